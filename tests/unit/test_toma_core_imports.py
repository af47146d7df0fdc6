"""toma_core is the algorithm in plain PyTorch: it never imports ComfyUI or the pack's nodes/.

Checked two ways: statically (every import statement in toma_core/*.py names the standard
library, torch, or a module of toma_core itself; Triton only inside functions, for the CUDA
kernel) and at run time (toma_core imported in a fresh interpreter in which importing ComfyUI's
modules or nodes/ raises, and planning on the CPU never imports Triton).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[2] / "toma_core"
ALLOWED_THIRD_PARTY = {"torch"}
# Imported by the functions that build or run the CUDA kernel only, never at module level: a
# machine without Triton (or without a GPU) never imports it.
LAZY_THIRD_PARTY = {"triton"}


def _imports(path: Path) -> list[tuple[str, int, bool]]:
    """(top-level module, relative level, inside a function) of every import in a file;
    relative imports give the module as written after the dots."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend((alias.name.split(".")[0], 0, in_function) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.append(((node.module or "").split(".")[0], node.level, in_function))
        inner = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(ast.parse(path.read_text(), str(path)), False)
    return found


@pytest.mark.parametrize("path", sorted(CORE.glob("*.py")), ids=lambda p: p.name)
def test_imports_are_stdlib_torch_or_toma_core(path: Path) -> None:
    siblings = {p.stem for p in CORE.glob("*.py")}
    for module, level, in_function in _imports(path):
        if level:
            # `from . import x` / `from .x import y` stay inside toma_core; `..` would leave it
            assert level == 1 and (module == "" or module in siblings), (path.name, module)
        elif module in LAZY_THIRD_PARTY:
            assert in_function, (path.name, module, "imported at module level")
        else:
            assert module in sys.stdlib_module_names or module in ALLOWED_THIRD_PARTY, \
                (path.name, module)


def test_imports_without_comfyui_or_nodes() -> None:
    """A fresh interpreter where `comfy*`, `nodes`, `server`, `folder_paths`, the pack's nodes/
    and Triton cannot be imported still imports toma_core (its operator registered) and builds
    and applies a plan on the CPU."""
    script = textwrap.dedent(f"""
        import importlib.abc, importlib.util, sys
        # ComfyUI's top-level modules, and nodes (ComfyUI's, or the pack's nodes/ as `..nodes`)
        BANNED = ("comfy", "comfy_extras", "comfy_api", "nodes", "server", "folder_paths",
                  "toma_pack", "triton")

        class Ban(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BANNED:
                    raise ImportError("toma_core imported " + name)
                return None

        sys.meta_path.insert(0, Ban())
        # toma_core as a package of its own (no pack __init__ that registers nodes)
        spec = importlib.util.spec_from_file_location(
            "toma_core", {str(CORE / "__init__.py")!r},
            submodule_search_locations=[{str(CORE)!r}])
        core = importlib.util.module_from_spec(spec)
        sys.modules["toma_core"] = core
        spec.loader.exec_module(core)
        import torch
        x = torch.randn(1, 64, 8)
        plan = core.build_plan(x, 8, 8, 0.5, tile_count=4)
        assert plan.unmerge(plan.merge(x)).shape == x.shape
        assert plan.around(lambda t: t * 2, x).shape == x.shape
        assert core.plan_op._OP is torch.ops.comfy_toma.plan_weights
        print(sorted(m for m in sys.modules if m.split(".")[0] in BANNED))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
