"""When plans are built again (toma_core.plan_schedule): a fresh plan dict every
`recompute_every` steps per identity, the kept one in between."""

from __future__ import annotations

import pytest
import torch

from toma_pack.toma_core import PlanSchedule, build_plan


def fresh_steps(schedule: PlanSchedule, identity: object, steps: list[int]) -> list[int]:
    """The steps (in call order) at which `identity` got a fresh dict."""
    return [step for step in steps if schedule.plans(identity, step)[1]]


def test_fresh_every_n_steps() -> None:
    schedule = PlanSchedule(recompute_every=3)
    dicts = [schedule.plans("k", step)[0] for step in range(10)]
    assert dicts[0] is dicts[1] is dicts[2]
    assert dicts[3] is dicts[4] is dicts[5] and dicts[3] is not dicts[0]
    assert dicts[6] is not dicts[3] and dicts[9] is not dicts[6]
    assert fresh_steps(PlanSchedule(3), "k", list(range(10))) == [0, 3, 6, 9]


def test_a_fresh_dict_is_empty_and_the_kept_one_keeps_what_blocks_put_in() -> None:
    schedule = PlanSchedule(recompute_every=2)
    plans, fresh = schedule.plans("k", 0)
    assert fresh and plans == {}
    plans["level"] = "plan"
    again, fresh = schedule.plans("k", 1)
    assert not fresh and again is plans and again["level"] == "plan"
    assert schedule.plans("k", 2) == ({}, True)


def test_due_follows_schedule() -> None:
    schedule = PlanSchedule(recompute_every=2)
    assert schedule.due("k", 0)
    schedule.plans("k", 0)
    assert not schedule.due("k", 0)
    assert not schedule.due("k", 1)
    assert schedule.due("k", 2)
    assert schedule.due("other", 0)
    schedule.plans("k", 1)
    assert schedule.due("k", 0)                        # back to an earlier step: new run
    assert not schedule.due("k", 1)
    assert not schedule.due("k", 1)                    # due() itself changes nothing


def test_every_step_by_default() -> None:
    """Several model calls per step (CFG, second-order samplers) share that step's dict."""
    schedule = PlanSchedule()
    steps = [step for step in range(5) for _ in range(3)]
    assert fresh_steps(schedule, "k", steps) == [0, 1, 2, 3, 4]


def test_repeated_calls_at_one_step_reuse() -> None:
    schedule = PlanSchedule(recompute_every=4)
    first, _ = schedule.plans("k", 2)
    assert all(schedule.plans("k", 2) == (first, False) for _ in range(5))


def test_new_run_or_earlier_step_is_fresh() -> None:
    """Going back to an earlier step (a new sampling run) gives a fresh dict even inside the
    reuse window, also back to the very step the kept plans were built at."""
    schedule = PlanSchedule(recompute_every=10)
    assert fresh_steps(schedule, "k", [0, 1, 2, 3]) == [0]
    assert schedule.plans("k", 0)[1]
    assert not schedule.plans("k", 1)[1]
    schedule = PlanSchedule(recompute_every=10)
    assert fresh_steps(schedule, "k", [4, 5, 6]) == [4]
    assert schedule.plans("k", 4)[1]                   # 4 < 6, the latest step served


def test_identities_are_independent() -> None:
    schedule = PlanSchedule(recompute_every=2)
    a, b = [], []
    for step in range(4):
        a += [step] if schedule.plans(("cond", "cpu"), step)[1] else []
        if step % 2:
            b += [step] if schedule.plans(("uncond", "cpu"), step)[1] else []
    assert a == [0, 2]
    assert b == [1, 3]                                 # each >= 2 steps after its last build
    assert schedule.plans(("cond", "cpu"), 3)[0] is not schedule.plans(("uncond", "cpu"), 3)[0]


@pytest.mark.parametrize("every", [0, -1])
def test_recompute_every_rejected(every: int) -> None:
    with pytest.raises(ValueError, match="recompute_every"):
        PlanSchedule(recompute_every=every)


def test_a_sampling_run_with_real_plans() -> None:
    """A 10-step run with two model calls per step (second-order sampler): one build every
    `recompute_every` steps, every call of a step served the same plan; a second run over the
    same steps builds again at its first step."""
    x = torch.randn(2, 64, 8, generator=torch.Generator().manual_seed(0))
    schedule = PlanSchedule(recompute_every=2)
    builds, served = 0, []
    for run in range(2):
        for step in range(10):
            for _call in range(2):
                plans, _ = schedule.plans((8, 8), step)
                if "level" not in plans:
                    builds += 1
                    plans["level"] = build_plan(x, 8, 8, 0.5, tile_count=4)
                served.append(plans["level"])
        assert builds == 5 * (run + 1)                # steps 0, 2, 4, 6, 8 of each run
    assert all(p is not None for p in served)
    assert served[0] is served[1] is served[2] is served[3] and served[4] is not served[0]
