"""A small recogniser of the rendered scenes' classes: the task metric of the quality fixtures.

    python -m bench.quality.recognise [--steps 1500] [--threads 2]

A CLIP score asks whether an image shows what the prompt says; here the "prompt" is a scene
class (bench/quality/scenes.py) and the question is answered by a convolutional classifier
trained on renders of that class. Recognition accuracy of a method's samples, next to the
unmerged model's, says whether merging broke what makes a shape or a glyph readable (edges,
thin strokes), which PSNR against the unmerged samples cannot tell from harmless changes.

Trained on fresh renders (stream seed TRAIN_STREAM) at the fixtures' pixel sizes, with the
blur, noise and colour shifts a sample may carry; accuracy on held-out renders (stream
TEST_STREAM) is stored with the weights (models/toma-scene-recogniser.safetensors). Every image
is resized to SIDE x SIDE first, so one recogniser reads every fixture's samples.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from . import scenes
from .models import MODELS_DIR

log = logging.getLogger(__name__)

WEIGHTS = MODELS_DIR / "toma-scene-recogniser.safetensors"
SIDE = 48
TRAIN_SIDES = (48, 56, 64)          # rendered at these sizes, like the fixtures' samples
TRAIN_STREAM, TEST_STREAM = 5000, 6000
POOL = 6000                         # renders drawn once, then augmented every step


class Recogniser(nn.Module):
    """images [B, 3, SIDE, SIDE] in [-1, 1] -> class logits [B, len(scenes.CLASSES)]."""

    def __init__(self) -> None:
        super().__init__()
        widths = (32, 32, 64, 64, 128)
        layers: list[nn.Module] = []
        cin = 3
        for i, w in enumerate(widths):
            layers += [nn.Conv2d(cin, w, 3, stride=1 if i % 2 == 0 else 2, padding=1),
                       nn.GroupNorm(8, w), nn.SiLU()]
            cin = w
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(cin, len(scenes.CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


def prepare(images: torch.Tensor) -> torch.Tensor:
    """[B, 3, H, W] in [-1, 1] or uint8 [B, H, W, 3] -> float [B, 3, SIDE, SIDE] in [-1, 1]."""
    if images.dtype == torch.uint8:
        images = images.permute(0, 3, 1, 2).float() / 127.5 - 1
    if images.shape[-1] != SIDE or images.shape[-2] != SIDE:
        images = F.interpolate(images, size=(SIDE, SIDE), mode="bilinear", antialias=True,
                               align_corners=False)
    return images


def augment(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """What a sample may carry: blur (up to 1 pixel), noise (up to 0.15), colour shifts."""
    b = x.shape[0]
    sigma = torch.rand(b, generator=g) * 1.0
    taps = torch.arange(-2, 3).float() ** 2
    kernel = torch.exp(-taps / (2 * sigma.clamp_min(1e-3)[:, None] ** 2))
    kernel = kernel / kernel.sum(1, keepdim=True)                      # [B, 5]
    k2 = (kernel[:, :, None] * kernel[:, None, :])[:, None]            # [B, 1, 5, 5]
    blurred = F.conv2d(F.pad(x.reshape(1, b * 3, SIDE, SIDE), (2, 2, 2, 2), mode="replicate"),
                       k2.repeat_interleave(3, 0), groups=b * 3).reshape(b, 3, SIDE, SIDE)
    shift = (torch.rand(b, 3, 1, 1, generator=g) - 0.5) * 0.2
    noise = torch.randn(x.shape, generator=g) * torch.rand(b, 1, 1, 1, generator=g) * 0.15
    return (blurred + shift + noise).clamp(-1, 1)


def render_set(count: int, stream: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` renders (classes in turn, sizes TRAIN_SIDES in turn), prepared: (x, labels)."""
    n = len(scenes.CLASSES)
    xs = [prepare(scenes.render(i % n, TRAIN_SIDES[(i // n) % len(TRAIN_SIDES)], stream,
                                i)[None]) for i in range(count)]
    return torch.cat(xs), torch.arange(count) % n


def train(steps: int, batch: int = 64, lr: float = 2e-3,
          seed: int = 0) -> tuple[Recogniser, dict]:
    """A trained recogniser and its record (held-out accuracy, timings)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    x_pool, y_pool = render_set(POOL, TRAIN_STREAM)
    x_test, y_test = render_set(len(scenes.CLASSES) * 50, TEST_STREAM)
    model = Recogniser()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=steps)
    for step in range(steps):
        idx = torch.randint(POOL, (batch,), generator=g)
        # no flips: glyphs have a handedness
        loss = F.cross_entropy(model(augment(x_pool[idx], g)), y_pool[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if (step + 1) % 100 == 0:
            log.warning("recogniser step %d/%d loss %.4f", step + 1, steps, float(loss))
    model.eval()
    record = {"steps": steps, "batch": batch, "lr": lr, "seed": seed, "pool": POOL,
              "train_sides": list(TRAIN_SIDES), "classes": list(scenes.CLASSES),
              "held_out_accuracy": accuracy(model, x_test, y_test),
              "held_out_accuracy_augmented": accuracy(model, augment(x_test, g), y_test),
              "train_wall_s": time.perf_counter() - start}
    return model, record


@torch.no_grad()
def predict(model: Recogniser, images: torch.Tensor) -> torch.Tensor:
    """Class ids [B] of images (see prepare for the accepted forms)."""
    return model(prepare(images)).argmax(-1)


def accuracy(model: Recogniser, images: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of images whose predicted class is their label."""
    return float((predict(model, images) == labels).float().mean())


def save(model: Recogniser, record: dict, path: Path = WEIGHTS) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path),
              metadata={k: json.dumps(v) for k, v in record.items()})


def load(path: Path = WEIGHTS) -> Recogniser:
    """The committed recogniser."""
    from safetensors.torch import load_file

    if not path.is_file():
        raise FileNotFoundError(f"{path} missing: train it with python -m bench.quality.recognise")
    model = Recogniser()
    model.load_state_dict(load_file(str(path)))
    return model.eval()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.quality.recognise",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=WEIGHTS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s",
                        datefmt="%H:%M:%S")
    torch.set_num_threads(args.threads)
    missing = scenes.missing_sources()
    if missing:
        raise SystemExit("scenes cannot be rendered: " + "; ".join(missing))
    model, record = train(args.steps)
    save(model, record, args.out)
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
