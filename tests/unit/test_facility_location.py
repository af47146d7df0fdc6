"""Greedy facility location (toma_core.facility_location) against brute force and its guarantee."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from plan_reference import split

from toma_pack.toma_core import make_regions
from toma_pack.toma_core.facility_location import gram_similarity, greedy_facility_location

GREEDY_BOUND = 1.0 - 1.0 / math.e
# Tolerances: the largest difference measured (torch 2.13 CPU; test_greedy_guarantee's over
# 3000 random cases of its strategy) times a margin of about 4. Comparisons measured
# bit-identical are exact.
GAIN_TOL = 2e-6      # float32 greedy pick vs the float64 best gain: measured 4.8e-7
SUM_TOL = 8e-6       # sum of float64 gains vs float32 f(D): measured 1.9e-6
F64_TOL = 1e-12      # float64 rounding of successive gains (measured 0: never increased)


def _features(seed: int, s: int, c: int, duplicates: bool = False) -> torch.Tensor:
    """[S, C] random features; with `duplicates`, drawn from a pool of <= S // 2 + 1 vectors."""
    gen = torch.Generator().manual_seed(seed)
    if not duplicates:
        return torch.randn(s, c, generator=gen)
    pool = torch.randn(max(1, s // 2 + 1) if s > 1 else 1, c, generator=gen)
    return pool[torch.randint(len(pool), (s,), generator=gen)]


def _normalise_then_dot(x: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Cosine similarity the textbook way: x [..., S, C] L2-normalised in float32 (norms below
    1e-6 count as 1e-6), then X X^T; pad slots (valid False, [R, S]) -1 to everything."""
    xn = F.normalize(x.float(), dim=-1, eps=1e-6)
    sim = xn @ xn.transpose(-1, -2)
    if valid is not None:
        sim = sim.masked_fill(~(valid[..., :, None] & valid[..., None, :]), -1.0)
    return sim


def _sim(x: torch.Tensor) -> torch.Tensor:
    return _normalise_then_dot(x)


def _coverage(sim: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
    """f(D) for each row of picks [..., k] over sim [..., S, S]: sum_j max_d (sim[d, j] + 1)."""
    rows = sim.gather(-2, picks.unsqueeze(-1).expand(*picks.shape, sim.shape[-1]))
    return (rows + 1.0).amax(-2).sum(-1)


def _brute_force(sim: torch.Tensor, k: int) -> float:
    """max over every k-subset of the coverage objective (sim [S, S])."""
    s = sim.shape[-1]
    subsets = torch.tensor(list(itertools.combinations(range(s), k)))
    return float(_coverage(sim.expand(len(subsets), s, s), subsets).max())


def _objective(sim: torch.Tensor, picks: list[int]) -> float:
    """f(D) = sum_j max_{d in D} (sim[d, j] + 1), f({}) = 0, straight from the definition."""
    if not picks:
        return 0.0
    return float((sim[picks] + 1.0).max(0).values.sum())


def test_similarity_symmetric_with_unit_diagonal() -> None:
    sim = gram_similarity(torch.randn(2, 4, 9, 6, generator=torch.Generator().manual_seed(0)))
    assert sim.shape == (2, 4, 9, 9)
    # measured: 2.4e-7 from symmetry, 2.4e-7 off the unit diagonal, |sim| at most 1 + 2.4e-7
    torch.testing.assert_close(sim, sim.transpose(-1, -2), atol=1e-6, rtol=0)
    torch.testing.assert_close(sim.diagonal(dim1=-2, dim2=-1), torch.ones(2, 4, 9), atol=1e-6,
                               rtol=0)
    assert bool((sim.abs() <= 1 + 1e-6).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gram_similarity_matches_normalised_dot(dtype: torch.dtype) -> None:
    """The Gram shortcut gives the cosine similarity of normalise-then-dot, pads masked alike."""
    x = (torch.randn(2, 3, 6, 40) * torch.rand(2, 3, 6, 1) * 10).to(dtype)
    x[0, 1, 2] = 0                                     # a zero token: similarity 0, not NaN
    valid = torch.tensor([[True] * 6, [True] * 4 + [False] * 2, [True] * 5 + [False]])
    for v in (None, valid):
        got = gram_similarity(x, v)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, _normalise_then_dot(x, v), atol=1.5e-6,
                                   rtol=0)                             # measured 3.6e-7
    assert not gram_similarity(x)[0, 1, 2].any()


def test_similarity_masks_pad_slots() -> None:
    valid = torch.tensor([[True, True, False], [True, True, True]])
    x = torch.randn(1, 2, 3, 4, generator=torch.Generator().manual_seed(0))
    sim, plain = gram_similarity(x, valid), gram_similarity(x)
    assert bool((sim[0, 0, 2, :] == -1).all() and (sim[0, 0, :, 2] == -1).all())
    assert torch.equal(sim[0, 0, :2, :2], plain[0, 0, :2, :2])         # real slots untouched
    assert torch.equal(sim[0, 1], plain[0, 1])                         # region with no pads


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("s", [1, 2, 5, 9])
def test_k1_is_optimal(seed: int, s: int) -> None:
    """k = 1: the greedy's single pick maximises f over all singletons."""
    sim = _sim(_features(seed, s, 4))
    picks = greedy_facility_location(sim, 1)
    assert picks.shape == (1,)
    assert _objective(sim, picks.tolist()) == _brute_force(sim, 1)     # measured identical


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("s", [1, 3, 8])
def test_k_equals_s_picks_everything(seed: int, s: int) -> None:
    sim = _sim(_features(seed, s, 3, duplicates=seed % 2 == 1))
    picks = greedy_facility_location(sim, s)
    assert sorted(picks.tolist()) == list(range(s))
    assert _objective(sim, picks.tolist()) == _brute_force(sim, s)     # measured identical


@settings(max_examples=120, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), s=st.integers(1, 9), k=st.integers(1, 4),
       c=st.integers(1, 5), duplicates=st.booleans())
def test_greedy_guarantee(seed: int, s: int, k: int, c: int, duplicates: bool) -> None:
    """f(greedy) >= (1 - 1/e) f(optimum); picks distinct; each pick has the largest gain."""
    k = min(k, s)
    sim = _sim(_features(seed, s, c, duplicates))
    picks = greedy_facility_location(sim, k).tolist()
    assert len(picks) == k and len(set(picks)) == k
    assert all(0 <= p < s for p in picks)
    value = _objective(sim, picks)
    best = _brute_force(sim, k)
    assert value <= best                  # measured: never above (equal when greedy is optimal)
    assert value >= GREEDY_BOUND * best   # measured: at least 0.74 above the bound
    # The greedy property itself: every pick's marginal gain is the largest available then.
    # f(D + v) for every v at once: sum_j max(cover_j, sim[v, j] + 1), in float64.
    shifted = sim.double() + 1.0
    cover = torch.zeros(s, dtype=torch.float64)
    gains = []
    for i, p in enumerate(picks):
        with_v = torch.maximum(shifted, cover).sum(-1)
        with_v[picks[:i]] = -math.inf
        base = float(cover.sum())
        assert float(with_v[p]) >= float(with_v.max()) - GAIN_TOL
        gains.append(float(with_v[p]) - base)
        cover = torch.maximum(cover, shifted[p])
    assert sum(gains) == pytest.approx(value, abs=SUM_TOL)
    # Submodularity: the greedy's gains never increase.
    assert all(b <= a + F64_TOL for a, b in zip(gains, gains[1:], strict=False))

@pytest.mark.parametrize("k", [1, 2, 5, 8])
def test_identical_tokens_never_repeat(k: int) -> None:
    """All gains tie at 0 after the first pick: picks stay distinct, lowest slots first."""
    sim = _sim(torch.ones(8, 4))
    picks = greedy_facility_location(sim, k)
    assert picks.tolist() == list(range(k))
    batched = _sim(torch.ones(3, 2, 8, 4))
    picks = greedy_facility_location(batched, k)
    assert picks.shape == (3, 2, k)
    for row in picks.reshape(-1, k).tolist():
        assert len(set(row)) == k


def test_batched_equals_per_region() -> None:
    """One batched call over [B, R] equals the greedy run on each region alone."""
    x = torch.randn(2, 5, 9, 6, generator=torch.Generator().manual_seed(3))
    x[1, 2] = x[1, 2, :1]  # a region of identical tokens among ordinary ones
    sim = _sim(x)
    picks = greedy_facility_location(sim, 4)
    assert picks.shape == (2, 5, 4)
    for b in range(2):
        for r in range(5):
            assert torch.equal(picks[b, r], greedy_facility_location(sim[b, r], 4))


def test_greedy_is_deterministic() -> None:
    sim = _sim(torch.randn(4, 16, 8))
    assert torch.equal(greedy_facility_location(sim, 6), greedy_facility_location(sim, 6))


@pytest.mark.parametrize(("h", "w", "tile_count"), [(5, 7, 4), (45, 80, 64), (11, 3, 2)])
def test_pad_slots_never_picked(h: int, w: int, tile_count: int) -> None:
    """Ragged regions: even with k = the smallest region's size, pad slots are never chosen."""
    regions = make_regions(h, w, "tile", tile_count)
    assert not regions.even
    valid = regions.tables().valid
    x = torch.randn(2, h * w, 5, generator=torch.Generator().manual_seed(h * w))
    sim = gram_similarity(split(regions, x), valid)
    for k in sorted({1, max(1, regions.min_size // 2), regions.min_size}):
        picks = greedy_facility_location(sim, k, valid)
        chosen_valid = valid.expand(2, -1, -1).gather(-1, picks)
        assert bool(chosen_valid.all())
        assert all(len(set(row)) == k for row in picks.reshape(-1, k).tolist())
    # The smallest regions with k = their size: exactly their valid slots.
    k = regions.min_size
    picks = greedy_facility_location(sim, k, valid)
    smallest = (valid.sum(-1) == k).nonzero().flatten()
    for r in smallest.tolist():
        expected = valid[r].nonzero().flatten().tolist()
        assert sorted(picks[0, r].tolist()) == expected


def test_pad_slots_with_identical_tokens() -> None:
    """Ties at zero gain must still skip pad slots (they sit at the region's end)."""
    regions = make_regions(5, 7, "tile", 4)
    valid = regions.tables().valid
    sim = gram_similarity(split(regions, torch.ones(1, 35, 3)), valid)
    picks = greedy_facility_location(sim, regions.min_size, valid)
    assert bool(valid.gather(-1, picks[0]).all())


@pytest.mark.parametrize("k", [0, -1, 10])
def test_k_out_of_range(k: int) -> None:
    sim = _sim(torch.randn(9, 3))
    with pytest.raises(ValueError, match="k"):
        greedy_facility_location(sim, k)


def test_selection_never_reads_the_device() -> None:
    """Similarity and greedy run on the meta device (no data: any read back to the host, such
    as checking k against the valid slots, would raise), pad mask included."""
    regions = make_regions(5, 7, "tile", 4)
    tables = regions.tables("meta")
    x = torch.empty(2, regions.count, regions.size, 6, device="meta")
    sim = gram_similarity(x, tables.valid)
    picks = greedy_facility_location(sim, regions.min_size, tables.valid)
    assert sim.shape == (2, regions.count, regions.size, regions.size)
    assert picks.shape == (2, regions.count, regions.min_size) and picks.device.type == "meta"


def test_weighted_coverage() -> None:
    """weight counts each token's coverage: uniform weights give the plain greedy's picks; a
    token the plain greedy merges away, weighted far above the rest, becomes a destination."""
    sim = _sim(torch.randn(16, 8, generator=torch.Generator().manual_seed(5)))
    plain = greedy_facility_location(sim, 5)
    assert torch.equal(greedy_facility_location(sim, 5, weight=torch.full((16,), 3.0)), plain)
    heavy = next(i for i in range(16) if i not in plain.tolist())
    weight = torch.ones(16)
    weight[heavy] = 1000.0
    assert heavy in greedy_facility_location(sim, 5, weight=weight).tolist()
