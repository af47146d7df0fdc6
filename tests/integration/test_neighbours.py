"""ToMA next to other nodes that patch the UNet: ComfyUI's own nodes (TomePatchModel,
SelfAttentionGuidance, PerturbedAttentionGuidance, FreeU, FreeU_V2, EasyCache, LazyCache), called
through their real node functions, and stand-ins for other packs' patches (regional prompting,
masked IPAdapter: patches that read the token grid from the sequence length).

Every composition runs in both node orders (neighbour before ToMA, ToMA before neighbour) through
the real sampler. ToMA decides at each block call, so a patch added after it counts the same.
Tiny SDXL at a 64x64 latent: attention levels 32x32 (1024 tokens) and 16x16 (256 tokens, with
the middle block). Tiny SD1.5 at 32x32: levels 32x32 (full latent resolution), 16x16, 8x8.
"""

from __future__ import annotations

import importlib
import logging
import math
import re

import pytest
import torch
from test_unet_variants import sd15_conds, tiny_sd15_patcher

import comfy_harness as ch
from toma_pack.nodes.toma_node import patch_model

ORDERS = ["neighbour_first", "toma_first"]
TEXT_TOKENS = 8   # context length of the test conds: attention with this many keys is cross


def toma(model, scope="auto", levels="all", ratio=0.5, skip="d0-4, s0-4"):
    patched = patch_model(
        model, ratio, 0, skip, 5, start_percent=0.0, end_percent=1.0,
        unet_levels=levels, merge_scope=scope, region="tile", tau=1000.0, unmerge="transpose",
        batch_policy="per_item", verbose=False, unique_id="5")
    return patched


def comfy_node(module: str, name: str, model, **inputs):
    """The MODEL output of ComfyUI's own node comfy_extras.<module>.<name>, called the way
    ComfyUI calls it: V3 nodes (io.ComfyNode) through `execute`, V1 through their FUNCTION."""
    cls = getattr(importlib.import_module(f"comfy_extras.{module}"), name)
    if hasattr(cls, "define_schema"):
        return cls.execute(model, **inputs).args[0]
    return getattr(cls(), cls.FUNCTION)(model, **inputs)[0]


def compose(model, order, neighbour, **toma_settings):
    if order == "neighbour_first":
        return toma(neighbour(model), **toma_settings)
    return neighbour(toma(model, **toma_settings))


def run_sdxl(model, steps=2, cfg=2.0, batch=1, **kwargs):
    positive, negative = ch.sdxl_conds(batch, 512, 512)
    return ch.sample(model, ch.empty_latent(model, batch, 64, 64), positive, negative,
                     steps=steps, cfg=cfg, **kwargs)


@pytest.fixture(scope="module")
def sdxl():
    return ch.tiny_sdxl_patcher()


@pytest.fixture
def self_attention(monkeypatch):
    """(query length, key length) of every self-attention call (cross-attention has the text's
    TEXT_TOKENS keys)."""
    import comfy.ldm.modules.attention as attention

    calls: list[tuple[int, int]] = []
    inner = attention.optimized_attention

    def recording(q, k, v, *args, **kwargs):
        # ComfyUI 0.34 and later hand q, k and v over in AttentionTensorContainers (read with
        # peek(), which leaves them to the attention function); older versions as tensors.
        qt, kt = (t.peek() if hasattr(t, "peek") else t for t in (q, k))
        if kt.shape[1] != TEXT_TOKENS:
            calls.append((qt.shape[1], kt.shape[1]))
        return inner(q, k, v, *args, **kwargs)

    monkeypatch.setattr(attention, "optimized_attention", recording)
    return calls


def note(stats) -> str:
    return stats[-1].get("note", "")


# ComfyUI's TomePatchModel ------------------------------------------------------------------------
TOME_RATIO = 0.3


@pytest.mark.parametrize("scope", ["auto", "block", "attention"])
@pytest.mark.parametrize("order", ORDERS)
def test_tome_keeps_the_full_resolution_level(comfyui_path, order, scope, self_attention, stats):
    """ComfyUI's ToMe merges queries at full latent resolution, reading the grid from the
    sequence length; ToMA at 0.25 used to hand it 768 of 1024 tokens there and it crashed
    ("expanded size of the tensor (512) must match the existing size (768)"). ToMA leaves that
    level to ToMe and merges the others."""
    model = compose(tiny_sd15_patcher(), order,
                    lambda m: comfy_node("nodes_tomesd", "TomePatchModel", m, ratio=TOME_RATIO),
                    scope=scope, ratio=0.25)
    positive, negative = sd15_conds(1)
    out = ch.sample(model, torch.zeros(1, 4, 32, 32), positive, negative, steps=2)
    assert torch.isfinite(out).all()
    tome_queries = 1024 - int(1024 * TOME_RATIO)
    # full level: ToMe's queries against all 1024 keys; 16x16 and 8x8: ToMA's 0.25
    assert set(self_attention) == {(tome_queries, 1024), (192, 192), (48, 48)}
    assert "TomePatchModel merges the full-resolution level" in note(stats)
    # ToMe is a known neighbour, harmless where ToMA merges: no fallback from block scope
    assert "merge_scope" not in note(stats)


# SelfAttentionGuidance and PerturbedAttentionGuidance ------------------------------------------
@pytest.mark.parametrize("scope", ["auto", "block"])
@pytest.mark.parametrize("order", ORDERS)
def test_sag_blur_mask_from_the_full_middle_grid(sdxl, order, scope, monkeypatch, stats):
    """SAG replaces the middle block's self-attention to record its 256x256 map (16x16 grid) and
    builds its blur mask from the map's size; a merged block would hand it 128 tokens."""
    import comfy_extras.nodes_sag as sag

    maps: list[tuple[int, ...]] = []
    blur_map = sag.create_blur_map

    def recording(x0, attn, *args, **kwargs):
        maps.append(tuple(attn.shape[-2:]))
        return blur_map(x0, attn, *args, **kwargs)

    monkeypatch.setattr(sag, "create_blur_map", recording)
    model = compose(sdxl, order, lambda m: comfy_node(
        "nodes_sag", "SelfAttentionGuidance", m, scale=0.5, blur_sigma=2.0), scope=scope)
    out = run_sdxl(model)
    assert torch.isfinite(out).all()
    assert maps and set(maps) == {(256, 256)}
    assert "replaces self-attention in some blocks (attn_and_record)" in note(stats)
    # the other blocks of both levels still merge
    assert {lv["name"]: lv["merged_tokens"] for lv in stats[-1]["levels"]} == {
        "32x32": 512, "16x16": 128}


@pytest.mark.parametrize("scope", ["auto", "block"])
@pytest.mark.parametrize("order", ORDERS)
def test_pag_perturbs_the_full_middle_grid(sdxl, order, scope, monkeypatch, stats):
    """PAG adds its self-attention replacement for the middle block only inside its own
    guidance call (after every node has run): ToMA sees it at that call and leaves the block."""
    import comfy.model_patcher

    seen: list[int] = []
    set_replace = comfy.model_patcher.set_model_options_patch_replace

    def recording_replace(model_options, patch, *args, **kwargs):
        def recorded(q, k, v, extra_options, *rest, **kw):
            seen.append(v.shape[1])
            return patch(q, k, v, extra_options, *rest, **kw)
        return set_replace(model_options, recorded, *args, **kwargs)

    monkeypatch.setattr(comfy.model_patcher, "set_model_options_patch_replace", recording_replace)
    model = compose(sdxl, order, lambda m: comfy_node(
        "nodes_pag", "PerturbedAttentionGuidance", m, scale=3.0), scope=scope)
    out = run_sdxl(model)
    assert torch.isfinite(out).all()
    assert seen and set(seen) == {256}
    assert "another node replaces self-attention in some blocks" in note(stats)


# FreeU, FreeU_V2: patches between UNet blocks, outside the transformer blocks --------------------
FREEU_CHANGE = {"FreeU": 0.397, "FreeU_V2": 0.236}


@pytest.mark.parametrize("node", ["FreeU", "FreeU_V2"])
def test_freeu_composes_in_block_scope(sdxl, node, self_attention, stats):
    """FreeU scales UNet features between blocks, where ToMA's tokens are whole again: ToMA
    keeps block scope, both orders give the same output, and FreeU still changes it."""
    def freeu(m):
        return comfy_node("nodes_freelunch", node, m, b1=1.3, b2=1.4, s1=0.9, s2=0.2)

    outs = {order: run_sdxl(compose(sdxl, order, freeu, levels="auto")) for order in ORDERS}
    alone = run_sdxl(toma(sdxl, levels="auto"))
    assert torch.equal(outs["neighbour_first"], outs["toma_first"])
    # FreeU's change of the output, relative L2: measured 0.397 (FreeU), 0.236 (FreeU_V2) on
    # every version; bound / 2
    change = float((outs["toma_first"] - alone).norm() / alone.norm())
    assert change > FREEU_CHANGE[node] / 2, change
    assert set(self_attention) == {(512, 512), (256, 256)}
    assert all("note" not in s for s in stats)   # no scope fallback


# EasyCache, LazyCache: wrappers that skip whole model calls ---------------------------------------
@pytest.mark.parametrize("node", ["EasyCache", "LazyCache"])
def test_step_caches_skip_steps_and_toma_merges_the_rest(sdxl, node, stats, caplog):
    def cache(m):
        return comfy_node("nodes_easycache", f"{node}Node", m, reuse_threshold=0.2,
                          start_percent=0.15, end_percent=0.95, verbose=False)

    outs = {}
    for order in ORDERS:
        caplog.clear()
        with caplog.at_level(logging.INFO):
            outs[order] = run_sdxl(compose(sdxl, order, cache, levels="auto"), steps=8)
        skipped = re.search(rf"{node} - skipped (\d+)/8 steps", caplog.text)
        assert skipped and int(skipped.group(1)) > 0, caplog.text
        assert stats[-1]["steps_merged"] == 8 - int(skipped.group(1))
        assert stats[-1]["levels"] == [{"name": "32x32", "tokens": 1024, "merged_tokens": 512}]
    assert torch.equal(outs["neighbour_first"], outs["toma_first"])
    assert torch.isfinite(outs["toma_first"]).all()


# A wrapper that runs the model more than once in one call -------------------------------------
def run_twice(model):
    """A clone of `model` whose diffusion model runs first on its input rolled by a quarter of
    the latent's width and then on the input itself, inside one model call, returning the
    second output (the shape of ComfyUI's HiDream-O1 seam smoothing, which runs the model
    again on rolled pixels)."""
    from comfy.patcher_extension import WrappersMP

    def wrapper(executor, x, *args, **kwargs):
        executor(torch.roll(x, x.shape[-1] // 4, dims=-1), *args, **kwargs)
        return executor(x, *args, **kwargs)

    out = model.clone()
    out.add_wrapper_with_key(WrappersMP.DIFFUSION_MODEL, "run_twice", wrapper)
    return out


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("family", ["sdxl", "flux"])
def test_each_pass_of_a_model_run_twice_in_one_call_gets_its_own_plans(sdxl, family, order,
                                                                      stats):
    """Each pass over the blocks within one model call gets plans built from its own tokens:
    the second pass here sees the unrolled input, so the samples are ToMA's alone, bit for
    bit, and twice as many plans are built. Reusing the first pass's plans (built from rolled
    tokens) would change them."""
    if family == "sdxl":
        model, run = sdxl, run_sdxl
    else:
        model = ch.tiny_flux_patcher()
        positive, negative = ch.flux_conds(1, TEXT_TOKENS)

        def run(m):
            return ch.sample(m, ch.empty_latent(m, 1, 32, 32), positive, negative, steps=2,
                             cfg=2.0)

    alone = run(toma(model, skip="none"))
    built = stats[-1]["plans_built"]
    assert built > 0
    out = run(compose(model, order, run_twice, skip="none"))
    assert torch.equal(out, alone)
    assert stats[-1]["plans_built"] == 2 * built


# Other packs' patches inside the transformer blocks (merge_scope auto vs block) -----------------
def grid_reading_attn2_patch(lengths: list[int]):
    """Like regional prompting / attention couple: a per-token mask built from the latent size
    and the sequence length (the block's downsampling is sqrt(latent tokens / sequence))."""
    def patch(n, context, value, extra_options):
        latent_h, latent_w = extra_options["original_shape"][-2:]
        scale = math.sqrt(latent_h * latent_w / n.shape[1])
        h, w = round(latent_h / scale), round(latent_w / scale)
        lengths.append(n.shape[1])
        mask = torch.ones(1, h * w, 1)   # a region mask on the grid: fails if tokens were merged
        return n * mask, context, value
    return patch


@pytest.mark.parametrize("order", ORDERS)
def test_auto_falls_back_to_attention_scope_for_in_block_patches(sdxl, order, self_attention,
                                                                 stats):
    lengths: list[int] = []

    def regional(m):
        m = m.clone()
        m.set_model_attn2_patch(grid_reading_attn2_patch(lengths))
        return m

    out = run_sdxl(compose(sdxl, order, regional, levels="auto"))
    assert torch.isfinite(out).all()
    assert set(lengths) == {1024, 256}                      # cross-attention sees every token
    assert set(self_attention) == {(512, 512), (256, 256)}  # self-attention still merged
    assert "merge_scope auto: attention scope where other nodes patch inside transformer " \
           "blocks (attn2_patch)" in note(stats)


def test_explicit_block_scope_keeps_block_and_warns(sdxl, stats):
    lengths: list[int] = []

    def recording(n, context, value, extra_options):
        lengths.append(n.shape[1])
        return n, context, value

    model = sdxl.clone()
    model.set_model_attn2_patch(recording)
    out = run_sdxl(toma(model, scope="block", levels="auto"))
    assert torch.isfinite(out).all()
    assert set(lengths) == {512, 256}
    assert "merge_scope block: other nodes' patches inside transformer blocks (attn2_patch) " \
           "see merged tokens" in note(stats)


@pytest.mark.parametrize("order", ORDERS)
def test_attn2_replacement_reading_the_grid_sees_every_token(sdxl, order):
    """Masked IPAdapter-style: an attn2 replacement sizes its mask from the query length."""
    import comfy.ldm.modules.attention as attention

    lengths: list[int] = []

    def masked(q, k, v, extra_options):
        lengths.append(q.shape[1])
        return attention.optimized_attention(q, k, v, extra_options["n_heads"])

    def ipadapter(m):
        m = m.clone()
        for block in (("input", 4), ("input", 5), ("output", 3), ("output", 4), ("output", 5)):
            m.set_model_attn2_replace(masked, *block)
        return m

    out = run_sdxl(compose(sdxl, order, ipadapter, levels="auto"))
    assert torch.isfinite(out).all() and set(lengths) == {1024}


@pytest.mark.parametrize("order", ORDERS)
def test_other_attn1_patches_see_every_token_in_attention_scope(sdxl, order, self_attention):
    """ToMA's merge runs after every other attn1 patch and its unmerge before every other attn1
    output patch, whichever node came first."""
    seen: list[int] = []

    def before(n, context, value, extra_options):
        seen.append(n.shape[1])
        return n, context, value

    def after(n, extra_options):
        seen.append(n.shape[1])
        return n

    def other(m):
        m = m.clone()
        m.set_model_attn1_patch(before)
        m.set_model_attn1_output_patch(after)
        return m

    out = run_sdxl(compose(sdxl, order, other, scope="attention", levels="auto"))
    assert torch.isfinite(out).all()
    assert set(seen) == {1024, 256}
    assert set(self_attention) == {(512, 512), (256, 256)}


# The block forward: any call signature, any subclass ----------------------------------------------
def test_block_forward_passes_extra_arguments_through(sdxl, stats):
    """Another pack's block forward (patched before ToMA) takes an extra keyword; a wrapper
    patched after ToMA calls the chain positionally with it: ToMA passes both through."""
    from toma_pack.nodes.unet_patch import transformer_blocks

    received: list[str] = []
    model = sdxl.clone()
    paths = [name for name, _ in transformer_blocks(model.get_model_object("diffusion_model"))]

    def inner_patch(block):
        def forward(x, context=None, transformer_options=None, tag=None):
            received.append(tag)
            return type(block).forward(block, x, context, transformer_options)
        return forward

    def outer_patch(previous):
        def forward(x, context=None, transformer_options=None):
            return previous(x, context, transformer_options, tag="outer")
        return forward

    for path, block in transformer_blocks(model.get_model_object("diffusion_model")):
        model.add_object_patch(f"diffusion_model.{path}.forward", inner_patch(block))
    patched = toma(model, levels="auto").clone()
    for path in paths:
        key = f"diffusion_model.{path}.forward"
        patched.add_object_patch(key, outer_patch(patched.object_patches[key]))
    out = run_sdxl(patched)
    assert torch.isfinite(out).all() and received and set(received) == {"outer"}
    assert stats[-1]["layers_merged"] == 5      # the 1024-token level's blocks
    assert "(forward)" in note(stats)           # another pack's forward: attention scope


def test_spatial_transformer_subclasses_are_found(comfyui_path, self_attention, stats):
    """Packs that swap a module's class for a subclass keep ToMA working (isinstance)."""
    from comfy.ldm.modules.attention import BasicTransformerBlock, SpatialTransformer

    class OtherSpatialTransformer(SpatialTransformer):
        pass

    class OtherBlock(BasicTransformerBlock):
        pass

    model = ch.tiny_sdxl_patcher()
    for module in model.model.diffusion_model.modules():
        if type(module) is SpatialTransformer:
            module.__class__ = OtherSpatialTransformer
        elif type(module) is BasicTransformerBlock:
            module.__class__ = OtherBlock
    out = run_sdxl(toma(model, levels="all"))
    assert torch.isfinite(out).all()
    assert set(self_attention) == {(512, 512), (128, 128)}
    assert stats[-1]["layers_merged"] == stats[-1]["layers_total"] == 17
