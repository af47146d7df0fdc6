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
  the inputs. It hands the blocks a ModelCall in the call's transformer_options. The blocks (run
  inside the model, traced by dynamo under torch.compile) only read that and append to its lists:
  no locks, thread-locals, clocks or host reads of device values there. After the call the
  wrapper adds what they recorded to the run.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

from ..toma_core import MergePlan, PlanSchedule, Regions, RegionTables
from ..toma_core.regions import compiling
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


def own_forward(module: torch.nn.Module) -> Callable:
    """The module's own forward, bound to it."""
    return types.MethodType(type(module).forward, module)


class ForwardPatches:
    """ToMA's object patches of module forwards on one patched ModelPatcher, kept so that they
    can be made again for another copy of the diffusion model: ComfyUI's multi-GPU clones
    (v0.33: MultiGPU CFG Split, Select Model Device) each run a model object of their own with
    the first one's object patches, and a patch bound to the first copy's modules would run
    those modules (another device's weights) from every device's thread.

    make(module, original) -> the patched forward of `module`; `original` is another pack's
    object patch of that forward where there was one (it keeps running, inside ToMA's), else
    the module's own forward."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, Callable | None, Callable]] = []

    def add(self, model, path: str, make: Callable[[torch.nn.Module, Callable], Callable]) -> None:
        """Patch the forward of diffusion_model.<path> on ModelPatcher `model`."""
        key = f"diffusion_model.{path}.forward"
        previous = model.object_patches.get(key)
        self.entries.append((path, previous, make))
        module = module_at(model.model.diffusion_model, path)
        model.add_object_patch(key, make(module, previous or own_forward(module)))

    def rebind(self, source, clone) -> None:
        """ComfyUI's multi-GPU callback (ON_MATCH_MULTIGPU_CLONES, ON_DEEPCLONE_MULTIGPU):
        `clone` runs its own model object; its patches are made again for that object's
        modules."""
        if clone.model is source.model:
            return
        for path, previous, make in self.entries:
            module = module_at(clone.model.diffusion_model, path)
            clone.add_object_patch(f"diffusion_model.{path}.forward",
                                   make(module, previous or own_forward(module)))

    def install_callbacks(self, model) -> None:
        """Have ComfyUI rebind these patches on each multi-GPU copy of `model` (callback kinds
        a ComfyUI version lacks are left out: it makes no such copies)."""
        from comfy.patcher_extension import CallbacksMP

        if not self.entries:
            return
        for name in ("ON_MATCH_MULTIGPU_CLONES", "ON_DEEPCLONE_MULTIGPU"):
            kind = getattr(CallbacksMP, name, None)
            if kind is not None:
                model.add_callback_with_key(kind, "toma", plain_function(self.rebind))


def module_at(root: torch.nn.Module, path: str) -> torch.nn.Module:
    """The submodule of `root` at a dotted path ("input_blocks.4.1.transformer_blocks.0")."""
    return functools.reduce(getattr, path.split("."), root)


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


def with_argument(executor, args: tuple, kwargs: dict, name: str,
                  value: object) -> tuple[tuple, dict]:
    """(args, kwargs) of the same wrapped call with argument `name` set to `value`, where it was
    passed (by keyword when it was not passed at all)."""
    try:
        params = list(inspect.signature(executor.original).parameters)
    except (TypeError, ValueError):
        params = []
    if name not in kwargs and name in params and params.index(name) < len(args):
        i = params.index(name)
        return (*args[:i], value, *args[i + 1:]), kwargs
    return args, {**kwargs, name: value}


def unguarded_compile(model_options: dict) -> bool:
    """Whether the model runs through a torch.compile wrapper that drops dynamo's guards on
    transformer_options (ComfyUI's TorchCompileModel from 0.8, KJNodes' compile nodes): what
    ToMA decides per call and hands the blocks there would then be fixed in the graph by its
    first trace. Such wrappers (comfy_api.torch_helpers and the ones modelled on it) leave
    "torch_compile_kwargs" in the options; torch.compile takes the guard filter out of those,
    so it is read from the compiled modules the APPLY_MODEL wrappers hold. Where none can be
    found, a compile with options is taken as unguarded (ComfyUI's node passes its filter
    there; v0.3.64's passes none and keeps every guard)."""
    kwargs = model_options.get("torch_compile_kwargs")
    if not isinstance(kwargs, dict):
        return False
    found = compiled_modules(model_options)
    if found:
        return any(guard_filter_of(module) is not None for module in found)
    return kwargs.get("options") is not None


def compiled_modules(model_options: dict) -> list:
    """The torch.compile'd modules (OptimizedModule) the APPLY_MODEL wrappers of these options
    hold, in their closures or in dicts of their module's globals (one level of dicts deep)."""
    import torch._dynamo.eval_frame as eval_frame

    wrappers = (((model_options.get("transformer_options") or {}).get("wrappers") or {})
                .get("apply_model") or {}).values()
    found: list = []

    def visit(value: object, depth: int = 0) -> None:
        if isinstance(value, eval_frame.OptimizedModule):
            found.append(value)
        elif depth < 2 and hasattr(value, "values") and callable(value.values):
            for item in list(value.values()):
                visit(item, depth + 1)

    for functions in wrappers:
        for fn in functions:
            for cell in getattr(fn, "__closure__", None) or ():
                try:
                    visit(cell.cell_contents)
                except ValueError:   # an empty cell
                    continue
            code, names = getattr(fn, "__code__", None), getattr(fn, "__globals__", {})
            for name in getattr(code, "co_names", ()):
                visit(names.get(name))
    return found


def guard_filter_of(module: object) -> object:
    """The guard filter a torch.compile'd module was compiled with (None: every guard kept)."""
    hooks = getattr(getattr(module, "dynamo_ctx", None), "_hooks", None)
    return getattr(hooks, "guard_filter_fn", None)


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
        self.prefix_entries: dict = {}   # HiDream-O1's kept prompt keys and values
        # compiled by torch.compile (see unguarded_compile: without guards on
        # transformer_options)
        self.compiled = False
        self.compiled_without_guards = False
        self.notes: list[str] = []   # what this run did differently from what was asked
        self.tables: dict[tuple[Regions, torch.device | None], RegionTables] = {}
        self.lock = threading.Lock()

    def step_done(self, step: int) -> None:
        """The sampler finished step `step` (0-based): later calls belong to the next one."""
        with self.lock:
            self.step = max(self.step, step + 1)
            self.steps_reported += 1

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

    identity: what plans are kept under (cond uuids, cond/uncond order, context window, device);
    grid: the family's token grid of this call ((h, w) or (t, h, w)), None where it has none;
    mergeable: False when the family found an input merging would break (see its notes);
    step: the sampling step; merging: whether this call merges (ratio, start/end_percent) -- the
    blocks read only this flag, never the step: under torch.compile a value read in the graph
    is guarded on, and a step would recompile the model every step;
    plans: key -> plan (or None: nothing to merge) for this identity; empty when the plans are
    due, so the first block of each level or group builds one;
    data: what the family's patches share within the call (e.g. text length, merged positions);
    records: layer -> (level, tokens, merged tokens or None), set by blocks (a dict: where the
    graph breaks inside blocks, dynamo replays a dict's new items, but rewrites a list whole);
    notes: appended by blocks; both added to the run after the call;
    pass_index / pass_layers: the pass over the model's blocks the call is in, and the layers
    that pass has run (see ToMAState.pass_of).
    """

    run: RunState
    device: torch.device | None = None
    identity: tuple = ()
    grid: tuple[int, ...] | None = None
    mergeable: bool = True
    step: int = 0
    merging: bool = False
    plans: dict = field(default_factory=dict)
    data: dict = field(default_factory=dict)
    records: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    timed: bool = False          # plan builds are timed (eager CPU: free and accurate there)
    plan_seconds: float = 0.0
    plans_before: int = 0        # plans kept from earlier calls (the rest are built in this one)
    pass_index: int = 0
    pass_layers: set = field(default_factory=set)

    @property
    def active(self) -> bool:
        """Whether this call merges at all."""
        return self.merging and self.mergeable

    def decisions(self) -> str:
        """What the host decided for this call that its blocks read and that can change at
        equal tensor shapes (merging on or off, the grid's mergeable part and the plain values
        a family read into `data`: protected frames, prefix and text lengths), as one text."""
        plain = sorted((str(k), v) for k, v in self.data.items()
                       if isinstance(v, (int, float, str, bool, tuple, type(None))))
        return repr((self.active, self.grid, plain))


# family hook: fills call.grid / data / mergeable from apply_model's arguments; returns why the
# call cannot merge when the user should know
Describe = Callable[[ModelCall, object, dict], str | None]


# While a model compiled by torch.compile runs: (node key, device) -> the node's settings and the
# decisions of the model call in flight (ModelCall.decisions). Blocks read their entry while
# dynamo traces them; unlike transformer_options (whose guards ComfyUI's compile drops, with
# those on the patch functions it holds) a global is guarded, so a call whose decisions or
# settings differ from a traced one's at equal shapes gets a trace of its own instead of
# replaying another call's. Each entry lives for its call only.
TRACED_DECISIONS: dict[tuple[str, str], str] = {}


# While a compiled model runs: (node key, device) -> the plans of the model call in flight (the
# dict of ModelCall.plans). Blocks ask it whether their level's plan is built yet: a check on
# transformer_options is not guarded there, and where the graph breaks inside the blocks, dynamo
# compiles one block's code once for all of them, so every block would replay the first one's
# answer. Asked here, the answer is guarded, and the blocks that reuse a plan get a trace of their
# own. Each entry lives for its call only.
TRACED_PLANS: dict[tuple[str, str], dict] = {}


def traced_decisions(key: str, device: torch.device) -> str | None:
    """The decisions of node `key`'s model call in flight on `device` (see TRACED_DECISIONS)."""
    return TRACED_DECISIONS.get((key, str(device)))


class ToMAState:
    """Options and setup notes of one ToMA node; runs and calls live in transformer_options."""

    def __init__(self, options: ToMAOptions, family: str, node_id: str | None = None,
                 depth: int = 0) -> None:
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
        self.describe: Describe | None = None
        # said when the node patched the model: true of every run of the patched model
        self.setup_notes: list[str] = []
        # the model call in flight on each thread (for blocks another pack's forward calls
        # without transformer_options), and the runs in progress
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
            run.step_done(int(step))
            if previous is not None:
                return previous(step, *rest, **more)
            return None

        args, kwargs = with_argument(executor, args, kwargs, "callback", callback)
        return executor(*args, **kwargs)

    def apply_model_wrapper(self, executor: Callable, *args, **kwargs):
        """WrappersMP.APPLY_MODEL: decide this call on the host and hand its ModelCall to the
        blocks in the call's transformer_options (and, for blocks that another pack's forward
        calls without them, as this thread's call in flight)."""
        arguments = call_arguments(executor, args, kwargs)
        options = arguments.get("transformer_options") or {}
        x = arguments.get("x", args[0] if args else None)
        run = options.get(self.key)
        call = self.open_call(run if isinstance(run, RunState) else self.new_run(), x, options)
        if self.describe is not None:
            why = self.describe(call, executor.class_obj, arguments)
            if why:
                self.run_note(call.run, why)
        args, kwargs = with_argument(executor, args, kwargs, "transformer_options",
                                     {**options, self.call_key: call})
        traced = (self.key, str(call.device)) if call.run.compiled else None
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
            self.close_call(call)

    def open_call(self, run: RunState, x: object, options: dict) -> ModelCall:
        """A ModelCall for the run's current step: merging on or off (ratio, start/end_percent
        on the noise schedule), and the plans of its identity, fresh when due."""
        device = x.device if torch.is_tensor(x) else None
        window = options.get("context_window")
        identity = (tuple(options.get("uuids") or ()), tuple(options.get("cond_or_uncond") or ()),
                    tuple(getattr(window, "index_list", None) or ()), device)
        call = ModelCall(run, device, identity, timed=device is not None and device.type == "cpu")
        with run.lock:
            run.model_calls += 1
            step = run.step
            o = self.options
            call.step = step
            if o.ratio > 0 and run.in_window(step, o.start_percent, o.end_percent):
                call.merging = True
                call.plans = run.schedule.plans(identity, step)[0]
        call.plans_before = len(call.plans)
        return call

    def close_call(self, call: ModelCall) -> None:
        """Add what the call's blocks recorded to its run, with their notes."""
        run = call.run
        with run.lock:
            run.merging_calls += call.active
            for layer, (level, tokens, merged) in call.records.items():
                run.layers_seen.add(layer)
                if merged is None:
                    continue
                run.layers_merged.add(layer)
                run.steps_merged.add(call.step)
                run.levels[level] = (tokens, merged)
            run.builds += len(call.plans) - call.plans_before
            if call.timed:
                run.build_seconds = (run.build_seconds or 0.0) + call.plan_seconds
        for note in dict.fromkeys(call.notes):
            self.run_note(run, note)

    # Inside the model's blocks -----------------------------------------------------------------
    def call_of(self, options: dict) -> ModelCall | None:
        """The ModelCall of the model call these block options belong to (None outside one)."""
        call = options.get(self.call_key)
        return call if isinstance(call, ModelCall) else None

    def block_call_of(self, options: dict, device: torch.device) -> ModelCall | None:
        """The ModelCall a block call on `device` belongs to: the one in its options; where
        another pack's copy of the model's forward hands the block none (TeaCache's), this
        thread's model call in flight; None (and said, naming the caller) outside any.

        Traced by torch.compile, the graph is also guarded on the call's decisions
        (TRACED_DECISIONS), so a later call that decides otherwise at equal shapes is traced
        anew rather than replaying this one's decisions."""
        call = self.call_of(options)
        if compiling():
            if traced_decisions(self.key, device) is None and call is None:
                return None
            return call
        if call is None:
            call = getattr(self.in_flight, "call", None)
            if call is None:
                self.blind_block(foreign_caller())
        return call

    def blind_block(self, caller: str) -> None:
        """A patched block ran outside every model call of this node (no options handed to it,
        none in flight on its thread): tell the runs in progress who called it."""
        with self._lock:
            runs = list(self.runs)
        for run in runs:
            self.run_note(run, f"{caller} runs the model's blocks outside ComfyUI's model call, "
                               f"where ToMA cannot tell which run and step they belong to: "
                               f"those block calls ran unmerged")

    def plan(self, call: ModelCall, key: Hashable,
             build: Callable[[], MergePlan | None]) -> MergePlan | None:
        """The plan under `key` in this call's plans, built by build() when missing (read
        through TRACED_PLANS while dynamo traces)."""
        if compiling():
            plans = TRACED_PLANS.get((self.key, str(call.device)), call.plans)
            if key not in plans:
                plans[key] = build()
            return plans[key]
        if key not in call.plans:
            if call.timed:
                start = time.perf_counter()
                call.plans[key] = build()
                call.plan_seconds += time.perf_counter() - start
            else:
                call.plans[key] = build()
        return call.plans[key]

    @staticmethod
    def pass_of(call: ModelCall | None, layer: Hashable) -> int:
        """The pass over the model's blocks that this call of `layer` belongs to: 0, and one more
        each time a layer runs again within the same model call. A wrapper that runs the model
        more than once inside one call (HiDream-O1's seam smoothing, on pixels rolled by part of
        a patch) so gets plans of its own for each pass (plan keys carry the pass), built from
        that pass's tokens rather than the first pass's."""
        if call is None:
            return 0
        if layer in call.pass_layers:
            call.pass_index += 1
            call.pass_layers.clear()
        call.pass_layers.add(layer)
        return call.pass_index

    @staticmethod
    def tables(call: ModelCall | None, regions: Regions,
               device: torch.device | None) -> RegionTables:
        """The index tables of `regions` on `device`: kept for the run, except under
        torch.compile, where the graph builds them (a kept dict would be guarded on)."""
        if call is None or compiling():
            return regions.tables(device)
        found = call.run.tables.get((regions, device))
        if found is None:
            found = call.run.tables.setdefault((regions, device), regions.tables(device))
        return found

    @staticmethod
    def record(call: ModelCall | None, layer: Hashable, level: str, tokens: int,
               plan: MergePlan | None) -> None:
        """Count one layer call for the run's summary (plan None: it ran unmerged)."""
        if call is not None:
            call.records[layer] = (level, tokens, None if plan is None else plan.merged_tokens)

    @staticmethod
    def note(call: ModelCall | None, message: str) -> None:
        """A notice from inside the model: said once per run after the call (see `run_note`)."""
        if call is not None:
            call.notes.append(message)

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
