"""HunyuanVideo 1.0 (text- and image-to-video) and 1.5: Flux's double and single blocks on video
tokens. Before ComfyUI 0.33 the image comes first ([image; text], `flipped_img_txt`), from 0.33
the text. Reference latents are put in front of the video tokens, and the image-to-video
"replace" mode modulates the first frame on its own: neither merges."""

from __future__ import annotations

import math

from ..dit_families import VIDEO_REGION_FRAMES, BlockKind, Family, latent_grid, set_grid

# the models of this family, as the node's error and the README name them
MODELS = "HunyuanVideo 1.0/1.5"


def kinds(flipped: bool) -> tuple[BlockKind, ...]:
    return (BlockKind("double_block", "double_blocks", "d", "after" if flipped else "before",
                      mask="attention_mask"),
            BlockKind("single_block", "single_blocks", "s",
                      "stream_after" if flipped else "stream_before", txt=None,
                      mask="attention_mask"))


def family(diffusion_model) -> Family | None:
    from comfy.ldm.hunyuan_video.model import HunyuanVideo

    if type(diffusion_model) is not HunyuanVideo or len(diffusion_model.patch_size) != 3:
        return None     # 2-D patches: HunyuanImage 2.1 (families/hunyuan_image.py)
    patch = tuple(int(p) for p in diffusion_model.patch_size)
    flipped = bool(getattr(diffusion_model.double_blocks[0], "flipped_img_txt", False))

    def describe(call, base_model, arguments: dict) -> None:
        """The (t, h, w) grid of latent x; reference latent tokens in front, and the first frame
        when a guiding frame gets its own modulation, never merge."""
        ref = latent_grid(arguments.get("ref_latent"), patch)
        guided = arguments.get("guiding_frame_index") is not None
        set_grid(call, latent_grid(arguments.get("x"), patch),
                 prefix=math.prod(ref) if ref else 0, protect_frames=1 if guided else 0)

    return Family("hunyuan_video", "HunyuanVideo", kinds(flipped), patch, describe,
                  frames_per_region=VIDEO_REGION_FRAMES)
