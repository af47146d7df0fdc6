"""Natural photographs as hidden-state-like token grids (the fidelity benchmark's inputs).

A random-weight block sees no real latent, so its inputs borrow the statistics of real images:
a photograph from scikit-image is cropped square, resized to side * p pixels (p = 512 // side),
cut into p x p patches, and each patch becomes one token through a fixed, seeded random linear
projection of its mean-centred pixels (3 p^2 -> C), scaled to unit variance, plus a little seeded
white noise, then layer-normalised over channels like a hidden state:

    image [3, H, W] -> tokens [1, side * side, C]      (row-major, like a flattened feature map)

Neighbouring tokens of smooth regions are similar, edges and textures are not: the similarity
structure token merging feeds on. Without scikit-image a smooth random field stands in.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket")
NOISE = 0.1


def _image(name: str) -> torch.Tensor | None:
    """skimage.data.<name>() as float RGB [3, H, W] in [0, 1], or None without scikit-image."""
    try:
        from skimage import data
    except ImportError:
        log.warning("scikit-image not installed: smooth random fields replace the photographs")
        return None
    img = torch.from_numpy(getattr(data, name)()).float() / 255.0
    if img.dim() == 2:
        img = img.unsqueeze(-1).expand(-1, -1, 3)
    return img[..., :3].permute(2, 0, 1).contiguous()


def _smooth_field(side: int, seed: int) -> torch.Tensor:
    """Fallback image [3, side * 8, side * 8]: bilinear-upsampled 8 x 8 noise."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(1, 3, 8, 8, generator=g)
    return F.interpolate(coarse, size=(side * 8, side * 8), mode="bilinear")[0]


def photo_tokens(name: str, side: int, channels: int, seed: int = 0) -> torch.Tensor:
    """Photograph `name` as a side x side grid of `channels`-wide tokens: [1, side^2, C], fp32."""
    img = _image(name)
    if img is None:
        img = _smooth_field(side, seed + sum(map(ord, name)))
    _, h, w = img.shape
    s = min(h, w)
    img = img[:, (h - s) // 2:(h - s) // 2 + s, (w - s) // 2:(w - s) // 2 + s]
    p = max(1, 512 // side)
    img = F.interpolate(img[None], size=(side * p, side * p), mode="bilinear", antialias=True,
                        align_corners=False)[0]
    img = img - img.mean(dim=(1, 2), keepdim=True)
    patches = img.unfold(1, p, p).unfold(2, p, p)                   # [3, side, side, p, p]
    patches = patches.permute(1, 2, 0, 3, 4).reshape(side * side, 3 * p * p)
    g = torch.Generator().manual_seed(seed * 1000 + channels)      # same projection per width
    proj = torch.randn(3 * p * p, channels, generator=g)
    tokens = patches @ proj
    tokens = tokens / tokens.std().clamp_min(1e-6)
    noise = torch.Generator().manual_seed(seed * 1000 + channels + 1 + sum(map(ord, name)))
    tokens = tokens + NOISE * torch.randn(tokens.shape, generator=noise)
    return F.layer_norm(tokens, (channels,))[None]
