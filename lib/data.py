"""Data for agrpo: the built-in arithmetic task, local JSONL/Parquet files, hub ids, prompts and gold answers.

Every loader returns records: plain dicts {"problem": str, "answer": str, ...}. The gold `answer` is always a
string; the other keys are the original columns under their own names (reward functions get them as columns,
as in TRL). Files are validated row by row at load time, so a bad row stops the run before any training.
"""

import json
import math
import numbers
import os
import random
import warnings
from pathlib import Path
from typing import Any

from lib.rewards import last_boxed

DEFAULT_INSTRUCTION = "Give the final answer as 'Answer: <number>'."

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")

# Hub ids that need a config name; load_dataset refuses them without one.
HUB_CONFIGS = {"openai/gsm8k": "main", "gsm8k": "main"}

COLUMN_FIX = "pass --prompt_column NAME and/or --answer_column NAME to say which columns to use"


# ---------------------------------------------------------------------------------------------------------------
# Gold answers


def format_number(value: numbers.Real) -> str:
    """Returns a number as gold-answer text: 145.0 -> "145", 2.5 -> "2.5", 7 -> "7"."""
    if isinstance(value, numbers.Integral):
        return str(int(value))
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"the answer is {'NaN' if math.isnan(value) else value}, not a finite number")
    # repr gives the shortest text that round-trips (1.84, not 1.8400000000000001)
    return str(int(value)) if value.is_integer() else repr(value)


def _gold(value: Any, kind: str) -> str:
    """Returns the gold answer text of one answer cell; raises ValueError saying what is wrong.

    kind: "plain" (the value is the answer), "gsm8k" (text after "#### "), "boxed" (last \\boxed{} of a
    solution), "auto" (a user-named column: "####" if present, else the last \\boxed{}, else the whole text).
    """
    if isinstance(value, bool) or value is None:
        raise ValueError(f"expected a string or a number, got {value!r}")
    if isinstance(value, numbers.Real):
        return format_number(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a string or a number, got {type(value).__name__}")
    if kind == "auto":
        kind = "gsm8k" if "####" in value else "boxed" if last_boxed(value) is not None else "plain"
    if kind == "gsm8k":
        if "####" not in value:
            raise ValueError("no '#### <answer>' line (GSM8K format; --answer_column answer takes the text as is)")
        # GSM8K writes thousands with commas ("#### 1,000"); the gold is the bare number
        gold = value.rsplit("####", 1)[1].strip().replace(",", "")
    elif kind == "boxed":
        gold = last_boxed(value)
        if gold is None:
            raise ValueError("no \\boxed{...} (or \\fbox{...}) with balanced braces in the solution")
    else:
        gold = value.strip()
    if not gold:
        raise ValueError("the extracted answer is empty")
    return gold


# ---------------------------------------------------------------------------------------------------------------
# Column detection and validation


def _detect_columns(
    columns: list[str], prompt_column: str | None, answer_column: str | None
) -> tuple[tuple[str, ...], str | None, str]:
    """Returns (prompt columns, answer column, answer kind) for a data set whose first row has `columns`.

    A column is None when no known format matches; the caller reports it as missing.
    """
    if prompt_column:
        prompt = (prompt_column,)
    elif "Body" in columns and "Question" in columns:  # SVAMP: the question comes after its context
        prompt = ("Body", "Question")
    else:
        prompt = next(((c,) for c in ("problem", "question", "input") if c in columns), (None,))
    if answer_column:
        return prompt, answer_column, "auto"
    if "answer" in columns:
        # GSM8K is the question/answer format with a worked solution ending "#### 18"; data sets that also
        # have `problem` (MATH-500, AIME24, AMC23) keep the final answer alone in `answer`
        return prompt, "answer", "plain" if "problem" in columns else "gsm8k"
    if "solution" in columns:  # MATH train/test: the gold is boxed inside the solution
        return prompt, "solution", "boxed"
    for name in ("Answer", "target"):  # SVAMP, MAWPS (floats)
        if name in columns:
            return prompt, name, "plain"
    return prompt, None, "plain"


def _missing(where: str, field: str, row: dict) -> None:
    """Raises the ValueError for a missing column: where, which field, the columns found, and the fix."""
    raise ValueError(f"{where}: missing field {field}; columns found: {sorted(row)}. Fix: {COLUMN_FIX}.")


def _to_record(row: dict, where: str, prompt: tuple[str | None, ...], answer: str | None, kind: str) -> dict:
    """Returns one validated record; raises ValueError naming the location, the field and the problem."""
    if None in prompt:
        _missing(where, "a prompt column (problem, question, input, or Body and Question)", row)
    if answer is None:
        _missing(where, "an answer column (answer, solution, Answer or target)", row)
    for field in (*prompt, answer):
        if field not in row:
            _missing(where, repr(field), row)
    parts = [row[c] for c in prompt]
    for field, part in zip(prompt, parts):
        if not isinstance(part, str) or not part.strip():
            raise ValueError(f"{where}: field {field!r} must be a non-empty string, got {part!r}. Fix or drop the row.")
    try:
        gold = _gold(row[answer], kind)
    except ValueError as err:
        value = str(row[answer])[-200:]  # the end of a long solution is where its answer should be
        raise ValueError(f"{where}: field {answer!r}: {err}; value ends {value!r}. Fix or drop the row.") from None
    # strip: trailing newlines in a problem would double the blank line before the instruction
    problem = " ".join(part.strip() for part in parts)
    return {**row, "problem": problem, "answer": gold}


# ---------------------------------------------------------------------------------------------------------------
# Reading rows


def _decode(path: Path, data: bytes, line: int | None = None) -> str:
    """UTF-8 text of a file's bytes (a leading byte-order mark dropped); ValueError names the file, the line where
    known, and the byte."""
    try:
        return data.decode("utf-8-sig" if line in (None, 1) else "utf-8")
    except UnicodeDecodeError as err:
        where = f"{path}, line {line}" if line else str(path)
        raise ValueError(f"{where}: not UTF-8 text (byte {err.start}{' of the line' if line else ''}: {err.reason}); "
                         f"save the file as UTF-8") from None


def _parse_json(text: str, where: str, layout: str):
    """json.loads, with every way it fails (bad syntax, an integer too long to read, nesting too deep) as a
    ValueError that names `where`."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        at = f"at column {err.colno}" if layout == "line" else f"at line {err.lineno}, column {err.colno}"
        fix = ("each line must be one JSON object" if layout == "line" else
               "a .json file holds a list of objects (one object a line is JSON Lines, .jsonl)")
        raise ValueError(f"{where}: invalid JSON ({err.msg} {at}); {fix}") from None
    except (ValueError, RecursionError) as err:
        reason = "nested too deeply" if isinstance(err, RecursionError) else str(err).split(";")[0]
        raise ValueError(f"{where}: invalid JSON ({reason})") from None


def _read_jsonl(path: Path, data: bytes) -> list[tuple[str, dict]]:
    """Returns (location, row) pairs of a JSON Lines file's bytes; the location names the 1-based line."""
    rows = []
    for line_number, raw in enumerate(data.splitlines(), start=1):
        line = _decode(path, raw, line_number)
        if not line.strip():
            continue
        where = f"{path}, line {line_number}"
        row = _parse_json(line, where, "line")
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
        rows.append((where, row))
    return rows


def _read_table(path: Path, data: bytes | None = None) -> list[tuple[str, dict]]:
    """Returns (location, row) pairs of a Parquet file or of a .json file's bytes holding a list of objects."""
    if path.suffix == ".parquet":
        import pyarrow  # installed with `datasets`; imported here so plain JSONL runs stay light
        import pyarrow.parquet

        try:
            rows = pyarrow.parquet.read_table(path).to_pylist()
        except (pyarrow.ArrowException, ValueError, OSError) as err:  # not Parquet, truncated, an unreadable type
            reason = " ".join(str(err).split())[:200]
            raise ValueError(f"{path}: not a readable Parquet file ({type(err).__name__}: {reason})") from None
    else:
        rows = _parse_json(_decode(path, data), str(path), "file")
        if not isinstance(rows, list):
            raise ValueError(f"{path}: expected a list of objects (or use JSON Lines, .jsonl)")
    for i, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise ValueError(f"{path}, row {i}: expected an object, got {type(row).__name__}")
    return [(f"{path}, row {i}", row) for i, row in enumerate(rows, start=1)]


def _read_hub(name: str, split: str) -> list[tuple[str, dict]]:
    """Returns (location, row) pairs of a hub data set; raises ValueError when it cannot be loaded."""
    import datasets  # slow to import; only hub ids need it

    try:
        rows = datasets.load_dataset(name, HUB_CONFIGS.get(name), split=split).to_list()
    # Offline or unknown ids surface as many exception types (ConnectionError, DatasetNotFoundError, HTTP errors);
    # all mean "could not load" to the user, and the original is quoted in the message and chained.
    except Exception as err:
        raise ValueError(
            f"dataset_id_or_path={name!r} (split {split!r}): the hub was not reachable or the id is unknown "
            f"({type(err).__name__}: {err}). Pass a local .jsonl or .parquet file (or a folder holding "
            f"{split}.jsonl) as dataset_id_or_path instead."
        ) from err
    return [(f"{name} (split {split}), row {i}", row) for i, row in enumerate(rows, start=1)]


def looks_local(name: str) -> bool:
    """Returns True when `name` is meant as a path: hub ids are "name" or "owner/name", never more."""
    return (
        name.endswith(DATA_SUFFIXES)
        or name.startswith((".", "/", "~"))
        or name.count("/") > 1
        or (os.sep != "/" and os.sep in name)
    )


def _read_rows(dataset_id_or_path: str, split: str) -> list[tuple[str, dict]]:
    """Returns (location, row) pairs from a local file, a folder holding {split}.jsonl/.parquet, or a hub id."""
    path = Path(dataset_id_or_path).expanduser()
    if path.is_dir():
        candidates = [path / f"{split}{suffix}" for suffix in DATA_SUFFIXES]
        path = next((c for c in candidates if c.is_file()), None)
        if path is None:
            found = sorted(p.name for p in candidates[0].parent.iterdir())
            raise FileNotFoundError(
                f"dataset_id_or_path={dataset_id_or_path!r} is a folder without {split}.jsonl, {split}.json or "
                f"{split}.parquet (split={split!r}); it holds {found}"
            )
    if path.is_file():
        if path.suffix not in DATA_SUFFIXES:
            raise ValueError(f"dataset_id_or_path={dataset_id_or_path!r}: expected a file ending in {DATA_SUFFIXES}")
        if path.suffix == ".parquet":
            return _read_table(path)
        try:
            data = path.read_bytes()
        except OSError as err:  # permission denied, a file that vanished
            raise ValueError(f"{path}: cannot read the file ({err.strerror or err}); check its permissions") from None
        # a .json file may hold a list of objects or, as `datasets` writes it, one object a line
        is_array = path.suffix == ".json" and data.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"[")
        return _read_table(path, data) if is_array else _read_jsonl(path, data)
    if looks_local(dataset_id_or_path):
        raise FileNotFoundError(f"dataset_id_or_path={dataset_id_or_path!r}: no such file or folder")
    return _read_hub(dataset_id_or_path, split)


# ---------------------------------------------------------------------------------------------------------------
# Public API


def load_records(
    dataset_id_or_path: str,
    split: str = "train",
    prompt_column: str | None = None,
    answer_column: str | None = None,
    max_samples: int | None = None,
    seed: int = 0,
    skip_invalid_rows: bool = False,
) -> list[dict]:
    """Returns the validated records of a data set: dicts {"problem": str, "answer": str, <original columns>}.

    dataset_id_or_path: a .jsonl/.json/.parquet file, a folder holding {split}.jsonl or {split}.parquet, or a hub
        id (`split` is used only for folders and hub ids).
    prompt_column / answer_column: override the format detection (GSM8K, MATH-500, MATH, SVAMP, MAWPS, AIME/AMC).
    max_samples: keep a seeded random subset of this size, in file order. Subsets are nested: with the same seed,
        the 100 rows drawn are among the 200 drawn, so a larger eval contains a smaller one.
    Every row is validated first; the first bad row raises ValueError naming the file, the row, the field and the fix.
    skip_invalid_rows: leave bad rows out instead, with one warning that counts them and names the first
        (MATH train has two solutions whose \\boxed{} is empty).
    """
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"max_samples must be at least 1 or None (all rows), got {max_samples}")
    rows = _read_rows(dataset_id_or_path, split)
    if not rows:
        raise ValueError(f"dataset_id_or_path={dataset_id_or_path!r}: no records")
    prompt, answer, kind = _detect_columns(list(rows[0][1]), prompt_column, answer_column)
    records, skipped = [], []
    for where, row in rows:
        try:
            records.append(_to_record(row, where, prompt, answer, kind))
        except ValueError as err:
            if not skip_invalid_rows:
                raise ValueError(f"{err} (or pass --skip_invalid_rows true to leave such rows out)") from None
            skipped.append(str(err))
    if skipped:
        warnings.warn(f"left out {len(skipped)} invalid row(s) of {len(rows)}; the first: {skipped[0]}")
    if not records:
        raise ValueError(f"dataset_id_or_path={dataset_id_or_path!r}: no valid records")
    if max_samples is None or max_samples >= len(records):
        return records
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    return [records[i] for i in sorted(order[:max_samples])]


# The built-in task: one-step arithmetic word problems that a 135M instruct model gets right only sometimes, so
# RL has signal from the first step. Inclusive ranges; the training owner may retune them.
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
        raise ValueError(f"could not generate {count} distinct problems; widen the *_RANGE constants in lib/data.py")
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


def prompts_for_step(position: int, count: int, num_records: int, seed: int) -> list[int]:
    """Record indices for the next `count` prompts from data position `position`: one seeded shuffle per epoch,
    so any position (a resumed run's) is reproducible without replaying the earlier ones."""
    indices = []
    for p in range(position, position + count):
        epoch, offset = divmod(p, num_records)
        order = list(range(num_records))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        indices.append(order[offset])
    return indices


def format_prompt(
    tokenizer: Any, problem: str, instruction: str = DEFAULT_INSTRUCTION, system_prompt: str | None = None,
    chat_template_kwargs: dict | None = None,
) -> str:
    """Returns the prompt text for one problem: the tokenizer's chat template with the generation prompt opened.

    The user message is `problem + "\\n" + instruction`. A tokenizer without a chat template (a base model)
    gets the plain text `problem + "\\n" + instruction + "\\n"`, preceded by the system prompt's line if one is given.
    `chat_template_kwargs` are the template's own variables (Qwen3's `enable_thinking`).
    """
    content = f"{problem}\n{instruction}" if instruction else problem
    if getattr(tokenizer, "chat_template", None) is None:
        return f"{system_prompt}\n{content}\n" if system_prompt else f"{content}\n"
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": content})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         **(chat_template_kwargs or {}))


def tokenize_prompts(tokenizer, prompts: list[str], max_prompt_length: int, device="cpu"):
    """Left-padded prompt ids and mask, (P, L) each; a prompt longer than `max_prompt_length` keeps its end
    (the question and the generation prompt), as TRL truncates from the left."""
    side = tokenizer.truncation_side
    tokenizer.truncation_side = "left"
    try:
        enc = tokenizer(prompts, return_tensors="pt", padding=True, truncation=True, max_length=max_prompt_length,
                        add_special_tokens=False)
    finally:
        tokenizer.truncation_side = side
    return enc["input_ids"].to(device), enc["attention_mask"].to(device)
