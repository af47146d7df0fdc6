"""Changes made to a scratch copy of a ComfyUI tree: the copy itself, and edits of its classes
and functions made on their syntax trees (found by qualified name, written back with
ast.unparse, so an edited definition is also reformatted and loses its comments).

An edit is data (JSON-able), so a test can list edits and contract_worker.py apply them:
{"file": path in the tree, "qualname": "Class.method" ("" for the module), "op": one of OPS,
"arg": its argument}. Nothing here imports ComfyUI.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import textwrap
from collections.abc import Callable, Iterable
from pathlib import Path

# the packages an edit may change: copied (their .py files); the rest of the tree is linked
COPIED = ("comfy", "comfy_extras", "comfy_api")
SUFFIX = "_renamed"


def changed_copy(tree: Path, dest: Path) -> Path:
    """A ComfyUI at `dest`: COPIED packages' Python files copied (writable), their other files
    and every other entry of `tree` linked."""
    dest.mkdir()
    for entry in tree.iterdir():
        if entry.name not in COPIED:
            (dest / entry.name).symlink_to(entry)
            continue
        for folder, _, files in os.walk(entry):
            if Path(folder).name == "__pycache__":
                continue
            target = dest / Path(folder).relative_to(tree)
            target.mkdir(parents=True, exist_ok=True)
            for name in files:
                source = Path(folder) / name
                if name.endswith(".py"):
                    shutil.copyfile(source, target / name)
                else:
                    (target / name).symlink_to(source)
    return dest


# Ops: each changes a definition's syntax tree in place -----------------------------------------
def _rename_names(node: ast.AST, old: str) -> None:
    """Rename a parameter or variable: every name and parameter called `old`."""
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and n.id == old:
            n.id = old + SUFFIX
        elif isinstance(n, ast.arg) and n.arg == old:
            n.arg = old + SUFFIX


def _rename_strings(node: ast.AST, old: str) -> None:
    """Every string constant `old` (a dict key, a marker) spelled another way."""
    for n in ast.walk(node):
        if isinstance(n, ast.Constant) and n.value == old:
            n.value = old + SUFFIX


def _unset_attribute(node: ast.AST, name: str) -> None:
    """The definition stores self.<name> under another name."""
    for n in ast.walk(node):
        if (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and n.attr == name
                and isinstance(n.value, ast.Name) and n.value.id == "self"):
            n.attr = name + SUFFIX


def _rename_definition(node: ast.AST, name: str) -> None:
    """A class, function, field or constant a class body defines is called another way."""
    for n in getattr(node, "body", ()):
        if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == name:
            n.name = name + SUFFIX
        targets = n.targets if isinstance(n, ast.Assign) else \
            [n.target] if isinstance(n, ast.AnnAssign) else []
        for target in targets:
            if isinstance(target, ast.Name) and target.id == name:
                target.id = name + SUFFIX


def _change_constant(node: ast.AST, name: str) -> None:
    """A module-level constant holds another value."""
    for n in getattr(node, "body", ()):
        if (isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
                and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)):
            value = n.value.value
            n.value.value = value + SUFFIX if isinstance(value, str) else value + 1


def _swap_cats(node: ast.AST, _: object = None) -> None:
    """Every torch.cat of two tensors joins them the other way round."""
    for n in ast.walk(node):
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "cat"
                and n.args and isinstance(n.args[0], (ast.Tuple, ast.List))
                and len(n.args[0].elts) == 2):
            n.args[0].elts.reverse()


def _respell(node: ast.AST, _: object = None) -> None:
    """A tidy-up that keeps the behaviour: every local variable of each function (the node,
    or a class's methods) renamed, the whole definition reformatted by unparsing."""
    functions = [node] if isinstance(node, ast.FunctionDef) else \
        [n for n in getattr(node, "body", ()) if isinstance(n, ast.FunctionDef)]
    for function in functions:
        _rename_locals(function)


def _rename_locals(function: ast.FunctionDef) -> None:
    declared = {name for n in ast.walk(function) if isinstance(n, (ast.Global, ast.Nonlocal))
                for name in n.names}
    bound = {n.id for n in ast.walk(function)
             if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    bound |= {n.name for n in ast.walk(function)
              if isinstance(n, ast.FunctionDef) and n is not function}
    for statement in function.body:
        _rename_in(statement, bound - _parameters(function) - declared)


def _parameters(function: ast.FunctionDef | ast.Lambda) -> set[str]:
    arguments = function.args
    return {a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs,
                            arguments.vararg, arguments.kwarg) if a is not None}


def _rename_in(node: ast.AST, names: set[str]) -> None:
    """`names` renamed in `node`, except inside a nested function or lambda whose parameter
    it is (a nested function's parameters keep their names: callers pass them by name)."""
    if isinstance(node, ast.Name) and node.id in names:
        node.id += "_local"
    if isinstance(node, (ast.FunctionDef, ast.Lambda)):
        if isinstance(node, ast.FunctionDef) and node.name in names:
            node.name += "_local"
        outer = [*getattr(node, "decorator_list", ()), *node.args.defaults,
                 *(d for d in node.args.kw_defaults if d is not None)]
        for child in outer:
            _rename_in(child, names)
        inner = names - _parameters(node)
        for child in node.body if isinstance(node.body, list) else [node.body]:
            _rename_in(child, inner)
        return
    for child in ast.iter_child_nodes(node):
        _rename_in(child, names)


OPS: dict[str, Callable[[ast.AST, object], None]] = {
    "rename_names": _rename_names,
    "rename_strings": _rename_strings,
    "unset_attribute": _unset_attribute,
    "rename_definition": _rename_definition,
    "change_constant": _change_constant,
    "swap_cats": _swap_cats,
    "respell": _respell,
}


# Applying edits ---------------------------------------------------------------------------------
def find(tree: ast.Module, qualname: str) -> ast.AST | None:
    """The class or function at `qualname` in a module's tree (also under if/try); the module
    for ""."""
    node: ast.AST | None = tree
    for part in qualname.split(".") if qualname else ():
        node = next((n for n in ast.walk(node) if isinstance(n, (ast.ClassDef, ast.FunctionDef))
                     and n.name == part and n is not node), None)
    return node


def apply(root: Path, edits: Iterable[dict], before: dict[Path, str] | None = None
          ) -> dict[Path, str]:
    """Make these edits in the tree at `root`, each file parsed once; the changed files' texts
    before them (kept in `before` as they change, so that a failed edit can be undone). An
    edit that changes nothing (a definition or name this ComfyUI lacks) raises
    AssertionError. "rename_everywhere" renames a module's name (its "arg") in every copied
    file, as ComfyUI renaming a class would (its importers following it)."""
    before = {} if before is None else before
    by_file: dict[str, list[dict]] = {}
    for e in edits:
        if e["op"] == "rename_everywhere":
            _rename_everywhere(root, e["arg"], before)
        else:
            by_file.setdefault(e["file"], []).append(e)
    for file, file_edits in by_file.items():
        path = root / file
        text = path.read_text()
        before.setdefault(path, text)
        tree = ast.parse(text)
        nodes = []
        for e in file_edits:
            node = find(tree, e["qualname"])
            assert node is not None, f"{file} defines no {e['qualname']}"
            dumped = ast.dump(node)
            OPS[e["op"]](node, e.get("arg"))
            # a re-spelling of a function without locals is its reformatting alone
            assert ast.dump(node) != dumped or e["op"] == "respell", f"{e} changed nothing"
            nodes.append(node)
        path.write_text(_spliced(text, tree, nodes))
    return before


def _rename_everywhere(root: Path, name: str, before: dict[Path, str]) -> None:
    pattern = re.compile(rf"\b{re.escape(name)}\b")
    changed = False
    for package in COPIED:
        for path in (root / package).rglob("*.py"):
            text = path.read_text()
            if pattern.search(text):
                before.setdefault(path, text)
                path.write_text(pattern.sub(name + SUFFIX, text))
                changed = True
    assert changed, f"no file names {name}"


def _spliced(text: str, tree: ast.Module, nodes: list[ast.AST]) -> str:
    """`text` with each outermost of `nodes` replaced by its unparsed tree."""
    if any(node is tree for node in nodes):
        return ast.unparse(tree) + "\n"
    spans = {}
    for node in nodes:
        start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", ()))])
        spans[(start, node.end_lineno)] = node
    outer = [(span, node) for span, node in spans.items()
             if not any(o != span and o[0] <= span[0] and span[1] <= o[1] for o in spans)]
    lines = text.splitlines(keepends=True)
    for (start, end), node in sorted(outer, key=lambda item: -item[0][0]):
        indent = lines[node.lineno - 1][:node.col_offset]
        lines[start - 1:end] = [textwrap.indent(ast.unparse(node), indent) + "\n"]
    return "".join(lines)
