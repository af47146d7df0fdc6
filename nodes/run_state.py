"""State of one ToMA patch: its options, the current sampling run, and the model call in flight.

ComfyUI shares patch objects between clones of a model, and v0.33 can evaluate the cond batches
of one step in a thread pool (one thread per GPU), so nothing mutable lives on the patch objects:

- Per run (the pattern of ComfyUI's EasyCache): the OUTER_SAMPLE wrapper clones the guider's
  model_options for that run, puts a fresh RunState (plans, counters) in its transformer_options
  under this node's key, and puts the original options back in `finally`, reporting what was
  merged. Every model call of the run, on any thread, finds it there.
- Steps: the SAMPLER_SAMPLE wrapper hands the sampler a callback that tells the run when a step
  is done (a host int, once per step however many model evaluations the step takes), and the
  schedule's length. The step is never read back from the device.
- Per call: the APPLY_MODEL wrapper runs on the host before the diffusion model (and outside the
  graph when ComfyUI's TorchCompileModel compiles the diffusion model). It decides everything
  that needs the host: the step, whether merging is on, whether plans are due, the batch's
  identity (cond uuids, cond/uncond order, context window, device), what the family reads from
  the inputs. It hands the blocks a ModelCall, which every block patch finds one way
  (ToMAState.call_of). The blocks (run inside the model, traced by dynamo under torch.compile)
  only read that and record through its methods (model_call.py): no locks, clocks or host reads
  of device values there. After the call the wrapper adds what they recorded to the run.

Beside it: arguments.py binds the wrapped calls' arguments, forward_patches.py installs the
block patches, compile_guards.py handles torch.compile without guards.
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
from .model_call import Describe, ModelCall, RunState
from .options import ToMAOptions
from .sequence_parallel import sequence_shard
from .ui_stats import send_stats

log = logging.getLogger("ToMA")


def foreign_caller() -> str:
    """Who called into a block patch: the node pack (or module) and function of the first frame
    up the stack outside this pack and torch, e.g. "ComfyUI-TeaCache (teacache_flux_forward)"."""
    from .dit_neighbours import pack_of

    pack = __name__.split(".")[0]
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.split(".")[0] not in (pack, "torch"):
            return f"{pack_of(module)} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "another node"


class ToMAState:
    """Options and setup notes of one ToMA node; runs and calls live in transformer_options."""

    def __init__(self, options: ToMAOptions, family: str, node_id: str | None = None,
                 depth: int = 0, describe: Describe | None = None) -> None:
        self.options = options
        self.family = family
        self.node_id = node_id
        # transformer_options keys of this node's RunState during a run and ModelCall in a call:
        # one per ToMA node in a chain (depth: ToMA nodes already on the model), the same
        # whenever the node runs again, since a model compiled without guards on
        # transformer_options replays the keys it traced (a new key each time the node ran,
        # on a LoRA strength change say, made the replay look up a key no longer there)
        self.key = "toma_run" if depth == 0 else f"toma_run_{depth + 1}"
        self.call_key = f"{self.key}_call"
        # the per-call hook (model_call.Describe): a transformer family's reading; none for a
        # UNet, whose blocks read everything they need from their own options
        self.describe = describe
        # said when the node patched the model: true of every run of the patched model
        self.setup_notes: list[str] = []
        # the model call in flight on each thread, and the runs in progress
        self.in_flight = threading.local()
        self.runs: list[RunState] = []
        # the ModelPatcher the node patched, weakly (a strong reference would keep it loaded
        # in ComfyUI's model management after the graph let it go)
        self.source: weakref.ref | None = None
        self.last_stats: dict | None = None     # the last finished run's summary
        self._lock = threading.Lock()

    def setup_note(self, message: str) -> None:
        """Tell the user (log warning, and a note in the stats of every run of this patched
        model) about something the node set up differently from what was asked, e.g. a scope
        fallback."""
        with self._lock:
            if message in self.setup_notes:
                return
            self.setup_notes.append(message)
        log.warning("ToMA: %s", message)

    def run_note(self, run: RunState, message: str) -> None:
        """Tell the user once per run (log warning, and a note in that run's stats) about
        something ToMA did differently from what was asked in that run."""
        if run.note(message):
            log.warning("ToMA: %s", message)

    # Runs ------------------------------------------------------------------------------------
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
        run.window = self.sigma_window(guider)
        run.compiled = isinstance(original.get("torch_compile_kwargs"), dict)
        run.compiled_without_guards = unguarded_compile(original)
        guider.model_options.setdefault("transformer_options", {})[self.key] = run
        with self._lock:
            self.runs.append(run)
        try:
            out = executor(*args, **kwargs)
            self.check_finite(run, out)
            return out
        finally:
            guider.model_options = original
            with self._lock:
                self.runs.remove(run)
            self._report(run)

    def sigma_window(self, guider: object) -> tuple[float, float] | None:
        """(start_sigma, end_sigma) of start_percent and end_percent on the guider's model's
        noise schedule (None where the model has no model_sampling)."""
        patcher = getattr(guider, "model_patcher", None)
        try:
            sampling = patcher.get_model_object("model_sampling")
        except AttributeError:
            return None
        o = self.options
        return (float(sampling.percent_to_sigma(o.start_percent)),
                float(sampling.percent_to_sigma(o.end_percent)))

    def check_finite(self, run: RunState, samples: object) -> None:
        """Say so when a run's samples hold NaN or inf (fp16 overflow, a broken LoRA): ToMA
        merged them as they came, as the unmerged model would have carried them. One read on
        the host per run, after sampling (never inside a model call)."""
        if torch.is_tensor(samples) and not bool(torch.isfinite(samples).all()):
            self.run_note(run, "the model produced non-finite values (NaN or inf); ToMA passed "
                               "them through as the unmerged model does")

    def sampler_sample_wrapper(self, executor: Callable, *args, **kwargs):
        """WrappersMP.SAMPLER_SAMPLE: the run learns the schedule (its sigmas, read to the host
        once here, before the first model call) and, through the sampler's step callback
        (ComfyUI's samplers call it once per finished step), each step as a host int. A
        callback that was there keeps being called."""
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
            if previous is not None:
                return previous(step, *rest, **more)
            return None

        args, kwargs = with_argument(executor, args, kwargs, "callback", callback)
        return executor(*args, **kwargs)

    def apply_model_wrapper(self, executor: Callable, *args, **kwargs):
        """WrappersMP.APPLY_MODEL: decide this call on the host and hand its ModelCall to the
        blocks (see call_of); afterwards add what they recorded to the run."""
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
            if key not in call.run.host_reads:
                call.run.host_reads[key] = sequence_shard(model)
            call.shard = call.run.host_reads[key]
            for note in self.describe(call, executor.class_obj, arguments):
                self.run_note(call.run, note)
        args, kwargs = with_argument(executor, args, kwargs, "transformer_options",
                                     {**options, self.call_key: call})
        traced = call.traced = (self.key, str(call.identity[-1])) if call.run.compiled else None
        if traced is not None:
            TRACED_DECISIONS[traced] = f"{self.family} {self.options!r} {call.decisions()}"
            TRACED_PLANS[traced] = call.plans
        outer = getattr(self.in_flight, "call", None)
        self.in_flight.call = call
        try:
            return executor(*args, **kwargs)
        finally:
            self.in_flight.call = outer
            if traced is not None:
                TRACED_DECISIONS.pop(traced, None)
                TRACED_PLANS.pop(traced, None)
            self.close_call(call, step, built)

    def open_call(self, run: RunState, x: object, options: dict) -> tuple[ModelCall, int]:
        """A ModelCall for the run's current step (returned beside it): merging on or off
        (ratio, start/end_percent on the noise schedule), and the plans of its identity, fresh
        when due."""
        device = x.device if torch.is_tensor(x) else None
        window = options.get("context_window")
        identity = (tuple(options.get("uuids") or ()), tuple(options.get("cond_or_uncond") or ()),
                    tuple(getattr(window, "index_list", None) or ()), device)
        timed = device is not None and device.type == "cpu"
        call = ModelCall(run, identity, plan_seconds=0.0 if timed else None)
        with run.lock:
            run.model_calls += 1
            step = run.step
            o = self.options
            if o.ratio > 0 and run.in_window(step, o.start_percent, o.end_percent):
                call.merging = True
                call.plans = run.schedule.plans(identity, step)[0]
        return call, step

    def close_call(self, call: ModelCall, step: int, built: int) -> None:
        """Add what the blocks of `call` (the run's step `step`, holding `built` plans from
        earlier calls when it began) recorded to its run, with their notes."""
        run = call.run
        with run.lock:
            run.merging_calls += call.active
            for layer, (level, tokens, merged) in call.records.items():
                run.layers_seen.add(layer)
                if merged is None:
                    continue
                run.layers_merged.add(layer)
                run.steps_merged.add(step)
                run.levels[level] = (tokens, merged)
            run.builds += len(call.plans) - built
            if call.plan_seconds is not None:
                run.build_seconds = (run.build_seconds or 0.0) + call.plan_seconds
        for note in dict.fromkeys(call.notes):
            self.run_note(run, note)

    # Inside the model's blocks -----------------------------------------------------------------
    def call_of(self, options: dict, device: torch.device | None = None) -> ModelCall | None:
        """The ModelCall a block call belongs to: the one way every block patch finds it,
        whoever called the block. It is in the block's transformer_options where the caller
        handed them on; else (another pack's copy of the model's forward: TeaCache's; a family
        whose blocks get no options) it is this thread's call in flight; else None, and the
        runs in progress say who called the block outside any call.

        Traced by torch.compile, the graph is guarded on the call's decisions on `device` (the
        block's tokens'; compile_guards.TRACED_DECISIONS; dynamo guards what it reads through
        the thread's call itself), so a later call that decides otherwise at equal shapes is
        traced anew rather than replaying this one's."""
        call = options.get(self.call_key)
        if not isinstance(call, ModelCall):
            call = getattr(self.in_flight, "call", None)
        if compiling():      # compared, so that dynamo realizes the read and guards on it
            if TRACED_DECISIONS.get((self.key, str(device))) is None and call is None:
                return None
        elif call is None:      # a block outside every call of this node: say who called it
            caller = foreign_caller()
            with self._lock:
                runs = list(self.runs)
            for run in runs:
                self.run_note(run, f"{caller} runs the model's blocks outside ComfyUI's model "
                                   f"call, where ToMA cannot tell which run and step they "
                                   f"belong to: those block calls ran unmerged")
        return call

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
        stats = self.summary(run)
        self.last_stats = stats
        if self.options.verbose:
            levels = ", ".join(f"{lv['name']}: {lv['tokens']}->{lv['merged_tokens']} tokens"
                               for lv in stats["levels"]) or "none"
            planning = (f" in {stats['planning_s']:.3f} s" if "planning_s" in stats else "")
            log.info("ToMA run: %s; %d/%d layers and %d/%d steps merged; %d plans built%s of "
                     "%.2f s sampling", levels, stats["layers_merged"], stats["layers_total"],
                     stats["steps_merged"], stats["steps_total"], run.builds, planning,
                     stats["sampling_s"])
        send_stats(self.node_id, stats)
