"""A stand-in for PyAV on the lent GPU machine, where the real one does not travel (bench/gpu/
run.sh puts this on the path only where `import av` fails): ComfyUI's comfy_api.latest imports
PyAV for its video types, and with it every V3 node (EasyCache among them) that the bench runs.
It holds the names those modules read when they import; using any of them raises."""


class _AnyAttribute(type):
    """Class attributes (enum members such as ColorTrc.ARIB_STD_B67) are Unavailable too."""

    def __getattr__(cls, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return Unavailable


class Unavailable(metaclass=_AnyAttribute):
    """Any PyAV class, enum or function: importable, never usable."""

    def __init__(self, *args, **kwargs) -> None:
        raise RuntimeError("PyAV is not installed here (bench/gpu/stubs stands in for it)")

    @classmethod
    def from_ndarray(cls, *args, **kwargs):
        return cls(*args, **kwargs)


def open(*args, **kwargs):
    raise RuntimeError("PyAV is not installed here (bench/gpu/stubs stands in for it)")


def __getattr__(name: str) -> type:
    if name.startswith("__"):
        raise AttributeError(name)
    return Unavailable
