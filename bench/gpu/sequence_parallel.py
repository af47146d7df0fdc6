"""Section gpu-sp (ComfyUI only): what ToMA buys inside raylight's sequence parallelism, projected
per rank and per model call, for Wan 2.1 14B and HunyuanVideo on P = 2, 4 and 8 GPUs, unmerged
and with the node's defaults. Nothing is computed and nothing is measured.

    COMFYUI_PATH=/path/to/ComfyUI python -m bench --sections gpu-sp [--out ...]

The split, as raylight (komikndr/raylight, xDiT/xfuser's USP with Ulysses) runs it
(../shared/notes/raylight/README.md; file:line below at raylight c0495710):

- The token sequence is zero-padded to a multiple of P and rank r holds rows
  [r * S, (r + 1) * S), S = ceil(rows / P), for the whole block loop. Wan splits the video
  tokens only; its text context stays whole on every rank (wan/xdit_context_parallel.py
  usp_dit_forward). HunyuanVideo splits the video and the text tokens each, for the double
  blocks; between the double and the single blocks it gathers both and splits [text; video]
  again (hunyuan_video/xdit_context_parallel.py usp_dit_forward).
- Every attention goes through xfuser's Ulysses attention: q, k and v [B, S, H, D] each go
  through one all_to_all_single that trades sequence for heads ([B, P * S, H / P, D]), the
  attention runs there, and one all_to_all_single brings the output back (yunchang
  comm/all_to_all.py all_to_all_4D, xfuser hybrid/attn_layer.py). Wan's cross-attention (its
  text keys and values whole on every rank) and HunyuanVideo's text refiner (all of it whole on
  every rank) go the same way, so after the all-to-all a rank holds P copies of those rows and
  attends over P * T of them (the same softmax, P times the work).
- raylight's HunyuanVideo loop at c0495710 fails with any "dit" patch (a stray `out["img"],`,
  hunyuan_video/xdit_context_parallel.py:193), so ToMA cannot run there yet: its rows assume
  that line fixed.
- After the blocks every rank all-gathers the sequence and runs the head on all of it; the
  patch embedding runs on all tokens before the split.

ToMA under the split (toma_core/shards.py): in a block it merges, each rank merges only its own
shard's grid (video) tokens; every rank drops the same number of tokens (the all-to-all needs
equal lengths): the ratio's share of the whole grid spread evenly over the ranks, a rank
holding fewer grid tokens (the text lies on the first) merging its own harder. Text tokens
never merge. So in a merged block every tensor of the block, and every all-to-all of its
attention, is (S - dropped) rows long instead of S.

Per rank and call, with B items, width C = H heads x D, P ranks, S rows of a block on the rank
(S' = S - dropped in a merged block), T text tokens, the hand counts of projected_calls.py
hand_flops extended to the shard (2 FLOPs per multiply-add):

- Wan block: self-attention projections 8BS'C^2; attention 4B(PS')^2 D H/P = 4BPS'^2C (queries
  and keys of every rank, H/P heads); cross-attention Q/O 4BS'C^2, K/V 4BTC^2 (the whole text
  on every rank), attention 4B(PS')(PT)D H/P = 4BPS'TC; FFN 4BS'CF.
- HunyuanVideo double block (S' video + T_r = ceil(T/P) text rows): modulations 2 x 2BC 6C;
  projections and MLPs 24B(S' + T_r)C^2; attention 4BP(S' + T_r)^2C. Single block (R' rows of
  [text; video]): modulation 2BC 3C; linear1 and linear2 24BR'C^2; attention 4BPR'^2C.
- Outside the blocks each rank runs what a single GPU runs (patch embedding, text and time
  embeddings, HunyuanVideo's text refiner with its attention at 4BPT^2C, the head on all tokens).
- All-to-all bytes out of a rank: (P - 1) / P of each all_to_all_single's input buffer
  [B, S', H, D] in bf16; the pack's test counts the whole input buffer (numel x element size)
  per call, reported beside it. The all_gathers send (P - 1) x their input out of each rank
  (a ring); they are the same with and without ToMA (the blocks hand back unmerged tokens).

Compute per rank: the matrix products and attention kernels above as ops (their shapes give the
products' wave quantization), the local copies around each all-to-all (one before and one after,
yunchang's all_to_all_4D), and every other kernel of the call (norms, modulation, RoPE, residual
adds, ToMA's merge, unmerge and plan kernels) taken from the same model call recorded on one GPU
(projected_calls.py: ComfyUI's own classes on meta tensors, unmerged and through the ToMA node)
with its bytes and FLOPs scaled to the rank's share of the rows; all of it projected by
projection.project_bounded under projected_calls.CALIBRATED (the H200 calibration of the
single-GPU projection). Link per call: each collective's bytes out / the link's bandwidth plus a
fixed latency per call. No overlap of compute and communication: each all-to-all sits between
the projections that make its input and the attention that reads it, on one stream, whether
raylight's sync_ulysses (default False, raylight nodes.py:387-392, only a host synchronize) is
on or not. Time per call = compute + link.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..shared.common import cpu_model
from ..shared.config import BenchConfig, load_pack
from .projected_calls import CALIBRATED, FLOP_TOLERANCE, ModelSpec, Setting, _randn, check
from .projection import Op, attention_flops, project_bounded

log = logging.getLogger(__name__)

RANKS = (2, 4, 8)
RATIO = 0.5                  # the node's default ratio (nodes/options.py ToMAOptions)
BF16 = 2                     # bytes per element: the projection's models run in bf16
# The composite at P = 1 against the recorded call's calibrated projection: they differ only
# where the FLOP model's matrix products and attention differ from the recorded ones (shapes,
# bias reads), so a larger gap means the FLOP model has drifted from ComfyUI's classes.
COMPOSITE_TOLERANCE = 0.02


@dataclass(frozen=True)
class Link:
    """How ranks reach each other: bandwidth in bytes/s out of one GPU (one direction), and
    latency, seconds added to every collective call; why: where the figures come from."""

    name: str
    bandwidth: float
    latency_s: float
    why: str


# Assumptions, not measurements (no multi-GPU machine ran here).
LINKS: tuple[Link, ...] = (
    Link("NVLink", 450e9, 20e-6,
         "NVLink 4 of an H100/H200 SXM: 900 GB/s per GPU both directions together, 450 GB/s "
         "each way (NVIDIA's H100 SXM datasheet; the H200 SXM's is the same), the peak: NCCL's "
         "all-to-all reaches less, so the link times are low; 20 us a call: an assumption, "
         "the order of a NCCL collective's fixed cost within one node"),
    Link("PCIe 4.0 via host", 12e9, 50e-6,
         "PCIe 4.0 x16 without peer access: 31.5 GB/s each way raw (16 GT/s x 16 lanes, "
         "128b/130b), about 25 GB/s for pinned host copies (typical of CUDA's bandwidthTest, "
         "not measured here); without peer-to-peer NCCL stages "
         "the bytes through host memory, so each crosses PCIe twice (sender to host, host to "
         "receiver) with a host copy between: about half, 12 GB/s, an assumption; 8 GPUs "
         "share one host's memory and root ports, so at P = 8 even that is optimistic; 50 us "
         "a call: an assumption (the host-staged path adds copies and waits)"),
)


# Models ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SPModel:
    """One model at one size as the split sees it.

    family: "wan" or "hunyuan_video"; batch: items per call; grid: video tokens (frames, rows,
    columns) after patching; width C, heads H; text: text tokens T; text_dim: the text
    encoder's width; blocks: Wan (blocks,), HunyuanVideo (double, single); ffn: Wan's
    feed-forward width (HunyuanVideo: mlp_ratio 4 x C); refiner: HunyuanVideo's text refiner
    blocks; patch_in / patch_out: channels x patch volume in and out; element: bytes per
    element; skip_blocks: the node's skip_blocks text; spec: the ModelSpec whose single-GPU
    call is recorded for the kernels other than products and attention (None: none).
    """

    name: str
    label: str
    family: str
    batch: int
    grid: tuple[int, int, int]
    width: int
    heads: int
    text: int
    text_dim: int
    blocks: tuple[int, ...]
    ffn: int = 0
    refiner: int = 0
    patch_in: int = 64
    patch_out: int = 64
    element: int = BF16
    skip_blocks: str | None = None      # None: the node's default
    spec: ModelSpec | None = field(default=None, compare=False)

    @property
    def tokens(self) -> int:
        """Video (grid) tokens N."""
        return math.prod(self.grid)

    @property
    def head_dim(self) -> int:
        return self.width // self.heads


# Wan 2.1 14B t2v, as bench/gpu/projected_calls.py's "wan" (WAN21_14B): 832x480, 81 frames,
# latent 21 x 60 x 104, patch 1x2x2 -> 21 x 30 x 52 tokens; 512 umT5 tokens; CFG 5 with cond and
# uncond in one call (batch 2).
WAN14B = SPModel("wan", "Wan 2.1 14B t2v 832x480x81", "wan", 2, (21, 30, 52), 5120, 40, 512,
                 4096, (40,), ffn=13824)

# HunyuanVideo (13B) t2v as ComfyUI's detection reads its checkpoint (comfy/model_detection.py:
# hidden 3072, heads 3072 / 128 = 24, mlp_ratio 4, 20 double and 40 single blocks, the text
# refiner's 2 blocks (hunyuan_video/model.py TokenRefiner(..., 2)), llava-llama-3 text of width
# 4096, a CLIP-L pooled vector of 768, embedded guidance); 720x1280, 129 frames: latent
# 33 x 90 x 160, patch 1x2x2 -> 33 x 45 x 80 tokens; 256 text tokens. Guidance is embedded, so
# the workflow runs cfg 1: one item per call.
HUNYUAN_VIDEO_CONFIG: dict[str, Any] = {
    "image_model": "hunyuan_video", "in_channels": 16, "patch_size": [1, 2, 2],
    "out_channels": 16, "vec_in_dim": 768, "axes_dim": [16, 56, 56], "meanflow": False,
    "context_in_dim": 4096, "hidden_size": 3072, "mlp_ratio": 4.0, "num_heads": 24, "depth": 20,
    "depth_single_blocks": 40, "theta": 256, "qkv_bias": True, "byt5": False,
    "guidance_embed": True, "use_cond_type_embedding": False, "vision_in_dim": None,
    "meanflow_sum": False,
}
HUNYUAN_VIDEO = SPModel(
    "hunyuan_video", "HunyuanVideo 720x1280x129", "hunyuan_video", 1, (33, 45, 80), 3072, 24,
    256, 4096, (20, 40), refiner=2,
    spec=ModelSpec("hunyuan_video", "HunyuanVideo 720x1280x129", "HunyuanVideo",
                   HUNYUAN_VIDEO_CONFIG, (1, 16, 33, 90, 160), 1.0, (1, 256, 4096),
                   lambda seed, text: {"pooled_output": _randn(1, 768, seed=seed),
                                       "guidance": 6.0}))


def models() -> tuple[SPModel, ...]:
    """The section's models; Wan's spec is projected_calls.py's own (the same call)."""
    from .projected_calls import MODELS

    return (dataclasses.replace(WAN14B, spec=MODELS["wan"]), HUNYUAN_VIDEO)


def skipped(model: SPModel) -> list[frozenset[int]]:
    """Blocks left unmerged, per block kind, as the node reads skip_blocks for this model."""
    options = load_pack().nodes.options
    text = model.skip_blocks if model.skip_blocks is not None else options.DEFAULT_SKIP_BLOCKS
    kinds = [("", model.blocks[0])] if model.family == "wan" else \
        [("d", model.blocks[0]), ("s", model.blocks[1])]
    return options.parse_skip_blocks(text).for_kinds(kinds)


# The split and the merge -------------------------------------------------------------------------
def shard_rows(rows: int, ranks: int) -> int:
    """Rows S each rank holds of a sequence of `rows`, zero-padded to a multiple of `ranks`."""
    return -(-rows // ranks)


def grid_per_rank(rows: int, ranks: int, start: int, tokens: int) -> list[int]:
    """Grid tokens on each rank when a sequence of `rows` (grid at rows [start, start +
    tokens)) is split in shards of shard_rows(rows, ranks)."""
    s = shard_rows(rows, ranks)
    return [max(0, min((r + 1) * s, start + tokens) - max(r * s, start)) for r in range(ranks)]


def dropped(grid: Iterable[int], ratio: float) -> int:
    """Tokens every rank drops in a merged block: toma_core/shards.py's common_drop, the same
    on every rank (the ratio's share of the grid spread evenly; a rank holding fewer grid
    tokens merges its own harder, up to local_cap). The one token each region piece keeps
    never binds at these sizes, and is left out."""
    load_pack()
    from toma_pack.toma_core.shards import common_drop

    held = list(grid)
    return common_drop(held, [0] * len(held), ratio)


# Kernels and messages ----------------------------------------------------------------------------
def linear(rows: int, fan_in: int, fan_out: int, element: int = BF16) -> Op:
    """A linear layer on [rows, fan_in] -> [rows, fan_out] as one matrix product: 2 x rows x
    fan_in x fan_out FLOPs; reads input, weight and bias, writes the output (bytes)."""
    return Op("aten::addmm", "matmul", 2 * rows * fan_in * fan_out,
              element * (rows * fan_in + fan_in * fan_out + fan_out), element * rows * fan_out, 1,
              dtype="bfloat16", shape=(rows, fan_out))


def attention(batch: int, heads: int, queries: int, keys: int, head_dim: int,
              element: int = BF16) -> Op:
    """One fused attention kernel over q [batch, heads, queries, head_dim] and k, v [batch,
    heads, keys, head_dim]: torch's FLOP count; reads q, k, v, writes the output (bytes)."""
    q, kv = (batch, heads, queries, head_dim), (batch, heads, keys, head_dim)
    return Op("fused_attention", "attention", attention_flops(q, kv, kv),
              element * batch * heads * (queries + 2 * keys) * head_dim,
              element * batch * heads * queries * head_dim, 1, dtype="bfloat16", shape=q)


def local_copy(elements: int, element: int = BF16) -> Op:
    """A contiguous copy of `elements` (reads and writes them once)."""
    return Op("aten::copy_", "memory", 0, element * elements, element * elements, 1,
              dtype="bfloat16", shape=(elements,))


@dataclass(frozen=True)
class Message:
    """One collective call of a rank. kind: "all_to_all" (all_to_all_single) or "all_gather";
    elements: of its input buffer on this rank; element: bytes per element; merged_block:
    sent inside a block that ToMA merges (at the defaults); what: which tensor."""

    kind: str
    elements: int
    element: int
    merged_block: bool
    what: str

    def buffer_bytes(self) -> int:
        """Bytes of the input buffer: what the pack's test counts per all_to_all_single."""
        return self.elements * self.element

    def bytes_out(self, ranks: int) -> float:
        """Bytes that leave this rank: an all-to-all keeps 1/P of its buffer and sends the
        rest; a ring all-gather forwards every other rank's shard, (P - 1) buffers."""
        if self.kind == "all_to_all":
            return self.buffer_bytes() * (ranks - 1) / ranks
        return float(self.buffer_bytes() * (ranks - 1))


@dataclass
class RankCall:
    """One model call on one rank: kernels (the FLOP model's products and attention, and the
    copies around the all-to-alls), collective messages, and the FLOPs of the blocks ToMA
    merges at the defaults (block_flops: in this variant, merged or not)."""

    ops: list[Op] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    block_flops: int = 0

    def add(self, ops: list[Op], messages: list[Message], in_merged_block: bool) -> None:
        """Append one part of the call; with each all-to-all its two local copies (yunchang's
        all_to_all_4D makes its input contiguous in the exchange order and the output back in
        [B, L, H, D] order)."""
        self.ops += ops
        for m in messages:
            if m.kind == "all_to_all":
                self.ops += [local_copy(m.elements, m.element)] * 2
        self.messages += messages
        if in_merged_block:
            self.block_flops += sum(op.flops for op in ops)

    @property
    def flops(self) -> int:
        return sum(op.flops for op in self.ops)


def _ulysses(rows: int, keys: int, model: SPModel, ranks: int, merged_block: bool,
             what: str) -> tuple[Op, list[Message]]:
    """Ulysses attention of `rows` query rows on this rank against `keys` key rows on it: the
    attention kernel over every rank's rows with H / P heads, and its four all-to-alls (q, k,
    v in, the output back); none on one GPU."""
    b, c, e = model.batch, model.width, model.element
    kernel = attention(b, model.heads // ranks, ranks * rows, ranks * keys, model.head_dim, e)
    if ranks == 1:
        return kernel, []
    sizes = ((rows, "q"), (keys, "k"), (keys, "v"), (rows, "out"))
    return kernel, [Message("all_to_all", b * n * c, e, merged_block, f"{what} {name}")
                    for n, name in sizes]


def wan_block(model: SPModel, rows: int, ranks: int,
              merged_block: bool) -> tuple[list[Op], list[Message]]:
    """One Wan block on `rows` rows of this rank (ComfyUI's WanAttentionBlock, raylight's
    usp_self_attn_forward and usp_t2v_cross_attn_forward)."""
    b, c, t, e = model.batch, model.width, model.text, model.element
    self_attn, self_msgs = _ulysses(rows, rows, model, ranks, merged_block, "self-attention")
    cross, cross_msgs = _ulysses(rows, t, model, ranks, merged_block, "cross-attention")
    ops = [linear(b * rows, c, c, e) for _ in range(3)] + [self_attn, linear(b * rows, c, c, e)]
    ops += [linear(b * rows, c, c, e), linear(b * t, c, c, e), linear(b * t, c, c, e), cross,
            linear(b * rows, c, c, e)]
    ops += [linear(b * rows, c, model.ffn, e), linear(b * rows, model.ffn, c, e)]
    return ops, self_msgs + cross_msgs


def wan_call(model: SPModel, ranks: int, ratio: float) -> RankCall:
    """One Wan call on one rank of `ranks` (ratio 0: unmerged)."""
    b, c, n, t, e = model.batch, model.width, model.tokens, model.text, model.element
    rows = shard_rows(n, ranks)
    drop = dropped(grid_per_rank(n, ranks, 0, n), ratio) if ratio else 0
    skip = skipped(model)[0]
    call = RankCall()
    # before the split, on every rank: patch embedding of all tokens, text and time embeddings
    call.add([linear(b * n, model.patch_in, c, e), linear(b * t, model.text_dim, c, e),
              linear(b * t, c, c, e), linear(b, 256, c, e), linear(b, c, c, e),
              linear(b, c, 6 * c, e)], [], False)
    for i in range(model.blocks[0]):
        merges = i not in skip
        call.add(*wan_block(model, rows - (drop if merges else 0), ranks, merges), merges)
    gather = [Message("all_gather", b * rows * c, e, False, "output")] if ranks > 1 else []
    call.add([linear(b * n, c, model.patch_out, e)], gather, False)   # the head on all tokens
    return call


def _mlp_embedder(batch: int, fan_in: int, width: int, e: int) -> list[Op]:
    """ComfyUI's MLPEmbedder: fan_in -> width -> width."""
    return [linear(batch, fan_in, width, e), linear(batch, width, width, e)]


def _refiner(model: SPModel, ranks: int) -> tuple[list[Op], list[Message]]:
    """HunyuanVideo's text refiner (TokenRefiner) on the whole text, on every rank; its blocks'
    attention is Ulysses attention (raylight's usp_token_refiner_forward)."""
    b, c, t, e = model.batch, model.width, model.text, model.element
    ops = _mlp_embedder(b, 256, c, e) + _mlp_embedder(b, model.text_dim, c, e)
    ops.append(linear(b * t, model.text_dim, c, e))
    messages: list[Message] = []
    for _ in range(model.refiner):
        kernel, msgs = _ulysses(t, t, model, ranks, False, "text refiner")
        ops += [linear(b, c, 2 * c, e), linear(b * t, c, 3 * c, e), kernel,
                linear(b * t, c, c, e), linear(b * t, c, 4 * c, e), linear(b * t, 4 * c, c, e)]
        messages += msgs
    return ops, messages


def double_block(model: SPModel, video: int, text: int, ranks: int,
                 merged_block: bool) -> tuple[list[Op], list[Message]]:
    """One HunyuanVideo double block on `video` + `text` rows of this rank (Flux's
    DoubleStreamBlock, raylight's usp_double_stream_forward: one attention over [text; video])."""
    b, c, e = model.batch, model.width, model.element
    kernel, messages = _ulysses(video + text, video + text, model, ranks, merged_block,
                                "double block")
    ops = [linear(b, c, 6 * c, e), linear(b, c, 6 * c, e)]
    for rows in (video, text):
        ops += [linear(b * rows, c, 3 * c, e), linear(b * rows, c, c, e),
                linear(b * rows, c, 4 * c, e), linear(b * rows, 4 * c, c, e)]
    return ops + [kernel], messages


def single_block(model: SPModel, rows: int, ranks: int,
                 merged_block: bool) -> tuple[list[Op], list[Message]]:
    """One HunyuanVideo single block on `rows` rows of [text; video] on this rank (Flux's
    SingleStreamBlock, raylight's usp_single_stream_forward)."""
    b, c, e = model.batch, model.width, model.element
    kernel, messages = _ulysses(rows, rows, model, ranks, merged_block, "single block")
    return [linear(b, c, 3 * c, e), linear(b * rows, c, 7 * c, e), kernel,
            linear(b * rows, 5 * c, c, e)], messages


def hunyuan_video_call(model: SPModel, ranks: int, ratio: float) -> RankCall:
    """One HunyuanVideo call on one rank of `ranks` (ratio 0: unmerged)."""
    b, c, n, t, e = model.batch, model.width, model.tokens, model.text, model.element
    skip_double, skip_single = skipped(model)
    call = RankCall()
    # before the split, on every rank: patch embedding of all tokens, time, guidance and
    # pooled-text vectors, the text refiner
    call.add([linear(b * n, model.patch_in, c, e)] + _mlp_embedder(b, 256, c, e) * 2
             + _mlp_embedder(b, 768, c, e), [], False)
    call.add(*_refiner(model, ranks), False)
    video, text = shard_rows(n, ranks), shard_rows(t, ranks)
    drop = dropped(grid_per_rank(n, ranks, 0, n), ratio) if ratio else 0
    for i in range(model.blocks[0]):
        merges = i not in skip_double
        call.add(*double_block(model, video - (drop if merges else 0), text, ranks, merges),
                 merges)
    if ranks > 1:     # gather video and text, split [text; video] again
        call.add([], [Message("all_gather", b * video * c, e, False, "video after doubles"),
                      Message("all_gather", b * text * c, e, False, "text after doubles")],
                 False)
    rows = shard_rows(t + n, ranks)
    drop = dropped(grid_per_rank(t + n, ranks, t, n), ratio) if ratio else 0
    for i in range(model.blocks[1]):
        merges = i not in skip_single
        call.add(*single_block(model, rows - (drop if merges else 0), ranks, merges), merges)
    gather = [Message("all_gather", b * rows * c, e, False, "output")] if ranks > 1 else []
    call.add([linear(b, c, 2 * c, e), linear(b * n, c, model.patch_out, e)], gather, False)
    return call


def rank_call(model: SPModel, ranks: int, ratio: float) -> RankCall:
    """One call of `model` on one rank of `ranks`, unmerged (ratio 0) or merged at `ratio`."""
    if model.family == "wan":
        return wan_call(model, ranks, ratio)
    if model.family == "hunyuan_video":
        return hunyuan_video_call(model, ranks, ratio)
    raise ValueError(f"no sequence-parallel model of family {model.family!r}")


def row_share(model: SPModel, ranks: int) -> float:
    """The rank's share of the split rows (ceil(rows / P) / rows): what the kernels other than
    products and attention are scaled by."""
    rows = model.tokens + (model.text if model.family == "hunyuan_video" else 0)
    return shard_rows(rows, ranks) / rows


# Bytes, links, time ------------------------------------------------------------------------------
def all_to_all_bytes(call: RankCall, ranks: int, merged_blocks_only: bool = False) -> float:
    """Bytes out of the rank over the call's all-to-alls (or those inside merged blocks)."""
    return sum(m.bytes_out(ranks) for m in call.messages
               if m.kind == "all_to_all" and (m.merged_block or not merged_blocks_only))


def buffer_bytes(call: RankCall, merged_blocks_only: bool = False) -> int:
    """The pack's test's count: every all_to_all_single's whole input buffer."""
    return sum(m.buffer_bytes() for m in call.messages
               if m.kind == "all_to_all" and (m.merged_block or not merged_blocks_only))


def gather_bytes(call: RankCall, ranks: int) -> float:
    """Bytes out of the rank over the call's all-gathers."""
    return sum(m.bytes_out(ranks) for m in call.messages if m.kind == "all_gather")


def link_seconds(call: RankCall, ranks: int, link: Link) -> float:
    """Time on the link: per collective call its bytes out / bandwidth + latency."""
    return sum(m.bytes_out(ranks) / link.bandwidth + link.latency_s for m in call.messages)


def scaled(ops: Iterable[Op], share: float) -> list[Op]:
    """The recorded single-GPU call's kernels other than the model's matrix products,
    convolutions and attention (which the FLOP model gives per rank), with FLOPs and bytes
    scaled by the rank's `share` of the rows and a product's rows likewise; host ops dropped."""
    out = []
    for op in ops:
        if op.host or (not op.toma and op.kind in ("matmul", "conv", "attention")):
            continue
        shape = (max(1, math.ceil(op.shape[0] * share)), *op.shape[1:]) if op.shape else ()
        out.append(dataclasses.replace(op, flops=round(op.flops * share),
                                       read=round(op.read * share),
                                       written=round(op.written * share), shape=shape))
    return out


def compute_seconds(call: RankCall, others: list[Op]) -> float:
    """The rank's compute time: its kernels and `others` under the calibrated projection
    (max of the GPU's time and the host's issue time)."""
    return project_bounded(call.ops + others, CALIBRATED).seconds


# Recording the single-GPU calls ------------------------------------------------------------------
@dataclass(frozen=True)
class Recorded:
    """A model's single-GPU call recorded unmerged and with ToMA at the defaults."""

    plain: list[Op]
    merged: list[Op]
    seconds: float


def record(model: SPModel) -> Recorded:
    """Record model.spec's call on meta tensors, unmerged and through the ToMA node at the
    defaults (projected_calls.py's machinery, as its gpu-model section does)."""
    from . import projected_calls as pc

    start = time.perf_counter()
    base = pc.build_patcher(model.spec)
    window = pc.install_window(base)
    plain = pc.record(base, window, model.spec)
    with pc.device_rules(on_gpu=True):
        merged = pc.record(pc.toma(base, Setting("default", {"ratio": RATIO})), window,
                           model.spec)
    return Recorded(plain.ops, merged.ops, time.perf_counter() - start)


def model_flops(ops: Iterable[Op]) -> int:
    """FLOPs of the model's own products, convolutions and attention (not ToMA's)."""
    return sum(op.flops for op in ops
               if not op.host and not op.toma and op.kind in ("matmul", "conv", "attention"))


# Rows --------------------------------------------------------------------------------------------
COLUMNS = ("model", "P", "link", "a2a_gb", "a2a_gb_toma", "a2a_ratio", "a2a_blocks_ratio",
           "buffer_gb", "buffer_gb_toma", "gather_gb", "tflop_blocks", "tflop_blocks_toma",
           "tflop", "tflop_toma", "flop_ratio", "compute_ms", "compute_ms_toma", "link_ms",
           "link_ms_toma", "call_ms", "call_ms_toma", "speedup")


def rows_for(model: SPModel, ranks: int, recorded: Recorded | None) -> list[dict[str, Any]]:
    """One row per link for `model` on `ranks` GPUs: per rank and call, unmerged and ToMA."""
    plain, merged = rank_call(model, ranks, 0.0), rank_call(model, ranks, RATIO)
    share = row_share(model, ranks)
    others = (scaled(recorded.plain, share), scaled(recorded.merged, share)) if recorded \
        else ([], [])
    compute = compute_seconds(plain, others[0]), compute_seconds(merged, others[1])
    base = {
        "model": model.label, "P": ranks,
        "a2a_gb": all_to_all_bytes(plain, ranks) / 1e9,
        "a2a_gb_toma": all_to_all_bytes(merged, ranks) / 1e9,
        "a2a_ratio": all_to_all_bytes(merged, ranks) / all_to_all_bytes(plain, ranks),
        "a2a_blocks_ratio": (all_to_all_bytes(merged, ranks, True)
                             / all_to_all_bytes(plain, ranks, True)),
        "buffer_gb": buffer_bytes(plain) / 1e9, "buffer_gb_toma": buffer_bytes(merged) / 1e9,
        "gather_gb": gather_bytes(plain, ranks) / 1e9,
        "tflop_blocks": plain.block_flops / 1e12, "tflop_blocks_toma": merged.block_flops / 1e12,
        "tflop": plain.flops / 1e12, "tflop_toma": merged.flops / 1e12,
        "flop_ratio": merged.flops / plain.flops,
        "toma_tflop": sum(op.flops for op in others[1] if op.toma) / 1e12,
        "compute_ms": 1e3 * compute[0], "compute_ms_toma": 1e3 * compute[1],
        "all_to_alls": sum(m.kind == "all_to_all" for m in plain.messages),
        "all_gathers": sum(m.kind == "all_gather" for m in plain.messages),
    }
    out = []
    for link in LINKS:
        wire = link_seconds(plain, ranks, link), link_seconds(merged, ranks, link)
        total = compute[0] + wire[0], compute[1] + wire[1]
        out.append({**base, "link": link.name, "link_ms": 1e3 * wire[0],
                    "link_ms_toma": 1e3 * wire[1], "call_ms": 1e3 * total[0],
                    "call_ms_toma": 1e3 * total[1], "speedup": total[0] / total[1],
                    "latency_ms": 1e3 * link.latency_s * len(plain.messages)})
    return out


def one_gpu(model: SPModel, recorded: Recorded) -> dict[str, Any]:
    """The composite at P = 1 (FLOP model + the recorded call's other kernels) against the
    recorded call projected whole: both calibrated seconds, unmerged and ToMA."""
    plain, merged = rank_call(model, 1, 0.0), rank_call(model, 1, RATIO)
    return {
        "composite_s": compute_seconds(plain, scaled(recorded.plain, 1.0)),
        "composite_s_toma": compute_seconds(merged, scaled(recorded.merged, 1.0)),
        "recorded_s": project_bounded(recorded.plain, CALIBRATED).seconds,
        "recorded_s_toma": project_bounded(recorded.merged, CALIBRATED).seconds,
        "flops": plain.flops, "recorded_flops": model_flops(recorded.plain),
    }


def checks(model: SPModel, single: dict[str, Any]) -> list[dict[str, Any]]:
    """The FLOP model and the composite against the recorded single-GPU call."""
    diff = abs(single["flops"] - single["recorded_flops"]) / single["recorded_flops"]
    out = [check(f"{model.label}: the FLOP model at P = 1 matches the recorded call's products "
                 f"and attention within {FLOP_TOLERANCE:.1%}", diff <= FLOP_TOLERANCE,
                 f"{single['flops'] / 1e12:.1f} vs {single['recorded_flops'] / 1e12:.1f} TFLOP "
                 f"({diff:.3%} apart)")]
    gap = abs(single["composite_s"] / single["recorded_s"] - 1)
    out.append(check(f"{model.label}: the composite at P = 1 (unmerged) projects the recorded "
                     f"call's time within {COMPOSITE_TOLERANCE:.0%}", gap <= COMPOSITE_TOLERANCE,
                     f"{1e3 * single['composite_s']:.0f} vs {1e3 * single['recorded_s']:.0f} ms "
                     f"({gap:.2%} apart)"))
    return out


# Raylight's own run on two CPU processes (../shared/notes/raylight/README.md, wan_usp_toma_cpu.py:
# ComfyUI's WanModel at dim 64, 4 heads, 3 blocks, 8 text tokens, latent 4 x 8 x 8 -> 64 tokens,
# fp32, a pair merge on every block): all_to_all_single input bytes per rank and call.
RAYLIGHT_TINY = SPModel("wan_tiny", "Wan, tiny (raylight on 2 CPU processes)", "wan", 1,
                        (4, 4, 4), 64, 4, 8, 32, (3,), ffn=128, element=4, skip_blocks="none")
RAYLIGHT_TINY_BYTES = (159_744, 86_016)


def tiny_check() -> dict[str, Any]:
    """The message model against the bytes raylight's run counted."""
    got = tuple(buffer_bytes(rank_call(RAYLIGHT_TINY, 2, r)) for r in (0.0, RATIO))
    return check("the message model counts the all_to_all_single bytes raylight's run on 2 CPU "
                 "processes counted (tiny Wan, every block merged)", got == RAYLIGHT_TINY_BYTES,
                 f"{got[0]:,} -> {got[1]:,} (measured {RAYLIGHT_TINY_BYTES[0]:,} -> "
                 f"{RAYLIGHT_TINY_BYTES[1]:,})")


def notes(singles: dict[str, dict[str, Any]], rows: list[dict[str, Any]]) -> list[str]:
    """The section's notes: what is assumed and how to read the table."""
    out = [
        f"machine: this {os.cpu_count()}-core {cpu_model()} CPU, no GPU; every figure is a "
        "projection, not a measurement",
        "projected, not measured: nothing ran on a GPU and no link was timed; per rank and per "
        "model call, at the node's defaults (ratio 0.5, skip_blocks d0-4, s0-4: Wan's blocks "
        "5-39, HunyuanVideo's double blocks 5-19 and single blocks 5-39 merge); the split as "
        "raylight's xDiT Ulysses runs it (bench/gpu/sequence_parallel.py)",
        "compute: the FLOP model's products and attention per rank plus the recorded one-GPU "
        "call's other kernels scaled to the rank's rows, projected by project_bounded under the "
        "H200 calibration of the gpu-model section; link: bytes out / bandwidth + latency per "
        "collective call; call_ms = compute + link (no overlap: each all-to-all sits between the "
        "kernels that make and read its tensors)",
    ]
    out += [f"link {link.name}: {link.bandwidth / 1e9:.0f} GB/s, {link.latency_s * 1e6:.0f} us "
            f"a call ({link.why})" for link in LINKS]
    out.append(
        "what each rank sends: Wan, per block 4 all-to-alls of self-attention [B, S, H, D] and 4 "
        "of cross-attention (q and out [B, S, H, D], the whole text's k and v [B, 512, H, D]); "
        "HunyuanVideo, 4 per attention over [text shard; video shard] (raylight splits its text "
        "too) and 4 per text-refiner block on the whole text; then all-gathers of the output. "
        "raylight's HunyuanVideo loop fails with any dit patch at c0495710 (a stray "
        "`out[\"img\"],`, hunyuan_video/xdit_context_parallel.py:193): its rows assume that "
        "fixed")
    out.append(
        "columns: a2a_gb: all-to-all bytes out of each rank per call (GB, (P - 1) / P of each "
        "buffer), unmerged and ToMA; a2a_ratio: ToMA / unmerged over the whole call; "
        "a2a_blocks_ratio: the same over the merged blocks' all-to-alls only; buffer_gb: the "
        "pack's test's count (each all_to_all_single's whole input buffer); gather_gb: "
        "all-gather bytes out of each rank, the same for both; tflop_blocks: FLOPs of the "
        "blocks ToMA merges, per rank; tflop: the whole call per rank (the model's products "
        "and attention); flop_ratio: ToMA / unmerged of tflop; compute_ms, link_ms, call_ms "
        "(their sum): projected times per rank and call, milliseconds; speedup: call_ms / "
        "call_ms_toma")
    out.append("ToMA's own products (merge, unmerge, plan) per rank: " + "; ".join(
        f"{r['model']} P={r['P']}: {r['toma_tflop']:.2f} TFLOP" for r in rows
        if r["link"] == LINKS[0].name))
    out.append("one GPU, the composite against the recorded call (calibrated): " + "; ".join(
        f"{label}: unmerged {1e3 * s['composite_s']:.0f} vs {1e3 * s['recorded_s']:.0f} ms, "
        f"ToMA {1e3 * s['composite_s_toma']:.0f} vs {1e3 * s['recorded_s_toma']:.0f} ms "
        f"(speedup {s['composite_s'] / s['composite_s_toma']:.2f}x vs "
        f"{s['recorded_s'] / s['recorded_s_toma']:.2f}x; the one-GPU ToMA merges the pack's "
        f"regions, which keep slightly fewer tokens than round(ratio x N))"
        for label, s in singles.items()))
    return out


def run(cfg: BenchConfig) -> dict[str, Any]:
    """The section: rows per model, P and link; notes; checks as targets."""
    cfg.apply_threads()
    load_pack()
    rows: list[dict[str, Any]] = []
    targets = [tiny_check()]
    singles: dict[str, dict[str, Any]] = {}
    timing = []
    for model in models():
        log.warning("gpu-sp: %s", model.label)
        recorded = record(model)
        timing.append(f"{model.label} {recorded.seconds:.0f} s")
        singles[model.label] = one_gpu(model, recorded)
        targets += checks(model, singles[model.label])
        for ranks in RANKS:
            rows += rows_for(model, ranks, recorded)
    return {"rows": rows, "columns": list(COLUMNS),
            "notes": notes(singles, rows) + ["wall time of the recording: " + "; ".join(timing)],
            "targets": targets}
