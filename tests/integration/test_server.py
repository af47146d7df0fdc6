"""The pack inside a real ComfyUI process: startup import, HTTP API, a queued graph, stats push.

ComfyUI runs from its own main.py (in this Python) with the pack linked into a temporary base
directory (see comfy_server.py); the checkout itself is left untouched.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import comfy_server
import toma_pack
from comfy_server import PACK_FOLDER, TEST_PACK_FOLDER, ComfyServer

PACK_NODES = ("ToMA", "ToMAAdvanced", "ToMAPreview")
WEB_SCRIPTS = ("toma_stats.js", "toma_stats_format.js")
EXAMPLES = comfy_server.REPO_ROOT / "example_workflows"
QUICK_TEST_TIMEOUT_S = 120.0
TOMA_ID = "7"


@pytest.fixture(scope="module")
def server(comfyui_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComfyServer]:
    with comfy_server.running_server(comfyui_path, tmp_path_factory.mktemp("server")) as running:
        yield running


def test_quick_test_for_ci_imports_the_pack(comfyui_path: Path, tmp_path: Path) -> None:
    base = comfy_server.make_base_directory(tmp_path)
    result = comfy_server.run_quick_test(comfyui_path, base, QUICK_TEST_TIMEOUT_S)
    log_tail = comfy_server.tail(result.stdout)
    assert result.returncode == 0, log_tail
    imports = comfy_server.custom_node_imports(result.stdout)
    assert imports.get(PACK_FOLDER) is True, f"{PACK_FOLDER} not imported: {imports}\n{log_tail}"
    assert imports.get(TEST_PACK_FOLDER) is True, f"test nodes not imported: {imports}"
    failures = [line for line in result.stdout.splitlines()
                if PACK_FOLDER in line and ("IMPORT FAILED" in line or "Cannot import" in line)]
    assert not failures, failures


def _input_names(spec: dict[str, Any]) -> dict[str, list[str]]:
    return {section: list(spec.get(section, {})) for section in ("required", "optional")}


def _input_type(spec: tuple | list) -> Any:
    # A combo's type is its option list; ComfyUI sends it as a list either way.
    kind = spec[0]
    return list(kind) if isinstance(kind, (list, tuple)) else kind


@pytest.mark.parametrize("name", PACK_NODES)
def test_object_info_matches_the_node_classes(server: ComfyServer, name: str) -> None:
    node_class = toma_pack.NODE_CLASS_MAPPINGS[name]
    expected = node_class.INPUT_TYPES()
    info = server.get_json(f"/object_info/{name}")[name]
    # Widget order is what saved workflows rely on: compare names in order, then types.
    assert _input_names(info["input"]) == _input_names(expected)
    for section in ("required", "optional"):
        for input_name, spec in expected.get(section, {}).items():
            assert _input_type(info["input"][section][input_name]) == _input_type(spec), input_name
    if "input_order" in info:  # newer versions send the order explicitly as well
        for section, names in _input_names(expected).items():
            assert info["input_order"].get(section, []) == names
    assert info["output"] == list(node_class.RETURN_TYPES)
    assert info["category"] == node_class.CATEGORY
    assert info["display_name"] == toma_pack.NODE_DISPLAY_NAME_MAPPINGS[name]
    assert info["python_module"].endswith(PACK_FOLDER)


def test_extensions_serve_the_web_scripts(server: ComfyServer) -> None:
    scripts = server.get_json("/extensions")
    for script in WEB_SCRIPTS:
        url = f"/extensions/{PACK_FOLDER}/{script}"
        assert url in scripts
        status, body = server.get(url)
        assert status == 200
        assert body == (comfy_server.REPO_ROOT / "web" / script).read_bytes()


def test_workflow_templates_list_the_examples(server: ComfyServer) -> None:
    status, body = server.get("/api/workflow_templates")
    if status == 404:
        pytest.skip("this ComfyUI has no /api/workflow_templates endpoint")
    assert status == 200, body[:500]
    # Keyed by the custom_nodes folder name, file names without .json (0.3.64 to 0.33.0).
    templates = json.loads(body)
    expected = sorted(path.stem for path in EXAMPLES.glob("*.json"))
    assert expected, "the pack has no example workflows"
    assert sorted(templates.get(PACK_FOLDER, [])) == expected
    # The frontend's template browser then fetches each file from here.
    for stem in expected:
        served = server.get_json(f"/api/workflow_templates/{PACK_FOLDER}/{stem}.json")
        assert served == json.loads((EXAMPLES / f"{stem}.json").read_text())


def test_prompt_runs_and_pushes_stats(server: ComfyServer) -> None:
    toma_inputs = {**comfy_server.node_defaults(toma_pack.NODE_CLASS_MAPPINGS["ToMA"]),
                   "ratio": 0.5}
    run = comfy_server.run_prompt(server, comfy_server.tiny_sdxl_graph(TOMA_ID, toma_inputs))

    status = run.history["status"]
    errors = run.messages_of("execution_error") + [
        m for m in status.get("messages", []) if m and m[0] == "execution_error"]
    assert not errors, errors
    assert status["status_str"] == "success" and status["completed"] is True, status
    sink = run.history["outputs"][comfy_server.SINK_ID]
    size = comfy_server.LATENT_SIZE
    assert sink["latent_shape"] == [[1, 4, size, size]]
    assert sink["finite"] == [True]

    # The backend -> frontend path: one "toma.stats" broadcast for the one sampling run.
    stats_messages = run.messages_of("toma.stats")
    assert len(stats_messages) == 1, stats_messages
    message = stats_messages[0]
    assert message["node"] == TOMA_ID
    stats = message["stats"]
    assert stats["layers_merged"] > 0, stats
    assert stats["ratio"] == 0.5 and stats["family"] == "unet"
    assert stats["steps_total"] == 2 and stats["steps_merged"] == 2
