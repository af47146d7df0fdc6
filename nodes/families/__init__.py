"""The diffusion transformer families ToMA patches, one module each (descriptions only: the
patch is dit_patch.py). Each module states its CONTRACT (contracts.py: the model classes it
patches and what it needs from ComfyUI) and gives, in `family(diffusion_model)`, the Family of a
model of those classes (`claims(diffusion_model)`, where a module has it, tells two families of
one class apart). Classes are matched exactly, not by isinstance: ComfyUI subclasses these
models for variants with other token layouts (S2V, HuMo and Animate 2 Wan, ...),
which must get the "not supported" error rather than a wrong merge.

`family_of` checks a model's family contract against the running ComfyUI before it describes
the model: a family whose contract fails refuses its models with what changed, and every other
family keeps working (no family imports its classes outside contracts.py's guards).
"""

from __future__ import annotations

from ..contracts import block_mismatches, claimed, mismatches, refusal
from ..dit_families import Family
from . import (
    anima,
    boogu,
    flux,
    hidream,
    hidream_o1,
    hunyuan_image,
    hunyuan_video,
    ideogram4,
    kandinsky5,
    krea2,
    ltx,
    lumina,
    mage_flow,
    minimax_h3,
    qwen_image,
    scail,
    sd3,
    wan,
)

MODULES = (flux, wan, hunyuan_video, hunyuan_image, qwen_image, sd3, lumina, ltx, hidream,
           hidream_o1, kandinsky5, krea2, minimax_h3, mage_flow, anima, scail, boogu,
           ideogram4)
UNET_MODELS = "SDXL, SD1.5 and SD2 (ComfyUI's UNet)"


def supported_models() -> str:
    """Every model the node supports, as its error names them: the UNet ones, then each
    family's."""
    names = [UNET_MODELS, *(module.MODELS for module in MODULES)]
    return ", ".join(names[:-1]) + " and " + names[-1]


# Models of these classes share a supported family's blocks but are left alone, and the error
# says why (classes by name: some exist only in some ComfyUI versions).
NOT_MERGED = {
    "WanAnimate2Model": "Wan Animate 2's self-attention splits the video's queries frame by "
                        "frame, each frame attending its own pose frame, with one length "
                        "(hw) for a frame of queries, its pose frame's keys and the "
                        "reference frame; merged frames shorter than hw could keep neither "
                        "the reference frame nor the pose frames whole",
    "WanModel_S2V": "Wan S2V spreads its timestep rows over the sequence by position (with "
                    "motion frames two a frame plus three, across video, reference and motion "
                    "tokens), so a shorter merged sequence would hand tokens other rows",
    "HumoWanModel": "HuMo's audio cross-attention cuts the video's tokens into equal parts, one "
                    "a frame, and WanHuMoImageToVideo always appends a reference frame (zeros "
                    "without a reference image) that must not merge, so merged frames could "
                    "not be equal parts",
}


def not_merged_reason(diffusion_model) -> str | None:
    """Why a known model class is left alone, or None."""
    return NOT_MERGED.get(type(diffusion_model).__name__)


def family_of(diffusion_model) -> Family | None:
    """The Family of a diffusion model, or None when ToMA does not support it. ValueError
    (naming the family, what changed and the ComfyUI version) for a model of a family whose
    contract this ComfyUI fails, or whose model cannot be read as the family reads it."""
    for module in MODULES:
        contract = module.CONTRACT
        model = claimed(contract, diffusion_model)
        if model is None or not _claims(module, diffusion_model):
            continue
        name = type(diffusion_model).__name__
        problems = mismatches(contract, model)
        if problems:
            raise ValueError(refusal(contract, name, problems))
        try:
            found = module.family(diffusion_model)
        except Exception as error:
            raise ValueError(refusal(contract, name, [
                f"reading its {name} model failed ({type(error).__name__}: {error})"])) \
                from error
        problems = block_mismatches(blocks_read(contract.blocks, found), diffusion_model)
        if problems:
            raise ValueError(refusal(contract, name, problems))
        return found
    return None


def _claims(module, diffusion_model) -> bool:
    """Whether a module whose classes the model is of takes it (its `claims`, where it has
    one; a model it cannot tell is taken, so that its family's checks say what is wrong)."""
    claims = getattr(module, "claims", None)
    try:
        return claims is None or bool(claims(diffusion_model))
    except Exception:
        return True


def blocks_read(blocks: dict[str, tuple[str, ...]], family: Family) -> dict[str, tuple[str, ...]]:
    """The contract's block forwards' parameters, with what the family reads by name where it
    patches a block's forward itself (its own kinds' arguments: the block's parameters are
    those names there) and the token positions it moves (which reach the block's forward)."""
    out = {path: tuple(names) for path, names in blocks.items()}
    for kind in family.kinds:
        needed = (*kind.arguments, *kind.opaque) if kind.hook == "object" else ()
        needed = (*needed, *kind.positions)
        out[kind.modules] = tuple(dict.fromkeys((*out.get(kind.modules, ()), *needed)))
    return out
