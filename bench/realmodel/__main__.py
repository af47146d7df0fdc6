"""python -m bench.realmodel: the terrain model merged as the pack merges, against unmerged.

Every merge samples the same 16 heightmaps with the package's own TerrainGenerator.generate
(one step, the package's noise and difficulty draws from one seed), the model's attention
blocks run by bench/realmodel/merges.py. Measures per sample, against the unmerged heightmaps:
PSNR (peak: the unmerged heightmap's height range) and the slope error (RMS of the difference of the
height gradients over the RMS of the unmerged gradient, %). Writes a result file (.json, .md)
and a grid picture (.png).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.resources
import json
import platform
import subprocess
import sys
import time

import numpy as np
import torch

from .merges import Merge
from .onnx_torch import OnnxUNet, Session

RATIOS = (0.25, 0.5, 0.75)


def merges(ratios, only: list[str] | None = None, rules: tuple = ()) -> list[Merge]:
    """Unmerged first, then every merge at every ratio (random destinations size-weighted at
    0.5 only, ToDo at 0.75 only, the destination `rules` of bench/realmodel/rules.py
    size-weighted), or those whose label is in `only`."""
    found = []
    for r in ratios:
        found += [Merge("toma", r, rule, sized=True) for rule in rules]
        found += [Merge("toma", r), Merge("toma", r, sized=True), Merge("toma", r, "random"),
                  Merge("toma", r, "random", sized=True), Merge("tomesd", r)]
    found += [Merge("todo", 0.75)]
    if only:
        return [Merge("none"), *(m for m in found if m.label in only or m.rule in rules)]
    default = [m for m in found if not (m.rule == "random" and m.sized and m.ratio != 0.5)]
    return [Merge("none"), *default]


def psnr(a: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """[n, H, W] heightmaps -> [n] dB, the peak each unmerged heightmap's own height range (the
    samples' ranges differ by difficulty, from a few metres to the package's 22 m)."""
    peak = ref.max(axis=(1, 2)) - ref.min(axis=(1, 2))
    mse = ((a - ref) ** 2).mean(axis=(1, 2))
    return 10 * np.log10(peak ** 2 / np.maximum(mse, 1e-20))


def slope_error(a: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """[n] %: RMS of the gradient difference over the RMS of the reference's gradient."""
    ga, gr = np.gradient(a, axis=(1, 2)), np.gradient(ref, axis=(1, 2))
    diff = sum(((x - y) ** 2).mean(axis=(1, 2)) for x, y in zip(ga, gr, strict=True))
    norm = sum((y ** 2).mean(axis=(1, 2)) for y in gr)
    return 100 * np.sqrt(diff / norm)


def conversion_error(path: str, model: OnnxUNet) -> float:
    """Largest |torch - onnxruntime| of the unmerged graph on two noisy inputs."""
    import onnxruntime as ort

    rng = np.random.default_rng(1)
    feeds = {"noisy": rng.standard_normal((2, 1, 128, 128), dtype=np.float32) * 80,
             "sigma": np.full(2, 80.0, np.float32),
             "difficulty": np.array([0.1, 0.9], np.float32)}
    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    return float(np.abs(model(**feeds).numpy() - ref).max())


def grid_picture(samples: dict[str, np.ndarray], path: str, shown: int) -> None:
    """Rows: merges (the first unmerged); columns: the first `shown` samples, each shown from
    its unmerged heightmap's lowest (black) to highest (white) point."""
    from PIL import Image, ImageDraw

    side, label_w = 128, 250
    rows = list(samples)
    ref = samples[rows[0]][:shown]
    low, high = ref.min(axis=(1, 2)), ref.max(axis=(1, 2))
    img = Image.new("L", (label_w + shown * (side + 4), len(rows) * (side + 4)), 255)
    draw = ImageDraw.Draw(img)
    for i, name in enumerate(rows):
        draw.text((4, i * (side + 4) + side // 2), name, fill=0)
        for j in range(shown):
            unit = (samples[name][j] - low[j]) / max(high[j] - low[j], 1e-6)
            h = np.clip(unit * 255, 0, 255).astype(np.uint8)
            img.paste(Image.fromarray(h), (label_w + j * (side + 4), i * (side + 4)))
    img.save(path)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ratios", type=float, nargs="+", default=RATIOS)
    ap.add_argument("--only", nargs="+", default=None, help="labels of the merges to run")
    ap.add_argument("--rules", nargs="+", default=(),
                    help="destination rules of bench/realmodel/rules.py to add, size-weighted")
    ap.add_argument("--out", required=True, help="result path without extension")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    from terrain_diffusion import TerrainGenerator

    path = str(importlib.resources.files("terrain_diffusion").joinpath(
        "weights/terrain_consistency_unet_difficulty100.onnx"))
    model = OnnxUNet(path)
    gen = TerrainGenerator(path, device="cpu")
    heights, rows, pictures = {}, [], {}
    for merge in merges(args.ratios, args.only, args.rules):
        model.runner = merge
        gen.session = Session(model, merge.start)
        t0 = time.perf_counter()
        out = gen.generate(args.samples, seed=args.seed, batch_size=args.samples)
        key = f"{merge.label} r{merge.ratio}" if merge.kind != "none" else "unmerged"
        heights[key] = out
        ref = heights["unmerged"]
        row = {"merge": merge.label, "kind": merge.kind, "rule": merge.rule,
               "sized": merge.sized, "ratio": merge.ratio,
               "psnr_db": psnr(out, ref).tolist(),
               "slope_error_pct": slope_error(out, ref).tolist(),
               "seconds": round(time.perf_counter() - t0, 1)}
        rows.append(row)
        if merge.ratio in (0.0, args.ratios[0]) or merge.kind == "todo":
            pictures[key] = out
        print(key, f"{np.mean(row['psnr_db']):.1f} dB", f"{np.mean(row['slope_error_pct']):.1f}%",
              row["seconds"], "s", flush=True)
    result = {
        "what": "adaptive-terrain-diffusion 0.4.2's consistency UNet, merged as the pack merges "
                "a UNet's attention (1024- and 256-token levels), against unmerged",
        "config": {"commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                            capture_output=True, text=True).stdout.strip(),
                   "command": "python -m bench.realmodel " + " ".join(argv or sys.argv[1:])},
        "machine": {"cpu": platform.processor() or platform.machine(),
                    "threads": torch.get_num_threads(), "torch": torch.__version__,
                    "date": datetime.datetime.now(datetime.timezone.utc).strftime(
                        "%Y-%m-%d %H:%M UTC")},
        "conversion_max_abs_error": conversion_error(path, model.__class__(path)),
        "samples": args.samples, "seed": args.seed, "rows": rows,
    }
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(report(result))
    grid_picture(pictures, args.out + ".png", min(6, args.samples))


def report(result: dict) -> str:
    """The result file's table: mean PSNR and slope error, and paired wins against ToMeSD."""
    rows = result["rows"]
    tomesd = {r["ratio"]: r for r in rows if r["kind"] == "tomesd"}
    lines = [f"# Real model: {result['what']}", "",
             f"commit {result['config']['commit']}, `{result['config']['command']}`, "
             f"{result['machine']}", "",
             f"conversion: unmerged torch graph vs onnxruntime, max abs error "
             f"{result['conversion_max_abs_error']:.1e}", "",
             f"{result['samples']} samples of `TerrainGenerator.generate(seed={result['seed']})`;"
             " PSNR of heightmaps vs unmerged (peak: the unmerged sample's height range), "
             "slope error: RMS of the gradient difference / RMS of the unmerged gradient; "
             "wins: samples closer than ToMeSD at the same ratio (PSNR)", "",
             "| merge | r | PSNR dB (mean) | PSNR min | slope error % (mean) | wins vs ToMeSD |",
             "|---|---|---|---|---|---|"]
    for r in rows[1:]:
        base = tomesd.get(r["ratio"])
        closer = sum(a > b for a, b in zip(r["psnr_db"], base["psnr_db"], strict=True)) \
            if base is not None else 0
        wins = "-" if base is None or r is base else f"{closer}/{len(r['psnr_db'])}"
        lines.append(f"| {r['merge']} | {r['ratio']} | {np.mean(r['psnr_db']):.1f} | "
                     f"{np.min(r['psnr_db']):.1f} | {np.mean(r['slope_error_pct']):.1f} | "
                     f"{wins} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
