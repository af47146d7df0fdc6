"""WanDancer (comfy/ldm/wan/model_wandancer, ComfyUI 0.33 and later): Wan 2.1's block loop and
token layout (WanDancerVideo conditions it as WanImageToVideo does: the start frames the
concatenated mask gives never merge), with music injected into the video's tokens between the
blocks, where they are whole again. Read as Wan reads its models (families/wan.py); its
blocks run unmerged under raylight's sequence parallelism, whose forward is Wan's own."""

from __future__ import annotations

import dataclasses

from ..contracts import Contract
from ..dit_families import Family
from . import wan

MODELS = "WanDancer"

KINDS = tuple(dataclasses.replace(kind, shard=None) for kind in wan.KINDS)

DANCER = "comfy.ldm.wan.model_wandancer:WanDancerModel"

CONTRACT = Contract(
    "WanDancer",
    models={DANCER: ()},
    needs=wan.CONTRACT.needs,
    blocks=wan.CONTRACT.blocks,
    kinds=KINDS,
)


def family(diffusion_model) -> Family:
    return dataclasses.replace(wan.family(diffusion_model), name="wan_dancer", label="WanDancer",
                               kinds=KINDS)
