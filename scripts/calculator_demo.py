"""The calculator demo (docs/agents.md 8): the embedded model learns to call a calculator for word problems whose
arithmetic it gets wrong, next to the same runs without the tool.

    python scripts/calculator_demo.py --configs grpo/tools grpo/direct agrpo/tools --seeds 42 43 44 \\
        --max_steps 10 --output_dir runs/calculator

Each configuration is a preset (`--algo`) and a variant: `tools` (the calculator, the data's worked example calls it)
or `direct` (no tool, the worked example answers directly; the same problems: scripts/calculator_task.py). Each run
is `train_agrpo.py` with its own greedy held-out evaluation before and after training (the trainer's, which runs
whole episodes with tools: the same tool, turns and limits as training). Written to <output_dir>: data/, runs/,
table.md (mean +- sample standard deviation over seeds of the accuracy before and after, the tool calls per
completion, the minutes a run took). A finished run is kept when the command is run again. Arguments after `--` go
to every run. `--probe N` measures instead how the starting model takes the call format under three prompt forms.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts import calculator_task  # noqa: E402

VARIANTS = {
    "tools": ["--tools", "lib.agents.tools:calculator", "--max_tool_calling_iterations", "2"],
    "direct": [],
}


def run_dir(out: Path, config: str, seed: int) -> Path:
    method, variant = config.split("/")
    return out / "runs" / method / variant / f"seed{seed}"


def evaluations(folder: Path) -> list[dict]:
    """The run's held-out evaluations, in step order ([] before the first)."""
    path = folder / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "eval/accuracy" in r]


def train(out: Path, config: str, seed: int, args: argparse.Namespace, extra: list[str]) -> None:
    method, variant = config.split("/")
    folder = run_dir(out, config, seed)
    done = evaluations(folder)
    if done and done[-1]["step"] >= args.max_steps:
        print(f"{config} seed {seed}: done earlier")
        return
    data = out / "data" / variant
    command = [sys.executable, str(REPO / "train_agrpo.py"), "--algo", method, "--seed", str(seed),
               "--dataset_name", str(data / "train.jsonl"), "--eval_dataset_name", str(data / "test.jsonl"),
               "--num_eval_samples", str(args.num_eval_samples), "--max_steps", str(args.max_steps),
               "--max_completion_length", "64", "--save_steps", str(args.max_steps), "--report_to", "none",
               "--output_dir", str(folder), "--overwrite_output_dir", *VARIANTS[variant], *extra]
    print(f"{config} seed {seed}: " + " ".join(command[1:]), flush=True)
    start = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"seed{seed}.log", "w") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    (folder / "minutes.txt").write_text(f"{(time.perf_counter() - start) / 60:.1f}\n")


def spread(values: list[float]) -> str:
    mean = statistics.fmean(values)
    return f"{100 * mean:.1f}% +- {100 * statistics.stdev(values):.1f}" if len(values) > 1 else f"{100 * mean:.1f}%"


def table(out: Path, configs: list[str], seeds: list[int]) -> str:
    lines = ["| configuration | seeds | accuracy before | accuracy after | tool calls after | minutes a run |",
             "|---|---|---|---|---|---|"]
    for config in configs:
        rows = [(evaluations(run_dir(out, config, s)), run_dir(out, config, s)) for s in seeds]
        rows = [(e, f) for e, f in rows if len(e) >= 2]
        if not rows:
            continue
        before = [e[0]["eval/accuracy"] for e, _ in rows]
        after = [e[-1]["eval/accuracy"] for e, _ in rows]
        calls = [e[-1].get("eval/tool_calls", 0.0) for e, _ in rows]
        minutes = [float((f / "minutes.txt").read_text()) for _, f in rows if (f / "minutes.txt").exists()]
        lines.append(f"| {config} | {len(rows)} | {spread(before)} | {spread(after)} | "
                     f"{statistics.fmean(calls):.2f} | {statistics.fmean(minutes) if minutes else float('nan'):.1f} |")
    return "\n".join(lines) + "\n"


def probe(samples: int, seed: int = 0) -> str:
    """How the starting model takes the plain call format (docs/agents.md 10): of `samples` completions of each of 12
    problems (temperature 0.7, the trainer's default, no top-k; at most 48 tokens), how many write a tool call, and
    how many call the calculator with an expression that gives the answer, for three prompt forms: the tools'
    description in the system prompt; the same with an example call written in it; the description and the data's
    worked example as earlier turns (the `tools` variant's prompts)."""
    import re

    import torch
    from transformers import AutoModelForCausalLM

    from lib.data.records import render_prompt
    from lib.agents.tools import calculator, plain_tool_prompt, tool_schemas
    from lib.models.embedded import embedded_model_path
    from lib.models.modeling import load_tokenizer

    path = str(embedded_model_path())
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(seed)
    problems = [calculator_task.problem(rng) for _ in range(12)]
    system = plain_tool_prompt(tool_schemas([calculator]))
    example = (f"\n\nFor example, asked \"{calculator_task.EXAMPLE_QUESTION}\", you write "
               f"{calculator_task.EXAMPLE_CALL}, the tool answers 391, and you write Answer: 391.")
    forms = {"description": (system, False), "description + example call in it": (system + example, False),
             "description + worked example as earlier turns": (system, True)}
    lines = ["| prompt | writes a tool call | calls the calculator with the right expression |", "|---|---|---|"]
    for name, (system_prompt, shot) in forms.items():
        torch.manual_seed(seed)
        calls = right = 0
        for text, answer in problems:
            ask = [{"role": "user", "content": f"{text}\n{calculator_task.INSTRUCTION}"}]
            record = {"prompt": (calculator_task.example(False) if shot else []) + ask}
            ids = tokenizer(render_prompt(tokenizer, record, "", system_prompt), return_tensors="pt")
            out = model.generate(**ids, do_sample=True, temperature=0.7, top_k=0, max_new_tokens=48,
                                 num_return_sequences=samples, pad_token_id=tokenizer.pad_token_id)
            for row in out[:, ids.input_ids.shape[1]:]:
                completion = tokenizer.decode(row, skip_special_tokens=True)
                calls += "<tool_call>" in completion
                expression = re.search(r'"expression":\s*"([^"]*)"', completion)
                try:
                    right += bool(expression) and calculator(expression.group(1)) == str(answer)
                except (ValueError, SyntaxError):  # what the calculator refuses: not arithmetic
                    pass
        total = samples * len(problems)
        lines.append(f"| {name} | {calls} / {total} | {right} / {total} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["grpo/tools", "grpo/direct"], metavar="ALGO/VARIANT")
    p.add_argument("--seeds", nargs="+", type=int, default=[42, 43, 44])
    p.add_argument("--max_steps", type=int, default=10)
    p.add_argument("--num_eval_samples", type=int, default=100, help="Held-out problems, greedy.")
    p.add_argument("--output_dir", default="runs/calculator")
    p.add_argument("--probe", type=int, default=0, metavar="N", help="Only measure how the starting model takes the "
                   "call format (N samples of each of 12 problems per prompt form; docs/agents.md 10), then stop.")
    args = p.parse_args(argv)
    if args.probe:
        print(probe(args.probe))
        return
    for config in args.configs:
        method, _, variant = config.partition("/")
        if variant not in VARIANTS:
            p.error(f"--configs: {config!r} is not ALGO/VARIANT with VARIANT one of {', '.join(VARIANTS)}")
    out = Path(args.output_dir)
    for variant in {c.split("/")[1] for c in args.configs}:
        calculator_task.main(["--out", str(out / "data" / variant), "--num_test", str(args.num_eval_samples)]
                             + (["--direct"] if variant == "direct" else []))
    for seed in args.seeds:  # seed-major: a stopped demo has every configuration at the first seeds
        for config in args.configs:
            train(out, config, seed, args, extra)
            (out / "table.md").write_text(table(out, args.configs, args.seeds))
    print(table(out, args.configs, args.seeds))


if __name__ == "__main__":
    main()
