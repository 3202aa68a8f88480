"""Sharded training through Accelerate's FSDP2 (docs/distributed.md).

`accelerate launch --config_file scripts/accelerate/fsdp2.yaml train_agrpo.py ...` makes Accelerate shard the
policy with torch's `fully_shard` (each decoder layer a unit, the rest in the root unit) and hand the optimizer the
sharded parameters; everything here is what the trainer adds around that:

- `enable_fsdp_on_cpu`: Accelerate turns its FSDP plugin on only for accelerator devices; on a CPU launched with an
  FSDP config it would silently run plain data parallelism. `fully_shard` itself runs over a gloo group, so the
  trainer switches the state to FSDP with the launcher's plugin: the same sharding code then runs on a CPU, which is
  how the tests exercise it.
- `shard_frozen`: the reference model, sharded the same way (Accelerate's `prepare` wants an optimizer with an
  FSDP2 model).
- `full_parameters`: the policy's parameters as full tensors, one at a time (an all-gather each), for the sampler's
  weight sync: no more than one parameter's full weight exists beyond the shards and the sampler's own copy.
- `save_sharded` / `load_sharded`: a checkpoint's model and optimizer as torch.distributed.checkpoint shards
  (Accelerate's FSDP save / load), and `full_state_dict` for final/, gathered on the main process.

Every function that gathers is a collective: each process calls it at the same point with the same arguments.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

MODEL_SHARDS = "pytorch_model_fsdp_0"  # the folder Accelerate's save_fsdp_model writes (model_index 0)
OPTIMIZER_SHARDS = "optimizer_0"


class ShardingError(ValueError):
    """A launch configuration the sharded trainer does not support, with the fix."""


def fsdp_requested() -> bool:
    """Whether `accelerate launch` was given an FSDP configuration (it exports ACCELERATE_USE_FSDP)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def enable_fsdp_on_cpu(accelerator: Accelerator) -> bool:
    """Run Accelerate's FSDP2 path over the CPU processes' gloo group when the launcher asked for FSDP.

    Accelerate's state sets distributed_type FSDP only for accelerator devices (MULTI_GPU, MULTI_NPU, ...); a
    MULTI_CPU launch with an FSDP config keeps MULTI_CPU and would wrap the model in DDP. torch's `fully_shard`
    runs on CPU tensors over gloo, so setting the state's type and plugin is all it takes for `prepare` to shard.
    Returns whether it switched."""
    if not fsdp_requested() or accelerator.distributed_type != DistributedType.MULTI_CPU:
        return False
    plugin = FullyShardedDataParallelPlugin()  # from the launcher's FSDP_* variables
    if plugin.fsdp_version != 2:
        raise ShardingError("fsdp_version: this trainer shards with FSDP2 (fully_shard); set fsdp_version: 2 in the "
                            "accelerate config (scripts/accelerate/fsdp2.yaml)")
    if accelerator.mixed_precision != "no":  # as Accelerate's state does for the plugin it keeps
        plugin.set_mixed_precision(accelerator.mixed_precision)
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    return True


def is_sharded(accelerator: Accelerator) -> bool:
    return accelerator.distributed_type == DistributedType.FSDP


def check_supported(accelerator: Accelerator, *, use_peft: bool, load_in_4bit: bool) -> None:
    """Refuse, before any model loads, what the sharded path does not do yet; reduce gradients in fp32."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        raise ShardingError("distributed_type DEEPSPEED: DeepSpeed is not supported yet (docs/distributed.md 7); shard "
                            "full fine-tuning with FSDP2: accelerate launch --config_file scripts/accelerate/fsdp2.yaml")
    if not is_sharded(accelerator):
        return
    plugin = accelerator.state.fsdp_plugin
    policy = plugin.mixed_precision_policy
    if policy is not None and not isinstance(policy, dict):
        # Accelerate's bf16 policy also reduce-scatters the gradients in bf16 and casts every unit's outputs to bf16:
        # summing gradients over processes in bf16 loses what the fp32 master weights are kept for, and the root's
        # outputs are the fp32 log-probs, whose differences (ratios, KL) bf16 would round to a few hundredths
        plugin.mixed_precision_policy = dataclasses.replace(policy, reduce_dtype=torch.float32, output_dtype=None)
    if plugin.fsdp_version != 2:
        raise ShardingError("fsdp_version: this trainer shards with FSDP2 (fully_shard); set fsdp_version: 2 in the "
                            "accelerate config (scripts/accelerate/fsdp2.yaml)")
    if use_peft or load_in_4bit:
        raise ShardingError("use_peft / load_in_4bit: LoRA and QLoRA train with data parallelism (their trainable "
                            "weights are small); launch them without the FSDP config "
                            "(scripts/accelerate/ddp_8gpu.yaml), or train in full under FSDP")


def _unit_classes(model: torch.nn.Module, accelerator: Accelerator) -> tuple[type, ...]:
    """The module classes that form their own FSDP unit: the plugin's transformer_cls_names_to_wrap, else the
    model's `_no_split_modules` (its decoder layers), as Accelerate's TRANSFORMER_BASED_WRAP picks them."""
    names = accelerator.state.fsdp_plugin.transformer_cls_names_to_wrap or []
    if not names:
        inner = getattr(model, "model", model)
        names = list(getattr(inner, "_no_split_modules", None) or getattr(model, "_no_split_modules", None) or [])
    classes = {type(m) for m in model.modules() if type(m).__name__ in set(names)}
    if not classes:
        raise ShardingError(f"fsdp_transformer_layer_cls_to_wrap: none of {names} is a module of "
                            f"{type(model).__name__}; name its decoder layer class in the accelerate config")
    return tuple(classes)


def shard_frozen(model: torch.nn.Module, accelerator: Accelerator) -> torch.nn.Module:
    """Shard a frozen model (the reference) like the policy: each decoder layer a unit, the rest in the root unit,
    with the plugin's mixed precision, resharded after each forward. In place; returns the model."""
    from torch.distributed.fsdp import fully_shard

    plugin = accelerator.state.fsdp_plugin
    options = {"reshard_after_forward": True}
    if plugin.mixed_precision_policy is not None:
        options["mp_policy"] = plugin.mixed_precision_policy
    units = _unit_classes(model, accelerator)
    for module in [m for m in model.modules() if isinstance(m, units)]:
        fully_shard(module, **options)
    fully_shard(model, **options)
    return model


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded parameter's full value (an all-gather: a collective); any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def full_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of each parameter, gathered one at a time, in the module's order."""
    for name, param in model.named_parameters():
        yield name, full_tensor(param.detach())


def full_state_dict(accelerator: Accelerator, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state on the main process (CPU tensors; empty elsewhere), for final/'s safetensors."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_sharded(accelerator: Accelerator, model: torch.nn.Module, optimizer, folder: Path) -> None:
    """The model's and the optimizer's shards into `folder` (torch.distributed.checkpoint; every process writes
    its own)."""
    from accelerate.utils import save_fsdp_model, save_fsdp_optimizer

    plugin = accelerator.state.fsdp_plugin
    save_fsdp_model(plugin, accelerator, model, str(folder))
    save_fsdp_optimizer(plugin, accelerator, optimizer, model, str(folder))


def load_sharded(accelerator: Accelerator, model: torch.nn.Module, optimizer, folder: Path) -> None:
    """Read what `save_sharded` wrote back into the sharded model and optimizer."""
    from accelerate.utils import load_fsdp_model, load_fsdp_optimizer

    if not any(path.name.startswith("pytorch_model_fsdp") for path in folder.iterdir()):
        raise ShardingError(f"resume_from_checkpoint: {folder.name} holds no sharded model ({MODEL_SHARDS}/): it was "
                            f"written by a run without FSDP. Resume it with the launch it was written with")
    plugin = accelerator.state.fsdp_plugin
    load_fsdp_model(plugin, accelerator, model, str(folder))
    load_fsdp_optimizer(plugin, accelerator, optimizer, model, str(folder))


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This process's shard of a sharded tensor; any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def grad_norm(params: list[torch.nn.Parameter], accelerator: Accelerator) -> torch.Tensor:
    """The L2 norm of all gradients, without clipping: from each process's shards when sharded (their squared sums
    added over the processes), else from the (already all-reduced) full gradients."""
    squares = sum((local_tensor(p.grad.detach()).float() ** 2).sum() for p in params if p.grad is not None)
    squares = torch.as_tensor(squares, device=accelerator.device)
    if is_sharded(accelerator):
        squares = accelerator.reduce(squares, reduction="sum")
    return torch.sqrt(squares)


def describe_sharding(model: torch.nn.Module, world: int) -> str:
    """One line: how many FSDP units the model has and how much of its weights this process holds."""
    from torch.distributed.fsdp import FSDPModule

    units = sum(isinstance(m, FSDPModule) for m in model.modules())
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    mine = sum(local_tensor(p).numel() * p.element_size() for p in model.parameters())
    return (f"FSDP2: the policy in {units} sharded units over {world} processes; this process holds "
            f"{mine / 2**20:.1f} MiB of its {whole / 2**20:.1f} MiB of weights (and their gradients and optimizer "
            f"states)")
