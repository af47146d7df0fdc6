"""Minimal CPU-test stand-in for torchaudio (torchaudio 2.11.1 from PyPI is CUDA-linked:
`libc10_cuda.so: cannot open shared object file`). ComfyUI >= ~v0.10 imports torchaudio at module
level from comfy/sd.py (comfy.ldm.lightricks.vae.audio_vae), so core cannot import without it.
Audio functionality itself is not provided: calls raise NotImplementedError."""
__version__ = "0.0.0-stub"
from . import functional, transforms  # noqa: F401


def load(*a, **k):
    raise NotImplementedError("torchaudio stub: load")

def save(*a, **k):
    raise NotImplementedError("torchaudio stub: save")
