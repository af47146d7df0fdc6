"""Tiny model files on disk, for tests that load models the way artists do: through ComfyUI's
UNETLoader (a diffusion-model-only .safetensors, default or fp8 weights), ComfyUI-GGUF's
UnetLoaderGGUF (a .gguf in the layout its tools write) and LoraLoaderModelOnly (a LoRA file).

The models are ComfyUI's own classes at the smallest sizes its model detection
(comfy.model_detection, what both loaders call) still reads back from the state dict, with
weights from comfy_harness.fill_weights:

    with model_folders(tmp_path):
        write_safetensors("wan21_t2v", tmp_path / "wan.safetensors")
        write_gguf("wan21_t2v", tmp_path / "wan-Q8_0.gguf", "Q8_0")
        model = UNETLoader().load_unet("wan.safetensors", "default")[0]

Detection fixes some widths, which sets how small a family can be and in which ComfyUI:
Flux: heads = hidden // 128 only from 0.33 (0.3.64 fixes hidden 3072, 0.8 fixes 24 heads);
Wan 2.1: heads = dim // 128, text width 4096; SD3: 64 * depth wide, heads of 64; Qwen-Image:
every width fixed (24 heads of 128, text 3584), so no tiny Qwen-Image loads from a file.
`unavailable(name)` says why a family cannot be used in the imported ComfyUI (None: it can).
Nothing here imports comfy at module import time (see comfy_harness).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from tiny_models import SampleInputs

from comfy_harness import CPU, Conditioning, _randn, ensure_comfy, fill_weights

if TYPE_CHECKING:
    from comfy.model_patcher import ModelPatcher

GGUFType = Literal["Q8_0", "F16"]

WAN_TEXT_DIM = 4096        # Wan 2.1's UMT5 width: detection does not read it
QWEN_TEXT_DIM = 3584       # Qwen-Image's Qwen2.5-VL width: nor this
FLUX_CONTEXT_DIM = 64      # as comfy_harness.FLUX_CONTEXT_DIM / FLUX_POOLED_DIM (flux_conds fits)
FLUX_POOLED_DIM = 32
SD3_CONTEXT_DIM = 32       # as tiny_models.TEXT_DIM / POOLED_DIM
SD3_POOLED_DIM = 32
TEXT_TOKENS = 7

# ComfyUI-GGUF's tools: convert.py keeps 1-D and small tensors (<= 1024 values) F32, and the
# keys_hiprec ones; its llama.cpp patch (lcpp.patch) quantises only 2-D ".weight" tensors whose
# name holds none of the arch's "keep" fragments, falling back to F16 for rows that do not
# split into 32-value blocks.
_SMALL = 1024
_Q8_BLOCK = 32


@dataclass(frozen=True)
class FileFamily:
    """One family of tiny model files.

    config: class name in comfy.supported_models; arch: the GGUF "general.architecture";
    unet_config: heads -> the unet_config the file's model is built from (what detection must
    read back); keep: name fragments a Q8_0 file leaves unquantised (lcpp.patch's rules);
    hiprec: name fragments kept F32 (convert.py's keys_hiprec); context_dim / pooled_dim: the
    conditioning's text width and pooled vector width (None: no pooled vector);
    video: latent [B, C, T, H, W]; frames_dim: latent [B, C, 1, H, W]; guidance: Flux dev's
    distilled guidance in the conditioning.
    """

    name: str
    config: str
    arch: str
    unet_config: Callable[[int], dict[str, Any]]
    keep: tuple[str, ...] = ()
    hiprec: tuple[str, ...] = ()
    context_dim: int = 32
    pooled_dim: int | None = None
    video: bool = False
    frames_dim: bool = False
    guidance: bool = False


def _flux(heads: int) -> dict[str, Any]:
    """Flux dev: heads of 128 (RoPE axes 16+56+56, as detection sets), 1 double and 1 single
    block, guidance embedding."""
    import comfy.ldm.flux.model as flux

    params = {"image_model": "flux", "in_channels": 16, "out_channels": 16,
              "vec_in_dim": FLUX_POOLED_DIM, "context_in_dim": FLUX_CONTEXT_DIM,
              "hidden_size": 128 * heads, "mlp_ratio": 4.0, "num_heads": heads, "depth": 1,
              "depth_single_blocks": 1, "axes_dim": [16, 56, 56], "theta": 10000,
              "patch_size": 2, "qkv_bias": True, "guidance_embed": True, "txt_ids_dims": []}
    fields = {f.name for f in dataclasses.fields(flux.FluxParams)} | {"image_model"}
    return {k: v for k, v in params.items() if k in fields}


def _wan21(heads: int) -> dict[str, Any]:
    """Wan 2.1 text-to-video: heads of 128, 2 blocks, feed-forward 256 wide."""
    return {"image_model": "wan2.1", "model_type": "t2v", "patch_size": (1, 2, 2),
            "text_len": 512, "in_dim": 16, "dim": 128 * heads, "ffn_dim": 256, "freq_dim": 256,
            "text_dim": WAN_TEXT_DIM, "out_dim": 16, "num_heads": heads, "num_layers": 2,
            "window_size": (-1, -1), "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6}


def _qwen_image(heads: int) -> dict[str, Any]:
    """Qwen-Image as small as it could be: 1 block (detection reads only in_channels and the
    block count; the widths are the class defaults, 24 heads of 128, which is why it is never
    built here: see unavailable())."""
    return {"image_model": "qwen_image", "in_channels": 64, "num_layers": 1,
            "num_attention_heads": heads, "attention_head_dim": 128,
            "joint_attention_dim": QWEN_TEXT_DIM}


def _sd3(heads: int) -> dict[str, Any]:
    """SD3 MMDiT: depth = heads (detection: width 64 * depth, heads of 64), learned positions
    for 16x16 patches (latents up to 32x32)."""
    return {"in_channels": 16, "out_channels": 16, "patch_size": 2, "depth": heads,
            "input_size": None, "adm_in_channels": SD3_POOLED_DIM,
            "context_embedder_config": {"target": "torch.nn.Linear",
                                        "params": {"in_features": SD3_CONTEXT_DIM,
                                                   "out_features": 64 * heads}},
            "num_patches": 16 * 16, "pos_embed_max_size": 16, "pos_embed_scaling_factor": None,
            "qk_norm": None, "x_block_self_attn_layers": []}


FAMILIES: dict[str, FileFamily] = {f.name: f for f in (
    FileFamily("flux", "Flux", "flux", _flux,
               keep=("txt_in.", "img_in.", "time_in.", "vector_in.", "guidance_in.",
                     "final_layer."),
               context_dim=FLUX_CONTEXT_DIM, pooled_dim=FLUX_POOLED_DIM, guidance=True),
    FileFamily("wan21_t2v", "WAN21_T2V", "wan", _wan21,
               keep=("modulation.", "patch_embedding.", "text_embedding.", "time_projection.",
                     "time_embedding.", "img_emb.", "head."),
               hiprec=(".modulation",), context_dim=WAN_TEXT_DIM, video=True),
    # lcpp.patch has no Qwen-Image rules: these follow the Flux ones (embedders and output).
    FileFamily("qwen_image", "QwenImage", "qwen_image", _qwen_image,
               keep=("img_in.", "txt_in.", "time_text_embed.", "norm_out.", "proj_out."),
               context_dim=QWEN_TEXT_DIM, frames_dim=True),
    FileFamily("sd3", "SD3", "sd3", _sd3,
               keep=("final_layer.", "time_text_embed.", "context_embedder.", "t_embedder.",
                     "y_embedder.", "x_embedder.", "proj_out.weight", "pos_embed"),
               context_dim=SD3_CONTEXT_DIM, pooled_dim=SD3_POOLED_DIM),
)}
# Heads per family by default: the smallest files (under 2 MB); SD3 needs 2 (depth = heads).
DEFAULT_HEADS: dict[str, int] = {"flux": 1, "wan21_t2v": 1, "qwen_image": 1, "sd3": 2}


def family(name: str) -> FileFamily:
    """The file family called `name`; ValueError listing the known names otherwise."""
    if name not in FAMILIES:
        raise ValueError(f"no model file family {name!r}; known: {', '.join(FAMILIES)}")
    return FAMILIES[name]


# Building ---------------------------------------------------------------------------------------
def _config(name: str, heads: int | None) -> Any:
    import comfy.supported_models

    fam = family(name)
    cls = getattr(comfy.supported_models, fam.config, None)
    if cls is None:
        raise ValueError(f"this ComfyUI has no {fam.config} (family {name})")
    return cls(fam.unet_config(DEFAULT_HEADS[name] if heads is None else heads))


def reference_patcher(name: str, seed: int = 0, heads: int | None = None) -> ModelPatcher:
    """The model the family's files hold, built in memory (fp32, CPU, weights from `seed`):
    the reference a file loaded back should match."""
    ensure_comfy()
    import comfy.model_patcher

    reason = unavailable(name, heads)
    if reason:
        raise ValueError(reason)
    config = _config(name, heads)
    config.set_inference_dtype(torch.float32, None)
    model = config.get_model({}, device=CPU)
    fill_weights(model, seed)
    _fill_buffers(model, seed)
    model.eval()
    return comfy.model_patcher.ModelPatcher(model, load_device=CPU, offload_device=CPU)


def _fill_buffers(model: torch.nn.Module, seed: int) -> None:
    """SD3's learned position table is a buffer, uninitialised like the weights: small values."""
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for key, buffer in model.named_buffers():
            if key.endswith("pos_embed") and buffer.is_floating_point():
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.02)


def state_dict(name: str, seed: int = 0, heads: int | None = None) -> dict[str, torch.Tensor]:
    """The family's diffusion model state dict (keys without "model.diffusion_model."), fp32."""
    model = reference_patcher(name, seed, heads).model.diffusion_model
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def _shapes(name: str, heads: int | None) -> dict[str, torch.Tensor]:
    """The family's state dict as meta tensors (shapes only, nothing allocated)."""
    config = _config(name, heads)
    config.set_inference_dtype(torch.float32, None)
    with torch.device("meta"):
        model = config.get_model({}, device=torch.device("meta"))
    return dict(model.diffusion_model.state_dict())


def unavailable(name: str, heads: int | None = None) -> str | None:
    """Why the imported ComfyUI cannot load the family's tiny files (None: it can): no such
    model class, or its model detection reads another model back from the state dict (a
    different class, or different shapes: widths it fixes instead of reading them)."""
    ensure_comfy()
    import comfy.model_detection

    try:
        ours = _shapes(name, heads)
    except ValueError as exc:
        return str(exc)
    fam = family(name)
    detected = comfy.model_detection.model_config_from_unet(ours, "")
    if detected is None:
        return f"{fam.config}: ComfyUI's model detection does not recognise the state dict"
    if type(detected).__name__ != fam.config:
        return f"{fam.config}: detected as {type(detected).__name__}"
    detected.set_inference_dtype(torch.float32, None)
    try:
        with torch.device("meta"):
            theirs = dict(detected.get_model({}, device=torch.device("meta"))
                          .diffusion_model.state_dict())
    except Exception as exc:  # the detected config does not even build
        return (f"{fam.config}: the detected config {detected.unet_config} fails to build "
                f"({type(exc).__name__}: {exc})")
    wrong = [f"{k} {tuple(v.shape)} -> {tuple(theirs[k].shape) if k in theirs else 'missing'}"
             for k, v in ours.items() if k not in theirs or theirs[k].shape != v.shape]
    if wrong:
        fixed = {k: detected.unet_config.get(k) for k in
                 ("hidden_size", "num_heads", "dim", "num_attention_heads",
                  "attention_head_dim", "joint_attention_dim", "context_in_dim", "text_dim")
                 if k in detected.unet_config}
        return (f"{fam.config}: detection reads back other shapes ({len(wrong)} tensors, e.g. "
                f"{wrong[0]}; detected {fixed or 'no widths: the class defaults'})")
    return None


def available_families() -> list[str]:
    """The families whose tiny files the imported ComfyUI loads."""
    return [name for name in FAMILIES if unavailable(name) is None]


# Writing ----------------------------------------------------------------------------------------
def write_safetensors(name: str, path: Path, seed: int = 0, heads: int | None = None,
                      dtype: torch.dtype = torch.float16) -> Path:
    """Write the family's diffusion model (state dict keys as in the reference checkpoints, no
    prefix) as a .safetensors file UNETLoader loads; `dtype` the stored weights' (fp16 by
    default, to halve the file: on the CPU ComfyUI computes in fp32 either way). `path`."""
    import safetensors.torch

    sd = {k: v.to(dtype) if v.is_floating_point() else v
          for k, v in state_dict(name, seed, heads).items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(sd, str(path))
    return path


def _gguf_type(fam: FileFamily, key: str, array: Any, qtype: GGUFType) -> Any:
    """The GGML type ComfyUI-GGUF's tools give a tensor (see _SMALL)."""
    import gguf

    types = gguf.GGMLQuantizationType
    if (array.ndim <= 1 or array.size <= _SMALL or array.ndim > 4
            or any(h in key for h in fam.hiprec)):
        return types.F32
    if (qtype == "Q8_0" and array.ndim == 2 and key.endswith("weight")
            and not any(k in key for k in fam.keep) and array.shape[-1] % _Q8_BLOCK == 0):
        return types.Q8_0
    return types.F16


def write_gguf(name: str, path: Path, qtype: GGUFType = "Q8_0", seed: int = 0,
               heads: int | None = None, tensors: dict[str, torch.Tensor] | None = None
               ) -> Path:
    """Write the family's diffusion model as a .gguf UnetLoaderGGUF loads, as ComfyUI-GGUF's
    tools write one: "general.architecture" the family's arch, file type and quantisation
    version set, tensors under their state dict names in ggml's reversed shape order (the
    writer's), F32 for 1-D, small (<= 1024 values) and high-precision ones and for the 5-D
    patch embedding of Wan (fix_5d_tensors.py adds it so), F16 for the rest, and with "Q8_0"
    the 2-D weights outside the arch's embedders and output quantised from their F16 values.
    `tensors`: another state dict of the family's layout to write (keys without prefix), e.g.
    a wider model's. `path`."""
    import gguf
    import numpy as np

    if qtype not in ("Q8_0", "F16"):
        raise ValueError(f"qtype must be 'Q8_0' or 'F16', not {qtype!r}")
    fam = family(name)
    file_type = (gguf.LlamaFileType.MOSTLY_Q8_0 if qtype == "Q8_0"
                 else gguf.LlamaFileType.MOSTLY_F16)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path=None, arch=fam.arch)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_file_type(file_type)
    for key, tensor in (state_dict(name, seed, heads) if tensors is None else tensors).items():
        array = tensor.float().numpy()
        kind = _gguf_type(fam, key, array, qtype)
        if kind == gguf.GGMLQuantizationType.Q8_0:
            array = array.astype(np.float16).astype(np.float32)  # quantised from the F16 file
        writer.add_tensor(key, gguf.quants.quantize(array, kind), raw_dtype=kind)
    writer.write_header_to_file(path=str(path))
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# LoRA -------------------------------------------------------------------------------------------
LORA_TARGETS = r"(attn|attention|qkv|linear1|linear2)"


def _weight_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """{state dict key: the weight's logical shape}: ComfyUI-GGUF's quantised weights hold
    their bytes ([out, bytes per row]) and give the real shape as `tensor_shape`."""
    return {f"{module_name}.{name}".lstrip("."): tuple(getattr(p, "tensor_shape", p.shape))
            for module_name, module in model.named_modules()
            for name, p in module.named_parameters(recurse=False)}


def lora_targets(patcher_or_model: Any, pattern: str = LORA_TARGETS) -> dict[str, str]:
    """{LoRA key ("lora_unet_..."): model weight key} that ComfyUI's own comfy.lora key map
    (model_lora_keys_unet) gives for the model's 2-D weights inside its blocks whose name
    matches `pattern` (attention and the single blocks' fused linears by default)."""
    import re

    import comfy.lora

    model = getattr(patcher_or_model, "model", patcher_or_model)
    shapes = _weight_shapes(model)
    key_map = comfy.lora.model_lora_keys_unet(model, {})
    blocks = re.compile(r"\.(transformer_blocks|double_blocks|single_blocks|blocks|joint_blocks|"
                        r"input_blocks|middle_block|output_blocks|layers)\.")
    wanted = re.compile(pattern)
    # One LoRA key per weight (the map also names SDXL's weights in diffusers' layout, and a
    # file naming a weight twice patches it twice): the one spelling the weight's own key.
    chosen: dict[str, str] = {}
    for lora, key in sorted(key_map.items()):
        if not (lora.startswith("lora_unet_") and len(shapes.get(key, ())) == 2
                and blocks.search(key) and wanted.search(key.rsplit(".", 1)[0])):
            continue
        own = "lora_unet_" + key.removeprefix("diffusion_model.").removesuffix(
            ".weight").replace(".", "_")
        if key not in chosen or lora == own:
            chosen[key] = lora
    return {lora: key for key, lora in sorted(chosen.items())}


def write_lora(patcher_or_model: Any, path: Path, seed: int = 0, rank: int = 4,
               gain: float = 0.5, pattern: str = LORA_TARGETS) -> dict[str, str]:
    """Write a LoRA file (kohya layout: "<key>.lora_up.weight" [out, rank], ".lora_down.weight"
    [rank, in], ".alpha" = rank) for the model of `patcher_or_model` (a ModelPatcher or a
    comfy BaseModel) over lora_targets(pattern): seeded factors whose product is `gain` times
    the weights' own scale (1 / sqrt(fan_in)), so that LoraLoaderModelOnly at strength 1 changes
    the output clearly. The {LoRA key: model weight key} written."""
    import safetensors.torch

    model = getattr(patcher_or_model, "model", patcher_or_model)
    shapes = _weight_shapes(model)
    targets = lora_targets(model, pattern)
    if not targets:
        raise ValueError(f"no weight of {type(model).__name__} matches {pattern!r}")
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for lora, key in sorted(targets.items()):
        out_features, in_features = shapes[key]
        down = torch.randn(rank, in_features, generator=generator) / in_features**0.5
        up = torch.randn(out_features, rank, generator=generator) * (gain / rank**0.5)
        tensors[f"{lora}.lora_down.weight"] = down.contiguous()
        tensors[f"{lora}.lora_up.weight"] = up.contiguous()
        tensors[f"{lora}.alpha"] = torch.tensor(float(rank))
    path.parent.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(tensors, str(path))
    return targets


# Model folders ----------------------------------------------------------------------------------
MODEL_FOLDERS = ("diffusion_models", "loras")


@contextlib.contextmanager
def model_folders(folder: Path, names: tuple[str, ...] = MODEL_FOLDERS) -> Iterator[Path]:
    """Make `folder` one of ComfyUI's model folders for `names` inside the block (folder_paths.
    add_model_folder_path; "diffusion_models" is also "unet", and ComfyUI-GGUF's "unet_gguf"
    shares its list), so that UNETLoader, UnetLoaderGGUF and LoraLoaderModelOnly find the files
    written there by name; removed afterwards, with the file lists ComfyUI cached."""
    ensure_comfy()
    import folder_paths

    path = str(Path(folder).resolve())
    added: list[list[str]] = []
    for name in names:
        before = folder_paths.folder_names_and_paths.get(folder_paths.map_legacy(name))
        had = before is not None and path in before[0]
        folder_paths.add_model_folder_path(name, path)
        if not had:
            added.append(folder_paths.folder_names_and_paths[folder_paths.map_legacy(name)][0])
    gguf = folder_paths.folder_names_and_paths.get("unet_gguf")
    if "diffusion_models" in names and gguf is not None and path not in gguf[0]:
        gguf[0].append(path)  # a ComfyUI-GGUF that made its own list (none to share at import)
        added.append(gguf[0])
    _forget_file_lists(folder_paths)
    try:
        yield Path(path)
    finally:
        for paths in added:
            while path in paths:
                paths.remove(path)
        _forget_file_lists(folder_paths)


def _forget_file_lists(folder_paths: Any) -> None:
    # ComfyUI caches each folder's file list (checked against folder mtimes, which a folder
    # removed later cannot give): drop it.
    folder_paths.filename_list_cache.clear()


# Conditioning -----------------------------------------------------------------------------------
def inputs(name: str, patcher: ModelPatcher, batch: int = 1, height: int = 8, width: int = 8,
           frames: int = 1, tokens: int = TEXT_TOKENS, guidance: float = 3.5,
           seed: int = 0) -> SampleInputs:
    """Empty latent and (positive, negative) conditioning for the family's file model, as
    comfy_harness.sample takes them: text context [B, tokens, context_dim], "pooled_output"
    [B, pooled_dim] (None where the family has none) and Flux's "guidance"; latent
    [B, 16, T, H, W] for Wan, [B, 16, 1, H, W] for Qwen-Image, else [B, 16, H, W] (latent
    sizes: pixels / 8)."""
    fam = family(name)
    channels = int(patcher.model.latent_format.latent_channels)
    if fam.video:
        shape: tuple[int, ...] = (batch, channels, frames, height, width)
    elif fam.frames_dim:
        shape = (batch, channels, 1, height, width)
    else:
        shape = (batch, channels, height, width)

    def cond(offset: int) -> Conditioning:
        context = _randn(batch, tokens, fam.context_dim, seed=seed + offset)
        extras: dict[str, Any] = {"pooled_output": None}
        if fam.pooled_dim is not None:
            extras["pooled_output"] = _randn(batch, fam.pooled_dim, seed=seed + offset + 1)
        if fam.guidance:
            extras["guidance"] = guidance
        return [[context, extras]]

    return SampleInputs(torch.zeros(shape), cond(0), cond(100))
