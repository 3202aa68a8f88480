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


# ---- faults (tests/test_faults.py). These run in the trainer's reward worker (lib/rewards/worker.py), a fresh process
# per run, so a module-level counter counts the calls of one run.
_calls = {"bad_after_two": 0}


def bad_after_two(prompts, completions, **columns):
    """Like `characters` for its first two calls (two generation batches), then the value of the environment variable
    AGRPO_TEST_BAD_VALUE (inf, -inf or nan) for the first completion of every batch."""
    import os

    _calls["bad_after_two"] += 1
    values = characters(prompts, completions)
    if _calls["bad_after_two"] > 2:
        values[0] = float(os.environ.get("AGRPO_TEST_BAD_VALUE", "inf"))
    return values


def hangs_on_x(prompts, completions, **columns):
    """Never returns on a batch that holds a completion with the letter x (a parser stuck on pathological text)."""
    import time

    if any("x" in c for c in completions):
        time.sleep(3600)
    return [1.0 for _ in completions]


def dies_on_x(prompts, completions, **columns):
    """Kills its own process on a completion with the letter x (a C extension's crash)."""
    import os
    import signal

    if any("x" in c for c in completions):
        os.kill(os.getpid(), signal.SIGKILL)
    return [1.0 for _ in completions]


def characters_hang_third(prompts, completions, **columns):
    """Like `characters`, but its third call (the third generation batch of a run) never returns while the file named
    by AGRPO_TEST_HANG_FILE exists: a run to kill at a known step (tests/test_distributed.py). A call that hangs says
    so in a file of its own beside that one, <file>.<pid>."""
    import os
    import time

    _calls["hang_third"] = _calls.get("hang_third", 0) + 1
    flag = os.environ.get("AGRPO_TEST_HANG_FILE", "")
    if _calls["hang_third"] == 3 and os.path.exists(flag):
        with open(f"{flag}.{os.getpid()}", "w"):
            pass
        while os.path.exists(flag):
            time.sleep(0.2)
    return characters(prompts, completions)


# ---- the update's direction and masks (tests/test_update.py)

def half_flat(prompts, completions, answer, **columns):
    """Like `characters` for the built-in task's problems with an even answer, 1 for every completion of the others:
    about half the groups have a spread and half have none (zero advantages), as a correctness reward's batches do."""
    return [len(c) / 100 if int(a) % 2 == 0 else 1.0 for a, c in zip(answer, completions)]


def characters_then_flat(prompts, completions, trainer_state, **columns):
    """`characters` on the first generation batch, then 1 for everything: a run's second step has no advantage, so
    only its KL term moves the policy."""
    return characters(prompts, completions) if trainer_state.global_step == 0 else one(prompts, completions)


_noise = __import__("random").Random(0)


def noise(prompts, completions, **columns):
    """A seeded random score per completion: a reward spread even where every completion is the same text (a model
    taught one answer, tests/test_agents.py)."""
    return [_noise.random() for _ in completions]


def short_from_step_two(prompts, completions, trainer_state, **columns):
    """`characters`, but one value short for the generation batch that optimizer step 2 starts on: a reward function
    that breaks its contract, which stops the run (tests/test_async.py: in the sampling thread)."""
    values = characters(prompts, completions)
    return values[:-1] if trainer_state.global_step >= 2 else values


def kill_the_sampler_process_at_step_two(prompts, completions, trainer_state, **columns):
    """`characters`, and on the generation batch that optimizer step 2 starts on, SIGKILL to the HF sampler's process
    (sampler_device: the trainer's child started by multiprocessing's spawn; this function runs in the reward worker,
    another child of the trainer): a sampler that dies mid-run (tests/test_async.py)."""
    import os

    import psutil

    if trainer_state.global_step >= 2:
        trainer = psutil.Process(os.getppid())
        for child in trainer.children():
            if child.pid != os.getpid() and "spawn_main" in " ".join(child.cmdline()):
                child.kill()
    return characters(prompts, completions)
