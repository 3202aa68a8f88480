"""Several processes through Accelerate: what every launch needs, data parallel or sharded (docs/distributed.md 1 and
2). A sharded launch's preparation, checkpoints and DeepSpeed's backward and step are lib/sharding/fsdp_deepspeed.py's; the
core keeps a sharded parameter's full value and this process's part of it (the sampler's weights, the gradient norm,
the finite-weights check) and small collectives. Every function that gathers is a collective: each process calls it at
the same point with the same arguments.
"""
from __future__ import annotations

import atexit
import ctypes
import math
import os
import sys
import threading

import torch
from accelerate import Accelerator


def zero3_partitioned(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a parameter DeepSpeed ZeRO-3 partitions (each process holds its `ds_tensor`)."""
    return getattr(tensor, "ds_id", None) is not None and hasattr(tensor, "ds_status")


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded parameter's full value (an all-gather: a collective; under ZeRO-3 a detached copy, since the gathered
    storage is released again); any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        return tensor.full_tensor()
    if zero3_partitioned(tensor):
        import deepspeed

        with deepspeed.zero.GatheredParameters([tensor]):
            return tensor.detach().clone()
    return tensor


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This process's shard of a sharded tensor (a ZeRO-3 parameter's partition); any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        return tensor.to_local()
    return tensor.ds_tensor if zero3_partitioned(tensor) else tensor


def grad_norm(params: list[torch.nn.Parameter], accelerator: Accelerator, sharded: bool) -> torch.Tensor:
    """The L2 norm of all gradients, without clipping: from each process's shards when sharded (their squared sums added
    over the processes), else from the (already all-reduced) full gradients."""
    squares = sum((local_tensor(p.grad.detach()).float() ** 2).sum() for p in params if p.grad is not None)
    squares = torch.as_tensor(squares, device=accelerator.device)
    if sharded:
        squares = accelerator.reduce(squares, reduction="sum")
    return torch.sqrt(squares)


def group_token_means(accelerator: Accelerator, values: torch.Tensor, mask: torch.Tensor,
                      group_size: int) -> list[float]:
    """Token mean of a (B_local, T) per-token quantity over each prompt group of the global batch (the trainer's
    AGPO-DSF statistics)."""
    width = min(values.shape[1], mask.shape[1])
    sums = torch.stack([(values[:, :width] * mask[:, :width]).sum(1),
                        mask[:, :width].sum(1).float()], dim=1)
    sums = accelerator.gather(sums).view(-1, group_size, 2).sum(1)
    return (sums[:, 0] / sums[:, 1].clamp(min=1)).tolist()


def reduce_extremes(accelerator: Accelerator, maxima: dict[str, torch.Tensor],
                    minima: dict[str, torch.Tensor]) -> dict[str, float]:
    """The largest of each of `maxima`'s values over the processes, and the smallest of each of `minima`'s, in one
    reduction (a minimum is the maximum of the negated values); {} for none."""
    if not maxima and not minima:
        return {}
    highs = accelerator.reduce(torch.stack([*maxima.values(), *(-v for v in minima.values())]), reduction="max")
    signs = [1.0] * len(maxima) + [-1.0] * len(minima)
    return {k: float(sign * v) for k, sign, v in zip([*maxima, *minima], signs, highs)}


def gather_ragged(accelerator: Accelerator, values: torch.Tensor) -> torch.Tensor:
    """Every process's (M_p,) values, one after the other, (sum_p M_p,), where the counts differ between processes (the
    loss tokens of a micro-batch, for lib/methods/losses.high_entropy_mask's threshold). Each process pads to the longest with
    -inf, which no entropy is, and the padding is dropped after the gather."""
    if accelerator.num_processes == 1:
        return values
    padded = accelerator.pad_across_processes(values, dim=0, pad_index=-math.inf)
    gathered = accelerator.gather(padded)
    return gathered[gathered > -math.inf]


def keep_gloo_groups_to_exit() -> None:
    """At a launch's end, before Accelerate's `end_training` destroys the process groups: gloo's groups stay alive
    until the process exits. `destroy_process_group` unregisters a group, but FSDP2 leaves it referenced from DTensor's
    caches (through the parameters' device mesh), so the interpreter's own shutdown frees it, joining its worker
    threads while Python is half torn down; now and then that aborts a process that has written everything
    ("terminate called without an active exception", exit code -6 from accelerate launch: seen once on CI, with two
    CPU processes). With one reference Python never gives back, the group is never freed and its idle threads end with
    the process. NCCL's groups are shut down by `destroy_process_group` itself and are left to it."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return
    for group in list(dist.distributed_c10d._world.pg_map):
        if "gloo" in str(dist.get_backend(group)):
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))


def launched_processes() -> int:
    """The processes `accelerate launch` or torchrun started for this run (WORLD_SIZE; 1 when run directly)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def end_launched_process() -> None:
    """The last call of a process `accelerate launch` (or torchrun) started, once its run has ended without an error:
    every file written and closed, the process groups destroyed or kept (`keep_gloo_groups_to_exit`). The process
    ends as the interpreter would end it (its other threads joined, the exit handlers run, the output flushed) but
    without the interpreter's own teardown (`os._exit`). In that teardown a gloo thread that lets go of a finished
    operation's tensors takes the interpreter's lock while the interpreter is being finalised, and the C++ runtime
    aborts the process ("terminate called without an active exception", exit -6; PyTorch pull request 179291 describes
    it): a DeepSpeed ZeRO-2 run on two CPU processes that had written everything, its final model included, failed
    so once in the suite (2026-11-29). A process that was not launched (WORLD_SIZE unset or 1) returns."""
    if launched_processes() <= 1:
        return
    for thread in threading.enumerate():  # what the interpreter's exit waits for: its threads that are not daemons
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # the trackers', logging's, temporary folders' handlers
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
