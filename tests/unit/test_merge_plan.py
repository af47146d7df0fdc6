"""Merge plans (toma_core.merge_plan): weights, merge/unmerge identities, the block scope
(begin / finish / around), layouts, positions, batches, dtypes, and the hot path's shape: a
gather and a batched matmul per step, nothing read back to the host."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from plan_reference import split
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from toma_pack.toma_core import (
    REGION_MODES,
    UNMERGE_METHODS,
    MergePlan,
    build_plan,
    make_regions,
)
from toma_pack.toma_core.merge_plan import destinations_per_region

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
    valid = plan.tables.valid
    return torch.ones(r.count, r.size, dtype=torch.bool) if valid is None else valid


def _m(plan: MergePlan) -> torch.Tensor:
    """M as [B, R, k, S]."""
    r = plan.regions
    return plan.merge_w.view(plan.items, r.count, plan.k, r.size)


def _p(plan: MergePlan) -> torch.Tensor:
    """The soft assignment P [B, R, k, S], read back from a transpose plan's unmerge weights."""
    r = plan.regions
    return plan.unmerge_w.view(plan.items, r.count, r.size, plan.k).transpose(-1, -2)


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    """|a - b| <= tol everywhere. Each caller's tol is the largest difference measured over all
    its cases (torch 2.13 CPU, stated beside it; where an Intel and an AMD CPU differ, both)
    times a margin of about 4; comparisons measured bit-identical use torch.equal instead."""
    torch.testing.assert_close(a, b, atol=tol, rtol=0)


# The definitions, written with split/join (independent of the plan's gather indices).
def _dense_merge(plan: MergePlan, x: torch.Tensor, prefix: int = 0) -> torch.Tensor:
    """M @ (x's grid in region layout), other tokens kept: [B, L, C] -> [B, L', C]."""
    n, r = plan.tokens, plan.regions
    m = _m(plan).to(x.dtype)
    merged = (m @ split(r, x[:, prefix:prefix + n])).flatten(1, 2)
    return torch.cat((x[:, :prefix], merged, x[:, prefix + n:]), 1)


def _dense_unmerge(plan: MergePlan, y: torch.Tensor, prefix: int = 0) -> torch.Tensor:
    """U @ merged tokens per region, joined back to grid order: [B, L', C] -> [B, L, C]."""
    mt, r = plan.merged_tokens, plan.regions
    u = plan.unmerge_w.view(plan.items, r.count, r.size, plan.k).to(y.dtype)
    grid = y[:, prefix:prefix + mt].unflatten(1, (r.count, plan.k))
    return torch.cat((y[:, :prefix], r.join(u @ grid), y[:, prefix + mt:]), 1)


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
    """Tokens all equal (per batch item): merge, merge->unmerge and a block scope around the
    identity give that token back."""
    n = h * w
    value = torch.tensor([[1.5, -2.0, 0.25, 3.0], [-0.5, 0.75, 2.0, -1.25]])
    x = value[:, None, :].expand(2, n, 4).contiguous()
    # Plan from unrelated features so the weights are soft and uneven.
    plan = build_plan(_x(2, n, 6, seed=n), h, w, 0.5, mode=mode, tile_count=tile_count,
                      unmerge=unmerge)
    merged = plan.merge(x)
    assert merged.shape == (2, plan.merged_tokens, 4)
    _close(merged, value[:, None, :].expand_as(merged), 2e-6)         # measured 4.8e-7
    _close(plan.unmerge(merged), x, 2.5e-5)                           # measured 6.0e-6
    # x - U M x + U M x: measured bit-identical here, rounding allowed as for unmerge
    _close(plan.around(lambda t: t, x), x, 2.5e-5)


# ------------------------------------------------------------------------------ the weights


@pytest.mark.parametrize(("h", "w", "mode", "tile_count"), LAYOUTS)
@pytest.mark.parametrize("tau", [1.0, 50.0, 1000.0])
def test_weights_normalised(h: int, w: int, mode: str, tile_count: int, tau: float) -> None:
    """P columns sum to 1 on real slots (0 on pads); M = P with rows normalised."""
    plan = build_plan(_x(2, h * w, 8, seed=h + w), h, w, 0.5, mode=mode, tile_count=tile_count,
                      tau=tau)
    r, k, s = plan.regions.count, plan.k, plan.regions.size
    assert plan.merge_w.shape == (2 * r, k, s) and plan.unmerge_w.shape == (2 * r, s, k)
    assert plan.merge_w.dtype == torch.float32 and plan.unmerge_w.dtype == torch.float32
    p, m = _p(plan), _m(plan)
    valid = _valid(plan).float()
    _close(p.sum(-2), valid.expand(2, r, s), 2e-6)                    # measured 4.8e-7
    assert bool((p >= 0).all())
    _close(m.sum(-1), torch.ones(2, r, k), 2e-6)
    _close(m * p.sum(-1, keepdim=True), p, 2e-6)
    # Pad slots carry no weight at all.
    pad = ~_valid(plan)
    assert not (m * pad[None, :, None, :]).any()
    assert not (_p(plan) * pad[None, :, None, :]).any()


def test_destination_is_its_own_source() -> None:
    """Each destination's column of P is one-hot on itself, so no merged token is empty."""
    plan = build_plan(_x(2, 15 * 22, 8), 15, 22, 0.6, tile_count=16, tau=5.0)
    p = _p(plan)
    own = p.gather(-1, plan.dest_slots.unsqueeze(-1)).squeeze(-1)       # [B, R, k]
    assert torch.equal(own, torch.ones_like(own))
    dest_cols = p.gather(-1, plan.dest_slots.unsqueeze(-2).expand_as(p[..., :plan.k]))
    assert torch.equal(dest_cols, torch.eye(plan.k).expand_as(dest_cols))


def test_hard_assignment() -> None:
    """tau = inf: P is 0/1 and each token goes to its most similar destination."""
    h, w = 15, 22
    x = _x(2, h * w, 8)
    plan = build_plan(x, h, w, 0.5, tile_count=16, tau=float("inf"))
    p = _p(plan)
    assert bool(((p == 0) | (p == 1)).all())
    xn = split(plan.regions, torch.nn.functional.normalize(x, dim=-1))
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
    assert torch.equal(m, (m > 0).float() / counts)                   # measured bit-identical


@pytest.mark.parametrize(("h", "w", "mode", "tile_count"), LAYOUTS)
@pytest.mark.parametrize("tau", [1000.0, 20.0])
def test_pinv_merge_unmerge_roundtrip(h: int, w: int, mode: str, tile_count: int,
                                      tau: float) -> None:
    """pinv unmerge: merge(unmerge(y)) == y also for soft weights."""
    plan = build_plan(_x(2, h * w, 8, seed=5), h, w, 0.5, mode=mode, tile_count=tile_count,
                      tau=tau, unmerge="pinv")
    r = plan.regions
    assert plan.unmerge_w.shape == (2 * r.count, r.size, plan.k)
    y = _x(2, plan.merged_tokens, 5, seed=6)
    _close(plan.merge(plan.unmerge(y)), y, 2e-5)                      # measured 5.3e-6


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
    g = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(6, 3, generator=g), torch.randn(3, generator=g)
    _close(plan.unmerge(y @ weight + bias), plan.unmerge(y) @ weight + bias,
           6e-6)                                                      # measured 1.4e-6


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


# --------------------------------------------------------------- merge/unmerge as defined


@pytest.mark.parametrize(("h", "w", "mode", "tile_count"), [*LAYOUTS, (64, 64, "tile", 64)])
@pytest.mark.parametrize("batch", ["per_item", "shared"])
@pytest.mark.parametrize("unmerge", UNMERGE_METHODS)
def test_merge_and_unmerge_are_their_definitions(h: int, w: int, mode: str, tile_count: int,
                                                 batch: str, unmerge: str) -> None:
    """merge(x) = M @ split(grid), unmerge(y) = join(U @ merged grid), with a prefix and a
    suffix around the grid: what the one gather + one bmm compute. Measured bit-identical."""
    n = h * w
    plan = build_plan(_x(2, n, 8, seed=h * w), h, w, 0.5, mode=mode, tile_count=tile_count,
                      tau=5.0, batch=batch, unmerge=unmerge)
    for prefix, suffix in ((0, 0), (5, 3)):
        x = _x(2, prefix + n + suffix, 12, seed=prefix)
        merged = plan.merge(x, prefix)
        assert torch.equal(merged, _dense_merge(plan, x, prefix))
        y = torch.randn(merged.shape, generator=torch.Generator().manual_seed(n))
        assert torch.equal(plan.unmerge(y, prefix), _dense_unmerge(plan, y, prefix))


@pytest.mark.parametrize(("h", "w", "mode", "tile_count"), LAYOUTS)
def test_dest_tokens_follow_merged_order(h: int, w: int, mode: str, tile_count: int) -> None:
    """dest_tokens[i] is the grid token of merged row i; that token unmerges to merged row i."""
    x = _x(2, h * w, 8, seed=8)
    plan = build_plan(x, h, w, 0.5, mode=mode, tile_count=tile_count)
    slots = plan.tables.slots
    expected = torch.stack([slots.gather(-1, plan.dest_slots[b]).flatten() for b in range(2)])
    assert torch.equal(plan.dest_tokens, expected)
    assert plan.dest_tokens.shape == (2, plan.merged_tokens)
    for b in range(2):
        assert len(set(plan.dest_tokens[b].tolist())) == plan.merged_tokens
    merged = plan.merge(x)
    restored = plan.unmerge(merged)
    at_dest = restored.gather(1, plan.dest_tokens.unsqueeze(-1).expand(-1, -1, 8))
    assert torch.equal(at_dest, merged)


def test_destinations_per_region() -> None:
    """k: at least 1, at most the smallest region, and R * k within R / 2 of (1 - ratio) N
    (rounding) where it is not clamped; video boxes alike."""
    cases = [make_regions(h, w, mode, tiles) for (h, w, mode, tiles) in LAYOUTS]
    cases += [make_regions(22, 40, "tile", 28, t=31, frames=2),
              make_regions(7, 9, "tile", 6, t=5, frames=3)]
    for regions in cases:
        for ratio in (0.1, 0.25, 0.5, 0.75, 0.99):
            k = destinations_per_region(ratio, regions)
            assert 1 <= k <= regions.min_size
            target = (1 - ratio) * regions.tokens
            if 1 < k < regions.min_size:
                assert abs(regions.count * k - target) <= regions.count / 2 + 1e-9
    assert destinations_per_region(0.99, make_regions(8, 8, "tile", 4)) == 1
    assert destinations_per_region(0.0, make_regions(15, 22, "tile", 16)) == 20   # min_size


@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.75, 0.9])
def test_merged_count_follows_ratio(ratio: float) -> None:
    plan = build_plan(_x(1, 64 * 64, 8), 64, 64, ratio, tile_count=64)
    assert plan.tokens == 4096
    assert plan.merged_tokens == round((1 - ratio) * 64) * 64
    assert plan.merge(_x(1, 4096, 8)).shape == (1, plan.merged_tokens, 8)


# ------------------------------------------------------------------------------- block scope


@pytest.mark.parametrize(("h", "w", "mode", "tile_count"), LAYOUTS)
@pytest.mark.parametrize(("prefix", "suffix"), [(0, 0), (7, 3)])
def test_around_is_the_residual_update_unmerged(h: int, w: int, mode: str, tile_count: int,
                                                prefix: int, suffix: int) -> None:
    """around(fn, x) = x + unmerge(fn(merge(x)) - merge(x)) on the grid, fn's own output on the
    other tokens; begin/finish are its two halves, and base is taken before fn runs, so a block
    updating its input in place (Flux's img +=) changes nothing."""
    n = h * w
    plan = build_plan(_x(2, n, 8, seed=n), h, w, 0.5, mode=mode, tile_count=tile_count, tau=5.0)
    x = _x(2, prefix + n + suffix, 6, seed=12)
    weight = torch.randn(6, 6, generator=torch.Generator().manual_seed(1)) / 3

    def block(t: torch.Tensor) -> torch.Tensor:
        return t + torch.tanh(t @ weight)

    def in_place(t: torch.Tensor) -> torch.Tensor:
        t += torch.tanh(t @ weight)
        return t

    merged = plan.merge(x, prefix)
    update = block(merged) - merged
    want = x.clone()
    want[:, prefix:prefix + n] += plan.unmerge(update, prefix)[:, prefix:prefix + n]
    want[:, :prefix] = block(merged)[:, :prefix]
    want[:, prefix + n:] = block(merged)[:, prefix + plan.merged_tokens:]
    got = plan.around(block, x, prefix)
    _close(got, want, 8e-6)                     # measured 4.8e-7 (Intel Xeon), 2.1e-6 (AMD EPYC)
    assert torch.equal(plan.around(in_place, x.clone(), prefix), got)
    begun, pending = plan.begin(x, prefix)
    assert torch.equal(begun, merged)
    assert pending.base.shape == (2 * plan.regions.count, plan.regions.size, 6)
    assert pending.merged is None
    assert torch.equal(plan.finish(block(begun), pending, prefix), got)
    # a block that leaves its input alone: the update is taken after it, the same sum
    kept = plan.around(block, x, prefix, block_keeps_input=True)
    _close(kept, want, 8e-6)                    # measured 4.8e-7 (Intel Xeon), 1.7e-6 (AMD EPYC)
    begun, pending = plan.begin(x, prefix, block_keeps_input=True)
    assert torch.equal(pending.merged.view_as(begun[:, prefix:prefix + plan.merged_tokens]),
                       begun[:, prefix:prefix + plan.merged_tokens])
    # an identity block returns x itself up to rounding, text tokens exactly
    same = plan.around(lambda t: t, x, prefix)
    _close(same, x, 6e-6)                       # measured 2.4e-7 (Intel Xeon), 1.4e-6 (AMD EPYC)
    assert torch.equal(same[:, :prefix], x[:, :prefix])
    assert torch.equal(same[:, prefix + n:], x[:, prefix + n:])


@pytest.mark.parametrize("keeps_input", [True, False])
def test_blocks_in_a_row_hand_the_grid_on_in_region_order(keeps_input: bool) -> None:
    """Three blocks on one plan: handing the grid on in region order (finish keep_order, then
    begin ordered) gives bit for bit what three separate around() calls give, with one gather
    in and one out instead of one each per block; the block's input is never written into."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 16 * 16, 8, generator=g)
    plan = build_plan(x, 16, 16, 0.5, tile_count=16)
    weights = [torch.randn(8, 8, generator=g) / 3 for _ in range(3)]

    def block(i: int):
        return lambda t: t + torch.tanh(t @ weights[i])

    want = x
    for i in range(3):
        want = plan.around(block(i), want, block_keeps_input=keeps_input)
    with Ops() as ops:
        first = plan.around(block(0), x, block_keeps_input=keeps_input, keep_order=True)
        before = first.clone()
        second = plan.around(block(1), first, block_keeps_input=keeps_input, ordered=True,
                             keep_order=True)
        got = plan.around(block(2), second, block_keeps_input=keeps_input, ordered=True)
    assert torch.equal(got, want)
    assert torch.equal(first, before)
    assert ops.names.count("index") == 2, ops.names
    assert torch.equal(plan.grid_order(plan.around(block(0), x, keep_order=True)),
                       plan.around(block(0), x))


def test_region_order_needs_even_regions() -> None:
    """Ragged regions have pad slots, so region order would not be a [B, N, C] tensor: asked
    for, it is refused, as it is for a stream holding more than the grid."""
    x = _x(2, 15 * 22, 8)
    ragged = build_plan(x, 15, 22, 0.5, tile_count=16)
    with pytest.raises(ValueError, match="even regions"):
        ragged.around(lambda t: t, x, keep_order=True)
    with pytest.raises(ValueError, match="even regions"):
        ragged.grid_order(x)
    even = build_plan(_x(2, 16 * 16, 8), 16, 16, 0.5, tile_count=16)
    longer = _x(2, 3 + 16 * 16, 8)
    with pytest.raises(ValueError, match="even regions"):
        even.around(lambda t: t, longer, 3, keep_order=True)


def test_finish_promotes_a_low_precision_update_onto_a_float32_stream() -> None:
    """A float32 stream with a bfloat16 block output comes back float32 (the sum in float32,
    not an in-place add that keeps bfloat16): base + U @ out."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 64, 8, generator=g)
    plan = build_plan(x, 8, 8, 0.5, tile_count=4)
    merged, pending = plan.begin(x)
    out = (merged + 0.1 * torch.randn(merged.shape, generator=g)).bfloat16()
    got = plan.finish(out, pending._replace(base=pending.base.clone()))
    assert got.dtype == torch.float32
    assert torch.equal(got, plan.finish(out.float(), pending._replace(base=pending.base.clone())))
    low = plan.begin(x.bfloat16())
    assert plan.finish(low[0], low[1]).dtype == torch.bfloat16


# ---------------------------------------------------------------------------- layouts, dtypes


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_keeps_dtype(dtype: torch.dtype) -> None:
    """Features read in float32 (the plan of the upcast features), weights made in the
    activations' dtype, every output in it."""
    h, w = 15, 22
    x = _x(2, h * w, 16, seed=9)
    xl = x.to(dtype)
    plan = build_plan(xl, h, w, 0.5, tile_count=16)
    assert plan.merge_w.dtype == plan.unmerge_w.dtype == dtype
    ref = build_plan(xl.float(), h, w, 0.5, tile_count=16)
    assert torch.equal(plan.dest_slots, ref.dest_slots)
    assert torch.equal(plan.merge_w, ref.merge_w.to(dtype))
    assert torch.equal(plan.unmerge_w, ref.unmerge_w.to(dtype))
    merged = plan.merge(xl)
    restored = plan.unmerge(merged)
    assert merged.dtype == dtype and restored.dtype == dtype
    assert plan.around(lambda t: t * 2, xl).dtype == dtype
    tol = 6e-3 if dtype == torch.float16 else 5e-2          # measured 1.4e-3 and 1.27e-2
    _close(merged.float(), ref.merge(xl.float()), tol)
    _close(restored.float(), ref.unmerge(ref.merge(xl.float())), tol)
    # float32 activations on a low-precision plan: the weights cast once and kept
    assert plan.merge(x).dtype == torch.float32
    assert plan.weights(torch.float32)[0] is plan.weights(torch.float32)[0]


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


def test_only_streams_are_merged() -> None:
    """The hot path takes [B, L, C] streams only (the heads layout [B, H, L, D] is gone)."""
    plan = build_plan(_x(2, 64, 8), 8, 8, 0.5, tile_count=4)
    with pytest.raises(ValueError, match="stream"):
        plan.merge(_x(2, 64, 8).view(2, 64, 2, 4).transpose(1, 2))


@pytest.mark.parametrize("batch", ["shared", "per_item"])
@pytest.mark.parametrize("pe_batch", [1, 2])
def test_merge_positions_flux_like(batch: str, pe_batch: int) -> None:
    """Flux pe [1 or B, 1, L, 8, 2, 2] with a text prefix: merged rows take their destination's
    row, text rows are kept, a suffix of extra rows too."""
    h, w, prefix = 12, 10, 9
    n = h * w
    plan = build_plan(_x(2, n, 8, seed=12), h, w, 0.5, tile_count=16, batch=batch)
    pe = torch.randn(pe_batch, 1, prefix + n + 4, 8, 2, 2)
    out = plan.merge_positions(pe, dim=2, prefix=prefix)
    assert out.shape == (2, 1, prefix + plan.merged_tokens + 4, 8, 2, 2)
    for b in range(2):
        src = pe[b % pe_batch]
        assert torch.equal(out[b, :, :prefix], src[:, :prefix])
        assert torch.equal(out[b, :, -4:], src[:, -4:])
        for i, t in enumerate(plan.dest_tokens[b].tolist()):
            assert torch.equal(out[b, :, prefix + i], src[:, prefix + t])
    assert torch.equal(plan.merge_positions(pe, dim=-4, prefix=prefix), out)
    with pytest.raises(ValueError, match="positions"):
        plan.merge_positions(pe[:, :, :n], dim=2, prefix=prefix)
    with pytest.raises(ValueError, match="positions"):
        plan.merge_positions(pe[:1].expand(3, -1, -1, -1, -1, -1), dim=2, prefix=prefix)


@pytest.mark.parametrize("pe_batch", [1, 2])
def test_merge_positions_wan_like(pe_batch: int) -> None:
    """Wan-like rows [1 or B, L, 1, D] (token axis 1), no prefix: row i of the merged sequence
    is the row of merged token i's destination."""
    regions = make_regions(6, 8, "tile", 4, t=3, frames=1)
    plan = build_plan(_x(2, regions.tokens, 8, seed=2), 18, 8, 0.5, regions=regions)
    pe = torch.randn(pe_batch, regions.tokens, 1, 6)
    out = plan.merge_positions(pe, dim=1)
    assert out.shape == (2, plan.merged_tokens, 1, 6)
    for b in range(2):
        assert torch.equal(out[b], pe[b % pe_batch, plan.dest_tokens[b]])


def test_merge_positions_one_item_keeps_batch_one() -> None:
    plan = build_plan(_x(1, 64, 8), 8, 8, 0.5, tile_count=4)
    pe = torch.randn(1, 1, 64, 4)
    out = plan.merge_positions(pe, dim=2)
    assert out.shape == (1, 1, plan.merged_tokens, 4)
    assert torch.equal(out[0, 0], pe[0, 0, plan.dest_tokens[0]])


# ----------------------------------------------------------------------------- batch policies


def test_per_item_equals_single_item_plans() -> None:
    h, w = 15, 22
    x = _x(3, h * w, 8, seed=13)
    plan = build_plan(x, h, w, 0.5, tile_count=16, batch="per_item")
    assert plan.items == 3
    for i in range(3):
        alone = build_plan(x[i:i + 1], h, w, 0.5, tile_count=16)
        assert torch.equal(plan.dest_slots[i], alone.dest_slots[0])
        assert torch.equal(plan.dest_tokens[i], alone.dest_tokens[0])
        assert torch.equal(_m(plan)[i], _m(alone)[0])
        assert torch.equal(_p(plan)[i], _p(alone)[0])
        assert torch.equal(plan.merge(x)[i:i + 1], alone.merge(x[i:i + 1]))
    # Items never mix: changing item 0 leaves items 1 and 2's merge untouched.
    x2 = x.clone()
    x2[0] = torch.randn(h * w, 8)
    other = build_plan(x2, h, w, 0.5, tile_count=16)
    assert torch.equal(other.merge(x2)[1:], plan.merge(x)[1:])
    with pytest.raises(ValueError, match="batch"):
        plan.merge(x[:2])


def test_shared_policy() -> None:
    """One set of destinations and weights from the batch's mean features, the same for every
    item (each item merged as a batch of one would be)."""
    h, w = 15, 22
    x = _x(2, h * w, 8, seed=14)
    plan = build_plan(x, h, w, 0.5, tile_count=16, batch="shared")
    assert plan.items == 2
    mean = build_plan(x.mean(0, keepdim=True), h, w, 0.5, tile_count=16)
    for i in range(2):
        assert torch.equal(plan.dest_slots[i], mean.dest_slots[0])
        assert torch.equal(plan.dest_tokens[i], mean.dest_tokens[0])
        assert torch.equal(_m(plan)[i], _m(mean)[0])
        assert torch.equal(_p(plan)[i], _p(mean)[0])
    y = _x(2, h * w, 4, seed=2)
    merged = plan.merge(y)
    assert merged.shape == (2, plan.merged_tokens, 4)
    for i in range(2):
        assert torch.equal(merged[i:i + 1], mean.merge(y[i:i + 1]))
    assert plan.unmerge(merged).shape == y.shape


def test_deterministic() -> None:
    x = _x(2, 45 * 80, 16, seed=15)
    a = build_plan(x, 45, 80, 0.5, tile_count=64)
    b = build_plan(x, 45, 80, 0.5, tile_count=64)
    for name in ("dest_slots", "dest_tokens", "merge_w", "unmerge_w"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_prebuilt_regions_and_tables_used() -> None:
    regions = make_regions(15, 22, "stripe", 3)
    tables = regions.tables()
    x = _x(1, 15 * 22, 8)
    plan = build_plan(x, 15, 22, 0.5, regions=regions, tables=tables)
    assert plan.regions.count == 3 and plan.regions.col_sizes == (22,)
    assert plan.tables is tables
    ref = build_plan(x, 15, 22, 0.5, mode="stripe", tile_count=3)
    assert torch.equal(plan.merge_w, ref.merge_w)


def test_grid_after_an_offset() -> None:
    """Features with the grid at rows offset..offset+N (text before, references after): the plan
    of the bare grid."""
    x = _x(2, 64, 8, seed=4)
    long = torch.cat((_x(2, 5, 8, seed=5), x, _x(2, 3, 8, seed=6)), 1)
    a = build_plan(long, 8, 8, 0.5, tile_count=4, offset=5)
    b = build_plan(x, 8, 8, 0.5, tile_count=4)
    for name in ("dest_slots", "dest_tokens", "merge_w", "unmerge_w"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


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
    _close(plan.unmerge(plan.merge(const)), const, 1e-5)   # measured up to 2.5e-6 (40 examples)


def test_pinv_plan_where_an_svd_does_not_converge() -> None:
    """A grid (found by test_plan_property) whose merge weights made LAPACK's SVD fail to
    converge in torch.linalg.pinv here: the plan still builds, and U is a right inverse of M."""
    h, w = 19, 24
    x = torch.rand(2, h * w, 4, generator=torch.Generator().manual_seed(h * w)) + 0.1
    plan = build_plan(x, h, w, 0.27075197245413535, mode="global", tile_count=76,
                      unmerge="pinv")
    m, u = plan.merge_w.double(), plan.unmerge_w.double()
    eye = torch.eye(m.shape[1], dtype=torch.float64).expand(m.shape[0], -1, -1)
    _close(m @ u, eye, 3e-7)       # measured 5.9e-8


# --------------------------------------------------------------------------- the hot path


class Ops(TorchDispatchMode):
    """Names of the ops dispatched inside the mode, and the devices of their tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self.devices: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.names.append(func._overloadpacket.__name__)
        self.devices |= {t.device.type for t in pytree.tree_leaves((args, out))
                         if isinstance(t, torch.Tensor)}
        return out


# Ops that only reinterpret a tensor's memory (no kernel runs).
VIEWS = {"view", "_unsafe_view", "reshape", "slice", "select", "alias", "expand", "unsqueeze",
         "squeeze", "transpose", "t", "permute", "unflatten", "flatten", "as_strided"}


def _work(ops: Ops) -> list[str]:
    return [name for name in ops.names if name not in VIEWS]


def test_each_step_is_a_gather_and_a_batched_matmul() -> None:
    """merge: one gather + one bmm; unmerge: one bmm + one gather; begin: one gather, one bmm,
    one in-place baddbmm (on the gathered copy); finish: one in-place baddbmm (on base), one
    gather; and a concatenation where the stream holds more than the grid (prefix, suffix)."""
    x = _x(2, 3 + 15 * 22, 8, seed=1)
    plan = build_plan(x[:, 3:], 15, 22, 0.5, tile_count=16)
    grid = x[:, 3:].contiguous()
    plan.merge(grid), plan.unmerge(plan.merge(grid))           # gather indices made once
    merged = plan.merge(grid)
    for name, call, want in (
        ("merge", lambda: plan.merge(grid), ["index", "bmm"]),
        ("unmerge", lambda: plan.unmerge(merged), ["bmm", "index"]),
        ("begin", lambda: plan.begin(grid), ["index", "bmm", "baddbmm_"]),
    ):
        with Ops() as ops:
            call()
        assert _work(ops) == want, (name, ops.names)
    begun, base = plan.begin(grid)
    with Ops() as ops:
        plan.finish(begun, base)
    assert _work(ops) == ["baddbmm_", "index"], ops.names
    plan.merge(x, 3)
    with Ops() as ops:
        plan.merge(x, 3)
    assert _work(ops) == ["index", "bmm", "cat"], ops.names


def test_nothing_is_read_back_to_the_host() -> None:
    """The whole plan (build, merge, unmerge, block scope, positions) runs on the meta device,
    which has no data: any read of a device value on the host would raise; and no op touches a
    host tensor."""
    x = torch.empty(2, 5 + 15 * 22, 8, device="meta")
    pe = torch.empty(1, 1, 5 + 15 * 22, 4, device="meta")
    with Ops() as ops:
        for options in ({}, {"batch": "shared"}, {"center": True}):
            plan = build_plan(x, 15, 22, 0.5, tile_count=16, offset=5, **options)
            merged = plan.merge(x, 5)
            assert plan.unmerge(merged, 5).shape == x.shape
            assert plan.around(lambda t: t * 2, x, 5).shape == x.shape
            assert plan.merge_positions(pe, 2, 5).shape == (2, 1, merged.shape[1], 4)
    assert ops.devices == {"meta"}, ops.devices
    assert not {"_local_scalar_dense", "nonzero", "equal", "is_nonzero", "item"} & set(
        ops.names)


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("ratio", [-0.1, 1.0, 1.5, math.nan])
def test_bad_ratio(ratio: float) -> None:
    with pytest.raises(ValueError, match="ratio"):
        build_plan(_x(1, 64, 4), 8, 8, ratio)


@pytest.mark.parametrize("shape", [(64, 4), (1, 63, 4), (1, 1, 64, 4)])
def test_bad_feature_shape(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="features"):
        build_plan(torch.randn(*shape), 8, 8, 0.5)


def test_grid_past_the_features_rejected() -> None:
    with pytest.raises(ValueError, match="features"):
        build_plan(_x(1, 70, 4), 8, 8, 0.5, offset=7)


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
    with pytest.raises(ValueError, match="regions hold"):
        build_plan(_x(1, 64, 4), 8, 8, 0.5, regions=make_regions(4, 15))


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
    with pytest.raises(ValueError, match="tokens"):
        plan.finish(torch.randn(2, plan.merged_tokens - 1, 4), torch.empty(0))


@pytest.mark.parametrize(("mode", "frames"), [("tile", 1), ("stripe", 1), ("tile", 2)])
def test_plan_traces_on_symbolic_sizes(mode: str, frames: int) -> None:
    """After an artist changes resolution under torch.compile, dynamo makes sizes symbolic:
    building regions and a plan from them must still trace as one graph (a builtin that
    dynamo cannot apply to a symbolic int, such as divmod, makes it drop the whole frame)."""
    import torch._dynamo

    def merged(x: torch.Tensor) -> torch.Tensor:
        t, h, w = x.shape[1:4]           # x [B, t, h, w, C]
        tokens = x.reshape(x.shape[0], t * h * w, x.shape[-1])
        regions = make_regions(h, w, mode, 4, t=t, frames=frames)
        plan = build_plan(tokens, t * h, w, 0.5, regions=regions)
        return plan.unmerge(plan.merge(tokens))

    torch._dynamo.reset()
    compiled = torch.compile(merged, fullgraph=True, dynamic=True, backend="eager")
    for h, w in ((8, 8), (10, 12)):
        x = torch.randn(2, 3, h, w, 8)
        assert torch.allclose(compiled(x), merged(x), atol=1e-5)
    torch._dynamo.reset()
