"""The trained quality fixtures: model layouts, initialisation, conditioning, safetensors I/O.

Small diffusion models built from ComfyUI's own classes (needs ComfyUI imported, see
bench.shared.config.setup_comfy):

- "sdxl": comfy.supported_models.SDXL (UNetModel, EPS prediction) with SDXL's block structure
  (3 levels, channel_mult 1/2/4, 2 res blocks per level, attention only at the two lower levels
  and in the middle, linear proj_in, adm vector from pooled + 6 size embeddings) at width 32 and
  transformer depth 1. At a 128x128 latent its attention levels have 4096 and 1024 tokens.
- "flux": comfy.supported_models.Flux (double/single stream blocks, RoPE) at hidden 64,
  4 heads, 10 double + 20 single blocks (Flux.1's 1:2 mix, deep enough for the default
  skip_blocks "d0-4, s0-4"), no guidance embedding. At a 64x64 latent: 1024 image tokens.

"sdxl-matched" and "flux-matched": the same classes at the real models' tokens per channel
(SDXL_MATCHED_UNET, FLUX_MATCHED_PARAMS below), trained on photographs and rendered scenes.

Conditioning is a class label: one fixed, seeded random "text embedding" per training photograph
(context [4 tokens, 64] and pooled [32]) plus a null class (the last row) for unconditional
samples and CFG's negative. The tables are stored in the safetensors file beside the weights.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from ..shared.config import ROOT

MODELS_DIR = ROOT / "models"
CONTEXT_TOKENS = 4
CONTEXT_DIM = 64
POOLED_DIM = 32
SDXL_ADM_EXTRA = 6 * 256   # model_base.SDXL.encode_adm: 6 size embeddings of 256

SDXL_UNET: dict[str, Any] = {
    "use_checkpoint": False, "image_size": 32, "in_channels": 4, "out_channels": 4,
    "model_channels": 32, "num_res_blocks": [2, 2, 2], "channel_mult": [1, 2, 4],
    "transformer_depth": [0, 0, 1, 1, 1, 1], "transformer_depth_middle": 1,
    "transformer_depth_output": [0, 0, 0, 1, 1, 1, 1, 1, 1], "context_dim": CONTEXT_DIM,
    "num_head_channels": 32, "adm_in_channels": POOLED_DIM + SDXL_ADM_EXTRA,
    "use_linear_in_transformer": True, "legacy": False, "num_classes": "sequential",
    "use_spatial_transformer": True, "use_temporal_attention": False,
    "use_temporal_resblock": False,
}
FLUX_PARAMS: dict[str, Any] = {
    "in_channels": 16, "out_channels": 16, "vec_in_dim": POOLED_DIM,
    "context_in_dim": CONTEXT_DIM, "hidden_size": 64, "mlp_ratio": 4.0, "num_heads": 4,
    # theta 32, not Flux's 10000: with 3 frequencies per image axis (Flux has 28), 10000 gives
    # 1, 0.046 and 0.002 rad per token, too few to tell a neighbour from a token far away on a
    # 32 x 32 grid; after 1300 steps the samples were independent per token (4x4-pixel blocks).
    # 32 gives 1, 0.32 and 0.10 rad per token (periods of 6, 20 and 63 tokens).
    "depth": 10, "depth_single_blocks": 20, "axes_dim": [4, 6, 6], "theta": 32,
    "patch_size": 2, "qkv_bias": True, "guidance_embed": False, "txt_ids_dims": [],
}
# The proportion-matched fixtures: fewer tokens at proportionally wider channels, so that the
# share of attention against the projections and feed-forward in each transformer block is
# SDXL's and Flux.1's at 1024x1024 (that share goes with tokens / channels; bench/quality/shares.py
# prints both). Trained on photographs and rendered scenes (bench/quality/scenes.py).
# SDXL at 1024^2: 4096 tokens at 640 channels, 1024 at 1280 (6.4 and 0.8 tokens per channel);
# here at a 56 x 56 latent: 784 at 128 and 196 at 256 (6.1 and 0.77), in SDXL's 64-wide heads
# (64 channels is the narrowest width above 32 that GroupNorm's 32 groups allow).
SDXL_MATCHED_UNET: dict[str, Any] = {**SDXL_UNET, "model_channels": 64, "num_head_channels": 64}
# Flux.1 at 1024^2: 4096 image + 512 text tokens at 3072 (1.5); here at a 32 x 32 latent:
# 256 + 4 at 192 (1.35), 3 heads of 64 like Flux's 128-wide heads split into (t, h, w) axes.
# theta 100: 12 frequencies per image axis from 1 to 0.015 rad per token on a 16 x 16 grid.
FLUX_MATCHED_PARAMS: dict[str, Any] = {**FLUX_PARAMS, "hidden_size": 192, "num_heads": 3,
                                       "axes_dim": [16, 24, 24], "theta": 100}
# Layout -> (architecture, its parameters).
ARCHITECTURE = {"sdxl": ("sdxl", SDXL_UNET), "flux": ("flux", FLUX_PARAMS),
                "sdxl-matched": ("sdxl", SDXL_MATCHED_UNET),
                "flux-matched": ("flux", FLUX_MATCHED_PARAMS)}
MATCHED = ("sdxl-matched", "flux-matched")
LAYOUTS = tuple(ARCHITECTURE)           # every committed fixture
# Evaluation latent sizes (pixels = latent for sdxl, 2 x latent for flux).
EVAL_LATENT = {"sdxl": 128, "flux": 64, "sdxl-matched": 56, "flux-matched": 32}


def arch(layout: str) -> str:
    """"sdxl" or "flux": the architecture (and latent space) of a fixture layout."""
    if layout not in ARCHITECTURE:
        raise ValueError(f"layout must be one of {tuple(ARCHITECTURE)}, got {layout!r}")
    return ARCHITECTURE[layout][0]


def latent_per_pixel(layout: str) -> int:
    """Pixel side / latent side."""
    return 1 if arch(layout) == "sdxl" else 2


def with_scenes(layout: str) -> bool:
    """Whether the layout is trained (and measured) on rendered scenes beside photographs."""
    return layout in MATCHED


def weights_path(layout: str) -> Path:
    """Where the committed weights of `layout` live."""
    return MODELS_DIR / f"toma-{layout}-fixture.safetensors"


def model_config(layout: str):
    """ComfyUI's supported_models config object for `layout`, fp32."""
    import comfy.ldm.flux.model
    import comfy.supported_models

    kind, given = arch(layout), ARCHITECTURE[layout][1]
    if kind == "sdxl":
        config = comfy.supported_models.SDXL(dict(given))
        # BASE.__init__ overlays SDXL's unet_extra_config (64-channel heads): restore ours.
        config.unet_config["num_head_channels"] = given["num_head_channels"]
        config.unet_config["num_heads"] = -1
    else:
        # FluxParams grows across ComfyUI versions: pass only the fields this version has.
        fields = {f.name for f in dataclasses.fields(comfy.ldm.flux.model.FluxParams)}
        params = {k: v for k, v in given.items() if k in fields}
        config = comfy.supported_models.Flux({"image_model": "flux", **params})
    config.set_inference_dtype(torch.float32, None)
    return config


def init_weights(model: torch.nn.Module, layout: str, seed: int) -> None:
    """Fresh weights (ComfyUI skips init): matrices normal(0, 1/fan_in), vectors 1 (scales) or
    0 (biases); the layers that write into a residual stream start at zero, so every block
    starts as the identity (zero_module in SD, adaLN-Zero in DiT)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim <= 1:
                p.fill_(0.0 if name.endswith("bias") else 1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p[0].numel() ** 0.5)
        for module in _zero_init_modules(model, layout):
            for p in module.parameters():
                p.zero_()


def _zero_init_modules(model: torch.nn.Module, layout: str) -> list[torch.nn.Module]:
    if arch(layout) == "sdxl":
        from comfy.ldm.modules.attention import SpatialTransformer
        from comfy.ldm.modules.diffusionmodules.openaimodel import ResBlock

        out = [model.out[-1]]
        for m in model.modules():
            if isinstance(m, ResBlock):
                out.append(m.out_layers[-1])
            elif isinstance(m, SpatialTransformer):
                out.append(m.proj_out)
        return out
    out = [model.final_layer.linear, model.final_layer.adaLN_modulation[-1]]
    for block in model.double_blocks:
        out += [block.img_mod.lin, block.txt_mod.lin]
    out += [block.modulation.lin for block in model.single_blocks]
    return out


def class_tables(n_classes: int, seed: int) -> dict[str, torch.Tensor]:
    """Fixed embeddings per class (+1 null class, last): context [n+1, T, 64], pooled [n+1, 32].
    The null class is all zeros."""
    g = torch.Generator().manual_seed(seed + 12345)
    context = torch.randn(n_classes + 1, CONTEXT_TOKENS, CONTEXT_DIM, generator=g)
    pooled = torch.randn(n_classes + 1, POOLED_DIM, generator=g)
    context[-1] = 0
    pooled[-1] = 0
    return {"context": context, "pooled": pooled}


@dataclasses.dataclass
class Fixture:
    """A fixture model: ComfyUI's BaseModel, its layout, class tables and card metadata."""

    layout: str
    model: Any                  # comfy.model_base.BaseModel
    tables: dict[str, torch.Tensor]
    meta: dict[str, Any]

    @property
    def null_class(self) -> int:
        return self.tables["context"].shape[0] - 1

    def labels(self, labels: torch.Tensor) -> torch.Tensor:
        """Labels with -1 (unconditional) mapped to the null class."""
        return torch.where(labels < 0, torch.full_like(labels, self.null_class), labels)

    def model_kwargs(self, labels: torch.Tensor, latent_h: int, latent_w: int) -> dict:
        """apply_model keyword arguments for a batch of labels (what the sampler computes from
        the conditioning below): c_crossattn and y."""
        idx = self.labels(labels)
        context = self.tables["context"][idx]
        pooled = self.tables["pooled"][idx]
        if arch(self.layout) == "sdxl":
            y = self.model.encode_adm(pooled_output=pooled, width=latent_w * 8,
                                      height=latent_h * 8)
            return {"c_crossattn": context, "y": y}
        return {"c_crossattn": context, "y": pooled}

    def conditioning(self, labels: torch.Tensor, latent_h: int, latent_w: int) -> list:
        """ComfyUI conditioning ([[context, {...}]]) for a batch of labels."""
        idx = self.labels(labels)
        extra: dict[str, Any] = {"pooled_output": self.tables["pooled"][idx]}
        if arch(self.layout) == "sdxl":
            extra.update(width=latent_w * 8, height=latent_h * 8)
        return [[self.tables["context"][idx], extra]]

    def patcher(self, device: torch.device | str = "cpu"):
        """A ModelPatcher around the model (what a loader node returns), loading to `device`."""
        import comfy.model_patcher

        return comfy.model_patcher.ModelPatcher(self.model, load_device=torch.device(device),
                                                offload_device=torch.device("cpu"))


def training_runs(record: dict) -> list[dict]:
    """The training runs behind a training record, oldest first (a run continued with --init
    keeps the record of the run it started from under "prior")."""
    chain = []
    while record is not None:
        chain.append(record)
        record = record.get("prior")
    return chain[::-1]


def total_steps(record: dict, step: int) -> int:
    """Optimiser steps behind weights saved at `step` of the run `record` describes: its
    earlier runs' and these."""
    return step + sum(run["steps_done"] for run in training_runs(record)[:-1])


def build(layout: str, n_classes: int, seed: int) -> Fixture:
    """An untrained fixture with seeded weights."""
    model = model_config(layout).get_model({}, device=torch.device("cpu"))
    init_weights(model.diffusion_model, layout, seed)
    return Fixture(layout, model, class_tables(n_classes, seed), {"layout": layout})


def save(fixture: Fixture, path: Path, meta: dict[str, Any]) -> None:
    """Weights as fp16 safetensors (diffusion_model.* keys, as in a ComfyUI checkpoint) plus the
    class tables (fixture.*); `meta` goes in the header as JSON strings."""
    from safetensors.torch import save_file

    tensors = {f"diffusion_model.{k}": v.detach().to(torch.float16).contiguous()
               for k, v in fixture.model.diffusion_model.state_dict().items()}
    tensors.update({f"fixture.{k}": v.contiguous() for k, v in fixture.tables.items()})
    header = {k: json.dumps(v) for k, v in {**meta, "layout": fixture.layout}.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=header)


def load(layout: str, path: Path | None = None, dtype: torch.dtype = torch.float32,
         device: torch.device | str = "cpu") -> Fixture:
    """The committed (or given) fixture, loaded into this ComfyUI's classes (strict)."""
    from safetensors import safe_open

    path = path or weights_path(layout)
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing: train it with python -m bench.quality.train "
                                f"--layout {layout}")
    with safe_open(str(path), framework="pt") as f:
        meta = {k: json.loads(v) for k, v in (f.metadata() or {}).items()}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if meta.get("layout") != layout:
        raise ValueError(f"{path} holds a {meta.get('layout')!r} model, not {layout!r}")
    config = model_config(layout)
    config.set_inference_dtype(dtype, None)
    model = config.get_model({}, device=torch.device(device))
    state = {k.removeprefix("diffusion_model."): v for k, v in tensors.items()
             if k.startswith("diffusion_model.")}
    # What ComfyUI's own loader does first: key renames between versions (newer Flux names
    # its QK-norm scales "weight" where the saved keys say "scale").
    state = config.process_unet_state_dict(state)
    model.diffusion_model.load_state_dict(state, strict=True)
    model.diffusion_model.to(device=device, dtype=dtype)
    model.eval()
    tables = {k.removeprefix("fixture."): v for k, v in tensors.items()
              if k.startswith("fixture.")}
    return Fixture(layout, model, tables, meta)


def denoising_loss(fixture: Fixture, x0: torch.Tensor, labels: torch.Tensor,
                   sigma: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Per-item training loss through BaseModel.apply_model: mean((denoised - x0)^2 / sigma^2),
    which is the epsilon MSE for EPS models (SDXL) and the velocity MSE for flow models (Flux).

    x0, noise [B, C, H, W] in model space; sigma [B]; returns [B].
    """
    model = fixture.model
    s = sigma.view(-1, 1, 1, 1)
    x = model.model_sampling.noise_scaling(s, noise, x0)
    kwargs = fixture.model_kwargs(labels, x0.shape[-2], x0.shape[-1])
    denoised = model.apply_model(x, sigma, **kwargs)
    return ((denoised - x0) ** 2 / s ** 2).mean(dim=(1, 2, 3))
