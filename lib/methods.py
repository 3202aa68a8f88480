"""A method's parts, chosen once before the training loop: how a generation batch is refilled, the advantage rule
and the controllers.

Every method (docs/methods.md section 9) is GRPO plus some of the parts below. `choose_method(cfg)` picks them from
the configuration, so the loop in train_agrpo.py calls the same hooks whatever the method and never asks which one
it runs (docs/methods.md 6.1):

    refill        after scoring: nothing (GRPO), DAPO's dynamic sampling (a group whose answers are all right or all
                  wrong gives way to the next prompt), or adaGRPO's retries (a group with no correct answer is
                  sampled again with the next retry's parameters)       (NoRefill, DynamicSampling, RetryUntilCorrect)
    advantages    lib/losses.group_advantages with the method's options
    controllers   the group size and each prompt's temperature before sampling (A-GRPO's adaptive group size,
                  AGPO-DSF's probe groups), the values each optimizer step trains with (beta, epsilon) and how they
                  move with what the step measured (KLController, GroupSizeController, DSFController)

The pure state transitions live in lib/controllers.py; the objects here hold a state, call those transitions at
fixed hooks, and save / restore the state with every checkpoint. Each hook's docstring says when the loop calls it.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from functools import partial

import torch
from accelerate.utils import gather_object

from lib import controllers
from lib.data import prompts_for_step, render_prompt, tokenize_prompts
from lib.losses import dispersion, group_advantages, group_skewness, weighted_rewards
from lib.rewards import RewardState, extract_answer, is_conversational, reward_arguments, score_completions
from lib.rollout import Rollout, replace_completions

# ---------------------------------------------------------------------------------------------------------------------
# What the sampling parts work with


@dataclass
class Prompts:
    """The prompts of one generation batch, and the share of them this process samples for.

    slots: record index of every prompt of the generation batch, in global order (P entries).
    used: (P_local,) the global indices of the prompts this process samples for (its completions are a contiguous
      share of the generation batch, so a prompt's group may be split between two processes).
    records, ids, mask: those prompts' records and left-padded token ids (P_local, Lp).
    counts: (P_local,) how many completions of each this process samples.
    """

    slots: list[int]
    used: torch.Tensor
    records: list[dict]
    ids: torch.Tensor
    mask: torch.Tensor
    counts: torch.Tensor


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


class RolloutContext:
    """The engine, the data, the reward functions and the process group, as the sampling parts need them."""

    def __init__(self, cfg, engine, tokenizer, reward_funcs, reward_weights: torch.Tensor, train_records: list[dict],
                 accelerator, answer_phase, local_rollout: int, first: int, worker=None):
        self.cfg, self.engine, self.tokenizer = cfg, engine, tokenizer
        self.reward_funcs, self.reward_weights = reward_funcs, reward_weights
        self.reward_names = [name for name, _ in reward_funcs]
        self.correct_index = (self.reward_names.index(cfg.correctness_reward)
                              if cfg.correctness_reward in self.reward_names else None)
        self.train_records, self.accelerator, self.answer_phase = train_records, accelerator, answer_phase
        self.local_rollout, self.first = local_rollout, first
        self.device = accelerator.device
        self.reward_seconds = 0.0  # time spent in reward functions, reported apart from generation
        self.worker = worker  # lib.extras.reward_worker.RewardWorker (reward_timeout > 0), or None: called in this process
        self.nonfinite = dict.fromkeys(self.reward_names, 0)  # completions scored inf / -inf / NaN, this batch
        self.trainer_state = RewardState(0, cfg.max_steps, 0.0)  # the reward functions' `trainer_state`

    def start_batch(self, step: int = 0, data_position: int = 0) -> None:
        """Reset the per-batch tallies (reward time, non-finite rewards). `step` (optimizer steps done) and
        `data_position` (prompts drawn so far) are the progress the reward functions get as `trainer_state`."""
        self.reward_seconds = 0.0
        self.nonfinite = dict.fromkeys(self.reward_names, 0)
        self.trainer_state = RewardState(step, self.cfg.max_steps, data_position / len(self.train_records))

    def prompt_text(self, record: dict) -> str:
        """The text the model is prompted with (lib/data.render_prompt: TRL's prompt as it is or through the chat
        template, or a math problem with the instruction)."""
        return render_prompt(self.tokenizer, record, self.cfg.instruction, self.cfg.system_prompt,
                             self.cfg.chat_template_kwargs)

    def next_slots(self, position: int, count: int) -> list[int]:
        seed = self.cfg.seed if self.cfg.data_seed is None else self.cfg.data_seed
        return prompts_for_step(position, count, len(self.train_records), seed, self.cfg.shuffle_dataset)

    def prompts(self, slots: list[int], group_size: int) -> Prompts:
        local_slots = torch.arange(self.first, self.first + self.local_rollout) // group_size  # global prompt of each
        used = torch.unique(local_slots)
        records = [self.train_records[slots[s]] for s in used.tolist()]
        counts = torch.bincount(local_slots - used[0], minlength=len(used)).to(self.device)
        ids, mask = tokenize_prompts(self.tokenizer, [self.prompt_text(r) for r in records],
                                     self.cfg.max_prompt_length, self.device)
        return Prompts(slots, used, records, ids, mask, counts)

    def generate(self, prompts: Prompts, temperature, top_p: float, rows: torch.Tensor | None = None,
                 answer_phase: bool = True) -> Rollout:
        """Sample this process's completions of `prompts` (or of the prompt rows `rows` only)."""
        ids, mask, counts = prompts.ids, prompts.mask, prompts.counts
        if rows is not None:
            ids, mask, counts = ids[rows], mask[rows], counts[rows]
        return self.engine.generate(ids, mask, counts, self.cfg.max_completion_length, temperature=temperature,
                                    top_p=top_p, top_k=self.cfg.top_k,
                                    answer_phase=self.answer_phase if answer_phase else None,
                                    min_p=self.cfg.min_p or 0.0, repetition_penalty=self.cfg.repetition_penalty)

    def score(self, rollout: Rollout, records: list[dict]) -> tuple[torch.Tensor, dict[str, int], list[str]]:
        """Every reward function on a rollout's completions, called as TRL calls them (lib/rewards.py; prompts and
        completions as messages for a conversational record, as text otherwise): (B, K) rewards, error counts,
        decoded texts."""
        t0 = time.perf_counter()
        texts = self.tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
        index = rollout.prompt_index.tolist()
        owners = [records[i] for i in index]
        # each text prompt as rendered for the policy, once per prompt (a conversation is passed as its messages)
        rendered = {i: self.prompt_text(records[i]) for i in set(index) if not is_conversational(records[i])}
        prompts, completions, columns, model_prompts = reward_arguments(
            owners, [rendered.get(i) for i in index], texts, instruction=self.cfg.instruction,
            system_prompt=self.cfg.system_prompt)
        lengths = rollout.completion_mask.sum(1).tolist()
        columns["completion_length"] = lengths  # tokens, for length-based rewards
        ids = [row[:n].tolist() for row, n in zip(rollout.completion_ids.cpu(), lengths)]  # the mask is a prefix
        nonfinite = {}
        per_func, errors = score_completions(self.reward_funcs, prompts, completions, columns,
                                             error_value=self.cfg.reward_error_value,
                                             call=self.worker.run if self.worker is not None else None,
                                             nonfinite=nonfinite, completion_ids=ids,
                                             trainer_state=self.trainer_state, model_prompts=model_prompts)
        self.nonfinite = {n: self.nonfinite[n] + nonfinite[n] for n in self.reward_names}
        self.reward_seconds += time.perf_counter() - t0
        return torch.tensor(per_func, dtype=torch.float32, device=self.device).T, errors, texts

    def gather_rewards(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(every process's (B_global, K) rewards, their (B_global,) weighted totals)."""
        rewards = self.accelerator.gather(scores)
        return rewards, weighted_rewards(rewards, self.reward_weights.to(rewards.device))

    def correct(self, rewards: torch.Tensor) -> torch.Tensor:
        """(B,) bool: the completions the correctness reward scores above 0."""
        return rewards[:, self.correct_index] > 0

    def sample_again(self, sampled: Sampled, flagged: torch.Tensor, temperature, top_p: float) -> tuple[Sampled, int]:
        """The groups of this process's prompt rows `flagged` (bool, P_local) sampled again, at `temperature` /
        `top_p`, in place of their completions, and scored (adaGRPO's retries, DAPO's dynamic sampling). Returns the
        new batch (its rewards not yet gathered) and the number of tokens the new completions replaced."""
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
        return gather_object(values)

    def reduce_sum(self, value: float) -> float:
        return float(self.accelerator.reduce(torch.tensor(float(value), device=self.device), reduction="sum"))


# ---------------------------------------------------------------------------------------------------------------------
# Refill rules: after the batch is scored, sample again the groups that carry no signal


class NoRefill:
    """GRPO: the batch is trained on as sampled."""

    def __call__(self, ctx: RolloutContext, sampled: Sampled, step: int) -> Sampled:
        return sampled



class DynamicSampling:
    """DAPO's dynamic sampling (arXiv 2503.14476, eq. 11's constraint 0 < #correct < G; docs/methods.md 1.3).

    A group whose answers are all right or all wrong has no signal, so its prompt gives way to the next prompt in the
    data order, sampled in its place, for at most `rounds` rounds; groups still flat after the last round stay (zero
    advantage). The judge is the gathered correctness, so every process agrees. verl over-samples 3x instead; here
    each round samples only the flat groups' slots.
    """

    def __init__(self, rounds: int):
        self.rounds = rounds

    def __call__(self, ctx: RolloutContext, sampled: Sampled, step: int) -> Sampled:
        num_prompts, group_size = len(sampled.prompts.slots), sampled.group_size
        replaced_groups, rounds, dropped = 0, 0, 0
        for _ in range(self.rounds):
            right = ctx.correct(sampled.rewards).view(num_prompts, group_size)
            flat = right.all(1) | ~right.any(1)
            if not bool(flat.any()):
                break
            rounds += 1
            replaced_groups += int(flat.sum())
            slots = list(sampled.prompts.slots)
            fresh = ctx.next_slots(sampled.data_position, int(flat.sum()))
            for slot, new_slot in zip(flat.nonzero().squeeze(1).tolist(), fresh):
                slots[slot] = new_slot
            sampled = dataclasses.replace(sampled, data_position=sampled.data_position + len(fresh))
            local_flat = flat[sampled.prompts.used]
            if bool(local_flat.any()):
                prompts = ctx.prompts(slots, group_size)
                rollout = dataclasses.replace(sampled.rollout, prompt_ids=prompts.ids, prompt_mask=prompts.mask)
                sampled = dataclasses.replace(sampled, prompts=prompts, rollout=rollout)
                sampled, replaced = ctx.sample_again(sampled, local_flat, sampled.temperatures[local_flat],
                                                     ctx.cfg.top_p)
                dropped += replaced  # the dropped groups' tokens
            else:  # none of the new prompts is sampled here; the slot list still follows
                sampled = dataclasses.replace(sampled, prompts=dataclasses.replace(sampled.prompts, slots=slots))
            rewards, total = ctx.gather_rewards(sampled.scores)
            sampled = dataclasses.replace(sampled, rewards=rewards, total=total)
        counters = {"dynamic_sampling/rounds": rounds, "dynamic_sampling/replaced_groups": replaced_groups,
                    "num_tokens/filtered": ctx.reduce_sum(dropped)}
        return dataclasses.replace(sampled, rounds=[sampled.total.view(num_prompts, group_size)],
                                   counters={**sampled.counters, **counters})


class RetryUntilCorrect:
    """adaGRPO's retries (docs/methods.md 4.1-4.2): a prompt none of whose completions is correct is sampled again
    with the next retry's temperature / top_p (the schedule in force at this step), while retries are left. The judge
    sees every process's rewards, so all agree. The last group is trained on, with the reward statistics of the
    advantage pooled over all of the prompt's rounds."""

    def __init__(self, schedule: list[dict]):
        self.schedule = schedule

    def __call__(self, ctx: RolloutContext, sampled: Sampled, step: int) -> Sampled:
        num_prompts, group_size = len(sampled.prompts.slots), sampled.group_size
        rounds = [sampled.total.view(num_prompts, group_size)]
        resampled_prompts, discarded = 0, 0
        for retry in controllers.resample_plan(self.schedule, step + 1, ctx.cfg.temperature, ctx.cfg.top_p):
            failing = ~ctx.correct(sampled.rewards).view(num_prompts, group_size).any(1)
            if not bool(failing.any()):
                break
            resampled_prompts += int(failing.sum())
            local_failing = failing[sampled.prompts.used]
            if bool(local_failing.any()):
                sampled, replaced = ctx.sample_again(sampled, local_failing, retry["temperature"], retry["top_p"])
                discarded += replaced  # the discarded round's tokens
            rewards, total = ctx.gather_rewards(sampled.scores)
            sampled = dataclasses.replace(sampled, rewards=rewards, total=total)
            rounds.append(torch.where(failing[:, None], total.view(num_prompts, group_size), torch.nan))
        counters = {"resample_rounds": len(rounds) - 1, "resampled_prompts": resampled_prompts,
                    "num_tokens/resampled": ctx.reduce_sum(discarded)}
        return dataclasses.replace(sampled, rounds=rounds, counters={**sampled.counters, **counters})


# ---------------------------------------------------------------------------------------------------------------------
# Controllers: the values a step trains with, and how they move


@dataclass(frozen=True)
class TrainValues:
    """What one optimizer step trains with: the KL weight and the clip range (a float, or one value per completion
    of this process's share of the generation batch)."""

    beta: float
    epsilon_low: float | torch.Tensor
    epsilon_high: float | torch.Tensor


class Controller:
    """The hooks a controller may use, in the order the loop calls them; here each changes nothing."""

    name = ""

    def group_size(self, size: int) -> int:
        """Before sampling: the group size of the next generation batch."""
        return size

    def prompt_temperatures(self, ctx: RolloutContext, prompts: Prompts, group_size: int,
                            temperatures: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Before sampling: each prompt's temperature (P_local,), and counters of the work it took."""
        return temperatures, {}

    def batch_values(self, entropies, prompt_of_row: torch.Tensor) -> None:
        """Once a generation batch's old log-probs are known: per-batch values. `entropies()` gives the policy's
        token-mean entropy per prompt group; `prompt_of_row` (B_local,) the global prompt of each completion."""

    def step_values(self, values: TrainValues) -> TrainValues:
        """Before each optimizer step: the values it trains with."""
        return values

    def after_step(self, kl: float) -> None:
        """After each optimizer step, with the token-mean KL to the reference that it measured."""

    def after_batch(self, frac_reward_zero_std: float, step_drift) -> None:
        """After the last optimizer step on a generation batch. `step_drift()` measures KL(pi_old || pi_new) of
        the batch's updates per prompt group (an extra forward pass, so only a controller that needs it calls it)."""

    def metrics(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class KLController(Controller):
    """A-GRPO's beta_t and epsilon_t from a moving average of the KL (docs/methods.md 2.2). The values a step trains
    with are read from the state before every step, so with several steps per generation batch none is stale."""

    name = "kl"

    def __init__(self, cfg):
        self.cfg, self.state = cfg, controllers.init_kl_controller(cfg)

    def step_values(self, values: TrainValues) -> TrainValues:
        # epsilon_high follows epsilon_low's relative change, so an asymmetric (clip-higher) range keeps its shape
        scale = self.state.epsilon / self.cfg.epsilon if self.cfg.epsilon > 0 else 1.0
        return TrainValues(self.state.beta, self.state.epsilon, values.epsilon_high * scale)

    def after_step(self, kl: float) -> None:
        self.state = controllers.update_kl_controller(self.state, kl, self.cfg)

    def metrics(self) -> dict[str, float]:
        return {"kl_ema": self.state.kl_ema, "next_beta": self.state.beta, "next_epsilon": self.state.epsilon}

    def state_dict(self) -> dict:
        return controllers.to_dict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = controllers.from_dict(controllers.KLControllerState, state)


class GroupSizeController(Controller):
    """A-GRPO's adaptive group size (docs/methods.md 2.2): G doubles while many groups have no reward spread."""

    name = "group_size"

    def __init__(self, cfg):
        self.cfg, self.state = cfg, controllers.init_group_size(cfg)

    def group_size(self, size: int) -> int:
        return self.state.num_generations

    def after_batch(self, frac_reward_zero_std: float, step_drift) -> None:
        self.state = controllers.update_group_size(self.state, frac_reward_zero_std, self.cfg)

    def metrics(self) -> dict[str, float]:
        return {"zero_std_ema": self.state.zero_std_ema, "next_num_generations": self.state.num_generations}

    def state_dict(self) -> dict:
        return controllers.to_dict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = controllers.from_dict(controllers.GroupSizeState, state)


class DSFController(Controller):
    """AGPO-DSF (docs/methods.md 5.1): a probe group per prompt, sampled at the base temperature, scored and never
    trained on; its reward spread, answer vote entropy and skewness set the prompt's training temperature, and with
    the policy's entropy and the last batch's step KL, the group's clip range."""

    name = "dsf"

    def __init__(self, cfg):
        self.cfg, self.state = cfg, controllers.DSFState()
        self.probe: dict[str, list[float]] = {}
        self.ranges: torch.Tensor | None = None

    def prompt_temperatures(self, ctx: RolloutContext, prompts: Prompts, group_size: int,
                            temperatures: torch.Tensor) -> tuple[torch.Tensor, dict]:
        cfg = self.cfg
        probe = ctx.generate(prompts, cfg.temperature, cfg.top_p, answer_phase=False)
        scores, _, texts = ctx.score(probe, prompts.records)
        _, total = ctx.gather_rewards(scores)
        total = total.view(len(prompts.slots), group_size)
        keys = ctx.gather_object([extract_answer(t) or t.strip() for t in texts])
        # the probe's spread is the plain robust statistic: the fall-back to the std for a robust spread of 0 is for
        # the training advantages only, as in the AGPO-DSF code (docs/methods.md 5.1, step 1 against step 3)
        self.probe = {"dispersion": dispersion(total, cfg.reward_dispersion, dim=1, fallback_to_std=False).tolist(),
                      "vote": [controllers.vote_entropy(keys[p * group_size: (p + 1) * group_size])
                               for p in range(len(prompts.slots))],
                      "skewness": group_skewness(total).tolist()}
        uncertainty = [controllers.dsf_uncertainty(s, v, k, cfg) for s, v, k in
                       zip(self.probe["dispersion"], self.probe["vote"], self.probe["skewness"])]
        self.state, taus, _ = controllers.dsf_temperatures(self.state, uncertainty, cfg)
        return torch.tensor(taus, device=temperatures.device)[prompts.used.to(temperatures.device)], {
            "num_tokens/probe": ctx.reduce_sum(probe.completion_mask.sum())}

    def batch_values(self, entropies, prompt_of_row: torch.Tensor) -> None:
        self.state, ranges = controllers.dsf_clip_ranges(self.state, entropies(), self.probe["dispersion"],
                                                         self.probe["vote"], self.probe["skewness"], self.cfg)
        self.ranges = torch.tensor(ranges, device=prompt_of_row.device)[prompt_of_row]

    def step_values(self, values: TrainValues) -> TrainValues:
        return TrainValues(values.beta, self.ranges, self.ranges)

    def after_batch(self, frac_reward_zero_std: float, step_drift) -> None:
        drift = step_drift()  # per group; negative values (noise) clamped, as the AGPO-DSF code does
        self.state = controllers.update_step_kl(self.state, sum(max(d, 0.0) for d in drift) / len(drift), self.cfg)

    def metrics(self) -> dict[str, float]:
        return {"entropy_ref": self.state.entropy_ref, "uncertainty_baseline": self.state.uncertainty_baseline,
                "step_kl_ema": self.state.step_kl_ema,
                "epsilon/group_min": float(self.ranges.min()), "epsilon/group_max": float(self.ranges.max()),
                "vote_entropy": sum(self.probe["vote"]) / len(self.probe["vote"]),
                "probe_reward_std": sum(self.probe["dispersion"]) / len(self.probe["dispersion"])}

    def state_dict(self) -> dict:
        return controllers.to_dict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = controllers.from_dict(controllers.DSFState, state)


class Controllers:
    """The run's controllers, called in a fixed order (A-GRPO's KL, group size, AGPO-DSF); none for plain GRPO."""

    def __init__(self, parts: list[Controller]):
        self.parts = parts

    def group_size(self, size: int) -> int:
        for part in self.parts:
            size = part.group_size(size)
        return size

    def prompt_temperatures(self, ctx, prompts, group_size, temperatures):
        counters = {}
        for part in self.parts:
            temperatures, more = part.prompt_temperatures(ctx, prompts, group_size, temperatures)
            counters.update(more)
        return temperatures, counters

    def batch_values(self, entropies, prompt_of_row) -> None:
        for part in self.parts:
            part.batch_values(entropies, prompt_of_row)

    def step_values(self, values: TrainValues) -> TrainValues:
        for part in self.parts:
            values = part.step_values(values)
        return values

    def after_step(self, kl: float) -> None:
        for part in self.parts:
            part.after_step(kl)

    def after_batch(self, frac_reward_zero_std: float, step_drift) -> None:
        for part in self.parts:
            part.after_batch(frac_reward_zero_std, step_drift)

    def metrics(self) -> dict[str, float]:
        return {k: v for part in self.parts for k, v in part.metrics().items()}

    def state_dict(self) -> dict:
        return {part.name: part.state_dict() for part in self.parts}

    def load_state_dict(self, state: dict) -> None:
        """A resumed run continues with exactly the state its checkpoint saved (a part it lacks starts fresh)."""
        for part in self.parts:
            if part.name in state:
                part.load_state_dict(state[part.name])


# ---------------------------------------------------------------------------------------------------------------------
# The method, chosen once


@dataclass
class Method:
    """The parts a run uses, picked from its configuration before the loop (see the module docstring)."""

    refill: NoRefill | DynamicSampling | RetryUntilCorrect
    advantages: partial
    controllers: Controllers
    old_logps: bool  # a no-grad pass for pi_old (needed off-policy, and by AGPO-DSF for its entropy)
    old_entropy: bool  # ... with the full-distribution entropy at temperature 1 (AGPO-DSF's clip rule)


def choose_method(cfg, steps_per_rollout: int) -> Method:
    if cfg.dynamic_sampling_rounds:
        refill = DynamicSampling(cfg.dynamic_sampling_rounds)
    elif cfg.resample_schedule:
        refill = RetryUntilCorrect(cfg.resample_schedule)
    else:
        refill = NoRefill()
    parts = ([KLController(cfg)] if cfg.adaptive_kl else []) + \
        ([GroupSizeController(cfg)] if cfg.adaptive_group_size else []) + ([DSFController(cfg)] if cfg.dsf else [])
    advantages = partial(group_advantages, scale_rewards=cfg.scale_rewards, dispersion_kind=cfg.reward_dispersion,
                         mix_weight=cfg.scale_rewards_mix, homogeneous_value=cfg.homogeneous_advantage)
    return Method(refill, advantages, Controllers(parts), old_logps=steps_per_rollout > 1 or cfg.dsf,
                  old_entropy=cfg.dsf)
