"""Boogu-Image (comfy/ldm/boogu, ComfyUI 0.33 and later): OmniGen2's blocks with a
double-stream stage, object patches (no replace patches). The double-stream blocks take the
image stream [references; image] and the text apart, attending over [text; references; image]
and over the image stream alone; the single-stream blocks run on [text; references; image].
The refiners before these stages run unmerged."""

from __future__ import annotations

from ..contracts import Contract
from ..dit_families import BlockKind, Family, TextAt
from . import conditioning, describe_latent, patch_of, sets_patch

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
    models={BOOGU: (sets_patch(BOOGU),)},
    needs=(conditioning("Omnigen2", ("c_crossattn", "ref_latents")),),
    kinds=KINDS,
)


def family(diffusion_model) -> Family:
    patch = patch_of(diffusion_model.patch_size)
    return Family("boogu", "Boogu-Image", KINDS, patch,
                  describe_latent(patch, "ref_latents", text=True))
