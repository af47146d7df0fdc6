"""ToMA on models loaded the way artists load them: quantized GGUF files through ComfyUI-GGUF's
UnetLoaderGGUF (its real code, loaded as ComfyUI loads it), fp8 weights through ComfyUI's
UNETLoader (manual cast), LoRAs through LoraLoaderModelOnly before and after ToMA, and a LoRA
strength changed between two runs of a model compiled by ComfyUI's TorchCompileModel node.

The files are tiny models of ComfyUI's own classes written to disk (model_files.py). Where no
tiny model of a family loads through a loader on this ComfyUI (its detection fixes the widths),
the row says "not tested" and the test holds that the family is indeed unavailable here.
Sampling runs in inference mode, as ComfyUI's executor runs it.
"""

from __future__ import annotations

import peers
import pytest
import torch
from compatibility import MERGES, NOT_TESTED, ROWS, Row
from model_files import (
    inputs,
    model_folders,
    unavailable,
    write_gguf,
    write_lora,
    write_safetensors,
)
from peer_cases import ORDERS, Case, case, composed, version

import comfy_harness as ch

STEPS = 3
FILE_ROWS = [row for row in ROWS if row.node in ("UnetLoaderGGUF", "UNETLoader (fp8_e4m3fn)")]
LORA_ROWS = [row for row in ROWS if row.node == "LoraLoaderModelOnly"]

# How far ToMA moves the samples of the loaded model (relative L2), 1.5 x the measured value
# (comments, v0.33.0; the same on the older versions where measured).
FILE_BOUNDS = {"flux": 0.24, "wan21_t2v": 0.46, "sd3": 0.4}   # 0.160, 0.308, 0.269
LORA_BOUNDS = {"sdxl": 0.64, "flux": 0.28, "wan21_t2v": 0.34}   # 0.423, 0.185, 0.224


def file_case(name: str, model) -> Case:
    """The Case of a model loaded from a file (model_files' inputs, Flux at cfg 1)."""
    x = inputs(name, model, 1, 16, 16, 3 if name == "wan21_t2v" else 1)
    return Case(name, model, x.latent, x.positive, x.negative, 1.0 if name == "flux" else 2.0,
                toma_options={"skip_blocks": "none"})


def snapshot(patcher) -> tuple:
    """What a node must leave alone on a ModelPatcher it was given: its patches and options."""
    return (dict(patcher.object_patches), repr(patcher.model_options), dict(patcher.patches))


@pytest.mark.parametrize("row", FILE_ROWS, ids=lambda row: f"{row.node}-{row.family}")
def test_loaded_from_a_file(row: Row, tmp_path) -> None:
    """GGUF (Q8_0 and F16) and fp8 weights: ToMA merges the loaded model, its samples within a
    measured bound of the loaded model unmerged, and the loader's model is left untouched (its
    patches and options, and its own samples afterwards)."""
    expected = row.on(version())
    why = unavailable(row.family)
    if expected == NOT_TESTED:
        assert why is not None
        return
    assert expected == MERGES and why is None, why
    if row.node == "UnetLoaderGGUF":
        loader = peers.load(row.pack).node(row.node)
        files = {q: write_gguf(row.family, tmp_path / f"{row.family}-{q}.gguf", q)
                 for q in ("Q8_0", "F16")}
        load = [lambda name=path.name: peers.run_node(loader, unet_name=name)[0]
                for path in files.values()]
    else:
        loader = peers.comfy_node("nodes", "UNETLoader")
        path = write_safetensors(row.family, tmp_path / f"{row.family}.safetensors")
        load = [lambda: peers.run_node(loader, unet_name=path.name,
                                        weight_dtype="fp8_e4m3fn")[0]]
    with model_folders(tmp_path):
        for make in load:
            model = make()
            c = file_case(row.family, model)
            before = snapshot(model)
            alone = c.run(model, STEPS)
            merged = c.run(c.toma(model), STEPS)
            again = c.run(model, STEPS)
            print(f"{row.node} {row.family}: {merged.distance(alone):.3f} from the loaded model "
                  f"unmerged; lengths {sorted(set(alone.lengths))} -> "
                  f"{sorted(set(merged.lengths))}")
            assert any(n not in set(alone.lengths) for n in merged.lengths), "nothing merged"
            assert merged.distance(alone) <= FILE_BOUNDS[row.family]
            assert snapshot(model) == before and torch.equal(again.samples, alone.samples)
    ch.unload_models()


def lora_node(path, strength: float = 1.0):
    loader = peers.comfy_node("nodes", "LoraLoaderModelOnly")
    return lambda model: peers.run_node(loader, model=model, lora_name=path.name,
                                        strength_model=strength)[0]


@pytest.mark.parametrize("row", LORA_ROWS, ids=lambda row: row.family)
def test_lora_before_and_after_toma(row: Row, tmp_path) -> None:
    """LoraLoaderModelOnly patches weights and ToMA the blocks' forwards: the LoRA changes the
    samples, ToMA merges, and the two node orders give the same samples, within a measured
    bound of the LoRA alone."""
    c = case(row.family)
    path = tmp_path / f"{row.family}-lora.safetensors"
    write_lora(c.model, path)
    with model_folders(tmp_path):
        lora = lora_node(path)
        plain = c.run(c.model, STEPS)
        alone = c.run(lora(c.model), STEPS)
        runs = {order: c.run(composed(order, lora, c.toma, c.model), STEPS) for order in ORDERS}
    full = set(alone.lengths)
    for order, both in runs.items():
        print(f"LoRA {row.family} {order}: {both.distance(alone):.3f} from the LoRA alone "
              f"(the LoRA moves the samples {alone.distance(plain):.3f})")
        assert any(n not in full and n < max(full) for n in both.lengths), "nothing merged"
        assert both.distance(alone) <= LORA_BOUNDS[row.family]
    assert alone.distance(plain) > 0.05
    assert torch.equal(runs["peer_first"].samples, runs["toma_first"].samples)
    ch.unload_models()


def test_lora_strength_changed_under_torch_compile(tmp_path) -> None:
    """A LoRA's strength changed between two runs of a model compiled by ComfyUI's own
    TorchCompileModel node (inductor, as on a CPU), with ToMA: the second run applies the new
    strength (the compiled graph reads the weights ComfyUI patched), matching eager ToMA with
    that strength within inductor's rounding, and differing from the first strength's run the
    way the LoRA alone does (against unmerged runs at both strengths)."""
    import torch._dynamo

    c = case("sdxl")
    path = tmp_path / "sdxl-lora.safetensors"
    write_lora(c.model, path)
    compile_node = peers.comfy_node("nodes_torch_compile", "TorchCompileModel")
    torch._dynamo.reset()
    try:
        with model_folders(tmp_path):
            runs, unmerged = {}, {}
            for strength in (1.0, 0.25):
                model = c.toma(lora_node(path, strength)(c.model))
                compiled = peers.run_node(compile_node, model=model, backend="inductor")[0]
                runs[strength] = (c.run(compiled, STEPS), c.run(model, STEPS))
                unmerged[strength] = c.run(lora_node(path, strength)(c.model), STEPS)
    finally:
        torch._dynamo.reset()
    (first, first_eager), (second, second_eager) = runs[1.0], runs[0.25]
    lora_cosine = float(torch.nn.functional.cosine_similarity(
        (first.samples - second.samples).flatten(),
        (unmerged[1.0].samples - unmerged[0.25].samples).flatten(), dim=0))
    print(f"compiled from eager: strength 1 {first.distance(first_eager):.2e}, strength 0.25 "
          f"{second.distance(second_eager):.2e}; the strengths apart "
          f"{second_eager.distance(first_eager):.2e}; compiled from unmerged at its own "
          f"strength / at the other: {first.distance(unmerged[1.0]):.3f} / "
          f"{first.distance(unmerged[0.25]):.3f}, {second.distance(unmerged[0.25]):.3f} / "
          f"{second.distance(unmerged[1.0]):.3f}; cosine {lora_cosine:.3f}")
    # inductor rounds otherwise, which ToMA's destination choices amplify (measured 0.0195;
    # see test_gpu_habits.test_torch_compile_inductor_near_eager); the strengths are 0.43 apart
    for compiled, eager in runs.values():
        assert compiled.distance(eager) < 0.05
        assert any(n not in (64, 256) for n in compiled.lengths)   # merged (16x16 and 8x8)
    assert second.distance(first_eager) > 5 * second.distance(second_eager)
    # ToMA's change between the strengths points the way the LoRA's own does (measured 0.479;
    # -0.453 where ToMA's blocks ran copies of the modules made when the node ran, i.e. other
    # weights than the ones ComfyUI patched)
    assert lora_cosine > 0.3
    ch.unload_models()
