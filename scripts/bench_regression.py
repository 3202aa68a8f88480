"""Regression benchmark: this working tree's trainer against another revision's, phase by phase, in alternated rounds.

    python scripts/bench_regression.py --against HEAD~1                 # the default short run, 3 rounds
    python scripts/bench_regression.py --against 01f7119 --rounds 5 -- --bf16 false --max_completion_length 128
    python scripts/bench_regression.py --b_flags "--max_staleness 1" -- <flags>   # this tree against itself with
                                                                                  # other flags (docs/async.md)

Run it before submitting a change to the loop, the sampler, the scorer or the model code, and quote its table. Each
round runs both trainers once, in alternating order (A B, then B A, ...), as fresh processes with the same flags and
seed; the other revision runs from a temporary `git worktree` of it (the same interpreter and packages). From each
run's metrics.jsonl it takes, per step after the first `--warmup_steps`, the step time and each phase's time
(`time/generation`, `time/policy`, ...).

Where both revisions sample the same completions (the same tokens, loss and gradient norm at every step: the change
did not touch what is computed) the phases are compared step for step; otherwise a step's work differs with its
completions, so the times are divided by the tokens generated in the step first (seconds per thousand tokens).
Printed: each phase's median for A and B, and the ratio A / B as the median of the rounds' ratios with their
min-max, which says how much of a difference the machine's noise can make. `--b_flags` makes B this working tree with
those flags added instead of another revision (an asynchronous run against the synchronous one: there the step's
time includes the loop's wait for its batch, so its ratio is the throughput's). On a machine with `nvidia-smi`, each
run's mean GPU utilisation (sampled every 200 ms) is printed too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("generation", "rewards", "reference", "policy", "optimizer", "weight_sync")
# a short run of the default demo: 4 steps of 8 completions of up to 64 tokens, no evaluation or saving
DEFAULT_FLAGS = ["--max_steps", "4", "--per_device_train_batch_size", "8", "--num_generations", "8",
                 "--max_completion_length", "64", "--builtin_num_train", "64"]


def run(tree: Path, flags: list[str], out: Path, utilisation: list | None = None) -> list[dict]:
    command = [sys.executable, "train_agrpo.py", *flags, "--output_dir", str(out), "--overwrite_output_dir", "true",
               "--report_to", "none", "--save_strategy", "no", "--num_eval_samples", "0", "--log_completions",
               "false"]
    with GpuUtilisation() as gpu:
        proc = subprocess.run(command, cwd=tree, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        sys.exit(f"bench_regression: the run in {tree.name} failed:\n{proc.stderr[-3000:]}")
    if utilisation is not None and gpu.samples:
        utilisation.append(statistics.mean(gpu.samples))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "step_time" in r]


class GpuUtilisation:
    """GPU 0's utilisation (%), sampled every 200 ms by `nvidia-smi` while a run lasts; no samples without it."""

    def __init__(self):
        self.samples: list[float] = []
        self.proc = None

    def __enter__(self):
        if shutil.which("nvidia-smi"):
            self.proc = subprocess.Popen(["nvidia-smi", "--id=0", "--query-gpu=utilization.gpu",
                                          "--format=csv,noheader,nounits", "-lms", "200"],
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.strip().isdigit():
                self.samples.append(float(line))

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


def same_samples(a: list[dict], b: list[dict]) -> bool:
    keys = ("num_tokens", "loss", "grad_norm")
    return len(a) == len(b) and all(x[k] == y[k] for x, y in zip(a, b) for k in keys)


def per_step(rows: list[dict], warmup: int, per_token: bool) -> dict[str, list[float]]:
    """Each measured step's times (per thousand generated tokens where `per_token`)."""
    out: dict[str, list[float]] = {"step": []}
    previous = rows[warmup - 1]["num_tokens"] if warmup > 0 else 0
    for row in rows[warmup:]:
        tokens = max(row["num_tokens"] - previous, 1)
        previous = row["num_tokens"]
        scale = 1000 / tokens if per_token else 1.0
        out["step"].append(row["step_time"] * scale)
        for phase in PHASES:
            if f"time/{phase}" in row:
                out.setdefault(phase, []).append(row[f"time/{phase}"] * scale)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", help="The revision to compare with (a commit, tag or branch).")
    parser.add_argument("--b_flags", help="Instead of --against: B is this working tree with these trainer flags "
                        "added (one quoted string), e.g. \"--max_staleness 1\".")
    parser.add_argument("--rounds", type=int, default=3, help="Runs of each, alternated (at least 2).")
    parser.add_argument("--warmup_steps", type=int, default=1, help="First steps of each run left out.")
    parser.add_argument("--output_json", help="Also write every run's numbers and the summary here.")
    parser.add_argument("flags", nargs="*", help="Trainer flags after --, for both (default: a short demo run).")
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error("--rounds must be at least 2: one round has no spread")
    if (args.against is None) == (args.b_flags is None):
        parser.error("give --against (another revision) or --b_flags (other flags on this tree), one of them")
    flags = args.flags or DEFAULT_FLAGS
    b_flags = flags + shlex.split(args.b_flags or "")
    utilisation: dict[str, list[float]] = {"A": [], "B": []}
    with tempfile.TemporaryDirectory(prefix="bench_regression_") as tmp:
        other = ROOT if args.b_flags is not None else Path(tmp) / "other"
        if args.against is not None:
            made = subprocess.run(["git", "worktree", "add", "--detach", str(other), args.against], cwd=ROOT,
                                  capture_output=True, text=True)
            if made.returncode != 0:
                sys.exit(f"bench_regression: --against {args.against}: {made.stderr.strip()}")
        try:
            runs: dict[str, list[list[dict]]] = {"A": [], "B": []}
            for r in range(args.rounds):
                for label in ("A", "B") if r % 2 == 0 else ("B", "A"):
                    tree = ROOT if label == "A" else other
                    print(f"[round {r + 1}/{args.rounds}] {label} ...", flush=True)
                    runs[label].append(run(tree, flags if label == "A" else b_flags, Path(tmp) / f"{label}-{r}",
                                           utilisation[label]))
        finally:
            if args.against is not None:
                subprocess.run(["git", "worktree", "remove", "--force", str(other)], cwd=ROOT, capture_output=True)
    identical = all(same_samples(a, b) for a, b in zip(runs["A"], runs["B"]))
    unit = "s" if identical else "s / 1k tokens"
    rounds = [(per_step(a, args.warmup_steps, not identical), per_step(b, args.warmup_steps, not identical))
              for a, b in zip(runs["A"], runs["B"])]
    summary = {}
    for phase in ("step", *PHASES):
        if not all(phase in a and phase in b for a, b in rounds):
            continue
        a_all = [t for a, _ in rounds for t in a[phase]]
        b_all = [t for _, b in rounds for t in b[phase]]
        ratios = [statistics.median(a[phase]) / statistics.median(b[phase]) for a, b in rounds
                  if statistics.median(b[phase]) > 0]
        summary[phase] = {"A": statistics.median(a_all), "B": statistics.median(b_all),
                          "ratio": statistics.median(ratios) if ratios else None,
                          "spread": [min(ratios), max(ratios)] if ratios else None}
    b_name = args.against if args.against is not None else f"this working tree with {args.b_flags}"
    print(f"\nA = this working tree, B = {b_name}; {args.rounds} rounds alternated; "
          + ("the same completions in both (compared step for step)" if identical else
             "different completions: times per thousand generated tokens"))
    print(f"| phase | A ({unit}) | B ({unit}) | A / B (median of rounds) | spread |\n|---|---|---|---|---|")
    for phase, row in summary.items():
        ratio = f"{row['ratio']:.3f}" if row["ratio"] is not None else "-"
        spread = f"{row['spread'][0]:.3f}-{row['spread'][1]:.3f}" if row["spread"] else "-"
        print(f"| {phase} | {row['A']:.3f} | {row['B']:.3f} | {ratio} | {spread} |")
    if utilisation["A"] and utilisation["B"]:
        print(f"GPU utilisation (mean over each run, then median of runs): A {statistics.median(utilisation['A']):.0f}%"
              f", B {statistics.median(utilisation['B']):.0f}%")
    report = {"against": args.against, "b_flags": args.b_flags, "flags": flags, "identical_samples": identical,
              "unit": unit, "summary": summary, "runs": runs, "gpu_utilisation": utilisation}
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
