"""The merge plan: destinations plus merge/unmerge weights, computed once, applied many times.

For each region with tokens X [S, C] and destinations D (k slots):
    P = softmax over destinations of tau * cos(X[D], X)      [k, S], each column sums to 1
    merge(x)   = M x      with M = P row-normalised (a merged token is the mean of its sources)
    unmerge(y) = P^T y    (rows sum to 1, so it commutes with a linear layer plus bias)
or, as an option, unmerge(y) = pinv(M) y. Both are batched matmuls over all regions at once.

A plan holds weights for B items ([B, R, k, S]) or one shared set ([1, R, k, S]) that broadcasts
over any batch. It merges any tensor laid out [B, L, C] or [B, heads, L, D] whose sequence holds
the N grid tokens after `prefix` other tokens (text) and before any suffix (reference images);
those other tokens pass through untouched.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from .facility_location import gram_similarity, greedy_facility_location
from .regions import REGION_MODES, RegionMode, Regions, make_regions

UnmergeMethod = Literal["transpose", "pinv"]
BatchPolicy = Literal["per_item", "shared"]
UNMERGE_METHODS: tuple[str, ...] = ("transpose", "pinv")
BATCH_POLICIES: tuple[str, ...] = ("per_item", "shared")


def destinations_per_region(ratio: float, regions: Regions) -> int:
    """k, the same for every region: round((1 - ratio) * N / R), clamped to [1, smallest region].

    With ragged regions (sides differing by one token) the larger regions merge a little harder,
    and the merged count R * k stays close to (1 - ratio) * N.
    """
    n = regions.h * regions.w
    return min(max(1, round((1.0 - ratio) * n / regions.count)), regions.min_size)


@dataclass
class MergePlan:
    """Merge/unmerge for one token grid. Build it with `build_plan`.

    regions: the partition; k: destinations per region.
    dest_slots [B', R, k]: chosen slot per destination; dest_tokens [B', R*k]: their grid index
    (the merged sequence order). merge_w [B', R, k, S], unmerge_w [B', R, S, k], float32.
    """

    regions: Regions
    k: int
    dest_slots: torch.Tensor
    dest_tokens: torch.Tensor
    merge_w: torch.Tensor
    unmerge_w: torch.Tensor
    _cast: dict = field(default_factory=dict, repr=False)

    @property
    def tokens(self) -> int:
        """N, grid tokens before merging."""
        return self.regions.h * self.regions.w

    @property
    def merged_tokens(self) -> int:
        """Grid tokens after merging (R * k)."""
        return self.regions.count * self.k

    def _weights(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """merge_w and unmerge_w in x's dtype and device, cast once and kept."""
        key = (x.dtype, x.device)
        if key not in self._cast:
            self._cast[key] = (self.merge_w.to(x.device, x.dtype),
                               self.unmerge_w.to(x.device, x.dtype))
        return self._cast[key]

    def _check(self, x: torch.Tensor, length: int, prefix: int) -> None:
        if x.dim() not in (3, 4):
            raise ValueError(f"expected [B, L, C] or [B, heads, L, D], got {tuple(x.shape)}")
        if prefix < 0 or x.shape[-2] < prefix + length:
            raise ValueError(f"sequence of {x.shape[-2]} tokens cannot hold {prefix} prefix "
                             f"tokens and {length} grid tokens")
        if self.merge_w.shape[0] not in (1, x.shape[0]):
            raise ValueError(f"plan built for batch {self.merge_w.shape[0]}, got {x.shape[0]}")

    @staticmethod
    def _heads(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Weights [B', R, a, b] lined up with x's leading dims ([B, heads, ...] gets a 1)."""
        return w.unsqueeze(1) if x.dim() == 4 else w

    def merge(self, x: torch.Tensor, prefix: int = 0) -> torch.Tensor:
        """x [B, prefix + N + suffix, C] (or [B, heads, L, D]) -> [B, prefix + R*k + suffix, C]."""
        n = self.tokens
        self._check(x, n, prefix)
        m, _ = self._weights(x)
        grid = x[..., prefix:prefix + n, :]
        merged = (self._heads(m, x) @ self.regions.split(grid)).flatten(-3, -2)
        return self._splice(x, merged, prefix, n)

    def unmerge(self, y: torch.Tensor, prefix: int = 0) -> torch.Tensor:
        """Inverse of merge: y [B, prefix + R*k + suffix, C] -> [B, prefix + N + suffix, C]."""
        n = self.merged_tokens
        self._check(y, n, prefix)
        _, u = self._weights(y)
        grid = y[..., prefix:prefix + n, :].unflatten(-2, (self.regions.count, self.k))
        restored = self.regions.join(self._heads(u, y) @ grid)
        return self._splice(y, restored, prefix, n)

    def around(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
               prefix: int = 0) -> torch.Tensor:
        """Run a residual block `fn` on merged tokens and unmerge only its update:
        x + unmerge(fn(merge(x)) - merge(x)), so every token keeps its own residual stream.
        x [B, prefix + N + suffix, C]; fn maps the merged sequence to one of the same shape.
        """
        merged = self.merge(x, prefix)
        return x + self.unmerge(fn(merged) - merged, prefix)

    @staticmethod
    def _splice(x: torch.Tensor, grid: torch.Tensor, prefix: int, n: int) -> torch.Tensor:
        """x with its grid part [prefix, prefix + n) replaced by `grid`."""
        if prefix == 0 and x.shape[-2] == n:
            return grid
        return torch.cat((x[..., :prefix, :], grid, x[..., prefix + n:, :]), dim=-2)

    def merge_positions(self, pe: torch.Tensor, dim: int, prefix: int = 0) -> torch.Tensor:
        """Positional rows (e.g. RoPE) for the merged sequence: each merged token takes the row of
        its destination; rows outside the grid are kept. pe has the grid rows at
        [prefix, prefix + N) along `dim` (not 0); a batch of 1 is expanded when destinations
        differ per item. pe [B or 1, ..., L, ...] -> [B', ..., prefix + R*k + suffix, ...].
        """
        dim = dim % pe.dim()
        n = self.tokens
        if dim == 0 or pe.shape[dim] < prefix + n:
            raise ValueError(f"positions {tuple(pe.shape)} cannot hold {prefix} + {n} rows "
                             f"along dim {dim}")
        keep = torch.arange(pe.shape[dim], device=pe.device)
        rows = [torch.cat((keep[:prefix], prefix + t.to(pe.device), keep[prefix + n:]))
                for t in self.dest_tokens]
        if len(rows) == 1:
            return pe.index_select(dim, rows[0])
        items = pe.expand(len(rows), *pe.shape[1:])
        return torch.stack([items[i].index_select(dim - 1, r) for i, r in enumerate(rows)])


def _assignment(sim: torch.Tensor, picks: torch.Tensor, tau: float,
                valid: torch.Tensor | None) -> torch.Tensor:
    """P [..., k, S]: softmax over destinations of tau * cos(dest, token); tau = inf is hard.

    sim [..., S, S] is the region's cosine similarity (float32), so the scores are its rows at
    the picks; softmax subtracts the column max, so any tau is stable. Pad slot columns are zero.
    """
    scores = sim.gather(-2, picks.unsqueeze(-1).expand(*picks.shape, sim.shape[-1]))
    if math.isinf(tau):
        best = scores.argmax(-2, keepdim=True)
        p = torch.zeros_like(scores).scatter_(-2, best, 1.0)
    else:
        p = torch.softmax(scores.mul_(tau), dim=-2)
    # A destination is its own source: keep that exact so no merged token is ever empty.
    is_dest = torch.zeros(sim.shape[:-1], dtype=torch.bool, device=sim.device)
    is_dest.scatter_(-1, picks, True)                                      # [..., S]
    p.masked_fill_(is_dest.unsqueeze(-2), 0.0).scatter_(-1, picks.unsqueeze(-1), 1.0)
    if valid is not None:
        p.mul_(valid.unsqueeze(-2))
    return p


def build_plan(features: torch.Tensor, h: int, w: int, ratio: float, *,
               mode: RegionMode = "tile", tile_count: int = 64, tau: float = 1000.0,
               unmerge: UnmergeMethod = "transpose", batch: BatchPolicy = "per_item",
               regions: Regions | None = None) -> MergePlan | None:
    """Plan merging for features [B, N, C] on an h x w grid (N == h * w).

    ratio: fraction of grid tokens merged away, in [0, 1). Returns None when nothing would merge
    (ratio 0, or regions too small to drop a token): callers then skip merging entirely.
    batch "per_item": destinations and weights per batch item (cond and uncond never mix);
    "shared": one set from the batch's mean features, applied to every item (cheaper, coarser).
    """
    _validate(features, h, w, ratio, tau, unmerge, batch)
    if regions is None and mode not in REGION_MODES:
        raise ValueError(f"region mode must be one of {REGION_MODES}, got {mode!r}")
    if regions is not None and (regions.h, regions.w) != (h, w):
        raise ValueError(f"regions are for a {regions.h}x{regions.w} grid, not {h}x{w}")
    if ratio == 0:
        return None
    regions = (regions or make_regions(h, w, mode, tile_count)).to(features.device)
    k = destinations_per_region(ratio, regions)
    if regions.count * k >= h * w:
        return None
    feats = features.float().mean(0, keepdim=True) if batch == "shared" else features
    valid = regions.valid
    sim = gram_similarity(regions.split(feats), valid)                     # [B', R, S, S]
    picks = greedy_facility_location(sim, k, valid)                        # [B', R, k]
    p = _assignment(sim, picks, tau, valid)
    m = p / p.sum(-1, keepdim=True)
    # Contiguous: batched matmuls with a transposed [S, k] operand run up to 3x slower on CPU.
    u = torch.linalg.pinv(m) if unmerge == "pinv" else p.transpose(-1, -2).contiguous()
    slots = regions.token_ids(features.device)                             # [R, S]
    dest_tokens = slots.expand(picks.shape[0], -1, -1).gather(-1, picks).flatten(1)
    return MergePlan(regions, k, picks, dest_tokens, m, u)


def _validate(features: torch.Tensor, h: int, w: int, ratio: float, tau: float,
              unmerge: str, batch: str) -> None:
    if features.dim() != 3 or features.shape[1] != h * w:
        raise ValueError(f"features must be [B, {h}*{w}, C], got {tuple(features.shape)}")
    if not 0 <= ratio < 1:
        raise ValueError(f"ratio must be in [0, 1), got {ratio}")
    if not tau > 0:
        raise ValueError(f"tau must be positive, got {tau}")
    if unmerge not in UNMERGE_METHODS:
        raise ValueError(f"unmerge must be one of {UNMERGE_METHODS}, got {unmerge!r}")
    if batch not in BATCH_POLICIES:
        raise ValueError(f"batch policy must be one of {BATCH_POLICIES}, got {batch!r}")
