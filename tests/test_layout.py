"""The source layout's promises (docs/methods.md 12), read from the source itself: the core (lib/*.py) never imports
lib/extras/, lib/'s modules import each other without a cycle, and no file of lib/ or the entry scripts is over 800
lines."""

import ast

from conftest import REPO

CORE = sorted((REPO / "lib").glob("*.py"))
LIB = CORE + sorted((REPO / "lib" / "extras").glob("*.py"))
ENTRY_SCRIPTS = [REPO / name for name in ("train_agrpo.py", "eval_agrpo.py", "chat_app.py", "serve_vllm.py")]


def module_name(path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def imported(tree: ast.AST, module_level: bool) -> set[str]:
    """The lib modules a parsed file imports (`from lib import x` and `from lib.extras import x` name modules);
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


def test_the_core_never_imports_the_extras():
    graph = import_graph(module_level=False)
    assert "lib.extras.cpu_kernels" in graph and "lib.modeling" in graph["lib.rollout"]  # the graph was read
    wrong = {name: sorted(t for t in targets if t.startswith("lib.extras"))
             for name, targets in graph.items() if not name.startswith("lib.extras")}
    assert not {name: targets for name, targets in wrong.items() if targets}


def test_lib_has_no_import_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}}) is None
    assert find_cycle(import_graph()) is None


def test_no_file_is_over_800_lines():
    lengths = {path.relative_to(REPO).as_posix(): len(path.read_text().splitlines()) for path in LIB + ENTRY_SCRIPTS}
    assert not {name: n for name, n in lengths.items() if n > 800}
