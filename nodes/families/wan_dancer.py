"""WanDancer (ComfyUI 0.33 and later): Wan 2.1's block loop and token layout, read as Wan
reads its models (WanDancerVideo conditions it as WanImageToVideo does), with music injected
into the video's tokens between the blocks, where they are whole again. Its blocks run unmerged
under raylight's sequence parallelism, whose forward is Wan's own."""

from __future__ import annotations

import dataclasses

from ..dit_families import Family
from . import wan

MODELS = "WanDancer"

KINDS = tuple(dataclasses.replace(kind, shard=None) for kind in wan.KINDS)

DANCER = "comfy.ldm.wan.model_wandancer:WanDancerModel"

CONTRACT = dataclasses.replace(wan.CONTRACT, label="WanDancer", models={DANCER: ()}, kinds=KINDS)


def family(diffusion_model) -> Family:
    return dataclasses.replace(wan.family(diffusion_model), name="wan_dancer", label="WanDancer",
                               kinds=KINDS)
