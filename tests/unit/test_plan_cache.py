"""Plan reuse across steps (toma_core.plan_cache): step_index from sigmas, PlanCache schedule."""

from __future__ import annotations

import pytest
import torch

from toma_pack.toma_core import PlanCache, build_plan, step_index

# A decreasing Karras-like schedule ending at 0, as ComfyUI's samplers pass it.
SIGMAS = [14.6, 9.7, 6.3, 3.9, 2.3, 1.3, 0.68, 0.32, 0.13, 0.03, 0.0]


class Builder:
    """A build callable that counts its calls and returns a fresh object each time."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> object:
        self.calls += 1
        return object()


@pytest.mark.parametrize("as_tensor", [False, True])
def test_step_index_on_schedule(as_tensor: bool) -> None:
    schedule = torch.tensor(SIGMAS) if as_tensor else SIGMAS
    for i, sigma in enumerate(SIGMAS[:-1]):
        assert step_index(sigma, schedule) == i
    # Float32 round trip of the model's sigma still lands on its step.
    for i, sigma in enumerate(SIGMAS[:-1]):
        assert step_index(float(torch.tensor(sigma, dtype=torch.float32)), schedule) == i
        assert step_index(torch.tensor(sigma), schedule) == i


def test_step_index_intermediate_sigmas() -> None:
    """dpm_2 / 2S evaluate between two sigmas: that evaluation belongs to the earlier step."""
    for i in range(len(SIGMAS) - 1):
        mid = (SIGMAS[i] + SIGMAS[i + 1]) / 2
        geometric = (SIGMAS[i] * SIGMAS[i + 1]) ** 0.5
        assert step_index(mid, SIGMAS) == i
        if SIGMAS[i + 1] > 0:
            assert step_index(geometric, SIGMAS) == i


def test_step_index_edges() -> None:
    assert step_index(3.0, None) == 0
    assert step_index(3.0, []) == 0
    assert step_index(3.0, torch.tensor([])) == 0
    assert step_index(100.0, SIGMAS) == 0            # above the schedule: first step
    assert step_index(1e-4, SIGMAS) == len(SIGMAS) - 2
    # Schedule given as [1, S] tensor (batched sigmas) is flattened.
    assert step_index(SIGMAS[3], torch.tensor([SIGMAS])) == 3


def test_recompute_schedule() -> None:
    cache = PlanCache(recompute_every=3)
    build = Builder()
    plans = [cache.get("k", step, build) for step in range(10)]
    assert build.calls == cache.builds == 4            # steps 0, 3, 6, 9
    assert plans[0] is plans[1] is plans[2]
    assert plans[3] is plans[4] is plans[5] and plans[3] is not plans[0]
    assert plans[6] is not plans[3] and plans[9] is not plans[6]
    assert cache.build_seconds >= 0


def test_due_follows_schedule() -> None:
    cache = PlanCache(recompute_every=2)
    assert cache.due("k", 0)
    cache.get("k", 0, Builder())
    assert not cache.due("k", 0)
    assert not cache.due("k", 1)
    assert cache.due("k", 2)
    assert cache.due("other", 0)
    cache.get("k", 1, Builder())
    assert cache.due("k", 0)                           # back to an earlier step: new run
    assert not cache.due("k", 1)


def test_every_step_by_default() -> None:
    cache = PlanCache()
    build = Builder()
    for step in range(5):
        for _ in range(3):                             # several model calls per step (CFG, ...)
            cache.get("k", step, build)
    assert build.calls == 5


def test_repeated_calls_same_step_reuse() -> None:
    cache = PlanCache(recompute_every=4)
    build = Builder()
    first = cache.get("k", 2, build)
    assert all(cache.get("k", 2, build) is first for _ in range(5))
    assert build.calls == 1


def test_new_run_rebuilds() -> None:
    """Going back to step 0 (a new sampling run) rebuilds even inside the reuse window."""
    cache = PlanCache(recompute_every=10)
    build = Builder()
    for step in range(4):
        cache.get("k", step, build)
    assert build.calls == 1
    again = cache.get("k", 0, build)
    assert build.calls == 2
    assert cache.get("k", 1, build) is again


def test_keys_are_independent() -> None:
    cache = PlanCache(recompute_every=2)
    a, b = Builder(), Builder()
    for step in range(4):
        cache.get(("sdxl", 64, 64), step, a)
        if step % 2:
            cache.get(("sdxl", 32, 32), step, b)
    assert a.calls == 2
    assert b.calls == 2                                # steps 1 and 3, each >= 2 after the last


def test_none_plan_is_cached() -> None:
    """A build that returns None (nothing to merge) is remembered, not retried every call."""
    cache = PlanCache(recompute_every=3)
    calls = []
    for step in range(3):
        assert cache.get("k", step, lambda: calls.append(1)) is None
    assert len(calls) == 1


def test_clear_keeps_counters() -> None:
    cache = PlanCache()
    build = Builder()
    cache.get("k", 0, build)
    cache.clear()
    assert cache.due("k", 0)
    cache.get("k", 0, build)
    assert cache.builds == 2 and build.calls == 2


@pytest.mark.parametrize("every", [0, -1])
def test_recompute_every_rejected(every: int) -> None:
    with pytest.raises(ValueError, match="recompute_every"):
        PlanCache(recompute_every=every)


def heun_evaluations(schedule: list[float]) -> list[float]:
    """The sigmas k-diffusion's Heun evaluates the model at: schedule[i], then the corrector at
    schedule[i + 1] (an Euler step instead when that is 0)."""
    sigmas = []
    for i in range(len(schedule) - 1):
        sigmas.append(schedule[i])
        if schedule[i + 1] > 0:
            sigmas.append(schedule[i + 1])
    return sigmas


def test_heun_corrector_counts_as_the_next_step() -> None:
    """Heun's corrector evaluates at the next step's sigma and counts as that step (step_index's
    docstring), also after the model's float32 round trip."""
    steps = [step_index(s, SIGMAS) for s in heun_evaluations(SIGMAS)]
    last = len(SIGMAS) - 2
    assert steps == [0] + [i for i in range(1, last + 1) for _ in range(2)]
    assert steps == [step_index(torch.tensor(s, dtype=torch.float32), SIGMAS)
                     for s in heun_evaluations(SIGMAS)]


@pytest.mark.parametrize("sampler", ["heun", "dpm_2"])
def test_second_order_run_with_real_plans(sampler: str) -> None:
    """Sigma-keyed reuse through a second-order run: one build per `recompute_every` steps."""
    x = torch.randn(2, 64, 8, generator=torch.Generator().manual_seed(0))
    cache = PlanCache(recompute_every=2)
    if sampler == "heun":
        evaluations = heun_evaluations(SIGMAS)
    else:   # dpm_2: schedule[i], then the geometric midpoint towards schedule[i + 1]
        evaluations = [s for i in range(len(SIGMAS) - 1) for s in (
            SIGMAS[i], *([(SIGMAS[i] * SIGMAS[i + 1]) ** 0.5] if SIGMAS[i + 1] > 0 else []))]
    steps = [step_index(s, SIGMAS) for s in evaluations]
    assert steps == sorted(steps) and set(steps) == set(range(len(SIGMAS) - 1))
    plans = [cache.get((8, 8), step, lambda: build_plan(x, 8, 8, 0.5, tile_count=4))
             for step in steps]
    assert cache.builds == 5                           # steps 0, 2, 4, 6, 8
    assert all(p is not None for p in plans)
    # A second run over the same schedule starts again at step 0 and rebuilds there.
    cache.get((8, 8), step_index(SIGMAS[0], SIGMAS), lambda: build_plan(x, 8, 8, 0.5))
    assert cache.builds == 6
