"""python -m bench.quality.norm_weighting: norm-weighted destinations (facility location with
each token's coverage counted by its squared norm) on the trained UNet fixtures, off and on,
size-weighted attention on (the pack's default) and off, against unmerged.

The quality section's sampling and measures, as bench/quality/size_weighting.py. Writes
bench/results/<date>-cpu-quality-norm-weighting.json and .md.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import logging
import os
import sys
from pathlib import Path

import torch

from ..shared.common import commit, machine_info, write_result
from ..shared.config import ROOT, load_pack, setup_comfy
from . import data, metrics, section
from . import models as qm
from .size_weighting import LAYOUTS


def measure(layout: str, scopes: list[str], ratios: list[float]) -> list[dict]:
    """Rows of one fixture: each scope and ratio, size weighting and norm weighting off/on."""
    unet_patch = load_pack().nodes.unet_patch
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
    for scope, r, sized, normed in itertools.product(scopes, ratios, (True, False),
                                                     (False, True)):
        patched = section._toma(**real, ratio=r, merge_scope=scope)(base)
        unet_patch.SIZE_WEIGHTED, unet_patch.NORM_WEIGHTED = sized, normed
        try:
            psnr, ssim = metrics.psnr_ssim(ref, pixels(patched))
        finally:
            unet_patch.SIZE_WEIGHTED = unet_patch.NORM_WEIGHTED = True
        rows.append({"model": layout, "scope": scope, "ratio": r, "size_weighted": sized,
                     "norm_weighted": normed, "psnr": psnr, "ssim": ssim})
        logging.warning("%s %s r%s sized=%s normed=%s: %.2f dB", layout, scope, r, sized,
                        normed, psnr)
    return rows


def report(result: dict) -> str:
    cfg = result["config"]
    lines = ["# Norm-weighted destinations on the trained UNet fixtures", "",
             f"commit {cfg['commit']}, `{cfg['command']}`, ComfyUI {cfg['comfyui']}, "
             f"{result['machine'].get('cpu')}, {cfg['threads']} thread(s)", "",
             "PSNR / SSIM of the decoded samples against unmerged (the quality section's "
             "sampling: 10 euler steps, its labels and seed); norm off: facility location "
             "unweighted, on: each token's coverage weighted by its squared norm", "",
             "| fixture | scope | r | size-weighted | PSNR norm off | PSNR norm on | "
             "SSIM norm off | SSIM norm on |", "|---|---|---|---|---|---|---|---|"]
    rows = result["rows"]
    for off, on in zip(rows[::2], rows[1::2], strict=True):
        lines.append(f"| {off['model']} | {off['scope']} | {off['ratio']} | "
                     f"{'on' if off['size_weighted'] else 'off'} | {off['psnr']:.2f} | "
                     f"{on['psnr']:.2f} | {off['ssim']:.3f} | {on['ssim']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.quality.norm_weighting")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--scopes", nargs="+", default=["block"])
    parser.add_argument("--ratios", nargs="+", type=float, default=[0.25, 0.5])
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
                         "command": " ".join(["python -m bench.quality.norm_weighting",
                                              *(sys.argv[1:] if argv is None else argv)])},
              "rows": rows}
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / (
        f"{datetime.date.today().isoformat()}-cpu-quality-norm-weighting.json")
    text = report(result)
    write_result(out, result, text)
    print(text)


if __name__ == "__main__":
    main()
