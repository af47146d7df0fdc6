"""Full-width Flux blocks: ToMA's replace patches against the plain blocks.

    COMFYUI_PATH=/path/to/ComfyUI python -m bench.speed.flux_blocks [--reps 3] [--threads N]
        [--clock cpu]

On a machine shared with other jobs use --threads 1: torch's thread pool thrashes when the cores
are busy (small elementwise ops got 8x slower on a loaded 2-core machine), which would drown the
differences being measured.

Builds ComfyUI's own DoubleStreamBlock and SingleStreamBlock at Flux.1 size (hidden 3072,
24 heads, mlp_ratio 4) with small random weights, fp32, SDPA attention, on 4096 image tokens
(a 1024x1024 image) and 512 text tokens, and times per block:

- the plain block;
- ToMA at ratios 0.5 and 0.75 through dit_patch.py's own replace patches (the real block as
  `original_block`), for double blocks in both scopes ("block", "attention"); the plan is built
  once beforehand and reused, as it is across a group of blocks (its cost is reported apart);
- the lower bound: the plain block on the merged image token count (2048 / 1024), no merge
  cost; a ToMA block faster than it is flagged (noise or a broken bound), not a result.

Timing: bench.shared.config.timings on the run's clock: warm-up calls, then `reps` rounds that call
every variant once in turn; median, minimum and spread per variant; the plan build likewise.

Fidelity: relative L2 error of the block output and of its update (output - input) against the
plain block. Random weights see no real image, so the image tokens are a smooth random field
(low-resolution noise upsampled, plus a little white noise), the way latent tokens correlate with
their neighbours; errors here compare variants, they do not predict image quality.

The projection: a 19 double + 38 single block model with the node's default skip_blocks and
recompute_every (read from the pack: "d0-4, s0-4" and 1), blocks only (embedders and the final
layer are a rounding error), one plan build per group amortised over recompute_every steps; per
repetition, so the projected speedup has a range too, and against the same projection of the
lower bounds.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F

from ..shared.common import Timing, machine_info, markdown_table, speedup, versus_lower_bound
from ..shared.config import BenchConfig, default_config, timings
from ..shared.weights import fill_weights

HIDDEN, HEADS, MLP_RATIO = 3072, 24, 4.0
GRID, TEXT = 64, 512                       # 64 x 64 = 4096 image tokens
DOUBLE_DEPTH, SINGLE_DEPTH = 19, 38      # Flux.1 dev / schnell
RATIOS = (0.5, 0.75)


def _comfy() -> None:
    """ComfyUI from COMFYUI_PATH (CPU mode, SDPA attention) and this pack as toma_pack."""
    from ..shared.config import setup_comfy

    if not setup_comfy(torch.device("cpu")):
        raise SystemExit("set COMFYUI_PATH to a ComfyUI checkout")


def make_blocks() -> tuple[torch.nn.Module, torch.nn.Module]:
    """ComfyUI's DoubleStreamBlock and SingleStreamBlock at Flux.1 size, fp32, CPU."""
    import comfy.ops
    from comfy.ldm.flux.layers import DoubleStreamBlock, SingleStreamBlock

    ops = comfy.ops.disable_weight_init
    double = DoubleStreamBlock(HIDDEN, HEADS, mlp_ratio=MLP_RATIO, qkv_bias=True,
                               dtype=torch.float32, operations=ops)
    single = SingleStreamBlock(HIDDEN, HEADS, mlp_ratio=MLP_RATIO, dtype=torch.float32,
                               operations=ops)
    return fill_weights(double, 1).eval(), fill_weights(single, 2).eval()


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
    """dit_patch's replace patch for one Flux block, with its state, run and model call set up."""

    def __init__(self, kind: str, block: torch.nn.Module, ratio: float, scope: str) -> None:
        from toma_pack.nodes.dit_patch import DiTToMA
        from toma_pack.nodes.families import flux
        from toma_pack.nodes.model_call import ModelCall
        from toma_pack.nodes.options import make_options
        from toma_pack.nodes.run_state import ToMAState

        state = ToMAState(make_options(ratio, skip_blocks="none", merge_scope=scope,
                                       recompute_every=1000), "flux")
        self.state = state
        # the model call the blocks run in (sampling opens it in the APPLY_MODEL wrapper and
        # hands it to the blocks in their transformer_options); its plans dict keeps the plan
        self.call = ModelCall(state.new_run(), grid=(1, GRID, GRID), merging=True,
                              txt_len=TEXT)
        self.kind, self.block = kind, block
        self.spec = flux.KINDS[0 if kind == "double" else 1]
        self.attention = flux.AttentionScope() if scope == "attention" else None
        self.toma = DiTToMA(state, flux.description((1, 2, 2)), {(self.spec.key, 0): 0},
                            self.attention)
        self.patch = self.toma.replace_patch(self.spec, 0, None)
        wrap = _double_wrap if kind == "double" else _single_wrap
        self.extra = {"original_block": wrap(block)}

    def __call__(self, args: dict) -> dict:
        args = self._in_call(args)
        if self.kind == "double" and self.attention is not None:
            return self._with_hooks(args)
        return self.patch(args, self.extra)

    def _in_call(self, args: dict) -> dict:
        """The block's args with this model call in their transformer_options."""
        options = {**(args.get("transformer_options") or {}), self.state.call_key: self.call}
        return {**args, "transformer_options": options}

    def _with_hooks(self, args: dict) -> dict:
        """The object patches the attention scope installs, set on the block for this call."""
        attn = self.block.img_attn
        originals = {name: getattr(attn, name).forward for name in ("qkv", "proj")}
        attn.qkv.forward = self.attention.qkv_forward(0, originals["qkv"])
        attn.proj.forward = self.attention.proj_forward(0, originals["proj"])
        try:
            return self.patch(args, self.extra)
        finally:
            for name in ("qkv", "proj"):
                del getattr(attn, name).forward          # back to the class's forward

    def build(self, inputs: dict) -> Any:
        """Build this block's plan afresh (it is kept for the timed calls)."""
        from toma_pack.nodes.token_layout import stream_of

        self.call.plans.clear()
        args = self._in_call(_args(inputs, self.kind))
        with torch.inference_mode():
            found = self.toma.plan_for(self.spec, 0, args,
                                       stream_of(self.spec, args[self.spec.stream]),
                                       args["transformer_options"], self.call,
                                       f"{self.spec.letter}0")
            return None if found is None else found[0]


def _image_out(kind: str, out: dict) -> torch.Tensor:
    """The image tokens of a block's output."""
    return out["img"] if kind == "double" else out["img"][:, TEXT:]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _variants(kind: str, block: torch.nn.Module, inputs: dict
              ) -> tuple[list[tuple[dict, Callable]], dict[str, Callable]]:
    """(row, run once) for the plain block, each ToMA variant and each lower bound, and the
    plan builds of the ToMA variants by row key."""
    wrap = (_double_wrap if kind == "double" else _single_wrap)(block)
    out = [({"block": kind, "variant": "plain", "image_tokens": GRID * GRID},
            lambda: wrap(_args(inputs, kind)))]
    builds = {}
    scopes = ("block", "attention") if kind == "double" else ("block",)
    for ratio in RATIOS:
        tokens = None
        for scope in scopes:
            toma = _Toma(kind, block, ratio, scope)
            tokens = toma.build(inputs).merged_tokens
            row = {"block": kind, "variant": f"toma {scope}", "ratio": ratio,
                   "image_tokens": tokens}
            builds[_key(row)] = lambda t=toma: t.build(inputs)
            out.append((row, lambda t=toma: t(_args(inputs, kind))))
        small = {**inputs, "img": inputs["img"][:, :tokens],
                 "pe": inputs["pe"][:, :, :TEXT + tokens]}
        out.append(({"block": kind, "variant": "lower bound", "ratio": ratio,
                     "image_tokens": tokens}, lambda s=small: wrap(_args(s, kind))))
    return out, builds


def _key(row: dict) -> str:
    return f"{row['block']} {row['variant']} {row.get('ratio')}"


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


def _bench_block(kind: str, block: torch.nn.Module, inputs: dict,
                 cfg: BenchConfig) -> tuple[list[dict], dict[str, Timing]]:
    """Rows for one block kind (plain, ToMA variants, lower bounds) and their timings."""
    variants, builds = _variants(kind, block, inputs)
    _errors(kind, variants, inputs)
    found = timings({_key(row): fn for row, fn in variants}, cfg)
    plans = timings(builds, cfg, warmup=0)
    base = found[_key(variants[0][0])]
    for row, _ in variants:
        row.update(found[_key(row)].fields())
        row.update(speedup(base, found[_key(row)]))
        if _key(row) in plans:
            row["plan_ms"] = 1e3 * plans[_key(row)].median
    for row, _ in variants:
        if row["variant"] == "toma block":
            versus_lower_bound(row, found[_key(row)],
                               found[_key({**row, "variant": "lower bound"})])
    return [row for row, _ in variants], found


def project(rows: list[dict], found: dict[str, Timing], ratio: float,
            double_variant: str) -> dict:
    """Whole-model blocks-only speedup for 19 + 38 blocks, the node's default skip_blocks and
    recompute_every, per repetition; against the same projection of the lower bounds."""
    defaults = _defaults()
    skip_d = sum(1 for i in range(DOUBLE_DEPTH) if i in defaults.skip_blocks.double)
    skip_s = sum(1 for i in range(SINGLE_DEPTH) if i in defaults.skip_blocks.single)

    def times(kind: str, variant: str, r: float | None = None) -> tuple[float, ...]:
        return found[f"{kind} {variant} {r}"].times

    def row_of(kind: str, variant: str) -> dict:
        return next(x for x in rows if x["block"] == kind and x["variant"] == variant
                    and x.get("ratio") == ratio)

    plans = (row_of("double", double_variant)["plan_ms"]
             + row_of("single", "toma block")["plan_ms"]) / 1e3 / defaults.recompute_every

    def model(d: tuple[float, ...], s: tuple[float, ...], extra: float = 0.0) -> Timing:
        return Timing(tuple(skip_d * d0 + skip_s * s0 + (DOUBLE_DEPTH - skip_d) * di
                            + (SINGLE_DEPTH - skip_s) * si + extra
                            for d0, s0, di, si in zip(times("double", "plain"),
                                                      times("single", "plain"), d, s,
                                                      strict=True)))

    plain = model(times("double", "plain"), times("single", "plain"))
    toma = model(times("double", double_variant, ratio), times("single", "toma block", ratio),
                 plans)
    bound = model(times("double", "lower bound", ratio), times("single", "lower bound", ratio))
    row = {"block": "model 19+38", "variant": f"projected, doubles {double_variant}",
           "ratio": ratio, **toma.fields(), **speedup(plain, toma)}
    versus_lower_bound(row, toma, bound)
    row["lb_speedup"] = plain.median / bound.median
    return row


def _defaults() -> Any:
    """The ToMA node's default options (skip_blocks, recompute_every), from the pack."""
    from toma_pack.nodes.options import make_options

    return make_options()


def run(cfg: BenchConfig) -> list[dict]:
    """All rows: per block kind and variant, then the whole-model projections; timed on cfg's
    clock, threads and repetitions."""
    _comfy()
    cfg.apply_threads()
    torch.manual_seed(0)
    double, single = make_blocks()
    inputs = make_inputs()
    rows, found = _bench_block("double", double, inputs, cfg)
    single_rows, single_found = _bench_block("single", single, inputs, cfg)
    rows += single_rows
    found.update(single_found)
    for ratio in RATIOS:
        for variant in ("toma block", "toma attention"):
            rows.append(project(rows, found, ratio, variant))
    return rows


COLUMNS = ("block", "variant", "ratio", "image_tokens", "ms", "spread", "speedup", "speedup_lo",
           "speedup_hi", "vs_lb", "lb_speedup", "plan_ms", "err_out", "err_update", "flag")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3, help="timed calls per variant (>= 3)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    a = parser.parse_args()
    cfg = replace(default_config(False, True, "cpu", a.clock, a.threads), warmup=1, reps=a.reps)
    rows = run(cfg)
    print(", ".join(f"{k}: {v}" for k, v in machine_info().items()))
    print(f"\n{cfg.describe()}\n")
    print(markdown_table(rows, COLUMNS))


if __name__ == "__main__":
    main()
