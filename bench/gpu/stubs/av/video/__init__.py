"""Part of the PyAV stand-in (see av/__init__.py)."""
