"""Write the train / held-out splits of the real word-problem sets that the CPU recipe and the ablations use.

    python scripts/make_splits.py                      # -> runs/data/{mawps,svamp}/{train,heldout}.jsonl
    python scripts/make_splits.py --data_dir ../shared/data --out runs/data --seed 0

- mawps: MAWPS's single-operation and add/subtract problems (singleop.jsonl + addsub.jsonl), 957 rows, 926 after
  dropping repeated problem texts; 200 held out, 726 to train on.
- svamp: SVAMP's 1,000 problems (one to two steps, with distractors); 200 held out, 800 to train on.

Each split is a seeded shuffle of the distinct problems, so the same seed writes the same files on any machine, and
no held-out problem's text appears in its training file. Rows are written as they are in the source files (their
own columns), so the trainer and the evaluator recognise their formats. The data stay outside the repository
(the source files' licences are in their folders).
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SETS = {  # name -> (source files, the columns whose text identifies a problem)
    "mawps": (["mawps/singleop.jsonl", "mawps/addsub.jsonl"], ("input",)),
    "svamp": (["svamp/test.jsonl"], ("Body", "Question")),
}
HELD_OUT = 200


def distinct_rows(data_dir: Path, files: list[str], key: tuple[str, ...]) -> list[dict]:
    """The rows of `files` in order, each problem text once (the first row that has it)."""
    seen, rows = set(), []
    for name in files:
        for line in (data_dir / name).read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            text = " ".join(" ".join(str(row[k]).split()) for k in key)
            if text not in seen:
                seen.add(text)
                rows.append(row)
    return rows


def split(rows: list[dict], held_out: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, held-out): a seeded shuffle, the first `held_out` rows held out."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    return [rows[i] for i in sorted(order[held_out:])], [rows[i] for i in sorted(order[:held_out])]


def main(argv: list[str] | None = None) -> dict[str, tuple[int, int]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data_dir", default=os.environ.get("AGRPO_DATA_DIR", str(REPO.parent / "shared" / "data")),
                        help="The folder of the real data sets (default: $AGRPO_DATA_DIR or ../shared/data).")
    parser.add_argument("--out", default=str(REPO / "runs" / "data"), help="Where the split files go.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the split.")
    args = parser.parse_args(argv)
    sizes = {}
    for name, (files, key) in SETS.items():
        train, held = split(distinct_rows(Path(args.data_dir), files, key), HELD_OUT, args.seed)
        folder = Path(args.out) / name
        folder.mkdir(parents=True, exist_ok=True)
        for part, rows in (("train", train), ("heldout", held)):
            (folder / f"{part}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        sizes[name] = (len(train), len(held))
        print(f"{name}: {len(train)} train, {len(held)} held out -> {folder}")
    return sizes


if __name__ == "__main__":
    main()
