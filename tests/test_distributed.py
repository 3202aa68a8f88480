"""Sharded training (FSDP2 and DeepSpeed ZeRO-2 / ZeRO-3 through Accelerate, lib/sharding/fsdp_deepspeed.py) on two CPU
processes over gloo: the same sharding code that runs on GPUs (docs/distributed.md).

The fast tests check the pieces a sharded run relies on in one process (the scorer's fixed decoder calls, the
sampler's own copy); the slow ones launch the trainer as a user does, `accelerate launch --config_file
scripts/accelerate/fsdp2_cpu.yaml train_agrpo.py` (or zero3_cpu.yaml), and compare it with data-parallel runs of
the same processes."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, wait_until
from test_loop import REWARDS, TINY, steps_of

FSDP = ["--config_file", str(REPO / "scripts" / "accelerate" / "fsdp2_cpu.yaml")]
DDP = ["--config_file", str(REPO / "scripts" / "accelerate" / "cpu_2proc.yaml")]
ZERO3 = ["--config_file", str(REPO / "scripts" / "accelerate" / "zero3_cpu.yaml")]
ZERO2 = ["--config_file", str(REPO / "scripts" / "accelerate" / "zero2_cpu.yaml")]
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="DeepSpeed is not installed (requirements-test.txt)")
# the same global batch on two processes: 4 completions each, one group of 4 a process
TWO = [*TINY, "--per_device_train_batch_size", "4", "--save_steps", "2", "--max_steps", "4"]
COMPARED = ("reward", "loss", "grad_norm", "kl", "entropy", "num_tokens")


def launch(config: list[str], args: list[str], cwd: Path, env: dict | None = None, timeout: float = 600,
           wait: bool = True) -> subprocess.CompletedProcess | subprocess.Popen:
    """`accelerate launch <config> train_agrpo.py <args>` in its own session (so that a test can kill the whole tree)."""
    command = [sys.executable, "-m", "accelerate.commands.launch", *config, str(REPO / "train_agrpo.py"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    if not wait:
        return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def compared(out: Path) -> list[dict]:
    return [{k: m[k] for k in ("step", *COMPARED)} for m in steps_of(out)]


def close(a: list[dict], b: list[dict], rel: float) -> bool:
    return len(a) == len(b) and all(x["step"] == y["step"] and all(x[k] == pytest.approx(y[k], rel=rel, abs=1e-7)
                                                                  for k in COMPARED) for x, y in zip(a, b))


def assert_resumes_exactly_after_sigkill(config: list[str], args: list[str], tmp_path: Path, unbroken: list[dict],
                                         final: dict) -> None:
    """A run killed with SIGKILL (both processes, inside step 3's rewards: a reward that hangs on its third call
    while a flag file exists) and resumed from checkpoint-2 ends exactly as the unbroken run (its metrics and
    final weights given): the same shards, optimizer states, RNG and data position."""
    killed, flag = tmp_path / "killed", tmp_path / "hang"
    flag.write_text("")
    hanging = [a if a != f"{REWARDS}:characters" else f"{REWARDS}:characters_hang_third" for a in args]
    proc = launch(config, [*hanging, "--output_dir", str(killed)], tmp_path, env={"AGRPO_TEST_HANG_FILE": str(flag)},
                  wait=False)
    # both processes inside step 3's hanging reward (each process's reward worker says so in a file of its own)
    wait_until(lambda: proc.poll() is not None or len(list(tmp_path.glob(f"{flag.name}.*"))) == 2, 300,
               "both processes inside step 3's rewards", interval_s=0.1)
    assert proc.poll() is None, proc.stdout.read()[-3000:] if proc.stdout else "the run exited before step 3"
    assert (killed / "checkpoint-2" / "trainer_state.json").exists()
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert [m["step"] for m in steps_of(killed)] == [1, 2]
    flag.unlink()
    resumed = launch(config, [*hanging, "--output_dir", str(killed), "--resume_from_checkpoint", "latest"], tmp_path,
                     env={"AGRPO_TEST_HANG_FILE": str(flag)})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert compared(killed) == unbroken
    assert json.loads((killed / "checkpoint-4" / "trainer_state.json").read_text())["global_step"] == 4
    again = load_file(killed / "final" / "model.safetensors")
    assert all(torch.equal(again[name], final[name]) for name in final)


# ------------------------------------------------------------------------------------------------ one process


def test_fixed_decoder_calls_give_the_same_log_probs_and_gradients(tiny_model):
    """A sharded scorer runs the decoder the same number of times on every process (no length chunks, a completion
    pass even for one-token completions): the values and gradients are those of the default path."""
    from transformers import AutoModelForCausalLM

    from lib.models.modeling import completion_logps

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(5, 200, (2, 6), generator=gen)
    prompt_mask = torch.ones_like(prompts)
    prompt_mask[1, :2] = 0  # left padding
    for width, lengths in ((1, [1, 1, 1, 1]), (9, [9, 2, 5, 1])):
        completions = torch.randint(5, 200, (4, width), generator=gen)
        mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
        index, temps = torch.tensor([0, 0, 1, 1]), torch.tensor([0.7, 0.7, 1.0, 1.0])
        results = []
        for fixed in (False, True):
            model.zero_grad()
            logp, entropy = completion_logps(model, prompts, prompt_mask, index, completions, mask, temps,
                                             fixed_calls=fixed)
            (logp.sum() + entropy.sum()).backward()
            results.append((logp.detach(), entropy.detach(), model.model.layers[0].mlp.up_proj.weight.grad.clone()))
        assert results[1][0].shape == (4, width)
        for plain, fixed in zip(*results):
            torch.testing.assert_close(fixed, plain, rtol=1e-5, atol=1e-6)


def test_the_sampler_of_a_sharded_policy_keeps_its_own_copy_and_follows_the_policy(tiny_model):
    """An fp32 policy without bf16 is sampled with itself, except when it will be sharded: then the sampler keeps a
    full copy, which a sync brings to the policy's current weights."""
    from transformers import AutoModelForCausalLM

    from lib.sampling.policy_copy import make_copy
    from lib.sampling.rollout import HFRollout

    policy = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    assert HFRollout(policy, [2], 0, copy=make_copy).copy is None
    sampler = HFRollout(policy, [2], 0, copy=partial(make_copy, own_copy=True))
    assert sampler.copy is not None and sampler.model is not policy
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01)
    assert not torch.equal(sampler.copy.model.norm.weight, policy.model.norm.weight)
    sampler.sync_weights(policy)
    copied = dict(sampler.copy.named_parameters())
    assert all(torch.equal(copied[name], p) for name, p in policy.named_parameters())


# ------------------------------------------------------------------------------------------------ two processes


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, tiny_model) -> Path:
    """The data-parallel run of TWO on two processes that the sharded runs are compared with (run once)."""
    folder = tmp_path_factory.mktemp("ddp")
    ddp = launch(DDP, ["--model_name_or_path", tiny_model, *TWO, "--output_dir", str(folder / "ddp")], folder)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    assert "FSDP2" not in ddp.stdout + ddp.stderr
    return folder / "ddp"


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory, tiny_model) -> tuple[Path, str]:
    """The same run sharded with FSDP2 on the same two processes (run once: compared with data parallelism and
    resumed after SIGKILL below, and compared with two machines): its folder and its console output."""
    folder = tmp_path_factory.mktemp("fsdp")
    fsdp = launch(FSDP, ["--model_name_or_path", tiny_model, *TWO, "--output_dir", str(folder / "fsdp")], folder)
    assert fsdp.returncode == 0, fsdp.stderr[-3000:]
    return folder / "fsdp", fsdp.stdout + fsdp.stderr


@pytest.mark.slow
def test_fsdp2_on_two_cpu_processes_matches_data_parallel_and_resumes_exactly_after_sigkill(tmp_path, tiny_model,
                                                                                           ddp_run, fsdp_run):
    """Four steps of the tiny model, sharded (FSDP2) and data parallel (DDP) on the same two processes, so that both
    sample the same completions: rewards, losses, gradient norms, KL and entropy agree step for step, and so do the
    final weights, within float tolerance (the sharded run sums its gradients in another order). The sharded
    checkpoint holds shards, not a model; final/ is one folder that transformers loads. A sharded run killed with
    SIGKILL (both processes, inside step 3's rewards) and resumed from checkpoint-2 ends exactly as the unbroken
    sharded run: the same metrics and bitwise the same final weights."""
    args = ["--model_name_or_path", tiny_model, *TWO]
    out, said = fsdp_run
    assert "FSDP2: the policy in 3 sharded units over 2 processes" in said
    sharded, plain = compared(out), compared(ddp_run)
    assert [m["step"] for m in sharded] == [1, 2, 3, 4]
    assert close(sharded, plain, rel=1e-4), (sharded, plain)
    final, reference = load_file(out / "final" / "model.safetensors"), \
        load_file(ddp_run / "final" / "model.safetensors")
    assert final.keys() == reference.keys()
    for name in final:
        torch.testing.assert_close(final[name], reference[name], rtol=1e-4, atol=1e-6)
    checkpoint = out / "checkpoint-2"
    assert (checkpoint / "pytorch_model_fsdp_0").is_dir() and (checkpoint / "optimizer_0").is_dir()
    assert not (checkpoint / "model.safetensors").exists() and not (checkpoint / "optimizer.pt").exists()
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(out / "final")
    torch.testing.assert_close(loaded.lm_head.weight, loaded.model.embed_tokens.weight)  # still tied

    assert_resumes_exactly_after_sigkill(FSDP, args, tmp_path, sharded, final)


@pytest.mark.slow
@needs_deepspeed
def test_deepspeed_zero2_and_zero3_on_two_cpu_processes_match_data_parallel_and_zero3_resumes_after_sigkill(
        tmp_path, tiny_model, ddp_run):
    """The same four steps under DeepSpeed ZeRO-2 and ZeRO-3 (DeepSpeed's CPU accelerator over gloo, launched with
    scripts/accelerate/zero2_cpu.yaml and zero3_cpu.yaml): step for step the data-parallel run's rewards, losses, gradient norms (the
    engine's), KL (the reference partitioned by an engine of its own under ZeRO-3) and entropy, and its final
    weights, within float tolerance. Checkpoints are DeepSpeed's per-process files; final/ is one folder that
    transformers loads; a ZeRO-3 run killed with SIGKILL resumes exactly."""
    args = ["--model_name_or_path", tiny_model, *TWO]
    plain = compared(ddp_run)
    reference = load_file(ddp_run / "final" / "model.safetensors")
    assert max(m["kl"] for m in plain) > 1e-4  # the KL term is compared on values that move
    for stage, config in (("2", ZERO2), ("3", ZERO3)):
        out = tmp_path / f"zero{stage}"
        proc = launch(config, [*args, "--output_dir", str(out)], tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"DeepSpeed ZeRO-{stage}: " in proc.stdout + proc.stderr
        runs = compared(out)
        assert [m["step"] for m in runs] == [1, 2, 3, 4]
        assert close(runs, plain, rel=1e-4), (stage, runs, plain)
        final = load_file(out / "final" / "model.safetensors")
        assert final.keys() == reference.keys()
        for name in final:
            torch.testing.assert_close(final[name], reference[name], rtol=1e-4, atol=1e-5)
        checkpoint = out / "checkpoint-2"
        assert sorted(p.name for p in (checkpoint / "deepspeed").glob("*optim_states.pt")) == [
            "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
        assert not (checkpoint / "model.safetensors").exists() and not (checkpoint / "optimizer.pt").exists()
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "zero3" / "final")
    torch.testing.assert_close(loaded.lm_head.weight, loaded.model.embed_tokens.weight)  # still tied
    assert_resumes_exactly_after_sigkill(ZERO3, args, tmp_path, compared(tmp_path / "zero3"),
                                         load_file(tmp_path / "zero3" / "final" / "model.safetensors"))


def fake_slurm(folder: Path) -> Path:
    """Stand-ins for SLURM's two commands that scripts/slurm/train_multinode.sbatch calls, so that it runs here:
    `scontrol show hostnames` names this machine once a node, `srun --ntasks=N cmd...` runs cmd N times at once with
    SLURM_PROCID 0..N-1 (one task a "node"), fails if any task fails, and stops its tasks when stopped."""
    folder.mkdir()
    (folder / "scontrol").write_text("#!/usr/bin/env bash\nfor ((i = 0; i < SLURM_NNODES; i++)); do echo 127.0.0.1; done\n")
    (folder / "srun").write_text(
        "#!/usr/bin/env bash\n"
        "n=1; while [[ $1 == --* ]]; do [[ $1 == --ntasks=* ]] && n=${1#--ntasks=}; shift; done\n"
        "pids=(); trap 'kill ${pids[*]} 2>/dev/null' TERM\n"
        "for ((i = 0; i < n; i++)); do SLURM_PROCID=$i \"$@\" & pids+=($!); done\n"
        "rc=0; for p in \"${pids[@]}\"; do wait $p || rc=$?; done; exit $rc\n")
    for name in ("scontrol", "srun"):
        (folder / name).chmod(0o755)
    return folder


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


GLOO_END = """
import gc, os, sys, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
sys.path.insert(0, sys.argv[1])
from lib.distributed import keep_gloo_groups_to_exit
dist.init_process_group("gloo")
model = fully_shard(torch.nn.Linear(4, 4))
model(torch.ones(2, 4)).sum().backward()
if sys.argv[2] == "keep":
    keep_gloo_groups_to_exit()
dist.destroy_process_group()
del model  # and what still holds the group: DTensor's caches
torch._C._clear_DTensor_sharding_propagator_cache()
DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
gc.collect()
threads = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
# one write, so that the two processes' lines do not interleave (the launcher runs them unbuffered: print's parts
# would be written one by one)
count = sum(name.startswith(("pt_gloo", "gloo")) for name in threads)
sys.stdout.write(f"gloo threads {os.environ['RANK']} {count}\\n")
"""


@pytest.mark.slow  # two launches of two processes: about 10 s
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="counts threads in /proc (Linux)")
def test_a_gloo_group_is_not_freed_in_the_interpreters_shutdown(tmp_path):
    """lib/setup.close keeps a gloo group to the process's exit (lib/distributed.keep_gloo_groups_to_exit): freed
    while the interpreter shuts down, its threads once aborted a finished FSDP2 run on CI (exit -6). Without it the
    group is freed as soon as nothing holds it (its three threads end: the control); with it, never."""
    script = tmp_path / "gloo_end.py"
    script.write_text(GLOO_END)
    counts = {}
    for mode in ("free", "keep"):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script),
                               str(REPO), mode], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        counts[mode] = sorted(line.split()[-1] for line in proc.stdout.splitlines() if line.startswith("gloo threads"))
    assert counts == {"free": ["0", "0"], "keep": ["3", "3"]}


LAUNCHED_END = """
import atexit, sys, threading, time
sys.path.insert(0, sys.argv[1])
from lib.distributed import end_launched_process
marks = sys.argv[2]
atexit.register(lambda: open(marks + ".atexit", "w").close())
threading.Thread(target=lambda: (time.sleep(0.3), open(marks + ".thread", "w").close())).start()

class Late:
    def __del__(self, open=open, path=marks + ".teardown"):  # a module's global: deleted in the teardown, not before
        open(path, "w").close()

late = Late()
sys.stdout.write("written, not yet flushed")  # stdout is a pipe here: block-buffered (no PYTHONUNBUFFERED)
end_launched_process()
"""


def test_a_launched_process_ends_as_the_interpreter_would_but_without_its_teardown(tmp_path):
    """train_agrpo.py's last call (lib/distributed.end_launched_process): in a launched process (WORLD_SIZE above 1)
    the process waits for its threads, runs its exit handlers, flushes its output and exits 0, skipping the
    interpreter's teardown (where a gloo thread once aborted a finished ZeRO-2 run); in a process that was not launched
    it returns, and the teardown runs."""
    script = tmp_path / "end.py"
    script.write_text(LAUNCHED_END)
    for world, torn_down in (("2", False), ("1", True)):
        marks = tmp_path / f"world{world}"
        proc = subprocess.run([sys.executable, str(script), str(REPO), str(marks)], capture_output=True, text=True,
                              timeout=120, env={**{k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"},
                                                "WORLD_SIZE": world, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0 and proc.stdout == "written, not yet flushed", (world, proc.stderr[-2000:])
        assert (tmp_path / f"world{world}.atexit").exists() and (tmp_path / f"world{world}.thread").exists()
        assert (tmp_path / f"world{world}.teardown").exists() == torn_down, world


@pytest.mark.slow
def test_two_machines_train_as_two_processes_of_one(tmp_path, tiny_model, fsdp_run):
    """Multi-node: the SLURM script's launch, two "machines" (one process each, --num_machines 2, --machine_rank 0 /
    1 over 127.0.0.1, SLURM's srun and scontrol played by stand-ins), sharded with FSDP2: the global ranks, world
    size and data split are those of two processes on one machine (the FSDP2 run above), so every logged value is
    the same, bitwise."""
    args = ["--model_name_or_path", tiny_model, *TWO]
    one = fsdp_run[0]
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"output_dir: {tmp_path / 'two'}\n")
    env = {**os.environ, "PATH": f"{fake_slurm(tmp_path / 'bin')}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "OMP_NUM_THREADS": "1", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[0-1]", "GPUS_PER_NODE": "1",
           "MAIN_PORT": str(free_port()), "ACCELERATE_CONFIG": "scripts/accelerate/fsdp2_cpu.yaml"}
    two = subprocess.run(["bash", "scripts/slurm/train_multinode.sbatch", str(recipe), *args], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stderr.count("FSDP2: the policy in 3 sharded units over 2 processes") + \
        two.stdout.count("FSDP2: the policy in 3 sharded units over 2 processes") == 1  # the main process says it
    assert compared(tmp_path / "two") == compared(one)
    assert (tmp_path / "two" / "checkpoint-4" / "rng_state_1.pt").exists()


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["fsdp2", pytest.param("zero3", marks=needs_deepspeed)])
def test_sharding_refuses_lora_before_loading_a_model(tmp_path, tiny_model, sharding):
    proc = launch(FSDP if sharding == "fsdp2" else ZERO3, ["--model_name_or_path", tiny_model, *TWO, "--use_peft",
                                                           "true", "--output_dir", str(tmp_path / "lora")], tmp_path)
    assert proc.returncode != 0
    assert "configuration error: use_peft / load_in_4bit: LoRA and QLoRA train with data parallelism" in proc.stderr
    assert not (tmp_path / "lora" / "checkpoint-2").exists()


@pytest.mark.slow
def test_the_memory_guard_counts_a_process_of_the_sharded_launch(tmp_path, tiny_model, fsdp_run):
    """The guard on two real processes: the sharded run says its per-process figure at start-up (and ran, fsdp_run);
    under a budget below it every process stops before a step with that figure and the advice for a sharded launch
    (more processes, not LoRA, which does not shard)."""
    _, output = fsdp_run
    assert "a process (FSDP2 over 2 processes) (in GB: already resident" in output
    proc = launch(FSDP, ["--model_name_or_path", tiny_model, *TWO, "--max_memory", "0.5", "--output_dir",
                         str(tmp_path / "small")], tmp_path)
    assert proc.returncode != 0
    refused = [line for line in proc.stderr.splitlines() if line.startswith("configuration error: a training step")]
    assert len(refused) == 2, proc.stderr[-3000:]  # each process
    assert all("GB a process (FSDP2 over 2 processes)" in line and "launch more processes" in line
               and "use_peft" not in line for line in refused), refused
    assert not (tmp_path / "small" / "metrics.jsonl").exists() or "loss" not in (
        tmp_path / "small" / "metrics.jsonl").read_text()


@pytest.fixture
def thirty_blocks(tmp_path, embedded_model) -> str:
    """The embedded 135M model's layout at a fraction of its width: its configuration (30 decoder blocks, 9 attention
    heads over 3 key-value heads, tied embeddings, its vocabulary and RoPE) with 72-wide hidden states and 128-wide
    MLPs, random (seeded) weights, its tokenizer. What sharding depends on (the units, the tied weights, the reference
    model) is the real model's; a step costs about what the tiny model's does."""
    from transformers import AutoConfig, LlamaForCausalLM

    from lib.models.modeling import load_tokenizer

    config = AutoConfig.from_pretrained(embedded_model)
    config.update({"hidden_size": 72, "head_dim": 8, "intermediate_size": 128})
    torch.manual_seed(0)
    folder = tmp_path / "thirty_blocks"
    LlamaForCausalLM(config).save_pretrained(folder)
    load_tokenizer(embedded_model).save_pretrained(folder)
    return str(folder)


@pytest.mark.slow
def test_fsdp2_on_the_embedded_models_layout_matches_data_parallel(tmp_path, thirty_blocks):
    """The embedded 135M model's layout (thirty_blocks: 30 decoder blocks, tied embeddings, a reference model for the
    KL term, sharded too), two steps of one group of 8 completions a step over two processes, fp32, 8-token
    completions: what is checked is how this layout shards (31 units), not what it learns, so its width is cut
    (the weights of the real model cost 64 s for the same two launches). The accuracy reward and the completion's
    characters (a spread in every group), so step 1 updates and step 2 runs on the weights that sharded update wrote
    (its KL is above 0): sharded and data-parallel runs agree step for step."""
    args = ["--model_name_or_path", thirty_blocks, "--max_steps", "2", "--per_device_train_batch_size", "4",
            "--max_completion_length", "8", "--num_eval_samples", "0", "--bf16", "false", "--save_strategy", "no",
            "--reward_funcs", "accuracy", f"{REWARDS}:characters"]
    ddp = launch(DDP, [*args, "--output_dir", str(tmp_path / "ddp")], tmp_path)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    fsdp = launch(FSDP, [*args, "--output_dir", str(tmp_path / "fsdp")], tmp_path)
    assert fsdp.returncode == 0, fsdp.stderr[-3000:]
    assert "FSDP2: the policy in 31 sharded units over 2 processes" in fsdp.stdout + fsdp.stderr
    sharded, plain = compared(tmp_path / "fsdp"), compared(tmp_path / "ddp")
    assert [m["step"] for m in sharded] == [1, 2] and sharded[0]["grad_norm"] > 0
    assert sharded[-1]["kl"] > 0, sharded  # the last step compares weights after an update, not the starting ones
    assert close(sharded, plain, rel=1e-3), (sharded, plain)
