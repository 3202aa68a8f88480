"""CPU-only kernels for sampling: a grouped decode attention and oneDNN-prepacked bf16 linear layers
(docs/performance.md 2.1). Neither changes what is computed; both make the HF sampler's decode step faster on a CPU.

Importing this module registers `grouped_decode_attention` with transformers under lib.modeling.FAST_ATTENTION,
which lib.modeling.default_attn_implementation then picks on a CPU; `prepack_for_cpu` is the hook the entry scripts
give lib.rollout.HFRollout (`prepack`) for its sampling copy.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from lib.extras.decode import decode_step_for
from lib.modeling import FAST_ATTENTION


def grouped_decode_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention for a transformers model: SDPA, except for one query token (decoding), done as two matmuls.

    Why: for decoding with a padding mask, transformers' SDPA path first copies every key/value head
    `num_key_value_groups` times (grouped-query attention) and PyTorch's CPU kernel is slow for a single query:
    measured here (batch 100, 120 cached tokens, 9 query / 3 kv heads) 11.7 ms per layer, against 0.95 ms for
    this form, which groups the query heads onto their shared kv head instead of copying the cache.
    query: (B, H, q, D); key, value: (B, KV, L, D); mask: bool (B, 1, q, L), True = attend, or additive float.
    """
    batch, heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    if q_len != 1 or dropout > 0.0 or heads % kv_heads:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scale = scaling if scaling is not None else dim**-0.5
    grouped = query.view(batch, kv_heads, heads // kv_heads, dim)  # head h attends with kv head h // groups
    scores = torch.matmul(grouped, key.transpose(-1, -2)).float() * scale  # (B, KV, groups, L)
    if attention_mask is not None:
        mask = attention_mask[:, :, -1, :].reshape(batch, 1, 1, kv_len)
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(probs, value).view(batch, heads, 1, dim)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(FAST_ATTENTION, grouped_decode_attention)
AttentionMaskInterface.register(FAST_ATTENTION, sdpa_mask)


def can_prepack() -> bool:
    """Whether this torch has oneDNN's prepacked linear (CPU builds with mkldnn) and this CPU its bf16 kernel: on a
    CPU without AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT the reorder raises (seen on an AVX2 EPYC), so the bf16 copy
    then decodes with plain linear layers."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(torch.nn.Module):
    """A bf16 linear layer whose weight is stored in oneDNN's blocked layout, for decoding on a CPU.

    `F.linear` in bf16 reorders the [out x in] weight into the layout the AMX / AVX-512 kernel reads on every call;
    at decode batch sizes that reorder costs as much as the product itself (measured on these CPUs: 84 -> 55 us for
    a 576 x 1536 layer at batch 8, 4.8 -> 2.5 ms for the 49k-token head). Reordering once per weight sync gives
    bitwise the same outputs. Inference only: no autograd through the packed weight. `load(weight, bias)` is the
    interface lib.rollout.HFRollout's weight sync uses for a layer that is not a plain nn.Linear.
    """

    def __init__(self, linear: torch.nn.Linear, batch_hint: int = 8):
        super().__init__()
        self.in_features, self.out_features, self.batch_hint = linear.in_features, linear.out_features, batch_hint
        self.load(linear.weight, linear.bias)

    @torch.no_grad()
    def load(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(torch.bfloat16), self.batch_hint)
        self.bias = None if bias is None else bias.detach().to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)


def prepack_linears(model: torch.nn.Module) -> None:
    """Replace every nn.Linear of an inference-only bf16 model by a PackedLinear, in place."""
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(module, child_name, PackedLinear(child))


def prepack_for_cpu(model: torch.nn.Module):
    """HFRollout's `prepack` hook: prepack a bf16 sampling copy's linear layers where it lives on a CPU that has
    oneDNN's bf16 kernel (leave any other model as it is); return the copy's decode step
    (lib/extras/decode.decode_step_for: LlamaStep for a Llama-family model, GraphStep on CUDA, else None)."""
    if next(model.parameters()).dtype == torch.bfloat16 and next(model.parameters()).device.type == "cpu" \
            and can_prepack():
        prepack_linears(model)
    return decode_step_for(model)
