"""bench/gpu/projected_calls.py through real ComfyUI: the projection's recording of a model call
matches
the call run for real (small models of the three families), and a full-size Flux.1 call on
meta tensors has the FLOPs of the hand count and merges the tokens the ratio asks for."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import comfy_harness as ch
from bench.gpu import projected_calls as gpu_model
from bench.gpu.projection import CallRecorder, project

# Lab code: runs with the newest ComfyUI tree only (tests/pytest.ini).
pytestmark = pytest.mark.newest_tree


@pytest.fixture(autouse=True)
def sdpa():
    """SDPA attention, as bench.shared.config.setup_comfy picks for the suite (the GPU default)."""
    with ch.attention_backend("sdpa"):
        yield
    ch.unload_models()


@pytest.mark.parametrize(("name", "setting"), [(n, s) for n, s in gpu_model.SETTINGS])
def test_small_model_on_meta_runs_the_ops_it_runs_for_real(name: str,
                                                           setting: gpu_model.Setting) -> None:
    """Same op list (names, shapes, dtypes, who issued them), FLOPs and peak device bytes on
    meta tensors as for real, unmerged and with ToMA: the shadows and the assumed answers send
    the code down the path real values do, and the attribution does not depend on values."""
    if not gpu_model.present(gpu_model.MODELS[name]):
        assert ch.comfy_version() < (0, 33) and name.startswith(("hidream_o1", "krea2",
                                                                  "minimax_h3"))
        return
    result = gpu_model.validate_small(name, setting)
    for variant in ("plain", "toma"):
        part = result[variant]
        assert part["same_ops"], part.get("first_difference")
        assert part["flops_meta"] == part["flops_real"] > 0
        assert part["peak_meta"] == part["peak_real"] > 0
    assert result["plain"]["toma_ops_meta"] == 0 < result["toma"]["toma_ops_meta"]


def test_full_size_flux_call_projects_from_its_real_ops() -> None:
    spec = gpu_model.MODELS["flux"]
    base = gpu_model.build_patcher(spec)
    window = gpu_model.install_window(base)
    plain = gpu_model.record(base, window, spec)
    assert gpu_model.compute_flops(plain.ops) == gpu_model.hand_flops(spec)
    assert gpu_model.detection_mismatches(spec, base) == []
    setting = gpu_model.Setting("test", {"ratio": 0.5})
    merged = gpu_model.record(gpu_model.toma(base, setting), window, spec)
    # 512 text + 2048 of the 4096 image tokens in the merged blocks
    assert gpu_model.attention_length(plain.ops) == 4608
    assert gpu_model.attention_length(merged.ops) == 512 + 2048
    a, b = project(plain.ops, gpu_model.H200), project(merged.ops, gpu_model.H200)
    assert b.flops < a.flops and 0 < b.toma < b.serial
    assert all(not op.toma for op in plain.ops)
    # the weights never left the meta device, and nothing of the call outlives it unmerged
    assert all(p.is_meta for p in base.model.diffusion_model.parameters())
    assert plain.kept_bytes == 0 < merged.kept_bytes


def test_recording_needs_the_batch_the_gpu_would_run() -> None:
    """SDXL with cfg > 1 runs cond and uncond as one batch-2 call (as on the H200)."""
    spec = gpu_model.MODELS["sdxl"]
    unet, latent, text, _ = gpu_model.SMALL["sdxl"]
    base = gpu_model.build_patcher(spec, unet)
    window = gpu_model.install_window(base)
    rec = gpu_model.record_call(base, window, spec, CallRecorder(gpu_model.owner_dirs()),
                                latent, text)
    assert window.batch == 2 and rec.ops
    assert torch.is_tensor(base.model.model_sampling.sigmas)
    assert not base.model.model_sampling.sigmas.is_meta   # put back after the call


def test_full_size_hidream_o1_records_a_call_on_the_prompt_cache() -> None:
    """HiDream-O1 (ComfyUI 0.33 and later): the recorded call is the third, where the unmerged
    model runs on the prompt K/V cache its first two calls (cond and uncond, of one item each:
    their prompts differ in length) left: only the tms token and the image get queries there,
    and it is cheaper than the first call. ToMA's patches turn the cache off: its call runs the
    whole prompt and half of the image."""
    spec = gpu_model.MODELS["hidream_o1"]
    if not gpu_model.present(spec):
        assert ch.comfy_version() < (0, 33)
        return
    base = gpu_model.build_patcher(spec)
    window = gpu_model.install_window(base)
    plain = gpu_model.record(base, window, spec)
    assert window.batch == 1
    fresh = gpu_model.build_patcher(spec)                # no cache left by the calls above
    first = gpu_model.record(fresh, gpu_model.install_window(fresh),
                             dataclasses.replace(spec, call=0))
    image = (spec.latent[-2] // 32) * (spec.latent[-1] // 32)
    assert gpu_model.attention_length(plain.ops) == image + 1
    assert gpu_model.compute_flops(plain.ops) < gpu_model.compute_flops(first.ops)
    assert sum(op.assumed == "equal -> True" for op in plain.ops) == 2   # the cache lookups
    merged = gpu_model.record(gpu_model.toma(base, gpu_model.Setting("test", {"ratio": 0.5})),
                              window, spec)
    assert gpu_model.attention_length(merged.ops) == image // 2 + 1
    assert project(merged.ops, gpu_model.H200).serial < project(plain.ops, gpu_model.H200).serial


def test_a_failing_model_costs_only_its_own_rows(monkeypatch) -> None:
    """The section goes on past a model whose recording fails (the device's torch once refused
    HiDream-O1's attention shapes), and says which failed and why."""
    def project_model(name, rows, checks):
        if name == "flux":
            raise AssertionError("refused")
        rows.append({"model": gpu_model.MODELS[name].label, "setting": "default",
                     "ratio": 0.5, "scope": "auto", "speedup": 1.5, "kept_mib_plain": 0.0,
                     "sensitivity": {}, "sensitivity_cal": {}, "toma_sites": [],
                     "sync_sites": []})
        return f"{name} recorded"

    monkeypatch.setattr(gpu_model, "project_model", project_model)
    cfg = type("Cfg", (), {"apply_threads": lambda self: None})()
    out = gpu_model.run(cfg)
    models = {r["model"] for r in out["rows"]}
    assert gpu_model.MODELS["sdxl"].label in models and gpu_model.MODELS["wan"].label in models
    assert gpu_model.MODELS["flux"].label not in models
    assert any(n == f"failed: {gpu_model.MODELS['flux'].label}: AssertionError: refused"
               for n in out["notes"])
