"""Checks the UI-format workflows in example_workflows/ (they appear in ComfyUI's template browser).

Every workflow must parse, have consistent links, give this pack's nodes widget values that fit
their current inputs (widget values are stored by position, so a reordered or retyped widget
breaks these files), explain itself in a note, and come with a title (its file name) and a
thumbnail (<name>.jpg, made by tests/integration/example_thumbnails.py). That the core nodes
they use exist, with these widget counts, is checked against each ComfyUI version's own node
list in tests/integration/test_server.py; an example that needs a later ComfyUI than the pack's
floor is named in tests/example_gate.py, and says so in its note.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from PIL import Image

import example_gate
from toma_pack.nodes import NODE_SPECS

EXAMPLES_DIR = example_gate.EXAMPLES_DIR
EXAMPLE_FILES = example_gate.example_files()
EXPECTED_EXAMPLES = {
    "SDXL text to image.json",
    "Flux dev text to image.json",
    "SDXL hires fix.json",
    "Wan 2.2 text to video.json",
    "Qwen-Image text to image.json",
    "LTX-2 text to video.json",
    "HiDream-O1 text to image.json",
    "MiniMax H3 image to video.json",
    "Flux schnell in 4 steps.json",
    "SDXL with EasyCache.json",
}
# The template browser shows the file name as the title: words, not an identifier.
TITLE = re.compile(r"^[A-Z0-9][\w.()+,-]*( [\w.()+,-]+)+$")
THUMBNAIL_SIDE = 256  # at least, square: ComfyUI's cards are square

TOMA_TYPES = {"ToMA", "ToMAAdvanced"}
SEED_CONTROL_VALUES = {"fixed", "increment", "decrement", "randomize"}
SCALAR_WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN"}
NON_WIDGET_NODE_TYPES = {"Note", "MarkdownNote", "Reroute"}
OPTIONAL_SHAPE = 7  # how the frontend saves an optional input (drawn hollow)


def load(path: Path) -> dict:
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def nodes_by_id(workflow: dict) -> dict:
    return {node["id"]: node for node in workflow["nodes"]}


def widget_specs(inputs: dict) -> list[tuple[str, object, dict]]:
    """(name, type or combo list, options) for each widget of a node's inputs, in the order the
    frontend makes them; the seed-style control_after_generate value appears as its own
    ("<name>:control") entry."""
    specs = []
    for name, spec in inputs.items():
        kind = spec[0]
        opts = dict(spec[1]) if len(spec) > 1 and isinstance(spec[1], dict) else {}
        if opts.get("forceInput"):
            continue
        if kind == "COMBO":
            kind = list(opts.get("options", []))
        if isinstance(kind, (list, tuple)):
            specs.append((name, list(kind), opts))
        elif str(kind) in SCALAR_WIDGET_TYPES:
            specs.append((name, str(kind), opts))
            if opts.get("control_after_generate"):
                specs.append((f"{name}:control", sorted(SEED_CONTROL_VALUES), {}))
    return specs


def check_value(name: str, kind, opts: dict, value) -> None:
    if isinstance(kind, list):
        assert value in kind, f"{name}={value!r} is not one of {kind}"
        return
    if kind == "BOOLEAN":
        assert isinstance(value, bool), f"{name}={value!r} should be a boolean"
        return
    if kind == "STRING":
        assert isinstance(value, str), f"{name}={value!r} should be a string"
        return
    if kind == "INT":
        assert isinstance(value, int) and not isinstance(value, bool), (
            f"{name}={value!r} should be an integer"
        )
    else:  # FLOAT
        assert isinstance(value, (int, float)) and not isinstance(value, bool), (
            f"{name}={value!r} should be a number"
        )
        assert math.isfinite(value), f"{name}={value!r} should be finite"
    if "min" in opts:
        assert value >= opts["min"], f"{name}={value!r} is below min {opts['min']}"
    if "max" in opts:
        assert value <= opts["max"], f"{name}={value!r} is above max {opts['max']}"


def test_expected_examples_exist():
    names = {path.name for path in EXAMPLE_FILES}
    assert EXPECTED_EXAMPLES <= names, f"missing: {sorted(EXPECTED_EXAMPLES - names)}"


def test_pack_exports_toma():
    assert "ToMA" in NODE_SPECS


@pytest.fixture(params=EXAMPLE_FILES, ids=[path.name for path in EXAMPLE_FILES])
def workflow(request) -> dict:
    return load(request.param)


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=[path.name for path in EXAMPLE_FILES])
def test_title_and_thumbnail(path: Path):
    assert TITLE.match(path.stem), f"{path.name}: the file name is the title users see"
    thumbnail = path.with_suffix(".jpg")
    assert thumbnail.is_file(), f"no thumbnail {thumbnail.name}: run example_thumbnails.py"
    with Image.open(thumbnail) as image:
        assert image.format == "JPEG"
        assert image.width == image.height >= THUMBNAIL_SIDE, image.size


def test_every_thumbnail_belongs_to_an_example():
    stems = {path.stem for path in EXAMPLE_FILES}
    assert {path.stem for path in EXAMPLES_DIR.glob("*.jpg")} <= stems


def test_top_level_structure(workflow):
    for key in ("last_node_id", "last_link_id", "nodes", "links", "version"):
        assert key in workflow, key
    assert isinstance(workflow["nodes"], list) and workflow["nodes"]
    assert isinstance(workflow["links"], list)
    ids = [node["id"] for node in workflow["nodes"]]
    assert len(ids) == len(set(ids)), "duplicate node ids"
    assert all(isinstance(i, int) for i in ids)
    assert workflow["last_node_id"] >= max(ids)
    link_ids = [link[0] for link in workflow["links"]]
    assert len(link_ids) == len(set(link_ids)), "duplicate link ids"
    if link_ids:
        assert workflow["last_link_id"] >= max(link_ids)
    for node in workflow["nodes"]:
        for key in ("id", "type", "pos", "size", "flags", "order", "mode", "properties"):
            assert key in node, f"node {node.get('id')} lacks {key}"
        assert len(node["pos"]) == 2 and len(node["size"]) == 2
        assert isinstance(node.get("inputs", []), list)
        assert isinstance(node.get("outputs", []), list)
        assert isinstance(node.get("widgets_values", []), list)


def test_links_are_consistent(workflow):
    nodes = nodes_by_id(workflow)
    links = {}
    for link in workflow["links"]:
        assert len(link) == 6, link
        link_id, src, src_slot, dst, dst_slot, link_type = link
        links[link_id] = link
        assert src in nodes, f"link {link_id}: no source node {src}"
        assert dst in nodes, f"link {link_id}: no target node {dst}"
        outputs = nodes[src].get("outputs") or []
        inputs = nodes[dst].get("inputs") or []
        assert 0 <= src_slot < len(outputs), f"link {link_id}: no output slot {src_slot}"
        assert 0 <= dst_slot < len(inputs), f"link {link_id}: no input slot {dst_slot}"
        output, input_ = outputs[src_slot], inputs[dst_slot]
        assert link_id in (output.get("links") or []), f"link {link_id} missing from output"
        assert input_.get("link") == link_id, f"link {link_id} missing from input"
        assert output["type"] == link_type == input_["type"], (
            f"link {link_id}: {output['type']} -> {link_type} -> {input_['type']}"
        )

    # And the other way round: every link id a node mentions exists and points back.
    for node in workflow["nodes"]:
        for slot, input_ in enumerate(node.get("inputs") or []):
            link_id = input_.get("link")
            if link_id is not None:
                assert link_id in links, f"node {node['id']} input {input_['name']}: {link_id}"
                assert links[link_id][3:5] == [node["id"], slot]
        for slot, output in enumerate(node.get("outputs") or []):
            for link_id in output.get("links") or []:
                assert link_id in links, f"node {node['id']} output {output['name']}: {link_id}"
                assert links[link_id][1:3] == [node["id"], slot]


def test_required_inputs_are_connected(workflow):
    for node in workflow["nodes"]:
        if node["type"] in NON_WIDGET_NODE_TYPES:
            continue
        for input_ in node.get("inputs") or []:
            if input_.get("widget") or input_.get("shape") == OPTIONAL_SHAPE:
                continue
            assert input_.get("link") is not None, (
                f"node {node['id']} ({node['type']}) input {input_['name']} is not connected"
            )


def test_pack_node_widgets_fit_their_inputs(workflow):
    pack_nodes = [node for node in workflow["nodes"] if node["type"] in NODE_SPECS]
    assert any(node["type"] in TOMA_TYPES for node in pack_nodes), "example without a ToMA node"
    for node in pack_nodes:
        specs = widget_specs(NODE_SPECS[node["type"]].inputs)
        values = node.get("widgets_values", [])
        assert len(values) == len(specs), (
            f"node {node['id']} ({node['type']}): {len(values)} widget values for "
            f"{[name for name, _, _ in specs]}"
        )
        for (name, kind, opts), value in zip(specs, values, strict=True):
            check_value(f"{node['type']}.{name}", kind, opts, value)


def test_toma_widget_layout_is_the_published_one():
    # Saved workflows store widget values by position: this order must never change.
    names = [name for name, _, _ in widget_specs(NODE_SPECS["ToMA"].inputs)]
    assert names[:4] == ["ratio", "tile_count", "skip_blocks", "recompute_every"]


def test_ksampler_widgets(workflow):
    for node in workflow["nodes"]:
        if node["type"] != "KSampler":
            continue
        seed, control, steps, cfg, sampler, scheduler, denoise = node["widgets_values"]
        assert isinstance(seed, int) and seed >= 0
        assert control in SEED_CONTROL_VALUES
        assert isinstance(steps, int) and steps >= 1
        assert isinstance(cfg, (int, float)) and 0 <= cfg <= 100
        assert isinstance(sampler, str) and isinstance(scheduler, str)
        assert isinstance(denoise, (int, float)) and 0 < denoise <= 1


def test_every_example_has_a_note(workflow):
    notes = [n for n in workflow["nodes"] if n["type"] in {"Note", "MarkdownNote"}]
    assert notes, "each example explains itself in a note"
    assert all(
        isinstance(n["widgets_values"][0], str) and "ToMA" in n["widgets_values"][0] for n in notes
    )


def _model_source(nodes: dict, links: dict, node: dict) -> dict:
    input_ = next(i for i in node["inputs"] if i["name"] == "model")
    return nodes[links[input_["link"]][1]]


def test_hires_fix_merges_only_the_large_pass():
    workflow = load(EXAMPLES_DIR / "SDXL hires fix.json")
    nodes = nodes_by_id(workflow)
    links = {link[0]: link for link in workflow["links"]}
    samplers = [n for n in workflow["nodes"] if n["type"] == "KSampler"]
    assert len(samplers) == 2
    first = next(n for n in samplers if n["widgets_values"][6] == 1.0)
    second = next(n for n in samplers if n["widgets_values"][6] < 1.0)
    assert _model_source(nodes, links, first)["type"] == "CheckpointLoaderSimple"
    assert _model_source(nodes, links, second)["type"] in TOMA_TYPES
    latent = next(i for i in second["inputs"] if i["name"] == "latent_image")
    assert nodes[links[latent["link"]][1]]["type"] == "LatentUpscaleBy"


@pytest.mark.parametrize(
    ("name", "latent_type"),
    [
        ("SDXL text to image.json", "EmptyLatentImage"),
        ("Flux dev text to image.json", "EmptySD3LatentImage"),
    ],
)
def test_txt2img_examples_sample_through_toma_at_1024(name, latent_type):
    workflow = load(EXAMPLES_DIR / name)
    nodes = nodes_by_id(workflow)
    links = {link[0]: link for link in workflow["links"]}
    (sampler,) = [n for n in workflow["nodes"] if n["type"] == "KSampler"]
    assert _model_source(nodes, links, sampler)["type"] in TOMA_TYPES
    (latent,) = [n for n in workflow["nodes"] if n["type"] == latent_type]
    assert latent["widgets_values"][:2] == [1024, 1024]


@pytest.mark.parametrize(("name", "sampler_type", "count"), [
    ("Wan 2.2 text to video.json", "KSamplerAdvanced", 2),   # high- and low-noise model
    ("Qwen-Image text to image.json", "KSampler", 1),
    ("LTX-2 text to video.json", "CFGGuider", 1),  # SamplerCustomAdvanced takes the guider
    ("HiDream-O1 text to image.json", "KSampler", 1),
    ("MiniMax H3 image to video.json", "BasicGuider", 1),  # and its BasicScheduler, below
])
def test_dit_examples_sample_every_model_through_toma(name, sampler_type, count):
    workflow = load(EXAMPLES_DIR / name)
    nodes = nodes_by_id(workflow)
    links = {link[0]: link for link in workflow["links"]}
    samplers = [n for n in workflow["nodes"] if n["type"] == sampler_type]
    assert len(samplers) == count
    assert all(_model_source(nodes, links, s)["type"] in TOMA_TYPES for s in samplers)
    schedulers = [n for n in workflow["nodes"] if n["type"] == "BasicScheduler"]
    assert all(_model_source(nodes, links, s)["type"] in TOMA_TYPES for s in schedulers)
    # one kind of block in both families: skip_blocks in plain indices
    toma = [n for n in workflow["nodes"] if n["type"] in TOMA_TYPES]
    assert all(n["widgets_values"][2] == "0-4" for n in toma)


@pytest.mark.parametrize("stem", sorted(example_gate.MIN_COMFYUI))
def test_gated_examples_exist_and_say_which_comfyui_they_need(stem: str):
    # A user of an older ComfyUI still finds the example in the template browser: its note says
    # why its nodes are missing there.
    path = EXAMPLES_DIR / f"{stem}.json"
    assert path in EXAMPLE_FILES, f"tests/example_gate.py names no example: {stem}"
    version = example_gate.min_version(path)
    assert version > example_gate.FLOOR, f"{stem}: runs on every supported ComfyUI, ungate it"
    notes = [n["widgets_values"][0] for n in load(path)["nodes"] if n["type"] == "MarkdownNote"]
    needs = f"Needs ComfyUI {example_gate.version_text(version)} or later"
    assert any(needs in note for note in notes), needs


def test_ltx2_example_size_and_frame_rates():
    # The size the LTX-2 benchmark (docs/benchmarks.md) measures; the frame rate is given
    # three times and
    # LTX-2 needs the three to agree (conditioning, audio length, the saved video).
    workflow = load(EXAMPLES_DIR / "LTX-2 text to video.json")
    by_type = {n["type"]: n["widgets_values"] for n in workflow["nodes"]}
    width, height, frames, batch = by_type["EmptyLTXVLatentVideo"]
    assert (width, height, frames, batch) == (768, 512, 121, 1)
    assert width % 32 == height % 32 == 0 and frames % 8 == 1
    audio_frames, audio_rate, _ = by_type["LTXVEmptyLatentAudio"]
    assert audio_frames == frames
    assert by_type["LTXVConditioning"][0] == audio_rate == by_type["CreateVideo"][0]


def test_hidream_o1_example_size_and_model_chain():
    # The size the HiDream-O1 benchmark (docs/benchmarks.md) measures, and the model path of
    # ComfyUI's own
    # HiDream-O1 template (noise scale, seam smoothing) with ToMA in front of the sampler.
    workflow = load(EXAMPLES_DIR / "HiDream-O1 text to image.json")
    nodes = nodes_by_id(workflow)
    links = {link[0]: link for link in workflow["links"]}
    by_type = {n["type"]: n for n in workflow["nodes"]}
    width, height, batch = by_type["EmptyHiDreamO1LatentImage"]["widgets_values"]
    assert (width, height, batch) == (2048, 2048, 1)
    chain, node = [], by_type["KSampler"]
    while any(i["name"] == "model" for i in node.get("inputs", [])):
        node = _model_source(nodes, links, node)
        chain.append(node["type"])
    assert chain == ["ToMA", "HiDreamO1PatchSeamSmoothing", "ModelNoiseScale",
                     "CheckpointLoaderSimple"]
