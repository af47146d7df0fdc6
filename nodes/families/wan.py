"""Wan 2.1 / 2.2 and its variants on Wan's blocks: one kind of block, self-attention over the
video tokens (the text is cross-attention context), per-frame modulation rows where each latent
frame has its own timestep (Wan 2.2 5B), one row for every token on VACE and camera control.

Given frames (describe's readers say which) never merge: merged with generated ones they blur
what the video takes from them (test_dit_families.py's test_start_image_dependence). Embeddings
added before the blocks (camera, Animate's pose latents) merge with their tokens; the blocks
ComfyUI calls outside the "dit" patches (VACE's context blocks, Animate's face adapter) run on
the full-length stream ToMA has put back."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ..contracts import Contract, Probe, Sets, Takes, bare, claimed, resolve
from ..dit_families import (
    VIDEO_REGION_FRAMES,
    BlockKind,
    Family,
    ShardKind,
    TextAt,
    host_read,
    latent_grid,
    leading_true,
    set_grid,
)
from ..model_call import ModelCall
from . import conditioning

MODELS = "Wan 2.1/2.2 (and VACE, Fun control and camera control, Animate)"

KINDS = (BlockKind("double_block", "blocks", "", TextAt.NONE, rows=("vec",), rows_dims=4,
                   shard=ShardKind()),)
# VACE's and the camera model's blocks get one modulation for every token, e0 [B, 6, C] (both
# embed t [B]), not WanModel's [B, frames, 6, C] rows
UNIFORM_KINDS = (BlockKind("double_block", "blocks", "", TextAt.NONE, shard=ShardKind()),)
# WanVaceToVideo's VACE context per input: 32 latent channels (inactive, reactive), then the
# control mask folded into 8 x 8 = 64 channels (one per pixel of a latent cell).
VACE_MASK_CHANNELS = 64

NOT_MERGED = {
    "WanAnimate2Model": "Wan Animate 2's self-attention splits the video's queries frame by "
                        "frame, each frame attending its own pose frame, with one length "
                        "(hw) for a frame of queries, its pose frame's keys and the "
                        "reference frame; merged frames shorter than hw could keep neither "
                        "the reference frame nor the pose frames whole",
    "WanModel_S2V": "Wan S2V spreads its timestep rows over the sequence by position (with "
                    "motion frames two a frame plus three, across video, reference and motion "
                    "tokens), so a shorter merged sequence would hand tokens other rows",
    "HumoWanModel": "HuMo's audio cross-attention cuts the video's tokens into equal parts, one "
                    "a frame, and WanHuMoImageToVideo always appends a reference frame (zeros "
                    "without a reference image) that must not merge, so merged frames could "
                    "not be equal parts",
}

WAN = "comfy.ldm.wan.model:WanModel"
VACE = "comfy.ldm.wan.model:VaceWanModel"
CAMERA = "comfy.ldm.wan.model:CameraWanModel"
ANIMATE = "comfy.ldm.wan.model_animate:AnimateWanModel"

CONTRACT = Contract(
    "Wan",
    models={
        WAN: (),
        VACE: (conditioning("WAN21_Vace", ("vace_context",)),
               Probe("comfy.model_base:WAN21_Vace.extra_conds", lambda f: probe_vace(f),
                     why="the VACE mask ToMA reads kept frames from")),
        CAMERA: (),
        ANIMATE: (),
    },
    needs=(
        Takes("comfy.model_base:BaseModel._apply_model", ("c_concat",)),
        conditioning("BaseModel", ("c_concat",)),
        conditioning("WAN21", ("time_dim_concat", "reference_latent")),
        conditioning("WAN22", ("denoise_mask",)),
        Probe("comfy.model_base:WAN21.concat_cond", lambda f: probe_concat(f),
              why="the concatenated mask or image ToMA reads given frames from"),
        Sets("comfy.ldm.wan.model:WanModel.__init__", ("patch_size", "ref_conv")),
    ),
    blocks={"blocks": ("x", "e", "freqs", "context")},
    kinds=KINDS,
)


def family(diffusion_model) -> Family:
    patch = tuple(int(p) for p in diffusion_model.patch_size)

    def describe(call, base_model, arguments: dict) -> str | None:
        """The video's (t, h, w) grid; a Wan Fun reference frame in front (ref_conv) and the
        given frames (the most any reader below finds) never merge."""
        grid = video_grid(arguments, patch)
        ref = (diffusion_model.ref_conv is not None
               and arguments.get("reference_latent") is not None and grid is not None)
        kept = 0
        if grid is not None:
            c_concat, x = arguments.get("c_concat"), arguments.get("x")
            kept = max(zero_timestep_frames(call, arguments.get("denoise_mask"), grid[0]),
                       given_frames(call, concat_mask(c_concat, x)),
                       vace_kept_frames(call, arguments.get("vace_context"), grid[0]),
                       image_frames(call, c_concat, x))
        set_grid(call, grid, prefix=grid[1] * grid[2] if ref else 0, protect_frames=kept)
        if grid is not None and kept >= grid[0]:
            return ("every frame of the video is given (a start image or reference fills it), so "
                    "no frame can merge; those model calls run unmerged")
        return None

    kinds = KINDS if claimed(CONTRACT, diffusion_model) in (WAN, ANIMATE) else UNIFORM_KINDS
    return description(patch, describe, kinds)


def video_grid(arguments: dict, patch: tuple[int, int, int]) -> tuple[int, int, int] | None:
    """The (t, h, w) grid of latent x, with the frames time_dim_concat appends."""
    grid, extra = (latent_grid(arguments.get(name), patch) for name in ("x", "time_dim_concat"))
    return grid if grid is None or extra is None else (grid[0] + extra[0], *grid[1:])


def zero_timestep_frames(call: ModelCall, mask: object, frames: int) -> int:
    """Leading latent frames a denoise mask [B|1, C|1, T, H, W] keeps entirely (all zero):
    image-to-video conditioning frames. 0 without such a mask (host_read)."""
    if not torch.is_tensor(mask) or mask.dim() != 5 or mask.shape[2] != frames:
        return 0
    return host_read(call, ("zero_timestep_frames", tuple(mask.shape)), lambda: leading_true(
        (mask.float().abs().amax(dim=(0, 1, 3, 4)) == 0).tolist()))


def given_frames(call: ModelCall, mask: object) -> int:
    """Leading latent frames a concatenated image-to-video mask [B, C, T, H, W] marks as given
    entirely (all 1, on the start image's frames). 0 without such a mask (host_read)."""
    if not torch.is_tensor(mask) or mask.dim() != 5:
        return 0
    return host_read(call, ("given_frames", tuple(mask.shape)), lambda: leading_true(
        (mask.float().amin(dim=(0, 1, 3, 4)) == 1).tolist()))


def concat_mask(c_concat: object, x: object) -> object:
    """The mask channels [B, 4, T, H, W] of Wan's concatenated image-to-video input
    (WAN21.concat_cond: before the C-channel image latent, or after a control latent: 2C + 4),
    or None."""
    if not torch.is_tensor(c_concat) or not torch.is_tensor(x) or c_concat.dim() != 5:
        return None
    latent = int(x.shape[1])
    start = {latent + 4: 0, 2 * latent + 4: latent}.get(int(c_concat.shape[1]))
    return None if start is None else c_concat[:, start:start + 4]


def image_frames(call, c_concat: object, x: object) -> int:
    """Leading latent frames of a mask-less concatenated image latent not all 0 in some batch
    item (the node's empty frames are exact zeros after process_latent_in): c_concat
    [B, C, T, H, W] itself (Camera 2.1) or its last C of 2C channels (Fun control 2.1, the
    control latent first). 0 for other layouts (host_read)."""
    if not torch.is_tensor(c_concat) or not torch.is_tensor(x) or c_concat.dim() != 5:
        return 0
    latent = int(x.shape[1])
    if int(c_concat.shape[1]) not in (latent, 2 * latent):
        return 0
    return host_read(call, ("image_frames", tuple(c_concat.shape)), lambda: leading_true(
        (c_concat[:, -latent:].float().abs().amax(dim=(0, 1, 3, 4)) > 0).tolist()))


def vace_kept_frames(call, vace_context: object, frames: int) -> int:
    """The most leading latent frames whose VACE mask is all 0 in one VACE input of a context
    [B, inputs, 32 + 64, T, H, W] (latents, then mask channels). 0 without one (host_read)."""
    if (not torch.is_tensor(vace_context) or vace_context.dim() != 6
            or vace_context.shape[3] != frames):
        return 0

    def read() -> int:
        masks = vace_context[:, :, -VACE_MASK_CHANNELS:].float()
        kept = (masks.abs().amax(dim=(0, 2, 4, 5)) == 0).tolist()     # [inputs][T], one read
        return max(leading_true(flags) for flags in kept)

    return host_read(call, ("vace_kept_frames", tuple(vace_context.shape)), read)


# Probes of the conditioning layouts the readers above read: three latent frames of 2 x 2
# cells, the first given (its concat_mask or VACE mask 0, an image there only).
_C, _FRAMES = 16, 3


def _first_frame(channels: int, value: float, rest: float) -> torch.Tensor:
    out = torch.full((1, channels, _FRAMES, 2, 2), rest)
    out[:, :, 0] = value
    return out


def _probe_call() -> SimpleNamespace:
    """The frame readers' host-read memo, as a ModelCall holds it."""
    return SimpleNamespace(identity=None, run=SimpleNamespace(host_reads={}))


def _bare_model(path: str, in_dim: int) -> object:
    """A bare model_base model of class `path` (there: its probed method is) whose diffusion
    model takes `in_dim` channels, with a latent format of _C channels that leaves latents as
    they are."""
    weight = SimpleNamespace(weight=torch.empty(0, in_dim))
    return bare(resolve(path)[0], diffusion_model=SimpleNamespace(patch_embedding=weight),
                latent_format=SimpleNamespace(latent_channels=_C, process_in=lambda x: x),
                image_to_video=True)


def probe_concat(concat_cond) -> list[str]:
    """WAN21.concat_cond on every layout ToMA reads given frames from (a start image, 0.5 on
    frame 0, with or without its mask and a control latent in front): what describe's readers
    of c_concat read as another count than the one given frame."""
    noise, image, control = (torch.zeros(1, _C, _FRAMES, 2, 2), _first_frame(_C, 0.5, 0.0),
                             torch.ones(1, _C, _FRAMES, 2, 2))
    mask, both = _first_frame(1, 0.0, 1.0), torch.cat((control, image), dim=1)
    cases = (("a start image with its mask", 2 * _C + 4,
              {"concat_latent_image": image, "concat_mask": mask}),
             ("a control latent and a start image with its mask", 3 * _C + 4,
              {"concat_latent_image": both, "concat_mask": mask, "concat_mask_index": _C}),
             ("a start image without a mask", 2 * _C, {"concat_latent_image": image}),
             ("a control latent and a start image without a mask", 3 * _C,
              {"concat_latent_image": both}))
    out = []
    for what, in_dim, given in cases:
        model = _bare_model("comfy.model_base:WAN21", in_dim)
        c_concat = concat_cond(model, noise=noise, device=noise.device, **given)
        call = _probe_call()
        found = max(given_frames(call, concat_mask(c_concat, noise)),
                    image_frames(call, c_concat, noise))
        if found != 1:
            out.append(f"lays out {what} where ToMA reads {found} given frames, not 1")
    return out


def probe_vace(extra_conds) -> list[str]:
    """WAN21_Vace.extra_conds on one VACE input whose mask is 0 on frame 0: what
    vace_kept_frames reads from its vace_context, if not that one frame."""
    noise = torch.zeros(1, _C, _FRAMES, 2, 2)
    model = _bare_model("comfy.model_base:WAN21_Vace", _C)
    conds = extra_conds(model, noise=noise, device=noise.device,
                        vace_frames=[torch.full((1, 2 * _C, _FRAMES, 2, 2), 0.5)],
                        vace_mask=[_first_frame(VACE_MASK_CHANNELS, 0.0, 1.0)])
    found = vace_kept_frames(_probe_call(), conds["vace_context"].cond, _FRAMES)
    return [] if found == 1 else [f"gives a vace_context where ToMA reads {found} kept frames, "
                                  f"not 1"]


def description(patch: tuple[int, int, int], describe=None,
                kinds: tuple[BlockKind, ...] = KINDS) -> Family:
    return Family("wan", "Wan", kinds, patch, describe, frames_per_region=VIDEO_REGION_FRAMES)
