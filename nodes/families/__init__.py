"""The diffusion transformer families ToMA patches, one module each (descriptions only: the
patch is dit_patch.py). Each module's `family(diffusion_model)` gives its Family for the model
classes it knows, else None. Classes are matched exactly, not by isinstance: ComfyUI subclasses
these models for variants with other token layouts (S2V and Animate Wan, Chroma Radiance,
...), which must get the "not supported" error rather than a wrong merge.
"""

from __future__ import annotations

from ..dit_families import Family
from . import (
    flux,
    hidream,
    hunyuan_image,
    hunyuan_video,
    kandinsky5,
    ltx,
    lumina,
    qwen_image,
    sd3,
    wan,
)

MODULES = (flux, wan, qwen_image, hunyuan_video, hunyuan_image, sd3, lumina, ltx, hidream,
           kandinsky5)


def family_of(diffusion_model) -> Family | None:
    """The Family of a diffusion model, or None when ToMA does not support it."""
    for module in MODULES:
        found = module.family(diffusion_model)
        if found is not None:
            return found
    return None
