"""Lumina 2 and Z-Image (NextDiT): one sequence of [text; image; padding] through one kind of
block, which ComfyUI calls without replace patches: ToMA patches each block's forward."""

from __future__ import annotations

import math

import torch

from ..contracts import Contract, Sets, Takes
from ..dit_families import BlockKind, Family, ShardKind, TextAt, host_read, latent_grid, set_grid
from ..model_call import ModelCall
from . import conditioning, patch_of, unmerged

MODELS = "Lumina 2, Z-Image"

# raylight hands each layer a shard of [text; image; padding] and its positional rows
KINDS = (BlockKind("layer", "layers", "", TextAt.STREAM_BEFORE, stream="x", txt=None,
                   pe="freqs_cis", mask="x_mask", mask_dims=(-1,), hook="object",
                   shard=ShardKind()),)

NEXT_DIT = "comfy.ldm.lumina.model:NextDiT"
# where NextDiT has it (0.8 on), the text is padded to a multiple, not cut to each item's length
PAD = "pad_tokens_multiple"

CONTRACT = Contract(
    "Lumina 2 / Z-Image",
    models={NEXT_DIT: (Sets(f"{NEXT_DIT}.__init__", (PAD,), since="0.8.0",
                            why="how long the text in front of the image is"),)},
    needs=(Takes("comfy.model_base:BaseModel._apply_model", ("c_crossattn",)),
           conditioning("Lumina2", ("c_crossattn", "attention_mask", "num_tokens")),
           conditioning("Lumina2", ("ref_latents",), since="0.33.0")),
    kinds=KINDS,
)


# MingImage's conditioning that adds tokens ToMA cannot place (after the text, its references)
EXTRA_TOKENS = ("direct_context", "ref_frames")


def _given(value: object) -> bool:
    """Whether a conditioning value holds anything (a tensor, or a non-empty list of them)."""
    return torch.is_tensor(value) or (isinstance(value, (list, tuple)) and len(value) > 0)


def family(diffusion_model) -> Family:
    patch = patch_of(diffusion_model.patch_size)

    def describe(call, base_model, arguments: dict) -> str | None:
        """The (1, h, w) grid of latent x and the text in front of it (text_length; a batch
        whose items' lengths differ runs unmerged). Z-Image Omni references put other tokens
        around the image: those calls run unmerged."""
        set_grid(call, latent_grid(arguments.get("x"), patch))
        context = arguments.get("c_crossattn")
        if len(arguments.get("ref_latents") or ()) > 0:
            return unmerged(call, "Z-Image Omni references", sep=":")
        extra = [name for name in EXTRA_TOKENS if _given(arguments.get(name))]
        if extra:
            return unmerged(call, f"{' and '.join(extra)} add tokens of their own around the "
                                  f"text and image (MingImage)", sep=":")
        if not torch.is_tensor(context):
            return unmerged(call)
        text = text_length(call, context, arguments, diffusion_model)
        if text is None:
            return unmerged(call, "the items of a batch have texts of different lengths "
                                  "(ComfyUI before 0.8 lays them out one by one)", sep=":")
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
