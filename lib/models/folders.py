"""Model folders as the evaluator and the chat page take them (eval_agrpo.py, chat_app.py): what is wrong with a
name, in words that name the fix, and loading any accepted name for inference (an adapter on its base).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from lib.config import EMBEDDED_MODEL
from lib.data.records import looks_local
from lib.models.embedded import EMBEDDED_ALIASES, resolve_model_path
from lib.models.modeling import is_adapter_folder, load_policy, load_tokenizer


def model_folder_problem(name: str) -> str | None:
    """Why `name` cannot be loaded as a model, in words that name the fix; None when it looks loadable.

    Accepted: the embedded model ('embedded'), a hub id, a folder with config.json (a model, a run's final/ or
    checkpoint-<step>/), or a PEFT adapter folder whose base is reachable. Checked without loading anything.
    """
    if name in EMBEDDED_ALIASES:
        return None
    path = Path(os.path.expanduser(name))
    if not path.exists():
        if looks_local(name):
            return (f"'{name}' does not exist; pass a model folder, a run's final/ or checkpoint-<step>/ folder, "
                    f"'embedded', or a hub id")
        return None  # a hub id: loading it tells whether it is reachable
    if not path.is_dir() or not ((path / "config.json").exists() or is_adapter_folder(str(path))):
        hint = " (it is a run folder: pass its final/ or a checkpoint-<step>/)" if (path / "final").is_dir() else ""
        return f"'{name}' is not a model folder (no config.json or adapter_config.json){hint}"
    if is_adapter_folder(str(path)):
        try:
            base = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
        except (OSError, ValueError) as error:
            return f"the adapter '{name}' has an unreadable adapter_config.json ({error})"
        if not base:
            return (f"the adapter '{name}' names no base_model_name_or_path in its adapter_config.json; set it to "
                    f"the base model's folder")
        if base not in EMBEDDED_ALIASES and looks_local(base) and not Path(os.path.expanduser(base)).exists():
            return (f"the adapter '{name}' is for the base model '{base}', which does not exist here; put the base "
                    f"there or edit base_model_name_or_path in {path / 'adapter_config.json'}")
    return None


def adapter_base(path: str) -> str:
    """The folder (or hub id) of a PEFT adapter's base model, the embedded sentinel resolved."""
    base = json.loads(Path(path, "adapter_config.json").read_text())["base_model_name_or_path"]
    return resolve_model_path(EMBEDDED_MODEL if base in EMBEDDED_ALIASES else base)


def load_for_inference(name: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                       trust_remote_code: bool = False):
    """(model in eval mode without grad, tokenizer) for any name `model_folder_problem` accepts; an adapter is
    loaded on its base and takes the tokenizer saved with it, or its base's."""
    path = resolve_model_path(EMBEDDED_MODEL if name in EMBEDDED_ALIASES else name)
    tokenizer_path = path
    if is_adapter_folder(path) and not Path(path, "tokenizer_config.json").exists():
        tokenizer_path = adapter_base(path)
    tokenizer = load_tokenizer(tokenizer_path, trust_remote_code=trust_remote_code)
    model = load_policy(path, dtype=dtype, device=device, trust_remote_code=trust_remote_code,
                        resolve=resolve_model_path)
    model = model.eval().requires_grad_(False)
    return model, tokenizer
