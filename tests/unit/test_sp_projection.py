"""bench/gpu/sequence_parallel.py without ComfyUI: the per-rank counts of the sequence-parallel
projection (all-to-all bytes, FLOPs, link time) against hand sums, against raylight's own run
on two CPU processes, and against the single-GPU hand count."""

from __future__ import annotations

import dataclasses

import pytest

from bench.gpu import projected_calls as gpu_model
from bench.gpu import sequence_parallel as sp

WAN = sp.WAN14B
HV = sp.HUNYUAN_VIDEO


def _bytes(call: sp.RankCall, ranks: int, prefix: str) -> tuple[float, int]:
    """(bytes out of the rank, input buffer bytes) over the all-to-alls whose tensor name
    starts with `prefix`."""
    picked = [m for m in call.messages if m.kind == "all_to_all" and m.what.startswith(prefix)]
    return sum(m.bytes_out(ranks) for m in picked), sum(m.buffer_bytes() for m in picked)


def test_message_model_counts_what_raylights_run_counted() -> None:
    # ../shared/notes/raylight/README.md: 159,744 -> 86,016 bytes per rank and call
    assert sp.tiny_check()["met"]
    tiny = sp.RAYLIGHT_TINY
    assert sp.buffer_bytes(sp.rank_call(tiny, 2, 0.0)) == 159_744
    assert sp.buffer_bytes(sp.rank_call(tiny, 2, 0.5)) == 86_016


def test_wan_on_two_gpus_sends_at_most_0_6_of_the_bytes_in_merged_blocks() -> None:
    plain, merged = sp.rank_call(WAN, 2, 0.0), sp.rank_call(WAN, 2, sp.RATIO)
    out = sp.all_to_all_bytes(merged, 2, True) / sp.all_to_all_bytes(plain, 2, True)
    buffers = sp.buffer_bytes(merged, True) / sp.buffer_bytes(plain, True)
    assert out <= 0.6 and buffers <= 0.6
    # the cross-attention's text keys and values never shrink, so not quite half
    assert out > 0.5
    # the whole call, unmerged blocks 0-4 included, still well under unmerged
    assert sp.all_to_all_bytes(merged, 2) / sp.all_to_all_bytes(plain, 2) <= 0.6


def test_merged_blocks_are_the_node_defaults() -> None:
    assert sp.skipped(WAN) == [frozenset(range(5))]
    assert sp.skipped(HV) == [frozenset(range(5)), frozenset(range(5))]
    call = sp.rank_call(WAN, 2, sp.RATIO)
    # 8 all-to-alls a block (self- and cross-attention), 35 of Wan's 40 blocks merge
    assert sum(m.merged_block for m in call.messages) == 8 * 35


@pytest.mark.parametrize("model, prefix", [(WAN, "self-attention"), (HV, "double block"),
                                           (HV, "single block")])
def test_bytes_scale_with_the_ranks(model: sp.SPModel, prefix: str) -> None:
    # unmerged, every P divides the rows: a rank's buffers are 1/P of the sequence and it
    # sends (P - 1) / P of them
    first = None
    for ranks in sp.RANKS:
        out, buffers = _bytes(sp.rank_call(model, ranks, 0.0), ranks, prefix)
        scaled = (buffers * ranks, out * ranks * ranks / (ranks - 1))
        first = first or scaled
        assert scaled == pytest.approx(first, rel=1e-12)
        merged_out, _ = _bytes(sp.rank_call(model, ranks, sp.RATIO), ranks, prefix)
        assert merged_out < out


def test_flops_merged_below_unmerged_and_attention_formula() -> None:
    for model in (WAN, HV):
        for ranks in sp.RANKS:
            plain, merged = sp.rank_call(model, ranks, 0.0), sp.rank_call(model, ranks, 0.5)
            assert merged.block_flops < 0.5 * plain.block_flops
            assert merged.flops < plain.flops
    # attention over every rank's rows with H / P heads: 4 B P S^2 C FLOPs per rank
    ranks, rows = 4, sp.shard_rows(WAN.tokens, 4)
    ops, _ = sp.wan_block(WAN, rows, ranks, False)
    self_attention = next(op for op in ops if op.kind == "attention")
    assert self_attention.flops == 4 * WAN.batch * ranks * rows**2 * WAN.width
    assert self_attention.shape == (WAN.batch, WAN.heads // ranks, ranks * rows, WAN.head_dim)


def test_one_gpu_is_the_single_gpu_hand_count() -> None:
    assert sp.rank_call(WAN, 1, 0.0).flops == gpu_model.hand_flops(gpu_model.MODELS["wan"])
    assert sp.rank_call(WAN, 1, 0.0).messages == []


def test_every_rank_drops_the_same_tokens() -> None:
    # HunyuanVideo's single blocks on 8 ranks: rank 0 holds the 256 text rows
    grid = sp.grid_per_rank(HV.text + HV.tokens, 8, HV.text, HV.tokens)
    assert grid == [14882 - 256] + [14882] * 7
    # the ratio's share of the whole grid spread evenly: rank 0 drops 51% of its own
    assert sp.dropped(grid, 0.5) == round(0.5 * (8 * 14882 - 256) / 8)


@pytest.mark.parametrize("model, text_first", [(WAN, False), (HV, False), (HV, True)])
def test_drop_count_is_the_packs_shard_rule(model: sp.SPModel, text_first: bool) -> None:
    # the pack's own split of the grid into per-rank regions (toma_core/shards.py): every rank
    # drops the same count of its grid tokens, the count the projection drops
    from toma_pack.toma_core.regions import make_regions
    from toma_pack.toma_core.shards import ShardGeometry, shard_regions

    start = model.text if text_first else 0
    rows = start + model.tokens
    frames, h, w = model.grid
    base = make_regions(h, w, "tile", 64, t=frames, frames=2)
    for ranks in sp.RANKS:
        geometry = ShardGeometry(ranks, sp.shard_rows(rows, ranks), start, base)
        spans = shard_regions(geometry, sp.RATIO)
        drops = {sum(span.sizes) - sum(span.counts) for span in spans if span is not None}
        grid = sp.grid_per_rank(rows, ranks, start, model.tokens)
        assert drops == {sp.dropped(grid, sp.RATIO)}


def test_link_time_is_bytes_over_bandwidth_plus_latency() -> None:
    call = sp.rank_call(sp.RAYLIGHT_TINY, 2, 0.0)
    link = sp.Link("toy", 1e3, 1.0, "round numbers")
    # 24 all-to-alls sending half their buffer, one all-gather sending its one buffer
    expected = (sp.buffer_bytes(call) / 2 + 1 * 32 * 64 * 4) / 1e3 + 25 * 1.0
    assert sp.link_seconds(call, 2, link) == pytest.approx(expected)


def test_toma_is_faster_per_call_without_the_recorded_kernels() -> None:
    for model in (WAN, HV):
        for ranks in sp.RANKS:
            for row in sp.rows_for(model, ranks, None):
                assert row["speedup"] > 1.5
                assert row["a2a_gb_toma"] < row["a2a_gb"]


def test_scaled_keeps_only_the_other_kernels() -> None:
    ops = [sp.linear(100, 8, 8), sp.attention(1, 2, 100, 100, 4),
           sp.local_copy(1000), dataclasses.replace(sp.linear(100, 8, 8), toma=True)]
    out = sp.scaled(ops, 0.25)
    assert [op.kind for op in out] == ["memory", "matmul"]
    assert out[0].read == 500 and out[1].shape == (25, 8)
