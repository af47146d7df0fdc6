"""Partition of a t x h x w token grid (frame-major, row-major; an image is t = 1) into merge
regions: boxes of frames x tile rows x tile columns, cut along each axis into parts whose sizes
differ by at most one (larger first). Regions go slab by slab, tile row, tile column; slots in a
box frame by frame, row by row; a padded [R, S] table holds them (S the largest box's size, pad
slots invalid: never counted nor picked). `Regions` is host metadata (Python ints, hashable);
`RegionTables` its index tensors, built on the device with device ops (no copy, no sync).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch

RegionMode = Literal["tile", "stripe", "global"]
REGION_MODES: tuple[str, ...] = get_args(RegionMode)


@dataclass(frozen=True)
class Regions:
    """R regions of a t x h x w grid, each padded to S slots; slab_sizes, row_sizes, col_sizes:
    each part's extent along t, h and w."""

    t: int
    h: int
    w: int
    slab_sizes: tuple[int, ...]
    row_sizes: tuple[int, ...]
    col_sizes: tuple[int, ...]
    # derived once: blocks read them on every call, where a property is a Python call each
    tokens: int = field(init=False, compare=False, repr=False)     # N, the grid's tokens
    count: int = field(init=False, compare=False, repr=False)      # regions R
    size: int = field(init=False, compare=False, repr=False)       # slots per region S
    min_size: int = field(init=False, compare=False, repr=False)   # tokens in the smallest
    even: bool = field(init=False, compare=False, repr=False)      # no pad slots

    def __post_init__(self) -> None:
        set_derived(self, tokens=self.t * self.h * self.w,
                    count=len(self.slab_sizes) * len(self.row_sizes) * len(self.col_sizes),
                    size=max(self.slab_sizes) * max(self.row_sizes) * max(self.col_sizes),
                    min_size=min(self.slab_sizes) * min(self.row_sizes) * min(self.col_sizes))

    def tables(self, device: torch.device | str | None = None) -> RegionTables:
        """The index tensors of this partition on `device` (see RegionTables)."""
        return RegionTables(self, device)

    def join(self, x: torch.Tensor) -> torch.Tensor:
        """Region layout back to grid order: x [..., R, S, C] -> [..., N, C] (pad slots
        dropped)."""
        return x.flatten(-3, -2).index_select(-2, self.tables(x.device).flat)


def set_derived(regions: object, **values: int) -> None:
    """A frozen partition's derived fields, and `even` (no pad slots: size == min_size)."""
    for name, value in {**values, "even": values["size"] == values["min_size"]}.items():
        object.__setattr__(regions, name, value)


class RegionTables:
    """Index tensors of one partition on one device: token_region [N], token_slot [N]: where
    each grid token sits, flat [N] its place in the [R * S] table; slots [R, S]: grid token of
    each slot (pad slots: token 0); valid [R, S] bool, False at pad slots, or None when even.
    Merge's and unmerge's gather indices are kept per batch size and offset."""

    def __init__(self, regions: Regions, device: torch.device | str | None) -> None:
        r = regions
        (tf, of), (ty, oy), (tx, ox) = (
            _parts(n, sizes, device)
            for n, sizes in ((r.t, r.slab_sizes), (r.h, r.row_sizes), (r.w, r.col_sizes)))
        # per token of the [t, h, w] grid: its box, and its place in the box (frame, row, column)
        region = ((tf.view(-1, 1, 1) * len(r.row_sizes) + ty.view(1, -1, 1)) * len(r.col_sizes)
                  + tx.view(1, 1, -1))
        slot = ((of.view(-1, 1, 1) * max(r.row_sizes) + oy.view(1, -1, 1)) * max(r.col_sizes)
                + ox.view(1, 1, -1))
        self._place(regions, region.flatten(), slot.flatten())

    def _place(self, regions: Regions, token_region: torch.Tensor,
               token_slot: torch.Tensor) -> None:
        """slots and valid from each token's region and slot [N] (regions: a Regions or a
        shards.SpanRegions); empty gather caches."""
        self.regions, self.token_region, self.token_slot = regions, token_region, token_slot
        device, table = token_region.device, (regions.count, regions.size)
        places = regions.count * regions.size
        self.flat = token_region * regions.size + token_slot
        self.slots = torch.zeros(places, dtype=torch.long, device=device).index_put_(
            (self.flat,), torch.arange(regions.tokens, device=device)).view(table)
        self.valid = None if regions.even else torch.zeros(
            places, dtype=torch.bool, device=device).index_fill_(0, self.flat, True).view(table)
        self._merge: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._unmerge: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def merge_index(self, batch: int, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(items [B*R, 1], tokens [B*R, S]): x[items, tokens] takes a stream x [B, L, C] whose
        grid starts at `offset` into region layout [B*R, S, C] in one gather."""
        key = (batch, offset)
        found = self._merge.get(key)
        if found is None:
            r = self.regions.count
            items = torch.arange(batch, device=self.slots.device).repeat_interleave(r).view(-1, 1)
            found = (items, (self.slots + offset).repeat(batch, 1))
            if not compiling():
                self._merge[key] = found
        return found

    def unmerge_index(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [B, N], slots [N]): y[rows, slots] takes region layout y [B*R, S, C] back to
        grid order [B, N, C] in one gather."""
        found = self._unmerge.get(batch)
        if found is None:
            items = torch.arange(batch, device=self.slots.device).view(-1, 1) * self.regions.count
            found = (items + self.token_region, self.token_slot)
            if not compiling():
                self._unmerge[batch] = found
        return found


def _parts(total: int, sizes: tuple[int, ...],
           device: torch.device | str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """An axis of `total` cut into `sizes` (as even_sizes makes them): each coordinate's part
    and its offset in it, [total] each."""
    parts = len(sizes)
    base, extra = total // parts, total % parts      # divmod does not trace on symbolic sizes
    if sizes != even_sizes(total, parts):
        raise ValueError(f"part sizes {sizes} are not an even split of {total}")
    c = torch.arange(total, device=device)
    boundary = extra * (base + 1)
    part = torch.where(c < boundary, c // (base + 1), extra + (c - boundary).clamp_min(0) // base)
    return part, c - (part * base + part.clamp(max=extra))


# Whether dynamo is tracing: then index tensors are rebuilt in the graph, not cached in a dict the
# compiled code would guard on. Dynamo's own flag: one Python call (is_compiling makes two).
compiling = torch.compiler.is_dynamo_compiling


def even_sizes(total: int, parts: int) -> tuple[int, ...]:
    """Split `total` into `parts` sizes differing by at most one (larger ones first)."""
    base, extra = total // parts, total % parts
    return tuple(base + 1 if i < extra else base for i in range(parts))


def tile_grid(h: int, w: int, tile_count: int) -> tuple[int, int]:
    """Tiles along each side for about `tile_count` near-square tiles on an h x w grid, at least
    2 tokens per side where the grid allows it (a 1-token tile could only keep itself)."""
    side = math.sqrt(h * w / max(tile_count, 1))
    rows = min(max(1, round(h / side)), max(1, h // 2))
    cols = min(max(1, round(w / side)), max(1, w // 2))
    return rows, cols


def make_regions(h: int, w: int, mode: RegionMode = "tile", tile_count: int = 64,
                 t: int = 1, frames: int = 1) -> Regions:
    """Partition a t x h x w grid (t = 1: an image). mode "tile": about `tile_count` tiles per
    frame; "stripe": `tile_count` bands of whole rows (at most h); "global": one region per slab.
    Frames are cut into t // `frames` slabs (one when t < `frames`) of even depths: a thinner
    last slab would cap every region's destination count and make the others merge harder."""
    if h < 1 or w < 1 or t < 1:
        raise ValueError(f"token grid must be at least 1x1, got {t}x{h}x{w}")
    if frames < 1:
        raise ValueError(f"frames per region must be at least 1, got {frames}")
    if mode == "tile":
        rows, cols = tile_grid(h, w, tile_count)
    elif mode == "stripe":
        rows, cols = min(max(1, tile_count), h), 1
    elif mode == "global":
        rows, cols = 1, 1
    else:
        raise ValueError(f"region mode must be one of {REGION_MODES}, got {mode!r}")
    return Regions(t, h, w, even_sizes(t, max(1, t // frames)), even_sizes(h, rows),
                   even_sizes(w, cols))
