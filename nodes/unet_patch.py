"""ToMA for ComfyUI's UNet models (SDXL, SD1.5, SD2): what it changes, and how.

Two merge scopes, both keyed on the block's own token grid (`activations_shape`), so any
resolution works:

- "attention": the attn1 patch pair. Before self-attention the normed tokens (queries, keys and
  values) are merged; after it the output is unmerged. The paper's SDXL setting. Composes with
  other packs' attn1 patches (it is one more entry in ComfyUI's patch lists).
- "block": an object patch on each BasicTransformerBlock's `forward`. The whole block
  (self-attention, cross-attention, feed-forward) runs on merged tokens and only its update is
  unmerged: out = x + unmerge(block(merge(x)) - merge(x)). Wraps another pack's patch of the same
  forward instead of dropping it.

One plan per grid level and batch layout serves every block of that level and is refreshed on the
`recompute_every` schedule. A call whose sequence is not the level's full grid (another ToMA
already merged it) is left alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ..toma_core import MergePlan, build_plan
from .run_state import ToMAState, patch_forward, plain_function

log = logging.getLogger("ToMA")

# tile_count 0: tiles of about 8x8 tokens at every level (64 tiles at SDXL's 4096-token level,
# 16 at its 1024-token level). bench/: lowest block error at both levels, same speed.
TOKENS_PER_TILE = 64
# Levels below this many tokens are left alone by "auto": merging costs more than it saves there
# (see bench/ and the README's Benchmarks section).
AUTO_MIN_TOKENS = 1024
# Below this even "all" skips a level: a few tokens per tile leave nothing to merge.
MIN_TOKENS = 16


class UNetToMA:
    """The patch functions for one ToMA node on one UNet model."""

    def __init__(self, state: ToMAState, scope: str, largest_level_ds: int) -> None:
        self.state = state
        self.scope = scope
        self.largest_level_ds = largest_level_ds
        self.plan_slot = f"toma_plan_{id(self)}"   # extra_options key for the attn1 pair

    # Which calls merge ---------------------------------------------------------------------------
    def merges_level(self, h: int, w: int, latent_w: int) -> bool:
        """Whether the unet_levels option merges an h x w level of a latent latent_w wide."""
        levels = self.state.options.unet_levels
        if levels == "largest":
            return round(latent_w / w) <= self.largest_level_ds
        return h * w >= (AUTO_MIN_TOKENS if levels == "auto" else MIN_TOKENS)

    def plan_for(self, x: torch.Tensor, options: dict,
                 features: Callable[[], torch.Tensor]) -> MergePlan | None:
        """The plan for this block call, or None to run it unchanged.

        x [B, N, C]: the block's tokens; options: its transformer/extra options;
        features(): the normed tokens the plan is built from (called only when one is due).
        """
        shape = options.get("activations_shape")
        layer = (tuple(options.get("block") or ()), options.get("block_index", 0))
        if shape is None or x.dim() != 3:
            return None
        h, w = int(shape[-2]), int(shape[-1])
        level = f"{h}x{w}"
        step = self.state.active_step(options)
        latent = options.get("original_shape") or shape
        if step is None or x.shape[1] != h * w or not self.merges_level(h, w, int(latent[-1])):
            self.state.record(layer, level, h * w, None, None)
            return None
        o = self.state.options
        key = ("unet", h, w, x.shape[0], tuple(options.get("cond_or_uncond") or ()))
        tiles = o.tile_count or max(1, round(h * w / TOKENS_PER_TILE))
        plan = self.state.plan(key, step, lambda: build_plan(
            features(), h, w, o.ratio, mode=o.region, tile_count=tiles, tau=o.tau,
            unmerge=o.unmerge, batch=o.batch_policy))
        self.state.record(layer, level, h * w, plan, step)
        return plan

    # Scope "attention": attn1 patch pair ---------------------------------------------------------
    def attn1_patch(self, n: torch.Tensor, context: torch.Tensor, value: torch.Tensor,
                    extra_options: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Merge self-attention's queries, keys and values: n [B, N, C] -> [B, N', C]."""
        plan = self.plan_for(n, extra_options, lambda: n)
        if plan is None:
            return n, context, value
        extra_options[self.plan_slot] = plan
        merged = plan.merge(n)

        def same(t: torch.Tensor) -> torch.Tensor:
            # keys/values are usually n itself; text context (disable_self_attn) stays whole
            if t is n:
                return merged
            return plan.merge(t) if t is not None and t.shape[1] == n.shape[1] else t

        return merged, same(context), same(value)

    def attn1_output_patch(self, n: torch.Tensor, extra_options: dict) -> torch.Tensor:
        """Unmerge self-attention's output back to the full grid: [B, N', C] -> [B, N, C]."""
        plan = extra_options.pop(self.plan_slot, None)
        return n if plan is None else plan.unmerge(n)

    # Scope "block": transformer block forward -----------------------------------------------------
    def block_forward(self, block: torch.nn.Module, original: Callable) -> Callable:
        """A replacement for block.forward that runs `original` on merged tokens."""

        def forward(x: torch.Tensor, context: torch.Tensor | None = None,
                    transformer_options: dict | None = None) -> torch.Tensor:
            options = transformer_options if transformer_options is not None else {}
            plan = self.plan_for(x, options, lambda: block.norm1(x))
            if plan is None:
                return original(x, context=context, transformer_options=options)
            return plan.around(
                lambda t: original(t, context=context, transformer_options=options), x)

        return forward


def transformer_blocks(diffusion_model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(dotted path, module) of every BasicTransformerBlock inside a SpatialTransformer."""
    from comfy.ldm.modules.attention import BasicTransformerBlock, SpatialTransformer

    found = []
    for name, module in diffusion_model.named_modules():
        if type(module) is SpatialTransformer:
            for i, block in enumerate(module.transformer_blocks):
                if isinstance(block, BasicTransformerBlock):
                    found.append((f"{name}.transformer_blocks.{i}", block))
    return found


def largest_level_downsample(diffusion_model: torch.nn.Module) -> int:
    """Downsampling factor of the highest-resolution UNet level that has attention (SDXL: 2)."""
    from comfy.ldm.modules.attention import SpatialTransformer
    from comfy.ldm.modules.diffusionmodules.openaimodel import Downsample

    ds = 1
    for block in diffusion_model.input_blocks:
        if any(isinstance(layer, SpatialTransformer) for layer in block):
            return ds
        if any(isinstance(layer, Downsample) for layer in block):
            ds *= 2
    return ds


def patch_unet(model, state: ToMAState, scope: str) -> None:
    """Install ToMA on a cloned UNet ModelPatcher `model` (changes only that clone's options)."""
    diffusion_model = model.get_model_object("diffusion_model")
    blocks = transformer_blocks(diffusion_model)
    if not blocks:
        raise ValueError("ToMA: this UNet has no transformer blocks to merge")
    toma = UNetToMA(state, scope, largest_level_downsample(diffusion_model))
    if scope == "attention":
        model.set_model_attn1_patch(plain_function(toma.attn1_patch))
        model.set_model_attn1_output_patch(plain_function(toma.attn1_output_patch))
        return
    for name, block in blocks:
        patch_forward(model, name, block, lambda original, b=block: toma.block_forward(b, original))
    log.debug("ToMA: patched %d UNet transformer blocks", len(blocks))
