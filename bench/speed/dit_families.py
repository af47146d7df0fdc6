"""One block of each new DiT family at full width: plain, lower bound and ToMA, and the whole
model projected from them.

    COMFYUI_PATH=/path/to/ComfyUI python -m bench.speed.dit_families --threads 1 --clock cpu
        [--quick] [--families wan22_5b,wan14b,wan_animate14b,qwen_image,sd35_large,
                               z_image,ltx2,ltxv,hidream,hunyuan_image,kandinsky5,
                               hidream_o1,minimax_h3,krea2]
        [--ratio 0.5]
        [--reps 3] [--family-reps wan14b=2] [--size wan14b=832x480x17]
        [--toma-hook bench.speed.dit_toma:hook | none] [--out bench/results/<date>-cpu-dit.json]
        [--baseline-hook bench.speed.dit_toma:baseline_hook]   (with TOMA_BASELINE=PATH)

Builds ComfyUI's own block class of each family at the real model's width (seeded random
weights from bench.shared.weights, fp32, CPU, SDPA attention) on the token count of a real
generation,
and times per family:

- plain: the block on every image token, called the way ComfyUI's block loop calls it;
- lower bound: the same block on the image token count ToMA merges to (text and other tokens
  unchanged, RoPE rows of the kept tokens), no merging cost: what merging could at best give;
- toma: the block through the pack's patch (the hook, below), with vs_lb (the median of the
  side-by-side ratios toma / lower bound; a ToMA row faster than its bound, or merging to a
  count more than RATIO_SLACK from what the ratio asks, is flagged, not a result, and so is its
  projected model), the plan build timed apart, and the relative L2 error of its image update
  against the plain block's (random weights: it ranks settings, it does not predict image
  quality).

Timing (bench.shared.common.interleaved): one untimed call of every variant first (the warm-up,
whose
plain and toma outputs give the error; at these sizes one call runs for seconds to minutes),
then `reps` rounds calling every variant once in turn; median, minimum and spread per variant,
speedups with the range of the side-by-side ratios. Fewer than 3 repetitions (--family-reps, for
the minutes-long video blocks) is said in the row's note.

The projection: the real model's blocks (blocks only: embedders and the final layer are a
rounding error at these sizes) with the node's default skip_blocks (the pack's make_options:
"d0-4, s0-4", blocks 0-4 on one-kind models) unmerged and one plan build per step (one group of
consecutive merged blocks, recompute_every 1), per repetition; against the same projection of the
lower bound. Families of two block kinds (HiDream, HunyuanImage: double and single) get one
case per kind, their rows named "<family> double" / "<family> single", and one projection that
adds both kinds per repetition (each kind's own depth and default skips, "d0-4" and "s0-4", and
one plan build per kind: each kind's merged blocks are one group). Blocks a model runs outside
the patches on every token (Wan Animate's face adapter blocks) are timed in the same rounds and
added unmerged to the plain, merged and lower-bound models alike.

Sizes (pixels -> latent -> token grid t x h x w):
  wan22_5b    Wan 2.2 TI2V 5B, width 3072, 30 blocks: 1280x704, 121 frames -> 31x22x40 = 27280
  wan14b      Wan 2.1 / 2.2 A14B, width 5120, 40 blocks: 832x480, 81 frames -> 21x30x52 = 32760
  wan_animate14b  Wan 2.2 Animate 14B (image-to-video blocks, 257 CLIP image + 512 text
              tokens of context): 832x480, 81 frames and the reference frame in front
              (never merged) -> 22x30x52 = 34320; its 8 face adapter blocks on all of them
  qwen_image  Qwen-Image, width 3072, 60 blocks: 1328x1328 -> 83x83 = 6889 (+ 256 text)
  sd35_large  SD3.5 Large, width 2432, 38 blocks: 1024x1024 -> 64x64 = 4096 (+ 154 text)
  z_image     Z-Image, width 3840, 30 blocks: 1024x1024 -> 64x64 = 4096 (+ 256 text)
  ltx2        LTX-2 19B, video width 4096, 48 blocks: 768x512, 121 frames (VAE 32x32 pixels,
              8 frames after the first) -> 16x16x24 = 6144 video tokens (+ 121 audio tokens,
              25 a second at 25 fps; 1024 text tokens as cross-attention context)
  minimax_h3  MiniMax H3, width 5376, 50 blocks: 1344x768, 124 frames (VAE 16x16 pixels, the
              17k+5 frame grid) -> 37x24x42 = 37296 video tokens (+ 414 audio tokens, 40 a
              second per stereo channel, and 512 text tokens in front, in the one sequence)
  ltxv        LTX-Video 2B, width 2048, 28 blocks: 768x512, 97 frames -> 13x16x24 = 4992
              (+ 128 text tokens as cross-attention context)
  krea2       Krea 2, width 6144, 28 blocks: 1024x1024 -> 64x64 = 4096 (+ 256 text in front,
              in the one sequence)
  hidream     HiDream-I1, width 2560, 16 double + 32 single blocks (MoE: 4 experts, 2 active):
              1024x1024 -> 64x64 = 4096 (+ 384 text: T5 128, Llama 128 + 128)
  hunyuan_image  HunyuanImage 2.1, width 3584, 20 double + 40 single blocks: 2048x2048 (its
              native size; VAE 32x32 pixels, 64 channels, 1x1 patches) -> 64x64 = 4096
              (+ 256 text)
  kandinsky5  Kandinsky 5 Lite 2B (video), width 1792, 32 blocks: 768x512, 121 frames
              -> 31x32x48 = 47616 (+ 256 text tokens as cross-attention context)
  hidream_o1  HiDream-O1, Qwen3-VL-8B decoder, width 4096, 36 layers: 2048x2048 (its default
              size; 32-pixel patches of the pixels) -> 64x64 = 4096 (+ 128 prompt tokens in
              front, the whole sequence as any patched model runs it)
--quick uses fewer frames / smaller images (same widths); --size name=WxH[xF] overrides one.
On one CPU core a plain Wan 14B block at full size takes about 8 minutes: time --quick first.

The hook: `hook(family: str, case: BlockCase, ratio: float)` returns None for a family it does
not handle, else a merged block: called with a fresh full-length argument dict (as `case.args()`
makes it) it returns what `case.original_block` would; `merged_tokens` is the image token count
it runs on; `build_plan()` builds its plan again (timed apart; the block calls reuse the plan,
as the blocks of a group do). bench/speed/dit_toma.py's is the default; the pack is importable as
`toma_pack` (bench.shared.config.setup_comfy). A --baseline-hook (e.g. ToMA of another checkout)
is timed in the same interleaved repetitions as "toma baseline" rows (its own projected model
too); the toma rows then give over_base (lo/hi): the baseline's time / toma's, per repetition.

Writes nothing unless --out: then the JSON there and the same report as .md beside it (machine,
commit, command, notes, table, targets, flags).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import logging
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..shared.common import (
    MIN_REPS,
    Timing,
    commit,
    cpu_features,
    cpu_model,
    goal,
    interleaved,
    machine_info,
    markdown_table,
    report_head,
    speedup,
    versus_lower_bound,
    write_result,
)
from ..shared.model_configs import hidream_o1_prompt_ids
from ..shared.weights import fill_weights

log = logging.getLogger(__name__)

RATIO = 0.5
DEFAULT_HOOK = "bench.speed.dit_toma:hook"
VIDEO_TARGET = 2.2          # projected whole-model speedup of video at ratio 0.5
LB_TARGET = 1.10            # ToMA within 10% of its lower bound
# held to VIDEO_TARGET
VIDEO_FAMILIES = ("wan22_5b", "wan14b", "wan_animate14b", "ltx2", "ltxv", "kandinsky5",
                  "minimax_h3")
KIND_NAMES = {"d": "double", "s": "single"}
COLUMNS = ("family", "variant", "ratio", "image_tokens", "text_tokens", "ms", "spread", "reps",
           "speedup", "speedup_lo", "speedup_hi", "vs_lb", "lb_speedup", "plan_ms",
           "err_update", "flag", "note")


@dataclass(frozen=True)
class Size:
    """A generation's size in pixels (frames for video) and how it becomes tokens."""

    width: int
    height: int
    frames: int = 1
    spatial: int = 8        # VAE downscale
    temporal: int = 4       # VAE frame compression (video): latent frames (frames-1)//temporal + 1
    patch: int = 2          # spatial patch of the transformer

    def grid(self) -> tuple[int, int, int]:
        """Image tokens (t, h, w): latent frames, ceil(latent / patch) per side."""
        t = (self.frames - 1) // self.temporal + 1 if self.frames > 1 else 1
        return (t, math.ceil(self.height / self.spatial / self.patch),
                math.ceil(self.width / self.spatial / self.patch))


@dataclass(frozen=True)
class FullLengthBlock:
    """A block the model runs between its main blocks outside the "dit" patches (Wan Animate's
    face adapter blocks), so on every image token whether ToMA merges the main blocks or not:
    its name, how many the model has, and one call of it on full-length inputs."""

    name: str
    count: int
    call: Callable[[], Any]


@dataclass(frozen=True)
class BlockCase:
    """One family's block and full-length inputs, as ComfyUI's block loop hands them over.

    family: name; block: ComfyUI's block module; grid: image tokens (t, h, w), row-major in
    the sequence; text_tokens: text length; depth: blocks in the real model; args(keep): fresh
    arguments in the family's "dit" replace form (img/txt/vec/pe/transformer_options, ...; for
    Lumina-style models, which have no replace patches, the same form for the object patch's
    call), with only the first `keep` image tokens (None: all) — the lower bound uses it;
    original_block(args) -> {"img", ...}: runs the block like ComfyUI's `original_block`;
    image_out(out) -> the image tokens of an output (for the error); kind: the skip_blocks
    letter of the block's kind in a family of two ("d" double, "s" single), else "";
    protect_frames: leading frames of the grid that never merge (a reference frame in front);
    prefix_tokens: tokens in front of the grid in the block's one stream that never merge (a
    packed sequence's text, conditioning and audio);
    full_length: the model's blocks that always run on every image token (timed beside the
    block, costed unmerged in the projection).

    Object-patched blocks (HiDream, Kandinsky 5) take args by their forward's own parameter
    names instead, and original_block returns their outputs by the pack's names for them.
    """

    family: str
    block: torch.nn.Module
    grid: tuple[int, int, int]
    text_tokens: int
    depth: int
    args: Callable[..., dict]
    original_block: Callable[[dict], dict]
    image_out: Callable[[dict], torch.Tensor]
    kind: str = ""
    protect_frames: int = 0
    full_length: tuple[FullLengthBlock, ...] = ()
    prefix_tokens: int = 0

    @property
    def image_tokens(self) -> int:
        return math.prod(self.grid)

    @property
    def protected_tokens(self) -> int:
        """Image tokens of the leading frames that never merge (protect_frames)."""
        return self.protect_frames * self.grid[1] * self.grid[2]

    @property
    def label(self) -> str:
        """The rows' family: the name, and the block kind in a family of two."""
        return f"{self.family} {KIND_NAMES[self.kind]}" if self.kind else self.family


# Shared input helpers -----------------------------------------------------------------------------
def _fill(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """bench.shared.weights' seeded fill, in eval mode."""
    return fill_weights(module, seed).eval()


def _ops() -> dict[str, Any]:
    import comfy.ops

    return {"operations": comfy.ops.disable_weight_init, "device": torch.device("cpu"),
            "dtype": torch.float32}


def smooth_tokens(grid: tuple[int, int, int], width: int, seed: int) -> torch.Tensor:
    """Image tokens [1, t*h*w, width] in (t, h, w) row-major order: a smooth random field
    (coarse noise upsampled in all three axes) plus a little white noise, the way latent tokens
    resemble their neighbours in space and time."""
    t, h, w = grid
    g = torch.Generator().manual_seed(seed)
    coarse = torch.randn(1, width, max(1, t // 4), max(1, h // 8), max(1, w // 8), generator=g)
    field = F.interpolate(coarse, size=(t, h, w), mode="trilinear", align_corners=False)
    tokens = field.flatten(2).transpose(1, 2)
    return tokens + 0.1 * torch.randn(tokens.shape, generator=g)


def grid_ids(grid: tuple[int, int, int], offset: tuple[float, float, float] = (0, 0, 0)
             ) -> torch.Tensor:
    """Position ids [1, t*h*w, 3] (frame, row, column) + offset, row-major."""
    t, h, w = grid
    axes = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    ids = torch.stack(axes, -1).reshape(1, -1, 3).float()
    return ids + torch.tensor(offset, dtype=torch.float32)


def _rope(ids: torch.Tensor, head_dim: int, theta: float, axes: list[int]) -> torch.Tensor:
    """ComfyUI's EmbedND rows for `ids` [1, L, n]: [1, 1, L, head_dim/2, 2, 2]."""
    from comfy.ldm.flux.layers import EmbedND

    return EmbedND(dim=head_dim, theta=theta, axes_dim=axes)(ids)


# Families ---------------------------------------------------------------------------------------
def wan_case(name: str, dim: int, ffn: int, depth: int, size: Size, text: int = 512,
             image_context: int = 0, lead_frames: int = 0) -> BlockCase:
    """WanAttentionBlock at width `dim` (heads of 128): text cross-attention, or with
    `image_context` CLIP image tokens before the text, image-to-video cross-attention;
    `lead_frames` frames in front of the video's (a reference frame), which never merge."""
    from comfy.ldm.wan.model import WanAttentionBlock

    heads = dim // 128
    cross = "i2v_cross_attn" if image_context else "t2v_cross_attn"
    block = _fill(WanAttentionBlock(cross, dim, ffn, heads, qk_norm=True, cross_attn_norm=True,
                                    eps=1e-6, operation_settings=_ops()), 1)
    t, h, w = size.grid()
    grid = (t + lead_frames, h, w)
    img = smooth_tokens(grid, dim, 2)
    g = torch.Generator().manual_seed(3)
    txt = torch.randn(1, image_context + text, dim, generator=g)
    vec = torch.randn(1, 1, 6, dim, generator=g) * 0.1   # e0: one timestep per item
    d = dim // heads
    freqs = _rope(grid_ids(grid), d, 10000.0,
                  [d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6)]).movedim(1, 2)  # [1, L, 1, ...]

    def args(keep: int | None = None) -> dict:
        n = keep or img.shape[1]
        return {"img": img[:, :n].clone(), "txt": txt, "vec": vec, "pe": freqs[:, :n],
                "transformer_options": {}}

    def original(a: dict) -> dict:
        return {"img": block(a["img"], context=a["txt"], e=a["vec"], freqs=a["pe"],
                             context_img_len=image_context or None,
                             transformer_options=a["transformer_options"])}

    return BlockCase(name, block, grid, text, depth, args, original, lambda out: out["img"],
                     protect_frames=lead_frames)


# Wan 2.2 Animate: ComfyUI's AnimateWanModel runs face adapter block i // 5 after every fifth
# main block; its FaceEncoder gives 4 motion tokens per latent frame plus 1 padding token.
ANIMATE_FACE_EVERY = 5
ANIMATE_FACE_TOKENS = 5
CLIP_IMAGE_TOKENS = 257


def wan_animate_case(name: str, size: Size) -> BlockCase:
    """Wan 2.2 Animate 14B: Wan 2.1 image-to-video's block (width 5120, 40 blocks) on the
    video with WanAnimateToVideo's reference frame in front (never merged), and its face
    adapter block (FaceBlock: a query and an output projection on every video token,
    attending per frame to that frame's motion tokens), one after every fifth main block, on
    the full-length video."""
    from comfy.ldm.wan.model_animate import FaceBlock

    dim, depth = 5120, 40
    case = wan_case(name, dim, 13824, depth, size, image_context=CLIP_IMAGE_TOKENS,
                    lead_frames=1)
    face = _fill(FaceBlock(dim, dim // 128, qk_norm=True, qk_norm_type="rms", **_ops()), 4)
    x = case.args()["img"]
    motion = torch.randn(1, case.grid[0], ANIMATE_FACE_TOKENS, dim,
                         generator=torch.Generator().manual_seed(5))
    return dataclasses.replace(case, full_length=(
        FullLengthBlock("face", depth // ANIMATE_FACE_EVERY, lambda: face(x, motion)),))


def qwen_case(name: str, size: Size, text: int = 256) -> BlockCase:
    """QwenImageTransformerBlock at Qwen-Image size (width 3072, 24 heads of 128)."""
    import comfy.ldm.qwen_image.model as qwen

    dim, heads, head_dim = 3072, 24, 128
    block = _fill(qwen.QwenImageTransformerBlock(dim, heads, head_dim, operations=_ops()[
        "operations"], dtype=torch.float32), 1)
    grid = size.grid()
    img = smooth_tokens(grid, dim, 2)
    g = torch.Generator().manual_seed(3)
    txt = torch.randn(1, text, dim, generator=g)
    temb = torch.randn(1, dim, generator=g)
    # Image ids centred, text ids on the diagonal after them (QwenImage._forward).
    _, h, w = grid
    img_ids = grid_ids(grid, (0, -(h // 2), -(w // 2)))
    start = max(h, w) // 2
    txt_ids = torch.arange(start, start + text).float().reshape(1, -1, 1).repeat(1, 1, 3)
    pe = _rope(torch.cat((txt_ids, img_ids), 1), head_dim, 10000, [16, 56, 56])
    # v0.3.64 applies RoPE on [B, L, H, D] with rows [B, L, 1, ...]; later on [B, H, L, D].
    pe_axis = 2 if hasattr(qwen, "apply_rope1") else 1
    if pe_axis == 1:
        pe = pe.squeeze(1).unsqueeze(2)

    def args(keep: int | None = None) -> dict:
        n = keep or img.shape[1]
        return {"img": img[:, :n].clone(), "txt": txt.clone(), "vec": temb,
                "pe": pe.narrow(pe_axis, 0, text + n), "transformer_options": {}}

    def original(a: dict) -> dict:
        txt_out, img_out = block(hidden_states=a["img"], encoder_hidden_states=a["txt"],
                                 encoder_hidden_states_mask=None, temb=a["vec"],
                                 image_rotary_emb=a["pe"],
                                 transformer_options=a["transformer_options"])
        return {"txt": txt_out, "img": img_out}

    return BlockCase(name, block, grid, text, 60, args, original, lambda out: out["img"])


def sd35_case(name: str, size: Size, text: int = 154) -> BlockCase:
    """SD3.5 Large's JointBlock (depth 38: width 2432, 38 heads of 64, RMS q/k norm)."""
    from comfy.ldm.modules.diffusionmodules.mmdit import JointBlock

    depth = 38
    dim = 64 * depth
    ops = _ops()
    block = _fill(JointBlock(dim, depth, mlp_ratio=4.0, qkv_bias=True, attn_mode="torch",
                             pre_only=False, rmsnorm=False, scale_mod_only=False, swiglu=False,
                             qk_norm="rms", x_block_self_attn=False, dtype=ops["dtype"],
                             device=ops["device"], operations=ops["operations"]), 1)
    grid = size.grid()
    img = smooth_tokens(grid, dim, 2)
    g = torch.Generator().manual_seed(3)
    txt = torch.randn(1, text, dim, generator=g)
    vec = torch.randn(1, dim, generator=g)

    def args(keep: int | None = None) -> dict:
        n = keep or img.shape[1]
        return {"img": img[:, :n].clone(), "txt": txt.clone(), "vec": vec,
                "transformer_options": {}}

    def original(a: dict) -> dict:
        txt_out, img_out = block(a["txt"], a["img"], c=a["vec"],
                                 transformer_options=a["transformer_options"])
        return {"txt": txt_out, "img": img_out}

    return BlockCase(name, block, grid, text, depth, args, original, lambda out: out["img"])


def z_image_case(name: str, size: Size, text: int = 256) -> BlockCase:
    """Z-Image's JointTransformerBlock (width 3840, 30 heads of 128, RoPE 32+48+48, theta 256).

    No "dit" replace patches in Lumina-family models: args here are {"img": text + image
    sequence, "pe", "vec", "mask", "transformer_options"}, and original_block calls the layer
    the way NextDiT's loop does; a ToMA hook object-patches the layer's forward.
    """
    import inspect

    from comfy.ldm.lumina.model import JointTransformerBlock

    if "z_image_modulation" not in inspect.signature(JointTransformerBlock).parameters:
        raise RuntimeError("this ComfyUI has no Z-Image")
    dim, heads, head_dim = 3840, 30, 128
    block = _fill(JointTransformerBlock(0, dim, heads, heads, 256, 8.0 / 3.0, 1e-5, True,
                                        modulation=True, z_image_modulation=True,
                                        operation_settings=_ops()), 1)
    grid = size.grid()
    img = smooth_tokens(grid, dim, 2)
    g = torch.Generator().manual_seed(3)
    txt = torch.randn(1, text, dim, generator=g)
    adaln = torch.randn(1, 256, generator=g)
    # Text ids (i + 1, 0, 0), image ids (text + 1, row, column) (NextDiT.patchify_and_embed).
    cap_ids = torch.zeros(1, text, 3)
    cap_ids[..., 0] = torch.arange(text) + 1.0
    ids = torch.cat((cap_ids, grid_ids(grid, (text + 1.0, 0, 0))), 1)
    freqs = _rope(ids, head_dim, 256.0, [32, 48, 48]).movedim(1, 2)   # [1, L, 1, ...]

    def args(keep: int | None = None) -> dict:
        n = keep or img.shape[1]
        return {"img": torch.cat((txt, img[:, :n]), 1), "pe": freqs[:, :text + n],
                "vec": adaln, "mask": None, "transformer_options": {}}

    def original(a: dict) -> dict:
        return {"img": block(a["img"], a["mask"], a["pe"], a["vec"],
                             transformer_options=a["transformer_options"])}

    return BlockCase(name, block, grid, text, 30, args, original,
                     lambda out: out["img"][:, text:])



# LTX (comfy/ldm/lightricks) ---------------------------------------------------------------------
FRAME_RATE = 25        # the LTX nodes' default


class _CapturedError(Exception):
    """Raised by the capturing patch: the block's arguments are in hand, the call can stop."""


def capture_block(call: Callable[[dict], Any]) -> tuple[dict, Callable]:
    """(arguments, original_block) of a model's block 0 as its own forward hands them to a
    "dit" replace patch: `call(transformer_options)` runs the model's forward, which stops at
    the block. Arguments are exactly what sampling gives the block (RoPE, timestep rows and
    their held form on every ComfyUI version), not a copy of the model's preprocessing."""
    return capture_blocks(call, (("double_block", 0),))[0]


def capture_blocks(call: Callable[[dict], Any], keys: tuple[tuple[str, int], ...]
                   ) -> list[tuple[dict, Callable]]:
    """capture_block for several "dit" keys in the order the forward reaches them: blocks
    before the last run (their output feeds the next), the forward stops at the last."""
    found: list[tuple[dict, Callable]] = []

    def patch(args: dict, extra: dict) -> dict:
        found.append((args, extra["original_block"]))
        if len(found) == len(keys):
            raise _CapturedError
        return extra["original_block"](args)

    options = {"patches_replace": {"dit": dict.fromkeys(keys, patch)}}
    try:
        call(options)
    except _CapturedError:
        pass
    if len(found) != len(keys):
        raise RuntimeError(f"the model ran {len(found)} of the replace patches {keys}")
    return found


def capture_forwards(call: Callable[[], Any], modules: list[torch.nn.Module]) -> list[dict]:
    """The arguments each of `modules` (blocks without replace patches) gets from the model's
    own forward, by its forward's parameter names, in the order the forward reaches them:
    `call()` runs the forward; modules before the last run, the forward stops at the last."""
    import inspect

    found: list[dict] = []

    def recorder(module: torch.nn.Module, last: bool) -> Callable:
        original = module.forward
        signature = inspect.signature(original)

        def forward(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            found.append(dict(bound.arguments))
            if last:
                raise _CapturedError
            return original(*args, **kwargs)

        return forward

    for i, module in enumerate(modules):
        module.forward = recorder(module, i == len(modules) - 1)
    try:
        call()
    except _CapturedError:
        pass
    finally:
        for module in modules:      # the class's forward again
            del module.forward
    if len(found) != len(modules):
        raise RuntimeError(f"the model's forward reached {len(found)} of {len(modules)} blocks")
    return found


def keep_grid(x: torch.Tensor, axis: int, start: int, tokens: int, keep: int) -> torch.Tensor:
    """A copy of x with only the first `keep` of its `tokens` grid tokens (from `start` along
    `axis`): what comes before and after the grid unchanged (the lower bound's input). Always
    a new tensor: some blocks update their input in place."""
    if keep >= tokens:
        return x.clone()
    after = x.shape[axis] - start - tokens
    return torch.cat((x.narrow(axis, 0, start + keep), x.narrow(axis, start + tokens, after)),
                     axis)


def one_block_model(cls: type, strip: tuple[str, ...], **config: Any) -> torch.nn.Module:
    """ComfyUI's model `cls` at the real config (with the block counts in `config` set to one
    block of each kind), seeded weights, CPU fp32. Built on the meta device first so that
    `strip` (parts the forward does not use, such as LTX-2's text connectors, ~1B parameters)
    never take memory."""
    import comfy.patcher_extension  # noqa: F401  (some models' forward needs it imported)

    ops = _ops()
    model = cls(dtype=ops["dtype"], device=torch.device("meta"), operations=ops["operations"],
                **config)
    for name in strip:
        setattr(model, name, torch.nn.Identity())
    return _fill(model.to_empty(device="cpu"), 1)


def latent_video(grid: tuple[int, int, int], channels: int, seed: int) -> torch.Tensor:
    """A smooth latent [1, channels, t, h, w] (smooth_tokens laid out as a video latent):
    after the 1x1x1 patch embedding its tokens resemble their neighbours as real ones do."""
    t, h, w = grid
    return smooth_tokens(grid, channels, seed).transpose(1, 2).reshape(1, channels, t, h, w)


def _narrow_tokens(value: Any, n: int, length: int) -> Any:
    """LTX RoPE rows (rotation [B, L, H, D/2, 2, 2], split flag) cut to the first n of
    `length` tokens; anything else as it is."""
    if isinstance(value, tuple):
        return tuple(_narrow_tokens(v, n, length) for v in value)
    if torch.is_tensor(value) and value.dim() > 2 and value.shape[1] == length:
        return value[:, :n]
    return value


def ltx2_case(name: str, size: Size, text: int = 1024) -> BlockCase:
    """LTX-2 (LTXAVModel, 19B): BasicAVTransformerBlock, video width 4096 (32 heads of 128),
    audio width 2048 (32 heads of 64), text as cross-attention context, 48 blocks.

    The arguments come from LTXAVModel's own forward (capture_block) on a t2v call: video
    latent [1, 128, t, h, w], audio latent [1, 8, frames / 25 fps x 25, 16] (the audio VAE's
    25 latents a second, LTXVEmptyLatentAudio), Gemma 3 text after the connectors [1, 1024,
    2 x 3840] (padded to 1024 with registers), one timestep; RoPE in its split form with
    float64 frequencies (the checkpoint's config chooses; the block's cost is the same either
    way). args: {"img": (video, audio), v_context, v_pe, ... as the block loop hands them};
    the lower bound cuts the video and its RoPE rows (v_pe, v_cross_pe); audio and text
    unchanged."""
    try:
        from comfy.ldm.lightricks.av_model import LTXAVModel
    except ImportError as exc:
        raise RuntimeError("this ComfyUI has no LTX-2") from exc
    model = one_block_model(LTXAVModel, ("video_embeddings_connector",
                                         "audio_embeddings_connector"), num_layers=1,
                            rope_type="split", frequencies_precision="float64")
    grid = size.grid()
    # LTXVEmptyLatentAudio: frames / frame rate seconds at the audio VAE's 16 kHz / hop 160 /
    # 4x downsampling = 25 latents a second
    audio = round(size.frames / FRAME_RATE * 25)
    g = torch.Generator().manual_seed(3)
    vx = latent_video(grid, 128, 2)
    ax = torch.randn(1, 8, audio, 16, generator=g)
    context = torch.randn(1, text, 2 * 3840, generator=g)
    sigma = torch.full((1,), 0.7)
    with torch.inference_mode():
        captured, original = capture_block(lambda options: model(
            [vx, ax], (sigma, sigma), context, frame_rate=FRAME_RATE,
            transformer_options=options))
    block = model.transformer_blocks[0]
    full = math.prod(grid)

    def args(keep: int | None = None) -> dict:
        n = keep or full
        video, sound = captured["img"]
        out = {**captured, "img": (video[:, :n].clone(), sound.clone()),
               "transformer_options": {}}
        for key in ("v_pe", "v_cross_pe"):
            out[key] = _narrow_tokens(captured[key], n, full)
        return out

    return BlockCase(name, block, grid, text, 48, args, original, lambda out: out["img"][0])


def minimax_h3_case(name: str, size: Size, text: int = 512) -> BlockCase:
    """MiniMax H3 (MiniMaxH3Model's defaults: width 5376, 56 heads of 128, 50 blocks): one
    packed sequence [text | audio | video] per call, batch size one, the stream [L, C] without
    a batch axis. The arguments come from the model's own forward (capture_block) on a text to
    video call: video latent [1, 24, t, h, w] (t from the 17k+5 frame grid at 24 fps: 5 frames
    -> 2), stereo audio latent [1, 32, 2, frames / 24 fps x 40], the prompt's states at the
    model's width (its token refiner then runs no layer), one timestep. The lower bound cuts
    the video, its RoPE rows and its modulation segment; text and audio unchanged."""
    try:
        from comfy.ldm.minimax.model import MiniMaxH3Model
    except ImportError as exc:
        raise RuntimeError("this ComfyUI has no MiniMax H3") from exc
    # requires_grad off: its fused RoPE runs in place, which autograd refuses (ComfyUI samples
    # without gradients)
    model = one_block_model(MiniMaxH3Model, ("token_refiner", "condition_proj"),
                            num_layers=1).requires_grad_(False)
    model.rope.inv_freq.copy_(10000.0 ** (-torch.arange(16, dtype=torch.float32) / 16))
    frames = 2 if size.frames <= 5 else (size.frames - 5) // 17 * 5 + 2
    h, w = size.height // size.spatial // size.patch, size.width // size.spatial // size.patch
    grid, audio = (frames, h, w), round(size.frames / 24 * 40)
    g = torch.Generator().manual_seed(3)
    vx = latent_video((frames, 2 * h, 2 * w), 24, 2)
    ax = torch.randn(1, 32, 2, audio, generator=g)
    context = torch.randn(1, text, 5376, generator=g)
    sigma = torch.full((1,), 700.0)
    with torch.inference_mode():
        captured, original = capture_block(lambda options: model(
            [vx, ax], sigma, context, transformer_options=options))
    block, full = model.blocks[0], math.prod(grid)
    prefix = captured["img"].shape[0] - full

    def args(keep: int | None = None) -> dict:
        n = prefix + (keep or full)
        *before, (start, _, row) = captured["mod_segments"]
        return {**captured, "img": captured["img"][:n].clone(),
                "rope_freqs": captured["rope_freqs"][:, :n],
                "mod_segments": [*before, (start, n, row)], "transformer_options": {}}

    return BlockCase(name, block, grid, prefix, 50, args, original,
                     lambda out: out["img"][prefix:].unsqueeze(0), prefix_tokens=prefix)


class _LastTextLayer(torch.nn.Module):
    """Stands in for Krea 2's text fusion stack (12 layers at width 2560 that run on the text
    alone, once per call): the last layer's states [B, L, layers, D] -> [B, L, D]."""

    def forward(self, x: torch.Tensor, **_: Any) -> torch.Tensor:
        return x[:, :, -1]


def krea2_case(name: str, size: Size, text: int = 256, **config: Any) -> BlockCase:
    """Krea 2 (SingleStreamDiT's defaults in comfy/ldm/krea2: width 6144, 48 query and 12
    key/value heads of 128, 28 blocks): one sequence [text | image] per call, the blocks
    object-patched (no replace patches). Arguments from the model's own forward
    (capture_forwards) on a text to image call: latent [1, 16, H/8, W/8] in 2x2 patches,
    Qwen3-VL states of `text` tokens from 12 layers [1, text, 12 x 2560] (the text fusion
    stack stood in for by its last layer's states: it runs once per call, outside the blocks),
    one timestep. The lower bound cuts the image and its RoPE rows; the text unchanged.
    config: other SingleStreamDiT settings (tests: a narrow model)."""
    try:
        from comfy.ldm.krea2.model import SingleStreamDiT
    except ImportError as exc:
        raise RuntimeError("this ComfyUI has no Krea 2") from exc
    model = one_block_model(SingleStreamDiT, (), **{"layers": 1, **config})
    model.txtfusion = _LastTextLayer()
    grid = size.grid()
    x = latent_image(grid, model.channels, 2, model.patch)
    g = torch.Generator().manual_seed(3)
    context = torch.randn(1, text, model.txtlayers * model.txtdim, generator=g)
    block = model.blocks[0]
    with torch.inference_mode():
        (captured,) = capture_forwards(lambda: model(x, torch.full((1,), 0.7), context),
                                       [block])
    full = math.prod(grid)

    def args(keep: int | None = None) -> dict:
        n = text + (keep or full)
        return {**captured, "x": captured["x"][:, :n].clone(),
                "freqs": captured["freqs"][:, :, :n], "transformer_options": {}}

    def original(a: dict) -> dict:
        return {"x": block(**a)}

    return BlockCase(name, block, grid, text, 28, args, original,
                     lambda out: out["x"][:, text:])


def ltxv_case(name: str, size: Size, text: int = 128) -> BlockCase:
    """LTX-Video 2B (LTXVModel's defaults, the 0.9.x 2B models): BasicTransformerBlock at width
    2048 (32 heads of 64), T5 text [1, 128, 4096] (padded to 128) with its attention mask as
    cross-attention context, 28 blocks; arguments from LTXVModel's own forward
    (capture_block), one timestep. The lower bound cuts the video and its RoPE rows."""
    from comfy.ldm.lightricks.model import LTXVModel

    model = one_block_model(LTXVModel, (), num_layers=1)
    grid = size.grid()
    g = torch.Generator().manual_seed(3)
    x = latent_video(grid, 128, 2)
    context = torch.randn(1, text, 4096, generator=g)
    mask = torch.ones(1, text, dtype=torch.long)
    with torch.inference_mode():
        captured, original = capture_block(lambda options: model(
            x, torch.full((1,), 0.7), context, mask, frame_rate=FRAME_RATE,
            transformer_options=options))
    block = model.transformer_blocks[0]
    full = math.prod(grid)

    def args(keep: int | None = None) -> dict:
        n = keep or full
        return {**captured, "img": captured["img"][:, :n].clone(),
                "pe": _narrow_tokens(captured["pe"], n, full), "transformer_options": {}}

    return BlockCase(name, block, grid, text, 28, args, original, lambda out: out["img"])


# Families of ComfyUI 0.33 built as one-block models --------------------------------------------
def hidream_cases(name: str, size: Size, text: int = 128) -> tuple[BlockCase, BlockCase]:
    """HiDream-I1 (Full, Dev and Fast share it; model_detection's config): width 2560 (20 heads
    of 128), 16 double and 32 single blocks, each with a MoE feed-forward of 4 routed experts
    (2 active per token) beside a shared one; RoPE 64+32+32. Cases of double block 0 and
    single block 0, their arguments from the model's own forward (capture_forwards) on a t2i
    call: latent [1, 16, H/8, W/8] (2x2 patches), T5 [1, 128, 4096] and Llama 3.1 states
    [1, layers, 128, 4096] (ComfyUI's tokenizers pad both to 128), pooled CLIP [1, 2048].
    Double block: image_tokens [1, N, 2560], text_tokens [1, 3 x 128, 2560] (T5, the last
    Llama layer, this block's layer); single block: image_tokens [1, N + 384, 2560], image
    first; rope [1, N + 384, 1, 64, 2, 2] over [image; text] in both. The lower bound cuts
    the image and its RoPE rows."""
    from comfy.ldm.hidream.model import HiDreamImageTransformer2DModel

    model = one_block_model(HiDreamImageTransformer2DModel, (), num_layers=1,
                            num_single_layers=1, patch_size=2, in_channels=16, out_channels=16,
                            attention_head_dim=128, num_attention_heads=20,
                            caption_channels=[4096, 4096], text_emb_dim=2048,
                            num_routed_experts=4, num_activated_experts=2,
                            axes_dims_rope=[64, 32, 32], max_resolution=[128, 128],
                            llama_layers=[0, 1])   # one Llama layer per block, as in the model
    grid = size.grid()
    g = torch.Generator().manual_seed(3)
    x = latent_image(grid, 16, 2, 2)
    t5 = torch.randn(1, text, 4096, generator=g)
    llama = torch.randn(1, 2, text, 4096, generator=g)
    pooled = torch.randn(1, 2048, generator=g)
    double_block, single_block = model.double_stream_blocks[0], model.single_stream_blocks[0]
    with torch.inference_mode():
        double, single = capture_forwards(lambda: model(x, torch.full((1,), 0.7), pooled, t5,
                                                        llama), [double_block, single_block])
    full = math.prod(grid)

    def double_args(keep: int | None = None) -> dict:
        n = keep or full
        return {**double, "image_tokens": double["image_tokens"][:, :n].clone(),
                "text_tokens": double["text_tokens"].clone(),
                "rope": keep_grid(double["rope"], 1, 0, full, n), "transformer_options": {}}

    def single_args(keep: int | None = None) -> dict:
        n = keep or full
        return {**single, "image_tokens": keep_grid(single["image_tokens"], 1, 0, full, n),
                "rope": keep_grid(single["rope"], 1, 0, full, n), "transformer_options": {}}

    def double_call(a: dict) -> dict:
        img, txt = double_block(**a)
        return {"image_tokens": img, "text_tokens": txt}

    def single_call(a: dict) -> dict:
        return {"image_tokens": single_block(**a)}

    def image(out: dict) -> torch.Tensor:
        return out["image_tokens"][:, :full]

    text_len = double["text_tokens"].shape[1]
    return (BlockCase(name, double_block, grid, text_len, 16, double_args, double_call, image,
                      "d"),
            BlockCase(name, single_block, grid, text_len, 32, single_args, single_call, image,
                      "s"))


def hunyuan_image_cases(name: str, size: Size, text: int = 256) -> tuple[BlockCase, BlockCase]:
    """HunyuanImage 2.1 (HunyuanVideo's class with 2-D 1x1 patches, supported_models'
    HunyuanImage21; the checkpoint's config): width 3584 (28 heads of 128), 20 double and 40
    single blocks, RoPE 64+64 (theta 256), a 64-channel latent at 32x32 pixels a token.
    Arguments from the model's own forward (capture_blocks) on a t2i call: latent
    [1, 64, H/32, W/32], Qwen2.5-VL states [1, 256, 3584] (a prompt with its template; no
    quoted text, so no ByT5 glyph tokens), one timestep. ComfyUI 0.33 puts the text first:
    double block img [1, N, 3584] and txt [1, 256, 3584], single block img [1, 256 + N, 3584];
    pe [1, 1, 256 + N, 64, 2, 2] over [text; image]. The lower bound cuts the image and its
    RoPE rows."""
    from comfy.ldm.hunyuan_video.model import HunyuanVideo

    model = one_block_model(HunyuanVideo, (), depth=1, depth_single_blocks=1,
                            image_model="hunyuan_video", in_channels=64, out_channels=64,
                            vec_in_dim=None, context_in_dim=3584, hidden_size=3584,
                            mlp_ratio=4.0, num_heads=28, axes_dim=[64, 64], theta=256,
                            patch_size=[1, 1], qkv_bias=True, guidance_embed=False, byt5=False,
                            meanflow=False, use_cond_type_embedding=False, vision_in_dim=None,
                            meanflow_sum=False)
    if getattr(model.double_blocks[0], "flipped_img_txt", False):
        raise RuntimeError("this ComfyUI puts HunyuanImage's image before its text; the bench "
                           "lays out ComfyUI 0.33's text first")
    grid = size.grid()
    g = torch.Generator().manual_seed(3)
    x = latent_image(grid, 64, 2, 1)
    context = torch.randn(1, text, 3584, generator=g)
    with torch.inference_mode():
        (double, _), (single, _) = capture_blocks(
            lambda options: model(x, torch.full((1,), 0.7), context,
                                  transformer_options=options),
            (("double_block", 0), ("single_block", 0)))
    full, txt = math.prod(grid), double["txt"].shape[1]
    double_block, single_block = model.double_blocks[0], model.single_blocks[0]

    # ComfyUI's block_wrap closures, written out: theirs call whichever block the loop
    # variable held last (the single block, once the forward stopped there)
    def double_call(a: dict) -> dict:
        img, text_out = double_block(img=a["img"], txt=a["txt"], vec=a["vec"], pe=a["pe"],
                                     attn_mask=a["attention_mask"],
                                     modulation_dims_img=a["modulation_dims_img"],
                                     modulation_dims_txt=a["modulation_dims_txt"],
                                     transformer_options=a["transformer_options"])
        return {"img": img, "txt": text_out}

    def single_call(a: dict) -> dict:
        return {"img": single_block(a["img"], vec=a["vec"], pe=a["pe"],
                                    attn_mask=a["attention_mask"],
                                    modulation_dims=a["modulation_dims"],
                                    transformer_options=a["transformer_options"])}

    def double_args(keep: int | None = None) -> dict:
        n = keep or full
        return {**double, "img": double["img"][:, :n].clone(), "txt": double["txt"].clone(),
                "pe": keep_grid(double["pe"], 2, txt, full, n), "transformer_options": {}}

    def single_args(keep: int | None = None) -> dict:
        n = keep or full
        return {**single, "img": keep_grid(single["img"], 1, txt, full, n),
                "pe": keep_grid(single["pe"], 2, txt, full, n), "transformer_options": {}}

    return (BlockCase(name, double_block, grid, txt, 20, double_args, double_call,
                      lambda out: out["img"], "d"),
            BlockCase(name, single_block, grid, txt, 40, single_args, single_call,
                      lambda out: out["img"][:, txt:txt + full], "s"))


def token_smooth_pixels(grid: tuple[int, int, int], patch: int) -> torch.Tensor:
    """Pixels [1, 3, h * patch, w * patch] whose patches resemble their neighbours as the
    latent tokens of the 2x2-patch families do: latent_image's field over a grid with two
    pixels a token, upsampled (bilinear) to `patch` pixels a token. (latent_image at 32-pixel
    patches would vary within a patch as much as between 2x2 patches: neighbouring 32-pixel
    tokens nearly unrelated, unlike a picture's.)"""
    _, h, w = grid
    coarse = latent_image(grid, 3, 2, 2)
    return F.interpolate(coarse, size=(h * patch, w * patch), mode="bilinear",
                         align_corners=False)


HIDREAM_O1_PATCH = 32           # HiDream-O1's pixel patch


@dataclass(frozen=True)
class HiDreamO1Case:
    """One generation: its name, prompt length (chat template included) and reference count."""

    name: str
    prompt: int
    references: int


def build_hidream_o1(text: dict[str, Any] | None = None) -> torch.nn.Module:
    """HiDreamO1Transformer at the real width (or with the decoder settings `text`) with one
    decoder layer; the vision tower is dropped (reference images enter as their token counts:
    the ViT's output is computed once per generation, outside the layers)."""
    from comfy.ldm.hidream_o1.model import HiDreamO1Transformer

    return one_block_model(HiDreamO1Transformer, ("visual",),
                           text_config_overrides={**(text or {}), "num_hidden_layers": 1})


def hidream_o1_conditioning(case: HiDreamO1Case, x: torch.Tensor) -> dict[str, Any]:
    """The model's extra conditioning as ComfyUI's HiDream-O1 model builds it for `case`:
    prompt ids [1, P] ending in the tms token; with a reference, a white image of the target's
    size, its ViT tokens spliced into the prompt (their pixel values left out: see
    build_hidream_o1)."""
    from comfy.ldm.hidream_o1.conditioning import build_extra_conds

    ids = hidream_o1_prompt_ids(case.prompt)
    refs = [torch.ones(1, x.shape[-2], x.shape[-1], 3)] * case.references or None
    conds = build_extra_conds(ids, x, ref_images=refs, target_patch_size=HIDREAM_O1_PATCH)
    conds.pop("ref_pixel_values", None)
    conds.pop("ref_image_grid_thw", None)
    conds.pop("token_types")
    return conds


def hidream_o1_case(name: str, size: Size, text: int = 128) -> BlockCase:
    """HiDream-O1 (ComfyUI 0.33): one of its 36 Qwen3-VL-8B decoder layers (width 4096, 32
    query and 8 key/value heads of 128, feed-forward 12288) on [prompt; image] in 32-pixel
    patches, the arguments from the model's own forward as its "dit" replace patch gets them
    (capture_block; build_hidream_o1 and hidream_o1_conditioning build the model and the
    prompt of `text` ids ending in the tms token): x [1, P + N, 4096], RoPE rows (cos, sin,
    -sin) [1, P + N, D].
    The model runs this path, the whole sequence, whenever a block is patched; unpatched it
    keeps the prompt's keys and values across steps (hidream_o1_cache measures that
    difference). The lower bound cuts the image and its RoPE rows."""
    model = build_hidream_o1()
    grid = size.grid()
    x = token_smooth_pixels(grid, HIDREAM_O1_PATCH)
    conds = hidream_o1_conditioning(HiDreamO1Case(name, text, 0), x)
    with torch.inference_mode():
        captured, original = capture_block(lambda options: model(
            x, torch.full((1,), 700.0), transformer_options=options, **conds))
    full, prompt = math.prod(grid), conds["input_ids"].shape[1]

    def args(keep: int | None = None) -> dict:
        n = keep or full
        return {**captured, "x": keep_grid(captured["x"], 1, prompt, full, n),
                "freqs_cis": tuple(keep_grid(t, 1, prompt, full, n)
                                   for t in captured["freqs_cis"]),
                "transformer_options": {}}

    return BlockCase(name, model.language_model.layers[0], grid, prompt, 36, args, original,
                     lambda out: out["x"][:, prompt:prompt + full])


def kandinsky5_case(name: str, size: Size, text: int = 256) -> BlockCase:
    """Kandinsky 5 Lite 2B video (Kandinsky5's defaults in comfy/ldm/kandinsky5): visual
    blocks at width 1792 (28 heads of 64), 32 of them, self-attention over the image tokens
    with 3-D RoPE (16+24+24, scaled 1, 2, 2) and the text as cross-attention context;
    HunyuanVideo's latent (16 channels, 8x8 pixels, 4 frames after the first) in 1x2x2
    patches. Arguments from the model's own forward (capture_forwards) on a t2v call: input
    [1, 33, t, H/8, W/8] (latent, image condition and mask channels, 132 per patch),
    Qwen2.5-VL states [1, 256, 3584] (a prompt with its template) through the two text
    blocks, pooled CLIP [1, 768], one timestep: visual_embed [1, N, 1792], text_embed
    [1, 256, 1792], freqs [1, N, 1, 32, 2, 2]. The lower bound cuts the video and its RoPE
    rows."""
    try:
        from comfy.ldm.kandinsky5.model import Kandinsky5
    except ImportError as exc:
        raise RuntimeError("this ComfyUI has no Kandinsky 5") from exc
    model = one_block_model(Kandinsky5, (), num_visual_blocks=1)
    grid = size.grid()
    g = torch.Generator().manual_seed(3)
    channels = model.visual_embed_dim // math.prod(model.patch_size)
    t, h, w = grid
    x = latent_video((t, 2 * h, 2 * w), channels, 2)
    context = torch.randn(1, text, 3584, generator=g)
    pooled = torch.randn(1, 768, generator=g)
    block = model.visual_transformer_blocks[0]
    with torch.inference_mode():
        (captured,) = capture_forwards(lambda: model(x, torch.full((1,), 0.7), context, pooled),
                                       [block])
    full = math.prod(grid)

    def args(keep: int | None = None) -> dict:
        n = keep or full
        return {**captured, "visual_embed": captured["visual_embed"][:, :n].clone(),
                "text_embed": captured["text_embed"].clone(), "freqs": captured["freqs"][:, :n],
                "transformer_options": {}}

    def original(a: dict) -> dict:
        return {"visual_embed": block(**a)}

    return BlockCase(name, block, grid, text, 32, args, original, lambda out: out["visual_embed"])


def latent_image(grid: tuple[int, int, int], channels: int, seed: int, patch: int
                 ) -> torch.Tensor:
    """A smooth image latent [1, channels, h * patch, w * patch] for the (1, h, w) token grid
    (latent_video of one frame): its patch tokens resemble their neighbours as real ones do."""
    _, h, w = grid
    return latent_video((1, h * patch, w * patch), channels, seed)[:, :, 0]


# name -> (builder, real size, quick size); a builder returns one case, or one per block kind

FAMILIES: dict[str, tuple[Callable[[str, Size], BlockCase | tuple[BlockCase, ...]], Size,
                          Size]] = {
    "wan22_5b": (lambda n, s: wan_case(n, 3072, 14336, 30, s),
                 Size(1280, 704, 121, spatial=16), Size(1280, 704, 9, spatial=16)),
    "wan14b": (lambda n, s: wan_case(n, 5120, 13824, 40, s),
               Size(832, 480, 81), Size(832, 480, 5)),
    "wan_animate14b": (wan_animate_case, Size(832, 480, 81), Size(832, 480, 5)),
    "qwen_image": (qwen_case, Size(1328, 1328), Size(768, 768)),
    "sd35_large": (sd35_case, Size(1024, 1024), Size(768, 768)),
    "z_image": (z_image_case, Size(1024, 1024), Size(768, 768)),
    # LTX's VAE: 32x32 pixels and 8 frames (after the first) per latent token, 1x1x1 patches
    "ltx2": (ltx2_case, Size(768, 512, 121, spatial=32, temporal=8, patch=1),
             Size(768, 512, 17, spatial=32, temporal=8, patch=1)),
    "ltxv": (ltxv_case, Size(768, 512, 97, spatial=32, temporal=8, patch=1),
             Size(768, 512, 17, spatial=32, temporal=8, patch=1)),
    # MiniMax H3's VAE: 16x16 pixels a latent, 2x2 patches; frames on its 17k+5 grid at 24 fps
    "minimax_h3": (minimax_h3_case, Size(1344, 768, 124, spatial=16),
                   Size(1344, 768, 5, spatial=16)),
    "hidream": (hidream_cases, Size(1024, 1024), Size(512, 512)),
    # Krea 2: Wan 2.1's VAE (8x8 pixels, 16 channels), 2x2 patches; 1024x1024 as its templates
    "krea2": (krea2_case, Size(1024, 1024), Size(768, 768)),
    # HunyuanImage 2.1's VAE: 32x32 pixels per latent, 1x1 patches; 2048x2048 is its native size
    "hunyuan_image": (hunyuan_image_cases, Size(2048, 2048, spatial=32, patch=1),
                      Size(1024, 1024, spatial=32, patch=1)),
    "kandinsky5": (kandinsky5_case, Size(768, 512, 121), Size(768, 512, 9)),
    "hidream_o1": (hidream_o1_case, Size(2048, 2048, spatial=32, patch=1),
                   Size(1024, 1024, spatial=32, patch=1)),
}


# Measuring --------------------------------------------------------------------------------------
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def bench_case(case: BlockCase, ratio: float, reps: int, clock: str, merged: Any | None,
               baseline: Any | None = None) -> tuple[list[dict], dict[str, Timing]]:
    """Rows plain / lower bound / toma (when `merged`, the hook's block, is not None) for one
    case, and their timings by variant (see the module docstring); with `baseline` (the
    baseline hook's block, needs `merged`) a "toma baseline" row after the toma row."""
    keep = (merged.merged_tokens if merged is not None
            else round(asked_tokens(case.image_tokens, case.protected_tokens, ratio)))
    calls: dict[str, Callable[[], Any]] = {
        "plain": lambda: case.original_block(case.args()),
        "lower bound": lambda: case.original_block(case.args(keep)),
    }
    tomas = {"toma": merged, "toma baseline": baseline if merged is not None else None}
    tomas = {name: block for name, block in tomas.items() if block is not None}
    for name, block in tomas.items():
        calls[name] = lambda block=block: block(case.args())
    with torch.inference_mode():        # the warm-up, whose outputs give the error
        img_in = case.image_out(case.args())
        first = {name: case.image_out(fn()) for name, fn in calls.items()}
        extra = {f"{b.name} block": b.call for b in case.full_length}
        for call in extra.values():
            call()
    found = interleaved(calls | extra, warmup=0, reps=reps, clock=clock, min_reps=1)
    base = {"family": case.family, "text_tokens": case.text_tokens}
    rows = [{**base, "variant": "plain", "image_tokens": case.image_tokens},
            {**base, "variant": "lower bound", "ratio": ratio, "image_tokens": keep}]
    rows += [{**base, "variant": name, "ratio": ratio, "image_tokens": block.merged_tokens}
             for name, block in tomas.items()]
    for row in rows:
        row.update(found[row["variant"]].fields())
        row.update(speedup(found["plain"], found[row["variant"]]))
    rows += [{**base, "variant": name, "image_tokens": case.image_tokens,
              "note": "full length in every variant (never merged)", **found[name].fields()}
             for name in extra]
    for row in rows:
        if reps < MIN_REPS:
            row["note"] = "; ".join(filter(None, (
                row.get("note"), f"{reps} repetition(s): spread from fewer than {MIN_REPS}")))
    for toma, (name, block) in zip(rows[2:], tomas.items(), strict=False):
        if first[name].shape != first["plain"].shape:
            raise ValueError(f"{case.family}: the {name} hook's block returned image tokens "
                             f"{tuple(first[name].shape)}, the plain block "
                             f"{tuple(first['plain'].shape)}")
        toma["err_update"] = _rel(first[name] - img_in, first["plain"] - img_in)
        versus_lower_bound(toma, found[name], found["lower bound"])
        off = off_ratio(block.merged_tokens, case.image_tokens, ratio, case.protected_tokens)
        if off:
            toma["flag"] = "; ".join(filter(None, (toma.get("flag"), off)))
        plans = interleaved({"plan": block.build_plan}, warmup=0, reps=MIN_REPS, clock=clock)
        toma["plan_ms"] = 1e3 * plans["plan"].median
    if "toma baseline" in tomas:
        versus_baseline(rows[2], found["toma"], found["toma baseline"])
    return rows, found


def versus_baseline(row: dict, toma: Timing, baseline: Timing) -> None:
    """over_base / _lo / _hi: the baseline's time / toma's (> 1: toma faster), the ratio of
    medians and the lowest and highest of the side-by-side repetitions."""
    row.update({key.replace("speedup", "over_base"): value
                for key, value in speedup(baseline, toma).items()})


# The most ToMA's merged count may stray from (1 - ratio) x tokens and still be "at this ratio":
# equal destinations per region on ragged regions measured within 1.5% on real video grids
# (tests/unit/test_regions.py); a thin last frame slab once kept 18% fewer than asked.
RATIO_SLACK = 0.03


def asked_tokens(tokens: int, protected: int, ratio: float) -> float:
    """The image tokens `ratio` asks for: the `protected` ones (never merged) and 1 - ratio of
    the others."""
    return protected + (tokens - protected) * (1.0 - ratio)


def off_ratio(kept: int, tokens: int, ratio: float, protected: int = 0) -> str | None:
    """Why a merged count is not a result at `ratio` (its speedup belongs to another ratio),
    or None when it is within RATIO_SLACK of what the ratio asks."""
    asked = asked_tokens(tokens, protected, ratio)
    if abs(kept - asked) <= RATIO_SLACK * asked:
        return None
    return (f"merges to {kept} tokens where ratio {ratio} asks for {round(asked)} "
            f"({kept / asked - 1:+.1%}): not a result at this ratio")


def default_skipped(depth: int, kind: str = "") -> int:
    """Blocks the node's default skip_blocks leaves unmerged among `depth` blocks of one kind
    (skip_blocks letter `kind`: "d", "s", or "" on a one-kind model)."""
    from toma_pack.nodes.options import make_options

    return len(make_options().skip_blocks.for_kinds([(kind, depth)])[0])


@dataclass(frozen=True)
class Part:
    """One block kind of a model in the projection: its block's rows and timings, how many
    blocks of it the model has and how many of them stay unmerged."""

    rows: list[dict]
    found: dict[str, Timing]
    depth: int
    skip: int

    @property
    def unmerged(self) -> bool:
        """Every block of the kind runs at full length: no toma row or plan is needed, its
        plain time counts in every variant."""
        return self.skip >= self.depth


def project(rows: list[dict], found: dict[str, Timing], depth: int, skip: int) -> dict | None:
    """The blocks-only whole-model row of a one-kind model: `depth` blocks, the first `skip`
    plain, the others merged, one plan build per step; per repetition, against the same
    projection of the lower bound. None without a toma row."""
    return project_parts([Part(rows, found, depth, skip)])


def project_parts(parts: list[Part], family: str | None = None, variant: str = "toma",
                  against: str | None = None) -> dict | None:
    """project for a model of one or more block kinds (HiDream, HunyuanImage: double and
    single; Wan Animate: main and face adapter blocks): per repetition i, the sum over kinds
    of skip x plain_i + (depth - skip) x merged_i, plus one plan build per kind that merges
    (each kind's merged blocks are one group); against the same sum of the lower bounds.
    None when a kind that merges has no `variant` row (toma, or "toma baseline"); `against`
    (a variant, "toma baseline") adds over_base, that variant's projection / this one's."""
    def rows_of(name: str) -> list[dict | None]:
        return [next((r for r in part.rows if r["variant"] == name), None) for part in parts]

    tomas = rows_of(variant)
    if not parts or tomas[0] is None or any(
            t is None and not p.unmerged for p, t in zip(parts, tomas, strict=True)):
        return None
    named = [t or p.rows[0] for p, t in zip(parts, tomas, strict=True)]

    def model(name: str | None, plan: bool = False) -> Timing:
        sums = [0.0] * len(parts[0].found["plain"].times)
        for part, toma in zip(parts, rows_of(name) if plan else tomas, strict=True):
            merged = part.found["plain" if part.unmerged else name or "plain"].times
            # a kind with every block unmerged builds no plan
            extra = toma["plan_ms"] / 1e3 if plan and not part.unmerged else 0.0
            for i, (p, m) in enumerate(zip(part.found["plain"].times, merged, strict=True)):
                sums[i] += part.skip * p + (part.depth - part.skip) * m + extra
        return Timing(tuple(sums))

    plain, merged, bound = model(None), model(variant, plan=True), model("lower bound")
    first = tomas[0]
    model_name = family or first["family"]
    blocks = " + ".join(f"{p.depth}" + (f" {kind_word(r['family'], model_name)}"
                                        if len(parts) > 1 else "")
                        for p, r in zip(parts, named, strict=True))
    unmerged = " + ".join(str(min(p.skip, p.depth)) for p in parts)
    row = {"family": model_name, "ratio": first["ratio"],
           "variant": (f"projected model{'' if variant == 'toma' else ', ' + variant}: "
                       f"{blocks} blocks, {unmerged} unmerged"),
           **merged.fields(), **speedup(plain, merged),
           "note": "; ".join(dict.fromkeys(t["note"] for t in tomas if t and t.get("note")))
           or None}
    versus_lower_bound(row, merged, bound)
    row["lb_speedup"] = plain.median / bound.median
    if against is not None:
        versus_baseline(row, merged, model(against, plan=True))
    # the blocks' flags hold for the model made of them
    flags = (row.get("flag"), *(t.get("flag") for t in tomas if t))
    if any(flags):
        row["flag"] = "; ".join(dict.fromkeys(f for f in flags if f))
    return row


def kind_word(label: str, model: str) -> str:
    """A part's kind in the projection's label: its rows' family after the model's name
    ("hidream double" -> "double", "wan_animate14b face" -> "face"), "main" for the model's
    own."""
    rest = label[len(model):].strip() if label.startswith(model) else label.rsplit(" ", 1)[-1]
    return rest or "main"


def targets(rows: list[dict], ratio: float) -> list[dict]:
    """The targets: ToMA within 10% of its lower bound on every family; video families
    at least 2.2x projected whole-model on CPU (both at ratio 0.5)."""
    out = []
    for row in rows:
        if row.get("ratio") != ratio or ratio != RATIO:
            continue
        if row["variant"] == "toma":
            out.append(goal(f"{row['family']}: ToMA block within 10% of its lower bound "
                            f"(vs_lb <= {LB_TARGET:.2f})", row, "vs_lb", LB_TARGET,
                            higher=False))
        elif (row["variant"].startswith("projected model:")      # not a baseline's
              and row["family"] in VIDEO_FAMILIES):
            out.append(goal(f"{row['family']}: projected whole-model speedup >= {VIDEO_TARGET} "
                            f"(video, CPU)", row, "speedup", VIDEO_TARGET))
    return [t for t in out if t is not None]


def load_hook(hook: str | Callable | None) -> Callable | None:
    """The hook itself, the function named "module:function" (import it only after
    setup_comfy: it may import ComfyUI and toma_pack), or None for "none" / None."""
    if hook is None or callable(hook):
        return hook
    if hook == "none":
        return None
    module, _, name = hook.partition(":")
    return getattr(importlib.import_module(module), name)


def _setup() -> None:
    """ComfyUI from COMFYUI_PATH (CPU, SDPA attention) and the pack as toma_pack, unless the
    suite (python -m bench) has done it already."""
    from ..shared.config import setup_comfy

    if "toma_pack" in sys.modules and "comfy.ldm.modules.attention" in sys.modules:
        return
    if not setup_comfy(torch.device("cpu")):
        raise SystemExit("set COMFYUI_PATH to a ComfyUI checkout")


def run(families: list[str] | None = None, quick: bool = False, ratio: float = RATIO,
        reps: int = MIN_REPS, clock: str = "cpu", sizes: dict[str, Size] | None = None,
        hook: str | Callable | None = DEFAULT_HOOK, threads: int | None = None,
        family_reps: dict[str, int] | None = None,
        baseline_hook: str | Callable | None = None) -> list[dict]:
    """Rows for every family (plain, lower bound, toma, projection); a family this ComfyUI
    lacks gets one row saying so. hook, baseline_hook: see load_hook; family_reps: reps per
    family name."""
    _setup()
    merged_block, baseline_block = load_hook(hook), load_hook(baseline_hook)
    if threads:
        torch.set_num_threads(threads)
    rows: list[dict] = []
    for name in families or list(FAMILIES):
        build, real, small = FAMILIES[name]
        size = (sizes or {}).get(name) or (small if quick else real)
        try:
            built = build(name, size)
        except (ImportError, RuntimeError, TypeError) as exc:
            rows.append({"family": name, "variant": f"not in this ComfyUI ({exc})"})
            continue
        parts = []
        for case in built if isinstance(built, tuple) else (built,):
            log.warning("%s: grid %s, %d image + %d text tokens", case.label, case.grid,
                        case.image_tokens, case.text_tokens)
            kind_parts = bench_kind(case, ratio, (family_reps or {}).get(name, reps), clock,
                                    merged_block, baseline_block)
            for part in kind_parts:
                rows += part.rows
                log_rows(part.rows)     # each block's figures as soon as they exist
            parts += kind_parts
        against = "toma baseline" if baseline_block is not None else None
        projected = [project_parts(parts, name, against=against),
                     against and project_parts(parts, name, against)]
        for row in filter(None, projected):
            rows.append(row)
            log_rows([row])
        del built, parts
    return rows


def bench_kind(case: BlockCase, ratio: float, reps: int, clock: str,
               merged_block: Callable | None, baseline_block: Callable | None = None
               ) -> list[Part]:
    """bench_case of one block kind, its rows named by case.label, as a Part of the model, and
    a Part for each of the case's full-length blocks (rows "<label> <name>", all unmerged)."""
    merged, baseline = (hook(case.family, case, ratio) if hook is not None else None
                        for hook in (merged_block, baseline_block))
    with torch.inference_mode():
        block_rows, found = bench_case(case, ratio, reps, clock, merged, baseline)
    extra = {f"{b.name} block": b for b in case.full_length}
    for row in block_rows:
        block = extra.get(row["variant"])
        row["family"] = f"{case.label} {block.name}" if block else case.label
    main = Part([r for r in block_rows if r["variant"] not in extra], found, case.depth,
                default_skipped(case.depth, case.kind))
    return [main, *(Part([r], {"plain": found[r["variant"]]}, extra[r["variant"]].count,
                         extra[r["variant"]].count)
                    for r in block_rows if r["variant"] in extra)]


def log_rows(rows: list[dict]) -> None:
    """Rows to the log: full-size runs take long."""
    for row in rows:
        gain = (f", speedup {row['speedup']:.3g} ({row['speedup_lo']:.3g}-"
                f"{row['speedup_hi']:.3g})" if "speedup" in row else "")
        log.warning("%s %s: %d image tokens, %.0f ms (spread %.2f)%s%s", row["family"],
                    row["variant"], row.get("image_tokens") or 0, row["ms"], row["spread"], gain,
                    f", vs_lb {row['vs_lb']:.3f}" if "vs_lb" in row else "")


def notes(clock: str, reps: int, family_reps: dict[str, int]) -> list[str]:
    """How the figures were taken, for the report."""
    per = ", ".join(f"{k} {v}" for k, v in family_reps.items())
    return [f"CPU {cpu_model()} ({cpu_features()}), {torch.get_num_threads()} thread(s), "
            f"{clock} clock, float32; one untimed call per variant (warm-up; its outputs give "
            f"err_update), then median, minimum and spread of {reps} interleaved repetitions"
            + (f" ({per} for those families)" if per else ""),
            "speedup_lo/hi: lowest/highest ratio of the side-by-side repetitions; vs_lb: median "
            "of the side-by-side ratios toma / lower bound; lb_speedup: the lower bound's "
            "projected speedup; plan_ms: one plan build (median of 3)",
            "projected model: blocks only, the node's default skip_blocks unmerged, one plan "
            "build per step (recompute_every 1); err_update: relative L2 error of the image "
            "update on random weights (ranks settings, does not predict image quality)"]


def report(result: dict[str, Any]) -> str:
    """The Markdown report of a result dict."""
    lines = report_head("DiT families: one block at full width per family, and the projected "
                        "model", result)
    compared = any("over_base" in row for row in result["rows"])
    columns = (*COLUMNS, "over_base", "over_base_lo", "over_base_hi") if compared else COLUMNS
    lines += ["", markdown_table(result["rows"], columns), "", "## Targets", ""]
    lines += [markdown_table(result["targets"], ["target", "value", "met", "why"])
              if result["targets"] else "- none checked (no ToMA rows at ratio 0.5)"]
    flagged = [r for r in result["rows"] if r.get("flag")]
    lines += ["", "## Flagged (not results)", ""]
    lines += ([f"- {r['family']} {r['variant']}: {r['flag']}" for r in flagged] if flagged
              else ["- none: no ToMA row measured faster than its own lower bound"])
    return "\n".join(lines) + "\n"


def _size(text: str) -> tuple[str, Size]:
    """"name=WxH" or "name=WxHxF" -> (name, Size) with the family's latent geometry."""
    name, _, dims = text.partition("=")
    if name not in FAMILIES:
        raise argparse.ArgumentTypeError(f"unknown family {name!r}")
    values = [int(v) for v in dims.split("x")]
    real = FAMILIES[name][1]
    return name, Size(*values, spatial=real.spatial, temporal=real.temporal, patch=real.patch)


def _family_reps(text: str) -> tuple[str, int]:
    """"name=N" -> (name, N)."""
    name, _, n = text.partition("=")
    if name not in FAMILIES or not n.isdigit() or int(n) < 1:
        raise argparse.ArgumentTypeError(f"write family=N with a family of {list(FAMILIES)}")
    return name, int(n)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--quick", action="store_true", help="smaller token counts")
    parser.add_argument("--ratio", type=float, default=RATIO)
    parser.add_argument("--reps", type=int, default=MIN_REPS,
                        help=f"timed rounds (>= {MIN_REPS}; median, min, spread)")
    parser.add_argument("--family-reps", type=_family_reps, action="append", default=[],
                        help="name=N: other rounds for one family (may be fewer than 3: said "
                             "in its rows)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--size", type=_size, action="append", default=[],
                        help="name=WxH[xFRAMES] pixels, overrides one family's size")
    parser.add_argument("--toma-hook", default=DEFAULT_HOOK,
                        help="module:function, or none (see docstring)")
    parser.add_argument("--baseline-hook", default=None,
                        help="module:function timed beside the toma hook (see docstring)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path for the results (the .md report beside it)")
    a = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s",
                        datefmt="%H:%M:%S")
    families = [f.strip() for f in a.families.split(",") if f.strip()]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        parser.error(f"unknown families {unknown}; choose from {','.join(FAMILIES)}")
    if a.reps < MIN_REPS:
        parser.error(f"--reps must be >= {MIN_REPS} (use --family-reps for a slow family)")
    family_reps = dict(a.family_reps)
    rows = run(families, a.quick, a.ratio, a.reps, a.clock, dict(a.size), a.toma_hook,
               a.threads, family_reps, a.baseline_hook)
    result = {"machine": machine_info(),
              "config": {"commit": commit(), "comfyui": os.environ.get("COMFYUI_PATH"),
                         "command": "python -m bench.speed.dit_families " + " ".join(
                             sys.argv[1:] if argv is None else argv),
                         "baseline": a.baseline_hook and os.environ.get("TOMA_BASELINE"),
                         "clock": a.clock, "threads": torch.get_num_threads(),
                         "reps": a.reps, "family_reps": family_reps, "ratio": a.ratio,
                         "quick": a.quick, "sizes": {n: FAMILIES[n][2 if a.quick else 1]
                                                     for n in families} | dict(a.size)},
              "notes": notes(a.clock, a.reps, family_reps), "rows": rows}
    result["targets"] = targets(rows, a.ratio)
    text = report(result)
    print(text)
    if a.out:
        write_result(a.out, result, text)
        print(f"JSON: {a.out} (Markdown beside it) at {datetime.datetime.now():%H:%M}")


if __name__ == "__main__":
    main()
