"""Test-only ComfyUI node pack: a tiny SDXL source, a test picture and sinks, for tests/integration,
and a recording of what the ToMA pack's nodes receive when they run.

ComfyUI loads this folder as a custom node pack only inside test_server.py's temporary base
directory (comfy_server.py links it there); it is never part of the ToMA pack. No VAE, no
weights on disk: the model is comfy_harness's random-weight tiny SDXL, built in the server.

The recording: GET /toma_test/calls?prompt_id=<id> lists, for every run of a ToMA, ToMAAdvanced
or ToMAPreview node in that prompt, the node's id, the hidden unique_id ComfyUI gave it (None
where the node asks for none) and the inputs its V3 `execute` was called with (numbers, text
and booleans as they are, anything else by its type name).
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from aiohttp import web
from comfy_execution.utils import get_executing_context
from server import PromptServer  # ComfyUI's own modules: this pack only ever runs inside it

RECORDED_NODES = ("ToMA", "ToMAAdvanced", "ToMAPreview", "ToMASpeedCheck")
_calls: list[dict[str, Any]] = []

# ComfyUI imports this file through a symlink: resolve it to find the harness beside it.
_HARNESS_FILE = Path(__file__).resolve().parent.parent / "comfy_harness.py"
_HARNESS_NAME = "toma_test_server_harness"


def _harness() -> ModuleType:
    """comfy_harness under a private name (no sys.path change inside the server)."""
    if _HARNESS_NAME not in sys.modules:
        spec = importlib.util.spec_from_file_location(_HARNESS_NAME, _HARNESS_FILE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[_HARNESS_NAME] = module
        spec.loader.exec_module(module)
        # It warns that it cannot force CPU mode once ComfyUI is imported: the server already
        # runs with --cpu.
        logging.getLogger(_HARNESS_NAME).setLevel(logging.ERROR)
    return sys.modules[_HARNESS_NAME]


class ToMATestTinySDXL:
    """Tiny random-weight SDXL with matching conditioning and an empty latent."""

    @classmethod
    def INPUT_TYPES(cls) -> dict:  # noqa: N802 (ComfyUI's name)
        return {"required": {
            # 64x64 latent: the outer attention level has 32x32 = 1024 tokens, where ToMA's
            # "auto" levels start merging.
            "latent_size": ("INT", {"default": 64, "min": 8, "max": 256, "step": 8}),
            "seed": ("INT", {"default": 0, "min": 0, "max": 2**31 - 1}),
        }}

    RETURN_TYPES = ("MODEL", "CONDITIONING", "CONDITIONING", "LATENT")
    RETURN_NAMES = ("model", "positive", "negative", "latent")
    FUNCTION = "build"
    CATEGORY = "testing/ToMA"

    def build(self, latent_size: int, seed: int) -> tuple:
        harness = _harness()
        model = harness.tiny_sdxl_patcher(seed)
        pixels = latent_size * 8
        positive, negative = harness.sdxl_conds(1, pixels, pixels, seed=seed)
        latent = harness.empty_latent(model, 1, latent_size, latent_size)
        return model, positive, negative, {"samples": latent}


class ToMATestLatentSink:
    """Output node: reports the sampled latent's shape and whether it is finite."""

    @classmethod
    def INPUT_TYPES(cls) -> dict:  # noqa: N802 (ComfyUI's name)
        return {"required": {"samples": ("LATENT",)}}

    RETURN_TYPES = ()
    FUNCTION = "report"
    OUTPUT_NODE = True
    CATEGORY = "testing/ToMA"

    def report(self, samples: dict) -> dict:
        latent = samples["samples"]
        # UI values are lists: ComfyUI concatenates them across list-mapped executions.
        return {"ui": {"latent_shape": [list(latent.shape)],
                       "finite": [bool(torch.isfinite(latent).all())]}}


class ToMATestImage:
    """A smooth colour picture (no file on disk), e.g. for ToMAPreview."""

    @classmethod
    def INPUT_TYPES(cls) -> dict:  # noqa: N802 (ComfyUI's name)
        return {"required": {
            "width": ("INT", {"default": 256, "min": 16, "max": 2048, "step": 8}),
            "height": ("INT", {"default": 256, "min": 16, "max": 2048, "step": 8}),
        }}

    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "draw"
    CATEGORY = "testing/ToMA"

    def draw(self, width: int, height: int) -> tuple:
        y = torch.linspace(0, 1, height).view(-1, 1, 1).expand(height, width, 1)
        x = torch.linspace(0, 1, width).view(1, -1, 1).expand(height, width, 1)
        return (torch.cat([y, x, x * y], -1).unsqueeze(0),)


class ToMATestImageSink:
    """Output node: reports the image's shape and whether it is finite."""

    @classmethod
    def INPUT_TYPES(cls) -> dict:  # noqa: N802 (ComfyUI's name)
        return {"required": {"images": ("IMAGE",)}}

    RETURN_TYPES = ()
    FUNCTION = "report"
    OUTPUT_NODE = True
    CATEGORY = "testing/ToMA"

    def report(self, images: torch.Tensor) -> dict:
        return {"ui": {"image_shape": [list(images.shape)],
                       "finite": [bool(torch.isfinite(images).all())]}}


NODE_CLASS_MAPPINGS = {
    "ToMATestTinySDXL": ToMATestTinySDXL,
    "ToMATestLatentSink": ToMATestLatentSink,
    "ToMATestImage": ToMATestImage,
    "ToMATestImageSink": ToMATestImageSink,
}


def _describe(value: Any) -> Any:
    return value if isinstance(value, (bool, int, float, str)) else type(value).__name__


def _record_calls_of(node_type: str, node_class: type) -> None:
    """Wrap the V3 node class's execute so that each call's inputs are kept."""
    execute = node_class.execute.__func__

    def recorded(cls: type, **inputs: Any) -> Any:
        context = get_executing_context()
        _calls.append({"prompt_id": context.prompt_id, "node": context.node_id,
                       "node_type": node_type, "unique_id": cls.hidden.unique_id,
                       "inputs": {name: _describe(value) for name, value in inputs.items()}})
        return execute(cls, **inputs)

    recorded.records_calls = True
    node_class.execute = classmethod(recorded)


def _record_pack_nodes(json_data: dict) -> dict:
    """PromptServer's on-prompt handler: on the first prompt (every pack is loaded by then,
    whatever their import order) start recording the pack's nodes' calls."""
    import nodes  # ComfyUI's node registry

    for node_type in RECORDED_NODES:
        node_class = nodes.NODE_CLASS_MAPPINGS.get(node_type)
        if node_class is not None and not getattr(node_class.execute, "records_calls", False):
            _record_calls_of(node_type, node_class)
    return json_data


@PromptServer.instance.routes.get("/toma_test/calls")
async def recorded_calls(request: web.Request) -> web.Response:
    prompt_id = request.query.get("prompt_id")
    return web.json_response([call for call in _calls
                              if prompt_id is None or call["prompt_id"] == prompt_id])


PromptServer.instance.add_on_prompt_handler(_record_pack_nodes)
