"""The summary of a bench/gpu/run.sh run: which sections ran, and the measured model calls (section
gpu-call) beside the gpu-model section's projection of the same calls.

    python -m bench.gpu.summary RESULTS_DIR [--out summary.md]

RESULTS_DIR holds gpu.sh's status.tsv and one JSON per section (`python -m bench --out`). The
projection comes from that run's gpu-model JSON when there is one, else from the committed
projection (PROJECTION), which the table names as its source. Prints the Markdown and writes it
to --out.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
from pathlib import Path
from typing import Any

from ..shared.common import markdown_table
from ..shared.config import ROOT

log = logging.getLogger(__name__)

PROJECTION = ROOT / "bench" / "results" / "2026-12-04-projection-h200-small-sizes.json"
CALL_COLUMNS = ("model", "setting", "batch", "tokens", "ms", "ms_toma", "speedup", "range",
                "spread", "bound", "host_us_launch", "plan_share", "peak_gib", "peak_gib_toma",
                "proj_ms_cal", "proj_ms_cal_toma", "proj_speedup_cal", "proj_speedup",
                "host_bound_us", "status")


def load(path: Path) -> dict[str, Any] | None:
    """A result JSON, or None when it is missing or unreadable (said in the log)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        log.info("no result at %s: %s", path, exc)
        return None


def statuses(results: Path) -> list[dict[str, str]]:
    """gpu.sh's status.tsv rows (section, status, seconds, limit), [] without one."""
    path = results / "status.tsv"
    if not path.exists():
        return []
    with path.open() as f:
        return list(csv.DictReader(f, delimiter="\t"))


def section(result: dict[str, Any] | None, name: str) -> dict[str, Any]:
    """One section of a result file ({} when absent). Partial gpu-call files are the section
    itself (rows, columns, notes)."""
    if result is None:
        return {}
    if "sections" in result:
        return result["sections"].get(name, {})
    return result


def projection_rows(results: Path) -> tuple[list[dict[str, Any]], str]:
    """The gpu-model rows of this run, else of the committed projection, and where from."""
    for path, source in ((results / "gpu-model.json", "this run's gpu-model section"),
                         (PROJECTION, f"{PROJECTION.relative_to(ROOT)} (committed)")):
        rows = section(load(path), "gpu-model").get("rows") or []
        if rows:
            return rows, source
    return [], "none"


def call_rows(calls: list[dict[str, Any]],
              projected: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The gpu-call rows with the projection of the same model and setting beside them, and the
    host's measured issue time per projected kernel of the ToMA call (host_us_launch) beside
    the projection's host_bound_us: above it, ToMA's call waits for the host."""
    out = []
    for r in calls:
        p = next((q for q in projected
                  if q.get("model") == r.get("model") and q.get("setting") == r.get("setting")),
                 None)
        lo, hi = r.get("speedup_lo"), r.get("speedup_hi")
        out.append({**r, "range": f"{lo:.2f}-{hi:.2f}" if lo is not None else None,
                    "spread": max(r.get("spread") or 0.0, r.get("spread_toma") or 0.0)
                    if r.get("reps") else None,
                    "host_us_launch": 1e3 * r["host_ms_toma"] / p["launches_toma"]
                    if p and r.get("host_ms_toma") and p.get("launches_toma") else None,
                    "proj_ms_cal": p and p.get("ms_cal"),
                    "proj_ms_cal_toma": p and p.get("ms_cal_toma"),
                    "proj_speedup_cal": p and p.get("speedup_cal"),
                    "proj_speedup": p and p.get("speedup"),
                    "host_bound_us": p and p.get("host_bound_us")})
    return out


def summary(results: Path) -> str:
    """The Markdown summary of a results folder."""
    lines = ["# GPU run summary", ""]
    status = statuses(results)
    if status:
        lines += [markdown_table(status, ["section", "status", "seconds", "limit"]), ""]
    name = "gpu-call"
    found = load(results / "gpu-call.json") or load(results / "gpu-call.partial.json")
    calls = section(found, name)
    projected, source = projection_rows(results)
    if calls.get("rows"):
        lines += ["## Model calls, measured (gpu-call) and projected (gpu-model)", "",
                  f"projection: {source}; ms: median device time of one model call; range: the "
                  "side-by-side speedups; spread: the larger (max - min) / median of the two; "
                  "bound: which of host and device took longer; host_us_launch: the host's "
                  "issue time of the ToMA call per kernel the projection counts, against its "
                  "host_bound_us; proj_*_cal: the calibrated projection, proj_speedup the "
                  "roofline",
                  "", markdown_table(call_rows(calls["rows"], projected), CALL_COLUMNS), ""]
    if calls.get("notes"):
        lines += [f"- {n}" for n in calls["notes"]] + [""]
    quality = section(load(results / "quality.json"), "quality")
    if quality.get("rows"):
        lines += ["## Quality (trained fixtures)", "",
                  markdown_table(quality["rows"], ["model", "variant", "s", "speedup", "psnr",
                                                   "ssim", "mmd", "dloss"]), ""]
    for other in sorted(results.glob("*.json")):
        if other.stem in ("gpu-call", "gpu-model", "quality") or other.name.endswith(
                ".partial.json"):
            continue
        result = load(other) or {}
        for sec_name, sec in result.get("sections", {}).items():
            lines.append(f"- {sec_name}: {len(sec.get('rows', []))} rows "
                         f"({'; '.join(sec.get('notes', [])[:1])[:160]})")
    targets = section(load(results / "gpu-model.json"), "gpu-model").get("targets") or []
    if targets:
        met = sum(1 for t in targets if t.get("met") is True)
        lines += ["", f"- gpu-model targets met: {met} of {len(targets)}"]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu.summary")
    parser.add_argument("results", type=Path, help="gpu.sh's results folder")
    parser.add_argument("--out", type=Path, default=None, help="write the Markdown here too")
    args = parser.parse_args(argv)
    text = summary(args.results)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
