"""CPU-only kernels for sampling: oneDNN-prepacked bf16 linear layers (docs/performance.md 2.1), which do not change
what is computed and make the HF sampler's decode step faster on a CPU. (The grouped decode attention that models load
with on a CPU is lib/models/attention.py.) `sampling_copy` is the copy lib/sampling/engines.make_engine gives
lib.sampling.rollout.HFRollout (`copy`): its sampling copy (lib/sampling/policy_copy.py) with `prepack_for_cpu`.
"""

from __future__ import annotations

import torch

from lib.sampling.decode import decode_step_for, llama_family
from lib.sampling.policy_copy import make_copy


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
    interface lib.sampling.rollout.HFRollout's weight sync uses for a layer that is not a plain nn.Linear.
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


class PackedGroup(torch.nn.Module):
    """Linear layers that read one input (a Llama-family layer's query, key and value projections; its gate and up
    projections) as one prepacked product, their weights stacked along the output axis: one kernel call a step
    where there were three or two, and the same numbers: each slice of the stacked product is its layer's own
    product bit for bit (docs/performance.md 2.4: oneDNN's bf16 kernel, 1 to 1,000 rows, these models' shapes).

    Each layer becomes a `PackedPart` of the group. A weight sync loads the parts one by one; the group packs
    again once every part has its new weight, or, where a sync refreshes only some of them (LoRA on some of the
    layers), at its next product, the other parts' weights read back from the pack as they are."""

    def __init__(self, linears: list[torch.nn.Linear], batch_hint: int = 8):
        super().__init__()
        self.in_features, self.batch_hint = linears[0].in_features, batch_hint
        self.sizes = [linear.out_features for linear in linears]
        self.staged: list[tuple | None] = [None] * len(linears)  # parts loaded since the last pack
        self.last = None  # (input, its version, product, parts yet to read it): `output`
        self._pack([linear.weight for linear in linears], [linear.bias for linear in linears])

    @torch.no_grad()
    def _pack(self, weights: list[torch.Tensor], biases: list) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(torch.cat([w.to(torch.bfloat16) for w in weights]),
                                                              self.batch_hint)
        self.bias = None if biases[0] is None else torch.cat([b.to(torch.bfloat16) for b in biases])

    def stage(self, index: int, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        # copies: a sync that refreshes some parts only packs them at the next product
        self.staged[index] = (weight.detach().to(torch.bfloat16, copy=True),
                              None if bias is None else bias.detach().to(torch.bfloat16, copy=True))
        if all(self.staged):
            self._repack()

    def _repack(self) -> None:
        # the pack read back in the plain layout is the weight it was packed from, bit for bit
        weights = list(self.packed.to_dense().split(self.sizes)) if not all(self.staged) else [None] * len(self.sizes)
        biases = list(self.bias.split(self.sizes)) if self.bias is not None else [None] * len(self.sizes)
        for i, staged in enumerate(self.staged):
            if staged is not None:
                weights[i], biases[i] = staged
        self.staged = [None] * len(self.sizes)
        self.last = None
        self._pack(weights, biases)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """The stacked product of a 2-D bf16 x: (rows, sum(sizes))."""
        if any(self.staged):
            self._repack()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """`product` of x (..., in_features), computed once for the parts that read the same x in turn (a layer's
        forward calls its q, k and v projections on one tensor) and dropped once each part has read it."""
        last = self.last
        if last is not None and last[0] is x and last[1] == x._version:
            self.last = (*last[:3], last[3] - 1) if last[3] > 1 else None
            return last[2]
        out = self.product(x.reshape(-1, self.in_features).to(torch.bfloat16))
        out = out.reshape(*x.shape[:-1], out.shape[-1])
        self.last = (x, x._version, out, len(self.sizes) - 1)
        return out


class PackedPart(torch.nn.Module):
    """One layer of a `PackedGroup`: its slice of the group's product (a view), and `load(weight, bias)` for
    lib.sampling.rollout.HFRollout's weight sync."""

    def __init__(self, group: PackedGroup, index: int):
        super().__init__()
        self.group, self.index = group, index
        self.in_features, self.out_features = group.in_features, group.sizes[index]
        self.start = sum(group.sizes[:index])

    @property
    def bias(self) -> torch.Tensor | None:
        bias = self.group.bias
        return None if bias is None else bias[self.start : self.start + self.out_features]

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.group.stage(self.index, weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output(x)[..., self.start : self.start + self.out_features]


def stacked_layers(model: torch.nn.Module) -> list[list[str]]:
    """The names of a Llama-family model's linear layers that read one input, by layer: (q, k, v), (gate, up)."""
    if not llama_family(model):
        return []
    prefix = next(name for name, module in model.named_modules() if module is model.get_decoder())
    groups = []
    for i, layer in enumerate(model.get_decoder().layers):
        names = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["mlp.gate_proj", "mlp.up_proj"]]
        for group in names:
            linears = [layer.get_submodule(name) for name in group]
            # one bias for all or none (Qwen2: q, k and v have one, Llama's attention_bias gives all three one)
            if all(isinstance(m, torch.nn.Linear) for m in linears) and \
                    len({m.bias is None for m in linears}) == 1:
                groups.append([f"{prefix}.layers.{i}.{name}" for name in group])
    return groups


def prepack_linears(model: torch.nn.Module, stacked: list[list[str]] = ()) -> None:
    """Replace every nn.Linear of an inference-only bf16 model by a PackedLinear, in place; the layers named in each
    list of `stacked` by the parts of one PackedGroup."""
    for names in stacked:
        group = PackedGroup([model.get_submodule(name) for name in names])
        for index, name in enumerate(names):
            owner, _, child = name.rpartition(".")
            setattr(model.get_submodule(owner), child, PackedPart(group, index))
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(module, child_name, PackedLinear(child))


def prepack_for_cpu(model: torch.nn.Module):
    """The sampling copy's `prepack` hook (lib/sampling/policy_copy.SamplingCopy): prepack a bf16 copy's linear
    layers where it lives on a CPU that has oneDNN's bf16 kernel, a Llama-family model's q, k, v and gate, up as one
    product each (leave any other model as it is); return the copy's decode step (lib/sampling/decode.decode_step_for:
    LlamaStep for a Llama-family model, GraphSteps on CUDA, else None)."""
    if next(model.parameters()).dtype == torch.bfloat16 and next(model.parameters()).device.type == "cpu" \
            and can_prepack():
        prepack_linears(model, stacked_layers(model))
    return decode_step_for(model)


def sampling_copy(policy: torch.nn.Module, bf16: bool, own_copy: bool = False, headroom: int | None = None):
    """HFRollout's `copy` hook, as the entry scripts give it: lib/sampling/policy_copy.make_copy (`headroom`: the
    bytes a copy may take, lib/sharding/memory.copy_headroom), a copy's linear layers prepacked and its decode step
    chosen by `prepack_for_cpu`."""
    return make_copy(policy, bf16, own_copy, prepack=prepack_for_cpu, headroom=headroom)
