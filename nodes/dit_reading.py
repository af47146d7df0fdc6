"""What one ToMA node reads of a diffusion transformer: once, when the node patches the model
(its blocks, which of them merge and in which groups: `read_model`), and on the host before
every model call (`DiTReading`, the per-call hook the node's state is built with). dit_patch.py
installs and runs the blocks' patches on what these decided."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .dit_families import Family
from .dit_neighbours import patched_self_attention, replaced_blocks, unwrapped
from .forward_patches import module_at
from .model_call import ModelCall
from .options import ToMAOptions
from .prefix_cache import open_prefix
from .sequence_parallel import RAYLIGHT


def dit_patches(arguments: dict) -> dict:
    """The "dit" replace patches in the transformer_options of a model call's arguments (or of
    a ModelPatcher's model_options)."""
    return ((arguments.get("transformer_options") or {}).get("patches_replace")
            or {}).get("dit") or {}


def existing_replace(model, block_kind: str, index: int) -> Callable | None:
    """Another pack's "dit" replace patch for (block_kind, index) on this ModelPatcher, if any."""
    return dit_patches(model.model_options).get((block_kind, index))


@dataclass
class DiTReading:
    """One ToMA node's reading of a diffusion transformer, and its per-call hook (__call__).

    depths: kind key -> its number of blocks; groups: (kind key, block index) -> first index of
    its group, merged blocks only; block_types: kind key -> its block class (for `neighbours`);
    prefix_layers: those whose prompt keys and values the node keeps (family.prefix_cache), None
    where another pack's patch is in the way; patches: the node's "dit" replace patch of each
    block (filled at install); aside: why blocks ToMA wraps unmerged (family.foreign_block)."""

    family: Family
    depths: dict[str, int]
    groups: dict[tuple[str, int], int]
    block_types: dict[str, type]
    prefix_layers: list[torch.nn.Module] | None = None
    patches: dict[tuple[str, int], Callable] = field(default_factory=dict)
    aside: tuple[str, ...] = ()

    def __call__(self, call: ModelCall, base_model, arguments: dict) -> list[str]:
        """The family's describe, then what other nodes do to the blocks (dit_neighbours), then
        (families with a prompt cache) whether this call keeps the prompt's keys and values.
        Returns what the run's notes should say."""
        family = self.family
        why = family.describe(call, base_model, arguments) if family.describe else None
        replaced, patched = self.neighbours(call, getattr(base_model, "diffusion_model", None))
        if replaced:
            call.mergeable = False
            return [f"{replaced} replaces {family.label}'s blocks with its own while it runs, "
                    f"so ToMA's block patches cannot merge them: those model calls run unmerged"]
        notes = []
        if patched and call.shard is not None:
            # raylight's sequence-parallel attention, which the shard's blocks need
            patched = {key: who for key, who in patched.items()
                       if not who.startswith(f"{RAYLIGHT} ")}
        if patched:
            call.foreign_attention = tuple(sorted(patched))
            notes.append(f"{', '.join(sorted(set(patched.values())))} patches the "
                         f"self-attention of {family.label} blocks, which may read their tokens "
                         f"as whole frames or by position: those {len(patched)} blocks run "
                         f"unmerged")
        displaced = self.displaced(call, arguments) if family.foreign_block else None
        why_not = self.keeps_prompt(call, arguments) if family.prefix_cache else None
        return [note for note in (*notes, displaced, why or why_not) if note]

    def keeps_prompt(self, call: ModelCall, arguments: dict) -> str | None:
        """Open this call's kept prompt (prefix_cache.open_prefix) while the node's patch is
        still in every layer and the model is not compiled without guards; else why not."""
        label = self.family.label
        replaced = dit_patches(arguments)
        if self.prefix_layers is None or any(replaced.get(key) is not patch for key, patch
                                             in self.patches.items()):
            return (f"another node patches {label}'s blocks too, so ToMA cannot keep the "
                    f"prompt's keys and values across steps: {label} recomputes them at every "
                    f"step")
        if call.run.compiled_without_guards:
            return (f"under TorchCompileModel ToMA cannot keep {label}'s prompt keys and values "
                    f"across steps (the compiled model would replay the first step's way): "
                    f"{label} recomputes them at every step")
        open_prefix(call, len(self.prefix_layers))
        return None

    def displaced(self, call: ModelCall, arguments: dict) -> str | None:
        """Why some blocks run without ToMA: another node's patch the family cannot merge
        with (family.foreign_block) took the place of ToMA's, that node applied after ToMA.
        Read once per run and patch table."""
        replaced = dit_patches(arguments)
        key = ("displaced", id(replaced))
        if key not in call.run.host_reads:
            whys = [self.family.foreign_block(other) for block, patch in self.patches.items()
                    if (other := replaced.get(block)) is not None and other is not patch]
            whys = [why for why in whys if why]
            call.run.host_reads[key] = None if not whys else (
                f"{whys[0]}; that node, applied after ToMA, replaced ToMA's patch of "
                f"{len(whys)} {self.family.label} blocks: those run without ToMA")
        return call.run.host_reads[key]

    def neighbours(self, call: ModelCall, diffusion_model) -> tuple[str | None, dict]:
        """(who replaced the model's blocks, or None; {(kind key, index): who patched that
        merged block's self-attention}), read once per run and model object."""
        key = ("dit_neighbours", id(diffusion_model))
        found = call.run.host_reads.get(key)
        if found is None:
            found = (None, {})
            if diffusion_model is not None:
                for kind in self.family.kinds:
                    blocks = module_at(diffusion_model, kind.modules)
                    replaced = replaced_blocks(blocks, self.depths[kind.key],
                                               self.block_types[kind.key])
                    if replaced:
                        found = (replaced, {})
                        break
                    for i, block in enumerate(blocks):
                        who = (kind.key, i) in self.groups and patched_self_attention(block)
                        if who:
                            found[1][(kind.key, i)] = who
            call.run.host_reads[key] = found
        return found


def read_model(model, options: ToMAOptions, family: Family) -> DiTReading:
    """The reading of a cloned ModelPatcher `model` of `family` for a node with `options`.

    Raises ValueError (shown by the node) for skip_blocks past the model's depth.
    """
    diffusion_model = model.get_model_object("diffusion_model")
    lists = {kind.key: module_at(diffusion_model, kind.modules) for kind in family.kinds}
    depths = {key: len(blocks) for key, blocks in lists.items()}
    skipped = options.skip_blocks.for_kinds([(k.letter, depths[k.key]) for k in family.kinds])
    # (kind key, index) -> why, for blocks holding another node's "dit" replace patch the family
    # cannot merge with (family.foreign_block): ToMA wraps it there unmerged
    aside: dict[tuple[str, int], str] = {}
    groups: dict[tuple[str, int], int] = {}
    for kind, skip in zip(family.kinds, skipped, strict=True):
        start = None        # the first index of the current run of merged blocks
        for i in range(depths[kind.key]):
            previous = (existing_replace(model, kind.key, i)
                        if kind.hook == "dit" and family.foreign_block else None)
            why = family.foreign_block(previous) if previous is not None else None
            if why:
                aside[(kind.key, i)] = why
            if why or i in skip:
                start = None
            else:
                start = i if start is None else start
                groups[(kind.key, i)] = start
    block_types = {key: type(unwrapped(found[0])) if found else type(None)
                   for key, found in lists.items()}
    reading = DiTReading(family, depths, groups, block_types,
                         aside=tuple(dict.fromkeys(aside.values())))
    if family.prefix_cache:
        kind = family.kinds[0]
        if all(existing_replace(model, kind.key, i) is None for i in range(depths[kind.key])):
            reading.prefix_layers = list(lists[kind.key])
    return reading
