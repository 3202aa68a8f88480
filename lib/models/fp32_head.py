"""TRL's cast_lm_head_to_fp32 (docs/methods.md 13.2): the output layer's weight kept in float32 and its logits
computed in float32. lib/setup.load_models applies `cast_lm_head_to_fp32` to the policy and the reference where the key is
true.
"""

from __future__ import annotations

import torch

from lib.config import ConfigError
from lib.models.modeling import unwrap_causal_lm


class Float32Head(torch.nn.Linear):
    """An output layer whose weight is float32 and whose logits are computed in float32, from float32 hidden states and
    outside autocast (TRL's cast_lm_head_to_fp32; ScaleRL, Khatri et al. 2025, arXiv 2510.13786, "FP32 precision at the
    LM head": the policy's and the sampler's probabilities then differ less). `cast_lm_head_to_fp32` turns a model's
    nn.Linear head into one in place, so its parameter names, and the checkpoints, stay the same."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.float()
            return torch.nn.functional.linear(hidden.float(), self.weight.float(), bias)


def cast_lm_head_to_fp32(model: torch.nn.Module) -> None:
    """The causal LM's output layer as a Float32Head (policy and reference; docs/methods.md 13.2). A head tied to the
    input embeddings shares its weight, which becomes float32 too; the embeddings' output is cast back to the dtype the
    rest of the model runs in. Refused (ConfigError) for a head that is not a plain linear layer: a LoRA-adapted head
    (lm_head in lora_target_modules), as TRL refuses it, or a quantised one."""
    lm = unwrap_causal_lm(model)
    head = lm.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        raise ConfigError(f"cast_lm_head_to_fp32: the output layer is a {type(head).__name__}, not a plain linear "
                          f"layer (an adapted or quantised head); remove lm_head from lora_target_modules or set "
                          f"cast_lm_head_to_fp32 false")
    dtype = head.weight.dtype
    head.float()
    head.__class__ = Float32Head
    embeddings = lm.get_input_embeddings()
    if dtype != torch.float32 and embeddings.weight is head.weight:  # tied: the embeddings are float32 now
        embeddings.register_forward_hook(lambda module, args, output: output.to(dtype))
