"""Quality metrics of the quality section: sample fidelity (PSNR, SSIM, via scikit-image) and a
distribution distance (MMD with KID's kernel) between sets of feature vectors. Plain functions
on tensors."""

from __future__ import annotations

import torch


def psnr_ssim(reference: torch.Tensor, images: torch.Tensor) -> tuple[float, float]:
    """Mean PSNR (dB) and SSIM of images against reference, uint8 [B, H, W, 3] each, pairwise
    (same seed, same index). Identical images give PSNR inf and SSIM 1."""
    from skimage.metrics import peak_signal_noise_ratio, structural_similarity

    if reference.shape != images.shape or {reference.dtype, images.dtype} != {torch.uint8}:
        raise ValueError(f"expected two uint8 [B, H, W, 3] of one shape, got "
                         f"{tuple(reference.shape)} {reference.dtype} and {tuple(images.shape)}")
    psnrs, ssims = [], []
    for ref, img in zip(reference.numpy(), images.numpy(), strict=True):
        if (ref == img).all():
            psnrs.append(float("inf"))
            ssims.append(1.0)
            continue
        psnrs.append(float(peak_signal_noise_ratio(ref, img, data_range=255)))
        ssims.append(float(structural_similarity(ref, img, channel_axis=-1, data_range=255)))
    return sum(psnrs) / len(psnrs), sum(ssims) / len(ssims)


def mmd(x: torch.Tensor, y: torch.Tensor, max_rows: int = 2048, seed: int = 0) -> float:
    """Squared maximum mean discrepancy between two sets of feature vectors, with KID's cubic
    polynomial kernel k(a, b) = (a.b / d + 1)^3 on features standardised by x's per-channel
    mean and std; the V-statistic (diagonals included), so identical sets give exactly 0 and
    any two sets a value >= 0. (KID's unbiased estimator assumes independent sets; here the
    sets come from the same seeds, so they are paired, and it goes negative.)

    x [n, d], y [m, d] (rows are samples); at most max_rows random rows of each are used."""
    if x.dim() != 2 or y.dim() != 2 or x.shape[1] != y.shape[1]:
        raise ValueError(f"expected [n, d] and [m, d], got {tuple(x.shape)}, {tuple(y.shape)}")
    if min(len(x), len(y)) < 2:
        raise ValueError("need at least 2 feature vectors per set")
    x, y = x.double(), y.double()
    mean, std = x.mean(0), x.std(0).clamp_min(1e-6)
    g = torch.Generator().manual_seed(seed)
    a = ((x - mean) / std)[torch.randperm(len(x), generator=g)[:max_rows]]
    g = torch.Generator().manual_seed(seed)
    b = ((y - mean) / std)[torch.randperm(len(y), generator=g)[:max_rows]]
    d = x.shape[1]

    def k(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ((u @ v.T / d + 1) ** 3).mean()

    return max(0.0, float(k(a, a) + k(b, b) - 2 * k(a, b)))
