"""Other nodes that change a diffusion transformer's blocks from outside the "dit" patches, seen
on the host once per run: a replaced block list (First Block Cache's CachedTransformerBlocks
calls the blocks as modules, past ToMA's replace patches) or a patched self-attention module
(which may read tokens as whole frames, as KJNodes' Enhance-A-Video does; cross-attention and
feed-forward patches work token by token). Those calls or blocks run unmerged, and the user is
told which node did it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

# Child modules of a block that hold its self-attention, by the names ComfyUI's families use.
SELF_ATTENTION = ("self_attn", "attn1", "attn", "attention", "img_attn", "txt_attn")


def owner(fn: object) -> str:
    """Who a patch function (or class) comes from, for a message: the node pack's folder and
    the function's own name, e.g. "ComfyUI-KJNodes (<class>.__get__)"."""
    fn = getattr(fn, "__func__", fn)
    module = str(getattr(fn, "__module__", None) or type(fn).__module__)
    name = str(getattr(fn, "__qualname__", None) or type(fn).__qualname__)
    return f"{pack_of(module)} ({name.split('.<locals>.')[0]})"


def pack_of(module: str) -> str:
    """The node pack folder a module name comes from: ComfyUI imports a custom node folder
    under its path, dots written "_x_" ("/ComfyUI/custom_nodes/ComfyUI-KJNodes.nodes.x"), or
    under its folder's name."""
    top = module.removeprefix("custom_nodes.").split(".")[0].replace("\\", "/").rstrip("/")
    return top.rsplit("/", 1)[-1].replace("_x_", ".")


def unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    """The module a torch.compile wrapper (OptimizedModule, swapped in per block by compile
    nodes) runs."""
    return getattr(module, "_orig_mod", module)


def replaced_blocks(blocks: Iterable[torch.nn.Module], depth: int, block_type: type) -> str | None:
    """Who replaced a family's block list when it no longer holds `depth` blocks of
    `block_type` (compiled ones count as theirs); None when it does."""
    found = [unwrapped(block) for block in blocks]
    strangers = [block for block in found if type(block) is not block_type]
    if len(found) == depth and not strangers:
        return None
    return owner(type(strangers[0]) if strangers else type(found[0]) if found else blocks)


def patched_self_attention(block: torch.nn.Module) -> str | None:
    """Who patched the forward of one of the block's self-attention modules (an object patch is
    an instance attribute `forward`), None when nobody did."""
    block = unwrapped(block)
    for name in SELF_ATTENTION:
        child = getattr(block, name, None)
        if isinstance(child, torch.nn.Module) and "forward" in vars(child):
            return owner(vars(child)["forward"])
    return None
