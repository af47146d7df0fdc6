"""Model card of the quality fixtures: loss curves and sample grids (PNG in docs/) and
models/README.md, from the weights and the training logs that bench/quality/train.py wrote.

    PYTHONPATH=../shared/stubs COMFYUI_PATH=../shared/comfyui/v0.8.0 \
        .cache/venvs/v0.8.0/bin/python -m bench.quality.card
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from PIL import Image, ImageDraw

from ..shared.config import ROOT
from . import data as quality_data
from . import models as qm
from . import section as quality

CARD = qm.MODELS_DIR / "README.md"
LAYOUT_TEXT = {
    "sdxl": "ComfyUI's SDXL class (`comfy.supported_models.SDXL`, UNetModel, EPS prediction) "
            "with SDXL's block structure at width 32 and transformer depth 1: 3 levels (channel "
            "mult 1/2/4, 2 res blocks each), attention only at the two lower levels and in the "
            "middle, linear proj_in, adm vector from pooled + 6 size embeddings, context 4 x 64, "
            "heads of 32 channels. Evaluated at a 128x128 latent (= 128x128 pixels): attention "
            "levels of 4096 and 1024 tokens. Full config in the file's metadata (`unet_config`).",
    "flux": "ComfyUI's Flux class (`comfy.supported_models.Flux`: double and single stream "
            "blocks, RoPE over axes 4/6/6 with theta 32, see bench/quality/models.py) at hidden "
            "64, 4 heads, 10 double + 20 single blocks (Flux.1's 1:2 mix, deep enough for the "
            "default skip_blocks `d0-4, s0-4`), no guidance embedding, context 4 x 64. "
            "Evaluated at a 64x64 latent (= 128x128 pixels): 1024 image tokens. "
            "Full config in the file's metadata (`flux_params`).",
    "sdxl-matched": "The SDXL layout at width 64 with SDXL's 64-channel heads (2 and 4 heads at "
                    "the attention levels), trained on photographs and rendered scenes. "
                    "Evaluated at a 56x56 latent (= 56x56 pixels): attention levels of 784 "
                    "tokens at 128 channels and 196 at 256, the tokens per channel of SDXL's "
                    "4096 x 640 and 1024 x 1280 at 1024x1024, so each transformer block splits "
                    "its work between self-attention, cross-attention and feed-forward as "
                    "SDXL's do (bench/results/2026-12-01-cpu-quality-shares.md). Config: "
                    "`SDXL_MATCHED_UNET` in bench/quality/models.py, also in the metadata.",
    "flux-matched": "The Flux layout at hidden 192 (3 heads of 64, RoPE axes 16/24/24, theta "
                    "100), 10 double + 20 single blocks, trained on photographs and rendered "
                    "scenes. Evaluated at a 32x32 latent (= 64x64 pixels): 256 image + 4 text "
                    "tokens at 192 channels, the tokens per channel of Flux.1's 4096 + 512 at "
                    "3072, so attention is the share of each block's work that it is in "
                    "Flux.1 at 1024x1024 (bench/results/2026-12-01-cpu-quality-shares.md). "
                    "Config: `FLUX_MATCHED_PARAMS` in bench/quality/models.py, also in the "
                    "metadata.",
}
LOADING = (
    "**Loading.** Load a fixture with the pack's loader: `bench.quality.models.load(\"sdxl\")` "
    "or `load(\"flux\")` (ComfyUI importable, e.g. through bench.shared.config.setup_comfy "
    "with COMFYUI_PATH set) builds ComfyUI's class from bench/quality/models.py's config and "
    "loads the weights strictly; its `.patcher()` is the ModelPatcher a ToMA node takes, and "
    "its `conditioning(labels, h, w)` the class conditioning. ComfyUI's own loaders (Load "
    "Diffusion Model, `comfy.sd.load_diffusion_model`) cannot detect these layouts (\"Could not "
    "detect model type\"). A model built from the stored `unet_config` through ComfyUI's SDXL "
    "config gets its 64-channel heads, which these weights load into without an error but "
    "which is a different, worse model: use `model_config`. In the metadata, `steps` counts "
    "every training step behind the weights, `run_steps` the last run's.")
SAMPLE_CLASSES = 6
SAMPLE_STEPS = 16
SAMPLE_CFGS = (1.0, 4.0)      # the quality bench's (1) and a usual guidance scale


def run_seconds(run: dict, clock: str) -> float:
    """A run's training time ("cpu" or "wall"); a stopped run's is its last logged point's."""
    return run.get(f"train_{clock}_s", run["curve"][-1][f"{clock}_s"])


def whole_curve(record: dict) -> tuple[list[dict], list[tuple[int, str]]]:
    """The loss curve over all runs (steps counted from the first run's start) and the step
    where each phase that ran ends, with its label."""
    curve, edges, offset = [], [], 0
    for i, run in enumerate(qm.training_runs(record)):
        curve += [{**c, "step": c["step"] + offset} for c in run["curve"]]
        end, stop = offset, offset + run["steps_done"]
        for phase in run["phases"]:
            if end >= stop:
                break          # a stopped run never reached this phase
            end = min(end + phase["steps"], stop)
            edges.append((end, f"run {i + 1}: latent {phase['latent']}, batch {phase['batch']}"))
        offset = stop
    return curve, edges


def loss_curve(record: dict, path: Path) -> None:
    """Training loss (mean of 25 steps) against step over all runs, log scale, phases marked."""
    curve, edges = whole_curve(record)
    w, h, m = 640, 320, 60
    img = Image.new("RGB", (w + 2 * m, h + 2 * m), "white")
    draw = ImageDraw.Draw(img)
    steps = [c["step"] for c in curve]
    logs = [math.log10(c["loss"]) for c in curve]
    lo, hi = min(logs) - 0.05, max(logs) + 0.05

    def at(step: float, value: float) -> tuple[float, float]:
        return m + step / max(steps) * w, m + h - (value - lo) / (hi - lo) * h

    draw.rectangle([m, m, m + w, m + h], outline=(120, 120, 120))
    for i in range(5):
        v = lo + (hi - lo) * i / 4
        draw.text((4, at(0, v)[1] - 6), f"{10 ** v:.3g}", fill=(60, 60, 60))
        s = max(steps) * i / 4
        draw.text((at(s, lo)[0] - 10, m + h + 6), f"{s:.0f}", fill=(60, 60, 60))
    for i, (edge, label) in enumerate(edges):
        x = at(edge, lo)[0]
        draw.line([x, m, x, m + h], fill=(200, 200, 200))
        draw.text((max(m + 2, x - 190), m + 4 + 14 * i), f"until here: {label}",
                  fill=(90, 90, 90))
    draw.line([at(s, v) for s, v in zip(steps, logs, strict=True)], fill=(200, 30, 30), width=2)
    draw.text((m, 10), f"{record['layout']}-layout fixture: training loss (log scale) vs step",
              fill=(0, 0, 0))
    draw.text((m + w // 2 - 20, m + h + 24), "step", fill=(0, 0, 0))
    img.save(path)


def _grid_classes(layout: str, pixels: int) -> tuple[torch.Tensor, list[str], torch.Tensor]:
    """The sample grid's classes: labels, names and a reference image each ([n, 3, p, p]):
    the first SAMPLE_CLASSES photographs (a crop), or every scene class (a held-out render)."""
    if qm.with_scenes(layout):
        from . import scenes

        real, ids = scenes.fixed_set(pixels, 1, seed=7)
        return ids + len(quality_data.train_photos()), list(scenes.CLASSES), real
    names = quality_data.train_photos()[:SAMPLE_CLASSES]
    real, _ = quality_data.load_set(names, labelled=True).fixed_crops(pixels, 1, seed=0)
    return torch.arange(SAMPLE_CLASSES), list(names), real


def sample_grid(fixture: qm.Fixture, path: Path) -> None:
    """Top row: a reference image of each class (a training photograph's crop or a scene
    render); below: the model's sample for that class (ComfyUI sampler, euler, SAMPLE_STEPS
    steps), one row per SAMPLE_CFGS scale (the null class as negative)."""
    layout = fixture.layout
    side = qm.EVAL_LATENT[layout]
    pixels = side * qm.latent_per_pixel(layout)
    labels, names, real = _grid_classes(layout, pixels)
    rows = [quality_data.to_uint8(real)]
    with torch.inference_mode():
        for cfg in SAMPLE_CFGS:
            x = quality.sample(fixture.patcher(), fixture, labels, side,
                               steps=SAMPLE_STEPS, cfg=cfg)
            pixels_out = quality_data.model_space_to_pixels(x, qm.arch(layout))
            rows.append(quality_data.to_uint8(pixels_out))
    scale, pad = max(2, 128 // pixels), 6
    cell = pixels * scale
    img = Image.new("RGB", (len(names) * (cell + pad) + pad, len(rows) * (cell + pad) + 40),
                    "white")
    draw = ImageDraw.Draw(img)
    cfgs = " and ".join(f"{c:g}" for c in SAMPLE_CFGS)
    draw.text((pad, 4), f"{layout} fixture: a class's reference (top), samples of that class "
                        f"below (cfg {cfgs}), {pixels}x{pixels}", fill=(0, 0, 0))
    for i, row in enumerate(rows):
        for j in range(len(names)):
            tile = Image.fromarray(row[j].numpy()).resize((cell, cell), Image.NEAREST)
            img.paste(tile, (pad + j * (cell + pad), 20 + i * (cell + pad)))
    for j, name in enumerate(names):
        draw.text((pad + j * (cell + pad), len(rows) * (cell + pad) + 22), name,
                  fill=(0, 0, 0))
    img.save(path)


def _held_out_table(record: dict) -> list[str]:
    """Untrained, after each run that finished (steps counted from the start), now / untrained."""
    columns, steps = [], 0
    for run in qm.training_runs(record):
        steps += run["steps_done"]
        if "held_out_trained" in run:
            columns.append((f"after {steps} steps", run["held_out_trained"]))
    lines = ["| noise level sigma | untrained | " + " | ".join(c for c, _ in columns)
             + " | now / untrained |", "|---|---|" + "---|" * len(columns) + "---|"]
    untrained = record["held_out_untrained"]
    rows = [(f"{s:.3g}", [u], [v[i] for _, v in columns])
            for i, (s, u) in enumerate(zip(record["held_out_sigmas"], untrained, strict=True))]
    rows.append(("mean", [sum(untrained) / len(untrained)],
                 [sum(v) / len(v) for _, v in columns]))
    for label, (u,), values in rows:
        lines.append(f"| {label} | {u:.4f} | " + " | ".join(f"{v:.4f}" for v in values)
                     + f" | {values[-1] / u:.3f} |")
    return lines


def _runs_text(record: dict) -> list[str]:
    """One line per training run: phases, steps done, times."""
    lines = []
    for i, run in enumerate(qm.training_runs(record)):
        start = "from scratch" if i == 0 else "continued from the previous run's weights"
        planned = sum(p["steps"] for p in run["phases"])
        stopped = "" if run["steps_done"] == planned else f" (stopped at {run['steps_done']})"
        lines.append(
            f"- run {i + 1}, {start}: phases (latent side/batch/steps) " + ", ".join(
                f"{p['latent']}/{p['batch']}/{p['steps']}" for p in run["phases"])
            + f"{stopped}; {run_seconds(run, 'cpu') / 60:.1f} min CPU, "
            f"{run_seconds(run, 'wall') / 60:.1f} min wall")
    return lines


def card(records: dict[str, dict]) -> str:
    """models/README.md."""
    lines = ["# Quality fixtures: small diffusion models trained here", "",
             "Four small diffusion models built from ComfyUI's own model classes (its SDXL UNet "
             "and its Flux transformer, each in two sizes), trained on CPU on natural "
             "photographs (the matched pair on rendered scenes too) so that the quality bench "
             "(`python -m bench --sections quality`, "
             "bench/quality/section.py) measures token merging on models that have learned "
             "something. "
             "They are test fixtures, not image generators.", "",
             LOADING, "",
             "**Limits.** Trained for about half an hour of CPU each (one thread, on a 2-core "
             "machine shared with other jobs). Both denoise held-out photographs far better "
             "than an untrained model (tables below), and their samples from pure noise are no "
             "longer noise: the SDXL layout gives smooth textures in the class's colours with "
             "blob- and stroke-sized shapes (clearer at cfg 4), the Flux layout colour regions "
             "of the class spanning several tokens. But neither shows a scene or an object of "
             "its photograph, and the Flux layout's samples are still blocky at its 4x4-pixel "
             "tokens: samples that show image structure are only partly reached. The Flux "
             "layout's RoPE theta went from 10000 to 32 for its last run (runs 1-3 used 10000; "
             "the weights are the same shapes): with 10000 its samples stayed independent per "
             "token and the training loss flat at about 0.42 for about 1000 steps; with 32 it "
             "fell to about 0.33 in 400 steps at the same crop size (0.28 at the evaluation "
             "size; one comparison, with a fresh warm-up, not a controlled one). More steps "
             "should help (not verified): "
             "`python -m bench.quality.train --layout flux --init "
             "models/toma-flux-fixture.safetensors "
             "--phases 32:8:2000,64:2:600` continues from these weights. Attention is a larger "
             "share of these narrow models' time than of SDXL's or Flux's (see "
             "docs/quality.md).", "",
             "**The matched pair** (`sdxl-matched`, `flux-matched`) fixes the first pair's "
             "proportions: fewer tokens at wider channels, so that each transformer block "
             "splits its work between attention and feed-forward as SDXL's and Flux.1's do at "
             "1024x1024 (within 20% on every share, bench/results/2026-12-01-cpu-quality-"
             "shares.md), and half of every training batch is a rendered scene "
             "(bench/quality/scenes.py: a shape, thin lines, a glyph or a word on a two-tone "
             "background, one class each) whose class a small recogniser "
             "(models/toma-scene-recogniser.safetensors, bench/quality/recognise.py) reads "
             "back from a sample. Trained in one run each of about 60 minutes wall "
             "(figures below). **Limit:** they denoise held-out photographs and scenes far "
             "better than untrained, but their samples do not draw the shapes or glyphs yet "
             "(blobs and strokes in a scene's colours, the sample grids below), so the "
             "recogniser reads their unmerged samples from an empty latent at about chance "
             "and recognition accuracy there cannot tell merging methods apart. Started from "
             "a rendered scene (image-to-image, denoise 0.7 on the SDXL layout and 0.5 on the "
             "Flux layout) their unmerged samples stay readable (92-100%), and there it does "
             "(docs/quality.md).", "",
             "Reproduce: `python -m bench.quality.train --layout "
             "sdxl|flux|sdxl-matched|flux-matched` "
             "(bench/quality/train.py; "
             "COMFYUI_PATH set, `apt-get install mate-backgrounds`), then "
             "`python -m bench.quality.card`.", "",
             "## Data", "",
             "Photographs (none committed), resized to a short side of "
             f"{quality_data.SHORT_SIDE} px, random crops and horizontal flips:", ""]
    for name in quality_data.all_photos():
        held = " (held out: never trained on)" if name in quality_data.HELD_OUT else ""
        lines.append(f"- {name}: {quality_data.LICENCES[name]}{held}")
    lines += ["", "scikit-image's photographs are in its bundled data set (licences in its "
              "docstrings); mate-backgrounds' nature photographs are GPL-2+ per the Debian "
              "package's copyright file. Conditioning: one class per training photograph "
              "(a fixed random 4-token context and pooled vector each, stored in the file as "
              "`fixture.context` / `fixture.pooled`) and a null class (last) for unconditional "
              "and held-out use. Latents: fixed linear pixel maps, no VAE "
              "(bench/quality/data.py).", "",
              "Scenes (matched fixtures only; rendered, seeded, none committed): the classes "
              "disc, square, triangle, ring, cross and bars (1-pixel-scale strokes), the "
              "glyphs A, E, K, R, S and the word OK in DejaVu Sans Bold (Debian's "
              "`fonts-dejavu-core`), each a class after the photographs' (labels 13-24); "
              "held-out loss adds one scene of every class from a stream training never "
              "draws.", ""]
    for layout, record in records.items():
        path = qm.weights_path(layout)
        size = path.stat().st_size / 2**20
        lines += [f"## {layout}-layout: `{path.relative_to(ROOT)}` ({size:.1f} MiB, fp16)", ""]
        lines.append(LAYOUT_TEXT[layout])
        chain = qm.training_runs(record)
        lines += ["", f"- parameters: {record['params'] / 1e6:.2f} M; seed {record['seed']}; "
                      f"AdamW lr {record['lr']}, EMA {record['ema']}",
                  f"- steps done: {sum(r['steps_done'] for r in chain)}; training time "
                  f"{sum(run_seconds(r, 'cpu') for r in chain) / 60:.1f} min CPU, "
                  f"{sum(run_seconds(r, 'wall') for r in chain) / 60:.1f} min wall "
                  "(1 thread, nice 5-10, on a 2-core machine shared with other jobs), "
                  f"torch {record['torch']}, ComfyUI {record['comfyui']}",
                  *_runs_text(record),
                  f"- final training loss (mean of the last 25 steps): "
                  f"{record['curve'][-1]['loss']:.4f}", "",
                  f"Held-out denoising loss (3 held-out photographs x {train_per_photo()} crops"
                  + (", and one held-out scene of every class" if qm.with_scenes(layout) else "")
                  + " "
                  f"at the evaluation size, {qm.EVAL_LATENT[layout]}x{qm.EVAL_LATENT[layout]} "
                  "latent, null class, fixed noise; epsilon MSE for the UNet, velocity MSE for "
                  "the DiT; the untrained model is the same seed's initialisation):", ""]
        lines += _held_out_table(record)
        lines += ["", f"![loss curve](../docs/quality-train-{layout}.png)", "",
                  f"![samples](../docs/quality-samples-{layout}.png)", ""]
    return "\n".join(lines)


def final_held_out(fixture: qm.Fixture, seed: int) -> list[float]:
    """The held-out loss at the evaluation size that bench.quality.train measures at the end of a
    run
    (for a run stopped before its end: from the saved weights)."""
    from . import train

    held = quality_data.load_set(quality_data.HELD_OUT, labelled=False)
    x0, labels = train.held_out_batch(fixture.layout, held, qm.EVAL_LATENT[fixture.layout], seed)
    return train.held_out_loss(fixture, x0, labels, seed)


def train_per_photo() -> int:
    from .train import HELD_OUT_PER_PHOTO

    return HELD_OUT_PER_PHOTO


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.quality.card")
    parser.add_argument("--layouts", default=",".join(qm.ARCHITECTURE))
    parser.add_argument("--text-only", action="store_true",
                        help="rewrite models/README.md only, not the pictures")
    parser.add_argument("--pictures", default=None,
                        help="comma-separated layouts whose pictures are redrawn (default: "
                             "every layout in the card, none with --text-only)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from ..shared.config import setup_comfy

    if not setup_comfy(torch.device("cpu")):
        raise SystemExit("set COMFYUI_PATH to a ComfyUI checkout")
    layouts = args.layouts.split(",")
    stray = set((args.pictures or "").split(",")) - set(layouts) - {""}
    if stray:
        parser.error(f"--pictures: {sorted(stray)} not among --layouts {layouts}")
    records = {}
    for layout in layouts:
        log_path = qm.weights_path(layout).with_suffix(".json")
        record = json.loads(log_path.read_text())
        fixture = qm.load(layout)
        if "held_out_trained" not in record:
            record["held_out_trained"] = final_held_out(fixture, record["seed"])
            log_path.write_text(json.dumps(record, indent=1))
        records[layout] = record
        if not args.text_only and (args.pictures is None or layout in args.pictures.split(",")):
            loss_curve(record, ROOT / "docs" / f"quality-train-{layout}.png")
            sample_grid(fixture, ROOT / "docs" / f"quality-samples-{layout}.png")
    CARD.write_text(card(records) + "\n")
    print(f"wrote {CARD}" + ("" if args.text_only else
                             " and docs/quality-train-*.png, docs/quality-samples-*.png"))


if __name__ == "__main__":
    main()
