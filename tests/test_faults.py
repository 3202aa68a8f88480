"""Faults a long run meets, on the tiny random-weight model (tests/conftest.py::tiny_model): non-finite rewards and
losses never reach the weights, preemption signals checkpoint and stop, rewards that hang or kill their worker are
scored as failures, a full disk keeps the last checkpoint whole, and a run killed at random moments and resumed with
`latest` each time ends exactly where an uninterrupted one does (docs/faults.md)."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import train_agrpo
from conftest import REPO, wait_until
from lib import checkpoint as ckpt
from test_loop import REWARDS, TINY, read_jsonl, steps_of, train, without_times

BAD = ["--reward_funcs", f"{REWARDS}:has_x", f"{REWARDS}:bad_after_two", "--reward_weights", "1", "0.5"]


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def weights(folder) -> dict:
    return load_file(Path(folder) / "model.safetensors")


def same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------------------ non-finite values


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_a_non_finite_reward_skips_its_steps_and_stops_the_run_keeping_the_last_good_checkpoint(
        tiny_model, tmp_path, monkeypatch, value):
    monkeypatch.setenv("AGRPO_TEST_BAD_VALUE", value)  # read in the reward worker, started by the run
    out = tmp_path / "run"
    with pytest.raises(ckpt.RunStopped) as stopped:
        train(tiny_model, out, *BAD, "--max_steps", "8", "--save_steps", "1", "--max_nonfinite_steps", "3")
    message = str(stopped.value)
    # the batches of steps 3, 4 and 5 scored one completion `value`: three skipped steps in a row stop the run
    assert "step 5: 3 optimizer steps in a row skipped" in message and "'bad_after_two'" in message
    assert f"1 x {value}" in message and "checkpoint-4" in message and "final/ was not written" in message
    steps = steps_of(out)
    assert [m["nonfinite_skipped"] for m in steps] == [0, 0, 1, 1, 1]
    assert [m["nonfinite/rewards/bad_after_two"] for m in steps] == [0, 0, 1, 1, 1]
    assert [m["grad_norm"] for m in steps][2:] == [0, 0, 0] and all(m["grad_norm"] > 0 for m in steps[:2])
    assert not (out / "final").exists()
    # the weights and the optimizer's state stayed those of step 2 through the skipped steps 3 and 4
    assert not same_tensors(weights(out / "checkpoint-1"), weights(out / "checkpoint-2"))
    assert same_tensors(weights(out / "checkpoint-2"), weights(out / "checkpoint-4"))
    opt2, opt4 = (torch.load(out / f"checkpoint-{s}" / "optimizer.pt", weights_only=False) for s in (2, 4))
    assert all(torch.equal(opt2["state"][i][k], opt4["state"][i][k]) for i in opt2["state"] for k in opt2["state"][i])
    assert ckpt.read_trainer_state(out / "checkpoint-4")["nonfinite_streak"] == 2


def test_a_non_finite_loss_skips_that_step_only_and_the_run_goes_on(tiny_model, tmp_path, monkeypatch):
    calls = {"n": 0}
    aggregate = train_agrpo.aggregate_loss

    def nan_at_step_two(*args, **kwargs):  # the loss of step 2 (one micro-batch a step) made non-finite
        calls["n"] += 1
        loss = aggregate(*args, **kwargs)
        return loss * float("nan") if calls["n"] == 2 else loss

    monkeypatch.setattr(train_agrpo, "aggregate_loss", nan_at_step_two)
    out = tmp_path / "run"
    steps = train(tiny_model, out, "--max_steps", "3", "--save_steps", "1")
    assert [m["nonfinite_skipped"] for m in steps] == [0, 1, 0]
    assert all(torch.isfinite(torch.tensor(m["grad_norm"])) for m in (steps[0], steps[2]))
    assert same_tensors(weights(out / "checkpoint-1"), weights(out / "checkpoint-2"))  # step 2 moved nothing
    assert not same_tensors(weights(out / "checkpoint-2"), weights(out / "final"))  # step 3 trained
    assert all(torch.isfinite(t).all() for t in weights(out / "final").values())


# ------------------------------------------------------------------------------------------------ preemption


def signal_at(monkeypatch, where: str, when: int, sig=signal.SIGTERM):
    """Send `sig` to this process from inside the trainer: at the `when`-th call of train_agrpo.aggregate_loss (in
    the middle of a step) or of lib.checkpoint.write_rng (in the middle of a checkpoint write)."""
    calls = {"n": 0}
    target = train_agrpo if where == "step" else ckpt
    name = "aggregate_loss" if where == "step" else "write_rng"
    original = getattr(target, name)

    def wrapped(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == when:
            os.kill(os.getpid(), sig)
        return original(*args, **kwargs)

    monkeypatch.setattr(target, name, wrapped)


@pytest.mark.parametrize(("where", "sig", "extra", "stop_step"), [
    ("step", signal.SIGTERM, [], 2),  # inside step 2's loss: checkpoint-2, then stop
    ("checkpoint", signal.SIGUSR1, ["--save_steps", "1"], 2),  # inside checkpoint-2's write: it completes, then stop
    pytest.param("step", signal.SIGTERM, ["--num_iterations", "2"], 4,  # step 3 of a batch for steps 3-4: after 4
                 marks=pytest.mark.slow),
])
def test_a_stop_signal_checkpoints_where_resuming_is_exact_and_the_resumed_run_equals_an_uninterrupted_one(
        tiny_model, tmp_path, monkeypatch, where, sig, extra, stop_step):
    args = ["--max_steps", "5", *extra]
    whole = train(tiny_model, tmp_path / "whole", *args)
    out = tmp_path / "run"
    with monkeypatch.context() as patch:
        signal_at(patch, where, {2: 2, 4: 3}[stop_step] if where == "step" else 2, sig)
        with pytest.raises(ckpt.RunStopped) as stopped:
            train(tiny_model, out, *args, "--resume_from_checkpoint", "latest")
    assert stopped.value.exit_code == 128 + sig
    assert f"{sig.name} received: stopped at step {stop_step}" in str(stopped.value)
    assert ckpt.latest_checkpoint(out).name == f"checkpoint-{stop_step}" and not (out / "final").exists()
    assert signal.getsignal(sig) is signal.SIG_DFL  # the handlers are restored when the run stops
    resumed = train(tiny_model, out, *args, "--resume_from_checkpoint", "latest")
    assert [without_times(m) for m in resumed] == [without_times(m) for m in whole]
    assert same_tensors(weights(out / "final"), weights(tmp_path / "whole" / "final"))


def test_latest_with_no_checkpoint_starts_the_run_and_sets_aside_what_a_killed_run_logged(tiny_model, tmp_path):
    out = tmp_path / "run"
    whole = train(tiny_model, tmp_path / "whole", "--max_steps", "2")
    # what a run killed in its first step's save leaves: its log, a staging folder, no checkpoint
    out.mkdir()
    (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward": 0.5}) + "\n" + '{"step": 2, "rew')
    (out / ".checkpoint-1.partial").mkdir()
    (out / ".checkpoint-1.partial" / "optimizer.pt").write_bytes(b"cut short")
    resumed = train(tiny_model, out, "--max_steps", "2", "--resume_from_checkpoint", "latest")
    assert [without_times(m) for m in resumed] == [without_times(m) for m in whole]
    assert not (out / ".checkpoint-1.partial").exists()
    orphaned = (out / "metrics.orphaned.jsonl").read_text().splitlines()
    assert orphaned == [json.dumps({"step": 1, "reward": 0.5}), '{"step": 2, "rew']  # set aside, not lost


def test_recover_completes_or_undoes_a_save_killed_between_its_renames(tmp_path):
    def folder(name, marker):
        path = tmp_path / name
        path.mkdir()
        (path / ckpt.STATE_FILE).write_text(json.dumps({"global_step": 3, "marker": marker}))
        return path

    folder(".checkpoint-3.old", "old")
    folder(".checkpoint-3.partial", "new")  # complete: its trainer_state.json is written before the renames
    folder(".checkpoint-5.old", "old five")
    (tmp_path / ".checkpoint-5.partial").mkdir()  # incomplete
    (tmp_path / ".final.partial").mkdir()
    done = ckpt.recover(tmp_path)
    assert len(done) == 4  # two checkpoints recovered, two staging folders removed
    assert json.loads((tmp_path / "checkpoint-3" / ckpt.STATE_FILE).read_text())["marker"] == "new"
    assert json.loads((tmp_path / "checkpoint-5" / ckpt.STATE_FILE).read_text())["marker"] == "old five"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3", "checkpoint-5"]


# ------------------------------------------------------------------------------------------------ rewards that hang


@pytest.mark.slow  # each hang costs reward_timeout: about 13 s in all
def test_a_reward_that_hangs_or_kills_its_worker_is_scored_as_a_failure_and_the_run_goes_on(tiny_model, tmp_path):
    out = tmp_path / "run"
    t0 = time.perf_counter()
    steps = train(tiny_model, out, "--reward_funcs", f"{REWARDS}:hangs_on_x", f"{REWARDS}:dies_on_x",
                  f"{REWARDS}:characters", "--reward_weights", "1", "1", "1", "--correctness_reward", "characters",
                  "--reward_timeout", "2", "--reward_error_value", "-1")
    elapsed = time.perf_counter() - t0
    completions_with_x = [sum(m[f"rewards/{f}/errors"] for m in steps) for f in ("hangs_on_x", "dies_on_x")]
    # the two functions fail on the same completions (those with an x): the one that hangs after 2 s each time
    assert completions_with_x[0] == completions_with_x[1] > 0
    assert all(m["rewards/characters/errors"] == 0 for m in steps)
    # a failed completion scored -1 and the others 1: the mean says how many failed
    for m in steps:
        assert m["rewards/hangs_on_x/mean"] == pytest.approx(1 - 2 * m["rewards/hangs_on_x/errors"] / 8)
    assert (out / "final" / "model.safetensors").exists()
    assert elapsed < 120  # each hang cost about reward_timeout, not an hour


# ------------------------------------------------------------------------------------------------ a full disk


def run_cli(args: list[str], timeout: int = 300, prefix: list[str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([*(prefix or []), sys.executable, str(REPO / "train_agrpo.py"), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


@pytest.mark.slow  # a trainer in a subprocess: 13 s
# a container that refuses unprivileged user and mount namespaces refuses them whatever .ci/run installs
@pytest.mark.ci_may_skip("this machine cannot mount a small filesystem")
def test_a_full_disk_keeps_the_previous_checkpoint_whole_and_says_how_much_space_one_needs(tiny_model, tmp_path):
    # a 60 MiB tmpfs mounted in a user and mount namespace of the trainer's own (no privileges needed where the kernel
    # allows unprivileged user namespaces); a checkpoint of the tiny model is about 38 MiB: the first fits, the
    # second does not
    mount = tmp_path / "small"
    mount.mkdir()
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs '{mount}'"],
                           capture_output=True, text=True, check=False, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"this machine cannot mount a small filesystem for the test: {probe.stderr.strip()}")
    out = mount / "run"
    script = (f"mount -t tmpfs -o size=60m tmpfs '{mount}' && \"$@\"; status=$?; "
              f"ls -a '{out}' > '{tmp_path}/listing'; cp '{out}/metrics.jsonl' '{tmp_path}/'; "
              f"cp -r '{out}/checkpoint-1' '{tmp_path}/checkpoint-1' 2>/dev/null; exit $status")
    proc = run_cli(["--model_name_or_path", tiny_model, *TINY, "--max_steps", "3", "--save_steps", "1",
                    "--output_dir", str(out)], prefix=["unshare", "-rm", "sh", "-c", script, "sh"])
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "training stopped: checkpoint-2 could not be written" in proc.stderr
    assert "A checkpoint needs about" in proc.stderr and "checkpoint-1 is whole" in proc.stderr
    listing = (tmp_path / "listing").read_text().split()
    assert "checkpoint-1" in listing and not [n for n in listing if n.endswith(".partial")]
    assert ckpt.read_trainer_state(tmp_path / "checkpoint-1")["global_step"] == 1
    assert len(weights(tmp_path / "checkpoint-1")) > 0  # loads: whole
    assert [m["step"] for m in read_jsonl(tmp_path / "metrics.jsonl") if "reward" in m] == [1, 2]


# ------------------------------------------------------------------------------------------------ chaos


@pytest.mark.slow
def test_a_stop_signal_to_one_of_two_processes_stops_both_at_the_same_exact_point(tiny_model, tmp_path):
    """SIGTERM to the second of two processes, first in the middle of a checkpoint write, then (after resuming) in the
    middle of a step: both processes stop at the same step each time, and the twice-resumed run equals an
    uninterrupted one."""
    import psutil

    args = ["--model_name_or_path", tiny_model, *TINY, "--per_device_train_batch_size", "4", "--max_steps", "6",
            "--save_steps", "1", "--resume_from_checkpoint", "latest"]
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                "--main_process_port", "0",
                str(REPO / "train_agrpo.py"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def launch(out):
        return subprocess.Popen([*launcher, "--output_dir", str(out)], cwd=tmp_path, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def stop_second_process(out, ready) -> int:
        proc = launch(out)
        wait_until(lambda: proc.poll() is not None or ready(), 300, "the moment to send SIGTERM", interval_s=0.001)
        ranks = {int(p.environ().get("RANK", -1)): p for p in psutil.Process(proc.pid).children(recursive=True)
                 if "train_agrpo.py" in " ".join(p.cmdline())}
        ranks[1].send_signal(signal.SIGTERM)  # the first process learns it from the step's reduce
        _, err = proc.communicate(timeout=600)
        assert proc.returncode != 0 and "SIGTERM received: stopped at step" in err, err[-3000:]
        step = ckpt.latest_checkpoint(out)
        assert (step / "rng_state_0.pt").exists() and (step / "rng_state_1.pt").exists()
        assert not (out / "final").exists() and not list(out.glob(".*.partial"))
        return int(step.name.split("-")[1])

    whole = launch(tmp_path / "whole")
    assert whole.wait(timeout=600) == 0, whole.stderr.read()[-3000:]
    out = tmp_path / "run"
    first = stop_second_process(out, lambda: any(out.glob(".checkpoint-*.partial")))  # inside a save
    second = stop_second_process(out, lambda: training_lines(out / "metrics.jsonl") > first)  # inside a step
    assert 0 < first < second < 6, (first, second)
    resumed = launch(out)
    assert resumed.wait(timeout=600) == 0, resumed.stderr.read()[-3000:]
    assert [without_times(m) for m in steps_of(out)] == [without_times(m) for m in steps_of(tmp_path / "whole")]
    assert same_tensors(weights(out / "final"), weights(tmp_path / "whole" / "final"))


def training_lines(path: Path) -> int:
    try:
        return path.read_text().count('"reward"')
    except FileNotFoundError:
        return 0


# Starts the trainer as `python train_agrpo.py ARGS` does (its __main__ block, output to a log), each start a process
# forked from one that imported the trainer once (and what its first model load and unwrap import): a start pays the
# run's own start-up (the models, the reward worker, the resume) but not the imports, 5 to 6 s of a start on 2 loaded
# cores. One start at a time; each request is a JSON line [args, log, exit_file]; the start's pid comes back as a
# line on its stdout, its exit code (negative: the signal) in exit_file when it ends.
STARTER = """
import importlib.util, json, os, runpy, sys, traceback
replies = os.fdopen(os.dup(1), "w")  # the pids; what the imports print goes to stderr
os.dup2(2, 1)
import train_agrpo
from transformers import AutoModelForCausalLM, AutoTokenizer
if importlib.util.find_spec("deepspeed"):  # accelerate imports it when it unwraps a model
    import deepspeed
for line in sys.stdin:
    args, log, exit_file = json.loads(line)
    pid = os.fork()
    if pid == 0:
        os.close(replies.fileno())
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        sys.argv, code = [train_agrpo.__file__, *args], 0
        try:
            runpy.run_path(train_agrpo.__file__, run_name="__main__")
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
            if not isinstance(stop.code, int) and stop.code is not None:
                print(stop.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    print(pid, file=replies, flush=True)
    status = os.waitpid(pid, 0)[1]
    with open(exit_file + ".tmp", "w") as f:
        f.write(str(os.waitstatus_to_exitcode(status)))
    os.replace(exit_file + ".tmp", exit_file)
"""


class Start:
    """One start of the trainer through STARTER: its pid, whether it ended, its exit code."""

    def __init__(self, starter: subprocess.Popen, args: list[str], log: Path):
        self.exit_file = log.with_suffix(".exit")
        starter.stdin.write(json.dumps([args, str(log), str(self.exit_file)]) + "\n")
        starter.stdin.flush()
        line = starter.stdout.readline()
        assert line.strip().isdigit(), f"the starter said {line!r}"
        self.pid = int(line)

    def ended(self) -> bool:
        return self.exit_file.exists()

    def kill(self) -> bool:
        """SIGKILL, unless the start has ended (and been reaped) already; whether it was sent."""
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        return True

    def wait(self, timeout_s: float) -> int:
        wait_until(self.ended, timeout_s, f"the end of start {self.pid}", interval_s=0.05)
        return int(self.exit_file.read_text())


@pytest.mark.slow
def test_six_random_kills_resumed_with_latest_end_exactly_where_an_uninterrupted_run_does(tiny_model, tmp_path):
    """Six SIGKILLs, every other one inside a save, in fp32 (a CPU of any kind runs it). bf16's own part of a
    resume, the bf16 sampler copy that a resume builds anew from the checkpoint and an uninterrupted run refreshes at
    every sync, is checked by tests/test_loop.py::test_resume_continues_exactly_with_every_controller[bf16] and
    tests/test_rollout.py::test_the_sampler_is_the_policy_after_every_sync (docs/faults.md 3)."""
    steps, kills_wanted = 16, 6
    args = ["--model_name_or_path", tiny_model, *TINY, "--max_steps", str(steps), "--save_steps", "1",
            "--num_eval_samples", "4", "--eval_steps", "4", "--lr_scheduler_type", "linear",
            "--resume_from_checkpoint", "latest", "--bf16", "false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    starter = subprocess.Popen([sys.executable, "-c", STARTER], cwd=REPO, env=env, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    proc = None
    try:
        whole = proc = Start(starter, [*args, "--output_dir", str(tmp_path / "whole")], tmp_path / "whole.log")
        wait_until(lambda: whole.ended() or training_lines(tmp_path / "whole" / "metrics.jsonl") > 0, 300,
                   "the uninterrupted run's first step")
        t0 = time.perf_counter()
        assert whole.wait(600) == 0, (tmp_path / "whole.log").read_text()[-3000:]
        per_step = (time.perf_counter() - t0) / (steps - 1)  # a step with its save, evaluations and final/ shared out
        out, rng, kills, starts, killed_at, recovered = tmp_path / "run", random.Random(0), 0, 0, [], []
        while True:
            starts += 1
            before = training_lines(out / "metrics.jsonl")
            log = tmp_path / f"start-{starts}.log"
            proc = Start(starter, [*args, "--output_dir", str(out)], log)
            if kills < kills_wanted:
                # once the run has logged a step past where it resumed, at a random moment within about a step and a
                # half (in a step, its metrics line, its checkpoint's writes and renames, an evaluation, final/), or
                # in the middle of a save
                wait_until(lambda: proc.ended() or training_lines(out / "metrics.jsonl") > before, 300,
                           f"a logged step past step {before}", detail=lambda: log.read_text()[-3000:])
                if kills % 2:  # every other kill inside a save: as soon as its staging folder appears
                    wait_until(lambda: proc.ended() or any(out.glob(".*.partial")), 300,
                               "a checkpoint's staging folder", interval_s=0.001,
                               detail=lambda: log.read_text()[-3000:])
                    time.sleep(rng.uniform(0, 0.02))
                else:
                    time.sleep(rng.uniform(0, 1.5 * per_step))
                if not proc.ended() and proc.kill():
                    kills += 1
                    killed_at.append(training_lines(out / "metrics.jsonl"))
            code = proc.wait(600)
            err = log.read_text()
            recovered += [line for line in err.splitlines() if line.startswith("output_dir: ")]
            if code == 0:
                break
            assert code == -signal.SIGKILL, err[-3000:]
            assert starts < 40
    finally:
        if proc is not None and not proc.ended():  # a failed test leaves no trainer behind
            proc.kill()
        starter.stdin.close()
        starter.wait(timeout=60)
    assert kills == kills_wanted, f"the run finished after {kills} kills (at logged steps {killed_at})"
    assert recovered, "no kill landed inside a save"
    mine, theirs = read_jsonl(out / "metrics.jsonl"), read_jsonl(tmp_path / "whole" / "metrics.jsonl")
    keys = ("step", "num_tokens", "reward", "loss", "learning_rate", "kl", "grad_norm", "eval/accuracy")
    assert [{k: m.get(k) for k in keys} for m in mine] == [{k: m.get(k) for k in keys} for m in theirs]
    assert same_tensors(weights(out / "final"), weights(tmp_path / "whole" / "final"))
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out / "final")  # final/ loads
    print(f"chaos: {kills} kills at logged steps {killed_at}, {starts} starts, {per_step:.2f} s a step; left behind "
          f"by kills inside saves and cleaned up at the next start: {recovered}")


def test_the_reward_worker_answers_survives_a_hang_and_a_crash_and_keeps_prints_out_of_its_answers(tmp_path):
    from lib.rewards.worker import RewardCallFailed, RewardWorker

    (tmp_path / "rewards.py").write_text(
        "import os, time\n"
        "def noisy(prompts, completions, **columns):\n"
        "    print('a reward function that prints')\n"
        "    return [float(len(c)) for c in completions]\n"
        "def slow(prompts, completions, **columns):\n"
        "    time.sleep(60)\n"
        "def crash(prompts, completions, **columns):\n"
        "    os._exit(3)\n"
        "def wrong(prompts, completions, **columns):\n"
        "    raise KeyError('answer')\n")
    path = tmp_path / "rewards.py"
    # tag_count: the worker resolves open-r1's rewards (lib/rewards/open_r1.py) as the trainer does
    worker = RewardWorker([f"{path}:noisy", f"{path}:slow", f"{path}:crash", f"{path}:wrong", "tag_count"], {},
                          timeout=1)
    try:
        assert worker.call(0, ["p", "p"], ["ab", "abc"], {}) == [2.0, 3.0]
        assert worker.call(4, ["p"], ["<think>\nx\n</think>\n"], {}) == [0.5]
        with pytest.raises(RewardCallFailed, match=r"gave no answer within reward_timeout = 1 s"):
            worker.call(1, ["p"], ["a"], {})
        with pytest.raises(RewardCallFailed, match=r"killed the reward worker \(exit code 3\)"):
            worker.call(2, ["p"], ["a"], {})
        with pytest.raises(RewardCallFailed, match=r"raised KeyError: 'answer'"):
            worker.call(3, ["p"], ["a"], {})
        assert worker.call(0, ["p"], ["abcd"], {}) == [4.0]  # a fresh worker after each of the two failures
        assert worker.restarts == 2
    finally:
        worker.close()
    assert worker.proc.poll() is not None


def test_an_output_folder_that_cannot_be_written_is_refused_before_any_model_loads(tmp_path, tiny_model):
    from lib.config import ConfigError

    from accelerate.state import AcceleratorState

    (tmp_path / "a_file").write_text("")
    try:
        with pytest.raises(ConfigError, match=r"output_dir: cannot create or write '.*a_file/run' "
                                              r"\(Not a directory\); pass a folder you can write to"):
            train_agrpo.main(["--model_name_or_path", tiny_model, "--output_dir",
                              str(tmp_path / "a_file" / "run")])
    finally:  # the Accelerator it built (bf16 on a CPU that has it) must not outlive the test
        AcceleratorState._reset_state(reset_partial_state=True)
