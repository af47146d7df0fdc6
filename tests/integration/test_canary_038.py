"""ToMA on ComfyUI 0.34-0.38 code: the canary overlay (../shared/comfyui/canary-0.38, newer
upstream files laid over a copy of v0.33.0 by its build.sh: an early warning, not a release),
built once per session into a temporary folder and run in a subprocess of its own (the
session's own `comfy` is the newest tree's; two ComfyUIs never share a process).

The subprocess (this file run as a script: `python test_canary_038.py --child TREE`) samples tiny
models from ComfyUI's own classes and prints one JSON line of findings; the tests here judge it:

- SDXL, Flux (block and attention scope), Wan 2.1, Lumina 2 and Z-Image merged by ToMA, beside
  an attention override (optimized_attention_override, installed before ToMA) and a
  module-level replacement of ComfyUI's attention function (what test fixtures and some packs
  use): the override gets plain tensors of merged length; the replacement gets
  AttentionTensorContainers on 0.34+ code and reads them with peek();
- Lumina 2 / Z-Image's INT8 path (the block computes qkv from its raw input and passes `qkv=` to
  its attention; taken only for INT8 ConvRot weights on a GPU): emulated on the CPU by
  replacing its fused kernel with the same math, so that `qkv=` runs under ToMA;
- ComfyUI's BlockSparseAttention and ModelAttentionBackend beside ToMA in both orders (on the
  CPU block-sparse attention always falls back to dense, after deciding on the sequence it got);
  BlockSparseAttention's MiniMax H3 block patches, beside which ToMA stands aside;
- Qwen-Image 2.1 merged (text to image and edit); MingImage (a NextDiT) sampled without a
  crash;
- forward_patches.kept_allocations: ComfyUI's pause_malloc_graph where it exists.

Where the overlay is missing (CI clones only the released trees) the subprocess runs the same
scenarios on the ComfyUI under test (the newest released tree: the test is marked newest_tree)
and the tests hold what that tree has instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.newest_tree

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SHARED = REPO.parent / "shared" / "comfyui"
OVERLAY = SHARED / "canary-0.38"
CHILD_TIMEOUT_S = 300


# The subprocess ---------------------------------------------------------------------------------
def plain(t: Any) -> Any:
    """The tensor an attention function was handed: ComfyUI 0.34 and later wrap q, k and v in
    AttentionTensorContainers (peek() reads without taking it from the attention function);
    older versions hand tensors."""
    return t.peek() if hasattr(t, "peek") else t


class ModuleAttention:
    """ComfyUI's attention function replaced in every loaded comfy module (as fixtures and some
    packs do), recording the type it was handed and the query length of self-attention calls."""

    NAMES = ("optimized_attention", "optimized_attention_masked")

    def __init__(self) -> None:
        self.types: set[str] = set()
        self.self_lengths: set[int] = set()
        self.replaced: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> ModuleAttention:
        import comfy.ldm.modules.attention as attention

        current = [getattr(attention, n) for n in self.NAMES]
        inner = current[0]

        def recording(q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> Any:
            self.types.add(type(q).__name__)
            qt, kt = plain(q), plain(k)
            axis = 2 if kwargs.get("skip_reshape") else 1
            if qt.shape[axis] == kt.shape[axis]:
                self.self_lengths.add(int(qt.shape[axis]))
            return inner(q, k, v, *args, **kwargs)

        for module in list(sys.modules.values()):
            name = getattr(module, "__name__", "") or ""
            if not (name == "comfy" or name.startswith("comfy.")):
                continue
            for attr in self.NAMES:
                value = vars(module).get(attr)
                if any(value is fn for fn in current):
                    self.replaced.append((module, attr, value))
                    setattr(module, attr, recording)
        return self

    def __exit__(self, *exc: Any) -> None:
        for module, attr, value in reversed(self.replaced):
            setattr(module, attr, value)


def override_recorder(patcher: Any) -> dict[str, Any]:
    """An optimized_attention_override on `patcher` (chaining any there): the types it is
    handed and the query lengths of self-attention calls."""
    seen: dict[str, Any] = {"types": set(), "self_lengths": set(), "calls": 0}
    options = patcher.model_options.setdefault("transformer_options", {})
    previous = options.get("optimized_attention_override")

    def override(func: Any, q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> Any:
        seen["calls"] += 1
        seen["types"].add(type(q).__name__)
        axis = 2 if kwargs.get("skip_reshape") else 1
        if q.shape[axis] == k.shape[axis]:
            seen["self_lengths"].add(int(q.shape[axis]))
        if previous is not None:
            return previous(func, q, k, v, *args, **kwargs)
        return func(q, k, v, *args, **kwargs)

    options["optimized_attention_override"] = override
    return seen


def child(tree: str) -> dict[str, Any]:
    os.environ["COMFYUI_PATH"] = tree
    for path in (HERE, HERE.parent, REPO):
        sys.path.insert(0, str(path))
    import comfy_harness as ch

    ch.ensure_comfy()
    import pack_loader

    pack_loader.load_pack()
    import torch

    torch.set_num_threads(1)
    import comfy.ldm.modules.attention as attention
    import comfy.supported_models
    import tiny_models

    from toma_pack.nodes import run_state
    from toma_pack.nodes.forward_patches import kept_allocations
    from toma_pack.nodes.toma_node import patch_model

    stats: list[dict] = []
    run_state.send_stats = lambda node, s: stats.append(s)
    results: dict[str, Any] = {}

    def toma(model: Any, scope: str = "block") -> Any:
        return patch_model(model, 0.5, 0, "", 5, unique_id="1", start_percent=0.0,
                           end_percent=1.0, unet_levels="all", merge_scope=scope,
                           region="tile", tau=1000.0, unmerge="transpose",
                           batch_policy="per_item", verbose=False)

    def attempt(name: str, fn: Any) -> None:
        try:
            results[name] = fn()
        except Exception as error:  # a finding, judged by the tests
            import traceback

            traceback.print_exc()
            results[name] = {"error": f"{type(error).__name__}: {error}"}

    prefetch = sys.modules.get("comfy.model_prefetch")
    results["tree"] = {
        "overlay": (Path(tree) / "comfy" / "ldm" / "qwen_image21").is_dir(),
        "containers": hasattr(attention, "AttentionTensorContainer"),
        "preferred_attention": hasattr(attention, "ComfyAttention"),
        "pause_malloc_graph": hasattr(prefetch, "pause_malloc_graph"),
        "kept_allocations": type(kept_allocations()).__name__,
        "qwen_image21": hasattr(comfy.supported_models, "QwenImage21"),
        "ming_image": hasattr(comfy.supported_models, "MingImage"),
    }

    # Families merged beside an override and a module-level attention replacement ------------
    def family_case(name: str, scope: str = "block") -> dict[str, Any]:
        if name == "sdxl":
            base = ch.tiny_sdxl_patcher()
            latent = ch.empty_latent(base, 1, 64, 64)
            positive, negative = ch.sdxl_conds(1, 512, 512)
            mask = None
        elif name == "flux":
            base = ch.tiny_flux_patcher()
            latent = ch.empty_latent(base, 1, 32, 32)
            positive, negative = ch.flux_conds(1, 8)
            mask = None
        else:
            base = tiny_models.tiny_patcher(name)
            x = tiny_models.inputs(name, base, batch=1, height=16, width=16,
                                   frames=3 if tiny_models.family(name).video else 1)
            latent, positive, negative, mask = x.latent, x.positive, x.negative, x.noise_mask
        cfg = 1.0 if name == "flux" else 2.0
        model = base.clone()
        seen = override_recorder(model)
        with ModuleAttention() as module:
            reference = ch.sample(model, latent, positive, negative, steps=2, cfg=cfg,
                                  noise_mask=mask)
            unmerged = sorted(module.self_lengths)
            module.self_lengths.clear()
            seen["self_lengths"].clear()
            out = ch.sample(toma(model, scope), latent, positive, negative, steps=2, cfg=cfg,
                            noise_mask=mask)
        return {
            "layers_merged": stats[-1]["layers_merged"],
            "finite": bool(torch.isfinite(out).all()),
            "rel_err": float((out - reference).norm() / reference.norm()),
            "override_calls": seen["calls"],
            "override_types": sorted(seen["types"]),
            "override_self_lengths": sorted(seen["self_lengths"]),
            "module_types": sorted(module.types),
            "module_self_lengths": sorted(module.self_lengths),
            "unmerged_self_lengths": unmerged,
        }

    for name in ("sdxl", "flux", "wan21_t2v", "lumina2", "z_image"):
        attempt(name, lambda n=name: family_case(n))
    attempt("flux_attention_scope", lambda: family_case("flux", "attention"))

    # Lumina 2 / Z-Image: qkv computed from the block's raw input, handed over as qkv= -------
    def lumina_qkv(name: str) -> dict[str, Any]:
        import comfy.ldm.lumina.model as lumina

        fused = getattr(lumina, "_fused_rms_modulated_linear", None)
        if fused is None:
            return {"present": False}
        lengths: list[int] = []

        def emulated(x: Any, linear: Any, norm: Any, scale: Any) -> Any:
            # the fused INT8 kernel's math: linear(norm(x) * (1 + scale)), as the unfused path
            lengths.append(int(x.shape[1]))
            return linear(norm(x) * (1 + scale.unsqueeze(1)))

        base = tiny_models.tiny_patcher(name)
        x = tiny_models.inputs(name, base, batch=1, height=16, width=16)
        unfused = ch.sample(toma(base), x.latent, x.positive, x.negative, steps=2)
        lumina._fused_rms_modulated_linear = emulated
        try:
            ch.sample(base, x.latent, x.positive, x.negative, steps=2)
            unmerged = sorted(set(lengths))
            lengths.clear()
            out = ch.sample(toma(base), x.latent, x.positive, x.negative, steps=2)
        finally:
            lumina._fused_rms_modulated_linear = fused
        return {"present": True, "calls": len(lengths), "lengths": sorted(set(lengths)),
                "unmerged_lengths": unmerged, "layers_merged": stats[-1]["layers_merged"],
                "max_diff": float((out - unfused).abs().max())}

    for name in ("lumina2", "z_image"):
        attempt(f"{name}_qkv", lambda n=name: lumina_qkv(n))

    # ComfyUI's BlockSparseAttention and ModelAttentionBackend beside ToMA ------------------------
    def core_attention_nodes() -> dict[str, Any]:
        try:
            import comfy_extras.nodes_sparse_attention as sparse
        except ImportError as error:
            return {"importable": False, "why": f"{type(error).__name__}: {error}"}
        ch.comfy_top_level_nodes()
        from comfy_extras.nodes_model_advanced import ModelAttentionBackend

        base = ch.tiny_flux_patcher()
        latent = ch.empty_latent(base, 1, 32, 32)
        positive, negative = ch.flux_conds(1, 8)
        tokens: list[int] = []
        ineligible = sparse._ineligible

        def recording(q: Any, k: Any, v: Any, dim_head: int) -> Any:
            tokens.append(int(q.shape[1]))          # BTHD: the sequence it would sparsify
            return ineligible(q, k, v, dim_head)

        def output(node: Any) -> Any:
            return (getattr(node, "result", None) or node.args)[0]

        def bsa(m: Any) -> Any:
            return output(sparse.BlockSparseAttention.execute(
                m, {"selection": "sol-attn", "tau": 1.3}, 0.0, 1.0, min_tokens=0))

        def backend(m: Any) -> Any:
            return output(ModelAttentionBackend.execute(m, "pytorch attention"))

        def run(model: Any) -> Any:
            tokens.clear()
            out = ch.sample(model, latent, positive, negative, steps=2, cfg=1.0)
            return out, sorted(set(tokens)), stats[-1]["layers_merged"] if stats else None

        backend_lengths: list[int] = []
        pytorch = attention.REGISTERED_ATTENTION_FUNCTIONS["pytorch"]

        def pytorch_recording(q: Any, *args: Any, **kwargs: Any) -> Any:
            backend_lengths.append(int(plain(q).shape[2 if kwargs.get("skip_reshape") else 1]))
            return pytorch(q, *args, **kwargs)

        sparse._ineligible = recording
        attention.REGISTERED_ATTENTION_FUNCTIONS["pytorch"] = pytorch_recording
        try:
            alone, _, _ = run(toma(base))
            found: dict[str, Any] = {"importable": True}
            _, unmerged_tokens, _ = run(bsa(base))
            found["unmerged_tokens"] = unmerged_tokens
            for order, model in (("bsa_then_toma", toma(bsa(base))),
                                 ("toma_then_bsa", bsa(toma(base)))):
                stats.clear()
                out, seen, merged = run(model)
                found[order] = {"tokens": seen, "layers_merged": merged,
                                "same_as_toma_alone": bool(torch.equal(out, alone))}
            outs = {}
            for order, model in (("backend_then_toma", toma(backend(base))),
                                 ("toma_then_backend", backend(toma(base)))):
                stats.clear()
                backend_lengths.clear()
                outs[order], _, merged = run(model)
                found[order] = {"layers_merged": merged, "lengths": sorted(set(backend_lengths)),
                                "finite": bool(torch.isfinite(outs[order]).all())}
            found["backend_orders_equal"] = bool(torch.equal(*outs.values()))
        finally:
            sparse._ineligible = ineligible
            attention.REGISTERED_ATTENTION_FUNCTIONS["pytorch"] = pytorch
        return found

    attempt("core_attention_nodes", core_attention_nodes)

    # BlockSparseAttention's MiniMax H3 block patches beside ToMA ---------------------------------
    def minimax_h3_block_sparse() -> dict[str, Any]:
        if not tiny_models.minimax_h3_available():
            return {"present": False}
        try:
            import comfy_extras.nodes_sparse_attention as sparse
        except ImportError as error:
            return {"present": True, "importable": False,
                    "why": f"{type(error).__name__}: {error}"}
        base = tiny_models.tiny_minimax_h3()
        x = tiny_models.minimax_h3_inputs("i2v")

        def bsa(m: Any) -> Any:
            out = sparse.BlockSparseAttention.execute(
                m, {"selection": "sol-attn", "tau": 1.3}, 0.0, 1.0, min_tokens=0)
            return (getattr(out, "result", None) or out.args)[0]

        def run(model: Any) -> tuple[Any, dict[str, Any]]:
            stats.clear()
            out = ch.sample(model, x.latent, x.positive, x.negative, steps=2, cfg=2.0)
            return ch.flat(out), (stats[-1] if stats else {})

        reference, _ = run(base)
        _, alone = run(toma(base))
        found: dict[str, Any] = {"present": True, "importable": True,
                                 "toma_alone_merged": alone.get("layers_merged")}
        for order, model in (("bsa_then_toma", toma(bsa(base))),
                             ("toma_then_bsa", bsa(toma(base)))):
            out, seen = run(model)
            found[order] = {"layers_merged": seen.get("layers_merged"),
                            "same_as_unmerged": bool(torch.equal(out, reference)),
                            "note": seen.get("note", "")}
        return found

    attempt("minimax_h3_block_sparse", minimax_h3_block_sparse)

    # New families: Qwen-Image 2.1 merged, MingImage -----------------------------------------------
    def tiny_config_patcher(config: Any) -> Any:
        return ch._patcher(config, 0)

    def qwen_image21() -> dict[str, Any]:
        """Text to image and an edit with one reference latent of another size (ReferenceLatent's
        conds): the sampled output unmerged (its prefix cache off, as any block hook turns it
        off) and with ToMA, and the sequence each block got under ToMA (a replace patch ToMA
        wraps)."""
        if not hasattr(comfy.supported_models, "QwenImage21"):
            return {"present": False}
        config = comfy.supported_models.QwenImage21({
            "image_model": "qwen_image21", "in_channels": 64, "out_channels": 64,
            "num_layers": 2, "attention_head_dim": 16, "num_attention_heads": 4,
            "context_in_dim": 32, "mlp_ratio": 3, "axes_dims_rope": (4, 6, 6)})
        base = tiny_config_patcher(config)
        base.model_options.setdefault("transformer_options", {})["qwen_image21_cache"] = {
            "device": "off"}
        latent = torch.zeros(1, 64, 8, 10)
        found: dict[str, Any] = {"present": True}
        for case, extra in (("t2i", {}),
                            ("edit", {"reference_latents": [ch._randn(1, 64, 6, 6, seed=4)]})):
            positive = [[ch._randn(1, 7, 32, seed=0), {"pooled_output": None, **extra}]]
            negative = [[ch._randn(1, 7, 32, seed=100), {"pooled_output": None, **extra}]]
            reference = ch.sample(base, latent, positive, negative, steps=2)
            model, inner, outer = base.clone(), [], []
            for i in range(2):
                def seen(args, extra_args, inner=inner):
                    inner.append(args["img"].clone())
                    return extra_args["original_block"](args)
                model.set_model_patch_replace(seen, "dit", "single_block", i)
            try:
                patched = toma(model)
            except ValueError as error:
                return {"present": True, "refused": True, "message": str(error)}
            replace = patched.model_options["transformer_options"]["patches_replace"]["dit"]
            for i in range(2):
                def given(args, extra_args, wrapped=replace[("single_block", i)], outer=outer):
                    outer.append(args["img"].clone())
                    return wrapped(args, extra_args)
                patched.set_model_patch_replace(given, "dit", "single_block", i)
            stats.clear()
            out = ch.sample(patched, latent, positive, negative, steps=2)
            prefix = 7 + 36 * bool(extra)
            found[case] = {"finite": bool(torch.isfinite(out).all()),
                           "rel_err": float((out - reference).norm() / reference.norm()),
                           "layers_merged": stats[-1]["layers_merged"],
                           "lengths": [a.shape[1] for a in inner],
                           "prefix_kept": all(torch.equal(a[:, :prefix], b[:, :prefix])
                                              for a, b in zip(inner, outer, strict=True))}
        return {**found, "refused": False}

    def ming_image() -> dict[str, Any]:
        if not hasattr(comfy.supported_models, "MingImage"):
            return {"present": False}
        config = comfy.supported_models.MingImage(
            {**tiny_models.family("z_image").unet_config(), "image_model": "ming_image"})
        model = tiny_config_patcher(config)
        latent = torch.zeros(1, 16, 1, 16, 16)
        positive = [[ch._randn(1, 7, 32, seed=0), {"pooled_output": None}]]
        negative = [[ch._randn(1, 7, 32, seed=100), {"pooled_output": None}]]
        try:
            patched = patch_model(model, 0.5, 0, "", 5)
        except ValueError as error:
            return {"present": True, "refused": True, "message": str(error)}
        stats.clear()
        out = ch.sample(patched, latent, positive, negative, steps=2)
        found = {"present": True, "refused": False, "finite": bool(torch.isfinite(out).all()),
                 "layers_merged": stats[-1]["layers_merged"] if stats else None}
        # its direct context: model-width tokens appended to the embedded text
        width = tiny_models.family("z_image").unet_config()["dim"]
        direct = {"direct_context": ch._randn(1, 4, width, seed=7)}
        stats.clear()
        out = ch.sample(patched, latent, [[positive[0][0], {**positive[0][1], **direct}]],
                        [[negative[0][0], {**negative[0][1], **direct}]], steps=2)
        found["direct_context"] = {"finite": bool(torch.isfinite(out).all()),
                                   "layers_merged": stats[-1]["layers_merged"],
                                   "note": stats[-1].get("note", "")}
        return found

    attempt("qwen_image21", qwen_image21)
    attempt("ming_image", ming_image)
    return results


# The tests --------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def canary(tmp_path_factory: pytest.TempPathFactory, comfyui_path: Path) -> dict[str, Any]:
    """The subprocess's findings, on the overlay built here (or, where the project's overlay
    folder is missing, on the ComfyUI under test: the newest released tree in this suite)."""
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    stubs = HERE.parent / "stubs"
    if stubs.is_dir() and not all(_importable(n) for n in ("torchvision", "torchaudio")):
        paths.insert(0, str(stubs))
    if (OVERLAY / "build.sh").is_file():
        where = tmp_path_factory.mktemp("canary")
        tree, site = where / "tree", where / "site"
        built = subprocess.run(["bash", str(OVERLAY / "build.sh"), str(tree), str(site)],
                               capture_output=True, text=True, timeout=120)
        assert built.returncode == 0, built.stdout + built.stderr
        paths.insert(0, str(site))
    else:
        tree = comfyui_path
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.pop("COMFYUI_PATH", None)
    ran = subprocess.run([sys.executable, __file__, "--child", str(tree)], capture_output=True,
                         text=True, env=env, cwd=str(HERE), timeout=CHILD_TIMEOUT_S)
    lines = [line for line in ran.stdout.splitlines() if line.startswith("CANARY ")]
    assert ran.returncode == 0 and lines, ran.stdout[-4000:] + ran.stderr[-8000:]
    found = json.loads(lines[-1].removeprefix("CANARY "))
    found["stderr"] = ran.stderr[-8000:]
    return found


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _case(canary: dict[str, Any], name: str) -> dict[str, Any]:
    found = canary[name]
    assert "error" not in found, f"{name}: {found['error']}\n{canary['stderr']}"
    return found


def test_the_tree_is_the_overlay_where_the_project_has_it(canary):
    tree = canary["tree"]
    assert tree["overlay"] == (OVERLAY / "build.sh").is_file()
    if tree["overlay"]:
        assert tree["containers"] and tree["preferred_attention"] and tree["pause_malloc_graph"]


def test_kept_allocations_pause_the_malloc_graph_where_comfyui_has_one(canary):
    tree = canary["tree"]
    expected = "_PauseMallocGraph" if tree["pause_malloc_graph"] else "nullcontext"
    assert tree["kept_allocations"] == expected


@pytest.mark.parametrize("name", ["sdxl", "flux", "flux_attention_scope", "wan21_t2v",
                                  "lumina2", "z_image"])
def test_merged_families_beside_attention_overrides(canary, name):
    """ToMA merges; an attention override installed before it gets plain tensors, merged
    (shorter than any unmerged self-attention); a module-level replacement of the attention
    function gets containers on 0.34+ code and reads them."""
    found = _case(canary, name)
    assert found["layers_merged"] > 0 and found["finite"]
    assert 0 < found["rel_err"] < 1
    assert found["override_calls"] > 0 and found["override_types"] == ["Tensor"]
    # the merged blocks' self-attention is shorter than the unmerged blocks' longest (shorter
    # unmerged ones, such as Lumina's refiners, run as they did)
    assert found["override_self_lengths"]
    assert max(found["unmerged_self_lengths"]) not in found["override_self_lengths"]
    assert found["module_self_lengths"] == found["override_self_lengths"]
    # every one of these models wraps q, k and v from 0.34 on; none did in v0.33.0
    wraps = canary["tree"]["overlay"]
    assert ("AttentionTensorContainer" in found["module_types"]) == wraps


@pytest.mark.parametrize("name", ["lumina2", "z_image"])
def test_lumina_qkv_path_takes_the_merged_block_input(canary, name):
    found = _case(canary, f"{name}_qkv")
    if not canary["tree"]["overlay"]:
        assert not found["present"]
        return
    assert found["present"] and found["calls"] > 0 and found["layers_merged"] > 0
    # the fused qkv is made from the block's raw input, which ToMA has merged: a sequence
    # shorter than any the unmerged model's blocks take; same samples as the unfused path
    assert max(found["lengths"]) < max(found["unmerged_lengths"])
    assert found["max_diff"] < 1e-5


def test_block_sparse_attention_and_attention_backend_beside_toma(canary):
    found = _case(canary, "core_attention_nodes")
    if not canary["tree"]["overlay"]:
        assert not found["importable"]
        return
    assert found["importable"]
    full = max(found["unmerged_tokens"])
    for order in ("bsa_then_toma", "toma_then_bsa"):
        # BlockSparseAttention decides on the merged sequence ToMA hands it; on the CPU it
        # falls back to dense attention, so the samples equal ToMA's alone
        assert found[order]["layers_merged"] > 0
        assert min(found[order]["tokens"]) < full
        assert found[order]["same_as_toma_alone"]
    for order in ("backend_then_toma", "toma_then_backend"):
        # ModelAttentionBackend's choice (PyTorch's attention here) runs on the merged tokens,
        # whichever node came first
        assert found[order]["layers_merged"] > 0 and found[order]["finite"]
        assert found[order]["lengths"] and full not in found[order]["lengths"]
    assert found["backend_orders_equal"]


def test_block_sparse_attention_beside_toma_on_minimax_h3(canary):
    """BlockSparseAttention runs MiniMax H3's attention by the packed layout (VSA cubes, exact
    conditioning rows): ToMA stands aside in its blocks in both orders and says so (wrapping
    it: a setup note; replaced by it: a note of the run); on the CPU block-sparse attention
    falls back to dense, so the samples are the unmerged model's."""
    found = _case(canary, "minimax_h3_block_sparse")
    if not found["present"]:
        return
    if not canary["tree"]["overlay"]:
        assert not found["importable"]
        return
    assert found["toma_alone_merged"] > 0
    for order in ("bsa_then_toma", "toma_then_bsa"):
        assert found[order]["layers_merged"] == 0
        assert found[order]["same_as_unmerged"]
        assert "BlockSparseAttention runs MiniMax H3's attention" in found[order]["note"]
    assert "replaced ToMA's patch of 2 MiniMax H3 blocks" in found["toma_then_bsa"]["note"]


def test_qwen_image21_merges(canary):
    """Qwen-Image 2.1's image merges in both its blocks, text to image and edit: each block
    gets the text (7 tokens) and the reference's 6 x 6 tokens whole and as ToMA was handed
    them, and half the image's 8 x 10 (ratio 0.5: 40 of 80 tokens); the sample stays near the
    unmerged one."""
    found = _case(canary, "qwen_image21")
    assert found["present"] == canary["tree"]["qwen_image21"]
    if not found["present"]:
        return
    assert not found["refused"], found
    for case, prefix in (("t2i", 7), ("edit", 7 + 36)):
        run = found[case]
        assert run["finite"] and run["layers_merged"] == 2
        assert set(run["lengths"]) == {prefix + 40}, run["lengths"]
        assert run["prefix_kept"]
        assert run["rel_err"] < 0.19, run["rel_err"]     # 0.127, 0.123 (canary-0.38)


def test_ming_image_never_crashes(canary):
    """MingImage (a NextDiT): text to image merges; its direct context adds tokens after the
    text that ToMA cannot place, so such calls run unmerged and the note says why."""
    found = _case(canary, "ming_image")
    assert found["present"] == canary["tree"]["ming_image"]
    if found["present"] and not found["refused"]:
        assert found["finite"]
        direct = found["direct_context"]
        assert direct["finite"] and direct["layers_merged"] == 0
        assert "direct_context" in direct["note"]


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    print("CANARY " + json.dumps(child(sys.argv[2]), default=sorted))
