import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The real data sets (../shared/data next to the repository), or $AGRPO_DATA_DIR."""
    default = Path(__file__).resolve().parents[2] / "shared" / "data"
    path = Path(os.environ.get("AGRPO_DATA_DIR", default))
    if not path.is_dir():
        pytest.fail(f"data directory {path} not found; set AGRPO_DATA_DIR to the folder holding gsm8k/, math/, ...")
    return path
