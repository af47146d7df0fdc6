"""Mage-Flow (comfy/ldm/mage_flow, ComfyUI 0.33 and later): Qwen-Image's double-stream blocks
on one latent pixel a token (attention over [text; image]); edit references
(TextEncodeMageFlowEdit's) after the image never merge."""

from __future__ import annotations

from ..contracts import Contract
from ..dit_families import BlockKind, Family, TextAt, describe_plain
from . import sets_patch

MODELS = "Mage-Flow (and Edit)"

KINDS = (BlockKind("double_block", "transformer_blocks", "", TextAt.BEFORE),)

MAGE_FLOW = "comfy.ldm.mage_flow.model:MageFlowTransformer2DModel"
# ComfyUI's MageFlow model class derives from QwenImage's, whose forward raylight puts on it
RAYLIGHT_REFUSAL = ("raylight runs its Qwen-Image forward on Mage-Flow, whose timestep "
                    "embedding takes other arguments")

CONTRACT = Contract(
    "Mage-Flow",
    models={MAGE_FLOW: (sets_patch(MAGE_FLOW),)},
    blocks={KINDS[0].modules: ()},
    kinds=KINDS,
)


def description(patch: tuple[int, int, int]) -> Family:
    """The (1, h, w) grid of latent x [B, C, H, W]."""
    return Family("mage_flow", "Mage-Flow", KINDS, patch, describe_plain(patch),
                  sequence_parallel_refusal=RAYLIGHT_REFUSAL)
