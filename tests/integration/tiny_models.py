"""Tiny random-weight models of ComfyUI's diffusion transformers (the families ToMA supports), built
from ComfyUI's own classes like comfy_harness.tiny_sdxl_patcher / tiny_flux_patcher.

Each family is a `Family`: the comfy.supported_models config class it is built from (its
presence in a ComfyUI tree is what says whether the tree has the family), a toy-sized
unet_config in the real layout (same block kinds, patch size, latent channels, RoPE axes, token
order; widths 64, 2 blocks of each kind), and the conditioning ComfyUI's own nodes would attach
(text context, pooled vectors, image-to-video concat latents, CLIP-vision outputs, reference
latents, noise masks). `inputs(name, ...)` gives everything `comfy_harness.sample` needs.

    patcher = tiny_patcher("wan22_5b")
    x = inputs("wan22_5b", patcher, batch=1, height=12, width=10, frames=3)
    out = sample(patcher, x.latent, x.positive, x.negative, noise_mask=x.noise_mask)

`height`, `width` and `frames` are latent sizes (pixels / 8 or / 16, frames = latent frames).
Nothing here imports comfy at module import time (see comfy_harness).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from comfy_harness import (
    Conditioning,
    _patcher,
    _randn,
    comfy_top_level_nodes,
    ensure_comfy,
    shared_trees,
)

if TYPE_CHECKING:
    from comfy.model_patcher import ModelPatcher

TEXT_DIM = 32        # width of every tiny text encoder output
TEXT_TOKENS = 7      # length of every tiny text context
POOLED_DIM = 32      # width of pooled text vectors (SD3, HunyuanVideo 1.0)
# Wan 2.1 i2v: CLIP ViT-H penultimate states, 257 x 1280 (img_emb = MLPProj(1280, dim)).
CLIP_VISION_TOKENS = 257
CLIP_VISION_DIM = 1280
SIGLIP_DIM = 1152          # HunyuanVideo 1.5: vision_in = MLPProj(1152, hidden)
BYT5_DIM = 1472            # HunyuanVideo 1.5: ByT5Mapper(in_dim=1472)
HIDREAM_LLAMA_TOKENS = 5   # HiDream's Llama context, another length than the T5 one
HIDREAM_O1_PROMPT = 6      # HiDream-O1's prompt ids, the tms token last
# The reference method whose references get timestep zero's modulation (Qwen-Image-Edit 2511,
# Krea 2's style reference, Flux 2 through Edit Model Reference Method)
TIMESTEP_ZERO = "index_timestep_zero"


@dataclass(frozen=True)
class SampleInputs:
    """What comfy_harness.sample takes: latent [B, C, (T,) H, W], conditioning, noise mask."""

    latent: torch.Tensor
    positive: Conditioning
    negative: Conditioning
    noise_mask: torch.Tensor | None = None


@dataclass(frozen=True)
class Family:
    """One tiny model family.

    config: class name in comfy.supported_models; unet_config: () -> the toy unet_config;
    video: latent is [B, C, T, H, W] (else [B, C, H, W], or [B, C, 1, H, W] when `frames_dim`);
    extra_conds: (batch, latent shape, seed) -> per-cond extras added to the text context;
    start_frame: image-to-video through the latent: frame 0 holds the (seeded) start image and
    the noise mask keeps it (0 there, 1 elsewhere), as Wan22ImageToVideoLatent and
    HunyuanImageToVideo "v2 (replace)" do;
    text_tokens / text_dim: length and width of the tiny text context; model_class: the
    diffusion model's class (module path, class) whose presence the tests also check; patch:
    the transformer's patch (t, h, w) over the latent;
    audio_tokens: LTX-2's audio latent [B, 8, audio_tokens, 16] sampled with the video (the
    latent a NestedTensor of both, as LTXVConcatAVLatent makes it), 0 for none;
    guides: (latent, noise mask, positive, negative, seed) -> the same after ComfyUI's own
    conditioning node code has added what it adds there (LTXVAddGuide's guide frames,
    WanVaceToVideo's VACE context, Kandinsky5ImageToVideo's start image);
    scale: latent pixels per unit of the sizes `inputs` takes (HiDream-O1 samples pixels, which
    its model cuts into 32-pixel patches without padding: sizes count its patches);
    own_sizes: the config class's unet_extra_config overlays the real widths (Ideogram 4):
    the toy unet_config is put back over them.
    """

    name: str
    config: str
    unet_config: Callable[[], dict[str, Any]]
    model_class: tuple[str, str]
    video: bool = False
    frames_dim: bool = False
    extra_conds: Callable[[int, tuple[int, ...], int], dict[str, Any]] = field(
        default=lambda batch, shape, seed: {})
    start_frame: bool = False
    patch: tuple[int, int, int] = (1, 2, 2)
    text_tokens: int = TEXT_TOKENS
    text_dim: int = TEXT_DIM
    audio_tokens: int = 0
    guides: Callable[..., tuple] | None = None
    scale: int = 1
    own_sizes: bool = False


# Toy unet_configs, in each family's real layout -------------------------------------------------
def _wan(**overrides: Any) -> Callable[[], dict[str, Any]]:
    """Wan: head dim 16 (RoPE axes 16 - 4*2, 2*2, 2*2 = 8, 4, 4), patch (1, 2, 2)."""
    def config() -> dict[str, Any]:
        return {"image_model": "wan2.1", "model_type": "t2v", "patch_size": (1, 2, 2),
                "text_len": 512, "in_dim": 16, "dim": 64, "ffn_dim": 128, "freq_dim": 256,
                "text_dim": TEXT_DIM, "out_dim": 16, "num_heads": 4, "num_layers": 2,
                "window_size": (-1, -1), "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6,
                **overrides}
    return config


def _qwen_image() -> dict[str, Any]:
    """Qwen-Image: patch 2 over 16 channels (in 64), 4 heads of 16, RoPE axes 4+6+6."""
    return {"image_model": "qwen_image", "patch_size": 2, "in_channels": 64, "out_channels": 16,
            "num_layers": 2, "attention_head_dim": 16, "num_attention_heads": 4,
            "joint_attention_dim": TEXT_DIM, "axes_dims_rope": (4, 6, 6)}


def _qwen_image_2511() -> dict[str, Any]:
    """Qwen-Image-Edit 2511: Qwen-Image whose references default to "index_timestep_zero" (what
    ComfyUI's model detection sets from its checkpoint), where this ComfyUI's class has that
    default (0.8 and later)."""
    import comfy.ldm.qwen_image.model as qwen

    known = inspect.signature(qwen.QwenImageTransformer2DModel.__init__).parameters
    return {**_qwen_image(), **({"default_ref_method": TIMESTEP_ZERO}
                                if "default_ref_method" in known else {})}


def _krea2() -> dict[str, Any]:
    """Krea 2: patch 2 over 16 channels, 4 query and 2 key/value heads of 16 (RoPE axes 4+6+6,
    the model's own split of 16), a text fusion of 2 layers of TEXT_DIM (its context
    2 x TEXT_DIM wide, as the Qwen3-VL layers stack)."""
    return {"image_model": "krea2", "features": 64, "heads": 4, "kvheads": 2, "multiplier": 4,
            "layers": 2, "patch": 2, "channels": 16, "txtdim": TEXT_DIM, "txtlayers": 2,
            "txtheads": 2, "txtkvheads": 2}


def _mage_flow() -> dict[str, Any]:
    """Mage-Flow: Qwen-Image's blocks on the 128-channel latent one pixel a token (patch 1),
    4 heads of 16 (RoPE axes 4+6+6)."""
    return {"image_model": "mage_flow", "in_channels": 128, "out_channels": 128,
            "num_layers": 2, "attention_head_dim": 16, "num_attention_heads": 4,
            "joint_attention_dim": TEXT_DIM, "axes_dims_rope": (4, 6, 6)}


def _boogu() -> dict[str, Any]:
    """Boogu-Image: patch 2 over 16 channels, width 64 in 4 query and 2 key/value heads of 16
    (RoPE axes 4+6+6), one refiner of each kind, 2 double- and 2 single-stream blocks."""
    return {"image_model": "boogu", "patch_size": 2, "in_channels": 16, "hidden_size": 64,
            "num_layers": 2, "num_double_stream_layers": 2, "num_refiner_layers": 1,
            "num_attention_heads": 4, "num_kv_heads": 2, "multiple_of": 16,
            "axes_dim_rope": (4, 6, 6), "axes_lens": (256, 256, 256),
            "instruction_feat_dim": TEXT_DIM}


def _omnigen2() -> dict[str, Any]:
    """OmniGen2: Boogu-Image's widths without its double-stream stage."""
    config = {**_boogu(), "image_model": "omnigen2", "text_feat_dim": TEXT_DIM}
    del config["num_double_stream_layers"], config["instruction_feat_dim"]
    return config


def _lens() -> dict[str, Any]:
    """Lens: its 128-channel latent (2x2 patches of 32 channels) at width 64, 4 heads of 16
    (RoPE axes 4+6+6), 2 blocks; the text four encoder layers of TEXT_DIM / 4 side by side."""
    return {"image_model": "lens", "in_channels": 128, "out_channels": 32, "num_layers": 2,
            "attention_head_dim": 16, "num_attention_heads": 4, "enc_hidden_dim": TEXT_DIM // 4,
            "axes_dims_rope": (4, 6, 6)}


def _joyimage() -> dict[str, Any]:
    """JoyImage: patch (1, 2, 2) over 16 channels, width 64 in 4 heads of 16 (RoPE 4+6+6 over
    its config's real [16, 56, 56]: own_sizes), 2 double-stream blocks."""
    return {"image_model": "joyimage", "patch_size": [1, 2, 2], "in_channels": 16,
            "hidden_size": 64, "num_attention_heads": 4, "text_dim": TEXT_DIM, "num_layers": 2,
            "rope_dim_list": [4, 6, 6], "theta": 256}


def _ernie() -> dict[str, Any]:
    """ERNIE-Image: its 128-channel latent one token a pixel (patch 1), width 64 in 4 heads of
    16 (RoPE axes 4+6+6), 2 blocks."""
    return {"image_model": "ernie", "hidden_size": 64, "num_attention_heads": 4, "num_layers": 2,
            "ffn_hidden_size": 128, "in_channels": 128, "out_channels": 128, "patch_size": 1,
            "text_in_dim": TEXT_DIM, "rope_axes_dim": (4, 6, 6)}


def _zero_negative(latent: torch.Tensor, mask: torch.Tensor | None, positive: Conditioning,
                   negative: Conditioning, seed: int) -> tuple:
    """The negative through ComfyUI's ConditioningZeroOut (a turbo template's)."""
    zero_out = comfy_top_level_nodes().ConditioningZeroOut().zero_out
    return latent, mask, positive, zero_out(negative)[0]


def _ideogram4() -> dict[str, Any]:
    """Ideogram 4: the 128-channel latent one pixel a token (its 2x2 patches in the channels),
    width 64 in 4 heads of 16 (interleaved MRoPE sections 4+2+2, half the head as the real
    model's), the text context TEXT_DIM wide."""
    return {"image_model": "ideogram4", "in_channels": 128, "num_layers": 2,
            "num_attention_heads": 4, "attention_head_dim": 16, "intermediate_size": 128,
            "adaln_dim": 32, "llm_features_dim": TEXT_DIM, "rope_theta": 10000,
            "mrope_section": [4, 2, 2], "norm_eps": 1e-5}


def _anima() -> dict[str, Any]:
    """Anima: Cosmos Predict2's blocks at width 64, 4 heads of 16 (3-D RoPE 8+4+4), patch
    (1, 2, 2), AdaLN-LoRA of 16 (the real layout's shape at toy width); its LLM adapter is
    ComfyUI's fixed size (its output, the blocks' context, 1024 wide)."""
    return {"image_model": "anima", "max_img_h": 240, "max_img_w": 240, "max_frames": 128,
            "in_channels": 16, "out_channels": 16, "patch_spatial": 2, "patch_temporal": 1,
            "concat_padding_mask": True, "model_channels": 64, "num_blocks": 2,
            "num_heads": 4, "crossattn_emb_channels": 1024, "pos_emb_cls": "rope3d",
            "pos_emb_learnable": True, "pos_emb_interpolation": "crop", "min_fps": 1,
            "max_fps": 30, "use_adaln_lora": True, "adaln_lora_dim": 16,
            "extra_per_block_abs_pos_emb": False, "rope_h_extrapolation_ratio": 4.0,
            "rope_w_extrapolation_ratio": 4.0, "rope_t_extrapolation_ratio": 1.0}


def _hunyuan_video(**overrides: Any) -> Callable[[], dict[str, Any]]:
    """HunyuanVideo: double + single blocks (Flux's, image first before 0.33), patch [1, 2, 2]."""
    def config() -> dict[str, Any]:
        import comfy.ldm.hunyuan_video.model as hv

        params = {"image_model": "hunyuan_video", "in_channels": 16, "out_channels": 16,
                  "vec_in_dim": POOLED_DIM, "context_in_dim": TEXT_DIM, "hidden_size": 64,
                  "mlp_ratio": 4.0, "num_heads": 4, "depth": 2, "depth_single_blocks": 2,
                  "axes_dim": [4, 6, 6], "theta": 256, "patch_size": [1, 2, 2],
                  "qkv_bias": True, "guidance_embed": True, "byt5": False, "meanflow": False,
                  "use_cond_type_embedding": False, "vision_in_dim": None,
                  "meanflow_sum": False, **overrides}
        return _known_fields(params, hv.HunyuanVideoParams, keep=("image_model",))
    return config


def _hidream() -> dict[str, Any]:
    """HiDream-I1: patch 2 over the Flux 16-channel latent, 4 heads of 16 (RoPE axes 8+4+4,
    the real 64+32+32 scaled), MoE feed-forward of 4 experts (2 active), 2 double and 2 single
    blocks taking Llama layers 0, 1, 2, 2 (the real model's 48 blocks take layers 0-31, the
    last repeated), T5 and Llama states TEXT_DIM wide."""
    return {"image_model": "hidream", "patch_size": 2, "in_channels": 16, "out_channels": 16,
            "num_layers": 2, "num_single_layers": 2, "attention_head_dim": 16,
            "num_attention_heads": 4, "caption_channels": [TEXT_DIM, TEXT_DIM],
            "text_emb_dim": POOLED_DIM, "num_routed_experts": 4, "num_activated_experts": 2,
            "axes_dims_rope": [8, 4, 4], "max_resolution": [128, 128],
            "llama_layers": [0, 1, 2, 2]}


def _hidream_o1() -> dict[str, Any]:
    """HiDream-O1 (ComfyUI 0.33 and later): a Qwen3-VL decoder of 2 layers, 4 query and 2
    key/value heads of 16 (interleaved MRoPE 4+2+2), over [prompt; image] in 32-pixel patches;
    the real vocabulary (the prompt ends in its tms token, where the timestep goes) and a
    one-layer vision tower (edits only)."""
    return {"image_model": "hidream_o1",
            "text_config_overrides": {"hidden_size": 64,
                                      "intermediate_size": 128, "num_hidden_layers": 2,
                                      "num_attention_heads": 4, "num_key_value_heads": 2,
                                      "head_dim": 16, "rope_dims": [4, 2, 2]},
            "vision_config_overrides": {"hidden_size": 32, "num_heads": 2,
                                        "intermediate_size": 64, "depth": 1,
                                        "num_position_embeddings": 16,
                                        "deepstack_visual_indexes": ()}}


def _mmdit(qk_norm: str | None, x_block_self_attn_layers: list[int]) -> Callable[[], dict]:
    """SD3 MMDiT: depth 2 -> width 128, 2 heads of 64 (the class fixes head size 64); learned
    position table for up to 16x16 patches, i.e. latents up to 32x32 (SD3's
    pos_embed_max_size, 192 in the real model)."""
    def config() -> dict[str, Any]:
        return {"in_channels": 16, "out_channels": 16, "patch_size": 2, "depth": 2,
                "input_size": None, "adm_in_channels": POOLED_DIM,
                "context_embedder_config": {"target": "torch.nn.Linear",
                                            "params": {"in_features": TEXT_DIM,
                                                       "out_features": 128}},
                "num_patches": 16 * 16, "pos_embed_max_size": 16, "pos_embed_scaling_factor": None,
                "qk_norm": qk_norm, "x_block_self_attn_layers": x_block_self_attn_layers}
    return config


def _lumina(**overrides: Any) -> Callable[[], dict[str, Any]]:
    """Lumina 2 / Z-Image NextDiT: patch 2, 4 heads of 16 (RoPE axes 4+6+6)."""
    def config() -> dict[str, Any]:
        import comfy.ldm.lumina.model as lumina

        params = {"image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 64,
                  "n_layers": 2, "n_refiner_layers": 1, "n_heads": 4, "n_kv_heads": 2,
                  "qk_norm": True, "cap_feat_dim": TEXT_DIM, "axes_dims": [4, 6, 6],
                  "axes_lens": [300, 512, 512], "rope_theta": 10000.0,
                  "ffn_dim_multiplier": 4.0, **overrides}
        # v0.3.64's NextDiT has no rope_theta (fixed 10000 there, the value used here); the
        # Z-Image overrides must all exist.
        known = set(inspect.signature(lumina.NextDiT.__init__).parameters) | {"image_model"}
        missing = [k for k in overrides if k not in known]
        if missing:
            raise ValueError(f"this ComfyUI's NextDiT has no {missing}")
        return {k: v for k, v in params.items() if k in known}
    return config


def _flux_like(model: str, **params: Any) -> Callable[[], dict[str, Any]]:
    """Flux 2 / Chroma: fields filtered by the params dataclass, which grows across versions."""
    def config() -> dict[str, Any]:
        if model == "chroma_radiance":
            import comfy.ldm.chroma_radiance.model as radiance

            fields_of = radiance.ChromaRadianceParams
        elif model == "chroma":
            import comfy.ldm.chroma.model as chroma

            fields_of = chroma.ChromaParams
        else:
            import comfy.ldm.flux.model as flux

            fields_of = flux.FluxParams
        return _known_fields({"image_model": model, **params}, fields_of, keep=("image_model",))
    return config


def _known_fields(params: dict[str, Any], dataclass_type: type,
                  keep: tuple[str, ...] = ()) -> dict[str, Any]:
    """params restricted to `dataclass_type`'s fields (plus `keep`): older ComfyUI versions have
    fewer fields, and their dataclasses reject unknown ones."""
    names = {f.name for f in dataclasses.fields(dataclass_type)} | set(keep)
    return {k: v for k, v in params.items() if k in names}


def _ltxv() -> dict[str, Any]:
    """LTX-Video: 128-ch latent, 1x1x1 patches, 4 heads of 16 (RoPE over t, h, w: 10 of the
    64 channels per axis, 4 padding), text projected from TEXT_DIM."""
    return {"image_model": "ltxv", "in_channels": 128, "cross_attention_dim": 64,
            "attention_head_dim": 16, "num_attention_heads": 4, "caption_channels": TEXT_DIM,
            "num_layers": 2}


def _ltx2() -> dict[str, Any]:
    """LTX-2 (LTXAVModel): the video side as _ltxv, an audio side of 4 heads of 8 (audio latent
    8 channels x 16 frequency bins = 128 in), the text context [video; audio] halves of
    TEXT_DIM each; ComfyUI 0.33's text connectors at toy size (unused: the context comes
    processed, 2 x TEXT_DIM wide)."""
    return {**_ltxv(), "image_model": "ltxav", "audio_in_channels": 128,
            "audio_cross_attention_dim": 32, "audio_attention_head_dim": 8,
            "audio_num_attention_heads": 4, "connector_attention_head_dim": 8,
            "connector_num_attention_heads": 2, "connector_num_layers": 1}


def _ltx_guide(latent: torch.Tensor, mask: torch.Tensor | None, positive: Any, negative: Any,
               seed: int) -> tuple:
    """LTXVAddGuide at frame_idx 0, strength 1 with one latent frame of guide (seeded): ComfyUI's
    own append_keyframe appends it to the latent after the video, with mask 0 there and its
    token positions in the conditioning's keyframe_idxs."""
    import comfy_harness

    comfy_harness.comfy_top_level_nodes()
    from comfy_extras.nodes_lt import LTXVAddGuide, get_noise_mask

    guide = _randn(latent.shape[0], latent.shape[1], 1, *latent.shape[3:], seed=seed + 11)
    noise_mask = get_noise_mask({"samples": latent} if mask is None else
                                {"samples": latent, "noise_mask": mask})
    positive, negative, latent, noise_mask = LTXVAddGuide.append_keyframe(
        positive, negative, 0, latent, noise_mask, guide, 1.0, (8, 32, 32))
    return latent, noise_mask, positive, negative


def _timestep_zero_reference(latent: torch.Tensor, mask: torch.Tensor | None, positive: Any,
                             negative: Any, seed: int) -> tuple:
    """ReferenceLatent with a seeded latent of another size than the output (its tokens after
    the image's), then Edit Model Reference Method (FluxKontextMultiReferenceLatentMethod)
    "index_timestep_zero" on both conditionings: ComfyUI's own nodes, as the Krea 2 style
    reference template uses them."""
    import comfy_harness

    comfy_harness.comfy_top_level_nodes()
    from comfy_extras.nodes_edit_model import ReferenceLatent
    from comfy_extras.nodes_flux import FluxKontextMultiReferenceLatentMethod

    h, w = latent.shape[-2:]
    ref = _randn(1, *latent.shape[1:-2], h + 2, max(w - 2, 2), seed=seed + 9)
    out = []
    for cond in (positive, negative):
        cond = ReferenceLatent.execute(cond, {"samples": ref})
        cond = cond.result[0] if hasattr(cond, "result") else cond[0]
        cond = FluxKontextMultiReferenceLatentMethod.execute(cond, TIMESTEP_ZERO)
        out.append(cond.result[0] if hasattr(cond, "result") else cond[0])
    return latent, mask, out[0], out[1]


class _StubImageVAE:
    """An image VAE's encode: pixels [N, H, W, 3] -> latent [N, channels, H / f, W / f], f x f
    means through a fixed random projection."""

    def __init__(self, channels: int, factor: int, seed: int) -> None:
        self.projection, self.factor = _randn(channels, 3, seed=seed), factor

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        cells = torch.nn.functional.avg_pool2d(pixels.movedim(-1, 1).float(), self.factor)
        return torch.einsum("oc,nchw->nohw", self.projection, cells - 0.5) * 4


class _GivenClip:
    """A text encoder handing back given conditionings: `positive` for the prompt "positive",
    `negative` for any other (the images a node tokenizes with the prompt are not read)."""

    def __init__(self, positive: Any, negative: Any) -> None:
        self.positive, self.negative = positive, negative

    def tokenize(self, text: str, images: Any = None, **kwargs: Any) -> str:
        return text

    def encode_from_tokens_scheduled(self, tokens: str) -> Any:
        return self.positive if tokens == "positive" else self.negative


def _mage_flow_edit(latent: torch.Tensor, mask: torch.Tensor | None, positive: Any,
                    negative: Any, seed: int) -> tuple:
    """TextEncodeMageFlowEdit with two seeded reference images of other sizes than the output
    (width and height the latent's): ComfyUI's own node resizes them to the output, encodes
    them and appends them as reference_latents to both conditionings."""
    import comfy_harness

    comfy_harness.comfy_top_level_nodes()
    from comfy_extras.nodes_mage import TextEncodeMageFlowEdit

    h, w = latent.shape[-2:]
    images = {"image_1": _pixels(1, 2 * h + 2, 2 * w, seed + 13),
              "image_2": _pixels(1, 2 * h, 2 * w + 4, seed + 14)}
    out = _node_output(TextEncodeMageFlowEdit.execute(
        _GivenClip(positive, negative), "positive", "negative", _StubImageVAE(128, 16, seed + 12),
        images, w * 16, h * 16, latent.shape[0]))
    assert out[2]["samples"].shape == latent.shape
    return latent, mask, out[0], out[1]


def _anima_text(latent: torch.Tensor, mask: torch.Tensor | None, positive: Any, negative: Any,
                seed: int) -> tuple:
    """Anima's conditioning as CLIPTextEncode hands it from Anima's text encoder: the Qwen3
    0.6B states [1, L, 1024] with the prompt's T5 token ids and weights (seeded ids, weights
    1), which ComfyUI's Anima runs through its LLM adapter into the blocks' context."""
    out = []
    for offset, cond in enumerate((positive, negative)):
        generator = torch.Generator().manual_seed(seed + 20 + offset)
        ids = torch.randint(1, 32128, (TEXT_TOKENS + 2,), generator=generator, dtype=torch.int)
        context, extras = cond[0]
        out.append([[context[:1], {**extras, "t5xxl_ids": ids,
                                   "t5xxl_weights": torch.ones(TEXT_TOKENS + 2)}]])
    return latent, mask, out[0], out[1]


def _kandinsky5(**overrides: Any) -> Callable[[], dict[str, Any]]:
    """Kandinsky 5: patch (1, 2, 2), 4 heads of 16 (RoPE axes 4+6+6), one text block; the video
    model's input is 16 latent + 16 image + 1 mask channels (33 x 4 = 132 per patch, the real
    visual_embed_dim), the image model's 16 (64)."""
    def config() -> dict[str, Any]:
        return {"image_model": "kandinsky5", "in_visual_dim": 16, "out_visual_dim": 16,
                "in_text_dim": TEXT_DIM, "in_text_dim2": POOLED_DIM, "time_dim": 32,
                "model_dim": 64, "ff_dim": 128, "visual_embed_dim": 132,
                "patch_size": (1, 2, 2), "num_text_blocks": 1, "num_visual_blocks": 2,
                "axes_dims": (4, 6, 6), **overrides}
    return config


class _StubVAE:
    """A video VAE's encode for ComfyUI's conditioning nodes: pixels [N, H, W, 3] -> latent
    [1, 16, (N - 1) // 4 + 1, H / 8, W / 8], every 4th frame's 8 x 8 means through a fixed
    random projection (deterministic, and different images give different latents)."""

    latent_channels = 16

    def __init__(self, seed: int) -> None:
        self.projection = _randn(16, 3, seed=seed)

    def spacial_compression_encode(self) -> int:
        return 8

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        frames = pixels[::4].movedim(-1, 1).float()                       # [F, 3, H, W]
        cells = torch.nn.functional.avg_pool2d(frames, 8)                 # [F, 3, h, w]
        latent = torch.einsum("oc,fchw->ofhw", self.projection, cells - 0.5) * 4
        return latent.unsqueeze(0)


def _pixels(frames: int, height: int, width: int, seed: int) -> torch.Tensor:
    """Seeded images [frames, height * 8, width * 8, 3] in [0, 1] for a latent's size."""
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(frames, height * 8, width * 8, 3, generator=generator)


def _kandinsky5_start(latent: torch.Tensor, mask: torch.Tensor | None, positive: Any,
                      negative: Any, seed: int) -> tuple:
    """Kandinsky5ImageToVideo with a start image (seeded): ComfyUI's own node sets its latent
    as time_dim_replace (written over frame 0 of the input) and concat_mask (0 there)."""
    import comfy_harness

    comfy_harness.comfy_top_level_nodes()
    from comfy_extras.nodes_kandinsky5 import Kandinsky5ImageToVideo

    batch, _, frames, h, w = latent.shape
    out = Kandinsky5ImageToVideo.execute(
        positive, negative, _StubVAE(seed + 12), w * 8, h * 8, (frames - 1) * 4 + 1, batch,
        start_image=_pixels(1, h, w, seed + 13)).result
    positive, negative, empty = out[0], out[1], out[2]["samples"]
    assert empty.shape == latent.shape
    return latent, mask, positive, negative


def _wan_vace(reference: bool) -> Callable[..., tuple]:
    """WanVaceToVideo with a seeded control video (no control mask), strength 1, and with
    `reference` a reference image: ComfyUI's own node builds the VACE frames, mask and
    strength; with a reference its latent has one frame more in front (the test's frames
    count it: the control video covers the others), the VACE mask 0 there."""
    def guides(latent: torch.Tensor, mask: torch.Tensor | None, positive: Any, negative: Any,
               seed: int) -> tuple:
        import comfy_harness

        comfy_harness.comfy_top_level_nodes()
        from comfy_extras.nodes_wan import WanVaceToVideo

        batch, _, frames, h, w = latent.shape
        video = frames - 1 if reference else frames
        out = WanVaceToVideo.execute(
            positive, negative, _StubVAE(seed + 12), w * 8, h * 8, (video - 1) * 4 + 1, batch,
            1.0, control_video=_pixels((video - 1) * 4 + 1, h, w, seed + 13),
            reference_image=_pixels(1, h, w, seed + 14) if reference else None).result
        assert out[2]["samples"].shape == latent.shape
        return latent, mask, out[0], out[1]
    return guides


def _wan_camera(start_image: bool) -> Callable[..., tuple]:
    """WanCameraEmbedding ("Pan Left") into WanCameraImageToVideo, with `start_image` a seeded
    start image: ComfyUI's own nodes build the camera embedding [1, 24, T, H * 8, W * 8] and
    the start image's concat_latent_image and concat_mask (Camera 2.1 concatenates the image
    latent alone, Camera 2.2 the mask in front of it)."""
    def guides(latent: torch.Tensor, mask: torch.Tensor | None, positive: Any, negative: Any,
               seed: int) -> tuple:
        import comfy_harness

        comfy_harness.comfy_top_level_nodes()
        from comfy_extras.nodes_camera_trajectory import WanCameraEmbedding
        from comfy_extras.nodes_wan import WanCameraImageToVideo

        batch, _, frames, h, w = latent.shape
        length = (frames - 1) * 4 + 1
        camera = WanCameraEmbedding.execute("Pan Left", w * 8, h * 8, length).result[0]
        out = WanCameraImageToVideo.execute(
            positive, negative, _StubVAE(seed + 12), w * 8, h * 8, length, batch,
            start_image=_pixels(1, h, w, seed + 13) if start_image else None,
            camera_conditions=camera).result
        assert out[2]["samples"].shape == latent.shape
        return latent, mask, out[0], out[1]
    return guides


def wan_animate_guides(face_frames: int = 0, continue_motion: bool = False
                       ) -> Callable[..., tuple]:
    """WanAnimateToVideo with a seeded reference image and pose video, `face_frames` frames of
    a seeded face video (its motion encoder is a full-size network at 512 x 512: the family
    runs without one, the face adapter's test with one), and with `continue_motion` one frame
    of a previous chunk to continue from: ComfyUI's own node puts the reference frame in front
    of the latent (the test's frames count it), its concat mask 0 there and on the latent frame
    the continued motion fills, and hands the pose latents to every frame after the reference."""
    def guides(latent: torch.Tensor, mask: torch.Tensor | None, positive: Any, negative: Any,
               seed: int) -> tuple:
        import comfy_harness

        comfy_harness.comfy_top_level_nodes()
        from comfy_extras.nodes_wan import WanAnimateToVideo

        batch, _, frames, h, w = latent.shape
        length = (frames - 2) * 4 + 1
        face = _pixels(face_frames, 64, 64, seed + 15) if face_frames else None
        out = WanAnimateToVideo.execute(
            positive, negative, _StubVAE(seed + 12), w * 8, h * 8, length, batch, 5, 0,
            reference_image=_pixels(1, h, w, seed + 13),
            pose_video=_pixels(length, h, w, seed + 14), face_video=face,
            continue_motion=_pixels(1, h, w, seed + 16) if continue_motion else None).result
        assert out[2]["samples"].shape == latent.shape
        return latent, mask, out[0], out[1]
    return guides


def wan_scail_guides(masks: bool) -> Callable[..., tuple]:
    """WanSCAILToVideo with a seeded reference image, pose video and CLIP-vision output, and
    with `masks` (SCAIL-2's replacement mode, as its templates run it) a pose video mask and a
    reference image mask: ComfyUI's own node hands the reference latent (put in front of the
    video in time), the pose latents at half the video's size (their tokens after the video)
    and, with masks, SCAIL-2's identity mask streams."""
    def guides(latent: torch.Tensor, mask: torch.Tensor | None, positive: Any, negative: Any,
               seed: int) -> tuple:
        import comfy_harness

        comfy_harness.comfy_top_level_nodes()
        from comfy_extras.nodes_scail import WanSCAILToVideo

        batch, _, frames, h, w = latent.shape
        length = (frames - 1) * 4 + 1
        clip = _clip_vision("penultimate_hidden_states", CLIP_VISION_TOKENS, CLIP_VISION_DIM,
                            1, seed + 17)
        shown = (lambda n, s: _pixels(n, h, w, s)) if masks else (lambda n, s: None)
        out = WanSCAILToVideo.execute(
            positive, negative, _StubVAE(seed + 12), w * 8, h * 8, length, batch, 1.0, 0.0,
            1.0, 0, 5, replacement_mode=masks, reference_image=_pixels(1, h, w, seed + 13),
            clip_vision_output=clip, pose_video=_pixels(length, h, w, seed + 14),
            pose_video_mask=shown(length, seed + 15),
            reference_image_mask=shown(1, seed + 16)).result
        assert out[2]["samples"].shape == latent.shape
        return latent, mask, out[0], out[1]
    return guides


def _wan_fun_control(latent: torch.Tensor, mask: torch.Tensor | None, positive: Any,
                     negative: Any, seed: int) -> tuple:
    """Wan22FunControlToVideo with a seeded control video and reference image: ComfyUI's own
    node concatenates the control latent, the mask (all 1: nothing given) and an empty image
    latent (concat_mask_index 16), and hands the reference image's latent to the model's
    ref_conv, whose tokens go in front of the video."""
    import comfy_harness

    comfy_harness.comfy_top_level_nodes()
    from comfy_extras.nodes_wan import Wan22FunControlToVideo

    batch, _, frames, h, w = latent.shape
    length = (frames - 1) * 4 + 1
    out = Wan22FunControlToVideo.execute(
        positive, negative, _StubVAE(seed + 12), w * 8, h * 8, length, batch,
        ref_image=_pixels(1, h, w, seed + 13), control_video=_pixels(length, h, w, seed + 14))
    out = out.result if hasattr(out, "result") else out
    assert out[2]["samples"].shape == latent.shape
    return latent, mask, out[0], out[1]


# Conditioning extras ----------------------------------------------------------------------------
def _clip_vision(attribute: str, tokens: int, dim: int, batch: int, seed: int) -> Any:
    import comfy.clip_vision

    output = comfy.clip_vision.Output()
    output[attribute] = _randn(batch, tokens, dim, seed=seed)
    return output


def _wan21_i2v(batch: int, shape: tuple[int, ...], seed: int) -> dict[str, Any]:
    """WanImageToVideo: start image latent in frame 0 (concat_latent_image), concat_mask 0 there
    (= keep), and the CLIP-vision output of the start image (cross-attention only)."""
    return {**_wan_concat(batch, shape, seed),
            "clip_vision_output": _clip_vision("penultimate_hidden_states", CLIP_VISION_TOKENS,
                                               CLIP_VISION_DIM, batch, seed + 7)}


def _wan_dancer(batch: int, shape: tuple[int, ...], seed: int) -> dict[str, Any]:
    """WanDancerVideo's conditioning: WanImageToVideo's (start image, concat_mask, CLIP vision)
    and the music features [1, frames, 35] with their fps (WanDancerEncodeAudio's output)."""
    return {**_wan21_i2v(batch, shape, seed), "audio_embed": _randn(1, 12, 35, seed=seed + 11),
            "fps": 30}


def _wan_concat(batch: int, shape: tuple[int, ...], seed: int) -> dict[str, Any]:
    """concat_latent_image [B, 16, T, H, W] with the start image in frame 0, zeros after;
    concat_mask [1, 1, T, H, W]: 0 on the start frame, 1 elsewhere (WanImageToVideo's)."""
    _, _, frames, h, w = shape
    image = torch.zeros(batch, 16, frames, h, w)
    image[:, :, :1] = _randn(batch, 16, 1, h, w, seed=seed + 5)
    mask = torch.ones(1, 1, frames, h, w)
    mask[:, :, :1] = 0.0
    return {"concat_latent_image": image, "concat_mask": mask}


def _flux_reference(batch: int, shape: tuple[int, ...], seed: int) -> dict[str, Any]:
    """TextEncodeQwenImageEdit's reference latent for a Flux-class model (LongCat-Image Edit):
    one [1, C, h, w] of another size than the output, appended after the image tokens."""
    h, w = shape[-2], shape[-1]
    return {"reference_latents": [_randn(1, shape[1], h + 2, max(w - 2, 2), seed=seed + 9)]}


def _qwen_edit(batch: int, shape: tuple[int, ...], seed: int) -> dict[str, Any]:
    """TextEncodeQwenImageEdit / ReferenceLatent: one reference latent [1, 16, 1, h, w] of a
    different size than the output (Qwen appends its tokens after the image tokens)."""
    h, w = shape[-2], shape[-1]
    return {"reference_latents": [_randn(1, 16, 1, h + 2, max(w - 2, 2), seed=seed + 9)]}


def _boogu_edit(batch: int, shape: tuple[int, ...], seed: int) -> dict[str, Any]:
    """TextEncodeBooguEdit's conditioning: the text's attention mask, and one reference latent
    [1, 16, h, w] of another size than the output (its tokens in front of the image's).
    Smaller than the node's own (which scales the image to about 1 Mpx): a tiny model on the
    CPU."""
    h, w = shape[-2], shape[-1]
    return {**_text_mask(batch, shape, seed),
            "reference_latents": [_randn(1, 16, h + 2, max(w - 2, 2), seed=seed + 9)]}


def _padded_text_mask(batch: int, shape: tuple[int, ...], seed: int) -> dict[str, Any]:
    """A text encoder's attention mask [1, L] whose last two tokens are padding (0): Ideogram
    4 puts them in an attention segment of their own (its blocks' mask)."""
    mask = torch.ones(1, TEXT_TOKENS, dtype=torch.long)
    mask[:, -2:] = 0
    return {"attention_mask": mask}


def _joyimage_edit(batch: int, shape: tuple[int, ...], seed: int) -> dict[str, Any]:
    """TextEncodeJoyImageEdit's conditioning: one reference latent [1, 16, 1, h, w] of another
    size than the output (its tokens after the image's)."""
    h, w = shape[-2], shape[-1]
    return {"reference_latents": [_randn(1, 16, 1, h + 2, max(w - 2, 2), seed=seed + 9)]}


def _hunyuan_i2v_concat(batch: int, shape: tuple[int, ...], seed: int) -> dict[str, Any]:
    """HunyuanImageToVideo "v1 (concat)": start image latent and concat_mask (0 on frame 0)."""
    return {**_pooled(batch, shape, seed), **_wan_concat(batch, shape, seed)}


def _hunyuan_i2v_replace(batch: int, shape: tuple[int, ...], seed: int) -> dict[str, Any]:
    """HunyuanImageToVideo "v2 (replace)": guiding_frame_index 0 (frame 0's tokens get their
    own modulation through modulation_dims); the start image is in the latent."""
    return {**_pooled(batch, shape, seed), "guiding_frame_index": 0}


def _hunyuan15(batch: int, shape: tuple[int, ...], seed: int) -> dict[str, Any]:
    """HunyuanVideo 1.5 image-to-video: start image latent (32 ch) in frame 0, SigLIP vision
    states (prepended to the text tokens) and ByT5 glyph tokens."""
    _, channels, frames, h, w = shape
    image = torch.zeros(batch, channels, frames, h, w)
    image[:, :, :1] = _randn(batch, channels, 1, h, w, seed=seed + 5)
    return {"concat_latent_image": image,
            "clip_vision_output": _clip_vision("last_hidden_state", 9, SIGLIP_DIM, batch, seed + 7),
            "conditioning_byt5small": _randn(batch, 5, BYT5_DIM, seed=seed + 8)}


def _hunyuan_image(batch: int, shape: tuple[int, ...], seed: int) -> dict[str, Any]:
    """HunyuanImage 2.1's text encoder output: ByT5 glyph tokens with the Qwen2.5-VL context
    (ComfyUI appends them to the refined text)."""
    return {"conditioning_byt5small": _randn(batch, 5, BYT5_DIM, seed=seed + 8)}


def _hidream_llama(batch: int, shape: tuple[int, ...], seed: int) -> dict[str, Any]:
    """HiDream's text encoders: pooled CLIP-L + CLIP-G output and the Llama 3.1 hidden states
    of every layer [B, layers, L, C] (conditioning_llama3; 3 layers of HIDREAM_LLAMA_TOKENS),
    the T5 states being the context."""
    return {**_pooled(batch, shape, seed),
            "conditioning_llama3": _randn(batch, 3, HIDREAM_LLAMA_TOKENS, TEXT_DIM,
                                          seed=seed + 6)}


def _hidream_o1_prompt(batch: int, shape: tuple[int, ...], seed: int) -> dict[str, Any]:
    """HiDream-O1's text encoder output: the prompt's token ids [1, HIDREAM_O1_PROMPT] (seeded),
    ending in the tms token as its chat template does; the model makes its own conditioning
    from them."""
    from comfy.text_encoders.hidream_o1 import TMS_TOKEN_ID

    ids = torch.randint(1000, 2000, (1, HIDREAM_O1_PROMPT),
                        generator=torch.Generator().manual_seed(seed))
    ids[0, -1] = TMS_TOKEN_ID
    return {"text_input_ids": ids}


def _hidream_o1_edit(batch: int, shape: tuple[int, ...], seed: int) -> dict[str, Any]:
    """HiDream-O1 Reference Images with one image of the target's size (seeded pixels
    [1, H, W, 3]): its ViT tokens join the prompt, its 32-pixel patches follow the image."""
    image = torch.rand(1, shape[-2], shape[-1], 3, generator=torch.Generator().manual_seed(seed))
    return {**_hidream_o1_prompt(batch, shape, seed), "reference_latents": [image]}


def _text_mask(batch: int, shape: tuple[int, ...], seed: int) -> dict[str, Any]:
    """Lumina 2 / Z-Image and LTX-Video text encoders hand over their attention mask [1, L]
    (1 = token); a single prompt has no padding. v0.3.64's Lumina needs it (num_tokens comes
    from it), every version's LTX-Video (its forward takes it)."""
    return {"attention_mask": torch.ones(1, TEXT_TOKENS, dtype=torch.long)}


def _pooled(batch: int, shape: tuple[int, ...], seed: int) -> dict[str, Any]:
    return {"pooled_output": _randn(batch, POOLED_DIM, seed=seed + 1)}


# The families -----------------------------------------------------------------------------------
_FLUX2 = {"in_channels": 128, "out_channels": 128, "vec_in_dim": None,
          "context_in_dim": TEXT_DIM, "hidden_size": 64, "mlp_ratio": 3.0, "num_heads": 4,
          "depth": 2, "depth_single_blocks": 2, "axes_dim": [4, 4, 4, 4], "theta": 2000,
          "patch_size": 1, "qkv_bias": False, "guidance_embed": True, "txt_ids_dims": [3],
          "global_modulation": True, "mlp_silu_act": True, "ops_bias": False,
          "default_ref_method": "index", "ref_index_scale": 10.0}
# LongCat-Image (ComfyUI's LongCatImage: Flux's class without guidance or pooled vector, text
# positions along both image axes) and Ovis-Image (Flux's class with the gated MLP and text
# norm of its checkpoint's detection), tiny
_LONGCAT = {"in_channels": 16, "out_channels": 16, "vec_in_dim": None,
            "context_in_dim": TEXT_DIM, "hidden_size": 64, "mlp_ratio": 4.0, "num_heads": 4,
            "depth": 2, "depth_single_blocks": 2, "axes_dim": [4, 6, 6], "theta": 10000,
            "patch_size": 2, "qkv_bias": True, "guidance_embed": False, "txt_ids_dims": [1, 2]}
_OVIS = {**_LONGCAT, "yak_mlp": True, "txt_norm": True}
_CHROMA = {"in_channels": 64, "out_channels": 64, "context_in_dim": TEXT_DIM, "hidden_size": 64,
           "mlp_ratio": 4.0, "num_heads": 4, "depth": 2, "depth_single_blocks": 2,
           "axes_dim": [4, 6, 6], "theta": 10000, "patch_size": 2, "qkv_bias": True,
           "in_dim": 64, "out_dim": 64, "hidden_dim": 64, "n_layers": 2, "txt_ids_dims": [],
           "vec_in_dim": None}

# Chroma Radiance: Chroma on 16-pixel patches of the image (3 channels), a NeRF head of one
# layer, untiled
_CHROMA_RADIANCE = {**_CHROMA, "in_channels": 3, "out_channels": 3, "patch_size": 16,
                    "nerf_hidden_size": 16, "nerf_mlp_ratio": 2, "nerf_depth": 1,
                    "nerf_max_freqs": 4, "nerf_tile_size": 0, "nerf_final_head_type": "linear",
                    "nerf_embedder_dtype": None, "use_x0": False,
                    "use_sequential_txt_ids": False}

_WAN = ("comfy.ldm.wan.model", "WanModel")
_HV = ("comfy.ldm.hunyuan_video.model", "HunyuanVideo")
_LUMINA = ("comfy.ldm.lumina.model", "NextDiT")
_MMDIT = ("comfy.ldm.modules.diffusionmodules.mmdit", "OpenAISignatureMMDITWrapper")
_QWEN = ("comfy.ldm.qwen_image.model", "QwenImageTransformer2DModel")
_LTXV = ("comfy.ldm.lightricks.model", "LTXVModel")
_LTXAV = ("comfy.ldm.lightricks.av_model", "LTXAVModel")
_VACE = ("comfy.ldm.wan.model", "VaceWanModel")
_CAMERA = ("comfy.ldm.wan.model", "CameraWanModel")
_K5 = ("comfy.ldm.kandinsky5.model", "Kandinsky5")
_ANIMATE = ("comfy.ldm.wan.model_animate", "AnimateWanModel")
_SCAIL = ("comfy.ldm.wan.model", "SCAILWanModel")
_SCAIL2 = ("comfy.ldm.wan.model", "SCAIL2WanModel")
_KREA2 = ("comfy.ldm.krea2.model", "SingleStreamDiT")
_MAGE_FLOW = ("comfy.ldm.mage_flow.model", "MageFlowTransformer2DModel")
_ANIMA = ("comfy.ldm.anima.model", "Anima")
_BOOGU = ("comfy.ldm.boogu.model", "BooguTransformer2DModel")
_IDEOGRAM4 = ("comfy.ldm.ideogram4.model", "Ideogram4Transformer2DModel")
_OMNIGEN2 = ("comfy.ldm.omnigen.omnigen2", "OmniGen2Transformer2DModel")
_LENS = ("comfy.ldm.lens.model", "LensTransformer2DModel")
_DANCER = ("comfy.ldm.wan.model_wandancer", "WanDancerModel")
_JOYIMAGE = ("comfy.ldm.joyimage.model", "JoyImageTransformer3DModel")
_ERNIE = ("comfy.ldm.ernie.model", "ErnieImageModel")

FAMILIES: dict[str, Family] = {f.name: f for f in (
    # Wan 2.1 text-to-video; also the Wan 2.2 A14B text-to-video layout (16-ch latent).
    Family("wan21_t2v", "WAN21_T2V", _wan(), _WAN, video=True),
    # Wan 2.1 image-to-video: 36 input channels (16 noise + 4 mask + 16 image) + CLIP vision.
    Family("wan21_i2v", "WAN21_I2V", _wan(model_type="i2v", in_dim=36), _WAN, video=True,
           extra_conds=_wan21_i2v),
    # Wan 2.2 A14B image-to-video: 36 input channels, no CLIP vision (model_type t2v).
    Family("wan22_14b_i2v", "WAN21_T2V", _wan(in_dim=36), _WAN, video=True,
           extra_conds=_wan_concat),
    # Wan 2.2 TI2V 5B: 48-ch latent (/16 spatial), patch 1x2x2; text-to-video ...
    Family("wan22_5b", "WAN22_T2V", _wan(in_dim=48, out_dim=48), _WAN, video=True),
    # ... and image-to-video: the start frame stays clean through the noise mask.
    Family("wan22_5b_i2v", "WAN22_T2V", _wan(in_dim=48, out_dim=48), _WAN, video=True,
           start_frame=True),
    Family("qwen_image", "QwenImage", _qwen_image, _QWEN, frames_dim=True),
    Family("qwen_image_edit", "QwenImage", _qwen_image, _QWEN, frames_dim=True,
           extra_conds=_qwen_edit),
    Family("qwen_image_edit_2511", "QwenImage", _qwen_image_2511, _QWEN, frames_dim=True,
           extra_conds=_qwen_edit),
    Family("hunyuan_video", "HunyuanVideo", _hunyuan_video(), _HV, video=True,
           extra_conds=_pooled),
    # HunyuanVideo image-to-video: 33 inputs (16 noise + 16 image + 1 mask), "v1 (concat)" ...
    Family("hunyuan_video_i2v", "HunyuanVideoI2V", _hunyuan_video(in_channels=33), _HV,
           video=True, extra_conds=_hunyuan_i2v_concat),
    # ... and "v2 (replace)". Without guidance_embed: ComfyUI adds guidance_in's [B, C] to the
    # [B, 2, C] vec of guiding_frame_index, which fails for B > 2 (e.g. batch 2 with CFG).
    Family("hunyuan_video_i2v_v2", "HunyuanVideoI2V",
           _hunyuan_video(in_channels=33, guidance_embed=False), _HV, video=True,
           extra_conds=_hunyuan_i2v_replace, start_frame=True),
    # HunyuanVideo 1.5: 32-ch latent, patch 1x1x1, 65 inputs (32 noise + 32 image + 1 mask),
    # no pooled vector (vector_in None).
    Family("hunyuan_video15", "HunyuanVideo15",
           _hunyuan_video(in_channels=65, out_channels=32, vec_in_dim=None,
                          patch_size=[1, 1, 1], guidance_embed=False, byt5=True,
                          use_cond_type_embedding=True, vision_in_dim=SIGLIP_DIM,
                          meanflow_sum=True),
           _HV, video=True, extra_conds=_hunyuan15, patch=(1, 1, 1)),
    # HunyuanImage 2.1: HunyuanVideo's class with 2-D patches (1x1 over a 64-ch latent, RoPE
    # over h and w), ByT5 glyph tokens, no pooled vector.
    Family("hunyuan_image", "HunyuanImage21",
           _hunyuan_video(in_channels=64, out_channels=64, vec_in_dim=None, patch_size=[1, 1],
                          axes_dim=[8, 8], byt5=True),
           _HV, extra_conds=_hunyuan_image, patch=(1, 1, 1)),
    Family("hidream", "HiDream", _hidream,
           ("comfy.ldm.hidream.model", "HiDreamImageTransformer2DModel"),
           extra_conds=_hidream_llama),
    # HiDream-O1: pixels [B, 3, H, W] in 32-pixel patches, the prompt's ids as conditioning.
    Family("hidream_o1", "HiDreamO1", _hidream_o1,
           ("comfy.ldm.hidream_o1.model", "HiDreamO1Transformer"), patch=(1, 32, 32),
           extra_conds=_hidream_o1_prompt, scale=32),
    Family("hidream_o1_edit", "HiDreamO1", _hidream_o1,
           ("comfy.ldm.hidream_o1.model", "HiDreamO1Transformer"), patch=(1, 32, 32),
           extra_conds=_hidream_o1_edit, scale=32),
    Family("sd3", "SD3", _mmdit(None, []), _MMDIT, extra_conds=_pooled),
    # SD3.5: RMS q/k norm; Medium's MMDiT-X second self-attention in block 0.
    Family("sd35", "SD3", _mmdit("rms", [0]), _MMDIT, extra_conds=_pooled),
    Family("lumina2", "Lumina2", _lumina(), _LUMINA, extra_conds=_text_mask),
    # Z-Image: width >= 256 (its adaLN input is min(dim, 256) wide, the timestep embedding 256),
    # 4 heads of 64 with RoPE axes 16+24+24 (the real 32+48+48 halved).
    Family("z_image", "ZImage",
           _lumina(dim=256, n_heads=4, n_kv_heads=4, axes_dims=[16, 24, 24],
                   axes_lens=[1536, 512, 512], rope_theta=256.0,
                   ffn_dim_multiplier=8.0 / 3.0, z_image_modulation=True, time_scale=1000.0,
                   pad_tokens_multiple=32),
           _LUMINA, extra_conds=_text_mask),
    Family("flux2", "Flux2", _flux_like("flux2", **_FLUX2), ("comfy.ldm.flux.model", "Flux"),
           patch=(1, 1, 1)),
    # Flux 2 (Klein's layout: no guidance embedding, with which ComfyUI's timestep-zero path
    # fails) with a reference through ReferenceLatent, its method "index_timestep_zero"
    Family("flux2_timestep_zero", "Flux2",
           _flux_like("flux2", **{**_FLUX2, "guidance_embed": False}),
           ("comfy.ldm.flux.model", "Flux"), patch=(1, 1, 1), guides=_timestep_zero_reference),
    # LongCat-Image text to image and edit (ComfyUI 0.33: LongCatImage), Ovis-Image (its Flux
    # detection: FluxSchnell's config with the gated MLP and text norm, ComfyUI 0.8 and later)
    Family("longcat_image", "LongCatImage", _flux_like("flux", **_LONGCAT),
           ("comfy.ldm.flux.model", "Flux")),
    Family("longcat_image_edit", "LongCatImage", _flux_like("flux", **_LONGCAT),
           ("comfy.ldm.flux.model", "Flux"), extra_conds=_flux_reference),
    Family("chroma", "Chroma", _flux_like("chroma", **_CHROMA),
           ("comfy.ldm.chroma.model", "Chroma")),
    # Chroma Radiance: pixels [B, 3, H, W] in 16-pixel patches (sizes count its patches)
    Family("chroma_radiance", "ChromaRadiance", _flux_like("chroma_radiance", **_CHROMA_RADIANCE),
           ("comfy.ldm.chroma_radiance.model", "ChromaRadiance"), patch=(1, 16, 16), scale=16),
    # LTX-Video text-to-video, image-to-video (LTXVImgToVideo: the image's frame kept by the
    # noise mask, 1 - strength = 0) and a guide frame appended (LTXVAddGuide).
    # LTX-Video's T5 hands its attention mask over with the text.
    Family("ltxv", "LTXV", _ltxv, _LTXV, video=True, patch=(1, 1, 1), extra_conds=_text_mask),
    Family("ltxv_i2v", "LTXV", _ltxv, _LTXV, video=True, patch=(1, 1, 1),
           extra_conds=_text_mask, start_frame=True),
    Family("ltxv_guide", "LTXV", _ltxv, _LTXV, video=True, patch=(1, 1, 1),
           extra_conds=_text_mask, guides=_ltx_guide),
    # LTX-2 video with audio, text- and image-to-video.
    Family("ltx2", "LTXAV", _ltx2, _LTXAV, video=True, patch=(1, 1, 1), text_dim=2 * TEXT_DIM,
           audio_tokens=5),
    Family("ltx2_i2v", "LTXAV", _ltx2, _LTXAV, video=True, patch=(1, 1, 1),
           text_dim=2 * TEXT_DIM, audio_tokens=5, start_frame=True),
    # Wan VACE (one VACE block, after main block 0: its hint reaches block 1) with a control
    # video, and with a reference image in front (WanVaceToVideo).
    Family("wan_vace", "WAN21_Vace", _wan(model_type="vace", vace_layers=1, vace_in_dim=96),
           _VACE, video=True, guides=_wan_vace(reference=False)),
    Family("wan_vace_ref", "WAN21_Vace",
           _wan(model_type="vace", vace_layers=1, vace_in_dim=96), _VACE, video=True,
           guides=_wan_vace(reference=True)),
    # Two VACE blocks, after main blocks 0 and 1: VACE block 1 merges when main block 1 does.
    Family("wan_vace2", "WAN21_Vace", _wan(model_type="vace", vace_layers=2, vace_in_dim=96),
           _VACE, video=True, guides=_wan_vace(reference=False)),
    # Wan Fun camera control (CameraWanModel, 24 camera channels) through WanCameraEmbedding
    # and WanCameraImageToVideo: Camera 2.1 (32 input channels: noise + start image latent)
    # with and without a start image, Camera 2.2 (36: noise + 4 mask + image) with one.
    Family("wan_camera", "WAN21_Camera", _wan(model_type="camera", in_dim=32), _CAMERA,
           video=True, guides=_wan_camera(start_image=False)),
    Family("wan_camera_i2v", "WAN21_Camera", _wan(model_type="camera", in_dim=32), _CAMERA,
           video=True, guides=_wan_camera(start_image=True)),
    Family("wan22_camera_i2v", "WAN22_Camera", _wan(model_type="camera_2.2", in_dim=36),
           _CAMERA, video=True, guides=_wan_camera(start_image=True)),
    # Wan 2.2 Fun control (52 input channels: noise, control, 4 mask, image; a reference
    # image through ref_conv) through Wan22FunControlToVideo.
    Family("wan22_fun_control", "WAN21_T2V", _wan(in_dim=52, in_dim_ref_conv=16), _WAN,
           video=True, guides=_wan_fun_control),
    # Wan 2.2 Animate (AnimateWanModel: Wan 2.1 i2v blocks, pose embedding, face adapter)
    # through WanAnimateToVideo with a reference image and a pose video, and continuing the
    # motion of a previous chunk.
    Family("wan_animate", "WAN22_Animate", _wan(model_type="animate", in_dim=36), _ANIMATE,
           video=True, guides=wan_animate_guides()),
    Family("wan_animate_continue", "WAN22_Animate", _wan(model_type="animate", in_dim=36),
           _ANIMATE, video=True, guides=wan_animate_guides(continue_motion=True)),
    # SCAIL (animation mode) and SCAIL-2 (replacement mode with its identity masks, as its
    # templates run it) through WanSCAILToVideo: a reference frame in front of the video, pose
    # tokens after it.
    Family("wan_scail", "WAN21_SCAIL", _wan(model_type="scail", in_dim=20), _SCAIL,
           video=True, guides=wan_scail_guides(masks=False)),
    Family("wan_scail2", "WAN21_SCAIL2", _wan(model_type="scail2", in_dim=20), _SCAIL2,
           video=True, guides=wan_scail_guides(masks=True)),
    # Kandinsky 5 video, text- and image-to-video (Kandinsky5ImageToVideo), and image.
    Family("kandinsky5", "Kandinsky5", _kandinsky5(), _K5, video=True, extra_conds=_pooled),
    Family("kandinsky5_i2v", "Kandinsky5", _kandinsky5(), _K5, video=True,
           extra_conds=_pooled, guides=_kandinsky5_start),
    Family("kandinsky5_image", "Kandinsky5Image", _kandinsky5(visual_embed_dim=64), _K5,
           extra_conds=_pooled),
    # Krea 2 text-to-image, and with a style reference (ReferenceLatent, "index_timestep_zero")
    Family("krea2", "Krea2", _krea2, _KREA2, frames_dim=True, text_dim=2 * TEXT_DIM),
    Family("krea2_reference", "Krea2", _krea2, _KREA2, frames_dim=True, text_dim=2 * TEXT_DIM,
           guides=_timestep_zero_reference),
    # Mage-Flow text-to-image, and editing two images (TextEncodeMageFlowEdit)
    Family("mage_flow", "MageFlow", _mage_flow, _MAGE_FLOW, patch=(1, 1, 1)),
    Family("mage_flow_edit", "MageFlow", _mage_flow, _MAGE_FLOW, patch=(1, 1, 1),
           guides=_mage_flow_edit),
    # Anima text-to-image (its text through the LLM adapter, as CLIPTextEncode conditions it)
    Family("anima", "Anima", _anima, _ANIMA, frames_dim=True, text_dim=1024,
           guides=_anima_text),
    # Boogu-Image text-to-image, and editing one reference (TextEncodeBooguEdit's conds)
    Family("boogu", "Boogu", _boogu, _BOOGU, extra_conds=_text_mask),
    Family("boogu_edit", "Boogu", _boogu, _BOOGU, extra_conds=_boogu_edit),
    # Ideogram 4 text-to-image, and with padding in the text (its segment attention mask)
    Family("ideogram4", "Ideogram4", _ideogram4, _IDEOGRAM4, patch=(1, 1, 1), own_sizes=True),
    Family("ideogram4_padded", "Ideogram4", _ideogram4, _IDEOGRAM4, patch=(1, 1, 1),
           own_sizes=True, extra_conds=_padded_text_mask),
    # OmniGen2 text-to-image, and editing one reference (ReferenceLatent's conds, its text mask)
    Family("omnigen2", "Omnigen2", _omnigen2, _OMNIGEN2, extra_conds=_text_mask),
    Family("omnigen2_edit", "Omnigen2", _omnigen2, _OMNIGEN2, extra_conds=_boogu_edit),
    # Lens text-to-image, and with padding in the text (its key mask)
    Family("lens", "Lens", _lens, _LENS, patch=(1, 1, 1)),
    Family("lens_padded", "Lens", _lens, _LENS, patch=(1, 1, 1), extra_conds=_padded_text_mask),
    # WanDancer image-to-video with music (its injector after both blocks)
    Family("wan_dancer", "WAN22_WanDancer",
           _wan(model_type="wandancer", in_dim=36, audio_inject_layers=[0, 1], music_dim=32,
                music_heads=2, music_latent_dim=32), _DANCER, video=True,
           extra_conds=_wan_dancer),
    # JoyImage text-to-image, and editing one reference (TextEncodeJoyImageEdit's conds)
    Family("joyimage", "JoyImage", _joyimage, _JOYIMAGE, frames_dim=True, own_sizes=True),
    Family("joyimage_edit", "JoyImage", _joyimage, _JOYIMAGE, frames_dim=True, own_sizes=True,
           extra_conds=_joyimage_edit),
    # ERNIE-Image text-to-image (its blocks take no transformer_options), and its turbo
    # template's negative (ConditioningZeroOut)
    Family("ernie", "ErnieImage", _ernie, _ERNIE, patch=(1, 1, 1)),
    Family("ernie_turbo", "ErnieImage", _ernie, _ERNIE, patch=(1, 1, 1), guides=_zero_negative),
)}


# Which ComfyUI has which family -----------------------------------------------------------------
def family(name: str) -> Family:
    """The family called `name`; ValueError listing the known names otherwise."""
    if name not in FAMILIES:
        raise ValueError(f"no tiny family {name!r}; known: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def in_tree(name: str, tree: Path) -> bool:
    """Whether the ComfyUI source tree at `tree` defines the family's config class (read from
    comfy/supported_models.py, without importing it)."""
    source = (tree / "comfy" / "supported_models.py").read_text()
    return re.search(rf"^class {re.escape(family(name).config)}\(", source, re.M) is not None


def families_by_version() -> dict[str, list[str]]:
    """{tree folder name (e.g. "v0.8.0"): [families it has]} for the shared ComfyUI trees."""
    return {tree.name: [n for n in FAMILIES if in_tree(n, tree)] for tree in shared_trees()}


def available(name: str) -> bool:
    """Whether the imported ComfyUI has the family (its supported_models config class)."""
    ensure_comfy()
    import comfy.supported_models

    return hasattr(comfy.supported_models, family(name).config)


def available_families() -> list[str]:
    """The families the imported ComfyUI has."""
    return [name for name in FAMILIES if available(name)]


# Building ---------------------------------------------------------------------------------------
def tiny_patcher(name: str, seed: int = 0, **overrides: Any) -> ModelPatcher:
    """A ModelPatcher around the family's tiny model (fp32, CPU, weights from `seed`);
    `overrides` replace unet_config entries (e.g. depths).

    Raises ValueError when the imported ComfyUI lacks the family.
    """
    if not available(name):
        raise ValueError(f"this ComfyUI has no {family(name).config} (family {name})")
    import comfy.supported_models

    fam = family(name)
    toy = {**fam.unet_config(), **overrides}
    config = getattr(comfy.supported_models, fam.config)(toy)
    if fam.own_sizes:              # BASE.__init__ overlaid unet_extra_config's real widths
        config.unet_config.update(toy)
    patcher = _patcher(config, seed)
    _fill_buffers(patcher.model, seed)
    return patcher


def tiny_hunyuan3d() -> ModelPatcher:
    """Hunyuan3D 2 (a model ToMA cannot patch): Flux's block classes on shape latents, not an
    image grid."""
    ensure_comfy()
    import comfy.supported_models

    return _patcher(comfy.supported_models.Hunyuan3Dv2({
        "image_model": "hunyuan3d2", "in_channels": 8, "context_in_dim": 32, "hidden_size": 64,
        "num_heads": 4, "depth": 1, "depth_single_blocks": 1}), 0)


def _fill_buffers(model: torch.nn.Module, seed: int) -> None:
    """Learned position tables registered as buffers (SD3's pos_embed) come uninitialised like
    the weights: small seeded values."""
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("pos_embed") and buffer.is_floating_point():
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.02)


def latent_shape(name: str, patcher: ModelPatcher, batch: int, height: int, width: int,
                 frames: int = 1) -> tuple[int, ...]:
    """The latent shape the family samples: [B, C, T, H, W] for video, [B, C, 1, H, W] for
    Qwen-Image (5-D latent format), else [B, C, H, W]; `frames` only for video."""
    fam = family(name)
    channels = int(patcher.model.latent_format.latent_channels)
    if fam.video:
        return (batch, channels, frames, height, width)
    if frames != 1:
        raise ValueError(f"{name} is an image model: frames must be 1, got {frames}")
    if fam.frames_dim:
        return (batch, channels, 1, height, width)
    return (batch, channels, height, width)


def inputs(name: str, patcher: ModelPatcher, batch: int = 1, height: int = 8, width: int = 8,
           frames: int = 1, seed: int = 0) -> SampleInputs:
    """Empty latent, (positive, negative) conditioning and noise mask for the family's tiny
    model (height and width in units of the family's `scale`); the negative has its own text
    context and extras seeded differently."""
    fam = family(name)
    shape = latent_shape(name, patcher, batch, height * fam.scale, width * fam.scale, frames)

    def cond(offset: int) -> Conditioning:
        context = _randn(batch, fam.text_tokens, fam.text_dim, seed=seed + offset)
        # Text encoders without a pooled output still hand ComfyUI "pooled_output": None.
        return [[context, {"pooled_output": None, **fam.extra_conds(batch, shape, seed + offset)}]]

    latent, mask = torch.zeros(shape), None
    if fam.start_frame:
        latent[:, :, :1] = _randn(batch, shape[1], 1, *shape[3:], seed=seed + 3)
        mask = torch.ones(1, 1, *shape[2:])
        mask[:, :, :1] = 0.0
    positive, negative = cond(0), cond(100)
    if fam.guides is not None:
        latent, mask, positive, negative = fam.guides(latent, mask, positive, negative, seed)
    if fam.audio_tokens:
        import comfy.nested_tensor

        audio = torch.zeros(batch, 8, fam.audio_tokens, 16)
        latent = comfy.nested_tensor.NestedTensor((latent, audio))
    return SampleInputs(latent, positive, negative, mask)


def hidream_o1_sequence(x: SampleInputs) -> tuple[int, int]:
    """(tokens in front of the image, tokens in all) of the sequence HiDream-O1's blocks get
    for the positive conditioning of `x`: [prompt (an edit's ViT tokens spliced in); image;
    reference patches], as ComfyUI's own build_extra_conds lays it out."""
    from comfy.ldm.hidream_o1.conditioning import build_extra_conds

    extras = x.positive[0][1]
    conds = build_extra_conds(extras["text_input_ids"], x.latent,
                              ref_images=extras.get("reference_latents"))
    return conds["input_ids"].shape[1], conds["vinput_mask"].shape[1]


def video_of(latent: Any) -> torch.Tensor:
    """The video (or image) part of a latent or a sample: LTX-2's first stream of its
    NestedTensor, else the tensor itself."""
    return latent.unbind()[0] if getattr(latent, "is_nested", False) else latent


def token_grid(name: str, latent: torch.Size | tuple[int, ...]) -> tuple[int, int, int]:
    """Image tokens (t, h, w) of the family's model for a latent [B, C, (T,) H, W] (LTX-2's
    NestedTensor has its video's shape): every family pads each side up to its patch."""
    pt, ph, pw = family(name).patch
    frames = latent[2] if len(latent) == 5 else 1
    return (-(-frames // pt), -(-latent[-2] // ph), -(-latent[-1] // pw))


def diffusion_model_class(name: str) -> type:
    """The diffusion model class the family's config builds (imported from its module)."""
    ensure_comfy()
    import importlib

    module, cls = family(name).model_class
    return getattr(importlib.import_module(module), cls)


# MiniMax H3 (batch size one, video and audio in one packed sequence) ----------------------------
# Built apart from FAMILIES: its latent is a (video, audio) pair sized by ComfyUI's own nodes in
# pixels and frames at 24 fps, its conditioning comes from MiniMax's own nodes.
MINIMAX_H3 = {"image_model": "minimax_h3", "hidden_size": 64, "num_layers": 2,
              "token_refiner_num_layers": 1, "num_attention_heads": 4,
              "attention_head_dim": 16, "ffn_hidden_size": 128, "text_dim": TEXT_DIM,
              "timestep_input_dim": 32, "time_embed_hidden_size": 64, "time_embed_dim": 32,
              "rope_inv_freq_len": 2}
MINIMAX_H3_TASKS = ("t2v", "i2v", "ref2v")


def minimax_h3_available() -> bool:
    """Whether the imported ComfyUI has MiniMax H3 (comfy.supported_models.MiniMaxH3)."""
    ensure_comfy()
    import comfy.supported_models

    return hasattr(comfy.supported_models, "MiniMaxH3")


def tiny_minimax_h3(seed: int = 0) -> ModelPatcher:
    """MiniMax H3 at toy width (hidden 64, 4 heads of 16, 2 blocks, RoPE over 2 frequencies a
    (t, h, w) axis: 12 of the 16 channels), from comfy.supported_models.MiniMaxH3; its RoPE
    frequencies (a buffer the checkpoint fills) set as the real model's 10000^(-i/n)."""
    ensure_comfy()
    import comfy.supported_models

    patcher = _patcher(comfy.supported_models.MiniMaxH3(dict(MINIMAX_H3)), seed)
    inv_freq = patcher.model.diffusion_model.rope.inv_freq
    n = inv_freq.shape[0]
    inv_freq.copy_(10000.0 ** (-torch.arange(n, dtype=torch.float32) / n))
    return patcher


class _StubClip:
    """MiniMax H3's text encoder for its conditioning nodes: the prompt's states [1, L, TEXT_DIM]
    (seeded) and, as ComfyUI's MiniMax CLIP hands them, `minimax_token_tags`, the modality of
    each token (0 over a vision block: tokens 1-3 where images or references are given)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def tokenize(self, text: str, images: Any = None, minimax_ref_items: Any = None,
                 **kwargs: Any) -> dict[str, Any]:
        return {"vision": bool(images) or bool(minimax_ref_items)}

    def encode_from_tokens_scheduled(self, tokens: dict[str, Any]) -> Any:
        tags = torch.ones(TEXT_TOKENS, dtype=torch.long)
        if tokens["vision"]:
            tags[1:4] = 0
        context = _randn(1, TEXT_TOKENS, TEXT_DIM, seed=self.seed)
        return [[context, {"pooled_output": None, "minimax_token_tags": tags}]]


class _StubVideoVAE:
    """MiniMax H3's video VAE encode: pixels [N, H, W, 3] -> latent [1, 24, t, H / 16, W / 16],
    t = 1 for an image (N < 5), else the model's latent frames for N; 16 x 16 means through a
    fixed random projection."""

    def __init__(self, seed: int) -> None:
        self.projection = _randn(24, 3, seed=seed)

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        n = pixels.shape[0]
        t = 1 if n < 5 else ((n - 5) // 17) * 5 + 2
        frames = pixels[torch.linspace(0, n - 1, t).long()].movedim(-1, 1).float()
        cells = torch.nn.functional.avg_pool2d(frames, 16)
        latent = torch.einsum("oc,fchw->ofhw", self.projection, cells - 0.5) * 4
        return latent.unsqueeze(0)


class _StubAudioVAE:
    """MiniMax H3's audio VAE encode: waveform [1, L, 2] at 32 kHz -> latent [1, 32, 2, L / 800]
    (40 latent frames a second), means of 800 samples through a fixed random projection."""

    audio_sample_rate = 32000

    def __init__(self, seed: int) -> None:
        self.projection = _randn(32, 1, seed=seed)

    def encode(self, waveform: torch.Tensor) -> torch.Tensor:
        frames = waveform[0, : waveform.shape[1] // 800 * 800].float()       # [L, 2]
        means = frames.view(-1, 800, 2).mean(dim=1).t()                     # [2, T]
        return (self.projection[:, :, None] * means[None]).unsqueeze(0)     # [1, 32, 2, T]


def minimax_h3_inputs(task: str, width: int = 160, height: int = 128, length: int = 22,
                      seed: int = 0) -> SampleInputs:
    """Latent and conditioning for MiniMax H3 from ComfyUI's own nodes, as its templates wire
    them: text to video (EmptyMiniMaxH3LatentAV), image to video (MiniMaxH3ImageToVideo with a
    first frame) or reference to video (MiniMaxH3ReferenceToVideo with a reference image and a
    reference audio); the negative is the text encoder's alone. Sizes in pixels and frames."""
    ensure_comfy()
    import comfy_harness

    comfy_harness.comfy_top_level_nodes()
    from comfy_extras import nodes_minimax_h3 as nodes

    clip, vae = _StubClip(seed), _StubVideoVAE(seed + 12)
    if task == "t2v":
        latent = _node_output(nodes.EmptyMiniMaxH3LatentAV.execute(width, height, length))[0]
        positive = clip.encode_from_tokens_scheduled(clip.tokenize(""))
    elif task == "i2v":
        image = _pixels(1, height // 8, width // 8, seed + 13)
        positive, latent = _node_output(nodes.MiniMaxH3ImageToVideo.execute(
            clip, vae, "", width, height, length, first_frame=image))
    elif task == "ref2v":
        image = _pixels(1, height // 8, width // 8, seed + 13)
        audio = {"waveform": _randn(1, 2, 32000 // 4, seed=seed + 14), "sample_rate": 32000}
        positive, latent = _node_output(nodes.MiniMaxH3ReferenceToVideo.execute(
            clip, vae, _StubAudioVAE(seed + 15), "", width, height, length,
            ref_images={"ref_image_0": image}, ref_audios={"ref_audio_0": audio}))
    else:
        raise ValueError(f"no MiniMax H3 task {task!r}; known: {', '.join(MINIMAX_H3_TASKS)}")
    negative = _StubClip(seed + 100).encode_from_tokens_scheduled({"vision": False})
    return SampleInputs(latent["samples"], positive, negative)


def _node_output(out: Any) -> tuple:
    """A V3 node's outputs (NodeOutput.result, .args on older ComfyUI)."""
    return getattr(out, "result", None) or out.args
