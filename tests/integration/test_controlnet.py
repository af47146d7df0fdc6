"""ControlNet beside ToMA, run the way ComfyUI runs it: tiny ControlNets built from ComfyUI's own
classes next to the tiny models of comfy_harness / tiny_models, applied by ComfyUI's own nodes,
sampled by ComfyUI's sampler.

ComfyUI has two kinds of ControlNet:

- Through the conditioning (SDXL's cldm ControlNet, Flux's XLabs ControlNet, Qwen-Image's
  InstantX and Fun ControlNets): ControlNetApplyAdvanced puts a ControlBase under each cond's
  "control" key. The sampler runs it for every model call (calc_cond_batch -> get_control) and
  hands its residuals to the diffusion model as the `control` argument; the model adds them to
  its streams between blocks: SDXL's UNet to the skip connections and the middle block's output
  (openaimodel.apply_control), Flux after every double and single block, Qwen-Image after every
  block. The ModelPatcher is not touched, so there is no node order: ToMA's patches cannot be
  put before or after the ControlNet, and ComfyUI's core has no other model patch that these
  ControlNets come with.
- Model patches (comfy_extras/nodes_model_patch.py): QwenImageDiffsynthControlnet, a
  "double_block" patch that computes and adds its residual after every Qwen-Image block, and
  ZImageFunControlnet (0.8+), "noise_refiner" and "double_block" patches that run Z-Image Fun
  control layers beside the model and add their residuals after some of its layers. There the
  ToMA node and the patch node are both model nodes, and both orders are tested. (SUPIR, the
  SDXL model patch of 0.33, has its widths fixed at SDXL's: no tiny one can be built.)

For each: the control acts (samples with it differ from samples without, with ToMA and
without), ToMA + ControlNet stays as close to the unmerged model + ControlNet as ToMA alone to
the unmerged model, and a recorded run shows the residuals added to full-length streams between
the blocks while ToMA merges inside them (and, for the transformers, carried through the next
merged block token by token: the block's output is its input plus the unmerged update).

Nodes and samplers run under torch.inference_mode, as ComfyUI's executor runs every node.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pytest
import tiny_models
import torch

import comfy_harness as ch
from toma_pack.nodes.apply import apply_toma
from toma_pack.nodes.dit_families import REGION_TOKENS
from toma_pack.nodes.dit_patch import existing_replace
from toma_pack.nodes.options import ToMAOptions, make_options
from toma_pack.toma_core import MergePlan, build_plan

if TYPE_CHECKING:
    from comfy.controlnet import ControlBase
    from comfy.model_patcher import ModelPatcher

Conditioning = ch.Conditioning
ModelNode = Callable[["ModelPatcher"], "ModelPatcher"]

RATIO = 0.5
STEPS = 2
STRENGTH = 1.0           # ControlNetApplyAdvanced's and the DiffSynth node's default
SDXL_LATENT = (64, 64)   # attention levels 32x32 (1024 tokens) and 16x16 (256, with the middle)
DIT_LATENT = (16, 20)    # Flux and Qwen-Image: 8 x 10 = 80 image tokens
FLUX_TEXT = 16


@dataclass(frozen=True)
class Measured:
    """Relative L2 errors of one model + ControlNet, measured on v0.3.64, v0.8.0 and v0.33.0
    (the same to 3 digits): control / control_toma: with vs without the ControlNet, unmerged /
    under ToMA; toma_cn: ToMA + ControlNet vs unmerged + ControlNet; ratio: toma_cn over ToMA
    alone vs the unmerged model (below 1 everywhere: the ControlNet adds no error of its own;
    its residuals join the stream exactly, between the blocks whose updates merging
    approximates)."""

    control: float
    control_toma: float
    toma_cn: float
    ratio: float


MEASURED = {
    "sdxl": Measured(control=0.542, control_toma=0.539, toma_cn=0.265, ratio=0.725),
    "flux": Measured(control=0.756, control_toma=0.761, toma_cn=0.111, ratio=0.514),
    "qwen_instantx": Measured(control=0.755, control_toma=0.756, toma_cn=0.0391, ratio=0.432),
    "qwen_fun": Measured(control=0.523, control_toma=0.523, toma_cn=0.0648, ratio=0.715),
    "diffsynth": Measured(control=0.589, control_toma=0.587, toma_cn=0.0763, ratio=0.842),
    "zimage_fun": Measured(control=0.658, control_toma=0.655, toma_cn=0.192, ratio=0.571),
}
# Bounds: measured x 0.9 and x 1.1 (a near-tie between two destinations falling the other way
# moves the samples by a few percent, see test_flux).
LOW, HIGH = 0.9, 1.1
# Merged blocks' output vs input + U (inner update): the same sum in another order, measured
# <= 9.7e-8 of the stream's largest value (Z-Image; Flux 8.2e-8 on v0.8.0, Qwen-Image 6.1e-8),
# bound x3.
CARRY_TOLERANCE = 2.9e-7


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def check_acts(kind: str, m: dict[str, float]) -> None:
    """The control moves the samples by about what it was measured to, unmerged and merged."""
    want = MEASURED[kind]
    assert m["control"] > want.control * LOW
    assert m["control_toma"] > want.control_toma * LOW


def check_close(kind: str, m: dict[str, float]) -> None:
    """ToMA + ControlNet within the measured distance of the unmerged model + ControlNet, and
    no further from it, relative to ToMA alone vs the unmerged model, than measured."""
    want = MEASURED[kind]
    assert want.toma_cn * LOW < m["toma_cn"] < want.toma_cn * HIGH
    assert m["ratio"] < want.ratio * HIGH


@pytest.fixture(scope="module", autouse=True)
def _as_comfyui_runs_nodes() -> Iterator[None]:
    """Every node and sampler call of this module under torch.inference_mode (ComfyUI's executor
    runs each node in it; v0.3.64 and v0.8.0 deep-copy model_options on clone, which a patch
    holding a tensor with autograd history would not survive), on one thread (conftest does that
    per test; the module's fixtures sample before it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with torch.inference_mode():
        yield
    torch.set_num_threads(threads)


# Building ControlNets as ComfyUI's loaders do ---------------------------------------------------
class LatentEncoder:
    """Stands in for the VAE that ControlNetApplyAdvanced and the model-patch nodes take with
    ControlNets working on latents (Qwen-Image's, Z-Image's); the ControlNet code calls only
    `encode` and `spacial_compression_encode` on it. encode: IMAGE [B, H, W, 3] -> 8x8 average
    pool -> a fixed seeded 3 -> 16 channel map: [B, 16, 1, H/8, W/8] as ComfyUI's Wan VAE
    (Qwen-Image's) returns an image's latent, [B, 16, H/8, W/8] with frames=False as the Flux VAE
    (Z-Image's) does."""

    def __init__(self, seed: int = 11, frames: bool = True) -> None:
        self.weight = torch.randn(16, 3, generator=torch.Generator().manual_seed(seed))
        self.frames = frames

    def spacial_compression_encode(self) -> int:
        return 8

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.avg_pool2d(pixels[..., :3].movedim(-1, 1), 8)
        latent = torch.einsum("oc,bchw->bohw", self.weight, x)
        return latent.unsqueeze(2) if self.frames else latent


def _operations() -> Any:
    """The operations ComfyUI's ControlNet loaders pick for fp32 weights on this device."""
    import comfy.ops

    return comfy.ops.pick_operations(torch.float32, None)


def _config(model: ModelPatcher) -> dict[str, Any]:
    """The diffusion model's unet_config as model detection gives it (without the inference
    dtype, which the loaders pass on their own)."""
    return {k: v for k, v in model.model.model_config.unet_config.items() if k != "dtype"}


def sdxl_controlnet(model: ModelPatcher, seed: int = 7) -> ControlBase:
    """A ControlNet for the tiny SDXL as load_controlnet_state_dict builds one from a ControlNet
    checkpoint: comfy.cldm.cldm.ControlNet from the UNet's config (out_channels dropped,
    hint_channels 3), wrapped in comfy.controlnet.ControlNet. Seeded weights like the harness's
    models (a trained ControlNet's zero convolutions have moved away from zero)."""
    import comfy.cldm.cldm
    import comfy.controlnet

    config = _config(model)
    config.pop("out_channels")
    config.update(hint_channels=3, operations=_operations(), dtype=torch.float32, device=ch.CPU)
    control_model = comfy.cldm.cldm.ControlNet(**config)
    ch.fill_weights(control_model, seed)
    return comfy.controlnet.ControlNet(control_model, global_average_pooling=False,
                                       load_device=ch.CPU, manual_cast_dtype=None)


def flux_controlnet(model: ModelPatcher, seed: int = 7) -> ControlBase:
    """An XLabs Flux ControlNet (hint image) for the tiny Flux, as
    load_controlnet_flux_xlabs_mistoline builds it: ControlNetFlux from the model's config, with
    the extra conds y and guidance."""
    import comfy.controlnet
    import comfy.ldm.flux.controlnet

    control_model = comfy.ldm.flux.controlnet.ControlNetFlux(
        mistoline=False, operations=_operations(), device=ch.CPU, dtype=torch.float32,
        **_config(model))
    ch.fill_weights(control_model, seed)
    return comfy.controlnet.ControlNet(control_model, load_device=ch.CPU, manual_cast_dtype=None,
                                       extra_conds=["y", "guidance"])


def qwen_instantx_controlnet(model: ModelPatcher, seed: int = 7) -> ControlBase:
    """An InstantX Qwen-Image ControlNet for the tiny Qwen-Image, as
    load_controlnet_qwen_instantx builds it: QwenImageControlNetModel from the model's config,
    its hint a latent (Wan 2.1 latent format: it needs the VAE input of the apply node)."""
    import comfy.controlnet
    import comfy.latent_formats
    import comfy.ldm.qwen_image.controlnet

    control_model = comfy.ldm.qwen_image.controlnet.QwenImageControlNetModel(
        extra_condition_channels=0, operations=_operations(), device=ch.CPU, dtype=torch.float32,
        **_config(model))
    ch.fill_weights(control_model, seed)
    return comfy.controlnet.ControlNet(control_model, compression_ratio=1,
                                       latent_format=comfy.latent_formats.Wan21(),
                                       load_device=ch.CPU, manual_cast_dtype=None, extra_conds=[])


def qwen_fun_controlnet(model: ModelPatcher, seed: int = 7) -> ControlBase:
    """A Fun Qwen-Image ControlNet through ComfyUI's own loader: load_controlnet_state_dict on the
    state dict of a QwenImageFunControlNetModel at the tiny model's width (the loader reads the
    widths from the weights; blocks, depth 60 and injection layers 0, 12, ... are fixed there, so
    the tiny 2-block model gets its residual after block 0)."""
    import comfy.controlnet
    import comfy.ldm.qwen_image.controlnet

    config = _config(model)
    fun = comfy.ldm.qwen_image.controlnet.QwenImageFunControlNetModel(
        control_in_features=132, inner_dim=config["num_attention_heads"] *
        config["attention_head_dim"], num_attention_heads=config["num_attention_heads"],
        attention_head_dim=config["attention_head_dim"], operations=_operations(),
        device=ch.CPU, dtype=torch.float32)
    ch.fill_weights(fun, seed)
    return comfy.controlnet.load_controlnet_state_dict(fun.state_dict())


def apply_controlnet(positive: Conditioning, negative: Conditioning, control: ControlBase,
                     image: torch.Tensor,
                     vae: LatentEncoder | None = None) -> tuple[Conditioning, Conditioning]:
    """ComfyUI's ControlNetApplyAdvanced node (nodes.py) on (positive, negative)."""
    node = ch.comfy_top_level_nodes().ControlNetApplyAdvanced()
    return node.apply_controlnet(positive, negative, control, image, STRENGTH, 0.0, 1.0, vae=vae)


def hint_image(latent_hw: tuple[int, int], seed: int = 3) -> torch.Tensor:
    """An IMAGE [1, H, W, 3] in [0, 1] at the latent's pixel size."""
    h, w = latent_hw
    return torch.rand(1, h * 8, w * 8, 3, generator=torch.Generator().manual_seed(seed))


# Recording ------------------------------------------------------------------------------------
@dataclass
class ModelCallRecord:
    """One diffusion model call: the residuals it was handed (cloned), what was left of them
    after the call, and the stream at every block boundary."""

    control: dict[str, list[torch.Tensor | None]]
    left: dict[str, int] = field(default_factory=dict)
    outer: list[dict] = field(default_factory=list)    # kind, index, in, out at ToMA's patch
    inner: list[dict] = field(default_factory=list)    # the same for what reached the block
    final: torch.Tensor | None = None                  # the stream after the last block
    # UNet: (name, stream shape, residual shape, stream after == before + residual) per add
    added: list[tuple[str, tuple, tuple, bool]] = field(default_factory=list)


class RunRecorder:
    """Records one sampling run of a patched clone: a DIFFUSION_MODEL wrapper (each call's
    `control` argument), "dit" replace patches on every block outside ToMA's (`outer`, the
    stream entering and leaving ToMA's patch) and inside (`inner`, installed before ToMA: what
    reaches ComfyUI's block), and an object patch on the layer after the blocks."""

    KEY = "test_controlnet_record"

    def __init__(self) -> None:
        self.calls: list[ModelCallRecord] = []

    def wrap_calls(self, model: ModelPatcher) -> None:
        from comfy.patcher_extension import WrappersMP

        def wrapper(executor, *args, **kwargs):
            bound = inspect.signature(executor.original).bind(*args, **kwargs).arguments
            control = bound.get("control") or {}
            record = ModelCallRecord({key: [None if t is None else t.clone() for t in values]
                                      for key, values in control.items()})
            self.calls.append(record)
            out = executor(*args, **kwargs)
            record.left = {key: len(values) for key, values in control.items()}
            return out

        model.add_wrapper_with_key(WrappersMP.DIFFUSION_MODEL, self.KEY, wrapper)

    def patch_blocks(self, model: ModelPatcher, kinds: dict[str, int], inner: bool) -> None:
        for kind, depth in kinds.items():
            for i in range(depth):
                previous = existing_replace(model, kind, i)
                model.set_model_patch_replace(self._block(kind, i, previous, inner), "dit",
                                              kind, i)

    def _block(self, kind: str, index: int, previous: Callable | None, inner: bool) -> Callable:
        def patch(args: dict, extra: dict) -> dict:
            entry = {"kind": kind, "index": index,
                     "in": {k: args[k].clone() for k in ("img", "txt") if torch.is_tensor(
                         args.get(k))}}
            out = previous(args, extra) if previous is not None else extra["original_block"](args)
            entry["out"] = {k: out[k].clone() for k in ("img", "txt") if torch.is_tensor(
                out.get(k))}
            (self.calls[-1].inner if inner else self.calls[-1].outer).append(entry)
            return out

        return patch

    def patch_layers(self, model: ModelPatcher, depth: int, inner: bool) -> None:
        """Object patches on the forward of Lumina 2 / Z-Image's `layers` (which ComfyUI calls
        without replace patches; ToMA patches the same forwards), recording x in and out like
        the "dit" patches record img; each wraps the object patch that was there."""
        for i in range(depth):
            layer = model.get_model_object(f"diffusion_model.layers.{i}")
            key = f"diffusion_model.layers.{i}.forward"
            previous = model.object_patches.get(key) or types.MethodType(type(layer).forward,
                                                                         layer)
            model.add_object_patch(key, self._layer(i, layer, previous, inner))

    def _layer(self, index: int, layer: torch.nn.Module, previous: Callable,
               inner: bool) -> Callable:
        signature = inspect.signature(types.MethodType(type(layer).forward, layer))

        def forward(*args, **kwargs) -> torch.Tensor:
            x = signature.bind(*args, **kwargs).arguments["x"]
            entry = {"kind": "layer", "index": index, "in": {"img": x.clone()}}
            out = previous(*args, **kwargs)
            entry["out"] = {"img": out.clone()}
            (self.calls[-1].inner if inner else self.calls[-1].outer).append(entry)
            return out

        return forward

    def patch_final(self, model: ModelPatcher, path: str) -> None:
        """Record the input of diffusion_model.<path> (final_layer; Qwen's norm_out)."""
        module = model.get_model_object(f"diffusion_model.{path}")
        original = types.MethodType(type(module).forward, module)

        def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            self.calls[-1].final = x.clone()
            return original(x, *args, **kwargs)

        model.add_object_patch(f"diffusion_model.{path}.forward", forward)


def merged_levels(stats: list[dict]) -> dict[str, int]:
    return {lv["name"]: lv["merged_tokens"] for lv in stats[-1]["levels"]}


# The four samples of one model and ControlNet ---------------------------------------------------
@dataclass
class Samples:
    """Unmerged / ToMA, each without and with the ControlNet, from the same noise."""

    base: torch.Tensor
    base_cn: torch.Tensor
    toma: torch.Tensor
    toma_cn: torch.Tensor

    def measured(self) -> dict[str, float]:
        """The relative errors the tests bound (printed with -s: the values in the comments)."""
        values = {"control": rel_err(self.base_cn, self.base),
                  "control_toma": rel_err(self.toma_cn, self.toma),
                  "toma": rel_err(self.toma, self.base),
                  "toma_cn": rel_err(self.toma_cn, self.base_cn)}
        values["ratio"] = values["toma_cn"] / values["toma"]
        print({k: round(v, 4) for k, v in values.items()})
        return values


def four_samples(model: ModelPatcher, options: ToMAOptions, run: Callable[..., torch.Tensor],
                 plain: tuple[Conditioning, Conditioning],
                 controlled: tuple[Conditioning, Conditioning]) -> Samples:
    """run(model, positive, negative) on the unmerged model and on ToMA's clone, with the plain
    conds and with the ControlNet's (what ControlNetApplyAdvanced made of them)."""
    toma = apply_toma(model, options)
    return Samples(run(model, *plain), run(model, *controlled), run(toma, *plain),
                   run(toma, *controlled))


# SDXL -------------------------------------------------------------------------------------------
def run_sdxl(model: ModelPatcher, positive: Conditioning,
             negative: Conditioning) -> torch.Tensor:
    return ch.sample(model, ch.empty_latent(model, 1, *SDXL_LATENT), positive, negative,
                     steps=STEPS, cfg=2.0)


@pytest.fixture(scope="module")
def sdxl() -> dict[str, Any]:
    model = ch.tiny_sdxl_patcher()
    plain = ch.sdxl_conds(1, SDXL_LATENT[1] * 8, SDXL_LATENT[0] * 8)
    control = sdxl_controlnet(model)
    controlled = apply_controlnet(*plain, control, hint_image(SDXL_LATENT))
    return {"model": model, "plain": plain, "controlled": controlled}


@pytest.fixture(scope="module")
def sdxl_samples(sdxl) -> Samples:
    return four_samples(sdxl["model"], make_options(RATIO), run_sdxl, sdxl["plain"],
                        sdxl["controlled"])


def test_sdxl_controlnet_acts_with_and_without_toma(sdxl_samples):
    """The ControlNet moves the samples, as much with ToMA as without."""
    m = sdxl_samples.measured()
    check_acts("sdxl", m)


def test_sdxl_toma_with_controlnet_stays_as_close_as_without(sdxl_samples):
    """ToMA + ControlNet vs the unmerged model + ControlNet: no further from it than ToMA alone
    from the unmerged model (the residuals join outside the merged transformer blocks)."""
    m = sdxl_samples.measured()
    check_close("sdxl", m)


def test_sdxl_residuals_join_full_size_streams(sdxl, monkeypatch, stats):
    """Every residual of the ControlNet (one per skip connection, one for the middle block) is
    added by ComfyUI's apply_control to a full-size UNet stream [B, C, H/ds, W/ds], in the UNet's
    own loop outside the transformer blocks ToMA merges (every level merged here, the middle
    block too), and every one is used."""
    import comfy.ldm.modules.diffusionmodules.openaimodel as openaimodel

    recorder = RunRecorder()
    original = openaimodel.apply_control

    def apply_control(h: torch.Tensor, control, name: str) -> torch.Tensor:
        residuals = (control or {}).get(name) or []
        residual = residuals[-1] if residuals else None
        before = h.clone()
        out = original(h, control, name)
        if residual is not None:
            recorder.calls[-1].added.append((name, tuple(before.shape), tuple(residual.shape),
                                             torch.equal(out, before + residual)))
        return out

    monkeypatch.setattr(openaimodel, "apply_control", apply_control)
    model = apply_toma(sdxl["model"], make_options(RATIO, unet_levels="all"))
    recorder.wrap_calls(model)
    run_sdxl(model, *sdxl["controlled"])
    assert merged_levels(stats) == {"32x32": 512, "16x16": 128}
    assert len(recorder.calls) == STEPS                    # cond and uncond in one call
    for call in recorder.calls:
        assert {k: len(v) for k, v in call.control.items()} == {"input": 0, "middle": 1,
                                                                "output": 9}
        assert call.left == {"input": 0, "middle": 0, "output": 0}     # all of them taken
        assert len(call.added) == 10
        for name, stream, residual, exact in call.added:
            assert name in ("middle", "output")
            assert stream == residual and exact
            batch, _, h, w = stream
            assert batch == 2 and (h, w) in {(64, 64), (32, 32), (16, 16)}


# Flux -------------------------------------------------------------------------------------------
FLUX_KINDS = {"double_block": 2, "single_block": 2}


def run_flux(model: ModelPatcher, positive: Conditioning,
             negative: Conditioning) -> torch.Tensor:
    return ch.sample(model, ch.empty_latent(model, 1, *DIT_LATENT), positive, negative,
                     steps=STEPS, cfg=1.0)


def flux_options() -> ToMAOptions:
    return make_options(RATIO, skip_blocks="none")   # the default skips would skip all 2+2


@pytest.fixture(scope="module")
def flux() -> dict[str, Any]:
    model = ch.tiny_flux_patcher()
    plain = ch.flux_conds(1, FLUX_TEXT)
    controlled = apply_controlnet(*plain, flux_controlnet(model), hint_image(DIT_LATENT))
    return {"model": model, "plain": plain, "controlled": controlled}


@pytest.fixture(scope="module")
def flux_samples(flux) -> Samples:
    return four_samples(flux["model"], flux_options(), run_flux, flux["plain"],
                        flux["controlled"])


def test_flux_controlnet_acts_with_and_without_toma(flux_samples):
    m = flux_samples.measured()
    check_acts("flux", m)


def test_flux_toma_with_controlnet_stays_as_close_as_without(flux_samples):
    m = flux_samples.measured()
    check_close("flux", m)


def rebuilt_plan(stream: torch.Tensor, prefix: int, h: int, w: int) -> MergePlan:
    """The plan ToMA's defaults give for the h x w grid at `prefix` in a group's first block
    input, rebuilt here with toma_core (regions of about REGION_TOKENS tokens)."""
    plan = build_plan(stream, h, w, RATIO, tile_count=max(1, round(h * w / REGION_TOKENS)),
                      offset=prefix, center=True)
    assert plan is not None
    return plan


# kind of block -> (row of the first image token in its stream, the stream's full length)
Layout = dict[str, tuple[int, int]]


def check_boundaries(call: ModelCallRecord,
                     residuals: list[tuple[str, int, torch.Tensor | None]], layout: Layout,
                     tokens: int, final_from: int = 0) -> None:
    """Between blocks: every block's output stream leaves ToMA's patch at full length, the next
    block's input is that output plus the residual added to its first `tokens` image rows, and
    the stream after the last block (from row `final_from`: Flux's final layer takes the image
    rows) likewise. residuals: (kind, index, residual or None) of each block in order."""
    blocks = call.outer
    assert [(b["kind"], b["index"]) for b in blocks] == [(k, i) for k, i, _ in residuals]
    for n, (block, (kind, _, residual)) in enumerate(zip(blocks, residuals, strict=True)):
        out = block["out"]["img"]
        offset, length = layout[kind]
        assert out.shape[1] == length
        expected = out.clone()
        if residual is not None:
            assert residual.shape[1] == tokens
            expected[:, offset:offset + tokens] += residual
        if n + 1 < len(blocks):
            following = blocks[n + 1]
            seen = following["in"]["img"]
            if following["kind"] != kind:                      # Flux: [text; image] from here
                expected = torch.cat((block["out"]["txt"], expected), dim=1)
            assert torch.equal(seen, expected), (kind, n)
            if "txt" in following["in"]:
                assert torch.equal(following["in"]["txt"], block["out"]["txt"])
        else:
            assert torch.equal(call.final, expected[:, final_from:])


def check_carried_through(call: ModelCallRecord, layout: Layout, h: int, w: int) -> float:
    """In every merged block the stream (residuals included) passes token by token: the output
    is the input plus the unmerged update of the merged block, U (inner out - inner in), U from
    the plan rebuilt from the group's first input. Returns the largest deviation relative to the
    stream's largest value."""
    worst = 0.0
    plans: dict[str, MergePlan] = {}
    for outer, inner in zip(call.outer, call.inner, strict=True):
        kind = outer["kind"]
        offset, _ = layout[kind]
        x_in, x_out = outer["in"]["img"], outer["out"]["img"]
        assert inner["in"]["img"].shape[1] < x_in.shape[1]      # merged inside
        if kind not in plans:
            plans[kind] = rebuilt_plan(x_in, offset, h, w)
        plan = plans[kind]
        update = plan.unmerge(inner["out"]["img"] - inner["in"]["img"], offset)
        worst = max(worst, float((x_out - x_in - update).abs().max() / x_in.abs().max()))
    return worst


def test_flux_residuals_join_full_length_streams(flux):
    """ComfyUI adds the ControlNet's residual for double block i to the full image stream after
    it (control["input"][i]) and single block i's to the image rows of [text; image]
    (control["output"][i]); ToMA merges every block inside, and hands the next block and the
    final layer the full stream with the residual in it, carried token by token."""
    recorder = RunRecorder()
    model = flux["model"].clone()
    recorder.patch_blocks(model, FLUX_KINDS, inner=True)
    model = apply_toma(model, flux_options())
    recorder.patch_blocks(model, FLUX_KINDS, inner=False)
    recorder.wrap_calls(model)
    recorder.patch_final(model, "final_layer")
    run_flux(model, *flux["controlled"])
    h, w = DIT_LATENT[0] // 2, DIT_LATENT[1] // 2
    layout = {"double_block": (0, h * w), "single_block": (FLUX_TEXT, FLUX_TEXT + h * w)}
    assert len(recorder.calls) == STEPS
    worst = 0.0
    for call in recorder.calls:
        # the XLabs ControlNet's residuals, repeated to Flux.1's 19 double and 38 single blocks
        assert {k: len(v) for k, v in call.control.items()} == {"input": 19, "middle": 0,
                                                                "output": 38}
        residuals = [("double_block", i, call.control["input"][i]) for i in range(2)]
        residuals += [("single_block", i, call.control["output"][i]) for i in range(2)]
        check_boundaries(call, residuals, layout, h * w, final_from=FLUX_TEXT)
        worst = max(worst, check_carried_through(call, layout, h, w))
    print(f"flux: largest deviation from the update rule {worst:.2e}")
    assert worst < CARRY_TOLERANCE


# Qwen-Image -------------------------------------------------------------------------------------
QWEN_KINDS = {"double_block": 2}


def run_qwen(model: ModelPatcher, positive: Conditioning,
             negative: Conditioning) -> torch.Tensor:
    x = tiny_models.inputs("qwen_image", model, height=DIT_LATENT[0], width=DIT_LATENT[1])
    return ch.sample(model, x.latent, positive, negative, steps=STEPS, cfg=2.0)


def qwen_layout() -> Layout:
    """Qwen-Image's image stream: the 8 x 10 image tokens alone (text is a stream of its own)."""
    return {"double_block": (0, DIT_LATENT[0] // 2 * (DIT_LATENT[1] // 2))}


def qwen_options() -> ToMAOptions:
    return make_options(RATIO, skip_blocks="none")


def qwen_conds(model: ModelPatcher) -> tuple[Conditioning, Conditioning]:
    x = tiny_models.inputs("qwen_image", model, height=DIT_LATENT[0], width=DIT_LATENT[1])
    return x.positive, x.negative


@pytest.fixture(scope="module")
def qwen() -> dict[str, Any]:
    model = tiny_models.tiny_patcher("qwen_image")
    plain = qwen_conds(model)
    controlled = apply_controlnet(*plain, qwen_instantx_controlnet(model),
                                  hint_image(DIT_LATENT), vae=LatentEncoder())
    return {"model": model, "plain": plain, "controlled": controlled}


@pytest.fixture(scope="module")
def qwen_samples(qwen) -> Samples:
    return four_samples(qwen["model"], qwen_options(), run_qwen, qwen["plain"],
                        qwen["controlled"])


def test_qwen_instantx_controlnet_acts_with_and_without_toma(qwen_samples):
    m = qwen_samples.measured()
    check_acts("qwen_instantx", m)


def test_qwen_instantx_toma_with_controlnet_stays_as_close_as_without(qwen_samples):
    m = qwen_samples.measured()
    check_close("qwen_instantx", m)


def recorded_qwen(model: ModelPatcher, positive: Conditioning, negative: Conditioning,
                  before: ModelNode | None = None,
                  after: ModelNode | None = None) -> RunRecorder:
    """One recorded ToMA run of the tiny Qwen-Image; `before` / `after`: a model node applied
    before / after ToMA."""
    recorder = RunRecorder()
    inner = (before or (lambda m: m))(model).clone()
    recorder.patch_blocks(inner, QWEN_KINDS, inner=True)
    toma = apply_toma(inner, qwen_options())
    if after is not None:
        toma = after(toma)
    recorder.patch_blocks(toma, QWEN_KINDS, inner=False)
    recorder.wrap_calls(toma)
    recorder.patch_final(toma, "norm_out")
    run_qwen(toma, positive, negative)
    assert len(recorder.calls) == STEPS
    return recorder


def test_qwen_instantx_residuals_join_full_length_streams(qwen):
    """After every block ComfyUI adds control["input"][i] to the image stream; ToMA merges both
    blocks inside and hands on the full stream with the residual in it."""
    recorder = recorded_qwen(qwen["model"], *qwen["controlled"])
    h, w = DIT_LATENT[0] // 2, DIT_LATENT[1] // 2
    worst = 0.0
    for call in recorder.calls:
        # the residuals of its 2 blocks repeated to Qwen-Image's depth 60
        assert {k: len(v) for k, v in call.control.items()} == {"input": 60, "middle": 0,
                                                                "output": 0}
        check_boundaries(call, [("double_block", i, call.control["input"][i]) for i in range(2)],
                         qwen_layout(), h * w)
        worst = max(worst, check_carried_through(call, qwen_layout(), h, w))
    print(f"qwen instantx: largest deviation from the update rule {worst:.2e}")
    assert worst < CARRY_TOLERANCE


def fun_available() -> bool:
    import comfy.controlnet

    return hasattr(comfy.controlnet, "load_controlnet_qwen_fun")


def assert_fun_absent() -> None:
    """Where ComfyUI has no Fun ControlNet loader (before 0.33 among the tested versions), its
    model class is absent too: nothing to test there."""
    import comfy.ldm.qwen_image.controlnet

    assert ch.comfy_version() < (0, 33)
    assert not hasattr(comfy.ldm.qwen_image.controlnet, "QwenImageFunControlNetModel")


@pytest.fixture(scope="module")
def qwen_fun(qwen) -> dict[str, Any] | None:
    if not fun_available():
        return None
    model, plain = qwen["model"], qwen["plain"]
    control = qwen_fun_controlnet(model)
    controlled = apply_controlnet(*plain, control, hint_image(DIT_LATENT), vae=LatentEncoder())
    return {"control": control, "controlled": controlled}


@pytest.fixture(scope="module")
def qwen_fun_samples(qwen, qwen_fun) -> Samples | None:
    if qwen_fun is None:
        return None
    return four_samples(qwen["model"], qwen_options(), run_qwen, qwen["plain"],
                        qwen_fun["controlled"])


def test_qwen_fun_controlnet_acts_with_and_without_toma(qwen_fun, qwen_fun_samples):
    if qwen_fun is None:
        return assert_fun_absent()
    import comfy.controlnet

    assert isinstance(qwen_fun["control"], comfy.controlnet.QwenFunControlNet)
    m = qwen_fun_samples.measured()
    check_acts("qwen_fun", m)


def test_qwen_fun_toma_with_controlnet_stays_as_close_as_without(qwen_fun_samples):
    if qwen_fun_samples is None:
        return assert_fun_absent()
    m = qwen_fun_samples.measured()
    check_close("qwen_fun", m)


def test_qwen_fun_residual_joins_the_full_length_stream(qwen, qwen_fun):
    """The Fun ControlNet's control blocks run beside the model (on its img_in and RoPE, with
    transformer_options of their own, so ToMA's patches are not in them) and inject after block
    0 only (injection layers 0, 12, ...): ComfyUI adds that residual to the full stream ToMA
    hands on, and none after block 1."""
    if qwen_fun is None:
        return assert_fun_absent()
    recorder = recorded_qwen(qwen["model"], *qwen_fun["controlled"])
    h, w = DIT_LATENT[0] // 2, DIT_LATENT[1] // 2
    for call in recorder.calls:
        assert len(call.control.get("input", ())) == 60
        first, second = call.control["input"][:2]
        assert first is not None and second is None
        check_boundaries(call, [("double_block", 0, first), ("double_block", 1, None)],
                         qwen_layout(), h * w)
        assert check_carried_through(call, qwen_layout(), h, w) < CARRY_TOLERANCE


# Qwen-Image, DiffSynth model-patch ControlNet ---------------------------------------------------
ORDERS = ["patch_first", "toma_first"]


def diffsynth_node(model: ModelPatcher, seed: int = 9) -> ModelNode:
    """model -> model with ComfyUI's QwenImageDiffsynthControlnet node applied (the node called as
    ComfyUI calls it), its MODEL_PATCH as ModelPatchLoader builds one from a DiffSynth checkpoint
    (QwenImageBlockWiseControlNet, manual_cast operations, in a ModelPatcher), at the tiny
    model's width and depth (the loader's are Qwen-Image's 3072 and 60)."""
    import comfy.model_patcher
    import comfy.ops

    patches = importlib.import_module("comfy_extras.nodes_model_patch")
    config = _config(model)
    control = patches.QwenImageBlockWiseControlNet(
        num_layers=config["num_layers"], in_dim=64, additional_in_dim=0,
        dim=config["num_attention_heads"] * config["attention_head_dim"], device=ch.CPU,
        dtype=torch.float32, operations=comfy.ops.manual_cast)
    ch.fill_weights(control, seed)
    patcher_class = getattr(comfy.model_patcher, "CoreModelPatcher",
                            comfy.model_patcher.ModelPatcher)
    model_patch = patcher_class(control, load_device=ch.CPU, offload_device=ch.CPU)
    node = patches.QwenImageDiffsynthControlnet
    image, vae = hint_image(DIT_LATENT), LatentEncoder()

    def apply(m: ModelPatcher) -> ModelPatcher:
        return getattr(node(), node.FUNCTION)(m, model_patch, vae, image, STRENGTH)[0]

    return apply


def compose(model: ModelPatcher, order: str, patch: ModelNode) -> ModelPatcher:
    """ToMA and the model-patch node on `model` in `order`."""
    if order == "patch_first":
        return apply_toma(patch(model), qwen_options())
    return patch(apply_toma(model, qwen_options()))


@pytest.fixture(scope="module")
def diffsynth(qwen) -> ModelNode:
    return diffsynth_node(qwen["model"])


@pytest.fixture(scope="module")
def diffsynth_samples(qwen, qwen_samples, diffsynth) -> dict[str, Any]:
    """Samples (the unmerged ones and ToMA alone shared with the InstantX tests; ToMA + patch:
    ToMA first) and ToMA + patch in each order."""
    model, plain = qwen["model"], qwen["plain"]
    alone = run_qwen(diffsynth(model), *plain)
    by_order = {order: run_qwen(compose(model, order, diffsynth), *plain) for order in ORDERS}
    samples = Samples(qwen_samples.base, alone, qwen_samples.toma, by_order["toma_first"])
    return {"samples": samples, "by_order": by_order}


def test_diffsynth_acts_with_and_without_toma_in_both_orders(diffsynth_samples):
    m = diffsynth_samples["samples"].measured()
    check_acts("diffsynth", m)
    toma = diffsynth_samples["samples"].toma
    for order, out in diffsynth_samples["by_order"].items():
        assert rel_err(out, toma) > MEASURED["diffsynth"].control_toma * LOW, order


def test_diffsynth_toma_stays_as_close_as_without_in_both_orders(diffsynth_samples):
    """The patch runs after each block's patches on the full stream ToMA hands on ("double_block"
    patches are outside the block, not among the in-block patches ToMA stands aside for), and
    ToMA's "dit" patches and the node's "double_block" patch live in different lists: both
    orders give the same model, hence bit-identical samples."""
    m = diffsynth_samples["samples"].measured()
    outs = diffsynth_samples["by_order"]
    assert torch.equal(outs["patch_first"], outs["toma_first"])
    check_close("diffsynth", m)


@pytest.mark.parametrize("order", ORDERS)
def test_diffsynth_residuals_join_full_length_streams(qwen, diffsynth, order, monkeypatch):
    """The DiffSynth patch computes its residual from the full image stream ToMA hands on
    (control_block's input is that block's output at 80 tokens) and adds it there; the next
    block and the final norm see it; ToMA merges both blocks inside and carries it through."""
    patches = importlib.import_module("comfy_extras.nodes_model_patch")
    seen: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    control_block = patches.QwenImageBlockWiseControlNet.control_block

    def recording(self, img, conditioning, block_id):
        out = control_block(self, img, conditioning, block_id)
        seen.append((block_id, img.clone(), out.clone()))
        return out

    monkeypatch.setattr(patches.QwenImageBlockWiseControlNet, "control_block", recording)
    model, (positive, negative) = qwen["model"], qwen["plain"]
    if order == "patch_first":
        recorder = recorded_qwen(model, positive, negative, before=diffsynth)
    else:
        recorder = recorded_qwen(model, positive, negative, after=diffsynth)
    h, w = DIT_LATENT[0] // 2, DIT_LATENT[1] // 2
    assert len(seen) == 2 * STEPS
    for n, call in enumerate(recorder.calls):
        assert call.control == {}                          # nothing through the conditioning
        residuals = []
        for (index, img, out), block in zip(seen[2 * n:2 * n + 2], call.outer, strict=True):
            assert index == block["index"]
            assert img.shape[1] == h * w and torch.equal(img, block["out"]["img"])
            residuals.append(("double_block", index, out * STRENGTH))
        check_boundaries(call, residuals, qwen_layout(), h * w)
        assert check_carried_through(call, qwen_layout(), h, w) < CARRY_TOLERANCE


# Z-Image, Fun model-patch ControlNet ------------------------------------------------------------
# The Fun ControlNet's patch counts its control steps through Z-Image's 2 noise refiner layers
# (the tiny family has 1) and injects after every round(30 / control layers)-th main layer, 30
# being Z-Image's depth: with 6 control layers after layers 0, 5, ... Its step state carries
# over from one model call to the next and is started afresh only when the last one it stood at
# is past the next call's first: 6 layers (residuals after 0 and 5) do that, 2 would not.
ZIMAGE = {"n_refiner_layers": 2, "n_layers": 6}
ZIMAGE_LAYERS = ZIMAGE["n_layers"]
ZIMAGE_INJECTED = (0, 5)
ZIMAGE_TEXT = 32               # the tiny text (7 tokens) padded to pad_tokens_multiple 32
ZIMAGE_IMAGE = 96              # 8 x 10 = 80 image tokens padded to 96


def zimage_available() -> bool:
    return tiny_models.available("z_image")


def assert_zimage_absent() -> None:
    """Before 0.8 (v0.3.64 among the tested versions) ComfyUI has neither Z-Image nor its Fun
    ControlNet."""
    assert ch.comfy_version() < (0, 8)
    assert importlib.util.find_spec("comfy.ldm.lumina.controlnet") is None


def zimage_node(model: ModelPatcher, seed: int = 9) -> ModelNode:
    """model -> model with ComfyUI's ZImageFunControlnet node applied (called with its inputs by
    name, as ComfyUI calls nodes), its MODEL_PATCH as ModelPatchLoader builds a Z-Image Fun
    ControlNet (ZImage_Control with the defaults a 6-control-layer checkpoint gets: no refiner
    control, manual_cast operations) at the tiny model's width and heads."""
    import comfy.ldm.lumina.controlnet
    import comfy.model_patcher
    import comfy.ops

    patches = importlib.import_module("comfy_extras.nodes_model_patch")
    config = _config(model)
    control = comfy.ldm.lumina.controlnet.ZImage_Control(
        dim=config["dim"], n_heads=config["n_heads"], n_kv_heads=config["n_kv_heads"],
        ffn_dim_multiplier=config["ffn_dim_multiplier"], device=ch.CPU, dtype=torch.float32,
        operations=comfy.ops.manual_cast)
    ch.fill_weights(control, seed)
    patcher_class = getattr(comfy.model_patcher, "CoreModelPatcher",
                            comfy.model_patcher.ModelPatcher)
    model_patch = patcher_class(control, load_device=ch.CPU, offload_device=ch.CPU)
    node = patches.ZImageFunControlnet
    image, vae = hint_image(DIT_LATENT), LatentEncoder(frames=False)

    def apply(m: ModelPatcher) -> ModelPatcher:
        return getattr(node(), node.FUNCTION)(model=m, model_patch=model_patch, vae=vae,
                                              strength=STRENGTH, image=image)[0]

    return apply


def run_zimage(model: ModelPatcher, positive: Conditioning,
               negative: Conditioning) -> torch.Tensor:
    x = tiny_models.inputs("z_image", model, height=DIT_LATENT[0], width=DIT_LATENT[1])
    return ch.sample(model, x.latent, positive, negative, steps=STEPS, cfg=2.0)


def zimage_options() -> ToMAOptions:
    return make_options(RATIO, skip_blocks="none")


@pytest.fixture(scope="module")
def zimage() -> dict[str, Any] | None:
    if not zimage_available():
        return None
    model = tiny_models.tiny_patcher("z_image", **ZIMAGE)
    x = tiny_models.inputs("z_image", model, height=DIT_LATENT[0], width=DIT_LATENT[1])
    return {"model": model, "plain": (x.positive, x.negative), "patch": zimage_node(model)}


@pytest.fixture(scope="module")
def zimage_samples(zimage) -> dict[str, Any] | None:
    if zimage is None:
        return None
    model, plain, patch = zimage["model"], zimage["plain"], zimage["patch"]
    base = run_zimage(model, *plain)
    toma = run_zimage(apply_toma(model, zimage_options()), *plain)
    alone = run_zimage(patch(model), *plain)
    by_order = {order: run_zimage(
        apply_toma(patch(model), zimage_options()) if order == "patch_first"
        else patch(apply_toma(model, zimage_options())), *plain) for order in ORDERS}
    return {"samples": Samples(base, alone, toma, by_order["toma_first"]),
            "by_order": by_order}


def test_zimage_fun_acts_with_and_without_toma_in_both_orders(zimage_samples):
    if zimage_samples is None:
        return assert_zimage_absent()
    m = zimage_samples["samples"].measured()
    check_acts("zimage_fun", m)
    toma = zimage_samples["samples"].toma
    for order, out in zimage_samples["by_order"].items():
        assert rel_err(out, toma) > MEASURED["zimage_fun"].control_toma * LOW, order


def test_zimage_fun_toma_stays_as_close_as_without_in_both_orders(zimage_samples):
    """Its "noise_refiner" and "double_block" patches run outside the layers ToMA patches (the
    noise refiner is not merged; the main layers' patches after each layer, on the full
    sequence): both orders give the same model, bit-identical samples."""
    if zimage_samples is None:
        return assert_zimage_absent()
    m = zimage_samples["samples"].measured()
    outs = zimage_samples["by_order"]
    assert torch.equal(outs["patch_first"], outs["toma_first"])
    check_close("zimage_fun", m)


@pytest.mark.parametrize("order", ORDERS)
def test_zimage_fun_residual_joins_the_full_length_stream(zimage, order, monkeypatch):
    """The patch's control layers read the first layer's input (img_input, the full image rows,
    which ToMA leaves as they were); their residuals are added after layers 0 and 5 to the 80
    image rows of the full [text; image; padding] sequence ToMA hands on, nothing after the
    others. ToMA merges every layer inside and carries the residuals through the next ones."""
    if zimage is None:
        return assert_zimage_absent()
    import comfy.ldm.lumina.controlnet

    seen: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    control_class = comfy.ldm.lumina.controlnet.ZImage_Control
    control_block = control_class.forward_control_block

    def recording(self, layer_id, control_context, x, *args, **kwargs):
        out = control_block(self, layer_id, control_context, x, *args, **kwargs)
        seen.append((layer_id, x.clone(), out[0].clone()))
        return out

    monkeypatch.setattr(control_class, "forward_control_block", recording)
    model, plain, patch = zimage["model"], zimage["plain"], zimage["patch"]
    recorder = RunRecorder()
    inner = (patch(model) if order == "patch_first" else model).clone()
    recorder.patch_layers(inner, ZIMAGE_LAYERS, inner=True)
    toma = apply_toma(inner, zimage_options())
    if order == "toma_first":
        toma = patch(toma)
    recorder.patch_layers(toma, ZIMAGE_LAYERS, inner=False)
    recorder.wrap_calls(toma)
    recorder.patch_final(toma, "final_layer")
    run_zimage(toma, *plain)
    h, w = DIT_LATENT[0] // 2, DIT_LATENT[1] // 2
    layout = {"layer": (ZIMAGE_TEXT, ZIMAGE_TEXT + ZIMAGE_IMAGE)}
    per_call = len(ZIMAGE_INJECTED)
    assert len(recorder.calls) == STEPS and len(seen) == per_call * STEPS
    for n, call in enumerate(recorder.calls):
        first_input = call.outer[0]["in"]["img"]
        residuals: list[tuple[str, int, torch.Tensor | None]] = [
            ("layer", i, None) for i in range(ZIMAGE_LAYERS)]
        for k, (layer_id, x, residual) in enumerate(seen[per_call * n:per_call * (n + 1)]):
            assert layer_id == k
            assert torch.equal(x, first_input[:, ZIMAGE_TEXT:ZIMAGE_TEXT + h * w])
            residuals[ZIMAGE_INJECTED[k]] = ("layer", ZIMAGE_INJECTED[k], residual * STRENGTH)
        check_boundaries(call, residuals, layout, h * w)
        worst = check_carried_through(call, layout, h, w)
        print(f"z-image: largest deviation from the update rule {worst:.2e}")
        assert worst < CARRY_TOLERANCE
