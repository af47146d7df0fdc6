"""Quality metrics of the quality section: sample fidelity (PSNR, SSIM, via scikit-image) and a
distribution distance (KID) between sets of feature vectors. Plain functions on tensors."""

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


def kid(x: torch.Tensor, y: torch.Tensor, subsets: int = 10, subset_size: int = 500,
        seed: int = 0) -> float:
    """Kernel Inception Distance's estimator on any features: unbiased MMD^2 with the cubic
    polynomial kernel k(a, b) = (a.b / d + 1)^3, averaged over random subsets.

    x [n, d], y [m, d] (rows are samples). 0 in expectation for one distribution; may be
    slightly negative by chance."""
    if x.dim() != 2 or y.dim() != 2 or x.shape[1] != y.shape[1]:
        raise ValueError(f"expected [n, d] and [m, d], got {tuple(x.shape)}, {tuple(y.shape)}")
    x, y = x.double(), y.double()
    size = min(subset_size, len(x), len(y))
    if size < 2:
        raise ValueError("need at least 2 feature vectors per set")
    d = x.shape[1]
    g = torch.Generator().manual_seed(seed)
    total = 0.0
    for _ in range(subsets):
        a = x[torch.randperm(len(x), generator=g)[:size]]
        b = y[torch.randperm(len(y), generator=g)[:size]]
        kxx = (a @ a.T / d + 1) ** 3
        kyy = (b @ b.T / d + 1) ** 3
        kxy = (a @ b.T / d + 1) ** 3
        off = size * (size - 1)
        total += float((kxx.sum() - kxx.diagonal().sum()) / off
                       + (kyy.sum() - kyy.diagonal().sum()) / off - 2 * kxy.mean())
    return total / subsets
