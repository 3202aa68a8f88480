"""Configuration: precedence, presets, and a clear error for every bad value before any model is loaded."""

import sys

import pytest
import yaml

from conftest import REPO
from lib.config import ConfigError, make_config, parse_config
from lib import trl_keys


def test_defaults_are_the_grpo_preset():
    cfg = parse_config([])
    assert (cfg.algo, cfg.beta, cfg.epsilon, cfg.loss_type, cfg.scale_rewards) == ("grpo", 0.04, 0.2, "grpo", "group")
    assert cfg.reward_funcs == ["accuracy"] and cfg.reward_weights is None
    assert cfg.resolved_epsilon_high() == 0.2


def test_precedence_preset_then_yaml_then_command_line(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"algo": "dapo", "learning_rate": 5e-7, "epsilon_high": 0.3,
                                      "lora_target_modules": ["q_proj", "v_proj"]}))
    cfg = parse_config(["--config", str(recipe), "--epsilon_high", "0.25", "--use_peft", "true"])
    assert cfg.loss_type == "dapo" and cfg.beta == 0.0  # from the preset
    assert cfg.learning_rate == 5e-7  # YAML over the default
    assert cfg.epsilon_high == 0.25  # command line over YAML over preset
    assert cfg.use_peft is True and cfg.lora_target_modules == ["q_proj", "v_proj"]
    cfg = parse_config(["--reward_funcs", "accuracy", "my_mod:fn", "--reward_weights", "1", "0.5"])
    assert cfg.reward_funcs == ["accuracy", "my_mod:fn"] and cfg.reward_weights == [1.0, 0.5]


def test_unknown_key_names_the_closest_field(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("learning_rte: 1e-5\n")
    with pytest.raises(ConfigError, match="unknown configuration key 'learning_rte'.*learning_rate"):
        parse_config(["--config", str(recipe)])
    # on the command line too, with the same hint (argparse alone said only "unrecognized arguments")
    with pytest.raises(ConfigError,
                       match="unknown configuration key 'learning_rte' \\(the command line\\).*learning_rate"):
        parse_config(["--learning_rte", "1e-5"])


@pytest.mark.parametrize("values, message", [
    ({"loss_type": "token"}, "loss_type: 'token' is not one of"),
    ({"scale_rewards": "yes"}, "scale_rewards: .yes. is not one of"),  # true / false are TRL's group / none
    ({"algo": "ppo"}, "algo: 'ppo' is not a preset"),
    ({"num_generations": 1, "per_device_train_batch_size": 1}, "num_generations must be at least 2"),
    ({"learning_rate": "fast"}, "learning_rate: cannot read 'fast' as float"),
    ({"max_steps": 0}, "max_steps must be at least 1"),
    ({"temperature": 0}, "temperature must be > 0"),
    ({"load_in_4bit": True}, "set use_peft true"),
    ({"reward_weights": [1.0, 2.0]}, "one weight per function"),
    ({"dataset_name": "./no/such/file.jsonl"}, "dataset_name: the path './no/such/file.jsonl' does not"),
    ({"model_name_or_path": "/no/such/model"}, "model_name_or_path: the folder '/no/such/model' does not exist"),
    ({"resume_from_checkpoint": "/tmp"}, "not a checkpoint folder"),
    ({"use_peft": "maybe"}, "use_peft: cannot read 'maybe' as bool"),
])
def test_bad_values_fail_with_the_field_and_the_fix(values, message):
    with pytest.raises(ConfigError, match=message):
        make_config(values)


def test_global_batch_counts_processes_and_accumulation():
    from lib.config import validate

    validate(make_config({"per_device_train_batch_size": 4, "num_generations": 8, "gradient_accumulation_steps": 2}),
             num_processes=1)
    validate(make_config({"per_device_train_batch_size": 4, "num_generations": 8}), num_processes=2)
    with pytest.raises(ConfigError, match="4 x 3 process.*multiple of num_generations"):
        validate(make_config({"per_device_train_batch_size": 4, "num_generations": 8}), num_processes=3)
    with pytest.raises(ConfigError, match="multiple of num_generations"):
        validate(make_config({"per_device_train_batch_size": 6, "num_generations": 4}), num_processes=1)


@pytest.mark.parametrize("algo, expected", [
    ("agrpo", {"beta": 0.001, "kl_estimator": "symmetric", "adaptive_kl": True, "eta": 1e-3, "scale_rewards": "batch",
               "loss_type": "dapo", "adaptive_group_size": False, "kl_target": 0.05, "kl_ema_decay": 0.9,
               "kl_beta_rate": 0.1, "kl_epsilon_rate": 0.5, "epsilon_min": 0.1, "epsilon_max": 0.3,
               "skip_zero_signal_updates": False}),
    ("agpo", {"homogeneous_advantage": 0.1, "reward_funcs": ["accuracy", "length"], "reward_weights": [1.0, 0.1],
              "loss_mask_zero_advantage": True, "dual_clip": None, "epsilon": 0.2}),
    ("adagrpo", {"loss_type": "bnpo", "beta": 0.04, "scale_rewards": "group"}),
    ("agpo_dsf", {"dsf": True, "num_iterations": 4, "beta": 0.03, "kl_estimator": "k3", "loss_type": "grpo",
                  "dsf_tau_min": 0.5, "dsf_tau_max": 1.5, "dsf_lambda_temp": 0.15, "dsf_eps_min": 0.05,
                  "dsf_eps_max": 0.4, "dsf_w_k": 0.0, "dsf_zeta_skew": 0.0}),
    ("grpo", {"adaptive_kl": False, "dsf": False, "resample_schedule": None, "eta": 0.0, "homogeneous_advantage": 0.0,
              "steps_per_generation": None}),
    ("dapo", {"beta": 0.0, "epsilon": 0.2, "epsilon_high": 0.28, "loss_type": "dapo",
              "mask_truncated_completions": True, "dynamic_sampling_rounds": 10}),
    ("gspo", {"beta": 0.0, "importance_sampling_level": "sequence", "loss_type": "grpo", "epsilon": 3e-4,
              "epsilon_high": 4e-4, "steps_per_generation": 4, "num_iterations": 1}),
])
def test_method_presets_set_section_9_defaults(algo, expected):
    cfg = make_config({"algo": algo})
    for key, value in expected.items():
        assert getattr(cfg, key) == value, key
    if algo == "adagrpo":
        assert [len(t["params"]) for t in cfg.resample_schedule] == [2, 4, 8, 16]


def test_user_keys_override_a_preset_and_config_yaml_records_the_resolved_values(tmp_path):
    from lib.config import save_yaml
    from lib.hub import check_settings

    cfg = parse_config(["--algo", "agrpo", "--eta", "0", "--kl_target", "0.1", "--resample_schedule",
                        '[{"step": 3, "params": [{"temperature": 1.2, "top_p": 0.95}]}]'])
    assert cfg.eta == 0.0 and cfg.kl_target == 0.1 and cfg.adaptive_kl is True and cfg.beta == 0.001
    assert cfg.resample_schedule == [{"step": 3, "params": [{"temperature": 1.2, "top_p": 0.95}]}]
    check_settings(cfg)  # report_to resolved, as the trainer's set-up does before it writes config.yaml
    save_yaml(cfg, tmp_path / "config.yaml")
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["algo"] == "agrpo" and saved["kl_estimator"] == "symmetric" and saved["eta"] == 0.0
    assert saved["resample_schedule"][0]["params"][0]["temperature"] == 1.2
    # and the saved file, read back as a recipe, gives the same configuration
    again = parse_config(["--config", str(tmp_path / "config.yaml")])
    check_settings(again)
    assert again == cfg
    # the seeds' ablations by hand (docs/methods.md 9.4): a fixed epsilon pins the controller's bounds, no KL turns
    # the controller off
    pinned = parse_config(["--algo", "agrpo", "--eta", "0", "--epsilon", "0.5", "--epsilon_min", "0.5",
                           "--epsilon_max", "0.5"])
    assert (pinned.eta, pinned.epsilon, pinned.epsilon_min, pinned.epsilon_max) == (0.0, 0.5, 0.5, 0.5)
    no_kl = parse_config(["--algo", "agrpo", "--beta", "0", "--adaptive_kl", "false"])
    assert (no_kl.beta, no_kl.adaptive_kl, no_kl.kl_estimator) == (0.0, False, "symmetric")


@pytest.mark.parametrize("values, message", [
    ({"algo": "agrpo", "beta": 0.0}, "adaptive_kl scales beta multiplicatively.*--beta 0 --adaptive_kl false"),
    # A-GRPO's controller would clip these back into its bounds after one step (docs/methods.md 9.4)
    ({"algo": "agrpo", "epsilon": 0.5}, r"epsilon 0.5 is outside \[epsilon_min 0.1, epsilon_max 0.3\].*"
     r"--epsilon_min 0.5 --epsilon_max 0.5"),
    ({"algo": "agrpo", "beta": 2.0}, r"beta 2.0 is outside \[beta_min 0.0001, beta_max 1.0\].*--adaptive_kl false"),
    ({"adaptive_kl": True, "beta_min": 0.5, "beta_max": 0.1}, "beta_min .* must not exceed beta_max"),
    ({"dual_clip": 1.0}, "dual_clip must be > 1"),
    # the loss keys of issue 39 (docs/methods.md 1.8-1.12): a key the loss type would not read, a dual_clip (TRL's
    # delta) where the two losses differ, reaching the widest clip range a controller can give, and bad bounds
    ({"dual_clip": 1.1}, r"dual_clip \(TRL's delta\) 1.1 is below 1 \+ epsilon_high = 1.2 .*give at least 1.2"),
    ({"algo": "agrpo", "dual_clip": 1.25}, r"below 1 \+ epsilon_high = 1.3 \(the widest upper clip range"),
    ({"dsf": True, "dual_clip": 1.3}, r"below 1 \+ epsilon_high = 1.4"),
    ({"loss_type": "cispo", "dual_clip": 3.0}, "loss_type cispo has none, so it would change nothing"),
    ({"loss_type": "sapo", "dual_clip": 3.0}, "loss_type sapo has none"),
    ({"algo": "agrpo", "loss_type": "sapo"}, r"loss_type sapo has no clip range .* so adaptive_kl, which adapts the "
     r"clip range, would change nothing there.*--adaptive_kl false"),
    ({"loss_type": "sapo", "dsf": True}, r"so dsf, which adapts"),
    ({"algo": "agpo_dsf", "loss_type": "cispo"}, r"loss_type cispo caps the importance weight at epsilon_high itself"
     r".*--dsf false"),
    ({"sapo_temperature_neg": 0}, "sapo_temperature_neg must be > 0"),
    ({"top_entropy_quantile": 1.5}, r"top_entropy_quantile must be in \[0, 1\]"),
    ({"off_policy_mask_threshold": -0.1}, "off_policy_mask_threshold must be >= 0"),
    ({"vllm_importance_sampling_clip_max": None}, "both null: give at least one bound"),
    ({"vllm_importance_sampling_clip_min": 1.0, "vllm_importance_sampling_clip_max": 1.0},
     r"clip_min \(1.0\) must be below vllm_importance_sampling_clip_max \(1.0\)"),
    ({"vllm_importance_sampling_clip_min": 1.5}, r"vllm_importance_sampling_clip_min must be in \[0, 1\]"),
    ({"eta": -0.1}, "eta must be >= 0"),
    ({"scale_rewards": "mix", "scale_rewards_mix": 2.0}, r"scale_rewards_mix must be in \[0.0, 1.0\]"),
    ({"reward_dispersion": "var"}, "reward_dispersion: 'var' is not one of std, mad, iqr"),
    ({"resample_schedule": "[{step: 0, params: []}]"}, r"resample_schedule\[0\].step must be an integer >= 1"),
    ({"resample_schedule": "not a list"}, "resample_schedule: cannot read"),
    ({"answer_marker": "Answer:", "answer_temperature": 0}, "answer_temperature must be > 0"),
    ({"dsf": True, "dsf_tau_min": 2.0}, "dsf_tau_min .* must be > 0 and <= dsf_tau_max"),
    ({"algo": "agpo_dsf", "save_steps": 6}, r"save_steps .6. must be a multiple of the optimizer steps one "
     r"generation batch serves, num_iterations x steps_per_generation / gradient_accumulation_steps .4 x 1 = 4."),
    ({"algo": "gspo", "num_iterations": 2, "save_steps": 4}, r"\(2 x 4 = 8\)"),
    ({"steps_per_generation": 0}, r"steps_per_generation \(0\) counts micro-batches \(TRL's meaning\) and must be a "
     r"positive multiple of gradient_accumulation_steps \(1\)"),
    ({"gradient_accumulation_steps": 2, "steps_per_generation": 3}, r"steps_per_generation \(3\) counts micro"),
    ({"dynamic_sampling_rounds": -1}, r"dynamic_sampling_rounds must be at least 0 \(0 = off\), got -1"),
    ({"algo": "dapo", "dsf": True}, "cannot be combined with resample_schedule .* or dsf"),
    ({"algo": "adagrpo", "dynamic_sampling_rounds": 2}, "set dynamic_sampling_rounds 0 or turn those off"),
    ({"overlong_buffer_length": 100}, "overlong_buffer_length .100. must not exceed max_completion_length .64."),
    ({"adaptive_group_size": True, "num_generations": 32}, "num_generations .32. must not exceed group_size_max"),
])
def test_bad_method_values_fail_with_the_field_and_the_fix(values, message):
    with pytest.raises(ConfigError, match=message):
        make_config(values)


def test_adaptive_group_size_needs_a_batch_that_splits_into_every_reachable_size():
    from lib.config import validate
    from lib.methods.registry import reachable_group_sizes

    cfg = make_config({"adaptive_group_size": True, "num_generations": 8, "per_device_train_batch_size": 16})
    assert reachable_group_sizes(cfg) == [4, 8, 16]
    validate(cfg, num_processes=1)
    small_values = {"adaptive_group_size": True, "num_generations": 8, "per_device_train_batch_size": 8}
    small = make_config(small_values)
    with pytest.raises(ConfigError, match=r"reach group sizes \[4, 8, 16\].*groups of \[16\]"):
        validate(small, num_processes=1)
    validate(small, num_processes=2)  # two processes: a global batch of 16
    validate(make_config({**small_values, "steps_per_generation": 2}), num_processes=1)  # or one rollout of 2 steps


def test_a_generation_batch_of_several_steps_needs_whole_groups_only_over_the_rollout():
    from lib.config import steps_per_rollout, validate

    # 4 completions a step and groups of 8: one group per rollout of 2 steps is fine, one step alone is not
    cfg = make_config({"per_device_train_batch_size": 4, "num_generations": 8, "steps_per_generation": 2})
    validate(cfg, num_processes=1)
    with pytest.raises(ConfigError, match=r"generation batch .* x steps_per_generation 1 = 4 completions\) must be "
                       r"a multiple of num_generations \(8\)"):
        validate(make_config({"per_device_train_batch_size": 4, "num_generations": 8}), num_processes=1)
    assert steps_per_rollout(make_config({"algo": "gspo"})) == 4
    assert steps_per_rollout(make_config({"algo": "agpo_dsf", "steps_per_generation": 2})) == 8


@pytest.mark.parametrize("recipe", sorted((REPO / "scripts" / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_every_recipe_parses_and_validates(recipe):
    import torch

    from lib.config import validate

    # sleep mode frees a GPU's memory and is refused without one: the rest of a GPU recipe is checked here, and the
    # packages its run needs (vLLM, bitsandbytes) are the machine's, not the recipe's (check_installed)
    gpu_only = ["--vllm_enable_sleep_mode", "false"] if not torch.cuda.is_available() else []
    cfg = parse_config(["--config", str(recipe), *gpu_only], check_installed=False)
    validate(cfg, num_processes=1, check_installed=False)
    # the file says which method it runs: in its name, or (a recipe named for its task) in an explicit algo key
    assert recipe.name.startswith(cfg.algo + "_") or yaml.safe_load(recipe.read_text()).get("algo") == cfg.algo


def test_a_vllm_recipe_is_refused_where_vllm_is_missing_but_estimated_and_planned(monkeypatch):
    """use_vllm's keys are lib/sampling/vllm_rollout.check_settings', which train_agrpo.main calls right after parsing,
    before anything loads."""
    import train_agrpo
    from lib.sampling.vllm_rollout import check_settings

    monkeypatch.setitem(sys.modules, "vllm", None)  # importlib reports vLLM as not installed, as on a bare machine
    recipe = str(REPO / "scripts" / "recipes" / "grpo_gsm8k_qlora_16gb.yaml")
    with pytest.raises(ConfigError, match="use_vllm needs vLLM: pip install vllm"):
        check_settings(parse_config(["--config", recipe]))
    with pytest.raises(ConfigError, match="use_vllm needs vLLM: pip install vllm"):
        train_agrpo.main(["--config", recipe])
    # the README's estimate of the 16 GB recipe runs nothing, and a plan (scripts/ablate.py --dry_run) runs nothing
    check_settings(estimate := parse_config(["--config", recipe, "--estimate_memory_only"]))
    planned = parse_config(["--config", recipe], check_installed=False)
    check_settings(planned, check_installed=False)
    assert estimate.use_vllm is True and planned.use_vllm is True
    for argv, message in [(["--vllm_mode", "server"], "vllm_mode server samples through a vLLM generation server: "
                                                       "set use_vllm true"),
                          (["--use_vllm", "true", "--vllm_mode", "server", "--vllm_enable_sleep_mode", "true"],
                           "leave it false with vllm_mode server"),
                          (["--vllm_max_model_length", "100", "--max_prompt_length", "100"],
                           r"vllm_max_model_length \(100\) must exceed max_prompt_length \(100\)")]:
        with pytest.raises(ConfigError, match=message):
            train_agrpo.main(argv)


def test_the_default_learning_rate_follows_what_is_trained(tmp_path):
    """2e-5 for all weights, 10x that for a LoRA adapter (docs/methods.md 9.7); a rate the user gives always wins,
    and config.yaml records the rate the run used, so the saved file trains the same."""
    from lib.config import save_yaml

    assert parse_config([]).learning_rate == 2e-5
    lora = parse_config(["--use_peft", "true"])
    assert lora.learning_rate == 2e-4
    assert parse_config(["--use_peft", "true", "--load_in_4bit", "true"]).learning_rate == 2e-4
    assert parse_config(["--use_peft", "true", "--learning_rate", "1e-5"]).learning_rate == 1e-5
    save_yaml(lora, tmp_path / "config.yaml")
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["learning_rate"] == 2e-4
    assert parse_config(["--config", str(tmp_path / "config.yaml"), "--use_peft", "false"]).learning_rate == 2e-4


def test_the_method_registry_is_the_one_source_of_presets_choices_and_parts():
    """lib/methods/registry.py METHODS (docs/methods.md 11): `--algo`'s choices, the presets and the parts choose_method
    picks all come from the one entry per method."""
    from lib.config import FIELDS, PRESETS, steps_per_rollout
    from lib.methods.losses import LOSS_TYPES
    from lib.methods.registry import METHODS, DynamicSampling, NoRefill, RetryUntilCorrect, choose_method

    assert FIELDS["algo"].metadata["choices"] == tuple(METHODS) == tuple(PRESETS)
    assert FIELDS["loss_type"].metadata["choices"] == tuple(LOSS_TYPES)
    refills = {"dapo": DynamicSampling, "adagrpo": RetryUntilCorrect}
    controllers = {"agrpo": ["kl"], "agpo_dsf": ["dsf"]}
    for name, entry in METHODS.items():
        assert set(entry.preset) <= set(FIELDS), name
        cfg = make_config({"algo": name})
        method = choose_method(cfg, steps_per_rollout(cfg))
        assert type(method.refill) is refills.get(name, NoRefill), name
        assert [part.name for part in method.controllers.parts] == controllers.get(name, []), name
        assert method.advantages.keywords.get("homogeneous_value", 0.0) == (0.1 if name == "agpo" else 0.0), name
        assert method.old_entropy == (name == "agpo_dsf") and method.old_logps == (steps_per_rollout(cfg) > 1 or
                                                                                 name == "agpo_dsf"), name
    # a part follows its keys, not the preset's name: A-GRPO's group-size controller under --algo grpo
    cfg = make_config({"adaptive_group_size": True})
    assert [part.name for part in choose_method(cfg, 1).controllers.parts] == ["group_size"]


@pytest.mark.parametrize("values, message", [
    ({"top_p": 0}, r"^top_p must be in \(0, 1\], got 0"),
    ({"warmup_ratio": 1.0}, r"^warmup_ratio must be in \[0, 1\), got 1.0"),
    ({"max_train_samples": 0}, r"^max_train_samples must be at least 1 or null, got 0"),
    ({"beta": -1}, r"^beta must be >= 0, got -1"),
    ({"optim": "sgd"}, r"^optim: 'sgd' is not one of adamw_torch, "),
    ({"vllm_mode": "remote"}, r"^vllm_mode: 'remote' is not one of colocate, server"),
    ({"run_name": " "}, r"^run_name is empty; give a value or leave it out \(null\)"),
    ({"kl_target": 0}, r"^kl_target must be > 0, got 0"),
])
def test_ranges_and_choices_come_from_the_fields_metadata(values, message):
    """lib/settings.py's metadata, read by one loop (lib/config.check_fields): the message names the field, what it
    accepts and the value given."""
    with pytest.raises(ConfigError, match=message):
        make_config(values)


@pytest.mark.parametrize("values, message", [
    ({"multi_objective_aggregation": "normalize_then_sum", "algo": "adagrpo"},
     "normalize_then_sum .* resample_schedule"),
    ({"multi_objective_aggregation": "normalize_then_sum", "scale_rewards": "none"},
     "replaces scale_rewards none; set scale_rewards group"),
    ({"sync_ref_model": True, "beta": 0.0}, "sync_ref_model .* beta is 0"),
    ({"use_adaptive_entropy": True, "entropy_coef_min": 0.5, "entropy_coef_max": 0.1},
     r"entropy_coef_min \(0.5\) must not exceed entropy_coef_max"),
])
def test_objective_keys_refuse_what_they_cannot_combine_with(values, message):
    """docs/configuration.md 10 lists these refusals with their reasons (lib/trl_differences.LIMITED)."""
    with pytest.raises(ConfigError, match=message):
        make_config(values)


def test_objective_keys_accept_their_combinations_with_the_presets():
    """normalize_then_sum under A-GRPO's batch scaling and AGPO's homogeneous values; the adaptive entropy controller
    under A-GRPO (with its KL controller) and under plain GRPO, as in TRL; the reference updates with full
    fine-tuning."""
    for algo in ("grpo", "agrpo", "agpo", "dapo", "agpo_dsf"):
        assert make_config({"algo": algo, "multi_objective_aggregation": "normalize_then_sum",
                            "use_adaptive_entropy": True, "sync_ref_model": True, "beta": 0.04}).use_adaptive_entropy
    # with a TRL recipe's names: entropy_coef is eta, the controller's starting value
    cfg = make_config({"entropy_coef": 0.01, "use_adaptive_entropy": True, "entropy_target": 0.3},
                      keys=trl_keys.resolve_keys)
    assert (cfg.eta, cfg.entropy_target) == (0.01, 0.3)
