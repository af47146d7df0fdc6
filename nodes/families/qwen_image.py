"""Qwen-Image and Qwen-Image-Edit: one kind of block with text and image in two streams
(attention over [text; image]); edit references after the image never merge. With
"index_timestep_zero" (Edit 2511) ComfyUI's block loop hands the blocks the index where the
references start, beside the replace patch's arguments: it moves with the merged image."""

from __future__ import annotations

from ..contracts import Contract, Mentions, Takes
from ..dit_families import BlockKind, Family, ShardKind, TextAt, describe_plain
from . import TIMESTEP_ZERO_METHOD, conditioning, patch_of, positions_taken, with_references

MODELS = "Qwen-Image (and Edit)"

# the blocks' parameter where their forward modulates "index_timestep_zero" references apart
TIMESTEP_ZERO = "timestep_zero_index"
# raylight hands the blocks positional rows [image rows, text rows]
KINDS = (BlockKind("double_block", "transformer_blocks", "", TextAt.BEFORE,
                   positions=(TIMESTEP_ZERO,), shard=ShardKind(pe_item=0)),)
CONTRACT = Contract(
    "Qwen-Image",
    models={"comfy.ldm.qwen_image.model:QwenImageTransformer2DModel": (
        Takes("comfy.ldm.qwen_image.model:QwenImageTransformerBlock.forward", (TIMESTEP_ZERO,),
              when=Mentions("comfy.ldm.qwen_image.model", (TIMESTEP_ZERO_METHOD,)),
              why="where 'index_timestep_zero' references start, which ToMA moves"),
    )},
    needs=(conditioning("QwenImage", ("ref_latents",)),),
    blocks={"transformer_blocks": ("hidden_states", "encoder_hidden_states", "temb",
                                   "image_rotary_emb")},
    kinds=KINDS,
)


def family(diffusion_model) -> Family:
    """The (t, h, w) grid of latent x [B, C, T, H, W] (T: 1, or the layers of Qwen-Image Layered,
    each a frame); reference positions to move where its blocks take them."""
    block = type(diffusion_model.transformer_blocks[0])
    return description(patch_of(diffusion_model.patch_size),
                       positions_taken(KINDS, block.forward, TIMESTEP_ZERO),
                       getattr(diffusion_model, "default_ref_method", None))


def description(patch: tuple[int, int, int], kinds: tuple[BlockKind, ...] = KINDS,
                default_method: str | None = None) -> Family:
    return with_references(Family("qwen_image", "Qwen-Image", kinds, patch,
                                  describe_plain(patch)), default_method)
