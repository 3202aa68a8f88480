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
    if four_bit:  # the 4-bit layers compute in bf16, the rest of the base is bf16 too
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


def test_a_4bit_base_keeps_its_other_weights_in_the_load_dtype_and_trains_as_the_upcast_one(embedded_model,
                                                                                               tokenizer):
    """QLoRA without peft's fp32 upcast of embeddings, head and norms (lib/models/modeling.load_policy): the embedded model
    in bf16 on a CPU holds fewer weight bytes, and three optimizer steps under gradient checkpointing give finite
    losses and gradient norms close to those of the upcast model (prepare_model_for_kbit_training), started alike."""
    pytest.importorskip("bitsandbytes")
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    prompts = tokenizer(["What is 2 + 3?", "Name a colour."], return_tensors="pt", padding=True)
    completion = torch.randint(100, 2000, (4, 8), generator=torch.Generator().manual_seed(0))
    ours = load_policy(embedded_model, dtype=torch.bfloat16, use_peft=True, load_in_4bit=True, lora_r=8,
                       gradient_checkpointing=True)
    upcast = load_policy(embedded_model, dtype=torch.bfloat16, load_in_4bit=True)
    upcast = prepare_model_for_kbit_training(upcast, gradient_checkpointing_kwargs={"use_reentrant": False})
    upcast = get_peft_model(upcast, LoraConfig(r=8, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))

    def weight_bytes(model) -> int:
        return sum(p.numel() * p.element_size() for p in model.parameters())

    norms = [p for n, p in ours.named_parameters() if "norm" in n]
    assert norms and all(p.dtype == torch.bfloat16 for p in norms)
    assert ours.get_input_embeddings().weight.dtype == torch.bfloat16
    assert upcast.get_input_embeddings().weight.dtype == torch.float32
    saved = weight_bytes(upcast) - weight_bytes(ours)
    # the embedded model's tied 49,152 x 576 embedding and its norms, 2 bytes a value fewer
    assert saved >= 49152 * 576 * 2
    print(f"weights: {weight_bytes(ours) / 2**20:.1f} MiB against {weight_bytes(upcast) / 2**20:.1f} MiB upcast")

    def train(model) -> list[tuple[float, float]]:
        torch.manual_seed(0)
        for name, p in model.named_parameters():  # the same adapter in both: lora_B given values, seeded
            if "lora_" in name:
                torch.nn.init.normal_(p, 0, 0.02)
        params = [p for p in model.parameters() if p.requires_grad]
        assert params and all(p.dtype == torch.float32 for p in params)
        optimizer = build_optimizer(params, "adamw_torch", 1e-3, (0.9, 0.99), 0.0)
        model.train()
        out = []
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logp, _ = completion_logps(model, prompts.input_ids, prompts.attention_mask,
                                           torch.tensor([0, 0, 1, 1]), completion, torch.ones_like(completion),
                                           torch.ones(4), with_entropy=False)
            loss = -logp.mean()
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, 1e9)
            optimizer.step()
            optimizer.zero_grad()
            out.append((float(loss.detach()), float(grad_norm)))
        return out

    mine, theirs = train(ours), train(upcast)
    print("loss, grad norm:", mine, "upcast:", theirs)
    for (loss, norm), (loss_u, norm_u) in zip(mine, theirs):
        assert torch.isfinite(torch.tensor([loss, norm])).all()
        # bf16 norms and residual stream against fp32 ones: measured 0.1% (loss) and 1% (norm) apart over 30 layers
        assert abs(loss - loss_u) <= 0.01 * abs(loss_u)
        assert abs(norm - norm_u) <= 0.03 * norm_u


@pytest.mark.parametrize("card,capability,precision", [
    ("v100", (7, 0), "fp16"), ("t4", (7, 5), "fp16"), ("a100", (8, 0), "bf16"), ("a10", (8, 6), "bf16"),
    ("h100", (9, 0), "bf16")])
def test_the_precision_is_chosen_from_the_cards_compute_capability(card, capability, precision):
    from lib.models.modeling import card_capability, training_precision

    assert card_capability(card) == capability == card_capability(f"{capability[0]}.{capability[1]}")
    assert training_precision("cuda", capability) == precision
    # what the configuration says wins; bf16 false on a bf16 card is fp32, as before fp16 existed
    assert training_precision("cuda", capability, bf16=True) == "bf16"
    assert training_precision("cuda", capability, fp16=False, bf16=False) == "fp32"
    assert training_precision("cuda", capability, bf16=False) == ("fp16" if precision == "fp16" else "fp32")
    with pytest.raises(ValueError, match="choose one"):
        training_precision("cuda", capability, bf16=True, fp16=True)
    with pytest.raises(ValueError, match="t4"):
        card_capability("a toaster")


def test_a_cpu_trains_in_bf16_where_it_has_it_and_fp32_elsewhere():
    from lib.models.modeling import native_bf16, training_precision

    assert training_precision("cpu") == ("bf16" if native_bf16("cpu") else "fp32")  # never fp16 on a CPU
    assert training_precision("cpu", fp16=True) == "fp16"  # asked for (Accelerate then runs it without autocast)


def test_the_16gb_recipe_estimated_for_a_t4_fits_in_fp16(capsys):
    from lib.config import parse_config
    from lib.sharding.memory import estimate_only

    recipe = Path(__file__).resolve().parents[1] / "scripts/recipes/grpo_gsm8k_qlora_16gb.yaml"
    out = {}
    for card in ("t4", "a100"):
        cfg = parse_config(["--config", str(recipe), "--estimate_memory_only", "--max_memory", "16", "--use_vllm",
                            "false", "--estimate_gpu", card])
        out[card] = estimate_only(cfg)
        printed = capsys.readouterr().out
        assert "fits in 16.0 GB" in printed
        assert ("fp16 autocast with loss scaling" if card == "t4" else "bf16 autocast") in printed
    assert (out["t4"]["precision"], out["a100"]["precision"]) == ("fp16", "bf16")
    # fp32 weights outside the 4-bit layers and an fp32 sampler copy on the T4: more than on a bf16 card
    assert out["t4"]["estimated_peak_bytes"] > out["a100"]["estimated_peak_bytes"]
