"""python -m bench.quality.norm_weighting: norm-weighted destinations (facility location with
each token's coverage counted by its squared norm) on the trained UNet fixtures, off and on,
size-weighted attention on (the pack's default) and off, against unmerged.

The quality section's sampling and measures, as bench/quality/size_weighting.py. Writes
bench/results/<date>-cpu-quality-norm-weighting.json and .md.
"""

from __future__ import annotations

import itertools
import logging

import torch

from ..shared.config import load_pack
from . import data, metrics, section
from . import models as qm
from .size_weighting import study_main


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
    study_main("norm_weighting", measure, report, ["block"], [0.25, 0.5], argv)

if __name__ == "__main__":
    main()
