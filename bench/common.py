"""Small helpers shared by the benchmark sections: timing, peak memory, tables, machine info."""

from __future__ import annotations

import datetime
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

log = logging.getLogger(__name__)


def sync(device: torch.device | str) -> None:
    """Wait for queued kernels on a CUDA device (no-op elsewhere)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


Clock = Literal["wall", "cpu"]


def now(clock: Clock) -> float:
    """Seconds on `clock`: "wall" (perf_counter) or "cpu" (this process's CPU time, steadier on
    a shared machine when torch runs one thread; it adds up every thread, and misses GPU time)."""
    return time.process_time() if clock == "cpu" else time.perf_counter()


def median_times(calls: dict[str, Callable[[], Any]], warmup: int = 3, reps: int = 20,
                 device: torch.device | str = "cpu", clock: Clock = "wall") -> dict[str, float]:
    """Median seconds per call of each function in `calls`, timed interleaved.

    Every repetition runs each function once (order reversed on odd repetitions), so load from
    other processes hits all of them alike and their ratios stay fair. On CUDA every call is
    bracketed by `torch.cuda.synchronize`, so the time covers the kernels, not their launch.
    Runs under `torch.no_grad()`.
    """
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock must be 'wall' or 'cpu', got {clock!r}")
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
    return {name: statistics.median(t) for name, t in times.items()}


def median_time(fn: Callable[[], Any], warmup: int = 3, reps: int = 20,
                device: torch.device | str = "cpu", clock: Clock = "wall") -> float:
    """Median seconds of `fn()` over `reps` calls after `warmup` untimed ones (see
    `median_times`)."""
    return median_times({"fn": fn}, warmup, reps, device, clock)["fn"]


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


def _cpu_model() -> str:
    """CPU model name from /proc/cpuinfo (Linux), else platform.processor()."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        log.debug("no /proc/cpuinfo", exc_info=True)
    return platform.processor() or "unknown"


def machine_info(device: torch.device | str = "cpu") -> dict[str, Any]:
    """Where a benchmark ran: CPU model, cores, torch version and threads, device name, date."""
    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": name,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
