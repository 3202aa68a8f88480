"""What only a GPU shows: the sampler against the scorer in bf16 and fp32 on CUDA kernels, merged LoRA / QLoRA
copies, the sampler process's copy shared through CUDA's inter-process handles, resume on CUDA and the memory
estimate against the allocator's own peak (FSDP2's mixed precision is in
tests/test_gpu_paths.py, which runs on the GPU check's device and on any CPU).

Marked `gpu`: `bash scripts/gpu_check.sh` runs them on an NVIDIA GPU (docs/performance.md 6); they skip on a machine
without one, except under `AGRPO_GPU_DRY_RUN=1` (`scripts/gpu_check.sh --dry-run`), where they run the same code on
the CPU so that the check cannot rot between GPU contacts. Every measured figure is also appended to the JSON-lines
file `$AGRPO_GPU_REPORT` when it is set, for the check's results file.

Models are built from a config with random (seeded) weights: a small Qwen2 for the mechanics, the Qwen2.5-0.5B
shape for the memory figure (no download). The trainer's tests use a tokenizer folder: `$AGRPO_TOKENIZER_DIR`
(the GPU machine gets the embedded model's tokenizer through scripts/gpu_check.sh --prepare), else the embedded
model's own.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import decoded_logps, rel_diff, rollout_logps

NO_GPU = "needs an NVIDIA GPU"
# under CI (a CPU machine) these skip: scripts/gpu_check.sh runs them where a GPU is, --dry-run on a CPU
pytestmark = [pytest.mark.gpu, pytest.mark.ci_may_skip(NO_GPU)]

REPO = Path(__file__).resolve().parents[1]
SMALL = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, rope_theta=10_000.0, rms_norm_eps=1e-6,
             tie_word_embeddings=True)


@pytest.fixture(scope="module")
def device() -> torch.device:
    if torch.cuda.is_available():
        # fp32 means fp32 here: TF32 matmuls would round the fp32 comparisons to 1e-3 (the trainer's `tf32` key)
        torch.backends.cuda.matmul.allow_tf32 = False
        return torch.device("cuda")
    if os.environ.get("AGRPO_GPU_DRY_RUN") == "1":
        return torch.device("cpu")
    pytest.skip(f"{NO_GPU}: bash scripts/gpu_check.sh runs these there (--dry-run: on this CPU)")


def report(test: str, **values) -> None:
    """One measured record for the GPU check's results (and the test's own output)."""
    record = {"test": test, **values}
    print(json.dumps(record))
    path = os.environ.get("AGRPO_GPU_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def tokenizer_folder() -> str:
    path = os.environ.get("AGRPO_TOKENIZER_DIR")
    if path:
        return path
    from lib.models.embedded import embedded_model_path

    return str(embedded_model_path())


@pytest.fixture(scope="module")
def small_model(tmp_path_factory) -> str:
    """A three-block Qwen2 with random weights (vocabulary 4,096), saved as a model folder."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("small_qwen2")
    config = Qwen2Config(**SMALL, vocab_size=4096, bos_token_id=None, eos_token_id=2, pad_token_id=0)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    return str(folder)


def prompts(device, rows: int = 3, length: int = 7, vocab: int = 4096):
    ids = torch.randint(10, vocab, (rows, length), generator=torch.Generator().manual_seed(1)).to(device)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # one left-padded prompt
    return ids, mask


@torch.no_grad()
def teacher_forced_logps(model, roll, autocast) -> torch.Tensor:
    """The sampler's own log-probs of its completions: the decode loop's arithmetic (one prefill per prompt, its
    cache gathered per completion, then one token at a time with the cache, logits in float32), each token's
    log-prob at the temperature it was sampled at. (B, T), 0 past each completion's end."""
    from lib.models.modeling import positions_from_mask
    from lib.sampling.rollout import prefill

    with autocast:
        logits, cache = prefill(model, roll.prompt_ids, roll.prompt_mask)
        logits = logits[roll.prompt_index]
        cache.reorder_cache(roll.prompt_index)
        attention = roll.prompt_mask[roll.prompt_index]
        position = positions_from_mask(roll.prompt_mask)[:, -1][roll.prompt_index] + 1
        out = torch.zeros(roll.completion_ids.shape, dtype=torch.float32, device=roll.completion_ids.device)
        for t in range(roll.completion_ids.shape[1]):
            temps = roll.temperatures[:, t].clamp(min=1e-6)
            token = roll.completion_ids[:, t]
            out[:, t] = torch.log_softmax(logits / temps[:, None], -1).gather(1, token[:, None])[:, 0]
            attention = torch.cat([attention, torch.ones_like(attention[:, :1])], 1)
            step = model(input_ids=token[:, None], attention_mask=attention, position_ids=position[:, None],
                         past_key_values=cache, use_cache=True)
            logits = step.logits[:, -1].float()
            position = position + 1
    return out * roll.completion_mask


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_the_samplers_logps_equal_the_scorers(device, small_model, bf16):
    """The tokens the HF sampler draws are scored by the trainer with another kernel path (a full forward with the
    shared prompt prefix, not one token at a time with a cache). In fp32 the two agree to rounding; in bf16 (the
    sampler's bf16 copy against the fp32 master weights under autocast) they may differ by bf16 rounding only: no
    more than the scorer's own bf16 results differ from fp32."""
    from lib.models.modeling import CompletionScorer, load_policy
    from lib.sampling.policy_copy import make_copy
    from lib.sampling.rollout import HFRollout

    policy = load_policy(small_model, device=device).eval()
    engine = HFRollout(policy, [2], 0, bf16=bf16, seed=3, copy=make_copy)
    ids, mask = prompts(device)
    roll = engine.generate(ids, mask, 4, 32, temperature=torch.tensor([0.7, 1.0, 1.3], device=device))
    assert int(roll.completion_mask.sum()) > 40
    sampler = teacher_forced_logps(engine.model, roll, engine.autocast())
    args = (roll.prompt_ids, roll.prompt_mask, roll.prompt_index, roll.completion_ids, roll.completion_mask,
            roll.temperatures)
    with torch.no_grad():
        exact = CompletionScorer(policy)(*args, with_entropy=False)[0]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            scorer = CompletionScorer(policy)(*args, with_entropy=False)[0]
    on = roll.completion_mask.bool()
    gap = (sampler - scorer)[on].abs()
    scorer_rounding = (scorer - exact)[on].abs()
    report(f"sampler_vs_scorer_{'bf16' if bf16 else 'fp32'}", device=str(device), tokens=int(on.sum()),
           max_gap=float(gap.max()), mean_gap=float(gap.mean()),
           scorer_bf16_vs_fp32_mean=float(scorer_rounding.mean()))
    if not bf16:
        assert float(gap.max()) < 1e-4 * max(1.0, float(exact[on].abs().max()))
    else:
        # the sampler's bf16 copy (every weight rounded) against autocast (products in bf16, the rest in fp32)
        assert float(gap.mean()) < 4 * float(scorer_rounding.mean()) + 1e-3
        assert float(gap.max()) < 0.25


def test_a_sampler_process_samples_what_the_in_process_sampler_samples(device, small_model):
    """sampler_device (docs/async.md 8) on this device: the child samples from the trainer's bf16 copy, shared
    through CUDA's inter-process handles (a CPU: shared memory, and a prepacked copy of the child's own), and draws the
    in-process HF sampler's tokens and log-probs at the same seed, before and after a push of moved weights."""
    from functools import partial

    from lib.models.modeling import load_policy
    from lib.sampling.cpu_kernels import sampling_copy
    from lib.sampling.rollout import HFRollout
    from lib.sampling.sampler_process import ProcessRollout

    policy = load_policy(small_model, device=device).eval()
    here = HFRollout(policy, [2], 0, bf16=True, seed=3, copy=partial(sampling_copy, own_copy=True))
    there = ProcessRollout(policy, [2], 0, bf16=True, seed=3, device=str(device))
    try:
        here.record_logps = there.record_logps = True
        ids, mask = prompts(device)
        for _ in range(2):
            a, b = (engine.generate(ids, mask, 4, 32, temperature=1.0) for engine in (here, there))
            assert b.completion_ids.device == ids.device and int(b.completion_mask.sum()) > 40
            assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.sampling_logps, b.sampling_logps)
            with torch.no_grad():
                for param in policy.parameters():
                    param.add_(0.05 * torch.randn_like(param))
            here.sync_weights(policy)
            there.sync_weights(policy)
        report("sampler_process", device=str(device), tokens=int(b.completion_mask.sum()),
               own_copy=there.info["own_copy"])
    finally:
        there.close()
    assert there.process.exitcode == 0


@torch.no_grad()
def test_the_written_out_decode_step_against_the_models_forward(device, small_model):
    """lib/sampling/decode.LlamaStep (the sampler's decode step for a Llama-family copy) against the model's own forward over
    transformers' cache, teacher-forced on the same tokens, on the bf16 copy: bit for bit on a CPU
    (tests/test_rollout.py); on CUDA the step attends over grouped keys and values without repeating them (bf16
    scores upcast, as transformers' eager attention) where the model attends with SDPA, so the logits may differ by
    bf16 rounding, and the figure is reported."""
    from lib.sampling.decode import LlamaStep, llama_family
    from lib.models.modeling import load_policy
    from lib.sampling.policy_copy import make_copy
    from lib.sampling.rollout import HFRollout, ModelStep, prefill

    engine = HFRollout(load_policy(small_model, device=device).eval(), [2], 0, bf16=True, seed=3, copy=make_copy)
    model = engine.model
    assert llama_family(model)
    ids, mask = prompts(device)
    steps = []
    for make in (lambda c: ModelStep(model, c, mask), lambda c: LlamaStep(model, c, mask, 64, block=16)):
        _, cache = prefill(model, ids, mask)
        steps.append(make(cache))
    tokens = torch.randint(10, 4096, (3, 64), generator=torch.Generator().manual_seed(2)).to(device)
    positions, gaps, scale = mask.sum(-1), [], 0.0
    for t in range(64):
        reference, ours = (s.step(tokens[:, t], positions) for s in steps)
        gaps.append(float((ours - reference).abs().max()))
        scale = max(scale, float(reference.abs().max()))
        positions = positions + 1
    report("decode_step_written_out_vs_forward", device=str(device), max_gap=max(gaps), logit_scale=scale,
           bitwise=max(gaps) == 0.0)
    assert max(gaps) < 0.05 * scale


@torch.no_grad()
def test_the_graphed_decode_step_against_the_written_out_one(device, small_model):
    """lib/sampling/decode.GraphStep (the sampler's decode step on CUDA: LlamaStep replayed from CUDA graphs) against
    LlamaStep, teacher-forced on the same tokens through eleven attention windows and a compaction of the rows, on
    the bf16 copy: the same logits (both attend over grouped keys and values without repeating them; bit for bit on
    a CPU, where it runs eagerly: tests/test_rollout.py, tests/test_decode.py); then both sample the same completions
    from one seed, the graphs kept across generate calls (`GraphSteps`: captured once a window, not once a call), and
    the time of a decode step of each, and of the model's forward, is reported (Qwen2.5-0.5B's is
    scripts/bench_sampler.py's). A rope type a graph cannot capture ("dynamic") is refused by GraphStep and decoded
    written out."""
    import time

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lib.sampling.decode import GraphStep, GraphSteps, LlamaStep, decode_step_for
    from lib.models.modeling import load_policy
    from lib.sampling.policy_copy import make_copy
    from lib.sampling.rollout import HFRollout, prefill

    engine = HFRollout(load_policy(small_model, device=device).eval(), [2], 0, bf16=True, seed=3, copy=make_copy)
    model = engine.model
    chosen = decode_step_for(model)
    assert isinstance(chosen, GraphSteps) if device.type == "cuda" else chosen is LlamaStep
    ids, mask = prompts(device)
    steps = []
    for make in (lambda c: LlamaStep(model, c, mask, 80, block=16), lambda c: GraphStep(model, c, mask, 80, block=8)):
        _, cache = prefill(model, ids, mask)
        steps.append(make(cache))
    tokens = torch.randint(10, 4096, (3, 80), generator=torch.Generator().manual_seed(2)).to(device)
    positions, gaps, scale = mask.sum(-1), [], 0.0
    for t in range(79):
        if t == 30:  # the middle row has ended
            rows = torch.tensor([0, 2], device=device)
            for s in steps:
                s.keep(rows)
            tokens, positions = tokens[rows], positions[rows]
        reference, ours = (s.step(tokens[:, t], positions) for s in steps)
        gaps.append(float((ours - reference).abs().max()))
        scale = max(scale, float(reference.abs().max()))
        positions = positions + 1
    assert steps[1].windows == list(range(8, 89, 8))  # every 8 up to the buffers' 7 + 80 rounded up to 8s
    if device.type == "cuda":
        assert sorted(steps[1].graphs) == steps[1].windows and steps[1].captures == 11  # a graph per window
        torch.manual_seed(0)
        dynamic = Qwen2ForCausalLM(Qwen2Config(**{**SMALL, "max_position_embeddings": 16}, vocab_size=4096,
                                               rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                "rope_theta": 10_000.0})).to(device).eval()
        assert decode_step_for(dynamic) is LlamaStep
        _, cache = prefill(dynamic, ids, mask)
        with pytest.raises(ValueError, match="cannot capture"):
            GraphStep(dynamic, cache, mask, 8)
    runs, times, captures = {}, {}, []
    graphs = GraphSteps()  # kept across the calls below, as the sampler keeps it for a run
    for name, step in (("graph", graphs), ("written", LlamaStep), ("model", None)):
        engine.decode_step = step
        for _ in range(2):  # the second is timed (the first warms up kernels and allocations)
            engine.generator.manual_seed(5)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            runs[name] = engine.generate(ids, mask, 4, 200, temperature=1.0)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name] = (time.perf_counter() - t0) / int(runs[name].completion_mask.sum(-1).max())
            if name == "graph":
                captures.append(graphs.steps[12].captures)  # 3 prompts x 4: one step for both calls
    same = (runs["graph"].completion_ids == runs["written"].completion_ids).all(-1) if \
        runs["graph"].completion_ids.shape == runs["written"].completion_ids.shape else torch.tensor([False])
    report("decode_step_graph_vs_written_out", device=str(device), max_gap=max(gaps), logit_scale=scale,
           bitwise=max(gaps) == 0.0, same_completions=f"{int(same.sum())}/{same.numel()}",
           step_ms={name: round(t * 1e3, 3) for name, t in times.items()}, captures_after_each_call=captures)
    if device.type == "cuda":  # the same completions, so the same windows: all captured in the first call
        assert captures[0] == captures[1] == len(graphs.steps[12].graphs) >= 1
    assert max(gaps) < 0.05 * scale
    assert float(same.float().mean()) >= 0.5


@pytest.mark.parametrize("load_in_4bit", [False, True], ids=["lora", "qlora"])
def test_a_merged_adapter_copy_samples_the_policy_and_a_sync_refreshes_it(device, small_model, load_in_4bit):
    """LoRA and QLoRA sample with a plain copy holding W + (alpha/r) B A (a 4-bit base dequantised): its log-probs
    of fixed completions equal the policy's to rounding, go stale when the adapter moves, and equal again after
    sync_weights."""
    if load_in_4bit:
        pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes (scripts/gpu_check.sh carries it)")
    from lib.models.modeling import load_policy
    from lib.sampling.policy_copy import make_copy
    from lib.sampling.rollout import HFRollout

    policy = load_policy(small_model, use_peft=True, lora_r=8, lora_alpha=16, load_in_4bit=load_in_4bit,
                         device=device)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)).to(p.device) * 0.05)
    policy.eval()
    engine = HFRollout(policy, [2], 0, seed=0, copy=make_copy)
    assert engine.copy is not None and not hasattr(engine.copy, "peft_config")
    ids, mask = prompts(device)
    roll = engine.generate(ids, mask, 3, 12, temperature=1.0)

    def logps(model):
        return rollout_logps(model, roll)

    fresh = rel_diff(logps(engine.copy), logps(policy))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_A" in name:
                p.add_(0.05)
    stale = rel_diff(logps(engine.copy), logps(policy))
    engine.sync_weights(policy)
    synced = rel_diff(logps(engine.copy), logps(policy))
    report(f"merged_sync_{'qlora' if load_in_4bit else 'lora'}", device=str(device), fresh=fresh, stale=stale,
           synced=synced)
    assert stale > 1e-3
    assert fresh < 1e-5 and synced < 1e-5


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("load_in_4bit", [False, True], ids=["lora", "qlora"])
def test_an_adapter_policy_decoded_without_a_copy_samples_the_policy(device, small_model, load_in_4bit, bf16):
    """With no room for a copy (headroom 0) the sampler decodes from the policy's own layers (on CUDA from graphs:
    the 4-bit base's dequantisation and the adapter's products inside them; with bf16 under autocast, as the 16 GB
    recipe runs): its log-probs of fixed completions are the merged copy's and the policy's, and after an optimizer
    step, with no sync, the updated policy's; in fp32 it writes the merged copy's greedy tokens."""
    if load_in_4bit:
        pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes (scripts/gpu_check.sh carries it)")
    from functools import partial

    from lib.sampling.policy_copy import DirectDecode, make_copy
    from lib.models.modeling import load_policy
    from lib.sampling.rollout import HFRollout

    policy = load_policy(small_model, use_peft=True, lora_r=8, lora_alpha=16, load_in_4bit=load_in_4bit,
                         device=device)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)).to(p.device) * 0.05)
    # no end token: every row runs to the cap, every position compared
    dense = HFRollout(policy, [-1], 0, bf16=bf16, seed=0, copy=make_copy)
    direct = HFRollout(policy, [-1], 0, bf16=bf16, seed=0, copy=partial(make_copy, headroom=0))
    assert isinstance(direct.sampling_copy, DirectDecode) and direct.copy is None
    ids, mask = prompts(device)
    same_greedy = torch.equal(dense.generate(ids, mask, 1, 12, greedy=True).completion_ids,
                              direct.generate(ids, mask, 1, 12, greedy=True).completion_ids)
    roll = dense.generate(ids, mask, 3, 12, temperature=1.0)
    policy.eval()
    copied = rel_diff(decoded_logps(direct, roll), decoded_logps(dense, roll))
    fresh = rel_diff(decoded_logps(direct, roll), rollout_logps(policy, roll))
    policy.train()
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=0.05)
    tokens = torch.cat([roll.prompt_ids[roll.prompt_index], roll.completion_ids], 1)
    policy(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    policy.eval()
    after = rollout_logps(policy, roll)
    moved = rel_diff(after, decoded_logps(dense, roll))  # the copy, not synced, still has the old adapter
    stepped = rel_diff(decoded_logps(direct, roll), after)
    name = f"direct_decode_{'qlora' if load_in_4bit else 'lora'}{'_bf16' if bf16 else ''}"
    report(name, device=str(device), same_greedy=same_greedy, copied=copied, fresh=fresh, moved=moved,
           stepped=stepped)
    # fp32: two sums of the same products; bf16: its rounding against the bf16 copy and the fp32 scorer
    tolerance = 3e-3 if bf16 else 1e-4  # measured on a CPU: 2e-4 to 3e-4 in bf16, 5e-8 in fp32; moved 0.035-0.04
    assert copied < tolerance and fresh < tolerance and stepped < tolerance
    assert moved > 3 * tolerance
    assert same_greedy or bf16


def run_trainer(args: list[str], cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, str(REPO / "train_agrpo.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def trainer_model(tmp_path_factory, small_model) -> str:
    """The small model with a real tokenizer (vocabulary padded to the model's), for whole training runs."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder())
    torch.manual_seed(0)
    config = Qwen2Config(**SMALL, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    folder = tmp_path_factory.mktemp("trainer_model")
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


# TRL 1.16's newer keys under bf16 on the device (docs/methods.md 1.8-1.12, 2.6, 13): SAPO with both token and
# sequence masks, the adaptive entropy controller, reference updates (saved with each checkpoint) and the fp32 head
ISSUE_39 = ["--bf16", "true", "--loss_type", "sapo", "--top_entropy_quantile", "0.5", "--off_policy_mask_threshold",
            "0.5", "--use_adaptive_entropy", "true", "--entropy_target", "0.5", "--sync_ref_model", "true",
            "--ref_model_sync_steps", "1", "--ref_model_mixup_alpha", "0.6", "--cast_lm_head_to_fp32", "true"]


@pytest.mark.parametrize("extra", [[], ISSUE_39], ids=["default", "trl_1_16_keys_bf16"])
def test_a_run_on_cuda_resumes_its_optimizer_exactly(device, trainer_model, tmp_path, extra):
    """Three steps, and the same run resumed from its checkpoint-2: the optimizer state written from the device is
    read back onto it (torch.load to the CPU first, then onto each parameter's device) and step 3 trains the same;
    then the same with TRL 1.16's newer keys in bf16 (the reference updated each step and restored from the
    checkpoint, the entropy controller's state, the fp32 output layer)."""
    common = ["--model_name_or_path", trainer_model, "--max_steps", "3", "--num_generations", "4",
              "--per_device_train_batch_size", "8", "--max_completion_length", "16", "--builtin_num_train", "32",
              "--num_eval_samples", "0", "--learning_rate", "1e-4", "--temperature", "1.0", "--log_completions",
              "false", "--report_to", "none", "--save_steps", "2", "--reward_funcs", "tests/tiny_rewards.py:characters",
              "--beta", "0.04", "--use_cpu", str(device.type == "cpu").lower(), *extra]
    whole = run_trainer([*common, "--output_dir", str(tmp_path / "whole")], REPO)
    assert whole.returncode == 0, whole.stderr[-4000:]
    import shutil

    shutil.copytree(tmp_path / "whole", tmp_path / "resumed", ignore=shutil.ignore_patterns("checkpoint-3", "final"))
    resumed = run_trainer([*common, "--output_dir", str(tmp_path / "resumed"), "--resume_from_checkpoint",
                           "latest"], REPO)
    assert resumed.returncode == 0, resumed.stderr[-4000:]

    def step3(folder):
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        return [r for r in rows if r.get("step") == 3][-1]

    a, b = step3(tmp_path / "whole"), step3(tmp_path / "resumed")
    report("resume_on_device" + ("_trl_1_16_keys_bf16" if extra else ""), device=str(device), loss=[a["loss"], b["loss"]], grad_norm=[a["grad_norm"],
           b["grad_norm"]], num_tokens=[a["num_tokens"], b["num_tokens"]])
    assert a["num_tokens"] == b["num_tokens"]  # the same completions sampled at step 3
    # CUDA's embedding backward sums with atomics (run-to-run rounding); everything else is the same arithmetic
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-3, abs=1e-7)


MEMORY_SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
import train_agrpo

argv = json.loads(sys.argv[2])
estimate = train_agrpo.main(argv + ["--estimate_memory_only", "true"])["estimated_peak_bytes"]
if torch.cuda.is_available():
    torch.cuda.reset_peak_memory_stats()
train_agrpo.main(argv)
out = {"estimate": estimate}
if torch.cuda.is_available():
    free, total = torch.cuda.mem_get_info()
    out.update(max_allocated=torch.cuda.max_memory_allocated(), max_reserved=torch.cuda.max_memory_reserved(),
               reserved_now=torch.cuda.memory_reserved(), device_used_now=total - free, total=total)
print("MEMORY" + json.dumps(out))
"""


def test_the_memory_estimate_against_the_measured_peak(device, tmp_path):
    """`--estimate_memory_only` (what a user planning a GPU run gets, by arithmetic) against a real run of the same
    recipe: the allocator's peak (max_memory_reserved, its slack included) plus what the process holds outside it
    (the CUDA context, kernels' workspaces: mem_get_info's used bytes less the allocator's reserved ones). A 0.5B
    shape (random weights) with G 8 x 256 tokens, full fine-tuning under bf16; on the CPU dry run a tiny shape."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    cuda = device.type == "cuda"
    shape = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                 tie_word_embeddings=True) if cuda else SMALL
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder())
    config = Qwen2Config(**shape, vocab_size=151936 if cuda else len(tokenizer), bos_token_id=None,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    del model
    argv = ["--model_name_or_path", str(tmp_path / "model"), "--max_steps", "2", "--num_generations", "8",
            "--per_device_train_batch_size", "8", "--max_completion_length", "256" if cuda else "16",
            "--builtin_num_train", "32", "--num_eval_samples", "0", "--log_completions", "false",
            "--report_to", "none", "--save_strategy", "no", "--output_dir", str(tmp_path / "run"),
            "--max_memory", "80", "--use_vllm", "false", "--use_cpu", str(not cuda).lower()]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(REPO), json.dumps(argv)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    measured = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("MEMORY"))[6:])
    if not cuda:
        report("memory_estimate", device="cpu", estimate_gb=measured["estimate"] / 2**30, note="dry run")
        return
    outside = measured["device_used_now"] - measured["reserved_now"]  # context, cuBLAS workspaces, NCCL
    peak = measured["max_reserved"] + outside
    report("memory_estimate", device=torch.cuda.get_device_name(), estimate_gb=measured["estimate"] / 2**30,
           max_allocated_gb=measured["max_allocated"] / 2**30, max_reserved_gb=measured["max_reserved"] / 2**30,
           outside_allocator_gb=outside / 2**30, measured_peak_gb=peak / 2**30, ratio=measured["estimate"] / peak)
    # the estimate is what the guard refuses runs by: it must not promise a fit that the device does not give
    # (at least 0.9x the measured peak), nor refuse runs that fit by a wide margin (at most 1.6x)
    assert 0.9 < measured["estimate"] / peak < 1.6


@pytest.mark.ci_may_skip("this vLLM has no bitsandbytes quantization")  # no installation adds it to vLLM 0.32
def test_a_4bit_policys_vllm_engine_holds_a_4bit_base_and_samples_the_policy(device, small_model, tmp_path):
    """A QLoRA policy's colocated engine (lib/sampling/vllm_rollout.colocated_rollout's choice, engine_quantization):
    started with bitsandbytes quantization where vLLM has it, given the adapter only, its sampling log-probs close to
    the scorer's on the policy (both NF4 of the same checkpoint). Skips where the installed vLLM has no bitsandbytes
    (0.32 removed it: the engine then holds a 16-bit base)."""
    pytest.importorskip("vllm")
    from lib.sampling.vllm_rollout import VLLMRollout, engine_quantization, vllm_quantization_methods
    from lib.models.modeling import CompletionScorer, load_policy

    quantization = engine_quantization(True, vllm_quantization_methods())
    if quantization is None or device.type != "cuda":
        pytest.skip("this vLLM has no bitsandbytes quantization (or no GPU): a 4-bit policy's engine is 16-bit")
    policy = load_policy(small_model, device=device, use_peft=True, load_in_4bit=True, lora_r=8,
                         dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    engine = VLLMRollout(small_model, [2], 0, max_model_len=64, gpu_memory_utilization=0.2, dtype="bfloat16",
                         lora_rank=8, quantization=quantization, max_num_seqs=12)
    try:
        assert engine.base_loaded  # nothing but the adapter is sent to a quantised engine
        engine.sync_weights(policy)
        ids, mask = prompts(device)
        roll = engine.generate(ids, mask, 4, 16)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            scorer = CompletionScorer(policy)(roll.prompt_ids, roll.prompt_mask, roll.prompt_index,
                                              roll.completion_ids, roll.completion_mask, roll.temperatures,
                                              with_entropy=False)[0]
        on = roll.completion_mask.bool()
        gap = (roll.sampling_logps - scorer)[on].abs()
        report("vllm_bnb_engine_vs_scorer", tokens=int(on.sum()), mean_gap=float(gap.mean()),
               max_gap=float(gap.max()))
        assert float(gap.mean()) < 0.05  # bf16 rounding of two kernels over the same NF4 weights
    finally:
        engine.close()


@pytest.mark.ci_may_skip("the cap is a CUDA allocator setting")  # the dry run on a CPU has no allocator to cap
def test_max_memory_caps_the_process_so_that_going_over_is_an_out_of_memory(device):
    """lib/sharding/memory.cap_process_memory: under a 2 GB cap an allocation past it raises torch's OutOfMemoryError
    on a card with far more memory, one within it succeeds; the fraction is reset afterwards."""
    from lib.sharding.memory import GB, cap_process_memory

    if device.type != "cuda":
        pytest.skip("the cap is a CUDA allocator setting")
    try:
        fraction = cap_process_memory(device, 2.0)
        total = torch.cuda.mem_get_info(device)[1]
        report("max_memory_cap", fraction=fraction, allocator_gb=fraction * total / GB)
        kept = torch.empty(GB // 2, dtype=torch.uint8, device=device)  # within the cap
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(2 * GB, dtype=torch.uint8, device=device)
        del kept
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.empty_cache()
