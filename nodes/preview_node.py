"""ToMAPreview: draw what ToMA would merge on a picture, at the artist's resolution.

The picture stands in for the model's features: each token is a cell of `px` x `px` pixels,
described by its downsampled pixels minus the image mean (so cosine similarity reflects colour
and texture differences, not overall brightness). PREVIEW's description says what is drawn.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..toma_core import build_plan, make_regions
from .node_spec import NodeSpec
from .options import MAX_RATIO, MAX_TILE_COUNT, check_number
from .toma_node import CATEGORY, TILE_DEFAULTS

LEVELS = {
    "16px (SDXL outer, Flux)": 16,
    "32px (SDXL inner)": 32,
    "8px (SD1.5 outer)": 8,
}
FEATURE_SIDE = 4   # each token described by a 4x4 thumbnail of its cell
BLEND = 0.45


def token_features(image: torch.Tensor, px: int) -> tuple[torch.Tensor, int, int]:
    """image [H, W, 3] in [0, 1] -> features [1, h*w, 3*16], grid h, w (h = ceil(H / px))."""
    height, width = image.shape[:2]
    h, w = -(-height // px), -(-width // px)
    chw = image.permute(2, 0, 1).unsqueeze(0).float()
    chw = F.pad(chw, (0, w * px - width, 0, h * px - height), mode="replicate")
    thumbs = F.adaptive_avg_pool2d(chw, (h * FEATURE_SIDE, w * FEATURE_SIDE))
    cells = thumbs.unfold(2, FEATURE_SIDE, FEATURE_SIDE).unfold(3, FEATURE_SIDE, FEATURE_SIDE)
    feats = cells.permute(0, 2, 3, 1, 4, 5).reshape(1, h * w, -1)
    return feats - feats.mean(1, keepdim=True), h, w


def palette(ids: torch.Tensor) -> torch.Tensor:
    """A stable, well-spread colour per integer id: ids [...] -> [..., 3] in [0, 1]."""
    hue = (ids.double() * 0.618033988749895) % 1.0
    k = (torch.tensor([5.0, 3.0, 1.0], dtype=torch.float64) + hue[..., None] * 6) % 6
    rgb = 1 - 0.75 * torch.clamp(torch.minimum(k, 4 - k), 0, 1)
    return rgb.float()


def preview(image: torch.Tensor, ratio: float, tile_count: int, px: int) -> torch.Tensor:
    """One picture [H, W, 3] -> the overlay [H, W, 3]."""
    height, width = image.shape[:2]
    feats, h, w = token_features(image, px)
    regions = make_regions(h, w, "tile", tile_count)
    plan = build_plan(feats, h, w, ratio, tile_count=tile_count, regions=regions)
    ids = torch.arange(h * w)
    dest = ids.clone()
    if plan is not None:
        slot_owner = plan.unmerge_w.argmax(-1)            # [B*R, S, k] (B = 1) -> [R, S] k index
        owner_tokens = plan.dest_tokens[0].view(regions.count, plan.k)
        dest = regions.join(owner_tokens.gather(1, slot_owner).unsqueeze(-1))[..., 0]
    colours = palette(dest).view(h, w, 3)
    is_dest = (dest == ids).view(h, w, 1).float()
    colours = colours * (1 - 0.6 * is_dest)
    cells = colours.repeat_interleave(px, 0).repeat_interleave(px, 1)[:height, :width]
    out = (1 - BLEND) * image.float() + BLEND * cells
    for edge in torch.tensor(regions.row_sizes).cumsum(0)[:-1].tolist():    # the tile borders
        out[min(edge * px, height - 1)] = 1.0
    for edge in torch.tensor(regions.col_sizes).cumsum(0)[:-1].tolist():
        out[:, min(edge * px, width - 1)] = 1.0
    return out


PREVIEW = NodeSpec(
    node_id="ToMAPreview",
    display_name="ToMA Merge Preview",
    category=CATEGORY,
    description="Shows what ToMA merges at your resolution: white lines are tile borders, dark "
                "cells the destination tokens kept, and every token is tinted with the colour "
                "of the destination it merges into. Uses the picture itself as a stand-in for "
                "the model's features, so it is a guide, not an exact replay.",
    inputs={
        "image": ("IMAGE", {"tooltip": "A picture at the size you generate (e.g. a previous "
                                       "render or a reference photo)."}),
        "ratio": ("FLOAT", {"default": 0.5, "min": 0.0, "max": MAX_RATIO, "step": 0.05,
                            "tooltip": "The ratio you use on the ToMA node."}),
        "tile_count": ("INT", {"default": 64, "min": 1, "max": MAX_TILE_COUNT, "step": 1,
                               "tooltip": "Tiles per image. ToMA's default (tile_count "
                                          f"0): {TILE_DEFAULTS}."}),
        "level": (list(LEVELS), {"default": next(iter(LEVELS)),
                                 "tooltip": "Which model level to show: how many pixels "
                                            "one token covers there."}),
    },
    outputs=("IMAGE",),
)


def render_preview(image: torch.Tensor, ratio: float, tile_count: int,
                   level: str) -> torch.Tensor:
    """What ToMAPreview does: images [B, H, W, C] -> the overlays [B, H, W, 3] in [0, 1].
    ValueError names a bad widget."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {', '.join(LEVELS)}; got {level!r}")
    check_number("ratio", ratio, 0.0, MAX_RATIO)
    check_number("tile_count", tile_count, 1, MAX_TILE_COUNT, whole=True)
    if image.dim() != 4 or image.shape[-1] < 3:
        raise ValueError(f"image must be [B, H, W, 3], got {tuple(image.shape)}")
    px = LEVELS[level]
    with torch.no_grad():
        frames = [preview(frame[..., :3].cpu(), ratio, tile_count, px) for frame in image]
    return torch.stack(frames).clamp(0, 1)
