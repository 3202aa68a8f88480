"""Saving a run and stopping it safely: checkpoints and final/, the stop on a signal (SIGTERM / SIGUSR1) where resuming
is exact, and the non-finite guard (a reward, loss or gradient norm that is not finite moves no weight;
max_nonfinite_steps such steps in a row stop the run). The checkpoint format itself is lib/checkpoint.py; what to do
when a run stops is docs/faults.md.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import sys

from pathlib import Path

import torch
from accelerate.utils import gather_object
from tqdm.auto import tqdm

from lib import checkpoint as ckpt
from lib import distributed
from lib.config import to_dict
from lib.hub import write_final_files
from lib.sampling.context import Sampled
from lib.models.modeling import REFERENCE_FOLDER, end_token_ids
from lib.setup import Learner, Output, Sampler, TrainerState


def nonfinite_rewards(sampler: Sampler, sampled: Sampled, advantages: torch.Tensor) -> tuple[str, dict]:
    """(what was not finite, "" if nothing; the per-function counts to log). A reward of inf, -inf or NaN (None is not
    one: it means 'does not apply') makes every advantage of the batch meaningless, so no step trains on it."""
    names, accelerator = sampler.ctx.reward_names, sampler.accelerator
    local = torch.tensor([sampled.nonfinite.get(n, 0) for n in names], dtype=torch.float32,
                         device=accelerator.device)
    counts = accelerator.reduce(local, reduction="sum").tolist()
    reasons = []
    for column, name, count in zip(sampled.rewards.T, names, counts):
        if count:
            kinds = {"inf": int(torch.isposinf(column).sum()),
                     "-inf": int(torch.isneginf(column).sum())}
            # NaN: the explicit ones, not None's
            kinds["nan"] = max(int(count) - kinds["inf"] - kinds["-inf"], 0)
            seen = ", ".join(f"{number} x {kind}" for kind, number in kinds.items() if number)
            reasons.append(f"reward function '{name}' returned {seen or 'non-finite values'}")
    if not reasons and not torch.isfinite(advantages).all():
        reasons.append("the advantages (from finite rewards: a reward too large for float32 "
                       "arithmetic?)")
    return "; ".join(reasons), {f"nonfinite/rewards/{n}": c for n, c in zip(names, counts)}


def step_optimizer(learner: Learner, loss: torch.Tensor, skip_update: bool,
                   nonfinite: str) -> tuple[torch.Tensor, str, bool]:
    """The optimizer step after a slice's backward passes (train_agrpo.update_policy, phase 5): (the gradient norm
    before clipping, what was not finite or "", whether the weights moved). No step on a skipped slice or non-finite
    values (the batch's rewards, the loss, the gradient norm); the loss and the norm are reduced over every process,
    so all take the same decision. A DeepSpeed engine steps, clips and skips non-finite gradients in one call
    (lib/sharding/fsdp_deepspeed.Sharding.step). The schedule advances either way: it is laid out over steps, not updates."""
    cfg, accelerator = learner.cfg, learner.accelerator
    grad_norm, moved = torch.zeros(()), False
    deepspeed = learner.sharding is not None and learner.sharding.deepspeed
    if not skip_update:
        if deepspeed:
            grad_norm, moved = learner.sharding.step(learner.scorer)
        else:
            grad_norm = distributed.full_tensor(
                accelerator.clip_grad_norm_(learner.params, cfg.max_grad_norm) if cfg.max_grad_norm > 0 else
                distributed.grad_norm(learner.params, accelerator, learner.sharding is not None))
        if not torch.isfinite(loss):
            nonfinite = nonfinite or f"the loss ({float(loss)})"
        elif not torch.isfinite(grad_norm) and accelerator.scaler is None:
            nonfinite = nonfinite or f"the gradient norm ({float(grad_norm)})"
    if not skip_update and not nonfinite and not deepspeed:
        # under fp16 loss scaling (Accelerate's GradScaler) a gradient that overflowed is the scaler's to handle: its
        # step skips the update and lowers the scale (Micikevicius et al. 2018, section 3.2), and no step counts as
        # non-finite for that
        learner.optimizer.step()
        moved = not getattr(learner.optimizer, "step_was_skipped", False)
    learner.scheduler.step()
    learner.optimizer.zero_grad(set_to_none=True)
    return grad_norm, nonfinite, moved


def save_checkpoint(learner: Learner, output: Output, rollouts, state: TrainerState) -> None:
    """Phase 8: model (or adapter), optimizer, scheduler, RNG per process (with the sampler's, and the batches sampled
    ahead and not yet trained on: `rollouts`, lib/sampling/pipeline.py) and trainer state, written to a staging folder
    and renamed into place (lib/checkpoint.py). Never from non-finite weights. A write that fails (a full disk) on any
    process removes the staging folder, leaves the previous checkpoint whole and stops the run with the space a
    checkpoint needs."""
    accelerator, step = learner.accelerator, state.global_step
    main_process = accelerator.is_main_process
    check_finite_weights(learner, output.out, f"checkpoint-{step}")
    staging = ckpt.staging_dir(output.out, step)
    error = None
    try:
        if main_process:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        accelerator.wait_for_everyone()
        ckpt.write_rng(staging, accelerator.process_index,
                       ckpt.rng_state(rollouts.state_dict()))
        if learner.sharding is not None:  # every process writes its shards of the model and the optimizer states
            learner.sharding.save(learner.scorer, learner.optimizer, staging)
        if main_process:
            if learner.sharding is None:
                accelerator.unwrap_model(learner.scorer).model.save_pretrained(staging)
                torch.save(learner.optimizer.state_dict(), staging / "optimizer.pt")
            if learner.cfg.sync_ref_model and step >= learner.cfg.ref_model_sync_steps:  # the reference has moved: an
                # exact resume needs it (lib/setup.load_models reads it back)
                learner.reference.model.save_pretrained(staging / REFERENCE_FOLDER)
            output.tokenizer.save_pretrained(staging)
            torch.save(learner.scheduler.state_dict(), staging / "scheduler.pt")
    except Exception as exc:  # noqa: BLE001 - OSError, or torch.save's RuntimeError around one
        error = f"{type(exc).__name__}: {exc}"
    error = first_error(learner.accelerator, error)
    if error is None and main_process:
        try:
            trainer_state = {**dataclasses.asdict(state), "config": to_dict(learner.cfg)}
            ckpt.commit_checkpoint(output.out, step, trainer_state, learner.cfg.save_total_limit)
        except OSError as exc:  # a full disk while writing trainer_state.json
            error = f"{type(exc).__name__}: {exc}"
    error = first_error(learner.accelerator, error)
    if error is not None:
        if main_process:
            shutil.rmtree(staging, ignore_errors=True)
        raise ckpt.RunStopped(save_failed_message(learner, output.out, f"checkpoint-{step}", error))
    if output.hub is not None:  # main process; in the background, never waited on here (docs/hub.md 3)
        output.hub.push_checkpoint(output.out / f"checkpoint-{step}", step)


def first_error(accelerator, error: str | None) -> str | None:
    """The first process's error, on every process (a collective: every process calls it at the same point)."""
    if accelerator.num_processes == 1:
        return error
    return next((e for e in gather_object([error]) if e is not None), None)


def check_finite_weights(learner: Learner, out: Path, what: str) -> None:
    """Refuse to save weights that are not finite (the trained ones; frozen ones never change). Every process calls it:
    sharded, each checks its shards and all take the same decision."""
    finite = all(bool(torch.isfinite(distributed.local_tensor(p)).all()) for p in learner.params)
    if learner.sharding is not None:
        votes = torch.tensor(float(finite), device=learner.accelerator.device)
        agreed = learner.accelerator.reduce(votes, reduction="sum")
        finite = bool(agreed == learner.accelerator.num_processes)
    if not finite:
        last = getattr(ckpt.latest_checkpoint(out), "name", "none")
        raise ckpt.RunStopped(f"{what} not written: the weights are not finite (an optimizer step "
                              f"on finite gradients overflowed: lower learning_rate). The last "
                              f"checkpoint is {last}")


def stop_if_nonfinite(output: Output, state: TrainerState, reason: str) -> None:
    """Say that a step was skipped for a non-finite value; stop after max_nonfinite_steps in a row."""
    cfg, step = output.cfg, state.global_step
    if output.accelerator.is_main_process:
        tqdm.write(f"step {step}: optimizer step skipped, the weights unchanged: {reason} not "
                   f"finite ({state.nonfinite_streak} of max_nonfinite_steps "
                   f"{cfg.max_nonfinite_steps} in a row)")
    if state.nonfinite_streak >= cfg.max_nonfinite_steps:
        latest = ckpt.latest_checkpoint(output.out)
        raise ckpt.RunStopped(
            f"step {step}: {state.nonfinite_streak} optimizer steps in a row skipped for "
            f"non-finite values, the last because {reason} was not finite (max_nonfinite_steps "
            f"{cfg.max_nonfinite_steps}). No weight was updated from them and final/ was not "
            f"written; the last checkpoint is "
            f"{latest.name if latest else 'none'}. Fix the cause (docs/faults.md) and resume with "
            f"--resume_from_checkpoint latest")


def stop_requested(output: Output) -> str | None:
    """The stop signal any process received (SIGTERM / SIGUSR1), the same answer on every process."""
    name = output.stop.signal_name
    if output.accelerator.num_processes > 1:
        names = ckpt.StopRequest.SIGNALS
        index = output.accelerator.reduce(torch.tensor(names.index(name) + 1 if name else 0,
                                                    device=output.accelerator.device), reduction="max")
        name = names[int(index) - 1] if int(index) else None
    return name


def stop_for_signal(learner: Learner, output: Output, rollouts, state: TrainerState, signal_name: str,
                    saved: bool) -> None:
    """Preemption: a checkpoint at this step (resuming from it is exact) and a stop."""
    if not saved:
        save_checkpoint(learner, output, rollouts, state)
    raise ckpt.RunStopped(f"{signal_name} received: stopped at step {state.global_step} of "
                          f"{learner.cfg.max_steps} with checkpoint-{state.global_step} written; "
                          f"continue with --resume_from_checkpoint latest",
                          exit_code=128 + int(getattr(signal, signal_name)))


def save_final(learner: Learner, output: Output, end_eval: dict, step: int) -> None:
    """final/: a model (or adapter) folder that transformers / peft load as is, renamed into place, with
    lib/hub.write_final_files's model card and generation_config.json written in before the rename (docs/hub.md 2)."""
    check_finite_weights(learner, output.out, "final/")
    # sharded: the whole model gathered on the main process (a collective), saved as one folder
    state = learner.sharding.full_state_dict(learner.scorer) if learner.sharding is not None else None
    if learner.accelerator.is_main_process:
        final, staging = output.out / "final", output.out / ".final.partial"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            model = learner.accelerator.unwrap_model(learner.scorer).model
            if state is not None:  # a tied output layer is one parameter: saved once, as
                # save_pretrained does
                kept = {name for name, _ in model.named_parameters()} \
                    | {name for name, _ in model.named_buffers()}
                model.save_pretrained(staging, state_dict={
                    name: v for k, v in state.items()
                    if (name := k.removeprefix("model.")) in kept})
            else:
                model.save_pretrained(staging)
            output.tokenizer.save_pretrained(staging)
            # the model card and the sampling the run trained with go in before the rename, so that final/ never
            # exists without them (docs/hub.md 2)
            write_final_files(staging, learner.cfg, end_ids=end_token_ids(learner.policy, output.tokenizer),
                              generation_config=getattr(learner.policy, "generation_config", None),
                              adapter=hasattr(model, "peft_config"), metrics_path=output.out / "metrics.jsonl",
                              after=end_eval, step=step, argv=sys.argv, num_processes=learner.accelerator.num_processes,
                              repo_id=output.hub.target.repo_id if output.hub else None)
        # a full disk (safetensors raises either): the checkpoint is whole
        except (OSError, RuntimeError) as exc:
            shutil.rmtree(staging, ignore_errors=True)
            message = save_failed_message(learner, output.out, "final/", f"{type(exc).__name__}: {exc}")
            raise ckpt.RunStopped(message) from exc
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        score_text = f"accuracy {end_eval['eval/accuracy']:.3f}; " if end_eval else ""
        tqdm.write(f"eval step {step}: {score_text}final model in {final}")
    learner.accelerator.wait_for_everyone()
    if output.hub is not None:  # main process, after the barrier: the others do not wait on the upload
        error = output.hub.push_final(output.out / "final", step)
        if error is not None:
            raise ckpt.RunStopped(error)


def folder_bytes(folder: str | Path) -> int:
    """The bytes of the files under `folder` (a checkpoint's size)."""
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())


def save_failed_message(learner: Learner, out: Path, what: str, error: str) -> str:
    """The message a run stops with when `what` (checkpoint-<step>, final/) could not be written, `error` the cause:
    out of space where a checkpoint (the last one's size, else the weights and optimizer states) needs more than is
    free, and the checkpoint a resume starts from."""
    unwrapped = learner.accelerator.unwrap_model(learner.scorer).model
    previous = ckpt.latest_checkpoint(out)
    if previous is not None:
        needed = folder_bytes(previous)
    else:  # model (adapter) and optimizer states, as written
        weights = learner.params if hasattr(unwrapped, "peft_config") \
            else list(unwrapped.state_dict().values())
        states = [v for s in learner.optimizer.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor)]
        needed = sum(t.numel() * t.element_size() for t in [*weights, *states])
    free = shutil.disk_usage(out).free
    cause = f"out of space; {error}" if free < needed else error
    kept = f"{previous.name} is whole" if previous else "no earlier checkpoint exists"
    return (f"{what} could not be written to '{out}' ({cause}). A checkpoint needs about "
            f"{needed / 2**20:.1f} MiB; {free / 2**20:.1f} MiB are free. The partial files were "
            f"removed and {kept}. Free some space and resume with --resume_from_checkpoint latest")
