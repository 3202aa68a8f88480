"""Keep the training problems the starting model solves sometimes but not always (difficulty filtering by pass rate,
as open-r1 filters its data with the model it will train; docs/results.md 8).

    python eval_agrpo.py --model_name_or_path embedded --dataset_name runs/data/mawps/train.jsonl --num_samples 8 \
        --temperature 0.7 --max_completion_length 96 --use_vllm true --output_dir runs/passrate/mawps
    python scripts/filter_by_pass_rate.py --completions runs/passrate/mawps/completions.jsonl \
        --dataset runs/data/mawps/train.jsonl --min_pass_rate 0.125 --max_pass_rate 0.875 \
        --out runs/data/mawps/train_filtered.jsonl

A problem's pass rate is the share of its sampled completions that are right. A group of completions of a problem the
model never solves (or always solves) has no reward spread, so GRPO learns nothing from it; keeping the problems in
between gives every group a signal. The rows are written as they are in the data set's file, in its order; the
held-out file is never read.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lib.data.records import load_records  # noqa: E402
from lib.data import hub_data  # noqa: E402


def pass_rates(completions: Path, dataset_label: str | None = None) -> dict[int, float]:
    """{problem index: share of its samples that are right} from eval_agrpo.py's completions.jsonl (one model)."""
    right: dict[int, list[bool]] = {}
    models = set()
    for line in completions.read_text().splitlines():
        row = json.loads(line)
        if dataset_label is not None and row["dataset"] != dataset_label:
            continue
        models.add(row["model"])
        right.setdefault(row["index"], []).append(bool(row["correct"]))
    if len(models) > 1:
        raise SystemExit(f"--completions: {completions} holds several models ({sorted(models)}); evaluate the "
                         f"starting model alone")
    return {i: sum(r) / len(r) for i, r in right.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--completions", type=Path, required=True, help="eval_agrpo.py's completions.jsonl")
    parser.add_argument("--dataset", type=Path, required=True, help="The .jsonl file that was evaluated")
    parser.add_argument("--min_pass_rate", type=float, default=0.125)
    parser.add_argument("--max_pass_rate", type=float, default=0.875)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    records = load_records(str(args.dataset), reader=hub_data)  # the evaluator's order: every row, in file order
    lines = [line for line in args.dataset.read_text().splitlines() if line.strip()]
    rates = pass_rates(args.completions)
    if len(records) != len(lines) or set(rates) != set(range(len(records))):
        raise SystemExit(f"--completions: {len(rates)} problems scored, {len(records)} in {args.dataset}: evaluate "
                         f"the whole file (no --max_samples)")
    for i, record in enumerate(records):  # the same problems, row for row
        if json.loads(lines[i]) is None or not record.get("answer"):
            raise SystemExit(f"--dataset: row {i + 1} has no answer")
    kept = [lines[i] for i in range(len(lines)) if args.min_pass_rate <= rates[i] <= args.max_pass_rate]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(line + "\n" for line in kept))
    counts = {"never right": sum(r == 0 for r in rates.values()), "always right": sum(r == 1 for r in rates.values())}
    print(f"{len(kept)} of {len(lines)} problems kept (pass rate in [{args.min_pass_rate}, {args.max_pass_rate}]); "
          f"{counts['never right']} never right, {counts['always right']} always right; mean pass rate "
          f"{sum(rates.values()) / len(rates):.3f} -> {args.out}")


if __name__ == "__main__":
    main()
