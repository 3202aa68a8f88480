"""What the sampling phases work with: the prompts of a generation batch, the batch as sampled and scored, and the
context (engine, data, reward functions, process group) through which a method's refill rule and controllers sample and
score again (lib/methods/registry.py; docs/methods.md 6.1)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch
from accelerate.utils import gather_object

from lib.data.records import prompts_for_step, render_prompt, tokenize_prompts
from lib.methods.losses import weighted_rewards
from lib.rewards.scoring import RewardState, is_conversational, reward_arguments, score_completions
from lib.sampling.rollout import Rollout, replace_completions


@dataclass
class Prompts:
    """The prompts of one generation batch, and the share of them this process samples for.

    slots: record index of every prompt of the generation batch, in global order (P entries).
    used: (P_local,) the global indices of the prompts this process samples for (its completions are a contiguous
      share of the generation batch, so a prompt's group may be split between two processes).
    records, ids, mask: those prompts' records and left-padded token ids (P_local, Lp).
    counts: (P_local,) how many completions of each this process samples.
    sources, episodes: with an agent's environments, the records as the data set holds them (`records` then hold the
      text each environment's reset appended to the prompt) and each prompt's episodes opened for its first sampling.
    """

    slots: list[int]
    used: torch.Tensor
    records: list[dict]
    ids: torch.Tensor
    mask: torch.Tensor
    counts: torch.Tensor
    sources: list[dict] | None = None
    episodes: list[list[int]] | None = None


@dataclass
class Sampled:
    """A generation batch as sampled and scored (phases 1 and 2), before its advantages are computed.

    temperatures: (P_local,) the temperature each of this process's prompt groups was sampled at.
    scores: (B_local, K) each reward function's score of this process's completions; rewards: (B_global, K) every
    process's, gathered, in global completion order; total: (B_global,) the weighted sum.
    rounds: (P, G) total rewards of every sampling round of each prompt (adaGRPO pools their statistics), the first
    being the batch itself and later ones NaN for prompts that were not sampled again.
    counters: this batch's sampling events (probe / discarded / dropped tokens, rounds, replaced groups), logged once,
    on the step that sampled it.
    """

    prompts: Prompts
    temperatures: torch.Tensor  # (P_local,) the temperature each prompt's group was sampled at
    rollout: Rollout
    scores: torch.Tensor
    rewards: torch.Tensor
    total: torch.Tensor
    errors: dict[str, int]
    group_size: int
    data_position: int
    rounds: list[torch.Tensor]
    counters: dict[str, float] = field(default_factory=dict)
    reward_seconds: float = 0.0  # time spent in reward functions
    nonfinite: dict[str, int] = field(default_factory=dict)  # completions each function scored inf / -inf / NaN
    generation_seconds: float = 0.0  # time spent sampling (probes and refills included), rewards excepted
    weight_sync_seconds: float = 0.0  # the sampler getting the last batch's weights first (lib/setup.ready_sampler)
    controller_state: dict = field(default_factory=dict)  # the controllers' sampling side after this batch
    # (lib/methods/registry.Controller.sampling_state), which its training steps read


class RolloutContext:
    """The engine, the data, the reward functions and the process group, as the sampling parts need them."""

    def __init__(self, cfg, engine, tokenizer, reward_funcs, reward_weights: torch.Tensor, train_records: list[dict],
                 accelerator, answer_phase, local_rollout: int, first: int, worker=None, episodes=None):
        self.cfg, self.engine, self.tokenizer = cfg, engine, tokenizer
        self.reward_funcs, self.reward_weights = reward_funcs, reward_weights
        self.reward_names = [name for name, _ in reward_funcs]
        self.correct_index = (self.reward_names.index(cfg.correctness_reward)
                              if cfg.correctness_reward in self.reward_names else None)
        self.train_records, self.accelerator, self.answer_phase = train_records, accelerator, answer_phase
        self.local_rollout, self.first = local_rollout, first
        self.device = accelerator.device
        self.reward_seconds = 0.0  # time spent in reward functions, reported apart from generation
        # lib.rewards.worker.RewardWorker (reward_timeout > 0), or None: called in this process
        self.worker = worker
        # lib.agents.episodes.Agent (tools, environment_factory): first turns continued into episodes; or
        # lib.agents.rollout_func.RolloutFunction (rollout_func), which samples in place of the engine; or None
        self.episodes = episodes
        self.nonfinite = dict.fromkeys(self.reward_names, 0)  # completions scored inf / -inf / NaN, this batch
        self.trainer_state = RewardState(0, cfg.max_steps, 0.0)  # the reward functions' `trainer_state`
        # the process group of the sampling side's collectives (rewards gathered, answers, counters): None, the
        # launch's; with max_staleness over several processes, the sampling thread's own (docs/async.md 6), so that
        # they never meet the training step's on one group
        self.group = None

    def start_batch(self, step: int = 0, data_position: int = 0) -> None:
        """Reset the per-batch tallies (reward time, non-finite rewards). `step` (optimizer steps done) and
        `data_position` (prompts drawn so far) are the progress the reward functions get as `trainer_state`."""
        self.reward_seconds = 0.0
        self.nonfinite = dict.fromkeys(self.reward_names, 0)
        if self.episodes is not None:
            self.episodes.start_batch()
        self.trainer_state = RewardState(step, self.cfg.max_steps, data_position / len(self.train_records))

    def prompt_text(self, record: dict) -> str:
        """The text the model is prompted with (lib/data/records.render_prompt: TRL's prompt as it is or through the chat
        template, or a math problem with the instruction), with an agent's tools (its row's environment's too)."""
        settings = (self.cfg.system_prompt, self.cfg.chat_template_kwargs)
        if self.episodes is not None:
            settings = self.episodes.prompt_settings(*settings, record)
        return render_prompt(self.tokenizer, record, self.cfg.instruction, *settings)

    def next_slots(self, position: int, count: int) -> list[int]:
        seed = self.cfg.seed if self.cfg.data_seed is None else self.cfg.data_seed
        return prompts_for_step(position, count, len(self.train_records), seed, self.cfg.shuffle_dataset)

    def prompts(self, slots: list[int], group_size: int) -> Prompts:
        local_slots = torch.arange(self.first, self.first + self.local_rollout) // group_size  # global prompt of each
        used = torch.unique(local_slots)
        records = [self.train_records[slots[s]] for s in used.tolist()]
        counts = torch.bincount(local_slots - used[0], minlength=len(used)).to(self.device)
        sources = episodes = None
        if self.episodes is not None and self.episodes.environments:  # each episode's environment, reset with its row
            sources = records
            records, episodes = self.episodes.open_groups(records, counts.tolist())
        ids, mask = tokenize_prompts(self.tokenizer, [self.prompt_text(r) for r in records],
                                     self.cfg.max_prompt_length, self.device)
        return Prompts(slots, used, records, ids, mask, counts, sources, episodes)

    def generate(self, prompts: Prompts, temperature, top_p: float, rows: torch.Tensor | None = None,
                 answer_phase: bool = True) -> Rollout:
        """Sample this process's completions of `prompts` (or of the prompt rows `rows` only): with the engine, or
        through the `episodes` hook (an agent's episodes go on from the engine's first turns; a rollout_func samples
        in the engine's place)."""
        sampling = dict(temperature=temperature, top_p=top_p, top_k=self.cfg.top_k,
                        answer_phase=self.answer_phase if answer_phase else None, min_p=self.cfg.min_p or 0.0,
                        repetition_penalty=self.cfg.repetition_penalty)
        if self.episodes is not None:
            return self.episodes.generate(self.engine, prompts, rows, sampling)
        take = slice(None) if rows is None else rows
        return self.engine.generate(prompts.ids[take], prompts.mask[take], prompts.counts[take],
                                    self.cfg.max_completion_length, **sampling)

    def sampling_counters(self) -> dict[str, float]:
        """This batch's sampling events that the sampler's hooks count, over every process (an agent's tool calls)."""
        return {} if self.episodes is None else self.episodes.counters(self.reduce_sum)

    def score(self, rollout: Rollout, records: list[dict]) -> tuple[torch.Tensor, dict[str, int], list[str]]:
        """Every reward function on a rollout's completions, called as TRL calls them (lib/rewards/scoring.py; prompts and
        completions as messages for a conversational record, as text otherwise): (B, K) rewards, error counts, decoded
        texts."""
        t0 = time.perf_counter()
        texts = self.tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
        index = rollout.prompt_index.tolist()
        owners = [records[i] for i in index]
        # each text prompt as rendered for the policy, once per prompt (a conversation is passed as its messages)
        rendered = {i: self.prompt_text(records[i]) for i in set(index) if not is_conversational(records[i])}
        prompts, completions, columns = reward_arguments(owners, [rendered.get(i) for i in index], texts)
        columns["completion_length"] = rollout.completion_mask.sum(1).tolist()  # the model's tokens
        columns.update(rollout.columns or {})  # what the sampler adds (an environment's get_reward)
        # every token of each completion (an episode's tool results too: its attended mask is a prefix)
        ids = [row[:n].tolist() for row, n in zip(rollout.completion_ids.cpu(), rollout.attended().sum(1).tolist())]
        nonfinite = {}
        per_func, errors = score_completions(self.reward_funcs, prompts, completions, columns,
                                             error_value=self.cfg.reward_error_value,
                                             call=self.worker.run if self.worker is not None else None,
                                             nonfinite=nonfinite, completion_ids=ids,
                                             trainer_state=self.trainer_state, records=owners)
        self.nonfinite = {n: self.nonfinite[n] + nonfinite[n] for n in self.reward_names}
        self.reward_seconds += time.perf_counter() - t0
        return torch.tensor(per_func, dtype=torch.float32, device=self.device).T, errors, texts

    def gather_rewards(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(every process's (B_global, K) rewards, their (B_global,) weighted totals)."""
        if self.group is None:
            rewards = self.accelerator.gather(scores)
        else:
            parts = [torch.empty_like(scores) for _ in range(torch.distributed.get_world_size(self.group))]
            torch.distributed.all_gather(parts, scores.contiguous(), group=self.group)
            rewards = torch.cat(parts)
        return rewards, weighted_rewards(rewards, self.reward_weights.to(rewards.device))

    def correct(self, rewards: torch.Tensor) -> torch.Tensor:
        """(B,) bool: the completions the correctness reward scores above 0."""
        return rewards[:, self.correct_index] > 0

    def sample_again(self, sampled: Sampled, flagged: torch.Tensor, temperature, top_p: float) -> tuple[Sampled, int]:
        """The groups of this process's prompt rows `flagged` (bool, P_local) sampled again, at `temperature` / `top_p`,
        in place of their completions, and scored (adaGRPO's retries, DAPO's dynamic sampling). Returns the new batch
        (its rewards not yet gathered) and the number of tokens the new completions replaced."""
        again = flagged.nonzero().squeeze(1)
        redo = self.generate(sampled.prompts, temperature, top_p, rows=again)
        rows = flagged[sampled.rollout.prompt_index].nonzero().squeeze(1)
        replaced_tokens = int(sampled.rollout.completion_mask[rows].sum())
        rollout = replace_completions(sampled.rollout, rows, redo, self.tokenizer.pad_token_id)
        redo_scores, redo_errors, _ = self.score(redo, [sampled.prompts.records[i] for i in again.tolist()])
        scores = sampled.scores.clone()
        scores[rows] = redo_scores
        errors = {n: sampled.errors[n] + redo_errors[n] for n in sampled.errors}
        return dataclasses.replace(sampled, rollout=rollout, scores=scores, errors=errors), replaced_tokens

    def gather_object(self, values: list) -> list:
        """Every process's `values`, one list in rank order."""
        if self.group is None:
            return gather_object(values)
        parts = [None] * torch.distributed.get_world_size(self.group)
        torch.distributed.all_gather_object(parts, values, group=self.group)
        return [value for part in parts for value in part]

    def reduce_sum(self, value: float) -> float:
        total = torch.tensor(float(value), device=self.device)
        if self.group is None:
            return float(self.accelerator.reduce(total, reduction="sum"))
        torch.distributed.all_reduce(total, group=self.group)
        return float(total)
