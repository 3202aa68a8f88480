"""Reward functions for the fast loop tests on the random-weight tiny model, whose completions are random text.

TRL's signature: f(prompts, completions, **columns) -> list[float]."""


def has_x(prompts, completions, **columns):
    """1 when the completion holds the letter x. On the tiny model's 8-token random completions about one in eight
    does (measured: 12%), so most groups are all wrong and some are mixed, as a correctness reward's are early on."""
    return [float("x" in c) for c in completions]


def characters(prompts, completions, **columns):
    """The length in characters / 100: every group has a spread."""
    return [len(c) / 100 for c in completions]


def one(prompts, completions, **columns):
    """1 for everything: no group has a spread, every advantage is 0."""
    return [1.0 for _ in completions]
