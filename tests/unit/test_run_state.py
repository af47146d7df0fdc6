"""Per-run and per-call state (nodes/run_state.py) without ComfyUI: the sampler's callback gives
the steps, the APPLY_MODEL wrapper decides each call on the host and hands its ModelCall to the
blocks in transformer_options, plans are kept per call identity (batch layout, device)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from toma_pack.nodes.model_call import ModelCall
from toma_pack.nodes.options import make_options
from toma_pack.nodes.run_state import RunState, ToMAState
from toma_pack.toma_core import build_plan, make_regions


class Executor:
    """What ComfyUI hands a wrapper: callable, with the wrapped function as `original`."""

    def __init__(self, original: Callable, class_obj: object = None) -> None:
        self.original, self.class_obj = original, class_obj

    def __call__(self, *args, **kwargs):
        return self.original(*args, **kwargs)


class Model:
    """A stand-in diffusion model: apply_model with ComfyUI's signature, whose "blocks" look
    their ModelCall up in the transformer_options they are given and build one plan."""

    def __init__(self, state: ToMAState) -> None:
        self.state = state
        self.seen: list[ModelCall | None] = []
        self.steps: list[int] = []      # the run's step at each call (a host value)
        self.builds = 0

    def apply_model(self, x, t, c_concat=None, c_crossattn=None, control=None,
                    transformer_options={}, **kwargs):  # noqa: B006 (ComfyUI's signature)
        call = self.state.call_of(transformer_options)
        self.seen.append(call)
        self.steps.append(call.run.step if call is not None else -1)
        if call is not None and call.active:
            call.plan(("grid", 8, 8), self._build)
            call.record("block0", "8x8", 64, call.plans[("grid", 8, 8)])
        return x

    def _build(self):
        self.builds += 1
        return build_plan(torch.randn(1, 64, 4), 8, 8, 0.5, tile_count=4)


def apply(state: ToMAState, model: Model, x: torch.Tensor, options: dict) -> torch.Tensor:
    """One model call through the node's APPLY_MODEL wrapper (transformer_options by keyword)."""
    return state.apply_model_wrapper(Executor(model.apply_model), x, torch.zeros(1),
                                     transformer_options=options)


def sample(state: ToMAState, model: Model, run: RunState | None, steps: int,
           calls_per_step: int = 2, report: bool = True) -> list[int]:
    """A sampler through the node's SAMPLER_SAMPLE wrapper: KSAMPLER.sample's signature,
    `calls_per_step` model calls per step (CFG halves, a second-order corrector), the callback
    after each step (unless report is False). Returns each call's step."""
    options = {"transformer_options": {state.key: run} if run is not None else {}}
    theirs: list[int] = []

    def sampler(model_wrap, sigmas, extra_args, callback, noise, latent_image=None,
                denoise_mask=None, disable_pbar=False):
        for i in range(len(sigmas) - 1):
            for _ in range(calls_per_step):
                apply(state, model, noise, extra_args["model_options"]["transformer_options"])
            if report and callback is not None:
                callback(i, noise, noise, len(sigmas) - 1)
        return noise

    state.sampler_sample_wrapper(Executor(sampler), None, torch.linspace(1, 0, steps + 1),
                                 {"model_options": options}, lambda i, *rest: theirs.append(i),
                                 torch.zeros(1, 4))
    assert theirs == (list(range(steps)) if report else [])   # a callback already there runs
    return [step for call, step in zip(model.seen, model.steps, strict=True) if call is not None]


def test_steps_come_from_the_samplers_callback() -> None:
    """Every call of a step gets that step (a host int from the callback, whatever the number
    of model calls per step); the run learns the schedule's length from the sigmas."""
    state = ToMAState(make_options(0.5), "sdxl")
    run = state.new_run()
    model = Model(state)
    assert sample(state, model, run, steps=5, calls_per_step=3) == [s for s in range(5)
                                                                   for _ in range(3)]
    assert run.steps_total == 5 and run.step == 5 and run.steps_reported == 5
    assert run.model_calls == 15


def test_plans_follow_the_schedule_across_a_run() -> None:
    """recompute_every 2 over 6 steps of two calls each: built at steps 0, 2, 4; the run counts
    them; a second run builds again from its first step."""
    state = ToMAState(make_options(0.5, recompute_every=2), "sdxl")
    model = Model(state)
    run = state.new_run()
    sample(state, model, run, steps=6)
    assert model.builds == 3 and run.builds == 3
    assert run.levels == {"8x8": (64, 32)} and run.layers_merged == {"block0"}
    assert run.steps_merged == set(range(6))
    second = state.new_run()
    sample(state, model, second, steps=2)
    assert model.builds == 4 and second.builds == 1


def test_start_and_end_percent_window_the_merged_steps() -> None:
    state = ToMAState(make_options(0.5, start_percent=0.25, end_percent=0.75), "sdxl")
    model = Model(state)
    run = state.new_run()
    sample(state, model, run, steps=8)
    merged = sorted({step for call, step in zip(model.seen, model.steps, strict=True)
                     if call is not None and call.merging})
    assert merged == [2, 3, 4, 5]
    assert run.steps_merged == {2, 3, 4, 5}
    assert state.summary(run)["steps_merged"] == 4


def test_a_sampler_that_reports_no_steps_keeps_step_zero_and_says_so() -> None:
    state = ToMAState(make_options(0.5), "sdxl")
    model = Model(state)
    run = state.new_run()
    assert set(sample(state, model, run, steps=4, report=False)) == {0}
    assert model.builds == 1
    assert "the sampler reported no steps" in state.summary(run)["note"]


def test_the_call_reaches_the_blocks_in_transformer_options_only() -> None:
    """Blocks find their call under the node's call_key; without one (outside sampling, or
    another node's options) they find none; the call's options are a copy, the caller's stay as
    they were."""
    a, b = ToMAState(make_options(0.5), "flux"), ToMAState(make_options(0.5), "flux", depth=1)
    assert a.call_key != b.call_key and a.key != b.key          # a second ToMA node in a chain
    assert ToMAState(make_options(0.25), "flux").key == a.key   # the node run again
    model = Model(a)
    options = {"uuids": ["u"]}
    apply(a, model, torch.zeros(1, 4), options)
    assert isinstance(model.seen[0], ModelCall) and options == {"uuids": ["u"]}
    assert b.call_of({a.call_key: model.seen[0]}) is None
    assert a.call_of({}) is None and a.call_of({a.call_key: "not a call"}) is None
    # outside sampling (no RunState in the options) the wrapper still opens a call of its own
    assert model.seen[0].run is not None and model.steps[0] == 0


def test_plans_are_kept_per_batch_identity_and_device() -> None:
    """Calls of one identity (cond uuids, cond/uncond order, device) share their plans; another
    cond of the same shape or another device does not."""
    state = ToMAState(make_options(0.5, recompute_every=5), "flux")
    run = state.new_run()
    builds: list[int] = []

    def build():
        builds.append(1)

    for uuids, device in ((["a"], "cpu"), (["a"], "cpu"), (["b"], "cpu"), (["a"], "meta")):
        call, step = state.open_call(run, torch.empty(1, device=device),
                                     {"uuids": uuids, "cond_or_uncond": [0]})
        assert call.merging and call.identity[-1] == torch.device(device)
        built = len(call.plans)
        call.plan(("grid", 8, 10), build)
        state.close_call(call, step, built)
    assert len(builds) == 3
    assert run.builds == 3


def test_a_plan_of_none_is_kept() -> None:
    """A build that returns None (nothing to merge) is remembered for the call's identity, not
    retried by every block and call."""
    state = ToMAState(make_options(0.5, recompute_every=3), "flux")
    run = state.new_run()
    calls = []
    for _ in range(3):
        call = state.open_call(run, None, {})[0]
        assert call.plan("k", lambda: calls.append(1)) is None
        assert call.plan("k", lambda: calls.append(1)) is None
    assert len(calls) == 1


def test_a_model_call_made_by_hand_keeps_its_plans() -> None:
    """The benchmarks' way to run a block outside sampling: a ModelCall of their own with
    merging on; its plans dict keeps a plan across blocks and calls until cleared."""
    state = ToMAState(make_options(0.5), "flux")
    call = ModelCall(state.new_run(), grid=(1, 8, 8), merging=True, txt_len=4)
    assert call.active
    built = []
    call.plan("k", lambda: built.append(1) or "plan")
    call.plan("k", lambda: built.append(1) or "plan")
    assert built == [1] and call.plans == {"k": "plan"}
    call.plans.clear()
    call.plan("k", lambda: built.append(1) or "plan")
    assert built == [1, 1]
    assert not ModelCall(state.new_run(), mergeable=False, merging=True).active


def test_a_layer_that_runs_again_in_one_call_starts_the_next_pass() -> None:
    """pass_of numbers the passes over a model's blocks within one call: a layer seen again
    starts the next pass, and every layer of that pass belongs to it; a fresh call starts at 0,
    and outside a call (None) everything is pass 0."""
    state = ToMAState(make_options(0.5), "flux")
    call = ModelCall(state.new_run(), merging=True)
    passes = [call.pass_of(layer) for layer in ("d0", "d1", "s0", "d0", "d1", "s0", "d0")]
    assert passes == [0, 0, 0, 1, 1, 1, 2]
    assert ModelCall(state.new_run()).pass_of("d0") == 0


def test_index_tables_are_kept_for_the_run_per_partition_and_device() -> None:
    state = ToMAState(make_options(0.5), "flux")
    call = ModelCall(state.new_run(), merging=True)
    regions = make_regions(15, 22, "tile", 16)
    tables = call.tables(regions, torch.device("cpu"))
    assert call.tables(make_regions(15, 22, "tile", 16), torch.device("cpu")) is tables
    assert call.tables(regions, torch.device("meta")) is not tables


def test_close_call_adds_the_blocks_records_and_says_notes_once() -> None:
    state = ToMAState(make_options(0.5), "flux")
    run = state.new_run()
    call, step = state.open_call(run, torch.zeros(1), {})
    call.record("d0", "64x64", 4096, None)                      # ran unmerged
    call.plan("k", lambda: build_plan(torch.randn(1, 64, 4), 8, 8, 0.5, tile_count=4))
    call.record("d1", "64x64", 4096, call.plans["k"])
    call.note("something differs")
    call.note("something differs")
    state.close_call(call, step, 0)
    assert run.layers_seen == {"d0", "d1"} and run.layers_merged == {"d1"}
    assert run.levels == {"64x64": (4096, 32)} and run.builds == 1
    assert run.build_seconds is not None and run.build_seconds >= 0   # timed on the CPU
    assert run.notes == ["something differs"]


def test_notes_belong_to_the_run_that_caused_them() -> None:
    """ComfyUI caches the node's output, so one state serves many runs: a note a run's call
    made is in that run's stats only; what the node set up is in every run's."""
    state = ToMAState(make_options(0.5), "flux")
    state.setup_note("set up differently")
    first, second = state.new_run(), state.new_run()
    call, step = state.open_call(first, torch.zeros(1), {})
    call.note("this call differs")
    state.close_call(call, step, 0)
    assert "this call differs" in state.summary(first)["note"]
    assert "this call differs" not in state.summary(second)["note"]
    assert "set up differently" in state.summary(first)["note"]
    assert "set up differently" in state.summary(second)["note"]


def test_start_and_end_percent_are_fractions_of_the_noise_schedule() -> None:
    """With the run's sigmas and the window's sigmas (percent_to_sigma), a step merges when
    end_sigma < its sigma <= start_sigma, as ComfyUI's EasyCache reads the same widgets; the
    same steps merge when the schedule is split over two samplers (the second run starts
    from the split's sigma)."""
    sigmas = [1.0, 0.9, 0.7, 0.45, 0.3, 0.2, 0.1, 0.05, 0.0]
    full, head, tail = RunState(1), RunState(1), RunState(1)
    for run, part in ((full, sigmas), (head, sigmas[:5]), (tail, sigmas[4:])):
        run.sigmas, run.window = part, (0.7, 0.1)
    merged = [s for s in range(8) if full.in_window(s, 0.3, 0.9)]
    assert merged == [2, 3, 4, 5]
    split = ([s for s in range(4) if head.in_window(s, 0.3, 0.9)]
             + [4 + s for s in range(4) if tail.in_window(s, 0.3, 0.9)])
    assert split == merged
    # a model called outside ComfyUI's sampler: fractions of the steps
    outside = RunState(1)
    outside.steps_total = 4
    assert [s for s in range(4) if outside.in_window(s, 0.25, 0.75)] == [1, 2]


def test_a_block_finds_the_call_in_flight_when_its_caller_hands_no_options() -> None:
    """Another pack's copy of a model's forward may call the blocks without transformer_options
    (TeaCache's Flux): the block finds this thread's call in flight. Outside every call it
    finds none, and the runs in progress say who called the block."""
    state = ToMAState(make_options(0.5), "flux")
    run = state.new_run()
    state.runs.append(run)
    found = []

    def apply_model(x, t, transformer_options={}, **kwargs):  # noqa: B006
        found.append(state.call_of({}, x.device))
        return x

    state.apply_model_wrapper(Executor(apply_model), torch.zeros(1), torch.zeros(1),
                              transformer_options={state.key: run})
    assert isinstance(found[0], ModelCall) and found[0].run is run
    assert state.call_of({}, torch.device("cpu")) is None   # no call in flight
    assert any("test_run_state (test_a_block_finds_the_call_in_flight" in n and
               "outside ComfyUI's model call" in n for n in run.notes)


def test_a_compiled_block_without_options_finds_the_call_in_flight() -> None:
    """Traced by torch.compile, a block handed no transformer_options (TeaCache's forward, a
    family whose blocks get none) finds this thread's call too, in one graph, and the graph is
    guarded on what it read of it: a call that merges is traced anew, not replayed unmerged."""
    state = ToMAState(make_options(0.5, end_percent=0.5), "flux")

    @torch.compile(backend="eager", fullgraph=True)
    def block(x: torch.Tensor) -> torch.Tensor:
        call = state.call_of({}, x.device)
        return x * 2 if call is not None and call.active else x

    def apply_model(x, t, transformer_options={}, **kwargs):  # noqa: B006
        return block(x)

    run = state.new_run()
    run.steps_total = 4
    outs = []
    for step in (3, 0):               # outside start..end_percent, then inside
        run.step = step
        outs.append(state.apply_model_wrapper(Executor(apply_model), torch.ones(1),
                                              torch.zeros(1), transformer_options={state.key: run}))
    assert [float(out) for out in outs] == [1.0, 2.0]


def test_calls_on_threads_see_their_own_call() -> None:
    """v0.33 evaluates cond batches in a thread per device: each thread's blocks get the call
    of their own options, with no shared per-thread state to mix them up."""
    state = ToMAState(make_options(0.5), "flux")
    run = state.new_run()
    seen: dict[str, ModelCall | None] = {}
    barrier = threading.Barrier(2)

    def worker(name: str) -> None:
        def apply_model(x, t, transformer_options={}, **kwargs):  # noqa: B006
            barrier.wait(timeout=10)                 # both calls open at once
            seen[name] = state.call_of(transformer_options)
            return x

        state.apply_model_wrapper(Executor(apply_model), torch.zeros(1), torch.zeros(1),
                                  transformer_options={"uuids": [name], state.key: run})

    threads = [threading.Thread(target=worker, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen["a"].identity[0] == ("a",) and seen["b"].identity[0] == ("b",)
    assert seen["a"] is not seen["b"] and seen["a"].run is seen["b"].run is run
    assert run.model_calls == 2
