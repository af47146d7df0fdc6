"""SDXL transformer blocks: ToMA in both scopes against no merging, its lower bound, ToMeSD, ToDo.

Levels (reference_blocks.LEVELS): SDXL at 1024x1024 has 64x64 tokens x 640 channels (10 heads,
10 blocks) and 32x32 x 1280 (20 heads, 60 blocks); context [B, 77, 2048]. The block is ComfyUI's
BasicTransformerBlock when ComfyUI is loaded, else reference_blocks.SDXLBlock; random weights;
input x [B, N, C] is a photograph's token grid (photos.py). Variants, per level:

- unpatched: the block as is.
- toma block / attention: through the pack's own UNetToMA.block_forward (block scope: plan.around
  the block; attention scope: the block with the node's attn1 merge/unmerge patch pair), ratio
  0.25 / 0.5 / 0.75, tile_count 64 (and 16 / 256 at 0.5; the node's own default is tiles of
  about 64 tokens: 64 tiles at 64x64, 16 at 32x32). The plan is the one kept in the block's
  model call, as for every block but the first of a level in a step; building it is timed
  apart (plan_ms, the node's own plan_for) and its share per block call is plan_ms / (blocks at
  the level x the node's default recompute_every) (plan_share_ms).
- lower bound: the same block on the merged token count, no merging cost (block scope: the
  block on the first N' tokens; attention scope: self-attention on N' tokens, output discarded
  into a preallocated full-size tensor).
- tomesd block / attention: baselines.ToMeSD at the same ratios (matching at every call).
- todo: baselines' ToDo (keys/values 2x2-pooled in self-attention).

Times are medians of interleaved repetitions after warm-up, inference mode; peak memory on CUDA.
Errors against the unpatched output on the same input: err = |y - y0| / |y0|, err_update =
|y - y0| / |y0 - x| (the block's update), cos = mean per-token cosine(y, y0).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ..shared.common import MIN_REPS, Timing, peak_memory, speedup, versus_lower_bound
from ..shared.config import BenchConfig, load_pack, timings
from ..shared.photos import photo_tokens
from .baselines import ToMeSD, todo_attn1_patch, todo_tokens, tomesd_matching
from .reference_blocks import (
    SDXL_LEVELS,
    SMALL_LEVELS,
    Level,
    block_options,
    make_block,
    make_context,
)

log = logging.getLogger(__name__)

RATIOS = (0.25, 0.5, 0.75)
SCOPES = ("block", "attention")
TILE_COUNTS = (16, 64, 256)
DEFAULT_TILES = 64
COLUMNS = ("level", "method", "scope", "ratio", "tiles", "tokens", "ms", "spread", "plan_ms",
           "plan_share_ms", "ms_total", "speedup", "speedup_lo", "speedup_hi", "vs_lb", "err",
           "cos", "peak_mb", "flag")


@dataclass(frozen=True)
class Variant:
    """One way of running a block. method: unpatched | toma | lower bound | tomesd | todo."""

    method: str
    scope: str | None = None
    ratio: float | None = None
    tiles: int | None = None

    @property
    def key(self) -> str:
        parts = [self.method, self.scope, self.ratio, self.tiles]
        return " ".join(str(p) for p in parts if p is not None)


UNPATCHED = Variant("unpatched")


@dataclass
class Prepared:
    """A variant ready to run: call() -> block output [B, N, C]; tokens: what the merged part
    runs on; plan(): a fresh plan the node's way (ToMA only); extra: merge/unmerge calls."""

    call: Callable[[], torch.Tensor]
    tokens: int
    plan: Callable[[], Any] | None = None
    extra: dict[str, Callable[[], Any]] = field(default_factory=dict)


def variants(ratios: tuple[float, ...], tile_counts: tuple[int, ...], baselines: bool = True,
             lower_bounds: bool = True) -> list[Variant]:
    """The variant list: unpatched, ToMA (both scopes, each ratio at the default tile count,
    each followed by its lower bound, so that the two run side by side; other tile counts at
    0.5), ToMeSD and ToDo."""
    out = [UNPATCHED]
    for scope in SCOPES:
        for r in ratios:
            out.append(Variant("toma", scope, r, DEFAULT_TILES))
            out += [Variant("lower bound", scope, r)] if lower_bounds else []
        out += [Variant("toma", scope, 0.5, t) for t in tile_counts if t != DEFAULT_TILES]
    if baselines:
        if tomesd_matching() is not None:
            out += [Variant("tomesd", s, r) for s in SCOPES for r in ratios]
        out.append(Variant("todo", "attention", 0.75))
    return out


class LevelBench:
    """One random-weight block of `level` with its context and transformer_options."""

    def __init__(self, level: Level, cfg: BenchConfig) -> None:
        self.level, self.cfg = level, cfg
        self.block = make_block(level, cfg.comfy, cfg.device, cfg.dtype, seed=cfg.seed)
        self.context = make_context(cfg.batch, cfg.device, cfg.dtype, seed=cfg.seed + 1)
        self.options = block_options(level, cfg.batch)

    def tokens_of(self, photo: str) -> torch.Tensor:
        """Photograph `photo` as this level's input x [B, N, C]."""
        x = photo_tokens(photo, self.level.side, self.level.channels, seed=self.cfg.seed)
        return x.expand(self.cfg.batch, -1, -1).to(self.cfg.device, self.cfg.dtype).contiguous()

    def _run(self, x: torch.Tensor, options: dict) -> Callable[[], torch.Tensor]:
        return lambda: self.block(x, context=self.context, transformer_options=options)

    def prepare(self, v: Variant, x: torch.Tensor) -> Prepared:
        """Build variant `v` on input x [B, N, C]."""
        side = self.level.side
        if v.method == "unpatched":
            return Prepared(self._run(x, dict(self.options)), self.level.tokens)
        if v.method == "toma":
            return self._toma(v, x)
        if v.method == "lower bound":
            return self._lower_bound(v, x)
        if v.method == "tomesd":
            gen = torch.Generator(self.cfg.device).manual_seed(self.cfg.seed)
            tome = ToMeSD(side, side, v.ratio, gen)
            if v.scope == "block":
                call = self._replaced(tome.block_forward(self.block.forward), x)
            else:
                call = self._run(x, self._patched(tome.attn1_patch, tome.attn1_output_patch))
            return Prepared(call, tome.merged_tokens())
        if v.method == "todo":
            return Prepared(self._run(x, self._patched(todo_attn1_patch(side, side))),
                            todo_tokens(side, side))
        raise ValueError(f"unknown method {v.method!r}")

    def _replaced(self, forward: Callable, x: torch.Tensor,
                  extra: dict | None = None) -> Callable[[], torch.Tensor]:
        """A call of a block-forward replacement on x; `extra`: more transformer_options."""
        options = {**self.options, **(extra or {})}
        return lambda: forward(x, context=self.context, transformer_options=options)

    def _patched(self, attn1: Callable, output: Callable | None = None) -> dict:
        patches = {"attn1_patch": [attn1]}
        if output is not None:
            patches["attn1_output_patch"] = [output]
        return {**self.options, "patches": patches}

    def _toma(self, v: Variant, x: torch.Tensor) -> Prepared:
        """ToMA through the pack's UNetToMA, in a model call of a live run as in sampling: the
        timed block calls reuse the call's plan (kept in its plans dict, as every block of a
        level but the first reuses it in a step) and the run's index tables."""
        load_pack()
        from toma_pack.nodes.model_call import ModelCall
        from toma_pack.nodes.options import make_options
        from toma_pack.nodes.run_state import ToMAState
        from toma_pack.nodes.unet_patch import UNetToMA

        options = make_options(v.ratio, v.tiles or 0, recompute_every=recompute_every(),
                               unet_levels="all", merge_scope=v.scope)
        state = ToMAState(options, "unet")
        # the model call the block runs in (sampling opens it in the APPLY_MODEL wrapper and
        # hands it to the blocks in their transformer_options)
        model_call = ModelCall(state.new_run(), merging=True)
        in_call = {state.call_key: model_call}
        toma = UNetToMA(state, v.scope, largest_level_ds=2)
        plain = {**self.options, **in_call}
        with torch.inference_mode():
            normed = self.block.norm1(x)
        # The node's block replacement: the whole block merged (block scope) or, in attention
        # scope, the block run with the node's attn1 merge/unmerge patch pair.
        call = self._replaced(toma.block_forward(self.block, self.block.forward,
                                                 foreign_forward=False), x, in_call)

        def features() -> torch.Tensor:
            # block scope plans from norm1(x); the attn1 patch is handed n = norm1(x)
            return self.block.norm1(x) if v.scope == "block" else normed

        def plan() -> Any:
            model_call.plans.clear()            # due: the level's first block builds it
            return toma.plan_for(x, plain, model_call, features)

        with torch.inference_mode():
            built = plan()
            merged = built.merge(normed)
        extra = {"merge": lambda: built.merge(normed), "unmerge": lambda: built.unmerge(merged)}
        return Prepared(call, built.merged_tokens, plan, extra)

    def _lower_bound(self, v: Variant, x: torch.Tensor) -> Prepared:
        """The block on N' tokens, nothing paid for merging."""
        n = merged_count(self.level, v.ratio)
        if v.scope == "block":
            small = x[:, :n].contiguous()
            return Prepared(self._run(small, dict(self.options)), n)
        sink = torch.zeros_like(x)

        def head(q, k, v_, extra):          # self-attention on the first N' tokens
            part = q[:, :n]
            return part, part, part

        return Prepared(self._run(x, self._patched(head, lambda out, extra: sink)), n)


def recompute_every() -> int:
    """The ToMA node's default recompute_every (steps a plan is reused for), from the pack."""
    return load_pack().nodes.options.make_options().recompute_every


def merged_count(level: Level, ratio: float, tiles: int = DEFAULT_TILES) -> int:
    """Tokens ToMA keeps on this level (R * k of its regions)."""
    core = load_pack().toma_core
    regions = core.make_regions(level.side, level.side, "tile", tiles)
    return regions.count * core.merge_plan.destinations_per_region(ratio, regions)


def output_errors(y: torch.Tensor, ref: torch.Tensor, x: torch.Tensor) -> dict[str, float]:
    """err, err_update and cos of output y against the unpatched ref (all [B, N, C])."""
    y, ref, x = y.float(), ref.float(), x.float()
    diff = (y - ref).norm()
    return {"err": float(diff / ref.norm()), "err_update": float(diff / (ref - x).norm()),
            "cos": float(F.cosine_similarity(y, ref, dim=-1).mean())}


def bench_level(level: Level, cfg: BenchConfig, vs: list[Variant],
                photo: str = "astronaut") -> list[dict[str, Any]]:
    """Rows for one level: every variant timed (interleaved), planned, checked against the
    unpatched output; a variant faster than its lower bound is flagged."""
    bench = LevelBench(level, cfg)
    x = bench.tokens_of(photo)
    prepared = {v: bench.prepare(v, x) for v in vs}
    log.info("level %s: %d variants", level.name, len(vs))
    with torch.inference_mode():
        outputs = {v: p.call() for v, p in prepared.items()}
    times = timings({v.key: p.call for v, p in prepared.items()}, cfg)
    planned = {v: p for v, p in prepared.items() if p.plan is not None}
    plan_times = timings({v.key: p.plan for v, p in planned.items()}, cfg, warmup=1,
                         reps=max(MIN_REPS, cfg.reps // 2))
    ref, base = outputs[UNPATCHED], times[UNPATCHED.key]
    lower = {(v.scope, v.ratio): (prepared[v].tokens, times[v.key])
             for v in vs if v.method == "lower bound"}
    rows = []
    for v, p in prepared.items():
        row: dict[str, Any] = {"level": level.name, "N": level.tokens, "C": level.channels,
                               "method": v.method, "scope": v.scope, "ratio": v.ratio,
                               "tiles": v.tiles, "tokens": p.tokens, **times[v.key].fields()}
        share = 0.0
        if v in planned:
            row["plan_ms"] = 1e3 * plan_times[v.key].median
            row["plan_share_ms"] = share = row["plan_ms"] / (level.blocks * recompute_every())
        total = Timing(tuple(t + share / 1e3 for t in times[v.key].times))
        row["ms_total"] = 1e3 * total.median
        row.update(speedup(base, total))
        bound = lower.get((v.scope, v.ratio))
        if bound is not None and v.method in ("toma", "tomesd") and bound[0] == p.tokens:
            versus_lower_bound(row, total, bound[1])
        if v.method != "lower bound":
            row.update(output_errors(outputs[v], ref, x))
        if cfg.device.type == "cuda":
            peak = peak_memory(p.call, cfg.device)
            row["peak_mb"] = None if peak is None else peak / 2**20
        rows.append(row)
    rows += _breakdown(level, cfg, prepared)
    return rows


def _breakdown(level: Level, cfg: BenchConfig, prepared: dict[Variant, Prepared]) -> list[dict]:
    """Merge and unmerge alone (plan prebuilt) for ToMA at the default tile count."""
    calls = {}
    for v, p in prepared.items():
        if v.method == "toma" and v.scope == "block" and v.tiles == DEFAULT_TILES:
            for name, fn in p.extra.items():
                calls[(name, v.ratio)] = fn
    if not calls:
        return []
    times = timings({f"{n} {r}": fn for (n, r), fn in calls.items()}, cfg, warmup=1)
    return [{"level": level.name, "N": level.tokens, "C": level.channels,
             "method": f"toma {name} only", "ratio": ratio, "tiles": DEFAULT_TILES,
             **times[f"{name} {ratio}"].fields()} for (name, ratio) in calls]


def run(cfg: BenchConfig) -> dict[str, Any]:
    """The section: rows for SDXL's two levels (all variants) and the smaller grids of 512 and
    768 images (unpatched, ToMA at 0.5 in both scopes, lower bound), plus notes. Quick: ratio
    0.5 and tile_count 64 only, no 768 px grids."""
    cfg.apply_threads()
    ratios = (0.5,) if cfg.quick else RATIOS
    tiles = (DEFAULT_TILES,) if cfg.quick else TILE_COUNTS
    rows: list[dict[str, Any]] = []
    for level in SDXL_LEVELS:
        rows += bench_level(level, cfg, variants(ratios, tiles))
    small = [UNPATCHED, Variant("toma", "block", 0.5, DEFAULT_TILES),
             Variant("toma", "attention", 0.5, DEFAULT_TILES),
             Variant("lower bound", "block", 0.5), Variant("lower bound", "attention", 0.5)]
    for level in SMALL_LEVELS:
        if not (cfg.quick and level.side in (48, 24)):       # quick: the 512 px grids only
            rows += bench_level(level, cfg, small)
    notes = [cfg.describe(),
             f"block: {'ComfyUI BasicTransformerBlock' if cfg.comfy else 'reference SDXLBlock'}"
             f", batch {cfg.batch}, SDPA; ms: median, spread: (max - min) / median",
             f"ms_total = ms + plan_share_ms (plan built once per level every "
             f"{recompute_every()} step(s), the node's default: plan_ms / (blocks at the level x "
             f"{recompute_every()})); speedup = unpatched ms / ms_total "
             "(lo-hi: ratios of the side-by-side repetitions)",
             "vs_lb = ms_total / the lower bound's ms at the same token count; flag: faster "
             "than its own lower bound (not a result)"]
    if tomesd_matching() is None:
        notes.append("tomesd not installed: no ToMeSD rows")
    return {"rows": rows, "notes": notes}
