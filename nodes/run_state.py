"""State of one ToMA patch: its options, and what the current sampling run has done.

ComfyUI shares patch objects between clones of a model, so nothing here is global and nothing
outlives a run: an OUTER_SAMPLE wrapper opens a run (fresh plan cache, fresh counters) and closes
it when sampling ends, reporting what was merged. A model called outside a sampler gets a run for
that one call (DIFFUSION_MODEL wrapper), so plans never linger between calls there either.
"""

from __future__ import annotations

import logging
import time
import types
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

from ..toma_core import MergePlan, PlanCache, step_index
from .options import ToMAOptions
from .ui_stats import send_stats

log = logging.getLogger("ToMA")


def plain_function(method: Callable) -> Callable:
    """`method` behind a plain function.

    ComfyUI before 0.20 deep-copies model_options on clone; a deep copy of a bound method copies
    its object, which would split one ToMA node's state between clones. Functions are copied by
    reference, so every clone keeps talking to the same state.
    """

    def call(*args, **kwargs):
        return method(*args, **kwargs)

    return call


def patch_forward(model, path: str, module: torch.nn.Module,
                  make: Callable[[Callable], Callable]) -> None:
    """Object-patch the forward of `module` (at diffusion_model.<path>) on ModelPatcher `model`
    with make(original). `original` is another pack's object patch of that forward when there is
    one (it keeps running, inside ours), else the module's own forward."""
    key = f"diffusion_model.{path}.forward"
    previous = model.object_patches.get(key)
    original = previous if previous is not None else types.MethodType(type(module).forward, module)
    model.add_object_patch(key, make(original))


@dataclass
class RunState:
    """One sampling run: plans and counters."""

    cache: PlanCache
    steps_total: int = 0
    started: float = field(default_factory=time.perf_counter)
    layers_seen: set = field(default_factory=set)
    layers_merged: set = field(default_factory=set)
    steps_merged: set = field(default_factory=set)
    levels: dict = field(default_factory=dict)
    # (sigmas, schedule, step) of the latest call: every block of one model call shares the
    # same sigmas tensor, so the step (a host read of sigma) is worked out once per call.
    last_step: tuple | None = None


class ToMAState:
    """Options and run bookkeeping shared by every patch function of one ToMA node."""

    def __init__(self, options: ToMAOptions, family: str, node_id: str | None = None) -> None:
        self.options = options
        self.family = family
        self.node_id = node_id
        self.run: RunState | None = None
        self.notices: list[str] = []   # said once per node, shown in every run's stats

    def notice(self, message: str) -> None:
        """Tell the user once (log warning, and a note in the stats line of every run) about
        something ToMA did differently from what was asked, e.g. a scope fallback."""
        if message not in self.notices:
            self.notices.append(message)
            log.warning("ToMA: %s", message)

    # Runs ------------------------------------------------------------------------------------
    def outer_sample_wrapper(self, executor: Callable, *args, **kwargs):
        """WrappersMP.OUTER_SAMPLE: one run per sampling call, reported when it ends."""
        self.run = RunState(PlanCache(self.options.recompute_every))
        try:
            return executor(*args, **kwargs)
        finally:
            run, self.run = self.run, None
            self._report(run)

    def diffusion_model_wrapper(self, executor: Callable, *args, **kwargs):
        """WrappersMP.DIFFUSION_MODEL: a throwaway run for a model call outside a sampler."""
        if self.run is not None:
            return executor(*args, **kwargs)
        self.run = RunState(PlanCache(self.options.recompute_every))
        try:
            return executor(*args, **kwargs)
        finally:
            self.run = None

    # Per-call decisions ------------------------------------------------------------------------
    def active_step(self, transformer_options: dict) -> int | None:
        """The sampling step of this call when merging is on for it, else None.

        The step comes from the call's sigma within the sampler's schedule, so every model call
        of one step (CFG halves, Heun's second evaluation) gets the same answer.
        """
        if self.run is None or self.options.ratio == 0:
            return None
        schedule = transformer_options.get("sample_sigmas")
        sigmas = transformer_options.get("sigmas")
        step = 0
        last = self.run.last_step
        if last is not None and last[0] is sigmas and last[1] is schedule:
            step = last[2]
        elif schedule is not None and sigmas is not None:
            step = step_index(float(sigmas.flatten()[0]), schedule)
            self.run.steps_total = max(len(schedule) - 1, 1)
            self.run.last_step = (sigmas, schedule, step)
        fraction = step / self.run.steps_total if self.run.steps_total else 0.0
        if not self.options.start_percent <= fraction < self.options.end_percent:
            return None
        return step

    def plan(self, key: Hashable, step: int,
             build: Callable[[], MergePlan | None]) -> MergePlan | None:
        """The run's plan under `key`, rebuilt on the recompute schedule."""
        return self.run.cache.get(key, step, build)

    def record(self, layer: Hashable, level: str, tokens: int, plan: MergePlan | None,
               step: int | None) -> None:
        """Count one layer call for the run's summary."""
        if self.run is None:
            return
        self.run.layers_seen.add(layer)
        if plan is None or step is None:
            return
        self.run.layers_merged.add(layer)
        self.run.steps_merged.add(step)
        self.run.levels[level] = (tokens, plan.merged_tokens)

    # Reporting ---------------------------------------------------------------------------------
    def summary(self, run: RunState) -> dict:
        """What a run did, in the fields the frontend's stats line reads."""
        stats = {
            "ratio": self.options.ratio,
            "family": self.family,
            "layers_merged": len(run.layers_merged),
            "layers_total": len(run.layers_seen),
            "steps_merged": len(run.steps_merged),
            "steps_total": run.steps_total,
            "planning_s": run.cache.build_seconds,
            "sampling_s": time.perf_counter() - run.started,
            "levels": [{"name": name, "tokens": n, "merged_tokens": m}
                       for name, (n, m) in sorted(run.levels.items())],
        }
        notes = list(self.notices)
        if not run.layers_merged:
            notes.append("nothing merged: no layer had enough tokens in the active steps")
        if notes:
            stats["note"] = "; ".join(notes)
        return stats

    def _report(self, run: RunState) -> None:
        stats = self.summary(run)
        if self.options.verbose:
            levels = ", ".join(f"{lv['name']}: {lv['tokens']}->{lv['merged_tokens']} tokens"
                               for lv in stats["levels"]) or "none"
            log.info("ToMA run: %s; %d/%d layers and %d/%d steps merged; %d plans built in "
                     "%.3f s of %.2f s sampling", levels, stats["layers_merged"],
                     stats["layers_total"], stats["steps_merged"], stats["steps_total"],
                     run.cache.builds, stats["planning_s"], stats["sampling_s"])
        send_stats(self.node_id, stats)
