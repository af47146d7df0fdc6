"""Which example workflows need a newer ComfyUI than the pack's floor: the one place that says so.

Every example in example_workflows/ runs on every ComfyUI the pack supports (v0.3.64 and later)
unless MIN_COMFYUI below names a later version for it: the oldest tested ComfyUI that has the
example's core nodes (LTX-2's: v0.8.0, which v0.3.64 lacks). The template browser still lists
such an example on older versions (ComfyUI serves the folder as it is); opening it there shows
its nodes as missing, and its note and the README say which version it needs.

The tests that load, validate or run the examples (tests/integration/test_server.py and
test_frontend.py) ask `runs_here` whether an example must run on the ComfyUI under test. Below
the example's minimum it answers no, and only after asserting that this ComfyUI really lacks
some node the example uses: a gate that hides an example on a version that has all its nodes
fails, so that it cannot hide a broken example. tests/unit/test_example_workflows.py and
tests/unit/test_readme.py check that every gated example exists and says, in its note and in
the README, from which version it works.

A mapping here rather than metadata in the workflow files' "extra", which ComfyUI would
tolerate (frontends 1.35 and 1.49 load an unknown key there without complaint, and keep it when
the workflow is saved again): those files are the product, and every copy a user saves would
carry a flag that only these tests read; a minimum version in them would still need code here
to act on it. Here it is one line beside the code that uses it, and the unit tests above fail
if it names a file that does not exist.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path

EXAMPLES_DIR = Path(__file__).resolve().parents[1] / "example_workflows"
FLOOR = (0, 3, 64)  # the oldest ComfyUI the pack supports (README: Compatibility, Versions)
# Example (file name without .json) -> the oldest tested ComfyUI with every core node it uses.
MIN_COMFYUI: dict[str, tuple[int, int, int]] = {
    # LTXAVTextEncoderLoader, LTXVAudioVAELoader, LTXVEmptyLatentAudio, LTXVConcatAVLatent,
    # LTXVSeparateAVLatent, LTXVAudioVAEDecode (comfy_extras/nodes_lt_audio.py, nodes_lt.py)
    "LTX-2 text to video": (0, 8, 0),
    # HiDream-O1's model and its nodes EmptyHiDreamO1LatentImage, HiDreamO1PatchSeamSmoothing
    # (comfy_extras/nodes_hidream_o1.py)
    "HiDream-O1 text to image": (0, 33, 0),
    # MiniMax H3's model and its nodes MiniMaxH3ImageToVideo (comfy_extras/nodes_minimax_h3.py)
    "MiniMax H3 image to video": (0, 33, 0),
}
# Node types the frontend draws without a backend node (they need none in /object_info).
FRONTEND_ONLY_NODES = frozenset({"Note", "MarkdownNote", "Reroute", "PrimitiveNode"})


def example_files() -> list[Path]:
    return sorted(EXAMPLES_DIR.glob("*.json"))


def min_version(example: Path) -> tuple[int, ...]:
    """The oldest ComfyUI the example runs on."""
    return MIN_COMFYUI.get(example.stem, FLOOR)


def version_text(version: tuple[int, ...]) -> str:
    """(0, 8, 0) -> "v0.8.0", as the README and the notes write versions."""
    return "v" + ".".join(str(part) for part in version)


def node_types(example: Path) -> set[str]:
    """The backend node types the example uses."""
    workflow = json.loads(example.read_text(encoding="utf-8"))
    return {node["type"] for node in workflow["nodes"]} - FRONTEND_ONLY_NODES


def runs_here(example: Path, version: tuple[int, ...], available: Collection[str]) -> bool:
    """Whether the example must load, validate and run on this ComfyUI (`version`, whose
    /object_info lists the node types `available`). False only below the example's minimum
    version, and only where this ComfyUI lacks some of its nodes (else the assertion fails:
    the gate would hide an example that may well work, or be broken, here)."""
    needed = min_version(example)
    if tuple(version) >= needed:
        return True
    missing = node_types(example) - set(available)
    assert missing, (
        f"{example.name} is gated to ComfyUI {version_text(needed)} and later, but ComfyUI "
        f"{version_text(tuple(version))} has every node it uses: nodes are present but the "
        f"example is gated; lower its entry in tests/example_gate.py (MIN_COMFYUI)")
    return False


def examples_here(version: tuple[int, ...], available: Collection[str]) -> list[Path]:
    """The examples that must run on this ComfyUI (see runs_here)."""
    return [path for path in example_files() if runs_here(path, version, available)]
