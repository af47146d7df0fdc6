"""Region partitions (toma_core.regions): every token in exactly one slot, lossless split/join."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from toma_pack.toma_core import REGION_MODES, Regions, make_regions, tile_grid

GRIDS = [(1, 1), (1, 9), (9, 1), (2, 2), (3, 5), (8, 8), (32, 32), (45, 80), (67, 101), (64, 64),
         (1, 70), (70, 1), (13, 13)]
TILE_COUNTS = [1, 4, 16, 64, 256, 300]
# "global" ignores tile_count: one case per grid is enough.
CASES = [(h, w, t, m) for (h, w) in GRIDS for m in REGION_MODES
         for t in (TILE_COUNTS if m != "global" else [64])]


def _slot_ids(regions: Regions) -> torch.Tensor:
    """[R, S] grid index held by each slot, from splitting arange (independent of index tables)."""
    n = regions.h * regions.w
    return regions.split(torch.arange(n).view(1, n, 1))[0, ..., 0]


def _valid(regions: Regions) -> torch.Tensor:
    """[R, S] bool mask of real (non-pad) slots."""
    if regions.valid is None:
        return torch.ones(regions.count, regions.size, dtype=torch.bool)
    return regions.valid


def check_partition(regions: Regions, h: int, w: int) -> None:
    """Every structural promise of a Regions object for an h x w grid."""
    n = h * w
    assert (regions.h, regions.w) == (h, w)
    assert sum(regions.row_sizes) == h and sum(regions.col_sizes) == w
    assert len(regions.row_sizes) == regions.rows and len(regions.col_sizes) == regions.cols
    assert max(regions.row_sizes) - min(regions.row_sizes) <= 1
    assert max(regions.col_sizes) - min(regions.col_sizes) <= 1
    assert min(regions.row_sizes) >= 1 and min(regions.col_sizes) >= 1
    assert regions.count == regions.rows * regions.cols
    assert regions.min_size <= regions.size

    ids = _slot_ids(regions)
    assert ids.shape == (regions.count, regions.size)
    valid = _valid(regions)
    # Every token exactly once among the valid slots.
    assert int(valid.sum()) == n
    assert torch.equal(ids[valid].sort().values, torch.arange(n))
    # Each region holds as many valid slots as its extent says, and at least min_size.
    per_region = valid.sum(-1)
    assert int(per_region.min()) == regions.min_size
    assert int(per_region.max()) == regions.size
    assert torch.equal(regions.token_ids(), torch.where(valid, ids, regions.token_ids()))
    assert torch.equal(regions.token_ids()[valid], ids[valid])

    if regions.even:
        assert regions.valid is None and regions.inverse is None
        assert regions.count * regions.size == n
    else:
        assert regions.valid.dtype == torch.bool and regions.valid.shape == ids.shape
        assert regions.index.shape == ids.shape
        assert torch.equal(regions.index[valid], ids[valid])
        assert regions.inverse.shape == (n,)
        # inverse[t] is the flat slot holding token t, and that slot is valid.
        flat_ids, flat_valid = ids.reshape(-1), valid.reshape(-1)
        assert torch.equal(flat_ids[regions.inverse], torch.arange(n))
        assert bool(flat_valid[regions.inverse].all())
        assert len(set(regions.inverse.tolist())) == n

    # Regions are axis-aligned rectangles: a region's valid tokens span rows x cols exactly.
    ys, xs = ids // w, ids % w
    big = h + w
    span_y = ys.masked_fill(~valid, -1).amax(-1) - ys.masked_fill(~valid, big).amin(-1) + 1
    span_x = xs.masked_fill(~valid, -1).amax(-1) - xs.masked_fill(~valid, big).amin(-1) + 1
    assert torch.equal(span_y * span_x, per_region)

def check_split_join(regions: Regions) -> None:
    """split then join is the identity (bit-exact), keeps shapes, never introduces zeros."""
    n = regions.h * regions.w
    gen = torch.Generator().manual_seed(n)
    # Entries bounded away from zero: any zero after the round trip is a lost token.
    x = (torch.rand(2, n, 3, generator=gen) + 0.5) * torch.where(
        torch.rand(2, n, 3, generator=gen) < 0.5, -1.0, 1.0)
    parts = regions.split(x)
    assert parts.shape == (2, regions.count, regions.size, 3)
    assert bool((parts[:, _valid(regions)] != 0).all())
    back = regions.join(parts)
    assert back.shape == x.shape
    assert torch.equal(back, x)
    assert bool((back != 0).all())
    # Extra leading dims ([B, heads, N, D]) and a non-contiguous input.
    xh = x.unsqueeze(1).expand(2, 2, n, 3) * torch.tensor([1.0, -2.0]).view(1, 2, 1, 1)
    xt = xh.transpose(0, 1)
    for t in (xh, xt):
        parts = regions.split(t)
        assert parts.shape == (*t.shape[:-2], regions.count, regions.size, 3)
        assert torch.equal(regions.join(parts), t)


@pytest.mark.parametrize(("h", "w", "tile_count", "mode"), CASES)
def test_partition_covers_grid(h: int, w: int, tile_count: int, mode: str) -> None:
    regions = make_regions(h, w, mode, tile_count)
    check_partition(regions, h, w)
    check_split_join(regions)


@settings(max_examples=150, deadline=None)
@given(h=st.integers(1, 70), w=st.integers(1, 70), tile_count=st.integers(1, 300),
       mode=st.sampled_from(REGION_MODES))
def test_partition_property(h: int, w: int, tile_count: int, mode: str) -> None:
    regions = make_regions(h, w, mode, tile_count)
    check_partition(regions, h, w)
    check_split_join(regions)


def test_mode_shapes() -> None:
    stripes = make_regions(45, 80, "stripe", 8)
    assert stripes.cols == 1 and stripes.rows == 8
    assert stripes.col_sizes == (80,)
    glob = make_regions(45, 80, "global", 64)
    assert glob.count == 1 and glob.size == 45 * 80 and glob.even
    # More stripes than rows: one row per stripe.
    assert make_regions(5, 80, "stripe", 64).rows == 5


@pytest.mark.parametrize(("h", "w", "tile_count"), [(64, 64, 64), (128, 128, 256), (32, 32, 64),
                                                    (64, 64, 16)])
def test_square_grid_square_tiles(h: int, w: int, tile_count: int) -> None:
    """A square grid whose side is a multiple of sqrt(tile_count) gets exactly that many tiles."""
    side = math.isqrt(tile_count)
    regions = make_regions(h, w, "tile", tile_count)
    assert (regions.rows, regions.cols) == (side, side)
    assert regions.even
    assert regions.size == (h // side) * (w // side)


@pytest.mark.parametrize(("h", "w"), [(104, 152), (152, 104), (45, 80), (128, 72), (67, 101)])
@pytest.mark.parametrize("tile_count", [16, 64, 256])
def test_tiles_follow_aspect(h: int, w: int, tile_count: int) -> None:
    """Non-square grids: tiles stay near-square and their number stays near tile_count.

    Measured over these cases: tile count 0.94-1.09 x tile_count, tile aspect 0.88-1.14.
    """
    rows, cols = tile_grid(h, w, tile_count)
    assert 0.85 * tile_count <= rows * cols <= 1.2 * tile_count
    tile_h, tile_w = h / rows, w / cols
    assert 0.8 <= tile_h / tile_w <= 1.25


@pytest.mark.parametrize(("h", "w"), [(2, 2), (4, 6), (1, 9), (9, 1), (3, 3), (5, 70)])
def test_tiles_at_least_two_per_side(h: int, w: int) -> None:
    """More tiles asked than the grid holds: tiles keep >= 2 tokens per side where possible."""
    regions = make_regions(h, w, "tile", 300)
    if h >= 2:
        assert min(regions.row_sizes) >= 2
    if w >= 2:
        assert min(regions.col_sizes) >= 2
    check_partition(regions, h, w)


def test_ragged_grid_is_ragged() -> None:
    regions = make_regions(45, 80, "tile", 64)
    assert not regions.even
    assert regions.size - regions.min_size > 0
    regions = make_regions(67, 101, "stripe", 10)
    assert not regions.even


def test_to_device_keeps_partition() -> None:
    regions = make_regions(45, 80, "tile", 64)
    moved = regions.to(torch.device("cpu"))
    assert torch.equal(moved.index, regions.index)
    check_partition(moved, 45, 80)
    even = make_regions(32, 32, "tile", 64)
    assert even.to(torch.device("cpu")) is even


@pytest.mark.parametrize(("h", "w"), [(0, 5), (5, 0), (-1, 3)])
def test_empty_grid_rejected(h: int, w: int) -> None:
    with pytest.raises(ValueError, match="grid"):
        make_regions(h, w)


def test_unknown_mode_rejected() -> None:
    with pytest.raises(ValueError, match="mode"):
        make_regions(8, 8, "hexagon")
