"""Tests for lib/data/records.py on the real data sets: the slices in tests/data (rows copied from the sets' files), and the
whole files where the full sets are given (the `full_data_dir` fixture; gold answers checked by hand against the
files)."""

import json
import re

import pytest

from conftest import FULL_DATA, NO_FULL_DATA, REPO
from lib.data import hub_data
from lib.data import word_problems
from lib.data.records import DEFAULT_INSTRUCTION, format_number, format_prompt, last_boxed, load_records, render_prompt
from lib.data.word_problems import builtin_task

# (file, records in the full set (its README) and in the slice (tests/data/README.md), gold of row 1, gold of row 2),
# read off the files by hand; a slice starts at the set's first row
REAL_FILES = [
    ("gsm8k/test.jsonl", 1319, 250, "18", "3"),
    ("gsm8k/train.jsonl", 7473, 100, "72", "10"),
    ("math500/test.jsonl", 500, 100, "\\left( 3, \\frac{\\pi}{2} \\right)", "p - q"),
    ("math/test.jsonl", 5000, 100, "2", "\\frac{1}{2}"),
    ("svamp/test.jsonl", 1000, 300, "145", "19"),
    ("mawps/test.jsonl", 2065, 210, "43", "26"),
    ("mawps/addsub.jsonl", 395, 200, "43", "26"),
    ("mawps/multiarith.jsonl", 600, 50, "39", "8"),
    ("mawps/singleeq.jsonl", 508, 50, "43", "26"),
    ("mawps/singleop.jsonl", 562, 200, "14", "9"),
    ("aime24/test.jsonl", 30, 20, "204", "113"),
    ("amc23/test.jsonl", 40, 20, "27", "36"),
]


@pytest.mark.parametrize("where", ["data_dir", FULL_DATA])
@pytest.mark.parametrize("name, full, sliced, gold1, gold2", REAL_FILES)
def test_real_files_counts_and_gold(request, where, name, full, sliced, gold1, gold2):
    records = load_records(str(request.getfixturevalue(where) / name))
    assert len(records) == (sliced if where == "data_dir" else full)
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


@pytest.mark.parametrize("where, line, rows", [("data_dir", 30, 100), pytest.param(
    "full_data_dir", 5530, 7500, marks=pytest.mark.ci_may_skip(NO_FULL_DATA))])
def test_math_train_has_two_empty_boxed_rows(request, where, line, rows):
    # MATH train lines 5530 and 5532 end in "\boxed{}" (the answer is missing upstream; lines 30 and 32 of the
    # slice, which starts at line 5501): validation stops there
    path = str(request.getfixturevalue(where) / "math/train.jsonl")
    with pytest.raises(ValueError, match=rf"train\.jsonl, line {line}: field 'solution': the extracted answer is "
                       r"empty.*--skip_invalid_rows true"):
        load_records(path)
    with pytest.warns(UserWarning, match=rf"left out 2 invalid row\(s\) of {rows}; the first: .*line {line}"):
        records = load_records(path, skip_invalid_rows=True)
    assert len(records) == rows - 2


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
    with pytest.raises(FileNotFoundError, match=rf"dataset_name='{re.escape(name)}'"):
        load_records(name)


def test_folder_without_split(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"problem": "p", "answer": 1}])
    with pytest.raises(FileNotFoundError, match=r"without test\.jsonl.*\['train\.jsonl'\]"):
        load_records(str(tmp_path), split="test", reader=hub_data)


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
    assert load_records(path, max_samples=10_000) == everything  # more than the file holds: all of it


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
    assert {r["operation"] for r in builtin_task(seed=0, num_train=300)[0]} == set(word_problems.DEFAULT_OPERATIONS)
    with pytest.raises(ValueError, match="operations must be"):
        builtin_task(seed=0, operations=("division",))
    train, evaluation = builtin_task(seed=0, operations=tuple(word_problems.TEMPLATES))
    compute = {"addition": lambda a, b: a + b, "subtraction": lambda a, b: a - b, "multiplication": lambda a, b: a * b}
    for record in train + evaluation:
        assert set(record) == {"problem", "answer", "operation"}
        a, b = operands(record["problem"])
        assert record["answer"] == str(compute[record["operation"]](a, b))
        if record["operation"] == "addition":
            assert word_problems.ADDITION_RANGE[0] <= min(a, b) and max(a, b) <= word_problems.ADDITION_RANGE[1]
        elif record["operation"] == "subtraction":
            assert word_problems.SUBTRACTION_RANGE[0] <= a <= word_problems.SUBTRACTION_RANGE[1] and 1 <= b < a
        else:
            low, high = word_problems.MULTIPLICATION_RANGE
            assert low <= min(a, b) and max(a, b) <= high
    assert {r["operation"] for r in evaluation} == set(compute)
    # every phrasing of every operation shows up in 2,000 draws
    patterns = []
    for template in (t for templates in word_problems.TEMPLATES.values() for t in templates):
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


# --- TRL's prompt format (docs/troubleshooting.md 3.1) ----------------------------------------------------------

# The sha256 of the 2,200 prompts of the default run (Config's defaults: the built-in task, seed 42, SmolLM2's chat
# template, the default instruction, no system prompt), each joined by a NUL byte, as format_prompt rendered them
# before render_prompt existed (commit b6aa7b7): the default run's prompts must not change by a byte.
DEFAULT_RUN_PROMPTS_SHA256 = "2b4ed4e84363462323c1d90826799a58935d1cea2348ecacd8f982e35ac68ba6"


def test_the_default_run_prompts_are_byte_for_byte_what_they_were(tokenizer):
    import hashlib
    from types import SimpleNamespace

    from lib.config import Config
    from lib.sampling.context import RolloutContext

    cfg = Config()
    train, held_out = builtin_task(seed=cfg.seed, num_train=cfg.builtin_num_train, num_eval=cfg.num_eval_samples)
    # the trainer's own method (sampling, rewards and evaluation all call it), on just what it reads
    context = SimpleNamespace(tokenizer=tokenizer, cfg=cfg, system_prompt=cfg.system_prompt,
                              template_kwargs=cfg.chat_template_kwargs, episodes=None)
    texts = [RolloutContext.prompt_text(context, r) for r in train + held_out]
    assert hashlib.sha256("\x00".join(texts).encode()).hexdigest() == DEFAULT_RUN_PROMPTS_SHA256
    assert texts[0] == render_prompt(tokenizer, train[0]) == format_prompt(tokenizer, train[0]["problem"])


MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2 + 3?"}]


def test_a_conversation_goes_through_the_chat_template_as_it_is(tokenizer):
    record = {"prompt": MESSAGES, "level": 1}
    text = render_prompt(tokenizer, record, instruction="Think.", system_prompt="Ignored: the messages have one.")
    assert text == tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert "Think." not in text and "Ignored" not in text and text.endswith("<|im_start|>assistant\n")
    # no system turn: system_prompt becomes the first one (instead of the template's default)
    user_only = {"prompt": MESSAGES[1:]}
    assert render_prompt(tokenizer, user_only, system_prompt="Be brief.") == tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, MESSAGES[1]], tokenize=False, add_generation_prompt=True)
    assert user_only == {"prompt": MESSAGES[1:]}  # the record is not changed
    # an assistant turn last is continued, not closed (TRL's continue_final_message)
    started = render_prompt(tokenizer, {"prompt": [*MESSAGES, {"role": "assistant", "content": "It is"}]})
    assert started.endswith("<|im_start|>assistant\nIt is")


def test_a_text_prompt_is_used_as_it_is(tokenizer):
    record = {"prompt": "Q: What is 2 + 3?\nA:", "answer": "5"}
    assert render_prompt(tokenizer, record, instruction="Think.", system_prompt="Be brief.") == record["prompt"]


def test_chat_template_kwargs_reach_the_template_and_a_missing_template_is_named(tokenizer):
    import copy

    own = copy.deepcopy(tokenizer)
    own.chat_template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant:{% if not thinking %} /no_think{% endif %}{% endif %}")
    record = {"prompt": MESSAGES}
    assert render_prompt(own, record, chat_template_kwargs={"thinking": False}) == (
        "system: You are terse.\nuser: What is 2 + 3?\nassistant: /no_think")
    assert render_prompt(own, record, chat_template_kwargs={"thinking": True}).endswith("assistant:")
    # the math formats take the same variables
    assert render_prompt(own, {"problem": "Q", "answer": "1"}, instruction="I.",
                         chat_template_kwargs={"thinking": False}) == "user: Q\nI.\nassistant: /no_think"
    own.chat_template = None
    with pytest.raises(ValueError, match="conversations .* no chat template .* set chat_template"):
        render_prompt(own, record)
    assert render_prompt(own, {"prompt": "as is"}) == "as is"


def test_trl_prompt_column_keeps_every_column_and_reads_an_answer_if_there_is_one(tmp_path):
    rows = [{"prompt": MESSAGES, "level": 1, "source": "a"}, {"prompt": MESSAGES[1:], "level": 2, "source": "b"}]
    records = load_records(write_jsonl(tmp_path / "chat.jsonl", rows))
    assert records == rows  # no gold, no `problem`: the rows as they are
    with_gold = [{**r, "solution": gold} for r, gold in zip(rows, ["so \\boxed{5}", "7"])]
    assert [r["answer"] for r in load_records(write_jsonl(tmp_path / "gold.jsonl", with_gold))] == ["5", "7"]
    text = [{"prompt": "2 + 3 =", "answer": "#### 5"}, {"prompt": "3 + 4 =", "answer": 7}]
    records = load_records(write_jsonl(tmp_path / "text.jsonl", text))
    assert [(r["prompt"], r["answer"]) for r in records] == [("2 + 3 =", "5"), ("3 + 4 =", "7")]
    # `prompt` wins over the math columns, as it does in TRL; --prompt_column prompt says the same
    both = [{"prompt": "P", "question": "Q", "answer": "1"}]
    for columns in ({}, {"prompt_column": "prompt"}):
        assert load_records(write_jsonl(tmp_path / "both.jsonl", both), **columns) == [
            {"prompt": "P", "question": "Q", "answer": "1"}]


def test_a_data_set_without_an_answer_column_loads_without_gold(data_dir, tmp_path):
    # GSM8K's questions without their answers: read as before, no `answer` key
    questions = [{"question": json.loads(line)["question"]}
                 for line in (data_dir / "gsm8k" / "test.jsonl").read_text().splitlines()[:3]]
    records = load_records(write_jsonl(tmp_path / "questions.jsonl", questions))
    assert [r["problem"] for r in records] == [q["question"] for q in questions]
    assert not any("answer" in r for r in records)


@pytest.mark.parametrize("prompt, message", [
    ("  ", r"line 1: field 'prompt' is empty"),
    (3, r"line 1: field 'prompt' must be text \(used as it is\) or a list of messages"),
    ([], r"line 1: field 'prompt' must be text"),
    ([{"role": "user"}], r"line 1: field 'prompt', message 1: expected \{'role': str, 'content': str\}"),
    ([{"role": "user", "content": "hi"}, "bye"], r"line 1: field 'prompt', message 2"),
    ([{"role": "user", "content": "hi"}, {"role": "system", "content": "x"}],
     r"line 1: field 'prompt': the conversation ends with a 'system' message; end it with a user turn"),
])
def test_a_bad_prompt_names_the_file_the_row_and_the_field(tmp_path, prompt, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": prompt}])
    with pytest.raises(ValueError, match=r"bad\.jsonl, " + message):
        load_records(path)


def test_messages_outside_the_prompt_column_and_a_prompt_column_left_aside_are_refused(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"question": MESSAGES, "answer": "#### 5"}])
    with pytest.raises(ValueError, match=r"m\.jsonl, line 1: field 'question' holds messages; .* named 'prompt'"):
        load_records(path)
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "P", "question": "Q", "answer": "#### 5"}])
    with pytest.raises(ValueError, match=r"p\.jsonl, line 1: the data set has a 'prompt' column.*--prompt_column "
                                         r"names 'question'. Leave --prompt_column unset"):
        load_records(path, prompt_column="question")


def test_reward_functions_that_need_the_gold_answer_are_named_with_the_fix():
    from lib.data.records import answer_needed, check_answers
    from lib.rewards.open_r1 import REWARD_FUNCS
    from lib.rewards.scoring import resolve_reward_funcs

    tiny = f"{REPO / 'tests' / 'tiny_rewards.py'}:characters"
    funcs = resolve_reward_funcs(["accuracy", "format", "length", "cosine", "repetition", tiny],
                                 named_rewards=REWARD_FUNCS)
    assert answer_needed(funcs) == ["accuracy", "length", "cosine"]
    no_gold = [{"prompt": MESSAGES, "level": 1}]
    with pytest.raises(ValueError) as error:
        check_answers(no_gold, funcs, "dataset_name", "chat.jsonl", REWARD_FUNCS)
    message = str(error.value)
    for part in ["reward_funcs: accuracy, length, cosine need the gold answer", "dataset_name 'chat.jsonl' has no "
                 "answer column", "answer, solution, Answer, target", "['level', 'prompt']", "--answer_column NAME", "format",
                 "module:function without an `answer` parameter",
                 "need none (format, think_format, repetition, soft_overlong, tag_count, reasoning_steps, or your own"]:
        assert part in message, part
    check_answers(no_gold, resolve_reward_funcs(["format", tiny]), "dataset_name", "chat.jsonl")  # nothing to say
    check_answers([{"problem": "p", "answer": "1"}], funcs, "dataset_name", "gold.jsonl")


def test_a_run_without_dataset_name_trains_on_the_builtin_task():
    """lib/setup.load_data: without dataset_name, lib/data/word_problems.builtin_task's problems from the seed."""
    from lib.config import Config
    from lib.setup import load_data

    cfg = Config(builtin_num_train=20, num_eval_samples=5)
    train, held_out = load_data(cfg)
    assert (train, held_out) == builtin_task(seed=cfg.seed, num_train=20, num_eval=5)
    assert len(train) == 20 and len(held_out) == 5
