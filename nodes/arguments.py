"""The arguments of a call ComfyUI wraps (its WrapperExecutor), by name: the one binder of the
host-side wrappers. A function's signature is read once, not at every call."""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable


@functools.lru_cache(maxsize=64)
def _positional(function: Callable) -> tuple[str, ...]:
    """Names of the parameters of `function` that can be passed by position, in order."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(name for name, param in inspect.signature(function).parameters.items()
                 if param.kind in kinds)


def positional(executor) -> tuple[str, ...]:
    """_positional of what `executor` wraps (executor.original; a bound method without its
    self), () where it has no signature. Plain functions (a bound method's included) are read
    once; other callables each time (uncached), so that none is kept alive here."""
    original = executor.original
    function = getattr(original, "__func__", None)
    try:
        if isinstance(function, types.FunctionType):
            return _positional(function)[1:]
        plain = isinstance(original, types.FunctionType)
        return (_positional if plain else _positional.__wrapped__)(original)
    except (TypeError, ValueError):
        return ()


def call_arguments(executor, args: tuple, kwargs: dict) -> dict:
    """The arguments of a wrapped call by parameter name, however ComfyUI passed them
    (positionally or by keyword); what went to the function's **kwargs included."""
    # fewer names than arguments: the rest went to the function's *args
    return {**dict(zip(positional(executor), args, strict=False)), **kwargs}


def with_argument(executor, args: tuple, kwargs: dict, name: str,
                  value: object) -> tuple[tuple, dict]:
    """(args, kwargs) of the same wrapped call with argument `name` set to `value`, where it was
    passed (by keyword when it was not passed at all)."""
    names = positional(executor)
    i = names.index(name) if name in names else len(args)
    if name not in kwargs and i < len(args):
        return (*args[:i], value, *args[i + 1:]), kwargs
    return args, {**kwargs, name: value}
