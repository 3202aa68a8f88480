"""The HF sampler's plain copy of the policy's weights, where sampling from one is faster than from the policy itself
(docs/performance.md 2.1), refreshed before each generation batch that follows an update: a bf16 copy of a fully trained fp32 policy with
`bf16`; a LoRA policy's base with the adapter merged, W + (alpha/r) B A, a 4-bit base dequantised, in bf16 with `bf16`,
else the compute dtype; a full copy of a policy that will be sharded (`own_copy`). Where a LoRA / QLoRA policy's copy
does not fit the memory budget (or `merge_adapter=False`), no copy: the sampler decodes from the policy's own layers,
the base's products plus the adapter's (`DirectDecode`). `sampler_plan` is the rule that picks. Also the merged weights
the vLLM engines are sent (lib/sampling/vllm_rollout.py).

`make_copy` is lib.sampling.rollout.HFRollout's `copy` hook; lib/sampling/cpu_kernels.sampling_copy, the one the entry scripts
give it, adds the CPU kernels (`prepack`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import torch

from lib.distributed import full_tensor
from lib.sampling.decode import decode_step_for
from lib.sharding.memory import sampler_plan
from lib.models.modeling import unwrap_causal_lm


def full_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of each parameter, gathered one at a time, in the module's order."""
    for name, param in model.named_parameters():
        yield name, full_tensor(param).detach()


def is_lora_layer(module: torch.nn.Module) -> bool:
    return hasattr(module, "lora_A") and hasattr(module, "base_layer") and hasattr(module, "get_delta_weight")


def _tied_output_layer(lm: torch.nn.Module) -> bool:
    """Whether a causal LM's output layer and input embeddings share one weight (tie_word_embeddings)."""
    head, embed = lm.get_output_embeddings(), lm.get_input_embeddings()
    return head is not None and embed is not None and getattr(head, "weight", None) is embed.weight


def _compute_dtype(lm: torch.nn.Module) -> torch.dtype:
    """The dtype the policy computes in: a 4-bit base's compute dtype, else its floating weights' dtype."""
    for module in lm.modules():
        if hasattr(module, "compute_dtype") and module.compute_dtype is not None:
            return module.compute_dtype
    return next(p.dtype for p in lm.parameters() if p.is_floating_point())


def dense_weight(linear: torch.nn.Module) -> torch.Tensor:
    """A linear layer's weight as a dense tensor: bitsandbytes' 4-bit weights dequantised (NF4 / FP4)."""
    weight = linear.weight
    state = getattr(weight, "quant_state", None)
    if state is not None:
        import bitsandbytes.functional as bnbf

        return bnbf.dequantize_4bit(weight.data, state)
    return weight


def merged_linear(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of a layer as the plain model computes it: for a LoRA layer with its active adapters, W + sum_a
    scale_a B_a A_a (PEFT's get_delta_weight; Hu et al. 2021, eq. 3); a 4-bit base dequantised."""
    if not is_lora_layer(module):
        return dense_weight(module), getattr(module, "bias", None)
    base = module.base_layer
    weight = dense_weight(base)
    adapters = [a for a in module.active_adapters if a in module.lora_A]
    if adapters and not getattr(module, "disable_adapters", False):
        weight = weight.float() + sum(module.get_delta_weight(a).float() for a in adapters)
    return weight, base.bias


def _load_linear(target: torch.nn.Module, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if not isinstance(target, torch.nn.Linear):  # a prepacked layer (`prepack`)
        target.load(weight, bias)
        return
    target.weight.copy_(weight)
    if bias is not None:
        target.bias.copy_(bias)


@torch.no_grad()
def merged_copy(lm: torch.nn.Module, dtype: torch.dtype,
                device: torch.device | None = None) -> tuple[torch.nn.Module, list[str]]:
    """A plain causal LM with `lm`'s weights as it computes them (adapters merged, 4-bit weights dequantised), in
    `dtype`, on `device` (`lm`'s where None), for sampling; and the names of its layers that come from LoRA layers (the
    ones a sync recomputes)."""
    from transformers.initialization import no_init_weights

    config = copy.deepcopy(lm.config)
    config.__dict__.pop("quantization_config", None)
    device = device or next(lm.parameters()).device
    with no_init_weights(), torch.device(device):  # every weight is overwritten below: no random init
        # the policy's own class (also one from a hub model's code, loaded with trust_remote_code)
        plain = type(lm)._from_config(config, dtype=dtype)
    plain.eval().requires_grad_(False)
    adapted = []
    for name, module in plain.named_modules():
        if not name:
            continue
        source = lm.get_submodule(name)
        if isinstance(module, torch.nn.Linear):
            weight, bias = merged_linear(source)
            _load_linear(module, weight, bias)
            if is_lora_layer(source):
                adapted.append(name)
        else:  # embeddings, norms: their own parameters and persistent buffers, as they are
            for key, tensor in module.named_parameters(recurse=False):
                tensor.copy_(getattr(source, key))
            for key, tensor in module.named_buffers(recurse=False):
                if key in module._buffers and key not in module._non_persistent_buffers_set:
                    tensor.copy_(getattr(source, key))
    plain.tie_weights()
    return plain, adapted


class SamplingCopy:
    """A plain copy of the policy to sample with (`model`), its decode step and its refresh (`sync`).

    `prepack(model)` (lib/sampling/cpu_kernels.prepack_for_cpu) may replace the copy's linear layers by faster ones that
    take their weights through `load(weight, bias)`, and returns the copy's decode step,
    `decode_step(model, cache, attention, max_new_tokens)` with lib.sampling.rollout.ModelStep's interface
    (lib/sampling/decode.LlamaStep: the same logits, less per-step overhead), or None: the model's own forward.
    """

    def __init__(self, model: torch.nn.Module, adapted: list[str], prepack=None):
        self.model = model
        self.adapted = adapted  # the copy's modules whose weights a sync recomputes (LoRA layers)
        # a tied output layer is the input embeddings' parameter, which a policy lists once, under the embeddings'
        # name: a prepacked copy of it must be packed again from the embeddings after each sync
        self.tied_head = _tied_output_layer(model)
        self.decode_step = prepack(model) if prepack is not None else None

    @torch.no_grad()
    def sync(self, policy: torch.nn.Module) -> None:
        """Copy the policy's current weights into the copy: every weight of a fully trained policy; the adapted layers
        only of a LoRA policy (W + (alpha/r) B A)."""
        if self.adapted:
            lm = unwrap_causal_lm(policy)
            for name in self.adapted:
                weight, bias = merged_linear(lm.get_submodule(name))
                _load_linear(self.model.get_submodule(name), weight, bias)
            return
        # one parameter at a time (a sharded policy's is gathered here: `full_parameters`); a
        # prepacked layer is loaded once its weight and bias have both come
        targets = dict(self.model.named_parameters())
        pending: dict[str, dict] = {}
        for name, tensor in full_parameters(policy):
            if name in targets:
                targets[name].copy_(tensor)
                continue
            owner, _, key = name.rpartition(".")
            module = self.model.get_submodule(owner)
            if isinstance(module, torch.nn.Linear) or not hasattr(module, "load"):
                raise KeyError(f"the sampling copy has no parameter {name}")
            parts = pending.setdefault(owner, {})
            parts[key] = tensor
            if "weight" in parts and ("bias" in parts or module.bias is None):
                module.load(parts["weight"], parts.get("bias"))
                del pending[owner]
        head = self.model.get_output_embeddings()
        if self.tied_head and hasattr(head, "load"):  # prepacked: bitwise what packing the new weights anew gives
            head.load(self.model.get_input_embeddings().weight, head.bias)


def dense_numel(lm: torch.nn.Module) -> int:
    """Values in a plain copy of `lm`: its parameters without the adapter's, a 4-bit weight counted at its dense shape,
    a tied output layer once."""
    seen, total = set(), 0
    for name, param in lm.named_parameters():
        if "lora_" in name or id(param) in seen:
            continue
        seen.add(id(param))
        state = getattr(param, "quant_state", None)
        total += state.shape.numel() if state is not None else param.numel()
    return total


class DirectDecode:
    """The sampler's hooks for a policy decoded from its own layers (`sampler_plan` "direct"): no copy (`model` None:
    lib.sampling.rollout.HFRollout samples with the policy, under its autocast), the written-out decode step over the policy's
    causal LM (lib/sampling/decode: `_lora_linear` for its LoRA layers), nothing to sync (it reads the live weights)."""

    model = None
    adapted: list[str] = []

    def __init__(self, step):
        self.step = step

    def decode_step(self, model: torch.nn.Module, cache, attention: torch.Tensor, max_new_tokens: int):
        return self.step(unwrap_causal_lm(model), cache, attention, max_new_tokens)

    def sync(self, policy: torch.nn.Module) -> None:
        """Nothing: the decode step reads the policy's weights as they are."""


def sampling_dtype(policy: torch.nn.Module, bf16: bool) -> torch.dtype:
    """The dtype a copy of `policy` samples in: bf16 with `bf16`, else a LoRA / QLoRA policy's compute dtype, else the
    policy's own."""
    lm = unwrap_causal_lm(policy)
    if bf16:
        return torch.bfloat16
    if any(is_lora_layer(m) for m in lm.modules()):
        return _compute_dtype(lm)
    return next(p.dtype for p in policy.parameters() if p.is_floating_point())


def make_copy(policy: torch.nn.Module, bf16: bool, own_copy: bool = False, merge_adapter: bool = True,
              prepack=None, headroom: int | None = None) -> SamplingCopy | DirectDecode | None:
    """HFRollout's `copy` hook: what `sampler_plan` picks for this policy (see the module docstring): a
    `SamplingCopy`, a `DirectDecode`, or None where the policy itself is sampled with its own forward. `headroom`:
    the bytes a copy may take (lib/sharding/memory.copy_headroom), None: unknown, a copy that pays is made."""
    lm = unwrap_causal_lm(policy)
    adapter = any(is_lora_layer(m) for m in lm.modules())
    quantized = getattr(lm, "is_quantized", False) or getattr(policy, "is_quantized", False)
    dtype = next(p.dtype for p in policy.parameters() if p.is_floating_point())
    copy_dtype = sampling_dtype(policy, bf16)
    plan = sampler_plan(adapter=adapter, quantized=quantized, bf16=bf16, policy_bf16=dtype == torch.bfloat16,
                        own_copy=own_copy, merge_adapter=merge_adapter, headroom=headroom,
                        copy_bytes=dense_numel(lm) * copy_dtype.itemsize)
    if plan == "direct":
        step = decode_step_for(lm)
        return DirectDecode(step) if step is not None else None
    if plan == "policy":
        return None
    # built in the copy's dtype and filled a layer at a time: a deepcopy cast afterwards would hold a second full fp32
    # copy on the device for a moment (28 GB at 7B)
    model, adapted = merged_copy(lm, copy_dtype)
    return SamplingCopy(model, adapted if adapter else [], prepack)
