"""lib/schedule.py: our learning-rate schedules give transformers' `get_scheduler` rates step for step, and the
trainer no longer imports peft and bitsandbytes when it starts."""

import subprocess
import sys

import pytest
import torch

from conftest import REPO
from lib.schedule import SCHEDULES, build_scheduler, lr_multiplier


def rates(scheduler, optimizer, steps):
    out = []
    for _ in range(steps):
        out.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return out


# every schedule with the options open-r1's and TRL's recipes pass (lr_scheduler_kwargs)
CASES = [(kind, {}) for kind in SCHEDULES if kind != "cosine_with_min_lr"] + [
    ("cosine", {"num_cycles": 1.5}),
    ("cosine_with_min_lr", {"min_lr_rate": 0.1}),
    ("cosine_with_min_lr", {"min_lr": 5e-6, "num_cycles": 0.25}),
]


@pytest.mark.parametrize("kind, kwargs", CASES)
@pytest.mark.parametrize("warmup, total", [(0, 10), (3, 10), (1, 1), (4, 25)])
def test_every_schedule_gives_transformers_rates_step_for_step(kind, kwargs, warmup, total):
    from transformers import get_scheduler

    def fresh():
        param = torch.nn.Parameter(torch.zeros(1))
        return torch.optim.SGD([param], lr=2e-5)

    ours_opt, theirs_opt = fresh(), fresh()
    ours = rates(build_scheduler(ours_opt, kind, num_warmup_steps=warmup, num_training_steps=total, kwargs=kwargs),
                 ours_opt, total + 2)
    theirs = rates(get_scheduler(kind, theirs_opt, num_warmup_steps=warmup, num_training_steps=total,
                                 scheduler_specific_kwargs=kwargs), theirs_opt, total + 2)
    assert ours == pytest.approx(theirs, rel=1e-12, abs=1e-18)
    if "min_lr_rate" in kwargs:  # after the warmup the rate never goes below the floor
        assert min(ours[warmup:]) >= 2e-5 * kwargs["min_lr_rate"] * (1 - 1e-9)


def test_warmup_and_decay_shapes():
    assert [lr_multiplier(t, "linear", 2, 6) for t in range(7)] == [0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0]
    assert lr_multiplier(4, "cosine", 2, 6) == pytest.approx(0.5)  # half way down the half cosine
    assert lr_multiplier(0, "constant", 5, 10) == 1.0  # constant has no warmup
    with pytest.raises(ValueError, match="lr_scheduler_type must be one of"):
        build_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), "polynomial", 0, 10)
    assert lr_multiplier(6, "cosine_with_min_lr", 2, 6, min_lr_rate=0.1) == pytest.approx(0.1)  # ends at the floor


def test_bad_schedule_options_are_configuration_errors_before_anything_loads():
    from lib.config import ConfigError, parse_config

    assert parse_config(["--lr_scheduler_type", "cosine_with_min_lr", "--lr_scheduler_kwargs",
                         '{"min_lr_rate": 0.1}']).lr_scheduler_kwargs == {"min_lr_rate": 0.1}
    for args, message in [
        (["--lr_scheduler_type", "cosine_with_min_lr"], "needs exactly one of min_lr_rate"),
        (["--lr_scheduler_kwargs", '{"min_lr_rate": 0.1}'], "'min_lr_rate' does not apply to lr_scheduler_type "
                                                           "constant"),
        (["--lr_scheduler_type", "cosine", "--lr_scheduler_kwargs", '{"min_lr": 1e-6}'], r"it takes num_cycles\)"),
        (["--lr_scheduler_type", "cosine_with_min_lr", "--lr_scheduler_kwargs", '{"min_lr": 1.0}'],
         "the floor must be between 0 and the peak rate"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_config(args)


@pytest.mark.slow
def test_starting_the_trainer_imports_neither_peft_nor_bitsandbytes():
    """Nor transformers' model code (modeling_utils, and with it torch._dynamo), which a run loads with its model and
    which --help and a refused configuration do without (docs/performance.md 5)."""
    code = ("import sys, train_agrpo; print(sorted(m for m in ('peft', 'bitsandbytes', 'transformers.modeling_utils') "
            "if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"
