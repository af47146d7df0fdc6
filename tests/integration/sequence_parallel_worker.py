"""One rank of a sequence-parallel run of ToMA inside raylight's real code (run by
test_sequence_parallel.py under `python -m torch.distributed.run`, gloo, CPU).

Each rank: a tiny model of the family from ComfyUI's own config classes, ToMA applied by its node
function (toma_node.patch_model) on a real ModelPatcher, raylight's sequence-parallel injection
added as raylight's RayUNETLoader adds it (its USPInjectRegistry.inject on ComfyUI's ON_LOAD
callback), and ComfyUI's KSampler path (comfy.sample.sample) at CFG 1. Beside it, on every rank,
the same sampling in one process without raylight: unmerged, and ToMA with its regions replaced
by the union of the ranks' clipped regions (tests/shard_union.py): what the ranks merge
together, merged in one process; the ranks' ToMA runs then take that reference's
destinations, their own greedy's picks kept beside (Destinations). $SCENARIOS (JSON) lists the
runs: family, latent size "frames x height x width", text tokens, skip_blocks, steps (and a
merge_scope, "scope"). Rank 0 writes a JSON list of what the test checks to $OUT.

The harness, not the pack, makes raylight run on a CPU (as ../shared/notes/raylight/README.md
found): the process group is gloo and made before raylight's xfuser setup; xfuser's attention
layer module is imported with torch.cuda.is_available() answering True (it defines nothing
without CUDA); attention "TORCH_MATH" (the flash and efficient kernels are CUDA-only).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parents[1])]   # shard_union
sys.argv = [sys.argv[0], "--cpu"]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from tie_gaps import parting_gaps  # noqa: E402

import comfy_harness as ch  # noqa: E402
import pack_loader  # noqa: E402

ch.ensure_comfy()
pack_loader.load_pack()
sys.path.insert(0, os.environ["RAYLIGHT_SRC"])
torch.set_num_threads(1)

import raylight.xfuser_compat as xfuser_compat  # noqa: E402

for name in [m for m in sys.modules if m.startswith("xfuser.core.long_ctx_attention")]:
    del sys.modules[name]
_cuda = torch.cuda.is_available
torch.cuda.is_available = lambda: True
try:
    xfuser_compat._install_long_ctx_attention(xfuser_compat._find_xfuser_root())
finally:
    torch.cuda.is_available = _cuda

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo")
from raylight.distributed_worker.parallel_group_manager import (  # noqa: E402
    initialize_xfuser_parallel,
)

initialize_xfuser_parallel(RANK, WORLD, {"is_xdit": True, "ulysses_degree": WORLD,
                                         "ring_degree": 1, "cfg_degree": 1,
                                         "attention": "TORCH_MATH", "sync_ulysses": False})

# all-to-all traffic per rank: bytes of each call's input buffer (what leaves and stays)
TRAFFIC = {"bytes": 0, "calls": 0}
_all_to_all = dist.all_to_all_single


def counting_all_to_all(output, input, *args, **kwargs):
    TRAFFIC["bytes"] += input.numel() * input.element_size()
    TRAFFIC["calls"] += 1
    return _all_to_all(output, input, *args, **kwargs)


dist.all_to_all_single = counting_all_to_all

import comfy.patcher_extension  # noqa: E402
import tiny_models  # noqa: E402
from raylight.distributed_modules.usp import USPInjectRegistry  # noqa: E402
from shard_union import union_of  # noqa: E402

from toma_pack.nodes import dit_patch  # noqa: E402
from toma_pack.nodes.toma_node import patch_model  # noqa: E402
from toma_pack.toma_core import build_plan, plan_op  # noqa: E402
from toma_pack.toma_core.shards import ShardGeometry, shard_regions  # noqa: E402

RATIO = 0.5
# the img_slice each merged block got (transformer_options), recorded per run
IMG_SLICES: set = set()
_merged_options = dit_patch.merged_options


def recording_merged_options(*args, **kwargs) -> dict:
    out = _merged_options(*args, **kwargs)
    if out.get("img_slice") is not None:
        IMG_SLICES.add(tuple(int(v) for v in out["img_slice"]))
    return out


dit_patch.merged_options = recording_merged_options


class Destinations:
    """The single-process reference's destinations, handed to this rank's greedy while the
    ranks sample with ToMA, so that both runs merge with the same destinations and their samples
    differ by the rounding of the arithmetic alone. Where two candidates tie to float precision,
    the ranks' rounding could pick the other one (an equally good choice, and a sample far
    apart); what this rank's own greedy would have picked is kept beside, and where it parts
    from the reference's, how much more its own pick gains there (`gap`: a near tie's size)."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.recorded: list[torch.Tensor] = []    # this rank's picks [B, R, k] per plan build
        self.replaying = False
        self.replayed = 0
        self.parted = 0                           # regions whose own picks part from them
        self.gap = 0.0

    def record(self, spans: list, plan) -> None:
        """The union plan's picks [B, R, k] of this rank's pieces (union_of lays the ranks'
        pieces out in rank order, every piece as its rank lays it out)."""
        if plan is not None and spans[RANK] is not None:
            counts = [0 if span is None else span.count for span in spans]
            self.recorded.append(plan.dest_slots.split(counts, dim=1)[RANK].clone())

    def replay(self) -> None:
        self.replaying, self.replayed = True, 0

    def stop(self) -> dict:
        self.replaying = False
        return {"recorded": len(self.recorded), "replayed": self.replayed,
                "parted": self.parted, "gap": self.gap}

    def greedy(self, sim: torch.Tensor, k: int, valid: torch.Tensor | None = None,
               weight: torch.Tensor | None = None) -> torch.Tensor:
        """plan_op's greedy_facility_location: its own picks, or, replaying, the reference's."""
        own = GREEDY(sim, k, valid, weight)
        if not self.replaying:
            return own
        if self.replayed == len(self.recorded):
            raise RuntimeError("the ranks built more plans than the reference")
        given = self.recorded[self.replayed]
        self.replayed += 1
        if given.shape != own.shape:
            raise RuntimeError(f"reference picks {tuple(given.shape)} for a rank's "
                               f"{tuple(own.shape)}")
        gaps = parting_gaps(sim, own, given)
        self.parted += len(gaps)
        self.gap = max([self.gap, *gaps])
        return given


GREEDY = plan_op.greedy_facility_location
DESTINATIONS = Destinations()
plan_op.greedy_facility_location = DESTINATIONS.greedy


def model_and_inputs(case: dict):
    """A fresh tiny ModelPatcher (the same seeded weights every time) and its sampling inputs:
    latent of case["batch"] items (default 1), positive and negative conditioning with
    case["text"] text tokens, noise mask."""
    family, text, batch = case["family"], case["text"], case.get("batch", 1)
    frames, height, width = (int(v) for v in case["size"].split("x"))
    if family == "flux":
        patcher = ch.tiny_flux_patcher()
        latent = ch.empty_latent(patcher, batch, height * 2, width * 2)
        positive, negative = ch.flux_conds(batch, text)
        return patcher, (latent, positive, negative, None)
    patcher = tiny_models.tiny_patcher(family)
    x = tiny_models.inputs(family, patcher, batch=batch, height=height, width=width,
                           frames=frames)
    conds = []
    for seed, [[context, extras]] in ((5, x.positive), (6, x.negative)):
        words = torch.randn(batch, text, context.shape[-1],
                            generator=torch.Generator().manual_seed(seed))
        if "attention_mask" in extras:      # the text encoder's mask: one 1 a token
            extras = {**extras, "attention_mask": torch.ones(1, text, dtype=torch.long)}
        conds.append([[words, extras]])
    return patcher, (x.latent, *conds, x.noise_mask)


def sample(case: dict, patcher, inputs: tuple) -> torch.Tensor:
    """ComfyUI's KSampler path at case["cfg"] (default 1: the negative is never run)."""
    latent, positive, negative, mask = inputs
    return ch.sample(patcher, latent, positive, negative, steps=case["steps"],
                     cfg=case.get("cfg", 1.0), noise_mask=mask)


def run_stats(patched) -> dict:
    wrapper = patched.get_wrappers(comfy.patcher_extension.WrappersMP.OUTER_SAMPLE, "toma")[0]
    return wrapper.toma_state.last_stats


def union_build(self, call, stream, offset, rows, cols, whole):
    """DiTToMA.build for the single-process reference: the whole grid's regions `whole` cut at
    the shard boundaries raylight would make of this block's sequence, each rank's clipped
    regions and counts (shard_regions) joined, so one process merges what the ranks merge
    together."""
    o = self.state.options
    geometry = ShardGeometry(WORLD, math.ceil(stream.shape[1] / WORLD), offset, whole)
    spans = shard_regions(geometry, o.ratio)
    if not spans:
        return None
    regions = union_of(spans)
    plan = build_plan(stream, 1, regions.tokens, o.ratio, regions=regions, tau=o.tau,
                      unmerge=o.unmerge, batch=o.batch_policy, offset=offset, center=True,
                      tables=regions.tables(stream.device))
    DESTINATIONS.record(spans, plan)
    return plan


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def run_case(case: dict) -> dict:
    """One scenario: single-process unmerged and reference, then raylight's sequence-parallel
    runs unmerged and with ToMA (traffic and ToMA's stats of every rank)."""
    def toma(patcher):
        scope = {"merge_scope": case["scope"]} if "scope" in case else {}
        return patch_model(patcher, RATIO, 0, case["skip"], 1, None, **scope)

    DESTINATIONS.clear()
    patcher, inputs = model_and_inputs(case)
    plain = sample(case, patcher, inputs)
    original_build = dit_patch.DiTToMA.build
    dit_patch.DiTToMA.build = union_build
    try:
        reference = sample(case, toma(patcher), inputs)
    finally:
        dit_patch.DiTToMA.build = original_build
    ch.unload_models()
    runs = {}
    for name, merged in (("unmerged", False), ("toma", True)):
        fresh, _ = model_and_inputs(case)
        fresh.add_callback(comfy.patcher_extension.CallbacksMP.ON_LOAD,
                           USPInjectRegistry.inject)
        model = toma(fresh) if merged else fresh.clone()
        TRAFFIC.update(bytes=0, calls=0)
        IMG_SLICES.clear()
        DESTINATIONS.replay()
        out = sample(case, model, inputs)
        picks = DESTINATIONS.stop()
        ch.unload_models()
        everyone = [None] * WORLD
        dist.all_gather_object(everyone, {"traffic": dict(TRAFFIC), "picks": picks,
                                          "stats": run_stats(model) if merged else None,
                                          "img_slices": sorted(IMG_SLICES)})
        runs[name] = (out, everyone)
        if merged:
            # ToMA put again on the same ModelPatcher, whose model raylight has changed by now
            # (as on a raylight GPU's second sampling: the Ray node installs ToMA per sampling)
            DESTINATIONS.replay()
            runs["again"] = (sample(case, toma(fresh), inputs), None)
            DESTINATIONS.stop()
            ch.unload_models()
    return {
        **case, "world": WORLD,
        "sp_merged_vs_reference": relative(runs["toma"][0], reference),
        "sp_unmerged_vs_plain": relative(runs["unmerged"][0], plain),
        "sp_merged_vs_sp_unmerged": relative(runs["toma"][0], runs["unmerged"][0]),
        "sp_again_vs_first": relative(runs["again"][0], runs["toma"][0]),
        "merge_moves_output": relative(reference, plain),
        "ranks": [{"unmerged": u["traffic"], "toma": t["traffic"], "stats": t["stats"],
                   "img_slices": t["img_slices"], "picks": t["picks"]}
                  for u, t in zip(runs["unmerged"][1], runs["toma"][1], strict=True)],
    }


def main() -> None:
    cases = json.loads(os.environ["SCENARIOS"])
    results = [run_case(case) for case in cases]
    if RANK == 0:
        Path(os.environ["OUT"]).write_text(json.dumps(results, default=str))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
