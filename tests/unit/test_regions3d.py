"""Spatio-temporal regions (toma_core.regions3d): a partition of t x h x w, frame-aligned slabs."""

from __future__ import annotations

import pytest
import torch

from toma_pack.toma_core import build_plan, make_regions
from toma_pack.toma_core.merge_plan import destinations_per_region
from toma_pack.toma_core.regions3d import make_regions_3d

SHAPES = [(1, 8, 10), (3, 8, 10), (5, 7, 9), (4, 6, 6), (2, 1, 5)]


def region_tokens(regions) -> list[list[int]]:
    """Token indices of each region (valid slots only)."""
    ids = regions.token_ids()
    if regions.valid is None:
        return ids.tolist()
    return [row[ok].tolist() for row, ok in zip(ids, regions.valid, strict=True)]


def slab_depth(t: int, frames: int) -> int:
    """The deepest slab: t // frames slabs (at least one) of depths differing by at most one."""
    return -(-t // max(1, t // frames))


@pytest.mark.parametrize("frames", [1, 2, 3])
@pytest.mark.parametrize("t, h, w", SHAPES)
def test_every_token_in_exactly_one_box(t, h, w, frames):
    regions = make_regions_3d(t, h, w, "tile", 6, frames)
    tokens = sorted(i for region in region_tokens(regions) for i in region)
    assert tokens == list(range(t * h * w))
    assert (regions.h, regions.w) == (t * h, w)
    for region in region_tokens(regions):
        f, y, x = (torch.tensor(region) // (h * w), torch.tensor(region) // w % h,
                   torch.tensor(region) % w)
        assert int(f.max() - f.min()) < slab_depth(t, frames)   # within one slab
        plane = make_regions(h, w, "tile", 6)
        assert int(y.max() - y.min()) < max(plane.row_sizes)   # within one tile
        assert int(x.max() - x.min()) < max(plane.col_sizes)


@pytest.mark.parametrize("frames", [1, 2])
@pytest.mark.parametrize("t, h, w", SHAPES)
def test_split_join_round_trip(t, h, w, frames):
    regions = make_regions_3d(t, h, w, "tile", 6, frames)
    x = torch.randn(2, t * h * w, 3)
    assert torch.equal(regions.join(regions.split(x)), x)


def test_one_frame_is_the_plane_partition():
    regions, plane = make_regions_3d(1, 7, 9, "tile", 6, 4), make_regions(7, 9, "tile", 6)
    assert (regions.rows, regions.cols, regions.row_sizes, regions.col_sizes) == (
        plane.rows, plane.cols, plane.row_sizes, plane.col_sizes)
    assert torch.equal(regions.token_ids(), plane.token_ids())


def test_one_frame_slabs_of_even_tiles_keep_the_view_fast_path():
    assert make_regions_3d(3, 8, 8, "tile", 4, 1).even
    assert not make_regions_3d(3, 8, 8, "tile", 4, 2).even


@pytest.mark.parametrize("t, h, w", [(3, 8, 10), (5, 7, 9)])
def test_one_frame_slabs_merge_the_same_count_per_frame_in_frame_order(t, h, w):
    regions = make_regions_3d(t, h, w, "tile", 6, 1)
    features = torch.randn(2, t * h * w, 8, generator=torch.Generator().manual_seed(0))
    plan = build_plan(features, t * h, w, 0.5, regions=regions)
    per_frame = plan.merged_tokens // t
    assert plan.merged_tokens == per_frame * t
    frames = plan.dest_tokens // (h * w)                      # [B, R*k]
    expected = torch.arange(t).repeat_interleave(per_frame)
    assert torch.equal(frames, expected.expand_as(frames))


@pytest.mark.parametrize("t, h, w", [
    (31, 22, 40),   # Wan 2.2 5B, 1280x704, 121 frames
    (21, 30, 52),   # Wan 14B, 832x480, 81 frames
    (21, 45, 80),   # Wan 14B, 1280x720, 81 frames
    (33, 45, 80),   # HunyuanVideo, 1280x720, 129 frames
])
@pytest.mark.parametrize("frames", [2, 3])
def test_frame_counts_that_are_not_a_multiple_still_merge_at_the_ratio(t, h, w, frames):
    """Regions of about 64 tokens `frames` deep (the DiT families' tile_count 0) on real video
    grids: the merged count stays at (1 - ratio) * N. With a one-frame last slab, 31 frames
    kept 41% of the tokens at ratio 0.5 (every region capped at the thin slab's smallest size)."""
    tiles = max(1, round(h * w * min(frames, t) / 64))
    regions = make_regions_3d(t, h, w, "tile", tiles, frames)
    for ratio in (0.25, 0.5, 0.75):
        kept = regions.count * destinations_per_region(ratio, regions) / (t * h * w)
        # measured: at most 0.0077 from 1 - ratio on these grids; the one-frame last slab
        # was 0.089 off at (31, 22, 40), ratio 0.5
        assert abs(kept - (1 - ratio)) < 0.01, (ratio, kept)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError):
        make_regions_3d(0, 4, 4)
    with pytest.raises(ValueError):
        make_regions_3d(2, 4, 4, frames=0)
