"""The merges the benchmark compares, each a runner for the model's attention blocks.

As the pack merges a UNet's attention: the normed tokens are merged before q/k/v and the output
is unmerged after the output projection, at levels of at least MIN_TOKENS tokens (this model's
1024- and 256-token levels), with toma_core's defaults (tiles of about 64 tokens, tau 1000,
transpose unmerge) and one plan per level per model call, built from the normed tokens of the
level's first block, as nodes/unet_patch.py does.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from toma_core import build_plan, make_regions, merged_attention

from .onnx_torch import AttentionBlock, plain
from .rules import Rules

MIN_TOKENS = 256
TOKENS_PER_TILE = 64     # nodes/unet_patch.py's tiles
SEED = 0                 # random destinations and ToMeSD's random cells, fixed per model call


def tokens(t: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, H*W, C]."""
    return t.flatten(2).transpose(1, 2)


def grid(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[B, H*W, C] -> [B, C, H, W] shaped like `like`."""
    return t.transpose(1, 2).reshape(like.shape)


@contextlib.contextmanager
def destinations(rule: str, generator: torch.Generator):
    """toma_core's plans with `rule` choosing destinations ("facility": toma_core's facility
    location weighted by the tokens' squared norms, as the pack's UNet path; "unweighted": it
    unweighted; the others bench/realmodel/rules.py's)."""
    if rule in ("facility", "unweighted"):
        yield
        return
    with Rules(rule, generator):
        yield


@dataclass
class Merge:
    """One merge at one ratio. kind: "none", "toma" (destinations: "facility" or "random";
    sized: size-weighted attention), "tomesd" (tomesd 0.1.3's 2x2 bipartite matching, its
    metric the block's input as tomesd's UNet patch uses) or "todo" (keys and values pooled
    2x2, queries whole)."""

    kind: str
    ratio: float = 0.0
    rule: str = "facility"
    sized: bool = False

    def __post_init__(self) -> None:
        self.plans: dict = {}
        self.generator = torch.Generator().manual_seed(SEED)

    @property
    def label(self) -> str:
        if self.kind == "toma":
            name = {"facility": "ToMA", "random": "random destinations",
                    "unweighted": "ToMA, unweighted destinations"}.get(
                self.rule, f"{self.rule} destinations")
            return name + (", size-weighted" if self.sized else "")
        return {"none": "unmerged", "tomesd": "ToMeSD", "todo": "ToDo"}[self.kind]

    def start(self) -> None:
        """A new model call: plans and random draws start again."""
        self.plans.clear()
        self.generator.manual_seed(SEED)

    def __call__(self, block: AttentionBlock, normed: torch.Tensor,
                 x: torch.Tensor) -> torch.Tensor:
        h, w = normed.shape[-2:]
        if self.kind == "none" or h * w < MIN_TOKENS:
            return plain(block, normed, x)
        t = tokens(normed)
        if self.kind == "todo":
            pooled = tokens(F.avg_pool2d(normed, 2))
            return grid(block.attend(t, kv=pooled), normed)
        if self.kind == "tomesd":
            from tomesd.merge import bipartite_soft_matching_random2d
            merge, unmerge = bipartite_soft_matching_random2d(
                tokens(x), w, h, 2, 2, int(h * w * self.ratio), no_rand=False,
                generator=self.generator)
            return grid(unmerge(block.attend(merge(t))), normed)
        plan = self.plans.get((h, w))
        if plan is None:
            with destinations(self.rule, self.generator):
                regions = make_regions(h, w, "tile", max(1, round(h * w / TOKENS_PER_TILE)))
                plan = self.plans[(h, w)] = build_plan(t, h, w, self.ratio, regions=regions,
                                                      weighted=self.rule == "facility")
        out = merged_attention(plan, t, lambda m, bias: block.attend(m, bias), 0, self.sized)
        return grid(out, normed)
