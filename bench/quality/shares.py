"""Where a transformer block's work goes, in the real models and in the quality fixtures.

    COMFYUI_PATH=/path/to/ComfyUI python -m bench.quality.shares [--out results.json]

Token merging pays for what a block spends per token; which scope (whole block or attention
only) and which ratio are best depends on how a block's work splits between self-attention
(its projections and the token-by-token core), cross-attention and the feed-forward, and that
split goes with tokens per channel. A fixture only predicts a real model if its split is the
real one. Measured, not derived: ComfyUI's own blocks built on the meta device (no memory, no
time) at the real and the fixture sizes, run once under torch's FlopCounterMode, each share
summed over the modules that do it:

- SDXL (BasicTransformerBlock at each attention level): self_attention = attn1 (with its
  q/k/v/out projections), attention_core = attn1 less those projections, cross_attention =
  attn2, feed_forward = ff.
- Flux (DoubleStreamBlock, SingleStreamBlock): feed_forward = img_mlp + txt_mlp, or the single
  block's MLP part of linear1 and linear2 (their output / input columns split qkv : mlp);
  self_attention = the rest; attention_core = what no child module does (the attention call).

Real sizes: SDXL base and Flux.1 dev at 1024x1024 (bench/shared/model_configs.py) with their
text encoders' token counts; fixtures at their evaluation size (bench/quality/models.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from ..shared.model_configs import FLUX_DEV, SDXL_UNET
from . import models as qm

META = torch.device("meta")
SHARES = ("self_attention", "attention_core", "cross_attention", "feed_forward")
TOLERANCE = 0.2      # a fixture's share within 20% of the real model's (relative)
# (name, layout or None for the real model, config, latent side, text tokens, text width)
REAL_SDXL = ("SDXL base 1024x1024", SDXL_UNET, 128, 77, 2048)
REAL_FLUX = ("Flux.1 dev 1024x1024", FLUX_DEV, 128, 512, 4096)


def _counts(module: torch.nn.Module, *args: Any, **kwargs: Any) -> dict[str, float]:
    """FLOPs of one call, per module path relative to `module` ("" = the module itself)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        module(*args, **kwargs)
    root = type(module).__name__
    return {name.removeprefix(root).removeprefix("."): float(sum(ops.values()))
            for name, ops in counter.get_flop_counts().items() if name != "Global"}


def _shares(parts: dict[str, float], total: float) -> dict[str, float]:
    return {k: parts[k] / total for k in SHARES}


def _core(counts: dict[str, float]) -> float:
    """What no leaf module does: the block's own attention call (the linears are leaves)."""
    leaves = [k for k in counts if k and not any(o.startswith(k + ".") for o in counts)]
    return counts[""] - sum(counts[k] for k in leaves)


def unet_levels(unet_config: dict, latent_side: int, text_tokens: int,
                text_width: int) -> list[dict[str, Any]]:
    """One row per attention level of a UNet (its first transformer block), outer level first."""
    import comfy.supported_models
    from comfy.ldm.modules.attention import BasicTransformerBlock

    config = comfy.supported_models.SDXL(dict(unet_config))
    config.unet_config["num_head_channels"] = unet_config["num_head_channels"]
    config.unet_config["num_heads"] = -1
    net = config.get_model({}, device=META).diffusion_model
    firsts: dict[int, BasicTransformerBlock] = {}
    for module in net.input_blocks.modules():
        if isinstance(module, BasicTransformerBlock):
            firsts.setdefault(module.attn1.to_q.in_features, module)
    rows = []
    for level, (channels, block) in enumerate(sorted(firsts.items())):
        side = latent_side // 2 ** (level + 1)          # attention starts at the second level
        tokens = side * side
        c = _counts(block, torch.empty(1, tokens, channels, device=META),
                    context=torch.empty(1, text_tokens, text_width, device=META),
                    transformer_options={})
        proj = sum(c[f"attn1.{p}"] for p in ("to_q", "to_k", "to_v", "to_out"))
        parts = {"self_attention": c["attn1"], "attention_core": c["attn1"] - proj,
                 "cross_attention": c["attn2"], "feed_forward": c["ff"]}
        rows.append({"block": f"level {level + 2}", "tokens": tokens, "channels": channels,
                     "tokens_per_channel": tokens / channels, **_shares(parts, c[""])})
    return rows


def flux_blocks(params: dict, latent_side: int, text_tokens: int) -> list[dict[str, Any]]:
    """One row per Flux block kind (double, single) at (latent_side / 2)^2 image tokens."""
    import comfy.ops
    from comfy.ldm.flux.layers import DoubleStreamBlock, SingleStreamBlock

    c, heads, ratio = params["hidden_size"], params["num_heads"], params["mlp_ratio"]
    ops = comfy.ops.disable_weight_init
    image = (latent_side // params["patch_size"]) ** 2
    n = image + text_tokens
    head = c // heads
    pe = torch.empty(1, 1, n, head // 2, 2, 2, device=META)
    vec = torch.empty(1, c, device=META)
    img, txt = torch.empty(1, image, c, device=META), torch.empty(1, text_tokens, c, device=META)
    double = DoubleStreamBlock(c, heads, ratio, qkv_bias=params["qkv_bias"], device=META,
                               operations=ops)
    single = SingleStreamBlock(c, heads, ratio, device=META, operations=ops)
    rows = []
    d = _counts(double, img, txt, vec, pe)
    mlp = d["img_mlp"] + d["txt_mlp"]
    rows.append({"block": "double", "tokens": n, "channels": c, "tokens_per_channel": n / c,
                 **_shares({"self_attention": d[""] - mlp, "attention_core": _core(d),
                            "cross_attention": 0.0, "feed_forward": mlp}, d[""])})
    s = _counts(single, torch.cat([txt, img], 1), vec, pe)
    hidden = single.mlp_hidden_dim
    mlp = s["linear1"] * hidden / (3 * c + hidden) + s["linear2"] * hidden / (c + hidden)
    rows.append({"block": "single", "tokens": n, "channels": c, "tokens_per_channel": n / c,
                 **_shares({"self_attention": s[""] - mlp, "attention_core": _core(s),
                            "cross_attention": 0.0, "feed_forward": mlp}, s[""])})
    return rows


def model_rows(layout: str | None, arch: str) -> list[dict[str, Any]]:
    """The rows of the real model of `arch` (layout None) or of a fixture layout."""
    if layout is None:
        name, config, side, tokens, width = REAL_SDXL if arch == "sdxl" else REAL_FLUX
    else:
        name, config = f"fixture {layout}", qm.ARCHITECTURE[layout][1]
        side, tokens, width = qm.EVAL_LATENT[layout], qm.CONTEXT_TOKENS, qm.CONTEXT_DIM
    rows = (unet_levels(config, side, tokens, width) if arch == "sdxl"
            else flux_blocks(config, side, tokens))
    return [{"model": name, **row} for row in rows]


def compare(layout: str) -> list[dict[str, Any]]:
    """A fixture's rows beside the real model's, with each share's ratio fixture / real and
    whether every share with a real value of at least 5% is within TOLERANCE."""
    arch = qm.arch(layout)
    out = []
    for real, fixture in zip(model_rows(None, arch), model_rows(layout, arch), strict=True):
        ratios = {k: fixture[k] / real[k] for k in SHARES if real[k] >= 0.05}
        out.append({"layout": layout, "block": real["block"], "real": real, "fixture": fixture,
                    "ratios": ratios,
                    "within": all(abs(r - 1) <= TOLERANCE for r in ratios.values())})
    return out


def report(rows: list[dict[str, Any]]) -> str:
    """A Markdown table: real and fixture shares side by side."""
    head = ("| fixture | block | model | tokens x channels | " + " | ".join(SHARES)
            + " | within 20% |")
    lines = [head, "|" + "---|" * (5 + len(SHARES))]
    for row in rows:
        for who in ("real", "fixture"):
            r = row[who]
            cells = [row["layout"], row["block"], r["model"], f"{r['tokens']} x {r['channels']}",
                     *(f"{100 * r[k]:.1f}%" for k in SHARES),
                     ("yes" if row["within"] else "no") if who == "fixture" else ""]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import os
    import sys

    from ..shared.common import commit, machine_info, write_result
    from ..shared.config import ROOT, setup_comfy

    parser = argparse.ArgumentParser(prog="python -m bench.quality.shares",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default=",".join(qm.ARCHITECTURE))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not setup_comfy(torch.device("cpu")):
        raise SystemExit("set COMFYUI_PATH to a ComfyUI checkout")
    rows = [row for layout in args.layouts.split(",") for row in compare(layout)]
    comfyui = str(ROOT.joinpath(os.environ["COMFYUI_PATH"]).resolve())
    config = {"commit": commit(), "comfyui": comfyui,
              "command": " ".join(["python -m bench.quality.shares",
                                   *(sys.argv[1:] if argv is None else argv)])}
    text = "\n".join([
        "# Where a transformer block's work goes: real models and quality fixtures "
        "(bench/quality/shares.py)", "",
        f"commit: {config['commit']}", "", f"command: `{config['command']}` with "
        f"COMFYUI_PATH={config['comfyui']}", "",
        "FLOPs of one block call (ComfyUI's blocks on the meta device, FlopCounterMode); "
        f"within: every share of at least 5% within {TOLERANCE:.0%} of the real model's.", "",
        report(rows), ""])
    print(text)
    if args.out:
        write_result(args.out, {"machine": machine_info(), "config": config, "rows": rows}, text)


if __name__ == "__main__":
    main()
