"""The learning-rate schedule: a multiplier of the peak rate per optimizer step, as a torch `LambdaLR`.

The four schedules of `lr_scheduler_type`, with linear warmup from 0 over `num_warmup_steps` where the schedule has
one, then (Loshchilov and Hutter, SGDR, 2017, for the cosine):

    constant               1                                  (no warmup, whatever warmup_ratio says)
    constant_with_warmup   1
    linear                 (T - t) / (T - W)                  down to 0 at step T
    cosine                 (1 + cos(pi * (t - W) / (T - W))) / 2

These are the values of transformers' `get_scheduler` for the same names, step for step (tests/test_schedule.py
compares them). We write them here rather than import that function because importing `transformers.optimization`
imports `transformers.trainer_utils`, which imports peft, bitsandbytes and triton: 4.7 s of the trainer's 9.5 s start
on a 2-core CPU, paid by every run, full fine-tuning included (docs/performance.md 5).
"""

from __future__ import annotations

import math
from functools import partial

import torch

SCHEDULES = ("constant", "constant_with_warmup", "linear", "cosine")


def lr_multiplier(step: int, kind: str, num_warmup_steps: int, num_training_steps: int) -> float:
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
    if kind == "cosine":
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * (step - num_warmup_steps) / remaining)))
    raise ValueError(f"lr_scheduler_type must be one of {', '.join(SCHEDULES)}, got {kind!r}")


def build_scheduler(optimizer: torch.optim.Optimizer, kind: str, num_warmup_steps: int,
                    num_training_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    if kind not in SCHEDULES:
        raise ValueError(f"lr_scheduler_type must be one of {', '.join(SCHEDULES)}, got {kind!r}")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_multiplier, kind=kind,
                                                                num_warmup_steps=num_warmup_steps,
                                                                num_training_steps=num_training_steps))
