"""LTX-Video and LTX-2 (comfy/ldm/lightricks): one kind of block on the video tokens of
1x1x1 patches of the latent, with RoPE over (t, h, w) and the text as cross-attention context.
LTX-2 (LTXAVModel) runs a video and an audio stream through each block (`img` = (video,
audio)): only the video merges, and the video side of its audio-video attention takes the
merged video. What never merges (guide and conditioned frames): docs/compatibility.md and
describe. Timesteps come per token (LTX-Video, LTX-2 before ComfyUI 0.33) or per frame (LTX-2
on 0.33, held compressed: held_rows), merged with the tokens; LTX-2.3 / 2.5's 9 modulation
vectors a row (`cross_attention_adaln`) move with them, and `v_prompt_timestep` (the text's,
one row a call) passes as it came."""

from __future__ import annotations

import dataclasses
import functools

import torch

from ..contracts import Contract, Hands, Has, Sets, Takes, claimed, resolve
from ..dit_families import (
    VIDEO_REGION_FRAMES,
    BlockKind,
    Family,
    HeldRows,
    TextAt,
    host_read,
    latent_grid,
    leading_true,
    set_grid,
)
from ..model_call import ModelCall
from . import conditioning, patch_of, unmerged

MODELS = "LTX-Video, LTX-2"


def shortened_guide_mask(mask, end: int, removed: int):
    """ComfyUI's GuideAttentionMask (an additive bias between the video and the guide tokens
    from `guide_start` on) for the sequence with `removed` of its first `end` tokens merged
    away, or None where the guide tokens do not start at `end`. The bias is the same for every
    token before `guide_start` (their queries share one row of noisy_mask [1, 1, 1, L]; each
    guide token's row of tracked_mask [1, 1, G, L] holds one value over their keys), so
    dropping `removed` of those columns is the merged tokens' mask."""
    if mask.guide_start != end:
        return None
    if not removed:
        return mask
    out = type(mask).__new__(type(mask))
    out.guide_start = end - removed
    out.tracked_count = mask.tracked_count
    out.noisy_mask = mask.noisy_mask[..., removed:].contiguous()
    out.tracked_mask = mask.tracked_mask[..., removed:].contiguous()
    return out


# the guide attention mask's argument and its shortening with the merged grid
GUIDE_MASK = (("self_attention_mask", shortened_guide_mask),)
VIDEO = BlockKind("double_block", "transformer_blocks", "", TextAt.NONE, txt=None, rows=("vec",),
                  shortened=GUIDE_MASK)
AUDIO_VIDEO = dataclasses.replace(VIDEO, pe="v_pe", more_pe=("v_cross_pe",), stream_item=0,
                                  rows=("v_timestep", "v_cross_scale_shift_timestep",
                                        "v_cross_gate_timestep"))


LTXV = "comfy.ldm.lightricks.model:LTXVModel"
LTXAV = "comfy.ldm.lightricks.av_model:LTXAVModel"
AV_MODEL = "comfy.ldm.lightricks.av_model"
# The object LTX-2's blocks get their per-frame timestep rows in (held_rows)
COMPRESSED = f"{AV_MODEL}:CompressedTimestep"
# ComfyUI versions whose LTX blocks get a guide attention mask and compress LTX-2's timesteps
GUIDE_MASKS = "0.33.0"
GUIDE_MASK_CLASS = "comfy.ldm.lightricks.model:GuideAttentionMask"
GUIDE_MASK_ARGUMENTS = tuple(name for name, _ in GUIDE_MASK)

CONTRACT = Contract(
    "LTX",
    models={
        LTXV: (Hands(LTXV, VIDEO.key, VIDEO.arguments),
               Hands(LTXV, VIDEO.key, GUIDE_MASK_ARGUMENTS, since=GUIDE_MASKS)),
        LTXAV: (Hands(LTXAV, AUDIO_VIDEO.key, AUDIO_VIDEO.arguments),
                Hands(LTXAV, AUDIO_VIDEO.key, GUIDE_MASK_ARGUMENTS, since=GUIDE_MASKS),
                conditioning("LTXAV", ("latent_shapes", "denoise_mask", "keyframe_idxs")),
                conditioning("LTXAV", ("generated_keyframes",), since=GUIDE_MASKS),
                Has(AV_MODEL, ("CompressedTimestep",), since=GUIDE_MASKS),
                Takes(f"{COMPRESSED}.__init__", ("patches_per_frame", "per_frame"),
                      since=GUIDE_MASKS),
                Sets(f"{COMPRESSED}.__init__", ("data", "patches_per_frame"),
                     since=GUIDE_MASKS, why="LTX-2's per-frame timestep rows")),
    },
    needs=(conditioning("LTXV", ("denoise_mask", "keyframe_idxs")),
           Sets(f"{GUIDE_MASK_CLASS}.__init__",
                ("guide_start", "tracked_count", "noisy_mask", "tracked_mask"),
                since=GUIDE_MASKS, why="the guide attention mask ToMA shortens"),
           conditioning("LTXV", ("generated_keyframes",), since=GUIDE_MASKS)),
    blocks={"transformer_blocks": ()},
)


def family(diffusion_model) -> Family:
    if claimed(CONTRACT, diffusion_model) == LTXAV:
        kinds, label, av_model = (AUDIO_VIDEO,), "LTX-2", resolve(AV_MODEL)[0]
    else:
        kinds, label, av_model = (VIDEO,), "LTX-Video", None
    patch = patch_of(diffusion_model.patchifier.patch_size)
    return description(patch, kinds, label, functools.partial(describe, patch),
                       held_rows(av_model))


def description(patch: tuple[int, int, int], kinds: tuple[BlockKind, ...] = (VIDEO,),
                label: str = "LTX-Video", describe=None, held: HeldRows | None = None) -> Family:
    return Family("ltx", label, kinds, patch, describe, frames_per_region=VIDEO_REGION_FRAMES,
                  held_rows=held, sequence_parallel_refusal=(
                      "raylight's LTX forward hands each GPU its share of the per-token timestep "
                      "rows, which ToMA's shard plans do not merge"))


def describe(patch: tuple[int, int, int], call, base_model, arguments: dict) -> str | None:
    """The (t, h, w) grid of the video latent's frames before the guide frames (LTXVAddGuide's,
    their token positions in `keyframe_idxs`) of x, or of the first of `latent_shapes` where
    LTX-2 packs video and audio into one latent; the leading frames the denoise mask
    conditions (conditioned_frames) in front of it."""
    shapes = arguments.get("latent_shapes")
    shape = shapes[0] if shapes else getattr(arguments.get("x"), "shape", None)
    grid = latent_grid(shape, patch)
    if grid is None or len(shape) != 5:
        return unmerged(call)
    total, h, w = grid
    if arguments.get("generated_keyframes") is not None:
        return unmerged(call, "LTX keyframe slots (generated_keyframes) mark frames inside the "
                              "video")
    keyframes = arguments.get("keyframe_idxs")
    guides = int(keyframes.shape[2]) if torch.is_tensor(keyframes) else 0
    if guides % (h * w):
        return unmerged(call, f"LTX guide tokens ({guides}) are not whole {h}x{w} frames")
    frames = total - guides // (h * w)
    kept = conditioned_frames(call, arguments.get("denoise_mask"), frames, total)
    if kept is None:
        return unmerged(call, "the LTX denoise mask keeps tokens inside the video (not only "
                              "leading frames), which merged tokens cannot keep apart")
    set_grid(call, (frames, h, w), protect_frames=kept)
    return None


def conditioned_frames(call: ModelCall, mask: object, frames: int, total: int) -> int | None:
    """Leading latent frames of a denoise mask [B|1, C|1, total, H, W] that are not all 1 (the
    sampler does not fully denoise them: image-to-video and in-place guide frames), read in the
    first `frames` (the video). None where the mask is no such prefix: a value below 1 after a
    frame of all 1 (inpainting), a negative value (a token ComfyUI drops), or another length.
    0 without a mask (host_read)."""
    if mask is None:
        return 0
    if not torch.is_tensor(mask) or mask.dim() != 5 or mask.shape[2] != total:
        return None

    def read() -> int | None:
        video = mask[:, :, :frames].float()
        low, high = torch.stack((video.amin(dim=(0, 1, 3, 4)),
                                 video.amax(dim=(0, 1, 3, 4)))).tolist()    # one host read
        free = [a == 1 and b == 1 for a, b in zip(low, high, strict=True)]
        count = leading_true([not f for f in free])
        clean = all(free[count:]) and min(low[:count], default=0) >= 0
        return count if clean else None

    return host_read(call, ("conditioned_frames", tuple(mask.shape), frames), read)


def held_rows(av_model) -> HeldRows | None:
    """LTX-2's compressed timesteps (CompressedTimestep of ComfyUI's av_model module: rows
    [B, R, C] of `patches_per_frame` tokens each), where this ComfyUI has them."""
    held = getattr(av_model, "CompressedTimestep", None)
    if held is None:
        return None

    def read(value: object) -> tuple[torch.Tensor, int] | None:
        return (value.data, int(value.patches_per_frame)) if isinstance(value, held) else None

    def write(value: object, rows: torch.Tensor, tokens: int) -> object:
        return held(rows, tokens, per_frame=True)

    return HeldRows(read, write)

