"""Reward functions written as TRL's and open-r1's are, for tests/test_rewards.py and tests/test_reward_models.py:
called with keywords only, the completion conversational (`completion[0]["content"]`), the gold in a `solution` column,
what they do not use in **kwargs, `completion_ids` and `trainer_state` where TRL passes them, and `async def`. Our own
functions with those calling conventions (not copies of open-r1's), loaded by the tests as `file.py:function`, in
this process or in the reward worker."""

import asyncio
import re
import time


def boxed_equals_solution(completions, solution, **kwargs):
    """open-r1's accuracy convention: 1.0 when the completion's last \\boxed{...} is the solution's, else 0.0."""
    def boxed(text):
        found = re.findall(r"\\boxed\{([^{}]*)\}", text)
        return found[-1].strip() if found else None

    contents = [completion[0]["content"] for completion in completions]
    return [1.0 if boxed(c) is not None and boxed(c) == boxed(s) else 0.0 for c, s in zip(contents, solution)]


def opens_with_think(completions, **kwargs):
    """open-r1's format convention: 1.0 when the content opens with <think>."""
    return [1.0 if completion[0]["content"].startswith("<think>") else 0.0 for completion in completions]


def token_count(completion_ids, **kwargs):
    """TRL's length convention (get_soft_overlong_punishment counts these): the completion's token ids."""
    return [float(len(ids)) for ids in completion_ids]


def prompt_turns(prompts, completions, **kwargs):
    """The number of messages of a conversational prompt (TRL passes them as they are in the data), -1 for text."""
    return [float(len(p)) if isinstance(p, list) else -1.0 for p in prompts]


def steps_done(completions, trainer_state, **kwargs):
    """TRL's dynamic shaping convention: the trainer's optimizer steps done so far, read from `trainer_state`."""
    return [float(trainer_state.global_step) for _ in completions]


def progress(completions, trainer_state, **kwargs):
    """Everything of trainer_state a function may read: global_step + max_steps / 1000 + epoch / 10^6."""
    state = trainer_state
    return [state.global_step + state.max_steps / 1000 + state.epoch / 1e6 for _ in completions]


async def slow_length(completions, **kwargs):
    """An async judge that takes a second (a remote call) and scores the content's length."""
    await asyncio.sleep(1.0)
    return [float(len(completion[0]["content"])) for completion in completions]


async def slow_words(completions, **kwargs):
    """Another one-second async judge: the number of words."""
    await asyncio.sleep(1.0)
    return [float(len(completion[0]["content"].split())) for completion in completions]


async def waits_forever(completions, **kwargs):
    """An async call whose remote end never answers: it awaits, so a time limit can cancel it."""
    await asyncio.sleep(3600)
    return [0.0 for _ in completions]


async def blocks_the_loop(completions, **kwargs):
    """An async function that blocks instead of awaiting: nothing short of killing its process stops it."""
    time.sleep(3600)
    return [0.0 for _ in completions]
