"""Why a checkpoint or final/ could not be written (docs/faults.md): the bytes one needs against the bytes free on the
output folder's disk, and what is left to resume from. train_agrpo.setup hands `save_failed_message` to the core as
lib/setup.Run's `save_failed`, which lib/save_and_stop.py calls when a save fails.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from lib import checkpoint as ckpt


def folder_bytes(folder: str | Path) -> int:
    """The bytes of the files under `folder` (a checkpoint's size)."""
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())


def save_failed_message(run, what: str, error: str) -> str:
    """The message a run stops with when `what` (checkpoint-<step>, final/) could not be written, `error` the cause:
    out of space where a checkpoint (the last one's size, else the weights and optimizer states) needs more than is
    free, and the checkpoint a resume starts from."""
    unwrapped = run.accelerator.unwrap_model(run.scorer).model
    previous = ckpt.latest_checkpoint(run.out)
    if previous is not None:
        needed = folder_bytes(previous)
    else:  # model (adapter) and optimizer states, as written
        weights = run.params if hasattr(unwrapped, "peft_config") \
            else list(unwrapped.state_dict().values())
        states = [v for s in run.optimizer.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor)]
        needed = sum(t.numel() * t.element_size() for t in [*weights, *states])
    free = shutil.disk_usage(run.out).free
    cause = f"out of space; {error}" if free < needed else error
    kept = f"{previous.name} is whole" if previous else "no earlier checkpoint exists"
    return (f"{what} could not be written to '{run.out}' ({cause}). A checkpoint needs about "
            f"{needed / 2**20:.1f} MiB; {free / 2**20:.1f} MiB are free. The partial files were "
            f"removed and {kept}. Free some space and resume with --resume_from_checkpoint latest")
