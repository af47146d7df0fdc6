"""Checks docs/workflows/raylight Wan text to video with ToMA.json: raylight's Wan 2.1 text to
video on 2 GPUs (Ulysses 2) with ToMA Token Merge (Ray) between its model loader and its sampler.

The workflow lives in docs/, not example_workflows/: the template browser would offer it to
users without raylight, where its nodes (and the Ray node, shown only where raylight is
installed) are missing. So tests/integration/test_server.py never loads it in a ComfyUI, and
this file checks what it can without one:
- the UI format and its links, with test_example_workflows.py's own checks;
- ToMA Token Merge (Ray)'s widget values against TOMA_RAY (the pack's definition);
- every raylight node's inputs, outputs and widget values against raylight's own INPUT_TYPES,
  RETURN_TYPES and RETURN_NAMES (raylight 1.5.1 in ../shared/peers/raylight), read from its
  source with `ast`: raylight's modules import ray, torch, yunchang and ComfyUI, so they are
  never imported here. Literal parts are evaluated; the few dropdowns filled at run time are
  read as what they hold: a file list (any model file name), ComfyUI's sampler and scheduler
  names (read the same way from ../shared/comfyui's trees, test_sampler_choices_are_comfyuis),
  yunchang's attention kinds (not installed here: the value must be raylight's default);
- the core nodes against the pack's examples, whose core nodes test_server.py checks on every
  ComfyUI version: same node types, inputs, outputs and widget counts;
- the graph: the sampler's RAY_ACTORS come through ToMARay from the loader, and its latent goes
  to the saved video; the note says what the graph is and where to read more.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest
from test_example_workflows import (
    check_value,
    load,
    nodes_by_id,
    widget_specs,
)
from test_example_workflows import test_links_are_consistent as check_links
from test_example_workflows import test_top_level_structure as check_structure

import example_gate
from toma_pack.nodes import NODE_SPECS
from toma_pack.nodes.options import make_options
from toma_pack.nodes.raylight_node import TOMA_RAY

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW_PATH = ROOT / "docs" / "workflows" / "raylight Wan text to video with ToMA.json"
MULTI_GPU_DOC = ROOT / "docs" / "multi-gpu.md"
RAYLIGHT_SRC = ROOT.parent / "shared" / "peers" / "raylight" / "src" / "raylight"
COMFYUI_TREES = ROOT.parent / "shared" / "comfyui"
NOTE_TYPES = {"Note", "MarkdownNote"}
SAMPLER = "XFuserKSamplerAdvanced"
# The RAY_ACTORS path from the sampler back to the Ray workers.
RAY_CHAIN = ["ToMARay", "RayModelSamplingSD3", "RayUNETLoader", "RayInitializer"]
# ComfyUI's folder_paths.supported_pt_extensions: what a file dropdown lists.
MODEL_FILE = re.compile(r"^[^/\\].*\.(safetensors|sft|ckpt|pt|pt2|pth|bin|pkl|gguf)$")
# Optional inputs of core nodes that this workflow leaves unconnected.
OPTIONAL_CORE_INPUTS = {("CreateVideo", "audio")}

FILES = "a model file name"        # folder_paths.get_filename_list(...): the user's files
SAMPLERS = "ComfyUI's sampler names"
SCHEDULERS = "ComfyUI's scheduler names"
DEFAULT_ONLY = "raylight's default"  # a list raylight builds from a package not installed here


@pytest.fixture(scope="module")
def workflow() -> dict:
    return load(WORKFLOW_PATH)


def links_by_id(workflow: dict) -> dict:
    return {link[0]: link for link in workflow["links"]}


def link_inputs(node: dict) -> list[tuple[str, str]]:
    """(name, type) of the inputs a node takes through links (widget inputs left out)."""
    return [(i["name"], i["type"]) for i in node.get("inputs", []) if not i.get("widget")]


def source(workflow: dict, node: dict, input_name: str) -> dict | None:
    """The node whose output feeds `node`'s input of that name; None where it is unconnected."""
    link_id = next(i for i in node["inputs"] if i["name"] == input_name)["link"]
    return None if link_id is None else nodes_by_id(workflow)[links_by_id(workflow)[link_id][1]]


# raylight's node definitions, read from its source -------------------------------------------
class RaylightNode:
    """One raylight node as its source defines it: inputs (name -> (kind, options), required
    then optional, in order; kind is an io type name, a list of choices, or one of FILES,
    SAMPLERS, SCHEDULERS, DEFAULT_ONLY), which of them are required, outputs and their names."""

    def __init__(self, node_id: str, cls: ast.ClassDef, classes: dict[str, ast.ClassDef]):
        self.node_id = node_id
        self.inputs: dict[str, tuple[object, dict]] = {}
        self.required: set[str] = set()
        method = class_member(cls, classes, "INPUT_TYPES")
        returned = [n.value for n in ast.walk(method) if isinstance(n, ast.Return)]
        assert len(returned) == 1 and isinstance(returned[0], ast.Dict), (
            f"{node_id}.INPUT_TYPES does not return one dict literal: read it again")
        for section, entries in zip(returned[0].keys, returned[0].values, strict=True):
            section_name = ast.literal_eval(section)
            if section_name == "hidden":
                continue
            assert section_name in ("required", "optional"), section_name
            assert isinstance(entries, ast.Dict), f"{node_id}: {section_name} is not a literal"
            for key, spec in zip(entries.keys, entries.values, strict=True):
                name = ast.literal_eval(key)
                assert isinstance(spec, ast.Tuple), f"{node_id}.{name}: {ast.unparse(spec)}"
                options = literal_options(spec.elts[1]) if len(spec.elts) > 1 else {}
                self.inputs[name] = (input_kind(node_id, name, spec.elts[0]), options)
                if section_name == "required":
                    self.required.add(name)
        self.outputs = tuple(class_constant(cls, classes, "RETURN_TYPES"))
        names = class_constant(cls, classes, "RETURN_NAMES", default=None)
        self.output_names = tuple(names) if names is not None else self.outputs

    def widget_inputs(self) -> dict[str, tuple[object, dict]]:
        """The inputs in widget_specs' notation: open dropdowns as a one-entry list naming what
        they hold (widget_specs keeps lists only), so that they stay widgets, in their place."""
        return {name: ([kind] if kind in (FILES, SAMPLERS, SCHEDULERS, DEFAULT_ONLY) else kind,
                       options) for name, (kind, options) in self.inputs.items()}

    def kind(self, widget: str) -> object:
        return self.inputs[widget][0]


def literal_options(node: ast.expr) -> dict:
    """A widget's options dict, keeping the entries whose values are literals."""
    assert isinstance(node, ast.Dict), ast.unparse(node)
    options = {}
    for key, value in zip(node.keys, node.values, strict=True):
        try:
            options[ast.literal_eval(key)] = ast.literal_eval(value)
        except ValueError:
            pass
    return options


def input_kind(node_id: str, name: str, node: ast.expr) -> object:
    """An input's type: a name, a list of choices, or what a dropdown filled at run time holds.
    Anything else fails, naming the input: a raylight update wrote something new there."""
    text = ast.unparse(node)
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        try:
            return list(ast.literal_eval(node))
        except ValueError:
            pass
    if "get_filename_list" in text and all(
            "get_filename_list" in ast.unparse(call) for call in ast.walk(node)
            if isinstance(call, ast.Call)):
        return FILES
    if text.endswith("KSampler.SAMPLERS"):
        return SAMPLERS
    if text.endswith("KSampler.SCHEDULERS"):
        return SCHEDULERS
    if re.fullmatch(r"\[member\.name for member in AttnType\]", text):
        return DEFAULT_ONLY
    raise AssertionError(f"cannot read raylight's {node_id}.{name}: {text}")


def class_member(cls: ast.ClassDef, classes: dict[str, ast.ClassDef], name: str) -> ast.AST:
    """The class body's definition of `name`, or its base classes' (raylight's own)."""
    for statement in cls.body:
        if isinstance(statement, ast.FunctionDef) and statement.name == name:
            return statement
        if isinstance(statement, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in statement.targets):
            return statement.value
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            return class_member(classes[base.id], classes, name)
    raise KeyError(f"{cls.name} has no {name}")


def class_constant(cls: ast.ClassDef, classes: dict[str, ast.ClassDef], name: str,
                   **default: object) -> object:
    """A class attribute's literal value (a tuple's non-literal items as their source text,
    e.g. raylight's any_type); `default` where neither the class nor its bases set it."""
    try:
        node = class_member(cls, classes, name)
    except KeyError:
        if "default" in default:
            return default["default"]
        raise
    if isinstance(node, ast.Tuple):
        return tuple(literal_or_text(item) for item in node.elts)
    return ast.literal_eval(node)


def literal_or_text(node: ast.expr) -> object:
    try:
        return ast.literal_eval(node)
    except ValueError:
        return ast.unparse(node)


class Raylight:
    """raylight's registered nodes (each module's NODE_CLASS_MAPPINGS literal) by node id; a
    node's definition is read when it is asked for (`raylight[node_id]`), so only the nodes this
    workflow uses must be readable."""

    def __init__(self, src: Path):
        self.classes: dict[str, tuple[ast.ClassDef, dict[str, ast.ClassDef]]] = {}
        self.specs: dict[str, RaylightNode] = {}
        for path in sorted(src.rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
            for statement in tree.body:
                if (isinstance(statement, ast.Assign) and isinstance(statement.value, ast.Dict)
                        and any(isinstance(t, ast.Name) and t.id == "NODE_CLASS_MAPPINGS"
                                for t in statement.targets)):
                    for key, value in zip(statement.value.keys, statement.value.values,
                                          strict=True):
                        if isinstance(value, ast.Name) and value.id in classes:
                            self.classes[ast.literal_eval(key)] = (classes[value.id], classes)

    def __contains__(self, node_id: str) -> bool:
        return node_id in self.classes

    def __getitem__(self, node_id: str) -> RaylightNode:
        if node_id not in self.specs:
            self.specs[node_id] = RaylightNode(node_id, *self.classes[node_id])
        return self.specs[node_id]


@pytest.fixture(scope="module")
def raylight() -> Raylight:
    if not RAYLIGHT_SRC.is_dir():
        pytest.skip(f"raylight's source is not here ({RAYLIGHT_SRC})")
    nodes = Raylight(RAYLIGHT_SRC)
    for node_id in ("RayInitializer", "RayUNETLoader", SAMPLER):
        assert node_id in nodes, f"raylight registers no {node_id}"
    return nodes


def comfyui_sampler_names(tree: Path) -> tuple[list[str], list[str]]:
    """ComfyUI's KSampler.SAMPLERS and SCHEDULERS in one source tree, read with ast:
    KSAMPLER_NAMES + the list SAMPLER_NAMES adds, and SCHEDULER_HANDLERS' keys."""
    module = ast.parse((tree / "comfy" / "samplers.py").read_text(encoding="utf-8"))
    assigned = {t.id: s.value for s in module.body if isinstance(s, ast.Assign)
                for t in s.targets if isinstance(t, ast.Name)}
    samplers = list(ast.literal_eval(assigned["KSAMPLER_NAMES"]))
    extra = assigned["SAMPLER_NAMES"]
    assert isinstance(extra, ast.BinOp) and ast.unparse(extra.left) == "KSAMPLER_NAMES"
    samplers += ast.literal_eval(extra.right)
    schedulers = [ast.literal_eval(key) for key in assigned["SCHEDULER_HANDLERS"].keys]
    return samplers, schedulers


# The file --------------------------------------------------------------------------------------
def test_ui_format(workflow):
    check_structure(workflow)


def test_links_are_consistent(workflow):
    check_links(workflow)


def test_kept_out_of_the_template_browser():
    assert WORKFLOW_PATH.is_file()
    assert WORKFLOW_PATH not in example_gate.example_files()
    assert not (example_gate.EXAMPLES_DIR / WORKFLOW_PATH.name).exists()


def test_the_multi_gpu_page_links_it():
    text = MULTI_GPU_DOC.read_text(encoding="utf-8")
    section = text.split("## ToMA inside raylight", 1)[1].split("\n## ", 1)[0]
    assert "(workflows/raylight%20Wan%20text%20to%20video%20with%20ToMA.json)" in section


def test_every_node_is_raylights_the_packs_or_core(workflow, raylight):
    core = core_nodes_in_the_packs_examples()
    for node in workflow["nodes"]:
        kind = node["type"]
        assert (kind in raylight or kind == TOMA_RAY.node_id or kind in core
                or kind in NOTE_TYPES), f"node {node['id']}: unknown type {kind}"
        assert kind not in NODE_SPECS, f"node {node['id']}: {kind} takes MODEL, not RAY_ACTORS"


# ToMA Token Merge (Ray) ----------------------------------------------------------------------
def test_toma_ray_widgets_fit_and_are_the_defaults(workflow):
    (node,) = [n for n in workflow["nodes"] if n["type"] == TOMA_RAY.node_id]
    specs = widget_specs(TOMA_RAY.inputs)
    values = node["widgets_values"]
    assert len(values) == len(specs), (
        f"{len(values)} widget values for {[name for name, _, _ in specs]}")
    for (name, kind, options), value in zip(specs, values, strict=True):
        check_value(f"ToMARay.{name}", kind, options, value)
    defaults = TOMA_RAY.defaults()
    assert values == [defaults[name] for name, _, _ in specs]
    make_options(*values)
    assert link_inputs(node) == [("ray_actors", "RAY_ACTORS")]
    assert [o["type"] for o in node["outputs"]] == list(TOMA_RAY.outputs)


# raylight's nodes ----------------------------------------------------------------------------
def test_raylight_nodes_fit_raylights_inputs(workflow, raylight):
    used = [n for n in workflow["nodes"] if n["type"] in raylight]
    assert {n["type"] for n in used} >= {"RayInitializer", "RayUNETLoader", SAMPLER}
    for node in used:
        spec = raylight[node["type"]]
        label = f"node {node['id']} ({node['type']})"
        widgets = widget_specs(spec.widget_inputs())
        widget_names = {name for name, _, _ in widgets}
        expected_links = [(name, kind) for name, (kind, _) in spec.inputs.items()
                          if name not in widget_names]
        assert link_inputs(node) == expected_links, label
        assert [(o["name"], o["type"]) for o in node["outputs"]] == list(
            zip(spec.output_names, spec.outputs, strict=True)), label
        values = node.get("widgets_values", [])
        assert len(values) == len(widgets), (
            f"{label}: {len(values)} widget values for {[name for name, _, _ in widgets]}")
        for (name, kind, options), value in zip(widgets, values, strict=True):
            what = spec.kind(name) if name in spec.inputs else None
            where = f"{node['type']}.{name}"
            if what == FILES:
                assert isinstance(value, str) and MODEL_FILE.match(value), f"{where}={value!r}"
            elif what in (SAMPLERS, SCHEDULERS):
                assert isinstance(value, str) and value, f"{where}={value!r}"
            elif what == DEFAULT_ONLY:
                assert value == options["default"], f"{where}={value!r}: {options['default']!r}"
            else:
                check_value(where, kind, options, value)


def test_sampler_choices_are_comfyuis(workflow, raylight):
    trees = sorted(p for p in COMFYUI_TREES.glob("*") if (p / "comfy" / "samplers.py").is_file())
    if not trees:
        pytest.skip(f"no ComfyUI source tree in {COMFYUI_TREES}")
    for node in (n for n in workflow["nodes"] if n["type"] in raylight):
        spec = raylight[node["type"]]
        names = [name for name, _, _ in widget_specs(spec.widget_inputs())]
        for name, value in zip(names, node["widgets_values"], strict=True):
            what = spec.kind(name) if name in spec.inputs else None
            if what not in (SAMPLERS, SCHEDULERS):
                continue
            for tree in trees:
                samplers, schedulers = comfyui_sampler_names(tree)
                assert value in (samplers if what == SAMPLERS else schedulers), (
                    f"{node['type']}.{name}={value!r} is not among {what} in {tree.name}")


def test_raylight_inputs_are_connected(workflow, raylight):
    for node in (n for n in workflow["nodes"] if n["type"] in raylight):
        for input_ in node.get("inputs", []):
            if input_["name"] in raylight[node["type"]].required:
                assert input_["link"] is not None, f"{node['type']}.{input_['name']}"


def test_two_gpus_split_the_tokens(workflow, raylight):
    (node,) = [n for n in workflow["nodes"] if n["type"] == "RayInitializer"]
    names = [name for name, _, _ in widget_specs(raylight["RayInitializer"].widget_inputs())]
    values = dict(zip(names, node["widgets_values"], strict=True))
    assert (values["GPU"], values["ulysses_degree"]) == (2, 2)
    assert values["ring_degree"] == values["cfg_degree"] == 1   # the tokens split, not CFG
    assert values["FSDP"] is False      # each GPU holds the whole model


# Core nodes ----------------------------------------------------------------------------------
@cache
def core_nodes_in_the_packs_examples() -> dict[str, dict]:
    """Each core node type the pack's examples use (test_server.py checks them in every
    ComfyUI), as the first example that has it writes it."""
    found: dict[str, dict] = {}
    for path in example_gate.example_files():
        for node in load(path)["nodes"]:
            if node["type"] not in NODE_SPECS and node["type"] not in NOTE_TYPES:
                found.setdefault(node["type"], node)
    return found


def test_core_nodes_as_the_packs_examples_use_them(workflow, raylight):
    core = core_nodes_in_the_packs_examples()
    used = [n for n in workflow["nodes"]
            if n["type"] not in raylight and n["type"] != TOMA_RAY.node_id
            and n["type"] not in NOTE_TYPES]
    assert {n["type"] for n in used} >= {"CLIPLoader", "CLIPTextEncode", "VAELoader",
                                         "VAEDecode", "SaveVideo"}
    for node in used:
        label = f"node {node['id']} ({node['type']})"
        assert node["type"] in core, f"{label}: no example of the pack uses it"
        known = core[node["type"]]
        assert link_inputs(node) == link_inputs(known), label
        assert [o["type"] for o in node["outputs"]] == [o["type"] for o in known["outputs"]]
        assert len(node["widgets_values"]) == len(known["widgets_values"]), label
        for input_ in node.get("inputs", []):
            if (node["type"], input_["name"]) not in OPTIONAL_CORE_INPUTS:
                assert input_["link"] is not None, f"{label}: {input_['name']}"


# The graph -----------------------------------------------------------------------------------
def test_ray_actors_reach_the_sampler_through_toma_ray(workflow):
    (sampler,) = [n for n in workflow["nodes"] if n["type"] == SAMPLER]
    chain, node = [], sampler
    while node["type"] != "RayInitializer":
        name = "ray_actors_init" if node["type"] == "RayUNETLoader" else "ray_actors"
        node = source(workflow, node, name)
        assert node is not None, f"{chain}: the RAY_ACTORS path breaks"
        chain.append(node["type"])
    assert chain == RAY_CHAIN
    # ToMARay between the loader and the sampler: after the model is loaded, before sampling
    assert chain.index("ToMARay") < chain.index("RayUNETLoader")


def test_the_video_is_saved_from_the_sampler(workflow):
    (save,) = [n for n in workflow["nodes"] if n["type"] == "SaveVideo"]
    video = source(workflow, save, "video")
    assert video["type"] == "CreateVideo"
    decode = source(workflow, video, "images")
    assert decode["type"] == "VAEDecode"
    assert source(workflow, decode, "samples")["type"] == SAMPLER
    (sampler,) = [n for n in workflow["nodes"] if n["type"] == SAMPLER]
    assert source(workflow, sampler, "latent_image")["type"] == "EmptyHunyuanLatentVideo"
    assert source(workflow, sampler, "positive")["type"] == "CLIPTextEncode"
    assert source(workflow, sampler, "negative")["type"] == "CLIPTextEncode"


def test_the_note_explains(workflow):
    notes = [n["widgets_values"][0] for n in workflow["nodes"] if n["type"] in NOTE_TYPES]
    assert len(notes) == 1
    (note,) = notes
    for needed in ("raylight", "Ray", "ToMA Token Merge (Ray)", "Load Diffusion Model (Ray)",
                   "ulysses_degree", "CFG 1", "CFG split", "docs/multi-gpu.md"):
        assert needed in note, needed
