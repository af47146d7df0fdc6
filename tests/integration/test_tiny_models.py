"""The tiny DiT family builders (tiny_models.py) on real ComfyUI, without ToMA.

Every family this ComfyUI has samples through comfy.sample (the KSampler path) with CFG, at odd
latent sizes and an odd frame count, and gives finite output of the latent's shape. A family it
lacks is not skipped: the test asserts that its classes are absent here instead.

The last test pins what each family's block loop hands a "dit" replace patch (block kinds,
argument names, image token counts, RoPE rows), the facts a generic ToMA block patch builds on.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import pytest
import torch
from tiny_models import (
    FAMILIES,
    available,
    available_families,
    diffusion_model_class,
    families_by_version,
    family,
    hidream_o1_sequence,
    in_tree,
    inputs,
    tiny_patcher,
    token_grid,
    video_of,
)

from comfy_harness import comfy_version, flat, sample, shared_trees

# (batch, latent height, latent width, latent frames): odd sizes, an odd frame count.
ODD_VIDEO = (2, 7, 9, 3)
ODD_IMAGE = (2, 7, 9, 1)
# HunyuanVideo 1.0's patch is 2x2 and ComfyUI itself needs even latent sizes for it (its
# unpatchify floors H/2, W/2 while the patch embedding pads: the reshape fails at 7x9): even,
# non-square, odd frame count. Wan VACE too (ComfyUI does not pad the VACE context to the
# patch as it pads the latent: at 7x9 its 3x4 tokens a frame meet the latent's 4x5), Wan camera
# control (its camera adapter's unpadded convolution likewise gives 3x4 tokens a frame), and
# Kandinsky 5 (it pads the latent but does not crop its output back), Wan Animate (its
# pose embedding is an unpadded convolution too) and Wan Fun's reference image (ref_conv,
# likewise), and SCAIL (its node resizes the pose video and SCAIL-2's pose mask to half the
# video's size apart, and ComfyUI adds the two: at 7x9 their latents are 3x4 and 3x5). Their
# nodes make latents of even sizes (pixels in steps of 16; SCAIL's 32). (HiDream-O1's sizes
# count its 32-pixel patches: its tiny family's `scale`.)
EVEN_VIDEO = (2, 6, 10, 3)
EVEN_IMAGE = (2, 6, 10, 1)
# WanDancer's music injector splits each frame's tokens into 8 equal parts: 4x6 tokens a frame.
DANCER_VIDEO = (2, 8, 12, 3)
SIZES = {"hunyuan_video": EVEN_VIDEO, "hunyuan_video_i2v": EVEN_VIDEO,
         "hunyuan_video_i2v_v2": EVEN_VIDEO, "wan_vace": EVEN_VIDEO, "wan_vace_ref": EVEN_VIDEO,
         "wan_vace2": EVEN_VIDEO, "wan22_fun_control": EVEN_VIDEO,
         "kandinsky5": EVEN_VIDEO, "kandinsky5_i2v": EVEN_VIDEO, "kandinsky5_image": EVEN_IMAGE,
         "wan_camera": EVEN_VIDEO, "wan_camera_i2v": EVEN_VIDEO, "wan22_camera_i2v": EVEN_VIDEO,
         "wan_animate": EVEN_VIDEO, "wan_animate_continue": EVEN_VIDEO,
         "wan_scail": EVEN_VIDEO, "wan_scail2": EVEN_VIDEO, "wan_dancer": DANCER_VIDEO}


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


def test_families_by_version_names_this_tree(comfyui_path) -> None:
    by_version = families_by_version()
    assert set(by_version) == {tree.name for tree in shared_trees()}
    if comfyui_path in shared_trees():
        assert by_version[comfyui_path.name] == available_families()


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
    assert out.shape == x.latent.shape and flat(out).shape == flat(x.latent).shape
    assert torch.isfinite(flat(out)).all()
    # The model ran: a sample, not the empty latent (mean |out| measured 0.87-4.5 over the
    # families on the three versions; LTX's video 1.11-1.31).
    assert flat(out).abs().mean() > 0.5
    if x.noise_mask is not None:
        # Frames the noise mask keeps (0: the start frame, LTX's guide frame) come out as they
        # went in, the rest is generated.
        video, latent = video_of(out), video_of(x.latent)
        kept = x.noise_mask.amax(dim=(0, 1, 3, 4)) == 0
        assert kept.any() and not kept.all()
        torch.testing.assert_close(video[:, :, kept], latent[:, :, kept])
        assert not torch.allclose(video[:, :, ~kept], latent[:, :, ~kept])


def test_builders_are_deterministic() -> None:
    name = "wan22_5b" if available("wan22_5b") else "wan21_t2v"
    a, b = tiny_patcher(name, seed=3), tiny_patcher(name, seed=3)
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    for key, value in sa.items():
        assert torch.equal(value, sb[key]), key


# "dit" replace patches each family's block loop calls: kind -> the argument names it passes.
# Wan, Qwen-Image and SD3 have one kind ("double_block"), HunyuanVideo (and HunyuanImage 2.1),
# Flux 2 and Chroma two, Lumina 2 / Z-Image and HiDream none (their loop has no
# patches_replace: object patches only).
_FLUX_ARGS = {"double_block": {"img", "txt", "vec", "pe", "attn_mask", "transformer_options"},
              "single_block": {"img", "vec", "pe", "attn_mask", "transformer_options"}}
_HV_ARGS = {"double_block": {"img", "txt", "vec", "pe", "attention_mask", "modulation_dims_img",
                             "modulation_dims_txt", "transformer_options"},
            "single_block": {"img", "vec", "pe", "attention_mask", "modulation_dims",
                             "transformer_options"}}
_TWO_STREAM_ARGS = {"double_block": {"img", "txt", "vec", "pe", "transformer_options"}}
# LTX-Video: the text is cross-attention context with its mask; ComfyUI 0.33 adds the guide
# attention mask and the prompt's timestep. LTX-2: `img` is (video, audio), every other
# argument comes per stream (v_ / a_), the cross-stream ones too.
_LTXV_ARGS = {"double_block": {"img", "txt", "attention_mask", "vec", "pe",
                               "transformer_options"}}
_LTXV_033 = {"self_attention_mask", "prompt_timestep"}
_LTX2_ARGS = {"double_block": {"img", "v_context", "a_context", "attention_mask", "v_timestep",
                               "a_timestep", "v_pe", "a_pe", "v_cross_pe", "a_cross_pe",
                               "v_cross_scale_shift_timestep", "a_cross_scale_shift_timestep",
                               "v_cross_gate_timestep", "a_cross_gate_timestep",
                               "transformer_options"}}
_LTX2_033 = {"self_attention_mask", "v_prompt_timestep", "a_prompt_timestep"}
# Kandinsky 5: its loop has replace patches, but they cannot run the block
# (test_kandinsky5_replace_patches_cannot_run_the_block): object patches only.
# HiDream-O1: one sequence [prompt; image] as `x`, its RoPE rows (cos, sin, -sin) [1, L, D].
_HIDREAM_O1_ARGS = {"double_block": {"x", "attention_mask", "freqs_cis", "optimized_attention",
                                     "transformer_options"}}
DIT_ARGS = {"wan": _TWO_STREAM_ARGS, "kandinsky5": {}, "qwen": _TWO_STREAM_ARGS,
            "hunyuan": _HV_ARGS,
            "sd3": {"double_block": {"img", "txt", "vec", "transformer_options"}},
            "lumina2": {}, "z_image": {}, "hidream_o1": _HIDREAM_O1_ARGS, "hidream": {},
            "flux2": _FLUX_ARGS, "chroma": _FLUX_ARGS,
            "ltxv": _LTXV_ARGS, "ltx2": _LTX2_ARGS, "krea2": {},
            "longcat": _FLUX_ARGS, "mage_flow": _TWO_STREAM_ARGS, "anima": {}, "boogu": {},
            "ideogram4": {}, "omnigen2": {}, "joyimage": _TWO_STREAM_ARGS,
            "ernie": {},
            "lens": {"double_block": {"img", "txt", "vec", "pe", "attn_mask",
                                      "transformer_options"}}}


# Conditioning whose latent's tokens the family's stream holds after the image's (SCAIL's pose
# video, at half the video's size).
APPENDED = {"wan_scail": "pose_video_latent", "wan_scail2": "pose_video_latent"}


def dit_args(name: str) -> dict[str, set[str]]:
    """DIT_ARGS of the family on this ComfyUI (LTX's grow in 0.33)."""
    expected = DIT_ARGS[_group(name)]
    more = {"ltxv": _LTXV_033, "ltx2": _LTX2_033}.get(_group(name))
    if more and comfy_version() >= (0, 33):
        return {kind: names | more for kind, names in expected.items()}
    return expected


def _group(name: str) -> str:
    return next(g for g in DIT_ARGS if name.startswith(g))


def _pe_token_axis(name: str) -> int:
    """Axis of the RoPE rows' token dimension: Wan, Kandinsky 5, JoyImage [1, L, 1, ...] and
    Qwen-Image before 0.8 [B, L, 1, ...], LTX [B, L, ...] (each tensor of its pair); Qwen-Image
    from 0.8, HunyuanVideo, Flux 2, Chroma [B, 1, L, ...]."""
    if _group(name) in ("wan", "ltxv", "ltx2", "kandinsky5", "joyimage") or (
            _group(name) == "qwen" and comfy_version() < (0, 8)):
        return 1
    return 2


def _recorder(kind: str, index: int, calls: list) -> object:
    def patch(args: dict, extra: dict) -> dict:
        calls.append((kind, index, args))
        return extra["original_block"](args)
    return patch


def record_dit_calls(name: str) -> tuple[Any, Any, list, torch.Tensor, torch.Tensor]:
    """Sample the family's tiny model once plain and once with pass-through "dit" replace
    patches on every block index it could have: (patcher, inputs, [(kind, index, args)],
    plain output, patched output)."""
    patcher = tiny_patcher(name)
    (batch, height, width, frames), cfg = sample_args(name)
    x = inputs(name, patcher, batch, height, width, frames)
    run = {"steps": 1, "cfg": cfg, "noise_mask": x.noise_mask}
    plain = sample(patcher, x.latent, x.positive, x.negative, **run)
    calls: list = []
    patched = patcher.clone()
    for kind in ("double_block", "single_block"):
        for i in range(4):
            patched.set_model_patch_replace(_recorder(kind, i, calls), "dit", kind, i)
    out = sample(patched, x.latent, x.positive, x.negative, **run)
    return patcher, x, calls, plain, out


@pytest.mark.parametrize("name", list(FAMILIES))
def test_dit_replace_patches_see_the_documented_sequence(name: str) -> None:
    if not available(name):
        assert_absent(name)
        return
    if _group(name) == "kandinsky5":
        return
    _, x, calls, plain, out = record_dit_calls(name)
    # A patch that calls original_block(args) as given reproduces the model exactly.
    assert torch.equal(flat(out), flat(plain))

    expected = dit_args(name)
    assert {(k, i) for k, i, _ in calls} == {(k, i) for k in expected for i in range(2)}
    if _group(name) == "hidream_o1":            # [prompt; image; reference patches]
        _, sequence = hidream_o1_sequence(x)
        for kind, _, args in calls:
            assert set(args) == expected[kind], kind
            assert args["x"].shape[1] == sequence
            assert all(rows.shape[1] == sequence for rows in args["freqs_cis"])
        return
    image = math.prod(token_grid(name, x.latent.shape))   # LTX: its guide frames included
    for ref in x.positive[0][1].get("reference_latents", []):
        image += math.prod(token_grid(name, ref.shape))   # Qwen edit: appended to the image
    appended = x.positive[0][1].get(APPENDED.get(name, ""))
    if appended is not None:                               # SCAIL: the pose video's tokens
        image += math.prod(token_grid(name, appended.shape))
    text = None
    # RoPE rows over the image only: the text is cross-attention (Wan, LTX) or has none (JoyImage)
    video_only = _group(name) in ("wan", "ltxv", "ltx2", "joyimage")
    for kind, _, args in calls:
        assert set(args) == expected[kind], kind
        stream = args["img"]
        if isinstance(stream, tuple):                      # LTX-2: (video, audio)
            video, audio = stream
            assert audio.shape[1] == family(name).audio_tokens
            stream = video
        if kind == "double_block":
            # The image stream holds exactly the image (+ reference) tokens.
            assert stream.shape[1] == image
            text = args["txt"].shape[1] if "txt" in args else 0
            sequence = image if video_only else text + image
        else:
            # Single blocks: one sequence of text and image tokens.
            sequence = text + image
            assert stream.shape[1] == sequence
        for key in ("pe", "v_pe", "v_cross_pe"):
            # RoPE rows: one per token of the attention sequence (Wan, LTX: image only), in
            # each tensor of LTX's pairs.
            pe = args.get(key)
            for rows in (pe if isinstance(pe, tuple) else (pe,)):
                if torch.is_tensor(rows):
                    assert rows.shape[_pe_token_axis(name)] == sequence


@pytest.mark.parametrize("name", ["kandinsky5", "kandinsky5_image"])
def test_kandinsky5_replace_patches_cannot_run_the_block(name: str) -> None:
    """Kandinsky 5's block loop hands a "dit" replace patch an original_block that calls the
    block with keywords its forward does not take (x=, context=): even a pass-through patch
    fails, which is why ToMA patches these blocks' forward instead. Without replace patches
    the blocks take (visual_embed, text_embed, time_embed, freqs): the RoPE rows [1, L, 1, ...]
    one per image token."""
    if not available(name):
        return assert_absent(name)
    with pytest.raises(TypeError, match="unexpected keyword argument 'x'"):
        record_dit_calls(name)
    import inspect

    block = tiny_patcher(name).model.diffusion_model.visual_transformer_blocks[0]
    assert list(inspect.signature(block.forward).parameters) == [
        "visual_embed", "text_embed", "time_embed", "freqs", "transformer_options"]


def test_hunyuan_video_token_order_follows_flipped_img_txt() -> None:
    """HunyuanVideo puts the image first in the attention sequence while its double blocks are
    built with flipped_img_txt (v0.3.64, v0.8.0), text first once that is gone (v0.33.0)."""
    patcher, _, calls, _, _ = record_dit_calls("hunyuan_video")
    flipped = getattr(patcher.model.diffusion_model.double_blocks[0], "flipped_img_txt", False)
    assert flipped == (comfy_version() < (0, 33))
    _, _, args = next(c for c in calls if c[0] == "double_block")
    text = args["txt"].shape[1]
    rows = args["pe"][0, 0]                     # [text + image, head_dim / 2, 2, 2]
    text_rows, image_rows = (rows[-text:], rows[:-text]) if flipped else (rows[:text], rows[text:])
    # Text positions are all zero: one RoPE row repeated; image rows vary.
    assert torch.equal(text_rows, text_rows[:1].expand_as(text_rows))
    assert not torch.equal(image_rows, image_rows[:1].expand_as(image_rows))


def test_wan22_5b_image_to_video_modulates_per_frame() -> None:
    """Wan 2.2 5B with a kept start frame gets one timestep per latent frame
    (WAN22.process_timestep): the blocks' modulation `vec` is [B, frames, 6, C] and
    repeat_e spreads it over each frame's tokens; text-to-video has one row."""
    _, x, calls, _, _ = record_dit_calls("wan22_5b_i2v")
    frames = x.latent.shape[2]
    assert {args["vec"].shape[1] for _, _, args in calls} == {frames}
    _, _, calls, _, _ = record_dit_calls("wan22_5b")
    assert {args["vec"].shape[1] for _, _, args in calls} == {1}


def test_hidream_blocks_see_the_documented_sequence() -> None:
    """HiDream's blocks, called without replace patches (object patches of their forward here):
    double-stream blocks get the image tokens alone and the text [T5; last Llama layer; their
    own Llama layer] as text_tokens, and return (image, text); single-stream blocks get one
    sequence [image; T5; last Llama layer; their own Llama layer] and no text_tokens. RoPE rows
    [B, L, 1, D / 2, 2, 2] cover image and text; no image mask (a single latent)."""
    import inspect
    import types

    from tiny_models import HIDREAM_LLAMA_TOKENS, TEXT_TOKENS

    if not available("hidream"):
        assert_absent("hidream")
        return
    patcher = tiny_patcher("hidream")
    (batch, height, width, frames), cfg = sample_args("hidream")
    x = inputs("hidream", patcher, batch, height, width, frames)
    plain = sample(patcher, x.latent, x.positive, x.negative, steps=1, cfg=cfg)
    calls: list = []
    patched = patcher.clone()
    dm = patcher.model.diffusion_model
    for attr in ("double_stream_blocks", "single_stream_blocks"):
        for i, block in enumerate(getattr(dm, attr)):
            signature = inspect.signature(types.MethodType(type(block).forward, block))
            original = types.MethodType(type(block).forward, block)

            def forward(*args, _sig=signature, _original=original, _attr=attr, **kwargs):
                out = _original(*args, **kwargs)
                calls.append((_attr, dict(_sig.bind(*args, **kwargs).arguments), out))
                return out

            patched.add_object_patch(f"diffusion_model.{attr}.{i}.forward", forward)
    out = sample(patched, x.latent, x.positive, x.negative, steps=1, cfg=cfg)
    assert torch.equal(out, plain)
    image = math.prod(token_grid("hidream", x.latent.shape))
    text = TEXT_TOKENS + 2 * HIDREAM_LLAMA_TOKENS
    assert [c[0] for c in calls[:4]] == ["double_stream_blocks"] * 2 + ["single_stream_blocks"] * 2
    for attr, args, result in calls:
        assert args["image_tokens_masks"] is None
        assert args["rope"].shape[1:3] == (image + text, 1)
        if attr == "double_stream_blocks":
            assert args["image_tokens"].shape[1] == image
            assert args["text_tokens"].shape[1] == text
            assert isinstance(result, tuple) and result[0].shape == args["image_tokens"].shape
        else:
            assert args["image_tokens"].shape[1] == image + text
            assert args.get("text_tokens") is None
            assert torch.is_tensor(result) and result.shape == args["image_tokens"].shape
