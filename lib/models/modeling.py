"""Loading the policy (full, LoRA, QLoRA) and its tokenizer; per-token log-probs. The embedded default model's folder
is lib/models/embedded.py's (the entry scripts resolve model_name_or_path with it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import transformers  # the model and tokenizer classes are read from it where used: it loads each on first use
from transformers.cache_utils import DynamicCache

from lib.config import ConfigError
from lib.methods.losses import token_logps_and_entropy
from lib.models.attention import FAST_ATTENTION, register_fast_attention


# transformers' attention implementations that apply an attention logit soft cap (they take `softcap`); its SDPA and
# ours drop it without a word
SOFT_CAP_ATTENTION = ("eager", "flash_attention_2", "flash_attention_3", "flex_attention")


def attention_soft_cap(config) -> float | None:
    """The attention logit soft cap c of a model's (text) config, or None: each attention score s becomes
    c tanh(s / c) (Gemma 2 report, Gemma Team 2024, section 2.2: Gemma-2 caps at 50, as do VaultGemma and T5Gemma;
    Gemma-3 sets none)."""
    return getattr(config.get_text_config(), "attn_logit_softcapping", None) or None


def default_attn_implementation(device: torch.device | str, config=None) -> str:
    """The attention a model loads with when `attn_implementation` is unset: eager for a model whose `config` has an
    attention soft cap (`attention_soft_cap`), which SDPA would drop (eager is transformers' reference forward and
    applies it; flash_attention_2, where installed, does too and is given by hand); otherwise the decode-friendly
    SDPA of lib/models/attention.py (`grouped_decode_attention`, registered with transformers as FAST_ATTENTION here)
    on CPU, plain SDPA elsewhere: on an H100 the two did not differ (docs/performance.md 6.2), and transformers' own
    also knows sliding windows."""
    if config is not None and attention_soft_cap(config):
        return "eager"
    if torch.device(device).type != "cpu":
        return "sdpa"
    register_fast_attention()  # the name is usable wherever it is returned
    return FAST_ATTENTION


def check_attn_implementation(name: str, config) -> None:
    """Refuse (ConfigError naming the key) an attention implementation that drops the model's attention soft cap:
    the policy, its reference and the HF sampler would compute another model than the checkpoint (and than vLLM,
    which applies the cap). Ours (FAST_ATTENTION, given by name or chosen on a CPU) is registered here, before the
    model loads with it."""
    if name == FAST_ATTENTION:
        register_fast_attention()
    cap = attention_soft_cap(config)
    if cap and name not in SOFT_CAP_ATTENTION:
        raise ConfigError(f"attn_implementation: {name} does not apply {config.get_text_config().model_type}'s "
                          f"attention soft cap (attn_logit_softcapping {cap}), so training would compute another "
                          f"model than the checkpoint; leave it unset (eager is chosen) or give one of "
                          f"{', '.join(SOFT_CAP_ATTENTION)}")


def load_tokenizer(model_path: str, padding_side: str = "left", trust_remote_code: bool = False,
                   revision: str | None = None):
    """The tokenizer with left padding (prompts are left-padded for batched decoding) and a pad token. Code shipped with
    a hub model runs only with `trust_remote_code`; `revision` picks a hub model's branch, tag or commit."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code,
                                                           revision=revision)
    tokenizer.padding_side = padding_side
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def end_token_ids(model: torch.nn.Module, tokenizer) -> list[int]:
    """The tokens that end a completion: the tokenizer's end token and any the generation config names (an int or a
    list; chat models often add their end-of-turn token there)."""
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    extra = [config_eos] if isinstance(config_eos, int) else list(config_eos or [])
    return sorted({tokenizer.eos_token_id, *extra})


def is_adapter_folder(path: str) -> bool:
    return Path(path, "adapter_config.json").exists()


def weights_dtype(name: str | None, *, lora: bool = False, device: str = "cpu",
                  bf16: bool = False) -> torch.dtype | str:
    """The dtype the weights load in: `dtype` as TRL's ModelConfig reads it (auto: the checkpoint's). Unset: a LoRA
    base on a GPU with bf16 is frozen in bf16 (half the memory; the adapter stays fp32, PEFT keeps it so, and a 4-bit
    base computes in bf16), anything else float32 master weights (bf16 autocast, where on, computes in bf16). A GPU
    without bf16 keeps fp32: an fp16 base would need loss scaling, which the loop does not do (docs/performance.md
    3.3)."""
    if name is None and lora and device == "cuda" and bf16:
        return torch.bfloat16
    return "auto" if name == "auto" else getattr(torch, name or "float32")


def reference_dtype(name: str | None, policy_dtype: torch.dtype, *, device: str = "cpu",
                    bf16: bool = False) -> torch.dtype:
    """The dtype the frozen reference model (full fine-tuning, beta > 0) loads in, given `dtype` (`name`) and the
    dtype the policy loaded in. With `dtype` given, the policy's (TRL loads both from the same model_init_kwargs).
    Unset, on a GPU with bf16: bf16, half the bytes of the fp32 master weights it would otherwise copy; it only runs
    forward, under the bf16 autocast the policy's forward runs in, so its products are bf16 either way (its norms and
    residual stream are bf16 instead of fp32, so the KL before the first update is small rather than exactly 0).
    Elsewhere the policy's, and the KL starts at exactly 0 (docs/performance.md 3.3)."""
    return torch.bfloat16 if name is None and device == "cuda" and bf16 else policy_dtype


def load_policy(
    model_path: str,
    *,
    dtype: torch.dtype | str = torch.float32,
    revision: str | None = None,
    use_peft: bool = False,
    lora_r: int = 16,
    lora_alpha: int = 32,
    lora_dropout: float = 0.0,
    lora_target_modules: list[str] | str | None = None,
    use_rslora: bool = False,
    load_in_4bit: bool = False,
    bnb_4bit_quant_type: str = "nf4",
    use_bnb_nested_quant: bool = True,
    gradient_checkpointing: bool = False,
    gradient_checkpointing_kwargs: dict | None = None,
    attn_implementation: str | None = None,
    device: torch.device | str = "cpu",
    trust_remote_code: bool = False,
    resolve: Callable[[str], str] | None = None,
) -> torch.nn.Module:
    """The trainable policy: full model, or a base with a fresh LoRA adapter (optionally on a 4-bit base).

    With `load_in_4bit` the base is quantised to NF4 by bitsandbytes (QLoRA, Dettmers et al. 2023) and frozen, its
    other weights (embeddings, norms, head) kept in `dtype`; LoRA is then required (a 4-bit base cannot be trained directly). A PEFT adapter folder (`final/` of
    a LoRA run) is loaded on its base and stays trainable; resolve(name), where given, turns the base's name into a
    folder or hub id (lib/models/embedded.resolve_model_path). The loaded model must pass `check_scoring_path`
    (ConfigError otherwise); code shipped with a hub model runs only with `trust_remote_code`.
    """
    # non-reentrant by default: reentrant checkpointing drops the gradient of inputs that need none (a frozen
    # embedding under LoRA) and, with it, every LoRA gradient inside the checkpointed blocks
    checkpointing_kwargs = {"use_reentrant": False, **(gradient_checkpointing_kwargs or {})}
    kwargs: dict = {"dtype": dtype, "trust_remote_code": trust_remote_code, "revision": revision}
    if load_in_4bit:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=bnb_4bit_quant_type,
            bnb_4bit_compute_dtype=torch.float32 if dtype == "auto" else dtype,
            bnb_4bit_use_double_quant=use_bnb_nested_quant,
        )
        kwargs["device_map"] = {"": device}
    adapter_path = None
    if is_adapter_folder(model_path):  # a LoRA run's final/ or checkpoint: its base, then the adapter on top
        from peft import PeftConfig

        adapter_path = model_path
        model_path = PeftConfig.from_pretrained(adapter_path).base_model_name_or_path
        model_path = resolve(model_path) if resolve else model_path
    config = transformers.AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code,
                                                     revision=revision)
    kwargs["attn_implementation"] = attn_implementation or default_attn_implementation(device, config)
    check_attn_implementation(kwargs["attn_implementation"], config)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, **kwargs)
    if load_in_4bit:
        # What peft's prepare_model_for_kbit_training does that training needs: the base frozen (the adapter is all
        # that trains), and below, input grads under gradient checkpointing. Not its upcast of the embeddings, head
        # and norms to fp32: 2.2 GB more weights at 7B and an fp32 residual stream (twice the kept activations);
        # they stay in the load dtype, as in TRL's GRPO path (docs/performance.md 3.3)
        model.requires_grad_(False)
        # bitsandbytes 0.50 repacks a 4-bit weight for its AVX512-BF16 CPU kernel at the first eval-mode forward
        # without grad (our sampling), and that kernel has no backward: every later training forward would drop
        # the gradient through the base layers. Keep the differentiable path.
        for module in model.modules():
            if hasattr(module, "support_avx512bf16_for_cpu"):
                module.support_avx512bf16_for_cpu = False
    else:
        model = model.to(device)
    check_scoring_path(model)  # after the 4-bit kernel choice above: its first no-grad forward would repack
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing_kwargs)
    if gradient_checkpointing and (use_peft or adapter_path):
        # with frozen embeddings the checkpointed blocks would see inputs without grad and drop the LoRA grads
        model.enable_input_require_grads()
    if adapter_path:
        from peft import PeftModel

        return PeftModel.from_pretrained(model, adapter_path, is_trainable=True)
    if use_peft:
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=lora_r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, use_rslora=use_rslora,
                            target_modules=_lora_targets(lora_target_modules), task_type="CAUSAL_LM")
        model = get_peft_model(model, config)
    return model


def _lora_targets(names: list[str] | str | None) -> list[str] | str:
    """PEFT's target_modules: the names given, or "all-linear" (every linear layer but the output head) when none are,
    or when TRL's spelling of it arrives as a one-item list from the command line or a YAML list."""
    if not names or names == "all-linear" or list(names) == ["all-linear"]:
        return "all-linear"
    return names


def load_reference(model_path: str, dtype: torch.dtype, device: torch.device | str = "cpu",
                   trust_remote_code: bool = False, revision: str | None = None,
                   attn_implementation: str | None = None) -> torch.nn.Module:
    """A frozen copy of the starting model (only for full fine-tuning with beta > 0; LoRA uses the base), with the
    policy's attention (`attn_implementation`, else `default_attn_implementation`)."""
    config = transformers.AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code,
                                                     revision=revision)
    attn_implementation = attn_implementation or default_attn_implementation(device, config)
    check_attn_implementation(attn_implementation, config)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype,
                                                              attn_implementation=attn_implementation,
                                                              trust_remote_code=trust_remote_code, revision=revision)
    model = model.to(device)
    return model.eval().requires_grad_(False)


REFERENCE_FOLDER = "reference"  # in a checkpoint-<step>/ folder: the reference once sync_ref_model has moved it


@torch.no_grad()
def mix_into_reference(reference: torch.nn.Module, policy: torch.nn.Module, alpha: float) -> None:
    """TR-DPO's soft reference update (Gorbatovski et al. 2024, arXiv 2404.09656, eq. 5; TRL's sync_ref_model):

        theta_ref <- alpha theta + (1 - alpha) theta_ref

    in place, parameter by parameter, in the reference's dtype. Both are the same architecture; their parameters are
    matched by name, so a model whose names differ is an error rather than a silent mismatch."""
    ref_params, params = dict(unwrap_causal_lm(reference).named_parameters()), dict(
        unwrap_causal_lm(policy).named_parameters())
    if ref_params.keys() != params.keys():
        raise ValueError(f"sync_ref_model: the reference's parameters differ from the policy's "
                         f"({sorted(ref_params.keys() ^ params.keys())[:3]}...)")
    for name, ref in ref_params.items():
        ref.mul_(1.0 - alpha).add_(params[name].to(ref.dtype), alpha=alpha)


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position ids for a left-padded batch: 0 at the first real token (pads get 0 too, they are masked)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def unwrap_causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The underlying *ForCausalLM module (through DDP and PEFT wrappers)."""
    model = getattr(model, "module", model)  # DistributedDataParallel
    if hasattr(model, "get_base_model"):  # peft.PeftModel
        model = model.get_base_model()
    return model


def adapter_disabled(model: torch.nn.Module):
    """Context in which a PEFT model computes as its base (the LoRA reference); a no-op context otherwise."""
    inner = getattr(model, "module", model)
    return inner.disable_adapter() if hasattr(inner, "disable_adapter") else nullcontext()


def logit_transform(config) -> tuple[float, float | None]:
    """(scale, cap): how a model's forward turns its output layer's values z into logits, read from its (text)
    config: logits = cap * tanh(scale * z / cap), or scale * z where there is no cap. The table (docs/models.md 2):
      - final_logit_softcapping c (Gemma-2, Gemma-3, Gemma-3n, VaultGemma, ...): c * tanh(z / c), the soft cap of
        the Gemma 2 report (Gemma Team 2024, section 2.2, "Logit soft-capping");
      - logits_scaling s: z / s (Granite family, MiniCPM3; muP's output multiplier, Yang et al. 2022), z * s in
        HyperCLOVA X; logit_scale (Cohere, Command R), lm_head_multiplier (Falcon-H1), output_multiplier (applied
        before the cap): z * s.
    `check_scoring_path` verifies the result against each model's own forward when it loads, so an architecture that
    does something else is refused rather than trained on the wrong distribution.
    """
    text = config.get_text_config()
    scale = 1.0
    logits_scaling = getattr(text, "logits_scaling", None)
    if logits_scaling is not None:
        scale = logits_scaling if text.model_type == "hyperclovax" else 1.0 / logits_scaling
    for name in ("logit_scale", "lm_head_multiplier", "output_multiplier"):
        if getattr(text, name, None) is not None:
            scale *= getattr(text, name)
    return float(scale), getattr(text, "final_logit_softcapping", None)


class OutputHead:
    """A causal LM's output layer followed by its logit post-processing (`logit_transform`): the logits its forward
    computes, at positions we choose (the scorer's completion tokens, the sampler's first token). Values in float32.
    `out_features`: the vocabulary size, for `lib.methods.losses.token_logps_and_entropy`'s chunking."""

    def __init__(self, lm: torch.nn.Module):
        self.head = lm.get_output_embeddings()
        self.scale, self.cap = logit_transform(lm.config)
        self.out_features = getattr(self.head, "out_features", None)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden).float()
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.cap:
            logits = torch.tanh(logits / self.cap) * self.cap
        return logits


@contextmanager
def attention_as(lm: torch.nn.Module, implementation: str):
    """`lm` attending with another of transformers' attention implementations within, its own again after; as it
    is where the model cannot switch (remote code outside transformers' attention interface)."""
    own = getattr(lm.config, "_attn_implementation", None)
    if own in (None, implementation) or not hasattr(lm, "set_attn_implementation") or \
            not lm._can_set_attn_implementation():
        yield
        return
    lm.set_attn_implementation(implementation)
    try:
        yield
    finally:
        lm.set_attn_implementation(own)


_CHECKED: set = set()


@torch.no_grad()
def check_scoring_path(model: torch.nn.Module) -> None:
    """Refuse (ConfigError naming the architecture) a causal LM whose own forward the package does not reproduce.

    The scorer and the sampler's first token run the decoder and `OutputHead` instead of the model's forward
    (docs/performance.md 2.1), the prompt prefix cached and shared. Here both are run on a tiny fixed input (two
    left-padded prompts of 5 tokens, 4 completion tokens each) and the per-token log-probs compared with log_softmax of
    the forward's logits: an architecture that post-processes its logits in a way `logit_transform` does not know, whose
    decoder is not what the head reads, or whose cache cannot be shared, fails here at load time (three forwards of 9
    tokens) instead of training on another distribution. The forward compared with runs with eager attention,
    transformers' reference implementation, so an attention implementation that computes something else (SDPA drops
    Gemma-2's attention soft cap) fails too, where the input shows it. Tolerance: 1e-3 of the log-probs' scale in
    float32 (a missed post-processing moved them by 0.16 to 0.5 nats on small random models, 38 to 47 with
    trained-size logits: docs/models.md 2), 3e-2 in lower precision.
    """
    lm = unwrap_causal_lm(model)
    name = type(lm).__name__
    device = next(lm.parameters()).device
    # what is checked is the code path, which the class, the config and the weights' dtype decide (not the weights'
    # values): once per process for each (a reference model, another checkpoint of the same model, pass at once)
    implementation = getattr(lm.config, "_attn_implementation", None)
    key = (type(lm), lm.config.to_json_string(use_diff=False), str(next(lm.parameters()).dtype), str(device),
           implementation)
    if key in _CHECKED:
        return
    vocab = lm.get_output_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (2, 5), generator=generator).to(device)
    completion = torch.randint(0, vocab, (2, 4), generator=generator).to(device)
    prompt_mask = torch.ones_like(prompt)
    prompt_mask[1, :2] = 0
    completion_mask = torch.ones_like(completion)
    ids, mask = torch.cat([prompt, completion], 1), torch.cat([prompt_mask, completion_mask], 1)
    was_training = lm.training
    lm.eval()

    def forward_logps(attention: str | None) -> torch.Tensor:  # the model's forward, with this attention
        with attention_as(lm, attention) if attention else nullcontext():
            logits = lm(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits
        return torch.log_softmax(logits[:, 4:-1].float(), -1).gather(-1, completion[..., None]).squeeze(-1)

    # a 4-bit base keeps its other weights in fp32 but computes its linear layers in its compute dtype
    precise = next(p for p in lm.parameters() if p.is_floating_point()).dtype == torch.float32 and all(
        getattr(m, "compute_dtype", None) in (None, torch.float32) for m in lm.modules()
        if type(m).__name__ == "Linear4bit")
    try:
        expected = forward_logps("eager")
        ours = [completion_logps(lm, prompt, prompt_mask, torch.arange(2, device=device), completion, completion_mask,
                                 torch.ones(2, device=device), share_prompt_prefix=shared, with_entropy=False)[0]
                for shared in (True, False)]
        gaps = [float((logp - expected).abs().max()) for logp in ours]
        limit = (1e-3 if precise else 3e-2) * max(1.0, float(expected.abs().max()))
        # refused, attending otherwise: is it the attention (the forward with its own agrees with ours)?
        own = forward_logps(None) if not max(gaps) <= limit and implementation not in (None, "eager") else None
    except Exception as error:  # noqa: BLE001  (any failure of our path on this architecture is a refusal)
        raise ConfigError(f"model_name_or_path: {name} cannot be scored by agrpo's log-prob path "
                          f"({type(error).__name__}: {error}); supported architectures: docs/models.md") from error
    finally:
        lm.train(was_training)
    if not max(gaps) <= limit:  # also refuses NaN
        if own is not None and max(float((logp - own).abs().max()) for logp in ours) <= limit:
            raise ConfigError(f"attn_implementation: {implementation} computes another model than {name}'s eager "
                              f"attention, transformers' reference (log-probs {max(gaps):.3g} nats apart on a test "
                              f"input, allowed {limit:.2g}): give attn_implementation: eager")
        raise ConfigError(f"model_name_or_path: {name} computes its logits in a way agrpo does not reproduce "
                          f"(log-probs {max(gaps):.3g} nats from the model's own forward on a test input, allowed "
                          f"{limit:.2g}), so it would train on another distribution than it samples from; supported "
                          f"architectures and how to add one: docs/models.md")
    _CHECKED.add(key)


def completion_logps(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    prompt_index: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperatures: torch.Tensor,
    *,
    share_prompt_prefix: bool = True,
    with_entropy: bool = True,
    entropy_grad: bool = False,
    entropy_at_unit_temperature: bool = False,
    fixed_calls: bool = False,
    checkpointed_prefix=None,
    _chunked: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropies) of the completion tokens under `model`, at the sampling temperature.

    prompt_ids, prompt_mask: (P, Lp) left-padded prompts; prompt_index: (B,) which prompt each completion continues;
    completion_ids, completion_mask: (B, T); temperatures: (B,) per completion or (B, T) per token (the temperature each
    token was sampled at). Returns logp (B, T) (0 at masked positions) and entropy (B, T) or None (entropy options:
    `lib.methods.losses.token_logps_and_entropy`).

    With `share_prompt_prefix`, each distinct prompt runs through the model once and its keys/values (with their
    autograd graph) are gathered for its completions: the result and its gradient are those of the full [prompt;
    completion] forward, at a fraction of the cost when G completions share a prompt. Logits are formed only at
    completion positions (the lm_head over a 49k vocabulary is a fifth of a small model's FLOPs). Under gradient
    checkpointing the prompt prefix is shared only through `checkpointed_prefix` (lib/models/checkpointed_prefix.py,
    docs/performance.md 3.6): both passes then run through the checkpointed blocks, which keep only their inputs;
    without it, or where it cannot be done (reentrant checkpointing, sliding-window or linear-attention layers), the
    full sequences are run instead.

    `fixed_calls` (a sharded model, docs/distributed.md 1): the decoder runs the same number of times whatever the data,
    because each call of a sharded layer is a collective that every process must make: no length chunks, and a
    completion pass even for one-token completions (on a padded, masked column that is cut off again).
    """
    batch, width = completion_ids.shape
    if fixed_calls and share_prompt_prefix and width < 2:
        logp, entropy = completion_logps(
            model, prompt_ids, prompt_mask, prompt_index, torch.nn.functional.pad(completion_ids, (0, 2 - width)),
            torch.nn.functional.pad(completion_mask, (0, 2 - width)),
            temperatures if temperatures.dim() == 1 else torch.nn.functional.pad(temperatures, (0, 2 - width),
                                                                                value=1.0),
            share_prompt_prefix=True, with_entropy=with_entropy, entropy_grad=entropy_grad,
            entropy_at_unit_temperature=entropy_at_unit_temperature, fixed_calls=True,
            checkpointed_prefix=checkpointed_prefix, _chunked=True)
        return logp[:, :width], entropy[:, :width] if entropy is not None else None
    chunks = []
    if batch > 1 and not _chunked and not fixed_calls:
        lengths = completion_mask.sum(1).tolist()
        # a chunk's fixed cost, in token positions: its prompts' prefill plus a little per call
        chunks = length_chunks(lengths, prompt_ids.shape[1] * int(torch.unique(prompt_index).numel()) + 16)
    if len(chunks) > 1:
        options = dict(share_prompt_prefix=share_prompt_prefix, with_entropy=with_entropy,
                       entropy_grad=entropy_grad, entropy_at_unit_temperature=entropy_at_unit_temperature,
                       checkpointed_prefix=checkpointed_prefix)
        # rows of similar length run together, each chunk padded to its own longest row: the same values and
        # gradients as one padded batch, without the positions past each row's end (a group's one long completion
        # would otherwise pad all the others to its length)
        parts, order = [], []
        for rows in chunks:
            index = torch.tensor(rows, device=completion_ids.device)
            w = max(1, max(lengths[r] for r in rows))
            t = temperatures[index] if temperatures.dim() == 1 else temperatures[index, :w]
            parts.append(completion_logps(model, prompt_ids, prompt_mask, prompt_index[index],
                                          completion_ids[index, :w], completion_mask[index, :w], t,
                                          **options, _chunked=True))
            order += rows
        inverse = torch.argsort(torch.tensor(order, device=completion_ids.device))

        def assemble(values: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat([torch.nn.functional.pad(v, (0, width - v.shape[1])) for v in values])[inverse]

        return assemble([p[0] for p in parts]), assemble([p[1] for p in parts]) if with_entropy else None
    lm = unwrap_causal_lm(model)
    decoder = lm.get_decoder()
    lm_head = OutputHead(lm)  # the output layer with the model's logit post-processing (soft cap, scaling)
    checkpointed = bool(getattr(lm, "is_gradient_checkpointing", False)) and lm.training
    # under checkpointing, plain layers that a block's recomputation can call again (lib/models/checkpointed_prefix.py)
    prompt_cache = checkpointed_prefix.prompt_cache(lm) if checkpointed and checkpointed_prefix is not None else None
    through_checkpoints = prompt_cache is not None
    if share_prompt_prefix and (not checkpointed or through_checkpoints):
        used, inverse = torch.unique(prompt_index, return_inverse=True)
        # the layer kinds of the model (sliding, linear attention)
        cache = prompt_cache if through_checkpoints else DynamicCache(config=lm.config)
        with checkpointed_prefix.keep_cache(lm) if through_checkpoints else nullcontext():
            prompt_out = decoder(input_ids=prompt_ids[used], attention_mask=prompt_mask[used],
                                 position_ids=positions_from_mask(prompt_mask[used]), past_key_values=cache,
                                 use_cache=not through_checkpoints)  # (a checkpointed block warns at use_cache)
            if through_checkpoints:
                cache = checkpointed_prefix.completion_cache(cache, inverse)
            else:
                cache.reorder_cache(inverse)  # every layer kind: keys and values, linear-attention states
            first_hidden = prompt_out.last_hidden_state[:, -1][inverse]  # (B, H): predicts completion token 0
            hidden = first_hidden[:, None]
            if width > 1:
                mask = torch.cat([prompt_mask[used][inverse], completion_mask[:, :-1]], dim=1)
                start = prompt_mask[used].long().sum(-1)[inverse]
                positions = start[:, None] + torch.arange(width - 1, device=start.device)[None, :]
                rest = decoder(input_ids=completion_ids[:, :-1], attention_mask=mask, position_ids=positions,
                               past_key_values=cache, use_cache=not through_checkpoints).last_hidden_state
                hidden = torch.cat([hidden, rest], dim=1)  # (B, T, H)
    else:
        ids = torch.cat([prompt_ids[prompt_index], completion_ids], dim=1)
        mask = torch.cat([prompt_mask[prompt_index], completion_mask], dim=1)
        out = decoder(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask), use_cache=False)
        lp = prompt_ids.shape[1]
        hidden = out.last_hidden_state[:, lp - 1 : lp - 1 + width]

    # only real completion tokens go through the vocabulary projection
    keep = completion_mask.bool()
    temps = temperatures[:, None].expand(batch, width) if temperatures.dim() == 1 else temperatures[:, :width]
    logp_flat, entropy_flat = token_logps_and_entropy(hidden[keep], lm_head, completion_ids[keep], temps[keep],
                                                      with_entropy=with_entropy, entropy_grad=entropy_grad,
                                                      entropy_at_unit_temperature=entropy_at_unit_temperature)
    logp = torch.zeros(batch, width, dtype=torch.float32, device=completion_ids.device)
    logp = logp.masked_scatter(keep, logp_flat)
    entropy = None
    if with_entropy:
        entropy = torch.zeros(batch, width, dtype=torch.float32, device=completion_ids.device)
        entropy = entropy.masked_scatter(keep, entropy_flat)
    return logp, entropy


def length_chunks(lengths: list[int], overhead: int = 64) -> list[list[int]]:
    """Split rows into groups that are each padded to their own longest row, with the least work.

    Cost of a group: rows x its longest length (the token positions computed) + `overhead` (a forward call's fixed cost
    and its prompts' prefill, in token positions). Rows sorted by length, an optimal split into contiguous runs is a
    small dynamic programme over the sorted order (O(B^2)). Returns row indices per group, shortest group first; a
    single group when splitting does not pay.
    """
    order = sorted(range(len(lengths)), key=lambda r: lengths[r])
    sorted_lengths = [lengths[r] for r in order]
    n = len(order)
    best = [0.0] + [math.inf] * n  # best[j]: least cost of the first j sorted rows
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):  # the last group is sorted rows i..j-1, padded to sorted_lengths[j - 1]
            cost = best[i] + (j - i) * sorted_lengths[j - 1] + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], n
    while j > 0:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]


class CompletionScorer(torch.nn.Module):
    """`completion_logps` as a module, so that Accelerate can wrap it (DDP, FSDP): gradient synchronisation hooks into a
    module's forward, and our forward is not the causal LM's own (it runs the decoder on shared prompt prefixes and
    projects only completion positions)."""

    def __init__(self, model: torch.nn.Module, share_prompt_prefix: bool = True, fixed_calls: bool = False,
                 checkpointed_prefix=None):
        super().__init__()
        self.model = model
        self.share_prompt_prefix = share_prompt_prefix
        self.fixed_calls = fixed_calls  # sharded: the same decoder calls on every process (completion_logps)
        self.checkpointed_prefix = checkpointed_prefix  # lib/models/checkpointed_prefix, or None (completion_logps)
        # the decoder layer classes, which FSDP's transformer-based wrapping makes units of (it reads this name)
        self._no_split_modules = getattr(unwrap_causal_lm(model), "_no_split_modules", None)

    def forward(self, prompt_ids, prompt_mask, prompt_index, completion_ids, completion_mask, temperatures,
                with_entropy: bool = True, entropy_grad: bool = False, entropy_at_unit_temperature: bool = False):
        return completion_logps(self.model, prompt_ids, prompt_mask, prompt_index, completion_ids, completion_mask,
                                temperatures, share_prompt_prefix=self.share_prompt_prefix,
                                with_entropy=with_entropy, entropy_grad=entropy_grad,
                                entropy_at_unit_temperature=entropy_at_unit_temperature, fixed_calls=self.fixed_calls,
                                checkpointed_prefix=self.checkpointed_prefix)


def native_bf16(device: torch.device | str, capability: tuple[int, int] | None = None) -> bool:
    """Whether bf16 matmuls run natively here: an NVIDIA GPU of compute capability 8.0 or above (Ampere on), or a CPU
    with AVX512-BF16 / AMX-BF16. `torch.cuda.is_bf16_supported()` also says yes for a T4 or V100 (7.x), where bf16 is
    emulated: slow, and a vLLM engine refuses bfloat16 there. `capability` (major, minor) overrides the device's, for
    tests and estimates."""
    device = torch.device(device)
    if device.type == "cuda":
        if capability is None:
            if not torch.cuda.is_available():
                return False
            capability = torch.cuda.get_device_capability(device)
        return tuple(capability) >= (8, 0)
    if device.type == "cpu":
        try:
            flags = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
        return "avx512_bf16" in flags or "amx_bf16" in flags
    return False


# compute capabilities of the cards an estimate can be made for (estimate_gpu), from NVIDIA's CUDA GPUs table
GPU_CAPABILITIES = {"v100": (7, 0), "t4": (7, 5), "a100": (8, 0), "a10": (8, 6), "rtx3090": (8, 6), "l4": (8, 9),
                    "rtx4090": (8, 9), "h100": (9, 0), "h200": (9, 0)}


def card_capability(name: str) -> tuple[int, int]:
    """(major, minor) for a card's name (GPU_CAPABILITIES, any case) or a capability written "7.5". ValueError
    naming the choices otherwise."""
    key = name.strip().lower().replace(" ", "").replace("-", "")
    if key in GPU_CAPABILITIES:
        return GPU_CAPABILITIES[key]
    try:
        major, minor = (int(x) for x in key.split("."))
        return major, minor
    except ValueError:
        raise ValueError(f"{name!r} is neither a card ({', '.join(GPU_CAPABILITIES)}) nor a compute capability such "
                         f"as 7.5") from None


def training_precision(device: torch.device | str, capability: tuple[int, int] | None = None, *,
                       bf16: bool | None = None, fp16: bool | None = None) -> str:
    """The training pass's precision: "bf16" (bf16 autocast), "fp16" (fp16 autocast with loss scaling) or "fp32",
    always over fp32 master weights; `bf16` / `fp16` as given by the configuration win (None: chosen here).
    Unset: bf16 where it runs natively (`native_bf16`: compute capability 8.0 on, CPUs with AVX512-BF16 / AMX); on a
    CUDA card below 8.0 (T4 7.5, V100 7.0), where bf16 is emulated and vLLM refuses it, fp16, whose 5-bit exponent
    needs the loss scaled so that small gradients do not flush to zero (Micikevicius et al. 2018, "Mixed precision
    training", section 3.2); a CPU without bf16: fp32 (docs/performance.md 3.3)."""
    if bf16 and fp16:
        raise ValueError("bf16 and fp16 are both true: choose one (or leave both unset to choose from the card)")
    if bf16 or fp16:
        return "bf16" if bf16 else "fp16"
    native = native_bf16(device, capability)
    if bf16 is None and native:
        return "bf16"
    cuda = torch.device(device).type == "cuda" and (capability is not None or torch.cuda.is_available())
    return "fp16" if cuda and fp16 is None and not native else "fp32"


def pad_cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """Stack (b_i, T_i) blocks into (sum b_i, max T_i), zero-padded on the right."""
    width = max(p.shape[1] for p in parts)
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])
