"""ToMA inside raylight's sequence parallelism (xDiT/xfuser USP: Ulysses or ring attention), where
one generation runs on several GPUs, each holding one shard of the token sequence.

raylight (komikndr/raylight) replaces a diffusion transformer's forward with its own that pads
the token sequence to a multiple of the GPU count P, splits it into P equal shards before the
block loop (positional rows sliced alike) and gathers it after; ComfyUI's "dit" replace patches
still run, each on its own GPU's shard, and ToMA merges that shard (toma_core.shards says how).
What raylight hands a block's patch differs per family (BlockKind.shard, set where its forward
was read and tested); a kind without one runs unmerged there, and says so.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

# Who splits the sequence: raylight's forwards live in modules under this package.
RAYLIGHT = "raylight"


@dataclass(frozen=True)
class Shard:
    """This process's part of a sequence-parallel model call: rank of `world` ranks, and the
    name of raylight's forward that split the sequence."""

    rank: int
    world: int
    forward: str


def sequence_shard(diffusion_model: object) -> Shard | None:
    """This process's Shard of a call of `diffusion_model`, None outside sequence parallelism
    (no raylight forward on the model, or a sequence-parallel group of one). The forward is one
    of raylight's usp_ functions, which raylight sets on the model object when the model loads;
    xfuser is read only where raylight already imported it."""
    forward = None
    for value in vars(diffusion_model).values() if hasattr(diffusion_model, "__dict__") else ():
        function = getattr(value, "__func__", None)
        module = getattr(function, "__module__", "") or ""
        if module.startswith(f"{RAYLIGHT}.") and function.__name__.startswith("usp_"):
            forward = f"{module}.{function.__name__}"
            break
    state = sys.modules.get("xfuser.core.distributed")
    if forward is None or state is None:
        return None
    world = int(state.get_sequence_parallel_world_size())
    if world <= 1:
        return None
    return Shard(int(state.get_sequence_parallel_rank()), world, forward)


def install_refusal(model) -> str | None:
    """Why ToMA must not patch this ModelPatcher, whose model raylight will run sequence
    parallel (raylight's RayUNETLoader puts its injection among the ModelPatcher's callbacks,
    call type -> key -> functions, on every GPU's model), or None."""
    from .families import family_of

    functions = [function for by_key in (getattr(model, "callbacks", None) or {}).values()
                 for listed in by_key.values() for function in listed]
    if not any((getattr(function, "__module__", "") or "").startswith(f"{RAYLIGHT}.")
               for function in functions):
        return None
    family = family_of(model.get_model_object("diffusion_model"))
    reason = family.sequence_parallel_refusal if family is not None else None
    if reason is None:
        return None
    return (f"ToMA leaves {family.label} alone under raylight's sequence parallelism: "
            f"{reason}; it runs unmerged")
