"""Asynchronous GRPO (max_staleness, lib/sampling/pipeline.py, docs/async.md) on the tiny random-weight model, in this
process: the synchronous run exactly at staleness 0, the fixed schedule of which weights sample which batch, exact
resume with the batches sampled ahead, every controller fed in training order, and a failing sampling thread that
stops the run with its error. The tests of three runs each are marked slow."""

import json
import shutil
import threading
import time
import types

import pytest
import torch
from safetensors.torch import load_file

from lib.config import ConfigError, make_config, validate
from lib.sampling.pipeline import Asynchronous, sampling_version
from test_loop import REWARDS, TINY, launch_two_processes, read_jsonl, steps_of, train, without_times

# every controller at once (A-GRPO's KL, entropy and group size, adaGRPO's retries, AGPO-DSF's probe and clip ranges),
# two optimizer steps per generation batch
EVERY_CONTROLLER = ["--algo", "agpo_dsf", "--adaptive_kl", "true", "--adaptive_group_size", "true", "--group_size_min",
                    "2", "--group_size_max", "8", "--num_iterations", "2", "--resample_schedule",
                    '[{"step": 1, "params": [{"temperature": 1.0}]}]', "--kl_estimator", "k1",
                    "--use_adaptive_entropy", "true", "--entropy_target", "100"]


def completions_by_step(out) -> dict[int, list[str]]:
    lines = read_jsonl(out / "completions.jsonl")
    steps = {}
    for line in lines:
        steps.setdefault(line["step"], []).append(line["completion"])
    return steps


def test_the_schedule_bounds_staleness_and_moves_weights_at_push_points():
    """r_b = N ceil(max(0, b S - k) / N): staleness b S - r_b never above k; weights pushed at multiples of N."""
    for steps_per_batch in (1, 2, 3):
        for k in range(0, 5):
            for n in range(1, k + 2):
                for b in range(12):
                    r = sampling_version(b, steps_per_batch, k, n)
                    assert 0 <= b * steps_per_batch - r <= k and r % n == 0
                    assert r == 0 or b * steps_per_batch - (r - n) > k  # the newest weights allowed
    assert [sampling_version(b, 1, 2, 3) for b in range(7)] == [0, 0, 0, 3, 3, 3, 6]
    with pytest.raises(ValueError, match="weight_sync_steps"):
        sampling_version(5, 1, 1, 3)


def test_staleness_zero_is_the_synchronous_run_with_every_controller(tmp_path, tiny_model):
    """max_staleness 0 goes through the sampling thread and gives the synchronous run's tokens, losses, controller
    values, evaluations (at the start, in the middle, at the end: the thread waits while they sample) and final
    weights exactly (the sampler's own copy of the weights samples what the policy itself does)."""
    args = [*EVERY_CONTROLLER, "--max_steps", "4", "--num_eval_samples", "4", "--eval_steps", "2"]
    want = train(tiny_model, tmp_path / "sync", *args)
    got = train(tiny_model, tmp_path / "async0", *args, "--max_staleness", "0")
    assert [m["staleness"] for m in got] == [0, 1] * 2  # the second step on a batch: one step after its weights
    assert [without_times(m) for m in got] == [without_times(m) for m in want]
    assert completions_by_step(tmp_path / "async0") == completions_by_step(tmp_path / "sync")
    evaluations = [[m for m in read_jsonl(tmp_path / name / "metrics.jsonl") if "eval/accuracy" in m]
                   for name in ("async0", "sync")]
    assert [m["step"] for m in evaluations[0]] == [0, 2, 4] and evaluations[0] == evaluations[1]
    a, b = (load_file(tmp_path / name / "final" / "model.safetensors") for name in ("async0", "sync"))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_dynamic_sampling_refills_in_the_thread_and_the_data_order_holds(tmp_path, tiny_model):
    """DAPO's dynamic sampling replaces flat groups with new prompts inside the thread: at staleness 0 the run is the
    synchronous one (the same prompts drawn, the same groups replaced), and at staleness 1 every checkpoint's data
    position is the trained batches' (one new prompt per replaced group)."""
    args = ["--algo", "dapo", "--num_generations", "2", "--mask_truncated_completions", "false", "--max_steps", "3",
            "--save_steps", "1"]
    want = train(tiny_model, tmp_path / "sync", *args)
    assert sum(m["dynamic_sampling/replaced_groups"] for m in want) > 0
    got = train(tiny_model, tmp_path / "async0", *args, "--max_staleness", "0")
    assert [without_times(m) for m in got] == [without_times(m) for m in want]
    stale = train(tiny_model, tmp_path / "async1", *args, "--max_staleness", "1")
    for step in (1, 2, 3):
        state = json.loads((tmp_path / "async1" / f"checkpoint-{step}" / "trainer_state.json").read_text())
        replaced = sum(m["dynamic_sampling/replaced_groups"] for m in stale[:step])
        assert state["data_position"] == 4 * step + replaced


@pytest.mark.slow
def test_each_batch_is_sampled_from_the_weights_its_staleness_says(tmp_path, tiny_model):
    """max_staleness 2, one step a batch: batches 0-2 come from the starting weights, batch 3 from the weights after
    step 1. A synchronous run whose weights never move samples batches 0-2 token for token (the
    sampler's random stream is the same), and its batch 3 differs; the importance weights against the sampler's
    log-probs are logged."""
    got = train(tiny_model, tmp_path / "async2", "--max_steps", "4", "--max_staleness", "2")
    assert [m["staleness"] for m in got] == [0, 1, 2, 2]
    assert all("sampling/importance_sampling_ratio/mean" in m for m in got), sorted(got[0])
    # (a learning rate far below the weights' float32 resolution: every step leaves them bit for bit)
    frozen = train(tiny_model, tmp_path / "frozen", "--max_steps", "4", "--learning_rate", "1e-30")
    async_batches, frozen_batches = completions_by_step(tmp_path / "async2"), completions_by_step(tmp_path / "frozen")
    assert [async_batches[s] for s in (1, 2, 3)] == [frozen_batches[s] for s in (1, 2, 3)]
    assert async_batches[4] != frozen_batches[4]
    # and the schedule does not depend on the threads' timing: the same run again is the same run
    again = train(tiny_model, tmp_path / "again", "--max_steps", "4", "--max_staleness", "2")
    assert [without_times(m) for m in again] == [without_times(m) for m in got]


def test_the_sampler_is_never_used_by_two_threads_at_once(tmp_path, tiny_model, monkeypatch):
    """Evaluations (at the start, every 2 steps, at the end) and checkpoints pause the thread: the HF sampler's
    generate, watched as it runs, is never entered twice at the same time, while the thread runs two batches ahead."""
    from lib.sampling.rollout import HFRollout

    real, inside, overlaps = HFRollout.generate, [], []

    def watched(self, *args, **kwargs):
        if inside:
            overlaps.append(kwargs.get("greedy", False))
        inside.append(1)
        try:
            time.sleep(0.05)  # long enough for a second caller to arrive where one could
            return real(self, *args, **kwargs)
        finally:
            inside.pop()

    monkeypatch.setattr(HFRollout, "generate", watched)
    got = train(tiny_model, tmp_path / "run", "--max_steps", "4", "--max_staleness", "2", "--num_eval_samples", "4",
                "--eval_steps", "2", "--save_steps", "2")
    assert [m["staleness"] for m in got] == [0, 1, 2, 2] and overlaps == []


def test_weight_sync_steps_moves_the_samplers_weights_every_n_steps(tmp_path, tiny_model):
    """weight_sync_steps 3 with max_staleness 2: batches 0-2 from step 0's weights, 3-5 from step 3's."""
    got = train(tiny_model, tmp_path / "run", "--max_steps", "6", "--max_staleness", "2", "--weight_sync_steps", "3")
    assert [m["staleness"] for m in got] == [0, 1, 2, 0, 1, 2]


@pytest.mark.slow
def test_a_resumed_asynchronous_run_continues_with_the_batches_sampled_ahead(tmp_path, tiny_model):
    """max_staleness 3 with every controller, two steps a batch: the step-2 checkpoint holds the batch sampled ahead
    (batch 1, from the start's weights), and the run resumed from it logs every number and ends with every weight as the uninterrupted run."""
    args = [*EVERY_CONTROLLER, "--max_steps", "6", "--save_steps", "2", "--max_staleness", "3"]
    reference = tmp_path / "uninterrupted"
    want = train(tiny_model, reference, *args)
    # batches 0 and 1 from the start's weights, batch 2 from step 1's (r_b = max(0, 2 b - 3)); a batch's second
    # step is one step further from the weights that sampled it
    assert [m["staleness"] for m in want] == [0, 1, 2, 3, 3, 4]
    saved = torch.load(reference / "checkpoint-2" / "rng_state_0.pt", weights_only=False)["queue"]
    assert [(p.batch, p.version) for p in saved] == [(1, 0), (2, 1)]  # (batch, the step whose weights sampled it)
    out = tmp_path / "resumed"
    shutil.copytree(reference, out, ignore=shutil.ignore_patterns("checkpoint-4", "checkpoint-6", "final"))
    got = train(tiny_model, out, *args, "--resume_from_checkpoint", "latest")
    assert [m["step"] for m in got] == list(range(1, 7))
    assert [without_times(m) for m in got] == [without_times(m) for m in want]
    a, b = load_file(out / "final" / "model.safetensors"), load_file(reference / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_failing_sampling_thread_stops_the_run_with_its_error(tmp_path, tiny_model):
    """The reward function breaks its contract on the batch step 2 starts on, which the thread samples while the
    loop trains step 1 or 2: the loop stops with the thread's error (no wait), the steps before it logged."""
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match=r"sampling thread failed .*ValueError"):
        train(tiny_model, out, "--max_steps", "4", "--max_staleness", "1", "--reward_funcs",
              f"{REWARDS}:has_x", f"{REWARDS}:short_from_step_two")
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl") if "reward" in m] == [1, 2]


@pytest.mark.slow  # three runs
def test_a_sampler_process_samples_what_the_thread_samples_and_resumes_alike(tmp_path, tiny_model):
    """sampler_device cpu: the HF sampler in a process of its own (lib/sampling/sampler_process.py), max_staleness 1,
    every controller, an evaluation in the middle: the thread's tokens, losses and final weights exactly; the step-2
    checkpoint holds the process's random generator and the batch sampled ahead, and the run resumed from it ends as
    the uninterrupted one."""
    args = [*EVERY_CONTROLLER, "--max_steps", "4", "--max_staleness", "1", "--save_steps", "2", "--num_eval_samples",
            "4", "--eval_steps", "2"]
    want = train(tiny_model, tmp_path / "thread", *args)
    got = train(tiny_model, tmp_path / "process", *args, "--sampler_device", "cpu")
    assert [without_times(m) for m in got] == [without_times(m) for m in want]
    assert completions_by_step(tmp_path / "process") == completions_by_step(tmp_path / "thread")
    a, b = (load_file(tmp_path / name / "final" / "model.safetensors") for name in ("process", "thread"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    out = tmp_path / "resumed"
    shutil.copytree(tmp_path / "process", out, ignore=shutil.ignore_patterns("checkpoint-4", "final"))
    again = train(tiny_model, out, *args, "--sampler_device", "cpu", "--resume_from_checkpoint", "latest")
    assert [without_times(m) for m in again] == [without_times(m) for m in want]
    c = load_file(out / "final" / "model.safetensors")
    assert all(torch.equal(a[k], c[k]) for k in a)


def test_a_sampler_process_that_dies_stops_the_run_with_its_exit_code(tmp_path, tiny_model):
    """A SIGKILL to the sampler's process once it sampled the batch step 2 starts on: the run stops at the next use
    of the process (the push of step 2's weights, before step 2 is logged) with a message naming it and its exit code,
    never a wait; step 1 logged, no sampler process left behind."""
    import multiprocessing

    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match=r"sampler process ended \(exit code -9\)"):
        train(tiny_model, out, "--max_steps", "4", "--max_staleness", "1", "--sampler_device", "cpu",
              "--reward_funcs", f"{REWARDS}:has_x", f"{REWARDS}:kill_the_sampler_process_at_step_two")
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl") if "reward" in m] == [1]
    assert not [c for c in multiprocessing.active_children() if c.name == "agrpo-sampler"]


@pytest.mark.slow  # three launches of two processes
def test_two_processes_sample_ahead_on_a_group_of_their_own(tmp_path, tiny_model):
    """Two processes (gloo), every group split between them, every controller, an evaluation and a checkpoint in the
    middle: each process's thread gathers rewards and answers on the sampling group, so max_staleness 0 logs the
    synchronous launch's numbers and ends with its weights, and max_staleness 1 trains through to the end (both
    threads stop at the same batch for the evaluation, the save and the end: no collective left unmatched)."""
    args = ["--model_name_or_path", tiny_model, *TINY, *EVERY_CONTROLLER, "--per_device_train_batch_size", "4",
            "--num_generations", "8",
            "--max_steps", "4", "--num_eval_samples", "4", "--eval_steps", "2", "--save_steps", "2"]
    runs = {}
    for name, extra in (("sync", []), ("async0", ["--max_staleness", "0"]), ("async1", ["--max_staleness", "1"])):
        proc = launch_two_processes([*args, *extra, "--output_dir", str(tmp_path / name)], tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = steps_of(tmp_path / name)
    assert [without_times(m) for m in runs["async0"]] == [without_times(m) for m in runs["sync"]]
    a, b = (load_file(tmp_path / name / "final" / "model.safetensors") for name in ("async0", "sync"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [m["step"] for m in runs["async1"]] == [1, 2, 3, 4]
    # two steps a batch: batch 1 (steps 3-4) sampled from step 1's weights, r_b = max(0, 2 b - 1)
    assert [m["staleness"] for m in runs["async1"]] == [0, 1, 1, 2]
    assert (tmp_path / "async1" / "checkpoint-2" / "rng_state_1.pt").exists()


def test_a_sampling_thread_that_hangs_is_reported_with_where_it_is():
    """The pipeline's own thread, a produce that blocks (as a sampler stuck in a call that never returns): the loop's
    wait says, every report_every seconds, how long it has waited and the line the thread is stuck at; once the call
    returns, the batch comes as usual."""
    gates, lines = {0: threading.Event(), 1: threading.Event()}, []

    def produce(position, step):
        gates[step].wait(timeout=30)  # the call that hangs, until its batch's gate opens
        return types.SimpleNamespace(data_position=position + 1)

    pipeline = Asynchronous(produce, lambda: 0.0, 1, dict, max_staleness=1, sync_every=1, max_steps=4, start_step=0,
                            data_position=0, report_every=0.2, say=lines.append)
    threading.Timer(0.7, gates[0].set).start()
    produced = pipeline.next(types.SimpleNamespace(global_step=0, data_position=0))
    assert produced.batch == 0 and produced.sampled.data_position == 1
    assert len(lines) >= 2, lines
    assert all("waited" in line and "for generation batch 0" in line for line in lines), lines
    assert "sampling generation batch 0 at test_async.py" in lines[0] and "in produce" in lines[0], lines
    # the run ends while the thread hangs in batch 1: closing says where it is and does not wait past its timeout
    started = time.perf_counter()
    assert pipeline.close(timeout=0.5) is False and time.perf_counter() - started < 5
    assert "still at test_async.py" in lines[-1] and "in produce" in lines[-1], lines
    gates[1].set()
    pipeline.thread.join(timeout=10)
    assert not pipeline.thread.is_alive()


@pytest.mark.parametrize("k, per_batch, sync_every", [(0, 1, 1), (1, 1, 1), (3, 1, 2), (2, 2, 1), (5, 2, 3)])
def test_the_queue_holds_at_most_what_queue_maxsize_is_checked_against(k, per_batch, sync_every):
    """A sampler faster than the loop fills the queue as far as the schedule lets it: floor(k / S) + 1 generation
    batches waiting, the bound lib/config.check_asynchronous holds queue_maxsize to, reached and never passed."""
    lengths, made = [], []

    def produce(position, step):
        while not made:  # the thread starts inside the constructor
            time.sleep(0.001)
        lengths.append(len(made[0].queue) + 1)  # the queue's length once this batch is in (the loop only pops)
        return types.SimpleNamespace(data_position=position + 1)

    steps = 8 * per_batch
    pipeline = Asynchronous(produce, lambda: 0.0, per_batch, dict, max_staleness=k, sync_every=sync_every,
                            max_steps=steps, start_step=0, data_position=0)
    made.append(pipeline)
    state = types.SimpleNamespace(global_step=0, data_position=0)
    for step in range(steps):
        if step % per_batch == 0:
            time.sleep(0.02)  # the loop's logging and the like: the thread samples what it may meanwhile
            assert pipeline.next(state).batch == step // per_batch
        state.global_step = step + 1
        pipeline.after_step(step + 1)
    pipeline.close()
    assert max(lengths) == k // per_batch + 1, lengths


@pytest.mark.parametrize("settings, message", [
    ({"max_staleness": 1, "weight_sync_steps": 3}, "weight_sync_steps .* at most max_staleness"),
    ({"max_staleness": 1, "use_vllm": True, "vllm_enable_sleep_mode": True}, "vllm_enable_sleep_mode false"),
    ({"max_staleness": 1, "rollout_func": "tests/tiny_tools.py:rollout_with_feedback"}, "rollout_func is not supported"),
    ({"max_staleness": -1}, "max_staleness must be"),
    ({"max_staleness": 2, "queue_maxsize": 47}, r"queue_maxsize \(47\) is below the 48 completions .*\(3 generation"),
    ({"sampler_device": "cpu"}, "sampler_device .* needs max_staleness set and use_vllm false"),
    ({"sampler_device": "cpu", "max_staleness": 1, "use_vllm": True}, "sampler_device .* use_vllm false"),
    ({"sampler_device": "tpu:0", "max_staleness": 1}, "sampler_device: 'tpu:0' is not a device .*cuda:1"),
    ({"sampler_device": f"cuda:{torch.cuda.device_count()}", "max_staleness": 1}, "sampler_device: cuda:.* GPU"),
])
def test_settings_the_sampling_thread_cannot_serve_are_refused_before_anything_loads(settings, message):
    with pytest.raises(ConfigError, match=message):
        make_config(settings, check_installed=False)


@pytest.mark.parametrize("settings", [{"use_vllm": True}, {"sampler_device": "cpu"}])
def test_two_training_processes_sample_with_the_hf_samplers_thread_only(settings):
    """Several processes: each samples its share in its own thread (the HF sampler); a vLLM engine or a sampler
    process is refused with the way out, before anything loads."""
    base = {"max_staleness": 1, "per_device_train_batch_size": 8, "num_generations": 4}
    validate(make_config(base, check_installed=False), 2, check_installed=False)
    cfg = make_config({**base, **settings}, check_installed=False)
    with pytest.raises(ConfigError, match="several training processes .*HF sampler's thread .*vllm_mode server"):
        validate(cfg, 2, check_installed=False)


@pytest.mark.parametrize("settings, message", [
    ({"vllm_inflight_updates": True, "use_vllm": True, "vllm_mode": "server"}, "needs max_staleness set"),
    ({"vllm_inflight_updates": True, "max_staleness": 1}, "use_vllm true with vllm_mode server"),
    ({"vllm_inflight_updates": True, "max_staleness": 1, "use_vllm": True, "vllm_mode": "server",
      "answer_marker": "Answer:"}, "answer_marker unset"),
])
def test_weights_in_flight_need_max_staleness_and_a_generation_server(settings, message):
    """vllm_inflight_updates is refused, naming the field and the fix, without the sampling thread and a server."""
    with pytest.raises(ConfigError, match=message) as refused:
        make_config(settings, check_installed=False)
    assert "vllm_inflight_updates" in str(refused.value)


def test_weights_in_flight_are_pushed_after_every_step_while_the_thread_samples():
    """vllm_inflight_updates (lib/sampling/pipeline.Asynchronous, push_inflight): the pipeline's own thread, a produce
    that takes a while: every optimizer step's weights are pushed right after the step, while the thread is inside
    a batch (not only at the schedule's steps, between batches), and the batches still start on the schedule (batch b
    not before the weights of step r_b exist), recorded with r_b."""
    pushed, started = [], []

    def produce(position, step):
        started.append((step, max(pushed, default=0)))  # the batch, and the newest weights pushed when it began
        time.sleep(0.15)
        return types.SimpleNamespace(data_position=position + 1)

    def push_inflight(step):
        pushed.append(step)
        busy.append(pipeline.busy)  # a batch being sampled as the weights go out
        return 0.0

    busy = []
    pipeline = Asynchronous(produce, lambda: 0.0, 1, dict, max_staleness=1, sync_every=1, max_steps=4, start_step=0,
                            data_position=0, push_inflight=push_inflight)
    state = types.SimpleNamespace(global_step=0, data_position=0)
    versions = []
    for step in range(4):
        versions.append(pipeline.next(state).version)
        time.sleep(0.05)  # the training step, while the thread samples the next batch
        state.global_step = step + 1
        pipeline.after_step(step + 1)
    pipeline.close()
    assert versions == [0, 0, 1, 2]  # r_b = b - 1, as without weights in flight
    assert pushed[:3] == [1, 2, 3] and set(pushed) <= {1, 2, 3, 4}
    assert all(newest >= max(0, batch - 1) for batch, newest in started), started
    assert busy[:3] == [True, True, True], busy  # steps 1-3's weights went out while a batch was being sampled
