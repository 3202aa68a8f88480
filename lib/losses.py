"""Pure tensor math for GRPO: advantages, importance ratios, the clipped surrogate, KL estimators, aggregation.

Everything here takes tensors and returns tensors (plus a dict of detached statistics). No model forward, no
Accelerator, no globals, no `.item()`: the training loop reduces and logs. Shapes use B = completions in the
(micro-)batch, T = completion tokens (padded), V = vocabulary, G = group size (`num_generations`).
Formulas: ALGORITHMS.md section 1 (DeepSeekMath GRPO, TRL's implementation, DAPO, Dr. GRPO, GSPO).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")
SCALE_REWARDS = ("group", "batch", "none")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k3", "forward", "symmetric")

# TRL (and adaGRPO, which inherits it) divide by std + 1e-4; ALGORITHMS.md 1.1 picks that for parity with TRL.
STD_EPS = 1e-4


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale_rewards: str = "group"
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Group-relative advantages (DeepSeekMath outcome supervision, TRL `scale_rewards`).

    rewards: (N,) with N a multiple of `group_size`, the completions of one prompt contiguous.
    Returns advantages (N,) and stats: `reward_std` (mean of the per-group std, TRL's key) and
    `frac_reward_zero_std` (share of groups whose rewards are all equal: they carry no learning signal).

    group: (r - mean_g) / (std_g + 1e-4); batch: (r - mean_g) / (std over all N + 1e-4) (Lite-PPO);
    none: r - mean_g (Dr. GRPO). std is unbiased (Bessel), as torch.std and TRL.
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.view(-1, group_size)
    mean_g = grouped.mean(dim=1, keepdim=True)
    # a group of one has no spread; std of one value is NaN in torch, so define it as 0
    std_g = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(mean_g)
    centred = grouped - mean_g
    if scale_rewards == "group":
        advantages = centred / (std_g + STD_EPS)
    elif scale_rewards == "batch":
        std_b = rewards.std() if rewards.numel() > 1 else torch.zeros((), dtype=rewards.dtype)
        advantages = centred / (std_b + STD_EPS)
    elif scale_rewards == "none":
        advantages = centred
    else:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    stats = {
        "reward_std": std_g.mean(),
        "frac_reward_zero_std": (std_g < 1e-6).float().mean(),
    }
    return advantages.reshape(-1), stats


def token_logps_and_entropy(
    hidden: torch.Tensor,
    lm_head: Callable[[torch.Tensor], torch.Tensor],
    token_ids: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    chunk_elements: int = 2**26,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities of `token_ids` under softmax(lm_head(hidden) / temperature), one chunk of rows at a time.

    hidden: (N, H) final hidden states at the positions that predict `token_ids` (N,); lm_head: (n, H) -> (n, V),
    the model's output projection (a module, so LoRA-wrapped or tied heads work unchanged).
    temperature: a float, or (N,) per-token temperatures (the temperature each token was sampled at).
    Returns logp (N,) with grad, and the entropy (N,) of the full next-token distribution (detached) or None.

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
        logits = lm_head(h).float() / t[:, None]
        logp_all = F.log_softmax(logits, dim=1)
        # entropy of the full distribution, for logging and the controllers; no gradient through it
        entropy = -(logp_all.detach().exp() * logp_all.detach()).sum(dim=1) if with_entropy else logits.new_zeros(0)
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


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of a KL between the policy and the reference, from sampled tokens (o ~ pi_theta).

    logp, ref_logp: (B, T). With u = pi_ref / pi_theta = exp(ref_logp - logp) (log u clamped to [-20, 20]):
      k1:        -log u                      (Schulman's k1: unbiased for KL(pi_theta || pi_ref), can be negative)
      k3:        u - log u - 1               (DeepSeekMath eq. 4, Schulman's k3: unbiased, >= 0)
      forward:   u log u - u + 1             (unbiased for KL(pi_ref || pi_theta) under o ~ pi_theta, >= 0)
      symmetric: k3 + forward                (A-GRPO's symmetric KL, ALGORITHMS.md 2.2 [RECON])
    """
    log_u = (ref_logp - logp).clamp(-20.0, 20.0)
    u = torch.exp(log_u)
    if estimator == "k1":
        return -log_u
    if estimator == "k3":
        return u - log_u - 1.0
    if estimator == "forward":
        return u * log_u - u + 1.0
    if estimator == "symmetric":
        return (u - log_u - 1.0) + (u * log_u - u + 1.0)
    raise ValueError(f"kl estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def clipped_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
    importance_sampling_level: str = "token",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token PPO/GRPO clipped surrogate loss, -min(rho A, clip(rho, 1-eps_low, 1+eps_high) A).

    logp, old_logp, completion_mask: (B, T); advantages: (B,). Returns the per-token loss (B, T) (to be
    aggregated by `aggregate_loss`) and clip statistics (fractions of completion tokens, TRL's keys).

    token level (GRPO): rho_{i,t} = exp(logp - old_logp).
    sequence level (GSPO, arXiv 2507.18071): s_i = exp(mean_t (logp - old_logp)), one ratio per completion,
    broadcast over its tokens; gradient flows through the mean.
    With one update per generation batch old_logp == logp.detach(), so rho == 1 in value and the clip is inactive:
    the gradient is then exactly -A grad log pi (DeepSeekMath's mu = 1 case).
    """
    mask = completion_mask.to(logp.dtype)
    log_ratio = logp - old_logp
    if importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(1) / mask.sum(1).clamp(min=1.0)).unsqueeze(1)
    elif importance_sampling_level != "token":
        raise ValueError(
            f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, got {importance_sampling_level!r}"
        )
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - epsilon_low, 1.0 + epsilon_high)
    adv = advantages.unsqueeze(1)
    per_token = -torch.min(ratio * adv, clipped * adv)
    if per_token.shape != logp.shape:  # sequence level: (B, 1) -> (B, T)
        per_token = per_token.expand_as(logp)

    with torch.no_grad():
        r = ratio.expand_as(logp)
        low = ((r < 1.0 - epsilon_low) & (adv < 0)).to(mask.dtype)
        high = ((r > 1.0 + epsilon_high) & (adv > 0)).to(mask.dtype)
        n_tok = mask.sum().clamp(min=1.0)
        stats = {
            "clip_ratio/low_mean": (low * mask).sum() / n_tok,
            "clip_ratio/high_mean": (high * mask).sum() / n_tok,
            "clip_ratio/region_mean": ((low + high) * mask).sum() / n_tok,
        }
    return per_token, stats


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
    """Reduce a (B, T) per-token loss of one local micro-batch to the scalar to call backward on.

    The result is scaled so that summing the gradients of all micro-batches of an optimizer step and averaging
    them over processes (what DDP does) gives the gradient of the loss of the *global* batch:
      grpo:    (1/N) sum_i (1/|o_i|) sum_t l_it      N = completions in the global batch (DeepSeekMath eq. 3)
      dapo:    (1/sum_i |o_i|) sum_i sum_t l_it      token mean over the global batch (DAPO, TRL "dapo")
      dr_grpo: (1/(N L)) sum_i sum_t l_it            L = max_completion_length (Dr. GRPO, TRL "dr_grpo")
      bnpo:    token mean over the local micro-batch, averaged over micro-batches and processes (TRL "bnpo";
               the only type whose value depends on how the batch is split, kept for parity with TRL 0.17-0.21).
    `global_num_sequences` and `global_num_tokens` are counted over every micro-batch and process of the step.
    """
    mask = completion_mask.to(per_token_loss.dtype)
    masked_sum = per_token_loss * mask
    # DDP averages gradients over processes; multiplying by num_processes turns that average into a sum
    if loss_type == "grpo":
        per_seq = masked_sum.sum(1) / mask.sum(1).clamp(min=1.0)
        return per_seq.sum() * num_processes / global_num_sequences
    if loss_type == "dapo":
        return masked_sum.sum() * num_processes / global_num_tokens
    if loss_type == "dr_grpo":
        return masked_sum.sum() * num_processes / (global_num_sequences * max_completion_length)
    if loss_type == "bnpo":
        return masked_sum.sum() / mask.sum().clamp(min=1.0) / gradient_accumulation_steps
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` over the positions where `mask` is 1 (0 when the mask is empty)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)
