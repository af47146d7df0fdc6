"""SCAIL and SCAIL-2 (SCAILWanModel, SCAIL2WanModel, ComfyUI 0.33 and later; conditioned by
WanSCAILToVideo): Wan 2.1's blocks and block loop over one stream

    [reference frames][video grid][pose tokens]

The reference images' latents (reference_latent: the additional references, then the primary
one, one latent frame each) are put in front of the video in time and never merge; the pose
video's tokens (its latent at half the video's size, through their own patch embedding) come
after the grid and never merge either. SCAIL-2's identity masks are added to the patch
embeddings before the blocks, so every token carries its own share into the blocks and merges
with it. The RoPE rows cover the whole stream (references, video, pose) and those of the
merged video tokens follow them; the timestep modulation is one row for all tokens. The blocks
and the "double_block" patches after them see the full stream; ComfyUI cuts the pose tokens and
the references off after the head.

The leading frames a continued chunk anchors (WanSCAILToVideo's previous_frames) are held by
the sampler's noise mask, which this model (Wan 2.1: one timestep for all frames) is not
handed: they merge as the other frames do, and the sampler puts them back after every step."""

from __future__ import annotations

import math

from ..contracts import Contract, Gives, Sets, Takes
from ..dit_families import VIDEO_REGION_FRAMES, Family, latent_grid, set_grid
from .wan import CONTRACT as WAN_CONTRACT
from .wan import KINDS as WAN_KINDS
from .wan import video_grid

MODELS = "SCAIL and SCAIL-2 (Wan 2.1)"

# Wan's blocks; raylight's SCAIL forward splits [references; video; pose] as Wan's forward
# splits Wan's stream
KINDS = WAN_KINDS

SCAIL = "comfy.ldm.wan.model:SCAILWanModel"
SCAIL2 = "comfy.ldm.wan.model:SCAIL2WanModel"

CONTRACT = Contract(
    "SCAIL",
    models={SCAIL: (), SCAIL2: ()},
    needs=(
        Gives("comfy.model_base:WAN21_SCAIL.extra_conds", ("reference_latent", "pose_latents"),
              what="conditioning"),
        Takes(f"{SCAIL}.forward_orig", ("reference_latent", "pose_latents"),
              why="the reference frames in front of the video and the pose tokens after it"),
        Sets("comfy.ldm.wan.model:WanModel.__init__", ("patch_size",)),
    ),
    blocks=WAN_CONTRACT.blocks,
    kinds=KINDS,
)


def family(diffusion_model) -> Family:
    return description(tuple(int(p) for p in diffusion_model.patch_size))


def description(patch: tuple[int, int, int] = (1, 2, 2)) -> Family:
    def describe(call, base_model, arguments: dict) -> None:
        """The (t, h, w) grid of latent x (plus frames appended by time_dim_concat); the
        reference frames' tokens in front of it (reference_latent [B, C, R, H, W]) never
        merge; the pose tokens after it are the stream's suffix."""
        reference = latent_grid(arguments.get("reference_latent"), patch)
        set_grid(call, video_grid(arguments, patch),
                 prefix=math.prod(reference) if reference else 0)

    return Family("scail", "SCAIL", KINDS, patch, describe,
                  frames_per_region=VIDEO_REGION_FRAMES)
