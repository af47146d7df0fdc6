"""No import circles in the product or the lab: every module's imports (those inside functions
included) of the pack's own modules, followed, never come back to it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("nodes", "toma_core", "bench")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES
            for path in sorted((ROOT / package).rglob("*.py"))}


def resolve(name: str, known: dict[str, Path]) -> str | None:
    """The known module `name` is, or the one it is an attribute of; None outside the pack."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The pack's modules that module `name` imports (a package's __init__ only when a name is
    taken from the package itself)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            stem = ".".join(part for part in (base if node.level else "", node.module or "")
                            if part)
            targets = [f"{stem}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            module = resolve(target.removeprefix("toma_pack."), known)
            if module is not None and module != name:
                found.add(module)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected group of modules (Tarjan), as a module list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def graph_of(known: dict[str, Path]) -> dict[str, set[str]]:
    return {name: imports_of(name, path, known) for name, path in known.items()}


def test_no_import_circles() -> None:
    known = modules()
    assert "bench.speed.dit_families" in known and "nodes.run_state" in known
    assert cycles(graph_of(known)) == []


def test_a_circle_is_found() -> None:
    # The check itself: two modules importing each other, one of them inside a function.
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
