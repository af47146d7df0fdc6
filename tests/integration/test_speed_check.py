"""ToMASpeedCheck through ComfyUI's real sampler and model forward: it times the settings of the
ToMA node the model comes from, each ToMA variant merges (its run's own summary says so), the
first output it compares is the sampler's, and the connected model is left as it was.

The node inside a real server (its table as progress text) is test_server.py; the table on
the node in the browser is test_frontend.py.
"""

from __future__ import annotations

import pytest
import torch

import comfy_harness as ch
from toma_pack.nodes.apply import WRAPPER_KEY, apply_toma
from toma_pack.nodes.options import make_options
from toma_pack.nodes.speed_check import speed_check

SIZE = 64   # latent pixels: the outer level has 32x32 tokens, where "auto" levels merge


@pytest.fixture(scope="module")
def sdxl():
    model = ch.tiny_sdxl_patcher(0)
    positive, _ = ch.sdxl_conds(1, SIZE * 8, SIZE * 8)
    return model, positive, {"samples": ch.empty_latent(model, 1, SIZE, SIZE)}


def first_step(model, positive, latent) -> torch.Tensor:
    """What the node compares: one Euler step at cfg 1 from seed 0's noise."""
    import comfy.sample

    samples = latent["samples"]
    noise = comfy.sample.prepare_noise(samples, 0)
    return comfy.sample.sample(model, noise, 1, 1.0, "euler", "simple", positive, positive,
                               samples, disable_pbar=True, seed=0).float()


def wrappers(model) -> list:
    from comfy.patcher_extension import WrappersMP

    return model.get_wrappers(WrappersMP.OUTER_SAMPLE, WRAPPER_KEY)


def test_times_the_connected_settings_and_other_ratios(sdxl):
    model, positive, latent = sdxl
    toma = apply_toma(model, make_options(ratio=0.6))
    before = list(wrappers(toma))
    rows, image = speed_check(toma, positive, latent, "0.3, 0.6, 0", calls=1)

    # The connected ratio once, ratio 0 being the unmerged row.
    assert [row.label for row in rows] == ["unmerged", "ToMA 0.6 (connected)", "ToMA 0.3"]
    assert all(row.seconds > 0 for row in rows)
    for row in rows[1:]:
        assert row.stats["layers_merged"] > 0, row
        assert row.stats["ratio"] == float(row.label.split()[1]), row
        assert row.change > 0, row
    # The more it merges, the further the first output moves.
    assert rows[1].change > rows[2].change
    # The unmerged row is the model without ToMA; the connected row is ToMA at its settings.
    plain = first_step(model, positive, latent)
    merged = first_step(apply_toma(model, make_options(ratio=0.6)), positive, latent)
    change = float((merged - plain).norm() / plain.norm())
    assert rows[1].change == pytest.approx(change, rel=1e-6)
    assert wrappers(toma) == before and not wrappers(model)
    assert image.shape[0] == 1 and image.shape[-1] == 3


def test_a_model_without_toma_is_timed_at_the_defaults(sdxl):
    model, positive, latent = sdxl
    rows, _ = speed_check(model, positive, latent, "", calls=1)
    assert [row.label for row in rows] == ["unmerged", "ToMA 0.5 (defaults)"]
    assert rows[1].stats["layers_merged"] > 0


def test_two_toma_nodes_time_the_last_ones_settings_on_the_model_without_either(sdxl):
    model, positive, latent = sdxl
    twice = apply_toma(apply_toma(model, make_options(ratio=0.3)), make_options(ratio=0.7))
    rows, _ = speed_check(twice, positive, latent, "", calls=1)
    assert [row.label for row in rows] == ["unmerged", "ToMA 0.7 (connected)"]
    plain = first_step(model, positive, latent)
    assert rows[1].change == pytest.approx(float(
        (first_step(apply_toma(model, make_options(ratio=0.7)), positive, latent) - plain).norm()
        / plain.norm()), rel=1e-6)


@pytest.mark.parametrize(("ratios", "calls", "latent", "message"), [
    ("0.5, x", 1, None, "ratios"),
    ("0.5", 0, None, "calls"),
    ("0.5", 1, {"samples": None}, "latent"),
])
def test_bad_inputs_name_the_widget(sdxl, ratios, calls, latent, message):
    model, positive, good = sdxl
    with pytest.raises(ValueError, match=message):
        speed_check(model, positive, latent or good, ratios, calls)
