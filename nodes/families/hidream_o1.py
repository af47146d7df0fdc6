"""HiDream-O1: a Qwen3-VL decoder (pixel space, 32-pixel patches) over one sequence
[prompt; tms; image; reference patches], the causal prompt first, its layers handed to "dit"
replace patches. Only the image merges. ToMA keeps the prompt's keys and values across steps
itself while its patches are in place (prefix_cache.py): ComfyUI does so only while no block
is replaced."""

from __future__ import annotations

import torch

from ..contracts import Contract, Gives
from ..dit_families import BlockKind, Family, TextAt, set_grid
from . import unmerged

MODELS = "HiDream-O1"

KINDS = (BlockKind("double_block", "language_model.layers", "", TextAt.STREAM_BEFORE, stream="x",
                   txt=None, pe="freqs_cis", mask="attention_mask", pe_heads=True),)
PATCH = (1, 32, 32)

CONTRACT = Contract(
    "HiDream-O1",
    models={"comfy.ldm.hidream_o1.model:HiDreamO1Transformer": ()},
    needs=(Gives("comfy.ldm.hidream_o1.conditioning:build_extra_conds", ("input_ids", "ar_len"),
                 what="conditioning"),),
    # how prefix_cache.py runs a layer on its own
    blocks={KINDS[0].modules: ("x", "attention_mask", "freqs_cis", "optimized_attention",
                               "past_key_value")},
    kinds=KINDS,
)


def family(diffusion_model) -> Family:
    return description()


def description() -> Family:
    return Family("hidream_o1", "HiDream-O1", KINDS, PATCH, describe, prefix_cache=True,
                  sequence_parallel_refusal=(
                      "raylight's HiDream-O1 forward puts the whole prompt in front of every "
                      "GPU's share of the image tokens, a split ToMA's shard plans do not "
                      "describe"))


def describe(call, base_model, arguments: dict) -> str | None:
    """The (1, h, w) grid of pixels x [B, 3, H, W] in 32-pixel patches (the model cuts
    H // 32 x W // 32), the prompt's length in front of it (input_ids [B, L]) and the causal
    part of that whose keys and values can be kept (ar_len, a host int)."""
    x, ids = arguments.get("x"), arguments.get("input_ids")
    if not torch.is_tensor(ids) or not torch.is_tensor(x) or x.dim() != 4:
        return unmerged(call)
    set_grid(call, (1, x.shape[-2] // PATCH[1], x.shape[-1] // PATCH[2]))
    call.txt_len = ids.shape[1]
    length = arguments.get("ar_len")
    call.prompt_length = length if isinstance(length, int) else None
    return None
