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

import comfy_harness as ch

STEPS = 3
SECOND = torch.device("cpu", 0)
ROW = {row.node: row for row in ROWS if row.pack == "ComfyUI"}
# Relative L2 of ToMA's samples to the same multi-GPU run unmerged: 1.5 x measured (0.389, as
# far as ToMA moves the single-device run).
BOUND = 0.58


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


@pytest.mark.parametrize("order", ORDERS)
def test_multigpu_cfg_split(order, sdxl_two_devices) -> None:
    """MultiGPU CFG Split before or after ToMA: cond and uncond run in two threads, each on its
    own device's copy of the model, and both merge; the samples within a measured bound of the
    same multi-GPU run unmerged."""
    if not multigpu_available():
        assert ROW["MultiGPU_WorkUnits"].on(version()) == NOT_LOADED
        return
    c = sdxl_two_devices
    node = peers.comfy_node("nodes_multigpu", "MultiGPU_WorkUnits")

    def split(model):
        return peers.run_node(node, model=model, max_gpus=2)[0]

    alone = c.run(split(c.model), STEPS)
    model = composed(order, split, c.toma, c.model)
    copies = model.get_additional_models_with_key("multigpu")
    assert [m.load_device for m in copies] == [SECOND]
    ran, remove = block_owners({"first": model, "second": copies[0]})
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
    # the same as ToMA on one device, but for the batch split's rounding
    single = c.run(c.toma(c.model), STEPS)
    print(f"{order}: {both.distance(single):.2e} from ToMA on one device")
    assert both.distance(single) < 2e-4     # measured 7.6e-5


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
