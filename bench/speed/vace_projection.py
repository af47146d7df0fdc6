"""Wan VACE 14B projected from the Wan 14B block bench.speed.dit_families measured.

    python -m bench.speed.vace_projection [--source bench/results/2026-12-01-cpu-dit.json]
        [--vace-blocks 8] [--out bench/results/<date>-cpu-dit-vace.json]

A VACE model is Wan's 40 main blocks plus VACE blocks: Wan attention blocks at the same width
that ComfyUI runs after some main blocks (VaceWanModel.vace_layers_mapping: every
40 / vace_blocks-th) on the VACE context, a stream of the video's token count, adding their
hint to the video. ToMA merges the main blocks and leaves the VACE blocks alone (ComfyUI calls
them without a "dit" patch), so each VACE block costs a plain block at every step.

No block is timed here: the main block's plain, lower bound and ToMA times and its plan build
come from the source result (same machine, commit and command as there), and each VACE block is
costed as one plain main block. A VACE block is that block plus one or two dim x dim
projections, which adds the same time to the plain and the merged model: the speedup as the
pack runs it is an upper estimate. The row "VACE blocks merged" projects an option the pack
does not have (each VACE block merged as a main block is, the one after main block 0 inside
the default skip, one plan build for them): what merging them would be worth, not a result of
the pack.

Writes nothing unless --out: then the JSON there and the same report as .md beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from ..shared.common import Timing, commit, goal, write_result
from ..shared.config import setup_comfy
from .dit_families import RATIO, VIDEO_TARGET, Part, default_skipped, project_parts, report

SOURCE = Path("bench/results/2026-12-01-cpu-dit.json")
MAIN_FAMILY = "wan14b"
MAIN_DEPTH = 40
VARIANTS = ("plain", "lower bound", "toma")


def block_timings(source: dict, family: str) -> tuple[list[dict], dict[str, Timing]]:
    """The family's block rows at ratio 0.5 (plain, lower bound, toma) in the source result and
    their timings, one repetition of each row's median (the source keeps medians only)."""
    rows = [r for r in source["rows"] if r["family"] == family and r["variant"] in VARIANTS
            and r.get("ratio", RATIO) in (RATIO, None)]
    found = {r["variant"]: Timing((r["ms"] / 1e3,)) for r in rows}
    missing = [v for v in VARIANTS if v not in found]
    if missing:
        raise SystemExit(f"{family}: the source result has no {', '.join(missing)} row")
    return rows, found


def vace_rows(source: dict, vace_blocks: int) -> list[dict]:
    """The projected VACE model as ToMA runs it (VACE blocks plain) and with VACE blocks merged
    (an option the pack does not have), both against the plain VACE model."""
    rows, found = block_timings(source, MAIN_FAMILY)

    def kind(label: str) -> list[dict]:          # "<family> <kind>" names the kind in the row
        return [{**r, "family": f"{MAIN_FAMILY} {label}"} for r in rows]

    main = Part(kind("main"), found, MAIN_DEPTH, default_skipped(MAIN_DEPTH))
    # VACE block i follows main block i * (40 // vace_blocks): those inside the default skip
    # would stay unmerged if VACE blocks merged
    step = MAIN_DEPTH // vace_blocks
    inside_skip = sum(1 for i in range(vace_blocks) if i * step < main.skip)
    name = f"wan_vace14b ({vace_blocks} VACE blocks)"
    built = project_parts([main, Part(kind("VACE"), found, vace_blocks, vace_blocks)], name)
    option = project_parts([main, Part(kind("VACE"), found, vace_blocks, inside_skip)],
                           f"{name}, VACE blocks merged (not built)")
    built["note"] = "VACE blocks plain, each costed as one plain main block (upper estimate)"
    option["note"] = (f"an option the pack does not have: VACE blocks merged, {inside_skip} "
                      f"inside the default skip; each costed as a main block")
    return [built, option]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=SOURCE,
                        help="a bench.speed.dit_families result with wan14b rows")
    parser.add_argument("--vace-blocks", type=int, default=8,
                        help="VACE blocks of the model (ComfyUI counts them in the checkpoint; "
                             "8 is one after every fifth of the 40 main blocks)")
    parser.add_argument("--out", type=Path, default=None)
    a = parser.parse_args(argv)
    if not 1 <= a.vace_blocks <= MAIN_DEPTH or MAIN_DEPTH % a.vace_blocks:
        parser.error(f"--vace-blocks must divide {MAIN_DEPTH} (ComfyUI spaces them evenly)")
    if not setup_comfy(torch.device("cpu")):       # the pack's default skip_blocks
        raise SystemExit("ComfyUI not found: set COMFYUI_PATH")
    source = json.loads(a.source.read_text())
    rows = vace_rows(source, a.vace_blocks)
    command = "python -m bench.speed.vace_projection " + " ".join(
        sys.argv[1:] if argv is None else argv)
    result: dict[str, Any] = {
        "machine": source["machine"],
        "config": {"commit": commit(), "comfyui": source["config"]["comfyui"],
                   "command": command, "source": str(a.source),
                   "source_commit": source["config"]["commit"],
                   "source_command": source["config"]["command"]},
        "notes": [f"no block timed here: the Wan 14B block rows of {a.source} (commit "
                  f"{source['config']['commit']}, machine above), each VACE block costed as "
                  f"one plain main block; a VACE block adds one or two dim x dim projections, "
                  f"so the speedup as the pack runs it is an upper estimate",
                  *source["notes"][1:]],
        "rows": rows}
    result["targets"] = [goal(f"{rows[0]['family']}: projected whole-model speedup >= "
                              f"{VIDEO_TARGET} (video, CPU; as the pack runs it)", rows[0],
                              "speedup", VIDEO_TARGET)]
    text = report(result)
    print(text)
    if a.out:
        write_result(a.out, result, text)


if __name__ == "__main__":
    main()
