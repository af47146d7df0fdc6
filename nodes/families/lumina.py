"""Lumina 2 and Z-Image (NextDiT): one sequence of [text; image; padding] through one kind of
block, which ComfyUI calls without replace patches: ToMA patches each block's forward."""

from __future__ import annotations

import math

import torch

from ..contracts import Contract, Gives, Sets, Takes
from ..dit_families import BlockKind, Family, ShardKind, TextAt, host_read, latent_grid, set_grid
from ..model_call import ModelCall

MODELS = "Lumina 2, Z-Image"

# raylight hands each layer a shard of [text; image; padding] and its positional rows
KINDS = (BlockKind("layer", "layers", "", TextAt.STREAM_BEFORE, stream="x", txt=None,
                   pe="freqs_cis", mask="x_mask", mask_dims=(-1,), hook="object",
                   shard=ShardKind(text_in_stream=True)),)

NEXT_DIT = "comfy.ldm.lumina.model:NextDiT"
# The attribute whose presence says the text is padded to a multiple (Z-Image), not cut to
# each item's own length.
PAD = "pad_tokens_multiple"

CONTRACT = Contract(
    "Lumina 2 / Z-Image",
    models={NEXT_DIT: (Sets(f"{NEXT_DIT}.__init__", (PAD,), since="0.8.0",
                            why="how long the text in front of the image is"),)},
    needs=(Takes("comfy.model_base:BaseModel._apply_model", ("c_crossattn",)),
           Gives("comfy.model_base:Lumina2.extra_conds",
                 ("c_crossattn", "attention_mask", "num_tokens"), what="conditioning"),
           Gives("comfy.model_base:Lumina2.extra_conds", ("ref_latents",), what="conditioning",
                 since="0.33.0")),
    kinds=KINDS,
)


# Conditioning that adds tokens ToMA cannot place: MingImage's context appended to the text and
# its reference frames
EXTRA_TOKENS = ("direct_context", "ref_frames")


def _given(value: object) -> bool:
    """Whether a conditioning value holds anything (a tensor, or a non-empty list of them)."""
    return torch.is_tensor(value) or (isinstance(value, (list, tuple)) and len(value) > 0)


def family(diffusion_model) -> Family:
    size = int(diffusion_model.patch_size)
    patch = (1, size, size)

    def describe(call, base_model, arguments: dict) -> str | None:
        """The (1, h, w) grid of latent x and the text length in front of it: the context,
        padded to `pad_tokens_multiple` (Z-Image); a NextDiT without it keeps each item's own
        text length (its attention mask), so a batch merges only when they agree. Z-Image Omni
        references put other tokens around the image: those calls run unmerged."""
        set_grid(call, latent_grid(arguments.get("x"), patch))
        context = arguments.get("c_crossattn")
        if len(arguments.get("ref_latents") or ()) > 0:
            call.mergeable = False
            return "Z-Image Omni references: those model calls run unmerged"
        extra = [name for name in EXTRA_TOKENS if _given(arguments.get(name))]
        if extra:
            call.mergeable = False
            return (f"{' and '.join(extra)} add tokens of their own around the text and image "
                    f"(MingImage): those model calls run unmerged")
        if not torch.is_tensor(context):
            call.mergeable = False
            return None
        text = text_length(call, context, arguments, diffusion_model)
        if text is None:
            call.mergeable = False
            return ("the items of a batch have texts of different lengths (ComfyUI before 0.8 "
                    "lays them out one by one): those model calls run unmerged")
        call.txt_len = text
        return None

    return description(patch, describe)


def description(patch: tuple[int, int, int], describe=None) -> Family:
    return Family("lumina", "Lumina 2 / Z-Image", KINDS, patch, describe)


def text_length(call: ModelCall, context: torch.Tensor, arguments: dict,
                diffusion_model) -> int | None:
    """Tokens in front of the image in the blocks' sequence, None when items differ. NextDiT
    without `pad_tokens_multiple` (ComfyUI before 0.8) cuts each item's text to its own length:
    its attention mask's count (host_read), else `num_tokens`."""
    if not hasattr(diffusion_model, PAD):
        mask = arguments.get("attention_mask")
        if torch.is_tensor(mask):
            def read() -> int | None:
                lengths = mask.sum(dim=-1).flatten().unique()
                return int(lengths[0]) if len(lengths) == 1 else None

            return host_read(call, ("text_length", tuple(mask.shape)), read)
        return int(arguments.get("num_tokens", context.shape[1]))
    multiple = diffusion_model.pad_tokens_multiple
    return math.ceil(context.shape[1] / multiple) * multiple if multiple else context.shape[1]
