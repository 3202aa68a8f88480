"""Runs with tools and environments held to the exactness the trainer's other runs are held to (docs/agents.md, issue
40): two processes train as one, a resumed run equals the uninterrupted one, and a vLLM engine serves the episodes.
All on the tiny model taught to call a tool (tests/test_agents.py::tool_caller)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO
from episode_replay import RecordingSampler, sampling_with
import test_agents
from test_loop import REWARDS, steps_of, without_times

TOOLS = test_agents.TOOLS
tool_caller = test_agents.tool_caller  # the fixture: the tiny model taught to call `add`

# 2 prompts x 4 episodes a step, of up to 2 tool-calling turns; temperature 1 so that one prompt's episodes differ
# (the lengths `characters` scores give the groups a spread); fp32
RUN = ["--max_steps", "2", "--num_generations", "4", "--max_completion_length", "64", "--num_eval_samples", "0",
       "--builtin_num_train", "4", "--seed", "0", "--learning_rate", "1e-4", "--temperature", "1.0", "--bf16", "false",
       "--reward_funcs", f"{REWARDS}:characters", "--beta", "0.04", "--eta", "0.01", "--tools", f"{TOOLS}:add",
       "--max_tool_calling_iterations", "2"]
COMPARED = ("reward", "reward_std", "loss", "grad_norm", "kl", "entropy", "num_tokens", "completions/mean_length",
            "tools/call_frequency", "tools/failure_frequency")


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def train(args: list[str]) -> None:
    import train_agrpo
    from accelerate.state import AcceleratorState

    try:
        train_agrpo.main(args)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)  # the next run builds its own Accelerator


def episodes_of(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]


@pytest.mark.slow  # a run in this process, then the same run on two launched processes: about a minute
def test_two_processes_with_tools_train_as_one(tool_caller, tmp_path):
    """The run with tools on one process, then on two (gloo, one group a process) sampling what the one process
    sampled (tests/episode_replay.py: the sampler's random stream is per process, so each call of the episode loop,
    first turns and continuations, is answered from the one-process record; the tool calls themselves run again, in
    each process's own tool worker): every logged number, the tool counters reduced over both processes among them,
    and the final weights are the one process's, within float tolerance (the gradient is summed in another order)."""
    record: dict = {}
    one = tmp_path / "one"
    with sampling_with(lambda engine: RecordingSampler(engine, record)):
        train(["--model_name_or_path", tool_caller, *RUN, "--per_device_train_batch_size", "8",
               "--output_dir", str(one)])
    torch.save(record, tmp_path / "record.pt")
    two = tmp_path / "two"
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    proc = subprocess.run([*launcher, str(REPO / "tests" / "episode_replay.py"), str(tmp_path / "record.pt"), "--",
                           "--model_name_or_path", tool_caller, *RUN, "--per_device_train_batch_size", "4",
                           "--output_dir", str(two)], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[proc.stderr.find("Traceback"):][:3000]
    # every recorded row replayed, each process its own share
    replayed = [json.loads((tmp_path / f"record.pt-{rank}.json").read_text())["replayed"] for rank in (0, 1)]
    assert min(replayed) > 0 and sum(replayed) == sum(map(len, record["calls"].values()))
    want, got = steps_of(one), steps_of(two)
    assert [m["step"] for m in got] == [1, 2]
    for a, b in zip(got, want):
        assert {k: a[k] for k in COMPARED} == pytest.approx({k: b[k] for k in COMPARED}, rel=1e-4, abs=1e-7)
    # episodes of two turns happened, and their tool results are not the model's tokens
    assert all(m["tools/call_frequency"] > 0 for m in want) and max(m["grad_norm"] for m in want) > 0
    assert any("tool\n5" in e["completion"] for e in episodes_of(one))
    final, reference = load_file(two / "final" / "model.safetensors"), load_file(one / "final" / "model.safetensors")
    for name in reference:
        torch.testing.assert_close(final[name], reference[name], rtol=1e-4, atol=1e-6)


def tool_workers() -> list:
    """This process's tool workers still alive (lib/extras/tools.ToolWorker's children)."""
    import psutil

    return [p for p in psutil.Process().children(recursive=True)
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE and "lib.extras.tools" in " ".join(p.cmdline())]


@pytest.mark.slow  # two short runs in this process: about 13 s a case
@pytest.mark.parametrize("agent", ["tools", "environment"])
def test_a_run_with_tools_or_an_environment_resumes_exactly(agent, tool_caller, tmp_path):
    """The run stopped after its step-1 checkpoint and resumed from it logs every number of step 2 (the tool counters
    and an environment's reward among them) and ends with every weight exactly as the uninterrupted run: with the
    run's `tools` (tests/tiny_tools.py:add), and with an environment_factory class instead (tests/tiny_tools.py:Adder,
    whose `add` method the model calls: one instance per episode, reset with the row, its count of calls the state
    get_reward reads). Nothing of an episode outlives its batch (its environment is dropped when the episode ends), so
    a checkpoint holds none; the resumed run starts a tool worker of its own, and each run's worker is stopped when
    the run ends."""
    args = ["--model_name_or_path", tool_caller, *RUN, "--per_device_train_batch_size", "8", "--save_steps", "1"]
    if agent == "environment":
        args = [a for a in args if a not in ("--tools", f"{TOOLS}:add")] + ["--environment_factory", f"{TOOLS}:Adder"]
    reference = tmp_path / "uninterrupted"
    train([*args, "--output_dir", str(reference)])
    assert not tool_workers()
    want = steps_of(reference)
    assert len(want) == 2 and all(m["tools/call_frequency"] > 0 for m in want)
    assert min(m["tools/failure_frequency"] for m in want) < 1  # calls that ran, not only malformed ones
    if agent == "environment":  # each episode's own count: the calls of other episodes never reach it
        assert all(m["rewards/Adder/errors"] == 0 and 0 < m["rewards/Adder/mean"] <= m["tools/call_frequency"]
                   for m in want)
    out = tmp_path / "resumed"
    shutil.copytree(reference, out, ignore=shutil.ignore_patterns("checkpoint-2", "final"))
    train([*args, "--output_dir", str(out), "--resume_from_checkpoint", "latest"])
    assert not tool_workers()
    got = steps_of(out)
    assert [m["step"] for m in got] == [1, 2]  # step 1 as logged before the stop, step 2 by the resumed run
    assert [without_times(m) for m in got] == [without_times(m) for m in want]
    a, b = load_file(out / "final" / "model.safetensors"), load_file(reference / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in b)
