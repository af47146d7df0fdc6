"""ComfyUI's own conventions, through its real nodes and sampler:

- start_percent / end_percent are fractions of the noise schedule, read as ComfyUI's own nodes
  read them (EasyCache, ControlNet apply): the same sigmas merge whether one KSamplerAdvanced
  runs the schedule or two split it (the Wan 2.2 two-model graph, a hires pass).
- A note belongs to the run that caused it: ComfyUI reuses a node's output, so one patched
  model serves many runs, and a later run without the cause shows no note.
- A model compiled without guards on transformer_options (TorchCompileModel from 0.8, KJNodes'
  compile nodes everywhere) cannot go stale: runs that change what ToMA decides at equal
  shapes (the start frames an image-to-video mask gives, the widgets of a node run again)
  give eager ToMA's samples; and the compile is told apart from a guarded one.
"""

from __future__ import annotations

import peers
import pytest
import torch
import torch._dynamo
from peer_cases import case
from test_gpu_habits import compiled, graph_breaks
from tiny_models import inputs, tiny_patcher

import comfy_harness as ch
from toma_pack.nodes import run_state
from toma_pack.nodes.apply import apply_toma
from toma_pack.nodes.options import make_options


def merged_sigmas(model, x, runs: list[tuple[int, int]], steps: int) -> list[float]:
    """The sigmas of the model calls whose self-attention ran merged, over KSamplerAdvanced
    runs (start_at_step, end_at_step) of one schedule, each continuing the last one's
    latent, as ComfyUI's node chains them."""
    from comfy.patcher_extension import WrappersMP

    node = peers.comfy_node("nodes", "KSamplerAdvanced")
    seen: list[float] = []
    with peers.attention_lengths() as lengths:
        def record(executor, *args, **kwargs):
            before = len(lengths)
            out = executor(*args, **kwargs)
            sigma = float(args[1][0] if len(args) > 1 else kwargs["t"][0])   # apply_model's t
            if min(lengths[before:], default=48) < 48:      # 48: the whole video's tokens
                seen.append(round(sigma, 5))
            return out

        patched = model.clone()
        patched.add_wrapper_with_key(WrappersMP.APPLY_MODEL, "record", record)
        latent = {"samples": x.latent}
        for i, (start, end) in enumerate(runs):
            latent = peers.run_node(
                node, model=patched, add_noise="enable" if i == 0 else "disable",
                noise_seed=0, steps=steps, cfg=2.0, sampler_name="euler", scheduler="simple",
                positive=x.positive, negative=x.negative, latent_image=latent,
                start_at_step=start, end_at_step=end,
                return_with_leftover_noise="disable" if end >= steps else "enable")[0]
    return sorted(set(seen), reverse=True)


def test_step_window_is_on_the_noise_schedule_whatever_the_split() -> None:
    """start_percent 0.5 over 20 steps of Wan (shift 8): one KSamplerAdvanced and the same
    schedule split over two (steps 0-10, 10-20) merge the model calls of the same sigmas, those
    at or below start_percent's sigma (EasyCache's rule); as fractions of each sampler's own
    steps the split would merge 5-9 and 15-19."""
    model = tiny_patcher("wan21_t2v")
    x = inputs("wan21_t2v", model, 1, 8, 8, 3)
    toma = apply_toma(model, make_options(0.5, skip_blocks="none", start_percent=0.5))
    start_sigma = model.get_model_object("model_sampling").percent_to_sigma(0.5)
    one = merged_sigmas(toma, x, [(0, 20)], 20)
    split = merged_sigmas(toma, x, [(0, 10), (10, 20)], 20)
    print(f"start_percent 0.5 is sigma {start_sigma:.4f}; merged at {one}")
    assert one == split
    assert one and all(s <= start_sigma + 1e-6 for s in one)
    assert len(one) < 20
    ch.unload_models()


def test_a_note_belongs_to_the_run_that_caused_it() -> None:
    """One ToMA model (a node's cached output) sampled beside First Block Cache, which runs
    LTX-Video's blocks as one module of its own (ToMA says so), then alone: the second run's
    stats line has no word of First Block Cache."""
    c = case("ltxv")
    toma = c.toma(c.model)
    fbcache = peers.load("Comfy-WaveSpeed").node("ApplyFBCacheOnModel")
    beside = peers.run_node(fbcache, model=toma, object_to_patch="diffusion_model",
                            residual_diff_threshold=0.5, start=0.0, end=1.0,
                            max_consecutive_cache_hits=-1)[0]
    first = c.run(beside, 2)
    second = c.run(toma, 2)
    assert "Comfy-WaveSpeed" in first.note
    assert "Comfy-WaveSpeed" not in second.note and second.stats["layers_merged"] > 0
    ch.unload_models()


def node_filter():
    """The guard filter ComfyUI's TorchCompileModel (0.8 and later) and KJNodes' compile nodes
    compile with: every guard on transformer_options dropped."""
    return lambda entries: ["transformer_options" not in e.name for e in entries]


def start_frames(x, frames: int):
    """Wan 2.1 image-to-video conditioning whose concatenated mask gives the first `frames`
    frames (WanImageToVideo's layout: concat_mask 0 on given frames)."""
    def with_mask(cond):
        extras = dict(cond[0][1])
        mask = torch.ones_like(extras["concat_mask"])
        mask[:, :, :frames] = 0.0
        extras["concat_mask"] = mask
        return [[cond[0][0], extras]]

    return with_mask(x.positive), with_mask(x.negative)


@pytest.fixture
def dynamo():
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    yield counters
    torch._dynamo.reset()


def test_compiled_runs_follow_what_changes_at_equal_shapes(dynamo) -> None:
    """Under a compile without guards on transformer_options (aot_eager: dynamo's graphs, run
    eagerly), a sequence of runs at equal shapes: 1 then 2 given start frames (the protected
    prefix grows), then the node run again with another ratio. Each matches eager ToMA's
    samples bit for bit, where a replay of the first trace would merge the second start frame
    or keep the first ratio (the decisions are guarded through compile_guards.TRACED_DECISIONS); no
    graph break. (A prompt's length reaches the blocks as a tensor's shape, which dynamo guards,
    on every family but HiDream-O1, whose kept prompt is off under such a compile.)"""
    model = tiny_patcher("wan21_i2v")
    x = inputs("wan21_i2v", model, 1, 8, 8, 3)
    runs = [(0.5, 1), (0.5, 2), (0.25, 2)]
    outs = []
    with ch.attention_backend("sdpa"), torch.inference_mode():
        for ratio, given in runs:
            toma = apply_toma(model, make_options(ratio, skip_blocks="none"))
            positive, negative = start_frames(x, given)
            eager = ch.sample(toma, x.latent, positive, negative, steps=2, cfg=2.0)
            out = ch.sample(compiled(toma, "aot_eager", node_filter()), x.latent, positive,
                            negative, steps=2, cfg=2.0)
            outs.append(out)
            print(f"ratio {ratio}, {given} given frame(s): compiled - eager "
                  f"{float((out - eager).abs().max()):.2e}")
            assert torch.equal(out, eager)
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2])
    assert graph_breaks(dynamo) == {}
    ch.unload_models()


def test_plans_are_kept_across_steps_under_every_compile(dynamo) -> None:
    """recompute_every 2 under ComfyUI 0.3.64's compile (every guard kept) and under the filter
    of the 0.8 node (none on transformer_options): plans are built half as often as with
    recompute_every 1, nothing is said, and the unguarded compile's samples are eager ToMA's
    (a step that reuses its plans gets a trace of its own: compile_guards.TRACED_PLANS)."""
    c = case("flux")
    every, kept = (apply_toma(c.model, make_options(0.5, skip_blocks="none", recompute_every=n))
                   for n in (1, 2))
    eager = c.run(kept, 4)
    with_guards = c.run(compiled(kept, "aot_eager"), 4)
    torch._dynamo.reset()
    without = c.run(compiled(kept, "aot_eager", node_filter()), 4)
    torch._dynamo.reset()
    built_every_step = c.run(compiled(every, "aot_eager", node_filter()), 4)
    assert with_guards.stats["plans_built"] == without.stats["plans_built"] \
        == eager.stats["plans_built"]
    assert without.stats["plans_built"] * 2 == built_every_step.stats["plans_built"]
    assert "recompute_every" not in with_guards.note + without.note
    assert torch.equal(without.samples, eager.samples)
    assert torch.equal(with_guards.samples, eager.samples)
    assert not torch.equal(without.samples, built_every_step.samples)
    ch.unload_models()


@pytest.mark.parametrize("name", ["sdxl", "flux"])
def test_graph_breaks_inside_the_blocks(name: str, dynamo) -> None:
    """An unguarded compile whose graph breaks inside every block (ComfyUI's sub-quadratic
    attention, the CPU's default: dynamo then compiles each block's code once for all blocks
    and replays it): the samples are eager ToMA's bit for bit, with as many plans built and
    layers merged, and ToMA adds no kind of break. Replayed, a build decided on
    transformer_options would make every layer build its own plan, and a record appended to a
    list there would be replayed at the first traced block's position."""
    c = case(name)
    toma = c.toma(c.model)

    def run(model) -> tuple[torch.Tensor, dict]:
        sent: list[dict] = []
        original = run_state.send_stats
        run_state.send_stats = lambda node, stats: sent.append(stats)
        try:
            with ch.attention_backend("sub_quadratic"), torch.inference_mode():
                out = ch.sample(model, c.latent, c.positive, c.negative, steps=2, cfg=c.cfg)
        finally:
            run_state.send_stats = original
        return out, sent[-1] if sent else {}

    run(compiled(c.model, "aot_eager", node_filter()))
    plain = {reason.split("\n")[0] for reason in graph_breaks(dynamo)}
    assert plain, "the attention no longer breaks the graph: this test tests nothing"
    eager, eager_stats = run(toma)
    torch._dynamo.reset()
    dynamo.clear()
    out, stats = run(compiled(toma, "aot_eager", node_filter()))
    print(f"{name}: breaks unmerged {sorted(plain)}, ToMA "
          f"{sorted({reason.split(chr(10))[0] for reason in graph_breaks(dynamo)})}; "
          f"stats {stats}")
    assert torch.equal(out, eager)
    for key in ("plans_built", "layers_merged", "layers_total", "levels"):
        assert stats[key] == eager_stats[key], key
    assert {reason.split("\n")[0] for reason in graph_breaks(dynamo)} <= plain
    ch.unload_models()

