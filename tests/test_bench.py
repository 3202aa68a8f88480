"""scripts/bench_vs_trl.py runs our trainer and TRL's GRPOTrainer side by side and reports both (a short run).
The side-by-side run itself (both trainers, their ratios, our phases) is checked on the one that the GPU check's dry
run makes (tests/test_gpu_check.py)."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

BENCH = [sys.executable, str(REPO / "scripts" / "bench_vs_trl.py")]


def test_bad_arguments_are_named_before_any_run(tmp_path):
    proc = subprocess.run(BENCH + ["--steps", "2", "--warmup_steps", "2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--steps (2) must exceed --warmup_steps (2)" in proc.stderr
    proc = subprocess.run(BENCH + ["--model_name_or_path", "no/such/folder"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0 and "is not a folder" in proc.stderr
    # where TRL is missing (here: an interpreter that cannot import it, None in sys.modules), a wrong argument is
    # still named first, and then the missing package with its install
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['trl'] = None\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(BENCH + ["--model_name_or_path", "no/such/folder"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode != 0 and "is not a folder" in proc.stderr
    proc = subprocess.run(BENCH, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode != 0 and "TRL is not installed: pip install -r requirements-bench.txt" in proc.stderr


def test_the_sharded_and_server_modes_name_what_they_need():
    proc = subprocess.run(BENCH + ["--launch_config", "no/such.yaml"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--launch_config: no file 'no/such.yaml'" in proc.stderr
    proc = subprocess.run(BENCH + ["--use_vllm", "--vllm_mode", "server", "--trainers", "ours"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "--vllm_mode server: give --vllm_server_base_url" in proc.stderr


@pytest.mark.slow
def test_a_sharded_run_is_measured_across_its_processes(tmp_path):
    """--launch_config: each measured run is an accelerate launch of two processes (FSDP2 over gloo here), the step
    times come from the main process and the peak memory is the largest of the two. At the Llama family's tiny shape
    (untied output layer), which the GPU check's dry run (tests/test_gpu_check.py) leaves out: it runs qwen2-tiny."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(BENCH + ["--shape", "llama-tiny", "--steps", "2", "--rounds", "1", "--trainers", "ours",
                                   "--max_completion_length", "8", "--output_json", str(out), "--launch_config",
                                   str(REPO / "scripts" / "accelerate" / "fsdp2_cpu.yaml")],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    ours = report["summary"]["ours"]
    assert ours["measured_steps"] == 1 and ours["median_step_time_s"] > 0 and ours["peak_memory_gb"] > 0.3
    assert report["settings"]["launch_config"].endswith("fsdp2_cpu.yaml")


@pytest.mark.slow  # four short runs of the tiny model: about a minute
def test_the_regression_benchmark_compares_two_revisions_phase_by_phase(tmp_path, tiny_model):
    """scripts/bench_regression.py against HEAD: the same code on both sides samples the same completions, so the
    phases are compared step for step, and every ratio's spread brackets its median."""
    out = tmp_path / "regression.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_regression.py"), "--against", "HEAD",
                           "--rounds", "2", "--output_json", str(out), "--", "--model_name_or_path", tiny_model,
                           "--max_steps", "3", "--per_device_train_batch_size", "8", "--num_generations", "4",
                           "--max_completion_length", "8", "--builtin_num_train", "32", "--reward_funcs",
                           "tests/tiny_rewards.py:characters"], cwd=REPO, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["identical_samples"] and report["unit"] == "s"
    assert {"step", "generation", "policy", "optimizer"} <= set(report["summary"])
    for row in report["summary"].values():
        assert row["spread"][0] <= row["ratio"] <= row["spread"][1]
    assert "| step |" in proc.stdout


def test_behaviour_check_leaves_out_only_what_measures_the_machine():
    """scripts/check_behaviour.py compares every metric but timings: a controller's beta / eta and the reward spread
    are the algorithm's (a substring match once dropped them)."""
    from scripts.check_behaviour import machine_key

    kept = ["beta", "eta", "next_beta", "reward_std", "frac_reward_zero_std", "nonfinite_skipped", "entropy_coef",
            "tools/call_frequency", "num_tokens", "update_skipped"]
    assert not [k for k in kept if machine_key(k)]
    assert all(machine_key(k) for k in ["step_time", "time/policy", "time/weight_sync", "memory/peak_gb", "wall_s"])


def test_the_sampler_benchmark_sets_each_step_beside_its_floor_and_its_products(tiny_model):
    """scripts/bench_sampler.py times the HF sampler's decode step (every row decoding to the cap) against its
    bandwidth floor, and its linear products alone, which are part of the step and so take less than it."""
    from scripts.bench_sampler import main

    report = main(["--model", tiny_model, "--rows", "1", "4", "--short", "2", "--steps", "6", "--repeats", "1",
                   "--bf16", "false"])
    assert [(r["rows"], r["decode"]) for r in report["results"]] == [(1, "fast"), (4, "fast")]
    for r in report["results"]:
        assert 0 < r["floor_ms"] < r["step_ms"] and 0 < r["products_ms"] < r["step_ms"]
        assert r["ratio"] == pytest.approx(r["step_ms"] / r["floor_ms"])
    assert report["bandwidth_gb_s"] > 0


def test_the_sampler_benchmark_compares_an_adapter_policys_copy_with_no_copy(tiny_model):
    """--use_peft --load_in_4bit --sampler dense direct: both ways of decoding a QLoRA policy timed, each with what it
    holds for sampling: the merged copy's weights (every dense value, fp32 here), or the largest layer dequantised for
    one product (the tiny model's MLP layers, 64 x 128 values)."""
    from lib.sampling.policy_copy import dense_numel
    from lib.models.modeling import load_policy
    from scripts.bench_sampler import main

    report = main(["--model", tiny_model, "--rows", "2", "--short", "2", "--steps", "4", "--repeats", "1",
                   "--bf16", "false", "--use_peft", "--load_in_4bit", "--sampler", "dense", "direct"])
    rows = {r["sampler"]: r for r in report["results"]}
    assert set(rows) == {"dense", "direct"} and all(r["rows"] == 2 and r["decode"] == "fast" for r in rows.values())
    assert rows["dense"]["sampler_bytes"] == dense_numel(load_policy(tiny_model)) * 4
    assert rows["direct"]["sampler_bytes"] == 64 * 128 * 4
