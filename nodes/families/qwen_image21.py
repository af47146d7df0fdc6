"""Qwen-Image 2.1 (comfy/ldm/qwen_image21, ComfyUI 0.35 and later): single-stream blocks with
"dit" replace patches on [text, the edit references' tokens spliced in; image], one token a
latent pixel. Its attention (`attn_fn`) runs segments fixed before the blocks; the image's,
last and unmasked, reaches the sequence's end, so a merged image is its whole segment. Its
modulation rows split at `prefix_len`, which merging leaves in place."""

from __future__ import annotations

from ..contracts import Contract, Hands
from ..dit_families import BlockKind, Family, TextAt
from . import describe_latent

MODELS = "Qwen-Image 2.1"

KINDS = (BlockKind("single_block", "transformer_blocks", "", TextAt.STREAM_BEFORE, txt=None),)

QWEN21 = "comfy.ldm.qwen_image21.model:QwenImage21Transformer2DModel"

CONTRACT = Contract(
    "Qwen-Image 2.1",
    models={QWEN21: (Hands(QWEN21, KINDS[0].key, (*KINDS[0].arguments, "prefix_len")),)},
    blocks={KINDS[0].modules: ()},
)


def family(diffusion_model) -> Family:
    return Family("qwen_image21", "Qwen-Image 2.1", KINDS, (1, 1, 1),
                  describe_latent((1, 1, 1), "ref_latents", text=True))
