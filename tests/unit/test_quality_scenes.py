"""The rendered training scenes of the matched quality fixtures (bench/quality/scenes.py) and
the recogniser that reads their class back (bench/quality/recognise.py)."""

from __future__ import annotations

import pytest
import torch

from bench.quality import recognise, scenes

pytestmark = pytest.mark.skipif(bool(scenes.missing_sources()), reason="fonts-dejavu-core "
                                "missing: bash scripts/setup.sh installs it")


@pytest.mark.parametrize("side", [48, 56, 64])
def test_every_class_renders(side):
    x, labels = scenes.fixed_set(side, 1, seed=3)
    assert x.shape == (len(scenes.CLASSES), 3, side, side)
    assert labels.tolist() == list(range(len(scenes.CLASSES)))
    assert x.min() >= -1 and x.max() <= 1
    # a hard-edged object on a smooth background: some neighbouring pixels differ a lot
    steps = (x[..., 1:] - x[..., :-1]).abs().amax(dim=(1, 2, 3))
    assert (steps > 0.3).all()


def test_scenes_are_deterministic_per_stream_and_index():
    a = scenes.render(7, 56, seed=1, index=4)
    assert torch.equal(a, scenes.render(7, 56, seed=1, index=4))
    assert not torch.equal(a, scenes.render(7, 56, seed=1, index=5))
    assert not torch.equal(a, scenes.render(7, 56, seed=2, index=4))


def test_classes_differ_in_shape_not_only_in_colour():
    """The same stream position (same colours, placement, distractor) with another class."""
    a, b = scenes.render(0, 56, 0, 0), scenes.render(1, 56, 0, 0)
    assert (a - b).abs().amax() > 0.5


def test_unknown_class_is_refused():
    with pytest.raises(ValueError, match="class_id"):
        scenes.render(len(scenes.CLASSES), 48, 0, 0)


def test_recogniser_reads_any_fixture_size():
    model = recognise.Recogniser()
    float_images = torch.rand(2, 3, 64, 64) * 2 - 1
    uint8_images = torch.randint(0, 256, (2, 56, 56, 3), dtype=torch.uint8)
    for images in (float_images, uint8_images):
        assert recognise.prepare(images).shape == (2, 3, recognise.SIDE, recognise.SIDE)
        assert recognise.predict(model, images).shape == (2,)


def test_committed_recogniser_reads_renders_it_never_saw():
    """The committed recogniser (models/toma-scene-recogniser.safetensors: 1200 steps, 100% on
    its 600 held-out renders, clean and augmented) on 48 renders from a stream neither its
    training nor its held-out set used, at every fixture size: at least 46 right."""
    import json

    from safetensors import safe_open

    with safe_open(str(recognise.WEIGHTS), framework="pt") as f:
        meta = {k: json.loads(v) for k, v in f.metadata().items()}
    assert meta["held_out_accuracy"] >= 0.98 and meta["classes"] == list(scenes.CLASSES)
    model = recognise.load()
    for side in (48, 56, 64):
        x, labels = scenes.fixed_set(side, 4, seed=7000 + side)
        assert recognise.accuracy(model, x, labels) >= 46 / 48
