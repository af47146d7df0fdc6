"""Flux.1 dev/schnell, Flux Kontext, Flux 2, LongCat-Image, Ovis-Image, Chroma and Chroma
Radiance: double blocks with text and image in two streams (attention over [text; image]), then
single blocks on [text; image]; reference images after the image never merge. The modulation
spans of "index_timestep_zero" references (modulation_dims, handed beside the replace patch's
arguments) move with the merged image.

Merge scope "attention" (the paper's variant, AttentionScope) merges only the double blocks'
image attention, through object patches on img_attn.qkv and img_attn.proj on every ComfyUI
version (attn1 patches would see Q/K/V only after the full-length projection). "auto" merges
whole blocks: much faster, at a block error like a merged single block's (docs/benchmarks.md,
Flux blocks)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...toma_core import MergePlan
from ..contracts import Contract, Mentions, Takes
from ..dit_families import BlockKind, Family, ShardKind, TextAt, describe_plain
from ..forward_patches import ForwardPatches
from . import TIMESTEP_ZERO_METHOD, conditioning, patch_of, positions_taken, with_references

MODELS = ("Flux.1 dev/schnell, Flux Kontext, Flux 2, LongCat-Image, Ovis-Image, Chroma, "
          "Chroma Radiance")

KINDS = (BlockKind("double_block", "double_blocks", "d", TextAt.BEFORE, mask="attn_mask",
                   positions=("modulation_dims_img",), attention_scope=True,
                   shard=ShardKind()),
         BlockKind("single_block", "single_blocks", "s", TextAt.STREAM_BEFORE, txt=None,
                   mask="attn_mask", positions=("modulation_dims",),
                   shard=ShardKind()))

FLUX = "comfy.ldm.flux.model:Flux"
CHROMA = "comfy.ldm.chroma.model:Chroma"
# Chroma's blocks on 16-pixel patches; a per-patch head makes pixels of their full-length output
CHROMA_RADIANCE = "comfy.ldm.chroma_radiance.model:ChromaRadiance"
# Flux.forward_orig's parameter where it modulates "index_timestep_zero" references on their own
TIMESTEP_ZERO = "timestep_zero_index"

CONTRACT = Contract(
    "Flux",
    models={
        FLUX: (Takes(f"{FLUX}.forward_orig", (TIMESTEP_ZERO,),
                     when=Mentions("comfy.ldm.flux.model", (TIMESTEP_ZERO_METHOD,)),
                     why="ToMA reads from it that 'index_timestep_zero' references are "
                         "modulated on their own, over spans it moves"),),
        CHROMA: (),
        CHROMA_RADIANCE: (),
    },
    needs=(conditioning("Flux", ("ref_latents",)),),
    blocks={"double_blocks": ("img", "txt", "vec", "pe", "attn_mask"),
            "single_blocks": ("x", "vec", "pe", "attn_mask")},
    kinds=KINDS,
)


def family(diffusion_model) -> Family:
    """The (1, h, w) grid of latent x; the modulation spans to move where this ComfyUI's model
    modulates "index_timestep_zero" references on their own."""
    return description(patch_of(diffusion_model.patch_size),
                       positions_taken(KINDS, type(diffusion_model).forward_orig, TIMESTEP_ZERO),
                       getattr(getattr(diffusion_model, "params", None), "default_ref_method",
                               None))


def description(patch: tuple[int, int, int], kinds: tuple[BlockKind, ...] = KINDS,
                default_method: str | None = None) -> Family:
    return with_references(Family("flux", "Flux", kinds, patch, describe_plain(patch),
                                  attention_hooks=AttentionScope), default_method)


class AttentionScope:
    """The img_attn hooks of one ToMA node. A double block running in this scope leaves its
    plan here, under its index and device, for the hooks inside it (which see no
    transformer_options); two calls of one block on one device never overlap, and calls on
    other devices (v0.33's per-GPU threads) have their own entries. merged: the entries whose
    qkv hook merged."""

    def __init__(self) -> None:
        self.entries: dict[tuple[int, torch.device], MergePlan] = {}
        self.merged: set[tuple[int, torch.device]] = set()

    def install(self, model, patches: ForwardPatches, indices: list[int]) -> None:
        """Object patches on img_attn.qkv and img_attn.proj of the double blocks `indices`
        (chaining another pack's patch of the same forward)."""
        for index in indices:
            for name, make in (("qkv", self.qkv_forward), ("proj", self.proj_forward)):
                patches.add(model, f"{KINDS[0].modules}.{index}.img_attn.{name}",
                            lambda module, original, m=make, i=index: m(i, original))

    def run(self, index: int, plan: MergePlan, merged_args: dict,
            run: Callable[[dict], dict]) -> dict:
        """Run double block `index` with only its image attention merged."""
        key = (index, plan.merge_w.device)
        self.entries[key] = plan
        try:
            return run(merged_args)
        finally:
            self.entries.pop(key, None)
            self.merged.discard(key)

    def qkv_forward(self, index: int, original: Callable) -> Callable:
        """img_attn.qkv: project merged image tokens [B, N + refs, C] -> [B, N' + refs, 3C]."""

        def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            key = (index, x.device)
            plan = self.entries.get(key)
            if plan is None or key in self.merged or x.shape[1] < plan.tokens:
                return original(x, *args, **kwargs)
            self.merged.add(key)
            return original(plan.merge(x), *args, **kwargs)

        return forward

    def proj_forward(self, index: int, original: Callable) -> Callable:
        """img_attn.proj: project, then unmerge [B, N' + refs, C] -> [B, N + refs, C].
        Unmerge rows sum to 1, so unmerging after the projection equals unmerging before it."""

        def forward(y: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            key = (index, y.device)
            out = original(y, *args, **kwargs)
            return out if key not in self.merged else self.entries[key].unmerge(out)

        return forward
