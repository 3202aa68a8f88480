"""Tools for tests/test_agents.py: one of each way a tool can fail the trainer (docs/agents.md)."""

import asyncio
import os
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
