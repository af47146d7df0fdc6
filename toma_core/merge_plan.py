"""The merge plan: destinations plus merge/unmerge weights, computed once, applied many times.

For each region with tokens X [S, C] and destinations D (k slots):
    P = softmax over destinations of tau * cos(X[D], X)      [k, S], each column sums to 1
    merge(x)   = M x      with M = P row-normalised (a merged token is the mean of its sources)
    unmerge(y) = P^T y    (rows sum to 1, so it commutes with a linear layer plus bias)
or, as an option, unmerge(y) = pinv(M) y. Both are batched matmuls over all regions at once.

A destination is its own only source (its column of P is one-hot), so M's destination columns
are diagonal and P^T's destination rows are one-hot. merge and unmerge use that: with each
region's slots ordered destinations first, then the S - k other slots ("sources"),
    merge(x)   = diag(M_dd) x_D + M_src x_src       [k, S - k] x [S - k, C]
    unmerge(y) = y at the destinations, P^T_src y at the sources    [S - k, k] x [k, C]
which is the dense product with the known zeros skipped: S / (S - k) times fewer FLOPs (2x at
ratio 0.5, 4x at 0.25), the region layout taken by one gather instead of a reshape copy. Dense
products stay the fallback for weights without that structure (pinv unmerge).

A plan holds weights for B items ([B, R, k, S]) or one shared set ([1, R, k, S]) that broadcasts
over any batch. It merges any tensor laid out [B, L, C] or [B, heads, L, D] whose sequence holds
the N grid tokens after `prefix` other tokens (text) and before any suffix (reference images);
those other tokens pass through untouched.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

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


class _Weights(NamedTuple):
    """A plan's index and weight tensors in one dtype and device (see `MergePlan._weights`).

    The "sources" of a region are its S - k slots that are not destinations, ascending.
    """

    dest_ids: torch.Tensor        # [B', R*k] grid token of each merged row (= dest_tokens)
    src_ids: torch.Tensor         # [B', R*(S-k)] grid token of each source slot (pads: 0)
    inverse: torch.Tensor         # [B', N] row of each grid token in [merged | sources]
    merge_dest: torch.Tensor      # [B', R, k, 1] M's diagonal at the destinations
    merge_src: torch.Tensor       # [B', R, k, S-k] M at the sources
    unmerge_src: torch.Tensor | None    # [B', R, S-k, k] U at the sources, or None:
    unmerge_dense: torch.Tensor | None  # [B', R, S, k] U without that structure (pinv)


@dataclass
class MergePlan:
    """Merge/unmerge for one token grid. Build it with `build_plan`.

    regions: the partition; k: destinations per region.
    dest_slots [B', R, k]: chosen slot per destination; dest_tokens [B', R*k]: their grid index
    (the merged sequence order). merge_w [B', R, k, S], unmerge_w [B', R, S, k], float32: the
    dense weights (the definition; merge and unmerge skip their known zeros, see the module
    docstring). Each destination must be its own only source (M's destination columns
    diagonal), as `build_plan` makes it.
    """

    regions: Regions
    k: int
    dest_slots: torch.Tensor
    dest_tokens: torch.Tensor
    merge_w: torch.Tensor
    unmerge_w: torch.Tensor
    _compact: _Weights = field(init=False, repr=False)
    _cast: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._compact = _compact_weights(self.regions, self.dest_slots, self.dest_tokens,
                                         self.merge_w, self.unmerge_w)

    @property
    def tokens(self) -> int:
        """N, grid tokens before merging."""
        return self.regions.h * self.regions.w

    @property
    def merged_tokens(self) -> int:
        """Grid tokens after merging (R * k)."""
        return self.regions.count * self.k

    def _weights(self, x: torch.Tensor) -> _Weights:
        """The plan's tensors in x's dtype (weights) and device, cast once and kept."""
        key = (x.dtype, x.device)
        if key not in self._cast:
            self._cast[key] = _Weights(*(
                t if t is None else t.to(x.device, x.dtype if t.is_floating_point() else None)
                for t in self._compact))
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
        n, r, k, s = self.tokens, self.regions.count, self.k, self.regions.size
        self._check(x, n, prefix)
        w = self._weights(x)
        lead, c = x.shape[:-2], x.shape[-1]
        merged = _take(x, w.dest_ids, prefix)                       # [..., R*k, C], a new tensor
        merged.view(*lead, r, k, c).mul_(self._heads(w.merge_dest, x))
        sources = _take(x, w.src_ids, prefix)                       # [..., R*(S-k), C]
        weights = self._heads(w.merge_src, x).expand(*lead, r, k, s - k)
        merged.view(-1, k, c).baddbmm_(weights.reshape(-1, k, s - k), sources.view(-1, s - k, c))
        return self.splice(x, merged, prefix, n)

    def unmerge(self, y: torch.Tensor, prefix: int = 0) -> torch.Tensor:
        """Inverse of merge: y [B, prefix + R*k + suffix, C] -> [B, prefix + N + suffix, C]."""
        m = self.merged_tokens
        self._check(y, m, prefix)
        w = self._weights(y)
        grid = y[..., prefix:prefix + m, :]
        blocks = grid.unflatten(-2, (self.regions.count, self.k))       # [..., R, k, C]
        if w.unmerge_dense is not None:
            restored = self.regions.join(self._heads(w.unmerge_dense, y) @ blocks)
            return self.splice(y, restored, prefix, m)
        sources = torch.matmul(self._heads(w.unmerge_src, y), blocks)   # [..., R, S-k, C]
        # Destinations come back unchanged (their rows of P^T are one-hot): one gather from
        # [y | sources] puts every grid token, and y's prefix and suffix rows, in place.
        rows = _unmerge_rows(w.inverse, prefix, y.shape[-2], m)
        return _take(torch.cat((y, sources.flatten(-3, -2)), -2), rows)

    def around(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
               prefix: int = 0) -> torch.Tensor:
        """Run a residual block `fn` on merged tokens and unmerge only its update:
        x + unmerge(fn(merge(x)) - merge(x)), so every token keeps its own residual stream.
        x [B, prefix + N + suffix, C]; fn maps the merged sequence to one of the same shape.
        """
        merged = self.merge(x, prefix)
        return self.unmerge_onto(fn(merged) - merged, x, prefix)

    def unmerge_onto(self, update: torch.Tensor, base: torch.Tensor,
                     prefix: int = 0) -> torch.Tensor:
        """base + unmerge(update, prefix); base [B, prefix + N + suffix, C]."""
        full = self.unmerge(update, prefix)
        # unmerge returns a new tensor: adding base into it saves a full-length allocation
        # (unless the dtypes differ, where base + full promotes and in place would not)
        return full.add_(base) if full.dtype == base.dtype else base + full

    @staticmethod
    def splice(x: torch.Tensor, grid: torch.Tensor, prefix: int, n: int) -> torch.Tensor:
        """x with its grid part [prefix, prefix + n) replaced by `grid` (`grid` itself, not a
        copy, when x is only the grid)."""
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


def _compact_weights(regions: Regions, dest_slots: torch.Tensor, dest_tokens: torch.Tensor,
                     merge_w: torch.Tensor, unmerge_w: torch.Tensor) -> _Weights:
    """Source slots and the weights merge/unmerge multiply with; checks that each destination
    is its own only source. Shapes as in MergePlan and _Weights."""
    b, r, k = dest_slots.shape
    s, n, device = regions.size, regions.h * regions.w, dest_slots.device
    eye = torch.eye(k, dtype=torch.bool, device=device)
    at_dest = merge_w.gather(-1, dest_slots.unsqueeze(-2).expand(b, r, k, k))  # M[i, d_j]
    if at_dest.masked_fill(eye, 0).any():
        raise ValueError("merge weights must keep each destination its own only source")
    is_dest = torch.zeros(b, r, s, dtype=torch.uint8, device=device).scatter_(-1, dest_slots, 1)
    src = is_dest.argsort(dim=-1, stable=True)[..., :s - k]                     # [B', R, S-k]
    src_ids = regions.token_ids(device).expand(b, r, s).gather(-1, src).flatten(1)
    # Pad slots (ragged regions) are sources with no weight; their rows go to a spare column N.
    real = src_ids if regions.valid is None else torch.where(
        regions.valid.to(device).expand(b, r, s).gather(-1, src).flatten(1), src_ids, n)
    inverse = torch.empty(b, n + 1, dtype=torch.long, device=device).scatter_(
        1, torch.cat((dest_tokens, real), 1), torch.arange(r * s, device=device).expand(b, -1))
    u_dest = unmerge_w.gather(-2, dest_slots.unsqueeze(-1).expand(b, r, k, k))  # U[d_i, j]
    one_hot = torch.equal(u_dest, eye.to(u_dest.dtype).expand(b, r, k, k))
    return _Weights(
        dest_tokens, src_ids, inverse[:, :n].contiguous(),
        merge_w.gather(-1, dest_slots.unsqueeze(-1)),
        merge_w.gather(-1, src.unsqueeze(-2).expand(b, r, k, s - k)),
        unmerge_w.gather(-2, src.unsqueeze(-1).expand(b, r, s - k, k)) if one_hot else None,
        None if one_hot else unmerge_w)


def _take(x: torch.Tensor, ids: torch.Tensor, prefix: int = 0) -> torch.Tensor:
    """Rows prefix + ids of x along its sequence dim, ids per batch item or shared: one gather.

    x [B, L, C] or [B, heads, L, D]; ids [1 or B, M] -> a new tensor [B, (heads,) M, C].
    """
    if ids.shape[0] == 1:
        return x.index_select(-2, ids[0] + prefix if prefix else ids[0])
    lead, (length, c) = x.shape[:-2], x.shape[-2:]
    items = torch.arange(math.prod(lead), device=ids.device).view(lead[0], -1, 1) * length
    rows = (items + (ids + prefix).unsqueeze(1)).flatten()
    return x.reshape(-1, c).index_select(0, rows).view(*lead, ids.shape[1], c)


def _unmerge_rows(inverse: torch.Tensor, prefix: int, length: int, merged: int) -> torch.Tensor:
    """Rows of [y | sources] that make the unmerged sequence: y's prefix, every grid token, y's
    suffix. inverse [B', N] indexes [merged | sources]; y has `length` rows, `merged` of them
    the grid's after `prefix`. -> [B', prefix + N + suffix]."""
    grid = torch.where(inverse < merged, inverse + prefix, inverse + (length - merged))
    keep = torch.arange(length, device=inverse.device).expand(inverse.shape[0], -1)
    return torch.cat((keep[:, :prefix], grid, keep[:, prefix + merged:]), -1)


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
