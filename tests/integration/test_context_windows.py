"""ToMA beside ComfyUI's context windows (comfy/context_windows.py through its own
ContextWindowsManual node): long videos are denoised window by window, one model call per window
of frames within each step, all with the same conds. Each window must merge with its own plan:
plans are kept per call identity, and the window (its frame indices) is part of it."""

from __future__ import annotations

import inspect

import pytest
import torch
from test_tiny_models import assert_absent
from tiny_models import available, inputs, tiny_patcher

import comfy_harness as ch
from toma_pack.nodes import run_state
from toma_pack.nodes.apply import apply_toma
from toma_pack.nodes.arguments import call_arguments
from toma_pack.nodes.options import make_options

FRAMES = 13          # latent frames
WINDOW, OVERLAP = 4, 1


def with_context_windows(model):
    """ComfyUI's ContextWindowsManual node on `model`: windows of 4 latent frames overlapping by
    1 along the frame axis (dim 2 of [B, C, T, H, W]); arguments by name, since the node's
    inputs grew across versions."""
    import comfy.context_windows as cw

    ch.comfy_top_level_nodes()
    from comfy_extras.nodes_context_windows import ContextWindowsManualNode

    wanted = {"model": model, "context_length": WINDOW, "context_overlap": OVERLAP,
              "context_schedule": cw.ContextSchedules.STATIC_STANDARD, "context_stride": 1,
              "closed_loop": False, "fuse_method": cw.ContextFuseMethods.PYRAMID, "dim": 2,
              "freenoise": False}
    params = inspect.signature(ContextWindowsManualNode.execute).parameters
    out = ContextWindowsManualNode.execute(**{k: v for k, v in wanted.items() if k in params})
    return (out.result if hasattr(out, "result") else out.args)[0]


class CallRecorder:
    """Every apply_model call of a patcher: its arguments (cloned tensors) and output."""

    def __init__(self, patcher) -> None:
        from comfy.patcher_extension import WrappersMP

        self.calls: list[tuple[tuple[int, ...], dict, torch.Tensor]] = []

        def record(executor, *args, **kwargs):
            out = executor(*args, **kwargs)
            named = call_arguments(executor, args, kwargs)      # transformer_options: args[5]
            window = (named.get("transformer_options") or {}).get("context_window")
            self.calls.append((tuple(getattr(window, "index_list", None) or ()), named,
                               out.clone()))
            return out

        patcher.add_wrapper_with_key(WrappersMP.APPLY_MODEL, "test_recorder", record)


@pytest.mark.parametrize("name", ["wan21_t2v", "hunyuan_video"])
def test_every_context_window_merges_with_its_own_plan(name):
    """A 13-frame video in windows of 4 (overlap 1): every window of a step is its own model
    call, ToMA builds one plan per window (and per block group), and each window's output is
    what ToMA gives for that window's frames alone, in a call outside the run (fresh plans).
    It used to build 2 plans for 4 windows and merge windows 3 and 4 with window 2's."""
    if not available(name):
        return assert_absent(name)
    base = tiny_patcher(name)
    x = inputs(name, base, batch=1, height=8, width=8, frames=FRAMES)
    recorder = CallRecorder(base)
    toma = apply_toma(base, make_options(skip_blocks="none", tile_count=4, verbose=True))
    builds = []
    report = run_state.ToMAState._report
    run_state.ToMAState._report = lambda self, run: builds.append(run.builds) or report(self, run)
    try:
        ch.sample(with_context_windows(toma), x.latent, x.positive, x.negative, steps=1, cfg=1.0)
    finally:
        run_state.ToMAState._report = report
    windows = [w for w, _, _ in recorder.calls]
    assert len(windows) >= 4 and len(set(windows)) == len(windows)     # one call per window
    groups = 2 if name == "hunyuan_video" else 1                       # double + single kinds
    assert builds == [len(windows) * groups]
    for window, named, out in list(recorder.calls):
        # the same call again outside the run (no run state: a throwaway one, fresh plans)
        options = {k: v for k, v in named["transformer_options"].items()
                   if not k.startswith("toma_run")}
        alone = toma.model.apply_model(**{**named, "transformer_options": options})
        assert torch.equal(alone, out), window
