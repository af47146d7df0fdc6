"""SD3 / SD3.5 (MMDiT): one kind of block with text and image in two streams; positions are
added once before the blocks (no positional rows to gather)."""

from __future__ import annotations

from ..contracts import Contract
from ..dit_families import BlockKind, Family, TextAt, describe_plain

MODELS = "SD3/SD3.5"

KINDS = (BlockKind("double_block", "joint_blocks", "", TextAt.BEFORE, pe=None),)


CONTRACT = Contract(
    "SD3",
    models={"comfy.ldm.modules.diffusionmodules.mmdit:OpenAISignatureMMDITWrapper": ()},
    blocks={"joint_blocks": ()},
    kinds=KINDS,
)


def description(patch: tuple[int, int, int]) -> Family:
    return Family("sd3", "SD3", KINDS, patch, describe_plain(patch))
