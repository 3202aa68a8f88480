"""The prompt prefix shared under gradient checkpointing (docs/performance.md 3.6): the hook that
lib/models/modeling.completion_logps takes as `checkpointed_prefix` (lib/setup.prepare_policy gives this module to the policy's
CompletionScorer). Without it a checkpointed training forward runs the full
[prompt; completion] sequences, with the same values and gradients.

Transformers drops the cache inside a checkpointed block because a block recomputed in backward would append its keys
and values a second time. The two cache layers here are safe to call twice (`_PromptLayer`, `_SharedPrefixLayer`), so
the blocks are told to keep them (`keep_cache`): each block still keeps only its input from forward to backward, and
the prompt runs once per distinct prompt instead of once per completion.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


class _PromptLayer(DynamicLayer):
    """A prompt pass's cache layer that a checkpointed block may call twice: the first call (the forward) keeps the keys
    and values, a later one (the block recomputed in backward) returns its own states and keeps nothing, so the
    recomputation does what the forward did."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True
            self.keys, self.values = key_states, value_states
        return key_states, value_states


class _SharedPrefixLayer(DynamicLayer):
    """The completions' cache layer: the prompts' keys and values (with their autograd graph) and which prompt each
    completion continues, read and never written, so a checkpointed block recomputed in backward sees what its forward
    saw. Each completion's copy of its prompt's states is made inside the block, so the checkpoint frees it with the
    block's other intermediates instead of keeping G copies of every layer's prefix to backward."""

    def update(self, key_states, value_states, *args, **kwargs):
        return (torch.cat([self.keys[self.index], key_states], dim=-2),
                torch.cat([self.values[self.index], value_states], dim=-2))


def prompt_cache(lm: torch.nn.Module) -> DynamicCache | None:
    """An empty prompt cache for the prefix-shared forward of a causal LM under transformers' gradient checkpointing,
    or None where that cannot be done exactly (the caller then runs the full sequences).

    Needs non-reentrant checkpointing, whose recomputation is differentiated through tensors the block reads from
    outside its inputs (the prompt's keys and values), and layers that all attend to the full sequence (a sliding window
    or a linear-attention state is not a pure function of the call)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    if not hasattr(GradientCheckpointingLayer, "_can_checkpoint_with_cache"):
        return None
    blocks = _checkpointed_blocks(lm)
    if not blocks:  # (a model that checkpoints in its own loop, not in its blocks)
        return None
    for block in blocks:
        func = getattr(block, "_gradient_checkpointing_func", None)
        if func is None:
            return None
        if getattr(func, "keywords", {}).get("use_reentrant", True):  # torch's default is still reentrant
            return None
    cache = DynamicCache(config=lm.config)
    if not cache.layers or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return None
    cache.layers = [_PromptLayer() for _ in cache.layers]
    return cache


def completion_cache(prompts: DynamicCache, index: torch.Tensor) -> DynamicCache:
    """A cache whose row b holds prompt `index[b]`'s keys and values from the filled `prompt_cache`."""
    cache = DynamicCache()
    cache.layers = []
    if not all(layer.is_initialized for layer in prompts.layers):
        raise RuntimeError("the prompt pass left the shared-prefix cache empty: this architecture's attention "
                           "does not write to the cache it is given; run with share_prompt_prefix false")
    for filled in prompts.layers:
        layer = _SharedPrefixLayer()
        layer.dtype, layer.device, layer.is_initialized = filled.dtype, filled.device, True
        layer.keys, layer.values, layer.index = filled.keys, filled.values, index
        cache.layers.append(layer)
    return cache


def _checkpointed_blocks(lm: torch.nn.Module) -> list[torch.nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in lm.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]


@contextmanager
def keep_cache(lm: torch.nn.Module):
    """Within it, checkpointed blocks pass the cache to attention instead of dropping it. The flag is read when a block
    runs forward; its recomputation in backward reuses the arguments of that call."""
    blocks = _checkpointed_blocks(lm)
    for block in blocks:
        block._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for block in blocks:
            del block._can_checkpoint_with_cache
