"""The memory guard's estimate on the real embedded model, the advice it gives, and the 8-bit optimizer."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from lib.memory import (GB, build_optimizer, check_step_memory, estimate_step_memory, memory_budget,
                        step_token_counts)

BASE = dict(resident=0, optim="adamw_torch", sampling_tokens=8 * 192, gradient_checkpointing=False, bf16=True)


@pytest.fixture(scope="module")
def model(embedded_model):
    return AutoModelForCausalLM.from_pretrained(embedded_model)


def test_estimate_parts_scale_with_the_step(model):
    n = sum(p.numel() for p in model.parameters())
    one = estimate_step_memory(model, tokens_per_micro_batch=1000, **BASE)
    two = estimate_step_memory(model, tokens_per_micro_batch=2000, **BASE)
    assert two.activations == 2 * one.activations
    assert one.gradients == 4 * n and one.optimizer == 8 * n  # fp32 gradients, two fp32 AdamW moments
    # SmolLM2-135M: hidden 576, MLP 1536, 30 blocks: (34 h + 8 i) bytes a token a block under bf16
    assert one.activations == 1000 * (34 * 576 + 8 * 1536) * 30
    # KV cache: 2 x 30 blocks x 3 kv heads x 64 x 1536 tokens x 2 bytes
    assert one.kv_cache == 2 * 30 * 3 * 64 * 8 * 192 * 2
    fp32 = estimate_step_memory(model, tokens_per_micro_batch=1000, **{**BASE, "bf16": False})
    assert fp32.activations == 2 * one.activations
    ckpt = estimate_step_memory(model, tokens_per_micro_batch=1000, **{**BASE, "gradient_checkpointing": True})
    assert ckpt.activations < one.activations / 5
    eight = estimate_step_memory(model, tokens_per_micro_batch=1000, **{**BASE, "optim": "paged_adamw_8bit"})
    assert eight.optimizer == one.optimizer // 4
    vllm = estimate_step_memory(model, tokens_per_micro_batch=1000, **BASE, vllm=True)
    assert vllm.kv_cache == 0  # inside the engine's reservation, which is measured as resident


def test_lora_estimate_counts_adapter_states_only(embedded_model):
    base = AutoModelForCausalLM.from_pretrained(embedded_model)
    full = estimate_step_memory(base, tokens_per_micro_batch=1000, **BASE)
    lora = get_peft_model(base, LoraConfig(r=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    adapter = estimate_step_memory(lora, tokens_per_micro_batch=1000, **BASE)
    trainable = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert adapter.gradients == 4 * trainable < full.gradients / 10
    assert adapter.activations == full.activations  # the backward still runs through every block


def test_guard_names_the_setting_to_lower(model):
    activations_heavy = estimate_step_memory(model, tokens_per_micro_batch=100_000, **BASE)
    with pytest.raises(MemoryError) as error:
        check_step_memory(activations_heavy, 4 * GB, "max_memory", use_peft=False, gradient_checkpointing=False,
                          optim="adamw_torch")
    message = str(error.value)
    assert "per_device_train_batch_size" in message and "gradient_checkpointing true" in message
    assert "max_memory is 4.0 GB" in message
    states_heavy = estimate_step_memory(model, tokens_per_micro_batch=10, **BASE)
    with pytest.raises(MemoryError) as error:
        check_step_memory(states_heavy, int(0.5 * GB), "max_memory", use_peft=False, gradient_checkpointing=True,
                          optim="adamw_torch")
    message = str(error.value)
    assert "per_device_train_batch_size" not in message and "use_peft true" in message
    assert "paged_adamw_8bit" in message
    check_step_memory(states_heavy, 64 * GB, "max_memory", use_peft=False, gradient_checkpointing=False,
                      optim="adamw_torch")  # fits: no error


def test_budget_on_cpu_is_this_process_plus_available_ram():
    budget, source = memory_budget(torch.device("cpu"), None)
    assert 1 * GB < budget < 4096 * GB and "RAM" in source
    assert memory_budget(torch.device("cpu"), 3.5) == (int(3.5 * GB), "max_memory")


def test_adamw_8bit_steps_like_adamw(embedded_model):
    # bitsandbytes' 8-bit AdamW on this CPU: one step on a real layer moves the weights like torch's AdamW
    layer_a = AutoModelForCausalLM.from_pretrained(embedded_model).model.layers[0].mlp.up_proj
    layer_b = torch.nn.Linear(layer_a.in_features, layer_a.out_features, bias=False)
    layer_b.weight.data.copy_(layer_a.weight.data)
    start = layer_a.weight.detach().clone()
    x = torch.randn(16, layer_a.in_features, generator=torch.Generator().manual_seed(0))
    for layer, name in ((layer_a, "adamw_8bit"), (layer_b, "adamw_torch")):
        optimizer = build_optimizer(layer.parameters(), name, 1e-3, (0.9, 0.999), 0.0)
        layer(x).pow(2).mean().backward()
        optimizer.step()
    moved_8bit, moved_torch = layer_a.weight.detach() - start, layer_b.weight.detach() - start
    assert moved_8bit.abs().max() > 0
    cosine = torch.nn.functional.cosine_similarity(moved_8bit.flatten(), moved_torch.flatten(), dim=0)
    assert cosine > 0.99


def test_step_token_counts_of_a_configuration():
    from lib.config import make_config

    cfg = make_config({"per_device_train_batch_size": 16, "num_generations": 8, "max_completion_length": 64,
                       "max_prompt_length": 256, "gradient_accumulation_steps": 2})
    # 16 completions x 64 + 3 prompts (2 whole groups, one more when a micro-batch straddles a group) x 256
    assert step_token_counts(cfg) == {"tokens_per_micro_batch": 16 * 64 + 3 * 256,
                                      "sampling_tokens": 32 * (256 + 64)}
