"""The block benches (bench sections flux and dit) drive ToMA's block patch the way the node
does, on ComfyUI's own blocks: here at tiny widths, one call of every variant, so that a change
of the patch's interfaces cannot leave the benches behind unseen (their full runs take many
minutes and no other test makes them)."""

from __future__ import annotations

import pytest
import torch

from bench.speed import dit_families, dit_toma, flux_blocks


@pytest.fixture
def tiny_flux(monkeypatch):
    """Flux blocks at width 256 (2 heads of 128, RoPE axes 16 + 56 + 56), 8x8 image tokens."""
    for name, value in (("HIDDEN", 256), ("HEADS", 2), ("GRID", 8), ("TEXT", 8)):
        monkeypatch.setattr(flux_blocks, name, value)
    return flux_blocks.make_blocks(), flux_blocks.make_inputs()


@pytest.mark.parametrize("kind", ["double", "single"])
def test_flux_block_variants_run_merged(tiny_flux, kind):
    (double, single), inputs = tiny_flux
    variants, builds = flux_blocks._variants(kind, double if kind == "double" else single,
                                             inputs)
    with torch.inference_mode():
        outputs = {flux_blocks._key(row): fn() for row, fn in variants}
        plain = flux_blocks._image_out(kind, outputs[f"{kind} plain None"])
        for row, _ in variants:
            if row["variant"].startswith("toma"):
                out = flux_blocks._image_out(kind, outputs[flux_blocks._key(row)])
                assert out.shape == plain.shape and torch.isfinite(out).all()
                assert not torch.equal(out, plain)          # merged, not passed through
                assert row["image_tokens"] < inputs["img"].shape[1]
    assert len(builds) == (4 if kind == "double" else 2)


def _wan():
    return dit_families.wan_case("wan14b", 256, 512, 1, dit_families.Size(256, 256, 5), text=8)


def _krea2():
    # 2 query heads and 1 key/value head of 128; the 12-layer text stack at 2 layers of 64
    return dit_families.krea2_case("krea2", dit_families.Size(256, 256), text=8, features=256,
                                   heads=2, kvheads=1, txtdim=64, txtlayers=2)


@pytest.mark.parametrize("build", [pytest.param(_wan, id="wan14b"), pytest.param(
    _krea2, id="krea2", marks=pytest.mark.newest_tree)])     # Krea 2 came with ComfyUI 0.33
def test_dit_block_hook_runs_merged(build):
    case = build()
    merged = dit_toma.hook(case.family, case, 0.5)
    with torch.inference_mode():
        plain = case.image_out(case.original_block(case.args()))
        out = case.image_out(merged(case.args()))
    assert out.shape == plain.shape and torch.isfinite(out).all()
    assert not torch.equal(out, plain)
    assert merged.merged_tokens < case.image_tokens
