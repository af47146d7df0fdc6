"""HunyuanVideo 1.0 (text- and image-to-video) and 1.5: Flux's double and single blocks on video
tokens. Where ComfyUI builds the double blocks with `flipped_img_txt` the image comes first
([image; text]), elsewhere the text. Reference latents are put in front of the video tokens,
and the image-to-video "replace" mode modulates the first frame on its own: neither merges."""

from __future__ import annotations

from ..contracts import Contract, JoinOrder
from ..dit_families import VIDEO_REGION_FRAMES, BlockKind, Family, TextAt, latent_grid, set_grid
from . import conditioning, latent_tokens, patch_of
from .flux import CONTRACT as FLUX_CONTRACT

MODELS = "HunyuanVideo 1.0/1.5"

# the flag on the double blocks that says the image comes first
FLIPPED = "flipped_img_txt"


def kinds(flipped: bool) -> tuple[BlockKind, ...]:
    return (BlockKind("double_block", "double_blocks", "d",
                      TextAt.AFTER if flipped else TextAt.BEFORE, mask="attention_mask"),
            BlockKind("single_block", "single_blocks", "s",
                      TextAt.STREAM_AFTER if flipped else TextAt.STREAM_BEFORE, txt=None,
                      mask="attention_mask"))


HUNYUAN_VIDEO = "comfy.ldm.hunyuan_video.model:HunyuanVideo"
RAYLIGHT_REFUSAL = ("raylight's HunyuanVideo forward fails whenever a block patch is installed "
                    "(its patched-block branch returns a tuple where the image is expected)")

CONTRACT = Contract(
    "HunyuanVideo",
    models={HUNYUAN_VIDEO: (
        # the single blocks' sequence: [text; image], or [image; text] where the double blocks
        # are built flipped (the flag ToMA reads the order from)
        JoinOrder(f"{HUNYUAN_VIDEO}.forward_orig", "img", ("txt", "img"),
                  f"{HUNYUAN_VIDEO}.__init__", FLIPPED,
                  "comfy.ldm.flux.layers:DoubleStreamBlock.__init__"),
    )},
    needs=(conditioning("HunyuanVideo", ("ref_latent", "guiding_frame_index")),),
    blocks=FLUX_CONTRACT.blocks,        # Flux's block classes
    kinds=kinds(False),
)


def claims(diffusion_model) -> bool:
    """HunyuanVideo's class with 3-D patches (2-D: HunyuanImage 2.1, families/hunyuan_image)."""
    return len(diffusion_model.patch_size) == 3


def flipped(diffusion_model) -> bool:
    """Whether the model's double blocks put the image first."""
    return bool(getattr(diffusion_model.double_blocks[0], FLIPPED, False))


def family(diffusion_model) -> Family:
    patch = patch_of(diffusion_model.patch_size)

    def describe(call, base_model, arguments: dict) -> None:
        """The (t, h, w) grid of latent x; reference latent tokens in front, and the first frame
        when a guiding frame gets its own modulation, never merge."""
        guided = arguments.get("guiding_frame_index") is not None
        set_grid(call, latent_grid(arguments.get("x"), patch),
                 prefix=latent_tokens(arguments.get("ref_latent"), patch),
                 protect_frames=1 if guided else 0)

    return Family("hunyuan_video", "HunyuanVideo", kinds(flipped(diffusion_model)), patch,
                  describe, frames_per_region=VIDEO_REGION_FRAMES,
                  sequence_parallel_refusal=RAYLIGHT_REFUSAL)
