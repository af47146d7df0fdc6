"""MiniMax H3 (comfy/ldm/minimax): video with synchronized audio in one packed sequence per
call, [text | conditioning rows | audio | video] (which conditioning: docs/compatibility.md),
batch size one: the stream is the sequence itself, [L, C]. Only the video, last, merges. Each
block modulates its tokens by segment (`mod_segments`: (start, stop, timestep row)); the video's
span follows the merged video, and a per-token row tensor (a denoise mask inside the video)
makes the block run unmerged. The fused RoPE table (`rope_freqs` [1, L, 1, D/2, 2, 2]) takes
the rows of the merged tokens' destinations."""

from __future__ import annotations

import functools
import math

from ..contracts import Contract, Gives, Sets
from ..dit_families import VIDEO_REGION_FRAMES, BlockKind, Family, TextAt, latent_grid, set_grid
from . import unmerged

MODELS = "MiniMax H3"

BLOCK = BlockKind("double_block", "blocks", "", TextAt.NONE, txt=None, pe="rope_freqs",
                  spans=("mod_segments",), batched=False)
# the module of ComfyUI's BlockSparseAttention node, whose blocks run unmerged (foreign_block)
SPARSE_MODULE = "nodes_sparse_attention"

CONTRACT = Contract(
    "MiniMax H3",
    models={"comfy.ldm.minimax.model:MiniMaxH3Model": (
        Gives("comfy.model_base:MiniMaxH3.extra_conds",
              ("latent_shapes", "minimax_payload", "layout"), what="conditioning"),
        Sets("comfy.ldm.minimax.model:PackedLayout.__init__", ("segments", "signature", "seq_len"),
             why="where the video sits in the packed sequence"),
    )},
    blocks={BLOCK.modules: ()},
    kinds=(BLOCK,),
)


def description(patch: tuple[int, int, int]) -> Family:
    return Family("minimax_h3", "MiniMax H3", (BLOCK,), patch, functools.partial(describe, patch),
                  frames_per_region=VIDEO_REGION_FRAMES, foreign_block=foreign_block)


def describe(patch: tuple[int, int, int], call, base_model, arguments: dict) -> str | None:
    """The video's (t, h, w) grid from the first of `latent_shapes`, and everything before the
    video's segment of the packed layout ComfyUI built for the call (its conditioning's
    `minimax_payload`) as the prefix that never merges."""
    shapes = arguments.get("latent_shapes")
    layout = (arguments.get("minimax_payload") or {}).get("layout")
    context = arguments.get("c_crossattn")
    grid = latent_grid(shapes[0], patch) if shapes and len(shapes) > 1 else None
    if grid is None or layout is None or context is None:
        return unmerged(call, "a MiniMax H3 call without its video and audio latents or its "
                              "packed layout")
    t, h, w = grid
    video = [(a, b) for a, b, kind in layout.segments if kind == "video"]
    signature = (int(context.shape[1]), t, h * patch[1], w * patch[2], int(shapes[1][-1]))
    if (len(video) != 1 or video[0][1] - video[0][0] != math.prod(grid)
            or video[0][1] != layout.seq_len or tuple(layout.signature) != signature):
        return unmerged(call, "MiniMax H3's packed layout does not end with this call's video")
    set_grid(call, grid, prefix=video[0][0])
    return None


def foreign_block(patch: object) -> str | None:
    """Why a block BlockSparseAttention patches cannot merge, None for other patches."""
    module = getattr(patch, "__module__", None) or ""
    if module.rpartition(".")[2] != SPARSE_MODULE:
        return None
    return ("BlockSparseAttention runs MiniMax H3's attention by the packed layout (video "
            "cubes, exact conditioning rows), which merged tokens do not keep")
