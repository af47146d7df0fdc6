"""SCAIL and SCAIL-2 (ComfyUI 0.33 and later; conditioned by WanSCAILToVideo): Wan 2.1's blocks
and block loop over one stream [reference frames][video grid][pose tokens], one timestep row
for all tokens. The reference images' latents (one latent frame each) in front and the pose
video's tokens (its latent at half the video's size, patch-embedded apart) after the grid never
merge; the RoPE rows of the merged video tokens follow them. SCAIL-2's identity masks are added
to the patch embeddings, so every token carries its share into the blocks and merges with it.

The leading frames a continued chunk anchors (WanSCAILToVideo's previous_frames) are held by
the sampler's noise mask, which this model (Wan 2.1: one timestep for all frames) is not
handed: they merge as the other frames do, and the sampler puts them back after every step."""

from __future__ import annotations

from ..contracts import Contract, Sets, Takes
from ..dit_families import VIDEO_REGION_FRAMES, Family, set_grid
from . import conditioning, latent_tokens, patch_of
from .wan import CONTRACT as WAN_CONTRACT
from .wan import KINDS as WAN_KINDS
from .wan import video_grid

MODELS = "SCAIL and SCAIL-2 (Wan 2.1)"

# raylight's SCAIL forward splits [references; video; pose] as Wan's forward splits Wan's stream
KINDS = WAN_KINDS

SCAIL = "comfy.ldm.wan.model:SCAILWanModel"
SCAIL2 = "comfy.ldm.wan.model:SCAIL2WanModel"

CONTRACT = Contract(
    "SCAIL",
    models={SCAIL: (), SCAIL2: ()},
    needs=(
        conditioning("WAN21_SCAIL", ("reference_latent", "pose_latents")),
        Takes(f"{SCAIL}.forward_orig", ("reference_latent", "pose_latents"),
              why="the reference frames in front of the video and the pose tokens after it"),
        Sets("comfy.ldm.wan.model:WanModel.__init__", ("patch_size",)),
    ),
    blocks=WAN_CONTRACT.blocks,
    kinds=KINDS,
)


def family(diffusion_model) -> Family:
    patch = patch_of(diffusion_model.patch_size)

    def describe(call, base_model, arguments: dict) -> None:
        """The video's (t, h, w) grid after the reference frames' tokens (reference_latent
        [B, C, R, H, W]); the pose tokens are the stream's suffix."""
        set_grid(call, video_grid(arguments, patch),
                 prefix=latent_tokens(arguments.get("reference_latent"), patch))

    return Family("scail", "SCAIL", KINDS, patch, describe,
                  frames_per_region=VIDEO_REGION_FRAMES)
