"""Atomic checkpoints: a folder is a checkpoint only once committed; a save killed midway leaves the previous one."""

import json
import random

import torch

from lib import checkpoint as ckpt


def _save(out, step, payload):
    staging = ckpt.staging_dir(out, step)
    staging.mkdir(parents=True)
    (staging / "model.bin").write_text(payload)
    ckpt.write_rng(staging, 0, ckpt.rng_state({"extra": 1}))
    return ckpt.commit_checkpoint(out, step, {"global_step": step}, save_total_limit=None)


def test_commit_renames_into_place_and_latest_ignores_partial_saves(tmp_path):
    first = _save(tmp_path, 2, "two")
    assert first.name == "checkpoint-2" and ckpt.read_trainer_state(first) == {"global_step": 2}
    # a save of step 4 killed before its commit: staging folder, and a folder without trainer_state.json
    ckpt.staging_dir(tmp_path, 4).mkdir()
    (tmp_path / "checkpoint-6").mkdir()
    (tmp_path / "checkpoint-6" / "model.bin").write_text("half written")
    assert ckpt.latest_checkpoint(tmp_path) == first
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["checkpoint-2"]


def test_resaving_a_step_swaps_atomically_and_rotation_keeps_the_newest(tmp_path):
    _save(tmp_path, 2, "old")
    again = _save(tmp_path, 2, "new")
    assert (again / "model.bin").read_text() == "new"
    for step in (4, 6):
        _save(tmp_path, step, str(step))
    staging = ckpt.staging_dir(tmp_path, 8)
    staging.mkdir()
    ckpt.commit_checkpoint(tmp_path, 8, {"global_step": 8}, save_total_limit=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["checkpoint-6", "checkpoint-8"]
    assert not list(tmp_path.glob(".checkpoint-*"))


def test_rng_state_round_trip(tmp_path):
    state = ckpt.rng_state()
    expected = (random.random(), torch.rand(3))
    ckpt.set_rng_state(state)
    assert random.random() == expected[0] and torch.equal(torch.rand(3), expected[1])
    _save(tmp_path, 1, "x")
    loaded = ckpt.read_rng(tmp_path / "checkpoint-1", 0)
    assert loaded["extra"] == 1 and ckpt.read_rng(tmp_path / "checkpoint-1", 3) is None
    assert json.loads((tmp_path / "checkpoint-1" / "trainer_state.json").read_text())["global_step"] == 1
