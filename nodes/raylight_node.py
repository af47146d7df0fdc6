"""ToMA Token Merge (Ray): ToMA on every GPU of a raylight graph.

raylight's nodes pass RAY_ACTORS (one Ray actor per GPU, each holding its own ComfyUI
ModelPatcher), not MODEL, so a patch on a graph's MODEL never reaches its GPUs. This node takes
RAY_ACTORS and, once the first GPU's model has been checked (a model ToMA cannot patch is
refused as the ToMA node refuses it), returns them with each actor wrapped
(RayWorkerWithToMA): when a sampler of the
graph after it samples on an actor, the actor first installs ToMA on its ModelPatcher (through
raylight's own `model_function_runner`, as its "(Ray)" nodes do), samples, and then puts its
ModelPatcher back as it was. Ray runs one caller's tasks on an actor in the order they were
sent, so the three run back to back. Nothing stays on the actors: running the graph again
installs ToMA once again for that sampling, and a graph without the node (or ratio 0, which
returns the actors as they came) samples unmerged.

The function an actor runs arrives in another process, which never imported this pack, by
pickle: it is a closure that only uses the standard library to import the pack there from its
folder (by the same package name), and then calls `install_on` / `remove_from` below.
"""

from __future__ import annotations

import logging
import operator
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .node_spec import NodeSpec
from .options import make_options
from .toma_node import BASIC_INPUTS, CATEGORY, DESCRIPTION

log = logging.getLogger("ToMA")

PACK_DIR = str(Path(__file__).resolve().parents[1])
PACKAGE = __name__.rsplit(".", 2)[0]        # the name the pack was imported under
# raylight's actor methods that sample with the actor's ModelPatcher (RayWorker, raylight 1.5.1)
SAMPLING = ("common_ksampler", "custom_sampler", "custom_sampler_advanced")
# where an installed ToMA keeps the ModelPatcher it was installed on
BASE = "toma_ray_base"

TOMA_RAY = NodeSpec(
    node_id="ToMARay",
    display_name="ToMA Token Merge (Ray)",
    category=CATEGORY,
    description=DESCRIPTION.replace("between the model loader (and any LoRA) and the sampler",
                                    "between raylight's model loader (RayUNETLoader) and its "
                                    "sampler")
    + " For raylight's multi-GPU graphs: each GPU merges its own part of the video's tokens.",
    inputs={
        "ray_actors": ("RAY_ACTORS", {
            "tooltip": "raylight's GPU workers (from Load Diffusion Model (Ray) or a raylight "
                       "node after it); each GPU gets ToMA while a sampler after this node "
                       "runs."}),
        **{name: spec for name, spec in BASIC_INPUTS.items() if name != "model"},
    },
    outputs=("RAY_ACTORS",),
)


def raylight_installed() -> bool:
    """Whether raylight can run here: Ray importable, and raylight importable or its node
    folder (custom_nodes/<folder>/src/raylight) beside this pack's."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        return False
    if importlib.util.find_spec("raylight") is not None:
        return True
    folders = Path(PACK_DIR).parent
    return any((folder / "src" / "raylight").is_dir() for folder in folders.iterdir()
               if folder.is_dir())


def patch_ray_actors(ray_actors: Any, ratio: float, tile_count: int, skip_blocks: str,
                     recompute_every: int) -> Any:
    """The node: ray_actors with each GPU worker wrapped to sample with ToMA (ratio 0: as they
    came). ValueError names a bad widget, or says what is not raylight's RAY_ACTORS."""
    make_options(ratio, tile_count, skip_blocks, recompute_every)      # fail here, not on a GPU
    workers = ray_actors.get("workers") if isinstance(ray_actors, dict) else None
    if not isinstance(workers, list) or not workers:
        raise ValueError("ray_actors: expected raylight's RAY_ACTORS (a dict whose 'workers' "
                         "lists its GPU actors), from Load Diffusion Model (Ray)")
    settings = {"ratio": ratio, "tile_count": tile_count, "skip_blocks": skip_blocks,
                "recompute_every": recompute_every}
    import ray

    # the model lives on the GPUs: the first one says whether ToMA can patch it (at every
    # ratio, as the ToMA node refuses a model it cannot patch)
    refusal = ray.get(workers[0].model_function_runner_get_values.remote(
        shipped("check_on", settings)))
    if refusal is not None:
        raise ValueError(refusal)
    if ratio == 0:
        return ray_actors
    install = shipped("install_on", settings)
    remove = shipped("remove_from")
    return {**ray_actors, "workers": [RayWorkerWithToMA(worker, install, remove)
                                      for worker in workers]}


class RayWorkerWithToMA:
    """One raylight GPU actor in the graph after the node: its sampling methods install ToMA on
    the actor's ModelPatcher first and remove it after; every other attribute is the actor's."""

    def __init__(self, actor: Any, install: Callable, remove: Callable) -> None:
        self._actor, self._install, self._remove = actor, install, remove

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        method = getattr(self._actor, name)
        return SamplingWithToMA(self, method) if name in SAMPLING else method

    def __reduce__(self) -> tuple:
        """Pickled (raylight's custom samplers send their RAY_GUIDER, which holds the actors,
        to the actors themselves): the actor handle alone."""
        return operator.itemgetter(0), ((self._actor,),)


class SamplingWithToMA:
    """A sampling method of a wrapped actor: `.remote(...)` as raylight calls it."""

    def __init__(self, worker: RayWorkerWithToMA, method: Any) -> None:
        self.worker, self.method = worker, method

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        runner = self.worker._actor.model_function_runner
        runner.remote(self.worker._install)
        try:
            return self.method.remote(*args, **kwargs)
        finally:
            runner.remote(self.worker._remove)


def shipped(function: str, *args: Any) -> Callable:
    """fn(model) -> model for an actor's model_function_runner: imports this pack in the
    actor's process from PACK_DIR under PACKAGE (once), then runs `function`(model, *args) of
    this module there. Only the standard library and plain values travel with it."""
    pack_dir, package = PACK_DIR, PACKAGE

    def run(model: Any) -> Any:
        import importlib
        import importlib.util
        import sys as system

        if package not in system.modules:
            spec = importlib.util.spec_from_file_location(
                package, f"{pack_dir}/__init__.py", submodule_search_locations=[pack_dir])
            module = importlib.util.module_from_spec(spec)
            system.modules[package] = module
            spec.loader.exec_module(module)
        target = importlib.import_module(f"{package}.nodes.raylight_node")
        return getattr(target, function)(model, *args)

    return run


# In the GPU actor's process -------------------------------------------------------------------
def check_on(model: Any, settings: dict) -> str | None:
    """Why ToMA cannot patch the actor's ModelPatcher (the ToMA node's error), or None."""
    from .apply import model_family

    try:
        model_family(model)
        make_options(**settings)
    except ValueError as error:
        return str(error)
    return None


def install_on(model: Any, settings: dict) -> Any:
    """ToMA on the actor's ModelPatcher (a clone: `model` stays as it is, and comes back with
    remove_from); the model itself where ToMA must leave it alone under raylight."""
    from .apply import apply_toma
    from .sequence_parallel import install_refusal

    refusal = install_refusal(model)
    if refusal is not None:
        log.warning("ToMA: %s", refusal)
        return model
    patched = apply_toma(model, make_options(**settings))
    setattr(patched, BASE, model)
    return patched


def remove_from(model: Any) -> Any:
    """The ModelPatcher install_on was given, after saying on this GPU's output what ToMA did
    in its run (raylight's workers print to the console ComfyUI runs in)."""
    base = getattr(model, BASE, None)
    if base is None:
        return model
    say(model)
    return base


def say(model: Any) -> None:
    """One line per GPU: its rank, the tokens of its shard's grid and what they merged to, and
    ToMA's notes."""
    from comfy.patcher_extension import WrappersMP

    wrappers = model.get_wrappers(WrappersMP.OUTER_SAMPLE, "toma")
    stats = getattr(wrappers[-1], "toma_state", None) if wrappers else None
    stats = getattr(stats, "last_stats", None)
    if not stats:
        return
    rank = "GPU"
    state = sys.modules.get("xfuser.core.distributed")
    try:
        if state is not None:
            rank = (f"GPU rank {state.get_sequence_parallel_rank()} of "
                    f"{state.get_sequence_parallel_world_size()}")
    except AssertionError:      # xfuser imported, its groups not made: no rank to name
        pass
    levels = ", ".join(f"{level['tokens']} -> {level['merged_tokens']} tokens"
                       for level in stats["levels"]) or "nothing merged"
    note = f"; {stats['note']}" if stats.get("note") else ""
    print(f"[ToMA] {rank}: {levels}; {stats['layers_merged']}/{stats['layers_total']} layers "
          f"and {stats['steps_merged']}/{stats['steps_total']} steps merged{note}", flush=True)
