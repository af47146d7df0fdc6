"""The public CI recipe (.github/workflows/test.yml) runs the README's test command in the layout
it expects: the ComfyUI versions the README says are tested, cloned at their tags into
../shared/comfyui/<tag>, and the torchvision/torchaudio stand-ins in ../shared/stubs. actionlint
(scripts/test.sh) checks that the file is a valid workflow; this checks what it does."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = (ROOT / ".github" / "workflows" / "test.yml").read_text(encoding="utf-8")
README = (ROOT / "README.md").read_text(encoding="utf-8")
STUBS = ROOT / "tests" / "stubs"
SHARED_STUBS = ROOT.parent / "shared" / "stubs"


def run_lines() -> list[str]:
    """Every shell line of the workflow's run steps, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", WORKFLOW)
    lines = []
    for block in re.findall(r"run: \|\n((?:\s{10,}.*\n)+)|run: (.+)", text):
        lines += [line.strip() for line in (block[0] or block[1]).splitlines() if line.strip()]
    return lines


def test_it_runs_the_readme_s_test_command() -> None:
    command = re.search(r"The test command[^\n]*\n\n```\n(.+)\n```", README)[1]
    assert command == "bash scripts/test.sh"
    assert command in run_lines()


def test_it_clones_the_tested_versions_at_their_tags_beside_the_checkout() -> None:
    tested = re.search(r"\(tested on ([^)]+)\)", README)[1]
    versions = re.findall(r"v[\d.]*\d", tested)
    loop = next(line for line in run_lines() if line.startswith("for tag in"))
    assert re.findall(r"v[\d.]*\d", loop.split(";")[0]) == versions
    clone = next(line for line in run_lines() if line.startswith("git clone"))
    assert '--branch "$tag"' in clone
    assert clone.split()[-2:] == ["https://github.com/comfyanonymous/ComfyUI",
                                  '"../shared/comfyui/$tag"']


def test_it_puts_the_stand_ins_where_the_tests_look() -> None:
    assert "cp -r tests/stubs ../shared/stubs" in run_lines()
    packages = {path.name for path in STUBS.iterdir() if path.is_dir()}
    assert packages == {"torchvision", "torchaudio"}
    if SHARED_STUBS.is_dir():  # this project's machines: the copy has the same modules
        modules = {path.relative_to(STUBS) for path in STUBS.rglob("*.py")}
        assert modules == {path.relative_to(SHARED_STUBS) for path in SHARED_STUBS.rglob("*.py")}
