"""The merge plan's definition computed directly, region by region in float64 with Python loops:
what the plan operator (toma_core.plan_op) and the integration tests' expected plans are checked
against, written from the method's description rather than from the product's code."""

from __future__ import annotations

import math

import torch

from toma_pack.toma_core.regions import Regions

# A greedy step is a near-tie when its best two float64 gains are closer than TIE: far above the
# error of a float32 gain here, a sum of S <= 60 similarities each within 3.6e-7 of float64
# (test_facility_location), so within 2.2e-5.
TIE = 1e-4


def split(regions: Regions, x: torch.Tensor) -> torch.Tensor:
    """Grid tokens into region layout (the inverse of Regions.join): x [..., N, C] ->
    [..., R, S, C] (pad slots hold token 0)."""
    slots = regions.tables(x.device).slots
    return x.index_select(-2, slots.reshape(-1)).unflatten(-2, slots.shape)


def valid_slots(regions: Regions) -> torch.Tensor:
    valid = regions.tables().valid
    return torch.ones(regions.count, regions.size, dtype=torch.bool) if valid is None else valid


def direct(stream: torch.Tensor, offset: int, regions: Regions, k: int, tau: float,
           center: bool) -> dict[str, torch.Tensor]:
    """The operator's definition, region by region in float64 on the real slots only:
    picks [B, R, k] (slots), settled [B, R] (how many leading picks no near-tie could swap: the
    best two gains of every step before differ by more than TIE), p [B, R, k, S] (softmax over
    destinations of tau * cos, each destination its own only source, pad columns zero)."""
    b = stream.shape[0]
    slots, valid = regions.tables().slots, valid_slots(regions)
    picks = torch.zeros(b, regions.count, k, dtype=torch.long)
    settled = torch.full((b, regions.count), k, dtype=torch.long)
    p = torch.zeros(b, regions.count, k, regions.size, dtype=torch.float64)
    for i in range(b):
        for r in range(regions.count):
            real = valid[r].nonzero().flatten()                 # slot of each real token
            x = stream[i, offset + slots[r, real]].double()
            if center:
                x = x - x.mean(-1, keepdim=True)
            xn = x / x.norm(dim=-1, keepdim=True).clamp_min(1e-6)
            cos = xn @ xn.T
            shifted, cover, chosen = cos + 1.0, torch.zeros(len(real), dtype=torch.float64), []
            for step in range(k):
                gain = (shifted - cover).clamp_min(0).sum(-1)
                gain[chosen] = -math.inf
                top = gain.topk(min(2, len(real) - len(chosen))).values
                if len(top) == 2 and top[0] - top[1] <= TIE and settled[i, r] == k:
                    settled[i, r] = step
                best = int(gain.argmax())                       # first maximum: lowest slot
                chosen.append(best)
                cover = torch.maximum(cover, shifted[best])
            weights = torch.softmax(tau * cos[chosen], dim=0)   # [k, S'] over destinations
            weights[:, chosen] = torch.eye(k, dtype=torch.float64)
            picks[i, r] = real[chosen]
            p[i, r][:, real] = weights
    return {"picks": picks, "settled": settled, "p": p}
