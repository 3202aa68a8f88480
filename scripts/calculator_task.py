"""The calculator demo's data (docs/agents.md 8): word problems whose arithmetic the embedded model gets wrong
(two-digit products, three-digit sums), as TRL-format conversations with one worked example before the question.

    python scripts/calculator_task.py --out data/calculator            # train.jsonl, test.jsonl: the example calls
    python scripts/calculator_task.py --out data/calculator_direct --direct   # the same problems, answered directly

Why the worked example: measured on SmolLM2-135M-Instruct (96 samples at temperature 1, docs/agents.md 8), the tools'
description in the system prompt alone gives 0 calls in 96; the same description with an example call written in
it, 1 in 96; one example exchange as earlier turns of the conversation (user, assistant's call, tool's result,
assistant's answer), 82 in 96. `--direct` writes the example exchange without the call, for the runs without tools.
Each row: {"prompt": [messages], "answer": "<number>"}; the same seed gives the same files.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

INSTRUCTION = "Give the final answer as 'Answer: <number>'."
NAMES = ("Ana", "Ben", "Chen", "Dana", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jia")
PRODUCTS = (  # a * b, both two-digit
    "A box holds {a} pencils. How many pencils are in {b} boxes?",
    "{name} earns {a} dollars a day. How many dollars does {name} earn in {b} days?",
    "A train travels {a} kilometres every hour. How many kilometres does it travel in {b} hours?",
    "A theatre has {a} rows with {b} seats in each row. How many seats does it have?",
    "{name} reads {a} pages every day for {b} days. How many pages does {name} read?",
)
SUMS = (  # a + b, both three-digit
    "{name} had {a} stamps and bought {b} more. How many stamps does {name} have now?",
    "A farm has {a} chickens and {b} ducks. How many birds does the farm have?",
    "A library lent {a} books on Monday and {b} books on Tuesday. How many books did it lend?",
)
EXAMPLE_QUESTION = "A crate holds 17 apples. How many apples are in 23 crates?"
EXAMPLE_CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "17 * 23"}}</tool_call>'


def problem(rng: random.Random) -> tuple[str, int]:
    """One word problem and its answer: a two-digit product (two in three) or a three-digit sum."""
    if rng.random() < 2 / 3:
        a, b = rng.randint(12, 99), rng.randint(12, 99)
        return rng.choice(PRODUCTS).format(a=a, b=b, name=rng.choice(NAMES)), a * b
    a, b = rng.randint(100, 999), rng.randint(100, 999)
    return rng.choice(SUMS).format(a=a, b=b, name=rng.choice(NAMES)), a + b


def example(direct: bool) -> list[dict]:
    """The worked example's turns: the call, the tool's result and the answer; or the answer alone (`direct`)."""
    ask = {"role": "user", "content": f"{EXAMPLE_QUESTION}\n{INSTRUCTION}"}
    if direct:
        return [ask, {"role": "assistant", "content": "17 * 23 = 391\nAnswer: 391"}]
    return [ask, {"role": "assistant", "content": EXAMPLE_CALL}, {"role": "tool", "content": "391"},
            {"role": "assistant", "content": "Answer: 391"}]


def rows(count: int, rng: random.Random, seen: set[str], direct: bool) -> list[dict]:
    out = []
    while len(out) < count:
        text, answer = problem(rng)
        if text in seen:
            continue
        seen.add(text)
        out.append({"prompt": example(direct) + [{"role": "user", "content": f"{text}\n{INSTRUCTION}"}],
                    "answer": str(answer)})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="Folder for train.jsonl and test.jsonl.")
    parser.add_argument("--direct", action="store_true", help="The worked example answers without the calculator.")
    parser.add_argument("--num_train", type=int, default=2000)
    parser.add_argument("--num_test", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng, seen = random.Random(args.seed), set()
    test = rows(args.num_test, rng, seen, args.direct)  # drawn first: changing num_train leaves it unchanged
    train = rows(args.num_train, rng, seen, args.direct)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, data in (("train", train), ("test", test)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    print(f"wrote {len(train)} training and {len(test)} test problems to {out}")


if __name__ == "__main__":
    main()
