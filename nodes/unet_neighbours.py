"""Other nodes' patches that look inside a UNet transformer block, read from the block's
`transformer_options` at each call (so patches added after ToMA, or for one model call only like
PAG's, are seen too). What unet_patch.py does about them:

- attn1/attn2 patches and output patches, middle_patch, attn2 replacements and another pack's
  patch of the block's forward may read the token grid from the sequence length (masked
  IPAdapter, regional prompting, attention couple): `auto` uses attention scope there (ToMA
  merges after every other attn1 patch and unmerges before every attn1 output patch), an explicit
  `block` keeps block scope and says so.
- An attn1 replacement (SelfAttentionGuidance, PAG) gets the projected queries, keys and values:
  that block runs unmerged.
- ComfyUI's TomePatchModel merges the full-resolution level itself: ToMA leaves it to it.
"""

from __future__ import annotations

from collections.abc import Callable

# The patch lists ComfyUI runs inside BasicTransformerBlock.forward (in this order of use).
IN_BLOCK_PATCHES = ("attn1_patch", "attn1_output_patch", "middle_patch", "attn2_patch",
                    "attn2_output_patch")
# Those ComfyUI's transformer families call inside their blocks (self- and cross-attention):
# middle and cross-attention output patches are the UNet's alone.
DIT_IN_BLOCK_PATCHES = ("attn1_patch", "attn1_output_patch", "attn2_patch")
# Marks ToMA's own functions (True; a UNet block forward's mark is its UNetToMA): a second ToMA
# node is no neighbour to stand aside for; it sees merged tokens and leaves them alone itself.
TOMA_MARK = "_toma_patch"


def mark(fn: Callable) -> Callable:
    """Mark `fn` as one of ToMA's own patch functions; returns it."""
    setattr(fn, TOMA_MARK, True)
    return fn


def is_toma(fn: object) -> bool:
    """Whether `fn` is one of ToMA's own patch functions."""
    return bool(getattr(fn, TOMA_MARK, False))


def is_comfy_tome(fn: object) -> bool:
    """One of ComfyUI's own TomePatchModel attn1 patches (comfy_extras/nodes_tomesd.py, every
    version). The module is "comfy_extras.nodes_tomesd" when imported as a package and
    "nodes_tomesd" when ComfyUI loads its extras by file."""
    return (getattr(fn, "__name__", "") in ("tomesd_m", "tomesd_u")
            and str(getattr(fn, "__module__", "")).endswith("nodes_tomesd"))


def in_block_patches(options: dict, kinds_run: tuple[str, ...] = IN_BLOCK_PATCHES) -> list[str]:
    """Kinds of other nodes' patches that ComfyUI runs inside a block in this call (ToMA's own
    and ComfyUI's TomePatchModel aside), from the block's transformer_options; `kinds_run`:
    the kinds these blocks call."""
    patches = options.get("patches") or {}
    kinds = []
    for kind in kinds_run:
        for p in patches.get(kind, ()):     # loops, not generators: this runs for every block
            if not (is_toma(p) or is_comfy_tome(p)):
                kinds.append(kind)
                break
    return kinds


def replacement(options: dict, kind: str) -> str | None:
    """Name of the `kind` ("attn1"/"attn2") replacement ComfyUI will use in this block, if any
    and not ToMA's own size-weighted attention (it looks up (block name, block id, index in the
    SpatialTransformer), then (name, id))."""
    replaces = (options.get("patches_replace") or {}).get(kind) or {}
    block = options.get("block")
    if not replaces or block is None:
        return None
    block = tuple(block)
    fn = replaces.get((*block, options.get("block_index", 0)), replaces.get(block))
    if fn is None or is_toma(fn):
        return None
    return str(getattr(fn, "__qualname__", None) or type(fn).__name__).split(".<locals>.")[-1]
