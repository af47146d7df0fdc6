"""HunyuanImage 2.1: HunyuanVideo's model class with 2-D patches (supported_models.HunyuanImage21),
so its blocks, token layout and contract are HunyuanVideo's. Its refiner has 3-D patches and is
a HunyuanVideo model to ToMA."""

from __future__ import annotations

import dataclasses

from ..dit_families import Family
from . import describe_latent, patch_of
from .hunyuan_video import CONTRACT as HUNYUAN_VIDEO_CONTRACT
from .hunyuan_video import flipped, kinds

MODELS = "HunyuanImage 2.1"

CONTRACT = dataclasses.replace(HUNYUAN_VIDEO_CONTRACT, label="HunyuanImage 2.1")


def claims(diffusion_model) -> bool:
    """HunyuanVideo's class with 2-D patches (a model whose patches cannot be read goes to
    HunyuanVideo, whose checks say what is wrong)."""
    return len(getattr(diffusion_model, "patch_size", ())) == 2


def family(diffusion_model) -> Family:
    return description(patch_of(diffusion_model.patch_size), flipped(diffusion_model))


def description(patch: tuple[int, int, int], flipped: bool = False) -> Family:
    """flipped: the image before the text. A guiding frame index (image-to-video) would
    modulate a fixed count of leading tokens on their own."""
    describe = describe_latent(patch, refusals=(("guiding_frame_index", "HunyuanImage with a "
                                                 "guiding frame index modulates fixed token "
                                                 "spans"),))
    return Family("hunyuan_image", "HunyuanImage 2.1", kinds(flipped), patch, describe)
