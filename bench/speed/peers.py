"""ToMA beside other node packs, side by side on the CPU: each node alone and with ToMA after it,
whole sampling runs through comfy.sample.sample.

    COMFYUI_PATH=../shared/comfyui/v0.3.64 python -m bench --sections peers

The models are bench/speed/whole_call.py's: ComfyUI's SDXL UNet and Flux with the real models'
layers and depths at a reduced width, here at 512x512 (6 Euler steps: step caches need several
steps to skip any), and its Wan 2.1 (reduced width and depth) at 512x320, 9 frames, for the
video caches. The other packs' real code comes from ../shared/peers, loaded as ComfyUI
loads it (tests/integration/peers.py); a pack that does not import on this ComfyUI leaves its
rows out with a note. What each pair does (and that both act) is tested in
tests/integration/test_peer_*.py; this section times it.

Rows: per pair, the node alone and the node with ToMA after it (node defaults), their times
and ToMA's speedup over the node alone; and the unmerged and ToMA-alone runs for reference.
Models loaded as artists load them count as pairs too: the same Flux written as a Q8_0 .gguf and
loaded by ComfyUI-GGUF's UnetLoaderGGUF (it dequantises every weight at every call; from
ComfyUI 0.33, whose model detection reads the reduced width), with a LoRA through
LoraLoaderModelOnly on it (applied at dequantisation, every call) and on the fp32 model
(merged into the weights once). TOMA_PEERS_MODELS=sdxl,flux chooses the models,
TOMA_PEERS_PAIRS=<words,...> the pairs whose label holds one of the words ("-": the reference
runs).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
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
# TeaCache on Wan watching the time embedding (its "ret_mode" skips every step after the first on
# this random-weight Wan at any threshold from 0.1, and every step of a run repeated on the same
# model); at its README's 1.3B values (0.05-0.08) it skips none in 6 steps
WAN_TEACACHE = 0.5
MODELS = {"sdxl": whole_call.sdxl_patcher, "flux": whole_call.flux_patcher,
          "wan": whole_call.wan_patcher}
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
        # retention 0.2: its README's 0.1 keeps no step of 6 (int(0.6) = 0) and MagCache fails
        node("ComfyUI-MagCache", "MagCache", model_type="flux", magcache_thresh=0.24,
             retention_ratio=0.2, magcache_K=5, start_step=0, end_step=-1)
    if name == "wan":
        node("ComfyUI-TeaCache", "TeaCache", model_type="wan2.1_t2v_1.3B",
             rel_l1_thresh=WAN_TEACACHE, start_percent=0.0, end_percent=1.0, cache_device="cpu")
        node("ComfyUI-MagCache", "MagCache", model_type="wan2.1_t2v_1.3B", magcache_thresh=0.24,
             retention_ratio=0.2, magcache_K=4, start_step=0, end_step=-1)
        latent, _, negative, _ = _inputs(name)
        kj = "ComfyUI-KJNodes"
        node(kj, "WanChunkFeedForward", chunks=2, dim_threshold=0)
        node(kj, "WanVideoNAG", conditioning=negative, nag_scale=11.0, nag_alpha=0.25,
             nag_tau=2.5)
        node(kj, "ApplyRifleXRoPE_WanVideo", latent={"samples": latent}, k=4)
        node(kj, "PatchModelPatcherOrder", patch_order="weight_patch_first", full_load="auto")
        node(kj, "ModelPatchTorchSettings", enable_fp16_accumulation=False)
        return out
    node("Comfy-WaveSpeed", "ApplyFBCacheOnModel", object_to_patch="diffusion_model",
         residual_diff_threshold=0.12 if name == "flux" else 0.2, start=0.0, end=1.0,
         max_consecutive_cache_hits=-1)
    return out


Group = tuple[str, Callable[[], Any], Callable[[Any], Any]]   # label, base model, node


def loaded(name: str, build: Callable[[], Any], folder: Path) -> list[Group]:
    """The loader pairs of model `name`: GGUF (Flux only), GGUF with a LoRA, and a LoRA on the
    fp32 model; their files written to `folder` (one of ComfyUI's model folders). None on Wan,
    which is here for the video caches."""
    gguf_labels = ("ComfyUI-GGUF UnetLoaderGGUF Q8_0",
                   "ComfyUI-GGUF UnetLoaderGGUF Q8_0 + LoraLoaderModelOnly")
    lora_labels = ("ComfyUI LoraLoaderModelOnly", gguf_labels[1])
    if name == "wan" or not any(chosen(label) for label in (*lora_labels, *gguf_labels)):
        return []   # nothing to write: building the model and its files takes a while
    peers = peers_module()
    import model_files

    lora = folder / f"{name}-lora.safetensors"
    model_files.write_lora(build(), lora)
    loader = peers.comfy_node("nodes", "LoraLoaderModelOnly")

    def with_lora(model):
        return peers.run_node(loader, model=model, lora_name=lora.name, strength_model=1.0)[0]

    out: list[Group] = [(lora_labels[0], build, with_lora)]
    gguf = peers.load("ComfyUI-GGUF")
    if name == "flux" and gguf.loaded and any(chosen(label) for label in gguf_labels):
        sd = build().model.diffusion_model.state_dict()
        path = model_files.write_gguf("flux", folder / "flux-Q8_0.gguf", "Q8_0", tensors=sd)
        unet = gguf.node("UnetLoaderGGUF")

        def from_gguf():
            return peers.run_node(unet, unet_name=path.name)[0]

        out += [(gguf_labels[0], from_gguf, lambda m: m), (gguf_labels[1], from_gguf, with_lora)]
    return out


@contextlib.contextmanager
def model_folder() -> Iterator[Path]:
    """A temporary folder that ComfyUI's loaders read model files from."""
    peers_module()   # puts tests/integration, where model_files lives, on the path
    import model_files

    with tempfile.TemporaryDirectory() as tmp, model_files.model_folders(Path(tmp)) as folder:
        yield folder


def chosen(label: str) -> bool:
    """Whether TOMA_PEERS_PAIRS (words, comma-separated; unset: all) selects pair `label`."""
    words = [w for w in os.environ.get("TOMA_PEERS_PAIRS", "").split(",") if w]
    return not words or any(w == label if w == "-" else w in label for w in words)


def run(cfg: BenchConfig) -> dict[str, Any]:
    """Per model: unmerged, ToMA, and each pair alone and with ToMA, interleaved."""
    from toma_pack.nodes.apply import apply_toma
    from toma_pack.nodes.options import make_options

    def toma(model):
        return apply_toma(model, make_options())

    cfg.apply_threads()
    rows, notes = [], []
    models = os.environ.get("TOMA_PEERS_MODELS", ",".join(MODELS)).split(",")
    with model_folder() as folder:
        for name, build in MODELS.items():
            if name not in models:
                continue
            # the caches keep their state on the diffusion model object: each pair runs on a
            # model of its own, its two variants interleaved
            groups: list[Group] = [("-", build, lambda m: m)]
            groups += [(label, build, peer) for label, peer in pairs(name).items()]
            groups += loaded(name, build, folder)
            for pair, base, peer in groups:
                if chosen(pair):
                    rows += _time_pair(cfg, name, pair, base, peer, toma, notes)
    peers = peers_module()
    missing = [p for p in ("ComfyUI-TeaCache", "ComfyUI-MagCache", "Comfy-WaveSpeed",
                           "ComfyUI-GGUF", "ComfyUI-KJNodes")
               if not peers.load(p).loaded]
    if missing:
        notes.append(f"not on this ComfyUI (they do not import): {', '.join(missing)}")
    notes.append(cfg.describe(MIN_REPS, warmup=1))
    notes.append(f"bench/speed/whole_call.py's SDXL (channels {whole_call.SDXL_CHANNELS}, CFG 2) "
                 f"and Flux (hidden {whole_call.FLUX_HIDDEN}, cfg 1) at 512x512, {STEPS} Euler "
                 f"steps (simple schedule) of comfy.sample.sample; ToMA at the node defaults, "
                 f"after the other node; TeaCache at its node's defaults (0.4), MagCache at its "
                 f"README's settings for Flux (0.24, K 5) at retention 0.2, First Block Cache "
                 f"at 0.12 on Flux (its README's value) and 0.2 on SDXL (its SDXL workflow's); "
                 f"the LoRA of tests/integration/model_files.write_lora (rank 4 on every "
                 f"attention and fused linear weight of the blocks) at strength 1; Wan 2.1 "
                 f"text-to-video with the 1.3B model's heads of 128 at width "
                 f"{whole_call.WAN_DIM} and {whole_call.WAN_BLOCKS} blocks, 512x320, 9 frames, "
                 f"cfg 1, TeaCache at {WAN_TEACACHE}, MagCache at 0.24, retention "
                 f"0.2, K 4; KJNodes' nodes at the settings of tests/integration/"
                 f"test_peer_kjnodes.py")
    return {"rows": rows, "columns": list(COLUMNS), "notes": notes}


def _time_pair(cfg: BenchConfig, name: str, pair: str, base: Callable[[], Any],
               peer: Callable[[Any], Any], toma: Callable[[Any], Any],
               notes: list[str]) -> list[dict[str, Any]]:
    """The two rows of one pair (the node alone, then with ToMA after it), interleaved; none,
    with a note, where the pair fails."""
    first, second = ("unmerged", "ToMA") if pair == "-" else (f"{pair} alone", f"{pair} + ToMA")
    try:
        model = peer(base())
        calls = {first: _run(model, name), second: _run(toma(model), name)}
        timings = interleaved(calls, warmup=1, reps=MIN_REPS, clock=cfg.clock)
    except Exception as exc:  # one pair failing must not take the others with it
        log.exception("peers %s %s failed", name, pair)
        notes.append(f"{name} {pair} failed: {type(exc).__name__}: {exc}")
        return []
    return [{"model": name, "pair": pair, "variant": first, **timings[first].fields()},
            {"model": name, "pair": pair, "variant": second, **timings[second].fields(),
             **speedup(timings[first], timings[second])}]
