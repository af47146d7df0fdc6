"""Part of the PyAV stand-in (see av/__init__.py)."""

from av import __getattr__  # noqa: F401 (every name is av.Unavailable)
