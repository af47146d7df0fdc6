"""JoyImage (comfy/ldm/joyimage, ComfyUI 0.33 and later: JoyAI Image Edit): double-stream
blocks with "dit" replace patches; the image stream is [image; reference latents], the text
apart, attention over [image stream; text] with RoPE rows over the image stream alone."""

from __future__ import annotations

from ..contracts import Contract
from ..dit_families import BlockKind, Family, TextAt, describe_plain
from . import sets_patch

MODELS = "JoyImage"

KINDS = (BlockKind("double_block", "double_blocks", "", TextAt.AFTER, pe=None,
                   stream_pe=("pe",)),)

JOYIMAGE = "comfy.ldm.joyimage.model:JoyImageTransformer3DModel"

CONTRACT = Contract(
    "JoyImage",
    models={JOYIMAGE: (sets_patch(JOYIMAGE),)},
    blocks={KINDS[0].modules: ()},
    kinds=KINDS,
)


def description(patch: tuple[int, int, int]) -> Family:
    """The (t, h, w) grid of latent x [B, C, T, H, W]."""
    return Family("joyimage", "JoyImage", KINDS, patch, describe_plain(patch))
