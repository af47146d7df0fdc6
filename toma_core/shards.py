"""Merging a sequence split across ranks (sequence parallelism), each rank its own tokens
(docs/multi-gpu.md says why so). Rank r holds rows [r * S, (r + 1) * S) of the sequence, a span
of the grid's flattened order; its regions are the whole grid's clipped to that span. Every rank
drops the same number of tokens (common_drop), decided from the geometry alone, its pieces
keeping destinations in proportion to their sizes (spread_counts: "ragged" counts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import accumulate, product

import torch

from .regions import Regions, RegionTables, set_derived


@dataclass(frozen=True)
class SpanRegions:
    """The regions of `base` clipped to grid tokens [cuts[0], cuts[-1]) and cut again at the
    cuts between (one rank's span, or the union of every rank's), keeping `counts` destinations
    per piece. pieces: (span index, global region index) of each piece, in order; sizes: its
    tokens; width / places: slots and destination places per piece (0: the largest here;
    shard_regions gives every rank the largest of all ranks: the same shapes everywhere)."""

    base: Regions
    cuts: tuple[int, ...]
    pieces: tuple[tuple[int, int], ...]
    sizes: tuple[int, ...]
    counts: tuple[int, ...]
    width: int = 0
    places: int = 0
    tokens: int = field(init=False, compare=False, repr=False)     # tokens in the span
    count: int = field(init=False, compare=False, repr=False)      # pieces R
    size: int = field(init=False, compare=False, repr=False)       # slots per piece S
    min_size: int = field(init=False, compare=False, repr=False)
    k: int = field(init=False, compare=False, repr=False)          # destination places
    even: bool = field(init=False, compare=False, repr=False)      # no pad slots

    def __post_init__(self) -> None:
        set_derived(self, tokens=self.cuts[-1] - self.cuts[0], count=len(self.pieces),
                    size=max(self.width, *self.sizes), min_size=min(self.sizes),
                    k=max(self.places, *self.counts))

    def tables(self, device: torch.device | str | None = None) -> SpanTables:
        return SpanTables(self, device)


class SpanTables(RegionTables):
    """RegionTables of a SpanRegions (span-local token indices), and for the ragged counts:
    dest_valid [R, k] (k the largest count), compact [M] (the real destinations' places in the
    padded R * k order) and expand [R * k] (each place's index in the compact order; pad places
    point at 0, which zero unmerge weights ignore)."""

    def __init__(self, regions: SpanRegions, device: torch.device | str | None) -> None:
        base = RegionTables(regions.base, device)
        n = regions.tokens
        first, last = regions.cuts[0], regions.cuts[-1]
        # each span token's (span, global region) as one id, relabelled in order to 0..R-1
        tokens = torch.arange(first, last, device=device)
        span = torch.zeros(n, dtype=torch.long, device=device)
        for cut in regions.cuts[1:-1]:
            span += tokens >= cut
        ids = span * regions.base.count + base.token_region[first:last]         # [n]
        present = torch.zeros(len(regions.cuts) * regions.base.count, dtype=torch.long,
                              device=device).index_fill_(0, ids, 1)
        piece = (present.cumsum(0) - 1)[ids]                                    # [n]
        # a token's slot: its rank among its piece's tokens in token order, i.e. its place in
        # the stable sort by piece less its piece's first place there
        grouped, order = torch.sort(piece, stable=True)
        slot = torch.empty_like(piece)
        slot[order] = torch.arange(n, device=device) - torch.searchsorted(grouped, grouped)
        self._place(regions, piece, slot)
        counts = torch.tensor(regions.counts, device=device)   # host ints: one small copy
        self.dest_valid = torch.arange(regions.k, device=device) < counts.unsqueeze(1)  # [R, k]
        # nonzero with its size given: no read of the count back from the device
        self.compact = self.dest_valid.flatten().nonzero_static(
            size=sum(regions.counts)).squeeze(1)
        self.expand = (self.dest_valid.flatten().long().cumsum(0) - 1).clamp_min(0)


def _below(c: int, h: int, w: int, box: tuple[int, int, int, int, int, int]) -> int:
    """Tokens of a box (frames f0..f1, rows y0..y1, columns x0..x1, ends exclusive) whose
    flattened index (f * h + y) * w + x is below c."""
    f0, f1, y0, y1, x0, x1 = box
    fc, rest = divmod(c, h * w)
    yc, xc = divmod(rest, w)
    count = max(0, min(f1, fc) - f0) * (y1 - y0) * (x1 - x0)
    if f0 <= fc < f1:
        count += max(0, min(y1, yc) - y0) * (x1 - x0)
        if y0 <= yc < y1:
            count += max(0, min(x1, xc) - x0)
    return count


def span_sizes(base: Regions, start: int, end: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(pieces, sizes): the regions of `base` that meet grid tokens [start, end), in region
    order, and their tokens there. Host arithmetic, one step per region."""
    pieces, sizes = [], []
    axes = (base.slab_sizes, base.row_sizes, base.col_sizes)
    boxes = product(*(zip([0, *accumulate(parts)][:-1], parts, strict=True) for parts in axes))
    for index, ((f0, df), (y0, dy), (x0, dx)) in enumerate(boxes):     # in region order
        box = (f0, f0 + df, y0, y0 + dy, x0, x0 + dx)
        inside = _below(end, base.h, base.w, box) - _below(start, base.h, base.w, box)
        if inside:
            pieces.append(index)
            sizes.append(inside)
    return tuple(pieces), tuple(sizes)


def spread_counts(sizes: tuple[int, ...], keep: int) -> tuple[int, ...]:
    """Destinations per piece: proportional to the pieces' sizes, at least 1 and at most the
    size, summing to exactly `keep` (len(sizes) <= keep <= sum(sizes)). Deterministic: every
    rank computes every rank's counts alike."""
    total = sum(sizes)
    if not len(sizes) <= keep <= total:
        raise ValueError(f"{len(sizes)} pieces of {total} tokens cannot keep {keep}")
    counts = [min(s, max(1, round(keep * s / total))) for s in sizes]
    step = 1 if keep > sum(counts) else -1
    # the pieces furthest from their share first, ties to the earlier piece
    order = sorted(range(len(sizes)), key=lambda i: step * (counts[i] / sizes[i]))
    while sum(counts) != keep:
        for i in order:
            if sum(counts) == keep:
                break
            if 1 <= counts[i] + step <= sizes[i]:
                counts[i] += step
    return tuple(counts)


@dataclass(frozen=True)
class ShardGeometry:
    """Where the grid (regions `base`) lies in a sequence split over `world` ranks of `shard`
    rows each, from row `grid_start` of the whole sequence."""

    world: int
    shard: int
    grid_start: int
    base: Regions

    def span(self, rank: int) -> tuple[int, int]:
        """Grid tokens [start, end) that rank `rank` holds (start == end: none)."""
        lo = min(max(rank * self.shard - self.grid_start, 0), self.base.tokens)
        hi = min(max((rank + 1) * self.shard - self.grid_start, 0), self.base.tokens)
        return lo, hi

    def offset(self, rank: int) -> int:
        """Row of the rank's first grid token in its shard."""
        return max(self.grid_start - rank * self.shard, 0)

    def fits(self) -> bool:
        """Whether the split sequence can hold the grid at all."""
        return self.world * self.shard >= self.grid_start + self.base.tokens


def local_cap(ratio: float) -> float:
    """The most of its own grid tokens one rank may drop: it keeps at least half of what the
    ratio would keep (0.75 at ratio 0.5), so that no tile merges far harder than asked."""
    return (1.0 + ratio) / 2.0


def common_drop(held: list[int], pieces: list[int], ratio: float) -> int:
    """Tokens every rank drops, ranks holding held[r] grid tokens in pieces[r] pieces: the
    ratio's share of the whole grid spread evenly (round(ratio x sum(held) / P): a rank holding
    fewer, the text on the first or pad rows on the last, merges harder), at most what every
    rank can drop (local_cap of its tokens; each piece keeps one). 0 or less: none merges."""
    even = round(ratio * sum(held) / len(held))
    cap = local_cap(ratio)
    return min(even, *(min(math.floor(cap * n + 1e-9), n - k)
                       for n, k in zip(held, pieces, strict=True)))


def shard_regions(geometry: ShardGeometry, ratio: float) -> list[SpanRegions | None]:
    """Every rank's clipped regions and destination counts (None for a rank without grid
    tokens), all ranks dropping common_drop tokens. An empty list when no token can be
    dropped on every rank: then no rank merges."""
    spans = [geometry.span(rank) for rank in range(geometry.world)]
    found = [span_sizes(geometry.base, lo, hi) for lo, hi in spans]     # ((), ()) where none
    drop = common_drop([hi - lo for lo, hi in spans], [len(pieces) for pieces, _ in found],
                       ratio)
    if drop <= 0:
        return []
    counts = [spread_counts(sizes, hi - lo - drop) if hi > lo else ()
              for (lo, hi), (_, sizes) in zip(spans, found, strict=True)]
    width = max(size for _, sizes in found for size in sizes)
    places = max(count for each in counts for count in each)
    return [SpanRegions(geometry.base, (lo, hi), tuple((0, p) for p in pieces), sizes, kept,
                        width, places) if hi > lo else None
            for (lo, hi), (pieces, sizes), kept in zip(spans, found, counts, strict=True)]


def dropped_share(spans: list[SpanRegions | None]) -> float:
    """The share of the whole grid's tokens the ranks of `spans` (shard_regions) drop."""
    present = [span for span in spans if span is not None]
    return sum(span.tokens - sum(span.counts) for span in present) / present[0].base.tokens

