"""ToMA for ComfyUI's Flux-family models (Flux.1 dev/schnell, Flux Kontext, Flux 2, Chroma).

What changes, and how:

- Every double and single block gets a "dit" replace patch. A merged block runs ComfyUI's own
  block (or the patch another pack put there before, which ToMA wraps) on a shorter sequence:
  the main image tokens merged, the RoPE rows (`pe`) and attention-mask rows of their
  destinations, text and Kontext reference tokens untouched. Only the block's update of the image
  tokens is unmerged: img_out = img + unmerge(block(merge(img)) - merge(img)); text and
  reference tokens come straight out of the block.
- Single blocks always run merged whole. Double blocks have two scopes:
  "block"     -- the whole block (both streams' attention and MLPs) on the merged sequence;
  "attention" -- the paper's variant: image Q/K/V come from merged tokens (object patches on the
                 block's img_attn.qkv / img_attn.proj merge the projection input and unmerge the
                 attention projection's output); the image MLP runs at full length.
                 This route is the same on every ComfyUI version (the >= 0.17 attn1 patches
                 would only see Q/K/V after the full-length projection).
  "auto" picks AUTO_DOUBLE_SCOPE, the faster at comparable fidelity (bench/flux_blocks.py).
- The token grid comes from the model call's latent (run_state's APPLY_MODEL wrapper hands it
  to `describe_call`: H x W padded to the patch size); text length from the block call itself.
  Blocks in skip_blocks run unchanged.
- Other packs' code inside a merged block sees transformer_options whose token spans
  (`img_slice`) are rewritten to the merged sequence.
- Destinations are chosen once per group of consecutive merged blocks of one kind, from the
  layer-normed image tokens entering the group's first block, and refreshed on the
  recompute_every schedule. Doubles and singles never share a group, even when d18 and s0 are
  both merged: one rule for every skip_blocks value and one cache key per group, for one more
  plan per recompute period (about a tenth of one block's time, see bench/flux_blocks.py).
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..toma_core import MergePlan, build_plan
from .run_state import ModelCall, ToMAState, patch_forward

log = logging.getLogger("ToMA")

DEFAULT_TILE_COUNT = 256
# bench/flux_blocks.py (Flux.1-size blocks, 4096 image + 512 text tokens, fp32 CPU, ratio 0.5):
# double block "block" 1.97x vs "attention" 1.36x faster than plain; relative L2 error of the
# image update 0.14 vs 0.09, the same as a merged single block's 0.13 (merged whole either
# way). Whole model (default skips): 1.68x vs 1.54x. Hence "block".
AUTO_DOUBLE_SCOPE = "block"
# Set in the transformer_options handed to a merged block: a ToMA patch further in (a second
# ToMA node on the same model) sees it and leaves the already merged sequence alone.
MERGED_FLAG = "toma_merged"
# Flux 2's reference method whose reference tokens get their own (timestep 0) modulation,
# over token spans ComfyUI fixes before the blocks run (see describe_call).
TIMESTEP_ZERO_METHOD = "index_timestep_zero"


@dataclass
class AttentionCall:
    """A double block running in scope "attention": its plan, and whether the qkv hook merged."""

    plan: MergePlan
    merged: bool = False


def token_grid(latent_shape: torch.Size | tuple, patch_size: int) -> tuple[int, int] | None:
    """(h, w) image tokens of a latent [B, C, H, W]: Flux pads each side up to the patch size."""
    if len(latent_shape) != 4:
        return None
    return math.ceil(latent_shape[-2] / patch_size), math.ceil(latent_shape[-1] / patch_size)


def merged_options(options: dict, start: int, removed: int) -> dict:
    """transformer_options for a block running on a merged sequence: flagged as merged, and
    `img_slice` (the image part of the sequence, [start, end)) shortened by the `removed` tokens
    when it holds the grid that starts at `start`."""
    out = {**options, MERGED_FLAG: True}
    span = options.get("img_slice")
    if span is not None and len(span) == 2 and span[0] <= start < span[1]:
        out["img_slice"] = [span[0], span[1] - removed]
    return out


def group_starts(depth: int, skipped: frozenset[int] | set[int]) -> dict[int, int]:
    """Merged block index -> first index of its run of consecutive merged blocks."""
    groups: dict[int, int] = {}
    start = None
    for i in range(depth):
        if i in skipped:
            start = None
            continue
        start = i if start is None else start
        groups[i] = start
    return groups


# Sequence surgery -------------------------------------------------------------------------------
def merge_input(plan: MergePlan, x: torch.Tensor, prefix: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, prefix + N + suffix, C] -> (merged [B, prefix + N' + suffix, C], merged grid [B, N', C]
    as it went in). Flux blocks add their update in place, so the grid is kept as a copy."""
    merged = plan.merge(x, prefix)
    return merged, merged[:, prefix:prefix + plan.merged_tokens].clone()


def unmerge_output(plan: MergePlan, x: torch.Tensor, out: torch.Tensor, before: torch.Tensor,
                   prefix: int) -> torch.Tensor:
    """Full-length block output: grid = x's grid + unmerge(out's grid - before); the prefix and
    suffix (text, references) are taken from `out` as they are.
    x [B, prefix + N + suffix, C], out [B, prefix + N' + suffix, C] -> [B, prefix + N + suffix, C].
    """
    n, m = plan.tokens, plan.merged_tokens
    grid = x[:, prefix:prefix + n] + plan.unmerge(out[:, prefix:prefix + m] - before)
    return torch.cat((out[:, :prefix], grid, out[:, prefix + m:]), dim=1)


def merge_pe(plan: MergePlan, pe: torch.Tensor | None, prefix: int) -> torch.Tensor | None:
    """RoPE rows [B|1, 1, L, D/2, 2, 2] -> [B', 1, L', D/2, 2, 2]: merged tokens take their
    destination's row; text and reference rows are kept."""
    return None if pe is None else plan.merge_positions(pe, 2, prefix)


def mask_fits(mask: torch.Tensor | None, length: int) -> bool:
    """Whether attn_mask can be merged: its last two dims (queries, keys) each span the whole
    sequence of `length` tokens or broadcast (size 1)."""
    if mask is None:
        return True
    return mask.dim() >= 2 and all(s in (1, length) for s in mask.shape[-2:])


def merge_mask(plan: MergePlan, mask: torch.Tensor | None, prefix: int,
               length: int) -> torch.Tensor | None:
    """attn_mask [..., L|1, L|1] gathered at the merged positions -> [..., L'|1, L'|1].

    A 2-D mask gets a leading batch dim (the attention functions accept [B, L, L]); a batch of 1
    is expanded when destinations differ per item.
    """
    if mask is None:
        return None
    out = mask.unsqueeze(0) if mask.dim() == 2 else mask
    for dim in (out.dim() - 2, out.dim() - 1):
        if out.shape[dim] == length:
            out = plan.merge_positions(out, dim, prefix)
    return out


# The patch ---------------------------------------------------------------------------------------
class FluxToMA:
    """The patch functions for one ToMA node on one Flux-family model."""

    def __init__(self, state: ToMAState, patch_size: int, double_scope: str,
                 groups: dict[tuple[str, int], int]) -> None:
        self.state = state
        self.patch_size = patch_size
        self.double_scope = double_scope
        self.groups = groups
        self.timestep_zero = False    # whether the model modulates timestep-zero references

    # Model call ----------------------------------------------------------------------------------
    def describe_call(self, call: ModelCall, base_model, arguments: dict) -> None:
        """Fill in a model call from BaseModel.apply_model's arguments (by name, however
        ComfyUI passed them): the token grid (h, w) of latent x, or no merging when x is not a
        [B, C, H, W] latent.

        Timestep-zero guard, on ComfyUI versions whose Flux has that modulation (its
        forward_orig takes `timestep_zero_index`): when the call has reference latents
        (`ref_latents`) and their method is "index_timestep_zero" (the call's
        `ref_latents_method`, else the model's `params.default_ref_method` read now, so an
        object patch of it counts), ComfyUI modulates the main image tokens and the reference
        tokens differently over spans it fixes before the blocks run; a merged sequence would
        shift those spans, so the whole call runs unmerged (said once, in the log and the
        stats line).
        """
        x = arguments.get("x")
        grid = token_grid(tuple(x.shape), self.patch_size) if torch.is_tensor(x) else None
        call.grid = grid
        call.mergeable = grid is not None
        refs = arguments.get("ref_latents")
        method = arguments.get("ref_latents_method")
        if method is None:
            params = getattr(getattr(base_model, "diffusion_model", None), "params", None)
            method = getattr(params, "default_ref_method", None)
        if (self.timestep_zero and refs is not None and len(refs) > 0
                and method == TIMESTEP_ZERO_METHOD):
            call.mergeable = False
            self.state.notice("references with 'index_timestep_zero' modulate fixed token "
                              "spans; those model calls run unmerged")

    # Decisions -----------------------------------------------------------------------------------
    def plan_for(self, kind: str, index: int, tokens: torch.Tensor, prefix: int, options: dict,
                 pe: torch.Tensor | None, mask: torch.Tensor | None,
                 seq_len: int) -> MergePlan | None:
        """The plan for this block call, or None to run it unchanged.

        tokens [B, prefix + N + suffix, C]: the stream holding the image grid after `prefix`
        tokens; pe / mask / seq_len: the attention sequence (text + image stream).
        """
        call = self.state.current()
        layer = f"{kind[0]}{index}"
        h, w = call.grid if call is not None and call.mergeable else (0, 0)
        level = f"{h}x{w}" if call is not None else "?"
        tokens_n = h * w
        group = self.groups.get((kind, index))
        if (group is None or not tokens_n or options.get(MERGED_FLAG)
                or tokens.dim() != 3 or tokens.shape[1] < prefix + tokens_n
                or not self.sequence_fits(pe, mask, seq_len, layer)):
            self.state.record(layer, level, tokens_n, None, None)
            return None
        step = self.state.active_step(options)
        if step is None:
            self.state.record(layer, level, tokens_n, None, None)
            return None
        o = self.state.options
        key = ("flux", kind, group, h, w, tokens.shape[0])
        grid = tokens[:, prefix:prefix + tokens_n]
        plan = self.state.plan(key, step, lambda: build_plan(
            F.layer_norm(grid.float(), grid.shape[-1:]), h, w, o.ratio, mode=o.region,
            tile_count=o.tile_count or DEFAULT_TILE_COUNT, tau=o.tau, unmerge=o.unmerge,
            batch=o.batch_policy))
        self.state.record(layer, level, tokens_n, plan, step)
        return plan

    def sequence_fits(self, pe: torch.Tensor | None, mask: torch.Tensor | None, seq_len: int,
                      layer: str) -> bool:
        """Whether pe and attn_mask line up with the sequence (else the block runs unmerged)."""
        if pe is not None and (pe.dim() < 3 or pe.shape[2] != seq_len):
            self.state.notice(f"RoPE rows {tuple(pe.shape)} do not match the {seq_len}-token "
                              f"sequence; block {layer} and others like it run unmerged")
            return False
        if not mask_fits(mask, seq_len):
            self.state.notice(f"attention mask {tuple(mask.shape)} does not span the "
                              f"{seq_len}-token sequence; block {layer} and others like it "
                              f"run unmerged")
            return False
        return True

    # Replace patches -----------------------------------------------------------------------------
    def double_block(self, index: int, previous: Callable | None) -> Callable:
        """The "dit" replace patch of double block `index`; `previous` is another pack's patch."""

        def patch(args: dict, extra: dict) -> dict:
            def run(a: dict) -> dict:
                return previous(a, extra) if previous is not None else extra["original_block"](a)

            img, txt = args["img"], args["txt"]
            options = args.get("transformer_options") or {}
            call = self.state.current()
            if call is not None:
                call.data["txt_len"] = txt.shape[1]
            prefix = txt.shape[1]
            plan = self.plan_for("double", index, img, 0, options, args.get("pe"),
                                 args.get("attn_mask"), prefix + img.shape[1])
            if plan is None:
                return run(args)
            merged_args = {**args, "pe": merge_pe(plan, args.get("pe"), prefix),
                           "attn_mask": merge_mask(plan, args.get("attn_mask"), prefix,
                                                   prefix + img.shape[1]),
                           "transformer_options": merged_options(
                               options, prefix, plan.tokens - plan.merged_tokens)}
            if self.double_scope == "attention":
                return self.run_attention_scope(index, plan, merged_args, run)
            merged, before = merge_input(plan, img, 0)
            out = run({**merged_args, "img": merged})
            return {**out, "img": self.restore(plan, img, out["img"], merged, before, 0)}

        return patch

    def run_attention_scope(self, index: int, plan: MergePlan, merged_args: dict,
                            run: Callable[[dict], dict]) -> dict:
        """Run a double block with only its image attention merged (hooks on img_attn, which
        find the plan in this thread's model call)."""
        entries = self.state.current().data.setdefault("attention", {})
        entries[index] = AttentionCall(plan)
        try:
            return run(merged_args)
        finally:
            entries.pop(index)

    def single_block(self, index: int, previous: Callable | None) -> Callable:
        """The "dit" replace patch of single block `index` (img = text, image, references)."""

        def patch(args: dict, extra: dict) -> dict:
            def run(a: dict) -> dict:
                return previous(a, extra) if previous is not None else extra["original_block"](a)

            x = args["img"]
            options = args.get("transformer_options") or {}
            prefix = self.single_text_len(options)
            if prefix is None:
                self.state.record(f"s{index}", "?", 0, None, None)
                return run(args)
            plan = self.plan_for("single", index, x, prefix, options, args.get("pe"),
                                 args.get("attn_mask"), x.shape[1])
            if plan is None:
                return run(args)
            merged, before = merge_input(plan, x, prefix)
            out = run({**args, "img": merged, "pe": merge_pe(plan, args.get("pe"), prefix),
                       "attn_mask": merge_mask(plan, args.get("attn_mask"), prefix, x.shape[1]),
                       "transformer_options": merged_options(
                           options, prefix, plan.tokens - plan.merged_tokens)})
            return {**out, "img": self.restore(plan, x, out["img"], merged, before, prefix)}

        return patch

    def restore(self, plan: MergePlan, x: torch.Tensor, out: torch.Tensor, merged: torch.Tensor,
                before: torch.Tensor, prefix: int) -> torch.Tensor:
        """unmerge_output, unless the block returned something else than a merged sequence (a
        caching pack answering from its cache): that is passed on as it is."""
        if out.shape[:2] != merged.shape[:2]:
            self.state.notice(f"a block returned {out.shape[1]} tokens for a merged input of "
                              f"{merged.shape[1]}; its output is passed on unchanged")
            return out
        return unmerge_output(plan, x, out, before, prefix)

    def single_text_len(self, options: dict) -> int | None:
        """Text tokens in front of the single stream: `img_slice` where ComfyUI gives it, else
        the length the double blocks of this call saw."""
        img_slice = options.get("img_slice")
        if img_slice:
            return int(img_slice[0])
        call = self.state.current()
        return call.data.get("txt_len") if call is not None else None

    # Scope "attention": hooks on a double block's image attention projections -------------------
    def attention_entry(self, index: int) -> AttentionCall | None:
        """Double block `index`'s attention-scope plan in this thread's model call, if any."""
        call = self.state.current()
        return None if call is None else call.data.get("attention", {}).get(index)

    def qkv_forward(self, index: int, original: Callable) -> Callable:
        """img_attn.qkv: project merged image tokens [B, N + refs, C] -> [B, N' + refs, 3C]."""

        def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            entry = self.attention_entry(index)
            if entry is None or entry.merged or x.shape[1] < entry.plan.tokens:
                return original(x, *args, **kwargs)
            entry.merged = True
            return original(entry.plan.merge(x), *args, **kwargs)

        return forward

    def proj_forward(self, index: int, original: Callable) -> Callable:
        """img_attn.proj: project, then unmerge [B, N' + refs, C] -> [B, N + refs, C].
        Unmerge rows sum to 1, so unmerging after the projection equals unmerging before it."""

        def forward(y: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            entry = self.attention_entry(index)
            out = original(y, *args, **kwargs)
            return out if entry is None or not entry.merged else entry.plan.unmerge(out)

        return forward


# Installation ----------------------------------------------------------------------------------
def resolve_double_scope(merge_scope: str) -> str:
    """The double-block scope for the merge_scope option ("auto" -> AUTO_DOUBLE_SCOPE)."""
    return AUTO_DOUBLE_SCOPE if merge_scope == "auto" else merge_scope


def existing_replace(model, block_kind: str, index: int) -> Callable | None:
    """Another pack's "dit" replace patch for (block_kind, index) on this ModelPatcher, if any;
    block_kind: "double_block" or "single_block"."""
    to = model.model_options.get("transformer_options", {})
    return to.get("patches_replace", {}).get("dit", {}).get((block_kind, index))


def install_attention_hooks(model, toma: FluxToMA, diffusion_model: torch.nn.Module,
                            index: int) -> None:
    """Object patches on double block `index`'s img_attn.qkv and img_attn.proj forwards
    (chaining another pack's patch of the same forward)."""
    attn = diffusion_model.double_blocks[index].img_attn
    for name, make in (("qkv", toma.qkv_forward), ("proj", toma.proj_forward)):
        patch_forward(model, f"double_blocks.{index}.img_attn.{name}", getattr(attn, name),
                      lambda original, m=make: m(index, original))


def patch_flux(model, state: ToMAState) -> FluxToMA:
    """Install ToMA on a cloned Flux-family ModelPatcher `model` (changes only its options).

    Raises ValueError (shown by the node) for skip_blocks past the model's depth.
    """
    diffusion_model = model.get_model_object("diffusion_model")
    doubles, singles = len(diffusion_model.double_blocks), len(diffusion_model.single_blocks)
    skip = state.options.skip_blocks
    skip.check_depth(doubles, singles)
    groups = {("double", i): g for i, g in group_starts(doubles, skip.double).items()}
    groups.update({("single", i): g for i, g in group_starts(singles, skip.single).items()})
    scope = resolve_double_scope(state.options.merge_scope)
    toma = FluxToMA(state, int(getattr(diffusion_model, "patch_size", 2)), scope, groups)
    toma.timestep_zero = "timestep_zero_index" in inspect.signature(
        type(diffusion_model).forward_orig).parameters
    state.describe = toma.describe_call
    # Skipped blocks get a patch too: it records the text length and counts them in the stats.
    for kind, depth, make in (("double", doubles, toma.double_block),
                              ("single", singles, toma.single_block)):
        for i in range(depth):
            previous = existing_replace(model, f"{kind}_block", i)
            model.set_model_patch_replace(make(i, previous), "dit", f"{kind}_block", i)
    if scope == "attention":
        for i in range(doubles):
            if ("double", i) in groups:
                install_attention_hooks(model, toma, diffusion_model, i)
    log.debug("ToMA: Flux patched, %d/%d double and %d/%d single blocks merged, double scope %s",
              sum(k == "double" for k, _ in groups), doubles,
              sum(k == "single" for k, _ in groups), singles, scope)
    return toma
