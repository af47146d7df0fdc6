"""Quality section: ToMA and its peers on the trained fixtures, through ComfyUI's sampler.

For each fixture (models/toma-{sdxl,flux}-fixture.safetensors, see bench/quality/train.py) at its
evaluation size (128 x 128 pixels: SDXL-layout attention levels of 4096 and 1024 tokens, Flux
1024 image tokens), every variant (unmerged; ToMA at several settings through the pack's own
ToMAAdvanced node; ToMeSD; ToDo; ComfyUI's EasyCache) is a ModelPatcher clone, sampled with
comfy.sample.sample (euler, "normal" schedule, cfg 1.0, fixed seeds and class labels) and
measured:

- s, speedup: median process CPU time of the whole sampling call (interleaved repetitions),
  and unmerged's time over it;
- psnr, ssim: of the decoded samples against the unmerged samples of the same seeds;
- mmd: MMD^2 (x1000, KID's kernel, bench.quality.metrics.mmd) between the sample sets'
  features, taken from the unmerged model's own middle (SDXL: middle_block's output; Flux: the
  middle single block's image tokens) at a mid noise level;
- dloss: increase of the held-out denoising loss (bench.quality.train's objective on photographs
never
  trained on, one sampler step from each noise level to 0 through comfy.sample.sample_custom),
  mean over the held-out noise levels, relative to unmerged's (step caching: not applicable,
  it changes nothing within one step).

Writes docs/quality-frontier-<layout>.png (speed vs PSNR and vs KID), docs/quality-grid-
<layout>.png (unmerged, ToMA defaults, ToMeSD, ToDo side by side) and returns rows for the
bench report, with the quality targets (TARGET_SPEEDUP and the peers) checked against them.
"""

from __future__ import annotations

import logging
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..shared.config import ROOT, BenchConfig, load_pack
from . import baselines as qb
from . import data, scenes
from . import models as qm

log = logging.getLogger(__name__)

DOCS = ROOT / "docs"
COLUMNS = ("model", "variant", "method", "s", "speedup", "psnr", "ssim", "mmd", "accuracy",
           "dloss", "pareto")
STEPS = 10
SEEDS = {"sdxl": 2, "flux": 2}           # images per variant (one batch, one seed)
LABELS = (0, 5, 9, 2)                    # classes of those images (train_photos order)
SCENES_PER_CLASS = 2                     # matched fixtures: images of every scene class
SEED = 0
# The matched fixtures have no speed target: their CPU time is mostly convolutions and
# small matrix products, not what a GPU at 1024^2 spends (bench/results/*-projection-*).
TARGET_SPEEDUP = {"sdxl": 1.5, "flux": 1.6}
ACCURACY_POINTS = 0.02                   # ToMA defaults' recognition accuracy vs unmerged
FEATURE_QUANTILE = 0.5
# What the node's defaults do on the real model at 1024^2, on the matched fixtures' smaller
# token counts: SDXL's auto levels merge both attention levels there (4096 and 1024 tokens,
# both >= the auto threshold; the fixture's are 784 and 196), and Flux.1's default skips
# leave 47 of its 57 blocks merged (82%; d0-2, s0-2 leave 24 of the fixture's 30, 80%). The
# peers merge the same SDXL levels.
REAL_SIZE_DEFAULTS: dict[str, dict[str, Any]] = {
    "sdxl-matched": {"unet_levels": "all"}, "flux-matched": {"skip_blocks": "d0-2, s0-2"}}


@dataclass
class Variant:
    """One way to run a fixture: a name, its method family, settings, and how to patch."""

    name: str
    method: str
    make: Callable[[Any], Any]
    settings: dict = field(default_factory=dict)


def _node_defaults() -> dict[str, Any]:
    """The ToMAAdvanced node's widget defaults (what a user gets), from the node itself."""
    return load_pack().nodes.toma_node.TOMA_ADVANCED.defaults()


def _toma(**settings: Any) -> Callable[[Any], Any]:
    def make(patcher):
        return load_pack().nodes.toma_node.patch_model(patcher,
                                                        **{**_node_defaults(), **settings})

    return make


def eval_labels(layout: str, per_class: int | None = None) -> torch.Tensor:
    """Class labels of the images each variant samples (one batch): photographs' classes
    (LABELS), or on the matched fixtures `per_class` (default SCENES_PER_CLASS) of every scene
    class (their labels follow the photographs')."""
    if qm.with_scenes(layout):
        first = len(data.train_photos())
        return torch.tensor([first + c for c in range(len(scenes.CLASSES))
                             for _ in range(per_class or SCENES_PER_CLASS)])
    return torch.tensor(LABELS[:SEEDS[layout]])


def variants(layout: str, side: int, quick: bool = False) -> list[Variant]:
    """The variants measured on a fixture at a side x side latent (quick: the ones the targets
    and the picture grid need)."""
    real = REAL_SIZE_DEFAULTS.get(layout, {})
    unet = qm.arch(layout) == "sdxl"
    low = 0 if real.get("unet_levels") == "all" else qb.MIN_TOKENS      # the peers' levels
    out = [Variant("unmerged", "unmerged", lambda p: p),
           Variant("ToMA defaults", "toma", _toma(**real), {"defaults": True, **real})]
    if unet:
        tome = [Variant(f"ToMeSD attention r{r}", "tomesd",
                        lambda p, r=r: qb.unet_tomesd(p, r, "attention", min_tokens=low),
                        {"ratio": r, "scope": "attention"}) for r in (0.5, 0.75)]
        tome += [Variant(f"ToMeSD block r{r}", "tomesd",
                         lambda p, r=r: qb.unet_tomesd(p, r, "block", min_tokens=low),
                         {"ratio": r, "scope": "block"}) for r in (0.5, 0.75)]
        todo = [Variant(f"ToDo {f}x{f}", "todo",
                        lambda p, f=f: qb.unet_todo(p, f, min_tokens=low),
                        {"factor": f}) for f in (2, 4)]
    else:
        h = w = side // 2
        txt = qm.CONTEXT_TOKENS
        tome = [Variant(f"ToMeSD attention r{r}", "tomesd",
                        lambda p, r=r: qb.flux_tomesd(p, r, txt, h, w),
                        {"ratio": r, "scope": "attention"}) for r in (0.5, 0.75)]
        todo = [Variant(f"ToDo {f}x{f}", "todo", lambda p, f=f: qb.flux_todo(p, txt, h, w, f),
                        {"factor": f}) for f in (2, 4)]
    cache = [Variant(f"EasyCache {t}", "easycache", lambda p, t=t: qb.easycache(p, t),
                     {"reuse_threshold": t}) for t in (0.2, 0.5, 1.0)]
    out += tome[:1] + todo[:1] + cache[1:2] if quick else tome + todo + cache
    if quick:
        return out
    defaults = _node_defaults()
    for scope in ("block", "attention"):
        for r in (0.25, 0.5, 0.75):
            if (r, scope) == (defaults["ratio"], defaults["merge_scope"]):
                continue          # the defaults' row
            out.append(Variant(f"ToMA {scope} r{r}", "toma",
                               _toma(**real, ratio=r, merge_scope=scope),
                               {"ratio": r, "merge_scope": scope, **real}))
    if real:
        return out               # the matched fixtures: the scope and ratio decision only
    # the defaults' neighbours: tiles of about 64 tokens are 64 + 16 tiles on SDXL's levels at
    # the evaluation size, 16 on Flux's 1024 tokens (256 was Flux's fixed default before)
    tiles = (16, 256) if layout == "sdxl" else (64, 256)
    out += [Variant(f"ToMA tiles {t}", "toma", _toma(tile_count=t), {"tile_count": t})
            for t in tiles]
    out.append(Variant("ToMA tau 100", "toma", _toma(tau=100.0), {"tau": 100.0}))
    out += [Variant(f"ToMA recompute {n}", "toma", _toma(recompute_every=n),
                    {"recompute_every": n})
            for n in (1, 5, 10) if n != defaults["recompute_every"]]
    if layout == "sdxl":
        out.append(Variant("ToMA levels largest", "toma", _toma(unet_levels="largest"),
                           {"unet_levels": "largest"}))
    if layout == "flux":
        out += [Variant("ToMA skip none", "toma", _toma(skip_blocks="none"),
                        {"skip_blocks": "none"}),
                Variant("ToMA r0.75 skip none", "toma", _toma(ratio=0.75, skip_blocks="none"),
                        {"ratio": 0.75, "skip_blocks": "none"})]
    return out


# Running the sampler ----------------------------------------------------------------------------
def _to_latent(fixture: qm.Fixture, x: torch.Tensor) -> torch.Tensor:
    return fixture.model.latent_format.process_out(x)


def _from_latent(fixture: qm.Fixture, x: torch.Tensor) -> torch.Tensor:
    return fixture.model.latent_format.process_in(x.float().cpu())


def sample(patcher, fixture: qm.Fixture, labels: torch.Tensor, side: int,
           steps: int = STEPS, cfg: float = 1.0, sampler: str = "euler",
           scheduler: str = "normal", start: torch.Tensor | None = None,
           denoise: float = 1.0) -> torch.Tensor:
    """One sample per label (one batch, seed SEED) of a side x side latent, in model space
    [n, C, side, side]; negative: the null class; ComfyUI's `sampler` and `scheduler`.
    start: images [n, C, side, side] (model space) to sample from at `denoise` < 1, as
    KSampler does with a latent image (image-to-image); None: from an empty latent."""
    import comfy.sample

    channels = fixture.model.latent_format.latent_channels
    latent = (torch.zeros(len(labels), channels, side, side) if start is None
              else _to_latent(fixture, start))
    positive = fixture.conditioning(labels, side, side)
    negative = fixture.conditioning(torch.full_like(labels, -1), side, side)
    noise = comfy.sample.prepare_noise(latent, SEED)
    out = comfy.sample.sample(patcher, noise, steps, cfg, sampler, scheduler, positive,
                              negative, latent, denoise=denoise, disable_pbar=True, seed=SEED)
    return _from_latent(fixture, out)


def denoise_once(patcher, fixture: qm.Fixture, x0: torch.Tensor, labels: torch.Tensor,
                 sigma: float, noise: torch.Tensor) -> torch.Tensor:
    """One euler step from noise level sigma to 0 through the sampler: the model's denoised
    prediction of x0 [B, C, h, w] (model space) noised with `noise`; same shape back."""
    import comfy.sample
    import comfy.samplers

    h, w = x0.shape[-2:]
    sigmas = torch.tensor([float(sigma), 0.0])
    out = comfy.sample.sample_custom(
        patcher, noise, 1.0, comfy.samplers.sampler_object("euler"), sigmas,
        fixture.conditioning(labels, h, w), fixture.conditioning(torch.full_like(labels, -1), h, w),
        _to_latent(fixture, x0), disable_pbar=True, seed=SEED)
    return _from_latent(fixture, out)


@dataclass
class HeldOut:
    x0: torch.Tensor        # [n, C, h, w] model space
    labels: torch.Tensor    # [n] (-1: unconditional)
    sigmas: list[float]
    noise: torch.Tensor


def held_out(fixture: qm.Fixture, side: int) -> HeldOut:
    """One fixed crop per held-out photograph (side x side latent), the training script's
    held-out noise levels, fixed noise."""
    from .train import held_out_sigmas

    photos = data.load_set(data.HELD_OUT, labelled=False)
    pixels, labels = photos.fixed_crops(side * qm.latent_per_pixel(fixture.layout), 1, SEED)
    x0 = data.pixels_to_model_space(pixels, qm.arch(fixture.layout))
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(SEED + 777))
    sigmas = [float(s) for s in held_out_sigmas(fixture)]
    return HeldOut(x0, labels, sigmas[::2], noise)        # 3 of the 5: lowest, middle, highest


def denoising_losses(patcher, fixture: qm.Fixture, ho: HeldOut) -> list[float]:
    """bench.quality.train's loss (mean (denoised - x0)^2 / sigma^2) at each held-out sigma."""
    out = []
    for sigma in ho.sigmas:
        denoised = denoise_once(patcher, fixture, ho.x0, ho.labels, sigma, ho.noise)
        out.append(float(((denoised - ho.x0) ** 2).mean() / sigma ** 2))
    return out


def features(patcher, fixture: qm.Fixture, x: torch.Tensor) -> torch.Tensor:
    """Middle-of-the-model features of model-space images x: [tokens of all images, C]."""
    net = fixture.model.diffusion_model
    # UNetModel runs middle_block's layers one by one (forward_timestep_embed), so the hook
    # goes on its last layer (a ResBlock), whose output is the middle block's.
    unet = qm.arch(fixture.layout) == "sdxl"
    module = (net.middle_block[-1] if unet
              else net.single_blocks[len(net.single_blocks) // 2])
    captured: list[torch.Tensor] = []

    def hook(_module, _inputs, output):
        captured.append(output.detach().float())

    from .train import held_out_sigmas

    table = held_out_sigmas(fixture)
    sigma = float(table[len(table) // 2])
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(SEED + 99))
    handle = module.register_forward_hook(hook)
    try:
        denoise_once(patcher, fixture, x, torch.full((len(x),), -1), sigma, noise)
    finally:
        handle.remove()
    f = captured[-1]
    if unet:                                          # [B, C, h, w]
        return f.flatten(2).transpose(1, 2).reshape(-1, f.shape[1])
    return f[:, -(x.shape[-2] // 2) * (x.shape[-1] // 2):].reshape(-1, f.shape[-1])


# The section ------------------------------------------------------------------------------------
def measure(layout: str, cfg: BenchConfig, quick: bool, reps: int,
            side: int | None = None) -> dict[str, Any]:
    """Rows for every variant of one fixture, plus the images of the picture grid.
    side: latent side (default: the evaluation size, EVAL_LATENT)."""
    from . import metrics

    side = side or qm.EVAL_LATENT[layout]
    fixture = qm.load(layout, dtype=cfg.dtype, device=cfg.device)
    base = fixture.patcher(cfg.device)
    found = variants(layout, side, quick)
    patched = {}
    for v in found:
        p = v.make(base)
        if p is None:
            log.warning("quality %s: %s not available in this ComfyUI", layout, v.name)
            continue
        patched[v.name] = p
    found = [v for v in found if v.name in patched]
    labels = eval_labels(layout)
    times: dict[str, list[float]] = {v.name: [] for v in found}
    samples: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        sample(patched["unmerged"], fixture, labels, side, steps=2)          # warm-up
        for rep in range(reps):
            for v in found if rep % 2 == 0 else list(reversed(found)):
                log.warning("quality %s rep %d: %s", layout, rep, v.name)
                cfg.sync()
                start = cfg.now()
                out = sample(patched[v.name], fixture, labels, side)
                cfg.sync()
                times[v.name].append(cfg.now() - start)
                samples.setdefault(v.name, out)
        ho = held_out(fixture, side)
        losses = {v.name: denoising_losses(patched[v.name], fixture, ho)
                  for v in found if v.method != "easycache"}
        feats = {name: features(patched["unmerged"], fixture, x) for name, x in samples.items()}
    pixels = {name: data.to_uint8(data.model_space_to_pixels(x, qm.arch(layout)))
              for name, x in samples.items()}
    recognised = recognition(layout, pixels, labels)
    base_t = statistics.median(times["unmerged"])
    base_loss = sum(losses["unmerged"]) / len(losses["unmerged"])
    rows = []
    for v in found:
        t = statistics.median(times[v.name])
        psnr, ssim = metrics.psnr_ssim(pixels["unmerged"], pixels[v.name])
        loss = losses.get(v.name)
        rows.append({
            "model": layout, "variant": v.name, "method": v.method, "settings": v.settings,
            "s": t, "runs_s": [round(x, 2) for x in times[v.name]], "speedup": base_t / t,
            "psnr": psnr, "ssim": ssim,
            "mmd": 1000 * metrics.mmd(feats["unmerged"], feats[v.name]),
            "accuracy": recognised.get(v.name),
            "dloss": None if loss is None else sum(loss) / len(loss) / base_loss - 1,
            "dloss_per_sigma": loss,
        })
    mark_pareto(rows)
    return {"rows": rows, "pixels": pixels, "held_out_loss": losses["unmerged"],
            "sigmas": ho.sigmas}


def recognition(layout: str, pixels: dict[str, torch.Tensor],
                labels: torch.Tensor) -> dict[str, float]:
    """Recognition accuracy of each variant's samples (uint8 [n, H, W, 3]) of scene classes
    (bench.quality.recognise); empty for fixtures without scenes."""
    if not qm.with_scenes(layout):
        return {}
    from . import recognise

    model = recognise.load()
    classes = labels - len(data.train_photos())
    return {name: recognise.accuracy(model, x, classes) for name, x in pixels.items()}


def mark_pareto(rows: list[dict]) -> None:
    """pareto = no other row is at least as fast with at least as good PSNR and MMD, and
    strictly better in one."""
    for r in rows:
        r["pareto"] = not any(
            o is not r and o["speedup"] >= r["speedup"] and _finite(o["psnr"]) >= _finite(
                r["psnr"]) and o["mmd"] <= r["mmd"]
            and (o["speedup"] > r["speedup"] or _finite(o["psnr"]) > _finite(r["psnr"])
                 or o["mmd"] < r["mmd"])
            for o in rows)


def _finite(psnr: float) -> float:
    """PSNR with identical images (inf) capped at 100 dB, so it compares and interpolates."""
    return min(psnr, 100.0)


BETTER = {"psnr": 1, "ssim": 1, "mmd": -1, "accuracy": 1, "dloss": -1}


def at_speed(rows: list[dict], method: str, speed: float,
             metric: str) -> tuple[float | None, str]:
    """`method`'s `metric` at `speed`, and how it was read off its own speed-quality curve:
    linear interpolation between its two rows around `speed`; its slowest row when every row
    is faster; None when every row is slower by more than 5% (it cannot reach that speed)."""
    own = sorted((r for r in rows if r["method"] == method and r.get(metric) is not None),
                 key=lambda r: r["speedup"])
    if not own:
        return None, "not measured"

    def value(r: dict) -> float:
        return _finite(r[metric]) if metric == "psnr" else r[metric]

    if speed <= own[0]["speedup"]:
        return value(own[0]), f"{own[0]['variant']} ({own[0]['speedup']:.3g}x, faster)"
    if speed > own[-1]["speedup"] * 1.05:
        return None, (f"cannot reach {speed:.3g}x (fastest: {own[-1]['variant']}, "
                      f"{own[-1]['speedup']:.3g}x)")
    if speed >= own[-1]["speedup"]:
        return value(own[-1]), f"{own[-1]['variant']} ({own[-1]['speedup']:.3g}x)"
    lo = max((r for r in own if r["speedup"] <= speed), key=lambda r: r["speedup"])
    hi = min((r for r in own if r["speedup"] > speed), key=lambda r: r["speedup"])
    t = (speed - lo["speedup"]) / (hi["speedup"] - lo["speedup"])
    return (value(lo) + t * (value(hi) - value(lo)),
            f"between {lo['variant']} ({lo['speedup']:.3g}x) and {hi['variant']} "
            f"({hi['speedup']:.3g}x)")


def targets(rows: list[dict], layout: str) -> list[dict[str, Any]]:
    """The quality targets for one fixture: the ToMA default's speedup, then metric by metric
    against ToMeSD (better), ToDo and EasyCache (not worse), each read off the peer's own
    speed-quality curve at the ToMA default's speed. met is "n/a" where the peer cannot run
    that fast at any of its measured settings."""
    default = next((r for r in rows if r["variant"] == "ToMA defaults"), None)
    if default is None:
        return []
    goal = TARGET_SPEEDUP.get(layout)
    speed = default["speedup"]
    out = [] if goal is None else [{"target": f"{layout}: ToMA defaults >= {goal}x faster "
                                              "than unmerged",
                                    "value": f"{speed:.3g}x", "met": speed >= goal}]
    if default.get("accuracy") is not None:
        base = next(r for r in rows if r["variant"] == "unmerged")["accuracy"]
        out.append({"target": f"{layout}: ToMA defaults' recognition accuracy within "
                              f"{100 * ACCURACY_POINTS:g} points of unmerged",
                    "value": f"{100 * default['accuracy']:.1f}% vs {100 * base:.1f}%",
                    "met": default["accuracy"] >= base - ACCURACY_POINTS - 1e-9})
    for method, strict in (("tomesd", True), ("todo", False), ("easycache", False)):
        relation = "better than" if strict else "not worse than"
        for metric, sign in BETTER.items():
            a = default.get(metric)
            if a is None:
                continue
            a = _finite(a) if metric == "psnr" else a
            b, where = at_speed(rows, method, speed, metric)
            if b is None and where == "not measured":
                if metric == "dloss" and method == "easycache":
                    continue      # one step has nothing to cache: not applicable
                out.append({"target": f"{layout}: ToMA {metric} {relation} {method}",
                            "value": "not measured", "met": False})
                continue
            met: bool | str = "n/a" if b is None else (
                sign * (a - b) > 0 if strict else sign * (a - b) >= 0)
            out.append({"target": f"{layout}: ToMA {metric} {relation} {method} at "
                                  f"{speed:.3g}x",
                        "value": f"{a:.4g} vs " + ("-" if b is None else f"{b:.4g}")
                                 + f" ({where})", "met": met})
    return out


def chosen_layouts(spec: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(--layouts' fixtures, those left out): "present" is every fixture whose weights file is
    in models/, any other value a comma-separated list."""
    if spec != "present":
        return tuple(spec.split(",")), ()
    here = tuple(layout for layout in qm.LAYOUTS if qm.weights_path(layout).exists())
    if not here:
        raise SystemExit(f"--layouts present: no fixture weights in {qm.MODELS_DIR}")
    return here, tuple(layout for layout in qm.LAYOUTS if layout not in here)


def run(cfg: BenchConfig, layouts: tuple[str, ...] = qm.LAYOUTS, reps: int | None = None,
        write_pictures: bool = True, side: int | None = None) -> dict[str, Any]:
    """The section: rows of every fixture, targets, and the pictures in docs/."""
    from . import plots

    # CPU: one timed run per variant (process CPU time of a whole sampling call; the 2-core
    # machine this was built on had no time for more); GPU: 3, interleaved.
    reps = reps or (1 if cfg.device.type == "cpu" else 3)
    cfg.apply_threads()
    rows, notes, checks = [], [], []
    for layout in layouts:
        result = measure(layout, cfg, cfg.quick, reps, side)
        rows += result["rows"]
        checks += targets(result["rows"], layout)
        notes.append(f"{layout}: held-out denoising loss unmerged "
                     + ", ".join(f"{v:.4g}" for v in result["held_out_loss"])
                     + " at sigma " + ", ".join(f"{s:.3g}" for s in result["sigmas"]))
        if write_pictures:
            # the committed pictures come from full CPU runs; others get their own names
            suffix = ("" if cfg.device.type == "cpu" else f"-{cfg.device.type}") + (
                "-quick" if cfg.quick else "")
            DOCS.mkdir(exist_ok=True)
            pixels = qm.EVAL_LATENT[layout] * qm.latent_per_pixel(layout)
            plots.frontier(result["rows"], DOCS / f"quality-frontier-{layout}{suffix}.png",
                           f"{layout}-layout fixture, {pixels}px")
            plots.grid(result["pixels"], DOCS / f"quality-grid-{layout}{suffix}.png")
    images = ", ".join(f"{layout} {len(eval_labels(layout))}" for layout in layouts)
    notes.insert(0, f"trained fixtures, {STEPS} euler steps, cfg 1.0, images per variant: "
                    f"{images}; {reps} timed runs each (interleaved), "
                    f"{str(cfg.dtype).replace('torch.', '')}; mmd x1000 on the unmerged "
                    "model's middle features; dloss = relative increase of held-out "
                    "denoising loss")
    return {"rows": rows, "notes": notes, "targets": checks}


def _fingerprint(row: dict) -> tuple:
    """What identifies a configuration across runs: its quality figures, which are
    deterministic (same weights, seeds and code give the same samples), unlike its time."""
    return (row["method"],) + tuple(round(float(row[k]), 6) if row.get(k) is not None else None
                                    for k in ("psnr", "ssim", "mmd", "dloss"))


def combine(results: list[dict]) -> dict[str, Any]:
    """One quality section from several runs of the same fixtures: the newest run's rows, each
    with the median of the speedups that every run measured for the same configuration
    (recognised by _fingerprint, so a renamed variant, e.g. after a default changed, still
    matches); then the Pareto marks and targets again. `results`: oldest first."""
    newest = results[-1]["sections"]["quality"]
    rows = [dict(r) for r in newest["rows"]]
    for row in rows:
        found = [o["speedup"] for res in results for o in res["sections"]["quality"]["rows"]
                 if o["model"] == row["model"] and _fingerprint(o) == _fingerprint(row)]
        row["speedups"] = [round(x, 3) for x in found]
        row["speedup"] = statistics.median(found)
    checks = []
    for layout in dict.fromkeys(r["model"] for r in rows):
        own = [r for r in rows if r["model"] == layout]
        mark_pareto(own)
        checks += targets(own, layout)
    notes = newest["notes"] + [f"speedup: median over {len(results)} runs of the same "
                               "configuration (speedups lists each run's)"]
    return {"rows": rows, "notes": notes, "targets": checks, "columns": list(COLUMNS)}


def main(argv: list[str] | None = None) -> None:
    """`python -m bench.quality`: the quality section alone, for chosen fixtures (the same
    rows as `python -m bench --sections quality`), to bench/results/<date>-<device>-quality-
    <layouts>.json and .md."""
    import argparse
    import datetime
    import json
    import sys

    from ..shared.common import commit, machine_info, write_result
    from ..shared.config import default_config, setup_comfy

    parser = argparse.ArgumentParser(prog="python -m bench.quality")
    parser.add_argument("--layouts", default=",".join(qm.LAYOUTS),
                        help="comma-separated fixtures, or 'present': those whose weights are "
                             "in models/ (a device run, where bench/gpu/travel.sh left the "
                             "large ones behind)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="cpu")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--side", type=int, default=None,
                        help="latent side (default: each fixture's evaluation size); smaller "
                             "for a quick check that the section runs, not for its figures")
    parser.add_argument("--out", default=None)
    parser.add_argument("--combine", nargs="+", type=Path, default=None,
                        help="instead of running: merge these result files (oldest first) into "
                             "--out, speedups as medians over the runs, and redraw the frontier")
    args = parser.parse_args(argv)
    if args.combine:
        runs = [json.loads(p.read_text()) for p in args.combine]
        result = {**runs[-1], "sections": {"quality": combine(runs)},
                  "combined_from": [str(p) for p in args.combine]}
        result["config"] = {**result["config"], "commit": commit(), "command": " ".join(
            ["python -m bench.quality", *(sys.argv[1:] if argv is None else argv)]),
            "runs_commits": [r.get("config", {}).get("commit") for r in runs]}
        from . import plots

        for layout in dict.fromkeys(r["model"] for r in result["sections"]["quality"]["rows"]):
            own = [r for r in result["sections"]["quality"]["rows"] if r["model"] == layout]
            pixels = qm.EVAL_LATENT[layout] * qm.latent_per_pixel(layout)
            plots.frontier(own, DOCS / f"quality-frontier-{layout}.png",
                           f"{layout}-layout fixture, {pixels}px, median of {len(runs)} runs")
        out = Path(args.out or args.combine[-1].with_name(args.combine[-1].stem + "-combined.json"))
        write_result(out, result, report(result) + "\n")
        print(report(result))
        return
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s",
                        datefmt="%H:%M:%S")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if not setup_comfy(device):
        raise SystemExit("set COMFYUI_PATH to a ComfyUI checkout")
    clock = "wall" if device.type == "cuda" else args.clock
    cfg = default_config(args.quick, True, str(device), clock)
    layouts, absent = chosen_layouts(args.layouts)
    section = {**run(cfg, layouts, args.reps, side=args.side), "columns": list(COLUMNS)}
    if absent:
        section["notes"].append("not run, their weights not in models/: " + ", ".join(absent))
    result = {"machine": machine_info(device),
              "config": {"device": device.type, "dtype": str(cfg.dtype).replace("torch.", ""),
                         "quick": cfg.quick, "clock": clock, "threads": torch.get_num_threads(),
                         "comfyui": str(ROOT.joinpath(os.environ["COMFYUI_PATH"]).resolve()),
                         "sections": ["quality"], "commit": commit(),
                         "command": " ".join(["python -m bench.quality",
                                              *(sys.argv[1:] if argv is None else argv)])},
              "sections": {"quality": section}}
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / (
        f"{datetime.date.today().isoformat()}-{device.type}-quality-{'-'.join(layouts)}.json")
    text = report(result)
    write_result(out, result, text + "\n")
    print(text)


def report(result: dict[str, Any]) -> str:
    """Markdown of a `python -m bench.quality` result: rows, then the targets."""
    from ..shared.common import markdown_table

    section = result["sections"]["quality"]
    config = result["config"]
    lines = [f"# ToMA quality section ({config['device']}, {config['dtype']})", "",
             ", ".join(f"{k}: {v}" for k, v in result["machine"].items()), "",
             f"commit: {config.get('commit')}", "", f"command: `{config.get('command')}`"
             + (f" with COMFYUI_PATH={config['comfyui']}" if config.get("comfyui") else ""), ""]
    lines += [f"- {note}" for note in section["notes"]]
    lines += ["", markdown_table(section["rows"], section["columns"]), "", "## Targets", "",
              markdown_table(section["targets"], ["target", "value", "met"]), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
