"""What a model call asks of the host, counted: kernel launches and Python function calls.

Both are the same at every run of the same graph, where times are not, so tests hold them and
bench/speed/host_cost.py reports them beside the times.

- Kernel launches: the aten ops that run a kernel, seen by a TorchDispatchMode: all but views
  (`func.is_view`) and the ops that only allocate or alias (LAUNCHLESS).
- Python function calls: the interpreter's "call" events (sys.setprofile). Counted on a model
  call of their own: a dispatch mode's own Python would count too.

Both install as an APPLY_MODEL wrapper on a ModelPatcher before ToMA is applied, so they are
outermost and ToMA's own wrapper counts too.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from torch.utils._python_dispatch import TorchDispatchMode

# Aten ops that launch no kernel though they are no views: allocation and aliasing.
LAUNCHLESS = ("empty", "empty_strided", "empty_like", "detach", "alias", "lift_fresh",
              "_unsafe_view")


def launches(func) -> bool:
    """Whether aten op `func` runs a kernel on a GPU."""
    return not func.is_view and func.overloadpacket.__name__ not in LAUNCHLESS


class LaunchCount(TorchDispatchMode):
    """Kernel launches dispatched inside the mode (`count`)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += launches(func)
        return func(*args, **(kwargs or {}))


class PerCall:
    """Per model call of a ModelPatcher (and of clones made from it afterwards): one count
    each, in call order, in `counts`. kind "launches" or "python"."""

    def __init__(self, kind: str) -> None:
        if kind not in ("launches", "python"):
            raise ValueError(f"kind must be 'launches' or 'python', got {kind!r}")
        self.kind = kind
        self.counts: list[int] = []

    def install(self, patcher) -> None:
        from comfy.patcher_extension import WrappersMP

        patcher.add_wrapper_with_key(WrappersMP.APPLY_MODEL, f"host_counts_{self.kind}",
                                     self._wrapper())

    def _wrapper(self) -> Callable:
        counts = self.counts
        if self.kind == "launches":
            def count(executor, *args, **kwargs):
                mode = LaunchCount()
                try:
                    with mode:
                        return executor(*args, **kwargs)
                finally:
                    counts.append(mode.count)

            return count

        def count_python(executor, *args, **kwargs):
            seen = [0]

            def profile(frame, event, arg):
                if event == "call":
                    seen[0] += 1

            previous = sys.getprofile()
            sys.setprofile(profile)
            try:
                return executor(*args, **kwargs)
            finally:
                sys.setprofile(previous)
                counts.append(seen[0])

        return count_python
