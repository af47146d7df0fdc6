"""Boogu-Image (comfy/ldm/boogu, ComfyUI 0.33 and later): OmniGen2's blocks with a double-stream
stage, which ComfyUI calls without replace patches: ToMA patches each block's forward. The
double-stream blocks take the image stream [references; image] and the text apart, attend
jointly over [text; references; image] and over the image stream alone; the single-stream
blocks run on [text; references; image]. The text and the edit references
(TextEncodeBooguEdit's reference latents) never merge; the RoPE rows of both attentions follow
the merged image. The refiners before these stages run unmerged."""

from __future__ import annotations

import torch

from ..contracts import Contract, Gives, Sets
from ..dit_families import BlockKind, Family, TextAt, latent_grid, set_grid

MODELS = "Boogu-Image"

# the attention masks ComfyUI's forward hands these blocks are always None: one given would
# address fixed token spans
KINDS = (BlockKind("double_block", "double_stream_layers", "d", TextAt.BEFORE,
                   stream="img_hidden_states", txt="instruct_hidden_states",
                   pe="joint_rotary_emb", stream_pe=("img_rotary_emb",),
                   opaque=("joint_attention_mask", "img_attention_mask"), hook="object",
                   returns=("img_hidden_states", "instruct_hidden_states")),
         BlockKind("single_block", "single_stream_layers", "s", TextAt.STREAM_BEFORE,
                   stream="hidden_states", txt=None, pe="image_rotary_emb",
                   opaque=("attention_mask",), hook="object"))

BOOGU = "comfy.ldm.boogu.model:BooguTransformer2DModel"

CONTRACT = Contract(
    "Boogu-Image",
    models={BOOGU: (Sets(f"{BOOGU}.__init__", ("patch_size",), why="the size of its patches"),)},
    needs=(Gives("comfy.model_base:Omnigen2.extra_conds", ("c_crossattn", "ref_latents"),
                 what="conditioning"),),
    kinds=KINDS,
)


def family(diffusion_model) -> Family:
    size = int(diffusion_model.patch_size)
    patch = (1, size, size)

    def describe(call, base_model, arguments: dict) -> None:
        """The (1, h, w) grid of latent x [B, C, H, W], after the reference latents' tokens
        (each [1, C, h, w] padded to the patch size) and the text (context c_crossattn)."""
        references = arguments.get("ref_latents") or ()
        prefix = 0
        for reference in references:
            _, h, w = latent_grid(reference, patch)
            prefix += h * w
        set_grid(call, latent_grid(arguments.get("x"), patch), prefix=prefix)
        context = arguments.get("c_crossattn")
        if torch.is_tensor(context):
            call.txt_len = context.shape[1]

    return description(patch, describe)


def description(patch: tuple[int, int, int] = (1, 2, 2), describe=None) -> Family:
    return Family("boogu", "Boogu-Image", KINDS, patch, describe)
