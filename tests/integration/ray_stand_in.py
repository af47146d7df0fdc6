"""A Ray actor standing in for raylight's GPU worker (raylight's RayWorker needs CUDA and NCCL
to start): the two methods the ToMA (Ray) node relies on, as raylight 1.5.1 writes them
(distributed_worker/ray_worker.py: model_function_runner sets `self.model = fn(self.model)`;
common_ksampler samples with comfy.sample.sample on self.model), around a real ComfyUI
ModelPatcher of a tiny model. Imported by name in Ray's worker processes, which never import
the pack: this module does not either."""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

import comfy_harness as ch


class StandInWorker:
    """`family`: a tiny_models family, or the name of one of its builder functions. hide: the
    pack's folder, made absent for this actor's process as on another machine of a Ray cluster:
    off sys.path, not the working directory, and any file under it but its tests refused."""

    def __init__(self, family: str, hide: str | None = None) -> None:
        ch.ensure_comfy()
        import tiny_models

        if family.startswith("tiny_"):
            self.model = getattr(tiny_models, family)()
        else:
            self.model = tiny_models.tiny_patcher(family)
        self.failing = (0, 0)
        self.samplings = 0
        if hide is not None:
            hide_folder(hide)

    def fail_runs(self, count: int, after: int = 0) -> None:
        """`count` model_function_runner calls fail (a GPU running out of memory), after
        `after` more succeed."""
        self.failing = (after, count)

    def model_function_runner(self, fn, *args, **kwargs) -> None:
        after, count = self.failing
        if count:
            self.failing = (max(after - 1, 0), count - (after == 0))
            if after == 0:
                raise RuntimeError("stand-in failure: CUDA out of memory")
        self.model = fn(self.model, *args, **kwargs)

    def get_parallel_dict(self) -> dict:
        return {}

    def clear_sampling_vram(self) -> None:
        """raylight's, after sampling where asked to (a name holding "sampl" that samples not)."""

    def model_function_runner_get_values(self, fn, *args, **kwargs) -> Any:
        return fn(self.model, *args, **kwargs)

    def common_ksampler(self, seed: int, steps: int, cfg: float, sampler_name: str,
                        scheduler: str, positive: Any, negative: Any, latent: dict,
                        denoise: float = 1.0) -> tuple[dict]:
        import comfy.sample

        samples = latent["samples"]
        noise = comfy.sample.prepare_noise(samples, seed)
        self.samplings += 1
        out = comfy.sample.sample(self.model, noise, steps, cfg, sampler_name, scheduler,
                                  positive, negative, samples, denoise=denoise,
                                  disable_pbar=True, seed=seed)
        return ({**latent, "samples": out},)

    def sample_video(self, *args: Any, **kwargs: Any) -> tuple[dict]:
        """A sampling method raylight 1.5.1 does not have (a newer raylight's)."""
        return self.common_ksampler(*args, **kwargs)

    def state(self, package: str) -> dict:
        """What the test reads back: whether the pack was imported here, and the ToMA
        wrappers on the worker's ModelPatcher now."""
        from comfy.patcher_extension import WrappersMP

        return {"pack_imported": package in sys.modules, "samplings": self.samplings,
                "toma_wrappers": len(self.model.get_wrappers(WrappersMP.OUTER_SAMPLE, "toma")),
                "model_id": id(self.model)}


def hide_folder(folder: str) -> None:
    """`folder` absent from this process from now on (all but its tests/, which the stand-in
    itself was imported from, and its dot-folders, where a checkout keeps the Python
    environment Ray itself imports from): off sys.path, not the working directory, its files
    refused by an audit hook on every open (Python's imports read sources through
    io.open_code, which raises the same "open" event)."""
    hidden = os.path.realpath(folder)

    def kept(path: str) -> bool:
        top = os.path.relpath(path, hidden).split(os.sep)[0]
        return top == "tests" or (top != "." and top.startswith("."))
    sys.path[:] = [p for p in sys.path
                   if os.path.realpath(p or ".") not in (hidden, os.path.dirname(hidden))]
    os.chdir(tempfile.gettempdir())

    def refuse(event: str, args: tuple) -> None:
        if event != "open" or not args or not isinstance(args[0], (str, bytes, os.PathLike)):
            return
        path = os.path.realpath(os.fsdecode(args[0]))
        if (path == hidden or path.startswith(hidden + os.sep)) and not kept(path):
            raise PermissionError(f"stand-in: {path} is not on this machine")

    sys.addaudithook(refuse)
