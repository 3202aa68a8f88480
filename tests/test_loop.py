"""The training loop's mechanics on a tiny random-weight model (tests/conftest.py::tiny_model), in the fast suite:
every preset's parts, per-batch counters, the controllers' timing, exact resume and two processes. The update itself
(its gradient, gradient accumulation, direction) is checked against its definition in tests/test_update.py. The
trainer runs in this process (`train_agrpo.main`), a few seconds a run. Learning and quality are tested on the real
embedded model in tests/test_train.py."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import train_agrpo
from conftest import PRECISIONS, REPO
from lib.config import PRESETS, steps_per_rollout, make_config

REWARDS = str(REPO / "tests" / "tiny_rewards.py")
# 2 prompts x 4 completions of 8 tokens a step; the correctness judge is has_x (about 1 completion in 8 on random
# text, so groups are mixed, all wrong and now and then all right), and `characters` gives every group a spread
TINY = ["--max_steps", "2", "--per_device_train_batch_size", "8", "--num_generations", "4",
        "--max_completion_length", "8", "--num_eval_samples", "0", "--builtin_num_train", "64",
        "--learning_rate", "1e-3", "--reward_funcs", f"{REWARDS}:has_x", f"{REWARDS}:characters",
        "--reward_weights", "1", "0.5", "--correctness_reward", "has_x", "--bf16", "false"]
TIMES = ("step_time",)


@pytest.fixture(autouse=True)
def one_thread():
    """One thread for the tiny model: its matrices are too small to share, and two threads that must meet at every
    operation wait on each other whenever the machine is busy (a tiny run took 39 s with two, 10 s with one, on 2
    loaded cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def train(tiny_model, out, *args) -> list[dict]:
    """Run the trainer in this process; returns the training lines of metrics.jsonl."""
    from accelerate.state import AcceleratorState

    try:
        train_agrpo.main(["--model_name_or_path", tiny_model, *TINY, "--output_dir", str(out), *args])
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)  # the next run builds its own Accelerator
    return steps_of(out)


def steps_of(out) -> list[dict]:
    return [m for m in read_jsonl(Path(out) / "metrics.jsonl") if "reward" in m]


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def without_times(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith("time/") and k not in TIMES}


def moved_tensors(out, start) -> int:
    final, base = load_file(Path(out) / "final" / "model.safetensors"), load_file(Path(start) / "model.safetensors")
    return sum(not torch.equal(final[k], base[k]) for k in base)


# every preset: the fields its parts log besides beta / epsilon / temperature / num_generations, and the ones among
# them that count events of a generation batch's sampling (logged on the step that sampled it, 0 on the others)
PRESET_FIELDS = {
    "grpo": [], "dr_grpo": [], "gspo": [],
    "dapo": ["dynamic_sampling/rounds", "dynamic_sampling/replaced_groups", "num_tokens/filtered"],
    "agrpo": ["kl_ema", "next_beta", "next_epsilon"],
    "agpo": ["rewards/length/mean"],
    "adagrpo": ["resample_rounds", "resampled_prompts", "num_tokens/resampled"],
    "agpo_dsf": ["entropy_ref", "uncertainty_baseline", "step_kl_ema", "vote_entropy", "probe_reward_std",
                 "num_tokens/probe", "epsilon/group_min", "epsilon/group_max"],
}
COUNTERS = {"dynamic_sampling/rounds", "dynamic_sampling/replaced_groups", "num_tokens/filtered", "resample_rounds",
            "resampled_prompts", "num_tokens/resampled", "num_tokens/probe"}


@pytest.mark.parametrize("algo", list(PRESET_FIELDS))
def test_every_preset_runs_its_parts_and_logs_batch_counters_once(algo, tmp_path, tiny_model):
    assert set(PRESET_FIELDS) == set(PRESETS)
    per_rollout = steps_per_rollout(make_config({"algo": algo}))
    steps = 2 * per_rollout  # two generation batches
    extra = ["--reward_funcs", f"{REWARDS}:has_x", "length", "--reward_weights", "1", "0.1"] if algo == "agpo" else []
    # DAPO: groups of 2 are often flat, so there is something to replace; the tiny model's random text never ends
    # within 8 tokens, so its overlong filter would mask every token out of the loss
    extra += ["--num_generations", "2", "--mask_truncated_completions", "false"] if algo == "dapo" else []
    out = tmp_path / algo
    lines = train(tiny_model, out, "--algo", algo, "--max_steps", str(steps), "--save_steps", str(per_rollout),
                  *extra)
    assert yaml.safe_load((out / "config.yaml").read_text())["algo"] == algo
    assert [m["step"] for m in lines] == list(range(1, steps + 1))
    for key in ["beta", "epsilon", "temperature", "num_generations", "loss", "grad_norm"] + PRESET_FIELDS[algo]:
        assert all(key in m for m in lines), key
    assert moved_tensors(out, tiny_model) > 10, "training did not change the parameters"
    # a generation batch's counters and its sampling time appear once, on the step that sampled it: summed over
    # the run they count each batch once
    for batch_start in range(0, steps, per_rollout):
        reused = lines[batch_start + 1: batch_start + per_rollout]
        assert "time/generation" in lines[batch_start] and not any("time/generation" in m for m in reused)
        for key in COUNTERS & set(PRESET_FIELDS[algo]):
            assert all(m[key] == 0 for m in reused), key
    batches = lines[::per_rollout]
    assert [m["num_tokens"] for m in lines] == [m["num_tokens"] for m in batches for _ in range(per_rollout)]
    if algo == "agpo_dsf":
        assert all(m["num_tokens/probe"] > 0 for m in batches)
        first = batches[0]["num_tokens"]
        assert first == 2 * batches[0]["num_tokens/probe"]  # probe and training groups are both 8 x 8 tokens
    if algo == "dapo":
        replaced = sum(m["dynamic_sampling/replaced_groups"] for m in lines)
        state = json.loads((out / f"checkpoint-{steps}" / "trainer_state.json").read_text())
        assert replaced > 0 and state["data_position"] == 4 * steps + replaced  # one new prompt per dropped group
        assert sum(m["num_tokens/filtered"] for m in lines) == 8 * replaced * 2  # groups of 2 x 8 tokens dropped
    if algo == "adagrpo":
        assert all(m["num_tokens"] >= 8 * 8 for m in batches) and all(m["resample_rounds"] <= 2 for m in lines)
    if algo == "gspo":  # the first slice is on-policy (s_i = 1 exactly), later slices were sampled before updates
        assert lines[0]["clip_ratio/region_mean"] == 0.0


def test_agrpo_controller_values_are_fresh_at_every_step_of_a_reused_batch(tmp_path, tiny_model):
    """A-GRPO's controller updates after every optimizer step; with two updates per generation batch the second
    must train with the beta / epsilon the first set, not the ones in force when the batch was sampled."""
    lines = train(tiny_model, tmp_path / "mu2", "--algo", "agrpo", "--num_iterations", "2", "--max_steps", "4",
                  "--beta", "0.04", "--kl_estimator", "k1")  # k1: the KL, and so the controller, moves at once
    assert lines[0]["beta"] == 0.04
    for before, after in zip(lines, lines[1:]):
        assert after["beta"] == before["next_beta"] and after["epsilon"] == before["next_epsilon"]
    assert len({m["beta"] for m in lines}) == 4  # it moved at every step


def test_dsf_step_kl_is_measured_in_eval_mode(tmp_path, tiny_model):
    """AGPO-DSF's step KL compares pi_old (eval mode) with the policy after the batch's updates. With every update
    skipped the policy did not change, so the drift is exactly 0; measured in train mode, the adapter's dropout
    noise, clamped at 0 per group, would make it positive (docs/methods.md 5.1)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # an adapter that does something (B != 0), so that its dropout changes the output in train mode
    adapter = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model), LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.5, target_modules="all-linear", init_lora_weights=False))
    adapter.save_pretrained(tmp_path / "adapter")
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(tmp_path / "adapter")  # as a LoRA run's final/ has
    lines = train(tiny_model, tmp_path / "dsf", "--model_name_or_path", str(tmp_path / "adapter"), "--algo",
                  "agpo_dsf", "--reward_funcs", f"{REWARDS}:one", "--reward_weights", "1", "--correctness_reward", "one",
                  "--skip_zero_signal_updates", "true", "--max_steps", "8")
    assert all(m["update_skipped"] == 1.0 for m in lines)
    assert [m["step_kl_ema"] for m in lines] == [0.0] * 8


@pytest.mark.parametrize("precision", PRECISIONS)
def test_resume_continues_exactly_with_every_controller(tmp_path, tiny_model, precision):
    """Every controller at once (A-GRPO's beta / epsilon, entropy coefficient and group size, adaGRPO's retries,
    AGPO-DSF's averages), in fp32 and in bf16 (autocast, and the bf16 sampler copy a sync refreshes and a resume
    builds anew): the run resumed from its step-2 checkpoint logs each step once, and every number and weight as the
    uninterrupted run."""
    args = ["--bf16", str(precision == "bf16").lower(), "--algo", "agpo_dsf", "--adaptive_kl", "true",
            "--adaptive_group_size", "true", "--group_size_min", "2", "--group_size_max", "8", "--num_iterations",
            "2", "--max_steps", "6", "--save_steps", "2",
            "--resample_schedule", '[{"step": 1, "params": [{"temperature": 1.0}]}]', "--kl_estimator", "k1",
            "--use_adaptive_entropy", "true", "--entropy_target", "100"]
    reference = tmp_path / "uninterrupted"
    want = train(tiny_model, reference, *args)
    saved = json.loads((reference / "checkpoint-2" / "trainer_state.json").read_text())["controller_state"]
    assert set(saved) == {"kl", "entropy", "group_size", "dsf"} and saved["dsf"]["step_kl_ema"] > 0
    assert saved["entropy"]["eta"] > 0 and want[2]["eta"] == saved["entropy"]["eta"]
    # the same run stopped after its step-2 checkpoint, then resumed from it: the same process, code and inputs, so
    # every number is exactly equal (timings aside)
    out = tmp_path / "resumed"
    shutil.copytree(reference, out, ignore=shutil.ignore_patterns("checkpoint-4", "checkpoint-6", "final"))
    got = train(tiny_model, out, *args, "--resume_from_checkpoint", "latest")
    assert [m["step"] for m in got] == list(range(1, 7))  # each step logged once: none redone twice, none lost
    assert got[2]["beta"] != 0.03  # step 3 trains with the saved controller state, not the configured start
    assert [without_times(m) for m in got] == [without_times(m) for m in want]
    for name in ("trainer_state.json",):
        got_state = json.loads((out / "checkpoint-6" / name).read_text())
        want_state = json.loads((reference / "checkpoint-6" / name).read_text())
        assert got_state["controller_state"] == want_state["controller_state"]
    a, b = load_file(out / "final" / "model.safetensors"), load_file(reference / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def sampler_events(monkeypatch) -> list:
    """Record, in order, every weight push to the HF sampler ("push") and every generate call ("sample", or "eval"
    for a greedy one) with whether the sampler's copy then computes what a copy made afresh from the policy does:
    a stale copy gives other logits."""
    from lib.sampling.cpu_kernels import sampling_copy
    from lib.sampling.rollout import HFRollout

    events, push, generate = [], HFRollout.sync_weights, HFRollout.generate
    probe = torch.arange(3, 19).view(2, 8)

    def counted_push(self, policy):
        events.append("push")
        return push(self, policy)

    def checked_generate(self, *args, **kwargs):
        with torch.no_grad():
            fresh = sampling_copy(self.policy, self.bf16).model
            current = bool(torch.equal(self.copy(probe).logits, fresh(probe).logits))
        events.append(("eval" if kwargs.get("greedy") else "sample", current))
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(HFRollout, "sync_weights", counted_push)
    monkeypatch.setattr(HFRollout, "generate", checked_generate)
    return events


def calls(events: list) -> list:
    """The events with a generate call's consecutive batches (an evaluation in several) counted once."""
    out = []
    for event in events:
        if event == "push" or not out or out[-1] != event:
            out.append(event)
    return out


def test_weights_are_pushed_once_per_generation_batch_and_every_sample_sees_them(tmp_path, tiny_model, monkeypatch):
    """Issue 52, defect 2: two optimizer steps a generation batch (num_iterations 2), a LoRA policy the HF sampler
    decodes through a merged copy (so a sampler that missed an update samples from other weights). The weights go to
    the sampler once per batch, just before it samples, not after each step; an evaluation between a batch's two
    steps, and the one after the last step, get the weights as they are then; so does the run resumed from its
    step-2 checkpoint (its sampler built from the checkpoint), with no push before its first batch."""
    args = ["--use_peft", "true", "--num_iterations", "2", "--max_steps", "6", "--save_steps", "2",
            "--num_eval_samples", "2", "--eval_steps", "3"]
    events = sampler_events(monkeypatch)
    want = train(tiny_model, tmp_path / "run", *args)
    assert all(m["grad_norm"] > 0 and m.get("update_skipped", 0.0) == 0 for m in want)  # every step moved the weights
    sample, evaluation = ("sample", True), ("eval", True)  # each with the current weights
    # eval at 0 | batch 1: steps 1, 2 | push, batch 2: step 3 | push, eval at 3 | step 4 | push, batch 3: steps 5, 6
    # | push, the final eval. (Pushed after each step, there would be 6 pushes, 2 in a row between steps.)
    assert calls(events) == [evaluation, sample, "push", sample, "push", evaluation, "push", sample, "push",
                              evaluation], events
    assert [m["time/weight_sync"] > 0 for m in want if "time/weight_sync" in m] == [True] * 3  # once per batch
    assert all("time/weight_sync" not in m for m in want[1::2])  # the batch's second step pushes nothing

    events.clear()
    out = tmp_path / "resumed"
    shutil.copytree(tmp_path / "run", out, ignore=shutil.ignore_patterns("checkpoint-4", "checkpoint-6", "final"))
    got = train(tiny_model, out, *args, "--resume_from_checkpoint", "latest")
    # step 3 onwards: batch 2 from the checkpoint's weights (no push), then as above
    assert calls(events) == [sample, "push", evaluation, "push", sample, "push", evaluation], events
    assert [without_times(m) for m in got] == [without_times(m) for m in want]


def test_a_batch_without_signal_is_measured_but_moves_nothing_when_skipped(tmp_path, tiny_model):
    """Every completion scores 1, so every advantage is 0; with the entropy bonus on, the only gradient is the
    bonus's. skip_zero_signal_updates keeps the model exactly as it started while the step is still measured."""
    common = ["--algo", "agrpo", "--reward_funcs", f"{REWARDS}:one", "--reward_weights", "1", "--correctness_reward",
              "one", "--num_eval_samples", "0"]
    skipped = train(tiny_model, tmp_path / "skipped", *common, "--skip_zero_signal_updates", "true")
    assert [m["update_skipped"] for m in skipped] == [1.0, 1.0]
    assert all(m["grad_norm"] == 0.0 and m["frac_reward_zero_std"] == 1.0 and m["entropy"] > 0 for m in skipped)
    assert all(abs(m["kl"]) < 1e-6 for m in skipped)  # the policy never left the reference
    assert moved_tensors(tmp_path / "skipped", tiny_model) == 0
    applied = train(tiny_model, tmp_path / "applied", *common, "--skip_zero_signal_updates", "false")
    assert "update_skipped" not in applied[0] and applied[0]["grad_norm"] > 0 and applied[1]["kl"] > 0
    assert moved_tensors(tmp_path / "applied", tiny_model) > 10


def test_custom_reward_that_raises_is_scored_zero_and_counted(tmp_path, tiny_model):
    (tmp_path / "flaky_reward.py").write_text(
        "def flaky(prompts, completions, **columns):\n"
        "    if any(len(c) % 2 for c in completions):\n"
        "        raise ValueError('odd length')\n"
        "    return [1.0 for _ in completions]\n")
    lines = train(tiny_model, tmp_path / "flaky", "--reward_funcs", f"{REWARDS}:has_x",
                  f"{tmp_path / 'flaky_reward.py'}:flaky", "--reward_weights", "1", "1", "--max_steps", "1")
    assert lines[0]["rewards/flaky/errors"] > 0
    # each completion that raised scored 0 and the others 1
    assert lines[0]["rewards/flaky/mean"] == pytest.approx(1 - lines[0]["rewards/flaky/errors"] / 8)


def launch_two_processes(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`accelerate launch` of the trainer on two CPU processes (gloo), one thread each."""
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                "--main_process_port", "0"]
    return subprocess.run(launcher + [str(REPO / "train_agrpo.py"), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow  # a launch of two processes, 22 s of CPU: the fast suite keeps tests/test_update.py's one
def test_two_processes_split_groups_and_agree_on_the_adaptive_sampling(tmp_path, tiny_model):
    """AGPO-DSF's probes and clip ranges, adaGRPO's retries and the answer-phase sampler, with every group split
    across two processes (gloo): the statistics come from gathered rewards, entropies and answer keys, so both
    processes take the same decisions."""
    out = tmp_path / "ddp"
    # two steps of 2 completions a process per generation batch, each made twice: one group of 8 a batch, 4 on each
    # process, and every step trains on a slice of both halves
    args = ["--model_name_or_path", tiny_model, *TINY, "--output_dir", str(out), "--per_device_train_batch_size", "2",
            "--max_steps", "8", "--num_generations", "8", "--steps_per_generation", "2", "--num_iterations", "2",
            "--algo", "agpo_dsf", "--resample_schedule", '[{"step": 1, "params": [{"temperature": 1.0}]}]',
            "--answer_marker", "is", "--kl_estimator", "k1", "--save_steps", "4",
            # the entropy mask's threshold is taken over both processes' tokens (lib/distributed.gather_ragged)
            "--top_entropy_quantile", "0.5", "--off_policy_mask_threshold", "0.5"]
    proc = launch_two_processes(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = steps_of(out)
    assert [m["step"] for m in lines] == list(range(1, 9))  # only the main process writes
    assert lines[0]["num_tokens/probe"] > 0 and lines[4]["num_tokens/probe"] > 0 and "resample_rounds" in lines[0]
    assert [m["num_tokens/probe"] for m in lines[1:4] + lines[5:8]] == [0] * 6
    assert len({m["epsilon"] for m in lines[:4]}) == 1 and lines[3]["step_kl_ema"] > 0
    assert all(0.2 < m["masked/low_entropy"] < 0.8 and "masked/off_policy" in m for m in lines)
    state = json.loads((out / "checkpoint-8" / "trainer_state.json").read_text())
    assert state["data_position"] == 2  # one prompt per generation batch, across both processes
    assert (out / "checkpoint-8" / "rng_state_1.pt").exists() and not (out / "checkpoint-8" / "rng_state_2.pt").exists()


@pytest.mark.slow
def test_two_processes_with_gdpo_adaptive_entropy_and_reference_updates(tmp_path, tiny_model):
    """normalize_then_sum, the adaptive entropy controller and sync_ref_model with every group split across two
    processes (gloo): the advantages come from the gathered rewards, the controller reads the entropy reduced over
    both, and each process mixes its own reference copy from the same policy."""
    out = tmp_path / "ddp"
    # 2 completions a process: each step's group of 4 has half its completions on each process
    args = ["--model_name_or_path", tiny_model, *TINY, "--output_dir", str(out), "--per_device_train_batch_size", "2",
            "--max_steps", "4", "--multi_objective_aggregation", "normalize_then_sum", "--algo", "agrpo",
            "--use_adaptive_entropy", "true", "--entropy_target", "100", "--sync_ref_model", "true",
            "--ref_model_sync_steps", "2", "--ref_model_mixup_alpha", "0.5", "--save_steps", "2"]
    proc = launch_two_processes(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = steps_of(out)
    assert [m["eta"] for m in lines[1:]] == pytest.approx([m["entropy_coef"] for m in lines[:-1]])
    base = load_file(Path(tiny_model) / "model.safetensors")
    policy = load_file(out / "checkpoint-2" / "model.safetensors")
    mixed = load_file(out / "checkpoint-2" / "reference" / "model.safetensors")
    assert all(torch.allclose(mixed[k], 0.5 * policy[k] + 0.5 * base[k], atol=1e-7) for k in base)


def test_a_run_refused_in_set_up_leaves_no_accelerate_state(tmp_path):
    """Accelerate keeps one state per process: a run refused after its Accelerator was made (here by the batch check,
    in bf16) made every later run in the same process with another precision fail to start."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from lib.config import ConfigError

    with pytest.raises(ConfigError, match="multiple of num_generations"):
        train_agrpo.main(["--per_device_train_batch_size", "6", "--num_generations", "4", "--bf16", "true",
                          "--output_dir", str(tmp_path / "refused")])
    try:
        assert Accelerator(cpu=True, mixed_precision="no").mixed_precision == "no"
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_cispo_loss_type_trains_through_the_registry(tmp_path, tiny_model):
    """`--loss_type cispo` (lib/methods/losses.LOSS_TYPES, docs/methods.md 1.7) reaches the loop's loss: on-policy every
    weight is 1, so its gradient is DAPO's (-A grad log pi over the global batch's tokens) and one step leaves the
    same weights, while the logged loss is the CISPO value, -A log pi, not DAPO's -A."""
    runs = {}
    for loss_type in ("dapo", "cispo"):
        out = tmp_path / loss_type
        lines = train(tiny_model, out, "--loss_type", loss_type, "--epsilon_high", "5", "--max_steps", "1",
                      "--beta", "0")
        runs[loss_type] = (lines[0], load_file(out / "final" / "model.safetensors"))
    (dapo, dapo_weights), (cispo, cispo_weights) = runs["dapo"], runs["cispo"]
    assert "clip_ratio/high_mean" in cispo and cispo["loss"] != pytest.approx(dapo["loss"])
    assert all(torch.allclose(cispo_weights[k], dapo_weights[k], atol=1e-6) for k in dapo_weights)
    assert moved_tensors(tmp_path / "cispo", tiny_model) > 10


def test_issue_39_loss_keys_train_through_the_loop(tmp_path, tiny_model):
    """TRL 1.16's newer loss keys reach the loop's loss (docs/methods.md 1.8-1.11): SAPO with the entropy and
    off-policy masks, over a generation batch that serves two steps (the second off-policy, so pi_old differs from the
    policy and the off-policy mask has a KL to read), and TRL's delta, read as dual_clip."""
    out = tmp_path / "sapo"
    lines = train(tiny_model, out, "--loss_type", "sapo", "--sapo_temperature_neg", "2", "--top_entropy_quantile",
                  "0.2", "--off_policy_mask_threshold", "0", "--num_iterations", "2", "--beta", "0")
    # about 80% of the loss tokens left out by the entropy mask, on every step
    assert all(0.7 < m["masked/low_entropy"] < 0.85 for m in lines), [m["masked/low_entropy"] for m in lines]
    # on-policy (step 1) the KL to pi_old is 0 and nothing is masked; after an update some negative sample is
    assert lines[0]["masked/off_policy"] == 0 and lines[1]["masked/off_policy"] > 0
    assert moved_tensors(out, tiny_model) > 10
    assert yaml.safe_load((out / "config.yaml").read_text())["sapo_temperature_neg"] == 2.0
    delta = train(tiny_model, tmp_path / "delta", "--delta", "3", "--loss_type", "dapo", "--max_steps", "1")
    assert yaml.safe_load((tmp_path / "delta" / "config.yaml").read_text())["dual_clip"] == 3.0
    assert "clip_ratio/dual_mean" in delta[0]


def test_adaptive_entropy_controller_drives_eta_under_agrpo(tmp_path, tiny_model):
    """use_adaptive_entropy (docs/methods.md 2.6) under the A-GRPO preset: the first step trains with no bonus (no
    entropy measured yet), each later one with the coefficient the step before left, while the trained tokens'
    entropy is at or below entropy_target; the coefficient climbs by entropy_coef_delta up to entropy_coef_max.
    Random text has an entropy near ln(vocabulary), far above 0, so a target of 0 makes it fall instead."""
    up = train(tiny_model, tmp_path / "up", "--algo", "agrpo", "--use_adaptive_entropy", "true", "--eta", "0.01",
               "--entropy_target", "100", "--entropy_coef_delta", "0.02", "--entropy_coef_max", "0.04",
               "--max_steps", "3")
    assert [m["eta"] for m in up] == [0.0, 0.03, 0.04]
    assert [m["entropy_coef"] for m in up] == pytest.approx([0.03, 0.04, 0.04])
    assert all(0 < m["entropy/trained"] <= 100 for m in up)
    down = train(tiny_model, tmp_path / "down", "--algo", "agrpo", "--use_adaptive_entropy", "true", "--eta",
                 "0.01", "--entropy_target", "0", "--entropy_coef_delta", "0.004", "--max_steps", "3")
    assert [m["eta"] for m in down] == [0.0] * 3  # above the target: no bonus at all
    assert [m["entropy_coef"] for m in down] == pytest.approx([0.006, 0.002, 0.0])


def test_sync_ref_model_mixes_the_reference_and_resumes_exactly(tmp_path, tiny_model):
    """sync_ref_model (TR-DPO, docs/methods.md 13.3): after step 2 the reference is 0.5 policy + 0.5 base, the
    checkpoint holds it, and a run resumed from that checkpoint logs every number (the KL to the moved reference
    included) and ends with every weight as the uninterrupted run."""
    args = ["--sync_ref_model", "true", "--ref_model_sync_steps", "2", "--ref_model_mixup_alpha", "0.5", "--beta",
            "0.04", "--kl_estimator", "k1", "--max_steps", "4", "--save_steps", "2", "--num_iterations", "2"]
    reference = tmp_path / "uninterrupted"
    want = train(tiny_model, reference, *args)
    base = load_file(Path(tiny_model) / "model.safetensors")
    policy = load_file(reference / "checkpoint-2" / "model.safetensors")
    mixed = load_file(reference / "checkpoint-2" / "reference" / "model.safetensors")
    assert all(torch.allclose(mixed[k], 0.5 * policy[k] + 0.5 * base[k], atol=1e-7) for k in base)
    assert sum(not torch.equal(mixed[k], base[k]) for k in base) > 10
    out = tmp_path / "resumed"
    shutil.copytree(reference, out, ignore=shutil.ignore_patterns("checkpoint-4", "final"))
    got = train(tiny_model, out, *args, "--resume_from_checkpoint", "latest")
    assert [without_times(m) for m in got] == [without_times(m) for m in want]
    a, b = load_file(out / "final" / "model.safetensors"), load_file(reference / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    # without the saved reference the resumed run would score the KL against the base: a different step 3
    fresh = tmp_path / "no_reference"
    shutil.copytree(reference, fresh, ignore=shutil.ignore_patterns("checkpoint-4", "final", "reference"))
    assert train(tiny_model, fresh, *args, "--resume_from_checkpoint", "latest")[2]["kl"] != want[2]["kl"]


def test_sync_ref_model_is_refused_with_lora_as_in_trl(tmp_path, tiny_model):
    """With LoRA the reference is the base with the adapter off: no copy to mix into (TRL refuses it too)."""
    from lib.config import ConfigError

    with pytest.raises(ConfigError, match="sync_ref_model .* LoRA run"):
        train(tiny_model, tmp_path / "lora", "--use_peft", "true", "--sync_ref_model", "true", "--max_steps", "1")
    assert not (tmp_path / "lora" / "metrics.jsonl").exists()


def test_normalize_then_sum_and_fp32_head_train(tmp_path, tiny_model):
    """multi_objective_aggregation normalize_then_sum (GDPO, docs/methods.md 13.1) and cast_lm_head_to_fp32 (13.2) with
    bfloat16 weights: a step trains, and the output layer (tied to the embeddings here) stays float32 while the
    other weights are bfloat16."""
    out = tmp_path / "gdpo"
    lines = train(tiny_model, out, "--multi_objective_aggregation", "normalize_then_sum", "--cast_lm_head_to_fp32",
                  "true", "--dtype", "bfloat16", "--max_steps", "1")
    assert lines[0]["reward_std"] > 0 and lines[0]["grad_norm"] > 0
    final = load_file(out / "final" / "model.safetensors")
    assert final["model.embed_tokens.weight"].dtype == torch.float32
    assert final["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16


def test_gradient_checkpointing_shares_the_prompt_in_the_trainer(tmp_path, tiny_model, monkeypatch):
    """lib/setup.prepare_policy gives the policy's scorer lib/models/checkpointed_prefix.py: under gradient checkpointing
    the training pass runs each prompt once (docs/performance.md 3.6), and the step equals the one without
    checkpointing. The real completion_cache runs; the wrapper only counts its calls."""
    from lib.models import checkpointed_prefix

    calls = []
    completion_cache = checkpointed_prefix.completion_cache
    monkeypatch.setattr(checkpointed_prefix, "completion_cache",
                        lambda cache, index: calls.append(len(index)) or completion_cache(cache, index))
    plain = train(tiny_model, tmp_path / "plain", "--max_steps", "1")
    assert not calls
    checkpointed = train(tiny_model, tmp_path / "checkpointed", "--max_steps", "1", "--gradient_checkpointing", "true")
    assert calls and sum(calls) >= 8  # the step's 8 completions, through the shared prompts
    assert checkpointed[0]["loss"] == pytest.approx(plain[0]["loss"], rel=1e-4, abs=1e-6)
    assert checkpointed[0]["grad_norm"] == pytest.approx(plain[0]["grad_norm"], rel=1e-3)
