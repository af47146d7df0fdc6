"""Real models' configurations the benches build ComfyUI's classes from."""

from __future__ import annotations

from typing import Any

import torch

# SDXL base: comfy/supported_models.py SDXL plus what model_detection reads from the checkpoint
# (320 channels, transformer depths 2 and 10, 64-channel heads, context 2048, adm 2816).
SDXL_UNET: dict[str, Any] = {
    "use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True,
    "legacy": False, "num_classes": "sequential", "adm_in_channels": 2816, "in_channels": 4,
    "model_channels": 320, "num_res_blocks": [2, 2, 2], "transformer_depth": [0, 0, 2, 2, 10, 10],
    "channel_mult": [1, 2, 4], "transformer_depth_middle": 10, "use_linear_in_transformer": True,
    "context_dim": 2048, "num_head_channels": 64,
    "transformer_depth_output": [0, 0, 0, 2, 2, 2, 10, 10, 10],
    "use_temporal_attention": False, "use_temporal_resblock": False,
}
# SD1.5: comfy/supported_models.py SD15 plus what model_detection reads from the checkpoint
# (320 channels, one transformer block at the three highest levels, 8 heads, context 768).
SD15_UNET: dict[str, Any] = {
    "use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True,
    "legacy": False, "adm_in_channels": None, "in_channels": 4, "model_channels": 320,
    "num_res_blocks": [2, 2, 2, 2], "transformer_depth": [1, 1, 1, 1, 1, 1, 0, 0],
    "channel_mult": [1, 2, 4, 4], "transformer_depth_middle": 1,
    "use_linear_in_transformer": False, "context_dim": 768, "num_heads": 8,
    "num_head_channels": -1, "transformer_depth_output": [0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1],
    "use_temporal_attention": False, "use_temporal_resblock": False,
}
# Flux.1 dev: model_detection's Flux branch (hidden 3072, 24 heads = 3072 / sum(axes_dim), 19
# double and 38 single blocks in the checkpoint, patch 2 over 16 latent channels: img_in takes
# 64, vec_in 768 = CLIP-L pooled, context 4096 = T5-XXL, guidance_in present in dev).
FLUX_DEV: dict[str, Any] = {
    "image_model": "flux", "in_channels": 16, "out_channels": 16, "vec_in_dim": 768,
    "context_in_dim": 4096, "hidden_size": 3072, "mlp_ratio": 4.0, "num_heads": 24, "depth": 19,
    "depth_single_blocks": 38, "axes_dim": [16, 56, 56], "theta": 10000, "patch_size": 2,
    "qkv_bias": True, "guidance_embed": True, "txt_ids_dims": [],
}


# HiDream-O1's prompt: token ids ending in the tms token (comfy.text_encoders.hidream_o1's
# TMS_TOKEN_ID), the slot its timestep goes to, as its chat template ends.
HIDREAM_O1_TMS = 151673


def hidream_o1_prompt_ids(length: int) -> torch.Tensor:
    """HiDream-O1 prompt ids [1, length] ending in the tms token (the others' values change
    neither the ops of a call nor its cost)."""
    ids = torch.arange(1000, 1000 + length).unsqueeze(0)
    ids[0, -1] = HIDREAM_O1_TMS
    return ids
