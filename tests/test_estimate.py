"""--estimate_memory_only: a configuration's per-GPU memory from the model's configuration, without its weights."""

import subprocess
import sys

import pytest
import torch

from conftest import REPO
from lib.config import load_yaml, make_config
from lib.extras.memory import GB, model_config, recipe_memory
from lib.modeling import load_policy


def _tensor_bytes(model: torch.nn.Module) -> int:
    """What a loaded model holds: every parameter and persistent buffer once (a tied output layer is the embedding),
    a 4-bit weight's quantisation statistics included."""
    seen, total = set(), 0
    for tensor in model.state_dict().values():
        if isinstance(tensor, torch.Tensor) and tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


@pytest.mark.parametrize("options", [{}, {"use_peft": True}, {"use_peft": True, "load_in_4bit": True},
                                     {"use_peft": True, "load_in_4bit": True, "use_bnb_nested_quant": True}],
                         ids=["full", "lora", "qlora", "qlora-nested"])
def test_the_meta_device_count_equals_the_loaded_models_bytes(tiny_model, options):
    cfg = make_config({"model_name_or_path": tiny_model, "beta": 0.0, "use_vllm": False, **options})
    parts, _ = recipe_memory(cfg, gpu_bytes=None, bf16=False)
    policy = load_policy(tiny_model, use_peft=cfg.use_peft, load_in_4bit=cfg.load_in_4bit,
                         use_bnb_nested_quant=cfg.use_bnb_nested_quant)
    measured = _tensor_bytes(policy)
    assert abs(parts["policy weights"] - measured) <= 0.02 * measured, (parts, measured)


def test_a_recipe_is_estimated_without_its_weights_and_without_the_hub():
    # the hub is out of reach here: the published shape of the recipe's model is used
    assert model_config("Qwen/Qwen2.5-1.5B-Instruct").num_hidden_layers == 28
    proc = subprocess.run([sys.executable, str(REPO / "train_agrpo.py"), "--config",
                           str(REPO / "scripts" / "recipes" / "grpo_gsm8k_qlora_16gb.yaml"), "--estimate_memory_only",
                           "--max_memory", "16", "--use_vllm", "false"], capture_output=True, text=True, timeout=300,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "policy weights" in proc.stdout and "fits in 16.0 GB" in proc.stdout and "estimate" in proc.stdout
    cfg = make_config({"model_name_or_path": "Qwen/Qwen2.5-7B-Instruct", "max_completion_length": 1024})
    parts, step = recipe_memory(cfg, gpu_bytes=80 * GB)
    # full fine-tuning of 7.6B parameters in fp32 with AdamW: 16 bytes a parameter before activations
    assert 7.0e9 * 16 < step.resident + step.gradients + step.optimizer < 8.5e9 * 24
    # activation_offloading at the 16 GB recipe's shape with 4,096-token completions: the checkpointed blocks' inputs
    # (8 x 4,096 + 2 x 256 tokens x 28 layers x 1,536 x 2 bytes: the bf16 stream, a 4-bit base's embedding not
    # upcast) leave the GPU's total
    recipe = load_yaml(str(REPO / "scripts" / "recipes" / "grpo_gsm8k_qlora_16gb.yaml"))
    long = {**recipe, "max_completion_length": 4096, "use_vllm": False}
    _, kept = recipe_memory(make_config(long), gpu_bytes=16 * GB)
    _, moved = recipe_memory(make_config({**long, "activation_offloading": True}), gpu_bytes=16 * GB)
    assert moved.offloaded == (8 * 4096 + 2 * 256) * 28 * 1536 * 2 == kept.total - moved.total
    with pytest.raises(ValueError, match="local model folder"):
        model_config("no-such-org/no-such-model-xyz")


SHAPES_16GB = ["Qwen/Qwen2.5-1.5B-Instruct", "Qwen/Qwen2.5-3B-Instruct", "Qwen/Qwen2.5-7B-Instruct",
               "meta-llama/Llama-3.1-8B-Instruct"]


@pytest.mark.parametrize("recipe", sorted((REPO / "scripts" / "recipes").glob("*16gb*.yaml")), ids=lambda p: p.stem)
def test_each_16gb_recipe_is_estimated_at_each_shape_and_its_parts_add_up(recipe, capsys):
    """--estimate_memory_only for each 16 GB recipe at the Qwen2.5-1.5B, 3B, 7B and Llama-3.1-8B shapes, with its
    vLLM engine and with the HF sampler: the table is printed, its peak is the parts' sum (what is resident, the
    gradients and states, then the larger of sampling's KV cache and training's activations and logits chunk), and
    the HF sampler holds the merged copy only where it fits (lib/extras/sampling_copy.sampler_plan): at 1.5B and 3B
    under 16 GB (2.9 and 5.8 GB of bf16 copy), not under 5 GB, never at 7B or 8B (15 and 16 GB), where the QLoRA
    recipe then fits 15 GB."""
    from lib.extras.memory import estimate_only

    for model in SHAPES_16GB:
        for use_vllm, budget in ((True, 16), (False, 16), (False, 5)):
            cfg = make_config({**load_yaml(str(recipe)), "model_name_or_path": model, "use_vllm": use_vllm,
                               "max_memory": budget, "estimate_memory_only": True})
            printed = estimate_only(cfg)["estimated_peak_bytes"]
            table = capsys.readouterr().out
            parts, step = recipe_memory(cfg, gpu_bytes=budget * GB)
            assert printed == step.total
            assert step.total == sum(parts.values()) + step.gradients + step.optimizer + max(step.kv_cache,
                                                                                             step.training)
            assert step.resident == sum(parts.values())
            rows = {line[:62].strip(): float(line[62:]) for line in table.splitlines()[1:]
                    if line[62:].strip().replace(".", "").isdigit()}
            assert rows["peak (sampling and training do not overlap)"] == round(step.total / GB, 2), table
            for name, value in parts.items():
                assert rows[name] == round(value / GB, 2), (name, table)
            copy = "sampler's bf16 copy" in parts
            direct = any(name.startswith("sampler without a copy") for name in parts)
            if use_vllm:
                assert not copy and not direct
                continue
            assert copy != direct
            assert copy == (budget == 16 and ("1.5B" in model or "3B" in model)), (model, budget, table)
            if copy:
                assert step.total <= budget * GB
            if "qlora" in recipe.name and budget == 16:
                assert step.total <= 15 * GB, (model, table)


def test_the_sharded_estimate_divides_the_policy_reference_gradients_and_states_and_adds_the_gathered_units(
        tiny_model):
    """--estimate_processes N (docs/distributed.md 4), counted on the tiny model's real parameters: the fp32
    shard, 1/N of the reference, gradients and AdamW states, and the root unit plus two decoder layers gathered in
    bf16; the sampler, activations and logits as on one GPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    numel = sum(p.numel() for p in model.parameters())  # the tied output layer once
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    root = numel - sum(p.numel() for p in model.model.layers.parameters())
    base = {"model_name_or_path": tiny_model, "beta": 0.04, "use_vllm": False, "bf16": True}
    one_parts, one = recipe_memory(make_config(base), gpu_bytes=None)
    parts, four = recipe_memory(make_config({**base, "estimate_processes": 4}), gpu_bytes=None)
    assert parts["policy weights (FSDP2: its fp32 shard)"] == numel * 4 // 4
    assert parts["reference model (FSDP2: its shard)"] == one_parts["reference model"] // 4
    assert parts["gathered for compute (FSDP2: root unit + 2 decoder layers)"] == (root + 2 * layer) * 2
    assert parts["sampler's bf16 copy"] == one_parts["sampler's bf16 copy"]
    assert four.gradients == numel * 4 // 4 and four.optimizer == numel * 8 // 4
    assert (four.activations, four.logits, four.kv_cache) == (one.activations, one.logits, one.kv_cache)
    from lib.config import ConfigError

    with pytest.raises(ConfigError, match="estimate_processes: FSDP2 and DeepSpeed shard full fine-tuning"):
        make_config({**base, "estimate_processes": 2, "use_peft": True})
    with pytest.raises(ConfigError, match="estimate_sharding: 'zero1' is not one of fsdp2, zero2, zero3"):
        make_config({**base, "estimate_processes": 2, "estimate_sharding": "zero1"})

    # DeepSpeed: ZeRO-3 as FSDP2 with a bf16 partition and its fp32 master copy, and the gradient bucket; ZeRO-2 with
    # the whole bf16 weights and reference on every GPU, the fp32 master partitioned
    parts3, three = recipe_memory(make_config({**base, "estimate_processes": 4, "estimate_sharding": "zero3"}),
                                  gpu_bytes=None)
    assert parts3["policy weights (ZeRO-3: its partition, + fp32 master)"] == numel * 6 // 4
    assert parts3["reference model (ZeRO-3: its shard)"] == one_parts["reference model"] // 4
    assert parts3["DeepSpeed's gradient bucket (reduce_bucket_size 5e8)"] == int(5e8) * 2
    parts2, two = recipe_memory(make_config({**base, "estimate_processes": 4, "estimate_sharding": "zero2"}),
                                gpu_bytes=None)
    assert parts2["policy weights (ZeRO-2: whole, compute dtype)"] == numel * 2
    assert parts2["fp32 master weights (ZeRO-2: its partition)"] == numel * 4 // 4
    assert parts2["reference model"] == one_parts["reference model"]
    assert (two.gradients, two.optimizer) == (three.gradients, three.optimizer) == (four.gradients, four.optimizer)
    # a generation server samples on GPUs of its own: no engine, no sampler's copy on a training GPU
    served, _ = recipe_memory(make_config({**base, "use_vllm": True, "vllm_mode": "server", "estimate_processes": 4,
                                           "estimate_sharding": "zero3"}), gpu_bytes=None)
    assert not [k for k in served if k.startswith(("vLLM", "sampler"))]
    assert served["policy weights (ZeRO-3: its partition, + fp32 master)"] == numel * 6 // 4
