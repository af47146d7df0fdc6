"""ToMA's block patch as bench/dit_families.py's hook: `--toma-hook bench.dit_toma:hook`.

The pack's own DiTToMA (nodes/dit_patch.py) with each family's description (nodes/families/),
its node defaults (tile_count 0) unless `tiles` / `frames` say otherwise, and a model call
(run_state.ModelCall) of the case's grid open around every block call, as sampling opens it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

# bench family -> (families module name, its BlockKind argument names in the bench's args)
FAMILIES = {"wan22_5b": "wan", "wan14b": "wan", "qwen_image": "qwen_image",
            "sd35_large": "sd3", "z_image": "lumina"}


def hook(family: str, case, ratio: float, tokens_per_region: int | None = None,
         frames: int | None = None) -> Callable[[dict], dict] | None:
    """run(args) -> the merged block's output for `case` (a dit_families.BlockCase), its plan
    built here; None for a family this does not know. tokens_per_region / frames: other
    regions than the family's default (bench/dit_tiles.py)."""
    import importlib

    from toma_pack.nodes.dit_patch import DiTToMA
    from toma_pack.nodes.options import make_options
    from toma_pack.nodes.run_state import ModelCall, RunState, ToMAState

    if family not in FAMILIES:
        return None
    module = importlib.import_module(f"toma_pack.nodes.families.{FAMILIES[family]}")
    spec = module.description((1, 2, 2))
    if tokens_per_region is not None:
        spec = dataclasses.replace(spec, tokens_per_region=tokens_per_region)
    if frames is not None:
        spec = dataclasses.replace(spec, frames_per_region=frames)
    kind = spec.kinds[0]
    if kind.hook == "object":       # the bench hands Z-Image's layer arguments by dit names
        kind = dataclasses.replace(kind, stream="img", pe="pe", mask="mask")
    state = ToMAState(make_options(ratio, skip_blocks="none", recompute_every=1000),
                      spec.name)
    call = ModelCall(RunState(1000), grid=case.grid, data={"txt_len": case.text_tokens})
    patch = DiTToMA(state, spec, {(kind.key, 0): 0}).replace_patch(kind, 0, None)
    extra = {"original_block": case.original_block}

    def run(args: dict) -> dict:
        with state.model_call(call):
            return patch(args, extra)

    run(case.args())            # builds the plan the timed calls reuse
    return run
