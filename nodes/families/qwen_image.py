"""Qwen-Image and Qwen-Image-Edit: one kind of block with text and image in two streams
(attention over [text; image]); edit reference images are appended after the image tokens and
never merge."""

from __future__ import annotations

import inspect

from ..dit_families import BlockKind, Family, latent_grid, set_grid, timestep_zero_guard

# the models of this family, as the node's error and the README name them
MODELS = "Qwen-Image (and Edit)"

KINDS = (BlockKind("double_block", "transformer_blocks", "", "before"),)


def family(diffusion_model) -> Family | None:
    from comfy.ldm.qwen_image.model import QwenImageTransformer2DModel

    if type(diffusion_model) is not QwenImageTransformer2DModel:
        return None
    patch = (1, int(diffusion_model.patch_size), int(diffusion_model.patch_size))
    timestep_zero = "timestep_zero_index" in inspect.signature(
        type(diffusion_model.transformer_blocks[0]).forward).parameters

    def describe(call, base_model, arguments: dict) -> str | None:
        """The (t, h, w) grid of latent x [B, C, T, H, W] (T: 1, or the layers of Qwen-Image
        Layered, each a frame). Timestep-zero guard as for Flux: references with
        "index_timestep_zero" (Qwen-Image-Edit 2511) get their own modulation from the token
        index where the image ends, fixed before the blocks run: those calls run unmerged."""
        set_grid(call, latent_grid(arguments.get("x"), patch))
        model = getattr(base_model, "diffusion_model", None)
        if not timestep_zero:
            return None
        return timestep_zero_guard(call, arguments, getattr(model, "default_ref_method", None))

    return description(patch, describe)


def description(patch: tuple[int, int, int], describe=None) -> Family:
    """Qwen-Image's Family (benchmarks call blocks without a model call to describe)."""
    return Family("qwen_image", "Qwen-Image", KINDS, patch, describe)
