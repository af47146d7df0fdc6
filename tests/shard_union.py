"""The ranks' clipped regions (toma_core.shards.shard_regions) as one partition of the grid
tokens they cover together: what the ranks merge, merged in one process (the tests' reference
for sequence parallelism)."""

from __future__ import annotations

from toma_pack.toma_core.shards import SpanRegions


def union_of(spans: list[SpanRegions | None]) -> SpanRegions:
    """The ranks' spans as one partition of the grid tokens they cover together (consecutive
    spans of one base): the pieces and counts of each, in rank order."""
    present = [span for span in spans if span is not None]
    cuts = (present[0].cuts[0], *(span.cuts[-1] for span in present))
    pieces = tuple((i, region) for i, span in enumerate(present) for _, region in span.pieces)
    return SpanRegions(present[0].base, cuts, pieces,
                       tuple(size for span in present for size in span.sizes),
                       tuple(count for span in present for count in span.counts),
                       max(span.size for span in present), max(span.k for span in present))
