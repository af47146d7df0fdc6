"""Destination rules the benchmark tries beside toma_core's facility location (the lab's).

Each is a stand-in for `greedy_facility_location(sim, k, valid)` -> picks [B, R, k], for the
8x8 row-major tiles this model's levels are cut into; rules that need the tokens' norms read
them from the features the plan's similarity is built from (`features_seen`).
"""

from __future__ import annotations

import torch

from toma_core import plan_op

TILE = 8


def bayer_rank(side: int = TILE) -> torch.Tensor:
    """[side*side] ordered-dither (Bayer) rank of each row-major slot: the first k of this order
    are k points spread evenly over the tile (one per 2x2 cell, then a checkerboard, ...)."""
    m = torch.zeros(1, 1, dtype=torch.long)
    while m.shape[0] < side:
        m = torch.cat([torch.cat([4 * m, 4 * m + 2], 1), torch.cat([4 * m + 3, 4 * m + 1], 1)])
    return m.flatten()


def greedy(sim: torch.Tensor, k: int, forced: torch.Tensor | None = None,
           weight: torch.Tensor | None = None) -> torch.Tensor:
    """Facility location's greedy (toma_core's), starting from the `forced` picks [..., m] and
    with each token's coverage counted `weight` [..., S] times (None: once)."""
    cover = torch.zeros(sim.shape[:-1])
    blocked = torch.zeros(sim.shape[:-1], dtype=torch.bool)
    shifted = sim + 1.0
    picks = []
    first = [] if forced is None else list(forced.split(1, -1))
    for i in range(k):
        if i < len(first):
            pick = first[i]
        else:
            gain = (shifted - cover.unsqueeze(-2)).clamp_min(0)
            if weight is not None:
                gain = gain * weight.unsqueeze(-2)
            pick = gain.sum(-1).masked_fill(blocked, -1.0).argmax(-1, keepdim=True)
        row = shifted.gather(-2, pick.unsqueeze(-1).expand(*pick.shape, sim.shape[-1]))
        cover = torch.maximum(cover, row.squeeze(-2))
        blocked = blocked.scatter(-1, pick, True)
        picks.append(pick)
    return torch.cat(picks, -1)


features_seen: dict = {}


def norms() -> torch.Tensor:
    """[B, R, S] norms of the features of the plan being built."""
    return features_seen["x"].norm(dim=-1)


def rule(name: str, generator: torch.Generator):
    """The picker for rule `name`: "random", "dither", "mix<f>" (the first f*k picks dithered,
    the rest facility location), "normfl<p>" (coverage weighted by norm ** p), "sinks<f>" (the
    f*k largest-norm tokens forced, the rest facility location)."""
    def pick(sim: torch.Tensor, k: int, valid=None, weight=None) -> torch.Tensor:
        shape = sim.shape[:-1]
        if name == "random":
            return torch.rand(shape, generator=generator).argsort(-1)[..., :k]
        order = bayer_rank().argsort().expand(*shape[:-1], -1)
        if name == "dither":
            return order[..., :k].contiguous()
        if name.startswith("mix"):
            return greedy(sim, k, order[..., :round(float(name[3:]) * k)])
        if name.startswith("normfl"):
            n = norms()
            return greedy(sim, k, weight=(n / n.mean(-1, keepdim=True)) ** float(name[6:]))
        if name.startswith("sinks"):
            m = round(float(name[5:]) * k)
            return greedy(sim, k, norms().argsort(-1, descending=True)[..., :m])
        raise ValueError(name)
    return pick


class Rules:
    """Context: toma_core's plans with `name` choosing destinations."""

    def __init__(self, name: str, generator: torch.Generator) -> None:
        self.name, self.generator = name, generator

    def __enter__(self):
        self.saved = plan_op.greedy_facility_location, plan_op.gram_similarity

        def seen(x, valid=None, **kw):
            features_seen["x"] = x
            return self.saved[1](x, valid, **kw)
        plan_op.greedy_facility_location = rule(self.name, self.generator)
        plan_op.gram_similarity = seen
        return self

    def __exit__(self, *exc):
        plan_op.greedy_facility_location, plan_op.gram_similarity = self.saved
