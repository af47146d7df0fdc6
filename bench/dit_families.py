"""One block of each new DiT family at full width: plain, lower bound, and ToMA once plugged in.

    COMFYUI_PATH=/path/to/ComfyUI python -m bench.dit_families --threads 1 --clock cpu [--quick]
        [--families wan22_5b,wan14b,qwen_image,sd35_large,z_image] [--ratio 0.5]
        [--warmup 1] [--reps 2] [--size wan14b=832x480x17] [--skip 0] [--toma-hook mod:fn]

Builds ComfyUI's own block class of each family at the real model's width (random weights,
fp32, CPU, SDPA attention) on the token count of a real generation, and times per family:

- plain: the block on every image token, called the way ComfyUI's block loop calls it;
- lower bound: the same block on round(N * (1 - ratio)) image tokens (text and other tokens
  unchanged, RoPE rows of the kept tokens), no merging cost: what merging could at best give;
- toma: the block through the ToMA patch, when a hook supplies it (below), with its speed
  against the lower bound (vs_lb = toma time / lower-bound time) and the relative L2 error of
  its image update against the plain block's.

Then a projected whole-model speedup from the block count (blocks only: embedders and the final
layer are a rounding error at these sizes), with the first `--skip` blocks left unmerged.

Sizes (pixels -> latent -> token grid t x h x w):
  wan22_5b    Wan 2.2 TI2V 5B, width 3072, 30 blocks: 1280x704, 121 frames -> 31x22x40 = 27280
  wan14b      Wan 2.1 / 2.2 A14B, width 5120, 40 blocks: 832x480, 81 frames -> 21x30x52 = 32760
  qwen_image  Qwen-Image, width 3072, 60 blocks: 1328x1328 -> 83x83 = 6889 (+ 256 text)
  sd35_large  SD3.5 Large, width 2432, 38 blocks: 1024x1024 -> 64x64 = 4096 (+ 154 text)
  z_image     Z-Image, width 3840, 30 blocks: 1024x1024 -> 64x64 = 4096 (+ 256 text)
--quick uses fewer frames / smaller images (same widths); --size name=WxH[xF] overrides one.
On 2 CPU cores the full Wan 14B block takes minutes per call: time a --quick run first.

The ToMA hook: a function `hook(family: str, case: BlockCase, ratio: float)` returning a
callable `run(args: dict) -> dict` that runs the merged block on a fresh full-length argument
dict (as `case.args()` makes it) and returns what `case.original_block` would, or None when it
does not handle that family. Set HOOK below, or pass --toma-hook module:function; the pack is
importable as `toma_pack` (bench.config.setup_comfy). Build plans inside the hook beforehand:
the timed calls stand for blocks that reuse a group's plan.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# The ToMA-patched block: see the module docstring (None: rows without ToMA).
HOOK: Callable[[str, BlockCase, float], Callable[[dict], dict] | None] | None = None

RATIO = 0.5
COLUMNS = ("family", "variant", "image_tokens", "text_tokens", "ms", "speedup", "vs_lb",
           "err_update")


@dataclass(frozen=True)
class Size:
    """A generation's size in pixels (frames for video) and how it becomes tokens."""

    width: int
    height: int
    frames: int = 1
    spatial: int = 8        # VAE downscale
    temporal: int = 4       # VAE frame compression (video): latent frames = (frames-1)//4 + 1
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
    """Small random weights: matrices N(0, 0.02), biases 0, other vectors (norm scales) 1.
    (flux_blocks._fill zeroes vectors named without "norm"/"scale", e.g. SD3's ln_q.weight,
    which would flatten that block's attention.)"""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            else:
                p.fill_(0.0 if name.endswith("bias") else 1.0)
    return module.eval()


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


# name -> (builder, real size, quick size)
FAMILIES: dict[str, tuple[Callable[[str, Size], BlockCase], Size, Size]] = {
    "wan22_5b": (lambda n, s: wan_case(n, 3072, 14336, 30, s),
                 Size(1280, 704, 121, spatial=16), Size(1280, 704, 9, spatial=16)),
    "wan14b": (lambda n, s: wan_case(n, 5120, 13824, 40, s),
               Size(832, 480, 81), Size(832, 480, 5)),
    "qwen_image": (qwen_case, Size(1328, 1328), Size(768, 768)),
    "sd35_large": (sd35_case, Size(1024, 1024), Size(768, 768)),
    "z_image": (z_image_case, Size(1024, 1024), Size(768, 768)),
}


# Measuring --------------------------------------------------------------------------------------
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def bench_case(case: BlockCase, ratio: float, warmup: int, reps: int, clock: str,
               hook: Callable | None, errors: bool = True) -> list[dict]:
    """Rows plain / lower bound / toma (if the hook handles the family) for one case."""
    from .common import median_times

    keep = round(case.image_tokens * (1 - ratio))
    calls: dict[str, Callable[[], Any]] = {
        "plain": lambda: case.original_block(case.args()),
        "lower bound": lambda: case.original_block(case.args(keep)),
    }
    merged = hook(case.family, case, ratio) if hook is not None else None
    if merged is not None:
        calls["toma"] = lambda: merged(case.args())
    seconds = median_times(calls, warmup=warmup, reps=reps, clock=clock)
    base = {"family": case.family, "text_tokens": case.text_tokens}
    rows = [{**base, "variant": "plain", "image_tokens": case.image_tokens},
            {**base, "variant": "lower bound", "ratio": ratio, "image_tokens": keep}]
    if merged is not None:
        rows.append({**base, "variant": "toma", "ratio": ratio})
    for row in rows:
        row["ms"] = seconds[row["variant"]] * 1e3
        row["speedup"] = seconds["plain"] / seconds[row["variant"]]
    if merged is not None:
        rows[2]["vs_lb"] = seconds["toma"] / seconds["lower bound"]
        if errors:
            with torch.inference_mode():
                img_in = case.image_out(case.args())
                plain = case.image_out(case.original_block(case.args()))
                toma = case.image_out(merged(case.args()))
            if toma.shape != plain.shape:
                raise ValueError(f"{case.family}: the ToMA hook's block returned image tokens "
                                 f"{tuple(toma.shape)}, the plain block {tuple(plain.shape)}")
            rows[2]["err_update"] = _rel(toma - img_in, plain - img_in)
    return rows


def project(rows: list[dict], depth: int, skip: int) -> list[dict]:
    """Blocks-only whole-model speedups: `depth` blocks, the first `skip` unmerged."""
    plain = next(r for r in rows if r["variant"] == "plain")
    out = []
    for r in rows:
        if r["variant"] == "plain":
            continue
        total = skip * plain["ms"] + (depth - skip) * r["ms"]
        out.append({"family": r["family"],
                    "variant": f"model: {depth} blocks, {skip} skipped, {r['variant']}",
                    "ratio": r.get("ratio"), "ms": total,
                    "speedup": depth * plain["ms"] / total})
    return out


def load_hook(hook: str | Callable | None) -> Callable | None:
    """The hook itself, the function named "module:function" (import it only after
    setup_comfy: it may import ComfyUI and toma_pack), or HOOK when None."""
    if hook is None or callable(hook):
        return hook or HOOK
    module, _, name = hook.partition(":")
    return getattr(importlib.import_module(module), name)


def _setup() -> None:
    """ComfyUI from COMFYUI_PATH (CPU, SDPA attention) and the pack as toma_pack, unless the
    suite (python -m bench) has done it already."""
    import sys

    from .config import setup_comfy

    if "toma_pack" in sys.modules and "comfy.ldm.modules.attention" in sys.modules:
        return
    if not setup_comfy(torch.device("cpu")):
        raise SystemExit("set COMFYUI_PATH to a ComfyUI checkout")


def run(families: list[str] | None = None, quick: bool = False, ratio: float = RATIO,
        warmup: int = 1, reps: int = 2, clock: str = "cpu", skip: int = 0,
        sizes: dict[str, Size] | None = None, hook: str | Callable | None = None,
        threads: int | None = None) -> list[dict]:
    """Rows for every family (plain, lower bound, toma, projections); a family this ComfyUI
    lacks gets one row saying so. hook: see load_hook."""
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
        with torch.inference_mode():
            block_rows = bench_case(case, ratio, warmup, reps, clock, merged_block)
        rows += block_rows + project(block_rows, case.depth, skip)
        # Each family's figures as soon as they exist: full-size runs take long.
        for row in block_rows:
            log.warning("%s %s: %d image tokens, %.0f ms, speedup %.3g", name, row["variant"],
                        row.get("image_tokens") or 0, row["ms"], row["speedup"])
        del case
    return rows


def _size(text: str) -> tuple[str, Size]:
    """"name=WxH" or "name=WxHxF" -> (name, Size) with the family's latent geometry."""
    name, _, dims = text.partition("=")
    if name not in FAMILIES:
        raise argparse.ArgumentTypeError(f"unknown family {name!r}")
    values = [int(v) for v in dims.split("x")]
    real = FAMILIES[name][1]
    return name, Size(*values, spatial=real.spatial, temporal=real.temporal, patch=real.patch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--quick", action="store_true", help="smaller token counts")
    parser.add_argument("--ratio", type=float, default=RATIO)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--reps", type=int, default=2, help="timed calls per variant (median)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--skip", type=int, default=0, help="unmerged first blocks (projection)")
    parser.add_argument("--size", type=_size, action="append", default=[],
                        help="name=WxH[xFRAMES] pixels, overrides one family's size")
    parser.add_argument("--toma-hook", default=None, help="module:function (see docstring)")
    a = parser.parse_args()
    from .common import machine_info, markdown_table

    families = [f.strip() for f in a.families.split(",") if f.strip()]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        parser.error(f"unknown families {unknown}; choose from {','.join(FAMILIES)}")
    rows = run(families, a.quick, a.ratio, a.warmup, a.reps, a.clock, a.skip, dict(a.size),
               a.toma_hook, a.threads)
    print(markdown_table(rows, COLUMNS))
    print()
    print(", ".join(f"{k}: {v}" for k, v in machine_info().items()))


if __name__ == "__main__":
    main()
