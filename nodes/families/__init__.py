"""The diffusion transformer families ToMA patches, one module each (descriptions only: the
patch is dit_patch.py). Each module gives:

- MODELS: the models of the family, as the node's error and the README name them;
- CONTRACT (contracts.py): the model classes it patches and what it needs from ComfyUI;
- family(diffusion_model): the Family of a model of those classes, once family_of checked it
  (where a module has none: its description of the model's patch_size);
- where it has them, description(...) (its Family without a model, for the benchmarks),
  claims(diffusion_model) (two families of one class told apart) and NOT_MERGED (classes by
  name that share its blocks but are left alone, and why).

Classes are matched exactly, not by isinstance: ComfyUI subclasses these models for variants
with other token layouts, which must get the "not supported" error rather than a wrong merge.
A family whose contract this ComfyUI fails refuses its models (family_of), and every other
family keeps working (no family imports its classes outside contracts.py's guards). Adding a
family is adding its module here: the registry finds it.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import pkgutil
from collections.abc import Callable

import torch

from ..contracts import Gives, Sets, block_mismatches, claimed, mismatches, refusal
from ..dit_families import BlockKind, Family, latent_grid, set_grid
from ..model_call import ModelCall

# Helpers the family modules share (defined before the modules below import them) -------------
# The reference method whose references get timestep zero's modulation over their own tokens
TIMESTEP_ZERO_METHOD = "index_timestep_zero"


def patch_of(size: object) -> tuple[int, int, int]:
    """A model's (t, h, w) patch from its patch_size: one side (square image patches), (h, w)
    or (t, h, w)."""
    sides = tuple(int(s) for s in size) if isinstance(size, (tuple, list)) else (int(size),) * 2
    return (1,) * (3 - len(sides)) + sides


def sets_patch(model: str, names: tuple[str, ...] = ("patch_size",)) -> Sets:
    """The need that model class `model`'s constructor sets the patch size family() reads."""
    return Sets(f"{model}.__init__", names, why="the size of its patches")


def conditioning(model: str, keys: tuple[str, ...], since: str | None = None) -> Gives:
    """The need that model_base's class `model` gives these conditioning keys (extra_conds)."""
    return Gives(f"comfy.model_base:{model}.extra_conds", keys, what="conditioning", since=since)


def unmerged(call: ModelCall, why: str | None = None, sep: str = ";") -> str | None:
    """What describe returns for a call that runs unmerged (marked so): `why`, told the user as
    such, or None where the user need not know."""
    call.mergeable = False
    return why and f"{why}{sep} those model calls run unmerged"


def with_references(family: Family, default_method: object) -> Family:
    """`family`, whose calls may carry "index_timestep_zero" references (the call's
    ref_latents_method, else the model's `default_method`). Where this ComfyUI modulates them
    on their own (its kinds move their positions), such calls run unmerged under raylight's
    sequence parallelism, and say so: raylight hands every GPU the whole sequence's reference
    positions, not its shard's."""
    if not any(kind.positions for kind in family.kinds):
        return family
    plain = family.describe

    def describe(call: ModelCall, base_model, arguments: dict) -> str | None:
        if (call.shard is not None and arguments.get("ref_latents") is not None
                and arguments.get("ref_latents_method", default_method) == TIMESTEP_ZERO_METHOD):
            return unmerged(call, f"under raylight's sequence parallelism {family.label}'s "
                                  f"'{TIMESTEP_ZERO_METHOD}' references get timestep zero's "
                                  f"modulation by the whole sequence's positions on every GPU, "
                                  f"not its shard's (raylight's forward does not split them)")
        return plain(call, base_model, arguments)

    return dataclasses.replace(family, describe=describe)


def latent_tokens(latent: object, patch: tuple[int, int, int]) -> int:
    """Tokens of a latent's grid (latent_grid), 0 where it is none."""
    grid = latent_grid(latent, patch)
    return math.prod(grid) if grid else 0


def describe_latent(patch: tuple[int, int, int], references: str | None = None,
                    text: bool = False, refusals: tuple[tuple[str, str], ...] = ()
                    ) -> Callable[[ModelCall, object, dict], str | None]:
    """describe for a call read as the grid of latent x [B, C, H, W] (latent_grid): unmerged,
    saying why, where it has one of `refusals`' (key, why); after the tokens of its
    `references` latents (a list, each [1, C, h, w]) and, where `text`, its text (context
    c_crossattn [B, L, C]; none: 0 tokens)."""

    def describe(call: ModelCall, base_model, arguments: dict) -> str | None:
        for key, why in refusals:
            if arguments.get(key) is not None:
                return unmerged(call, why)
        found = (arguments.get(references) or ()) if references else ()
        set_grid(call, latent_grid(arguments.get("x"), patch),
                 prefix=sum(latent_tokens(reference, patch) for reference in found))
        if text:
            context = arguments.get("c_crossattn")
            call.txt_len = int(context.shape[1]) if torch.is_tensor(context) else 0
        return None

    return describe


def positions_taken(kinds: tuple[BlockKind, ...], forward: object,
                    parameter: str) -> tuple[BlockKind, ...]:
    """`kinds`, less their token positions to move where the blocks' `forward` takes no
    `parameter` (a ComfyUI that modulates no references on their own)."""
    if parameter in inspect.signature(forward).parameters:
        return kinds
    return tuple(dataclasses.replace(kind, positions=()) for kind in kinds)


# every module of this package is a family, tried in name order (a model two modules' classes
# share goes to the one whose `claims` takes it)
MODULES = tuple(importlib.import_module(f"{__name__}.{info.name}")
                for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name))
UNET_MODELS = "SDXL, SD1.5 and SD2 (ComfyUI's UNet)"
# model class name -> why ToMA leaves it alone: every family's NOT_MERGED
NOT_MERGED = {name: why for module in MODULES
              for name, why in getattr(module, "NOT_MERGED", {}).items()}


def supported_models() -> str:
    """Every model the node supports, as its error names them: the UNet's, then each family's."""
    names = [UNET_MODELS, *(module.MODELS for module in MODULES)]
    return ", ".join(names[:-1]) + " and " + names[-1]


def family_of(diffusion_model) -> Family | None:
    """The Family of a diffusion model, or None when ToMA does not support it. ValueError
    (naming the family, what changed and the ComfyUI version) for a model of a family whose
    contract this ComfyUI fails, or whose model cannot be read as the family reads it."""
    for module in MODULES:
        contract = module.CONTRACT
        model = claimed(contract, diffusion_model)
        if model is None or not _claims(module, diffusion_model):
            continue
        name = type(diffusion_model).__name__
        problems = mismatches(contract, model)
        if problems:
            raise ValueError(refusal(contract, name, problems))
        try:
            found = (module.family(diffusion_model) if hasattr(module, "family")
                     else module.description(patch_of(diffusion_model.patch_size)))
        except Exception as error:
            raise ValueError(refusal(contract, name, [
                f"reading its {name} model failed ({type(error).__name__}: {error})"])) \
                from error
        blocks = dict(contract.blocks)     # with the token positions the family moves
        for kind in found.kinds:
            blocks[kind.modules] = tuple(dict.fromkeys((*blocks.get(kind.modules, ()),
                                                        *kind.positions)))
        problems = block_mismatches(blocks, diffusion_model)
        if problems:
            raise ValueError(refusal(contract, name, problems))
        return found
    return None


def _claims(module, diffusion_model) -> bool:
    """Whether a module whose classes the model is of takes it (its `claims`, where it has
    one; a model it cannot tell is taken, so that its family's checks say what is wrong)."""
    claims = getattr(module, "claims", None)
    try:
        return claims is None or bool(claims(diffusion_model))
    except Exception:
        return True
