"""ToMA for ComfyUI's diffusion transformers: one block patch for every family in families/.

Each block of the model gets a patch: a "dit" replace patch where ComfyUI's block loop has them,
else an object patch on the block's forward (the family says which, families/). A merged block
runs ComfyUI's own block (or the patch another pack put there before, which ToMA wraps) on a
shorter sequence: the image grid merged, the positional rows (RoPE), attention-mask rows and
per-token modulation rows of the destinations, per-frame modulation rows regrouped; text,
audio, reference images, guide frames, padding and protected frames untouched. Only the block's
update of the grid is unmerged:
    grid_out = grid + unmerge(block(merge(grid)) - merge(grid))
and every other token comes straight out of the block.

- The grid (t, h, w) comes from the model call's latent (run_state's APPLY_MODEL wrapper hands
  the call's arguments to the family's `describe`); regions are tiles of each frame spanning a
  few frames (toma_core.regions.make_regions), one frame per region where the model modulates
  every frame on its own.
- Destinations are chosen once per group of consecutive merged blocks of one kind, from the
  layer-normed grid tokens entering the group's first block, refreshed on the recompute_every
  schedule; blocks in skip_blocks run unchanged (and are counted).

What other packs' code sees, decided on every block call from what ComfyUI hands the block:
- Patches ComfyUI runs *inside* the block (attn1/attn2 patches and their output patches, the
  middle patch: masks, regional prompts, MultiTalk's attention maps) may read tokens by grid
  position (`grid_sizes`, the sequence length): such a block runs unmerged, and the user is
  told once (unet_neighbours.in_block_patches; UNet blocks fall back to attention scope).
- Another pack's "dit" replace patch or object patch of the block wraps the block: ToMA runs
  it on the merged arguments, like the block itself. Arguments the family marks opaque (an
  attention mask over fixed token spans) make the block run unmerged when set; those it marks
  shortened (alike for every token up to the grid's end) are shortened with the merged grid.
- An attention override (`optimized_attention_override`: a choice of attention kernel) gets
  the merged queries, keys and values: attention does not care about the sequence's order.
  With SIZE_WEIGHTED, ToMA's own (sized_attention) stands in front of it in merged blocks;
  attention calls that do not hand ComfyUI's attention the block's transformer_options (one
  that takes the model call's), and sequence-parallel calls, get no size bias.
- In a merged block, transformer_options carry MERGED_FLAG and `img_slice` rewritten to the
  merged sequence (token_layout.merged_options); grid descriptions such as `grid_sizes` and
  `reference_image_num_tokens` still describe the unmerged input (references never merge).
  Patches after a block and before the blocks (`double_block`, `post_input`) see full length.
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
from .dit_families import BlockKind, Family
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
    map_positions,
    mask_fits,
    merge_mask,
    merged_options,
    merged_rows_of,
    moved_positions,
    position_tensors,
    regroup_frame_rows,
    sequence_positions,
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

    groups: (kind key, block index) -> first index of its group, for merged blocks only.
    attention: the family's attention_hooks for merge_scope "attention", or None (whole
    blocks).
    """

    def __init__(self, state: ToMAState, family: Family, groups: dict[tuple[str, int], int],
                 attention=None) -> None:
        self.state = state
        self.family = family
        self.groups = groups
        self.attention = attention
        # the layers whose prompt keys and values this patch keeps (family.prefix_cache; see
        # DiTReading), None where it keeps none
        self.prefix_layers: list[torch.nn.Module] | None = None

    # One block call ------------------------------------------------------------------------------
    def block_call(self, kind: BlockKind, index: int, args: dict,
                   run: Callable[[dict], dict], layer: str, options: dict) -> dict:
        """Run one block call, merged when it should be; args / run's result are the block's
        arguments / outputs by name (the "dit" patch form), `options` its transformer_options
        (wherever the caller handed them over); `layer` names the block in the stats (made
        when the patch is, not in the traced call: under torch.compile a block index can turn
        symbolic, which no string can be formatted from)."""
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
        plan, lay, forms, key = found
        merged_args, merged, base = self.merged_args(kind, plan, lay, args, stream, options,
                                                     call, forms, key)
        if merged is None:
            return self.attention.run(index, plan, merged_args, run)
        out = run(merged_args)
        got = stream_of(kind, out[kind.stream])
        restored = self.restore(call, plan, got, merged, base, lay.offset)
        if restored is got:
            return out
        return {**out, kind.stream: restored if kind.bare
                else with_stream(kind, out[kind.stream], restored, args[kind.stream])}

    def plan_for(self, kind: BlockKind, index: int, args: dict, stream: torch.Tensor | None,
                 options: dict, call: ModelCall | None, layer: str
                 ) -> tuple[MergePlan, Layout, dict, tuple] | None:
        """(plan, layout, modulation rows by argument name (RowForm), plan key) for this block
        call (its grid tensor `stream`), or None to run it unchanged."""
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
                or not self.fits(call, kind, args, lay, layer, options)):
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
        return None if plan is None else (plan, lay, forms, key)

    def regions_of(self, grid: tuple[int, int, int], frames: int) -> Regions:
        """The t*h*w grid's regions: `frames` frames deep, tile_count tiles per frame (0: the
        family's default)."""
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
                       ) -> tuple[MergePlan, Layout, dict, tuple] | None:
        """plan_for on a sequence shard [B, S, C] (sequence_parallel.py). Every decision here
        comes from what is alike on every rank (shapes, options, the call's grid), never from
        this rank's own tokens or offsets, so that every rank merges, or none does: the
        attention's all-to-all needs equal lengths."""
        shard, label = call.shard, self.family.label
        spec = kind.shard
        if spec is None:
            call.note(f"ToMA does not merge {label} under raylight's sequence parallelism "
                      f"({shard.forward}): those model calls run unmerged")
            return None
        text = 0
        if spec.text_in_stream:
            span = options.get("img_slice")
            text = int(span[0]) if span else call.txt_len
            if text is None:
                call.note(f"{label}'s {kind.key} blocks under raylight's sequence parallelism "
                          f"got no text length (img_slice): those blocks run unmerged")
                return None
        geometry = ShardGeometry(shard.world, stream.shape[1], text + call.prefix,
                                 self.regions_of(call.grid, self.family.frames_per_region))
        if not geometry.fits():
            call.note(f"a {shard.world} x {stream.shape[1]}-token split sequence cannot hold "
                      f"{label}'s {geometry.base.tokens} grid tokens after "
                      f"{geometry.grid_start} others: those blocks run unmerged")
            return None
        offset = geometry.offset(shard.rank)
        lay = Layout(offset, offset, stream.shape[1], spec.pe_item)
        mask = args.get(kind.mask) if kind.mask else None
        if isinstance(mask, torch.Tensor) or not self.fits(call, kind, args, lay, layer, options):
            if isinstance(mask, torch.Tensor):
                call.note(f"raylight's sequence parallelism drops attention masks; ToMA leaves "
                          f"{label} blocks with one unmerged")
            return None
        for name in kind.rows:
            if self.read_rows(kind, args.get(name), stream.shape[1]) is not None:
                call.note(f"under raylight's sequence parallelism {label}'s {name} rows (one per "
                          f"frame or token) reach every GPU whole, not split with its tokens "
                          f"(raylight's forward does not split them): those blocks run "
                          f"unmerged")
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
        return None if plan is None else (plan, lay, {}, key)

    def build_shard(self, call: ModelCall, kind: BlockKind, stream: torch.Tensor, offset: int,
                    geometry: ShardGeometry) -> MergePlan | None:
        """This rank's plan: its clipped regions (every rank's, computed alike on every rank and
        kept for the run), built from its own shard's tokens [B, S, C] from row `offset`."""
        o = self.state.options
        spans = call.run.host_reads.get(("shard_regions", geometry, o.ratio))
        if spans is None:
            spans = call.run.host_reads.setdefault(("shard_regions", geometry, o.ratio),
                                                   shard_regions(geometry, o.ratio))
            if spans:
                span = next(span for span in spans if span is not None)
                call.note(f"{self.family.label}'s {kind.key} blocks on {geometry.world} GPUs: "
                          f"each drops "
                          f"{span.tokens - sum(span.counts)} grid tokens, "
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

    def fits(self, call: ModelCall, kind: BlockKind, args: dict, lay: Layout, layer: str,
             options: dict) -> bool:
        """Whether positional rows and mask line up with the sequence, no opaque argument is
        set, and no other pack's in-block patch reads tokens by their grid position (else the
        block runs unmerged)."""
        for name in kind.pe_names:
            seq = stream_layout(kind, lay, args) if name in kind.stream_pe else lay
            value = args.get(name)
            for pe in (position_tensors(value) if seq.pe_item is None
                       else sequence_positions(value, seq.pe_item)):
                axis = token_axis(pe, seq.seq_len)
                if axis is None or pe.shape[axis] != seq.seq_len:
                    call.note(f"positional rows {tuple(pe.shape)} do not match the "
                              f"{seq.seq_len}-token sequence; block {layer} and "
                              f"others like it run unmerged")
                    return False
        mask = args.get(kind.mask) if kind.mask else None
        if isinstance(mask, torch.Tensor) and not mask_fits(mask, kind.mask_dims, lay.seq_len):
            call.note(f"attention mask {tuple(mask.shape)} does not span the "
                      f"{lay.seq_len}-token sequence; block {layer} and others like "
                      f"it run unmerged")
            return False
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
            return False
        foreign = options.get("patches") and in_block_patches(options, DIT_IN_BLOCK_PATCHES)
        if foreign:
            call.note(f"other nodes patch inside {self.family.label} blocks "
                      f"({', '.join(foreign)}); such patches may read tokens by "
                      f"their grid position, so those blocks run unmerged")
            return False
        return True

    def read_rows(self, kind: BlockKind, value: object,
                  length: int) -> tuple[torch.Tensor, int, bool] | None:
        """(rows [B, R, ...], tokens each row covers, held in an object) of a modulation-rows
        argument over a stream of `length` tokens; None for no rows (absent, or one for all:
        a single row, or a tensor of other dims than kind.rows_dims)."""
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
        """How each modulation-rows argument of the block lines up with the merged sequence
        (argument name -> RowForm; rows one for all are left out). None when some cannot be
        lined up: rows spread over other than the whole stream, or per-frame rows where the
        tokens around the grid are not whole frames."""
        t, h, w = call.grid
        forms: dict[str, RowForm] = {}
        for name in kind.rows:
            found = self.read_rows(kind, args.get(name), stream.shape[1])
            if found is None:
                continue
            rows, per_row, held = found
            after = stream.shape[1] - lay.offset - t * h * w
            if per_row * rows.shape[1] != stream.shape[1]:
                mode = None
            elif per_row == 1:
                mode = "token"
            elif per_row == h * w and lay.offset % per_row == 0 and after % per_row == 0:
                mode = "frame"
            else:
                mode = None
            if mode is None:
                call.note(f"modulation rows {name} ({rows.shape[1]} rows) do not line "
                          f"up with {stream.shape[1]} tokens of {t}x{h}x{w} frames; "
                          f"block {layer} and others like it run unmerged")
                return None
            forms[name] = RowForm(mode, rows, held)
        return forms

    def merged_args(self, kind: BlockKind, plan: MergePlan, lay: Layout, args: dict,
                    stream: torch.Tensor, options: dict, call: ModelCall,
                    forms: dict[str, RowForm], key: tuple
                    ) -> tuple[dict, torch.Tensor | None, Pending | None]:
        """The block's arguments for the merged sequence, its merged grid tensor and
        plan.begin's base for the stream's unmerge (both None, and the stream whole, when only
        the attention merges: the attention helper merges it inside the block). Positional
        rows, masks and modulation rows are the same for every block of a group in a call:
        merged once, kept in call.merged_rows."""
        out, merged, base = dict(args), None, None
        if self.attention is None or not kind.attention_scope or call.shard is not None:
            merged, base = plan.begin(stream, lay.offset)
            out[kind.stream] = merged if kind.bare else with_stream(
                kind, args[kind.stream], merged)      # a bare tensor without a further call
        for name in kind.pe_names:
            seq = stream_layout(kind, lay, args) if name in kind.stream_pe else lay
            value = args.get(name)
            if position_tensors(value):
                out[name] = self.once(call, ("pe", name, key), value, lambda v=value, q=seq: (
                    map_positions(v, lambda pe: merged_rows_of(kind, plan, pe, q),
                                  q.pe_item)))
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
                moved_positions(v, lay.offset, lay.offset + plan.tokens,
                                plan.tokens - plan.merged_tokens, spans=True)))
        if merged is not None:
            for name in kind.positions:
                if name in args:
                    out[name] = moved_positions(args[name], lay.offset, lay.offset + plan.tokens,
                                                plan.tokens - plan.merged_tokens)
            for name, shorten in kind.shortened:
                value = args.get(name)
                if value is not None:
                    out[name] = self.once(call, ("shortened", name, key), value, lambda v=value,
                                          f=shorten: f(v, lay.offset + plan.tokens,
                                                       plan.tokens - plan.merged_tokens))
        if not kind.takes_options:
            return out, merged, base
        out["transformer_options"] = sized = merged_options(
            options, lay.seq_start, plan, call.grid, None if merged is None else lay.offset,
            self, call.shard is not None and kind.shard.text_in_stream)
        if SIZE_WEIGHTED and call.shard is None:
            length = lay.seq_len - plan.tokens + plan.merged_tokens
            bias = plan.size_biases.get((length, lay.seq_start, stream.dtype))  # no call when kept
            if bias is None:
                bias = size_bias(plan, length, lay.seq_start, stream.dtype)
            sized[SIZE_BIAS] = (bias, options.get(OVERRIDE))
            sized[OVERRIDE] = sized_attention
        return out, merged, base

    def merged_rows(self, call: ModelCall, plan: MergePlan, lay: Layout, value: object,
                    form: RowForm) -> object:
        """A modulation-rows argument for the merged sequence: per-token rows those of the
        destinations, per-frame rows regrouped (regroup_frame_rows; regions are one frame deep
        then, so every merged frame holds merged_tokens / t tokens), in the form they came."""
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
        """make() for this source tensor, made once per call and key (the blocks of a group get
        the same positional rows, mask and modulation rows) and again if the source differs."""
        kept = call.merged_rows.get(key)
        if kept is None or not same_object(kept[0], source):
            with kept_allocations():       # kept for the group's later blocks
                kept = (source, make())
            call.merged_rows[key] = kept
        return kept[1]

    def restore(self, call: ModelCall, plan: MergePlan, out: torch.Tensor | None,
                merged: torch.Tensor, base: Pending, offset: int) -> torch.Tensor | None:
        """The full-length stream from the block's output on the merged one (plan.finish),
        unless the block returned something else than a merged sequence (a caching pack
        answering from its cache): that is passed on as it is."""
        if out is None or out.shape[:2] != merged.shape[:2]:
            got = "no stream" if out is None else f"{out.shape[1]} tokens"
            call.note(f"a block returned {got} for a merged input of "
                      f"{merged.shape[1]}; its output is passed on unchanged")
            return out
        return plan.finish(out, base, offset)

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
        """An object patch for block `index`'s forward: its arguments by name, as the block's
        own signature names them, through block_call; `original` is what ran there before. A
        forward returning a tuple (kind.returns) is seen by name like a "dit" patch's outputs
        and returns the same tuple."""
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

        forward.toma_block = True       # what a second ToMA node finds (optionless_chain)
        return forward

    def positions_forward(self, kind: BlockKind, original: Callable) -> Callable:
        """An object patch for the forward of a block whose "dit" replace patch this node
        installed, where ComfyUI's block loop hands the block kind.positions beside the
        patch's arguments: in a call this node's patch merged (its MERGED_FLAG), positions
        past the grid move back by the tokens merged away. The loop passes them and
        transformer_options by name."""

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
    """ComfyUI's attention override in a merged block: keys k [B, L', H*D] or [B, H, L', D] of
    the merged sequence's length get transformer_options[SIZE_BIAS]'s bias [B, 1, 1, L'] on
    their logits (added to the block's own mask); other keys (a cross-attention's text) none.
    Then the override that stood there before, or ComfyUI's attention `func`."""
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


def stream_layout(kind: BlockKind, lay: Layout, args: dict) -> Layout:
    """The layout of kind.stream_pe's rows: the stream's own tokens, where `lay` is the
    attention sequence's."""
    return Layout(lay.offset, lay.offset, stream_of(kind, args.get(kind.stream)).shape[1])


def same_object(a: object, b: object) -> bool:
    """Whether `b` is `a`, a tuple or list compared item by item (positional rows as a
    (rotation, split) pair: torch.compile cannot trace `is` between two tuples once a graph
    has broken before it)."""
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))
    return a is b


@dataclass(frozen=True)
class Parameters:
    """A block forward's parameter names, read once when the patch is made: binding a call by
    name is then plain tuple and dict work, which torch.compile traces (inspect.Signature.bind
    reads a mappingproxy dynamo cannot follow: a graph break at every block).

    names: the parameters that take a value by position or name, in order; keywords: those
    and the keyword-only ones; extra: whether it takes **kwargs; plain: whether that is all it
    takes (a forward with positional-only parameters or *args is not bound: its calls run as
    they came)."""

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
        """(args, kwargs) for the values `named`, in the form of a call that passed `passed`
        arguments by position: those positional, the rest by name."""
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
    toma = DiTToMA(state, family, groups, attention)
    toma.prefix_layers = reading.prefix_layers
    # Skipped blocks get a patch too: it records text lengths and counts them in the stats.
    for kind in family.kinds:
        if optionless_chain(model, kind, reading.depths[kind.key]):
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


def optionless_chain(model, kind: BlockKind, depth: int) -> bool:
    """Whether the blocks of `kind`, which take no transformer_options, already hold another
    ToMA node's forward patch on ModelPatcher `model`: the merged sequence it hands them
    carries no MERGED_FLAG, so a second node would merge it again."""
    return not kind.takes_options and any(
        getattr(model.object_patches.get(f"diffusion_model.{kind.modules}.{i}.forward"),
                "toma_block", False) for i in range(depth))
