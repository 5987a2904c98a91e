"""Imports only go down (DESIGN.md, layers): no circle among fabric's modules, lazy imports included."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "fabric"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run, inside functions too, but not those under `if TYPE_CHECKING:`."""
    typing_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for node in ast.walk(block)
    }
    return [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom) and id(n) not in typing_only]


def _targets(node: ast.Import | ast.ImportFrom, here: str, is_package: bool, modules: set[str]) -> set[str]:
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in modules}
    base = node.module or ""
    if node.level:
        package = here.split(".") if is_package else here.split(".")[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join([*package, base] if base else package)
    found = set()
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        found.add(submodule if submodule in modules else base)
    return found & modules


def _import_graph() -> dict[str, set[str]]:
    files = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        edges: set[str] = set()
        for node in _runtime_imports(ast.parse(path.read_text())):
            edges |= _targets(node, name, path.name == "__init__.py", set(files))
        graph[name] = edges - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan; recursion is fine at this size)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_among_fabric_modules() -> None:
    assert _cycles(_import_graph()) == []


def test_the_checker_sees_a_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_wrappers_do_not_import_strategies_and_checkpoints_sit_below_strategies() -> None:
    graph = _import_graph()
    assert not any(target.startswith("fabric.strategies") for target in graph["fabric.wrappers"])
    for name, targets in graph.items():
        if name.startswith("fabric.checkpoint"):
            assert not any(t.startswith("fabric.strategies") for t in targets), (name, targets)
