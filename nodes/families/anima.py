"""Anima (comfy/ldm/anima, ComfyUI 0.33 and later): Cosmos Predict2's blocks (MiniTrainDIT),
an image model, object patches (no replace patches). The stream is the image grid alone,
[B, T, H, W, C]; the text is cross-attention context. The timestep modulation is one row per
latent frame: an image's one row is every merged token's."""

from __future__ import annotations

from ..contracts import Contract
from ..dit_families import BlockKind, Family, ShardKind, TextAt, latent_grid, set_grid
from . import sets_patch, unmerged

MODELS = "Anima"

# extra_per_block_pos_emb: Cosmos's learned positions per grid token, absent from Anima's
# checkpoints: a block handed them runs unmerged. raylight splits the image's rows over the
# GPUs (one frame: a contiguous span of the tokens) with their positional rows
KINDS = (BlockKind("block", "blocks", "", TextAt.NONE, stream="x_B_T_H_W_D", txt=None,
                   pe="rope_emb_L_1_1_D", opaque=("extra_per_block_pos_emb",), grid_axes=True,
                   hook="object", shard=ShardKind()),)

ANIMA = "comfy.ldm.anima.model:Anima"
COSMOS = "comfy.ldm.cosmos.predict2:MiniTrainDIT"

CONTRACT = Contract(
    "Anima",
    models={ANIMA: (sets_patch(COSMOS, ("patch_spatial", "patch_temporal")),)},
    kinds=KINDS,
)


def family(diffusion_model) -> Family:
    size = int(diffusion_model.patch_spatial)
    patch = (int(diffusion_model.patch_temporal), size, size)

    def describe(call, base_model, arguments: dict) -> str | None:
        """The (1, h, w) grid of latent x [B, C, 1, H, W]."""
        grid = latent_grid(arguments.get("x"), patch)
        if grid is not None and grid[0] != 1:
            return unmerged(call, f"an Anima call of {grid[0]} latent frames (its blocks "
                                  f"modulate each frame's tokens by the frame's row)")
        set_grid(call, grid)
        return None

    return Family("anima", "Anima", KINDS, patch, describe)
