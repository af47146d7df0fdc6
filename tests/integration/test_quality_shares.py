"""The proportion-matched quality fixtures split a transformer block's work as SDXL and Flux.1
do at 1024x1024 (bench/quality/shares.py, ComfyUI's own blocks on the meta device), and the
first fixtures do not (so the check can fail)."""

from __future__ import annotations

import pytest

import comfy_harness as ch
from bench.quality import models as quality_models
from bench.quality import shares

# Lab code: runs with the newest ComfyUI tree only (tests/pytest.ini).
pytestmark = pytest.mark.newest_tree


@pytest.fixture(scope="module", autouse=True)
def comfy():
    # The count runs on the meta device: ComfyUI's split attention asks that device's free
    # memory, PyTorch's attention does not (the count is the same; the bench uses it too).
    with ch.attention_backend("sdpa"):
        yield


@pytest.mark.parametrize("layout", quality_models.MATCHED)
def test_matched_fixture_has_the_real_split(layout):
    rows = shares.compare(layout)
    assert len(rows) == 2            # SDXL's two attention levels; Flux's double and single
    for row in rows:
        assert row["within"], (row["block"], row["ratios"])
        # The shares that decide merge_scope: self-attention and feed-forward.
        assert set(row["ratios"]) >= {"self_attention", "feed_forward"}


@pytest.mark.parametrize("layout", ["sdxl", "flux"])
def test_first_fixtures_are_attention_heavy(layout):
    """At 64 channels and 1024-4096 tokens attention is most of the work: 72-88% in the core
    against SDXL's 8-41% and Flux's 20% (measured)."""
    for row in shares.compare(layout):
        assert not row["within"]
        assert row["fixture"]["attention_core"] > 1.5 * row["real"]["attention_core"]


def test_real_shares_match_the_block_algebra():
    """Flux.1's blocks at 4608 tokens x 3072: core 4 N^2 C of 4 N^2 C + 24 N C^2 (attention
    is N / (N + 6 C) of the work), the same in double and single blocks."""
    n, c = 4096 + 512, 3072
    for row in shares.model_rows(None, "flux"):
        assert row["attention_core"] == pytest.approx(n / (n + 6 * c), rel=1e-3)
