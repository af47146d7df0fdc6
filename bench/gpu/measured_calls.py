"""Section gpu-call (ComfyUI only): one model call of SDXL, Flux.1 dev, Wan 2.1 14B and (ComfyUI
0.33 and later) HiDream-O1 at real size, measured on the GPU, unmerged and through the ToMA node:
the measurement beside the gpu-model section's projection of the same calls.

    COMFYUI_PATH=/path/to/ComfyUI python -m bench --sections gpu-call --device cuda [--out ...]

The models and sizes are gpu-model's (bench/gpu_model.MODELS, ComfyUI's own classes at their
real configuration): SDXL base 1024x1024 (batch 2, cond and uncond in one call), Flux.1 dev
1024x1024 (batch 1, 512 text tokens), Wan 2.1 14B t2v 832x480 (batch 2; 33 frames on the GPU:
WAN_GPU_LATENT), HiDream-O1 2048x2048 (batch 1: its third call, the first on the unmerged
model's prompt cache), bf16, random
weights (`fill_on_device`: bench/shared/weights.py's distribution, drawn on the device). Settings:
gpu-model's SETTINGS, the node's defaults (ratio 0.5) for all four and the paper's (SDXL ratio
0.5, Flux 0.75, attention scope), applied through the pack's public path (nodes/apply.py
apply_toma with nodes/options.py make_options).

Each repetition is one sampling run (comfy.sample.sample, Euler, a 20-step schedule) stopped after
its first model call, so the call goes through the ModelPatcher as a workflow's does, with
ToMA's OUTER_SAMPLE / SAMPLER_SAMPLE / APPLY_MODEL wrappers running and a fresh run (plans built
inside the call, as at every step with recompute_every 1). An APPLY_MODEL wrapper of our own, the
outermost, times that call: CUDA events around it on the GPU's timeline (the device synchronised
first, so nothing queued before is counted), the host's perf_counter beside them: host_ms until
the call returned on the host (issuing its kernels; "bound" says host where that nearly fills
the GPU's time, so the GPU waited for the host), wall_ms after the sync; on a CPU only the host
clock. Warm-up calls first (cuBLAS/cuDNN handles, attention kernel choice, Triton's
compilation of the pack's kernels), then the variants interleaved (order reversed every other
repetition): median, minimum and spread of each, speedup with the range of the side-by-side
ratios (bench.shared.common). Peak memory: torch.cuda.max_memory_allocated over one warm-up call,
with
the weights (peak_gib) and above what was allocated before the call (act_gib). Plan builds: one
more ToMA call with every plan build (ModelCall.plan's build) bracketed by events, their sum
against the same call's time (plan_share). Then, if the budget allows, the default setting and
the unmerged model under ComfyUI's TorchCompileModel wrapper (comfy_api.torch_helpers.
set_torch_compile_wrapper, backend inductor, the node's guard filter): each compiled on its own
after torch._dynamo.reset() and timed on its own (see `collect`: with the node's guard filter
one variant's graph would serve the other), its first call's time (compile included) and
dynamo's graph and graph-break counts beside the timings.

On a CPU (`--device cpu`, the rehearsal) the same code runs at reduced sizes: gpu-model's SMALL
configurations (toy widths of the same classes; SDXL latent 32x32 with unet_levels "all", Flux
and Wan with skip_blocks "none", so that ToMA merges at those sizes), bf16 as on the GPU.

Every case (a model eagerly, a model compiled) runs under a time limit: repetitions stop early
when the next round would pass it, and an alarm ends the case at the limit; the section's whole
budget ($TOMA_GPU_CALL_BUDGET_S, else BUDGET_S) caps every case's limit, and a case that no
longer fits is not started. After every case the rows so far are written to
$TOMA_GPU_CALL_PARTIAL when that is set (bench/gpu/run.sh keeps them if the section is killed).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import os
import signal
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..shared.common import MIN_REPS, Timing, speedup
from ..shared.config import BenchConfig, load_pack
from . import projected_calls as gpu_model

log = logging.getLogger(__name__)

DTYPE = torch.bfloat16
STEPS = gpu_model.STEPS
WRAPPER_KEY = "bench_gpu_call"
BUDGET_S = 260.0            # the whole section when $TOMA_GPU_CALL_BUDGET_S is unset
MARGIN_S = 5.0              # kept free at the end of the budget (writing results)
COLUMNS = ("model", "setting", "ratio", "scope", "batch", "tokens", "ms", "ms_toma", "speedup",
           "speedup_lo", "speedup_hi", "host_ms", "host_ms_toma", "bound", "spread",
           "spread_toma", "reps", "plan_ms", "plan_share",
           "peak_gib", "peak_gib_toma", "act_gib", "act_gib_toma", "first_call_s",
           "first_call_s_toma", "graphs", "graphs_toma", "flag")


@dataclass(frozen=True)
class Case:
    """One timed case: a model, eagerly or compiled, its repetitions and time limit.

    warmup / reps: per variant, on a GPU (a CPU run uses CPU_WARMUP / CPU_REPS); limit_s: the
    most the case may take, building the model included; min_s: the least it needs to be
    started at all (a build, the warm-ups and MIN_REPS rounds)."""

    model: str
    compiled: bool
    warmup: int
    reps: int
    limit_s: float
    min_s: float


# The eager cases run in bench/gpu/run.sh's first command, the compiled ones in its second
# (TOMA_GPU_CALL_CASES). Limits: assumptions sized from the gpu-model projection of one call
# (SDXL 31 ms, Flux 116 ms, Wan 4.5 s, HiDream-O1 99 ms (three calls a repetition) unmerged, at
# the H200's measured peaks: real calls are slower) with room for the sampler's setup around
# each call and the model build; inductor's compile time is not known for these models on that
# machine: what is left of the budget goes to it, SDXL first.
CASES: tuple[Case, ...] = (
    Case("sdxl", False, warmup=2, reps=10, limit_s=40, min_s=15),
    Case("flux", False, warmup=2, reps=10, limit_s=50, min_s=20),
    Case("wan", False, warmup=1, reps=5, limit_s=60, min_s=30),
    Case("sdxl", True, warmup=2, reps=5, limit_s=120, min_s=30),
    Case("flux", True, warmup=2, reps=5, limit_s=120, min_s=30),
    # last: what the budget leaves (the compiled cases come first)
    Case("hidream_o1", False, warmup=2, reps=10, limit_s=40, min_s=15),
)
# On a CPU: 2 warm-up rounds (with one, the first timed round of the rehearsal's reduced SDXL
# ran 30 times slower than the next two, measured on the 2-core machine this was built on).
CPU_WARMUP, CPU_REPS = 2, MIN_REPS


class CaseTimeout(BaseException):  # BaseException: no `except Exception` swallows it
    """A case ran past its time limit (raised by the alarm)."""


class _OneCall(Exception):  # noqa: N818 (control flow, not an error)
    """Raised by the timing wrapper after the first model call: stops the sampler."""


# The clock ---------------------------------------------------------------------------------------
class Stopwatch:
    """Marks on the device's timeline: CUDA events on a GPU (no host sync to record one), the
    host's perf_counter on a CPU. `elapsed_ms(a, b)` after `finish()`."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def finish(self) -> None:
        """Wait until every marked point has passed (a sync on a GPU)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def elapsed_ms(self, start: Any, end: Any) -> float:
        if self.cuda:
            return float(start.elapsed_time(end))
        return 1e3 * (end - start)


@dataclass
class CallTime:
    """One timed model call: device ms (events), wall ms (to the end of the GPU's work), host ms
    (issuing it: until the model call returned on the host, before the sync), batch, the token
    counts ToMA merged ("" unmerged), and peak memory when asked for. Where host_ms reaches ms
    the GPU waited for the host: the call is host-bound."""

    ms: float
    wall_ms: float
    host_ms: float
    batch: int
    levels: str = ""
    peak_bytes: int | None = None
    act_bytes: int | None = None


@dataclass
class Timer:
    """The timing wrapper's state: whether to time a call (after `skip` more), what it saw."""

    watch: Stopwatch
    armed: bool = False
    skip: int = 0
    peak: bool = False
    result: CallTime | None = None
    run_type: Any = None          # the pack's RunState class, to find a ToMA run


def install_timer(patcher, device: torch.device, timer: Timer | None = None) -> Timer:
    """Add the timing APPLY_MODEL wrapper to `patcher` (before the pack's and the compile
    wrapper, so that it is the outermost on every clone) and return its state (`timer`, when
    given: one state for several models)."""
    from comfy.patcher_extension import WrappersMP

    pack = load_pack()
    call_arguments = pack.nodes.arguments.call_arguments
    if timer is None:
        timer = Timer(Stopwatch(device), run_type=pack.nodes.run_state.RunState)

    def wrapper(executor: Callable, *args, **kwargs):
        if not timer.armed:
            return executor(*args, **kwargs)
        if timer.skip > 0:              # a call before the timed one (spec.call) runs as it is
            timer.skip -= 1
            return executor(*args, **kwargs)
        timer.armed = False
        arguments = call_arguments(executor, args, kwargs)
        x = arguments.get("x", args[0] if args else None)
        options = arguments.get("transformer_options") or {}
        watch = timer.watch
        watch.finish()
        before = None
        if watch.cuda and timer.peak:
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        wall = time.perf_counter()
        start = watch.mark()
        executor(*args, **kwargs)
        end = watch.mark()
        host_ms = 1e3 * (time.perf_counter() - wall)
        watch.finish()
        wall_ms = 1e3 * (time.perf_counter() - wall)
        run = next((v for v in options.values() if isinstance(v, timer.run_type)), None)
        timer.result = CallTime(watch.elapsed_ms(start, end), wall_ms, host_ms, int(x.shape[0]),
                                levels_of(run))
        if before is not None:
            peak = torch.cuda.max_memory_allocated(device)
            timer.result.peak_bytes, timer.result.act_bytes = peak, peak - before
        raise _OneCall

    patcher.add_wrapper_with_key(WrappersMP.APPLY_MODEL, WRAPPER_KEY, wrapper)
    return timer


@contextlib.contextmanager
def timed_plans(watch: Stopwatch) -> Iterator[list[tuple[Any, Any]]]:
    """Every ToMA plan build while inside, bracketed by marks of `watch`: yields the list of
    (start, end) pairs it fills. It wraps the build function the pack's patches hand to
    ModelCall.plan (the one place a plan is built), and puts ModelCall.plan back after."""
    call_type = load_pack().nodes.model_call.ModelCall
    original = call_type.__dict__["plan"]
    pairs: list[tuple[Any, Any]] = []

    def plan(call, key, build):
        def timed_build():
            start = watch.mark()
            try:
                return build()
            finally:
                pairs.append((start, watch.mark()))

        return original(call, key, timed_build)

    call_type.plan = plan
    try:
        yield pairs
    finally:
        call_type.plan = original


# Models -----------------------------------------------------------------------------------------
def fill_on_device(module: torch.nn.Module, seed: int = 0, gain: float = 1.0) -> torch.nn.Module:
    """bench.shared.weights.fill_weights' distribution (biases 0, other vectors 1, matrices and
    kernels
    normal with std gain / sqrt(fan_in)), drawn where each parameter lives, in its own dtype, by
    a generator on that device: no host tensor, no copy. The values differ from fill_weights'
    (another generator); the distribution is the same."""
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, param in module.named_parameters():
            if param.ndim <= 1:
                param.fill_(0.0 if name.endswith("bias") else 1.0)
                continue
            g = generators.get(param.device)
            if g is None:
                g = generators[param.device] = torch.Generator(param.device).manual_seed(seed)
            param.normal_(0.0, gain / math.prod(param.shape[1:]) ** 0.5, generator=g)
    return module


@dataclass
class Built:
    """A model in a ModelPatcher, and how long its construction and weight fill took."""

    patcher: Any
    build_s: float
    fill_s: float
    params: int


def build(spec: gpu_model.ModelSpec, device: torch.device,
          unet_config: dict[str, Any] | None = None, seed: int = 0) -> Built:
    """`spec`'s model in bf16, constructed directly on `device` (ComfyUI's operations allocate
    without initialising: nothing is written until the fill) and filled there; a ModelPatcher
    with load and offload device `device`, so ComfyUI never moves the weights."""
    import comfy.model_patcher

    start = time.perf_counter()
    config = gpu_model.comfy_config(spec, unet_config)
    config.set_inference_dtype(DTYPE, None)
    model = config.get_model({}, device=device)
    model.diffusion_model.eval()
    built = time.perf_counter()
    fill_on_device(model.diffusion_model, seed)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    filled = time.perf_counter()
    params = sum(p.numel() for p in model.diffusion_model.parameters())
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=device, offload_device=device)
    return Built(patcher, built - start, filled - built, params)


COMPILE_BACKEND = "inductor"   # TorchCompileModel's default (tests trace with "eager")


def restated_guard_filter(guard_entries):
    """TorchCompileModel's guard filter as v0.8.0 and v0.33.0 write it (comfy_extras/
    nodes_torch_compile.py skip_torch_compile_dict): no guards on transformer_options entries.
    Used where that module does not import (it imports comfy_api.latest, which needs PyAV)."""
    return [("transformer_options" not in entry.name) for entry in guard_entries]


def compiled(patcher):
    """`patcher` as ComfyUI's TorchCompileModel node returns it (COMPILE_BACKEND): a clone
    (with disable_dynamic where this ComfyUI's clone has it, as the v0.33 node asks) with
    set_torch_compile_wrapper and the node's guard filter where its version has one."""
    import inspect

    from comfy_api.torch_helpers import set_torch_compile_wrapper

    try:
        import comfy_extras.nodes_torch_compile as node
        guard_filter = getattr(node, "skip_torch_compile_dict", None)
    except ImportError:
        log.info("comfy_extras.nodes_torch_compile does not import: its guard filter restated")
        guard_filter = restated_guard_filter
    dynamic = "disable_dynamic" in inspect.signature(patcher.clone).parameters
    clone = patcher.clone(disable_dynamic=True) if dynamic else patcher.clone()
    set_torch_compile_wrapper(model=clone, backend=COMPILE_BACKEND,
                              options={"guard_filter_fn": guard_filter} if guard_filter else None)
    return clone


# One case ----------------------------------------------------------------------------------------
@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise CaseTimeout in the main thread after `seconds` (SIGALRM; where there is no alarm,
    e.g. off the main thread, only the soft checks between repetitions apply)."""
    try:
        previous = signal.signal(signal.SIGALRM, _alarm)
    except (ValueError, AttributeError):
        yield
        return
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _alarm(signum, frame):
    raise CaseTimeout


@dataclass
class Sizes:
    """What a case samples: latent and text sizes, and options added to every ToMA setting
    (reduced CPU sizes only)."""

    unet_config: dict[str, Any] | None = None
    latent: tuple[int, ...] | None = None
    text: tuple[int, ...] | None = None
    options: dict[str, Any] = field(default_factory=dict)
    label: str | None = None       # the rows' model name, where it is not the spec's

    @property
    def reduced(self) -> bool:
        return self.latent is not None


# Wan on the GPU: 33 frames (9 latent frames, 14040 tokens) instead of the projection's 81, so
# that the first command's budget holds its repetitions: its call runs about 1 s, not 4.5.
WAN_GPU_LATENT = (1, 16, 9, 60, 104)


def sizes_for(name: str, device: torch.device) -> Sizes:
    """Real sizes on a GPU (Wan at WAN_GPU_LATENT's frames); gpu-model's SMALL configurations
    on a CPU."""
    if device.type == "cuda":
        if name == "wan":
            return Sizes(latent=WAN_GPU_LATENT, label="Wan 2.1 14B t2v 832x480x33")
        return Sizes()
    unet_config, latent, text, options = gpu_model.SMALL[name]
    return Sizes(unet_config, latent, text, dict(options))


def one_call(patcher, timer: Timer, spec: gpu_model.ModelSpec, sizes: Sizes,
             peak: bool = False) -> CallTime:
    """Sample with `patcher` until its model call spec.call, which the timer times."""
    import comfy.sample

    noise = gpu_model._randn(*(sizes.latent or spec.latent), seed=0)
    positive, negative = gpu_model.conditioning(spec, 0, sizes.text)
    timer.armed, timer.peak, timer.result, timer.skip = True, peak, None, spec.call
    try:
        with torch.inference_mode():
            comfy.sample.sample(patcher, noise, STEPS, spec.cfg, "euler", "normal", positive,
                                negative, torch.zeros_like(noise), disable_pbar=True, seed=0)
    except _OneCall:
        pass
    finally:
        timer.armed = False
    if timer.result is None:
        raise RuntimeError(f"{spec.label}: sampling ended without a model call")
    return timer.result


def levels_of(run: Any) -> str:
    """The token counts a ToMA run merged, per level or block group ("4096->2048")."""
    if run is None or not run.levels:
        return ""
    return ", ".join(f"{n}->{m}" for n, m in dict.fromkeys(run.levels.values()))


@dataclass
class Collected:
    """What a case measured so far (kept when its time limit cuts it short)."""

    first: dict[str, CallTime] = field(default_factory=dict)    # first warm-up call
    peaks: dict[str, CallTime] = field(default_factory=dict)    # last warm-up call (memory)
    times: dict[str, list[float]] = field(default_factory=dict)
    walls: dict[str, list[float]] = field(default_factory=dict)
    hosts: dict[str, list[float]] = field(default_factory=dict)
    plan: dict[str, tuple[float, float]] = field(default_factory=dict)   # (plan ms, call ms)
    graphs: dict[str, tuple[int, int]] = field(default_factory=dict)  # compiled: graphs, breaks
    status: str = "complete"


def collect(variants: dict[str, Any], timer: Timer, spec: gpu_model.ModelSpec, sizes: Sizes,
            warmup: int, reps: int, deadline: float, into: Collected,
            compiled_run: bool = False) -> None:
    """Warm-up rounds over the variants (the last one measuring memory), then `reps` interleaved
    rounds (fewer when the next would pass `deadline`, never fewer than MIN_REPS while time
    lasts), then one call per ToMA variant with its plan builds timed.

    compiled_run: the variants are compiled (`compiled`), each on its own after dynamo's caches
    are emptied: TorchCompileModel's guard filter drops the guards on transformer_options,
    where ToMA's patches and per-call state live, so a graph compiled for one variant would
    serve the other (the same diffusion model's forward, its weights graph inputs). The first
    warm-up call compiles; no plan timing (inside the graph)."""
    groups = [[name] for name in variants] if compiled_run else [list(variants)]
    for group in groups:
        if compiled_run:
            import torch._dynamo
            from torch._dynamo.utils import counters

            torch._dynamo.reset()
            counters.clear()
        for i in range(warmup):           # warm-up rounds, interleaved as the timed ones
            for name in group:
                result = one_call(variants[name], timer, spec, sizes, peak=i == warmup - 1)
                into.first.setdefault(name, result)
                into.peaks[name] = result
        for name in group:
            into.times[name], into.walls[name], into.hosts[name] = [], [], []
        round_s = 0.0
        for rep in range(reps):
            if rep >= MIN_REPS and time.perf_counter() + 1.5 * round_s > deadline:
                into.status = f"stopped after {rep} of {reps} repetitions (time limit)"
                break
            started = time.perf_counter()
            for name in group if rep % 2 == 0 else list(reversed(group)):
                result = one_call(variants[name], timer, spec, sizes)
                into.times[name].append(result.ms)
                into.walls[name].append(result.wall_ms)
                into.hosts[name].append(result.host_ms)
            round_s = time.perf_counter() - started
        if compiled_run:
            into.graphs[group[0]] = (int(counters["stats"]["unique_graphs"]),
                                     sum(counters["graph_break"].values()))
    if not compiled_run:
        for name in list(variants)[1:]:
            with timed_plans(timer.watch) as pairs:
                result = one_call(variants[name], timer, spec, sizes)
            into.plan[name] = (sum(timer.watch.elapsed_ms(a, b) for a, b in pairs), result.ms)


def measure(case: Case, device: torch.device, limit_s: float,
            quick: bool = False) -> dict[str, Any]:
    """One case within `limit_s` (its model built, measured and released): {"rows", "notes"},
    a row per ToMA setting with the unmerged call's figures on each (a compiled case: the
    default setting only)."""
    spec = gpu_model.MODELS[case.model]
    if not gpu_model.present(spec):
        return {"rows": [], "notes": [f"{spec.label}: not in ComfyUI "
                                      f"{gpu_model.comfy_version()} (not run)"]}
    sizes = sizes_for(case.model, device)
    cuda = device.type == "cuda"
    warmup = case.warmup if cuda else CPU_WARMUP
    reps = (max(MIN_REPS, case.reps // 2) if quick else case.reps) if cuda else CPU_REPS
    deadline = time.perf_counter() + limit_s
    label = sizes.label or spec.label + (" (reduced)" if sizes.reduced else "")
    what = label + (" compiled" if case.compiled else "")
    settings = [s for m, s in gpu_model.SETTINGS if m == case.model
                and (s.name == "default" or not case.compiled)]
    got = Collected()
    notes: list[str] = []
    built = None
    try:
        with time_limit(limit_s):
            built = build(spec, device, sizes.unet_config)
            notes.append(f"{label}: {built.params / 1e9:.3g} B parameters, built in "
                         f"{built.build_s:.2f} s, filled in {built.fill_s:.2f} s on "
                         f"{device.type}")
            timer = install_timer(built.patcher, device)
            variants: dict[str, Any] = {"unmerged": built.patcher}
            for s in settings:
                setting = gpu_model.Setting(s.name, {**s.options, **sizes.options})
                variants[s.name] = gpu_model.toma(built.patcher, setting)
            if case.compiled:
                variants = {name: compiled(p) for name, p in variants.items()}
            collect(variants, timer, spec, sizes, warmup, reps, deadline, got, case.compiled)
            # a partial load (ComfyUI's low-VRAM mode) would stream weights during the call
            notes.append(f"{what}: ComfyUI had {built.patcher.loaded_size() / 2**30:.2f} of "
                         f"{built.patcher.model_size() / 2**30:.2f} GiB of weights loaded")
    except CaseTimeout:
        got.status = f"cut at its time limit ({limit_s:.0f} s)"
    finally:
        variants = {}
        if built is not None:
            release(built)
    rows = [case_row(label, case, s, got) for s in settings if "unmerged" in got.first]
    if case.compiled:
        notes += [f"{what}: {name} first call {got.first[name].wall_ms / 1e3:.1f} s (inductor's "
                  "compile included)" for name in got.first]
    if got.status != "complete":
        notes.append(f"{what}: {got.status}")
    return {"rows": rows, "notes": notes}


def case_row(label: str, case: Case, s: gpu_model.Setting, got: Collected) -> dict[str, Any]:
    """The row of one ToMA setting: the unmerged and ToMA figures side by side (COLUMNS, and
    the raw repetitions for the JSON)."""
    unmerged = got.times.get("unmerged", [])
    merged = got.times.get(s.name, [])
    n = min(len(unmerged), len(merged))
    peak = got.peaks.get(s.name)
    row: dict[str, Any] = {
        "model": label, "setting": s.name + (", compiled" if case.compiled else ""),
        "ratio": s.ratio, "scope": s.scope, "batch": got.first["unmerged"].batch,
        "tokens": peak.levels if peak else "", "reps": n, "status": got.status,
    }
    if n:
        a, b = Timing(tuple(unmerged[:n])), Timing(tuple(merged[:n]))
        row.update({"ms": a.median, "ms_min": a.min, "ms_toma": b.median, "ms_toma_min": b.min,
                    **speedup(a, b), "spread": a.spread, "spread_toma": b.spread,
                    "wall_ms": statistics.median(got.walls["unmerged"][:n]),
                    "wall_ms_toma": statistics.median(got.walls[s.name][:n]),
                    "host_ms": statistics.median(got.hosts["unmerged"][:n]),
                    "host_ms_toma": statistics.median(got.hosts[s.name][:n]),
                    "bound": bound(statistics.median(got.hosts[s.name][:n]), b.median),
                    "runs_ms": [round(t, 3) for t in unmerged[:n]],
                    "runs_ms_toma": [round(t, 3) for t in merged[:n]]})
    if n < MIN_REPS:
        row["flag"] = f"{n} repetition(s), fewer than {MIN_REPS}: no figure ({got.status})"
    if s.name in got.plan:
        plan_ms, call_ms = got.plan[s.name]
        row["plan_ms"], row["plan_share"] = plan_ms, plan_ms / call_ms
    for key, name in (("", "unmerged"), ("_toma", s.name)):
        found = got.peaks.get(name)
        if found is not None and found.peak_bytes is not None:
            row[f"peak_gib{key}"] = found.peak_bytes / 2**30
            row[f"act_gib{key}"] = found.act_bytes / 2**30
    if case.compiled:
        for key, name in (("", "unmerged"), ("_toma", s.name)):
            if name in got.first:
                row[f"first_call_s{key}"] = got.first[name].wall_ms / 1e3
            if name in got.graphs:
                row[f"graphs{key}"], row[f"graph_breaks{key}"] = got.graphs[name]
    return row


# The host issued the call in at least this share of the GPU's time for it: the GPU waited.
HOST_BOUND = 0.9


def bound(host_ms: float, gpu_ms: float) -> str:
    """"host" where issuing a call took nearly as long as the GPU's work on it (the GPU waited
    for the host: fewer FLOPs would not make it faster), else "GPU"."""
    return "host" if host_ms >= HOST_BOUND * gpu_ms else "GPU"


def release(built: Built) -> None:
    """Drop a case's model from ComfyUI's loaded models and free its memory."""
    import comfy.model_management as mm

    built.patcher = None
    mm.unload_all_models()
    gc.collect()
    mm.soft_empty_cache()


# The section -------------------------------------------------------------------------------------
def selected_cases() -> tuple[Case, ...]:
    """CASES, or only the eager or only the compiled ones ($TOMA_GPU_CALL_CASES "eager" or
    "compiled": bench/gpu/run.sh's first command and its second)."""
    which = os.environ.get("TOMA_GPU_CALL_CASES", "all")
    if which not in ("all", "eager", "compiled"):
        raise ValueError(f"TOMA_GPU_CALL_CASES must be all, eager or compiled; got {which!r}")
    return tuple(c for c in CASES if which == "all" or c.compiled == (which == "compiled"))


def budget_s() -> float:
    """The section's time budget: $TOMA_GPU_CALL_BUDGET_S, else BUDGET_S."""
    value = os.environ.get("TOMA_GPU_CALL_BUDGET_S")
    return float(value) if value else BUDGET_S


def write_partial(result: dict[str, Any]) -> None:
    """The rows so far to $TOMA_GPU_CALL_PARTIAL, when set."""
    path = os.environ.get("TOMA_GPU_CALL_PARTIAL")
    if path:
        Path(path).write_text(json.dumps(result, indent=1, default=str))


def run(cfg: BenchConfig, cases: tuple[Case, ...] | None = None,
        budget: float | None = None) -> dict[str, Any]:
    """The section: every case (default: selected_cases()) that fits the budget, in order (see
    the module docstring)."""
    cfg.apply_threads()
    load_pack()
    cases = selected_cases() if cases is None else cases
    started = time.perf_counter()
    budget = budget_s() if budget is None else budget
    rows: list[dict[str, Any]] = []
    notes = [f"{'CUDA events' if cfg.device.type == 'cuda' else 'host perf_counter'}, bf16, "
             f"ComfyUI {gpu_model.comfy_version()}'s own classes, random weights; one model "
             f"call per repetition (a {STEPS}-step Euler run stopped after its first call); "
             "median of interleaved repetitions after warm-up; speedup_lo/hi: range of the "
             "side-by-side ratios; plan_share: ToMA's plan builds over the same call's time "
             "(events); peak_gib: max_memory_allocated over one call, weights included; act_gib: "
             "the same above what was allocated before the call; compiled rows: each variant on "
             "its own after torch._dynamo.reset() (not interleaved: TorchCompileModel's guard "
             "filter lets one variant's graph serve the other), first_call_s: its first call's "
             "host time, inductor's compile included, graphs: dynamo's unique graphs over its "
             "calls (graph breaks in the JSON)"]
    if cfg.device.type != "cuda":
        notes.append("reduced sizes (not a GPU measurement): gpu-model's SMALL configurations "
                     "(SDXL model_channels 32 at a 32x32 latent, unet_levels all; Flux hidden 64,"
                     " 2+2 blocks, 32x32 latent; Wan dim 64, 2 blocks, 5x16x20 latent; HiDream-O1 "
                     "width 64, 2 layers, 128x160 pixels; skip_blocks none), 8 text tokens")
    timings = []
    for case in cases:
        left = budget - (time.perf_counter() - started) - MARGIN_S
        name = f"{case.model}{' compiled' if case.compiled else ''}"
        if left < case.min_s:
            notes.append(f"{name}: not run ({left:.0f} s of the budget left, {case.min_s:.0f} s "
                         "needed)")
            continue
        limit = min(case.limit_s, left)
        log.warning("gpu-call: %s (limit %.0f s)", name, limit)
        start = time.perf_counter()
        try:
            part = measure(case, cfg.device, limit, cfg.quick)
        except Exception as exc:  # one broken case must not lose the others' rows
            log.exception("gpu-call: %s failed", name)
            part = {"rows": [], "notes": [f"{name}: failed: {type(exc).__name__}: {exc}"]}
        rows += part["rows"]
        notes += part["notes"]
        timings.append(f"{name} {time.perf_counter() - start:.0f} s")
        write_partial({"rows": rows, "columns": list(COLUMNS), "notes": notes})
        if cfg.device.type == "cuda":
            torch.cuda.empty_cache()
    notes.append("wall time per case: " + ", ".join(timings))
    if cfg.device.type == "cuda":
        # the pack builds plans with its Triton kernel on CUDA and falls back to PyTorch ops,
        # for the rest of the process, when the kernel cannot be built (toma_core/triton_plan.py)
        disabled = load_pack().toma_core.triton_plan._disabled
        notes.append("the pack's Triton plan kernel: " + (f"disabled ({disabled[0]})" if disabled
                                                          else "not disabled"))
    return {"rows": rows, "columns": list(COLUMNS), "notes": notes}
