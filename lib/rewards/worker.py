"""Reward functions in a worker process, each call with a time limit (docs/faults.md).

Reward functions are user code that parses model output: some hang on pathological text (a regular expression that
backtracks, a symbolic simplification that never ends), some crash the interpreter (a C extension's segfault,
`os._exit`). In the trainer's own process either would stop the run. Here they run in a child process that the
trainer starts once and talks to over a pipe: a call that does not answer within `timeout` seconds is abandoned (the
child is killed and started again on the next call) and one whose child dies is reported the same way; both raise
`RewardCallFailed`, which `lib.rewards.scoring.score_completions` scores as a failure and counts, exactly as it does for a
function that raises. The child resolves the reward specs itself (`resolve_reward_funcs`), so built-ins (those of
lib/rewards/open_r1.REWARD_FUNCS), `module:function` and `file.py:function` all work without pickling
functions; reward models (None in the specs, lib/setup.resolve_rewards) stay in the trainer, on its device, and are
never sent here.

A request is a list of jobs, (function index, TRL's keyword arguments): one call of a synchronous function, or
several calls of `async def` functions, which the child runs at once on its event loop (lib.rewards.scoring.run_jobs), each
cancelled at `timeout` (`with_time_limit`); the trainer waits `timeout` plus ASYNC_GRACE_S for those (a coroutine that
blocks instead of awaiting cannot be cancelled, and then the child is killed like any hung call).

    python -m lib.rewards.worker      # started by RewardWorker, speaks pickled frames on the descriptor it is given

The child ignores SIGINT, SIGTERM and SIGUSR1 (the trainer decides what a signal means: a checkpoint on preemption,
lib/checkpoint.StopRequest) and is killed with SIGKILL by `close()`, or by the kernel when the trainer dies (Linux
parent-death signal).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import pickle
import signal
import subprocess
import sys
import time
from multiprocessing.connection import Connection, wait

from lib.rewards.open_r1 import REWARD_FUNCS
from lib.rewards.scoring import describe_failure, is_async, resolve_reward_funcs, run_jobs

# Extra seconds the trainer waits for a request of async calls, past the child's own cancellation at `timeout`, so that
# a call that is cancelled in time reports itself instead of having the child killed under it.
ASYNC_GRACE_S = 1.0


class RewardTimeout(Exception):
    """An async call that ran past its time limit, cancelled in the child. Its message is a predicate of the function,
    like RewardCallFailed's."""

    predicate = True


def with_time_limit(func, timeout: float):
    """`func`, an `async def` one cancelled after `timeout` seconds (0: no limit). A coroutine is stopped only where it
    awaits, so the trainer's own deadline (`timeout` + ASYNC_GRACE_S) covers one that blocks."""
    if not timeout or not is_async(func):
        return func

    async def limited(**kwargs):
        try:
            return await asyncio.wait_for(func(**kwargs), timeout)
        except TimeoutError:
            raise RewardTimeout(f"gave no answer within reward_timeout = {timeout:g} s; the call was "
                                f"cancelled") from None

    return limited


class RewardCallFailed(Exception):
    """A reward call that did not return: it raised in the worker, ran past the time limit, or killed the worker.
    Its message is a predicate of the function ("raised ValueError: ...", "gave no answer within ..."), which
    lib.rewards.scoring.score_completions puts after the function's name."""

    predicate = True


class RewardWorker:
    """A child process that runs the reward functions `specs` (resolved there with `options`), one request at a time.

    `run(jobs, concurrent)` returns each job's list of rewards or a RewardCallFailed (what
    lib.rewards.scoring.score_completions' `call` gets); `call(index, prompts, completions, columns)` runs one and raises.
    The child starts on the first request (about a second: it imports lib.rewards.scoring) and again after a request that killed it or ran out of time.
    `start_seconds` and `restarts` say what that cost.
    """

    # what the child runs and how its failures are named: lib/agents/episodes.py's ToolWorker runs tools the same way
    CHILD, NAME, TIMEOUT_KEY = "lib.rewards.worker", "reward worker", "reward_timeout"

    def __init__(self, specs: list[str | None], options: dict, timeout: float):
        self.specs, self.options, self.timeout = list(specs), dict(options), float(timeout)
        self.proc: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.restarts = 0  # children started after the first
        self.start_seconds = 0.0  # from starting a child to its first answer, summed
        self._ready, self._started_at = False, 0.0

    # -------------------------------------------------------------------------------------------------- lifetime
    def _start(self) -> None:
        t0 = time.perf_counter()
        if self.proc is not None:
            self.restarts += 1
        read_parent, write_child = os.pipe()  # child -> parent
        read_child, write_parent = os.pipe()  # parent -> child
        env = dict(os.environ)
        # the child imports what the trainer can: the same module search path (file.py:function specs resolve
        # against the same working directory)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env.setdefault("OMP_NUM_THREADS", "1")  # reward code is Python; it must not compete with the trainer's threads
        self.proc = subprocess.Popen(
            [sys.executable, "-m", self.CHILD, str(read_child), str(write_child)],
            pass_fds=(read_child, write_child), env=env, stdin=subprocess.DEVNULL)
        os.close(read_child)
        os.close(write_child)
        self.conn = _Duplex(Connection(read_parent, writable=False), Connection(write_parent, readable=False))
        self.conn.send(self.init_payload())
        self._started_at, self._ready = t0, False  # the child imports while the trainer goes on; call() waits

    def init_payload(self):
        """The child's first frame, what its setup function is given."""
        return self.specs, self.options, self.timeout

    def start(self) -> None:
        """Start the child now (it loads the reward functions while the caller loads its models)."""
        if self.proc is None or self.proc.poll() is not None or self.conn is None:
            self._start()

    def _wait_ready(self) -> None:
        ok, payload = self._receive(max(self.timeout, 60.0), " while starting")
        if not ok:  # the specs did not resolve in the child: the trainer resolved them, so this is the environment
            self.close()
            raise RewardCallFailed(f"could not be loaded in the {self.NAME} ({payload})")
        self._ready = True
        self.start_seconds += time.perf_counter() - self._started_at

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.conn is not None:
            self.conn.close()
        self.conn = None

    def __del__(self):
        with contextlib.suppress(Exception):  # interpreter shutdown: nothing left to report to
            self.close()

    # -------------------------------------------------------------------------------------------------- calls
    def run(self, jobs: list[tuple[int, dict]], concurrent: bool = False) -> list:
        """Each job's output, or the RewardCallFailed that stands for it: what the function raised, or, for every job
        of the request, a time limit passed or a dead worker. `concurrent`: the jobs are async calls, run at once."""
        try:
            self.start()
            if not self._ready:
                self._wait_ready()
            try:
                self.conn.send(jobs)
            except OSError:  # the child died between calls (BrokenPipeError)
                self._start()
                self._wait_ready()
                self.conn.send(jobs)
            _, answers = self._receive(self.timeout + ASYNC_GRACE_S * concurrent if self.timeout else 0, "")
        except RewardCallFailed as failed:
            return [failed] * len(jobs)
        return [payload if ok else RewardCallFailed(payload) for ok, payload in answers]

    def call(self, index: int, prompts: list, completions: list, columns: dict) -> list:
        """Function `index`'s rewards of one batch; raises RewardCallFailed."""
        [out] = self.run([(index, {**columns, "prompts": prompts, "completions": completions})])
        if isinstance(out, RewardCallFailed):
            raise out
        return out

    def _receive(self, timeout: float, doing: str):
        """The child's next answer, or RewardCallFailed after killing it (no answer in time, or it died)."""
        if not wait([self.conn.reader], timeout=timeout if timeout > 0 else None):
            self.close()
            limit = timeout if doing else self.timeout  # a request of async calls had a grace second on top
            raise RewardCallFailed(f"gave no answer within {self.TIMEOUT_KEY} = {limit:g} s{doing}; the call was "
                                   "abandoned and the worker restarted")
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            code = self.proc.wait()
            self.close()
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            raise RewardCallFailed(f"killed the {self.NAME} ({how}){doing}; it was restarted") from None


class _Duplex:
    """Two one-way connections used as one."""

    def __init__(self, reader: Connection, writer: Connection):
        self.reader, self.writer = reader, writer

    def send(self, obj) -> None:
        self.writer.send(obj)

    def recv(self):
        return self.reader.recv()

    def close(self) -> None:
        self.reader.close()
        self.writer.close()


# ------------------------------------------------------------------------------------------------------ the child
def serve(read_fd: int, write_fd: int, setup) -> None:
    """The child's side: `setup(init)` (the first frame) returns the function that answers each later request; an
    error in `setup` is sent back as (False, message), and then the child ends."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    if sys.platform.startswith("linux"):  # die with the trainer, even when it is killed with SIGKILL
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    # the pipe's descriptors carry the frames; what reward code prints goes to stderr, never into a frame
    os.dup2(2, 1)
    reader, writer = Connection(read_fd, writable=False), Connection(write_fd, readable=False)

    try:
        answer = setup(reader.recv())
    except Exception as error:  # noqa: BLE001 - reported to the trainer, which names it
        writer.send((False, f"{type(error).__name__}: {error}"))
        return
    writer.send((True, None))
    while True:
        try:
            request = reader.recv()
        except EOFError:  # the trainer closed the pipe
            return
        writer.send((True, answer(request)))


def _reward_setup(init):
    specs, options, timeout = init
    resolved = iter(resolve_reward_funcs([spec for spec in specs if spec is not None], options,
                                         named_rewards=REWARD_FUNCS))
    # None: a reward model, run in the trainer
    funcs = [None if spec is None else with_time_limit(next(resolved)[1], timeout) for spec in specs]

    def answer(jobs):
        answers = []
        for out in run_jobs(funcs, jobs):
            if isinstance(out, Exception):
                answers.append((False, describe_failure(out)))
                continue
            item = (True, list(out) if isinstance(out, tuple) else out)
            try:
                pickle.dumps(item)  # an unpicklable result is the function's error, not the pipe's
            except Exception as error:  # noqa: BLE001
                item = (False, f"raised {type(error).__name__}: {error}")
            answers.append(item)
        return answers
    return answer


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]), _reward_setup)
