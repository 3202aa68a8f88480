"""The source layout's promises (docs/methods.md 12), read from the source itself: lib/'s modules import each other
without a cycle, its rooms (each folder of lib/, and each module directly in it) import downward only, no room holds more
than about a fifth of the package's lines, and no file of lib/ or the entry scripts is over 800 lines."""

import ast

from conftest import REPO

LIB = sorted((REPO / "lib").rglob("*.py"))
ENTRY_SCRIPTS = [REPO / name for name in ("train_agrpo.py", "eval_agrpo.py", "chat_app.py", "serve_vllm.py")]


def module_name(path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def imported(tree: ast.AST, module_level: bool) -> set[str]:
    """The lib modules a parsed file imports (`from lib import x` and `from lib.sampling.context import x` name modules);
    module_level: only the imports run when the module loads, not those inside functions or classes."""
    names, nodes = set(), list(ast.iter_child_nodes(tree))
    while nodes:
        node = nodes.pop()
        if module_level and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            package = (REPO / node.module.replace(".", "/")).is_dir()
            names |= {f"{node.module}.{alias.name}" for alias in node.names} if package else {node.module}
        nodes.extend(ast.iter_child_nodes(node))
    return {name for name in names if name.split(".")[0] == "lib"}


def import_graph(module_level: bool = True) -> dict[str, set[str]]:
    return {module_name(path): imported(ast.parse(path.read_text()), module_level) for path in LIB}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of the graph (its modules in order, the first repeated at the end), or None."""
    done, path = set(), []

    def visit(node: str) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if (cycle := visit(target)) is not None:
                return cycle
        path.pop()
        done.add(node)
        return None

    return next((cycle for node in sorted(graph) if (cycle := visit(node)) is not None), None)


def room(module: str) -> str:
    """A module's room: its folder under lib/ (lib.sampling.decode -> lib.sampling.context), or the module itself when it
    lies directly in lib/ (lib.setup)."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_rooms_import_downward():
    """Folded into rooms, lib/'s imports (those inside functions too) still form no cycle: a room never imports one
    that imports it back, so each folder can be read from the ones below it."""
    graph = import_graph(module_level=False)
    assert "lib.sampling.cpu_kernels" in graph and "lib.models.modeling" in graph["lib.sampling.rollout"]  # read
    rooms: dict[str, set[str]] = {}
    for name, targets in graph.items():
        rooms.setdefault(room(name), set()).update(room(t) for t in targets if room(t) != room(name))
    assert "lib.models" in rooms["lib.sampling"]
    assert find_cycle(rooms) is None


def test_no_room_holds_more_than_a_fifth():
    """The lines of the package (lib/, the entry scripts, scripts/) by room: lib/'s folders, lib/'s own modules
    together, scripts/, each entry script. None holds more than about a fifth (22%)."""
    lines: dict[str, int] = {}
    for path in LIB + ENTRY_SCRIPTS + sorted((REPO / "scripts").rglob("*.py")):
        parts = path.relative_to(REPO).parts
        key = parts[0] if parts[0] != "lib" else "/".join(parts[:2]) if len(parts) > 2 else "lib/*.py"
        lines[key] = lines.get(key, 0) + len(path.read_text().splitlines())
    total = sum(lines.values())
    assert {"lib/sampling", "lib/*.py", "scripts", "train_agrpo.py"} <= set(lines)
    assert not {key: round(n / total, 3) for key, n in lines.items() if n > 0.22 * total}


def test_lib_has_no_import_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}}) is None
    assert find_cycle(import_graph()) is None


def test_no_file_is_over_800_lines():
    lengths = {path.relative_to(REPO).as_posix(): len(path.read_text().splitlines()) for path in LIB + ENTRY_SCRIPTS}
    assert not {name: n for name, n in lengths.items() if n > 800}
