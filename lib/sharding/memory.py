"""Memory habits for a 16 GB card: the optimizer states' bytes, a step's peak-memory estimate, and the guard that stops a
run which would not fit, naming the setting to lower, before any training step.

The estimate adds what a step allocates on top of what is already resident after loading (the policy, the
reference, the sampler and vLLM's reservation are measured, not estimated):

    gradients     trainable parameters x their bytes
    optimizer     AdamW's two moments: 8 bytes a trainable fp32 parameter, 2 with 8-bit states (bitsandbytes)
    activations   kept for backward, per token of a micro-batch; the accounting below, checked against the bytes
                  autograd saves for one block in seven settings (tests/test_memory.py: 0.99 to 1.12 of them) and
                  against whole steps of the 16 GB recipe at Qwen2.5-1.5B and 3B shapes (docs/performance.md 3.5).
                  With gradient checkpointing every block's input stays (h x s bytes a block), plus one block's set
                  while it is recomputed and run backward, plus that block's working set; without, every block's
                  input and set stay. A Llama-style block (h hidden, i MLP, q = heads x head size, kv = key-value
                  heads x head size) keeps
                      2 h x 4            the two RMSNorms' inputs (they compute in fp32)
                      (2 q + 2 kv) x c   SDPA's query, key, value and output (the output is o_proj's input)
                      3 i x o            the gated MLP's gate and up outputs and the activation's output
                  and, by what trains:
                      full fine-tuning   each weight's gradient reads its layer's input: under autocast a bf16 copy
                                         each (q, k, v, gate, up: h; o: q; down: i, x 2), else the shared inputs
                                         (2 h + i) x s; and the norms' normalised inputs, 2 h x s
                      LoRA               lora_A's gradient reads each adapted layer's input: under autocast a bf16
                                         copy each (inputs x 2; autocast casts the input PEFT gave the fp32
                                         adapter), with dropout its own dropped-out copy (inputs x the adapter's
                                         bytes), else the shared inputs; with dropout its mask too, in the adapter's
                                         dtype on a CPU (torch's CPU dropout multiplies by a float mask) and one
                                         byte on CUDA (native_dropout's bool mask)
                  where s is the residual stream's bytes (the embedding's dtype; a 4-bit model's other weights stay
                  in the load dtype, lib/models/modeling.load_policy), c = 2 under bf16
                  autocast else s, and o = s for a 4-bit model (a bitsandbytes layer returns its input's dtype, the
                  fp32 stream), c otherwise. The block being run also holds about 3 i x o of temporaries (the MLP's
                  product and its gradients: 2.3 i x 4 measured at 1.5B). Under autocast an fp32 weight's bf16 copy is
                  kept for backward too (per block, not per token). (Korthikanti et al. 2022's 34 h + 8 i bytes for a
                  bf16 block under-counts a QLoRA block, whose MLP tensors stay fp32: docs/performance.md 3.5.)
    logits        four fp32 buffers of one vocabulary chunk (lib/methods/losses.token_logps_and_entropy: at most 2^26
                  floats): the logits, their log-softmax and the entropy's p and p log p are live at once, and the
                  backward's buffers take their place; under bf16 autocast an fp32 output layer's bf16 copy too
                  (0.43 GB at Qwen2.5-1.5B's 151,936 x 1,536)
    KV cache      sampling: 2 x layers x kv_heads x head_dim x (prompt + completion) tokens x batch x 2 bytes
                  (4 in fp32; HF decode loop; vLLM's cache is inside its measured reservation)

A micro-batch's tokens: its completions x max_completion_length plus its distinct prompts x max_prompt_length
(each prompt runs once, its keys/values shared by its group).

Several processes: every figure is one process's. `process_memory` turns what a process holds before the policy is
sharded into what the launch leaves it (FSDP2 / ZeRO-3: 1/N of the weights, gradients and AdamW states; ZeRO-2: of
the gradients and states; data parallel: everything), for the run-time guard (`check_run`, measured) and the
estimate (`recipe_memory`, by arithmetic) alike (docs/distributed.md 4).
"""

from __future__ import annotations

import dataclasses
import os
import resource
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from lib.config import ConfigError
from lib.data.hub_data import HUB_TIMEOUT_S
from lib.models.folders import adapter_base
from lib.models.embedded import resolve_model_path
from lib.models.modeling import (_lora_targets, card_capability, is_adapter_folder, reference_dtype, training_precision,
                          weights_dtype)

GB = 2**30
CHUNK_ELEMENTS = 2**26  # lib/methods/losses.token_logps_and_entropy's default


def optimizer_state_bytes(optim: str) -> int:
    """Bytes of optimizer state per trainable parameter."""
    return {"adamw_torch": 8, "adamw_torch_fused": 8, "paged_adamw_32bit": 8, "adamw_8bit": 2,
            "paged_adamw_8bit": 2}[optim]


def eight_bit_adamw(params, name: str, **options) -> torch.optim.Optimizer:
    """bitsandbytes' AdamW for `optim` adamw_8bit, paged_adamw_8bit or paged_adamw_32bit (Dettmers et al. 2022, "8-bit
    optimizers via block-wise quantization"): 2 bytes of state per parameter instead of 8; paged states are moved to
    host memory by the CUDA driver when the GPU runs short instead of failing. `options`: AdamW's (lr, betas, eps,
    weight_decay). lib/setup.build_optimizer's `eight_bit`."""
    import bitsandbytes as bnb  # an optional dependency: imported only for an 8-bit optimizer

    cls = {"adamw_8bit": bnb.optim.AdamW8bit, "paged_adamw_8bit": bnb.optim.PagedAdamW8bit,
           "paged_adamw_32bit": bnb.optim.PagedAdamW32bit}[name]
    return cls(params, **options)


@dataclass
class StepMemory:
    """A step's estimated peak, in bytes, by part."""

    resident: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    kv_cache: int
    # the activations alive while the logits chunks run: with gradient checkpointing only the block inputs (the
    # recomputed block's set comes later, in backward: measured apart at Qwen2.5-1.5B, docs/performance.md 3.5);
    # None: all of them (without checkpointing every block's set is kept through the forward)
    kept: int | None = None
    # activation_offloading: the bytes saved for backward that live in host memory instead (not in `total`)
    offloaded: int = 0
    # vLLM sleep mode: the bytes of `resident` the sleeping engine gives back while the policy trains (its weights,
    # KV cache and working pools); sampling has them back, but sampling holds no activations
    asleep: int = 0
    overlapped: bool = False  # max_staleness: sampling runs beside training (docs/async.md), their peaks add up

    @property
    def training(self) -> int:
        """The training pass's peak over the gradients and states: activations, and the logits chunk on top of what
        is kept while it runs."""
        kept = self.activations if self.kept is None else self.kept
        return max(self.activations, kept + self.logits)

    @property
    def total(self) -> int:
        # sampling (KV cache; a vLLM engine awake) and training (activations, logits; the engine asleep) do not
        # overlap, unless `overlapped`; gradients and optimizer states are counted through both
        both = (self.kv_cache + self.training) if self.overlapped else max(self.kv_cache, self.training - self.asleep)
        return self.resident + self.gradients + self.optimizer + both

    def describe(self) -> str:
        parts = [("already resident (models loaded)", self.resident), ("gradients", self.gradients),
                 ("optimizer states", self.optimizer), ("activations", self.activations),
                 ("logits chunk", self.logits), ("sampling KV cache", self.kv_cache)]
        if self.offloaded:
            parts.append(("offloaded to host memory (not counted)", self.offloaded))
        if self.asleep:
            parts.append(("given back by the sleeping vLLM engine while training", self.asleep))
        return ", ".join(f"{name} {value / GB:.2f}" for name, value in parts)


def _is_4bit(module: torch.nn.Module) -> bool:
    return type(module).__name__ == "Linear4bit" or type(getattr(module, "weight", None)).__name__ == "Params4bit"


def _adapted_layers(model: torch.nn.Module) -> list[tuple[int, float, int]]:
    """(input features, dropout p, the adapter's bytes a value) of each PEFT LoRA layer."""
    out = []
    for module in model.modules():
        lora_a = getattr(module, "lora_A", None)
        if isinstance(lora_a, torch.nn.ModuleDict) and len(lora_a):
            name = next(iter(lora_a))
            dropouts = getattr(module, "lora_dropout", {})
            p = getattr(dropouts[name], "p", 0.0) if name in dropouts else 0.0
            out.append((lora_a[name].in_features, float(p), lora_a[name].weight.element_size()))
    return out


def activation_bytes(model: torch.nn.Module, *, bf16: bool, load_in_4bit: bool | None = None,
                     device_type: str | None = None) -> dict[str, int]:
    """What one decoder block keeps for backward, by the module docstring's accounting: bytes per token of the
    block's own set ("block"), of the block input a checkpointed model keeps ("input"), of the working set of the
    block being run ("working"), and the bytes per block that do not grow with tokens ("fixed": bf16 copies of fp32
    weights under autocast). `load_in_4bit` and `device_type` say what the model will be when it is a stand-in
    (the meta-device model of `recipe_memory`): read from the model otherwise."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    h = config.hidden_size
    i = getattr(config, "intermediate_size", 4 * h)
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    q, kv = heads * head_dim, getattr(config, "num_key_value_heads", heads) * head_dim
    linears = [m for n, m in base.named_modules() if isinstance(m, torch.nn.Linear) and "lora_" not in n
               and m is not base.get_output_embeddings()]
    quantized = any(_is_4bit(m) for m in base.modules()) if load_in_4bit is None else load_in_4bit
    if device_type is None:
        device_type = next(model.parameters()).device.type
    # the residual stream's dtype: the embedding's (a 4-bit model's too: its other weights stay in the load dtype)
    s = base.get_input_embeddings().weight.element_size()
    cast = bf16 and s > 2  # autocast makes bf16 copies of the fp32 tensors a product reads
    c = 2 if bf16 else s  # SDPA and plain linear layers compute (and return) in this
    o = s if quantized else c  # a bitsandbytes 4-bit layer returns its input's dtype: the fp32 stream
    block = 2 * h * 4 + (2 * q + 2 * kv) * c + 3 * i * o
    shared_inputs = (2 * h + i) * s  # q/k/v's and gate/up's normalised inputs, down's input; o's is SDPA's output
    trainable = [m for m in linears if m.weight.requires_grad]
    if trainable:  # full fine-tuning: each weight's gradient reads its layer's input; the norms' their own
        block += (sum(m.in_features for m in trainable) * 2 // layers if cast else shared_inputs) + 2 * h * s
    adapted = _adapted_layers(model)
    if adapted:
        inputs = sum(n for n, _, _ in adapted) // layers
        dropout = any(p > 0 for _, p, _ in adapted)
        adapter = adapted[0][2]
        if bf16:  # autocast hands lora_A (an fp32 adapter) a bf16 copy of each adapted layer's input, and keeps it
            block += inputs * 2
        elif dropout or adapter != s:  # each adapted layer's own dropped-out (or cast) copy
            block += inputs * adapter
        else:
            block += shared_inputs
        if dropout:  # the mask: a float tensor on a CPU (torch's dropout there multiplies by one), bool on CUDA
            block += inputs * (adapter if device_type == "cpu" else 1)
    fixed = 0
    if cast and not quantized:  # the bf16 copy of each fp32 weight that its product (and its backward) reads
        fixed = sum(m.weight.numel() for m in linears) * 2 // layers
    return {"block": block, "input": h * s, "working": 3 * i * o, "fixed": fixed, "layers": layers}


def estimate_step_memory(model: torch.nn.Module, *, resident: int, optim: str, tokens_per_micro_batch: int,
                         sampling_tokens: int, gradient_checkpointing: bool, bf16: bool,
                         vllm: bool = False, load_in_4bit: bool | None = None,
                         device_type: str | None = None, activation_offloading: bool = False) -> StepMemory:
    """StepMemory for `model` (the policy, PEFT or not) with the step's shapes; see the module docstring.
    `load_in_4bit`, `device_type`: for a stand-in model (`activation_bytes`)."""
    config = getattr(model, "config", None)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", config)
    layers = config.num_hidden_layers
    vocab = config.vocab_size
    trainable = [p for p in model.parameters() if p.requires_grad]
    grads = sum(p.numel() * p.element_size() for p in trainable)
    optimizer = sum(p.numel() for p in trainable) * optimizer_state_bytes(optim)
    act = activation_bytes(model, bf16=bf16, load_in_4bit=load_in_4bit, device_type=device_type)
    tokens = tokens_per_micro_batch
    kept = None
    if gradient_checkpointing:  # every block's input, and one block's set while it is recomputed and run backward
        kept = tokens * layers * act["input"]
        activations = kept + tokens * (act["block"] + act["working"]) + act["fixed"]
    else:
        activations = tokens * (layers * (act["input"] + act["block"]) + act["working"]) + layers * act["fixed"]
    offloaded = 0
    if activation_offloading:  # (a GPU's: offloaded_activations) what is saved goes to host memory; the
        # device holds the block being run (forward) or recomputed and run backward, one at a time
        device_side = tokens * (act["block"] + act["working"]) + act["fixed"]
        offloaded, activations, kept = max(0, activations - device_side), device_side, 0
    rows = min(tokens_per_micro_batch, max(1, CHUNK_ELEMENTS // vocab))
    # four buffers: measured on a CPU (token_logps_and_entropy, vocabulary 49152, 170 to 512 rows a chunk, with and
    # without the chunk recomputation) the peak is 4.0 to 4.6 buffers in the forward and 3.6 to 4.0 in backward, and
    # tests/test_memory.py measures 3.99; three (logits, softmax, gradient) missed the entropy's temporaries. Rows
    # count the prompt tokens too, although logits are formed at completion positions only: an over-count while a
    # micro-batch is under one chunk. Under bf16 autocast an fp32 output layer (fp32 master weights) is copied to
    # bf16 for each chunk's product: 0.43 GB at Qwen2.5-1.5B's 151,936 x 1,536, measured with the chunk
    # (scripts/bench_memory.py, docs/performance.md 3.5).
    logits = 4 * rows * vocab * 4
    head = base.get_output_embeddings()
    head_bytes = head.weight.element_size() if head is not None else 2
    if bf16 and head_bytes > 2 and head is not None:
        logits += head.weight.numel() * 2
    kv_cache = 0 if vllm else kv_bytes_per_token(config, 2 if bf16 else 4) * sampling_tokens
    return StepMemory(resident=resident, gradients=grads, optimizer=optimizer, activations=activations,
                      logits=logits, kv_cache=kv_cache, kept=kept, offloaded=offloaded)


def step_token_counts(cfg) -> dict[str, int]:
    """The token positions a step of this configuration holds at once, per process: a training micro-batch's
    (its completions at full length plus its distinct prompts, at most one more than whole groups) and the sampling
    batch's (every completion of the generation batch with its prompt, in the KV cache)."""
    completions = cfg.per_device_train_batch_size
    prompts = min(-(-completions // cfg.num_generations) + 1, completions)
    return {"tokens_per_micro_batch": completions * cfg.max_completion_length + prompts * cfg.max_prompt_length,
            "sampling_tokens": cfg.local_generation_batch * (cfg.max_prompt_length + cfg.max_completion_length)}


def resident_bytes(device: torch.device) -> int:
    """What the process holds now. On a GPU, what the device has in use (mem_get_info): the tensors, the allocator's
    slack, the CUDA context, cuBLAS and NCCL workspaces and a colocated vLLM engine's share; memory_allocated alone
    leaves all but the tensors out (2.1 GB outside the allocator on an H100, docs/performance.md 6). On a CPU, the
    resident set."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total - free
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def memory_budget(device: torch.device, max_memory_gb: float | None, local_processes: int = 1) -> tuple[int, str]:
    """(bytes a step of this process may use in all, where the number comes from). A GPU is this process's own; on a
    CPU the `local_processes` processes of this machine share the RAM available, an equal part each."""
    if max_memory_gb is not None:
        return int(max_memory_gb * GB), "max_memory"
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, "the GPU's memory"
    available = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    if local_processes > 1:
        return (resident_bytes(device) + available // local_processes,
                f"this process's memory plus 1/{local_processes} of the RAM available")
    return resident_bytes(device) + available, "this process's memory plus the RAM available"


def allocator_fraction(budget: int, total: int, outside: int) -> float:
    """The share of a GPU's memory (`total` bytes) that torch's caching allocator may take so that the process stays
    within `budget` bytes (max_memory) in all, given the bytes it holds outside the allocator (`outside`: the CUDA
    context, cuBLAS handles, NCCL; what mem_get_info counts beyond memory_reserved): (budget - outside) / total.
    ValueError where the budget does not cover what is already outside it or is above the GPU's memory."""
    if budget > total:
        raise ValueError(f"max_memory ({budget / GB:.1f} GB) is above this GPU's memory ({total / GB:.1f} GB)")
    if budget <= outside:
        raise ValueError(f"max_memory ({budget / GB:.1f} GB) does not cover the {outside / GB:.2f} GB this process "
                         f"already holds outside PyTorch's allocator (the CUDA context)")
    return (budget - outside) / total


def cap_process_memory(device: torch.device, max_memory_gb: float | None) -> float | None:
    """On a GPU with max_memory: cap this process's caching allocator (torch.cuda.set_per_process_memory_fraction) so
    that the process, the CUDA context included, stays within max_memory: going over is then a real out-of-memory
    (`out_of_memory_message`) and not only the estimate's warning, as on a card of that size. The context and a cuBLAS
    handle are made first so that what lies outside the allocator is measured. Returns the fraction (None: no cap)."""
    if max_memory_gb is None or device.type != "cuda":
        return None
    torch.ones(8, 8, device=device) @ torch.ones(8, 8, device=device)  # the context and a cuBLAS handle
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    outside = max(0, total - free - torch.cuda.memory_reserved(device))
    fraction = allocator_fraction(int(max_memory_gb * GB), total, outside)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


def out_of_memory_message(max_memory_gb: float | None, error: BaseException) -> str:
    """What a run that ran out of GPU memory stops with: under max_memory, the cap named and what to change."""
    if max_memory_gb is None:
        return f"out of GPU memory ({str(error)[:200]})"
    return (f"out of memory under max_memory {max_memory_gb:g} GB (the process is capped there, as a card of that "
            f"size would be): lower per_device_train_batch_size (raise gradient_accumulation_steps to keep the "
            f"batch), max_completion_length or vllm_gpu_memory_utilization; set gradient_checkpointing, load_in_4bit "
            f"or optim paged_adamw_8bit; or raise max_memory. `--estimate_memory_only --max_memory "
            f"{max_memory_gb:g}` shows the parts (docs/performance.md 3.4). ({str(error)[:200]})")


def fit_advice(estimate: StepMemory, *, use_peft: bool, gradient_checkpointing: bool, optim: str,
               sharding: str = "ddp") -> str:
    """The settings to lower, biggest part first. `sharding`: as `process_memory` takes it."""
    activations = estimate.training
    states = estimate.gradients + estimate.optimizer
    advice = []
    if max(activations, estimate.kv_cache) >= states:
        advice.append("lower per_device_train_batch_size (raise gradient_accumulation_steps to keep the batch) or "
                      "max_completion_length")
        if not gradient_checkpointing:
            advice.append("set gradient_checkpointing true")
    if sharding != "ddp":  # LoRA does not shard (docs/distributed.md 7): more GPUs divide the states further
        advice.append("launch more processes (num_processes: each holds 1/N of the sharded parts)")
    elif not use_peft:
        advice.append("set use_peft true (LoRA: gradients and optimizer states for the adapter only), or shard "
                      "full fine-tuning over several GPUs (scripts/accelerate/fsdp2.yaml, docs/distributed.md)")
    if "8bit" not in optim:
        advice.append("set optim paged_adamw_8bit (2 bytes of state a parameter instead of 8)")
    if use_peft:
        advice.append("set load_in_4bit true (QLoRA: a 4-bit base)")
    return "; or ".join(advice)


def check_step_memory(estimate: StepMemory, budget: int, source: str, scope: str = "", **settings) -> None:
    """Raise MemoryError naming the settings to lower when the estimated peak exceeds the budget. `scope`: what the
    figure is of, said after it (" a process, FSDP2 over 8 processes")."""
    if estimate.total <= budget:
        return
    raise MemoryError(
        f"a training step would need about {estimate.total / GB:.1f} GB{scope} ({estimate.describe()}, in GB) but "
        f"{source} is {budget / GB:.1f} GB. To fit: {fit_advice(estimate, **settings)}. (max_memory sets the "
        f"budget, in GB)")


# ---------------------------------------------------------------------------------------------------------------------
# A recipe's estimate without loading weights (--estimate_memory_only)

# The shapes of the models the recipes name, from their published config.json files, so that a machine that cannot
# reach the hub still gets an estimate (a local folder or a cached config is read first).
_QWEN25 = dict(model_type="qwen2", vocab_size=151936, tie_word_embeddings=True, rms_norm_eps=1e-6,
               rope_theta=1_000_000.0, max_position_embeddings=32768)
_QWEN3 = dict(model_type="qwen3", vocab_size=151936, tie_word_embeddings=True, rms_norm_eps=1e-6,
              rope_theta=1_000_000.0, max_position_embeddings=40960, head_dim=128)
PUBLISHED_SHAPES = {
    "Qwen/Qwen2.5-0.5B": dict(_QWEN25, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                              num_attention_heads=14, num_key_value_heads=2),
    "Qwen/Qwen2.5-1.5B": dict(_QWEN25, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                              num_attention_heads=12, num_key_value_heads=2),
    "Qwen/Qwen2.5-3B": dict(_QWEN25, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                            num_attention_heads=16, num_key_value_heads=2),
    "Qwen/Qwen2.5-7B": dict(_QWEN25, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                            num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                            tie_word_embeddings=False),
    "meta-llama/Llama-3.1-8B": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                    tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=500_000.0,
                                    max_position_embeddings=131072),
    "Qwen/Qwen3-0.6B": dict(_QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                            num_attention_heads=16, num_key_value_heads=8),
    "Qwen/Qwen3-1.7B": dict(_QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                            num_attention_heads=16, num_key_value_heads=8),
}
# what a GPU process holds besides tensors: the CUDA context and kernels (about 0.5 GB), cuBLAS workspaces and the
# caching allocator's slack (fragmentation); an allowance, not a measurement
GPU_OVERHEAD = int(1.0 * GB)


def model_config(name: str, revision: str | None = None, trust_remote_code: bool = False):
    """A model's configuration without its weights: a local folder or the hub cache first, then the published
    shapes above (no network needed), then the hub. ValueError when none has it."""
    from transformers import AutoConfig


    path = resolve_model_path(name)
    if is_adapter_folder(path):
        path = adapter_base(path)
    try:
        return AutoConfig.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code,
                                          local_files_only=True)
    except (OSError, ValueError):
        pass
    shape = PUBLISHED_SHAPES.get(name.removesuffix("-Instruct"))
    if shape is not None:
        shape = dict(shape)
        return AutoConfig.for_model(shape.pop("model_type"), **shape)
    from huggingface_hub import HfApi


    try:  # asked with a time limit first: an unreachable hub fails in seconds, not after the library's retries
        HfApi().model_info(name, revision=revision, timeout=HUB_TIMEOUT_S)
        return AutoConfig.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
    except Exception as error:  # noqa: BLE001  (no route, unknown id, gated, a config transformers cannot read)
        raise ValueError(f"no configuration for '{name}' here or on the hub ({str(error)[:200]}); give a local "
                         f"model folder") from None


def quantized_bytes(numel: int, nested: bool) -> float:
    """Bytes of a bitsandbytes 4-bit weight: half a byte a value, plus one absmax per 64-value block (fp32, or with
    nested quantisation 8-bit with an fp32 absmax per 256 of those; Dettmers et al. 2023, QLoRA, section 3)."""
    blocks = numel / 64
    return numel / 2 + (blocks + blocks / 256 * 4 if nested else blocks * 4)


def recipe_model(cfg, bf16: bool = True) -> torch.nn.Module:
    """The policy a configuration trains, on the meta device (shapes, no memory): the model built from its
    configuration in the dtype the trainer loads it in on a GPU, with the run's LoRA adapter."""
    from transformers import AutoModelForCausalLM


    config = model_config(cfg.model_name_or_path, cfg.model_revision, cfg.trust_remote_code)
    dtype = weights_dtype(cfg.dtype, lora=bool(cfg.use_peft), device="cuda", bf16=bf16)
    if dtype == "auto":  # the checkpoint's
        dtype = getattr(config, "dtype", None) or torch.bfloat16
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if cfg.use_peft:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha,
                                                 lora_dropout=cfg.lora_dropout,  # its masks are activations
                                                 target_modules=_lora_targets(cfg.lora_target_modules),
                                                 task_type="CAUSAL_LM"))
    return model


ENGINE_PART = "vLLM engine (its share of the GPU)"
# what a colocated vLLM engine keeps on the GPU while it sleeps: its sleep frees the memory pools it allocates
# weights, KV cache, workspace and run-time buffers from (vllm/v1/worker/gpu_worker.py, `sleep`), and leaves what it
# holds outside them; an allowance, not a measurement (the run-time guard measures the engine asleep)
VLLM_ASLEEP = int(0.5 * GB)


def recipe_parts(cfg, model: torch.nn.Module, *, gpu_bytes: int | None, bf16: bool = True) -> dict[str, int]:
    """What one GPU holds before a step when nothing is sharded, by part, counted as the trainer would hold `model`
    (`recipe_model`): the policy's weights, the reference, the sampler (vLLM's reservation: its share of
    `gpu_bytes`), the device allowance."""
    lora = bool(cfg.use_peft)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    # the linear layers a 4-bit load quantises (a LoRA layer's base_layer under its own name)
    names = {n.replace(".base_layer", "") for n, m in base.named_modules()
             if isinstance(m, torch.nn.Linear) and "lora_" not in n and n != "lm_head"}
    dtype = next(p.dtype for n, p in model.named_parameters() if "lora_" not in n)
    size = torch.finfo(dtype).bits // 8
    total = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    weights = 0.0
    for name, p in model.named_parameters():
        if "lora_" in name:
            weights += p.numel() * 4  # the adapter is fp32 (PEFT upcasts it on a 16-bit base)
        elif cfg.load_in_4bit and name.rsplit(".", 1)[0].replace("base_model.model.", "").replace(
                ".base_layer", "") in names:
            weights += quantized_bytes(p.numel(), cfg.use_bnb_nested_quant)
        else:  # a 4-bit model's other weights stay in the load dtype (lib/models/modeling.load_policy)
            weights += p.numel() * size
    parts = {"policy weights": int(weights)}
    if cfg.beta > 0 and not lora:  # bf16 on a bf16 GPU unless dtype says otherwise (lib/models/modeling.reference_dtype)
        reference = reference_dtype(cfg.dtype, dtype, device="cuda", bf16=bf16)
        parts["reference model"] = total * torch.finfo(reference).bits // 8
    if cfg.use_vllm and getattr(cfg, "vllm_mode", "colocate") == "server":
        pass  # the generation server's own GPUs hold the sampler (docs/distributed.md 6)
    elif cfg.use_vllm:
        if gpu_bytes is None:
            raise ValueError("use_vllm reserves a share of the GPU's memory: give max_memory (the GPU's GB)")
        parts[ENGINE_PART] = int(cfg.vllm_gpu_memory_utilization * gpu_bytes)
    elif lora or (bf16 and size == 4):  # the HF sampler's merged copy (lib/sampling/rollout.HFRollout): bf16, else the
        # compute dtype (fp32 on a card without bf16)
        parts["sampler's bf16 copy" if bf16 else "sampler's fp32 copy"] = total * (2 if bf16 else 4)
    parts["CUDA context, workspaces, allocator slack (allowance)"] = GPU_OVERHEAD
    return parts


def sampler_plan(*, adapter: bool, quantized: bool, bf16: bool, policy_bf16: bool, own_copy: bool = False,
                 merge_adapter: bool = True, copy_bytes: int = 0, headroom: int | None = None) -> str:
    """How the HF sampler decodes a policy, the one rule (docs/performance.md 2.5, 3.4):

    "dense"   a plain copy of the weights (`merged_copy`), where it pays and fits: a LoRA / QLoRA policy's base with the
              adapter merged and a 4-bit base dequantised, or a bf16 copy of a wider policy trained under bf16
              (decoding skips the adapter's extra products, the dequantisation and autocast's weight casts: several
              times faster a token on a CPU, docs/performance.md 2.5), or the full copy a policy that will be sharded
              needs
              (`own_copy`, whatever it costs). It fits when its `copy_bytes` are at most `headroom`: the memory
              budget less the step's estimated peak without it (copy_headroom); None (no budget
              known) counts as fitting.
    "direct"  a LoRA / QLoRA policy decoded from its own layers, no copy: each layer's base product (a 4-bit base
              dequantised one layer at a time, for the call) plus the adapter's scale B (A x)
              (lib/sampling/decode._lora_linear), under bf16 autocast with bf16. Costs one layer's dequantised weight
              instead of the whole model's; where the copy does not fit, or `merge_adapter` is False. (A model
              outside the written-out step's family, lib/sampling/decode.llama_family, decodes with its own forward.)
    "policy"  the policy itself through its own forward: a plain policy that needs no copy, or whose copy does not fit.
    """
    fits = headroom is None or copy_bytes <= headroom
    if adapter:
        return "dense" if merge_adapter and fits else "direct"
    if own_copy and not quantized:
        return "dense"
    if bf16 and not quantized and not policy_bf16 and fits:
        return "dense"
    return "policy"


def recipe_memory(cfg, *, gpu_bytes: int | None, bf16: bool = True,
                  fp16: bool = False) -> tuple[dict[str, int], StepMemory]:
    """(what is resident before a step, by part; the step's StepMemory) for a configuration on one GPU, from the
    model's configuration alone (`recipe_model`, `recipe_parts`). `gpu_bytes`: the GPU's memory, for vLLM's
    reservation. With cfg.estimate_processes N > 1, per GPU of a launch of N processes as cfg.estimate_sharding
    says (`process_memory`, which the run-time guard, `check_run`, goes through too). With vllm_enable_sleep_mode
    the engine gives back all but VLLM_ASLEEP of its share while the policy trains. `bf16`: a card with bf16 (bf16
    autocast, a LoRA base frozen in bf16); `fp16` (a card without, T4, V100): fp16 autocast over the fp32 weights the
    trainer keeps there, 2 bytes a computed value as under bf16 (lib/models/modeling.training_precision)."""
    model = recipe_model(cfg, bf16)
    parts = recipe_parts(cfg, model, gpu_bytes=gpu_bytes, bf16=bf16)
    asleep = max(0, parts[ENGINE_PART] - VLLM_ASLEEP) if cfg.vllm_enable_sleep_mode and ENGINE_PART in parts else 0
    processes = getattr(cfg, "estimate_processes", 1)

    def counted(parts: dict[str, int]) -> tuple[dict[str, int], StepMemory]:
        return process_memory(model, parts, cfg, processes=processes, bf16=bf16 or fp16, asleep=asleep,
                              sharding=getattr(cfg, "estimate_sharding", "fsdp2") if processes > 1 else "ddp",
                              sampler=not (cfg.use_vllm and getattr(cfg, "vllm_mode", "colocate") == "server"),
                              load_in_4bit=bool(cfg.load_in_4bit), device_type="cuda")

    copy = next((k for k in parts if k.startswith("sampler's")), None)
    # a policy to be sharded keeps its full copy, whatever it costs; so does a sampler behind it (docs/async.md)
    if processes > 1 or copy is None or getattr(cfg, "max_staleness", None) is not None:
        return counted(parts)
    # one process, the HF sampler: its copy where it pays and fits what the step leaves (`sampler_plan`)
    copy_bytes = parts.pop(copy)
    dtype = next(p.dtype for n, p in model.named_parameters() if "lora_" not in n)
    plan = sampler_plan(adapter=bool(cfg.use_peft), quantized=bool(cfg.load_in_4bit), bf16=bf16,
                        policy_bf16=dtype == torch.bfloat16, copy_bytes=copy_bytes,
                        headroom=None if gpu_bytes is None else gpu_bytes - counted(parts)[1].total)
    if plan == "dense":
        parts[copy] = copy_bytes
    elif plan == "direct":
        # no copy: the decode step dequantises a 4-bit layer (or casts an fp32 one under autocast) for its product,
        # one layer at a time; the largest one is alive at once (nothing for a 16-bit base)
        cast = cfg.load_in_4bit or (bf16 and dtype == torch.float32)
        largest = max((m.weight.numel() for n, m in model.named_modules()
                       if isinstance(m, torch.nn.Linear) and "lora_" not in n and not n.endswith("lm_head")), default=0)
        parts["sampler without a copy (one layer dequantised at a time)"] = largest * (2 if bf16 else 4) if cast else 0
    return counted(parts)


SHARDING_NAMES = {"ddp": "data parallel", "fsdp2": "FSDP2", "zero2": "DeepSpeed ZeRO-2", "zero3": "DeepSpeed ZeRO-3"}


def process_memory(model: torch.nn.Module, parts: dict[str, int], cfg, *, processes: int, sharding: str,
                   bf16: bool, sampler: bool = True, asleep: int = 0, load_in_4bit: bool | None = None,
                   device_type: str | None = None) -> tuple[dict[str, int], StepMemory]:
    """One process's resident parts and step peak in a launch of `processes` processes: the one place where both the
    estimate (`recipe_memory`: `parts` by arithmetic) and the run-time guard (`check_run`: `parts` measured, before
    the policy is sharded) turn what a process holds into what it will hold while it trains.

    `parts` holds the policy's whole weights as "policy weights" (and, for the estimate, the whole reference as
    "reference model"); `sharding` says what the launch divides (docs/distributed.md 1, 4): "ddp" nothing (one
    process, or data parallelism: each holds everything); "fsdp2" and "zero3" the weights, gradients and optimizer
    states (and the reference); "zero2" the gradients and optimizer states, with the fp32 master weights
    (`sharded_parts`). Gradients and AdamW states of a sharded launch are fp32, 1/N each. `sampler` False: the
    parts already hold the sampler (measured), or a generation server samples. `asleep`: the bytes a sleeping vLLM
    engine gives back while the policy trains (StepMemory.asleep). `load_in_4bit`, `device_type`: for a stand-in
    model (`activation_bytes`)."""
    if sharding not in SHARDING_NAMES:
        raise ValueError(f"sharding: {sharding!r} is not one of {', '.join(SHARDING_NAMES)}")
    sharded = processes > 1 and sharding != "ddp"
    if sharded:
        parts = sharded_parts(parts, model, processes, bf16=bf16, mode=sharding, sampler=sampler)
    if device_type is None:
        device_type = next(model.parameters()).device.type
    step = estimate_step_memory(model, resident=sum(parts.values()), optim=cfg.optim, bf16=bf16,
                                vllm=bool(cfg.use_vllm), gradient_checkpointing=cfg.gradient_checkpointing,
                                load_in_4bit=load_in_4bit, device_type=device_type,
                                activation_offloading=bool(cfg.activation_offloading) and device_type == "cuda",
                                **step_token_counts(cfg))
    if sharded:  # fp32 gradients and optimizer states, 1/N of each a process
        numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        step = dataclasses.replace(step, gradients=numel * 4 // processes,
                                   optimizer=numel * optimizer_state_bytes(cfg.optim) // processes)
    return parts, dataclasses.replace(step, asleep=asleep, overlapped=getattr(cfg, "max_staleness", None) is not None)


DEEPSPEED_BUCKET = int(5e8)  # DeepSpeed's default reduce_bucket_size, in elements (of the compute dtype)


def sharded_parts(parts: dict[str, int], model: torch.nn.Module, processes: int, bf16: bool,
                  mode: str = "fsdp2", sampler: bool = True) -> dict[str, int]:
    """The resident parts of one GPU when full fine-tuning is sharded over `processes` (docs/distributed.md 1, 4).

    fsdp2: the policy's shard in fp32 (FSDP2 keeps fp32 master weights under bf16 mixed precision), the reference's
    shard in its dtype, and what is gathered in the compute dtype while a forward runs: the root unit (embeddings,
    final norm, output layer: gathered for the whole forward) and two decoder layers (the one computing and the next,
    prefetched). zero3: the same, the partition held in the compute dtype with its fp32 master copy in the
    optimizer (a copy in fp32 training too), plus DeepSpeed's gradient bucket. zero2: whole weights in the compute dtype on every GPU (and a
    whole reference), the fp32 master weights partitioned, plus the bucket. The sampler keeps its full weights.
    Gradients and optimizer states, 1/N each, are the caller's (recipe_memory). `sampler` False: a generation
    server samples, on GPUs of its own."""
    if mode == "zero2":
        compute = 2 if bf16 else 4
        total = sum(p.numel() for p in model.parameters())
        # DeepSpeed's optimizer keeps its own fp32 copy of the partition, in fp32 training too
        out = {"policy weights (ZeRO-2: whole, compute dtype)": total * compute,
               "fp32 master weights (ZeRO-2: its partition)": total * 4 // processes}
        rest = {k: v for k, v in parts.items() if k != "policy weights"}
        return {**out, **rest, "DeepSpeed's gradient bucket (reduce_bucket_size 5e8)": DEEPSPEED_BUCKET * compute}
    if mode == "zero3":
        parts = sharded_parts(parts, model, processes, bf16, sampler=sampler)
        compute = 2 if bf16 else 4
        total = sum(p.numel() for p in model.parameters())
        renamed = {k.replace("FSDP2", "ZeRO-3"): v for k, v in parts.items()}
        renamed.pop("policy weights (ZeRO-3: its fp32 shard)")
        weights = {"policy weights (ZeRO-3: its partition, + fp32 master)": total * (compute + 4) // processes}
        return {**weights, **renamed, "DeepSpeed's gradient bucket (reduce_bucket_size 5e8)": DEEPSPEED_BUCKET * compute}
    compute = 2 if bf16 else 4
    numel = {name: p.numel() for name, p in model.named_parameters()}  # (a tied output layer once)
    layers = {}
    for name, count in numel.items():
        key = layer_key(name)
        layers[key] = layers.get(key, 0) + count
    root = layers.pop(None, 0)
    largest = max(layers.values(), default=0)
    out = {"policy weights (FSDP2: its fp32 shard)": sum(numel.values()) * 4 // processes}
    if "reference model" in parts:
        out["reference model (FSDP2: its shard)"] = parts["reference model"] // processes
    out["gathered for compute (FSDP2: root unit + 2 decoder layers)"] = (root + 2 * largest) * compute
    rest = {k: v for k, v in parts.items() if k not in ("policy weights", "reference model")}
    if sampler and not any(k.startswith(("vLLM engine", "sampler's")) for k in rest):  # the HF sampler's full copy
        out["sampler's copy (FSDP2: full weights)"] = sum(numel.values()) * compute
    return {**out, **rest}


def layer_key(name: str) -> str | None:
    """The decoder layer a parameter belongs to ('model.layers.3'), or None for the root unit's parameters."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit() and i > 0 and parts[i - 1] in ("layers", "h", "blocks", "layer"):
            return ".".join(parts[:i + 1])
    return None


def describe_recipe(parts: dict[str, int], step: StepMemory, budget: int | None) -> str:
    """The estimate as a table, per GPU, in GB."""
    lines = [f"{'part':<62}{'GB':>8}"]
    lines += [f"{name:<62}{value / GB:>8.2f}" for name, value in parts.items()]
    for name, value in (("gradients", step.gradients), ("optimizer states", step.optimizer),
                        ("activations (training micro-batch)", step.activations),
                        ("logits chunk", step.logits), ("sampling KV cache (HF sampler)", step.kv_cache)):
        lines.append(f"{name:<62}{value / GB:>8.2f}")
    if step.asleep:
        lines.append(f"{'vLLM sleep mode: given back while the policy trains':<62}{-step.asleep / GB:>8.2f}")
    peak = "peak (sampling beside training)" if step.overlapped else "peak (sampling and training do not overlap)"
    lines.append(f"{peak:<62}{step.total / GB:>8.2f}")
    if step.offloaded:
        lines.append(f"{'activation_offloading: in pinned host memory, not above':<62}{step.offloaded / GB:>8.2f}")
    if budget is not None:
        verdict = "fits" if step.total <= budget else "does NOT fit"
        lines.append(f"{verdict} in {budget / GB:.1f} GB (max_memory)")
    lines.append("an estimate by arithmetic (lib/sharding/memory.py, docs/performance.md 3), not a GPU measurement")
    return "\n".join(lines)


MEASURED_PART = "the rest of what this process holds now (measured)"


def sharding_of(sharding) -> str:
    """`process_memory`'s name for a launch's lib/sharding/fsdp_deepspeed.Sharding: None (one process, or data parallel)
    shards nothing."""
    if sharding is None:
        return "ddp"
    return f"zero{sharding.stage}" if sharding.deepspeed else "fsdp2"


def guard_memory(cfg, policy: torch.nn.Module, *, resident: int, processes: int, sharding: str, bf16: bool,
                 asleep: int = 0, load_in_4bit: bool | None = None,
                 device_type: str | None = None) -> tuple[dict[str, int], StepMemory]:
    """The run-time guard's figure from what this process holds before the policy is sharded (`resident`, measured:
    the whole policy, the reference as loaded, already sharded under FSDP2 / ZeRO-3, the sampler, the context), per
    process as `process_memory` counts it: the policy's whole weights are replaced by what the launch leaves this
    process of them. `asleep`: what the sleeping vLLM engine gave back, measured. `load_in_4bit`, `device_type`: for
    a stand-in policy (tests/test_estimate.py gives the meta-device model of a recipe)."""
    seen, weights = set(), 0
    for p in policy.parameters():  # a tied output layer once
        if id(p) not in seen:
            seen.add(id(p))
            weights += p.numel() * p.element_size()
    parts = {"policy weights": weights, MEASURED_PART: max(0, resident - weights)}
    return process_memory(policy, parts, cfg, processes=processes, sharding=sharding, bf16=bf16, sampler=False,
                          asleep=asleep, load_in_4bit=load_in_4bit, device_type=device_type)


def check_run(cfg, policy: torch.nn.Module, device: torch.device, bf16: bool, processes: int = 1,
              sharding=None, engine=None) -> str:
    """The memory guard train_agrpo.setup runs once the models, the sampler, the reward models and the optimizer are
    loaded, before the policy is sharded and before any sampling or training: this process's step peak, as the
    launch of `processes` processes sharded as `sharding` (lib/sharding/fsdp_deepspeed.Sharding or None) will leave it
    (`guard_memory`, on top of what loading left resident), against its budget. A vLLM `engine` with sleep mode on a
    GPU is put to sleep here, as it will be through every training pass, and measured asleep (the next sampling or
    evaluation wakes it: its `ready`). A run that would not fit stops here (ConfigError) with the setting to lower,
    on every process; else the line that says the estimate."""
    mode = sharding_of(sharding)
    resident = resident_bytes(device)
    asleep = 0
    if getattr(engine, "enable_sleep_mode", False) and device.type == "cuda":
        engine.sleep()
        asleep = max(0, resident - resident_bytes(device))
    _, estimate = guard_memory(cfg, policy, resident=resident, processes=processes, sharding=mode, bf16=bf16,
                               asleep=asleep, device_type=device.type)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # torchrun's (accelerate launch's) processes on this machine
    scope = f" a process ({SHARDING_NAMES[mode]} over {processes} processes)" if processes > 1 else ""
    try:
        check_step_memory(estimate, *memory_budget(device, cfg.max_memory, local), scope=scope,
                          use_peft=hasattr(policy, "peft_config"), sharding=mode,
                          gradient_checkpointing=cfg.gradient_checkpointing, optim=cfg.optim)
    except MemoryError as error:
        raise ConfigError(str(error)) from error
    return f"memory: a step is estimated at {estimate.total / GB:.1f} GB{scope} (in GB: {estimate.describe()})"


PRECISION_WORDS = {"bf16": "bf16 autocast, fp32 master weights (a LoRA base frozen in bf16)",
                   "fp16": "fp16 autocast with loss scaling, fp32 master weights (no bf16 below compute capability "
                           "8.0; a vLLM engine samples in fp16)",
                   "fp32": "fp32 (bf16 and fp16 off)"}


def copy_headroom(cfg, policy: torch.nn.Module, device: torch.device, bf16: bool, vllm: bool | None = None) -> int:
    """The bytes the HF sampler's copy may take (`sampler_plan`'s headroom): the memory budget (`memory_budget`) less
    the step's estimated peak on top of what is resident now, before the sampler is made (train_agrpo.setup; with
    `vllm` False in place of a vLLM engine, lib/setup.check_first_batch: the estimate counts the sampler's KV cache)."""
    vllm = cfg.use_vllm if vllm is None else vllm
    estimate = estimate_step_memory(policy, resident=resident_bytes(device), optim=cfg.optim, bf16=bf16, vllm=vllm,
                                    gradient_checkpointing=cfg.gradient_checkpointing,
                                    activation_offloading=cfg.activation_offloading and device.type == "cuda",
                                    **step_token_counts(cfg))
    return memory_budget(device, cfg.max_memory)[0] - estimate.total


def estimate_only(cfg) -> dict:
    """estimate_memory_only: the recipe's memory from the model's configuration alone (no
    weights, no accelerator), printed; {"estimated_peak_bytes": the step's estimated peak}."""
    budget = int(cfg.max_memory * GB) if cfg.max_memory else None
    try:
        capability = card_capability(cfg.estimate_gpu) if cfg.estimate_gpu else (8, 0)
        precision = training_precision("cuda", capability, bf16=cfg.bf16, fp16=cfg.fp16)
        parts, step = recipe_memory(cfg, gpu_bytes=budget, bf16=precision == "bf16", fp16=precision == "fp16")
    except ValueError as error:
        raise ConfigError(f"estimate_memory_only: {error}") from None
    card = cfg.estimate_gpu or "a card with bf16"
    print(f"precision on {card} (compute capability {capability[0]}.{capability[1]}): {PRECISION_WORDS[precision]}")
    print(describe_recipe(parts, step, budget))
    return {"estimated_peak_bytes": step.total, "precision": precision}


def kv_bytes_per_token(config, dtype_bytes: int) -> int:
    """Bytes one token takes in a decoder's KV cache: a key and a value per layer and KV head (Vaswani et al. 2017;
    grouped-query attention, Ainslie et al. 2023, stores num_key_value_heads of them)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * getattr(config, "num_key_value_heads", heads) * head_dim * dtype_bytes


def say_offloading_note(cfg, device: torch.device, say) -> None:
    """activation_offloading given for a CPU run, where it does nothing (`offloaded_activations`): said once
    (train_agrpo.setup, on the main process, after the memory estimate)."""
    if cfg.activation_offloading and device.type != "cuda":
        say("activation_offloading: ignored on a CPU (the saved activations are already in its memory)")


def offloaded_activations(enabled: bool, device: torch.device | str):
    """The context a training forward runs in: with `activation_offloading` on a GPU, every tensor autograd saves
    for backward is copied to pinned CPU memory as it is saved and back when backward needs it (torch's
    `save_on_cpu`); under gradient checkpointing these are the blocks' inputs (torch's non-reentrant checkpoint saves
    them through the same hooks) and the logits chunks' inputs. A no-op elsewhere: on a CPU there is nowhere else to
    put them."""
    if enabled and torch.device(device).type == "cuda":
        return torch.autograd.graph.save_on_cpu(pin_memory=True)
    return nullcontext()
