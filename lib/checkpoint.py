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


def read_trainer_state(checkpoint: str | Path) -> dict:
    return json.loads((Path(checkpoint) / STATE_FILE).read_text())


def read_rng(checkpoint: str | Path, rank: int) -> dict | None:
    path = Path(checkpoint) / f"rng_state_{rank}.pt"
    return torch.load(path, weights_only=False) if path.exists() else None


def trim_jsonl(path: Path, last_step: int) -> None:
    """Keep the lines of `path` up to `last_step`; later ones move to `<name>.orphaned.jsonl` (not lost)."""
    if not path.exists():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    keep = [line for line in lines if json.loads(line).get("step", 0) <= last_step]
    later = [line for line in lines if json.loads(line).get("step", 0) > last_step]
    if later:
        with open(path.with_suffix(".orphaned.jsonl"), "a") as f:
            f.write("\n".join(later) + "\n")
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)
