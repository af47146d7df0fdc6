"""Wan 2.1 / 2.2 (text- and image-to-video, 14B and 5B): one kind of block; self-attention over
the video tokens only (the text is cross-attention context); per-frame modulation rows when the
model gives each latent frame its own timestep (Wan 2.2 image-to-video)."""

from __future__ import annotations

from ..dit_families import (
    VIDEO_REGION_FRAMES,
    BlockKind,
    Family,
    latent_grid,
    set_grid,
    zero_timestep_frames,
)

KINDS = (BlockKind("double_block", "blocks", "", "none", rows=("vec",)),)


def family(diffusion_model) -> Family | None:
    from comfy.ldm.wan.model import WanModel

    if type(diffusion_model) is not WanModel:
        return None
    patch = tuple(int(p) for p in diffusion_model.patch_size)

    def describe(call, base_model, arguments: dict) -> None:
        """The (t, h, w) grid of latent x (plus frames appended by time_dim_concat); a Wan Fun
        reference frame in front (ref_conv) and the leading frames a Wan 2.2 denoise mask keeps
        (the image-to-video start frame, timestep 0) never merge."""
        grid = latent_grid(arguments.get("x"), patch)
        extra = latent_grid(arguments.get("time_dim_concat"), patch)
        if grid is not None and extra is not None:
            grid = (grid[0] + extra[0], grid[1], grid[2])
        ref = (diffusion_model.ref_conv is not None
               and arguments.get("reference_latent") is not None and grid is not None)
        kept = zero_timestep_frames(call, arguments.get("denoise_mask"), grid[0]) if grid else 0
        set_grid(call, grid, prefix=grid[1] * grid[2] if ref else 0, protect_frames=kept)

    return description(patch, describe)


def description(patch: tuple[int, int, int], describe=None) -> Family:
    """Wan's Family (benchmarks call blocks without a model call to describe)."""
    return Family("wan", "Wan", KINDS, patch, describe, frames_per_region=VIDEO_REGION_FRAMES)
