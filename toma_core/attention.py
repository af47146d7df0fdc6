"""Attention over merged tokens, each key weighted by how many grid tokens it stands for.

A merged key draws the attention of one key where its n sources drew n times as much, which
moves the whole output where a few tokens draw most of it (attention sinks): log(n) on its logit
gives back their weight (ToMe's proportional attention). Tokens outside the grid get bias 0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .merge_plan import MergePlan
from .regions import compiling

# attend(tokens [B, L', C], bias [B, 1, 1, L'] additive on the keys' logits, or None) -> [B, L', C]
Attend = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


def key_sizes(plan: MergePlan) -> torch.Tensor:
    """[B, merged_tokens] float32: how many grid tokens each merged token stands for (its row
    of P summed), the keys' weights."""
    p_t = plan.unmerge_w if plan.assignment is None else plan.assignment
    sizes = p_t.sum(1, dtype=torch.float32).view(plan.items, -1)
    return sizes if plan.compact is None else sizes.index_select(1, plan.compact)


def size_bias(plan: MergePlan, length: int, prefix: int = 0,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The additive mask of size-weighted attention for a merged sequence of `length` tokens
    whose grid starts at `prefix`: [B, 1, 1, length], log(size) over the grid, 0 elsewhere.
    Kept in plan.size_biases by (length, prefix, dtype)."""
    key = (length, prefix, dtype)
    found = plan.size_biases.get(key)
    if found is None:
        bias = key_sizes(plan).log()
        tail = length - prefix - bias.shape[1]
        if prefix or tail:
            bias = torch.nn.functional.pad(bias, (prefix, tail))
        found = bias.to(dtype)[:, None, None]
        if not compiling():     # a traced graph makes its own (a kept one is guarded on)
            plan.size_biases[key] = found
    return found


def merged_attention(plan: MergePlan, x: torch.Tensor, attend: Attend, prefix: int = 0,
                     size_weighted: bool = True) -> torch.Tensor:
    """ToMA around any attention: x [B, prefix + N + suffix, C] merged, attended with the size
    bias (size_weighted) and unmerged -> [B, prefix + N + suffix, C]."""
    merged = plan.merge(x, prefix)
    bias = size_bias(plan, merged.shape[1], prefix, x.dtype) if size_weighted else None
    return plan.unmerge(attend(merged, bias), prefix)
