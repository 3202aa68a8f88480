"""Where the loop's generation batches come from: sampled when the loop asks (`Synchronous`), or ahead of it in a
thread, from weights up to `max_staleness` optimizer steps old (`Asynchronous`; docs/async.md).

Both take the same two functions from the trainer: `produce(data_position, step) -> Sampled` samples and scores the
generation batch that optimizer step `step` starts to train on (phases 1-2, no weights pushed), and `push() -> float`
gives the sampler the learner's current weights (`lib/setup.ready_sampler`, seconds). The loop calls `next(state)`
for each batch, `after_step(step)` after each optimizer step, and holds `paused()` while it evaluates or saves.

The asynchronous schedule is fixed in advance, so a run does not depend on how fast either side is:

    batch b (trained from step s_b = b S, S = steps_per_rollout) is sampled from the weights after exactly
    r_b = N * ceil(max(0, s_b - k) / N) optimizer steps        (k = max_staleness, N = weight_sync_steps <= k + 1)

so its staleness s_b - r_b is at most k (0 for the first batches), the sampler's weights move only at multiples of
N, and the same seed gives the same tokens, losses and checkpoints however the two threads interleave. With k = 0,
r_b = s_b: every batch waits for the weights of the step before it, the synchronous run's order exactly. At most
floor(k / S) + 1 batches wait for the loop (queue_maxsize is checked against it); no batch is ever dropped for age,
because none is sampled before the weights it is due for exist (TRL's asynchronous trainer samples freely and drops
what comes back too old).

The thread only ever touches the sampler: the learner's weights are read in the loop's thread, at the pushes, which
wait for the sampler to finish the batches due to older weights. A failure in the thread stops the loop with the
thread's error, never a silent wait; a thread that makes no progress while the loop waits is reported every
`report_every` seconds, with where it is (`where_is`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import sys
import threading
import time
import traceback
from dataclasses import dataclass

import torch


def sampling_version(batch: int, steps_per_batch: int, max_staleness: int, sync_every: int = 1) -> int:
    """r_b of the module docstring: the optimizer step whose weights sample generation batch `batch`."""
    start = batch * steps_per_batch
    earliest = max(0, start - max_staleness)
    version = -(-earliest // sync_every) * sync_every
    if version > start:  # cannot happen with sync_every <= max_staleness + 1 (config checks it)
        raise ValueError(f"weight_sync_steps {sync_every} leaves batch {batch} no weights within max_staleness "
                         f"{max_staleness}: set weight_sync_steps <= max_staleness + 1")
    return version


@dataclass
class Produced:
    """A generation batch and where it came from: its index, the optimizer step whose weights sampled it, and when
    sampling it started and ended (seconds since the pipeline started, for the run view's timeline)."""

    batch: int
    version: int
    sampled: object  # lib/sampling/context.Sampled
    started: float
    ended: float


class Synchronous:
    """Each generation batch sampled when the loop asks for it, from the current weights (staleness 0)."""

    def __init__(self, produce, push, steps_per_batch: int, engine_state):
        self.produce, self.push, self.steps_per_batch = produce, push, steps_per_batch
        self.engine_state = engine_state  # the sampler's state for a checkpoint (its random generator)
        self.t0 = time.perf_counter()

    def clock(self) -> float:
        """Seconds since the pipeline started (the timeline's clock)."""
        return time.perf_counter() - self.t0

    def next(self, state):
        seconds = self.push()
        started = time.perf_counter() - self.t0
        sampled = self.produce(state.data_position, state.global_step)
        sampled.weight_sync_seconds = seconds
        return Produced(state.global_step // self.steps_per_batch, state.global_step, sampled, started,
                        time.perf_counter() - self.t0)

    def after_step(self, step: int) -> None:
        """Nothing: the next batch gets the weights when it is sampled."""

    def paused(self):
        return contextlib.nullcontext()

    def state_dict(self) -> dict:
        return {"rollout": self.engine_state()}

    def close(self) -> bool:
        """No thread to stop."""
        return True


class Asynchronous:
    """Generation batches sampled in a thread on the schedule of the module docstring.

    `queue`: batches sampled and not yet trained on (a resumed run starts with those its checkpoint saved);
    `position`, `next_batch`: where the thread goes on; `version`: the optimizer step whose weights the sampler holds.
    """

    def __init__(self, produce, push, steps_per_batch: int, engine_state, *, max_staleness: int, sync_every: int,
                 max_steps: int, start_step: int, data_position: int, queue: list[Produced] | None = None,
                 device: torch.device = torch.device("cpu"), report_every: float = 300.0, say=None,
                 push_inflight=None, drain: bool = False):
        self.produce, self.push, self.engine_state = produce, push, engine_state
        # weights in flight (vllm_inflight_updates): `push_inflight(step) -> seconds` gives the sampler the weights
        # of every N-th step at once, the thread mid-batch or not (its controllers untouched: `push` still refreshes
        # them at the schedule's steps, between batches)
        self.push_inflight = push_inflight
        # a wait longer than report_every seconds is reported (say: a line to the run's console, stderr by default)
        self.report_every, self.say = report_every, say or (lambda line: print(line, file=sys.stderr, flush=True))
        self.steps_per_batch, self.max_staleness, self.sync_every = steps_per_batch, max_staleness, sync_every
        self.max_steps = max_steps
        # several processes (their threads' collectives on a group of their own): every thread stops at the same
        # batch, the last one its weights allow, so that none is left in a collective the others never join
        self.drain = drain
        self.queue: list[Produced] = list(queue or [])
        first = start_step // steps_per_batch
        self.next_batch = first + len(self.queue)
        self.position = self.queue[-1].sampled.data_position if self.queue else data_position
        # the optimizer step whose weights the sampler holds: the start's (a resumed run's queue was sampled from
        # older ones, saved with it); `pushed_for`: the first batch due to newer weights than those
        self.version = start_step
        self.pushed_for = self.next_batch
        self._advance()
        self.busy = False  # the thread is sampling a batch
        self.error: BaseException | None = None
        self.stopping = False
        self.held = False  # the loop holds the sampler (an evaluation, a save)
        self.condition = threading.Condition()
        self.cuda = device.type == "cuda"
        self.device = device
        self.push_seconds = push()  # the start's weights (a resumed policy's, a vLLM engine's first)
        self.t0 = time.perf_counter()
        self.thread = threading.Thread(target=self._run, name="agrpo-sampler", daemon=True)
        self.thread.start()

    clock = Synchronous.clock

    def past_end(self, batch: int) -> bool:
        return batch * self.steps_per_batch >= self.max_steps

    def version_of(self, batch: int) -> int:
        return sampling_version(batch, self.steps_per_batch, self.max_staleness, self.sync_every)

    # ---------------------------------------------------------------------------------------------- the thread
    def _run(self) -> None:
        try:
            with sampling_stream(self.device):
                while True:
                    with self.condition:
                        batch = self.next_batch
                        # (past the run's last batch it waits for the loop to stop it)
                        self.condition.wait_for(lambda: self.stopping or (
                            not self.past_end(batch) and self.version >= self.version_of(batch) and not self.held))
                        if self.stopping:
                            return
                        # the weights it is due to (the pushes wait for the thread); newer only where a run resumes
                        # from a checkpoint with no older weights (a synchronous run's, another max_staleness)
                        version = self.version
                        self.busy = True
                    started = time.perf_counter() - self.t0
                    sampled = self.produce(self.position, batch * self.steps_per_batch)
                    if self.cuda:  # the batch's tensors written before the loop's stream reads them
                        torch.cuda.current_stream(self.device).synchronize()
                    with self.condition:
                        self.queue.append(Produced(batch, version, sampled, started, time.perf_counter() - self.t0))
                        self.position = sampled.data_position
                        self.next_batch = batch + 1
                        self.busy = False
                        self.condition.notify_all()
        except BaseException as error:  # reported to the loop, which stops with it
            with self.condition:
                self.error, self.busy = error, False
                self.condition.notify_all()

    # ---------------------------------------------------------------------------------------------- the loop's side
    def _wait(self, ready, what: str, fail: bool = True) -> None:
        """Wait (holding the condition) until `ready()`; the thread's error, or its end, stops the loop instead (or,
        with `fail` False, ends the wait: the loop meets the error where it next needs a batch)."""
        since = reported = time.perf_counter()
        while not ready():
            if not fail and (self.error is not None or not self.thread.is_alive()):
                return
            if self.error is not None:
                raise RuntimeError(f"max_staleness: the sampling thread failed while the loop waited for {what}: "
                                   f"{type(self.error).__name__}: {self.error}") from self.error
            if not self.thread.is_alive():
                raise RuntimeError(f"max_staleness: the sampling thread ended while the loop waited for {what}")
            self.condition.wait(timeout=min(1.0, self.report_every))
            if time.perf_counter() - reported >= self.report_every:  # a hang is said, not waited on in silence
                reported = time.perf_counter()
                self.say(f"max_staleness: the loop has waited {reported - since:.0f} s for {what}; the sampling thread "
                         f"is {'sampling' if self.busy else 'waiting'} generation batch {self.next_batch} at "
                         f"{where_is(self.thread)}")

    def next(self, state) -> Produced:
        """The batch that step state.global_step starts on, sampled (the loop waits for it where it is not yet)."""
        batch = state.global_step // self.steps_per_batch
        self._push_due(state.global_step)
        with self.condition:
            self._wait(lambda: any(p.batch == batch for p in self.queue), f"generation batch {batch}")
            produced = self.queue.pop(0)
            self.condition.notify_all()
        assert produced.batch == batch, (produced.batch, batch)
        if self.cuda:  # allocated on the thread's stream, used on the loop's: not reused before the loop is done
            for tensor in tensors_of(produced.sampled):
                if tensor.is_cuda:
                    tensor.record_stream(torch.cuda.current_stream(self.device))
        # the pushes since the last batch, logged with this one (the loop's time, where a synchronous run has it)
        produced.sampled.weight_sync_seconds, self.push_seconds = self.push_seconds, 0.0
        return produced

    def after_step(self, step: int) -> None:
        """After optimizer step `step`: the sampler gets the weights where a batch is due to be sampled from them;
        with weights in flight, every N-th step's at once, while the thread samples (PipelineRL's in-flight updates,
        Piché et al. 2025: the batch in progress goes on with them from its next decode step; the batches still
        start on the schedule, so no token is older than max_staleness steps)."""
        if (self.push_inflight is not None and step % self.sync_every == 0 and self.error is None
                and not self.past_end(self.next_batch)):  # (after the last batch was sampled: nothing to push for)
            self.push_seconds += self.push_inflight(step)
        self._push_due(step)

    def _push_due(self, step: int) -> None:
        if self.version_of(self.pushed_for) != step or self.past_end(self.pushed_for):  # no batch waits for them
            return
        with self.condition:  # every batch due to older weights sampled first
            self._wait(lambda: self.next_batch >= self.pushed_for and not self.busy, "the sampler to push weights",
                       fail=False)
            if self.error is not None:  # the step is logged first; the next batch's wait reports the error
                return
            self.held = True
        try:
            self.push_seconds += self.push()
            if self.cuda:  # the new weights written before the thread's stream reads them
                torch.cuda.current_stream(self.device).synchronize()
        finally:
            with self.condition:
                self.held = False
                self.version = step
                self._advance()
                self.condition.notify_all()

    def _advance(self) -> None:
        """`pushed_for` past every batch the sampler's weights serve."""
        while self.version_of(self.pushed_for) <= self.version:
            self.pushed_for += 1

    @contextlib.contextmanager
    def paused(self):
        """The sampler to the loop alone (an evaluation, a save): the thread finishes the batches whose weights it
        has, and starts none until the loop lets go."""
        with self.condition:
            self._wait(self._between_schedules, "the sampler to finish its batch")
            self.held = True
        try:
            yield
        finally:
            with self.condition:
                self.held = False
                self.condition.notify_all()

    def _between_schedules(self) -> bool:
        """The thread idle, every batch its weights allow sampled: the same batch on every process."""
        return not self.busy and (self.next_batch >= self.pushed_for or self.past_end(self.next_batch))

    def state_dict(self) -> dict:
        """The sampler's state and the batches sampled and not yet trained on, for a checkpoint (inside `paused()`:
        the thread between batches)."""
        with self.condition:
            return {"rollout": self.engine_state(), "queue": [copy.copy(p) for p in self.queue]}

    def close(self, timeout: float = 60.0) -> bool:
        """Stop the thread; False (and a line saying where it is) where it is still in a call after `timeout`
        seconds: the run then ends without it (a daemon thread), and its sampler is not closed under it."""
        with self.condition:
            if self.drain:
                self._wait(self._between_schedules, "the sampler to finish its batch", fail=False)
            self.stopping = True
            self.condition.notify_all()
        self.thread.join(timeout=timeout)
        if self.thread.is_alive():
            self.say(f"max_staleness: the sampling thread is still at {where_is(self.thread)} after {timeout:.0f} s; "
                     f"the run ends without it")
            return False
        return True


def where_is(thread: threading.Thread) -> str:
    """The innermost frame of `thread`'s stack outside this module and `threading`, as file:line in function (for a
    hang report: the call that does not return)."""
    frame = sys._current_frames().get(thread.ident)
    skip = {__file__, threading.__file__}
    stack = [f for f in traceback.extract_stack(frame) if f.filename not in skip] if frame is not None else []
    if not stack:
        return "an unknown place"
    last = stack[-1]
    return f"{last.filename.rsplit('/', 1)[-1]}:{last.lineno} in {last.name}"


def tensors_of(value):
    """Every tensor inside `value` (dataclasses, lists, tuples, dicts)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from tensors_of(getattr(value, f.name))
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_of(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_of(item)


def to_device(value, device):
    """`value` with every tensor inside it moved to `device` (a checkpoint's queue is read to the CPU)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: to_device(getattr(value, f.name), device)
                                             for f in dataclasses.fields(value) if f.init})
    if isinstance(value, list):
        return [to_device(item, device) for item in value]
    if isinstance(value, tuple):
        return tuple(to_device(item, device) for item in value)
    if isinstance(value, dict):
        return {k: to_device(item, device) for k, item in value.items()}
    return value


@contextlib.contextmanager
def sampling_stream(device: torch.device):
    """The sampling thread's CUDA stream, so that its kernels run beside the training step's on the default stream
    (one stream would queue them one after the other); nothing on a CPU."""
    if device.type != "cuda":
        yield
        return
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        yield
