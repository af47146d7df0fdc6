"""Fidelity proxy: how far each method moves a block's output, on photographs' token grids.

For SDXL's two levels (64x64 x 640, 32x32 x 1280), each photograph (photos.PHOTOS; two in quick
mode) becomes the block input x [B, N, C]; every method (ToMA in both scopes at each ratio and at
tile counts 16 / 64 / 256, ToMeSD in both scopes, ToDo) runs the same random-weight block as in
unet_blocks, and its output y is compared with the unmerged output y0:

    err = |y - y0| / |y0|,  err_update = |y - y0| / |y0 - x|,  cos = mean per-token cos(y, y0)

averaged over the photographs (err_max: the worst one). `pareto` joins these errors with the
unet section's speedups (plan share included) and marks the methods no other method beats on
both speed and error.
"""

from __future__ import annotations

import logging
import statistics
from typing import Any

import torch

from ..shared.config import BenchConfig
from ..shared.photos import PHOTOS
from .reference_blocks import SDXL_LEVELS
from .unet_blocks import (
    RATIOS,
    TILE_COUNTS,
    UNPATCHED,
    LevelBench,
    Variant,
    output_errors,
    variants,
)

log = logging.getLogger(__name__)

COLUMNS = ("level", "method", "scope", "ratio", "tiles", "err", "err_max", "err_update", "cos")
PARETO_COLUMNS = ("level", "method", "scope", "ratio", "tiles", "speedup", "err", "cos",
                  "pareto")


def run(cfg: BenchConfig) -> dict[str, Any]:
    """Rows: mean errors per level and method over the photographs."""
    photos = PHOTOS[:2] if cfg.quick else PHOTOS
    ratios = (0.5,) if cfg.quick else RATIOS
    vs = [v for v in variants(ratios, TILE_COUNTS, lower_bounds=False) if v != UNPATCHED]
    rows = []
    for level in SDXL_LEVELS:
        bench = LevelBench(level, cfg)
        found: dict[Variant, list[dict[str, float]]] = {v: [] for v in vs}
        for photo in photos:
            log.info("fidelity %s %s", level.name, photo)
            x = bench.tokens_of(photo)
            with torch.inference_mode():
                ref = bench.prepare(UNPATCHED, x).call()
                for v in vs:
                    found[v].append(output_errors(bench.prepare(v, x).call(), ref, x))
        for v, errs in found.items():
            rows.append({"level": level.name, "method": v.method, "scope": v.scope,
                         "ratio": v.ratio, "tiles": v.tiles,
                         "err": statistics.mean(e["err"] for e in errs),
                         "err_max": max(e["err"] for e in errs),
                         "err_update": statistics.mean(e["err_update"] for e in errs),
                         "cos": statistics.mean(e["cos"] for e in errs)})
    notes = [f"photographs: {', '.join(photos)}; random-weight blocks, so errors rank methods, "
             "they do not predict image quality"]
    return {"rows": rows, "notes": notes}


def _key(row: dict[str, Any]) -> tuple:
    return (row["level"], row["method"], row.get("scope"), row.get("ratio"), row.get("tiles"))


def pareto(unet_rows: list[dict[str, Any]], fidelity_rows: list[dict[str, Any]]
           ) -> list[dict[str, Any]]:
    """Speed (unet section, plan share included) against error (this section) per level;
    pareto True when no other method is at least as fast and as accurate, and better in one."""
    speed = {_key(r): r["speedup"] for r in unet_rows if "speedup" in r}
    out = []
    for level in sorted({r["level"] for r in fidelity_rows}):
        points = [{"level": level, "method": "unpatched", "speedup": 1.0, "err": 0.0, "cos": 1.0}]
        for r in fidelity_rows:
            if r["level"] == level and _key(r) in speed:
                points.append({**{k: r.get(k) for k in ("level", "method", "scope", "ratio",
                                                         "tiles", "err", "cos")},
                               "speedup": speed[_key(r)]})
        for p in points:
            p["pareto"] = not any(
                q is not p and q["speedup"] >= p["speedup"] and q["err"] <= p["err"]
                and (q["speedup"] > p["speedup"] or q["err"] < p["err"]) for q in points)
        out += sorted(points, key=lambda p: -p["speedup"])
    return out
