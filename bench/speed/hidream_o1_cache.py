"""HiDream-O1's prompt K/V cache against merging: what patching its blocks costs, measured.

    COMFYUI_PATH=/path/to/ComfyUI python -m bench.speed.hidream_o1_cache --threads 1 --clock cpu
        [--cases t2i-128,t2i-512,edit-128] [--size 2048x2048] [--ratio 0.5] [--reps 3]
        [--out bench/results/<date>-cpu-hidream-o1-cache.json]

HiDreamO1Transformer (ComfyUI 0.33) runs [prompt; tms; image (; reference patches)] through its
36 Qwen3-VL-8B decoder layers (width 4096, 32 query and 8 key/value heads of 128, feed-forward
12288), the prompt causal. From its second call on it keeps the prompt's keys and values (the
"hot path"): a step runs only [tms; image (; reference patches)] and attends to the cached
prompt. It keeps them only while no "dit" replace patch is set, so a model whose blocks any node
patches (a merging patch among them) runs the whole sequence at every step.

One decoder layer at the real width (seeded random weights, fp32, CPU, SDPA attention), its
arguments taken from the model's own forward (a one-layer model: the cold call, then the hot
call on the cache it left), timed in interleaved rounds:

- cached: the hot path, as the unpatched model runs every step after the first;
- patched: the whole sequence, as the model runs with any block patch and nothing merged;
- merged, patched (lower bound): the whole sequence with only (1 - ratio) of the image tokens
  and their RoPE rows (the prompt, tms and reference patches unchanged): the best a merging
  "dit" patch could give;
- merged, cached (lower bound): the hot path with the same image tokens: what merging would
  give if it kept the cache;
- ToMA, cached: the pack's own block patch on the whole sequence as ComfyUI's loop hands it to
  the patch, keeping the prompt (nodes/prefix_cache.py, on the hot call's kept keys and values):
  merge, the layer on the tokens after the prompt, unmerge; its plan kept, as a group's blocks
  reuse their group's plan;
- ToMA plan build: one plan for the layer's image tokens.

Projection (layers only; the node's default skip_blocks, blocks 0-4, unmerged; no merging
cost, so every merged figure is a lower bound on the time): a patch that does not keep the
cache makes every layer lose it, so that model is 5 x patched + 31 x merged, patched, against
36 x cached; ToMA's is 5 x cached + 31 x ToMA, cached + one plan build (measured, not a bound);
per repetition. Cases: t2i-P: text to image with a prompt of P tokens (chat template included);
edit-P: instruction edit with one reference image (HiDream-O1 Reference Images): its 12 x 12 ViT
tokens join the cached prompt, its 32-pixel patches (as many as the target's) the gen tokens.

Writes nothing unless --out: then the JSON there and the same report as .md beside it.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..shared.common import (
    MIN_REPS,
    Timing,
    commit,
    cpu_features,
    cpu_model,
    interleaved,
    machine_info,
    markdown_table,
    report_head,
    speedup,
    write_result,
)
from .dit_families import (
    HIDREAM_O1_PATCH,
    HiDreamO1Case,
    _setup,
    build_hidream_o1,
    capture_forwards,
    default_skipped,
    hidream_o1_conditioning,
    keep_grid,
    latent_image,
)

log = logging.getLogger(__name__)

DEPTH = 36                  # Qwen3-VL-8B decoder layers
VARIANTS = ("cached", "patched", "merged, patched", "merged, cached", "ToMA, cached",
            "ToMA plan build")
COLUMNS = ("case", "variant", "prompt_tokens", "gen_tokens", "image_tokens", "ms", "spread",
           "reps", "speedup", "speedup_lo", "speedup_hi", "note")


def parse_case(text: str) -> HiDreamO1Case:
    """"t2i-128" / "edit-128" -> HiDreamO1Case."""
    kind, _, prompt = text.partition("-")
    if kind not in ("t2i", "edit") or not prompt.isdigit() or int(prompt) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: expected t2i-P or edit-P, P >= 2 tokens")
    return HiDreamO1Case(text, int(prompt), 1 if kind == "edit" else 0)


@dataclass(frozen=True)
class Layer:
    """The layer and its arguments from the model's forward: cold (the whole sequence) and hot
    (tokens after the cached prefix); where the image starts in each, its length and the
    prefix's."""

    layer: torch.nn.Module
    cold: dict
    hot: dict
    image_start: int
    image_tokens: int
    cache_len: int
    grid: tuple[int, int, int]

    def call(self, hot: bool, keep: int | None = None) -> Callable[[], Any]:
        """One layer call on fresh arguments (the layer adds into its input in place), with
        only the first `keep` image tokens and their RoPE rows."""
        args = self.hot if hot else self.cold
        start = self.image_start - (self.cache_len if hot else 0)
        keep = keep or self.image_tokens

        def run() -> Any:
            cut = {**args, "x": keep_grid(args["x"], 1, start, self.image_tokens, keep),
                   "freqs_cis": tuple(keep_grid(t, t.ndim - 2, start, self.image_tokens, keep)
                                      for t in args["freqs_cis"])}
            return self.layer(**cut)

        return run


def capture_layer(model: torch.nn.Module, case: HiDreamO1Case, size: tuple[int, int]) -> Layer:
    """Layer for `case` at `size` (width, height): a cold call fills the cache, the hot call's
    and a second cold call's layer arguments are recorded (the cold one as a block patch runs
    it: no K/V kept)."""
    width, height = size
    grid = (1, height // HIDREAM_O1_PATCH, width // HIDREAM_O1_PATCH)
    x = latent_image(grid, 3, 2, HIDREAM_O1_PATCH)
    conds = hidream_o1_conditioning(case, x)
    t = torch.full((1,), 700.0)
    layer = model.language_model.layers[0]
    with torch.inference_mode():
        model.clear_kv_cache()
        model(x, t, **conds)                                        # fills the cache
        hot = capture_forwards(lambda: model(x, t, **conds), [layer])[0]
        model.clear_kv_cache()
        cold = capture_forwards(lambda: model(x, t, **conds), [layer])[0]
    cache_len = hot["past_key_value"][2]
    cold["past_key_value"] = None
    return Layer(layer, cold, hot, conds["input_ids"].shape[1], math.prod(grid), cache_len, grid)


def toma_calls(lay: Layer, ratio: float) -> tuple[Callable[[], Any], Callable[[], Any], int]:
    """(ToMA's patch of the layer on a hot call, one plan build, the merged image tokens): the
    pack's DiTToMA with HiDream-O1's description, keeping the prompt on the hot call's kept keys
    and values, handed the whole sequence as ComfyUI's loop hands it to a "dit" patch."""
    from toma_pack.nodes.dit_patch import DiTToMA
    from toma_pack.nodes.families.hidream_o1 import description
    from toma_pack.nodes.model_call import ModelCall
    from toma_pack.nodes.options import make_options
    from toma_pack.nodes.prefix_cache import PrefixEntry
    from toma_pack.nodes.run_state import ToMAState
    from toma_pack.nodes.token_layout import stream_of

    spec = description()
    kind = spec.kinds[0]
    state = ToMAState(make_options(ratio, skip_blocks="none", recompute_every=1000), spec.name)
    k, v, n = lay.hot["past_key_value"]
    call = ModelCall(state.new_run(), grid=lay.grid, merging=True, txt_len=lay.image_start,
                     prompt=(PrefixEntry(n, {0: (k, v)}), True))
    toma = DiTToMA(state, spec, {(kind.key, 0): 0})
    toma.prefix_layers = [lay.layer]
    patch = toma.replace_patch(kind, 0, None)
    names = ("x", "attention_mask", "freqs_cis", "optimized_attention")
    base = {**{name: lay.cold[name] for name in names},
            "transformer_options": {state.call_key: call}}

    def args() -> dict:
        return {**base, "x": base["x"].clone()}      # the layer adds into its input in place

    def run() -> Any:
        return patch(args(), {"original_block": None})

    def build() -> Any:
        call.plans.clear()
        a = args()
        return toma.plan_for(kind, 0, a, stream_of(kind, a[kind.stream]),
                             a["transformer_options"], call, "0")

    with torch.inference_mode():
        plan = build()[0]
    return run, build, plan.merged_tokens


def bench_case(model: torch.nn.Module, case: HiDreamO1Case, size: tuple[int, int], ratio: float,
               reps: int, clock: str) -> list[dict]:
    """The four variants' rows and the projected models' for one case."""
    lay = capture_layer(model, case, size)
    keep = round(lay.image_tokens * (1 - ratio))
    toma, build, merged = toma_calls(lay, ratio)
    calls = {"cached": lay.call(True), "patched": lay.call(False),
             "merged, patched": lay.call(False, keep), "merged, cached": lay.call(True, keep),
             "ToMA, cached": toma, "ToMA plan build": build}
    cold_len, hot_len = lay.cold["x"].shape[1], lay.hot["x"].shape[1]
    tokens = {"cached": (hot_len, lay.image_tokens), "patched": (cold_len, lay.image_tokens),
              "merged, patched": (cold_len - lay.image_tokens + keep, keep),
              "merged, cached": (hot_len - lay.image_tokens + keep, keep),
              "ToMA, cached": (hot_len - lay.image_tokens + merged, merged),
              "ToMA plan build": (None, lay.image_tokens)}
    with torch.inference_mode():
        for fn in calls.values():     # warm-up
            fn()
        found = interleaved(calls, warmup=0, reps=reps, clock=clock)
    base = {"case": case.name, "prompt_tokens": lay.cache_len}
    rows = []
    for name in VARIANTS:
        gen, image = tokens[name]
        ratios = (speedup(found["cached"], found[name]) if name != "ToMA plan build" else
                  dict.fromkeys(("speedup", "speedup_lo", "speedup_hi")))   # not a layer
        rows.append({**base, "variant": name, "gen_tokens": gen, "image_tokens": image,
                     **found[name].fields(), **ratios,
                     "note": "lower bound" if name.startswith("merged") else None})
    rows += projections(case, found, ratio)
    return rows


def projections(case: HiDreamO1Case, found: dict[str, Timing], ratio: float) -> list[dict]:
    """The 36-layer models against the unpatched model (36 x cached), per repetition."""
    skip = default_skipped(DEPTH)

    def model(unmerged: str, merged: str, skipped: int, plan: bool = False) -> Timing:
        builds = found["ToMA plan build"].times if plan else (0.0,) * len(found[merged].times)
        return Timing(tuple(skipped * u + (DEPTH - skipped) * m + b for u, m, b in
                            zip(found[unmerged].times, found[merged].times, builds, strict=True)))

    today = model("cached", "cached", DEPTH)
    models = [(f"model, any block patch, nothing merged ({DEPTH} x patched)",
               model("patched", "patched", DEPTH), None),
              (f"model, merging patch at ratio {ratio:g} ({skip} x patched + {DEPTH - skip} x "
               f"merged, patched)", model("patched", "merged, patched", skip), "lower bound"),
              (f"model, merging that kept the cache ({skip} x cached + {DEPTH - skip} x "
               f"merged, cached)", model("cached", "merged, cached", skip), "lower bound"),
              (f"model, ToMA keeping the cache ({skip} x cached + {DEPTH - skip} x ToMA, cached "
               f"+ 1 plan build)", model("cached", "ToMA, cached", skip, plan=True), None)]
    return [{"case": case.name, "variant": name, **timing.fields(), **speedup(today, timing),
             "note": note} for name, timing, note in models]


def notes(clock: str, reps: int) -> list[str]:
    """How the figures were taken, for the report."""
    return [f"CPU {cpu_model()} ({cpu_features()}), {torch.get_num_threads()} thread(s), "
            f"{clock} clock, float32; one untimed call per variant, then median, minimum and "
            f"spread of {reps} interleaved repetitions",
            "speedup: against cached (the unpatched model's layer, or its 36 layers); "
            "speedup_lo/hi: lowest/highest ratio of the side-by-side repetitions",
            "gen_tokens: the tokens the layer runs on (queries); prompt_tokens: the prefix the "
            "hot path keeps as keys and values; lower bound: merged image tokens with no "
            "merging cost"]


def report(result: dict[str, Any]) -> str:
    """The Markdown report of a result dict."""
    lines = report_head("HiDream-O1: its prompt K/V cache against merging block patches",
                        result)
    lines += ["", markdown_table(result["rows"], COLUMNS)]
    return "\n".join(lines) + "\n"


def _size(text: str) -> tuple[int, int]:
    width, _, height = text.partition("x")
    patch = HIDREAM_O1_PATCH
    if not (width.isdigit() and height.isdigit()) or int(width) % patch or int(height) % patch:
        raise argparse.ArgumentTypeError(f"{text!r}: expected WxH, multiples of {patch}")
    return int(width), int(height)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="t2i-128,t2i-512,edit-128",
                        type=lambda s: [parse_case(c.strip()) for c in s.split(",") if c.strip()])
    parser.add_argument("--size", type=_size, default=(2048, 2048),
                        help="WxH pixels (HiDream-O1's default and trained size: 2048x2048)")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--reps", type=int, default=MIN_REPS)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path for the results (the .md report beside it)")
    a = parser.parse_args(argv)
    if not 0 < a.ratio < 1:
        parser.error(f"--ratio must be in (0, 1), got {a.ratio}")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s",
                        datefmt="%H:%M:%S")
    _setup()
    if a.threads:
        torch.set_num_threads(a.threads)
    model = build_hidream_o1()
    rows = []
    for case in a.cases:
        case_rows = bench_case(model, case, a.size, a.ratio, a.reps, a.clock)
        for row in case_rows:
            log.warning("%s %s: %.0f ms, speedup %s", row["case"], row["variant"], row["ms"],
                        "-" if row["speedup"] is None else f"{row['speedup']:.3g}")
        rows += case_rows
    result = {"machine": machine_info(),
              "config": {"commit": commit(), "comfyui": os.environ.get("COMFYUI_PATH"),
                         "command": "python -m bench.speed.hidream_o1_cache " + " ".join(
                             sys.argv[1:] if argv is None else argv),
                         "clock": a.clock, "threads": torch.get_num_threads(), "reps": a.reps,
                         "ratio": a.ratio, "size": a.size},
              "notes": notes(a.clock, a.reps), "rows": rows}
    text = report(result)
    print(text)
    if a.out:
        write_result(a.out, result, text)
        print(f"JSON: {a.out} (Markdown beside it) at {datetime.datetime.now():%H:%M}")


if __name__ == "__main__":
    main()
