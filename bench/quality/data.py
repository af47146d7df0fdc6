"""Photographs for the trained quality fixtures: which ones, their licences, crops, and the fixed
maps between RGB pixels and the models' latents.

Sources (both installable here, nothing downloaded at run time):
- scikit-image's bundled data set (in requirements-dev.txt): astronaut (NASA, public domain),
  coffee (Rachel Michetti, CC0), chelsea (Stefan van der Walt, CC0), rocket (SpaceX, public
  domain / CC0), as their docstrings say.
- Debian's `mate-backgrounds` package (`apt-get install mate-backgrounds`), folder
  /usr/share/backgrounds/mate/nature/: 12 nature photographs, GPL-2+ per the package's
  debian/copyright (compatible with this project's GPL-3.0-or-later; the photographs are not
  committed, only weights trained on them).

Held out (never trained on; the held-out denoising loss uses them): HELD_OUT.

The "latents" are pixel-space stand-ins for a VAE (none can be downloaded here), fixed linear
maps with exact pseudo-inverses:
- SDXL layout, 4 channels at full pixel resolution: (R, G, B, luma) centred;
- Flux layout, 16 channels at half resolution: each 2x2 pixel block's 12 RGB values, plus the
  block's 4 luma values. Flux's 2x2 patchify then makes one token per 4x4 pixels.
Both are scaled so that the model-space data (after the model's own latent_format.process_in)
has roughly unit variance, like real SD/Flux latents.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

SKIMAGE_PHOTOS = ("astronaut", "coffee", "chelsea", "rocket")
MATE_DIR = Path("/usr/share/backgrounds/mate/nature")
MATE_PHOTOS = ("Aqua", "Blinds", "Dune", "FreshFlower", "Garden", "GreenMeadow", "LadyBird",
               "RainDrops", "Storm", "TwoWings", "Wood", "YellowFlower")
HELD_OUT = ("rocket", "Storm", "YellowFlower")
LICENCES = {**{n: "scikit-image data (public domain / CC0)" for n in SKIMAGE_PHOTOS},
            **{n: "Debian mate-backgrounds, GPL-2+" for n in MATE_PHOTOS}}
# Short side of every photograph after resizing: a 128-pixel crop then shows a good part of the
# scene (objects, horizon), not just texture.
SHORT_SIDE = 192
# Pixel values in [-1, 1] have std ~0.5; this brings the latents near unit variance.
PIXEL_GAIN = 2.0


def all_photos() -> tuple[str, ...]:
    """Every photograph name, scikit-image's first (fixed order: class ids depend on it)."""
    return SKIMAGE_PHOTOS + MATE_PHOTOS


def train_photos() -> tuple[str, ...]:
    """The photographs trained on; their index here is the class label."""
    return tuple(n for n in all_photos() if n not in HELD_OUT)


def missing_sources() -> list[str]:
    """What is not installed (empty when every photograph can be read)."""
    missing = []
    try:
        import skimage.data  # noqa: F401
    except ImportError:
        missing.append("scikit-image (pip install scikit-image)")
    if not all((MATE_DIR / f"{n}.jpg").is_file() for n in MATE_PHOTOS):
        missing.append(f"Debian package mate-backgrounds ({MATE_DIR})")
    return missing


def load_photo(name: str) -> torch.Tensor:
    """Photograph `name` as float RGB [3, H, W] in [-1, 1], short side SHORT_SIDE."""
    if name in SKIMAGE_PHOTOS:
        from skimage import data

        array = getattr(data, name)()
    elif name in MATE_PHOTOS:
        from skimage import io

        path = MATE_DIR / f"{name}.jpg"
        if not path.is_file():
            raise FileNotFoundError(f"{path} missing: apt-get install mate-backgrounds")
        array = io.imread(path)
    else:
        raise ValueError(f"unknown photograph {name!r}; known: {', '.join(all_photos())}")
    img = torch.from_numpy(array[..., :3].copy()).float().permute(2, 0, 1) / 127.5 - 1.0
    h, w = img.shape[-2:]
    scale = SHORT_SIDE / min(h, w)
    size = (max(SHORT_SIDE, round(h * scale)), max(SHORT_SIDE, round(w * scale)))
    return F.interpolate(img[None], size=size, mode="bilinear", antialias=True,
                         align_corners=False)[0].clamp(-1, 1)


@dataclass
class PhotoSet:
    """Loaded photographs with a class label each (-1: held out / unconditional)."""

    images: list[torch.Tensor]
    labels: list[int]
    names: list[str]

    def crops(self, count: int, size: int, generator: torch.Generator,
              flip: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """`count` random size x size crops: (pixels [count, 3, size, size], labels [count]).

        Photographs are drawn uniformly, then a uniform crop position, then a random
        horizontal flip (training only)."""
        picks = torch.randint(len(self.images), (count,), generator=generator).tolist()
        out, labels = [], []
        for i in picks:
            img = self.images[i]
            h, w = img.shape[-2:]
            y = int(torch.randint(h - size + 1, (1,), generator=generator))
            x = int(torch.randint(w - size + 1, (1,), generator=generator))
            crop = img[:, y:y + size, x:x + size]
            if flip and bool(torch.rand((), generator=generator) < 0.5):
                crop = crop.flip(-1)
            out.append(crop)
            labels.append(self.labels[i])
        return torch.stack(out), torch.tensor(labels)

    def fixed_crops(self, size: int, per_photo: int,
                    seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A deterministic evaluation set: `per_photo` crops of each photograph, no flips."""
        g = torch.Generator().manual_seed(seed)
        pix, labels = [], []
        for img, label in zip(self.images, self.labels, strict=True):
            one = PhotoSet([img], [label], [])
            p, lab = one.crops(per_photo, size, g, flip=False)
            pix.append(p)
            labels.append(lab)
        return torch.cat(pix), torch.cat(labels)


def load_set(names: tuple[str, ...], labelled: bool) -> PhotoSet:
    """The photographs `names`; labels are their index in `names` if labelled, else -1."""
    images = [load_photo(n) for n in names]
    labels = list(range(len(names))) if labelled else [-1] * len(names)
    return PhotoSet(images, labels, list(names))


# Pixel <-> latent maps ---------------------------------------------------------------------------
_LUMA = torch.tensor([0.299, 0.587, 0.114])


def _sdxl_matrix() -> torch.Tensor:
    """[4, 3]: R, G, B and luma."""
    return torch.cat([torch.eye(3), _LUMA[None]]) * PIXEL_GAIN


def _flux_matrix() -> torch.Tensor:
    """[16, 12] on a 2x2 block's values ordered (channel, dy, dx): 12 RGB values + 4 lumas."""
    luma = torch.zeros(4, 12)
    for p in range(4):
        for c in range(3):
            luma[p, c * 4 + p] = _LUMA[c]
    return torch.cat([torch.eye(12), luma]) * PIXEL_GAIN


def pixels_to_model_space(pixels: torch.Tensor, layout: str) -> torch.Tensor:
    """RGB [B, 3, H, W] in [-1, 1] -> model-space latent: sdxl [B, 4, H, W], flux
    [B, 16, H/2, W/2] (H, W even)."""
    if layout == "sdxl":
        return torch.einsum("oc,bchw->bohw", _sdxl_matrix(), pixels)
    if layout == "flux":
        blocks = F.pixel_unshuffle(pixels, 2)          # [B, 12, H/2, W/2], (c, dy, dx) order
        return torch.einsum("oc,bchw->bohw", _flux_matrix(), blocks)
    raise ValueError(f"layout must be 'sdxl' or 'flux', got {layout!r}")


def model_space_to_pixels(latent: torch.Tensor, layout: str) -> torch.Tensor:
    """Inverse of pixels_to_model_space (least squares), clamped to [-1, 1]: [B, 3, H, W]."""
    if layout == "sdxl":
        return torch.einsum("co,bohw->bchw", torch.linalg.pinv(_sdxl_matrix()), latent).clamp(-1, 1)
    if layout == "flux":
        blocks = torch.einsum("co,bohw->bchw", torch.linalg.pinv(_flux_matrix()), latent)
        return F.pixel_shuffle(blocks, 2).clamp(-1, 1)
    raise ValueError(f"layout must be 'sdxl' or 'flux', got {layout!r}")


def to_uint8(pixels: torch.Tensor) -> torch.Tensor:
    """[B, 3, H, W] in [-1, 1] -> uint8 [B, H, W, 3] (for PNGs and the metrics)."""
    return ((pixels.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1)
