"""ToMA for ComfyUI's diffusion transformers: one block patch for every family in families/
(dit_families says how each hooks its blocks and where their tokens are).

A merged block runs ComfyUI's block (or another pack's patch there, which ToMA wraps) on the grid
merged with its positional, mask and modulation rows (token_layout), other tokens untouched; only
the block's update of the grid is unmerged: grid + unmerge(block(merge(grid)) - merge(grid)).
Destinations come from the layer-normed grid entering a group's first block (dit_reading).
Patches inside the block (attn1/attn2 and their output patches) and opaque arguments may read
tokens by grid position: such calls run unmerged, and the user is told. Other packs' "dit"
replace or object patches get the merged arguments and options (token_layout.merged_options;
`grid_sizes` still describe the unmerged input), an attention override the merged q, k, v.
"""
from __future__ import annotations

import inspect
import logging
import math
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..toma_core import MergePlan, Regions, build_plan, make_regions, size_bias
from ..toma_core.merge_plan import Pending
from ..toma_core.shards import ShardGeometry, dropped_share, local_cap, shard_regions
from .dit_families import BlockKind, Family, TextAt
from .dit_reading import DiTReading, existing_replace
from .forward_patches import ForwardPatches, kept_allocations
from .model_call import ModelCall
from .prefix_cache import prefix_run
from .run_state import ToMAState
from .token_layout import (
    MERGED_FLAG,
    Layout,
    RowForm,
    layout,
    merge_mask,
    merged_options,
    merged_positions,
    moved_positions,
    position_tensors,
    regroup_frame_rows,
    stream_of,
    token_axis,
    with_stream,
)
from .unet_neighbours import DIT_IN_BLOCK_PATCHES, in_block_patches

log = logging.getLogger("ToMA")

# Self-attention over merged keys weighted by their sizes, through ComfyUI's attention override
# under these option keys: off, as it brought the trained transformer fixtures no closer and
# its mask takes flash and sage attention away (docs/quality.md, the size-weighting section).
SIZE_WEIGHTED = False
OVERRIDE = "optimized_attention_override"
SIZE_BIAS = "toma_size_bias"

class DiTToMA:
    """The patch functions for one ToMA node on one diffusion transformer.

    groups: (kind key, block index) -> first index of its group, for merged blocks only;
    attention: the family's attention_hooks for merge_scope "attention", or None (whole blocks);
    prefix_layers: the layers whose prompt keys and values it keeps (DiTReading.prefix_layers).
    """

    def __init__(self, state: ToMAState, family: Family, groups: dict[tuple[str, int], int],
                 attention=None, prefix_layers: list[torch.nn.Module] | None = None) -> None:
        self.state = state
        self.family = family
        self.groups = groups
        self.attention = attention
        self.prefix_layers = prefix_layers

    # One block call ------------------------------------------------------------------------------
    def block_call(self, kind: BlockKind, index: int, args: dict,
                   run: Callable[[dict], dict], layer: str, options: dict) -> dict:
        """Run one block call, merged when it should be; args / run's result: the block's
        arguments / outputs by name, `options` its transformer_options; `layer` names it in the
        stats (made with the patch: under torch.compile an index can turn symbolic)."""
        stream = stream_of(kind, args.get(kind.stream))
        call = self.state.call_of(options, None if stream is None else stream.device)
        if self.prefix_layers is not None:
            run = prefix_run(call, self.prefix_layers[index], index, run)
        txt = args.get(kind.txt) if kind.txt else None
        if call is not None and call.shard is None and isinstance(txt, torch.Tensor):
            call.txt_len = txt.shape[1]     # for single-stream blocks after these
        found = self.plan_for(kind, index, args, stream, options, call, layer)
        if found is None:
            return run(args)
        plan, lay, own, forms, key = found
        merged_args, merged, base = self.merged_args(kind, plan, lay, own, args, stream, options,
                                                     call, forms, key)
        if merged is None:
            return self.attention.run(index, plan, merged_args, run)
        out = run(merged_args)
        got = stream_of(kind, out[kind.stream])
        if got is None or got.shape[:2] != merged.shape[:2]:   # a caching pack's answer
            what = "no stream" if got is None else f"{got.shape[1]} tokens"
            call.note(f"a block returned {what} for a merged input of "
                      f"{merged.shape[1]}; its output is passed on unchanged")
            return out
        restored = plan.finish(got, base, lay.offset)
        return {**out, kind.stream: restored if kind.bare
                else with_stream(kind, out[kind.stream], restored, args[kind.stream])}

    def plan_for(self, kind: BlockKind, index: int, args: dict, stream: torch.Tensor | None,
                 options: dict, call: ModelCall | None, layer: str
                 ) -> tuple[MergePlan, Layout, Layout, dict, tuple] | None:
        """(plan, layout, the stream_pe rows' layout (fits), RowForm by argument name, plan key)
        for this block call, or None to run it unchanged."""
        grid = call.grid if call is not None and call.mergeable else None
        tokens_n = math.prod(grid) if grid else 0
        level = call.level if grid else "?"

        def unmerged() -> None:
            if call is not None:
                call.record(layer, level, tokens_n, None)

        group = self.groups.get((kind.key, index))
        if (group is None or not tokens_n or not call.active or options.get(MERGED_FLAG)
                or stream is None or stream.dim() != 3
                or (kind.key, index) in call.foreign_attention):
            return unmerged()
        if call.shard is not None:
            return self.shard_plan_for(kind, group, args, stream, options, call, layer) \
                or unmerged()
        lay = layout(kind, args, stream, call, options)
        if (lay is None or stream.shape[1] < lay.offset + tokens_n
                or (own := self.fits(call, kind, args, stream, lay, layer, options)) is None):
            return unmerged()
        forms = self.row_forms(call, kind, args, stream, lay, layer)
        if forms is None:
            return unmerged()
        for name in kind.spans:
            if moved_positions(args.get(name), lay.offset, lay.offset + tokens_n, 0,
                               spans=True) is None:
                call.note(f"the token spans {name} of {self.family.label} blocks do not keep "
                          f"the {level} grid in a span of its own (or hold values per token "
                          f"there); block {layer} and others like it run unmerged")
                return unmerged()
        frames = self.family.frames_per_region
        for form in forms.values():      # a loop, not any(): no generator call per block
            if form.mode == "frame":
                frames = 1
        key = (kind.key, group, grid, lay.offset, stream.shape[0], frames, call.pass_of(layer))
        plan = call.plan(key, lambda: self.build(call, stream, lay.offset, grid[0] * grid[1],
                                                 grid[2], self.regions_of(grid, frames)))
        call.record(layer, level, tokens_n, plan)
        return None if plan is None else (plan, lay, own, forms, key)

    def regions_of(self, grid: tuple[int, int, int], frames: int) -> Regions:
        """The t*h*w grid's regions, `frames` deep, tile_count tiles per frame (0: by family)."""
        o = self.state.options
        t, h, w = grid
        tiles = o.tile_count or max(
            1, round(h * w * min(frames, t) / self.family.tokens_per_region))
        return make_regions(h, w, o.region, tiles, t=t, frames=frames)

    def build(self, call: ModelCall, stream: torch.Tensor, offset: int, rows: int, cols: int,
              regions: Regions) -> MergePlan | None:
        """A plan for the rows x cols grid tokens of stream [B, L, C] from row `offset` in
        `regions`, from their layer-normed features."""
        o = self.state.options
        return build_plan(stream, rows, cols, o.ratio, regions=regions, tau=o.tau,
                          unmerge=o.unmerge, batch=o.batch_policy, offset=offset, center=True,
                          tables=call.tables(regions, stream.device))

    # Sequence parallelism: the block gets one shard of the sequence ------------------------------
    def shard_plan_for(self, kind: BlockKind, group: int, args: dict, stream: torch.Tensor,
                       options: dict, call: ModelCall, layer: str
                       ) -> tuple[MergePlan, Layout, Layout, dict, tuple] | None:
        """plan_for on a sequence shard [B, S, C] (sequence_parallel.py), deciding from what is
        alike on every rank: every rank merges or none does (the all-to-all needs equal lengths)."""
        shard, spec, label = call.shard, kind.shard, self.family.label
        if spec is None:
            call.note(f"ToMA does not merge {label} under raylight's sequence parallelism "
                      f"({shard.forward}): those model calls run unmerged")
            return None
        lay = layout(kind, args, stream, call, options)
        if lay is None:
            call.note(f"{label}'s {kind.key} blocks under raylight's sequence parallelism "
                      f"got no text length (img_slice): those blocks run unmerged")
            return None
        geometry = ShardGeometry(shard.world, stream.shape[1], lay.offset,
                                 self.regions_of(call.grid, self.family.frames_per_region))
        if not geometry.fits():
            call.note(f"a {shard.world} x {stream.shape[1]}-token split sequence cannot hold "
                      f"{label}'s {geometry.base.tokens} grid tokens after "
                      f"{geometry.grid_start} others: those blocks run unmerged")
            return None
        offset = geometry.offset(shard.rank)
        lay = Layout(offset, offset, stream.shape[1], spec.pe_item)
        if kind.mask and isinstance(args.get(kind.mask), torch.Tensor):
            call.note(f"raylight's sequence parallelism drops attention masks; ToMA leaves "
                      f"{label} blocks with one unmerged")
            return None
        own = self.fits(call, kind, args, stream, lay, layer, options)
        if own is None:
            return None
        for name in kind.rows:
            if self.read_rows(kind, args.get(name), stream.shape[1]) is not None:
                call.note(f"under raylight's sequence parallelism {label}'s {name} rows (one per "
                          f"frame or token) reach every GPU whole, not split with its tokens "
                          f"(raylight's forward does not split them): those blocks run unmerged")
                return None
        if self.attention is not None and kind.attention_scope:
            call.note(f"under raylight's sequence parallelism {label}'s double blocks merge "
                      f"whole blocks (merge_scope attention applies on one GPU)")
        key = (kind.key, group, call.grid, geometry, shard.rank, stream.shape[0],
               call.pass_of(layer))
        plan = call.plan(key, lambda: self.build_shard(call, kind, stream, offset, geometry))
        # this rank's grid tokens and what they merge to: the stats of a rank are its own
        call.record(layer, call.level, math.prod(call.grid) if plan is None else plan.tokens,
                    plan)
        return None if plan is None else (plan, lay, own, {}, key)

    def build_shard(self, call: ModelCall, kind: BlockKind, stream: torch.Tensor, offset: int,
                    geometry: ShardGeometry) -> MergePlan | None:
        """This rank's plan from its shard's tokens [B, S, C] from row `offset`, in its clipped
        regions (every rank's, computed alike on every rank and kept for the run)."""
        o = self.state.options
        read = ("shard_regions", geometry, o.ratio)
        spans = call.run.host_reads.get(read)
        if spans is None:
            spans = call.run.host_reads.setdefault(read, shard_regions(geometry, o.ratio))
            if spans:
                span = next(span for span in spans if span is not None)
                call.note(f"{self.family.label}'s {kind.key} blocks on {geometry.world} GPUs: "
                          f"each drops {span.tokens - sum(span.counts)} grid tokens, "
                          f"{dropped_share(spans):.1%} of the {geometry.base.tokens}-token grid "
                          f"at ratio {o.ratio} (a GPU holding fewer grid tokens merges up to "
                          f"{local_cap(o.ratio):.0%} of its own)")
        if not spans:
            call.note(f"some GPU of the {geometry.world} holds too few of the "
                      f"{self.family.label} grid's tokens to drop any, and every GPU must "
                      f"drop alike: those blocks run unmerged")
            return None
        span = spans[call.shard.rank]
        return self.build(call, stream, offset, 1, span.tokens, span)

    def fits(self, call: ModelCall, kind: BlockKind, args: dict, stream: torch.Tensor,
             lay: Layout, layer: str, options: dict) -> Layout | None:
        """The layout kind.stream_pe rows follow (the stream's own sequence) where positional
        rows and mask line up with the sequence, no opaque argument is set and no other pack
        patches inside the block; None (it runs unmerged) otherwise."""
        own = Layout(lay.offset, lay.offset, stream.shape[1]) if kind.stream_pe else lay
        for name in kind.pe_names:
            seq = own if name in kind.stream_pe else lay
            for pe in position_tensors(args.get(name), seq.pe_item):
                axis = token_axis(pe, seq.seq_len)
                if axis is None or pe.shape[axis] != seq.seq_len:
                    call.note(f"positional rows {tuple(pe.shape)} do not match the "
                              f"{seq.seq_len}-token sequence; block {layer} and "
                              f"others like it run unmerged")
                    return None
        mask = args.get(kind.mask) if kind.mask else None
        # each token dim of the mask spans the sequence or broadcasts (size 1)
        if isinstance(mask, torch.Tensor) and (mask.dim() < len(kind.mask_dims) or any(
                mask.shape[d] not in (1, lay.seq_len) for d in kind.mask_dims)):
            call.note(f"attention mask {tuple(mask.shape)} does not span the {lay.seq_len}-token "
                      f"sequence; block {layer} and others like it run unmerged")
            return None
        opaque = kind.opaque and [name for name in kind.opaque if args.get(name) is not None]
        end = lay.offset + math.prod(call.grid)
        for name in kind.positions:       # those the call hands (an object-patched forward's)
            if args.get(name) is not None and moved_positions(args[name], lay.offset, end,
                                                              0) is None:
                opaque = [name]
        for name, shorten in kind.shortened:
            if args.get(name) is not None and shorten(args[name], end, 0) is None:
                opaque = [name]
        if opaque:
            call.note(f"{self.family.label} blocks get {', '.join(opaque)}, which "
                      f"addresses fixed token spans; those blocks run unmerged")
            return None
        foreign = options.get("patches") and in_block_patches(options, DIT_IN_BLOCK_PATCHES)
        if foreign:
            call.note(f"other nodes patch inside {self.family.label} blocks "
                      f"({', '.join(foreign)}); such patches may read tokens by "
                      f"their grid position, so those blocks run unmerged")
            return None
        return own

    def read_rows(self, kind: BlockKind, value: object,
                  length: int) -> tuple[torch.Tensor, int, bool] | None:
        """(rows [B, R, ...], tokens each row covers, held in an object) of a modulation-rows
        argument over `length` tokens; None for none, or one for all (a single row, or a
        tensor of other dims than kind.rows_dims)."""
        held = self.family.held_rows.read(value) if self.family.held_rows else None
        if held is not None:
            rows, per_row = held
            return None if rows.shape[1] == 1 else (rows, per_row, True)
        if (not isinstance(value, torch.Tensor) or value.dim() < 3 or value.shape[1] == 1
                or kind.rows_dims not in (None, value.dim())):
            return None
        per_row = length // value.shape[1] if length % value.shape[1] == 0 else 0
        return value, per_row, False

    def row_forms(self, call: ModelCall, kind: BlockKind, args: dict, stream: torch.Tensor,
                  lay: Layout, layer: str) -> dict[str, RowForm] | None:
        """Argument name -> RowForm of each modulation-rows argument (rows one for all left
        out); None where some spread over other than the whole stream, or per-frame rows meet
        tokens around the grid that are not whole frames."""
        t, h, w = call.grid
        forms: dict[str, RowForm] = {}
        for name in kind.rows:
            found = self.read_rows(kind, args.get(name), stream.shape[1])
            if found is None:
                continue
            rows, per_row, held = found
            after = stream.shape[1] - lay.offset - t * h * w
            mode = None
            if per_row * rows.shape[1] == stream.shape[1]:
                if per_row == 1:
                    mode = "token"
                elif per_row == h * w and lay.offset % per_row == 0 and after % per_row == 0:
                    mode = "frame"
            if mode is None:
                call.note(f"modulation rows {name} ({rows.shape[1]} rows) do not line up with "
                          f"{stream.shape[1]} tokens of {t}x{h}x{w} frames; block {layer} and "
                          f"others like it run unmerged")
                return None
            forms[name] = RowForm(mode, rows, held)
        return forms

    def merged_args(self, kind: BlockKind, plan: MergePlan, lay: Layout, own: Layout,
                    args: dict, stream: torch.Tensor, options: dict, call: ModelCall,
                    forms: dict[str, RowForm], key: tuple
                    ) -> tuple[dict, torch.Tensor | None, Pending | None]:
        """The block's arguments for the merged sequence, its merged grid tensor and plan.begin's
        base (both None, the stream whole, when only the attention merges: inside the block)."""
        out, merged, base = dict(args), None, None
        end, dropped = lay.offset + plan.tokens, plan.tokens - plan.merged_tokens
        if self.attention is None or not kind.attention_scope or call.shard is not None:
            merged, base = plan.begin(stream, lay.offset)
            out[kind.stream] = merged if kind.bare else with_stream(
                kind, args[kind.stream], merged)      # a bare tensor without a further call
        for name in kind.pe_names:
            seq = own if name in kind.stream_pe else lay
            value = args.get(name)
            if position_tensors(value):
                out[name] = self.once(call, ("pe", name, key), value,
                                      lambda v=value, q=seq: merged_positions(kind, plan, v, q))
        mask = args.get(kind.mask) if kind.mask else None
        if isinstance(mask, torch.Tensor):
            out[kind.mask] = self.once(call, ("mask", key), mask, lambda: merge_mask(
                plan, mask, kind.mask_dims, lay.seq_start, lay.seq_len))
        for name, form in forms.items():
            value = args[name]
            out[name] = self.once(call, ("rows", name, key), value,
                                  lambda v=value, f=form: self.merged_rows(call, plan, lay, v, f))
        for name in kind.spans:
            value = args[name]
            out[name] = self.once(call, ("spans", name, key), value, lambda v=value: (
                moved_positions(v, lay.offset, end, dropped, spans=True)))
        if merged is not None:
            for name in kind.positions:
                if name in args:
                    out[name] = moved_positions(args[name], lay.offset, end, dropped)
            for name, shorten in kind.shortened:
                value = args.get(name)
                if value is not None:
                    out[name] = self.once(call, ("shortened", name, key), value,
                                          lambda v=value, f=shorten: f(v, end, dropped))
        if not kind.takes_options:
            return out, merged, base
        out["transformer_options"] = sized = merged_options(
            options, lay.seq_start, plan, None if merged is None else lay.offset, self,
            call.shard is not None and kind.text is TextAt.STREAM_BEFORE)
        if SIZE_WEIGHTED and call.shard is None:
            length = lay.seq_len - dropped
            bias = plan.size_biases.get((length, lay.seq_start, stream.dtype))  # no call when kept
            if bias is None:
                bias = size_bias(plan, length, lay.seq_start, stream.dtype)
            sized[SIZE_BIAS] = (bias, options.get(OVERRIDE))
            sized[OVERRIDE] = sized_attention
        return out, merged, base

    def merged_rows(self, call: ModelCall, plan: MergePlan, lay: Layout, value: object,
                    form: RowForm) -> object:
        """A modulation-rows argument for the merged sequence, in the form it came: per-token
        rows the destinations', per-frame rows regrouped (regions one frame deep then)."""
        t, h, w = call.grid
        if form.mode == "token":
            rows, per_row = plan.merge_positions(form.rows, 1, lay.offset), 1
        else:
            rows, per_row = regroup_frame_rows(form.rows, lay.offset // (h * w), h * w,
                                               plan.merged_tokens // t, t)
        return self.family.held_rows.write(value, rows, per_row) if form.held else rows

    @staticmethod
    def once(call: ModelCall, key: tuple, source: torch.Tensor,
             make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """make() for this source, once per call and key (a group's blocks share rows and mask)."""
        kept = call.merged_rows.get(key)
        old = None if kept is None else kept[0]
        # tuples (positional rows as a (rotation, split) pair) item by item: torch.compile
        # cannot trace `is` between two tuples once a graph has broken before it
        if isinstance(old, (tuple, list)) and isinstance(source, (tuple, list)):
            fresh = len(old) != len(source) or any(
                x is not y for x, y in zip(old, source, strict=True))
        else:
            fresh = old is not source
        if fresh:
            with kept_allocations():       # kept for the group's later blocks
                kept = (source, make())
            call.merged_rows[key] = kept
        return kept[1]

    # The two patch forms -------------------------------------------------------------------------
    def replace_patch(self, kind: BlockKind, index: int, previous: Callable | None) -> Callable:
        """The "dit" replace patch of block `index`; `previous` is another pack's patch."""
        layer = f"{kind.letter}{index}"

        def patch(args: dict, extra: dict) -> dict:
            def run(a: dict) -> dict:
                return previous(a, extra) if previous is not None else extra["original_block"](a)

            # ComfyUI's forwards hand the options in args; copies of them in other packs (First
            # Block Cache's) in extra, or nowhere (some step caches): call_of finds the call
            options = args.get("transformer_options") or extra.get("transformer_options") or {}
            return self.block_call(kind, index, args, run, layer, options)

        return patch

    def forward_patch(self, kind: BlockKind, index: int, module: torch.nn.Module,
                      original: Callable) -> Callable:
        """An object patch for block `index`'s forward (`original`: what ran there before): its
        arguments by name through block_call; a tuple it returns (kind.returns) by name too."""
        params = Parameters.of(types.MethodType(type(module).forward, module))
        layer = f"{kind.letter}{index}"

        def forward(*args, **kwargs):
            named = params.bind(args, kwargs)
            if named is None:
                return original(*args, **kwargs)

            def run(a: dict) -> dict:
                positional, by_name = params.call(len(args), {**named, **a})
                result = original(*positional, **by_name)
                if not kind.returns:
                    return {kind.stream: result}
                return dict(zip(kind.returns, result, strict=True))

            out = self.block_call(kind, index, named, run, layer,
                                  named.get("transformer_options") or {})
            if not kind.returns:
                return out[kind.stream]
            # A list, not a generator: after a graph break inside the block (expert
            # routing) this line runs in a frame of its own, and dynamo refuses generator frames.
            return tuple([out[name] for name in kind.returns])

        forward.toma_block = True       # what a second ToMA node finds (patch_dit)
        return forward

    def positions_forward(self, kind: BlockKind, original: Callable) -> Callable:
        """An object patch for the forward of a block holding this node's "dit" replace patch:
        in a call this node merged (its MERGED_FLAG), kind.positions past the grid move back."""

        def forward(*args, **kwargs):
            options = kwargs.get("transformer_options")
            flag = options.get(MERGED_FLAG) if options else None
            if flag is None or flag["by"] is not self or flag["offset"] is None:
                return original(*args, **kwargs)
            start, tokens = flag["offset"], flag["tokens"]
            for name in kind.positions:
                if kwargs.get(name) is None:
                    continue
                moved = moved_positions(kwargs[name], start, start + tokens,
                                        tokens - flag["merged_tokens"])
                if moved is None:
                    raise RuntimeError(f"ToMA: {self.family.label} handed its blocks a {name} "
                                       f"inside the merged image tokens ({kwargs[name]})")
                kwargs[name] = moved
            return original(*args, **kwargs)

        return forward


def sized_attention(func: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    heads: int, mask: torch.Tensor | None = None, *args, **kwargs) -> torch.Tensor:
    """ComfyUI's attention override in a merged block: keys k [B, L', H*D] or [B, H, L', D] of the
    merged length get transformer_options[SIZE_BIAS]'s bias [B, 1, 1, L'] (on the block's own
    mask), others (a cross-attention's text) none; then the override that stood there, or `func`."""
    bias, previous = kwargs["transformer_options"][SIZE_BIAS]
    if k.shape[-2] == bias.shape[-1]:
        if bias.dtype != q.dtype:
            bias = bias.to(q.dtype)
        mask = bias if mask is None else with_bias(mask, bias)
    if previous is not None:
        return previous(func, q, k, v, heads, mask, *args, **kwargs)
    return func(q, k, v, heads, mask, *args, **kwargs)


def with_bias(mask: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """A ComfyUI attention mask (True attends, or additive; [Lq, Lk], [B, Lq, Lk] or
    [B, H, Lq, Lk]) plus the additive bias [B, 1, 1, Lk] -> [B, H | 1, Lq, Lk]."""
    if mask.dtype == torch.bool:
        mask = torch.where(mask, 0.0, float("-inf")).to(bias.dtype)
    if mask.dim() == 2:
        mask = mask[None]
    if mask.dim() == 3:
        mask = mask[:, None]
    return mask + bias


@dataclass(frozen=True)
class Parameters:
    """A block forward's parameter names, read once: binding a call by name is then tuple and
    dict work torch.compile traces (inspect.Signature.bind breaks the graph at every block).
    names: positional-or-keyword, in order; keywords: those and the keyword-only ones; extra: it
    takes **kwargs; plain: that is all it takes (else its calls run as they came, unbound)."""

    names: tuple[str, ...]
    keywords: frozenset[str]
    extra: bool
    plain: bool

    @classmethod
    def of(cls, forward: Callable) -> Parameters:
        kinds = inspect.Parameter
        params = list(inspect.signature(forward).parameters.values())
        names = tuple(p.name for p in params if p.kind is kinds.POSITIONAL_OR_KEYWORD)
        return cls(names, frozenset(names) | {p.name for p in params
                                              if p.kind is kinds.KEYWORD_ONLY},
                   any(p.kind is kinds.VAR_KEYWORD for p in params),
                   all(p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY,
                                  kinds.VAR_KEYWORD) for p in params))

    def bind(self, args: tuple, kwargs: dict) -> dict | None:
        """The passed arguments by name, or None for a call this signature cannot take."""
        if not self.plain or len(args) > len(self.names):
            return None
        named = dict(zip(self.names, args, strict=False))
        for name, value in kwargs.items():
            if name in named or (name not in self.keywords and not self.extra):
                return None
            named[name] = value
        return named

    def call(self, passed: int, named: dict) -> tuple[tuple, dict]:
        """(args, kwargs) for the values `named`, the first `passed` by position as called."""
        positional = self.names[:passed]
        return tuple(named[n] for n in positional), {
            k: v for k, v in named.items() if k not in positional}


# Installation ----------------------------------------------------------------------------------
def patch_dit(model, state: ToMAState, reading: DiTReading, patches: ForwardPatches) -> DiTToMA:
    """Install ToMA on a cloned ModelPatcher `model` (changes only its options), on what
    `reading` (dit_reading.read_model, the hook `state` was built with) found."""
    family, groups = reading.family, reading.groups
    attention = None
    if state.options.merge_scope == "attention":
        if family.attention_hooks is not None:
            attention = family.attention_hooks()
            scoped = {kind.key for kind in family.kinds if kind.attention_scope}
            attention.install(model, patches, [i for (key, i) in groups if key in scoped])
        else:
            state.setup_note(f"merge_scope attention: {family.label} has no attention-only "
                             f"variant; whole blocks merge")
    for why in reading.aside:
        state.setup_note(f"{why}: ToMA leaves those {family.label} blocks unmerged")
    toma = DiTToMA(state, family, groups, attention, reading.prefix_layers)
    # Skipped blocks get a patch too: it records text lengths and counts them in the stats.
    for kind in family.kinds:
        # blocks taking no transformer_options get no MERGED_FLAG: were another ToMA node's
        # forward patch on them, this one would merge its merged sequence again
        if not kind.takes_options and any(
                getattr(model.object_patches.get(f"diffusion_model.{kind.modules}.{i}.forward"),
                        "toma_block", False) for i in range(reading.depths[kind.key])):
            state.setup_note(f"another ToMA node already merges these {family.label} blocks, "
                             f"which take no transformer_options to tell a merged sequence "
                             f"by: this node leaves them to it")
            continue
        for i in range(reading.depths[kind.key]):
            if kind.hook == "dit":
                patch = toma.replace_patch(kind, i, existing_replace(model, kind.key, i))
                model.set_model_patch_replace(patch, "dit", kind.key, i)
                reading.patches[(kind.key, i)] = patch
                if kind.positions and (kind.key, i) in groups:
                    patches.add(model, f"{kind.modules}.{i}",
                                lambda module, original, k=kind: toma.positions_forward(
                                    k, original))
            else:
                patches.add(model, f"{kind.modules}.{i}",
                            lambda module, original, k=kind, j=i:
                            toma.forward_patch(k, j, module, original))
    log.debug("ToMA: %s patched, %d of %d blocks merged", family.label, len(groups),
              sum(reading.depths.values()))
    return toma

