"""Partition of an h x w token grid into merge regions (tiles, row stripes or one global region).

Tokens are in row-major order (a UNet's flattened feature map, Flux's image tokens). Every token
belongs to exactly one region. Regions are laid out as a padded [R, S] table so that selection and
merging run as one batched tensor op over all regions:

- When the grid divides evenly into equal regions, moving tokens into region layout is a view
  (`x.view(...)`) plus the one permute-copy that batched matmuls need; no index tensors.
- Otherwise region sides differ by at most one token; the table is padded to the largest region
  and moved with a gather, pad slots marked invalid so they never count nor get picked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

RegionMode = Literal["tile", "stripe", "global"]
REGION_MODES: tuple[str, ...] = ("tile", "stripe", "global")


@dataclass(frozen=True)
class Regions:
    """R regions of an h x w grid, each padded to S slots.

    rows, cols: how many regions along each grid side (stripes: cols == 1; global: 1 x 1).
    row_sizes, col_sizes: token extent of each region row / column (sum to h / w).
    index: [R, S] token index of each slot (pad slots point at token 0), or None when even.
    valid: [R, S] bool, False at pad slots, or None when even.
    inverse: [N] flat slot (r * S + s) holding each token, or None when even.
    """

    h: int
    w: int
    rows: int
    cols: int
    row_sizes: tuple[int, ...]
    col_sizes: tuple[int, ...]
    index: torch.Tensor | None
    valid: torch.Tensor | None
    inverse: torch.Tensor | None

    @property
    def count(self) -> int:
        """Number of regions R."""
        return self.rows * self.cols

    @property
    def size(self) -> int:
        """Slots per region S (the largest region)."""
        return max(self.row_sizes) * max(self.col_sizes)

    @property
    def min_size(self) -> int:
        """Tokens in the smallest region."""
        return min(self.row_sizes) * min(self.col_sizes)

    @property
    def even(self) -> bool:
        """True when all regions have the same shape (zero-index fast path)."""
        return self.index is None

    def to(self, device: torch.device) -> Regions:
        """The same partition with its index tensors on `device`."""
        if self.even or self.index.device == device:
            return self
        return Regions(self.h, self.w, self.rows, self.cols, self.row_sizes, self.col_sizes,
                       self.index.to(device), self.valid.to(device), self.inverse.to(device))

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """Grid tokens into region layout: x [..., N, C] -> [..., R, S, C]."""
        lead, c = x.shape[:-2], x.shape[-1]
        if self.even:
            a, b = self.row_sizes[0], self.col_sizes[0]
            x = x.reshape(*lead, self.rows, a, self.cols, b, c)
            return x.transpose(-4, -3).reshape(*lead, self.count, a * b, c)
        out = x.index_select(-2, self.index.reshape(-1))
        return out.reshape(*lead, self.count, self.size, c)

    def join(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of split: x [..., R, S, C] -> [..., N, C] (pad slots dropped)."""
        lead, c = x.shape[:-3], x.shape[-1]
        if self.even:
            a, b = self.row_sizes[0], self.col_sizes[0]
            x = x.reshape(*lead, self.rows, self.cols, a, b, c)
            return x.transpose(-4, -3).reshape(*lead, self.h * self.w, c)
        return x.reshape(*lead, self.count * self.size, c).index_select(-2, self.inverse)

    def token_ids(self, device: torch.device | None = None) -> torch.Tensor:
        """[R, S] grid index of each slot (pad slots: 0)."""
        if self.even:
            ids = torch.arange(self.h * self.w, device=device).view(1, self.h * self.w, 1)
            return self.split(ids)[0, ..., 0]
        return self.index.to(device)


def even_sizes(total: int, parts: int) -> tuple[int, ...]:
    """Split `total` into `parts` sizes differing by at most one (larger ones first)."""
    base, extra = divmod(total, parts)
    return tuple(base + 1 if i < extra else base for i in range(parts))


def tile_grid(h: int, w: int, tile_count: int) -> tuple[int, int]:
    """Tiles along each side for about `tile_count` near-square tiles on an h x w grid.

    The tile side follows the grid's aspect so that 832x1216 gets taller-than-wide tile rows
    rather than thin tiles. Tiles are at least 2 tokens per side where the grid allows it:
    a 1-token tile could only keep itself, which merges nothing.
    """
    side = math.sqrt(h * w / max(tile_count, 1))
    rows = min(max(1, round(h / side)), max(1, h // 2))
    cols = min(max(1, round(w / side)), max(1, w // 2))
    return rows, cols


def make_regions(h: int, w: int, mode: RegionMode = "tile", tile_count: int = 64) -> Regions:
    """Partition an h x w grid.

    mode "tile": about `tile_count` tiles; "stripe": `tile_count` bands of whole rows (at most h);
    "global": one region holding every token.
    """
    if h < 1 or w < 1:
        raise ValueError(f"token grid must be at least 1x1, got {h}x{w}")
    if mode == "tile":
        rows, cols = tile_grid(h, w, tile_count)
    elif mode == "stripe":
        rows, cols = min(max(1, tile_count), h), 1
    elif mode == "global":
        rows, cols = 1, 1
    else:
        raise ValueError(f"region mode must be one of {REGION_MODES}, got {mode!r}")
    row_sizes, col_sizes = even_sizes(h, rows), even_sizes(w, cols)
    if len(set(row_sizes)) == 1 and len(set(col_sizes)) == 1:
        return Regions(h, w, rows, cols, row_sizes, col_sizes, None, None, None)
    return _ragged(h, w, row_sizes, col_sizes)


def _ragged(h: int, w: int, row_sizes: tuple[int, ...], col_sizes: tuple[int, ...]) -> Regions:
    """Padded index tables for regions whose sides differ by one token."""
    a, b = max(row_sizes), max(col_sizes)
    r0 = torch.tensor((0,) + row_sizes).cumsum(0)
    c0 = torch.tensor((0,) + col_sizes).cumsum(0)
    dy, dx = torch.arange(a), torch.arange(b)
    y = r0[:-1, None, None, None] + dy[None, None, :, None]          # [rows, 1, a, 1]
    x = c0[None, :-1, None, None] + dx[None, None, None, :]          # [1, cols, 1, b]
    ok = (dy[None, None, :, None] < torch.tensor(row_sizes)[:, None, None, None]) & (
        dx[None, None, None, :] < torch.tensor(col_sizes)[None, :, None, None])
    count, size = len(row_sizes) * len(col_sizes), a * b
    valid = ok.expand(len(row_sizes), len(col_sizes), a, b).reshape(count, size)
    index = torch.where(valid, (y * w + x).reshape(count, size), 0)
    inverse = torch.empty(h * w, dtype=torch.long)
    inverse[index[valid]] = torch.arange(count * size).view(count, size)[valid]
    return Regions(h, w, len(row_sizes), len(col_sizes), row_sizes, col_sizes,
                   index, valid, inverse)
