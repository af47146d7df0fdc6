"""ToMASpeedCheck: what ToMA gives on the artist's own machine, model and resolution, on
whatever device ComfyUI runs the model (SPEED_CHECK's description says what the node shows,
time_variants how each variant is timed)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from .apply import WRAPPER_KEY, apply_toma
from .node_spec import NodeSpec
from .options import MAX_RATIO, ToMAOptions, check_number
from .toma_node import CATEGORY
from .ui_stats import LINE_BREAK, SEPARATOR, send_text

DEFAULT_RATIOS = "0.25, 0.5, 0.75"
MAX_CALLS = 50
ROUNDS = 2


@dataclass(frozen=True)
class Timing:
    """One variant: its label, seconds per model call, the relative L2 distance of its first
    step's output to the unmerged one's and ToMA's summary of its timed run (None for the
    unmerged row)."""

    label: str
    seconds: float
    change: float | None = None
    stats: dict | None = None


SPEED_CHECK = NodeSpec(
    node_id="ToMASpeedCheck",
    display_name="ToMA Speed Check",
    category=CATEGORY,
    description="Times a few model calls of the connected model on this machine: unmerged, "
                "with ToMA at the settings of the ToMA node it comes from (or the defaults), "
                "and at other ratios. Shows time per call, speed-up and how far the first "
                "output moves from unmerged, a line per variant on the node, and a chart.",
    inputs={
        "model": ("MODEL", {"tooltip": "The model to check: the output of a ToMA node (its "
                                       "settings are timed), or a model without ToMA."}),
        "positive": ("CONDITIONING", {"tooltip": "The prompt's conditioning, as your sampler "
                                                 "gets it."}),
        "latent": ("LATENT", {"tooltip": "A latent at the size you generate (e.g. Empty Latent "
                                         "Image)."}),
        "ratios": ("STRING", {"default": DEFAULT_RATIOS, "multiline": False,
                              "tooltip": "Other ratios to time, separated by commas."}),
        "calls": ("INT", {"default": 3, "min": 1, "max": MAX_CALLS, "step": 1,
                          "tooltip": "Model calls timed per variant (more: steadier figures)."}),
    },
    outputs=("IMAGE",),
    hidden=("unique_id",),
)


def parse_ratios(text: str) -> list[float]:
    """"0.25, 0.5" -> [0.25, 0.5]; ValueError naming the widget for anything else."""
    if not isinstance(text, str):
        raise ValueError(f"ratios must be text such as {DEFAULT_RATIOS!r}")
    ratios = []
    for part in text.replace(";", ",").split(","):
        if not part.strip():
            continue
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"ratios: cannot read {part.strip()!r}; write numbers separated "
                             f"by commas, e.g. {DEFAULT_RATIOS!r}") from None
        check_number("ratios", value, 0.0, MAX_RATIO)
        ratios.append(value)
    return ratios


def state_of(model: Any) -> Any:
    """The ToMAState of the last ToMA node that patched ModelPatcher `model` (apply_toma keeps
    it on its OUTER_SAMPLE wrapper), or None."""
    from comfy.patcher_extension import WrappersMP

    wrappers = model.get_wrappers(WrappersMP.OUTER_SAMPLE, WRAPPER_KEY)
    return wrappers[-1].toma_state if wrappers else None


def variants(model: Any, ratios: list[float]) -> dict[str, Any]:
    """The models to time, by label: unmerged (the model without its ToMA nodes), the settings
    of the last ToMA node on it (or the defaults), then each other ratio at those settings
    (ratio 0 is the unmerged model)."""
    base, options = model, None
    while (state := state_of(base)) is not None:
        base = state.source()
        if base is None:
            raise ValueError("the model the ToMA node patched is no longer loaded: run the "
                             "graph again with the speed check connected after the ToMA node")
        options = options or state.options
    connected = options is not None
    options = options or ToMAOptions()
    out = {"unmerged": base,
           f"ToMA {options.ratio:g} ({'connected' if connected else 'defaults'})":
               apply_toma(base, options)}
    for ratio in dict.fromkeys(ratios):
        if ratio not in (0.0, options.ratio):
            out[f"ToMA {ratio:g}"] = apply_toma(base, replace(options, ratio=ratio))
    return out


def time_variants(models: dict[str, Any], positive: Any, latent: dict, calls: int) -> list[Timing]:
    """Each model's seconds per model call (the faster of ROUNDS interleaved runs of `calls`
    Euler steps at cfg 1, so that a burst of other work on the machine does not decide; CUDA
    events on a GPU, the clock elsewhere), and the change of its first step's output from the
    first model's (unmerged)."""
    import comfy.model_management
    import comfy.sample

    samples = latent["samples"]
    noise = comfy.sample.prepare_noise(samples, 0)
    device = comfy.model_management.get_torch_device()

    def sample(model, steps: int) -> torch.Tensor:
        return comfy.sample.sample(model, noise, steps, 1.0, "euler", "simple", positive,
                                   positive, samples, disable_pbar=True, seed=0)

    # one step each first: loading, compiling, the output compared
    firsts = {label: sample(model, 1).float() for label, model in models.items()}
    best = dict.fromkeys(models, math.inf)
    for _ in range(ROUNDS):
        for label, model in models.items():
            if device.type == "cuda":
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                sample(model, calls)
                end.record()
                end.synchronize()
                seconds = start.elapsed_time(end) / 1e3
            else:
                begin = time.perf_counter()
                sample(model, calls)
                seconds = time.perf_counter() - begin
            best[label] = min(best[label], seconds / calls)
    (base_label, base), *others = firsts.items()
    out = [Timing(base_label, best[base_label])]
    for label, first in others:
        change = float((first - base).norm() / base.norm().clamp_min(1e-12))
        state = state_of(models[label])
        out.append(Timing(label, best[label], change, state and state.last_stats))
    return out


def format_results(rows: list[Timing]) -> str:
    """The text shown on the node, a line a variant, ToMA's first (the node's text box shows
    about two lines before it scrolls), unmerged last, e.g.

        ToMA 0.5 (connected): 1.35x · 12.3 ms a call · 60/70 layers · output moved 0.042
        unmerged: 1.00x · 16.6 ms a call

    then what ToMA said about each variant's timed run that merged nothing."""
    base = rows[0].seconds
    lines, notes = [], []
    for row in [*rows[1:], rows[0]]:
        parts = [f"{base / row.seconds:.2f}x", f"{row.seconds * 1e3:.1f} ms a call"]
        if row.stats is not None:
            merged = row.stats.get("layers_merged", 0)
            parts.append(f"{merged}/{row.stats.get('layers_total', 0)} layers")
            if not merged and row.stats.get("note"):
                notes.append(f"{row.label}: {row.stats['note']}")
        if row.change is not None:
            parts.append(f"output moved {row.change:.3f}")
        lines.append(f"{row.label}: {SEPARATOR.join(parts)}")
    return LINE_BREAK.join(lines + notes)


def chart(rows: list[Timing]) -> torch.Tensor:
    """A bar chart of the speed-ups [1, H, W, 3] in [0, 1]: one bar a variant, 1x marked."""
    from PIL import Image, ImageDraw

    base = rows[0].seconds
    speedups = [base / row.seconds for row in rows]
    bar, gap, left, width = 22, 8, 200, 512
    height = gap + len(rows) * (bar + gap)
    top = max(max(speedups), 1.0) * 1.1
    image = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    scale = (width - left - 60) / top
    one = left + int(scale)
    draw.line([one, 0, one, height], fill=(200, 60, 60), width=1)        # 1x: as fast as unmerged
    for i, (row, speed) in enumerate(zip(rows, speedups, strict=True)):
        y = gap + i * (bar + gap)
        colour = (150, 150, 150) if i == 0 else (60, 110, 200)
        draw.rectangle([left, y, left + int(speed * scale), y + bar], fill=colour)
        draw.text((6, y + 5), row.label, fill=(0, 0, 0))
        draw.text((left + int(speed * scale) + 6, y + 5), f"{speed:.2f}x", fill=(0, 0, 0))
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    return pixels.view(1, height, width, 3).float() / 255


def speed_check(model: Any, positive: Any, latent: dict, ratios: str, calls: int,
                unique_id: str | None = None) -> tuple[list[Timing], torch.Tensor]:
    """What ToMASpeedCheck does: the timings (also shown on node `unique_id`) and their chart.
    ValueError names a bad widget."""
    check_number("calls", calls, 1, MAX_CALLS, whole=True)
    other = parse_ratios(ratios)
    if not isinstance(latent, dict) or not torch.is_tensor(latent.get("samples")):
        raise ValueError("latent must be a LATENT (e.g. from Empty Latent Image)")
    rows = time_variants(variants(model, other), positive, latent, calls)
    send_text(unique_id, format_results(rows))
    return rows, chart(rows)
