"""Kandinsky 5 (comfy/ldm/kandinsky5, ComfyUI 0.8 and later): video (Kandinsky5) and image
(Kandinsky5Image) models of one class. The text runs through its own encoder blocks first
(never patched: text only); the visual blocks, one kind, attend over the image tokens only (the
text is cross-attention context), with RoPE over (t, h, w) and one modulation vector per batch
item. They get object patches of their forward, not "dit" replace patches: ComfyUI's block loop
has those, but its original_block calls the block with keywords it does not take (x=, context=;
a TypeError in ComfyUI 0.8 and 0.33), so no replace patch can run the block.

Image-to-video (Kandinsky5ImageToVideo): ComfyUI writes the clean start image latent
(`time_dim_replace`, its leading frames) over the input's latent channels before the visual
blocks: those frames' tokens are given, not generated, and never merge (as Wan's given
frames)."""

from __future__ import annotations

import math

import torch

from ..contracts import Contract, Gives
from ..dit_families import (
    VIDEO_REGION_FRAMES,
    BlockKind,
    Family,
    ShardKind,
    TextAt,
    latent_grid,
    set_grid,
)

MODELS = "Kandinsky 5"

# raylight hands each visual block a shard of the video tokens and their positional rows
KINDS = (BlockKind("double_block", "visual_transformer_blocks", "", TextAt.NONE,
                   stream="visual_embed", txt="text_embed", pe="freqs", hook="object",
                   shard=ShardKind()),)


KANDINSKY5 = "comfy.ldm.kandinsky5.model:Kandinsky5"

CONTRACT = Contract(
    "Kandinsky 5",
    models={KANDINSKY5: ()},
    needs=(Gives("comfy.model_base:Kandinsky5.extra_conds", ("time_dim_replace",),
                 what="conditioning"),),
    kinds=KINDS,
)


def family(diffusion_model) -> Family:
    patch = tuple(int(p) for p in diffusion_model.patch_size)

    def describe(call, base_model, arguments: dict) -> None:
        """The (t, h, w) grid of latent x ([B, C, H, W] for the image model: one frame), the
        leading frames `time_dim_replace` overwrites with the start image in front of it."""
        grid = latent_grid(arguments.get("x"), patch)
        set_grid(call, grid, protect_frames=replaced_frames(arguments.get("time_dim_replace"),
                                                            patch))

    return description(patch, describe)


def replaced_frames(replace: object, patch: tuple[int, int, int]) -> int:
    """Token frames of the input that a start image latent [B, C, T', H, W] overwrites
    (Kandinsky5's _forward writes it into x[:, :C, :T']): T' padded up to the patch; 0
    without one. Read from the shape: no host sync."""
    if not torch.is_tensor(replace) or replace.dim() != 5:
        return 0
    return math.ceil(int(replace.shape[2]) / patch[0])


def description(patch: tuple[int, int, int], describe=None) -> Family:
    return Family("kandinsky5", "Kandinsky 5", KINDS, patch, describe,
                  frames_per_region=VIDEO_REGION_FRAMES)
