"""Qwen-Image and Qwen-Image-Edit: one kind of block with text and image in two streams
(attention over [text; image]); edit reference images are appended after the image tokens and
never merge. References with "index_timestep_zero" (Qwen-Image-Edit 2511) get timestep zero's
modulation from the token index where the image ends, which ComfyUI's block loop hands the
block beside the replace patch's arguments: ToMA moves it with the merged image."""

from __future__ import annotations

import dataclasses
import inspect

from ..contracts import Contract, Gives, Mentions, Takes
from ..dit_families import BlockKind, Family, ShardKind, TextAt, describe_plain

MODELS = "Qwen-Image (and Edit)"

# The block forward's parameter holding where the references start in the image stream, in
# ComfyUI versions whose Qwen-Image modulates "index_timestep_zero" references on their own.
TIMESTEP_ZERO = "timestep_zero_index"
# raylight hands the blocks positional rows [image rows, text rows]
KINDS = (BlockKind("double_block", "transformer_blocks", "", TextAt.BEFORE,
                   positions=(TIMESTEP_ZERO,), shard=ShardKind(pe_item=0)),)

QWEN_IMAGE = "comfy.ldm.qwen_image.model:QwenImageTransformer2DModel"
_SEPARATE_MODULATION = Mentions("comfy.ldm.qwen_image.model", ("index_timestep_zero",))

CONTRACT = Contract(
    "Qwen-Image",
    models={QWEN_IMAGE: (
        Takes("comfy.ldm.qwen_image.model:QwenImageTransformerBlock.forward", (TIMESTEP_ZERO,),
              when=_SEPARATE_MODULATION,
              why="where 'index_timestep_zero' references start, which ToMA moves"),
    )},
    needs=(Gives("comfy.model_base:QwenImage.extra_conds", ("ref_latents",),
                 what="conditioning"),),
    blocks={"transformer_blocks": ("hidden_states", "encoder_hidden_states", "temb",
                                   "image_rotary_emb")},
    kinds=KINDS,
)


def family(diffusion_model) -> Family:
    """The (t, h, w) grid of latent x [B, C, T, H, W] (T: 1, or the layers of Qwen-Image Layered,
    each a frame); reference positions to move where its blocks take them."""
    patch = (1, int(diffusion_model.patch_size), int(diffusion_model.patch_size))
    takes = TIMESTEP_ZERO in inspect.signature(
        type(diffusion_model.transformer_blocks[0]).forward).parameters
    return description(patch, describe_plain(patch), KINDS if takes else tuple(
        dataclasses.replace(kind, positions=()) for kind in KINDS))


def description(patch: tuple[int, int, int], describe=None, kinds=KINDS) -> Family:
    return Family("qwen_image", "Qwen-Image", kinds, patch, describe)
