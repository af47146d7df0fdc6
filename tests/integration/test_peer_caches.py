"""ToMA beside the step caches artists use, with their real code loaded as ComfyUI loads it
(tests/integration/peers.py): ComfyUI-TeaCache, ComfyUI-MagCache and Comfy-WaveSpeed's First
Block Cache, on every family of theirs ToMA supports, both node orders, on every ComfyUI
version (tests/compatibility.py says what happens where; its rows are the cases).

Both act where the row says MERGES: the cache skips steps (the model's last block runs on fewer
steps than the sampler takes) and in the steps it computes, ToMA's merged blocks run shorter
self-attention sequences; the samples stay within a measured bound of the cache alone. Where a
cache runs the blocks as one module of its own (UNMERGED), the samples are the cache's alone
bit for bit, and ToMA's stats line names the node. Where the cache fails without ToMA too, or
does not import on this ComfyUI, the test holds that, so a peer's fix shows here.

The caches' copies of a model's forward hand the blocks their options another way than
ComfyUI's (First Block Cache in the patch's second argument, TeaCache's Flux not at all):
ToMA finds its model call either way.
"""

from __future__ import annotations

import peers
import pytest
from compatibility import MERGES, NOT_LOADED, PEER_FAILS, ROWS, UNMERGED, Row
from peer_cases import ORDERS, case, composed, version
from tiny_models import available

import comfy_harness as ch

STEPS = 8
CACHES = ("ComfyUI-TeaCache", "ComfyUI-MagCache", "Comfy-WaveSpeed")
CACHE_ROWS = [row for row in ROWS if row.pack in CACHES]

# model_type of TeaCache and MagCache per family; settings that skip steps on the tiny models
# (Wan's "_ret_mode" watches e0: the plain mode, watching the time embedding, skipped no step
# of the tiny model at any threshold up to 10)
TEACACHE_TYPES = {"flux": "flux", "wan21_t2v": "wan2.1_t2v_1.3B_ret_mode",
                  "hidream": "hidream_i1_full",
                  "lumina2": "lumina_2", "ltxv": "ltxv", "hunyuan_video": "hunyuan_video"}
MAGCACHE_TYPES = {"flux": "flux", "flux_kontext": "flux_kontext", "wan21_t2v": "wan2.1_t2v_1.3B",
                  "wan_vace": "wan2.1_vace_1.3B", "hunyuan_video15": "hunyuan_video1.5",
                  "hunyuan_video": "hunyuan_video", "chroma": "chroma",
                  "qwen_image": "qwen_image"}

# How far ToMA moves the cache's samples (relative L2), 1.5 x what the two node orders measured
# on v0.3.64 (comments: the same for both); ToMA alone moves the unmerged samples about as far.
BOUNDS = {
    ("ComfyUI-TeaCache", "flux"): 0.24,             # 0.158
    ("ComfyUI-TeaCache", "wan21_t2v"): 0.37,        # 0.246
    ("ComfyUI-TeaCache", "hidream"): 0.73,          # 0.483
    ("ComfyUI-TeaCache", "lumina2"): 0.37,          # 0.242
    ("ComfyUI-TeaCache", "ltxv"): 0.83,             # 0.554
    ("ComfyUI-MagCache", "flux"): 0.25,             # 0.162
    ("ComfyUI-MagCache", "flux_kontext"): 0.29,     # 0.189
    ("ComfyUI-MagCache", "wan21_t2v"): 0.36,        # 0.239
    ("ComfyUI-MagCache", "wan_vace"): 0.23,         # 0.148
    ("ComfyUI-MagCache", "hunyuan_video"): 0.51,    # 0.337
    ("Comfy-WaveSpeed", "flux"): 0.3,               # 0.147 (v0.8.0: 0.201)
    ("Comfy-WaveSpeed", "sdxl"): 0.49,              # 0.324
}


def cache_node(row: Row):
    """A function applying the row's cache node (its real class, as ComfyUI runs it) at
    settings that skip steps on the tiny models."""
    node = peers.load(row.pack).node(row.node)
    if row.pack == "ComfyUI-TeaCache":
        settings = {"model_type": TEACACHE_TYPES[row.family], "rel_l1_thresh": 2.0,
                    "start_percent": 0.0, "end_percent": 1.0, "cache_device": "cpu"}
    elif row.pack == "ComfyUI-MagCache":
        settings = {"model_type": MAGCACHE_TYPES[row.family], "magcache_thresh": 0.3,
                    "retention_ratio": 0.2, "magcache_K": 6, "start_step": 0, "end_step": -1}
    else:
        settings = {"object_to_patch": "diffusion_model", "residual_diff_threshold": 0.5,
                    "start": 0.0, "end": 1.0, "max_consecutive_cache_hits": -1}
    return lambda model: peers.run_node(node, model=model, **settings)[0]


def row_id(row: Row) -> str:
    return f"{row.node}-{row.family}"


@pytest.mark.parametrize("row", CACHE_ROWS, ids=row_id)
def test_step_cache_beside_toma(row: Row) -> None:
    expected = row.on(version())
    peer = peers.load(row.pack)
    if expected == NOT_LOADED:      # the pack does not import, or this ComfyUI lacks the model
        assert not peer.loaded or not available(row.family)
        return
    assert peer.loaded, peer.error
    c = case(row.family)
    cache = cache_node(row)
    if expected == PEER_FAILS:
        with pytest.raises(Exception):   # noqa: B017 (the peer's own error, whatever it is)
            c.run(cache(c.model), STEPS)
        return
    alone = c.run(cache(c.model), STEPS)
    full = set(alone.lengths)
    if expected == MERGES:
        assert alone.last_block_calls < STEPS, "the cache skipped no step"
    for order in ORDERS:
        both = c.run(composed(order, cache, c.toma, c.model), STEPS)
        print(f"{row.node} {row.family} {order}: {both.distance(alone):.3f} from the cache "
              f"alone; lengths {sorted(full)} -> {sorted(set(both.lengths))}; last block ran "
              f"{alone.last_block_calls} / {both.last_block_calls} of {STEPS} steps")
        if expected == MERGES:
            assert both.last_block_calls < STEPS, "the cache skipped no step beside ToMA"
            assert any(n not in full and n < max(full) for n in both.lengths), "nothing merged"
            assert both.distance(alone) <= BOUNDS[(row.pack, row.family)]
            assert "nothing merged" not in both.note
        else:
            assert expected == UNMERGED
            assert (both.samples == alone.samples).all() and set(both.lengths) == full
            assert row.pack in both.note and "unmerged" in both.note
    ch.unload_models()
