"""The benchmark suite: one command, one JSON file, one Markdown report.

    python -m bench                      # everything available, CPU fp32 (CUDA bf16 on a GPU)
    python -m bench --quick              # fewer cases and repetitions (~5-10 min on 2 cores)
    python -m bench --sections unet,fidelity --out results.json
    COMFYUI_PATH=/path/to/ComfyUI python -m bench     # ComfyUI's own blocks, + the ComfyUI-only
                                                      # sections

Runs from a fresh clone with torch and requirements-dev.txt (tomesd for the ToMeSD baseline,
scikit-image for the photographs). Without ComfyUI the UNet blocks are the plain-torch
reference_blocks.SDXLBlock and the ComfyUI-only sections are skipped with a note; with
COMFYUI_PATH they are ComfyUI's classes and every section runs (the ones marked "not in
--quick" run in quick mode only when named in --sections). On a shared CPU machine
`--threads 1 --clock cpu` gives steadier numbers (process CPU time, no thread barriers waiting on
other jobs); every section honours both.

Every time is the median of interleaved repetitions (at least 3) with its minimum and spread
((max - min) / median); every speedup has the range of the side-by-side repetitions' ratios. A
variant measured faster than its own lower bound is flagged ("Flagged" in the report): that is
noise or a broken bound, never a result. The CPU model is in every section's notes and in the
result file.

Sections: see SECTIONS below (name, module, what it measures). Adding one: a function
`run(cfg) -> {"rows", "columns", "notes"[, "targets"]}` and one Section entry.

Writes .cache/bench/<date>-<device>[-quick].json (ignored by git) or --out, the same report as
.md beside it, and prints the tables and the targets they are checked against. Committed results
(bench/results/) are written only with --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .shared.common import (
    MIN_REPS,
    commit,
    cpu_features,
    cpu_model,
    goal,
    machine_info,
    markdown_table,
    write_result,
)
from .shared.config import ROOT, BenchConfig, default_config, setup_comfy

log = logging.getLogger("bench")

DEFAULT_SCOPE = "block"      # merge_scope "auto" on a model without other nodes' patches
RATIO = 0.5                  # the node's default ratio
OUT_DIR = ROOT / ".cache" / "bench"


def _kernels(cfg: BenchConfig) -> dict[str, Any]:
    from .speed import kernels

    return {"rows": kernels.run(cfg), "columns": list(kernels.COLUMNS),
            "notes": [cfg.describe(kernels.reps(cfg)), kernels.LEGEND]}


def _unet(cfg: BenchConfig) -> dict[str, Any]:
    from .speed import unet_blocks

    return {**unet_blocks.run(cfg), "columns": list(unet_blocks.COLUMNS)}


def _flux(cfg: BenchConfig) -> dict[str, Any]:
    from .speed import flux_blocks

    return {"rows": flux_blocks.run(cfg), "columns": list(flux_blocks.COLUMNS),
            "notes": [cfg.describe(), "speedup_lo/hi: ratios of the side-by-side repetitions; "
                      "vs_lb: ToMA / lower bound (the block on the merged token count); "
                      "lb_speedup: the lower bound's speedup (what merging could give)"]}


def _fidelity(cfg: BenchConfig) -> dict[str, Any]:
    from .speed import fidelity

    return {**fidelity.run(cfg), "columns": list(fidelity.COLUMNS)}


def _model(cfg: BenchConfig) -> dict[str, Any]:
    from .speed import sdxl_step as model

    return {**model.run(cfg), "columns": list(model.COLUMNS)}


def _quality(cfg: BenchConfig) -> dict[str, Any]:
    from .quality import section as quality

    return {**quality.run(cfg), "columns": list(quality.COLUMNS)}


def _gpu_model(cfg: BenchConfig) -> dict[str, Any]:
    from .gpu import projected_calls as gpu_model

    return gpu_model.run(cfg, cfg.models)


def _gpu_sp(cfg: BenchConfig) -> dict[str, Any]:
    from .gpu import sequence_parallel

    return sequence_parallel.run(cfg)


def _whole_call(cfg: BenchConfig) -> dict[str, Any]:
    from .speed import whole_call

    return whole_call.run(cfg)


def _host(cfg: BenchConfig) -> dict[str, Any]:
    from .speed import host_cost

    return host_cost.run(cfg)


def _peers(cfg: BenchConfig) -> dict[str, Any]:
    from .speed import peers

    return peers.run(cfg)


def _ceilings(cfg: BenchConfig) -> dict[str, Any]:
    from .gpu import ceilings

    return ceilings.run(cfg)


def _gpu_runs(cfg: BenchConfig) -> dict[str, Any]:
    from .gpu import whole_runs

    return whole_runs.run(cfg)


def _gpu_call(cfg: BenchConfig) -> dict[str, Any]:
    from .gpu import measured_calls as gpu_call

    return gpu_call.run(cfg)


def _dit(cfg: BenchConfig) -> dict[str, Any]:
    from .speed import dit_families

    # 3 rounds, not cfg's 7: one full-size Wan 14B block runs for minutes on a CPU core
    reps = MIN_REPS
    rows = dit_families.run(quick=cfg.quick, reps=reps, clock=cfg.clock, threads=cfg.threads)
    return {"rows": rows, "columns": list(dit_families.COLUMNS),
            "notes": dit_families.notes(cfg.clock, reps, {}),
            "targets": dit_families.targets(rows, dit_families.RATIO)}


@dataclass(frozen=True)
class Section:
    """One section of the suite: run(cfg) -> {"rows", "columns", "notes"[, "targets"]}."""

    run: Callable[[BenchConfig], dict[str, Any]]
    about: str
    comfy_only: bool = False
    quick: bool = True          # in --quick's default set


SECTIONS: dict[str, Section] = {
    "kernels": Section(
        _kernels, "bench/speed/kernels.py: ToMA merge/unmerge/plan vs tomesd and one SDPA call"),
    "unet": Section(
        _unet, "bench/speed/unet_blocks.py: SDXL's 64x64x640 and 32x32x1280 blocks (+ 512/768 px "
               "grids): unpatched, ToMA (block / attention scope), lower bound, ToMeSD, ToDo"),
    "flux": Section(_flux, "bench/speed/flux_blocks.py: Flux double/single blocks",
                    comfy_only=True, quick=False),
    "fidelity": Section(
        _fidelity, "bench/speed/fidelity.py: output error on photographs' token grids, "
                   "speed-vs-error frontier"),
    "model": Section(_model, "bench/speed/sdxl_step.py: a whole SDXL UNet step at 1024x1024",
                     comfy_only=True, quick=False),
    "quality": Section(
        _quality, "bench/quality/section.py: trained fixtures (models/) through ComfyUI's "
                  "sampler: ToMA vs ToMeSD, ToDo, EasyCache; speed, PSNR/SSIM, MMD, held-out "
                  "loss", comfy_only=True, quick=False),
    "dit": Section(
        _dit, "bench/speed/dit_families.py: one full-width block per DiT family (Wan, Qwen-Image, "
              "SD3.5, Z-Image): plain, ToMA, lower bound, projected model (about 2 h of CPU at "
              "full size)", comfy_only=True, quick=False),
    "whole-call": Section(
        _whole_call, "bench/speed/whole_call.py: one sampling step of SDXL and Flux (real layers, "
                     "reduced width) at 1024x1024: unmerged, ToMA, an older checkout's ToMA "
                     "(TOMA_BASELINE), both compiled (TOMA_BENCH_COMPILE)",
        comfy_only=True, quick=False),
    "host": Section(
        _host, "bench/speed/host_cost.py: per steady model call of SDXL (70 blocks) and Flux "
               "(19 + 38) with every merged block active and small tensors: kernel launches, "
               "Python function calls and CPU time, unmerged vs ToMA", comfy_only=True),
    "peers": Section(
        _peers, "bench/speed/peers.py: whole 512x512 runs of SDXL and Flux (real layers, reduced "
                "width) with TeaCache, MagCache and First Block Cache (../shared/peers), alone "
                "and with ToMA", comfy_only=True, quick=False),
    "gpu-model": Section(
        _gpu_model, "bench/gpu/projected_calls.py: one model call of SDXL, Flux.1 dev, Wan 2.1 "
                    "14B, HiDream-O1, Krea 2 and MiniMax H3 at real size projected on an "
                    "H200, unmerged and ToMA, computing nothing (--models picks some) "
                    "(meta tensors; about 1.5 min on 2 cores, the same with --quick)",
        comfy_only=True),
    "gpu-sp": Section(
        _gpu_sp, "bench/gpu/sequence_parallel.py: Wan 2.1 14B and HunyuanVideo split over 2, 4 "
                 "and 8 GPUs as raylight's Ulysses runs them, per rank and call, unmerged and "
                 "ToMA: all-to-all bytes, FLOPs, time over NVLink and PCIe, projected (about "
                 "30 s on 2 cores)", comfy_only=True),
    "ceilings": Section(
        _ceilings, "bench/gpu/ceilings.py: versions, copy bandwidth, a bf16 GEMM, the SDPA "
                   "backend at SDXL's and Flux's shapes, the plan kernel against the reference "
                   "at real shapes (small sizes on a CPU)", quick=False),
    "gpu-runs": Section(
        _gpu_runs, "bench/gpu/whole_runs.py: whole 20-step SDXL runs on the GPU: unmerged, "
                   "ToMA, EasyCache, ToMA + EasyCache (reduced sizes on a CPU)",
        comfy_only=True, quick=False),
    "gpu-call": Section(
        _gpu_call, "bench/gpu/measured_calls.py: the same model calls measured on the GPU (CUDA "
                   "events, real size, bf16, random weights), unmerged, ToMA and under "
                   "TorchCompileModel; reduced sizes on a CPU", comfy_only=True, quick=False),
}


def measured_on(cfg: BenchConfig) -> str:
    """The line every section carries: CPU model and matrix features, threads, clock."""
    return (f"{cpu_model()} ({cpu_features()}), {torch.get_num_threads()} thread(s), "
            f"{cfg.clock} clock, {str(cfg.dtype).replace('torch.', '')}"
            + (f", {torch.cuda.get_device_name(cfg.device)}" if cfg.device.type == "cuda"
               else ""))


def run_sections(names: list[str], cfg: BenchConfig) -> dict[str, Any]:
    """Each section's {"rows", "columns", "notes", "measured_on"}, or a note saying why it did
    not run."""
    out: dict[str, Any] = {}
    for name in names:
        section = SECTIONS[name]
        if section.comfy_only and not cfg.comfy:
            out[name] = {"rows": [], "notes": ["skipped: needs ComfyUI (set COMFYUI_PATH)"]}
            continue
        log.warning("section %s ...", name)
        start = time.perf_counter()
        try:
            out[name] = section.run(cfg)
        except Exception as exc:  # one broken section must not lose the others' results
            log.error("section %s failed:\n%s", name, traceback.format_exc())
            out[name] = {"rows": [], "notes": [f"failed: {type(exc).__name__}: {exc}"]}
        out[name]["measured_on"] = measured_on(cfg)
        out[name]["seconds"] = time.perf_counter() - start
        log.warning("section %s done in %.0f s", name, out[name]["seconds"])
    if "unet" in out and "fidelity" in out and out["fidelity"]["rows"]:
        from .speed import fidelity

        out["pareto"] = {"rows": fidelity.pareto(out["unet"]["rows"], out["fidelity"]["rows"]),
                         "columns": list(fidelity.PARETO_COLUMNS),
                         "notes": ["speedup from the unet section (plan share included), error "
                                   "from the fidelity section; pareto: not beaten on both"]}
    return out


def flags(sections: dict[str, Any]) -> list[dict[str, Any]]:
    """Every row a section flagged (e.g. faster than its own lower bound): not results."""
    keys = ("level", "block", "variant", "method", "scope", "ratio", "tiles")
    return [{"section": name,
             "row": " ".join(f"{row[k]}" for k in keys if row.get(k) is not None),
             "flag": row["flag"]}
            for name, sec in sections.items() for row in sec.get("rows", []) if row.get("flag")]


def _find(rows: list[dict], **match: Any) -> dict | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def targets(sections: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, checked against whatever sections ran; each one not met says what
    was missed and by how much."""
    out: list[dict[str, Any] | None] = []
    unet = sections.get("unet", {}).get("rows", [])
    for level, least in (("64x64x640", 2.0), ("32x32x1280", 1.7)):
        r = _find(unet, level=level, method="toma", scope=DEFAULT_SCOPE, ratio=RATIO, tiles=64)
        out.append(goal(f"{level} ToMA {DEFAULT_SCOPE} {RATIO} speedup >= {least}", r,
                        "speedup", least))
        out.append(goal(f"{level} within 10% of its lower bound (vs_lb <= 1.10)", r, "vs_lb",
                        1.10, higher=False))
    r = _find(sections.get("model", {}).get("rows", []), variant="toma")
    out.append(goal("whole UNet step speedup >= 1.45", r, "speedup", 1.45))
    out.append(goal("whole UNet within 10% of its lower bound (vs_lb <= 1.10)", r, "vs_lb",
                    1.10, higher=False))
    fid = sections.get("fidelity", {}).get("rows", [])
    for level in ("64x64x640", "32x32x1280"):
        for scope in ("block", "attention"):
            out.append(_versus_tomesd(level, scope, fid, unet))
    for name, sec in sections.items():
        out += sec.get("targets", []) if name != "pareto" else []
    par = sections.get("pareto", {}).get("rows", [])
    for level in ("64x64x640", "32x32x1280"):
        out.append(_frontier(level, par))
    return [t for t in out if t is not None]


def _versus_tomesd(level: str, scope: str, fid: list[dict], unet: list[dict]) -> dict | None:
    """ToMA no worse than ToMeSD in error and faster, at ratio 0.5 in one scope."""
    toma = _find(fid, level=level, method="toma", scope=scope, ratio=RATIO, tiles=64)
    tome = _find(fid, level=level, method="tomesd", scope=scope, ratio=RATIO)
    ts = _find(unet, level=level, method="toma", scope=scope, ratio=RATIO, tiles=64)
    ms = _find(unet, level=level, method="tomesd", scope=scope, ratio=RATIO)
    if not (toma and tome and ts and ms):
        return None
    missed = []
    if toma["err"] > tome["err"]:
        missed.append(f"error {toma['err']:.3g} > ToMeSD's {tome['err']:.3g} "
                      f"({toma['err'] / tome['err'] - 1:.1%} worse)")
    if ts["speedup"] <= ms["speedup"]:
        missed.append(f"speedup {ts['speedup']:.3g} <= ToMeSD's {ms['speedup']:.3g}")
    out = {"target": f"{level} {scope} {RATIO}: ToMA err <= ToMeSD err, and faster",
           "value": f"err {toma['err']:.3g} vs {tome['err']:.3g}; speedup "
                    f"{ts['speedup']:.3g} vs {ms['speedup']:.3g}",
           "met": not missed}
    if missed:
        out["why"] = "missed: " + "; ".join(missed)
    return out


def _frontier(level: str, par: list[dict]) -> dict | None:
    """The default ToMA point on the speed-error frontier and not beaten by ToDo."""
    todo = _find(par, level=level, method="todo")
    toma = [p for p in par if p["level"] == level and p["method"] == "toma"]
    default = _find(toma, scope=DEFAULT_SCOPE, ratio=RATIO, tiles=64)
    if not (todo and default):
        return None
    beaten = [p for p in toma if todo["speedup"] >= p["speedup"] and todo["err"] <= p["err"]]
    on = [p for p in toma if p["pareto"]]
    out = {"target": f"{level}: ToMA on the speed-error frontier against ToDo",
           "value": f"{len(on)} of {len(toma)} ToMA points on the frontier, {len(beaten)} "
                    f"beaten by ToDo; ToDo speedup {todo['speedup']:.3g} err {todo['err']:.3g}",
           "met": bool(on) and default not in beaten}
    if not out["met"]:
        out["why"] = ("missed: no ToMA point on the frontier" if not on else
                      f"missed: ToDo ({todo['speedup']:.3g}x, err {todo['err']:.3g}) beats the "
                      f"default ({default['speedup']:.3g}x, err {default['err']:.3g})")
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


# What the columns of the section tables mean (a table's legend lists the ones it has).
COLUMN_HELP = {
    "ms": "median time of one call, milliseconds", "s": "median time of one call, seconds",
    "ms_min": "fastest repetition", "s_min": "fastest repetition",
    "spread": "(slowest - fastest) / median of the repetitions: how steady the figure is",
    "reps": "timed repetitions, interleaved with the other variants of the table",
    "speedup": "unmerged time / this variant's time (above 1: faster)",
    "speedup_lo": "lowest speedup of one side-by-side repetition",
    "speedup_hi": "highest speedup of one side-by-side repetition",
    "lb_ms": "lower bound: the same block run on the merged token count, merging free",
    "vs_lb": "this variant / its lower bound (1.00: as fast as merging can make it)",
    "plan_ms": "time of one plan build (destinations and weights)",
    "err": "relative L2 error of the output against the unmerged one",
    "cos": "mean cosine similarity of output tokens with the unmerged ones",
    "psnr": "PSNR of samples against the unmerged model's, dB (higher: closer)",
    "ssim": "SSIM of samples against the unmerged model's (1: identical)",
    "mmd": "MMD of the model's features against the unmerged ones (lower: closer)",
    "dloss": "relative increase of the held-out denoising loss (lower: better)",
    "ms_toma": "ToMA's projected time", "launches": "kernel launches of the unmerged call",
    "launches_toma": "kernel launches of the ToMA call",
}


def column_legend(columns: list[str]) -> str | None:
    """The legend line of a table: what its known columns mean."""
    known = [f"{c}: {COLUMN_HELP[c]}" for c in columns if c in COLUMN_HELP]
    return "- columns: " + "; ".join(known) if known else None


def stability_note(config: dict[str, Any]) -> str | None:
    """A warning when the run's settings give unsteady CPU figures."""
    if config.get("device") != "cpu":
        return None
    if config.get("clock") == "wall" or (config.get("threads") or 1) > 1:
        return (f"{config.get('threads')} thread(s) on the {config.get('clock')} clock: on a "
                f"machine shared with other jobs these CPU figures are unsteady (see each "
                f"table's spread); `--threads 1 --clock cpu` (the CPU default) measures the "
                f"steady way")
    return None


def verdict(result: dict[str, Any]) -> list[str]:
    """A few plain sentences on what the run found, before the tables."""
    sections, config = result["sections"], result["config"]
    where = (f"this machine ({result['machine'].get('cpu')}, {config.get('threads')} thread(s))"
             if config.get("device") == "cpu" else f"this GPU ({config.get('device')})")
    out = [f"Measured on {where}, {config.get('dtype')}, commit {config.get('commit')}."]
    unet = sections.get("unet", {}).get("rows", [])
    fid = sections.get("fidelity", {}).get("rows", [])
    for level in ("64x64x640", "32x32x1280"):
        toma = _find(unet, level=level, method="toma", scope=DEFAULT_SCOPE, ratio=RATIO, tiles=64)
        if toma is None:
            continue
        peers = []
        for method, label in (("tomesd", "ToMeSD"), ("todo", "ToDo")):
            peer = _find(unet, level=level, method=method, ratio=RATIO) or _find(
                unet, level=level, method=method)
            if peer and peer.get("speedup"):
                peers.append(f"{label} {peer['speedup']:.2f}x")
        error = _find(fid, level=level, method="toma", scope=DEFAULT_SCOPE, ratio=RATIO, tiles=64)
        out.append(f"SDXL block {level} at ratio {RATIO}: ToMA {toma['speedup']:.2f}x faster "
                   f"than unmerged" + (f" (peers: {', '.join(peers)})" if peers else "")
                   + (f", output error {error['err']:.3g}" if error else "") + ".")
    kernels = [r for r in sections.get("kernels", {}).get("rows", []) if r.get("mu_speedup")]
    if kernels:
        mu = [r["mu_speedup"] for r in kernels]
        full = [r["full_speedup"] for r in kernels if r.get("full_speedup")]
        out.append(f"Merge + unmerge alone: {min(mu):.2f}-{max(mu):.2f}x the speed of tomesd's"
                   + (f"; with the plan built: {min(full):.2f}-{max(full):.2f}x its matching"
                      if full else "") + " (batch 2, the rows' token counts and ratios).")
    whole = _find(sections.get("model", {}).get("rows", []), variant="toma")
    if whole and whole.get("speedup"):
        out.append(f"Whole SDXL UNet step at 1024x1024: {whole['speedup']:.2f}x faster.")
    for row in sections.get("flux", {}).get("rows", []):
        if str(row.get("block", "")).startswith("model") and row.get("speedup") and \
                row.get("ratio") == RATIO and "block" in str(row.get("variant")):
            out.append(f"Flux.1 whole model, projected from its blocks: {row['speedup']:.2f}x "
                       f"at ratio {RATIO}.")
    for row in sections.get("whole-call", {}).get("rows", []):
        if row.get("speedup") and row["variant"] in ("ToMA", "compiled ToMA", "ToMA baseline"):
            out.append(f"One {row['model']} sampling step ({row['variant']}): "
                       f"{row['speedup']:.2f}x faster than its unmerged counterpart.")
    for row in sections.get("gpu-model", {}).get("rows", []):
        if row.get("speedup"):
            out.append(f"Projected, not measured, on an H200: {row['model']} "
                       f"({row['setting']}) {row['speedup']:.2f}x.")
    for row in sections.get("quality", {}).get("rows", []):
        if row.get("variant") == "ToMA defaults":
            out.append(f"Trained {row['model']} fixture, ToMA defaults: {row['speedup']:.2f}x "
                       f"faster, samples at {row['psnr']:.1f} dB PSNR against the unmerged "
                       f"model's.")
    missed = [t for t in result.get("targets", []) if t.get("met") is False]
    out.append(f"Targets: {sum(1 for t in result.get('targets', []) if t.get('met') is True)} "
               f"met, {len(missed)} missed" + (f" ({'; '.join(t['target'] for t in missed[:3])}"
                                               f"{'; ...' if len(missed) > 3 else ''})"
                                               if missed else "") + ".")
    note = stability_note(config)
    return out + ([note] if note else [])


def report(result: dict[str, Any]) -> str:
    """The Markdown report of a result dict: the verdict in plain words, then the tables."""
    lines = [f"# ToMA benchmarks ({result['config']['device']}, {result['config']['dtype']}"
             f"{', quick' if result['config']['quick'] else ''})", "",
             ", ".join(f"{k}: {v}" for k, v in result["machine"].items()), "",
             f"commit: {result['config'].get('commit')}", ""]
    lines += ["## Verdict", ""] + [f"- {sentence}" for sentence in verdict(result)] + [""]
    if result["config"].get("command"):
        lines += [f"command: `{result['config']['command']}`"
                  + (f" with COMFYUI_PATH={result['config']['comfyui']}"
                     if result["config"].get("comfyui") else ""), ""]
    for name, sec in result["sections"].items():
        lines += [f"## {name}", ""]
        if sec.get("measured_on"):
            lines.append(f"- measured on: {sec['measured_on']}")
        lines += [note if note.startswith("- ") else f"- {note}" for note in sec.get("notes", [])]
        if sec.get("rows"):
            columns = sec.get("columns") or list(sec["rows"][0])
            legend = column_legend(columns)
            lines += ([legend] if legend else []) + ["", markdown_table(sec["rows"], columns)]
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
        lines += ["## Targets", "",
                  markdown_table(result["targets"], ["target", "value", "met", "why"]), ""]
    lines += ["## Flagged (not results)", ""]
    lines += ([markdown_table(result["flags"], ["section", "row", "flag"])] if result["flags"]
              else ["- none: no variant measured faster than its own lower bound"])
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench",
                                     description="ToMA benchmark suite (see bench/__main__.py)")
    parser.add_argument("--quick", action="store_true", help="fewer cases and repetitions")
    parser.add_argument("--sections", default=None,
                        help=f"comma-separated, from {','.join(SECTIONS)} (default: all; with "
                             f"--quick, those not marked not-in-quick)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (default: .cache/bench/<date>-<device>[-quick].json, "
                             "ignored by git; committed results need --out)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default on the CPU: 1, the steady way)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default=None,
                        help="wall time, or process CPU time (default: cpu on the CPU, with one "
                             "thread; wall on a GPU)")
    parser.add_argument("--models", default=None,
                        help="gpu-model: comma-separated models to project (bench/gpu/"
                             "projected_calls.py MODELS; default: all)")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    names = [s.strip() for s in (args.sections or ",".join(SECTIONS)).split(",") if s.strip()]
    unknown = sorted(set(names) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {','.join(SECTIONS)}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    # CPU figures the steady way unless asked otherwise: one thread, this process's CPU time
    # (two threads on the wall clock wait on other jobs of a shared machine)
    on_cpu = device.type == "cpu"
    clock = args.clock or ("cpu" if on_cpu and (args.threads or 1) == 1 else "wall")
    threads = args.threads or (1 if on_cpu and clock == "cpu" else None)
    comfy = setup_comfy(device)
    cfg = default_config(args.quick, comfy, str(device), clock, threads)
    if args.models:
        cfg = dataclasses.replace(cfg, models=tuple(m.strip() for m in args.models.split(",")))
    cfg.apply_threads()
    skipped = []
    if args.quick and args.sections is None:
        skipped = [n for n in names if not SECTIONS[n].quick]
        names = [n for n in names if SECTIONS[n].quick]
    sections = run_sections(names, cfg)
    for name in skipped:
        sections[name] = {"rows": [], "notes": ["left out of --quick (name it in --sections)"]}
    result = {
        "machine": machine_info(device),
        "config": {"device": device.type, "dtype": str(cfg.dtype).replace("torch.", ""),
                   "quick": cfg.quick, "comfyui": os.environ.get("COMFYUI_PATH") if comfy
                   else None, "batch": cfg.batch, "commit": commit(),
                   "warmup": cfg.warmup, "reps": cfg.reps, "clock": cfg.clock,
                   "threads": torch.get_num_threads(), "sections": names,
                   "command": " ".join(["python -m bench", *(sys.argv[1:] if argv is None
                                                            else argv)])},
        "sections": sections,
    }
    result["targets"] = targets(sections)
    result["flags"] = flags(sections)
    result["recommendations"] = recommendations(sections)
    out = args.out or (OUT_DIR / (f"{datetime.date.today().isoformat()}-{device.type}"
                                  f"{'-quick' if cfg.quick else ''}.json"))
    text = report(result)
    write_result(out, result, text)
    print(text)
    print(f"JSON: {out} (Markdown beside it)")


if __name__ == "__main__":
    main()
