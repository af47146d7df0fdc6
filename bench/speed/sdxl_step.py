"""Whole SDXL UNet (ComfyUI only): one denoising step at 1024x1024, with and without ToMA.

Builds ComfyUI's own SDXL model (comfy.supported_models.SDXL with the real SDXL unet_config:
2.6 B parameters, 70 transformer blocks) with seeded random weights (bench.shared.weights), wraps
it in
a ModelPatcher and samples one Euler step (comfy.sample.sample, cfg 1.0: one UNet forward on
latent [1, 4, 128, 128], context [1, 77, 2048]) for:

- unpatched: the model as loaded;
- toma: the pack's ToMA node with its defaults (toma_node.patch_model(...)): what a
  workflow gets; its one-step run builds a plan per level, which a real run would reuse for
  recompute_every steps, so planning is over-counted here (planning_s says how much);
- lower bound: every transformer block the node merged runs on the merged token count the node
  reported for its level (its RunState), with no merging cost (its output is thrown away), the
  rest of the UNet unchanged.

The node's RunState (levels merged, plan build time) is read through a ComfyUI APPLY_MODEL
wrapper of our own, which sees the transformer_options the node's wrappers put it in.
Interleaved over repetitions (3 by default), after a warm-up at 256x256 and one 1024x1024 ToMA
step that records the levels. fp32 weights need ~11 GB of memory: the section is skipped, with a
note, when less is available.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..shared.common import MIN_REPS, Timing, speedup, versus_lower_bound
from ..shared.config import BenchConfig, load_pack
from ..shared.model_configs import SDXL_UNET
from ..shared.weights import fill_weights

log = logging.getLogger(__name__)

NEEDED_GB = 13.0
COLUMNS = ("variant", "image", "s", "s_min", "spread", "runs_s", "speedup", "speedup_lo",
           "speedup_hi", "vs_lb", "planning_s", "peak_gb", "flag")


def available_gb() -> float | None:
    """MemAvailable from /proc/meminfo in GiB (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        return None
    return None


def build_patcher(cfg: BenchConfig):
    """SDXL with random weights in a ModelPatcher on cfg.device."""
    import comfy.model_patcher
    import comfy.supported_models

    sdxl = comfy.supported_models.SDXL(dict(SDXL_UNET))
    sdxl.set_inference_dtype(cfg.dtype, None)
    model = sdxl.get_model({}, device=cfg.device)
    fill_weights(model.diffusion_model, cfg.seed).eval()
    model.diffusion_model.to(cfg.device, cfg.dtype)
    return comfy.model_patcher.ModelPatcher(model, load_device=cfg.device,
                                            offload_device=torch.device("cpu"))


def lower_bound(patcher, levels: dict[str, tuple[int, int]]):
    """A clone whose transformer blocks at the merged levels run on the merged token count,
    free of merging cost. levels: {"HxW": (tokens, merged tokens)} as the node's RunState has
    them."""
    load_pack()
    from toma_pack.nodes.unet_patch import transformer_blocks

    clone = patcher.clone()
    for name, block in transformer_blocks(clone.get_model_object("diffusion_model")):
        original = types.MethodType(type(block).forward, block)

        def forward(x, *args, _original=original, **kwargs):
            options = kwargs.get("transformer_options") or {}
            h, w = options["activations_shape"][-2:]
            merged = levels.get(f"{h}x{w}")
            if merged is None:
                return _original(x, *args, **kwargs)
            _original(x[:, :merged[1]], *args, **kwargs)
            return x

        clone.add_object_patch(f"diffusion_model.{name}.forward", forward)
    return clone


class RunRecorder:
    """The ToMA node's RunStates of the runs a patcher samples, read from the transformer_options
    of each model call by an APPLY_MODEL wrapper (ComfyUI's wrapper API; the node puts its
    RunState there for its own blocks)."""

    KEY = "bench_run_recorder"

    def __init__(self) -> None:
        self.runs: list[Any] = []

    def install(self, patcher) -> None:
        """Add the wrapper to `patcher` (a plain function: ComfyUI may deep-copy wrappers when
        it clones model options, which would copy a bound method's recorder)."""
        from comfy.patcher_extension import WrappersMP

        from toma_pack.nodes.arguments import call_arguments
        from toma_pack.nodes.run_state import RunState

        runs = self.runs

        def wrapper(executor: Callable, *args, **kwargs):
            options = call_arguments(executor, args, kwargs).get("transformer_options") or {}
            for value in options.values():
                if isinstance(value, RunState) and all(value is not r for r in runs):
                    runs.append(value)
            return executor(*args, **kwargs)

        patcher.add_wrapper_with_key(WrappersMP.APPLY_MODEL, self.KEY, wrapper)


def toma_node(patcher):
    """The ToMA node's output with its defaults, and a recorder of its runs."""
    toma_node = load_pack().nodes.toma_node
    patched = toma_node.patch_model(patcher, **toma_node.TOMA.defaults())
    recorder = RunRecorder()
    recorder.install(patched)
    return patched, recorder


def sampler(patcher, size: int, cfg: BenchConfig) -> Callable[[], torch.Tensor]:
    """One Euler step at size x size pixels, batch 1, cfg 1.0 (a single UNet forward)."""
    import comfy.sample

    g = torch.Generator().manual_seed(cfg.seed)
    side = size // 8
    noise = torch.randn(1, 4, side, side, generator=g)
    latent = torch.zeros_like(noise)
    context = torch.randn(1, 77, 2048, generator=g)
    pooled = torch.randn(1, 1280, generator=g)
    positive = [[context, {"pooled_output": pooled, "width": size, "height": size}]]
    negative = [[torch.zeros_like(context), {"pooled_output": torch.zeros_like(pooled),
                                             "width": size, "height": size}]]

    def call() -> torch.Tensor:
        return comfy.sample.sample(patcher, noise, 1, 1.0, "euler", "normal", positive,
                                   negative, latent, disable_pbar=True, seed=cfg.seed)

    return call


def run(cfg: BenchConfig, reps: int | None = None, size: int = 1024) -> dict[str, Any]:
    """Rows per variant: median, minimum and spread of one size x size step (1024: SDXL's
    native size), speedup with its range, ratio to the lower bound (flagged when below 1)."""
    free = available_gb()
    if free is not None and free < NEEDED_GB:
        return {"rows": [], "notes": [f"skipped: {free:.1f} GiB memory available, about "
                                      f"{NEEDED_GB:.0f} needed for fp32 SDXL"]}
    cfg.apply_threads()
    reps = reps or (MIN_REPS if cfg.device.type == "cpu" else 5)
    base = build_patcher(cfg)
    toma, recorder = toma_node(base)
    with torch.inference_mode():
        for name, p in (("unpatched", base), ("toma", toma)):
            log.info("model warm-up %s", name)
            sampler(p, 256, cfg)()
        recorder.runs.clear()
        sampler(toma, size, cfg)()                 # the levels the node merges at this size
    levels = dict(recorder.runs[-1].levels)
    patchers = {"unpatched": base, "toma": toma, "lower bound": lower_bound(base, levels)}
    recorder.runs.clear()
    calls = {name: sampler(p, size, cfg) for name, p in patchers.items()}
    times: dict[str, list[float]] = {name: [] for name in calls}
    peaks: dict[str, float] = {}
    cuda = cfg.device.type == "cuda"
    with torch.inference_mode():
        for rep in range(reps):
            for name in calls if rep % 2 == 0 else reversed(list(calls)):
                log.info("model %s rep %d", name, rep)
                cfg.sync()
                if cuda:
                    torch.cuda.reset_peak_memory_stats(cfg.device)
                start = cfg.now()
                calls[name]()
                cfg.sync()
                times[name].append(cfg.now() - start)
                if cuda:
                    peaks[name] = torch.cuda.max_memory_allocated(cfg.device) / 2**30
    found = {name: Timing(tuple(t)) for name, t in times.items()}
    rows = []
    for name, t in found.items():
        row = {"variant": name, "image": f"{size}x{size}", "s": t.median, "s_min": t.min,
               "spread": t.spread, "runs_s": ", ".join(f"{s:.1f}" for s in t.times),
               **speedup(found["unpatched"], t), "peak_gb": peaks.get(name)}
        if name == "toma":
            versus_lower_bound(row, t, found["lower bound"])
            # the run times its plan builds on the CPU only (on CUDA that would need a sync)
            timed = [r.build_seconds for r in recorder.runs if r.build_seconds is not None]
            row["planning_s"] = sum(timed) / len(timed) if timed else None
            row["levels"] = {k: list(v) for k, v in levels.items()}
        rows.append(row)
    notes = [cfg.describe(reps, 1),
             "one Euler step, cfg 1.0, batch 1; SDPA attention; levels merged by the node: "
             + ", ".join(f"{k} {n}->{m} tokens" for k, (n, m) in sorted(levels.items())),
             "planning_s: the node's plan builds per step (a real run builds them once every "
             "recompute_every steps)"]
    return {"rows": rows, "notes": notes}
