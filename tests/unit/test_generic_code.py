"""The generic modules name no model family: what a family is lives in its module under
nodes/families/ (and the UNet's in nodes/unet_patch.py). The names are those the family modules
give their models (MODELS), so a new family's name is checked without editing this test. The
node modules whose widgets and tooltips name models to the user are not generic code."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# user-facing text (tooltips, preview levels), the UNet family and the packages' code maps
NOT_GENERIC = {"toma_node.py", "preview_node.py", "unet_patch.py", "__init__.py"}


def family_names() -> set[str]:
    """Each model's name in the families' MODELS, and its stem before a hyphen ("Qwen" of
    "Qwen-Image"), where that stem is a word of three letters or more."""
    names: set[str] = set()
    for path in (ROOT / "nodes" / "families").glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(
                    getattr(t, "id", None) == "MODELS" for t in node.targets):
                for word in re.findall(r"[A-Za-z][\w-]*", ast.literal_eval(node.value)):
                    if word[0].isupper() and word not in {"Edit", "Animate", "VACE", "Fun"}:
                        names.add(word)
                        stem = word.split("-")[0]
                        if len(stem) >= 3:
                            names.add(stem)
    return names


def generic_modules() -> list[Path]:
    return sorted(p for folder in ("nodes", "toma_core") for p in (ROOT / folder).glob("*.py")
                  if p.name not in NOT_GENERIC)


def test_the_family_names_are_read():
    assert {"Flux", "Wan", "LTX", "Qwen", "HiDream-O1", "MiniMax", "Lens"} <= family_names()


@pytest.mark.parametrize("path", generic_modules(), ids=lambda p: p.name)
def test_generic_module_names_no_family(path: Path):
    text = path.read_text()
    found = sorted(name for name in family_names()
                   if re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text))
    assert not found, f"{path.name} names {found}: say it in the family's module"
