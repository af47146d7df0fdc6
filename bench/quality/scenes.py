"""Procedurally rendered training scenes: hard-edged shapes, thin lines, glyphs and short words.

Photographs show what a merge does to texture; these show what artists notice first: broken
edges, smeared small text, lost thin lines. Each scene is one object of a known class (CLASSES)
on a two-tone background, sometimes crossed by a 1-pixel distractor line, so that a sample's
class can be read back by a small recogniser (bench/quality/recognise.py).

Deterministic: scene `index` of stream `seed` is drawn from numpy's generator seeded with
(seed, index) and nothing else. Glyphs use DejaVu Sans Bold from Debian's `fonts-dejavu-core`
(apt-get install fonts-dejavu-core; the Bitstream Vera licence allows this use).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

FONT = Path("/usr/share/fonts/truetype/dejavu/DejaVuSans-Bold.ttf")
SHAPES = ("disc", "square", "triangle", "ring", "cross", "bars")
GLYPHS = ("A", "E", "K", "R", "S", "OK")
CLASSES = SHAPES + GLYPHS
SUPERSAMPLE = 4          # drawn at 4x, then box-filtered down: clean anti-aliased edges
MIN_CONTRAST = 0.35      # luma difference between object and background, in [0, 1]
_LUMA = np.array([0.299, 0.587, 0.114])


def missing_sources() -> list[str]:
    """What is not installed (empty when scenes can be rendered)."""
    return [] if FONT.is_file() else [f"Debian package fonts-dejavu-core ({FONT})"]


def _colours(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Background, second background tone and object colour (RGB in [0, 1]); the object
    contrasts with the background by at least MIN_CONTRAST in luma."""
    while True:
        bg, fg = rng.uniform(0, 1, 3), rng.uniform(0, 1, 3)
        if abs(float(_LUMA @ (fg - bg))) >= MIN_CONTRAST:
            break
    bg2 = np.clip(bg + rng.uniform(-0.15, 0.15, 3), 0, 1)
    return bg, bg2, fg


def _background(rng: np.random.Generator, big: int, bg: np.ndarray,
                bg2: np.ndarray) -> np.ndarray:
    """[big, big, 3] linear blend from bg to bg2 along a random direction."""
    angle = rng.uniform(0, 2 * math.pi)
    yy, xx = np.mgrid[0:big, 0:big] / (big - 1) - 0.5
    t = np.clip(0.5 + xx * math.cos(angle) + yy * math.sin(angle), 0, 1)[..., None]
    return bg * (1 - t) + bg2 * t


def _shape_mask(name: str, big: int, size: float) -> Image.Image:
    """An 'L' mask [big, big] of the object centred, `size` pixels across (at supersampling)."""
    mask = Image.new("L", (big, big), 0)
    draw = ImageDraw.Draw(mask)
    c, r = big / 2, size / 2
    if name == "disc":
        draw.ellipse([c - r, c - r, c + r, c + r], fill=255)
    elif name == "square":
        s = r * 0.85
        draw.rectangle([c - s, c - s, c + s, c + s], fill=255)
    elif name == "triangle":
        draw.polygon([(c, c - r), (c + r * 0.95, c + r * 0.75), (c - r * 0.95, c + r * 0.75)],
                     fill=255)
    elif name == "ring":
        draw.ellipse([c - r, c - r, c + r, c + r], outline=255, width=max(1, round(size * 0.12)))
    elif name == "cross":
        w = max(1, round(size * 0.07))
        draw.line([(c - r, c), (c + r, c)], fill=255, width=w)
        draw.line([(c, c - r), (c, c + r)], fill=255, width=w)
    elif name == "bars":
        w = max(1, round(size * 0.07))
        for dy in (-0.6, 0.0, 0.6):
            draw.line([(c - r, c + dy * r), (c + r, c + dy * r)], fill=255, width=w)
    else:                                                     # a glyph or a word
        font = ImageFont.truetype(str(FONT), size=max(4, round(size / (0.6 * len(name) + 0.4))))
        draw.text((c, c), name, fill=255, font=font, anchor="mm")
    return mask


def render(class_id: int, side: int, seed: int, index: int) -> torch.Tensor:
    """Scene `index` of stream `seed`: RGB [3, side, side] in [-1, 1] showing CLASSES[class_id]."""
    if not 0 <= class_id < len(CLASSES):
        raise ValueError(f"class_id must be in [0, {len(CLASSES)}), got {class_id}")
    rng = np.random.default_rng([seed, index])
    big = side * SUPERSAMPLE
    bg, bg2, fg = _colours(rng)
    canvas = _background(rng, big, bg, bg2)
    if rng.uniform() < 0.5:                                   # a thin distractor line
        line = Image.new("L", (big, big), 0)
        a, b = rng.uniform(0, big, 2)
        ends = [(a, 0), (b, big)] if rng.uniform() < 0.5 else [(0, a), (big, b)]
        ImageDraw.Draw(line).line(ends, fill=255, width=SUPERSAMPLE)
        tone = np.clip(bg + rng.choice([-1, 1]) * 0.25, 0, 1)
        a = np.asarray(line, dtype=np.float64)[..., None] / 255
        canvas = canvas * (1 - a) + tone * a
    size = rng.uniform(0.5, 0.8) * big
    mask = _shape_mask(CLASSES[class_id], big, size)
    mask = mask.rotate(rng.uniform(-20, 20), resample=Image.BILINEAR,
                       translate=tuple(rng.uniform(-0.12, 0.12, 2) * big))
    a = np.asarray(mask, dtype=np.float64)[..., None] / 255
    canvas = canvas * (1 - a) + fg * a
    image = Image.fromarray((canvas * 255).round().astype(np.uint8)).resize((side, side),
                                                                              Image.BOX)
    return torch.from_numpy(np.asarray(image).copy()).float().permute(2, 0, 1) / 127.5 - 1.0


def batch(class_ids: list[int], side: int, seed: int, start: int) -> torch.Tensor:
    """Scenes start, start + 1, ... of stream `seed`, one per class id: [n, 3, side, side]."""
    return torch.stack([render(c, side, seed, start + i) for i, c in enumerate(class_ids)])


def fixed_set(side: int, per_class: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic evaluation set: `per_class` scenes of every class, class-major order:
    (pixels [n, 3, side, side], class ids [n])."""
    ids = [c for c in range(len(CLASSES)) for _ in range(per_class)]
    return batch(ids, side, seed, 0), torch.tensor(ids)
