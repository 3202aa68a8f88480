"""docs/configuration.md is generated from the configuration dataclass (scripts/config_doc.py): it must match what
the script writes now, so a changed key, default or help string cannot leave the page behind."""

from conftest import REPO
from lib.config import FIELDS, PRESETS, build_parser
from scripts.config_doc import COMMAND, groups, render


def test_configuration_page_is_up_to_date():
    page = REPO / "docs" / "configuration.md"
    assert page.is_file(), f"docs/configuration.md is missing: run `{COMMAND}`"
    assert page.read_text() == render(), f"docs/configuration.md is out of date: run `{COMMAND}`"


def test_every_key_and_preset_is_on_the_page():
    text = render()
    assert [name for *_, names in groups() for name in names] == list(FIELDS)  # each once, in the dataclass's order
    for name in FIELDS:
        assert f"| `{name}` |" in text
    for algo in PRESETS:
        assert f"`{algo}`" in text


def test_help_strings_format_in_argparse():
    # argparse %-formats every help string: a bare % in a help text breaks `python train_agrpo.py --help`
    help_text = build_parser().format_help()
    assert "--learning_rate" in help_text and "--dsf_step_kl_ema_alpha" in help_text
