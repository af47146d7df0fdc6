"""A sampling run (RunState) and one model call in it as its blocks see it (ModelCall)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

from ..toma_core import MergePlan, PlanSchedule, Regions, RegionTables
from ..toma_core.regions import compiling
from .compile_guards import TRACED_PLANS
from .forward_patches import kept_allocations

log = logging.getLogger("ToMA")


class RunState:
    """One sampling run: its plans (per call identity), step, what it keeps, counters and notes.

    The wrappers update it under `lock` (v0.33 runs a thread per GPU); blocks touch only
    `host_reads`, a dict whose setdefault is atomic."""

    def __init__(self, recompute_every: int) -> None:
        self.schedule = PlanSchedule(recompute_every)
        self.step = 0                # steps the sampler has finished
        self.steps_total = 0         # the schedule's steps (0: unknown)
        self.steps_reported = 0      # sampler callbacks seen
        self.sigmas: list[float] | None = None     # host floats; None outside ComfyUI's sampler
        self.window: tuple[float, float] | None = None     # start/end_percent's sigmas
        self.model_calls = 0
        self.merging_calls = 0       # calls that merged (ratio, window, the family's reading)
        self.builds = 0
        self.build_seconds: float | None = None
        self.started = time.perf_counter()
        self.layers_seen: set = set()
        self.layers_merged: set = set()
        self.steps_merged: set = set()
        self.levels: dict = {}
        # what is read or built once per run, by key: a family's host reads (tagged tuples),
        # index tables ((Regions, device)), a prefix cache's prompt keys and values
        self.host_reads: dict = {}
        self.compiled = False                   # by TorchCompileModel
        self.compiled_without_guards = False    # see compile_guards.unguarded_compile
        self.notes: list[str] = []   # what this run did differently from what was asked
        self.lock = threading.Lock()

    def in_window(self, step: int, start_percent: float, end_percent: float) -> bool:
        """Whether step `step` lies in start_percent..end_percent, read as ComfyUI's own nodes
        (EasyCache, ControlNet apply) read them: end_sigma < sigma <= start_sigma, so that a
        schedule split over two samplers merges the same steps as one. Without the run's
        sigmas (outside ComfyUI's sampler), fractions of the steps."""
        if self.window is not None and self.sigmas and step < len(self.sigmas):
            start_sigma, end_sigma = self.window
            return end_sigma < self.sigmas[step] <= start_sigma
        fraction = step / self.steps_total if self.steps_total else 0.0
        return start_percent <= fraction < end_percent

    def note(self, message: str) -> None:
        """Keep `message` among the run's notes (its stats) and warn, once per run."""
        with self.lock:
            if message in self.notes:
                return
            self.notes.append(message)
        log.warning("ToMA: %s", message)


@dataclass
class ModelCall:
    """One model call: what the host decided for it, and what its blocks share and record
    through its methods (the host adds their records to the run after the call)."""

    run: RunState
    identity: tuple = ()    # what plans are kept under: uuids, cond/uncond, context window, device
    grid: tuple[int, ...] | None = None     # the family's token grid, (h, w) or (t, h, w)
    mergeable: bool = True      # False where the family found an input merging would break
    # whether this call's step merges: blocks get this flag, never the step, which torch.compile
    # would guard on and so recompile every step
    merging: bool = False
    plans: dict = field(default_factory=dict)   # key -> plan (None: nothing to merge); {}: due
    prefix: int = 0     # tokens before the grid in the stream (dit_families.set_grid)
    level: str = "?"    # the grid's name in the stats
    # the whole text's tokens before the image, for single-stream blocks (never recorded from a
    # sequence shard, whose blocks see a shard of the text)
    txt_len: int | None = None
    foreign_attention: tuple = ()   # (kind key, index): blocks whose attention another pack patches
    prompt_length: int | None = None    # a prefix-cached family's prompt length, and the
    prompt: tuple | None = None         # kept prompt entry with whether it is complete
    merged_rows: dict = field(default_factory=dict)     # rows merged once a group: DiTToMA.once
    # layer -> (level, tokens, merged tokens or None): a dict, since where the graph breaks in
    # blocks dynamo replays a dict's new items but rewrites a list whole
    records: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)   # said once per run after the call
    plan_seconds: float | None = None   # plan builds' time where timed (an eager CPU), else None
    pass_index: int = 0                 # see pass_of
    pass_layers: set = field(default_factory=set)
    # (node key, str(device)) of its entries in compile_guards' globals in a compiled model
    traced: tuple[str, str] | None = None
    # (output, plan) of the last UNet block that left its grid in region order for the next
    # block (MergePlan.finish's keep_order)
    region_order: tuple[torch.Tensor, MergePlan] | None = None
    shard: object | None = None     # this process's part of a sequence-parallel call

    @property
    def active(self) -> bool:
        """Whether this call merges at all."""
        return self.merging and self.mergeable

    def decisions(self) -> str:
        """What the host decided that blocks read and that can change at equal shapes, as text."""
        return repr((self.active, self.grid, self.prefix, self.level,
                     self.txt_len, self.foreign_attention, self.prompt_length,
                     None if self.prompt is None else self.prompt[1], self.shard))

    def plan(self, key: Hashable, build: Callable[[], MergePlan | None]) -> MergePlan | None:
        """The plan under `key` in this call's plans, built by build() when missing (read
        through compile_guards.TRACED_PLANS while dynamo traces)."""
        if compiling():
            plans = TRACED_PLANS.get(self.traced, self.plans)
            if key not in plans:
                plans[key] = build()
            return plans[key]
        if key not in self.plans:
            with kept_allocations():       # kept for later blocks and steps
                start = time.perf_counter()
                self.plans[key] = build()
                if self.plan_seconds is not None:
                    self.plan_seconds += time.perf_counter() - start
        return self.plans[key]

    def pass_of(self, layer: Hashable) -> int:
        """The pass over the model's blocks that this call of `layer` belongs to: 0, and one more
        each time a layer runs again within the call, so that a wrapper running the model twice
        in one call (a seam smoothing pass) gets plans of that pass's tokens (keys carry it)."""
        if layer in self.pass_layers:
            self.pass_index += 1
            self.pass_layers.clear()
        self.pass_layers.add(layer)
        return self.pass_index

    def tables(self, regions: Regions, device: torch.device | None) -> RegionTables:
        """The index tables of `regions` on `device`: kept for the run, except under
        torch.compile, where the graph builds them (a kept dict would be guarded on)."""
        if compiling():
            return regions.tables(device)
        found = self.run.host_reads.get((regions, device))
        if found is None:
            with kept_allocations():
                found = self.run.host_reads.setdefault((regions, device), regions.tables(device))
        return found

    def record(self, layer: Hashable, level: str, tokens: int, plan: MergePlan | None) -> None:
        """Count one layer call for the run's summary (plan None: it ran unmerged)."""
        self.records[layer] = (level, tokens, None if plan is None else plan.merged_tokens)

    def note(self, message: str) -> None:
        """A notice from inside the model: said once per run after the call."""
        self.notes.append(message)

