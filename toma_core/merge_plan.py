"""The merge plan: destinations plus merge/unmerge weights, computed once, applied many times.

For each region with tokens X [S, C] and destinations D (k slots), P = softmax over destinations
of tau * cos(X[D], X) [k, S] (each column sums to 1; a destination is its own only source):
merge(x) = M x with M = P row-normalised; unmerge(y) = U y with U = P^T (rows sum to 1, so it
commutes with a linear layer plus bias) or pinv(M).
On the hot path each step is one static-shape gather or one batched matmul over every region of
every batch item, dense over the region (no host syncs, nothing data-dependent):
xr = x[items, slots] [B*R, S, C], merged = M @ xr [B*R, k, C]; a block run on merged tokens
("block scope", `begin` / `finish`) gives xr + U @ (block(merged) - merged), gathered back to
grid order. A stream [B, L, C] holds the N grid tokens after `prefix` other tokens (text) and
before any suffix (reference images), which pass through untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, get_args

import torch

from .plan_op import plan_weights, plan_weights_reference
from .regions import RegionMode, Regions, RegionTables, make_regions
from .shards import SpanRegions

UnmergeMethod = Literal["transpose", "pinv"]
BatchPolicy = Literal["per_item", "shared"]
UNMERGE_METHODS: tuple[str, ...] = get_args(UnmergeMethod)
BATCH_POLICIES: tuple[str, ...] = get_args(BatchPolicy)
ORDER_NEEDS = "region order needs even regions and a stream that is only the grid"


class Pending(NamedTuple):
    """What `MergePlan.begin` hands `finish`: base [B*R, S, C], merged [B*R, k, C] or None (see
    begin); shared: base is the caller's own tensor (an ordered input), never written into."""

    base: torch.Tensor
    merged: torch.Tensor | None
    shared: bool = False


def destinations_per_region(ratio: float, regions: Regions) -> int:
    """k, the same for every region: round((1 - ratio) * N / R), clamped to [1, smallest region]
    (where sizes differ by a token, the larger regions merge a little harder)."""
    return min(max(1, round((1.0 - ratio) * regions.tokens / regions.count)), regions.min_size)


@dataclass
class MergePlan:
    """Merge/unmerge for one token grid and batch. Build it with `build_plan`.

    dest_slots [B, R, k]: each destination's slot; dest_tokens [B, R*k]: its grid token (the
    merged sequence's order); merge_w [B*R, k, S], unmerge_w [B*R, S, k]: M and U in the
    activations' dtype (pad slots weigh 0); assignment [B*R, S, k]: P^T where unmerge_w is not
    (pinv), else None. size_biases: attention.size_bias's masks (hot paths read them inline).
    A shard's SpanRegions keep unequal numbers of destinations (k the most): the merged sequence
    holds only the real ones (dest_tokens [B, M]), gathered by compact and expand.
    """

    regions: Regions | SpanRegions
    k: int
    tables: RegionTables
    dest_slots: torch.Tensor
    dest_tokens: torch.Tensor
    merge_w: torch.Tensor
    unmerge_w: torch.Tensor
    assignment: torch.Tensor | None = None
    _cast: dict = field(default_factory=dict, repr=False)
    _rows: dict = field(default_factory=dict, repr=False)
    size_biases: dict = field(default_factory=dict, repr=False)
    # derived once: blocks read them on every call, where a property is a Python call each
    tokens: int = field(init=False, repr=False)          # N, grid tokens before merging
    merged_tokens: int = field(init=False, repr=False)   # grid tokens after merging (R * k)
    items: int = field(init=False, repr=False)           # B, the batch the plan was built for
    compact: torch.Tensor | None = field(init=False, repr=False)
    expand: torch.Tensor | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._cast[self.merge_w.dtype] = (self.merge_w, self.unmerge_w)
        self.tokens = self.regions.tokens
        self.merged_tokens = self.dest_tokens.shape[1]
        self.items = self.dest_tokens.shape[0]
        # the padded-order gathers of ragged regions (SpanTables), None where every region keeps k
        self.compact = getattr(self.tables, "compact", None)
        self.expand = getattr(self.tables, "expand", None)

    def weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(M, U) in `dtype`, cast once and kept (hot paths read `_cast` first: no call)."""
        found = self._cast.get(dtype)
        if found is None:
            found = self._cast[dtype] = (self.merge_w.to(dtype), self.unmerge_w.to(dtype))
        return found

    def _check(self, x: torch.Tensor, length: int, prefix: int) -> None:
        if x.dim() != 3:
            raise ValueError(f"expected a stream [B, L, C], got {tuple(x.shape)}")
        if prefix < 0 or x.shape[1] < prefix + length:
            raise ValueError(f"sequence of {x.shape[1]} tokens cannot hold {prefix} prefix "
                             f"tokens and {length} grid tokens")
        if x.shape[0] != self.items:
            raise ValueError(f"plan built for batch {self.items}, got {x.shape[0]}")

    def _grid_of(self, y: torch.Tensor, prefix: int) -> torch.Tensor:
        """y's merged grid as [B*R, k, C] (a view where y holds only it)."""
        m = self.merged_tokens
        grid = y if prefix == 0 and y.shape[1] == m else y[:, prefix:prefix + m]
        if self.expand is not None:
            grid = grid.index_select(1, self.expand)
        return grid.reshape(-1, self.k, y.shape[-1])

    def merge(self, x: torch.Tensor, prefix: int = 0) -> torch.Tensor:
        """x [B, prefix + N + suffix, C] -> [B, prefix + R*k + suffix, C]."""
        self._check(x, self.tokens, prefix)
        merge_w, _ = self._cast.get(x.dtype) or self.weights(x.dtype)
        xr = x[self.tables.merge_index(x.shape[0], prefix)]     # region layout [B*R, S, C]
        merged = torch.bmm(merge_w, xr).view(x.shape[0], -1, x.shape[-1])
        if self.compact is not None:      # ragged counts: the real destinations only
            merged = merged.index_select(1, self.compact)
        return self.splice(x, merged, prefix, self.tokens)

    def unmerge(self, y: torch.Tensor, prefix: int = 0) -> torch.Tensor:
        """Inverse of merge: y [B, prefix + R*k + suffix, C] -> [B, prefix + N + suffix, C]."""
        self._check(y, self.merged_tokens, prefix)
        _, unmerge_w = self._cast.get(y.dtype) or self.weights(y.dtype)
        full = torch.bmm(unmerge_w, self._grid_of(y, prefix))        # region layout [B*R, S, C]
        full = full[self.tables.unmerge_index(self.items)]           # grid order [B, N, C]
        return self.splice(y, full, prefix, self.merged_tokens)

    def begin(self, x: torch.Tensor, prefix: int = 0, block_keeps_input: bool = False,
              ordered: bool = False) -> tuple[torch.Tensor, Pending]:
        """Block scope, before the block: (merged stream [B, prefix + R*k + suffix, C], what
        `finish` needs). block_keeps_input: the block leaves its input alone (ComfyUI's UNet
        blocks); otherwise (`img += ...` would overwrite merged) base = xr - U @ merged is taken
        now. ordered: x [B, N, C] is in region order (`finish` with keep_order): no gather."""
        self._check(x, self.tokens, prefix)
        merge_w, unmerge_w = self._cast.get(x.dtype) or self.weights(x.dtype)
        xr = (self._ordered_regions(x, prefix) if ordered
              else x[self.tables.merge_index(x.shape[0], prefix)])      # one gather
        merged = torch.bmm(merge_w, xr)
        grid = merged.view(x.shape[0], -1, x.shape[-1])
        if self.compact is not None:      # ragged counts: the real destinations only
            grid = grid.index_select(1, self.compact)
        stream = self.splice(x, grid, prefix, self.tokens)
        if block_keeps_input:
            return stream, Pending(xr, merged, ordered)
        if ordered:
            return stream, Pending(torch.baddbmm(xr, unmerge_w, merged, alpha=-1), None)
        return stream, Pending(xr.baddbmm_(unmerge_w, merged, alpha=-1), None)

    def finish(self, out: torch.Tensor, pending: Pending, prefix: int = 0,
               keep_order: bool = False) -> torch.Tensor:
        """Block scope, after the block: out [B, prefix + R*k + suffix, C] ->
        [B, prefix + N + suffix, C], the grid being x + U (out - merged), other tokens out's.
        keep_order: the grid in region order, for the next block's `begin(ordered=True)` on
        the same plan (a gather fewer each; even regions, a stream that is only the grid)."""
        self._check(out, self.merged_tokens, prefix)
        grid = self._grid_of(out, prefix)
        base, merged, shared = pending
        if merged is not None:
            grid = grid - merged
        if grid.dtype != base.dtype:   # e.g. a low-precision update onto a float32 stream
            dtype = torch.promote_types(base.dtype, grid.dtype)
            base, grid, shared = base.to(dtype), grid.to(dtype), False
        _, unmerge_w = self._cast.get(base.dtype) or self.weights(base.dtype)
        full = torch.baddbmm(base, unmerge_w, grid) if shared else base.baddbmm_(unmerge_w, grid)
        if keep_order:
            if not self.regions.even or prefix or out.shape[1] != self.merged_tokens:
                raise ValueError(ORDER_NEEDS)
            return full.view(self.items, self.tokens, full.shape[-1])
        full = full[self.tables.unmerge_index(self.items)]          # grid order, one gather
        return self.splice(out, full, prefix, self.merged_tokens)

    def around(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
               prefix: int = 0, block_keeps_input: bool = False, ordered: bool = False,
               keep_order: bool = False) -> torch.Tensor:
        """x + unmerge(fn(merge(x)) - merge(x)) for a residual block `fn` (every token keeps its
        own residual stream); x [B, prefix + N + suffix, C]. Options: see `begin`, `finish`."""
        merged, pending = self.begin(x, prefix, block_keeps_input, ordered)
        return self.finish(fn(merged), pending, prefix, keep_order)

    def grid_order(self, x: torch.Tensor) -> torch.Tensor:
        """A grid in region order (`finish(keep_order=True)`) back in grid order: x [B, N, C]."""
        return self._ordered_regions(x, 0)[self.tables.unmerge_index(self.items)]

    def _ordered_regions(self, x: torch.Tensor, prefix: int) -> torch.Tensor:
        """A grid in region order as region layout: x [B, N, C] -> [B*R, S, C], a view."""
        if not self.regions.even or prefix or x.shape[1] != self.tokens:
            raise ValueError(ORDER_NEEDS)
        return x.view(-1, self.regions.size, x.shape[-1])

    @staticmethod
    def splice(x: torch.Tensor, grid: torch.Tensor, prefix: int, n: int) -> torch.Tensor:
        """x [B, L, ...] with its grid part [prefix, prefix + n) along dim 1 replaced by `grid`
        (`grid` itself, not a copy, when x is only the grid)."""
        tail = x.shape[1] - prefix - n
        parts = ([x[:, :prefix]] if prefix else []) + [grid] + (
            [x[:, prefix + n:]] if tail else [])
        return grid if len(parts) == 1 else torch.cat(parts, dim=1)

    def position_rows(self, length: int, prefix: int = 0) -> torch.Tensor:
        """[B, prefix + R*k + suffix]: the row of a `length`-row sequence (grid from `prefix`)
        each merged position takes: its destination's in the grid, its own elsewhere. Kept."""
        key = (length, prefix)
        if key not in self._rows:
            own = torch.arange(length, device=self.dest_tokens.device).expand(self.items, -1)
            self._rows[key] = self.splice(own, self.dest_tokens + prefix, prefix, self.tokens)
        return self._rows[key]

    def merge_positions(self, pe: torch.Tensor, dim: int, prefix: int = 0) -> torch.Tensor:
        """Positional rows (e.g. RoPE) for the merged sequence, as position_rows picks them:
        pe [B or 1, ..., L, ...] (grid rows [prefix, prefix + N) along `dim`, not 0) ->
        [B, ..., prefix + R*k + suffix, ...] (batch 1 kept when the plan is for one item)."""
        dim = dim % pe.dim()
        if dim == 0 or pe.shape[dim] < prefix + self.tokens or pe.shape[0] not in (1, self.items):
            raise ValueError(f"positions {tuple(pe.shape)} cannot hold {prefix} + {self.tokens} "
                             f"rows along dim {dim} for a batch of {self.items}")
        rows = self.position_rows(pe.shape[dim], prefix)
        if self.items == 1:
            return pe.index_select(dim, rows[0])
        items = torch.arange(self.items, device=pe.device).view(-1, 1) if pe.shape[0] > 1 else 0
        return pe.movedim(dim, 1)[items, rows].movedim(1, dim)        # picked [B, L', ...]


def pseudo_inverse(m: torch.Tensor) -> torch.Tensor:
    """pinv(M) [..., S, k] of merge weights M [..., k, S]: M^T (M M^T)^-1, exact because a
    destination is its own only source (the nonzero rows are independent), by a k x k solve
    where an SVD can fail to converge; zero rows (ragged pad picks) get zero columns."""
    wide = m.to(torch.float32 if m.device.type == "mps" else torch.float64)  # mps: no float64
    gram = wide @ wide.mT
    gram = gram + torch.diag_embed((gram.diagonal(dim1=-2, dim2=-1) == 0).to(gram.dtype))
    return torch.linalg.solve_ex(gram, wide)[0].mT.to(m.dtype)     # no error check: no sync


def build_plan(features: torch.Tensor, h: int, w: int, ratio: float, *,
               mode: RegionMode = "tile", tile_count: int = 64, tau: float = 1000.0,
               unmerge: UnmergeMethod = "transpose", batch: BatchPolicy = "per_item",
               regions: Regions | SpanRegions | None = None, tables: RegionTables | None = None,
               offset: int = 0, center: bool = False, weighted: bool = False) -> MergePlan | None:
    """Plan merging for the grid in features [B, L, C]: N = h * w tokens from row `offset`,
    weights in the features' dtype. ratio: fraction of grid tokens merged away, in [0, 1);
    None when nothing would merge (ratio 0, or regions too small to drop a token).

    regions (video boxes; a shard's SpanRegions bring their own destination counts) replaces
    mode / tile_count and must hold N tokens; tables: its index tensors on this device, when
    the caller keeps them. center, weighted: see plan_op. batch "per_item": destinations and
    weights per item (cond and uncond never mix); "shared": one set from the batch's mean
    features for every item (cheaper, coarser).
    """
    n = h * w
    if features.dim() != 3 or offset < 0 or features.shape[1] < offset + n:
        raise ValueError(f"features must be [B, L, C] holding {n} grid tokens from row {offset}, "
                         f"got {tuple(features.shape)}")
    if not 0 <= ratio < 1:
        raise ValueError(f"ratio must be in [0, 1), got {ratio}")
    if not tau > 0:
        raise ValueError(f"tau must be positive, got {tau}")
    if unmerge not in UNMERGE_METHODS:
        raise ValueError(f"unmerge must be one of {UNMERGE_METHODS}, got {unmerge!r}")
    if batch not in BATCH_POLICIES:
        raise ValueError(f"batch policy must be one of {BATCH_POLICIES}, got {batch!r}")
    if regions is not None and regions.tokens != n:
        raise ValueError(f"regions hold {regions.tokens} tokens, not {h}x{w}")
    regions = regions or make_regions(h, w, mode, tile_count)
    if ratio == 0:
        return None
    ragged = isinstance(regions, SpanRegions)
    k = regions.k if ragged else destinations_per_region(ratio, regions)
    if (sum(regions.counts) if ragged else regions.count * k) >= regions.tokens:
        return None
    tables = tables or regions.tables(features.device)
    dtype = features.dtype
    b = features.shape[0]
    source = features.float().mean(0, keepdim=True) if batch == "shared" else features
    weight_dtype = torch.float32 if unmerge == "pinv" else dtype
    if ragged:
        picks, dest, merge_w, unmerge_w = plan_weights_reference(
            source, offset, tables.slots, tables.valid, k, tau, center, weight_dtype,
            tables.dest_valid, weighted)
        dest = dest.index_select(1, tables.compact)
    else:
        picks, dest, merge_w, unmerge_w = plan_weights(
            source, offset, tables.slots, tables.valid, k, tau, center, weight_dtype, weighted)
    assignment = None
    if unmerge == "pinv":     # P^T kept for key_sizes, which the pseudo-inverse no longer is
        assignment = unmerge_w
        merge_w, unmerge_w = merge_w.to(dtype), pseudo_inverse(merge_w).to(dtype)
    if batch == "shared" and b > 1:
        picks, dest = picks.expand(b, -1, -1), dest.expand(b, -1)
        merge_w, unmerge_w, assignment = (
            None if t is None else t.unsqueeze(0).expand(b, -1, -1, -1).flatten(0, 1)
            for t in (merge_w, unmerge_w, assignment))
    return MergePlan(regions, k, tables, picks, dest, merge_w, unmerge_w, assignment)
