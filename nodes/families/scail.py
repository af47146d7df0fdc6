"""SCAIL and SCAIL-2 (ComfyUI 0.33 and later): Wan 2.1's blocks and block loop over one stream
[reference frames][video grid][pose tokens], one timestep row for all tokens; the references
and pose tokens never merge (docs/compatibility.md). Continued chunks' anchored frames merge:
the sampler's noise mask, which this model is not handed, puts them back after every step."""

from __future__ import annotations

import dataclasses

from ..contracts import Sets, Takes
from ..dit_families import VIDEO_REGION_FRAMES, Family, set_grid
from . import conditioning, latent_tokens, patch_of
from .wan import CONTRACT as WAN_CONTRACT
from .wan import video_grid

MODELS = "SCAIL and SCAIL-2 (Wan 2.1)"

SCAIL = "comfy.ldm.wan.model:SCAILWanModel"
SCAIL2 = "comfy.ldm.wan.model:SCAIL2WanModel"

# Wan's kinds: raylight's SCAIL forward splits [references; video; pose] as Wan's splits Wan's
CONTRACT = dataclasses.replace(
    WAN_CONTRACT, label="SCAIL",
    models={SCAIL: (), SCAIL2: ()},
    needs=(
        conditioning("WAN21_SCAIL", ("reference_latent", "pose_latents")),
        Takes(f"{SCAIL}.forward_orig", ("reference_latent", "pose_latents"),
              why="the reference frames in front of the video and the pose tokens after it"),
        Sets("comfy.ldm.wan.model:WanModel.__init__", ("patch_size",)),
    ),
)


def family(diffusion_model) -> Family:
    patch = patch_of(diffusion_model.patch_size)

    def describe(call, base_model, arguments: dict) -> None:
        """The video's (t, h, w) grid after the reference frames' tokens (reference_latent
        [B, C, R, H, W]); the pose tokens are the stream's suffix."""
        set_grid(call, video_grid(arguments, patch),
                 prefix=latent_tokens(arguments.get("reference_latent"), patch))

    return Family("scail", "SCAIL", CONTRACT.kinds, patch, describe,
                  frames_per_region=VIDEO_REGION_FRAMES)
