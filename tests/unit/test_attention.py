"""Size-weighted attention over merged tokens (toma_core/attention.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from toma_pack.toma_core import build_plan, merged_attention, size_bias
from toma_pack.toma_core.attention import key_sizes

COPIES = (22, 14, 10, 7, 5, 3, 2, 1)     # 64 tokens, 8 distinct


def duplicated_grid(batch: int = 2, channels: int = 16) -> torch.Tensor:
    """[B, 64, C]: 8 random tokens, the i-th COPIES[i] times, shuffled."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(batch, len(COPIES), channels, generator=g)
    which = torch.repeat_interleave(torch.arange(len(COPIES)), torch.tensor(COPIES))
    order = torch.stack([which[torch.randperm(len(which), generator=g)] for _ in range(batch)])
    return base.gather(1, order.unsqueeze(-1).expand(-1, -1, channels))


def attend(t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Self-attention of t [B, L, C] in 2 heads, bias an additive mask on the keys."""
    heads = t.unflatten(-1, (2, -1)).transpose(1, 2)
    return F.scaled_dot_product_attention(heads, heads, heads, attn_mask=bias) \
        .transpose(1, 2).flatten(2)


@pytest.mark.parametrize("batch_policy", ["per_item", "shared"])
def test_sizes_are_the_assignments_row_sums_and_add_up_to_the_grid(batch_policy: str) -> None:
    x = torch.randn(3, 12 * 10, 8)
    plan = build_plan(x, 12, 10, 0.5, tile_count=6, tau=10.0, batch=batch_policy)
    assert key_sizes(plan).shape == (3, plan.merged_tokens)
    assert torch.allclose(key_sizes(plan).sum(1), torch.full((3,), 120.0))
    # transpose unmerge: U = P^T, so a merged token's size is its column of U summed
    per_region = plan.unmerge_w.float().sum(1).view(3, -1)
    assert torch.allclose(key_sizes(plan), per_region)
    assert (key_sizes(plan) >= 1).all()          # each destination is its own source



def test_sizes_under_the_pseudo_inverse_are_still_ps_row_sums() -> None:
    """unmerge "pinv" keeps P^T apart (plan.assignment): the sizes are those of the transpose
    plan with the same destinations, not the pseudo-inverse's column sums."""
    x = torch.randn(2, 12 * 10, 8)
    want = build_plan(x, 12, 10, 0.5, tile_count=6, tau=10.0)
    got = build_plan(x, 12, 10, 0.5, tile_count=6, tau=10.0, unmerge="pinv")
    assert torch.equal(got.dest_slots, want.dest_slots)
    assert torch.equal(key_sizes(got), key_sizes(want))

def test_size_bias_is_log_size_on_the_grid_and_zero_elsewhere() -> None:
    x = torch.randn(2, 3 + 64 + 2, 8)
    plan = build_plan(x, 8, 8, 0.5, offset=3, tile_count=4)
    m = plan.merged_tokens
    bias = size_bias(plan, 3 + m + 2, prefix=3, dtype=torch.float16)
    assert bias.shape == (2, 1, 1, 3 + m + 2) and bias.dtype == torch.float16
    assert torch.equal(bias[..., :3], torch.zeros(2, 1, 1, 3, dtype=torch.float16))
    assert torch.equal(bias[..., 3 + m:], torch.zeros(2, 1, 1, 2, dtype=torch.float16))
    assert torch.allclose(bias[0, 0, 0, 3:3 + m].float(), key_sizes(plan)[0].log(), atol=1e-2)
    assert size_bias(plan, 3 + m + 2, prefix=3, dtype=torch.float16) is bias   # made once
    assert plan.size_biases[(3 + m + 2, 3, torch.float16)] is bias   # where hot paths read it


def test_merging_duplicate_keys_loses_nothing_when_size_weighted() -> None:
    """Tokens that are copies of 8 distinct ones (1 to 22 copies each), merged to those 8 (hard
    assignment): the size-weighted attention over the merged keys is the full attention, the
    plain one is not."""
    x = duplicated_grid()
    plan = build_plan(x, 8, 8, 1 - 8 / 64, tile_count=1, tau=math.inf)
    assert sorted(key_sizes(plan)[0].tolist()) == sorted(float(c) for c in COPIES)
    full = attend(x, None)
    weighted = merged_attention(plan, x, attend)
    plain = merged_attention(plan, x, attend, size_weighted=False)
    assert torch.allclose(weighted, full, atol=1e-5)
    assert not torch.allclose(plain, full, atol=1e-2)
