"""open-r1's reward functions beyond those the presets use (open-r1 `src/open_r1/rewards.py`, commit 1416fa0;
docs/methods.md 2.4), and DAPO's soft overlong punishment: think_format, cosine, repetition, soft_overlong, tag_count,
reasoning_steps. Pure, called as lib/rewards/functions.py's are (keyword arguments, either form of completion).

`REWARD_FUNCS` is every built-in name, lib/rewards/functions.py's and these: lib/models/reward_models.reward_functions
hands it to lib/rewards/scoring.resolve_reward_funcs (`named_rewards`), so that `--reward_funcs cosine` resolves there;
`reward_options` their keyword options from the configuration, which train_agrpo.py hands over the same way.
"""

import math
import re

from lib.rewards.functions import REWARD_FUNCS as CORE_REWARD_FUNCS
from lib.rewards.functions import RewardFunc, completion_lengths, completion_texts, correct_answers

# open-r1 format_reward (docs/methods.md 2.4). With MULTILINE, `$` also matches before a newline, so text on lines
# after </answer> still passes; we keep open-r1's exact regex for parity.
_THINK_FORMAT = re.compile(r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$", re.DOTALL | re.MULTILINE)


def think_format_reward(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """1.0 per completion laid out as `<think>\\n...\\n</think>\\n<answer>\\n...\\n</answer>` (open-r1), else 0.0."""
    return [1.0 if _THINK_FORMAT.match(c) else 0.0 for c in completion_texts(completions)]


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
    completions = completion_texts(completions)
    rewards = []
    lengths = completion_lengths(completions, completion_length)
    for length, correct in zip(lengths, correct_answers(completions, answer), strict=True):
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
    for completion in completion_texts(completions):
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
    for length in completion_lengths(completion_texts(completions), completion_length):
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
    return [sum(0.25 for tag in tags if text.count(tag) == 1) for text in completion_texts(completions)]


# open-r1 `reasoning_steps_reward`. It calls re.findall with no flags, so `^\d+\.` matches only a list number at the
# very start of the completion, not "2." on later lines; we keep that for parity (later list items that start with
# "\n-" or "\n*" do count, and so does a markdown "\n**Answer:**" line).
_REASONING_STEP = re.compile(r"(Step \d+:|^\d+\.|\n-|\n\*|First,|Second,|Next,|Finally,)")


def reasoning_steps_reward(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """open-r1 `reasoning_steps_reward`: min(1, #step markers / 3); 3 because open-r1 aims for at least 3 steps."""
    return [min(1.0, len(_REASONING_STEP.findall(text)) / 3) for text in completion_texts(completions)]

REWARD_FUNCS: dict[str, RewardFunc] = {
    **CORE_REWARD_FUNCS,
    "think_format": think_format_reward,
    "cosine": cosine_reward,
    "repetition": repetition_reward,
    "soft_overlong": soft_overlong_reward,
    "tag_count": tag_count_reward,
    "reasoning_steps": reasoning_steps_reward,
}


# the trainer's keys that reward_options reads (lib/settings.py): the evaluator declares them (eval_agrpo.SHARED_KEYS)
# and the chat page reads them from a run's config.yaml (lib/apps/page.reward_options_of)
REWARD_OPTION_KEYS = ("cosine_max_len", "max_completion_length", "overlong_buffer_length", "repetition_n_grams",
                      "repetition_max_penalty")


def reward_options(cfg) -> dict:
    """Keyword options of the built-in reward functions above (cosine, repetition and soft_overlong), from the
    configuration: lib/setup.resolve_rewards reads them (the trainer's half of lib/models/reward_models.build_rewards),
    and train_agrpo.setup hands them to the reward worker, and lib/rewards/scoring.resolve_reward_funcs binds to each
    function the ones it takes."""
    return {"max_len": cfg.cosine_max_len or cfg.max_completion_length,
            "max_completion_length": cfg.max_completion_length,
            "overlong_buffer_length": cfg.overlong_buffer_length or max(1, cfg.max_completion_length // 5),
            "ngram_size": cfg.repetition_n_grams, "max_penalty": cfg.repetition_max_penalty}
