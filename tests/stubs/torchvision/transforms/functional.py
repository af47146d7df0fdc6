import enum

import torch.nn.functional as F


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"

def resize(img, size, interpolation=None, **kw):
    mode = getattr(interpolation, "value", interpolation) or "bilinear"
    if isinstance(size, int):
        size = [size, size]
    return F.interpolate(img, size=list(size), mode=mode)

def rotate(*a, **k):
    raise NotImplementedError("torchvision stub: rotate")

def normalize(tensor, mean, std, inplace=False):
    import torch
    mean = torch.as_tensor(mean, dtype=tensor.dtype, device=tensor.device).view(-1, 1, 1)
    std = torch.as_tensor(std, dtype=tensor.dtype, device=tensor.device).view(-1, 1, 1)
    return tensor.sub_(mean).div_(std) if inplace else (tensor - mean) / std


def pil_to_tensor(*a, **k):
    raise NotImplementedError("torchvision stub: pil_to_tensor")
