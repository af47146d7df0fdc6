"""Whole sampling calls side by side on the CPU: unmerged, ToMA, ToMA of another checkout, and
both under ComfyUI's torch.compile wrapper.

    [TOMA_BASELINE=/path/to/older/checkout] [TOMA_BENCH_COMPILE=1] \
        python -m bench --sections whole-call

One Euler step through comfy.sample.sample (SDXL with CFG 2: one model call of batch 2; Flux
with cfg 1: one call of batch 1) of ComfyUI's own SDXL UNet and Flux at 1024x1024 token grids,
with the layers and depths of the real models at a reduced width (WIDTH below: a real-size SDXL
call takes about a minute of CPU, Flux several, and compiling them longer). A narrower model
gives merging's own work a larger share of the call, so its speedups are, if anything, lower
than the real width's (bench/speed/unet_blocks.py and flux_blocks.py measure real-width blocks).

- TOMA_BASELINE=PATH: the pack in another checkout (e.g. a worktree of an older commit), loaded
  under its own package name and applied through its own apply_toma: "ToMA baseline" rows give
  that code's speedup in the same run, interleaved with this checkout's.
- TOMA_WHOLE_MODELS=sdxl,flux: which models (default both).
- TOMA_BENCH_COMPILE=1: unmerged and ToMA through ComfyUI's TorchCompileModel wrapper
  (inductor), timed after their compiling call; their speedup is compiled ToMA over compiled
  unmerged.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..shared.common import MIN_REPS, interleaved, speedup
from ..shared.config import BenchConfig

log = logging.getLogger(__name__)

COLUMNS = ("model", "variant", "ms", "ms_min", "spread", "reps", "speedup", "speedup_lo",
           "speedup_hi")
# Reduced widths (the real ones: SDXL model_channels 320, Flux hidden 3072 with 24 heads).
SDXL_CHANNELS = 160
FLUX_HIDDEN, FLUX_HEADS = 768, 6          # heads of 128, as Flux's RoPE axes (16, 56, 56) need
LATENT = 128                               # 1024x1024 pixels


def sdxl_patcher(channels: int = SDXL_CHANNELS, head_channels: int = 64):
    """ComfyUI's SDXL UNet with SDXL's levels and depths at `channels` (heads of
    `head_channels`: SDXL's 64 by default), fp32, weights from bench.shared.weights."""
    import comfy.model_patcher
    import comfy.supported_models

    from ..shared.weights import fill_weights

    unet = {"use_checkpoint": False, "image_size": 32, "in_channels": 4, "out_channels": 4,
            "model_channels": channels, "num_res_blocks": [2, 2, 2],
            "channel_mult": [1, 2, 4], "transformer_depth": [0, 0, 2, 2, 10, 10],
            "transformer_depth_middle": 10,
            "transformer_depth_output": [0, 0, 0, 2, 2, 2, 10, 10, 10], "context_dim": 2048,
            "num_head_channels": head_channels, "adm_in_channels": 2816,
            "use_linear_in_transformer": True,
            "legacy": False, "num_classes": "sequential", "use_spatial_transformer": True,
            "use_temporal_attention": False, "use_temporal_resblock": False}
    config = comfy.supported_models.SDXL(unet)
    config.unet_config["num_head_channels"] = head_channels
    return _patcher(config, comfy, fill_weights)


def flux_patcher(hidden: int = FLUX_HIDDEN, heads: int = FLUX_HEADS,
                 axes: tuple[int, int, int] = (16, 56, 56)):
    """ComfyUI's Flux with Flux.1's 19 + 38 blocks at `hidden` in `heads` heads (of 128 by
    default, as Flux's RoPE `axes` need: they sum to the head size), fp32."""
    import comfy.ldm.flux.model
    import comfy.model_patcher
    import comfy.supported_models

    from ..shared.weights import fill_weights

    fields = {f.name for f in dataclasses.fields(comfy.ldm.flux.model.FluxParams)}
    params = {"in_channels": 16, "out_channels": 16, "vec_in_dim": 768, "context_in_dim": 4096,
              "hidden_size": hidden, "mlp_ratio": 4.0, "num_heads": heads, "depth": 19,
              "depth_single_blocks": 38, "axes_dim": list(axes), "theta": 10000,
              "patch_size": 2, "qkv_bias": True, "guidance_embed": True, "txt_ids_dims": []}
    config = comfy.supported_models.Flux(
        {"image_model": "flux", **{k: v for k, v in params.items() if k in fields}})
    return _patcher(config, comfy, fill_weights)


# Wan 2.1 T2V 1.3B is 1536 wide (12 heads of 128), 30 blocks, feed-forward 8960.
WAN_DIM, WAN_HEADS, WAN_FFN, WAN_BLOCKS = 512, 4, 2986, 15


def wan_patcher():
    """ComfyUI's Wan 2.1 text-to-video with the 1.3B model's heads of 128 and feed-forward ratio
    at WAN_DIM, WAN_BLOCKS blocks, fp32."""
    import comfy.model_patcher
    import comfy.supported_models

    from ..shared.weights import fill_weights

    config = comfy.supported_models.WAN21_T2V(
        {"image_model": "wan2.1", "model_type": "t2v", "patch_size": (1, 2, 2), "text_len": 512,
         "in_dim": 16, "dim": WAN_DIM, "ffn_dim": WAN_FFN, "freq_dim": 256, "text_dim": 4096,
         "out_dim": 16, "num_heads": WAN_HEADS, "num_layers": WAN_BLOCKS,
         "window_size": (-1, -1), "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6})
    return _patcher(config, comfy, fill_weights)


def _patcher(config, comfy, fill_weights):
    cpu = torch.device("cpu")
    config.set_inference_dtype(torch.float32, None)
    model = config.get_model({}, device=cpu)
    fill_weights(model, 0)
    model.eval()
    return comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)


def _inputs(name: str) -> tuple[torch.Tensor, list, list, float]:
    """(latent, positive, negative, cfg) for one step at 1024x1024."""
    g = torch.Generator().manual_seed(0)
    if name == "sdxl":
        def cond(seed: int) -> list:
            gg = torch.Generator().manual_seed(seed)
            return [[torch.randn(1, 77, 2048, generator=gg),
                     {"pooled_output": torch.randn(1, 1280, generator=gg), "width": 1024,
                      "height": 1024}]]
        return torch.zeros(1, 4, LATENT, LATENT), cond(1), cond(2), 2.0
    text = torch.randn(1, 512, 4096, generator=g)
    if name == "wan":   # 512x320, 9 frames: 3 x 20 x 32 = 1920 tokens
        return torch.zeros(1, 16, 3, 40, 64), [[text, {}]], [[text, {}]], 1.0
    positive = [[text, {"pooled_output": torch.randn(1, 768, generator=g), "guidance": 3.5}]]
    return torch.zeros(1, 16, LATENT, LATENT), positive, positive, 1.0


def load_baseline(path: Path) -> Any:
    """The pack at `path` (another checkout) as the package `toma_baseline`."""
    name = "toma_baseline"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, path / "__init__.py", submodule_search_locations=[str(path)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _one_step(patcher, name: str) -> Callable[[], torch.Tensor]:
    import comfy.sample

    latent, positive, negative, cfg = _inputs(name)
    noise = comfy.sample.prepare_noise(latent, 0)

    def call() -> torch.Tensor:
        return comfy.sample.sample(patcher, noise, 1, cfg, "euler", "normal", positive,
                                   negative, latent, disable_pbar=True, seed=0)

    return call


def variants(name: str, base, baseline: Path | None, compile_: bool) -> dict[str, Callable]:
    """The side-by-side calls of one model."""
    from toma_pack.nodes.apply import apply_toma
    from toma_pack.nodes.options import make_options

    calls = {"unmerged": _one_step(base, name),
             "ToMA": _one_step(apply_toma(base, make_options()), name)}
    if baseline is not None:
        old = load_baseline(baseline)
        calls["ToMA baseline"] = _one_step(
            old.nodes.apply.apply_toma(base, old.nodes.options.make_options()), name)
    if compile_:
        from comfy_api.torch_helpers import set_torch_compile_wrapper

        for label, source in (("compiled unmerged", base),
                              ("compiled ToMA", apply_toma(base, make_options()))):
            model = source.clone()
            set_torch_compile_wrapper(model=model, backend="inductor")
            calls[label] = _one_step(model, name)
    return calls


def run(cfg: BenchConfig) -> dict[str, Any]:
    """The section's rows: per model, every variant's time and its speedup (ToMA rows over
    unmerged, compiled ToMA over compiled unmerged)."""
    cfg.apply_threads()
    baseline = os.environ.get("TOMA_BASELINE")
    baseline = Path(baseline) if baseline else None
    compile_ = bool(os.environ.get("TOMA_BENCH_COMPILE"))
    models = os.environ.get("TOMA_WHOLE_MODELS", "sdxl,flux").split(",")
    rows, notes = [], []
    reps = MIN_REPS
    for name, build in (("sdxl", sdxl_patcher), ("flux", flux_patcher)):
        if name not in models:
            continue
        try:
            calls = variants(name, build(), baseline, compile_)
            # one untimed call each (it compiles the compiled ones), then interleaved reps
            timings = interleaved(calls, warmup=1, reps=reps, clock=cfg.clock)
        except Exception as exc:  # one model failing must not take the other's rows with it
            log.exception("whole-call %s failed", name)
            notes.append(f"{name} failed: {type(exc).__name__}: {exc}")
            continue
        for label, timing in timings.items():
            row = {"model": name, "variant": label, **timing.fields()}
            reference = "compiled unmerged" if label == "compiled ToMA" else "unmerged"
            if label not in ("unmerged", "compiled unmerged"):
                row.update(speedup(timings[reference], timing))
            rows.append(row)
    notes.append(cfg.describe(reps, warmup=1))
    notes.append(f"SDXL: SDXL's levels and 70 transformer blocks at model_channels "
                 f"{SDXL_CHANNELS} (real 320), CFG 2 batched; Flux: 19 + 38 blocks, heads of "
                 f"128, hidden {FLUX_HIDDEN} (real 3072), 512 text tokens, cfg 1; one Euler step "
                 f"of comfy.sample.sample at 1024x1024, SDPA attention (bench.shared.config), node "
                 f"defaults")
    if baseline is not None:
        notes.append(f"ToMA baseline: the pack at {baseline}")
    if compile_:
        notes.append("compiled: ComfyUI's TorchCompileModel wrapper, inductor; compiled ToMA's "
                     "speedup is over compiled unmerged")
    return {"rows": rows, "columns": list(COLUMNS), "notes": notes}
