"""The peers ToMA is measured against, as ComfyUI-style block patches (own code, no ComfyUI).

- ToMeSD: tomesd's `bipartite_soft_matching_random2d` (one random destination per 2x2 cell,
  sx = sy = 2, r = int(ratio * N) tokens merged away by bipartite matching), applied in the same
  two scopes as ToMA. As in tomesd, the matching is recomputed at every block call, from the
  block's input x (block scope) or the normed tokens (attention scope: the attn1 patch sees no x).
- ToDo (token downsampling): keys and values of self-attention are 2x2 average-pooled
  (N -> N / 4), queries stay full, so nothing needs unmerging. Pooling before the K/V projections
  equals pooling after them (they are linear), so it is one attn1 patch.

Patches follow ComfyUI's conventions: `attn1_patch(n, context, value, extra_options)` returns
(n, context, value) [B, L, C] each; `attn1_output_patch(n, extra_options)` returns [B, N, C];
a block forward replacement has the signature of `BasicTransformerBlock.forward`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

_SLOT = "bench_tomesd_unmerge"


def tomesd_matching() -> Callable | None:
    """tomesd's `bipartite_soft_matching_random2d`, or None when tomesd is not installed."""
    try:
        from tomesd.merge import bipartite_soft_matching_random2d
    except ImportError:
        return None
    return bipartite_soft_matching_random2d


class ToMeSD:
    """tomesd merging for an h x w grid at `ratio`; `generator` draws the random destinations."""

    def __init__(self, h: int, w: int, ratio: float, generator: torch.Generator) -> None:
        self.matching = tomesd_matching()
        if self.matching is None:
            raise ImportError("tomesd is not installed (pip install tomesd)")
        self.h, self.w, self.generator = h, w, generator
        self.r = int(ratio * h * w)

    def merged_tokens(self) -> int:
        """Tokens after merging (tomesd can remove at most the 3/4 that are not destinations)."""
        n = self.h * self.w
        return n - min(self.r, n - (self.h // 2) * (self.w // 2))

    def match(self, metric: torch.Tensor) -> tuple[Callable, Callable]:
        """(merge, unmerge) for metric [B, N, C]: merge [B, N, C] -> [B, N', C] and back."""
        return self.matching(metric, self.w, self.h, 2, 2, self.r, no_rand=False,
                             generator=self.generator)

    def attn1_patch(self, n: torch.Tensor, context: torch.Tensor, value: torch.Tensor,
                    extra_options: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Merge self-attention's queries, keys and values: [B, N, C] -> [B, N', C]."""
        merge, unmerge = self.match(n)
        extra_options[_SLOT] = unmerge
        merged = merge(n)
        return merged, merged, merged

    def attn1_output_patch(self, n: torch.Tensor, extra_options: dict) -> torch.Tensor:
        """Unmerge self-attention's output: [B, N', C] -> [B, N, C]."""
        return extra_options.pop(_SLOT)(n)

    def block_forward(self, original: Callable) -> Callable:
        """Block replacement: x + unmerge(block(merge(x)) - merge(x)), matching on x."""

        def forward(x: torch.Tensor, context: torch.Tensor | None = None,
                    transformer_options: dict | None = None) -> torch.Tensor:
            merge, unmerge = self.match(x)
            merged = merge(x)
            update = original(merged, context=context,
                              transformer_options=transformer_options or {}) - merged
            return x + unmerge(update)

        return forward


def todo_attn1_patch(h: int, w: int) -> Callable:
    """ToDo's attn1 patch for an h x w grid: keys/values [B, N, C] -> [B, (h/2)(w/2), C]."""

    def patch(n: torch.Tensor, context: torch.Tensor, value: torch.Tensor,
              extra_options: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, _, c = n.shape
        grid = n.transpose(1, 2).reshape(b, c, h, w)
        pooled = F.avg_pool2d(grid, 2).flatten(2).transpose(1, 2)
        return n, pooled, pooled

    return patch


def todo_tokens(h: int, w: int) -> int:
    """Keys/values ToDo's self-attention runs on."""
    return (h // 2) * (w // 2)
