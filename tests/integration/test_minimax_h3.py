"""ToMA on MiniMax H3 (video with synchronized audio, ComfyUI 0.33 and later), through ComfyUI's
sampler, on a tiny model from ComfyUI's own config class with its conditioning from ComfyUI's
own MiniMax nodes (text, image and reference to video: tiny_models.minimax_h3_inputs).

Each merged run is recorded as test_dit_families records the other families: a patch inside
ToMA's (what reaches the block) and one outside it (the block's real input). The packed
sequence's layout is read here from the model's own PackedLayout in the call's conditioning:
everything before the video segment (text, keyframes, references, audio) never merges.

A tree without MiniMax H3 is not skipped: the test asserts it is absent.
"""

from __future__ import annotations

import pytest
import torch
from test_dit_families import Recorder, assert_identity, check_against_definition
from tiny_models import (
    MINIMAX_H3_TASKS,
    minimax_h3_available,
    minimax_h3_inputs,
    tiny_minimax_h3,
)

import comfy_harness as ch
from toma_pack.nodes import run_state
from toma_pack.nodes.apply import apply_toma
from toma_pack.nodes.options import make_options
from toma_pack.toma_core import build_plan
from toma_pack.toma_core.regions import Regions

RATIO = 0.5
# tiny_models' size: 160 x 128 pixels, 22 frames -> 7 latent frames of 8 x 10, (7, 4, 5) tokens
GRID = (7, 4, 5)
# the node's default regions for that grid (about 64 tokens, 2 frames deep, slabs of near-equal
# depth): slabs of 3, 2 and 2 frames, one tile a frame
REGIONS = ((3, 2, 2), (4,), (5,))
# Relative error of merged samples against unmerged (test_template_sampling_stays_near_unmerged),
# the measured value x 1.5 (comments: measured on v0.33.0)
SAMPLE_ERROR = {"t2v": 0.19, "i2v": 0.19, "ref2v": 0.19}      # 0.1260, 0.1255, 0.1250


def present() -> bool:
    """Whether this tree has MiniMax H3: ComfyUI 0.33 on, and only there."""
    found = minimax_h3_available()
    assert found == (ch.comfy_version() >= (0, 33))
    return found


def sample(model, x, steps: int = 2):
    return ch.sample(model, x.latent, x.positive, x.negative, steps=steps, cfg=2.0)


def video_start(x, positive: bool = True) -> int:
    """Where the video segment starts in the packed sequence of the positive (or negative)
    call: the tokens before it never merge."""
    import comfy.ldm.minimax.model as h3

    cond = (x.positive if positive else x.negative)[0]
    extras = cond[1]
    video, audio = x.latent.unbind()
    layout = h3.PackedLayout(cond[0].shape[1], video.shape[2], video.shape[3], video.shape[4],
                             audio.shape[-1], keyframes=extras.get("minimax_keyframes"),
                             refs=extras.get("minimax_refs"))
    (start, stop), = [(a, b) for a, b, kind in layout.segments if kind == "video"]
    assert stop == layout.seq_len and stop - start == GRID[0] * GRID[1] * GRID[2]
    return start


@pytest.mark.parametrize("task", MINIMAX_H3_TASKS)
def test_ratio_zero_and_inactive_steps_are_bit_identical(task, monkeypatch):
    """Ratio 0, and every patch installed and running with merging outside the active steps
    (start_percent 0.4 to end_percent 0.5, between the 2 steps' sigmas): the samples are the
    unpatched model's, video and audio."""
    if not present():
        return
    x = minimax_h3_inputs(task)
    assert_identity(tiny_minimax_h3(), lambda model: sample(model, x), monkeypatch)


def recorded_run(task: str):
    """One merged sampling step with CFG (the positive and negative calls run apart: batch
    size one), recorded inside and outside ToMA."""
    base = tiny_minimax_h3()
    x = minimax_h3_inputs(task)
    inner, outer = Recorder(), Recorder(unmerged=True)
    model = base.clone()
    inner.install(model)
    toma = apply_toma(model, make_options(RATIO, skip_blocks="none"))
    outer.install(toma)
    out = sample(toma, x, steps=1)
    return x, inner, outer, out


def expected_plan(given: torch.Tensor, offset: int):
    """The plan the node's defaults give for the video tokens of the block input `given`
    [L, C] (rebuilt here with toma_core, checked against the method's definition)."""
    t, h, w = GRID
    stream = given.unsqueeze(0)
    plan = build_plan(stream, t * h, w, RATIO, offset=offset, center=True,
                      regions=Regions(t, h, w, *REGIONS))
    check_against_definition(plan, stream, offset)
    return plan


@pytest.mark.parametrize("task", MINIMAX_H3_TASKS)
def test_only_the_video_merges_and_its_rows_follow(task):
    """In every block call (positive and negative): the text, the keyframe or reference rows
    and the audio reach the block exactly as they came, the video merged by the plan; the
    RoPE table's rows of merged tokens are their destinations'; the modulation segments are
    the same but the video's, which spans the merged video; the block's output keeps every
    token before the video as the block put it out and unmerges the video's update."""
    if not present():
        return
    x, inner, outer, out = recorded_run(task)
    assert len(inner.calls) == len(outer.calls) == 4       # 2 blocks, positive and negative
    video, audio = out.unbind()
    assert torch.isfinite(video).all() and torch.isfinite(audio).all()
    starts = {video_start(x, True), video_start(x, False)}
    n = GRID[0] * GRID[1] * GRID[2]
    plans: dict[int, object] = {}
    calls = zip(inner.calls, inner.outputs, outer.calls, outer.outputs, strict=True)
    for (_, index, a), a_out, (_, _, b), b_out in calls:
        given, got = b["img"], a["img"]
        offset = given.shape[0] - n
        assert offset in starts
        if index == 0:
            plans[offset] = expected_plan(given, offset)
        plan = plans[offset]
        m = plan.merged_tokens
        assert got.shape[0] == offset + m < given.shape[0]
        assert torch.equal(got[:offset], given[:offset])
        assert torch.equal(got[offset:], plan.merge(given.unsqueeze(0), offset)[0, offset:])
        # RoPE [1, L, 1, D/2, 2, 2]: rows before the video kept, merged rows the destinations'
        pe_in, pe_out = a["rope_freqs"], b["rope_freqs"]
        assert torch.equal(pe_in[:, :offset], pe_out[:, :offset])
        assert torch.equal(pe_in[0, offset:], pe_out[0].index_select(
            0, offset + plan.dest_tokens[0]))
        # modulation by segment: every segment but the video's as it came
        seg_in, seg_out = list(a["mod_segments"]), list(b["mod_segments"])
        assert seg_in[:-1] == seg_out[:-1] and len(seg_in) >= 3
        assert seg_out[-1][:2] == (offset, offset + n)
        assert seg_in[-1] == (offset, offset + m, seg_out[-1][2])
        # output: the block's own tokens before the video, the video x + U (out - merged)
        assert torch.equal(b_out[:offset], a_out[:offset])
        update = plan.unmerge((a_out[offset:] - got[offset:]).unsqueeze(0))[0]
        expected = given[offset:] + update
        # the same sum in another order
        assert float((b_out[offset:] - expected).abs().max()) <= 4e-7 * float(
            given.abs().max())


def test_reference_and_keyframe_rows_never_merge():
    """Image to video puts the first frame's keyframe rows before the audio, reference to video
    the reference image and audio: the merged prefix grows by them, the merged count does
    not change."""
    if not present():
        return
    t2v, i2v, ref = (video_start(minimax_h3_inputs(task)) for task in MINIMAX_H3_TASKS)
    h, w = GRID[1:]
    assert i2v == t2v + h * w                                # one keyframe latent frame
    assert ref > t2v + h * w                                 # reference image and audio


def test_per_token_video_timesteps_run_unmerged(monkeypatch):
    """A noise mask inside the video (an inpainting mask: SetLatentNoiseMask) gives video
    tokens timesteps of their own, one modulation row each: those blocks run unmerged and the
    run says why."""
    if not present():
        return
    import comfy.nested_tensor

    model = tiny_minimax_h3()
    x = minimax_h3_inputs("t2v")
    video, audio = x.latent.unbind()
    mask_video = torch.ones(1, 1, *video.shape[2:])
    mask_video[..., : video.shape[3] // 2, :] = 0.0
    mask = comfy.nested_tensor.NestedTensor((mask_video, torch.ones(1, 1, *audio.shape[2:])))
    sent: list[dict] = []
    monkeypatch.setattr(run_state, "send_stats", lambda node, stats: sent.append(stats))
    toma = apply_toma(model, make_options(RATIO, skip_blocks="none"))
    out = ch.sample(toma, x.latent, x.positive, x.negative, steps=1, cfg=2.0, noise_mask=mask)
    assert torch.isfinite(ch.flat(out)).all()
    assert sent[-1]["layers_merged"] == 0
    assert "mod_segments" in sent[-1]["note"]


@pytest.mark.parametrize("task", MINIMAX_H3_TASKS)
def test_template_sampling_stays_near_unmerged(task):
    """As MiniMax H3's templates sample (BasicGuider: the positive alone, res_multistep, the
    simple scheduler; 4 steps as their turbo LoRA), at ratio 0.5 with ToMA's default
    skip_blocks: finite video and audio, within a measured distance of unmerged (random
    weights: this bounds how far merging moves the samples, not their quality)."""
    if not present():
        return
    model = tiny_minimax_h3()
    x = minimax_h3_inputs(task)
    run = {"steps": 4, "cfg": 1.0, "sampler": "res_multistep", "scheduler": "simple"}
    base = ch.flat(ch.sample(model, x.latent, x.positive, x.negative, **run))
    toma = apply_toma(model, make_options(RATIO, skip_blocks="none"))
    merged = ch.flat(ch.sample(toma, x.latent, x.positive, x.negative, **run))
    err = float((merged - base).norm() / base.norm())
    print(f"minimax_h3 {task}: relative error of merged samples {err:.4f}")
    assert torch.isfinite(merged).all() and 0 < err <= SAMPLE_ERROR[task]
