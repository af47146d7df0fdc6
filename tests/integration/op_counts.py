"""Counting what a GPU would pay for, on the CPU: aten ops, kernel launches and host syncs per
model call.

A TorchDispatchMode sees every aten op a model call dispatches (views included: each is a
Python-to-C++ round trip in eager mode; kernels launch for the others). `OpCounter.install`
adds an APPLY_MODEL wrapper to a ModelPatcher *before* ToMA is applied, so it is the outermost
wrapper and ToMA's own wrapper (its per-call decisions, the family's reading of the inputs) runs
inside the count too.

Host syncs are the ops that make the host wait for the device on a GPU: reading a value back
(`_local_scalar_dense`: .item(), int(t), bool(t), `if t.any()`), data-dependent shapes (nonzero,
unique, masked_select, boolean-mask indexing, repeat_interleave with tensor repeats and no
output size), `equal`, and tensors made from Python data (`lift_fresh`: torch.tensor(...) on a
GPU is a host-to-device copy that waits for the stream). `.tolist()` and device copies are not
visible to a dispatch mode on the CPU; torch.compile's graph-break check catches .tolist() and
.item() in code it traces.

Kernel launches: bench/shared/host_counts.py says which ops launch one; it also counts Python
function calls (PerCall).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.shared.host_counts import launches

SYNC_OPS = ("_local_scalar_dense", "nonzero", "equal", "is_nonzero", "item", "_unique",
            "_unique2", "unique_dim", "unique_consecutive", "masked_select", "lift_fresh")


def is_sync(func, args: tuple, kwargs: dict) -> str | None:
    """The sync an op call stands for (its name), or None."""
    name = func.overloadpacket.__name__
    if name in SYNC_OPS:
        return name
    if name == "repeat_interleave" and torch.is_tensor(args[1] if len(args) > 1 else None) \
            and kwargs.get("output_size") is None:
        return "repeat_interleave (tensor repeats)"
    if name in ("index", "index_put", "index_put_"):
        indices = args[1] if len(args) > 1 else ()
        if any(torch.is_tensor(i) and i.dtype == torch.bool for i in indices or ()):
            return f"{name} (boolean mask)"
    return None


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.syncs: Counter = Counter()
        self.launches = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops[func.overloadpacket.__name__] += 1
        self.launches += launches(func)
        sync = is_sync(func, args, kwargs)
        if sync is not None:
            self.syncs[sync] += 1
        return func(*args, **kwargs)


class OpCounter:
    """Per model call: ops (Counter by op name) and syncs (Counter by kind), in call order."""

    KEY = "test_op_counter"

    def __init__(self) -> None:
        self.ops: list[Counter] = []
        self.syncs: list[Counter] = []
        self.launches: list[int] = []

    def install(self, patcher) -> None:
        """Count every model call of `patcher` (and of clones made from it afterwards)."""
        from comfy.patcher_extension import WrappersMP

        patcher.add_wrapper_with_key(WrappersMP.APPLY_MODEL, self.KEY, self._wrapper())

    def _wrapper(self) -> Callable:
        ops, syncs, launched = self.ops, self.syncs, self.launches

        def count(executor, *args, **kwargs):
            mode = _Count()
            with mode:
                out = executor(*args, **kwargs)
            ops.append(mode.ops)
            syncs.append(mode.syncs)
            launched.append(mode.launches)
            return out

        return count

    def totals(self) -> list[int]:
        """Aten ops of each model call."""
        return [sum(c.values()) for c in self.ops]

