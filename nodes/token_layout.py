"""Where a diffusion transformer's tokens are (text, grid, references), and its positional (RoPE)
rows, attention masks and modulation rows rewritten for a merge plan: pure tensor and shape work;
dit_patch.py decides when it applies."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..toma_core import MergePlan
from .dit_families import BlockKind, TextAt
from .model_call import ModelCall

# Set in the transformer_options handed to a merged block: a ToMA patch further in (a second
# ToMA node on the same model) sees it and leaves the already merged sequence alone.
MERGED_FLAG = "toma_merged"


@dataclass(frozen=True)
class Layout:
    """Where the grid sits in one block call: `offset` in the stream tensor, `seq_start` in the
    attention sequence (positional rows, mask) of `seq_len` tokens; pe_item: the positional-rows
    argument is a list whose item `pe_item` alone follows that sequence (None: all of it)."""

    offset: int
    seq_start: int
    seq_len: int
    pe_item: int | None = None


def stream_of(kind: BlockKind, value: object) -> torch.Tensor | None:
    """The tensor [B, L, C] holding the grid in the stream argument's `value` (as BlockKind's
    stream_item, batched and grid_axes say), None when it is not there."""
    if not kind.batched:
        return value.unsqueeze(0) if isinstance(value, torch.Tensor) else None
    if kind.grid_axes:
        return value.flatten(1, -2) if isinstance(value, torch.Tensor) and value.dim() == 5 \
            else None
    if kind.stream_item is not None:
        if not isinstance(value, (tuple, list)) or len(value) <= kind.stream_item:
            return None
        value = value[kind.stream_item]
    return value if isinstance(value, torch.Tensor) else None


def with_stream(kind: BlockKind, value: object, tensor: torch.Tensor,
                full: torch.Tensor | None = None) -> object:
    """The stream argument's `value` holding `tensor` [B, L, C] in place of its grid tensor;
    with kind.grid_axes, in the shape of `full` (the block's input) where it holds as many."""
    if not kind.batched:
        return tensor[0]
    if kind.grid_axes:
        whole = full is not None and full.shape[1:-1].numel() == tensor.shape[1]
        return tensor.reshape(full.shape if whole else (tensor.shape[0], 1, 1, *tensor.shape[1:]))
    if kind.stream_item is None:
        return tensor
    items = list(value)
    items[kind.stream_item] = tensor
    return type(value)(items)


def layout(kind: BlockKind, args: dict, stream: torch.Tensor, call: ModelCall,
           options: dict) -> Layout | None:
    """The grid's place in this call of a block whose grid tensor is `stream` [B, L, C]
    (dit_families' module docstring), None when the text length a single-stream block needs
    is unknown."""
    n_stream, prefix = stream.shape[1], call.prefix
    txt = args.get(kind.txt) if kind.txt else None
    n_txt = txt.shape[1] if isinstance(txt, torch.Tensor) else 0
    if kind.text is TextAt.BEFORE:
        return Layout(prefix, n_txt + prefix, n_txt + n_stream)
    if kind.text is TextAt.AFTER:
        return Layout(prefix, prefix, n_stream + n_txt)
    if kind.text is TextAt.STREAM_BEFORE:
        span = options.get("img_slice")
        text = int(span[0]) if span else call.txt_len
        return None if text is None else Layout(text + prefix, text + prefix, n_stream)
    return Layout(prefix, prefix, n_stream)


def token_axis(pe: torch.Tensor, seq_len: int) -> int | None:
    """The token axis of positional rows over a `seq_len`-token sequence: [B, 1, L, ...],
    [B, L, 1, ...], [B, L, D] (interleaved), [B, H, L, D/2] or [B, L, H, ...] (split rows):
    where neither of axes 1 and 2 has size 1, the one of length `seq_len`; None when that
    cannot tell (H = L), and the block runs unmerged."""
    if pe.dim() > 2 and pe.shape[1] == 1:
        return 2
    if pe.dim() <= 3 or pe.shape[2] == 1:
        return 1
    axes = [axis for axis in (1, 2) if pe.shape[axis] == seq_len]
    return axes[0] if len(axes) == 1 else None


def position_tensors(value: object, item: int | None = None) -> list[torch.Tensor]:
    """The tensors of a positional-rows argument: itself, or those in a tuple (a
    (rotation, split) pair, a (cos, sin) pair); its item `item` alone where that is given."""
    if item is not None:
        picked = value[item] if isinstance(value, (tuple, list)) and len(value) > item else None
        return [picked] if isinstance(picked, torch.Tensor) else []
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def merged_options(options: dict, start: int, plan: MergePlan, offset: int | None, by: object,
                   shard: bool) -> dict:
    """transformer_options for a block on a merged sequence: MERGED_FLAG with the grid's tokens
    before and after merging, `offset` in the stream (None where only the attention merged) and
    `by`, the patch that merged it; `img_slice` ([start, end) of the image) shortened by the
    tokens merged away where it holds the grid starting at `start`, or on every rank alike where
    `shard` (sequence-parallel single blocks' [whole text's length, shard's length])."""
    out = {**options, MERGED_FLAG: {"tokens": plan.tokens, "merged_tokens": plan.merged_tokens,
                                    "offset": offset, "by": by}}
    span = options.get("img_slice")
    if span is not None and len(span) == 2 and (shard or span[0] <= start < span[1]):
        out["img_slice"] = [span[0], span[1] - (plan.tokens - plan.merged_tokens)]
    return out


def moved_positions(value: object, start: int, end: int, dropped: int,
                    spans: bool = False) -> object | None:
    """Token positions (an index, or spans (first, stop, value...)) in a stream whose grid
    [start, end) merges `dropped` tokens away: those at or past `end` move back by `dropped`.
    None where one lies strictly inside the grid; with `spans`, also where BlockKind.spans
    says the block runs unmerged, or the value is no list of spans."""
    if isinstance(value, (int, torch.SymInt)) and not spans:
        return None if start < value < end else value - dropped if value >= end else value
    if not isinstance(value, (tuple, list)):
        return None if spans else value
    out = []
    for span in value:      # a loop: no generator call per block (any() on the grid's span only)
        if not isinstance(span, (tuple, list)):
            if spans:
                return None
            out.append(span)
            continue
        first, stop = span[0], span[1]
        if start < first < end or start < stop < end or (
                spans and first < end and stop > start and (first != start or stop != end or any(
                    isinstance(item, torch.Tensor) for item in span[2:]))):
            return None
        out.append(type(span)([first - dropped if first >= end else first,
                               stop - dropped if stop >= end else stop, *span[2:]]))
    return type(value)(out)


def merged_positions(kind: BlockKind, plan: MergePlan, value: object, lay: Layout) -> object:
    """A positional-rows argument for the merged sequence: each of its tensors (its item
    lay.pe_item alone where that is set) merged along its token axis (kind.pe_heads: [1, L, D]
    -> [B, 1, L', D] when the batch's items merged apart)."""

    def merged(pe: torch.Tensor) -> torch.Tensor:
        out = plan.merge_positions(pe, token_axis(pe, lay.seq_len), lay.seq_start)
        return out.unsqueeze(1) if kind.pe_heads and pe.dim() == 3 and out.shape[0] > 1 else out

    if isinstance(value, torch.Tensor):
        return merged(value)
    return type(value)(merged(v) if isinstance(v, torch.Tensor) and lay.pe_item in (None, i)
                       else v for i, v in enumerate(value))


def merge_mask(plan: MergePlan, mask: torch.Tensor, dims: tuple[int, ...], start: int,
               length: int) -> torch.Tensor:
    """The mask's token dims gathered at the merged positions ([..., L|1, L|1] ->
    [..., L'|1, L'|1]); a 2-D query x key mask gets a leading batch dim first."""
    out = mask.unsqueeze(0) if mask.dim() == 2 and len(dims) == 2 else mask
    for dim in dims:
        if out.shape[dim] == length:
            out = plan.merge_positions(out, dim % out.dim(), start)
    return out


def regroup_frame_rows(rows: torch.Tensor, kept: int, per_kept: int, per_frame: int,
                       frames: int) -> tuple[torch.Tensor, int]:
    """Per-frame modulation rows [B, F, ...] for a sequence whose first `kept` frames hold
    `per_kept` tokens each, the next `frames` `per_frame` each and any after those `per_kept`
    each: (every frame's row repeated count / g times, g = gcd of the counts), so that a model
    spreading rows evenly (g tokens each) gives each token its own frame's row (integer
    repeats: no count is read back from the device)."""
    after = rows.shape[1] - kept - frames
    g, b = (per_kept, per_frame) if kept or after else (per_frame, 0)
    while b:        # Euclid's steps: torch.compile traces them on symbolic sizes, not math.gcd
        g, b = b, g % b
    parts = [rows[:, kept:kept + frames].repeat_interleave(per_frame // g, dim=1)]
    if kept:
        parts.insert(0, rows[:, :kept].repeat_interleave(per_kept // g, dim=1))
    if after:
        parts.append(rows[:, kept + frames:].repeat_interleave(per_kept // g, dim=1))
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)), g


@dataclass(frozen=True)
class RowForm:
    """How one modulation-rows argument lines up with the stream: `mode` "token" (a row per
    token: merged like positional rows) or "frame" (a row per frame of the grid: regrouped);
    `rows` [B, R, ...] the rows, `held` whether they came out of an object (Family.held_rows)."""

    mode: str
    rows: torch.Tensor
    held: bool
