"""The tiny DiT family builders (tiny_models.py) on real ComfyUI, without ToMA.

Every family this ComfyUI has samples through comfy.sample (the KSampler path) with CFG, at odd
latent sizes and an odd frame count, and gives finite output of the latent's shape. A family it
lacks is not skipped: the test asserts that its classes are absent here instead.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from tiny_models import (
    FAMILIES,
    available,
    diffusion_model_class,
    family,
    in_tree,
    inputs,
    tiny_patcher,
)

from comfy_harness import comfy_version, sample

# (batch, latent height, latent width, latent frames): odd sizes, an odd frame count.
ODD_VIDEO = (2, 7, 9, 3)
ODD_IMAGE = (2, 7, 9, 1)
# HunyuanVideo 1.0's patch is 2x2 and ComfyUI itself needs even latent sizes for it (its
# unpatchify floors H/2, W/2 while the patch embedding pads: the reshape fails at 7x9): even,
# non-square, odd frame count.
EVEN_VIDEO = (2, 6, 10, 3)
SIZES = {"hunyuan_video": EVEN_VIDEO, "hunyuan_video_i2v": EVEN_VIDEO,
         "hunyuan_video_i2v_v2": EVEN_VIDEO}


def assert_absent(name: str) -> None:
    """The family's config class is missing from this ComfyUI, and building it says so."""
    import comfy.supported_models

    assert not hasattr(comfy.supported_models, family(name).config)
    with pytest.raises(ValueError, match="has no"):
        tiny_patcher(name)


def sample_args(name: str) -> tuple[tuple[int, int, int, int], float]:
    """((batch, height, width, frames), cfg) for the family."""
    size = SIZES.get(name, ODD_VIDEO if family(name).video else ODD_IMAGE)
    if name == "hunyuan_video_i2v_v2" and comfy_version() < (0, 33):
        # guiding_frame_index: in v0.3.64 and v0.8.0 ComfyUI's apply_mod multiplies [B, n, C] by
        # [B, C] (flux/layers.py), which only broadcasts for one item per model call.
        return (1, *size[1:]), 1.0
    return size, 2.0


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_presence_follows_the_tree(name: str, comfyui_path) -> None:
    present = available(name)
    assert present == in_tree(name, comfyui_path)
    if not present:
        assert_absent(name)
        return
    module, cls = family(name).model_class
    assert hasattr(importlib.import_module(module), cls)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_samples_finite_output_of_the_latent_shape(name: str) -> None:
    if not available(name):
        assert_absent(name)
        return
    patcher = tiny_patcher(name)
    assert isinstance(patcher.model.diffusion_model, diffusion_model_class(name))
    (batch, height, width, frames), cfg = sample_args(name)
    x = inputs(name, patcher, batch, height, width, frames)
    out = sample(patcher, x.latent, x.positive, x.negative, steps=2, cfg=cfg,
                 noise_mask=x.noise_mask)
    assert out.shape == x.latent.shape
    assert torch.isfinite(out).all()
    # The model ran: a sample, not the empty latent (mean |out| measured 0.87-4.5 over the
    # families on the three versions).
    assert out.abs().mean() > 0.5
    if x.noise_mask is not None:
        # The start frame is kept (noise mask 0), the rest is generated.
        torch.testing.assert_close(out[:, :, :1], x.latent[:, :, :1])
        assert not torch.allclose(out[:, :, 1:], x.latent[:, :, 1:])


def test_builders_are_deterministic() -> None:
    name = "wan22_5b" if available("wan22_5b") else "wan21_t2v"
    a, b = tiny_patcher(name, seed=3), tiny_patcher(name, seed=3)
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    for key, value in sa.items():
        assert torch.equal(value, sb[key]), key
