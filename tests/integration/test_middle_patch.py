"""A middle patch beside ToMA on ComfyUI's UNet (the tiny SDXL-layout model).

ComfyUI's BasicTransformerBlock runs the model's `middle_patch` patches (ModelPatcher.
set_model_patch(fn, "middle_patch"), the same call in v0.3.64, v0.8.0 and v0.33.0; GLIGEN puts
its own there per call) between self-attention and cross-attention, on the residual stream:
`x = p(x, extra_options)` after `x = n + x`. By ComfyUI's convention such a patch sees the
block's whole token grid: x [B, h*w, C] with (h, w) and C those of extra_options
["activations_shape"] [B, C, h, w], so it can read positions on the grid (GLIGEN's boxes).

ToMA counts middle_patch among the patches inside a block (nodes/unet_neighbours.py,
IN_BLOCK_PATCHES). With merge_scope auto (the default) a block with one runs in attention
scope, not unmerged: only self-attention runs on merged tokens and is unmerged before the
residual add, so the middle patch gets the full grid, and the stats' note says why; explicit
`attention` does the same silently; explicit `block` keeps block scope, hands the patch merged
tokens, and the note warns of that.

The tests install a middle patch that records what it gets and adds a ramp over the grid's
rows (read from activations_shape, as a grid-reading patch would; on a sequence of another
length it adds nothing, so that the check of what it got is what fails), in both node orders
(the patch before the ToMA node, and after), with ToMAAdvanced merging every level, sample with
ComfyUI's sampler (euler, 2 steps, CFG 2: cond and uncond in one batch of 2), and check what the
patch saw in each of the 17 blocks and 2 steps, that self-attention still merged (the stats and
the self-attention lengths), the note, and the patch's effect on the samples: both orders
alike, the same as attention scope, as large as without ToMA.

Why: no other test installs a middle patch, so ToMA could stop looking for one and every other
test would pass. Mutation this module catches (applied to a copy of the working tree, run on
ComfyUI v0.33.0): "middle_patch" removed from IN_BLOCK_PATCHES fails 5 of the 7 tests:
test_middle_patch_sees_the_full_grid with auto scope in both orders ("middle patch got 512
tokens of the 32x32 grid (1024 tokens) in block ('input', 4)"), test_explicit_block_scope_warns
in both orders (the note is empty) and test_the_patch_acts_as_without_toma ("merge_scope auto
with a middle patch is not attention scope in every block"). Explicit attention scope does not
look at the patch lists, and passes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from test_widgets_reach import toma_advanced

import comfy_harness as ch

ORDERS = ("patch_first", "toma_first")
LAYERS = 17            # transformer blocks of the tiny SDXL: 5 at 32x32, 12 at 16x16
STEPS = 2
TEXT_TOKENS = 8        # context length of the conds: attention with this many keys is cross
RAMP = 0.5             # the patch's ramp runs from -RAMP to +RAMP over the grid's rows
AUTO_NOTE = ("merge_scope auto: attention scope where other nodes patch inside transformer "
             "blocks (middle_patch), so that they see every token")
BLOCK_NOTE = ("merge_scope block: other nodes' patches inside transformer blocks "
              "(middle_patch) see merged tokens")


@dataclass(frozen=True)
class Seen:
    """One middle patch call: the tokens and channels of x, and extra_options' grid."""

    tokens: int
    channels: int
    activations_shape: tuple[int, ...]
    block: tuple

    @property
    def grid(self) -> str:
        return f"{self.activations_shape[-2]}x{self.activations_shape[-1]}"


def middle_patch(seen: list[Seen]) -> Callable:
    """A middle patch: records each call, and adds to x a ramp over the grid's rows (from
    activations_shape); x of another length than the grid's gets nothing added."""
    def patch(x: torch.Tensor, extra_options: dict) -> torch.Tensor:
        shape = tuple(extra_options["activations_shape"])
        seen.append(Seen(x.shape[1], x.shape[2], shape, tuple(extra_options.get("block") or ())))
        h, w = shape[-2:]
        if x.shape[1] != h * w:
            return x
        rows = torch.linspace(-RAMP, RAMP, h, dtype=x.dtype, device=x.device)
        return x + rows.repeat_interleave(w).view(1, h * w, 1)
    return patch


def with_middle_patch(model, seen: list[Seen]):
    """A clone of `model` with the middle patch, installed through ComfyUI's API."""
    m = model.clone()
    m.set_model_patch(middle_patch(seen), "middle_patch")
    return m


def compose(model, order: str, seen: list[Seen], scope: str = "auto"):
    """The model through the patch and ToMAAdvanced (every level merging), in `order`."""
    def toma(m):
        return toma_advanced(m, unet_levels="all", merge_scope=scope)
    if order == "patch_first":
        return toma(with_middle_patch(model, seen))
    return with_middle_patch(toma(model), seen)


def run(model) -> torch.Tensor:
    positive, negative = ch.sdxl_conds(1, 512, 512)
    return ch.sample(model, ch.empty_latent(model, 1, 64, 64), positive, negative, steps=STEPS,
                     cfg=2.0)


def distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 distance of samples a to samples b."""
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def sdxl():
    return ch.tiny_sdxl_patcher()


@pytest.fixture
def self_attention(monkeypatch):
    """Query lengths of every self-attention call (cross-attention has TEXT_TOKENS keys)."""
    import comfy.ldm.modules.attention as attention

    lengths: list[int] = []
    inner = attention.optimized_attention

    def recording(q, k, v, *args, **kwargs):
        if k.shape[1] != TEXT_TOKENS:
            lengths.append(q.shape[1])
        return inner(q, k, v, *args, **kwargs)

    monkeypatch.setattr(attention, "optimized_attention", recording)
    return lengths


def check_full_grid(seen: list[Seen]) -> None:
    """Every middle patch call got the whole grid of its block, in every block and step."""
    assert len(seen) == LAYERS * STEPS, len(seen)   # one model call per step (cond + uncond)
    for call in seen:
        _, channels, h, w = call.activations_shape
        assert call.tokens == h * w and call.channels == channels, (
            f"middle patch got {call.tokens} tokens of the {call.grid} grid "
            f"({h * w} tokens) in block {call.block}")
    assert {call.grid for call in seen} == {"32x32", "16x16"}


@pytest.mark.parametrize("scope", ["auto", "attention"])
@pytest.mark.parametrize("order", ORDERS)
def test_middle_patch_sees_the_full_grid(sdxl, order, scope, stats, self_attention):
    """merge_scope auto (the default) and attention: the middle patch gets every token of its
    block's grid, self-attention still merges in all 17 blocks, and auto says why it chose
    attention scope."""
    seen: list[Seen] = []
    out = run(compose(sdxl, order, seen, scope))
    assert torch.isfinite(out).all()
    check_full_grid(seen)
    # self-attention still runs merged in every block, at both levels
    assert stats[-1]["layers_merged"] == stats[-1]["layers_total"] == LAYERS, stats[-1]
    assert set(self_attention) == {512, 128}
    if scope == "auto":
        assert AUTO_NOTE in stats[-1].get("note", ""), stats[-1]
    else:
        assert "note" not in stats[-1], stats[-1]


@pytest.mark.parametrize("order", ORDERS)
def test_explicit_block_scope_warns(sdxl, order, stats):
    """merge_scope block keeps the whole block merged, as asked: the middle patch gets the
    merged tokens (half the grid) and the note says so."""
    seen: list[Seen] = []
    run(compose(sdxl, order, seen, "block"))
    assert BLOCK_NOTE in stats[-1].get("note", ""), stats[-1]
    assert len(seen) == LAYERS * STEPS
    assert all(call.tokens * 2 == call.activations_shape[-2] * call.activations_shape[-1]
               for call in seen), {(call.grid, call.tokens) for call in seen}


# The patch's effect (relative L2, 2 steps), measured on ComfyUI v0.3.64, v0.8.0 and v0.33.0
# alike: it changes the unmerged model's samples by 0.2108 (bound: 10% either way; the patch
# itself acts) and ToMA's (attention scope, every level) by 0.2174, 3.1% more (bound: 3.1% x
# 1.5). ToMA's distance to the unmerged model is
# 0.1586 with the patch in both (bound x 1.2), 0.1614 without it in both; were the patch lost
# in ToMA's blocks it would be 0.2557, ToMA's samples against the patch's own.
EFFECT_WITHOUT_TOMA = 0.2108
EFFECT_GAP = 0.031
TOMA_DISTANCE = 0.1586
LOST = 0.2557


def test_the_patch_acts_as_without_toma(sdxl):
    """Both orders give the same samples (ToMA decides at each block call, so a patch added
    after it counts the same), the same as merge_scope attention (auto chose it in every
    block), and the patch changes ToMA's samples as much as it changes the unmerged model's,
    leaving ToMA's distance to the unmerged model what it is without the patch."""
    plain = run(sdxl)
    alone = run(with_middle_patch(sdxl, []))
    attention = run(toma_advanced(sdxl, unet_levels="all", merge_scope="attention"))
    outs = {order: run(compose(sdxl, order, [])) for order in ORDERS}
    assert torch.equal(outs["patch_first"], outs["toma_first"]), \
        distance(outs["patch_first"], outs["toma_first"])
    scoped = run(compose(sdxl, "toma_first", [], "attention"))
    assert torch.equal(outs["toma_first"], scoped), (
        f"merge_scope auto with a middle patch is not attention scope in every block: "
        f"samples {distance(outs['toma_first'], scoped):.4g} apart")

    effect = distance(alone, plain)
    effect_with_toma = distance(outs["toma_first"], attention)
    assert abs(effect - EFFECT_WITHOUT_TOMA) < EFFECT_WITHOUT_TOMA * 0.1, effect
    assert abs(effect_with_toma / effect - 1) < EFFECT_GAP * 1.5, (effect_with_toma, effect)
    toma_distance = distance(outs["toma_first"], alone)
    assert toma_distance < TOMA_DISTANCE * 1.2 < LOST, toma_distance


def test_a_middle_patch_leaves_transformer_blocks_merging(stats) -> None:
    """ComfyUI's transformer blocks never call middle patches (only the UNet's
    BasicTransformerBlock does): on Flux one beside ToMA changes nothing, every block still
    merges and no note says otherwise. With middle_patch counted among a transformer block's
    patches (the check ToMA makes for patches those blocks do call), nothing would merge."""
    seen: list[Seen] = []
    model = ch.tiny_flux_patcher()
    merged = toma_advanced(with_middle_patch(model, seen), skip_blocks="none")
    latent = ch.empty_latent(merged, 1, 32, 32)
    positive, _ = ch.flux_conds(1, TEXT_TOKENS)
    ch.sample(merged, latent, positive, positive, steps=STEPS, cfg=1.0)
    run = stats[-1]
    assert run["layers_merged"] == run["layers_total"] == 4, run
    assert "middle_patch" not in (run.get("note") or "")
    assert not seen
