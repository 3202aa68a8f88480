"""vLLM with a LoRA policy: decode time and sync time of the two ways the adapter reaches the engine.

    python scripts/bench_vllm_lora.py                         # embedded model, r16 adapter, 2 prompts x 4 x 32 tokens
    python scripts/bench_vllm_lora.py --num_prompts 64 --num_generations 1   # a wide batch, as an evaluation
    python scripts/bench_vllm_lora.py --load_in_4bit --rounds 5 --max_new_tokens 64

`merge` (every weight with the adapter merged in, sent each step) and `adapter` (vLLM's LoRA: the base once, the
adapter each step), each in a fresh child process one after the other, through lib/sampling/vllm_rollout.VLLMRollout as the
trainer builds it. Every completion runs to --max_new_tokens (ignore_eos), so both decode the same number of tokens.
Prints the median seconds of a sampling call and of a sync per mode, and their ratio (docs/performance.md 4.1).
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


def worker(args) -> dict:
    import torch

    from lib.models.embedded import resolve_model_path
    from lib.models.modeling import load_policy, load_tokenizer
    from lib.sampling.vllm_rollout import VLLMRollout, adapter_ranks

    path = resolve_model_path(args.model_name_or_path)
    tokenizer = load_tokenizer(path)
    policy = load_policy(path, use_peft=True, lora_r=args.lora_r, lora_alpha=2 * args.lora_r,
                         load_in_4bit=args.load_in_4bit)
    engine = VLLMRollout(path, [tokenizer.eos_token_id], tokenizer.pad_token_id, max_model_len=512, seed=0,
                         dtype="bfloat16" if args.bf16 else "float32", sampling_kwargs={"ignore_eos": True},
                         lora_rank=max(adapter_ranks(policy)) if args.mode == "adapter" else None)
    from lib.data.records import format_prompt, tokenize_prompts
    from lib.data.word_problems import builtin_task

    records = builtin_task(seed=0, num_train=args.num_prompts, num_eval=1)[0][: args.num_prompts]
    ids, mask = tokenize_prompts(tokenizer, [format_prompt(tokenizer, r["problem"]) for r in records], 256)
    syncs, calls = [], []
    for _ in range(args.rounds):
        with torch.no_grad():  # an optimizer step's worth of change in the adapter
            for name, p in policy.named_parameters():
                if "lora_" in name:
                    p.add_(torch.randn_like(p) * 1e-3)
        t0 = time.perf_counter()
        engine.sync_weights(policy)
        syncs.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        out = engine.generate(ids, mask, args.num_generations, args.max_new_tokens, temperature=0.8)
        calls.append(time.perf_counter() - t0)
    engine.close()
    return {"sync_s": syncs, "sample_s": calls, "tokens": int(out.completion_mask.sum())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model_name_or_path", default="embedded")
    p.add_argument("--lora_r", type=int, default=16)
    p.add_argument("--load_in_4bit", action="store_true")
    p.add_argument("--bf16", action="store_true", help="A bf16 engine (default fp32).")
    p.add_argument("--num_prompts", type=int, default=2, help="Prompts of the built-in task per call.")
    p.add_argument("--num_generations", type=int, default=4)
    p.add_argument("--max_new_tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--mode", choices=["merge", "adapter"], help=argparse.SUPPRESS)  # internal: one child
    args = p.parse_args()
    if args.mode:
        print("RESULT" + json.dumps(worker(args)))
        return
    results = {}
    for mode in ("merge", "adapter"):
        proc = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--mode", mode], capture_output=True,
                              text=True, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get(
                                  "VLLM_CPU_KVCACHE_SPACE", "1")})
        if proc.returncode != 0:
            sys.exit(f"{mode} failed:\n{proc.stderr[-3000:]}")
        results[mode] = json.loads(proc.stdout.split("RESULT", 1)[1])
    print(f"{'':<10}{'sample call (s)':>18}{'sync (s)':>12}{'tokens':>8}")
    for mode, r in results.items():
        print(f"{mode:<10}{statistics.median(r['sample_s']):>18.2f}{statistics.median(r['sync_s']):>12.3f}"
              f"{r['tokens']:>8}")
    ratio = statistics.median(results["adapter"]["sample_s"]) / statistics.median(results["merge"]["sample_s"])
    print(f"adapter / merge sampling time: {ratio:.2f}x ({args.rounds} calls each, medians)")


if __name__ == "__main__":
    main()
