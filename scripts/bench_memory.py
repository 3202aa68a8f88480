"""Memory of one GRPO step of the 16 GB QLoRA recipe at real model shapes, by part, against lib/sharding/memory.py's estimate.

    python scripts/bench_memory.py --shape qwen2-tiny --lengths 64             # a quick check of the script (~1 min)
    python scripts/bench_memory.py --shape qwen2.5-1.5b --lengths 1024 --json 1.5b-1024.json
    python scripts/bench_memory.py --shape qwen2.5-3b --lengths 1024 2048 --json 3b.json

The model is built from its published config (scripts/bench_vs_trl.SHAPES) with random weights, saved in bf16 (as
the published checkpoints are) to a temporary folder, and loaded through the trainer's own path,
lib/models/modeling.load_policy, with the settings of scripts/recipes/grpo_gsm8k_qlora_16gb.yaml (NF4 base with nested
quantisation, LoRA r 16 / alpha 32 / dropout 0.05 on every linear layer, gradient checkpointing, the trainer's
default float32 weights dtype; the recipe's bf16 is bf16 autocast, used where lib/models/modeling.native_bf16 says the CPU
runs it). Then, in that process:

  weights        the resident set after load_policy, less the one before; and the bytes of the model's tensors
  sampler copy   lib/sampling/policy_copy's plain bf16 copy with the adapter merged (resident in the trainer too)
  KV cache       the sampler's cache for the generation batch (per_device_train_batch_size x
                 gradient_accumulation_steps completions, each with its prompt): the prompt and completion, full
                 length, prefilled at once through the sampler's copy with lib/sampling/rollout.prefill (use_cache), and the
                 resident set with the cache held. Decoding 1,024 tokens one at a time would take hours on a CPU; the
                 cache a prefill leaves is the one the decode loop ends with (the same rows, positions and dtype).
  reference      the no-grad reference pass (beta > 0: the policy with its adapter disabled), its peak
  training step  one micro-batch: G completions of one prompt, every completion forced to full length (random
                 token ids: memory does not depend on the values), scored by lib/models/modeling.CompletionScorer under
                 bf16 autocast, lib/losses' clipped surrogate, k3 KL and grpo aggregation, backward, gradient
                 clipping and one step of lib/setup.build_optimizer's AdamW. The peak is read in three phases: the
                 decoder's forward (activations), the vocabulary chunks' forward and backward (logits), the decoder's
                 backward (the checkpointed blocks recomputed one at a time); then the gradients held after backward
                 and the optimizer states after the step.
  logits chunk   token_logps_and_entropy alone on two chunks' rows (its recomputing path, as in the step)

How: each configuration runs in a fresh child process with glibc's mmap threshold fixed at 64 KiB
(MALLOC_MMAP_THRESHOLD_), so a freed tensor leaves the resident set at once (tests/test_memory.py measures the same
way). "5" written to /proc/self/clear_refs restarts the kernel's high-water mark (VmHWM in /proc/self/status) at the
current resident set, so one process reads the peak of each phase. Each child first checks the method on a tensor
of known size (256 MiB): its peak and resident deltas are printed with the results.

The estimate is lib/sharding/memory.estimate_step_memory with what the trainer passes it (step_token_counts of the recipe's
configuration at this length, bf16, the optimizer); its `resident` is measured in the trainer, so the weights row
compares the measured resident set with the bytes of the model's tensors instead. This is a CPU measurement: what a
GPU adds (the CUDA context, the caching allocator's slack, cuBLAS workspaces, bitsandbytes' CUDA kernels' own
buffers) is not in it (docs/performance.md 3.3).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts.bench_vs_trl import SHAPES  # noqa: E402  (the published Qwen2.5 shapes)

RECIPE = ROOT / "scripts" / "recipes" / "grpo_gsm8k_qlora_16gb.yaml"
GB = 2**30
# the rows of the table: (key, label); each configuration's result has {key: {"estimate": bytes or None,
# "measured": bytes}}
ROWS = [
    ("weights", "weights: policy after load (4-bit base, fp32 rest, LoRA)"),
    ("sampler_copy", "weights: the sampler's merged bf16 copy"),
    ("gradients", "gradients (LoRA, fp32)"),
    ("optimizer", "optimizer states (AdamW)"),
    ("kept", "activations kept from forward to backward"),
    ("activations", "activations: peak of the decoder's forward / backward"),
    ("logits", "logits chunk (in the step)"),
    ("logits_alone", "logits chunk (alone)"),
    ("activations_logits", "training pass: activations and logits chunk, the forward+backward peak"),
    ("reference", "reference pass (no grad): peak"),
    ("kv_cache", "sampling KV cache (held)"),
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b",
                   help="Model shape (random weights), from scripts/bench_vs_trl.py's SHAPES.")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048],
                   help="max_completion_length values, one child process each; every completion runs to it.")
    p.add_argument("--max_prompt_length", type=int, default=None, help="Default: the recipe's (256).")
    p.add_argument("--recipe", default=str(RECIPE), help="The YAML recipe whose settings are measured.")
    p.add_argument("--bf16", choices=["auto", "true", "false"], default="auto",
                   help="bf16 autocast (auto: where lib/models/modeling.native_bf16 says the CPU runs bf16 natively).")
    p.add_argument("--dtype", choices=["gpu", "cpu", "bfloat16", "float32"], default="gpu",
                   help="The dtype load_policy gets, which is the 4-bit layers' compute dtype: gpu (default) the "
                   "trainer's choice on a bf16 GPU (lib/models/modeling.weights_dtype: bfloat16 for a LoRA base where bf16 is "
                   "on), cpu the trainer's choice on a CPU (float32), or one named.")
    p.add_argument("--no_kv", action="store_true", help="Leave out the KV-cache prefill (the longest part after "
                   "the step).")
    p.add_argument("--kv_rows", type=int, help="Prefill this many rows instead of the whole generation batch and "
                   "scale the cache to it (each row's keys and values are its own, so it scales exactly); the "
                   "prefill is the longest part after the step.")
    p.add_argument("--no_reference", action="store_true", help="Leave out the no-grad reference pass.")
    p.add_argument("--model_dir", help="Keep the random-weight model folders here (default: a temporary folder, "
                   "removed at the end).")
    p.add_argument("--json", help="Write every configuration's numbers here.")
    p.add_argument("--table", nargs="+", metavar="JSON", help="Print the tables of results written by --json "
                   "before, with the estimates as lib/sharding/memory.py computes them now, and exit.")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one configuration in a child process
    p.add_argument("--build", nargs=2, help=argparse.SUPPRESS)  # internal: SHAPE FOLDER, build a model there
    return p


# ---- measuring, in the child --------------------------------------------------------------------------------------


def resident() -> int:
    """The resident set now, after a garbage collection."""
    import torch

    from lib.sharding.memory import resident_bytes

    gc.collect()
    return resident_bytes(torch.device("cpu"))


def restart_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def calibrate() -> dict:
    """The method on a tensor whose size is known: 256 MiB of fp32 ones, its peak and resident deltas, and the
    resident set after it is freed."""
    import torch

    size = 256 * 2**20
    before = resident()
    restart_peak()
    tensor = torch.ones(size // 4, dtype=torch.float32)
    held = resident() - before
    del tensor
    return {"bytes": size, "peak": peak() - before, "held": held, "after_free": resident() - before}


def tensor_bytes(module) -> dict:
    """The bytes of a model's tensors, each storage once: 4-bit weights with their quantisation state (absmax,
    nested absmax, code), the other floating-point tensors, and tensors held as plain attributes (the sampler's
    prepacked weights)."""
    import torch

    seen: dict[int, tuple[str, int]] = {}

    def add(tensor, kind):
        if isinstance(tensor, torch.Tensor) and tensor.numel():
            try:
                storage = tensor.untyped_storage()
                seen.setdefault(storage.data_ptr(), (kind, storage.nbytes()))
            except NotImplementedError:  # oneDNN's prepacked weight: no storage to read, its logical size
                seen.setdefault(id(tensor), (kind, tensor.numel() * tensor.element_size()))

    for tensor in itertools.chain(module.parameters(), module.buffers()):
        quant = getattr(tensor, "quant_state", None)
        kind = "4bit" if quant is not None else ("trainable" if tensor.requires_grad else "other")
        add(tensor, kind)
        states = [quant, getattr(quant, "state2", None)] if quant is not None else []
        for state in filter(None, states):
            for value in vars(state).values():
                add(value, "4bit")
    for sub in module.modules():
        for value in vars(sub).values():
            add(value, "other")
    out = {"4bit": 0, "trainable": 0, "other": 0}
    for kind, nbytes in seen.values():
        out[kind] += nbytes
    out["total"] = sum(out.values())
    return out


def build_model(shape: str, folder: str) -> None:
    """A Qwen2 model of `shape` with random weights, saved in bf16 (no tokenizer: none is needed)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**SHAPES[shape], bos_token_id=None, eos_token_id=2, pad_token_id=2)
    model = Qwen2ForCausalLM._from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)


def run_worker(spec: dict) -> dict:
    import torch
    from accelerate import Accelerator

    from lib.config import load_yaml, make_config
    from lib.methods.losses import aggregate_loss, clipped_surrogate, kl_penalty, token_logps_and_entropy
    from lib.sharding.memory import CHUNK_ELEMENTS, estimate_step_memory, step_token_counts
    from lib.models.modeling import (CompletionScorer, OutputHead, adapter_disabled, load_policy, native_bf16,
                              unwrap_causal_lm, weights_dtype)
    from lib.models import checkpointed_prefix
    from lib.sampling import cpu_kernels
    from lib import trl_keys
    from lib.sampling.rollout import HFRollout, prefill
    from lib.setup import build_optimizer

    clock = time.perf_counter()

    def say(what: str) -> None:  # progress, to the parent's output
        print(f"    [{time.perf_counter() - clock:6.0f} s] {what}", flush=True)

    out: dict = {"shape": spec["shape"], "calibration": calibrate(), "seconds": {}, "parts": {}}
    length = spec["max_completion_length"]
    values = {**load_yaml(spec["recipe"]), "model_name_or_path": spec["model"], "max_completion_length": length}
    if spec["max_prompt_length"]:
        values["max_prompt_length"] = spec["max_prompt_length"]
    cfg = make_config(values, keys=trl_keys.resolve_keys)
    bf16 = native_bf16("cpu") if spec["bf16"] == "auto" else spec["bf16"] == "true"
    accelerator = Accelerator(cpu=True, mixed_precision="bf16" if bf16 else "no")  # as lib/setup.py
    if spec["dtype"] in ("gpu", "cpu"):
        dtype = weights_dtype(cfg.dtype, lora=cfg.use_peft, device="cuda" if spec["dtype"] == "gpu" else "cpu",
                              bf16=bf16)
    else:
        dtype = getattr(torch, spec["dtype"])
    prompt_length, batch, group = cfg.max_prompt_length, cfg.per_device_train_batch_size, cfg.num_generations
    out["settings"] = {"max_completion_length": length, "max_prompt_length": prompt_length,
                       "per_device_train_batch_size": batch, "num_generations": group,
                       "gradient_accumulation_steps": cfg.gradient_accumulation_steps, "bf16": bf16,
                       "dtype": str(dtype), "optim": cfg.optim, "beta": cfg.beta,
                       "lora_r": cfg.lora_r, "lora_alpha": cfg.lora_alpha,
                       "lora_dropout": cfg.lora_dropout, "threads": torch.get_num_threads()}
    parts = out["parts"]

    say("loading the policy")
    # the policy, as lib/setup.py loads it
    t0 = time.perf_counter()
    before = resident()
    restart_peak()
    policy = load_policy(spec["model"], dtype=dtype, use_peft=cfg.use_peft, lora_r=cfg.lora_r,
                         lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                         lora_target_modules=cfg.lora_target_modules, use_rslora=cfg.use_rslora,
                         load_in_4bit=cfg.load_in_4bit, bnb_4bit_quant_type=cfg.bnb_4bit_quant_type,
                         use_bnb_nested_quant=cfg.use_bnb_nested_quant,
                         gradient_checkpointing=cfg.gradient_checkpointing,
                         gradient_checkpointing_kwargs=cfg.gradient_checkpointing_kwargs, device="cpu")
    if cfg.disable_dropout:
        for module in policy.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    loaded = resident()
    tensors = tensor_bytes(policy)
    parts["weights"] = {"estimate": tensors["total"], "measured": loaded - before, "peak": peak() - before,
                        "tensors": tensors}
    out["seconds"]["load"] = time.perf_counter() - t0
    lm = unwrap_causal_lm(policy)
    config = lm.config
    vocab = config.vocab_size

    say("the sampler's copy")
    # the sampler's copy and its KV cache
    t0 = time.perf_counter()
    before = resident()
    restart_peak()
    engine = HFRollout(policy, [config.eos_token_id], config.pad_token_id, bf16=bf16, seed=cfg.seed,
                       copy=cpu_kernels.sampling_copy)
    copy_bytes = tensor_bytes(engine.copy)["total"] if engine.copy is not None else 0
    parts["sampler_copy"] = {"estimate": copy_bytes, "measured": resident() - before, "peak": peak() - before}
    out["seconds"]["sampler_copy"] = time.perf_counter() - t0
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, cfg.optim, cfg.learning_rate, (cfg.adam_beta1, cfg.adam_beta2),
                                cfg.weight_decay, eps=cfg.adam_epsilon)
    counts = step_token_counts(cfg)
    # what train_agrpo.setup estimates (lib/sharding/memory.check_run): after the policy and the sampler are loaded
    estimate = estimate_step_memory(policy, resident=resident(), optim=cfg.optim, bf16=bf16, vllm=False,
                                    gradient_checkpointing=cfg.gradient_checkpointing, **counts)
    out["estimate"] = {k: getattr(estimate, k) for k in ("resident", "gradients", "optimizer", "activations",
                                                          "logits", "kv_cache")}
    out["estimate"]["total"] = estimate.total
    out["tokens"] = dict(counts)
    generator = torch.Generator().manual_seed(0)
    if not spec["no_kv"]:
        say("the KV cache's prefill")
        t0 = time.perf_counter()
        rows = batch * cfg.gradient_accumulation_steps  # the generation batch, one generate call
        run_rows = min(spec.get("kv_rows") or rows, rows)
        scale = rows / run_rows
        ids = torch.randint(vocab, (run_rows, prompt_length + length), generator=generator)
        with torch.no_grad(), engine.autocast():
            before = resident()
            restart_peak()
            logits, cache = prefill(engine.model, ids, torch.ones_like(ids))
            cache_tensors = sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values))
            held = resident() - before - logits.nbytes
            parts["kv_cache"] = {"estimate": estimate.kv_cache, "measured": int(held * scale),
                                 "peak": int((peak() - before) * scale), "tensors": int(cache_tensors * scale),
                                 "rows": rows, "rows_prefilled": run_rows, "dtype": str(cache.layers[0].keys.dtype)}
            del logits, cache
        out["seconds"]["kv_prefill"] = time.perf_counter() - t0
    del engine
    gc.collect()

    # one training micro-batch: one prompt, G completions at full length
    prompt_ids = torch.randint(vocab, (1, prompt_length), generator=generator)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_index = torch.zeros(batch, dtype=torch.long)
    completion_ids = torch.randint(vocab, (batch, length), generator=generator)
    completion_mask = torch.ones_like(completion_ids)
    temperatures = torch.full((batch,), cfg.temperature)
    advantages = torch.randn(batch, generator=generator)
    scorer = CompletionScorer(policy, checkpointed_prefix=checkpointed_prefix)  # as the trainer's
    decoder = lm.get_decoder()
    positions = []  # token positions each decoder call ran (shared prompt prefix or whole sequences)
    decoder.register_forward_pre_hook(
        lambda module, args, kwargs: positions.append(int(kwargs["input_ids"].numel())), with_kwargs=True)

    ref_logp = None
    if cfg.beta > 0 and not spec["no_reference"]:
        say("the reference pass")
        t0 = time.perf_counter()
        policy.eval()  # as in train_agrpo.reference_and_old_logps: after sampling, the policy in eval mode
        before = resident()
        restart_peak()
        with torch.no_grad(), accelerator.autocast(), adapter_disabled(policy):
            ref_logp, _ = scorer(prompt_ids, prompt_mask, prompt_index, completion_ids, completion_mask,
                                 temperatures, with_entropy=False)
        parts["reference"] = {"estimate": None, "measured": peak() - before}
        out["seconds"]["reference"] = time.perf_counter() - t0
    if ref_logp is None:
        ref_logp = torch.zeros(batch, length)
    positions.clear()

    policy.train()
    # a one-token forward and backward first, so that what the first pass allocates for good (thread pools, kernel
    # caches) is not counted with the step's parts
    one = torch.ones(1, 1, dtype=torch.long)
    with accelerator.autocast():
        logp, _ = scorer(one, one, torch.zeros(1, dtype=torch.long), one, one, torch.ones(1))
    logp.sum().backward()
    del logp, _
    optimizer.zero_grad(set_to_none=True)
    positions.clear()

    t0 = time.perf_counter()
    marks: dict = {"decoder_forward": 0, "kept": None, "logits": None, "hidden_dtype": None}

    def after_decoder(module, args, output):  # each decoder call's end: its forward peak, then a fresh mark
        marks["decoder_forward"] = max(marks["decoder_forward"], peak())
        marks["hidden_dtype"] = str(output.last_hidden_state.dtype)
        if torch.is_grad_enabled() and output.last_hidden_state.requires_grad:
            output.last_hidden_state.register_hook(after_logits)
        restart_peak()

    def after_logits(grad):  # the decoder output's gradient: every vocabulary chunk's backward is done
        if marks["logits"] is None:
            marks["logits"] = peak()
            restart_peak()

    handle = decoder.register_forward_hook(after_decoder)
    say("the training step")
    base = resident()
    restart_peak()
    with accelerator.autocast():
        logp, entropy = scorer(prompt_ids, prompt_mask, prompt_index, completion_ids, completion_mask,
                               temperatures, entropy_grad=cfg.eta > 0)
    handle.remove()  # the backward's recomputation calls the blocks, not the decoder
    marks["kept"] = resident() - base  # saved for backward (no logits: the chunks recompute theirs)
    logits_forward = peak()
    epsilon_high = cfg.epsilon_high if cfg.epsilon_high is not None else cfg.epsilon
    per_token, _ = clipped_surrogate(logp, logp.detach(), advantages, completion_mask.float(), cfg.epsilon,
                                     epsilon_high, cfg.importance_sampling_level, dual_clip=cfg.dual_clip)
    if cfg.beta > 0:
        per_token = per_token + cfg.beta * kl_penalty(logp, ref_logp, cfg.kl_estimator)
    loss = aggregate_loss(per_token, completion_mask.float(), cfg.loss_type,
                          global_num_sequences=batch * cfg.gradient_accumulation_steps,
                          global_num_tokens=completion_mask.sum() * cfg.gradient_accumulation_steps,
                          max_completion_length=length, gradient_accumulation_steps=cfg.gradient_accumulation_steps)
    forward_seconds = time.perf_counter() - t0
    say("backward")
    accelerator.backward(loss)
    decoder_backward = peak()
    del logp, entropy, per_token, loss
    grads = resident() - base
    grad_tensors = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    out["seconds"]["forward"] = forward_seconds
    out["seconds"]["backward"] = time.perf_counter() - t0 - forward_seconds
    t0 = time.perf_counter()
    torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
    optimizer.step()
    states = resident() - base - grads
    optimizer.zero_grad(set_to_none=True)
    out["seconds"]["optimizer"] = time.perf_counter() - t0
    logits_peak = max(marks["logits"] or 0, logits_forward)
    activations = max(marks["decoder_forward"], decoder_backward) - base
    # the resident set's growth over the step, and the bytes of the .grad tensors themselves: on this CPU the first
    # grew ~20 MB more than the second at both shapes (what the libraries keep after a first backward, oneDNN's
    # primitive caches and scratchpads among them; a GPU's counterpart is in lib/sharding/memory.GPU_OVERHEAD)
    parts["gradients"] = {"estimate": estimate.gradients, "measured": grads, "grad_tensors": grad_tensors}
    parts["optimizer"] = {"estimate": estimate.optimizer, "measured": states}
    # without checkpointing every block's set; with it, the block inputs
    kept = estimate.activations if estimate.kept is None else estimate.kept
    parts["kept"] = {"estimate": kept, "measured": marks["kept"]}
    parts["activations"] = {"estimate": estimate.activations, "measured": activations,
                            "decoder_forward": marks["decoder_forward"] - base,
                            "decoder_backward": decoder_backward - base}
    # the chunk's own share: the vocabulary phase's peak over what the forward kept
    parts["logits"] = {"estimate": estimate.logits, "measured": logits_peak - base - marks["kept"]}
    parts["activations_logits"] = {"estimate": estimate.training,
                                   "measured": max(activations, logits_peak - base)}
    out["scored_positions"] = sum(positions)
    out["hidden_dtype"] = marks["hidden_dtype"]

    say("a logits chunk alone")
    # one logits chunk alone: two chunks' rows through the model's output head (the recomputing path of the step)
    t0 = time.perf_counter()
    rows = 2 * max(1, CHUNK_ELEMENTS // vocab)
    dtype = getattr(torch, marks["hidden_dtype"].split(".")[-1])
    hidden = torch.randn(rows, config.hidden_size, generator=generator).to(dtype).requires_grad_(True)
    ids = torch.randint(vocab, (rows,), generator=generator)
    before = resident()
    restart_peak()
    with accelerator.autocast():
        logp, entropy = token_logps_and_entropy(hidden, OutputHead(lm), ids, torch.ones(rows))
    logp.sum().backward()
    chunk_estimate = estimate_step_memory(policy, resident=0, optim=cfg.optim, tokens_per_micro_batch=rows,
                                          sampling_tokens=0, gradient_checkpointing=cfg.gradient_checkpointing,
                                          bf16=bf16).logits  # one chunk: the estimate at these rows
    parts["logits_alone"] = {"estimate": chunk_estimate, "measured": peak() - before, "rows": rows // 2}
    out["seconds"]["logits_alone"] = time.perf_counter() - t0
    out["seconds"]["total"] = time.perf_counter() - clock
    return out


# ---- the parent: one child per configuration, the table -----------------------------------------------------------


def gb(value) -> str:
    return "" if value is None else f"{value / GB:.2f}"


def current_estimates(result: dict) -> dict[str, dict[str, int]]:
    """lib/sharding/memory's estimate of each row for a result's shape and settings, computed now (so that a result measured
    before a change of the formula is compared with the formula as it is): on a meta-device model of the shape with
    the recipe's adapter, as lib/sharding/memory.recipe_memory builds it, at the micro-batch's counted tokens ("counted") and at
    the token positions the scorer ran ("ran"), with a CPU's dropout masks; "gpu": the counted tokens with CUDA's."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lib.sharding.memory import CHUNK_ELEMENTS, activation_bytes, estimate_step_memory

    s = result["settings"]
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPES[result["shape"]]))
    model = get_peft_model(model, LoraConfig(r=s.get("lora_r", 16), lora_alpha=s.get("lora_alpha", 32),
                                             lora_dropout=s["lora_dropout"], target_modules="all-linear",
                                             task_type="CAUSAL_LM"))
    config = model.get_base_model().config
    out = {}
    for name, tokens, device in (("counted", result["tokens"]["tokens_per_micro_batch"], "cpu"),
                                 ("ran", result["scored_positions"], "cpu"),
                                 ("gpu", result["tokens"]["tokens_per_micro_batch"], "cuda")):
        options = dict(resident=0, optim=s["optim"], sampling_tokens=result["tokens"]["sampling_tokens"],
                       gradient_checkpointing=True, bf16=s["bf16"], load_in_4bit=True, device_type=device)
        e = estimate_step_memory(model, tokens_per_micro_batch=tokens, **options)
        rows = 2 * max(1, CHUNK_ELEMENTS // config.vocab_size)
        kept = tokens * config.num_hidden_layers * activation_bytes(model, bf16=s["bf16"], load_in_4bit=True,
                                                                    device_type=device)["input"]
        out[name] = {"gradients": e.gradients, "optimizer": e.optimizer, "kept": kept,
                     "activations": e.activations, "logits": e.logits, "activations_logits": e.training,
                     "kv_cache": e.kv_cache,
                     "logits_alone": estimate_step_memory(model, tokens_per_micro_batch=rows, **options).logits}
    return out


def format_result(result: dict) -> str:
    s = result["settings"]
    cal = result["calibration"]
    fresh = current_estimates(result)
    counted, ran = result["tokens"]["tokens_per_micro_batch"], result["scored_positions"]
    lines = [f"\n{result['shape']}: {s['num_generations']} completions x {s['max_completion_length']} tokens of one "
             f"{s['max_prompt_length']}-token prompt a micro-batch (per_device_train_batch_size "
             f"{s['per_device_train_batch_size']}), bf16 autocast {s['bf16']}, weights dtype {s['dtype']}, optim "
             f"{s['optim']}, {s['threads']} threads",
             f"method check: a {cal['bytes'] / 2**20:.0f} MiB tensor read {cal['peak'] / 2**20:.1f} MiB peak, "
             f"{cal['held'] / 2**20:.1f} MiB held, {cal['after_free'] / 2**20:.1f} MiB after it was freed",
             f"token positions: {counted} counted a micro-batch (lib/sharding/memory.step_token_counts), the scorer ran {ran} "
             f"(decoder output {result['hidden_dtype']}); sampling {result['tokens']['sampling_tokens']}",
             "",
             f"| part | estimate at {counted} tokens (GB) | estimate at {ran} (GB) | measured (GB) | "
             f"estimate at {ran} / measured |",
             "|---|---|---|---|---|"]
    for key, label in ROWS:
        part = result["parts"].get(key)
        if part is None:
            continue
        measured = part["measured"]
        if key in fresh["counted"]:
            est_counted, est = fresh["counted"][key], fresh["ran"][key]
        else:  # weights: the bytes of the loaded tensors; the reference pass: not estimated
            est_counted = est = part["estimate"]
        ratio = f"{est / measured:.2f}" if est is not None and measured > 0 else ""
        lines.append(f"| {label} | {gb(est_counted)} | {gb(est)} | {gb(measured)} | {ratio} |")
    e = result["estimate"]
    lines.append(f"\nthe trainer's resident set when it estimates (policy and sampler copy loaded): "
                 f"{gb(e['resident'])} GB; a GPU's estimate of the step (CUDA's byte dropout masks, {counted} "
                 f"tokens): activations {gb(fresh['gpu']['activations'])} GB, logits {gb(fresh['gpu']['logits'])} GB")
    grad = result["parts"].get("gradients", {})
    if "grad_tensors" in grad:
        lines.append(f"gradients: the .grad tensors hold {gb(grad['grad_tensors'])} GB of the "
                     f"{gb(grad['measured'])} GB the resident set grew by over the step")
    kv = result["parts"].get("kv_cache")
    if kv is not None and kv.get("rows_prefilled", kv["rows"]) != kv["rows"]:
        lines.append(f"KV cache: {kv['rows_prefilled']} of the generation batch's {kv['rows']} rows prefilled, scaled "
                     f"to {kv['rows']}")
    lines.append("seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in result["seconds"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    args = build_parser().parse_args(argv)
    if args.build:
        build_model(*args.build)
        return []
    if args.table:
        results = [r for path in args.table for r in json.loads(Path(path).read_text())]
        for result in results:
            print(format_result(result))
        return results
    if args.worker:
        spec = json.loads(Path(args.worker).read_text())
        Path(spec["result"]).write_text(json.dumps(run_worker(spec)))
        return []
    if any(n < 1 for n in args.lengths):
        sys.exit("--lengths must be positive token counts")
    if not Path(args.recipe).is_file():
        sys.exit(f"--recipe: '{args.recipe}' is not a file")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as tmp:
        model = Path(args.model_dir or tmp) / f"random-{args.shape}"
        if not (model / "config.json").exists():
            t0 = time.perf_counter()
            print(f"building {args.shape} with random weights ...", flush=True)
            subprocess.run([sys.executable, __file__, "--build", args.shape, str(model)], cwd=ROOT, env=env,
                           check=True)
            print(f"    {time.perf_counter() - t0:.0f} s", flush=True)
        for length in args.lengths:
            spec = {"shape": args.shape, "model": str(model), "max_completion_length": length,
                    "max_prompt_length": args.max_prompt_length, "recipe": args.recipe, "bf16": args.bf16,
                    "dtype": args.dtype,
                    "no_kv": args.no_kv, "kv_rows": args.kv_rows, "no_reference": args.no_reference,
                    "result": str(Path(tmp) / f"result-{length}.json")}
            Path(tmp, "spec.json").write_text(json.dumps(spec))
            print(f"{args.shape} at {length} completion tokens ...", flush=True)
            proc = subprocess.run([sys.executable, __file__, "--worker", str(Path(tmp, "spec.json"))], cwd=ROOT,
                                  env=env, stderr=subprocess.PIPE, text=True, check=False)
            if proc.returncode != 0:
                sys.exit(f"{args.shape} at {length} tokens failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
            result = json.loads(Path(spec["result"]).read_text())
            results.append(result)
            print(format_result(result), flush=True)
            if args.json:  # after each configuration, so a long series keeps what finished
                Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
