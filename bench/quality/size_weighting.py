"""python -m bench.quality.size_weighting: size-weighted self-attention on the trained fixtures
(UNet: unet_patch.SIZE_WEIGHTED; Flux layouts, the DiT path: dit_patch.SIZE_WEIGHTED), on and
off, ToMA in both scopes at three ratios, against unmerged.

The quality section's sampling (10 euler steps, its labels and seed, bench/quality/section.py)
and its PSNR and SSIM of the decoded pixels; no timing (the correction adds one mask to the
merged self-attention calls, the same kernels otherwise). Writes bench/results/<date>-cpu-
quality-size-weighting.json and .md.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from ..shared.common import commit, machine_info, write_result
from ..shared.config import ROOT, load_pack, setup_comfy
from . import data, metrics, section
from . import models as qm

LAYOUTS = ("sdxl", "sdxl-matched", "flux", "flux-matched")
RATIOS = (0.25, 0.5, 0.75)


def measure(layout: str, scopes: list[str], ratios: list[float]) -> list[dict]:
    """Rows of one fixture: each scope and ratio, size-weighted and not."""
    path = "nodes.unet_patch" if qm.arch(layout) == "sdxl" else "nodes.dit_patch"
    switch = importlib.import_module(f"{load_pack().__name__}.{path}")
    side = qm.EVAL_LATENT[layout]
    fixture = qm.load(layout)
    base = fixture.patcher(torch.device("cpu"))
    labels = section.eval_labels(layout)
    real = section.REAL_SIZE_DEFAULTS.get(layout, {})

    def pixels(patcher) -> torch.Tensor:
        with torch.inference_mode():
            out = section.sample(patcher, fixture, labels, side)
        return data.to_uint8(data.model_space_to_pixels(out, qm.arch(layout)))

    ref = pixels(base)
    rows = []
    for scope in scopes:
        for r in ratios:
            patched = section._toma(**real, ratio=r, merge_scope=scope)(base)
            for weighted in (False, True):
                default, switch.SIZE_WEIGHTED = switch.SIZE_WEIGHTED, weighted
                try:
                    psnr, ssim = metrics.psnr_ssim(ref, pixels(patched))
                finally:
                    switch.SIZE_WEIGHTED = default
                rows.append({"model": layout, "scope": scope, "ratio": r,
                             "size_weighted": weighted, "psnr": psnr, "ssim": ssim})
                logging.warning("%s %s r%s weighted=%s: %.2f dB", layout, scope, r, weighted,
                                psnr)
    return rows


def report(result: dict) -> str:
    cfg = result["config"]
    lines = ["# Size-weighted self-attention on the trained fixtures", "",
             f"commit {cfg['commit']}, `{cfg['command']}`, ComfyUI {cfg['comfyui']}, "
             f"{result['machine'].get('cpu')}, {cfg['threads']} thread(s)", "",
             "PSNR / SSIM of the decoded samples against unmerged (the quality section's "
             "sampling: 10 euler steps, its labels and seed)", "",
             "| fixture | scope | r | PSNR off | PSNR on | SSIM off | SSIM on |",
             "|---|---|---|---|---|---|---|"]
    rows = result["rows"]
    for off, on in zip(rows[::2], rows[1::2], strict=True):
        lines.append(f"| {off['model']} | {off['scope']} | {off['ratio']} | {off['psnr']:.2f} | "
                     f"{on['psnr']:.2f} | {off['ssim']:.3f} | {on['ssim']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    study_main("size_weighting", measure, report, ["block", "attention"], list(RATIOS), argv)


def study_main(name: str, measure: Callable, report: Callable, scopes: list[str],
               ratios: list[float], argv: list[str] | None) -> None:
    """The command line of a fixture study `bench.quality.<name>` comparing a switch off and
    on: measure(layout, scopes, ratios) -> rows; report(result) -> Markdown; the result goes
    to bench/results/<date>-cpu-quality-<name, dashed>.json (or --out)."""
    prog = f"python -m bench.quality.{name}"
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--scopes", nargs="+", default=scopes)
    parser.add_argument("--ratios", nargs="+", type=float, default=ratios)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    torch.set_num_threads(1)
    if not setup_comfy(torch.device("cpu")):
        raise SystemExit("set COMFYUI_PATH to a ComfyUI checkout")
    rows = [row for layout in args.layouts.split(",")
            for row in measure(layout, args.scopes, args.ratios)]
    result = {"machine": machine_info("cpu"),
              "config": {"commit": commit(), "threads": 1,
                         "comfyui": str(Path(os.environ["COMFYUI_PATH"]).resolve()),
                         "command": " ".join([prog, *(sys.argv[1:] if argv is None else argv)])},
              "rows": rows}
    slug = name.replace("_", "-")
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / (
        f"{datetime.date.today().isoformat()}-cpu-quality-{slug}.json")
    text = report(result)
    write_result(out, result, text)
    print(text)

if __name__ == "__main__":
    main()
