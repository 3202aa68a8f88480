"""A vLLM generation server on devices of its own, and the trainer's client for it (docs/distributed.md 6).

`python serve_vllm.py --model <base model>` serves one engine over HTTP; a run with `vllm_mode: server` samples
through it (`ServerRollout`, the colocated `VLLMRollout`'s interface) and pushes the policy's weights to it before
each generation batch the weights moved for (lib/setup.ready_sampler) through a torch.distributed group of its own:
the trainer's main process (rank 0) and each of the server's vLLM workers (ranks 1..). The group is NCCL between
GPUs and gloo between CPUs, the only difference between the two: the same broadcasts either way.

Protocol (JSON over HTTP):
  GET  /health                    the model, the engine's dtype, the server's id (a new one at every start), the
                                  number of weight updates received and the last one's version; whether it can
                                  take weights in flight (`inflight_updates`) and the steps of the stepped call
                                  in progress (`steps`)
  POST /generate                  `VLLMRollout.generate`'s arguments, plus the trainer's seed and call count (so a
                                  sample is the one a colocated engine of the same seed would draw); with
                                  `"inflight": true` (vllm_inflight_updates) the call is stepped, weight updates
                                  land between its decode steps, and the rollout carries `token_versions`, each
                                  completion token's version (lib/sampling/inflight.py; absent otherwise)
  POST /init_weight_group         port, world_size: the server's workers form the weight group, its store served
                                  by the first worker on that port of the server's node; the trainer joins it at the
                                  address it reaches the server at (no name of the trainer's is resolved there)
  POST /update_weights            {"version": the trainer's optimizer step}: the workers receive the weights
                                  rank 0 broadcasts (a header, the name, the tensor, for each; `send_weights`)
                                  and load each in place as it comes, between two decode steps of a stepped call
                                  in progress, else between calls; the prefix cache is dropped (at the stepped
                                  call's end: sequences in flight keep their KV cache)
  POST /close_weight_group        the workers drop the group and its store: the port is free for the next run (the
                                  trainer posts it at its end; /init_weight_group drops a group a run left too)

The server runs one engine call at a time (the engine is not shared between calls); a weight update waits for the
call to end, except one posted during a stepped call (weights in flight: PipelineRL's in-flight updates, Piché et
al. 2025). A trainer that reaches no server says so with the address and the command to start one; a request that
takes longer than `vllm_server_timeout` ends with an error naming the setting; a server that restarted (another id)
has lost the pushed weights, and the trainer stops with a message instead of sampling from the base model.
"""

from __future__ import annotations

import dataclasses
import gc
import threading
import time
from datetime import timedelta

import torch

from lib.models.modeling import end_token_ids
from lib.sampling.rollout import AnswerPhase, Rollout
from lib.sampling.vllm_rollout import SeededWorker, policy_weights, refresh_tied_output_layer

ROLLOUT_FIELDS = [f.name for f in dataclasses.fields(Rollout)]


class ServerError(RuntimeError):
    """The generation server is down, too slow, restarted or refused a request: the message says which and what to
    do."""


# ------------------------------------------------------------------------------------------------ the weight group


def weight_group(host: str, port: int, rank: int, world_size: int, timeout_s: float = 300.0,
                 serves_store: bool = False):
    """A process group of its own (not torch.distributed's default one, which the trainer's processes use among
    themselves): a TCP store on host:port (`serves_store`: this process serves it, on every interface) and NCCL
    between GPUs, gloo between CPUs. The server's first worker serves the store, so every process connects to the
    server's address, the one the trainer already reaches it at: NCCL and gloo then exchange numeric addresses
    through the store, and no node needs to resolve another's name."""
    store = torch.distributed.TCPStore(host, port, world_size, is_master=serves_store,
                                       timeout=timedelta(seconds=timeout_s))
    if torch.cuda.is_available():
        return torch.distributed.ProcessGroupNCCL(store, rank, world_size)
    return torch.distributed.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=timeout_s))


def broadcast(group, tensor: torch.Tensor) -> None:
    """Send (rank 0) or receive (the others) one tensor, in place."""
    options = torch.distributed.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


# the weights go over the group as a stream, each tensor after a header (so that only one exists at a time on either
# side): int64 [more, dtype, name length, ndim, dims...], the name's UTF-8 bytes, the tensor
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8]
HEADER = 12  # 4 fields and up to 8 dimensions


def send_weights(group, weights, device: torch.device | str = "cpu") -> int:
    """Rank 0: broadcast every (name, tensor) of `weights`, then an end marker. Returns the bytes sent."""
    sent = 0
    for name, tensor in weights:
        tensor = tensor.detach().contiguous().to(device)
        encoded = torch.tensor(list(name.encode()), dtype=torch.uint8, device=device)
        header = torch.zeros(HEADER, dtype=torch.int64, device=device)
        header[:4] = torch.tensor([1, DTYPES.index(tensor.dtype), encoded.numel(), tensor.dim()])
        header[4:4 + tensor.dim()] = torch.tensor(tensor.shape)
        for part in (header, encoded, tensor):
            broadcast(group, part)
        sent += tensor.numel() * tensor.element_size()
    broadcast(group, torch.zeros(HEADER, dtype=torch.int64, device=device))  # more = 0: the end
    return sent


def receive_weights(group, device: torch.device | str = "cpu"):
    """The other ranks: (name, tensor) pairs as rank 0 sends them, one at a time, until its end marker."""
    while True:
        header = torch.zeros(HEADER, dtype=torch.int64, device=device)
        broadcast(group, header)
        more, dtype, length, ndim = header[:4].tolist()
        if not more:
            return
        encoded = torch.empty(length, dtype=torch.uint8, device=device)
        broadcast(group, encoded)
        tensor = torch.empty(header[4:4 + ndim].tolist(), dtype=DTYPES[dtype], device=device)
        broadcast(group, tensor)
        yield bytes(encoded.cpu().tolist()).decode(), tensor


class WeightReceiver(SeededWorker):
    """Mixed into each of the server's vLLM workers (`worker_extension_cls`; the names are prefixed so as not to
    collide with the worker's own methods): forms the weight group with the trainer and loads the tensors it
    broadcasts into the worker's model in place, one at a time; seeded per call (SeededWorker)."""

    def agrpo_init_weight_group(self, port: int, world_size: int, rank_offset: int = 1) -> None:
        # the first worker serves the group's store on `port`; the others (on its node) and the trainer connect. A
        # group a run before this one left (it stopped without closing it) is dropped first: its store holds the port
        self.agrpo_close_weight_group()
        rank = getattr(self, "rank", 0)
        self.weight_group = weight_group("127.0.0.1", port, rank_offset + rank, world_size, serves_store=rank == 0)

    def agrpo_receive_weights(self) -> None:
        device = getattr(self, "device", None) if torch.cuda.is_available() else torch.device("cpu")
        self.model_runner.reload_weights(weights_iterator=receive_weights(self.weight_group, device))
        refresh_tied_output_layer(self.model_runner.get_model())

    def agrpo_close_weight_group(self) -> None:
        """Drop the group and, with it, the store it was formed on (the port is free once nothing refers to it)."""
        if getattr(self, "weight_group", None) is not None:
            self.weight_group = None
            gc.collect()


# ------------------------------------------------------------------------------------------------ the trainer's side


def tensor_parallel_size(config, gpus: int) -> int:
    """The largest tensor-parallel degree up to `gpus` that vLLM accepts for a model: a power of two (the layers'
    widths split evenly: Qwen2.5-1.5B's MLP, 8,960 wide, does not split in 6) that divides the attention heads and
    the MLP width, and the KV heads where there are at least as many (fewer KV heads are replicated, so the degree
    must be a multiple of them). Qwen2.5-7B (28 heads, 4 KV heads) on 8 GPUs: 4; Qwen2.5-1.5B (12, 2): 4;
    Qwen2.5-0.5B (14, 2): 2."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    width = getattr(text, "intermediate_size", None) or heads
    size = 1
    while size * 2 <= gpus and heads % (size * 2) == 0 and width % (size * 2) == 0 and \
            (kv_heads % (size * 2) == 0 if kv_heads >= size * 2 else (size * 2) % kv_heads == 0):
        size *= 2
    return size


class ServerRollout:
    """The sampler of a run with vllm_mode server: `VLLMRollout`'s interface over HTTP. Every process samples its
    share through the server; the main process pushes the weights (a sharded policy is gathered on every process,
    a parameter at a time, for it)."""

    def __init__(self, base_url: str, eos_token_ids: list[int], pad_token_id: int, *, seed: int, group_port: int,
                 timeout_s: float, is_main: bool, sharded: bool = False, connect_timeout_s: float | None = None,
                 world: int = 1, inflight: bool = False):
        self.base_url, self.timeout_s = base_url.rstrip("/"), timeout_s
        self.eos_token_ids, self.pad_token_id = sorted(set(eos_token_ids)), pad_token_id
        self.seed, self.calls = seed, 0
        self.is_main, self.sharded = is_main, sharded
        self.world = world  # the run's processes: the server serves their requests of a step in one engine call
        # weights in flight (vllm_inflight_updates, lib/sampling/inflight.py): the loop's thread pushes while the
        # sampling thread's request is out, each thread with its own connection; `weight_version` labels the next
        # push (the optimizer step of its weights), which the server reports for every token sampled with them
        self.inflight, self.weight_version = inflight, 0
        self._local, self._clients = threading.local(), []
        self.health = self._wait_for_server(timeout_s if connect_timeout_s is None else connect_timeout_s)
        self.server_id = self.health["server_id"]
        if inflight and not self.health.get("inflight_updates"):
            raise ServerError(f"vllm_inflight_updates: the generation server at {self.base_url} cannot take weights "
                              f"between decode steps (its engine schedules a step while the one before runs, or it "
                              f"predates in-flight updates): restart it with python serve_vllm.py --inflight_updates "
                              f"..., or set vllm_inflight_updates false")
        self.dtype = getattr(torch, self.health["dtype"])
        self.group = None
        if is_main:
            world = 1 + int(self.health["workers"])
            # the server's first worker starts serving the group's store (in the background there), then this
            # process joins it as rank 0 at the server's own address
            self._post("/init_weight_group", {"port": group_port, "world_size": world})
            self.group = self._join_group(group_port, world, timeout_s)
            self._until(lambda health: health["group"], "joining the weight group")

    @property
    def http(self):
        """This thread's HTTP client (the sampling thread's requests and the loop's pushes go side by side)."""
        import httpx

        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = httpx.Client(timeout=self.timeout_s)
            self._clients.append(client)
        return client

    def _join_group(self, port: int, world: int, timeout_s: float):
        """Rank 0 of the weight group, whose store the server serves on `port` at the address of base_url; a
        ServerError naming vllm_group_port where it cannot be reached (a closed port between the nodes)."""
        host = server_host(self.base_url)
        try:
            return weight_group(host, port, 0, world, timeout_s)
        except (RuntimeError, ValueError) as error:  # torch.distributed's DistError is a RuntimeError
            raise ServerError(
                f"vllm_mode server: could not join the weight group the generation server serves at {host}:{port} "
                f"(vllm_group_port) within {timeout_s:.0f} s ({type(error).__name__}: {str(error)[:300]}). The "
                f"trainer's main process must reach that port on the server's node: open it, or choose a free "
                f"one with --vllm_group_port") from None

    def _wait_for_server(self, timeout_s: float) -> dict:
        import httpx

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                response = self.http.get(f"{self.base_url}/health", timeout=min(10.0, timeout_s))
                response.raise_for_status()
                return response.json()
            except httpx.HTTPError as error:
                if time.monotonic() >= deadline:
                    raise ServerError(
                        f"vllm_mode server: no generation server answered at {self.base_url} within "
                        f"{timeout_s:.0f} s (vllm_server_timeout; {type(error).__name__}: {error}). Start it first, "
                        f"on its own devices, with the run's base model: python serve_vllm.py --model <model> "
                        f"--port <port>; then give its address as vllm_server_base_url (or vllm_server_host and "
                        f"vllm_server_port)") from None
                time.sleep(1.0)

    def _post(self, path: str, payload: dict) -> dict:
        import httpx

        try:
            response = self.http.post(f"{self.base_url}{path}", json=payload)
        except httpx.TimeoutException:
            raise ServerError(f"the generation server at {self.base_url} did not answer {path} within "
                              f"{self.timeout_s:.0f} s (vllm_server_timeout): raise it, or give the server more "
                              f"devices") from None
        except httpx.HTTPError as error:
            raise ServerError(f"the generation server at {self.base_url} stopped answering ({path}: "
                              f"{type(error).__name__}: {error}). Restart it (python serve_vllm.py ...) and resume "
                              f"the run with --resume_from_checkpoint latest") from None
        if response.status_code != 200:
            raise ServerError(f"the generation server at {self.base_url} refused {path}: {response.text[-2000:]}")
        answer = response.json()
        if answer.get("server_id", self.server_id) != self.server_id:
            raise self._restarted()
        return answer

    def _restarted(self) -> ServerError:
        return ServerError(f"the generation server at {self.base_url} restarted: it holds the base model's weights, "
                           f"not the policy's, so sampling from it would train on the wrong distribution. Resume the "
                           f"run with --resume_from_checkpoint latest (it pushes the checkpoint's weights at start)")

    def _until(self, done, what: str) -> dict:
        """Poll /health until done(health) or the server reports an error, within vllm_server_timeout."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            health = self._get_health()
            if health.get("error"):
                raise ServerError(f"the generation server at {self.base_url} failed while {what}: {health['error']}")
            if done(health):
                return health
            if time.monotonic() >= deadline:
                raise ServerError(f"the generation server at {self.base_url} did not finish {what} within "
                                  f"{self.timeout_s:.0f} s (vllm_server_timeout)")
            time.sleep(0.05)

    def _get_health(self) -> dict:
        import httpx

        try:
            health = self.http.get(f"{self.base_url}/health").json()
        except httpx.HTTPError as error:
            raise ServerError(f"the generation server at {self.base_url} stopped answering ({type(error).__name__}: "
                              f"{error}). Restart it (python serve_vllm.py ...) and resume the run with "
                              f"--resume_from_checkpoint latest") from None
        if health["server_id"] != self.server_id:
            raise self._restarted()
        return health

    @torch.no_grad()
    def sync_weights(self, policy: torch.nn.Module) -> None:
        """Push every weight (a LoRA adapter merged) in the engine's dtype, one tensor at a time, from the main
        process; the server loads each in place as it comes. A sharded policy is gathered on every process (a
        collective), so every process walks the weights."""
        if not self.is_main and not self.sharded:
            return
        weights = ((name, tensor.to(self.dtype)) for name, tensor in policy_weights(policy, merge_adapter=True))
        if not self.is_main:
            for _ in weights:
                pass
            return
        # the server starts receiving (between two decode steps, with weights in flight); this process sends
        update = self._post("/update_weights", {"version": self.weight_version})["update"]
        send_weights(self.group, weights, "cuda" if torch.cuda.is_available() else "cpu")
        self._until(lambda health: health["updates"] >= update, "loading the pushed weights")

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, num_generations, max_new_tokens: int,
                 temperature=1.0, top_p=1.0, top_k: int = 0, greedy: bool = False,
                 answer_phase: AnswerPhase | None = None, min_p: float = 0.0,
                 repetition_penalty: float = 1.0) -> Rollout:
        """As `VLLMRollout.generate`, on the server, with this process's seed and call count."""
        payload = {
            "seed": self.seed, "calls": self.calls, "eos_token_ids": self.eos_token_ids,
            "pad_token_id": self.pad_token_id, "prompt_ids": prompt_ids.cpu().tolist(),
            "prompt_mask": prompt_mask.cpu().tolist(),
            "num_generations": torch.as_tensor(num_generations).tolist(), "max_new_tokens": max_new_tokens,
            "temperature": torch.as_tensor(temperature, dtype=torch.float32).tolist(),
            "top_p": torch.as_tensor(top_p, dtype=torch.float32).tolist(), "top_k": top_k, "greedy": greedy,
            "answer_phase": dataclasses.asdict(answer_phase) if answer_phase is not None else None,
            "min_p": min_p, "repetition_penalty": repetition_penalty, "world": self.world,
        }
        if self.inflight:  # stepped, taking weights between steps; each token's version comes back
            payload["inflight"] = True
        self.calls += 1
        answer = self._post("/generate", payload)
        return rollout_from_json(answer["rollout"], prompt_ids.device)

    def state_dict(self) -> dict:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self.calls = int(state.get("calls", 0))

    def sleep(self) -> None:
        """The server's devices are its own: nothing to free here."""

    def ready(self, policy: torch.nn.Module) -> None:
        """The server is always awake."""

    def close(self) -> None:
        """Leave the weight group, so that the server frees its port for the next run (a run after this one may
        use the same vllm_group_port), and close the connections. A server that is down holds nothing to free."""
        import httpx

        if self.group is not None:
            self.group = None
            try:
                self.http.post(f"{self.base_url}/close_weight_group", json={}, timeout=10)
            except httpx.HTTPError:
                pass
        for client in self._clients:
            client.close()


# ------------------------------------------------------------------------------------------------ rollouts as JSON


def server_host(base_url: str) -> str:
    """The host of a server URL, as this machine connects to it (0.0.0.0, which a server listens on for every
    interface, is this machine)."""
    from urllib.parse import urlsplit

    host = urlsplit(base_url).hostname or "127.0.0.1"
    return "127.0.0.1" if host in ("0.0.0.0", "localhost") else host


# fields a rollout carries only where asked for, left out of the JSON otherwise (the protocol as it was before them)
OPTIONAL_FIELDS = ("token_versions",)


def rollout_to_json(rollout: Rollout) -> dict:
    out = {}
    for name in ROLLOUT_FIELDS:
        value = getattr(rollout, name)
        if value is None and name in OPTIONAL_FIELDS:
            continue
        out[name] = None if value is None else {"dtype": str(value.dtype).removeprefix("torch."),
                                                "shape": list(value.shape), "values": value.cpu().flatten().tolist()}
    return out


def rollout_from_json(data: dict, device: torch.device | str = "cpu") -> Rollout:
    def tensor(entry):
        if entry is None:
            return None
        return torch.tensor(entry["values"], dtype=getattr(torch, entry["dtype"])).reshape(entry["shape"]).to(device)

    return Rollout(**{name: tensor(data.get(name)) for name in ROLLOUT_FIELDS})


def server_rollout(cfg, policy, tokenizer, rank: int, sharded: bool = False,
                   world: int = 1) -> ServerRollout:
    """vllm_mode server's sampler, as train_agrpo.setup makes it: the client of the server the
    configuration names, given the policy's weights before the first sample (a policy that will be
    sharded sends gathered weights)."""
    url = cfg.vllm_server_base_url or f"http://{cfg.vllm_server_host}:{cfg.vllm_server_port}"
    engine = ServerRollout(url, end_token_ids(policy, tokenizer), tokenizer.pad_token_id,
                           seed=cfg.seed + rank, group_port=cfg.vllm_group_port,
                           timeout_s=cfg.vllm_server_timeout, is_main=rank == 0, sharded=sharded,
                           world=world, inflight=bool(cfg.vllm_inflight_updates))
    engine.sync_weights(policy)
    return engine
