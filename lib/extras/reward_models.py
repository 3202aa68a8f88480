"""Reward models: a sequence-classification model that scores prompt + completion, used as a reward function
(docs/methods.md 2.5).

A folder or hub id in reward_funcs (or reward_model_name_or_path) names one; lib/reward_funcs.py resolves it to a
RewardModelSpec, checked before anything loads, and load_reward_models loads it onto the trainer's device. It scores
as TRL's GRPOTrainer scores one: the prompt's messages and the completion as one conversation in the reward model's
own chat template (prompt text + completion where its tokenizer has none), tokenized with its own tokenizer without
added special tokens (the template holds them), padded on the right, and the reward is the first logit at the last
non-padding token (`logits[:, 0]`). In eval mode, without gradients, `batch_size` texts at a time. It runs in the
trainer's process, never in the reward worker: its weights are on the trainer's device.
"""

from __future__ import annotations

import torch

from lib.config import ConfigError
from lib.modeling import load_tokenizer
from lib.reward_funcs import RewardModelSpec, reward_model_name
from lib.rewards import completion_text


class RewardModel:
    """A loaded reward model, called like a reward function: model(prompts=..., completions=..., **columns) returns one
    float per completion. A prompt may be messages (read with the model's chat template) or text (TRL's plain form:
    text + completion, no template); the trainer passes lib.reward_funcs.reward_arguments' `model_prompts`. A completion
    may be either form."""

    is_reward_model = True  # lib.reward_funcs.is_reward_model: in this process, given `model_prompts` as its prompts

    def __init__(self, model: torch.nn.Module, tokenizer, name: str, batch_size: int = 8,
                 chat_template_kwargs: dict | None = None):
        self.model, self.tokenizer = model.eval(), tokenizer
        self.__name__ = name
        self.batch_size = batch_size
        self.chat_template_kwargs = chat_template_kwargs or {}

    def text(self, prompt, completion) -> str:
        """What the model reads for one completion."""
        if not isinstance(prompt, list):
            return prompt + completion_text(completion)
        reply = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template([*prompt, *reply], tokenize=False,
                                                      **self.chat_template_kwargs)
        # no template (a base model's tokenizer): each message on its line, as lib/data.format_prompt writes a prompt
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
                      trust_remote_code: bool = False, chat_template_kwargs: dict | None = None) -> RewardModel:
    """The sequence-classification model at `path` (a folder or hub id) and its tokenizer, on `device`, in the
    checkpoint's dtype, one score a text (num_labels=1, TRL's loading). Raises ValueError naming the path and the
    fix."""
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
    return RewardModel(model.to(device), tokenizer, name or reward_model_name(path), batch_size, chat_template_kwargs)


def load_reward_models(reward_funcs: list[tuple[str, object]], device: torch.device | str, batch_size: int = 8, *,
                       trust_remote_code: bool = False, chat_template_kwargs: dict | None = None) -> list[tuple]:
    """`reward_funcs` (lib.reward_funcs.resolve_reward_funcs) with every RewardModelSpec loaded; functions unchanged."""
    return [(name, load_reward_model(func.path, device, batch_size, name=name, trust_remote_code=trust_remote_code,
                                     chat_template_kwargs=chat_template_kwargs))
            if isinstance(func, RewardModelSpec) else (name, func) for name, func in reward_funcs]


def load_rewards(cfg, reward_funcs: list, device: torch.device) -> list:
    """The reward functions with their reward models loaded: each scores in this process, on its
    device, a micro-batch at a time (load_reward_models). Loaded before the memory check, which
    counts them as resident."""
    try:
        return load_reward_models(reward_funcs, device, cfg.per_device_train_batch_size,
                                  trust_remote_code=cfg.trust_remote_code,
                                  chat_template_kwargs=cfg.chat_template_kwargs)
    except ValueError as error:
        raise ConfigError(f"reward_funcs: {error}") from error
