"""ToMA through ComfyUI's own multi-GPU engine (v0.33: comfy/multigpu.py, the MultiGPU CFG Split
and Select Model Device nodes): each device gets a copy of the model from the loader's factory
and runs its work units (here cond and uncond) in a thread of its own.

Run here on two CPU devices: ComfyUI's device list is replaced by [cpu, cpu:0] (two devices
that compare unequal, as its per-device dicts need), the tiny model's loader factory set as a
core loader sets it. Real threads, real per-device copies, ComfyUI's own dispatch. What this
does not cover: every tensor reports the CPU, so a tensor on the wrong device cannot fail
here (the tests check instead which model object's blocks each thread ran); no CUDA streams,
per-GPU memory, lowvram loading, half precision or ModelPatcherDynamic. Select Model Device's
gpu:N branch resolves to its cpu branch on a CPU device: its helper that the gpu:N branch
calls (_retarget_patcher) is called directly with the second device.

ToMA's object patches are bound to modules; each device's copy has modules of its own, and
ToMA makes its patches again for them (forward_patches.ForwardPatches, on ComfyUI's multi-GPU
callbacks): every thread runs its own copy's blocks, merged.
"""

from __future__ import annotations

import importlib.util
import threading
from collections import defaultdict

import peers
import pytest
import torch
from compatibility import NOT_LOADED, ROWS
from peer_cases import ORDERS, case, composed, version
from tie_gaps import parting_gaps

import comfy_harness as ch
from toma_pack.nodes import unet_patch
from toma_pack.toma_core import plan_op

STEPS = 3
SECOND = torch.device("cpu", 0)
ROW = {row.node: row for row in ROWS if row.pack == "ComfyUI"}
# Relative L2 of ToMA's samples to the same multi-GPU run unmerged: 1.5 x measured (0.391, as
# far as ToMA moves the single-device run).
BOUND = 0.58
# Relative L2 of the CFG split's samples to ToMA's on one device, both merging with the same
# destinations: the batch split's rounding. Measured 5.0e-6 (avx512; 5.4e-6 without size
# weighting), 6.4e-6 (ATEN_CPU_CAPABILITY avx2), 3.1e-6 (default).
SAME_DESTINATIONS_BOUND = 2e-5
# A greedy pick of the split run parting from one device's at a tie to float precision gains
# about a gain's rounding more (64 tokens per region x 2 x 1e-6; measured 0 to 1.2e-7).
TIE_BOUND = 1e-4


def multigpu_available() -> bool:
    ch.ensure_comfy()
    return importlib.util.find_spec("comfy.multigpu") is not None


@pytest.fixture
def sdxl_two_devices(monkeypatch):
    """A tiny SDXL case whose loader factory ComfyUI can copy the model with, and ComfyUI's
    device list [cpu, cpu:0]."""
    import comfy.model_management as mm

    if multigpu_available():
        monkeypatch.setattr(mm, "get_all_torch_devices",
                            lambda exclude_current=False: [torch.device("cpu"), SECOND])
    c = case("sdxl")
    c.model.cached_patcher_init = (lambda *args, **kwargs: case("sdxl").model, ())
    yield c
    ch.unload_models()


class SameDestinations:
    """The destinations of ToMA on one device, per batch item (cond or uncond, as ComfyUI's
    cond_or_uncond names it) and plan build, handed to the greedy of a multi-device run, where
    each thread builds the plans of its own item: both runs then merge alike and their samples
    differ by the batch split's rounding alone. The split run's own picks are kept beside: where
    they part from the given ones, by how much gain (tie_gaps.py: why ties part)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.recorded: dict[int, list[torch.Tensor]] = defaultdict(list)   # item -> [R, k]s
        self.handed: dict[int, int] = defaultdict(int)
        self.gaps: list[float] = []
        self.replaying = False
        self.local = threading.local()
        greedy, plan_for = plan_op.greedy_facility_location, unet_patch.UNetToMA.plan_for

        def items_plan_for(toma, x, options, call, features):
            self.local.items = tuple(options.get("cond_or_uncond") or ())
            return plan_for(toma, x, options, call, features)

        def handing_greedy(sim, k, valid=None, weight=None):
            own = greedy(sim, k, valid, weight)
            items = self.local.items
            assert len(items) == own.shape[0], (items, tuple(own.shape))
            if not self.replaying:
                for item, picks in zip(items, own, strict=True):
                    self.recorded[item].append(picks)
                return own
            given = torch.stack([self.recorded[item][self.handed[item]] for item in items])
            for item in items:
                self.handed[item] += 1
            self.gaps += parting_gaps(sim, own, given)
            return given

        monkeypatch.setattr(unet_patch.UNetToMA, "plan_for", items_plan_for)
        monkeypatch.setattr(plan_op, "greedy_facility_location", handing_greedy)


def block_owners(patchers: dict[str, object]) -> tuple[dict, callable]:
    """({(owner, thread): [query lengths]}, remove): pre-hooks on the self-attention's query
    projection of every transformer block of each patcher's own model object (ComfyUI calls it
    whether the block runs CrossAttention.forward or an attn1 replace, as ToMA's is)."""
    ran: dict[tuple[str, str], list[int]] = defaultdict(list)
    handles = []
    for owner, patcher in patchers.items():
        for module in patcher.model.diffusion_model.modules():
            if type(module).__name__ == "BasicTransformerBlock":
                handles.append(module.attn1.to_q.register_forward_pre_hook(
                    lambda m, args, o=owner: ran[(o, threading.current_thread().name)].append(
                        int(args[0].shape[1]))))
    return ran, lambda: [h.remove() for h in handles]


@pytest.mark.rounding
@pytest.mark.parametrize("order", ORDERS)
def test_multigpu_cfg_split(order, sdxl_two_devices, monkeypatch) -> None:
    """MultiGPU CFG Split before or after ToMA: cond and uncond run in two threads, each on its
    own device's copy of the model, and both merge; the samples within a measured bound of the
    same multi-GPU run unmerged, and, merging with the destinations of ToMA on one device, its
    samples but for the batch split's rounding (size-weighted attention included: each thread
    weights its own item's keys by its own plan's sizes)."""
    if not multigpu_available():
        assert ROW["MultiGPU_WorkUnits"].on(version()) == NOT_LOADED
        return
    assert unet_patch.SIZE_WEIGHTED
    c = sdxl_two_devices
    node = peers.comfy_node("nodes_multigpu", "MultiGPU_WorkUnits")

    def split(model):
        return peers.run_node(node, model=model, max_gpus=2)[0]

    destinations = SameDestinations(monkeypatch)
    single = c.run(c.toma(c.model), STEPS)
    alone = c.run(split(c.model), STEPS)
    model = composed(order, split, c.toma, c.model)
    copies = model.get_additional_models_with_key("multigpu")
    assert [m.load_device for m in copies] == [SECOND]
    ran, remove = block_owners({"first": model, "second": copies[0]})
    destinations.replaying = True
    try:
        both = c.run(model, STEPS)
    finally:
        remove()
    threads = defaultdict(set)
    for owner, thread in ran:
        threads[owner].add(thread)
    print(f"{order}: {both.distance(alone):.3f} from the unmerged multi-GPU run; blocks by "
          f"(copy, thread): { {k: sorted(set(v)) for k, v in ran.items()} }")
    # each copy ran in a thread of its own, and no thread ran another device's copy
    assert len(threads["first"]) == len(threads["second"]) == 1
    assert threads["first"] != threads["second"]
    for owner in ("first", "second"):
        lengths = [n for (o, _), ns in ran.items() if o == owner for n in ns]
        assert min(lengths) < 64, f"the {owner} device's copy did not merge"   # 64: 8x8 level
    assert both.distance(alone) <= BOUND
    assert both.stats["layers_merged"] > 0
    # the same as ToMA on one device, but for the batch split's rounding; every plan the split
    # run built took one device's destinations, and its own picks part from them at ties only
    print(f"{order}: {both.distance(single):.2e} from ToMA on one device; own picks parted "
          f"{len(destinations.gaps)} times, by at most {max(destinations.gaps, default=0):.1e}")
    assert destinations.handed == {item: len(picks)
                                   for item, picks in destinations.recorded.items()}
    assert sorted(destinations.handed) == [0, 1]
    assert both.distance(single) < SAME_DESTINATIONS_BOUND
    assert max(destinations.gaps, default=0.0) < TIE_BOUND, destinations.gaps


def test_select_model_device(sdxl_two_devices) -> None:
    """Select Model Device after ToMA: the node itself on "cpu", and its gpu:N path (a fresh copy
    of the model from the loader's factory on the other device, the node's _retarget_patcher):
    the copy's own blocks run, merged, and give the samples of ToMA on the first copy."""
    if not multigpu_available():
        assert ROW["SelectModelDevice"].on(version()) == NOT_LOADED
        return
    import comfy_extras.nodes_multigpu as multigpu

    c = sdxl_two_devices
    toma = c.toma(c.model)
    reference = c.run(toma, STEPS)
    on_cpu = peers.run_node(peers.comfy_node("nodes_multigpu", "SelectModelDevice"),
                            model=toma, device="cpu")[0]
    assert torch.equal(c.run(on_cpu, STEPS).samples, reference.samples)
    moved = multigpu._retarget_patcher(toma.clone(), SECOND, torch.device("cpu"))
    assert moved.model is not toma.model and moved.load_device == SECOND
    ran, remove = block_owners({"source": toma, "copy": moved})
    try:
        out = c.run(moved, STEPS)
    finally:
        remove()
    owners = {owner for owner, _ in ran}
    assert owners == {"copy"}, owners
    assert min(n for ns in ran.values() for n in ns) < 64
    assert out.distance(reference) < 1e-5
