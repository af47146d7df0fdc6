"""Whole SDXL UNet (ComfyUI only): one denoising step at 1024x1024, with and without ToMA.

Builds ComfyUI's own SDXL model (comfy.supported_models.SDXL with the real SDXL unet_config:
2.6 B parameters, 70 transformer blocks) with seeded random weights, wraps it in a ModelPatcher
and samples one Euler step (comfy.sample.sample, cfg 1.0: one UNet forward on latent
[1, 4, 128, 128], context [1, 77, 2048]) for:

- unpatched: the model as loaded;
- toma: the pack's ToMA node with its defaults (toma_pack.nodes.ToMA().patch(...)): what a
  workflow gets; its one-step run builds a plan per level, which a real run would reuse for
  recompute_every (5) steps, so planning is over-counted here (planning_s says how much);
- lower bound: every transformer block the node would merge runs on the merged token count
  with no merging cost (its output is thrown away), the rest of the UNet unchanged.

Interleaved over reps, after a warm-up at 256x256. fp32 weights need ~11 GB of memory: the
section is skipped, with a note, when less is available.
"""

from __future__ import annotations

import logging
import statistics
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .config import BenchConfig, load_pack
from .reference_blocks import fill_random

log = logging.getLogger(__name__)

SDXL_UNET = {
    "use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True,
    "legacy": False, "num_classes": "sequential", "adm_in_channels": 2816, "in_channels": 4,
    "model_channels": 320, "num_res_blocks": [2, 2, 2], "transformer_depth": [0, 0, 2, 2, 10, 10],
    "channel_mult": [1, 2, 4], "transformer_depth_middle": 10, "use_linear_in_transformer": True,
    "context_dim": 2048, "num_head_channels": 64,
    "transformer_depth_output": [0, 0, 0, 2, 2, 2, 10, 10, 10],
    "use_temporal_attention": False, "use_temporal_resblock": False,
}
NEEDED_GB = 13.0
COLUMNS = ("variant", "image", "s", "runs_s", "speedup", "vs_lb", "planning_s", "peak_gb")


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
    fill_random(model.diffusion_model, cfg.seed)
    model.diffusion_model.to(cfg.device, cfg.dtype)
    return comfy.model_patcher.ModelPatcher(model, load_device=cfg.device,
                                            offload_device=torch.device("cpu"))


def lower_bound(patcher):
    """A clone whose merged blocks run on the merged token count, free of merging cost."""
    pack = load_pack()
    from toma_pack.nodes.unet_patch import AUTO_MIN_TOKENS, transformer_blocks

    core = pack.toma_core
    clone = patcher.clone()
    for name, block in transformer_blocks(clone.get_model_object("diffusion_model")):
        original = types.MethodType(type(block).forward, block)

        def forward(x, context=None, transformer_options=None, _original=original):
            options = transformer_options or {}
            h, w = options["activations_shape"][-2:]
            if h * w < AUTO_MIN_TOKENS:
                return _original(x, context=context, transformer_options=options)
            regions = core.make_regions(h, w, "tile", 64)
            n = regions.count * core.destinations_per_region(0.5, regions)
            _original(x[:, :n], context=context, transformer_options=options)
            return x

        clone.add_object_patch(f"diffusion_model.{name}.forward", forward)
    return clone


def toma_node(patcher, planning: list[dict]):
    """The ToMA node's output with its defaults; run summaries are appended to `planning`."""
    pack = load_pack()
    basic = pack.nodes.toma_node.BASIC_INPUTS
    defaults = {k: spec[1]["default"] for k, spec in basic.items() if k != "model"}
    (patched,) = pack.nodes.ToMA().patch(patcher, **defaults)
    from comfy.patcher_extension import WrappersMP

    for fn in patched.wrappers.get(WrappersMP.OUTER_SAMPLE, {}).get("toma", []):
        for cell in fn.__closure__ or ():
            state = getattr(cell.cell_contents, "__self__", None)
            if hasattr(state, "summary"):
                state._report = lambda run, s=state: planning.append(s.summary(run))
    return patched


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
    """Rows per variant: median seconds of one size x size step (1024: SDXL's native size),
    speedup, ratio to the lower bound."""
    free = available_gb()
    if free is not None and free < NEEDED_GB:
        return {"rows": [], "notes": [f"skipped: {free:.1f} GiB memory available, about "
                                      f"{NEEDED_GB:.0f} needed for fp32 SDXL"]}
    reps = reps or (1 if cfg.device.type == "cpu" else 5)
    base = build_patcher(cfg)
    planning: list[dict] = []
    patchers = {"unpatched": base, "toma": toma_node(base, planning),
                "lower bound": lower_bound(base)}
    with torch.inference_mode():
        for name, p in patchers.items():
            log.info("model warm-up %s", name)
            sampler(p, 256, cfg)()
    planning.clear()
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
    med = {name: statistics.median(t) for name, t in times.items()}
    rows = []
    for name, t in times.items():
        row = {"variant": name, "image": f"{size}x{size}", "s": med[name],
               "runs_s": ", ".join(f"{s:.1f}" for s in t),
               "speedup": med["unpatched"] / med[name], "peak_gb": peaks.get(name)}
        if name == "toma":
            row["vs_lb"] = med[name] / med["lower bound"]
            if planning:
                row["planning_s"] = sum(p.get("planning_s", 0.0) for p in planning) / len(
                    planning)
                row["levels"] = planning[-1].get("levels")
        rows.append(row)
    notes = [f"one Euler step, cfg 1.0, batch 1, {str(cfg.dtype).replace('torch.', '')}; "
             f"{reps} rep(s) per variant, interleaved, after a 256x256 warm-up; SDPA attention"]
    return {"rows": rows, "notes": notes}
