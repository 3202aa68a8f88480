"""The HF sampler's decode step against the machine's floor (docs/performance.md 2.1).

    python scripts/bench_sampler.py                                   # CPU: the embedded model, 1 / 8 / 64 rows
    python scripts/bench_sampler.py --shape qwen2.5-0.5b --attn sdpa agrpo_sdpa    # GPU: random weights, bf16
    python scripts/bench_sampler.py --use_peft --load_in_4bit --sampler dense direct   # QLoRA: copy or none

One decode step of `lib.sampling.rollout.HFRollout` (the trainer's sampler: prompts prefilled once, the cache shared by a
group, one token a step for every row), timed as the difference of two generate calls that decode `--short` and
`--short + --steps` tokens with no end token (every row runs to the cap), divided by `--steps`; the median of
`--repeats`. Beside it, its floor: the bytes one step must read (the sampler's weights once, and every row's cached
keys and values at the mean context length) over the memory bandwidth measured here by copying a large tensor (bytes
read plus written a second). Arithmetic is far below both at these batch sizes, so the floor is a bandwidth floor.
Last, the step's linear products alone (each layer's product once, on random input): what the matrix kernel, not the
step's own code, costs; on a CPU that part alone is 2-2.5x the floor (docs/performance.md 2.4).

With --use_peft (LoRA r 16, alpha 32, every linear layer, B drawn so the adapter changes the logits) and
--load_in_4bit (an NF4 base), --sampler compares the HF sampler's two ways of decoding an adapter policy
(lib/sharding/memory.sampler_plan): "dense", the merged copy, and "direct", no copy (the base's products plus the
adapter's); `sampler_bytes` is what each holds for sampling: the copy's weights, or one dequantised layer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lib.sharding.memory import kv_bytes_per_token  # noqa: E402
from lib.models.embedded import resolve_model_path  # noqa: E402
from lib.models.modeling import load_policy, native_bf16, unwrap_causal_lm  # noqa: E402
from lib.sampling import cpu_kernels  # noqa: E402
from lib.sampling.decode import GraphSteps, LlamaStep  # noqa: E402
from lib.sampling.policy_copy import dense_numel  # noqa: E402
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


def sampler_memory(engine: HFRollout, policy: torch.nn.Module, bf16: bool) -> int:
    """Bytes the sampler holds for its weights beyond the policy's: a copy's tensors (prepacked ones included); with
    no copy, the largest layer a decode step dequantises (a 4-bit base) or casts to bf16 under autocast (an fp32
    base), alive for its product only."""
    if engine.copy is not None:  # counted from the policy: a prepacked layer keeps its weight outside its parameters
        return dense_numel(unwrap_causal_lm(policy)) * (2 if bf16 else 4)
    largest = 0
    for module in policy.modules():
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is not None:
            largest = max(largest, state.shape.numel() * (2 if bf16 else 4))
        elif hasattr(module, "base_layer") and bf16 and module.base_layer.weight.element_size() > 2:
            largest = max(largest, module.base_layer.weight.numel() * 2)
    return largest


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
    p.add_argument("--use_peft", action="store_true", help="A LoRA policy (r 16, alpha 32, every linear layer).")
    p.add_argument("--load_in_4bit", action="store_true", help="With --use_peft: an NF4 base (QLoRA).")
    p.add_argument("--sampler", nargs="+", choices=["dense", "direct"], default=["dense"],
                   help="An adapter policy's sampler (lib/sharding/memory.sampler_plan): dense (the merged "
                   "copy), direct (no copy); several are timed in alternation.")
    p.add_argument("--bandwidth_mb", type=int, default=None, help="Copy size for the bandwidth (default: 1024 on a "
                   "GPU, 256 on a CPU).")
    p.add_argument("--output_json")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bf16 = native_bf16(device) if args.bf16 == "auto" else args.bf16 == "true"
    path = model_folder(args)
    bw = bandwidth(device, args.bandwidth_mb or (1024 if device.type == "cuda" else 256))
    results = []
    if args.load_in_4bit and not args.use_peft:
        p.error("--load_in_4bit trains an adapter on a 4-bit base: add --use_peft")
    for attn in args.attn:
        policy = load_policy(path, device=device, attn_implementation=attn, use_peft=args.use_peft, lora_r=16,
                             lora_alpha=32, load_in_4bit=args.load_in_4bit).eval()
        with torch.no_grad():  # B = 0 would make the adapter's products add nothing
            for name, param in policy.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(0)) * 0.01)
        # no end token: every row decodes to the cap; headroom 0: no copy fits, the direct decode
        engines = {sampler: HFRollout(policy, [-1], 0, bf16=bf16, seed=0, copy=partial(
            cpu_kernels.sampling_copy, headroom=None if sampler == "dense" else 0)) for sampler in args.sampler}
        engine = engines[args.sampler[0]]
        model = engine.model
        steps_by_name = {sampler: {"fast": e.decode_step, "model": None, "written": LlamaStep,
                                   "graph": GraphSteps()}  # graphs kept across calls, as the sampler keeps them
                         for sampler, e in engines.items()}
        if engine.copy is None:  # the policy's own layers: what is read a step is the policy's weights
            weight_bytes = sum(t.numel() * t.element_size() for t in policy.parameters())
        else:
            weight_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()
                               if t.is_floating_point())
            weight_bytes += sum(m.packed.numel() * m.packed.element_size() for m in model.modules()
                                if hasattr(m, "packed"))  # prepacked bf16 linears keep their weight outside the state
        sampler_bytes = {sampler: sampler_memory(e, policy, bf16) for sampler, e in engines.items()}
        kv_token = kv_bytes_per_token(model.config, 2 if bf16 else 4)
        name = attn or getattr(model.config, "_attn_implementation", "default")
        variants = [(sampler, decode) for sampler in args.sampler for decode in args.decode]
        for rows in args.rows:
            prompts = torch.randint(10, 1000, (rows, args.prompt_length), generator=torch.Generator().manual_seed(0))
            prompts, mask = prompts.to(device), torch.ones_like(prompts).to(device)

            def timed(new_tokens: int, variant: tuple[str, str]) -> float:
                sampler, decode = variant
                engines[sampler].decode_step = steps_by_name[sampler][decode]
                sync(device)
                t0 = time.perf_counter()
                engines[sampler].generate(prompts, mask, 1, new_tokens, temperature=1.0)
                sync(device)
                return time.perf_counter() - t0

            steps: dict[tuple[str, str], list[float]] = {variant: [] for variant in variants}
            for variant in variants:  # warm-up: kernels, allocations, and the graphs of both lengths' windows
                timed(args.short + args.steps, variant)
                timed(args.short, variant)
            for _ in range(args.repeats):  # the variants alternate, so that a slow moment hits both
                for variant in variants:
                    long = timed(args.short + args.steps, variant)
                    steps[variant].append((long - timed(args.short, variant)) / args.steps)
            context = args.prompt_length + args.short + args.steps / 2
            floor = (weight_bytes + rows * context * kv_token) / bw
            products = products_time(model, rows, device, 5 * args.repeats)
            for (sampler, decode), times in steps.items():
                step = statistics.median(times)
                results.append({"attn": name, "decode": decode, "rows": rows, "step_ms": step * 1e3,
                                "floor_ms": floor * 1e3, "ratio": step / floor, "products_ms": products * 1e3,
                                "spread_ms": [min(times) * 1e3, max(times) * 1e3],
                                **({"sampler": sampler, "sampler_bytes": sampler_bytes[sampler]}
                                   if args.use_peft else {})})
                label = f"{sampler:>6} " if args.use_peft else ""
                print(f"{name:>12} {label}{decode:>5}  rows {rows:3d}: decode step {step * 1e3:7.2f} ms (spread "
                      f"{min(times) * 1e3:.2f}-{max(times) * 1e3:.2f}), floor {floor * 1e3:6.2f} ms, "
                      f"{step / floor:5.1f}x; its linear products alone {products * 1e3:.2f} ms "
                      f"({products / floor:.1f}x the floor)", flush=True)
        if args.use_peft:
            for sampler, size in sampler_bytes.items():
                print(f"{sampler}: holds {size / 2**20:.2f} MiB for sampling", flush=True)
        engines = engine = policy = model = None  # freed before the next attention implementation loads
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "bf16": bf16,
              "model": args.shape or args.model, "bandwidth_gb_s": bw / 1e9, "results": results}
    print(f"memory bandwidth (copy, read + written): {bw / 1e9:.0f} GB/s")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
