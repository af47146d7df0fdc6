"""What ToMA needs to know about each diffusion transformer family (dit_patch.py, the one patch,
reads it): its blocks and where their calls carry the tokens (`BlockKind`); its (t, h, w) token
grid, default regions and how one model call's inputs are read into the ModelCall (`Family`).

A block call's stream (the tensor holding the image grid) is [prefix][grid: t*h*w][suffix].
prefix: the text where the stream holds it first (TextAt.STREAM_BEFORE), then tokens that never
merge (reference latents put in front, image-to-video conditioning frames); suffix: everything
after the grid (references, padding, text that comes last, guide frames). Positional rows and
masks follow the attention sequence, which holds a text stream of its own too (TextAt.BEFORE,
AFTER). Modulation rows are spread evenly over the stream: R rows of L / R tokens each.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum, auto

import torch

from .model_call import ModelCall

# tile_count 0: regions of about REGION_TOKENS tokens, VIDEO_REGION_FRAMES frames deep for
# video: the sizes tried that stayed closest to unmerged (docs/compatibility.md)
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
    """How raylight's sequence-parallel forward (sequence_parallel.py) hands a block its shard
    (with TextAt.STREAM_BEFORE, a shard of [text; grid; ...])."""

    # the positional rows are a list whose item `pe_item` holds the stream's rows ([image
    # rows, text rows]); None: the stream's rows alone
    pe_item: int | None = None


@dataclass(frozen=True)
class BlockKind:
    """One kind of block and the arguments by which its call carries the tokens (None: none)."""

    key: str        # the "dit" replace key ("double_block", "single_block")
    modules: str    # the diffusion model's attribute holding these blocks
    letter: str     # its skip_blocks label ("" in one-kind families)
    text: TextAt
    stream: str = "img"         # the image stream
    txt: str | None = "txt"     # the text stream of its own
    # positional rows (as more_pe, stream_pe): a tensor, or a tuple whose tensors are rows
    pe: str | None = "pe"
    mask: str | None = None     # the attention mask
    mask_dims: tuple[int, ...] = (-2, -1)   # the mask's token dims
    # modulation rows along dim 1 (per-frame or per-token timestep embeddings): plain tensors,
    # or held in an object (Family.held_rows)
    rows: tuple[str, ...] = ()
    # dims of a plain tensor of rows (None: 3 or more); other dims: one modulation for every token
    rows_dims: int | None = None
    # more positional rows over the same sequence (the video side of an audio-video attention)
    more_pe: tuple[str, ...] = ()
    # positional rows over the stream alone (an image self-attention beside a joint one)
    stream_pe: tuple[str, ...] = ()
    # positional rows [1, L, D] broadcast over the heads: merged per item, [B, 1, L', D]
    pe_heads: bool = False
    stream_item: int | None = None  # the stream is a tuple ((video, audio)): its item holding it
    # arguments that address fixed token spans (an attention mask): a call setting one runs unmerged
    opaque: tuple[str, ...] = ()
    # (name, shorten): arguments alike for every token up to the grid's end (an attention
    # bias); shorten(value, end, removed) drops `removed` of the first `end` tokens' entries, or
    # gives None where the alike ones do not end at `end` (the block runs unmerged)
    shortened: tuple[tuple[str, Callable[[object, int, int], object | None]], ...] = ()
    batched: bool = True    # False: the stream is one item's tokens [L, C]
    # the stream's token spans (start, stop, value...), one modulation row each, moved with the
    # grid (token_layout.moved_positions; the block runs unmerged where they cannot be)
    spans: tuple[str, ...] = ()
    # token positions set before the blocks run (references' timestep zero modulation), moved
    # likewise; with hook "dit" the block loop hands them to the forward, which ToMA patches too
    positions: tuple[str, ...] = ()
    grid_axes: bool = False     # the stream is the grid alone, [B, T, H, W, C]
    hook: str = "dit"   # "dit" (replace patch) or "object" (patch of the block's forward)
    # an object-patched forward returning a tuple (image, text): its items' argument names
    returns: tuple[str, ...] = ()
    # merge_scope "attention" merges only these blocks' image attention (Family.attention_hooks)
    attention_scope: bool = False
    # how raylight's sequence-parallel forward hands these blocks their shard (None: unmerged)
    shard: ShardKind | None = None
    # False: the forward takes no transformer_options, so a merged call hands it none (no size
    # bias), and a second ToMA node, blind to the merge, leaves these blocks to the first
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
        """The arguments ToMA reads or rewrites by name (not the opaque and shortened ones, which
        a block loop may not hand at all): what a family's contract requires to be named so."""
        names = (self.stream, self.txt, self.pe, self.mask, *self.rows, *self.more_pe,
                 *self.stream_pe, *self.spans)
        return tuple(dict.fromkeys(name for name in names if name))


@dataclass(frozen=True)
class HeldRows:
    """Modulation rows a family's blocks get inside an object (compressed timesteps).
    read(value) -> (rows [B, R, C], tokens each row covers), None for a value it does not hold;
    write(value, rows, tokens) -> an object of the same kind holding `rows` so."""

    read: Callable[[object], tuple[torch.Tensor, int] | None]
    write: Callable[[object, torch.Tensor, int], object]


@dataclass(frozen=True)
class Family:
    """One model family: its blocks, token grid and per-call reading."""

    name: str
    label: str      # as messages name it
    kinds: tuple[BlockKind, ...]
    patch: tuple[int, int, int]     # (t, h, w) patch size (images: t 1)
    # describe(call, base_model, arguments): reads one model call (apply_model's arguments by
    # name) into `call`; returns why the call cannot merge when the user should know, else None
    describe: Callable[[ModelCall, object, dict], str | None]
    # tile_count 0: regions of about this many tokens, this many frames deep
    tokens_per_region: int = REGION_TOKENS
    frames_per_region: int = 1
    held_rows: HeldRows | None = None   # how its blocks hold rows that are not plain tensors
    # its one kind of block attends over a causal prompt first in the sequence, whose keys and
    # values ToMA keeps across steps (prefix_cache.py; describe sets call.prompt_length)
    prefix_cache: bool = False
    # foreign_block(patch): why a block holding another node's "dit" replace patch `patch` must
    # not merge (it reads the sequence by a layout merging breaks; ToMA wraps it unmerged), or None
    foreign_block: Callable[[Callable], str | None] | None = None
    # why ToMA leaves this family alone under raylight's sequence parallelism, or None
    sequence_parallel_refusal: str | None = None
    # merge_scope "attention" (BlockKind.attention_scope): makes one node's hooks; install(model,
    # patches, indices) puts them on the blocks, run(index, plan, merged_args, run) runs one block
    attention_hooks: Callable[[], object] | None = None


# Reading a model call -------------------------------------------------------------------------
def latent_grid(x: object, patch: tuple[int, int, int]) -> tuple[int, int, int] | None:
    """(t, h, w) tokens of a latent [B, C, H, W] or [B, C, T, H, W] or of its shape (a packed
    latent's `latent_shapes` entry), each side padded up to the patch size (what every family
    here does); None for anything else."""
    shape = x.shape if torch.is_tensor(x) else x
    if not isinstance(shape, (tuple, list, torch.Size)) or len(shape) not in (4, 5):
        return None
    sides = (1, *shape[-2:]) if len(shape) == 4 else tuple(shape[-3:])
    return tuple(math.ceil(int(s) / p) for s, p in zip(sides, patch, strict=True))


def set_grid(call: ModelCall, grid: tuple[int, int, int] | None, prefix: int = 0,
             protect_frames: int = 0) -> None:
    """call.grid = the grid's mergeable part: `protect_frames` leading frames join the prefix
    (tokens that never merge) with `prefix` others. Its stats name ("HxW", "TxHxW") is made on
    the host here: in a compiled model a size can turn symbolic, and no string is made from one."""
    if grid is None or grid[0] <= protect_frames:
        call.grid, call.mergeable = None, False
        return
    t, h, w = grid
    call.grid = (t - protect_frames, h, w)
    call.prefix = prefix + protect_frames * h * w
    call.level = "x".join(map(str, call.grid[1:] if call.grid[0] == 1 else call.grid))


def describe_plain(patch: tuple[int, int, int]) -> Callable[[ModelCall, object, dict], None]:
    """describe for families whose call is the latent alone."""
    return lambda call, base_model, arguments: set_grid(
        call, latent_grid(arguments.get("x"), patch))


def host_read(call: ModelCall, key: tuple, read: Callable[[], object]) -> object:
    """read() once per run and batch identity under `key`: a value read on the host from the
    call's inputs (conditioning, masks), which do not change within a run."""
    key = (*key, call.identity)
    if key not in call.run.host_reads:
        call.run.host_reads[key] = read()
    return call.run.host_reads[key]


def leading_true(flags: list[bool]) -> int:
    """How many of `flags` are true before the first false."""
    return next((i for i, flag in enumerate(flags) if not flag), len(flags))
