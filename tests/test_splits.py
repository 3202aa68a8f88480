"""scripts/make_splits.py: the real word-problem splits the CPU recipe and the ablations train and evaluate on."""

import json
import sys

import pytest

from conftest import NO_FULL_DATA, REPO

sys.path.insert(0, str(REPO / "scripts"))
import make_splits  # noqa: E402  (a script, imported from its folder)

from lib.data.records import load_records  # noqa: E402


def problems(path) -> list[str]:
    return [" ".join(r["problem"].split()) for r in load_records(str(path))]


# (where, the sizes written): 926 distinct MAWPS problems and 1,000 SVAMP ones in the full sets; 384 and 300 in the
# slices (tests/data/README.md)
@pytest.mark.parametrize("where, expected", [("data_dir", {"mawps": (184, 200), "svamp": (100, 200)}),
                                             pytest.param("full_data_dir", {"mawps": (726, 200), "svamp": (800, 200)},
                                                          marks=pytest.mark.ci_may_skip(NO_FULL_DATA))])
def test_splits_are_disjoint_seeded_and_read_by_the_trainer(tmp_path, request, where, expected):
    data_dir = request.getfixturevalue(where)
    sizes = make_splits.main(["--data_dir", str(data_dir), "--out", str(tmp_path / "a")])
    assert sizes == expected
    for name in sizes:
        train, held = problems(tmp_path / "a" / name / "train.jsonl"), problems(tmp_path / "a" / name / "heldout.jsonl")
        assert not set(train) & set(held) and len(set(train)) == len(train)
    make_splits.main(["--data_dir", str(data_dir), "--out", str(tmp_path / "b")])
    for part in ("mawps/train.jsonl", "svamp/heldout.jsonl"):  # the same seed writes the same bytes
        assert (tmp_path / "a" / part).read_bytes() == (tmp_path / "b" / part).read_bytes()
    make_splits.main(["--data_dir", str(data_dir), "--out", str(tmp_path / "c"), "--seed", "1"])
    other_seed = (tmp_path / "c" / "mawps" / "heldout.jsonl").read_bytes()
    assert other_seed != (tmp_path / "a" / "mawps" / "heldout.jsonl").read_bytes()
    first = json.loads((tmp_path / "a" / "svamp" / "train.jsonl").read_text().splitlines()[0])
    assert {"Body", "Question", "Answer"} <= set(first)  # rows as in the source file, so the format is recognised
