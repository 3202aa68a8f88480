"""The pages (README.md, docs/*.md, docs/log/*.md, tests/data/README.md) against the code: every flag of a command
they show exists in that script's parser, every file, folder, function and section they name exists, and `.ci/run`
runs the README's test command. A renamed flag or a moved file fails here instead of on a reader's machine."""

import contextlib
import glob
import io
import re
from pathlib import Path

import pytest

from conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "docs" / "log").glob("*.md")),
         REPO / "tests" / "data" / "README.md", REPO / "tests" / "fixtures" / "README.md"]
ENTRY_SCRIPTS = ("train_agrpo.py", "eval_agrpo.py", "chat_app.py", "serve_vllm.py")
# scripts whose words after a lone `--` go to every train_agrpo.py run they start
PASS_THROUGH = ("ablate.py", "compare_presets.py")


def code_lines(text: str) -> list[str]:
    """The lines of the fenced code blocks (a trailing backslash joins a line to the next) and the inline code spans
    of a Markdown page, with shell comments cut off."""
    lines = []
    for block in re.findall(r"```[^\n]*\n(.*?)```", text, re.S):
        lines += re.sub(r"\\\n\s*", " ", block).splitlines()
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    lines += [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]
    return [re.split(r"(?:^|\s)#", line)[0] for line in lines]


def commands(text: str) -> list[tuple[str, list[str]]]:
    """(script, the flags given to it) for every command of a page that runs one of ENTRY_SCRIPTS, or passes
    trainer flags through one of PASS_THROUGH."""
    found = []
    for line in code_lines(text):
        for part in re.split(r"&&|\|\||;|\s&\s|\s\|\s", line):
            words = part.split()
            at = next((i for i, w in enumerate(words) if Path(w).name in ENTRY_SCRIPTS + PASS_THROUGH), None)
            if at is None:
                continue
            name, rest = Path(words[at]).name, words[at + 1:]
            if name in PASS_THROUGH:
                if "--" not in rest:
                    continue
                name, rest = "train_agrpo.py", rest[rest.index("--") + 1:]
            found.append((name, [w.split("=")[0] for w in rest if w.startswith("--") and len(w) > 2]))
    return found


def help_flags(module_name: str) -> set[str]:
    """The flags a script's `parse_args(["--help"])` lists."""
    import importlib

    module = importlib.import_module(module_name)
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown), pytest.raises(SystemExit):
        module.parse_args(["--help"])
    return set(re.findall(r"(--[\w-]+)", shown.getvalue()))


@pytest.fixture(scope="module")
def known_flags() -> dict[str, set[str]]:
    from lib.config import build_parser

    known = {name: help_flags(name.removesuffix(".py")) for name in ENTRY_SCRIPTS if name != "train_agrpo.py"}
    known["train_agrpo.py"] = {flag for action in build_parser()._actions for flag in action.option_strings}
    return known


def test_the_command_finder_reads_the_forms_the_pages_use():
    page = ("```bash\npython train_agrpo.py --algo agrpo \\\n    --eta 0   # a comment --not_a_flag\n"
            "accelerate launch --num_processes 2 train_agrpo.py --max_steps=2 && python eval_agrpo.py --plot\n```\n"
            "Prose with `python scripts/ablate.py --seeds 1 -- --config r.yaml` and `train_agrpo.py`.")
    assert commands(page) == [("train_agrpo.py", ["--algo", "--eta"]), ("train_agrpo.py", ["--max_steps"]),
                              ("eval_agrpo.py", ["--plot"]), ("train_agrpo.py", ["--config"]),
                              ("train_agrpo.py", [])]


def test_every_flag_in_the_pages_commands_is_one_its_script_takes(known_flags):
    unknown, seen = [], 0
    for page in PAGES:
        for script, flags in commands(page.read_text()):
            seen += len(flags)
            unknown += [f"{page.relative_to(REPO)}: {script} {flag}" for flag in flags
                        if flag not in known_flags[script]]
    assert seen > 200, seen  # the finder found the pages' commands
    assert not unknown, "flags the scripts do not take:\n" + "\n".join(unknown)


# a repository path in the text: a file or folder under one of the repository's folders, a wildcard allowed; a
# `lib/module.name` names a function, class or constant of that module (lib/data/records.py::name too; `name...` is the start
# of a long name)
REPO_PATH = re.compile(r"(?<![\w./-])((?:scripts|docs|lib|tests|\.ci)/[\w./*-]*[\w/*])(?:::(\w+(?:\.\.\.)?))?")


def slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(heading) for heading in re.findall(r"^#+\s+(.*)$", text, re.M)}


def defines(module: Path, name: str) -> bool:
    """Whether a module defines `name` at its top level (`name...`: a name that starts so)."""
    name, end = (name[:-3], "") if name.endswith("...") else (name, r"\b")
    return re.search(rf"^(?:def|class|async def) {name}{end}|^{name}{end}\s*[:=]", module.read_text(),
                     re.M) is not None


def missing_references(page: Path) -> list[str]:
    missing = []
    text = page.read_text()
    for link in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", link):
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            missing.append(f"link {link}")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            missing.append(f"section {link}")
    for line in text.splitlines():
        if "github.com" in line:  # a table of other repositories' files
            continue
        for match in REPO_PATH.finditer(line):
            path, name = match.group(1), match.group(2)
            if "*" in path:
                if not glob.glob(str(REPO / path)):
                    missing.append(f"no file matches {path}")
                continue
            module = re.fullmatch(r"(lib/(?:\w+/)?\w+)\.(\w+)(?:\.\w+)*", path)
            if module and not (REPO / path).exists():  # lib/sampling/vllm_rollout.VLLMRollout
                path, name = module.group(1) + ".py", module.group(2)
            if not (REPO / path).exists():
                missing.append(f"path {path}")
            elif name and not defines(REPO / path, name):
                missing.append(f"{path} defines no {name}")
    return missing


def test_the_reference_finder_catches_a_stale_path_a_stale_name_and_a_stale_section(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Top\n`lib/sampling/vllm_rollout.VLLMRollout`, `lib/data/word_problems.py::builtin_task`, "
                    "scripts/recipes/*.yaml, [ok](#top), `lib/data/word_problems.py::builtin_t...`\n"
                    "`lib/sampling/rollout.NoSuchThing`, lib/nowhere.py, [gone](#nowhere), docs/*.nothing\n")
    assert missing_references(page) == ["section #nowhere", "lib/sampling/rollout.py defines no NoSuchThing",
                                        "path lib/nowhere.py", "no file matches docs/*.nothing"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_file_function_and_section_a_page_names_exists(page):
    assert not missing_references(page), "\n".join(missing_references(page))


def test_ci_runs_the_readmes_test_command():
    readme = (REPO / "README.md").read_text()
    tests = [line for line in code_lines(readme) if line.startswith("python3 -m venv") and "pytest" in line]
    assert len(tests) == 1, tests  # one line that sets up and runs the tests
    assert tests[0].strip() in (REPO / ".ci" / "run").read_text().splitlines()
