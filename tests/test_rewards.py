"""Reward parsing is where silent bugs live: hand-written expected values on concrete, realistic model outputs,
malformed ones included, plus gold answers from the real data sets."""

import json
import math
import re
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO
from lib.rewards.open_r1 import (REWARD_FUNCS as NAMED, cosine_reward, reasoning_steps_reward,
                                        repetition_reward, soft_overlong_reward, tag_count_reward, think_format_reward)
from lib.rewards.functions import REWARD_FUNCS, accuracy_reward, answers_match, extract_answer, format_reward, length_reward
from lib.rewards.scoring import RewardState, resolve_reward_funcs, reward_arguments, score_completions

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
    thread.join(timeout=60)
    assert not thread.is_alive(), "answers_match did not return within 60 s off the main thread"
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


# --- length-shaped rewards ------------------------------------------------------------------------------------------

RIGHT, WRONG = "Answer: 52", "Answer: 53"  # gold 52


@pytest.mark.parametrize(
    "completions, expected",
    [
        # lengths 10 / 20 / 30: lambda = 0.5 - (L - 10)/20 = 0.5, 0.0, -0.5
        ([RIGHT, RIGHT, RIGHT], [0.5, 0.0, -0.5]),
        ([WRONG, WRONG, WRONG], [0.0, 0.0, -0.5]),  # wrong: min(0, lambda); the short wrong one earns nothing
        ([RIGHT, WRONG, WRONG], [0.5, 0.0, -0.5]),
        ([WRONG, RIGHT, RIGHT], [0.0, 0.0, -0.5]),
        ([WRONG, WRONG, RIGHT], [0.0, 0.0, -0.5]),  # a long correct answer is still punished for its length
    ],
)
def test_length_reward_one_group(completions, expected):
    assert length_reward(["q"] * 3, completions, answer=["52"] * 3, completion_length=[10, 20, 30]) == expected


def test_length_reward_equal_lengths_and_single_completion():
    assert length_reward(["q"] * 3, [RIGHT, WRONG, ""], answer=["52"] * 3, completion_length=[7, 7, 7]) == [0.0] * 3
    assert length_reward(["q"], [RIGHT], answer=["52"], completion_length=[10]) == [0.0]
    assert length_reward([], [], answer=[], completion_length=[]) == []


def test_length_reward_interleaved_groups():
    # p: completions 0, 2, 4 with lengths 10, 30, 20 -> lambda 0.5, -0.5, 0.0
    # q: completions 1, 3 with lengths 100, 40 -> lambda 0.5 - 60/60 = -0.5, 0.5 - 0/60 = 0.5
    # (one min/max over the whole call, 10 and 100, would give 0.5, -0.5, 0.5 - 20/90, 0.5 - 30/90, 0.5 - 10/90)
    prompts = ["p", "q", "p", "q", "p"]
    completions = [RIGHT, RIGHT, WRONG, WRONG, RIGHT]
    rewards = length_reward(prompts, completions, answer=["52"] * 5, completion_length=[10, 100, 30, 40, 20])
    assert rewards == [0.5, -0.5, -0.5, 0.0, 0.0]  # idx 3: wrong, min(0, 0.5) = 0; idx 4: correct, lambda 0


def test_length_reward_characters_and_malformed_output():
    # No completion_length column: characters. "Answer: 52" 10, "18 + 34 = 52\nAnswer: 52" 12 + 1 + 10 = 23,
    # "Answer: 5" 9 -> range 14: lambda = 0.5 - 1/14 = 3/7, 0.5 - 14/14 = -0.5, 0.5 (wrong -> 0)
    completions = [RIGHT, "18 + 34 = 52\nAnswer: 52", "Answer: 5"]
    assert length_reward(["q"] * 3, completions, answer=["52"] * 3) == pytest.approx([3 / 7, -0.5, 0.0])
    # Malformed: "" (0, no answer), "no idea" (7, no answer), "<answer>52" (10, unbalanced tag: the last number,
    # 52, is correct) -> range 10: lambda 0.5, 0.5 - 0.7 = -0.2, -0.5
    malformed = ["", "no idea", "<answer>52"]
    assert length_reward(["q"] * 3, malformed, answer=[52] * 3) == pytest.approx([0.0, -0.2, -0.5])  # int gold


def test_cosine_reward_tokens():
    # max_len 100; correct: 0.5 + 0.25 (1 + cos(pi p)); wrong: -0.5 - 0.25 (1 + cos(pi p))
    lengths = [0, 25, 50, 100, 0, 50, 100, 200]
    completions = [RIGHT] * 4 + [WRONG] * 4
    rewards = cosine_reward(["q"] * 8, completions, answer=["52"] * 8, completion_length=lengths, max_len=100)
    expected = [
        1.0,  # cos 0 = 1: 0.5 + 0.25 * 2
        0.5 + 0.25 * (1 + math.sqrt(2) / 2),  # cos(pi/4): 0.9268
        0.75,  # cos(pi/2) = 0
        0.5,  # cos(pi) = -1
        -1.0,  # short wrong: -0.5 - 0.25 * 2
        -0.75,
        -0.5,  # long wrong
        -0.5,  # 200 > max_len clamps to p = 1; open-r1 (cos 2 pi = 1) would give -1.0
    ]
    assert rewards == pytest.approx(expected)


def test_cosine_reward_characters_options_and_malformed_output():
    # No completion_length: characters, with max_len 20. "Answer: 52" / "Answer: 53": 10 chars, p = 0.5, cos = 0;
    # "": wrong at p = 0 -> -1.0 (an empty completion is a short wrong one);
    # "no numbers here at all": 22 chars -> p clamps to 1, wrong -> -0.5;
    # "<think>\n52": 10 chars, no tags closed, the last number 52 is correct -> 0.75
    completions = [RIGHT, WRONG, "", "no numbers here at all", "<think>\n52"]
    rewards = cosine_reward(["q"] * 5, completions, answer=["52"] * 5, max_len=20)
    assert rewards == pytest.approx([0.75, -0.75, -1.0, -0.5, 0.75])
    # open-r1's ScriptArguments defaults for wrong answers (min 0.0, max -0.5): lo = -0.5, hi = 0.0,
    # so p = 0 -> -0.5 + 0.5 * 0.5 * (1 + 1) = 0.0 and p = 1 -> -0.5 + 0.5 * 0.5 * (1 - 1) = -0.5
    rewards = cosine_reward(["q"] * 2, [WRONG, WRONG], answer=["52"] * 2, completion_length=[0, 100], max_len=100,
                            min_value_wrong=0.0, max_value_wrong=-0.5)
    assert rewards == pytest.approx([0.0, -0.5])
    with pytest.raises(ValueError, match="max_len must be positive"):
        cosine_reward(["q"], [RIGHT], answer=["52"], max_len=0)


@pytest.mark.parametrize(
    "completion_length, expected",
    [
        # L_max 100, L_cache 20: free up to 80, then (80 - L)/20, then -1
        (0, 0.0),
        (80, 0.0),  # last free length
        (81, -0.05),  # (80 - 81)/20
        (90, -0.5),  # (80 - 90)/20
        (100, -1.0),  # (80 - 100)/20 at L_max itself
        (101, -1.0),  # past L_max
    ],
)
def test_soft_overlong_reward_boundaries(completion_length, expected):
    rewards = soft_overlong_reward(["q"], [""], completion_length=[completion_length],
                                   max_completion_length=100, overlong_buffer_length=20)
    assert rewards == pytest.approx([expected])


def test_soft_overlong_reward_defaults_and_errors():
    # verl DAPO values 20480 / 4096: free up to 16384; 16385 -> -1/4096; 20480 -> -4096/4096 = -1
    lengths = [16384, 16385, 20480, 20481]
    rewards = soft_overlong_reward(["q"] * 4, ["x"] * 4, completion_length=lengths)
    assert rewards == pytest.approx([0.0, -1 / 4096, -1.0, -1.0])
    # buffer == limit: punishment starts from the first token, 5 tokens of 10 -> (0 - 5)/10
    assert soft_overlong_reward(["q"] * 2, ["", "x"], completion_length=[0, 5], max_completion_length=10,
                                overlong_buffer_length=10) == [0.0, -0.5]
    with pytest.raises(ValueError, match="'completion_length'"):
        soft_overlong_reward(["q"], ["Answer: 52"])
    for buffer in [0, -1, 101]:
        with pytest.raises(ValueError, match="overlong_buffer_length"):
            soft_overlong_reward(["q"], [""], completion_length=[1], max_completion_length=100,
                                 overlong_buffer_length=buffer)


# --- text-shape rewards ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, kwargs, expected",
    [
        ("one", {}, 0.0),  # 1 word < 3
        ("", {}, 0.0),
        ("  \n ", {}, 0.0),  # whitespace only: no words
        ("a b c a b c a b c", {}, -4 / 7),  # 7 trigrams abc bca cab abc bca cab abc, 3 distinct: (1 - 3/7) * -1
        ("the cat sat on the mat", {}, 0.0),  # 4 trigrams, all distinct
        ("A b C a B c", {}, -0.25),  # lower-cased: abc bca cab abc, 3 of 4 distinct: (1 - 3/4) * -1
        ("Answer: Answer: Answer: Answer:", {}, -0.5),  # a degenerate loop: 2 trigrams, 1 distinct: (1 - 1/2) * -1
        ("a a a a", {"ngram_size": 2, "max_penalty": -0.5}, -1 / 3),  # 3 bigrams, 1 distinct: (1 - 1/3) * -0.5
        ("a b", {"ngram_size": 2}, 0.0),  # exactly n words: one n-gram, nothing repeated
    ],
)
def test_repetition_reward(completion, kwargs, expected):
    assert repetition_reward(["q"], [completion], **kwargs) == pytest.approx([expected])


def test_repetition_reward_rejects_bad_parameters():
    with pytest.raises(ValueError, match="max_penalty"):
        repetition_reward(["q"], ["a b c"], max_penalty=0.5)
    with pytest.raises(ValueError, match="ngram_size"):
        repetition_reward(["q"], ["a b c"], ngram_size=0)


def test_tag_count_reward():
    completions = [
        THINK,  # all four tags once: 4 * 0.25
        "<think>\n<think>\nx\n</think>\n<answer>\n42\n</answer>",  # "<think>\n" twice: 3 * 0.25
        EMMA,  # plain text
        "",
        "<think>\nhmm\n</think>\n<answer>\n42",  # unbalanced: no "\n</answer>"
        "<answer>\n42\n</answer>",  # at the very start "<answer>" has no "\n" before it: only "\n</answer>" counts
        "<think>x</think><answer>42</answer>",  # no newlines at all
    ]
    assert tag_count_reward([""] * 7, completions) == [1.0, 0.75, 0.0, 0.0, 0.75, 0.25, 0.0]


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("Step 1: add 18 and 34. Step 2: that is 52. Step 3: check it.", 1.0),  # 3 markers / 3
        ("Step 1: a\nStep 2: b\nStep 3: c\nStep 4: d", 1.0),  # min(1, 4/3)
        ("First, add 18 and 34. Finally, the total is 52.", 2 / 3),  # 2 markers
        ("1. Add.\n2. Multiply.\n3. Done.", 1 / 3),  # no MULTILINE flag: only the "1." at the very start counts
        ("- add\n- multiply\n- done", 2 / 3),  # "\n-" twice; the first "-" has no newline before it
        ("The sum is 52.\n**Answer:** 52", 1 / 3),  # markdown bold on a new line counts as "\n*"
        ("Step1: add. step 2: done.", 0.0),  # no space after "Step", lower-case "step"
        ("", 0.0),
        ("no steps here", 0.0),
    ],
)
def test_reasoning_steps_reward(completion, expected):
    assert reasoning_steps_reward(["q"], [completion]) == pytest.approx([expected])


# --- real gold answers ----------------------------------------------------------------------------------------------

def _golds(relative_path: str, gold_of, n: int = 20) -> list[str]:
    """The gold answers of the first `n` rows of a data set's slice (tests/data/README.md)."""
    with (REPO / "tests" / "data" / relative_path).open() as f:
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

def scaled(prompts, completions, *, scale=1.0, **columns):
    return [scale * len(c) for c in completions]

def column_names(prompts, completions, max_len=5, **columns):
    return [float(max_len + len(columns))] * len(completions)
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
    assert "accuracy, format, length" in message and "'module:function'" in message


def test_resolve_rejects_duplicate_names():
    with pytest.raises(ValueError, match="unique"):
        resolve_reward_funcs(["accuracy", "accuracy"])


def test_open_r1_rewards_resolve_only_where_the_entry_scripts_hand_them_over():
    """The core knows the presets' rewards; open-r1's others are lib/rewards/open_r1.py, which
    lib/models/reward_models.reward_functions passes as `named_rewards`: without it "cosine" is an unknown name, and
    every message lists the names it was given."""
    assert list(REWARD_FUNCS) == ["accuracy", "format", "length"]
    assert list(NAMED) == [*REWARD_FUNCS, "think_format", "cosine", "repetition", "soft_overlong", "tag_count",
                           "reasoning_steps"]
    with pytest.raises(ValueError, match=r"'cosine': unknown name\. Built-in reward functions: accuracy, format, "
                                         r"length\. For your own"):
        resolve_reward_funcs(["cosine"])
    with pytest.raises(ValueError, match=r"'no_such_module_xyz:f': cannot import .*Built-in reward functions: "
                                         r"accuracy, format, length, think_format, cosine, .*, reasoning_steps\. For"):
        resolve_reward_funcs(["no_such_module_xyz:f"], named_rewards=NAMED)
    assert [name for name, _ in resolve_reward_funcs(["accuracy", "tag_count"], named_rewards=NAMED)] == [
        "accuracy", "tag_count"]



def test_resolve_binds_options_to_keyword_only_parameters(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(CUSTOM)
    monkeypatch.syspath_prepend(str(tmp_path))
    options = {"max_len": 20, "ngram_size": 2, "max_penalty": -0.5, "max_completion_length": 100,
               "overlong_buffer_length": 20, "scale": 2.0}
    specs = ["accuracy", "cosine", "repetition", "soft_overlong", "my_rewards:scaled", "my_rewards:column_names"]
    resolved = dict(resolve_reward_funcs(specs, options, named_rewards=NAMED))
    assert list(resolved) == ["accuracy", "cosine", "repetition", "soft_overlong", "scaled", "column_names"]
    assert resolved["accuracy"] is accuracy_reward  # nothing to bind: the function itself
    assert resolved["cosine"](["q"], [RIGHT], answer=["52"]) == pytest.approx([0.75])  # 10 chars / max_len 20
    assert resolved["repetition"](["q"], ["a a a a"]) == pytest.approx([-1 / 3])  # bigrams, -0.5
    assert resolved["soft_overlong"](["q"], [""], completion_length=[90]) == pytest.approx([-0.5])  # (80 - 90)/20
    assert resolved["scaled"]([""], ["abc"]) == [6.0]  # keyword-only `scale` bound
    # **columns gets no options, and `max_len` (not keyword-only) keeps its default: 5 + 0 columns
    assert resolved["column_names"]([""], ["abc"]) == [5.0]
    rewards, _ = score_completions([("column_names", resolved["column_names"])], ["q"], ["abc"], {"answer": ["1"]})
    assert rewards == [[6.0]]  # 5 + 1 column (answer)
    assert resolve_reward_funcs(["cosine"], named_rewards=NAMED)[0][1] is cosine_reward  # options=None: unchanged


def test_the_configurations_options_reach_the_functions_as_the_trainer_hands_them_over():
    # lib/setup.resolve_rewards reads open-r1's options from the configuration (lib/rewards/open_r1.reward_options)
    from lib.config import parse_config
    from lib.setup import resolve_rewards

    cfg = parse_config(["--reward_funcs", "cosine", "soft_overlong", "--cosine_max_len", "20",
                        "--max_completion_length", "100", "--overlong_buffer_length", "20"])
    specs, resolved = resolve_rewards(cfg)
    assert specs == ["cosine", "soft_overlong"]
    assert dict(resolved)["cosine"](["q"], [RIGHT], answer=["52"]) == pytest.approx([0.75])  # 10 chars / 20
    assert dict(resolved)["soft_overlong"](["q"], [""], completion_length=[90]) == pytest.approx([-0.5])


def test_resolve_rejects_bad_options_at_start_up():
    # The default buffer 4096 is longer than a 64-token limit: caught here, not as an error on every step.
    with pytest.raises(ValueError, match="'soft_overlong'.*overlong_buffer_length"):
        resolve_reward_funcs(["soft_overlong"], {"max_completion_length": 64}, named_rewards=NAMED)
    with pytest.raises(ValueError, match="'repetition'.*max_penalty"):
        resolve_reward_funcs(["repetition"], {"max_penalty": 1.0}, named_rewards=NAMED)
    with pytest.raises(ValueError, match="'cosine'.*max_len"):
        resolve_reward_funcs(["cosine"], {"max_len": 0}, named_rewards=NAMED)


def test_score_completions_with_length_columns():
    # Through the trainer's path: length and soft_overlong read completion_length; accuracy ignores it.
    funcs = resolve_reward_funcs(["accuracy", "length", "soft_overlong"],
                                 {"max_completion_length": 40, "overlong_buffer_length": 20}, named_rewards=NAMED)
    columns = {"answer": ["52"] * 3, "completion_length": [10, 20, 30]}
    rewards, errors = score_completions(funcs, ["q"] * 3, [RIGHT, WRONG, RIGHT], columns)
    # length: lambda 0.5, 0.0, -0.5 (the wrong one min(0, 0) = 0); soft_overlong: free to 20, (20 - 30)/20 = -0.5
    assert rewards == [[1.0, 0.0, 1.0], [0.5, 0.0, -0.5], [0.0, 0.0, -0.5]]
    assert errors == {"accuracy": 0, "length": 0, "soft_overlong": 0}


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


# --- TRL's calling convention (docs/methods.md 2.5) -----------------------------------------------------------------

TRL_STYLE = Path(__file__).resolve().parent / "trl_style_rewards.py"


def conversation(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def test_every_builtin_scores_a_conversational_completion_as_its_text():
    texts = [EMMA, THINK, RIGHT, "First, 2.\nSecond, 3.\n- a a a a a a", ""]
    n = len(texts)
    options = {"max_len": 40, "max_completion_length": 40, "overlong_buffer_length": 20}
    funcs = resolve_reward_funcs(list(NAMED), options, named_rewards=NAMED)
    columns = {"answer": ["52", "42", "52", "5", "52"], "completion_length": [10, 25, 30, 35, 0]}
    messages = [[{"role": "user", "content": "q"}]] * n
    as_text, _ = score_completions(funcs, ["q"] * n, texts, columns)
    as_messages, _ = score_completions(funcs, messages, [conversation(t) for t in texts], columns)
    assert as_messages == as_text
    # the texts give every function some non-zero score, so equal lists are not equal zeros
    assert all(any(v != 0 for v in row) for row in as_text)


def test_reward_arguments_pass_prompts_and_completions_in_the_records_form():
    # lib/data/records.py's three forms: a conversation under `prompt`, a text `prompt` (TRL's standard form), `problem`
    chat = {"prompt": [{"role": "user", "content": "2+2?"}], "problem": "2+2?", "solution": "\\boxed{4}",
            "answer": "4"}
    text = {"prompt": "Q: 5+5?\nA:", "answer": "10"}
    math = {"problem": "3+3?", "answer": "6", "operation": "+"}
    prompts, completions, columns = reward_arguments([chat, chat], [None, None], ["\\boxed{4}", "5"])
    assert prompts == [chat["prompt"]] * 2 and completions == [conversation("\\boxed{4}"), conversation("5")]
    # every column but the prompt, as TRL passes them (`problem` is a column here: the prompt is `prompt`)
    assert columns == {"problem": ["2+2?"] * 2, "solution": ["\\boxed{4}"] * 2, "answer": ["4"] * 2}
    prompts, completions, columns = reward_arguments([text], ["Q: 5+5?\nA:"], [" 10"])
    assert prompts == ["Q: 5+5?\nA:"] and completions == [" 10"] and columns == {"answer": ["10"]}
    prompts, completions, columns = reward_arguments([math], ["<rendered>3+3?"], ["6"])
    assert prompts == ["<rendered>3+3?"] and completions == ["6"]
    assert columns == {"answer": ["6"], "operation": ["+"]}  # not `problem`: it reaches the function as the prompt
    # a reward model (lib/models/reward_models.py) reads each prompt from its record, as the policy's was built:
    # the system prompt first, the text as it is, the problem and the instruction as messages
    from lib.models.reward_models import RewardModel

    model = RewardModel(torch.nn.Linear(1, 1), None, "rm", instruction="Answer briefly.", system_prompt="Be brief.")
    assert model.prompts_of([chat, text, math]) == [
        [{"role": "system", "content": "Be brief."}, *chat["prompt"]], "Q: 5+5?\nA:",
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3+3?\nAnswer briefly."}]]
    assert model.prompts_of(None) is None  # without records, the prompts as given


def test_functions_written_for_trl_and_open_r1_run_unchanged():
    specs = [f"{TRL_STYLE}:{name}" for name in
             ("boxed_equals_solution", "opens_with_think", "token_count", "prompt_turns", "progress")]
    specs.append("trl_style_rewards.steps_done")  # TRL's dotted form (tests/ is on sys.path)
    funcs = resolve_reward_funcs(specs)
    assert [name for name, _ in funcs] == ["boxed_equals_solution", "opens_with_think", "token_count",
                                           "prompt_turns", "progress", "steps_done"]
    texts = ["<think>\nfour\n</think>\nSo \\boxed{4}", "\\boxed{5}"]
    messages = [[{"role": "user", "content": "2+2?"}]] * 2
    rewards, errors = score_completions(
        funcs, messages, [conversation(t) for t in texts], {"solution": ["\\boxed{4}"] * 2, "answer": ["4"] * 2},
        completion_ids=[[5, 6, 7], [8]], trainer_state=RewardState(global_step=3, max_steps=10, epoch=0.25))
    assert errors == dict.fromkeys(errors, 0)
    assert rewards[:4] == [[1.0, 0.0], [1.0, 0.0], [3.0, 1.0], [1.0, 1.0]]
    assert rewards[4] == pytest.approx([3.01000025] * 2, abs=1e-9) and rewards[5] == [3.0, 3.0]
    # without a trainer_state (a direct call, the evaluator), a function that needs one fails like any other
    with pytest.warns(RuntimeWarning, match="'steps_done' raised TypeError"):
        _, errors = score_completions(funcs[5:], messages, [conversation(t) for t in texts], {})
    assert errors == {"steps_done": 2}


def test_trl_names_map_to_ours_or_are_refused_with_what_to_use():
    """TRL's reward names are lib/trl_keys.py's: read as ours (or refused) with the configuration's keys."""
    from lib.config import ConfigError, make_config
    from lib.trl_keys import resolve_keys, reward_name

    options = {"max_completion_length": 40, "overlong_buffer_length": 20}
    funcs = resolve_reward_funcs([reward_name(s) for s in ("accuracy_reward", "get_soft_overlong_punishment")], options,
                                 named_rewards=NAMED)
    assert [name for name, _ in funcs] == ["accuracy", "soft_overlong"]
    assert funcs[0][1] is accuracy_reward
    # TRL's soft overlong punishment counts completion_ids; ours does too when completion_length is absent
    assert funcs[1][1](prompts=["q"] * 3, completions=["a"] * 3, completion_ids=[[1] * 10, [1] * 30, [1] * 50]) \
        == pytest.approx([0.0, -0.5, -1.0])
    with pytest.raises(ValueError, match=r"'think_format_reward': TRL's think_format_reward .* also requires an "
                                         r"<answer>.*Pass think_format"):
        reward_name("think_format_reward")
    with pytest.raises(ConfigError, match=r"reward_funcs: reward function 'reasoning_accuracy_reward': .* after the "
                                          r"last </think>.*Pass accuracy"):
        make_config({"reward_funcs": "reasoning_accuracy_reward"}, keys=resolve_keys)
    assert make_config({"reward_funcs": ["accuracy_reward", "format"]}, keys=resolve_keys).reward_funcs == [
        "accuracy", "format"]
    with pytest.raises(ValueError, match="'accuracy_reward': unknown name"):  # lib/rewards/scoring.py alone: ours only
        resolve_reward_funcs(["accuracy_reward"])


def test_reward_model_specs_are_told_apart_from_functions_before_anything_loads(tmp_path, monkeypatch):
    from lib.models.reward_models import RewardModelSpec, reward_model_spec

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_rm").mkdir()
    (tmp_path / "my_rm" / "config.json").write_text(json.dumps({"architectures": ["LlamaForSequenceClassification"]}))
    (tmp_path / "policy").mkdir()
    (tmp_path / "policy" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "empty").mkdir()
    resolved = resolve_reward_funcs(["my_rm", f"{tmp_path / 'my_rm'}/", "org/rm-v1.5"][::2], models=reward_model_spec)
    assert resolved == [("my_rm", RewardModelSpec("my_rm")), ("rm-v1.5", RewardModelSpec("org/rm-v1.5"))]
    assert resolve_reward_funcs([f"{tmp_path / 'my_rm'}/"], models=reward_model_spec)[0][0] == "my_rm"
    with pytest.raises(ValueError, match="'my_rm': unknown name"):  # a reward model only where `models` is given
        resolve_reward_funcs(["my_rm"])
    for spec, problem in [("policy", "holds a LlamaForCausalLM, not a sequence-classification model"),
                          ("empty", "a folder without config.json"),
                          ("rewards.py", "name the function in the file: 'rewards.py:function'"),
                          ("./no_such_rm", "no such folder")]:
        with pytest.raises(ValueError, match=re.escape(problem)):
            resolve_reward_funcs([spec], models=reward_model_spec)
    with pytest.raises(ValueError, match=r"reward model\(s\) \['my_rm'\] not loaded"):
        score_completions(resolved[:1], ["q"], ["a"], {})


def test_async_functions_run_concurrently_in_this_process():
    funcs = resolve_reward_funcs([f"{TRL_STYLE}:slow_length", f"{TRL_STYLE}:slow_words", "format"])
    texts = ["two words", "Answer: 3"]
    t0 = time.perf_counter()
    rewards, errors = score_completions(funcs, ["q", "q"], [conversation(t) for t in texts], {})
    elapsed = time.perf_counter() - t0
    assert rewards == [[9.0, 9.0], [2.0, 2.0], [0.0, 1.0]] and errors == dict.fromkeys(errors, 0)
    assert 1.0 <= elapsed < 1.8, elapsed  # two one-second functions together, not 2 s one after the other


def test_async_functions_run_concurrently_in_the_reward_worker_and_get_the_run_state():
    from lib.rewards.worker import RewardWorker

    specs = [f"{TRL_STYLE}:slow_length", f"{TRL_STYLE}:slow_words", f"{TRL_STYLE}:progress"]
    worker = RewardWorker(specs, {}, timeout=5)
    try:
        funcs = resolve_reward_funcs(specs)
        worker.call(2, ["q"], [conversation("x")], {"trainer_state": RewardState(0, 1, 0.0)})  # started, warm
        t0 = time.perf_counter()
        rewards, errors = score_completions(funcs, ["q", "q"], [conversation("a b"), conversation("abc")], {},
                                            call=worker.run, trainer_state=RewardState(7, 20, 0.5))
        elapsed = time.perf_counter() - t0
    finally:
        worker.close()
    assert rewards[:2] == [[3.0, 3.0], [2.0, 1.0]] and errors == dict.fromkeys(errors, 0)
    assert rewards[2] == pytest.approx([7.0200005] * 2)  # trainer_state crossed into the worker, pickled
    assert 1.0 <= elapsed < 1.8, elapsed


def test_the_time_limit_cancels_an_async_call_and_kills_a_worker_whose_loop_is_blocked():
    from lib.rewards.worker import RewardCallFailed, RewardWorker

    specs = [f"{TRL_STYLE}:waits_forever", "format", f"{TRL_STYLE}:blocks_the_loop"]
    worker = RewardWorker(specs, {}, timeout=1)
    try:
        funcs = resolve_reward_funcs(specs)
        worker.start()
        t0 = time.perf_counter()
        with pytest.warns(RuntimeWarning, match=r"'waits_forever' gave no answer within reward_timeout = 1 s; the "
                                                r"call was cancelled; scored -1.0"):
            rewards, errors = score_completions(funcs[:2], ["q"] * 3, ["a", "b", "Answer: 1"], {}, error_value=-1,
                                                call=worker.run)
        elapsed = time.perf_counter() - t0
        assert rewards == [[-1.0] * 3, [0.0, 0.0, 1.0]] and errors == {"waits_forever": 3, "format": 0}
        # the batch's call and then the three single-completion calls together: about 2 limits, not 4
        assert elapsed < 3.5, elapsed
        assert worker.restarts == 0  # cancelled where it awaited: the worker lived on
        t0 = time.perf_counter()
        out = worker.run([(2, {"prompts": ["q"], "completions": ["a"]}), (0, {"prompts": ["q"], "completions": ["b"]})],
                         concurrent=True)
        assert 1.0 <= time.perf_counter() - t0 < 2.5  # the limit and the grace second, then the kill
        assert [type(o) for o in out] == [RewardCallFailed] * 2
        assert "gave no answer within reward_timeout = 1 s; the call was abandoned and the worker restarted" \
            in str(out[0])
        assert worker.call(1, ["q"], ["Answer: 2"], {}) == [1.0] and worker.restarts == 1
    finally:
        worker.close()
