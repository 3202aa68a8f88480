"""Reward functions and answer checking. Pure: text in, float out; imports nothing from our package.

Every reward function has TRL's signature
    func(prompts: list[str], completions: list[str], **columns) -> list[float | None]
where `columns` holds per-completion lists of data-set columns (e.g. `answer`, the gold answer as a string).
None means "not applicable to this completion": the trainer skips it when it sums rewards (TRL's nansum).

The built-in functions follow open-r1 `src/open_r1/rewards.py` (commit 1416fa0, ALGORITHMS.md 2.4);
answer equivalence is decided by math-verify (`parse` + `verify`), never by string comparison of our own.
"""

import importlib
import importlib.util
import math
import numbers
import re
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

from math_verify import parse, verify

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
        # verify(gold, target): the order matters, gold first.
        return verify(gold_parsed, predicted_parsed, timeout_seconds=timeout)
    except (ValueError, TypeError, OverflowError, RecursionError):
        # math-verify already swallows its own parse/compare errors (raise_on_error=False); this is a safety net
        # for what escapes it, so one odd completion never stops a training step.
        return False


# ---------------------------------------------------------------------------------------------------------------------
# Reward functions

# open-r1 format_reward (ALGORITHMS.md 2.4). With MULTILINE, `$` also matches before a newline, so text on lines
# after </answer> still passes; we keep open-r1's exact regex for parity.
_THINK_FORMAT = re.compile(r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$", re.DOTALL | re.MULTILINE)
_FORMAT_LINE = re.compile(r"Answer:(.*)")
_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")
_WORD = re.compile(r"[A-Za-z]{2,}")
# The prompt asks for 'Answer: <number>'; 30 characters fit any number or short expression (\frac{\sqrt{3}}{2},
# (3, \frac{\pi}{2})) but not a sentence.
_MAX_FORMAT_VALUE_CHARS = 30


def accuracy_reward(prompts: list[str], completions: list[str], answer: list[str], **columns) -> list[float]:
    """1.0 per completion whose extracted answer equals the gold `answer`, else 0.0."""
    # str(): a gold read from Parquet/JSON may arrive as a number (SVAMP's 145.0).
    pairs = zip(completions, answer, strict=True)
    return [1.0 if answers_match(extract_answer(c), str(gold)) else 0.0 for c, gold in pairs]


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
    for completion in completions:
        lines = [line for line in completion.splitlines() if line.strip()]
        match = _FORMAT_LINE.fullmatch(lines[-1].strip()) if lines else None
        rewards.append(1.0 if match and _is_single_value(match.group(1)) else 0.0)
    return rewards


def think_format_reward(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """1.0 per completion laid out as `<think>\\n...\\n</think>\\n<answer>\\n...\\n</answer>` (open-r1), else 0.0."""
    return [1.0 if _THINK_FORMAT.match(c) else 0.0 for c in completions]


REWARD_FUNCS: dict[str, RewardFunc] = {
    "accuracy": accuracy_reward,
    "format": format_reward,
    "think_format": think_format_reward,
}

# ---------------------------------------------------------------------------------------------------------------------
# Resolving `--reward_funcs` and scoring a batch

_HOW_TO_CUSTOM = (
    "Built-in reward functions: {names}. For your own, pass 'module:function' (a module on sys.path) or "
    "'path/to/file.py:function', where function(prompts, completions, **columns) returns one float "
    "(or None to skip) per completion; columns holds per-completion lists such as answer."
)


def _spec_error(spec: str, problem: str) -> ValueError:
    return ValueError(f"reward function {spec!r}: {problem}. " + _HOW_TO_CUSTOM.format(names=", ".join(REWARD_FUNCS)))


def _load_module(spec: str, module_part: str):
    """Import `module_part`, a dotted module name or a path to a .py file (relative to the working directory)."""
    if module_part.endswith(".py") or "/" in module_part or "\\" in module_part:
        path = Path(module_part)
        if not path.is_file():
            raise _spec_error(spec, f"file {module_part!r} not found")
        # importlib recipe "Importing a source file directly"; the prefix keeps 'math.py' from shadowing math.
        module_spec = importlib.util.spec_from_file_location(f"_agrpo_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(module_part)
    except ImportError as exc:
        raise _spec_error(spec, f"cannot import module {module_part!r} ({exc})") from exc


def resolve_reward_funcs(specs: list[str]) -> list[tuple[str, RewardFunc]]:
    """(name, function) per spec, in order. A spec is a built-in name or 'module:function' / 'file.py:function';
    a custom function is named by its `__name__`. Raises ValueError naming the spec and the fix on any bad spec."""
    resolved = []
    for spec in specs:
        if spec in REWARD_FUNCS:
            resolved.append((spec, REWARD_FUNCS[spec]))
            continue
        module_part, sep, attr = spec.rpartition(":")
        if not sep or not module_part or not attr:
            raise _spec_error(spec, "unknown name")
        func = getattr(_load_module(spec, module_part), attr, None)
        if func is None:
            raise _spec_error(spec, f"module {module_part!r} has no attribute {attr!r}")
        if not callable(func):
            raise _spec_error(spec, f"{attr!r} is a {type(func).__name__}, not a function")
        resolved.append((getattr(func, "__name__", attr), func))
    names = [name for name, _ in resolved]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        # Rewards are logged and weighted by name, so two functions with one name would overwrite each other.
        raise ValueError(f"reward function names must be unique, got {duplicates} more than once in {specs}")
    return resolved


def _as_floats(name: str, values, expected: int) -> list[float]:
    """Check one function's output: a list of `expected` numbers or None (-> NaN). A wrong shape or type is a bug in
    the function, not a flaky completion, so it raises ValueError instead of being scored."""
    if not isinstance(values, (list, tuple)) or len(values) != expected:
        got = f"{len(values)} values" if isinstance(values, (list, tuple)) else f"a {type(values).__name__}"
        raise ValueError(f"reward function {name!r} returned {got} for {expected} completions; "
                         "it must return a list with one float (or None) per completion")
    floats = []
    for value in values:
        if value is None:
            floats.append(math.nan)
        elif isinstance(value, numbers.Real):
            floats.append(float(value))
        else:
            raise ValueError(f"reward function {name!r} returned {value!r} ({type(value).__name__}); "
                             "each reward must be a float or None")
    return floats


def score_completions(
    reward_funcs: list[tuple[str, RewardFunc]],
    prompts: list[str],
    completions: list[str],
    columns: dict[str, list],
    error_value: float | None = 0.0,
) -> tuple[list[list[float]], dict[str, int]]:
    """Run every reward function on the batch.

    Returns (rewards, errors): rewards[k][i] is function k's reward for completion i (NaN where the function returned
    None); errors[name] counts the completions on which that function raised and got `error_value` (None -> NaN).
    A function that raises on the batch is retried one completion at a time, so one bad completion costs one reward,
    not the whole batch. Raises ValueError for a wrong-length or non-numeric result, or a column of the wrong length.
    """
    n = len(completions)
    if len(prompts) != n:
        raise ValueError(f"got {len(prompts)} prompts for {n} completions; repeat each prompt once per completion")
    for key, column in columns.items():
        if len(column) != n:
            raise ValueError(f"column {key!r} has {len(column)} values for {n} completions")
    fallback = math.nan if error_value is None else float(error_value)
    rewards, errors = [], {}
    for name, func in reward_funcs:
        errors[name] = 0
        try:
            values = func(prompts, completions, **columns)
        # User code can raise anything; catching Exception (not BaseException: Ctrl-C still stops) is the point here.
        except Exception as batch_exc:  # noqa: BLE001
            warned = set()
            values = []
            for i in range(n):
                try:
                    one = func([prompts[i]], [completions[i]], **{key: [col[i]] for key, col in columns.items()})
                except Exception as exc:  # noqa: BLE001
                    errors[name] += 1
                    values.append(fallback)
                    message = f"reward function {name!r} raised {type(exc).__name__}: {exc}; scored {fallback}"
                    if message not in warned:  # one line per distinct failure, no traceback per completion
                        warnings.warn(message, RuntimeWarning, stacklevel=2)
                        warned.add(message)
                    continue
                values.append(_as_floats(name, one, 1)[0])
            if not errors[name]:
                warnings.warn(f"reward function {name!r} raised {type(batch_exc).__name__}: {batch_exc} on the batch "
                              "but on no single completion", RuntimeWarning, stacklevel=2)
        rewards.append(_as_floats(name, values, n))
    return rewards, errors


def weighted_sum(rewards_per_func: list[list[float]], weights: list[float]) -> list[float]:
    """r_i = sum_k w_k r_i^(k) per completion, skipping NaN (TRL's nansum, ALGORITHMS.md 1); NaN if all are NaN."""
    if len(weights) != len(rewards_per_func):
        raise ValueError(f"got {len(weights)} reward weights for {len(rewards_per_func)} reward functions")
    totals = []
    for per_completion in zip(*rewards_per_func, strict=True):
        terms = [w * r for w, r in zip(weights, per_completion, strict=True) if not math.isnan(r)]
        totals.append(sum(terms) if terms else math.nan)
    return totals
