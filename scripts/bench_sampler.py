"""The HF sampler's decode step against the machine's floor (docs/performance.md 2.1).

    python scripts/bench_sampler.py                                   # CPU: the embedded model, 1 / 8 / 64 rows
    python scripts/bench_sampler.py --shape qwen2.5-0.5b --attn sdpa agrpo_sdpa    # GPU: random weights, bf16

One decode step of `lib.sampling.rollout.HFRollout` (the trainer's sampler: prompts prefilled once, the cache shared by a
group, one token a step for every row), timed as the difference of two generate calls that decode `--short` and
`--short + --steps` tokens with no end token (every row runs to the cap), divided by `--steps`; the median of
`--repeats`. Beside it, its floor: the bytes one step must read (the sampler's weights once, and every row's cached
keys and values at the mean context length) over the memory bandwidth measured here by copying a large tensor (bytes
read plus written a second). Arithmetic is far below both at these batch sizes, so the floor is a bandwidth floor.
Last, the step's linear products alone (each layer's product once, on random input): what the matrix kernel, not the
step's own code, costs; on a CPU that part alone is 2-2.5x the floor (docs/performance.md 2.4).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lib.sharding.memory import kv_bytes_per_token  # noqa: E402
from lib.models.embedded import resolve_model_path  # noqa: E402
from lib.models.modeling import load_policy, native_bf16  # noqa: E402
from lib.sampling import cpu_kernels  # noqa: E402  (also registers --attn agrpo_sdpa)
from lib.sampling.decode import GraphSteps, LlamaStep  # noqa: E402
from lib.sampling.rollout import HFRollout  # noqa: E402


def bandwidth(device: torch.device, megabytes: int) -> float:
    """Bytes a second a large copy moves on `device` (read plus written), the best of five."""
    source = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(6):
        sync(device)
        t0 = time.perf_counter()
        target.copy_(source)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * source.numel() / best


def products_time(model: torch.nn.Module, rows: int, device: torch.device, repeats: int) -> float:
    """Seconds that one decode step's linear products alone take at `rows` (every layer's, the output layer's,
    each prepacked group's once), on random bf16 / fp32 input: the part of a step that the matrix kernel sets."""
    calls = []
    for module in model.modules():
        if isinstance(module, cpu_kernels.PackedGroup):
            calls.append((module.product, module.in_features))
        elif isinstance(module, (cpu_kernels.PackedLinear, torch.nn.Linear)):
            calls.append((module, module.in_features))
    dtype = next(model.parameters()).dtype
    inputs = {size: torch.randn(rows, size, dtype=dtype, device=device) for size in {size for _, size in calls}}
    times = []
    with torch.no_grad():
        for _ in range(repeats + 1):  # the first is a warm-up
            sync(device)
            t0 = time.perf_counter()
            for call, size in calls:
                call(inputs[size])
            sync(device)
            times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def model_folder(args) -> str:
    if args.shape is None:
        return resolve_model_path(args.model)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from scripts.bench_vs_trl import SHAPES

    folder = Path(args.workdir) / f"random-{args.shape}"
    if not (folder / "config.json").exists():
        torch.manual_seed(0)
        Qwen2ForCausalLM(Qwen2Config(**SHAPES[args.shape], bos_token_id=None, eos_token_id=2,
                                     pad_token_id=0)).save_pretrained(folder)
    return str(folder)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="embedded", help="A model folder, or 'embedded'.")
    p.add_argument("--shape", help="Instead: a Qwen2 of this shape with random weights (scripts/bench_vs_trl.py).")
    p.add_argument("--workdir", default="runs/bench_sampler", help="Where a --shape model is written.")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--prompt_length", type=int, default=64)
    p.add_argument("--short", type=int, default=8)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--attn", nargs="+", default=[None], help="Attention implementations to compare (default: the "
                   "trainer's for this device).")
    p.add_argument("--decode", nargs="+", choices=["fast", "model", "written", "graph"], default=["fast"],
                   help="The sampler's decode step: fast (what the sampler uses: lib/sampling/decode.decode_step_for), "
                   "model (the model's own forward), written (decode.LlamaStep), graph (decode.GraphSteps: "
                   "decode.GraphStep's CUDA graphs, kept across calls); several are timed in alternation.")
    p.add_argument("--bf16", choices=["auto", "true", "false"], default="auto")
    p.add_argument("--bandwidth_mb", type=int, default=None, help="Copy size for the bandwidth (default: 1024 on a "
                   "GPU, 256 on a CPU).")
    p.add_argument("--output_json")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bf16 = native_bf16(device) if args.bf16 == "auto" else args.bf16 == "true"
    path = model_folder(args)
    bw = bandwidth(device, args.bandwidth_mb or (1024 if device.type == "cuda" else 256))
    results = []
    for attn in args.attn:
        policy = load_policy(path, device=device, attn_implementation=attn).eval()
        # no end token: every row decodes to the cap
        engine = HFRollout(policy, [-1], 0, bf16=bf16, seed=0, copy=cpu_kernels.sampling_copy)
        model = engine.model
        # graphs kept across the generate calls, as the sampler keeps them for a run
        steps_by_name = {"fast": engine.decode_step, "model": None, "written": LlamaStep,
                         "graph": GraphSteps()}
        weight_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()
                           if t.is_floating_point())
        weight_bytes += sum(m.packed.numel() * m.packed.element_size() for m in model.modules()
                            if hasattr(m, "packed"))  # prepacked bf16 linears keep their weight outside the state
        kv_token = kv_bytes_per_token(model.config, 2 if bf16 else 4)
        name = attn or getattr(model.config, "_attn_implementation", "default")
        for rows in args.rows:
            prompts = torch.randint(10, 1000, (rows, args.prompt_length), generator=torch.Generator().manual_seed(0))
            prompts, mask = prompts.to(device), torch.ones_like(prompts).to(device)

            def timed(new_tokens: int, decode: str) -> float:
                engine.decode_step = steps_by_name[decode]
                sync(device)
                t0 = time.perf_counter()
                engine.generate(prompts, mask, 1, new_tokens, temperature=1.0)
                sync(device)
                return time.perf_counter() - t0

            steps: dict[str, list[float]] = {decode: [] for decode in args.decode}
            for decode in args.decode:  # warm-up: kernels, allocations, and the graphs of both lengths' windows
                timed(args.short + args.steps, decode)
                timed(args.short, decode)
            for _ in range(args.repeats):  # the variants alternate, so that a slow moment hits both
                for decode in args.decode:
                    long = timed(args.short + args.steps, decode)
                    steps[decode].append((long - timed(args.short, decode)) / args.steps)
            context = args.prompt_length + args.short + args.steps / 2
            floor = (weight_bytes + rows * context * kv_token) / bw
            products = products_time(model, rows, device, 5 * args.repeats)
            for decode, times in steps.items():
                step = statistics.median(times)
                results.append({"attn": name, "decode": decode, "rows": rows, "step_ms": step * 1e3,
                                "floor_ms": floor * 1e3, "ratio": step / floor, "products_ms": products * 1e3,
                                "spread_ms": [min(times) * 1e3, max(times) * 1e3]})
                print(f"{name:>12} {decode:>5}  rows {rows:3d}: decode step {step * 1e3:7.2f} ms (spread "
                      f"{min(times) * 1e3:.2f}-{max(times) * 1e3:.2f}), floor {floor * 1e3:6.2f} ms, "
                      f"{step / floor:5.1f}x; its linear products alone {products * 1e3:.2f} ms "
                      f"({products / floor:.1f}x the floor)", flush=True)
        engine = policy = model = None  # freed before the next attention implementation loads
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "bf16": bf16,
              "model": args.shape or args.model, "bandwidth_gb_s": bw / 1e9, "results": results}
    print(f"memory bandwidth (copy, read + written): {bw / 1e9:.0f} GB/s")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
