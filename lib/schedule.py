"""The learning-rate schedule: a multiplier of the peak rate per optimizer step, as a torch `LambdaLR`; and the run's
length it is laid out over, in optimizer steps (`steps_per_rollout`, `resolve_epochs`, `warmup_steps`).

The schedules of `lr_scheduler_type`, with linear warmup from 0 over `num_warmup_steps` where the schedule has one, then
(Loshchilov and Hutter, SGDR, 2017, for the cosine):

    constant               1                                  (no warmup, whatever warmup_ratio says)
    constant_with_warmup   1
    linear                 (T - t) / (T - W)                  down to 0 at step T
    cosine                 c(t) = (1 + cos(2 pi n (t - W) / (T - W))) / 2, n = num_cycles (0.5: one half cosine)
    cosine_with_min_lr     r + (1 - r) c(t), r = min_lr_rate (or min_lr / the peak rate): open-r1's recipes' schedule

`lr_scheduler_kwargs` (a mapping, as in transformers' TrainingArguments) carries num_cycles for both cosines and
min_lr_rate or min_lr for the second.

These are transformers' `get_scheduler` values, step for step (tests/test_schedule.py), written here because
importing that function costs every run seconds of start-up (docs/performance.md 5).
"""

from __future__ import annotations

import math
from functools import partial

import torch

SCHEDULES = ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_min_lr")
KWARGS = {"cosine": ("num_cycles",), "cosine_with_min_lr": ("num_cycles", "min_lr_rate", "min_lr")}


def lr_multiplier(step: int, kind: str, num_warmup_steps: int, num_training_steps: int, num_cycles: float = 0.5,
                  min_lr_rate: float = 0.0) -> float:
    """The share of the peak learning rate that optimizer step `step` (0-based) uses."""
    if kind == "constant":
        return 1.0
    if step < num_warmup_steps:
        return step / max(1, num_warmup_steps)
    if kind == "constant_with_warmup":
        return 1.0
    remaining = max(1, num_training_steps - num_warmup_steps)
    if kind == "linear":
        return max(0.0, (num_training_steps - step) / remaining)
    if kind in ("cosine", "cosine_with_min_lr"):
        progress = (step - num_warmup_steps) / remaining
        factor = 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress))
        if kind == "cosine_with_min_lr":
            factor = min_lr_rate + (1.0 - min_lr_rate) * factor
        return max(0.0, factor)
    raise ValueError(f"lr_scheduler_type must be one of {', '.join(SCHEDULES)}, got {kind!r}")


def schedule_options(kind: str, kwargs: dict | None, peak_lr: float) -> dict:
    """`lr_scheduler_kwargs` checked against the schedule, as `lr_multiplier`'s keyword arguments (min_lr becomes
    min_lr_rate = min_lr / peak_lr). ValueError naming the key and the fix."""
    if kind not in SCHEDULES:
        raise ValueError(f"lr_scheduler_type must be one of {', '.join(SCHEDULES)}, got {kind!r}")
    kwargs = dict(kwargs or {})
    allowed = KWARGS.get(kind, ())
    for key in kwargs:
        if key not in allowed:
            raise ValueError(f"lr_scheduler_kwargs: {key!r} does not apply to lr_scheduler_type {kind}"
                             + (f" (it takes {', '.join(allowed)})" if allowed else " (it takes none)"))
    options = {}
    if "num_cycles" in kwargs:
        options["num_cycles"] = float(kwargs["num_cycles"])
    if kind == "cosine_with_min_lr":
        if ("min_lr_rate" in kwargs) == ("min_lr" in kwargs):
            raise ValueError("lr_scheduler_kwargs: cosine_with_min_lr needs exactly one of min_lr_rate (a share of "
                             "the peak rate, e.g. {min_lr_rate: 0.1}) or min_lr (an absolute rate)")
        rate = float(kwargs["min_lr_rate"]) if "min_lr_rate" in kwargs else float(kwargs["min_lr"]) / peak_lr
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"lr_scheduler_kwargs: the floor must be between 0 and the peak rate, got a share of "
                             f"{rate:g}")
        options["min_lr_rate"] = rate
    return options


def build_scheduler(optimizer: torch.optim.Optimizer, kind: str, num_warmup_steps: int, num_training_steps: int,
                    kwargs: dict | None = None) -> torch.optim.lr_scheduler.LambdaLR:
    options = schedule_options(kind, kwargs, optimizer.defaults["lr"])
    return torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_multiplier, kind=kind,
                                                                num_warmup_steps=num_warmup_steps,
                                                                num_training_steps=num_training_steps, **options))


# ---- the run's length in optimizer steps, from the configuration (any object with its keys) ------------------------


def steps_per_rollout(cfg) -> int:
    """Optimizer steps one generation batch serves: mu passes (num_iterations) over its slices."""
    return cfg.num_iterations * cfg.optimizer_steps_per_generation


def resolve_epochs(cfg, num_train_prompts: int, num_processes: int) -> int:
    """Optimizer steps an epoch takes (every training prompt sampled once, num_generations completions each, rounded
    up to whole generation batches and repeated num_iterations times); sets max_steps from num_train_epochs when it
    is -1, and eval_steps / save_steps for the `epoch` strategies. Adaptive group sizes and DAPO's replaced groups
    make an epoch approximate: the count is that of the starting group size."""
    prompts_per_rollout = max(1, cfg.per_device_train_batch_size * num_processes * cfg.gradient_accumulation_steps
                              * cfg.optimizer_steps_per_generation // cfg.num_generations)
    per_epoch = math.ceil(num_train_prompts / prompts_per_rollout) * steps_per_rollout(cfg)
    if cfg.max_steps == -1:
        rollouts = math.ceil(cfg.num_train_epochs * per_epoch / steps_per_rollout(cfg))
        cfg.max_steps = max(1, rollouts) * steps_per_rollout(cfg)
    if cfg.eval_strategy == "epoch":
        cfg.eval_steps = per_epoch
    if cfg.save_strategy == "epoch":
        cfg.save_steps = per_epoch
    return per_epoch


def warmup_steps(cfg) -> int:
    """Warm-up steps: warmup_steps, a share of max_steps when it is below 1 (transformers' convention), or
    warmup_ratio x max_steps."""
    if cfg.warmup_steps >= 1:
        return int(cfg.warmup_steps)
    return math.ceil((cfg.warmup_steps or cfg.warmup_ratio) * cfg.max_steps)
