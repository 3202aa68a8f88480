"""Weights in flight (`vllm_inflight_updates`, docs/async.md 7): new weights reach a generation server's engine
between two decode steps of the batch it is sampling, instead of after the batch, as PipelineRL does (Piché et al.
2025, "PipelineRL: Faster On-policy Reinforcement Learning for Long Sequence Generation", its in-flight weight
updates). Each token then comes from the newest weights the trainer had pushed when it was drawn, and is labelled
with their version.

The server's side (serve_vllm.py):
- `stepped_generate` is `LLM.generate` with the engine stepped here, one scheduler step (a prefill or a decode step
  of every running sequence) at a time, calling `between_steps()` before each: with nothing to apply there it is
  `LLM.generate` step for step (its requests, ids, FINAL_ONLY outputs and order), so it samples the same tokens;
- `Updates` holds the weight updates the trainer posts: applied by the stepping loop between two steps where a batch
  is being sampled, else by a thread of their own under the engine's lock (the server's behaviour without in-flight
  updates);
- each update labels the engine's weights with the version the trainer gave (its optimizer step) through vLLM's own
  weight versions (`LLMEngine.set_weight_version`): vLLM records for every sequence the output-token index where each
  version began (`CompletionOutput.weight_versions`), which `token_versions` turns into a version per token.

The KV cache of a sequence in flight is kept across an update: its earlier tokens' keys and values were computed by
the old weights, and the later tokens attend to them, as in PipelineRL. vLLM cannot drop the prefix cache while
sequences hold blocks, so an update in the middle of a batch drops it when the batch ends instead (a sequence that
started later in the same batch may still reuse a prompt's blocks computed by the old weights).

The trainer's side: train_agrpo.py pushes each optimizer step's weights as soon as the step made them
(lib/sampling/pipeline.Asynchronous, `push_inflight`), and logs the staleness of the tokens (`token_staleness`).
"""

from __future__ import annotations

import threading

import torch


def stepped_generate(llm, prompts: list, params: list, lora_request, between_steps) -> list:
    """`llm.generate(prompts, params, lora_request=...)` (vLLM V1, in-process engine), stepping the engine here and
    calling `between_steps()` before each step. The outputs in the prompts' order, as LLM.generate returns them."""
    llm.enqueue(prompts, params, lora_request=lora_request, use_tqdm=False)  # LLM.generate's own requests
    engine, outputs = llm.llm_engine, []
    while engine.has_unfinished_requests():
        between_steps()
        outputs.extend(output for output in engine.step() if output.finished)
    return sorted(outputs, key=lambda output: int(output.request_id))  # as LLM.generate orders them


def steps_one_at_a_time(llm) -> bool:
    """Whether the engine finishes each step before `step()` returns, so that weights changed between two calls
    change no forward pass in progress: no batch queue (asynchronous scheduling or pipeline parallelism, where a
    step is scheduled while the one before still runs: a GPU engine's default in vLLM 0.32; serve_vllm.py's
    --inflight_updates turns it off), and weight versions to label the tokens with (vLLM 0.32 has them)."""
    engine = llm.llm_engine
    return int(getattr(engine.vllm_config, "max_concurrent_batches", 2)) == 1 and hasattr(engine, "set_weight_version")


def token_versions(sample, length: int) -> list[int]:
    """The weight version of each of a completion's `length` tokens, from vLLM's spans (`weight_versions`: the
    version label and the output-token range it sampled); -1 where no label says (a label that is not a number:
    vLLM's "default", weights no update labelled)."""
    versions = [-1] * length
    for span in getattr(sample, "weight_versions", None) or []:
        label = int(span.version) if str(span.version).lstrip("-").isdigit() else -1
        versions[span.start:min(span.end, length)] = [label] * max(0, min(span.end, length) - span.start)
    return versions


def versions_tensor(rows: list[list[int]], completion_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) int64 of a rollout's completions: each row's token versions (`token_versions`), -1 past them."""
    out = torch.full(completion_ids.shape, -1, dtype=torch.long)
    for i, row in enumerate(rows):
        width = min(len(row), out.shape[1])
        out[i, :width] = torch.tensor(row[:width], dtype=torch.long)
    return out.to(completion_ids.device)


class Updates:
    """The weight updates of a generation server (serve_vllm.build_app), applied where they may be.

    `post(job)`, `job(in_flight)` loading the weights (`in_flight`: sequences hold KV blocks, so the prefix cache
    cannot be dropped now): a stepping batch in progress runs the job between two of its steps (`between_steps`, in
    its own thread, which holds the engine's lock); otherwise a thread of its own takes the engine's lock and runs it
    (waiting for a batch sampled without stepping to end, the server's behaviour without in-flight updates). A job
    posted just as a stepping batch starts is run by that batch before its first step. `mid_batch`: an update landed
    while sequences were in flight (their blocks could not be dropped from the prefix cache then: `finish_batch`
    drops them)."""

    def __init__(self, lock: threading.Lock, report_error):
        self.lock, self.report_error = lock, report_error
        self.condition = threading.Condition()
        self.pending: list = []
        self.stepping = False
        self.steps = 0  # the steps the stepping batch has taken
        self.mid_batch = False

    def post(self, job) -> None:
        with self.condition:
            self.pending.append(job)
            if self.stepping:
                return

        def run() -> None:
            with self.lock:
                self._run_pending(in_flight=False)

        threading.Thread(target=run, daemon=True).start()

    def _run_pending(self, in_flight: bool) -> None:
        with self.condition:
            jobs, self.pending = self.pending, []
        for job in jobs:
            try:
                job(in_flight)
            except Exception as error:  # noqa: BLE001 - reported to the trainer through /health
                self.report_error(error)
            self.mid_batch |= in_flight

    def start_batch(self) -> None:
        """A stepping batch begins (the caller holds the engine's lock)."""
        with self.condition:
            self.stepping, self.steps = True, 0

    def between_steps(self) -> None:
        """Before each step: the updates posted meanwhile, in flight once a step has run (before the first, no
        sequence holds blocks yet: the update is applied as between batches)."""
        if self.pending:
            self._run_pending(in_flight=self.steps > 0)
        self.steps += 1

    def finish_batch(self, reset_prefix_cache) -> None:
        """A stepping batch ended (the caller still holds the engine's lock): the updates posted since its last step
        applied, and the prefix cache dropped where an update landed while sequences held blocks."""
        with self.condition:
            self.stepping, self.steps = False, 0
        self._run_pending(in_flight=False)
        if self.mid_batch:
            reset_prefix_cache()
            self.mid_batch = False


def token_staleness(versions: torch.Tensor, mask: torch.Tensor, trained_from: int) -> dict[str, float]:
    """The staleness of a batch's sampled tokens (`versions` (B, T): the optimizer step whose weights drew each
    token; `mask`: the tokens sampled) for a step that trains the weights after `trained_from` steps: its mean and
    largest value over the tokens."""
    sampled = mask.bool()
    if not sampled.any():
        return {}
    staleness = (trained_from - versions[sampled]).double()
    return {"staleness/tokens_mean": float(staleness.mean()), "staleness/tokens_max": float(staleness.max())}
