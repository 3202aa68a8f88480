"""Reward functions and answer checking. Pure: text in, float out; imports nothing from our package.

Every reward function is called as TRL's GRPOTrainer calls it, with keyword arguments only (docs/methods.md 2.5: what
each holds):
    func(prompts=..., completions=..., completion_ids=..., trainer_state=..., **columns) -> list[float | None]
one entry per completion; None means "not applicable to this completion": the trainer skips it when it sums rewards
(TRL's nansum).

The built-in functions here (accuracy, format, length: what the presets and the evaluation use) follow open-r1
`src/open_r1/rewards.py` (commit 1416fa0, docs/methods.md 2.4), take either form of completion, and ignore the keywords
they do not use; answer equivalence is decided by math-verify (`parse` + `verify`), never by string comparison of our
own. open-r1's other rewards (think_format, cosine, repetition, soft_overlong, tag_count, reasoning_steps) are
lib/rewards/open_r1.py, which lib/models/reward_models.reward_functions hands to
lib/rewards/scoring.resolve_reward_funcs.

Lengths: the trainer passes the column `completion_length` (completion tokens, ints). `length` falls back to
`len(completion)` in characters when the column is absent, which is what open-r1 measures, so it also works when
called on plain text.
"""

import json
import re
import threading
from collections.abc import Callable


RewardFunc = Callable[..., list[float | None]]

# math-verify's own default (seconds per parse / per comparison); a power tower like 3^{3^{3^3}} hits it.
MATH_VERIFY_TIMEOUT_S = 5

# ---------------------------------------------------------------------------------------------------------------------
# Answer extraction

_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# "answer:" at the start of a line or after whitespace / markdown bold ("**Answer:** 52"); the greedy `.*` before it
# makes the match the LAST "answer:" on the line, so "Answer: Answer:" yields an empty value, not "Answer:".
_ANSWER_LINE = re.compile(r"^(?:.*[\s*])?answer:(.*)$", re.IGNORECASE)
# A number not glued to a word or a decimal point on its left ("x2", ".5" inside "12.5", "-" of "12-16" is a minus
# sign, not a negative 16). ASCII digits only: int()/sympy would not read other scripts' digits anyway.
_NUMBER = re.compile(r"(?<![\w.])-?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?")
_THOUSANDS = re.compile(r"-?[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]+)?")


def last_boxed(text: str) -> str | None:
    """Returns the content of the last \\boxed{...} or \\fbox{...} in `text` (nested braces kept), or None."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    # MATH train writes "\boxed {17}" and "\boxed 9" a few times; both mean the same as "\boxed{9}"
    while i < len(text) and text[i] == " ":
        i += 1
    if i < len(text) and text[i] == "{":
        depth = 0
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i + 1 : j].strip()
        return None  # unbalanced braces
    token = re.match(r"[^\s$]*", text[i:]).group()
    return token or None


def _clean(value: str) -> str:
    """Normalise an extracted answer so that equal answers are equal strings (majority voting groups by string)."""
    value = value.replace("\\$", "").replace("$", "").strip().strip("*").strip()
    value = value.rstrip(".").strip()
    # "Answer: \boxed{52}" -> "52"; only when the box is the whole value, otherwise keep the text as written.
    if value.startswith("\\boxed{") and last_boxed(value) == value[len("\\boxed{") : -1]:
        value = value[len("\\boxed{") : -1].strip()
    if _THOUSANDS.fullmatch(value):
        value = value.replace(",", "")
    return value


def extract_answer(completion: str) -> str | None:
    """The model's final answer as text, or None if the completion holds none.

    Priority, first found wins: the last `<answer>...</answer>` block, the last `Answer: ...` line, the last
    `\\boxed{...}`, the last number. Returns the value cleaned: surrounding whitespace, `$` signs, markdown `*` and a
    trailing period removed, thousands commas dropped from plain numbers ("1,000" -> "1000"). A unit word after the
    number is kept ("18 cards"); `answers_match` copes with it.
    """
    blocks = _ANSWER_BLOCK.findall(completion)
    if blocks and _clean(blocks[-1]):
        return _clean(blocks[-1])
    for line in reversed(completion.splitlines()):
        match = _ANSWER_LINE.match(line)
        if match:
            # An empty "Answer:" is no answer: fall through to the box / last number rather than return "".
            if _clean(match.group(1)):
                return _clean(match.group(1))
            break
    boxed = last_boxed(completion)
    if boxed is not None and _clean(boxed):
        return _clean(boxed)
    numbers_found = _NUMBER.findall(completion)
    return numbers_found[-1].replace(",", "") if numbers_found else None


# ---------------------------------------------------------------------------------------------------------------------
# Answer checking

# "52 dollars", "18 cards": math-verify would read the word as a product of symbols (52*a*do*l*l*r*s), so drop
# plain words after a number. LaTeX units ("10\text{ cm}") are already handled by math-verify itself.
_NUMBER_THEN_WORDS = re.compile(r"(-?[0-9][0-9,]*(?:\.[0-9]+)?)\s+[A-Za-z]{2,}(?:\s+[A-Za-z]+)*")


def _parse_math(text: str, timeout: int | None) -> list:
    """math-verify's parse of one bare value. Wrapping it in `$...$` makes the LaTeX extractor read the whole string:
    without it, "3\\sqrt{13}" parses as 3, "(3, \\frac{\\pi}{2})" and "\\dfrac12" as nothing, and "1,2" as 1.2."""
    text = text.replace("\\$", "").replace("$", "").strip()
    words = _NUMBER_THEN_WORDS.fullmatch(text)
    if words:
        text = words.group(1)
    from math_verify import parse  # imported on first use: 1.5 s that a run without answer checking never pays

    return parse(f"${text}$", parsing_timeout=timeout)


def answers_match(predicted: str | None, gold: str) -> bool:
    """True if the predicted answer is mathematically equal to the gold one ("145" == "145.0", "0.5" == "\\frac12").

    Returns False, never raises, on None, empty text or anything math-verify cannot read.
    """
    if predicted is None or not predicted.strip() or not gold.strip():
        return False
    # math-verify times out with signal.alarm, which only works in the main thread; elsewhere (an evaluator's worker
    # thread) it raises ValueError, so there we run without its timeout.
    timeout = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    try:
        gold_parsed = _parse_math(gold, timeout)
        predicted_parsed = _parse_math(predicted, timeout)
        if not gold_parsed or not predicted_parsed:
            return False
        from math_verify import verify

        # verify(gold, target): the order matters, gold first.
        return verify(gold_parsed, predicted_parsed, timeout_seconds=timeout)
    except (ValueError, TypeError, OverflowError, RecursionError):
        # math-verify already swallows its own parse/compare errors (raise_on_error=False); this is a safety net
        # for what escapes it, so one odd completion never stops a training step.
        return False


# ---------------------------------------------------------------------------------------------------------------------
# Reward functions

_FORMAT_LINE = re.compile(r"Answer:(.*)")
_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")
_WORD = re.compile(r"[A-Za-z]{2,}")
# The prompt asks for 'Answer: <number>'; 30 characters fit any number or short expression (\frac{\sqrt{3}}{2},
# (3, \frac{\pi}{2})) but not a sentence.
_MAX_FORMAT_VALUE_CHARS = 30


def completion_text(completion) -> str:
    """The text of one completion in either form TRL passes: the text itself, or a conversational completion (a list
    of messages, [{"role": "assistant", "content": text}]), whose message contents are joined."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):  # one message given alone
        completion = [completion]
    return "".join(m["content"] if isinstance(m.get("content"), str) else "" for m in completion)


def completion_texts(completions: list) -> list[str]:
    """The text of each completion (completion_text)."""
    return [completion_text(c) for c in completions]


def accuracy_reward(prompts: list[str], completions: list[str], answer: list[str], **columns) -> list[float]:
    """1.0 per completion whose extracted answer equals the gold `answer`, else 0.0."""
    return [1.0 if correct else 0.0 for correct in correct_answers(completion_texts(completions), answer)]


def _is_single_value(value: str) -> bool:
    """A number or short expression: not empty, at most 30 characters, no words outside LaTeX commands."""
    value = value.replace("$", "").strip().rstrip(".").strip()
    return (
        0 < len(value) <= _MAX_FORMAT_VALUE_CHARS
        and any(ch.isalnum() for ch in value)
        and not _WORD.search(_LATEX_COMMAND.sub("", value))
    )


def format_reward(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """1.0 per completion whose last non-empty line is `Answer: <single value>`, else 0.0."""
    rewards = []
    for completion in completion_texts(completions):
        lines = [line for line in completion.splitlines() if line.strip()]
        match = _FORMAT_LINE.fullmatch(lines[-1].strip()) if lines else None
        rewards.append(1.0 if match and _is_single_value(match.group(1)) else 0.0)
    return rewards


def completion_lengths(completions: list[str], completion_length: list[int] | None) -> list[int]:
    """Token counts from the trainer's `completion_length` column, or characters when the column is absent."""
    if completion_length is None:
        return [len(c) for c in completions]
    # int(): the trainer may hand over numpy / torch integers; a length is a count either way.
    return [int(n) for n in completion_length]


def correct_answers(completions: list[str], answer: list[str]) -> list[bool]:
    """Per completion: does its extracted answer equal the gold one (str(): a gold read from Parquet / JSON may arrive
    as a number, SVAMP's 145.0)."""
    return [answers_match(extract_answer(c), str(gold)) for c, gold in zip(completions, answer, strict=True)]


def _prompt_key(prompt) -> str:
    """A hashable stand-in for a prompt, text or messages (a conversational prompt is a list of dicts)."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, default=str)


def length_reward(
    prompts: list[str], completions: list[str], answer: list[str], completion_length: list[int] | None = None,
    **columns,
) -> list[float]:
    """Kimi k1.5 length reward (open-r1 `len_reward`), computed within each group of completions of one prompt.

    For a group with lengths L: lambda_i = 0.5 - (L_i - min L) / (max L - min L); the reward is lambda_i for a correct
    completion and min(0, lambda_i) for a wrong one (so a short wrong answer is not rewarded for being short);
    0 for the whole group when all its lengths are equal. In [-0.5, 0.5].
    """
    # open-r1 takes min/max over the whole call, which mixes prompts; AGPO (arXiv 2503.15952) shapes length within
    # the group (docs/methods.md 3.2(b)), so a group is the completions in this call that share a prompt string.
    # All of a group must be in the call: a group split across calls is judged on the part each call sees.
    completions = completion_texts(completions)
    lengths = completion_lengths(completions, completion_length)
    correct = correct_answers(completions, answer)
    groups: dict[str, list[int]] = {}
    for i, (prompt, _) in enumerate(zip(prompts, completions, strict=True)):
        groups.setdefault(_prompt_key(prompt), []).append(i)
    rewards = [0.0] * len(completions)
    for members in groups.values():
        shortest = min(lengths[i] for i in members)
        longest = max(lengths[i] for i in members)
        if longest == shortest:
            continue  # no length signal in this group (also the single-completion case)
        for i in members:
            lam = 0.5 - (lengths[i] - shortest) / (longest - shortest)
            rewards[i] = lam if correct[i] else min(0.0, lam)
    return rewards


REWARD_FUNCS: dict[str, RewardFunc] = {
    "accuracy": accuracy_reward,
    "format": format_reward,
    "length": length_reward,
}
