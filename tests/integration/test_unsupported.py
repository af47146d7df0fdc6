"""Models ToMA cannot patch get an error naming what is supported, never a silent no-op."""

from __future__ import annotations

import pytest
import torch

import comfy_harness as ch
from toma_pack.nodes import ToMA


def tiny_sd3_patcher():
    """A two-block SD3 (MMDiT), the kind of model ToMA does not support."""
    import comfy.model_patcher
    import comfy.supported_models

    config = comfy.supported_models.SD3({
        "in_channels": 16, "out_channels": 16, "patch_size": 2, "depth": 2,
        "adm_in_channels": 64, "pos_embed_max_size": 16, "num_patches": 256,
        "pos_embed_scaling_factor": None,
        "context_embedder_config": {"target": "torch.nn.Linear",
                                    "params": {"in_features": 64, "out_features": 128}}})
    config.set_inference_dtype(torch.float32, None)
    return comfy.model_patcher.ModelPatcher(config.get_model({}, device=ch.CPU), ch.CPU, ch.CPU)


@pytest.mark.parametrize("ratio", [0.5, 0.0])
def test_sd3_is_refused_with_the_supported_list(comfyui_path, ratio):
    with pytest.raises(ValueError, match="supported: SDXL") as error:
        ToMA().patch(tiny_sd3_patcher(), ratio, 0, "d0-4, s0-4", 5)
    assert "MMDIT" in str(error.value).upper()
