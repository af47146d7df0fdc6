"""Where step caches stop: the matched fixtures sampled in a few steps, and ToMA stacked with a
cache over many.

    COMFYUI_PATH=/path/to/ComfyUI-v0.3.64 python -m bench.quality.few_steps
        [--layouts sdxl-matched,flux-matched] [--parts few,stacked]
        [--out bench/results/<date>-cpu-quality-few-steps.json]

ComfyUI v0.3.64 is the one version where every cache compared here runs: its own EasyCache,
and from ../shared/peers MagCache and First Block Cache (Comfy-WaveSpeed), loaded as ComfyUI
loads them (bench/speed/peers.py).

- few: 4 and 8 steps at cfg 1 (the distilled workflows' setting) with the samplers and
  schedules of FEW; unmerged, ToMA (defaults and other ratios) and each cache at
  CACHE_SETTINGS.
- stacked: STACKED_STEPS steps at cfg 1 with euler / normal; unmerged, EasyCache and MagCache
  at STACKED_SETTINGS, ToMA at its defaults and ratio 0.75, and ToMA before each cache.

Every part also samples the unmerged model a second time under another name ("unmerged,
again"): its speed-up shows how far the machine's noise moves a ratio.

Each variant samples one batch (every scene class, seed 0) from an empty latent, against the
unmerged samples of the same sampler and steps: PSNR and SSIM, and the speed-up: process CPU
time of the sampling call, unmerged's over it, the faster of REPS interleaved runs. ToMA's own
run summary gives its plan builds and their share of sampling time (plan_share). A cache
keeps its state on the diffusion model, so every cache variant samples a model of its own.
Writes nothing unless --out: then the JSON and the same report as .md beside it, and each
part's frontier to docs/quality-few-steps-<layout>.png.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..shared.config import ROOT
from . import baselines as qb
from . import data, section
from . import models as qm

# (steps, sampler, scheduler) of the few-step part
FEW = ((4, "euler", "sgm_uniform"), (4, "lcm", "sgm_uniform"), (8, "euler", "sgm_uniform"))
STACKED_STEPS = 20
STACKED_SETTINGS = {"EasyCache": (0.2, 0.5), "MagCache": (0.12, 0.24)}
STACKED_SAMPLER = ("euler", "normal")
TOMA_RATIOS = (0.25, 0.5, 0.75)
REPS = 2
# Each cache's threshold: its node's default, and a looser and a tighter one.
CACHE_SETTINGS = {"EasyCache": (0.2, 0.5, 1.0), "First Block Cache": (0.06, 0.12, 0.2),
                  "MagCache": (0.06, 0.12, 0.24)}
# MagCache starts after int(steps x retention_ratio) steps and needs one computed step before
# it: its default 0.2 starts at step 0 of 4 and fails; 0.3, its maximum, runs at 4 steps.
MAGCACHE_RETENTION = {"few": 0.3, "stacked": 0.2}
COLUMNS = ("model", "part", "steps", "sampler", "variant", "method", "speedup", "psnr", "ssim",
           "plan_builds", "plan_share", "note")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Variant:
    """A way to sample: its name, method ("unmerged", "toma", a cache's name, "toma+<cache>"),
    and how to make it from a fresh fixture's ModelPatcher (None: not on this fixture)."""

    name: str
    method: str
    make: Callable[[Any], Any | None]


def _peer_node(pack: str, node_id: str, **inputs: Any) -> Callable[[Any], Any] | None:
    """The function applying `pack`'s node `node_id` with `inputs` to a model; None where the
    pack does not import on this ComfyUI."""
    from ..speed.peers import peers_module

    peers = peers_module()
    peer = peers.load(pack)
    if not peer.loaded:
        return None
    cls = peer.node(node_id)
    return lambda model: peers.run_node(cls, model=model, **inputs)[0]


def caches(layout: str, part: str) -> dict[str, Callable[[float], Callable[[Any], Any] | None]]:
    """Each cache by name: threshold -> the function applying it (None: not here)."""
    flux = qm.arch(layout) == "flux"
    out: dict[str, Callable[[float], Callable[[Any], Any] | None]] = {
        "EasyCache": lambda t: lambda p: qb.easycache(p, t),
        "First Block Cache": lambda t: _peer_node(
            "Comfy-WaveSpeed", "ApplyFBCacheOnModel", object_to_patch="diffusion_model",
            residual_diff_threshold=t, start=0.0, end=1.0, max_consecutive_cache_hits=-1)}
    if flux:    # MagCache's calibrated magnitudes exist for Flux, not for SDXL's UNet
        out["MagCache"] = lambda t: _peer_node(
            "ComfyUI-MagCache", "MagCache", model_type="flux", magcache_thresh=t,
            retention_ratio=MAGCACHE_RETENTION[part], magcache_K=2, start_step=0, end_step=-1)
    return out


def _toma(layout: str, ratio: float) -> Callable[[Any], Any]:
    return section._toma(**{**section.REAL_SIZE_DEFAULTS.get(layout, {}), "ratio": ratio})


def _then(first: Callable[[Any], Any], second: Callable[[Any], Any] | None):
    return None if second is None else lambda p: second(first(p))


def variants(layout: str, part: str) -> list[Variant]:
    """The variants of one part ("few" or "stacked") on a fixture."""
    out = [Variant("unmerged", "unmerged", lambda p: p),
           Variant("unmerged, again", "control", lambda p: p)]
    ratios = TOMA_RATIOS if part == "few" else (0.5, 0.75)
    out += [Variant("ToMA defaults" if r == 0.5 else f"ToMA r{r}", "toma", _toma(layout, r))
            for r in ratios]
    settings = CACHE_SETTINGS if part == "few" else STACKED_SETTINGS
    for name, cache in caches(layout, part).items():
        for t in settings.get(name, ()):
            apply = cache(t)
            if apply is None:
                continue
            out.append(Variant(f"{name} {t:g}", name, apply))
            if part == "stacked":
                out.append(Variant(f"ToMA + {name} {t:g}", f"toma+{name}",
                                   _then(_toma(layout, 0.5), apply)))
    return out


def plan_figures(patcher) -> tuple[int | None, float | None]:
    """(plan builds, planning time over sampling time) of ToMA's last run on `patcher`."""
    from toma_pack.nodes.speed_check import state_of

    state = state_of(patcher)
    stats = state.last_stats if state is not None else None
    if not stats:
        return None, None
    planning = stats.get("planning_s")
    share = planning / stats["sampling_s"] if planning and stats.get("sampling_s") else None
    return stats.get("plans_built"), share


def measure(layout: str, part: str, steps: int, sampler: str, scheduler: str
            ) -> list[dict[str, Any]]:
    """Rows of one fixture, part, step count and sampler."""
    from . import metrics

    found = variants(layout, part)
    labels = section.eval_labels(layout)
    side = qm.EVAL_LATENT[layout]
    fixture = qm.load(layout)
    # a fresh model for each cache: they keep their state on the diffusion model object
    models = {v.name: v.make(fixture.patcher() if v.method in ("unmerged", "control", "toma")
                             else qm.load(layout).patcher()) for v in found}
    samples: dict[str, torch.Tensor] = {}
    seconds = dict.fromkeys(models, float("inf"))
    failed: dict[str, str] = {}
    with torch.inference_mode():
        for _ in range(REPS):
            for v in found:
                if v.name in failed:
                    continue
                log.warning("few_steps %s %s %d steps %s/%s: %s", layout, part, steps, sampler,
                            scheduler, v.name)
                start = time.process_time()
                try:
                    out = section.sample(models[v.name], fixture, labels, side,
                                         steps=steps, sampler=sampler, scheduler=scheduler)
                except Exception as exc:    # a peer's own failure is a result, not a crash
                    log.exception("%s failed", v.name)
                    failed[v.name] = f"fails: {type(exc).__name__}: {exc}"[:160]
                    continue
                seconds[v.name] = min(seconds[v.name], time.process_time() - start)
                samples.setdefault(v.name, out)
    pixels = {n: data.to_uint8(data.model_space_to_pixels(x, qm.arch(layout)))
              for n, x in samples.items()}
    rows = []
    for v in found:
        if v.name in failed:
            rows.append({"model": layout, "part": part, "steps": steps,
                         "sampler": f"{sampler} / {scheduler}", "variant": v.name,
                         "method": v.method, "note": failed[v.name]})
            continue
        psnr, ssim = metrics.psnr_ssim(pixels["unmerged"], pixels[v.name])
        builds, share = plan_figures(models[v.name]) if "toma" in v.method else (None, None)
        rows.append({"model": layout, "part": part, "steps": steps,
                     "sampler": f"{sampler} / {scheduler}", "variant": v.name,
                     "method": v.method, "s": seconds[v.name],
                     "speedup": seconds["unmerged"] / seconds[v.name], "psnr": psnr,
                     "ssim": ssim, "plan_builds": builds, "plan_share": share})
    return rows


def run(layouts: tuple[str, ...], parts: tuple[str, ...]) -> list[dict[str, Any]]:
    rows = []
    for layout in layouts:
        if "few" in parts:
            for steps, sampler, scheduler in FEW:
                rows += measure(layout, "few", steps, sampler, scheduler)
        if "stacked" in parts:
            rows += measure(layout, "stacked", STACKED_STEPS, *STACKED_SAMPLER)
    return rows


def targets(rows: list[dict]) -> list[dict[str, Any]]:
    """The few-step and stacking targets, per fixture, step count and sampler:
    - few steps, 4 steps: ToMA defaults at least FEW_TARGET[arch] x, and every cache at most
      1.1x at its settings whose PSNR is within 2 dB of ToMA defaults';
    - stacked: each ToMA + EasyCache row at least 1.3x as fast as the fastest EasyCache-alone
      row with a PSNR at least as high (none: met, EasyCache gets no such quality)."""
    out = []
    groups = dict.fromkeys((r["model"], r["part"], r["steps"], r["sampler"]) for r in rows)
    for model, part, steps, sampler in groups:
        own = [r for r in rows if (r["model"], r["part"], r["steps"], r["sampler"])
               == (model, part, steps, sampler) and "psnr" in r]      # failed rows: none
        where = f"{model} {steps} steps {sampler}"
        toma = next(r for r in own if r["variant"] == "ToMA defaults")
        if part == "few" and steps == 4:
            need = FEW_TARGET[qm.arch(model)]
            out.append({"where": where, "target": f"ToMA defaults >= {need}x",
                        "value": f"{toma['speedup']:.2f}x", "met": toma["speedup"] >= need})
            for method in [m for m in dict.fromkeys(r["method"] for r in own)
                           if m not in ("unmerged", "control", "toma")]:
                close = [r for r in own if r["method"] == method
                         and r["psnr"] >= toma["psnr"] - 2]
                fastest = max((r["speedup"] for r in close), default=None)
                out.append({"where": where, "target": f"{method} <= 1.1x within 2 dB of ToMA",
                            "value": "none within 2 dB" if fastest is None
                            else f"{fastest:.2f}x",
                            "met": fastest is None or fastest <= 1.1})
        if part == "stacked":
            stack = [r for r in own if r["method"] == "toma+EasyCache"]
            alone = [r for r in own if r["method"] == "EasyCache"]
            for s in stack:
                peers = [a for a in alone if a["psnr"] >= s["psnr"]]
                ref = max(peers, key=lambda a: a["speedup"], default=None)
                ratio = None if ref is None else s["speedup"] / ref["speedup"]
                out.append({"where": where, "target": f"{s['variant']} >= 1.3x EasyCache alone "
                                                      f"at equal PSNR",
                            "value": "no EasyCache setting as good" if ratio is None
                            else f"{ratio:.2f}x ({ref['variant']})",
                            "met": ratio is None or ratio >= 1.3})
    return out


FEW_TARGET = {"sdxl": 1.15, "flux": 1.3}


def _settings(settings: dict[str, tuple[float, ...]]) -> str:
    return "; ".join(f"{k} {', '.join(f'{t:g}' for t in v)}" for k, v in settings.items())


def report(result: dict[str, Any]) -> str:
    from ..shared.common import markdown_table

    config = result["config"]
    found = targets(result["rows"])
    met = sum(t["met"] is True for t in found)
    return "\n".join([
        "# Few steps and stacked caches on the quality fixtures (bench/quality/few_steps.py)",
        "", ", ".join(f"{k}: {v}" for k, v in result["machine"].items()), "",
        f"commit: {config['commit']}", "",
        f"command: `{config['command']}` with COMFYUI_PATH={config['comfyui']}", "",
        f"- cfg 1; one batch of every scene class (seed {section.SEED}), float32; psnr / ssim "
        "against the unmerged samples of the same sampler and steps; speedup: process CPU "
        f"time of the sampling call, unmerged's over it, the faster of {REPS} interleaved "
        "runs; plan_builds / plan_share: ToMA's plans built in the run and their share of "
        "its sampling time; caches in few steps at " + _settings(CACHE_SETTINGS)
        + ", stacked at " + _settings(STACKED_SETTINGS) + " (EasyCache between 15% and 95% "
        "of the schedule, its defaults; First Block Cache over every step; MagCache K 2 and "
        "retention 0.3 in few steps, 0.2 (its default) over more); 'unmerged, again': the "
        "unmerged model sampled a second time (the machine's noise)", "",
        markdown_table(result["rows"], COLUMNS), "", "## Targets", "",
        f"{met} of {len(found)} met.", "",
        markdown_table(found, ["where", "target", "value", "met"]), ""])


def main(argv: list[str] | None = None) -> None:
    from ..shared.common import commit, machine_info, write_result
    from ..shared.config import setup_comfy
    from . import plots

    parser = argparse.ArgumentParser(prog="python -m bench.quality.few_steps",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default="sdxl-matched,flux-matched")
    parser.add_argument("--parts", default="few,stacked")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    parts = tuple(args.parts.split(","))
    if set(parts) - {"few", "stacked"}:
        parser.error(f"--parts: few and/or stacked, got {args.parts}")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s",
                        datefmt="%H:%M:%S")
    torch.set_num_threads(1)
    if not setup_comfy(torch.device("cpu")):
        raise SystemExit("set COMFYUI_PATH to a ComfyUI checkout")
    layouts = tuple(args.layouts.split(","))
    rows = run(layouts, parts)
    result = {"machine": machine_info(),
              "config": {"commit": commit(),
                         "comfyui": str(ROOT.joinpath(os.environ["COMFYUI_PATH"]).resolve()),
                         "command": " ".join(["python -m bench.quality.few_steps",
                                              *(sys.argv[1:] if argv is None else argv)]),
                         "few": FEW, "stacked_steps": STACKED_STEPS,
                         "cache_settings": CACHE_SETTINGS,
                         "stacked_settings": STACKED_SETTINGS},
              "rows": rows}
    text = report(result)
    print(text)
    if args.out:
        write_result(args.out, result, text)
        for layout in layouts:
            plots.few_steps_figure([r for r in rows if r["model"] == layout and "psnr" in r],
                                   ROOT / "docs" / f"quality-few-steps-{layout}.png")


if __name__ == "__main__":
    main()
