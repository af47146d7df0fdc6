"""ToMA's block patch as bench/speed/dit_families.py's hook: `--toma-hook
bench.speed.dit_toma:hook`; `--baseline-hook bench.speed.dit_toma:baseline_hook` with
TOMA_BASELINE=PATH times the pack of another checkout (e.g. `git archive <commit> __init__.py
nodes toma_core` unpacked there) side by side, loaded as the package `toma_baseline`.

The pack's own DiTToMA (nodes/dit_patch.py) with each family's description (nodes/families/),
its node defaults (tile_count 0) unless `tiles` / `frames` say otherwise, and a model call
(model_call.ModelCall) of the case's grid in every block call's transformer_options, as sampling
hands it to the blocks.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from pathlib import Path

import torch

# bench family -> the pack's families module that describes it
FAMILIES = {"wan22_5b": "wan", "wan14b": "wan", "wan_animate14b": "wan",
            "qwen_image": "qwen_image",
            "sd35_large": "sd3", "z_image": "lumina", "ltx2": "ltx", "ltxv": "ltx",
            "hidream": "hidream", "hunyuan_image": "hunyuan_image", "kandinsky5": "kandinsky5",
            "hidream_o1": "hidream_o1", "minimax_h3": "minimax_h3",
            "krea2": "krea2"}


def family_spec(family: str, module):
    """The pack's Family for a bench family (what nodes/families/<module>.family gives the
    real model): LTX with 1x1x1 patches, LTX-2 with its audio-video block kind and its
    compressed timesteps; HiDream-O1 with its 32-pixel patches; the others from their
    description((1, 2, 2))."""
    if family == "hidream_o1":
        return module.description()
    if family == "ltx2":
        from comfy.ldm.lightricks import av_model

        return module.description((1, 1, 1), (module.AUDIO_VIDEO,), "LTX-2", None,
                                  module.held_rows(av_model))
    if family in ("ltxv", "hunyuan_image"):      # 1x1(x1) patches; HunyuanImage text first
        return module.description((1, 1, 1))
    return module.description((1, 2, 2))


def block_kind(spec, case):
    """The spec's kind of the case's block: by skip_blocks letter in a family of two kinds
    (case.kind "d" / "s"), the only one otherwise."""
    return next(k for k in spec.kinds if k.letter == case.kind)


class MergedBlock:
    """One family's block through ToMA's patch: call it with a fresh full-length argument dict
    (as `case.args()` makes it) for what `case.original_block` returns. "dit" kinds go
    through the replace patch; object-patched kinds through the patched forward where the
    case's args are the forward's own (HiDream, Kandinsky 5), else (Z-Image, whose case hands
    them by "dit" names) through the replace patch with the kind's names mapped to those.

    Its plan is built on construction and kept, as the blocks of a group reuse their group's
    plan; build_plan() builds it again (to time it) and returns it. merged_tokens: the image
    tokens the block runs on. package: the pack's package name (toma_baseline: another
    checkout's)."""

    def __init__(self, family: str, case, ratio: float, tokens_per_region: int | None = None,
                 frames: int | None = None, package: str = "toma_pack") -> None:
        def nodes(name: str):
            return importlib.import_module(f"{package}.nodes.{name}")

        self.stream_of = nodes("token_layout").stream_of
        module = nodes(f"families.{FAMILIES[family]}")
        spec = family_spec(family, module)
        if tokens_per_region is not None:
            spec = dataclasses.replace(spec, tokens_per_region=tokens_per_region)
        if frames is not None:
            spec = dataclasses.replace(spec, frames_per_region=frames)
        kind = block_kind(spec, case)
        forward = kind.hook == "object" and kind.stream in case.args(1)
        if kind.hook == "object" and not forward:   # Z-Image's layer arguments by dit names
            kind = dataclasses.replace(kind, stream="img", pe="pe", mask="mask")
        self.case, self.kind = case, kind
        options = nodes("options").make_options(ratio, skip_blocks="none", recompute_every=1000)
        self.state = nodes("run_state").ToMAState(options, spec.name)
        # the model call the block runs in (sampling opens it in the APPLY_MODEL wrapper and
        # hands it to the blocks in their transformer_options); its plans dict keeps the plan
        self.call = nodes("model_call").ModelCall(self.state.new_run(), grid=case.grid,
                                                  merging=True, txt_len=case.text_tokens)
        if case.protect_frames or case.prefix_tokens:    # as the family's describe says it
            nodes("dit_families").set_grid(self.call, case.grid, prefix=case.prefix_tokens,
                                           protect_frames=case.protect_frames)
        self.toma = nodes("dit_patch").DiTToMA(self.state, spec, {(kind.key, 0): 0})
        self.forward = (self.toma.forward_patch(kind, 0, case.block, case.block.forward)
                        if forward else None)
        self.patch = self.toma.replace_patch(kind, 0, None)
        self.extra = {"original_block": case.original_block}
        # the image tokens the block runs on: the merged grid and the protected frames before it
        self.merged_tokens = (self.build_plan().merged_tokens + self.call.prefix
                              - case.prefix_tokens)

    def __call__(self, args: dict) -> dict:
        if self.forward is None:
            return self.patch(self._in_call(args), self.extra)
        out = self.forward(**self._in_call(args))     # as ComfyUI's loop calls the block
        if self.kind.returns:
            return dict(zip(self.kind.returns, out, strict=True))
        return {self.kind.stream: out}

    def _in_call(self, args: dict) -> dict:
        """The block's args with this model call in their transformer_options."""
        options = {**(args.get("transformer_options") or {}), self.state.call_key: self.call}
        return {**args, "transformer_options": options}

    def build_plan(self):
        """Forget the plan and build it again from the case's inputs; returns the MergePlan."""
        self.call.plans.clear()
        args = self._in_call(self.case.args())
        with torch.inference_mode():
            found = self.toma.plan_for(self.kind, 0, args,
                                       self.stream_of(self.kind, args[self.kind.stream]),
                                       args["transformer_options"], self.call,
                                       f"{self.kind.letter}0")
        if found is None:
            raise RuntimeError(f"{self.case.family}: ToMA left the block unmerged "
                               f"(see its notes: {self.state.setup_notes + self.call.notes})")
        return found[0]


def hook(family: str, case, ratio: float, tokens_per_region: int | None = None,
         frames: int | None = None) -> MergedBlock | None:
    """The merged block for `case` (a dit_families.BlockCase), its plan built; None for a
    family this does not know. tokens_per_region / frames: other regions than the family's
    default (bench/speed/dit_tiles.py)."""
    if family not in FAMILIES:
        return None
    return MergedBlock(family, case, ratio, tokens_per_region, frames)


def baseline_hook(family: str, case, ratio: float) -> MergedBlock | None:
    """hook with the pack at TOMA_BASELINE (another checkout) instead of this one."""
    from .whole_call import load_baseline

    path = os.environ.get("TOMA_BASELINE")
    if not path:
        raise RuntimeError("set TOMA_BASELINE to the other checkout's pack")
    if family not in FAMILIES:
        return None
    load_baseline(Path(path))
    return MergedBlock(family, case, ratio, package="toma_baseline")
