"""Section gpu-model (ComfyUI only): one model call of SDXL, Flux.1 dev, Wan 2.1 14B and (ComfyUI
0.33 and later) HiDream-O1, Krea 2 and MiniMax H3 projected on the project's GPU, an NVIDIA H200,
unmerged and through the ToMA node, computing nothing.

    COMFYUI_PATH=/path/to/ComfyUI python -m bench --sections gpu-model [--models a,b] [--out ...]

Each model is ComfyUI's own class (comfy.supported_models) at its real configuration, bf16, its
weights on the meta device (no memory, nothing computed). ComfyUI samples it (comfy.sample.sample,
Euler, 20-step schedule) at a real generation's size, so the call goes through the ModelPatcher
as a workflow's does: object patches applied, the OUTER_SAMPLE and APPLY_MODEL wrappers run
(ToMA's per-run state in place), "dit" replace patches read by the block loop. What is stood in
for (`as_on_gpu`): ComfyUI's loader only applies the object patches
(`patch_model(load_weights=False)`), since meta weights cannot move and recent ComfyUI replaces
meta weights by zeros when it loads them; and the free memory and attention kind that decide
whether cond and uncond run as one batch are the H200's, not this CPU's. An APPLY_MODEL wrapper
of our own, the outermost, records the first model call (HiDream-O1: the third, the first on
its prompt cache; ModelSpec.call) under bench/gpu/projection.py's CallRecorder and then stops
sampling; it puts the call's inputs and the model's own tensors (the noise schedule) on the
meta device first, as a GPU run has them on the GPU, so tensors the call
creates on the CPU are the host's (and moving them to the device is a blocking copy).

Why meta tensors and not FakeTensorMode: ComfyUI's model management calls nn.Module.to on the
model, and nn.Module._apply swaps FakeTensor parameters (torch.utils.swap_tensors), which fails
on the weak references FakeTensorMode keeps to them ("Cannot swap t1 because it has weakref
associated with it", torch 2.13); meta tensors are plain tensors that run only meta kernels and
never reach the loader here. Both kinds need the recorder to answer the host's reads of device
values (see projection.py).

Per model and setting (the paper's: SDXL at ratio 0.5 and Flux at 0.75 with merge_scope
"attention", the paper's variant; the node's defaults at ratio 0.5 for all four): the call
unmerged and with the pack's node applied through its public path (nodes/apply.py apply_toma
with nodes/options.py make_options), projected by projection.project on H200 below: ms (serial:
roofline plus launch cost per kernel) and the queued timeline, the speedup, kernel launches and
host syncs, ToMA's share of the time (the ops its own code issued), and its memory: the peak of
live device bytes during the call against the unmerged one, and what stays alive after the call
(the plans it keeps for the following layers and steps).

Validation, in every run (reported as targets):
- FLOPs of the unmerged calls against torch.utils.flop_counter.FlopCounterMode stacked on the
  same call, and for Flux and Wan against a hand count of their matrix products (`hand_flops`);
- the configurations against ComfyUI's own detection (comfy.model_detection reading the built
  model's state dict);
- small models of the same classes run for real on the CPU under the same recorder, unmerged and
  with ToMA, against the same models on meta tensors: the same op list (names, output shapes,
  dtypes, who issued each op), FLOPs and peak bytes, so the shadows and the answers given for
  values the projection cannot know send the code down the real path; a setting whose check
  fails has its row flagged (not judged against the targets).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..shared.common import goal
from ..shared.config import ROOT, BenchConfig, load_pack
from ..shared.model_configs import FLUX_DEV, SD15_UNET, SDXL_UNET, hidream_o1_prompt_ids
from ..shared.weights import fill_weights
from .projection import GPU, META, Calibration, CallRecorder, Op, project, project_bounded

log = logging.getLogger(__name__)

# The project's GPU. bf16 and bandwidth: measured on the project's H200 (given with the task:
# dense bf16 about 790 TFLOP/s, memory about 4.3 TB/s). fp32 matrix products (ToMA builds its
# plans in fp32; PyTorch's default allow_tf32=False, which ComfyUI leaves alone, keeps them off
# the tensor cores): NVIDIA's H200 SXM datasheet figure, 67 TFLOP/s, times the measured/datasheet
# ratio of bf16 (790 / 989, the datasheet's dense bf16): an assumption, that fp32 reaches the
# same fraction of its peak. Launch cost: an assumption, 4 us per kernel, within the 2-5 us
# commonly quoted for a CUDA launch plus the gap between back-to-back kernels; sensitivity to it
# is in every row (speedup at 0 and 10 us). Efficiency: every kernel at the measured peaks
# (1.0), an assumption that makes the model's kernels as short as they can be, so a launch-bound
# overhead weighs more than at real efficiencies: the speedup with every kernel at 0.5 is in
# every row. Attention efficiency: 1.0 of the measured peak, an assumption; FlashAttention-class
# kernels reach less than dense matmuls, which would make attention, where merging saves
# quadratically, a larger share: the speedup at 0.6 is in every row too.
BF16_PEAK = 790e12
FP32_PEAK = 67e12 * BF16_PEAK / 989e12
H200 = GPU("NVIDIA H200 (projected)", {"bfloat16": BF16_PEAK, "float16": BF16_PEAK,
                                       "float32": FP32_PEAK}, bandwidth=4.3e12, launch_s=4e-6)
SENSITIVITY = {"launch 0 us": {"launch_s": 0.0}, "launch 10 us": {"launch_s": 10e-6},
               "attention 60%": {"attention_efficiency": 0.6},
               "kernels at 50%": {"efficiency": 0.5}}
# The calibrated projection (projection.Calibration): what kernels of each kind and size reach.
# sms: the GH100 of the H100 SXM5 has 132 SMs (NVIDIA's H100 architecture whitepaper), which the
# H200 keeps. tile: 128 x 256 outputs per SM, a common Hopper GEMM tile (an assumption; 128 x 128
# in the sensitivity). Attention: FlashAttention-2, PyTorch's flash SDPA backend, reaches about
# 35% of the H100's 989 TFLOP/s datasheet peak (Shah et al., FlashAttention-3, 2024,
# arXiv:2407.08608), here as a share of the measured bf16 peak; FlashAttention-3's 75% in the
# sensitivity. Kernel floor 2 us, gap between kernels 1 us, and 5 us of host time to issue one
# kernel through PyTorch's eager dispatch: assumptions, 10 us in the sensitivity; the GPU run
# measures the host's issue time of the same calls (bench/gpu/measured_calls.py host_ms).
CALIBRATED = Calibration(H200, sms=132, tile=(128, 256),
                         attention_efficiency=0.35 * 989e12 / BF16_PEAK, kernel_floor_s=2e-6,
                         gap_s=1e-6, host_launch_s=5e-6)
CALIBRATED_SENSITIVITY = {
    "host 10 us a launch": {"host_launch_s": 10e-6},
    "attention at FlashAttention-3's 75%": {"attention_efficiency": 0.75 * 989e12 / BF16_PEAK},
    "tiles 128x128": {"tile": (128, 128)},
}
# NVIDIA's datasheet memory of the H200 (141 GB): only ComfyUI's cond-batching decision reads it.
GPU_MEMORY = 141e9
STEPS = 20               # the schedule the sampler builds (only its first model call runs)
SDXL_TARGET = 1.2        # the paper's measured GPU gain on SDXL at ratio 0.5 (5.04 vs 6.07 s)
FLUX_TARGET = 1.3        # on Flux.1 dev at ratio 0.75 (16.12 vs 21.03 s)
FLOP_TOLERANCE = 0.005   # relative: recorded FLOPs against FlopCounterMode and hand counts
COLUMNS = ("model", "setting", "ratio", "scope", "batch", "attn_len", "ms", "ms_toma",
           "speedup", "ms_cal", "ms_cal_toma", "speedup_cal", "bound", "bound_toma",
           "host_bound_us", "launches", "launches_toma", "syncs", "syncs_toma", "toma_share",
           "peak_gib", "extra_mib", "kept_mib", "ms_queued", "ms_toma_queued", "speedup_queued",
           "tflop", "tflop_toma", "assumed_toma", "flag")


# Models ------------------------------------------------------------------------------------------
Shape = tuple[int, ...] | tuple[tuple[int, ...], ...]   # a latent, or its streams' latents


@dataclass(frozen=True)
class ModelSpec:
    """One model at one generation size.

    config: class in comfy.supported_models; unet_config: what its detection reads from the
    real checkpoint (comfy/model_detection.py); latent: one item's latent [1, C, (T,) H, W], or
    the shapes of its streams (MiniMax H3: video and audio, one NestedTensor);
    cfg: > 1 batches cond and uncond into one call; text: one cond's text context [1, L, D];
    extra: (seed, text shape, latent shape) -> the cond's other entries (pooled vectors, size,
    guidance, token ids, token tags, keyframes); negative: the uncond's text shape where it is
    not the cond's (ComfyUI then runs cond and uncond as separate calls of one item); call:
    which model call of the run is recorded (0: the first; later where the model keeps
    something from its first calls).
    """

    name: str
    label: str
    config: str
    unet_config: dict[str, Any]
    latent: Shape
    cfg: float
    text: tuple[int, ...]
    extra: Callable[[int, tuple[int, ...], Shape], dict[str, Any]] = field(
        default=lambda seed, text, latent: {})
    negative: tuple[int, ...] | None = None
    call: int = 0

    @property
    def batch(self) -> int:
        """Items in one model call: cond and uncond together when cfg > 1 and their shapes
        agree."""
        return 2 if self.cfg > 1 and self.negative is None else 1


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def latent_tensor(shape: Shape, seed: int, zero: bool = False):
    """A seeded normal latent of `shape` (zero: zeros), a NestedTensor of one per stream when
    `shape` holds several, as ComfyUI's latent nodes give a model of several streams."""
    if isinstance(shape[0], tuple):
        import comfy.nested_tensor

        return comfy.nested_tensor.NestedTensor(tuple(
            latent_tensor(s, seed + i, zero) for i, s in enumerate(shape)))
    return torch.zeros(shape) if zero else _randn(*shape, seed=seed)


# SDXL base and Flux.1 dev: bench/shared/model_configs.py; Wan 2.1 14B t2v: model_detection's
# Wan branch (dim 5120, heads dim / 128 = 40, ffn 13824, 40 blocks in the checkpoint; the rest
# fixed there) with WanModel's defaults text_len 512 and text_dim 4096 (umT5-XXL).
WAN21_14B: dict[str, Any] = {
    "image_model": "wan2.1", "model_type": "t2v", "dim": 5120, "ffn_dim": 13824,
    "num_heads": 40, "num_layers": 40, "in_dim": 16, "out_dim": 16, "patch_size": (1, 2, 2),
    "freq_dim": 256, "window_size": (-1, -1), "qk_norm": True, "cross_attn_norm": True,
    "eps": 1e-6, "text_len": 512, "text_dim": 4096,
}

def sdxl_spec(name: str, side: int) -> ModelSpec:
    """SDXL base at side x side pixels, cond and uncond batched (CFG 7)."""
    return ModelSpec(name, f"SDXL base {side}x{side}", "SDXL", SDXL_UNET,
                     (1, 4, side // 8, side // 8), 7.0, (1, 77, 2048),
                     lambda seed, text, latent: {
                         "pooled_output": _randn(1, 1280, seed=seed), "width": side,
                         "height": side})


H3_WIDTH = 5376     # MiniMaxH3Model's width


def minimax_h3_conds(pictures: tuple[int, ...] = (), vision: int = 0, refs: bool = False,
                     ref_latent: tuple[int, int] | None = None) -> Callable[..., dict[str, Any]]:
    """The cond entries ComfyUI's MiniMax H3 nodes give besides the text states: each token's
    modality tag (`minimax_token_tags`: 1 text, 0 over each picture's vision block of `vision`
    tokens, which starts at the text position given in `pictures`) and each picture's video
    latent [1, 24, 1, H, W] at the canvas' size: MiniMaxH3ImageToVideo's one picture as the
    first frame's keyframe (`minimax_keyframes`), or (refs) MiniMaxH3ReferenceToVideo's
    reference images (`minimax_refs`: kind "image", the latent and its height and width), at
    the latent size `ref_latent` (H, W) where its ref_image_size gives them another size than
    the canvas'.

    The templates' prompts as MiniMaxH3Tokenizer tokenizes them: text to video 388 tokens; image
    to video "<Picture 1>: " (6 tokens), the first frame's vision block (vision start, its 400
    Qwen3-VL tokens at 640x640: 16-pixel patches merged 2x2, vision end) and 302 prompt tokens;
    reference to video, for each of its two reference images "<Picture i>: " (6 tokens) and its
    vision block (405 tokens at 864x480, and the two around them), then 319 prompt tokens.
    The text states at the model's width: extra_conds runs condition_proj and the token refiner
    once per sampling, before the calls, and hands the calls their output. The pictures'
    pixels and latents are random: a call's cost depends on their shapes only."""
    def extra(seed: int, text: tuple[int, ...], latent: Shape) -> dict[str, Any]:
        tags = torch.ones(text[1], dtype=torch.long)
        out: dict[str, Any] = {"minimax_token_tags": tags}
        video = latent[0]
        height, width = ref_latent or video[3:]
        latents = [_randn(1, video[1], 1, height, width, seed=seed + i)
                   for i in range(len(pictures))]
        for at in pictures:
            tags[at:at + vision] = 0
        if refs:
            out["minimax_refs"] = [{"kind": "image", "latent_h": height, "latent_w": width,
                                    "latent": z} for z in latents]
        elif latents:
            out["minimax_keyframes"] = [{"resolved_frame_index": 0, "latent": latents[0]}]
        return out

    return extra


def minimax_h3_r2v_spec(name: str, refs: str, vision: int,
                        ref_latent: tuple[int, int] | None = None) -> ModelSpec:
    """MiniMax H3 reference to video at the text to video size and length with two reference
    images described by `refs`: each "<Picture i>: " (6 tokens) and its vision block of `vision`
    tokens, then 319 prompt tokens; their latents at the canvas' size or `ref_latent` (H, W)."""
    return ModelSpec(name, f"MiniMax H3 r2v 864x480x124, 2 synthetic {refs}", "MiniMaxH3",
                     {"image_model": "minimax_h3"}, ((1, 24, 37, 30, 54), (1, 32, 2, 207)), 1.0,
                     (1, 2 * (6 + vision) + 319, H3_WIDTH),
                     minimax_h3_conds((6, 6 + vision + 6), vision, refs=True,
                                      ref_latent=ref_latent))


MODELS: dict[str, ModelSpec] = {
    # 1024x1024: latent 128x128; CLIP-L + bigG context 77 x 2048, pooled bigG 1280
    "sdxl": sdxl_spec("sdxl", 1024),
    # 512x512 (SDXL's smallest common size, its levels 1024 and 256 tokens) and SD1.5 at 512x512
    # (levels 4096, 1024, 256 tokens; CLIP-L context 77 x 768) and 768x768: where merging
    # stops paying on a GPU (unet_patch.GPU_MIN_WORK)
    "sdxl_512": sdxl_spec("sdxl_512", 512),
    "sd15": ModelSpec("sd15", "SD1.5 512x512", "SD15", SD15_UNET, (1, 4, 64, 64), 7.0,
                      (1, 77, 768)),
    "sd15_768": ModelSpec("sd15_768", "SD1.5 768x768", "SD15", SD15_UNET, (1, 4, 96, 96), 7.0,
                          (1, 77, 768)),
    # 1024x1024: latent 128x128 -> 64x64 = 4096 image tokens; 512 T5 tokens; distilled guidance,
    # cfg 1 (one cond per call)
    "flux": ModelSpec("flux", "Flux.1 dev 1024x1024", "Flux", FLUX_DEV, (1, 16, 128, 128), 1.0,
                      (1, 512, 4096), lambda seed, text, latent: {
                          "pooled_output": _randn(1, 768, seed=seed), "guidance": 3.5}),
    # 832x480, 81 frames: latent 21 x 60 x 104 -> 21 x 30 x 52 = 32760 tokens; 512 umT5 tokens
    "wan": ModelSpec("wan", "Wan 2.1 14B t2v 832x480x81", "WAN21_T2V", WAN21_14B,
                     (1, 16, 21, 60, 104), 5.0, (1, 512, 4096)),
    # 2048x2048 pixels in 32-pixel patches: 4096 image tokens; the prompt and negative prompt
    # of ComfyUI's HiDream-O1 template tokenized by its HiDreamO1Tokenizer (chat template
    # included): 32 and 10 token ids, so cond and uncond run as two calls of one item. The
    # third call is recorded: the first step's two calls fill the unmerged model's prompt K/V
    # cache, which it uses from the second step on (ToMA's patches turn it off).
    "hidream_o1": ModelSpec("hidream_o1", "HiDream-O1 2048x2048", "HiDreamO1",
                            {"image_model": "hidream_o1"}, (1, 3, 2048, 2048), 5.0, (1, 32, 1),
                            lambda seed, text, latent: {
                                "text_input_ids": hidream_o1_prompt_ids(text[1])},
                            negative=(1, 10, 1), call=2),
    # 1024x1024 as Krea 2's templates (Wan 2.1's latent: 16 channels, 8x8 pixels) in 2x2 patches
    # -> 4096 image tokens; SingleStreamDiT's defaults (width 6144, 28 blocks); 256 tokens of
    # its 12 stacked Qwen3-VL layers (12 x 2560); its turbo templates sample at cfg 1
    "krea2": ModelSpec("krea2", "Krea 2 1024x1024", "Krea2", {"image_model": "krea2"},
                       (1, 16, 128, 128), 1.0, (1, 256, 12 * 2560)),
    # MiniMax H3 as its text and image to video templates sample (video_minimax_h3_t2v and _i2v):
    # the size of their ResolutionSelector (16:9 and 1:1 at 0.4 MP: 864x480 and 640x640), 5 s
    # snapped to 124 frames by their ComfyMathExpression, sized as MiniMaxH3ImageToVideo sizes
    # them: video [1, 24, 37, H/16, W/16] in 2x2 patches -> 37 x 15 x 27 = 14985 and 37 x 20 x
    # 20 = 14800 tokens, stereo audio [1, 32, 2, 207] -> 414 tokens; BasicGuider: cfg 1.
    # MiniMaxH3Model's defaults (56 heads of 128, 50 blocks). See minimax_h3_conds.
    "minimax_h3": ModelSpec("minimax_h3", "MiniMax H3 t2v 864x480x124", "MiniMaxH3",
                            {"image_model": "minimax_h3"},
                            ((1, 24, 37, 30, 54), (1, 32, 2, 207)), 1.0, (1, 388, H3_WIDTH),
                            minimax_h3_conds()),
    "minimax_h3_i2v": ModelSpec("minimax_h3_i2v", "MiniMax H3 i2v 640x640x124", "MiniMaxH3",
                                {"image_model": "minimax_h3"},
                                ((1, 24, 37, 40, 40), (1, 32, 2, 207)), 1.0,
                                (1, 6 + 402 + 302, H3_WIDTH), minimax_h3_conds((6,), 402)),
    # Reference to video (video_minimax_h3_r2v): its MiniMaxH3ReferenceToVideo at the text to
    # video size and length with two reference images, which its ref_image_size "match" scales
    # down to the canvas' area keeping their aspect. The template's two images do not ship with
    # the template packages: assumed 16:9 and at least 864x480, so each is 864x480 (what a
    # larger 16:9 image becomes), latent [1, 24, 1, 30, 54] -> 405 rows in front of the audio
    # and video, and 405 Qwen3-VL tokens in the text.
    "minimax_h3_r2v": minimax_h3_r2v_spec("minimax_h3_r2v", "864x480 refs", 407),
    # The same with ref_image_size "max": each reference scaled down (never up) to a 2048-pixel
    # short edge, keeping its aspect, each side rounded to 32. Assumed: two 16:9 images of a
    # 2048-pixel short edge or more (a 3840x2160 photo: 3640.9 x 2048 -> 3648x2048), so each is
    # latent [1, 24, 1, 128, 228] -> 64 x 114 = 7296 rows, and Qwen3-VL's processor keeps
    # 3648x2048 (under its 12845056-pixel cap): 7296 tokens in a vision block of 7298. A source
    # of 864x480 stays 864x480 under "max" (minimax_h3_r2v's sizes).
    "minimax_h3_r2v_max": minimax_h3_r2v_spec(
        "minimax_h3_r2v_max", "3840x2160 refs at max (3648x2048)", 7298, (128, 228)),
    # "max" with two 1920x1080 sources (under the 2048 short edge: never scaled up, each side
    # rounded to 32 -> 1920x1088): latent [1, 24, 1, 68, 120] -> 34 x 60 = 2040 rows each, and
    # 2040 Qwen3-VL tokens in a vision block of 2042.
    "minimax_h3_r2v_max_1080": minimax_h3_r2v_spec(
        "minimax_h3_r2v_max_1080", "1920x1080 refs at max (1920x1088)", 2042, (68, 120)),
}


@dataclass(frozen=True)
class Setting:
    """A ToMA node setting: make_options keyword arguments (everything else the default).
    cpu_rules: the node's choices as it makes them on a CPU (its GPU-only rule, a UNet's
    smallest merged levels left alone, off), to show what that rule changes."""

    name: str
    options: dict[str, Any]
    cpu_rules: bool = False

    @property
    def ratio(self) -> float:
        return self.options.get("ratio", 0.5)

    @property
    def scope(self) -> str:
        return self.options.get("merge_scope", "auto")


# The paper's settings: SDXL at ratio 0.5, Flux at 0.75, both merging the attention only (the
# paper's SDXL merges around self-attention; its Flux code merges the image Q/K/V of double
# blocks and whole single blocks, the pack's "attention" scope); skipped blocks and tiles stay
# the node's defaults. The node's defaults: ratio 0.5, everything else default.
SETTINGS: tuple[tuple[str, Setting], ...] = (
    ("sdxl", Setting("paper", {"ratio": 0.5, "merge_scope": "attention"})),
    ("sdxl", Setting("default", {"ratio": 0.5})),
    ("flux", Setting("paper", {"ratio": 0.75, "merge_scope": "attention"})),
    ("flux", Setting("default", {"ratio": 0.5})),
    ("sdxl_512", Setting("default", {"ratio": 0.5})),
    ("sdxl_512", Setting("default, as on a CPU", {"ratio": 0.5}, cpu_rules=True)),
    ("sd15", Setting("default", {"ratio": 0.5})),
    ("sd15", Setting("default, as on a CPU", {"ratio": 0.5}, cpu_rules=True)),
    ("sd15", Setting("largest level", {"ratio": 0.5, "unet_levels": "largest"})),
    ("sd15_768", Setting("default", {"ratio": 0.5})),
    ("wan", Setting("default", {"ratio": 0.5})),
    ("hidream_o1", Setting("default", {"ratio": 0.5})),
    ("krea2", Setting("default", {"ratio": 0.5})),
    ("minimax_h3", Setting("default", {"ratio": 0.5})),
    ("minimax_h3_i2v", Setting("default", {"ratio": 0.5})),
    ("minimax_h3_r2v", Setting("default", {"ratio": 0.5})),
    ("minimax_h3_r2v_max", Setting("default", {"ratio": 0.5})),
    ("minimax_h3_r2v_max_1080", Setting("default", {"ratio": 0.5})),
)


def present(spec: ModelSpec) -> bool:
    """Whether this ComfyUI has spec's model (HiDream-O1, Krea 2 and MiniMax H3 came with
    0.33)."""
    import comfy.supported_models

    return hasattr(comfy.supported_models, spec.config)


def comfy_config(spec: ModelSpec, unet_config: dict[str, Any] | None = None):
    """The comfy.supported_models config object of `spec` (FluxParams-style fields this
    ComfyUI lacks are dropped: the dataclass grows across versions)."""
    import comfy.supported_models

    config = dict(unet_config if unet_config is not None else spec.unet_config)
    if spec.config == "Flux":
        import comfy.ldm.flux.model

        known = {f.name for f in dataclasses.fields(comfy.ldm.flux.model.FluxParams)}
        config = {k: v for k, v in config.items() if k in known or k == "image_model"}
    return getattr(comfy.supported_models, spec.config)(config)


def build_patcher(spec: ModelSpec, unet_config: dict[str, Any] | None = None, real: bool = False,
                  dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """A ModelPatcher of `spec`'s model in `dtype`, weights on the meta device (real: on the
    CPU with bench.shared.weights' seeded fill, for the validation runs); load and offload device
    the
    CPU, as ComfyUI's CPU mode has them."""
    import comfy.model_patcher

    config = comfy_config(spec, unet_config)
    config.set_inference_dtype(dtype, None)
    model = config.get_model({}, device=torch.device("cpu") if real else META)
    if real:
        fill_weights(model.diffusion_model, seed).eval()
    cpu = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)


def conditioning(spec: ModelSpec, seed: int = 0, text: tuple[int, ...] | None = None,
                 latent: Shape | None = None):
    """(positive, negative) in ComfyUI's [[context, {extras}]] form, seeded; text and latent
    override spec's sizes (the uncond keeps spec.negative where it has one)."""
    def cond(offset: int, shape: tuple[int, ...]):
        context = _randn(*shape, seed=seed + offset)
        return [[context, spec.extra(seed + offset + 1, shape, latent or spec.latent)]]

    text = text or spec.text
    return cond(0, text), cond(100, spec.negative or text)


# One model call ----------------------------------------------------------------------------------
class _OneCall(Exception):  # noqa: N818 (control flow, not an error)
    """Raised by the recording wrapper after the recorded model call: stops the sampler."""


@dataclass
class _Window:
    """The recording wrapper's state: the recorder of the recorded call and what it saw."""

    recorder: CallRecorder | None = None
    batch: int = 0
    extra: Any = None       # a mode stacked above the recorder for the call (FlopCounterMode)
    skip: int = 0           # model calls still to run before the recorded one


WRAPPER_KEY = "bench_gpu_model"


def install_window(patcher) -> _Window:
    """Add the recording APPLY_MODEL wrapper to `patcher` (before the pack's, so that it is the
    outermost on every clone) and return its state."""
    from comfy.patcher_extension import WrappersMP

    window = _Window()

    def wrapper(executor: Callable, *args, **kwargs):
        recorder = window.recorder
        if recorder is None:
            return executor(*args, **kwargs)
        earlier = window.skip > 0
        if earlier:
            # a call before the recorded one runs as it does, under a recorder of its own
            # (its inputs on the device too) whose record is dropped
            window.skip -= 1
            recorder = CallRecorder(owner_dirs(), simulate=recorder.simulate)
        else:
            window.batch = int(args[0].shape[0])
        if recorder.simulate:
            args, kwargs = recorder.to_device((args, kwargs))
        with contextlib.ExitStack() as stack:
            if recorder.simulate:
                stack.enter_context(on_device(executor.class_obj, recorder))
            stack.enter_context(recorder)
            if window.extra is not None and not earlier:
                stack.enter_context(window.extra)
            out = executor(*args, **kwargs)
        recorder.close(out)
        if earlier:
            # back on the host for the sampler; values nobody computed are zeros, which only
            # the following calls' noisy input sees (their ops do not depend on it)
            return out.new_zeros(out.shape, device="cpu") if out.is_meta else out
        raise _OneCall

    patcher.add_wrapper_with_key(WrappersMP.APPLY_MODEL, WRAPPER_KEY, wrapper)
    return window


@contextlib.contextmanager
def on_device(base_model: torch.nn.Module, recorder: CallRecorder) -> Iterator[None]:
    """The model's own real tensors (the noise schedule of model_sampling) on the meta device
    with their values as shadows for the call, as a GPU run has them on the GPU; put back
    after."""
    swapped = []
    for module in base_model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and not buf.is_meta:
                swapped.append((module, name, buf))
                module._buffers[name] = recorder.to_device(buf)
    try:
        yield
    finally:
        for module, name, buf in swapped:
            module._buffers[name] = buf


@contextlib.contextmanager
def as_on_gpu(patcher) -> Iterator[None]:
    """ComfyUI's view of the device while sampling, as on the H200 rather than this CPU:

    - load_models_gpu only applies each model's object patches, leaving its weights alone
      (ModelPatcher.patch_model(load_weights=False); unpatch_model(unpatch_weights=False)
      afterwards);
    - get_free_memory answers the H200's memory minus the model's weights, and
      pytorch_attention_flash_attention True (what it answers with PyTorch attention on an
      NVIDIA GPU): the two things calc_cond_batch's decision to run cond and uncond as one
      batch reads, through model.memory_required.
    """
    import comfy.model_management as mm

    loaded: list = []

    def load_models_gpu(models, *args, **kwargs) -> None:
        for model in models:
            if all(model is not m for m in loaded):
                model.patch_model(load_weights=False)
                loaded.append(model)

    free = GPU_MEMORY - patcher.model_size()
    originals = {name: getattr(mm, name) for name in
                 ("load_models_gpu", "get_free_memory", "pytorch_attention_flash_attention")}
    mm.load_models_gpu = load_models_gpu
    mm.get_free_memory = lambda *args, **kwargs: free
    mm.pytorch_attention_flash_attention = lambda: True
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(mm, name, fn)
        for model in loaded:
            model.unpatch_model(unpatch_weights=False)


def record_call(patcher, window: _Window, spec: ModelSpec, recorder: CallRecorder,
                latent: Shape | None = None, text: tuple[int, ...] | None = None,
                extra: Any = None, seed: int = 0) -> CallRecorder:
    """Sample with `patcher` (Euler, STEPS-step schedule) until its model call spec.call, which
    `recorder` records; latent / text override spec's sizes (validation runs).
    Returns the recorder. Raises when the call's batch is not spec.batch (ComfyUI split cond
    and uncond)."""
    import comfy.sample

    shape = latent or spec.latent
    noise = latent_tensor(shape, seed)
    positive, negative = conditioning(spec, seed, text, latent)
    window.recorder, window.extra, window.batch, window.skip = recorder, extra, 0, spec.call
    try:
        with as_on_gpu(patcher), torch.inference_mode():
            comfy.sample.sample(patcher, noise, STEPS, spec.cfg, "euler", "normal", positive,
                                negative, latent_tensor(shape, seed, zero=True),
                                disable_pbar=True, seed=seed)
    except _OneCall:
        pass
    finally:
        window.recorder, window.extra, window.skip = None, None, 0
    if window.batch != spec.batch:
        raise RuntimeError(f"{spec.label}: the model call had batch {window.batch}, expected "
                           f"{spec.batch} (ComfyUI did not batch cond and uncond)")
    return recorder


def comfy_version() -> str:
    """The ComfyUI version in use (its comfyui_version.py), "unknown" without one."""
    try:
        import comfyui_version
    except ImportError:
        return "unknown"
    return str(getattr(comfyui_version, "__version__", "unknown"))


def owner_dirs() -> tuple[str, ...]:
    """The pack's code: its toma_core/ and nodes/ folders."""
    return (str(ROOT / "toma_core"), str(ROOT / "nodes"))


@contextlib.contextmanager
def device_rules(on_gpu: bool) -> Iterator[None]:
    """The pack's GPU-only choices (unet_patch.GPU_DEVICES) made for the meta tensors a
    projection runs on, as on the H200; on_gpu False: as on a CPU."""
    unet = load_pack().nodes.unet_patch
    saved = unet.GPU_DEVICES
    unet.GPU_DEVICES = (*saved, "meta") if on_gpu else saved
    try:
        yield
    finally:
        unet.GPU_DEVICES = saved


def toma(patcher, setting: Setting):
    """The pack applied as the ToMA node does: apply_toma(model, make_options(...))."""
    pack = load_pack()
    return pack.nodes.apply.apply_toma(patcher, pack.nodes.options.make_options(**setting.options))


# Hand counts -------------------------------------------------------------------------------------
def hand_flops(spec: ModelSpec) -> int | None:
    """FLOPs of one call's matrix products, convolutions and attention, counted by hand from
    the architecture (2 per multiply-add), for Flux and Wan; None for other models.

    Flux (B items, image tokens N, text T, width C, L = N + T): img_in 2BN(16*4)C; txt_in
    2BT*4096*C; time, guidance and vector MLPs 2B(256C + C^2) twice and 2B(768C + C^2); per
    double block two modulations 2B*C*6C, Q/K/V 6(N + T)C^2, attention 4BL^2C, projections
    2(N + T)C^2, MLPs 16(N + T)C^2 (all B-fold); per single block modulation 2B*C*3C, linear1
    14BLC^2, attention 4BL^2C, linear2 10BLC^2; final layer 2B*C*2C + 2BN*C*64.
    Wan (tokens N, text T, width C, FFN F): patch embedding 2BN*64*C; text embedding
    2BT(4096C + C^2); time embedding 2B(256C + C^2) + 2B*C*6C; per block self-attention
    projections 8BNC^2, attention 4BN^2C, cross-attention Q/O 4BNC^2, K/V 4BTC^2, attention
    4BNTC, FFN 4BNCF; head 2BN*C*64.
    """
    b = spec.batch
    if spec.name == "flux":
        p = spec.unet_config
        c, n, t = p["hidden_size"], (spec.latent[2] // 2) * (spec.latent[3] // 2), spec.text[1]
        ln = n + t
        flops = 2 * n * 64 * c + 2 * t * p["context_in_dim"] * c
        flops += 2 * 2 * (256 * c + c * c) + 2 * (p["vec_in_dim"] * c + c * c)
        flops += p["depth"] * (2 * 2 * c * 6 * c + 6 * ln * c * c + 4 * ln * ln * c
                               + 2 * ln * c * c + 16 * ln * c * c)
        flops += p["depth_single_blocks"] * (2 * c * 3 * c + 14 * ln * c * c + 4 * ln * ln * c
                                             + 10 * ln * c * c)
        flops += 2 * c * 2 * c + 2 * n * c * 64
        return b * flops
    if spec.name == "wan":
        p = spec.unet_config
        c, f, t = p["dim"], p["ffn_dim"], spec.text[1]
        n = spec.latent[2] * (spec.latent[3] // 2) * (spec.latent[4] // 2)
        flops = 2 * n * 64 * c + 2 * t * (p["text_dim"] * c + c * c)
        flops += 2 * (256 * c + c * c) + 2 * c * 6 * c
        flops += p["num_layers"] * (8 * n * c * c + 4 * n * n * c + 4 * n * c * c
                                    + 4 * t * c * c + 4 * n * t * c + 4 * n * c * f)
        flops += 2 * n * c * 64
        return b * flops
    return None


def compute_flops(ops: list[Op]) -> int:
    """FLOPs of the recorded matrix products, convolutions and attention."""
    return sum(op.flops for op in ops if not op.host)


def detection_mismatches(spec: ModelSpec, patcher) -> list[str]:
    """Where ComfyUI's model detection, reading the built model's state dict (meta tensors),
    disagrees with spec.unet_config or picks another config class; [] when it agrees."""
    import comfy.model_detection

    sd = patcher.model.diffusion_model.state_dict()
    found = comfy.model_detection.detect_unet_config(sd, "")
    picked = comfy.model_detection.model_config_from_unet_config(found, sd)
    out = []
    if type(picked).__name__ != spec.config:
        out.append(f"detected class {type(picked).__name__}, not {spec.config}")
    for key, value in spec.unet_config.items():
        if key in found and _plain(found[key]) != _plain(value):
            out.append(f"{key}: detected {found[key]!r}, used {value!r}")
    return out


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, (list, tuple)) else value


# Validation on small models run for real ---------------------------------------------------------
# The same classes at toy widths, small enough to run for real on a CPU in a few seconds: every
# block kind, both UNet levels with attention merging (unet_levels "all": 16x16 and 8x8 tokens),
# every Flux and Wan block merging (skip_blocks "none"), a video grid of 5 x 8 x 10 tokens whose
# regions are ragged (slabs of 3 and 2 frames), as the real Wan 14B grid's are; HiDream-O1's
# Qwen3-VL at width 64 (2 layers, 4 query and 2 key/value heads of 16) on 4 x 5 patches, a
# prompt of 8 ids (the negative keeps its 10: two calls a step, as at real size).
SMALL: dict[str, tuple[dict[str, Any], Shape, tuple[int, ...], dict[str, Any]]] = {
    "sdxl": ({**SDXL_UNET, "model_channels": 32, "transformer_depth": [0, 0, 1, 1, 2, 2],
              "transformer_depth_middle": 2,
              "transformer_depth_output": [0, 0, 0, 1, 1, 1, 2, 2, 2], "context_dim": 2048,
              "num_head_channels": 16}, (1, 4, 32, 32), (1, 8, 2048), {"unet_levels": "all"}),
    "flux": ({**FLUX_DEV, "hidden_size": 64, "num_heads": 4, "depth": 2,
              "depth_single_blocks": 2, "axes_dim": [4, 6, 6], "context_in_dim": 4096},
             (1, 16, 32, 32), (1, 8, 4096), {"skip_blocks": "none"}),
    "sd15": ({**SD15_UNET, "model_channels": 32, "num_heads": 2}, (1, 4, 32, 32), (1, 8, 768),
             {"unet_levels": "all"}),
    "wan": ({**WAN21_14B, "dim": 64, "ffn_dim": 128, "num_heads": 4, "num_layers": 2},
            (1, 16, 5, 16, 20), (1, 8, 4096), {"skip_blocks": "none"}),
    "hidream_o1": ({"image_model": "hidream_o1",
                    "text_config_overrides": {"hidden_size": 64, "intermediate_size": 128,
                                              "num_hidden_layers": 2, "num_attention_heads": 4,
                                              "num_key_value_heads": 2, "head_dim": 16,
                                              "rope_dims": [4, 2, 2]},
                    "vision_config_overrides": {"hidden_size": 32, "num_heads": 2,
                                                "intermediate_size": 64, "depth": 1,
                                                "num_position_embeddings": 16,
                                                "deepstack_visual_indexes": ()}},
                   (1, 3, 128, 160), (1, 8, 1), {"skip_blocks": "none"}),
    "krea2": ({"image_model": "krea2", "features": 64, "heads": 4, "kvheads": 2, "layers": 2,
               "txtdim": 32, "txtlayers": 2, "txtheads": 2, "txtkvheads": 2},
              (1, 16, 32, 40), (1, 8, 64), {"skip_blocks": "none"}),
    # 160x128 pixels, 22 frames: video [1, 24, 7, 8, 10] -> 7 x 4 x 5 tokens, audio 2 x 37
    "minimax_h3": ({"image_model": "minimax_h3", "hidden_size": 64, "num_layers": 2,
                    "token_refiner_num_layers": 1, "num_attention_heads": 4,
                    "attention_head_dim": 16, "ffn_hidden_size": 128, "text_dim": 32,
                    "timestep_input_dim": 32, "time_embed_hidden_size": 64,
                    "time_embed_dim": 32, "rope_inv_freq_len": 2},
                   ((1, 24, 7, 8, 10), (1, 32, 2, 37)), (1, 8, 64), {"skip_blocks": "none"}),
}


# the same classes at another size: the same small model (MiniMax H3's image to video: its
# first frame's keyframe, the vision block's tags over the small prompt's tokens 6 and 7; its
# reference to video: the same tags, two reference images of the canvas' 4 x 5 tokens, or at
# "max" of the full size's 64 x 114 or 34 x 60)
SMALL["sdxl_512"], SMALL["sd15_768"] = SMALL["sdxl"], SMALL["sd15"]
SMALL["minimax_h3_i2v"] = SMALL["minimax_h3_r2v"] = SMALL["minimax_h3"]
SMALL["minimax_h3_r2v_max"] = SMALL["minimax_h3_r2v_max_1080"] = SMALL["minimax_h3"]

COPIES = ("aten::_to_copy", "aten::copy_")
SCALAR_WRITE = "a Python number written into a tensor"


def _signature(ops: list[Op]) -> list[tuple[str, tuple[int, ...], str, bool]]:
    """The op list compared between a real and a meta run: name, output shape, dtype and
    whether the pack issued it, per op; copies left out (on meta a move between host and
    device is a copy, on a CPU run there is nothing to move). A Python number written into a
    slice (`t[..., 0] = 1`) is one write either way: PyTorch's indexing fills a CPU tensor from
    a lifted 0-dim scalar (lift_fresh, fill_) and copies a scalar made on a device, as on the
    GPU (scalar_tensor, its 0-dim view expanded, copy_). A tensor made from a Python list for a
    device (`torch.tensor(values, device=...)`) is lifted where it is made (lift_fresh returns
    its input: no kernel), on the CPU run only."""
    out: list[tuple[str, tuple[int, ...], str, bool]] = []
    for op in ops:
        name = op.name
        if name in COPIES or name == "aten::lift_fresh" or (name == "aten::scalar_tensor"
                                                             and op.shape == ()):
            continue
        if name == "aten::expand" and out and out[-1][:2] == ("aten::view", ()):
            out.pop()
            name = SCALAR_WRITE
        elif name == "aten::fill_.Tensor":
            name = SCALAR_WRITE
        out.append((name, op.shape, op.dtype, op.toma))
    return out


def validate_small(name: str, setting: Setting) -> dict[str, Any]:
    """One small model of `name`'s class, unmerged and with `setting` (plus SMALL's options),
    in float32, recorded for real on the CPU and on meta tensors: whether the op lists agree
    (_signature), and the recorded FLOPs, peak bytes and ops the pack issued of both."""
    spec = MODELS[name]
    unet_config, latent, text, options = SMALL[name]
    setting = Setting(setting.name, {**setting.options, **options})
    result: dict[str, Any] = {"model": name, "setting": setting.name}
    for variant in ("plain", "toma"):
        recorded = {}
        for real in (True, False):
            base = build_patcher(spec, unet_config, real=real, dtype=torch.float32)
            window = install_window(base)
            patcher = toma(base, setting) if variant == "toma" else base
            recorded[real] = record_call(patcher, window, spec,
                                         CallRecorder(owner_dirs(), simulate=not real),
                                         latent, text)
        same = _signature(recorded[True].ops) == _signature(recorded[False].ops)
        result[variant] = {
            "same_ops": same, "ops": len(recorded[False].ops),
            "flops_real": compute_flops(recorded[True].ops),
            "flops_meta": compute_flops(recorded[False].ops),
            "peak_real": recorded[True].peak_bytes, "peak_meta": recorded[False].peak_bytes,
            "toma_ops_real": sum(op[3] for op in _signature(recorded[True].ops)),
            "toma_ops_meta": sum(op[3] for op in _signature(recorded[False].ops)),
            "assumed": sorted({f"{op.assumed} at {op.where}" for op in recorded[False].ops
                               if op.assumed}),
        }
        if not same:
            result[variant]["first_difference"] = _first_difference(recorded[True].ops,
                                                                    recorded[False].ops)
    return result


def _first_difference(real: list[Op], meta: list[Op]) -> str:
    a, b = _signature(real), _signature(meta)
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"op {i}: real {x} vs meta {y}"
    return f"lengths {len(a)} vs {len(b)}"


# The section -------------------------------------------------------------------------------------
@dataclass
class Recorded:
    """One recorded call: its ops, its memory, and the wall seconds recording it took."""

    ops: list[Op]
    peak_bytes: int
    kept_bytes: int
    seconds: float


def record(patcher, window: _Window, spec: ModelSpec) -> Recorded:
    """Record `patcher`'s call of `spec` on meta tensors."""
    start = time.perf_counter()
    rec = record_call(patcher, window, spec, CallRecorder(owner_dirs()))
    return Recorded(rec.ops, rec.peak_bytes, rec.kept_bytes, time.perf_counter() - start)


def attention_length(ops: list[Op]) -> int:
    """The most frequent query length L of the recorded attention kernels ([B, H, L, D]), the
    shorter of two as frequent; kernels over a short prefix (L under 1/16 of the longest:
    HiDream-O1's layers attend over its prompt in a kernel of their own) left out."""
    lengths = [op.shape[2] for op in ops if op.kind == "attention" and len(op.shape) == 4]
    longest = max(lengths, default=0)
    counts: dict[int, int] = {}
    for n in lengths:
        if 16 * n >= longest:
            counts[n] = counts.get(n, 0) + 1
    return max(counts, key=lambda n: (counts[n], -n)) if counts else 0


def row(spec: ModelSpec, setting: Setting, plain: Recorded, merged: Recorded) -> dict[str, Any]:
    """The table row of one model and setting (COLUMNS, plus details for the JSON)."""
    a, b = project(plain.ops, H200), project(merged.ops, H200)
    return {
        "model": spec.label, "setting": setting.name, "ratio": setting.ratio,
        "scope": setting.scope, "batch": spec.batch,
        "attn_len": f"{attention_length(plain.ops)}->{attention_length(merged.ops)}",
        "ms": 1e3 * a.serial, "ms_toma": 1e3 * b.serial, "speedup": a.serial / b.serial,
        "launches": a.launches, "launches_toma": b.launches, "syncs": a.syncs,
        "syncs_toma": b.syncs, "toma_share": b.toma_share, "toma_ms": 1e3 * b.toma,
        "peak_gib": plain.peak_bytes / 2**30,
        "extra_mib": (merged.peak_bytes - plain.peak_bytes) / 2**20,
        "kept_mib": merged.kept_bytes / 2**20, "kept_mib_plain": plain.kept_bytes / 2**20,
        "ms_queued": 1e3 * a.queued, "ms_toma_queued": 1e3 * b.queued,
        "speedup_queued": a.queued / b.queued,
        "tflop": a.flops / 1e12, "tflop_toma": b.flops / 1e12,
        "gb": a.bytes / 1e9, "gb_toma": b.bytes / 1e9,
        "assumed_toma": sum(1 for op in merged.ops if op.assumed),
        "by_kind_ms": {k: 1e3 * v for k, v in a.by_kind.items()},
        "by_kind_ms_toma": {k: 1e3 * v for k, v in b.by_kind.items()},
        "toma_sites": toma_sites(merged.ops),
        "sync_sites": sorted({op.where for op in merged.ops if op.sync}),
        "sensitivity": sensitivity(plain.ops, merged.ops),
        **calibrated(plain.ops, merged.ops),
        "record_s": merged.seconds,
    }


def calibrated(plain: list[Op], merged: list[Op]) -> dict[str, Any]:
    """The calibrated projection's fields of one row: each call as max(host, GPU) under
    CALIBRATED (ms_cal, speedup_cal, the GPU and host parts, which bound wins), and the
    speedup with one of its assumptions changed."""
    a, b = project_bounded(plain, CALIBRATED), project_bounded(merged, CALIBRATED)
    out = {"ms_cal": 1e3 * a.seconds, "ms_cal_toma": 1e3 * b.seconds,
           "speedup_cal": a.seconds / b.seconds, "bound": a.bound, "bound_toma": b.bound,
           "gpu_ms_cal": 1e3 * a.gpu, "gpu_ms_cal_toma": 1e3 * b.gpu,
           "host_ms_cal": 1e3 * a.host, "host_ms_cal_toma": 1e3 * b.host,
           # the host's time per launch above which the ToMA call waits for the host
           "host_bound_us": 1e6 * b.gpu / max(1, sum(op.launches for op in merged
                                                     if not op.host))}
    changed = {}
    for label, change in CALIBRATED_SENSITIVITY.items():
        cal = dataclasses.replace(CALIBRATED, **change)
        changed[label] = (project_bounded(plain, cal).seconds
                          / project_bounded(merged, cal).seconds)
    out["sensitivity_cal"] = changed
    return out


def toma_sites(ops: list[Op], top: int = 8) -> list[str]:
    """The pack's code locations taking the most projected (serial) time, as
    "file:line function: ms (launches)"."""
    sites: dict[str, list[float]] = {}
    for op in ops:
        if op.toma and not op.host:
            entry = sites.setdefault(op.where, [0.0, 0])
            entry[0] += project([op], H200).serial
            entry[1] += op.launches
    ranked = sorted(sites.items(), key=lambda kv: -kv[1][0])[:top]
    return [f"{where}: {1e3 * t:.3f} ms ({n:.0f} launches)" for where, (t, n) in ranked]


def sensitivity(plain: list[Op], merged: list[Op]) -> dict[str, float]:
    """The speedup with one assumption changed (SENSITIVITY)."""
    out = {}
    for label, change in SENSITIVITY.items():
        gpu = dataclasses.replace(H200, **change)
        out[label] = project(plain, gpu).serial / project(merged, gpu).serial
    return out


def speed_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The paper's measured GPU gains as targets on the projected rows, roofline and
    calibrated: SDXL at ratio 0.5 (both settings), Flux at ratio 0.75; and the calibrated
    projection at the defaults at least those gains (SDXL 1.2x, Flux 1.3x)."""
    out = []
    for model, ratio, least in (("sdxl", 0.5, SDXL_TARGET), ("flux", 0.75, FLUX_TARGET)):
        label = MODELS[model].label
        for r in rows:
            if r["model"] == label and r["ratio"] == ratio:
                for key, what in (("speedup", "projected"), ("speedup_cal", "calibrated")):
                    out.append(goal(f"{what} H200 speedup {label}, {r['setting']} (ratio "
                                    f"{r['ratio']}, scope {r['scope']}) >= {least}", r, key,
                                    least))
    for model, paper_ratio, least in (("sdxl", 0.5, SDXL_TARGET), ("flux", 0.75, FLUX_TARGET)):
        label = MODELS[model].label
        for r in rows:     # the defaults' row where the loop above did not judge it already
            if r["model"] == label and r["setting"] == "default" and r["ratio"] != paper_ratio:
                out.append(goal(f"calibrated H200 speedup {label} at the defaults >= {least}",
                                r, "speedup_cal", least))
    return [t for t in out if t is not None]


def check(target: str, met: bool, value: str, why: str = "") -> dict[str, Any]:
    """A validation check in the suite's targets format."""
    out = {"target": target, "value": value, "met": met}
    if not met:
        out["why"] = why or "missed"
    return out


def flop_check(label: str, recorded: int, reference: int, against: str) -> dict[str, Any]:
    """Recorded FLOPs against another count, within FLOP_TOLERANCE."""
    diff = abs(recorded - reference) / reference
    return check(f"{label}: recorded FLOPs match {against} within {FLOP_TOLERANCE:.1%}",
                 diff <= FLOP_TOLERANCE,
                 f"{recorded / 1e12:.4f} vs {reference / 1e12:.4f} TFLOP ({diff:.3%} apart)")


def small_check(spec: ModelSpec, setting: Setting, small: dict[str, Any]) -> dict[str, Any]:
    """validate_small's result as a check: op lists and FLOPs agree, unmerged and ToMA."""
    parts = [small[v] for v in ("plain", "toma")]
    met = all(p["same_ops"] and p["flops_meta"] == p["flops_real"] for p in parts)
    toma = small["toma"]
    return check(f"{spec.label} {setting.name}: a small model's op list on meta tensors is the "
                 f"one it runs for real (unmerged and ToMA)", met,
                 f"{toma['ops']} ops, FLOPs and peak bytes equal: "
                 f"{toma['flops_meta'] == toma['flops_real']}, "
                 f"{toma['peak_meta'] == toma['peak_real']}; assumed answers: "
                 f"{'; '.join(toma['assumed']) or 'none'}",
                 "; ".join(p.get("first_difference", "") for p in parts))


def counted_flops(patcher, window: _Window, spec: ModelSpec) -> int:
    """FlopCounterMode's count of spec's recorded call, stacked on the recorder."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    record_call(patcher, window, spec, CallRecorder(owner_dirs()), extra=counter)
    return counter.get_total_flops()


def project_model(name: str, rows: list[dict[str, Any]], checks: list[dict[str, Any]]) -> str:
    """One model's rows (every setting of SETTINGS for it) and checks, appended; returns the
    wall-time line of its recording."""
    spec = MODELS[name]
    start = time.perf_counter()
    base = build_patcher(spec)
    window = install_window(base)
    plain = record(base, window, spec)
    mismatch = detection_mismatches(spec, base)
    checks.append(check(f"{spec.label}: configuration as ComfyUI's detection reads it",
                        not mismatch, "; ".join(mismatch) or "agrees"))
    recorded = compute_flops(plain.ops)
    checks.append(flop_check(spec.label, recorded, counted_flops(base, window, spec),
                             "FlopCounterMode"))
    hand = hand_flops(spec)
    if hand is not None:
        checks.append(flop_check(spec.label, recorded, hand, "the hand count"))
    per_setting = []
    for model, setting in SETTINGS:
        if model != name:
            continue
        with device_rules(on_gpu=not setting.cpu_rules):
            merged = record(toma(base, setting), window, spec)
        rows.append(row(spec, setting, plain, merged))
        small_start = time.perf_counter()
        small = validate_small(name, setting)
        rows[-1]["validation"] = small
        checks.append(small_check(spec, setting, small))
        if not checks[-1]["met"]:
            rows[-1]["flag"] = ("the small model's meta run left the path of its real run: "
                                "not a projection of what the code does")
        per_setting.append(f"ToMA {setting.name} {merged.seconds:.1f} s, its small-model "
                           f"validation {time.perf_counter() - small_start:.1f} s")
    return (f"{spec.label} {time.perf_counter() - start:.0f} s (unmerged call "
            f"{plain.seconds:.1f} s, " + ", ".join(per_setting) + ")")


def run(cfg: BenchConfig, models: tuple[str, ...] = ()) -> dict[str, Any]:
    """The section: rows per model and setting, notes, targets (see the module docstring);
    models: only these of MODELS (empty: every one)."""
    cfg.apply_threads()
    load_pack()
    rows: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    timing: list[str] = []
    absent: list[str] = []
    failed: list[str] = []
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        raise ValueError(f"gpu-model: no model {unknown}; known: {', '.join(MODELS)}")
    for name in dict.fromkeys(n for n, _ in SETTINGS if not models or n in models):
        spec = MODELS[name]
        if not present(spec):
            absent.append(spec.label)
            continue
        log.warning("gpu-model: %s", spec.label)
        try:
            timing.append(project_model(name, rows, checks))
        except Exception as exc:  # one broken model must not lose the others' rows
            log.exception("gpu-model: %s failed", spec.label)
            failed.append(f"{spec.label}: {type(exc).__name__}: {exc}")
    notes = [
        f"{H200.name}: bf16 {BF16_PEAK / 1e12:.0f} TFLOP/s and {H200.bandwidth / 1e12:.1f} TB/s "
        f"(measured on the project's H200), fp32 matmul {FP32_PEAK / 1e12:.1f} TFLOP/s, "
        f"{H200.launch_s * 1e6:.0f} us per launch, attention at "
        f"{H200.attention_efficiency:.0%} of the peak (assumptions: bench/gpu/projected_calls.py); "
        f"nothing computed: ComfyUI {comfy_version()}'s own classes at real size in bf16 on "
        "meta tensors, one model call through comfy.sample.sample; a projection, not a "
        "measurement",
        "ms: serial projection, per kernel max(FLOPs / peak, bytes / bandwidth) + launch cost "
        "(every kernel at the measured peaks: optimistic absolute times, quote the ratios); "
        "ms_queued: the same kernels on an asynchronous queue, the host waiting at syncs; "
        "attn_len: the most frequent attention query length, unmerged -> ToMA; "
        "toma_share: share of ms_toma in ops the pack's code issued; peak_gib: most live "
        "device memory during the unmerged call (weights and inputs not included); extra_mib: "
        "ToMA's peak minus that; kept_mib: device memory the ToMA call leaves alive (plans kept "
        "for the next layers and steps; the unmerged call keeps "
        f"{max((r['kept_mib_plain'] for r in rows), default=0.0):.1f} MiB); assumed_toma: "
        "host reads of values no projection can know, answered as in bench/gpu/projection.py",
        "calibrated (ms_cal): each call as max(host, GPU); GPU: every kernel at what its kind "
        f"and size reach ({CALIBRATED.sms} SMs, {CALIBRATED.tile[0]}x{CALIBRATED.tile[1]} output "
        "tiles: matrix products at their wave quantization; fused attention at "
        f"{CALIBRATED.attention_efficiency:.0%} of the measured peak (FlashAttention-2's 35% of "
        "the datasheet's); no kernel under "
        f"{CALIBRATED.kernel_floor_s * 1e6:.0f} us; {CALIBRATED.gap_s * 1e6:.0f} us between "
        f"kernels), host: {CALIBRATED.host_launch_s * 1e6:.0f} us to issue each kernel; bound: "
        "which of the two is longer; host_bound_us: the host's time per launch above which the "
        "ToMA call would wait for the host (sources and assumptions: "
        "bench/gpu/projected_calls.py)",
        "calibrated speedup with one assumption changed: " + "; ".join(
            f"{r['model']} {r['setting']}: " + ", ".join(
                f"{k} {v:.2f}x" for k, v in r["sensitivity_cal"].items()) for r in rows),
        "speedup with one assumption changed: " + "; ".join(
            f"{r['model']} {r['setting']}: " + ", ".join(
                f"{k} {v:.2f}x" for k, v in r["sensitivity"].items()) for r in rows),
        "ToMA's costliest code (serial ms, launches): " + "; ".join(
            f"{r['model']} {r['setting']}: " + ", ".join(r["toma_sites"][:3]) for r in rows),
        "host syncs in the ToMA calls: " + "; ".join(
            f"{r['model']} {r['setting']}: {', '.join(r['sync_sites']) or 'none'}"
            for r in rows),
        "wall time of the recording: " + "; ".join(timing),
    ]
    if absent:
        notes.append(f"not in ComfyUI {comfy_version()} (left out): " + ", ".join(absent))
    notes += [f"failed: {why}" for why in failed]
    return {"rows": rows, "columns": list(COLUMNS), "notes": notes,
            "targets": speed_targets(rows) + checks}
