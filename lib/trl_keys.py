"""Recipes and command lines written for TRL or open-r1 (docs/configuration.md, "Recipes written for TRL or
open-r1"): the keys of TRL's GRPO configuration (GRPOConfig on top of transformers' TrainingArguments, ModelConfig,
the GRPO script's arguments) and of open-r1's recipes that are not fields of lib.settings.Config, what this package
does with each, and `resolve_keys`, which turns a mapping written with any of them into our fields' values (TRL's
reward names in reward_funcs too: `reward_name`).

Every such key is in exactly one table: RENAMED (the value goes to the new key), IGNORED (cannot change what is
trained; one warning line each) or UNSUPPORTED (accepted only at TRL's default value, refused otherwise with the
reason); docs/configuration.md 10 lists them, with lib/trl_differences.py's tables about fields.
tests/test_trl_keys.py checks the tables against TRL's own dataclasses when TRL is installed. The entry scripts pass
`resolve_keys` to lib.config.parse_config / make_config as their `keys`; without it only our fields are read.
"""

from __future__ import annotations

import logging

from lib.config import as_bool, key_error
from lib.settings import FIELDS, ConfigError

# old or foreign name -> (our key, deprecation note or None). A note is printed once when the old name is used.
RENAMED: dict[str, tuple[str, str | None]] = {
    # our names before TRL's were adopted (kept working, with a note)
    "dataset_id_or_path": ("dataset_name", "renamed to dataset_name (TRL's name)"),
    "eval_dataset_id_or_path": ("eval_dataset_name", "renamed to eval_dataset_name"),
    "dataset_split": ("dataset_train_split", "renamed to dataset_train_split (TRL's name)"),
    "eval_split": ("dataset_test_split", "renamed to dataset_test_split (TRL's name)"),
    "eval_batch_size": ("per_device_eval_batch_size", "renamed to per_device_eval_batch_size (TRL's name)"),
    # other projects' names for the same setting
    "torch_dtype": ("dtype", None),  # ModelConfig before TRL 1.0 (open-r1's recipes)
    "dataset_prompt_column": ("prompt_column", None),  # open-r1's ScriptArguments
    "entropy_coef": ("eta", None),  # TRL's entropy bonus: the loss subtracts entropy_coef x the token entropy
    "vllm_importance_sampling_cap": ("vllm_importance_sampling_clip_max", None),  # TRL's older name
    # INTELLECT-2's two-sided clipping: dual-clip PPO's loss for every sign of A at delta >= 1 + epsilon_high
    # (lib/methods/losses.check_settings refuses a smaller one; docs/methods.md 1.9)
    "delta": ("dual_clip", None),
    "wandb_project": ("project", None),  # open-r1's GRPOConfig
}

# TRL's built-in reward names (trl/scripts/grpo.py) that mean what one of ours means: the name is logged as ours.
TRL_NAMES = {
    # 1 when math-verify finds the completion's answer equal to the gold, else 0. TRL reads the gold from the column
    # `solution`, we from `answer`, which lib/data/records.py fills from the data's answer column (MATH's solution too).
    "accuracy_reward": "accuracy",
    # DAPO's soft overlong punishment, the same formula on completion tokens. TRL's script fixes L_max 1280 and
    # L_cache 256; here they are max_completion_length and overlong_buffer_length.
    "get_soft_overlong_punishment": "soft_overlong",
}

# TRL's names that mean something none of ours does: refused, with what to use instead.
TRL_REFUSED = {
    "think_format_reward": (
        "TRL's think_format_reward scores 1 for a completion that opens with one <think>...</think> block, whatever "
        "follows; this package's think_format (open-r1's format reward) also requires an <answer>...</answer> block "
        "after it. Pass think_format for that layout, or TRL's own function as 'trl.rewards:think_format_reward'"),
    "reasoning_accuracy_reward": (
        "TRL's reasoning_accuracy_reward checks only the answer after the last </think> and scores 0 without one; "
        "this package's accuracy reads the answer wherever it is (an <answer> block, an 'Answer:' line, \\boxed{}, "
        "the last number). Pass accuracy (with think_format for the layout), or TRL's own function as "
        "'trl.rewards:reasoning_accuracy_reward'"),
}


# key -> why ignoring it cannot change what is trained (printed in the warning line)
IGNORED: dict[str, str] = {}
for _names, _why in [
    (("log_level", "log_level_replica", "log_on_each_node", "logging_first_step", "logging_nan_inf_filter",
      "logging_strategy", "logging_dir", "disable_tqdm", "include_num_input_tokens_seen", "skip_memory_metrics",
      "log_multimodal", "log_unique_prompts", "log_completions_hub_repo", "debug", "wandb_entity",
      "wandb_run_group", "wandb_log_unique_prompts", "trackio_space_id", "trackio_bucket_id",
      "trackio_static_space_id"),
     "logging only: metrics.jsonl gets every logging_steps line"),
    (("dataloader_drop_last", "dataloader_num_workers", "dataloader_pin_memory", "dataloader_persistent_workers",
      "dataloader_prefetch_factor", "dataloader_multiprocessing_context", "dataloader_in_order",
      "remove_unused_columns", "label_names", "length_column_name", "train_sampling_strategy", "pad_to_multiple_of",
      "dataset_streaming", "streaming"),
     "data-loader plumbing: prompts are drawn by the trainer's own seeded order"),
    (("ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers", "ddp_static_graph", "ddp_backend",
      "ddp_timeout", "local_rank", "num_processes", "vllm_device", "accelerator_config", "parallelism_config",
      "ds3_gather_for_generation", "torch_empty_cache_steps", "ignore_bias_buffers"),
     "launch and device plumbing: `accelerate launch` sets the processes"),
    (("do_train", "do_eval", "do_predict", "prediction_loss_only", "eval_delay", "eval_on_start",
      "eval_do_concat_batches", "eval_use_gather_object", "eval_accumulation_steps", "include_for_metrics",
      "batch_eval_metrics", "bf16_full_eval", "fp16_full_eval", "num_generations_eval", "benchmarks"),
     "evaluation only: the held-out evaluation is set by eval_strategy, eval_steps and num_eval_samples"),
    (("save_safetensors", "save_on_each_node", "save_only_model", "enable_jit_checkpoint",
      "restore_callback_states_from_checkpoint", "hub_always_push", "callbacks", "hub_model_revision",
      "overwrite_hub_revision", "push_to_hub_revision"),
     "saving and hub plumbing: checkpoints hold everything an exact resume needs"),
    (("use_cache", "cache_implementation", "use_transformers_continuous_batching",
      "transformers_continuous_batching_config", "use_transformers_paged"),
     "sampling implementation only: the sampled distribution is the same"),
    (("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "torch_compile_backend",
      "torch_compile_mode", "liger_kernel_config",
      "optim_target_modules", "metric_for_best_model", "greater_is_better"),
     "an option of a feature that is off (its own key is refused unless at TRL's default)"),
]:
    IGNORED.update(dict.fromkeys(_names, _why))
del _names, _why

# key -> (TRL's default, why it is not implemented and what to do instead). At the default the key is accepted.
UNSUPPORTED: dict[str, tuple[object, str]] = {
    "auto_find_batch_size": (False, "a batch that does not fit is refused before training (max_memory), not shrunk"),
    "torch_compile": (False, "torch.compile of the policy is not implemented"),
    "use_liger_kernel": (False, "Liger kernels are not used; the log-probs are computed in chunks instead "
                                "(docs/performance.md)"),
    "use_liger_loss": (False, "the Liger GRPO loss is not used; lib/methods/losses.py computes the loss"),
    "neftune_noise_alpha": (None, "NEFTune embedding noise is not implemented"),
    "label_smoothing_factor": (0.0, "label smoothing does not apply to a policy-gradient loss"),
    "optim_args": (None, "optimizer arguments beyond adam_beta1/2, adam_epsilon and weight_decay are not read"),
    "average_tokens_across_devices": (True, "the loss is always normalised over the global batch "
                                            "(lib/methods/losses.aggregate_loss)"),
    "load_best_model_at_end": (False, "final/ is the last step's model; pick a checkpoint-<step>/ folder instead"),
    "ignore_data_skip": (False, "a resumed run always continues the data order where its checkpoint was"),
    "full_determinism": (False, "deterministic algorithms are not switched on; runs are seeded"),
    "fsdp": (None, "FSDP is set by the launch, not by a training key: accelerate launch --config_file "
                   "scripts/accelerate/fsdp2.yaml train_agrpo.py (docs/distributed.md)"),
    "fsdp_config": (None, "FSDP's settings go in the accelerate config's fsdp_config (scripts/accelerate/fsdp2.yaml, "
                          "docs/distributed.md)"),
    "deepspeed": (None, "DeepSpeed is set by the launch, not by a training key: accelerate launch --config_file "
                        "scripts/accelerate/zero3.yaml (or zero2.yaml) train_agrpo.py; a DeepSpeed JSON goes in the "
                        "accelerate config's deepspeed_config_file (docs/distributed.md)"),
    "model_init_kwargs": (None, "give the loading keys directly: dtype, attn_implementation, model_revision, "
                                "trust_remote_code"),
    "router_aux_loss_coef": (None, "the MoE router's auxiliary loss is not added"),
    "vllm_model_impl": ("vllm", "only vLLM's own model implementations are used"),
    "vllm_tensor_parallel_size": (1, "a colocated engine runs on its process's GPU; a generation server spans "
                                     "several with python serve_vllm.py --tensor_parallel_size N (vllm_mode server)"),
    "vllm_structured_outputs_regex": (None, "structured outputs are not implemented"),
    "lora_target_parameters": (None, "adapting parameters (MoE experts) directly is not implemented; use "
                                     "lora_target_modules"),
    "lora_modules_to_save": (None, "training whole modules beside the adapter is not implemented"),
    "lora_task_type": ("CAUSAL_LM", "the policy is a causal LM"),
    "use_dora": (False, "DoRA adapters are not implemented (the sampler merges plain LoRA)"),
    "load_in_8bit": (False, "8-bit bases are not implemented; use load_in_4bit (QLoRA)"),
    "bnb_4bit_quant_storage": (None, "the 4-bit storage dtype is bitsandbytes' default"),
    "datasets": ([], "data-set mixtures are not implemented; give one dataset_name"),
    "test_split_size": (None, "a held-out share of the training split is num_eval_samples rows (a single file) or "
                              "the data set's test split"),
    "dataset_mixture": (None, "data-set mixtures are not implemented; give one dataset_name"),
}


def reward_name(spec: str) -> str:
    """Our name for one of TRL's reward names (TRL_NAMES), any other spec as it is; ValueError for a TRL name none
    of ours means (TRL_REFUSED)."""
    if spec in TRL_REFUSED:
        raise ValueError(f"reward function {spec!r}: {TRL_REFUSED[spec]}")
    return TRL_NAMES.get(spec, spec)


def all_known() -> set[str]:
    """Every key these tables handle."""
    return set(RENAMED) | set(IGNORED) | set(UNSUPPORTED)


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
            return as_bool(value) is default
        if isinstance(default, (int, float)):
            return not isinstance(value, bool) and float(value) == float(default)
    except (TypeError, ValueError):
        return False
    return str(value) == str(default)


def resolve_keys(values: dict, where: str, follows: dict[str, str] | None = None) -> dict:
    """The values of our fields, from a mapping that may use TRL's or open-r1's keys (lib/config.py's `keys`):
    renamed keys moved to ours (a note for our old names), ignored keys dropped with one warning line each,
    unimplemented keys accepted at TRL's default and refused otherwise, anything else an error with the closest
    field."""
    resolved, given_as = {}, {}
    for key, value in values.items():
        if not isinstance(key, str):
            raise key_error(key, where)
        if key in FIELDS:
            target = key
        elif key in RENAMED:
            target, note = RENAMED[key]
            if note:
                _note(f"config: {key!r} is {note}; the old name still works")
        elif key == "dataset_configs":  # open-r1's list form of dataset_config
            items = value if isinstance(value, list) else [value]
            if len(items) != 1:
                raise ConfigError(f"dataset_configs: give one configuration (dataset_config), got {value!r:.80}")
            target, value = "dataset_config", items[0]
        elif key in IGNORED:
            _note(f"config: ignored {key!r} from {where} ({IGNORED[key]})")
            continue
        elif key in UNSUPPORTED:
            default, why = UNSUPPORTED[key]
            if _same_value(value, default):
                continue  # TRL's default: what this trainer does
            raise ConfigError(f"{key}: {value!r:.80} is not supported ({why}); remove {key} or set it to "
                              f"{default!r}")
        else:
            raise key_error(key, where, follows, known=[*FIELDS, *all_known()])
        if target in resolved and given_as[target] != key:  # in either order
            other = key if key != target else given_as[target]
            raise ConfigError(f"{other} and {target} are the same setting, given twice in {where}; keep {target}")
        given_as[target] = key
        if target == "scale_rewards" and str(value).lower() in ("true", "false"):  # TRL's older boolean form
            value = "group" if str(value).lower() == "true" else "none"
        if target == "reward_funcs" and isinstance(value, (str, list)):  # TRL's reward names read as ours
            try:
                value = [reward_name(v) if isinstance(v, str) else v
                         for v in (value if isinstance(value, list) else value.replace(",", " ").split())]
            except ValueError as error:
                raise ConfigError(f"reward_funcs: {error}") from None
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
