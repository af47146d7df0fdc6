"""Every need of every contract (nodes/contracts.py) against a changed copy of the ComfyUI
under test (comfy_edits.py), the contracts checked in fresh imports of it (contract_worker.py).

- One fault for each need that applies here: its parameter, key, attribute, name or constant
  spelled another way, or (for a probed function or a join) its torch.cat of two tensors
  turned round; and for each block list of each family, a parameter of its blocks' forward
  renamed. The family (each model class) whose need it is finds exactly that changed, and
  every other contract finds nothing. Faults of different families share a round (one fork of
  the worker each), so a fault that reached another family would show there.
- A re-spelling of every class and function the contracts read (every local variable
  renamed, each definition reformatted): every contract still holds, and a tiny model of each
  family still merges through the node (fault_probe.py on that copy).
"""

from __future__ import annotations

import inspect
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import comfy_edits
import pytest
import tiny_models

import comfy_harness as ch

HERE = Path(__file__).resolve().parent
WORKER = HERE / "contract_worker.py"
PROBE = HERE / "fault_probe.py"
SECONDS = 600
# A tiny model of each family (and each class a family patches) that must still merge after
# the re-spelling, where this ComfyUI has it.
MERGING = ("sdxl", "flux", "chroma", "wan21_i2v", "wan_vace", "wan_camera", "wan_animate",
           "hunyuan_video", "hunyuan_image", "qwen_image", "sd3", "lumina2", "ltxv", "ltx2",
           "hidream", "hidream_o1", "kandinsky5", "mage_flow", "anima", "wan_scail2", "boogu",
           "ideogram4", "omnigen2", "lens", "wan_dancer", "joyimage", "ernie")


def contracts_here():
    """[(contract, model path or None)] for the sampling contract, the UNet's and each family's
    model classes this ComfyUI has."""
    from toma_pack.nodes import apply, contracts, unet_patch
    from toma_pack.nodes.families import MODULES

    out = [(apply.CONTRACT, None), (unet_patch.CONTRACT, unet_patch.UNET_MODEL)]
    for module in MODULES:
        out += [(module.CONTRACT, model) for model in module.CONTRACT.models
                if contracts.resolve(model)[0] is not None]
    return out


def key(contract, model) -> str:
    return f"{contract.label}|{model}"


def needs_of(contract, model) -> tuple:
    return (*contract.needs, *(contract.models.get(model, ()) if model else ()))


def place(path: str, tree: Path) -> tuple[str, str]:
    """(file in the tree, qualname) of the ComfyUI object at "module:qualname"."""
    from toma_pack.nodes import contracts

    found, _ = contracts.resolve(path)
    target = inspect.unwrap(found) if callable(found) else found
    if inspect.ismodule(target):
        return str(Path(target.__file__).resolve().relative_to(tree.resolve())), ""
    module = sys.modules[target.__module__]
    return (str(Path(module.__file__).resolve().relative_to(tree.resolve())),
            target.__qualname__)


# the edit that takes one of a need's names from the code it reads, by the need's kind
NAME_FAULTS = {"Takes": "rename_names", "Gives": "rename_strings", "Sets": "unset_attribute",
               "Mentions": "rename_strings"}


def faults_of(need, tree: Path) -> list[tuple[dict, tuple]]:
    """[(edit, signature)] that break this need: the signature (kind, file, qualname, item)
    names what the edit breaks, so that every need reading the same is expected to fail."""
    from toma_pack.nodes import contracts

    kind = type(need).__name__
    if kind in ("Probe", "JoinOrder"):
        target, op, items = need.path, "swap_cats", [None]
    elif kind in NAME_FAULTS:
        target, op, items = need.path, NAME_FAULTS[kind], need.names
    elif kind == "Has":
        module_level = ":" not in need.path
        target, items = need.path, need.names
        op = "rename_everywhere" if module_level else "rename_definition"
    elif kind == "Equals":
        module, _, name = need.path.partition(":")
        target, op, items = module, "change_constant", [name]
    elif kind == "Hands":
        model, _ = contracts.resolve(need.path)
        handing = next(cls for cls in inspect.getmro(model)
                       if (tree_of := contracts.tree_of(cls)) is not None
                       and contracts.handed_dicts(tree_of, need.key))
        target = f"{handing.__module__}:{handing.__qualname__}"
        op, items = "rename_strings", need.arguments
    else:
        raise AssertionError(f"no fault made for a {kind} need: add one here")
    file, qualname = place(target, tree)
    return [({"file": file, "qualname": qualname, "op": op, "arg": item},
             (op, file, qualname, item)) for item in items]


def block_classes() -> dict[str, dict[str, list[str]]]:
    """{model path: {block list path: block classes}} read from each family's tiny model."""
    from toma_pack.nodes.contracts import claimed
    from toma_pack.nodes.families import MODULES

    out: dict[str, dict[str, list[str]]] = {}
    for name in tiny_models.available_families():
        cls = tiny_models.diffusion_model_class(name)
        for module in MODULES:
            model = next((m for m in module.CONTRACT.models
                          if claimed(module.CONTRACT, cls.__new__(cls)) == m), None)
            if model is None or model in out or not module.CONTRACT.blocks:
                continue
            diffusion_model = tiny_models.tiny_patcher(name).model.diffusion_model
            out[model] = {}
            for path in module.CONTRACT.blocks:
                listed = diffusion_model
                for part in path.split("."):
                    listed = getattr(listed, part)
                out[model][path] = sorted({f"{type(b).__module__}:{type(b).__qualname__}"
                                           for b in listed})
    return out


def block_faults(blocks: dict, combos: list, tree: Path) -> list[tuple[dict, tuple, str]]:
    """A parameter renamed in the forward of each family's block classes."""
    out = []
    for contract, model in combos:
        for path, parameters in contract.blocks.items():
            if not parameters:
                continue
            for cls_path in blocks.get(model, {}).get(path, ()):
                file, qualname = place(cls_path, tree)
                item = parameters[0]
                out.append(({"file": file, "qualname": f"{qualname}.forward",
                             "op": "rename_names", "arg": item},
                            ("block", cls_path, item), key(contract, model)))
    return out


def signatures(contract, model, blocks: dict, tree: Path, version: str) -> set[tuple]:
    """What the contract reads for this model class, as fault signatures."""
    out = set()
    for need in needs_of(contract, model):
        if need.applies(version) and readable(need):
            out |= {signature for _, signature in faults_of(need, tree)}
    for path, parameters in contract.blocks.items():
        for cls_path in blocks.get(model, {}).get(path, ()):
            out |= {("block", cls_path, p) for p in parameters}   # any list holding it
    return out


def readable(need) -> bool:
    """Whether the code the need reads is ComfyUI's own here (otherwise it is taken as met)."""
    from toma_pack.nodes import contracts

    found, _ = contracts.resolve(need.path.partition(":")[0] if type(need).__name__ == "Equals"
                                 else need.path)
    return found is not None and contracts.tree_of(found) is not None


def message_item(signature: tuple) -> str:
    """What the mismatch a fault causes must name."""
    op, *_, item = signature
    if op == "swap_cats":
        return signature[2].rpartition(".")[2] or signature[1]
    if op == "unset_attribute":
        return f"self.{item}"
    if op in ("rename_definition", "rename_everywhere", "change_constant"):
        return item
    return repr(item)


def run_worker(root: Path, spec: dict) -> list[dict]:
    done = subprocess.run([sys.executable, str(WORKER), str(root)], input=json.dumps(spec),
                          capture_output=True, text=True, timeout=SECONDS,
                          cwd=HERE.parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def setting(comfyui_path):
    """(combos, block classes) of the ComfyUI under test."""
    return contracts_here(), block_classes()


def test_every_need_refuses_its_family_alone(comfyui_path, tmp_path, setting):
    combos, blocks = setting
    version = ch.comfy_version_string()
    tree = comfyui_path
    # (edit, signature, owner) for each need once, grouped by the contract that states it
    owned: dict[str, list] = {}
    seen = set()
    for contract, model in combos:
        for need in needs_of(contract, model):
            if not (need.applies(version) and readable(need)):
                continue
            edits = faults_of(need, tree)
            # one fault a need: the item no other need of this contract reads, where one is
            edit, signature = next(((e, s) for e, s in edits if s not in seen), edits[0])
            if signature not in seen:
                seen.add(signature)
                owned.setdefault(contract.label, []).append((edit, signature))
    for edit, signature, owner in block_faults(blocks, combos, tree):
        if signature not in seen:
            seen.add(signature)
            owned.setdefault(owner.partition("|")[0], []).append((edit, signature))
    rounds = [[f for f in faults if f is not None]
              for faults in itertools.zip_longest(*owned.values())]
    reads = {key(c, m): signatures(c, m, blocks, tree, version) for c, m in combos}
    spec = {"rounds": [[], *[[e for e, _ in r] for r in rounds]],
            "combos": [[c.label, m] for c, m in combos], "blocks": blocks}
    found = run_worker(comfy_edits.changed_copy(tree, tmp_path / "ComfyUI"), spec)
    assert found[0] == {key(c, m): [] for c, m in combos}, found[0]
    failures = []
    for faults, result in zip(rounds, found[1:], strict=True):
        if "error" in result:
            failures.append(f"{[s for _, s in faults]}: {result['error']}")
            continue
        for combo, problems in result.items():
            expected = [s for _, s in faults if s in reads[combo]]
            named = [message_item(s) for s in expected]
            if expected and not problems:
                failures.append(f"{combo} not refused for {expected}")
            stray = [p for p in problems if not any(n in p for n in named)]
            if stray:
                failures.append(f"{combo}: {stray} (faults {expected})")
    print(f"{sum(map(len, rounds))} faults in {len(rounds)} rounds")
    assert not failures, "\n".join(failures)


def respelled(combos, blocks: dict, tree: Path) -> list[dict]:
    """A re-spelling of every class and function the contracts read (modules aside)."""
    targets = set()
    for contract, model in combos:
        for need in needs_of(contract, model):
            if readable(need):
                # a Has or Equals need reads a class's or module's names, not its code
                paths = [getattr(need, name, "") for name in ("model", "block")]
                if type(need).__name__ not in ("Has", "Equals"):
                    paths.append(need.path)
                targets |= {place(p, tree) for p in paths if ":" in p}
        for classes in blocks.get(model, {}).values():
            targets |= {place(c, tree) for c in classes}
    return [{"file": file, "qualname": qualname, "op": "respell"}
            for file, qualname in sorted(targets) if qualname]


def test_a_respelled_comfyui_keeps_every_family(comfyui_path, tmp_path, setting):
    combos, blocks = setting
    copy = comfy_edits.changed_copy(comfyui_path, tmp_path / "ComfyUI")
    comfy_edits.apply(copy, respelled(combos, blocks, comfyui_path))
    spec = {"rounds": [[]], "combos": [[c.label, m] for c, m in combos], "blocks": blocks}
    assert run_worker(copy, spec)[0] == {key(c, m): [] for c, m in combos}
    models = [m for m in MERGING if m in ("sdxl", "flux") or tiny_models.available(m)]
    done = subprocess.run([sys.executable, str(PROBE), *models], capture_output=True,
                          text=True, timeout=SECONDS, cwd=HERE.parents[1],
                          env={**os.environ, "COMFYUI_PATH": str(copy)})
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(r.get("merged", 0) > 0 for r in found.values()), found
