"""Agents: tool calls inside a rollout (docs/agents.md).

An episode is a completion of several turns: the model writes, its tool calls are run (lib/extras/tools.py), their
results are appended to the completion as the chat template renders a `tool` message, and the model goes on, until
a turn calls no tool, `max_tool_calling_iterations` turns have called one, or the completion budget is spent. The
tokens of the results are part of the completion (later turns read them: `Rollout.sequence_mask`) but not the
model's (`Rollout.completion_mask` is 0 there), so the trainer trains, regularises and counts only the model's.
`run_episodes` works over any sampler with the trainer's `generate` (the HF sampler and vLLM's).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn.utils.rnn import pad_sequence

from lib.config import ConfigError
from lib.extras.tools import (ResultRenderer, ToolWorker, plain_tool_prompt, template_has_tools, tool_schemas,
                              tool_spec, turn_tool_calls)
from lib.rollout import Rollout


@dataclass
class Episode:
    """One completion of several turns. ids: its tokens after the prompt; model: 1 for the model's tokens, 0 for
    the tool results'; logps: the sampler's log-probability of each model token (0 at tool tokens); temperatures:
    each token's sampling temperature (1 at tool tokens: never sampled, and it keeps the forward's division finite)."""

    ids: list[int] = field(default_factory=list)
    model: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    temperatures: list[float] = field(default_factory=list)
    calls: int = 0
    failures: int = 0
    turns: int = 0
    truncated: bool = False
    done: bool = False

    def add(self, ids: list[int], model: int, logps: list[float], temperatures: list[float]) -> None:
        self.ids += ids
        self.model += [model] * len(ids)
        self.logps += logps
        self.temperatures += temperatures


def engine_generate(engine, pad_token_id: int, sampling: dict, owner: torch.Tensor):
    """`run_episodes`' `generate` over a sampler with the trainer's interface (lib/rollout.HFRollout, vLLM's
    engines): each prompt left-padded, one completion each, at the batch's sampling settings `sampling` (a value
    given per prompt of the first turns, such as a controller's temperatures, is taken at each episode's prompt:
    `owner`, the first turns' prompt_index)."""
    def generate(prompts: list[list[int]], max_new_tokens: int, rows: list[int]) -> Rollout:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[row, width - len(p):] = 1
        index = owner[torch.tensor(rows, device=owner.device)]
        options = {k: v[index] if torch.is_tensor(v) and v.dim() == 1 else v for k, v in sampling.items()}
        return engine.generate(ids.to(owner.device), mask.to(owner.device), 1, max_new_tokens, **options)
    return generate


class Agent:
    """The episodes hook of lib/sampling.RolloutContext: a batch's first turns continued into episodes with the tools
    (`call`: lib/extras/tools.ToolWorker.call), and the batch's tool counters, TRL's `tools/call_frequency` (calls
    per completion) and `tools/failure_frequency` (failed calls per call)."""

    def __init__(self, tokenizer, call, max_iterations: int | None, max_completion_length: int,
                 schemas: list[dict] | None = None, worker: ToolWorker | None = None):
        self.tokenizer, self.call = tokenizer, call
        self.max_iterations, self.max_completion_length = max_iterations, max_completion_length
        self.schemas, self.worker = schemas or [], worker
        self.renderer = ResultRenderer(tokenizer)
        self.start_batch()

    @classmethod
    def from_config(cls, cfg, tokenizer) -> Agent | None:
        """The run's agent (`tools`), its worker started; None without tools. A tool that cannot be imported or
        described raises ValueError naming it, before any sampling."""
        if not cfg.tools:
            return None
        try:
            specs = [tool_spec(t) for t in cfg.tools]
            schemas = tool_schemas(specs)
        except ValueError as error:
            raise ConfigError(f"tools: {error}") from None
        worker = ToolWorker(specs, cfg.tool_timeout)
        worker.start()
        return cls(tokenizer, worker.call, cfg.max_tool_calling_iterations, cfg.max_completion_length, schemas,
                   worker)

    def prompt_settings(self, system_prompt: str | None, template_kwargs: dict | None) -> tuple:
        """The system prompt and the chat template's variables that give the model the tools: the template's own
        `tools` where it renders them, else the plain format's description after the system prompt."""
        if template_has_tools(self.tokenizer):
            return system_prompt, {**(template_kwargs or {}), "tools": self.schemas}
        text = plain_tool_prompt(self.schemas)
        return (f"{system_prompt}\n\n{text}" if system_prompt else text), template_kwargs

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()

    def start_batch(self) -> None:
        self.calls = self.failures = self.completions = 0

    def __call__(self, first: Rollout, engine, sampling: dict) -> Rollout:
        """The episodes that go on from the sampler `engine`'s first turns `first`, sampled at `sampling`, counted
        in the batch's tool counters."""
        rollout, episodes = self.run(first, engine, sampling)
        self.calls += sum(e.calls for e in episodes)
        self.failures += sum(e.failures for e in episodes)
        self.completions += len(episodes)
        return rollout

    def run(self, first: Rollout, engine, sampling: dict) -> tuple[Rollout, list[Episode]]:
        """The episodes as one Rollout, and each Episode (its calls, failures, turns), counted nowhere (an
        evaluation's: lib/evaluation.generate_and_score)."""
        generate = engine_generate(engine, self.tokenizer.pad_token_id, sampling, first.prompt_index)
        episodes = run_episodes(generate, first, self.tokenizer, self.call, self.renderer, self.max_iterations,
                                self.max_completion_length)
        return episodes_rollout(first, episodes, self.tokenizer.pad_token_id), episodes

    def counters(self, reduce_sum) -> dict[str, float]:
        calls, failures = reduce_sum(self.calls), reduce_sum(self.failures)
        return {"tools/call_frequency": calls / max(reduce_sum(self.completions), 1.0),
                "tools/failure_frequency": failures / calls if calls else 0.0}


def run_episodes(generate, first: Rollout, tokenizer, call, renderer: ResultRenderer, max_iterations: int | None,
                 max_completion_length: int) -> list[Episode]:
    """Go on from the first turns `first` (a Rollout from the sampler) until every episode ends.

    `generate(prompt_ids: list[list[int]], max_new_tokens: int, rows: list[int]) -> Rollout` samples one
    continuation of each prompt, those of episodes `rows` (`engine_generate`: the sampler at the batch's settings);
    `call(name, arguments) -> (text, failed)` runs one tool. An episode ends when
    a turn calls no tool, when `max_iterations` turns have called tools (TRL's max_tool_calling_iterations; None: no
    limit), or when its tokens reach `max_completion_length` (then it is truncated, as a one-turn completion is)."""
    eos = tokenizer.eos_token_id
    prompts = [row[m.bool()].tolist() for row, m in zip(first.prompt_ids, first.prompt_mask)]
    owner = first.prompt_index.tolist()
    episodes = [Episode() for _ in owner]
    turn, active, iteration = first, list(range(len(episodes))), 0
    while active:
        go_on = []
        limit_reached = max_iterations is not None and iteration >= max_iterations
        for k, i in enumerate(active):
            ep = episodes[i]
            # the new turn, cut to the episode's room (a call's budget is its longest episode's)
            room = max_completion_length - len(ep.ids)
            n = int(turn.completion_mask[k].sum())
            ids = turn.completion_ids[k, :min(n, room)].tolist()
            logps = turn.sampling_logps[k, :len(ids)].tolist() if turn.sampling_logps is not None else [0.0] * len(ids)
            ep.add(ids, 1, logps, turn.temperatures[k, :len(ids)].tolist())
            ep.turns += 1
            ep.truncated = bool(turn.is_truncated[k]) or n >= room
            if ep.truncated or limit_reached or ids[-1:] != [eos]:
                continue
            calls, errors = turn_tool_calls(tokenizer, ids, tokenizer.decode(ids, skip_special_tokens=True))
            if not calls and not errors:
                continue  # a turn that calls nothing ends the episode
            results = list(errors)
            for c in calls:
                text, failed = call(c.name, c.arguments)
                results.append(text)
                ep.failures += failed
            ep.calls += len(calls) + len(errors)
            ep.failures += len(errors)
            tool_ids = renderer.ids(results)
            kept = tool_ids[:max_completion_length - len(ep.ids)]
            ep.add(kept, 0, [0.0] * len(kept), [1.0] * len(kept))
            if len(kept) < len(tool_ids) or len(ep.ids) >= max_completion_length:
                ep.truncated = True  # no room left for the model to read the result and answer
                continue
            go_on.append(i)
        for i in set(active) - set(go_on):
            episodes[i].done = True
        active = go_on
        if active:
            iteration += 1
            room = max(max_completion_length - len(episodes[i].ids) for i in active)
            turn = generate([prompts[owner[i]] + episodes[i].ids for i in active], room, active)
    return episodes


def episodes_rollout(first: Rollout, episodes: list[Episode], pad_token_id: int) -> Rollout:
    """The episodes as one Rollout: completion_ids (B, T) every token of each episode; completion_mask (B, T) its
    model tokens (what the trainer trains, regularises and counts); sequence_mask (B, T) all of its tokens (what the
    policy reads); sampling_logps 0 and temperatures 1 at tool tokens."""
    def padded(name: str, fill, dtype) -> torch.Tensor:
        return pad_sequence([torch.tensor(getattr(e, name), dtype=dtype) for e in episodes], batch_first=True,
                            padding_value=fill)

    ids, model = padded("ids", pad_token_id, torch.long), padded("model", 0, torch.long)
    logps, temperatures = padded("logps", 0.0, torch.float32), padded("temperatures", 0.0, torch.float32)
    sequence = pad_sequence([torch.ones(len(e.ids), dtype=torch.long) for e in episodes], batch_first=True)
    device = first.completion_ids.device
    return Rollout(first.prompt_ids, first.prompt_mask, ids.to(device), model.to(device),
                   torch.tensor([e.truncated for e in episodes], device=device),
                   temperatures.to(device=device, dtype=first.temperatures.dtype),
                   first.prompt_index, logps.to(device) if first.sampling_logps is not None else None,
                   sequence_mask=sequence.to(device))

