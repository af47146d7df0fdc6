"""The ToMA and ToMAAdvanced nodes (ComfyUI V1 node API: loads on v0.3.64 and later).

Widget order is part of every saved workflow: new widgets go at the end, none is ever moved,
renamed or retyped (tests/unit/test_node_inputs.py holds the snapshot).
"""

from __future__ import annotations

from ..toma_core import BATCH_POLICIES, REGION_MODES, UNMERGE_METHODS
from .apply import SUPPORTED, apply_toma
from .options import DEFAULT_SKIP_BLOCKS, MAX_RATIO, MERGE_SCOPES, UNET_LEVELS, make_options

CATEGORY = "model_patches/ToMA"

BASIC_INPUTS = {
    "model": ("MODEL", {"tooltip": "The diffusion model to speed up (SDXL, SD1.5/2, Flux, "
                                   "Flux Kontext, Chroma)."}),
    "ratio": ("FLOAT", {
        "default": 0.5, "min": 0.0, "max": MAX_RATIO, "step": 0.05,
        "tooltip": "Fraction of image tokens merged away in merged layers. 0 turns ToMA off "
                   "exactly. 0.5 is the measured sweet spot; 0.75 is faster and softer."}),
    "tile_count": ("INT", {
        "default": 0, "min": 0, "max": 4096, "step": 1,
        "tooltip": "Tiles per image at each merged level; destinations are chosen inside each "
                   "tile. 0 = measured defaults: UNet models use tiles of about 8x8 tokens at "
                   "every level (64 tiles at SDXL's outer level at 1024x1024), Flux 256 tiles. "
                   "With region 'stripe' it is the number of stripes."}),
    "skip_blocks": ("STRING", {
        "default": DEFAULT_SKIP_BLOCKS, "multiline": False,
        "tooltip": "Flux only: blocks left unmerged, double blocks as d<i> or d<i>-<j>, single "
                   "blocks as s<i> or s<i>-<j>, e.g. 'd0-4, s0-4'; 'none' merges every block. "
                   "UNet models (SDXL, SD1.5) ignore it."}),
    "recompute_every": ("INT", {
        "default": 5, "min": 1, "max": 1000, "step": 1,
        "tooltip": "Destinations and merge weights are rebuilt every N sampling steps and reused "
                   "in between (and across all layers of a level). 1 = every step."}),
}

ADVANCED_INPUTS = {
    "start_percent": ("FLOAT", {
        "default": 0.0, "min": 0.0, "max": 1.0, "step": 0.01,
        "tooltip": "Merging starts at this fraction of the sampling steps."}),
    "end_percent": ("FLOAT", {
        "default": 1.0, "min": 0.0, "max": 1.0, "step": 0.01,
        "tooltip": "Merging stops at this fraction of the sampling steps (the last steps "
                   "refine details; ending early trades speed for detail)."}),
    "unet_levels": (list(UNET_LEVELS), {
        "default": "auto",
        "tooltip": "UNet models: which attention levels merge. auto = levels with at least "
                   "1024 tokens (where merging pays off); all = every level; largest = only the "
                   "highest-resolution level with attention. Flux ignores it."}),
    "merge_scope": (list(MERGE_SCOPES), {
        "default": "auto",
        "tooltip": "block = the whole transformer block runs on merged tokens and only its "
                   "update is unmerged (fastest); attention = only self-attention (UNet) or "
                   "the image attention of Flux double blocks runs merged (the paper's "
                   "setting). auto = block; on UNet models attention in blocks that other "
                   "nodes patch inside, so their patches see every token."}),
    "region": (list(REGION_MODES), {
        "default": "tile",
        "tooltip": "Where destinations are chosen: tiles of the token grid (best quality), row "
                   "stripes, or the whole image at once (global; slow at high resolution)."}),
    "tau": ("FLOAT", {
        "default": 1000.0, "min": 1.0, "max": 100000.0, "step": 1.0,
        "tooltip": "Softmax temperature of the token-to-destination assignment. Large = each "
                   "token goes to its nearest destination; small = softer averaging."}),
    "unmerge": (list(UNMERGE_METHODS), {
        "default": "transpose",
        "tooltip": "How merged tokens are spread back: transpose of the assignment (fast, the "
                   "paper's choice) or pseudo-inverse of the merge (slower, same quality)."}),
    "batch_policy": (list(BATCH_POLICIES), {
        "default": "per_item",
        "tooltip": "per_item = each image of the batch (and cond/uncond) gets its own "
                   "destinations; shared = one set from the batch mean (cheaper, coarser)."}),
    "verbose": ("BOOLEAN", {
        "default": False,
        "tooltip": "Log a summary after each run: tokens per level, layers and steps merged, "
                   "time spent planning."}),
}

HIDDEN = {"unique_id": "UNIQUE_ID"}

DESCRIPTION = (
    "ToMA token merging: merges similar image tokens inside tiles so the transformer blocks run "
    "on fewer tokens, then spreads the result back. Put it between the model loader (and any "
    "LoRA) and the sampler. Helps most at 1024x1024 and above (SDXL, Flux); UNet levels under "
    "1024 tokens (SDXL below 512x512) are left alone. Works on " + SUPPORTED + "; other models get "
    "an error.")


class ToMA:
    """Token merging with the measured defaults."""

    @classmethod
    def INPUT_TYPES(cls) -> dict:  # noqa: N802 (ComfyUI's name)
        return {"required": dict(BASIC_INPUTS), "hidden": dict(HIDDEN)}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = CATEGORY
    DESCRIPTION = DESCRIPTION

    def patch(self, model, ratio: float, tile_count: int, skip_blocks: str, recompute_every: int,
              unique_id: str | None = None, **advanced) -> tuple:
        options = make_options(ratio, tile_count, skip_blocks, recompute_every, **advanced)
        return (apply_toma(model, options, unique_id),)


class ToMAAdvanced(ToMA):
    """Token merging with every setting exposed."""

    @classmethod
    def INPUT_TYPES(cls) -> dict:  # noqa: N802 (ComfyUI's name)
        return {"required": {**BASIC_INPUTS, **ADVANCED_INPUTS}, "hidden": dict(HIDDEN)}

    DESCRIPTION = DESCRIPTION + " The advanced node also sets the step window, the UNet " \
        "levels, the merge scope, the region shape, the assignment temperature, the unmerge " \
        "method, the batch policy and logging."
