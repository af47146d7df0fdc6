from . import functional  # noqa: F401
from .functional import InterpolationMode  # noqa: F401


class ToTensor:
    def __call__(self, pic):
        import numpy as np
        import torch
        a = np.asarray(pic, dtype=np.float32) / 255.0
        if a.ndim == 2:
            a = a[:, :, None]
        return torch.from_numpy(a).permute(2, 0, 1).contiguous()

class ToPILImage:
    def __call__(self, t):
        from PIL import Image
        a = (t.detach().cpu().clamp(0, 1) * 255).byte().permute(1, 2, 0).numpy()
        return Image.fromarray(a[:, :, 0] if a.shape[2] == 1 else a)


class _Unavailable:
    """A transform the tests never call (imported at module level by other node packs)."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"torchvision stub: {type(self).__name__}")


class Resize(_Unavailable):
    pass


class CenterCrop(_Unavailable):
    pass


class Compose(_Unavailable):
    pass


class Normalize(_Unavailable):
    pass
