"""ERNIE-Image (comfy/ldm/ernie, ComfyUI 0.33 and later): one kind of single-stream block on
[image; text], called without replace patches or transformer_options: ToMA patches each
block's forward, which finds its model call as the one in flight on its thread."""

from __future__ import annotations

from ..contracts import Contract
from ..dit_families import BlockKind, Family, TextAt, describe_plain
from . import sets_patch

MODELS = "ERNIE-Image"

# ComfyUI's loop never hands its blocks an attention mask: one given would address fixed spans
KINDS = (BlockKind("layer", "layers", "", TextAt.STREAM_AFTER, stream="x", txt=None,
                   pe="rotary_pos_emb", opaque=("attention_mask",), hook="object",
                   takes_options=False),)

ERNIE = "comfy.ldm.ernie.model:ErnieImageModel"

CONTRACT = Contract(
    "ERNIE-Image",
    models={ERNIE: (sets_patch(ERNIE),)},
    kinds=KINDS,
)


def description(patch: tuple[int, int, int]) -> Family:
    """The (1, h, w) grid of latent x [B, C, H, W]."""
    return Family("ernie", "ERNIE-Image", KINDS, patch, describe_plain(patch))
