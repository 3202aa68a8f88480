"""Several processes through Accelerate: data parallelism, FSDP2, DeepSpeed ZeRO-2 / ZeRO-3 (docs/distributed.md 1 and
1.1: what is sharded and how; 2: the same code on a CPU over gloo). What the trainer adds around Accelerate: the
launch's checks and settings, the reference sharded like the policy, weights gathered one parameter at a time for the
sampler, sharded checkpoints, DeepSpeed's backward and step, and small collectives. Every function that gathers is a
collective: each process calls it at the same point with the same arguments.
"""
from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

DEEPSPEED_TAG = "deepspeed"  # the sub-folder of a checkpoint that DeepSpeed's save_checkpoint writes
MODEL_SHARDS = "pytorch_model_fsdp_0"  # the folder Accelerate's save_fsdp_model writes (model_index 0)
OPTIMIZER_SHARDS = "optimizer_0"


class ShardingError(ValueError):
    """A launch configuration the sharded trainer does not support, with the fix."""


def fsdp_requested() -> bool:
    """Whether `accelerate launch` was given an FSDP configuration (it exports ACCELERATE_USE_FSDP)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def _check_fsdp_version(plugin) -> None:
    if plugin.fsdp_version != 2:
        raise ShardingError("fsdp_version: this trainer shards with FSDP2 (fully_shard); set fsdp_version: 2 in the "
                            "accelerate config (scripts/accelerate/fsdp2.yaml)")


def _refuse_adapters(launch: str) -> ShardingError:
    return ShardingError(f"use_peft / load_in_4bit: LoRA and QLoRA train with data parallelism (their trainable "
                         f"weights are small); launch them without the {launch} config "
                         f"(scripts/accelerate/ddp_8gpu.yaml), or train in full under {launch}")


def enable_fsdp_on_cpu(accelerator: Accelerator) -> bool:
    """Run Accelerate's FSDP2 path over the CPU processes' gloo group when the launcher asked for FSDP.

    Accelerate's state sets distributed_type FSDP only for accelerator devices (MULTI_GPU, MULTI_NPU, ...); a MULTI_CPU
    launch with an FSDP config keeps MULTI_CPU and would wrap the model in DDP. torch's `fully_shard` runs on CPU
    tensors over gloo, so setting the state's type and plugin is all it takes for `prepare` to shard. Returns whether it
    switched."""
    if not fsdp_requested() or accelerator.distributed_type != DistributedType.MULTI_CPU:
        return False
    plugin = FullyShardedDataParallelPlugin()  # from the launcher's FSDP_* variables
    _check_fsdp_version(plugin)
    if accelerator.mixed_precision != "no":  # as Accelerate's state does for the plugin it keeps
        plugin.set_mixed_precision(accelerator.mixed_precision)
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    return True


def is_sharded(accelerator: Accelerator) -> bool:
    """FSDP2, or DeepSpeed (any ZeRO stage: its optimizer states are partitioned, and the trainer treats its engine the
    way it treats a sharded model)."""
    return accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)


def deepspeed_requested() -> bool:
    """Whether `accelerate launch` was given a DeepSpeed configuration (it exports ACCELERATE_USE_DEEPSPEED)."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def is_deepspeed(accelerator: Accelerator) -> bool:
    return accelerator.distributed_type == DistributedType.DEEPSPEED


def zero_stage(accelerator: Accelerator) -> int:
    """DeepSpeed's ZeRO stage; 0 without DeepSpeed."""
    return int(accelerator.state.deepspeed_plugin.zero_stage) if is_deepspeed(accelerator) else 0


def partitions_weights(accelerator: Accelerator) -> bool:
    """Whether each process holds only part of the weights (FSDP2, ZeRO-3): the model's calls are then collectives, and
    the sampler and the reference need gathered weights."""
    return accelerator.distributed_type == DistributedType.FSDP or zero_stage(accelerator) == 3


def enable_deepspeed_on_cpu(accelerator: Accelerator) -> bool:
    """Make Accelerate's state count the processes of a DeepSpeed launch on a CPU.

    Launched with a DeepSpeed config and no accelerator, Accelerate lets DeepSpeed form the process group (gloo, the
    communication backend of DeepSpeed's CPU accelerator) but, finding no device backend of its own, records one process
    of rank 0 on every process; the engine would then be configured for a world of one. The counts are the process
    group's. Returns whether it changed them."""
    if not is_deepspeed(accelerator) or not torch.distributed.is_initialized():
        return False
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    if accelerator.num_processes == world and accelerator.process_index == rank:
        return False
    from accelerate.state import AcceleratorState, PartialState

    counts = {"num_processes": world, "process_index": rank, "backend": torch.distributed.get_backend(),
              "local_process_index": int(os.environ.get("LOCAL_RANK", rank))}
    for shared in (PartialState._shared_state, AcceleratorState._shared_state):
        shared.update(counts)
    return True


def configure_deepspeed(accelerator: Accelerator, *, micro_batch: int, accumulation: int, max_grad_norm: float,
                        bf16: bool) -> dict:
    """The engine's settings that follow from the training configuration, written into the launcher's DeepSpeed config
    before any model is prepared: the batch geometry (the trainer feeds it micro-batches itself), the clipping
    (max_grad_norm; 0 = none), DeepSpeed's skip of steps with non-finite gradients in bf16 too, and final/'s gathered
    weights under ZeRO-3. Returns the config."""
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    config["train_micro_batch_size_per_gpu"] = micro_batch
    config["gradient_accumulation_steps"] = accumulation
    config["train_batch_size"] = micro_batch * accumulation * accelerator.num_processes
    config["gradient_clipping"] = max_grad_norm
    config["zero_allow_untested_optimizer"] = True  # the optimizer is the trainer's (optim), handed to the engine
    config.setdefault("bf16", {})["enabled"] = bf16
    if bf16:
        config["bf16"]["check_grad_overflow"] = True
    config.setdefault("zero_optimization", {})["stage3_gather_16bit_weights_on_model_save"] = True
    config["steps_per_print"] = float("inf")
    # Accelerate registers the config with transformers, whose from_pretrained would then build a ZeRO-3 model
    # already partitioned (deepspeed.zero.Init): the trainer loads whole weights on each process, as under FSDP2, and
    # the engine partitions them in prepare (the load-time peak is one full copy a process: docs/distributed.md 7)
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    return config


def check_supported(accelerator: Accelerator, *, use_peft: bool, load_in_4bit: bool) -> None:
    """Refuse, before any model loads, what the sharded path does not do yet; reduce gradients in fp32."""
    if is_deepspeed(accelerator):
        if use_peft or load_in_4bit:
            raise _refuse_adapters("DeepSpeed")
        if zero_stage(accelerator) not in (2, 3):
            raise ShardingError(f"zero_stage: {zero_stage(accelerator)} is not supported; the trainer runs ZeRO-2 "
                                f"(scripts/accelerate/zero2.yaml) and ZeRO-3 (scripts/accelerate/zero3.yaml). For "
                                f"plain data parallelism launch without a DeepSpeed config")
        return
    if not is_sharded(accelerator):
        return
    plugin = accelerator.state.fsdp_plugin
    policy = plugin.mixed_precision_policy
    if policy is not None and not isinstance(policy, dict):
        plugin.mixed_precision_policy = mixed_precision_policy(policy)
    _check_fsdp_version(plugin)
    if use_peft or load_in_4bit:
        raise _refuse_adapters("FSDP")


def mixed_precision_policy(policy):
    """FSDP2's mixed-precision policy as the trainer needs it, from the one Accelerate builds for `mixed_precision:
    bf16` (torch's MixedPrecisionPolicy):
    - gradients reduce-scattered in fp32 (reduce_dtype): summing them over processes in bf16 loses what the fp32
      master weights are kept for;
    - outputs left as computed (output_dtype None): the root's outputs are the fp32 log-probs, whose differences
      (ratios, KL) bf16 would round to a few hundredths;
    - forward inputs not cast (cast_forward_inputs False): the scorer's floating inputs are the per-row sampling
      temperatures, which a cast would round (0.7 -> 0.69921875), so that tokens would be scored at another
      temperature than they were sampled at (AGPO-DSF's per-prompt temperatures, every importance ratio). The
      decoder layers need no cast either: their inputs come from the bf16 embedding (tests/test_gpu.py)."""
    return dataclasses.replace(policy, reduce_dtype=torch.float32, output_dtype=None, cast_forward_inputs=False)


def _unit_classes(model: torch.nn.Module, accelerator: Accelerator) -> tuple[type, ...]:
    """The module classes that form their own FSDP unit: the plugin's transformer_cls_names_to_wrap, else the model's
    `_no_split_modules` (its decoder layers), as Accelerate's TRANSFORMER_BASED_WRAP picks them."""
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
    """Shard a frozen model (the reference) like the policy: each decoder layer a unit, the rest in the root unit, with
    the plugin's mixed precision, resharded after each forward. In place; returns the model."""
    if is_deepspeed(accelerator):
        return _partition_frozen(model, accelerator)
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


def _partition_frozen(model: torch.nn.Module, accelerator: Accelerator) -> torch.nn.Module:
    """The reference under DeepSpeed: partitioned over the processes by an inference-only ZeRO-3 engine of the same
    config (its weights gathered a module at a time in each forward); under ZeRO-2, whose weights are whole on every
    process, left as it is. Returns the module to call."""
    if zero_stage(accelerator) != 3:
        return model
    import copy

    import deepspeed

    config = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
    for key in ("optimizer", "scheduler"):
        config.pop(key, None)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()  # (the engine's eval returns None, not the module)
    return engine


def _zero3_partitioned(tensor: torch.Tensor) -> bool:
    return getattr(tensor, "ds_id", None) is not None and hasattr(tensor, "ds_status")


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded parameter's full value (an all-gather: a collective; under ZeRO-3 a detached copy, since the gathered
    storage is released again); any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        return tensor.full_tensor()
    if _zero3_partitioned(tensor):
        import deepspeed

        with deepspeed.zero.GatheredParameters([tensor]):
            return tensor.detach().clone()
    return tensor


def full_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of each parameter, gathered one at a time, in the module's order."""
    for name, param in model.named_parameters():
        yield name, full_tensor(param).detach()


def full_state_dict(accelerator: Accelerator, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state on the main process (CPU tensors; empty elsewhere), for final/'s safetensors."""
    if is_deepspeed(accelerator):  # ZeRO-3: gathered on the main process (stage3_gather_16bit_weights_on_model_save)
        state = accelerator.get_state_dict(model)  # None on the other processes
        return {k: v.cpu() for k, v in (state or {}).items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_sharded(accelerator: Accelerator, model: torch.nn.Module, optimizer, folder: Path) -> None:
    """The model's and the optimizer's shards into `folder` (torch.distributed.checkpoint; every process writes its
    own)."""
    if is_deepspeed(accelerator):  # model states and each process's optimizer partition, in DEEPSPEED_TAG/
        model.save_checkpoint(str(folder), tag=DEEPSPEED_TAG, save_latest=False)
        return
    from accelerate.utils import save_fsdp_model, save_fsdp_optimizer

    plugin = accelerator.state.fsdp_plugin
    save_fsdp_model(plugin, accelerator, model, str(folder))
    save_fsdp_optimizer(plugin, accelerator, optimizer, model, str(folder))


def load_sharded(accelerator: Accelerator, model: torch.nn.Module, optimizer, folder: Path) -> None:
    """Read what `save_sharded` wrote back into the sharded model and optimizer."""
    if is_deepspeed(accelerator):
        if not (folder / DEEPSPEED_TAG).is_dir():
            raise ShardingError(f"resume_from_checkpoint: {folder.name} holds no DeepSpeed states ({DEEPSPEED_TAG}/): "
                                f"it was written by a run without DeepSpeed. Resume it with the launch it was "
                                f"written with")
        loaded, _ = model.load_checkpoint(str(folder), tag=DEEPSPEED_TAG, load_optimizer_states=True,
                                          load_lr_scheduler_states=False)
        if loaded is None:
            raise ShardingError(f"resume_from_checkpoint: DeepSpeed could not read {folder.name}/{DEEPSPEED_TAG}")
        return
    from accelerate.utils import load_fsdp_model, load_fsdp_optimizer

    if not any(path.name.startswith("pytorch_model_fsdp") for path in folder.iterdir()):
        raise ShardingError(f"resume_from_checkpoint: {folder.name} holds no sharded model ({MODEL_SHARDS}/): it was "
                            f"written by a run without FSDP. Resume it with the launch it was written with")
    plugin = accelerator.state.fsdp_plugin
    load_fsdp_model(plugin, accelerator, model, str(folder))
    load_fsdp_optimizer(plugin, accelerator, optimizer, model, str(folder))


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This process's shard of a sharded tensor (a ZeRO-3 parameter's partition); any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        return tensor.to_local()
    return tensor.ds_tensor if _zero3_partitioned(tensor) else tensor


def backward(accelerator: Accelerator, model: torch.nn.Module, loss: torch.Tensor, last: bool) -> None:
    """The backward pass of one micro-batch's loss. A DeepSpeed engine is told whether this is the slice's last
    micro-batch (where it reduces the accumulated gradients) and does not rescale the loss, which the trainer has
    already divided for accumulation (lib/losses.aggregate_loss); the step is `deepspeed_step`'s."""
    if is_deepspeed(accelerator):
        model.set_gradient_accumulation_boundary(last)
        model.backward(loss, scale_wrt_gas=False)
    else:
        accelerator.backward(loss)


def deepspeed_step(model) -> tuple[torch.Tensor, bool]:
    """The engine's optimizer step: the global gradient norm (before clipping) and whether the weights moved. DeepSpeed
    clips to gradient_clipping (configure_deepspeed) and skips a step whose gradients are not finite."""
    model.step()
    norm = model.get_global_grad_norm()
    norm = torch.as_tensor(float("nan") if norm is None else float(norm))
    return norm, not bool(getattr(model.optimizer, "overflow", False)) and bool(torch.isfinite(norm))


def grad_norm(params: list[torch.nn.Parameter], accelerator: Accelerator) -> torch.Tensor:
    """The L2 norm of all gradients, without clipping: from each process's shards when sharded (their squared sums added
    over the processes), else from the (already all-reduced) full gradients."""
    squares = sum((local_tensor(p.grad.detach()).float() ** 2).sum() for p in params if p.grad is not None)
    squares = torch.as_tensor(squares, device=accelerator.device)
    if is_sharded(accelerator):
        squares = accelerator.reduce(squares, reduction="sum")
    return torch.sqrt(squares)


def describe_sharding(model: torch.nn.Module, world: int, stage: int = 0) -> str:
    """One line: how many FSDP units the model has (or which ZeRO stage) and how much of its weights this process
    holds."""
    if stage:
        params = list(model.parameters())
        whole = sum((p.ds_numel if _zero3_partitioned(p) else p.numel()) * p.element_size() for p in params)
        mine = sum(local_tensor(p).numel() * p.element_size() for p in params)
        held = "its optimizer states and gradients" if stage == 2 else "its weights, gradients and optimizer states"
        return (f"DeepSpeed ZeRO-{stage}: {held} partitioned over {world} processes; this process holds "
                f"{mine / 2**20:.1f} MiB of its {whole / 2**20:.1f} MiB of weights")
    from torch.distributed.fsdp import FSDPModule

    units = sum(isinstance(m, FSDPModule) for m in model.modules())
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    mine = sum(local_tensor(p).numel() * p.element_size() for p in model.parameters())
    return (f"FSDP2: the policy in {units} sharded units over {world} processes; this process holds "
            f"{mine / 2**20:.1f} MiB of its {whole / 2**20:.1f} MiB of weights (and their gradients and optimizer "
            f"states)")


def group_token_means(accelerator: Accelerator, values: torch.Tensor, mask: torch.Tensor,
                      group_size: int) -> list[float]:
    """Token mean of a (B_local, T) per-token quantity over each prompt group of the global batch (the trainer's
    AGPO-DSF statistics)."""
    width = min(values.shape[1], mask.shape[1])
    sums = torch.stack([(values[:, :width] * mask[:, :width]).sum(1),
                        mask[:, :width].sum(1).float()], dim=1)
    sums = accelerator.gather(sums).view(-1, group_size, 2).sum(1)
    return (sums[:, 0] / sums[:, 1].clamp(min=1)).tolist()


def gather_ragged(accelerator: Accelerator, values: torch.Tensor) -> torch.Tensor:
    """Every process's (M_p,) values, one after the other, (sum_p M_p,), where the counts differ between processes (the
    loss tokens of a micro-batch, for lib/losses.high_entropy_mask's threshold). Each process pads to the longest with
    -inf, which no entropy is, and the padding is dropped after the gather."""
    if accelerator.num_processes == 1:
        return values
    padded = accelerator.pad_across_processes(values, dim=0, pad_index=-math.inf)
    gathered = accelerator.gather(padded)
    return gathered[gathered > -math.inf]
