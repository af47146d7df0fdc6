"""Small helpers shared by the benchmark sections: timing, peak memory, tables, machine info."""

from __future__ import annotations

import datetime
import json
import logging
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

log = logging.getLogger(__name__)
_ROOT = Path(__file__).resolve().parents[2]   # the checkout (config.ROOT)


def sync(device: torch.device | str) -> None:
    """Wait for queued kernels on a CUDA device (no-op elsewhere)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


Clock = Literal["wall", "cpu"]


def now(clock: Clock) -> float:
    """Seconds on `clock`: "wall" (perf_counter) or "cpu" (this process's CPU time, steadier on
    a shared machine when torch runs one thread; it adds up every thread, and misses GPU time)."""
    return time.process_time() if clock == "cpu" else time.perf_counter()


MIN_REPS = 3   # fewest timed repetitions that give a figure a spread


@dataclass(frozen=True)
class Timing:
    """Seconds per call of one function over interleaved repetitions (see `interleaved`)."""

    times: tuple[float, ...]

    @property
    def min(self) -> float:
        return min(self.times)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def spread(self) -> float:
        """(max - min) / median over the repetitions: how far apart the runs were."""
        return (max(self.times) - self.min) / self.median

    def fields(self) -> dict[str, float | int]:
        """Row fields: ms (median), ms_min, spread, reps."""
        return {"ms": 1e3 * self.median, "ms_min": 1e3 * self.min, "spread": self.spread,
                "reps": len(self.times)}


def speedup(base: Timing, other: Timing) -> dict[str, float]:
    """base / other: the ratio of medians, and the lowest and highest ratio of the repetitions
    that ran side by side (repetition i of both), as speedup / speedup_lo / speedup_hi."""
    pairs = [b / o for b, o in zip(base.times, other.times, strict=True)]
    return {"speedup": base.median / other.median, "speedup_lo": min(pairs),
            "speedup_hi": max(pairs)}


def interleaved(calls: dict[str, Callable[[], Any]], warmup: int = 3, reps: int = 20,
                device: torch.device | str = "cpu", clock: Clock = "wall",
                min_reps: int = MIN_REPS) -> dict[str, Timing]:
    """Time each function in `calls`, interleaved: every repetition runs each function once
    (order reversed on odd repetitions), so load from other processes hits all of them alike
    and their ratios stay fair. At least MIN_REPS repetitions, so that every figure has a
    spread. On CUDA every call is bracketed by `torch.cuda.synchronize`, so the time covers the
    kernels, not their launch. Runs under `torch.no_grad()`.
    """
    if reps < min_reps:
        raise ValueError(f"reps must be >= {min_reps} (a figure needs a spread), got {reps}")
    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock must be 'wall' or 'cpu', got {clock!r}")
    if clock == "cpu" and torch.device(device).type == "cuda":
        raise ValueError("the cpu clock cannot time CUDA kernels: use the wall clock")
    names = list(calls)
    times: dict[str, list[float]] = {name: [] for name in names}
    with torch.no_grad():
        for _ in range(warmup):
            for name in names:
                calls[name]()
        for rep in range(reps):
            for name in names if rep % 2 == 0 else reversed(names):
                sync(device)
                start = now(clock)
                calls[name]()
                sync(device)
                times[name].append(now(clock) - start)
    return {name: Timing(tuple(t)) for name, t in times.items()}


def median_times(calls: dict[str, Callable[[], Any]], warmup: int = 3, reps: int = 20,
                 device: torch.device | str = "cpu", clock: Clock = "wall") -> dict[str, float]:
    """Median seconds per call of each function in `calls`, timed by `interleaved` (any reps
    >= 1: a single repetition has no spread, so figures for publishing use `interleaved`)."""
    return {name: t.median for name, t in interleaved(calls, warmup, reps, device, clock,
                                                       min_reps=1).items()}


def median_time(fn: Callable[[], Any], warmup: int = 3, reps: int = 20,
                device: torch.device | str = "cpu", clock: Clock = "wall") -> float:
    """Median seconds of `fn()` over `reps` calls after `warmup` untimed ones."""
    return median_times({"fn": fn}, warmup, reps, device, clock)["fn"]


def versus_lower_bound(row: dict[str, Any], timing: Timing, bound: Timing) -> None:
    """Record a variant's time against its own lower bound (the same work on the merged token
    count, nothing paid for merging): lb_ms (the bound's median) and vs_lb, the median of the
    side-by-side repetitions' ratios variant / bound (steadier than a ratio of medians when the
    machine's load drifts). A variant faster than its bound measured noise or a broken bound:
    it is flagged, never published as a result."""
    row["lb_ms"] = 1e3 * bound.median
    row["vs_lb"] = statistics.median(t / b for t, b in zip(timing.times, bound.times,
                                                            strict=True))
    if row["vs_lb"] < 1.0:
        row["flag"] = (f"faster than its own lower bound (vs_lb {row['vs_lb']:.3f}): noise or "
                       "a broken bound, not a result")


def peak_memory(fn: Callable[[], Any], device: torch.device | str = "cpu") -> int | None:
    """Peak CUDA memory allocated (bytes) while `fn()` runs, above what was allocated before.

    Returns None on devices without an allocator counter (CPU).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    with torch.no_grad():
        fn()
    sync(device)
    return torch.cuda.max_memory_allocated(device) - base


def _cell(value: Any) -> str:
    """A table cell: floats with 3 significant digits, None as a dash."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value).replace("|", "\\|")


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """A GitHub Markdown table of `rows` (missing keys print as '-'), one column per key."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def cpu_model() -> str:
    """CPU model name from /proc/cpuinfo (Linux), else platform.processor()."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        log.debug("no /proc/cpuinfo", exc_info=True)
    return platform.processor() or "unknown"


# CPU features that change which formulation of a kernel is fastest (matrix units, vector width).
MATMUL_FEATURES = ("amx_tile", "amx_bf16", "avx512f", "avx512_bf16", "avx2")


def cpu_features() -> str:
    """Which of MATMUL_FEATURES /proc/cpuinfo lists ("-" for none or no /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "-"
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), [])
    return " ".join(f for f in MATMUL_FEATURES if f in flags) or "-"


def machine_info(device: torch.device | str = "cpu") -> dict[str, Any]:
    """Where a benchmark ran: CPU model and features, cores, torch version and threads, device
    name, date."""
    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {
        "cpu": cpu_model(),
        "cpu_features": cpu_features(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": name,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def goal(target: str, row: dict | None, key: str, threshold: float,
         higher: bool = True) -> dict[str, Any] | None:
    """A numeric target on row[key] (>= threshold, or <= with higher=False): met or not, and
    by how much it was missed. A flagged row (faster than its own lower bound) is no result:
    its target says so instead of passing or failing."""
    if row is None or row.get(key) is None:
        return None
    value = row[key]
    out = {"target": target, "value": value}
    if row.get("flag"):
        return {**out, "met": None, "why": f"not judged: {row['flag']}"}
    # equal at the precision the report shows (3 significant digits) is met, not "missed by 0%"
    met = (value >= threshold if higher else value <= threshold) or f"{value:.3g}" == \
        f"{threshold:.3g}"
    out["met"] = met
    if not met:
        out["why"] = (f"missed: {value:.3g} against {'>=' if higher else '<='} {threshold:g} "
                      f"({abs(value - threshold) / threshold:.1%} "
                      f"{'short' if higher else 'over'})")
    return out


def checkout_state() -> str | None:
    """The checkout's commit now (with "+changes" when the tree differs from it), or None."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                "bench", "toma_core", "nodes"], cwd=_ROOT, check=True,
                               capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+changes" if dirty else "")


# Read when a bench starts (every bench imports this module before it runs): the code that ran,
# not whatever is checked out when a long run writes its result.
STARTED_AT = checkout_state()


def commit() -> str | None:
    """The commit the bench started at (see checkout_state), and what the checkout is now when
    it changed during the run."""
    now = checkout_state()
    if now == STARTED_AT:
        return STARTED_AT
    return f"{STARTED_AT} (the checkout changed during the run: {now} at the end)"


def report_head(title: str, result: dict[str, Any]) -> list[str]:
    """A Markdown report's first lines for a result dict with machine, config (commit,
    command, comfyui) and notes: the title, where and how it ran, the notes as a list."""
    config = result["config"]
    lines = [f"# {title}", "", ", ".join(f"{k}: {v}" for k, v in result["machine"].items()), "",
             f"commit: {config['commit']}", "", f"command: `{config['command']}`", "",
             f"ComfyUI: {config['comfyui']}", ""]
    return lines + [f"- {note}" for note in result["notes"]]


def write_result(out: Path, result: dict[str, Any], text: str) -> None:
    """A bench's result: the JSON at `out` (its folder made), the Markdown report `text` beside
    it (.md)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    out.with_suffix(".md").write_text(text)
