"""Load this checkout as the package `toma_pack`, the way ComfyUI imports a custom node folder.

The pack uses relative imports (ComfyUI has a top-level `nodes` module of its own), so tests and
benchmarks load it as a package under a fixed name rather than by its folder's name.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

PACK_NAME = "toma_pack"
ROOT = Path(__file__).resolve().parent


def load_pack() -> ModuleType:
    """The pack as `toma_pack` (imported once, then taken from sys.modules)."""
    if PACK_NAME in sys.modules:
        return sys.modules[PACK_NAME]
    spec = importlib.util.spec_from_file_location(
        PACK_NAME, ROOT / "__init__.py", submodule_search_locations=[str(ROOT)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACK_NAME] = module
    spec.loader.exec_module(module)
    return module
