"""Spatio-temporal regions of a t x h x w token grid (video), as a `Regions` that merge_plan uses.

Video tokens are laid out frame by frame, each frame row-major (t, h, w), i.e. as a (t*h) x w
grid whose rows are the frames' rows one after another. A region is a box of `frames` frames x
(about) a tile of the frame; every frame is cut into the same tiles, and frames into slabs of
`frames` frames, some deeper where the frame count is not a multiple (t // frames slabs whose
depths differ by at most one). Never a shorter slab: every region keeps the same number of
destinations, at most the smallest region's size, so one thin slab would make every other region
merge harder than the ratio asks (31 frames in slabs of 2 and one of 1 kept 41% of the tokens at
ratio 0.5). Regions are ordered slab by slab, so a plan's merged tokens come out slab-major:
with one frame per slab every frame keeps the same number of merged tokens, in frame order
(what models that modulate each frame separately need).

With one frame per slab and even tiles the regions are a plain 2-D tiling of the (t*h) x w grid
and `Regions` keeps its view-only fast path; otherwise index tables move the tokens.
One frame (t = 1) gives exactly `make_regions(h, w, ...)`.
"""

from __future__ import annotations

import torch

from .regions import RegionMode, Regions, even_sizes, make_regions


def make_regions_3d(t: int, h: int, w: int, mode: RegionMode = "tile", tile_count: int = 64,
                    frames: int = 1) -> Regions:
    """Partition a t x h x w token grid; the result describes a (t*h) x w grid.

    Each frame is partitioned like `make_regions(h, w, mode, tile_count)`; regions span the
    consecutive frames of a slab: t // `frames` slabs (one when t < `frames`) of depths that
    differ by at most one, the deeper ones first.
    """
    if t < 1 or frames < 1:
        raise ValueError(f"frames must be at least 1, got t={t}, frames={frames}")
    plane = make_regions(h, w, mode, tile_count)
    if t == 1:
        return plane
    slabs = even_sizes(t, max(1, t // frames))
    if len(slabs) == t and plane.even:
        # one frame per slab, even tiles: a 2-D tiling of the (t*h) x w grid
        return Regions(t * h, w, t * plane.rows, plane.cols, plane.row_sizes * t, plane.col_sizes,
                       None, None, None)
    return _boxes(t, h, w, slabs, plane)


def _boxes(t: int, h: int, w: int, slabs: tuple[int, ...], plane: Regions) -> Regions:
    """Index tables for slab x tile boxes, padded to the largest box."""
    rows, cols = plane.row_sizes, plane.col_sizes
    at, ah, aw = max(slabs), max(rows), max(cols)
    t0 = torch.tensor((0,) + slabs).cumsum(0)[:-1]
    y0 = torch.tensor((0,) + rows).cumsum(0)[:-1]
    x0 = torch.tensor((0,) + cols).cumsum(0)[:-1]
    dt, dy, dx = torch.arange(at), torch.arange(ah), torch.arange(aw)
    # [slabs, rows, cols, at, ah, aw]: frame, row and column of every slot of every box
    f = (t0.view(-1, 1, 1, 1, 1, 1) + dt.view(1, 1, 1, -1, 1, 1))
    y = (y0.view(1, -1, 1, 1, 1, 1) + dy.view(1, 1, 1, 1, -1, 1))
    x = (x0.view(1, 1, -1, 1, 1, 1) + dx.view(1, 1, 1, 1, 1, -1))
    ok = ((dt.view(1, 1, 1, -1, 1, 1) < torch.tensor(slabs).view(-1, 1, 1, 1, 1, 1))
          & (dy.view(1, 1, 1, 1, -1, 1) < torch.tensor(rows).view(1, -1, 1, 1, 1, 1))
          & (dx.view(1, 1, 1, 1, 1, -1) < torch.tensor(cols).view(1, 1, -1, 1, 1, 1)))
    count, size = len(slabs) * len(rows) * len(cols), at * ah * aw
    shape = (len(slabs), len(rows), len(cols), at, ah, aw)
    valid = ok.expand(shape).reshape(count, size)
    token = ((f * h + y) * w + x).expand(shape).reshape(count, size)
    index = torch.where(valid, token, 0)
    inverse = torch.empty(t * h * w, dtype=torch.long)
    inverse[index[valid]] = torch.arange(count * size).view(count, size)[valid]
    # row extents: one per (slab, tile row) pair, so that size / min_size are the boxes'
    row_sizes = tuple(s * r for s in slabs for r in rows)
    return Regions(t * h, w, len(slabs) * len(rows), len(cols), row_sizes, cols,
                   index, valid, inverse)
