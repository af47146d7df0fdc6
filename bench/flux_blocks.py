"""Full-width Flux blocks: ToMA's replace patches against the plain blocks.

    COMFYUI_PATH=/path/to/ComfyUI python -m bench.flux_blocks [--reps 3] [--threads N]

On a machine shared with other jobs use --threads 1: torch's thread pool thrashes when the cores
are busy (small elementwise ops got 8x slower on a loaded 2-core machine), which would drown the
differences being measured.

Builds ComfyUI's own DoubleStreamBlock and SingleStreamBlock at Flux.1 size (hidden 3072,
24 heads, mlp_ratio 4) with small random weights, fp32, SDPA attention, on 4096 image tokens
(a 1024x1024 image) and 512 text tokens, and times per block:

- the plain block;
- ToMA at ratios 0.5 and 0.75 through flux_patch's own replace patches (the real block as
  `original_block`), for double blocks in both scopes ("block", "attention"); the plan is built
  once beforehand and reused, as it is across a group of blocks (its cost is reported apart);
- the lower bound: the plain block on 2048 / 1024 image tokens, no merge cost.

Timing: bench.config.interleaved_medians, one warm-up call per variant, then `reps` rounds that
call every variant once in turn; the median per variant.

Fidelity: relative L2 error of the block output and of its update (output - input) against the
plain block. Random weights see no real image, so the image tokens are a smooth random field
(low-resolution noise upsampled, plus a little white noise), the way latent tokens correlate with
their neighbours; errors here compare variants, they do not predict image quality.

The projection: a 19 double + 38 single block model with skip_blocks "d0-4, s0-4", blocks only
(embedders and the final layer are a rounding error), plan builds amortised over recompute_every 5.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

HIDDEN, HEADS, MLP_RATIO = 3072, 24, 4.0
GRID, TEXT = 64, 512                       # 64 x 64 = 4096 image tokens
DOUBLE_DEPTH, SINGLE_DEPTH, SKIPPED = 19, 38, 5
RECOMPUTE_EVERY = 5
RATIOS = (0.5, 0.75)


def _comfy() -> None:
    """ComfyUI from COMFYUI_PATH (CPU mode, SDPA attention) and this pack as toma_pack."""
    from .config import setup_comfy

    if not setup_comfy(torch.device("cpu")):
        raise SystemExit("set COMFYUI_PATH to a ComfyUI checkout")


def _fill(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Small random weights: matrices N(0, 0.02), biases 0, norm scales 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1 and ("norm" in name or name.endswith("scale")):
                p.fill_(1.0)
            elif p.dim() == 1:
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return module.eval()


def make_blocks() -> tuple[torch.nn.Module, torch.nn.Module]:
    """ComfyUI's DoubleStreamBlock and SingleStreamBlock at Flux.1 size, fp32, CPU."""
    import comfy.ops
    from comfy.ldm.flux.layers import DoubleStreamBlock, SingleStreamBlock

    ops = comfy.ops.disable_weight_init
    double = DoubleStreamBlock(HIDDEN, HEADS, mlp_ratio=MLP_RATIO, qkv_bias=True,
                               dtype=torch.float32, operations=ops)
    single = SingleStreamBlock(HIDDEN, HEADS, mlp_ratio=MLP_RATIO, dtype=torch.float32,
                               operations=ops)
    return _fill(double, 1), _fill(single, 2)


def make_inputs(tokens_side: int | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    """img [1, side^2, C] (smooth field; side 64), txt [1, 512, C], vec [1, C],
    pe [1, 1, L, 64, 2, 2]."""
    from comfy.ldm.flux.layers import EmbedND

    tokens_side = tokens_side or GRID
    g = torch.Generator().manual_seed(seed)
    coarse = torch.randn(1, HIDDEN, 16, 16, generator=g)
    field = F.interpolate(coarse, size=(tokens_side, tokens_side), mode="bilinear",
                          align_corners=False)
    img = field.flatten(2).transpose(1, 2) + 0.1 * torch.randn(1, tokens_side ** 2, HIDDEN,
                                                                 generator=g)
    txt = torch.randn(1, TEXT, HIDDEN, generator=g)
    vec = torch.randn(1, HIDDEN, generator=g)
    ys, xs = torch.meshgrid(torch.arange(tokens_side), torch.arange(tokens_side), indexing="ij")
    img_ids = torch.stack((torch.zeros_like(ys), ys, xs), -1).reshape(1, -1, 3).float()
    ids = torch.cat((torch.zeros(1, TEXT, 3), img_ids), 1)
    pe = EmbedND(dim=HIDDEN // HEADS, theta=10000, axes_dim=[16, 56, 56])(ids)
    return {"img": img, "txt": txt, "vec": vec, "pe": pe}


def _double_wrap(block: torch.nn.Module) -> Callable[[dict], dict]:
    """ComfyUI's `original_block` for a double block: args dict -> {"img", "txt"}."""

    def run(a: dict) -> dict:
        img, txt = block(img=a["img"], txt=a["txt"], vec=a["vec"], pe=a["pe"],
                         attn_mask=a.get("attn_mask"),
                         transformer_options=a.get("transformer_options") or {})
        return {"img": img, "txt": txt}

    return run


def _single_wrap(block: torch.nn.Module) -> Callable[[dict], dict]:
    """ComfyUI's `original_block` for a single block: args dict -> {"img"}."""

    def run(a: dict) -> dict:
        return {"img": block(a["img"], vec=a["vec"], pe=a["pe"], attn_mask=a.get("attn_mask"),
                             transformer_options=a.get("transformer_options") or {})}

    return run


def _args(inputs: dict, kind: str) -> dict:
    """Fresh block args (blocks update their inputs in place)."""
    if kind == "double":
        return {"img": inputs["img"].clone(), "txt": inputs["txt"].clone(), "vec": inputs["vec"],
                "pe": inputs["pe"], "attn_mask": None, "transformer_options": {}}
    return {"img": torch.cat((inputs["txt"], inputs["img"]), 1), "vec": inputs["vec"],
            "pe": inputs["pe"], "attn_mask": None, "transformer_options": {}}


class _Toma:
    """flux_patch's replace patch for one block, with its state, run and model call set up."""

    def __init__(self, kind: str, block: torch.nn.Module, ratio: float, scope: str) -> None:
        from toma_pack.nodes.flux_patch import FluxCall, FluxToMA
        from toma_pack.nodes.options import make_options
        from toma_pack.nodes.run_state import RunState, ToMAState
        from toma_pack.toma_core import PlanCache

        state = ToMAState(make_options(ratio, skip_blocks="none", merge_scope=scope,
                                       recompute_every=1000), "flux")
        state.run = RunState(PlanCache(1000))
        self.state = state
        self.kind, self.block = kind, block
        self.toma = FluxToMA(state, 2, scope, {(kind, 0): 0})
        self.toma.calls.append(FluxCall(GRID, GRID, txt_len=TEXT))
        make = self.toma.double_block if kind == "double" else self.toma.single_block
        self.patch = make(0, None)
        wrap = _double_wrap if kind == "double" else _single_wrap
        self.extra = {"original_block": wrap(block)}

    def __call__(self, args: dict) -> dict:
        if self.kind == "double" and self.toma.double_scope == "attention":
            return self._with_hooks(args)
        return self.patch(args, self.extra)

    def _with_hooks(self, args: dict) -> dict:
        """The object patches patch_flux installs, set on the block for this call."""
        attn = self.block.img_attn
        originals = {name: getattr(attn, name).forward for name in ("qkv", "proj")}
        attn.qkv.forward = self.toma.qkv_forward(0, originals["qkv"])
        attn.proj.forward = self.toma.proj_forward(0, originals["proj"])
        try:
            return self.patch(args, self.extra)
        finally:
            for name in ("qkv", "proj"):
                del getattr(attn, name).forward          # back to the class's forward

    def build(self, inputs: dict) -> tuple[Any, float]:
        """Build this block's plan (kept for the timed calls): (plan, seconds)."""
        self.state.run.cache.clear()
        with torch.inference_mode():
            start = time.perf_counter()
            plan = self.toma.plan_for(self.kind, 0, *self._plan_args(inputs))
            return plan, time.perf_counter() - start

    def _plan_args(self, inputs: dict) -> tuple:
        if self.kind == "double":
            return inputs["img"], 0, {}, inputs["pe"], None, TEXT + GRID * GRID
        seq = torch.cat((inputs["txt"], inputs["img"]), 1)
        return seq, TEXT, {}, inputs["pe"], None, seq.shape[1]


def _image_out(kind: str, out: dict) -> torch.Tensor:
    """The image tokens of a block's output."""
    return out["img"] if kind == "double" else out["img"][:, TEXT:]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _variants(kind: str, block: torch.nn.Module, inputs: dict) -> list[tuple[dict, Callable]]:
    """(row, run once) for the plain block, each ToMA variant and each lower bound."""
    wrap = (_double_wrap if kind == "double" else _single_wrap)(block)
    out = [({"block": kind, "variant": "plain", "image_tokens": GRID * GRID},
            lambda: wrap(_args(inputs, kind)))]
    scopes = ("block", "attention") if kind == "double" else ("block",)
    for ratio in RATIOS:
        for scope in scopes:
            toma = _Toma(kind, block, ratio, scope)
            plan, plan_s = toma.build(inputs)
            out.append(({"block": kind, "variant": f"toma {scope}", "ratio": ratio,
                         "image_tokens": plan.merged_tokens, "plan_ms": plan_s * 1e3},
                        lambda t=toma: t(_args(inputs, kind))))
        tokens = round(GRID * GRID * (1 - ratio))
        small = {**inputs, "img": inputs["img"][:, :tokens],
                 "pe": inputs["pe"][:, :, :TEXT + tokens]}
        out.append(({"block": kind, "variant": "lower bound", "ratio": ratio,
                     "image_tokens": tokens}, lambda s=small: wrap(_args(s, kind))))
    return out


def _errors(kind: str, variants: list[tuple[dict, Callable]], inputs: dict) -> None:
    """Add err_out / err_update (image tokens vs the plain block) to the ToMA rows."""
    img_in = inputs["img"]
    with torch.inference_mode():
        base = _image_out(kind, variants[0][1]())
        for row, fn in variants:
            if row["variant"].startswith("toma"):
                img = _image_out(kind, fn())
                row["err_out"] = _rel(img, base)
                row["err_update"] = _rel(img - img_in, base - img_in)


def _bench_block(kind: str, block: torch.nn.Module, inputs: dict, reps: int) -> list[dict]:
    """Rows for one block kind: plain, ToMA variants, lower bounds."""
    from .config import default_config, interleaved_medians

    variants = _variants(kind, block, inputs)
    _errors(kind, variants, inputs)
    cfg = default_config(quick=False, comfy=True, device="cpu")
    seconds = interleaved_medians({str(i): fn for i, (_, fn) in enumerate(variants)}, cfg,
                                  warmup=1, reps=reps)
    base = seconds["0"]
    for i, (row, _) in enumerate(variants):
        row["ms"] = seconds[str(i)] * 1e3
        row["speedup"] = base / seconds[str(i)]
    return [row for row, _ in variants]


def project(rows: list[dict], ratio: float, double_variant: str) -> dict:
    """Whole-model blocks-only speedup for 19 + 38 blocks, the first 5 of each kind unmerged."""
    def ms(kind: str, variant: str, r: float | None = None) -> dict:
        return next(x for x in rows if x["block"] == kind and x["variant"] == variant
                    and (r is None or x.get("ratio") == r))

    d0, s0 = ms("double", "plain")["ms"], ms("single", "plain")["ms"]
    d, s = ms("double", double_variant, ratio), ms("single", "toma block", ratio)
    plain = DOUBLE_DEPTH * d0 + SINGLE_DEPTH * s0
    plans = (d["plan_ms"] + s["plan_ms"]) / RECOMPUTE_EVERY       # one plan per group
    toma = (SKIPPED * (d0 + s0) + (DOUBLE_DEPTH - SKIPPED) * d["ms"]
            + (SINGLE_DEPTH - SKIPPED) * s["ms"] + plans)
    return {"block": "model 19+38", "variant": f"projected, doubles {double_variant}",
            "ratio": ratio, "ms": toma, "speedup": plain / toma}


def run(reps: int = 1, threads: int | None = None) -> list[dict]:
    """All rows: per block kind and variant, then the whole-model projections."""
    _comfy()
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    double, single = make_blocks()
    inputs = make_inputs()
    rows = _bench_block("double", double, inputs, reps) + _bench_block("single", single, inputs,
                                                                        reps)
    for ratio in RATIOS:
        for variant in ("toma block", "toma attention"):
            rows.append(project(rows, ratio, variant))
    return rows


COLUMNS = ("block", "variant", "ratio", "image_tokens", "ms", "speedup", "plan_ms", "err_out",
           "err_update")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=1, help="timed calls per variant (median)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    a = parser.parse_args()
    rows = run(a.reps, a.threads)
    from .common import machine_info, markdown_table

    print(markdown_table(rows, COLUMNS))
    print()
    print(", ".join(f"{k}: {v}" for k, v in machine_info().items()))


if __name__ == "__main__":
    main()
