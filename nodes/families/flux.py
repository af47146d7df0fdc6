"""Flux.1 dev/schnell, Flux Kontext, Flux 2, LongCat-Image, Ovis-Image (Flux's class), Chroma
and Chroma Radiance (Chroma's blocks on pixel patches): double blocks with text and image in two
streams (attention over [text; image]), then single blocks on [text; image]; reference images
(Kontext, Flux 2, LongCat-Image Edit) are appended after the main image tokens and never merge.
References with "index_timestep_zero" get timestep zero's modulation over token spans
(modulation_dims) that ComfyUI's block loop hands the blocks beside the replace patch's
arguments: ToMA moves them with the merged image."""

from __future__ import annotations

import dataclasses
import inspect

from ..contracts import Contract, Gives, Hands, Mentions, Takes
from ..dit_families import BlockKind, Family, ShardKind, TextAt, describe_plain

# the models of this family, as the node's error and the README name them
MODELS = ("Flux.1 dev/schnell, Flux Kontext, Flux 2, LongCat-Image, Ovis-Image, Chroma, "
          "Chroma Radiance")

KINDS = (BlockKind("double_block", "double_blocks", "d", TextAt.BEFORE, mask="attn_mask",
                   positions=("modulation_dims_img",), attention_scope=True,
                   shard=ShardKind()),
         BlockKind("single_block", "single_blocks", "s", TextAt.STREAM_BEFORE, txt=None,
                   mask="attn_mask", positions=("modulation_dims",),
                   shard=ShardKind(text_in_stream=True)))

FLUX = "comfy.ldm.flux.model:Flux"
CHROMA = "comfy.ldm.chroma.model:Chroma"
# Chroma's blocks and block loop on 16-pixel patches of the image, its pixels then made by a
# per-patch head from the blocks' full-length output
CHROMA_RADIANCE = "comfy.ldm.chroma_radiance.model:ChromaRadiance"
# The parameter of Flux.forward_orig that says this ComfyUI's Flux modulates
# "index_timestep_zero" references on their own (its blocks then get spans to move).
TIMESTEP_ZERO = "timestep_zero_index"
_SEPARATE_MODULATION = Mentions("comfy.ldm.flux.model", ("index_timestep_zero",))

CONTRACT = Contract(
    "Flux",
    models={
        FLUX: (Hands(FLUX, KINDS[0].key, KINDS[0].arguments),
               Hands(FLUX, KINDS[1].key, KINDS[1].arguments),
               Takes(f"{FLUX}.forward_orig", (TIMESTEP_ZERO,), when=_SEPARATE_MODULATION,
                     why="ToMA reads from it that 'index_timestep_zero' references are "
                         "modulated on their own, over spans it moves")),
        **{model: (Hands(model, KINDS[0].key, KINDS[0].arguments),
                   Hands(model, KINDS[1].key, KINDS[1].arguments))
           for model in (CHROMA, CHROMA_RADIANCE)},
    },
    needs=(Gives("comfy.model_base:Flux.extra_conds", ("ref_latents",), what="conditioning"),),
    blocks={"double_blocks": ("img", "txt", "vec", "pe", "attn_mask"),
            "single_blocks": ("x", "vec", "pe", "attn_mask")},
)


def family(diffusion_model) -> Family:
    """The Family of a model of this family's classes (families.family_of checked it): the
    (1, h, w) grid of latent x; the modulation spans to move where this ComfyUI's model
    modulates "index_timestep_zero" references on their own."""
    patch = (1, int(diffusion_model.patch_size), int(diffusion_model.patch_size))
    spans = TIMESTEP_ZERO in inspect.signature(type(diffusion_model).forward_orig).parameters
    return description(patch, describe_plain(patch), KINDS if spans else tuple(
        dataclasses.replace(kind, positions=()) for kind in KINDS))


def description(patch: tuple[int, int, int], describe=None, kinds=KINDS) -> Family:
    """The Flux family's Family (benchmarks call blocks without a model call to describe)."""
    return Family("flux", "Flux", kinds, patch, describe)
