"""The HiDream-O1 cache bench (bench/speed/hidream_o1_cache.py) on a tiny decoder through
ComfyUI's own HiDreamO1Transformer: the layer calls it times are the model's own, and the hot
path it times is the cold path's computation on the tokens after the cached prompt.

ComfyUI versions without HiDream-O1 (before 0.33) are not skipped: the test asserts it is
absent there.
"""

from __future__ import annotations

import pytest
import torch

import comfy_harness as ch
from bench.speed import hidream_o1_cache as bench

# Lab code: runs with the newest ComfyUI tree only (tests/pytest.ini).
pytestmark = pytest.mark.newest_tree

# A tiny Qwen3-VL decoder; the vocabulary stays the real one (the prompt's image and tms ids).
TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "rope_dims": [4, 2, 2]}
SIZE = (128, 96)            # 4 x 3 patches of 32 pixels
PROMPT = 6


@pytest.fixture(scope="module")
def model():
    import comfy.supported_models

    if not hasattr(comfy.supported_models, "HiDreamO1"):
        assert ch.comfy_version() < (0, 33, 0), "HiDreamO1 missing"
        return None
    torch.manual_seed(0)
    return bench.build_hidream_o1(TEXT)


@pytest.mark.parametrize("name", [f"t2i-{PROMPT}", f"edit-{PROMPT}"])
def test_hot_path_is_the_cold_path_after_the_cached_prompt(model, name):
    if model is None:
        return
    case = bench.parse_case(name)
    layer = bench.capture_layer(model, case, SIZE)
    image = 12
    assert layer.image_tokens == image
    # t2i caches the prompt before its tms token; edit also the reference's ViT tokens (at 4:3
    # 416 x 320 pixels in 16-pixel patches merged 2 x 2: 13 x 10) and their two markers
    assert layer.cache_len == PROMPT - 1 + (13 * 10 + 2 if case.references else 0)
    cold, hot = layer.cold["x"].shape[1], layer.hot["x"].shape[1]
    assert cold == layer.image_start + image * (1 + case.references)
    assert hot == cold - layer.cache_len
    with torch.inference_mode():
        hot_out, _ = layer.call(True)()
        cold_out, _ = layer.call(False)()
        merged = {hot: layer.call(hot, keep=5)()[0] for hot in (True, False)}
    # measured: identical here (largest difference 0.0, outputs up to 4.5); 1e-6 leaves room
    # for another BLAS blocking the rows otherwise
    torch.testing.assert_close(hot_out, cold_out[:, layer.cache_len:], rtol=0, atol=1e-6)
    # the lower bounds run on 5 of the 12 image tokens, the rest unchanged
    assert merged[True].shape[1] == hot - image + 5
    assert merged[False].shape[1] == cold - image + 5



@pytest.mark.parametrize("name", [f"t2i-{PROMPT}", f"edit-{PROMPT}"])
def test_toma_variant_is_the_pack_patch_after_the_kept_prompt(model, name):
    """The "ToMA, cached" variant is ToMA's block patch keeping the prompt: from the whole
    sequence it hands back a sequence as long, whose rows after the prompt are those of the
    same patch running the whole sequence (no prompt kept, the prompt recomputed), on the same
    plan; its plan build builds a plan of the merged size."""
    if model is None:
        return
    layer = bench.capture_layer(model, bench.parse_case(name), SIZE)
    run, build, merged = bench.toma_calls(layer, 0.5)
    assert merged == 6                                      # half of the 12 image tokens
    with torch.inference_mode():
        kept = run()["x"]
        plan = build()[0]
    assert plan.merged_tokens == merged
    assert kept.shape == layer.cold["x"].shape

    from toma_pack.nodes.dit_patch import DiTToMA
    from toma_pack.nodes.families.hidream_o1 import description
    from toma_pack.nodes.model_call import ModelCall
    from toma_pack.nodes.options import make_options
    from toma_pack.nodes.run_state import ToMAState

    spec = description()
    state = ToMAState(make_options(0.5, skip_blocks="none"), spec.name)
    call = ModelCall(state.new_run(), grid=layer.grid, merging=True, txt_len=layer.image_start)
    toma = DiTToMA(state, spec, {("double_block", 0): 0})      # keeps no prompt
    args = {name: layer.cold[name] for name in ("attention_mask", "freqs_cis",
                                                "optimized_attention")}
    args["transformer_options"] = {state.call_key: call}

    def whole(a: dict) -> dict:
        return {"x": layer.layer(x=a["x"], attention_mask=a["attention_mask"],
                                 freqs_cis=a["freqs_cis"],
                                 optimized_attention=a["optimized_attention"])[0]}

    with torch.inference_mode():
        recomputed = toma.replace_patch(spec.kinds[0], 0, None)(
            {**args, "x": layer.cold["x"].clone()}, {"original_block": whole})["x"]
    n = layer.cache_len
    # measured: identical (largest difference 0.0); 1e-6 as in the test above
    torch.testing.assert_close(kept[:, n:], recomputed[:, n:], rtol=0, atol=1e-6)
    assert not torch.equal(kept[:, n:], layer.cold["x"][:, n:])    # the layer ran
