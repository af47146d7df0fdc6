"""Ideogram 4 (comfy/ldm/ideogram4, ComfyUI 0.33 and later): one kind of single-stream block
on [text; image] (the image alone where a call has no text), object patches (no replace
patches), one token a latent pixel (the latent's channels hold its 2x2 patches). Its segment
attention mask (text padding in a segment of its own) follows the merged image."""

from __future__ import annotations

from ..contracts import Contract
from ..dit_families import BlockKind, Family, TextAt
from . import conditioning, describe_latent

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
    return Family("ideogram4", "Ideogram 4", KINDS, (1, 1, 1),
                  describe_latent((1, 1, 1), text=True))
