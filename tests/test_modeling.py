"""Log-probs of completions: the shared-prefix forward equals the plain forward in value and gradient; LoRA's
reference is the base; QLoRA loads, samples and trains on the CPU for real."""

import pytest
import torch

from conftest import assert_close_to_scale, assert_rel_close
from lib.data.records import format_prompt, tokenize_prompts
from lib.models.modeling import adapter_disabled, completion_logps, length_chunks, load_policy
from lib.sampling.rollout import HFRollout

PROBLEMS = ["Ben has 9 books. Ben gives away 4 books. How many books does Ben have left?", "What is 6 x 7?"]


def _rollout(policy, tokenizer, tokens=20):
    ids, mask = tokenize_prompts(tokenizer, [format_prompt(tokenizer, p) for p in PROBLEMS], 256)
    torch.manual_seed(0)
    return HFRollout(policy, [tokenizer.eos_token_id], tokenizer.pad_token_id, seed=1).generate(
        ids, mask, 3, tokens, temperature=0.9)


def test_shared_prefix_logps_and_gradients_equal_the_full_forward(tiny_model, tokenizer):
    policy = load_policy(tiny_model)
    ro = _rollout(policy, tokenizer, tokens=12)
    args = (ro.prompt_ids, ro.prompt_mask, ro.prompt_index, ro.completion_ids, ro.completion_mask, ro.temperatures)
    shared, ent_shared = completion_logps(policy, *args, share_prompt_prefix=True)
    full, ent_full = completion_logps(policy, *args, share_prompt_prefix=False)
    # two paths through the model (cached prefix, full sequences): equal to rounding, which another CPU's kernels
    # order differently (tests/conftest.py); a token masked wrongly moves a log-prob by 0.9 of the scale
    assert_close_to_scale(shared, full, 1e-4, "log-probs")
    assert_close_to_scale(ent_shared, ent_full, 1e-4, "entropies")
    # against transformers' own logits at the sampling temperature
    ids = torch.cat([ro.prompt_ids[ro.prompt_index], ro.completion_ids], 1)
    mask = torch.cat([ro.prompt_mask[ro.prompt_index], ro.completion_mask], 1)
    with torch.no_grad():
        logits = policy(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    lp = ro.prompt_ids.shape[1]
    expected = torch.log_softmax(logits[:, lp - 1:-1].float() / 0.9, -1).gather(-1, ro.completion_ids[..., None])
    assert_close_to_scale(shared, expected.squeeze(-1) * ro.completion_mask, 1e-4, "log-probs against the logits")

    weight = policy.model.layers[1].self_attn.k_proj.weight
    (shared * ro.completion_mask).sum().backward()
    g_shared = weight.grad.clone()
    policy.zero_grad()
    full, _ = completion_logps(policy, *args, share_prompt_prefix=False)
    (full * ro.completion_mask).sum().backward()
    # relative norm of the whole gradient: 3e-7 measured (1.2e-6 on the embedded model); one completion token left
    # out of the sum gives 0.12
    assert_rel_close(g_shared, weight.grad, 1e-4, "k_proj gradient")


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_checkpointed_blocks_share_the_prompt_and_equal_the_plain_forward(tiny_model, tokenizer, lora):
    """Under gradient checkpointing the prompt still runs once per distinct prompt (docs/performance.md 3.2), with
    the values and gradients of the plain full-sequence forward without checkpointing."""
    from lib.models import checkpointed_prefix

    plain = load_policy(tiny_model, use_peft=lora, lora_r=4)
    checkpointed = load_policy(tiny_model, use_peft=lora, lora_r=4, gradient_checkpointing=True)
    checkpointed.load_state_dict(plain.state_dict())
    if lora:  # a non-zero adapter, the same in both
        with torch.no_grad():
            for (name, p), (_, q) in zip(plain.named_parameters(), checkpointed.named_parameters()):
                if "lora_B" in name:
                    p.normal_(0, 0.05)
                    q.copy_(p)
    plain.train(), checkpointed.train()  # checkpointing acts in training mode (the tiny model has no dropout)
    ro = _rollout(plain, tokenizer, tokens=12)
    args = (ro.prompt_ids, ro.prompt_mask, ro.prompt_index, ro.completion_ids, ro.completion_mask, ro.temperatures)
    assert checkpointed_prefix.prompt_cache(checkpointed.get_base_model() if lora else checkpointed) is not None

    positions = []  # token positions each decoder call embeds
    embed = (checkpointed.get_base_model() if lora else checkpointed).model.embed_tokens
    hook = embed.register_forward_hook(lambda m, inputs, out: positions.append(inputs[0].numel()))
    ours, ent_ours = completion_logps(checkpointed, *args, share_prompt_prefix=True,
                                      checkpointed_prefix=checkpointed_prefix)
    hook.remove()
    expected, ent_expected = completion_logps(plain, *args, share_prompt_prefix=False)
    # the prompts ran once each (2 distinct prompts, 6 completions), not once per completion; chunks by length may
    # split the completions into several calls, each with its own prompts
    full_positions = ro.completion_ids.shape[0] * (ro.prompt_ids.shape[1] + ro.completion_ids.shape[1])
    assert sum(positions) < full_positions - 3 * ro.prompt_ids.shape[1]
    assert_close_to_scale(ours, expected, 1e-4, "log-probs")
    assert_close_to_scale(ent_ours, ent_expected, 1e-4, "entropies")

    (ours * ro.completion_mask).sum().backward()
    (expected * ro.completion_mask).sum().backward()
    compared = 0
    for (name, p), (_, q) in zip(checkpointed.named_parameters(), plain.named_parameters()):
        if p.requires_grad and ("k_proj" in name or "lora_B" in name or "up_proj" in name):
            # the prompt's keys feed every completion: their gradient comes back through the recomputed blocks
            assert_rel_close(p.grad, q.grad, 1e-4, f"{name} gradient")
            compared += 1
    assert compared >= 2


def test_reentrant_checkpointing_runs_the_full_sequences(tiny_model, tokenizer):
    """Reentrant checkpointing does not differentiate through the prompt's keys read inside a block, so there the
    scorer runs the full sequences (and still equals the plain forward)."""
    from lib.models import checkpointed_prefix

    policy = load_policy(tiny_model, gradient_checkpointing=True,
                         gradient_checkpointing_kwargs={"use_reentrant": True})
    policy.train()
    assert checkpointed_prefix.prompt_cache(policy) is None
    ro = _rollout(policy, tokenizer, tokens=8)
    args = (ro.prompt_ids, ro.prompt_mask, ro.prompt_index, ro.completion_ids, ro.completion_mask, ro.temperatures)
    ours, _ = completion_logps(policy, *args, checkpointed_prefix=checkpointed_prefix)
    expected, _ = completion_logps(policy, *args, share_prompt_prefix=False)
    assert_close_to_scale(ours, expected, 1e-5, "log-probs")


def test_length_chunks_split_where_padding_costs_more_than_a_call():
    assert length_chunks([64] * 8) == [list(range(8))]  # equal lengths: one call
    # seven short rows and one long one: the long one alone (7 x 60 + 128 + 2 x 64 < 8 x 128 + 64)
    assert length_chunks([30, 35, 40, 45, 50, 55, 60, 128]) == [[0, 1, 2, 3, 4, 5, 6], [7]]
    assert length_chunks([10, 128, 12, 127], overhead=64) == [[0, 2], [3, 1]]
    assert length_chunks([10, 12], overhead=64) == [[0, 1]]  # too small to pay for a second call


def test_length_chunked_logps_and_gradients_equal_one_padded_batch(tiny_model, tokenizer):
    policy = load_policy(tiny_model)
    ro = _rollout(policy, tokenizer, tokens=4)
    ids = torch.randint(100, 40000, (6, 96), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros_like(ids)
    for row, n in enumerate([96, 3, 4, 2, 96, 5]):  # two long rows, four short: worth splitting
        mask[row, :n] = 1
    args = (ro.prompt_ids, ro.prompt_mask, ro.prompt_index, ids, mask, torch.full((6,), 0.9))
    assert len(length_chunks(mask.sum(1).tolist(), ro.prompt_ids.shape[1] * 2 + 16)) > 1
    chunked, ent_chunked = completion_logps(policy, *args)
    (chunked.sum() + ent_chunked.sum()).backward()
    grads = [p.grad.clone() for p in policy.parameters()]
    policy.zero_grad()
    whole, ent_whole = completion_logps(policy, *args, _chunked=True)  # one call, padded to 24
    (whole.sum() + ent_whole.sum()).backward()
    assert chunked.shape == whole.shape and torch.equal(chunked == 0, mask == 0)
    # other batch shapes sum in another order, and another CPU's kernels in another still (tests/conftest.py): per
    # element the log-probs agree to 6e-7 of their scale, entropies to 2e-6 (measured on the embedded model, the same
    # code path); a token masked wrongly is off by about the whole scale
    assert_close_to_scale(chunked, whole, 1e-4, "log-probs")
    assert_close_to_scale(ent_chunked, ent_whole, 1e-4, "entropies")
    # each parameter's gradient as a whole: relative norms up to 2e-6 measured (6.4e-7 on an AMX Xeon, where one
    # element of a v_proj gradient was 7.6e-5 off with the tensor's largest at 192); a token masked wrongly gives
    # 5e-3 on every parameter and 0.1 on the worst
    for (name, p), g in zip(policy.named_parameters(), grads):
        assert_rel_close(g, p.grad, 1e-4, name)


def test_lora_reference_is_the_base_with_the_adapter_disabled(tiny_model, tokenizer):
    base = load_policy(tiny_model)
    ro = _rollout(base, tokenizer, tokens=8)
    args = (ro.prompt_ids, ro.prompt_mask, ro.prompt_index, ro.completion_ids, ro.completion_mask, ro.temperatures)
    with torch.no_grad():
        base_logp, _ = completion_logps(base, *args)
    lora = load_policy(tiny_model, use_peft=True, lora_r=4, lora_alpha=8)
    trainable = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    with torch.no_grad():  # make the adapter do something
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
        adapted, _ = completion_logps(lora, *args)
        with adapter_disabled(lora):
            reference, _ = completion_logps(lora, *args)
    # the disabled adapter runs the base layers: equal to rounding (bitwise here; tests/conftest.py for why not
    # exact); the enabled one moves the tiny model's log-probs (about -11 a token) by up to 0.3 nats
    assert_close_to_scale(reference, base_logp, 1e-4, "reference log-probs")
    assert (adapted - base_logp).abs().max() > 0.05


def test_gradient_checkpointing_with_peft_keeps_lora_gradients(tiny_model, tokenizer):
    lora = load_policy(tiny_model, use_peft=True, lora_r=4, gradient_checkpointing=True)
    ro = _rollout(lora, tokenizer, tokens=8)
    logp, _ = completion_logps(lora, ro.prompt_ids, ro.prompt_mask, ro.prompt_index, ro.completion_ids,
                               ro.completion_mask, ro.temperatures)
    (logp * ro.completion_mask).sum().backward()
    # lora_B starts at zero, so lora_A's gradient is zero at the first step; lora_B's is not
    grads = [p.grad for n, p in lora.named_parameters() if "lora_B" in n]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_qlora_loads_in_4bit_samples_and_trains(tiny_model, tokenizer):
    pytest.importorskip("bitsandbytes")
    qlora = load_policy(tiny_model, use_peft=True, load_in_4bit=True, lora_r=4, lora_dropout=0.0)
    linear = qlora.get_base_model().model.layers[0].mlp.up_proj.base_layer
    assert type(linear).__name__ == "Linear4bit"
    with torch.no_grad():  # lora_B starts at 0; give it values so that every LoRA weight gets a gradient
        for name, p in qlora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    ids, mask = tokenize_prompts(tokenizer, [format_prompt(tokenizer, p) for p in PROBLEMS], 256)
    completion = tokenizer(["Answer: 5<|im_end|>"] * 2, return_tensors="pt", add_special_tokens=False)
    args = (ids, mask, torch.arange(2), completion.input_ids, completion.attention_mask, torch.ones(2))

    def lora_grads():
        qlora.zero_grad()
        qlora.train()
        logp, _ = completion_logps(qlora, *args)
        logp.sum().backward()
        return {n: p.grad.clone() for n, p in qlora.named_parameters() if p.requires_grad}

    before = lora_grads()
    assert all(g.abs().sum() > 0 for g in before.values())
    # sampling (eval mode, no grad) must not switch the base to a kernel without backward: with bitsandbytes'
    # CPU repacking left on, the first layer's LoRA gradient came out 0 after a generation (measured)
    ro = _rollout(qlora, tokenizer, tokens=8)
    assert ro.completion_mask.sum() > 0
    after = lora_grads()
    first_layer = [n for n in before if ".layers.0." in n]
    # same inputs, same kernels: equal to rounding (relative norm); a gradient lost to a kernel without backward
    # differs by 1.0
    assert first_layer
    for n in before:
        assert_rel_close(after[n], before[n], 1e-4, n)


def _small_llama(tied: bool, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    return LlamaForCausalLM(config).to(dtype).eval()


def test_mix_into_reference_matches_trls_sync_ref_model_callback():
    """sync_ref_model's update (docs/methods.md 13.3) against TRL 1.16's SyncRefModelCallback on the same weights:
    ref <- alpha policy + (1 - alpha) ref, bit for bit, a tied head counted once."""
    import copy

    callbacks = pytest.importorskip("trl.trainer.callbacks")
    from lib.models.modeling import mix_into_reference

    policy = _small_llama(tied=True)
    reference = copy.deepcopy(policy)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    theirs = copy.deepcopy(reference)
    mix_into_reference(reference, policy, 0.6)
    callbacks.SyncRefModelCallback._sync_target_model(policy, theirs, 0.6)
    ours_state, their_state = reference.state_dict(), theirs.state_dict()
    assert all(torch.equal(ours_state[k], their_state[k]) for k in ours_state)
    start = copy.deepcopy(theirs)
    mix_into_reference(reference, policy, 0.0)  # alpha 0 keeps the reference, alpha 1 copies the policy
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), start.parameters()))
    mix_into_reference(reference, policy, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), policy.parameters()))


@pytest.mark.parametrize("tied", [False, True])
def test_fp32_head_matches_trls_fused_head_on_bf16_weights(tied):
    """cast_lm_head_to_fp32 (docs/methods.md 13.2) on a bfloat16 model: our log-probs equal those of TRL 1.16's fused
    LM head with cast_lm_head_to_fp32 (its head cast to float32 as its trainer does) to float rounding, while the
    bfloat16 head is off by bfloat16 rounding. The tied embeddings still feed the decoder bfloat16 values."""
    import copy

    trl_utils = pytest.importorskip("trl.trainer.utils")
    from lib.models.fp32_head import cast_lm_head_to_fp32

    model = _small_llama(tied, torch.bfloat16)
    theirs, plain = copy.deepcopy(model), copy.deepcopy(model)
    cast_lm_head_to_fp32(model)
    assert model.lm_head.weight.dtype == torch.float32 and model.model.layers[0].mlp.up_proj.weight.dtype == \
        torch.bfloat16
    prompt = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(1))
    completion = torch.randint(0, 96, (3, 6), generator=torch.Generator().manual_seed(2))
    completion_mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 5 + [0]])
    index = torch.tensor([0, 1, 1])
    args = (prompt, torch.ones_like(prompt), index, completion, completion_mask, torch.ones(3))
    ours, _ = completion_logps(model, *args, share_prompt_prefix=False)
    ours.sum().backward()

    theirs.lm_head.float()  # what TRL's trainer does to the head before it adds the fused head, and, tied, to the
    if tied:  # embeddings' output (GRPOTrainer.__init__, cast_lm_head_to_fp32)
        theirs.model.embed_tokens.register_forward_hook(lambda module, a, output: output.to(torch.bfloat16))
    trl_utils.add_fused_lm_head(theirs, temperature=1.0, cast_lm_head_to_fp32=True)
    ids = torch.cat([prompt[index], completion], 1)
    labels = ids.masked_fill(torch.cat([torch.zeros_like(prompt[index]), completion_mask], 1) == 0, -100)
    out = theirs(input_ids=ids, attention_mask=torch.cat([torch.ones_like(prompt[index]), completion_mask], 1),
                 labels=labels, fused_lm_head=True)
    trl_logp = out.log_probs[:, prompt.shape[1] - 1:].float()
    trl_logp.sum().backward()
    gap = (ours.detach() - trl_logp.detach()).abs().max()
    with torch.no_grad():
        bf16_gap = (completion_logps(plain, *args, share_prompt_prefix=False)[0] - trl_logp).abs().max()
    assert gap < 1e-5 < bf16_gap
    # the output layer's gradient (float32 on both sides), the same to float rounding
    assert_rel_close(model.lm_head.weight.grad, theirs.lm_head.weight.grad, 1e-5, "the output layer's gradient")


def test_fp32_head_refuses_an_adapted_head():
    from peft import LoraConfig, get_peft_model

    from lib.config import ConfigError
    from lib.models.fp32_head import cast_lm_head_to_fp32

    model = get_peft_model(_small_llama(tied=False), LoraConfig(r=2, target_modules=["lm_head", "q_proj"]))
    with pytest.raises(ConfigError, match="lora_target_modules"):
        cast_lm_head_to_fp32(model)
