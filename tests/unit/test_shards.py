"""A token grid split across ranks (toma_core.shards): the clipped regions, the equal drops, and
merging each rank's shard against merging the whole grid with the union of the ranks' regions."""

from __future__ import annotations

import math

import pytest
import torch
from shard_union import union_of

from toma_pack.toma_core import build_plan, make_regions
from toma_pack.toma_core.shards import (
    ShardGeometry,
    SpanRegions,
    common_drop,
    dropped_share,
    local_cap,
    shard_regions,
    span_sizes,
    spread_counts,
)

# (t, h, w, frames per region, tiles per frame, grid start, ranks): video grids cut mid-frame
# and mid-row, a text prefix before an image grid, shards with pad rows at the end
CASES = [
    (21, 6, 10, 2, 4, 0, 2),
    (5, 6, 6, 2, 9, 0, 4),
    (1, 12, 10, 1, 16, 7, 2),      # 7 text tokens before the grid (Flux's single blocks)
    (3, 5, 7, 1, 4, 0, 3),         # 105 tokens on 3 ranks: no pad; odd sides
    (3, 5, 5, 2, 4, 3, 2),         # 78 rows on 2 ranks
]


def geometry(t, h, w, frames, tiles, start, world, pad=0) -> ShardGeometry:
    base = make_regions(h, w, "tile", tiles, t=t, frames=frames)
    shard = math.ceil((start + base.tokens + pad) / world)
    return ShardGeometry(world, shard, start, base)


@pytest.mark.parametrize("case", CASES)
def test_pieces_partition_the_span(case) -> None:
    """Each rank's pieces hold exactly its span's tokens, each once, in the tables as on the
    host; the ranks' spans cover the grid."""
    g = geometry(*case)
    spans = [g.span(r) for r in range(g.world)]
    assert spans[0][0] == 0 and spans[-1][1] == g.base.tokens
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    for lo, hi in spans:
        if hi == lo:
            continue
        pieces, sizes = span_sizes(g.base, lo, hi)
        region = SpanRegions(g.base, (lo, hi), tuple((0, p) for p in pieces), sizes, sizes)
        tables = region.tables("cpu")
        slots = tables.slots if tables.valid is None else tables.slots[tables.valid]
        assert sorted(slots.flatten().tolist()) == list(range(hi - lo))
        counted = torch.bincount(tables.token_region, minlength=len(sizes)).tolist()
        assert tuple(counted) == sizes
        # every token sits where token_region / token_slot say
        assert torch.equal(tables.slots[tables.token_region, tables.token_slot],
                           torch.arange(hi - lo))
        # a piece holds tokens of one base region only
        base = g.base.tables("cpu").token_region[lo:hi]
        for i, p in enumerate(pieces):
            assert set(base[tables.token_region == i].tolist()) == {p}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.75])
def test_every_rank_drops_alike(case, ratio) -> None:
    """Every rank keeps its grid tokens minus the same drop: the ratio's share of the whole
    grid spread evenly, or what the rank that can drop least allows (local_cap of its tokens,
    one token per piece); counts stay within 1..size."""
    g = geometry(*case)
    spans = shard_regions(g, ratio)
    held = [hi - lo for lo, hi in (g.span(r) for r in range(g.world))]
    drops = {h - sum(s.counts) for h, s in zip(held, spans, strict=True)}
    assert len(drops) == 1
    drop = drops.pop()
    assert drop == min(round(ratio * sum(held) / g.world),
                       *(min(math.floor(local_cap(ratio) * h), h - s.count)
                         for h, s in zip(held, spans, strict=True)))
    assert all(drop <= local_cap(ratio) * h for h in held)
    for s in spans:
        assert all(1 <= k <= n for k, n in zip(s.counts, s.sizes, strict=True))


def test_equal_shards_drop_the_ratio_of_each() -> None:
    """Where every rank holds as many grid tokens (a video grid split evenly), each drops
    round(ratio x its tokens), as one process would of that many."""
    g = geometry(21, 6, 10, 2, 4, 0, 2)
    spans = shard_regions(g, 0.5)
    assert [s.tokens - sum(s.counts) for s in spans] == [315, 315]
    assert dropped_share(spans) == 0.5


@pytest.mark.parametrize(("world", "drop", "share"), [(2, 1024, 0.5), (4, 480, 0.469),
                                                      (8, 48, 0.094)])
def test_the_rank_holding_the_text_merges_harder(world, drop, share) -> None:
    """Flux's single blocks at 1024x1024 with 512 text tokens on rank 0: rank 0 merges its own
    grid harder than the ratio (up to local_cap, 0.75 at ratio 0.5) so that every rank drops
    the even share of the grid where it can (P = 2: 1024 of its 1792); where even 0.75 of its
    grid falls short (P = 4: 640 tokens, P = 8: 64), every rank drops that much."""
    base = make_regions(64, 64, "tile", 64)
    g = ShardGeometry(world, math.ceil((512 + base.tokens) / world), 512, base)
    spans = shard_regions(g, 0.5)
    assert {s.tokens - sum(s.counts) for s in spans} == {drop}
    assert dropped_share(spans) == pytest.approx(share, abs=1e-3)
    assert spans[0].tokens - sum(spans[0].counts) <= 0.75 * spans[0].tokens


def test_common_drop() -> None:
    assert common_drop([100, 100], [4, 4], 0.5) == 50
    assert common_drop([60, 100], [4, 4], 0.5) == 40          # the even share of 160
    assert common_drop([40, 100], [4, 4], 0.5) == 30          # 35 asked, 0.75 x 40 allowed
    assert common_drop([10, 100], [9, 4], 0.5) == 1           # one token per piece kept
    assert common_drop([0, 100], [0, 4], 0.5) == 0           # a rank without grid tokens


def test_no_merge_where_a_rank_holds_no_grid_token() -> None:
    """A rank holding only text (the grid starts after its shard) cannot drop: no rank
    merges."""
    g = ShardGeometry(4, 10, 12, make_regions(4, 4, "tile", 4))
    assert g.span(0) == (0, 0)
    assert shard_regions(g, 0.5) == []


def test_spread_counts() -> None:
    assert spread_counts((64, 64, 24, 40), 96) == (32, 32, 12, 20)
    assert sum(spread_counts((1, 1, 7, 64), 40)) == 40
    with pytest.raises(ValueError):
        spread_counts((3, 3), 1)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("unmerge", ["transpose", "pinv"])
def test_ranks_merge_as_the_union_does(case, unmerge) -> None:
    """Merging each rank's shard with its plan and concatenating equals merging the whole
    sequence with the union of their regions (the merged sequences hold the same tokens in the
    same order); unmerging each rank's update equals unmerging the union's. Ragged counts pad
    some destinations: those never reach the merged sequence."""
    g = geometry(*case, pad=1)
    spans = shard_regions(g, 0.5)
    torch.manual_seed(0)
    length = g.world * g.shard
    x = torch.randn(2, length, 16)
    x[:, g.grid_start + g.base.tokens:] = 0                      # pad rows
    merged_parts, plans = [], []
    for rank, span in enumerate(spans):
        shard = x[:, rank * g.shard:(rank + 1) * g.shard]
        plan = build_plan(shard, 1, span.tokens, 0.5, regions=span, offset=g.offset(rank),
                          center=True, unmerge=unmerge)
        plans.append(plan)
        merged = plan.merge(shard, g.offset(rank))
        assert merged.shape[1] == g.shard - (g.base.tokens and plan.tokens - plan.merged_tokens)
        merged_parts.append(merged)
    lengths = {m.shape[1] for m in merged_parts}
    assert len(lengths) == 1                                      # the all-to-all's equal lengths
    union = union_of(spans)
    whole = build_plan(x[:, :g.grid_start + g.base.tokens], 1, union.tokens, 0.5,
                       regions=union, offset=g.grid_start, center=True, unmerge=unmerge)
    full = whole.merge(x[:, :g.grid_start + g.base.tokens], g.grid_start)
    grid_rows = torch.cat([m[:, p.tokens and g.offset(r):g.offset(r) + p.merged_tokens]
                           for r, (m, p) in enumerate(zip(merged_parts, plans, strict=True))],
                          dim=1)
    torch.testing.assert_close(grid_rows, full[:, g.grid_start:g.grid_start
                                                + whole.merged_tokens])
    # block scope: the same update unmerged per rank and in the union
    update = torch.randn_like(full)
    out_whole = whole.finish(full + update, whole.begin(x[:, :g.grid_start + g.base.tokens],
                                                         g.grid_start)[1], g.grid_start)
    outs = []
    cursor = g.grid_start
    for rank, (plan, merged) in enumerate(zip(plans, merged_parts, strict=True)):
        shard = x[:, rank * g.shard:(rank + 1) * g.shard]
        start = g.offset(rank)
        rows = update[:, cursor:cursor + plan.merged_tokens]
        cursor += plan.merged_tokens
        piece = merged.clone()
        piece[:, start:start + plan.merged_tokens] += rows
        _, pending = plan.begin(shard, start)
        outs.append(plan.finish(piece, pending, start)[:, start:start + plan.tokens])
    torch.testing.assert_close(torch.cat(outs, 1),
                               out_whole[:, g.grid_start:g.grid_start + g.base.tokens])
