"""Reward models: a sequence-classification model that scores prompt + completion, used as a reward function
(docs/methods.md 2.5).

A folder or hub id in reward_funcs (or reward_model_name_or_path) names one; `reward_model_spec` (the `models`
`reward_functions` hands lib/rewards/scoring.resolve_reward_funcs) resolves it to a RewardModelSpec, checked before
anything loads, and load_reward_models loads it onto the device. `build_rewards` is the one builder of a run's rewards
(functions and reward models) that the trainer, the evaluator and the chat page call from the same settings: it sits
here, with the models it loads: lib/rewards/ is the lowest room (pure functions that the data, the methods and the
models import) and cannot import the models' loading. It scores as TRL's GRPOTrainer scores one: the
prompt's messages and the completion as one conversation in the reward model's own chat template (prompt text +
completion where its tokenizer has none), tokenized with its own tokenizer without added special tokens (the template
holds them), padded on the right, and the reward is the first logit at the last non-padding token (`logits[:, 0]`).
In eval mode, without gradients, `batch_size` texts at a time. It runs in the trainer's process, never in the reward
worker: its weights are on the trainer's device.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from lib.config import setting
from lib.rewards.open_r1 import REWARD_FUNCS
from lib.models.modeling import load_tokenizer
from lib.rewards.scoring import is_conversational, resolve_reward_funcs, spec_error
from lib.rewards.functions import completion_text

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # a hub id ("org/name")


@dataclass(frozen=True)
class RewardModelSpec:
    """A reward model named in reward_funcs (a local folder or a hub id of a sequence-classification model), not
    loaded yet: load_reward_models loads it onto the trainer's device. It scores nothing itself."""

    path: str
    in_process = True  # lib/setup.resolve_rewards: not for the reward worker

    def prompts_of(self, records) -> list:
        """Refused: a spec scores nothing. lib/rewards/scoring.score_completions asks every reward model for its prompts
        before any function runs, so a spec that load_reward_models has not loaded stops the scoring here."""
        raise ValueError(f"reward model(s) {[self.path]} not loaded: lib/models/reward_models.load_reward_models "
                         "loads them onto the device before scoring")


def reward_model_name(spec: str) -> str:
    """A reward model's name in the logs (`rewards/<name>/mean`): the folder's name, or the part of a hub id after the
    '/' (TRL's naming)."""
    return Path(spec.rstrip("/\\")).name


def reward_model_spec(spec: str) -> tuple[str, RewardModelSpec] | None:
    """(name, the reward model) `spec` names (a local folder, or a hub id 'org/name'), or None when it names a
    function: lib/rewards/scoring.resolve_reward_funcs' `models`, which `reward_functions` passes.
    Raises on a folder that holds no sequence-classification model: a causal LM would get a new, random score head
    (transformers initialises what the checkpoint lacks) and train the policy on noise."""
    if ":" in spec:
        return None
    path = Path(os.path.expanduser(spec))
    if path.is_dir():
        try:
            config = json.loads((path / "config.json").read_text())
        except FileNotFoundError:
            raise spec_error(spec, "a folder without config.json, so not a model; a reward model folder is what "
                                    "AutoModelForSequenceClassification.save_pretrained writes", REWARD_FUNCS) from None
        except (OSError, ValueError) as exc:
            raise spec_error(spec, f"its config.json cannot be read ({exc})", REWARD_FUNCS) from exc
        architectures = config.get("architectures") or []
        if not any(str(a).endswith("ForSequenceClassification") for a in architectures):
            held = ", ".join(map(str, architectures)) or "model with no 'architectures' entry"
            raise spec_error(spec, f"the folder holds a {held}, not a sequence-classification model; a reward model "
                                    "has a one-score head (AutoModelForSequenceClassification, num_labels=1)",
                             REWARD_FUNCS)
        return reward_model_name(spec), RewardModelSpec(str(path))
    if spec.endswith(".py"):
        return None  # a file of functions (lib/rewards/scoring.py says what is missing)
    if spec.startswith((".", "/", "~", "\\")):
        raise spec_error(spec, "no such folder (a reward model is a folder or a hub id)", REWARD_FUNCS)
    if _HUB_ID.fullmatch(spec):
        return reward_model_name(spec), RewardModelSpec(spec)
    return None


def prompt_messages(problem: str, instruction: str = "", system_prompt: str | None = None) -> list[dict]:
    """The messages of a math-format record's prompt, as lib/data/records.format_prompt renders them: the system prompt if
    any, then `problem + "\n" + instruction` from the user. A reward model reads them with its own chat template."""
    content = f"{problem}\n{instruction}" if instruction else problem
    return [{"role": "system", "content": system_prompt}] * bool(system_prompt) + [{"role": "user", "content": content}]


class RewardModel:
    """A loaded reward model, called like a reward function: model(prompts=..., completions=..., **columns) returns one
    float per completion. A prompt may be messages (read with the model's chat template) or text (TRL's plain form:
    text + completion, no template); lib.rewards.scoring.score_completions passes what `prompts_of` makes of the
    records, where it has them. A completion may be either form. `instruction` and `system_prompt` are the policy's
    (the configuration's), with which the records' prompts were rendered for it."""

    in_process = True  # lib.rewards.scoring.score_completions: in this process, on its device, never in the worker

    def __init__(self, model: torch.nn.Module, tokenizer, name: str, batch_size: int = 8,
                 chat_template_kwargs: dict | None = None, instruction: str = "", system_prompt: str | None = None):
        self.model, self.tokenizer = model.eval(), tokenizer
        self.__name__ = name
        self.batch_size = batch_size
        self.chat_template_kwargs = chat_template_kwargs or {}
        self.instruction, self.system_prompt = instruction, system_prompt

    def prompts_of(self, records: list[dict] | None) -> list | None:
        """What the model reads as each completion's prompt (None without records: the prompts as given): a
        conversation's messages with the system prompt added where it has no system turn, as the policy's prompt was
        rendered; a text prompt as it is (TRL joins text and completion); a math-format record's messages, the problem
        and the instruction (prompt_messages), since its rendered text is in the policy's chat template, not the
        reward model's."""
        if records is None:
            return None
        prompts = []
        for record in records:
            if is_conversational(record):
                messages = record["prompt"]
                has_system = any(m.get("role") == "system" for m in messages)
                prompts.append(messages if has_system or not self.system_prompt
                               else [{"role": "system", "content": self.system_prompt}, *messages])
            else:
                prompts.append(record["prompt"] if "prompt" in record
                               else prompt_messages(record["problem"], self.instruction, self.system_prompt))
        return prompts

    def text(self, prompt, completion) -> str:
        """What the model reads for one completion."""
        if not isinstance(prompt, list):
            return prompt + completion_text(completion)
        reply = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template([*prompt, *reply], tokenize=False,
                                                      **self.chat_template_kwargs)
        # no template (a base model's tokenizer): each message on its line, as lib/data/records.format_prompt writes a prompt
        # for a model without one, then the completion
        return "".join(f"{m['content']}\n" for m in prompt) + completion_text(completion)

    def __call__(self, prompts: list, completions: list, **columns) -> list[float]:
        texts = [self.text(p, c) for p, c in zip(prompts, completions, strict=True)]
        # batches of similar lengths waste little on padding; the scores go back in the given order
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        scores = [0.0] * len(texts)
        device = next(self.model.parameters()).device
        for start in range(0, len(order), self.batch_size):
            rows = order[start : start + self.batch_size]
            inputs = self.tokenizer([texts[i] for i in rows], return_tensors="pt", padding=True,
                                    add_special_tokens=False).to(device)
            with torch.inference_mode():
                logits = self.model(**inputs).logits[:, 0].float().tolist()
            for i, score in zip(rows, logits):
                scores[i] = score
        return scores


def load_reward_model(path: str, device: torch.device | str, batch_size: int = 8, *, name: str | None = None,
                      trust_remote_code: bool = False, chat_template_kwargs: dict | None = None,
                      instruction: str = "", system_prompt: str | None = None) -> RewardModel:
    """The sequence-classification model at `path` (a folder or hub id) and its tokenizer, on `device`, in the
    checkpoint's dtype, one score a text (num_labels=1, TRL's loading). Raises ValueError naming the path and the
    fix. `instruction` and `system_prompt`: RewardModel's."""
    from transformers import AutoModelForSequenceClassification

    try:
        tokenizer = load_tokenizer(path, padding_side="right", trust_remote_code=trust_remote_code)
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype="auto",
                                                                   trust_remote_code=trust_remote_code)
    # transformers raises OSError (no such folder or id, hub unreachable), ValueError (an unknown architecture) or
    # RuntimeError (a head of another size); all mean "not a usable reward model" to the user
    except (OSError, ValueError, RuntimeError) as error:
        raise ValueError(f"reward model {path!r}: could not load a sequence-classification model and its tokenizer "
                         f"({type(error).__name__}: {error}); pass a folder holding both (save_pretrained of each) "
                         "or a hub id that is reachable") from error
    if tokenizer.pad_token_id is None:
        raise ValueError(f"reward model {path!r}: its tokenizer has neither a pad token nor an end token; set "
                         "tokenizer.pad_token and save it again")
    # the model scores the last token that is not padding, found by this id (TRL sets it the same way)
    model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
    model.requires_grad_(False)
    return RewardModel(model.to(device), tokenizer, name or reward_model_name(path), batch_size, chat_template_kwargs,
                       instruction, system_prompt)


def load_reward_models(reward_funcs: list[tuple[str, object]], device: torch.device | str, batch_size: int = 8, *,
                       trust_remote_code: bool = False, chat_template_kwargs: dict | None = None,
                       instruction: str = "", system_prompt: str | None = None) -> list[tuple]:
    """`reward_funcs` (lib.rewards.scoring.resolve_reward_funcs) with every RewardModelSpec loaded; functions unchanged.
    The keywords: load_reward_model's."""
    return [(name, load_reward_model(func.path, device, batch_size, name=name, trust_remote_code=trust_remote_code,
                                     chat_template_kwargs=chat_template_kwargs, instruction=instruction,
                                     system_prompt=system_prompt))
            if isinstance(func, RewardModelSpec) else (name, func) for name, func in reward_funcs]


def reward_functions(specs: list[str], options: dict | None = None) -> list[tuple[str, object]]:
    """The reward functions of `specs`, as the trainer, the evaluator and the chat page resolve them: the built-ins and
    open-r1's by name (lib/rewards/open_r1.py; `options` their settings, lib/rewards/open_r1.reward_options), `module:
    function` and `file.py:function`, and a folder or hub id as a reward model (a RewardModelSpec: `load_rewards` loads
    it). Nothing loads here: the scripts call it to check the specs before any data or model loads. Raises ValueError
    naming the spec and the fix."""
    return resolve_reward_funcs(specs, options, reward_model_spec, REWARD_FUNCS)


def load_rewards(settings, reward_funcs: list, device: torch.device | str, batch_size: int) -> list:
    """`reward_funcs` (`reward_functions`) with their reward models loaded onto `device`, each scoring `batch_size`
    texts at a time, with the settings' chat_template_kwargs, instruction, system_prompt and trust_remote_code
    (lib/config.setting: the trainer's default where a script does not declare the key). The trainer loads them after
    the policy, before the memory check, which counts them as resident. Raises ValueError naming the model."""
    return load_reward_models(reward_funcs, device, batch_size,
                              trust_remote_code=setting(settings, "trust_remote_code"),
                              chat_template_kwargs=setting(settings, "chat_template_kwargs"),
                              instruction=setting(settings, "instruction"),
                              system_prompt=setting(settings, "system_prompt"))


def build_rewards(settings, device: torch.device | str, batch_size: int, options: dict | None = None) -> list:
    """A run's rewards, the one builder of them: the settings' reward_funcs resolved (`reward_functions`, `options`
    the built-ins' settings where the script has them: lib/rewards/open_r1.reward_options) and their reward models
    loaded (`load_rewards`). The evaluator and the chat page call it whole; the trainer calls its two halves, as it
    checks the names before the data loads and loads the models after the policy (lib/setup.resolve_rewards).
    Raises ValueError naming the spec or the model and the fix."""
    return load_rewards(settings, reward_functions(settings.reward_funcs, options), device, batch_size)
