"""Memory habits for a 16 GB card: the optimizer choice, a step's peak-memory estimate, and the guard that stops a
run which would not fit, naming the setting to lower, before any training step.

The estimate adds what a step allocates on top of what is already resident after loading (the policy, the
reference, the sampler and vLLM's reservation are measured, not estimated):

    gradients     trainable parameters x their bytes
    optimizer     AdamW's two moments: 8 bytes a trainable fp32 parameter, 2 with 8-bit states (bitsandbytes)
    activations   kept for backward, per token of a micro-batch and per layer. A Llama-style block under bf16
                  autocast keeps about 34 h + 8 i bytes (norm inputs in fp32, q/k/v/o and MLP inputs in bf16,
                  SDPA's output and log-sum-exp; Korthikanti et al. 2022, "Reducing activation recomputation",
                  section 4, adapted to a gated MLP and fused attention). With gradient checkpointing only the block
                  inputs (4 h bytes) stay, plus one block's full set during its recomputation.
    logits        four fp32 buffers of one vocabulary chunk (lib/losses.token_logps_and_entropy: at most 2^26
                  floats): the logits, their log-softmax and the entropy's p and p log p are live at once, and the
                  backward's buffers take their place
    KV cache      sampling: 2 x layers x kv_heads x head_dim x (prompt + completion) tokens x batch x 2 bytes
                  (4 in fp32; HF decode loop; vLLM's cache is inside its measured reservation)

A micro-batch's tokens: its completions x max_completion_length plus its distinct prompts x max_prompt_length
(each prompt runs once, its keys/values shared by its group).
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

import torch

GB = 2**30
CHUNK_ELEMENTS = 2**26  # lib/losses.token_logps_and_entropy's default


def build_optimizer(params, name: str, lr: float, betas: tuple[float, float], weight_decay: float,
                    eps: float = 1e-8):
    """AdamW by `optim` name: torch's, or bitsandbytes' 8-bit / paged states (Dettmers et al. 2022, "8-bit
    optimizers via block-wise quantization"): 2 bytes of state per parameter instead of 8; paged states are moved
    to host memory by the CUDA driver when the GPU runs short instead of failing."""
    if name in ("adamw_torch", "adamw_torch_fused"):  # fused: one kernel for all tensors on CUDA, the same update
        fused = name == "adamw_torch_fused" and all(p.is_cuda for p in params)
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused or None)
    import bitsandbytes as bnb

    cls = {"adamw_8bit": bnb.optim.AdamW8bit, "paged_adamw_8bit": bnb.optim.PagedAdamW8bit,
           "paged_adamw_32bit": bnb.optim.PagedAdamW32bit}[name]
    return cls(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def optimizer_state_bytes(optim: str) -> int:
    """Bytes of optimizer state per trainable parameter."""
    return {"adamw_torch": 8, "adamw_torch_fused": 8, "paged_adamw_32bit": 8, "adamw_8bit": 2,
            "paged_adamw_8bit": 2}[optim]


@dataclass
class StepMemory:
    """A step's estimated peak, in bytes, by part."""

    resident: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    kv_cache: int

    @property
    def total(self) -> int:
        # sampling (KV cache) and training (activations, logits) do not overlap; gradients and optimizer states
        # live through the training pass
        return self.resident + self.gradients + self.optimizer + max(self.kv_cache, self.activations + self.logits)

    def describe(self) -> str:
        parts = [("already resident (models loaded)", self.resident), ("gradients", self.gradients),
                 ("optimizer states", self.optimizer), ("activations", self.activations),
                 ("logits chunk", self.logits), ("sampling KV cache", self.kv_cache)]
        return ", ".join(f"{name} {value / GB:.2f}" for name, value in parts)


def estimate_step_memory(model: torch.nn.Module, *, resident: int, optim: str, tokens_per_micro_batch: int,
                         sampling_tokens: int, gradient_checkpointing: bool, bf16: bool,
                         vllm: bool = False) -> StepMemory:
    """StepMemory for `model` (the policy, PEFT or not) with the step's shapes; see the module docstring."""
    config = getattr(model, "config", None)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", config)
    hidden = config.hidden_size
    inner = getattr(config, "intermediate_size", 4 * hidden)
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", heads)
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    vocab = config.vocab_size
    trainable = [p for p in model.parameters() if p.requires_grad]
    grads = sum(p.numel() * p.element_size() for p in trainable)
    optimizer = sum(p.numel() for p in trainable) * optimizer_state_bytes(optim)
    scale = 1.0 if bf16 else 2.0  # fp32 activations take twice the bf16 ones
    per_block = int((34 * hidden + 8 * inner) * scale)
    if gradient_checkpointing:
        activations = tokens_per_micro_batch * (4 * hidden * layers + per_block)
    else:
        activations = tokens_per_micro_batch * per_block * layers
    rows = min(tokens_per_micro_batch, max(1, CHUNK_ELEMENTS // vocab))
    # four buffers: measured on a CPU (token_logps_and_entropy, vocabulary 49152, 170 to 512 rows a chunk, with and
    # without the chunk recomputation) the peak is 4.0 to 4.6 buffers in the forward and 3.6 to 4.0 in backward, and
    # tests/test_memory.py measures 3.99; three (logits, softmax, gradient) missed the entropy's temporaries. Rows
    # count the prompt tokens too, although logits are formed at completion positions only: an over-count while a
    # micro-batch is under one chunk.
    logits = 4 * rows * vocab * 4
    kv_cache = 0 if vllm else 2 * layers * kv_heads * head_dim * sampling_tokens * (2 if bf16 else 4)
    return StepMemory(resident=resident, gradients=grads, optimizer=optimizer, activations=activations,
                      logits=logits, kv_cache=kv_cache)


def step_token_counts(cfg) -> dict[str, int]:
    """The token positions a step of this configuration holds at once, per process: a training micro-batch's
    (its completions at full length plus its distinct prompts, at most one more than whole groups) and the sampling
    batch's (every completion of the generation batch with its prompt, in the KV cache)."""
    completions = cfg.per_device_train_batch_size
    prompts = min(-(-completions // cfg.num_generations) + 1, completions)
    return {"tokens_per_micro_batch": completions * cfg.max_completion_length + prompts * cfg.max_prompt_length,
            "sampling_tokens": completions * cfg.gradient_accumulation_steps
            * (cfg.max_prompt_length + cfg.max_completion_length)}


def resident_bytes(device: torch.device) -> int:
    """What the process holds now: allocated CUDA memory on a GPU, the resident set on a CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def memory_budget(device: torch.device, max_memory_gb: float | None) -> tuple[int, str]:
    """(bytes a step may use in all, where the number comes from)."""
    if max_memory_gb is not None:
        return int(max_memory_gb * GB), "max_memory"
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, "the GPU's memory"
    available = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    return resident_bytes(device) + available, "this process's memory plus the RAM available"


def fit_advice(estimate: StepMemory, *, use_peft: bool, gradient_checkpointing: bool, optim: str) -> str:
    """The settings to lower, biggest part first."""
    activations = estimate.activations + estimate.logits
    states = estimate.gradients + estimate.optimizer
    advice = []
    if max(activations, estimate.kv_cache) >= states:
        advice.append("lower per_device_train_batch_size (raise gradient_accumulation_steps to keep the batch) or "
                      "max_completion_length")
        if not gradient_checkpointing:
            advice.append("set gradient_checkpointing true")
    if not use_peft:
        advice.append("set use_peft true (LoRA: gradients and optimizer states for the adapter only)")
    if "8bit" not in optim:
        advice.append("set optim paged_adamw_8bit (2 bytes of state a parameter instead of 8)")
    if use_peft:
        advice.append("set load_in_4bit true (QLoRA: a 4-bit base)")
    return "; or ".join(advice)


def check_step_memory(estimate: StepMemory, budget: int, source: str, **settings) -> None:
    """Raise MemoryError naming the settings to lower when the estimated peak exceeds the budget."""
    if estimate.total <= budget:
        return
    raise MemoryError(
        f"a training step would need about {estimate.total / GB:.1f} GB ({estimate.describe()}, in GB) but "
        f"{source} is {budget / GB:.1f} GB. To fit: {fit_advice(estimate, **settings)}. (max_memory sets the "
        f"budget, in GB)")
