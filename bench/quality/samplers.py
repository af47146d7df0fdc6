"""The trained fixtures under several samplers and guidance scales: how far each method's
samples move from the unmerged model's, and how far the sampler itself amplifies small errors.

    COMFYUI_PATH=/path/to/ComfyUI python -m bench.quality.samplers [--layouts sdxl,flux]
        [--out bench/results/<date>-cpu-quality-samplers.json]

For each fixture at its evaluation size, each sampler (SAMPLERS: ComfyUI's euler with the
normal schedule, dpmpp_2m with karras, euler_ancestral with normal) and each cfg (CFGS: 1 and a
usual guidance scale), the quality section's variants (bench/quality/section.py) of every
peer (ToMeSD, ToDo, EasyCache at each of their settings) and ToMA at its defaults and at
TOMA_VARIANTS, are sampled from the same seed and labels, and measured against the unmerged
samples of the same sampler and cfg: PSNR, SSIM, and MMD on the unmerged model's middle
features (the section's metrics).

The noise floor: the unmerged model with Gaussian noise of NOISE_LEVEL times each model output's
RMS added to that output (seeded). Its PSNR says how strongly the sampler turns a small, even
error of the model into a change of the samples on this fixture: a method scoring near it is
as close as an error of that size allows, not necessarily at fault.

On the matched fixtures (trained on rendered scenes too) the samples are of every scene class
and `accuracy` is their recognition accuracy (bench/quality/recognise.py). speedup: process CPU
time of each sampling call, unmerged's over it, one run each (the section times with more
care). Writes nothing unless --out: then the JSON there and the same report as .md beside it
(machine, commit, command, rows), and each fixture's frontiers, a panel per sampler and cfg, to
docs/quality-samplers-<layout>[-img2img].png (bench/quality/plots.py; `python -m
bench.quality.plots RESULT.json` redraws them from the rows).

Image-to-image (--denoise D < 1, matched fixtures): every sample starts from a rendered scene of
its own class (stream IMAGE_TO_IMAGE_STREAM, which neither the fixtures nor the recogniser were
trained on), noised and sampled over the last D of the schedule as KSampler does with a latent
image. The fixtures do not draw their classes from noise (their unmerged samples are recognised
near chance), so `accuracy` from an empty latent cannot tell whether a method keeps shapes and
glyphs readable; from a scene it can: the unmerged model keeps most of them, and what a merge
breaks (edges, thin strokes) shows as accuracy lost against unmerged's. The report gives the
recogniser's accuracy on the source scenes themselves.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..shared.config import ROOT
from . import data, plots, section
from . import models as qm

SAMPLERS = (("euler", "normal"), ("dpmpp_2m", "karras"), ("euler_ancestral", "normal"))
CFGS = (1.0, 4.0)
NOISE_LEVEL = 0.2
TOMA_VARIANTS = ("ToMA defaults", "ToMA attention r0.5", "ToMA block r0.75")
IMAGE_TO_IMAGE_STREAM = 7000
COLUMNS = ("model", "sampler", "cfg", "denoise", "variant", "method", "speedup", "psnr",
           "ssim", "mmd", "accuracy")

log = logging.getLogger(__name__)


def noisy(patcher, level: float, seed: int = 0) -> tuple[Any, Callable[[], None]]:
    """A clone whose model outputs get Gaussian noise of `level` x their RMS, and the function
    that restarts its seeded noise stream (call it before each sampling call)."""
    state = {"generator": None}

    def wrapper(apply_model, args: dict) -> torch.Tensor:
        out = apply_model(args["input"], args["timestep"], **args["c"])
        if state["generator"] is None:
            state["generator"] = torch.Generator().manual_seed(seed)
        noise = torch.randn(out.shape, generator=state["generator"]).to(out)
        return out + level * out.float().pow(2).mean().sqrt().to(out) * noise

    clone = patcher.clone()
    clone.set_model_unet_function_wrapper(wrapper)
    return clone, lambda: state.update(generator=None)


def source_scenes(layout: str, side: int, labels: torch.Tensor) -> torch.Tensor:
    """The image-to-image starts: a rendered scene of each label's class (stream
    IMAGE_TO_IMAGE_STREAM, one index per image), in model space [n, C, side, side]."""
    from . import scenes

    classes = (labels - len(data.train_photos())).tolist()
    pixels = scenes.batch(classes, side * qm.latent_per_pixel(layout), IMAGE_TO_IMAGE_STREAM, 0)
    return data.pixels_to_model_space(pixels, qm.arch(layout))


def source_accuracy(layout: str, per_class: int | None = None) -> float:
    """The recogniser's accuracy on the image-to-image starts themselves."""
    labels = section.eval_labels(layout, per_class)
    start = source_scenes(layout, qm.EVAL_LATENT[layout], labels)
    pixels = data.to_uint8(data.model_space_to_pixels(start, qm.arch(layout)))
    return section.recognition(layout, {"source": pixels}, labels)["source"]


def measure(layout: str, side: int | None = None, only: tuple[str, ...] | None = None,
            per_class: int | None = None, denoise: float = 1.0,
            samplers: tuple[tuple[str, str], ...] | None = None) -> list[dict[str, Any]]:
    """Rows for every sampler, cfg and variant of one fixture (side: latent side, default its
    evaluation size; only: these variants and unmerged; per_class: scene images per class on
    the matched fixtures, default the section's; denoise < 1: image-to-image from scenes of
    the labels' classes, matched fixtures only; samplers: default SAMPLERS)."""
    from . import metrics

    if not 0 < denoise <= 1:
        raise ValueError(f"--denoise must be in (0, 1], got {denoise}")
    if denoise < 1 and not qm.with_scenes(layout):
        raise ValueError(f"--denoise {denoise}: image-to-image starts from rendered scenes, "
                         f"which only the matched fixtures know; {layout} has none")
    side = side or qm.EVAL_LATENT[layout]
    found = section.variants(layout, side)
    unknown = set(only or ()) - {v.name for v in found}
    if unknown:
        raise ValueError(f"--only: no variants {sorted(unknown)} on {layout}; its variants: "
                         + ", ".join(v.name for v in found))
    if per_class is not None and per_class < 1:
        raise ValueError(f"--per-class must be at least 1, got {per_class}")
    fixture = qm.load(layout)
    base = fixture.patcher()
    patched = {}
    for v in found:
        if v.method == "toma" and v.name not in TOMA_VARIANTS:
            continue
        if only is not None and v.name not in (*only, "unmerged"):
            continue
        p = v.make(base)
        if p is not None:
            patched[v.name] = (v.method, p)
    floor, restart = noisy(base, NOISE_LEVEL)
    patched[f"noise floor ({NOISE_LEVEL:g} x RMS)"] = ("noise", floor)
    labels = section.eval_labels(layout, per_class)
    scenes_in = source_scenes(layout, side, labels) if denoise < 1 else None
    rows = []
    with torch.inference_mode():
        for sampler, scheduler in samplers or SAMPLERS:
            for cfg in CFGS:
                samples, seconds = {}, {}
                for name, (_, p) in patched.items():
                    log.warning("samplers %s %s/%s cfg %g: %s", layout, sampler, scheduler,
                                cfg, name)
                    restart()
                    start = time.process_time()
                    samples[name] = section.sample(p, fixture, labels, side, cfg=cfg,
                                                   sampler=sampler, scheduler=scheduler,
                                                   start=scenes_in, denoise=denoise)
                    seconds[name] = time.process_time() - start
                pixels = {n: data.to_uint8(data.model_space_to_pixels(x, qm.arch(layout)))
                          for n, x in samples.items()}
                feats = {n: section.features(base, fixture, x) for n, x in samples.items()}
                recognised = section.recognition(layout, pixels, labels)
                for name, (method, _) in patched.items():
                    psnr, ssim = metrics.psnr_ssim(pixels["unmerged"], pixels[name])
                    rows.append({"model": layout, "sampler": f"{sampler} / {scheduler}",
                                 "cfg": cfg, "denoise": denoise, "variant": name,
                                 "method": method,
                                 "s": seconds[name],
                                 "speedup": seconds["unmerged"] / seconds[name],
                                 "psnr": psnr, "ssim": ssim,
                                 "mmd": 1000 * metrics.mmd(feats["unmerged"], feats[name]),
                                 "accuracy": recognised.get(name)})
    return rows


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The quality section's targets (bench.quality.section.targets: ToMA defaults against each
    peer read off its own speed-quality curve at ToMA's speed) for every fixture, sampler and
    cfg, from this sweep's rows and speeds."""
    out = []
    groups = dict.fromkeys((r["model"], r["sampler"], r["cfg"]) for r in rows)
    for model, sampler, cfg in groups:
        own = [r for r in rows if (r["model"], r["sampler"], r["cfg"]) == (model, sampler, cfg)
               and r["method"] != "noise"]
        out += [{"sampler": sampler, "cfg": cfg, **t} for t in section.targets(own, model)]
    return out


def report(result: dict[str, Any]) -> str:
    from ..shared.common import markdown_table

    config = result["config"]
    found = targets(result["rows"])
    sources = config.get("source_accuracy") or {}
    image_to_image = [] if config.get("denoise", 1.0) >= 1 else [
        f"- image-to-image at denoise {config['denoise']:g}: every sample starts from a "
        f"rendered scene of its class (stream {IMAGE_TO_IMAGE_STREAM}); the recogniser's "
        "accuracy on those scenes: " + ", ".join(f"{k} {v:.3g}" for k, v in sources.items()),
        ""]
    met = sum(t["met"] is True for t in found)
    return "\n".join([
        "# Quality fixtures under several samplers (bench/quality/samplers.py)", "",
        ", ".join(f"{k}: {v}" for k, v in result["machine"].items()), "",
        f"commit: {config['commit']}", "",
        f"command: `{config['command']}` with COMFYUI_PATH={config['comfyui']}", "",
        f"- {section.STEPS} steps, {section.SEEDS['sdxl']} images per variant on the first "
        "fixtures (photograph classes), one batch of every scene class on the matched ones "
        f"(--per-class each; seed {section.SEED}), float32; psnr / ssim against the unmerged "
        "samples of the same sampler and cfg; mmd x1000 on the unmerged model's middle "
        "features; accuracy: the scene recogniser's on the samples; noise floor: the unmerged "
        f"model with {NOISE_LEVEL:g} x RMS Gaussian noise on each output", "", *image_to_image,
        markdown_table(result["rows"], COLUMNS), "", "## Targets", "",
        f"{met} of {len(found)} met; n/a: the peer never gets as fast as ToMA defaults.", "",
        markdown_table(found, ["sampler", "cfg", "target", "value", "met"]), ""])


def main(argv: list[str] | None = None) -> None:
    from ..shared.common import commit, machine_info, write_result
    from ..shared.config import setup_comfy

    parser = argparse.ArgumentParser(prog="python -m bench.quality.samplers",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default=",".join(qm.LAYOUTS))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--only", default=None,
                        help="comma-separated variant names (and unmerged): a shorter sweep")
    parser.add_argument("--per-class", type=int, default=None,
                        help="matched fixtures: scene images per class (default: the "
                             "section's)")
    parser.add_argument("--denoise", type=float, default=1.0,
                        help="below 1: image-to-image from rendered scenes of each sample's "
                             "class (matched fixtures), as KSampler's denoise")
    parser.add_argument("--samplers", default=",".join(s for s, _ in SAMPLERS),
                        help="comma-separated sampler names of " +
                             ", ".join(f"{s} ({k})" for s, k in SAMPLERS))
    args = parser.parse_args(argv)
    chosen = {name: (name, schedule) for name, schedule in SAMPLERS}
    unknown = [n for n in args.samplers.split(",") if n not in chosen]
    if unknown:
        parser.error(f"--samplers: unknown {unknown}; choose from {', '.join(chosen)}")
    samplers = tuple(chosen[n] for n in args.samplers.split(","))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s",
                        datefmt="%H:%M:%S")
    torch.set_num_threads(1)
    if not setup_comfy(torch.device("cpu")):
        raise SystemExit("set COMFYUI_PATH to a ComfyUI checkout")
    only = None if args.only is None else tuple(args.only.split(","))
    layouts = args.layouts.split(",")
    rows = [row for layout in layouts
            for row in measure(layout, only=only, per_class=args.per_class,
                               denoise=args.denoise, samplers=samplers)]
    sources = ({layout: source_accuracy(layout, args.per_class) for layout in layouts}
               if args.denoise < 1 else {})
    result = {"machine": machine_info(),
              "config": {"commit": commit(),
                         "comfyui": str(ROOT.joinpath(os.environ["COMFYUI_PATH"]).resolve()),
                         "command": " ".join(["python -m bench.quality.samplers",
                                              *(sys.argv[1:] if argv is None else argv)]),
                         "samplers": samplers, "cfgs": CFGS, "noise_level": NOISE_LEVEL,
                         "denoise": args.denoise, "source_accuracy": sources},
              "rows": rows}
    text = report(result)
    print(text)
    if args.out:
        write_result(args.out, result, text)
        plots.sweep_figures(rows, args.denoise, ROOT / "docs")


if __name__ == "__main__":
    main()
