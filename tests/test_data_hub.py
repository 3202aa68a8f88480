"""Data as TRL takes it (docs/troubleshooting.md 3.1), offline: folders laid out as the hub lays a data set out
(parquet shards under data/, a README's configurations as openai/gsm8k has them), folders save_to_disk wrote, a hub
id that cannot be reached, the held-out split the trainer picks, and a run on conversational data with no gold
answer. The fixtures are built from the real GSM8K rows in tests/data with `datasets` itself."""

import json
import socket
import time

import pytest

datasets = pytest.importorskip("datasets")

from lib.config import ConfigError, parse_config  # noqa: E402
from lib.data.records import load_records as read_records, split_names as read_splits  # noqa: E402
from lib.data import hub_data  # noqa: E402


def load_records(*args, **kwargs):
    return read_records(*args, reader=hub_data, **kwargs)


def split_names(*args):
    return read_splits(*args, reader=hub_data)


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path_factory):
    """No test here asks the network: the hub's offline mode (as HF_HUB_OFFLINE=1 sets it; the libraries read the
    variable at import, so the flag is set on them), and datasets' cache (the Arrow files load_dataset prepares from
    a folder) under the tests' temporary folder instead of the user's."""
    from huggingface_hub import constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.getbasetemp() / "hf_datasets"))


@pytest.fixture(scope="module")
def gsm8k_rows(data_dir) -> list[dict]:
    lines = (data_dir / "gsm8k" / "test.jsonl").read_text().splitlines()[:40]
    return [json.loads(line) for line in lines]


def gold(row: dict) -> str:
    return row["answer"].rsplit("####", 1)[1].strip().replace(",", "")


def write_shards(folder, rows: list[dict], split: str, shards: int) -> None:
    """`rows` as the hub stores a split: {split}-0000i-of-0000n.parquet, written by datasets."""
    folder.mkdir(parents=True, exist_ok=True)
    dataset = datasets.Dataset.from_list(rows)
    for i in range(shards):
        dataset.shard(shards, i, contiguous=True).to_parquet(folder / f"{split}-{i:05d}-of-{shards:05d}.parquet")


@pytest.fixture(scope="module")
def gsm8k_hub(tmp_path_factory, gsm8k_rows):
    """openai/gsm8k's layout: configurations `main` and `socratic` in subfolders, declared in the README."""
    root = tmp_path_factory.mktemp("gsm8k_hub")
    write_shards(root / "main", gsm8k_rows[:20], "train", 2)
    write_shards(root / "main", gsm8k_rows[20:30], "test", 1)
    write_shards(root / "socratic", gsm8k_rows[30:36], "train", 1)
    write_shards(root / "socratic", gsm8k_rows[36:40], "test", 1)
    card = ["---", "configs:"]
    for config in ("main", "socratic"):
        card += [f"- config_name: {config}", "  data_files:"]
        card += [f"  - split: {split}\n    path: {config}/{split}-*" for split in ("train", "test")]
    (root / "README.md").write_text("\n".join(card + ["---", ""]))
    return root


def test_a_folder_laid_out_as_the_hub_reads_each_configuration_and_split(gsm8k_hub, gsm8k_rows):
    main = load_records(str(gsm8k_hub), split="train", config="main")
    assert [r["question"] for r in main] == [r["question"] for r in gsm8k_rows[:20]]  # both shards, in order
    assert [r["answer"] for r in main] == [gold(r) for r in gsm8k_rows[:20]]
    assert main[0]["problem"] == gsm8k_rows[0]["question"]  # GSM8K's format, recognised as in a file
    socratic = load_records(str(gsm8k_hub), split="test", config="socratic")
    assert [r["answer"] for r in socratic] == [gold(r) for r in gsm8k_rows[36:40]]
    assert split_names(str(gsm8k_hub), "main") == ["test", "train"]
    with pytest.raises(ValueError, match=r"dataset_config='other': .* declares no such configuration \(it declares "
                                         r"\['main', 'socratic'\]\) and has no subfolder 'other'"):
        load_records(str(gsm8k_hub), config="other")
    with pytest.raises(FileNotFoundError, match=r"datasets finds no 'validation' split in it \(its splits: "
                                                r"\['train', 'test'\]"):
        load_records(str(gsm8k_hub), split="validation", config="main")


def test_data_shards_and_config_subfolders_without_a_readme(tmp_path, gsm8k_rows):
    flat = tmp_path / "flat"
    write_shards(flat / "data", gsm8k_rows[:12], "train", 2)
    write_shards(flat / "data", gsm8k_rows[12:16], "test", 1)
    assert split_names(str(flat)) == ["test", "train"]
    assert [r["answer"] for r in load_records(str(flat), split="test")] == [gold(r) for r in gsm8k_rows[12:16]]
    # a configuration as a subfolder, with no README to declare it, is read as a data set of its own
    nested = tmp_path / "nested"
    write_shards(nested / "main", gsm8k_rows[:5], "train", 1)
    write_shards(nested / "socratic", gsm8k_rows[5:8], "train", 1)
    assert [r["answer"] for r in load_records(str(nested), config="socratic")] == [gold(r) for r in gsm8k_rows[5:8]]


def test_save_to_disk_folders(tmp_path, gsm8k_rows):
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(gsm8k_rows[:8]),
                                   "test": datasets.Dataset.from_list(gsm8k_rows[8:11])})
    splits.save_to_disk(tmp_path / "dict")
    assert split_names(str(tmp_path / "dict")) == ["test", "train"]
    assert [r["answer"] for r in load_records(str(tmp_path / "dict"), split="test")] == [
        gold(r) for r in gsm8k_rows[8:11]]
    with pytest.raises(FileNotFoundError, match=r"the saved DatasetDict has no split 'dev'; its splits: "):
        load_records(str(tmp_path / "dict"), split="dev")
    splits["train"].save_to_disk(tmp_path / "one")  # one Dataset: no splits, so a run holds out rows of it
    assert split_names(str(tmp_path / "one")) is None
    assert len(load_records(str(tmp_path / "one"), split="anything")) == 8


def test_a_hub_id_that_cannot_be_reached_fails_at_once_with_the_fix(monkeypatch):
    from huggingface_hub import constants

    # offline mode (HF_HUB_OFFLINE=1): the datasets cache only, which holds no copy
    start = time.time()
    with pytest.raises(ValueError, match=r"dataset_name='openai/gsm8k': offline mode is on \(HF_HUB_OFFLINE or "
                                         r"HF_DATASETS_OFFLINE\), and the datasets cache holds no copy of it\. Pass a "
                                         r"local file or folder"):
        load_records("openai/gsm8k", split="test")
    # online, with a hub that refuses connections: the probe gives up, and the load reads the cache only instead of
    # retrying for about 25 s
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(ValueError, match=r"dataset_name='openai/gsm8k': the hub was not reachable within 10 s "
                                         r"\(ConnectError.*\), and the datasets cache holds no copy of it"):
        split_names("openai/gsm8k")
    assert time.time() - start < 5
    assert not datasets.config.HF_HUB_OFFLINE and not constants.HF_HUB_OFFLINE  # the call's offline mode is undone


# --- the trainer's data ----------------------------------------------------------------------------------------


def test_the_trainer_evaluates_on_the_test_split_and_holds_out_rows_of_a_single_file(gsm8k_hub, data_dir, tmp_path,
                                                                                     gsm8k_rows):
    from lib.setup import load_data

    said = []
    train, held_out = load_data(parse_config(["--dataset_name", str(gsm8k_hub), "--dataset_config", "main"]),
                                say=said.append)
    assert len(train) == 20 and [r["answer"] for r in held_out] == [gold(r) for r in gsm8k_rows[20:30]]
    path = tmp_path / "one.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in gsm8k_rows))
    train, held_out = load_data(parse_config(["--dataset_name", str(path)]), say=said.append)
    assert (len(train), len(held_out)) == (36, 4) and not {r["question"] for r in train} & {
        r["question"] for r in held_out}
    assert said == []


def conversations(rows: list[dict]) -> list[dict]:
    """GSM8K's questions as TRL's conversational prompts, with a column of their own and no answer."""
    system = {"role": "system", "content": "Answer with one number."}
    return [{"prompt": [system, {"role": "user", "content": r["question"]}], "level": i} for i, r in enumerate(rows)]


# A custom reward that needs no gold answer, and writes down what it was given (the run's reward worker calls it).
REWARD = '''
import json, os

def brevity(prompts, completions, level, **columns):
    with open(os.environ["AGRPO_TEST_SEEN"], "a") as seen:
        seen.write(json.dumps({"prompt": prompts[0], "level": level[0], "columns": sorted(columns)}) + "\\n")
    return [-len(str(c)) / 100 for c in completions]
'''


def test_a_conversational_set_with_no_answer_trains_with_a_reward_that_needs_none(tmp_path, tiny_model, monkeypatch,
                                                                                   capsys, gsm8k_rows):
    import torch
    from accelerate.state import AcceleratorState

    import train_agrpo

    chats = conversations(gsm8k_rows[:16])
    datasets.Dataset.from_list(chats).save_to_disk(tmp_path / "chat")
    (tmp_path / "rewards.py").write_text(REWARD)
    monkeypatch.setenv("AGRPO_TEST_SEEN", str(tmp_path / "seen.jsonl"))
    args = ["--model_name_or_path", str(tiny_model), "--dataset_name", str(tmp_path / "chat"), "--max_steps", "2",
            "--per_device_train_batch_size", "8", "--num_generations", "4", "--max_completion_length", "8",
            "--learning_rate", "1e-3", "--bf16", "false", "--num_eval_samples", "4"]
    # the built-in accuracy needs the gold answer: refused before any model loads, naming the column and the fix
    start = time.time()
    try:
        with pytest.raises(ConfigError, match=r"reward_funcs: accuracy needs the gold answer, and dataset_name '.*chat' "
                                              r"has no answer column .*--answer_column NAME"):
            train_agrpo.main(args + ["--output_dir", str(tmp_path / "refused"), "--reward_funcs", "accuracy"])
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert time.time() - start < 10 and not (tmp_path / "refused").exists()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model's matrices are too small to share (tests/test_loop.py)
    try:
        train_agrpo.main(args + ["--output_dir", str(tmp_path / "run"), "--reward_funcs",
                                 f"{tmp_path / 'rewards.py'}:brevity"])
    finally:
        torch.set_num_threads(threads)
        AcceleratorState._reset_state(reset_partial_state=True)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "reward" in m] == [1, 2] and not any("eval/accuracy" in m for m in lines)
    assert "evaluation skipped: " in capsys.readouterr().out
    seen = [json.loads(line) for line in (tmp_path / "seen.jsonl").read_text().splitlines()]
    # every call got the conversation as TRL passes it, and the data set's own column
    assert seen and all(s["prompt"] in [c["prompt"] for c in chats] for s in seen)
    assert all(s["level"] in range(16) for s in seen)


def test_the_evaluator_reads_a_configuration_and_refuses_a_set_with_no_gold(gsm8k_hub, gsm8k_rows, tmp_path):
    import eval_agrpo

    args = eval_agrpo.parse_args(["--dataset_name", str(gsm8k_hub), "--dataset_config", "socratic",
                                  "--dataset_test_split", "train"])
    (records,) = eval_agrpo.load_sets(args).values()
    assert [r["answer"] for r in records] == [gold(r) for r in gsm8k_rows[30:36]]
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps(r) + "\n" for r in conversations(gsm8k_rows[:2])))
    with pytest.raises(eval_agrpo.EvalConfigError, match=r"--dataset_name: '.*chat\.jsonl' has no gold answer column "
                                                         r"\(looked for answer, solution, Answer, target; columns "
                                                         r"found: \['level', 'prompt'\]\); name it with --answer_column"):
        eval_agrpo.main(["--dataset_name", str(chat), "--output_dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
