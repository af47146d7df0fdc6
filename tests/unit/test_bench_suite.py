"""The benchmark suite's own pieces on tiny shapes: reference block, variants, Pareto marking."""

from __future__ import annotations

import pytest
import torch

from bench.config import default_config
from bench.fidelity import pareto
from bench.photos import photo_tokens
from bench.reference_blocks import Level
from bench.unet_blocks import UNPATCHED, LevelBench, Variant, merged_count, output_errors

TINY = Level(8, 64, 2)          # 8 x 8 tokens, 64 channels, 1 head


@pytest.fixture(scope="module")
def bench() -> LevelBench:
    return LevelBench(TINY, default_config(quick=True, comfy=False, device="cpu"))


def _run(bench: LevelBench, v: Variant, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    prepared = bench.prepare(v, x)
    with torch.inference_mode():
        return prepared.call(), prepared.tokens


def test_photo_tokens_are_layer_normed_grids() -> None:
    x = photo_tokens("astronaut", 8, 64)
    assert x.shape == (1, 64, 64)
    assert torch.allclose(x.mean(-1), torch.zeros(64), atol=1e-4)


@pytest.mark.parametrize("v", [
    Variant("toma", "block", 0.5, 4), Variant("toma", "attention", 0.5, 4),
    Variant("lower bound", "block", 0.5), Variant("lower bound", "attention", 0.5),
    Variant("todo", "attention", 0.75),
])
def test_variants_keep_the_output_shape(bench: LevelBench, v: Variant) -> None:
    x = bench.tokens_of("coffee")
    y, tokens = _run(bench, v, x)
    # the block-scope lower bound runs (and returns) the merged count only
    length = tokens if v == Variant("lower bound", "block", 0.5) else TINY.tokens
    assert y.shape == (1, length, 64) and torch.isfinite(y).all()
    assert tokens < TINY.tokens


def test_toma_is_close_to_unpatched_and_exact_at_no_merging(bench: LevelBench) -> None:
    x = bench.tokens_of("chelsea")
    ref, _ = _run(bench, UNPATCHED, x)
    y, tokens = _run(bench, Variant("toma", "block", 0.5, 4), x)
    assert tokens == merged_count(TINY, 0.5, 4) == 32
    errs = output_errors(y, ref, x)
    assert 0 < errs["err"] < 1 and errs["cos"] > 0.5
    assert output_errors(ref, ref, x)["err"] == 0


def test_tomesd_variant_runs_when_installed(bench: LevelBench) -> None:
    pytest.importorskip("tomesd")
    x = bench.tokens_of("rocket")
    for scope in ("block", "attention"):
        y, tokens = _run(bench, Variant("tomesd", scope, 0.5), x)
        assert y.shape == x.shape and tokens == 32


def test_pareto_marks_only_unbeaten_points() -> None:
    unet = [{"level": "L", "method": m, "scope": "block", "ratio": 0.5, "tiles": None,
             "speedup": s} for m, s in (("toma", 2.0), ("tomesd", 1.5), ("todo", 1.8))]
    fid = [{"level": "L", "method": m, "scope": "block", "ratio": 0.5, "tiles": None,
            "err": e, "cos": 0.9} for m, e in (("toma", 0.2), ("tomesd", 0.3), ("todo", 0.1))]
    marks = {p["method"]: p["pareto"] for p in pareto(unet, fid)}
    assert marks == {"toma": True, "tomesd": False, "todo": True, "unpatched": True}
