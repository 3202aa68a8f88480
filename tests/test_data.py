"""Tests for lib/data.py on the real data sets in shared/data (gold answers checked by hand against the files)."""

import json
import re

import pytest

from lib import data
from lib.data import DEFAULT_INSTRUCTION, builtin_task, format_number, format_prompt, last_boxed, load_records

# (file, record count from shared/data/README.md, gold of row 1, gold of row 2), read off the files by hand
REAL_FILES = [
    ("gsm8k/test.jsonl", 1319, "18", "3"),
    ("gsm8k/train.jsonl", 7473, "72", "10"),
    ("math500/test.jsonl", 500, "\\left( 3, \\frac{\\pi}{2} \\right)", "p - q"),
    ("math/test.jsonl", 5000, "2", "\\frac{1}{2}"),
    ("svamp/test.jsonl", 1000, "145", "19"),
    ("mawps/test.jsonl", 2065, "43", "26"),
    ("mawps/addsub.jsonl", 395, "43", "26"),
    ("mawps/multiarith.jsonl", 600, "39", "8"),
    ("mawps/singleeq.jsonl", 508, "43", "26"),
    ("mawps/singleop.jsonl", 562, "14", "9"),
    ("aime24/test.jsonl", 30, "204", "113"),
    ("amc23/test.jsonl", 40, "27", "36"),
]


@pytest.mark.parametrize("name, count, gold1, gold2", REAL_FILES)
def test_real_files_counts_and_gold(data_dir, name, count, gold1, gold2):
    records = load_records(str(data_dir / name))
    assert len(records) == count
    assert [records[0]["answer"], records[1]["answer"]] == [gold1, gold2]
    assert all(isinstance(r["problem"], str) and r["problem"] and isinstance(r["answer"], str) for r in records)


def test_gsm8k_problem_and_thousands_separator(data_dir):
    records = load_records(str(data_dir / "gsm8k/test.jsonl"))
    assert records[0]["problem"].startswith("Janet\u2019s ducks lay 16 eggs per day.")
    assert records[0]["question"] == records[0]["problem"]  # original columns stay under their own names
    golds = {r["answer"] for r in records}
    assert "114200" in golds and not any("," in g for g in golds)  # "#### 114,200" in the file


def test_svamp_problem_is_body_then_question(data_dir):
    first = load_records(str(data_dir / "svamp/test.jsonl"))[0]
    assert first["problem"] == (
        "There are 87 oranges and 290 bananas in Philip's collection. If the bananas are organized into 2 groups "
        "and oranges are organized into 93 groups How big is each group of bananas?"
    )
    assert first["Answer"] == 145.0 and first["ID"] == "chal-777"  # extra columns kept for reward functions


def test_mawps_non_integer_targets(data_dir):
    records = load_records(str(data_dir / "mawps/test.jsonl"))
    assert [records[205]["answer"], records[206]["answer"]] == ["11.5", "1.84"]  # lines 206, 207


def test_math500_keeps_answer_column_and_extras(data_dir):
    first = load_records(str(data_dir / "math500/test.jsonl"))[0]
    assert first["problem"].startswith("Convert the point $(0,3)$")
    assert first["subject"] == "Precalculus" and first["level"] == 2


def test_math500_boxed_agrees_with_answer_column(data_dir):
    # the same file read through its solutions: the last \boxed{} is the official answer in all 500 rows
    by_answer = load_records(str(data_dir / "math500/test.jsonl"))
    by_solution = load_records(str(data_dir / "math500/test.jsonl"), answer_column="solution")
    assert [r["answer"] for r in by_solution] == [r["answer"] for r in by_answer]


def test_math_train_has_two_empty_boxed_rows(data_dir):
    # MATH train lines 5530 and 5532 end in "\boxed{}" (the answer is missing upstream): validation stops there
    with pytest.raises(ValueError, match=r"train\.jsonl, line 5530: field 'solution': the extracted answer is empty"
                       r".*--skip_invalid_rows true"):
        load_records(str(data_dir / "math/train.jsonl"))
    with pytest.warns(UserWarning, match=r"left out 2 invalid row\(s\) of 7500; the first: .*line 5530"):
        records = load_records(str(data_dir / "math/train.jsonl"), skip_invalid_rows=True)
    assert len(records) == 7498


def test_last_boxed():
    assert last_boxed("so $x = \\boxed{\\frac{1}{2}}$.") == "\\frac{1}{2}"
    assert last_boxed("first \\boxed{1}, then \\boxed{\\{1, 2\\}}") == "\\{1, 2\\}"
    assert last_boxed("\\fbox{7}") == "7"
    assert last_boxed("$\\sqrt{289} = \\boxed {17}.$") == "17"  # spellings seen in MATH train
    assert last_boxed("$x^2 + y^2 = \\boxed 9$.") == "9"
    assert last_boxed("\\boxed{\\frac{1}{2}") is None  # unbalanced
    assert last_boxed("no box here") is None


def test_format_number():
    assert [format_number(x) for x in (145.0, 2.5, 7, -3.0, 1.84)] == ["145", "2.5", "7", "-3", "1.84"]
    with pytest.raises(ValueError, match="NaN"):
        format_number(float("nan"))


# --- column overrides -----------------------------------------------------------------------------------------


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_column_overrides(tmp_path):
    path = write_jsonl(
        tmp_path / "custom.jsonl",
        [
            {"text": "What is 2+2?", "worked": "2+2=4\n#### 4", "final": " 4 ", "sol": "so \\boxed{4}"},
            {"text": "What is 1,000 + 0?", "worked": "#### 1,000", "final": "1000", "sol": "\\boxed{1000}"},
        ],
    )
    for answer_column, golds in [("worked", ["4", "1000"]), ("final", ["4", "1000"]), ("sol", ["4", "1000"])]:
        records = load_records(path, prompt_column="text", answer_column=answer_column)
        assert [r["problem"] for r in records] == ["What is 2+2?", "What is 1,000 + 0?"]
        assert [r["answer"] for r in records] == golds


def test_prompt_column_override_on_real_file(data_dir):
    first = load_records(str(data_dir / "amc23/test.jsonl"), prompt_column="question")[0]
    assert first["problem"] == first["question"] and first["answer"] == "27"


# --- errors ---------------------------------------------------------------------------------------------------


def test_missing_column_names_file_row_field_and_fix(tmp_path):
    rows = [{"question": "q1", "answer": "#### 1"}, {"question": "q2", "answer": "#### 2"}, {"question": "q3"}]
    path = write_jsonl(tmp_path / "missing.jsonl", rows)
    with pytest.raises(ValueError) as err:
        load_records(path)
    message = str(err.value)
    for part in ["missing.jsonl", "line 3", "'answer'", "['question']", "--prompt_column", "--answer_column"]:
        assert part in message


def test_unknown_format_lists_columns(tmp_path):
    path = write_jsonl(tmp_path / "unknown.jsonl", [{"text": "hi", "label": 1}])
    with pytest.raises(ValueError, match=r"unknown\.jsonl, line 1: missing field a prompt column.*\['label', 'text'\]"):
        load_records(path)


def test_override_naming_absent_column(data_dir):
    with pytest.raises(ValueError, match=r"test\.jsonl, line 1: missing field 'prompt'.*--prompt_column"):
        load_records(str(data_dir / "gsm8k/test.jsonl"), prompt_column="prompt")


def test_invalid_json_names_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"question": "q1", "answer": "#### 1"}\n{"question": "q2", "answer": \n')
    with pytest.raises(ValueError, match=r"broken\.jsonl, line 2: invalid JSON"):
        load_records(str(path))


def test_gsm8k_answer_without_hashes(tmp_path):
    rows = [{"question": "q1", "answer": "#### 1"}, {"question": "q2", "answer": "2"}]
    path = write_jsonl(tmp_path / "gsm.jsonl", rows)
    with pytest.raises(ValueError, match=r"gsm\.jsonl, line 2: field 'answer': no '#### <answer>' line"):
        load_records(path)


@pytest.mark.parametrize("problem", [None, "", "   ", ["a", "list"]])
def test_bad_problem(tmp_path, problem):
    path = write_jsonl(tmp_path / "p.jsonl", [{"problem": "ok", "answer": 1}, {"problem": problem, "answer": 2}])
    with pytest.raises(ValueError, match=r"p\.jsonl, line 2: field 'problem' must be a non-empty string"):
        load_records(path)


def test_solution_without_boxed(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"problem": "p", "solution": "The answer is 3."}])
    with pytest.raises(ValueError, match=r"m\.jsonl, line 1: field 'solution': no \\boxed"):
        load_records(path)


@pytest.mark.parametrize("name", ["missing/gsm8k.jsonl", "test.parquet", "./nowhere", "/no/such/folder"])
def test_nonexistent_path(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=rf"dataset_id_or_path='{re.escape(name)}'"):
        load_records(name)


def test_folder_without_split(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"problem": "p", "answer": 1}])
    with pytest.raises(FileNotFoundError, match=r"without test\.jsonl.*\['train\.jsonl'\]"):
        load_records(str(tmp_path), split="test")


def test_max_samples_must_be_positive(data_dir):
    with pytest.raises(ValueError, match="max_samples"):
        load_records(str(data_dir / "amc23/test.jsonl"), max_samples=0)


# --- other sources --------------------------------------------------------------------------------------------


def test_parquet_folder_json_array_and_json_lines(tmp_path):
    import pyarrow
    import pyarrow.parquet

    rows = [{"question": "q1", "answer": "#### 1,5"}, {"question": "q2", "answer": "#### 7"}]
    (tmp_path / "pq").mkdir()
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), tmp_path / "pq" / "test.parquet")
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    (tmp_path / "lines.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sources = [tmp_path / "pq" / "test.parquet", tmp_path / "pq", tmp_path / "rows.json", tmp_path / "lines.json"]
    for source, split in zip(sources, ["train", "test", "train", "train"]):
        assert [r["answer"] for r in load_records(str(source), split=split)] == ["15", "7"]


def test_parquet_row_number_in_error(tmp_path):
    import pyarrow
    import pyarrow.parquet

    rows = [{"problem": "p1", "answer": "1"}, {"problem": "p2", "answer": "2"}, {"problem": None, "answer": "3"}]
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), tmp_path / "t.parquet")
    with pytest.raises(ValueError, match=r"t\.parquet, row 3: field 'problem'"):
        load_records(str(tmp_path / "t.parquet"))


def test_hub_id_offline_gives_clear_error(monkeypatch):
    datasets = pytest.importorskip("datasets")

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub")

    # the real call retries for ~25 s with no network; the wrapping is what is tested here
    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ValueError, match=r"'openai/gsm8k'.*hub was not reachable or the id is unknown.*\.jsonl"):
        load_records("openai/gsm8k")


def test_hub_id_rows_and_config(monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []

    def fake_load(name, config, split):
        calls.append((name, config, split))
        rows = [{"question": "q1", "answer": "#### 3"}, {"question": "q2", "answer": "#### 4"}]
        return datasets.Dataset.from_list(rows)

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    assert [r["answer"] for r in load_records("openai/gsm8k", split="test")] == ["3", "4"]
    assert calls == [("openai/gsm8k", "main", "test")]


# --- max_samples ----------------------------------------------------------------------------------------------


def test_max_samples_seeded_nested_in_file_order(data_dir):
    path = str(data_dir / "gsm8k/test.jsonl")
    everything = load_records(path)
    position = {r["problem"]: i for i, r in enumerate(everything)}
    small = load_records(path, max_samples=50, seed=1)
    large = load_records(path, max_samples=200, seed=1)
    assert len(small) == 50 and len(large) == 200
    assert small == load_records(path, max_samples=50, seed=1)
    assert small != load_records(path, max_samples=50, seed=2)
    assert small[:5] != everything[:5]  # a random subset, not the head of the file
    indices = [position[r["problem"]] for r in small]
    assert indices == sorted(indices)
    assert {r["problem"] for r in small} <= {r["problem"] for r in large}
    assert len(load_records(path, max_samples=10_000)) == 1319


# --- built-in task --------------------------------------------------------------------------------------------


def operands(problem: str) -> tuple[int, int]:
    a, b = (int(n) for n in re.findall(r"\d+", problem))
    return a, b


def test_builtin_task_sizes_and_determinism():
    train, evaluation = builtin_task(seed=0)
    assert (len(train), len(evaluation)) == (2000, 200)
    assert builtin_task(seed=0) == (train, evaluation)
    other_train, other_eval = builtin_task(seed=1)
    assert other_train != train and other_eval != evaluation
    small_train, same_eval = builtin_task(seed=0, num_train=50, num_eval=200)
    assert len(small_train) == 50 and same_eval == evaluation


def test_builtin_task_disjoint_and_distinct():
    train, evaluation = builtin_task(seed=3)
    train_texts, eval_texts = {r["problem"] for r in train}, {r["problem"] for r in evaluation}
    assert len(train_texts) == len(train) and len(eval_texts) == len(evaluation)
    assert not train_texts & eval_texts


def test_builtin_task_answers_and_ranges():
    assert {r["operation"] for r in builtin_task(seed=0, num_train=300)[0]} == set(data.DEFAULT_OPERATIONS)
    with pytest.raises(ValueError, match="operations must be"):
        builtin_task(seed=0, operations=("division",))
    train, evaluation = builtin_task(seed=0, operations=tuple(data.TEMPLATES))
    compute = {"addition": lambda a, b: a + b, "subtraction": lambda a, b: a - b, "multiplication": lambda a, b: a * b}
    for record in train + evaluation:
        assert set(record) == {"problem", "answer", "operation"}
        a, b = operands(record["problem"])
        assert record["answer"] == str(compute[record["operation"]](a, b))
        if record["operation"] == "addition":
            assert data.ADDITION_RANGE[0] <= min(a, b) and max(a, b) <= data.ADDITION_RANGE[1]
        elif record["operation"] == "subtraction":
            assert data.SUBTRACTION_RANGE[0] <= a <= data.SUBTRACTION_RANGE[1] and 1 <= b < a
        else:
            assert data.MULTIPLICATION_RANGE[0] <= min(a, b) and max(a, b) <= data.MULTIPLICATION_RANGE[1]
    assert {r["operation"] for r in evaluation} == set(compute)
    # every phrasing of every operation shows up in 2,000 draws
    patterns = []
    for template in (t for templates in data.TEMPLATES.values() for t in templates):
        pattern = re.escape(template).replace(r"\{name\}", r"\w+").replace(r"\{item\}", r"\w+")
        patterns.append(pattern.replace(r"\{a\}", r"\d+").replace(r"\{b\}", r"\d+"))
    assert all(any(re.fullmatch(p, r["problem"]) for r in train) for p in patterns)


# --- prompts --------------------------------------------------------------------------------------------------


class ChatTokenizer:
    """Stands in for a tokenizer with a chat template: renders messages as <role>content</role>."""

    chat_template = "a template"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert tokenize is False and add_generation_prompt is True
        return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages) + "<assistant>"


class PlainTokenizer:
    chat_template = None


def test_format_prompt_with_chat_template():
    assert format_prompt(ChatTokenizer(), "What is 2 + 3?") == (
        "<user>What is 2 + 3?\nGive the final answer as 'Answer: <number>'.</user><assistant>"
    )
    assert format_prompt(ChatTokenizer(), "Q", instruction="Think.", system_prompt="Be brief.") == (
        "<system>Be brief.</system><user>Q\nThink.</user><assistant>"
    )


def test_format_prompt_without_chat_template():
    assert format_prompt(PlainTokenizer(), "What is 2 + 3?") == f"What is 2 + 3?\n{DEFAULT_INSTRUCTION}\n"
    assert format_prompt(PlainTokenizer(), "Q", instruction="") == "Q\n"
