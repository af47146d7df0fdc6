"""Wan 2.1 / 2.2 (text- and image-to-video, 14B and 5B): one kind of block; self-attention over
the video tokens only (the text is cross-attention context); per-frame modulation rows when the
model gives each latent frame its own timestep (Wan 2.2 5B image-to-video).

Image-to-video frames never merge: the start frame the denoise mask keeps (Wan 2.2 5B) and the
frames the concatenated mask marks as given (Wan 2.1 and Wan 2.2 A14B image-to-video, first and
last frame: the leading ones). Merging the given start frame's tokens with generated ones blurs
what the video takes from the start image: on the tiny Wan 2.1 image-to-video model (2 steps,
ratio 0.5) the change of the output between two start images moved 0.74 relative with that
frame merged, 0.065 with it kept (tests/integration/test_dit_families.py,
test_wan_start_image_dependence)."""

from __future__ import annotations

import torch

from ..dit_families import (
    VIDEO_REGION_FRAMES,
    BlockKind,
    Family,
    given_frames,
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
        (the image-to-video start frame, timestep 0) and the leading frames the concatenated
        mask gives never merge."""
        grid = latent_grid(arguments.get("x"), patch)
        extra = latent_grid(arguments.get("time_dim_concat"), patch)
        if grid is not None and extra is not None:
            grid = (grid[0] + extra[0], grid[1], grid[2])
        ref = (diffusion_model.ref_conv is not None
               and arguments.get("reference_latent") is not None and grid is not None)
        kept = 0
        if grid is not None:
            kept = max(zero_timestep_frames(call, arguments.get("denoise_mask"), grid[0]),
                       given_frames(call, concat_mask(arguments.get("c_concat"),
                                                      arguments.get("x"))))
        set_grid(call, grid, prefix=grid[1] * grid[2] if ref else 0, protect_frames=kept)

    return description(patch, describe)


def concat_mask(c_concat: object, x: object) -> object:
    """The mask channels [B, 4, T, H, W] of Wan's concatenated image-to-video input, or None.
    ComfyUI's WAN21.concat_cond puts 4 mask channels before the image latent (C + 4 channels
    for a C-channel latent), or after a control latent (Fun control: 2C + 4, concat_mask_index
    C); other layouts have no mask."""
    if not torch.is_tensor(c_concat) or not torch.is_tensor(x) or c_concat.dim() != 5:
        return None
    latent = int(x.shape[1])
    start = {latent + 4: 0, 2 * latent + 4: latent}.get(int(c_concat.shape[1]))
    return None if start is None else c_concat[:, start:start + 4]


def description(patch: tuple[int, int, int], describe=None) -> Family:
    """Wan's Family (benchmarks call blocks without a model call to describe)."""
    return Family("wan", "Wan", KINDS, patch, describe, frames_per_region=VIDEO_REGION_FRAMES)
