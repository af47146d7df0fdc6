"""The pack's nodes in ComfyUI's V3 node API (comfy_api.latest), built from their plain
definitions (node_spec.NodeSpec in toma_node.py and preview_node.py).

This module needs ComfyUI to import: the pack's __init__.py imports it from comfy_entrypoint,
which only ComfyUI calls, so the rest of the pack imports without ComfyUI. It uses only what
ComfyUI v0.3.64, the oldest version the pack supports, has in comfy_api.latest: Schema's
node_id, display_name, category, description, inputs, outputs and hidden; Model, Image, Float,
Int, String, Boolean, Conditioning, Latent and Combo inputs with default, min, max, step,
multiline, options and tooltip; Hidden.unique_id; NodeOutput; ComfyExtension.get_node_list.
"""

from __future__ import annotations

from typing import Any, ClassVar

from comfy_api.latest import ComfyExtension, io

from .node_spec import NodeSpec
from .preview_node import PREVIEW, render_preview
from .raylight_node import TOMA_RAY, patch_ray_actors, raylight_installed
from .speed_check import SPEED_CHECK, speed_check
from .toma_node import TOMA, TOMA_ADVANCED, check_inputs, patch_model

IO_TYPES: dict[str, type[io.ComfyTypeIO]] = {
    "MODEL": io.Model, "IMAGE": io.Image, "FLOAT": io.Float, "INT": io.Int,
    "STRING": io.String, "BOOLEAN": io.Boolean, "CONDITIONING": io.Conditioning,
    "LATENT": io.Latent, "RAY_ACTORS": io.Custom("RAY_ACTORS"),
}


def schema(spec: NodeSpec) -> io.Schema:
    """The V3 schema of a node definition: same id, names, inputs in the same order with the
    same options, same outputs and hidden values."""
    return io.Schema(
        node_id=spec.node_id,
        display_name=spec.display_name,
        category=spec.category,
        description=spec.description,
        inputs=[schema_input(name, kind, options) for name, (kind, options) in spec.inputs.items()],
        outputs=[IO_TYPES[kind].Output() for kind in spec.outputs],
        hidden=[io.Hidden[name] for name in spec.hidden],
    )


def schema_input(name: str, kind: str | list[str], options: dict[str, Any]) -> io.Input:
    """One input: a dropdown for a list of choices, else the io type of that name."""
    if isinstance(kind, list):
        return io.Combo.Input(name, options=list(kind), **options)
    return IO_TYPES[kind].Input(name, **options)


class _PackNode(io.ComfyNode):
    """A node whose schema comes from its definition. Never registered itself: ComfyUI caches
    schema fields on the class it is asked about, and a registered parent would hand its
    cache to its subclasses."""

    SPEC: ClassVar[NodeSpec]

    @classmethod
    def define_schema(cls) -> io.Schema:
        return schema(cls.SPEC)


class _TokenMergeNode(_PackNode):
    """ToMA and ToMAAdvanced: one implementation, two sets of widgets."""

    @classmethod
    def validate_inputs(cls, skip_blocks: str | None = None,
                        ratio: float | None = None) -> bool | str:
        """Refuse an unreadable skip_blocks and a NaN ratio when the workflow is queued (see
        toma_node.check_inputs)."""
        return check_inputs(skip_blocks, ratio)

    @classmethod
    def execute(cls, model: Any, ratio: float, tile_count: int, skip_blocks: str,
                recompute_every: int, **advanced: Any) -> io.NodeOutput:
        return io.NodeOutput(patch_model(model, ratio, tile_count, skip_blocks, recompute_every,
                                         cls.hidden.unique_id, **advanced))


class ToMA(_TokenMergeNode):
    """Token merging with the measured defaults."""

    SPEC = TOMA


class ToMAAdvanced(_TokenMergeNode):
    """Token merging with every setting exposed."""

    SPEC = TOMA_ADVANCED


class ToMAPreview(_PackNode):
    """Preview of tiles, destinations and assignments over an image."""

    SPEC = PREVIEW

    @classmethod
    def execute(cls, image: Any, ratio: float, tile_count: int, level: str) -> io.NodeOutput:
        return io.NodeOutput(render_preview(image, ratio, tile_count, level))


class ToMASpeedCheck(_PackNode):
    """Time per model call unmerged and with ToMA, on this machine."""

    SPEC = SPEED_CHECK

    @classmethod
    def execute(cls, model: Any, positive: Any, latent: dict, ratios: str,
                calls: int) -> io.NodeOutput:
        _, chart = speed_check(model, positive, latent, ratios, calls, cls.hidden.unique_id)
        return io.NodeOutput(chart)


class ToMARay(_PackNode):
    """ToMA on every GPU of a raylight graph (RAY_ACTORS in and out)."""

    SPEC = TOMA_RAY
    validate_inputs = _TokenMergeNode.validate_inputs

    @classmethod
    def execute(cls, ray_actors: Any, ratio: float, tile_count: int, skip_blocks: str,
                recompute_every: int) -> io.NodeOutput:
        return io.NodeOutput(patch_ray_actors(ray_actors, ratio, tile_count, skip_blocks,
                                              recompute_every))


class ToMAExtension(ComfyExtension):
    """What the pack's comfy_entrypoint hands ComfyUI: the Ray node only where raylight is
    installed (its RAY_ACTORS come from no other pack)."""

    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        nodes = [ToMA, ToMAAdvanced, ToMAPreview, ToMASpeedCheck]
        return [*nodes, ToMARay] if raylight_installed() else nodes
