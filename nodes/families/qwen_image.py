"""Qwen-Image and Qwen-Image-Edit: one kind of block with text and image in two streams
(attention over [text; image]); edit reference images are appended after the image tokens and
never merge."""

from __future__ import annotations

import inspect

from ..contracts import Contract, Gives, Hands, Mentions, Sets, Takes
from ..dit_families import BlockKind, Family, latent_grid, set_grid, timestep_zero_guard

# the models of this family, as the node's error and the README name them
MODELS = "Qwen-Image (and Edit)"

KINDS = (BlockKind("double_block", "transformer_blocks", "", "before"),)

QWEN_IMAGE = "comfy.ldm.qwen_image.model:QwenImageTransformer2DModel"
# The parameter of the block's forward that tells ToMA this ComfyUI's Qwen-Image modulates
# "index_timestep_zero" references on their own (its describe then guards those calls).
TIMESTEP_ZERO = "timestep_zero_index"
_SEPARATE_MODULATION = Mentions("comfy.ldm.qwen_image.model", ("index_timestep_zero",))

CONTRACT = Contract(
    "Qwen-Image",
    models={QWEN_IMAGE: (
        Hands(QWEN_IMAGE, KINDS[0].key, KINDS[0].arguments),
        Takes("comfy.ldm.qwen_image.model:QwenImageTransformerBlock.forward", (TIMESTEP_ZERO,),
              when=_SEPARATE_MODULATION,
              why="ToMA reads from it that 'index_timestep_zero' references are modulated on "
                  "their own"),
        Sets(f"{QWEN_IMAGE}.__init__", ("default_ref_method",), when=_SEPARATE_MODULATION,
             why="the reference method of calls that name none"),
    )},
    needs=(Gives("comfy.model_base:QwenImage.extra_conds", ("ref_latents", "ref_latents_method"),
                 what="conditioning"),),
    blocks={"transformer_blocks": ("hidden_states", "encoder_hidden_states", "temb",
                                   "image_rotary_emb")},
)


def family(diffusion_model) -> Family:
    """The Family of a model of this family's classes (families.family_of checked it)."""
    patch = (1, int(diffusion_model.patch_size), int(diffusion_model.patch_size))
    timestep_zero = TIMESTEP_ZERO in inspect.signature(
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
