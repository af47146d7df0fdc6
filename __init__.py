"""ToMA Token Merge: ComfyUI nodes that speed up SDXL and Flux by merging similar image tokens.

ComfyUI loads the nodes through comfy_entrypoint (its V3 node API). The module defines no
NODE_CLASS_MAPPINGS on purpose: ComfyUI would load those (V1) instead. NODE_SPECS holds the
nodes' definitions as plain data (for tests and benchmarks, which run without ComfyUI).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .nodes import NODE_SPECS

if TYPE_CHECKING:
    from comfy_api.latest import ComfyExtension

__all__ = ["NODE_SPECS", "WEB_DIRECTORY", "comfy_entrypoint"]

# Served at /extensions/<this folder>/: the nodes' help pages (web/docs/<node id>.md, and
# web/docs/<node id>/<locale>.md translated), which the frontend shows for a node.
WEB_DIRECTORY = "./web"


async def comfy_entrypoint() -> ComfyExtension:
    """The pack's nodes, for ComfyUI (nodes.v3 needs ComfyUI's comfy_api, so it is imported
    here: the package imports without ComfyUI)."""
    from .nodes.v3 import ToMAExtension

    return ToMAExtension()
