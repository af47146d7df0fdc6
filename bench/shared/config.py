"""What a benchmark run uses: device, dtype, repetitions, and ComfyUI when COMFYUI_PATH is set."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .common import Timing, cpu_model, interleaved, now, sync

ROOT = Path(__file__).resolve().parents[2]
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchConfig:
    """Settings shared by the sections.

    batch: images per block call (1: one latent, no CFG batching); warmup/reps: untimed and
    timed calls per variant, interleaved across variants; comfy: ComfyUI's classes are in use;
    clock: "wall" (perf_counter) or "cpu" (this process's CPU time: steadier on a shared CPU
    machine when torch runs one thread; meaningless on CUDA); threads: torch CPU threads
    (None: torch's default), set by `apply_threads`; models: the models section gpu-model
    projects (empty: every one).
    """

    device: torch.device
    dtype: torch.dtype
    quick: bool
    comfy: bool
    batch: int = 1
    warmup: int = 2
    reps: int = 7
    seed: int = 0
    clock: str = "wall"
    threads: int | None = None
    models: tuple[str, ...] = ()    # gpu-model: only these models (empty: all)

    def now(self) -> float:
        """Seconds on the configured clock."""
        return now(self.clock)

    def sync(self) -> None:
        """Wait for queued kernels (CUDA); nothing on CPU."""
        sync(self.device)

    def apply_threads(self) -> None:
        """Set torch's CPU threads to cfg.threads (sections call it; a no-op when None)."""
        if self.threads:
            torch.set_num_threads(self.threads)

    def describe(self, reps: int | None = None, warmup: int | None = None) -> str:
        """How figures were taken, for every section's notes: CPU model, threads, clock,
        dtype, repetitions (cfg's unless the section used others)."""
        where = "CUDA" if self.device.type == "cuda" else f"CPU {cpu_model()}"
        return (f"{where}, {torch.get_num_threads()} thread(s), {self.clock} clock, "
                f"{str(self.dtype).replace('torch.', '')}; median, min and spread of "
                f"{reps or self.reps} interleaved repetitions after "
                f"{self.warmup if warmup is None else warmup} warm-up")


def default_config(quick: bool, comfy: bool, device: str | None = None,
                   clock: str = "wall", threads: int | None = None) -> BenchConfig:
    """CUDA in bf16 when a GPU is present, else CPU in fp32; quick: 1 warm-up, 3 reps."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    warmup, reps = (1, 3) if quick else (2, 7)
    if dev.type == "cuda":
        warmup, reps = warmup + 3, reps * 3
    if clock == "cpu" and dev.type == "cuda":
        raise ValueError("the cpu clock cannot time CUDA kernels: use the wall clock")
    return BenchConfig(dev, dtype, quick, comfy, warmup=warmup, reps=reps, clock=clock,
                       threads=threads)


_READY: set[str] = set()    # COMFYUI_PATHs set up in this process


def setup_comfy(device: torch.device) -> bool:
    """Put the ComfyUI at COMFYUI_PATH on sys.path (CPU mode on CPU, SDPA attention) and load
    this pack as `toma_pack`. False, doing nothing, when COMFYUI_PATH is unset; a second call
    (a section run on its own after the suite's setup) finds it done."""
    path = os.environ.get("COMFYUI_PATH")
    if not path:
        return False
    if path in _READY:
        return True
    if not (Path(path) / "comfy").is_dir():
        raise SystemExit(f"COMFYUI_PATH={path} is not a ComfyUI checkout (no comfy/ folder)")
    if path not in sys.path:
        sys.path.insert(0, path)
    import comfy.options  # (before cli_args on some versions)
    from comfy.cli_args import args

    if "comfy.model_management" in sys.modules:
        log.warning("comfy.model_management was imported before setup: CPU/SDPA not applied")
    args.cpu = device.type == "cpu"
    args.use_pytorch_cross_attention = True
    import comfy.ldm.modules.attention  # noqa: F401  (picks its attention function now)

    load_pack()
    _READY.add(path)
    return True


def load_pack():
    """This checkout as the package `toma_pack` (see pack_loader.py)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import pack_loader

    return pack_loader.load_pack()


def timings(calls: dict[str, Callable[[], object]], cfg: BenchConfig,
            warmup: int | None = None, reps: int | None = None) -> dict[str, Timing]:
    """Each call timed interleaved (see common.interleaved) on cfg's device and clock, with
    cfg's repetitions unless given."""
    return interleaved(calls, cfg.warmup if warmup is None else warmup,
                       cfg.reps if reps is None else reps, cfg.device, cfg.clock)
