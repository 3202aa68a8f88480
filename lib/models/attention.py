"""The attention our models load with on a CPU (lib/models/modeling.default_attn_implementation): transformers' SDPA,
except for one query token, where `grouped_decode_attention` attends with grouped query heads instead of copying the
key / value heads (docs/performance.md 2.1). Registered with transformers under FAST_ATTENTION by
`register_fast_attention`, which lib/models/modeling calls before a model loads on a CPU, so that the trainer, the
evaluator and the chat page load the same model whatever they imported first.
"""

from __future__ import annotations

import torch

FAST_ATTENTION = "agrpo_sdpa"  # grouped_decode_attention's name in transformers' attention registry


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
        from transformers.integrations.sdpa_attention import sdpa_attention_forward  # loaded by register() already

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


def register_fast_attention() -> None:
    """Register `grouped_decode_attention` with transformers as FAST_ATTENTION (with SDPA's mask), once. Its imports
    load transformers' model code (about 1.1 s), so they wait for the first model a process loads on a CPU rather
    than slow `--help` and the configuration's checks."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if FAST_ATTENTION not in AttentionInterface().valid_keys():
        AttentionInterface.register(FAST_ATTENTION, grouped_decode_attention)
        AttentionMaskInterface.register(FAST_ATTENTION, sdpa_mask)
