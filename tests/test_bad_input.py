"""Bad input at every door gets one line that names the field and the fix, never a traceback: property tests (with
hypothesis) of the configuration (every key of Config, through the command line, make_config and a YAML recipe) and
of the data readers (every format load_records reads), then the YAML recipe's own errors.

The property tests are deterministic (derandomize=True) for a given set of imported modules: Hypothesis also draws
constants it finds in the project's loaded code, so the whole suite draws other examples than this file alone (CI
found three message bugs that a lone run never drew). Sized to run in seconds on one thread; no model is loaded."""

import dataclasses
import functools
import io
import json
import math
import subprocess
import sys
from contextlib import redirect_stderr

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import REPO
from lib.config import Config, ConfigError, load_yaml, make_config, parse_config, validate
from lib.data.records import load_records
from lib import hub
from lib.data import hub_data

FIELDS = [f.name for f in dataclasses.fields(Config)]


def examples(count: int) -> settings:
    """Hypothesis settings: `count` examples, the same ones on every run, no example database, no time limit."""
    return settings(max_examples=count, derandomize=True, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

# ---------------------------------------------------------------------------------------------- values of any type

# text a user could type where a number, a flag or a name is expected
TRICKY_TEXT = ["", " ", "nan", "NaN", "inf", "-inf", "1e400", "-1", "0", "1.5", "1e3", "true", "false", "yes", "null",
               "None", "~", "[1, 2", "{a: 1}", "- x", "\x00", "a\x00b", "../..", "/", "x" * 300, "é", "日本",
               "🙂", "--lr", "accuracy", "embedded", "latest", "Answer:"]
scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-3, max_value=70),
    st.integers(), st.sampled_from([2**31, 2**32, 2**63, 2**64, 10**400, -10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-300, 1e300, 0.5, 1.0, 2.0]),
    st.sampled_from(TRICKY_TEXT), st.text(max_size=12))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=5)


def cli_words(value) -> list[str]:
    """A value as a user types it after --key: one word, several for a list, JSON for a structure."""
    def word(v) -> str:
        if v is None:
            return "null"
        if isinstance(v, bool):
            return str(v).lower()
        if isinstance(v, (dict, list)):
            return json.dumps(v)
        return repr(v) if isinstance(v, float) else str(v)

    return [word(v) for v in value] if isinstance(value, list) else [word(value)]


def check_outcome(key: str, build) -> None:
    """build() gives a Config (validated again here for one process) or raises ConfigError naming `key`."""
    try:
        cfg = build()
        validate(cfg, num_processes=1)
    except ConfigError as error:
        assert key in str(error), f"{key}: the message does not name the key: {error}"
        assert "\n" not in str(error).strip() or key == "resample_schedule", str(error)
        return
    assert isinstance(cfg, Config)


# ---------------------------------------------------------------------------------------------- (a) configuration


@examples(10)  # 10 x 122 keys x 3 doors: 3,660 checks
@given(chosen=st.fixed_dictionaries({key: values for key in FIELDS}))
def test_any_value_for_any_key_is_a_config_or_a_config_error_naming_the_key(chosen, tmp_path_factory, monkeypatch):
    """Each example gives every key of Config a value of any type; each key is tried alone, through all three doors."""
    folder = tmp_path_factory.getbasetemp() / "config_values"  # an empty folder: no value names a file in it
    folder.mkdir(exist_ok=True)
    monkeypatch.chdir(folder)
    recipe = tmp_path_factory.getbasetemp() / "recipe.yaml"
    for key, value in chosen.items():
        # as YAML or Python gives it
        check_outcome(key, functools.partial(make_config, {key: value}))
        # as typed on the command line
        words = cli_words(value)
        argv = [f"--{key}={words[0]}"] if not isinstance(value, list) else [f"--{key}", *words]
        stderr = io.StringIO()
        try:
            with redirect_stderr(stderr):
                check_outcome(key, functools.partial(parse_config, argv))
        except SystemExit as stop:  # argparse's own one-line refusal: a list value holding '--lr' or '-x' reads
            # as an unknown option ("unrecognized arguments: --lr"), an empty one as "expected at least one argument"
            said = stderr.getvalue()  # the whole of it: the value may hold line breaks (\x0c, \x1c, ...)
            assert stop.code == 2 and "error: " in said, said
            assert f"--{key}" in said or "unrecognized arguments" in said, said
        # as written in a YAML recipe
        recipe.write_text(yaml.safe_dump({key: value}, allow_unicode=True), encoding="utf-8")
        check_outcome(key, functools.partial(parse_config, ["--config", str(recipe)]))


@examples(150)
@given(text=st.one_of(st.text(max_size=60), st.sampled_from(["a: [1, 2", "- 1\n- 2", "'x", "a: *b", "\ta: 1",
                                                             "a: 1\na: 2", "!!python/object:os.system 1",
                                                             "--- 1\n--- 2", "[1]: 2", "1: 2", "a: b: c"])))
def test_any_yaml_text_is_a_mapping_or_a_config_error_naming_the_file(text, tmp_path_factory):
    recipe = tmp_path_factory.getbasetemp() / "any.yaml"
    recipe.write_text(text, encoding="utf-8")
    try:
        data = load_yaml(str(recipe))
    except ConfigError as error:
        assert str(recipe) in str(error) and "\n" not in str(error)
        return
    assert isinstance(data, dict) and all(isinstance(k, str) for k in data)


# ---------------------------------------------------------------------------------------------- (b) data files


# cells of any JSON type, with the column names the format detection looks for among the random ones
json_cells = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.sampled_from(
        ["#### 4", "\\boxed{3}", "\\boxed{", "", " ", "2 + 2?", "####", "#### ", "1,000"]), st.text(max_size=15)),
    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=4), inner, max_size=2),
    max_leaves=4)
column_names = st.one_of(st.sampled_from(["prompt", "problem", "question", "input", "answer", "solution", "Answer",
                                          "target", "Body", "Question"]), st.text(max_size=6))
rows = st.lists(st.dictionaries(column_names, json_cells, max_size=4), max_size=4)


def write_rows(path, rows, how: str) -> None:
    """Rows as a file of one format; some damaged on purpose."""
    if how == "jsonl":
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    elif how == "json":
        path.write_text(json.dumps(rows, ensure_ascii=False), encoding="utf-8")
    elif how == "parquet":
        import pyarrow
        import pyarrow.parquet

        try:  # the cells as they are where Arrow can type them, else as JSON text
            pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)
        except (pyarrow.ArrowException, TypeError, ValueError, OverflowError):
            pyarrow.parquet.write_table(pyarrow.Table.from_pylist(
                [{k: json.dumps(v) for k, v in r.items()} for r in rows]), path)


def check_records(path, **kwargs) -> None:
    """load_records gives valid records, or ValueError / FileNotFoundError naming the file, never another error."""
    try:
        records = load_records(str(path), reader=hub_data, **kwargs)
    except (ValueError, FileNotFoundError) as error:
        assert path.name in str(error), f"the message does not name the file: {error}"
        assert "\n" not in str(error), str(error)
        return
    for r in records:  # a problem, or TRL's prompt (text or messages); a gold answer where the data set has one
        prompt = r["prompt"] if "prompt" in r else r["problem"]
        assert (isinstance(prompt, str) and prompt.strip()) or (isinstance(prompt, list) and prompt), r
        assert "answer" not in r or (isinstance(r["answer"], str) and r["answer"]), r
    assert records


@pytest.mark.filterwarnings("ignore:left out")
@pytest.mark.parametrize("how", ["jsonl", "json", "parquet"])
@examples(100)
@given(rows=rows, columns=st.sampled_from([{}, {"prompt_column": "question", "answer_column": "answer"}]),
       skip=st.booleans())
def test_any_rows_in_any_format_load_or_fail_naming_the_file(how, rows, columns, skip, tmp_path_factory):
    path = tmp_path_factory.getbasetemp() / f"rows.{how}"
    write_rows(path, rows, how)
    check_records(path, skip_invalid_rows=skip, **columns)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
@examples(100)
@given(data=st.one_of(
    st.binary(max_size=40),
    st.sampled_from([b"", b"\n\n", b"\xff\xfe{}", b'{"question": "\xe9"}\n', b'{"question": "a", "answer": "#### 1"',
                     b"[", b"[{", b'[{"question": "a", "answer": "#### 1"}', b"null", b"3", b'"x"', b"{}", b"[]",
                     b"[1, 2]", b"PAR1", b"PAR1\x00\x00PAR1", b"\xef\xbb\xbf[]", b'{"a": NaN}\n', b"[[]]",
                     b'{"question": "a", "answer": "#### 1"}\n{"question"']),
    st.text(max_size=40).map(lambda t: t.encode("utf-8"))))
def test_any_bytes_in_any_data_file_load_or_fail_naming_the_file(suffix, data, tmp_path_factory):
    path = tmp_path_factory.getbasetemp() / f"bytes{suffix}"
    path.write_bytes(data)
    check_records(path)


def test_a_data_path_that_is_not_a_readable_file_names_it(tmp_path):
    (tmp_path / "train.jsonl").mkdir()  # a folder named like a file, inside a folder
    for path in (tmp_path / "missing.jsonl", tmp_path / "notes.txt", tmp_path / "train.jsonl"):
        if path.suffix == ".txt":
            path.write_text("x")
        check_records(path)
    with pytest.raises(FileNotFoundError, match="is a folder without test.jsonl"):
        load_records(str(tmp_path), split="test", reader=hub_data)


# ---------------------------------------------------------------------------------------------- YAML recipes


@pytest.mark.parametrize("content, message", [
    (b"learning_rate: [1, 2\n", "line 2, column 1: expected ',' or ']', but got '<stream end>' (while parsing a flow "
                                "sequence at line 1, column 16); fix the YAML there"),
    (b"learning_rate: 1e-5\n  beta: 0\n", "line 2, column 7: mapping values are not allowed here"),
    (b"- learning_rate\n- 1e-5\n", "must hold a mapping of keys to values (lines of 'key: value'), but its top level "
                                   "is a list"),
    (b"learning_rate: 1e-5\nlearning_rate: 2e-5\n", "line 2, column 1: the key 'learning_rate' is given twice"),
    (b"beta: \xff\n", "is not UTF-8 text (byte 6: invalid start byte); save the recipe as UTF-8"),
    (b"beta: !!python/object/apply:os.system [echo]\n", "could not determine a constructor for the tag"),
])
def test_yaml_recipe_errors_name_the_file_the_place_and_the_fix(content, message, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_bytes(content)
    with pytest.raises(ConfigError) as error:
        parse_config(["--config", str(recipe)])
    assert message in str(error.value) and "recipe.yaml" in str(error.value)


def test_yaml_recipe_that_is_missing_or_a_folder_is_named(tmp_path):
    with pytest.raises(ConfigError, match="the file '.*missing.yaml' does not exist; pass the path of a YAML recipe"):
        load_yaml(str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="is a folder; pass the path of a YAML recipe file"):
        load_yaml(str(tmp_path))
    (tmp_path / "empty.yaml").write_text("# nothing\n")
    assert load_yaml(str(tmp_path / "empty.yaml")) == {}


@pytest.mark.slow  # the trainer in a subprocess: 7 s; load_yaml's messages are tested in this process above
def test_trainer_prints_a_yaml_syntax_error_on_one_line_and_exits_1(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("learning_rate: [1, 2\n")
    proc = subprocess.run([sys.executable, str(REPO / "train_agrpo.py"), "--config", str(recipe)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("configuration error: config: ") and "line 2, column 1" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("value, message", [
    ("nan", "learning_rate: nan is not a finite number"), ("inf", "learning_rate: inf is not a finite number"),
])
def test_non_finite_numbers_are_refused(value, message):
    """NaN passed every range check (each comparison with it is False) and trained with a NaN learning rate."""
    with pytest.raises(ConfigError, match=message):
        parse_config([f"--learning_rate={value}"])
    assert math.isfinite(parse_config(["--learning_rate", "1e-6"]).learning_rate)


def test_a_flag_that_is_not_a_field_is_named_not_read_as_an_abbreviation():
    """argparse's abbreviations read `--lr 1e-5` as --lr_scheduler_type 1e-5, then refused '1e-5' as a scheduler
    (found by the property test above); now `--lr` is an unknown key, named."""
    with pytest.raises(ConfigError, match="unknown configuration key 'lr' \\(the command line\\)"):
        parse_config(["--lr", "1e-5"])


@pytest.mark.parametrize("argv, where", [
    (["--run_name", "x", "--lr"], "after --run_name and its value"),
    (["--hub_revision", "-1", "--lr"], "after --hub_revision and its value"),
    (["--reward_weights", "1", "-2", "--lr"], "after --reward_weights and its values"),
    (["--trust_remote_code", "--lr"], "after --trust_remote_code, a switch that is true when given alone"),
])
def test_an_unknown_flag_after_a_known_one_names_both(argv, where):
    """A list value holding '--lr' (the property test above) reads as an unknown flag of its own; the message names
    the flag it follows, since it may have been meant as that flag's value."""
    with pytest.raises(ConfigError) as error:
        parse_config(argv)
    assert str(error.value).startswith(f"unknown configuration key 'lr' (the command line, {where})")


@pytest.mark.parametrize("argv, key", [
    (["--hub_strategy", "a\nb"], "hub_strategy"), (["--hub_model_id", "a\nb"], "hub_model_id"),
    (["--lr_scheduler_kwargs", '{"\\nx": 1}'], "lr_scheduler_kwargs"),
])
def test_a_value_with_a_line_break_is_quoted_on_one_line(argv, key):
    """Values are shown with their escapes (repr), so a line break in one cannot split the one-line message
    (hub_model_id is read as a repository id when a run starts: lib/hub.check_settings)."""
    with pytest.raises(ConfigError) as error:
        hub.check_settings(parse_config(argv))
    assert str(error.value).startswith(f"{key}: ") and "\n" not in str(error.value) and "\\n" in str(error.value)


@pytest.mark.parametrize("key", ["resume_from_checkpoint", "model_name_or_path", "dataset_name"])
def test_a_path_under_an_unknown_users_home_is_a_missing_path(key):
    """pathlib's expanduser raises RuntimeError for '~name/...' when there is no user 'name' (the property test found
    it); such a path is kept as typed and reported as missing, naming the key."""
    with pytest.raises(ConfigError, match=f"^{key}: "):
        make_config({key: "~no_such_user_agrpo/folder"})
