"""Rollout backends: turn prompts into groups of sampled completions.

A backend has one job and a small interface, so the trainer, the evaluator and the adaptive methods never care which
engine samples:

    backend.generate(prompt_ids, prompt_mask, num_generations, max_new_tokens, temperature, top_p, top_k, greedy,
                     answer_phase) -> Rollout
    backend.sync_weights(policy)     # before sampling, when optimizer steps moved the weights (lib/setup.ready_sampler)

Sampling parameters are arguments, per call and per prompt (temperature and top_p may be (P,) tensors), so controllers
that change them (adaptive temperature, resampling rounds) never reach into the backend. An `AnswerPhase` switches a
sequence to other sampling parameters once it has written the answer marker (adaGRPO's think/answer sampler). The
temperature every token was sampled at is returned, for the training log-probs.

`HFRollout` runs the model's own forward in a decode loop of ours rather than `model.generate`: one prefill per
prompt, shared by its group; one inverse-CDF draw per row; finished rows leave the batch (why: docs/performance.md 2.1).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from transformers.cache_utils import DynamicCache

from lib.models.modeling import OutputHead, positions_from_mask, unwrap_causal_lm


@dataclass
class Rollout:
    """One generation batch: P prompts and B completions (a prompt's completions are contiguous).

    prompt_ids, prompt_mask: (P, Lp), left-padded. prompt_index: (B,) the prompt row each completion continues.
    completion_ids: (B, T), padded with `pad_token_id` after the end; completion_mask: (B, T), 1 up to and including the
    first end-of-sequence token. is_truncated: (B,) True where no end token came within max_new_tokens. temperatures:
    (B, T) the temperature each token was sampled at (0 for greedy). sampling_logps: (B, T) the sampling engine's own
    log-probability of each sampled token, from the distribution it actually sampled from (temperature, top_p and top_k
    applied), or None when the engine is the policy itself (HF, unless its copy runs behind: max_staleness > 0): the
    trainer's truncated importance sampling compares it with the training log-probs.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    is_truncated: torch.Tensor
    temperatures: torch.Tensor
    prompt_index: torch.Tensor
    sampling_logps: torch.Tensor | None = None
    sequence_mask: torch.Tensor | None = None  # (B, T) every token the policy reads, where that is more than the
    # model's own tokens in completion_mask: an agent's episode holds tool results (lib/agents/episodes.py)
    columns: dict[str, list] | None = None  # values per completion that the sampler adds to the reward functions'
    # keyword arguments (an environment's get_reward: lib/agents/episodes.py)
    token_versions: torch.Tensor | None = None  # (B, T) int64 the optimizer step whose weights drew each token, where
    # weights reach the sampler in the middle of a batch (vllm_inflight_updates: lib/sampling/inflight.py); else None

    def attended(self) -> torch.Tensor:
        """(B, T) the completion tokens a forward pass reads: all of an episode's, tool results included."""
        return self.completion_mask if self.sequence_mask is None else self.sequence_mask


@dataclass(frozen=True)
class AnswerPhase:
    """Sampling parameters for the answer part of a completion (adaGRPO's intent, docs/methods.md 4.3 [RECON]).

    A sequence samples with the call's parameters until its last tokens equal one of `marker_ids` (the marker's token
    ids; several variants, since "Answer:" after a space or a newline tokenises differently), and with `temperature` /
    `top_p` from the next token on. The switch is per sequence and sticky. `marker` is the text itself, for engines that
    stop on text rather than token ids (vLLM).
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
    """`batch` with its completions at `rows` (b,) replaced by the b completions of `new`, in order (a resampled group
    replaces the old one). The width becomes that of the longest completion kept."""
    width = max(batch.completion_ids.shape[1], new.completion_ids.shape[1])

    def merged(old: torch.Tensor, replacement: torch.Tensor, fill) -> torch.Tensor:
        """`old` widened with `fill`, its `rows` replaced by `replacement` (widened alike)."""
        out = torch.nn.functional.pad(old, (0, width - old.shape[1]), value=fill).clone()
        out[rows] = torch.nn.functional.pad(replacement, (0, width - replacement.shape[1]), value=fill)
        return out

    ids = merged(batch.completion_ids, new.completion_ids, pad_token_id)
    mask = merged(batch.completion_mask, new.completion_mask, 0)
    temps = merged(batch.temperatures, new.temperatures, 0.0)
    truncated = batch.is_truncated.clone()
    truncated[rows] = new.is_truncated
    sequence = None
    if batch.sequence_mask is not None or new.sequence_mask is not None:  # agents' episodes: model tokens have gaps
        sequence = merged(batch.attended(), new.attended(), 0)
    used = int((mask if sequence is None else sequence).sum(1).max()) if mask.numel() else 0
    # per-token values a sampler adds (both sides have them or the result has none): its log-probs, weight versions
    logps = None if batch.sampling_logps is None or new.sampling_logps is None else \
        merged(batch.sampling_logps, new.sampling_logps, 0.0)[:, :used]
    versions = None if batch.token_versions is None or new.token_versions is None else \
        merged(batch.token_versions, new.token_versions, -1)[:, :used]
    columns = None
    if batch.columns or new.columns:
        columns = {}
        for key in {**(batch.columns or {}), **(new.columns or {})}:
            column = list((batch.columns or {}).get(key, [None] * len(truncated)))
            for row, value in zip(rows.tolist(), (new.columns or {}).get(key, [None] * len(rows))):
                column[row] = value
            columns[key] = column
    return replace(batch, completion_ids=ids[:, :used], completion_mask=mask[:, :used], temperatures=temps[:, :used],
                   is_truncated=truncated, sampling_logps=logps, token_versions=versions,
                   sequence_mask=None if sequence is None else sequence[:, :used], columns=columns)

def penalize_repetitions(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """The repetition penalty of CTRL (Keskar et al. 2019, section 4.1, "penalized sampling"): the logit of each token
    already in the prompt or the completion (`seen`, (B, V) bool) is divided by the penalty theta. A negative logit is
    multiplied by theta instead, as transformers' RepetitionPenaltyLogitsProcessor and vLLM do, so that theta > 1 lowers
    a seen token's probability whatever its sign. Applied to the model's logits, before the temperature."""
    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


def sampling_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: float | torch.Tensor = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    normalize: bool = True,
) -> torch.Tensor:
    """The distribution a token is drawn from, (B, V): logits (B, V) float; temperature (B,) (rows with 0 are computed
    at temperature 1, the caller takes their argmax); top_p a float or (B,) per row.

    In vLLM's order (docs/models.md 3), so that both backends sample the same distribution: temperature, then min-p
    (Nguyen et al. 2024: drop tokens below min_p x the top token's probability), top-k, and top-p (nucleus, Holtzman et
    al. 2020: the smallest prefix, by probability, whose mass reaches top_p, over what min-p and top-k kept; the top
    token is always kept). Min-p and top-k commute (each keeps a prefix of the sorted tokens), so top-k goes first here,
    where it is cheaper. `normalize` False leaves the kept mass unnormalised (the sampler's draw scales by it).
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
    any_greedy: bool | None = None,
    with_logp: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row from `sampling_probs` (logits: (B, V) float, a repetition penalty already applied;
    temperature: (B,), rows with 0 are greedy). Returns (B,). `all_greedy`, `any_greedy`: whether every row, or
    some row, is greedy, where the caller knows it (asking the tensor is a host sync, per token on a GPU; with no
    greedy row the argmax over the vocabulary is skipped, a third of the draw's time on a CPU at 8 rows).

    The draw is inverse-CDF with one uniform per row: cumsum of the probabilities, count entries below u.
    `with_logp`: also (B,) the log-probability of each drawn token under the distribution it was drawn from (a
    greedy row's under the unscaled softmax), as vLLM reports its sampling log-probs.
    """
    greedy = temperature <= 0
    if all_greedy if all_greedy is not None else bool(greedy.all()):
        token = logits.argmax(-1)
        return (token, _greedy_logp(logits, token)) if with_logp else token
    probs = sampling_probs(logits, temperature, top_p, top_k, min_p, normalize=False)
    cdf = probs.cumsum(-1)
    u = torch.rand(cdf.shape[0], 1, generator=generator, device=cdf.device) * cdf[:, -1:]
    sampled = torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp(max=cdf.shape[-1] - 1)
    token = sampled if any_greedy is False else torch.where(greedy, logits.argmax(-1), sampled)
    if not with_logp:
        return token
    logp = (probs.gather(1, sampled[:, None]) / cdf[:, -1:]).squeeze(1).log()
    return token, logp if any_greedy is False else torch.where(greedy, _greedy_logp(logits, token), logp)


def _greedy_logp(logits: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), -1).gather(1, token[:, None]).squeeze(1)


def prefill(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor):
    """Run left-padded prompts (P, L) through the model once: (the logits of each prompt's next token (P, V) in float32,
    as the model's forward computes them, and the KV cache). The output layer is applied to a contiguous (P, H) slice
    only: on a CPU, a bf16 linear on a strided 3-D slice expands the [V x H] weight per row (13 s for 100 prompts,
    measured); `OutputHead` adds the model's logit post-processing (soft cap, scaling)."""
    lm = unwrap_causal_lm(model)
    out = lm.get_decoder()(input_ids=prompt_ids, attention_mask=prompt_mask,
                           position_ids=positions_from_mask(prompt_mask),
                           past_key_values=DynamicCache(config=lm.config), use_cache=True)
    return OutputHead(lm)(out.last_hidden_state[:, -1].contiguous()), out.past_key_values


class ModelStep:
    """The sampler's decode step: the model's forward, one token a row, over a transformers cache; `attention` is the
    (B, L) mask so far. `keep(rows)` keeps the live rows; `step(tokens, positions)` gives (B, V) float32 logits."""

    def __init__(self, model: torch.nn.Module, cache: DynamicCache, attention: torch.Tensor):
        self.model, self.cache, self.attention = model, cache, attention

    def keep(self, rows: torch.Tensor) -> None:
        self.cache.reorder_cache(rows)
        self.attention = self.attention[rows]

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.attention = torch.cat([self.attention, torch.ones_like(self.attention[:, :1])], dim=1)
        out = self.model(input_ids=tokens[:, None], attention_mask=self.attention, position_ids=positions[:, None],
                         past_key_values=self.cache, use_cache=True)
        return out.logits[:, -1].float()


class HFRollout:
    """Sample with a Hugging Face causal LM and a shared-prefix KV cache.

    `copy(policy, bf16)`, where given, may return a plain copy of the policy's weights to sample with where that is
    faster (lib/sampling/policy_copy.SamplingCopy: its `model`, its `decode_step` or None, and `sync(policy)`, called
    by `sync_weights` before sampling once the weights moved), or a decode step over the policy itself (its `model` None:
    lib/sampling/policy_copy.DirectDecode); None, or no hook: the policy itself, under bf16 autocast with `bf16`,
    decoded with its own forward (`ModelStep`). A `decode_step(model, cache, attention, max_new_tokens)` has
    `ModelStep`'s interface (lib/sampling/decode.LlamaStep); setting `decode_step = None` forces `ModelStep`, for
    comparisons.
    """

    def __init__(self, policy: torch.nn.Module, eos_token_ids: list[int], pad_token_id: int,
                 bf16: bool = False, seed: int = 0, copy=None):
        self.eos_token_ids = torch.tensor(sorted(set(eos_token_ids)))
        self.pad_token_id = pad_token_id
        self.policy = policy
        self.bf16 = bf16
        self.sampling_copy = copy(policy, bf16) if copy is not None else None
        self.decode_step = None if self.sampling_copy is None else self.sampling_copy.decode_step
        self.generator = torch.Generator(device=next(policy.parameters()).device).manual_seed(seed)
        # record each token's sampling log-probability (Rollout.sampling_logps): where the copy may hold older
        # weights than the policy trains (max_staleness > 0), for the trainer's importance weights
        self.record_logps = False

    def autocast(self):
        """bf16 autocast when sampling with the policy itself (no copy: PEFT unmerged, quantised) and bf16 is on."""
        device_type = next(self.model.parameters()).device.type
        return torch.autocast(device_type, dtype=torch.bfloat16, enabled=self.bf16 and self.copy is None)

    @property
    def copy(self) -> torch.nn.Module | None:
        """The copy's model, or None: sampling with the policy itself."""
        return None if self.sampling_copy is None else self.sampling_copy.model

    @property
    def model(self) -> torch.nn.Module:
        return self.copy if self.copy is not None else self.policy

    def sync_weights(self, policy: torch.nn.Module) -> None:
        """Copy the policy's current weights into the sampling copy (no-op when sampling with the policy)."""
        if self.sampling_copy is not None:
            self.sampling_copy.sync(policy)

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
        """Sample completions for P prompts: `num_generations` each (an int, or a (P,) tensor of counts, for a process
        that holds part of a group). temperature, top_p: floats or (P,) tensors. answer_phase: switch each sequence to
        the phase's parameters after its answer marker (ignored when greedy). min_p, top_k, top_p: `sampling_probs`;
        repetition_penalty: `penalize_repetitions` over each row's prompt and completion so far (greedy rows too, as in
        transformers and vLLM)."""
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
        any_greedy = bool((temps <= 0).any()) or (phase is not None and phase.temperature <= 0)
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
            if self.decode_step is not None:
                decoder = self.decode_step(model, cache, attention, max_new_tokens)
            else:
                decoder = ModelStep(model, cache, attention)
            next_pos = prompt_mask.long().sum(-1)[prompt_index]

            eos = self.eos_token_ids.to(device)
            tokens = torch.full((batch, max_new_tokens), self.pad_token_id, dtype=torch.long, device=device)
            token_temps = torch.zeros(batch, max_new_tokens, dtype=torch.float32, device=device)
            logps = torch.zeros(batch, max_new_tokens, dtype=torch.float32, device=device) if self.record_logps \
                else None
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
                drawn = sample_next_token(logits, step_temps, step_top_p, top_k, self.generator, min_p, all_greedy,
                                          any_greedy, with_logp=self.record_logps)
                token = drawn[0] if self.record_logps else drawn
                if self.record_logps:
                    logps[live, step] = drawn[1]
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
                    decoder.keep(keep)
                    live, token, next_pos = live[keep], token[keep], next_pos[keep]
                    live_temps = live_temps[keep]
                    live_nucleus = live_nucleus if plain_nucleus else live_nucleus[keep]
                logits = decoder.step(token, next_pos)
                next_pos = next_pos + 1
        if was_training:
            model.train()

        width = int(lengths.max())
        completion_mask = (torch.arange(width, device=device)[None, :] < lengths[:, None]).long()
        return Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=tokens[:, :width],
                       completion_mask=completion_mask, is_truncated=~finished,
                       temperatures=token_temps[:, :width] * completion_mask,
                       prompt_index=prompt_index,
                       sampling_logps=None if logps is None else logps[:, :width] * completion_mask)
