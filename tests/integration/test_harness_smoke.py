"""The harness itself on real ComfyUI: tiny SDXL and Flux sample, deterministically, on both
attention backends, and hand patches what the ToMA patches rely on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from comfy_harness import (
    attention_backend,
    comfy_version,
    current_attention,
    empty_latent,
    flux_conds,
    record_attention_calls,
    sample,
    sdxl_conds,
    tiny_flux_patcher,
    tiny_sdxl_patcher,
)

BACKEND_FUNCTION = {"sub_quadratic": "attention_sub_quad", "sdpa": "attention_pytorch"}
SDXL_SHAPES = [(1, 16, 16), (2, 16, 16), (1, 12, 20)]  # (batch, latent h, latent w)
FLUX_SHAPES = [(1, 16, 16), (2, 16, 16), (1, 12, 20)]
FLUX_TEXT = 8


def run_sdxl(batch: int, h: int, w: int, seed: int = 0, patcher: Any = None) -> torch.Tensor:
    patcher = patcher or tiny_sdxl_patcher()
    positive, negative = sdxl_conds(batch, w * 8, h * 8)
    return sample(patcher, empty_latent(patcher, batch, h, w), positive, negative, seed=seed)


def run_flux(batch: int, h: int, w: int, seed: int = 0, patcher: Any = None) -> torch.Tensor:
    patcher = patcher or tiny_flux_patcher()
    positive, negative = flux_conds(batch, FLUX_TEXT)
    latent = empty_latent(patcher, batch, h, w)
    return sample(patcher, latent, positive, negative, cfg=1.0, scheduler="simple", seed=seed)


def assert_sane(out: torch.Tensor, shape: tuple[int, ...]) -> None:
    assert out.shape == shape
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert out.std() > 0.1  # the model and noise reached the output
    assert out.abs().max() < 1e4  # random weights stay tame


def test_comfy_is_the_checkout_under_test(comfyui_path: Path) -> None:
    import comfy.ldm.modules.attention
    import comfy.model_management

    assert Path(comfy.ldm.modules.attention.__file__).resolve().is_relative_to(comfyui_path)
    assert comfy.model_management.cpu_state == comfy.model_management.CPUState.CPU
    assert current_attention() == "attention_sub_quad"  # ComfyUI's CPU default


@pytest.mark.parametrize(("batch", "h", "w"), SDXL_SHAPES)
def test_sdxl_samples_finite_and_deterministic(batch: int, h: int, w: int) -> None:
    patcher = tiny_sdxl_patcher()
    first = run_sdxl(batch, h, w, patcher=patcher)
    assert_sane(first, (batch, 4, h, w))
    assert torch.equal(first, run_sdxl(batch, h, w, patcher=patcher))
    assert torch.equal(first, run_sdxl(batch, h, w))  # a fresh model: same seeded weights
    assert not torch.equal(first, run_sdxl(batch, h, w, seed=1))


@pytest.mark.parametrize(("batch", "h", "w"), FLUX_SHAPES)
def test_flux_samples_finite_and_deterministic(batch: int, h: int, w: int) -> None:
    patcher = tiny_flux_patcher()
    first = run_flux(batch, h, w, patcher=patcher)
    assert_sane(first, (batch, 16, h, w))
    assert torch.equal(first, run_flux(batch, h, w, patcher=patcher))
    assert torch.equal(first, run_flux(batch, h, w))
    assert not torch.equal(first, run_flux(batch, h, w, seed=1))


@pytest.mark.parametrize("model", ["sdxl", "flux"])
def test_attention_backend_is_used(attention: str, model: str) -> None:
    make, run = (tiny_sdxl_patcher, run_sdxl) if model == "sdxl" else (tiny_flux_patcher, run_flux)
    patcher = make()
    calls = record_attention_calls(patcher)
    out = run(2, 16, 16, patcher=patcher)
    assert torch.isfinite(out).all()
    assert calls and set(calls) == {BACKEND_FUNCTION[attention]}


@pytest.mark.parametrize("run", [run_sdxl, run_flux], ids=["sdxl", "flux"])
def test_backends_agree(run: Any) -> None:
    with attention_backend("sub_quadratic"):
        reference = run(2, 16, 16)
    with attention_backend("sdpa"):
        out = run(2, 16, 16)
    torch.testing.assert_close(out, reference, rtol=1e-3, atol=1e-3)


def test_attention_backend_restores_every_binding() -> None:
    import comfy.ldm.flux.math
    import comfy.ldm.modules.attention as attention

    before = (attention.optimized_attention, comfy.ldm.flux.math.optimized_attention)
    with attention_backend("sdpa"):
        assert current_attention() == "attention_pytorch"
        assert comfy.ldm.flux.math.optimized_attention is attention.attention_pytorch
        assert attention.optimized_attention_masked is attention.attention_pytorch
    assert (attention.optimized_attention, comfy.ldm.flux.math.optimized_attention) == before


def test_sdxl_attn1_patch_sees_the_token_grid() -> None:
    """What ToMA's UNet patch relies on: n is [B, h*w, C] of activations_shape's grid, and the
    batch chunks, sigmas and block position are in extra_options (all three versions)."""
    seen: list[dict[str, Any]] = []

    def attn1(n: torch.Tensor, context: torch.Tensor, value: torch.Tensor,
              extra: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        seen.append({"tokens": n.shape[1], **extra})
        return n, context, value

    patcher = tiny_sdxl_patcher().clone()
    patcher.set_model_attn1_patch(attn1)
    run_sdxl(2, 12, 20, patcher=patcher)
    for call in seen:
        b, _, h, w = call["activations_shape"]
        assert call["tokens"] == h * w and b == 4  # cond and uncond of 2 images
        assert call["original_shape"] == [4, 4, 12, 20]
        assert sorted(call["cond_or_uncond"]) == [0, 1]
        # sigmas: one per latent image, not per chunk; sample_sigmas: the schedule (4 steps)
        assert call["sigmas"].shape == (2,) and call["sample_sigmas"].shape == (5,)
        assert call["block"][0] in ("input", "middle", "output")
    grids = {tuple(call["activations_shape"][2:]) for call in seen}
    assert grids == {(6, 10), (3, 5)}  # attention at 1/2 and 1/4 of the latent, as in SDXL


def test_flux_block_replace_args() -> None:
    keys: dict[str, set[str]] = {}

    def recorder(kind: str) -> Any:
        def patch(args: dict[str, Any], extra: dict[str, Any]) -> dict[str, torch.Tensor]:
            keys[kind] = set(args)
            return extra["original_block"](args)

        return patch

    patcher = tiny_flux_patcher().clone()
    patcher.set_model_patch_replace(recorder("double"), "dit", "double_block", 0)
    patcher.set_model_patch_replace(recorder("single"), "dit", "single_block", 1)
    run_flux(1, 16, 16, patcher=patcher)
    common = {"img", "vec", "pe", "attn_mask", "transformer_options"}
    assert keys == {"double": common | {"txt"}, "single": common}


def test_flux_blocks_call_attn1_patches_only_from_0_17() -> None:
    """Flux calls attn1 patches as p(q, k, v, pe=, attn_mask=, extra_options=) since 0.17."""
    calls: list[dict[str, Any]] = []

    def attn1(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> dict:
        calls.append({"q": tuple(q.shape), **kwargs["extra_options"]})
        return {}

    patcher = tiny_flux_patcher().clone()
    patcher.set_model_attn1_patch(attn1)
    run_flux(1, 16, 16, patcher=patcher)
    if comfy_version() < (0, 17):
        assert calls == []
        return
    assert len(calls) == 4 * 4  # 2 double + 2 single blocks, 4 steps
    text, image = FLUX_TEXT, 8 * 8
    assert {c["q"] for c in calls} == {(1, 4, text + image, 16)}
    assert {tuple(c["img_slice"]) for c in calls} == {(text, text + image)}
