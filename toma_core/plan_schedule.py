"""When plans are built again: the recompute schedule, decided on the host before a model call.

Plans are kept per identity (calls that must never share a plan) in a dict the blocks fill,
fresh when the identity has none, its plans are `recompute_every` or more steps old, or `step`
is earlier than the latest they served (a new run). Steps are the sampler's, on the host: CFG,
several calls per step and repeated runs see the same schedule, at no device cost.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field


@dataclass
class _Entry:
    plans: dict = field(default_factory=dict)
    step: int = 0    # step the plans were built at
    seen: int = 0    # latest step they served


class PlanSchedule:
    """Plan dicts by identity, handed out fresh every `recompute_every` steps."""

    def __init__(self, recompute_every: int = 1) -> None:
        if recompute_every < 1:
            raise ValueError(f"recompute_every must be >= 1, got {recompute_every}")
        self.recompute_every = recompute_every
        self._entries: dict[Hashable, _Entry] = {}

    def due(self, identity: Hashable, step: int) -> bool:
        """Whether a call of `identity` at `step` builds its plans anew."""
        entry = self._entries.get(identity)
        return (entry is None or step < entry.seen
                or step - entry.step >= self.recompute_every)

    def plans(self, identity: Hashable, step: int) -> tuple[dict, bool]:
        """(the plan dict for a call of `identity` at `step`, whether it is fresh)."""
        fresh = self.due(identity, step)
        if fresh:
            self._entries[identity] = _Entry({}, step, step)
        entry = self._entries[identity]
        entry.seen = step
        return entry.plans, fresh
