"""The GPU check (docs/performance.md 6): everything a first contact with an NVIDIA GPU should measure, in one run
that fits ten minutes on one H100 or H200, with one JSON file of results. `bash scripts/gpu_check.sh` runs it.

    python scripts/gpu_check.py --prepare            # here, with the project installed: what the GPU machine lacks
    python scripts/gpu_check.py --out results/       # on the GPU machine (PyTorch with CUDA, transformers,
                                                     # accelerate, peft; no network)
    python scripts/gpu_check.py --dry-run            # the same steps on a CPU with tiny shapes (a few minutes)

Steps, each under its own time limit so that one that hangs or fails leaves the others' results:
  1. environment: the card, its compute capability, memory, driver, torch / CUDA and the packages' versions;
  2. the tests marked `gpu` (tests/test_gpu.py): the sampler's log-probs against the scorer's in fp32 and bf16,
     merged LoRA / QLoRA sync, FSDP2 under bf16 mixed precision keeping the temperatures, resume on the device,
     the memory estimate against the measured peak, the sampler process (sampler_device) sampling from the copy it
     shares with the trainer through CUDA's inter-process handles; their measured figures go to the results;
  3. the HF sampler's decode step at 1, 8 and 64 rows against its memory-bandwidth floor, written out
     (lib/sampling/decode.LlamaStep) and replayed from CUDA graphs kept across calls (GraphSteps), in alternation
     (scripts/bench_sampler.py); the graphed step's ratios to the floor at 8 and 64 rows beside their goals
     (3x and 5x) in the results (`graph_floor_ratios`);
  4. a side-by-side benchmark of our trainer and TRL's GRPOTrainer (scripts/bench_vs_trl.py) at the Qwen2.5-0.5B
     shape with random weights: 8 completions of 256 new tokens, bf16, HF sampling on both sides, five steps (the
     first left out), TRL with the folder's bf16 weights (its default) and with fp32 master weights (as ours):
     median step, generated tokens a second, peak memory, where our step's time goes;
  5. "16 GB": the QLoRA recipe's settings (8 completions of 512 new tokens, LoRA r 16 on every linear layer, NF4
     base, gradient checkpointing, bf16) under `--max_memory 16` at the Qwen2.5-1.5B, Qwen2.5-7B and Llama-3.1-8B
     shapes with random weights, 3 steps each (the first left out): our trainer with the HF sampler (and with vLLM
     where installed, at --card16_vllm_shapes), TRL at the same settings and cap where it fits the time
     (--card16_trl_shapes); each run's peak (the allocator's reserved peak plus what the process holds outside it),
     median step and the ratios to TRL, beside `--estimate_memory_only` for the same settings (estimate / peak);
  6. asynchronous GRPO (docs/async.md): our step at `--max_staleness 1` against the synchronous step, same settings
     as step 4 (Qwen2.5-0.5B shape, 8 completions of 256 new tokens, bf16, the HF sampler), alternated rounds
     (scripts/bench_regression.py --b_flags), with each run's mean GPU utilisation; issue 54's goal is 0.6x.
     `--async_b_flags "--max_staleness 1 --sampler_device cuda:0"` measures the HF sampler in a process of its own.
Time: about 12 minutes of GPU in all, each step under its own limit (defaults: 200 + 60 + 100 s for steps 2-4;
for step 5 one limit a run, --card16_timeouts: 1.5B 75 s ours + 120 s TRL, 7B and 8B 130 s each with the model's
building, vLLM at 1.5B 90 s: 545 s; 905 s at most in all, less as runs end before their limits); step 6, 240 s
(--async_timeout), more than one session's GPU time allows with all the others: `--skip tests sampler bench card16`
runs it alone.
Results: `<out>/gpu_check.json`, rewritten after every step (a check stopped at its limit keeps what it measured).

--prepare gathers, into `.gpu/` (ignored by git; the device tool carries it): the embedded model's tokenizer (the
GPU machine has no network and no GGUF reader), and the wheels of the packages the GPU image lacks (TRL, datasets,
math-verify and what they need, bitsandbytes), for CPython 3.12 on x86-64 Linux, 44 MB in all:
    python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \\
        -d .gpu/wheels <package>==<version> ...
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / ".gpu"
# the versions requirements*.txt pins; what the GPU image lacks, and what those need beyond it
WHEELS = ["trl==1.16.0", "datasets==5.2.0", "dill==0.4.1", "multiprocess==0.70.19", "math-verify==0.9.0",
          "latex2sympy2_extended==1.11.0", "antlr4-python3-runtime==4.13.2", "bitsandbytes==0.50.2"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]
# the graphed decode step's time over its memory floor that issue 52 sets, by rows (docs/performance.md 6.4)
FLOOR_GOALS = {8: 3.0, 64: 5.0}
PACKAGES = ["torch", "transformers", "accelerate", "peft", "trl", "datasets", "bitsandbytes", "math_verify", "vllm"]


def prepare() -> None:
    """The tokenizer and the wheels, into .gpu/."""
    sys.path.insert(0, str(ROOT))
    from lib.models.embedded import embedded_model_path
    from lib.models.modeling import load_tokenizer

    load_tokenizer(str(embedded_model_path())).save_pretrained(ASSETS / "tokenizer")
    wheels = ASSETS / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
               "3.12", "--implementation", "cp", *[f"--platform={p}" for p in PLATFORMS], "-d", str(wheels), *WHEELS]
    subprocess.run(command, check=True)
    size = sum(f.stat().st_size for f in ASSETS.rglob("*") if f.is_file())
    print(f"gpu_check --prepare: {ASSETS.relative_to(ROOT)}/ holds the tokenizer and {len(list(wheels.glob('*.whl')))} "
          f"wheels, {size / 2**20:.0f} MiB")


def environment() -> dict:
    import importlib.metadata

    import torch

    env = {"date": datetime.date.today().isoformat(), "python": platform.python_version(),
           "cuda_available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda,
           "packages": {}}
    for name in PACKAGES:
        try:
            env["packages"][name] = importlib.metadata.version(name.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            env["packages"][name] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info()
        env.update(device=props.name, capability=list(torch.cuda.get_device_capability(0)),
                   multiprocessors=props.multi_processor_count, memory_gb=round(total / 2**30, 1),
                   free_gb=round(free / 2**30, 1), bf16_native=torch.cuda.get_device_capability(0) >= (8, 0))
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            env["driver"] = None
    else:
        env["device"] = platform.processor() or platform.machine()
    return env


def run_step(name: str, command: list[str], timeout_s: int, log: Path, env: dict) -> dict:
    """One step in a child process, under its own limit; its output to `log`."""
    t0 = time.perf_counter()
    print(f"gpu_check: {name} (at most {timeout_s} s) ...", flush=True)
    with open(log, "w") as out:
        try:
            proc = subprocess.run(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    seconds = round(time.perf_counter() - t0, 1)
    tail = log.read_text(errors="replace")[-3000:]
    print(f"gpu_check: {name}: exit {code} after {seconds} s\n{tail[-1500:]}", flush=True)
    return {"exit": code, "seconds": seconds, "log_tail": tail if code != 0 else tail[-600:]}


def junit_results(path: Path) -> list[dict]:
    if not path.exists():
        return []
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                outcome = "skipped" if kind == "skipped" else "failed"
                message = (node.get("message") or node.text or "")[:800]
        cases.append({"test": case.get("name"), "outcome": outcome, "seconds": float(case.get("time", 0)),
                      "message": message})
    return cases


def card16_estimate(model: str, settings: list[str], env: dict) -> dict:
    """`--estimate_memory_only` for the 16 GB step's settings on `model` (a folder with its config.json): its peak in
    GB (2^30 bytes, as the benchmark's peaks; None when it printed none) and its sampler line (the merged copy, or
    none: lib/sharding/memory.sampler_plan, the rule the trainer applies too)."""
    command = [sys.executable, "train_agrpo.py", "--model_name_or_path", model, *settings,
               "--estimate_memory_only", "true"]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    out: dict = {"estimate_gb": None, "estimate_sampler": None}
    for line in proc.stdout.splitlines():
        if line.startswith("peak (sampling and training"):
            out["estimate_gb"] = float(line.split()[-1])
        elif line.startswith("sampler"):
            out["estimate_sampler"] = " ".join(line.split())
    return out


def card16_step(args, out: Path, env: dict, tokenizer: Path, record) -> dict:
    """Step 5 (the module docstring): one scripts/bench_vs_trl.py run a trainer and shape, each under its own limit
    (so that one which runs out of memory or time leaves the others'), the random model kept between a shape's runs
    and removed after them (a 7-8B one is 15-16 GB of disk)."""
    import importlib.util
    import shutil

    dry = args.dry_run
    shapes = args.card16_shapes or (["qwen2-tiny", "llama-tiny"] if dry else ["qwen2.5-1.5b", "qwen2.5-7b",
                                                                             "llama-3.1-8b"])
    trl_shapes = shapes[:1] if args.card16_trl_shapes is None else args.card16_trl_shapes
    vllm_shapes = ([] if dry else ["qwen2.5-1.5b"]) if args.card16_vllm_shapes is None else args.card16_vllm_shapes
    if importlib.util.find_spec("vllm") is None:
        vllm_shapes = []
    first, trl_limit, later, vllm_limit = args.card16_timeouts
    # the recipe's settings (scripts/recipes/grpo_gsm8k_qlora_16gb.yaml) as the benchmark passes them to both trainers
    tokens = "8" if dry else "512"
    settings = ["--num_generations", "8", "--per_device_train_batch_size", "8", "--max_completion_length", tokens,
                "--beta", "0.04", "--use_peft", "true", "--load_in_4bit", "true", "--gradient_checkpointing", "true",
                "--lora_dropout", "0.0", "--max_memory", "16", "--use_vllm", "false"]
    if not dry:
        settings += ["--bf16", "true"]
    cache = Path(tempfile.gettempdir()) / "agrpo_card16_models"
    step: dict = {"exit": 0, "seconds": 0.0, "shapes": {}}
    for i, shape in enumerate(shapes):
        bench = [sys.executable, "scripts/bench_vs_trl.py", "--shape", shape, "--use_peft", "--load_in_4bit",
                 "--gradient_checkpointing", "--num_generations", "8", "--max_completion_length", tokens,
                 "--steps", "2" if dry else "3", "--warmup_steps", "1", "--rounds", "1", "--trl_bf16", "true",
                 "--trl_dtype", "auto", "--max_memory", "16", "--model_cache", str(cache)]
        if not dry:
            bench += ["--bf16", "true"]
        if tokenizer.is_dir():
            bench += ["--tokenizer", str(tokenizer)]
        runs = [("ours", ["--trainers", "ours"], first if i == 0 else later)]
        if shape in trl_shapes:
            runs.append(("trl", ["--trainers", "trl"], trl_limit))
        if shape in vllm_shapes:
            runs.append(("ours-vllm", ["--trainers", "ours", "--use_vllm", "--vllm_gpu_memory_utilization", "0.35"],
                         vllm_limit))
        figures: dict = {}
        for label, extra, limit in runs:
            name = f"card16-{shape}-{label}"
            run = run_step(f"16 GB: {shape}, {label}", [*bench, *extra, "--output_json", str(out / f"{name}.json")],
                           limit, out / f"{name}.log", env)
            step["seconds"] += run["seconds"]
            if (out / f"{name}.json").exists():
                report = json.loads((out / f"{name}.json").read_text())
                side = next(iter(report["summary"].values()))
                run.update({k: side[k] for k in ("peak_memory_gb", "median_step_time_s", "tokens_per_s",
                                                 "mean_completion_length", "measured_steps")})
            elif step["exit"] == 0:
                step["exit"] = run["exit"]
            figures[label] = run
        model = cache / f"random-{shape}"
        if (model / "config.json").exists():
            figures.update(card16_estimate(str(model), settings, env))
            peak = figures["ours"].get("peak_memory_gb")
            if figures["estimate_gb"] is not None and peak:
                figures["estimate_over_peak"] = figures["estimate_gb"] / peak
        if "peak_memory_gb" in figures["ours"] and "peak_memory_gb" in figures.get("trl", {}):
            figures["ratios"] = {"peak": figures["ours"]["peak_memory_gb"] / figures["trl"]["peak_memory_gb"],
                                 "step_time": figures["ours"]["median_step_time_s"]
                                 / figures["trl"]["median_step_time_s"]}
        step["shapes"][shape] = figures
        record(step)  # a check stopped at its limit keeps the shapes measured so far
        shutil.rmtree(model, ignore_errors=True)
    return step


def async_step(args, out: Path, env: dict, tokenizer: Path) -> dict:
    """Step 6: the synchronous step against the step at max_staleness 1 on one random-weight model of step 4's shape
    (its folder built first, outside the time limit's runs)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_vs_trl import model_folder

    shape = "qwen2-tiny" if args.dry_run else "qwen2.5-0.5b"
    folder = model_folder(argparse.Namespace(shape=shape, model_cache=None, seed=0,
                                             tokenizer=str(tokenizer) if tokenizer.is_dir() else None),
                          Path(tempfile.gettempdir()) / "agrpo_gpu_check_async")
    flags = ["--model_name_or_path", folder, "--max_steps", "3" if args.dry_run else "6",
             "--per_device_train_batch_size", "8", "--num_generations", "8", "--builtin_num_train", "64",
             "--max_completion_length", "8" if args.dry_run else "256", "--bf16", "false" if args.dry_run else "true"]
    step = run_step("asynchronous against synchronous", [
        sys.executable, "scripts/bench_regression.py", "--b_flags", args.async_b_flags, "--rounds",
        "2" if args.dry_run else args.async_rounds, "--output_json", str(out / "async.json"), "--", *flags],
        args.async_timeout, out / "async.log", env)
    if (out / "async.json").exists():
        report = json.loads((out / "async.json").read_text())
        ratio = report["summary"]["step"]["ratio"]  # synchronous / asynchronous, the median of rounds
        step.update(b_flags=args.async_b_flags, summary=report["summary"], gpu_utilisation=report["gpu_utilisation"],
                    async_over_sync=round(1 / ratio, 3) if ratio else None, goal=0.6)
        print(f"gpu_check: our step with {args.async_b_flags} / the synchronous step: {step['async_over_sync']} "
              f"(goal 0.6); GPU utilisation {report['gpu_utilisation']}", flush=True)
    return step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prepare", action="store_true", help="Gather the tokenizer and wheels into .gpu/ and stop.")
    parser.add_argument("--dry-run", action="store_true", help="Run every step on this CPU with tiny shapes.")
    parser.add_argument("--out", default=None, help="Folder for gpu_check.json and the logs (default: $OUT where "
                                                    "set, else runs/gpu_check).")
    parser.add_argument("--tests_timeout", type=int, default=200, help="Seconds for step 2 (190 s ran "
                        "7 of its 9 tests on an H100, 2026-11-26).")
    parser.add_argument("--bench_timeout", type=int, default=100, help="Seconds for step 4.")
    parser.add_argument("--sampler_timeout", type=int, default=60, help="Seconds for step 3.")
    parser.add_argument("--card16_shapes", nargs="+", default=None, help="Step 5's shapes (scripts/bench_vs_trl.py "
                        "--shape; default qwen2.5-1.5b qwen2.5-7b llama-3.1-8b, in the dry run qwen2-tiny llama-tiny).")
    parser.add_argument("--card16_trl_shapes", nargs="*", default=None, help="Step 5's shapes that TRL runs at too "
                        "(default: the first shape: at 1.5B TRL's step is 29 s, at 7-8B minutes).")
    parser.add_argument("--card16_vllm_shapes", nargs="*", default=None, help="Step 5's shapes that our trainer "
                        "also runs with vLLM at, where vLLM is installed (default: qwen2.5-1.5b; none in the dry run).")
    parser.add_argument("--card16_timeouts", nargs=4, type=int, default=[75, 120, 130, 90], help="Step 5's seconds "
                        "a run: ours at the first shape, TRL, ours at each further shape, ours with vLLM (a shape's "
                        "first run builds its random model).")
    parser.add_argument("--sampler_attn", nargs="+", default=["sdpa"],
                        help="Attention implementations step 3 compares, in this order.")
    parser.add_argument("--sampler_rows", nargs="+", default=["1", "8", "64"], help="Step 3's batch sizes.")
    parser.add_argument("--sampler_decode", nargs="+", default=["written", "graph"], help="Step 3's decode steps, "
                        "timed in alternation (scripts/bench_sampler.py --decode).")
    parser.add_argument("--bench_rounds", default="1", help="Step 4's alternated rounds (scripts/bench_vs_trl.py).")
    parser.add_argument("--bench_trl_dtype", nargs="+", default=["auto", "float32"], help="Step 4's TRL weights.")
    parser.add_argument("--async_timeout", type=int, default=240, help="Seconds for step 6.")
    parser.add_argument("--async_rounds", default="2", help="Step 6's alternated rounds.")
    parser.add_argument("--async_b_flags", default="--max_staleness 1",
                        help="Step 6's asynchronous side, against the synchronous one: for the HF sampler in a "
                             "process on the same GPU, \"--max_staleness 1 --sampler_device cuda:0\".")
    parser.add_argument("--skip", nargs="*", default=[], choices=["tests", "sampler", "bench", "card16", "async"],
                        help="Steps to leave out.")
    args = parser.parse_args(argv)
    if args.prepare:
        prepare()
        return 0
    import torch

    if not torch.cuda.is_available() and not args.dry_run:
        sys.exit("gpu_check: no CUDA device here; run it on a machine with an NVIDIA GPU, or give --dry-run to "
                 "run its steps on this CPU")
    out = Path(args.out or os.environ.get("OUT") or ROOT / "runs" / "gpu_check")
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    tokenizer = ASSETS / "tokenizer"
    if tokenizer.is_dir():
        env["AGRPO_TOKENIZER_DIR"] = str(tokenizer)
    if args.dry_run:
        env["AGRPO_GPU_DRY_RUN"] = "1"
    results = {"dry_run": args.dry_run, "environment": environment(), "steps": {}}
    report_file = out / "gpu_check.json"

    def save() -> None:
        report_file.write_text(json.dumps(results, indent=1))

    save()
    if "tests" not in args.skip:
        measures = out / "measures.jsonl"
        measures.unlink(missing_ok=True)
        # without the suite's addopts (two pytest-xdist workers): one test at a time, as they measure times and memory
        # on the GPU, and the GPU image has no pytest-xdist
        step = run_step("tests marked gpu", [sys.executable, "-m", "pytest", "-o", "addopts=", "-m", "gpu",
                                             "tests/test_gpu.py", "tests/test_gpu_paths.py", "-p", "no:cacheprovider",
                                             "-q", "-rfE", f"--junitxml={out / 'tests.xml'}"],
                        args.tests_timeout, out / "tests.log", {**env, "AGRPO_GPU_REPORT": str(measures)})
        step["tests"] = junit_results(out / "tests.xml")
        step["measured"] = [json.loads(line) for line in measures.read_text().splitlines()] \
            if measures.exists() else []
        results["steps"]["tests"] = step
        save()
    if "sampler" not in args.skip:
        shape = ["--shape", "qwen2-tiny", "--rows", "1", "8", "--steps", "4", "--short", "2", "--repeats", "1"] \
            if args.dry_run else ["--shape", "qwen2.5-0.5b", "--rows", *args.sampler_rows, "--steps", "64",
                                  "--repeats", "3"]
        step = run_step("sampler decode step against its floor", [
            sys.executable, "scripts/bench_sampler.py", *shape, "--attn", *args.sampler_attn, "--decode",
            *args.sampler_decode, "--workdir",
            str(Path(tempfile.gettempdir()) / "agrpo_bench_sampler"), "--output_json", str(out / "sampler.json")],
            args.sampler_timeout, out / "sampler.log", env)
        if (out / "sampler.json").exists():
            step["report"] = json.loads((out / "sampler.json").read_text())
            # the graphed step against its floor, and issue 52's goal for it at the Qwen2.5-0.5B shape
            step["graph_floor_ratios"] = {
                str(r["rows"]): {"ratio": round(r["ratio"], 2), "goal": FLOOR_GOALS[r["rows"]],
                                 "met": r["ratio"] <= FLOOR_GOALS[r["rows"]]}
                for r in step["report"]["results"] if r["decode"] == "graph" and r["rows"] in FLOOR_GOALS}
            print(f"gpu_check: the graphed decode step / its floor: {step['graph_floor_ratios']}", flush=True)
        results["steps"]["sampler"] = step
        save()
    if "card16" not in args.skip:
        def record(step: dict) -> None:
            results["steps"]["card16"] = step
            save()

        record(card16_step(args, out, env, tokenizer, record))
    if "bench" not in args.skip:
        # the dry run: one measured step of each trainer, 8 tokens, TRL with bf16=True as on the GPU (the script's
        # mechanics; tests/test_gpu_check.py checks its report)
        shape = ["--shape", "qwen2-tiny", "--max_completion_length", "8", "--steps", "2", "--trl_bf16", "true"] \
            if args.dry_run else ["--shape", "qwen2.5-0.5b", "--max_completion_length", "256", "--steps", "5",
                                  "--trl_bf16", "true", "--bf16", "true", "--trl_dtype", *args.bench_trl_dtype]
        bench = [sys.executable, "scripts/bench_vs_trl.py", *shape, "--num_generations", "8", "--warmup_steps", "1",
                 "--rounds", "1" if args.dry_run else args.bench_rounds, "--output_json", str(out / "bench.json")]
        if tokenizer.is_dir():
            bench += ["--tokenizer", str(tokenizer)]
        step = run_step("benchmark against TRL", bench, args.bench_timeout, out / "bench.log", env)
        if (out / "bench.json").exists():
            report = json.loads((out / "bench.json").read_text())
            step.update(summary=report.get("summary"), ratios=report.get("ratios"), settings=report.get("settings"))
        results["steps"]["bench"] = step
        save()
    if "async" not in args.skip:
        results["steps"]["async"] = async_step(args, out, env, tokenizer)
        save()
    failed = [name for name, step in results["steps"].items() if step["exit"] != 0]
    print(f"gpu_check: results in {report_file}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
