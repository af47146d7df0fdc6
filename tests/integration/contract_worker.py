"""Run by test_contract_faults.py: checks every contract on a scratch copy of a ComfyUI tree
after each round of edits (comfy_edits.py), each round in a fresh import of ComfyUI.

    python contract_worker.py SCRATCH < spec.json

spec: {"rounds": [[edit, ...], ...], "combos": [[contract label, model path or null], ...],
"blocks": {model path: {block list path: [block class "module:qualname", ...]}}}. Prints
one JSON line: for each round, {"label|model": [what the contract finds changed]} (block
forwards' parameters included, read from bare blocks of the classes given), or {"error": why}.

The rounds share one process: the packages ComfyUI imports are imported once here, then each
round edits the copy, forks, imports ComfyUI and the pack from it in the child, and puts the
files back.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]
sys.dont_write_bytecode = True      # a restored file must never meet its edited copy's .pyc

import comfy_edits  # noqa: E402

# What ComfyUI imports that takes long, imported once before the rounds fork.
PRELOADED = ("torch", "torch._dynamo", "comfy_kitchen", "transformers", "safetensors.torch",
             "einops", "numpy", "PIL.Image", "scipy", "torchsde", "kornia", "yaml", "av",
             "aiohttp", "psutil", "tokenizers", "sentencepiece")


def report(spec: dict) -> dict:
    """{"label|model": mismatches} for every combo on the ComfyUI at COMFYUI_PATH."""
    import comfy_harness as ch
    import pack_loader

    ch.ensure_comfy()
    pack_loader.load_pack()
    from toma_pack.nodes import apply, contracts, unet_patch
    from toma_pack.nodes.families import MODULES

    by_label = {c.label: c for c in (apply.CONTRACT, unet_patch.CONTRACT,
                                     *(m.CONTRACT for m in MODULES))}
    out = {}
    for label, model in spec["combos"]:
        contract = by_label[label]
        found = contracts.mismatches(contract, model)
        blocks = spec["blocks"].get(model or "", {})
        if blocks:
            found += contracts.block_mismatches(contract.blocks, bare_model(blocks))
        out[f"{label}|{model}"] = found
    return out


def bare_model(blocks: dict[str, list[str]]) -> SimpleNamespace:
    """A stand-in diffusion model whose block lists hold a bare block of each class."""
    from toma_pack.nodes.contracts import bare, resolve

    model = SimpleNamespace()
    for path, classes in blocks.items():
        *parents, last = path.split(".")
        holder = model
        for name in parents:
            if not hasattr(holder, name):
                setattr(holder, name, SimpleNamespace())
            holder = getattr(holder, name)
        listed = []
        for cls_path in classes:
            cls, _ = resolve(cls_path)
            if cls is not None:
                listed.append(bare(cls))
        setattr(holder, last, listed)
    return model


def run_round(root: Path, edits: list[dict], spec: dict) -> dict:
    saved: dict[Path, str] = {}
    read, write = os.pipe()
    try:
        comfy_edits.apply(root, edits, saved)
        pid = os.fork()
        if pid == 0:
            os.close(read)
            try:
                found = report(spec)
            except BaseException:
                found = {"error": traceback.format_exc(limit=6)}
            with os.fdopen(write, "w") as pipe:
                pipe.write(json.dumps(found))
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as pipe:
            text = pipe.read()
        os.waitpid(pid, 0)
        return json.loads(text) if text else {"error": "the round's process wrote nothing"}
    except AssertionError as error:
        return {"error": f"edit failed: {error}"}
    finally:
        for path, text in saved.items():
            path.write_text(text)


def main(root: Path) -> None:
    spec = json.loads(sys.stdin.read())
    os.environ["COMFYUI_PATH"] = str(root)
    for name in PRELOADED:
        try:
            importlib.import_module(name)
        except Exception:
            pass
    import torch

    torch.set_num_threads(1)
    print(json.dumps([run_round(root, edits, spec) for edits in spec["rounds"]]))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
