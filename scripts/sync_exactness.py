"""How exactly the sampler's weights follow an adapter policy: the merged copy's log-probs against the policy's.

    python scripts/sync_exactness.py

On the embedded model with a LoRA adapter (r 16, every linear layer; lora_B set to 0.01 N(0, 1) so the adapter does
something), for LoRA and QLoRA (NF4 base), in fp32 and in bf16 (the sampler's copy in bf16, the policy under bf16
autocast, as the trainer runs them): 2 random prompts x 4 completions of 32 tokens sampled from the copy, then the
per-token log-prob gap (max / mean) between the copy and the policy: after building the copy, after an update of
lora_A that the copy has not received (what a missed sync would cost), and after `sync_weights`, with the sync's
time. Last, full fine-tuning's bf16 copy against its fp32 master weights, for comparison. docs/performance.md 2.3.
"""

import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lib.models.embedded import embedded_model_path  # noqa
from lib.models.modeling import CompletionScorer, end_token_ids, load_policy, load_tokenizer  # noqa
from lib.sampling import cpu_kernels  # noqa: E402
from lib.sampling.rollout import HFRollout  # noqa: E402


def gap(engine, policy, rollout, bf16: bool) -> str:
    args = (rollout.prompt_ids, rollout.prompt_mask, rollout.prompt_index, rollout.completion_ids,
            rollout.completion_mask, rollout.temperatures)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext():
        ours = CompletionScorer(engine.copy)(*args, with_entropy=False)[0].float()
        theirs = CompletionScorer(policy)(*args, with_entropy=False)[0].float()
    diff = (ours - theirs)[rollout.completion_mask.bool()].abs()
    return f"{diff.max():.2g} / {diff.mean():.2g}"


def main() -> None:
    path = str(embedded_model_path())
    tokenizer = load_tokenizer(path)
    print("| policy | precision | after building | an update not synced | after the sync | sync (s) |")
    print("|---|---|---|---|---|---|")
    for load_in_4bit in (False, True):
        for bf16 in (False, True):
            policy = load_policy(path, use_peft=True, load_in_4bit=load_in_4bit)
            with torch.no_grad():
                for name, p in policy.named_parameters():
                    if "lora_B" in name:
                        p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.01)
            engine = HFRollout(policy, end_token_ids(policy, tokenizer), tokenizer.pad_token_id, bf16=bf16, seed=0,
                               copy=cpu_kernels.sampling_copy)
            generator = torch.Generator().manual_seed(1)
            prompts = torch.randint(100, 40000, (2, 20), generator=generator)
            rollout = engine.generate(prompts, torch.ones_like(prompts), 4, 32, temperature=1.0)
            policy.eval()
            built = gap(engine, policy, rollout, bf16)
            with torch.no_grad():
                for name, p in policy.named_parameters():
                    if "lora_A" in name:
                        p.add_(torch.randn(p.shape, generator=generator) * 0.01)
            stale = gap(engine, policy, rollout, bf16)
            start = time.perf_counter()
            engine.sync_weights(policy)
            seconds = time.perf_counter() - start
            print(f"| {'QLoRA' if load_in_4bit else 'LoRA'} | {'bf16' if bf16 else 'fp32'} | {built} | {stale} | "
                  f"{gap(engine, policy, rollout, bf16)} | {seconds:.2f} |", flush=True)
    policy = load_policy(path)
    engine = HFRollout(policy, end_token_ids(policy, tokenizer), tokenizer.pad_token_id, bf16=True, seed=0,
                       copy=cpu_kernels.sampling_copy)
    prompts = torch.randint(100, 40000, (2, 20), generator=torch.Generator().manual_seed(1))
    rollout = engine.generate(prompts, torch.ones_like(prompts), 4, 32, temperature=1.0)
    policy.eval()
    print(f"| full fine-tuning | bf16 | {gap(engine, policy, rollout, True)} | - | - | - |")


if __name__ == "__main__":
    main()
