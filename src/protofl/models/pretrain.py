"""A pretrained encoder without downloads: MobileNetV2 trained centrally on the Shapes
pretraining set, written as a torchvision-style state_dict that ``model.pretrained`` reads.

The seed starts DeepLab-V3+ from an ImageNet-classification MobileNetV2. Here the encoder
(BatchNorm in training mode, so its running statistics are real) is trained to classify the
object class of each image of :func:`protofl.data.shapes.pretraining_set` (images no
``shapes`` split holds), with global average pooling and a linear layer on its last
features (``objective="classify"``, the ImageNet analogue), or, with
``objective="segment"``, inside a whole DeepLab-V3+ on the masks. Only the encoder is
written (``features.N...``, torchvision's names), with a ``.json`` beside it recording how it
was trained; :func:`shapes_encoder` reuses a file whose record matches.

    python -m protofl.models.pretrain --out runs/shapes_mnv2.pth --width 0.35

Then ``--set model.pretrained=runs/shapes_mnv2.pth --set model.width=0.35`` with
``model.norm=frozen`` (vectorised trainer) or ``batch`` (sequential trainer).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from protofl.errors import ProtoflError
from protofl.models.deeplab import DeepLabV3Plus, MobileNetV2Encoder

OBJECTIVES = ("classify", "segment")


@dataclass(frozen=True)
class PretrainSpec:
    """How the encoder is trained (written beside it; a file is reused only if it matches)."""

    width: float = 0.35
    size: int = 48
    images: int = 2400
    steps: int = 800
    batch: int = 32
    lr: float = 3e-3
    seed: int = 0
    objective: str = "classify"
    augment: bool = True


class Classifier(nn.Module):
    """The encoder's last features, globally pooled, then a linear layer."""

    def __init__(self, width: float, classes: int):
        super().__init__()
        self.encoder = MobileNetV2Encoder(3, width, 16, "batch")
        self.fc = nn.Linear(self.encoder.high_channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.encoder(x)[1].mean(dim=(2, 3)))


def model_inputs(x: torch.Tensor) -> torch.Tensor:
    """uint8 images as the shapes federation feeds them (ImageNet's statistics)."""
    from protofl.data.images import IMAGENET_MEAN, IMAGENET_STD

    mean = torch.tensor(IMAGENET_MEAN)[:, None, None]
    std = torch.tensor(IMAGENET_STD)[:, None, None]
    return (x.float() / 255 - mean) / std


def _model(spec: PretrainSpec) -> nn.Module:
    from protofl.data.shapes import SHAPE_CLASSES

    if spec.objective == "classify":
        return Classifier(spec.width, len(SHAPE_CLASSES))
    return DeepLabV3Plus((3, spec.size, spec.size), len(SHAPE_CLASSES) + 1, width=spec.width,
                         channels=64, norm="batch")


def pretrain(spec: PretrainSpec, log=print) -> tuple[dict[str, torch.Tensor], dict]:
    """Train per ``spec``; returns the encoder's state_dict and a record (spec, seconds,
    final training loss and accuracy on the last 200 steps' batches)."""
    from protofl.data.seg_augment import random_crop_flip
    from protofl.data.shapes import pretraining_set

    if spec.objective not in OBJECTIVES:
        raise ProtoflError(f"pretrain objective {spec.objective!r}; allowed: "
                           f"{', '.join(OBJECTIVES)}")
    torch.manual_seed(spec.seed)
    gen = torch.Generator().manual_seed(spec.seed)
    x, m, lab = (torch.from_numpy(a) for a in pretraining_set(spec.images, spec.size))
    model = _model(spec).train()
    opt = torch.optim.Adam(model.parameters(), lr=spec.lr)
    start, hits, seen, loss = time.perf_counter(), 0, 0, torch.tensor(0.0)
    for step in range(1, spec.steps + 1):
        idx = torch.randint(len(x), (spec.batch,), generator=gen)
        xb, mb, yb = model_inputs(x[idx]), m[idx], lab[idx] - 1
        if spec.augment:
            xb, mb = random_crop_flip(xb, mb, gen)
        out = model(xb)
        if spec.objective == "classify":
            loss = F.cross_entropy(out, yb)
        else:
            out = out[1]
            loss = F.cross_entropy(out, mb.long(), ignore_index=255)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step > spec.steps - 200 and spec.objective == "classify":
            hits += int((out.argmax(1) == yb).sum())
            seen += len(yb)
        if step % 250 == 0 or step == spec.steps:
            log(f"pretrain step {step}/{spec.steps}  loss {loss.item():.3f}  "
                f"{time.perf_counter() - start:.0f} s")
    record = {"spec": asdict(spec), "seconds": round(time.perf_counter() - start, 1),
              "final_loss": round(loss.item(), 4),
              "train_accuracy": round(hits / seen, 4) if seen else None}
    state = {k: v.detach().clone() for k, v in model.encoder.state_dict().items()}
    return state, record


def shapes_encoder(path: str | Path, spec: PretrainSpec = PretrainSpec(), log=print) -> Path:
    """``path`` holding the encoder pretrained per ``spec``: reused when the record beside it
    (``path`` + ``.json``) names the same spec, else trained and written (the state_dict,
    then the record)."""
    path = Path(path)
    meta = path.with_name(path.name + ".json")
    if path.is_file() and meta.is_file():
        try:
            if json.loads(meta.read_text()).get("spec") == asdict(spec):
                return path
        except ValueError:
            pass
    state, record = pretrain(spec, log)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    torch.save(state, tmp)
    tmp.replace(path)
    meta.write_text(json.dumps(record, indent=1) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    d = PretrainSpec()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="the .pth to write (a .json goes beside it)")
    p.add_argument("--width", type=float, default=d.width)
    p.add_argument("--size", type=int, default=d.size)
    p.add_argument("--images", type=int, default=d.images)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--objective", choices=OBJECTIVES, default=d.objective)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    spec = PretrainSpec(a.width, a.size, a.images, a.steps, a.batch, a.lr, a.seed, a.objective)
    try:
        out = shapes_encoder(a.out, spec)
    except ProtoflError as e:
        print(f"error: {e}")
        return 2
    print(f"wrote {out}; use: --set model.pretrained={out} --set model.width={a.width} "
          "--set model.norm=frozen")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
