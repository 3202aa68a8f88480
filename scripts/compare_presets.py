"""Train every method preset on the same prompts with the same seed, then print one table of what each did.

    python scripts/compare_presets.py                       # all presets, 40 steps' prompts each (the demo)
    python scripts/compare_presets.py --algos grpo agrpo --max_steps 20 -- --learning_rate 1e-5 --seed 7

Every preset trains on the same prompts in the same order: `--max_steps` steps' worth (P prompts each, the
default 2). A preset that makes mu > 1 updates per generation batch (agpo_dsf: 4) runs mu times as many optimizer
steps, as AGPO-DSF itself counts a step; one that samples several steps' prompts in one rollout (gspo: 4,
steps_per_generation) runs the same steps from fewer, larger generation batches.
Each preset runs `train_agrpo.py --algo <name>` into `<output_dir>/<name>/` (arguments after `--` go to every run),
one after the other. A run that already has its `final/` folder is not run again, so an interrupted comparison
continues where it stopped. The table (markdown, also written to `<output_dir>/presets.md`) has, per preset:
greedy held-out accuracy before and after, and over the last five steps the mean KL to the reference (in the
preset's own estimator: k3, symmetric or k1; none when beta is 0), the entropy of the sampling distribution, the
completion length, the tokens generated in all (probe groups and discarded resampling rounds included), and the
generation batches (rollouts) and optimizer steps run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from lib.config import PRESETS, parse_config  # noqa: E402  (the repository root is put on the path just above)
from lib.trl_keys import resolve_keys  # noqa: E402

LAST = 5  # steps averaged for the end-of-run columns


def train_command(algo: str, out: Path, max_steps: int, extra: list[str]) -> list[str] | None:
    """The `train_agrpo.py` command line for one run into `out`: None when the run is complete (it has `final/`),
    `--resume_from_checkpoint latest` when an interrupted run left a checkpoint, `--overwrite_output_dir true` when
    it left lines but no checkpoint. Shared with scripts/ablate.py."""
    if (out / "final").exists():
        return None
    command = [sys.executable, str(REPO / "train_agrpo.py"), "--algo", algo, "--max_steps", str(max_steps),
               "--output_dir", str(out)]
    if (out / "metrics.jsonl").exists():  # interrupted: continue from its checkpoint, or start over without one
        has_checkpoint = any(out.glob("checkpoint-*/trainer_state.json"))
        command += ["--resume_from_checkpoint", "latest"] if has_checkpoint else ["--overwrite_output_dir", "true"]
    return command + extra


def preset_steps(algo: str, batches: int, extra: list[str]) -> int:
    """Optimizer steps that make `batches` generation batches for `algo`: a preset with mu > 1 updates per batch
    (AGPO-DSF's 4 update epochs, num_iterations) takes mu steps on each. AGPO-DSF counts a step per rollout batch
    (its scheduler runs max_steps x update_epochs, docs/methods.md 5.1); at 40 optimizer steps it would see 20 prompts
    where every other preset sees 80."""
    return batches * parse_config(["--algo", algo, *extra], keys=resolve_keys).num_iterations


def run_preset(algo: str, out: Path, max_steps: int, extra: list[str]) -> float | None:
    """Train one preset unless its run is complete; returns the wall time in seconds (None if it was skipped)."""
    command = train_command(algo, out, max_steps, extra)
    if command is None:
        return None
    start = time.perf_counter()
    subprocess.run(command, check=True)
    return time.perf_counter() - start


def summarize_run(out: Path) -> dict:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [m for m in lines if "eval/accuracy" in m]
    train = [m for m in lines if "reward" in m][-LAST:]
    config = yaml.safe_load((out / "config.yaml").read_text())

    def mean(key: str) -> float:
        return sum(m[key] for m in train) / len(train)

    return {"start": evals[0]["eval/accuracy"], "end": evals[-1]["eval/accuracy"],
            "kl": mean("kl") if config["beta"] > 0 else None, "estimator": config["kl_estimator"],
            "entropy": mean("entropy"), "length": mean("completions/mean_length"),
            "tokens": train[-1]["num_tokens"], "steps": train[-1]["step"],
            "batches": train[-1]["step"] // (config["num_iterations"] * slices_per_generation(config))}


def slices_per_generation(config: dict) -> int:
    """Optimizer steps a generation batch is split into: steps_per_generation counts micro-batches (TRL's meaning)
    over gradient_accumulation_steps each; runs older than that change wrote it in optimizer steps with 1 micro-batch
    a step, where both readings agree."""
    accumulation = config.get("gradient_accumulation_steps", 1)
    return max(1, (config.get("steps_per_generation") or accumulation) // accumulation)


def table(rows: dict[str, dict]) -> str:
    head = ("| preset | accuracy start | accuracy end | change | KL (estimator) | entropy | length | "
            "generated tokens | rollouts (updates) |\n|---|---|---|---|---|---|---|---|---|\n")
    body = ""
    for algo, r in rows.items():
        kl = f"{r['kl']:.4f} ({r['estimator']})" if r["kl"] is not None else "- (beta 0)"
        body += (f"| {algo} | {r['start']:.1%} | {r['end']:.1%} | {100 * (r['end'] - r['start']):+.1f} pts | {kl} | "
                 f"{r['entropy']:.3f} | {r['length']:.1f} | {r['tokens']:,} | {r['batches']} ({r['steps']}) |\n")
    return head + body


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algos", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    parser.add_argument("--max_steps", type=int, default=40, help="Steps' worth of prompts per preset (40: the demo "
                        "default), the same prompts in the same order for every preset; a preset that updates mu > 1 "
                        "times per generation batch (agpo_dsf) runs mu x this many optimizer steps.")
    parser.add_argument("--output_dir", default="runs/presets")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    root = Path(args.output_dir)
    rows = {}
    for algo in args.algos:
        seconds = run_preset(algo, root / algo, preset_steps(algo, args.max_steps, extra), extra)
        if seconds is not None:
            print(f"{algo}: {seconds / 60:.1f} min", flush=True)
        rows[algo] = summarize_run(root / algo)
    text = table(rows)
    (root / "presets.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
