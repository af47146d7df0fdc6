"""Integration tests run against a real ComfyUI; comfy_harness.py says where it is looked for.

Without one, or when `import comfy` fails in this Python, every test module here is skipped
with that reason before it is imported (test modules may import comfy at top level, which would
otherwise be a collection error).

Where ComfyUI must be tested (TOMA_REQUIRE_COMFYUI=1, set by scripts/test.sh, or whenever the
project's ../shared/comfyui trees exist) a skip is a failure: CI must never go green over tests
that did not run. Tests that do not apply to a ComfyUI version test what happens there instead.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# tests/ has no __init__.py: make `import comfy_harness` work under any pytest import mode.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import comfy_harness  # noqa: E402


class _SkippedModule(pytest.Module):
    """Stands for a test module when ComfyUI can't be used: reports one skip, imports nothing."""

    def collect(self) -> list[pytest.Item]:
        _, reason = comfy_harness.comfy_status()
        pytest.skip(reason)


def pytest_pycollect_makemodule(
    module_path: Path, parent: pytest.Collector
) -> pytest.Module | None:
    path, _ = comfy_harness.comfy_status()
    if path is not None:
        return None  # pytest's own Module
    return _SkippedModule.from_parent(parent, path=module_path)


def require_comfyui() -> bool:
    """Whether a skipped real-ComfyUI test fails the run (see the module docstring)."""
    flag = os.environ.get("TOMA_REQUIRE_COMFYUI")
    if flag is not None:
        return flag not in ("", "0")
    return bool(comfy_harness.shared_trees())


def _fail_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    if report.skipped and require_comfyui():
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped where ComfyUI must be tested: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    _fail_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    _fail_skip(outcome.get_result())


def pytest_report_header() -> str:
    path, reason = comfy_harness.comfy_status()
    if path is None:
        return f"comfyui: none ({reason})"
    return f"comfyui: {comfy_harness.comfy_version_string(path)} at {path}"


@pytest.fixture(scope="session")
def comfyui_path() -> Path:
    """The ComfyUI folder under test (imported, CPU mode)."""
    return comfy_harness.ensure_comfy()


@pytest.fixture(params=["sub_quadratic", "sdpa"])
def attention(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs the test once per attention backend: the CPU default (sub-quadratic) and PyTorch
    SDPA (ComfyUI's GPU default); yields the backend's name."""
    with comfy_harness.attention_backend(request.param):
        yield request.param


@pytest.fixture(autouse=True)
def _single_thread_torch() -> Iterator[None]:
    # The tiny models gain nothing from intra-op threads, and on a busy 2-core machine the thread
    # pool thrashes: one thread is 4-8x faster there. Restored for the tests outside this folder.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _unload_comfy_models() -> Iterator[None]:
    # ComfyUI keeps loaded models (with their patches applied) in a module-level list.
    yield
    comfy_harness.unload_models()


@pytest.fixture
def stats(monkeypatch) -> list[dict]:
    """The stats dicts ToMA sends to the graph when a run ends, in order."""
    from toma_pack.nodes import run_state

    sent: list[dict] = []
    monkeypatch.setattr(run_state, "send_stats", lambda node, s: sent.append(s))
    return sent
