"""Section gpu-runs (ComfyUI only): whole 20-step sampling runs of SDXL 1024x1024 on the GPU,
unmerged, ToMA (node defaults), ComfyUI's EasyCache (its defaults) and both (ToMA before the
cache, as the *SDXL with EasyCache* example chains them), side by side.

    COMFYUI_PATH=/path/to/ComfyUI python -m bench --sections gpu-runs --device cuda

A model call (section gpu-call) says what merging saves per call; a whole run also holds the
sampler's own work and the steps a cache skips, so it says what a user waits for. The model is
gpu-call's (bench/gpu/measured_calls.py: ComfyUI's SDXL at its real configuration in bf16,
random weights filled on the device); every run is comfy.sample.sample with Euler over 20 steps
at CFG 7 (cond and uncond in one call), timed from the device's sync before it to the sync
after it. One warm-up run per variant, then interleaved repetitions until the budget
($TOMA_GPU_RUNS_BUDGET_S, else BUDGET_S) would be passed, at least MIN_REPS.

On a CPU (the rehearsal) the same runs use gpu-model's SMALL SDXL (toy width, 32x32 latent,
unet_levels "all"): they show the section runs, not what a GPU gives. With random weights
EasyCache may skip other steps than with a real checkpoint; the quality section measures the
cache's skips on trained fixtures.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from ..quality.baselines import easycache
from ..shared.common import MIN_REPS, Timing, speedup
from ..shared.config import BenchConfig, load_pack
from . import measured_calls as gpu_call
from . import projected_calls as gpu_model

log = logging.getLogger(__name__)

STEPS = 20
EASYCACHE_THRESHOLD = 0.2      # the EasyCache node's default reuse_threshold
BUDGET_S = 45.0
COLUMNS = ("model", "variant", "steps", "ms", "ms_min", "spread", "reps", "speedup",
           "speedup_lo", "speedup_hi")


def budget_s() -> float:
    """The section's time budget: $TOMA_GPU_RUNS_BUDGET_S, else BUDGET_S."""
    value = os.environ.get("TOMA_GPU_RUNS_BUDGET_S")
    return float(value) if value else BUDGET_S


def variants(patcher, options: dict[str, Any]) -> dict[str, Any]:
    """The four ModelPatchers: unmerged, ToMA, EasyCache, ToMA then EasyCache (the last two
    missing where this ComfyUI has no EasyCache)."""
    pack = load_pack()
    toma = pack.nodes.apply.apply_toma(patcher, pack.nodes.options.make_options(**options))
    out = {"unmerged": patcher, "ToMA": toma}
    cached = easycache(patcher, EASYCACHE_THRESHOLD)
    if cached is not None:
        out["EasyCache"] = cached
        out["ToMA + EasyCache"] = easycache(toma, EASYCACHE_THRESHOLD)
    return out


def sampler(patcher, spec: gpu_model.ModelSpec, sizes: gpu_call.Sizes,
            device: torch.device) -> Callable[[], float]:
    """One whole run of `patcher` as a function returning its seconds (synced on a GPU)."""
    import comfy.sample

    noise = gpu_model._randn(*(sizes.latent or spec.latent), seed=0)
    positive, negative = gpu_model.conditioning(spec, 0, sizes.text)

    def run() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        with torch.inference_mode():
            comfy.sample.sample(patcher, noise, STEPS, spec.cfg, "euler", "normal", positive,
                                negative, torch.zeros_like(noise), disable_pbar=True, seed=0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    return run


def run(cfg: BenchConfig) -> dict[str, Any]:
    cfg.apply_threads()
    load_pack()
    started = time.perf_counter()
    deadline = started + budget_s()
    device = cfg.device
    spec = gpu_model.MODELS["sdxl"]
    sizes = gpu_call.sizes_for("sdxl", device)
    built = gpu_call.build(spec, device, sizes.unet_config)
    notes = [f"{spec.label}{' (reduced: not a GPU figure)' if sizes.reduced else ''}, bf16, "
             f"random weights; {STEPS} Euler steps at CFG {spec.cfg:g}, one warm-up run per "
             f"variant, then interleaved runs; EasyCache at reuse_threshold "
             f"{EASYCACHE_THRESHOLD} (start 0.15, end 0.95: the node's defaults), after ToMA "
             "in the chained variant"]
    try:
        runs = {name: sampler(p, spec, sizes, device)
                for name, p in variants(built.patcher, sizes.options).items()}
        if "EasyCache" not in runs:
            notes.append("this ComfyUI has no EasyCache: its rows are left out")
        for fn in runs.values():
            fn()
        times: dict[str, list[float]] = {name: [] for name in runs}
        round_s = 0.0
        for rep in range(100):
            if rep >= MIN_REPS and time.perf_counter() + 1.5 * round_s > deadline:
                break
            began = time.perf_counter()
            for name in runs if rep % 2 == 0 else list(reversed(runs)):
                times[name].append(runs[name]())
            round_s = time.perf_counter() - began
    finally:
        gpu_call.release(built)
    timings = {name: Timing(tuple(t)) for name, t in times.items()}
    rows = []
    for name, timing in timings.items():
        row = {"model": spec.label, "variant": name, "steps": STEPS, **timing.fields()}
        if name != "unmerged":
            row.update(speedup(timings["unmerged"], timing))
        rows.append(row)
    notes.append(f"section time {time.perf_counter() - started:.0f} s of {budget_s():.0f}")
    return {"rows": rows, "columns": list(COLUMNS), "notes": notes}
