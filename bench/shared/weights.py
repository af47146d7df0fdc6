"""Seeded random weights for models built without a checkpoint: the one fill shared by the
benchmarks and the tests.

ComfyUI's operations skip weight initialisation, so a model built from its classes holds
whatever memory it got; benchmarks and tests fill it here. Plain torch and nothing else, so that
tests/integration/comfy_harness.py can load this file by path (inside a ComfyUI server too).
"""

from __future__ import annotations

import math

import torch


def fill_weights(module: torch.nn.Module, seed: int = 0, gain: float = 1.0) -> torch.nn.Module:
    """Fill every parameter of `module` in place and return it: biases 0, other vectors (norm
    scales) 1, matrices and convolution kernels normal with std gain / sqrt(fan_in) (fan_in =
    the product of all but the first dimension), which keeps activations O(1) through blocks."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if param.ndim <= 1:
                param.fill_(0.0 if name.endswith("bias") else 1.0)
            else:
                fan_in = math.prod(param.shape[1:])
                values = torch.randn(param.shape, generator=generator) * (gain / fan_in**0.5)
                param.copy_(values.to(param.dtype))
    return module
