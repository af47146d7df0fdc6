"""Destination selection: batched greedy facility location inside each region.

f(D) = sum_j max_{d in D} (sim(j, d) + 1) over a region's tokens j, sim the cosine similarity:
the +1 makes f non-negative with f({}) = 0 and changes no greedy choice, so the greedy keeps its
(1 - 1/e) guarantee. The k picks are sequential, each one batched op over every region and item.
"""

from __future__ import annotations

import torch


def gram_similarity(x: torch.Tensor, valid: torch.Tensor | None = None,
                    eps: float = 1e-6) -> torch.Tensor:
    """Cosine similarity inside each region from raw features: x [..., S, C] -> [..., S, S].

    The float32 Gram matrix scaled by the inverse norms off its diagonal (at least `eps`), with
    no normalised copy of x. Pad slots (valid False, [R, S]) get -1 to everything: no coverage.
    """
    x = x.float()
    gram = x @ x.transpose(-1, -2)
    inv = gram.diagonal(dim1=-2, dim2=-1).clamp_min(eps * eps).rsqrt()
    sim = gram.mul_(inv.unsqueeze(-1)).mul_(inv.unsqueeze(-2))
    if valid is not None:
        sim.masked_fill_(~(valid[..., :, None] & valid[..., None, :]), -1.0)
    return sim


def greedy_facility_location(sim: torch.Tensor, k: int, valid: torch.Tensor | None = None,
                             weight: torch.Tensor | None = None) -> torch.Tensor:
    """Pick k destinations per region greedily: picks [..., k] (distinct slots, in pick order,
    ties to the lowest slot). sim [..., S, S] (`gram_similarity`); valid [R, S] or None; weight
    [..., S] (non-negative) or None: what covering each token counts (still submodular).
    k must not exceed the smallest region's valid slots (unchecked: a check would sync)."""
    s = sim.shape[-1]
    if not 1 <= k <= s:
        raise ValueError(f"k must be in [1, {s}], got {k}")
    cover = torch.zeros(sim.shape[:-1], dtype=sim.dtype, device=sim.device)   # [..., S]
    blocked = torch.zeros(sim.shape[:-1], dtype=torch.bool, device=sim.device)
    if valid is not None:
        blocked = blocked | ~valid
    shifted = sim + 1.0
    buf = torch.empty_like(shifted)
    picks = []
    for _ in range(k):
        # gain(v) = sum_j relu(shifted[v, j] - cover[j]), into one reused [..., S, S] buffer.
        gain = torch.sub(shifted, cover.unsqueeze(-2), out=buf).clamp_min_(0)
        gain = (gain if weight is None else gain.mul_(weight.unsqueeze(-2))).sum(-1)
        pick = gain.masked_fill_(blocked, -1.0).argmax(-1, keepdim=True)   # [..., 1]
        row = shifted.gather(-2, pick.unsqueeze(-1).expand(*pick.shape, s)).squeeze(-2)
        torch.maximum(cover, row, out=cover)
        blocked.scatter_(-1, pick, True)
        picks.append(pick)
    return torch.cat(picks, -1)

