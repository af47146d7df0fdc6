"""SDXL-shaped transformer blocks in plain PyTorch, for benchmarking without ComfyUI.

`SDXLBlock` mirrors ComfyUI's `BasicTransformerBlock` as SDXL uses it (parameter names included,
so a state dict moves between the two):

    x [B, N, C] -> n = norm1(x) -> attn1 patches -> self-attention (SDPA) -> attn1 output patches
                -> x = n + x -> x = attn2(norm2(x), context [B, T, Cc]) + x
                -> x = ff(norm3(x)) + x            (GEGLU feed-forward, inner 4C)

It honours ComfyUI's `transformer_options["patches"]["attn1_patch" | "attn1_output_patch"]`
protocol, so the pack's own UNet patch functions (and the baselines' patches) run on it unchanged.

`LEVELS` holds SDXL's two transformer levels at 1024x1024 and the smaller grids of 512x512 and
768x768 images, with the number of transformer blocks SDXL has at each channel width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..shared.weights import fill_weights

HEAD_DIM = 64
CONTEXT_DIM = 2048
CONTEXT_TOKENS = 77


@dataclass(frozen=True)
class Level:
    """One UNet transformer level: an h x w token grid of `channels`, `blocks` blocks deep.

    blocks: transformer blocks sharing one plan at this level in SDXL (2 x 5 stacks at 640
    channels, 10 x 6 stacks at 1280), used to amortise plan building.
    """

    side: int
    channels: int
    blocks: int

    @property
    def name(self) -> str:
        return f"{self.side}x{self.side}x{self.channels}"

    @property
    def heads(self) -> int:
        return self.channels // HEAD_DIM

    @property
    def tokens(self) -> int:
        return self.side * self.side


# SDXL at 1024x1024: latent 128x128, attention at /2 (640 ch) and /4 (1280 ch).
SDXL_LEVELS = (Level(64, 640, 10), Level(32, 1280, 60))
# Smaller images: 768x768 (48x48 / 24x24) and 512x512 (32x32 / 16x16).
SMALL_LEVELS = (Level(48, 640, 10), Level(24, 1280, 60), Level(32, 640, 10), Level(16, 1280, 60))


class CrossAttention(nn.Module):
    """Multi-head attention with ComfyUI's layout: q from x, k from context, v from value."""

    def __init__(self, dim: int, heads: int, context_dim: int | None = None) -> None:
        super().__init__()
        context_dim = context_dim or dim
        self.heads = heads
        self.to_q = nn.Linear(dim, heads * HEAD_DIM, bias=False)
        self.to_k = nn.Linear(context_dim, heads * HEAD_DIM, bias=False)
        self.to_v = nn.Linear(context_dim, heads * HEAD_DIM, bias=False)
        self.to_out = nn.Sequential(nn.Linear(heads * HEAD_DIM, dim), nn.Dropout(0.0))

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None,
                value: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, N, C], context/value [B, M, Cc] (default x) -> [B, N, C]."""
        context = x if context is None else context
        value = context if value is None else value
        b = x.shape[0]
        q, k, v = (t.view(b, -1, self.heads, HEAD_DIM).transpose(1, 2)
                   for t in (self.to_q(x), self.to_k(context), self.to_v(value)))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.to_out(out.transpose(1, 2).reshape(b, -1, self.heads * HEAD_DIM))


class GEGLU(nn.Module):
    """x -> a * gelu(g) with [a, g] = proj(x): [B, N, C] -> [B, N, inner]."""

    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, inner * 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, gate = self.proj(x).chunk(2, dim=-1)
        return a * F.gelu(gate)


class FeedForward(nn.Module):
    """GEGLU feed-forward, inner width 4C: [B, N, C] -> [B, N, C]."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.net = nn.Sequential(GEGLU(dim, 4 * dim), nn.Dropout(0.0), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class SDXLBlock(nn.Module):
    """SDXL's BasicTransformerBlock: dim C, C / 64 heads, cross-attention on a 2048-wide text."""

    def __init__(self, dim: int, context_dim: int = CONTEXT_DIM) -> None:
        super().__init__()
        heads = dim // HEAD_DIM
        self.n_heads, self.d_head = heads, HEAD_DIM
        self.attn1 = CrossAttention(dim, heads)
        self.ff = FeedForward(dim)
        self.attn2 = CrossAttention(dim, heads, context_dim)
        self.norm2 = nn.LayerNorm(dim)
        self.norm1 = nn.LayerNorm(dim)
        self.norm3 = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None,
                transformer_options: dict | None = None) -> torch.Tensor:
        """x [B, N, C], context [B, T, Cc] -> [B, N, C]."""
        options = transformer_options or {}
        patches = options.get("patches", {})
        extra = {k: v for k, v in options.items() if k not in ("patches", "patches_replace")}
        extra.update(n_heads=self.n_heads, dim_head=self.d_head, attn_precision=None)
        n = self.norm1(x)
        context1 = value1 = None
        if "attn1_patch" in patches:
            context1 = value1 = n
            for p in patches["attn1_patch"]:
                n, context1, value1 = p(n, context1, value1, extra)
        n = self.attn1(n, context1, value1)
        for p in patches.get("attn1_output_patch", ()):
            n = p(n, extra)
        x = n + x
        x = self.attn2(self.norm2(x), context) + x
        return self.ff(self.norm3(x)) + x


def make_block(level: Level, comfy: bool, device: torch.device, dtype: torch.dtype,
               seed: int = 0) -> nn.Module:
    """A random-weight block for `level`: ComfyUI's BasicTransformerBlock when `comfy`,
    else `SDXLBlock`. Both get the same weights for the same seed."""
    if comfy:
        import comfy.ops
        from comfy.ldm.modules.attention import BasicTransformerBlock

        block = BasicTransformerBlock(level.channels, level.heads, HEAD_DIM,
                                      context_dim=CONTEXT_DIM, checkpoint=False,
                                      operations=comfy.ops.disable_weight_init)
    else:
        block = SDXLBlock(level.channels)
    return fill_weights(block, seed).eval().requires_grad_(False).to(device, dtype)


def make_context(batch: int, device: torch.device, dtype: torch.dtype,
                 seed: int = 1) -> torch.Tensor:
    """A seeded stand-in for SDXL's text embedding: [B, 77, 2048], unit scale."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, CONTEXT_TOKENS, CONTEXT_DIM, generator=g).to(device, dtype)


def block_options(level: Level, batch: int, block_index: int = 0) -> dict:
    """The transformer_options a SDXL UNet passes to a block of this level (1024x1024 latent
    128 x 128 for the SDXL levels; the latent is 2x the 640-channel grid, 4x the 1280 one)."""
    scale = 2 if level.channels == 640 else 4
    latent = level.side * scale
    return {"activations_shape": [batch, level.channels, level.side, level.side],
            "original_shape": [batch, 4, latent, latent],
            "block": ("input", 4 if level.channels == 640 else 7), "block_index": block_index,
            "transformer_index": block_index, "cond_or_uncond": [0] * batch}
