"""Tools for tests/test_agents.py: one of each way a tool can fail the trainer, environments (environment_factory) and
a rollout function (rollout_func) (docs/agents.md)."""

import asyncio
import os
import random
import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


async def slow_double(x: int) -> int:
    """Double a number, after a short wait.

    Args:
        x: The number.
    """
    await asyncio.sleep(0.01)
    return 2 * x


def broken(x: int) -> int:
    """Always raises.

    Args:
        x: Anything.
    """
    raise ValueError(f"cannot handle {x}")


def hangs(x: int) -> int:
    """Never returns in time.

    Args:
        x: Anything.
    """
    time.sleep(600)
    return x


def dies(x: int) -> int:
    """Ends its process.

    Args:
        x: Anything.
    """
    os._exit(3)


class _Unprintable:
    def __str__(self):
        raise RuntimeError("no text for this")


def unprintable(x: int):
    """Returns something that cannot be printed.

    Args:
        x: Anything.
    """
    return _Unprintable()


def untyped(x):
    """No type hint.

    Args:
        x: Anything.
    """
    return x


class Counter:
    """An environment (environment_factory): a counter whose state lives in its instance, one per episode; reset
    tells the model where it starts, get_reward is the count."""

    def reset(self, start: int | str = 0, **row) -> str:
        # start "random": a reset that draws its own state (refused: one prompt's episodes must share its text)
        self.count = random.randrange(10**9) if start == "random" else int(start)
        return f" The counter starts at {self.count}."

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: How much to add.
        """
        self.count += by
        return self.count

    def explode(self) -> int:
        """Always raises."""
        raise RuntimeError(f"boom at {self.count}")

    def stall(self) -> int:
        """Never returns in time."""
        time.sleep(600)
        return self.count

    def get_reward(self) -> float:
        return float(self.count)

    def _hidden(self) -> None:  # not a tool: its name starts with "_"
        pass


class Store:
    """A second environment: a key-value store, no reset text, no reward of its own."""

    def reset(self, **row) -> None:
        self.data = {}

    def put(self, key: str, value: str) -> str:
        """Store a value.

        Args:
            key: The key.
            value: The value.
        """
        self.data[key] = value
        return "ok"

    def get(self, key: str) -> str:
        """Read a value.

        Args:
            key: The key.
        """
        return self.data.get(key, "missing")


class BadReset:
    """An environment whose reset fails."""

    def reset(self, **row) -> None:
        raise KeyError("no such level")

    def look(self) -> str:
        """Look around."""
        return "nothing"


class NoReset:
    def look(self) -> str:
        """Look around."""
        return "nothing"


class Adder:
    """An environment whose one method is `add` as described above (the same schema, and reset adds no text, so the
    model taught to call that tool sees its own prompt and calls it here): the episode's successful calls are its
    state, get_reward their count (tests/test_agents_runs.py)."""

    def reset(self, **row) -> None:
        self.calls = 0

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first.
            b: The second.
        """
        self.calls += 1
        return a + b

    def get_reward(self) -> float:
        return float(self.calls)


# ---- rollout_func (tests/test_agents.py): TRL's signature f(prompts, trainer) -> dict

FEEDBACK = " [checked]"


def rollout_with_feedback(prompts, trainer):
    """Samples 4 tokens of each prompt with the trainer's own sampler, then appends an environment's feedback
    (env_mask 0 there); the completion's model length travels to the reward functions as `feedback_score`."""
    tok = trainer.processing_class
    texts = [p if isinstance(p, str) else tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
             for p in prompts]
    prompt_ids = [tok.encode(t, add_special_tokens=False) for t in texts]
    completions, logprobs = trainer.generate(prompt_ids, max_new_tokens=4)
    feedback = tok.encode(FEEDBACK, add_special_tokens=False)
    return {"prompt_ids": prompt_ids, "completion_ids": [c + feedback for c in completions], "logprobs": None,
            "env_mask": [[1] * len(c) + [0] * len(feedback) for c in completions],
            "feedback_score": [float(len(c)) for c in completions], "source": "tiny"}


def feedback(prompts, completions, feedback_score, source, **columns):
    """A reward function that reads the rollout function's extra fields (a value that was not a list comes once per
    completion, as in TRL)."""
    assert source == ["tiny"] * len(completions), source
    return list(feedback_score)
