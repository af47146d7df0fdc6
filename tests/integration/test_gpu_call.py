"""bench/gpu/measured_calls.py through real ComfyUI on the CPU, at the reduced sizes its CPU path
(the
rehearsal of bench/gpu/run.sh) runs: every case samples through the node's public path, times each
setting against the unmerged call, merges the tokens the ratio asks for and times the plan
builds; a compiled case compiles each variant on its own, with ToMA inside the graph."""

from __future__ import annotations

import pytest
import torch

import comfy_harness as ch
from bench.gpu import measured_calls as gpu_call
from bench.gpu import projected_calls as gpu_model

# Lab code: runs with the newest ComfyUI tree only (tests/pytest.ini).
pytestmark = pytest.mark.newest_tree

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def sdpa():
    """SDPA attention, as bench.shared.config.setup_comfy picks for the suite (the GPU default)."""
    with ch.attention_backend("sdpa"):
        yield
    ch.unload_models()


def merged_pairs(tokens: str) -> list[tuple[int, int]]:
    """"256->128, 64->32" as [(256, 128), (64, 32)]."""
    return [tuple(int(n) for n in part.split("->")) for part in tokens.split(", ") if part]


@pytest.mark.parametrize("model", ["sdxl", "flux", "wan", "hidream_o1"])
def test_eager_case_times_every_setting_through_the_node(model: str) -> None:
    case = gpu_call.Case(model, False, warmup=1, reps=3, limit_s=300, min_s=1)
    out = gpu_call.measure(case, CPU, 300)
    if not gpu_model.present(gpu_model.MODELS[model]):
        assert ch.comfy_version() < (0, 33) and model == "hidream_o1"
        assert out["rows"] == [] and "not run" in out["notes"][0]
        return
    settings = [s for m, s in gpu_model.SETTINGS if m == model]
    assert [r["setting"] for r in out["rows"]] == [s.name for s in settings]
    for row, setting in zip(out["rows"], settings, strict=True):
        assert row["status"] == "complete" and "flag" not in row, row
        assert row["reps"] == gpu_call.CPU_REPS
        assert row["batch"] == gpu_model.MODELS[model].batch       # cond and uncond together
        assert row["ms"] > 0 and row["ms_toma"] > 0
        assert row["speedup_lo"] <= row["speedup_hi"]
        pairs = merged_pairs(row["tokens"])
        assert pairs, "ToMA merged nothing"
        for tokens, merged in pairs:
            assert abs(merged - tokens * (1 - setting.ratio)) <= 0.05 * tokens, row["tokens"]
        assert 0 < row["plan_share"] < 1
    assert any("built in" in note for note in out["notes"])


def test_hidream_o1_times_its_third_call() -> None:
    """HiDream-O1's timed call is its third (cond and uncond of the first step fill the unmerged
    model's prompt cache; the next call runs on it): the timer lets spec.call calls pass."""
    spec = gpu_model.MODELS["hidream_o1"]
    if not gpu_model.present(spec):
        assert ch.comfy_version() < (0, 33)
        return
    from comfy.patcher_extension import WrappersMP

    sizes = gpu_call.sizes_for("hidream_o1", CPU)
    built = gpu_call.build(spec, CPU, sizes.unet_config)
    timer = gpu_call.install_timer(built.patcher, CPU)
    calls: list[int] = []

    def count(executor, *args, **kwargs):                 # inside the timer: every call
        calls.append(int(args[0].shape[0]))
        return executor(*args, **kwargs)

    built.patcher.add_wrapper_with_key(WrappersMP.APPLY_MODEL, "test_count", count)
    gpu_call.one_call(built.patcher, timer, spec, sizes)
    assert spec.call == 2 and calls == [1, 1, 1]
    gpu_call.release(built)


def test_compiled_case_compiles_each_variant_with_toma_inside(monkeypatch) -> None:
    """The unmerged and the ToMA model each compile into one graph of their own; the ToMA
    call merges inside it (the run's token counts). dynamo's "eager" backend: the same graphs
    as inductor's, without inductor's minutes of code generation on a CPU."""
    monkeypatch.setattr(gpu_call, "COMPILE_BACKEND", "eager")
    case = gpu_call.Case("flux", True, warmup=1, reps=3, limit_s=300, min_s=1)
    out = gpu_call.measure(case, CPU, 300)
    (row,) = out["rows"]
    assert row["setting"] == "default, compiled" and row["status"] == "complete", row
    assert merged_pairs(row["tokens"]) == [(256, 128)]
    assert row["graphs"] == row["graphs_toma"] == 1
    assert row["graph_breaks_toma"] == 0
    assert row["first_call_s"] > 0 and row["first_call_s_toma"] > 0


def test_pyav_stand_in_lets_comfyuis_v3_nodes_import(tmp_path) -> None:
    """Where PyAV is missing (the lent GPU machine), bench/gpu/stubs stands in for it: with it
    first on the path, comfy_api.latest, EasyCache and TorchCompileModel import, in a fresh
    interpreter whose `av` is the stand-in."""
    import subprocess
    import sys

    from bench.shared.config import ROOT

    code = ("import comfy.cli_args; comfy.cli_args.args.cpu = True\n"
            "import av, comfy_api.latest, comfy_extras.nodes_easycache, "
            "comfy_extras.nodes_torch_compile\n"
            "print(av.__file__)\n")
    stubs = ROOT / "bench" / "gpu" / "stubs"
    path = [str(stubs), str(ch.ensure_comfy()), *sys.path]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=tmp_path, env={"PYTHONPATH": ":".join(path), "PATH": "/usr/bin"},
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().startswith(str(stubs))


def test_whole_runs_time_unmerged_toma_easycache_and_both(monkeypatch) -> None:
    """Section gpu-runs at the CPU's reduced size: the four variants, side by side, at least
    MIN_REPS runs each even when the budget is spent, and ToMA merges in both of its
    variants."""
    from bench.gpu import whole_runs
    from bench.shared.common import MIN_REPS
    from bench.shared.config import default_config
    from toma_pack.nodes.run_state import ToMAState

    monkeypatch.setenv("TOMA_GPU_RUNS_BUDGET_S", "1")
    merged = []
    report = ToMAState._report

    def counting(self, run):
        merged.append(len(run.layers_merged))
        return report(self, run)

    monkeypatch.setattr(ToMAState, "_report", counting)
    out = whole_runs.run(default_config(quick=True, comfy=True, device="cpu"))
    rows = {r["variant"]: r for r in out["rows"]}
    assert list(rows) == ["unmerged", "ToMA", "EasyCache", "ToMA + EasyCache"]
    assert all(r["reps"] >= MIN_REPS and r["steps"] == whole_runs.STEPS for r in rows.values())
    assert "speedup" in rows["ToMA + EasyCache"] and "speedup" not in rows["unmerged"]
    assert merged and all(n > 0 for n in merged)
