"""The lent-GPU run without a GPU or ComfyUI: bench/gpu/run.sh's budget and its `run` call,
what bench/gpu/prepare.sh carries, and bench/gpu/measured_calls.py's and bench/gpu/summary.py's
pieces
on hand-made inputs."""

from __future__ import annotations

import json
import math
import re
import shlex
import shutil
import subprocess
import time

import pytest
import torch

import bench.__main__ as suite
from bench.gpu import measured_calls as gpu_call
from bench.gpu import summary as gpu_summary
from bench.shared.config import ROOT, default_config

GPU_SH = ROOT / "bench" / "gpu" / "run.sh"
PREPARE = ROOT / "bench" / "gpu" / "prepare.sh"
PACKAGES = ROOT / "bench" / "gpu" / "device_packages.txt"
SIX_MINUTES, EIGHT_MINUTES = 360, 480
RUN_LIMIT = 600          # the device tool's most seconds for one command
MAX_COMMAND = 2000       # its most characters for one command
MAX_CARRY = 8            # its most carried paths


def _sections(text: str, which: str) -> list[tuple[str, int]]:
    """gpu.sh's FIRST_SECTIONS or SECOND_SECTIONS array as (name, cap seconds)."""
    block = re.search(rf"^{which}_SECTIONS=\(\n(.*?)^\)", text, re.S | re.M)
    assert block, f"gpu.sh has no {which}_SECTIONS=( ... ) array"
    out = []
    for entry in re.findall(r'"([^"]+)"', block.group(1)):
        name, cap = entry.split(":")[:2]
        out.append((name, int(cap)))
    return out


def _total(text: str, which: str) -> int:
    return int(re.search(rf"^{which}_TOTAL_S=(\d+)$", text, re.M).group(1))


def _run_calls(text: str) -> list[dict]:
    """The `run` calls gpu.sh's header gives, as JSON after '# run: ': the first command's,
    then the second's."""
    found = re.findall(r"^# run: (\{.*\})$", text, re.M)
    assert len(found) == 2, "gpu.sh's header must give two '# run: {...}' lines"
    return [json.loads(f) for f in found]


def test_gpu_sh_first_command_decides_within_six_minutes() -> None:
    """The first command's sections fit 6 minutes, the machine's ceilings and the plan kernel
    check first, then the measured calls; the second's fit 8 minutes."""
    text = GPU_SH.read_text()
    first, second = _sections(text, "FIRST"), _sections(text, "SECOND")
    assert sum(cap for _, cap in first) <= _total(text, "FIRST") <= SIX_MINUTES
    assert sum(cap for _, cap in second) <= _total(text, "SECOND") <= EIGHT_MINUTES
    assert [name for name, _ in first[:2]] == ["ceilings", "gpu-call"]
    for name, _ in first + second:
        assert set(name.split(",")) <= set(suite.SECTIONS), name


def test_run_calls_in_gpu_sh_header_are_valid_and_name_existing_paths() -> None:
    text = GPU_SH.read_text()
    prepare = PREPARE.read_text()
    for call, which in zip(_run_calls(text), ("FIRST", "SECOND"), strict=True):
        assert set(call) == {"command", "carry", "timeout_s"}
        assert len(call["command"]) < MAX_COMMAND
        assert _total(text, which) < call["timeout_s"] <= 540 < RUN_LIMIT
        # every path the command names is a file of the checkout
        paths = [w for w in shlex.split(call["command"]) if "/" in w or w.endswith(".sh")]
        assert paths and all((ROOT / p).is_file() for p in paths), paths
        # every carried path is one device_prepare.sh fills and gpu.sh reads
        assert 0 < len(call["carry"]) <= MAX_CARRY
        for path in call["carry"]:
            assert re.search(rf"mkdir -p {re.escape(path)}\b", prepare), path
            assert path in text.replace(call["command"], ""), path
    # 15 minutes of device time hold a machine's start (4 minutes at most, as budgeted here)
    # and the first command twice (a rerun)
    assert 2 * _run_calls(text)[0]["timeout_s"] <= 15 * 60 - 240


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_carried_folders_are_ignored_by_git() -> None:
    inside = subprocess.run(["git", "rev-parse", "--is-inside-work-tree"], cwd=ROOT,
                            capture_output=True, text=True)
    if inside.returncode != 0:
        pytest.skip("not a git checkout")
    call = _run_calls(GPU_SH.read_text())[0]
    probes = [f"{path}/probe.py" for path in call["carry"]]
    result = subprocess.run(["git", "check-ignore", "--no-index", *probes], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.stdout.split() == probes


def test_carried_wheels_are_what_the_device_lacks() -> None:
    """One pinned version of each wheel, none of a package the device already has (carrying one
    would replace the device's own), and the pure-Python downloads among them."""
    prepare = PREPARE.read_text()
    block = re.search(r"^WHEELS=\(\n(.*?)^\)", prepare, re.S | re.M).group(1)
    specs = re.findall(r'"([^"]+)"', block)
    names = [s.split("==")[0] for s in specs]
    assert all(re.fullmatch(r"[\w.-]+==[\w.]+", s) for s in specs), specs
    assert len(names) == len(set(names))
    have = {line.split("==")[0].strip().lower() for line in PACKAGES.read_text().splitlines()
            if line.strip() and not line.startswith("#")}
    assert {"torch", "triton", "numpy", "transformers"} <= have
    assert not {n.lower() for n in names} & have
    pure = re.search(r"^PURE=\((.*)\)", prepare, re.M).group(1).split()
    assert set(pure) <= set(names)


# ---------------------------------------------------------------------------- gpu_call pieces


def test_fill_on_device_draws_fill_weights_distribution() -> None:
    layer = torch.nn.Linear(512, 256).to(torch.bfloat16)
    norm = torch.nn.LayerNorm(256)
    torch.nn.init.zeros_(norm.weight)
    gpu_call.fill_on_device(torch.nn.ModuleDict({"layer": layer, "norm": norm}), seed=3)
    assert layer.weight.dtype == torch.bfloat16
    assert torch.equal(layer.bias, torch.zeros_like(layer.bias))
    assert torch.equal(norm.weight, torch.ones_like(norm.weight))
    w = layer.weight.detach().float()
    # 131072 draws of N(0, 1/512): the sample std is within 1% of 1/sqrt(512) (its own
    # standard error is 0.2%), the mean within 5 standard errors of 0
    assert abs(float(w.std()) * math.sqrt(512) - 1) < 0.01
    assert abs(float(w.mean())) < 5 / math.sqrt(w.numel() * 512)
    again = torch.nn.Linear(512, 256).to(torch.bfloat16)
    gpu_call.fill_on_device(again, seed=3)
    assert torch.equal(again.weight, layer.weight)           # seeded


def test_time_limit_raises_in_a_busy_loop_and_disarms() -> None:
    start = time.perf_counter()
    with pytest.raises(gpu_call.CaseTimeout), gpu_call.time_limit(0.05):
        while time.perf_counter() - start < 5:
            pass
    assert time.perf_counter() - start < 1
    with gpu_call.time_limit(0.05):
        pass
    time.sleep(0.1)                                           # no alarm left behind


def test_case_row_pairs_the_repetitions() -> None:
    setting = gpu_call.gpu_model.Setting("default", {"ratio": 0.5})
    case = gpu_call.Case("sdxl", False, 2, 3, 10, 1)
    first = gpu_call.CallTime(9.0, 9.0, 1.0, 2)
    got = gpu_call.Collected(first={"unmerged": first, "default": first},
                             peaks={"unmerged": first,
                                    "default": gpu_call.CallTime(5.0, 5.0, 1.0, 2, "4096->2048")},
                             times={"unmerged": [10.0, 12.0, 11.0], "default": [5.0, 8.0, 5.5]},
                             walls={"unmerged": [10.5, 12.5, 11.5], "default": [5.5, 8.5, 6.0]},
                             hosts={"unmerged": [2.0, 3.0, 2.5], "default": [5.0, 7.0, 5.2]},
                             plan={"default": (1.0, 4.0)})
    row = gpu_call.case_row("SDXL", case, setting, got)
    assert (row["ms"], row["ms_toma"], row["reps"], row["batch"]) == (11.0, 5.5, 3, 2)
    # side by side: 10 / 5, 12 / 8, 11 / 5.5
    assert row["speedup"] == 2.0 and row["speedup_lo"] == 1.5 and row["speedup_hi"] == 2.0
    assert row["tokens"] == "4096->2048" and row["plan_share"] == 0.25
    assert "flag" not in row and row["wall_ms_toma"] == 6.0
    # issuing ToMA's calls took 5.2 of the GPU's 5.5 ms: host-bound; unmerged 2.5 of 11
    assert (row["host_ms"], row["host_ms_toma"], row["bound"]) == (2.5, 5.2, "host")
    assert gpu_call.bound(2.5, 11.0) == "GPU"
    got.times["default"] = [5.0, 8.0]
    assert gpu_call.case_row("SDXL", case, setting, got)["flag"].startswith("2 repetition(s)")


def test_gpu_sizes_are_real_but_for_wans_frames() -> None:
    """On a GPU every model samples at its real size, Wan at 33 frames (9 latent frames of the
    832x480 grid) so that its repetitions fit the first command, named so in its rows; on a
    CPU the reduced configurations."""
    cuda = torch.device("cuda")
    assert gpu_call.sizes_for("sdxl", cuda) == gpu_call.Sizes()
    wan = gpu_call.sizes_for("wan", cuda)
    real = gpu_call.gpu_model.MODELS["wan"].latent
    assert wan.latent == (*real[:2], 9, *real[3:]) and wan.label.endswith("832x480x33")
    assert wan.unet_config is None and wan.options == {}
    assert gpu_call.sizes_for("wan", torch.device("cpu")).label is None


def test_run_keeps_every_case_within_the_budget(monkeypatch, tmp_path) -> None:
    """Cases run in order with the budget's remainder as their limit; one that no longer fits
    is not started; a failing case costs only its own rows; rows so far are written after
    every case."""
    partial = tmp_path / "partial.json"
    monkeypatch.setenv("TOMA_GPU_CALL_PARTIAL", str(partial))
    limits = []

    def measure(case, device, limit, quick=False):
        limits.append((case.model, limit))
        if case.model == "flux":
            raise RuntimeError("broken")
        return {"rows": [{"model": case.model}], "notes": []}

    monkeypatch.setattr(gpu_call, "measure", measure)
    cases = (gpu_call.Case("sdxl", False, 1, 3, limit_s=30, min_s=1),
             gpu_call.Case("flux", False, 1, 3, limit_s=30, min_s=1),
             gpu_call.Case("wan", False, 1, 3, limit_s=100, min_s=1),
             gpu_call.Case("sdxl", True, 1, 3, limit_s=100, min_s=60))
    cfg = default_config(quick=True, comfy=False, device="cpu")
    out = gpu_call.run(cfg, cases, budget=50 + gpu_call.MARGIN_S)
    assert [m for m, _ in limits] == ["sdxl", "flux", "wan"]
    assert limits[0][1] == 30 and limits[2][1] <= 50
    assert [r["model"] for r in out["rows"]] == ["sdxl", "wan"]
    assert any("flux: failed: RuntimeError: broken" in n for n in out["notes"])
    assert any(n.startswith("sdxl compiled: not run") for n in out["notes"])
    assert json.loads(partial.read_text())["rows"] == out["rows"]


def test_summary_puts_the_projection_beside_the_measurement(tmp_path) -> None:
    (tmp_path / "status.tsv").write_text("section\tstatus\tseconds\tlimit\n"
                                         "gpu-call\tok\t100\t270\nquality\ttimed out\t75\t75\n")
    call = {"model": "SDXL base 1024x1024", "setting": "default", "batch": 2, "ms": 80.0,
            "ms_toma": 60.0, "speedup": 4 / 3, "speedup_lo": 1.2, "speedup_hi": 1.4,
            "spread": 0.05, "spread_toma": 0.1, "reps": 10, "status": "complete",
            "host_ms_toma": 23.5, "bound": "GPU"}
    projected = {"model": "SDXL base 1024x1024", "setting": "default", "ms": 30.9,
                 "ms_toma": 24.9, "speedup": 1.24, "ms_cal": 34.5, "ms_cal_toma": 28.0,
                 "speedup_cal": 1.23, "host_bound_us": 11.9, "launches_toma": 2350}
    (tmp_path / "gpu-call.json").write_text(json.dumps(
        {"sections": {"gpu-call": {"rows": [call], "notes": ["a note"]}}}))
    text = gpu_summary.summary(tmp_path)
    assert "| quality | timed out | 75 | 75 |" in text
    assert "(committed)" in text                 # no gpu-model JSON: the committed projection
    (tmp_path / "gpu-model.json").write_text(json.dumps(
        {"sections": {"gpu-model": {"rows": [projected], "targets": []}}}))
    text = gpu_summary.summary(tmp_path)
    row = next(line for line in text.splitlines() if line.startswith("| SDXL"))
    assert "this run's gpu-model section" in text
    assert row.split(" | ")[-6:-1] == ["34.5", "28", "1.23", "1.24", "11.9"]
    assert "| GPU | 10 |" in row                  # 23.5 ms over 2350 kernels: 10 us each
    assert "1.20-1.40" in row and "| 0.1 |" in row


TRAVEL = ROOT / "bench" / "gpu" / "travel.sh"


def _git(repo, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout


def test_travel_slim_leaves_the_large_fixtures_behind_and_restore_puts_them_back(
        tmp_path) -> None:
    """In a scratch repository laid out as this one: `slim` takes TRAVEL_LEFT_OUT out of the
    index and ignores them, so what a call sends shrinks by their size and they stay on disk,
    and no commit can be made until `restore`, which leaves the index, .git/info/exclude and
    the hooks as they were."""
    text = TRAVEL.read_text()
    left_out = re.search(r"^TRAVEL_LEFT_OUT=\((.*?)\)", text, re.S | re.M).group(1).split()
    assert left_out and all((ROOT / p).is_file() for p in left_out)   # the real files
    repo = tmp_path / "repo"
    (repo / "bench" / "gpu").mkdir(parents=True)
    shutil.copy(TRAVEL, repo / "bench" / "gpu" / "travel.sh")
    (repo / "models").mkdir()
    for path in left_out:
        (repo / path).write_bytes(b"\0" * 40 * 2**20)                  # 80 MiB together
    (repo / "models" / "small.safetensors").write_bytes(b"\0" * 1024)
    _git(tmp_path, "init", "-q", str(repo))
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "fixtures")
    exclude = repo / ".git" / "info" / "exclude"
    before = exclude.read_text() if exclude.exists() else ""

    def travel(verb: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(repo / "bench" / "gpu" / "travel.sh"), verb],
                              capture_output=True, text=True)

    assert travel("size").returncode == 1                              # over 64 MiB
    slim = travel("slim")
    assert slim.returncode == 0, slim.stderr
    assert "of 64 MiB" in slim.stdout
    sent = _git(repo, "ls-files", "--cached", "--others", "--exclude-standard").split()
    assert "models/small.safetensors" in sent and not set(left_out) & set(sent)
    assert all((repo / p).stat().st_size == 40 * 2**20 for p in left_out)
    assert travel("slim").returncode == 0                              # twice: no harm
    assert exclude.read_text().count(left_out[0]) == 1
    commit = subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t",
                             "commit", "-qm", "deletion"], capture_output=True, text=True)
    assert commit.returncode != 0 and "travel.sh restore" in commit.stderr
    assert travel("restore").returncode == 0
    assert _git(repo, "status", "--porcelain") == ""
    assert exclude.read_text() == before
    assert not (repo / ".git" / "hooks" / "pre-commit").exists()
