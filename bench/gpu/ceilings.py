"""Section ceilings: what the machine itself reaches, and whether ToMA's plan kernel runs there,
first in a GPU run (seconds), so that every later figure can be read against them.

    python -m bench --sections ceilings --device cuda

- versions: torch, CUDA, Triton, the GPU;
- copy bandwidth: a 1 GiB device-to-device copy (bytes read + written per second);
- matrix rate: a bf16 GEMM of 8192^3 (FLOP/s);
- attention: which SDPA backend the default call picks for SDXL's and Flux's attention shapes
  (each backend timed on its own, the default beside them: the backend whose time it matches);
- the plan kernel (comfy_toma::plan_weights, toma_core/triton_plan.py) against the reference
  ops at real shapes: regions of 64 slots, k 16 and 32, C 640 to 5120, bf16 and fp16, even and
  ragged regions; the largest difference of the weights, whether the destinations agree, both
  times, and that the kernel applied and did not fall back (a fallback is a failed check).

On a CPU the sizes are small and the kernel rows say it does not apply there: the rehearsal
shows the section runs, not what a GPU reaches.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from ..shared.config import BenchConfig, load_pack

log = logging.getLogger(__name__)

COLUMNS = ("check", "shape", "dtype", "value", "unit", "ms", "ms_reference", "max_diff",
           "same_picks", "ok")
# (label, q/k/v shape [B, heads, L, D]): SDXL's 4096-token level at 1024x1024 with CFG, Flux.1's
# joint attention at 1024x1024 (4096 image + 512 text tokens)
ATTENTION_SHAPES = (("SDXL 64x64", (2, 10, 4096, 64)), ("Flux 1024", (1, 24, 4608, 128)))
# (h, w, channels): regions of 64 slots (8x8 tiles) on even and ragged grids
PLAN_SHAPES = ((64, 64, 640), (32, 32, 1280), (64, 64, 3072), (64, 64, 5120), (60, 90, 640))
PLAN_KS = (16, 32)
DIFF_LIMIT = 2e-2       # bf16 weights from fp32 similarities: rounding, not another answer


def _timed(fn: Callable[[], Any], device: torch.device, reps: int = 5) -> float:
    """Median milliseconds of fn() after one warm-up call (CUDA events on a GPU)."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t))
    return sorted(times)[len(times) // 2]


def versions(device: torch.device) -> list[dict[str, Any]]:
    """One row per version that matters to the figures."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    rows = [{"check": "torch", "value": torch.__version__},
            {"check": "CUDA", "value": torch.version.cuda or "none"},
            {"check": "Triton", "value": triton_version}]
    if device.type == "cuda":
        rows.append({"check": "GPU", "value": torch.cuda.get_device_name(device)})
    return rows


def bandwidth(device: torch.device, small: bool) -> dict[str, Any]:
    """Device-to-device copy: bytes read and written per second."""
    n = (1 << 20 if small else 1 << 30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    ms = _timed(lambda: dst.copy_(src), device)
    return {"check": "copy bandwidth", "shape": f"{2 * n / 2**30:.3g} GiB", "dtype": "bfloat16",
            "value": round(2 * 2 * n / (ms / 1e3) / 1e12, 3), "unit": "TB/s", "ms": ms}


def gemm(device: torch.device, small: bool) -> dict[str, Any]:
    """A square bf16 matrix product: FLOP/s."""
    n = 512 if small else 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    ms = _timed(lambda: a @ b, device)
    return {"check": "GEMM", "shape": f"{n}^3", "dtype": "bfloat16",
            "value": round(2 * n**3 / (ms / 1e3) / 1e12, 1), "unit": "TFLOP/s", "ms": ms}


def attention(device: torch.device, small: bool) -> list[dict[str, Any]]:
    """Per attention shape: the default SDPA call's time and each backend's alone."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = torch.nn.functional.scaled_dot_product_attention
    rows = []
    for label, shape in ATTENTION_SHAPES:
        if small:
            shape = (*shape[:2], 256, shape[3])
        q, k, v = (torch.randn(shape, dtype=torch.bfloat16, device=device) for _ in range(3))
        default = _timed(lambda q=q, k=k, v=v: sdpa(q, k, v), device)
        times = {}
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                        SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH):
            try:
                with sdpa_kernel(backend):
                    times[backend.name] = _timed(
                        lambda q=q, k=k, v=v: sdpa(q, k, v), device)
            except RuntimeError as exc:     # the backend does not run here
                log.info("SDPA %s on %s: %s", backend.name, label, exc)
        closest = min(times, key=lambda name: abs(times[name] - default)) if times else "?"
        flops = 4 * shape[0] * shape[1] * shape[2] ** 2 * shape[3]
        rows.append({"check": f"SDPA {label}", "shape": "x".join(map(str, shape)),
                     "dtype": "bfloat16", "value": closest, "unit": "backend (closest time)",
                     "ms": default, "max_diff": None,
                     "note": ", ".join(f"{n} {t:.3f} ms" for n, t in times.items())
                     + f"; {flops / (default / 1e3) / 1e12:.1f} TFLOP/s at the default"})
    return rows


def plan_kernel(device: torch.device) -> list[dict[str, Any]]:
    """The plan operator against the reference ops at PLAN_SHAPES x PLAN_KS x bf16/fp16."""
    import importlib

    core = load_pack().toma_core
    triton_plan = importlib.import_module(f"{core.__name__}.triton_plan")
    plan_op = importlib.import_module(f"{core.__name__}.plan_op")
    make_regions, plan_weights = core.make_regions, plan_op.plan_weights
    plan_weights_reference = plan_op.plan_weights_reference

    rows = []
    g = torch.Generator(device).manual_seed(0)
    for h, w, c in PLAN_SHAPES if device.type == "cuda" else PLAN_SHAPES[:1]:
        regions = make_regions(h, w, "tile", round(h * w / 64))
        tables = regions.tables(device)
        for dtype in (torch.bfloat16, torch.float16):
            x = torch.randn(2, h * w, c, generator=g, device=device).to(dtype)
            for k in PLAN_KS:
                args = (x, 0, tables.slots, tables.valid, k, 1000.0, True, dtype)
                applies = triton_plan.applies(regions.size, k, 1000.0)
                got = plan_weights(*args)
                want = plan_weights_reference(*args)
                diff = max(float((a.float() - b.float()).abs().max())
                           for a, b in zip(got[2:], want[2:], strict=True))
                same = bool(torch.equal(got[0], want[0]))
                fell_back = bool(triton_plan._disabled)
                ok = device.type != "cuda" or (applies and not fell_back and diff <= DIFF_LIMIT)
                rows.append({
                    "check": "plan kernel", "dtype": str(dtype).replace("torch.", ""),
                    "shape": f"{h}x{w}x{c} k{k} S{regions.size}"
                             + ("" if regions.even else " ragged"),
                    "value": "kernel" if applies and device.type == "cuda" else "reference",
                    "unit": "ran", "ms": _timed(lambda a=args: plan_weights(*a), device),
                    "ms_reference": _timed(lambda a=args: plan_weights_reference(*a), device),
                    "max_diff": diff, "same_picks": same, "ok": ok,
                    **({"note": f"fell back: {triton_plan._disabled[0]}"} if fell_back else {})})
    return rows


def run(cfg: BenchConfig) -> dict[str, Any]:
    device = cfg.device
    small = device.type != "cuda"
    rows = versions(device) + [bandwidth(device, small), gemm(device, small)]
    rows += attention(device, small)
    rows += plan_kernel(device)
    failed = [r for r in rows if r.get("ok") is False]
    notes = ["copy bandwidth counts bytes read and written; GEMM 2 n^3 FLOPs; SDPA: the default "
             "call's time and the backend whose time it matches (each backend timed alone under "
             "sdpa_kernel); plan kernel: the operator against plan_weights_reference, max_diff "
             "over merge and unmerge weights, same_picks: equal destinations, ok: the kernel "
             f"applied, did not fall back and stayed within {DIFF_LIMIT}"]
    if small:
        notes.append("on a CPU: small sizes, and the plan kernel does not apply (a rehearsal)")
    if failed:
        notes.append(f"FAILED: {len(failed)} plan kernel check(s): " +
                     "; ".join(f"{r['shape']} {r['dtype']}" for r in failed))
    return {"rows": rows, "columns": list(COLUMNS) + ["note"], "notes": notes}
