"""Reward functions and answer checking. Pure: text in, float out; imports nothing from our package.

Every reward function is called as TRL's GRPOTrainer calls it (`_calculate_rewards`; docs/methods.md 2.5), with
keyword arguments only:
    func(prompts=..., completions=..., completion_ids=..., trainer_state=..., **columns) -> list[float | None]
one entry per completion: `prompts` the prompt's messages (a list of {role, content}) when the data set's prompts are
conversational, the prompt text otherwise; `completions` then [{"role": "assistant", "content": text}], or the text;
`completion_ids` the completion's token ids; `columns` every other column of the record (e.g. `answer`, the gold
answer as a string); `trainer_state` the run's progress (RewardState). `async def` functions run concurrently. None
means "not applicable to this completion": the trainer skips it when it sums rewards (TRL's nansum).

The built-in functions follow open-r1 `src/open_r1/rewards.py` (commit 1416fa0, docs/methods.md 2.4), take either
form of completion, and ignore the keywords they do not use; answer equivalence is decided by math-verify (`parse` +
`verify`), never by string comparison of our own.

Lengths: the trainer passes the column `completion_length` (completion tokens, ints). The functions that use a length
(`length`, `cosine`) fall back to `len(completion)` in characters when the column is absent, which is what open-r1
measures, so they also work when called on plain text; `soft_overlong` counts tokens only and requires the column.
"""

import asyncio
import functools
import importlib
import importlib.util
import inspect
import json
import math
import numbers
import os
import re
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


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

# open-r1 format_reward (docs/methods.md 2.4). With MULTILINE, `$` also matches before a newline, so text on lines
# after </answer> still passes; we keep open-r1's exact regex for parity.
_THINK_FORMAT = re.compile(r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$", re.DOTALL | re.MULTILINE)
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


def _texts(completions: list) -> list[str]:
    return [completion_text(c) for c in completions]


def accuracy_reward(prompts: list[str], completions: list[str], answer: list[str], **columns) -> list[float]:
    """1.0 per completion whose extracted answer equals the gold `answer`, else 0.0."""
    # str(): a gold read from Parquet/JSON may arrive as a number (SVAMP's 145.0).
    pairs = zip(_texts(completions), answer, strict=True)
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
    for completion in _texts(completions):
        lines = [line for line in completion.splitlines() if line.strip()]
        match = _FORMAT_LINE.fullmatch(lines[-1].strip()) if lines else None
        rewards.append(1.0 if match and _is_single_value(match.group(1)) else 0.0)
    return rewards


def think_format_reward(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """1.0 per completion laid out as `<think>\\n...\\n</think>\\n<answer>\\n...\\n</answer>` (open-r1), else 0.0."""
    return [1.0 if _THINK_FORMAT.match(c) else 0.0 for c in _texts(completions)]


def _lengths(completions: list[str], completion_length: list[int] | None) -> list[int]:
    """Token counts from the trainer's `completion_length` column, or characters when the column is absent."""
    if completion_length is None:
        return [len(c) for c in completions]
    # int(): the trainer may hand over numpy / torch integers; a length is a count either way.
    return [int(n) for n in completion_length]


def _correct(completions: list[str], answer: list[str]) -> list[bool]:
    """Per completion: does its extracted answer equal the gold one (str(): a gold may arrive as a number)."""
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
    completions = _texts(completions)
    lengths = _lengths(completions, completion_length)
    correct = _correct(completions, answer)
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


def cosine_reward(
    prompts: list[str], completions: list[str], answer: list[str], completion_length: list[int] | None = None,
    *, max_len: int = 1000, min_value_correct: float = 0.5, max_value_correct: float = 1.0,
    min_value_wrong: float = -1.0, max_value_wrong: float = -0.5, **columns,
) -> list[float]:
    """Cosine-scaled correctness (Yeo et al. 2025, "Demystifying Long Chain-of-Thought Reasoning"; open-r1
    `get_cosine_scaled_reward`): reward = lo + 0.5 (hi - lo)(1 + cos(pi * min(1, L / max_len))) with
    lo, hi = min_value_correct, max_value_correct for a correct answer and max_value_wrong, min_value_wrong for a wrong
    one. Defaults (open-r1 signature): short correct 1.0, long correct 0.5, short wrong -1.0, long wrong -0.5.

    `max_len` is in the unit of the lengths: tokens with `completion_length`, characters without (open-r1's 1000).
    """
    if max_len <= 0:
        raise ValueError(f"cosine: max_len must be positive, got {max_len}")
    completions = _texts(completions)
    rewards = []
    for length, correct in zip(_lengths(completions, completion_length), _correct(completions, answer), strict=True):
        # open-r1 does not clamp: past max_len the cosine climbs back, and a completion of 2 * max_len would score
        # like an empty one. Clamped, longer is never better, whatever the generation limit.
        progress = min(1.0, length / max_len)
        # Wrong answers swap the ends (open-r1: min_value = max_value_wrong, max_value = min_value_wrong), so that
        # with the defaults a short wrong answer gets the harshest -1.0 and a long one, still thinking, -0.5.
        lo, hi = (min_value_correct, max_value_correct) if correct else (max_value_wrong, min_value_wrong)
        rewards.append(lo + 0.5 * (hi - lo) * (1.0 + math.cos(math.pi * progress)))
    return rewards


def repetition_reward(
    prompts: list[str], completions: list[str], *, ngram_size: int = 3, max_penalty: float = -1.0, **columns,
) -> list[float]:
    """n-gram repetition penalty (open-r1 `get_repetition_penalty_reward`): with the lower-cased whitespace-split
    words, reward = (1 - #distinct n-grams / #n-grams) * max_penalty; 0 when there are fewer than `ngram_size` words.
    In [max_penalty, 0]: 0 for text without a repeated n-gram, near max_penalty for a loop of one phrase."""
    if max_penalty > 0:
        raise ValueError(f"repetition: max_penalty is a penalty and must be <= 0, got {max_penalty}")
    if ngram_size < 1:
        raise ValueError(f"repetition: ngram_size must be at least 1, got {ngram_size}")
    rewards = []
    for completion in _texts(completions):
        words = completion.lower().split()
        if len(words) < ngram_size:  # includes the empty completion
            rewards.append(0.0)
            continue
        ngrams = [tuple(words[i : i + ngram_size]) for i in range(len(words) - ngram_size + 1)]
        distinct = len(set(ngrams))
        # the `if` keeps a -0.0 (0 * -1.0) out of the logs
        rewards.append((1 - distinct / len(ngrams)) * max_penalty if distinct < len(ngrams) else 0.0)
    return rewards


def soft_overlong_reward(
    prompts: list[str], completions: list[str], completion_length: list[int] | None = None,
    completion_ids: list[list[int]] | None = None,
    *, max_completion_length: int = 20480, overlong_buffer_length: int = 4096, **columns,
) -> list[float]:
    """DAPO soft overlong punishment (arXiv 2503.14476, "overlong reward shaping"; TRL `get_soft_overlong_punishment`):
    0 up to L_max - L_cache tokens, then falling linearly to -1 at L_max, and -1 beyond (L_max = max_completion_length,
    L_cache = overlong_buffer_length; defaults are the verl DAPO recipe's 20480 / 4096, docs/methods.md 1.3).

    Requires the column `completion_length` or TRL's `completion_ids` (the trainer passes both): the punishment is
    defined on tokens, and characters would put the buffer in the wrong place. A generation limit of L_max tokens
    never produces the -1 case; it is there for parity.
    """
    if not 0 < overlong_buffer_length <= max_completion_length:
        raise ValueError(f"soft_overlong: overlong_buffer_length ({overlong_buffer_length}) must be positive and at "
                         f"most max_completion_length ({max_completion_length})")
    if completion_length is None and completion_ids is not None:
        completion_length = [len(ids) for ids in completion_ids]  # TRL's get_soft_overlong_punishment counts these
    if completion_length is None:
        raise ValueError("soft_overlong needs the per-completion column 'completion_length' (completion tokens, "
                         "ints) or completion_ids; the trainer passes both, a direct call must pass one")
    start = max_completion_length - overlong_buffer_length  # last length with no punishment
    rewards = []
    for length in _lengths(_texts(completions), completion_length):
        if length <= start:
            rewards.append(0.0)
        elif length <= max_completion_length:
            rewards.append((start - length) / overlong_buffer_length)
        else:
            rewards.append(-1.0)
    return rewards


def tag_count_reward(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """open-r1 `tag_count_reward`: 0.25 for each of "<think>\\n", "\\n</think>\\n", "\\n<answer>\\n" and
    "\\n</answer>" found exactly once. Partial credit, so a model learning the think/answer layout gets a gradient
    before it matches `think_format` as a whole."""
    tags = ("<think>\n", "\n</think>\n", "\n<answer>\n", "\n</answer>")
    return [sum(0.25 for tag in tags if completion.count(tag) == 1) for completion in _texts(completions)]


# open-r1 `reasoning_steps_reward`. It calls re.findall with no flags, so `^\d+\.` matches only a list number at the
# very start of the completion, not "2." on later lines; we keep that for parity (later list items that start with
# "\n-" or "\n*" do count, and so does a markdown "\n**Answer:**" line).
_REASONING_STEP = re.compile(r"(Step \d+:|^\d+\.|\n-|\n\*|First,|Second,|Next,|Finally,)")


def reasoning_steps_reward(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """open-r1 `reasoning_steps_reward`: min(1, #step markers / 3); 3 because open-r1 aims for at least 3 steps."""
    return [min(1.0, len(_REASONING_STEP.findall(completion)) / 3) for completion in _texts(completions)]


REWARD_FUNCS: dict[str, RewardFunc] = {
    "accuracy": accuracy_reward,
    "format": format_reward,
    "think_format": think_format_reward,
    "length": length_reward,
    "cosine": cosine_reward,
    "repetition": repetition_reward,
    "soft_overlong": soft_overlong_reward,
    "tag_count": tag_count_reward,
    "reasoning_steps": reasoning_steps_reward,
}

# ---------------------------------------------------------------------------------------------------------------------
# Other projects' names (docs/methods.md 2.5)

# TRL's built-in reward names (trl/scripts/grpo.py) that mean what one of ours means: the name is logged as ours.
TRL_NAMES = {
    # 1 when math-verify finds the completion's answer equal to the gold, else 0. TRL reads the gold from the column
    # `solution`, we from `answer`, which lib/data.py fills from the data's answer column (MATH's solution too).
    "accuracy_reward": "accuracy",
    # DAPO's soft overlong punishment, the same formula on completion tokens. TRL's script fixes L_max 1280 and
    # L_cache 256; here they are max_completion_length and overlong_buffer_length.
    "get_soft_overlong_punishment": "soft_overlong",
}
# TRL's names that mean something none of ours does: refused, with what to use instead.
TRL_REFUSED = {
    "think_format_reward": (
        "TRL's think_format_reward scores 1 for a completion that opens with one <think>...</think> block, whatever "
        "follows; this package's think_format (open-r1's format reward) also requires an <answer>...</answer> block "
        "after it. Pass think_format for that layout, or TRL's own function as 'trl.rewards:think_format_reward'"),
    "reasoning_accuracy_reward": (
        "TRL's reasoning_accuracy_reward checks only the answer after the last </think> and scores 0 without one; "
        "this package's accuracy reads the answer wherever it is (an <answer> block, an 'Answer:' line, \\boxed{}, "
        "the last number). Pass accuracy (with think_format for the layout), or TRL's own function as "
        "'trl.rewards:reasoning_accuracy_reward'"),
}

# ---------------------------------------------------------------------------------------------------------------------
# Resolving `--reward_funcs`

_HOW_TO_CUSTOM = (
    "Built-in reward functions: {names} (TRL's accuracy_reward and get_soft_overlong_punishment map to accuracy and "
    "soft_overlong). For your own, pass 'module:function' or 'module.function' (a module on sys.path) or "
    "'path/to/file.py:function', called as TRL calls it: function(prompts=..., completions=..., **columns) returns "
    "one float (or None to skip) per completion; columns holds per-completion lists such as answer. A reward model "
    "is a folder or hub id of a sequence-classification model (num_labels=1)."
)

# A hub id ("org/name"); a dotted Python name ("package.module.function", TRL's form).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")


def _spec_error(spec: str, problem: str) -> ValueError:
    return ValueError(f"reward function {spec!r}: {problem}. " + _HOW_TO_CUSTOM.format(names=", ".join(REWARD_FUNCS)))


@dataclass(frozen=True)
class RewardModelSpec:
    """A reward model named in reward_funcs (a local folder or a hub id of a sequence-classification model), not
    loaded yet: lib/reward_models.load_reward_models loads it onto the trainer's device. It scores nothing itself."""

    path: str


def reward_model_name(spec: str) -> str:
    """A reward model's name in the logs (`rewards/<name>/mean`): the folder's name, or the part of a hub id after the
    '/' (TRL's naming)."""
    return Path(spec.rstrip("/\\")).name


def _reward_model(spec: str) -> RewardModelSpec | None:
    """The reward model `spec` names (a local folder, or a hub id 'org/name'), or None when it names a function.
    Raises on a folder that holds no sequence-classification model: a causal LM would get a new, random score head
    (transformers initialises what the checkpoint lacks) and train the policy on noise."""
    if ":" in spec:
        return None
    path = Path(os.path.expanduser(spec))
    if path.is_dir():
        try:
            config = json.loads((path / "config.json").read_text())
        except FileNotFoundError:
            raise _spec_error(spec, "a folder without config.json, so not a model; a reward model folder is what "
                                    "AutoModelForSequenceClassification.save_pretrained writes") from None
        except (OSError, ValueError) as exc:
            raise _spec_error(spec, f"its config.json cannot be read ({exc})") from exc
        architectures = config.get("architectures") or []
        if not any(str(a).endswith("ForSequenceClassification") for a in architectures):
            held = ", ".join(map(str, architectures)) or "model with no 'architectures' entry"
            raise _spec_error(spec, f"the folder holds a {held}, not a sequence-classification model; a reward model "
                                    "has a one-score head (AutoModelForSequenceClassification, num_labels=1)")
        return RewardModelSpec(str(path))
    if spec.endswith(".py"):
        raise _spec_error(spec, f"name the function in the file: '{spec}:function'")
    if spec.startswith((".", "/", "~", "\\")):
        raise _spec_error(spec, "no such folder (a reward model is a folder or a hub id)")
    if _HUB_ID.fullmatch(spec):
        return RewardModelSpec(spec)
    return None


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


def _keyword_only(func) -> set[str]:
    """Names of `func`'s keyword-only parameters; none for a callable whose signature Python cannot read."""
    try:
        parameters = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return set()
    return {p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}


def _bind_options(spec: str, func: RewardFunc, options: dict) -> RewardFunc:
    """`func` with the entries of `options` that name one of its keyword-only parameters bound (functools.partial).

    Only keyword-only parameters: a function that takes **columns would otherwise receive every option as if it were
    a data-set column. A built-in is called once on an empty batch, so that a bad value (a buffer longer than the
    limit) fails here, at start-up, instead of on every step inside score_completions, which would score it as an
    error and go on.
    """
    bound = {key: value for key, value in options.items() if key in _keyword_only(func)}
    if not bound:
        return func
    func = functools.partial(func, **bound)
    if spec in REWARD_FUNCS:
        try:
            func([], [], answer=[], completion_length=[])
        except ValueError as exc:
            raise ValueError(f"reward function {spec!r}: {exc}") from exc
    return func


def resolve_reward_funcs(specs: list[str], options: dict | None = None) -> list[tuple[str, RewardFunc]]:
    """(name, function) per spec, in order. A spec is a built-in name, one of TRL's names that maps to one
    (TRL_NAMES), 'module:function', 'module.function' (TRL's form) or 'file.py:function', or a reward model (a
    folder or a hub id, resolved to a RewardModelSpec for lib/reward_models.py to load). A custom function is named by
    its `__name__`, a built-in by our name, a reward model by its folder. Raises ValueError naming the spec and the
    fix on any bad spec.

    `options` (e.g. {"max_len": 1000, "ngram_size": 3}): each function gets, bound, the entries whose key is one of its
    keyword-only parameters, and nothing else; the name stays the spec's. A built-in with a bad value raises here."""
    options = options or {}
    resolved = []
    for spec in specs:
        if spec in TRL_REFUSED:
            raise ValueError(f"reward function {spec!r}: {TRL_REFUSED[spec]}")
        name = TRL_NAMES.get(spec, spec)
        if name in REWARD_FUNCS:
            resolved.append((name, _bind_options(name, REWARD_FUNCS[name], options)))
            continue
        model = _reward_model(spec)
        if model is not None:
            resolved.append((reward_model_name(spec), model))
            continue
        if ":" in spec:
            module_part, _, attr = spec.rpartition(":")
        elif _DOTTED.fullmatch(spec):
            module_part, _, attr = spec.rpartition(".")
        else:
            raise _spec_error(spec, "unknown name")
        if not module_part or not attr:
            raise _spec_error(spec, "unknown name")
        func = getattr(_load_module(spec, module_part), attr, None)
        if func is None:
            raise _spec_error(spec, f"module {module_part!r} has no attribute {attr!r}")
        if not callable(func):
            raise _spec_error(spec, f"{attr!r} is a {type(func).__name__}, not a function")
        resolved.append((getattr(func, "__name__", attr), _bind_options(spec, func, options)))
    names = [name for name, _ in resolved]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        # Rewards are logged and weighted by name, so two functions with one name would overwrite each other.
        raise ValueError(f"reward function names must be unique, got {duplicates} more than once in {specs}")
    return resolved


# ---------------------------------------------------------------------------------------------------------------------
# What a reward function is given


@dataclass(frozen=True)
class RewardState:
    """The run's progress, passed as `trainer_state` (TRL passes transformers' TrainerState, which has these three
    among others): optimizer steps done, the run's length in steps, and epochs of the training data drawn so far
    (a float). Plain and picklable, so that it crosses into the reward worker."""

    global_step: int
    max_steps: int
    epoch: float


def is_conversational(record: dict) -> bool:
    """A record whose prompt is a conversation: a list of {role, content} messages under `prompt`, TRL's
    conversational format (lib/data.py checks the messages when it loads them)."""
    return isinstance(record.get("prompt"), list)


def prompt_messages(problem: str, instruction: str = "", system_prompt: str | None = None) -> list[dict]:
    """The messages of a math-format record's prompt, as lib/data.format_prompt renders them: the system prompt if
    any, then `problem + "\n" + instruction` from the user. A reward model reads them with its own chat template."""
    content = f"{problem}\n{instruction}" if instruction else problem
    return [{"role": "system", "content": system_prompt}] * bool(system_prompt) + [{"role": "user", "content": content}]


# Keys of a record never passed as columns: the names TRL passes itself (and leaves out of its columns).
_NOT_COLUMNS = ("prompt", "completion", "completion_ids", "prompts", "completions", "trainer_state")


def reward_arguments(records: list[dict], prompt_texts: list[str | None], texts: list[str], *, instruction: str = "",
                     system_prompt: str | None = None) -> tuple[list, list, dict[str, list], list]:
    """TRL's arguments for one batch, from each completion's record, its prompt as rendered for the policy
    (lib/data.render_prompt; None for a conversational record) and its decoded text: (prompts, completions,
    columns, model_prompts). The records' forms are lib/data.py's:

    - a conversation under `prompt`: prompts are its messages as the data holds them, completions
      [{"role": "assistant", "content": text}] (TRL's conversational form);
    - a text `prompt` (TRL's standard form) or a math-format record (`problem`): prompts are the rendered prompt
      text, completions the text.

    columns: every other key of the records, one value per completion; not the prompt (`prompt`, or `problem` for a
    record without `prompt`, whose prompt it is), as TRL leaves out its `prompt` column. model_prompts: what a reward
    model reads as the prompt (lib/reward_models.py): a conversation's messages with the system prompt added where
    it has no system turn, as the policy's prompt was rendered; a text prompt as it is (TRL joins text and
    completion); a math-format record's messages, the problem and the instruction (prompt_messages), since its
    rendered text is in the policy's chat template, not the reward model's.
    """
    prompts, completions, model_prompts = [], [], []
    for record, prompt_text, text in zip(records, prompt_texts, texts, strict=True):
        if is_conversational(record):
            messages = record["prompt"]
            prompts.append(messages)
            completions.append([{"role": "assistant", "content": text}])
            has_system = any(m.get("role") == "system" for m in messages)
            model_prompts.append(messages if has_system or not system_prompt
                                 else [{"role": "system", "content": system_prompt}, *messages])
        else:
            prompts.append(prompt_text)
            completions.append(text)
            model_prompts.append(record["prompt"] if "prompt" in record
                                 else prompt_messages(record["problem"], instruction, system_prompt))
    keys = dict.fromkeys(key for r in records for key in r)  # every record's keys, in the order first seen
    prompt_key = "problem" if records and "prompt" not in records[0] else None
    columns = {key: [r.get(key) for r in records] for key in keys if key not in _NOT_COLUMNS and key != prompt_key}
    return prompts, completions, columns, model_prompts


# ---------------------------------------------------------------------------------------------------------------------
# Running the functions

def is_async(func) -> bool:
    """Whether calling `func` gives a coroutine: an `async def` function, a functools.partial of one (options
    bound), or an object whose __call__ is `async def` (inspect.iscoroutinefunction looks at the object itself)."""
    while isinstance(func, functools.partial):
        func = func.func
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(getattr(type(func), "__call__", None))


def is_reward_model(func) -> bool:
    """A loaded reward model (lib/reward_models.RewardModel) or one still to load: it runs in the trainer's process,
    on its device, never in the reward worker."""
    return isinstance(func, RewardModelSpec) or getattr(func, "is_reward_model", False)


class RewardTimeout(Exception):
    """An async call that ran past its time limit. Its message is a predicate of the function, like
    lib/extras/reward_worker.RewardCallFailed's."""

    predicate = True


def describe_failure(exc: BaseException) -> str:
    """What a failed call did, as a predicate of the function's name ("raised KeyError: 'x'", "gave no answer ...")."""
    return str(exc) if getattr(exc, "predicate", False) else f"raised {type(exc).__name__}: {exc}"


_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _event_loop() -> asyncio.AbstractEventLoop:
    """This process's event loop for async reward functions, run by a daemon thread (TRL runs them the same way):
    one loop serves every call, so a client a function keeps (an HTTP session) stays bound to a live loop, and the
    caller may itself be inside a running loop (a notebook), where asyncio.run would refuse."""
    global _loop
    with _loop_lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="agrpo-async-rewards", daemon=True).start()
            _loop = loop
    return _loop


def run_jobs(funcs: list[RewardFunc], jobs: list[tuple[int, dict]], timeout: float = 0.0) -> list:
    """Reward calls in this process. A job is (function index, keyword arguments). Synchronous functions run one after
    another, `async def` ones all at once on the event loop, each for at most `timeout` seconds (0: no limit; a
    coroutine is stopped only where it awaits, so the reward worker's own deadline covers one that blocks). Returns
    per job its output, or the exception it raised: this never raises for a function."""
    results: list = [None] * len(jobs)
    waiting = []
    for j, (k, kwargs) in enumerate(jobs):
        if is_async(funcs[k]):
            waiting.append(j)
            continue
        try:
            results[j] = funcs[k](**kwargs)
        # User code can raise anything; catching Exception (not BaseException: Ctrl-C still stops) is the point here.
        except Exception as exc:  # noqa: BLE001
            results[j] = exc
    if waiting:
        async def one(k: int, kwargs: dict):
            try:
                coroutine = funcs[k](**kwargs)
                return await (asyncio.wait_for(coroutine, timeout) if timeout > 0 else coroutine)
            except TimeoutError:
                return RewardTimeout(f"gave no answer within reward_timeout = {timeout:g} s; the call was cancelled")
            except Exception as exc:  # noqa: BLE001
                return exc

        async def together():
            return await asyncio.gather(*(one(*jobs[j]) for j in waiting))

        for j, out in zip(waiting, asyncio.run_coroutine_threadsafe(together(), _event_loop()).result()):
            results[j] = out
    return results


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
    prompts: list,
    completions: list,
    columns: dict[str, list],
    error_value: float | None = 0.0,
    call: Callable | None = None,
    nonfinite: dict[str, int] | None = None,
    *,
    completion_ids: list[list[int]] | None = None,
    trainer_state: RewardState | None = None,
    model_prompts: list | None = None,
) -> tuple[list[list[float]], dict[str, int]]:
    """Run every reward function on the batch, as TRL calls them: keyword arguments prompts, completions,
    completion_ids (if given), trainer_state (if given) and the columns. Synchronous functions run one after
    another, then the `async def` ones together (TRL's order).

    Returns (rewards, errors): rewards[k][i] is function k's reward for completion i (NaN where the function returned
    None); errors[name] counts the completions on which that function raised and got `error_value` (None -> NaN).
    A function that raises on the batch is retried one completion at a time (an async one on all of them at once),
    so one bad completion costs one reward, not the whole batch. Raises ValueError for a wrong-length or non-numeric
    result, a column of the wrong length, or a reward model not loaded.

    call(jobs, concurrent): how the functions run, jobs being (function index, keyword arguments), returning each
    job's output or exception (default: run_jobs, in this process; the trainer passes
    lib.extras.reward_worker.RewardWorker.run, which runs them in a worker with a time limit and returns a timeout or a dead
    worker as an exception, scored like any). Reward models always run in this process, on its device, and are given
    `model_prompts` (reward_arguments) as their prompts when it is given. nonfinite: if given,
    nonfinite[name] counts the completions the function scored inf, -inf or NaN (None is not counted: it means the
    function does not apply).
    """
    funcs = [func for _, func in reward_funcs]
    unloaded = [name for name, func in reward_funcs if isinstance(func, RewardModelSpec)]
    if unloaded:
        raise ValueError(f"reward model(s) {unloaded} not loaded: lib/reward_models.load_reward_models loads them "
                         "onto the device before scoring")
    n = len(completions)
    if len(prompts) != n:
        raise ValueError(f"got {len(prompts)} prompts for {n} completions; repeat each prompt once per completion")
    per_completion = {**columns, "prompts": list(prompts), "completions": list(completions)}
    if completion_ids is not None:
        per_completion["completion_ids"] = completion_ids
    for key, column in per_completion.items():
        if len(column) != n:
            raise ValueError(f"column {key!r} has {len(column)} values for {n} completions")
    for_models = per_completion if model_prompts is None else {**per_completion, "prompts": model_prompts}
    shared = {} if trainer_state is None else {"trainer_state": trainer_state}

    def arguments(k: int, i: int | None = None) -> dict:
        batch = for_models if is_reward_model(funcs[k]) else per_completion
        if i is not None:
            batch = {key: [column[i]] for key, column in batch.items()}
        return {**batch, **shared}

    def run(jobs: list[tuple[int, dict]]) -> list:
        k = jobs[0][0]
        if call is None or is_reward_model(funcs[k]):
            return run_jobs(funcs, jobs)
        return call(jobs, is_async(funcs[k]))

    fallback = None if error_value is None else float(error_value)  # None: skipped, like a function's None
    outputs = {k: run([(k, arguments(k))])[0] for k, func in enumerate(funcs) if not is_async(func)}
    concurrent = [k for k, func in enumerate(funcs) if is_async(func)]
    if concurrent:
        outputs.update(zip(concurrent, run([(k, arguments(k)) for k in concurrent])))
    rewards, errors = [], {}
    for k, (name, func) in enumerate(reward_funcs):
        errors[name] = 0
        values = outputs[k]
        if isinstance(values, Exception):
            batch_exc = values
            jobs = [(k, arguments(k, i)) for i in range(n)]
            # one completion at a time; an async function's single-completion calls all at once
            ones = run(jobs) if is_async(func) and jobs else [run([job])[0] for job in jobs]
            warned = set()
            values = []
            for one in ones:
                if isinstance(one, Exception):
                    errors[name] += 1
                    values.append(fallback)
                    message = f"reward function {name!r} {describe_failure(one)}; scored {fallback}"
                    if message not in warned:  # one line per distinct failure, no traceback per completion
                        warnings.warn(message, RuntimeWarning, stacklevel=2)
                        warned.add(message)
                    continue
                checked = _as_floats(name, one, 1)[0]
                values.append(None if one[0] is None else checked)
            if not errors[name]:
                warnings.warn(f"reward function {name!r} {describe_failure(batch_exc)} on the batch but on no single "
                              "completion", RuntimeWarning, stacklevel=2)
        floats = _as_floats(name, values, n)
        if nonfinite is not None:
            nonfinite[name] = sum(v is not None and not math.isfinite(f) for v, f in zip(values, floats))
        rewards.append(floats)
    return rewards, errors
