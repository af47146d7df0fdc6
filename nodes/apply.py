"""Recognise the model family and install the matching ToMA patches on a clone, once CONTRACT
and the family's own (unet_patch.py, families/) hold on the running ComfyUI.
"""

from __future__ import annotations

import logging
import weakref

from . import unet_patch
from .contracts import Contract, Equals, Gives, Has, Takes, mismatches, refusal, running_comfyui
from .dit_families import Family
from .families import NOT_MERGED, family_of, supported_models
from .forward_patches import ForwardPatches, plain_function
from .options import ToMAOptions
from .run_state import ToMAState

log = logging.getLogger("ToMA")

SUPPORTED = supported_models()
WRAPPER_KEY = "toma"

# What run_state's wrappers read of ComfyUI: wrapper kinds, arguments by name, and the key of
# TorchCompileModel's settings in the model options.
CONTRACT = Contract(
    "sampling",
    models={},
    needs=(Has("comfy.patcher_extension:WrappersMP",
               ("OUTER_SAMPLE", "SAMPLER_SAMPLE", "APPLY_MODEL")),
           Takes("comfy.samplers:KSAMPLER.sample", ("sigmas", "extra_args", "callback")),
           Takes("comfy.model_base:BaseModel._apply_model", ("x", "transformer_options")),
           Equals("comfy_api.torch_helpers.torch_compile:TORCH_COMPILE_KWARGS",
                  "torch_compile_kwargs"),
           Gives("comfy_api.torch_helpers.torch_compile:set_torch_compile_wrapper",
                 ("options",), what="compile setting")),
)


def model_family(model) -> str | Family:
    """"unet", or the Family of a diffusion transformer, for a ModelPatcher; ValueError naming
    what is supported otherwise (at every ratio), or what changed where the running ComfyUI
    fails the contract of ToMA's sampling wrappers or of the model's family."""
    problems = mismatches(CONTRACT)
    if problems:
        raise ValueError(f"ToMA cannot patch models on {running_comfyui()}: this version "
                         f"changed what ToMA's sampling wrappers rely on "
                         f"({'; '.join(problems)})")
    diffusion_model = model.get_model_object("diffusion_model")
    if unet_patch.is_unet(diffusion_model):
        name = type(diffusion_model).__name__
        problems = mismatches(unet_patch.CONTRACT, unet_patch.UNET_MODEL, diffusion_model)
        if problems:
            raise ValueError(refusal(unet_patch.CONTRACT, name, problems))
        if unet_patch.is_video_unet(diffusion_model):
            raise ValueError(f"ToMA does not support video UNets; supported: {SUPPORTED}")
        return "unet"
    family = family_of(diffusion_model)
    if family is None:
        reason = NOT_MERGED.get(type(diffusion_model).__name__)
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
    patches = ForwardPatches()
    if family == "unet":
        state = ToMAState(options, "unet", node_id, depth)
        unet_patch.patch_unet(patched, state, options.merge_scope, patches)
    else:
        from .dit_patch import patch_dit
        from .dit_reading import read_model

        reading = read_model(patched, options, family)
        state = ToMAState(options, family.name, node_id, depth, describe=reading)
        patch_dit(patched, state, reading, patches)
    state.source = weakref.ref(model)
    for kind, method in ((WrappersMP.OUTER_SAMPLE, state.outer_sample_wrapper),
                         (WrappersMP.SAMPLER_SAMPLE, state.sampler_sample_wrapper),
                         (WrappersMP.APPLY_MODEL, state.apply_model_wrapper)):
        wrapper = plain_function(method)
        wrapper.toma_state = state      # what the speed check reads: settings, the model patched
        patched.add_wrapper_with_key(kind, WRAPPER_KEY, wrapper)
    patches.install_callbacks(patched)
    return patched
