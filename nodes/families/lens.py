"""Lens (comfy/ldm/lens, ComfyUI 0.33 and later): double-stream blocks with "dit" replace
patches, attention over [image; text], one token a latent pixel (the latent's channels hold its
2x2 patches)."""

from __future__ import annotations

from ..contracts import Contract
from ..dit_families import BlockKind, Family, TextAt, describe_plain

MODELS = "Lens"

KINDS = (BlockKind("double_block", "transformer_blocks", "", TextAt.AFTER, mask="attn_mask",
                   mask_dims=(-1,)),)


CONTRACT = Contract(
    "Lens",
    models={"comfy.ldm.lens.model:LensTransformer2DModel": ()},
    blocks={KINDS[0].modules: ()},
    kinds=KINDS,
)


def family(diffusion_model) -> Family:
    """The (1, h, w) grid of latent x [B, C, H, W], one token a latent pixel."""
    return Family("lens", "Lens", KINDS, (1, 1, 1), describe_plain((1, 1, 1)))
