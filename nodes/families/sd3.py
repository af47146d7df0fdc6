"""SD3 / SD3.5 (MMDiT): one kind of block with text and image in two streams; positions are
added once before the blocks (no positional rows to gather)."""

from __future__ import annotations

from ..contracts import Contract, Hands
from ..dit_families import BlockKind, Family, TextAt, describe_plain

# the models of this family, as the node's error and the README name them
MODELS = "SD3/SD3.5"

KINDS = (BlockKind("double_block", "joint_blocks", "", TextAt.BEFORE, pe=None),)

MMDIT = "comfy.ldm.modules.diffusionmodules.mmdit:OpenAISignatureMMDITWrapper"

CONTRACT = Contract(
    "SD3",
    models={MMDIT: (Hands(MMDIT, KINDS[0].key, KINDS[0].arguments),)},
    blocks={"joint_blocks": ()},
)


def family(diffusion_model) -> Family:
    """The Family of a model of this family's classes (families.family_of checked it)."""
    patch = (1, int(diffusion_model.patch_size), int(diffusion_model.patch_size))
    return description(patch, describe_plain(patch))


def description(patch: tuple[int, int, int], describe=None) -> Family:
    """SD3's Family (benchmarks call blocks without a model call to describe)."""
    return Family("sd3", "SD3", KINDS, patch, describe)
