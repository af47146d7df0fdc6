"""The peers of the quality section, installed on whole ComfyUI models (ModelPatcher clones).

UNet (grid from each block call's `activations_shape`; levels of at least MIN_TOKENS tokens,
the same placement as ToMA's `auto` levels, or those a fixture's section asks for):
- ToMeSD, attention scope (tomesd's own placement: self-attention's q/k/v merged, output
  unmerged) and block scope, from bench.speed.baselines.ToMeSD (tomesd's bipartite matching).
- ToDo: 2x2 average-pooled keys/values in self-attention (bench.speed.baselines.todo_attn1_patch).
Flux (through `optimized_attention_override`, which sees q/k/v [B, heads, txt + N, D] after
RoPE, so the positions stay right; the image grid h x w and text length are given):
- ToMeSD: image q/k/v merged by tomesd's matching on the image keys (heads concatenated),
  attention on [text; merged image], image output unmerged. Attention only: the projections
  and MLPs run at full length.
- ToDo: image keys/values pooled 2x2, queries full.
Step caching: ComfyUI's own EasyCache node (comfy_extras.nodes_easycache), where the version
has it.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..speed.baselines import ToMeSD, todo_attn1_patch

MIN_TOKENS = 1024
_SLOT = "bench_quality_tomesd"


def _grid(extra_options: dict, min_tokens: int) -> tuple[int, int] | None:
    shape = extra_options.get("activations_shape")
    if shape is None:
        return None
    h, w = int(shape[-2]), int(shape[-1])
    return (h, w) if h * w >= min_tokens else None


class UNetToMeSD:
    """ToMeSD on every UNet level with at least min_tokens tokens; one matcher per grid."""

    def __init__(self, ratio: float, seed: int, min_tokens: int = MIN_TOKENS) -> None:
        self.ratio = ratio
        self.min_tokens = min_tokens
        self.generator = torch.Generator().manual_seed(seed)
        self.matchers: dict[tuple[int, int], ToMeSD] = {}

    def matcher(self, grid: tuple[int, int]) -> ToMeSD:
        if grid not in self.matchers:
            self.matchers[grid] = ToMeSD(*grid, self.ratio, self.generator)
        return self.matchers[grid]

    def attn1_patch(self, n, context, value, extra_options):
        grid = _grid(extra_options, self.min_tokens)
        if grid is None or n.shape[1] != grid[0] * grid[1]:
            return n, context, value
        merge, unmerge = self.matcher(grid).match(n)
        extra_options[_SLOT] = unmerge
        merged = merge(n)
        return merged, merged, merged

    def attn1_output_patch(self, n, extra_options):
        unmerge = extra_options.pop(_SLOT, None)
        return n if unmerge is None else unmerge(n)

    def block_forward(self, original: Callable) -> Callable:
        def forward(x, context=None, transformer_options=None):
            options = transformer_options or {}
            grid = _grid(options, self.min_tokens)
            if grid is None or x.shape[1] != grid[0] * grid[1]:
                return original(x, context=context, transformer_options=options)
            return self.matcher(grid).block_forward(original)(x, context, options)

        return forward


def unet_tomesd(patcher, ratio: float, scope: str, seed: int = 0,
                min_tokens: int = MIN_TOKENS):
    """A clone of a UNet ModelPatcher with ToMeSD in `scope` ("attention" or "block") on the
    levels of at least min_tokens tokens."""
    from comfy.ldm.modules.attention import BasicTransformerBlock

    tome = UNetToMeSD(ratio, seed, min_tokens)
    clone = patcher.clone()
    if scope == "attention":
        clone.set_model_attn1_patch(tome.attn1_patch)
        clone.set_model_attn1_output_patch(tome.attn1_output_patch)
        return clone
    model = clone.get_model_object("diffusion_model")
    for name, block in model.named_modules():
        if isinstance(block, BasicTransformerBlock):
            original = types.MethodType(type(block).forward, block)
            clone.add_object_patch(f"diffusion_model.{name}.forward", tome.block_forward(original))
    return clone


def unet_todo(patcher, factor: int = 2, min_tokens: int = MIN_TOKENS):
    """A clone of a UNet ModelPatcher with ToDo (factor x factor K/V pooling) on levels of at
    least min_tokens tokens."""

    def patch(n, context, value, extra_options):
        grid = _grid(extra_options, min_tokens)
        if grid is None or n.shape[1] != grid[0] * grid[1]:
            return n, context, value
        if factor == 2:
            return todo_attn1_patch(*grid)(n, context, value, extra_options)
        b, _, c = n.shape
        pooled = F.avg_pool2d(n.transpose(1, 2).reshape(b, c, *grid), factor)
        pooled = pooled.flatten(2).transpose(1, 2)
        return n, pooled, pooled

    clone = patcher.clone()
    clone.set_model_attn1_patch(patch)
    return clone


def _override(patcher, attention: Callable):
    """Clone with an attention override (chaining one already there)."""
    clone = patcher.clone()
    options = clone.model_options.setdefault("transformer_options", {})
    previous = options.get("optimized_attention_override")

    def override(func, *args, **kwargs):
        def inner(*a, **k):
            return previous(func, *a, **k) if previous is not None else func(*a, **k)

        return attention(inner, *args, **kwargs)

    options["optimized_attention_override"] = override
    return clone


def flux_todo(patcher, txt_len: int, h: int, w: int, factor: int = 2):
    """ToDo on a Flux model: image keys/values [B, H, N, D] pooled factor x factor in every
    attention."""

    def attention(func, q, k, v, heads, *args, **kwargs):
        if k.dim() != 4 or k.shape[2] != txt_len + h * w:
            return func(q, k, v, heads, *args, **kwargs)

        def pool(t: torch.Tensor) -> torch.Tensor:
            b, nh, _, d = t.shape
            img = t[:, :, txt_len:].transpose(2, 3).reshape(b * nh, d, h, w)
            img = F.avg_pool2d(img, factor).reshape(b, nh, d, -1).transpose(2, 3)
            return torch.cat((t[:, :, :txt_len], img), dim=2)

        return func(q, pool(k), pool(v), heads, *args, **kwargs)

    return _override(patcher, attention)


def flux_tomesd(patcher, ratio: float, txt_len: int, h: int, w: int, seed: int = 0):
    """ToMeSD on a Flux model's attention: image q/k/v merged, image output unmerged."""
    tome = ToMeSD(h, w, ratio, torch.Generator().manual_seed(seed))

    def attention(func, q, k, v, heads, *args, **kwargs):
        if k.dim() != 4 or k.shape[2] != txt_len + h * w:
            return func(q, k, v, heads, *args, **kwargs)
        b, nh, _, d = k.shape

        def tokens(t: torch.Tensor) -> torch.Tensor:      # image rows [B, N, H*D]
            return t[:, :, txt_len:].transpose(1, 2).reshape(b, h * w, nh * d)

        def heads_of(t: torch.Tensor) -> torch.Tensor:    # [B, N', H*D] -> [B, H, N', D]
            return t.reshape(b, -1, nh, d).transpose(1, 2)

        merge, unmerge = tome.match(tokens(k))
        q2, k2, v2 = (torch.cat((t[:, :, :txt_len], heads_of(merge(tokens(t)))), dim=2)
                      for t in (q, k, v))
        out = func(q2, k2, v2, heads, *args, **kwargs)   # [B, txt + N', H*D]
        return torch.cat((out[:, :txt_len], unmerge(out[:, txt_len:])), dim=1)

    return _override(patcher, attention)


def easycache(patcher, reuse_threshold: float):
    """ComfyUI's EasyCache node applied to `patcher` (start 0.15, end 0.95: its defaults);
    None when this ComfyUI has no EasyCache."""
    try:
        from comfy_extras.nodes_easycache import EasyCacheNode
    except ImportError:
        return None
    out = EasyCacheNode.execute(patcher, reuse_threshold=reuse_threshold, start_percent=0.15,
                                end_percent=0.95, verbose=False)
    return out.result[0] if hasattr(out, "result") else out[0]
