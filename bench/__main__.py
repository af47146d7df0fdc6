"""The benchmark suite: one command, one JSON file, one Markdown report.

    python -m bench                      # everything available, CPU fp32 (CUDA bf16 on a GPU)
    python -m bench --quick              # fewer cases and repetitions (~5-10 min on 2 cores)
    python -m bench --sections unet,fidelity --out results.json
    COMFYUI_PATH=/path/to/ComfyUI python -m bench     # ComfyUI's own blocks, + flux and model

Runs from a fresh clone with torch and requirements-dev.txt (tomesd for the ToMeSD baseline,
scikit-image for the photographs). Without ComfyUI the UNet blocks are the plain-torch
reference_blocks.SDXLBlock and the flux and model sections are skipped with a note; with
COMFYUI_PATH they are ComfyUI's classes and every section runs (flux and model are left out of
--quick unless named in --sections). On a shared CPU machine `--threads 1 --clock cpu` gives
steadier numbers (process CPU time, no thread barriers waiting on other jobs).

Sections:
  kernels   bench/kernels.py: ToMA merge/unmerge/plan vs tomesd and one SDPA call
  unet      bench/unet_blocks.py: SDXL's 64x64x640 and 32x32x1280 blocks (+ 512/768 px grids):
            unpatched, ToMA (block / attention scope), lower bound, ToMeSD, ToDo
  flux      bench/flux_blocks.py: Flux double/single blocks (ComfyUI only)
  fidelity  bench/fidelity.py: output error on photographs' token grids, speed-vs-error frontier
  model     bench/model.py: a whole SDXL UNet step at 1024x1024 (ComfyUI only; not in --quick)

Writes bench/results/<date>-<device>[-quick].json (or --out) and the same report as .md beside
it, and prints the tables and the targets they are checked against.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from .common import machine_info, markdown_table
from .config import ROOT, BenchConfig, default_config, setup_comfy

log = logging.getLogger("bench")

SECTIONS = ("kernels", "unet", "flux", "fidelity", "model")
COMFY_ONLY = ("flux", "model")
NOT_QUICK = ("flux", "model")
DEFAULT_SCOPE = "block"      # merge_scope "auto" (nodes/apply.py)
RATIO = 0.5


def _kernels(cfg: BenchConfig) -> dict[str, Any]:
    from . import kernels

    rows = kernels.run(cfg.device, cfg.dtype, reps=20, quick=cfg.quick)
    return {"rows": rows, "columns": list(kernels.COLUMNS), "notes": [kernels.LEGEND]}


def _flux(cfg: BenchConfig, threads: int | None) -> dict[str, Any]:
    from . import flux_blocks

    rows = flux_blocks.run(reps=1 if cfg.quick else 2, threads=threads)
    return {"rows": rows, "columns": list(flux_blocks.COLUMNS)}


def run_sections(names: list[str], cfg: BenchConfig, threads: int | None) -> dict[str, Any]:
    """Each section's {"rows", "columns", "notes"}, or a note saying why it did not run."""
    from . import fidelity, model, unet_blocks

    runners = {
        "kernels": lambda: _kernels(cfg),
        "unet": lambda: {**unet_blocks.run(cfg), "columns": list(unet_blocks.COLUMNS)},
        "flux": lambda: _flux(cfg, threads),
        "fidelity": lambda: {**fidelity.run(cfg), "columns": list(fidelity.COLUMNS)},
        "model": lambda: {**model.run(cfg), "columns": list(model.COLUMNS)},
    }
    out: dict[str, Any] = {}
    for name in names:
        if name in COMFY_ONLY and not cfg.comfy:
            out[name] = {"rows": [], "notes": ["skipped: needs ComfyUI (set COMFYUI_PATH)"]}
            continue
        log.warning("section %s ...", name)
        start = time.perf_counter()
        try:
            out[name] = runners[name]()
        except Exception as exc:  # one broken section must not lose the others' results
            log.error("section %s failed:\n%s", name, traceback.format_exc())
            out[name] = {"rows": [], "notes": [f"failed: {type(exc).__name__}: {exc}"]}
        out[name]["seconds"] = time.perf_counter() - start
        log.warning("section %s done in %.0f s", name, out[name]["seconds"])
    if "unet" in out and "fidelity" in out and out["fidelity"]["rows"]:
        out["pareto"] = {"rows": fidelity.pareto(out["unet"]["rows"], out["fidelity"]["rows"]),
                         "columns": list(fidelity.PARETO_COLUMNS),
                         "notes": ["speedup from the unet section (plan share included), error "
                                   "from the fidelity section; pareto: not beaten on both"]}
    return out


def _find(rows: list[dict], **match: Any) -> dict | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def targets(sections: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, checked against whatever sections ran."""
    out = []
    unet = sections.get("unet", {}).get("rows", [])
    for level, goal in (("64x64x640", 2.0), ("32x32x1280", 1.7)):
        r = _find(unet, level=level, method="toma", scope=DEFAULT_SCOPE, ratio=RATIO, tiles=64)
        if r:
            out.append({"target": f"{level} ToMA {DEFAULT_SCOPE} 0.5 speedup >= {goal}",
                        "value": r["speedup"], "met": r["speedup"] >= goal})
            out.append({"target": f"{level} within 10% of lower bound", "value": r.get("vs_lb"),
                        "met": r.get("vs_lb") is not None and r["vs_lb"] <= 1.10})
    rows = sections.get("model", {}).get("rows", [])
    r = _find(rows, variant="toma")
    if r:
        out.append({"target": "whole UNet step speedup >= 1.45", "value": r["speedup"],
                    "met": r["speedup"] >= 1.45})
        out.append({"target": "whole UNet within 10% of lower bound", "value": r.get("vs_lb"),
                    "met": r.get("vs_lb") is not None and r["vs_lb"] <= 1.10})
    fid = sections.get("fidelity", {}).get("rows", [])
    for level in ("64x64x640", "32x32x1280"):
        for scope in ("block", "attention"):
            toma = _find(fid, level=level, method="toma", scope=scope, ratio=RATIO, tiles=64)
            tome = _find(fid, level=level, method="tomesd", scope=scope, ratio=RATIO)
            if not (toma and tome):
                continue
            ts = _find(unet, level=level, method="toma", scope=scope, ratio=RATIO, tiles=64)
            ms = _find(unet, level=level, method="tomesd", scope=scope, ratio=RATIO)
            faster = ts is not None and ms is not None and ts["speedup"] > ms["speedup"]
            out.append({"target": f"{level} {scope} 0.5: ToMA err <= ToMeSD err, and faster",
                        "value": f"err {toma['err']:.3g} vs {tome['err']:.3g}"
                                 + (f"; speedup {ts['speedup']:.3g} vs {ms['speedup']:.3g}"
                                    if ts and ms else ""),
                        "met": toma["err"] <= tome["err"] and faster})
    par = sections.get("pareto", {}).get("rows", [])
    for level in ("64x64x640", "32x32x1280"):
        todo = _find(par, level=level, method="todo")
        toma = [p for p in par if p["level"] == level and p["method"] == "toma"]
        default = _find(toma, scope=DEFAULT_SCOPE, ratio=RATIO, tiles=64)
        if todo and default:
            beaten = [p for p in toma
                      if todo["speedup"] >= p["speedup"] and todo["err"] <= p["err"]]
            on = [p for p in toma if p["pareto"]]
            out.append({"target": f"{level}: ToMA on the speed-error frontier against ToDo",
                        "value": f"{len(on)} of {len(toma)} ToMA points on the frontier, "
                                 f"{len(beaten)} beaten by ToDo; ToDo speedup "
                                 f"{todo['speedup']:.3g} err {todo['err']:.3g}",
                        "met": bool(on) and default not in beaten})
    return out


def recommendations(sections: dict[str, Any]) -> dict[str, Any]:
    """Figures behind the defaults: the small-grid crossover, block vs attention, tile count."""
    unet = sections.get("unet", {}).get("rows", [])
    fid = sections.get("fidelity", {}).get("rows", [])
    crossover = []
    for level in sorted({r["level"] for r in unet}, key=lambda n: -int(n.split("x")[0])):
        base = _find(unet, level=level, method="unpatched")
        row = {"level": level, "N": base["N"] if base else None,
               "unpatched_ms": base["ms"] if base else None}
        for scope in ("block", "attention"):
            r = _find(unet, level=level, method="toma", scope=scope, ratio=RATIO, tiles=64)
            row[f"{scope}_speedup"] = r["speedup"] if r else None
            lb = _find(unet, level=level, method="lower bound", scope=scope, ratio=RATIO)
            row[f"{scope}_lb_speedup"] = lb["speedup"] if lb else None
        crossover.append(row)
    paying = [r["N"] for r in crossover if (r["block_speedup"] or 0) > 1.0]
    losing = [r["N"] for r in crossover if (r["block_speedup"] or 2) <= 1.0]
    tiles = []
    for level in ("64x64x640", "32x32x1280"):
        for scope in ("block", "attention"):
            for t in (16, 64, 256):
                s = _find(unet, level=level, method="toma", scope=scope, ratio=RATIO, tiles=t)
                f = _find(fid, level=level, method="toma", scope=scope, ratio=RATIO, tiles=t)
                if s or f:
                    tiles.append({"level": level, "scope": scope, "tiles": t,
                                  "speedup": s and s["speedup"], "plan_ms": s and s.get("plan_ms"),
                                  "err": f and f["err"], "cos": f and f["cos"]})
    return {"crossover": crossover,
            "min_tokens_paying": min(paying) if paying else None,
            "max_tokens_losing": max(losing) if losing else None,
            "tiles": tiles}


def report(result: dict[str, Any]) -> str:
    """The Markdown report of a result dict."""
    lines = [f"# ToMA benchmarks ({result['config']['device']}, {result['config']['dtype']}"
             f"{', quick' if result['config']['quick'] else ''})", "",
             ", ".join(f"{k}: {v}" for k, v in result["machine"].items()), ""]
    for name, sec in result["sections"].items():
        lines += [f"## {name}", ""]
        lines += [note if note.startswith("- ") else f"- {note}" for note in sec.get("notes", [])]
        if sec.get("rows"):
            lines += ["", markdown_table(sec["rows"], sec.get("columns") or list(sec["rows"][0]))]
        lines.append("")
    rec = result["recommendations"]
    lines += ["## Small grids (crossover at ratio 0.5, tile_count 64)", "",
              markdown_table(rec["crossover"], ["level", "N", "unpatched_ms", "block_speedup",
                                                "block_lb_speedup", "attention_speedup",
                                                "attention_lb_speedup"]), "",
              f"- smallest grid where block-scope ToMA pays: {rec['min_tokens_paying']} tokens; "
              f"largest where it loses: {rec['max_tokens_losing']}", ""]
    if rec["tiles"]:
        lines += ["## Tile count at ratio 0.5", "",
                  markdown_table(rec["tiles"], ["level", "scope", "tiles", "speedup", "plan_ms",
                                                "err", "cos"]), ""]
    if result["targets"]:
        lines += ["## Targets", "", markdown_table(result["targets"], ["target", "value", "met"]),
                  ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench",
                                     description="ToMA benchmark suite (see bench/__main__.py)")
    parser.add_argument("--quick", action="store_true", help="fewer cases and repetitions")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated, from {','.join(SECTIONS)}")
    parser.add_argument("--out", type=Path, default=None, help="JSON path")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall time, or process CPU time (CPU only; use with --threads 1)")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    names = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(names) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {','.join(SECTIONS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    comfy = setup_comfy(device)
    cfg = default_config(args.quick, comfy, str(device), args.clock)
    skipped = []
    if args.quick and args.sections == parser.get_default("sections"):
        skipped = [n for n in names if n in NOT_QUICK]
        names = [n for n in names if n not in NOT_QUICK]
    sections = run_sections(names, cfg, args.threads)
    for name in skipped:
        sections[name] = {"rows": [], "notes": ["left out of --quick (name it in --sections)"]}
    result = {
        "machine": machine_info(device),
        "config": {"device": device.type, "dtype": str(cfg.dtype).replace("torch.", ""),
                   "quick": cfg.quick, "comfyui": os.environ.get("COMFYUI_PATH") if comfy
                   else None, "batch": cfg.batch,
                   "warmup": cfg.warmup, "reps": cfg.reps, "clock": cfg.clock,
                   "threads": torch.get_num_threads(), "sections": names},
        "sections": sections,
    }
    result["targets"] = targets(sections)
    result["recommendations"] = recommendations(sections)
    out = args.out or (ROOT / "bench" / "results" / (
        f"{datetime.date.today().isoformat()}-{device.type}{'-quick' if cfg.quick else ''}.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    text = report(result)
    out.with_suffix(".md").write_text(text + "\n")
    print(text)
    print(f"\nJSON: {out} (Markdown beside it)")


if __name__ == "__main__":
    main()
