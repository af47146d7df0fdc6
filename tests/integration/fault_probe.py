"""Run by test_update_faults.py in a fresh Python whose COMFYUI_PATH is a changed copy of a
ComfyUI tree: patches each named tiny model with the ToMA node, samples it two steps, and prints
one JSON line, {model: {"refused": the node's error} | {"merged": layers merged, "layers":
layers seen} | {"failed": what else went wrong}}.

    COMFYUI_PATH=/tmp/changed python tests/integration/fault_probe.py flux wan qwen_image sdxl

Models: sdxl and flux (comfy_harness's tiny ones), and any tiny_models family (wan21_t2v,
qwen_image, chroma, ...). Chroma's parameters are read from wherever this ComfyUI keeps its
Chroma class (a changed copy may have moved it).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]

import torch  # noqa: E402

import comfy_harness as ch  # noqa: E402
import pack_loader  # noqa: E402

# The node's widgets for every model: half the tokens merged in every block, every UNet level.
NODE = {"ratio": 0.5, "tile_count": 0, "skip_blocks": "none", "recompute_every": 1,
        "unet_levels": "all"}


def chroma_patcher():
    """Tiny Chroma (tiny_models' parameters) built from this ComfyUI's own Chroma class."""
    import comfy.model_base  # imports ComfyUI's Chroma module, wherever it is
    import comfy.supported_models
    import tiny_models

    params = next(module.ChromaParams for name, module in list(sys.modules.items())
                  if name.startswith("comfy.ldm.chroma.") and hasattr(module, "ChromaParams"))
    known = {f.name for f in dataclasses.fields(params)} | {"image_model"}
    config = {k: v for k, v in {"image_model": "chroma", **tiny_models._CHROMA}.items()
              if k in known}
    return ch._patcher(comfy.supported_models.Chroma(config), 0)


def inputs(name: str):
    """(patcher, latent, positive, negative) of a tiny model."""
    if name == "sdxl":
        patcher = ch.tiny_sdxl_patcher()
        return (patcher, ch.empty_latent(patcher, 1, 16, 16), *ch.sdxl_conds(1, 128, 128))
    if name == "flux":
        patcher = ch.tiny_flux_patcher()
        return (patcher, ch.empty_latent(patcher, 1, 16, 16), *ch.flux_conds(1, 8))
    import tiny_models

    patcher = chroma_patcher() if name == "chroma" else tiny_models.tiny_patcher(name)
    frames = 3 if tiny_models.family(name).video else 1
    x = tiny_models.inputs(name, patcher, 1, 8, 8, frames=frames)
    return patcher, x.latent, x.positive, x.negative


def probe(name: str) -> dict:
    """What the ToMA node does with one tiny model on this ComfyUI."""
    from comfy.patcher_extension import WrappersMP

    from toma_pack.nodes.toma_node import patch_model

    patcher, latent, positive, negative = inputs(name)
    try:
        patched = patch_model(patcher, **NODE)
    except ValueError as error:
        return {"refused": str(error)}
    ch.sample(patched, latent, positive, negative, steps=2, cfg=1.0)
    state = patched.get_wrappers(WrappersMP.OUTER_SAMPLE, "toma")[0].toma_state
    stats = state.last_stats or {}
    return {"merged": stats.get("layers_merged", 0), "layers": stats.get("layers_total", 0)}


def main(names: list[str]) -> None:
    torch.set_num_threads(1)
    ch.ensure_comfy()
    pack_loader.load_pack()
    found = {}
    for name in names:
        try:
            found[name] = probe(name)
        except Exception as error:
            found[name] = {"failed": f"{type(error).__name__}: {error}",
                           "trace": traceback.format_exc(limit=4)}
        ch.unload_models()
    print(json.dumps(found))


if __name__ == "__main__":
    main(sys.argv[1:])
