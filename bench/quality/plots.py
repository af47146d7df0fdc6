"""PNG figures of the quality section, drawn with Pillow (matplotlib is not a dependency):
a speed-quality frontier (two panels: PSNR vs unmerged and KID, against speedup) and a
side-by-side picture grid."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from PIL import Image, ImageDraw

COLOURS = {"unmerged": (0, 0, 0), "toma": (200, 30, 30), "tomesd": (30, 90, 200),
           "todo": (20, 150, 60), "easycache": (200, 130, 0)}
GRID_COLUMNS = ("unmerged", "ToMA defaults", "ToMeSD attention r0.5", "ToDo 2x2")
PANEL = (420, 300)
MARGIN = 50


def _panel(draw: ImageDraw.ImageDraw, origin: tuple[int, int], rows: list[dict], key: str,
           label: str, higher_better: bool) -> None:
    x0, y0 = origin
    w, h = PANEL
    pts = [(r["speedup"], r[key], r) for r in rows if r.get(key) is not None
           and math.isfinite(r[key])]
    if not pts:
        return
    xs = [p[0] for p in pts] + [1.0]
    ys = [p[1] for p in pts]
    xlo, xhi = min(xs) * 0.95, max(xs) * 1.05
    ylo, yhi = min(ys), max(ys)
    pad = (yhi - ylo) * 0.08 or 1.0
    ylo, yhi = ylo - pad, yhi + pad

    def at(x: float, y: float) -> tuple[float, float]:
        return (x0 + (x - xlo) / (xhi - xlo) * w, y0 + h - (y - ylo) / (yhi - ylo) * h)

    draw.rectangle([x0, y0, x0 + w, y0 + h], outline=(120, 120, 120))
    for i in range(5):
        xv = xlo + (xhi - xlo) * i / 4
        yv = ylo + (yhi - ylo) * i / 4
        px, _ = at(xv, ylo)
        _, py = at(xlo, yv)
        draw.text((px - 12, y0 + h + 4), f"{xv:.2f}", fill=(60, 60, 60))
        draw.text((x0 - 44, py - 6), f"{yv:.3g}", fill=(60, 60, 60))
    draw.text((x0 + w // 2 - 60, y0 + h + 20), "speedup over unmerged (x)", fill=(0, 0, 0))
    draw.text((x0, y0 - 16), label + (" (higher is better)" if higher_better
                                      else " (lower is better)"), fill=(0, 0, 0))
    for x, y, r in pts:
        px, py = at(x, y)
        colour = COLOURS.get(r["method"], (100, 100, 100))
        size = 5 if r["variant"] == "ToMA defaults" else 3
        draw.ellipse([px - size, py - size, px + size, py + size], fill=colour)
        draw.text((px + 5, py - 5), r["variant"].replace("ToMA ", "").replace("attention", "att"),
                  fill=colour)


def frontier(rows: list[dict], path: Path, title: str) -> None:
    """Speed vs PSNR (vs the unmerged samples) and speed vs KID, one point per variant."""
    shown = [r for r in rows if r["method"] != "unmerged"]
    width = 2 * PANEL[0] + 3 * MARGIN + 60
    height = PANEL[1] + 2 * MARGIN + 60
    img = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(img)
    draw.text((MARGIN, 8), f"Speed vs quality, {title} (ToMA red, ToMeSD blue, ToDo green, "
                           "EasyCache orange)", fill=(0, 0, 0))
    _panel(draw, (MARGIN + 40, MARGIN), shown, "psnr", "PSNR vs unmerged samples, dB", True)
    _panel(draw, (2 * MARGIN + PANEL[0] + 80, MARGIN), shown, "mmd",
           "MMD^2 x1000 vs unmerged (mid-block features)", False)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)


def grid(pixels: dict[str, torch.Tensor], path: Path, columns: tuple[str, ...] = GRID_COLUMNS,
         scale: int = 2) -> None:
    """Images side by side: one column per variant (uint8 [B, H, W, 3] each), one row per
    seed, labelled; upscaled `scale` x (nearest) so the pixels are visible."""
    columns = tuple(c for c in columns if c in pixels)
    b, h, w, _ = pixels[columns[0]].shape
    cw, ch = w * scale, h * scale
    img = Image.new("RGB", (len(columns) * (cw + 6) + 6, b * (ch + 6) + 26), "white")
    draw = ImageDraw.Draw(img)
    for j, name in enumerate(columns):
        draw.text((6 + j * (cw + 6), 6), name, fill=(0, 0, 0))
        for i in range(b):
            tile = Image.fromarray(pixels[name][i].numpy()).resize((cw, ch), Image.NEAREST)
            img.paste(tile, (6 + j * (cw + 6), 22 + i * (ch + 6)))
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
