"""Region size for tile_count 0 on the DiT families: error of the merged block against plain.

    COMFYUI_PATH=/path/to/ComfyUI python -m bench.speed.dit_tiles [families ...]

For each family of bench/speed/dit_families.py (its --quick sizes: full width, fewer frames and
pixels)
and each region size, the relative L2 error of ToMA's merged block's image update against the
plain block's, at ratio 0.5 (bench/speed/dit_toma.py's hook; one block, random weights, smooth token
fields: it ranks region sizes, it does not predict image quality). The defaults in
nodes/dit_families.py (REGION_TOKENS, VIDEO_REGION_FRAMES) come from this run. Process CPU time
per merged call is printed beside, for scale only.
"""

from __future__ import annotations

import sys
import time

import torch

# (tokens per region, frames deep) tried on image and on video families
REGIONS = {"image": [(16, 1), (36, 1), (64, 1), (144, 1)],
           "video": [(16, 1), (64, 1), (32, 2), (64, 2), (128, 2), (64, 4)]}


def main(families: list[str]) -> None:
    from . import dit_families as df
    from .dit_toma import hook

    df._setup()
    torch.set_num_threads(1)
    for name in families or list(df.FAMILIES):
        build, _, quick = df.FAMILIES[name]
        case = build(name, quick)
        kind = "video" if case.grid[0] > 1 else "image"
        with torch.inference_mode():
            img_in = case.image_out(case.args())
            plain = case.image_out(case.original_block(case.args())) - img_in
            print(f"{name}: grid {case.grid}", flush=True)
            for tokens, frames in REGIONS[kind]:
                run = hook(name, case, 0.5, tokens_per_region=tokens, frames=frames)
                start = time.process_time()
                update = case.image_out(run(case.args())) - img_in
                seconds = time.process_time() - start
                err = float((update - plain).norm() / plain.norm())
                print(f"  {tokens} tokens, {frames} frame(s): error {err:.4f} "
                      f"({seconds:.1f} s CPU)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
