"""SD3 / SD3.5 (MMDiT): one kind of block with text and image in two streams; positions are
added once before the blocks (no positional rows to gather)."""

from __future__ import annotations

from ..dit_families import BlockKind, Family, describe_plain

# the models of this family, as the node's error and the README name them
MODELS = "SD3/SD3.5"

KINDS = (BlockKind("double_block", "joint_blocks", "", "before", pe=None),)


def family(diffusion_model) -> Family | None:
    from comfy.ldm.modules.diffusionmodules.mmdit import OpenAISignatureMMDITWrapper

    if type(diffusion_model) is not OpenAISignatureMMDITWrapper:
        return None
    patch = (1, int(diffusion_model.patch_size), int(diffusion_model.patch_size))
    return description(patch, describe_plain(patch))


def description(patch: tuple[int, int, int], describe=None) -> Family:
    """SD3's Family (benchmarks call blocks without a model call to describe)."""
    return Family("sd3", "SD3", KINDS, patch, describe)
