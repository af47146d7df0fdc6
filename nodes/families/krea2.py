"""Krea 2 (comfy/ldm/krea2, ComfyUI 0.33 and later): one kind of single-stream block on [text;
image; reference images], object patches (no replace patches). "index_timestep_zero"
references get timestep zero's modulation from the position `timestep_zero_index`, which
moves with the merged image. A 5-D latent's frames are batch items to it: the grid is one
frame's."""

from __future__ import annotations

from ..contracts import Contract, Gives
from ..dit_families import BlockKind, Family, TextAt, latent_grid, set_grid
from . import patch_of, sets_patch

MODELS = "Krea 2"

KINDS = (BlockKind("block", "blocks", "", TextAt.STREAM_BEFORE, stream="x", txt=None, pe="freqs",
                   mask="mask", positions=("timestep_zero_index",), hook="object"),)

KREA2 = "comfy.ldm.krea2.model:SingleStreamDiT"

CONTRACT = Contract(
    "Krea 2",
    models={KREA2: (sets_patch(KREA2, ("patch",)),
                    Gives(f"{KREA2}._forward", ("img_slice",), what="transformer option",
                          why="how long the text in front of the image is"))},
    kinds=KINDS,
)


def family(diffusion_model) -> Family:
    return description(patch_of(diffusion_model.patch))


def description(patch: tuple[int, int, int]) -> Family:
    def describe(call, base_model, arguments: dict) -> None:
        """The (1, h, w) grid of latent x [B, C, H, W] or [B, C, T, H, W] (T frames each a
        batch item of their own)."""
        x = arguments.get("x")
        shape = None if x is None else (*x.shape[:2], *x.shape[-2:])
        set_grid(call, latent_grid(shape, patch))

    return Family("krea2", "Krea 2", KINDS, patch, describe)
