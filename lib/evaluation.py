"""Scoring a model on held-out problems: the loop the trainer's periodic evaluation and eval_agrpo.py share.

Generation goes through a rollout backend (greedy or sampled), answers are checked with the same function the
training reward uses (`lib.rewards.answers_match` through `extract_answer`), so a number in the training log and a
number from the evaluator mean the same thing.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable

import torch

from lib.data import tokenize_prompts
from lib.modeling import completion_logps
from lib.rewards import answers_match, extract_answer, format_reward


@torch.no_grad()
def generate_and_score(
    backend,
    tokenizer,
    records: list[dict],
    prompts: list[str],
    *,
    max_new_tokens: int,
    max_prompt_length: int,
    batch_size: int = 64,
    num_samples: int = 1,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    device: torch.device | str = "cpu",
    on_batch: Callable[[list[dict]], None] | None = None,
) -> list[dict]:
    """Complete every prompt `num_samples` times (greedy when temperature is 0) and score each completion.

    Returns one dict per record, in the order given: {"gold": str, "completions": [str], "answers": [str | None],
    "correct": [bool], "lengths": [int], "truncated": [bool], "formatted": [bool], "token_ids": [[int]]}.
    Prompts are batched in order of length, so a batch wastes little on padding. `on_batch` is called with each
    batch's results as they come (a progress bar with the running accuracy).
    """
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    results: list[dict | None] = [None] * len(prompts)
    for start in range(0, len(order), batch_size):
        index = order[start : start + batch_size]
        prompt_ids, prompt_mask = tokenize_prompts(tokenizer, [prompts[i] for i in index], max_prompt_length, device)
        rollout = backend.generate(prompt_ids, prompt_mask, num_generations=num_samples, max_new_tokens=max_new_tokens,
                                   temperature=temperature if temperature > 0 else 1.0, top_p=top_p, top_k=top_k,
                                   greedy=temperature <= 0, min_p=min_p, repetition_penalty=repetition_penalty)
        texts = tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
        lengths = rollout.completion_mask.sum(-1).tolist()
        truncated = rollout.is_truncated.tolist()
        formatted = format_reward([], texts)
        ids = [row[: int(n)].tolist() for row, n in zip(rollout.completion_ids.cpu(), lengths)]
        done = []
        for k, i in enumerate(index):
            rows = range(k * num_samples, (k + 1) * num_samples)
            answers = [extract_answer(texts[r]) for r in rows]
            gold = records[i]["answer"]
            results[i] = {
                "gold": gold,
                "completions": [texts[r] for r in rows],
                "answers": answers,
                "correct": [answers_match(a, gold) for a in answers],
                "lengths": [int(lengths[r]) for r in rows],
                "truncated": [bool(truncated[r]) for r in rows],
                "formatted": [formatted[r] > 0 for r in rows],
                "token_ids": [ids[r] for r in rows],
            }
            done.append(results[i])
        if on_batch is not None:
            on_batch(done)
    return results


def summarize(results: list[dict]) -> dict[str, float]:
    """Accuracy (mean over samples and problems), mean completion length, truncated and formatted shares."""
    flat = [(c, n, t, f) for r in results for c, n, t, f in zip(r["correct"], r["lengths"], r["truncated"],
                                                                   r["formatted"])]
    count = max(len(flat), 1)
    return {
        "accuracy": sum(c for c, _, _, _ in flat) / count,
        "mean_length": sum(n for _, n, _, _ in flat) / count,
        "truncated_ratio": sum(t for _, _, t, _ in flat) / count,
        "format": sum(f for _, _, _, f in flat) / count,
        "num_problems": float(len(results)),
    }


# ---------------------------------------------------------------------------------------------------------------
# Metrics over sampled completions (pure: lists in, numbers out)


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
    rows = [(i, ids) for i, r in enumerate(results) for ids in r["token_ids"]]
    kl_sum = entropy_sum = tokens = 0.0
    for start in range(0, len(rows), batch_size):
        chunk = [(i, ids) for i, ids in rows[start : start + batch_size] if ids]
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
        index = torch.arange(len(chunk), device=device)
        temps = torch.full((len(chunk),), temp, device=device)
        logp, entropy = completion_logps(model, prompt_ids, prompt_mask, index, completion, mask, temps)
        ref_logp = logp if reference is model else completion_logps(  # the reference itself: KL 0, one pass
            reference, prompt_ids, prompt_mask, index, completion, mask, temps, with_entropy=False)[0]
        log_u = (ref_logp - logp).clamp(-20, 20)
        kl = (torch.exp(log_u) - log_u - 1) * mask
        kl_sum += float(kl.sum())
        entropy_sum += float((entropy * mask).sum())
        tokens += float(mask.sum())
    return kl_sum / max(tokens, 1.0), entropy_sum / max(tokens, 1.0)
