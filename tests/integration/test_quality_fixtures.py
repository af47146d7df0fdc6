"""The committed quality fixtures (models/*.safetensors) on real ComfyUI: they load into this
version's own classes, they denoise photographs they never saw far better than an untrained
model, the sampler route of the quality bench computes the training objective, and the quality
section runs end to end (small size)."""

from __future__ import annotations

import pytest
import torch

import comfy_harness as ch
from bench.quality import data as quality_data
from bench.quality import models as quality_models
from bench.quality import section as quality
from bench.quality import train
from bench.shared.config import BenchConfig

# Lab code: runs with the newest ComfyUI tree only (tests/pytest.ini).
pytestmark = pytest.mark.newest_tree

# Small sizes keep this quick: SDXL 64x64 latent (one attention level of 1024 tokens, the
# smallest that ToMA's auto levels and the peers merge), Flux 32x32 latent (256 image tokens);
# the matched fixtures at 16x16 (SDXL levels of 64 and 16 tokens, which their section's
# variants merge; Flux 64 image tokens), one scene image per class.
SIDE = {"sdxl": 64, "flux": 32, "sdxl-matched": 16, "flux-matched": 16}


@pytest.fixture(scope="module", params=quality_models.LAYOUTS)
def layout(request):
    ch.ensure_comfy()
    yield request.param
    ch.unload_models()


@pytest.fixture(autouse=True)
def one_scene_per_class(monkeypatch):
    monkeypatch.setattr(quality, "SCENES_PER_CLASS", 1)


def _held_out(layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    photos = quality_data.load_set(quality_data.HELD_OUT[:1], labelled=False)
    return train.held_out_batch(layout, photos, SIDE[layout], seed=0)


def test_fixture_loads_into_comfy_classes(layout):
    fixture = quality_models.load(layout)
    import comfy.model_base

    expected = (comfy.model_base.SDXL if quality_models.arch(layout) == "sdxl"
                else comfy.model_base.Flux)
    assert type(fixture.model) is expected
    assert fixture.tables["context"].shape[0] == len(train.class_names(layout)) + 1
    assert fixture.meta["classes"] == train.class_names(layout)


def test_fixture_metadata_counts_every_training_step(layout):
    """The file's `steps` is every step behind its weights (continued runs' earlier steps
    included: the training log's runs), `run_steps` the last run's."""
    import json

    fixture = quality_models.load(layout)
    record = json.loads(quality_models.weights_path(layout).with_suffix(".json").read_text())
    runs = quality_models.training_runs(record)
    if layout not in quality_models.MATCHED:
        assert len(runs) > 1      # the first fixtures were trained in several runs
    assert fixture.meta["steps"] == sum(run["steps_done"] for run in runs)
    assert fixture.meta["run_steps"] == runs[-1]["steps_done"]


def test_comfyui_loader_cannot_detect_the_fixtures(layout):
    """What the model card says: ComfyUI's own diffusion-model loader refuses these layouts
    (load them with the pack's bench.quality.models.load)."""
    import comfy.sd

    with pytest.raises(RuntimeError, match="Could not detect model type"):
        comfy.sd.load_diffusion_model(str(quality_models.weights_path(layout)))


def test_trained_denoises_far_better_than_untrained(layout):
    x0, labels = _held_out(layout)
    trained = quality_models.load(layout)
    untrained = quality_models.build(layout, len(train.class_names(layout)), seed=0)
    good = sum(train.held_out_loss(trained, x0, labels, seed=0))
    bad = sum(train.held_out_loss(untrained, x0, labels, seed=0))
    assert good < 0.5 * bad, (good, bad)


def test_a_training_step_reaches_every_weight(layout):
    """bench.quality.train's batch loss through this ComfyUI's classes sends a gradient to every
    weight of the model (ComfyUI 0.33 makes parameters without requires_grad: training from
    the committed weights raised at its first backward there)."""
    fixture = quality_models.load(layout)
    net = train.trainable(fixture)
    x0, labels = _held_out(layout)
    x0, labels = x0[:2], labels[:2]
    sigma = torch.full((2,), float(train.held_out_sigmas(fixture)[1]))
    train.batch_loss(fixture, x0, labels, sigma, torch.randn_like(x0)).backward()
    assert [n for n, p in net.named_parameters() if p.grad is None] == []


def test_sampler_route_matches_training_objective(layout):
    """quality.denoising_losses (comfy.sample.sample_custom, one euler step) equals the
    training loss through BaseModel.apply_model on the unpatched model."""
    fixture = quality_models.load(layout)
    x0, labels = _held_out(layout)
    x0, labels = x0[:2], labels[:2]
    ho = quality.HeldOut(x0, labels, [float(s) for s in train.held_out_sigmas(fixture)][1:3],
                         torch.randn(x0.shape, generator=torch.Generator().manual_seed(1)))
    with torch.inference_mode():
        via_sampler = quality.denoising_losses(fixture.patcher(), fixture, ho)
        direct = [float(quality_models.denoising_loss(
            fixture, x0, labels, torch.full((len(x0),), s), ho.noise).mean()) for s in ho.sigmas]
    assert via_sampler == pytest.approx(direct, rel=1e-3)


def test_quality_section_runs(layout, tmp_path):
    cfg = BenchConfig(torch.device("cpu"), torch.float32, quick=True, comfy=True)
    result = quality.measure(layout, cfg, quick=True, reps=1, side=SIDE[layout])
    rows = {r["variant"]: r for r in result["rows"]}
    assert rows["unmerged"]["psnr"] == float("inf") and rows["unmerged"]["dloss"] == 0
    assert {"ToMA defaults", "ToDo 2x2", "ToMeSD attention r0.5", "EasyCache 0.5"} <= set(rows)
    for name in ("ToMA defaults", "ToDo 2x2", "ToMeSD attention r0.5"):
        assert 10 < rows[name]["psnr"] < 80, name        # changed the samples, not to noise
        assert rows[name]["mmd"] > 0 and rows[name]["dloss"] is not None
    assert rows["EasyCache 0.5"]["dloss"] is None           # one step: nothing to cache
    assert all(r["s"] > 0 for r in rows.values())
    found = quality.targets(result["rows"], layout)
    # the speed target first (the first fixtures), the recognition accuracy one (the matched
    # fixtures), then every metric against ToMeSD, ToDo and EasyCache (EasyCache's held-out loss
    # is not applicable to a one-step run): each judged from this run's rows
    scenes = layout in quality_models.MATCHED
    assert (rows["ToMA defaults"]["accuracy"] is not None) == scenes
    metrics = len(quality.BETTER) - (0 if scenes else 1)
    head = (layout in quality.TARGET_SPEEDUP) + scenes
    assert len(found) == head + 3 * metrics - 1
    speed = rows["ToMA defaults"]["speedup"]
    if layout in quality.TARGET_SPEEDUP:
        assert found[0]["met"] == (speed >= quality.TARGET_SPEEDUP[layout])
    assert all(t["met"] in (True, False, "n/a") for t in found)
    for t in found[head:]:
        metric = t["target"].split("ToMA ")[1].split(" ")[0]
        ours = rows["ToMA defaults"][metric]
        assert t["value"].startswith(f"{quality._finite(ours) if metric == 'psnr' else ours:.4g}")


def test_sampler_rows_and_noise_floor(layout, monkeypatch):
    """bench.quality.samplers at a small size, one sampler that adds noise of its own
    (euler_ancestral) and one cfg: every variant gets a row, unmerged is its own reference, the
    noise floor moves the samples, and its noise restarts per sampling call (the same samples
    twice)."""
    from bench.quality import samplers

    monkeypatch.setattr(samplers, "SAMPLERS", (("euler_ancestral", "normal"),))
    monkeypatch.setattr(samplers, "CFGS", (1.0,))
    rows = {row["variant"]: row for row in samplers.measure(layout, side=SIDE[layout])}
    assert rows["unmerged"]["psnr"] == float("inf")
    floor = next(row for row in rows.values() if row["method"] == "noise")
    assert 10 < floor["psnr"] < 60
    assert {"ToMA defaults", *samplers.TOMA_VARIANTS} <= set(rows)
    fixture = quality_models.load(layout)
    noisy, restart = samplers.noisy(fixture.patcher(), samplers.NOISE_LEVEL)
    labels = torch.tensor(quality.LABELS[:1])
    with torch.inference_mode():
        first = quality.sample(noisy, fixture, labels, SIDE[layout], steps=2)
        restart()
        again = quality.sample(noisy, fixture, labels, SIDE[layout], steps=2)
    assert torch.equal(first, again)


@pytest.mark.parametrize("layout", quality_models.MATCHED)
def test_image_to_image_samples_start_from_the_given_scenes(layout):
    """bench.quality.samplers --denoise: each sample starts from its class's rendered scene, as
    KSampler does with a latent image: a little denoise keeps the scene, and another scene
    gives another sample."""
    from bench.quality import samplers

    ch.ensure_comfy()
    fixture = quality_models.load(layout)
    side = SIDE[layout]
    labels = quality.eval_labels(layout, 1)[:2]
    start = samplers.source_scenes(layout, side, labels)
    with torch.inference_mode():
        kept = quality.sample(fixture.patcher(), fixture, labels, side, steps=2, start=start,
                              denoise=0.1)
        other = quality.sample(fixture.patcher(), fixture, labels, side, steps=2,
                               start=start.flip(0), denoise=0.1)
        fresh = quality.sample(fixture.patcher(), fixture, labels, side, steps=2)
    near = float((kept - start).norm() / start.norm())
    # measured (v0.33.0): 0.056 (sdxl-matched) and 0.084 (flux-matched) of a fresh sample's
    # distance from the scene
    assert near < 0.15 * float((fresh - start).norm() / start.norm())
    assert not torch.allclose(kept, other)
