"""The grid tokens each rank drops under sequence parallelism, by toma_core.shards' own rule
(shard_regions), at full model sizes: the whole grid's share dropped, and the most any one rank
drops of its own grid, for P = 2, 4, 8. Host arithmetic only (no model, no GPU).

    python -m bench.gpu.shard_drops --out bench/results/<date>-shard-drops.json

The geometries are what raylight hands a block (the sequence padded to a multiple of P, then
split), the regions those ToMA's node makes at its defaults (tile regions, tile_count 0: the
family's tokens per region, nodes/dit_families.py)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from bench.shared.common import commit, machine_info, markdown_table, write_result
from bench.shared.config import load_pack

load_pack()
from toma_pack.toma_core import make_regions  # noqa: E402
from toma_pack.toma_core.shards import (  # noqa: E402
    ShardGeometry,
    dropped_share,
    local_cap,
    shard_regions,
)

RATIO = 0.5
RANKS = (2, 4, 8)
REGION_TOKENS = 64          # nodes/dit_families.py REGION_TOKENS
VIDEO_FRAMES = 2            # nodes/dit_families.py VIDEO_REGION_FRAMES
# (name, block kind, grid (t, h, w) that merges, tokens before it in the split sequence,
# tokens after it, frames per region): Wan 832x480x81 is 21 latent frames of 30 x 52 tokens,
# image to video keeps its start frame unmerged (before the grid, on the first rank); Flux's
# single blocks hold the 512 T5 tokens before a 1024x1024 image's 64 x 64 tokens.
CASES = [
    ("Wan 2.1 t2v 832x480x81", "blocks", (21, 30, 52), 0, 0, VIDEO_FRAMES),
    ("Wan 2.1 i2v 832x480x81", "blocks", (20, 30, 52), 30 * 52, 0, VIDEO_FRAMES),
    ("Qwen-Image 1328x1328", "blocks", (1, 83, 83), 0, 0, 1),
    ("Qwen-Image 1024x1024", "blocks", (1, 64, 64), 0, 0, 1),
    ("Flux 1024x1024 T5-512", "double blocks", (1, 64, 64), 0, 0, 1),
    ("Flux 1024x1024 T5-512", "single blocks", (1, 64, 64), 512, 0, 1),
]


def row(name: str, kind: str, grid: tuple[int, int, int], before: int, after: int,
        frames: int, ranks: int) -> dict:
    t, h, w = grid
    tiles = max(1, round(h * w * min(frames, t) / REGION_TOKENS))
    base = make_regions(h, w, "tile", tiles, t=t, frames=frames)
    shard = math.ceil((before + base.tokens + after) / ranks)
    spans = shard_regions(ShardGeometry(ranks, shard, before, base), RATIO)
    held = [0 if s is None else s.tokens for s in spans]
    drop = spans[0].tokens - sum(spans[0].counts) if spans else 0
    return {"model": name, "blocks": kind, "P": ranks, "grid_tokens": base.tokens,
            "fewest_held": min(held) if spans else None, "drop_per_rank": drop,
            "grid_dropped": dropped_share(spans) if spans else 0.0,
            "most_dropped_on_a_rank": max(drop / n for n in held) if spans else 0.0,
            "within_10pct": abs((dropped_share(spans) if spans else 0.0) - RATIO) <= 0.1 * RATIO}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    rows = [row(*case, ranks) for case in CASES for ranks in RANKS]
    columns = list(rows[0])
    config = {"commit": commit(), "command": f"python -m bench.gpu.shard_drops --out {out}",
              "ratio": RATIO, "local_cap": local_cap(RATIO)}
    result = {"config": config, "machine": machine_info(), "rows": rows}
    text = "\n".join([
        "# Grid tokens dropped under sequence parallelism (toma_core/shards.py)", "",
        f"commit: {config['commit']}", f"command: `{config['command']}`",
        f"machine: {result['machine']['cpu']} (host arithmetic only: no model ran)", "",
        f"ratio {RATIO}; a rank drops at most {local_cap(RATIO)} of its own grid tokens "
        "(toma_core.shards.local_cap); every rank drops drop_per_rank tokens; grid_dropped: "
        "the whole grid's share dropped; most_dropped_on_a_rank: the largest share a rank drops "
        "of its own grid tokens (the rank holding the text or the start frame, or the last "
        "rank's pad).", "",
        markdown_table(rows, columns), ""])
    write_result(out, result, text)
    print(text)


if __name__ == "__main__":
    main()
