"""The projected time of one model call on a GPU, from the aten ops it runs, computing nothing.

`CallRecorder` is a TorchDispatchMode. Inside it, tensors on the meta device stand for tensors on
the GPU: an op on them runs only its meta kernel (shapes, dtypes, strides: no FLOP executed, no
memory used), and the recorder writes one `Op` for it:

- FLOPs: torch.utils.flop_counter's formulas for the ops it has formulas for (mm, addmm, bmm,
  baddbmm, convolution, scaled-dot-product attention); 0 for every other op (elementwise,
  reductions, copies, gathers: a few FLOPs per element at most, against the ~180 FLOP per byte
  a GPU like the H200 needs before compute rather than memory bounds an op, so their FLOPs
  never decide the projection).
- Bytes: the memory span of every distinct input and output tensor (a broadcast input counts
  its real extent, not its expanded size); a gather (index_select, gather, index, embedding)
  reads at most its output's worth of its source; write-only ops (copy_, fill_, zero_) do not
  read their destination. Views and metadata ops (outputs sharing an input's storage) move 0
  bytes and launch nothing; allocations (empty*) launch nothing.
- Launches: one kernel per other op (an approximation: a few CUDA ops launch more than one).
- Syncs: reads of device values by the host (`.item()`, `bool()`, `torch.equal`, ops whose
  output size depends on data such as `nonzero`, device-to-host copies) and host-to-device
  copies, which PyTorch makes blocking by default (aten/src/ATen/native/cuda/Copy.cu:
  non_blocking=False copies call memcpy_and_sync, i.e. cudaMemcpyAsync + cudaStreamSynchronize).
- Whose op it is: the pack's (`toma`) when its own code (a file under one of `owner_dirs`)
  issues it with only torch functions in between (its merge, unmerge and plan code). An op
  inside a module's forward (a torch module's or the model's) belongs to whoever called the
  innermost module (`nn.Module.__call__` on the stack): the pack's when it called the module for
  itself (a block's norm for plan features), the model's when the model did, even where the
  pack's patch replaced that forward and runs the original inside it (the block on merged
  tokens, a patched projection).
- Host work: ops on CPU tensors only (tables the pack builds before uploading them) are kept
  in the list with host=True and left out of the projection.
- Memory: every device storage an op allocates is live from that op until its last tensor
  dies (a weakref finalizer on the storage); `peak_bytes` is the most live at once.

Composite ops are recorded as the kernels a GPU runs for them: scaled-dot-product attention as
one fused attention kernel (what PyTorch picks on CUDA for bf16: flash, cuDNN or memory-efficient
attention, same FLOPs and the same tensors in and out; on meta it would fall back to the math
path, which materialises the attention matrix), rms_norm as one `_fused_rms_norm` (PyTorch's
layer_norm.cpp: rms_norm calls at::_fused_rms_norm, a CUDA kernel, composite elsewhere); every
other composite op is decomposed into the aten ops it runs. This needs the call to run under
torch.inference_mode() (as ComfyUI runs prompts), where composite ops reach the mode whole.

Values: tensors small enough (SHADOW_LIMIT elements) whose values follow from the call's inputs
(sigmas, timesteps, index tables the pack uploads) carry a real CPU "shadow" computed alongside,
so a host read of them gets the true value. A read of a value that depends on the weights or
the noise cannot be known: `equal` is answered True and a boolean read False (the checks a
correct plan passes: a sanity check that raises on a flag, a structure test that holds by
construction); the Op says so (`assumed`) and where it came from, and any other unknown read
raises UnknownValueError. An op whose output size depends on data runs on shadows; a tensor of
unknown values indexed by a boolean mask of known ones (a model picking its image rows) needs
only the mask's. bench/gpu/projected_calls.py validates these answers by running small models
for real under the same recorder and comparing the op lists.

`project(ops, gpu)` turns an op list into time: each launching op takes its roofline time
max(FLOPs / peak FLOP/s of its dtype, bytes / bandwidth) (at `efficiency` of both peaks, fused
attention at `attention_efficiency` of the FLOP peak on top) plus `launch_s`, summed ("serial");
and the same ops on an
asynchronous queue ("queued"), where the host issues a launch every `launch_s`, the GPU runs
each kernel once it is issued and the previous one is done, and the host waits for the GPU at
every sync. `project_bounded(ops, calibration)` is the calibrated projection: each kernel at what
its kind and size reach (matrix products at their wave quantization, fused attention at a
measured share of the peak, no kernel under a floor, a gap between kernels), the host's issue
time from the launch count, and the call as the larger of the two, saying which bound wins.
"""

from __future__ import annotations

import gc
import os
import sys
import sysconfig
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.utils.flop_counter as flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten
META = torch.device("meta")
HOST = torch.device("cpu")

# Tensors up to this many elements carry real values beside their meta twin (see the module
# docstring): big enough for a video's region tables (Wan 14B: 450 x 108), small enough that
# computing them costs nothing next to the model's meta kernels.
SHADOW_LIMIT = 1 << 20

MATMUL_OPS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm}
CONV_OPS = {aten.convolution, aten._convolution, aten.convolution_overrideable}
ALLOCATIONS = {aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty,
               aten.new_empty_strided}
WRITE_ONLY = {aten.copy_, aten.fill_, aten.zero_}
GATHERS = {aten.index_select, aten.gather, aten.index, aten.embedding, aten.take}
VALUE_READS = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default}
FUSED = {aten.scaled_dot_product_attention.default, aten.rms_norm.default}


class UnknownValueError(RuntimeError):
    """The host read a device value the projection cannot know (it depends on weights or
    noise) and has no safe answer for."""


class DeviceMismatchError(RuntimeError):
    """A host tensor (not a 0-dim scalar) met device tensors in one op: that fails on a GPU."""


@dataclass(frozen=True)
class GPU:
    """A GPU as a roofline: peak FLOP/s of matrix products by dtype name (e.g. "bfloat16"),
    memory bandwidth in bytes/s, seconds per kernel launch; the fraction of both peaks every
    kernel reaches (`efficiency`) and, on top, the fraction of the FLOP peak fused attention
    reaches. `fallback_dtype`'s peak serves dtypes missing from `peak_flops`."""

    name: str
    peak_flops: Mapping[str, float]
    bandwidth: float
    launch_s: float
    attention_efficiency: float = 1.0
    efficiency: float = 1.0
    fallback_dtype: str = "float32"

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s of matrix products in `dtype`."""
        return self.peak_flops.get(dtype, self.peak_flops[self.fallback_dtype])


@dataclass(frozen=True)
class Op:
    """One recorded aten op.

    name: the aten overload; kind: "matmul", "conv", "attention", "copy" (host <-> device),
    "read" (the host reads a device value), "view", "alloc" or "memory" (every other kernel);
    flops; read / written: bytes; launches: kernels it launches (0 for views, metadata,
    allocations); sync: the host waits for the device; toma: issued by the pack (see the module
    docstring); host: runs on host tensors only (not GPU work: left out of projections);
    dtype: of its first tensor input (picks the FLOP peak); shape: of its first output;
    where: "file:line function" of the innermost frame outside torch; assumed: the answer
    given for a value the projection could not know ("" when none).
    """

    name: str
    kind: str = "memory"
    flops: int = 0
    read: int = 0
    written: int = 0
    launches: int = 0
    sync: bool = False
    toma: bool = False
    host: bool = False
    dtype: str = "bfloat16"
    shape: tuple[int, ...] = ()
    where: str = ""
    assumed: str = ""


def op_seconds(op: Op, gpu: GPU) -> float:
    """Roofline seconds of one op on the GPU, launch cost left out: max(FLOPs / peak,
    bytes / bandwidth) for an op that launches a kernel, 0 for one that does not."""
    if not op.launches or op.host:
        return 0.0
    peak = gpu.peak(op.dtype) * (gpu.attention_efficiency if op.kind == "attention" else 1.0)
    return max(op.flops / peak, (op.read + op.written) / gpu.bandwidth) / gpu.efficiency


@dataclass(frozen=True)
class Projection:
    """One call's projection (see `project`); seconds unless said otherwise.

    serial: sum over launching ops of roofline + launches * launch_s; queued: the asynchronous
    queue's finish time; device: sum of rooflines (the GPU's busy time); toma: serial time of
    the pack's ops; by_kind: serial time by Op.kind; flops, bytes, launches, syncs: totals of
    device ops.
    """

    serial: float
    queued: float
    device: float
    toma: float
    launches: int
    syncs: int
    flops: int
    bytes: int
    by_kind: dict[str, float] = field(default_factory=dict)

    @property
    def toma_share(self) -> float:
        """Fraction of the serial time spent in the pack's ops."""
        return self.toma / self.serial if self.serial else 0.0


def project(ops: Iterable[Op], gpu: GPU) -> Projection:
    """Project the device ops of `ops` (host ops are skipped) on `gpu`, serial and queued."""
    serial = device = toma = 0.0
    host_clock = gpu_clock = 0.0
    launches = syncs = flops = moved = 0
    by_kind: dict[str, float] = {}
    for op in ops:
        if op.host:
            continue
        run = op_seconds(op, gpu)
        cost = run + op.launches * gpu.launch_s
        serial += cost
        device += run
        toma += cost if op.toma else 0.0
        by_kind[op.kind] = by_kind.get(op.kind, 0.0) + cost
        launches += op.launches
        flops += op.flops
        moved += op.read + op.written
        if op.launches:
            host_clock += op.launches * gpu.launch_s
            gpu_clock = max(gpu_clock, host_clock) + run
        if op.sync:
            syncs += 1
            host_clock = max(host_clock, gpu_clock)
    return Projection(serial, max(host_clock, gpu_clock), device, toma, launches, syncs,
                      flops, moved, by_kind)


# Calibrated: each kernel at what its kind and size reach, and the host issuing them --------------
@dataclass(frozen=True)
class Calibration:
    """What a real GPU and its host reach below `gpu`'s peaks (projected_calls.py names the
    source of each value).

    sms: streaming multiprocessors; tile: a matrix product's output tile per SM (M, N), so a
    product of T tiles runs in ceil(T / sms) waves and reaches T / (waves * sms) of the peak
    (wave quantization); attention_efficiency: fused attention's share of the FLOP peak;
    kernel_floor_s: the shortest a kernel runs; gap_s: the GPU idle between two kernels;
    host_launch_s: the host's time to issue one kernel (PyTorch's eager dispatch and the launch
    itself, the Python around it included on average)."""

    gpu: GPU
    sms: int
    tile: tuple[int, int]
    attention_efficiency: float
    kernel_floor_s: float
    gap_s: float
    host_launch_s: float


def wave_efficiency(shape: tuple[int, ...], kind: str, cal: Calibration) -> float:
    """The share of the SMs a matrix product's output tiles keep busy over its waves: output
    [..., M, N] (a convolution's [B, C, H, W] as the implicit GEMM's M = B*H*W, N = C)."""
    if len(shape) < 2:
        return 1.0
    if kind == "conv" and len(shape) >= 3:
        m, n, batch = shape[0] * _prod(shape[2:]), shape[1], 1
    else:
        m, n, batch = shape[-2], shape[-1], _prod(shape[:-2])
    tiles = batch * -(-m // cal.tile[0]) * -(-n // cal.tile[1])
    waves = -(-tiles // cal.sms)
    return tiles / (waves * cal.sms) if tiles else 1.0


def _prod(dims: Sequence[int]) -> int:
    out = 1
    for d in dims:
        out *= d
    return out


def calibrated_seconds(op: Op, cal: Calibration) -> float:
    """One launching op's GPU time: matrix products at their wave efficiency, fused attention
    at attention_efficiency of the FLOP peak, every op at least its bytes over the bandwidth
    and the kernel floor; 0 for an op that launches nothing."""
    if not op.launches or op.host:
        return 0.0
    peak = cal.gpu.peak(op.dtype)
    if op.kind in ("matmul", "conv"):
        peak *= wave_efficiency(op.shape, op.kind, cal)
    elif op.kind == "attention":
        peak *= cal.attention_efficiency
    compute = op.flops / peak if op.flops else 0.0
    return max(compute, (op.read + op.written) / cal.gpu.bandwidth, cal.kernel_floor_s)


@dataclass(frozen=True)
class Bounded:
    """A call as max(host, GPU): gpu: the kernels and the gaps between them; host: issuing
    them; seconds: the larger; bound: which one ("host" or "GPU")."""

    gpu: float
    host: float

    @property
    def seconds(self) -> float:
        return max(self.gpu, self.host)

    @property
    def bound(self) -> str:
        return "host" if self.host > self.gpu else "GPU"


def project_bounded(ops: Iterable[Op], cal: Calibration) -> Bounded:
    """The device ops of `ops` as a Bounded call under `cal`."""
    gpu = host = 0.0
    for op in ops:
        if op.host or not op.launches:
            continue
        gpu += calibrated_seconds(op, cal) + op.launches * cal.gap_s
        host += op.launches * cal.host_launch_s
    return Bounded(gpu, host)


# Recording ----------------------------------------------------------------------------------
def span_bytes(t: torch.Tensor) -> int:
    """Bytes of memory tensor `t` covers: its elements, or fewer where strides repeat them
    (a broadcast, stride-0 tensor covers only its real extent)."""
    if t.numel() == 0:
        return 0
    span = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride(), strict=True) if n > 0)
    return min(t.numel(), span) * t.element_size()


def storage_key(t: torch.Tensor) -> int:
    """Identity of t's storage while it lives (the address of its StorageImpl)."""
    return t.untyped_storage()._cdata


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass
class _Frames:
    """Classifies Python code objects for attribution (see CallRecorder's docstring).

    torch_dir: torch's package folder; skip_dirs: it, this module and the standard library.
    """

    owner_dirs: tuple[str, ...]
    torch_dir: str
    skip_dirs: tuple[str, ...]
    cache: dict[Any, str] = field(default_factory=dict)

    def kind(self, code: Any) -> str:
        """"call" (nn.Module's call machinery), "layer" (a torch module's forward), "skip"
        (other torch code, this module, the standard library), "owner" or "other"."""
        found = self.cache.get(code)
        if found is None:
            path = code.co_filename
            modules = path.startswith(self.torch_dir) and (
                os.sep + os.path.join("nn", "modules") + os.sep) in path
            if modules and code.co_name in ("_call_impl", "_wrapped_call_impl"):
                found = "call"
            elif modules and code.co_name == "forward":
                found = "layer"
            elif path.startswith("<") or path.startswith(self.skip_dirs):
                found = "skip"
            elif path.startswith(self.owner_dirs):
                found = "owner"
            else:
                found = "other"
            self.cache[code] = found
        return found

    def issuer(self) -> tuple[bool, str]:
        """(issued by the owner, "file:line function" of the innermost frame outside torch).

        The owner's when its code issues the op itself (only torch functions in between); an
        op inside a module's forward (torch's or the model's) belongs to whoever called the
        innermost module: the owner's when the owner called it.
        """
        frame = sys._getframe(1)
        first = None        # the innermost frame outside torch's plumbing
        in_module = False   # a torch module's forward lies between the op and `first`
        while frame is not None:
            kind = self.kind(frame.f_code)
            if kind == "call" and (first is not None or in_module):
                return self._owner_called(frame), _where(first)
            if kind == "layer":
                in_module = True
            elif kind in ("owner", "other") and first is None:
                first = frame
                if kind == "owner" and not in_module:
                    return True, _where(frame)
            frame = frame.f_back
        return False, _where(first)

    def _owner_called(self, call: Any) -> bool:
        """Whether the code that made module call `call` (torch's plumbing skipped) is the
        owner's."""
        caller = call.f_back
        while caller is not None and self.kind(caller.f_code) in ("call", "skip", "layer"):
            caller = caller.f_back
        return caller is not None and self.kind(caller.f_code) == "owner"


def _where(frame: Any) -> str:
    if frame is None:
        return ""
    parts = Path(frame.f_code.co_filename).parts
    return f"{'/'.join(parts[-2:])}:{frame.f_lineno} {frame.f_code.co_name}"


def _frames(owner_dirs: Sequence[str | Path]) -> _Frames:
    """A classifier for these owner folders; skipped: torch, this module, and the Python
    standard library (not its site-packages)."""
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    stdlib = sysconfig.get_paths()["stdlib"]
    skip = [torch_dir, __file__] + ([stdlib + os.sep] if "site-packages" not in stdlib else [])
    return _Frames(tuple(str(Path(d).resolve()) + os.sep for d in owner_dirs), torch_dir,
                   tuple(skip))


def attention_flops(q: Sequence[int], k: Sequence[int], v: Sequence[int]) -> int:
    """FLOPs of attention over q [B, H, L, D], k [B, Hk, S, D], v [B, Hk, S, Dv]: torch's
    sdpa_flop_count with the key/value heads broadcast to the query's (grouped-query attention,
    Hk dividing H: HiDream-O1's 32 query and 8 key/value heads), which torch 2.11's formula,
    the device's, refuses."""
    b, h, _, _ = q
    if k[1] != v[1] or h % k[1]:
        raise ValueError(f"attention heads: q {tuple(q)}, k {tuple(k)}, v {tuple(v)}")
    return int(flop_counter.sdpa_flop_count(q, (b, h, *k[2:]), (b, h, *v[2:])))


class CallRecorder(TorchDispatchMode):
    """Record the aten ops of one model call (see the module docstring).

    owner_dirs: folders whose code counts as the pack's. simulate True: meta tensors are the
    GPU's, real (CPU) tensors the host's; put the call's inputs on the device with `to_device`.
    simulate False: every tensor is real and every op counts as device work (the validation
    runs, where small models run for real to check the op list and the assumed answers).
    After the call, `close(output)` stops memory tracking and measures what stays alive.
    ops: the recorded ops in order (host ops included, flagged); peak_bytes: most device bytes
    live at once (the call's inputs not counted, also those it copies from the host itself);
    kept_bytes: device bytes still alive at close, the output's left out.
    """

    def __init__(self, owner_dirs: Sequence[str | Path], simulate: bool = True) -> None:
        super().__init__()
        self.simulate = simulate
        self.ops: list[Op] = []
        self.live_bytes = 0
        self.peak_bytes = 0
        self.kept_bytes = 0
        self._frames = _frames(owner_dirs)
        self._shadows: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._poisoned: set[int] = set()
        self._live: dict[int, int] = {}
        self._host_made: set[int] = set()       # storages the call's host ops made
        self._finalizers: list[weakref.finalize] = []
        self._tracking = True

    # Inputs ----------------------------------------------------------------------------------
    def to_device(self, tree: Any) -> Any:
        """`tree` with every real tensor replaced by a meta twin (same shape, strides, dtype),
        carrying its values as a shadow when small: the call's inputs, which a GPU run has on
        the device already (nothing is recorded). Dicts, lists and tuples are rebuilt."""
        if isinstance(tree, torch.Tensor):
            return tree if tree.is_meta else self._twin(tree)
        if isinstance(tree, dict):
            return {k: self.to_device(v) for k, v in tree.items()}
        if isinstance(tree, (list, tuple)):
            items = [self.to_device(v) for v in tree]
            return type(tree)(items) if isinstance(tree, list) else tuple(items)
        return tree

    def _twin(self, real: torch.Tensor, shadow: bool = True) -> torch.Tensor:
        twin = torch.empty_strided(real.shape, real.stride(), dtype=real.dtype, device=META)
        if shadow and real.numel() <= SHADOW_LIMIT:
            self._shadows[twin] = real.clone()
        return twin

    def shadow(self, t: torch.Tensor) -> torch.Tensor | None:
        """The real values of meta tensor t, when known."""
        if not t.is_meta:
            return t
        if storage_key(t) in self._poisoned:
            return None
        return self._shadows.get(t)

    # Dispatch --------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not torch.is_inference_mode_enabled():
            raise RuntimeError("CallRecorder needs torch.inference_mode() (composite ops must "
                               "reach it whole; ComfyUI runs prompts that way)")
        if func in VALUE_READS:
            return self._value_read(func, args, kwargs)
        if func in FUSED:
            return self._fused(func, args, kwargs)
        with self:
            out = func.decompose(*args, **kwargs)
        if out is not NotImplemented:
            return out
        if self.simulate:
            transfer = self._transfer(func, args, kwargs)
            if transfer is not None:
                return transfer
            args, kwargs = self._place(func, args, kwargs)
        try:
            out = func(*args, **kwargs)
        except (NotImplementedError, RuntimeError):
            # a meta kernel that cannot run: the output's size depends on data (nonzero)
            if not self.simulate:
                raise
            if func is aten.index.Tensor and self.shadow(args[0]) is None:
                return self._masked(args[0], args[1])
            if any(self.shadow(t) is None for t in _tensors((args, kwargs))):
                raise
            return self._data_dependent(func, args, kwargs)
        self._record(func, args, kwargs, out)
        if self.simulate:
            self._propagate(func, args, kwargs, out)
        return out

    def _place(self, func, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """0-dim host tensors joining device tensors go to the device (CUDA takes CPU scalars
        as kernel arguments); any other host tensor there is refused."""
        flat = _tensors((args, kwargs))
        if not any(t.is_meta for t in flat):
            return args, kwargs
        for t in flat:
            if not t.is_meta and t.dim() > 0:
                raise DeviceMismatchError(
                    f"{func} mixes a host tensor {tuple(t.shape)} with device tensors at "
                    f"{self._frames.issuer()[1]}: this fails on a GPU")
        return tree_map(lambda x: self._twin(x) if isinstance(x, torch.Tensor) and not x.is_meta
                        else x, (args, kwargs))

    def _transfer(self, func, args: tuple, kwargs: dict) -> Any:
        """Copies between host and device: recorded as blocking copies (syncs); a copy to the
        host needs the values (shadow). None for anything else."""
        if func is aten._to_copy.default:
            src, target = args[0], kwargs.get("device")
            if not src.is_meta and target is not None and torch.device(target) == META:
                real = func(src, **{**kwargs, "device": HOST})
                twin = self._twin(real)
                self._record_copy(func, src, twin, not kwargs.get("non_blocking", False))
                if storage_key(src) in self._host_made:
                    # a host tensor from before the call is one of its inputs (not counted)
                    self._allocated(twin)
                return twin
            if src.is_meta and target is not None and torch.device(target) != META:
                real = self._known(src, func).to(**{k: v for k, v in kwargs.items()
                                                    if k in ("dtype", "device")})
                self._record_copy(func, src, real)
                return real
            return None
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            if dst.is_meta and not src.is_meta:
                blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
                self._record_copy(func, src, dst, blocking)
                if dst.numel() <= SHADOW_LIMIT and dst.shape == src.shape:
                    self._shadows[dst] = src.to(dst.dtype).clone()
                    self._poisoned.discard(storage_key(dst))
                else:
                    self._poisoned.add(storage_key(dst))
                return dst
            if src.is_meta and not dst.is_meta:
                dst.copy_(self._known(src, func))
                self._record_copy(func, src, dst)
                return dst
        return None

    def _known(self, t: torch.Tensor, func) -> torch.Tensor:
        real = self.shadow(t)
        if real is None:
            raise UnknownValueError(f"{func}: the host reads a device tensor {tuple(t.shape)} "
                                    f"whose values depend on weights or noise, at "
                                    f"{self._frames.issuer()[1]}")
        return real

    def _value_read(self, func, args: tuple, kwargs: dict) -> Any:
        """.item(), bool() and torch.equal on device tensors: a sync, answered from shadows or
        by the assumption in the module docstring."""
        tensors = _tensors(args)
        device = any(t.is_meta for t in tensors) or not self.simulate
        if not device:
            out = func(*args, **kwargs)
            self._record_host(func, tensors, out)
            return out
        owned, where = self._frames.issuer()
        reals = [self.shadow(t) for t in tensors] if self.simulate else tensors
        assumed = ""
        if all(r is not None for r in reals):
            real_args = tree_map(lambda x: self.shadow(x) if isinstance(x, torch.Tensor) else x,
                                 args) if self.simulate else args
            value = func(*real_args, **kwargs)
        elif func is aten.equal.default:
            value, assumed = True, "equal -> True"
        elif tensors[0].dtype == torch.bool:
            value, assumed = False, "bool -> False"
        else:
            raise UnknownValueError(f"{func} reads a device value {tuple(tensors[0].shape)} "
                                    f"that depends on weights or noise, at {where}")
        read = sum(span_bytes(t) for t in tensors) if func is aten.equal.default else \
            tensors[0].element_size()
        self.ops.append(Op(func.name(), "read", 0, read, 0, 1, True, owned, False,
                           _dtype_name(tensors[0].dtype), (), where, assumed))
        return value

    def _fused(self, func, args: tuple, kwargs: dict) -> torch.Tensor:
        """Attention and rms_norm as the one kernel CUDA runs (output computed without
        recording its math)."""
        if self.simulate:
            args, kwargs = self._place(func, args, kwargs)
        q = args[0]
        attention = func is aten.scaled_dot_product_attention.default
        if attention and q.is_meta and args[2].shape[-1] == q.shape[-1]:
            # the layout CUDA's fused kernels give: like the query's (PyTorch's meta kernel of
            # _scaled_dot_product_flash_attention and FlashAttention's mha_fwd use empty_like)
            out = torch.empty_like(q)
        else:
            out = func(*args, **kwargs)
        owned, where = self._frames.issuer()
        if attention:
            k, v = args[1], args[2]
            mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
            inputs = [q, k, v] + ([mask] if isinstance(mask, torch.Tensor) else [])
            flops = attention_flops(q.shape, k.shape, v.shape)
            name, kind = "fused_attention", "attention"
        else:
            weight = args[2] if len(args) > 2 else kwargs.get("weight")
            inputs = [q] + ([weight] if isinstance(weight, torch.Tensor) else [])
            flops, name, kind = 0, "_fused_rms_norm", "memory"
        host = self.simulate and not out.is_meta
        self.ops.append(Op(name, kind, flops, sum(span_bytes(t) for t in inputs),
                           span_bytes(out), 1, False, owned, host, _dtype_name(q.dtype),
                           tuple(out.shape), where))
        if not host:
            self._allocated(out)
        return out

    def _data_dependent(self, func, args: tuple, kwargs: dict) -> Any:
        """An op whose meta kernel cannot run (its output size depends on data, e.g. nonzero):
        computed on shadows, recorded as a sync."""
        reals = tree_map(lambda x: self._known(x, func) if isinstance(x, torch.Tensor) else x,
                         (args, kwargs))
        real_out = func(*reals[0], **{**reals[1], **({"device": HOST} if "device" in kwargs
                                                      else {})})
        out = tree_map(lambda x: self._twin(x) if isinstance(x, torch.Tensor) else x, real_out)
        self._record(func, args, kwargs, out, sync=True)
        return out

    def _masked(self, data: torch.Tensor, indices: list) -> torch.Tensor:
        """data[indices] where some index is a boolean mask and data's values are unknown (e.g.
        the image rows of a hidden state): the output's size needs only the masks' values, so
        the masks become the integer indices they stand for (their nonzero(), from shadows) and
        the meta kernel runs on those; recorded as the one indexing op it is, a sync."""
        func = aten.index.Tensor
        longs: list = []
        for index in indices:
            if index is not None and index.dtype == torch.bool:
                real = self._known(index, func)
                longs.extend(self._twin(i.contiguous()) for i in real.nonzero().unbind(1))
            else:
                longs.append(index)
        out = func(data, longs)
        self._record(func, (data, indices), {}, out, sync=True)
        return out

    def _propagate(self, func, args: tuple, kwargs: dict, out: Any) -> None:
        """Keep shadows: compute the op on shadows when all its device inputs have one and its
        outputs are small; else forget the shadows of what it wrote."""
        outs = _tensors(out)
        if not outs or not any(t.is_meta for t in outs):
            return
        ins = [t for t in _tensors((args, {k: v for k, v in kwargs.items() if k != "out"}))
               if t.is_meta]
        mutated = self._mutated(func, args, kwargs)
        random = torch.Tag.nondeterministic_seeded in func.tags
        known = (not random and func.overloadpacket not in ALLOCATIONS
                 and all(t.numel() <= SHADOW_LIMIT for t in outs)
                 and all(self.shadow(t) is not None for t in ins))
        if not known:
            for t in mutated:
                self._poisoned.add(storage_key(t))
            return
        for t in _tensors(kwargs.get("out")):
            if self.shadow(t) is None:      # an out= buffer is written whole: a fresh shadow
                self._shadows[t] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
                self._poisoned.discard(storage_key(t))
        real = tree_map(lambda x: self.shadow(x) if isinstance(x, torch.Tensor) else x,
                        (args, kwargs))
        real_kwargs = {**real[1], **({"device": HOST} if "device" in kwargs else {})}
        real_out = func(*real[0], **real_kwargs)
        for twin, value in zip(outs, _tensors(real_out), strict=True):
            if twin.is_meta and not any(twin is m for m in mutated):
                self._shadows[twin] = value

    # Bookkeeping -----------------------------------------------------------------------------
    @staticmethod
    def _mutated(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """Tensors an in-place or out= op writes to (its schema's written arguments)."""
        written: list[torch.Tensor] = []
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = kwargs[arg.name] if arg.name in kwargs else args[i] if i < len(args) else None
            written += _tensors(value)
        return written

    def _record(self, func, args: tuple, kwargs: dict, out: Any, sync: bool = False) -> None:
        outs = _tensors(out)
        ins = _tensors((args, {k: v for k, v in kwargs.items() if k != "out"}))
        device = (not self.simulate or any(t.is_meta for t in ins + outs)
                  or torch.device(kwargs.get("device") or HOST) == META)
        if not device:
            self._record_host(func, ins, out)
            return
        packet = func.overloadpacket
        mutated = self._mutated(func, args, kwargs)
        in_keys = {storage_key(t) for t in ins}
        view = not mutated and bool(outs) and all(storage_key(o) in in_keys for o in outs)
        if packet in ALLOCATIONS:
            kind, launches = "alloc", 0
        elif view or not outs:
            kind, launches = "view", 0
        else:
            kind = ("matmul" if packet in MATMUL_OPS else "conv" if packet in CONV_OPS
                    else "memory")
            launches = 1
        read = written = flops = 0
        if launches:
            sources = [t for t in _distinct(ins)
                       if not (packet in WRITE_ONLY and t is args[0])]
            out_elems = sum(o.numel() for o in outs)
            for t in sources:
                size = span_bytes(t)
                if packet in GATHERS and t is args[0]:
                    size = min(size, out_elems * t.element_size())
                read += size
            written = sum(span_bytes(o) for o in _distinct(outs))
            if packet in flop_counter.flop_registry:
                flops = int(flop_counter.flop_registry[packet](*args, **kwargs, out_val=out))
        owned, where = self._frames.issuer()
        first = ins[0] if ins else outs[0] if outs else None
        self.ops.append(Op(func.name(), kind, flops, read, written, launches, sync, owned, False,
                           _dtype_name(first.dtype) if first is not None else "",
                           tuple(outs[0].shape) if outs else (), where))
        if launches or kind == "alloc":
            for o in outs:
                if not any(o is m for m in mutated):
                    self._allocated(o)

    def _record_host(self, func, ins: list[torch.Tensor], out: Any) -> None:
        outs = _tensors(out)
        self._host_made.update(storage_key(o) for o in outs)
        first = ins[0] if ins else outs[0] if outs else None
        owned, where = self._frames.issuer()
        self.ops.append(Op(func.name(), "memory", toma=owned, host=True,
                           dtype=_dtype_name(first.dtype) if first is not None else "",
                           shape=tuple(outs[0].shape) if outs else (), where=where))

    def _record_copy(self, func, src: torch.Tensor, dst: torch.Tensor,
                     blocking: bool = True) -> None:
        owned, where = self._frames.issuer()
        self.ops.append(Op(func.name(), "copy", 0, span_bytes(src), span_bytes(dst), 1,
                           blocking, owned, False, _dtype_name(src.dtype), tuple(dst.shape),
                           where))

    def _allocated(self, t: torch.Tensor) -> None:
        """Count t's storage as live device memory from now until it is freed."""
        if not self._tracking or (self.simulate and not t.is_meta):
            return
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._live:
            return
        self._poisoned.discard(key)
        self._live[key] = storage.nbytes()
        self.live_bytes += storage.nbytes()
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._finalizers.append(weakref.finalize(storage, self._freed, key))

    def _freed(self, key: int) -> None:
        if self._tracking:
            self.live_bytes -= self._live.pop(key, 0)

    def close(self, output: Any = None) -> None:
        """Stop tracking memory; kept_bytes = device bytes allocated during the call and still
        alive now (after a garbage collection), the storages of `output` left out."""
        gc.collect()
        skip = {storage_key(t) for t in _tensors(output)}
        self.kept_bytes = sum(n for key, n in self._live.items() if key not in skip)
        self._tracking = False
        for fin in self._finalizers:
            fin.detach()
        self._finalizers.clear()


def _distinct(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors with the same storage, offset, sizes and strides counted once."""
    seen: set[tuple] = set()
    out = []
    for t in tensors:
        key = (storage_key(t), t.storage_offset(), tuple(t.shape), t.stride())
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out
