"""HunyuanImage 2.1: ComfyUI builds it from HunyuanVideo's model class with 2-D patches over its
64-channel image latent (supported_models.HunyuanImage21), so its blocks, token layout and
contract are HunyuanVideo's: double blocks with text and image in two streams, then single
blocks on one sequence of both (image first where the double blocks are built flipped). The
text stream holds the refined Qwen2.5-VL states with the ByT5 glyph tokens appended: none of it
merges. Its refiner has 3-D patches and is a HunyuanVideo model to ToMA
(families/hunyuan_video.py)."""

from __future__ import annotations

import dataclasses

from ..dit_families import Family, latent_grid, set_grid
from .hunyuan_video import CONTRACT as HUNYUAN_VIDEO_CONTRACT
from .hunyuan_video import flipped, kinds

MODELS = "HunyuanImage 2.1"

CONTRACT = dataclasses.replace(HUNYUAN_VIDEO_CONTRACT, label="HunyuanImage 2.1")


def claims(diffusion_model) -> bool:
    """HunyuanVideo's class with 2-D patches (a model whose patches cannot be read goes to
    HunyuanVideo, whose checks say what is wrong)."""
    return len(getattr(diffusion_model, "patch_size", ())) == 2


def family(diffusion_model) -> Family:
    patch = (1, *(int(p) for p in diffusion_model.patch_size))

    def describe(call, base_model, arguments: dict) -> str | None:
        """The (1, h, w) grid of latent x [B, C, H, W]. A guiding frame index (an image-to-video
        input, not one of this model's) would modulate a fixed count of leading tokens of
        the single blocks' [text; image] sequence on their own, which a merged sequence would
        shift: such calls run unmerged."""
        if arguments.get("guiding_frame_index") is not None:
            call.mergeable = False
            return ("HunyuanImage with a guiding frame index modulates fixed token spans; those "
                    "model calls run unmerged")
        set_grid(call, latent_grid(arguments.get("x"), patch))
        return None

    return description(patch, flipped(diffusion_model), describe)


def description(patch: tuple[int, int, int], flipped: bool = False, describe=None) -> Family:
    """flipped: the image before the text."""
    return Family("hunyuan_image", "HunyuanImage 2.1", kinds(flipped), patch, describe)
