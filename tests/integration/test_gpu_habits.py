"""What a GPU would see of ToMA, counted on the CPU through real ComfyUI sampling.

- Host syncs: none inside any model call, first calls (index tables, plans) included, on every
  family (op_counts.py says what counts as one).
- Launches: ToMA's extra aten ops per steady model call against the unmerged model's, on SDXL's
  70-block structure and Flux.1's 19 + 38 blocks at 1024x1024 token grids and the node defaults
  (every call rebuilds its plans: recompute_every 1).
- torch.compile through ComfyUI's own TorchCompileModel: no graph break, one graph across
  blocks, steps and plan rebuilds (dynamo's counters), the same output as eager ToMA; one merged
  block compiles with fullgraph=True; on every transformer family no break ToMA brings.
Counts are stable where times are not, so they are tested; speed lives in bench/.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from op_counts import OpCounter
from test_tiny_models import assert_absent
from tiny_models import available, inputs, tiny_patcher

import comfy_harness as ch
from toma_pack.nodes import unet_patch
from toma_pack.nodes.apply import apply_toma
from toma_pack.nodes.options import make_options

# The budgets: ToMA's extra ops per steady model call, as a share of the unmerged
# call's, at the node defaults.
SDXL_BUDGET = 0.10
FLUX_BUDGET = 0.20


def counted(patcher, toma: bool, **options):
    """(patched model, counter): the counter outermost, ToMA (node defaults + options) inside."""
    counter = OpCounter()
    counter.install(patcher)
    return (apply_toma(patcher, make_options(**options)) if toma else patcher), counter


def sample_sdxl(model, side: int, steps: int = 3, cfg: float = 2.0) -> torch.Tensor:
    positive, negative = ch.sdxl_conds(1, side * 8, side * 8)
    with ch.attention_backend("sdpa"):
        return ch.sample(model, ch.empty_latent(model, 1, side, side), positive, negative,
                         steps=steps, cfg=cfg)


def sample_flux(model, side: int, steps: int = 3, cfg: float = 2.0) -> torch.Tensor:
    positive, negative = ch.flux_conds(1, 16)
    with ch.attention_backend("sdpa"):
        return ch.sample(model, ch.empty_latent(model, 1, side, side), positive, negative,
                         steps=steps, cfg=cfg)


# Launches ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["sdxl", "flux"])
def test_extra_ops_per_steady_model_call_within_budget(name):
    """At 1024x1024 (latent 128: SDXL's 64x64 and 32x32 attention levels both merge, Flux's
    64x64 image tokens), 3 euler steps, CFG 2 (SDXL) and 1 (Flux): ToMA adds at most 10%
    (SDXL) / 20% (Flux) to the ops of each steady call. Measured on v0.8.0: SDXL 5153 -> 5647
    (+494, 9.6%: per merged block one gather, a bmm and a baddbmm in, a baddbmm and a gather
    out, 2 views; per level a layer norm and the plan operator), Flux 4002 -> 4510 (+508,
    12.7%)."""
    build = ch.tiny_sdxl_patcher if name == "sdxl" else ch.tiny_flux_patcher
    run = sample_sdxl if name == "sdxl" else sample_flux
    budget = SDXL_BUDGET if name == "sdxl" else FLUX_BUDGET
    cfg = 2.0 if name == "sdxl" else 1.0     # Flux dev is guidance-distilled: cfg 1
    plain, plain_ops = counted(build(real_depths=True), toma=False)
    run(plain, 128, cfg=cfg)
    toma, toma_ops = counted(build(real_depths=True), toma=True)
    run(toma, 128, cfg=cfg)
    # ComfyUI batches cond and uncond into one call when it deems memory enough (so 3 or 6
    # calls); a call's ops do not depend on its batch size
    base, merged = plain_ops.totals(), toma_ops.totals()
    assert len(base) >= 3 and len(merged) >= 3 and len(set(base)) == 1
    steady = merged[1:]
    assert len(set(steady)) == 1, steady           # every steady call the same ops
    extra = steady[0] - base[0]
    print(f"{name}: {base[0]} -> {steady[0]} ops per call (+{extra}, {extra / base[0]:.1%}); "
          f"first call {merged[0]}")
    assert 0 < extra <= budget * base[0]
    assert toma_ops.ops[1]["plan_weights"] == 2    # one plan per level / block group


# Host syncs -------------------------------------------------------------------------------------
SYNC_FAMILIES = ["wan21_t2v", "wan22_5b", "wan22_5b_i2v", "qwen_image", "qwen_image_edit", "sd3",
                 "sd35", "hunyuan_video", "hunyuan_video15", "hunyuan_image", "lumina2",
                 "z_image", "flux2", "chroma", "ltxv", "ltxv_i2v", "ltxv_guide", "ltx2",
                 "ltx2_i2v", "hidream", "wan_vace", "wan_vace_ref", "kandinsky5",
                 "kandinsky5_i2v", "kandinsky5_image", "wan_camera", "wan_camera_i2v",
                 "wan22_camera_i2v", "wan_animate", "wan_animate_continue", "wan_vace2",
                 "wan22_fun_control", "hidream_o1", "qwen_image_edit_2511",
                 "flux2_timestep_zero", "krea2", "krea2_reference", "longcat_image",
                 "longcat_image_edit", "chroma_radiance", "mage_flow", "mage_flow_edit", "anima",
                 "wan_scail", "wan_scail2", "boogu", "boogu_edit", "ideogram4",
                 "ideogram4_padded", "omnigen2", "omnigen2_edit", "lens", "lens_padded",
                 "wan_dancer", "joyimage", "joyimage_edit", "ernie", "ernie_turbo"]


def assert_no_syncs(plain: OpCounter, toma: OpCounter, dropped: tuple[str, ...] = ()) -> None:
    """ToMA's calls sync exactly as often as the unmerged model's, first calls included, less
    the `dropped` kinds of sync (which the model makes only while unpatched). On these families
    the model itself never syncs, but for HiDream's MoE feed-forward (its expert routing
    indexes tokens by boolean masks, one index and one index_put_ per expert and block: 16 each
    per call on the tiny model, merged or not) and HiDream-O1 (its output's image tokens picked
    by a boolean mask, one a call; unpatched, its prompt cache lookup compares the prompt's ids
    with torch.equal, twice a call after the first)."""
    assert len(plain.syncs) == len(toma.syncs) > 0
    for i, (a, b) in enumerate(zip(plain.syncs, toma.syncs, strict=True)):
        want = a - Counter({kind: a[kind] for kind in dropped})
        assert b == want, f"model call {i}: {dict(b)} with ToMA, {dict(a)} without"


@pytest.mark.parametrize("name", ["sdxl", "flux"])
def test_no_host_syncs_sdxl_and_flux(name):
    """Both attention levels (SDXL at 1024: latent 128 at the tiny depths) and both Flux kinds
    merge; cfg 2 batches cond and uncond; the first call builds the tables and plans."""
    build = ch.tiny_sdxl_patcher if name == "sdxl" else ch.tiny_flux_patcher
    run = sample_sdxl if name == "sdxl" else sample_flux
    side = 128 if name == "sdxl" else 32
    options = {} if name == "sdxl" else {"skip_blocks": "none"}
    plain, plain_ops = counted(build(), toma=False)
    run(plain, side, steps=2)
    toma, toma_ops = counted(build(), toma=True, **options)
    run(toma, side, steps=2)
    assert_no_syncs(plain_ops, toma_ops)
    assert all(c["plan_weights"] > 0 for c in toma_ops.ops)     # merging really ran


@pytest.mark.parametrize("name", SYNC_FAMILIES)
def test_no_host_syncs_transformer_families(name):
    """Every transformer family on this ComfyUI, every block merged, CFG 2. Wan 2.2's and
    LTX's image-to-video frames are read from their denoise mask once per run and cond batch on
    the host (the frames to protect), Wan VACE's reference frames from its VACE mask, before
    the first call's blocks: those reads are a .tolist() a dispatch mode cannot see, and they
    are the only ones."""
    if not available(name):
        return assert_absent(name)
    plain_model = tiny_patcher(name)
    from tiny_models import family

    frames = 3 if family(name).video else 1
    x = inputs(name, plain_model, batch=1, height=8, width=8, frames=frames)
    plain, plain_ops = counted(plain_model, toma=False)
    ch.sample(plain, x.latent, x.positive, x.negative, steps=2, cfg=2.0, noise_mask=x.noise_mask)
    toma, toma_ops = counted(tiny_patcher(name), toma=True, skip_blocks="none", tile_count=4)
    ch.sample(toma, x.latent, x.positive, x.negative, steps=2, cfg=2.0, noise_mask=x.noise_mask)
    assert_no_syncs(plain_ops, toma_ops, ("equal",) if name == "hidream_o1" else ())
    assert all(c["plan_weights"] > 0 for c in toma_ops.ops), name


# torch.compile ----------------------------------------------------------------------------------
def compiled(model, backend: str = "eager", guard_filter=None):
    """`model` with ComfyUI's TorchCompileModel wrapper (comfy_api.torch_helpers, what the
    TorchCompileModel node installs on its clone; `guard_filter`: the node's guard_filter_fn,
    see node_guard_filter). The node offers inductor and cudagraphs; the graph-break and
    recompile counts are dynamo's, the same for every backend, so the fast "eager" backend is
    used for them and inductor where outputs are compared."""
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    m = model.clone()
    options = {"guard_filter_fn": guard_filter} if guard_filter else None
    set_torch_compile_wrapper(model=m, backend=backend, options=options)
    return m


def node_guard_filter():
    """The guard filter ComfyUI's TorchCompileModel node compiles with (0.8 and later: it drops
    every guard on transformer_options), or None where the node has none (0.3.64)."""
    import comfy_extras.nodes_torch_compile as node

    return getattr(node, "skip_torch_compile_dict", None)


@pytest.fixture
def dynamo_counters():
    """dynamo's counters, reset before and after the test (and its compiled code dropped)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield counters
    torch._dynamo.reset()
    counters.clear()


def graph_breaks(counters) -> dict:
    """Graph breaks, and what made dynamo give up on a whole frame and run it eagerly (an
    exception while tracing: counted as "unimplemented", not as a graph break)."""
    return dict(counters.get("graph_break", {})) | dict(counters.get("unimplemented", {}))


@pytest.mark.parametrize("name", ["sdxl", "flux"])
@pytest.mark.parametrize("recompute_every", [1, 2])
def test_torch_compile_one_graph_no_breaks(name, recompute_every, dynamo_counters):
    """ComfyUI's compile wrapper around ToMA, 5 steps with CFG: no graph break anywhere in the
    model, and one graph for every call, across blocks, steps and plan rebuilds; with
    recompute_every 2, the calls that reuse plans get the second graph they need, with or
    without guards on transformer_options (the node's filter from 0.8: the blocks ask a guarded
    global which plans are built, compile_guards.TRACED_PLANS)."""
    build = ch.tiny_sdxl_patcher if name == "sdxl" else ch.tiny_flux_patcher
    run = sample_sdxl if name == "sdxl" else sample_flux
    options = {"recompute_every": recompute_every}
    if name == "flux":
        options["skip_blocks"] = "none"
    model = compiled(apply_toma(build(), make_options(**options)), guard_filter=node_guard_filter())
    run(model, 64, steps=5)
    assert graph_breaks(dynamo_counters) == {}
    assert dynamo_counters["stats"]["unique_graphs"] == (2 if recompute_every > 1 else 1)


@pytest.mark.parametrize("levels", ["auto", "all"])
def test_torch_compile_with_the_gpu_level_rule(levels, dynamo_counters, monkeypatch):
    """The GPU's level rule (unet_patch.GPU_MIN_WORK; the CPU standing in for the GPU and the
    bar scaled to the tiny model: auto then merges nothing, all merges both levels with a
    note each) decides and notes inside the traced blocks without a break, in one graph."""
    monkeypatch.setattr(unet_patch, "GPU_DEVICES", ("cpu",))
    monkeypatch.setattr(unet_patch, "GPU_MIN_WORK", 32 * 32 * 64**2 + 1)
    model = compiled(apply_toma(ch.tiny_sdxl_patcher(), make_options(unet_levels=levels)),
                     guard_filter=node_guard_filter())
    sample_sdxl(model, 64, steps=5)
    assert graph_breaks(dynamo_counters) == {}
    assert dynamo_counters["stats"]["unique_graphs"] == 1


def compiled_run(name: str, toma: bool, sizes: tuple[tuple[int, int], ...] = ((8, 8),),
                 steps: int = 3) -> tuple[set[str], int]:
    """(graph break reasons, first line each; unique graphs) of `steps` steps with CFG of the
    family's tiny model under ComfyUI's compile wrapper, with ToMA (every block merged) or
    without, at each latent size of `sizes` in turn on the same compiled model."""
    import torch._dynamo
    from tiny_models import family
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    plain = tiny_patcher(name)
    model = apply_toma(plain, make_options(skip_blocks="none")) if toma else plain
    model = compiled(model, "eager", node_guard_filter())
    for height, width in sizes:
        x = inputs(name, plain, batch=1, height=height, width=width,
                   frames=3 if family(name).video else 1)
        with ch.attention_backend("sdpa"):
            ch.sample(model, x.latent, x.positive, x.negative, steps=steps, cfg=2.0,
                      noise_mask=x.noise_mask)
    reasons = {reason.split("\n")[0] for reason in graph_breaks(counters)}
    return reasons, counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("name", SYNC_FAMILIES)
def test_torch_compile_transformer_families(name, dynamo_counters):
    """Every transformer family on this ComfyUI under ComfyUI's compile wrapper: where the
    unmerged model compiles to one graph, so does ToMA, with no graph break; where ComfyUI's own
    code breaks the graph (HiDream's mixture-of-experts routing, LTX's data-dependent masks),
    ToMA adds no other kind of break. Object-patched blocks (Lumina 2, Z-Image, HiDream,
    Kandinsky 5) included: their calls are bound by name without inspect.Signature.bind, which
    dynamo cannot trace."""
    if not available(name):
        return assert_absent(name)
    plain, plain_graphs = compiled_run(name, toma=False)
    merged, graphs = compiled_run(name, toma=True)
    print(f"{name}: unmerged {plain_graphs} graph(s), breaks {sorted(plain)}; "
          f"ToMA {graphs}, breaks {sorted(merged)}")
    if not plain:
        assert plain_graphs == graphs == 1 and not merged
    assert merged <= plain


@pytest.mark.parametrize("name", ["wan21_t2v", "qwen_image", "lumina2", "ltx2_i2v", "sd3",
                                  "wan22_5b_i2v"])
def test_torch_compile_across_resolutions(name, dynamo_counters):
    """An artist changes the size between runs of one compiled model: dynamo recompiles, and
    after a change it makes sizes symbolic. ToMA's code then still traces: no kind of graph
    break, and no frame dynamo gives up on, that the unmerged model does not have (strings are
    made outside the model, positional rows compared item by item, no divmod or math.gcd on
    sizes). Families with "dit" patches, object patches, LTX-2's (rotation, split) rows after
    ComfyUI's own break on v0.33, and per-frame rows regrouped around kept frames."""
    if not available(name):
        return assert_absent(name)
    sizes = ((8, 8), (10, 12), (12, 6))
    plain, _ = compiled_run(name, toma=False, sizes=sizes, steps=2)
    merged, graphs = compiled_run(name, toma=True, sizes=sizes, steps=2)
    print(f"{name}: breaks unmerged {sorted(plain)}, ToMA {sorted(merged)} ({graphs} graphs)")
    assert merged <= plain


def toma_and_run(name: str):
    """(ToMA model at the node defaults, every Flux block merged; its sampler at 64x64, 2 steps)."""
    build = ch.tiny_sdxl_patcher if name == "sdxl" else ch.tiny_flux_patcher
    run = sample_sdxl if name == "sdxl" else sample_flux
    options = {} if name == "sdxl" else {"skip_blocks": "none"}
    toma = apply_toma(build(), make_options(**options))
    return toma, lambda model: run(model, 64, steps=2)


@pytest.mark.parametrize("name", ["sdxl", "flux"])
def test_torch_compile_matches_eager(name, dynamo_counters):
    """The compiled graph is eager ToMA: through aot_eager (dynamo's graph and AOT autograd's
    functionalised ops, run eagerly) the samples are bit-identical, with no graph break."""
    toma, run = toma_and_run(name)
    eager = run(toma)
    assert torch.equal(run(compiled(toma, "aot_eager")), eager)
    assert graph_breaks(dynamo_counters) == {}


def test_blocks_without_options_merge_under_compile(dynamo_counters, monkeypatch):
    """ERNIE-Image's blocks get no transformer_options (BlockKind.takes_options): compiled
    through aot_eager they find their model call on their thread (ToMAState.call_of) as eager
    ones do: every block merges, the sample is eager ToMA's bit for bit (it is not the unmerged
    one), no graph break."""
    from toma_pack.nodes import run_state

    if not available("ernie"):
        return assert_absent("ernie")
    sent: list[dict] = []
    monkeypatch.setattr(run_state, "send_stats", lambda node, stats: sent.append(stats))
    plain = tiny_patcher("ernie")
    x = inputs("ernie", plain, batch=1, height=8, width=8)
    toma = apply_toma(plain, make_options(skip_blocks="none"))

    def run(model) -> torch.Tensor:
        with ch.attention_backend("sdpa"):
            return ch.sample(model, x.latent, x.positive, x.negative, steps=2, cfg=2.0)

    eager = run(toma)
    out = run(compiled(toma, "aot_eager"))
    assert sent[-1]["layers_merged"] == sent[-1]["layers_total"] == 2
    assert torch.equal(out, eager) and not torch.equal(out, run(plain))
    assert graph_breaks(dynamo_counters) == {}


@pytest.mark.newest_tree
@pytest.mark.parametrize("name", ["sdxl", "flux"])
def test_torch_compile_inductor_near_eager(name, dynamo_counters):
    """Inductor (what TorchCompileModel runs on a CPU) computes the model's own ops with other
    roundings (the unmerged tiny Flux: 3.9e-6 relative), and ToMA's choices amplify such
    differences: a destination picked between two near-equal gains, and tau = 1000 in the
    assignment, turn a 1e-6 change of a similarity into a change of weights. Measured, inductor
    against eager ToMA: SDXL 3.5e-6 (bound 1e-5), Flux 1.27e-2 (bound 0.1); eager ToMA itself
    moves 3.6e-2 to 4.9e-2 on the tiny Flux when its input noise moves by 4e-6 relative."""
    toma, run = toma_and_run(name)
    eager = run(toma)
    out = run(compiled(toma, "inductor"))
    err = float((out - eager).norm() / eager.norm())
    print(f"{name}: inductor vs eager ToMA relative error {err:.2e}")
    assert graph_breaks(dynamo_counters) == {}
    assert err <= (1e-5 if name == "sdxl" else 0.1)


def test_step_window_under_the_nodes_own_compile(dynamo_counters, caplog):
    """end_percent 0.5 over 4 steps, compiled the way ComfyUI's TorchCompileModel node compiles
    (0.8+: with a guard filter that drops every guard on transformer_options, where the graph
    the first call traced would merge in every later step). ToMA's blocks read the decisions of
    each call from a guarded place too (compile_guards.TRACED_DECISIONS), so the first unmerged step
    gets a trace of its own: two graphs, no break, no warning, and the samples are eager ToMA's
    with the same window (merging steps 0 and 1 only: not those of ToMA merging every step)."""
    import logging

    model = ch.tiny_sdxl_patcher()
    window = apply_toma(model, make_options(end_percent=0.5))
    with caplog.at_level(logging.WARNING, logger="ToMA"):
        out = sample_sdxl(compiled(window, "aot_eager", node_guard_filter()), 64, steps=4)
    assert not [r for r in caplog.records if "compile" in r.getMessage()]
    assert torch.equal(out, sample_sdxl(window, 64, steps=4))
    assert not torch.equal(out, sample_sdxl(apply_toma(model, make_options()), 64, steps=4))
    assert dynamo_counters["stats"]["unique_graphs"] == 2
    assert graph_breaks(dynamo_counters) == {}


def test_one_merged_block_compiles_with_fullgraph(dynamo_counters):
    """ToMA's patched SDXL transformer block (the object patch ComfyUI installs: plan built from
    norm1, merge, the whole block on merged tokens, unmerge of its update) traces as one graph
    with fullgraph=True, and gives the eager result."""
    from toma_pack.nodes.model_call import ModelCall
    from toma_pack.nodes.run_state import ToMAState
    from toma_pack.nodes.unet_patch import UNetToMA

    model = ch.tiny_sdxl_patcher()
    block = model.model.diffusion_model.output_blocks[3][1].transformer_blocks[0]
    state = ToMAState(make_options(), "unet")
    toma = UNetToMA(state, "auto", largest_level_ds=2)
    forward = toma.block_forward(block, block.forward, foreign_forward=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 64 * 64, block.norm1.normalized_shape[0], generator=g)
    context = torch.randn(2, 8, ch.SDXL_CONTEXT_DIM, generator=g)

    run = state.new_run()

    def merged_block(x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        call = ModelCall(run, merging=True)
        options = {"activations_shape": [2, x.shape[-1], 64, 64],
                   "original_shape": [2, 4, 128, 128], "block": ("output", 3), "block_index": 0,
                   state.call_key: call}
        return forward(x, context=context, transformer_options=options)

    with torch.no_grad(), ch.attention_backend("sdpa"):   # the sub-quadratic one reads /proc
        eager = merged_block(x, context)
        out = torch.compile(merged_block, fullgraph=True, backend="eager")(x, context)
        plain = block(x, context=context)
    assert torch.allclose(out, eager, rtol=0, atol=1e-6)
    assert not torch.allclose(eager, plain, atol=1e-3)   # it did merge
