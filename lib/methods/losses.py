"""Pure tensor math for GRPO: advantages, importance ratios, the clipped surrogate, KL estimators, aggregation.

Everything here takes tensors and returns tensors (plus a dict of detached statistics). No model forward, no
Accelerator, no globals, no `.item()`: the training loop reduces and logs. Shapes use B = completions in the
(micro-)batch, T = completion tokens (padded), V = vocabulary, G = group size (`num_generations`).
Formulas: docs/methods.md section 1 (DeepSeekMath GRPO, TRL's implementation, DAPO, Dr. GRPO, GSPO, CISPO).
`policy_objective` assembles the per-token loss from them: the surrogate, its masks and weights, KL, entropy.

The choices a configuration offers are the keys of the registries here: `LOSS_TYPES` (the per-token policy loss and
how it is averaged), `KL_ESTIMATORS`, `SCALE_REWARDS`, plus `DISPERSIONS` and `IMPORTANCE_SAMPLING_LEVELS`;
lib/settings.py reads its choices from them, and `check_settings` refuses the keys a loss type would not read
(lib/config.py calls it). Adding a loss: docs/methods.md 11.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

DISPERSIONS = ("std", "mad", "iqr")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
# vllm_importance_sampling_mode (TRL 1.16's values): granularity x what happens outside [C_min, C_max]
IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")

# scale_rewards (TRL's key) -> the advantages from the centred rewards r - mean_g, their two scaled forms and the mix
# weight (docs/methods.md 6.2; `group_advantages` says which paper each comes from)
SCALE_REWARDS: dict[str, Callable] = {
    "group": lambda centred, by_group, by_batch, w: by_group,
    "batch": lambda centred, by_group, by_batch, w: by_batch,
    "mix": lambda centred, by_group, by_batch, w: w * by_group + (1.0 - w) * by_batch,
    "none": lambda centred, by_group, by_batch, w: centred,
}

# TRL (and adaGRPO, which inherits it) divide by std + 1e-4; docs/methods.md 1.1 picks that for parity with TRL.
STD_EPS = 1e-4

# multi_objective_aggregation (TRL's key): how several reward functions make one advantage (`group_advantages`)
MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


def dispersion(values: torch.Tensor, kind: str = "std", dim: int = -1, fallback_to_std: bool = True) -> torch.Tensor:
    """Spread of `values` along `dim` (NaN entries ignored, so ragged pools can be padded with NaN).

    std: unbiased (Bessel) standard deviation, as torch.std and TRL; 0 for fewer than two values.
    mad: 1.4826 * median |r - median r|   (the factor makes it equal the std for normal data)
    iqr: (q75 - q25) / 1.349              (same reason)
    The robust two come from AGPO-DSF (`agpo_use_robust_dispersion`, docs/methods.md 5.1). A robust spread is 0 for a
    group with one outlier (MAD of [1, 0, 0, 0] is 0), which would silence exactly the rare correct answer; like the
    AGPO-DSF code, such a group falls back to the std when the spread scales advantages (`fallback_to_std`). The
    same code measures its probe groups' spread without the fall-back (docs/methods.md 5.1, step 1).
    """
    if kind not in DISPERSIONS:
        raise ValueError(f"dispersion must be one of {DISPERSIONS}, got {kind!r}")
    count = (~torch.isnan(values)).sum(dim)
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    std = torch.sqrt(torch.nansum((values - mean) ** 2, dim=dim) / (count - 1).clamp(min=1))
    std = torch.where(count > 1, std, torch.zeros_like(std))
    if kind == "std":
        return std
    if kind == "mad":
        median = torch.nanmedian(values, dim=dim, keepdim=True).values
        robust = 1.4826 * torch.nanmedian((values - median).abs(), dim=dim).values
    else:
        q = torch.nanquantile(values, torch.tensor([0.25, 0.75], dtype=values.dtype, device=values.device), dim=dim)
        robust = (q[1] - q[0]) / 1.349
    return torch.where(robust > 1e-8, robust, std) if fallback_to_std else robust


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    scale_rewards: str = "group",
    *,
    dispersion_kind: str = "std",
    mix_weight: float = 0.5,
    pooled: torch.Tensor | None = None,
    correct: torch.Tensor | None = None,
    homogeneous_value: float = 0.0,
    aggregation: str = "sum_then_normalize",
    per_function: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Group-relative advantages, every rule of docs/methods.md 6.2's advantage row in one function.

    rewards: (N,) with N a multiple of `group_size`, the completions of one prompt contiguous.
    Returns advantages (N,) and stats: `reward_std` (mean of the per-group spread, TRL's key) and
    `frac_reward_zero_std` (share of groups whose rewards are all equal: they carry no learning signal).

    scale_rewards (TRL's key):
      group: (r - mean_g) / (spread_g + 1e-4)                         DeepSeekMath outcome supervision
      batch: (r - mean_g) / (spread over all N + 1e-4)                 Lite-PPO; A-GRPO's "weighted & global"
      mix:   w * group + (1 - w) * batch, w = mix_weight               A-GRPO option (docs/methods.md 2.2 [RECON])
      none:  r - mean_g                                                Dr. GRPO
    spread = `dispersion(kind=dispersion_kind)`: std (default), or the robust MAD / IQR of AGPO-DSF.
    pooled: (P, M) rewards of every sampling round of each prompt, NaN-padded (adaGRPO, docs/methods.md 4.1): the
      group mean and spread come from all rounds, so a rare correct answer after failed rounds gets a large
      advantage. None = the group itself.
    correct: (N,) bool and homogeneous_value > 0: AGPO (arXiv 2503.15952 v1, docs/methods.md 3.2 (a) [RECON]): a
      group that is all correct gets +homogeneous_value, all wrong -homogeneous_value, instead of 0. Homogeneity is
      judged on correctness, not on the total reward (a length term makes every group look mixed).
    aggregation: sum_then_normalize (the rules above, on `rewards`, the weighted sum) or normalize_then_sum (GDPO:
      `normalize_then_sum` on `per_function` (N, K) and `weights` (K,), in place of the scale_rewards rule; AGPO's
      homogeneous values still apply after it). The stats are those of `rewards` either way.
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.view(-1, group_size)
    stats_source = grouped if pooled is None else pooled
    if stats_source.shape[0] != grouped.shape[0]:
        raise ValueError(f"pooled has {stats_source.shape[0]} rows for {grouped.shape[0]} groups")
    mean_g = torch.nanmean(stats_source, dim=1, keepdim=True)
    spread_g = dispersion(stats_source, dispersion_kind, dim=1).unsqueeze(1)
    centred = grouped - mean_g
    by_group = centred / (spread_g + STD_EPS)
    by_batch = centred / (dispersion(rewards, dispersion_kind) + STD_EPS)
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {tuple(SCALE_REWARDS)}, got {scale_rewards!r}")
    advantages = SCALE_REWARDS[scale_rewards](centred, by_group, by_batch, mix_weight)
    if aggregation == "normalize_then_sum":
        if per_function is None or weights is None or pooled is not None:
            raise ValueError("normalize_then_sum needs per_function and weights, and takes no pooled statistics")
        advantages = normalize_then_sum(per_function, weights, group_size, dispersion_kind).view_as(grouped)
    elif aggregation != "sum_then_normalize":
        raise ValueError(f"aggregation must be one of {MULTI_OBJECTIVE_AGGREGATIONS}, got {aggregation!r}")
    if homogeneous_value > 0:
        if correct is None:
            raise ValueError("homogeneous_value needs `correct`, the per-completion correctness")
        right = correct.view(-1, group_size).bool()
        fill = torch.zeros_like(advantages)
        fill = torch.where(right.all(1, keepdim=True), homogeneous_value, fill)
        fill = torch.where((~right).all(1, keepdim=True), -homogeneous_value, fill)
        homogeneous = right.all(1, keepdim=True) | (~right).all(1, keepdim=True)
        advantages = torch.where(homogeneous, fill, advantages)
    own_spread = dispersion(grouped, "std", dim=1)
    stats = {
        "reward_std": own_spread.mean(),
        "frac_reward_zero_std": (own_spread < 1e-6).float().mean(),
    }
    return advantages.reshape(-1), stats


def normalize_then_sum(rewards: torch.Tensor, weights: torch.Tensor, group_size: int,
                       dispersion_kind: str = "std") -> torch.Tensor:
    """GDPO's decoupled normalisation (Liu et al. 2026, "GDPO: Group reward-Decoupled Normalization Policy
    Optimization for Multi-reward RL Optimization", arXiv 2601.05242; TRL 1.16's multi_objective_aggregation
    "normalize_then_sum"; docs/methods.md 13.1). rewards: (N, K), one column per reward function, NaN where a function
    does not apply; weights: (K,). Returns the advantages (N,):

        a_ik = (r_ik - mean_g r_k) / (spread_g r_k + 1e-4)     each function within its group (NaN entries skipped)
        s_i  = sum_k w_k a_ik                                    (a NaN a_ik adds nothing)
        A_i  = (s_i - mean_batch s) / (std_batch s + 1e-4)       over the N completions

    Summing the raw rewards first lets a function with a wide range drown the others, and distinct reward
    combinations collapse to the same advantage; normalising each one first keeps them apart (GDPO, section 3).
    A completion that every function skipped gets A = 0 and stays out of the batch mean and std, as in TRL. The
    spread is `dispersion(kind)` (the std, as TRL, by default; a group with fewer than two values has spread 0 here
    and NaN in TRL, which adds the same nothing to s).
    """
    n, k = rewards.shape
    if n % group_size:
        raise ValueError(f"{n} rewards do not split into groups of {group_size}")
    grouped = rewards.view(-1, group_size, k)
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    spread_k = dispersion(grouped, dispersion_kind, dim=1).unsqueeze(1)
    normalised = ((grouped - mean_k) / (spread_k + STD_EPS)).view(n, k)
    summed = torch.nansum(normalised * weights.to(normalised), dim=1)
    scorable = ~torch.isnan(rewards).all(dim=1)
    kept = torch.where(scorable, summed, torch.nan)
    advantages = (summed - torch.nanmean(kept)) / (dispersion(kept, "std") + STD_EPS)
    return torch.where(scorable, advantages, torch.zeros_like(advantages))


def weighted_rewards(rewards: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """r = sum_k w_k r_k per completion of (B, K) rewards; NaN (a function's "not applicable") is skipped, as TRL's
    nansum, and a completion that every function skipped gets 0. Returns (B,)."""
    total = torch.nansum(rewards * weights, dim=1)
    return torch.where(torch.isnan(rewards).all(dim=1), torch.zeros_like(total), total)


def group_skewness(values: torch.Tensor, max_abs: float = 10.0) -> torch.Tensor:
    """Adjusted Fisher-Pearson sample skewness per row of (P, G) values (AGPO-DSF `_skewness`, docs/methods.md 5.1).

    g = mean(((r - mean) / s)^3) with s the Bessel std; times sqrt(n(n-1))/(n-2) when n > 2; 0 when s < 1e-6;
    clamped to +-max_abs (a single outlier in a group of 8 would otherwise dominate the clip rule). Returns (P,).
    """
    n = values.shape[1]
    s = dispersion(values, "std", dim=1)
    z = (values - values.mean(1, keepdim=True)) / s.clamp(min=1e-6)[:, None]
    g = (z**3).mean(1)
    if n > 2:
        g = g * (n * (n - 1)) ** 0.5 / (n - 2)
    return torch.where(s < 1e-6, torch.zeros_like(g), g).clamp(-max_abs, max_abs)


def token_logps_and_entropy(
    hidden: torch.Tensor,
    lm_head: Callable[[torch.Tensor], torch.Tensor],
    token_ids: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    chunk_elements: int = 2**26,
    with_entropy: bool = True,
    entropy_grad: bool = False,
    entropy_at_unit_temperature: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities of `token_ids` under softmax(lm_head(hidden) / temperature), one chunk of rows at a time.

    hidden: (N, H) final hidden states at the positions that predict `token_ids` (N,); lm_head: (n, H) -> (n, V),
    the model's output projection (a module, so LoRA-wrapped or tied heads work unchanged).
    temperature: a float, or (N,) per-token temperatures (the temperature each token was sampled at).
    Returns logp (N,) with grad, and the entropy (N,) of the full next-token distribution, -sum_v p_v log p_v, or
    None. The entropy is detached unless `entropy_grad` (A-GRPO's entropy bonus eta trains through it); it is that of
    the tempered distribution, or of the model's own (temperature 1) with `entropy_at_unit_temperature` (the
    AGPO-DSF clip controller reads the policy's entropy, whatever temperature sampled the tokens).

    Why chunks: the [N x V] logits of a whole batch (e.g. 8 x 1024 x 151936 floats = 5 GB for Qwen2.5) would
    otherwise be materialised, plus their softmax for backward. Rows are taken `chunk_elements // V` at a time
    (2^26 floats = 256 MB) and each chunk's logits are recomputed in backward (activation checkpointing), so at
    most one chunk lives at a time. When all rows fit in one chunk, nothing is recomputed: the saving is not
    needed and the recompute would cost a second head projection and softmax.
    """
    n = hidden.shape[0]
    vocab = getattr(lm_head, "out_features", None) or lm_head(hidden[:1]).shape[-1]
    chunk_size = max(1, chunk_elements // vocab)
    recompute = n > chunk_size
    temps = torch.as_tensor(temperature, dtype=torch.float32, device=hidden.device)
    temps = temps.expand(n) if temps.dim() == 0 else temps

    def chunk(h: torch.Tensor, ids: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raw = lm_head(h).float()
        logp_all = F.log_softmax(raw / t[:, None], dim=1)
        entropy = raw.new_zeros(0)
        if with_entropy:
            source = F.log_softmax(raw, dim=1) if entropy_at_unit_temperature else logp_all
            source = source if entropy_grad else source.detach()
            entropy = -(source.exp() * source).sum(dim=1)
        return logp_all.gather(1, ids[:, None]).squeeze(1), entropy

    logps, entropies = [], []
    for start in range(0, n, chunk_size):
        sl = slice(start, start + chunk_size)
        args = (hidden[sl], token_ids[sl], temps[sl])
        if recompute and torch.is_grad_enabled() and hidden.requires_grad:
            logp, entropy = checkpoint(chunk, *args, use_reentrant=False)
        else:
            logp, entropy = chunk(*args)
        logps.append(logp)
        entropies.append(entropy)
    if not logps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    return torch.cat(logps), (torch.cat(entropies) if with_entropy else None)


# kl_estimator -> the per-token KL from log u and u, u = pi_ref / pi_theta of a sampled token (o ~ pi_theta):
KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    # Schulman's k1: unbiased for KL(pi_theta || pi_ref), can be negative
    "k1": lambda log_u, u: -log_u,
    # DeepSeekMath eq. 4, Schulman's k3: unbiased, >= 0
    "k3": lambda log_u, u: u - log_u - 1.0,
    # unbiased for KL(pi_ref || pi_theta) under o ~ pi_theta, >= 0
    "forward": lambda log_u, u: u * log_u - u + 1.0,
    # A-GRPO's symmetric KL, k3 + forward (docs/methods.md 2.2 [RECON])
    "symmetric": lambda log_u, u: (u - log_u - 1.0) + (u * log_u - u + 1.0),
}


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of a KL between the policy and the reference, from sampled tokens: logp, ref_logp (B, T)
    -> (B, T), by KL_ESTIMATORS[estimator] with log u = ref_logp - logp clamped to [-20, 20]."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl estimator must be one of {tuple(KL_ESTIMATORS)}, got {estimator!r}")
    log_u = (ref_logp - logp).clamp(-20.0, 20.0)
    return KL_ESTIMATORS[estimator](log_u, torch.exp(log_u))


def policy_ratio(logp: torch.Tensor, old_logp: torch.Tensor, completion_mask: torch.Tensor,
                 importance_sampling_level: str = "token") -> torch.Tensor:
    """The differentiable ratio pi / pi_old: per token (GRPO), (B, T), or GSPO's one ratio per sequence, (B, 1), which
    broadcasts over the tokens (its gradient flows through the mean). `clipped_surrogate` clips it; the KL's bias
    correction multiplies the per-token KL by it (DeepSeek-V3.2, arXiv 2512.02556: weighting the k3 term by the
    ratio makes its gradient the unbiased reverse-KL gradient; TRL's use_bias_correction_kl). In value it is 1
    on-policy; its gradient is not 0."""
    log_ratio = logp - old_logp
    if importance_sampling_level == "sequence":
        mask = completion_mask.to(logp.dtype)
        log_ratio = ((log_ratio * mask).sum(1) / mask.sum(1).clamp(min=1.0)).unsqueeze(1)
    elif importance_sampling_level != "token":
        raise ValueError(
            f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, got {importance_sampling_level!r}"
        )
    return torch.exp(log_ratio)


def token_share(flags: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The share of the completion tokens (mask, (B, T)) where the (B, T) 0 / 1 `flags` are set; 0 with no tokens."""
    return (flags * mask).sum() / mask.sum().clamp(min=1.0)


def clipped_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    epsilon_low: float | torch.Tensor,
    epsilon_high: float | torch.Tensor,
    importance_sampling_level: str = "token",
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token PPO/GRPO clipped surrogate loss, -min(rho A, clip(rho, 1-eps_low, 1+eps_high) A).

    logp, old_logp, completion_mask: (B, T); advantages: (B,). epsilon_low / epsilon_high: floats, or (B,) tensors
    for a clip range per completion (AGPO-DSF sets one per prompt group). Returns the per-token loss (B, T) (to be
    aggregated by `aggregate_loss`) and clip statistics (fractions of completion tokens, TRL's keys).
    dual_clip = c: for A < 0 the loss is also capped at c |A| (dual-clip PPO, Ye et al. 2020, arXiv 1912.09729;
    AGPO's "loss clip" reading C1, docs/methods.md 3.2 (c)): a token whose ratio has run far above 1 on a negative
    advantage cannot dominate the batch. TRL's `delta` (INTELLECT-2's two-sided clipping, arXiv 2505.07291),
    -min(min(rho, delta) A, clip(rho) A), is the same loss and gradient for every sign of A when delta >= 1 + eps_high
    (docs/methods.md 1.9), so it is read as dual_clip; `check_settings` refuses a smaller value, where the two differ.

    token level (GRPO): rho_{i,t} = exp(logp - old_logp).
    sequence level (GSPO, arXiv 2507.18071): s_i = exp(mean_t (logp - old_logp)), one ratio per completion,
    broadcast over its tokens; gradient flows through the mean.
    With one update per generation batch old_logp == logp.detach(), so rho == 1 in value and the clip is inactive:
    the gradient is then exactly -A grad log pi (DeepSeekMath's mu = 1 case).
    """
    mask = completion_mask.to(logp.dtype)
    ratio = policy_ratio(logp, old_logp, completion_mask, importance_sampling_level)  # (B, T) or (B, 1)
    # (B, 1) bounds when the clip range is per completion, scalars otherwise
    low_bound = 1.0 - torch.as_tensor(epsilon_low, dtype=ratio.dtype, device=ratio.device).reshape(-1, 1)
    high_bound = 1.0 + torch.as_tensor(epsilon_high, dtype=ratio.dtype, device=ratio.device).reshape(-1, 1)
    clipped = torch.clamp(ratio, low_bound, high_bound)
    adv = advantages.unsqueeze(1)
    per_token = -torch.min(ratio * adv, clipped * adv)
    if per_token.shape != logp.shape:  # sequence level: (B, 1) -> (B, T)
        per_token = per_token.expand_as(logp)
    if dual_clip is not None:
        capped = torch.minimum(per_token, dual_clip * (-adv))
        per_token = torch.where(adv < 0, capped, per_token)

    with torch.no_grad():
        r = ratio.expand_as(logp)
        low = ((r < low_bound) & (adv < 0)).to(mask.dtype)
        high = ((r > high_bound) & (adv > 0)).to(mask.dtype)
        stats = {"clip_ratio/low_mean": token_share(low, mask), "clip_ratio/high_mean": token_share(high, mask),
                 "clip_ratio/region_mean": token_share(low + high, mask)}
        if dual_clip is not None:
            dual = ((r * adv.abs() > dual_clip * adv.abs()) & (adv < 0)).to(mask.dtype)
            stats["clip_ratio/dual_mean"] = token_share(dual, mask)
    return per_token, stats


def cispo_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    epsilon_low: float | torch.Tensor,
    epsilon_high: float | torch.Tensor,
    importance_sampling_level: str = "token",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO's per-token loss (MiniMax-M1, arXiv 2506.13585, eq. 4-5): the importance weight is clipped and detached,
    so every token keeps a gradient (the PPO clip drops the gradient of a clipped token entirely):

        l_it = -sg(min(rho_it, epsilon_high)) A_i log pi(o_it)

    Arguments and shapes as `clipped_surrogate`. As TRL's loss_type "cispo" reads it, the weight is capped from above
    only, at epsilon_high itself (ScaleRL's eps_max, arXiv 2510.13786, which recommends 5): the paper leaves the lower
    bound unset, so epsilon_low is not used (nor dual_clip, which `check_settings` refuses with it). On-policy rho = 1
    and the gradient is -A grad log pi.
    Statistics: the share of tokens whose weight the cap lowered on a positive advantage (TRL's cispo_clip_ratio).
    """
    mask = completion_mask.to(logp.dtype)
    ratio = policy_ratio(logp, old_logp, completion_mask, importance_sampling_level)  # (B, T) or (B, 1)
    cap = torch.as_tensor(epsilon_high, dtype=ratio.dtype, device=ratio.device).reshape(-1, 1)
    adv = advantages.unsqueeze(1)
    per_token = -torch.minimum(ratio, cap).detach() * adv * logp
    with torch.no_grad():
        share = token_share(((ratio.expand_as(logp) > cap) & (adv > 0)).to(mask.dtype), mask)
        stats = {"clip_ratio/low_mean": torch.zeros_like(share), "clip_ratio/high_mean": share,
                 "clip_ratio/region_mean": share}
    return per_token, stats


def sapo_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    epsilon_low: float | torch.Tensor,
    epsilon_high: float | torch.Tensor,
    importance_sampling_level: str = "token",
    *,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO's per-token loss (Soft Adaptive Policy Optimization, Gao et al. 2025, arXiv 2511.20347): a smooth gate of
    the ratio replaces the hard clip,

        l_it = -f(rho_it) A_i,   f(rho) = (4 / tau) sigmoid(tau (rho - 1)),   tau = tau_pos if A_i > 0 else tau_neg

    so grad l = -4 s (1 - s) A rho grad log pi with s = sigmoid(tau (rho - 1)): the weight 4 s (1 - s) is 1 on-policy
    (the gradient is then GRPO's, -A grad log pi) and decays smoothly as rho leaves 1, instead of dropping to 0 at
    1 +- epsilon; a larger tau narrows it. The paper takes tau_neg > tau_pos: tokens with a negative advantage push
    probability off many other tokens, and a faster decay keeps that from destabilising training. A_i = 0 takes
    tau_neg, as TRL's loss_type "sapo" (it contributes nothing either way). Arguments and shapes as
    `clipped_surrogate`; the clip range is not read (`check_settings` refuses the controllers that move it).
    Statistics: the share of tokens whose gate weight 4 s (1 - s) is below 1/2 (|rho - 1| beyond about 1.76 / tau),
    logged as `clip_ratio/region_mean`, so that runs with a hard clip and with SAPO show a comparable number.
    """
    mask = completion_mask.to(logp.dtype)
    ratio = policy_ratio(logp, old_logp, completion_mask, importance_sampling_level)  # (B, T) or (B, 1)
    adv = advantages.unsqueeze(1)
    tau = torch.where(adv > 0, sapo_temperature_pos, sapo_temperature_neg).to(ratio.dtype)  # (B, 1)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
    per_token = -gate * adv
    if per_token.shape != logp.shape:  # sequence level: (B, 1) -> (B, T)
        per_token = per_token.expand_as(logp)
    with torch.no_grad():
        s = torch.sigmoid(tau * (ratio - 1.0)).expand_as(logp)
        faded = ((4.0 * s * (1.0 - s) < 0.5) & (adv != 0)).to(mask.dtype)
        low = faded * (ratio.expand_as(logp) < 1.0)
        stats = {"clip_ratio/low_mean": token_share(low, mask), "clip_ratio/high_mean": token_share(faded - low, mask),
                 "clip_ratio/region_mean": token_share(faded, mask)}
    return per_token, stats


def off_policy_sequence_mask(logp: torch.Tensor, sampling_logp: torch.Tensor, advantages: torch.Tensor,
                             completion_mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence masking (arXiv 2512.02556, eq. 9), (B, 1) of 0 / 1, no grad:

        M_i = 0  if A_i < 0 and (1/|o_i|) sum_t (log pi_sampling(o_it) - log pi_theta(o_it)) > threshold,  else 1

    A completion with a negative advantage that the trained policy has drifted far from (a k1 estimate of
    KL(pi_sampling || pi_theta) over its tokens) is dropped from the policy loss: pushing its probability down
    further, on a sample the policy would no longer draw, is what destabilises off-policy training. Positive-advantage
    completions always stay. `sampling_logp` is the sampler's own log-probability (vLLM's) where the rollout has one,
    otherwise pi_old's (TRL's loss reads them the same way); logp is the current policy's, detached. A token whose
    sampling log-prob is NaN (the engine could not score it) counts as 0, as in TRL. Padding does not count.
    """
    mask = completion_mask.to(logp.dtype)
    gap = torch.nan_to_num(sampling_logp - logp.detach(), nan=0.0)
    mean_gap = (gap * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1.0)
    drop = (advantages.unsqueeze(1) < 0) & (mean_gap > threshold)
    return (~drop).to(logp.dtype)


def high_entropy_mask(entropy: torch.Tensor, completion_mask: torch.Tensor, quantile: float,
                      pool: torch.Tensor | None = None) -> torch.Tensor:
    """The tokens whose entropy is in the top `quantile` of the pool, (B, T) of 0 / 1 (Wang et al. 2025, "Beyond the
    80/20 rule", arXiv 2506.01939: the policy gradient of only the ~20% highest-entropy "forking" tokens trains as well
    as or better than all of them; quantile 0.2 is the paper's).

        keep_it = [H_it >= q],   q = the (1 - quantile) quantile of the pool, linearly interpolated (torch.quantile)

    pool: (M,) the entropies the threshold is taken over; None = this micro-batch's loss tokens, entropy[mask]. TRL
    takes it over one micro-batch's loss tokens gathered from every process (lib/distributed.gather_ragged), so the
    threshold, like bnpo's average, depends on how a step is split into micro-batches. quantile 0 keeps the single
    highest-entropy token (and ties); padding is never kept; an empty pool keeps nothing.
    """
    mask = completion_mask.bool()
    pool = entropy.detach()[mask].float() if pool is None else pool.float()
    if pool.numel() == 0:
        return torch.zeros_like(entropy)
    threshold = torch.quantile(pool, 1.0 - quantile)
    return ((entropy.detach() >= threshold) & mask).to(entropy.dtype)


def truncated_importance_weights(train_logp: torch.Tensor, sampling_logp: torch.Tensor, mask: torch.Tensor,
                                 mode: str = "token_truncate", clip_max: float | None = 3.0,
                                 clip_min: float | None = None) -> torch.Tensor:
    """Importance weights correcting for a sampler whose probabilities differ from the trainer's (B, T), no grad.

    Truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
    training"): the policy gradient is estimated on tokens drawn from the inference engine's pi_vllm, not the
    trained pi, so each token's term is weighted by w = pi(y_t) / pi_vllm(y_t), computed from log-probs
    (`train_logp` of the policy that sampled, `sampling_logp` the engine's), and bounded to [C_min, C_max] for
    variance (TRL's vllm_importance_sampling_clip_min / _max; None = no bound on that side):
        token_truncate     w_t = clamp(w_t, C_min, C_max)
        token_mask         w_t inside [C_min, C_max], else 0: with both bounds, IcePop (Ling team 2025, arXiv
                           2510.18855: tokens whose two probabilities disagree beyond a band leave the gradient)
        sequence_truncate  one weight per completion, clamp(prod_t w_t, C_min, C_max), on all its tokens
        sequence_mask      prod_t w_t inside [C_min, C_max], else 0 (masked importance sampling per sequence)
    Masked positions get weight 0; a NaN sampling log-prob (a token the engine could not score) gives w = 1, as TRL.
    """
    if mode not in IMPORTANCE_SAMPLING_MODES:
        raise ValueError(f"vllm_importance_sampling_mode: {mode!r} is not one of {IMPORTANCE_SAMPLING_MODES}")
    log_ratio = torch.nan_to_num((train_logp - sampling_logp) * mask, nan=0.0).detach()
    if mode.startswith("sequence"):
        log_ratio = log_ratio.sum(1, keepdim=True).expand_as(train_logp)
    ratio = torch.exp(log_ratio.clamp(max=50.0))  # exp of a huge log-ratio overflows; e^50 is beyond any useful cap
    if mode.endswith("truncate"):
        weight = ratio if clip_min is None and clip_max is None else ratio.clamp(min=clip_min, max=clip_max)
    else:
        inside = torch.ones_like(ratio, dtype=torch.bool)
        if clip_min is not None:
            inside &= ratio >= clip_min
        if clip_max is not None:
            inside &= ratio <= clip_max
        weight = torch.where(inside, ratio, torch.zeros_like(ratio))
    return weight * mask


# How a loss type averages its per-token losses (l_it masked to the completion tokens, `masked_sum`) into the scalar
# to call backward on, scaled so that summing the micro-batches' gradients and averaging over processes (DDP) gives
# the gradient of the global batch's loss. N = completions in the global batch, L = max_completion_length.


def sequence_mean(masked_sum, mask, num_sequences, num_tokens, max_length, num_processes, accumulation):
    """(1/N) sum_i (1/|o_i|) sum_t l_it (DeepSeekMath eq. 3)."""
    per_seq = masked_sum.sum(1) / mask.sum(1).clamp(min=1.0)
    return per_seq.sum() * num_processes / num_sequences


def token_mean(masked_sum, mask, num_sequences, num_tokens, max_length, num_processes, accumulation):
    """(1/sum_i |o_i|) sum_i sum_t l_it: the token mean over the global batch (DAPO eq. 8)."""
    # every token masked (all truncated, or every advantage 0 under the AGPO loss mask): a zero loss, not 0 / 0
    tokens = torch.as_tensor(num_tokens, dtype=masked_sum.dtype, device=masked_sum.device).clamp(min=1.0)
    return masked_sum.sum() * num_processes / tokens


def constant_length_mean(masked_sum, mask, num_sequences, num_tokens, max_length, num_processes, accumulation):
    """(1/(N L)) sum_i sum_t l_it (Dr. GRPO, arXiv 2503.20783)."""
    return masked_sum.sum() * num_processes / (num_sequences * max_length)


def local_token_mean(masked_sum, mask, num_sequences, num_tokens, max_length, num_processes, accumulation):
    """The token mean of the local micro-batch, averaged over micro-batches and processes (TRL's bnpo; the only one
    whose value depends on how the batch is split, kept for parity with TRL 0.17-0.21)."""
    return masked_sum.sum() / mask.sum().clamp(min=1.0) / accumulation


@dataclass(frozen=True)
class LossType:
    """A `loss_type`: its per-token policy loss, (logp, old_logp, advantages, mask, epsilon_low, epsilon_high,
    importance_sampling_level, **options) -> ((B, T) loss, statistics), and how it is averaged (`aggregate_loss`).
    `options`: the configuration keys the per-token loss also takes, as keyword arguments of the same names
    (`loss_options` reads them). `clip`: what it reads of the clip range: "band" (1 - epsilon_low, 1 + epsilon_high),
    "cap" (epsilon_high itself, an absolute cap of the ratio) or "none"; `check_settings` refuses a controller whose
    clip would not act on it (adaptive_kl scales epsilon, which a band and a cap both read; dsf sets band widths)."""

    surrogate: Callable
    average: Callable
    summary: str  # for --help and docs/configuration.md
    options: tuple[str, ...] = ()
    clip: str = "band"


# loss_type (TRL's names) -> its entry. Adding a loss: a pure function above and one line here (docs/methods.md 11).
_CLIP = ("dual_clip",)
LOSS_TYPES: dict[str, LossType] = {
    "grpo": LossType(clipped_surrogate, sequence_mean, "per-sequence mean", _CLIP),
    "bnpo": LossType(clipped_surrogate, local_token_mean, "local token mean", _CLIP),
    "dapo": LossType(clipped_surrogate, token_mean, "global token mean", _CLIP),
    "dr_grpo": LossType(clipped_surrogate, constant_length_mean, "sum over N x max_completion_length", _CLIP),
    "cispo": LossType(cispo_surrogate, token_mean, "detached IS weight capped at epsilon_high x log pi, "
                      "global token mean; ScaleRL recommends epsilon_high 5", clip="cap"),
    "sapo": LossType(sapo_surrogate, sequence_mean, "a sigmoid gate of the ratio instead of the clip "
                     "(sapo_temperature_pos / _neg), per-sequence mean",
                     ("sapo_temperature_pos", "sapo_temperature_neg"), clip="none"),
}


def loss_options(loss_type: str, settings) -> dict:
    """The keyword arguments LOSS_TYPES[loss_type]'s per-token loss takes from a configuration (any object with
    those attributes)."""
    return {name: getattr(settings, name) for name in LOSS_TYPES[loss_type].options}


def check_settings(cfg) -> None:
    """What the loss type and the advantages read, against the keys that would feed them (docs/methods.md 1.7-1.12,
    13.1), from a configuration (any object with its keys): a key the loss type would silently not use is refused,
    and so is a dual_clip (TRL's delta) in the range where the two differ, a controller whose clip range the loss
    type does not read (its `clip`), the importance-sampling bounds of `truncated_importance_weights`, and GDPO's
    aggregation with what it replaces. ValueError naming the key and the fix (lib/config.py makes it a ConfigError)."""
    entry = LOSS_TYPES[cfg.loss_type]
    if cfg.dual_clip is not None and "dual_clip" not in entry.options:
        raise ValueError(f"dual_clip (TRL's delta) caps the clipped surrogate's loss, and loss_type {cfg.loss_type} "
                         f"has none, so it would change nothing; remove dual_clip, or use loss_type grpo, bnpo, "
                         f"dapo or dr_grpo")
    if cfg.dual_clip is not None:
        # the widest upper clip range a step can train with: the controllers move it (lib/methods/registry.py)
        widest = cfg.resolved_epsilon_high()
        if cfg.adaptive_kl and cfg.epsilon > 0:
            widest = max(widest, widest * cfg.epsilon_max / cfg.epsilon)
        if cfg.dsf:
            widest = max(widest, cfg.dsf_eps_max)
        if cfg.dual_clip < 1.0 + widest:
            raise ValueError(f"dual_clip (TRL's delta) {cfg.dual_clip} is below 1 + epsilon_high = {1 + widest:g} "
                             f"(the widest upper clip range this run reaches): there it would cap the loss inside "
                             f"the clip range, and TRL's delta and dual-clip PPO give different losses "
                             f"(docs/methods.md 1.9); give at least {1 + widest:g} (Ye et al. use 3, INTELLECT-2 4)")
    if entry.clip == "none":
        moving = [key for key in ("adaptive_kl", "dsf") if getattr(cfg, key)]
        if moving:
            raise ValueError(f"loss_type {cfg.loss_type} has no clip range (its gate's width is set by "
                             f"{' and '.join(entry.options) or 'its own keys'}), so {' and '.join(moving)}, which "
                             f"adapt{'s' * (len(moving) == 1)} the clip range, would change nothing there; use "
                             f"loss_type grpo, dapo or cispo with {' and '.join(moving)}, or turn "
                             f"{'it' if len(moving) == 1 else 'them'} off "
                             f"({', '.join(f'--{k} false' for k in moving)})")
    if entry.clip == "cap" and cfg.dsf:
        # AGPO-DSF sets epsilon_high to a band width per group (dsf_eps_min..dsf_eps_max, about 0.2), which as
        # CISPO's absolute cap would scale every on-policy token's gradient by it
        raise ValueError(f"loss_type {cfg.loss_type} caps the importance weight at epsilon_high itself (e.g. 5), "
                         f"while dsf sets a clip band's width per group (dsf_eps_min {cfg.dsf_eps_min} to dsf_eps_max "
                         f"{cfg.dsf_eps_max}), which as that cap would scale every on-policy gradient by it; use "
                         f"loss_type grpo or dapo with dsf, or --dsf false")
    low, high = cfg.vllm_importance_sampling_clip_min, cfg.vllm_importance_sampling_clip_max
    if low is None and high is None:
        raise ValueError("vllm_importance_sampling_clip_min and vllm_importance_sampling_clip_max are both null: "
                         "give at least one bound of the importance ratio (TRL's default: clip_max 3)")
    if low is not None and high is not None and low >= high:
        raise ValueError(f"vllm_importance_sampling_clip_min ({low}) must be below vllm_importance_sampling_clip_max "
                         f"({high})")
    if cfg.multi_objective_aggregation == "normalize_then_sum":
        if cfg.resample_schedule:
            raise ValueError("multi_objective_aggregation normalize_then_sum normalises each reward function within "
                             "its group, while resample_schedule (adaGRPO) pools the summed reward over a prompt's "
                             "rounds; set one of them off")
        if cfg.scale_rewards not in ("group", "batch"):
            raise ValueError(f"multi_objective_aggregation normalize_then_sum normalises each reward function by "
                             f"its group's spread and the sum over the batch (GDPO), which replaces scale_rewards "
                             f"{cfg.scale_rewards}; set scale_rewards group (the default) or "
                             f"multi_objective_aggregation sum_then_normalize")


def _loss_type(loss_type: str) -> LossType:
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {tuple(LOSS_TYPES)}, got {loss_type!r}")
    return LOSS_TYPES[loss_type]


def policy_loss(loss_type: str, *args, **options) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-token policy loss (B, T) of `loss_type` and its statistics; arguments as `clipped_surrogate`, and
    the options that loss type takes (LossType.options; e.g. dual_clip for the clipped ones)."""
    entry = _loss_type(loss_type)
    unknown = set(options) - set(entry.options)
    if unknown:
        raise ValueError(f"loss_type {loss_type} takes no {', '.join(sorted(unknown))}")
    return entry.surrogate(*args, **options)


def aggregate_loss(
    per_token_loss: torch.Tensor,
    completion_mask: torch.Tensor,
    loss_type: str,
    *,
    global_num_sequences: int | torch.Tensor,
    global_num_tokens: int | torch.Tensor,
    max_completion_length: int,
    num_processes: int = 1,
    gradient_accumulation_steps: int = 1,
) -> torch.Tensor:
    """Reduce a (B, T) per-token loss of one local micro-batch to the scalar to call backward on, as
    LOSS_TYPES[loss_type].average says (the averages above). `global_num_sequences` and `global_num_tokens` are
    counted over every micro-batch and process of the step. DDP averages gradients over processes; multiplying by
    num_processes turns that average into a sum."""
    mask = completion_mask.to(per_token_loss.dtype)
    return _loss_type(loss_type).average(per_token_loss * mask, mask, global_num_sequences, global_num_tokens,
                                         max_completion_length, num_processes, gradient_accumulation_steps)


@dataclass(frozen=True)
class ObjectiveSettings:
    """What shapes `policy_objective`, read once from a configuration at set-up (`of`). The values a controller moves
    between steps (beta, eta, the clip range) are arguments of each call instead. docs/methods.md 6.1, phase 5."""

    loss_type: str
    importance_sampling_level: str = "token"
    loss_options: dict = field(default_factory=dict)  # the loss type's own keys (LossType.options, `loss_options`)
    off_policy_mask_threshold: float | None = None  # DeepSeek-V3.2's sequence mask (docs/methods.md 1.10); None: off
    top_entropy_quantile: float = 1.0  # the 80/20 rule (docs/methods.md 1.11); 1: every token
    importance_sampling: bool = False  # the sampler's truncated importance weights (docs/methods.md 1.12)
    importance_sampling_mode: str = "token_truncate"
    importance_sampling_clip_max: float | None = 3.0
    importance_sampling_clip_min: float | None = None
    kl_estimator: str = "k3"
    bias_correction_kl: bool = False  # TRL's use_bias_correction_kl: the KL term weighted by pi / pi_old

    def __post_init__(self):
        unknown = set(self.loss_options) - set(_loss_type(self.loss_type).options)
        if unknown:
            raise ValueError(f"loss_type {self.loss_type} takes no {', '.join(sorted(unknown))}")
        for name, value, choices in (("kl_estimator", self.kl_estimator, tuple(KL_ESTIMATORS)),
                                     ("importance_sampling_level", self.importance_sampling_level,
                                      IMPORTANCE_SAMPLING_LEVELS),
                                     ("vllm_importance_sampling_mode", self.importance_sampling_mode,
                                      IMPORTANCE_SAMPLING_MODES)):
            if value not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {value!r}")

    @classmethod
    def of(cls, cfg) -> ObjectiveSettings:
        """From a configuration (any object with its keys). The importance weights apply where the sampler's weights
        may differ from the trained ones: a vLLM engine (use_vllm), or a sampler up to max_staleness > 0 steps behind;
        a synchronous HF sampler samples with the trained weights themselves."""
        off_policy = bool(cfg.use_vllm or getattr(cfg, "max_staleness", None))
        return cls(cfg.loss_type, cfg.importance_sampling_level, loss_options(cfg.loss_type, cfg),
                   cfg.off_policy_mask_threshold, cfg.top_entropy_quantile,
                   off_policy and bool(cfg.vllm_importance_sampling_correction), cfg.vllm_importance_sampling_mode,
                   cfg.vllm_importance_sampling_clip_max, cfg.vllm_importance_sampling_clip_min, cfg.kl_estimator,
                   cfg.use_bias_correction_kl)


@dataclass
class ObjectiveStats:
    """`policy_objective`'s statistics of one micro-batch, each keyed by the metric it is logged as, in the form that
    combines over micro-batches (`+`) and processes: `sums` are added (each logged divided by the step's loss
    tokens), `maxima` take the largest, `minima` the smallest."""

    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    maxima: dict[str, torch.Tensor] = field(default_factory=dict)
    minima: dict[str, torch.Tensor] = field(default_factory=dict)

    def __add__(self, other: ObjectiveStats) -> ObjectiveStats:
        def combine(mine: dict, theirs: dict, how: Callable) -> dict:
            return {**mine, **{k: how(mine[k], v) if k in mine else v for k, v in theirs.items()}}
        return ObjectiveStats(combine(self.sums, other.sums, torch.add),
                              combine(self.maxima, other.maxima, torch.maximum),
                              combine(self.minima, other.minima, torch.minimum))


def policy_objective(settings: ObjectiveSettings, logp: torch.Tensor, old_logp: torch.Tensor,
                     advantages: torch.Tensor, completion_mask: torch.Tensor, entropy: torch.Tensor, *,
                     epsilon_low: float | torch.Tensor, epsilon_high: float | torch.Tensor, beta: float = 0.0,
                     eta: float = 0.0, ref_logp: torch.Tensor | None = None, sampling_logp: torch.Tensor | None = None,
                     entropy_pool: torch.Tensor | None = None) -> tuple[torch.Tensor, ObjectiveStats]:
    """Every per-token term of the loss of one micro-batch, (B, T), for `aggregate_loss` to average:

        l_it = M_i K_it w_it s_it  +  beta c_it KL_it  -  eta H_it

    s_it   the loss type's surrogate (`policy_loss`, LOSS_TYPES) with the clip range epsilon_low / epsilon_high (floats
           or (B,), one per completion)
    M_i    the off-policy sequence mask (`off_policy_sequence_mask`, docs/methods.md 1.10) with
           off_policy_mask_threshold, its KL taken to `sampling_logp` where given, else to `old_logp`
    K_it   the high-entropy mask (`high_entropy_mask`, 1.11) with top_entropy_quantile < 1, its threshold over
           `entropy_pool` (the caller gathers every process's loss-token entropies: lib/distributed.gather_ragged)
    w_it   the sampler's truncated importance weight pi_old / pi_sampling (`truncated_importance_weights`, 1.12) with
           settings.importance_sampling and `sampling_logp` given
    KL_it  `kl_penalty` to `ref_logp` (needed when beta > 0) by kl_estimator; c_it = pi / pi_old (`policy_ratio`)
           with bias_correction_kl, else 1
    H_it   `entropy`, the full next-token distribution's (with its gradient for A-GRPO's bonus eta)

    A term whose setting is off, or whose weight (beta, eta) is 0, is not computed. The log-probs, the entropy and the
    mask are (B, T); advantages (B,). Statistics (ObjectiveStats), by the logged name: sums over the
    loss tokens of the surrogate's clip shares, `masked/off_policy` and `masked/low_entropy` (the tokens each mask
    left out), `kl` (0 with beta 0) and, with the importance weights, the weights and |log pi_old - log pi_sampling|
    (`.../mean`), their largest (`.../max`) and the smallest weight (`.../min`)."""
    mask = completion_mask
    per_token, shares = policy_loss(settings.loss_type, logp, old_logp, advantages, mask, epsilon_low, epsilon_high,
                                    settings.importance_sampling_level, **settings.loss_options)
    if settings.off_policy_mask_threshold is not None:
        keep = off_policy_sequence_mask(logp, old_logp if sampling_logp is None else sampling_logp, advantages, mask,
                                        settings.off_policy_mask_threshold)
        per_token = per_token * keep
        shares["masked/off_policy"] = token_share(1 - keep, mask)
    if settings.top_entropy_quantile < 1.0:
        keep = high_entropy_mask(entropy, mask, settings.top_entropy_quantile, entropy_pool)
        per_token = per_token * keep
        shares["masked/low_entropy"] = token_share(1 - keep, mask)
    tokens = mask.sum()
    stats = ObjectiveStats({k: v * tokens for k, v in shares.items()})
    if settings.importance_sampling and sampling_logp is not None:
        weight = truncated_importance_weights(old_logp, sampling_logp, mask, settings.importance_sampling_mode,
                                              settings.importance_sampling_clip_max,
                                              settings.importance_sampling_clip_min)
        per_token = per_token * weight
        off = ~mask.bool()
        gap = (old_logp - sampling_logp).abs().masked_fill(off, 0.0)
        ratio, difference = "sampling/importance_sampling_ratio", "sampling/sampling_logp_difference"
        stats.sums |= {f"{ratio}/mean": weight.masked_fill(off, 0.0).sum(), f"{difference}/mean": gap.sum()}
        stats.maxima |= {f"{ratio}/max": weight.masked_fill(off, 0.0).max(), f"{difference}/max": gap.max()}
        stats.minima[f"{ratio}/min"] = weight.masked_fill(off, math.inf).min()
    stats.sums["kl"] = torch.zeros((), device=logp.device)
    if beta > 0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs ref_logp, the reference's log-probs of the same tokens")
        kl = kl_penalty(logp, ref_logp, settings.kl_estimator)
        kl_weight = policy_ratio(logp, old_logp, mask, settings.importance_sampling_level) \
            if settings.bias_correction_kl else 1.0
        per_token = per_token + beta * kl * kl_weight
        stats.sums["kl"] = (kl.detach() * mask).sum()
    if eta > 0:  # A-GRPO's entropy bonus: the gradient raises the full distribution's entropy
        per_token = per_token - eta * entropy
    return per_token, stats


def per_row(value: float | torch.Tensor, rows: slice) -> float | torch.Tensor:
    """A per-completion tensor's rows of one micro-batch, or the scalar itself."""
    return value[rows] if isinstance(value, torch.Tensor) else value


def mean_of(value: float | torch.Tensor) -> float:
    """The mean of a per-completion tensor, or the scalar itself."""
    return float(value.mean()) if isinstance(value, torch.Tensor) else value
