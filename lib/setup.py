"""Building a run: everything train_agrpo.py does before its first step, and what the loop reads.

`Run` holds what set-up builds, in three parts that the phases take as they read them: the `Learner` (the policy, its
scorer, the reference, the objective, the optimizer and scheduler: the update), the `Sampler` (the engine, the data and
rewards' context, the method: sampling and scoring) and the `Output` (the run folder, the tokenizer, the health watch,
the hub, the stop request: logs and saves); `TrainerState` what the loop advances and a checkpoint saves; `Geometry`
the batch sizes. The functions below are the set-up's steps, which train_agrpo.setup calls in the order that fails fastest:
configuration and data errors before any model loads, the memory check before any sampling.

Each step imports the parts it builds from the rooms below (lib/sharding for FSDP2 / DeepSpeed and the 8-bit optimizer,
lib/models for the embedded model and TRL's float32 output layer, lib/data for the built-in task and hub data sets,
lib/rewards for open-r1's rewards, lib/sampling for the sampler's copy of the policy): the entry script calls the steps
with the settings and what earlier steps returned, nothing else.
"""

from __future__ import annotations

import dataclasses
import math
import gc
import json
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from tqdm.auto import tqdm
from transformers.utils import logging as hf_logging

from lib import checkpoint as ckpt
from lib import distributed
from lib.config import Config, ConfigError, save_yaml, validate
from lib.data import hub_data
from lib.data.records import check_answers, load_records, render_prompt, split_names
from lib.data.word_problems import builtin_task
from lib.methods.losses import ObjectiveSettings
from lib.methods.registry import Method
from lib.sampling.context import RolloutContext
from lib.models.modeling import (REFERENCE_FOLDER, CompletionScorer, is_adapter_folder, load_policy,
                          load_reference, load_tokenizer, pad_cat, reference_dtype, training_precision, weights_dtype)
from lib.models.embedded import resolve_model_path
from lib.models import checkpointed_prefix
from lib.models.fp32_head import cast_lm_head_to_fp32
from lib.models import reward_models
from lib.models.reward_models import reward_functions
from lib.rewards.open_r1 import REWARD_FUNCS, reward_options
from lib.sampling.engines import make_engine
from lib.sampling.rollout import AnswerPhase, HFRollout, Rollout
from lib.schedule import build_scheduler, steps_per_rollout, warmup_steps
from lib.sharding import fsdp_deepspeed
from lib.sharding.memory import copy_headroom, eight_bit_adamw
from lib.sampling.vllm_rollout import judge_sampling_logps, logp_gap_sums

# the run's JSON-lines logs (lib/logs.py), trimmed to the checkpoint on resume
RUN_LOGS = ("metrics.jsonl", "completions.jsonl", "warnings.jsonl")


@dataclass
class TrainerState:
    """What the loop advances; saved as trainer_state.json in every checkpoint and restored on resume."""

    global_step: int = 0
    data_position: int = 0  # prompts taken from the data order so far (lib/data/records.prompts_for_step)
    num_tokens: int = 0  # tokens generated on all processes, probes and discarded rounds included
    controller_state: dict = dataclasses.field(default_factory=dict)
    nonfinite_streak: int = 0  # optimizer steps skipped in a row for non-finite values


@dataclass(frozen=True)
class Geometry:
    """Batch geometry, TRL semantics: per_device_train_batch_size counts completions; the group size may change from one
    generation batch to the next (adaptive_group_size), the batch size never does. A generation batch serves
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
        local_rollout = cfg.local_generation_batch
        micro = [slice(i, i + cfg.per_device_train_batch_size)
                 for i in range(0, local_rollout, cfg.per_device_train_batch_size)]
        return cls(world, local, local * world, local_rollout, rank * local_rollout,
                   steps_per_rollout(cfg), micro)


@dataclass
class Learner:
    """What the policy update (phase 5) reads and changes, and what a checkpoint saves of the model: the policy, its
    scorer, the reference, the objective's settings, the optimizer and the scheduler."""

    cfg: Config
    accelerator: Accelerator
    geometry: Geometry
    policy: torch.nn.Module  # the model being trained (PEFT-wrapped with LoRA)
    scorer: torch.nn.Module  # CompletionScorer(policy), prepared by Accelerate (DDP, FSDP2, ...)
    reference: CompletionScorer | None  # frozen; None when beta is 0 or with LoRA (the adapter off)
    objective: ObjectiveSettings  # what shapes the per-token loss (lib/methods/losses.policy_objective)
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: object
    # FSDP2 / DeepSpeed (weights, gradients, optimizer states sharded): lib/sharding/fsdp_deepspeed.Sharding; else None
    sharding: object = None
    # an optimizer step moved the policy's weights since the sampler last got them (`ready_sampler` pushes them)
    weights_moved: bool = False

    @property
    def model(self) -> torch.nn.Module:
        """The policy's causal LM as it trains, unwrapped from Accelerate's wrapper and the scorer."""
        return self.accelerator.unwrap_model(self.scorer).model


@dataclass
class Sampler:
    """What sampling and scoring (phases 1-3) read: the sampler (`engine`: lib/sampling/rollout.HFRollout, or one with
    its interface: VLLMRollout, ServerRollout), the context (data, reward functions, the reward worker, an agent) and
    the method's parts (refill, advantages, controllers)."""

    cfg: Config
    accelerator: Accelerator
    geometry: Geometry
    engine: HFRollout
    ctx: RolloutContext
    method: Method
    # the first generation batch with sampling log-probs was checked against the learner's (`check_first_batch`)
    checked: bool = False
    # where the loop's generation batches come from: lib/sampling/pipeline.Synchronous or .Asynchronous (max_staleness)
    rollouts: object = None


@dataclass
class Output:
    """Where a run writes (phases 7-8, checkpoints, final/): the run folder, the tokenizer saved with the model, the
    health warnings' history (lib/apps/health.Watch), push_to_hub's uploads (lib/hub.HubPusher, main process, or None)
    and the stop request (SIGTERM / SIGUSR1 received)."""

    cfg: Config
    accelerator: Accelerator
    out: Path
    tokenizer: object
    stop: ckpt.StopRequest
    watch: object = None
    hub: object = None


@dataclass
class Run:
    """A run's parts as set-up builds them; the loop hands each phase the parts it reads."""

    learner: Learner
    sampler: Sampler
    output: Output
    eval_records: list[dict]

    @property
    def cfg(self) -> Config:
        return self.learner.cfg

    @property
    def accelerator(self) -> Accelerator:
        return self.learner.accelerator


def start_accelerator(cfg: Config) -> tuple[Accelerator, bool, object, bool]:
    """The Accelerator as launched (data parallel, FSDP2 or DeepSpeed), its launch checked against the configuration
    (lib/sharding/fsdp_deepspeed starts FSDP2 and DeepSpeed launches). Returns
    (accelerator, bf16, the launch's lib/sharding/fsdp_deepspeed.Sharding or None, partitioned): partitioned where each process
    holds only part of the weights (FSDP2, ZeRO-3)."""
    hf_logging.disable_progress_bar()  # per-file loading bars would drown the one training bar
    try:  # bf16 / fp16 autocast or fp32, from the card where the configuration leaves it open
        precision = training_precision("cuda" if torch.cuda.is_available() and not cfg.use_cpu else "cpu",
                                       bf16=cfg.bf16, fp16=cfg.fp16)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    bf16 = precision == "bf16"
    # with no accelerator, say cpu=True: that is what makes Accelerate form a gloo group (MULTI_CPU) when launched
    # with several processes, instead of running each process alone (except under DeepSpeed, which forms the group
    # itself: lib/sharding/fsdp_deepspeed.enable_deepspeed_on_cpu). The scheduler is stepped by us once per optimizer step:
    # its Accelerate wrapper must not step it once per process
    accelerator = Accelerator(cpu=(cfg.use_cpu or torch.accelerator.current_accelerator() is None)
                              and not fsdp_deepspeed.deepspeed_requested(),
                              # fp16: Accelerate's autocast and loss scaling (a GradScaler behind backward, the
                              # gradient clip and the optimizer's step; lib/save_and_stop.step_optimizer)
                              mixed_precision=precision if precision != "fp32" else "no",
                              step_scheduler_with_optimizer=False, log_with=cfg.report_to or None,
                              project_dir=cfg.output_dir)
    # FSDP2 / DeepSpeed, checked and configured (on a CPU too, where Accelerate would not run them)
    launch = fsdp_deepspeed.start(accelerator, cfg, bf16)
    validate(cfg, accelerator.num_processes)  # the settings that depend on the number of processes
    if cfg.tf32 is not None and accelerator.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = cfg.tf32
    return accelerator, bf16, launch, launch is not None and launch.partitioned


def resolve_rewards(cfg: Config) -> tuple[list[str], list]:
    """(the reward specs the reward worker resolves, None for a reward model, the resolved functions): bad names stop
    here, before any data or model loads. The first half of lib/models/reward_models.build_rewards, the builder the
    evaluator and the chat page call whole: names are the built-ins and open-r1's (lib/rewards/open_r1.py, with the
    configuration's options); a folder or hub id is a reward model, which `load_rewards` loads later, onto each
    process's device, and which runs in this process."""
    # TRL's script puts reward_model_name_or_path first; a folder or hub id in reward_funcs is a reward model too
    specs = [cfg.reward_model_name_or_path] * bool(cfg.reward_model_name_or_path) + cfg.reward_funcs
    try:
        reward_funcs = reward_functions(specs, reward_options(cfg))
    except ValueError as error:
        raise ConfigError(f"reward_funcs: {error}") from error
    names = [name for name, _ in reward_funcs]
    if cfg.correctness_reward not in names and (
            cfg.homogeneous_advantage > 0 or cfg.resample_schedule or cfg.dynamic_sampling_rounds):
        raise ConfigError(f"correctness_reward: '{cfg.correctness_reward}' is not among "
                          f"reward_funcs {names}; homogeneous_advantage, resample_schedule and "
                          f"dynamic_sampling_rounds judge correctness with it. Add it to "
                          f"reward_funcs or name another function")
    in_process = [getattr(func, "in_process", False) for _, func in reward_funcs]  # a reward model runs here
    return [None if here else spec for spec, here in zip(specs, in_process)], reward_funcs


def load_rewards(cfg: Config, reward_funcs: list, device: torch.device) -> list:
    """The second half of lib/models/reward_models.build_rewards: the reward models loaded onto this process's device,
    scoring a micro-batch at a time; loaded before the memory check, which counts them as resident."""
    try:
        return reward_models.load_rewards(cfg, reward_funcs, device, cfg.per_device_train_batch_size)
    except ValueError as error:
        raise ConfigError(f"reward_funcs: {error}") from error


def load_data(cfg: Config, reward_funcs: list = (), say=print) -> tuple[list[dict], list[dict]]:
    """(train records, eval records). Errors in the data surface here, before any model is loaded; so does a data set
    with no gold answer trained with a reward function that needs one (lib/data/records.check_answers, which names the
    built-in rewards that need none).

    The held-out set is eval_dataset_name; else dataset_name's dataset_test_split where it has one (a folder or a hub
    data set, as TRL evaluates on it); else, for a single file, a seeded share of its rows. Held-out data with no gold
    answer cannot be scored: the evaluation is left out, and `say` says so in one line. Hub ids and the folders only
    `datasets` reads go through lib/data/hub_data.py; a run without dataset_name trains on the built-in task
    (lib/data/word_problems.builtin_task)."""
    reader = hub_data
    try:
        if cfg.dataset_name is None:
            return builtin_task(seed=cfg.seed, num_train=cfg.builtin_num_train, num_eval=cfg.num_eval_samples)
        columns = dict(prompt_column=cfg.prompt_column, answer_column=cfg.answer_column,
                       skip_invalid_rows=cfg.skip_invalid_rows, reader=reader)
        train = load_records(cfg.dataset_name, split=cfg.dataset_train_split,
                             max_samples=cfg.max_train_samples, seed=cfg.seed,
                             config=cfg.dataset_config, **columns)
        check_answers(train, reward_funcs, "dataset_name", cfg.dataset_name, REWARD_FUNCS)
        evals, source = [], cfg.eval_dataset_name or cfg.dataset_name
        if cfg.num_eval_samples == 0:
            source = None  # no evaluation asked for
        elif cfg.eval_dataset_name:
            # dataset_config names a configuration of dataset_name (TRL's ScriptArguments); this set is read with
            # its default one
            evals = load_records(cfg.eval_dataset_name, split=cfg.dataset_test_split,
                                 max_samples=cfg.num_eval_samples, seed=cfg.seed, **columns)
        elif cfg.dataset_test_split != cfg.dataset_train_split and cfg.dataset_test_split in (
                split_names(cfg.dataset_name, cfg.dataset_config, reader) or ()):
            evals = load_records(cfg.dataset_name, split=cfg.dataset_test_split,
                                 max_samples=cfg.num_eval_samples, seed=cfg.seed,
                                 config=cfg.dataset_config, **columns)
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
        say(f"evaluation skipped: '{source}' has no gold answer column (answer, solution, Answer "
            f"or target; --answer_column names another), so held-out accuracy cannot be scored")
        evals = []
    return train, evals


def prepare_output_dir(cfg: Config, accelerator: Accelerator) -> Path | None:
    """Refuse to write over an existing run unless asked; returns the checkpoint to resume from, if any."""
    out = Path(cfg.output_dir)
    try:  # every process: on several nodes each writes its RNG state into the same folder
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write_test_{accelerator.process_index}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise ConfigError(f"output_dir: cannot create or write '{out}' "
                          f"({error.strerror or error}); pass a folder you can write to") from error
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
            tqdm.write(f"resume_from_checkpoint: 'latest' found no checkpoint in '{out}': "
                       f"starting from step 0")
            for name in RUN_LOGS:
                ckpt.trim_jsonl(out / name, 0)
    elif cfg.resume_from_checkpoint:
        resume = Path(cfg.resume_from_checkpoint)
    holds_run = (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").stat().st_size > 0 \
        or bool(ckpt.list_checkpoints(out))
    if holds_run and resume is None and not cfg.overwrite_output_dir:
        raise ConfigError(f"output_dir: '{out}' already holds a run. Pass --resume_from_checkpoint "
                          f"latest to continue it, --overwrite_output_dir true to start over, or "
                          f"another --output_dir")
    if accelerator.is_main_process:
        if holds_run and resume is None:  # overwrite_output_dir: start over, explicitly asked for
            for old in [*ckpt.list_checkpoints(out), out / "final"]:
                shutil.rmtree(old, ignore_errors=True)
            for name in RUN_LOGS:
                (out / name).unlink(missing_ok=True)
        if resume is not None:  # lines written after the checkpoint are redone: set them aside
            step = ckpt.read_trainer_state(resume)["global_step"]
            for name in RUN_LOGS:
                ckpt.trim_jsonl(out / name, step)
    accelerator.wait_for_everyone()
    return resume


def record_and_seed(cfg: Config, accelerator: Accelerator) -> Path:
    """config.yaml in output_dir (the main process), then Python, NumPy and torch seeded; returns output_dir."""
    out = Path(cfg.output_dir)
    if accelerator.is_main_process:
        save_yaml(cfg, out / "config.yaml")
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    return out


def load_checked_tokenizer(cfg: Config, model_path: str, records: list[dict]):
    """The tokenizer (with the configuration's chat template), checked to render the data's prompts: a conversation
    needs a chat template, said before the model loads."""
    tokenizer = load_tokenizer(model_path, trust_remote_code=cfg.trust_remote_code,
                               revision=cfg.model_revision)
    if cfg.chat_template is not None:
        tokenizer.chat_template = cfg.chat_template
    try:  # a conversation needs a chat template: say so before the model loads
        for record in records:
            render_prompt(tokenizer, record, cfg.instruction, cfg.system_prompt,
                          cfg.chat_template_kwargs)
    except ValueError as error:
        raise ConfigError(f"dataset_name: {error}") from error
    return tokenizer


def load_models(cfg: Config, accelerator: Accelerator, model_path: str, resume: Path | None,
                bf16: bool, sharding, partitioned: bool) -> tuple[torch.nn.Module, CompletionScorer | None]:
    """(policy, reference): the policy from the model (or an unsharded checkpoint), the frozen reference (none when beta
    is 0; with LoRA the base with the adapter disabled, not a second copy), sharded like the policy will be where
    `sharding` (Learner.sharding) is given; the embedded model's name resolved to its cached folder
    (lib/models/embedded.py); the output layers in float32 where cast_lm_head_to_fp32 (lib/models/fp32_head.py). The
    sampler comes next (make_engine)."""
    device, sharded = accelerator.device, sharding is not None
    adapter = cfg.use_peft or is_adapter_folder(model_path)
    if cfg.sync_ref_model and (adapter or sharded or partitioned):
        # TRL refuses the adapter case too: the LoRA reference is the base with the adapter off, no copy to mix into
        raise ConfigError("sync_ref_model mixes the policy into a separate reference copy, which "
                          + ("a LoRA run does not have (its reference is the base with the adapter off, as in TRL); "
                             "train the full model or set sync_ref_model false" if adapter
                             else "is not implemented for a sharded reference (FSDP / DeepSpeed); run without "
                                  "sharding or set sync_ref_model false"))
    # a sharded checkpoint's weights are read into the sharded model later (restore)
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
                         trust_remote_code=cfg.trust_remote_code, resolve=resolve_model_path)
    if cfg.cast_lm_head_to_fp32:
        cast_lm_head_to_fp32(policy)
    if cfg.disable_dropout:  # TRL's disable_dropout: the scored distribution is the sampled one
        for module in policy.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    reference = None
    if cfg.beta > 0 and not hasattr(policy, "peft_config"):
        # bf16 on a bf16 GPU, else the policy's dtype (lib/models/modeling.reference_dtype)
        dtype = reference_dtype(cfg.dtype, next(policy.parameters()).dtype, device=device.type,
                                bf16=bf16)
        # sync_ref_model: a checkpoint after a reference update holds the mixed reference (save_checkpoint)
        synced = resume is not None and (resume / REFERENCE_FOLDER).is_dir()
        frozen = load_reference(str(resume / REFERENCE_FOLDER) if synced else model_path, dtype, device,
                                trust_remote_code=cfg.trust_remote_code, revision=None if synced else
                                cfg.model_revision, attn_implementation=cfg.attn_implementation)
        if cfg.cast_lm_head_to_fp32:
            cast_lm_head_to_fp32(frozen)
        reference = CompletionScorer(frozen, fixed_calls=partitioned)
        if sharded:
            reference = sharding.shard_frozen(reference)
    return policy, reference


def build_optimizer(params, name: str, lr: float, betas: tuple[float, float], weight_decay: float,
                    eps: float = 1e-8):
    """AdamW by `optim` name: torch's, or bitsandbytes' 8-bit / paged states (lib/sharding/memory.eight_bit_adamw)."""
    if name in ("adamw_torch", "adamw_torch_fused"):
        # fused: one kernel for all tensors on CUDA, the same update
        fused = name == "adamw_torch_fused" and all(p.is_cuda for p in params)
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                 fused=fused or None)
    return eight_bit_adamw(params, name, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def policy_optimizer(cfg: Config, policy: torch.nn.Module) -> torch.optim.Optimizer:
    """The optimizer over the policy's trained parameters (all of them, or LoRA's adapter)."""
    params = [p for p in policy.parameters() if p.requires_grad]
    return build_optimizer(params, cfg.optim, cfg.learning_rate, (cfg.adam_beta1, cfg.adam_beta2),
                           cfg.weight_decay, eps=cfg.adam_epsilon)


def prepare_policy(cfg: Config, accelerator: Accelerator, policy: torch.nn.Module,
                   optimizer: torch.optim.Optimizer, sharding, partitioned: bool
                   ) -> tuple[torch.nn.Module, torch.optim.Optimizer, object, list]:
    """(scorer, optimizer, scheduler, trained parameters): the scheduler built, the scorer and the optimizer prepared by
    Accelerate. Called after the memory check, which needs the optimizer built. The scorer shares the prompt under
    gradient checkpointing (lib/models/checkpointed_prefix.py)."""
    scheduler = build_scheduler(optimizer, cfg.lr_scheduler_type, num_training_steps=cfg.max_steps,
                                num_warmup_steps=warmup_steps(cfg), kwargs=cfg.lr_scheduler_kwargs)
    # DDP, or FSDP2 / DeepSpeed (lib/sharding/fsdp_deepspeed.Sharding.prepare)
    scorer = CompletionScorer(policy, fixed_calls=partitioned, checkpointed_prefix=checkpointed_prefix)
    scorer, optimizer, scheduler = (accelerator if sharding is None else sharding).prepare(scorer, optimizer, scheduler)
    # the shards the optimizer holds, when sharded
    return scorer, optimizer, scheduler, [p for p in scorer.parameters() if p.requires_grad]


def restore(resume: Path | None, accelerator: Accelerator, scorer, optimizer, scheduler, engine,
            method: Method, sharding) -> TrainerState:
    """The checkpoint's trainer state, optimizer and scheduler states, RNG and controllers (a fresh state without one);
    a sharded checkpoint's weights too, which the sampler then gets."""
    state = TrainerState()
    if resume is None:
        return state
    saved = ckpt.read_trainer_state(resume)
    state = TrainerState(**{f.name: saved[f.name] for f in dataclasses.fields(TrainerState)
                            if f.name in saved})
    if sharding is not None:
        sharding.load(scorer, optimizer, resume)
        # the sampler was made from the base weights
        engine.sync_weights(accelerator.unwrap_model(scorer).model)
    else:
        # read to the CPU first (load_state_dict then moves each state onto its parameter's device): a checkpoint
        # written from GPU 0 would otherwise be rebuilt on GPU 0 by every process
        optimizer.load_state_dict(torch.load(resume / "optimizer.pt", map_location="cpu",
                                             weights_only=False))
    scheduler.load_state_dict(torch.load(resume / "scheduler.pt", map_location="cpu",
                                         weights_only=False))
    rng = ckpt.read_rng(resume, accelerator.process_index)
    if rng is not None:
        ckpt.set_rng_state(rng)
        engine.load_state_dict(rng["rollout"])
    method.controllers.load_state_dict(state.controller_state)
    return state


def rollout_context(cfg: Config, engine, tokenizer, reward_funcs: list, train_records: list[dict],
                    accelerator: Accelerator, geometry: Geometry, worker=None, episodes=None) -> RolloutContext:
    """What sampling and scoring read (lib/methods/registry.RolloutContext): the sampler, the rewards and their weights, the
    data, the answer phase (answer_marker: the answer sampled at its own temperature), and the reward worker
    (lib/rewards/worker.RewardWorker, made by train_agrpo.setup) or None."""
    answer_phase = None
    if cfg.answer_marker:
        answer_phase = AnswerPhase.from_text(tokenizer, cfg.answer_marker, cfg.answer_temperature,
                                             cfg.answer_top_p)
    weights = list(cfg.reward_weights or [])
    # weight 1 for each function without one: all of them without reward_weights, and the reward functions the
    # trainer adds after the configured ones (an environment's get_reward, weight 1 as in TRL: docs/agents.md 7)
    reward_weights = torch.tensor(weights + [1.0] * (len(reward_funcs) - len(weights)))
    return RolloutContext(cfg, engine, tokenizer, reward_funcs, reward_weights, train_records,
                          accelerator, answer_phase, geometry.local_rollout, geometry.first, worker, episodes)


def close(run: Run) -> None:
    """After the run, or when it stops early: the sampler, the reward worker, the trackers, the signal handlers."""
    run.output.stop.restore()
    # the sampling thread (max_staleness) first: it uses the engine, which stays open under a thread stuck in a call
    if run.sampler.rollouts is None or run.sampler.rollouts.close():
        run.sampler.engine.close()
    for worker in (run.sampler.ctx.worker, run.sampler.ctx.episodes):  # the reward worker, an agent's tool worker
        if worker is not None:
            worker.close()
    if run.output.hub is not None:  # says which pushes an early stop abandons (docs/hub.md 3)
        run.output.hub.close()
    distributed.keep_gloo_groups_to_exit()  # a gloo group freed in the interpreter's shutdown can abort it
    run.accelerator.end_training()


def ready_sampler(engine, learner: Learner) -> float:
    """Before sampling or evaluating: the sampler (`engine`) gets the policy's weights where an optimizer step moved
    them since it last got them, then an engine asleep (vLLM sleep mode) wakes. So the weights are pushed once per
    generation batch however many optimizer steps train on it (steps_per_generation, num_iterations), as TRL does, and
    a sleeping engine stays asleep through the batch's steps; an evaluation between them still samples from the
    current weights. Every process calls it (a sharded policy is gathered in a collective); `weights_moved` is the
    same on all of them (lib/save_and_stop.step_optimizer decides on reduced values). Returns the seconds it took."""
    t0 = clock(learner)
    if learner.weights_moved:
        engine.sync_weights(learner.model)
        learner.weights_moved = False
    engine.ready(learner.model)
    return clock(learner) - t0


def check_first_batch(sampler: Sampler, learner: Learner, output: Output, rollout: Rollout, step: int,
                      sample_again) -> Rollout:
    """The first generation batch a vLLM engine (colocated or a server) samples, checked once per run against the
    trainer's own log-probs of the same tokens (docs/troubleshooting.md 4): every sampling log-prob finite and the
    mean gap per token within vllm_logp_check_threshold (lib/sampling/vllm_rollout.judge_sampling_logps, on the sums
    of every process, so all of them decide alike). Where the batch fails, the run samples with the HF sampler from
    then on (`make_engine`, as set-up makes it without vLLM; one line and a warnings.jsonl record say why) and this
    batch is sampled again with it by `sample_again()`: no step trains on the engine's batch, and nothing is written
    but the record. Before the first step the policy is the one the engine was built from, and the optimizer, the
    checkpoints and the logs do not know the sampler, so the switch loses nothing. A policy sharded over the
    processes (FSDP2, ZeRO-3) has no whole copy for the HF sampler at this point: that run stops here with the
    message (ckpt.RunStopped). Returns the batch to train on. Costs one no-grad pass over the first batch."""
    cfg, accelerator = sampler.cfg, sampler.accelerator
    if (sampler.checked or rollout.sampling_logps is None or not cfg.use_vllm or cfg.rollout_func
            or cfg.vllm_logp_check_threshold is None):  # (a rollout_func samples in the engine's place)
        return rollout
    sampler.checked = True
    scorer, size = accelerator.unwrap_model(learner.scorer), cfg.per_device_train_batch_size
    with torch.no_grad(), accelerator.autocast():
        trainer_logp = pad_cat([
            scorer(rollout.prompt_ids, rollout.prompt_mask, rollout.prompt_index[rows], rollout.completion_ids[rows],
                   rollout.attended()[rows], rollout.temperatures[rows], with_entropy=False)[0]
            for rows in (slice(i, i + size) for i in range(0, len(rollout.completion_ids), size))])
    sums = accelerator.reduce(logp_gap_sums(rollout.sampling_logps, trainer_logp, rollout.completion_mask),
                                  reduction="sum")
    verdict = judge_sampling_logps(sums.cpu(), getattr(sampler.engine, "dtype", None), first_batch_threshold(cfg))
    if verdict.ok:
        return rollout
    if learner.sharding is not None and learner.sharding.partitioned:
        raise ckpt.RunStopped(f"{verdict.message}. The policy is sharded (FSDP2 / ZeRO-3), so the HF sampler cannot "
                              f"take the engine's place here: stopped before the first step")
    fallback = "Sampling with the HF sampler from now on (use_vllm off for the rest of the run)"
    if accelerator.is_main_process:
        tqdm.write(f"{verdict.message}. {fallback}")
        with open(output.out / "warnings.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "kind": "vllm_logp_check", "title": "the vLLM engine's log-probs "
                                "failed the first batch's check", "first_step": step, "evidence": verdict.message,
                                "advice": fallback, "tokens": verdict.tokens, "nonfinite": verdict.nonfinite,
                                "mean_gap": verdict.mean_gap}) + "\n")
    sampler.engine.close()  # the engine's memory (its weights and KV cache) goes before the HF sampler is made
    sampler.engine = sampler.ctx.engine = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    policy = learner.model
    bf16 = accelerator.mixed_precision == "bf16"
    headroom = copy_headroom(cfg, policy, accelerator.device, bf16, vllm=False)
    sampler.engine = sampler.ctx.engine = make_engine(policy, output.tokenizer, bf16,
                                                      cfg.seed + accelerator.process_index, headroom=headroom)
    return sample_again()


def first_batch_threshold(cfg: Config) -> float:
    """The mean gap a token (nats) that `check_first_batch` allows between the engine's log-probs and the learner's.
    Sampling options the learner's log-probs do not see reshape the engine's distribution, whose log-probs are then
    those of the renormalised one (top_k, min_p, a repetition penalty, generation_kwargs: the importance-sampling
    correction exists for that gap), so only their finiteness is checked (inf); top_p's nucleus adds at most
    -log(top_p) nats a token to vllm_logp_check_threshold."""
    reshaped = cfg.top_k > 0 or bool(cfg.min_p) or cfg.repetition_penalty != 1.0 or bool(cfg.generation_kwargs)
    return math.inf if reshaped else cfg.vllm_logp_check_threshold - math.log(cfg.top_p)


def clock(part) -> float:
    """time.perf_counter once the device has run what was queued: on a GPU a kernel runs after the call that queued it,
    so an unsynchronised phase time would land in the next phase that waits on a result. `part`: any of the run's
    parts (its accelerator says the device)."""
    if part.accelerator.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()
