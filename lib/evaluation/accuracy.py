"""Scoring a model on held-out problems: the loop the trainer's periodic evaluation and eval_agrpo.py share.

Generation goes through a rollout backend (greedy or sampled), answers are checked with the same function the training
reward uses (`lib.rewards.functions.answers_match` through `extract_answer`), so a number in the training log and a number from
the evaluator mean the same thing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lib.data.records import tokenize_prompts
from lib.rewards.functions import answers_match, extract_answer, format_reward


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
    min_p: float | None = 0.0,
    repetition_penalty: float = 1.0,
    device: torch.device | str = "cpu",
    on_batch: Callable[[list[dict]], None] | None = None,
    episodes=None,
) -> list[dict]:
    """Complete every prompt `num_samples` times (greedy when temperature is 0) and score each completion.

    Returns one dict per record, in the order given: {"gold": str, "completions": [str], "answers": [str | None],
    "correct": [bool], "lengths": [int], "truncated": [bool], "formatted": [bool], "token_ids": [[int]]}. Prompts are
    batched in order of length, so a batch wastes little on padding. `on_batch` is called with each batch's results as
    they come (a progress bar with the running accuracy).

    `episodes` (lib/agents/episodes.Agent: a run with tools) continues each completion into an episode, its tool calls
    run and their results appended (docs/agents.md); a result then also holds "tool_calls": [int] per completion and
    "model_mask": [[int]], 1 at the model's tokens of "token_ids" and 0 at the tools'. "lengths" count the model's
    tokens; "completions" are the whole episodes' texts, results included, as the reward functions read them.
    min_p None is off, as 0 is (the trainer's `min_p` default).
    """
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    results: list[dict | None] = [None] * len(prompts)
    for start in range(0, len(order), batch_size):
        index = order[start : start + batch_size]
        prompt_ids, prompt_mask = tokenize_prompts(tokenizer, [prompts[i] for i in index], max_prompt_length, device)
        sampling = dict(temperature=temperature if temperature > 0 else 1.0, top_p=top_p, top_k=top_k,
                        greedy=temperature <= 0, min_p=min_p or 0.0, repetition_penalty=repetition_penalty)
        rollout = backend.generate(prompt_ids, prompt_mask, num_samples, max_new_tokens, **sampling)
        calls = None
        if episodes is not None:
            rollout, finished = episodes.run(rollout, backend, sampling)
            calls = [e.calls for e in finished]
        texts = tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
        lengths = rollout.completion_mask.sum(-1).tolist()
        truncated = rollout.is_truncated.tolist()
        formatted = format_reward([], texts)
        spans = rollout.attended().sum(-1).tolist()  # every token of an episode, the tools' results included
        ids = [row[: int(n)].tolist() for row, n in zip(rollout.completion_ids.cpu(), spans)]
        model = [row[: int(n)].tolist() for row, n in zip(rollout.completion_mask.cpu(), spans)]
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
            if calls is not None:
                results[i]["tool_calls"] = [calls[r] for r in rows]
                results[i]["model_mask"] = [model[r] for r in rows]
            done.append(results[i])
        if on_batch is not None:
            on_batch(done)
    return results


def summarize(results: list[dict]) -> dict[str, float]:
    """Accuracy (mean over samples and problems), mean completion length, truncated and formatted shares, and with
    tools the tool calls per completion ("tool_calls")."""
    flat = [(c, n, t, f) for r in results for c, n, t, f in zip(r["correct"], r["lengths"], r["truncated"],
                                                                   r["formatted"])]
    count = max(len(flat), 1)
    summary = {
        "accuracy": sum(c for c, _, _, _ in flat) / count,
        "mean_length": sum(n for _, n, _, _ in flat) / count,
        "truncated_ratio": sum(t for _, _, t, _ in flat) / count,
        "format": sum(f for _, _, _, f in flat) / count,
        "num_problems": float(len(results)),
    }
    if results and "tool_calls" in results[0]:
        summary["tool_calls"] = sum(sum(r["tool_calls"]) for r in results) / count
    return summary
