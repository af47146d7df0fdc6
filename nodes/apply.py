"""Recognise the model family and install the matching ToMA patches on a clone."""

from __future__ import annotations

import logging
import weakref

from .dit_families import Family
from .families import supported_models
from .forward_patches import ForwardPatches, plain_function
from .options import ToMAOptions
from .run_state import ToMAState

log = logging.getLogger("ToMA")

SUPPORTED = supported_models()
WRAPPER_KEY = "toma"


def model_family(model) -> str | Family:
    """"unet", or the Family of a diffusion transformer, for a ModelPatcher; ValueError naming
    what is supported otherwise (at every ratio: one rule for every model)."""
    from comfy.ldm.modules.attention import SpatialVideoTransformer
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel

    from .families import family_of, not_merged_reason

    diffusion_model = model.get_model_object("diffusion_model")
    if isinstance(diffusion_model, UNetModel):
        if any(isinstance(m, SpatialVideoTransformer) for m in diffusion_model.modules()):
            raise ValueError(f"ToMA does not support video UNets; supported: {SUPPORTED}")
        return "unet"
    family = family_of(diffusion_model)
    if family is None:
        reason = not_merged_reason(diffusion_model)
        raise ValueError(f"ToMA cannot patch {type(diffusion_model).__name__} models"
                         + (f" ({reason})" if reason else "") + f"; supported: {SUPPORTED}")
    return family


def apply_toma(model, options: ToMAOptions, node_id: str | None = None):
    """A clone of ModelPatcher `model` with ToMA installed; `model` itself is not changed.

    Ratio 0 returns a plain clone: sampling is bit-identical to the input model.
    """
    family = model_family(model)
    patched = model.clone()
    if options.ratio == 0:
        log.info("ToMA: ratio 0, model left unchanged")
        return patched
    from comfy.patcher_extension import WrappersMP

    depth = len(model.get_wrappers(WrappersMP.OUTER_SAMPLE, WRAPPER_KEY))   # ToMA nodes before
    if family == "unet":
        reading = None
        state = ToMAState(options, "unet", node_id, depth)
    else:
        from .dit_reading import read_model

        reading = read_model(patched, options, family)
        state = ToMAState(options, family.name, node_id, depth, describe=reading)
    outer = plain_function(state.outer_sample_wrapper)
    outer.toma_state = state        # what the speed check reads: settings and the model patched
    state.source = weakref.ref(model)
    patched.add_wrapper_with_key(WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, outer)
    patched.add_wrapper_with_key(WrappersMP.SAMPLER_SAMPLE, WRAPPER_KEY,
                                 plain_function(state.sampler_sample_wrapper))
    patched.add_wrapper_with_key(WrappersMP.APPLY_MODEL, WRAPPER_KEY,
                                 plain_function(state.apply_model_wrapper))
    patches = ForwardPatches()
    if family == "unet":
        from .unet_patch import patch_unet

        patch_unet(patched, state, options.merge_scope, patches)
    else:
        from .dit_patch import patch_dit

        patch_dit(patched, state, reading, patches)
    patches.install_callbacks(patched)
    return patched
