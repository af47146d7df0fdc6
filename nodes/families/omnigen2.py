"""OmniGen2 (comfy/ldm/omnigen): Boogu-Image's single-stream blocks alone on [text; edit
references; image], read as Boogu-Image reads a call; the refiners before them run unmerged."""

from __future__ import annotations

import dataclasses

from ..contracts import Contract
from ..dit_families import Family
from . import boogu, conditioning, sets_patch

MODELS = "OmniGen2"

KINDS = (dataclasses.replace(boogu.KINDS[1], key="layer", modules="layers", letter=""),)

OMNIGEN2 = "comfy.ldm.omnigen.omnigen2:OmniGen2Transformer2DModel"

CONTRACT = Contract(
    "OmniGen2",
    models={OMNIGEN2: (sets_patch(OMNIGEN2),)},
    needs=(conditioning("Omnigen2", ("c_crossattn", "ref_latents")),),
    kinds=KINDS,
)


def family(diffusion_model) -> Family:
    return dataclasses.replace(boogu.family(diffusion_model), name="omnigen2",
                               label="OmniGen2", kinds=KINDS)
