"""Per-run and per-call state: plans per device and batch identity, calls per thread."""

from __future__ import annotations

import threading

import torch

from toma_pack.nodes.options import make_options
from toma_pack.nodes.run_state import ModelCall, RunState, ToMAState


def counting_build(counter: list):
    def build():
        counter.append(1)
        return None

    return build


def test_plans_are_kept_per_batch_identity_and_device():
    state = ToMAState(make_options(0.5), "flux")
    run = RunState(5)
    builds: list = []
    calls = [ModelCall(run, torch.device("cpu"), (("uuid-a",), (0,))),
             ModelCall(run, torch.device("cpu"), (("uuid-a",), (0,))),   # the same batch again
             ModelCall(run, torch.device("cpu"), (("uuid-b",), (0,))),   # same shape, other cond
             ModelCall(run, torch.device("meta"), (("uuid-a",), (0,)))]  # another device
    for call in calls:
        with state.model_call(call):
            state.plan(("grid", 8, 10), 0, counting_build(builds))
    assert len(builds) == 3
    assert set(run.caches) == {torch.device("cpu"), torch.device("meta")}


def test_model_calls_are_per_thread():
    state = ToMAState(make_options(0.5), "flux")
    seen = []
    with state.model_call(ModelCall(RunState(5))) as call:
        thread = threading.Thread(target=lambda: seen.append(state.current()))
        thread.start()
        thread.join()
        assert state.current() is call
    assert seen == [None]
    assert state.current() is None


def test_step_is_worked_out_once_per_call_and_windowed():
    state = ToMAState(make_options(0.5, start_percent=0.0, end_percent=0.5), "flux")
    schedule = torch.tensor([10.0, 5.0, 2.0, 1.0, 0.0])
    for sigma, expected in ((10.0, 0), (5.0, 1), (2.0, None), (1.0, None)):
        with state.model_call(ModelCall(RunState(5))):
            options = {"sample_sigmas": schedule, "sigmas": torch.tensor([sigma])}
            assert state.active_step(options) == expected
            assert state.active_step({}) == expected           # kept for the call
