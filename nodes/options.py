"""The nodes' settings as one validated value, and the `skip_blocks` notation.

Every check names the widget it is about: ComfyUI shows the message to the user as is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..toma_core import BATCH_POLICIES, REGION_MODES, UNMERGE_METHODS

MERGE_SCOPES: tuple[str, ...] = ("auto", "block", "attention")
UNET_LEVELS: tuple[str, ...] = ("auto", "all", "largest")
MAX_RATIO = 0.9
MAX_TILE_COUNT = 4096
DEFAULT_SKIP_BLOCKS = "d0-4, s0-4"
# Block indices above this are refused while parsing, before a range becomes a set (a shared
# workflow's "d0-99999999999" would fill memory); for_kinds holds them to the model's depth.
MAX_BLOCK_INDEX = 999


@dataclass(frozen=True)
class SkipBlocks:
    """Blocks left unmerged: indices of double and of single blocks, and indices written
    without a letter (models with one kind of block)."""

    double: frozenset[int]
    single: frozenset[int]
    plain: frozenset[int] = frozenset()

    def for_kinds(self, kinds: list[tuple[str, int]]) -> list[frozenset[int]]:
        """The skipped indices of each block kind of a model, given as (letter, depth) pairs:
        [("d", doubles), ("s", singles)], or [("", blocks)] for one kind of block. A model with
        one kind of block (any other kind empty) takes "d", "s" and bare indices all as naming
        its blocks, so the default "d0-4, s0-4" leaves its blocks 0-4 alone. Raises ValueError for
        indices past the depth or a notation the model cannot have."""
        present = [(letter, depth) for letter, depth in kinds if depth > 0]
        if len(present) <= 1:
            letter, depth = present[0] if present else ("", 0)
            picked = self.plain | self.double | self.single
            _refuse_past_depth("", "blocks", picked, depth)
            return [picked if name == letter else frozenset() for name, _ in kinds]
        if self.plain:
            raise ValueError(f"skip_blocks: this model has double and single blocks; write "
                             f"d<i> or s<i>, e.g. {DEFAULT_SKIP_BLOCKS!r}")
        depths = dict(kinds)
        _refuse_past_depth("d", "double blocks", self.double, depths.get("d", 0))
        _refuse_past_depth("s", "single blocks", self.single, depths.get("s", 0))
        return [self.double if letter == "d" else self.single for letter, _ in kinds]


def _refuse_past_depth(letter: str, blocks: str, picked: frozenset[int], depth: int) -> None:
    """Raise for the first index of `picked` past a model's `depth` `blocks` ("double blocks")."""
    beyond = sorted(i for i in picked if i >= depth)
    if beyond:
        raise ValueError(f"skip_blocks: {letter}{beyond[0]} is past this model's depth ({depth} "
                         f"{blocks}, {letter}0-{letter}{depth - 1})")


_PART = re.compile(r"^([ds]?)(\d+)(?:-\1?(\d+))?$")


def parse_skip_blocks(text: str) -> SkipBlocks:
    """Parse e.g. "d0-4, s0-4" (double blocks 0..4, single blocks 0..4; ranges inclusive).

    Parts are separated by commas or spaces: "d3" one block, "d0-4" or "d0-d4" a range,
    "none" or an empty text skips nothing. Without a letter ("0-4") for models with one kind
    of block.
    """
    picked: dict[str, set[int]] = {"d": set(), "s": set(), "": set()}
    cleaned = text.strip().lower()
    if cleaned in ("", "none"):
        return SkipBlocks(frozenset(), frozenset())
    for part in re.split(r"[,\s]+", re.sub(r"\s*-\s*", "-", cleaned)):
        if not part:
            continue
        match = _PART.match(part)
        if not match:
            raise ValueError(f"skip_blocks: cannot read {part!r}; write double blocks as d<i> or "
                             f"d<i>-<j> and single blocks as s<i> or s<i>-<j>, e.g. "
                             f"{DEFAULT_SKIP_BLOCKS!r}, or <i>-<j> on models with one kind of "
                             f"block")
        kind, first, last = match.groups()
        first_i = _block_index(kind, first)
        last_i = _block_index(kind, last) if last is not None else first_i
        if last_i < first_i:
            raise ValueError(f"skip_blocks: range {part!r} runs backwards")
        picked[kind].update(range(first_i, last_i + 1))
    return SkipBlocks(frozenset(picked["d"]), frozenset(picked["s"]), frozenset(picked[""]))


def _block_index(kind: str, digits: str) -> int:
    """A block index of skip_blocks, refused past MAX_BLOCK_INDEX (checked on the digits, so a
    thousand-digit number is never converted)."""
    if len(digits.lstrip("0")) > len(str(MAX_BLOCK_INDEX)) or int(digits) > MAX_BLOCK_INDEX:
        raise ValueError(f"skip_blocks: {kind}{digits} is past every model's depth; block "
                         f"indices go up to {kind}{MAX_BLOCK_INDEX}")
    return int(digits)


@dataclass(frozen=True)
class ToMAOptions:
    """Everything a ToMA node was asked to do, validated from its widget values (skip_blocks as
    text); ValueError names the widget at fault. tile_count 0 means the family's default."""

    ratio: float = 0.5
    tile_count: int = 0
    skip_blocks: SkipBlocks | str = DEFAULT_SKIP_BLOCKS    # parsed into SkipBlocks
    recompute_every: int = 1   # measured on the trained fixtures, see toma_node.py
    start_percent: float = 0.0
    end_percent: float = 1.0
    unet_levels: str = "auto"
    merge_scope: str = "auto"
    region: str = "tile"
    tau: float = 1000.0
    unmerge: str = "transpose"
    batch_policy: str = "per_item"
    verbose: bool = False

    def __post_init__(self) -> None:
        check_number("ratio", self.ratio, 0.0, MAX_RATIO)
        check_number("tile_count", self.tile_count, 0, MAX_TILE_COUNT, whole=True)
        check_number("recompute_every", self.recompute_every, 1, 1000, whole=True)
        check_number("start_percent", self.start_percent, 0.0, 1.0)
        check_number("end_percent", self.end_percent, 0.0, 1.0)
        if self.start_percent >= self.end_percent:
            raise ValueError(f"start_percent ({self.start_percent}) must be below end_percent "
                             f"({self.end_percent})")
        check_number("tau", self.tau, 1.0, 1e5)
        for name, allowed in (("unet_levels", UNET_LEVELS), ("merge_scope", MERGE_SCOPES),
                              ("region", REGION_MODES), ("unmerge", UNMERGE_METHODS),
                              ("batch_policy", BATCH_POLICIES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}; got "
                                 f"{getattr(self, name)!r}")
        if isinstance(self.skip_blocks, str):
            object.__setattr__(self, "skip_blocks", parse_skip_blocks(self.skip_blocks))
        elif not isinstance(self.skip_blocks, SkipBlocks):
            raise ValueError(f"skip_blocks must be text such as {DEFAULT_SKIP_BLOCKS!r}")
        for name in ("ratio", "start_percent", "end_percent", "tau"):   # an int from JSON: 1.0
            object.__setattr__(self, name, float(getattr(self, name)))
        object.__setattr__(self, "verbose", bool(self.verbose))


make_options = ToMAOptions     # the name the nodes and tests build options by


def check_number(name: str, value: object, low: float, high: float, whole: bool = False) -> None:
    """Raise ValueError naming widget `name` unless value is a number (a whole one where
    `whole`) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)) \
            or value != value:      # NaN
        raise ValueError(f"{name} must be a {'whole ' if whole else ''}number, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be between {low} and {high}, got {value}")
