"""Train the quality fixtures on CPU: small SDXL- and Flux-layout models on photographs.

    COMFYUI_PATH=../shared/comfyui/v0.3.64 nice -n 10 .cache/venvs/v0.3.64/bin/python \
        -m bench.quality.train --layout sdxl --threads 1 > .cache/train-sdxl.log 2>&1 &

Reproducible: every random draw (weights, class tables, crops, labels, noise levels, noise)
comes from generators seeded by --seed; data list and licences in bench/quality/data.py.
Training is the plain diffusion objective through ComfyUI's own BaseModel.apply_model
(bench.quality.models.denoising_loss): epsilon MSE for the EPS UNet, velocity MSE for the flow
DiT, noise levels drawn uniformly from the model's own sigma table, 10% of labels dropped to the
null class (for CFG), AdamW, linear warm-up then cosine decay, gradient clipping at 1, EMA of
the weights (what is saved). Phases go from small crops (cheap steps, many of them) to the
evaluation size (so attention sees 4096 / 1024 tokens before it is measured there).
It runs on ComfyUI v0.3.64 and v0.33.0; on v0.8.0 only the SDXL layouts train (its Flux RoPE
is comfy-kitchen's op, which has no backward, with no training switch around it).

Writes the EMA weights to models/toma-<layout>-fixture.safetensors (every --save-every steps
and at the end) and the run's log (loss curve, held-out losses, timings) to
models/toma-<layout>-fixture.json; `python -m bench.quality.card` turns both into the model card.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from . import data, scenes
from . import models as qm

log = logging.getLogger("bench.quality.train")

# Phases: (latent side, batch, steps). Pixel crop = latent side * latent_per_pixel().
DEFAULT_PHASES = {
    "sdxl": "32:8:300,64:4:80,128:1:30",
    "flux": "16:16:500,32:8:200,64:2:60",
    "sdxl-matched": "24:16:600,48:8:600",
    "flux-matched": "16:16:600,32:8:600",
}
HELD_OUT_QUANTILES = (0.1, 0.3, 0.5, 0.7, 0.9)   # positions in the model's sigma table
HELD_OUT_PER_PHOTO = 4
HELD_OUT_SCENES = 1          # per scene class, from a stream training never draws from
HELD_OUT_STREAM = 1000       # added to the seed: the held-out scenes' stream
P_UNCOND = 0.1


@dataclass(frozen=True)
class Phase:
    latent: int
    batch: int
    steps: int


def parse_phases(text: str) -> list[Phase]:
    """"32:16:1500,64:8:250" -> phases (latent side, batch, steps)."""
    phases = []
    for part in text.split(","):
        try:
            latent, batch, steps = (int(v) for v in part.split(":"))
        except ValueError:
            raise ValueError(f"phase {part!r}: write latent:batch:steps, e.g. 32:16:1500") from None
        if min(latent, batch, steps) < 1 or latent % 8:
            raise ValueError(f"phase {part!r}: positive numbers, latent side a multiple of 8")
        phases.append(Phase(latent, batch, steps))
    return phases


def held_out_sigmas(fixture: qm.Fixture) -> torch.Tensor:
    """Noise levels of the held-out loss: fixed quantiles of the model's sigma table."""
    table = fixture.model.model_sampling.sigmas.float()
    return torch.stack([table[int(q * (len(table) - 1))] for q in HELD_OUT_QUANTILES])


def held_out_batch(layout: str, photos: data.PhotoSet, latent: int,
                   seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed held-out crops (and, for layouts with scenes, held-out scenes) in model space
    [n, C, latent, latent] and their labels (-1: the loss is unconditional)."""
    side = latent * qm.latent_per_pixel(layout)
    pixels, labels = photos.fixed_crops(side, HELD_OUT_PER_PHOTO, seed)
    if qm.with_scenes(layout):
        more, _ = scenes.fixed_set(side, HELD_OUT_SCENES, seed + HELD_OUT_STREAM)
        pixels, labels = torch.cat([pixels, more]), torch.cat([labels, torch.full((len(more),),
                                                                                  -1)])
    return data.pixels_to_model_space(pixels, qm.arch(layout)), labels


def class_names(layout: str) -> list[str]:
    """The class of each label: the training photographs, then (with scenes) "scene:<class>"."""
    names = list(data.train_photos())
    if qm.with_scenes(layout):
        names += [f"scene:{c}" for c in scenes.CLASSES]
    return names


def training_batch(layout: str, photos: data.PhotoSet, count: int, side: int,
                   g: torch.Generator, seed: int,
                   scene_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` training images (pixels [count, 3, side, side], labels [count]): photograph
    crops, and for layouts with scenes half of them scenes `scene_index`, ... of stream `seed`
    (the run's seed; the held-out scenes come from another stream)."""
    n_scenes = count // 2 if qm.with_scenes(layout) else 0
    pixels, labels = photos.crops(count - n_scenes, side, g)
    if n_scenes:
        ids = torch.randint(len(scenes.CLASSES), (n_scenes,), generator=g)
        more = scenes.batch(ids.tolist(), side, seed, scene_index)
        pixels = torch.cat([pixels, more])
        labels = torch.cat([labels, ids + len(data.train_photos())])
    return pixels, labels


@torch.no_grad()
def held_out_loss(fixture: qm.Fixture, x0: torch.Tensor, labels: torch.Tensor,
                  seed: int) -> list[float]:
    """Mean denoising loss on x0 at each held-out sigma, with fixed noise (one item a call)."""
    g = torch.Generator().manual_seed(seed + 777)
    noise = torch.randn(x0.shape, generator=g)
    out = []
    for sigma in held_out_sigmas(fixture):
        losses = [qm.denoising_loss(fixture, x0[i:i + 1], labels[i:i + 1], sigma.view(1),
                                    noise[i:i + 1]) for i in range(len(x0))]
        out.append(float(torch.cat(losses).mean()))
    return out


def _saved_copies(layout: str):
    """Flux: autograd keeps copies of what it saves. ComfyUI's Flux blocks add their updates in
    place (`txt += ...`, `x += ...`) into tensors a LayerNorm saved for backward, which plain
    autograd refuses; the copies cost memory, not correctness. UNet: nothing to do."""
    if qm.arch(layout) != "flux":
        return contextlib.nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t)


@contextlib.contextmanager
def _comfy_training() -> Iterator[None]:
    """ComfyUI's training flag for a forward, as its own LoRA trainer sets it: ComfyUI 0.33's
    Flux RoPE is comfy-kitchen's op, which has no backward, unless the flag is on. Older
    versions have no such flag and need none."""
    import comfy.model_management as mm

    had = hasattr(mm, "in_training")
    before = getattr(mm, "in_training", False)
    mm.in_training = True
    try:
        yield
    finally:
        if had:
            mm.in_training = before
        else:
            del mm.in_training


def trainable(fixture: qm.Fixture) -> torch.nn.Module:
    """The fixture's diffusion model, every parameter requiring grad: ComfyUI 0.33 makes its
    layers' parameters without (it only infers), and training through them raised at the
    first backward."""
    net = fixture.model.diffusion_model
    net.requires_grad_(True)
    return net


def batch_loss(fixture: qm.Fixture, x0: torch.Tensor, labels: torch.Tensor,
               sigma: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """One training batch's mean loss, ready for backward (x0, noise [B, C, H, W] in model
    space; sigma [B])."""
    with _saved_copies(fixture.layout), _comfy_training():
        return qm.denoising_loss(fixture, x0, labels, sigma, noise).mean()


class EMA:
    """Exponential moving average of a module's floating-point state."""

    def __init__(self, module: torch.nn.Module, decay: float) -> None:
        self.decay = decay
        self.shadow = {k: v.detach().clone() for k, v in module.state_dict().items()}

    @torch.no_grad()
    def update(self, module: torch.nn.Module, step: int) -> None:
        d = min(self.decay, (1 + step) / (10 + step))
        for k, v in module.state_dict().items():
            if v.dtype.is_floating_point:
                self.shadow[k].lerp_(v, 1 - d)

    def swap(self, module: torch.nn.Module) -> None:
        """Exchange the module's weights and the averaged ones (call twice to undo)."""
        current = {k: v.detach().clone() for k, v in module.state_dict().items()}
        module.load_state_dict(self.shadow)
        self.shadow = current


def lr_at(step: int, total: int, peak: float, warmup: int = 100) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train(layout: str, phases: list[Phase], seed: int, lr: float, ema_decay: float,
          out: Path, save_every: int, eval_every: int, init: Path | None = None) -> dict:
    """Train (or, with `init`, continue training from those weights) and save; the run's
    record (see the module docstring)."""
    torch.manual_seed(seed)
    train_set = data.load_set(data.train_photos(), labelled=True)
    held = data.load_set(data.HELD_OUT, labelled=False)
    fixture = qm.build(layout, len(class_names(layout)), seed)
    untrained = None
    if init is not None:
        # The untrained baseline is the same seed's initialisation, measured before loading.
        x_eval, l_eval = held_out_batch(layout, held, qm.EVAL_LATENT[layout], seed)
        untrained = held_out_loss(fixture, x_eval, l_eval, seed)
        start = qm.load(layout, init)
        fixture.model.diffusion_model.load_state_dict(start.model.diffusion_model.state_dict())
        fixture.tables = start.tables
    net = trainable(fixture)
    eval_latent = qm.EVAL_LATENT[layout]
    small_latent = phases[0].latent * 2 if phases[0].latent * 2 < eval_latent else eval_latent
    x_small, l_small = held_out_batch(layout, held, small_latent, seed)
    x_eval, l_eval = held_out_batch(layout, held, eval_latent, seed)
    record: dict = {
        "layout": layout, "seed": seed, "lr": lr, "ema": ema_decay,
        "phases": [vars(p) for p in phases], "train_photos": list(data.train_photos()),
        "classes": class_names(layout),
        "held_out_photos": list(data.HELD_OUT), "licences": data.LICENCES,
        "held_out_sigmas": [float(s) for s in held_out_sigmas(fixture)],
        "params": sum(p.numel() for p in net.parameters()), "curve": [], "held_out_small": [],
        "comfyui": os.environ.get("COMFYUI_PATH"), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "init": None if init is None else str(init),
    }
    if init is not None and init.with_suffix(".json").is_file():
        # The run these weights came from (its own "prior" chains further back), for the card.
        record["prior"] = json.loads(init.with_suffix(".json").read_text())
    record["held_out_untrained"] = untrained or held_out_loss(fixture, x_eval, l_eval, seed)
    log.warning("untrained held-out loss at %d: %s", eval_latent, record["held_out_untrained"])
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.01)
    ema = EMA(net, ema_decay)
    g = torch.Generator().manual_seed(seed + 1)
    n_sigmas = len(fixture.model.model_sampling.sigmas)
    total = sum(p.steps for p in phases)
    step, running, start_cpu, start_wall = 0, [], time.process_time(), time.perf_counter()
    for phase in phases:
        crop = phase.latent * qm.latent_per_pixel(layout)
        for _ in range(phase.steps):
            pixels, labels = training_batch(layout, train_set, phase.batch, crop, g, seed,
                                            step * phase.batch)
            labels = torch.where(torch.rand(phase.batch, generator=g) < P_UNCOND,
                                 torch.full_like(labels, -1), labels)
            x0 = data.pixels_to_model_space(pixels, qm.arch(layout))
            idx = torch.randint(n_sigmas, (phase.batch,), generator=g)
            sigma = fixture.model.model_sampling.sigmas[idx].float()
            noise = torch.randn(x0.shape, generator=g)
            for group in opt.param_groups:
                group["lr"] = lr_at(step, total, lr)
            loss = batch_loss(fixture, x0, labels, sigma, noise)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            ema.update(net, step)
            running.append(float(loss))
            step += 1
            if step % 25 == 0 or step == total:
                record["curve"].append({"step": step, "latent": phase.latent,
                                        "loss": sum(running) / len(running),
                                        "cpu_s": time.process_time() - start_cpu,
                                        "wall_s": time.perf_counter() - start_wall})
                log.warning("step %d/%d latent %d loss %.4f cpu %.0f s", step, total,
                            phase.latent, record["curve"][-1]["loss"],
                            record["curve"][-1]["cpu_s"])
                running = []
            if step % eval_every == 0 or step == total:
                ema.swap(net)
                losses = held_out_loss(fixture, x_small, l_small, seed)
                ema.swap(net)
                record["held_out_small"].append({"step": step, "latent": small_latent,
                                                 "loss": losses})
                log.warning("held-out (EMA, latent %d) at step %d: %s", small_latent, step,
                            [round(v, 4) for v in losses])
            if step % save_every == 0 or step == total:
                _save(fixture, ema, record, out, step)
    ema.swap(net)
    record["held_out_trained"] = held_out_loss(fixture, x_eval, l_eval, seed)
    record["train_cpu_s"] = time.process_time() - start_cpu
    record["train_wall_s"] = time.perf_counter() - start_wall
    ema.swap(net)
    _save(fixture, ema, record, out, step)
    log.warning("trained held-out loss at %d: %s", eval_latent, record["held_out_trained"])
    return record


def _save(fixture: qm.Fixture, ema: EMA, record: dict, out: Path, step: int) -> None:
    """Write the EMA weights and the log so far (a killed run leaves a usable checkpoint)."""
    net = fixture.model.diffusion_model
    ema.swap(net)
    record["steps_done"] = step
    # "steps": every step behind these weights (a continued run's earlier ones included).
    qm.save(fixture, out, {"steps": qm.total_steps(record, step), "run_steps": step,
                           "seed": record["seed"],
                           "classes": record["classes"],
                           "unet_config" if qm.arch(fixture.layout) == "sdxl" else "flux_params":
                           qm.ARCHITECTURE[fixture.layout][1]})
    ema.swap(net)
    out.with_suffix(".json").write_text(json.dumps(record, indent=1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.quality.train", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", choices=tuple(qm.ARCHITECTURE), required=True)
    parser.add_argument("--phases", default=None,
                        help="latent:batch:steps,... (default per layout: "
                             + "; ".join(f"{k} {v}" for k, v in DEFAULT_PHASES.items()) + ")")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--ema", type=float, default=0.995)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--init", type=Path, default=None,
                        help="continue from these weights (a fixture .safetensors) instead of "
                             "a fresh initialisation")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s",
                        datefmt="%H:%M:%S")
    torch.set_num_threads(args.threads)
    missing = data.missing_sources() + scenes.missing_sources()
    if missing:
        raise SystemExit("training data missing: " + "; ".join(missing))
    from ..shared.config import setup_comfy

    if not setup_comfy(torch.device("cpu")):
        raise SystemExit("set COMFYUI_PATH to a ComfyUI checkout (the models are its classes)")
    phases = parse_phases(args.phases or DEFAULT_PHASES[args.layout])
    record = train(args.layout, phases, args.seed, args.lr, args.ema,
                   args.out or qm.weights_path(args.layout), args.save_every, args.eval_every,
                   args.init)
    print(json.dumps({k: record[k] for k in ("held_out_untrained", "held_out_trained",
                                             "train_cpu_s", "train_wall_s")}, indent=1))


if __name__ == "__main__":
    main()
