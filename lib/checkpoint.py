"""Checkpoints that are written atomically and resume exactly.

checkpoint-<step>/ holds: the model (a `save_pretrained` folder, or a PEFT adapter folder), `optimizer.pt`,
`scheduler.pt`, `rng_state_<rank>.pt` (Python, NumPy, torch and the sampler's generator, per process) and
`trainer_state.json` (step, data position, token count, controller state, resolved config). A checkpoint is first
written to a hidden staging folder and renamed into place; `trainer_state.json` is written last, so a folder
without it is never treated as a checkpoint. A run killed while saving leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import threading
from pathlib import Path

import numpy as np
import torch

STATE_FILE = "trainer_state.json"
_STEP = re.compile(r"^checkpoint-(\d+)$")


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints in `output_dir`, oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name)) and (p / STATE_FILE).exists()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    checkpoints = list_checkpoints(output_dir)
    return checkpoints[-1] if checkpoints else None


def rng_state(extra: dict | None = None) -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    state.update(extra or {})
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def staging_dir(output_dir: str | Path, step: int) -> Path:
    """The hidden folder checkpoint `step` is written into before its commit (the main process empties and creates
    it; every process writes its own RNG file there)."""
    return Path(output_dir) / f".checkpoint-{step}.partial"


def write_rng(folder: Path, rank: int, state: dict) -> None:
    torch.save(state, folder / f"rng_state_{rank}.pt")


def commit_checkpoint(output_dir: str | Path, step: int, trainer_state: dict, save_total_limit: int | None) -> Path:
    """Main process only, after every process has written into the staging folder: write trainer_state.json,
    rename the folder into place, and drop the oldest checkpoints beyond `save_total_limit`."""
    staging = staging_dir(output_dir, step)
    final = Path(output_dir) / f"checkpoint-{step}"
    state_tmp = staging / (STATE_FILE + ".tmp")
    state_tmp.write_text(json.dumps(trainer_state, indent=2))
    os.replace(state_tmp, staging / STATE_FILE)
    if final.exists():  # the same step saved again after a resume: swap, then delete the old copy
        trash = Path(output_dir) / f".checkpoint-{step}.old"
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(final, trash)
        os.replace(staging, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(staging, final)
    if save_total_limit:
        for old in list_checkpoints(output_dir)[:-save_total_limit]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def recover(output_dir: str | Path) -> list[str]:
    """Finish or undo what a run killed while saving left behind; returns what was done, one line each.

    A kill between the two renames of a re-saved step (commit_checkpoint) leaves `checkpoint-N` missing, the old copy
    in `.checkpoint-N.old` and the new one, complete, in `.checkpoint-N.partial`: the complete new one is put in
    place (or the old one back). Staging folders of saves that never committed, and of `final/`, are removed."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    done = []
    for old in sorted(root.glob(".checkpoint-*.old")):
        step = old.name[len(".checkpoint-"):-len(".old")]
        final, staging = root / f"checkpoint-{step}", staging_dir(root, int(step)) if step.isdigit() else None
        if not final.exists():
            if staging is not None and (staging / STATE_FILE).exists():
                os.replace(staging, final)
                done.append(f"checkpoint-{step}: completed the save a kill interrupted")
            elif (old / STATE_FILE).exists():
                os.replace(old, final)
                done.append(f"checkpoint-{step}: put the previous copy back")
        shutil.rmtree(old, ignore_errors=True)
    for partial in [*root.glob(".checkpoint-*.partial"), root / ".final.partial"]:
        if partial.exists():
            shutil.rmtree(partial, ignore_errors=True)
            done.append(f"removed {partial.name} (a save that never finished)")
    return done


class RunStopped(RuntimeError):
    """The run stopped on purpose, its checkpoints whole: preempted (exit code 128 + the signal's number, as a shell
    reports a process the signal ended), too many non-finite steps, or a checkpoint that could not be written (1)."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


class StopRequest:
    """SIGTERM and SIGUSR1 (a scheduler's preemption, or its warning ahead of the time limit) ask the run to stop:
    the handler only records the signal; the loop checks `signal_name` where a checkpoint resumes exactly, saves
    and exits (train_agrpo.train). A second signal of the same kind while the first is pending is ignored. Handlers
    are installed in the main thread only (Python's rule) and restored by `restore()`."""

    SIGNALS = ("SIGTERM", "SIGUSR1")

    def __init__(self):
        self.signal_name: str | None = None
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                sig = getattr(signal, name, None)
                if sig is not None:
                    self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signal_name = self.signal_name or signal.Signals(signum).name

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


def read_trainer_state(checkpoint: str | Path) -> dict:
    return json.loads((Path(checkpoint) / STATE_FILE).read_text())


def read_rng(checkpoint: str | Path, rank: int) -> dict | None:
    path = Path(checkpoint) / f"rng_state_{rank}.pt"
    return torch.load(path, map_location="cpu", weights_only=False) if path.exists() else None


def trim_jsonl(path: Path, last_step: int) -> None:
    """Keep the lines of `path` that a run resumed at `last_step` does not write again: those of earlier steps and
    the training lines of `last_step` itself (its evaluation, if any, is redone after the resume). The others move to
    `<name>.orphaned.jsonl` (not lost), and so does a line cut short by a kill in the middle of a write."""
    if not path.exists():
        return

    def kept(line: str) -> bool:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            return False
        step = record.get("step", 0)
        return step < last_step or (step == last_step and not any(k.startswith("eval/") for k in record))

    lines = [line for line in path.read_text().splitlines() if line.strip()]
    keep = [line for line in lines if kept(line)]
    later = [line for line in lines if not kept(line)]
    if later:
        with open(path.with_suffix(".orphaned.jsonl"), "a") as f:
            f.write("\n".join(later) + "\n")
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)
