"""The models the composition tests run beside other node packs: one `Case` per model family
(tiny models from ComfyUI's own classes, as the other integration tests build them), with the
inputs and sampler settings of the tests, and a run that records what both nodes did.

A `Trace` of one sampling run holds the samples, how often the model's last block ran (a step
cache that skips a step skips it), the self-attention lengths (recorded outside the pack, see
peers.attention_lengths) and the note of ToMA's stats line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import peers
import torch
from tiny_models import family, inputs, tiny_patcher

import comfy_harness as ch
from toma_pack.nodes import run_state
from toma_pack.nodes.apply import apply_toma
from toma_pack.nodes.options import make_options

ORDERS = ("peer_first", "toma_first")


@dataclass
class Trace:
    """What one sampling run did."""

    samples: torch.Tensor
    last_block_calls: int
    lengths: list[int]
    stats: dict = field(default_factory=dict)

    @property
    def note(self) -> str:
        return self.stats.get("note", "")

    def distance(self, other: Trace) -> float:
        """Relative L2 distance of the samples to another run's."""
        return float((self.samples - other.samples).norm() / other.samples.norm())


@dataclass
class Case:
    """One family's tiny model with its test inputs and sampler settings."""

    name: str
    model: Any
    latent: torch.Tensor
    positive: Any
    negative: Any
    cfg: float
    noise_mask: torch.Tensor | None = None
    toma_options: dict = field(default_factory=dict)

    def toma(self, model: Any) -> Any:
        """ToMA at ratio 0.5 on every block the family has (the tiny models have 2 of a kind)."""
        return apply_toma(model, make_options(0.5, **self.toma_options))

    def last_block(self) -> torch.nn.Module:
        """The diffusion model's last transformer block (UNet: the first layer of its last
        output block, which ComfyUI calls one by one)."""
        diffusion_model = self.model.model.diffusion_model
        for name in ("single_blocks", "blocks", "transformer_blocks", "layers",
                     "double_stream_blocks", "joint_blocks", "output_blocks"):
            blocks = getattr(diffusion_model, name, None)
            if isinstance(blocks, torch.nn.ModuleList) and len(blocks):
                return blocks[-1][0] if name == "output_blocks" else blocks[-1]
        raise ValueError(f"{self.name}: no block list found")

    def run(self, model: Any, steps: int) -> Trace:
        """Sample `steps` steps with `model` (this case's model, patched) in inference mode, as
        ComfyUI's executor samples, and record them."""
        sent: list[dict] = []
        calls, remove = peers.counting_calls(self.last_block())
        original = run_state.send_stats
        run_state.send_stats = lambda node, stats: sent.append(stats)
        try:
            # SDPA, the GPU's default: the sub-quadratic attention (the CPU's) reads /proc, a
            # graph break under torch.compile
            with ch.attention_backend("sdpa"), peers.attention_lengths() as lengths, \
                    torch.inference_mode():
                out = ch.sample(model, self.latent, self.positive, self.negative, steps=steps,
                                cfg=self.cfg, noise_mask=self.noise_mask)
        finally:
            run_state.send_stats = original
            remove()
        return Trace(ch.flat(out).clone(), len(calls), list(lengths), sent[-1] if sent else {})


def case(name: str) -> Case:
    """The Case of family `name`: "flux" and "sdxl" (comfy_harness), else tiny_models'."""
    if name == "flux":
        model = ch.tiny_flux_patcher()
        positive, negative = ch.flux_conds(1, 16)
        return Case(name, model, torch.zeros(1, 16, 32, 32), positive, negative, 1.0,
                    toma_options={"skip_blocks": "none"})
    if name == "flux_kontext":       # a reference image, as ReferenceLatent hands it over
        c = case("flux")
        for cond in (c.positive, c.negative):
            cond[0][1]["reference_latents"] = [torch.randn(
                1, 16, 16, 16, generator=torch.Generator().manual_seed(3))]
        c.name = name
        return c
    if name == "sdxl":
        model = ch.tiny_sdxl_patcher()
        positive, negative = ch.sdxl_conds(1, 256, 256)
        return Case(name, model, ch.empty_latent(model, 1, 32, 32), positive, negative, 2.0,
                    toma_options={"unet_levels": "all"})
    model = tiny_patcher(name)
    x = inputs(name, model, 1, 8, 8, 3 if family(name).video else 1)
    return Case(name, model, x.latent, x.positive, x.negative, 2.0, x.noise_mask,
                toma_options={"skip_blocks": "none"})


def composed(order: str, peer: Callable[[Any], Any], toma: Callable[[Any], Any],
             model: Any) -> Any:
    """The model through both nodes, the other node first or ToMA first."""
    return toma(peer(model)) if order == "peer_first" else peer(toma(model))


def version() -> str:
    """This ComfyUI's version as the compatibility rows name it ("v0.8.0")."""
    return "v" + ch.comfy_version_string()
