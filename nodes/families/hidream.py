"""HiDream-I1 (and E1's edit calls, which run unmerged): double-stream blocks with image and
text apart (attention over [image; text]), returning (image, text), then single-stream blocks
on [image; text; this block's Llama layer], which drop that layer again after the block.
Object patches (no replace patches); the MoE feed-forward routes each merged token like any
other."""

from __future__ import annotations

from ..contracts import Contract
from ..dit_families import BlockKind, Family, TextAt
from . import conditioning, describe_latent

# image_tokens_masks (a key mask over the image tokens, only for a list of latents of other
# sizes, which ComfyUI's forward never builds) lines up with fixed token spans: opaque.
_BLOCK = {"stream": "image_tokens", "pe": "rope", "opaque": ("image_tokens_masks",),
          "hook": "object"}
KINDS = (BlockKind("double_block", "double_stream_blocks", "d", TextAt.AFTER, txt="text_tokens",
                   returns=("image_tokens", "text_tokens"), **_BLOCK),
         BlockKind("single_block", "single_stream_blocks", "s", TextAt.STREAM_AFTER, txt=None,
                   **_BLOCK))

MODELS = "HiDream-I1"

CONTRACT = Contract(
    "HiDream",
    models={"comfy.ldm.hidream.model:HiDreamImageTransformer2DModel": ()},
    needs=(conditioning("HiDream", ("image_cond",)),),
    kinds=KINDS,
)


def description(patch: tuple[int, int, int]) -> Family:
    # HiDream-E1's edit image (image_cond) sits beside the latent along the width
    describe = describe_latent(patch, refusals=(("image_cond", "HiDream-E1's edit image shares "
                                                 "every row of the token grid with the image"),))
    return Family("hidream", "HiDream", KINDS, patch, describe)
