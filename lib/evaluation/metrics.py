"""The evaluator's statistics over sampled completions (eval_agrpo.py): pass@k, maj@k, a bootstrap interval, the
win rate against a reference, and KL / entropy against the reference; the scoring loop itself is lib/evaluation/accuracy.py.
"""

from __future__ import annotations

import math
from collections import Counter

import torch

from lib.data.records import tokenize_prompts
from lib.evaluation.accuracy import summarize
from lib.models.modeling import completion_logps
from lib.rewards.functions import answers_match


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021, "Evaluating Large Language Models
    Trained on Code", eq. 1): 1 - C(n-c, k) / C(n, k), the chance that k samples drawn without replacement from the
    n hold at least one correct one. Computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i), which never forms a large binomial.
    """
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def majority_answer(answers: list[str | None]) -> str | None:
    """The most frequent extracted answer (None, no answer, never wins); a tie goes to the one that came first.
    Answers are compared as the cleaned strings `extract_answer` returns ("1,000" and "1000" are one answer)."""
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return None
    best = max(counts.values())
    return next(a for a in answers if a is not None and counts[a] == best)


def bootstrap_interval(values: list[float], *, confidence: float = 0.95, num_resamples: int = 1000,
                       seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of per-problem values (Efron & Tibshirani 1993): resample the
    problems with replacement `num_resamples` times and take the (1-confidence)/2 and (1+confidence)/2 quantiles."""
    if not values:
        return (float("nan"), float("nan"))
    data = torch.tensor(values, dtype=torch.float64)
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(values), (num_resamples, len(values)), generator=generator)
    means = data[picks].mean(1)
    tail = (1.0 - confidence) / 2
    low, high = torch.quantile(means, torch.tensor([tail, 1.0 - tail], dtype=torch.float64)).tolist()
    return low, high


def win_rate(policy_rewards: list[list[float]], reference_rewards: list[list[float]]) -> float:
    """docs/methods.md 9.5: the share of held-out prompts where a completion of the trained policy gets a higher
    reward than one of the reference model, ties counted as half. Sample j of a problem is paired with sample j of
    the reference on the same problem, and every pair counts."""
    if len(policy_rewards) != len(reference_rewards):
        raise ValueError(f"win rate: {len(policy_rewards)} problems against {len(reference_rewards)} in the reference")
    outcomes = [1.0 if p > r else 0.5 if p == r else 0.0
                for ps, rs in zip(policy_rewards, reference_rewards) for p, r in zip(ps, rs)]
    return sum(outcomes) / len(outcomes) if outcomes else float("nan")


def score_problems(results: list[dict], ks: list[int], *, seed: int = 0) -> dict[str, float]:
    """The evaluator's row for one model on one data set, from `generate_and_score` results.

    accuracy: pass@1, the mean over problems of the share of correct samples (greedy: one sample); its 95% bootstrap
    interval over problems; pass@k (unbiased) and maj@k (majority vote of the first k samples) for every k;
    mean completion tokens; share of truncated completions; share with an `Answer:` line."""
    n = min(len(r["correct"]) for r in results)
    per_problem = [sum(r["correct"]) / len(r["correct"]) for r in results]
    low, high = bootstrap_interval(per_problem, seed=seed)
    row = {**summarize(results), "accuracy_low": low, "accuracy_high": high, "num_samples": float(n)}
    for k in ks:
        row[f"pass@{k}"] = sum(pass_at_k(len(r["correct"]), sum(r["correct"]), k) for r in results) / len(results)
        row[f"maj@{k}"] = sum(answers_match(majority_answer(r["answers"][:k]), r["gold"]) for r in results) \
            / len(results)
    return row


@torch.no_grad()
def completion_kl_entropy(
    model: torch.nn.Module,
    reference: torch.nn.Module,
    tokenizer,
    prompts: list[str],
    results: list[dict],
    *,
    temperature: float,
    max_prompt_length: int,
    batch_size: int = 16,
    device: torch.device | str = "cpu",
) -> tuple[float, float]:
    """Per-token KL(model || reference) and entropy of `model` on the model's own completions (the seeds' KL and
    Entropy columns), as token means over every completion.

    KL uses the k3 estimator (Schulman 2020, "Approximating KL divergence": u - log u - 1 with u = p_ref / p_model,
    unbiased and never negative), the same as the trainer's `kl`; entropy is that of the full next-token distribution.
    Both at the sampling temperature (1 for greedy decoding, where no temperature was applied).
    """
    temp = temperature if temperature > 0 else 1.0
    rows = [(i, ids, kept) for i, r in enumerate(results)
            for ids, kept in zip(r["token_ids"], r.get("model_mask", [None] * len(r["token_ids"])))]
    kl_sum = entropy_sum = tokens = 0.0
    for start in range(0, len(rows), batch_size):
        chunk = [(i, ids) for i, ids, _ in rows[start : start + batch_size] if ids]
        kept = [k for _, ids, k in rows[start : start + batch_size] if ids]
        if not chunk:
            continue
        prompt_ids, prompt_mask = tokenize_prompts(tokenizer, [prompts[i] for i, _ in chunk], max_prompt_length,
                                                   device)
        width = max(len(ids) for _, ids in chunk)
        completion = torch.full((len(chunk), width), tokenizer.pad_token_id, dtype=torch.long, device=device)
        mask = torch.zeros(len(chunk), width, dtype=torch.long, device=device)
        for row, (_, ids) in enumerate(chunk):
            completion[row, : len(ids)] = torch.tensor(ids, device=device)
            mask[row, : len(ids)] = 1
        counted = mask.clone()  # the model's tokens: an episode's tool results are read (mask), never counted
        for row, tokens_of_model in enumerate(kept):
            if tokens_of_model is not None:
                counted[row, : len(tokens_of_model)] = torch.tensor(tokens_of_model, device=device)
        index = torch.arange(len(chunk), device=device)
        temps = torch.full((len(chunk),), temp, device=device)
        logp, entropy = completion_logps(model, prompt_ids, prompt_mask, index, completion, mask, temps)
        ref_logp = logp if reference is model else completion_logps(  # the reference itself: KL 0, one pass
            reference, prompt_ids, prompt_mask, index, completion, mask, temps, with_entropy=False)[0]
        log_u = (ref_logp - logp).clamp(-20, 20)
        kl = (torch.exp(log_u) - log_u - 1) * counted
        kl_sum += float(kl.sum())
        entropy_sum += float((entropy * counted).sum())
        tokens += float(counted.sum())
    return kl_sum / max(tokens, 1.0), entropy_sum / max(tokens, 1.0)
