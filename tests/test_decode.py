"""lib/sampling/decode.py on a CPU: the grouped-query attention the written-out step computes (each key/value head read
once), the choice of decode step by family and rope type (with the fallbacks' equality to the model's own forward),
and the graphed step kept across generate calls (`GraphSteps`: its steps run eagerly here; the graphs themselves are
tests/test_gpu.py's). Tiny models built from their configs, random weights."""

from functools import partial

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import (Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Phi3Config, Phi3ForCausalLM)

from lib.sampling import cpu_kernels
from lib.sampling.decode import (GraphStep, GraphSteps, LlamaStep, _grouped_attention, decode_step_for, graphable,
                               host_synced_rope, llama_family)
from lib.sampling.policy_copy import make_copy
from lib.models.modeling import FAST_ATTENTION, CompletionScorer
from lib.sampling.rollout import HFRollout, ModelStep, prefill

# 8 query heads on 2 key/value heads: groups of 4
SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=512)


def tiny(kind: str, attn: str = FAST_ATTENTION) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**SHAPE, attn_implementation=attn))
    if kind == "llama-dynamic":  # NTK scaling past 16 positions, which the decoding below crosses
        return LlamaForCausalLM(LlamaConfig(**{**SHAPE, "max_position_embeddings": 16}, attn_implementation=attn,
                                            rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                             "rope_theta": 10_000.0}))
    if kind == "llama-longrope":  # the long factors past 16 positions
        return LlamaForCausalLM(LlamaConfig(**{**SHAPE, "max_position_embeddings": 64}, attn_implementation=attn,
                                            rope_parameters={"rope_type": "longrope", "short_factor": [1.0] * 4,
                                                             "long_factor": [1.5, 2.0, 3.0, 4.0], "factor": 4.0,
                                                             "original_max_position_embeddings": 16,
                                                             "rope_theta": 10_000.0}))
    if kind == "mistral":  # no sliding window (Mistral 7B v0.2 on): the Llama layer
        return MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=None, attn_implementation=attn))
    if kind == "mistral-window":  # a window of 4, shorter than the prompts
        return MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=4, attn_implementation="sdpa"))
    if kind == "gemma2":  # soft caps, every other layer a window of 4; eager, which applies the attention cap
        return Gemma2ForCausalLM(Gemma2Config(**SHAPE, head_dim=8, sliding_window=4, query_pre_attn_scalar=8,
                                              attn_implementation="eager"))
    assert kind == "phi3"  # fused q/k/v and gate/up products
    return Phi3ForCausalLM(Phi3Config(**SHAPE, pad_token_id=0, attn_implementation="sdpa"))


def prompts(rows: int = 3, length: int = 10):
    ids = torch.randint(3, 300, (rows, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :4], ids[0, :4] = 0, 0  # a left-padded prompt
    return ids, mask


class Shapes(TorchDispatchMode):
    """The shapes of every tensor the operations under it return."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


@torch.no_grad()
def test_grouped_attention_reads_each_key_value_head_once_and_equals_sdpa_over_repeated_heads():
    """`_grouped_attention` (the step's attention on a GPU, and on a CPU with our decode attention) against PyTorch's
    SDPA over keys and values repeated per query head (what transformers' SDPA computes with a mask), in float32;
    then inside the step on a model whose own attention is transformers' SDPA: no tensor of the repeated keys'
    shape is made (the model's own SDPA, taken by the same step, makes one a layer), and its logits equal the model's
    forward's to float32 rounding."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(3, 8, 1, 16, generator=generator)
    keys, values = torch.randn(2, 3, 2, 20, 16, generator=generator)
    allowed = torch.rand(3, 20, generator=generator) > 0.3
    allowed[:, -1] = True
    additive = torch.where(allowed, 0.0, float("-inf"))[:, None, None, :]
    ours = _grouped_attention(q, keys, values, additive, 0.25)
    reference = torch.nn.functional.scaled_dot_product_attention(
        q, keys.repeat_interleave(4, dim=1), values.repeat_interleave(4, dim=1), attn_mask=allowed[:, None, None, :],
        scale=0.25)
    assert torch.allclose(ours, reference.reshape(3, 8 * 16), atol=1e-6)

    model = tiny("llama", attn="sdpa").eval()
    ids, mask = prompts()
    # (B, query heads, positions, D): keys or values repeated per query head
    repeated = lambda shape: len(shape) == 4 and shape[:2] == (3, 8) and shape[2] > 1 and shape[3] == 8  # noqa: E731
    made = {}
    for grouped in (True, False):
        _, cache = prefill(model, ids, mask)
        step = LlamaStep(model, cache, mask, 4, grouped=grouped)
        with Shapes() as seen:
            logits = step.step(ids[:, -1], mask.sum(-1))
        made[grouped] = sum(map(repeated, seen.shapes))
        _, cache = prefill(model, ids, mask)
        expected = ModelStep(model, cache, mask).step(ids[:, -1], mask.sum(-1))
        assert torch.allclose(logits, expected, atol=1e-5 * float(expected.abs().max())), grouped
    assert made[True] == 0 and made[False] >= 2 * 2, made  # keys and values, each layer


@pytest.mark.parametrize("kind", ["llama-dynamic", "llama-longrope"])
def test_a_rope_type_a_graph_cannot_capture_decodes_written_out_with_the_models_own_logits(kind):
    """"dynamic" and "longrope" rope scaling read the positions back on the host at every step: on CUDA the sampler
    takes the written-out step, eagerly, instead of the graphs (on a CPU, as always, the written-out step). Its
    logits equal the model's forward's bit for bit at every step, the positions crossing the length where the
    frequencies change (16), and a sampled run takes the same tokens either way."""
    engine = HFRollout(tiny(kind), [1], 0, bf16=True, seed=3, copy=cpu_kernels.sampling_copy)
    model = engine.model
    assert llama_family(model) and host_synced_rope(model) and not graphable(model)
    assert decode_step_for(model, "cuda") is LlamaStep and decode_step_for(model, "cpu") is LlamaStep
    assert isinstance(decode_step_for(tiny("llama"), "cuda"), GraphSteps)  # the rope types a graph can take
    ids, mask = prompts()
    with torch.no_grad():
        steps = []
        for make in (lambda c: ModelStep(model, c, mask), lambda c: LlamaStep(model, c, mask, 30, block=8)):
            _, cache = prefill(model, ids, mask)
            steps.append(make(cache))
        tokens, positions = torch.randint(3, 300, (3, 30), generator=torch.Generator().manual_seed(2)), mask.sum(-1)
        for t in range(30):
            reference, ours = (s.step(tokens[:, t], positions) for s in steps)
            assert torch.equal(ours, reference), t
            positions = positions + 1
    runs = []
    for step in (None, LlamaStep):
        engine.decode_step = step
        engine.generator.manual_seed(3)
        runs.append(engine.generate(ids, mask, 2, 40, temperature=1.0))
    assert torch.equal(runs[0].completion_ids, runs[1].completion_ids)
    assert int(runs[1].completion_mask.sum(-1).max()) > 10  # decoded past position 16


@pytest.mark.parametrize("kind", ["gemma2", "mistral-window", "phi3"])
def test_the_families_the_step_does_not_write_out_decode_with_their_forward_and_score_what_they_sample(kind):
    """Gemma-2 (soft caps, sliding windows), Mistral with a sliding window and Phi-3 (fused products) decode with
    the model's own forward (`ModelStep`) on every device: the sampler's per-token log-probs of its own completions,
    one token at a time over the cache (windows of 4 crossed), equal the scorer's full forward in float32."""
    policy = tiny(kind).eval()
    engine = HFRollout(policy, [1], 0, seed=3, copy=partial(cpu_kernels.sampling_copy, own_copy=True))
    assert engine.copy is not None and engine.decode_step is None
    assert not llama_family(engine.model) and decode_step_for(engine.model, "cuda") is None
    ids, mask = prompts()
    roll = engine.generate(ids, mask, 2, 24, temperature=1.0)
    assert int(roll.completion_mask.sum()) > 40
    with torch.no_grad():  # the sampler's arithmetic, teacher-forced on its own tokens
        logits, cache = prefill(engine.model, roll.prompt_ids, roll.prompt_mask)
        logits = logits[roll.prompt_index]
        cache.reorder_cache(roll.prompt_index)
        step = ModelStep(engine.model, cache, roll.prompt_mask[roll.prompt_index])
        position = roll.prompt_mask.sum(-1)[roll.prompt_index]
        sampler = torch.zeros(roll.completion_ids.shape)
        for t in range(roll.completion_ids.shape[1]):
            token = roll.completion_ids[:, t]
            sampler[:, t] = torch.log_softmax(logits, -1).gather(1, token[:, None])[:, 0]
            logits, position = step.step(token, position), position + 1
        scorer = CompletionScorer(policy)(roll.prompt_ids, roll.prompt_mask, roll.prompt_index, roll.completion_ids,
                                          roll.completion_mask, roll.temperatures, with_entropy=False)[0]
    on = roll.completion_mask.bool()
    assert float((sampler - scorer)[on].abs().max()) < 1e-4


@torch.no_grad()
def test_mistral_without_a_window_is_written_out_with_its_forwards_logits_bit_for_bit():
    engine = HFRollout(tiny("mistral"), [1], 0, bf16=True, seed=3, copy=cpu_kernels.sampling_copy)
    model = engine.model
    assert llama_family(model) and engine.decode_step is LlamaStep and isinstance(decode_step_for(model, "cuda"),
                                                                                 GraphSteps)
    assert not llama_family(tiny("mistral-window"))
    ids, mask = prompts()
    steps = []
    for make in (lambda c: ModelStep(model, c, mask), lambda c: LlamaStep(model, c, mask, 20, block=8),
                 lambda c: GraphStep(model, c, mask, 20, block=8)):
        _, cache = prefill(model, ids, mask)
        steps.append(make(cache))
    tokens, positions = torch.randint(3, 300, (3, 20), generator=torch.Generator().manual_seed(2)), mask.sum(-1)
    for t in range(20):
        reference, *ours = (s.step(tokens[:, t], positions) for s in steps)
        assert all(torch.equal(o, reference) for o in ours), t
        positions = positions + 1


def test_the_graphed_step_is_kept_across_generate_calls_while_it_fits():
    """`GraphSteps` (the sampler's decode step on CUDA) keeps one `GraphStep`, its buffers and (on CUDA) its
    graphs, from one generate call to the next: restarted for prompts of another length and after a sync that
    copies new weights into the copy's tensors, with the same tokens as a fresh written-out step each time;
    replaced where the buffers are too short, where a weight is another tensor, and kept per batch size for the
    last two used."""
    policy = tiny("llama").eval()
    # a bf16 copy with plain linear layers (prepacked ones are a CPU's, where no graph is kept)
    engine = HFRollout(policy, [1], 0, bf16=True, seed=3, copy=make_copy)
    graphs = GraphSteps(block=8)

    def run(step, ids, mask, new_tokens, generations=2):
        engine.decode_step = step
        engine.generator.manual_seed(7)
        return engine.generate(ids, mask, generations, new_tokens, temperature=1.0).completion_ids

    def same_as_written_out(ids, mask, new_tokens, generations=2):
        ours = run(graphs, ids, mask, new_tokens, generations)
        assert torch.equal(ours, run(LlamaStep, ids, mask, new_tokens, generations))
        return graphs.steps[ids.shape[0] * generations]

    ids, mask = prompts(length=10)
    first = same_as_written_out(ids, mask, 20)
    assert first.windows == [8, 16, 24, 32] and first.mask.shape == (6, 32)
    longer_prompt = torch.cat([ids[:, :2], ids], 1), torch.cat([mask[:, :2], mask], 1)
    assert same_as_written_out(*longer_prompt, 20) is first  # 12 + 20 positions still fit
    # a sync copies new weights into the copy's own tensors: the same step, reading them
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    engine.sync_weights(policy)
    assert same_as_written_out(ids, mask, 20) is first
    # a weight that is another tensor: a graph would read the old one
    engine.model.lm_head.weight = torch.nn.Parameter(engine.model.lm_head.weight.detach().clone())
    second = same_as_written_out(ids, mask, 20)
    assert second is not first
    third = same_as_written_out(ids, mask, 30)  # 40 positions: longer buffers
    assert third is not second and third.windows == [8, 16, 24, 32, 40]
    fourth = same_as_written_out(ids[:2], mask[:2], 30)  # another batch size: its own step, the other kept
    assert fourth is not third and graphs.steps == {6: third, 4: fourth}
    assert same_as_written_out(ids, mask, 25) is third
    same_as_written_out(ids[:1], mask[:1], 30, generations=3)  # a third batch size: the least recent goes
    assert list(graphs.steps) == [6, 3]
