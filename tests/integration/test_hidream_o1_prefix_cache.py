"""ToMA keeps HiDream-O1's prompt keys and values across steps (nodes/prefix_cache.py), through
ComfyUI's own model and sampler (ComfyUI 0.33 and later; older versions assert the model is
absent).

Unpatched, ComfyUI runs a prompt's first call on the whole sequence and later calls on the
tokens after the prompt, over the prompt's kept keys and values; with any block replaced it
recomputes the prompt at every call. ToMA's patches keep the prompt themselves, so its layers
run as ComfyUI's unpatched hot path does, merged or not. What a layer is handed is recorded by
an object patch on each decoder layer's forward (another pack's patch, which ToMA's call of the
layer goes through, as ComfyUI's own hot path does).
"""

from __future__ import annotations

import logging
import types

import pytest
import torch
from test_tiny_models import assert_absent, sample_args
from tiny_models import available, inputs, tiny_patcher

import comfy_harness as ch
from toma_pack.nodes import run_state
from toma_pack.nodes.apply import apply_toma
from toma_pack.nodes.options import make_options

NAME = "hidream_o1"
STEPS = 3
LOST = "cannot keep the prompt's keys and values"


def layer_lengths(model, seen: list[tuple[int, bool]]) -> None:
    """Object patches on every decoder layer's forward recording (tokens handed, whether kept
    keys and values came with them) and running the layer."""
    layers = model.model.diffusion_model.language_model.layers
    for i, layer in enumerate(layers):
        # the class's forward: another clone's object patch may still be on the module
        original = types.MethodType(type(layer).forward, layer)

        def forward(*args, _original=original, **kwargs):
            past = kwargs.get("past_key_value")
            seen.append((kwargs["x"].shape[1], bool(past)))
            return _original(*args, **kwargs)

        model.add_object_patch(f"diffusion_model.language_model.layers.{i}.forward", forward)


def pass_through(model) -> None:
    """Another pack's "dit" replace patch on every layer, running the layer as it is: ToMA
    wraps it, which leaves ToMA no way to keep the prompt (the patch runs the whole sequence)."""
    for i in range(len(model.model.diffusion_model.language_model.layers)):
        model.set_model_patch_replace(lambda args, extra: extra["original_block"](args), "dit",
                                      "double_block", i)


def setup(name: str = NAME):
    model = tiny_patcher(name)
    (batch, height, width, frames), cfg = sample_args(name)
    x = inputs(name, model, batch, height, width, frames)
    return model, x, {"steps": STEPS, "cfg": cfg}


def recorded(model, options=None, before=None):
    """(model with the layer recorder, then `before` (a function patching it), then ToMA at
    `options` when given, the recorded list)."""
    seen: list[tuple[int, bool]] = []
    out = model.clone()
    layer_lengths(out, seen)
    if before is not None:
        before(out)
    return (apply_toma(out, options) if options is not None else out), seen


def sequence(x) -> tuple[int, int]:
    """(prompt tokens kept, tokens in the whole sequence) of the positive's calls, as ComfyUI's
    own build_extra_conds lays them out (ar_len: the causal prompt, an edit's ViT tokens in it)."""
    from comfy.ldm.hidream_o1.conditioning import build_extra_conds

    extras = x.positive[0][1]
    conds = build_extra_conds(extras["text_input_ids"], x.latent,
                              ref_images=extras.get("reference_latents"))
    return conds["ar_len"], conds["vinput_mask"].shape[1]


def test_inactive_toma_runs_the_unpatched_models_calls_bit_identical(monkeypatch):
    """ToMA installed and running, merging off (start_percent 0.9 to end_percent 0.95 of the noise
    schedule, between the steps' sigmas): every layer call is the
    unpatched model's (the whole sequence on the first step, the tokens after the prompt with
    its kept keys and values afterwards), and the samples are the unpatched model's bit for bit."""
    if not available(NAME):
        return assert_absent(NAME)
    model, x, run = setup()
    plain, plain_seen = recorded(model)
    base = ch.sample(plain, x.latent, x.positive, x.negative, **run)
    model.model.diffusion_model.clear_kv_cache()
    sent: list[dict] = []
    monkeypatch.setattr(run_state, "send_stats", lambda node, stats: sent.append(stats))
    toma, seen = recorded(model, make_options(0.5, skip_blocks="none", start_percent=0.9,
                                                 end_percent=0.95))
    out = ch.sample(toma, x.latent, x.positive, x.negative, **run)
    assert seen == plain_seen
    layers = len(model.model.diffusion_model.language_model.layers)
    assert sum(past for _, past in seen) == (STEPS - 1) * layers    # one cond/uncond batch a step
    assert torch.equal(out, base)
    assert sent[-1]["layers_total"] == layers and sent[-1]["layers_merged"] == 0
    assert LOST not in sent[-1].get("note", "")
    assert model.model.diffusion_model._kv_cache_entries == []    # ComfyUI's own kept none


@pytest.mark.parametrize("name", [NAME, "hidream_o1_edit"])
def test_merged_layers_run_after_the_kept_prompt(name, monkeypatch):
    """Merging every layer: the first step's layers run the whole merged sequence, the later
    steps' only the merged tokens after the prompt (an edit's: with the reference's ViT tokens),
    over its kept keys and values; the samples are those of ToMA recomputing the prompt at every
    call (another pack's pass-through patch in every layer), to float rounding."""
    if not available(name):
        return assert_absent(name)
    model, x, run = setup(name)
    kept, full = sequence(x)
    options = make_options(0.5, skip_blocks="none")
    sent: list[dict] = []
    monkeypatch.setattr(run_state, "send_stats", lambda node, stats: sent.append(stats))
    toma, seen = recorded(model, options)
    out = ch.sample(toma, x.latent, x.positive, x.negative, **run)
    layers = len(model.model.diffusion_model.language_model.layers)
    first, later = seen[:layers], seen[layers:]
    merged = first[0][0]
    assert merged < full and all(s == (merged, False) for s in first)
    assert len(later) == (STEPS - 1) * layers
    assert all(s == (merged - kept, True) for s in later)
    assert sent[-1]["layers_merged"] == layers and LOST not in sent[-1].get("note", "")

    again, again_seen = recorded(model, options, before=pass_through)
    recomputed = ch.sample(again, x.latent, x.positive, x.negative, **run)
    assert all(s == (merged, False) for s in again_seen)
    assert LOST in sent[-1]["note"]
    # measured: 0.0 (the same sums in the same order here); 1e-5 of the samples' scale leaves
    # room for a BLAS that blocks a shorter sequence's rows otherwise
    torch.testing.assert_close(out, recomputed, rtol=0, atol=1e-5 * float(out.abs().max()))


def test_a_patch_put_in_after_toma_stops_the_kept_prompt(monkeypatch, caplog):
    """Another pack replacing one layer's patch after ToMA's (set_model_patch_replace over
    ToMA's): that layer would run the whole sequence on prompt rows ToMA no longer updates, so
    no call keeps the prompt, the user is told once, and the samples are those of ToMA with the
    prompt recomputed beside the same patch, bit for bit."""
    if not available(NAME):
        return assert_absent(NAME)
    model, x, run = setup()
    options = make_options(0.5, skip_blocks="none")

    def over(patched):
        patched.set_model_patch_replace(lambda args, extra: extra["original_block"](args), "dit",
                                        "double_block", 1)
        return patched

    toma, seen = recorded(model, options)
    with caplog.at_level(logging.WARNING, logger="ToMA"):
        out = ch.sample(over(toma), x.latent, x.positive, x.negative, **run)
    assert seen and not any(past for _, past in seen)
    told = [r for r in caplog.records if LOST in r.getMessage()]
    assert len(told) == 1
    reference, _ = recorded(model, options, before=pass_through)
    assert torch.equal(out, ch.sample(over(reference), x.latent, x.positive, x.negative, **run))


# case: (cfg, prompt tokens the negative drops, model calls a step)
BATCHES = {"cond": (1.0, 0, 1), "batched": (2.0, 0, 1), "apart": (2.0, 2, 2)}


@pytest.mark.parametrize("case", list(BATCHES))
def test_each_cond_batch_keeps_its_own_prompt(case):
    """cfg 1 runs the cond alone; cfg 2 cond and uncond, batched in one call where their
    prompts are equally long and in two calls a step where not: each call after the first step
    runs every layer after its own prompt, and the samples are ToMA's with the prompt
    recomputed (another prompt's keys and values would change them)."""
    if not available(NAME):
        return assert_absent(NAME)
    model, x, run = setup()
    cfg, dropped, calls = BATCHES[case]
    negative = x.negative[0][1]
    negative["text_input_ids"] = negative["text_input_ids"][:, dropped:]
    run = {**run, "cfg": cfg}
    options = make_options(0.5, skip_blocks="none")
    toma, seen = recorded(model, options)
    out = ch.sample(toma, x.latent, x.positive, x.negative, **run)
    layers = len(model.model.diffusion_model.language_model.layers)
    assert len(seen) == STEPS * calls * layers
    assert sum(past for _, past in seen) == (STEPS - 1) * calls * layers
    again, _ = recorded(model, options, before=pass_through)
    recomputed = ch.sample(again, x.latent, x.positive, x.negative, **run)
    # measured: 0.0 in all three; see test_merged_layers_run_after_the_kept_prompt
    torch.testing.assert_close(out, recomputed, rtol=0, atol=1e-5 * float(out.abs().max()))


def test_seam_smoothing_passes_keep_the_prompt_too():
    """Beside ComfyUI's HiDream-O1 Patch Seam Smoothing (the example workflow's setting: 2
    passes, 4 in the last steps), every pass of every call after the first runs after the kept
    prompt, and the samples are those with the prompt recomputed."""
    if not available(NAME):
        return assert_absent(NAME)
    from test_hidream_o1_seam_smoothing import seam_smoothing

    model, x, run = setup()
    options = make_options(0.5, skip_blocks="none")
    toma, seen = recorded(model, options)
    out = ch.sample(seam_smoothing(toma, "example"), x.latent, x.positive, x.negative, **run)
    layers = len(model.model.diffusion_model.language_model.layers)
    cold = [past for _, past in seen[:2 * layers]]                  # the first call's two passes
    assert not any(cold) and all(past for _, past in seen[2 * layers:])
    assert len(seen) > 2 * STEPS * layers
    again, _ = recorded(model, options, before=pass_through)
    recomputed = ch.sample(seam_smoothing(again, "example"), x.latent, x.positive, x.negative,
                           **run)
    # measured: 0.0; see test_merged_layers_run_after_the_kept_prompt
    torch.testing.assert_close(out, recomputed, rtol=0, atol=1e-5 * float(out.abs().max()))
