"""Flux double blocks in merge scope "attention" (the paper's variant): only the image attention
runs merged. Everything else about Flux-family models is the generic block patch (dit_patch.py)
with the description in families/flux.py.

In this scope a double block gets the whole image stream, with merged RoPE and mask rows; object
patches on its img_attn.qkv and img_attn.proj forwards merge the projection's input (image Q/K/V
come from merged tokens, text Q/K/V stay full, the joint attention runs on [text; merged image])
and unmerge the attention projection's output; the image MLP runs at full length. This route is
the same on every ComfyUI version (the >= 0.17 attn1 patches would only see Q/K/V after the
full-length projection).

Merging whole double blocks is much faster than merging their attention only, at a block error
like a merged single block's (docs/benchmarks.md, Flux blocks); hence merge_scope "auto" merges
whole blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..toma_core import MergePlan
from .forward_patches import ForwardPatches
from .run_state import ToMAState


@dataclass
class AttentionCall:
    """A double block running in scope "attention": its plan, and whether the qkv hook merged."""

    plan: MergePlan
    merged: bool = False


class AttentionScope:
    """The img_attn hooks of one ToMA node. A double block running in this scope leaves its
    plan here, under its index and device, for the hooks inside it (which see no
    transformer_options); two calls of one block on one device never overlap, and calls on
    other devices (v0.33's per-GPU threads) have their own entries."""

    def __init__(self, state: ToMAState) -> None:
        self.state = state
        self.entries: dict[tuple[int, torch.device], AttentionCall] = {}

    def install(self, model, patches: ForwardPatches, indices: list[int]) -> None:
        """Object patches on img_attn.qkv and img_attn.proj of the double blocks `indices`
        (chaining another pack's patch of the same forward)."""
        for index in indices:
            for name, make in (("qkv", self.qkv_forward), ("proj", self.proj_forward)):
                patches.add(model, f"double_blocks.{index}.img_attn.{name}",
                            lambda module, original, m=make, i=index: m(i, original))

    def run(self, index: int, plan: MergePlan, merged_args: dict,
            run: Callable[[dict], dict]) -> dict:
        """Run double block `index` with only its image attention merged."""
        key = (index, plan.merge_w.device)
        self.entries[key] = AttentionCall(plan)
        try:
            return run(merged_args)
        finally:
            self.entries.pop(key, None)

    def qkv_forward(self, index: int, original: Callable) -> Callable:
        """img_attn.qkv: project merged image tokens [B, N + refs, C] -> [B, N' + refs, 3C]."""

        def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            entry = self.entries.get((index, x.device))
            if entry is None or entry.merged or x.shape[1] < entry.plan.tokens:
                return original(x, *args, **kwargs)
            entry.merged = True
            return original(entry.plan.merge(x), *args, **kwargs)

        return forward

    def proj_forward(self, index: int, original: Callable) -> Callable:
        """img_attn.proj: project, then unmerge [B, N' + refs, C] -> [B, N + refs, C].
        Unmerge rows sum to 1, so unmerging after the projection equals unmerging before it."""

        def forward(y: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            entry = self.entries.get((index, y.device))
            out = original(y, *args, **kwargs)
            return out if entry is None or not entry.merged else entry.plan.unmerge(out)

        return forward
