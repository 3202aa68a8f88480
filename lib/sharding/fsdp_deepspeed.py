"""FSDP2 and DeepSpeed ZeRO-2 / ZeRO-3 through Accelerate (docs/distributed.md 1 and 1.1: what is sharded and how; 2:
the same code on a CPU over gloo). What the trainer adds around Accelerate for a sharded launch: its checks and
settings, the reference sharded like the policy, sharded checkpoints, DeepSpeed's backward and step. lib/setup.start_accelerator
calls `start`, which returns None for a single process or data parallelism, and keeps the `Sharding` it returns for a
sharded launch as Learner.sharding. lib/distributed.py keeps what every launch needs (lib/distributed.py: a
sharded parameter's full value, small collectives)."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from tqdm.auto import tqdm

from lib.config import Config, ConfigError
from lib.distributed import local_tensor, zero3_partitioned

DEEPSPEED_TAG = "deepspeed"  # the sub-folder of a checkpoint that DeepSpeed's save_checkpoint writes
MODEL_SHARDS = "pytorch_model_fsdp_0"  # the folder Accelerate's save_fsdp_model writes (model_index 0)
OPTIMIZER_SHARDS = "optimizer_0"


class ShardingError(ValueError):
    """A launch configuration the sharded trainer does not support, with the fix."""


def fsdp_requested() -> bool:
    """Whether `accelerate launch` was given an FSDP configuration (it exports ACCELERATE_USE_FSDP)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def deepspeed_requested() -> bool:
    """Whether `accelerate launch` was given a DeepSpeed configuration (it exports ACCELERATE_USE_DEEPSPEED)."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def is_deepspeed(accelerator: Accelerator) -> bool:
    return accelerator.distributed_type == DistributedType.DEEPSPEED


def zero_stage(accelerator: Accelerator) -> int:
    """DeepSpeed's ZeRO stage; 0 without DeepSpeed."""
    return int(accelerator.state.deepspeed_plugin.zero_stage) if is_deepspeed(accelerator) else 0


def start(accelerator: Accelerator, cfg: Config, bf16: bool) -> Sharding | None:
    """The launch's sharding, checked against the configuration before any model loads, or None for one process or
    data parallelism. FSDP2 and DeepSpeed run on a CPU too, where Accelerate would not run them
    (enable_deepspeed_on_cpu, enable_fsdp_on_cpu). Raises ConfigError with the fix."""
    try:
        enable_deepspeed_on_cpu(accelerator)
        enable_fsdp_on_cpu(accelerator)
        check_supported(accelerator, use_peft=cfg.use_peft, load_in_4bit=cfg.load_in_4bit)
    except ShardingError as error:
        raise ConfigError(str(error)) from None
    if accelerator.distributed_type not in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        return None
    if is_deepspeed(accelerator):
        configure_deepspeed(accelerator, micro_batch=cfg.per_device_train_batch_size,
                            accumulation=cfg.gradient_accumulation_steps, max_grad_norm=cfg.max_grad_norm, bf16=bf16)
    return Sharding(accelerator)


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
    if accelerator.distributed_type != DistributedType.FSDP:
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


def describe_sharding(model: torch.nn.Module, world: int, stage: int = 0) -> str:
    """One line: how many FSDP units the model has (or which ZeRO stage) and how much of its weights this process
    holds."""
    if stage:
        params = list(model.parameters())
        whole = sum((p.ds_numel if zero3_partitioned(p) else p.numel()) * p.element_size() for p in params)
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


class Sharding:
    """What the core does differently for a sharded launch (FSDP2, or DeepSpeed at any ZeRO stage: its optimizer states
    are partitioned, and the trainer treats its engine the way it treats a sharded model), bound to its accelerator.
    lib/setup.py and lib/save_and_stop.py call it where Learner.sharding is not None."""

    def __init__(self, accelerator: Accelerator):
        self.accelerator = accelerator
        self.deepspeed = is_deepspeed(accelerator)  # the engine steps, clips and skips non-finite gradients itself
        self.stage = zero_stage(accelerator)
        # each process holds only part of the weights (FSDP2, ZeRO-3): the model's calls are then collectives, and
        # the sampler and the reference need gathered weights
        self.partitioned = not self.deepspeed or self.stage == 3

    def shard_frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        """Shard a frozen model (the reference) like the policy: each decoder layer a unit, the rest in the root unit,
        with the plugin's mixed precision, resharded after each forward. In place; returns the model."""
        if self.deepspeed:
            return self._partition_frozen(model)
        from torch.distributed.fsdp import fully_shard

        plugin = self.accelerator.state.fsdp_plugin
        options = {"reshard_after_forward": True}
        if plugin.mixed_precision_policy is not None:
            options["mp_policy"] = plugin.mixed_precision_policy
        units = _unit_classes(model, self.accelerator)
        for module in [m for m in model.modules() if isinstance(m, units)]:
            fully_shard(module, **options)
        fully_shard(model, **options)
        return model

    def _partition_frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        """The reference under DeepSpeed: partitioned over the processes by an inference-only ZeRO-3 engine of the same
        config (its weights gathered a module at a time in each forward); under ZeRO-2, whose weights are whole on
        every process, left as it is. Returns the module to call."""
        if self.stage != 3:
            return model
        import copy

        import deepspeed

        config = copy.deepcopy(self.accelerator.state.deepspeed_plugin.deepspeed_config)
        for key in ("optimizer", "scheduler"):
            config.pop(key, None)
        engine, *_ = deepspeed.initialize(model=model, config=config)
        engine.eval()  # (the engine's eval returns None, not the module)
        return engine

    def prepare(self, scorer: torch.nn.Module, optimizer, scheduler) -> tuple[torch.nn.Module, object, object]:
        """FSDP2: the scorer's decoder layers sharded, the optimizer given the shards; or a DeepSpeed engine, whose
        optimizer follows the trainer's scheduler's rates (the scheduler stays the trainer's, unprepared). The main
        process says how the policy is sharded."""
        accelerator = self.accelerator
        if self.deepspeed:
            scorer, optimizer = accelerator.prepare(scorer, optimizer)
        else:
            scorer, optimizer, scheduler = accelerator.prepare(scorer, optimizer, scheduler)
        if accelerator.is_main_process:
            tqdm.write(describe_sharding(scorer, accelerator.num_processes, self.stage))
        return scorer, optimizer, scheduler

    def backward(self, model: torch.nn.Module, loss: torch.Tensor, last: bool) -> None:
        """The backward pass of one micro-batch's loss. A DeepSpeed engine is told whether this is the slice's last
        micro-batch (where it reduces the accumulated gradients) and does not rescale the loss, which the trainer has
        already divided for accumulation (lib/methods/losses.aggregate_loss); the step is `step`'s."""
        if self.deepspeed:
            model.set_gradient_accumulation_boundary(last)
            model.backward(loss, scale_wrt_gas=False)
        else:
            self.accelerator.backward(loss)

    def step(self, model) -> tuple[torch.Tensor, bool]:
        """DeepSpeed's optimizer step: the global gradient norm (before clipping) and whether the weights moved.
        DeepSpeed clips to gradient_clipping (configure_deepspeed) and skips a step whose gradients are not finite."""
        model.step()
        norm = model.get_global_grad_norm()
        norm = torch.as_tensor(float("nan") if norm is None else float(norm))
        return norm, not bool(getattr(model.optimizer, "overflow", False)) and bool(torch.isfinite(norm))

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's state on the main process (CPU tensors; empty elsewhere), for final/'s safetensors."""
        if self.deepspeed:  # ZeRO-3: gathered on the main process (stage3_gather_16bit_weights_on_model_save)
            state = self.accelerator.get_state_dict(model)  # None on the other processes
            return {k: v.cpu() for k, v in (state or {}).items()}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def save(self, model: torch.nn.Module, optimizer, folder: Path) -> None:
        """The model's and the optimizer's shards into `folder` (torch.distributed.checkpoint; every process writes its
        own)."""
        if self.deepspeed:  # model states and each process's optimizer partition, in DEEPSPEED_TAG/
            model.save_checkpoint(str(folder), tag=DEEPSPEED_TAG, save_latest=False)
            return
        from accelerate.utils import save_fsdp_model, save_fsdp_optimizer

        plugin = self.accelerator.state.fsdp_plugin
        save_fsdp_model(plugin, self.accelerator, model, str(folder))
        save_fsdp_optimizer(plugin, self.accelerator, optimizer, model, str(folder))

    def load(self, model: torch.nn.Module, optimizer, folder: Path) -> None:
        """Read what `save` wrote back into the sharded model and optimizer."""
        if self.deepspeed:
            if not (folder / DEEPSPEED_TAG).is_dir():
                raise ShardingError(f"resume_from_checkpoint: {folder.name} holds no DeepSpeed states "
                                    f"({DEEPSPEED_TAG}/): it was written by a run without DeepSpeed. Resume it with "
                                    f"the launch it was written with")
            loaded, _ = model.load_checkpoint(str(folder), tag=DEEPSPEED_TAG, load_optimizer_states=True,
                                              load_lr_scheduler_states=False)
            if loaded is None:
                raise ShardingError(f"resume_from_checkpoint: DeepSpeed could not read {folder.name}/{DEEPSPEED_TAG}")
            return
        from accelerate.utils import load_fsdp_model, load_fsdp_optimizer

        if not any(path.name.startswith("pytorch_model_fsdp") for path in folder.iterdir()):
            raise ShardingError(f"resume_from_checkpoint: {folder.name} holds no sharded model ({MODEL_SHARDS}/): it "
                                f"was written by a run without FSDP. Resume it with the launch it was written with")
        plugin = self.accelerator.state.fsdp_plugin
        load_fsdp_model(plugin, self.accelerator, model, str(folder))
        load_fsdp_optimizer(plugin, self.accelerator, optimizer, model, str(folder))
