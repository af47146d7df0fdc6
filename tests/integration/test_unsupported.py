"""Models ToMA cannot patch get an error naming the model and what is supported, at every
ratio (0 included), never a silent no-op: one rule for every model. A model of a family whose
contract the running ComfyUI fails (nodes/contracts.py) gets one naming the family, what
changed and the ComfyUI version, and only that family's models do."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_models import tiny_hunyuan3d

import comfy_harness as ch
from toma_pack.nodes.toma_node import patch_model


def _patcher(config):
    import comfy.model_patcher

    config.set_inference_dtype(torch.float32, None)
    return comfy.model_patcher.ModelPatcher(config.get_model({}, device=ch.CPU), ch.CPU, ch.CPU)


def tiny_wan_s2v():
    """Wan 2.2 S2V (WanModel_S2V): timestep rows spread over video, reference and motion
    tokens by position."""
    import comfy.supported_models
    import tiny_models

    config = tiny_models.family("wan21_t2v").unet_config()
    return _patcher(comfy.supported_models.WAN22_S2V({**config, "model_type": "s2v"}))


def tiny_wan_animate2():
    """Wan Animate 2 (WanAnimate2Model, ComfyUI 0.33 and later): self-attention split frame by
    frame against the pose branch."""
    import comfy.supported_models
    import tiny_models

    config = tiny_models.family("wan21_t2v").unet_config()
    return _patcher(comfy.supported_models.WAN_Animate2(
        {**config, "model_type": "animate2", "in_dim": 36}))


def tiny_wan_humo():
    """HuMo (HumoWanModel): an audio cross-attention over equal per-frame parts."""
    import comfy.supported_models
    import tiny_models

    config = tiny_models.family("wan21_t2v").unet_config()
    return _patcher(comfy.supported_models.WAN21_HuMo({**config, "model_type": "humo"}))


def tiny_svd():
    """Stable Video Diffusion: ComfyUI's UNet with temporal layers."""
    import comfy.supported_models

    unet = {**ch.SDXL_UNET_CONFIG, "in_channels": 8, "adm_in_channels": 768,
            "use_temporal_attention": True, "use_temporal_resblock": True,
            "extra_ff_mix_layer": True, "use_spatial_context": True,
            "merge_strategy": "learned_with_images", "merge_factor": 0.0,
            "video_kernel_size": [3, 1, 1], "disable_temporal_crossattention": False,
            "max_ddpm_temb_period": 10000}
    config = comfy.supported_models.SVD_img2vid(unet)
    config.unet_config["num_head_channels"] = 16
    config.unet_config["num_heads"] = -1
    return _patcher(config)


MODELS = {"wan_animate2": (tiny_wan_animate2, "WanAnimate2Model"),
          "wan_s2v": (tiny_wan_s2v, "WanModel_S2V"), "wan_humo": (tiny_wan_humo, "HumoWanModel"),
          "hunyuan3d": (tiny_hunyuan3d, "Hunyuan3Dv2"), "svd": (tiny_svd, "video UNet")}
# What the error says about why (models ToMA knows and leaves alone).
REASONS = {"wan_animate2": "frame by frame", "wan_s2v": "timestep rows",
           "wan_humo": "appends a reference frame"}
# Models that only newer ComfyUI versions have: the class ComfyUI's config would be.
NEWER = {"wan_animate2": "WAN_Animate2"}


@pytest.mark.parametrize("ratio", [0.5, 0.0])
@pytest.mark.parametrize("name", list(MODELS))
def test_unsupported_models_are_refused_at_every_ratio(comfyui_path, name, ratio):
    build, named = MODELS[name]
    if name in NEWER:
        import comfy.supported_models

        if not hasattr(comfy.supported_models, NEWER[name]):
            assert ch.comfy_version() < (0, 33, 0), f"{NEWER[name]} missing"
            return
    with pytest.raises(ValueError, match="supported: SDXL") as error:
        patch_model(build(), ratio, 0, "d0-4, s0-4", 5)
    assert named.upper() in str(error.value).upper()
    if name in REASONS:
        assert REASONS[name] in str(error.value)


@pytest.mark.parametrize("ratio", [0.5, 0.0])
def test_a_family_this_comfyui_fails_is_refused_alone(comfyui_path, monkeypatch, ratio):
    """A family whose contract the running ComfyUI fails (here: Wan's block loop asked for an
    argument it does not hand) refuses its models at every ratio, naming the family, what is
    missing and the ComfyUI version; models of other families still patch."""
    import tiny_models

    from toma_pack.nodes.contracts import Hands
    from toma_pack.nodes.families import wan

    missing = Hands(wan.WAN, "double_block", ("frame_rows",))
    monkeypatch.setattr(wan, "CONTRACT", dataclasses.replace(
        wan.CONTRACT, needs=(*wan.CONTRACT.needs, missing)))
    with pytest.raises(ValueError, match="ToMA cannot patch WanModel models") as error:
        patch_model(tiny_models.tiny_patcher("wan21_t2v"), ratio, 0, "none", 1)
    message = str(error.value)
    assert f"ComfyUI {ch.comfy_version_string()}" in message
    assert "Wan support" in message
    assert "comfy.ldm.wan.model.WanModel hands double_block patches no 'frame_rows'" in message
    patch_model(ch.tiny_flux_patcher(), ratio, 0, "none", 1)
    patch_model(ch.tiny_sdxl_patcher(), ratio, 0, "none", 1)


def test_a_moved_class_refuses_only_its_models(comfyui_path, monkeypatch):
    """A model class the contract names where it no longer imports (Chroma, said to have
    moved): models of that class (matched by name) are refused with the import's failure;
    the family's other class (Flux) still patches."""
    import tiny_models

    from toma_pack.nodes.families import flux

    moved = "comfy.ldm.chroma.moved_model:Chroma"
    models = {moved if path == flux.CHROMA else path: needs
              for path, needs in flux.CONTRACT.models.items()}
    monkeypatch.setattr(flux, "CONTRACT", dataclasses.replace(flux.CONTRACT, models=models))
    with pytest.raises(ValueError, match="ToMA cannot patch Chroma models") as error:
        patch_model(tiny_models.tiny_patcher("chroma"), 0.5, 0, "none", 1)
    assert "comfy.ldm.chroma.moved_model does not import" in str(error.value)
    patch_model(ch.tiny_flux_patcher(), 0.5, 0, "none", 1)


def test_a_model_its_family_cannot_read_is_refused(comfyui_path, monkeypatch):
    """A model of a family's class that its family cannot read (an attribute it reads is
    gone) is refused with what failed, not with a traceback."""
    from toma_pack.nodes.families import flux

    model = ch.tiny_flux_patcher()
    del model.model.diffusion_model.patch_size
    with pytest.raises(ValueError, match="ToMA cannot patch Flux models") as error:
        patch_model(model, 0.5, 0, "none", 1)
    assert "patch_size" in str(error.value)
    assert flux.CONTRACT.label in str(error.value)
