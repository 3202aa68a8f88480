"""The training pass alone: the embedded model's policy forward and backward, full fine-tuning against LoRA variants.

    python scripts/bench_policy_pass.py                     # full, lora (dropout 0.05), lora_nodrop, and bf16 bases
    python scripts/bench_policy_pass.py full lora_nodrop    # some of them

Each variant: 2 prompts of 90 tokens x 8 completions of 48 tokens (random token ids, the prompt prefix shared as in
training), `CompletionScorer` as the trainer calls it, a mean log-prob loss, backward; bf16 autocast where the CPU
has native bf16 (as the trainer's default), fp32 otherwise. Prints the median of 5 passes after one warm-up, in
seconds. Used for docs/performance.md 2.3 (what LoRA's training pass costs against full fine-tuning's)."""

import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lib.models.embedded import embedded_model_path  # noqa: E402
from lib.models.modeling import CompletionScorer, load_policy, native_bf16  # noqa: E402

VARIANTS = {
    "full": {},
    "lora": {"use_peft": True, "lora_dropout": 0.05},
    "lora_nodrop": {"use_peft": True, "lora_dropout": 0.0},
    "lora_bf16base": {"use_peft": True, "lora_dropout": 0.05, "dtype": torch.bfloat16},
    "lora_bf16base_nodrop": {"use_peft": True, "lora_dropout": 0.0, "dtype": torch.bfloat16},
}


def main(names: list[str]) -> None:
    path = str(embedded_model_path())
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 40000, (2, 90), generator=generator)
    completion = torch.randint(100, 40000, (16, 48), generator=generator)
    prompt_mask, completion_mask = torch.ones_like(prompt), torch.ones_like(completion)
    index, temperatures = torch.arange(2).repeat_interleave(8), torch.full((16,), 0.7)
    bf16 = native_bf16("cpu")
    print(f"precision: {'bf16 autocast' if bf16 else 'fp32'}")
    for name in names:
        model = load_policy(path, **VARIANTS[name]).train()
        scorer = CompletionScorer(model)
        params = [p for p in model.parameters() if p.requires_grad]
        times = []
        for _ in range(6):
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext():
                logps, _ = scorer(prompt, prompt_mask, index, completion, completion_mask, temperatures)
            (-(logps * completion_mask).sum() / completion_mask.sum()).backward()
            times.append(time.perf_counter() - start)
            for p in params:
                p.grad = None
        trainable = sum(p.numel() for p in params) / 1e6
        print(f"{name:22s} {statistics.median(times[1:]):.3f} s  ({trainable:.1f}M trainable)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or list(VARIANTS))
