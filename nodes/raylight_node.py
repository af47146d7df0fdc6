"""ToMA Token Merge (Ray): ToMA on every GPU of a raylight graph.

raylight's nodes pass RAY_ACTORS (one Ray actor per GPU, each holding its own ComfyUI
ModelPatcher), not MODEL, so a patch on a graph's MODEL never reaches its GPUs. This node checks
the first GPU's model (refused as the ToMA node refuses it) and wraps each actor
(RayWorkerWithToMA), so that ToMA is on every actor's ModelPatcher only while a sampler after it
samples (ToMAOnActors), installed through raylight's own `model_function_runner` by a function
that carries the pack's sources to the actor's process (shipped).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.util
import json
import logging
import operator
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .node_spec import NodeSpec
from .options import make_options
from .toma_node import BASIC_INPUTS, CATEGORY, DESCRIPTION, patch_model

log = logging.getLogger("ToMA")

PACK_DIR = str(Path(__file__).resolve().parents[1])
PACKAGE = __name__.rsplit(".", 2)[0]        # the name the pack was imported under
# raylight 1.5.1's RayWorker methods that do not sample, and Ray's own on every actor; the
# ones that sample with the actor's ModelPatcher (common_ksampler, custom_sampler,
# custom_sampler_advanced) and any other whose name holds "sampl" go through ToMA
OTHER_METHODS = frozenset((
    "get_meta_model", "set_meta_model", "clear_sampling_vram", "check_model_loaded",
    "set_state_dict", "get_compute_capability", "get_parallel_dict", "get_exec_group_info",
    "set_parallel_dict", "model_function_runner", "model_function_runner_get_values",
    "get_local_rank", "get_is_model_loaded", "patch_cfg", "patch_usp", "patch_pipefusion",
    "load_unet", "load_gguf_unet", "set_lora_list", "get_lora_list", "load_lora", "kill",
    "ray_vae_loader", "ray_vae_decode", "ray_vae_decode_partial", "ray_vae_decode_finalize",
    "load_controlnet", "free_cached_controlnet", "free_cached_vae", "__ray_ready__",
    "__ray_terminate__"))
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
    if importlib.util.find_spec("ray") is None:
        return False
    if importlib.util.find_spec("raylight") is not None:
        return True
    return any(path.is_dir() for path in Path(PACK_DIR).parent.glob("*/src/raylight"))


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

    # the first GPU's model says whether ToMA can patch it, at every ratio (as the ToMA node)
    refusal = ray.get(workers[0].model_function_runner_get_values.remote(shipped("check_on")))
    if refusal is not None:
        raise ValueError(refusal)
    if ratio == 0:
        return ray_actors
    group = ToMAOnActors(workers, shipped("install_on", settings), shipped("remove_from"))
    return {**ray_actors, "workers": [RayWorkerWithToMA(group, i) for i in range(len(workers))]}


class ToMAOnActors:
    """The GPU actors of one node's output, which get ToMA together. Each actor's removal is
    sent right after its sampling call (Ray runs one caller's calls on an actor in order), and
    waited for on the next call through a wrapped actor once every actor has been sent its
    sampling (raylight's samplers call get_parallel_dict after sampling) or on the next
    sampling."""

    def __init__(self, actors: list, install: Callable, remove: Callable) -> None:
        self.actors, self.install, self.remove = actors, install, remove
        self.waiting: set[int] = set()        # actors with ToMA installed, not yet sampled
        self.removals: list[tuple[int, Any]] = []

    def sample(self, index: int, method: Any, args: tuple, kwargs: dict) -> Any:
        if index not in self.waiting:
            self.settle()
            self.install_everywhere()
        self.waiting.discard(index)
        result = method.remote(*args, **kwargs)
        self.removals.append((index, self.actors[index].model_function_runner.remote(
            self.remove)))
        return result

    def install_everywhere(self) -> None:
        targets = [i for i in range(len(self.actors)) if i not in self.waiting]
        failures = failed_calls(
            [(i, self.actors[i].model_function_runner.remote(self.install)) for i in targets])
        self.waiting |= set(targets) - {i for i, _ in failures}
        if failures:
            installed = sorted(self.waiting)
            self.waiting.clear()
            failed = failed_calls([(i, self.actors[i].model_function_runner.remote(self.remove))
                                   for i in installed])
            undone = "; ".join(f"GPU {i + 1}: {cause(error)}" for i, error in failed)
            i, error = failures[0]
            raise RuntimeError(
                f"ToMA Token Merge (Ray): installing ToMA failed on GPU {i + 1} of "
                f"{len(self.actors)}{f' (and {len(failures) - 1} more)' if failures[1:] else ''}"
                f": {cause(error)}. Nothing sampled; ToMA was taken off the other GPUs"
                f"{f' (except {undone})' if failed else ''}.") from error

    def settle(self) -> None:
        """Wait for the removals sent after sampling; raise the first that failed."""
        removals, self.removals = self.removals, []
        failures = failed_calls(removals)
        if failures:
            i, error = failures[0]
            raise RuntimeError(f"ToMA Token Merge (Ray): taking ToMA off GPU {i + 1} of "
                               f"{len(self.actors)} after sampling failed: "
                               f"{cause(error)}") from error


def failed_calls(sent: list[tuple[int, Any]]) -> list[tuple[int, BaseException]]:
    """(actor index, error) of each call sent to an actor that failed, once all have returned."""
    import ray

    failures = []
    for i, ref in sent:
        try:
            ray.get(ref)
        except Exception as error:      # whatever failed there is the user's to see
            failures.append((i, error))
    return failures


def cause(error: BaseException) -> str:
    """What went wrong on an actor, without Ray's wrapping (RayTaskError.cause)."""
    found = getattr(error, "cause", None) or error
    return f"{type(found).__name__}: {found}"


class RayWorkerWithToMA:
    """One raylight GPU actor in the graph after the node: its sampling methods go through its
    group (ToMAOnActors); raylight 1.5.1's other methods are the actor's; any other method is
    refused, since ToMA cannot tell whether it samples (it would sample unmerged)."""

    def __init__(self, group: ToMAOnActors, index: int) -> None:
        self._group, self._index = group, index
        self._actor = group.actors[index]

    def __getattr__(self, name: str) -> Any:
        if name in OTHER_METHODS:    # clear_sampling_vram among them
            if self._group.removals and not self._group.waiting:    # every actor sampled
                self._group.settle()
            return getattr(self._actor, name)
        if name.startswith("_"):
            raise AttributeError(name)
        if "sampl" in name:
            return SamplingWithToMA(self._group, self._index, getattr(self._actor, name))
        raise RuntimeError(
            f"ToMA Token Merge (Ray) does not know raylight's GPU method {name!r} (it knows "
            f"raylight 1.5.1's): it cannot tell whether that samples, and would let it sample "
            f"unmerged. Take ToMA Token Merge (Ray) out of this graph, or update the ToMA pack.")

    def __reduce__(self) -> tuple:
        """Pickled (raylight's custom samplers send their RAY_GUIDER, which holds the actors,
        to the actors themselves): the actor handle alone."""
        return operator.itemgetter(0), ((self._actor,),)


class SamplingWithToMA:
    """A sampling method of a wrapped actor: `.remote(...)` as raylight calls it."""

    def __init__(self, group: ToMAOnActors, index: int, method: Any) -> None:
        self.group, self.index, self.method = group, index, method

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self.group.sample(self.index, self.method, args, kwargs)


@functools.cache
def pack_sources() -> bytes:
    """The pack's product code (its __init__, nodes/ and toma_core/ sources) as compressed
    JSON: {module name below the package ("" for the package): [is a package, source, path]}.
    Read once per process."""
    root = Path(PACK_DIR)
    found = {}
    for path in [root / "__init__.py", *sorted((root / "nodes").rglob("*.py")),
                 *sorted((root / "toma_core").rglob("*.py"))]:
        parts = path.relative_to(root).with_suffix("").parts     # ("__init__",): the package
        package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if package else parts)] = [package, path.read_text(), str(path)]
    return zlib.compress(json.dumps(found).encode())


def shipped(function: str, *args: Any) -> Callable:
    """fn(model) -> model for an actor's model_function_runner: imports this pack under PACKAGE
    in the actor's process (once; a process that never imported it, maybe on another machine)
    from the sources that travel with it, with the standard library alone, then runs
    `function`(model, *args) of this module there."""
    package, sources = PACKAGE, pack_sources()

    def run(model: Any) -> Any:
        if package not in sys.modules:
            code = json.loads(zlib.decompress(sources))

            class ShippedPack(importlib.abc.MetaPathFinder, importlib.abc.Loader):
                """The pack's modules from the shipped sources, first on the meta path (the
                actor runs the driver's code); also each shipped package's path entry, listing
                its modules for pkgutil.iter_modules (the family registry lists its package)."""

                def __init__(self, below=""):
                    self.start = f"{below}." if below else ""

                def find_spec(self, name, path=None, target=None):
                    below = name[len(package) + 1:]
                    if not f"{name}.".startswith(f"{package}.") or below not in code:
                        return None
                    return importlib.util.spec_from_loader(name, self, origin=code[below][2],
                                                           is_package=code[below][0])

                def exec_module(self, module):
                    below = module.__name__[len(package) + 1:]
                    is_package, source, origin = code[below]
                    module.__file__ = origin
                    if is_package:
                        module.__path__ = [f"{origin}:shipped"]
                        sys.path_importer_cache[module.__path__[0]] = ShippedPack(below)
                    exec(compile(source, origin, "exec"), module.__dict__)

                def iter_modules(self, prefix=""):
                    for name, (is_package, _, _) in code.items():
                        rest = name[len(self.start):]
                        if name.startswith(self.start) and rest and "." not in rest:
                            yield prefix + rest, is_package

            sys.meta_path.insert(0, ShippedPack())
            importlib.import_module(package)
        target = importlib.import_module(f"{package}.nodes.raylight_node")
        return getattr(target, function)(model, *args)

    return run


# In the GPU actor's process -------------------------------------------------------------------
def check_on(model: Any) -> str | None:
    """Why ToMA cannot patch the actor's ModelPatcher (the ToMA node's error), or None."""
    from .apply import model_family

    try:
        model_family(model)
    except ValueError as error:
        return str(error)
    return None


def install_on(model: Any, settings: dict) -> Any:
    """ToMA on the actor's ModelPatcher (a clone: `model` stays as it is, and comes back with
    remove_from); the model itself where ToMA must leave it alone under raylight. A model
    still holding ToMA (its removal failed, and said so) is put back first."""
    from .sequence_parallel import install_refusal

    model = getattr(model, BASE, model)
    refusal = install_refusal(model)
    if refusal is not None:
        log.warning("ToMA: %s", refusal)
        return model
    patched = patch_model(model, **settings)
    setattr(patched, BASE, model)
    return patched


def remove_from(model: Any) -> Any:
    """The ModelPatcher install_on was given, after printing this GPU's stats to the console
    ComfyUI runs in (where raylight's workers print; under sequence parallelism the levels are
    its shard's and the notes say what all GPUs dropped of the whole grid)."""
    from .speed_check import state_of

    base = getattr(model, BASE, None)
    if base is None:
        return model
    stats = getattr(state_of(model), "last_stats", None)
    if not stats:
        return base
    rank = "GPU"
    state = sys.modules.get("xfuser.core.distributed")
    with contextlib.suppress(AssertionError):   # xfuser imported, its groups not made: no rank
        if state is not None:
            rank = (f"GPU rank {state.get_sequence_parallel_rank()} of "
                    f"{state.get_sequence_parallel_world_size()}")
    levels = ", ".join(f"{level['tokens']} -> {level['merged_tokens']} tokens "
                       f"({1 - level['merged_tokens'] / level['tokens']:.0%} dropped)"
                       for level in stats["levels"] if level["tokens"]) or "nothing merged"
    note = f"; {stats['note']}" if stats.get("note") else ""
    print(f"[ToMA] {rank}: ratio {stats['ratio']} asked; {levels}; "
          f"{stats['layers_merged']}/{stats['layers_total']} layers "
          f"and {stats['steps_merged']}/{stats['steps_total']} steps merged{note}", flush=True)
    return base
