"""Gradient checkpointing with and without the shared prompt prefix: time and peak memory of a training pass.

    python scripts/bench_checkpointing.py                                   # the embedded model, G=8, 256 + 512
    python scripts/bench_checkpointing.py --prompt_length 1024 --completion_length 256 --repeats 3

One micro-batch of G completions of one prompt (random token ids, every completion at full length), scored by
lib/models/modeling.CompletionScorer and run backward, in three settings, each in a fresh child process:

  plain        no checkpointing, the prompt run once and shared (the default)
  full         gradient checkpointing, the full [prompt; completion] sequences (what the scorer did under
               checkpointing before the prefix could pass through checkpointed blocks)
  shared       gradient checkpointing, the prompt run once and its keys and values shared
               (lib/models/checkpointed_prefix.py, which the trainer hands to its scorer)

It prints seconds (median of --repeats passes, after one warm-up pass) and the peak resident set above the loaded
model (glibc's mmap threshold fixed at 64 KiB, the kernel's high-water mark restarted before the pass: the method of
scripts/bench_memory.py), and the log-probs' largest difference between the settings. On a CPU the times are ratios
only; docs/performance.md 3.6 has the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SETTINGS = {"plain": (False, True), "full": (True, False), "shared": (True, True)}  # (checkpointing, shared prefix)


def worker(spec: dict) -> dict:
    import torch

    from lib.models import checkpointed_prefix
    from lib.models.embedded import resolve_model_path
    from lib.models.modeling import CompletionScorer, load_policy
    from scripts.bench_memory import peak, resident, restart_peak

    torch.set_num_threads(spec["threads"])
    checkpointing, shared = SETTINGS[spec["setting"]]
    policy = load_policy(resolve_model_path(spec["model"]), use_peft=spec["lora"], gradient_checkpointing=checkpointing)
    policy.train()
    scorer = CompletionScorer(policy, share_prompt_prefix=shared, checkpointed_prefix=checkpointed_prefix)
    vocab = policy.get_output_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, vocab, (1, spec["prompt_length"]), generator=g)
    completions = torch.randint(3, vocab, (spec["generations"], spec["completion_length"]), generator=g)
    args = (prompt, torch.ones_like(prompt), torch.zeros(spec["generations"], dtype=torch.long), completions,
            torch.ones_like(completions), torch.ones(spec["generations"]))
    times, peaks, logp = [], [], None
    for i in range(spec["repeats"] + 1):
        policy.zero_grad(set_to_none=True)
        base = resident()
        restart_peak()
        t0 = time.perf_counter()
        logp, _ = scorer(*args, with_entropy=False)
        logp.sum().backward()
        if i:  # the first pass warms up (allocator, oneDNN's kernels)
            times.append(time.perf_counter() - t0)
            peaks.append(peak() - base)
    return {"seconds": statistics.median(times), "peak": max(peaks), "logp": logp.detach()[:, :8].tolist()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="embedded:SmolLM2-135M-Instruct", help="Default: the embedded model.")
    p.add_argument("--lora", action="store_true", help="A LoRA adapter (r 16) instead of full weights.")
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--prompt_length", type=int, default=256)
    p.add_argument("--completion_length", type=int, default=512)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        print("RESULT " + json.dumps(worker(json.loads(a.worker))))
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}
    results = {}
    for setting in SETTINGS:
        spec = {**{k: getattr(a, k) for k in ("model", "lora", "generations", "prompt_length", "completion_length",
                                              "repeats", "threads")}, "setting": setting}
        out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], env=env, capture_output=True,
                             text=True, cwd=ROOT)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"{setting} failed:\n{out.stderr[-3000:]}")
        results[setting] = json.loads(line[7:])
    import torch

    print(f"{a.model} ({'LoRA' if a.lora else 'full'}), {a.generations} completions x {a.completion_length} tokens "
          f"of one {a.prompt_length}-token prompt, {a.threads} threads, median of {a.repeats}")
    print("| setting | seconds | vs full | peak above the model (MB) | vs plain |")
    print("|---|---|---|---|---|")
    for setting, r in results.items():
        print(f"| {setting} | {r['seconds']:.2f} | {r['seconds'] / results['full']['seconds']:.2f} | "
              f"{r['peak'] / 2**20:.0f} | {r['peak'] / results['plain']['peak']:.2f} |")
    gap = max(float((torch.tensor(r["logp"]) - torch.tensor(results["plain"]["logp"])).abs().max())
              for r in results.values())
    print(f"log-probs: largest difference from plain {gap:.2g}")


if __name__ == "__main__":
    main()
