"""Any causal LM: the scorer and the sampler give each architecture's own distribution (its logit post-processing
included), an architecture whose forward does something else is refused at load time, chat_template_kwargs reach the
template, and a hub model's own code runs only with trust_remote_code (docs/models.md)."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import assert_close_to_scale, rel_diff
from lib.config import ConfigError, make_config
from lib.models.modeling import (check_scoring_path, completion_logps, default_attn_implementation, load_policy,
                          load_reference, load_tokenizer, logit_transform)
from lib.sampling.rollout import prefill

VOCAB = 96
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)
# each family's config class and what sets it apart; sliding windows of 4 tokens, shorter than the test's sequences,
# so that the cached-prefix path runs through the window masks; Granite's and Cohere's scales are their published
# models' (granite-3.x: logits_scaling 8; command-r: logit_scale 0.0625), Gemma's soft cap is Gemma-2's 30
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "gemma2": ("Gemma2Config", {"sliding_window": 4, "final_logit_softcapping": 30.0}),
    "gemma3": ("Gemma3TextConfig", {"sliding_window": 4, "final_logit_softcapping": 30.0}),
    "granite": ("GraniteConfig", {"logits_scaling": 8.0}),
    "phi3": ("Phi3Config", {"sliding_window": 4}),
    "mistral": ("MistralConfig", {"sliding_window": 4}),
    "cohere": ("CohereConfig", {"logit_scale": 0.0625}),
}
POSTPROCESSED = {"gemma2", "gemma3", "granite", "cohere"}


def tiny(family: str, logit_size: float = 40.0) -> torch.nn.Module:
    """A two-block model of `family` with random (seeded) weights, its output layer scaled so that the raw logits
    reach about +-`logit_size`, as a trained model's do (random ones stay below 1, where a soft cap of 30 is almost
    the identity and would go untested)."""
    import transformers

    name, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(getattr(transformers, name)(**SMALL, **extra)).eval()
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        probe = model(input_ids=torch.arange(3, 40)[None]).logits
        scale, _ = logit_transform(model.config)
        head.mul_(logit_size / float(probe.abs().max() / scale))
    return model


def batch():
    """Two left-padded prompts (7 and 5 tokens) and three completions of 6, 4 and 6 tokens."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, VOCAB, (2, 7), generator=g)
    prompt_mask = torch.ones_like(prompt)
    prompt_mask[1, :2] = 0
    completion = torch.randint(3, VOCAB, (3, 6), generator=g)
    completion_mask = torch.ones_like(completion)
    completion_mask[1, 4:] = 0
    return prompt, prompt_mask, torch.tensor([0, 0, 1]), completion, completion_mask


@pytest.mark.parametrize("family", list(FAMILIES))
def test_scorer_and_first_token_give_the_models_own_distribution(family):
    model = tiny(family)
    prompt, prompt_mask, index, completion, completion_mask = batch()
    ids = torch.cat([prompt[index], completion], 1)
    mask = torch.cat([prompt_mask[index], completion_mask], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        # the model's own distribution at the sampling temperature, the reference every path is held to
        expected = torch.log_softmax(logits[:, 6:-1].float() / 0.7, -1).gather(-1, completion[..., None]).squeeze(-1)
        expected = expected * completion_mask
        for shared in (True, False):  # the shared-prompt forward and the full one
            logp, _ = completion_logps(model, prompt, prompt_mask, index, completion, completion_mask,
                                       torch.full((3,), 0.7), share_prompt_prefix=shared, with_entropy=False)
            # two paths through the same fp32 weights: equal to rounding (tests/conftest.py)
            assert_close_to_scale(logp, expected, 1e-4, f"{family} log-probs, share_prompt_prefix={shared}")
        first, _ = prefill(model, prompt, prompt_mask)  # the sampler's first token
        own = model(input_ids=prompt, attention_mask=prompt_mask,
                    position_ids=(prompt_mask.cumsum(-1) - 1).clamp(min=0)).logits[:, -1]
        assert_close_to_scale(first, own, 1e-4, f"{family} first-token logits")
        if family in POSTPROCESSED:  # the raw output layer alone (the code before) is far off: the test bites
            raw = model.get_output_embeddings()(model.get_decoder()(input_ids=prompt, attention_mask=prompt_mask,
                                                                    position_ids=(prompt_mask.cumsum(-1) - 1)
                                                                    .clamp(min=0)).last_hidden_state[:, -1])
            assert rel_diff(raw, own) > 0.05


def test_an_architecture_whose_forward_we_do_not_reproduce_is_refused():
    """A forward that post-processes its logits in a way the table does not know (here: Llama with its logits
    halved) is refused at load time, naming the architecture; the model itself is accepted."""
    from transformers import LlamaForCausalLM

    class HalvedLlamaForCausalLM(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits / 2
            return out

    model = tiny("llama")
    check_scoring_path(model)
    halved = HalvedLlamaForCausalLM(model.config).eval()
    halved.load_state_dict(model.state_dict())
    with pytest.raises(ConfigError, match="HalvedLlamaForCausalLM computes its logits in a way agrpo does not "
                                          "reproduce") as refused:
        check_scoring_path(halved)
    assert "docs/models.md" in str(refused.value)


def test_gemma2s_attention_soft_cap_is_applied_by_default_and_an_attention_that_drops_it_refused(tmp_path):
    """Gemma-2 caps each attention score s at c tanh(s / c), c = 50 (Gemma 2 report, 2.2), which transformers' SDPA
    (and ours on CPUs) drops. Unset, the attention is eager on every device, for the policy and its reference: the
    scorer's and the sampler's first-token log-probs equal an eager forward's, where the same weights under SDPA are
    another distribution. SDPA given by hand is refused at load, naming the key; and the load-time check, which
    compares with an eager forward, refuses a model that attends with SDPA."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, Qwen2Config

    config = Gemma2Config(**SMALL, query_pre_attn_scalar=8, sliding_window=4)  # Gemma-2's caps: 50 and 30
    assert config.attn_logit_softcapping == 50.0
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(config)
    with torch.no_grad():  # attention scores past the cap, as a trained model's reach (random ones stay below 1)
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(100)
            layer.self_attn.k_proj.weight.mul_(100)
    model.save_pretrained(tmp_path)
    assert default_attn_implementation("cpu", config) == default_attn_implementation("cuda", config) == "eager"
    assert default_attn_implementation("cuda", Qwen2Config()) == "sdpa"  # no cap: as before

    policy = load_policy(str(tmp_path))
    reference = load_reference(str(tmp_path), torch.float32)
    assert policy.config._attn_implementation == reference.config._attn_implementation == "eager"
    sdpa = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    prompt, prompt_mask, index, completion, completion_mask = batch()
    ids = torch.cat([prompt[index], completion], 1)
    mask = torch.cat([prompt_mask[index], completion_mask], 1)
    with torch.no_grad():
        logits = policy(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        expected = torch.log_softmax(logits[:, 6:-1].float(), -1).gather(-1, completion[..., None]).squeeze(-1)
        expected = expected * completion_mask
        args = (prompt, prompt_mask, index, completion, completion_mask, torch.ones(3))
        for model in (policy, reference):
            logp, _ = completion_logps(model, *args, with_entropy=False)
            assert_close_to_scale(logp, expected, 1e-4, "eager log-probs")
        first, _ = prefill(policy, prompt, prompt_mask)
        assert_close_to_scale(first, logits[[0, 2], 6], 1e-4, "the sampler's first token")
        dropped, _ = completion_logps(sdpa, *args, with_entropy=False)
    assert float((dropped - expected).abs().max()) > 0.1  # the cap matters at these scores (0.17 nats here)
    with pytest.raises(ConfigError, match="attn_implementation: sdpa does not apply gemma2's attention soft cap"):
        load_policy(str(tmp_path), attn_implementation="sdpa")
    with pytest.raises(ConfigError, match="attn_implementation: sdpa computes another model than Gemma2ForCausalLM"):
        check_scoring_path(sdpa)


def remote_code_folder(tmp_path):
    """A model folder that ships its own architecture (a renamed Llama) as hub models with custom code do."""
    folder = tmp_path / "remote"
    folder.mkdir()
    (folder / "configuration_mini.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass MiniConfig(LlamaConfig):\n    model_type = 'mini'\n")
    (folder / "modeling_mini.py").write_text(
        "from transformers import LlamaForCausalLM\n\nfrom .configuration_mini import MiniConfig\n\n\n"
        "class MiniForCausalLM(LlamaForCausalLM):\n    config_class = MiniConfig\n")
    tiny("llama").save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="mini", architectures=["MiniForCausalLM"],
                  auto_map={"AutoConfig": "configuration_mini.MiniConfig",
                            "AutoModelForCausalLM": "modeling_mini.MiniForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_models_own_code_runs_only_with_trust_remote_code(tmp_path):
    folder = remote_code_folder(tmp_path)
    assert make_config({}).trust_remote_code is False
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_policy(str(folder))
    policy = load_policy(str(folder), trust_remote_code=True)
    assert type(policy).__name__ == "MiniForCausalLM"


# a Qwen3-style template, written for this test: Qwen3's generation prompt closes an empty think block when the
# template variable enable_thinking is false (no reasoning), and leaves the block to the model otherwise
QWEN3_STYLE_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")


def test_chat_template_kwargs_reach_the_template(tmp_path, embedded_model):
    from accelerate import Accelerator

    from lib.sampling.context import RolloutContext

    tokenizer = load_tokenizer(embedded_model)
    tokenizer.chat_template = QWEN3_STYLE_TEMPLATE
    tokenizer.save_pretrained(tmp_path)
    tokenizer = load_tokenizer(str(tmp_path))
    record = {"problem": "What is 2 + 3?", "answer": "5"}
    prompts = {}
    for given in (None, '{"enable_thinking": false}', '{"enable_thinking": true}'):
        cfg = make_config({} if given is None else {"chat_template_kwargs": given})  # JSON, as on the command line
        context = RolloutContext(cfg, None, tokenizer, [("accuracy", None)], torch.ones(1), [record],
                                 Accelerator(cpu=True), None, 2, 0, None)
        prompts[given] = context.prompt_text(record)  # the text the trainer samples, scores and evaluates with
    assert prompts[None].endswith("<|im_start|>assistant\n") and "<think>" not in prompts[None]
    assert prompts['{"enable_thinking": false}'] == prompts[None] + "<think>\n\n</think>\n\n"
    assert prompts['{"enable_thinking": true}'] == prompts[None]
    with pytest.raises(ConfigError, match="chat_template_kwargs: expected a mapping"):
        make_config({"chat_template_kwargs": "[1, 2]"})
