"""scripts/gpu_check.sh --dry-run: the GPU check's every step on this CPU with tiny shapes, so that the script, its
tests and its benchmarks still run when the next GPU is lent (docs/performance.md 6)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # 2-6 min on 2 cores: the gpu tests, the decode-step, TRL and async benchmarks, the 16 GB step
def test_the_gpu_check_runs_every_step_on_a_cpu(tmp_path):
    """Every step of the check, the 16 GB step at one of its dry run's two shapes: qwen2-tiny, where it runs ours,
    TRL, the estimate and their ratios. The second shape, llama-tiny, would run only ours again (20 s on 2 busy cores:
    a benchmark run and an estimate); the benchmark's run at that shape is tests/test_bench.py's sharded one."""
    pytest.importorskip("trl", reason="the check's benchmark runs TRL (requirements-bench.txt)")
    # the script's interpreter is this one (gpu_check.sh takes $PYTHON, else the python3 on PATH)
    env = {**{k: v for k, v in os.environ.items() if k not in ("AGRPO_GPU_REPORT", "OUT")}, "PYTHON": sys.executable}
    # each step's limit is the GPU's (seconds there); on 2 busy cores a step takes minutes: the gpu tests over 200 s,
    # the async step over its 240 s (a step stopped at its limit left no report and the test a bare KeyError)
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", "--out", str(tmp_path),
                           "--tests_timeout", "900", "--sampler_timeout", "600", "--bench_timeout", "600",
                           "--card16_timeouts", "600", "600", "600", "600", "--async_timeout", "900",
                           "--card16_shapes", "qwen2-tiny"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1800, check=False)
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    steps = results["steps"]
    # what a failure shows: the check's output, then each step's exit, seconds and log tail (gpu_check.json)
    detail = proc.stdout[-3000:] + proc.stderr[-2000:] + "\n" + "\n".join(
        f"{name}: exit {step.get('exit')} after {step.get('seconds')} s\n{step.get('log_tail', '')[-1500:]}"
        for name, step in steps.items())
    assert results["dry_run"] and results["environment"]["cuda_available"] is False
    assert set(steps) == {"tests", "sampler", "bench", "card16", "async"}, detail
    assert all(step.get("exit") == 0 for step in steps.values()) and proc.returncode == 0, detail
    # step 6: the asynchronous step against the synchronous one (bench_regression --b_flags), both sides measured
    assert steps["async"].get("async_over_sync", 0) > 0, detail
    assert "with --max_staleness 1" in (tmp_path / "async.log").read_text()
    tests = {t["test"]: t["outcome"] for t in steps["tests"]["tests"]}
    # every gpu test ran; on a CPU only the two that need CUDA itself skip (the allocator's cap, bitsandbytes in vLLM)
    cuda_only = {"test_max_memory_caps_the_process_so_that_going_over_is_an_out_of_memory",
                 "test_a_4bit_policys_vllm_engine_holds_a_4bit_base_and_samples_the_policy"}
    skipped = {t for t, o in tests.items() if o == "skipped"}
    assert len(tests) == 17 and skipped <= cuda_only, (tests, steps["tests"]["log_tail"])
    assert all(o == "passed" for t, o in tests.items() if t not in skipped), (tests, steps["tests"]["log_tail"])
    measured = {m["test"] for m in steps["tests"]["measured"]}
    assert {"sampler_vs_scorer_fp32", "decode_step_graph_vs_written_out", "merged_sync_lora", "fsdp2_bf16_temperatures",
            "resume_on_device", "direct_decode_lora", "direct_decode_qlora", "direct_decode_qlora_bf16",
            "sampler_process"} <= measured
    rows = steps["sampler"]["report"]["results"]
    assert {(r["attn"], r["decode"], r["rows"]) for r in rows} == \
        {("sdpa", d, n) for d in ("written", "graph") for n in (1, 8)}
    assert all(r["step_ms"] > 0 and r["floor_ms"] > 0 for r in rows)
    # the benchmark against TRL (scripts/bench_vs_trl.py) as its own run would report it: the dry run's is the one
    # side-by-side run of the suite (on a random model of the Qwen2 family, TRL with bf16=True)
    assert "| median step time (s) |" in (tmp_path / "bench.log").read_text()
    assert "ours / TRL" in (tmp_path / "bench.log").read_text()
    report = json.loads((tmp_path / "bench.json").read_text())
    assert steps["bench"]["summary"] == report["summary"]
    ours, trl = report["summary"]["ours"], report["summary"]["trl-bf16"]
    assert set(report["summary"]) == {"ours", "trl-bf16"}
    for side in (ours, trl):
        assert side["measured_steps"] == 1 and side["median_step_time_s"] > 0 and side["peak_memory_gb"] > 0.3
        assert 0 < side["mean_completion_length"] <= 8
    assert set(ours["phases"]) == {"generation", "rewards", "reference", "policy", "optimizer", "weight_sync"}
    assert ours["phases"]["generation"] > 0 and ours["phases"]["policy"] > 0
    # how long the step waited on its longest completion alone, from the completions our run logged
    alone = ours["longest_alone"]
    assert alone["tokens"] >= 0 and 0 <= alone["share"] <= 1 and 0 <= alone["seconds"] <= ours["phases"]["generation"]
    assert "the wait on one long completion" in (tmp_path / "bench.log").read_text()
    assert report["ratios"]["against"] == "trl-bf16"
    assert report["ratios"]["step_time"] == pytest.approx(ours["median_step_time_s"] / trl["median_step_time_s"])
    assert report["settings"]["steps"] == 2 and report["settings"]["num_generations"] == 8
    assert report["settings"]["beta"] == 0.04 and report["settings"]["max_completion_length"] == 8
    # the 16 GB step (QLoRA, gradient checkpointing, 8 completions, --max_memory 16) at a tiny shape: ours and TRL,
    # each under its own limit, the estimate beside them
    card16 = steps["card16"]
    assert card16["exit"] == 0 and set(card16["shapes"]) == {"qwen2-tiny"}, card16
    for shape, figures in card16["shapes"].items():
        ours = figures["ours"]
        assert ours["exit"] == 0 and ours["measured_steps"] == 1 and ours["peak_memory_gb"] > 0.3, (shape, ours)
        assert 0 < ours["mean_completion_length"] <= 8 and ours["median_step_time_s"] > 0
        assert figures["estimate_gb"] > 0 and figures["estimate_over_peak"] == pytest.approx(
            figures["estimate_gb"] / ours["peak_memory_gb"])
        assert figures["estimate_sampler"].startswith("sampler")  # the copy, or the line saying there is none
    trl = card16["shapes"]["qwen2-tiny"]["trl"]
    assert trl["exit"] == 0 and trl["measured_steps"] == 1
    assert card16["shapes"]["qwen2-tiny"]["ratios"] == pytest.approx(
        {"peak": card16["shapes"]["qwen2-tiny"]["ours"]["peak_memory_gb"] / trl["peak_memory_gb"],
         "step_time": card16["shapes"]["qwen2-tiny"]["ours"]["median_step_time_s"] / trl["median_step_time_s"]})
    assert (tmp_path / "card16-qwen2-tiny-ours.log").exists() and (tmp_path / "card16-qwen2-tiny-trl.log").exists()
