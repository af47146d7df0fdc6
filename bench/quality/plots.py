"""PNG figures of the quality section, drawn with Pillow (matplotlib is not a dependency):
a speed-quality frontier (two panels: PSNR vs unmerged and KID, against speedup), the sampler
sweep's frontiers (one panel per sampler and cfg) and a side-by-side picture grid."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from PIL import Image, ImageDraw

COLOURS = {"unmerged": (0, 0, 0), "toma": (200, 30, 30), "tomesd": (30, 90, 200),
           "todo": (20, 150, 60), "easycache": (200, 130, 0),
           # bench/quality/few_steps.py's caches, alone and after ToMA
           "EasyCache": (200, 130, 0), "First Block Cache": (130, 60, 170),
           "MagCache": (0, 140, 140), "toma+EasyCache": (110, 20, 20),
           "toma+First Block Cache": (90, 30, 110), "toma+MagCache": (0, 80, 80)}
GRID_COLUMNS = ("unmerged", "ToMA defaults", "ToMeSD attention r0.5", "ToDo 2x2")
PANEL = (420, 300)
MARGIN = 50


def _panel(draw: ImageDraw.ImageDraw, origin: tuple[int, int], rows: list[dict], key: str,
           label: str, higher_better: bool) -> list[tuple[float, ...]]:
    """One scatter panel of `key` against speedup; the label boxes it drew (left, top, right,
    bottom). A variant whose samples equal the unmerged ones (PSNR infinite: EasyCache where it
    skips no step) sits on the panel's top edge, labelled so."""
    x0, y0 = origin
    w, h = PANEL
    pts = [(r["speedup"], r[key], r) for r in rows if r.get(key) is not None
           and not math.isnan(r[key])]
    finite = [y for _, y, _ in pts if math.isfinite(y)]
    if not finite:
        return []
    xs = [p[0] for p in pts] + [1.0]
    xlo, xhi = min(xs) * 0.95, max(xs) * 1.05
    ylo, yhi = min(finite), max(finite)
    pad = (yhi - ylo) * 0.08 or 1.0
    ylo, yhi = ylo - pad, yhi + pad
    identical = {id(r) for _, y, r in pts if math.isinf(y)}
    pts = [(x, yhi if math.isinf(y) else y, r) for x, y, r in pts]

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
    anchors = [at(x, y) for x, y, _ in pts]
    texts = [r["variant"].replace("ToMA ", "").replace("attention", "att")
             + (" (= unmerged)" if id(r) in identical else "") for *_, r in pts]
    sizes = [_text_size(draw, t) for t in texts]
    boxes = place_labels(anchors, sizes, (x0, y0, x0 + w, y0 + h))
    for (px, py), (*_, r), text, box in zip(anchors, pts, texts, boxes, strict=True):
        colour = COLOURS.get(r["method"], (100, 100, 100))
        size = 5 if r["variant"] == "ToMA defaults" else 3
        draw.ellipse([px - size, py - size, px + size, py + size], fill=colour)
        if math.dist((px, py), _nearest(box, (px, py))) > LEADER:
            draw.line([(px, py), _nearest(box, (px, py))], fill=(170, 170, 170))
        draw.text((box[0], box[1]), text, fill=colour)
    return boxes


LEADER = 10          # a label farther than this from its point gets a line to it


def _text_size(draw: ImageDraw.ImageDraw, text: str) -> tuple[float, float]:
    left, top, right, bottom = draw.textbbox((0, 0), text)
    return right - left, bottom - top


def _nearest(box: tuple[float, float, float, float],
             p: tuple[float, float]) -> tuple[float, float]:
    return min(max(p[0], box[0]), box[2]), min(max(p[1], box[1]), box[3])


def _overlap(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def place_labels(anchors: list[tuple[float, float]], sizes: list[tuple[float, float]],
                 bounds: tuple[float, float, float, float]) -> list[tuple[float, ...]]:
    """A box (left, top, right, bottom) per label, none overlapping another label or a point
    (greedy: each label takes the first free spot on rings of growing distance around its
    point, inside `bounds`; the most crowded points are placed first). A label with no free
    spot within 104 pixels goes right of its point."""
    points = [(x - 4, y - 4, x + 4, y + 4) for x, y in anchors]
    placed: dict[int, tuple[float, ...]] = {}

    def crowd(i: int) -> int:
        return -sum(math.dist(anchors[i], a) < 40 for a in anchors)

    for i in sorted(range(len(anchors)), key=crowd):
        (x, y), (w, h) = anchors[i], sizes[i]
        best = None
        for radius in (6, 14, 24, 36, 50, 66, 84, 104):
            for k in range(16):
                angle = 2 * math.pi * k / 16
                cx, cy = x + math.cos(angle) * (radius + w / 2), y + math.sin(angle) * (
                    radius + h / 2)
                box = (cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2)
                inside = (box[0] >= bounds[0] and box[2] <= bounds[2]
                          and box[1] >= bounds[1] and box[3] <= bounds[3])
                if inside and not any(_overlap(box, o) for o in [*placed.values(), *points]):
                    best = box
                    break
            if best is not None:
                break
        placed[i] = best or (x + 6, y - h / 2, x + 6 + w, y + h / 2)
    return [placed[i] for i in range(len(anchors))]


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


def sampler_frontiers(rows: list[dict], path: Path,
                      title: str) -> list[list[tuple[float, ...]]]:
    """A sampler sweep's rows (bench/quality/samplers.py, one fixture) as a grid of panels,
    a row per sampler and a column per cfg: PSNR vs the unmerged samples of that sampler and
    cfg against speedup, one point per variant. The noise floor is named in each panel's title
    rather than drawn (at a typical cfg it sits far below every method and would squash the
    axis). Returns each panel's label boxes."""
    samplers = list(dict.fromkeys(r["sampler"] for r in rows))
    cfgs = list(dict.fromkeys(r["cfg"] for r in rows))
    cell_w, cell_h = PANEL[0] + MARGIN + 60, PANEL[1] + MARGIN + 30
    img = Image.new("RGB", (len(cfgs) * cell_w + MARGIN, len(samplers) * cell_h + 40), "white")
    draw = ImageDraw.Draw(img)
    draw.text((MARGIN, 8), f"Speed vs PSNR vs unmerged (dB), {title} (ToMA red, ToMeSD blue, "
                           "ToDo green, EasyCache orange)", fill=(0, 0, 0))
    boxes = []
    for i, sampler in enumerate(samplers):
        for j, cfg in enumerate(cfgs):
            own = [r for r in rows if r["sampler"] == sampler and r["cfg"] == cfg]
            floor = [r["psnr"] for r in own if r["method"] == "noise"]
            shown = [r for r in own if r["method"] not in ("unmerged", "noise")]
            label = f"{sampler}, cfg {cfg:g}" + (f", noise floor {floor[0]:.3g}" if floor
                                                 else "")
            boxes.append(_panel(draw, (MARGIN + 40 + j * cell_w, MARGIN + 10 + i * cell_h),
                                shown, "psnr", label, True))
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return boxes


def few_steps_figure(rows: list[dict], path: Path) -> None:
    """bench/quality/few_steps.py's rows of one fixture: a panel per part, step count and
    sampler, PSNR vs the unmerged samples against speedup, one point per variant."""
    groups = list(dict.fromkeys((r["part"], r["steps"], r["sampler"]) for r in rows))
    columns = 3
    cell_w, cell_h = PANEL[0] + MARGIN + 60, PANEL[1] + MARGIN + 30
    lines = -(-len(groups) // columns)
    img = Image.new("RGB", (columns * cell_w + MARGIN, lines * cell_h + 40), "white")
    draw = ImageDraw.Draw(img)
    draw.text((MARGIN, 8), f"Speed vs PSNR vs unmerged (dB), {rows[0]['model']}-layout fixture, "
                           "cfg 1 (ToMA red, EasyCache orange, First Block Cache purple, "
                           "MagCache teal; after ToMA: darker)", fill=(0, 0, 0))
    for k, (part, steps, sampler) in enumerate(groups):
        own = [r for r in rows if (r["part"], r["steps"], r["sampler"]) == (part, steps, sampler)
               and r["method"] != "unmerged"]
        i, j = divmod(k, columns)
        _panel(draw, (MARGIN + 40 + j * cell_w, MARGIN + 10 + i * cell_h), own, "psnr",
               f"{steps} steps, {sampler}", True)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)


def sweep_figures(rows: list[dict], denoise: float, docs: Path) -> list[Path]:
    """Each fixture's sampler_frontiers of a sweep's rows, written to
    docs/quality-samplers-<layout>[-img2img].png; the paths written."""
    start = f"image-to-image at denoise {denoise:g}" if denoise < 1 else "from an empty latent"
    paths = []
    for layout in dict.fromkeys(r["model"] for r in rows):
        path = docs / f"quality-samplers-{layout}{'-img2img' if denoise < 1 else ''}.png"
        sampler_frontiers([r for r in rows if r["model"] == layout], path,
                          f"{layout}-layout fixture, {start}")
        paths.append(path)
    return paths


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


def main(argv: list[str] | None = None) -> None:
    """`python -m bench.quality.plots RESULT.json`: redraw docs/quality-frontier-<layout>.png
    from a quality section's result file, or docs/quality-samplers-<layout>[-img2img].png from
    a sampler sweep's (its rows, nothing re-measured)."""
    import argparse
    import json

    from ..shared.config import ROOT
    from . import models as qm

    parser = argparse.ArgumentParser(prog="python -m bench.quality.plots")
    parser.add_argument("result", type=Path)
    args = parser.parse_args(argv)
    result = json.loads(args.result.read_text())
    if "sections" not in result:
        for path in sweep_figures(result["rows"], result["config"].get("denoise", 1.0),
                                  ROOT / "docs"):
            print(f"wrote {path}")
        return
    rows = result["sections"]["quality"]["rows"]
    runs = len(result.get("combined_from", [])) or 1
    for layout in dict.fromkeys(r["model"] for r in rows):
        pixels = qm.EVAL_LATENT[layout] * qm.latent_per_pixel(layout)
        title = f"{layout}-layout fixture, {pixels}px" + (
            f", median of {runs} runs" if runs > 1 else "")
        path = ROOT / "docs" / f"quality-frontier-{layout}.png"
        frontier([r for r in rows if r["model"] == layout], path, title)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
