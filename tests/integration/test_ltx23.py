"""ToMA on LTX-2.3 / LTX-2.5: LTX-2's class (LTXAVModel) with the cross-attention AdaLN
(`cross_attention_adaln`, set from the checkpoint's config; ComfyUI 0.33 and later), through
ComfyUI's sampler, on a tiny model from ComfyUI's own config class, conditioned with the nodes
of the LTX-2.3 templates (EmptyLTXVLatentVideo, LTXVImgToVideoInplace, LTXVEmptyLatentAudio,
LTXVConcatAVLatent, LTXVConditioning).

With the cross-attention AdaLN each video block's `v_timestep` rows carry 9 modulation vectors
a token (a frame, compressed) instead of 6: the last 3 shift, scale and gate the text
cross-attention's queries, so they must follow the merged tokens like the others;
`v_prompt_timestep` ([B, 1, 2C]) modulates the text's keys and values, one row a call, and
reaches the block as it came. The blocks are recorded as test_dit_families records the other
families (a patch inside ToMA's and one outside it) and checked with its checks.

A tree without the cross-attention AdaLN is not skipped: the test asserts it is absent.
"""

from __future__ import annotations

import inspect
import types
from pathlib import Path

import pytest
import test_dit_families
import torch
from test_dit_families import (
    RATIO,
    assert_identity,
    check_guide_masks,
    check_merged_blocks,
    recorded_run,
    worst_update_error,
)
from test_tiny_models import sample_args
from tiny_models import TEXT_TOKENS, SampleInputs, family, tiny_patcher

import comfy_harness as ch
from toma_pack.nodes import run_state
from toma_pack.nodes.apply import apply_toma
from toma_pack.nodes.options import make_options

# LTX-2.3 text to video, image to video with its start image kept (LTXVImgToVideoInplace at
# strength 1), and image and audio to video (the given audio kept too: SetLatentNoiseMask with a
# SolidMask of 0 on its latent): the tiny families of LTX-2 whose layout (protected frames,
# regions) they share
TASKS = {"t2v": "ltx2", "i2v": "ltx2_i2v", "ia2v": "ltx2_i2v"}
# Rows of the blocks' `v_timestep` (CompressedTimestep): text to video has one timestep for
# every token, one row; with a start image one row a frame (its rows test the rows' moving)
TIMESTEP_ROWS = {"t2v": 1, "i2v": 3, "ia2v": 3}
ADALN_PARAMS = 9        # ComfyUI's ADALN_CROSS_ATTN_PARAMS_COUNT (6 without the AdaLN)
AUDIO_TOKENS = 5        # audio latent frames of the stand-in audio VAE
# LTXVAddGuide's strength in the first-last-frame templates (LTX-2.3, LTX-2.5, style transition)
GUIDE_STRENGTH = 0.7
# Relative error of a merged block's update against the unmerged block's (worst_update_error),
# the measured value x 1.5 (comments: measured on v0.33.0)
UPDATE_ERROR = {"t2v": 0.8, "i2v": 0.55, "ia2v": 0.55,       # 0.531, 0.366, 0.332
                "flf2v": 0.58}                               # 0.382


def present() -> bool:
    """Whether this tree's LTX-2 class has the cross-attention AdaLN: ComfyUI 0.33 on (0.8
    would take the option into **kwargs and build a plain LTX-2; 0.3.64 has no LTX-2)."""
    ch.ensure_comfy()
    import comfy.ldm.lightricks as lightricks

    try:
        from comfy.ldm.lightricks.av_model import LTXAVModel
    except ModuleNotFoundError:
        assert not (Path(lightricks.__path__[0]) / "av_model.py").exists()
        found = False
    else:
        found = "cross_attention_adaln" in inspect.signature(LTXAVModel.__init__).parameters
    assert found == (ch.comfy_version() >= (0, 33))
    return found


def tiny_ltx23(seed: int = 0):
    """The tiny LTX-2 of tiny_models with the cross-attention AdaLN on, as ComfyUI builds
    LTX-2.3 from its checkpoint's config."""
    model = tiny_patcher("ltx2", seed, cross_attention_adaln=True)
    block = model.model.diffusion_model.transformer_blocks[0]
    assert block.cross_attention_adaln and block.scale_shift_table.shape[0] == ADALN_PARAMS
    assert model.model.diffusion_model.prompt_adaln_single is not None
    return model


def node_output(out) -> tuple:
    """An io.ComfyNode's outputs."""
    return tuple(out.result) if hasattr(out, "result") else tuple(out)


def template_inputs(task: str, seed: int = 0) -> SampleInputs:
    """The LTX-2.3 templates' conditioning at the LTX-2 tests' odd size (batch 2 of 3 latent
    frames of 7 x 9): EmptyLTXVLatentVideo, for image to video LTXVImgToVideoInplace with a
    seeded image and a stand-in VAE (its encode gives one seeded latent frame),
    LTXVEmptyLatentAudio with a stand-in audio VAE, LTXVConcatAVLatent, and LTXVConditioning's
    frame rate on the (already encoded) text contexts; for image and audio to video a seeded
    audio latent (LTXVAudioVAEEncode's place) kept by SetLatentNoiseMask(SolidMask 0)."""
    comfy_nodes = ch.comfy_top_level_nodes()
    from comfy_extras.nodes_lt import (
        EmptyLTXVLatentVideo,
        LTXVAddGuide,
        LTXVConcatAVLatent,
        LTXVConditioning,
        LTXVImgToVideoInplace,
    )
    from comfy_extras.nodes_lt_audio import LTXVEmptyLatentAudio
    from comfy_extras.nodes_mask import SolidMask

    (batch, height, width, frames), _ = sample_args("ltx2")    # every task's size
    if task == "flf2v":         # LTXVAddGuide appends a one-item guide: one latent item too
        batch = 1
    length, rate = 8 * (frames - 1) + 1, 25.0
    video, = node_output(EmptyLTXVLatentVideo.execute(32 * width, 32 * height, length, batch))

    class VAE:
        downscale_index_formula = (8, 32, 32)

        def encode(self, pixels: torch.Tensor) -> torch.Tensor:
            return ch._randn(1, 128, 1, height, width, seed=seed + 3)

    image = torch.rand(1, 32 * height, 32 * width, 3,
                       generator=torch.Generator().manual_seed(seed + 4))
    text = family("ltx2").text_dim
    positive, negative = ([[ch._randn(batch, TEXT_TOKENS, text, seed=seed + offset),
                            {"pooled_output": None}]] for offset in (0, 100))
    if task in ("i2v", "ia2v"):
        video, = node_output(LTXVImgToVideoInplace.execute(VAE(), image, video, 1.0))
    if task == "flf2v":       # the first and last frame, the templates' strength
        for frame in (0, -1):
            positive, negative, video = node_output(LTXVAddGuide.execute(
                positive, negative, VAE(), video, image, frame, GUIDE_STRENGTH))
    audio_vae = types.SimpleNamespace(
        latent_channels=8, first_stage_model=types.SimpleNamespace(
            latent_frequency_bins=16, num_of_latents_from_frames=lambda n, r: AUDIO_TOKENS))
    audio, = node_output(LTXVEmptyLatentAudio.execute(length, rate, batch, audio_vae))
    if task == "ia2v":
        keep = node_output(SolidMask.execute(0.0, 1024, 1024))[0]
        audio = {**audio, "samples": ch._randn(*audio["samples"].shape, seed=seed + 5)}
        audio, = comfy_nodes.SetLatentNoiseMask().set_mask(audio, keep)
    latent, = node_output(LTXVConcatAVLatent.execute(video, audio))
    positive, negative = node_output(LTXVConditioning.execute(positive, negative, rate))
    return SampleInputs(latent["samples"], positive, negative, latent.get("noise_mask"))


def sample(model, x: SampleInputs, steps: int = 2):
    return ch.sample(model, x.latent, x.positive, x.negative, steps=steps, cfg=2.0,
                     noise_mask=x.noise_mask)


@pytest.mark.parametrize("task", TASKS)
def test_ratio_zero_and_inactive_steps_are_bit_identical(task, monkeypatch):
    """Ratio 0, and every patch installed and running with merging outside the active steps
    (start_percent 0.4 to end_percent 0.5, between the 2 steps' sigmas): the samples are the
    unpatched model's, video and audio."""
    if not present():
        return
    x = template_inputs(task)
    out, _ = assert_identity(tiny_ltx23(), lambda model: sample(model, x), monkeypatch)
    if task == "ia2v":    # the given audio kept, but for the latent format's scaling in and out
        # (measured 9.3e-10, bound x10)
        assert float((out.unbind()[1] - x.latent.unbind()[1]).abs().max()) <= 1e-8


@pytest.mark.rounding          # a measured bound after the destinations' discrete choices
@pytest.mark.parametrize("task", TASKS)
def test_merged_blocks_carry_the_cross_attention_adaln(task, monkeypatch):
    """Every block merges (fewer video tokens, test_dit_families' checks: the merged grid, the
    start frame and audio kept, RoPE rows and every `v_timestep` row, the cross-attention
    AdaLN's 3 included, the merged tokens' destinations' rows); `v_prompt_timestep` reaches the
    block as it came; each merged block's update stays within a measured distance of the
    unmerged block's on the same input; the sample is finite."""
    if not present():
        return
    sent: list[dict] = []
    monkeypatch.setattr(run_state, "send_stats", lambda node, stats: sent.append(stats))
    name, base, x = TASKS[task], tiny_ltx23(), template_inputs(task)
    run = recorded_run(name, base=base, x=x)
    _, _, inner, outer, out = run
    check_merged_blocks(name, *run)
    assert sent[-1]["layers_merged"] == sent[-1]["layers_total"] > 0
    width = base.model.diffusion_model.inner_dim
    for (_, _, a), (_, _, b) in zip(inner.calls, outer.calls, strict=True):
        assert b["v_timestep"].data.shape[1:] == (TIMESTEP_ROWS[task], ADALN_PARAMS * width)
        assert a["v_timestep"].data.shape[-1] == ADALN_PARAMS * width
        assert a["v_prompt_timestep"].shape[1:] == (1, 2 * width)
        assert torch.equal(a["v_prompt_timestep"], b["v_prompt_timestep"])
        assert a["img"][0].shape[1] < b["img"][0].shape[1]
    worst = worst_update_error(name, *run)
    print(f"LTX-2.3 {task}: worst relative error of a merged block's update {worst:.3f}")
    assert worst <= UPDATE_ERROR[task]
    assert torch.isfinite(out).all()


def dual_cfg_sample(model, x: SampleInputs) -> torch.Tensor:
    """Two steps through the LTX-2.5 templates' guider (LTXVDualCFGGuider, video CFG 3, audio
    CFG 7: one uncond and one cond pass, combined per modality) and SamplerCustomAdvanced."""
    ch.comfy_top_level_nodes()
    from comfy_extras.nodes_custom_sampler import (
        BasicScheduler,
        KSamplerSelect,
        RandomNoise,
        SamplerCustomAdvanced,
    )
    from comfy_extras.nodes_lt import LTXVDualCFGGuider

    guider, = node_output(LTXVDualCFGGuider.execute(model, x.positive, x.negative, 3.0, 7.0))
    latent = {"samples": x.latent} if x.noise_mask is None else {"samples": x.latent,
                                                                  "noise_mask": x.noise_mask}
    out = SamplerCustomAdvanced.execute(
        node_output(RandomNoise.execute(0))[0], guider,
        node_output(KSamplerSelect.execute("euler"))[0],
        node_output(BasicScheduler.execute(model, "normal", 2, 1.0))[0], latent)
    return node_output(out)[0]["samples"]


@pytest.mark.parametrize("task", ["t2v", "i2v"])
def test_dual_cfg_guider(task, monkeypatch):
    """The LTX-2.5 templates' guider and sampler node: at ratio 0 and with every patch
    installed outside the active steps the samples are the unpatched model's; merged, every
    block of every call merges and the samples are finite."""
    if not present():
        return
    model, x = tiny_ltx23(), template_inputs(task)
    out, sent = assert_identity(model, lambda model: dual_cfg_sample(model, x), monkeypatch)
    base = ch.flat(out)
    merged = ch.flat(dual_cfg_sample(apply_toma(model, make_options(RATIO, skip_blocks="none")),
                                     x))
    assert sent[-1]["layers_merged"] == sent[-1]["layers_total"] > 0
    assert merged.shape == base.shape and torch.isfinite(merged).all()


@pytest.mark.rounding          # a measured bound after the destinations' discrete choices
def test_first_last_frame_guides_merge(monkeypatch):
    """The first-last-frame templates' guides (LTXVAddGuide at frames 0 and -1, strength 0.7,
    appended after the video) make ComfyUI give the blocks a guide attention mask: its bias is
    the same for every video token, so every block merges and gets the full mask less the
    merged-away video columns, `guide_start` moved back by as many; each merged block's update
    stays within a measured distance of the unmerged block's. Ratio 0, and every patch
    installed with merging outside the active steps, give the unpatched samples bit for bit."""
    if not present():
        return
    model, x = tiny_ltx23(), template_inputs("flf2v")
    assert x.latent.unbind()[0].shape[2] == 3 + 2              # two guide frames appended
    # test_dit_families' checks on this layout: the two guide frames after the grid, and
    # regions one frame deep (the guide frames' own timesteps: one compressed row a frame)
    monkeypatch.setitem(test_dit_families.SUFFIX_FRAMES, "ltx2", 2)
    monkeypatch.setattr(test_dit_families, "frames_deep", lambda name: 1)
    monkeypatch.setitem(test_dit_families.EXPECTED_REGIONS, (3, 7, 9, 1),
                        ((1, 1, 1), (7,), (9,)))
    _, sent = assert_identity(model, lambda model: sample(model, x, steps=1), monkeypatch)
    name = "ltx2"
    run = recorded_run(name, base=model, x=x)
    _, _, inner, outer, out = run
    check_merged_blocks(name, *run)
    assert sent[-1]["layers_merged"] == sent[-1]["layers_total"] > 0
    check_guide_masks(inner, outer, 2 * 7 * 9)             # two guide frames of 7 x 9
    worst = worst_update_error(name, *run)
    print(f"LTX-2.3 flf2v: worst relative error of a merged block's update {worst:.3f}")
    assert worst <= UPDATE_ERROR["flf2v"]
    assert torch.isfinite(out).all()
