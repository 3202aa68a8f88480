"""One place per method: the registry `METHODS`, where each method is one entry holding its preset (the keys `--algo
NAME` sets), the check of its keys, its refill rule, its advantage options and its controllers; and the parts those
entries are made of.

Every method (docs/methods.md 9) is GRPO plus some of these parts, switched on by its keys (so a part can also be used
under another preset: `--algo grpo --adaptive_kl true`). `choose_method(cfg)` collects the parts of every entry whose
keys are on, so the loop calls the same hooks whatever the method (docs/methods.md 6.1: the refill rules, advantages and
controllers, and when the loop calls each hook, as each hook's docstring says too). The pure state transitions live in
lib/methods/controllers.py; the objects here hold a state, call those transitions at the hooks, and save / restore it with every
checkpoint. The `ctx` the hooks take is lib/sampling/context.RolloutContext. lib/config.py reads the presets, the `--algo`
choices and the checks from `METHODS`; adding a method: docs/methods.md 11.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch

from lib.methods import controllers
from lib.methods.losses import dispersion, group_advantages, group_skewness
from lib.rewards.functions import extract_answer

# ---------------------------------------------------------------------------------------------------------------------
# Refill rules: after the batch is scored, sample again the groups that carry no signal


class NoRefill:
    """GRPO: the batch is trained on as sampled."""

    def __call__(self, ctx, sampled, step: int):
        return sampled


class DynamicSampling:
    """DAPO's dynamic sampling (arXiv 2503.14476, eq. 11's constraint 0 < #correct < G; docs/methods.md 1.3).

    A group whose answers are all right or all wrong has no signal, so its prompt gives way to the next prompt in the
    data order, sampled in its place, for at most `rounds` rounds; groups still flat after the last round stay (zero
    advantage). The judge is the gathered correctness, so every process agrees. verl over-samples 3x instead; here each
    round samples only the flat groups' slots.
    """

    def __init__(self, rounds: int):
        self.rounds = rounds

    def __call__(self, ctx, sampled, step: int):
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
    """adaGRPO's retries (docs/methods.md 4.1-4.2): a prompt none of whose completions is correct is sampled again with
    the next retry's temperature / top_p (the schedule in force at this step), while retries are left. The judge sees
    every process's rewards, so all agree. The last group is trained on, with the reward statistics of the advantage
    pooled over all of the prompt's rounds."""

    def __init__(self, schedule: list[dict]):
        self.schedule = schedule

    def __call__(self, ctx, sampled, step: int):
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
    """What one optimizer step trains with: the KL weight, the clip range (a float, or one value per completion of this
    process's share of the generation batch) and the entropy bonus's weight."""

    beta: float
    epsilon_low: float | torch.Tensor
    epsilon_high: float | torch.Tensor
    eta: float = 0.0


class Controller:
    """The hooks a controller may use, in the order the loop calls them; here each changes nothing."""

    name = ""
    state = None  # the controller's lib/controllers state (a dataclass), which every checkpoint saves

    def group_size(self, size: int) -> int:
        """Before sampling: the group size of the next generation batch."""
        return size

    def prompt_temperatures(self, ctx, prompts, group_size: int,
                            temperatures: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Before sampling: each prompt's temperature (P_local,), and counters of the work it took."""
        return temperatures, {}

    def batch_values(self, entropies, prompt_of_row: torch.Tensor) -> None:
        """Once a generation batch's old log-probs are known: per-batch values. `entropies()` gives the policy's
        token-mean entropy per prompt group; `prompt_of_row` (B_local,) the global prompt of each completion."""

    def step_values(self, values: TrainValues) -> TrainValues:
        """Before each optimizer step: the values it trains with."""
        return values

    def after_step(self, measured: dict) -> None:
        """After each optimizer step, with what it measured (the loop's step metrics: `kl`, the token-mean KL to the
        reference; `entropy/trained`, the token-mean entropy of the tokens the loss trained)."""

    def after_batch(self, frac_reward_zero_std: float, step_drift) -> None:
        """After the last optimizer step on a generation batch. `step_drift()` measures KL(pi_old || pi_new) of the
        batch's updates per prompt group (an extra forward pass, so only a controller that needs it calls it)."""

    def metrics(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict:
        return {} if self.state is None else controllers.to_dict(self.state)

    def load_state_dict(self, state: dict) -> None:
        if self.state is not None:
            self.state = controllers.from_dict(type(self.state), state)

    def sampling_state(self) -> dict:
        """What the sampling hooks (`group_size`, `prompt_temperatures`) wrote, which the training hooks of the same
        batch read: it travels with the batch, so that a batch sampled ahead (max_staleness, lib/sampling/pipeline.py)
        is trained with its own. Nothing here."""
        return {}

    def load_sampling_state(self, state: dict) -> None:
        """The sampling hooks' state of the batch about to be trained on (`sampling_state`)."""


class KLController(Controller):
    """A-GRPO's beta_t and epsilon_t from a moving average of the KL (docs/methods.md 2.2). The values a step trains
    with are read from the state before every step, so with several steps per generation batch none is stale."""

    name = "kl"

    def __init__(self, cfg):
        self.cfg, self.state = cfg, controllers.init_kl_controller(cfg)

    def step_values(self, values: TrainValues) -> TrainValues:
        # epsilon_high follows epsilon_low's relative change, so an asymmetric (clip-higher) range keeps its shape
        scale = self.state.epsilon / self.cfg.epsilon if self.cfg.epsilon > 0 else 1.0
        return dataclasses.replace(values, beta=self.state.beta, epsilon_low=self.state.epsilon,
                                   epsilon_high=values.epsilon_high * scale)

    def after_step(self, measured: dict) -> None:
        self.state = controllers.update_kl_controller(self.state, measured["kl"], self.cfg)

    def metrics(self) -> dict[str, float]:
        return {"kl_ema": self.state.kl_ema, "next_beta": self.state.beta, "next_epsilon": self.state.epsilon}


class EntropyController(Controller):
    """Adaptive entropy control (Skywork-OR1; TRL's use_adaptive_entropy; docs/methods.md 2.6): the entropy bonus's
    weight eta_t moves by entropy_coef_delta after every optimizer step toward keeping the trained tokens' entropy at
    entropy_target, and applies only while the last measured entropy is at or below it. A-GRPO's option in place of its
    fixed eta; usable under any preset."""

    name = "entropy"

    def __init__(self, cfg):
        self.cfg, self.state = cfg, controllers.init_entropy_controller(cfg)
        self.applied = 0.0

    def step_values(self, values: TrainValues) -> TrainValues:
        self.applied = controllers.entropy_bonus_weight(self.state, self.cfg)
        return dataclasses.replace(values, eta=self.applied)

    def after_step(self, measured: dict) -> None:
        self.state = controllers.update_entropy_controller(self.state, measured["entropy/trained"], self.cfg)

    def metrics(self) -> dict[str, float]:
        # eta: the weight this step trained with; entropy_coef: TRL's key, the coefficient after this step's update
        return {"eta": self.applied, "entropy_coef": self.state.eta}


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


class DSFController(Controller):
    """AGPO-DSF (docs/methods.md 5.1): a probe group per prompt, sampled at the base temperature, scored and never
    trained on; its reward spread, answer vote entropy and skewness set the prompt's training temperature, and with the
    policy's entropy and the last batch's step KL, the group's clip range."""

    name = "dsf"

    def __init__(self, cfg):
        self.cfg, self.state = cfg, controllers.DSFState()
        self.probe: dict[str, list[float]] = {}
        self.ranges: torch.Tensor | None = None

    def prompt_temperatures(self, ctx, prompts, group_size: int,
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

    def sampling_state(self) -> dict:
        """The probe's statistics and the uncertainty baseline the probes move (`dsf_temperatures`)."""
        return {"probe": self.probe, "uncertainty_baseline": self.state.uncertainty_baseline}

    def load_sampling_state(self, state: dict) -> None:
        self.probe = state["probe"]
        self.state = dataclasses.replace(self.state, uncertainty_baseline=state["uncertainty_baseline"])

    def batch_values(self, entropies, prompt_of_row: torch.Tensor) -> None:
        self.state, ranges = controllers.dsf_clip_ranges(self.state, entropies(), self.probe["dispersion"],
                                                         self.probe["vote"], self.probe["skewness"], self.cfg)
        self.ranges = torch.tensor(ranges, device=prompt_of_row.device)[prompt_of_row]

    def step_values(self, values: TrainValues) -> TrainValues:
        return dataclasses.replace(values, epsilon_low=self.ranges, epsilon_high=self.ranges)

    def after_batch(self, frac_reward_zero_std: float, step_drift) -> None:
        drift = step_drift()  # per group; negative values (noise) clamped, as the AGPO-DSF code does
        self.state = controllers.update_step_kl(self.state, sum(max(d, 0.0) for d in drift) / len(drift), self.cfg)

    def metrics(self) -> dict[str, float]:
        return {"entropy_ref": self.state.entropy_ref, "uncertainty_baseline": self.state.uncertainty_baseline,
                "step_kl_ema": self.state.step_kl_ema,
                "epsilon/group_min": float(self.ranges.min()), "epsilon/group_max": float(self.ranges.max()),
                "vote_entropy": sum(self.probe["vote"]) / len(self.probe["vote"]),
                "probe_reward_std": sum(self.probe["dispersion"]) / len(self.probe["dispersion"])}


class Controllers:
    """The run's controllers, called in a fixed order (A-GRPO's KL, entropy, group size, AGPO-DSF); none for plain
    GRPO."""

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

    def after_step(self, measured: dict) -> None:
        for part in self.parts:
            part.after_step(measured)

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

    def sampling_state(self) -> dict:
        return {part.name: state for part in self.parts if (state := part.sampling_state())}

    def load_sampling_state(self, state: dict) -> None:
        for part in self.parts:
            if part.name in state:
                part.load_sampling_state(state[part.name])

    def refreshed(self, live: Controllers) -> None:
        """This copy (the sampling thread's, max_staleness) takes the training side's state of `live` and keeps its
        own sampling side, which runs ahead of the batches trained on."""
        own = self.sampling_state()
        self.load_state_dict(live.state_dict())
        self.load_sampling_state(own)


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
    """The parts of every registered method whose keys are on, in registry order (at most one refill rule: the checks
    refuse two)."""
    used = [method for method in METHODS.values() if method.uses(cfg)]
    refills = [rule for rule in (m.refill(cfg) for m in used) if rule is not None]
    options = {key: value for m in used for key, value in m.advantages(cfg).items()}
    advantages = partial(group_advantages, scale_rewards=cfg.scale_rewards, dispersion_kind=cfg.reward_dispersion,
                         mix_weight=cfg.scale_rewards_mix, aggregation=cfg.multi_objective_aggregation, **options)
    parts = [part for m in used for part in m.controllers(cfg)]
    old_entropy = any(m.old_entropy for m in used)
    return Method(refills[0] if refills else NoRefill(), advantages, Controllers(parts),
                  old_logps=steps_per_rollout > 1 or old_entropy, old_entropy=old_entropy)


# ---------------------------------------------------------------------------------------------------------------------
# The registry: one entry per method


@dataclass(frozen=True)
class MethodEntry:
    """One method. `preset`: the keys `--algo NAME` sets (docs/methods.md 9; any key the user sets wins). The rest
    applies whenever `uses(cfg)`, whatever the preset: `check(cfg, global_batch)` refuses its keys' bad values and
    combinations with a ValueError naming the key and the fix (lib/config.py makes it a ConfigError; ranges and choices
    are the fields' metadata in lib/settings.py instead); `refill(cfg)` its refill rule or None; `advantages(cfg)` its
    options of lib/methods/losses.group_advantages; `controllers(cfg)` its controllers; `old_entropy`: it reads the policy's
    entropy from the pi_old pass."""

    name: str
    summary: str  # the method and its source, one line (the model card, docs/configuration.md)
    preset: dict = field(default_factory=dict)
    uses: Callable = lambda cfg: False
    check: Callable = lambda cfg, global_batch: None
    refill: Callable = lambda cfg: None
    advantages: Callable = lambda cfg: {}
    controllers: Callable = lambda cfg: []
    old_entropy: bool = False


METHODS: dict[str, MethodEntry] = {}


def register(entry: MethodEntry) -> MethodEntry:
    METHODS[entry.name] = entry
    return entry


def _ordered(cfg, low: str, high: str) -> None:
    if getattr(cfg, low) > getattr(cfg, high):
        raise ValueError(f"{low} ({getattr(cfg, low)}) must not exceed {high} ({getattr(cfg, high)})")


def reachable_group_sizes(cfg) -> list[int]:
    """Every num_generations a run can use: the fixed one, or with adaptive_group_size every doubling and halving of it
    within [group_size_min, group_size_max]."""
    sizes = {cfg.num_generations}
    if cfg.adaptive_group_size:
        size = cfg.num_generations
        while size * 2 <= cfg.group_size_max:
            size *= 2
            sizes.add(size)
        size = cfg.num_generations
        while size // 2 >= cfg.group_size_min:
            size //= 2
            sizes.add(size)
    return sorted(sizes)


def _check_agrpo(cfg, global_batch: int | None) -> None:
    """A-GRPO's controller bounds and the group sizes it can reach (docs/methods.md 2.2), and the adaptive entropy
    controller's bounds (2.3)."""
    if cfg.use_adaptive_entropy:
        _ordered(cfg, "entropy_coef_min", "entropy_coef_max")
    if cfg.adaptive_kl:
        if cfg.beta <= 0:
            raise ValueError("adaptive_kl scales beta multiplicatively, so beta must be > 0 (A-GRPO starts at "
                             "0.001); for no KL term turn the controller off as well: --beta 0 --adaptive_kl false")
        _ordered(cfg, "beta_min", "beta_max")
        _ordered(cfg, "epsilon_min", "epsilon_max")
        # the controller clips beta_t and epsilon_t into these bounds after its first step (lib/methods/controllers.py), so
        # a starting value outside them would hold for one step only: refused rather than silently undone
        for name, low, high, fix in (("beta", "beta_min", "beta_max", "--adaptive_kl false"),
                                     ("epsilon", "epsilon_min", "epsilon_max", "")):
            value, lo, hi = getattr(cfg, name), getattr(cfg, low), getattr(cfg, high)
            if not lo <= value <= hi:
                pin = f"--{low} {value} --{high} {value}"
                raise ValueError(f"{name} {value} is outside [{low} {lo}, {high} {hi}], the range adaptive_kl "
                                 f"(A-GRPO's controller) keeps it in, so it would hold for one step only; for a "
                                 f"fixed {name} give {f'{fix} or ' if fix else ''}{pin}, or a value inside the range")
    if cfg.adaptive_group_size:
        _ordered(cfg, "group_size_min", "num_generations")
        _ordered(cfg, "num_generations", "group_size_max")
        bad = [g for g in reachable_group_sizes(cfg) if global_batch is not None and global_batch % g]
        if bad:
            raise ValueError(f"adaptive_group_size can reach group sizes {reachable_group_sizes(cfg)}, but the "
                             f"generation batch of {global_batch} completions does not split into groups of {bad}; "
                             f"make per_device_train_batch_size x processes x gradient_accumulation_steps x "
                             f"steps_per_generation a multiple of group_size_max ({cfg.group_size_max}) or narrow "
                             f"the range")


def _check_adagrpo(cfg, global_batch: int | None) -> None:
    """adaGRPO's retry schedule (read into its list form here) and think/answer sampler (docs/methods.md 4)."""
    if cfg.resample_schedule is not None:
        try:
            cfg.resample_schedule = controllers.parse_resample_schedule(cfg.resample_schedule)
        except TypeError as error:  # a temperature or top_p that is not a number
            raise ValueError(f"resample_schedule: {error}; each retry's temperature and top_p are numbers") from None
        for trigger in cfg.resample_schedule:
            for params in trigger["params"]:
                if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                           for v in params.values()) or isinstance(trigger["step"], bool):
                    raise ValueError(f"resample_schedule: step {trigger['step']!r} with {params!r}: the step is an "
                                     f"integer and each retry's temperature and top_p are finite numbers")
    if cfg.answer_marker is not None and not cfg.answer_marker.strip():
        raise ValueError("answer_marker is empty; give the text that starts the answer (e.g. 'Answer:')")


def _check_dsf(cfg, global_batch: int | None) -> None:
    """AGPO-DSF's bounds (docs/methods.md 5.1)."""
    if not 0 < cfg.dsf_tau_min <= cfg.dsf_tau_max:
        raise ValueError(f"dsf_tau_min ({cfg.dsf_tau_min}) must be > 0 and <= dsf_tau_max ({cfg.dsf_tau_max})")
    if not 0 < cfg.dsf_eps_min <= cfg.dsf_eps_max:
        raise ValueError(f"dsf_eps_min ({cfg.dsf_eps_min}) must be > 0 and <= dsf_eps_max ({cfg.dsf_eps_max})")
    _ordered(cfg, "dsf_entropy_h_min", "dsf_entropy_h_max")


def _check_dapo(cfg, global_batch: int | None) -> None:
    """DAPO's dynamic sampling replaces groups with new prompts (docs/methods.md 1.3)."""
    if cfg.resample_schedule or cfg.dsf:
        raise ValueError("dynamic_sampling_rounds (DAPO) replaces flat groups with new prompts, and cannot be "
                         "combined with resample_schedule (adaGRPO re-samples the same prompt) or dsf (each prompt's "
                         "temperature comes from its own probe); set dynamic_sampling_rounds 0 or turn those off")


# The methods, in the order of docs/methods.md section 9's table. The presets hold only method keys: the task,
# model, sampling temperature and optimiser stay the user's (or the recipe's).

# DeepSeekMath: beta 0.04 k3, epsilon 0.2, loss grpo, group scaling (the dataclass defaults)
register(MethodEntry("grpo", "GRPO (DeepSeekMath, arXiv 2402.03300)"))

# A-GRPO (docs/methods.md 2.2, [RECON] but beta_0): symmetric KL with beta_t / epsilon_t from its moving average,
# entropy bonus, group mean / batch std advantages, token-mean loss; the adaptive group size stays off
register(MethodEntry(
    "agrpo", "A-GRPO (adaptive KL and clip from a moving average of the KL, entropy bonus)",
    preset={"beta": 0.001, "kl_estimator": "symmetric", "adaptive_kl": True, "epsilon": 0.2, "eta": 1e-3,
            "scale_rewards": "batch", "loss_type": "dapo"},
    uses=lambda cfg: cfg.adaptive_kl or cfg.adaptive_group_size or cfg.use_adaptive_entropy, check=_check_agrpo,
    controllers=lambda cfg: ([KLController(cfg)] if cfg.adaptive_kl else [])
    + ([EntropyController(cfg)] if cfg.use_adaptive_entropy else [])
    + ([GroupSizeController(cfg)] if cfg.adaptive_group_size else [])))

# AGPO (Li et al., docs/methods.md 3.2 (a) + (b) + v3 loss mask): a fixed advantage for homogeneous groups, a length
# reward, zero-advantage completions masked out of a token-mean loss; dual_clip off. Both signals damped from v1's
# +-1 and weight 1 to 0.1 (why: docs/results.md 2.2)
register(MethodEntry(
    "agpo", "AGPO (Li, Liu, Yang, arXiv 2503.15952: fixed advantages for homogeneous groups, a length reward)",
    preset={"homogeneous_advantage": 0.1, "reward_funcs": ["accuracy", "length"], "reward_weights": [1.0, 0.1],
            "loss_mask_zero_advantage": True, "loss_type": "dapo"},
    uses=lambda cfg: cfg.homogeneous_advantage > 0,
    advantages=lambda cfg: {"homogeneous_value": cfg.homogeneous_advantage}))

# adaGRPO (docs/methods.md 4): groups with no correct answer sampled again on the upstream schedule, pooled
# statistics; TRL 0.18.1's bnpo loss and beta 0.04
register(MethodEntry(
    "adagrpo", "adaGRPO (groups with no correct answer sampled again with hotter settings)",
    preset={"resample_schedule": controllers.ADAGRPO_SCHEDULE, "loss_type": "bnpo"},
    uses=lambda cfg: cfg.resample_schedule is not None or cfg.answer_marker is not None, check=_check_adagrpo,
    refill=lambda cfg: RetryUntilCorrect(cfg.resample_schedule) if cfg.resample_schedule else None))

# AGPO-DSF (docs/methods.md 5): probe groups, adaptive temperature and clip, 4 update epochs, beta_ref 0.03; k3
# instead of the upstream code's k1 (why: docs/methods.md 5.3)
register(MethodEntry(
    "agpo_dsf", "AGPO-DSF (Hu et al., arXiv 2605.20722: per-prompt temperature and clip range from probe groups)",
    preset={"dsf": True, "num_iterations": 4, "beta": 0.03, "kl_estimator": "k3", "loss_type": "grpo"},
    uses=lambda cfg: cfg.dsf, check=_check_dsf, controllers=lambda cfg: [DSFController(cfg)], old_entropy=True))

# DAPO (docs/methods.md 1.3): clip-higher, token-mean loss, overlong filtering, no KL, and dynamic sampling (each
# round re-samples only the flat groups' slots; verl over-samples 3x)
register(MethodEntry(
    "dapo", "DAPO (arXiv 2503.14476: clip-higher, token-mean loss, dynamic sampling)",
    preset={"beta": 0.0, "epsilon": 0.2, "epsilon_high": 0.28, "loss_type": "dapo",
            "mask_truncated_completions": True, "dynamic_sampling_rounds": 10},
    uses=lambda cfg: cfg.dynamic_sampling_rounds > 0, check=_check_dapo,
    refill=lambda cfg: DynamicSampling(cfg.dynamic_sampling_rounds)))

# Dr. GRPO (arXiv 2503.20783): no length or spread normalisation
register(MethodEntry("dr_grpo", "Dr. GRPO (arXiv 2503.20783: no std scaling, constant normaliser)",
                     preset={"beta": 0.0, "loss_type": "dr_grpo", "scale_rewards": "none"}))

# GSPO (arXiv 2507.18071 section 5.1, TRL's GSPO settings): each rollout trains 4 minibatches, so all but the first
# are off-policy and the sequence-level clip acts (with one step per rollout s_i is exactly 1)
register(MethodEntry(
    "gspo", "GSPO (arXiv 2507.18071: one clipped ratio per sequence)",
    preset={"beta": 0.0, "importance_sampling_level": "sequence", "loss_type": "grpo", "epsilon": 3e-4,
            "epsilon_high": 4e-4, "steps_per_generation": 4}))
