"""Kandinsky 5 (comfy/ldm/kandinsky5, ComfyUI 0.8 and later): video and image models of one
class. Its visual blocks, one kind, attend over the image tokens only (the text runs through its
own blocks first, unpatched, then is cross-attention context). They get object patches of
their forward: the "dit" replace patches' original_block calls the block with keywords it does
not take (x=, context=). The start image's frames (`time_dim_replace`) never merge."""

from __future__ import annotations

import torch

from ..contracts import Contract
from ..dit_families import (
    VIDEO_REGION_FRAMES,
    BlockKind,
    Family,
    ShardKind,
    TextAt,
    latent_grid,
    set_grid,
)
from . import conditioning

MODELS = "Kandinsky 5"

# raylight hands each visual block a shard of the video tokens and their positional rows
KINDS = (BlockKind("double_block", "visual_transformer_blocks", "", TextAt.NONE,
                   stream="visual_embed", txt="text_embed", pe="freqs", hook="object",
                   shard=ShardKind()),)

CONTRACT = Contract(
    "Kandinsky 5",
    models={"comfy.ldm.kandinsky5.model:Kandinsky5": ()},
    needs=(conditioning("Kandinsky5", ("time_dim_replace",)),),
    kinds=KINDS,
)


def replaced_frames(replace: object, patch: tuple[int, int, int]) -> int:
    """Token frames a start image latent [B, C, T', H, W] overwrites (x[:, :C, :T'] in
    Kandinsky5's _forward), from its shape; 0 without one."""
    return latent_grid(replace, patch)[0] if torch.is_tensor(replace) and replace.dim() == 5 else 0


def description(patch: tuple[int, int, int]) -> Family:
    def describe(call, base_model, arguments: dict) -> None:
        """The (t, h, w) grid of latent x ([B, C, H, W] for the image model: one frame), the
        leading frames `time_dim_replace` overwrites with the start image in front of it."""
        grid = latent_grid(arguments.get("x"), patch)
        set_grid(call, grid, protect_frames=replaced_frames(arguments.get("time_dim_replace"),
                                                            patch))

    return Family("kandinsky5", "Kandinsky 5", KINDS, patch, describe,
                  frames_per_region=VIDEO_REGION_FRAMES)
