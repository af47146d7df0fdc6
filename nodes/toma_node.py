"""The ToMA and ToMAAdvanced nodes: their definitions (node_spec.NodeSpec) and what they do
when they run (their queue-time check is nodes/v3.py's). A widget appended later must also cope
with text in its slot: ComfyUI's frontend 1.35 (ComfyUI 0.8.0) saves the node's progress text
(the stats of the last run, nodes/ui_stats.py) after the widget values. Tooltips and the
description quote the defaults from the constants that define them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..toma_core import BATCH_POLICIES, REGION_MODES, UNMERGE_METHODS
from .apply import apply_toma
from .dit_families import REGION_TOKENS, VIDEO_REGION_FRAMES
from .node_spec import InputSpec, NodeSpec
from .options import (
    DEFAULT_SKIP_BLOCKS,
    MAX_RATIO,
    MAX_TILE_COUNT,
    MERGE_SCOPES,
    UNET_LEVELS,
    make_options,
)
from .unet_patch import AUTO_MIN_TOKENS, TOKENS_PER_TILE

CATEGORY = "model_patches/ToMA"

# SDXL's two attention levels have a token per 16 and per 32 pixels (latent / 2 and / 4).
TILE_DEFAULTS = (
    f"UNet models use tiles of about {TOKENS_PER_TILE} tokens at every level "
    f"({(1024 // 16) ** 2 // TOKENS_PER_TILE} tiles at SDXL's outer level at "
    f"1024x1024, {(1024 // 32) ** 2 // TOKENS_PER_TILE} at its inner level), "
    f"transformer models (Flux and the others) regions of about {REGION_TOKENS} tokens "
    f"({VIDEO_REGION_FRAMES} frames deep on video)")

BASIC_INPUTS: dict[str, InputSpec] = {
    "model": ("MODEL", {"tooltip": "The diffusion model to speed up: put ToMA after the model "
                                   "loader and any LoRA, before the sampler. The help page lists "
                                   "the supported models."}),
    "ratio": ("FLOAT", {
        "default": 0.5, "min": 0.0, "max": MAX_RATIO, "step": 0.05,
        "tooltip": "Fraction of image tokens merged away. 0 turns ToMA off exactly; 0.5 is the "
                   "measured sweet spot, 0.75 faster and softer."}),
    "tile_count": ("INT", {
        "default": 0, "min": 0, "max": MAX_TILE_COUNT, "step": 1,
        "tooltip": "Tiles per image; destinations are chosen inside each tile. 0 = the measured "
                   f"default for the model (tiles of about {TOKENS_PER_TILE} tokens)."}),
    "skip_blocks": ("STRING", {
        "default": DEFAULT_SKIP_BLOCKS, "multiline": False,
        "tooltip": f"Transformer blocks left unmerged, e.g. {DEFAULT_SKIP_BLOCKS!r} (double and "
                   "single blocks), or 'none'. SDXL and SD1.5 ignore it; the help page has the "
                   "notation."}),
    "recompute_every": ("INT", {
        # 1: on the trained fixtures rebuilding every step gave the closest samples at the same
        # speed (docs/quality.md)
        "default": 1, "min": 1, "max": 1000, "step": 1,
        "tooltip": "Rebuild the merge plan every N sampling steps (1 = every step, the measured "
                   "best)."}),
}

ADVANCED_INPUTS: dict[str, InputSpec] = {
    "start_percent": ("FLOAT", {
        "default": 0.0, "min": 0.0, "max": 1.0, "step": 0.01,
        "tooltip": "Merging starts at this fraction of the noise schedule, as ComfyUI's own "
                   "start_percent widgets read it."}),
    "end_percent": ("FLOAT", {
        "default": 1.0, "min": 0.0, "max": 1.0, "step": 0.01,
        "tooltip": "Merging stops at this fraction of the noise schedule (ending early trades "
                   "speed for detail)."}),
    "unet_levels": (list(UNET_LEVELS), {
        "default": "auto",
        "tooltip": f"UNet models: which attention levels merge. auto = levels of at least "
                   f"{AUTO_MIN_TOKENS} tokens (on a CUDA GPU, only those large enough to pay "
                   "there), all = every level, largest = the highest resolution one."}),
    "merge_scope": (list(MERGE_SCOPES), {
        "default": "auto",
        "tooltip": "block = whole blocks run merged (fastest); attention = only self-attention "
                   "(the paper's setting); auto = block, or attention where other nodes patch "
                   "inside UNet blocks."}),
    "region": (list(REGION_MODES), {
        "default": "tile",
        "tooltip": "Where destinations are chosen: tiles of the token grid (best quality), row "
                   "stripes, or the whole image (global; slow at high resolution)."}),
    "tau": ("FLOAT", {
        "default": 1000.0, "min": 1.0, "max": 100000.0, "step": 1.0,
        "tooltip": "Softmax temperature of the assignment: large = each token goes to its "
                   "nearest destination, small = softer averaging."}),
    "unmerge": (list(UNMERGE_METHODS), {
        "default": "transpose",
        "tooltip": "How merged tokens are spread back: transpose (fast, the paper's choice) or "
                   "pseudo-inverse (slower, same quality)."}),
    "batch_policy": (list(BATCH_POLICIES), {
        "default": "per_item",
        "tooltip": "per_item = each image (and cond/uncond) gets its own destinations; shared = "
                   "one set for the batch (cheaper, coarser)."}),
    "verbose": ("BOOLEAN", {
        "default": False,
        "tooltip": "Log a summary after each run: tokens per level, layers and steps merged, "
                   "planning time."}),
}

DESCRIPTION = (
    "ToMA token merging: merges similar image tokens so the transformer blocks run on fewer "
    "tokens, then spreads the result back. Put it between the model loader (and any LoRA) and "
    "the sampler; it helps most at 1024x1024 and above. The help page lists the supported "
    "models and settings per model.")

TOMA = NodeSpec(
    node_id="ToMA",
    display_name="ToMA Token Merge",
    category=CATEGORY,
    description=DESCRIPTION,
    inputs=BASIC_INPUTS,
    outputs=("MODEL",),
    hidden=("unique_id",),
)
TOMA_ADVANCED = replace(
    TOMA,
    node_id="ToMAAdvanced",
    display_name="ToMA Token Merge (Advanced)",
    description=DESCRIPTION + " The advanced node also sets the step window, the UNet levels, "
    "the merge scope, the region shape, the assignment temperature, the unmerge method, the "
    "batch policy and logging.",
    inputs={**BASIC_INPUTS, **ADVANCED_INPUTS},
)


def patch_model(model: Any, ratio: float, tile_count: int, skip_blocks: str,
                recompute_every: int, unique_id: str | None = None, **advanced: Any) -> Any:
    """What ToMA and ToMAAdvanced do: a patched clone of the ComfyUI model (a ModelPatcher),
    from the widget values (`advanced`: ToMAAdvanced's, by name) and the node's id in the
    graph, where its stats are shown (None outside a graph). ValueError names a bad widget."""
    options = make_options(ratio, tile_count, skip_blocks, recompute_every, **advanced)
    return apply_toma(model, options, unique_id)
