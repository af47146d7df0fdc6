"""The nodes' settings as one validated value, and the `skip_blocks` notation.

Every check names the widget it is about: ComfyUI shows the message to the user as is.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..toma_core import BATCH_POLICIES, REGION_MODES, UNMERGE_METHODS

MERGE_SCOPES: tuple[str, ...] = ("auto", "block", "attention")
UNET_LEVELS: tuple[str, ...] = ("auto", "all", "largest")
MAX_RATIO = 0.9
DEFAULT_SKIP_BLOCKS = "d0-4, s0-4"


@dataclass(frozen=True)
class SkipBlocks:
    """Flux blocks left unmerged: indices of double and of single blocks."""

    double: frozenset[int]
    single: frozenset[int]

    def check_depth(self, double_blocks: int, single_blocks: int) -> None:
        """Raise when an index lies past the model's depth."""
        for kind, picked, depth in (("d", self.double, double_blocks),
                                    ("s", self.single, single_blocks)):
            beyond = sorted(i for i in picked if i >= depth)
            if beyond:
                raise ValueError(
                    f"skip_blocks: {kind}{beyond[0]} is past this model's depth "
                    f"({depth} {'double' if kind == 'd' else 'single'} blocks, "
                    f"{kind}0-{kind}{depth - 1})")


_PART = re.compile(r"^([ds])(\d+)(?:-\1?(\d+))?$")


def parse_skip_blocks(text: str) -> SkipBlocks:
    """Parse e.g. "d0-4, s0-4" (double blocks 0..4, single blocks 0..4; ranges inclusive).

    Parts are separated by commas or spaces: "d3" one block, "d0-4" or "d0-d4" a range,
    "none" or an empty text skips nothing.
    """
    double: set[int] = set()
    single: set[int] = set()
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
                             f"{DEFAULT_SKIP_BLOCKS!r}")
        kind, first, last = match.group(1), int(match.group(2)), match.group(3)
        last_i = int(last) if last is not None else first
        if last_i < first:
            raise ValueError(f"skip_blocks: range {part!r} runs backwards")
        (double if kind == "d" else single).update(range(first, last_i + 1))
    return SkipBlocks(frozenset(double), frozenset(single))


@dataclass(frozen=True)
class ToMAOptions:
    """Everything a ToMA node was asked to do. tile_count 0 means the family's default."""

    ratio: float = 0.5
    tile_count: int = 0
    skip_blocks: SkipBlocks = parse_skip_blocks(DEFAULT_SKIP_BLOCKS)
    recompute_every: int = 5
    start_percent: float = 0.0
    end_percent: float = 1.0
    unet_levels: str = "auto"
    merge_scope: str = "auto"
    region: str = "tile"
    tau: float = 1000.0
    unmerge: str = "transpose"
    batch_policy: str = "per_item"
    verbose: bool = False


def make_options(ratio: float = 0.5, tile_count: int = 0, skip_blocks: str = DEFAULT_SKIP_BLOCKS,
                 recompute_every: int = 5, start_percent: float = 0.0, end_percent: float = 1.0,
                 unet_levels: str = "auto", merge_scope: str = "auto", region: str = "tile",
                 tau: float = 1000.0, unmerge: str = "transpose", batch_policy: str = "per_item",
                 verbose: bool = False) -> ToMAOptions:
    """Validate widget values into ToMAOptions; ValueError names the widget at fault."""
    _number("ratio", ratio, 0.0, MAX_RATIO)
    _integer("tile_count", tile_count, 0, 4096)
    _integer("recompute_every", recompute_every, 1, 1000)
    _number("start_percent", start_percent, 0.0, 1.0)
    _number("end_percent", end_percent, 0.0, 1.0)
    if start_percent >= end_percent:
        raise ValueError(f"start_percent ({start_percent}) must be below end_percent "
                         f"({end_percent})")
    _number("tau", tau, 1.0, 1e5)
    for name, value, allowed in (("unet_levels", unet_levels, UNET_LEVELS),
                                 ("merge_scope", merge_scope, MERGE_SCOPES),
                                 ("region", region, REGION_MODES),
                                 ("unmerge", unmerge, UNMERGE_METHODS),
                                 ("batch_policy", batch_policy, BATCH_POLICIES)):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
    if not isinstance(skip_blocks, str):
        raise ValueError(f"skip_blocks must be text such as {DEFAULT_SKIP_BLOCKS!r}")
    return ToMAOptions(float(ratio), int(tile_count), parse_skip_blocks(skip_blocks),
                       int(recompute_every), float(start_percent), float(end_percent),
                       unet_levels, merge_scope, region, float(tau), unmerge, batch_policy,
                       bool(verbose))


def _number(name: str, value: object, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be between {low} and {high}, got {value}")


def _integer(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be between {low} and {high}, got {value}")
