"""The pack's nodes in ComfyUI's V3 node API (comfy_api.latest), built from their plain
definitions (node_spec.NodeSpec), with only what comfy_api.latest has in ComfyUI v0.3.64, the
oldest version the pack supports. Only comfy_entrypoint imports it (it needs ComfyUI).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from comfy_api.latest import ComfyExtension, io

from .node_spec import NodeSpec
from .options import MAX_RATIO, check_number, parse_skip_blocks
from .preview_node import PREVIEW, render_preview
from .raylight_node import TOMA_RAY, patch_ray_actors, raylight_installed
from .speed_check import SPEED_CHECK, speed_check
from .toma_node import TOMA, TOMA_ADVANCED, patch_model

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
        # a list of choices is a dropdown
        inputs=[io.Combo.Input(name, options=list(kind), **options) if isinstance(kind, list)
                else IO_TYPES[kind].Input(name, **options)
                for name, (kind, options) in spec.inputs.items()],
        outputs=[IO_TYPES[kind].Output() for kind in spec.outputs],
        hidden=[io.Hidden[name] for name in spec.hidden],
    )


class _PackNode(io.ComfyNode):
    """A node whose schema comes from its definition (SPEC), and which runs RUN with its inputs
    by name and the hidden values SPEC names. Never registered itself: ComfyUI caches schema
    fields on the class it is asked about, and a registered parent would hand its cache to its
    subclasses."""

    SPEC: ClassVar[NodeSpec]
    RUN: ClassVar[Callable[..., Any]]

    @classmethod
    def define_schema(cls) -> io.Schema:
        return schema(cls.SPEC)

    @classmethod
    def execute(cls, **inputs: Any) -> io.NodeOutput:
        hidden = {name: getattr(cls.hidden, name) for name in cls.SPEC.hidden}
        return io.NodeOutput(cls.RUN(**inputs, **hidden))


class _TokenMergeNode(_PackNode):
    """ToMA, ToMAAdvanced and ToMARay: the same widgets checked at queue time."""

    @classmethod
    def validate_inputs(cls, skip_blocks: str | None = None,
                        ratio: float | None = None) -> bool | str:
        """ComfyUI's check when the workflow is queued: an unreadable skip_blocks fails it on
        every model (a typo should not wait for a transformer to surface), and so does a NaN
        ratio (ComfyUI leaves the range check of the inputs a node validates to the node); a
        linked value (None) is checked by make_options when the node runs. A message names the
        widget inside, not first: ComfyUI shows it after each validated input's name."""
        try:
            if ratio is not None:
                check_number("ratio", ratio, 0.0, MAX_RATIO)
            if skip_blocks is not None:
                parse_skip_blocks(skip_blocks)
        except ValueError as error:
            message = str(error)
            if message.startswith("skip_blocks: "):
                return f"{message.removeprefix('skip_blocks: ')} (skip_blocks)"
            return message
        return True


def pack_node(spec: NodeSpec, base: type[_PackNode], run: Callable[..., Any]) -> type[_PackNode]:
    """The class ComfyUI loads for node `spec`, named by its id: `base` running `run`."""
    return type(spec.node_id, (base,), {"SPEC": spec, "RUN": staticmethod(run),
                                        "__doc__": spec.description})


ToMA = pack_node(TOMA, _TokenMergeNode, patch_model)
ToMAAdvanced = pack_node(TOMA_ADVANCED, _TokenMergeNode, patch_model)
ToMAPreview = pack_node(PREVIEW, _PackNode, render_preview)
ToMARay = pack_node(TOMA_RAY, _TokenMergeNode, patch_ray_actors)
# its output is the chart; the timings are shown on the node as text
ToMASpeedCheck = pack_node(SPEED_CHECK, _PackNode, lambda **inputs: speed_check(**inputs)[1])


class ToMAExtension(ComfyExtension):
    """What the pack's comfy_entrypoint hands ComfyUI: the Ray node only where raylight is
    installed (its RAY_ACTORS come from no other pack)."""

    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        nodes = [ToMA, ToMAAdvanced, ToMAPreview, ToMASpeedCheck]
        return [*nodes, ToMARay] if raylight_installed() else nodes
