"""A sampling run (RunState) and one model call in it as its blocks see it (ModelCall): what the
host decided for the call, and what the blocks share and record through its methods."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

from ..toma_core import MergePlan, PlanSchedule, Regions, RegionTables
from ..toma_core.regions import compiling
from .compile_guards import TRACED_PLANS
from .forward_patches import kept_allocations


class RunState:
    """One sampling run: its plans (per call identity), step, index tables, counters and notes.

    The sampler's thread and, on v0.33, one thread per GPU use it: the wrappers (host code)
    update it under `lock`; blocks never touch it but for the index tables, a dict whose
    setdefault is atomic."""

    def __init__(self, recompute_every: int) -> None:
        self.schedule = PlanSchedule(recompute_every)
        self.step = 0                # steps the sampler has finished
        self.steps_total = 0         # the schedule's steps (0: unknown)
        self.steps_reported = 0      # sampler callbacks seen
        # the schedule's sigmas as host floats (read once, when sampling starts) and the
        # sigmas of start_percent and end_percent (model_sampling.percent_to_sigma); None
        # outside ComfyUI's sampler
        self.sigmas: list[float] | None = None
        self.window: tuple[float, float] | None = None
        self.model_calls = 0
        self.merging_calls = 0       # calls that merged (ratio, window, the family's reading)
        self.builds = 0
        self.build_seconds: float | None = None
        self.started = time.perf_counter()
        self.layers_seen: set = set()
        self.layers_merged: set = set()
        self.steps_merged: set = set()
        self.levels: dict = {}
        self.host_reads: dict = {}       # what a family reads on the host once per run
        self.prefix_entries: dict = {}   # a prefix cache's kept prompt keys and values
        # compiled by torch.compile (see unguarded_compile: without guards on
        # transformer_options)
        self.compiled = False
        self.compiled_without_guards = False
        self.notes: list[str] = []   # what this run did differently from what was asked
        self.tables: dict[tuple[Regions, torch.device | None], RegionTables] = {}
        self.lock = threading.Lock()

    def in_window(self, step: int, start_percent: float, end_percent: float) -> bool:
        """Whether step `step` lies in start_percent..end_percent, read as ComfyUI's own nodes
        read those widgets (EasyCache, ControlNet apply, hook keyframes): fractions of the
        noise schedule, end_sigma < sigma <= start_sigma with the sigmas from
        model_sampling.percent_to_sigma, so that a schedule split over two samplers merges
        the same steps as one sampler. Without the run's sigmas (a model called outside
        ComfyUI's sampler), fractions of the steps."""
        if self.window is not None and self.sigmas and step < len(self.sigmas):
            start_sigma, end_sigma = self.window
            return end_sigma < self.sigmas[step] <= start_sigma
        fraction = step / self.steps_total if self.steps_total else 0.0
        return start_percent <= fraction < end_percent

    def note(self, message: str) -> bool:
        """Keep `message` among the run's notes; False when it was already there."""
        with self.lock:
            if message in self.notes:
                return False
            self.notes.append(message)
            return True


@dataclass
class ModelCall:
    """One model call: what the host decided for it, and what its blocks share and record.

    identity: what plans are kept under (cond uuids, cond/uncond order, context window, device),
    read on the host;
    grid: the family's token grid of this call ((h, w) or (t, h, w)), None where it has none;
    mergeable: False when the family found an input merging would break (see its notes);
    merging: whether this call's step merges (ratio, start/end_percent) -- the blocks get this
    flag, never the step: under torch.compile a value read in the graph is guarded on, and a
    step would recompile the model every step;
    plans: key -> plan (or None: nothing to merge) for this identity; empty when the plans are
    due, so the first block of each level or group builds one;
    prefix, level: set with the grid by the family (dit_families.set_grid): tokens before the
    mergeable grid in the stream (text, protected frames), the grid's name in the stats;
    txt_len: the whole text's tokens in front of the image where single-stream blocks need it
    (read by the family on the host, or recorded by the double-stream blocks before them; never
    recorded from a sequence shard, whose blocks see a shard of the text);
    foreign_attention: (kind key, index) of merged blocks whose self-attention another pack
    patches (those run unmerged);
    prompt_length / prompt: a prefix-cached family's causal prompt length, and the call's kept
    prompt entry with whether it is complete (prefix_cache.py);
    merged_rows: positional, mask and modulation rows merged once per call for a group of
    blocks (DiTToMA.once: key -> (source, merged));
    records: layer -> (level, tokens, merged tokens or None), set by blocks (a dict: where the
    graph breaks inside blocks, dynamo replays a dict's new items, but rewrites a list whole);
    notes: appended by blocks; both added to the run after the call;
    plan_seconds: the time plan builds took (None: not timed; they are on an eager CPU, where
    timing is free and accurate);
    pass_index / pass_layers: the pass over the model's blocks the call is in, and the layers
    that pass has run (see pass_of);
    traced: (node key, device) of its entries in compile_guards' globals while a compiled model
    runs it, else None;
    region_order: (output, plan) of the last UNet block that left its grid in the plan's region
    order for the next block of its transformer (MergePlan.finish's keep_order), else None;
    shard: this process's part of a sequence-parallel call (sequence_parallel.Shard: the
    blocks get one shard of the token sequence), None for a whole sequence.

    Blocks call its methods; the host reads what they recorded after the call.
    """

    run: RunState
    identity: tuple = ()
    grid: tuple[int, ...] | None = None
    mergeable: bool = True
    merging: bool = False
    plans: dict = field(default_factory=dict)
    prefix: int = 0
    level: str = "?"
    txt_len: int | None = None
    foreign_attention: tuple = ()
    prompt_length: int | None = None
    prompt: tuple | None = None
    merged_rows: dict = field(default_factory=dict)
    records: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    plan_seconds: float | None = None
    pass_index: int = 0
    pass_layers: set = field(default_factory=set)
    traced: tuple[str, str] | None = None
    region_order: tuple[torch.Tensor, MergePlan] | None = None
    shard: object | None = None

    @property
    def active(self) -> bool:
        """Whether this call merges at all."""
        return self.merging and self.mergeable

    def decisions(self) -> str:
        """What the host decided for this call that its blocks read and that can change at
        equal tensor shapes (merging on or off, the grid's mergeable part, what the family read:
        prefix, text and prompt lengths, blocks left to other packs, whether the kept prompt
        is complete), as one text."""
        return repr((self.active, self.grid, self.prefix, self.level,
                     self.txt_len, self.foreign_attention, self.prompt_length,
                     None if self.prompt is None else self.prompt[1], self.shard))

    # What the blocks call -------------------------------------------------------------------------
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
                if self.plan_seconds is not None:
                    start = time.perf_counter()
                    self.plans[key] = build()
                    self.plan_seconds += time.perf_counter() - start
                else:
                    self.plans[key] = build()
        return self.plans[key]

    def pass_of(self, layer: Hashable) -> int:
        """The pass over the model's blocks that this call of `layer` belongs to: 0, and one more
        each time a layer runs again within the same model call. A wrapper that runs the model
        more than once inside one call (a seam smoothing pass, on pixels rolled by part of
        a patch) so gets plans of its own for each pass (plan keys carry the pass), built from
        that pass's tokens rather than the first pass's."""
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
        found = self.run.tables.get((regions, device))
        if found is None:
            with kept_allocations():
                found = self.run.tables.setdefault((regions, device), regions.tables(device))
        return found

    def record(self, layer: Hashable, level: str, tokens: int, plan: MergePlan | None) -> None:
        """Count one layer call for the run's summary (plan None: it ran unmerged)."""
        self.records[layer] = (level, tokens, None if plan is None else plan.merged_tokens)

    def note(self, message: str) -> None:
        """A notice from inside the model: said once per run after the call."""
        self.notes.append(message)


# The per-call hook a node's state is built with (dit_reading.DiTReading): reads one model call
# (apply_model's arguments by name) on the host before its blocks run, fills in what the blocks
# read (grid, mergeable, prefix, ...), and returns what the run's notes should say.
Describe = Callable[[ModelCall, object, dict], list[str]]
