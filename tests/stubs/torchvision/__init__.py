"""Minimal CPU-test stand-in for torchvision (the PyPI wheels here are CUDA-linked and fail to
import against torch+cpu: `operator torchvision::nms does not exist`). Provides only the names
ComfyUI (v0.33, Aug 2026) imports at module level; anything not needed for tests raises."""
__version__ = "0.0.0-stub"
from . import models, ops, transforms  # noqa: F401
