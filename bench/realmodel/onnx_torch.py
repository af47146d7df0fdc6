"""The terrain model's ONNX graph run node by node as torch ops, self-attention as blocks.

Each of the graph's self-attention blocks (a 1x1 `qkv` conv on the group-normed grid, heads of
dot-product attention, a 1x1 `proj_out` conv) runs as one `AttentionBlock` handed to a
`runner(block, normed [B, C, H, W], x [B, C, H, W]) -> [B, C, H, W]` (x: the block's input,
before its norm): the unmerged attention, or a merge
around it (merges.py). Everything else runs as the ONNX nodes say (the few op types this
graph uses; an unknown one is an error).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import numpy_helper


class AttentionBlock:
    """One self-attention block: qkv_w [3C, C], proj_w [C, C] (1x1 convs as linear layers)."""

    def __init__(self, name: str, qkv_w, qkv_b, proj_w, proj_b, heads: int) -> None:
        self.name, self.heads = name, heads
        self.qkv_w, self.qkv_b = qkv_w.flatten(1), qkv_b
        self.proj_w, self.proj_b = proj_w.flatten(1), proj_b

    def heads_of(self, t: torch.Tensor) -> torch.Tensor:
        """[B, N, C] -> [B, H, N, C/H]."""
        return t.unflatten(-1, (self.heads, -1)).transpose(1, 2)

    def attend(self, t: torch.Tensor, bias: torch.Tensor | None = None,
               kv: torch.Tensor | None = None) -> torch.Tensor:
        """Normed tokens t [B, N, C] (keys and values from kv [B, N', C] when given) ->
        projected attention output [B, N, C]; bias: an additive mask on the keys' logits."""
        q, k, v = F.linear(t, self.qkv_w, self.qkv_b).chunk(3, dim=-1)
        if kv is not None:
            _, k, v = F.linear(kv, self.qkv_w, self.qkv_b).chunk(3, dim=-1)
        out = F.scaled_dot_product_attention(*map(self.heads_of, (q, k, v)), attn_mask=bias)
        return F.linear(out.transpose(1, 2).flatten(2), self.proj_w, self.proj_b)


def plain(block: AttentionBlock, normed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The unmerged block: normed [B, C, H, W] -> its attention output [B, C, H, W]."""
    b, c, h, w = normed.shape
    out = block.attend(normed.flatten(2).transpose(1, 2))
    return out.transpose(1, 2).reshape(b, c, h, w)


Runner = Callable[[AttentionBlock, torch.Tensor, torch.Tensor], torch.Tensor]


def _attr(node) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _conv(x, w, b=None, pads=(), strides=(), dilations=(), group=1, **_):
    fn = F.conv2d if w.dim() == 4 else F.conv1d
    half = len(pads) // 2
    if list(pads[:half]) != list(pads[half:]):
        raise ValueError(f"asymmetric pads {pads}")
    return fn(x, w, b, stride=tuple(strides) or 1, padding=tuple(pads[:half]) or 0,
              dilation=tuple(dilations) or 1, groups=group)


def _reshape(x, shape, allowzero=0, **_):
    dims = [int(d) for d in shape.tolist()]
    if not allowzero:
        dims = [x.shape[i] if d == 0 else d for i, d in enumerate(dims)]
    return x.reshape(dims)


def _split(x, split=None, axis=0, num_outputs=None, **_):
    if split is not None:
        return torch.split(x, [int(s) for s in split.tolist()], dim=axis)
    return torch.chunk(x, num_outputs, dim=axis)


def _resize(x, roi=None, scales=None, sizes=None, mode=b"nearest",
            coordinate_transformation_mode=b"asymmetric", nearest_mode=b"floor", **_):
    if (mode, coordinate_transformation_mode, nearest_mode) != (b"nearest", b"asymmetric",
                                                                 b"floor"):
        raise ValueError("only nearest/asymmetric/floor resizing is converted")
    if sizes is not None and sizes.numel():
        return F.interpolate(x, size=[int(s) for s in sizes.tolist()[2:]], mode="nearest")
    return F.interpolate(x, scale_factor=[float(s) for s in scales.tolist()[2:]],
                         mode="nearest")


def _gemm(a, b, c=None, alpha=1.0, beta=1.0, transA=0, transB=0, **_):  # noqa: N803
    out = alpha * (a.T if transA else a) @ (b.T if transB else b)
    return out if c is None else out + beta * c


def _axes(x, axes, fn):
    for a in sorted(int(v) for v in axes.tolist()):
        x = fn(x, a)
    return x


OPS: dict[str, Callable] = {
    "Add": lambda a, b, **_: a + b, "Sub": lambda a, b, **_: a - b,
    "Mul": lambda a, b, **_: a * b, "Div": lambda a, b, **_: a / b,
    "Pow": lambda a, b, **_: a ** b, "Reciprocal": lambda a, **_: 1.0 / a,
    "Sqrt": lambda a, **_: a.sqrt(), "Log": lambda a, **_: a.log(),
    "Cos": lambda a, **_: a.cos(), "Sin": lambda a, **_: a.sin(),
    "Sigmoid": lambda a, **_: a.sigmoid(),
    "Clip": lambda a, lo=None, hi=None, **_: a.clamp(lo, hi),
    "Softmax": lambda a, axis=-1, **_: a.softmax(axis),
    "Einsum": lambda *xs, equation, **_: torch.einsum(equation.decode(), *xs),
    "Concat": lambda *xs, axis, **_: torch.cat(xs, dim=axis),
    "Shape": lambda a, start=0, end=None, **_: torch.tensor(a.shape[start:end]),
    "Squeeze": lambda a, axes=None, **_: a.squeeze() if axes is None else a.squeeze(
        tuple(int(v) for v in axes.tolist())),
    "Unsqueeze": lambda a, axes, **_: _axes(a, axes, torch.unsqueeze),
    "InstanceNormalization": lambda x, s, b, epsilon=1e-5, **_: F.instance_norm(
        x, weight=s, bias=b, eps=epsilon),
    "AveragePool": lambda x, kernel_shape, strides, pads=(0, 0, 0, 0), count_include_pad=0,
    ceil_mode=0, **_: F.avg_pool2d(x, kernel_shape, strides, pads[:2], bool(ceil_mode),
                                   bool(count_include_pad)),
    "Conv": _conv, "Reshape": _reshape, "Split": _split, "Resize": _resize, "Gemm": _gemm,
}


class OnnxUNet:
    """The graph as a callable: (noisy [B, 1, H, W], sigma [B], difficulty [B]) -> denoised.
    `runner` runs every self-attention block (default: unmerged)."""

    def __init__(self, path: str) -> None:
        graph = onnx.load(path).graph
        self.values = {i.name: torch.from_numpy(numpy_helper.to_array(i).copy())
                       for i in graph.initializer}
        self.nodes = [n for n in graph.node if n.op_type != "Constant"]
        for n in graph.node:
            if n.op_type == "Constant":
                self.values[n.output[0]] = torch.from_numpy(
                    numpy_helper.to_array(n.attribute[0].t).copy())
        self.attrs = [_attr(n) for n in self.nodes]
        self.inputs = [i.name for i in graph.input]
        self.outputs = [o.name for o in graph.output]
        self.blocks = self._find_blocks()
        self.runner: Runner = plain

    def _find_blocks(self) -> dict[int, tuple[AttentionBlock, int, str]]:
        """Index of each qkv conv -> (its block, the index of its proj_out conv, the name of
        the block's input: the residual proj_out's output is added to)."""
        found, start = {}, None
        for i, n in enumerate(self.nodes):
            if n.op_type == "Conv" and n.input[1].endswith(".qkv.weight"):
                start = i
            elif n.op_type == "Conv" and n.input[1].endswith(".proj_out.weight"):
                heads = self._heads(start, i)
                q, p = self.nodes[start], n
                name = q.input[1].removesuffix(".qkv.weight")
                block = AttentionBlock(name, *(self.values[v] for v in q.input[1:]),
                                       *(self.values[v] for v in p.input[1:]), heads)
                residual = self.nodes[i + 1]
                if residual.op_type != "Add" or n.output[0] not in residual.input:
                    raise ValueError(f"{name}: no residual add after proj_out")
                x = next(v for v in residual.input if v != n.output[0])
                found[start] = (block, i, x)
        return found

    def _heads(self, start: int, stop: int) -> int:
        """The block's head count: its channels over the per-head width, the constant in the
        middle of the [B * heads, width, tokens] shape its scaled queries are viewed to (a
        shape made once per level and shared by its blocks)."""
        made = {o: n for n in self.nodes for o in n.output}
        channels = self.values[self.nodes[start].input[1]].shape[1]
        scaled = {n.output[0] for n in self.nodes[start:stop] if n.op_type == "Mul"
                  and any(v in self.values and self.values[v].is_floating_point()
                          for v in n.input)}
        for n in self.nodes[start:stop]:
            if n.op_type == "Reshape" and n.input[0] in scaled:
                width = self.values[made[n.input[1]].input[1]]
                return channels // int(width)
        raise ValueError("no head width found in an attention block")

    @torch.no_grad()
    def __call__(self, **feeds: np.ndarray) -> torch.Tensor:
        env = dict(self.values)
        env.update({k: torch.from_numpy(np.asarray(feeds[k])) for k in self.inputs})
        i = 0
        while i < len(self.nodes):
            node = self.nodes[i]
            if i in self.blocks:
                block, stop, x = self.blocks[i]
                env[self.nodes[stop].output[0]] = self.runner(block, env[node.input[0]], env[x])
                i = stop + 1
                continue
            args = [env[v] if v else None for v in node.input]
            out = OPS[node.op_type](*args, **self.attrs[i])
            outs = out if isinstance(out, (tuple, list)) else (out,)
            env.update(zip(node.output, outs, strict=True))
            i += 1
        return env[self.outputs[0]]


class Session:
    """Stands in for the package's onnxruntime session: `run(names, feeds)` on the torch graph,
    each call (one model call) starting with `start()` (a merge's plans are per call)."""

    def __init__(self, model: OnnxUNet, start: Callable[[], None] = lambda: None) -> None:
        self.model, self.start = model, start

    def run(self, names, feeds):
        self.start()
        return [self.model(**feeds).numpy()]

    def get_providers(self):
        return ["CPUExecutionProvider"]
