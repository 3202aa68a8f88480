"""Half-precision frozen bases for LoRA and QLoRA: the base in bf16, the adapter and its optimizer states in fp32."""

from pathlib import Path

import pytest
import torch

from lib.models.modeling import completion_logps, load_policy, reference_dtype, weights_dtype
from lib.setup import build_optimizer


def test_a_lora_base_is_frozen_in_bf16_on_a_bf16_gpu_and_fp32_elsewhere():
    assert weights_dtype(None, lora=True, device="cuda", bf16=True) == torch.bfloat16
    # a GPU without bf16 (T4, V100): fp32, since an fp16 base would need loss scaling; a CPU keeps the demo's fp32
    assert weights_dtype(None, lora=True, device="cuda", bf16=False) == torch.float32
    assert weights_dtype(None, lora=True, device="cpu", bf16=True) == torch.float32
    assert weights_dtype(None, lora=False, device="cuda", bf16=True) == torch.float32  # full fine-tuning
    assert weights_dtype("float16", lora=True, device="cuda", bf16=True) == torch.float16  # asked for: as asked
    assert weights_dtype("auto") == "auto"


def test_a_full_fine_tuning_reference_is_bf16_on_a_bf16_gpu_and_the_policys_dtype_elsewhere():
    assert reference_dtype(None, torch.float32, device="cuda", bf16=True) == torch.bfloat16
    assert reference_dtype(None, torch.float32, device="cuda", bf16=False) == torch.float32  # T4, V100
    assert reference_dtype(None, torch.float32, device="cpu", bf16=True) == torch.float32  # the KL starts at 0
    assert reference_dtype("float32", torch.float32, device="cuda", bf16=True) == torch.float32  # asked for
    assert reference_dtype("bfloat16", torch.bfloat16, device="cpu") == torch.bfloat16
    assert reference_dtype("auto", torch.bfloat16, device="cuda", bf16=True) == torch.bfloat16  # the checkpoint's


def test_the_recipe_estimate_counts_a_bf16_reference():
    from lib.config import parse_config
    from lib.sharding.memory import recipe_memory

    recipe = Path(__file__).resolve().parents[1] / "scripts/recipes/grpo_gsm8k_qwen05b.yaml"
    sizes = {}
    for dtype in (None, "float32"):
        argv = ["--config", str(recipe)] + (["--dtype", dtype] if dtype else [])
        cfg = parse_config(argv)
        parts, _ = recipe_memory(cfg, gpu_bytes=80 * 2**30)
        sizes[dtype] = (parts["policy weights"], parts["reference model"])
    weights, reference = sizes[None]
    assert weights == 2 * reference  # fp32 master weights, a bf16 reference of the same parameters
    assert sizes["float32"] == (weights, weights)


@pytest.mark.parametrize("four_bit", [False, True])
def test_a_bf16_base_trains_an_fp32_adapter(tiny_model, tokenizer, four_bit):
    policy = load_policy(tiny_model, dtype=torch.bfloat16, use_peft=True, load_in_4bit=four_bit)
    trainable = {n: p for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n and p.dtype == torch.float32 for n, p in trainable.items())
    frozen = [p for n, p in policy.named_parameters() if not p.requires_grad and p.is_floating_point()]
    assert frozen and all(p.dtype in (torch.bfloat16, torch.float32) for p in frozen)
    if four_bit:  # the 4-bit layers compute in bf16; norms stay fp32 (prepare_model_for_kbit_training)
        assert {m.compute_dtype for m in policy.modules() if hasattr(m, "compute_dtype")} == {torch.bfloat16}
    else:  # every linear and embedding weight of the base is bf16
        assert all(p.dtype == torch.bfloat16 for n, p in policy.named_parameters() if "base_layer" in n)
    optimizer = build_optimizer(list(trainable.values()), "adamw_torch", 1e-3, (0.9, 0.99), 0.0)
    prompts = tokenizer(["What is 2 + 3?"], return_tensors="pt")
    completion = torch.randint(100, 2000, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, _ = completion_logps(policy, prompts.input_ids, prompts.attention_mask, torch.tensor([0, 0]),
                                   completion, torch.ones_like(completion), torch.ones(2), with_entropy=False)
    (-logp.mean()).backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in trainable.values())
    assert any(p.grad.abs().sum() > 0 for p in trainable.values())
    optimizer.step()
    states = [s for s in optimizer.state.values()]
    assert states and all(s["exp_avg"].dtype == torch.float32 for s in states)
