"""ToMA beside ComfyUI-KJNodes' model patches that run without CUDA-only packages, from its real
code loaded as ComfyUI loads it: its torch.compile nodes (blocks compiled one by one, with and
without ComfyUI's guard filter), the patch-order and torch-settings nodes, and the Wan helpers
that wrap the model (NAG, chunked feed-forward, RifleX RoPE, Enhance-A-Video, skip layer
guidance), in both node orders, on every ComfyUI version (tests/compatibility.py's rows).

MERGES: KJNodes' node does its work and the merged blocks run shorter sequences, the samples
within a measured bound of the node alone. Enhance-A-Video scores the video's frames from the
self-attention's queries, reading the sequence as whole frames: ToMA runs those blocks unmerged
and names the node (UNMERGED, samples the node's alone bit for bit). Skip layer guidance asks
for KJNodes' own TeaCache and fails without ToMA too (PEER_FAILS).
"""

from __future__ import annotations

import peers
import pytest
from compatibility import MERGES, PEER_FAILS, ROWS, UNMERGED, Row
from peer_cases import ORDERS, Case, case, composed, version

import comfy_harness as ch

STEPS = 4
KJ_ROWS = [row for row in ROWS if row.pack == "ComfyUI-KJNodes"]
COMPILE = {"backend": "inductor", "fullgraph": False, "mode": "default"}

# How far ToMA moves the node's samples (relative L2), 1.5 x what both node orders measured on
# v0.33.0 (comments); ToMA alone moves the unmerged samples as far.
BOUNDS = {
    "TorchCompileModelFluxAdvancedV2": 0.24,    # 0.159
    "TorchCompileModelWanVideoV2": 0.3,         # 0.201
    "TorchCompileModelAdvanced": 0.3,           # 0.201
    "PatchModelPatcherOrder": 0.24,             # 0.159
    "ModelPatchTorchSettings": 0.24,            # 0.159
    "WanVideoNAG": 0.3,                         # 0.201
    "WanChunkFeedForward": 0.3,                 # 0.201
    "ApplyRifleXRoPE_WanVideo": 0.3,            # 0.202
}


def kj_node(row: Row, c: Case):
    """A function applying the row's KJNodes node (its real class) at its usual settings."""
    node = peers.load(row.pack).node(row.node)
    settings = {
        "TorchCompileModelFluxAdvancedV2": {**COMPILE, "double_blocks": True,
                                            "single_blocks": True, "dynamic": False},
        "TorchCompileModelWanVideoV2": {**COMPILE, "dynamic": False,
                                        "dynamo_cache_size_limit": 64,
                                        "compile_transformer_blocks_only": True},
        "TorchCompileModelAdvanced": {**COMPILE, "dynamic": "false",
                                      "dynamo_cache_size_limit": 64,
                                      "compile_transformer_blocks_only": True,
                                      "debug_compile_keys": False},
        "PatchModelPatcherOrder": {"patch_order": "weight_patch_first", "full_load": "auto"},
        "ModelPatchTorchSettings": {"enable_fp16_accumulation": False},
        "WanVideoNAG": {"conditioning": c.negative, "nag_scale": 11.0, "nag_alpha": 0.25,
                        "nag_tau": 2.5},
        "WanChunkFeedForward": {"chunks": 2, "dim_threshold": 0},
        "ApplyRifleXRoPE_WanVideo": {"latent": {"samples": c.latent}, "k": 4},
        "WanVideoEnhanceAVideoKJ": {"weight": 2.0, "latent": {"samples": c.latent}},
        "SkipLayerGuidanceWanVideo": {"blocks": "1", "start_percent": 0.0,
                                      "end_percent": 1.0},
    }[row.node]
    return lambda model: peers.run_node(node, model=model, **settings)[0]


@pytest.fixture
def fresh_dynamo():
    """The compile nodes' graphs are dynamo's, shared by the whole process: dropped around a
    test (and KJNodes' cache size limit put back)."""
    import torch._dynamo

    limit = torch._dynamo.config.cache_size_limit
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    torch._dynamo.config.cache_size_limit = limit


@pytest.mark.parametrize("row", KJ_ROWS, ids=lambda row: row.node)
def test_kjnodes_beside_toma(row: Row, fresh_dynamo) -> None:
    expected = row.on(version())
    peer = peers.load(row.pack)
    assert peer.loaded, peer.error
    c = case(row.family)
    node = kj_node(row, c)
    if expected == PEER_FAILS:
        with pytest.raises(ValueError, match="TeaCache"):
            c.run(node(c.model), STEPS)
        return
    alone = c.run(node(c.model), STEPS)
    full = set(alone.lengths)
    for order in ORDERS:
        both = c.run(composed(order, node, c.toma, c.model), STEPS)
        print(f"{row.node} {order}: {both.distance(alone):.3f} from the node alone; lengths "
              f"{sorted(full)} -> {sorted(set(both.lengths))}")
        if expected == MERGES:
            assert any(n not in full and n < max(full) for n in both.lengths), "nothing merged"
            assert both.distance(alone) <= BOUNDS[row.node]
        else:
            assert expected == UNMERGED
            assert (both.samples == alone.samples).all() and set(both.lengths) == full
            assert row.pack in both.note and "run unmerged" in both.note
    ch.unload_models()
