"""The plan operator (toma_core.plan_op): its reference against a direct per-region computation,
the registered custom op (fake implementation, one op per plan), and the Triton kernel
(toma_core.triton_plan) run by Triton's interpreter on CPU tensors against the reference.

Exact ties are common in the greedy, not rare: when two candidates u, v are each other's best
cover, gain(u) = gain(v) exactly in real arithmetic. Which one float32 sums put first depends on
summation order, so picks are compared exactly up to the first step at which the greedy (in
float64) has a near-tie; after it the coverage f(D), the greedy property itself and the weights
of the regions whose picks agree are compared.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from plan_reference import direct, split, valid_slots
from torch.utils._python_dispatch import TorchDispatchMode

from toma_pack.toma_core import build_plan, make_regions, plan_op, triton_plan
from toma_pack.toma_core.facility_location import gram_similarity, greedy_facility_location
from toma_pack.toma_core.regions import Regions

# Tolerances: the largest difference measured (torch 2.13 CPU, Triton 3.6 interpreter, over
# every case of the test using it) times a margin of about 4, the measurement beside each.
GAIN_TOL = 2e-15     # float32 pick's float64 gain below the best available: measured 4.4e-16
F_TOL = 1e-15        # relative f(D) of two greedy paths up to a swapped pick: measured 2.2e-16
F_END_TOL = 7e-3     # relative f(D) of two greedy paths after a swap: measured 1.6e-3
P_TOL = 1.3e-6       # float32 P vs the float64 direct one: measured 3.2e-7
M_TOL = 5e-7         # float32 M vs P row-normalised in float64: measured 1.3e-7
LN_TOL = 1.7e-6      # centred vs layer-normed features' weights: measured 4.2e-7
KERNEL_TOL = 7e-7    # kernel vs reference float32 weights where picks agree: measured 1.8e-7
BF16_TOL = 8e-3      # the same in bfloat16: measured 3.9e-3, one rounding step of a weight
                     # in [0.5, 1]
GREEDY_BOUND = 1.0 - 1.0 / math.e

# (h, w, tile_count, t, frames): even tiles, ragged tiles (two), ragged video boxes
LAYOUTS = [(8, 8, 4, 1, 1), (7, 9, 4, 1, 1), (15, 22, 16, 1, 1), (5, 7, 2, 5, 2)]


def _regions(h: int, w: int, tiles: int, t: int, frames: int) -> Regions:
    return make_regions(h, w, "tile", tiles, t=t, frames=frames)


def _stream(b: int, length: int, c: int, seed: int, dtype: torch.dtype = torch.float32,
            channel_stride: bool = False) -> torch.Tensor:
    """Random [B, L, C]; channel_stride: a view whose channels are not contiguous."""
    g = torch.Generator().manual_seed(seed)
    if channel_stride:
        return torch.randn(b, c, length, generator=g).to(dtype).transpose(1, 2)
    return torch.randn(b, length, c, generator=g).to(dtype)


# ------------------------------------------------------------ the direct per-region computation


def shifted_similarity(stream: torch.Tensor, offset: int, regions: Regions,
                       center: bool) -> torch.Tensor:
    """cos + 1 between the real tokens of each region, float64, 0 where either slot is a pad:
    [B, R, S, S]."""
    x = split(regions, stream[:, offset:offset + regions.tokens].double())
    if center:
        x = x - x.mean(-1, keepdim=True)
    xn = x / x.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    valid = valid_slots(regions)
    return (xn @ xn.transpose(-1, -2) + 1.0).masked_fill(
        ~(valid[:, :, None] & valid[:, None, :]), 0.0)


def coverage(shifted: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
    """f(D) = sum_j max_{d in D} (cos(d, j) + 1) over the real tokens j: picks [..., k] of
    shifted [..., S, S] -> [...]."""
    rows = shifted.gather(-2, picks.unsqueeze(-1).expand(*picks.shape, shifted.shape[-1]))
    return rows.amax(-2).sum(-1)


def coverage_rows(shifted: torch.Tensor, pick: torch.Tensor) -> torch.Tensor:
    """The rows of shifted [..., S, S] at pick [..., 1]: [..., S]."""
    return shifted.gather(-2, pick.unsqueeze(-1).expand(*pick.shape, shifted.shape[-1])
                          ).squeeze(-2)


def run_reference(stream: torch.Tensor, offset: int, regions: Regions, k: int, tau: float,
                  center: bool, dtype: torch.dtype | None = None) -> plan_op.PlanTensors:
    tables = regions.tables()
    return plan_op.plan_weights_reference(stream, offset, tables.slots, tables.valid, k, tau,
                                          center, dtype or stream.dtype)


def as_p(out: plan_op.PlanTensors, b: int, regions: Regions) -> torch.Tensor:
    """P [B, R, k, S] from the operator's unmerge weights (U = P^T)."""
    k = out[0].shape[-1]
    return out[3].view(b, regions.count, regions.size, k).transpose(-1, -2).double()


# ------------------------------------------------------------------------------ the reference


@pytest.mark.parametrize("center", [False, True])
@pytest.mark.parametrize(("h", "w", "tiles", "t", "frames"), LAYOUTS)
@pytest.mark.parametrize("kfrac", [0.25, 0.5])
def test_reference_is_the_per_region_definition(h: int, w: int, tiles: int, t: int,
                                                frames: int, center: bool, kfrac: float) -> None:
    """The direct computation's very picks up to the first near-tie, and its weights (within
    float32 rounding) where all picks agree. Every region: each pick has the largest float64
    gain available at its step (the greedy property, hence the (1 - 1/e) guarantee), f(D) as the
    direct path's up to a swapped pick, destinations' grid tokens in pick order, pad slots
    weightless."""
    regions = _regions(h, w, tiles, t, frames)
    k, b, offset = max(1, int(regions.min_size * kfrac)), 2, 3
    stream = _stream(b, offset + regions.tokens + 2, 12, seed=h * w + t)
    out = run_reference(stream, offset, regions, k, 5.0, center)
    want = direct(stream, offset, regions, k, 5.0, center)
    picks, dest, merge_w, unmerge_w = out
    r, s = regions.count, regions.size
    assert picks.shape == (b, r, k) and dest.shape == (b, r * k)
    assert merge_w.shape == (b * r, k, s) and unmerge_w.shape == (b * r, s, k)
    settled = want["settled"]
    lead = torch.arange(k) < settled.unsqueeze(-1)                      # [B, R, k]
    assert torch.equal(picks[lead], want["picks"][lead])
    same = (picks == want["picks"]).all(-1)
    assert bool(same.any()), "no region to compare the weights on"
    p = as_p(out, b, regions)
    assert float((p - want["p"])[same].abs().max()) <= P_TOL
    merge = merge_w.view(b, r, k, s).double()
    assert float((merge - p / p.sum(-1, keepdim=True)).abs().max()) <= M_TOL
    # the greedy property on every region, in float64
    shifted = shifted_similarity(stream, offset, regions, center)
    cover = torch.zeros(b, r, s, dtype=torch.float64)
    blocked = ~valid_slots(regions).expand(b, r, s).clone()
    for step in range(k):
        gain = (shifted - cover.unsqueeze(-2)).clamp_min(0).sum(-1)
        gain = gain.masked_fill(blocked, -math.inf)
        pick = picks[..., step:step + 1]
        assert float((gain.amax(-1) - gain.gather(-1, pick).squeeze(-1)).max()) <= GAIN_TOL
        cover = torch.maximum(cover, coverage_rows(shifted, pick))
        blocked.scatter_(-1, pick, True)
    # where a near-tie swapped a pick: the same coverage up to that pick, and the ends of the
    # two greedy paths close
    split = (picks != want["picks"]).int().argmax(-1, keepdim=True)       # first differing
    upto = torch.arange(k) <= split                                         # [B, R, k]
    got_f = coverage(shifted, torch.where(upto, picks, picks[..., :1]))
    want_f = coverage(shifted, torch.where(upto, want["picks"], want["picks"][..., :1]))
    assert float(((got_f - want_f) / want_f).abs().max()) <= F_TOL
    got_f, want_f = coverage(shifted, picks), coverage(shifted, want["picks"])
    assert float(((got_f - want_f) / want_f).abs().max()) <= F_END_TOL
    slots = regions.tables().slots
    assert torch.equal(dest, slots.expand(b, r, s).gather(-1, picks).view(b, r * k))
    assert bool(valid_slots(regions).expand(b, r, s).gather(-1, picks).all())
    pad = ~valid_slots(regions)
    assert not (merge_w.view(b, r, k, s) * pad[None, :, None, :]).any()
    assert not (unmerge_w.view(b, r, s, k) * pad[None, :, :, None]).any()


@pytest.mark.parametrize("seed", range(6))
def test_greedy_guarantee_against_brute_force(seed: int) -> None:
    """Regions of 9 tokens (3 x 3 tiles) and k <= 3: f(greedy) is at least (1 - 1/e) of the
    best k-subset's f, and never above it."""
    regions = make_regions(6, 6, "tile", 4)
    stream = _stream(1, regions.tokens, 3, seed)
    shifted = shifted_similarity(stream, 0, regions, False)[0]              # [R, S, S]
    for k in (1, 2, 3):
        got = coverage(shifted, run_reference(stream, 0, regions, k, 5.0, False)[0][0])
        subsets = torch.tensor(list(itertools.combinations(range(regions.size), k)))
        n = len(subsets)
        every = coverage(shifted.unsqueeze(1).expand(-1, n, -1, -1),
                         subsets.expand(regions.count, -1, -1))                # [R, n]
        best = every.amax(-1)                                                # [R]
        assert bool((got <= best + 1e-12).all())         # measured: never above (0 at most)
        assert bool((got >= GREEDY_BOUND * best).all())  # measured: >= 0.88 of the best


@pytest.mark.parametrize(("h", "w", "tiles", "t", "frames"), LAYOUTS)
def test_ties_go_to_the_lowest_slot(h: int, w: int, tiles: int, t: int, frames: int) -> None:
    """Identical tokens: every gain ties, so the picks are the lowest real slots in order (pad
    slots, which ragged boxes have inside their extent, skipped). Two alternating kinds of token:
    the first two picks are the lowest slot of each kind, then the lowest of the rest."""
    regions = _regions(h, w, tiles, t, frames)
    valid, k = valid_slots(regions), regions.min_size
    picks = run_reference(torch.ones(1, regions.tokens, 4), 0, regions, k, 5.0, False)[0][0]
    for r in range(regions.count):
        assert picks[r].tolist() == valid[r].nonzero().flatten()[:k].tolist()
    kinds = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    slots = regions.tables().slots
    token_kind = torch.empty(regions.tokens, dtype=torch.long)
    token_kind[slots[valid]] = (valid.long().cumsum(-1) - 1)[valid] % 2   # alternate per region
    picks = run_reference(kinds[token_kind].unsqueeze(0), 0, regions, min(k, 4), 5.0,
                          False)[0][0]
    for r in range(regions.count):
        real = valid[r].nonzero().flatten()
        first_of_each = [int(real[0]), int(real[1])]
        rest = [int(v) for v in real if int(v) not in first_of_each]
        assert picks[r].tolist() == (first_of_each + rest)[:min(k, 4)]


@pytest.mark.parametrize(("h", "w", "tiles", "t", "frames"), [(7, 9, 4, 1, 1), (15, 22, 16, 1, 1),
                                                              (5, 7, 2, 5, 2), (5, 7, 4, 1, 1)])
def test_pad_slots_never_picked(h: int, w: int, tiles: int, t: int, frames: int) -> None:
    """k up to the smallest region's size: only real slots, distinct; the smallest regions
    take exactly their real slots."""
    regions = _regions(h, w, tiles, t, frames)
    assert not regions.even
    valid = valid_slots(regions)
    stream = _stream(2, regions.tokens, 5, seed=h * w)
    for k in sorted({1, max(1, regions.min_size // 2), regions.min_size}):
        picks = run_reference(stream, 0, regions, k, 5.0, False)[0]
        assert bool(valid.expand(2, -1, -1).gather(-1, picks).all())
        assert all(len(set(row)) == k for row in picks.reshape(-1, k).tolist())
    smallest = (valid.sum(-1) == regions.min_size).nonzero().flatten()
    for r in smallest.tolist():
        assert sorted(picks[0, r].tolist()) == valid[r].nonzero().flatten().tolist()


@pytest.mark.parametrize(("h", "w", "tiles", "t", "frames"), LAYOUTS)
def test_center_is_the_similarity_of_layer_normed_features(h: int, w: int, tiles: int, t: int,
                                                           frames: int) -> None:
    """center=True: the features minus their per-token mean (bit-identical to centring the
    stream by hand), which has the cosine similarity of layer-normed features: the same plan
    as from F.layer_norm(x) where no near-tie can swap a pick."""
    regions = _regions(h, w, tiles, t, frames)
    k, offset = max(1, regions.min_size // 4), 2
    # features with a large common offset per token, which centring removes
    stream = _stream(2, offset + regions.tokens, 16, seed=t * 7 + h) + torch.linspace(
        -3, 3, offset + regions.tokens).view(1, -1, 1)
    got = run_reference(stream, offset, regions, k, 5.0, True)
    by_hand = run_reference(stream - stream.mean(-1, keepdim=True), offset, regions, k, 5.0,
                            False)
    for a, b in zip(got, by_hand, strict=True):
        assert torch.equal(a, b)
    normed = run_reference(F.layer_norm(stream, (16,)), offset, regions, k, 5.0, False)
    want = direct(stream, offset, regions, k, 5.0, True)
    settled = (want["settled"] == k)
    assert bool(settled.any())
    assert torch.equal(got[0][settled], normed[0][settled])
    same = (got[0] == normed[0]).all(-1).view(-1)                       # [B*R]
    assert float((got[2] - normed[2])[same].abs().max()) <= LN_TOL
    assert float((got[3] - normed[3])[same].abs().max()) <= LN_TOL
    # and not the uncentred plan: the offsets dominate the raw similarity
    assert not torch.equal(got[0], run_reference(stream, offset, regions, k, 5.0, False)[0])


def test_grid_anywhere_in_the_stream_and_output_dtype() -> None:
    """The grid at rows offset..offset+N of a longer stream gives the plan of the bare grid;
    a bfloat16 stream is read in float32 (the plan of its float32 upcast) and the weights come
    out in the requested dtype."""
    regions = make_regions(15, 22, "tile", 16)
    k, n = regions.min_size // 2, regions.tokens
    grid = _stream(2, n, 8, seed=1)
    long = torch.cat((_stream(2, 5, 8, seed=2), grid, _stream(2, 3, 8, seed=3)), 1)
    for a, b in zip(run_reference(long, 5, regions, k, 5.0, False),
                    run_reference(grid, 0, regions, k, 5.0, False), strict=True):
        assert torch.equal(a, b)
    low = grid.bfloat16()
    got = run_reference(low, 0, regions, k, 5.0, False)
    ref = run_reference(low.float(), 0, regions, k, 5.0, False)
    assert got[2].dtype == got[3].dtype == torch.bfloat16
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert torch.equal(got[2], ref[2].bfloat16()) and torch.equal(got[3], ref[3].bfloat16())
    as_f32 = run_reference(low, 0, regions, k, 5.0, False, torch.float32)
    assert torch.equal(as_f32[2], ref[2]) and torch.equal(as_f32[3], ref[3])


@pytest.mark.parametrize("tau", [5.0, math.inf])
def test_ragged_assignment_is_the_per_region_definition(tau: float) -> None:
    """Regions keeping unequal numbers of destinations (dest_valid, sequence shards): each
    region's first count picks are its destinations, P their softmax (tau = inf: the argmax),
    each its own only source; the pad picks' rows are zero and the tokens under them take
    weights like any other. Checked against a loop over regions on the real slots only; one
    region holds fewer tokens than k, so its pad picks repeat slots."""
    sizes, counts, k, s = (6, 5, 3, 2, 6), (4, 2, 3, 1, 1), 4, 6
    valid = torch.arange(s) < torch.tensor(sizes).unsqueeze(1)                # [R, S]
    dest_valid = torch.arange(k) < torch.tensor(counts).unsqueeze(1)           # [R, k]
    x = _stream(2, len(sizes) * s, 8, seed=11).view(2, len(sizes), s, 8)
    sim = gram_similarity(x, valid)                                            # [B, R, S, S]
    picks = greedy_facility_location(sim, k, valid)                            # [B, R, k]
    got = plan_op.assignment(sim.clone(), picks, tau, valid, dest_valid)      # [B, R, k, S]
    want = torch.zeros_like(got)
    for i, r in itertools.product(range(2), range(len(sizes))):
        dests, real = picks[i, r, :counts[r]], valid[r].nonzero().flatten()   # real: 0..size-1
        scores = sim[i, r][dests][:, real]                                     # [count, S']
        if math.isinf(tau):
            weights = F.one_hot(scores.argmax(0), counts[r]).T.float()
        else:
            weights = torch.softmax(tau * scores, dim=0)
        weights[:, dests] = torch.eye(counts[r])
        want[i, r, :counts[r], real] = weights
    assert len(set(picks[0, 3].tolist())) < k                            # repeated pad picks
    assert float((got - want).abs().max()) <= 1e-6     # measured: 0 (the same float32 ops)


# ------------------------------------------------------------------------------ the custom op


def _op_args(regions: Regions, k: int, dtype: torch.dtype, center: bool) -> tuple:
    tables = regions.tables()
    stream = _stream(2, regions.tokens + 4, 8, seed=k)
    return (stream, 4, tables.slots, tables.valid, k, 5.0, center, dtype)


def test_the_operator_is_registered() -> None:
    """torch.ops.comfy_toma.plan_weights, the one plan_op calls, with the reference's schema."""
    op = torch.ops.comfy_toma.plan_weights.default
    assert plan_op.OP_NAME == "comfy_toma::plan_weights"
    assert plan_op._OP is torch.ops.comfy_toma.plan_weights
    names = [a.name for a in op._schema.arguments]
    assert names == ["stream", "offset", "slots", "valid", "k", "tau", "center", "dtype",
                     "weighted"]
    assert len(op._schema.returns) == 4
    args = _op_args(make_regions(15, 22, "tile", 16), 5, torch.float32, True)
    for a, b in zip(op(*args), plan_op.plan_weights_reference(*args), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("h", "w", "dtype", "center"), [(16, 16, torch.float32, False),
                                                         (15, 22, torch.float32, True),
                                                         (15, 22, torch.bfloat16, False)])
def test_opcheck(h: int, w: int, dtype: torch.dtype, center: bool) -> None:
    """torch.library.opcheck: schema, fake implementation (shapes, dtypes and strides of every
    output equal the real kernel's), autograd registration, AOT dispatch. Even regions pass
    valid None; the centered case is also weighted."""
    regions = make_regions(h, w, "tile", 16)
    assert regions.even == (h == 16)
    args = (*_op_args(regions, regions.min_size // 2, dtype, center), center)   # weighted
    result = torch.library.opcheck(torch.ops.comfy_toma.plan_weights.default, args)
    assert set(result.values()) == {"SUCCESS"}, result


def test_build_plan_under_fake_tensors() -> None:
    """build_plan, merge and unmerge trace on FakeTensors (no data): the fake implementation's
    shapes are the plan's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = build_plan(_stream(2, 15 * 22, 8, seed=0), 15, 22, 0.5, tile_count=16)
    with FakeTensorMode():
        x = torch.empty(2, 15 * 22, 8)
        plan = build_plan(x, 15, 22, 0.5, tile_count=16)
        merged = plan.merge(x)
        back = plan.unmerge(merged)
    for name in ("dest_slots", "dest_tokens", "merge_w", "unmerge_w"):
        fake, want = getattr(plan, name), getattr(real, name)
        assert (fake.shape, fake.dtype, fake.stride()) == (want.shape, want.dtype,
                                                           want.stride()), name
    assert merged.shape == (2, real.merged_tokens, 8) and back.shape == (2, 15 * 22, 8)


class Ops(TorchDispatchMode):
    """The ops dispatched inside the mode, by name (the op itself, not what it runs inside)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.name()))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("options", [{}, {"center": True}, {"batch": "shared"},
                                     {"unmerge": "pinv"}, {"tau": 2.0}])
def test_one_operator_per_plan(options: dict) -> None:
    """A plan build dispatches comfy_toma::plan_weights exactly once (all regions, all items,
    destinations and both weights); with the tables at hand and the defaults it is the only op."""
    regions = make_regions(15, 22, "tile", 16)
    tables = regions.tables()
    x = _stream(2, 15 * 22, 8, seed=0)
    with Ops() as ops:
        build_plan(x, 15, 22, 0.5, regions=regions, tables=tables, **options)
    assert ops.names.count("comfy_toma::plan_weights") == 1, ops.names
    if not options or options == {"center": True} or options == {"tau": 2.0}:
        assert ops.names == ["comfy_toma::plan_weights"]


# ------------------------------------------------------------------ the Triton kernel, interpreted


def _triton_or_skip() -> None:
    """Skip where Triton is not installed, unless the test command requires it
    (TOMA_REQUIRE_TRITON=1, scripts/test.sh), then fail; fail on a numpy that Triton 3.6's
    interpreter cannot run with."""
    try:
        import triton  # noqa: F401
    except ImportError:
        if os.environ.get("TOMA_REQUIRE_TRITON") == "1":
            pytest.fail("TOMA_REQUIRE_TRITON=1 but triton is not installed in this venv "
                        "(requirements-dev.txt pins it; run scripts/setup.sh)")
        pytest.skip("triton is not installed: the plan kernel is not checked here "
                    "(pip install -r requirements-dev.txt)")
    import numpy
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    major, minor = (int(v) for v in numpy.__version__.split(".")[:2])
    if (major, minor) >= (2, 3):
        pytest.fail(f"numpy {numpy.__version__}: Triton 3.6's interpreter fails on numpy >= 2.3 "
                    f"(requirements-dev.txt pins numpy < 2.3)")
    if not isinstance(standard.argmax, InterpretedFunction):
        pytest.fail("triton was imported without TRITON_INTERPRET=1 (tests/unit/conftest.py "
                    "sets it before anything imports triton), so its kernels cannot run here")


# Triton 3.6's interpreter converts one-element arrays to scalars, which numpy deprecates.
INTERPRETER_WARNING = "ignore:Conversion of an array with ndim > 0:DeprecationWarning"


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> Iterator:
    """triton_plan with its kernel defined afresh under TRITON_INTERPRET=1 (it runs on CPU
    tensors); the module's kernel cache and disabled flag are put back afterwards."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _triton_or_skip()
    saved = list(triton_plan._KERNEL), list(triton_plan._disabled)
    triton_plan._KERNEL.clear()
    triton_plan._disabled.clear()
    try:
        yield triton_plan
    finally:
        triton_plan._KERNEL[:], triton_plan._disabled[:] = saved


# (h, w, tile_count, t, frames, channels, k as a fraction of the smallest region, center, dtype,
# tau): even regions (S = 16), ragged ones (S = 20, padded to 32 in the kernel), ragged video
# boxes (S = 60); channel counts that are not a multiple of the kernel's channel block.
KERNEL_CASES = [
    (8, 8, 4, 1, 1, 40, 0.25, False, torch.float32, 5.0),
    (8, 8, 4, 1, 1, 40, 0.5, True, torch.bfloat16, 5.0),
    (7, 9, 4, 1, 1, 40, 0.5, False, torch.float32, 1000.0),
    (7, 9, 4, 1, 1, 40, 0.25, True, torch.float32, 5.0),
    (7, 9, 4, 1, 1, 24, 0.5, True, torch.bfloat16, 2.0),
    (5, 7, 2, 5, 2, 33, 0.5, True, torch.float32, 5.0),
    (5, 7, 2, 5, 2, 33, 0.25, False, torch.bfloat16, 5.0),
]


@pytest.mark.filterwarnings(INTERPRETER_WARNING)
@pytest.mark.parametrize(("h", "w", "tiles", "t", "frames", "c", "kfrac", "center", "dtype",
                          "tau"), KERNEL_CASES)
def test_kernel_matches_the_reference(kernel, h: int, w: int, tiles: int, t: int, frames: int,
                                      c: int, kfrac: float, center: bool, dtype: torch.dtype,
                                      tau: float) -> None:
    """The Triton kernel (interpreted) against plan_weights_reference on a stream with a
    prefix, a suffix and (in the float32 cases) non-contiguous channels: the same picks where
    no near-tie can swap them, the same coverage up to a swapped pick, the same weights where
    the picks agree, destinations the grid tokens of its picks, pad slots weightless."""
    regions = _regions(h, w, tiles, t, frames)
    k, b, offset = max(1, int(regions.min_size * kfrac)), 2, 3
    stream = _stream(b, offset + regions.tokens + 2, c, seed=h * w * t + c, dtype=dtype,
                     channel_stride=dtype == torch.float32)
    tables = regions.tables()
    assert kernel.applies(regions.size, k, tau)
    got = kernel.plan_weights(stream, offset, tables.slots, tables.valid, k, tau, center, dtype)
    ref = plan_op.plan_weights_reference(stream, offset, tables.slots, tables.valid, k, tau,
                                         center, dtype)
    for a, want in zip(got, ref, strict=True):
        assert (a.shape, a.dtype, a.stride()) == (want.shape, want.dtype, want.stride())
    picks, dest, merge_w, unmerge_w = got
    r, s = regions.count, regions.size
    want = direct(stream, offset, regions, k, tau, center)
    lead = torch.arange(k) < want["settled"].unsqueeze(-1)
    assert torch.equal(picks[lead], want["picks"][lead])
    shifted = shifted_similarity(stream, offset, regions, center)
    split = (picks != ref[0]).int().argmax(-1, keepdim=True)
    upto = torch.arange(k) <= split
    got_f = coverage(shifted, torch.where(upto, picks, picks[..., :1]))
    ref_f = coverage(shifted, torch.where(upto, ref[0], ref[0][..., :1]))
    assert float(((got_f - ref_f) / ref_f).abs().max()) <= F_TOL
    got_f, ref_f = coverage(shifted, picks), coverage(shifted, ref[0])
    assert float(((got_f - ref_f) / ref_f).abs().max()) <= F_END_TOL
    same = (picks == ref[0]).all(-1).view(-1)                          # [B*R]
    assert bool(same.any()), "no region to compare the weights on"
    tol = KERNEL_TOL if dtype == torch.float32 else BF16_TOL
    assert float((merge_w.float() - ref[2].float())[same].abs().max()) <= tol
    assert float((unmerge_w.float() - ref[3].float())[same].abs().max()) <= tol
    slots, valid = tables.slots, valid_slots(regions)
    assert torch.equal(dest, slots.expand(b, r, s).gather(-1, picks).view(b, r * k))
    assert bool(valid.expand(b, r, s).gather(-1, picks).all())
    assert all(len(set(row)) == k for row in picks.reshape(-1, k).tolist())
    assert not (merge_w.view(b, r, k, s) * ~valid[None, :, None, :]).any()
    assert not (unmerge_w.view(b, r, s, k) * ~valid[None, :, :, None]).any()


@pytest.mark.filterwarnings(INTERPRETER_WARNING)
@pytest.mark.parametrize(("h", "w", "tiles", "center", "dtype"),
                         [(8, 8, 4, False, torch.float32), (7, 9, 4, True, torch.bfloat16)])
def test_kernel_weighted_matches_the_reference(kernel, h: int, w: int, tiles: int, center: bool,
                                               dtype: torch.dtype) -> None:
    """weighted (coverage counted by squared norm) on tokens of norms from 0.1 to 10: the
    kernel's picks and weights are the reference's, and the picks differ from the unweighted
    ones (the weights reach the greedy)."""
    regions = make_regions(h, w, "tile", tiles)
    k, tables = regions.min_size // 2, regions.tables()
    stream = _stream(2, regions.tokens, 40, seed=h * w, dtype=dtype)
    scale = torch.logspace(-1, 1, regions.tokens)[torch.randperm(
        regions.tokens, generator=torch.Generator().manual_seed(1))]
    stream = (stream.float() * scale[:, None]).to(dtype)
    args = (stream, 0, tables.slots, tables.valid, k, 5.0, center, dtype)
    got = kernel.plan_weights(*args, weighted=True)
    ref = plan_op.plan_weights_reference(*args, weighted=True)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    tol = KERNEL_TOL if dtype == torch.float32 else BF16_TOL
    assert float((got[2].float() - ref[2].float()).abs().max()) <= tol
    assert float((got[3].float() - ref[3].float()).abs().max()) <= tol
    assert not torch.equal(ref[0], plan_op.plan_weights_reference(*args)[0])


@pytest.mark.filterwarnings(INTERPRETER_WARNING)
def test_kernel_ties_and_pads(kernel) -> None:
    """Identical tokens in ragged regions: the kernel too picks the lowest real slots in order
    and gives the reference's weights."""
    regions = make_regions(7, 9, "tile", 4)
    tables, k = regions.tables(), regions.min_size
    stream = torch.ones(1, regions.tokens, 8)
    got = kernel.plan_weights(stream, 0, tables.slots, tables.valid, k, 5.0, False,
                              torch.float32)
    ref = plan_op.plan_weights_reference(stream, 0, tables.slots, tables.valid, k, 5.0, False,
                                         torch.float32)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert float((got[2] - ref[2]).abs().max()) <= KERNEL_TOL
    assert float((got[3] - ref[3]).abs().max()) <= KERNEL_TOL


@pytest.mark.filterwarnings(INTERPRETER_WARNING)
def test_kernel_applies_only_where_it_can(kernel) -> None:
    """Regions up to MAX_SLOTS slots, 1 <= k <= S, finite tau; the rest stays on the reference
    ops."""
    assert kernel.applies(64, 32, 1000.0)
    assert kernel.applies(kernel.MAX_SLOTS, 1, 1.0)
    assert not kernel.applies(kernel.MAX_SLOTS + 1, 32, 1000.0)
    assert not kernel.applies(64, 65, 1000.0) and not kernel.applies(64, 0, 1000.0)
    assert not kernel.applies(64, 32, math.inf)
