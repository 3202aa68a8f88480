"""Where this package's fields differ from TRL's keys of the same name, as tables for docs/configuration.md 10
(scripts/config_doc.py writes them there; tests/test_trl_keys.py checks them against TRL's dataclasses). No run reads
them: the checks they describe are in lib/config.py, lib/methods/losses.check_settings, lib/setup.py and lib/methods/registry.py, and
lib/trl_keys.py handles TRL's keys that are not fields."""

from __future__ import annotations

# Values of TRL's keys that are refused although the key itself is read (lib/config.py says the same when it refuses
# one): (what, why). docs/configuration.md lists them under the tables above.
REFUSED_VALUES: list[tuple[str, str]] = [
    ("loss_type vespo, luspo", "not implemented (TRL 1.16 has them; the choices are lib/methods/losses.LOSS_TYPES)"),
    ("delta (read as dual_clip) below 1 + epsilon_high", "there TRL's two-sided clip and dual-clip PPO are different "
     "losses; at 1 + epsilon_high and above they are the same for every sign of the advantage (docs/methods.md 1.9)"),
    ("delta / dual_clip with loss_type cispo or sapo", "those losses have no clipped surrogate to cap; TRL ignores "
     "delta there, this trainer says so instead"),
    ("loss_type sapo with adaptive_kl or dsf", "SAPO has no clip range for their adaptive clip to move "
     "(docs/methods.md 1.8)"),
    ("loss_type cispo with dsf", "AGPO-DSF's per-group clip widths (about 0.2) would become CISPO's absolute cap "
     "(docs/methods.md 1.7)"),
    ("vllm_importance_sampling_clip_min and _clip_max both null", "as TRL: at least one bound"),
]


# TRL keys that are fields here, with TRL's meaning, but refused in some combinations or read differently in one
# point: key -> what and why (the checks: lib/methods/losses.check_settings, lib/setup.load_models, lib/methods/registry.py,
# lib/models/fp32_head.cast_lm_head_to_fp32; docs/configuration.md lists them, docs/methods.md 13 and 2.6 explain).
LIMITED: dict[str, str] = {
    "multi_objective_aggregation": "normalize_then_sum is refused with resample_schedule (adaGRPO pools the summed "
                                   "reward over a prompt's rounds) and with scale_rewards none or mix (GDPO's own "
                                   "normalisation replaces the rule; TRL ignores scale_rewards there). "
                                   "frac_reward_zero_std stays the share of groups whose total reward is flat (TRL "
                                   "logs the batch's there)",
    "sync_ref_model": "refused with beta 0 (no reference is loaded) and with LoRA / QLoRA (the reference is the base "
                      "with the adapter off: no copy to mix into), as TRL refuses both; refused under FSDP / "
                      "DeepSpeed, where mixing a sharded reference is not implemented",
    "use_adaptive_entropy": "the bonus eta x entropy is averaged as loss_type says, like the policy term (TRL: each "
                            "micro-batch's token mean), which is TRL's for bnpo and for dapo with one micro-batch a "
                            "step; a step skipped for a non-finite value does not move eta",
    "cast_lm_head_to_fp32": "refused when the output layer is adapted (lm_head in lora_target_modules), as TRL "
                            "refuses it; the bf16 sampling copy and vLLM sample with their own output layer",
}


# Keys whose meaning is TRL's but whose default here is not: key -> (TRL's default, why ours). A TRL recipe that
# leaves one of these out trains with ours; write the key to get TRL's (docs/configuration.md lists them).
DIFFERENT_DEFAULTS: dict[str, tuple[object, str]] = {
    "beta": (0.0, "DeepSeekMath's k3 KL at 0.04, as TRL had before 0.19"),
    "loss_type": ("dapo", "DeepSeekMath's per-sequence mean (grpo); the presets set their own"),
    "temperature": (1.0, "samples the 135M demo model's answers without drifting off (docs/results.md 1.3)"),
    "learning_rate": (1e-06, "2e-5 for full fine-tuning, 2e-4 with use_peft (null picks), sized for the 40-step demo"),
    "max_completion_length": (512, "the demo's answers are one line"),
    "per_device_train_batch_size": (8, "2 prompts x 8 completions a step in the demo"),
    "max_steps": (-1, "the demo's length where num_train_epochs is not given either; a recipe that gives "
                      "num_train_epochs and no max_steps trains those epochs, as in TRL"),
    "lr_scheduler_type": ("linear", "for the short demo"),
    "logging_steps": (10, "a line every step"),
    "save_steps": (500, "only at the end unless asked"),
    "gradient_checkpointing": (True, "the demo fits in memory and runs faster without"),
    "optim": ("adamw_torch_fused", "the same update; fused only pays on CUDA"),
    "eval_strategy": ("no", "evaluate before and after training (the demo's before/after accuracy)"),
    "log_completions": (False, "completions.jsonl feeds the run view (docs/watching.md)"),
    "lora_dropout": (0.05, "dropout makes the scored distribution differ from the sampled one "
                           "(docs/performance.md 2.3)"),
    "use_bnb_nested_quant": (False, "QLoRA's double quantisation saves about 0.4 bits a parameter"),
    "vllm_importance_sampling_mode": ("sequence_mask", "Yao et al. 2025's truncated importance sampling per token"),
    "use_bias_correction_kl": (True, "the k3 term as DeepSeekMath writes it; the demo's figures were measured with it"),
    "output_dir": (None, "a run folder under runs/"),
    "model_name_or_path": (None, "the embedded SmolLM2-135M-Instruct, so that no argument is needed"),
    "reward_funcs": (None, "answer accuracy, the demo's reward"),
    "dtype": ("float32", "null loads float32 master weights, as TRL's float32 does, and a LoRA base on a bf16 GPU "
                         "in bfloat16 (frozen; the adapter float32)"),
    "fp16": (False, "null turns it on for a CUDA card without bf16 (T4, V100), where bf16 is emulated and vLLM "
                    "refuses it; off elsewhere"),
    "num_train_epochs": (3.0, "a recipe that gives neither key trains the demo's 40 steps, not 3 epochs; give it "
                              "to train by epochs"),
    "num_completions_to_print": (None, "a few a step keep completions.jsonl small"),
    "per_device_eval_batch_size": (8, "greedy evaluation decodes 64 prompts at a time"),
    "project": ("huggingface", "the tracker project is named after this package"),
    "use_vllm": (False, "null samples with vLLM on a CUDA GPU where it is installed (expected to be the faster "
                        "sampler there) and with the HF loop elsewhere"),
}
