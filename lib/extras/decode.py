"""The HF sampler's decode step with the Llama-family layer (Llama, SmolLM, Qwen2, Qwen3) written out over key /
value buffers allocated ahead: the same operations in the same order as the model's forward, so the same logits,
with less per-step overhead on a CPU (docs/performance.md 2.4). The interface is lib.rollout.ModelStep's
(`keep(rows)`, `step(tokens, positions) -> (B, V) float32 logits`); lib/extras/cpu_kernels.prepack_for_cpu hands it
to lib.rollout.HFRollout for a Llama-family copy.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, DynamicCache

from lib.modeling import OutputHead

LLAMA_FAMILY = ("llama", "qwen2", "qwen3")


def llama_family(lm: torch.nn.Module) -> bool:
    """Whether `LlamaStep` computes what this model's own forward does: a Llama-family decoder whose every layer
    attends to the whole context (no sliding window), with the attention we register for CPUs or SDPA."""
    config = lm.config
    if config.model_type not in LLAMA_FAMILY or not hasattr(lm, "get_decoder"):
        return False
    layers = lm.get_decoder().layers
    return all(getattr(layer.self_attn, "sliding_window", None) is None for layer in layers) and \
        config._attn_implementation in ("agrpo_sdpa", "sdpa")


def _linear(module: torch.nn.Module):
    """A layer's product as a plain function of a 2-D x (a prepacked oneDNN layer's kernel called directly)."""
    packed = getattr(module, "packed", None)
    if packed is None:
        return module
    bias = module.bias

    def forward(x: torch.Tensor) -> torch.Tensor:  # x: (rows, in_features)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    return forward


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Root-mean-square normalisation (Zhang & Sennrich 2019) in transformers' order: statistics in float32, the
    result cast back before the gain."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021) in the half-split layout: x cos + rotate_half(x) sin."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class LlamaStep:
    """A Llama-family decode step over per-layer key/value buffers (B, KV heads, capacity, D), zero-filled, holding
    the prefill's keys and values, grown by doubling (one copy per doubling, not one per token) up to the prompt plus
    `max_new_tokens`. Attention reads each buffer whole: its unwritten positions are masked (probability exactly 0,
    times values that are exactly 0)."""

    def __init__(self, lm: torch.nn.Module, cache: DynamicCache, attention: torch.Tensor, max_new_tokens: int,
                 block: int = 128):
        decoder = lm.get_decoder()
        self.embed, self.rotary, self.head = decoder.embed_tokens, decoder.rotary_emb, OutputHead(lm)
        self.final_norm = (decoder.norm.weight, decoder.norm.variance_epsilon)
        self.layers = []
        for layer in decoder.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qk_norms = None
            if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head's query and key
                qk_norms = ((attn.q_norm.weight, attn.q_norm.variance_epsilon),
                            (attn.k_norm.weight, attn.k_norm.variance_epsilon))
            self.layers.append((
                (layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon),
                _linear(attn.q_proj), _linear(attn.k_proj), _linear(attn.v_proj), _linear(attn.o_proj), qk_norms,
                attn, (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon),
                _linear(mlp.gate_proj), _linear(mlp.up_proj), _linear(mlp.down_proj), mlp.act_fn))
        self.head_dim = self.layers[0][6].head_dim
        self.attention = AttentionInterface()[lm.config._attn_implementation]  # the function the model calls
        prompt_len = attention.shape[1]
        self.limit = prompt_len + max_new_tokens
        capacity = min(self.limit, prompt_len + block)
        self.keys, self.values = [], []
        for layer in cache.layers:
            shape = (*layer.keys.shape[:2], capacity, layer.keys.shape[-1])
            keys = layer.keys.new_zeros(shape)
            values = layer.values.new_zeros(shape)
            keys[:, :, :prompt_len] = layer.keys
            values[:, :, :prompt_len] = layer.values
            self.keys.append(keys)
            self.values.append(values)
        cache.layers.clear()  # the prefill's tensors are copied: free them now
        self.mask = torch.zeros(attention.shape[0], capacity, dtype=torch.bool, device=attention.device)
        self.mask[:, :prompt_len] = attention.bool()
        self.length = prompt_len

    def keep(self, rows: torch.Tensor) -> None:
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        self.mask = self.mask[rows]

    def _grow(self) -> None:
        capacity = min(self.limit, 2 * self.mask.shape[1])

        def widen(t: torch.Tensor) -> torch.Tensor:
            out = t.new_zeros(*t.shape[:2], capacity, t.shape[-1])
            out[:, :, : t.shape[2]] = t
            return out

        self.keys = [widen(k) for k in self.keys]
        self.values = [widen(v) for v in self.values]
        mask = self.mask.new_zeros(self.mask.shape[0], capacity)
        mask[:, : self.mask.shape[1]] = self.mask
        self.mask = mask

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.length == self.mask.shape[1]:
            self._grow()
        col = self.length
        self.length += 1
        self.mask[:, col] = True
        mask = self.mask[:, None, None, :]  # (B, 1, 1, capacity), True = attend
        batch, dim = tokens.shape[0], self.head_dim
        hidden = self.embed(tokens)  # (B, H): one token a row, so no sequence axis
        cos, sin = self.rotary(hidden, positions[:, None])
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, 1, D)
        for i, (norm1, q_proj, k_proj, v_proj, o_proj, qk_norms, attn, norm2, gate, up, down, act) in \
                enumerate(self.layers):
            x = _rms_norm(hidden, *norm1)
            q = q_proj(x).view(batch, -1, 1, dim)  # (B, heads, 1, D)
            k = k_proj(x).view(batch, -1, 1, dim)
            if qk_norms is not None:
                q, k = _rms_norm(q, *qk_norms[0]), _rms_norm(k, *qk_norms[1])
            heads = q.shape[1]
            qk = _rotate(torch.cat((q, k), dim=1), cos, sin)  # the query and key heads rotated in one go
            q = qk[:, :heads]
            self.keys[i][:, :, col] = qk[:, heads:, 0]
            self.values[i][:, :, col] = v_proj(x).view(batch, -1, dim)
            out, _ = self.attention(attn, q, self.keys[i], self.values[i], mask, scaling=attn.scaling)
            hidden = hidden + o_proj(out.reshape(batch, -1))
            x = _rms_norm(hidden, *norm2)
            hidden = hidden + down(act(gate(x)) * up(x))
        return self.head(_rms_norm(hidden, *self.final_norm))
