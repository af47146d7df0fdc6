"""ToMA beside other node packs, side by side on the CPU: each node alone and with ToMA after it,
whole sampling runs through comfy.sample.sample.

    COMFYUI_PATH=../shared/comfyui/v0.3.64 python -m bench --sections peers

The models are bench/speed/whole_call.py's: ComfyUI's SDXL UNet and Flux with the real models'
layers and depths at a reduced width, here at 512x512 (6 Euler steps: step caches need several
steps to skip any). The other packs' real code comes from ../shared/peers, loaded as ComfyUI
loads it (tests/integration/peers.py); a pack that does not import on this ComfyUI leaves its
rows out with a note. What each pair does (and that both act) is tested in
tests/integration/test_peer_*.py; this section times it.

Rows: per pair, the node alone and the node with ToMA after it (node defaults), their times
and ToMA's speedup over the node alone; and the unmerged and ToMA-alone runs for reference.
TOMA_PEERS_MODELS=sdxl,flux chooses the models.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..shared.common import MIN_REPS, interleaved, speedup
from ..shared.config import BenchConfig
from . import whole_call

log = logging.getLogger(__name__)

COLUMNS = ("model", "pair", "variant", "ms", "ms_min", "spread", "reps", "speedup",
           "speedup_lo", "speedup_hi")
LATENT = 64            # 512x512 pixels
STEPS = 6
TESTS = Path(__file__).resolve().parents[2] / "tests" / "integration"


def peers_module():
    """tests/integration/peers.py (the loader of ../shared/peers), imported by path."""
    if "peers" not in sys.modules:
        for path in (str(TESTS), str(TESTS.parent)):
            if path not in sys.path:
                sys.path.append(path)
        spec = importlib.util.spec_from_file_location("peers", TESTS / "peers.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["peers"] = module
        spec.loader.exec_module(module)
    return sys.modules["peers"]


def _inputs(name: str) -> tuple[torch.Tensor, list, list, float]:
    """(latent, positive, negative, cfg) at 512x512."""
    latent, positive, negative, cfg = whole_call._inputs(name)
    return latent[..., :LATENT, :LATENT].contiguous(), positive, negative, cfg


def _run(patcher, name: str) -> Callable[[], torch.Tensor]:
    import comfy.sample

    latent, positive, negative, cfg = _inputs(name)
    noise = comfy.sample.prepare_noise(latent, 0)

    def call() -> torch.Tensor:
        return comfy.sample.sample(patcher, noise, STEPS, cfg, "euler", "simple", positive,
                                   negative, latent, disable_pbar=True, seed=0)

    return call


def pairs(name: str) -> dict[str, Callable[[Any], Any]]:
    """The other nodes timed beside ToMA on model `name`, by label, as functions of a model;
    those whose pack does not import here are left out."""
    peers = peers_module()
    out: dict[str, Callable[[Any], Any]] = {}

    def node(pack: str, node_id: str, **inputs: Any) -> None:
        peer = peers.load(pack)
        if peer.loaded:
            cls = peer.node(node_id)
            out[f"{pack} {node_id}"] = lambda m: peers.run_node(cls, model=m, **inputs)[0]

    if name == "flux":
        node("ComfyUI-TeaCache", "TeaCache", model_type="flux", rel_l1_thresh=0.4,
             start_percent=0.0, end_percent=1.0, cache_device="cpu")
        node("ComfyUI-MagCache", "MagCache", model_type="flux", magcache_thresh=0.24,
             retention_ratio=0.1, magcache_K=5, start_step=0, end_step=-1)
    node("Comfy-WaveSpeed", "ApplyFBCacheOnModel", object_to_patch="diffusion_model",
         residual_diff_threshold=0.12 if name == "flux" else 0.2, start=0.0, end=1.0,
         max_consecutive_cache_hits=-1)
    return out


def run(cfg: BenchConfig) -> dict[str, Any]:
    """Per model: unmerged, ToMA, and each pair alone and with ToMA, interleaved."""
    from toma_pack.nodes.apply import apply_toma
    from toma_pack.nodes.options import make_options

    def toma(model):
        return apply_toma(model, make_options())

    cfg.apply_threads()
    rows, notes = [], []
    models = os.environ.get("TOMA_PEERS_MODELS", "sdxl,flux").split(",")
    for name, build in (("sdxl", whole_call.sdxl_patcher), ("flux", whole_call.flux_patcher)):
        if name not in models:
            continue
        # the caches keep their state on the diffusion model object: each pair runs on a model
        # of its own, its two variants interleaved
        groups = [("-", build(), lambda m: m)] + [(label, build(), peer)
                                                  for label, peer in pairs(name).items()]
        for pair, base, peer in groups:
            first, second = ("unmerged", "ToMA") if pair == "-" else (f"{pair} alone",
                                                                     f"{pair} + ToMA")
            calls = {first: _run(peer(base), name), second: _run(toma(peer(base)), name)}
            try:
                timings = interleaved(calls, warmup=1, reps=MIN_REPS, clock=cfg.clock)
            except Exception as exc:  # one pair failing must not take the others with it
                log.exception("peers %s %s failed", name, pair)
                notes.append(f"{name} {pair} failed: {type(exc).__name__}: {exc}")
                continue
            rows.append({"model": name, "pair": pair, "variant": first,
                         **timings[first].fields()})
            rows.append({"model": name, "pair": pair, "variant": second,
                         **timings[second].fields(), **speedup(timings[first], timings[second])})
    peers = peers_module()
    missing = [p for p in ("ComfyUI-TeaCache", "ComfyUI-MagCache", "Comfy-WaveSpeed")
               if not peers.load(p).loaded]
    if missing:
        notes.append(f"not on this ComfyUI (they do not import): {', '.join(missing)}")
    notes.append(cfg.describe(MIN_REPS, warmup=1))
    notes.append(f"bench/speed/whole_call.py's SDXL (channels {whole_call.SDXL_CHANNELS}, CFG 2) "
                 f"and Flux (hidden {whole_call.FLUX_HIDDEN}, cfg 1) at 512x512, {STEPS} Euler "
                 f"steps (simple schedule) of comfy.sample.sample; ToMA at the node defaults, "
                 f"after the other node; TeaCache at its node's defaults (0.4), MagCache at its "
                 f"README's settings for Flux (0.24, retention 0.1, K 5), First Block Cache "
                 f"at 0.12 on Flux (its README's value) and 0.2 on SDXL (its SDXL workflow's)")
    return {"rows": rows, "columns": list(COLUMNS), "notes": notes}
