"""The pack inside a real ComfyUI process: startup import, HTTP API, template browser files, a
queued graph and its stats, input validation before a graph runs.

ComfyUI runs from its own main.py (in this Python) with the pack linked into a temporary base
directory (see comfy_server.py); the checkout itself is left untouched.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import comfy_harness as ch
import comfy_server
import example_gate
from comfy_server import PACK_FOLDER, TEST_PACK_FOLDER, ComfyServer
from toma_pack.nodes import NODE_SPECS
from toma_pack.nodes.options import parse_skip_blocks
from toma_pack.nodes.ui_stats import LINE_BREAK

PACK_NODES = tuple(NODE_SPECS)
V1_NODES = ("ToMA", "ToMAAdvanced", "ToMAPreview")     # the nodes the pack had before V3
EXAMPLES = comfy_server.REPO_ROOT / "example_workflows"
CATEGORY_TITLE = "ToMA Token Merge"
JPEG_MAGIC = b"\xff\xd8\xff"
QUICK_TEST_TIMEOUT_S = 600.0    # guards a hang (see comfy_server's waits)
TOMA_ID = "7"
V1_OBJECT_INFO = json.loads((Path(__file__).parent / "object_info_v1.json").read_text())


def without_texts(value: object) -> object:
    """`value` (object_info of a node) less its texts, tooltips and description, which may be
    reworded; ids, names, types, defaults, ranges, steps and order never change."""
    if isinstance(value, dict):
        return {k: without_texts(v) for k, v in value.items() if k not in ("tooltip",
                                                                          "description")}
    if isinstance(value, list):
        return [without_texts(v) for v in value]
    return value


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


def as_v1(info: dict[str, Any]) -> dict[str, Any]:
    """A V3 node's /object_info entry as the V1 nodes sent it: a combo's type is its option list
    (V3: "COMBO" with the list under "options" and "multiselect": false) and a hidden input's
    spec a plain string (V3: a one-element list). The representation changed, not the node."""
    v1 = json.loads(json.dumps(info))
    for section, inputs in v1["input"].items():
        for name, spec in inputs.items():
            if section == "hidden":
                inputs[name] = spec[0]
            elif spec[0] == "COMBO":
                options = dict(spec[1])
                choices = options.pop("options")
                assert options.pop("multiselect") is False, (name, spec)
                inputs[name] = [choices, options]
    return v1


@pytest.mark.parametrize("name", V1_NODES)
def test_object_info_is_what_the_v1_nodes_sent(server: ComfyServer, name: str) -> None:
    # object_info_v1.json: /object_info of the V1 nodes (INPUT_TYPES) just before the V3 port,
    # from ComfyUI v0.3.64; v0.8.0 and v0.33.0 sent the same for every field in it. Ids, names,
    # category, inputs in order with every type, default, range and step are the same in V3;
    # only the fields V3 adds (flags that are off) are new. Tooltips and descriptions are
    # reworded on purpose (test_object_info_matches_the_node_definitions holds them).
    expected = without_texts(V1_OBJECT_INFO[name])
    info = without_texts(as_v1(server.get_json(f"/object_info/{name}")[name]))
    assert {key: info.get(key) for key in expected} == expected
    assert info["input"]["required"] == expected["input"]["required"]  # the clearest diff


@pytest.mark.parametrize("name", PACK_NODES)
def test_object_info_matches_the_node_definitions(server: ComfyServer, name: str) -> None:
    spec = NODE_SPECS[name]
    info = as_v1(server.get_json(f"/object_info/{name}")[name])
    # Widget order is what saved workflows rely on: names in order, then types and options.
    assert list(info["input"]["required"]) == list(spec.inputs)
    assert info["input_order"]["required"] == list(spec.inputs)
    for input_name, (kind, options) in spec.inputs.items():
        assert info["input"]["required"][input_name] == [kind, options], input_name
    assert info["input"].get("hidden", {}) == {hidden: hidden.upper() for hidden in spec.hidden}
    assert info["output"] == list(spec.outputs)
    assert info["category"] == spec.category
    assert info["display_name"] == spec.display_name
    assert info["description"] == spec.description
    assert info["python_module"].endswith(PACK_FOLDER)


def test_template_browser_files(server: ComfyServer) -> None:
    # The list: keyed by the custom_nodes folder name, file names without .json (0.3.64 to
    # 0.33.0); the browser shows each under that name as its title. Every example, on every
    # version: ComfyUI lists the folder as it is, examples that need a later ComfyUI included
    # (tests/example_gate.py; their notes say which).
    templates = server.get_json("/api/workflow_templates")
    expected = sorted(path.stem for path in example_gate.example_files())
    assert expected, "the pack has no example workflows"
    assert sorted(templates.get(PACK_FOLDER, [])) == expected
    for stem in expected:
        path = f"/api/workflow_templates/{PACK_FOLDER}/{urllib.parse.quote(stem)}"
        served = server.get_json(f"{path}.json")
        assert served == json.loads((EXAMPLES / f"{stem}.json").read_text())
        # The thumbnail the browser asks for (frontends 1.27 to 1.49: <name>.jpg beside it).
        status, body = server.get(f"{path}.jpg")
        assert status == 200 and body.startswith(JPEG_MAGIC), (stem, status, body[:40])
    # The category's title comes from the pack's locales/ (keyed by the folder name).
    categories = server.get_json("/i18n")["en"]["templateWorkflows"]["category"]
    assert categories[PACK_FOLDER] == CATEGORY_TITLE


WEB = comfy_server.REPO_ROOT / "web"
LOCALES = comfy_server.REPO_ROOT / "locales"


@pytest.mark.parametrize("name", PACK_NODES)
def test_help_pages_are_served_where_the_frontend_looks(server: ComfyServer, name: str) -> None:
    # The frontend (1.27 to 1.49) fetches /extensions/<pack folder>/docs/<node>/<locale>.md,
    # then /extensions/<pack folder>/docs/<node>.md; pictures relative to .../docs/.
    base = f"/extensions/{PACK_FOLDER}/docs"
    for path, source in ((f"{name}.md", WEB / "docs" / f"{name}.md"),
                         (f"{name}/zh.md", WEB / "docs" / name / "zh.md")):
        status, body = server.get(f"{base}/{path}")
        assert status == 200 and body == source.read_bytes(), (path, status)
    assert server.get(f"{base}/{name}/en.md")[0] == 404  # English: the fallback page
    status, body = server.get(f"{base}/preview.png")
    assert status == 200 and body == (WEB / "docs" / "preview.png").read_bytes()


def test_translations_are_served(server: ComfyServer) -> None:
    # ComfyUI merges every pack's locales/<language>/{main,nodeDefs}.json into /i18n.
    served = server.get_json("/i18n")
    for language in ("en", "zh"):
        main = json.loads((LOCALES / language / "main.json").read_text(encoding="utf-8"))
        category = main["templateWorkflows"]["category"]
        assert served[language]["templateWorkflows"]["category"][PACK_FOLDER] == \
            category[PACK_FOLDER]
    node_defs = json.loads((LOCALES / "zh" / "nodeDefs.json").read_text(encoding="utf-8"))
    assert {name: served["zh"]["nodeDefs"][name] for name in PACK_NODES} == node_defs


SCALAR_WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN")
SEED_CONTROL_VALUES = ["fixed", "increment", "decrement", "randomize"]
DYNAMIC_COMBO = "COMFY_DYNAMICCOMBO_V3"  # V3 (ComfyUI 0.33): a combo whose options add inputs
Widget = tuple[str, Any, dict[str, Any]]  # name, kind (a scalar type or the combo's options), opts


def widgets(inputs: dict[str, Any], values: list[Any]) -> list[Widget]:
    """The widgets the frontend makes for a node with these /object_info inputs, in the order of
    a saved workflow's values: one per widget input (a combo, or a scalar that is not
    forceInput; a multi-type input by its widgetType), then the frontend's "control after
    generate" value for inputs that ask for it (seeds) and the upload button's value for image
    combos that take uploads (LoadImage), and right after a dynamic combo the
    widgets of the option its saved value picks. A hidden input still makes one (0.33's
    SaveVideo: filename_prefix, format, format.codec, then the hidden codec, in frontend 1.49)."""
    found: list[Widget] = []

    def walk(inputs: dict[str, Any]) -> None:
        for section in ("required", "optional"):
            for name, spec in (inputs.get(section) or {}).items():
                kind, options = spec[0], (spec[1] if len(spec) > 1 else {})
                if options.get("forceInput"):
                    continue
                kind = options.get("widgetType", kind)
                if kind == DYNAMIC_COMBO:
                    choices = {option["key"]: option["inputs"] for option in options["options"]}
                    found.append((name, list(choices), options))
                    picked = (values[len(found) - 1] if len(found) <= len(values)
                              else options.get("default", next(iter(choices))))
                    walk(choices.get(picked, {}))
                    continue
                if kind == "COMBO":  # V3 nodes: the options under "options"
                    kind = list(options.get("options", []))
                if isinstance(kind, list) or kind in SCALAR_WIDGET_TYPES:
                    found.append((name, kind, options))
                    if options.get("control_after_generate"):
                        found.append((f"{name}:control", SEED_CONTROL_VALUES, {}))
                    if options.get("image_upload"):     # the upload button saves a value too
                        found.append((f"{name}:upload", "STRING", {}))

    walk(inputs)
    return found


MODEL_FILE = re.compile(r"\.(safetensors|sft|ckpt|pt|pth|bin|gguf)$")
IMAGE_FILE = re.compile(r"\.(png|jpe?g|webp)$")


def fits(widget: Widget, value: Any) -> bool:
    """Whether a saved value fits its widget: a combo's option (a model file name is not one on
    this server, which has no models: any name of one; nor an image's name, where the combo takes
    uploads, in its empty input folder), a number in range, a boolean, a string."""
    _, kind, options = widget
    if isinstance(kind, list):
        file = MODEL_FILE if not options.get("image_upload") else IMAGE_FILE
        return value in kind or isinstance(value, str) and (
            MODEL_FILE.search(value) is not None or file.search(value) is not None)
    if kind in ("BOOLEAN", "STRING"):
        return isinstance(value, bool if kind == "BOOLEAN" else str)
    if isinstance(value, bool) or not isinstance(value, int if kind == "INT" else (int, float)):
        return False
    return options.get("min", value) <= value <= options.get("max", value)


@pytest.fixture(scope="module")
def node_info(server: ComfyServer) -> dict[str, Any]:
    return server.get_json("/object_info")


@pytest.mark.parametrize("example", example_gate.example_files(), ids=lambda path: path.stem)
def test_examples_fit_this_comfyuis_nodes(node_info: dict[str, Any], example: Path) -> None:
    # Every node an example uses exists here and gets a fitting value for each of its widgets;
    # below the example's minimum ComfyUI (tests/example_gate.py), its nodes are missing here.
    version = ch.comfy_version()
    if not example_gate.runs_here(example, version, node_info):
        return
    # Saved in the widget layout of the oldest ComfyUI the example runs on: there, exactly one
    # value per widget; later ComfyUIs may append widgets, which the frontend gives their
    # defaults (LTX-2's text encoder loader got `device` in 0.33, CreateVideo `bit_depth`).
    exact = version == example_gate.min_version(example)
    for node in json.loads(example.read_text())["nodes"]:
        if node["type"] in example_gate.FRONTEND_ONLY_NODES:
            continue
        assert node["type"] in node_info, f"node {node['id']}: no {node['type']} here"
        values = node.get("widgets_values", [])
        found = widgets(node_info[node["type"]]["input"], values)
        assert (len(values) == len(found)) if exact else (len(values) <= len(found)), (
            node["id"], values, [name for name, _, _ in found])
        for widget, value in zip(found, values, strict=False):  # the widgets may outnumber them
            assert fits(widget, value), (node["id"], node["type"], widget[0], value, widget[1:])


def test_prompt_runs_and_pushes_stats(server: ComfyServer) -> None:
    toma_inputs = {**NODE_SPECS["ToMA"].defaults(),
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

    # The stats reach the browser as ComfyUI's progress text of the ToMA node: once, for the
    # one sampling run. Ratio 0.5, some of the tiny SDXL's layers merged, both steps.
    texts = run.messages_of("progress_text")
    assert [message["node"] for message in texts] == [TOMA_ID], texts
    assert re.match(r"50% merged · [1-9]\d*/\d+ layers · 2/2 steps", texts[0]["text"]), texts

    # The V3 node's execute got every widget by name, and the hidden unique_id (which the stats
    # above were sent to) is the node's id in the graph.
    calls = comfy_server.recorded_calls(server, run.prompt_id)
    expected = {**toma_inputs, "model": "ModelPatcher"}
    assert calls == [{"prompt_id": run.prompt_id, "node": TOMA_ID, "node_type": "ToMA",
                      "unique_id": TOMA_ID, "inputs": expected}], calls


def test_speed_check_shows_its_results_on_the_node(server: ComfyServer) -> None:
    check_id = "9"
    check_inputs = {**NODE_SPECS["ToMASpeedCheck"].defaults(), "ratios": "0.25", "calls": 1}
    toma_inputs = {**NODE_SPECS["ToMA"].defaults(), "ratio": 0.5}
    run = comfy_server.run_prompt(server, comfy_server.speed_check_graph(
        check_id, check_inputs, toma_inputs, toma_id=TOMA_ID))
    assert run.history["status"]["status_str"] == "success", run.history["status"]
    sink = run.history["outputs"][comfy_server.SINK_ID]
    assert sink["finite"] == [True]
    (height, width), = [shape[1:3] for shape in sink["image_shape"]]
    assert sink["image_shape"][0][0] == 1 and sink["image_shape"][0][3] == 3 and width == 512

    # One text on the speed check, none on the ToMA node (the node samples its own variants):
    # a line per variant, ToMA's first, each ToMA variant merging.
    texts = run.messages_of("progress_text")
    assert [message["node"] for message in texts] == [check_id], texts
    lines = texts[0]["text"].split(LINE_BREAK)
    assert [line.split(":")[0] for line in lines] == [
        "ToMA 0.5 (connected)", "ToMA 0.25", "unmerged"], texts
    assert all(re.search(r" · [1-9]\d*/\d+ layers · ", line) for line in lines[:2]), lines
    # The ToMA node's output may come from ComfyUI's cache (an earlier test ran the same node).
    calls = [call for call in comfy_server.recorded_calls(server, run.prompt_id)
             if call["node_type"] == "ToMASpeedCheck"]
    assert calls == [{"prompt_id": run.prompt_id, "node": check_id, "node_type": "ToMASpeedCheck",
                      "unique_id": check_id, "inputs": {
                          **check_inputs, "model": "ModelPatcher", "positive": "list",
                          "latent": "dict"}}], calls


def test_unreadable_skip_blocks_is_refused_before_the_graph_runs(server: ComfyServer) -> None:
    # A UNet model does not use skip_blocks; the value is still checked, when queued.
    toma_inputs = {**NODE_SPECS["ToMA"].defaults(),
                   "skip_blocks": "d0-4, x9"}
    graph = comfy_server.tiny_sdxl_graph(TOMA_ID, toma_inputs)
    status, body = server.post("/prompt", {"prompt": graph, "client_id": "validation-test"})
    assert status == 400, body
    with pytest.raises(ValueError) as parser_error:
        parse_skip_blocks("d0-4, x9")
    errors = body["node_errors"][TOMA_ID]["errors"]
    # ComfyUI shows the message under every input the check takes, each name in front once
    # ("skip_blocks - skip_blocks: ..." before): the message names the widget at its end
    reason = str(parser_error.value).removeprefix("skip_blocks: ") + " (skip_blocks)"
    assert sorted((e["type"], e["details"]) for e in errors) == sorted(
        ("custom_validation_failed", f"{name} - {reason}") for name in ("skip_blocks", "ratio"))
    assert body["node_errors"][TOMA_ID]["class_type"] == "ToMA"


@pytest.mark.parametrize("node", ["ToMA", "ToMAAdvanced"])
def test_nan_ratio_is_refused_before_the_graph_runs(server: ComfyServer, node: str) -> None:
    """A ratio of "nan" passes ComfyUI's own min/max check (NaN compares false with both) and
    used to fail only at execution: refused when queued, with the widget named once."""
    inputs = {**NODE_SPECS[node].defaults(), "ratio": "nan"}
    graph = comfy_server.tiny_sdxl_graph(TOMA_ID, inputs, toma_type=node)
    status, body = server.post("/prompt", {"prompt": graph, "client_id": "validation-test"})
    assert status == 400, body
    errors = body["node_errors"][TOMA_ID]["errors"]
    assert sorted(error["details"] for error in errors) == sorted(
        f"{name} - ratio must be a number, got nan" for name in ("skip_blocks", "ratio"))
