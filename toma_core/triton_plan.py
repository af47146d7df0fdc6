"""plan_op's operator as one Triton kernel: one program per (batch item, region).

A program gathers its region's S tokens through the slot table, accumulates their Gram matrix in
IEEE float32 (TF32 would round the similarity to 10 bits), runs the k greedy picks in registers
and writes M and U: the steps, order and tie-breaking (lowest slot) of
`plan_op.plan_weights_reference`, which tests compare it with under TRITON_INTERPRET=1. Regions
over MAX_SLOTS slots and tau = inf use the reference ops, as does every call once the kernel
failed to build here (logged once).
"""

from __future__ import annotations

import logging
import math

import torch

log = logging.getLogger("ToMA")

MAX_SLOTS = 128
BLOCK_C = 32
_disabled: list[str] = []


def applies(slots: int, k: int, tau: float) -> bool:
    """Whether the kernel handles regions of `slots` slots with k destinations and this tau."""
    return (not _disabled and slots <= MAX_SLOTS and 1 <= k <= slots and math.isfinite(tau)
            and _kernel() is not None)


def disable(exc: Exception) -> None:
    """Use the reference ops from now on (the kernel failed to build or run here)."""
    if not _disabled:
        _disabled.append(repr(exc))
        log.warning("ToMA: the Triton plan kernel is unavailable here (%s); using torch ops", exc)


_KERNEL: list = []


def _kernel():
    """The jitted kernel, defined on first use (Triton is imported only where it runs), or None."""
    if _KERNEL:
        return _KERNEL[0]
    try:
        import triton
        import triton.language as tl
    except ImportError:
        _KERNEL.append(None)
        return None

    @triton.jit
    def plan_kernel(x_ptr, slots_ptr, valid_ptr, picks_ptr, dest_ptr, m_ptr, u_ptr,
                    offset, n_regions, n_slots, n_channels, k, tau,
                    stride_b, stride_l, stride_c,
                    has_valid: tl.constexpr, center_rows: tl.constexpr, weighted: tl.constexpr,
                    s_pad: tl.constexpr, k_pad: tl.constexpr, block: tl.constexpr):
        pid = tl.program_id(0)                      # item * R + region
        item = pid // n_regions
        region = pid % n_regions
        slot = tl.arange(0, s_pad)
        in_table = slot < n_slots
        token = tl.load(slots_ptr + region * n_slots + slot, mask=in_table, other=0)
        ok = in_table
        if has_valid:
            ok = ok & (tl.load(valid_ptr + region * n_slots + slot, mask=in_table, other=0) != 0)
        rows = x_ptr + item.to(tl.int64) * stride_b + (token.to(tl.int64) + offset) * stride_l
        chans = tl.arange(0, block)

        mean = tl.zeros((s_pad,), dtype=tl.float32)
        if center_rows:
            for c0 in range(0, n_channels, block):
                c = c0 + chans
                tile = tl.load(rows[:, None] + c[None, :] * stride_c,
                               mask=ok[:, None] & (c[None, :] < n_channels), other=0.0)
                mean += tl.sum(tile.to(tl.float32), axis=1)
            mean = mean / n_channels
        gram = tl.zeros((s_pad, s_pad), dtype=tl.float32)
        for c0 in range(0, n_channels, block):
            c = c0 + chans
            live = ok[:, None] & (c[None, :] < n_channels)
            tile = tl.load(rows[:, None] + c[None, :] * stride_c, mask=live, other=0.0)
            tile = tl.where(live, tile.to(tl.float32) - mean[:, None], 0.0)
            gram += tl.dot(tile, tl.trans(tile), input_precision="ieee")

        same = slot[:, None] == slot[None, :]
        sq = tl.sum(tl.where(same, gram, 0.0), axis=1)
        inv = 1.0 / tl.sqrt(tl.maximum(sq, 1e-12))
        sim = gram * inv[:, None] * inv[None, :]
        pair = ok[:, None] & ok[None, :]
        sim = tl.where(pair, sim, -1.0)
        shifted = sim + 1.0
        weight = tl.full((s_pad,), 1.0, tl.float32)
        if weighted:
            weight = sq

        kk = tl.arange(0, k_pad)
        cover = tl.zeros((s_pad,), dtype=tl.float32)
        blocked = ok == 0
        picks = tl.zeros((k_pad,), dtype=tl.int32)
        scores = tl.zeros((k_pad, s_pad), dtype=tl.float32)
        for i in range(k):
            gain = tl.sum(tl.maximum(shifted - cover[None, :], 0.0) * weight[None, :], axis=1)
            gain = tl.where(blocked, -1.0, gain)
            pick = tl.argmax(gain, axis=0)
            chosen = slot == pick
            row = tl.sum(tl.where(chosen[:, None], shifted, 0.0), axis=0)
            cover = tl.maximum(cover, row)
            blocked = blocked | chosen
            picks = tl.where(kk == i, pick, picks)
            scores = tl.where((kk == i)[:, None], row[None, :] - 1.0, scores)

        live_k = kk < k
        z = tl.where(live_k[:, None], scores * tau, float("-inf"))
        top = tl.max(z, axis=0)
        e = tl.exp(z - top[None, :])
        p = e / tl.sum(e, axis=0)[None, :]
        own = live_k[:, None] & (picks[:, None] == slot[None, :])
        is_dest = tl.sum(own.to(tl.int32), axis=0) > 0
        p = tl.where(is_dest[None, :], own.to(tl.float32), p)
        p = tl.where(ok[None, :] & live_k[:, None], p, 0.0)
        m = p / tl.where(live_k, tl.sum(p, axis=1), 1.0)[:, None]

        out = live_k[:, None] & in_table[None, :]
        base = pid.to(tl.int64) * k * n_slots
        tl.store(m_ptr + base + kk[:, None] * n_slots + slot[None, :],
                 m.to(m_ptr.dtype.element_ty), mask=out)
        tl.store(u_ptr + base + slot[None, :] * k + kk[:, None],
                 p.to(u_ptr.dtype.element_ty), mask=out)
        dest = tl.sum(tl.where(own, token[None, :], 0), axis=1)
        tl.store(picks_ptr + pid.to(tl.int64) * k + kk, picks.to(tl.int64), mask=live_k)
        tl.store(dest_ptr + pid.to(tl.int64) * k + kk, dest.to(tl.int64), mask=live_k)

    _KERNEL.append(plan_kernel)
    return plan_kernel


def plan_weights(stream: torch.Tensor, offset: int, slots: torch.Tensor,
                 valid: torch.Tensor | None, k: int, tau: float, center: bool,
                 dtype: torch.dtype, weighted: bool = False) -> tuple[torch.Tensor, ...]:
    """Launch the kernel: shapes and meaning as plan_op.plan_weights_reference."""
    kernel = _kernel()
    b, (r, s), c = stream.shape[0], slots.shape, stream.shape[-1]
    picks = torch.empty((b, r, k), dtype=torch.long, device=stream.device)
    dest = torch.empty((b, r * k), dtype=torch.long, device=stream.device)
    merge_w = torch.empty((b * r, k, s), dtype=dtype, device=stream.device)
    unmerge_w = torch.empty((b * r, s, k), dtype=dtype, device=stream.device)
    s_pad = max(16, 1 << (s - 1).bit_length())
    k_pad = max(16, 1 << (k - 1).bit_length())
    slots = slots.contiguous()
    kernel[(b * r,)](
        stream, slots, valid if valid is not None else slots, picks, dest, merge_w, unmerge_w,
        offset, r, s, c, k, float(tau), stream.stride(0), stream.stride(1), stream.stride(2),
        has_valid=valid is not None, center_rows=center, weighted=weighted, s_pad=s_pad,
        k_pad=k_pad, block=BLOCK_C, num_warps=4 if s_pad <= 64 else 8)
    return picks, dest, merge_w, unmerge_w
