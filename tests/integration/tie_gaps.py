"""How far apart two runs' destination picks are: where they part, and by how much gain.

Facility location's greedy picks are discrete choices. Once a region's coverage saturates, two
candidates can tie to float precision (a pair of tokens that only cover each other gains the
same whichever is picked), and a rounding difference anywhere upstream (another batch size,
another device's kernels, attention reduced across ranks) can pick the other one: an equally good
choice whose samples part far more than the rounding. Tests that compare two such runs hand both
the same picks and check apart, with `parting_gaps`, that each run's own picks part from them at
near ties only.
"""

from __future__ import annotations

import torch


def parting_gaps(sim: torch.Tensor, own: torch.Tensor, given: torch.Tensor) -> list[float]:
    """For each region where the picks `own` and `given` ([..., k], of the greedy on the
    similarities sim [..., S, S]) part, the greedy's gain of its own pick less that of the given
    one at the first pick where they part (the same picks before it): about a gain's rounding
    at a tie to float precision. Empty where they never part."""
    shifted = (sim.float() + 1.0).flatten(0, -3)                        # [G, S, S]
    gaps = []
    for rows, mine, theirs in zip(shifted, own.flatten(0, -2), given.flatten(0, -2),
                                  strict=True):
        parting = (mine != theirs).nonzero()
        if len(parting) == 0:
            continue
        t = int(parting[0])
        cover = rows[theirs[:t]].amax(0) if t else torch.zeros_like(rows[0])
        gains = (rows - cover).clamp_min(0).sum(-1)
        gaps.append(float(gains[mine[t]] - gains[theirs[t]]))
    return gaps
