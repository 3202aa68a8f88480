"""Record what every `--algo` preset and the default run do, and compare two records key for key (timings aside).

    python scripts/check_behaviour.py --out before.json                  # record, on this checkout
    python scripts/check_behaviour.py --out after.json --against before.json

A restructuring must leave behaviour unchanged: each preset runs 3 steps on a two-block random-weight Llama (built
from a config, seeded) with rewards that have a spread (tests/tiny_rewards.py), and the default run 2 steps on the
embedded model; every metric of every step, except the ones that measure time or memory, is written down. With
`--against`, every key whose value differs (or that one side lacks) is printed and the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from lib.methods.registry import METHODS  # noqa: E402  (the repository root is put on the path just above)

PRESETS = tuple(METHODS)  # every registered method's preset
# words of metric names that measure the machine, not the algorithm (whole words: "eta" and "_s" as substrings once
# dropped beta, eta, reward_std and frac_reward_zero_std from the comparison)
MACHINE = {"time", "seconds", "memory", "mem", "peak", "throughput", "wall"}
TINY = ["--max_steps", "3", "--per_device_train_batch_size", "8", "--num_generations", "4",
        "--max_completion_length", "16", "--num_eval_samples", "8", "--temperature", "0.8", "--learning_rate", "1e-4",
        "--builtin_num_train", "64", "--report_to", "none", "--save_steps", "100", "--seed", "3"]


def build_tiny(folder: Path) -> str:
    """The test suite's tiny model (tests/conftest.py `tiny_model`): same config, same seed."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lib.models.embedded import embedded_model_path
    from lib.models.modeling import load_tokenizer

    tokenizer = load_tokenizer(str(embedded_model_path()))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def machine_key(key: str) -> bool:
    words = set(re.split(r"[/_.]", key.lower()))
    return bool(MACHINE & words) or key.endswith("_s") or "per_s" in key or "tokens_per" in key


def run(name: str, args: list[str], work: Path) -> list[dict]:
    out = work / name
    cmd = [sys.executable, str(REPO / "train_agrpo.py"), *args, "--output_dir", str(out)]
    proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True, env={**os.environ,
                          "TOKENIZERS_PARALLELISM": "false"})
    if proc.returncode != 0:
        raise SystemExit(f"{name}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if not machine_key(k)} for r in records]


def record(work: Path, only: list[str] | None) -> dict:
    tiny = build_tiny(work / "tiny")
    spread = ["--reward_funcs", "accuracy", f"{REPO / 'tests' / 'tiny_rewards.py'}:has_x",
              f"{REPO / 'tests' / 'tiny_rewards.py'}:characters", "--reward_weights", "1", "1", "0.5"]
    runs = {f"tiny:{algo}": ["--algo", algo, "--model_name_or_path", tiny, *TINY, *spread] for algo in PRESETS}
    runs["embedded:default"] = ["--max_steps", "2", "--builtin_num_train", "32", "--num_eval_samples", "8",
                                "--report_to", "none", "--save_steps", "100"]
    result = {}
    for name, args in runs.items():
        if only and name.split(":")[1] not in only:
            continue
        print(f"running {name}", flush=True)
        result[name] = run(name.replace(":", "_"), args, work)
    return result


def same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a == b


def compare(before: dict, after: dict) -> list[str]:
    diffs = []
    for name in sorted(set(before) | set(after)):
        if name not in before or name not in after:
            diffs.append(f"{name}: only in {'after' if name in after else 'before'}")
            continue
        b, a = before[name], after[name]
        if len(a) != len(b):
            diffs.append(f"{name}: {len(b)} records before, {len(a)} after")
        for i, (rb, ra) in enumerate(zip(b, a)):
            for key in sorted(set(rb) | set(ra)):
                if key not in rb or key not in ra:
                    diffs.append(f"{name}[{i}].{key}: only {'after' if key in ra else 'before'}")
                elif not same(rb[key], ra[key]):
                    diffs.append(f"{name}[{i}].{key}: {rb[key]!r} before, {ra[key]!r} after")
    return diffs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file to write this checkout's record to")
    p.add_argument("--against", help="a record written before: compare key for key")
    p.add_argument("--only", nargs="+", help="only these presets (or 'default')")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as work:
        result = record(Path(work), args.only)
    Path(args.out).write_text(json.dumps(result, indent=1, sort_keys=True))
    steps = sum(len(v) for v in result.values())
    print(f"{len(result)} runs, {steps} records written to {args.out}")
    if not args.against:
        return 0
    diffs = compare(json.loads(Path(args.against).read_text()), result)
    for line in diffs:
        print(line)
    print(f"{len(diffs)} differences" if diffs else "equal key for key (timings aside)")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
