"""Flux.1 dev/schnell, Flux Kontext, Flux 2 and Chroma: double blocks with text and image in
two streams (attention over [text; image]), then single blocks on [text; image]; reference
images (Kontext, Flux 2) are appended after the main image tokens and never merge."""

from __future__ import annotations

import inspect

from ..contracts import Contract, Gives, Hands, Has, Mentions, Takes
from ..dit_families import BlockKind, Family, latent_grid, set_grid, timestep_zero_guard

# the models of this family, as the node's error and the README name them
MODELS = "Flux.1 dev/schnell, Flux Kontext, Flux 2, Chroma"

KINDS = (BlockKind("double_block", "double_blocks", "d", "before", mask="attn_mask"),
         BlockKind("single_block", "single_blocks", "s", "stream_before", txt=None,
                   mask="attn_mask"))

FLUX = "comfy.ldm.flux.model:Flux"
CHROMA = "comfy.ldm.chroma.model:Chroma"
# The parameter of Flux.forward_orig that tells ToMA this ComfyUI's Flux modulates
# "index_timestep_zero" references on their own (its describe then guards those calls).
TIMESTEP_ZERO = "timestep_zero_index"
_SEPARATE_MODULATION = Mentions("comfy.ldm.flux.model", ("index_timestep_zero",))

CONTRACT = Contract(
    "Flux",
    models={
        FLUX: (Hands(FLUX, KINDS[0].key, KINDS[0].arguments),
               Hands(FLUX, KINDS[1].key, KINDS[1].arguments),
               Takes(f"{FLUX}.forward_orig", (TIMESTEP_ZERO,), when=_SEPARATE_MODULATION,
                     why="ToMA reads from it that 'index_timestep_zero' references are "
                         "modulated on their own"),
               Has("comfy.ldm.flux.model:FluxParams", ("default_ref_method",),
                   when=_SEPARATE_MODULATION,
                   why="the reference method of calls that name none")),
        CHROMA: (Hands(CHROMA, KINDS[0].key, KINDS[0].arguments),
                 Hands(CHROMA, KINDS[1].key, KINDS[1].arguments)),
    },
    needs=(Gives("comfy.model_base:Flux.extra_conds", ("ref_latents", "ref_latents_method"),
                 what="conditioning"),),
    blocks={"double_blocks": ("img", "txt", "vec", "pe", "attn_mask"),
            "single_blocks": ("x", "vec", "pe", "attn_mask")},
)


def family(diffusion_model) -> Family:
    """The Family of a model of this family's classes (families.family_of checked it)."""
    patch = (1, int(diffusion_model.patch_size), int(diffusion_model.patch_size))
    timestep_zero = TIMESTEP_ZERO in inspect.signature(
        type(diffusion_model).forward_orig).parameters

    def describe(call, base_model, arguments: dict) -> str | None:
        """The (1, h, w) grid of latent x. Timestep-zero guard, where this ComfyUI's Flux has
        that modulation: when the call has reference latents whose method is
        "index_timestep_zero" (the call's `ref_latents_method`, else the model's
        `params.default_ref_method` read now, so an object patch of it counts), ComfyUI
        modulates the main image tokens and the reference tokens differently over spans it
        fixes before the blocks run; a merged sequence would shift those spans, so the whole
        call runs unmerged (said once, in the log and the stats line)."""
        set_grid(call, latent_grid(arguments.get("x"), patch))
        params = getattr(getattr(base_model, "diffusion_model", None), "params", None)
        if not timestep_zero:
            return None
        return timestep_zero_guard(call, arguments, getattr(params, "default_ref_method", None))

    return description(patch, describe)


def description(patch: tuple[int, int, int], describe=None) -> Family:
    """The Flux family's Family (benchmarks call blocks without a model call to describe)."""
    return Family("flux", "Flux", KINDS, patch, describe, attention_scope=True)
