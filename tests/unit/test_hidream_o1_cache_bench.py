"""The HiDream-O1 cache bench's projection and case names (bench/speed/hidream_o1_cache.py;
its layer calls are tested through ComfyUI's model in
tests/integration/test_hidream_o1_cache.py)."""

from __future__ import annotations

import argparse

import pytest

from bench.speed import hidream_o1_cache as bench


def test_projection_adds_the_default_skips_per_repetition():
    found = {"cached": (10.0, 12.0, 11.0), "patched": (12.0, 13.0, 12.5),
             "merged, patched": (6.0, 7.0, 6.5), "merged, cached": (5.0, 6.0, 5.5),
             "ToMA, cached": (5.5, 6.5, 6.0), "ToMA plan build": (0.2, 0.3, 0.1)}
    rows = bench.projections(bench.parse_case("t2i-128"),
                             {k: bench.Timing(v) for k, v in found.items()}, 0.5)
    by = {row["variant"].split(" (")[0]: row for row in rows}
    patch = by["model, merging patch at ratio 0.5"]
    # 5 x patched + 31 x merged, patched against 36 x cached, median of the three rounds
    assert patch["ms"] == pytest.approx(1e3 * (5 * 12.5 + 31 * 6.5))
    assert patch["speedup"] == pytest.approx(36 * 11.0 / (5 * 12.5 + 31 * 6.5))
    assert by["model, any block patch, nothing merged"]["speedup"] == pytest.approx(11 / 12.5)
    assert by["model, merging that kept the cache"]["note"] == "lower bound"
    assert by["model, any block patch, nothing merged"]["note"] is None
    # ToMA's own: 5 x cached + 31 x ToMA, cached + the plan build of the same round
    toma = by["model, ToMA keeping the cache"]
    assert toma["ms"] == pytest.approx(1e3 * (5 * 11.0 + 31 * 6.0 + 0.1))   # round 3: median
    assert toma["note"] is None


@pytest.mark.parametrize("text", ["t2i", "img-12", "edit-1", "t2i-x"])
def test_cases_are_named_kind_and_prompt_length(text):
    with pytest.raises(argparse.ArgumentTypeError, match="t2i-P or edit-P"):
        bench.parse_case(text)
