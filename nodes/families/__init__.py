"""The diffusion transformer families ToMA patches, one module each (descriptions only: the
patch is dit_patch.py). Each module's `family(diffusion_model)` gives its Family for the model
classes it knows, else None. Classes are matched exactly, not by isinstance: ComfyUI subclasses
these models for variants with other token layouts (S2V and Animate 2 Wan, Chroma Radiance,
...), which must get the "not supported" error rather than a wrong merge.
"""

from __future__ import annotations

from ..dit_families import Family
from . import (
    flux,
    hidream,
    hidream_o1,
    hunyuan_image,
    hunyuan_video,
    kandinsky5,
    ltx,
    lumina,
    qwen_image,
    sd3,
    wan,
)

MODULES = (flux, wan, hunyuan_video, hunyuan_image, qwen_image, sd3, lumina, ltx, hidream,
           hidream_o1, kandinsky5)
UNET_MODELS = "SDXL, SD1.5 and SD2 (ComfyUI's UNet)"


def supported_models() -> str:
    """Every model the node supports, as its error names them: the UNet ones, then each
    family's."""
    names = [UNET_MODELS, *(module.MODELS for module in MODULES)]
    return ", ".join(names[:-1]) + " and " + names[-1]


# Models of these classes share a supported family's blocks but are left alone, and the error
# says why (classes by name: some exist only in some ComfyUI versions).
NOT_MERGED = {
    "WanAnimate2Model": "Wan Animate 2's self-attention splits the video's queries frame by "
                        "frame, each frame attending its own pose frame; merged tokens span "
                        "frames",
    "WanModel_S2V": "Wan S2V spreads its timestep rows over the sequence by position (with "
                    "motion frames two a frame plus three, across video, reference and motion "
                    "tokens), so a shorter merged sequence would hand tokens other rows",
    "HumoWanModel": "HuMo's audio cross-attention cuts the video's tokens into equal parts, one "
                    "a frame, and WanHuMoImageToVideo always appends a reference frame (zeros "
                    "without a reference image) that must not merge, so merged frames could "
                    "not be equal parts",
}


def not_merged_reason(diffusion_model) -> str | None:
    """Why a known model class is left alone, or None."""
    return NOT_MERGED.get(type(diffusion_model).__name__)


def family_of(diffusion_model) -> Family | None:
    """The Family of a diffusion model, or None when ToMA does not support it."""
    for module in MODULES:
        found = module.family(diffusion_model)
        if found is not None:
            return found
    return None
