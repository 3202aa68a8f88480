"""The memory guard's estimate against a measured training step and on the real embedded model, the advice it
gives, and the 8-bit optimizer."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from lib.sharding.memory import (GB, check_step_memory, estimate_step_memory, memory_budget,
                               step_token_counts)
from lib.setup import build_optimizer

BASE = dict(resident=0, optim="adamw_torch", sampling_tokens=8 * 192, gradient_checkpointing=False, bf16=True)


@pytest.fixture(scope="module")
def model(embedded_model):
    return AutoModelForCausalLM.from_pretrained(embedded_model)


# A real training step in a fresh process, its peak resident set against the estimate. The process runs with glibc's
# mmap threshold fixed at 64 KiB, so every tensor over that is mapped when allocated and unmapped when freed and the
# resident set follows the live tensors (with the default threshold freed heap memory stays resident and is reused:
# tried here, the forward's peak then read half the live tensors and AdamW's states 1.5x). "5" written to
# /proc/self/clear_refs restarts the high-water mark (VmHWM) at the current resident set, so one process measures
# each stage. The model is a small Llama with random weights (hidden 256, MLP 768, 6 blocks, 4 query / 2 key-value
# heads, 8192-token vocabulary, untied head): gradients, AdamW states, activations and logits are each tens of MB
# while a step stays a few GFLOPs. The step runs in fp32, as the trainer's on a CPU without native bf16, and is
# estimated with bf16=False.
STEP_SCRIPT = r"""
import gc
import json
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lib.config import make_config
from lib.methods.losses import token_logps_and_entropy
from lib.sharding.memory import estimate_step_memory, resident_bytes, step_token_counts
from lib.models.modeling import completion_logps, default_attn_implementation
from lib.setup import build_optimizer

model_config, micro_batches = json.loads(sys.argv[1])


def resident():
    gc.collect()
    return resident_bytes(torch.device("cpu"))


def restart_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


torch.manual_seed(0)
config = LlamaConfig(**model_config, attn_implementation=default_attn_implementation("cpu"))
model = LlamaForCausalLM(config).train()
optimizer = build_optimizer(list(model.parameters()), "adamw_torch", 1e-5, (0.9, 0.99), 0.0)
vocab = config.vocab_size


def step(prompt_index, prompt_length, length, marks):
    # as train_agrpo.py's micro-batch: each distinct prompt runs once and its completions continue on its keys and
    # values, entropies computed (detached), a surrogate's backward, one AdamW step
    prompts, completions = max(prompt_index) + 1, len(prompt_index)
    logp, entropy = completion_logps(
        model, torch.randint(vocab, (prompts, prompt_length)), torch.ones(prompts, prompt_length, dtype=torch.long),
        torch.tensor(prompt_index), torch.randint(vocab, (completions, length)),
        torch.ones(completions, length, dtype=torch.long), torch.ones(completions))
    marks["forward"] = peak()
    (-(logp * torch.randn(completions, 1)).mean()).backward()
    del logp, entropy
    marks["gradients"] = resident()
    optimizer.step()
    optimizer.zero_grad()
    marks["states"] = resident()
    marks["peak"] = peak()


loaded = resident()  # what train_agrpo.py passes as `resident`: model and optimizer built, no step run yet
restart_peak()
# a one-token forward and backward first: what the first pass allocates for good (thread pools, kernel workspaces)
# is then kept apart from the gradients and states measured next
one = torch.ones(1, 1, dtype=torch.long)
logp, _ = completion_logps(model, one, one, torch.zeros(1, dtype=torch.long), one, one, torch.ones(1))
logp.sum().backward()
del logp, _
optimizer.zero_grad()
primed = resident()
first = {}
step([0], 1, 1, first)  # a one-token step: its gradients, then AdamW's states, which every later step keeps
out = {"first_pass": primed - loaded, "gradients": first["gradients"] - primed, "states": first["states"] - primed,
       "steps": []}
run_peak = first["peak"]
for values in micro_batches:
    cfg = make_config(values)
    counts = step_token_counts(cfg)
    estimate = estimate_step_memory(model, resident=loaded, optim=cfg.optim, bf16=False, vllm=False,
                                    gradient_checkpointing=cfg.gradient_checkpointing, **counts)
    # the micro-batch that straddles two groups (rows B..2B-1 of the batch): two prompts, as step_token_counts counts
    size, group = cfg.per_device_train_batch_size, cfg.num_generations
    prompt_index = [row // group - size // group for row in range(size, 2 * size)]
    base = resident()
    restart_peak()
    marks = {}
    step(prompt_index, cfg.max_prompt_length, cfg.max_completion_length, marks)
    run_peak = max(run_peak, marks["peak"])
    out["steps"].append({
        "tokens": size * cfg.max_completion_length + (max(prompt_index) + 1) * cfg.max_prompt_length,
        "estimated_tokens": counts["tokens_per_micro_batch"], "forward": marks["forward"] - base,
        "peak": run_peak - loaded, "estimate": {part: getattr(estimate, part) for part in
                                                ("gradients", "optimizer", "activations", "logits")},
        "estimate_total": estimate.total - loaded})
# one logits chunk alone, the part the step shares with the activations: the head over a micro-batch's completion
# positions with their entropies, and its backward
rows = 512
hidden = torch.randn(rows, config.hidden_size, requires_grad=True)
model.lm_head.weight.requires_grad_(False)  # its gradient is counted with the gradients
base = resident()
restart_peak()
logp, entropy = token_logps_and_entropy(hidden, model.lm_head, torch.randint(vocab, (rows,)), torch.ones(rows))
logp.sum().backward()
out["logits"] = {"peak": peak() - base, "estimate": estimate_step_memory(
    model, resident=0, optim="adamw_torch", tokens_per_micro_batch=rows, sampling_tokens=0,
    gradient_checkpointing=False, bf16=False).logits}
print(json.dumps(out))
"""

MEASURED_MODEL = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 6, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "vocab_size": 8192, "tie_word_embeddings": False}
# 4 completions a micro-batch from groups of 6: two prompts; then twice the prompt and completion lengths
MICRO_BATCHES = [{"per_device_train_batch_size": 4, "num_generations": 6, "max_prompt_length": n,
                  "max_completion_length": n, "optim": "adamw_torch", "gradient_checkpointing": False}
                 for n in (64, 128)]


@pytest.fixture(scope="module")
def measured_steps():
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", STEP_SCRIPT, json.dumps([MEASURED_MODEL, MICRO_BATCHES])], cwd=repo,
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # a real training step in a fresh process: 13 s
def test_estimate_against_a_measured_training_step(measured_steps):
    measured = measured_steps
    first = measured["steps"][0]["estimate"]
    # gradients and AdamW states are the parameters' bytes: measured 1.01x and 1.02x the estimate here
    assert measured["gradients"] == pytest.approx(first["gradients"], rel=0.1)
    assert measured["states"] == pytest.approx(first["optimizer"], rel=0.1)
    for step in measured["steps"]:
        assert step["tokens"] == step["estimated_tokens"]  # the straddling micro-batch is the one the guard counts
        estimate = step["estimate"]
        # Measured on this CPU (MiB; estimate / measured): the forward's peak over the step's start, activations and
        # one logits chunk, 92.4 -> 1.09 at 384 tokens and 190.1 -> 1.06 at 768; the step's peak over the loaded
        # model, the first step included (gradients, states and AdamW's temporaries), 172.8 -> 1.17 and 275.2 ->
        # 1.10. The estimate sits above because it counts prompt tokens as logit rows (256 of the 384 tokens are
        # completion positions). Band: the guard must not let through a step that does not fit (estimate at least
        # 0.9x the peak, a margin for other CPUs' kernel workspaces), nor refuse runs that fit by much (1.4x:
        # doubling the activations' share would give 1.6x to 1.7x, doubling the logits' about 1.6x).
        assert 0.9 < (estimate["activations"] + estimate["logits"]) / step["forward"] < 1.4
        assert 0.9 < step["estimate_total"] / step["peak"] < 1.4
    # one logits chunk (512 rows of 8192 fp32 logits, 16 MiB a buffer), forward and backward: measured 63.9 MiB, the
    # logits, their log-softmax and the entropy's p and p log p live at once; the estimate's four buffers are 1.00x
    # (three buffers, counting the softmax and its gradient only, were 0.75x)
    assert 0.9 < measured["logits"]["estimate"] / measured["logits"]["peak"] < 1.15
    one, two = measured["steps"]
    # twice the tokens: the estimated activations and logits double, the measured ones nearly (1.87x here)
    assert two["estimate"]["activations"] + two["estimate"]["logits"] == \
        2 * (one["estimate"]["activations"] + one["estimate"]["logits"])
    assert two["forward"] > 1.6 * one["forward"]
    assert two["estimate_total"] > one["estimate_total"] and two["peak"] > 1.3 * one["peak"]  # 1.55x here


# The 16 GB recipe's path, measured (docs/performance.md 3.5): a 4-bit base with LoRA (dropout 0.05) on every linear
# layer, gradient checkpointing, bf16 autocast, in a fresh process under the same mmap threshold as STEP_SCRIPT. The
# decoder's activations are read apart from the vocabulary chunks: the peak up to the end of the decoder's forward,
# and from the end of the chunks' backward (the decoder output's gradient) to the end of the backward, each over the
# step's start. Then one logits chunk alone through an fp32 output layer under autocast, whose bf16 copy is as large
# as the chunk's four fp32 buffers at these shapes (hidden 1024, 128 rows).
QLORA_SCRIPT = r"""
import gc
import json
import sys

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from lib.methods.losses import token_logps_and_entropy
from lib.sharding.memory import estimate_step_memory, resident_bytes
from lib.models.modeling import OutputHead, completion_logps, load_policy, unwrap_causal_lm


def resident():
    gc.collect()
    return resident_bytes(torch.device("cpu"))


def restart_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


folder = sys.argv[1]
torch.manual_seed(0)
config = Qwen2Config(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=8192, tie_word_embeddings=True, bos_token_id=None,
                     eos_token_id=2, pad_token_id=2)
Qwen2ForCausalLM(config).save_pretrained(folder)
policy = load_policy(folder, load_in_4bit=True, use_peft=True, lora_dropout=0.05, gradient_checkpointing=True)
policy.train()
decoder = unwrap_causal_lm(policy).get_decoder()
positions, marks = [], {}


def after_decoder(module, args, output):
    marks["forward"] = peak()
    output.last_hidden_state.register_hook(after_logits)


def after_logits(grad):
    restart_peak()


decoder.register_forward_pre_hook(lambda m, a, k: positions.append(k["input_ids"].numel()), with_kwargs=True)
decoder.register_forward_hook(after_decoder)
out = {"steps": []}
for prompt_length, length in ((8, 8), (64, 448), (128, 896)):  # the first only primes the kernels
    positions.clear()
    ones = torch.ones(1, prompt_length, dtype=torch.long)
    base = resident()
    restart_peak()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, _ = completion_logps(policy, torch.randint(8192, (1, prompt_length)), ones,
                                   torch.zeros(4, dtype=torch.long), torch.randint(8192, (4, length)),
                                   torch.ones(4, length, dtype=torch.long), torch.ones(4), share_prompt_prefix=False)
    (-(logp * torch.randn(4, 1)).mean()).backward()
    measured = max(marks["forward"], peak()) - base
    del logp, _
    policy.zero_grad(set_to_none=True)
    estimate = estimate_step_memory(policy, resident=0, optim="adamw_torch", tokens_per_micro_batch=sum(positions),
                                    sampling_tokens=0, gradient_checkpointing=True, bf16=True)
    out["steps"].append({"positions": sum(positions), "activations": measured, "estimate": estimate.activations})
# one logits chunk through an fp32 head under autocast: four fp32 buffers of its rows and the head's bf16 copy
from transformers import LlamaConfig, LlamaForCausalLM

lm = LlamaForCausalLM(LlamaConfig(hidden_size=1024, intermediate_size=256, num_hidden_layers=1,
                                  num_attention_heads=4, vocab_size=8192)).requires_grad_(False)
rows = 128
hidden = torch.randn(rows, 1024, requires_grad=True)
base = resident()
restart_peak()
with torch.autocast("cpu", dtype=torch.bfloat16):
    logp, entropy = token_logps_and_entropy(hidden, OutputHead(lm), torch.randint(8192, (rows,)), torch.ones(rows))
logp.sum().backward()
estimate = estimate_step_memory(lm, resident=0, optim="adamw_torch", tokens_per_micro_batch=rows, sampling_tokens=0,
                                gradient_checkpointing=False, bf16=True)
out["logits"] = {"peak": peak() - base, "estimate": estimate.logits, "buffers": 4 * rows * 8192 * 4}
print(json.dumps(out))
"""


@pytest.mark.slow  # a 4-bit model in a fresh process: about a minute on 2 busy cores
def test_qlora_activations_and_an_fp32_head_under_autocast_measured(tmp_path):
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", QLORA_SCRIPT, str(tmp_path / "model")], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = json.loads(proc.stdout.strip().splitlines()[-1])
    one, two = measured["steps"][1:]
    # the full sequences (prompt + completion, 512 and 1,024 per row), so that the positions double exactly; the
    # shared-prompt path under checkpointing is measured at real shapes by scripts/bench_memory.py
    # (docs/performance.md 3.5)
    assert two["positions"] == 2 * one["positions"] == 4 * 1024
    # measured here (MiB, estimate / measured): 78.0 -> 0.83 at 2,048 positions, 156.0 -> 0.91 at 4,096; what the
    # extra tokens added, 78.0 MiB, 1.02 (the rest, about 15 MiB, does not grow with tokens: kernel workspaces for
    # the new shapes). The accounting before (34 h + 8 i bytes a token for the recomputed block, as if its tensors
    # were bf16, and 4 h for each block input) gave 0.48 of the added bytes: a 4-bit layer returns the fp32 stream's
    # dtype, and each adapted layer keeps a bf16 copy of its input and a float dropout mask.
    added = (two["estimate"] - one["estimate"]) / (two["activations"] - one["activations"])
    assert 0.9 < added < 1.2, measured["steps"]
    assert 0.85 < two["estimate"] / two["activations"] < 1.3, two
    logits = measured["logits"]
    # 32.4 MiB measured: the four fp32 buffers (16.0 MiB) and the head's bf16 copy (16.0 MiB); estimate 0.99
    assert logits["buffers"] / logits["peak"] < 0.6
    assert 0.9 < logits["estimate"] / logits["peak"] < 1.2, logits


def _saved_bytes_per_token(model, bf16: bool) -> float:
    """What one decoder block saves for its backward, per token: the tensors autograd keeps
    (torch.autograd.graph.saved_tensors_hooks), each storage once, less the block input, the rotary tables and the
    weights, at 256 and 512 tokens; the difference, so that what does not grow with tokens drops out."""
    from lib.models.modeling import unwrap_causal_lm

    lm = unwrap_causal_lm(model)
    layer = lm.get_decoder().layers[0]
    layer.gradient_checkpointing = False  # the block's own set, as its recomputation keeps it
    dtype = lm.get_input_embeddings().weight.dtype
    sizes = []
    for tokens in (256, 512):
        x = torch.randn(1, tokens, lm.config.hidden_size, dtype=dtype, requires_grad=True)
        positions = torch.arange(tokens)[None]
        rotary = lm.get_decoder().rotary_emb(x, positions)
        seen = {}

        def pack(tensor):
            seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            layer(x, attention_mask=None, position_ids=positions, position_embeddings=rotary)
        known = {t.untyped_storage().data_ptr() for t in [x, *rotary, *model.parameters()]}
        sizes.append(sum(size for ptr, size in seen.items() if ptr not in known))
    return (sizes[1] - sizes[0]) / 256


@pytest.fixture(scope="module")
def one_block_model(tmp_path_factory) -> str:
    """A one-block Qwen2 with random weights (hidden 256, MLP 768, 4 query / 2 key-value heads), saved."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    folder = tmp_path_factory.mktemp("one_block")
    config = Qwen2Config(hidden_size=256, intermediate_size=768, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True, bos_token_id=None,
                         eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("options,bf16", [
    ({"load_in_4bit": True, "use_peft": True, "lora_dropout": 0.05}, True),  # the 16 GB recipe
    ({"load_in_4bit": True, "use_peft": True, "lora_dropout": 0.05, "dtype": torch.bfloat16}, True),
    ({"load_in_4bit": True, "use_peft": True}, False),
    ({"use_peft": True}, True),
    ({"use_peft": True, "lora_dropout": 0.05, "dtype": torch.bfloat16}, True),
    ({}, False),
    ({}, True),
], ids=["qlora-recipe", "qlora-bf16-compute", "qlora-fp32", "lora", "lora-bf16-base", "full-fp32", "full-autocast"])
def test_block_activations_against_what_autograd_saves(one_block_model, options, bf16):  # under a second each
    # the per-token accounting of one block (lib/sharding/memory.activation_bytes) against the bytes autograd keeps for that
    # block's backward. Here 0.99 to 1.12 of them in each setting (over with autocast: q, k and v are counted with a
    # bf16 copy of their input each). The accounting before counted 34 h + 8 i bytes (x 2 in fp32) whatever the
    # setting: 0.57 of the recipe's (a 4-bit layer returns the fp32 stream's dtype; LoRA keeps bf16 copies of its
    # inputs and float dropout masks) and 1.45 of full fine-tuning's in fp32.
    from lib.sharding.memory import activation_bytes
    from lib.models.modeling import load_policy

    policy = load_policy(one_block_model, **options).train()
    saved = _saved_bytes_per_token(policy, bf16)
    assert 0.97 < activation_bytes(policy, bf16=bf16)["block"] / saved < 1.15, saved


def test_estimate_options_move_the_parts_they_name(model):
    base = estimate_step_memory(model, tokens_per_micro_batch=1000, **BASE)
    n = sum(p.numel() for p in model.parameters())
    assert base.gradients == n * next(model.parameters()).element_size()  # every parameter trains, in its dtype
    fp32 = estimate_step_memory(model, tokens_per_micro_batch=1000, **{**BASE, "bf16": False})
    assert fp32.activations > base.activations and fp32.kv_cache > base.kv_cache
    assert (fp32.gradients, fp32.optimizer) == (base.gradients, base.optimizer)  # master weights are fp32 anyway
    # gradient checkpointing keeps the 30 blocks' inputs and one block's full set: a fraction of the activations
    ckpt = estimate_step_memory(model, tokens_per_micro_batch=1000, **{**BASE, "gradient_checkpointing": True})
    assert ckpt.activations < base.activations / 5
    assert (ckpt.gradients, ckpt.optimizer, ckpt.logits) == (base.gradients, base.optimizer, base.logits)
    eight = estimate_step_memory(model, tokens_per_micro_batch=1000, **{**BASE, "optim": "paged_adamw_8bit"})
    assert eight.optimizer < base.optimizer / 2 and eight.activations == base.activations
    vllm = estimate_step_memory(model, tokens_per_micro_batch=1000, **BASE, vllm=True)
    assert vllm.kv_cache == 0 < base.kv_cache  # inside the engine's reservation, which is measured as resident
    assert vllm.total <= base.total


def test_lora_estimate_counts_adapter_states_only(embedded_model):
    base = AutoModelForCausalLM.from_pretrained(embedded_model)
    full = estimate_step_memory(base, tokens_per_micro_batch=1000, **BASE)
    lora = get_peft_model(base, LoraConfig(r=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    adapter = estimate_step_memory(lora, tokens_per_micro_batch=1000, **BASE)
    trainable = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert adapter.gradients == 4 * trainable < full.gradients / 10
    # the backward still runs through every block; the adapted layers keep their own bf16 copies of their inputs
    # (for lora_A's gradient) instead of full fine-tuning's weight-gradient inputs
    assert full.activations / 2 < adapter.activations < full.activations
    config = base.config
    adapted_inputs = 6 * config.hidden_size + config.intermediate_size  # q, k, v, o, gate, up, down
    dropped = get_peft_model(AutoModelForCausalLM.from_pretrained(embedded_model),
                             LoraConfig(r=16, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM"))
    with_dropout = estimate_step_memory(dropped, tokens_per_micro_batch=1000, **BASE)
    # LoRA dropout keeps a mask of each adapted layer's input, float (4 bytes) on a CPU
    assert with_dropout.activations - adapter.activations == 1000 * config.num_hidden_layers * adapted_inputs * 4
    on_gpu = estimate_step_memory(dropped, tokens_per_micro_batch=1000, **BASE, device_type="cuda")
    assert with_dropout.activations - on_gpu.activations == 1000 * config.num_hidden_layers * adapted_inputs * 3


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
    # two processes of one machine (LOCAL_WORLD_SIZE 2) share the RAM available: each gets half of it
    shared, source = memory_budget(torch.device("cpu"), None, 2)
    assert "1/2 of the RAM available" in source and shared < budget - 0.25 * GB


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


def test_activation_offloading_moves_the_checkpointed_block_inputs(tmp_path):
    """What activation_offloading moves to host memory (lib/sharding/memory.offloaded_activations: torch's save_on_cpu,
    so every tensor autograd saves in the training forward) against the estimate's `offloaded`: under non-reentrant
    gradient checkpointing the blocks' inputs are saved through the same hooks (so they do move), and only they,
    the last norm's and the logits chunks' inputs are. On a CPU save_on_cpu moves nothing, so the bytes it would
    move are counted with the same hooks; the scores and gradients under save_on_cpu are checked against none."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lib.models import checkpointed_prefix
    from lib.models.modeling import CompletionScorer, load_policy

    config = Qwen2Config(hidden_size=128, intermediate_size=384, num_hidden_layers=6, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True, bos_token_id=None,
                         eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    generator = torch.Generator().manual_seed(1)
    prompts, mask = torch.randint(3, 512, (1, 32), generator=generator), torch.ones(1, 32, dtype=torch.long)
    completions = torch.randint(3, 512, (8, 96), generator=generator)
    args = (prompts, mask, torch.zeros(8, dtype=torch.long), completions, torch.ones_like(completions),
            torch.ones(8))

    def saved_bytes(checkpointing: bool) -> tuple[int, torch.Tensor]:
        policy = load_policy(str(tmp_path), gradient_checkpointing=checkpointing)
        policy.train()
        scorer, seen = CompletionScorer(policy, checkpointed_prefix=checkpointed_prefix), {}  # as the trainer's
        weights = {p.untyped_storage().data_ptr() for p in policy.parameters()}  # (a tied head's transpose too)

        def pack(tensor):
            if tensor.untyped_storage().data_ptr() not in weights:
                seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            logp, _ = scorer(*args, with_entropy=False)
        logp.sum().backward()
        grad = policy.model.layers[0].self_attn.k_proj.weight.grad.clone()
        with torch.autograd.graph.save_on_cpu():  # the real context runs (moves nothing on a CPU)
            logp_offloaded, _ = scorer(*args, with_entropy=False)
        policy.zero_grad()
        logp_offloaded.sum().backward()
        torch.testing.assert_close(logp_offloaded, logp)
        torch.testing.assert_close(policy.model.layers[0].self_attn.k_proj.weight.grad, grad)
        return sum(seen.values()), policy

    plain, _ = saved_bytes(False)
    checkpointed, policy = saved_bytes(True)
    tokens = 8 * 96 + 32  # completions and their one shared prompt (lib/sharding/memory.step_token_counts)
    options = dict(BASE, bf16=False, sampling_tokens=0, tokens_per_micro_batch=tokens)
    estimate = estimate_step_memory(policy, **{**options, "gradient_checkpointing": True},
                                    activation_offloading=True, device_type="cuda")
    block_inputs = tokens * config.num_hidden_layers * config.hidden_size * 4  # fp32 here
    assert estimate.offloaded == block_inputs and estimate.kept == 0
    # measured: the block inputs (2.43 MB), plus the last norm's input and output and the logits chunk's saved
    # tensors (2.75 MB), which the estimate leaves in its device-side activations and logits chunk; a checkpoint
    # that kept its inputs out of the hooks would show under half of the block inputs
    assert 0.95 * block_inputs <= checkpointed <= 1.5 * block_inputs + estimate.logits
    assert checkpointed < plain / 4  # the blocks' own sets are recomputed, not saved (and not moved)
    without = estimate_step_memory(policy, **{**options, "gradient_checkpointing": True}, device_type="cuda")
    assert without.total - estimate.total == block_inputs and without.offloaded == 0


def test_the_max_memory_cap_leaves_the_context_outside_the_allocators_share():
    """lib/sharding/memory.allocator_fraction: on a 141 GB card with 0.5 GB outside the allocator (the CUDA context),
    16 GB in all gives the allocator (16 - 0.5) / 141 of the card; a cap that does not cover the context, or one
    above the card, is refused naming max_memory. vLLM's share scales to the cap (vllm_rollout.engine_share)."""
    from lib.sharding.memory import GB, allocator_fraction, out_of_memory_message
    from lib.sampling.vllm_rollout import engine_share

    assert allocator_fraction(16 * GB, 141 * GB, GB // 2) == pytest.approx(15.5 / 141)
    assert allocator_fraction(16 * GB, 16 * GB, 0) == 1.0
    with pytest.raises(ValueError, match="max_memory .* does not cover"):
        allocator_fraction(GB // 4, 141 * GB, GB // 2)
    with pytest.raises(ValueError, match="max_memory .* above this GPU"):
        allocator_fraction(200 * GB, 141 * GB, GB // 2)
    assert engine_share(0.35, 16, 141 * GB) * 141 == pytest.approx(0.35 * 16)
    assert engine_share(0.35, None, 141 * GB) == engine_share(0.35, 16, None) == 0.35
    message = out_of_memory_message(16, RuntimeError("CUDA out of memory"))
    assert "max_memory 16 GB" in message and "per_device_train_batch_size" in message
