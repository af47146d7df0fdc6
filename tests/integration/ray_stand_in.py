"""A Ray actor standing in for raylight's GPU worker (raylight's RayWorker needs CUDA and NCCL
to start): the two methods the ToMA (Ray) node relies on, as raylight 1.5.1 writes them
(distributed_worker/ray_worker.py: model_function_runner sets `self.model = fn(self.model)`;
common_ksampler samples with comfy.sample.sample on self.model), around a real ComfyUI
ModelPatcher of a tiny model. Imported by name in Ray's worker processes, which never import
the pack: this module does not either."""

from __future__ import annotations

import sys
from typing import Any

import comfy_harness as ch


class StandInWorker:
    """`family`: a tiny_models family, or the name of one of its builder functions."""

    def __init__(self, family: str) -> None:
        ch.ensure_comfy()
        import tiny_models

        if family.startswith("tiny_"):
            self.model = getattr(tiny_models, family)()
        else:
            self.model = tiny_models.tiny_patcher(family)

    def model_function_runner(self, fn, *args, **kwargs) -> None:
        self.model = fn(self.model, *args, **kwargs)

    def model_function_runner_get_values(self, fn, *args, **kwargs) -> Any:
        return fn(self.model, *args, **kwargs)

    def common_ksampler(self, seed: int, steps: int, cfg: float, sampler_name: str,
                        scheduler: str, positive: Any, negative: Any, latent: dict,
                        denoise: float = 1.0) -> tuple[dict]:
        import comfy.sample

        samples = latent["samples"]
        noise = comfy.sample.prepare_noise(samples, seed)
        out = comfy.sample.sample(self.model, noise, steps, cfg, sampler_name, scheduler,
                                  positive, negative, samples, denoise=denoise,
                                  disable_pbar=True, seed=seed)
        return ({**latent, "samples": out},)

    def state(self, package: str) -> dict:
        """What the test reads back: whether the pack was imported here, and the ToMA
        wrappers on the worker's ModelPatcher now."""
        from comfy.patcher_extension import WrappersMP

        return {"pack_imported": package in sys.modules,
                "toma_wrappers": len(self.model.get_wrappers(WrappersMP.OUTER_SAMPLE, "toma")),
                "model_id": id(self.model)}
