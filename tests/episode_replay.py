"""A run's samples recorded, episodes included, and replayed in a launch with another number of processes.

The trainer's sampler draws from one random stream per process (seed + rank), which no other process count
reproduces; tests/update_reference.ReplaySampler gives a launch the one-turn completions a recorded run sampled. With
tools (docs/agents.md 3) the episode loop calls the sampler again for each continuation, from the prompt, the turns
and the tool results so far, so here every call is recorded and answered by what it continues: the tokens of its
context (the prompt without padding, then the episode so far), each context's continuations in the order they were
sampled. Only the sampling is replaced: each process's tool worker, the tool calls and their results, the tool
counters' reduction, rewards, advantages, masks and the update run as in any launch (a continuation whose context
the record lacks, because a tool result or an episode's turns came out differently, stops the run with a KeyError).

Run as a script (`python tests/episode_replay.py RECORD.pt -- TRAINER_ARGS`, alone or under `accelerate launch`), it
trains replaying RECORD.pt and writes RECORD.pt-<rank>.json: the rows this process replayed.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import torch


class RecordingSampler:
    """The run's own sampler, each call's completions kept in `record` ({"pad": id, "calls": {context: [(ids,
    truncated, temperatures), ...]}}); every other attribute is the sampler's."""

    def __init__(self, engine, record: dict):
        self.engine, self.record = engine, record
        record.setdefault("pad", engine.pad_token_id)
        record.setdefault("calls", {})

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompt_ids, prompt_mask, num_generations, max_new_tokens, **kwargs):
        roll = self.engine.generate(prompt_ids, prompt_mask, num_generations, max_new_tokens, **kwargs)
        for i, p in enumerate(roll.prompt_index.tolist()):
            n = int(roll.completion_mask[i].sum())
            self.record["calls"].setdefault(context(prompt_ids[p], prompt_mask[p]), []).append(
                (roll.completion_ids[i, :n].cpu().clone(), bool(roll.is_truncated[i]),
                 roll.temperatures[i, :n].cpu().clone()))
        return roll


class ReplayingSampler:
    """Answers each call with the recorded continuations of its contexts, in their order (whole groups: a prompt's
    `num_generations` come from its own list)."""

    def __init__(self, record: dict):
        self.pad = record["pad"]
        self.calls = {key: list(rows) for key, rows in record["calls"].items()}
        self.replayed = 0

    def generate(self, prompt_ids, prompt_mask, num_generations, max_new_tokens, **_):
        from lib.sampling.rollout import Rollout

        counts = num_generations.tolist() if isinstance(num_generations, torch.Tensor) else \
            [num_generations] * prompt_ids.shape[0]
        rows, index = [], []
        for p, count in enumerate(counts):
            queue = self.calls[context(prompt_ids[p], prompt_mask[p])]
            assert len(queue) >= count, "the record holds fewer continuations of this context than asked for"
            rows += [queue.pop(0) for _ in range(count)]
            index += [p] * count
        self.replayed += len(rows)
        width = max(len(ids) for ids, _, _ in rows)
        ids = torch.full((len(rows), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        temps = torch.zeros((len(rows), width), dtype=torch.float32)
        for r, (row, _, t) in enumerate(rows):
            ids[r, :len(row)], mask[r, :len(row)], temps[r, :len(row)] = row, 1, t
        device = prompt_ids.device
        return Rollout(prompt_ids, prompt_mask, ids.to(device), mask.to(device),
                       torch.tensor([truncated for _, truncated, _ in rows], device=device), temps.to(device),
                       torch.tensor(index, device=device))

    def sync_weights(self, policy) -> None:
        """The samples are fixed: nothing to sync."""

    def sleep(self) -> None:
        pass

    def ready(self, policy) -> None:
        pass

    def close(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def context(ids: torch.Tensor, mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(ids[mask.bool()].tolist())


@contextmanager
def sampling_with(wrap):
    """While inside, train_agrpo's sampler is `wrap(the sampler it makes)`."""
    import train_agrpo

    make_sampler = train_agrpo.make_sampler
    train_agrpo.make_sampler = lambda *args, **kwargs: wrap(make_sampler(*args, **kwargs))
    try:
        yield
    finally:
        train_agrpo.make_sampler = make_sampler


if __name__ == "__main__":  # python tests/episode_replay.py RECORD.pt -- TRAINER_ARGS
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    split = sys.argv.index("--")
    record_path, argv = sys.argv[1], sys.argv[split + 1:]
    import train_agrpo

    sampler = ReplayingSampler(torch.load(record_path, weights_only=False))
    train_agrpo.make_sampler = lambda *args, **kwargs: sampler
    train_agrpo.main(argv)
    Path(f"{record_path}-{os.environ.get('RANK', '0')}.json").write_text(json.dumps({"replayed": sampler.replayed}))
