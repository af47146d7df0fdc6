"""Other nodes' patches that look inside a UNet transformer block, seen at the block's call.

ComfyUI hands every BasicTransformerBlock its patches in `transformer_options`; ToMA reads them
there on each call, so patches added by nodes after ToMA, or only for one model call (PAG adds
its self-attention replacement inside its own guidance call), are seen too.

What ToMA does about each kind (unet_patch.py acts on it):

- attn1/attn2 patches, attn1/attn2 output patches, middle_patch, attn2 replacements, and another
  pack's patch of the block's forward: they see the block's tokens. `block` scope would hand
  them merged tokens, which breaks patches that read the token grid from the sequence length
  (masked IPAdapter, regional prompting, attention couple). `auto` uses attention scope for such
  blocks (ToMA merges after every other attn1 patch and unmerges before every attn1 output patch,
  so they all see the full grid); an explicit `block` keeps block scope and says that they see
  merged tokens.
- An attn1 replacement (SelfAttentionGuidance records its attention map there, PAG swaps
  self-attention) receives the projected queries, keys and values: ToMA leaves that block
  unmerged in every scope.
- ComfyUI's TomePatchModel merges queries itself at full latent resolution and derives its grid
  from the sequence length: ToMA leaves that level to it in every scope.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# The patch lists ComfyUI runs inside BasicTransformerBlock.forward (in this order of use).
IN_BLOCK_PATCHES = ("attn1_patch", "attn1_output_patch", "middle_patch", "attn2_patch",
                    "attn2_output_patch")
# Those ComfyUI's transformer families call inside their blocks (self- and cross-attention):
# middle and cross-attention output patches are the UNet's alone.
DIT_IN_BLOCK_PATCHES = ("attn1_patch", "attn1_output_patch", "attn2_patch")
# Marks ToMA's own functions (block forwards, per-call attn1 pair): a second ToMA node is no
# neighbour to stand aside for; it sees merged tokens and leaves them alone itself.
TOMA_MARK = "_toma_patch"


def mark(fn: Callable) -> Callable:
    """Mark `fn` as one of ToMA's own patch functions; returns it."""
    setattr(fn, TOMA_MARK, True)
    return fn


def is_toma(fn: object) -> bool:
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


def _name(fn: object) -> str:
    return str(getattr(fn, "__qualname__", None) or type(fn).__name__).split(".<locals>.")[-1]


@dataclass(frozen=True)
class Neighbours:
    """What other nodes do inside one transformer block call."""

    patches: tuple[str, ...] = ()      # kinds of other nodes' in-block patches (for messages)
    attn1_replace: str | None = None   # name of the function replacing this block's attn1
    tome: bool = False                 # ComfyUI's TomePatchModel is among the attn1 patches

    @property
    def in_block(self) -> bool:
        return bool(self.patches)


NONE = Neighbours()


def neighbours(options: dict, foreign_forward: bool) -> Neighbours:
    """Other nodes' patches in this block call's transformer_options.

    foreign_forward: another pack's patch of this block's forward runs inside ToMA's.
    """
    patches = options.get("patches") or {}
    busy = foreign_forward or bool(options.get("patches_replace"))
    for kind in IN_BLOCK_PATCHES:
        busy = busy or bool(patches.get(kind))
    if not busy:
        return NONE       # the usual block: decided without a further Python call
    # ComfyUI's ToMe is known: it acts only where the sequence is longer than half the latent's
    # pixels, i.e. at full resolution, which ToMA leaves to it; elsewhere merged tokens are fine.
    kinds = in_block_patches(options)
    if _replacement(options, "attn2") is not None:
        kinds.append("attn2 replacement")
    if foreign_forward:
        kinds.append("forward")
    tome = any(is_comfy_tome(p) for p in patches.get("attn1_patch", ()))
    return Neighbours(tuple(kinds), _replacement(options, "attn1"), tome)


def _replacement(options: dict, kind: str) -> str | None:
    """Name of the `kind` ("attn1"/"attn2") replacement ComfyUI will use in this block, if any
    and not ToMA's own size-weighted attention (it looks up (block name, block id, index in the
    SpatialTransformer), then (name, id))."""
    replaces = (options.get("patches_replace") or {}).get(kind) or {}
    block = options.get("block")
    if not replaces or block is None:
        return None
    block = tuple(block)
    fn = replaces.get((*block, options.get("block_index", 0)), replaces.get(block))
    return None if fn is None or is_toma(fn) else _name(fn)
