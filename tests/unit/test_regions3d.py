"""Spatio-temporal regions (toma_core.regions3d): a partition of t x h x w, frame-aligned slabs."""

from __future__ import annotations

import pytest
import torch

from toma_pack.toma_core import build_plan, make_regions
from toma_pack.toma_core.regions3d import make_regions_3d

SHAPES = [(1, 8, 10), (3, 8, 10), (5, 7, 9), (4, 6, 6), (2, 1, 5)]


def region_tokens(regions) -> list[list[int]]:
    """Token indices of each region (valid slots only)."""
    ids = regions.token_ids()
    if regions.valid is None:
        return ids.tolist()
    return [row[ok].tolist() for row, ok in zip(ids, regions.valid, strict=True)]


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
        assert int(f.max() - f.min()) < frames                 # within one slab
        assert int(f.min()) % frames == 0                      # slabs start at multiples
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


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError):
        make_regions_3d(0, 4, 4)
    with pytest.raises(ValueError):
        make_regions_3d(2, 4, 4, frames=0)
