"""Write docs/configuration.md from the configuration dataclass and the method registry, so that the page cannot
drift from the code.

    python scripts/config_doc.py                 # print the page
    python scripts/config_doc.py --write         # write it to docs/configuration.md
    python scripts/config_doc.py --check         # exit 1 if docs/configuration.md is out of date

Every field of `lib.settings.Config` becomes a row (key, type, default, its help string and the values it accepts),
one section per section dataclass of lib/settings.py (its --help title and docstring), in their order; then one
table of the keys each `--algo` preset sets (`lib.methods.registry.METHODS`). tests/test_config_doc.py fails when the page differs from this output.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import typing
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from lib import trl_keys  # noqa: E402
from lib import trl_differences  # noqa: E402
from lib.config import FIELDS, PRESETS, SECTIONS  # noqa: E402
from lib.methods.registry import METHODS  # noqa: E402
from lib.config import _type_hints as type_hints  # noqa: E402  (the repository root is put on the path just above)
from lib.methods.controllers import ADAGRPO_SCHEDULE  # noqa: E402

PAGE = REPO / "docs" / "configuration.md"
COMMAND = "python scripts/config_doc.py --write"
DOC_MENTION = re.compile(r"docs/(\w+)\.md")

HEADER = f"""# Configuration: every key

[README](../README.md) · [methods](methods.md) · [results](results.md) · [performance](performance.md) ·
**configuration** · [troubleshooting](troubleshooting.md)

<!-- Generated from lib/settings.py and lib/methods/registry.py by `{COMMAND}`; edit the help strings there, not this page. -->

Every key of the trainer's one configuration surface (`lib/settings.py` `Config`; names follow TRL's `GRPOConfig`).
Set a key in a YAML recipe (`--config recipe.yaml`) or as a flag (`--learning_rate 1e-5`; a list takes several
values, `--reward_funcs accuracy format`; a boolean takes `true` / `false`). Precedence: the defaults below < the
`--algo` preset ([section 9](#9-presets)) < the YAML file < the command line. An unknown key is an error that names
the closest field; an invalid value is an error that names the field and the fix
([troubleshooting](troubleshooting.md#2-configuration-errors)). The resolved values are saved as `config.yaml` in the
run directory. `python train_agrpo.py --help` prints the same help strings. `eval_agrpo.py` takes the keys it
shares with the trainer from here too (their help, reading and checks; its own defaults, with their reasons, in
`python eval_agrpo.py --help`).
"""


def groups() -> list[tuple[str, str, list[str]]]:
    """(section title, its introduction, field names) per section dataclass of lib/settings.py, in their order: the
    title HfArgumentParser gives its --help section (`_argument_group_name`), the class's docstring, its fields."""
    result = [(section._argument_group_name, " ".join(section.__doc__.split()),
               [f.name for f in dataclasses.fields(section)]) for section in SECTIONS]
    listed = [n for *_, names in result for n in names]
    if sorted(listed) != sorted(FIELDS):
        raise ValueError(f"fields not placed in exactly one section: {sorted(set(FIELDS) ^ set(listed)) or listed}")
    return result


def value_text(value) -> str:
    """A value as it is written in a YAML recipe."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is ADAGRPO_SCHEDULE:
        return "ADAGRPO_SCHEDULE"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(value_text(v) for v in value) + "]"
    return str(value)


def cell(text: str) -> str:
    """Text safe inside a markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def linked(text: str) -> str:
    """Help text with its `docs/<page>.md` mentions as links (this page sits in docs/)."""
    return DOC_MENTION.sub(r"[docs/\1.md](\1.md)", text)


def title_case(text: str) -> str:
    return text[0].upper() + text[1:]


def type_text(annotation) -> str:
    """A field's type as written in lib/settings.py ("int | None"), from its resolved annotation."""
    return annotation.__name__ if isinstance(annotation, type) and not typing.get_args(annotation) else str(annotation)


def default_of(f: dataclasses.Field):
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def accepted(f: dataclasses.Field) -> str:
    """The range a field's metadata gives it, as the check reads it (lib/config.check_fields)."""
    return f" Range: `{f.metadata['range']}`." if "range" in f.metadata else ""


def render() -> str:
    parts = [HEADER]
    sections = groups()
    parts.append("| section | keys |\n|---|---|")
    for i, (name, _, names) in enumerate(sections, start=1):
        heading = title_case(name)
        anchor = f"{i}-" + re.sub(r"[^a-z0-9 _-]", "", heading.lower()).replace(" ", "-")
        parts[-1] += f"\n| [{i}. {cell(heading)}](#{anchor}) | {len(names)} |"
    parts[-1] += f"\n| [{len(sections) + 1}. Presets](#{len(sections) + 1}-presets) | the keys each `--algo` sets |"
    parts[-1] += (f"\n| [{len(sections) + 2}. Recipes written for TRL or open-r1](#{len(sections) + 2}-recipes-written-"
                  f"for-trl-or-open-r1) | TRL's other keys: renamed, ignored or refused |\n")
    for i, (name, intro, names) in enumerate(sections, start=1):
        rows = ["| key | type | default | what it does |", "|---|---|---|---|"]
        for key in names:
            f = FIELDS[key]
            rows.append(f"| `{key}` | `{cell(type_text(type_hints()[key]))}` | `{cell(value_text(default_of(f)))}` | "
                        f"{cell(linked(f.metadata.get('help', '') + accepted(f)))} |")
        parts.append(f"## {i}. {title_case(name)}\n\n{linked(intro)}\n\n" + "\n".join(rows) + "\n")
    parts.append(presets_section(len(sections) + 1))
    parts.append(trl_section(len(sections) + 2))
    return "\n".join(parts)


def trl_section(number: int) -> str:
    """lib/trl_keys.py's tables (what a recipe written for TRL or open-r1 gets for each key that is not a
    field) and lib/trl_differences.py's (the fields whose values, combinations or defaults differ from TRL's)."""
    renamed = ["| key | read as | note |", "|---|---|---|"] + [
        f"| `{k}` | `{target}` | {cell(note or 'the same setting')} |"
        for k, (target, note) in trl_keys.RENAMED.items()]
    renamed.append("| `dataset_configs` | `dataset_config` | open-r1's list form; one configuration |")
    ignored: dict[str, list[str]] = {}
    for key, why in trl_keys.IGNORED.items():
        ignored.setdefault(why, []).append(f"`{key}`")
    ignored_rows = ["| keys | why ignoring them cannot change what is trained |", "|---|---|"] + [
        f"| {', '.join(keys)} | {cell(why)} |" for why, keys in ignored.items()]
    refused = ["| key | accepted at (TRL's default) | otherwise refused because |", "|---|---|---|"] + [
        f"| `{k}` | `{cell(value_text(default))}` | {cell(why)} |"
        for k, (default, why) in trl_keys.UNSUPPORTED.items()]
    refused_values = ["| value | refused because |", "|---|---|"] + [
        f"| {cell(what)} | {cell(linked(why))} |" for what, why in trl_differences.REFUSED_VALUES]
    limited = ["| key | refused in, or read otherwise in |", "|---|---|"] + [
        f"| `{k}` | {cell(why)} |" for k, why in trl_differences.LIMITED.items()]
    differ = ["| key | TRL's default | ours, and why |", "|---|---|---|"] + [
        f"| `{k}` | `{cell(value_text(trl))}` | `{cell(value_text(default_of(FIELDS[k])))}`: {cell(linked(why))} |"
        for k, (trl, why) in trl_differences.DIFFERENT_DEFAULTS.items()]
    return (f"## {number}. Recipes written for TRL or open-r1\n\n"
            "A YAML recipe or command line written for TRL's `GRPOConfig` + `ModelConfig` + `ScriptArguments` (what\n"
            "`trl/scripts/grpo.py` and open-r1 parse) runs here as it is: every key above has TRL's meaning where TRL\n"
            "has the key, and each other key of theirs is handled as the tables below say (`lib/trl_keys.py`,\n"
            "`lib/trl_differences.py`; `tests/test_trl_keys.py` checks them against TRL's own dataclasses).\n"
            "`--flag` alone means true.\n\n"
            "Renamed: the value goes to our key (a note is printed for our own old names).\n\n"
            + "\n".join(renamed) + "\n\nIgnored, with one warning line each:\n\n" + "\n".join(ignored_rows)
            + "\n\nNot implemented: accepted at TRL's default (the recipe then asks for what this trainer does), "
            "refused with this reason otherwise:\n\n" + "\n".join(refused)
            + "\n\nValues refused, of keys that are read:\n\n" + "\n".join(refused_values)
            + "\n\nImplemented with TRL's meaning, but refused in some combinations (with the reason) or read "
            "otherwise in one point:\n\n" + "\n".join(limited)
            + "\n\nSame meaning, another default: a TRL recipe that leaves these out trains with ours; write the key "
            "to get TRL's.\n\n" + "\n".join(differ) + "\n")


def presets_section(number: int) -> str:
    algos = list(PRESETS)
    keys = [k for k in FIELDS if any(k in PRESETS[a] for a in algos)]
    rows = ["| key | default | " + " | ".join(f"`{a}`" for a in algos) + " |",
            "|---|---|" + "---|" * len(algos)]
    for key in keys:
        values = [f"`{cell(value_text(PRESETS[a][key]))}`" if key in PRESETS[a] else "" for a in algos]
        rows.append(f"| `{key}` | `{cell(value_text(default_of(FIELDS[key])))}` | " + " | ".join(values) + " |")
    return (f"## {number}. Presets\n\n"
            "The keys each `--algo` preset sets (`lib/methods/registry.py` `METHODS`); an empty cell keeps the default, and\n"
            "any key you set yourself wins. `ADAGRPO_SCHEDULE` is the upstream retry schedule\n"
            "([methods 4.2](methods.md#42-the-schedule-and-the-published-settings)). Why each preset has its values:\n"
            "[methods section 9](methods.md#9-presets-the-choices-this-package-makes).\n\n"
            + "".join(f"- `{name}`: {cell(method.summary)}\n" for name, method in METHODS.items()) + "\n"
            + "\n".join(rows) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"write {PAGE.relative_to(REPO)}")
    mode.add_argument("--check", action="store_true", help="exit 1 if the page is out of date")
    args = parser.parse_args(argv)
    page = render()
    if args.write:
        PAGE.write_text(page)
    elif args.check:
        if not PAGE.is_file() or PAGE.read_text() != page:
            print(f"{PAGE.relative_to(REPO)} is out of date: run `{COMMAND}`", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
