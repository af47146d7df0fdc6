"""Merge plans (toma_core.merge_plan): weights, merge/unmerge identities, layouts, batches."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from toma_pack.toma_core import (
    REGION_MODES,
    UNMERGE_METHODS,
    MergePlan,
    build_plan,
    destinations_per_region,
    make_regions,
)

# (h, w, mode, tile_count): even and ragged tiles, stripes, global (small: S x S similarity).
LAYOUTS = [
    (16, 16, "tile", 16), (15, 22, "tile", 16), (45, 80, "tile", 64),
    (16, 16, "stripe", 4), (13, 9, "stripe", 5), (12, 12, "global", 1), (7, 9, "global", 1),
]


def _x(b: int, n: int, c: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, n, c, generator=torch.Generator().manual_seed(seed))


def _valid(plan: MergePlan) -> torch.Tensor:
    """[R, S] real-slot mask of the plan's regions."""
    r = plan.regions
    return torch.ones(r.count, r.size, dtype=torch.bool) if r.valid is None else r.valid


def _p(plan: MergePlan) -> torch.Tensor:
    """The soft assignment P [B', R, k, S], read back from a transpose plan's unmerge weights."""
    return plan.unmerge_w.transpose(-1, -2)


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    """|a - b| <= tol everywhere. Each caller's tol is the largest difference measured over all
    its cases (torch 2.13 CPU, stated beside it) times a margin of about 4; comparisons measured
    bit-identical use torch.equal instead."""
    torch.testing.assert_close(a, b, atol=tol, rtol=0)


# ----------------------------------------------------------------------------- ratio 0 / None


@pytest.mark.parametrize("mode", REGION_MODES)
def test_ratio_zero_returns_none(mode: str) -> None:
    assert build_plan(_x(2, 64, 8), 8, 8, 0.0, mode=mode) is None
    assert build_plan(_x(1, 45 * 80, 4), 45, 80, 0, mode=mode, tile_count=64) is None


def test_nothing_to_merge_returns_none() -> None:
    """A 1x1 grid cannot drop a token; ratios that round to k == S neither."""
    assert build_plan(_x(1, 1, 4), 1, 1, 0.5) is None
    assert build_plan(_x(1, 64, 4), 8, 8, 0.01, tile_count=16) is None


# ----------------------------------------------------------------------- constant tokens exact


@pytest.mark.parametrize("unmerge", UNMERGE_METHODS)
@pytest.mark.parametrize(("h", "w", "mode", "tile_count"), LAYOUTS)
def test_constant_tokens_survive(h: int, w: int, mode: str, tile_count: int, unmerge: str) -> None:
    """Tokens all equal (per batch item): merge and merge->unmerge give that token back."""
    n = h * w
    value = torch.tensor([[1.5, -2.0, 0.25, 3.0], [-0.5, 0.75, 2.0, -1.25]])
    x = value[:, None, :].expand(2, n, 4).contiguous()
    # Plan from unrelated features so the weights are soft and uneven.
    plan = build_plan(_x(2, n, 6, seed=n), h, w, 0.5, mode=mode, tile_count=tile_count,
                      unmerge=unmerge)
    merged = plan.merge(x)
    assert merged.shape == (2, plan.merged_tokens, 4)
    _close(merged, value[:, None, :].expand_as(merged), 2.5e-5)       # measured 6.2e-6
    _close(plan.unmerge(merged), x, 2.5e-5)


# ------------------------------------------------------------------------------ the weights


@pytest.mark.parametrize(("h", "w", "mode", "tile_count"), LAYOUTS)
@pytest.mark.parametrize("tau", [1.0, 50.0, 1000.0])
def test_weights_normalised(h: int, w: int, mode: str, tile_count: int, tau: float) -> None:
    """P columns sum to 1 on real slots (0 on pads); M = P with rows normalised."""
    plan = build_plan(_x(2, h * w, 8, seed=h + w), h, w, 0.5, mode=mode, tile_count=tile_count,
                      tau=tau)
    r, k, s = plan.regions.count, plan.k, plan.regions.size
    assert plan.merge_w.shape == (2, r, k, s) and plan.unmerge_w.shape == (2, r, s, k)
    assert plan.merge_w.dtype == torch.float32 and plan.unmerge_w.dtype == torch.float32
    p = _p(plan)
    valid = _valid(plan).float()
    _close(p.sum(-2), valid.expand(2, r, s), 2e-6)                    # measured 4.8e-7
    assert bool((p >= 0).all())
    _close(plan.merge_w.sum(-1), torch.ones(2, r, k), 2e-6)
    _close(plan.merge_w * p.sum(-1, keepdim=True), p, 2e-6)
    # Pad slots carry no weight at all.
    pad = ~_valid(plan)
    assert not (plan.merge_w * pad[None, :, None, :]).any()
    assert not (plan.unmerge_w * pad[None, :, :, None]).any()


def test_destination_is_its_own_source() -> None:
    """Each destination's column of P is one-hot on itself, so no merged token is empty."""
    plan = build_plan(_x(2, 15 * 22, 8), 15, 22, 0.6, tile_count=16, tau=5.0)
    p = _p(plan)
    own = p.gather(-1, plan.dest_slots.unsqueeze(-1)).squeeze(-1)       # [B, R, k]
    assert torch.equal(own, torch.ones_like(own))
    dest_cols = p.gather(-1, plan.dest_slots.unsqueeze(-2).expand_as(p[..., :plan.k]))
    eye = torch.eye(plan.k).expand_as(dest_cols)
    assert torch.equal(dest_cols, eye)


def test_hard_assignment() -> None:
    """tau = inf: P is 0/1 and each token goes to its most similar destination."""
    h, w = 15, 22
    x = _x(2, h * w, 8)
    plan = build_plan(x, h, w, 0.5, tile_count=16, tau=float("inf"))
    p = _p(plan)
    assert bool(((p == 0) | (p == 1)).all())
    xn = plan.regions.split(torch.nn.functional.normalize(x, dim=-1))
    dest = xn.gather(-2, plan.dest_slots.unsqueeze(-1).expand(*plan.dest_slots.shape, 8))
    scores = dest @ xn.transpose(-1, -2)
    chosen = (scores * p).sum(-2)
    best = scores.max(-2).values
    valid = _valid(plan).expand_as(best)
    assert torch.equal(chosen[valid], best[valid])


@pytest.mark.parametrize(("h", "w", "mode", "tile_count"), LAYOUTS)
def test_hard_merge_unmerge_roundtrip(h: int, w: int, mode: str, tile_count: int) -> None:
    """tau = inf: merge(unmerge(y)) == y; merged tokens are plain means of their sources."""
    plan = build_plan(_x(2, h * w, 8, seed=3), h, w, 0.5, mode=mode, tile_count=tile_count,
                      tau=float("inf"))
    y = _x(2, plan.merged_tokens, 5, seed=4)
    _close(plan.merge(plan.unmerge(y)), y, 1e-6)                      # measured 2.4e-7
    m = plan.merge_w
    counts = (m > 0).sum(-1, keepdim=True).float()
    _close(m, (m > 0).float() / counts, 1e-6)


@pytest.mark.parametrize(("h", "w", "mode", "tile_count"), LAYOUTS)
@pytest.mark.parametrize("tau", [1000.0, 20.0])
def test_pinv_merge_unmerge_roundtrip(h: int, w: int, mode: str, tile_count: int,
                                      tau: float) -> None:
    """pinv unmerge: merge(unmerge(y)) == y also for soft weights."""
    plan = build_plan(_x(2, h * w, 8, seed=5), h, w, 0.5, mode=mode, tile_count=tile_count,
                      tau=tau, unmerge="pinv")
    assert plan.unmerge_w.shape == (2, plan.regions.count, plan.regions.size, plan.k)
    y = _x(2, plan.merged_tokens, 5, seed=6)
    _close(plan.merge(plan.unmerge(y)), y, 2e-5)                      # measured 5.0e-6


def test_pinv_equals_transpose_when_hard() -> None:
    """For a hard P the transpose is the pseudo-inverse of M (the paper's argument)."""
    kw = {"tile_count": 16, "tau": float("inf")}
    x = _x(2, 15 * 22, 8)
    a = build_plan(x, 15, 22, 0.5, unmerge="transpose", **kw)
    b = build_plan(x, 15, 22, 0.5, unmerge="pinv", **kw)
    _close(a.unmerge_w, b.unmerge_w, 1.5e-6)                          # measured 3.6e-7


def test_unmerge_commutes_with_affine() -> None:
    """Rows of P^T sum to 1: unmerge(y W + b) == unmerge(y) W + b."""
    plan = build_plan(_x(2, 15 * 22, 8), 15, 22, 0.5, tile_count=16, tau=10.0)
    y = _x(2, plan.merged_tokens, 6, seed=1)
    weight, bias = torch.randn(6, 3), torch.randn(3)
    _close(plan.unmerge(y @ weight + bias), plan.unmerge(y) @ weight + bias, 5e-6)  # meas. 1.2e-6


def test_tau_limits() -> None:
    """tau = 1e6 stays finite; tau = 1000 is nearly the hard assignment."""
    x = _x(2, 16 * 16, 64, seed=7)
    huge = build_plan(x, 16, 16, 0.5, tile_count=16, tau=1e6)
    assert torch.isfinite(huge.merge_w).all() and torch.isfinite(huge.unmerge_w).all()
    hard = build_plan(x, 16, 16, 0.5, tile_count=16, tau=float("inf"))
    near = build_plan(x, 16, 16, 0.5, tile_count=16, tau=1000.0)
    assert torch.equal(near.dest_slots, hard.dest_slots)
    # Same winner for every token, and nearly all of each token's weight on it.
    p_near, p_hard = _p(near), _p(hard)
    assert torch.equal(p_near.argmax(-2), p_hard.argmax(-2))
    top = p_near.max(-2).values
    assert float((top > 0.99).float().mean()) > 0.95                   # measured 0.988
    assert float((p_near - p_hard).abs().mean()) < 2e-3                # measured 7.0e-4
    assert torch.equal(huge.dest_slots, hard.dest_slots)
    assert torch.equal(_p(huge), p_hard)                                # tau 1e6: all 0/1
    soft = build_plan(x, 16, 16, 0.5, tile_count=16, tau=1.0)
    assert float((soft.merge_w - hard.merge_w).abs().max()) > 0.25      # measured 0.51


# ----------------------------------------------------------------------------- destinations


@pytest.mark.parametrize(("h", "w", "mode", "tile_count"), LAYOUTS)
def test_dest_tokens_follow_merged_order(h: int, w: int, mode: str, tile_count: int) -> None:
    """dest_tokens[i] is the grid token of merged row i; that token unmerges to merged row i."""
    x = _x(2, h * w, 8, seed=8)
    plan = build_plan(x, h, w, 0.5, mode=mode, tile_count=tile_count)
    ids = plan.regions.token_ids()
    expected = torch.stack([ids.gather(-1, plan.dest_slots[b]).flatten() for b in range(2)])
    assert torch.equal(plan.dest_tokens, expected)
    assert plan.dest_tokens.shape == (2, plan.merged_tokens)
    for b in range(2):
        assert len(set(plan.dest_tokens[b].tolist())) == plan.merged_tokens
    merged = plan.merge(x)
    restored = plan.unmerge(merged)
    at_dest = restored.gather(1, plan.dest_tokens.unsqueeze(-1).expand(-1, -1, 8))
    assert torch.equal(at_dest, merged)


def test_destinations_per_region() -> None:
    for (h, w, mode, tile_count) in LAYOUTS:
        regions = make_regions(h, w, mode, tile_count)
        for ratio in (0.1, 0.25, 0.5, 0.75, 0.99):
            k = destinations_per_region(ratio, regions)
            assert 1 <= k <= regions.min_size
            target = (1 - ratio) * h * w
            if 1 < k < regions.min_size:
                assert abs(regions.count * k - target) <= regions.count / 2 + 1e-9


@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.75, 0.9])
def test_merged_count_follows_ratio(ratio: float) -> None:
    plan = build_plan(_x(1, 64 * 64, 8), 64, 64, ratio, tile_count=64)
    assert plan.tokens == 4096
    assert plan.merged_tokens == round((1 - ratio) * 64) * 64
    assert plan.merge(_x(1, 4096, 8)).shape == (1, plan.merged_tokens, 8)


# ---------------------------------------------------------------------------- layouts, dtypes


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_keeps_dtype(dtype: torch.dtype) -> None:
    h, w = 15, 22
    x = _x(2, h * w, 16, seed=9)
    plan = build_plan(x.to(dtype), h, w, 0.5, tile_count=16)
    assert plan.merge_w.dtype == torch.float32
    # Features are read in float32: same plan as from the upcast features.
    ref = build_plan(x.to(dtype).float(), h, w, 0.5, tile_count=16)
    assert torch.equal(plan.dest_slots, ref.dest_slots)
    assert torch.equal(plan.merge_w, ref.merge_w)
    xl = x.to(dtype)
    merged = plan.merge(xl)
    restored = plan.unmerge(merged)
    assert merged.dtype == dtype and restored.dtype == dtype
    tol = 5e-3 if dtype == torch.float16 else 4e-2          # measured 1.4e-3 and 1.27e-2
    _close(merged.float(), plan.merge(xl.float()), tol)
    _close(restored.float(), plan.unmerge(plan.merge(xl.float())), tol)
    # Heads layout in low precision too.
    xh = xl.view(2, h * w, 2, 8).transpose(1, 2)
    assert plan.merge(xh).dtype == dtype and plan.unmerge(plan.merge(xh)).dtype == dtype


@pytest.mark.parametrize(("h", "w", "mode", "tile_count"), LAYOUTS)
def test_heads_layout_matches_per_head(h: int, w: int, mode: str, tile_count: int) -> None:
    """[B, H, N, D] merges each head like its own [B, N, D]."""
    n = h * w
    plan = build_plan(_x(2, n, 8), h, w, 0.5, mode=mode, tile_count=tile_count)
    xh = _x(2, 3 * n, 4, seed=10).view(2, 3, n, 4)
    merged = plan.merge(xh)
    assert merged.shape == (2, 3, plan.merged_tokens, 4)
    for head in range(3):
        assert torch.equal(merged[:, head], plan.merge(xh[:, head].contiguous()))
    restored = plan.unmerge(merged)
    assert restored.shape == xh.shape
    for head in range(3):
        assert torch.equal(restored[:, head], plan.unmerge(merged[:, head].contiguous()))


@pytest.mark.parametrize(("h", "w", "mode", "tile_count"), LAYOUTS[:4])
@pytest.mark.parametrize(("prefix", "suffix"), [(7, 0), (0, 5), (7, 3)])
def test_prefix_suffix_pass_through(h: int, w: int, mode: str, tile_count: int, prefix: int,
                                    suffix: int) -> None:
    n = h * w
    plan = build_plan(_x(2, n, 8), h, w, 0.5, mode=mode, tile_count=tile_count)
    x = _x(2, prefix + n + suffix, 6, seed=11)
    merged = plan.merge(x, prefix=prefix)
    m = plan.merged_tokens
    assert merged.shape == (2, prefix + m + suffix, 6)
    assert torch.equal(merged[:, :prefix], x[:, :prefix])
    assert torch.equal(merged[:, prefix + m:], x[:, prefix + n:])
    assert torch.equal(merged[:, prefix:prefix + m],
                       plan.merge(x[:, prefix:prefix + n].contiguous()))
    restored = plan.unmerge(merged, prefix=prefix)
    assert restored.shape == x.shape
    assert torch.equal(restored[:, :prefix], x[:, :prefix])
    assert torch.equal(restored[:, prefix + n:], x[:, prefix + n:])
    assert torch.equal(restored[:, prefix:prefix + n],
                       plan.unmerge(plan.merge(x[:, prefix:prefix + n])))
    # Heads layout with a prefix.
    xh = x.view(2, prefix + n + suffix, 2, 3).transpose(1, 2)
    mh = plan.merge(xh, prefix=prefix)
    assert torch.equal(mh[:, :, :prefix], xh[:, :, :prefix])
    assert torch.equal(mh[:, :, prefix + m:], xh[:, :, prefix + n:])


@pytest.mark.parametrize("batch", ["shared", "per_item"])
def test_merge_positions_flux_like(batch: str) -> None:
    """Flux pe [1, 1, L, 8, 2, 2] with a text prefix: merged rows take their destination's pe."""
    h, w, prefix = 12, 10, 9
    n = h * w
    x = _x(2, n, 8, seed=12)
    plan = build_plan(x, h, w, 0.5, tile_count=16, batch=batch)
    pe = torch.randn(1, 1, prefix + n, 8, 2, 2)
    out = plan.merge_positions(pe, dim=2, prefix=prefix)
    items = plan.dest_tokens.shape[0]
    assert out.shape == (items, 1, prefix + plan.merged_tokens, 8, 2, 2)
    for b in range(items):
        assert torch.equal(out[b, :, :prefix], pe[0, :, :prefix])
        for i, t in enumerate(plan.dest_tokens[b].tolist()):
            assert torch.equal(out[b, :, prefix + i], pe[0, :, prefix + t])
    # Negative dim and a suffix of extra rows.
    pe2 = torch.randn(1, 1, prefix + n + 4, 8, 2, 2)
    out2 = plan.merge_positions(pe2, dim=-4, prefix=prefix)
    assert torch.equal(out2[:, :, -4:], pe2[:, :, -4:].expand(items, -1, -1, -1, -1, -1))
    with pytest.raises(ValueError, match="positions"):
        plan.merge_positions(pe[:, :, :n], dim=2, prefix=prefix)


# ----------------------------------------------------------------------------- batch policies


def test_per_item_equals_single_item_plans() -> None:
    h, w = 15, 22
    x = _x(3, h * w, 8, seed=13)
    plan = build_plan(x, h, w, 0.5, tile_count=16, batch="per_item")
    assert plan.merge_w.shape[0] == 3
    for i in range(3):
        alone = build_plan(x[i:i + 1], h, w, 0.5, tile_count=16)
        assert torch.equal(plan.dest_slots[i], alone.dest_slots[0])
        assert torch.equal(plan.dest_tokens[i], alone.dest_tokens[0])
        assert torch.equal(plan.merge_w[i], alone.merge_w[0])
        assert torch.equal(plan.unmerge_w[i], alone.unmerge_w[0])
    # Items never mix: changing item 0 leaves items 1 and 2's merge untouched.
    x2 = x.clone()
    x2[0] = torch.randn(h * w, 8)
    other = build_plan(x2, h, w, 0.5, tile_count=16)
    assert torch.equal(other.merge(x2)[1:], plan.merge(x)[1:])
    with pytest.raises(ValueError, match="batch"):
        plan.merge(x[:2])


def test_shared_policy() -> None:
    h, w = 15, 22
    x = _x(2, h * w, 8, seed=14)
    plan = build_plan(x, h, w, 0.5, tile_count=16, batch="shared")
    assert plan.merge_w.shape[0] == 1 and plan.unmerge_w.shape[0] == 1
    assert plan.dest_tokens.shape[0] == 1
    mean = build_plan(x.mean(0, keepdim=True), h, w, 0.5, tile_count=16)
    assert torch.equal(plan.dest_slots, mean.dest_slots)
    assert torch.equal(plan.merge_w, mean.merge_w)
    for b in (1, 2, 5):
        y = _x(b, h * w, 4, seed=b)
        merged = plan.merge(y)
        assert merged.shape == (b, plan.merged_tokens, 4)
        # Each item merged with the same weights as a batch of one.
        for i in range(b):
            assert torch.equal(merged[i:i + 1], plan.merge(y[i:i + 1]))
        assert plan.unmerge(merged).shape == y.shape


def test_deterministic() -> None:
    x = _x(2, 45 * 80, 16, seed=15)
    a = build_plan(x, 45, 80, 0.5, tile_count=64)
    b = build_plan(x, 45, 80, 0.5, tile_count=64)
    for name in ("dest_slots", "dest_tokens", "merge_w", "unmerge_w"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_prebuilt_regions_used() -> None:
    regions = make_regions(15, 22, "stripe", 3)
    x = _x(1, 15 * 22, 8)
    plan = build_plan(x, 15, 22, 0.5, regions=regions)
    assert plan.regions.count == 3 and plan.regions.cols == 1
    ref = build_plan(x, 15, 22, 0.5, mode="stripe", tile_count=3)
    assert torch.equal(plan.merge_w, ref.merge_w)


# -------------------------------------------------------------------------------- no zeros


@pytest.mark.parametrize("unmerge", UNMERGE_METHODS)
@pytest.mark.parametrize(("h", "w", "mode", "tile_count"), LAYOUTS)
def test_no_zero_rows(h: int, w: int, mode: str, tile_count: int, unmerge: str) -> None:
    """Positive tokens never merge or unmerge into an all-zero row (the reference's ragged bug)."""
    n = h * w
    x = torch.rand(2, n, 6, generator=torch.Generator().manual_seed(n)) + 0.1
    plan = build_plan(x, h, w, 0.5, mode=mode, tile_count=tile_count, unmerge=unmerge)
    merged = plan.merge(x)
    restored = plan.unmerge(merged)
    assert bool((merged.abs().sum(-1) > 0).all())
    assert bool((restored.abs().sum(-1) > 0).all())
    assert torch.isfinite(restored).all()


@settings(max_examples=40, deadline=None)
@given(h=st.integers(1, 24), w=st.integers(1, 24), tile_count=st.integers(1, 100),
       mode=st.sampled_from(REGION_MODES), ratio=st.floats(0.05, 0.95),
       unmerge=st.sampled_from(UNMERGE_METHODS))
def test_plan_property(h: int, w: int, tile_count: int, mode: str, ratio: float,
                       unmerge: str) -> None:
    """Any grid: shapes hold, constants survive, positive tokens never produce zero rows."""
    n = h * w
    x = torch.rand(2, n, 4, generator=torch.Generator().manual_seed(n)) + 0.1
    plan = build_plan(x, h, w, ratio, mode=mode, tile_count=tile_count, unmerge=unmerge)
    if plan is None:
        regions = make_regions(h, w, mode, tile_count)
        assert regions.count * destinations_per_region(ratio, regions) >= n
        return
    assert plan.merged_tokens < n
    merged = plan.merge(x)
    restored = plan.unmerge(merged)
    assert merged.shape == (2, plan.merged_tokens, 4) and restored.shape == x.shape
    assert bool((merged.abs().sum(-1) > 0).all()) and bool((restored.abs().sum(-1) > 0).all())
    const = torch.full((2, n, 4), 0.7)
    _close(plan.unmerge(plan.merge(const)), const, 1e-5)   # measured 2.5e-6 (40 examples)


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("ratio", [-0.1, 1.0, 1.5, math.nan])
def test_bad_ratio(ratio: float) -> None:
    with pytest.raises(ValueError, match="ratio"):
        build_plan(_x(1, 64, 4), 8, 8, ratio)


@pytest.mark.parametrize("shape", [(64, 4), (1, 63, 4), (1, 1, 64, 4)])
def test_bad_feature_shape(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="features"):
        build_plan(torch.randn(*shape), 8, 8, 0.5)


@pytest.mark.parametrize(("kwargs", "word"), [
    ({"mode": "hexagon"}, "mode"), ({"unmerge": "inverse"}, "unmerge"),
    ({"batch": "each"}, "batch"), ({"tau": 0.0}, "tau"), ({"tau": -1.0}, "tau"),
])
@pytest.mark.parametrize("ratio", [0.5, 0.0])
def test_bad_options(kwargs: dict, word: str, ratio: float) -> None:
    """Unknown options are rejected even when the ratio would make the plan a no-op."""
    with pytest.raises(ValueError, match=word):
        build_plan(_x(1, 64, 4), 8, 8, ratio, **kwargs)


def test_regions_for_another_grid_rejected() -> None:
    with pytest.raises(ValueError, match="grid"):
        build_plan(_x(1, 64, 4), 8, 8, 0.5, regions=make_regions(4, 16))


def test_bad_merge_inputs() -> None:
    plan = build_plan(_x(2, 64, 4), 8, 8, 0.5, tile_count=4)
    with pytest.raises(ValueError, match="expected"):
        plan.merge(torch.randn(64, 4))
    with pytest.raises(ValueError, match="tokens"):
        plan.merge(torch.randn(2, 63, 4))
    with pytest.raises(ValueError, match="tokens"):
        plan.merge(torch.randn(2, 64, 4), prefix=1)
    with pytest.raises(ValueError, match="tokens"):
        plan.unmerge(torch.randn(2, plan.merged_tokens - 1, 4))


# ---------------------------------------------------------- compact products == dense products


def _dense_merge(plan: MergePlan, x: torch.Tensor, prefix: int) -> torch.Tensor:
    """The definition: M @ (x's grid in region layout), every slot multiplied."""
    n = plan.tokens
    w = plan.merge_w.unsqueeze(1) if x.dim() == 4 else plan.merge_w
    merged = (w @ plan.regions.split(x[..., prefix:prefix + n, :])).flatten(-3, -2)
    return torch.cat((x[..., :prefix, :], merged, x[..., prefix + n:, :]), -2)


def _dense_unmerge(plan: MergePlan, y: torch.Tensor, prefix: int) -> torch.Tensor:
    """The definition: U @ merged tokens per region, joined back to grid order."""
    m = plan.merged_tokens
    w = plan.unmerge_w.unsqueeze(1) if y.dim() == 4 else plan.unmerge_w
    grid = y[..., prefix:prefix + m, :].unflatten(-2, (plan.regions.count, plan.k))
    return torch.cat((y[..., :prefix, :], plan.regions.join(w @ grid), y[..., prefix + m:, :]),
                     -2)


@pytest.mark.parametrize(("h", "w", "mode", "tile_count"), [*LAYOUTS, (64, 64, "tile", 64)])
@pytest.mark.parametrize("batch", ["per_item", "shared"])
@pytest.mark.parametrize("unmerge", UNMERGE_METHODS)
def test_compact_products_equal_dense(h: int, w: int, mode: str, tile_count: int, batch: str,
                                      unmerge: str) -> None:
    """merge/unmerge skip the known zeros of M and P^T (destination columns/rows) and gather
    instead of reshaping: the same results as the dense products, in every layout.
    Measured: merge differs by at most 4.2e-7 of the largest output (summation order);
    unmerge is bit-identical (the skipped terms are exact zeros and ones)."""
    n = h * w
    plan = build_plan(_x(2, n, 8, seed=h * w), h, w, 0.5, mode=mode, tile_count=tile_count,
                      tau=5.0, batch=batch, unmerge=unmerge)
    for prefix, suffix in ((0, 0), (5, 3)):
        x = _x(2, prefix + n + suffix, 12, seed=prefix)
        for t in (x, x.view(2, -1, 3, 4).transpose(1, 2)):          # [B, L, C], [B, H, L, D]
            merged, ref = plan.merge(t, prefix), _dense_merge(plan, t, prefix)
            assert merged.shape == ref.shape
            assert float((merged - ref).abs().max()) <= 1e-6 * float(ref.abs().max())
            y = torch.randn(ref.shape, generator=torch.Generator().manual_seed(n))
            assert torch.equal(plan.unmerge(y, prefix), _dense_unmerge(plan, y, prefix))


def test_weights_without_self_source_rejected() -> None:
    """The compact merge relies on each destination being its own only source: a plan whose
    merge weights break that is refused, not silently merged wrong."""
    plan = build_plan(_x(1, 64, 4), 8, 8, 0.5, tile_count=4)
    broken = plan.merge_w.clone()
    broken[0, 0, 0] = 1.0 / broken.shape[-1]             # destination 0 takes every slot
    with pytest.raises(ValueError, match="own only source"):
        MergePlan(plan.regions, plan.k, plan.dest_slots, plan.dest_tokens, broken,
                  plan.unmerge_w)


def test_unmerge_onto_adds_the_base_and_keeps_its_dtype_promotion():
    """base + unmerge(update): bit-identical to the out-of-place sum, and a float32 base with a
    bfloat16 update still gives float32 (the in-place shortcut only where dtypes match)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 64, 8, generator=g)
    plan = build_plan(x, 8, 8, 0.5, tile_count=4)
    update = torch.randn(2, plan.merged_tokens, 8, generator=g)
    assert torch.equal(plan.unmerge_onto(update, x), x + plan.unmerge(update))
    mixed = plan.unmerge_onto(update.bfloat16(), x)
    assert mixed.dtype == torch.float32
    assert torch.equal(mixed, x + plan.unmerge(update.bfloat16()))
