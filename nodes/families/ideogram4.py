"""Ideogram 4 (comfy/ldm/ideogram4, ComfyUI 0.33 and later): one kind of single-stream block
on [text; image] (the image alone where a call has no text), object patches (no replace
patches), one token a latent pixel (the latent's channels hold its 2x2 patches). Its segment
attention mask (text padding in a segment of its own) follows the merged image."""

from __future__ import annotations

from ..contracts import Contract
from ..dit_families import BlockKind, Family, TextAt, latent_grid, set_grid
from . import conditioning, context_length

MODELS = "Ideogram 4"

KINDS = (BlockKind("layer", "layers", "", TextAt.STREAM_BEFORE, stream="x", txt=None,
                   pe="freqs_cis", mask="attn_mask", hook="object"),)


CONTRACT = Contract(
    "Ideogram 4",
    models={"comfy.ldm.ideogram4.model:Ideogram4Transformer2DModel": ()},
    needs=(conditioning("Ideogram4", ("c_crossattn", "attention_mask")),),
    kinds=KINDS,
)


def family(diffusion_model) -> Family:
    def describe(call, base_model, arguments: dict) -> None:
        """The (1, h, w) grid of latent x [B, C, H, W] and the text in front of it: the
        context's length (none where the call has no context)."""
        set_grid(call, latent_grid(arguments.get("x"), (1, 1, 1)))
        call.txt_len = context_length(arguments) or 0

    return Family("ideogram4", "Ideogram 4", KINDS, (1, 1, 1), describe)
