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


@pytest.mark.parametrize("kind", SCHEDULES)
@pytest.mark.parametrize("warmup, total", [(0, 10), (3, 10), (1, 1), (4, 25)])
def test_every_schedule_gives_transformers_rates_step_for_step(kind, warmup, total):
    from transformers import get_scheduler

    def fresh():
        param = torch.nn.Parameter(torch.zeros(1))
        return torch.optim.SGD([param], lr=2e-5)

    ours_opt, theirs_opt = fresh(), fresh()
    ours = rates(build_scheduler(ours_opt, kind, num_warmup_steps=warmup, num_training_steps=total), ours_opt,
                 total + 2)
    theirs = rates(get_scheduler(kind, theirs_opt, num_warmup_steps=warmup, num_training_steps=total), theirs_opt,
                   total + 2)
    assert ours == pytest.approx(theirs, rel=1e-12, abs=1e-18)


def test_warmup_and_decay_shapes():
    assert [lr_multiplier(t, "linear", 2, 6) for t in range(7)] == [0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0]
    assert lr_multiplier(4, "cosine", 2, 6) == pytest.approx(0.5)  # half way down the half cosine
    assert lr_multiplier(0, "constant", 5, 10) == 1.0  # constant has no warmup
    with pytest.raises(ValueError, match="lr_scheduler_type must be one of"):
        build_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), "polynomial", 0, 10)


@pytest.mark.slow
def test_starting_the_trainer_imports_neither_peft_nor_bitsandbytes():
    code = "import sys, train_agrpo; print(sorted(m for m in ('peft', 'bitsandbytes') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"
