"""Reuse of merge plans across layers and sampling steps.

A plan is kept under a key (for example grid size, level, block group and batch layout) and
served until `recompute_every` steps have passed since it was built. Steps come from the
sampler's noise level (`step_index`), never from counting model calls, so CFG, samplers that
evaluate the model several times per step and repeated runs all see the same schedule.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from .merge_plan import MergePlan


def step_index(sigma: float, schedule: Sequence[float] | torch.Tensor | None) -> int:
    """The sampling step a noise level belongs to: the last i with schedule[i] >= sigma.

    schedule: the sampler's sigmas, decreasing. Step i starts with an evaluation at schedule[i].
    Second-order samplers evaluate once more within the step: dpm_2 and the 2S samplers between
    schedule[i] and schedule[i + 1], which counts as step i; Heun's corrector at schedule[i + 1]
    itself, which counts as step i + 1, like the next step's first evaluation at that same noise
    level (sigma cannot tell the two apart). Without a schedule every call is step 0, so a plan
    is built once and reused for the whole run.
    """
    if schedule is None or len(schedule) == 0:
        return 0
    sig = torch.as_tensor(schedule, dtype=torch.float64).flatten()
    above = (sig >= float(sigma) * (1 - 1e-5)).nonzero()
    return int(above[-1]) if len(above) else 0


@dataclass
class _Entry:
    plan: MergePlan | None
    step: int       # step the plan was built at
    seen: int       # latest step it was asked for


class PlanCache:
    """Plans by key, rebuilt every `recompute_every` steps; counts builds and their time."""

    def __init__(self, recompute_every: int = 1) -> None:
        if recompute_every < 1:
            raise ValueError(f"recompute_every must be >= 1, got {recompute_every}")
        self.recompute_every = recompute_every
        self._entries: dict[Hashable, _Entry] = {}
        self.builds = 0
        self.build_seconds = 0.0

    def due(self, key: Hashable, step: int) -> bool:
        """True when the plan under `key` is missing, was built `recompute_every` or more steps
        ago, or `step` is earlier than the latest step it served (a new run started, even one
        that comes back to the very step the plan was built at)."""
        entry = self._entries.get(key)
        return (entry is None or step < entry.seen
                or step - entry.step >= self.recompute_every)

    def get(self, key: Hashable, step: int,
            build: Callable[[], MergePlan | None]) -> MergePlan | None:
        """The plan under `key` for `step`, calling `build()` when it is due."""
        if self.due(key, step):
            start = time.perf_counter()
            self._entries[key] = _Entry(build(), step, step)
            self.build_seconds += time.perf_counter() - start
            self.builds += 1
        entry = self._entries[key]
        entry.seen = step
        return entry.plan

    def clear(self) -> None:
        """Forget every plan (the counters stay)."""
        self._entries.clear()
