"""Region size for tile_count 0 on the DiT families: error of the merged block against plain.

    COMFYUI_PATH=/path/to/ComfyUI python -m bench.speed.dit_tiles [--families a,b]
        [--out bench/results/<date>-cpu-dit-tiles.json]

For each family of bench/speed/dit_families.py (its --quick sizes: full width, fewer frames and
pixels) and each region size, the relative L2 error of ToMA's merged block's image update
against the plain block's, at ratio 0.5 (bench/speed/dit_toma.py's hook; one block, random
weights, smooth token fields: it ranks region sizes, it does not predict image quality), and
how far each size is from the family's best. The defaults in nodes/dit_families.py
(REGION_TOKENS, VIDEO_REGION_FRAMES) come from this run. Errors are deterministic (seeded
weights and tokens); the process CPU time per merged call is recorded for scale only.

Writes nothing unless --out: then the JSON there and the same report as .md beside it (machine,
commit, command, table).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..shared.common import commit, machine_info, markdown_table, write_result

# (tokens per region, frames deep) tried on image and on video families
REGIONS = {"image": [(16, 1), (36, 1), (64, 1), (144, 1)],
           "video": [(16, 1), (64, 1), (32, 2), (64, 2), (128, 2), (64, 4)]}
COLUMNS = ("family", "grid", "tokens", "frames", "error", "vs_best", "default", "cpu_s")


def rows_for(name: str, defaults: tuple[int, int]) -> list[dict[str, Any]]:
    """One row per region size tried on the family's block (its --quick size); `defaults` the
    node's (REGION_TOKENS, VIDEO_REGION_FRAMES)."""
    from . import dit_families as df
    from .dit_toma import hook

    build, _, quick = df.FAMILIES[name]
    case = build(name, quick)
    kind = "video" if case.grid[0] > 1 else "image"
    rows = []
    with torch.inference_mode():
        img_in = case.image_out(case.args())
        plain = case.image_out(case.original_block(case.args())) - img_in
        for tokens, frames in REGIONS[kind]:
            run = hook(name, case, 0.5, tokens_per_region=tokens, frames=frames)
            start = time.process_time()
            update = case.image_out(run(case.args())) - img_in
            seconds = time.process_time() - start
            err = float((update - plain).norm() / plain.norm())
            default = tokens == defaults[0] and frames == (defaults[1] if kind == "video" else 1)
            rows.append({"family": name, "grid": "x".join(map(str, case.grid)),
                         "tokens": tokens, "frames": frames, "error": round(err, 4),
                         "default": default, "cpu_s": round(seconds, 1)})
            print(f"{name} {case.grid}: {tokens} tokens, {frames} frame(s): error {err:.4f} "
                  f"({seconds:.1f} s CPU)", flush=True)
    best = min(r["error"] for r in rows)
    for row in rows:
        row["vs_best"] = round(row["error"] / best, 3)
    return rows


def main(argv: list[str] | None = None) -> None:
    from . import dit_families as df

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(df.FAMILIES))
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path for the results (the .md report beside it)")
    a = parser.parse_args(argv)
    df._setup()
    torch.set_num_threads(1)
    from toma_pack.nodes.dit_families import REGION_TOKENS, VIDEO_REGION_FRAMES

    families = [f.strip() for f in a.families.split(",") if f.strip()]
    rows = [row for name in families
            for row in rows_for(name, (REGION_TOKENS, VIDEO_REGION_FRAMES))]
    worst = max((r["vs_best"] for r in rows if r["default"]), default=None)
    result = {"machine": machine_info(),
              "config": {"commit": commit(), "comfyui": os.environ.get("COMFYUI_PATH"),
                         "command": "python -m bench.speed.dit_tiles " + " ".join(
                             sys.argv[1:] if argv is None else argv),
                         "threads": 1, "ratio": 0.5,
                         "defaults": {"REGION_TOKENS": REGION_TOKENS,
                                      "VIDEO_REGION_FRAMES": VIDEO_REGION_FRAMES}},
              "default_worst_vs_best": worst, "rows": rows}
    text = "\n".join([
        "# Region size for tile_count 0 (bench/speed/dit_tiles.py)", "",
        f"Machine: {result['machine']}", f"Commit: {result['config']['commit']}",
        f"Command: `{result['config']['command']}` (COMFYUI_PATH {result['config']['comfyui']})",
        "", "Relative L2 error of the merged block's image update against the plain block's "
        "(ratio 0.5, random weights, smooth token fields); vs_best: error / the family's "
        "lowest; default: the node's tile_count 0 region.", "",
        markdown_table(rows, COLUMNS), "",
        f"The default region's worst error against its family's best: {worst}x.", ""])
    print(text)
    if a.out:
        write_result(a.out, result, text)


if __name__ == "__main__":
    main()
