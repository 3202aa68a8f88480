"""The sampler a run samples with, built from the settings by one function, `make_sampler`, that the trainer and the
evaluator call: the HF sampler (lib/sampling/rollout.HFRollout, our decode loop) or, with use_vllm, a colocated vLLM
engine (lib/sampling/vllm_rollout.colocated_rollout); with `sampler_device`, the HF sampler in a process of its own
(lib/sampling/sampler_process.py). The trainer's other sampler, an engine on devices of its own
(vllm_mode server), is lib/sampling/generation_server.server_rollout. The chat page streams each answer token by token
with its model's own `generate` and builds no sampler.
"""

from __future__ import annotations

from functools import partial

from lib.config import setting
from lib.models.modeling import end_token_ids
from lib.sampling import vllm_rollout
from lib.sampling.rollout import HFRollout


def make_engine(policy, tokenizer, bf16: bool, seed: int, sharded: bool = False,
                headroom: int | None = None) -> HFRollout:
    """The HF sampler (lib/sampling/rollout.py): our decode loop, over the policy itself or a copy of its weights that
    lib/sampling/cpu_kernels.sampling_copy makes where that is faster, refreshed before each generation batch that
    follows an optimizer step (lib/setup.ready_sampler); a policy that will be sharded is sampled from a full copy
    (`own_copy`); a LoRA / QLoRA policy whose copy does not fit `headroom` bytes (lib/sharding/memory.copy_headroom)
    decodes from its own layers (lib/sharding/memory.sampler_plan)."""
    # imported when a sampler is made, not with this module: it registers the CPU decode attention with transformers
    # (lib/models/modeling.FAST_ATTENTION), which loads transformers' model code (about 1.3 s), and --help or a
    # refused configuration need none of it
    from lib.sampling.cpu_kernels import sampling_copy

    return HFRollout(policy, end_token_ids(policy, tokenizer), tokenizer.pad_token_id, bf16=bf16,
                     seed=seed, copy=partial(sampling_copy, own_copy=sharded, headroom=headroom))


def make_sampler(policy, tokenizer, settings, bf16: bool, *, rank: int = 0, model_path: str | None = None,
                 max_num_seqs: int | None = None, own_copy: bool = False, headroom: int | None = None,
                 lora_sync: str | None = None):
    """The sampler of `policy`, as `settings` ask (use_vllm, seed and the vllm_* keys; a run's Config or the
    evaluator's arguments, lib/config.setting): a colocated vLLM engine loaded from `model_path` (its base for an
    adapter) and given the policy's weights, `max_num_seqs` sequences a call (the trainer's largest call where None)
    and `lora_sync` the LoRA sync (vllm_lora_sync where None); with sampler_device the HF sampler in a process on that
    device; else the HF sampler (`make_engine`, with `own_copy` and `headroom`). Process `rank` samples from seed + rank."""
    if settings.use_vllm:
        return vllm_rollout.colocated_rollout(settings, policy, tokenizer, model_path, bf16, rank,
                                              max_num_seqs=max_num_seqs, lora_sync=lora_sync)
    device = setting(settings, "sampler_device")
    if device is not None:  # the HF sampler in a process of its own (max_staleness, docs/async.md 8)
        from lib.sampling.sampler_process import process_rollout

        return process_rollout(policy, tokenizer, bf16, settings.seed + rank, device)
    return make_engine(policy, tokenizer, bf16, settings.seed + rank, own_copy, headroom)
