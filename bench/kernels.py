"""Kernel benchmark: ToMA merge/unmerge and plan building against ToMeSD and one SDPA call.

Cases (SDXL's two attention levels at 1024x1024, batch 2): N = 1024 tokens (32x32 grid,
C = 1280) and N = 4096 (64x64, C = 640), merge ratios 0.25 and 0.5. Figures per case, medians:

- merge+unmerge with the plan / matching prebuilt: ToMA (tile_count 64) vs tomesd's
  `bipartite_soft_matching_random2d` (sx = sy = 2, random destinations, r = int(N * ratio));
  target: ToMA >= 4x faster.
- the whole thing, plan (`build_plan`) or matching included: target: ToMA faster.
- ToMA's selection + weights (`build_plan`) vs one self-attention over the same tokens
  (`scaled_dot_product_attention`, q = k = v [B, C / 64, N, 64]); target: <= 10%.

tomesd is a dev dependency only; without it its columns say so. Run:

    python bench/kernels.py [--device cuda] [--dtype float16] [--reps 30] [--quick]
    python -m bench.kernels --threads 1 --clock cpu     # steadier on a shared CPU machine

On CPU with glibc malloc, buffers of several MB go back to the OS when freed, so every call
page-faults its outputs in again (a few ms per call here, for both libraries); setting
MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ to 4294967296 shows the times without that.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

if __package__ in (None, ""):          # run as `python bench/kernels.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import toma_dev
from bench.common import Clock, machine_info, markdown_table, median_times

log = logging.getLogger(__name__)

BATCH = 2
TILE_COUNT = 64
HEAD_DIM = 64
RATIOS = (0.25, 0.5)
# (grid side, channels): SDXL's 1024-token and 4096-token attention levels at 1024x1024.
GRIDS = ((32, 1280), (64, 640))

COLUMNS = [
    "N", "C", "ratio", "toma_mu_ms", "tome_mu_ms", "mu_speedup", "toma_full_ms", "tome_full_ms",
    "full_speedup", "build_ms", "sdpa_ms", "build_vs_sdpa", "note",
]
LEGEND = """\
- toma_mu_ms / tome_mu_ms: merge + unmerge, plan or matching prebuilt (target: speedup >= 4)
- toma_full_ms / tome_full_ms: build_plan / matching + merge + unmerge (target: speedup > 1)
- build_ms: ToMA selection + weights (build_plan, tile_count 64); sdpa_ms: one self-attention
  SDPA over the same tokens, q = k = v [B, C/64, N, 64]; build_vs_sdpa (build_plan / SDPA, the
  two timed interleaved, reps / 4): target <= 0.10"""


def _tomesd_matching() -> Callable[..., Any] | None:
    """tomesd's `bipartite_soft_matching_random2d`, or None when tomesd is not installed."""
    try:
        from tomesd.merge import bipartite_soft_matching_random2d
    except ImportError:
        log.info("tomesd not installed: its columns stay empty")
        return None
    return bipartite_soft_matching_random2d


def _case(side: int, channels: int, ratio: float, device: torch.device, dtype: torch.dtype,
          warmup: int, reps: int, clock: Clock,
          matching: Callable[..., Any] | None) -> dict[str, Any]:
    """ToMA and tomesd figures for one grid and ratio (milliseconds; ToMA and tomesd variants
    are timed interleaved so that machine noise hits both alike)."""
    build_plan = toma_dev.load_pack().toma_core.build_plan
    n = side * side
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(BATCH, n, channels, device=device, dtype=dtype, generator=gen)

    def plan_once() -> Any:
        return build_plan(x, side, side, ratio, tile_count=TILE_COUNT)

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

        prebuilt["tome_mu"] = lambda: tome_unmerge(tome_merge(x))
        whole["tome_full"] = tome_full
    for calls in (prebuilt, whole):
        times = median_times(calls, warmup, reps, device, clock)
        row.update({f"{name}_ms": 1e3 * t for name, t in times.items()})
    # The attention reference is long: fewer repetitions, interleaved with build_plan again so
    # that their ratio is taken under the same machine load.
    q = torch.randn(BATCH, channels // HEAD_DIM, n, HEAD_DIM, device=device, dtype=dtype,
                    generator=gen)
    times = median_times({"build": plan_once,
                          "sdpa": lambda: F.scaled_dot_product_attention(q, q, q)},
                         min(warmup, 1), max(2, reps // 4), device, clock)
    row["sdpa_ms"] = 1e3 * times["sdpa"]
    row["build_vs_sdpa"] = times["build"] / times["sdpa"]
    if matching is not None:
        row["mu_speedup"] = row["tome_mu_ms"] / row["toma_mu_ms"]
        row["full_speedup"] = row["tome_full_ms"] / row["toma_full_ms"]
    return row


def run(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
        reps: int = 20, quick: bool = False, clock: Clock = "wall") -> list[dict[str, Any]]:
    """One row per (grid, ratio) with the figures described in the module docstring.

    quick: a smoke run (1 warmup, 2 reps). clock: "wall" or "cpu" (see `bench.common`).
    """
    device = torch.device(device)
    warmup, reps = (1, 2) if quick else (3, reps)
    matching = _tomesd_matching()
    rows = []
    for side, channels in GRIDS:
        for ratio in RATIOS:
            log.info("case N=%d C=%d ratio=%s", side * side, channels, ratio)
            rows.append(_case(side, channels, ratio, device, dtype, warmup, reps, clock,
                              matching))
    return rows


def main(argv: list[str] | None = None) -> None:
    """Command line: print machine info and the Markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                        help="cpu: process CPU time, steadier on a shared machine with --threads 1")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    rows = run(args.device, dtype, args.reps, args.quick, args.clock)
    info = machine_info(args.device)
    print(f"## Kernels ({args.dtype}, batch {BATCH}, tile_count {TILE_COUNT}, "
          f"{args.clock} clock)\n")
    print(", ".join(f"{key}: {value}" for key, value in info.items()) + "\n")
    print(markdown_table(rows, COLUMNS))
    print()
    print(markdown_table(rows, ["N", "ratio", "k", "merged", "toma_merge_ms", "toma_unmerge_ms"]))
    print()
    print(LEGEND)


if __name__ == "__main__":
    main()
