"""rollout_func, as TRL 1.16's GRPOTrainer takes it (docs/agents.md 8): a user's function samples a batch's
completions in place of the trainer's sampler.

    rollout_func(prompts: list, trainer) -> {"prompt_ids": [[int]], "completion_ids": [[int]], "logprobs": [[float]]
                                             | None, "env_mask": [[0 | 1]] (optional), <any other key>: [value] | value}

`prompts` are this process's prompts as the data set holds them (TRL's `prompt`: text or messages; a math problem as
the user message `problem + "\\n" + instruction`, after the system prompt if one is set), once per completion (a
prompt's completions in a row, as TRL's repeated batch has them), not rendered: the function applies the chat
template itself (`trainer.processing_class`). It returns one entry per prompt: the prompt's tokens, the completion's,
the sampler's log-probability of each completion token (or None: no importance-sampling correction), and optionally
`env_mask`, 1 at the model's tokens and 0 at tokens the environment wrote (not trained, read by later tokens, as an
agent's tool results). Every other key reaches the reward functions as a keyword argument: a list is one value per
completion, anything else the same value for all (TRL's rule).

It sits behind lib/sampling/context.RolloutContext's `episodes` hook, as lib/agents/episodes.Agent does: RolloutContext.generate
calls the hook's `generate`, which here calls the function instead of the sampler; the training loop has no branch of
its own.
"""

from __future__ import annotations

import copy

import torch
from torch.nn.utils.rnn import pad_sequence

from lib.config import ConfigError
from lib.agents.episodes import engine_generate
from lib.models.reward_models import prompt_messages
from lib.agents.tools import load_tool
from lib.sampling.rollout import Rollout

REQUIRED = ("prompt_ids", "completion_ids", "logprobs")


class RolloutTrainer:
    """What the function gets as `trainer`: TRL's names where this trainer has the thing (`args`: the Config,
    `processing_class`: the tokenizer, `num_generations`, `accelerator`), and `generate(prompt_ids)`, the trainer's
    own sampler: one completion of each prompt (token ids), the i-th at the batch's settings of the i-th prompt the
    function was given, returning (completion ids, their log-probabilities or None)."""

    def __init__(self, cfg, tokenizer, accelerator, engine, sampling: dict, owner: torch.Tensor):
        self.args, self.processing_class, self.accelerator = cfg, tokenizer, accelerator
        self.num_generations = cfg.num_generations
        self._generate = engine_generate(engine, tokenizer.pad_token_id, sampling, owner)
        self._size = len(owner)

    def generate(self, prompt_ids: list[list[int]], max_new_tokens: int | None = None):
        if len(prompt_ids) != self._size:
            raise ValueError(f"trainer.generate samples one completion of each of the {self._size} prompts the "
                             f"rollout function was given; got {len(prompt_ids)} prompt(s)")
        roll = self._generate([list(p) for p in prompt_ids], max_new_tokens or self.args.max_completion_length,
                              list(range(self._size)))
        lengths = roll.completion_mask.sum(1).tolist()
        ids = [row[:n].tolist() for row, n in zip(roll.completion_ids, lengths)]
        logps = None if roll.sampling_logps is None else [row[:n].tolist()
                                                          for row, n in zip(roll.sampling_logps, lengths)]
        return ids, logps


class RolloutFunction:
    """The `episodes` hook of lib/sampling/context.RolloutContext that replaces its sampling with the user's function."""

    environments: dict = {}  # no environments: prompts render as without the hook

    def __init__(self, func, cfg, tokenizer, accelerator):
        self.func, self.cfg, self.tokenizer, self.accelerator = func, cfg, tokenizer, accelerator
        self.end_ids = {tokenizer.eos_token_id, tokenizer.pad_token_id}

    @classmethod
    def from_config(cls, cfg, tokenizer, accelerator) -> RolloutFunction | None:
        """The run's rollout function (`rollout_func`), or None. ConfigError naming the key for a spec that does not
        name a function (lib/config.validate refuses tools / environment_factory beside it)."""
        if not cfg.rollout_func:
            return None
        try:
            func = load_tool(cfg.rollout_func, "rollout_func") if isinstance(cfg.rollout_func, str) else cfg.rollout_func
        except ValueError as error:
            raise ConfigError(f"rollout_func: {error}") from None
        return cls(func, cfg, tokenizer, accelerator)

    def prompt_settings(self, system_prompt, template_kwargs, record=None) -> tuple:
        return system_prompt, template_kwargs

    def start_batch(self) -> None:
        pass

    def counters(self, reduce_sum) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass

    def prompt_of(self, record: dict):
        """A record's prompt as TRL passes it: the data set's `prompt`, or a math problem's messages."""
        if "prompt" in record:
            return copy.deepcopy(record["prompt"])
        return prompt_messages(record["problem"], self.cfg.instruction, self.cfg.system_prompt)

    def generate(self, engine, prompts, rows: torch.Tensor | None, sampling: dict) -> Rollout:
        """The completions of lib/sampling/context.Prompts `prompts` (of its rows `rows`, or all), counts[i] of the i-th, from
        the function, as a Rollout: lib/sampling/context.RolloutContext.generate's hook."""
        records = prompts.records if rows is None else [prompts.records[i] for i in rows.tolist()]
        counts = (prompts.counts if rows is None else prompts.counts[rows]).tolist()
        owner = torch.repeat_interleave(torch.arange(len(records)), torch.tensor(counts))
        prompts = [self.prompt_of(records[i]) for i in owner.tolist()]
        trainer = RolloutTrainer(self.cfg, self.tokenizer, self.accelerator, engine, sampling,
                                 owner.to(self.accelerator.device))
        out = self.func(prompts, trainer)
        return self.to_rollout(out, owner, sampling)

    def to_rollout(self, out, owner: torch.Tensor, sampling: dict) -> Rollout:
        """The function's answer as the trainer's Rollout; ValueError naming rollout_func and the fix for an answer
        that breaks TRL's contract."""
        if not isinstance(out, dict):
            raise ValueError(f"rollout_func must return a dict with {', '.join(REQUIRED)}; got a {type(out).__name__}")
        missing = [k for k in REQUIRED if k not in out]
        if missing:
            raise ValueError(f"rollout_func must return keys {missing} in its output dict")
        n = len(owner)
        for key in ("prompt_ids", "completion_ids", "env_mask") + (("logprobs",) if out["logprobs"] is not None
                                                                   else ()):
            if key in out and len(out[key]) != n:
                raise ValueError(f"rollout_func returned {len(out[key])} {key} for {n} prompts; it returns one "
                                 "completion per prompt it is given (a prompt comes once per completion)")
        rows = owner.tolist()
        prompt_rows: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            ids = list(out["prompt_ids"][i])
            if prompt_rows.setdefault(row, ids) != ids:
                raise ValueError("rollout_func returned different prompt_ids for completions of the same prompt; this "
                                 "trainer keeps one prompt per group (GRPO compares its completions): render each "
                                 "prompt the same way")
        device, limit = self.accelerator.device, self.cfg.max_completion_length
        temperature = sampling.get("temperature", self.cfg.temperature)
        ids, model, temps, logps, truncated = [], [], [], [], []
        for i, row in enumerate(rows):
            completion = list(out["completion_ids"][i])[:limit]
            mask = list(out["env_mask"][i])[:len(completion)] if "env_mask" in out else [1] * len(completion)
            if len(mask) != len(completion):
                raise ValueError(f"rollout_func's env_mask {i} has {len(mask)} values for {len(completion)} tokens")
            t = float(temperature[row]) if torch.is_tensor(temperature) and temperature.dim() else float(temperature)
            ids.append(torch.tensor(completion, dtype=torch.long))
            model.append(torch.tensor(mask, dtype=torch.long))
            temps.append(torch.tensor([t if m else 1.0 for m in mask], dtype=torch.float32))
            if out["logprobs"] is not None:
                values = list(out["logprobs"][i])[:len(completion)]
                logps.append(torch.tensor([0.0 if v is None or not m else float(v) for v, m in zip(values, mask)],
                                          dtype=torch.float32))
            truncated.append(len(out["completion_ids"][i]) > limit or not completion
                             or completion[-1] not in self.end_ids)
        pad = self.tokenizer.pad_token_id
        prompt_list = [torch.tensor(prompt_rows[r], dtype=torch.long) for r in range(len(prompt_rows))]
        width = max(len(p) for p in prompt_list)
        prompt_ids = torch.full((len(prompt_list), width), pad, dtype=torch.long)
        prompt_mask = torch.zeros_like(prompt_ids)
        for r, p in enumerate(prompt_list):  # left-padded, as the sampler's
            prompt_ids[r, width - len(p):], prompt_mask[r, width - len(p):] = p, 1
        sequence = pad_sequence([torch.ones(len(c), dtype=torch.long) for c in ids], batch_first=True)
        completion_mask = pad_sequence(model, batch_first=True)
        columns = {k: list(v) if isinstance(v, list) else [v] * n for k, v in out.items()
                   if k not in REQUIRED and k != "env_mask"}
        for key, values in columns.items():
            if len(values) != n:
                raise ValueError(f"rollout_func's {key!r} has {len(values)} values for {n} completions")
        return Rollout(prompt_ids.to(device), prompt_mask.to(device),
                       pad_sequence(ids, batch_first=True, padding_value=pad).to(device), completion_mask.to(device),
                       torch.tensor(truncated, device=device), pad_sequence(temps, batch_first=True).to(device),
                       owner.to(device), pad_sequence(logps, batch_first=True).to(device) if logps else None,
                       sequence_mask=sequence.to(device) if "env_mask" in out else None, columns=columns or None)
