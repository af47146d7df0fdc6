"""Simulated ComfyUI updates that break one model family: the node refuses that family with
what changed and the ComfyUI version, and every other family still patches and merges.

Each fault changes a scratch copy of the ComfyUI under test (comfy_edits.changed_copy) and
runs fault_probe.py in a fresh Python on it: one process per fault, every model sampled inside
it. test_contract_faults.py makes a fault for every need of every contract, checked without
sampling; these three go through the node and the sampler.

- moved: comfy/ldm/chroma/model.py moved to chroma_model.py, every import of it following: a
  class the Flux family names no longer imports where it says. Chroma is refused; Flux (its
  own family), Wan, Qwen-Image and SDXL merge.
- block parameter: Flux's DoubleStreamBlock.forward takes `rope` where it took `pe`. Flux is
  refused; Wan, Qwen-Image and SDXL merge.
- conditioning key: Wan 2.2's extra_conds gives the denoise mask (the frames it keeps) as
  `timestep_mask`. Wan is refused; Flux, Qwen-Image and SDXL merge.

Beside them, in this process: every family contract holds on the ComfyUI under test for each
model class it has.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from comfy_edits import COPIED, changed_copy

import comfy_harness as ch

HERE = Path(__file__).resolve().parent
PROBE = HERE / "fault_probe.py"
PROBE_SECONDS = 240


def edit(path: Path, change: Callable[[str], str]) -> None:
    """Rewrite a file of the copy; the change must change something (a fault that no longer
    applies to this ComfyUI must fail the test, not pass it unchanged)."""
    text = path.read_text()
    changed = change(text)
    assert changed != text, f"the fault changed nothing in {path}"
    path.write_text(changed)


def span(text: str, start: str, end: str) -> tuple[int, int]:
    """Where the first `start` begins and the next `end` after it begins (or the text ends)."""
    i = text.index(start)
    j = text.find(end, i + len(start))
    return i, len(text) if j < 0 else j


def move_chroma(root: Path) -> str:
    """comfy/ldm/chroma/model.py moved to chroma_model.py, every import following it."""
    chroma = root / "comfy" / "ldm" / "chroma"
    (chroma / "model.py").rename(chroma / "chroma_model.py")
    for package in COPIED:
        for path in (root / package).rglob("*.py"):
            text = path.read_text()
            if "comfy.ldm.chroma.model" in text:
                path.write_text(text.replace("comfy.ldm.chroma.model",
                                             "comfy.ldm.chroma.chroma_model"))
    return "comfy.ldm.chroma.model"


def rename_flux_pe(root: Path) -> str:
    """Flux's DoubleStreamBlock.forward takes `rope` where it took `pe` (its body following)."""
    def change(text: str) -> str:
        i, j = span(text, "class DoubleStreamBlock", "\nclass ")
        start = text.index("def forward(", i)
        body = text[start:j]
        # the name, not a keyword passed on (pe=...) nor a string ("pe")
        renamed = re.sub(r"(?<![\w.\"'])pe(?![\w\"'])(?!\s*=[^=])", "rope", body)
        return text[:start] + renamed + text[j:]

    edit(root / "comfy" / "ldm" / "flux" / "layers.py", change)
    return "'pe'"


def rename_wan_denoise_mask(root: Path) -> str:
    """WAN22 gives the denoise mask as `timestep_mask` (its process_timestep takes it so)."""
    def change(text: str) -> str:
        i, j = span(text, "class WAN22(WAN21):", "\nclass ")
        block = text[i:j].replace('out["denoise_mask"]', 'out["timestep_mask"]')
        k = block.index("def process_timestep")
        block = block[:k] + re.sub(r"\bdenoise_mask\b", "timestep_mask", block[k:])
        return text[:i] + block + text[j:]

    edit(root / "comfy" / "model_base.py", change)
    return "'denoise_mask'"


# fault -> (change, model refused, models that must still merge)
FAULTS = {
    "moved_module": (move_chroma, "chroma", ("flux", "wan21_t2v", "qwen_image", "sdxl")),
    "block_parameter": (rename_flux_pe, "flux", ("wan21_t2v", "qwen_image", "sdxl")),
    "conditioning_key": (rename_wan_denoise_mask, "wan21_t2v", ("flux", "qwen_image", "sdxl")),
}


def run_probe(comfyui: Path, models: list[str]) -> dict:
    """fault_probe.py's findings for these models on the ComfyUI at `comfyui`."""
    env = {**os.environ, "COMFYUI_PATH": str(comfyui)}
    done = subprocess.run([sys.executable, str(PROBE), *models], capture_output=True,
                          text=True, env=env, timeout=PROBE_SECONDS, cwd=HERE.parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("fault", list(FAULTS))
def test_update_fault_refuses_only_the_changed_family(comfyui_path, tmp_path, fault):
    change, refused, working = FAULTS[fault]
    copy = changed_copy(comfyui_path, tmp_path / "ComfyUI")
    named = change(copy)
    found = run_probe(copy, [refused, *working])
    message = found[refused].get("refused", "")
    assert message, f"{refused} was not refused: {found[refused]}"
    assert named in message, message
    assert f"ComfyUI {ch.comfy_version_string()}" in message, message
    for model in working:
        assert found[model].get("merged", 0) > 0, f"{model}: {found[model]}"


def test_every_family_contract_holds_here(comfyui_path):
    """Each family's contract, for each model class this ComfyUI has, finds nothing changed
    (a class absent from this version is no model's class here)."""
    from toma_pack.nodes import apply, contracts, unet_patch
    from toma_pack.nodes.families import MODULES

    assert contracts.mismatches(apply.CONTRACT) == []
    assert contracts.mismatches(unet_patch.CONTRACT, unet_patch.UNET_MODEL) == []
    present = 0
    for module in MODULES:
        for model in module.CONTRACT.models:
            if contracts.resolve(model)[0] is None:
                continue
            present += 1
            assert contracts.mismatches(module.CONTRACT, model) == [], model
    assert present >= 10
