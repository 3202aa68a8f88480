"""lib/evaluation/accuracy.py and lib/evaluation/metrics.py: the metrics with hand-computed values, answer checking on real
records of every data set, and the KL / entropy pass on the real embedded model."""

import math

import pytest
import torch

from lib.data.records import load_records
from lib.evaluation.metrics import (bootstrap_interval, completion_kl_entropy, majority_answer, pass_at_k,
                                     score_problems, win_rate)
from lib.rewards.functions import answers_match, extract_answer


@pytest.mark.parametrize("n, c, k, expected", [
    (5, 2, 1, 0.4),                      # pass@1 = c / n
    (5, 2, 2, 1 - 3 / 10),               # 1 - C(3,2)/C(5,2)
    (10, 3, 4, 1 - 35 / 210),            # 1 - C(7,4)/C(10,4)
    (5, 0, 3, 0.0),
    (5, 1, 5, 1.0),                      # all samples drawn: one is right
    (4, 2, 3, 1.0),                      # n - c < k: any 3 of 4 include a right one
])
def test_pass_at_k_matches_the_binomial_formula(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))


def test_pass_at_k_needs_k_between_1_and_n():
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)


@pytest.mark.parametrize("answers, expected", [
    (["3", "5", "5", None, "3"], "3"),   # a tie goes to the answer seen first
    (["5", None, None], "5"),            # no answer never wins
    ([None, None], None),
    (["7"], "7"),
])
def test_majority_answer(answers, expected):
    assert majority_answer(answers) == expected


def test_bootstrap_interval_brackets_the_mean_with_the_normal_width():
    values = [0.0, 1.0] * 100  # mean 0.5, standard error 0.035: a 95% interval of about +-0.07
    low, high = bootstrap_interval(values, seed=3)
    assert 0.42 < low < 0.46 and 0.54 < high < 0.58
    assert bootstrap_interval(values, seed=3) == (low, high)  # seeded
    assert bootstrap_interval([0.25] * 10) == (pytest.approx(0.25), pytest.approx(0.25))


def test_win_rate_pairs_samples_and_counts_ties_half():
    # pairs: 1>0 win, 0=0 tie, 0<1 loss, 0=0 tie -> (1 + 0.5 + 0 + 0.5) / 4
    assert win_rate([[1.0, 0.0], [0.0, 0.0]], [[0.0, 0.0], [1.0, 0.0]]) == 0.5
    assert win_rate([[1.0], [1.0]], [[0.0], [1.0]]) == 0.75
    with pytest.raises(ValueError, match="problems"):
        win_rate([[1.0]], [[1.0], [0.0]])


def _result(gold, answers, lengths=None, truncated=None):
    n = len(answers)
    return {"gold": gold, "answers": answers, "correct": [answers_match(a, gold) for a in answers],
            "lengths": lengths or [10] * n, "truncated": truncated or [False] * n, "formatted": [True] * n,
            "completions": [f"Answer: {a}" for a in answers], "token_ids": [[1]] * n}


def test_score_problems_by_hand():
    results = [
        _result("5", ["5", "4", "5", "4"]),            # 2 of 4 right; majority of 4: tie 5/4 -> 5 (first) right
        _result("12", ["11", "11", "12", None]),       # 1 of 4; majority 11 wrong
        _result("0.5", ["\\frac12", "1/2", "2", "3"], lengths=[20, 20, 40, 40], truncated=[False, False, True, True]),
    ]
    row = score_problems(results, [1, 2, 4], seed=0)
    assert row["accuracy"] == pytest.approx((2 / 4 + 1 / 4 + 2 / 4) / 3)
    assert row["pass@1"] == pytest.approx(row["accuracy"])
    # pass@2 per problem: 1 - C(2,2)/C(4,2) = 5/6; 1 - C(3,2)/C(4,2) = 1/2; 5/6
    assert row["pass@2"] == pytest.approx((5 / 6 + 1 / 2 + 5 / 6) / 3)
    assert row["pass@4"] == pytest.approx(1.0)
    # maj@4: problem 1 -> "5" right; problem 2 -> "11" wrong; problem 3 -> "\frac12" (tie, first) right
    assert row["maj@4"] == pytest.approx(2 / 3)
    # maj@1 is the first sample: 5 right, 11 wrong, \frac12 right
    assert row["maj@1"] == pytest.approx(2 / 3)
    assert row["truncated_ratio"] == pytest.approx(2 / 12)
    assert row["mean_length"] == pytest.approx((8 * 10 + 2 * 20 + 2 * 40) / 12)
    assert row["accuracy_low"] <= row["accuracy"] <= row["accuracy_high"]
    assert row["num_problems"] == 3 and row["num_samples"] == 4


# every data set (its slice in tests/data), read by the loader the evaluator uses: the gold answer written as the model is
# asked to write it is right, another problem's gold is wrong (where the golds differ), malformed output is wrong
DATA_SETS = ["gsm8k/test.jsonl", "math500/test.jsonl", "svamp/test.jsonl", "mawps/singleop.jsonl",
             "mawps/addsub.jsonl", "mawps/multiarith.jsonl", "mawps/singleeq.jsonl", "aime24/test.jsonl",
             "amc23/test.jsonl", "math/test.jsonl"]
MALFORMED = ["", "Answer:", "Answer: \\boxed{", "\\boxed{}", "I cannot solve this.", "Answer: ???",
             "Answer: 1e99999", "Answer: " + "9" * 5000, "<answer></answer>", "\u200b\u202e 𝟘 Answer: ½?",
             "Answer: \\frac{1}{0}", "Answer: {{{{{{{{"]


@pytest.mark.parametrize("name", DATA_SETS)
def test_answer_checking_on_real_records(data_dir, name):
    records = load_records(str(data_dir / name), max_samples=12, seed=1)
    golds = [r["answer"] for r in records]
    right = [extract_answer(f"We work it out step by step.\nAnswer: {g}") for g in golds]
    assert all(answers_match(a, g) for a, g in zip(right, golds)), [(a, g) for a, g in zip(right, golds)
                                                                      if not answers_match(a, g)]
    others = golds[1:] + golds[:1]
    wrong = [(o, g) for o, g in zip(others, golds) if not answers_match(g, o)]  # skip pairs of equal golds
    assert len(wrong) >= 8
    assert not any(answers_match(extract_answer(f"Answer: {o}"), g) for o, g in wrong)
    for text in MALFORMED:
        assert answers_match(extract_answer(text), golds[0]) is False


def test_kl_of_a_model_to_itself_is_zero_and_entropy_positive(tiny_model, tokenizer):
    from lib.data.records import format_prompt
    from lib.models.modeling import load_policy

    model = load_policy(tiny_model).eval()
    prompts = [format_prompt(tokenizer, "What is 2 + 3?"), format_prompt(tokenizer, "What is 7 - 4?")]
    ids = [tokenizer.encode(" The answer is 5.", add_special_tokens=False),
           tokenizer.encode("Answer: 3", add_special_tokens=False)]
    results = [{"token_ids": [ids[0]]}, {"token_ids": [ids[1], ids[1][:2]]}]
    # the reference as a second copy of the same weights, not the same object: completion_kl_entropy's
    # `reference is model` shortcut (eval_agrpo.py's reference row: one pass instead of two) is not taken, so both
    # forwards and the k3 math run
    copy = load_policy(tiny_model).eval()
    kl, entropy = completion_kl_entropy(model, copy, tokenizer, prompts, results, temperature=0.0,
                                        max_prompt_length=128)
    # Two copies of the same weights on the same inputs run the same kernels in the same order: their log-probs are
    # bitwise equal on this CPU and the KL is exactly 0. The bound 1e-6 also holds on a CPU whose kernels are not
    # run-to-run deterministic: k3 of a log-prob difference d is d^2 / 2 + O(d^3), so float32 noise d ~ 1e-5 gives
    # ~1e-10, while k3 without its -1 would give 1.
    assert kl == pytest.approx(0.0, abs=1e-6)
    assert 0.0 < entropy < math.log(len(tokenizer))
    shortcut = completion_kl_entropy(model, model, tokenizer, prompts, results, temperature=0.0,
                                     max_prompt_length=128)
    assert shortcut == pytest.approx((0.0, entropy), abs=1e-6)  # the shortcut gives the same

    # a perturbed copy is a different distribution: its KL to the reference at a sampling temperature is the k3 token
    # mean of the two models' per-token log-probs, computed here from plain forwards of each unpadded
    # [prompt; completion] (the function pads prompts and runs completions on a shared-prefix cache)
    other = load_policy(tiny_model).eval()
    with torch.no_grad():
        other.model.norm.weight.mul_(3)  # KL 0.18 at temperature 0.7 (x 4: 0.56, x 10: 2900)
    temperature = 0.7
    kl_other, entropy_other = completion_kl_entropy(other, model, tokenizer, prompts, results,
                                                    temperature=temperature, max_prompt_length=128)
    k3, entropies = [], []
    with torch.no_grad():
        for i, completion in [(0, ids[0]), (1, ids[1]), (1, ids[1][:2])]:
            prompt = tokenizer.encode(prompts[i], add_special_tokens=False)
            sequence = torch.tensor([prompt + completion])
            at = slice(len(prompt) - 1, len(prompt) - 1 + len(completion))  # the positions predicting completion
            target = torch.tensor(completion)[:, None]
            logp_all = torch.log_softmax(other(sequence).logits[0, at].double() / temperature, dim=-1)
            ref_all = torch.log_softmax(model(sequence).logits[0, at].double() / temperature, dim=-1)
            log_u = ref_all.gather(1, target) - logp_all.gather(1, target)
            k3 += (torch.exp(log_u) - log_u - 1).flatten().tolist()
            entropies += (-(logp_all.exp() * logp_all).sum(-1)).tolist()
    assert len(k3) == len(ids[0]) + len(ids[1]) + 2
    kl_hand = sum(k3) / len(k3)
    assert kl_hand > 1e-2
    # Both sides are float32 forwards of the same weights that differ only in padding, the prefix cache and summation
    # order. Measured on this CPU (the tiny random model): KL 0.1797377 by hand and by the function (relative gap
    # 5e-7); entropies 1e-7 apart. The bounds leave 100x for other CPUs' kernels; a missing temperature (KL 0.070)
    # or another estimator is far outside them.
    assert kl_other == pytest.approx(kl_hand, rel=1e-3)
    assert entropy_other == pytest.approx(sum(entropies) / len(entropies), rel=1e-5)
