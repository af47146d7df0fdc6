"""ToMA on an SD1.5-layout UNet (attention at full latent resolution too) and with a LoRA-style
weight patch on the model."""

from __future__ import annotations

import torch

import comfy_harness as ch
from toma_pack.nodes.toma_node import patch_model

SD15_CONFIG = {
    "use_checkpoint": False, "image_size": 32, "in_channels": 4, "out_channels": 4,
    "model_channels": 32, "num_res_blocks": [1, 1, 1], "channel_mult": [1, 2, 2],
    "transformer_depth": [1, 1, 1], "transformer_depth_middle": 1,
    "transformer_depth_output": [1, 1, 1, 1, 1, 1], "context_dim": 64, "num_heads": 2,
    "num_head_channels": -1, "use_linear_in_transformer": False, "legacy": False,
    "adm_in_channels": None, "use_spatial_transformer": True, "use_temporal_attention": False,
    "use_temporal_resblock": False,
}


def tiny_sd15_patcher():
    import comfy.model_patcher
    import comfy.supported_models

    config = comfy.supported_models.SD15(dict(SD15_CONFIG))
    config.unet_config.update(num_heads=2, num_head_channels=-1)
    config.set_inference_dtype(torch.float32, None)
    model = config.get_model({}, device=ch.CPU)
    ch.fill_weights(model)
    return comfy.model_patcher.ModelPatcher(model, ch.CPU, ch.CPU)


def toma(model, levels="all"):
    patched = patch_model(
        model, 0.5, 0, "d0-4, s0-4", 5, start_percent=0.0, end_percent=1.0, unet_levels=levels,
        merge_scope="block", region="tile", tau=1000.0, unmerge="transpose",
        batch_policy="per_item", verbose=False)
    return patched


def sd15_conds(batch):
    def cond(seed):
        return [[torch.randn(batch, 8, 64, generator=torch.Generator().manual_seed(seed)), {}]]
    return cond(0), cond(1)


def test_sd15_full_resolution_level_merges(comfyui_path, monkeypatch):
    import comfy.ldm.modules.attention as attention

    lengths: list[int] = []
    inner = attention.optimized_attention

    def recording(q, k, v, *args, **kwargs):
        if k.shape[1] == q.shape[1]:
            lengths.append(q.shape[1])
        return inner(q, k, v, *args, **kwargs)

    monkeypatch.setattr(attention, "optimized_attention", recording)
    model = tiny_sd15_patcher()
    positive, negative = sd15_conds(2)
    latent = torch.zeros(2, 4, 48, 40)
    out = ch.sample(toma(model, levels="largest"), latent, positive, negative, steps=2)
    assert torch.isfinite(out).all()
    # levels: 48x40 (merged by "largest"), 24x20 and 12x10 (left whole)
    assert set(lengths) == {960, 480, 120}


def test_lora_style_weight_patch_still_applies(comfyui_path):
    model = ch.tiny_sdxl_patcher()
    key = "diffusion_model.input_blocks.4.1.transformer_blocks.0.ff.net.2.weight"
    weight = model.model.state_dict()[key]
    lora = model.clone()
    lora.add_patches({key: (torch.ones_like(weight) * 0.05,)}, 1.0)
    positive, negative = ch.sdxl_conds(1, 512, 512)
    latent = ch.empty_latent(model, 1, 64, 64)
    plain = ch.sample(toma(model), latent, positive, negative, steps=2)
    with_lora = ch.sample(toma(lora), latent, positive, negative, steps=2)
    assert torch.isfinite(with_lora).all()
    # the LoRA moves the output: relative L2 change measured 0.346 on every version; bound / 2
    assert float((with_lora - plain).norm() / plain.norm()) > 0.17
    # the LoRA's weights come off again: the ToMA model without it is unchanged
    assert torch.equal(ch.sample(toma(model), latent, positive, negative, steps=2), plain)
