"""Patch installation: ToMA's object patches of module forwards, made again for every copy of the
diffusion model ComfyUI runs (ForwardPatches), the wrappers' plain functions, and where tensors
kept beyond the block that makes them are allocated (kept_allocations)."""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from collections.abc import Callable

import torch

from ..toma_core.regions import compiling


def plain_function(method: Callable) -> Callable:
    """`method` behind a plain function: ComfyUI before 0.20 deep-copies model_options on clone,
    and a deep copy of a bound method copies its object (one node's state split between clones);
    a function is copied by reference, so every clone keeps talking to the same state."""

    def call(*args, **kwargs):
        return method(*args, **kwargs)

    return call


def kept_allocations() -> contextlib.AbstractContextManager:
    """The context to allocate a tensor in that outlives the block making it, inside a forward.

    ComfyUI 0.34+'s "Comfy model compiler" plans a forward's allocations block by block in its
    malloc graph, where a tensor kept past its scope is a "rogue"; its pause_malloc_graph lets
    allocations bypass the graph. A no-op on older versions, while dynamo traces (the pause
    calls a C library), and where ComfyUI has not loaded comfy.model_prefetch (never imported)."""
    pause = None if compiling() else getattr(sys.modules.get("comfy.model_prefetch"),
                                             "pause_malloc_graph", None)
    return contextlib.nullcontext() if pause is None else pause()


class ForwardPatches:
    """ToMA's object patches of module forwards on one patched ModelPatcher, made again for each
    copy of the diffusion model: ComfyUI's multi-GPU clones (MultiGPU CFG Split, Select Model
    Device) run their own model object with the first one's object patches, whose modules
    would be another device's.

    make(module, original[, after]) -> the patched forward of `module`; `original`: another
    pack's object patch of that forward (it runs inside ToMA's), else the module's own forward;
    `after`: the module at that path in the same copy (the block that runs next)."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, Callable | None, Callable, str | None]] = []

    def add(self, model, path: str, make: Callable[..., Callable],
            after: str | None = None) -> None:
        """Patch the forward of diffusion_model.<path> on ModelPatcher `model`."""
        entry = (path, model.object_patches.get(f"diffusion_model.{path}.forward"), make, after)
        self.entries.append(entry)
        self._install(model, *entry)

    @staticmethod
    def _install(model, path: str, previous: Callable | None, make: Callable,
                 after: str | None) -> None:
        root = model.model.diffusion_model
        module = module_at(root, path)
        extra = () if after is None else (module_at(root, after),)
        model.add_object_patch(f"diffusion_model.{path}.forward", make(
            module, previous or types.MethodType(type(module).forward, module), *extra))

    def rebind(self, source, clone) -> None:
        """ComfyUI's multi-GPU callback: the patches made again for `clone`'s own model object."""
        if clone.model is not source.model:
            for entry in self.entries:
                self._install(clone, *entry)

    def install_callbacks(self, model) -> None:
        """Have ComfyUI rebind these patches on each multi-GPU copy of `model` (callback kinds
        a ComfyUI version lacks are left out: it makes no such copies)."""
        from comfy.patcher_extension import CallbacksMP

        if not self.entries:
            return
        for name in ("ON_MATCH_MULTIGPU_CLONES", "ON_DEEPCLONE_MULTIGPU"):
            kind = getattr(CallbacksMP, name, None)
            if kind is not None:
                model.add_callback_with_key(kind, "toma", plain_function(self.rebind))


def module_at(root: torch.nn.Module, path: str) -> torch.nn.Module:
    """The submodule of `root` at a dotted path ("input_blocks.4.1.transformer_blocks.0")."""
    return functools.reduce(getattr, path.split("."), root)
