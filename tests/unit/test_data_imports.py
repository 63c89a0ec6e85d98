"""``unbroken.data`` imports in one direction: no module of it imports, even for type checking
only, a module that imports it back. A cycle means two modules that cannot be read (or changed)
one without the other; the loader, its iterator, torch's API and the sources are layered."""

import ast
from pathlib import Path

import unbroken.data

PACKAGE = "unbroken.data"
ROOT = Path(unbroken.data.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((PACKAGE, *parts))


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``path`` imports anywhere in it (``TYPE_CHECKING`` blocks
    and functions included): each ``from .x import y`` names module ``.x.y`` if there is one,
    else module ``.x``."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            target = f"{base}.{node.module}" if node.module else base
            for alias in node.names:
                found.add(
                    f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target
                )
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {module for module in found if module in modules and module != name}


def import_graph() -> dict[str, set[str]]:
    paths = sorted(ROOT.rglob("*.py"))
    modules = {_module_name(path) for path in paths}
    return {_module_name(path): _imports(path, modules) for path in paths}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` as the list of its modules (the first one repeated last), or None."""
    state: dict[str, str] = {}  # "open" while on the path, "done" once all it reaches is seen
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return [*path[path.index(target) :], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_the_graph_sees_relative_imports_of_every_kind():
    graph = import_graph()
    assert "unbroken.data.sources.base" in graph["unbroken.data.sources.orders"]  # from .base
    assert "unbroken.data.keys" in graph["unbroken.data.sources.orders"]  # from .. import keys
    assert "unbroken.data.loader" in graph["unbroken.data"]  # from .loader, in __init__
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_of_unbroken_data_imports_one_that_imports_it_back():
    cycle = find_cycle(import_graph())
    assert cycle is None, (
        "an import cycle inside unbroken.data: "
        + " -> ".join(cycle or ())
        + ". Move what both need into a module below them, or pass it in (a Protocol for the "
        "type), so that imports go one way"
    )
