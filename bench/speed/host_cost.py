"""What ToMA asks of the host per steady model call: kernel launches, Python function calls and
CPU time, unmerged against ToMA, side by side.

    COMFYUI_PATH=/path/to/ComfyUI python -m bench --sections host

On a fast GPU the host issues every kernel and runs every block patch's Python; where that
takes longer than the GPU's work, the saved FLOPs are lost. Here every merged block is active
and the tensors are small (the call is mostly host work): ComfyUI's SDXL UNet with its 70
transformer blocks (unet_levels "all" on a 32x32 latent: the 16x16 and 8x8 levels) at 32
channels, and Flux with Flux.1's 19 + 38 blocks at the node defaults (16x16 image tokens) 64
wide, both built by bench/speed/whole_call.py. A steady call is one after the first of a
sampling run (the first builds the run's index tables); with recompute_every 1 it builds its
plans. Counts come from bench/shared/host_counts.py; times are the process's CPU time of the
model calls (APPLY_MODEL), the runs of both variants interleaved.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from ..shared.common import MIN_REPS, Timing, goal, speedup
from ..shared.config import BenchConfig
from ..shared.host_counts import PerCall
from . import whole_call

log = logging.getLogger(__name__)

COLUMNS = ("model", "variant", "launches", "launches_extra", "python_calls", "python_extra",
           "python_per_block", "ms", "ms_min", "spread", "reps", "speedup", "speedup_lo",
           "speedup_hi")
LATENT = 32
STEPS = 3
# model -> (patcher, ToMA's options besides the defaults, transformer blocks)
MODELS: dict[str, tuple[Callable, dict, int]] = {
    "sdxl": (lambda: whole_call.sdxl_patcher(channels=32, head_channels=16),
             {"unet_levels": "all"}, 70),
    "flux": (lambda: whole_call.flux_patcher(hidden=64, heads=4, axes=(4, 6, 6)), {}, 19 + 38),
}
# The budgets: ToMA's extra share per steady call (launches, Python calls).
BUDGETS = {"sdxl": (0.10, 0.15), "flux": (0.15, 0.20)}


class CallTimes:
    """CPU seconds of each model call of a ModelPatcher (APPLY_MODEL wrapper)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    def install(self, patcher) -> None:
        from comfy.patcher_extension import WrappersMP

        def timed(executor, *args, **kwargs):
            start = time.process_time()
            try:
                return executor(*args, **kwargs)
            finally:
                self.seconds.append(time.process_time() - start)

        patcher.add_wrapper_with_key(WrappersMP.APPLY_MODEL, "host_cost_times", timed)


def _sampler(patcher, name: str) -> Callable[[], torch.Tensor]:
    """STEPS euler steps at LATENT (SDXL with CFG 2: cond and uncond in one call)."""
    import comfy.sample

    latent, positive, negative, cfg = whole_call._inputs(name)
    latent = latent[..., :LATENT, :LATENT]
    noise = comfy.sample.prepare_noise(latent, 0)

    def run() -> torch.Tensor:
        return comfy.sample.sample(patcher, noise, STEPS, cfg, "euler", "normal", positive,
                                   negative, latent, disable_pbar=True, seed=0)

    return run


def _variant(name: str, toma: bool, counter) -> Callable[[], torch.Tensor]:
    """A fresh model of `name` with `counter` outermost and (toma) ToMA inside."""
    from toma_pack.nodes.apply import apply_toma
    from toma_pack.nodes.options import make_options

    build, options, _ = MODELS[name]
    patcher = build()
    counter.install(patcher)
    if toma:
        patcher = apply_toma(patcher, make_options(**options))
    return _sampler(patcher, name)


def _steady(counts: list) -> Any:
    """The counts of a run's steady calls (all after the first) must agree: that count."""
    steady = set(counts[1:])
    if len(steady) != 1:
        raise RuntimeError(f"steady calls differ: {counts}")
    return steady.pop()


def _counts(name: str, kind: str) -> dict[str, int]:
    """Per variant, the steady calls' count of `kind` ("launches" or "python")."""
    out = {}
    for label, toma in (("unmerged", False), ("ToMA", True)):
        counter = PerCall(kind)
        with torch.no_grad():
            _variant(name, toma, counter)()
        out[label] = _steady(counter.counts)
    return out


def _times(name: str, reps: int) -> dict[str, Timing]:
    """Per variant, its steady calls' mean CPU seconds in each of `reps` interleaved runs."""
    timers = {"unmerged": CallTimes(), "ToMA": CallTimes()}
    runs = {label: _variant(name, label == "ToMA", timer) for label, timer in timers.items()}
    per_rep: dict[str, list[float]] = {label: [] for label in runs}
    with torch.no_grad():
        for label in runs:                    # warm-up run each
            runs[label]()
        for rep in range(reps):
            for label in runs if rep % 2 == 0 else reversed(list(runs)):
                timers[label].seconds.clear()
                runs[label]()
                per_rep[label].append(statistics.mean(timers[label].seconds[1:]))
    return {label: Timing(tuple(times)) for label, times in per_rep.items()}


def rows_of(name: str, reps: int) -> list[dict[str, Any]]:
    """The unmerged and ToMA rows of one model."""
    launches, python = _counts(name, "launches"), _counts(name, "python")
    times = _times(name, reps)
    blocks = MODELS[name][2]
    rows = []
    for label in ("unmerged", "ToMA"):
        row = {"model": name, "variant": label, "launches": launches[label],
               "python_calls": python[label], **times[label].fields()}
        if label == "ToMA":
            extra = python[label] - python["unmerged"]
            row.update({
                "launches_extra": (launches[label] - launches["unmerged"]) / launches["unmerged"],
                "python_extra": extra / python["unmerged"],
                "python_per_block": extra / blocks,
                **speedup(times["unmerged"], times[label])})
        rows.append(row)
    return rows


def targets(rows: list[dict]) -> list[dict[str, Any]]:
    """The budgets checked: ToMA's extra launches and Python calls as shares of unmerged's."""
    out = []
    for name, (launch_budget, python_budget) in BUDGETS.items():
        row = next((r for r in rows if r["model"] == name and r["variant"] == "ToMA"), None)
        out.append(goal(f"{name} extra launches <= {launch_budget:.0%}", row, "launches_extra",
                        launch_budget, higher=False))
        out.append(goal(f"{name} extra Python calls <= {python_budget:.0%}", row,
                        "python_extra", python_budget, higher=False))
    return [t for t in out if t is not None]


def run(cfg: BenchConfig) -> dict[str, Any]:
    cfg.apply_threads()
    reps = max(MIN_REPS, 5 if cfg.quick else 9)
    rows, notes = [], []
    for name in MODELS:
        try:
            rows += rows_of(name, reps)
        except Exception as exc:  # one model failing must not take the other's rows with it
            log.exception("host %s failed", name)
            notes.append(f"{name} failed: {type(exc).__name__}: {exc}")
    notes.append(f"per steady model call (after a run's first; plans built in each), {STEPS} "
                 f"euler steps at a {LATENT}x{LATENT} latent, {reps} interleaved runs per "
                 f"variant after one warm-up; ms: CPU time of the steady model calls")
    notes.append("launches: aten ops that run a kernel (views, allocation and aliasing left "
                 "out); python_calls: the interpreter's call events; *_extra: ToMA's extra as "
                 "a share of unmerged's; python_per_block: ToMA's extra Python calls per "
                 "transformer block call (SDXL 70, Flux 57)")
    notes.append("SDXL: unet_levels all (every block merged), model_channels 32 (heads of 16), "
                 "CFG 2 batched; Flux: node defaults (d0-4 and s0-4 unmerged), hidden 64 (4 "
                 "heads), 512 text tokens, cfg 1")
    return {"rows": rows, "columns": list(COLUMNS), "notes": notes, "targets": targets(rows)}
