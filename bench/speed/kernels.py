"""Kernel benchmark: ToMA merge/unmerge and plan building against ToMeSD and one SDPA call.

Cases (SDXL's two attention levels at 1024x1024, batch 2): N = 1024 tokens (32x32 grid,
C = 1280) and N = 4096 (64x64, C = 640), merge ratios 0.25 and 0.5. Figures per case, medians:

- merge+unmerge with the plan / matching prebuilt: ToMA (tile_count 64) vs tomesd's
  `bipartite_soft_matching_random2d` (sx = sy = 2, random destinations, r = int(N * ratio));
  target: ToMA >= 4x faster.
- the whole thing, plan (`build_plan`) or matching included: target: ToMA faster.
- ToMA's selection + weights (`build_plan`, the partition's index tables prebuilt as the node
  keeps them for a run) vs one self-attention over the same tokens
  (`scaled_dot_product_attention`, q = k = v [B, C / 64, N, 64]); target: <= 10%.

tomesd is a dev dependency only; without it its columns say so. Run:

    python bench/speed/kernels.py [--device cuda] [--dtype float16] [--reps 30] [--quick]
    python -m bench.speed.kernels --threads 1 --clock cpu     # steadier on a shared CPU machine

Every time is the median of interleaved repetitions, with its minimum and spread; every speedup
is the ratio of medians with the range of the side-by-side repetitions' ratios (lo-hi).

Which formulation wins depends on the CPU: ToMA's merge/unmerge are one gather and one batched
[k, S] x [S, C] matrix product over all tiles (S = N / 64 tokens, k kept), tomesd's are gathers
and a scatter-mean.
Matrix units (Intel AMX) and core counts shift the balance, so the CPU model and its matrix
features are printed with the figures.

On CPU with glibc malloc, buffers of several MB go back to the OS when freed, so every call
page-faults its outputs in again (a few ms per call here, for both libraries); setting
MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ to 4294967296 shows the times without that.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

if __package__ in (None, ""):          # run as `python bench/speed/kernels.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.shared.common import Timing, machine_info, markdown_table, speedup
from bench.shared.config import BenchConfig, default_config, load_pack, timings
from bench.speed.baselines import tomesd_matching

log = logging.getLogger(__name__)

BATCH = 2
TILE_COUNT = 64
HEAD_DIM = 64
RATIOS = (0.25, 0.5)
# (grid side, channels): SDXL's 1024-token and 4096-token attention levels at 1024x1024.
GRIDS = ((32, 1280), (64, 640))
REPS, QUICK_REPS = 20, 5

COLUMNS = [
    "N", "C", "ratio", "toma_mu_ms", "tome_mu_ms", "mu_speedup", "mu_range", "toma_full_ms",
    "tome_full_ms", "full_speedup", "full_range", "build_ms", "sdpa_ms", "build_vs_sdpa",
    "max_spread", "note",
]
LEGEND = """\
- toma_mu_ms / tome_mu_ms: merge + unmerge, plan or matching prebuilt (target: speedup >= 4)
- toma_full_ms / tome_full_ms: build_plan / matching + merge + unmerge (target: speedup > 1)
- *_range: lowest-highest ratio of the repetitions that ran side by side
- build_ms: ToMA selection + weights (build_plan, tile_count 64); sdpa_ms: one self-attention
  SDPA over the same tokens, q = k = v [B, C/64, N, 64]; build_vs_sdpa (build_plan / SDPA, the
  two timed interleaved, reps / 4): target <= 0.10
- max_spread: the largest (max - min) / median of the row's timings"""


def _ms(t: Timing) -> float:
    return 1e3 * t.median


def _ratio(row: dict[str, Any], name: str, base: Timing, other: Timing) -> None:
    """row[name + "_speedup"] and row[name + "_range"] for base / other."""
    s = speedup(base, other)
    row[f"{name}_speedup"] = s["speedup"]
    row[f"{name}_range"] = f"{s['speedup_lo']:.2f}-{s['speedup_hi']:.2f}"


def _case(side: int, channels: int, ratio: float, cfg: BenchConfig, reps: int,
          matching: Callable[..., Any] | None) -> dict[str, Any]:
    """ToMA and tomesd figures for one grid and ratio (milliseconds; ToMA and tomesd variants
    are timed interleaved so that machine noise hits both alike)."""
    core = load_pack().toma_core
    device, dtype = cfg.device, cfg.dtype
    n = side * side
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(BATCH, n, channels, device=device, dtype=dtype, generator=gen)
    # the partition and its index tables made once, as the node keeps them for a run
    regions = core.make_regions(side, side, "tile", TILE_COUNT)
    tables = regions.tables(device)

    def plan_once() -> Any:
        return core.build_plan(x, side, side, ratio, regions=regions, tables=tables)

    plan = plan_once()
    merged = plan.merge(x)

    def toma_full() -> torch.Tensor:
        p = plan_once()
        return p.unmerge(p.merge(x))

    prebuilt: dict[str, Callable[[], Any]] = {
        "toma_merge": lambda: plan.merge(x),
        "toma_unmerge": lambda: plan.unmerge(merged),
        "toma_mu": lambda: plan.unmerge(plan.merge(x)),
    }
    whole: dict[str, Callable[[], Any]] = {"build": plan_once, "toma_full": toma_full}
    row: dict[str, Any] = {"N": n, "C": channels, "ratio": ratio, "k": plan.k,
                           "merged": plan.merged_tokens}
    if matching is None:
        row["note"] = "tomesd not installed"
    else:
        r = int(n * ratio)
        tome_gen = torch.Generator(device=device).manual_seed(0)

        def match_once() -> tuple[Callable, Callable]:
            return matching(x, side, side, 2, 2, r, no_rand=False, generator=tome_gen)

        tome_merge, tome_unmerge = match_once()

        def tome_full() -> torch.Tensor:
            m, u = match_once()
            return u(m(x))

        prebuilt["tome_merge"] = lambda: tome_merge(x)
        prebuilt["tome_mu"] = lambda: tome_unmerge(tome_merge(x))
        whole["tome_full"] = tome_full
    found: dict[str, Timing] = {}
    for calls in (prebuilt, whole):
        found.update(timings(calls, cfg, reps=reps))
    # The attention reference is long: fewer repetitions, interleaved with build_plan again so
    # that their ratio is taken under the same machine load.
    q = torch.randn(BATCH, channels // HEAD_DIM, n, HEAD_DIM, device=device, dtype=dtype,
                    generator=gen)
    versus = timings({"build": plan_once, "sdpa": lambda: F.scaled_dot_product_attention(q, q, q)},
                     cfg, warmup=min(cfg.warmup, 1), reps=max(3, reps // 4))
    row.update({f"{name}_ms": _ms(t) for name, t in found.items()})
    row["sdpa_ms"] = _ms(versus["sdpa"])
    row["build_vs_sdpa"] = versus["build"].median / versus["sdpa"].median
    if matching is not None:
        _ratio(row, "mu", found["tome_mu"], found["toma_mu"])
        _ratio(row, "full", found["tome_full"], found["toma_full"])
        _ratio(row, "merge", found["tome_merge"], found["toma_merge"])
    row["max_spread"] = max(t.spread for t in [*found.values(), *versus.values()])
    return row


def reps(cfg: BenchConfig, asked: int | None = None) -> int:
    """Timed repetitions: `asked`, else 20 (quick 5); kernels are short, so more than cfg's."""
    return asked or (QUICK_REPS if cfg.quick else REPS)


def run(cfg: BenchConfig, asked_reps: int | None = None) -> list[dict[str, Any]]:
    """One row per (grid, ratio) with the figures described in the module docstring, timed on
    cfg's device, dtype, clock and threads."""
    cfg.apply_threads()
    count = reps(cfg, asked_reps)
    matching = tomesd_matching()
    if matching is None:
        log.info("tomesd not installed: its columns stay empty")
    rows = []
    for side, channels in GRIDS:
        for ratio in RATIOS:
            log.info("case N=%d C=%d ratio=%s", side * side, channels, ratio)
            rows.append(_case(side, channels, ratio, cfg, count, matching))
    return rows


def main(argv: list[str] | None = None) -> None:
    """Command line: print machine info and the Markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--reps", type=int, default=None, help=f"default {REPS} (quick "
                                                                f"{QUICK_REPS})")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                        help="cpu: process CPU time, steadier on a shared machine with --threads 1")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    cfg = replace(default_config(args.quick, False, args.device, args.clock, args.threads),
                  dtype=getattr(torch, args.dtype))
    rows = run(cfg, args.reps)
    print(f"## Kernels ({args.dtype}, batch {BATCH}, tile_count {TILE_COUNT})\n")
    print(", ".join(f"{key}: {value}" for key, value in machine_info(cfg.device).items()))
    print(f"\n{cfg.describe(reps(cfg, args.reps))}\n")
    print(markdown_table(rows, COLUMNS))
    print()
    print(markdown_table(rows, ["N", "ratio", "k", "merged", "toma_merge_ms", "tome_merge_ms",
                                "merge_speedup", "merge_range", "toma_unmerge_ms"]))
    print()
    print(LEGEND)


if __name__ == "__main__":
    main()
