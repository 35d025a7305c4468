"""Does DeepLab-V3+ learn the embedded Shapes set? Training for a fixed step budget.

Trains ``DeepLabV3Plus`` on the whole Shapes training pool (one client holding everything),
Adam, per-pixel cross-entropy with void (255) ignored, joint random resized crop + flip,
then reports the global test set's mIoU and pixel accuracy against the all-background
baseline (every pixel predicted background), at a few checkpoints. ``--fedavg`` instead
runs a bare FedAvg (a sizing estimate for the segmentation suite, not protofl's engine):
``--per-round`` clients drawn in proportion to their size, ``--local-steps`` Adam steps
each, weights averaged in proportion to client size. Never run as a test.

    python benchmarks/shapes_central.py --steps 600 --width 0.5 --channels 64
    python benchmarks/shapes_central.py --macro --size 32
    python benchmarks/shapes_central.py --figure qual.png   # + the qualitative figure
    python benchmarks/shapes_central.py --fedavg --alpha 0.01 --rounds 30
    python benchmarks/shapes_central.py --probe enc.pth --width 0.35   # linear probe
    python benchmarks/shapes_central.py --pretrained enc.pth --norm frozen --width 0.35

``--probe`` fits a linear classifier on the pixel features (stride 4) of a pretrained
encoder, loaded each way ``model.pretrained`` can (frozen BatchNorm, GroupNorm from the
statistics, the old GroupNorm load with the statistics dropped) and from scratch.
"""

from __future__ import annotations

import argparse
import copy
import time

import numpy as np
import torch
import torch.nn.functional as F

from protofl.config import DataConfig
from protofl.data.seg_augment import CropFlip, random_crop_flip
from protofl.data.shapes import shapes_federation, shapes_macro_federation
from protofl.metrics.segmentation import ConfusionMeter
from protofl.models.deeplab import DeepLabV3Plus
from protofl.models.pretrain import model_inputs

# uint8 images -> standardised float, as the shapes federation feeds them (ImageNet's
# statistics, which the pretrained encoders expect)
to_input = model_inputs


def evaluate(model, x: torch.Tensor, y: torch.Tensor, num_classes: int, batch: int = 100
             ) -> dict:
    meter = ConfusionMeter(num_classes)
    with torch.no_grad():
        for i in range(0, len(x), batch):
            meter.update(y[i:i + batch], model(to_input(x[i:i + batch]))[1])
    return meter.report()


def all_background(y: torch.Tensor, num_classes: int) -> dict:
    meter = ConfusionMeter(num_classes)
    meter.update(y, torch.zeros_like(y))
    return meter.report()


def train_step(model, opt, x: torch.Tensor, y: torch.Tensor, batch: int,
               gen: torch.Generator, augment: bool) -> torch.Tensor:
    """One Adam step on ``batch`` rows drawn with replacement (jointly cropped and flipped with
    ``augment``); returns the loss."""
    idx = torch.randint(len(x), (batch,), generator=gen)
    xb, yb = to_input(x[idx]), y[idx]
    if augment:
        xb, yb = random_crop_flip(xb, yb, gen, CropFlip())
    loss = F.cross_entropy(model(xb)[1], yb.long(), ignore_index=255)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


def train_central(data, steps: int, batch: int, lr: float, seed: int, width: float,
                  channels: int, output_stride: int, augment: bool, every: int,
                  log=print, snapshots: dict | None = None, norm: str = "group",
                  pretrained: str | None = None) -> list[tuple[int, float, dict]]:
    """Train on every training image (the encoder from ``pretrained`` if given); returns
    (step, seconds, test report) checkpoints. With ``snapshots``, a copy of the model is
    stored there at every checkpoint."""
    from protofl.config import ModelConfig
    from protofl.models.deeplab import deeplabv3plus

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = deeplabv3plus(data.input_shape, data.num_classes,
                          ModelConfig(norm=norm, pretrained=pretrained), width=width,
                          output_stride=output_stride, channels=channels)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    x, y = data.x_train, data.y_train
    out, start = [], time.perf_counter()
    for step in range(1, steps + 1):
        loss = train_step(model, opt, x, y, batch, gen, augment)
        if step % every == 0 or step == steps:
            model.eval()
            r = evaluate(model, data.x_test, data.y_test, data.num_classes)
            model.train()
            t = time.perf_counter() - start
            out.append((step, t, r))
            if snapshots is not None:
                snapshots[f"central, step {step}"] = copy.deepcopy(model).eval()
            log(f"step {step:5d}  {t:6.1f}s  loss {loss.item():.3f}  mIoU {r['miou']:.3f}  "
                f"pixel acc {r['pixel_accuracy']:.3f}")
    return out


def train_fedavg(data, rounds: int, per_round: int, local_steps: int, batch: int, lr: float,
                 seed: int, width: float, channels: int, output_stride: int, augment: bool,
                 log=print) -> tuple[float, dict]:
    """Bare FedAvg on ``data``'s clients; returns (seconds, final test report)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = DeepLabV3Plus(data.input_shape, data.num_classes, width=width,
                          output_stride=output_stride, channels=channels)
    sizes = data.train_sizes.astype(float)
    start = time.perf_counter()
    for _ in range(rounds):
        active = rng.choice(data.num_clients, per_round, replace=False, p=sizes / sizes.sum())
        states, weights = [], []
        for k in active:
            local = copy.deepcopy(model)
            opt = torch.optim.Adam(local.parameters(), lr=lr)
            x, y = data.client_train(int(k))
            for _ in range(local_steps):
                train_step(local, opt, x, y, min(batch, len(x)), gen, augment)
            states.append(local.state_dict())
            weights.append(float(len(x)))
        w = torch.tensor(weights) / sum(weights)
        model.load_state_dict({n: sum(wk * s[n] for wk, s in zip(w, states))
                               for n in states[0]})
    model.eval()
    rep = evaluate(model, data.x_test, data.y_test, data.num_classes)
    t = time.perf_counter() - start
    log(f"fedavg {rounds} rounds x {per_round} clients x {local_steps} steps: {t:.1f}s  "
        f"mIoU {rep['miou']:.3f}  pixel acc {rep['pixel_accuracy']:.3f}")
    return t, rep


# ---------------------------------------------------------------- linear probe
def pixel_features(encoder, x: torch.Tensor, batch: int = 100) -> torch.Tensor:
    """Per-pixel features at stride 4: the low-level map joined with the high-level map
    upsampled to it; ``(N * h * w, d)``."""
    out = []
    with torch.no_grad():
        for i in range(0, len(x), batch):
            low, high = encoder(model_inputs(x[i:i + batch]))
            high = F.interpolate(high, size=low.shape[-2:], mode="bilinear", align_corners=False)
            out.append(torch.cat([low, high], 1).permute(0, 2, 3, 1).flatten(0, 2))
    return torch.cat(out)


def pixel_labels(y: torch.Tensor, stride: int = 4) -> torch.Tensor:
    """The mask at the centre of each ``stride`` x ``stride`` cell, flattened."""
    return y[:, stride // 2::stride, stride // 2::stride].flatten().long()


def linear_probe(f_train, y_train, f_test, y_test, classes: int, steps: int = 300,
                 seed: int = 0) -> dict:
    """A softmax-linear classifier (full-batch L-BFGS on standardised features, void
    ignored) fitted on the training pixels; the test pixels' accuracy and mIoU."""
    keep, keep_test = y_train != 255, y_test != 255
    mean, std = f_train[keep].mean(0), f_train[keep].std(0).clamp_min(1e-6)
    a, b = (f_train[keep] - mean) / std, y_train[keep]
    torch.manual_seed(seed)
    lin = torch.nn.Linear(a.shape[1], classes)
    opt = torch.optim.LBFGS(lin.parameters(), lr=1, max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(lin(a), b) + 1e-4 * lin.weight.square().sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        pred = lin((f_test[keep_test] - mean) / std).argmax(1)
    meter = ConfusionMeter(classes)
    meter.update(y_test[keep_test][None], pred[None])
    r = meter.report()
    return {"pixel_accuracy": r["pixel_accuracy"], "miou": r["miou"]}


def old_group_norm_load(model, path: str) -> None:
    """What ``model.pretrained`` did before: BatchNorm's affine copied into GroupNorm, the
    running statistics dropped."""
    from protofl.models.pretrained import read_state_dict

    sd = read_state_dict(path)
    with torch.no_grad():
        for name, m in model.encoder.named_modules():
            if isinstance(m, torch.nn.GroupNorm) and f"{name}.weight" in sd:
                m.weight.copy_(sd[f"{name}.weight"])
                m.bias.copy_(sd[f"{name}.bias"])


def probe(path: str, width: float, images: int, log=print) -> dict:
    """The linear probe of the encoder's pixel features on ``shapes`` (``images`` training
    images to fit, the 300 test images to score), per way of loading ``path``."""
    from protofl.config import ModelConfig
    from protofl.models.deeplab import deeplabv3plus

    data = shapes_federation(DataConfig(name="shapes", num_clients=1))
    x, y = data.x_train[:images], data.y_train[:images]
    yt, yte = pixel_labels(y), pixel_labels(data.y_test)
    torch.manual_seed(0)
    variants = {
        "BatchNorm statistics kept (norm=frozen)": ModelConfig(norm="frozen", pretrained=path),
        "GroupNorm from the statistics (norm=group)": ModelConfig(norm="group",
                                                                   pretrained=path),
        "GroupNorm, statistics dropped (old loader)": ModelConfig(norm="group",
                                                                   pretrained=path),
        "random initialisation (GroupNorm)": ModelConfig(norm="group")}
    out, ref = {}, None
    for name, cfg in variants.items():
        torch.manual_seed(0)
        m = deeplabv3plus(data.input_shape, data.num_classes, cfg, width=width, channels=16)
        if "old loader" in name:
            old_group_norm_load(m, path)
        m.eval()
        f, ft = pixel_features(m.encoder, x), pixel_features(m.encoder, data.x_test)
        r = linear_probe(f, yt, ft, yte, data.num_classes)
        ref = ft if ref is None else ref
        r["feature_error"] = float((ft - ref).norm() / ref.norm())
        out[name] = r
        log(f"{name:45s} pixel acc {r['pixel_accuracy']:.3f}  mIoU {r['miou']:.3f}  "
            f"|f - f_BN| / |f_BN| {r['feature_error']:.3f}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--macro", action="store_true", help="the 5 macro classes")
    p.add_argument("--size", type=int, default=48)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--width", type=float, default=0.5)
    p.add_argument("--channels", type=int, default=64)
    p.add_argument("--output-stride", type=int, default=16)
    p.add_argument("--no-augment", action="store_true")
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--figure", help="write the qualitative figure (4 test images) here")
    p.add_argument("--fedavg", action="store_true", help="bare FedAvg instead (sizing)")
    p.add_argument("--alpha", type=float, default=0.1, help="Dirichlet alpha (--fedavg)")
    p.add_argument("--clients", type=int, default=20, help="clients (--fedavg)")
    p.add_argument("--rounds", type=int, default=30, help="rounds (--fedavg)")
    p.add_argument("--per-round", type=int, default=5, help="active clients (--fedavg)")
    p.add_argument("--local-steps", type=int, default=2, help="steps per client (--fedavg)")
    p.add_argument("--probe", help="a pretrained encoder (.pth): linear-probe its pixel "
                   "features per way of loading it, then stop")
    p.add_argument("--probe-images", type=int, default=400, help="images to fit the probe")
    p.add_argument("--pretrained", help="start the central run's encoder from this .pth")
    p.add_argument("--norm", default="group", choices=("group", "batch", "frozen"))
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.probe:
        probe(a.probe, a.width, a.probe_images)
        return
    cfg = DataConfig(name="shapes", image_size=a.size,
                     num_clients=a.clients if a.fedavg else 1, alpha=a.alpha)
    data = (shapes_macro_federation if a.macro else shapes_federation)(cfg)
    base = all_background(data.y_test, data.num_classes)
    print(f"{data.name}: {len(data.x_train)} train / {len(data.x_test)} test images "
          f"{data.input_shape}; all-background mIoU {base['miou']:.3f}, pixel acc "
          f"{base['pixel_accuracy']:.3f}")
    if a.fedavg:
        train_fedavg(data, a.rounds, a.per_round, a.local_steps, a.batch, a.lr, a.seed,
                     a.width, a.channels, a.output_stride, not a.no_augment)
        return
    snaps: dict | None = {} if a.figure else None
    res = train_central(data, a.steps, a.batch, a.lr, a.seed, a.width, a.channels,
                        a.output_stride, not a.no_augment, a.every, snapshots=snaps,
                        norm=a.norm, pretrained=a.pretrained)
    if a.figure:
        from protofl.report.segmentation import maps_from_outputs, qualitative_figure

        x, y = data.x_test[:4], data.y_test[:4]
        with torch.no_grad():
            maps = {k: maps_from_outputs(*m(to_input(x))) for k, m in snaps.items()}
        print(qualitative_figure(x, y, maps, a.figure, data.class_names, data.name))
    final = res[-1][2]
    print("per-class IoU: " + ", ".join(f"{k} {v:.2f}" for k, v in final["iou"].items()
                                        if v is not None))
    print(f"final mIoU {final['miou']:.3f} vs all-background {base['miou']:.3f} "
          f"({np.round(res[-1][1], 1)} s)")


if __name__ == "__main__":
    main()
