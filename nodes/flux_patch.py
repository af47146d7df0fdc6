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
- The token grid comes from a DIFFUSION_MODEL wrapper (the latent's H x W, padded to the patch
  size); text length from the block call itself. Blocks in skip_blocks run unchanged.
- Destinations are chosen once per group of consecutive merged blocks of one kind, from the
  layer-normed image tokens entering the group's first block, and refreshed on the
  recompute_every schedule. Doubles and singles never share a group, even when d18 and s0 are
  both merged: one rule for every skip_blocks value and one cache key per group, for one more
  plan per recompute period (about a tenth of one block's time, see bench/flux_blocks.py).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..toma_core import MergePlan, build_plan
from .run_state import ToMAState, patch_forward, plain_function

log = logging.getLogger("ToMA")

DEFAULT_TILE_COUNT = 256
# bench/flux_blocks.py (Flux.1-size blocks, 4096 image + 512 text tokens, fp32 CPU, ratio 0.5):
# double block "block" 1.97x vs "attention" 1.36x faster than plain; relative L2 error of the
# image update 0.14 vs 0.09, the same as a merged single block's 0.13 (merged whole either
# way). Whole model (default skips): 1.68x vs 1.54x. Hence "block".
AUTO_DOUBLE_SCOPE = "block"
GRID_WRAPPER_KEY = "toma_flux_grid"
# Set in the transformer_options handed to a merged block: a ToMA patch further in (a second
# ToMA node on the same model) sees it and leaves the already merged sequence alone.
MERGED_FLAG = "toma_merged"
# Flux 2's "index_timestep_zero" references modulate fixed token spans: merging would shift them.
TIMESTEP_ZERO_METHOD = "index_timestep_zero"

_UNSET = object()


@dataclass
class FluxCall:
    """One model call: image token grid h x w, text length once a block has shown it, and the
    sampling step (None: no merging in this call; unset until the first block asks)."""

    h: int
    w: int
    mergeable: bool = True
    txt_len: int | None = None
    step: object = _UNSET

    @property
    def tokens(self) -> int:
        return self.h * self.w


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
        self.default_ref_method: str | None = None   # the model's, when a call names none
        self.calls: list[FluxCall] = []              # innermost model call last
        self.attention: dict[int, AttentionCall] = {}
        self._warned: set[str] = set()

    def warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            log.warning("ToMA: %s", message)  # once per message and patch

    # Model call ----------------------------------------------------------------------------------
    def grid_wrapper(self, executor: Callable, *args, **kwargs):
        """WrappersMP.DIFFUSION_MODEL: note the token grid of latent x (first positional)."""
        x = args[0] if args else kwargs.get("x")
        grid = token_grid(tuple(x.shape), self.patch_size) if torch.is_tensor(x) else None
        call = FluxCall(*grid) if grid is not None else FluxCall(0, 0, mergeable=False)
        refs = kwargs.get("ref_latents")
        method = kwargs.get("ref_latents_method", self.default_ref_method)
        if refs is not None and len(refs) > 0 and method == TIMESTEP_ZERO_METHOD:
            call.mergeable = False
            self.warn_once("references with 'index_timestep_zero' modulate fixed token spans; "
                           "those model calls run unmerged")
        self.calls.append(call)
        try:
            return executor(*args, **kwargs)
        finally:
            self.calls.pop()

    @property
    def current(self) -> FluxCall | None:
        return self.calls[-1] if self.calls else None

    # Decisions -----------------------------------------------------------------------------------
    def plan_for(self, kind: str, index: int, tokens: torch.Tensor, prefix: int, options: dict,
                 pe: torch.Tensor | None, mask: torch.Tensor | None,
                 seq_len: int) -> MergePlan | None:
        """The plan for this block call, or None to run it unchanged.

        tokens [B, prefix + N + suffix, C]: the stream holding the image grid after `prefix`
        tokens; pe / mask / seq_len: the attention sequence (text + image stream).
        """
        call = self.current
        layer = f"{kind[0]}{index}"
        level = f"{call.h}x{call.w}" if call is not None else "?"
        tokens_n = call.tokens if call is not None else 0
        group = self.groups.get((kind, index))
        if (group is None or call is None or not call.mergeable or options.get(MERGED_FLAG)
                or tokens.dim() != 3 or tokens.shape[1] < prefix + tokens_n
                or not self.sequence_fits(pe, mask, seq_len, layer)):
            self.state.record(layer, level, tokens_n, None, None)
            return None
        if call.step is _UNSET:
            call.step = self.state.active_step(options)
        if call.step is None:
            self.state.record(layer, level, tokens_n, None, None)
            return None
        o = self.state.options
        key = ("flux", kind, group, call.h, call.w, tokens.shape[0],
               tuple(options.get("cond_or_uncond") or ()))
        grid = tokens[:, prefix:prefix + tokens_n]
        plan = self.state.plan(key, call.step, lambda: build_plan(
            F.layer_norm(grid.float(), grid.shape[-1:]), call.h, call.w, o.ratio, mode=o.region,
            tile_count=o.tile_count or DEFAULT_TILE_COUNT, tau=o.tau, unmerge=o.unmerge,
            batch=o.batch_policy))
        self.state.record(layer, level, tokens_n, plan, call.step)
        return plan

    def sequence_fits(self, pe: torch.Tensor | None, mask: torch.Tensor | None, seq_len: int,
                      layer: str) -> bool:
        """Whether pe and attn_mask line up with the sequence (else the block runs unmerged)."""
        if pe is not None and (pe.dim() < 3 or pe.shape[2] != seq_len):
            self.warn_once(f"RoPE rows {tuple(pe.shape)} do not match the {seq_len}-token "
                           f"sequence; block {layer} and others like it run unmerged")
            return False
        if not mask_fits(mask, seq_len):
            self.warn_once(f"attention mask {tuple(mask.shape)} does not span the {seq_len}-token "
                           f"sequence; block {layer} and others like it run unmerged")
            return False
        return True

    @staticmethod
    def flagged(options: dict) -> dict:
        """A copy of transformer_options marked as already merged."""
        return {**options, MERGED_FLAG: True}

    # Replace patches -----------------------------------------------------------------------------
    def double_block(self, index: int, previous: Callable | None) -> Callable:
        """The "dit" replace patch of double block `index`; `previous` is another pack's patch."""

        def patch(args: dict, extra: dict) -> dict:
            def run(a: dict) -> dict:
                return previous(a, extra) if previous is not None else extra["original_block"](a)

            img, txt = args["img"], args["txt"]
            options = args.get("transformer_options") or {}
            call = self.current
            if call is not None:
                call.txt_len = txt.shape[1]
            prefix = txt.shape[1]
            plan = self.plan_for("double", index, img, 0, options, args.get("pe"),
                                 args.get("attn_mask"), prefix + img.shape[1])
            if plan is None:
                return run(args)
            merged_args = {**args, "pe": merge_pe(plan, args.get("pe"), prefix),
                           "attn_mask": merge_mask(plan, args.get("attn_mask"), prefix,
                                                   prefix + img.shape[1]),
                           "transformer_options": self.flagged(options)}
            if self.double_scope == "attention":
                return self.run_attention_scope(index, plan, merged_args, run)
            merged, before = merge_input(plan, img, 0)
            out = run({**merged_args, "img": merged})
            return {**out, "img": self.restore(plan, img, out["img"], merged, before, 0)}

        return patch

    def run_attention_scope(self, index: int, plan: MergePlan, merged_args: dict,
                            run: Callable[[dict], dict]) -> dict:
        """Run a double block with only its image attention merged (hooks on img_attn)."""
        self.attention[index] = AttentionCall(plan)
        try:
            return run(merged_args)
        finally:
            self.attention.pop(index)

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
                       "transformer_options": self.flagged(options)})
            return {**out, "img": self.restore(plan, x, out["img"], merged, before, prefix)}

        return patch

    def restore(self, plan: MergePlan, x: torch.Tensor, out: torch.Tensor, merged: torch.Tensor,
                before: torch.Tensor, prefix: int) -> torch.Tensor:
        """unmerge_output, unless the block returned something else than a merged sequence (a
        caching pack answering from its cache): that is passed on as it is."""
        if out.shape[:2] != merged.shape[:2]:
            self.warn_once(f"a block returned {out.shape[1]} tokens for a merged input of "
                           f"{merged.shape[1]}; its output is passed on unchanged")
            return out
        return unmerge_output(plan, x, out, before, prefix)

    def single_text_len(self, options: dict) -> int | None:
        """Text tokens in front of the single stream: `img_slice` where ComfyUI gives it, else
        the length the double blocks of this call saw."""
        img_slice = options.get("img_slice")
        if img_slice:
            return int(img_slice[0])
        call = self.current
        return call.txt_len if call is not None else None

    # Scope "attention": hooks on a double block's image attention projections -------------------
    def qkv_forward(self, index: int, original: Callable) -> Callable:
        """img_attn.qkv: project merged image tokens [B, N + refs, C] -> [B, N' + refs, 3C]."""

        def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            entry = self.attention.get(index)
            if entry is None or entry.merged or x.shape[1] < entry.plan.tokens:
                return original(x, *args, **kwargs)
            entry.merged = True
            return original(entry.plan.merge(x), *args, **kwargs)

        return forward

    def proj_forward(self, index: int, original: Callable) -> Callable:
        """img_attn.proj: project, then unmerge [B, N' + refs, C] -> [B, N + refs, C].
        Unmerge rows sum to 1, so unmerging after the projection equals unmerging before it."""

        def forward(y: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            entry = self.attention.get(index)
            out = original(y, *args, **kwargs)
            return out if entry is None or not entry.merged else entry.plan.unmerge(out)

        return forward


# Installation ----------------------------------------------------------------------------------
def resolve_double_scope(merge_scope: str) -> str:
    """The double-block scope for the merge_scope option ("auto" -> AUTO_DOUBLE_SCOPE)."""
    return AUTO_DOUBLE_SCOPE if merge_scope == "auto" else merge_scope


def check_model(diffusion_model: torch.nn.Module) -> None:
    """Refuse models that share Flux's blocks but not its image token layout (HunyuanVideo,
    Hunyuan3D): ToMA needs text first, then a row-major 2-D image grid."""
    from comfy.ldm.flux.model import Flux

    allowed: tuple[type, ...] = (Flux,)
    try:
        from comfy.ldm.chroma.model import Chroma

        allowed += (Chroma,)
    except ImportError:     # ComfyUI without Chroma
        pass
    if not isinstance(diffusion_model, allowed):
        raise ValueError(f"ToMA cannot patch {type(diffusion_model).__name__}: among the models "
                         f"with Flux blocks it supports Flux, Flux Kontext, Flux 2 and Chroma")


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

    Raises ValueError (shown by the node) for skip_blocks past the model's depth and for models
    whose blocks are Flux's but whose tokens are not a Flux image grid.
    """
    from comfy.patcher_extension import WrappersMP

    diffusion_model = model.get_model_object("diffusion_model")
    check_model(diffusion_model)
    doubles, singles = len(diffusion_model.double_blocks), len(diffusion_model.single_blocks)
    skip = state.options.skip_blocks
    skip.check_depth(doubles, singles)
    groups = {("double", i): g for i, g in group_starts(doubles, skip.double).items()}
    groups.update({("single", i): g for i, g in group_starts(singles, skip.single).items()})
    scope = resolve_double_scope(state.options.merge_scope)
    toma = FluxToMA(state, int(getattr(diffusion_model, "patch_size", 2)), scope, groups)
    params = getattr(diffusion_model, "params", None)
    toma.default_ref_method = getattr(params, "default_ref_method", None)
    model.add_wrapper_with_key(WrappersMP.DIFFUSION_MODEL, GRID_WRAPPER_KEY,
                               plain_function(toma.grid_wrapper))
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
