"""report_to as TRL takes it, and what each tracker receives (lib/hub.py, docs/hub.md 4), offline: TensorBoard's event
files, wandb's offline run folder (WANDB_MODE=offline, under the run directory) and trackio's local store
(TRACKIO_DIR), each read back after a run of the trainer on the tiny random model of tests/conftest.py."""

import glob
import importlib.util
import json
import os
import sqlite3
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO
from lib import hub
from lib.config import ConfigError, make_config, parse_config
from lib.hub import check_settings, resolve_report_to

REWARDS = str(REPO / "tests" / "tiny_rewards.py")
TINY = ["--max_steps", "2", "--per_device_train_batch_size", "8", "--num_generations", "4",
        "--max_completion_length", "8", "--num_eval_samples", "4", "--builtin_num_train", "64", "--learning_rate",
        "1e-3", "--reward_funcs", f"{REWARDS}:has_x", f"{REWARDS}:characters", "--reward_weights", "1", "0.5",
        "--correctness_reward", "has_x", "--bf16", "false"]
TOKEN = "hf_test_secret_never_written"


def test_report_to_takes_a_name_or_a_list_as_trl_does(tmp_path):
    installed = {"tensorboard", "wandb"}.__contains__
    assert resolve_report_to("none", installed) == [] and resolve_report_to(None, installed) == []
    assert resolve_report_to("wandb", installed) == ["wandb"]
    assert resolve_report_to(["wandb", "tensorboard", "wandb"], installed) == ["wandb", "tensorboard"]
    assert resolve_report_to(["all"], installed) == ["tensorboard", "wandb"]  # the installed ones
    with pytest.raises(ValueError, match=r"^report_to: 'trackio' needs its package: pip install trackio \(or remove "
                                         r"it from report_to\)$"):
        resolve_report_to(["tensorboard", "trackio"], installed)
    with pytest.raises(ValueError, match=r"^report_to: 'mlflow' is not one of none, all, tensorboard, wandb, trackio"):
        resolve_report_to("mlflow", installed)
    with pytest.raises(ValueError, match=r"^report_to: 'none' cannot be combined with other trackers"):
        resolve_report_to(["none", "wandb"], installed)
    # the configuration: a YAML list, a list of flags, TRL's `report_to: none`, resolved when a run starts
    # (lib/hub.check_settings, train_agrpo.setup's first step); config.yaml keeps the resolved list
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("report_to: [tensorboard]\nrun_name: first\n")
    cfg = parse_config(["--config", str(recipe)])
    check_settings(cfg)
    assert (cfg.report_to, cfg.project, cfg.run_name) == (["tensorboard"], "agrpo", "first")
    cfg = parse_config(["--report_to", "tensorboard", "tensorboard", "--project", "p"])
    check_settings(cfg)
    assert cfg.report_to == ["tensorboard"]
    cfg = make_config({"report_to": "none"})
    check_settings(cfg)
    assert cfg.report_to == []
    with pytest.raises(ConfigError, match=r"^report_to: 'mlflow' is not one of"):
        check_settings(make_config({"report_to": "mlflow"}))
    with pytest.raises(ConfigError, match=r"^project is empty"):
        make_config({"project": ""})


def test_completions_reach_tensorboard_as_one_markdown_table():
    text = hub.completions_markdown([{"step": 3, "prompt": "a | b\nc", "completion": "x", "answer": "2",
                                      "reward": 0.123456, "advantage": -1.0}])
    assert text.splitlines() == ["| step | prompt | completion | answer | reward | advantage |",
                                 "|---|---|---|---|---|---|", "| 3 | a \\| b<br>c | x | 2 | 0.1235 | -1 |"]


def wandb_records(run_folder: Path) -> list:
    """The records of wandb's offline run file (run-<id>.wandb): a 7-byte header, then LevelDB-style log blocks of
    32 KiB whose records (4-byte checksum, 2-byte length, 1-byte type: 1 full, 2 first, 3 middle, 4 last) carry
    wandb's Record protobufs. wandb 0.31 ships no reader for it."""
    from wandb.proto import wandb_internal_pb2

    data = next(run_folder.glob("run-*.wandb")).read_bytes()
    assert data[:4] == b":W&B"
    records, pos, part, block, header = [], 7, b"", 32768, 7
    while pos + header <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + header]) if left >= header else (0, 0, 0)
        if left < header or (length == 0 and kind == 0):  # the block's padding
            pos += left
            continue
        part += data[pos + header:pos + header + length]
        pos += header + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(part)
            records.append(record)
            part = b""
    return records


@pytest.mark.slow  # a whole tiny-model run (about 8 s): the whole suite runs it, the fast one stays fast
@pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in ("tensorboard", "wandb", "trackio")),
                    reason="pip install -r requirements-test.txt (tensorboard, wandb, trackio)")
def test_every_tracker_gets_the_metrics_and_the_completions(tmp_path, tiny_model):
    out, store = tmp_path / "run", tmp_path / "trackio"
    env = {**os.environ, "WANDB_MODE": "offline", "TRACKIO_DIR": str(store), "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
    proc = subprocess.run([sys.executable, str(REPO / "train_agrpo.py"), "--model_name_or_path", tiny_model, *TINY,
                           "--output_dir", str(out), "--report_to", "tensorboard", "wandb", "trackio", "--project",
                           "tiny-project", "--run_name", "tiny-run", "--hub_token", TOKEN], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert yaml.safe_load((out / "config.yaml").read_text())["report_to"] == ["tensorboard", "wandb", "trackio"]
    completions = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert [c["step"] for c in completions] == [1, 1, 2, 2]  # num_completions_to_print 2 a step

    # TensorBoard: scalars under output_dir/<project>, the completions as a text summary
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next((out / "tiny-project").glob("events.out.tfevents.*")).parent),
                              size_guidance={"tensors": 0})
    events.Reload()
    assert {"reward", "kl", "eval/accuracy"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("reward")] == [1, 2]
    text = events.Tensors("completions/text_summary")
    assert [e.step for e in text] == [1, 2]
    assert text[0].tensor_proto.string_val[0].decode().startswith("| step | prompt | completion | answer |")

    # wandb: the offline run folder under the run directory, the run's name, the metrics, a Table of completions
    run_folder = Path(glob.glob(str(out / "wandb" / "offline-run-*"))[0])
    records = wandb_records(run_folder)
    kinds = [r.WhichOneof("record_type") for r in records]
    assert records[kinds.index("run")].run.display_name == "tiny-run"
    assert records[kinds.index("run")].run.project == "tiny-project"
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.HasField("history")]
    rewards = {h["_step"]: h["reward"] for h in history if "reward" in h}
    assert rewards == {m["step"]: pytest.approx(m["reward"]) for m in map(json.loads, (out / "metrics.jsonl")
                                                                          .read_text().splitlines()) if "reward" in m}
    assert any("eval/accuracy" in h for h in history)
    assert [(h["_step"], h["completions/_type"], h["completions/nrows"]) for h in history
            if "completions/_type" in h] == [(1, "table-file", 2), (2, "table-file", 2)]
    table = json.loads(next((run_folder / "files" / "media" / "table").glob("completions_2_*.table.json"))
                       .read_text())
    assert table["columns"] == list(hub.COMPLETION_COLUMNS) and len(table["data"]) == 2
    assert table["data"][0][2] == completions[2]["completion"]

    # trackio: its local store (TRACKIO_DIR) holds the metrics and a table of completions, per step
    rows = sqlite3.connect(store / "tiny-project.db").execute("SELECT run_name, step, metrics FROM metrics").fetchall()
    logged = [(name, step, json.loads(metrics)) for name, step, metrics in rows]
    assert {name for name, _, _ in logged} == {"tiny-run"}
    assert sorted(step for _, step, m in logged if "reward" in m) == [1, 2]
    tables = [m["completions"] for _, _, m in logged if "completions" in m]
    assert [t["_type"] for t in tables] == ["trackio.table"] * 2
    assert tables[1]["_value"][0]["completion"] == completions[2]["completion"]

    # the token is in none of them (wandb records the command line; the trainer hides the token there)
    for path in [*out.rglob("*"), *store.rglob("*")]:
        if path.is_file():
            assert TOKEN.encode() not in path.read_bytes(), path
