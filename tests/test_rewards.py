"""Reward parsing is where silent bugs live (STYLE.md habit 10): hand-written expected values on concrete, realistic
model outputs, malformed ones included, plus gold answers from the real data sets."""

import json
import math
import os
import threading
from pathlib import Path

import pytest

from lib.rewards import (
    REWARD_FUNCS,
    accuracy_reward,
    answers_match,
    extract_answer,
    format_reward,
    resolve_reward_funcs,
    score_completions,
    think_format_reward,
    weighted_sum,
)

EMMA = "Emma has 18 cards, so Emma has 18 + 34 = 52 cards.\nAnswer: 52."
THINK = "<think>\nEmma has 18 + 24 = 42 cards.\n</think>\n<answer>\n42\n</answer>"

# (completion, extract_answer, format_reward)
CASES = [
    (EMMA, "52", 1.0),
    ("Sara has 12 - 16 = 2 pencils left.", "2", 0.0),  # last number; "- 16" is not a negative number
    ("The answer is: 41", "41", 0.0),  # "answer is:" is not an "Answer:" line
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 0.0),
    (THINK, "42", 0.0),
    ("", None, 0.0),
    ("Answer: Answer:", None, 0.0),  # empty value after the last "answer:"
    ("Answer: 1,000", "1000", 1.0),
    ("Answer: $52", "52", 1.0),
    ("answer: -3.5", "-3.5", 0.0),  # extraction is case-insensitive, the format is not
    ("So it is \\boxed{\\frac{1}{2}", "2", 0.0),  # unbalanced box: falls through to the last number
    ("Step 1: 3 + 4 = 7.\nAnswer: 7 apples", "7 apples", 0.0),  # unit word kept; not a single value
    ("**Answer:** 18", "18", 0.0),  # markdown bold still extracts
    ("Answer: The answer is 52", "The answer is 52", 0.0),
    ("Answer: 52\nI hope this helps!", "52", 0.0),  # the Answer line is not the last line
    ("First 10.\nAnswer: 3\nWait.\nAnswer: 4", "4", 1.0),  # the LAST Answer line
    ("Answer: \\boxed{17}", "17", 1.0),
    ("Answer: \\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt{3}}{2}", 1.0),
    ("We get x = -7 after all.", "-7", 0.0),
    ("Total: 1,234,567.5 dollars", "1234567.5", 0.0),
    ("The final answer: 3.14", "3.14", 0.0),
    ("🎉 Sie hat 7 Äpfel 🍎", "7", 0.0),  # unicode around the number
    ("Answer: ٣", "٣", 1.0),  # Arabic-Indic digit: extracted, a single value, but math-verify cannot read it
    ("no numbers here at all", None, 0.0),
    ("Answer: " + "9" * 5000, "9" * 5000, 0.0),  # huge number: too long for a single value
]


@pytest.mark.parametrize("completion, expected, _", CASES)
def test_extract_answer(completion, expected, _):
    assert extract_answer(completion) == expected


def test_format_reward():
    completions = [c for c, _, _ in CASES]
    assert format_reward([""] * len(CASES), completions) == [f for _, _, f in CASES]


@pytest.mark.parametrize(
    "predicted, gold, expected",
    [
        ("52", "52", True),
        ("52.0", "52", True),
        ("145", "145.0", True),  # SVAMP gold is a float
        ("1,000", "1000", True),
        ("1000", "1,000", True),  # GSM8K gold keeps thousands commas
        ("0.5", "\\frac{1}{2}", True),
        ("\\dfrac12", "\\frac{1}{2}", True),  # bare math-verify parses "\dfrac12" as nothing; $...$ fixes it
        ("(3,\\frac{\\pi}{2})", "(3, \\frac{\\pi}{2})", True),
        ("3\\sqrt{13}", "3", False),  # bare math-verify would read only the 3
        ("7 apples", "7", True),
        ("10\\text{ cm}", "10", True),
        ("−3", "-3", True),  # U+2212 minus
        ("53", "52", False),
        ("-3.5", "3.5", False),
        ("The answer is 52", "52", True),  # math-verify's own "answer is" anchor finds the 52
        ("٣", "3", False),
        ("9" * 5000, "52", False),  # past Python's int-string limit: math-verify returns nothing, no exception
        ("123456789012345678901234567890", "123456789012345678901234567890", True),
        ("123456789012345678901234567891", "123456789012345678901234567890", False),
        (None, "52", False),
        ("", "52", False),
        ("52", "", False),
        ("Answer:", "52", False),
    ],
)
def test_answers_match(predicted, gold, expected):
    assert answers_match(predicted, gold) is expected


def test_answers_match_outside_the_main_thread():
    # math-verify's signal-based timeout raises ValueError off the main thread unless it is disabled.
    results = []
    thread = threading.Thread(target=lambda: results.append(answers_match("0.5", "\\frac{1}{2}")))
    thread.start()
    thread.join()
    assert results == [True]


def test_accuracy_reward():
    completions = [EMMA, "Sara has 12 - 16 = 2 pencils left.", THINK, "", "\\boxed{\\frac{1}{2}}", "Answer: 146"]
    gold = ["52", "-4", "42", "52", "0.5", "145.0"]
    assert accuracy_reward([""] * 6, completions, answer=gold, other_column=[0] * 6) == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]


def test_think_format_reward():
    completions = [
        THINK,
        "<think>\nx\n</think>\n<answer>\n42\n</answer>\nextra line",  # passes: MULTILINE `$`, as in open-r1
        "<think>x</think><answer>42</answer>",  # no newlines
        "<answer>\n42\n</answer>",
        EMMA,
        "",
    ]
    assert think_format_reward([""] * 6, completions) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


# --- real gold answers ----------------------------------------------------------------------------------------------

DATA_DIR = Path(os.environ.get("AGRPO_DATA_DIR", Path(__file__).resolve().parents[2] / "shared" / "data"))


def _golds(relative_path: str, gold_of, n: int = 20) -> list[str]:
    path = DATA_DIR / relative_path
    if not path.is_file():
        pytest.skip(f"{path} not found; set AGRPO_DATA_DIR to the folder holding gsm8k/, math500/, svamp/, mawps/")
    with path.open() as f:
        return [gold_of(json.loads(line)) for line, _ in zip(f, range(n))]


@pytest.mark.parametrize(
    "relative_path, gold_of",
    [
        ("gsm8k/test.jsonl", lambda r: r["answer"].split("#### ")[-1].strip()),
        ("svamp/test.jsonl", lambda r: str(r["Answer"])),  # "145.0"
        ("mawps/singleop.jsonl", lambda r: str(r["target"])),
    ],
)
def test_real_numeric_golds(relative_path, gold_of):
    golds = _golds(relative_path, gold_of)
    right = [f"Let me compute step by step.\nAnswer: {g}" for g in golds]
    values = [float(g.replace(",", "")) + 1 for g in golds]
    wrong = [f"Let me compute step by step.\nAnswer: {int(v) if v.is_integer() else v}" for v in values]
    n = len(golds)
    assert accuracy_reward([""] * n, right, answer=golds) == [1.0] * n
    assert accuracy_reward([""] * n, wrong, answer=golds) == [0.0] * n


def test_real_latex_golds():
    golds = _golds("math500/test.jsonl", lambda r: r["answer"])
    assert "\\frac{14}{3}" in golds and "\\left( 3, \\frac{\\pi}{2} \\right)" in golds  # LaTeX is in this slice
    right = [f"Thus the result follows.\nAnswer: {g}" for g in golds]
    # Another problem's answer is a wrong LaTeX answer (the first 20 golds are pairwise different values).
    wrong = [f"Thus the result follows.\nAnswer: {g}" for g in golds[1:] + golds[:1]]
    n = len(golds)
    assert accuracy_reward([""] * n, right, answer=golds) == [1.0] * n
    assert accuracy_reward([""] * n, wrong, answer=golds) == [0.0] * n


# --- resolving reward specs -----------------------------------------------------------------------------------------

CUSTOM = """
def length_score(prompts, completions, **columns):
    return [len(c) / 10 for c in completions]

not_callable = 3
"""


def test_resolve_builtin_and_custom(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(CUSTOM)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    resolved = resolve_reward_funcs(["accuracy", "format", "my_rewards:length_score"])
    assert [name for name, _ in resolved] == ["accuracy", "format", "length_score"]
    assert resolved[0][1] is REWARD_FUNCS["accuracy"]
    assert resolved[2][1]([""], ["abcde"]) == [0.5]
    # A file path, relative to the working directory or absolute.
    for spec in ["my_rewards.py:length_score", f"{tmp_path / 'my_rewards.py'}:length_score"]:
        [(name, func)] = resolve_reward_funcs([spec])
        assert name == "length_score" and func([""], ["ab"]) == [0.2]


@pytest.mark.parametrize(
    "spec, problem",
    [
        ("acuracy", "unknown name"),
        ("no_such_module_xyz:score", "cannot import module 'no_such_module_xyz'"),
        ("missing_file.py:score", "file 'missing_file.py' not found"),
        ("my_rewards:nope", "has no attribute 'nope'"),
        ("my_rewards:not_callable", "is a int, not a function"),
        ("my_rewards.py:not_callable", "is a int, not a function"),
    ],
)
def test_resolve_errors(spec, problem, tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(CUSTOM)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as info:
        resolve_reward_funcs([spec])
    message = str(info.value)
    assert repr(spec) in message and problem in message
    assert "accuracy, format, think_format" in message and "'module:function'" in message


def test_resolve_rejects_duplicate_names():
    with pytest.raises(ValueError, match="unique"):
        resolve_reward_funcs(["accuracy", "accuracy"])


# --- scoring a batch ------------------------------------------------------------------------------------------------


def flaky(prompts, completions, answer, **columns):
    """Raises on the completion that says 'boom', like a user parser hitting odd output."""
    if any("boom" in c for c in completions):
        raise KeyError("boom")
    return [None if g == "skip" else 0.5 for g in answer]


def test_score_completions_isolates_a_raising_completion():
    funcs = [("accuracy", accuracy_reward), ("flaky", flaky)]
    completions = ["Answer: 52", "boom", "Answer: 3"]
    columns = {"answer": ["52", "7", "skip"]}
    with pytest.warns(RuntimeWarning, match="'flaky' raised KeyError") as record:
        rewards, errors = score_completions(funcs, ["q"] * 3, completions, columns)
    assert len(record) == 1  # one line for the one distinct failure
    assert rewards[0] == [1.0, 0.0, 0.0]
    assert rewards[1][:2] == [0.5, 0.0] and math.isnan(rewards[1][2])  # None -> NaN
    assert errors == {"accuracy": 0, "flaky": 1}

    with pytest.warns(RuntimeWarning):
        rewards, errors = score_completions(funcs, ["q"] * 3, completions, columns, error_value=None)
    assert rewards[1][0] == 0.5 and math.isnan(rewards[1][1]) and errors["flaky"] == 1


def test_score_completions_warns_when_only_the_batch_fails():
    def batch_only(prompts, completions, **columns):
        if len(completions) > 1:
            raise RuntimeError("batch too big")
        return [1.0]

    with pytest.warns(RuntimeWarning, match="on the batch but on no single completion"):
        rewards, errors = score_completions([("batch_only", batch_only)], ["q", "q"], ["a", "b"], {})
    assert rewards == [[1.0, 1.0]] and errors == {"batch_only": 0}


def test_score_completions_rejects_malformed_output():
    def too_short(prompts, completions, **columns):
        return [1.0]

    def text(prompts, completions, **columns):
        return ["1"] * len(completions)

    with pytest.raises(ValueError, match="'too_short' returned 1 values for 2 completions"):
        score_completions([("too_short", too_short)], ["q", "q"], ["a", "b"], {})
    with pytest.raises(ValueError, match="'text' returned '1'"):
        score_completions([("text", text)], ["q", "q"], ["a", "b"], {})
    with pytest.raises(ValueError, match="column 'answer' has 1 values for 2 completions"):
        score_completions([("format", format_reward)], ["q", "q"], ["a", "b"], {"answer": ["1"]})


# --- weighted sum ---------------------------------------------------------------------------------------------------


def test_weighted_sum_skips_nan():
    nan = math.nan
    rewards = [[1.0, 0.0, nan, nan], [1.0, nan, 0.5, nan]]
    total = weighted_sum(rewards, [1.0, 2.0])
    assert total[:3] == [3.0, 0.0, 1.0] and math.isnan(total[3])
    with pytest.raises(ValueError, match="2 reward weights for 1 reward functions"):
        weighted_sum(rewards[:1], [1.0, 2.0])
