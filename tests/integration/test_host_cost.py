"""What ToMA costs the host per model call, counted through real ComfyUI sampling.

On a fast GPU the host issues every kernel and runs every block patch's Python, and can become
the bottleneck: so kernel launches and Python function calls per steady model call are held
here, unmerged against ToMA, with every merged block active and tiny tensors (the call is
almost all host work): SDXL's 70 transformer blocks (unet_levels "all" on a 32x32 latent) and
Flux.1's 19 + 38 blocks at the node defaults. op_counts.py says what counts. Counts are the
same at every run, where times are not; bench/speed/host_cost.py times the same calls.

Transformer blocks in a row hand their grid on in region order (MergePlan.finish keep_order):
the samples are bit for bit those of blocks that each gather in and out, and a block another
node patched after ToMA gets the grid in its own order.
"""

from __future__ import annotations

import pytest
import torch
from op_counts import OpCounter

import comfy_harness as ch
from bench.shared.host_counts import PerCall
from toma_pack.nodes import unet_patch
from toma_pack.nodes.apply import apply_toma
from toma_pack.nodes.options import make_options

# ToMA's extra kernel launches per steady call over the unmerged call's, as a share of it.
# Measured: SDXL 1692 -> 1932 (+14.2%) on all three trees; Flux 2448 -> 2759 (+12.7%) on v0.8.0
# and v0.33.0, 2733 -> 3044 (+11.4%) on v0.3.64.
LAUNCH_BUDGET = {"sdxl": 0.15, "flux": 0.15}
# ToMA's extra Python function calls per block call (the unmerged calls' own count differs by
# ComfyUI version; ToMA's barely does). Measured: SDXL 24.6-24.8 (1725-1733 over 70 blocks),
# Flux 34.3 (1956 over 57) on v0.3.64 and v0.8.0; on v0.33.0 Flux 35.2 (2004), whose merged
# blocks' forwards carry one more patch (the reference spans of "index_timestep_zero" calls).
PYTHON_BUDGET = {"sdxl": 26.5, "flux": 37}
BLOCKS = {"sdxl": 70, "flux": 19 + 38}
OPTIONS = {"sdxl": {"unet_levels": "all"}, "flux": {}}
SIDE = 32       # latent side: SDXL's 16x16 and 8x8 attention levels, Flux's 16x16 tokens
STEPS = 4


def sample(name: str, patcher) -> torch.Tensor:
    """STEPS euler steps, CFG 2 for SDXL (cond and uncond in one call), 1 for Flux."""
    if name == "sdxl":
        positive, negative = ch.sdxl_conds(1, SIDE * 8, SIDE * 8)
    else:
        positive, negative = ch.flux_conds(1, 16)
    with ch.attention_backend("sdpa"):
        return ch.sample(patcher, ch.empty_latent(patcher, 1, SIDE, SIDE), positive, negative,
                         steps=STEPS, cfg=2.0 if name == "sdxl" else 1.0)


def counted(name: str, counter, toma: bool, **options):
    """A real-depth tiny model with `counter` outermost, ToMA (OPTIONS[name] + options) inside,
    sampled; returns the samples."""
    build = ch.tiny_sdxl_patcher if name == "sdxl" else ch.tiny_flux_patcher
    patcher = build(real_depths=True)
    counter.install(patcher)
    if toma:
        patcher = apply_toma(patcher, make_options(**OPTIONS[name], **options))
    return sample(name, patcher)


def steady(per_call: list[int]) -> int:
    """The count of every call after the first (which builds index tables), all the same."""
    assert len(per_call) >= STEPS, per_call
    assert len(set(per_call[1:])) == 1, per_call
    return per_call[-1]


@pytest.mark.parametrize("name", ["sdxl", "flux"])
def test_kernel_launches_per_steady_call_within_budget(name):
    plain, toma = OpCounter(), OpCounter()
    counted(name, plain, toma=False)
    counted(name, toma, toma=True)
    base, merged = steady(plain.launches), steady(toma.launches)
    print(f"{name}: launches {base} -> {merged} (+{(merged - base) / base:.1%})")
    assert 0 < merged - base <= LAUNCH_BUDGET[name] * base
    assert all(c["plan_weights"] > 0 for c in toma.ops[1:])    # plans built, merging ran


@pytest.mark.parametrize("name", ["sdxl", "flux"])
def test_python_calls_per_steady_call_within_budget(name):
    plain, toma = PerCall("python"), PerCall("python")
    counted(name, plain, toma=False)
    counted(name, toma, toma=True)
    base, merged = steady(plain.counts), steady(toma.counts)
    per_block = (merged - base) / BLOCKS[name]
    print(f"{name}: Python calls {base} -> {merged} (+{(merged - base) / base:.1%}), "
          f"{per_block:.1f} per block")
    assert 0 < per_block <= PYTHON_BUDGET[name]


def gathers(counter: OpCounter) -> int:
    """Gathers (aten index) of the last model call."""
    return counter.ops[-1]["index"]


def test_blocks_hand_the_grid_on_in_region_order(monkeypatch):
    """SDXL's 11 transformers (70 blocks), every one merged: one gather in and one out per
    transformer instead of per block, and the same samples bit for bit as without handing on."""
    handed, each = OpCounter(), OpCounter()
    got = counted("sdxl", handed, toma=True)
    monkeypatch.setattr(unet_patch, "handed_on", lambda diffusion_model: {})
    want = counted("sdxl", each, toma=True)
    assert torch.equal(got, want)
    assert gathers(each) - gathers(handed) == 2 * (70 - 11), (gathers(each), gathers(handed))


def test_a_block_another_node_patched_after_toma_gets_grid_order(monkeypatch):
    """Another node's object patch replaces ToMA's on the second block of a transformer at the
    16x16 level (2x2 tiles, so region order is not grid order; that block runs its own forward,
    unmerged): the block before it hands it the grid in grid order, and the samples are those
    of blocks that never hand on."""
    path = "diffusion_model.input_blocks.4.1.transformer_blocks.1.forward"

    def with_replacement(patcher):
        block = patcher.get_model_object(path.rsplit(".", 1)[0])
        patcher.add_object_patch(path, lambda x, *args, **kwargs: type(block).forward(
            block, x, *args, **kwargs))
        return patcher

    outputs = []
    for hand_on in (True, False):
        if not hand_on:
            monkeypatch.setattr(unet_patch, "handed_on", lambda diffusion_model: {})
        patcher = ch.tiny_sdxl_patcher(real_depths=True)
        patcher = with_replacement(apply_toma(patcher, make_options(**OPTIONS["sdxl"])))
        outputs.append(sample("sdxl", patcher))
    assert torch.equal(outputs[0], outputs[1])
