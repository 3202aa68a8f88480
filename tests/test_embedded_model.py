"""lib/models/embedded.py: the embedded model's one-time conversion, with processes that start together."""

import threading
import time
from pathlib import Path

from filelock import FileLock

from lib.models.embedded import conversion_lock, embedded_model_path


def test_a_process_that_finds_a_conversion_under_way_waits_and_loads_its_folder(tmp_path, monkeypatch, embedded_model):
    """Two processes on an empty cache (accelerate launch's two, the test workers): the second waits on the lock
    while the first converts, then returns the first one's folder as it is, neither converting again nor replacing
    the folder that the first one may be reading."""
    monkeypatch.setenv("AGRPO_CACHE", str(tmp_path))
    target = tmp_path / "SmolLM2-135M-Instruct"
    found = {}
    with FileLock(conversion_lock(target)):  # the first process, converting
        second = threading.Thread(target=lambda: found.update(path=embedded_model_path()))
        second.start()
        time.sleep(1)
        assert second.is_alive() and not target.exists()  # waiting, not converting beside it
        target.mkdir()  # the first one's whole folder: links to the converted files (their copy, without 0.5 GB)
        for file in Path(embedded_model).iterdir():
            (target / file.name).symlink_to(file)
    second.join(timeout=60)
    assert not second.is_alive() and found["path"] == target
    assert all(file.is_symlink() for file in target.iterdir())  # the first one's folder, untouched
