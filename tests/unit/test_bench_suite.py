"""The benchmark suite's own pieces on tiny shapes, each checked against an independent
computation: variants against the block called by hand, errors against their formulas, timing
against a fake clock, reports and targets against hand-made results."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import bench.__main__ as suite
from bench.shared import common
from bench.shared.common import Timing, interleaved, speedup, versus_lower_bound
from bench.shared.config import ROOT, default_config
from bench.shared.photos import photo_tokens
from bench.shared.weights import fill_weights
from bench.speed import dit_families, kernels, unet_blocks
from bench.speed.baselines import ToMeSD, tomesd_matching
from bench.speed.fidelity import pareto
from bench.speed.reference_blocks import Level
from bench.speed.unet_blocks import UNPATCHED, LevelBench, Variant, merged_count, output_errors
from toma_pack.toma_core import build_plan

TINY = Level(8, 64, 2)          # 8 x 8 tokens, 64 channels, 1 head


@pytest.fixture(scope="module")
def bench() -> LevelBench:
    return LevelBench(TINY, default_config(quick=True, comfy=False, device="cpu"))


def _run(bench: LevelBench, v: Variant, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    prepared = bench.prepare(v, x)
    with torch.inference_mode():
        return prepared.call(), prepared.tokens


def _block(bench: LevelBench, x: torch.Tensor, options: dict | None = None) -> torch.Tensor:
    """The tiny block called by hand, the way a UNet calls it."""
    with torch.inference_mode():
        return bench.block(x, context=bench.context,
                           transformer_options=options if options is not None else bench.options)


# ---------------------------------------------------------------------------------- inputs


def test_photo_tokens_are_layer_normed_grids() -> None:
    x = photo_tokens("astronaut", 8, 64)
    assert x.shape == (1, 64, 64)
    # layer-normed over channels: per token, measured |mean| <= 5.6e-8 and |variance - 1| <=
    # 3.0e-5 (layer_norm's eps)
    torch.testing.assert_close(x.mean(-1), torch.zeros(1, 64), atol=2.5e-7, rtol=0)
    torch.testing.assert_close(x.var(-1, unbiased=False), torch.ones(1, 64), atol=1.2e-4, rtol=0)
    # a photograph, not noise: neighbouring tokens are more alike than distant ones (measured
    # mean cosine 0.235 between horizontal neighbours, -0.258 between tokens 4 rows apart)
    grid = F.normalize(x[0], dim=-1).view(8, 8, 64)
    near = float((grid[:, :-1] * grid[:, 1:]).sum(-1).mean())
    far = float((grid[:-4] * grid[4:]).sum(-1).mean())
    assert near - far > 0.4


# -------------------------------------------------------------------- variants, by hand


def test_unpatched_is_the_block(bench: LevelBench) -> None:
    x = bench.tokens_of("coffee")
    y, tokens = _run(bench, UNPATCHED, x)
    assert tokens == TINY.tokens and torch.equal(y, _block(bench, x))


def test_lower_bound_runs_the_block_on_the_merged_count(bench: LevelBench) -> None:
    """Block scope: the block on the first N' tokens (N' = ToMA's merged count); attention
    scope: self-attention on N' tokens, its output thrown away."""
    x = bench.tokens_of("coffee")
    n = merged_count(TINY, 0.5)
    assert n == build_plan(x, 8, 8, 0.5, tile_count=unet_blocks.DEFAULT_TILES).merged_tokens
    y, tokens = _run(bench, Variant("lower bound", "block", 0.5), x)
    assert tokens == n and torch.equal(y, _block(bench, x[:, :n].contiguous()))
    y, tokens = _run(bench, Variant("lower bound", "attention", 0.5), x)
    assert tokens == n and y.shape == x.shape


@pytest.mark.parametrize("tiles", [4, 16])
def test_toma_block_variant_is_plan_around_the_block(bench: LevelBench, tiles: int) -> None:
    """What the bench times is the node's block scope: plan from norm1(x), the block run on
    merged tokens, only its update unmerged; bit-identical to doing it by hand."""
    x = bench.tokens_of("chelsea")
    y, tokens = _run(bench, Variant("toma", "block", 0.5, tiles), x)
    with torch.inference_mode():
        plan = build_plan(bench.block.norm1(x), 8, 8, 0.5, tile_count=tiles)
        ref = plan.around(lambda t: _block(bench, t), x, block_keeps_input=True)
    assert tokens == plan.merged_tokens == 32
    assert torch.equal(y, ref)


def test_toma_attention_variant_merges_self_attention_only(bench: LevelBench) -> None:
    """Attention scope: self-attention on merged queries/keys/values, unmerged before the
    residual; the rest of the block at full length. Checked against a hand-written forward."""
    x = bench.tokens_of("chelsea")
    y, _ = _run(bench, Variant("toma", "attention", 0.5, 4), x)
    b = bench.block
    with torch.inference_mode():
        n = b.norm1(x)
        plan = build_plan(n, 8, 8, 0.5, tile_count=4)
        m = plan.merge(n)
        h = plan.unmerge(b.attn1(m, m, m)) + x
        h = b.attn2(b.norm2(h), bench.context) + h
        ref = b.ff(b.norm3(h)) + h
    # measured: bit-identical on torch 2.13 CPU
    assert torch.equal(y, ref)


def test_tomesd_variant_is_tomesds_own_merge(bench: LevelBench) -> None:
    pytest.importorskip("tomesd")
    x = bench.tokens_of("rocket")
    y, tokens = _run(bench, Variant("tomesd", "block", 0.5), x)
    generator = torch.Generator().manual_seed(bench.cfg.seed)
    merge, unmerge = tomesd_matching()(x, 8, 8, 2, 2, 32, no_rand=False, generator=generator)
    with torch.inference_mode():
        merged = merge(x)
        ref = x + unmerge(_block(bench, merged) - merged)
    assert tokens == ToMeSD(8, 8, 0.5, torch.Generator()).merged_tokens() == 32
    assert torch.equal(y, ref)
    y, _ = _run(bench, Variant("tomesd", "attention", 0.5), x)
    assert y.shape == x.shape


def test_todo_variant_pools_keys_and_values(bench: LevelBench) -> None:
    x = bench.tokens_of("coffee")
    y, tokens = _run(bench, Variant("todo", "attention", 0.75), x)
    b = bench.block
    with torch.inference_mode():
        n = b.norm1(x)
        pooled = F.avg_pool2d(n.transpose(1, 2).reshape(1, 64, 8, 8), 2).flatten(2).transpose(1, 2)
        h = b.attn1(n, pooled, pooled) + x
        h = b.attn2(b.norm2(h), bench.context) + h
        ref = b.ff(b.norm3(h)) + h
    assert tokens == 16 and torch.equal(y, ref)


def test_toma_error_on_the_tiny_block(bench: LevelBench) -> None:
    """A regression in destination selection or weights moves this: ToMA block scope at 0.5,
    4 tiles of 16 tokens, on a photograph (measured err 0.4105, cos 0.9151), within 10%."""
    x = bench.tokens_of("chelsea")
    ref, _ = _run(bench, UNPATCHED, x)
    y, _ = _run(bench, Variant("toma", "block", 0.5, 4), x)
    errs = output_errors(y, ref, x)
    assert 0.4105 / 1.1 < errs["err"] < 0.4105 * 1.1
    assert errs["cos"] > 1 - (1 - 0.9151) * 1.1


def test_output_errors_follow_their_formulas() -> None:
    g = torch.Generator().manual_seed(0)
    x, ref, delta = (torch.randn(2, 16, 8, generator=g) for _ in range(3))
    y = ref + 0.1 * delta
    errs = output_errors(y, ref, x)
    assert errs["err"] == pytest.approx(float((0.1 * delta).norm() / ref.norm()), rel=1e-6)
    assert errs["err_update"] == pytest.approx(float((0.1 * delta).norm() / (ref - x).norm()),
                                               rel=1e-6)
    cos = F.cosine_similarity(y.double(), ref.double(), dim=-1).mean()
    assert errs["cos"] == pytest.approx(float(cos), rel=1e-6)


def test_pareto_marks_only_unbeaten_points() -> None:
    unet = [{"level": "L", "method": m, "scope": "block", "ratio": 0.5, "tiles": None,
             "speedup": s} for m, s in (("toma", 2.0), ("tomesd", 1.5), ("todo", 1.8))]
    fid = [{"level": "L", "method": m, "scope": "block", "ratio": 0.5, "tiles": None,
            "err": e, "cos": 0.9} for m, e in (("toma", 0.2), ("tomesd", 0.3), ("todo", 0.1))]
    marks = {p["method"]: p["pareto"] for p in pareto(unet, fid)}
    assert marks == {"toma": True, "tomesd": False, "todo": True, "unpatched": True}


# ---------------------------------------------------------------------------------- timing


class FakeClock:
    """Stands in for common.now: records the clock asked for, advances 1 s per reading."""

    def __init__(self) -> None:
        self.clocks: list[str] = []
        self.t = 0.0

    def __call__(self, clock: str) -> float:
        self.clocks.append(clock)
        self.t += 1.0
        return self.t


def test_timing_statistics() -> None:
    t = Timing((0.3, 0.1, 0.2, 0.5))
    assert (t.min, t.median) == (0.1, 0.25)
    assert t.spread == pytest.approx((0.5 - 0.1) / 0.25)
    assert t.fields() == {"ms": 250.0, "ms_min": 100.0, "spread": pytest.approx(1.6), "reps": 4}
    s = speedup(Timing((2.0, 4.0, 3.0)), Timing((1.0, 1.0, 2.0)))
    assert s == {"speedup": 3.0 / 1.0, "speedup_lo": 1.5, "speedup_hi": 4.0}


def test_interleaved_needs_a_spread_and_reverses_order() -> None:
    order: list[str] = []
    calls = {name: (lambda n=name: order.append(n)) for name in "abc"}
    with pytest.raises(ValueError, match="spread"):
        interleaved(calls, warmup=0, reps=2)
    found = interleaved(calls, warmup=1, reps=3)
    assert order == list("abc") + list("abc") + list("cba") + list("abc")
    assert all(len(t.times) == 3 for t in found.values())


def test_interleaved_cpu_clock_ignores_sleeping() -> None:
    """The cpu clock is process CPU time: a call that sleeps costs (almost) nothing on it."""
    import time

    found = interleaved({"sleep": lambda: time.sleep(0.02)}, warmup=0, reps=3, clock="cpu")
    assert found["sleep"].median < 0.005                  # measured ~1e-5 s
    found = interleaved({"sleep": lambda: time.sleep(0.02)}, warmup=0, reps=3, clock="wall")
    assert found["sleep"].median >= 0.02


def test_kernels_section_honours_clock_and_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """--clock and --threads reach the kernel timings (60907d1: the kernels section was timed
    on the wall clock whatever --clock said)."""
    clock = FakeClock()
    monkeypatch.setattr(common, "now", clock)
    monkeypatch.setattr(kernels, "GRIDS", ((8, 64),))
    monkeypatch.setattr(kernels, "RATIOS", (0.5,))
    threads = torch.get_num_threads()
    try:
        cfg = default_config(quick=True, comfy=False, device="cpu", clock="cpu", threads=1)
        sections = suite.run_sections(["kernels"], cfg)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    assert clock.clocks and set(clock.clocks) == {"cpu"}
    row = sections["kernels"]["rows"][0]
    assert row["N"] == 64 and row["toma_mu_ms"] == pytest.approx(1e3)   # one fake second
    assert "AMD" in sections["kernels"]["measured_on"] or common.cpu_model() in \
        sections["kernels"]["measured_on"]


def test_unet_rows_carry_spread_range_and_flags(monkeypatch: pytest.MonkeyPatch,
                                               bench: LevelBench) -> None:
    """Every unet row has its spread and speedup range, on the configured clock; a ToMA row
    faster than its own lower bound is flagged."""
    clock = FakeClock()
    monkeypatch.setattr(common, "now", clock)
    cfg = default_config(quick=True, comfy=False, device="cpu", clock="cpu")
    rows = unet_blocks.bench_level(TINY, cfg, [UNPATCHED, Variant("toma", "block", 0.5, 64),
                                                Variant("lower bound", "block", 0.5)])
    assert set(clock.clocks) == {"cpu"}
    toma = next(r for r in rows if r["method"] == "toma" and "speedup" in r)
    assert toma["reps"] == cfg.reps and toma["spread"] == 0.0        # fake clock: 1 s each
    assert toma["speedup_lo"] <= toma["speedup"] <= toma["speedup_hi"]
    # the fake clock gives every variant 1 s, plus the plan share: ToMA above its bound
    assert toma["vs_lb"] > 1 and "flag" not in toma


def test_versus_lower_bound_pairs_repetitions_and_flags() -> None:
    """vs_lb is the median of the side-by-side ratios; below 1 the row is flagged."""
    bound = Timing((0.010, 0.020, 0.012))
    row: dict = {}
    versus_lower_bound(row, Timing((0.009, 0.019, 0.0132)), bound)
    assert row["lb_ms"] == pytest.approx(12.0)
    assert row["vs_lb"] == pytest.approx(0.95) and "lower bound" in row["flag"]
    row = {}
    versus_lower_bound(row, Timing((0.0105, 0.021, 0.0126)), bound)
    assert row["vs_lb"] == pytest.approx(1.05) and "flag" not in row


# ------------------------------------------------------------ DiT families (no ComfyUI)


def _tiny_dit_case() -> dit_families.BlockCase:
    """A residual linear "block" on 16 image tokens (grid 1 x 4 x 4), depth 10."""
    block = fill_weights(torch.nn.Linear(8, 8), seed=2)
    x = torch.randn(1, 16, 8, generator=torch.Generator().manual_seed(1))

    def args(keep: int | None = None) -> dict:
        return {"img": x[:, :keep or 16].clone()}

    def original(a: dict) -> dict:
        return {"img": a["img"] + block(a["img"])}

    return dit_families.BlockCase("wan14b", block, (1, 4, 4), 0, 10, args, original,
                                  lambda out: out["img"])


class _PairMerge:
    """Stands in for the hook's merged block: token pairs averaged, the block's update of each
    pair copied back to both."""

    merged_tokens = 8

    def __init__(self, case: dit_families.BlockCase) -> None:
        self.case, self.builds = case, 0

    def __call__(self, a: dict) -> dict:
        x = a["img"]
        pairs = x.reshape(1, 8, 2, 8).mean(2)
        update = self.case.original_block({"img": pairs})["img"] - pairs
        return {"img": x + update.repeat_interleave(2, dim=1)}

    def build_plan(self) -> None:
        self.builds += 1


def test_dit_rows_time_every_variant_and_measure_the_update_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """plain / lower bound (on ToMA's merged count) / toma, each with its spread and range on
    the given clock; err_update against the update computed here; the plan build timed."""
    clock = FakeClock()
    monkeypatch.setattr(common, "now", clock)
    case = _tiny_dit_case()
    merged = _PairMerge(case)
    with torch.inference_mode():
        rows, found = dit_families.bench_case(case, 0.5, 3, "cpu", merged)
    assert set(clock.clocks) == {"cpu"} and merged.builds == 3
    assert [r["variant"] for r in rows] == ["plain", "lower bound", "toma"]
    assert [r["image_tokens"] for r in rows] == [16, 8, 8]
    assert all(r["reps"] == 3 and r["spread"] == 0.0 and "note" not in r for r in rows)
    assert all(len(t.times) == 3 for t in found.values())
    toma = rows[2]
    # fake clock: 1 s per call, so ToMA equals its bound (not below it: no flag)
    assert toma["vs_lb"] == 1.0 and "flag" not in toma and toma["plan_ms"] == 1e3
    x = case.args()["img"]
    with torch.no_grad():
        plain = case.original_block(case.args())["img"] - x
        update = merged(case.args())["img"] - x
    assert toma["err_update"] == pytest.approx(float((update - plain).norm() / plain.norm()),
                                               rel=1e-6)
    assert toma["err_update"] > 0.01            # the pair merge really changes the update
    with torch.inference_mode():
        few, _ = dit_families.bench_case(case, 0.5, 2, "cpu", merged)
    assert all("fewer than 3" in r["note"] for r in few)


def test_dit_toma_row_off_its_ratio_is_flagged(monkeypatch: pytest.MonkeyPatch) -> None:
    """A merged count far from (1 - ratio) x tokens (a thin last frame slab once kept 41% at
    ratio 0.5) makes the row's speedup one of another ratio: flagged, not a result."""
    monkeypatch.setattr(common, "now", FakeClock())
    case = _tiny_dit_case()
    merged = _PairMerge(case)                              # 16 -> 8 tokens
    with torch.inference_mode():
        at_half, _ = dit_families.bench_case(case, 0.5, 3, "cpu", merged)
        at_quarter, _ = dit_families.bench_case(case, 0.25, 3, "cpu", merged)
    assert "flag" not in at_half[2]
    assert "asks for 12" in at_quarter[2]["flag"] and "-33.3%" in at_quarter[2]["flag"]
    merged.merged_tokens = 6                               # says 6 where 0.5 asks for 8
    with torch.inference_mode():
        rows, found = dit_families.bench_case(case, 0.5, 3, "cpu", merged)
    model = dit_families.project(rows, found, depth=10, skip=2)
    assert "asks for 8" in rows[2]["flag"]
    assert model["flag"] == rows[2]["flag"]               # the model is made of that block
    judged = dit_families.targets([rows[2], model], 0.5)
    assert len(judged) == 2 and all(t["met"] is None for t in judged)   # neither met nor missed
    assert dit_families.off_ratio(13440, 27280, 0.5) is None     # 49.3%: the slab fix
    assert dit_families.off_ratio(11200, 27280, 0.5)              # 41%: before it


def test_dit_projection_per_repetition_with_skips_and_plan() -> None:
    """blocks-only model: skip plain blocks + the rest merged + one plan build, per repetition,
    against the same projection of the lower bound."""
    found = {"plain": Timing((10.0, 12.0, 11.0)), "toma": Timing((5.0, 6.5, 5.5)),
             "lower bound": Timing((4.5, 6.0, 5.0))}
    rows = [{"family": "wan14b", "variant": "toma", "ratio": 0.5, "plan_ms": 100.0}]
    row = dit_families.project(rows, found, depth=10, skip=2)
    p, t, b = (found[k].times for k in ("plain", "toma", "lower bound"))
    plain = [10 * p[i] for i in range(3)]
    toma = [2 * p[i] + 8 * t[i] + 0.1 for i in range(3)]
    bound = [2 * p[i] + 8 * b[i] for i in range(3)]
    assert row["ms"] == pytest.approx(1e3 * sorted(toma)[1])
    assert row["speedup"] == pytest.approx(sorted(plain)[1] / sorted(toma)[1])
    pairs = [plain[i] / toma[i] for i in range(3)]
    assert (row["speedup_lo"], row["speedup_hi"]) == (pytest.approx(min(pairs)),
                                                      pytest.approx(max(pairs)))
    assert row["vs_lb"] == pytest.approx(sorted(toma[i] / bound[i] for i in range(3))[1])
    assert row["lb_speedup"] == pytest.approx(sorted(plain)[1] / sorted(bound)[1])
    assert dit_families.project(rows[:0], found, 10, 2) is None


def test_dit_projection_of_two_block_kinds_adds_them_per_repetition() -> None:
    """HiDream / HunyuanImage: each kind's skip plain + rest merged + its own plan build, the
    kinds added per repetition, against the same sum of the lower bounds."""
    double = {"plain": Timing((10.0, 12.0, 11.0)), "toma": Timing((5.0, 6.5, 5.5)),
              "lower bound": Timing((4.5, 6.0, 5.0))}
    single = {"plain": Timing((8.0, 9.0, 8.5)), "toma": Timing((4.0, 4.4, 4.2)),
              "lower bound": Timing((3.9, 4.3, 4.1))}
    rows_d = [{"family": "hidream double", "variant": "toma", "ratio": 0.5, "plan_ms": 100.0}]
    rows_s = [{"family": "hidream single", "variant": "toma", "ratio": 0.5, "plan_ms": 50.0}]
    row = dit_families.project_parts([dit_families.Part(rows_d, double, 16, 5),
                                      dit_families.Part(rows_s, single, 32, 5)], "hidream")
    toma = [5 * double["plain"].times[i] + 11 * double["toma"].times[i] + 0.1
            + 5 * single["plain"].times[i] + 27 * single["toma"].times[i] + 0.05
            for i in range(3)]
    assert row["family"] == "hidream"
    assert row["variant"] == "projected model: 16 double + 32 single blocks, 5 + 5 unmerged"
    assert row["ms"] == pytest.approx(1e3 * sorted(toma)[1])
    assert dit_families.project_parts([dit_families.Part(rows_d[:0], double, 16, 5)]) is None
    assert dit_families.default_skipped(32, "s") == 5


def test_dit_full_length_blocks_are_timed_beside_the_block_and_never_merged(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Wan Animate: the face adapter blocks (here "face", 2 of them) run in the same rounds as
    the block, get rows of their own and a Part whose every block stays unmerged; the
    protected leading frame counts in the lower bound's tokens and in the ratio check."""
    monkeypatch.setattr(common, "now", FakeClock())
    calls = []
    base = _tiny_dit_case()
    case = dit_families.BlockCase(
        base.family, base.block, (2, 2, 4), 0, 10, base.args, base.original_block,
        base.image_out, protect_frames=1,
        full_length=(dit_families.FullLengthBlock("face", 2, lambda: calls.append(1)),))
    assert case.protected_tokens == 8

    class Hook(_PairMerge):
        merged_tokens = 12              # the 8 protected tokens and 8 merged to 4

    parts = dit_families.bench_kind(case, 0.5, 3, "cpu", lambda f, c, r: Hook(c))
    assert len(calls) == 1 + 3                                  # warm-up and every round
    main, face = parts
    assert [r["variant"] for r in main.rows] == ["plain", "lower bound", "toma"]
    assert main.rows[1]["image_tokens"] == 12 and "flag" not in main.rows[2]
    assert (face.depth, face.skip, face.unmerged) == (2, 2, True)
    assert face.rows[0]["family"] == "wan14b face" and "never merged" in face.rows[0]["note"]
    assert dit_families.off_ratio(12, 16, 0.5, protected=8) is None
    assert "asks for 12" in dit_families.off_ratio(8, 16, 0.5, protected=8)


def test_dit_projection_adds_unmerged_parts_to_every_variant() -> None:
    """A part that never merges adds its plain time to the plain, merged and lower-bound
    models alike and needs no toma row; one that merges still does."""
    found = {"plain": Timing((10.0, 12.0, 11.0)), "toma": Timing((5.0, 6.5, 5.5)),
             "lower bound": Timing((4.5, 6.0, 5.0))}
    face = {"plain": Timing((1.0, 1.5, 1.2))}
    rows = [{"family": "wan_animate14b", "variant": "toma", "ratio": 0.5, "plan_ms": 100.0}]
    face_rows = [{"family": "wan_animate14b face", "variant": "face block"}]
    row = dit_families.project_parts([dit_families.Part(rows, found, 40, 5),
                                      dit_families.Part(face_rows, face, 8, 8)],
                                     "wan_animate14b")
    p, t, b, f = (x.times for x in (found["plain"], found["toma"], found["lower bound"],
                                    face["plain"]))
    plain = [40 * p[i] + 8 * f[i] for i in range(3)]
    toma = [5 * p[i] + 35 * t[i] + 0.1 + 8 * f[i] for i in range(3)]
    bound = [5 * p[i] + 35 * b[i] + 8 * f[i] for i in range(3)]
    assert row["variant"] == "projected model: 40 main + 8 face blocks, 5 + 8 unmerged"
    assert row["speedup"] == pytest.approx(sorted(plain)[1] / sorted(toma)[1])
    assert row["lb_speedup"] == pytest.approx(sorted(plain)[1] / sorted(bound)[1])
    assert dit_families.project_parts([dit_families.Part(face_rows, face, 8, 8)]) is None
    assert dit_families.project_parts([dit_families.Part(rows, found, 40, 5),
                                       dit_families.Part(face_rows, face, 8, 7)]) is None


def test_vace_projection_costs_vace_blocks_as_plain_main_blocks() -> None:
    """Wan VACE 14B from a Wan 14B result: 40 main blocks (5 plain, 35 merged, one plan) and 8
    VACE blocks plain, against 48 plain blocks; the option with VACE blocks merged leaves the
    one after main block 0 plain and builds a second plan."""
    from bench.speed import vace_projection

    source = {"rows": [
        {"family": "wan14b", "variant": "plain", "ratio": None, "ms": 10_000.0},
        {"family": "wan14b", "variant": "lower bound", "ratio": 0.5, "ms": 3_500.0},
        {"family": "wan14b", "variant": "toma", "ratio": 0.5, "ms": 4_000.0, "plan_ms": 100.0},
        {"family": "sd35_large", "variant": "plain", "ratio": None, "ms": 1.0}]}
    built, option = vace_projection.vace_rows(source, 8)
    assert built["speedup"] == pytest.approx(48 * 10 / (5 * 10 + 35 * 4 + 0.1 + 8 * 10))
    assert built["lb_speedup"] == pytest.approx(48 * 10 / (5 * 10 + 35 * 3.5 + 8 * 10))
    assert built["variant"] == "projected model: 40 main + 8 VACE blocks, 5 + 8 unmerged"
    assert option["speedup"] == pytest.approx(48 * 10 / (6 * 10 + 42 * 4 + 0.2))
    with pytest.raises(SystemExit, match="no toma"):
        vace_projection.vace_rows({"rows": source["rows"][:2]}, 8)


def test_dit_projection_skips_what_the_node_skips() -> None:
    from toma_pack.nodes.options import make_options

    skipped = make_options().skip_blocks.for_kinds([("", 40)])[0]
    assert dit_families.default_skipped(40) == len(skipped) == 5      # "d0-4, s0-4": 0-4


def test_dit_baseline_is_timed_beside_toma_and_projected_with_its_own_plan(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """--baseline-hook: a "toma baseline" row after the toma row, in the same interleaved
    repetitions, its plan timed; over_base = the baseline's time / toma's, per repetition and
    for the projected model (each with its own plan build); no target for the baseline."""
    monkeypatch.setattr(common, "now", FakeClock())
    case = _tiny_dit_case()
    merged, baseline = _PairMerge(case), _PairMerge(case)
    with torch.inference_mode():
        rows, found = dit_families.bench_case(case, 0.5, 3, "cpu", merged, baseline)
    assert [r["variant"] for r in rows] == ["plain", "lower bound", "toma", "toma baseline"]
    assert baseline.builds == 3 and len(found["toma baseline"].times) == 3
    assert rows[3]["err_update"] == rows[2]["err_update"] and rows[3]["plan_ms"] == 1e3
    # fake clock: 1 s per call for both
    assert (rows[2]["over_base"], rows[2]["over_base_lo"], rows[2]["over_base_hi"]) == (1, 1, 1)
    assert "over_base" not in rows[3]
    found = {"plain": Timing((10.0, 10.0, 10.0)), "lower bound": Timing((5.0, 5.0, 5.0)),
             "toma": Timing((6.0, 6.0, 6.0)), "toma baseline": Timing((7.0, 6.0, 8.0))}
    rows = [{"family": "wan14b", "variant": "toma", "ratio": 0.5, "plan_ms": 1e3},
            {"family": "wan14b", "variant": "toma baseline", "ratio": 0.5, "plan_ms": 2e3}]
    parts = [dit_families.Part(rows, found, 10, 2)]
    toma = dit_families.project_parts(parts, against="toma baseline")
    base = dit_families.project_parts(parts, variant="toma baseline")
    # 2 x 10 + 8 x merged + plan: toma 69 s; baseline 78, 70, 86 s
    assert toma["ms"] == 69e3 and base["ms"] == 78e3
    assert base["variant"] == "projected model, toma baseline: 10 blocks, 2 unmerged"
    assert toma["over_base"] == pytest.approx(78 / 69)
    assert (toma["over_base_lo"], toma["over_base_hi"]) == (pytest.approx(70 / 69),
                                                            pytest.approx(86 / 69))
    judged = dit_families.targets([toma, base], 0.5)
    assert [t["value"] for t in judged] == [toma["speedup"]]     # the baseline is no result


def test_dit_targets_say_what_was_missed() -> None:
    rows = [{"family": "wan14b", "variant": "toma", "ratio": 0.5, "vs_lb": 1.2},
            {"family": "wan14b", "variant": "projected model: 40 blocks, 5 unmerged",
             "ratio": 0.5, "speedup": 1.7},
            {"family": "qwen_image", "variant": "toma", "ratio": 0.5, "vs_lb": 1.05},
            {"family": "qwen_image", "variant": "projected model: 60 blocks, 5 unmerged",
             "ratio": 0.5, "speedup": 1.7}]
    found = {t["target"]: t for t in dit_families.targets(rows, 0.5)}
    assert len(found) == 3                       # no video target for an image family
    bound = found["wan14b: ToMA block within 10% of its lower bound (vs_lb <= 1.10)"]
    assert bound["met"] is False and bound["why"] == "missed: 1.2 against <= 1.1 (9.1% over)"
    video = found["wan14b: projected whole-model speedup >= 2.2 (video, CPU)"]
    assert video["met"] is False and video["why"] == "missed: 1.7 against >= 2.2 (22.7% short)"
    assert found["qwen_image: ToMA block within 10% of its lower bound (vs_lb <= 1.10)"]["met"]
    assert dit_families.targets(rows, 0.75) == []    # the targets are set at ratio 0.5


# -------------------------------------------------------------------- report and targets


def _result(sections: dict) -> dict:
    return {"machine": {"cpu": "Test CPU 9000"}, "sections": sections,
            "config": {"device": "cpu", "dtype": "float32", "quick": False, "commit": "abc"},
            "targets": suite.targets(sections), "flags": suite.flags(sections),
            "recommendations": suite.recommendations(sections)}


def _unet_row(level: str, **fields) -> dict:
    return {"level": level, "method": "toma", "scope": "block", "ratio": 0.5, "tiles": 64,
            **fields}


def test_missed_targets_say_by_how_much() -> None:
    """60907d1 printed a bare False."""
    sections = {"unet": {"rows": [_unet_row("64x64x640", speedup=1.9, vs_lb=1.05),
                                  _unet_row("32x32x1280", speedup=1.8, vs_lb=1.2)]}}
    found = {t["target"]: t for t in suite.targets(sections)}
    speed = found["64x64x640 ToMA block 0.5 speedup >= 2.0"]
    assert speed["met"] is False and speed["why"] == "missed: 1.9 against >= 2 (5.0% short)"
    bound = found["32x32x1280 within 10% of its lower bound (vs_lb <= 1.10)"]
    assert bound["met"] is False and bound["why"] == "missed: 1.2 against <= 1.1 (9.1% over)"
    assert found["32x32x1280 ToMA block 0.5 speedup >= 1.7"]["met"] is True
    assert "why" not in found["32x32x1280 ToMA block 0.5 speedup >= 1.7"]


def test_flagged_rows_are_not_judged_and_are_reported() -> None:
    row = _unet_row("64x64x640", speedup=2.5)
    versus_lower_bound(row, Timing((0.0095,) * 3), Timing((0.010,) * 3))
    sections = {"unet": {"rows": [row], "measured_on": "Test CPU 9000 (-), 1 thread(s)"}}
    result = _result(sections)
    target = next(t for t in result["targets"] if "lower bound" in t["target"])
    assert target["met"] is None and target["why"].startswith("not judged")
    assert result["flags"] == [{"section": "unet", "row": "64x64x640 toma block 0.5 64",
                                "flag": row["flag"]}]
    text = suite.report(result)
    flagged = text.split("## Flagged (not results)")[1]
    assert "64x64x640 toma block 0.5 64" in flagged
    assert "measured on: Test CPU 9000" in text and "cpu: Test CPU 9000" in text


def test_report_without_flags_says_none() -> None:
    text = suite.report(_result({"unet": {"rows": [_unet_row("64x64x640", speedup=2.5)]}}))
    assert "- none: no variant measured faster than its own lower bound" in text


def test_results_default_to_an_ignored_folder(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    """A run without --out writes under .cache/bench (ignored by git), never into the tracked
    bench/results (60907d1 wrote there), and the result names the CPU and the commit."""
    assert suite.OUT_DIR == ROOT / ".cache" / "bench"
    ignored = (ROOT / ".gitignore").read_text().split()
    assert ".cache/" in ignored
    monkeypatch.setattr(suite, "OUT_DIR", tmp_path / "out")
    monkeypatch.setitem(suite.SECTIONS, "tiny", suite.Section(
        lambda cfg: {"rows": [{"a": 1}], "columns": ["a"], "notes": []}, "a test section"))
    suite.main(["--sections", "tiny", "--device", "cpu"])
    written = list((tmp_path / "out").glob("*.json"))
    assert len(written) == 1 and written[0].with_suffix(".md").exists()
    result = json.loads(written[0].read_text())
    assert result["machine"]["cpu"] == common.cpu_model()
    assert result["sections"]["tiny"]["measured_on"].startswith(common.cpu_model())
    assert re.fullmatch(r"[0-9a-f]{7,}(\+changes)?", result["config"]["commit"])
    assert result["config"]["command"] == "python -m bench --sections tiny --device cpu"
    assert "command: `python -m bench --sections tiny --device cpu`" in \
        written[0].with_suffix(".md").read_text()


# ---------------------------------------------------------------- one helper for each job


def test_one_random_weight_fill_for_bench_and_tests() -> None:
    """tests/integration/comfy_harness.py uses bench/shared/weights.py's fill, not a copy."""
    path = ROOT / "tests" / "integration" / "comfy_harness.py"
    spec = importlib.util.spec_from_file_location("harness_for_test", path)
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    weights = ROOT / "bench" / "shared" / "weights.py"
    assert harness.fill_weights.__code__.co_filename == str(weights)
    a, b = torch.nn.Linear(16, 8), torch.nn.LayerNorm(8)
    fill_weights(a, seed=3)
    fill_weights(b, seed=3)
    expected = torch.randn(8, 16, generator=torch.Generator().manual_seed(3)) / math.sqrt(16)
    torch.testing.assert_close(a.weight.detach(), expected, atol=0, rtol=1e-7)
    assert not a.bias.any() and bool((b.weight == 1).all()) and not b.bias.any()


def test_bench_never_reaches_into_closures() -> None:
    for path in (ROOT / "bench").rglob("*.py"):
        assert "__closure__" not in path.read_text(), path.name


# ------------------------------------------------------------------ the report a user reads
def test_a_target_equal_at_the_shown_precision_is_met():
    """1.2 against >= 1.2 printed as "missed: 1.2 against >= 1.2 (0.0% short)" before."""
    from bench.shared.common import goal

    row = {"speedup": 1.19996}
    assert goal("x", row, "speedup", 1.2)["met"] is True
    assert goal("x", {"speedup": 1.19}, "speedup", 1.2)["met"] is False
    assert goal("x", {"vs_lb": 1.1004}, "vs_lb", 1.10, higher=False)["met"] is True


def _report_input(threads: int, clock: str) -> dict:
    unet = [{"level": "64x64x640", "method": "toma", "scope": "block", "ratio": 0.5,
             "tiles": 64, "speedup": 2.41, "ms": 10.0},
            {"level": "64x64x640", "method": "tomesd", "scope": "block", "ratio": 0.5,
             "speedup": 2.19, "ms": 11.0}]
    fid = [{"level": "64x64x640", "method": "toma", "scope": "block", "ratio": 0.5,
            "tiles": 64, "err": 0.159}]
    return {"machine": {"cpu": "Test CPU"},
            "config": {"device": "cpu", "dtype": "float32", "quick": True, "threads": threads,
                       "clock": clock, "commit": "abc1234"},
            "sections": {"unet": {"rows": unet, "columns": ["level", "method", "speedup", "ms"],
                                  "notes": []},
                         "fidelity": {"rows": fid, "columns": ["level", "err"], "notes": []}},
            "targets": [{"target": "a", "value": 1, "met": True},
                        {"target": "b", "value": 1, "met": False}],
            "flags": [], "recommendations": {"crossover": [], "min_tokens_paying": None,
                                             "max_tokens_losing": None, "tiles": []}}


def test_the_report_opens_with_a_verdict_in_plain_words():
    from bench.__main__ import report, verdict

    steady = verdict(_report_input(1, "cpu"))
    assert steady[0] == "Measured on this machine (Test CPU, 1 thread(s)), float32, commit abc1234."
    assert ("SDXL block 64x64x640 at ratio 0.5: ToMA 2.41x faster than unmerged (peers: ToMeSD "
            "2.19x), output error 0.159.") in steady
    assert steady[-1] == "Targets: 1 met, 1 missed (b)."
    text = report(_report_input(1, "cpu"))
    assert text.index("## Verdict") < text.index("## unet")
    # every table says what its columns mean
    assert "- columns: speedup: unmerged time / this variant's time" in text
    # unsteady settings say so
    assert "unsteady" in verdict(_report_input(2, "wall"))[-1]
    assert not any("unsteady" in line for line in steady)


def test_results_name_the_commit_the_run_started_at(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long bench names the code it ran (the checkout when it started), and says so when the
    checkout moved before it wrote its result."""
    monkeypatch.setattr(common, "STARTED_AT", "abc1234")
    monkeypatch.setattr(common, "checkout_state", lambda: "abc1234")
    assert common.commit() == "abc1234"
    monkeypatch.setattr(common, "checkout_state", lambda: "def5678+changes")
    assert common.commit() == ("abc1234 (the checkout changed during the run: def5678+changes "
                               "at the end)")
