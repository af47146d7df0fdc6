"""Destination selection: batched greedy facility location inside each region.

f(D) = sum_j max_{d in D} (sim(j, d) + 1) over the tokens j of a region, sim the cosine
similarity. The +1 shift makes f non-negative with f({}) = 0 while leaving every greedy choice
unchanged (the first pick is still the token with the largest row sum), so the greedy keeps its
(1 - 1/e) guarantee. The loop over the k picks is sequential; each pick is one batched op over
every region of every batch item.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def normalized(x: torch.Tensor) -> torch.Tensor:
    """L2-normalised float32 copy of features x [..., C] (cosine similarity is a dot product)."""
    return F.normalize(x.float(), dim=-1, eps=1e-6)


def similarity(xn: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Cosine similarity inside each region: xn [..., S, C] normalised -> [..., S, S].

    Pad slots (valid False, [R, S]) get similarity -1 to everything, i.e. 0 after the shift:
    they add nothing to any coverage.
    """
    sim = xn @ xn.transpose(-1, -2)
    if valid is not None:
        pad = ~(valid[..., :, None] & valid[..., None, :])
        sim = sim.masked_fill(pad, -1.0)
    return sim


def gram_similarity(x: torch.Tensor, valid: torch.Tensor | None = None,
                    eps: float = 1e-6) -> torch.Tensor:
    """Cosine similarity inside each region from raw features: x [..., S, C] -> [..., S, S].

    The same values as `similarity(normalized(x), valid)` up to float rounding, but without the
    normalised copy of x: the float32 Gram matrix X X^T scaled by the inverse norms read off its
    diagonal (norms below `eps` count as `eps`, as in `normalized`). Features are expected to be
    normalised hidden states (entries far below 1e18), so their squared norms fit in float32.
    """
    x = x.float()
    gram = x @ x.transpose(-1, -2)
    inv = gram.diagonal(dim1=-2, dim2=-1).clamp_min(eps * eps).rsqrt()
    sim = gram.mul_(inv.unsqueeze(-1)).mul_(inv.unsqueeze(-2))
    if valid is not None:
        sim.masked_fill_(~(valid[..., :, None] & valid[..., None, :]), -1.0)
    return sim


def greedy_facility_location(sim: torch.Tensor, k: int,
                             valid: torch.Tensor | None = None) -> torch.Tensor:
    """Pick k destinations per region greedily.

    sim [..., S, S] shifted-free cosine similarity (see `similarity`); valid [R, S] or None.
    Returns picks [..., k] (slot indices, distinct within a region, in pick order).
    Ties go to the lowest slot index, so the result is deterministic.
    """
    s = sim.shape[-1]
    if not 1 <= k <= s:
        raise ValueError(f"k must be in [1, {s}], got {k}")
    if valid is not None and k > (fewest := int(valid.sum(-1).min())):
        raise ValueError(f"k must be at most {fewest} (valid slots in the smallest region), "
                         f"got {k}")
    cover = torch.zeros(sim.shape[:-1], dtype=sim.dtype, device=sim.device)   # [..., S]
    blocked = torch.zeros(sim.shape[:-1], dtype=torch.bool, device=sim.device)
    if valid is not None:
        blocked = blocked | ~valid
    shifted = sim + 1.0
    buf = torch.empty_like(shifted)
    picks = []
    for _ in range(k):
        # gain(v) = sum_j relu(shifted[v, j] - cover[j]), into one reused [..., S, S] buffer.
        gain = torch.sub(shifted, cover.unsqueeze(-2), out=buf).clamp_min_(0).sum(-1)
        pick = gain.masked_fill_(blocked, -1.0).argmax(-1, keepdim=True)   # [..., 1]
        row = shifted.gather(-2, pick.unsqueeze(-1).expand(*pick.shape, s)).squeeze(-2)
        torch.maximum(cover, row, out=cover)
        blocked.scatter_(-1, pick, True)
        picks.append(pick)
    return torch.cat(picks, -1)


def coverage(sim: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
    """f(D) of the shifted objective for picks [..., k] in sim [..., S, S] -> [...]."""
    s = sim.shape[-1]
    rows = (sim + 1.0).gather(-2, picks.unsqueeze(-1).expand(*picks.shape, s))
    return rows.max(-2).values.sum(-1)
