"""The quality bench's pieces that need no ComfyUI: data pipeline, latent maps, metrics, training
schedule, target checks."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from bench.quality import data as quality_data
from bench.quality import metrics as quality_metrics
from bench.quality import section as quality
from bench.quality import train


def test_train_and_held_out_photos_are_disjoint_and_licensed():
    trained = set(quality_data.train_photos())
    held = set(quality_data.HELD_OUT)
    assert trained.isdisjoint(held)
    assert trained | held == set(quality_data.all_photos())
    assert set(quality_data.LICENCES) == set(quality_data.all_photos())


@pytest.mark.parametrize("layout", ["sdxl", "flux"])
def test_latent_maps_round_trip(layout):
    g = torch.Generator().manual_seed(0)
    pixels = torch.rand(2, 3, 16, 24, generator=g) * 2 - 1
    latent = quality_data.pixels_to_model_space(pixels, layout)
    expected = (2, 4, 16, 24) if layout == "sdxl" else (2, 16, 8, 12)
    assert latent.shape == expected
    back = quality_data.model_space_to_pixels(latent, layout)
    assert torch.allclose(back, pixels, atol=1e-5)   # measured 6e-7


def test_latent_maps_flux_tokens_are_local():
    """A change of one pixel touches one latent position only (2x2 blocks, no mixing)."""
    pixels = torch.zeros(1, 3, 8, 8)
    pixels[0, 1, 5, 2] = 1.0
    latent = quality_data.pixels_to_model_space(pixels, "flux")
    touched = (latent.abs().sum(1) > 0).nonzero().tolist()
    assert touched == [[0, 2, 1]]


def test_latent_scale_is_near_unit_on_photographs():
    photo = quality_data.load_photo("astronaut")
    latent = quality_data.pixels_to_model_space(photo[None], "sdxl")
    assert 0.5 < float(latent.std()) < 1.5          # measured 1.06


def test_load_photo_short_side_and_range():
    photo = quality_data.load_photo("coffee")
    assert min(photo.shape[-2:]) == quality_data.SHORT_SIDE
    assert photo.min() >= -1 and photo.max() <= 1
    with pytest.raises(ValueError, match="unknown photograph"):
        quality_data.load_photo("nope")


def test_crops_are_seeded_and_labelled():
    photos = quality_data.PhotoSet([torch.randn(3, 40, 50), torch.randn(3, 45, 40)], [0, 1],
                                   ["a", "b"])
    a = photos.crops(6, 16, torch.Generator().manual_seed(3))
    b = photos.crops(6, 16, torch.Generator().manual_seed(3))
    c = photos.crops(6, 16, torch.Generator().manual_seed(4))
    assert a[0].shape == (6, 3, 16, 16) and a[1].shape == (6,)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    fixed, labels = photos.fixed_crops(16, 2, seed=0)
    assert fixed.shape == (4, 3, 16, 16) and labels.tolist() == [0, 0, 1, 1]


def test_psnr_ssim():
    g = torch.Generator().manual_seed(0)
    ref = (torch.rand(2, 32, 32, 3, generator=g) * 255).to(torch.uint8)
    assert quality_metrics.psnr_ssim(ref, ref) == (math.inf, 1.0)
    small = (ref.int() + torch.randint(-3, 4, ref.shape, generator=g)).clamp(0, 255).to(
        torch.uint8)
    large = (ref.int() + torch.randint(-60, 61, ref.shape, generator=g)).clamp(0, 255).to(
        torch.uint8)
    p_small, s_small = quality_metrics.psnr_ssim(ref, small)
    p_large, s_large = quality_metrics.psnr_ssim(ref, large)
    assert p_small > 35 > p_large                       # measured 40.0 and 19.4 dB
    assert s_small > s_large
    with pytest.raises(ValueError):
        quality_metrics.psnr_ssim(ref, ref.float())


def test_mmd_separates_distributions():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(600, 16, generator=g)
    same = torch.randn(600, 16, generator=g)
    shifted = torch.randn(600, 16, generator=g) + 0.5
    assert quality_metrics.mmd(x, x) == 0.0
    near = quality_metrics.mmd(x, same)
    far = quality_metrics.mmd(x, shifted)
    assert 0 < near < 0.1                               # measured 0.031
    assert far > 10 * near                              # measured 1.01
    with pytest.raises(ValueError):
        quality_metrics.mmd(x, torch.randn(5, 8))


def test_parse_phases():
    assert train.parse_phases("32:8:600,64:4:150") == [train.Phase(32, 8, 600),
                                                        train.Phase(64, 4, 150)]
    for bad in ("32:8", "30:8:10", "32:0:10", "a:b:c"):
        with pytest.raises(ValueError):
            train.parse_phases(bad)


def test_lr_schedule_warms_up_and_decays():
    peak = 1e-3
    assert train.lr_at(0, 1000, peak) == pytest.approx(peak / 100)
    assert train.lr_at(99, 1000, peak) == pytest.approx(peak)
    assert train.lr_at(999, 1000, peak) == pytest.approx(0.1 * peak, rel=1e-3)
    values = [train.lr_at(s, 1000, peak) for s in range(100, 1000)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))


def test_ema_tracks_weights():
    net = torch.nn.Linear(2, 2)
    with torch.no_grad():
        # Weights exact in float32: a random one near -0.5 ends near 0, where the float32
        # rounding of the update exceeds allclose's absolute tolerance (1e-8).
        net.weight.copy_(torch.tensor([[0.25, -0.75], [1.5, -2.0]]))
    ema = train.EMA(net, decay=0.5)
    with torch.no_grad():
        net.weight.add_(1.0)
    before = ema.shadow["weight"].clone()
    ema.update(net, step=100)
    assert torch.allclose(ema.shadow["weight"], before + 0.5)
    current = net.weight.detach().clone()
    ema.swap(net)
    assert torch.allclose(net.weight, before + 0.5)
    ema.swap(net)
    assert torch.equal(net.weight, current)


def _row(variant, method, speedup, psnr, ssim, mmd, dloss):
    return {"variant": variant, "method": method, "speedup": speedup, "psnr": psnr,
            "ssim": ssim, "mmd": mmd, "dloss": dloss}


def test_at_speed_interpolates_on_the_peer_curve():
    rows = [_row("a", "tomesd", 1.2, 30.0, 0.9, 1.0, 0.1),
            _row("b", "tomesd", 1.6, 20.0, 0.7, 3.0, 0.3)]
    value, where = quality.at_speed(rows, "tomesd", 1.5, "psnr")
    assert value == pytest.approx(22.5) and "between a" in where
    assert quality.at_speed(rows, "tomesd", 1.0, "mmd")[0] == 1.0          # peer faster
    assert quality.at_speed(rows, "tomesd", 1.65, "ssim")[0] == 0.7        # within 5%
    value, where = quality.at_speed(rows, "tomesd", 2.0, "psnr")
    assert value is None and "cannot reach" in where
    assert quality.at_speed(rows, "todo", 1.5, "psnr") == (None, "not measured")


def test_targets_compare_at_matched_speed():
    rows = [_row("unmerged", "unmerged", 1.0, math.inf, 1.0, 0.0, 0.0),
            _row("ToMA defaults", "toma", 1.6, 30.0, 0.9, 1.5, 0.05),
            _row("ToMeSD a", "tomesd", 1.2, 35.0, 0.95, 0.5, 0.01),
            _row("ToMeSD b", "tomesd", 2.0, 20.0, 0.80, 2.0, 0.10),   # at 1.6x: 27.5 dB, 1.25
            _row("ToDo 2x2", "todo", 1.3, 31.0, 0.92, 0.8, 0.02)]     # cannot reach 1.6x
    checks = {c["target"]: c for c in quality.targets(rows, "sdxl")}
    assert checks["sdxl: ToMA defaults >= 1.5x faster than unmerged"]["met"] is True
    assert checks["sdxl: ToMA psnr better than tomesd at 1.6x"]["met"] is True
    assert checks["sdxl: ToMA mmd better than tomesd at 1.6x"]["met"] is False   # 1.5 vs 1.25
    assert checks["sdxl: ToMA psnr not worse than todo at 1.6x"]["met"] == "n/a"
    assert checks["sdxl: ToMA psnr not worse than easycache"]["met"] is False    # not measured


def test_pareto_marks_dominated_rows():
    rows = [_row("a", "toma", 1.5, 30.0, 0.9, 1.0, 0.0),
            _row("b", "tomesd", 1.4, 29.0, 0.9, 1.5, 0.0),    # slower, worse: dominated
            _row("c", "todo", 1.2, 35.0, 0.9, 0.5, 0.0)]
    quality.mark_pareto(rows)
    assert [r["pareto"] for r in rows] == [True, False, True]


def test_combine_takes_median_speedups_of_the_same_configuration():
    """Runs are matched by their (deterministic) quality figures, not by name: a variant renamed
    after a default changed still pairs with its earlier measurements."""
    def run(rows):
        return {"sections": {"quality": {"rows": rows, "notes": []}}}

    def row(variant, speedup, psnr):
        return {**_row(variant, "toma", speedup, psnr, 0.9, 1.0, 0.1), "model": "sdxl"}

    old = run([row("unmerged", 1.0, math.inf), row("ToMA recompute 1", 1.5, 30.0),
               row("ToMA defaults", 1.9, 28.0)])
    new = run([row("unmerged", 1.0, math.inf), row("ToMA defaults", 1.7, 30.0),
               row("ToMA recompute 5", 2.1, 28.0)])
    for r in new["sections"]["quality"]["rows"][:1] + old["sections"]["quality"]["rows"][:1]:
        r["method"] = "unmerged"
    combined = {r["variant"]: r for r in quality.combine([old, old, new])["rows"]}
    assert combined["ToMA defaults"]["speedups"] == [1.5, 1.5, 1.7]
    assert combined["ToMA defaults"]["speedup"] == 1.5
    assert combined["ToMA recompute 5"]["speedup"] == 1.9


def test_frontier_labels_do_not_overlap():
    """12 points in a 60 x 30 pixel cluster (as the SDXL frontier's ToMA settings are): every
    label gets a box of its own, clear of every point, inside the panel."""
    from bench.quality import plots

    anchors = [(200 + 5 * (i % 4), 150 + 10 * (i // 4)) for i in range(12)]
    sizes = [(60, 10)] * 12
    bounds = (0, 0, 420, 300)
    boxes = plots.place_labels(anchors, sizes, bounds)
    points = [(x - 4, y - 4, x + 4, y + 4) for x, y in anchors]
    for i, box in enumerate(boxes):
        assert bounds[0] <= box[0] and box[2] <= bounds[2]
        assert bounds[1] <= box[1] and box[3] <= bounds[3]
        assert not any(plots._overlap(box, other) for other in boxes[:i] + boxes[i + 1:])
        assert not any(plots._overlap(box, p) for p in points)


def test_sampler_frontiers_label_every_variant_in_every_panel(tmp_path):
    """The committed image-to-image sweep of the SDXL layout, drawn: one panel per sampler and
    cfg, a label for every variant but unmerged and the noise floor (EasyCache's settings that
    skip no step, PSNR infinite, included), no two labels of a panel overlapping."""
    import json

    from bench.quality import plots

    root = Path(__file__).resolve().parents[2]
    result = json.loads((root / "bench/results/2026-12-02-cpu-quality-img2img-sdxl-matched"
                                ".json").read_text())
    rows = result["rows"]
    path = tmp_path / "sweep.png"
    panels = plots.sampler_frontiers(rows, path, "test")
    assert path.is_file()
    keys = list(dict.fromkeys((r["sampler"], r["cfg"]) for r in rows))
    assert len(panels) == len(keys) == 6
    for key, boxes in zip(keys, panels, strict=True):
        shown = [r for r in rows if (r["sampler"], r["cfg"]) == key
                 and r["method"] not in ("unmerged", "noise")]
        assert len(boxes) == len(shown) == 12
        for i, box in enumerate(boxes):
            assert not any(plots._overlap(box, other) for other in boxes[:i] + boxes[i + 1:])
    # EasyCache 0.2 with euler_ancestral equals the unmerged samples there (measured: inf dB).
    assert any(r["psnr"] == float("inf") and r["method"] == "easycache" for r in rows)


def test_sampler_sweep_targets_are_judged_per_sampler_and_cfg():
    """bench.quality.samplers.targets: the section's targets for each (fixture, sampler, cfg)
    from that group's rows alone; the noise floor is no peer."""
    from bench.quality import samplers

    def row(sampler, variant, method, speedup, psnr, accuracy):
        return {"model": "flux-matched", "sampler": sampler, "cfg": 1.0, "variant": variant,
                "method": method, "speedup": speedup, "psnr": psnr, "ssim": psnr / 100,
                "mmd": 100 / psnr, "accuracy": accuracy}

    rows = []
    for sampler, peer_psnr in (("euler / normal", 20.0), ("dpmpp_2m / karras", 30.0)):
        rows += [row(sampler, "unmerged", "unmerged", 1.0, float("inf"), 0.9),
                 row(sampler, "ToMA defaults", "toma", 1.5, 25.0, 0.9),
                 row(sampler, "ToDo 2x2", "todo", 1.6, peer_psnr, 0.9),
                 row(sampler, "noise floor", "noise", 1.0, 10.0, 0.5)]
    found = samplers.targets(rows)
    psnr = {t["sampler"]: t["met"] for t in found if "psnr not worse than todo" in t["target"]}
    assert psnr == {"euler / normal": True, "dpmpp_2m / karras": False}
    assert not any("noise" in t["target"] for t in found)
    accuracy = [t for t in found if "recognition accuracy within" in t["target"]]
    assert len(accuracy) == 2 and all(t["met"] for t in accuracy)


def test_sampler_sweep_refuses_unknown_variants_and_counts():
    from bench.quality import samplers

    with pytest.raises(ValueError, match="--only: no variants"):
        samplers.measure("flux-matched", only=("ToMA nonsense",))
    with pytest.raises(ValueError, match="--per-class must be at least 1"):
        samplers.measure("flux-matched", per_class=0)
    with pytest.raises(ValueError, match="only the matched fixtures"):
        samplers.measure("sdxl", denoise=0.5)
    with pytest.raises(ValueError, match=r"--denoise must be in \(0, 1\]"):
        samplers.measure("sdxl-matched", denoise=0.0)


def test_present_layouts_are_the_fixtures_whose_weights_are_in_models(monkeypatch,
                                                                       tmp_path) -> None:
    """--layouts present (the device run, after bench/gpu/travel.sh slim): every fixture whose
    weights file exists, in LAYOUTS' order, and the others named as left out."""
    here = quality.qm.LAYOUTS[::2]
    for layout in here:
        (tmp_path / f"toma-{layout}-fixture.safetensors").write_bytes(b"")
    monkeypatch.setattr(quality.qm, "MODELS_DIR", tmp_path)
    layouts, absent = quality.chosen_layouts("present")
    assert layouts == here and set(absent) == set(quality.qm.LAYOUTS) - set(here) != set()
    assert quality.chosen_layouts("flux,sdxl") == (("flux", "sdxl"), ())
    monkeypatch.setattr(quality.qm, "MODELS_DIR", tmp_path / "empty")
    with pytest.raises(SystemExit, match="--layouts present"):
        quality.chosen_layouts("present")                 # nothing to run: said, not skipped
