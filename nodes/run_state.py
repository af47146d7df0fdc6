"""State of one ToMA patch (ToMAState). ComfyUI shares patch objects between clones of a model,
and v0.33 can run a step's cond batches in a thread per GPU, so nothing mutable lives on them:
a run lives in a clone of the guider's model_options (EasyCache's pattern), and each model
call's ModelCall reaches the blocks through call_of (no locks, clocks or host reads there).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable

import torch

from ..toma_core.regions import compiling
from .arguments import call_arguments, with_argument
from .compile_guards import TRACED_DECISIONS, TRACED_PLANS, unguarded_compile
from .model_call import ModelCall, RunState
from .options import ToMAOptions
from .sequence_parallel import sequence_shard
from .ui_stats import send_stats

log = logging.getLogger("ToMA")


class ToMAState:
    """Options and setup notes of one ToMA node; runs and calls live in transformer_options."""

    def __init__(self, options: ToMAOptions, family: str, node_id: str | None = None,
                 depth: int = 0,
                 describe: Callable[[ModelCall, object, dict], list[str]] | None = None) -> None:
        self.options = options
        self.family = family
        self.node_id = node_id
        # transformer_options keys of the RunState and the ModelCall: one per ToMA node in a chain
        # (depth: ToMA nodes before it), the same each run (compiled unguarded, keys are replayed)
        self.key = "toma_run" if depth == 0 else f"toma_run_{depth + 1}"
        self.call_key = f"{self.key}_call"
        self.describe = describe    # a family's per-call hook (dit_reading.DiTReading); UNet: none
        self.setup_notes: list[str] = []    # true of every run of the patched model
        self.in_flight = threading.local()  # the model call in flight on each thread
        self.runs: list[RunState] = []      # the runs in progress
        # weakly: a strong reference would keep the patched model loaded after the graph let go
        self.source: weakref.ref | None = None
        self.last_stats: dict | None = None     # the last finished run's summary
        self._lock = threading.Lock()

    def setup_note(self, message: str) -> None:
        """Warn once, and note in every run's stats, that the node set something up differently
        from what was asked (e.g. a scope fallback); said while the node patches the model."""
        if message not in self.setup_notes:
            self.setup_notes.append(message)
            log.warning("ToMA: %s", message)

    def new_run(self) -> RunState:
        return RunState(self.options.recompute_every)

    def outer_sample_wrapper(self, executor: Callable, *args, **kwargs):
        """WrappersMP.OUTER_SAMPLE: one RunState per sampling call in the guider's cloned
        model_options, reported and dropped when sampling ends."""
        import comfy.model_patcher

        guider = executor.class_obj
        original = guider.model_options
        guider.model_options = comfy.model_patcher.create_model_options_clone(original)
        run = self.new_run()
        try:
            sampling = guider.model_patcher.get_model_object("model_sampling")
        except AttributeError:      # no noise schedule: in_window reads fractions of the steps
            pass
        else:
            run.window = (float(sampling.percent_to_sigma(self.options.start_percent)),
                          float(sampling.percent_to_sigma(self.options.end_percent)))
        run.compiled = isinstance(original.get("torch_compile_kwargs"), dict)
        run.compiled_without_guards = unguarded_compile(original)
        guider.model_options.setdefault("transformer_options", {})[self.key] = run
        with self._lock:
            self.runs.append(run)
        try:
            out = executor(*args, **kwargs)
            # NaN or inf (fp16 overflow, a broken LoRA) merged as they came: one host read per
            # run, after sampling
            if torch.is_tensor(out) and not bool(torch.isfinite(out).all()):
                run.note("the model produced non-finite values (NaN or inf); ToMA passed them "
                         "through as the unmerged model does")
            return out
        finally:
            guider.model_options = original
            with self._lock:
                self.runs.remove(run)
            self._report(run)

    def sampler_sample_wrapper(self, executor: Callable, *args, **kwargs):
        """WrappersMP.SAMPLER_SAMPLE: the run learns the schedule (its sigmas, read to the host
        once, before the first model call) and each finished step as a host int through the
        sampler's step callback (chained to any callback that was there)."""
        arguments = call_arguments(executor, args, kwargs)
        extra = arguments.get("extra_args") or {}
        run = ((extra.get("model_options") or {}).get("transformer_options") or {}).get(self.key)
        sigmas = arguments.get("sigmas")
        if not isinstance(run, RunState):
            return executor(*args, **kwargs)
        if torch.is_tensor(sigmas):
            run.steps_total = max(int(sigmas.shape[-1]) - 1, 1)
            run.sigmas = [float(v) for v in sigmas.detach().flatten().tolist()]
        previous = arguments.get("callback")

        def callback(step, *rest, **more):
            with run.lock:      # step `step` (0-based) is done: later calls belong to the next
                run.step = max(run.step, int(step) + 1)
                run.steps_reported += 1
            return None if previous is None else previous(step, *rest, **more)

        args, kwargs = with_argument(executor, args, kwargs, "callback", callback)
        return executor(*args, **kwargs)

    def apply_model_wrapper(self, executor: Callable, *args, **kwargs):
        """WrappersMP.APPLY_MODEL: decide this call on the host (outside the graph under
        TorchCompileModel) and hand its ModelCall to the blocks (see call_of); afterwards add
        what they recorded to the run."""
        arguments = call_arguments(executor, args, kwargs)
        options = arguments.get("transformer_options") or {}
        x = arguments.get("x", args[0] if args else None)
        run = options.get(self.key)
        run = run if isinstance(run, RunState) else self.new_run()
        call, step = self.open_call(run, x, options)
        built = len(call.plans)
        if self.describe is not None:
            model = getattr(executor.class_obj, "diffusion_model", None)
            key = ("sequence_shard", id(model))    # read once per run and model object
            if key not in run.host_reads:
                run.host_reads[key] = sequence_shard(model)
            call.shard = run.host_reads[key]
            for note in self.describe(call, executor.class_obj, arguments):
                run.note(note)
        args, kwargs = with_argument(executor, args, kwargs, "transformer_options",
                                     {**options, self.call_key: call})
        if call.traced is not None:
            TRACED_DECISIONS[call.traced] = f"{self.family} {self.options!r} {call.decisions()}"
            TRACED_PLANS[call.traced] = call.plans
        outer = getattr(self.in_flight, "call", None)
        self.in_flight.call = call
        try:
            return executor(*args, **kwargs)
        finally:
            self.in_flight.call = outer
            if call.traced is not None:
                TRACED_DECISIONS.pop(call.traced, None)
                TRACED_PLANS.pop(call.traced, None)
            self.close_call(call, step, built)

    def open_call(self, run: RunState, x: object, options: dict) -> tuple[ModelCall, int]:
        """A ModelCall for the run's current step (returned beside it): merging on or off, and
        the plans of its identity, fresh when due."""
        device = x.device if torch.is_tensor(x) else None
        window = options.get("context_window")
        identity = (tuple(options.get("uuids") or ()), tuple(options.get("cond_or_uncond") or ()),
                    tuple(getattr(window, "index_list", None) or ()), device)
        timed = device is not None and device.type == "cpu"
        call = ModelCall(run, identity, plan_seconds=0.0 if timed else None,
                         traced=(self.key, str(device)) if run.compiled else None)
        with run.lock:
            run.model_calls += 1
            step = run.step
            if run.in_window(step, self.options.start_percent, self.options.end_percent):
                call.merging = True
                call.plans = run.schedule.plans(identity, step)[0]
        return call, step

    def close_call(self, call: ModelCall, step: int, built: int) -> None:
        """Add what the blocks of `call` (at `step`, begun with `built` plans) recorded to its
        run, with their notes."""
        run = call.run
        with run.lock:
            run.merging_calls += call.active
            for layer, (level, tokens, merged) in call.records.items():
                run.layers_seen.add(layer)
                if merged is not None:
                    run.layers_merged.add(layer)
                    run.steps_merged.add(step)
                    run.levels[level] = (tokens, merged)
            run.builds += len(call.plans) - built
            if call.plan_seconds is not None:
                run.build_seconds = (run.build_seconds or 0.0) + call.plan_seconds
        for note in call.notes:     # run.note says each once
            run.note(note)

    def call_of(self, options: dict, device: torch.device | None = None) -> ModelCall | None:
        """The ModelCall a block call belongs to, the one way every block patch finds it: in the
        block's transformer_options; else (TeaCache's copy of the forward, blocks given no
        options) this thread's call in flight; else None, noting who called the block. Traced,
        the graph is guarded on the decisions on `device` (compile_guards.TRACED_DECISIONS)."""
        call = options.get(self.call_key)
        if not isinstance(call, ModelCall):
            call = getattr(self.in_flight, "call", None)
        if compiling():      # compared, so that dynamo realizes the read and guards on it
            if TRACED_DECISIONS.get((self.key, str(device))) is None and call is None:
                return None
        elif call is None:      # a block outside every call of this node: say who called it
            from .dit_neighbours import pack_of

            caller = "another node"
            frame = sys._getframe(1)
            while frame is not None:    # the first frame outside this pack and torch
                module = frame.f_globals.get("__name__", "")
                if module.split(".")[0] not in (__name__.split(".")[0], "torch"):
                    caller = f"{pack_of(module)} ({frame.f_code.co_name})"
                    break
                frame = frame.f_back
            with self._lock:
                runs = list(self.runs)
            for run in runs:
                run.note(f"{caller} runs the model's blocks outside ComfyUI's model call, where "
                         f"ToMA cannot tell which run and step they belong to: those block calls "
                         f"ran unmerged")
        return call

    def summary(self, run: RunState) -> dict:
        """What a run did, in the fields the frontend's stats line reads."""
        stats = {
            "ratio": self.options.ratio,
            "family": self.family,
            "layers_merged": len(run.layers_merged),
            "layers_total": len(run.layers_seen),
            "steps_merged": len(run.steps_merged),
            "steps_total": run.steps_total,
            "plans_built": run.builds,
            "sampling_s": time.perf_counter() - run.started,
            "levels": [{"name": name, "tokens": n, "merged_tokens": m}
                       for name, (n, m) in sorted(run.levels.items())],
        }
        if run.build_seconds is not None:
            stats["planning_s"] = run.build_seconds
        notes = [*self.setup_notes, *run.notes]
        if not run.layers_merged:
            notes.append(self.why_nothing_merged(run))
        if run.model_calls and run.steps_total > 1 and not run.steps_reported:
            notes.append("the sampler reported no steps, so plans were built once for the run")
        if notes:
            stats["note"] = "; ".join(notes)
        return stats

    def why_nothing_merged(self, run: RunState) -> str:
        """Why a run merged no layer, from what it counted (its notes say more)."""
        if not run.merging_calls:
            if run.model_calls and not any(run.in_window(step, self.options.start_percent,
                                                         self.options.end_percent)
                                           for step in range(max(run.steps_total, 1))):
                return "nothing merged: no step lay inside start_percent..end_percent"
            return "nothing merged: no model call could merge"
        if not run.layers_seen:
            return ("nothing merged: ToMA's block patches did not run in the merging steps "
                    "(another node ran the model's blocks its own way)")
        if run.notes:
            return "nothing merged (see the notes before)"
        return "nothing merged: no layer had enough tokens in the merging steps"

    def _report(self, run: RunState) -> None:
        stats = self.last_stats = self.summary(run)
        if self.options.verbose:
            levels = ", ".join(f"{lv['name']}: {lv['tokens']}->{lv['merged_tokens']} tokens"
                               for lv in stats["levels"]) or "none"
            planning = (f" in {stats['planning_s']:.3f} s" if "planning_s" in stats else "")
            log.info("ToMA run: %s; %d/%d layers and %d/%d steps merged; %d plans built%s of "
                     "%.2f s sampling", levels, stats["layers_merged"], stats["layers_total"],
                     stats["steps_merged"], stats["steps_total"], run.builds, planning,
                     stats["sampling_s"])
        send_stats(self.node_id, stats)
