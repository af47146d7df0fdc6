"""ToMA for ComfyUI's UNet models (SDXL, SD1.5, SD2).

Every BasicTransformerBlock's `forward` gets an object patch (wrapping another pack's patch of it)
that picks each call's scope from the block's own grid (`activations_shape`), at any resolution:
"block" runs the whole block merged and unmerges only its update (as dit_patch.py does; the
fastest), "attention" merges the normed tokens before self-attention and unmerges its output (an
attn1 patch pair; the paper's SDXL setting), none where another node replaces self-attention or
ComfyUI's ToMe merges. `merge_scope` auto is "block" unless other nodes patch inside the block
(unet_neighbours.py). Self-attention over merged tokens is size-weighted (toma_core/attention.py).
One plan per grid level and batch layout serves its blocks, on the `recompute_every` schedule; a
sequence that is not the level's full grid (another ToMA merged it) is left alone.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable

import torch

from ..toma_core import MergePlan, build_plan, make_regions, size_bias
from ..toma_core.regions import compiling
from .contracts import Contract, Gives, Has, Mentions, Sets, Takes, resolve
from .forward_patches import ForwardPatches
from .model_call import ModelCall
from .run_state import ToMAState
from .unet_neighbours import (
    IN_BLOCK_PATCHES,
    TOMA_MARK,
    in_block_patches,
    is_comfy_tome,
    is_toma,
    mark,
    replacement,
)

log = logging.getLogger("ToMA")

# tile_count 0: tiles of about 8x8 tokens at every level (bench/: lowest block error, same speed).
TOKENS_PER_TILE = 64
# "auto" leaves smaller levels alone: merging costs more than it saves there (docs/benchmarks.md).
AUTO_MIN_TOKENS = 1024
# On a CUDA GPU "auto" also leaves a level alone below this much work per item and block
# (tokens x channels^2, what its linear layers scale with): halving kernels this small does not
# pay for ToMA's own (docs/benchmarks.md "Where merging stops paying on a GPU").
GPU_MIN_WORK = 2**29
GPU_DEVICES = ("cuda",)
GPU_FIGURE = ("SD1.5 at 512x512 on an H200, projected: 0.98x with its two largest levels "
              "merged, 0.995x with the largest alone")
# Below this even "all" skips a level: a few tokens per tile leave nothing to merge.
MIN_TOKENS = 16
# Self-attention over merged tokens weighted by the merged keys' sizes: far closer to unmerged
# on a real trained UNet and the SDXL-proportioned fixture (docs/quality.md, real-model section).
SIZE_WEIGHTED = True
# Each token's coverage in facility location weighted by its squared norm: tokens that stand
# out in norm (a trained UNet's attention sinks) stay unmerged (the same section).
NORM_WEIGHTED = True

UNET_MODEL = "comfy.ldm.modules.diffusionmodules.openaimodel:UNetModel"
_ATTENTION = "comfy.ldm.modules.attention"
# What the UNet patch reads of ComfyUI's UNet (SpatialVideoTransformer: what it refuses).
CONTRACT = Contract(
    "UNet (SDXL, SD1.5, SD2)",
    models={UNET_MODEL: ()},
    needs=(
        Takes(f"{_ATTENTION}:BasicTransformerBlock.forward",
              ("x", "context", "transformer_options")),
        Sets(f"{_ATTENTION}:BasicTransformerBlock.__init__", ("norm1",)),
        Mentions(f"{_ATTENTION}:BasicTransformerBlock.forward",
                 ("attn1_patch", "attn1_output_patch", "patches_replace")),
        Sets(f"{_ATTENTION}:SpatialTransformer.__init__", ("transformer_blocks",)),
        Gives(f"{_ATTENTION}:SpatialTransformer.forward", ("activations_shape", "block_index"),
              what="transformer option"),
        Gives(f"{UNET_MODEL}._forward", ("original_shape", "block"),
              what="transformer option"),
        Sets(f"{UNET_MODEL}.__init__", ("input_blocks",)),
        Has(_ATTENTION, ("SpatialVideoTransformer",)),
        Has("comfy.ldm.modules.diffusionmodules.openaimodel", ("Downsample",)),
    ),
)


def is_unet(diffusion_model: torch.nn.Module) -> bool:
    """Whether the model is ComfyUI's UNet (or a subclass of it; by name where the class no
    longer imports from where the contract says, so that the contract says what moved)."""
    unet = resolve(UNET_MODEL)[0]
    if isinstance(unet, type):
        return isinstance(diffusion_model, unet)
    return any(cls.__name__ == "UNetModel" and cls.__module__.startswith("comfy.")
               for cls in type(diffusion_model).__mro__)


def is_video_unet(diffusion_model: torch.nn.Module) -> bool:
    """Whether a UNet has temporal transformers (Stable Video Diffusion)."""
    video = resolve(f"{_ATTENTION}:SpatialVideoTransformer")[0]
    return any(isinstance(m, video) for m in diffusion_model.modules())


class UNetToMA:
    """The patch functions for one ToMA node on one UNet model."""

    def __init__(self, state: ToMAState, scope: str, largest_level_ds: int,
                 attn1_keys: tuple = ()) -> None:
        self.state = state
        self.scope = scope   # the merge_scope widget: "auto", "block" or "attention"
        # size-weighted attention (see with_sized_attention) as the attn1 replace of every
        # block, named at patch time so that a traced call does not add keys (torch.compile
        # guards on the dict's length); a call names any other it meets
        self.sized_key = f"{state.key}_sized"
        self.attend = sized_attention(self.sized_key)
        self.attn1 = dict.fromkeys(attn1_keys, self.attend)
        self.largest_level_ds = largest_level_ds

    # Which calls merge ---------------------------------------------------------------------------
    def merges_level(self, h: int, w: int, latent_w: int, x: torch.Tensor,
                     call: ModelCall) -> bool:
        """Whether the unet_levels option merges an h x w level of a latent latent_w wide, for
        tokens x [B, h*w, C]; says so in `call` where the level is too small to pay on a GPU."""
        levels = self.state.options.unet_levels
        if levels == "largest":
            merges = round(latent_w / w) <= self.largest_level_ds
        else:
            merges = h * w >= (AUTO_MIN_TOKENS if levels == "auto" else MIN_TOKENS)
        if (merges and x.device.type in GPU_DEVICES
                and h * w * x.shape[-1] ** 2 < GPU_MIN_WORK):
            # the note made on each such call: a kept text would be a dict torch.compile
            # guards on, and recompiles for
            level = f"the {h}x{w} level ({x.shape[-1]} channels)"
            loss = f"a level this small merges at a loss ({GPU_FIGURE})"
            call.note(f"unet_levels auto: {level} is left unmerged on a GPU, where {loss}; "
                      f"unet_levels all merges it" if levels == "auto" else
                      f"unet_levels {levels}: {level} merges, though on a GPU {loss}")
            return levels != "auto"
        return merges

    def scope_for(self, call: ModelCall | None, options: dict, foreign_forward: bool
                  ) -> str | None:
        """"block" or "attention" for this block call, or None to run it unmerged, by what other
        nodes patch in it (unet_neighbours.py; foreign_forward: in its forward)."""
        patches = options.get("patches") or {}
        busy = foreign_forward or bool(options.get("patches_replace"))
        for kind in IN_BLOCK_PATCHES:
            busy = busy or bool(patches.get(kind))
        if not busy:       # the usual block: decided without a further Python call
            return "attention" if self.scope == "attention" else "block"
        note = call.note if call is not None else lambda message: None
        attn1_replace = replacement(options, "attn1")
        if attn1_replace is not None:
            note(f"another node replaces self-attention in some blocks "
                 f"({attn1_replace}): ToMA leaves those blocks unmerged")
            return None
        # ComfyUI's ToMe acts only where the sequence is longer than half the latent's pixels,
        # i.e. at full resolution, which ToMA leaves to it; elsewhere merged tokens are fine
        shape, latent = options.get("activations_shape"), options.get("original_shape")
        if shape is not None and latent is not None and list(shape[-2:]) == list(latent[-2:]) \
                and any(is_comfy_tome(p) for p in patches.get("attn1_patch", ())):
            note("ComfyUI's TomePatchModel merges the full-resolution level: ToMA leaves "
                 "that level to it")
            return None
        if self.scope == "attention":
            return "attention"
        found = in_block_patches(options)
        if replacement(options, "attn2") is not None:
            found.append("attn2 replacement")
        if foreign_forward:
            found.append("forward")
        if not found:
            # auto = block: at equal speed, block scope keeps samples far closer to unmerged
            # than attention scope (docs/quality.md, what the matched fixtures decided)
            return "block"
        kinds = ", ".join(found)
        if self.scope == "block":
            note(f"merge_scope block: other nodes' patches inside transformer blocks "
                 f"({kinds}) see merged tokens; auto or attention scope keeps them on the "
                 f"full grid")
            return "block"
        note(f"merge_scope auto: attention scope where other nodes patch inside "
             f"transformer blocks ({kinds}), so that they see every token")
        return "attention"

    def plan_for(self, x: torch.Tensor, options: dict, call: ModelCall | None,
                 features: Callable[[], torch.Tensor] | None) -> MergePlan | None:
        """The plan for the block call on x [B, N, C] with these transformer options, or None to
        run it unchanged; features(): the normed tokens a plan is built from, when one is due
        (None: the call runs unmerged, and is only counted)."""
        shape = options.get("activations_shape")
        if shape is None or x.dim() != 3:
            return None
        layer = (tuple(options.get("block") or ()), options.get("block_index", 0))
        h, w = int(shape[-2]), int(shape[-1])
        latent = options.get("original_shape") or shape
        plan = None
        if (call is not None and call.active and features is not None and x.shape[1] == h * w
                and self.merges_level(h, w, int(latent[-1]), x, call)):
            o = self.state.options

            def build() -> MergePlan | None:
                tiles = o.tile_count or max(1, round(h * w / TOKENS_PER_TILE))
                regions = make_regions(h, w, o.region, tiles)
                return build_plan(features(), h, w, o.ratio, regions=regions, tau=o.tau,
                                  unmerge=o.unmerge, batch=o.batch_policy,
                                  weighted=NORM_WEIGHTED, tables=call.tables(regions, x.device))

            plan = call.plan(("unet", h, w, x.shape[0], call.pass_of(layer)), build)
        if call is not None:
            call.record(layer, f"{h}x{w}", h * w, plan)
        return plan

    # Scope "attention": a fresh attn1 patch pair per block call ----------------------------------
    def with_attention_pair(self, options: dict, call: ModelCall | None) -> dict:
        """A copy of the call's transformer_options whose attn1 patches end with ToMA's merge and
        whose attn1 output patches start with its unmerge."""
        held: list[MergePlan] = []   # the plan the merge used, for the unmerge of the same call

        def merge(n: torch.Tensor, context: torch.Tensor, value: torch.Tensor,
                  extra_options: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            """Merge self-attention's queries, keys and values: n [B, N, C] -> [B, N', C]."""
            plan = self.plan_for(n, extra_options, call, lambda: n)
            if plan is None:
                return n, context, value
            held.append(plan)
            merged = plan.merge(n)

            def same(t: torch.Tensor) -> torch.Tensor:
                # keys/values are usually n itself; text context (disable_self_attn) stays whole
                if t is n:
                    return merged
                return plan.merge(t) if t is not None and t.shape[1] == n.shape[1] else t

            return merged, same(context), same(value)

        def unmerge(n: torch.Tensor, extra_options: dict) -> torch.Tensor:
            """Unmerge self-attention's output back to the full grid: [B, N', C] -> [B, N, C]."""
            return held.pop().unmerge(n) if held else n

        patches = dict(options.get("patches") or {})
        patches["attn1_patch"] = [*patches.get("attn1_patch", ()), mark(merge)]
        patches["attn1_output_patch"] = [mark(unmerge), *patches.get("attn1_output_patch", ())]
        return self.with_sized_attention({**options, "patches": patches}, held)

    def with_sized_attention(self, options: dict, plans: list[MergePlan] | tuple[MergePlan]
                             ) -> dict:
        """A copy of a block call's transformer_options with `plans` and size-weighted attention
        as the attn1 replace under every block's key (a compile without guards replays one
        block's code for all); unchanged where no block is named or another ToMA's is there."""
        block = options.get("block")
        if block is None or not SIZE_WEIGHTED:
            return options
        key = (block[0], block[1], options.get("block_index", 0))
        replace = options.get("patches_replace") or {}
        attn1 = replace.get("attn1") or {}
        if getattr(attn1.get(key), TOMA_MARK, False):
            return options
        if key not in self.attn1:
            self.attn1[key] = self.attend
        return {**options, self.sized_key: plans, "patches_replace": {
            **replace, "attn1": {**attn1, **self.attn1} if attn1 else self.attn1}}

    # The block's forward --------------------------------------------------------------------------
    def block_forward(self, block: torch.nn.Module, original: Callable, foreign_forward: bool,
                      after: torch.nn.Module | None = None) -> Callable:
        """A replacement for block.forward(x, context=None, transformer_options={}, ...) that runs
        `original` (another pack's patch where foreign_forward) merged in the call's scope.
        after: the block its output goes to (None for a transformer's last block): while that
        runs this patch, merged blocks hand it the grid in their plan's region order."""

        def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            # ComfyUI passes the options by name; another pack's wrapper may pass them second
            by_name = "transformer_options" in kwargs or len(args) < 2
            options = (kwargs.get("transformer_options") if by_name else args[1]) or {}
            call = self.state.call_of(options, x.device)
            held = None if call is None else call.region_order
            if held is not None:
                call.region_order = None
                if held[0] is not x:       # not the grid the block before handed on
                    held = None
            scope = self.scope_for(call, options, foreign_forward)
            plan = None
            if scope == "block":
                plan = self.plan_for(x, options, call, lambda: block.norm1(
                    x if held is None else held[1].grid_order(x)))
            elif scope is None:        # because of a neighbour: counted
                self.plan_for(x, options, call, None)
            ordered = held is not None and held[1] is plan
            if held is not None and not ordered:
                x = held[1].grid_order(x)
            if scope == "attention" or (plan is not None and SIZE_WEIGHTED):
                given = (self.with_attention_pair(options, call) if plan is None
                         else self.with_sized_attention(options, (plan,)))
                if by_name:
                    kwargs = {**kwargs, "transformer_options": given}
                else:
                    args = (args[0], given, *args[2:])
            if plan is None:
                return original(x, *args, **kwargs)
            keep = (after is not None and not foreign_forward and plan.regions.even
                    and not compiling()
                    and getattr(after.__dict__.get("forward"), TOMA_MARK, None) is self)
            # ComfyUI's block never updates its input in place (x = n + x); another pack's
            # patch of the forward might
            out = plan.around(lambda t: original(t, *args, **kwargs), x,
                              block_keeps_input=not foreign_forward, ordered=ordered,
                              keep_order=keep)
            if keep:
                call.region_order = (out, plan)
            return out

        # the mark names its node: a block hands its grid on in region order only to its own
        setattr(forward, TOMA_MARK, self)
        return forward


def sized_attention(key: str) -> Callable:
    """An attn1 replace: ComfyUI's attention with the size bias of the last plan a block call's
    transformer_options hold under `key` (empty: the call did not merge)."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               extra_options: dict) -> torch.Tensor:
        """q [B, N', H*D], k and v [B, M, H*D] -> [B, N', H*D]; keys of another length than
        the merged grid's (a block's text context) take no bias."""
        # imported where ComfyUI's block calls it: a block of the benchmarks' own never does
        import comfy.ldm.modules.attention as attention

        plans = extra_options.get(key)
        plan = plans[-1] if plans else None
        bias = None
        if plan is not None and k.shape[1] == plan.merged_tokens:
            # the kept bias read inline: no call per block once it is made
            bias = plan.size_biases.get((k.shape[1], 0, q.dtype))
            if bias is None:
                bias = size_bias(plan, k.shape[1], 0, q.dtype)
        # looked up per call, as CrossAttention's own call does (the attention ComfyUI chose)
        return attention.optimized_attention(
            q, k, v, extra_options["n_heads"], mask=bias,
            attn_precision=extra_options.get("attn_precision"), transformer_options=extra_options)

    return mark(attend)     # a ToMA that runs after this one leaves it there


def transformer_blocks(diffusion_model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(dotted path, module) of every BasicTransformerBlock inside a SpatialTransformer (or a
    subclass of either)."""
    from comfy.ldm.modules.attention import BasicTransformerBlock, SpatialTransformer

    found = []
    for name, module in diffusion_model.named_modules():
        if isinstance(module, SpatialTransformer):
            for i, block in enumerate(module.transformer_blocks):
                if isinstance(block, BasicTransformerBlock):
                    found.append((f"{name}.transformer_blocks.{i}", block))
    return found


def attn1_key(path: str) -> tuple[str, int, int] | None:
    """The attn1 replace key (block kind, its index, block_index) that the UNet's forward and
    SpatialTransformer give the transformer block at dotted `path` (transformer_blocks' names);
    None outside the UNet's three block lists."""
    lists, index, *_, block_index = path.split(".")
    kind = {"input_blocks": "input", "middle_block": "middle", "output_blocks": "output"}
    if lists not in kind:
        return None
    return kind[lists], 0 if lists == "middle_block" else int(index), int(block_index)


def handed_on(diffusion_model: torch.nn.Module) -> dict[str, str]:
    """Dotted path of each transformer block -> that of the block its output goes to next, in
    transformers whose own forward runs their blocks one after another (SpatialTransformer's;
    a video transformer's interleaves time blocks, which see the grid's order)."""
    from comfy.ldm.modules.attention import SpatialTransformer

    found = {}
    for name, module in diffusion_model.named_modules():
        if type(module).forward is SpatialTransformer.forward:
            for i in range(len(module.transformer_blocks) - 1):
                found[f"{name}.transformer_blocks.{i}"] = f"{name}.transformer_blocks.{i + 1}"
    return found


def largest_level_downsample(diffusion_model: torch.nn.Module) -> int:
    """Downsampling factor of the highest-resolution UNet level that has attention (SDXL: 2)."""
    from comfy.ldm.modules.attention import SpatialTransformer
    from comfy.ldm.modules.diffusionmodules.openaimodel import Downsample

    ds = 1
    for block in diffusion_model.input_blocks:
        if any(isinstance(layer, SpatialTransformer) for layer in block):
            return ds
        if any(isinstance(layer, Downsample) for layer in block):
            ds *= 2
    return ds


def patch_unet(model, state: ToMAState, scope: str, patches: ForwardPatches) -> None:
    """Install ToMA on a cloned UNet ModelPatcher `model` (changes only that clone's options),
    in `scope` (the merge_scope widget)."""
    diffusion_model = model.get_model_object("diffusion_model")
    blocks = transformer_blocks(diffusion_model)
    if not blocks:
        raise ValueError("ToMA: this UNet has no transformer blocks to merge")
    toma = UNetToMA(state, scope, largest_level_downsample(diffusion_model),
                    tuple(filter(None, (attn1_key(name) for name, _ in blocks))))

    def make(block: torch.nn.Module, original: Callable, *after: torch.nn.Module) -> Callable:
        # `original` is the block's own forward, a ToMA patch, or another pack's patch
        own = (isinstance(original, types.MethodType) and original.__self__ is block
               and original.__func__ is type(block).forward)
        return toma.block_forward(block, original, not (own or is_toma(original)), *after)

    following = handed_on(diffusion_model)
    for name, _ in blocks:
        patches.add(model, name, make, following.get(name))
    log.debug("ToMA: patched %d UNet transformer blocks", len(blocks))
