"""One block of each new DiT family at full width: plain, lower bound and ToMA, and the whole
model projected from them.

    COMFYUI_PATH=/path/to/ComfyUI python -m bench.speed.dit_families --threads 1 --clock cpu
        [--quick] [--families wan22_5b,wan14b,qwen_image,sd35_large,z_image,ltx2,ltxv]
        [--ratio 0.5]
        [--reps 3] [--family-reps wan14b=2] [--size wan14b=832x480x17]
        [--toma-hook bench.speed.dit_toma:hook | none] [--out bench/results/<date>-cpu-dit.json]

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
lower bound.

Sizes (pixels -> latent -> token grid t x h x w):
  wan22_5b    Wan 2.2 TI2V 5B, width 3072, 30 blocks: 1280x704, 121 frames -> 31x22x40 = 27280
  wan14b      Wan 2.1 / 2.2 A14B, width 5120, 40 blocks: 832x480, 81 frames -> 21x30x52 = 32760
  qwen_image  Qwen-Image, width 3072, 60 blocks: 1328x1328 -> 83x83 = 6889 (+ 256 text)
  sd35_large  SD3.5 Large, width 2432, 38 blocks: 1024x1024 -> 64x64 = 4096 (+ 154 text)
  z_image     Z-Image, width 3840, 30 blocks: 1024x1024 -> 64x64 = 4096 (+ 256 text)
  ltx2        LTX-2 19B, video width 4096, 48 blocks: 768x512, 121 frames (VAE 32x32 pixels,
              8 frames after the first) -> 16x16x24 = 6144 video tokens (+ 121 audio tokens,
              25 a second at 25 fps; 1024 text tokens as cross-attention context)
  ltxv        LTX-Video 2B, width 2048, 28 blocks: 768x512, 97 frames -> 13x16x24 = 4992
              (+ 128 text tokens as cross-attention context)
--quick uses fewer frames / smaller images (same widths); --size name=WxH[xF] overrides one.
On one CPU core a plain Wan 14B block at full size takes about 8 minutes: time --quick first.

The hook: `hook(family: str, case: BlockCase, ratio: float)` returns None for a family it does
not handle, else a merged block: called with a fresh full-length argument dict (as `case.args()`
makes it) it returns what `case.original_block` would; `merged_tokens` is the image token count
it runs on; `build_plan()` builds its plan again (timed apart; the block calls reuse the plan,
as the blocks of a group do). bench/speed/dit_toma.py's is the default; the pack is importable as
`toma_pack` (bench.shared.config.setup_comfy).

Writes nothing unless --out: then the JSON there and the same report as .md beside it (machine,
commit, command, notes, table, targets, flags).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
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
    speedup,
    versus_lower_bound,
)
from ..shared.weights import fill_weights

log = logging.getLogger(__name__)

RATIO = 0.5
DEFAULT_HOOK = "bench.speed.dit_toma:hook"
VIDEO_TARGET = 2.2          # projected whole-model speedup of video at ratio 0.5
LB_TARGET = 1.10            # ToMA within 10% of its lower bound
VIDEO_FAMILIES = ("wan22_5b", "wan14b", "ltx2", "ltxv")     # held to VIDEO_TARGET
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
class BlockCase:
    """One family's block and full-length inputs, as ComfyUI's block loop hands them over.

    family: name; block: ComfyUI's block module; grid: image tokens (t, h, w), row-major in
    the sequence; text_tokens: text length; depth: blocks in the real model; args(keep): fresh
    arguments in the family's "dit" replace form (img/txt/vec/pe/transformer_options, ...; for
    Lumina-style models, which have no replace patches, the same form for the object patch's
    call), with only the first `keep` image tokens (None: all) — the lower bound uses it;
    original_block(args) -> {"img", ...}: runs the block like ComfyUI's `original_block`;
    image_out(out) -> the image tokens of an output (for the error).
    """

    family: str
    block: torch.nn.Module
    grid: tuple[int, int, int]
    text_tokens: int
    depth: int
    args: Callable[..., dict]
    original_block: Callable[[dict], dict]
    image_out: Callable[[dict], torch.Tensor]

    @property
    def image_tokens(self) -> int:
        return math.prod(self.grid)


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
def wan_case(name: str, dim: int, ffn: int, depth: int, size: Size, text: int = 512) -> BlockCase:
    """WanAttentionBlock (t2v cross-attention) at width `dim` (heads of 128)."""
    from comfy.ldm.wan.model import WanAttentionBlock

    heads = dim // 128
    block = _fill(WanAttentionBlock("t2v_cross_attn", dim, ffn, heads, qk_norm=True,
                                    cross_attn_norm=True, eps=1e-6, operation_settings=_ops()), 1)
    grid = size.grid()
    img = smooth_tokens(grid, dim, 2)
    g = torch.Generator().manual_seed(3)
    txt = torch.randn(1, text, dim, generator=g)
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
                             context_img_len=None, transformer_options=a["transformer_options"])}

    return BlockCase(name, block, grid, text, depth, args, original, lambda out: out["img"])


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
    found: dict[str, Any] = {}

    def patch(args: dict, extra: dict) -> dict:
        found.update(args=args, original=extra["original_block"])
        raise _CapturedError

    options = {"patches_replace": {"dit": {("double_block", 0): patch}}}
    try:
        call(options)
    except _CapturedError:
        pass
    if not found:
        raise RuntimeError("the model ran no replace patch on its first block")
    return found["args"], found["original"]


def one_block_model(cls: type, strip: tuple[str, ...], **config: Any) -> torch.nn.Module:
    """ComfyUI's model `cls` at the real config with one block, seeded weights, CPU fp32.
    Built on the meta device first so that `strip` (parts the forward does not use, such as
    LTX-2's text connectors, ~1B parameters) never take memory."""
    ops = _ops()
    model = cls(num_layers=1, dtype=ops["dtype"], device=torch.device("meta"),
                operations=ops["operations"], **config)
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
                                         "audio_embeddings_connector"),
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


def ltxv_case(name: str, size: Size, text: int = 128) -> BlockCase:
    """LTX-Video 2B (LTXVModel's defaults, the 0.9.x 2B models): BasicTransformerBlock at width
    2048 (32 heads of 64), T5 text [1, 128, 4096] (padded to 128) with its attention mask as
    cross-attention context, 28 blocks; arguments from LTXVModel's own forward
    (capture_block), one timestep. The lower bound cuts the video and its RoPE rows."""
    from comfy.ldm.lightricks.model import LTXVModel

    model = one_block_model(LTXVModel, ())
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


# name -> (builder, real size, quick size)
FAMILIES: dict[str, tuple[Callable[[str, Size], BlockCase], Size, Size]] = {
    "wan22_5b": (lambda n, s: wan_case(n, 3072, 14336, 30, s),
                 Size(1280, 704, 121, spatial=16), Size(1280, 704, 9, spatial=16)),
    "wan14b": (lambda n, s: wan_case(n, 5120, 13824, 40, s),
               Size(832, 480, 81), Size(832, 480, 5)),
    "qwen_image": (qwen_case, Size(1328, 1328), Size(768, 768)),
    "sd35_large": (sd35_case, Size(1024, 1024), Size(768, 768)),
    "z_image": (z_image_case, Size(1024, 1024), Size(768, 768)),
    # LTX's VAE: 32x32 pixels and 8 frames (after the first) per latent token, 1x1x1 patches
    "ltx2": (ltx2_case, Size(768, 512, 121, spatial=32, temporal=8, patch=1),
             Size(768, 512, 17, spatial=32, temporal=8, patch=1)),
    "ltxv": (ltxv_case, Size(768, 512, 97, spatial=32, temporal=8, patch=1),
             Size(768, 512, 17, spatial=32, temporal=8, patch=1)),
}


# Measuring --------------------------------------------------------------------------------------
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def bench_case(case: BlockCase, ratio: float, reps: int, clock: str,
               merged: Any | None) -> tuple[list[dict], dict[str, Timing]]:
    """Rows plain / lower bound / toma (when `merged`, the hook's block, is not None) for one
    case, and their timings by variant (see the module docstring)."""
    keep = merged.merged_tokens if merged is not None else round(case.image_tokens * (1 - ratio))
    calls: dict[str, Callable[[], Any]] = {
        "plain": lambda: case.original_block(case.args()),
        "lower bound": lambda: case.original_block(case.args(keep)),
    }
    if merged is not None:
        calls["toma"] = lambda: merged(case.args())
    with torch.inference_mode():        # the warm-up, whose outputs give the error
        img_in = case.image_out(case.args())
        first = {name: case.image_out(fn()) for name, fn in calls.items()}
    found = interleaved(calls, warmup=0, reps=reps, clock=clock, min_reps=1)
    base = {"family": case.family, "text_tokens": case.text_tokens}
    rows = [{**base, "variant": "plain", "image_tokens": case.image_tokens},
            {**base, "variant": "lower bound", "ratio": ratio, "image_tokens": keep}]
    if merged is not None:
        rows.append({**base, "variant": "toma", "ratio": ratio, "image_tokens": keep})
    for row in rows:
        row.update(found[row["variant"]].fields())
        row.update(speedup(found["plain"], found[row["variant"]]))
        if reps < MIN_REPS:
            row["note"] = f"{reps} repetition(s): spread from fewer than {MIN_REPS}"
    if merged is not None:
        toma = rows[2]
        if first["toma"].shape != first["plain"].shape:
            raise ValueError(f"{case.family}: the ToMA hook's block returned image tokens "
                             f"{tuple(first['toma'].shape)}, the plain block "
                             f"{tuple(first['plain'].shape)}")
        toma["err_update"] = _rel(first["toma"] - img_in, first["plain"] - img_in)
        versus_lower_bound(toma, found["toma"], found["lower bound"])
        off = off_ratio(keep, case.image_tokens, ratio)
        if off:
            toma["flag"] = "; ".join(filter(None, (toma.get("flag"), off)))
        plans = interleaved({"plan": merged.build_plan}, warmup=0, reps=MIN_REPS, clock=clock)
        toma["plan_ms"] = 1e3 * plans["plan"].median
    return rows, found


# The most ToMA's merged count may stray from (1 - ratio) x tokens and still be "at this ratio":
# equal destinations per region on ragged regions measured within 1.5% on real video grids
# (tests/unit/test_regions.py); a thin last frame slab once kept 18% fewer than asked.
RATIO_SLACK = 0.03


def off_ratio(kept: int, tokens: int, ratio: float) -> str | None:
    """Why a merged count is not a result at `ratio` (its speedup belongs to another ratio),
    or None when it is within RATIO_SLACK of what the ratio asks."""
    asked = tokens * (1.0 - ratio)
    if abs(kept - asked) <= RATIO_SLACK * asked:
        return None
    return (f"merges to {kept} tokens where ratio {ratio} asks for {round(asked)} "
            f"({kept / asked - 1:+.1%}): not a result at this ratio")


def default_skipped(depth: int) -> int:
    """Blocks the node's default skip_blocks leaves unmerged on a one-kind model of `depth`."""
    from toma_pack.nodes.options import make_options

    return len(make_options().skip_blocks.for_kinds([("", depth)])[0])


def project(rows: list[dict], found: dict[str, Timing], depth: int, skip: int) -> dict | None:
    """The blocks-only whole-model row: `depth` blocks, the first `skip` plain, the others
    merged, one plan build per step; per repetition, against the same projection of the lower
    bound. None without a toma row."""
    toma = next((r for r in rows if r["variant"] == "toma"), None)
    if toma is None:
        return None

    def model(merged: tuple[float, ...], extra: float = 0.0) -> Timing:
        return Timing(tuple(skip * p + (depth - skip) * m + extra
                            for p, m in zip(found["plain"].times, merged, strict=True)))

    plain = model(found["plain"].times)
    merged = model(found["toma"].times, toma["plan_ms"] / 1e3)
    bound = model(found["lower bound"].times)
    row = {"family": toma["family"], "ratio": toma["ratio"],
           "variant": f"projected model: {depth} blocks, {skip} unmerged",
           **merged.fields(), **speedup(plain, merged), "note": toma.get("note")}
    versus_lower_bound(row, merged, bound)
    row["lb_speedup"] = plain.median / bound.median
    # the block's flags hold for the model made of it
    flags = (row.get("flag"), toma.get("flag"))
    if any(flags):
        row["flag"] = "; ".join(dict.fromkeys(f for f in flags if f))
    return row


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
        elif row["variant"].startswith("projected") and row["family"] in VIDEO_FAMILIES:
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
        family_reps: dict[str, int] | None = None) -> list[dict]:
    """Rows for every family (plain, lower bound, toma, projection); a family this ComfyUI
    lacks gets one row saying so. hook: see load_hook; family_reps: reps per family name."""
    _setup()
    merged_block = load_hook(hook)
    if threads:
        torch.set_num_threads(threads)
    rows: list[dict] = []
    for name in families or list(FAMILIES):
        build, real, small = FAMILIES[name]
        size = (sizes or {}).get(name) or (small if quick else real)
        try:
            case = build(name, size)
        except (ImportError, RuntimeError, TypeError) as exc:
            rows.append({"family": name, "variant": f"not in this ComfyUI ({exc})"})
            continue
        log.warning("%s: grid %s, %d image + %d text tokens", name, case.grid,
                    case.image_tokens, case.text_tokens)
        merged = merged_block(name, case, ratio) if merged_block is not None else None
        with torch.inference_mode():
            block_rows, found = bench_case(case, ratio, (family_reps or {}).get(name, reps),
                                           clock, merged)
        projected = project(block_rows, found, case.depth, default_skipped(case.depth))
        rows += block_rows + ([projected] if projected else [])
        # Each family's figures as soon as they exist: full-size runs take long.
        for row in block_rows + ([projected] if projected else []):
            log.warning("%s %s: %d image tokens, %.0f ms (spread %.2f), speedup %.3g (%.3g-%.3g)"
                        "%s", name, row["variant"], row.get("image_tokens") or 0, row["ms"],
                        row["spread"], row["speedup"], row["speedup_lo"], row["speedup_hi"],
                        f", vs_lb {row['vs_lb']:.3f}" if "vs_lb" in row else "")
        del case, merged
    return rows


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
    lines = ["# DiT families: one block at full width per family, and the projected model", "",
             ", ".join(f"{k}: {v}" for k, v in result["machine"].items()), "",
             f"commit: {result['config']['commit']}", "",
             f"command: `{result['config']['command']}`", "",
             f"ComfyUI: {result['config']['comfyui']}", ""]
    lines += [f"- {note}" for note in result["notes"]]
    lines += ["", markdown_table(result["rows"], COLUMNS), "", "## Targets", ""]
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
               a.threads, family_reps)
    result = {"machine": machine_info(),
              "config": {"commit": commit(), "comfyui": os.environ.get("COMFYUI_PATH"),
                         "command": "python -m bench.speed.dit_families " + " ".join(
                             sys.argv[1:] if argv is None else argv),
                         "clock": a.clock, "threads": torch.get_num_threads(),
                         "reps": a.reps, "family_reps": family_reps, "ratio": a.ratio,
                         "quick": a.quick, "sizes": {n: FAMILIES[n][2 if a.quick else 1]
                                                     for n in families} | dict(a.size)},
              "notes": notes(a.clock, a.reps, family_reps), "rows": rows}
    result["targets"] = targets(rows, a.ratio)
    text = report(result)
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1, default=str))
        a.out.with_suffix(".md").write_text(text)
        print(f"JSON: {a.out} (Markdown beside it) at {datetime.datetime.now():%H:%M}")


if __name__ == "__main__":
    main()
