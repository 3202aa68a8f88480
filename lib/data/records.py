"""Data for agrpo: local JSONL/Parquet files and folders of them, prompts and gold answers (the built-in arithmetic task
is lib/data/word_problems.py's). Hub ids and the folders only `datasets` reads (save_to_disk's, the hub's layout)
are read by a `reader`, lib/data/hub_data.py, which lib/setup.load_data passes in.

Every loader returns records, plain dicts that keep every original column under its own name (reward functions get
them as keyword arguments, as in TRL), in one of two forms (docs/troubleshooting.md 3.1):
  - the recognised math formats and the built-in task: {"problem": str, "answer": str, ...}; the prompt is rendered
    from `problem` with the instruction appended, the system prompt and the chat template;
  - TRL's prompt format, a `prompt` column: {"prompt": str | list[dict], ...}; a string is the prompt as it is (TRL's
    standard format), a list of {role, content} messages a conversation (lib/rewards/scoring.is_conversational), rendered
    with the chat template. Such a record has no `problem` unless the data set has that column.
`answer` is the gold answer as a string when the data set has an answer column, and absent when it has none (a
data set for reward functions that need no gold). Files are validated row by row at load time, so a bad row stops
the run before any training. Prompts are rendered by `render_prompt`, for training and evaluation alike.
"""

import inspect
import json
import math
import numbers
import os
import random
import warnings
from pathlib import Path
from typing import Any, Protocol

from lib.rewards.functions import REWARD_FUNCS, last_boxed

DEFAULT_INSTRUCTION = "Give the final answer as 'Answer: <number>'."

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")

COLUMN_FIX = "pass --prompt_column NAME and/or --answer_column NAME to say which columns to use"

# Where a gold answer is looked for when no --answer_column is given (the formats _detect_columns recognises).
ANSWER_COLUMNS = ("answer", "solution", "Answer", "target")

# The files `Dataset.save_to_disk` / `DatasetDict.save_to_disk` write: such a folder goes to the Reader.
SAVED_DATASET_FILES = ("state.json", "dataset_dict.json")


class Reader(Protocol):
    """What reads the data sets this module does not read itself (hub ids, save_to_disk folders, folders in the
    hub's layout): lib/data/hub_data.py, which lib/setup.load_data passes in (a module with these two functions)."""

    def read_rows(self, name: str, split: str, config: str | None) -> list[tuple[str, dict]]: ...

    def split_names(self, name: str, config: str | None = None) -> list[str] | None: ...


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

    The prompt column is None when no known format matches (the caller reports it as missing); the answer column is
    None when the data set has no gold answer.
    """
    if prompt_column:
        prompt = (prompt_column,)
    elif "prompt" in columns:  # TRL's format: the column TRL's GRPOTrainer reads, whatever else the rows hold
        prompt = ("prompt",)
    elif "Body" in columns and "Question" in columns:  # SVAMP: the question comes after its context
        prompt = ("Body", "Question")
    else:
        prompt = next(((c,) for c in ("problem", "question", "input") if c in columns), (None,))
    if answer_column:
        return prompt, answer_column, "auto"
    if prompt == ("prompt",):
        # TRL's format has no convention for the gold (TRL's accuracy_reward reads `solution`): the first answer
        # column found is read as a user-named one ("#### x", the last \boxed{}, or the text as it is)
        return prompt, next((c for c in ANSWER_COLUMNS if c in columns), None), "auto"
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


def _is_messages(value: Any) -> bool:
    """True for a list of dicts with a `role`: a conversation, as TRL's is_conversational tells one."""
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and "role" in value[0]


def _check_prompt(value: Any, where: str) -> None:
    """Raises ValueError unless `value` is a prompt as TRL takes it: non-empty text, or a list of messages
    {role: str, content: str} that ends with a turn the model answers (user, tool) or continues (assistant)."""
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"{where}: field 'prompt' is empty. Fix or drop the row.")
        return
    if not _is_messages(value):
        raise ValueError(f"{where}: field 'prompt' must be text (used as it is) or a list of messages "
                         f"[{{'role': ..., 'content': ...}}], got {str(value)[:80]!r}. Fix or drop the row.")
    for i, message in enumerate(value, start=1):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise ValueError(f"{where}: field 'prompt', message {i}: expected {{'role': str, 'content': str}}, got "
                             f"{str(message)[:80]!r}. Fix or drop the row.")
    if value[-1]["role"] not in ("user", "tool", "assistant"):
        # TRL's rule (apply_chat_template): the model answers a user or tool turn, or continues an assistant one
        raise ValueError(f"{where}: field 'prompt': the conversation ends with a {value[-1]['role']!r} message; end "
                         f"it with a user turn for the model to answer (or an assistant turn it continues)")


def _to_record(row: dict, where: str, prompt: tuple[str | None, ...], answer: str | None, kind: str) -> dict:
    """Returns one validated record; raises ValueError naming the location, the field and the problem."""
    if None in prompt:
        _missing(where, "a prompt column (prompt, problem, question, input, or Body and Question)", row)
    for field in (*prompt, answer) if answer else prompt:
        if field not in row:
            _missing(where, repr(field), row)
    if prompt == ("prompt",):
        _check_prompt(row["prompt"], where)
        record = dict(row)
    else:
        if "prompt" in row:
            # render_prompt reads a record's `prompt` as TRL's; a record keeps every column, so both cannot stay
            raise ValueError(f"{where}: the data set has a 'prompt' column, which is read as TRL's prompt, and "
                             f"--prompt_column names {prompt[0]!r}. Leave --prompt_column unset to use 'prompt', or "
                             f"rename or drop the 'prompt' column")
        parts = [row[c] for c in prompt]
        for field, part in zip(prompt, parts):
            if _is_messages(part):
                raise ValueError(f"{where}: field {field!r} holds messages; a conversation is read from a column "
                                 f"named 'prompt' (TRL's format): rename the column")
            if not isinstance(part, str) or not part.strip():
                raise ValueError(f"{where}: field {field!r} must be a non-empty string, got {part!r}. Fix or drop "
                                 f"the row.")
        # strip: trailing newlines in a problem would double the blank line before the instruction
        record = {**row, "problem": " ".join(part.strip() for part in parts)}
    if answer is None:
        return record
    try:
        record["answer"] = _gold(row[answer], kind)
    except ValueError as err:
        value = str(row[answer])[-200:]  # the end of a long solution is where its answer should be
        raise ValueError(f"{where}: field {answer!r}: {err}; value ends {value!r}. Fix or drop the row.") from None
    return record


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


def is_saved_dataset(path: Path) -> bool:
    """True for a folder that Dataset.save_to_disk or DatasetDict.save_to_disk wrote."""
    return any((path / name).is_file() for name in SAVED_DATASET_FILES)


def looks_local(name: str) -> bool:
    """Returns True when `name` is meant as a path: hub ids are "name" or "owner/name", never more."""
    return (
        name.endswith(DATA_SUFFIXES)
        or name.startswith((".", "/", "~"))
        or name.count("/") > 1
        or (os.sep != "/" and os.sep in name)
    )


def _needs_reader(name: str, reader: Reader | None) -> Reader:
    if reader is None:
        raise ValueError(f"dataset_name={name!r}: a hub id or a folder only `datasets` reads needs the reader of "
                         f"lib/data/hub_data.py (reader=hub_data); pass a .jsonl / .json / .parquet file instead")
    return reader


def _read_rows(dataset_name: str, split: str, config: str | None = None,
               reader: Reader | None = None) -> list[tuple[str, dict]]:
    """Returns (location, row) pairs from a local file; a folder holding {split}.jsonl / .json / .parquet (read here,
    with row-exact errors); or, through `reader`, a folder save_to_disk wrote, any other folder `datasets` reads
    (the hub's layout), or a hub id."""
    path = Path(os.path.expanduser(dataset_name))
    if path.is_dir():
        candidates = [path / f"{split}{suffix}" for suffix in DATA_SUFFIXES]
        found = next((c for c in candidates if c.is_file()), None) if config is None else None
        if found is None or is_saved_dataset(path):
            return _needs_reader(dataset_name, reader).read_rows(dataset_name, split, config)
        path = found
    if path.is_file():
        if path.suffix not in DATA_SUFFIXES:
            raise ValueError(f"dataset_name={dataset_name!r}: expected a file ending in {DATA_SUFFIXES}")
        if path.suffix == ".parquet":
            return _read_table(path)
        try:
            data = path.read_bytes()
        except OSError as err:  # permission denied, a file that vanished
            raise ValueError(f"{path}: cannot read the file ({err.strerror or err}); check its permissions") from None
        # a .json file may hold a list of objects or, as `datasets` writes it, one object a line
        is_array = path.suffix == ".json" and data.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"[")
        return _read_table(path, data) if is_array else _read_jsonl(path, data)
    if looks_local(dataset_name):
        raise FileNotFoundError(f"dataset_name={dataset_name!r}: no such file or folder")
    return _needs_reader(dataset_name, reader).read_rows(dataset_name, split, config)


def split_names(dataset_name: str, config: str | None = None, reader: Reader | None = None) -> list[str] | None:
    """The splits of a data set, sorted, or None for one that has no splits (a file, a saved Dataset): a folder's
    {split}.jsonl / .json / .parquet files and the splits `datasets` finds in it, a saved DatasetDict's, a hub data
    set's (configuration `config`); `reader` (lib/data/hub_data.py) answers for what only `datasets` reads, and
    without it a folder has its own files' splits. Raises as load_records does for a name that is none of these."""
    path = Path(os.path.expanduser(dataset_name))
    if path.is_file():
        return None
    if path.is_dir() and not is_saved_dataset(path):
        own = [] if config else [p.stem for p in path.iterdir() if p.is_file() and p.suffix in DATA_SUFFIXES]
        return sorted({*own, *((reader.split_names(dataset_name, config) or []) if reader else [])})
    if looks_local(dataset_name) and not path.is_dir():
        raise FileNotFoundError(f"dataset_name={dataset_name!r}: no such file or folder")
    return _needs_reader(dataset_name, reader).split_names(dataset_name, config)


# ---------------------------------------------------------------------------------------------------------------
# Public API


def load_records(
    dataset_name: str,
    split: str = "train",
    prompt_column: str | None = None,
    answer_column: str | None = None,
    max_samples: int | None = None,
    seed: int = 0,
    skip_invalid_rows: bool = False,
    config: str | None = None,
    reader: Reader | None = None,
) -> list[dict]:
    """Returns the validated records of a data set (the module's docstring: {"problem": str, "answer": str, ...} or
    TRL's {"prompt": str | messages, ...}; "answer" only where the data set has a gold answer column).

    dataset_name: a .jsonl/.json/.parquet file; a folder holding {split}.jsonl / .json / .parquet, or laid out as
        the hub lays a data set out (data/train-00000-of-00002.parquet, a README's configurations), or written by
        save_to_disk; or a hub id. `split` applies to folders and hub ids, `config` (TRL's dataset_config) to hub
        ids and to folders with configurations (openai/gsm8k needs "main", taken by default).
    prompt_column / answer_column: override the format detection (TRL's `prompt`, GSM8K, MATH-500, MATH, SVAMP, MAWPS,
        AIME/AMC).
    max_samples: keep a seeded random subset of this size, in file order. Subsets are nested: with the same seed,
        the 100 rows drawn are among the 200 drawn, so a larger eval contains a smaller one.
    Every row is validated first; the first bad row raises ValueError naming the file, the row, the field and the fix.
    skip_invalid_rows: leave bad rows out instead, with one warning that counts them and names the first
        (MATH train has two solutions whose \\boxed{} is empty).
    reader: what reads hub ids and the folders only `datasets` reads (lib/data/hub_data.py; `_read_rows`).
    """
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"max_samples must be at least 1 or None (all rows), got {max_samples}")
    rows = _read_rows(dataset_name, split, config, reader)
    if not rows:
        raise ValueError(f"dataset_name={dataset_name!r}: no records")
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
        raise ValueError(f"dataset_name={dataset_name!r}: no valid records")
    if max_samples is None or max_samples >= len(records):
        return records
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    return [records[i] for i in sorted(order[:max_samples])]


def prompts_for_step(position: int, count: int, num_records: int, seed: int,
                     shuffle: bool = True) -> list[int]:
    """Record indices for the next `count` prompts from data position `position`: one seeded shuffle per epoch,
    so any position (a resumed run's) is reproducible without replaying the earlier ones; file order when not
    `shuffle` (TRL's shuffle_dataset false)."""
    if not shuffle:
        return [p % num_records for p in range(position, position + count)]
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
    return _render_conversation(tokenizer, [{"role": "user", "content": content}], system_prompt,
                                chat_template_kwargs)


def _render_conversation(tokenizer: Any, messages: list[dict], system_prompt: str | None,
                         chat_template_kwargs: dict | None) -> str:
    """Messages through the chat template: `system_prompt` first when they have no system turn, then the generation
    prompt opened after a user or tool turn, or the last assistant turn continued (TRL's rule)."""
    messages = list(messages)
    if system_prompt and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    options = dict(chat_template_kwargs or {})
    if messages[-1]["role"] == "assistant":  # the model goes on with the last turn instead of opening a new one
        options["continue_final_message"] = True
    else:
        options["add_generation_prompt"] = True
    return tokenizer.apply_chat_template(messages, tokenize=False, **options)


def render_prompt(
    tokenizer: Any, record: dict, instruction: str = DEFAULT_INSTRUCTION, system_prompt: str | None = None,
    chat_template_kwargs: dict | None = None,
) -> str:
    """Returns the text the model is prompted with for one record; the trainer, its evaluation and eval_agrpo.py
    all render through this function.

    A record with `prompt` is TRL's format: text is used as it is (no chat template, no instruction: TRL's standard
    format); a conversation (a list of {role, content}) goes through the chat template with the generation prompt
    opened, or with its last assistant turn continued, as TRL does, and `system_prompt` becomes its first turn when
    it has no system turn. Any other record (the recognised math formats, the built-in task) is `format_prompt` of its
    `problem`: the instruction appended, the system prompt, the chat template. `chat_template_kwargs` are the
    template's own variables (Qwen3's `enable_thinking`). Raises ValueError for a conversation and a tokenizer
    without a chat template.
    """
    if "prompt" not in record:
        return format_prompt(tokenizer, record["problem"], instruction, system_prompt, chat_template_kwargs)
    prompt = record["prompt"]
    if isinstance(prompt, str):
        return prompt
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the data set's prompts are conversations (lists of messages), and the tokenizer has no "
                         "chat template to render them: set chat_template (a Jinja template), use a model that has "
                         "one, or give the prompts as text")
    return _render_conversation(tokenizer, prompt, system_prompt, chat_template_kwargs)


# ---------------------------------------------------------------------------------------------------------------
# Gold answers and the reward functions that need them


def answer_needed(reward_funcs: list[tuple[str, Any]]) -> list[str]:
    """The names of the reward functions that cannot run without the gold answer: those with a parameter `answer`
    that has no default (the built-in accuracy, length and cosine; a custom f(prompts, completions, answer, ...))."""
    needed = []
    for name, func in reward_funcs:
        try:
            parameter = inspect.signature(func).parameters.get("answer")
        except (TypeError, ValueError):  # not a function (a reward model), or a signature Python cannot read
            continue
        if parameter is not None and parameter.default is inspect.Parameter.empty and parameter.kind not in (
                inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            needed.append(name)
    return needed


def check_answers(records: list[dict], reward_funcs: list[tuple[str, Any]], option: str, name: str,
                  named_rewards: dict = REWARD_FUNCS) -> None:
    """Raises ValueError when `records` have no gold answer and a reward function needs one, naming the functions,
    the columns looked for and the fix (the built-ins of `named_rewards` that need none); `option` and `name` say
    which data set (dataset_name and its value)."""
    needed = answer_needed(reward_funcs)
    if not records or "answer" in records[0] or not needed:
        return
    free = [n for n, func in named_rewards.items() if not answer_needed([(n, func)])]
    columns = sorted(k for k in records[0] if k != "problem")
    raise ValueError(
        f"reward_funcs: {', '.join(needed)} need{'s' if len(needed) == 1 else ''} the gold answer, and {option} "
        f"'{name}' has no answer column (looked for {', '.join(ANSWER_COLUMNS)}; columns found: {columns}). Name "
        f"the column with --answer_column NAME, or train with reward functions that need none ({', '.join(free)}, "
        f"or your own module:function without an `answer` parameter)")


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
