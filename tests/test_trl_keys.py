"""TRL's and open-r1's configuration keys (lib/trl_keys.py): a recipe or command line
written for TRL's GRPOConfig + ModelConfig + ScriptArguments, or an open-r1 recipe, parses here as it is; keys with
TRL's name have TRL's meaning; keys that are not implemented are ignored with a line only where that cannot change
what is trained, and refused otherwise."""

import dataclasses
import functools
import importlib.util
import logging

import pytest
import torch
import yaml
from safetensors.torch import load_file

from lib import config
from lib import trl_differences
from lib import trl_keys
from lib.config import FIELDS, ConfigError, build_parser, validate
from lib.methods.losses import kl_penalty, policy_ratio
from lib.schedule import resolve_epochs, steps_per_rollout, warmup_steps

# as the trainer parses (train_agrpo.py passes TRL's and open-r1's keys to the configuration as `keys`)
parse_config = functools.partial(config.parse_config, keys=trl_keys.resolve_keys)
make_config = functools.partial(config.make_config, keys=trl_keys.resolve_keys)

HAS_TRL = importlib.util.find_spec("trl") is not None


def trl_fields() -> dict:
    """Every key of the dataclasses trl/scripts/grpo.py parses, with TRL's default."""
    from trl import GRPOConfig, ModelConfig, ScriptArguments
    from trl.scripts.grpo import GRPOScriptArguments
    from trl.scripts.utils import DatasetMixtureConfig

    fields = {}
    for cls in (GRPOConfig, ModelConfig, ScriptArguments, GRPOScriptArguments, DatasetMixtureConfig):
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
            fields.setdefault(f.name, default)
    return fields


@pytest.mark.skipif(not HAS_TRL, reason="TRL is not installed (pip install -r requirements-bench.txt)")
def test_every_key_of_trls_grpo_script_is_a_field_or_handled_in_exactly_one_table():
    fields = trl_fields()
    tables = [set(trl_keys.RENAMED), set(trl_keys.IGNORED), set(trl_keys.UNSUPPORTED)]
    assert not any(a & b for i, a in enumerate(tables) for b in tables[i + 1:]), "a key in two tables"
    assert not set(FIELDS) & trl_keys.all_known(), "a field is also in a table"
    uncovered = sorted(k for k in fields if k not in FIELDS and k not in trl_keys.all_known())
    assert not uncovered, f"TRL keys this package neither implements nor handles: {uncovered}"
    wrong = {k: (d, fields[k]) for k, (d, _) in trl_keys.UNSUPPORTED.items() if k in fields and d != fields[k]}
    assert not wrong, f"UNSUPPORTED defaults that are not TRL's: {wrong}"
    # the table of defaults that differ is complete and right: every field TRL also has, at another default, is in it
    ours = {k: FIELDS[k].default if FIELDS[k].default is not dataclasses.MISSING else FIELDS[k].default_factory()
            for k in FIELDS}
    differ = {k for k in fields if k in ours and ours[k] != fields[k]}
    assert differ == set(trl_differences.DIFFERENT_DEFAULTS), (differ ^ set(trl_differences.DIFFERENT_DEFAULTS))
    assert all(fields[k] == trl for k, (trl, _) in trl_differences.DIFFERENT_DEFAULTS.items())


# the keys of open-r1's recipes/Qwen2.5-1.5B-Instruct/grpo/config_demo.yaml (40 keys), with values of our own: what
# matters here is that every key is read with TRL's (or open-r1's) meaning
OPEN_R1_STYLE = """
model_name_or_path: Qwen/Qwen2.5-1.5B-Instruct
model_revision: main
torch_dtype: bfloat16
attn_implementation: sdpa
dataset_name: some-org/some-math-set
dataset_configs:
- default
system_prompt: "Think first, then answer."
bf16: true
use_vllm: false
vllm_device: auto
vllm_gpu_memory_utilization: 0.7
do_eval: false
gradient_accumulation_steps: 4
gradient_checkpointing: true
gradient_checkpointing_kwargs:
  use_reentrant: false
hub_model_id: my-model
hub_strategy: every_save
learning_rate: 2.0e-05
log_completions: true
log_level: info
logging_first_step: true
logging_steps: 1
logging_strategy: steps
lr_scheduler_type: cosine
max_prompt_length: 512
max_completion_length: 1024
max_steps: -1
num_generations: 16
num_train_epochs: 1
output_dir: data/out
overwrite_output_dir: true
per_device_eval_batch_size: 16
per_device_train_batch_size: 16
push_to_hub: false
report_to:
- none
reward_funcs:
- accuracy
- format
save_strategy: "epoch"
save_total_limit: 1
seed: 42
warmup_ratio: 0.1
"""


def test_an_open_r1_recipe_parses_with_each_key_read_or_said_ignored(tmp_path, caplog):
    recipe = tmp_path / "config_demo.yaml"
    recipe.write_text(OPEN_R1_STYLE)
    assert len(yaml.safe_load(OPEN_R1_STYLE)) == 40
    with caplog.at_level(logging.WARNING, logger="agrpo.config"):
        cfg = parse_config(["--config", str(recipe)])
    assert (cfg.dtype, cfg.dataset_config, cfg.max_steps, cfg.num_train_epochs) == ("bfloat16", "default", -1, 1.0)
    assert (cfg.save_strategy, cfg.per_device_eval_batch_size, cfg.gradient_checkpointing_kwargs) == \
        ("epoch", 16, {"use_reentrant": False})
    assert cfg.log_completions is True and cfg.warmup_ratio == 0.1 and cfg.system_prompt.startswith("Think")
    said = [r.getMessage() for r in caplog.records]
    ignored = sorted(m.split("'")[1] for m in said if m.startswith("config: ignored"))
    assert ignored == ["do_eval", "log_level", "logging_first_step", "logging_strategy", "vllm_device"], said
    assert (cfg.hub_model_id, cfg.hub_strategy, cfg.report_to) == ("my-model", "every_save", ["none"])  # resolved at start-up
    assert all(m.count("\n") == 0 for m in said)
    # each epoch's end is a checkpoint; 16 x 4 completions a step are 4 prompts of 16: 160 prompts take 40 steps
    assert (cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps) == (16, 4)
    assert resolve_epochs(cfg, 160, num_processes=1) == 40 and cfg.max_steps == 40 and cfg.save_steps == 40


def test_a_trl_command_line_reads_flags_alone_as_true_and_trls_names():
    cfg = parse_config(["--model_name_or_path", "Qwen/Qwen2-0.5B-Instruct", "--dataset_name", "trl-lib/DeepMath-103K",
                        "--dataset_train_split", "train", "--use_peft", "--lora_r", "32", "--bf16",
                        "--gradient_checkpointing", "--log_completions", "--num_completions_to_print", "3",
                        "--dtype", "bfloat16", "--per_device_train_batch_size", "8", "--num_generations", "8",
                        "--steps_per_generation", "2", "--disable_dropout", "--no_shuffle_dataset"])
    assert cfg.use_peft and cfg.bf16 and cfg.gradient_checkpointing and cfg.disable_dropout
    assert (cfg.lora_r, cfg.dtype, cfg.num_completions_to_print, cfg.shuffle_dataset) == (32, "bfloat16", 3, False)
    assert cfg.optimizer_steps_per_generation == 2
    help_text = build_parser().format_help()
    for section in ("method:", "model:", "data:", "generation:", "optimisation:", "GRPO:", "adaptive methods:", "run:"):
        assert f"\n{section}\n" in help_text, section


@pytest.mark.parametrize("values, message", [
    ({"torch_compile": "true"}, "torch_compile: 'true' is not supported"),
    ({"vllm_tensor_parallel_size": 2}, "vllm_tensor_parallel_size: 2 is not supported .*serve_vllm.py"),
    ({"use_liger_loss": True}, "use_liger_loss: True is not supported"),
    ({"use_dora": True}, "use_dora"),
    ({"datasets": [{"path": "a"}]}, r"datasets: .* is not supported \(data-set mixtures are not implemented"),
])
def test_an_unimplemented_trl_key_is_accepted_at_trls_default_and_refused_otherwise(values, message):
    key = next(iter(values))
    default = trl_keys.UNSUPPORTED[key][0]
    make_config({key: default})  # TRL's default: what this trainer does
    with pytest.raises(ConfigError, match=message):
        make_config(values)


def test_trls_newer_loss_keys_are_read_with_trls_meaning():
    """Issue 39's loss keys (docs/methods.md 1.8-1.12), as a TRL 1.16 recipe writes them."""
    cfg = make_config({"loss_type": "sapo", "sapo_temperature_pos": 0.8, "sapo_temperature_neg": 1.2,
                       "off_policy_mask_threshold": 0.5, "top_entropy_quantile": 0.2,
                       "vllm_importance_sampling_mode": "token_mask", "vllm_importance_sampling_clip_min": 0.5,
                       "vllm_importance_sampling_clip_max": 2.0})
    assert (cfg.sapo_temperature_pos, cfg.sapo_temperature_neg, cfg.off_policy_mask_threshold,
            cfg.top_entropy_quantile, cfg.vllm_importance_sampling_clip_min) == (0.8, 1.2, 0.5, 0.2, 0.5)
    assert make_config({"delta": 4.0, "epsilon_high": 0.28}).dual_clip == 4.0  # INTELLECT-2's two-sided clip
    assert make_config({"vllm_importance_sampling_clip_max": None,
                        "vllm_importance_sampling_clip_min": 0.5}).vllm_importance_sampling_clip_max is None
    with pytest.raises(ConfigError, match="delta and dual_clip are the same setting"):
        make_config({"delta": 4.0, "dual_clip": 3.0})


def test_our_old_names_still_work_with_a_note_and_a_count_becomes_trls_pair(caplog):
    with caplog.at_level(logging.WARNING, logger="agrpo.config"):
        cfg = parse_config(["--dataset_id_or_path", "some/data", "--eval_split", "validation",
                            "--log_completions", "4"])
    assert (cfg.dataset_name, cfg.dataset_test_split) == ("some/data", "validation")
    assert (cfg.log_completions, cfg.num_completions_to_print) == (True, 4)
    said = " | ".join(r.getMessage() for r in caplog.records)
    assert "'dataset_id_or_path' is renamed to dataset_name" in said and "num_completions_to_print 4" in said
    assert make_config({"log_completions": 0}).log_completions is False
    with pytest.raises(ConfigError, match="dataset_id_or_path and dataset_name are the same setting"):
        make_config({"dataset_name": "a/b", "dataset_id_or_path": "c/d"})
    assert make_config({"entropy_coef": 0.01}).eta == 0.01  # TRL's name of the entropy bonus
    # TRL's older boolean scale_rewards, and transformers' resume_from_checkpoint true (the newest checkpoint)
    assert (make_config({"scale_rewards": True}).scale_rewards, make_config({"scale_rewards": "false"}).scale_rewards,
            make_config({"resume_from_checkpoint": True}).resume_from_checkpoint) == ("group", "none", "latest")


def test_steps_per_generation_counts_micro_batches_as_in_trl():
    cfg = make_config({"gradient_accumulation_steps": 2, "steps_per_generation": 4, "per_device_train_batch_size": 4,
                       "num_generations": 4})
    assert cfg.optimizer_steps_per_generation == 2 and steps_per_rollout(cfg) == 2
    default = make_config({"gradient_accumulation_steps": 2, "per_device_train_batch_size": 4, "num_generations": 4})
    validate(default, num_processes=1)
    assert default.steps_per_generation == 2 and default.optimizer_steps_per_generation == 1  # on-policy
    by_size = make_config({"generation_batch_size": 32, "per_device_train_batch_size": 8, "num_generations": 8})
    validate(by_size, num_processes=2)  # 32 completions = 8 per micro-batch x 2 processes x 2 micro-batches
    assert (by_size.steps_per_generation, by_size.generation_batch_size, by_size.optimizer_steps_per_generation) == \
        (2, None, 2)
    with pytest.raises(ConfigError, match=r"generation_batch_size \(24\) must be a multiple of "
                                          r"per_device_train_batch_size x processes \(16\)"):
        validate(make_config({"generation_batch_size": 24, "per_device_train_batch_size": 8}), num_processes=2)
    with pytest.raises(ConfigError, match="generation_batch_size and steps_per_generation both"):
        make_config({"generation_batch_size": 32, "steps_per_generation": 2})


def test_a_recipe_with_epochs_and_no_max_steps_trains_its_epochs_and_the_demo_keeps_its_40_steps(tmp_path):
    # TRL's max_steps defaults to -1: a recipe that gives num_train_epochs and no max_steps trains those epochs
    epochs = tmp_path / "epochs.yaml"
    epochs.write_text("num_train_epochs: 2\nper_device_train_batch_size: 8\nnum_generations: 4\n")
    cfg = parse_config(["--config", str(epochs)])
    assert cfg.max_steps == -1
    assert resolve_epochs(cfg, 64, num_processes=1) == 32 and cfg.max_steps == 64  # 2 prompts a step, 2 passes
    # a max_steps that is given wins over the epochs (TRL: max_steps > 0 overrides num_train_epochs)
    assert parse_config(["--config", str(epochs), "--max_steps", "5"]).max_steps == 5
    both = tmp_path / "both.yaml"
    both.write_text("num_train_epochs: 2\nmax_steps: 5\n")
    assert parse_config(["--config", str(both)]).max_steps == 5
    # no epochs given: the demo's 40 steps, with no arguments and from a recipe that sets neither
    plain = tmp_path / "plain.yaml"
    plain.write_text("learning_rate: 1.0e-5\nnum_generations: 4\n")
    assert parse_config([]).max_steps == 40 and parse_config(["--config", str(plain)]).max_steps == 40
    assert parse_config(["--num_train_epochs", "1"]).max_steps == -1  # on the command line too


def test_epochs_and_warmup_follow_trls_conventions():
    cfg = make_config({"max_steps": -1, "num_train_epochs": 2, "per_device_train_batch_size": 8,
                       "num_generations": 4, "eval_strategy": "epoch", "warmup_steps": 0.25})
    assert resolve_epochs(cfg, 64, num_processes=1) == 32  # 2 prompts a step
    assert (cfg.max_steps, cfg.eval_steps, warmup_steps(cfg)) == (64, 32, 16)
    assert warmup_steps(make_config({"warmup_steps": 5})) == 5
    with pytest.raises(ConfigError, match="max_steps -1 trains for num_train_epochs, which is not set"):
        make_config({"max_steps": -1})
    with pytest.raises(ConfigError, match="warmup_steps and warmup_ratio both"):
        make_config({"warmup_steps": 2, "warmup_ratio": 0.1})
    no = make_config({"eval_strategy": "no", "save_strategy": "no", "save_steps": 5, "eval_steps": 5})
    assert (no.num_eval_samples, no.eval_steps, no.save_steps) == (0, None, None)


def test_bias_corrected_kl_has_the_ratio_in_its_gradient_but_not_in_its_value():
    torch.manual_seed(0)
    logp = torch.randn(2, 5, requires_grad=True)
    ref = torch.randn(2, 5)
    mask = torch.ones(2, 5)
    old = logp.detach()
    ratio = policy_ratio(logp, old, mask)
    assert torch.equal(ratio.detach(), torch.ones(2, 5))  # on-policy: 1 in value
    kl = kl_penalty(logp, ref, "k3")
    (grad_corrected,) = torch.autograd.grad((kl * ratio).sum(), logp, retain_graph=True)
    (grad_plain,) = torch.autograd.grad(kl.sum(), logp)
    # d/dlogp [k3 x exp(logp - old)] = dk3/dlogp + k3, at logp = old
    torch.testing.assert_close(grad_corrected, grad_plain + kl.detach())
    sequence = policy_ratio(logp, old + torch.tensor([[0.1], [0.0]]), mask, "sequence")
    torch.testing.assert_close(sequence.detach()[:, 0], torch.exp(torch.tensor([-0.1, 0.0])))


def test_a_tiny_run_with_trls_keys_trains_the_weights_in_the_asked_dtype(tmp_path, tiny_model):
    """dtype bfloat16 trains bf16 weights (TRL's meaning), a recipe's num_train_epochs with no max_steps sets the
    run's length, save_strategy no writes final/ only, eval_strategy no evaluates nothing."""
    from accelerate.state import AcceleratorState

    import train_agrpo
    from test_loop import TINY, steps_of

    out = tmp_path / "run"
    recipe = tmp_path / "recipe.yaml"
    # 64 prompts, 2 a step: a quarter epoch is 8 steps (the recipe gives no max_steps, so not the demo's 40)
    recipe.write_text("num_train_epochs: 0.25\ndtype: bfloat16\nsave_strategy: 'no'\neval_strategy: 'no'\n")
    at = TINY.index("--max_steps")
    try:
        train_agrpo.main(["--config", str(recipe), "--model_name_or_path", tiny_model, *TINY[:at], *TINY[at + 2:],
                          "--output_dir", str(out), "--use_bias_correction_kl", "--beta", "0.04", "--warmup_steps",
                          "2", "--lr_scheduler_type", "linear", "--disable_dropout"])
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)  # the next run builds its own Accelerator
    lines = steps_of(out)
    assert [m["step"] for m in lines] == list(range(1, 9))
    assert lines[0]["learning_rate"] < lines[1]["learning_rate"]  # warming up
    assert not list(out.glob("checkpoint-*")) and (out / "final" / "model.safetensors").exists()
    weights = load_file(out / "final" / "model.safetensors")
    assert {w.dtype for w in weights.values()} == {torch.bfloat16}
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert (saved["max_steps"], saved["dtype"], saved["num_eval_samples"]) == (8, "bfloat16", 0)
    assert "eval/accuracy" not in (out / "metrics.jsonl").read_text()


@pytest.mark.skipif(not HAS_TRL, reason="TRL is not installed (pip install -r requirements-bench.txt)")
def test_limited_keys_are_trls_keys_implemented_here():
    """lib/trl_differences.LIMITED (docs/configuration.md 10) names TRL keys that are fields here, with TRL's default."""
    fields = trl_fields()
    for key in trl_differences.LIMITED:
        assert key in FIELDS and key in fields and FIELDS[key].default == fields[key], key


def test_only_the_fields_are_read_unless_the_trl_keys_are_passed():
    """lib/config.py alone reads our fields; the entry scripts pass lib/trl_keys.resolve_keys as `keys`."""
    with pytest.raises(ConfigError, match=r"unknown configuration key 'torch_dtype' \(the configuration\)\. Did you "
                                          r"mean 'dtype'\?"):
        config.make_config({"torch_dtype": "float32"})
    with pytest.raises(ConfigError, match=r"unknown configuration key 'delta' \(the command line\)"):
        config.parse_config(["--delta", "4"])
    assert make_config({"torch_dtype": "float32"}).dtype == parse_config(["--dtype", "float32"]).dtype == "float32"
    assert parse_config(["--delta", "4"]).dual_clip == 4.0
