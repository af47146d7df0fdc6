"""Recognise the model family and install the matching ToMA patches on a clone."""

from __future__ import annotations

import logging

from .options import ToMAOptions
from .run_state import ToMAState, plain_function

log = logging.getLogger("ToMA")

SUPPORTED = ("SDXL, SD1.5 and SD2 (ComfyUI's UNet), Flux.1 dev/schnell, Flux Kontext and Chroma "
             "(ComfyUI's Flux double/single block models)")
WRAPPER_KEY = "toma"


def model_family(model) -> str:
    """'unet' or 'flux' for a ModelPatcher, or ValueError naming what is supported."""
    from comfy.ldm.modules.attention import SpatialVideoTransformer
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel

    diffusion_model = model.get_model_object("diffusion_model")
    if isinstance(diffusion_model, UNetModel):
        if any(isinstance(m, SpatialVideoTransformer) for m in diffusion_model.modules()):
            raise ValueError(f"ToMA does not support video UNets; supported: {SUPPORTED}")
        return "unet"
    if isinstance(diffusion_model, _flux_classes()):
        return "flux"
    raise ValueError(f"ToMA cannot patch {type(diffusion_model).__name__} models; "
                     f"supported: {SUPPORTED}")


def _flux_classes() -> tuple[type, ...]:
    """Models with Flux's token layout (text first, then a row-major 2-D image grid) and its
    double/single block loop with "dit" replace patches. Chroma before v0.8 has its own copies
    of Flux's block classes, so the model class is what is checked, not the blocks'."""
    from comfy.ldm.chroma.model import Chroma
    from comfy.ldm.flux.model import Flux

    return (Flux, Chroma)


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

    state = ToMAState(options, family, node_id)
    patched.add_wrapper_with_key(WrappersMP.OUTER_SAMPLE, WRAPPER_KEY,
                                 plain_function(state.outer_sample_wrapper))
    patched.add_wrapper_with_key(WrappersMP.APPLY_MODEL, WRAPPER_KEY,
                                 plain_function(state.apply_model_wrapper))
    if family == "unet":
        from .unet_patch import patch_unet

        patch_unet(patched, state, options.merge_scope)
    else:
        from .flux_patch import patch_flux

        patch_flux(patched, state)
    return patched
