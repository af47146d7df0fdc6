"""ToMA Token Merge: ComfyUI nodes that speed up SDXL and Flux by merging similar image tokens."""

from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
