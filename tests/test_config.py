"""Configuration: precedence, presets, and a clear error for every bad value before any model is loaded."""

import pytest
import yaml

from lib.config import ConfigError, make_config, parse_config


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
    with pytest.raises(SystemExit):  # argparse rejects an unknown flag itself
        parse_config(["--learning_rte", "1e-5"])


@pytest.mark.parametrize("values, message", [
    ({"loss_type": "token"}, "loss_type: 'token' is not one of"),
    ({"scale_rewards": "True"}, "scale_rewards"),
    ({"algo": "ppo"}, "algo: 'ppo' is not a preset"),
    ({"num_generations": 1, "per_device_train_batch_size": 1}, "num_generations must be at least 2"),
    ({"learning_rate": "fast"}, "learning_rate: cannot read 'fast' as float"),
    ({"max_steps": 0}, "max_steps must be at least 1"),
    ({"temperature": 0}, "temperature must be > 0"),
    ({"load_in_4bit": True}, "set use_peft true"),
    ({"reward_weights": [1.0, 2.0]}, "one weight per function"),
    ({"dataset_id_or_path": "./no/such/file.jsonl"}, "dataset_id_or_path: the path './no/such/file.jsonl' does not"),
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
