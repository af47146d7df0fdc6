"""ToMA beside ComfyUI's own HiDream-O1 Patch Seam Smoothing node (ComfyUI 0.33 and later).

That node wraps the diffusion model (a DIFFUSION_MODEL wrapper) and, inside one model call,
runs the model again on pixels rolled by part of a 32-pixel patch, then blends the rolled-back
outputs. ToMA decides each model call in its APPLY_MODEL wrapper, which ComfyUI runs outside
every DIFFUSION_MODEL wrapper, so the extra passes belong to the same model call: each runs
through merged blocks, on plans of its own built from its own (rolled) tokens. The node's real
execute() builds the wrapper; samples come from ComfyUI's sampler.
"""

from __future__ import annotations

import pytest
import torch
from test_tiny_models import assert_absent, sample_args
from tiny_models import available, inputs, tiny_patcher

import comfy_harness as ch
from toma_pack.nodes import run_state
from toma_pack.nodes.apply import apply_toma
from toma_pack.nodes.options import make_options

NAME = "hidream_o1"
RUN = {"steps": 2}
# (pattern, passes, blend): the node's defaults (the natural grid and one pass rolled by
# (16, 16)); the example workflow's (2 passes, then 4 in the last steps); and every pass off the
# natural grid (the model call's own pass unused), 2, 4 then 8 passes
SMOOTHING = {"default": ("single_shift", "2", "average"),
             "example": ("single_shift", "ramp_2_4", "median"),
             "symmetric": ("symmetric", "ramp_2_4_8", "window")}


def seam_smoothing(model, setting: str = "default"):
    """The model through HiDreamO1PatchSeamSmoothing, on at every step of the run."""
    from comfy_extras.nodes_hidream_o1 import HiDreamO1PatchSeamSmoothing

    pattern, passes, blend = SMOOTHING[setting]
    out = HiDreamO1PatchSeamSmoothing.execute(
        model=model, start_percent=0.0, end_percent=1.0, pattern=pattern, passes=passes,
        blend=blend, strength=1.0)
    return out.args[0]


def length_patches(model, seen: list[int]) -> None:
    """A "dit" replace patch on every decoder layer that records the sequence length it is
    handed and runs the layer: installed before ToMA, so ToMA wraps it and it sees what
    reaches ComfyUI's layer (the merged sequence in a merged layer)."""
    layers = len(model.model.diffusion_model.language_model.layers)

    def patch(args: dict, extra: dict) -> dict:
        seen.append(args["x"].shape[1])
        return extra["original_block"](args)

    for i in range(layers):
        model.set_model_patch_replace(patch, "dit", "double_block", i)


def setup(steps: int = RUN["steps"]):
    model = tiny_patcher(NAME)
    (batch, height, width, frames), cfg = sample_args(NAME)
    x = inputs(NAME, model, batch, height, width, frames)
    return model, x, {"steps": steps, "cfg": cfg}


def both_orders(model, options, setting: str = "default"):
    """(ToMA then seam smoothing, seam smoothing then ToMA) on `model`."""
    return (seam_smoothing(apply_toma(model, options), setting),
            apply_toma(seam_smoothing(model, setting), options))


@pytest.mark.parametrize("order", (0, 1), ids=("toma_first", "smoothing_first"))
def test_inactive_toma_beside_seam_smoothing_is_bit_identical(order, monkeypatch):
    """Every ToMA patch installed and running, merging outside the active steps: the samples
    are seam smoothing's alone, bit for bit, in either node order."""
    if not available(NAME):
        return assert_absent(NAME)
    model, x, run = setup()
    base = ch.sample(seam_smoothing(model), x.latent, x.positive, x.negative, **run)
    sent: list[dict] = []
    monkeypatch.setattr(run_state, "send_stats", lambda node, stats: sent.append(stats))
    patched = both_orders(model, make_options(0.5, skip_blocks="none", start_percent=0.9,
                                                     end_percent=0.95))
    out = ch.sample(patched[order], x.latent, x.positive, x.negative, **run)
    assert torch.equal(out, base)
    assert sent[-1]["layers_total"] > 0 and sent[-1]["layers_merged"] == 0


# setting: (steps, passes over the model's layers in the run as ComfyUI's node runs them, the
# least change of the samples against seam smoothing alone: measured 0.565, 0.546, 0.634, /2)
RUNS = {"default": (2, 4, 0.28), "example": (4, 10, 0.27), "symmetric": (6, 26, 0.32)}


@pytest.mark.parametrize("setting", list(SMOOTHING))
def test_every_pass_merges_on_plans_of_its_own(setting, monkeypatch):
    """Merging beside seam smoothing: each model call's rolled pass runs through merged layers
    too, on plans built for it (as many plans as ToMA alone builds, once per pass), the samples
    stay finite and move away from seam smoothing's alone, and the two node orders give the
    same samples."""
    if not available(NAME):
        return assert_absent(NAME)
    steps, passes, least_change = RUNS[setting]
    model, x, run = setup(steps)
    plain_seen: list[int] = []
    recorded = model.clone()
    length_patches(recorded, plain_seen)
    base = ch.sample(seam_smoothing(recorded, setting), x.latent, x.positive, x.negative, **run)
    layers = len(model.model.diffusion_model.language_model.layers)
    assert len(plain_seen) == passes * layers        # one batched cond/uncond call a step
    full = plain_seen[0]

    sent: list[dict] = []
    monkeypatch.setattr(run_state, "send_stats", lambda node, stats: sent.append(stats))
    ch.sample(apply_toma(model, make_options(0.5, skip_blocks="none")), x.latent, x.positive,
              x.negative, **run)
    alone = sent[-1]["plans_built"]                   # ToMA without seam smoothing
    assert alone > 0
    samples = []
    for order in (0, 1):
        seen: list[int] = []
        again = model.clone()
        length_patches(again, seen)
        patched = both_orders(again, make_options(0.5, skip_blocks="none"), setting)[order]
        samples.append(ch.sample(patched, x.latent, x.positive, x.negative, **run))
        assert len(seen) == len(plain_seen)
        assert all(n < full for n in seen)            # every pass, every layer merged
        assert sent[-1]["plans_built"] * steps == passes * alone
    assert torch.equal(samples[0], samples[1])
    assert bool(torch.isfinite(samples[0]).all())
    change = float((samples[0] - base).norm() / base.norm())
    assert change > least_change
