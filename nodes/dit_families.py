"""What ToMA needs to know about each diffusion transformer family ComfyUI runs (dit_patch.py
is the one patch that reads it): which blocks get a patch and how, and where the image grid
sits in a block call's arguments (`BlockKind`); the patch size that turns the latent into the
(t, h, w) token grid, the default regions, and how one model call's inputs are read into the
ModelCall (`Family.describe`).

Token layout in a block call, per kind (stream = the tensor holding the image grid):

    stream = [prefix][grid: t*h*w tokens][suffix]

prefix: the text when it is in the stream and comes first (TextAt.STREAM_BEFORE), then tokens
that never merge (reference latents put in front, image-to-video conditioning frames); suffix:
everything after the grid (reference images, padding, text that comes last, guide frames).
Positional rows (RoPE) and attention masks follow the attention sequence, which also holds the
text when the block attends over [text; image] (BEFORE) or [image; text] (AFTER). Modulation
rows are spread evenly over the stream: R rows of L / R tokens each (one row for all, one per
token or one per frame).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum, auto

import torch

from .model_call import ModelCall

# tile_count 0: regions of about REGION_TOKENS tokens, VIDEO_REGION_FRAMES frames deep for
# video: the sizes whose merged blocks and samples stayed closest to unmerged among those tried
# (docs/compatibility.md, settings for the transformer families).
REGION_TOKENS = 64
VIDEO_REGION_FRAMES = 2


class TextAt(Enum):
    """Where a block's text is: BEFORE / AFTER the image in the attention, from a text stream
    of its own; STREAM_BEFORE / STREAM_AFTER the image in the stream itself; NONE: the text is
    not among the attended tokens (cross-attention context, or no text)."""

    BEFORE = auto()
    AFTER = auto()
    STREAM_BEFORE = auto()
    STREAM_AFTER = auto()
    NONE = auto()


@dataclass(frozen=True)
class ShardKind:
    """How raylight's sequence-parallel forward (sequence_parallel.py) hands one kind of block
    its shard. text_in_stream: the stream is a shard of [text; grid; ...], the text length the
    first item of transformer_options["img_slice"] (the whole text's on every rank) where
    raylight sets it, else ModelCall.txt_len; pe_item: the positional-rows argument is a list
    whose item `pe_item` holds the stream's rows ([image rows, text rows]), None: it is the
    stream's rows alone."""

    text_in_stream: bool = False
    pe_item: int | None = None


@dataclass(frozen=True)
class BlockKind:
    """One kind of block and how its call carries the tokens (argument names; None: none).

    key: the "dit" replace key ("double_block"/"single_block"); modules: the diffusion model's
    attribute holding these blocks; letter: its skip_blocks label ("" in one-kind families);
    text: where the text is; stream / txt / pe / mask: the image stream, the separate text
    stream, the positional rows and the attention mask; mask_dims: the mask's token dims;
    rows: arguments holding modulation rows along dim 1 (per-frame or per-token timestep
    embeddings), plain tensors or held in an object the family's `held_rows` reads;
    rows_dims: how many dims a plain tensor of rows has (None: 3 or more); one of other dims
    is one modulation for every token (an e0 [B, 6, C] that other packs' copies of a forward
    pass instead of ComfyUI's [B, F, 6, C]);
    more_pe: other positional rows over the same sequence (the video side of an audio-video
    attention); positional rows are a tensor or a tuple whose tensors are rows (a (rotation,
    split) pair);
    stream_pe: positional rows over the stream alone, for a block that also attends over the
    stream without the text (an image self-attention beside a joint one);
    pe_heads: the positional rows are [1, L, D], broadcast over the block's [B, H, L, D]
    queries and keys: merged per batch item they become [B, 1, L', D];
    stream_item: the stream argument is a tuple ((video, audio)) whose item this is;
    opaque: arguments the patch cannot line up with a merged sequence (an attention mask
    addressing fixed token spans): a block call where one is set runs unmerged;
    shortened: (name, shorten) pairs of arguments over the sequence whose entries are alike
    for every token up to the grid's end (an attention bias): shorten(value, end, removed)
    gives the argument with `removed` of its first `end` tokens merged away (those entries
    dropped, the ones after moved back), or None where the alike entries do not end at `end`
    (the block then runs unmerged); for kinds whose blocks merge their whole stream;
    batched: False where the stream argument is one item's tokens [L, C] without a batch axis;
    spans: arguments listing the stream's token spans as (start, stop, value...) tuples (one
    modulation row per span): spans before the grid are kept, the grid's own becomes the
    merged grid's, those after it move with it; a span cutting into the grid, or holding a
    tensor of per-token values over it, makes the block run unmerged;
    positions: arguments holding token positions in the stream, fixed before the blocks run
    (where references get timestep zero's modulation: an index or (start, end, ...) spans),
    moved back past the grid in a merged call (token_layout.moved_positions); with hook "dit"
    ComfyUI's block loop hands them to the block's forward, which ToMA then patches too;
    grid_axes: the stream argument is the grid alone, [B, T, H, W, C]: read as [B, T*H*W, C],
    a merged one handed over as [B, 1, 1, M, C];
    hook: "dit" (replace patch) or "object" (patch of the block's forward);
    attention_scope: merge_scope "attention" merges only these blocks' image attention (the
    family's attention_hooks);
    shard: how raylight's sequence-parallel forward (read in raylight 1.5.1) hands these
    blocks their shard; None: such blocks run unmerged under it;
    returns: for an object-patched block whose forward returns a tuple (image and text
    tokens), the argument names of its items; () when it returns the stream alone;
    takes_options: False where the block's forward takes no transformer_options (hook
    "object"): a merged call hands it none (its attention gets no size bias), and a second
    ToMA node, which could not see the sequence flagged as merged, leaves such blocks to the
    first.
    """

    key: str
    modules: str
    letter: str
    text: TextAt
    stream: str = "img"
    txt: str | None = "txt"
    pe: str | None = "pe"
    mask: str | None = None
    mask_dims: tuple[int, ...] = (-2, -1)
    rows: tuple[str, ...] = ()
    rows_dims: int | None = None
    more_pe: tuple[str, ...] = ()
    stream_pe: tuple[str, ...] = ()
    pe_heads: bool = False
    stream_item: int | None = None
    opaque: tuple[str, ...] = ()
    shortened: tuple[tuple[str, Callable[[object, int, int], object | None]], ...] = ()
    batched: bool = True
    spans: tuple[str, ...] = ()
    positions: tuple[str, ...] = ()
    grid_axes: bool = False
    hook: str = "dit"
    returns: tuple[str, ...] = ()
    attention_scope: bool = False
    shard: ShardKind | None = None
    takes_options: bool = True
    # the stream argument is the grid tensor itself (read without a further call per block)
    bare: bool = field(init=False, repr=False, compare=False)
    # every positional-rows argument (pe, more_pe, stream_pe), named once for the hot path
    pe_names: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "bare", self.stream_item is None and self.batched
                           and not self.grid_axes)
        object.__setattr__(self, "pe_names", tuple(
            name for name in (self.pe, *self.more_pe, *self.stream_pe) if name))

    @property
    def arguments(self) -> tuple[str, ...]:
        """The arguments of a block call of this kind that ToMA reads or rewrites by name (the
        opaque and shortened ones aside: a block loop may not hand them at all): what a
        family's contract requires ComfyUI's block loop or the block's forward to name so."""
        names = (self.stream, self.txt, self.pe, self.mask, *self.rows, *self.more_pe,
                 *self.stream_pe, *self.spans)
        return tuple(dict.fromkeys(name for name in names if name))


@dataclass(frozen=True)
class HeldRows:
    """Modulation rows a family's blocks get inside an object rather than as a tensor
    (compressed timesteps). read(value) -> (rows [B, R, C], tokens each row covers), or None
    for a value it does not hold; write(value, rows, tokens) -> an object of the same kind
    holding `rows`, each covering `tokens` tokens."""

    read: Callable[[object], tuple[torch.Tensor, int] | None]
    write: Callable[[object, torch.Tensor, int], object]


@dataclass(frozen=True)
class Family:
    """One model family: its blocks, token grid and per-call reading.

    patch: (t, h, w) patch size (images: t 1); tile_count 0 gives regions of about
    `tokens_per_region` tokens, `frames_per_region` frames deep;
    describe(call, base_model, arguments): reads one model call (apply_model's arguments by
    name) into `call`; returns why the call cannot merge when the user should know, else None;
    held_rows: how its blocks hold modulation rows that are not plain tensors, if they do;
    prefix_cache: its one kind of block attends over a causal prompt first in the sequence,
    whose keys and values ToMA keeps across steps (prefix_cache.py; describe puts its length
    in call.prompt_length);
    foreign_block(patch): why a block holding another node's "dit" replace patch `patch` must
    not merge (it reads the block's whole sequence by a layout merging would break), or None;
    such blocks run unmerged when ToMA wraps the patch (the run says so where it replaced
    ToMA's);
    sequence_parallel_refusal: why ToMA leaves this family alone under raylight's
    sequence-parallel forward (saying so), or None;
    attention_hooks: where merge_scope "attention" applies to some of its kinds
    (BlockKind.attention_scope), what makes the hooks of one node: `install(model, patches,
    indices)` puts them on those blocks, `run(index, plan, merged_args, run)` runs one block
    with only its attention merged.
    """

    name: str
    label: str
    kinds: tuple[BlockKind, ...]
    patch: tuple[int, int, int]
    describe: Callable[[ModelCall, object, dict], str | None]
    tokens_per_region: int = REGION_TOKENS
    frames_per_region: int = 1
    held_rows: HeldRows | None = None
    prefix_cache: bool = False
    foreign_block: Callable[[Callable], str | None] | None = None
    sequence_parallel_refusal: str | None = None
    attention_hooks: Callable[[], object] | None = None


# Reading a model call -------------------------------------------------------------------------
def latent_grid(x: object, patch: tuple[int, int, int]) -> tuple[int, int, int] | None:
    """(t, h, w) tokens of a latent [B, C, H, W] or [B, C, T, H, W], each side padded up to
    the patch size (what every family here does); None for anything else."""
    return shape_grid(x.shape, patch) if torch.is_tensor(x) else None


def shape_grid(shape: object, patch: tuple[int, int, int]) -> tuple[int, int, int] | None:
    """latent_grid of a latent's shape (a packed latent's `latent_shapes` entry)."""
    if not isinstance(shape, (tuple, list, torch.Size)) or len(shape) not in (4, 5):
        return None
    sides = (1, *shape[-2:]) if len(shape) == 4 else tuple(shape[-3:])
    return tuple(math.ceil(int(s) / p) for s, p in zip(sides, patch, strict=True))


def set_grid(call: ModelCall, grid: tuple[int, int, int] | None, prefix: int = 0,
             protect_frames: int = 0) -> None:
    """call.grid = the grid's mergeable part: `protect_frames` leading frames join the prefix
    (tokens before the grid that never merge), together with `prefix` other tokens. Its name in
    the stats ("HxW", "TxHxW") is made here, outside the model: under torch.compile a size can
    turn symbolic inside it after a change of resolution, and no string is made from one."""
    if grid is None or grid[0] <= protect_frames:
        call.grid, call.mergeable = None, False
        return
    t, h, w = grid
    call.grid = (t - protect_frames, h, w)
    call.prefix = prefix + protect_frames * h * w
    call.level = "x".join(map(str, call.grid[1:] if call.grid[0] == 1 else call.grid))


def describe_plain(patch: tuple[int, int, int]) -> Callable[[ModelCall, object, dict], None]:
    """describe for families whose call is the latent alone."""

    def describe(call: ModelCall, base_model, arguments: dict) -> None:
        set_grid(call, latent_grid(arguments.get("x"), patch))

    return describe


def host_read(call: ModelCall, key: tuple, read: Callable[[], object]) -> object:
    """read() once per run and batch identity under `key`: a value read on the host from the
    call's inputs (conditioning, masks), which do not change within a run."""
    key = (*key, call.identity)
    if key not in call.run.host_reads:
        call.run.host_reads[key] = read()
    return call.run.host_reads[key]


def leading_true(flags: list[bool]) -> int:
    """How many of `flags` are true before the first false (leading frames a mask read on
    the host marks)."""
    return next((i for i, flag in enumerate(flags) if not flag), len(flags))


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


def conditioned_frames(call: ModelCall, mask: object, frames: int, total: int) -> int | None:
    """Leading latent frames of a denoise mask [B|1, C|1, total, H, W] that are not all 1:
    frames the sampler does not fully denoise (image-to-video and in-place guide frames,
    timestep (1 - strength) * t), whose tokens' timesteps differ from the generated ones'.
    Only the first `frames` frames (the video; guide frames may follow it) are read.
    None when the mask cannot be held as such a prefix: a value below 1 after the first frame
    of all 1 (an inpainting mask inside the video), a negative value (a token ComfyUI drops), or
    a mask of another length. 0 without a mask (host_read)."""
    if mask is None:
        return 0
    if not torch.is_tensor(mask) or mask.dim() != 5 or mask.shape[2] != total:
        return None

    def read() -> int | None:
        video = mask[:, :, :frames].float()
        low, high = torch.stack((video.amin(dim=(0, 1, 3, 4)),
                                 video.amax(dim=(0, 1, 3, 4)))).tolist()    # one host read
        free = [a == 1 and b == 1 for a, b in zip(low, high, strict=True)]
        count = leading_true([not f for f in free])
        clean = all(free[count:]) and min(low[:count], default=0) >= 0
        return count if clean else None

    return host_read(call, ("conditioned_frames", tuple(mask.shape), frames), read)
