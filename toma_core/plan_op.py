"""A plan's destinations and weights for every region at once, as one operator.

stream [B, L, C] holds the grid's tokens at rows offset + slots[r, s] (slots [R, S], pad slots
False in valid [R, S] or valid None). Per region: cosine similarity in float32 (center: of
features minus their mean over C, as layer-normed), k destinations by greedy facility location
(weighted: coverage counted by squared feature norm, so attention sinks stay their own
destinations), then merge_plan's P, M and U. Returns picks [B, R, k] (slots, in pick order),
dest [B, R*k] (their grid tokens), merge_w [B*R, k, S] and unmerge_w [B*R, S, k] in `dtype`.
One operator, so that the greedy's k sequential steps are one launch on CUDA (triton_plan.py)
and one opaque node for torch.compile; elsewhere they run as `plan_weights_reference`'s ops.
"""

from __future__ import annotations

import math

import torch

from .facility_location import gram_similarity, greedy_facility_location

OP_NAME = "comfy_toma::plan_weights"
# (picks, dest, merge_w, unmerge_w)
PlanTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def plan_weights_reference(stream: torch.Tensor, offset: int, slots: torch.Tensor,
                           valid: torch.Tensor | None, k: int, tau: float, center: bool,
                           dtype: torch.dtype, dest_valid: torch.Tensor | None = None,
                           weighted: bool = False) -> PlanTensors:
    """The operator in plain torch ops (shapes in the module docstring). dest_valid [R, k]
    (sequence shards' unequal counts, see assignment; not behind the operator): pad picks get
    zero weights, and dest holds their slots' tokens too (MergePlan keeps only the real ones).
    """
    b, (r, s) = stream.shape[0], slots.shape
    x = stream.index_select(1, (slots + offset).flatten()).view(b, r, s, -1).float()
    if center:
        x = x - x.mean(-1, keepdim=True)
    sim = gram_similarity(x, valid)                                    # [B, R, S, S]
    weight = x.square().sum(-1) if weighted else None                  # [B, R, S]
    picks = greedy_facility_location(sim, k, valid, weight)            # [B, R, k]
    p = assignment(sim, picks, tau, valid, dest_valid)                 # [B, R, k, S]
    # a destination weighs itself 1, so only ragged regions' pad rows (sum 0) are clamped
    merge_w = (p / p.sum(-1, keepdim=True).clamp_min(1.0)).to(dtype).view(b * r, k, s)
    # A dense copy, as the fake outputs are: .to(dtype, memory_format=contiguous_format) returns
    # the transposed view itself when the dtype already matches.
    unmerge_w = torch.empty((b, r, s, k), dtype=dtype, device=p.device).copy_(p.mT)
    dest = slots.expand(b, r, s).gather(-1, picks).view(b, r * k)
    return picks, dest, merge_w, unmerge_w.view(b * r, s, k)


def assignment(sim: torch.Tensor, picks: torch.Tensor, tau: float,
               valid: torch.Tensor | None, dest_valid: torch.Tensor | None = None
               ) -> torch.Tensor:
    """P [..., k, S]: softmax over destinations of tau * cos(dest, token); tau = inf is hard.

    sim [..., S, S]: the region's cosine similarity (float32; softmax subtracts the column max,
    so any tau is stable). Pad slot columns are zero. dest_valid [R, k]: True at a region's
    first `count` picks (the greedy's choice for its own count); the other picks' rows are zero.
    """
    s, ragged = sim.shape[-1], dest_valid is not None
    scores = sim.gather(-2, picks.unsqueeze(-1).expand(*picks.shape, s))
    if ragged:
        scores.masked_fill_(~dest_valid.unsqueeze(-1), -math.inf)
    if math.isinf(tau):
        best = scores.argmax(-2, keepdim=True)
        p = torch.zeros_like(scores).scatter_(-2, best, 1.0)
    else:
        p = torch.softmax(scores.mul_(tau), dim=-2)
    # A destination is its own source: keep that exact so no merged token is ever empty. Pad
    # picks are marked one slot past the end, which is then cut off.
    real = torch.where(dest_valid, picks, s) if ragged else picks
    is_dest = torch.zeros((*sim.shape[:-2], s + 1), dtype=torch.bool, device=sim.device)
    is_dest.scatter_(-1, real, True)                                       # [..., S + 1]
    p.masked_fill_(is_dest[..., None, :s], 0.0).scatter_(-1, picks.unsqueeze(-1), 1.0)
    if ragged:
        p.mul_(dest_valid.unsqueeze(-1))
    if valid is not None:
        p.mul_(valid.unsqueeze(-2))
    return p


def _empty_like_outputs(stream: torch.Tensor, slots: torch.Tensor, k: int,
                        dtype: torch.dtype) -> PlanTensors:
    b, (r, s) = stream.shape[0], slots.shape
    return (stream.new_empty((b, r, k), dtype=torch.long),
            stream.new_empty((b, r * k), dtype=torch.long),
            stream.new_empty((b * r, k, s), dtype=dtype),
            stream.new_empty((b * r, s, k), dtype=dtype))


def _cuda_kernel(stream: torch.Tensor, offset: int, slots: torch.Tensor,
                 valid: torch.Tensor | None, k: int, tau: float, center: bool,
                 dtype: torch.dtype, weighted: bool = False) -> PlanTensors:
    """CUDA: the Triton kernel where it applies, else the reference ops."""
    from . import triton_plan

    if triton_plan.applies(slots.shape[1], k, tau):
        try:
            return triton_plan.plan_weights(stream, offset, slots, valid, k, tau, center, dtype,
                                            weighted)
        except Exception as exc:  # a Triton that cannot build the kernel here: stay correct
            triton_plan.disable(exc)
    return plan_weights_reference(stream, offset, slots, valid, k, tau, center, dtype,
                                  weighted=weighted)


def _register():
    """The operator, registered once per process (a second copy of the pack reuses it)."""
    namespace, name = OP_NAME.split("::")
    existing = getattr(getattr(torch.ops, namespace), name, None)   # any namespace resolves
    if existing is not None:
        return existing
    if not hasattr(torch.library, "custom_op"):   # torch < 2.4: plain functions
        return None

    @torch.library.custom_op(OP_NAME, mutates_args=())
    def op(stream: torch.Tensor, offset: int, slots: torch.Tensor, valid: torch.Tensor | None,
           k: int, tau: float, center: bool, dtype: torch.dtype,
           weighted: bool = False) -> PlanTensors:
        return plan_weights_reference(stream, offset, slots, valid, k, tau, center, dtype,
                                      weighted=weighted)

    op.register_fake(lambda stream, offset, slots, valid, k, tau, center, dtype, weighted=False:
                     _empty_like_outputs(stream, slots, k, dtype))
    op.register_kernel("cuda")(_cuda_kernel)
    return getattr(getattr(torch.ops, namespace), name)


_OP = _register()


def plan_weights(stream: torch.Tensor, offset: int, slots: torch.Tensor,
                 valid: torch.Tensor | None, k: int, tau: float, center: bool,
                 dtype: torch.dtype, weighted: bool = False) -> PlanTensors:
    """(picks, dest, merge_w, unmerge_w) for the grid in `stream` (module docstring)."""
    if _OP is None:     # torch < 2.4: plain functions
        run = _cuda_kernel if stream.is_cuda else plan_weights_reference
        return run(stream, offset, slots, valid, k, tau, center, dtype, weighted=weighted)
    return _OP(stream, offset, slots, valid, k, float(tau), center, dtype, weighted)

