"""--estimate_memory_only: a configuration's per-GPU memory from the model's configuration, without its weights."""

import subprocess
import sys

import pytest
import torch

from conftest import REPO
from lib.config import load_yaml, make_config
from lib.sharding.memory import GB, model_config, recipe_memory
from lib.models.modeling import load_policy


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


def test_a_recipe_is_estimated_without_its_weights_and_without_the_hub(meta_models_once):
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


@pytest.fixture
def meta_models_once(monkeypatch):
    """recipe_model, each meta-device model built once for the test: a test that estimates one shape under several
    budgets and samplers (and through both estimate_only and recipe_memory) builds the same model each time, 1 s
    with its LoRA adapter at 7B; what the estimate counts from it is unchanged."""
    from lib.sharding import memory

    built, build = {}, memory.recipe_model

    def once(cfg, bf16=True):
        # every setting recipe_model reads
        key = (cfg.model_name_or_path, cfg.model_revision, cfg.trust_remote_code, cfg.dtype, bool(cfg.use_peft),
               cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, str(cfg.lora_target_modules), bf16)
        if key not in built:
            built[key] = build(cfg, bf16)
        return built[key]

    monkeypatch.setattr(memory, "recipe_model", once)


SHAPES_16GB = ["Qwen/Qwen2.5-1.5B-Instruct", "Qwen/Qwen2.5-3B-Instruct", "Qwen/Qwen2.5-7B-Instruct",
               "meta-llama/Llama-3.1-8B-Instruct"]


@pytest.mark.parametrize("recipe", sorted((REPO / "scripts" / "recipes").glob("*16gb*.yaml")), ids=lambda p: p.stem)
def test_each_16gb_recipe_is_estimated_at_each_shape_and_its_parts_add_up(recipe, capsys, meta_models_once):
    """--estimate_memory_only for each 16 GB recipe at the Qwen2.5-1.5B, 3B, 7B and Llama-3.1-8B shapes, with its
    vLLM engine and with the HF sampler: the table is printed, its peak is the parts' sum (what is resident, the
    gradients and states, then the larger of sampling's KV cache and training's activations and logits chunk), and
    the HF sampler holds the merged copy only where it fits (lib/sharding/memory.sampler_plan): at 1.5B and 3B
    under 16 GB (2.9 and 5.8 GB of bf16 copy), not under 5 GB, never at 7B or 8B (15 and 16 GB), where the QLoRA
    recipe then fits 15 GB."""
    from lib.sharding.memory import estimate_only

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
    with pytest.raises(ConfigError, match="estimate_sharding: 'zero1' is not one of fsdp2, zero2, zero3, ddp"):
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


# ---- the run-time guard, per process and per shard, and its agreement with --estimate_memory_only

def test_the_guard_counts_one_process_of_each_sharding(tiny_model):
    """The guard's figure from what a process holds before the policy is sharded (`guard_memory`), on the tiny
    model's real fp32 parameters: data parallel keeps everything whole at any process count; FSDP2 and ZeRO-3
    replace the whole weights by 1/N of them (plus what is gathered, and ZeRO-3's bucket) and divide the fp32
    gradients and AdamW states; ZeRO-2 divides the gradients and states, keeps whole compute-dtype weights. A
    budget between the sharded and the unsharded peak refuses the one and passes the other."""
    from transformers import AutoModelForCausalLM

    from lib.sharding.memory import DEEPSPEED_BUCKET, MEASURED_PART, check_step_memory, guard_memory

    policy = AutoModelForCausalLM.from_pretrained(tiny_model)
    numel = sum(p.numel() for p in policy.parameters())
    layer = sum(p.numel() for p in policy.model.layers[0].parameters())
    root = numel - sum(p.numel() for p in policy.model.layers.parameters())
    cfg = make_config({"model_name_or_path": tiny_model, "use_vllm": False, "bf16": True})
    resident = 3 * GB  # what the process measured: the whole policy, its sampler, the context...
    rest = resident - numel * 4

    def guard(processes, sharding):
        return guard_memory(cfg, policy, resident=resident, processes=processes, sharding=sharding, bf16=True)

    one_parts, one = guard(1, "fsdp2")  # one process shards nothing, whatever the launch config says
    assert one_parts == {"policy weights": numel * 4, MEASURED_PART: rest}
    assert (one.resident, one.gradients, one.optimizer) == (resident, numel * 4, numel * 8)
    for processes in (2, 8):
        assert guard(processes, "ddp")[1] == one
        parts, fsdp2 = guard(processes, "fsdp2")
        assert parts == {"policy weights (FSDP2: its fp32 shard)": numel * 4 // processes,
                         "gathered for compute (FSDP2: root unit + 2 decoder layers)": (root + 2 * layer) * 2,
                         MEASURED_PART: rest}
        assert (fsdp2.gradients, fsdp2.optimizer) == (numel * 4 // processes, numel * 8 // processes)
        assert (fsdp2.activations, fsdp2.logits) == (one.activations, one.logits)
        parts, zero3 = guard(processes, "zero3")
        assert zero3.resident == (numel * 6 // processes + (root + 2 * layer) * 2 + rest
                                  + DEEPSPEED_BUCKET * 2)
        parts, zero2 = guard(processes, "zero2")
        assert zero2.resident == numel * 2 + numel * 4 // processes + rest + DEEPSPEED_BUCKET * 2
        assert (zero2.gradients, zero2.optimizer) == (zero3.gradients, zero3.optimizer) == (
            fsdp2.gradients, fsdp2.optimizer)
    # the decision: between FSDP2's peak over 8 processes and the whole policy's
    _, eight = guard(8, "fsdp2")
    budget = (eight.total + one.total) // 2
    check_step_memory(eight, budget, "max_memory", use_peft=False, gradient_checkpointing=False, optim=cfg.optim,
                      sharding="fsdp2")
    with pytest.raises(MemoryError, match="shard full fine-tuning over several GPUs"):
        check_step_memory(one, budget, "max_memory", use_peft=False, gradient_checkpointing=False, optim=cfg.optim)
    with pytest.raises(ValueError, match="sharding: 'zero1' is not one of ddp, fsdp2, zero2, zero3"):
        guard(2, "zero1")


# each launch the multi-GPU recipes and the SLURM script start (scripts/recipes, scripts/slurm): the recipe, the
# processes, the sharding and the flags the launch adds
LAUNCHES = {
    "fsdp2 x 8": ("grpo_gsm8k_qwen7b_fsdp2.yaml", 8, "fsdp2", {}),
    "zero3 x 7 + server": ("grpo_gsm8k_qwen7b_zero3_server.yaml", 7, "zero3", {}),
    "slurm: 2 nodes, fsdp2 x 16": ("grpo_gsm8k_qwen7b_fsdp2.yaml", 16, "fsdp2", {}),
    "slurm: 2 training nodes + a generation node": ("grpo_gsm8k_qwen7b_fsdp2.yaml", 16, "fsdp2",
                                                     {"vllm_mode": "server", "vllm_enable_sleep_mode": False}),
}


@pytest.mark.parametrize("launch", LAUNCHES)
def test_each_multi_gpu_recipe_fits_its_cards_and_the_guard_decides_as_the_estimate(launch, meta_models_once):
    """--estimate_memory_only of each multi-GPU launch fits 80 GB cards; and the run-time guard, given what a
    process of that launch holds before sharding (the whole fp32 policy, the reference already sharded as
    lib/setup.load_models leaves it, the vLLM engine awake, the context) and what the engine gives back asleep,
    comes to the same peak, so it lets the run through (before, it counted the whole policy's gradients and AdamW
    states on every GPU: over 120 GB)."""
    from lib.sharding.memory import ENGINE_PART, VLLM_ASLEEP, guard_memory, recipe_model, recipe_parts

    recipe, processes, sharding, flags = LAUNCHES[launch]
    cfg = make_config({**load_yaml(str(REPO / "scripts" / "recipes" / recipe)), **flags,
                       "estimate_processes": processes, "estimate_sharding": sharding})
    _, estimate = recipe_memory(cfg, gpu_bytes=80 * GB)
    assert estimate.total <= 80 * GB, estimate.describe()

    model = recipe_model(cfg)
    whole = recipe_parts(cfg, model, gpu_bytes=80 * GB)
    held = dict(whole)
    if "reference model" in held and sharding in ("fsdp2", "zero3"):  # sharded as it loads
        held["reference model"] //= processes
    asleep = whole[ENGINE_PART] - VLLM_ASLEEP if cfg.vllm_enable_sleep_mode else 0
    _, guard = guard_memory(cfg, model, resident=sum(held.values()), processes=processes, sharding=sharding,
                            bf16=True, asleep=asleep, load_in_4bit=False, device_type="cuda")
    assert abs(guard.total - estimate.total) <= processes, (guard.describe(), estimate.describe())
    # what the guard refused before: the whole policy's gradients and states on one process
    _, unsharded = guard_memory(cfg, model, resident=sum(held.values()), processes=1, sharding="ddp", bf16=True,
                                asleep=asleep, load_in_4bit=False, device_type="cuda")
    assert unsharded.total > 80 * GB


def test_the_estimate_of_a_multi_gpu_recipe_says_it_fits():
    proc = subprocess.run([sys.executable, str(REPO / "train_agrpo.py"), "--config",
                           str(REPO / "scripts" / "recipes" / "grpo_gsm8k_qwen7b_zero3_server.yaml"),
                           "--estimate_memory_only", "--max_memory", "80", "--estimate_processes", "7",
                           "--estimate_sharding", "zero3"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "fits in 80.0 GB" in proc.stdout and "ZeRO-3: its partition" in proc.stdout


def test_a_run_that_fits_only_because_the_engine_sleeps_is_not_refused():
    """vllm_enable_sleep_mode: the engine gives its weights and KV cache back while the policy trains, so the
    training pass is counted without them and sampling (no activations) with them. The 7B FSDP2 recipe over 8 GPUs
    fits 50 GB that way and not awake; the guard, given the engine's share measured asleep, decides alike."""
    from lib.sharding.memory import (ENGINE_PART, VLLM_ASLEEP, check_step_memory, guard_memory, recipe_model,
                                   recipe_parts)

    recipe = {**load_yaml(str(REPO / "scripts" / "recipes" / "grpo_gsm8k_qwen7b_fsdp2.yaml")),
              "estimate_processes": 8}
    asleep_cfg = make_config(recipe)
    awake_cfg = make_config({**recipe, "vllm_enable_sleep_mode": False})
    _, sleeping = recipe_memory(asleep_cfg, gpu_bytes=80 * GB)
    _, awake = recipe_memory(awake_cfg, gpu_bytes=80 * GB)
    share = int(0.35 * 80 * GB)
    assert sleeping.asleep == share - VLLM_ASLEEP and awake.asleep == 0
    # asleep, the peak is sampling's (the engine's whole share, no activations); awake, training's on top of it
    assert sleeping.total == sleeping.resident + sleeping.gradients + sleeping.optimizer
    assert awake.total == awake.resident + awake.gradients + awake.optimizer + awake.training
    budget = 50 * GB
    assert sleeping.total <= budget < awake.total
    settings = dict(use_peft=False, gradient_checkpointing=True, optim="adamw_torch", sharding="fsdp2")
    check_step_memory(sleeping, budget, "max_memory", **settings)
    with pytest.raises(MemoryError, match="about 5[0-9.]* GB"):
        check_step_memory(awake, budget, "max_memory", **settings)
    # the guard, with what it would measure: the engine asleep gives back what the estimate says
    model = recipe_model(asleep_cfg)
    held = recipe_parts(asleep_cfg, model, gpu_bytes=80 * GB)
    held["reference model"] //= 8
    for cfg, asleep, estimate in ((asleep_cfg, held[ENGINE_PART] - VLLM_ASLEEP, sleeping), (awake_cfg, 0, awake)):
        _, guard = guard_memory(cfg, model, resident=sum(held.values()), processes=8, sharding="fsdp2", bf16=True,
                                asleep=asleep, load_in_4bit=False, device_type="cuda")
        assert abs(guard.total - estimate.total) <= 8
        assert (guard.total <= budget) == (estimate.total <= budget)
