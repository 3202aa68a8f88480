"""The reference model's scores, kept for later evaluations (eval_agrpo.py --reference_cache): a reference scored
once on a data set is read back instead of generated again, as long as nothing its scores depend on has changed
(`cache_key`: the model and its files, the problems, the rendered prompts, the generation and scoring settings).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def weights_fingerprint(path: str | os.PathLike) -> list[tuple[str, int, int]]:
    """(name, size, mtime_ns) of a local model file or of the files directly in a model folder; [] for a hub id.
    Rewritten weights change it, so a kept score is never reused for a different model."""
    path = Path(os.path.expanduser(path))
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else []
    return [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]


def cache_key(model: str, fingerprint: list, records: list[dict], prompts: list[str], settings: dict) -> str:
    """A digest of everything a model's scores on one data set depend on: the model and its files, the problems, the
    rendered prompts and the generation and scoring settings."""
    blob = json.dumps({"model": model, "files": fingerprint, "records": records, "prompts": prompts,
                       "settings": settings}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def read_kept(folder: str | os.PathLike, key: str) -> dict | None:
    """The entry kept under `key`, or None (none yet, or a file cut short by a stopped run)."""
    path = Path(folder) / f"{key}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_kept(folder: str | os.PathLike, key: str, entry: dict) -> None:
    """Written whole or not at all (a temporary file renamed over the name), so a reader never sees half of one."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f"{key}.json.partial"
    tmp.write_text(json.dumps(entry, default=str))
    os.replace(tmp, folder / f"{key}.json")
