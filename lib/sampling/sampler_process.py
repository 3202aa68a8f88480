"""The HF sampler in a process of its own (`sampler_device`, with max_staleness: docs/async.md 8).

A sampling thread (lib/sampling/pipeline.Asynchronous) shares its process with the training step: on one GPU its
kernels queue on its own CUDA stream, on a CPU they share the interpreter. `sampler_device` moves the decode loop
(lib/sampling/rollout.HFRollout, the same code) into a child process on the device it names: another GPU, the training
GPU itself (a CUDA context of its own, whose launch-bound decode steps fill the gaps of the training step's kernels),
or the CPU. The thread stays: it calls `ProcessRollout.generate`, which waits on the child without holding the
interpreter, then scores the batch as before.

Weights. The parent keeps the policy's sampling weights (`sampling_dtype`: adapters merged, a 4-bit base
dequantised) in one plain copy *on the sampler's device*, in memory both processes map (CPU shared memory, or CUDA's
inter-process handles), and refreshes it in place at each push (`sync_weights`, lib/setup.ready_sampler) while the
child is between batches (the pipeline pushes only then). The child samples from that copy directly, so no weights
travel through the pipe and a sampler on another GPU leaves none on the training one; only where the child's own
kernels need another layout (bf16 on a CPU: oneDNN's prepacked linear layers, lib/sampling/cpu_kernels.py) does it
keep a packed copy of its own, reloaded at each push.

Calls. Prompts go to the child and completions come back through a pipe, as CPU tensors (a few kilobytes); the
child's random generator is the HF sampler's, seeded alike, so a run samples the same tokens as with the thread at
the same seed (tested at max_staleness 0 against the synchronous run). A child that fails sends its traceback, which
the caller raises; a child that dies (killed, out of memory) is noticed within a second of the call's wait and named
with its exit code; a child that hangs leaves the thread waiting in `_call`, which the pipeline reports with where it
waits (lib/sampling/pipeline.where_is) every `report_every` seconds.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from unittest import mock

import torch

from lib.models.modeling import end_token_ids, unwrap_causal_lm
from lib.sampling.pipeline import to_device
from lib.sampling.policy_copy import SamplingCopy, merged_copy, sampling_dtype


class SamplerProcessError(RuntimeError):
    """The sampler's process failed, ended or could not start: the message says which, with its traceback or exit."""


class ProcessRollout:
    """HFRollout's interface (generate, sync_weights, state_dict, load_state_dict, ready, sleep, close) over a child
    process that runs an HFRollout on `device`, sampling from this process's shared copy of the policy's weights."""

    def __init__(self, policy: torch.nn.Module, eos_token_ids: list[int], pad_token_id: int, *, bf16: bool,
                 seed: int, device: str, start_timeout: float = 600.0):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        lm = unwrap_causal_lm(policy)
        model, adapted = merged_copy(lm, sampling_dtype(policy, bf16), self.device)
        if self.device.type == "cpu":
            model.share_memory()  # the child maps these pages; CUDA tensors travel as inter-process handles
        # the weights both processes read (no decode step of its own: the child picks its own)
        self.shared = SamplingCopy(model, adapted)
        self.record_logps = False  # HFRollout's switch, sent with each call
        self.lock = threading.Lock()  # one call at a time through the pipe
        context = torch.multiprocessing.get_context("spawn")
        self.conn, child_end = context.Pipe()
        self.process = context.Process(target=serve, name="agrpo-sampler", daemon=True, args=(
            child_end, model, sorted(set(eos_token_ids)), pad_token_id, bf16, seed, str(self.device),
            torch.get_num_threads()))
        # on a CPU the child's OpenMP threads sleep when idle instead of spinning (libgomp reads this at its start):
        # spinning threads of two processes on the same cores made a step 3x slower (docs/async.md 8)
        with mock.patch.dict(os.environ, {"OMP_WAIT_POLICY": "PASSIVE"} if self.device.type == "cpu" else {}):
            self.process.start()  # (the environment as it was once the child has it)
        child_end.close()
        self.info = self._call("started", timeout=start_timeout)

    # HFRollout's attributes the trainer reads
    @property
    def copy(self) -> torch.nn.Module:
        """The weights the sampler samples from (in shared memory, on the sampler's device)."""
        return self.shared.model

    model = copy

    def _call(self, kind: str, payload=None, timeout: float | None = None):
        """Send one request and wait for its answer; the child's error, its end or `timeout` seconds raise."""
        with self.lock:
            try:
                if kind != "started":
                    if not self.process.is_alive():
                        raise self._ended(kind)
                    self.conn.send((kind, payload))
                since = time.perf_counter()
                while not self.conn.poll(1.0):
                    if not self.process.is_alive() and not self.conn.poll(0):
                        raise self._ended(kind)
                    if timeout is not None and time.perf_counter() - since > timeout:
                        raise SamplerProcessError(f"sampler_device: the sampler process did not answer {kind} "
                                                  f"within {timeout:.0f} s")
                status, value = self.conn.recv()
            except (EOFError, OSError):  # the pipe closed under the call: the child is gone
                raise self._ended(kind) from None
        if status == "error":
            raise SamplerProcessError(f"sampler_device: the sampler process failed in {kind}:\n{value}")
        return value

    def _ended(self, kind: str) -> SamplerProcessError:
        self.process.join(timeout=5)
        return SamplerProcessError(f"sampler_device: the sampler process ended (exit code {self.process.exitcode}) "
                                   f"before it answered {kind}: killed, or out of memory on {self.device}")

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, num_generations, max_new_tokens: int,
                 **kwargs):
        """HFRollout.generate in the child: the same arguments, the same Rollout, on the prompts' device."""
        request = to_device(dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, num_generations=num_generations,
                                 max_new_tokens=max_new_tokens, **kwargs), torch.device("cpu"))
        rollout = self._call("generate", (request, self.record_logps))
        return to_device(rollout, prompt_ids.device)

    def sync_weights(self, policy: torch.nn.Module) -> None:
        """The policy's current weights into the shared copy (the child between batches), then into the child's
        packed copy where it keeps one."""
        self.shared.sync(policy)
        if self.device.type == "cuda":  # written before the child's stream reads them
            torch.cuda.synchronize(self.device)
        self._call("sync")

    def state_dict(self) -> dict:
        return self._call("state_dict")

    def load_state_dict(self, state: dict) -> None:
        self._call("load_state_dict", state)

    def sleep(self) -> None:
        """Nothing to free (the child's memory is its own)."""

    def ready(self, policy: torch.nn.Module) -> None:
        """Nothing to wake."""

    def close(self, timeout: float = 30.0) -> None:
        """Stop the child: asked first, then terminated where it does not end within `timeout` seconds."""
        if self.process.is_alive():
            try:
                self._call("close", timeout=timeout)
            except SamplerProcessError:
                pass
            self.process.join(timeout=timeout)
            if self.process.is_alive():
                self.process.terminate()
                self.process.join(timeout=5)
        self.conn.close()


def serve(conn, source: torch.nn.Module, eos_token_ids: list[int], pad_token_id: int, bf16: bool, seed: int,
          device: str, threads: int) -> None:
    """The child: an HFRollout over `source` (the parent's shared copy), or over a packed copy of it where the CPU's
    bf16 kernels want one, answering the parent's requests until it asks it to close."""
    try:
        from lib.models.attention import register_fast_attention
        from lib.sampling.cpu_kernels import can_prepack, prepack_for_cpu
        from lib.sampling.rollout import HFRollout

        register_fast_attention()  # the attention the trainer's models name (lib/models/modeling.py), in this process

        torch.set_num_threads(threads)
        device = torch.device(device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        source.eval().requires_grad_(False)
        if device.type == "cpu" and bf16 and can_prepack():  # oneDNN's packed layers: a copy of its own, packed
            own, _ = merged_copy(source, torch.bfloat16, device)  # from the shared weights (a push reloads them)
            sampler_copy = SamplingCopy(own, [], prepack_for_cpu)
        else:  # the shared weights themselves (the decode step chosen for the model, nothing packed)
            own, sampler_copy = None, SamplingCopy(source, [], prepack_for_cpu)
        engine = HFRollout(sampler_copy.model, eos_token_ids, pad_token_id, bf16=bf16, seed=seed,
                           copy=lambda policy, bf16: sampler_copy)
        conn.send(("ok", {"device": str(device), "own_copy": own is not None, "pid": os.getpid()}))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            kind, payload = conn.recv()
        except EOFError:  # the parent is gone
            return
        try:
            value = None
            if kind == "generate":
                request, engine.record_logps = payload
                value = to_device(engine.generate(**to_device(request, device)), torch.device("cpu"))
            elif kind == "sync":
                if own is not None:
                    sampler_copy.sync(source)
            elif kind == "state_dict":
                value = engine.state_dict()
            elif kind == "load_state_dict":
                engine.load_state_dict(payload)
            elif kind == "close":
                conn.send(("ok", None))
                return
            else:
                raise ValueError(f"unknown request {kind!r}")
            conn.send(("ok", value))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


def process_rollout(policy, tokenizer, bf16: bool, seed: int, device: str) -> ProcessRollout:
    """The HF sampler in a process on `device` (the trainer's `sampler_device`), for `policy` and `tokenizer`."""
    return ProcessRollout(policy, end_token_ids(policy, tokenizer), tokenizer.pad_token_id, bf16=bf16, seed=seed,
                          device=device)
