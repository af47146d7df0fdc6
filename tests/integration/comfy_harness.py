"""Real ComfyUI for integration tests: find it, import it in CPU mode, build tiny models, sample.

Tested against ComfyUI 0.3.64, 0.8.0 and 0.33.0. Nothing here imports `comfy` when this module is
imported: `ensure_comfy()` does it once, so that a machine without ComfyUI skips the integration
tests (see conftest.py) instead of failing to collect them.

Where ComfyUI is: $COMFYUI_PATH, else the ComfyUI folder that holds this pack in custom_nodes/,
else the newest source tree in ../shared/comfyui (this project's read-only copies, see its README).

The tiny models are ComfyUI's own SDXL and Flux classes at toy sizes, fp32 on the CPU, with
weights filled from a seeded generator (uninitialised otherwise: ComfyUI skips weight init).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from comfy.model_patcher import ModelPatcher

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
SHARED_TREES = REPO_ROOT.parent / "shared" / "comfyui"
# Stand-ins for torchvision/torchaudio, whose PyPI wheels need CUDA beside the CPU torch here;
# used only with the shared trees and only when the real packages are missing (tests/stubs: the
# names ComfyUI imports, and those the other node packs of the composition tests import).
STUBS = REPO_ROOT / "tests" / "stubs"
CPU = torch.device("cpu")
HOW_TO = (
    "set COMFYUI_PATH=/path/to/ComfyUI (a checkout whose requirements.txt is installed in this "
    "Python), or put this pack in ComfyUI/custom_nodes/"
)

# Conditioning in ComfyUI's format: [[cross_attn_tensor, {extra conds}], ...].
Conditioning = list[list[Any]]
AttentionBackend = Literal["sub_quadratic", "sdpa"]

# Tiny SDXL: the real layout (3 levels, attention only at the two lower resolutions, depths
# 1/2 there and 2 in the middle) at toy widths, so every block kind and index ToMA sees exists.
SDXL_CONTEXT_DIM = 64
SDXL_POOLED_DIM = 32
SDXL_ADM_EXTRA = 6 * 256  # model_base.SDXL.encode_adm: size, crop and target, 256 wide each
SDXL_UNET_CONFIG: dict[str, Any] = {
    "use_checkpoint": False,
    "image_size": 32,
    "in_channels": 4,
    "out_channels": 4,
    "model_channels": 32,
    "num_res_blocks": [2, 2, 2],
    "channel_mult": [1, 2, 4],
    "transformer_depth": [0, 0, 1, 1, 2, 2],
    "transformer_depth_middle": 2,
    "transformer_depth_output": [0, 0, 0, 1, 1, 1, 2, 2, 2],
    "context_dim": SDXL_CONTEXT_DIM,
    "num_head_channels": 16,
    "adm_in_channels": SDXL_POOLED_DIM + SDXL_ADM_EXTRA,
    "use_linear_in_transformer": True,
    "legacy": False,
    "num_classes": "sequential",
    "use_spatial_transformer": True,
    "use_temporal_attention": False,
    "use_temporal_resblock": False,
}

# SDXL's real block structure at the tiny width: transformer depths 2 and 10 at its two
# attention levels and 10 in the middle, 70 transformer blocks (what ToMA patches and counts).
SDXL_REAL_DEPTHS: dict[str, Any] = {
    "transformer_depth": [0, 0, 2, 2, 10, 10],
    "transformer_depth_middle": 10,
    "transformer_depth_output": [0, 0, 0, 2, 2, 2, 10, 10, 10],
}
# Flux.1's block structure (19 double + 38 single blocks) at the tiny width.
FLUX_REAL_DEPTHS: dict[str, Any] = {"depth": 19, "depth_single_blocks": 38}

# Tiny Flux: 2 double + 2 single blocks, 4 heads of 16 (RoPE axes 4+6+6), 16 latent channels.
FLUX_CONTEXT_DIM = 64
FLUX_POOLED_DIM = 32
FLUX_PARAMS: dict[str, Any] = {
    "in_channels": 16,
    "out_channels": 16,
    "vec_in_dim": FLUX_POOLED_DIM,
    "context_in_dim": FLUX_CONTEXT_DIM,
    "hidden_size": 64,
    "mlp_ratio": 4.0,
    "num_heads": 4,
    "depth": 2,
    "depth_single_blocks": 2,
    "axes_dim": [4, 6, 6],
    "theta": 10000,
    "patch_size": 2,
    "qkv_bias": True,
    "guidance_embed": True,
    "txt_ids_dims": [],  # FluxParams field since 0.8 (no default there); [] is plain Flux
}

_BACKEND_FUNCTIONS: dict[str, str] = {
    "sdpa": "attention_pytorch",
    "sub_quadratic": "attention_sub_quad",
}
_ATTENTION_NAMES = ("optimized_attention", "optimized_attention_masked")


class ComfyUnavailableError(RuntimeError):
    """ComfyUI cannot be used in this Python; the message says why and what to do."""


# Finding and importing ComfyUI -----------------------------------------------------------------
def _is_comfyui(path: Path) -> bool:
    return (path / "main.py").is_file() and (path / "comfy").is_dir()


def _pack_roots() -> list[Path]:
    """This pack's folder as reached: really, and through a symlink in custom_nodes/ (pytest
    resolves symlinks, the shell's $PWD keeps them)."""
    roots = [REPO_ROOT]
    logical = Path(os.environ.get("PWD", "."))
    roots += [p for p in (logical, *logical.parents) if p.resolve() == REPO_ROOT]
    return roots


def find_comfyui() -> Path:
    """The ComfyUI checkout to test against; raises ComfyUnavailableError if there is none."""
    env = os.environ.get("COMFYUI_PATH")
    if env:
        path = Path(env).expanduser().resolve()
        if not _is_comfyui(path):
            raise ComfyUnavailableError(
                f"COMFYUI_PATH={env} is not a ComfyUI folder (no main.py and comfy/)")
        return path
    # The usual install: ComfyUI/custom_nodes/<this pack>.
    for root in _pack_roots():
        if _is_comfyui(root.parent.parent):
            return root.parent.parent.resolve()
    trees = shared_trees()
    if trees:
        return trees[-1]
    raise ComfyUnavailableError(f"no ComfyUI found: {HOW_TO}")


def _version_key(path: Path) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", path.name))


def shared_trees() -> list[Path]:
    """The ComfyUI source trees in ../shared/comfyui (v0.3.64, ...), oldest first; [] if none."""
    if not SHARED_TREES.is_dir():
        return []
    return sorted((p.resolve() for p in SHARED_TREES.iterdir() if _is_comfyui(p)),
                  key=_version_key)


def _imported_from(module_name: str) -> Path | None:
    """Where an already imported package lives (comfy/ has no __init__.py: use __path__)."""
    module = sys.modules.get(module_name)
    locations = list(getattr(module, "__path__", [])) or [getattr(module, "__file__", None)]
    return Path(locations[0]).resolve() if locations and locations[0] else None


def _import_comfy(path: Path) -> None:
    if "comfy" in sys.modules:
        # Another ComfyUI (or a stand-in) is already loaded: mixing two would test the wrong one.
        where = _imported_from("comfy")
        if where is None or not where.is_relative_to(path):
            raise ComfyUnavailableError(
                f"a different `comfy` is already imported (from {where}), not {path}")
    else:
        _use_stubs_if_needed(path)
    if "comfy" not in sys.modules and str(path) not in sys.path:
        # Appended, not prepended: ComfyUI's top-level nodes.py, utils/, app/ must not shadow
        # this pack's own packages (the pack has a nodes/ package) for the other tests.
        sys.path.append(str(path))
    importlib.import_module("comfy.options")
    from comfy.cli_args import args

    if "comfy.model_management" in sys.modules:
        log.warning("comfy.model_management was imported before the harness: CPU mode not forced")
    else:
        args.cpu = True  # read once, when comfy.model_management is first imported
    for name in ("comfy.model_management", "comfy.model_patcher", "comfy.samplers",
                 "comfy.sample", "comfy.supported_models", "comfy.ldm.modules.attention",
                 "comfy.ldm.flux.model", "comfy.ldm.flux.math"):
        importlib.import_module(name)
    where = _imported_from("comfy")
    if where is None or not where.is_relative_to(path):
        raise ComfyUnavailableError(f"`comfy` was imported from {where}, not from {path}")


def _use_stubs_if_needed(path: Path) -> None:
    """Put tests/stubs on sys.path (and PYTHONPATH, for ComfyUI servers started by tests)
    when testing a shared tree in a Python without torchvision/torchaudio."""
    if not path.is_relative_to(SHARED_TREES.resolve()) or not STUBS.is_dir():
        return
    if all(importlib.util.find_spec(name) for name in ("torchvision", "torchaudio")):
        return
    stubs = str(STUBS)
    if stubs not in sys.path:
        sys.path.insert(0, stubs)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if stubs not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([stubs, *parts])


_status: tuple[Path | None, str] | None = None


def comfy_status() -> tuple[Path | None, str]:
    """(ComfyUI folder, "") when comfy imports here, else (None, why not). Tried once."""
    global _status
    if _status is None:
        path: Path | None = None
        sys_path, modules = list(sys.path), set(sys.modules)
        try:
            path = find_comfyui()
            _import_comfy(path)
            _status = (path, "")
            log.info("integration tests use ComfyUI %s at %s", comfy_version_string(path), path)
        except ComfyUnavailableError as exc:
            _status = (None, str(exc))
        except Exception as exc:  # any import failure: missing deps, a broken checkout
            _forget_comfy(sys_path, modules)
            _status = (None, f"ComfyUI found at {path} but `import comfy` failed "
                             f"({type(exc).__name__}: {exc}): install its requirements.txt "
                             "in this Python")
    return _status


def _forget_comfy(sys_path: list[str], modules: set[str]) -> None:
    # A half-imported comfy must not leak into the other tests of the session.
    sys.path[:] = sys_path
    for name in [n for n in sys.modules if n not in modules]:
        if name == "comfy" or name.startswith("comfy."):
            del sys.modules[name]


def ensure_comfy() -> Path:
    """Import ComfyUI (CPU mode) if not done yet; its folder. Raises ComfyUnavailableError."""
    path, reason = comfy_status()
    if path is None:
        raise ComfyUnavailableError(reason)
    return path


def comfy_top_level_nodes() -> Any:
    """ComfyUI's own top-level `nodes` module (nodes.py), which some comfy_extras modules import
    (`import nodes`): this pack's folder also has a `nodes` package, which that import would
    find first from the repository root. Loaded once by path under its own name."""
    path = ensure_comfy() / "nodes.py"
    module = sys.modules.get("nodes")
    if module is None or Path(getattr(module, "__file__", "") or "").resolve() != path.resolve():
        spec = importlib.util.spec_from_file_location("nodes", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["nodes"] = module
        spec.loader.exec_module(module)
    return module


def comfy_version_string(path: Path | None = None) -> str:
    """ComfyUI's version as written in its comfyui_version.py ("unknown" if absent)."""
    version_file = (path or ensure_comfy()) / "comfyui_version.py"
    if not version_file.is_file():
        return "unknown"
    match = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", version_file.read_text())
    return match.group(1) if match else "unknown"


def comfy_version() -> tuple[int, ...]:
    """ComfyUI's version as numbers, e.g. (0, 33, 0), for version-dependent expectations."""
    numbers = re.findall(r"\d+", comfy_version_string())
    return tuple(int(n) for n in numbers[:3])


# Attention backend -----------------------------------------------------------------------------
def current_attention() -> str:
    """Name of the attention function ComfyUI's models call now (e.g. "attention_sub_quad")."""
    ensure_comfy()
    import comfy.ldm.modules.attention as attention

    return attention.optimized_attention.__name__


@contextlib.contextmanager
def attention_backend(name: AttentionBackend) -> Iterator[None]:
    """Make every ComfyUI model use this attention function inside the block.

    ComfyUI picks `optimized_attention` once, at import, from its command line flags; the UNet
    reads the name from comfy.ldm.modules.attention at call time, but Flux (comfy.ldm.flux.math)
    and other models bound it with `from ... import optimized_attention`. So every loaded comfy
    module holding the current function under either name gets the new one, and the old one
    back afterwards. Same in 0.3.64, 0.8.0 and 0.33.0. Modules first imported inside the block
    would keep the new function: the harness imports the ones the tiny models use beforehand.
    """
    ensure_comfy()
    import comfy.ldm.modules.attention as attention

    new = getattr(attention, _BACKEND_FUNCTIONS[name])
    current = [getattr(attention, attr) for attr in _ATTENTION_NAMES]
    replaced: list[tuple[Any, str, Any]] = []
    for module in list(sys.modules.values()):
        module_name = getattr(module, "__name__", "")
        if not (module_name == "comfy" or module_name.startswith("comfy.")):
            continue
        for attr in _ATTENTION_NAMES:
            value = vars(module).get(attr)
            if any(value is fn for fn in current):
                replaced.append((module, attr, value))
                setattr(module, attr, new)
    try:
        yield
    finally:
        for module, attr, value in reversed(replaced):
            setattr(module, attr, value)


def record_attention_calls(patcher: ModelPatcher) -> list[str]:
    """Record, per attention call of `patcher`'s model, the attention function's name.

    Uses ComfyUI's `optimized_attention_override` (called with the function about to run) and
    chains any override already there. The returned list fills while sampling.
    """
    calls: list[str] = []
    options = patcher.model_options.setdefault("transformer_options", {})
    previous = options.get("optimized_attention_override")

    def override(func: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(func.__name__)
        if previous is not None:
            return previous(func, *args, **kwargs)
        return func(*args, **kwargs)

    options["optimized_attention_override"] = override
    return calls


# Tiny models -----------------------------------------------------------------------------------
def _bench_weights() -> Any:
    """bench/shared/weights.py, the random-weight fill shared with the benchmarks, loaded by path
    (no
    sys.path change, so it works inside a ComfyUI server too)."""
    name = "toma_bench_weights"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, REPO_ROOT / "bench" / "shared" / "weights.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


# fill_weights(model, seed=0, gain=1.0): biases 0, norm scales 1, matrices N(0, gain^2/fan_in).
fill_weights = _bench_weights().fill_weights


def _patcher(model_config: Any, seed: int) -> ModelPatcher:
    import comfy.model_patcher

    model_config.set_inference_dtype(torch.float32, None)
    model = model_config.get_model({}, device=CPU)
    fill_weights(model, seed)
    model.eval()
    # Plain ModelPatcher: what ComfyUI uses on the CPU (0.33 swaps in ModelPatcherDynamic only
    # when comfy-aimdo works, i.e. on an NVIDIA GPU).
    return comfy.model_patcher.ModelPatcher(model, load_device=CPU, offload_device=CPU)


def tiny_sdxl_patcher(seed: int = 0, real_depths: bool = False) -> ModelPatcher:
    """A ~5M-parameter SDXL-layout UNet (comfy.supported_models.SDXL), fp32, seeded weights;
    real_depths: SDXL's 70 transformer blocks (SDXL_REAL_DEPTHS) instead of the tiny depths."""
    ensure_comfy()
    import comfy.supported_models

    config = comfy.supported_models.SDXL(
        {**SDXL_UNET_CONFIG, **(SDXL_REAL_DEPTHS if real_depths else {})})
    # BASE.__init__ overlays unet_extra_config (num_head_channels 64, for the real width 320).
    config.unet_config["num_head_channels"] = SDXL_UNET_CONFIG["num_head_channels"]
    config.unet_config["num_heads"] = -1
    return _patcher(config, seed)


def tiny_flux_patcher(seed: int = 0, real_depths: bool = False) -> ModelPatcher:
    """A tiny Flux (comfy.supported_models.Flux): hidden 64, 4 heads, 2+2 blocks (real_depths:
    Flux.1's 19+38, FLUX_REAL_DEPTHS), fp32."""
    ensure_comfy()
    import comfy.ldm.flux.model
    import comfy.supported_models

    # FluxParams grows across versions (txt_ids_dims, global_modulation, ...): pass only the
    # fields this version has; the rest keep their defaults.
    fields = {f.name for f in dataclasses.fields(comfy.ldm.flux.model.FluxParams)}
    params = {k: v for k, v in {**FLUX_PARAMS, **(FLUX_REAL_DEPTHS if real_depths else {})}.items()
              if k in fields}
    config = comfy.supported_models.Flux({"image_model": "flux", **params})
    return _patcher(config, seed)


def latent_channels(patcher: ModelPatcher) -> int:
    """Channels of the model's latent (4 for SDXL, 16 for Flux)."""
    return int(patcher.model.latent_format.latent_channels)


def empty_latent(patcher: ModelPatcher, batch: int, height: int, width: int) -> torch.Tensor:
    """Zeros [batch, channels, height, width] (latent pixels, i.e. image pixels / 8)."""
    return torch.zeros(batch, latent_channels(patcher), height, width)


# Conditioning ----------------------------------------------------------------------------------
def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def sdxl_conds(batch: int, width: int, height: int, tokens: int = 8,
               seed: int = 0) -> tuple[Conditioning, Conditioning]:
    """(positive, negative) for the tiny SDXL; width and height are image pixels (latent * 8).

    SDXL's adm vector is built by model_base.SDXL.encode_adm from pooled_output, width and
    height (crop and target sizes default from them) in all three versions.
    """
    def cond(offset: int) -> Conditioning:
        context = _randn(batch, tokens, SDXL_CONTEXT_DIM, seed=seed + offset)
        pooled = _randn(batch, SDXL_POOLED_DIM, seed=seed + offset + 1)
        return [[context, {"pooled_output": pooled, "width": width, "height": height}]]

    return cond(0), cond(100)


def flux_conds(batch: int, txt_len: int, guidance: float = 3.5,
               seed: int = 0) -> tuple[Conditioning, Conditioning]:
    """(positive, negative) for the tiny Flux: T5-like context [batch, txt_len, 64], pooled
    CLIP-like vector, and "guidance" (Flux dev's distilled guidance)."""
    def cond(offset: int) -> Conditioning:
        context = _randn(batch, txt_len, FLUX_CONTEXT_DIM, seed=seed + offset)
        pooled = _randn(batch, FLUX_POOLED_DIM, seed=seed + offset + 1)
        return [[context, {"pooled_output": pooled, "guidance": guidance}]]

    return cond(0), cond(100)


# Sampling --------------------------------------------------------------------------------------
def sample(patcher: ModelPatcher, latent: torch.Tensor, positive: Conditioning,
           negative: Conditioning, steps: int = 4, cfg: float = 2.0, sampler: str = "euler",
           scheduler: str = "normal", seed: int = 0, denoise: float = 1.0,
           noise_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Run ComfyUI's KSampler path (comfy.sample.sample) like the KSampler node does.

    cfg 1.0 skips the negative pass (ComfyUI's cfg1 optimisation): use it for Flux.
    noise_mask: the latent's "noise_mask" (1 = denoise), as the KSampler node passes it.
    """
    ensure_comfy()
    import comfy.sample

    noise = comfy.sample.prepare_noise(latent, seed)
    return comfy.sample.sample(patcher, noise, steps, cfg, sampler, scheduler, positive, negative,
                               latent, denoise=denoise, noise_mask=noise_mask,
                               disable_pbar=True, seed=seed)


def flat(samples: Any) -> torch.Tensor:
    """Samples as one tensor: a NestedTensor's streams (LTX-2's video and audio) each
    flattened per batch item and joined, [B, N]; a tensor as it is."""
    if getattr(samples, "is_nested", False):
        return torch.cat([t.flatten(1) for t in samples.unbind()], dim=1)
    return samples


def unload_models() -> None:
    """Drop ComfyUI's loaded-model list so a test's models and patches don't outlive it."""
    if "comfy.model_management" in sys.modules:
        sys.modules["comfy.model_management"].unload_all_models()
