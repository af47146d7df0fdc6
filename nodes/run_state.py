"""State of one ToMA patch: its options, the current sampling run, and the model call in flight.

ComfyUI shares patch objects between clones of a model, and v0.33 can evaluate the cond batches
of one step in a thread pool (one thread per GPU), so nothing mutable lives on the patch objects:

- Per run (the pattern of ComfyUI's EasyCache): the OUTER_SAMPLE wrapper clones the guider's
  model_options for that run, puts a fresh RunState (plan caches, counters) in its
  transformer_options under this node's key, and puts the original options back in `finally`,
  reporting what was merged. Every model call of the run, on any thread, finds it there.
- Per call: the APPLY_MODEL wrapper runs on the thread that evaluates the model, so it opens a
  ModelCall (the run, the device, the batch's identity, what the family reads from the inputs)
  on a per-thread stack; the blocks of that call, on the same thread, read the top of it.
  A model called outside a sampler gets a throwaway run for that one call.
- Plans are kept per device and keyed on the batch's identity (cond uuids and cond/uncond
  order), so calls of the same shape from different conds, areas or hook groups never share one.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
import types
import uuid
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ..toma_core import MergePlan, PlanCache, step_index
from .options import ToMAOptions
from .ui_stats import send_stats

log = logging.getLogger("ToMA")

# ModelCall.step before the first block asked for it
UNSET = object()


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


def call_arguments(executor, args: tuple, kwargs: dict) -> dict:
    """The arguments of a wrapped call by parameter name, however ComfyUI passed them
    (positionally or by keyword); the function's **kwargs are merged in."""
    try:
        bound = inspect.signature(executor.original).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return dict(kwargs)
    arguments = dict(bound.arguments)
    for name, param in bound.signature.parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(arguments.pop(name, {}))
    return arguments


class RunState:
    """One sampling run: plan caches (one per device) and counters, safe to share by threads."""

    def __init__(self, recompute_every: int) -> None:
        self.recompute_every = recompute_every
        self.caches: dict[torch.device | None, PlanCache] = {}
        self.steps_total = 0
        self.started = time.perf_counter()
        self.layers_seen: set = set()
        self.layers_merged: set = set()
        self.steps_merged: set = set()
        self.levels: dict = {}
        self.lock = threading.Lock()

    def cache(self, device: torch.device | None) -> PlanCache:
        """The plan cache of `device`: only the thread driving that device uses it."""
        with self.lock:
            if device not in self.caches:
                self.caches[device] = PlanCache(self.recompute_every)
            return self.caches[device]

    @property
    def builds(self) -> int:
        return sum(c.builds for c in self.caches.values())

    @property
    def build_seconds(self) -> float:
        return sum(c.build_seconds for c in self.caches.values())

    def clear_plans(self) -> None:
        """Forget every plan (benchmarks time a plan build this way)."""
        for cache in self.caches.values():
            cache.clear()


@dataclass
class ModelCall:
    """One model call on one thread: what every block of the call shares.

    identity: cond uuids and cond/uncond order of the batch (part of every plan key);
    grid: the family's token grid of this call ((h, w) or (t, h, w)), None where it has none;
    mergeable: False when the family found an input merging would break (see its notes);
    step: the sampling step, worked out once per call (None: no merging in this call);
    data: what the family's patches share within the call (e.g. text length, hook state).
    """

    run: RunState
    device: torch.device | None = None
    identity: tuple = ()
    grid: tuple[int, ...] | None = None
    mergeable: bool = True
    step: object = UNSET
    data: dict = field(default_factory=dict)


# family hook: fills call.grid / data / mergeable from apply_model's arguments; returns why the
# call cannot merge when the user should know
Describe = Callable[[ModelCall, object, dict], str | None]


class ToMAState:
    """Options, notices and the per-thread call stack of one ToMA node; runs live elsewhere."""

    def __init__(self, options: ToMAOptions, family: str, node_id: str | None = None) -> None:
        self.options = options
        self.family = family
        self.node_id = node_id
        # transformer_options key of this node's RunState during a run
        self.key = f"toma_run_{uuid.uuid4().hex[:12]}"
        self.describe: Describe | None = None
        self.notices: list[str] = []   # said once per node, shown in every run's stats
        self._local = threading.local()

    def notice(self, message: str) -> None:
        """Tell the user once (log warning, and a note in the stats line of every run) about
        something ToMA did differently from what was asked, e.g. a scope fallback."""
        if message not in self.notices:
            self.notices.append(message)
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
        guider.model_options.setdefault("transformer_options", {})[self.key] = run
        try:
            return executor(*args, **kwargs)
        finally:
            guider.model_options = original
            self._report(run)

    def apply_model_wrapper(self, executor: Callable, *args, **kwargs):
        """WrappersMP.APPLY_MODEL: open this thread's ModelCall for the blocks of the call."""
        arguments = call_arguments(executor, args, kwargs)
        options = arguments.get("transformer_options") or {}
        x = arguments.get("x", args[0] if args else None)
        run = options.get(self.key)
        call = ModelCall(run if isinstance(run, RunState) else self.new_run(),
                         x.device if torch.is_tensor(x) else None,
                         (tuple(options.get("uuids") or ()),
                          tuple(options.get("cond_or_uncond") or ())))
        if self.describe is not None:
            why = self.describe(call, executor.class_obj, arguments)
            if why:
                self.notice(why)
        with self.model_call(call):
            return executor(*args, **kwargs)

    @contextmanager
    def model_call(self, call: ModelCall) -> Iterator[ModelCall]:
        """Make `call` this thread's current model call inside the block."""
        stack = self._stack()
        stack.append(call)
        try:
            yield call
        finally:
            stack.pop()

    def current(self) -> ModelCall | None:
        """This thread's innermost model call, or None outside one."""
        stack = self._stack()
        return stack[-1] if stack else None

    def _stack(self) -> list[ModelCall]:
        stack = getattr(self._local, "calls", None)
        if stack is None:
            stack = self._local.calls = []
        return stack

    # Per-call decisions ------------------------------------------------------------------------
    def active_step(self, transformer_options: dict) -> int | None:
        """The sampling step of this thread's model call when merging is on for it, else None.

        The step comes from the call's sigma within the sampler's schedule, so every model call
        at one noise level (CFG halves; Heun's corrector, which evaluates at the next step's
        sigma, and that step's first call) gets the same answer (see step_index); it is worked
        out once per call (one host read of sigma).
        """
        call = self.current()
        if call is None or self.options.ratio == 0:
            return None
        if call.step is UNSET:
            call.step = self._step(call.run, transformer_options)
        return call.step

    def _step(self, run: RunState, transformer_options: dict) -> int | None:
        schedule = transformer_options.get("sample_sigmas")
        sigmas = transformer_options.get("sigmas")
        step = 0
        if schedule is not None and sigmas is not None:
            step = step_index(float(sigmas.flatten()[0]), schedule)
            run.steps_total = max(len(schedule) - 1, 1)
        fraction = step / run.steps_total if run.steps_total else 0.0
        if not self.options.start_percent <= fraction < self.options.end_percent:
            return None
        return step

    def plan(self, key: Hashable, step: int,
             build: Callable[[], MergePlan | None]) -> MergePlan | None:
        """The plan under `key` for this thread's call (its device's cache, keyed on its batch
        identity too), rebuilt on the recompute schedule."""
        call = self.current()
        return call.run.cache(call.device).get((key, call.identity), step, build)

    def record(self, layer: Hashable, level: str, tokens: int, plan: MergePlan | None,
               step: int | None) -> None:
        """Count one layer call for the run's summary."""
        call = self.current()
        if call is None:
            return
        run = call.run
        with run.lock:
            run.layers_seen.add(layer)
            if plan is None or step is None:
                return
            run.layers_merged.add(layer)
            run.steps_merged.add(step)
            run.levels[level] = (tokens, plan.merged_tokens)

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
            "planning_s": run.build_seconds,
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
                     run.builds, stats["planning_s"], stats["sampling_s"])
        send_stats(self.node_id, stats)
