"""How a client's local data become training batches: the sample order of each local epoch
and an optional per-batch transform (augmentation). An algorithm declares its pipeline (e.g.
fedproin's class-balanced epochs with adaptive augmentation); the data may add its own
augmentation (``data.augment``, e.g. segmentation's joint crop and flip), which runs first
(``compose``); the trainers only run them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from protofl.config import AUGMENTATIONS
from protofl.errors import ProtoflError

Order = Callable[[torch.Tensor, torch.Generator], torch.Tensor]  # (y, gen) -> indices
# (x, y, gen, the client's per-class sample counts) -> transformed (x, y); y changes with x
# when labels are spatial (segmentation masks under a crop or flip)
Transform = Callable[[torch.Tensor, torch.Tensor, torch.Generator, torch.Tensor],
                     tuple[torch.Tensor, torch.Tensor]]


def shuffled(y: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One pass over every sample in a fresh random order."""
    return torch.randperm(len(y), generator=gen)


def class_balanced(y: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Class-balanced epoch: ``max_c n_c * C_local`` indices drawn with replacement, sample i
    with probability ``1 / (C_local * n_{y_i})``."""
    if len(y) == 0:
        return shuffled(y, gen)
    counts = torch.bincount(y)
    c_local = int((counts > 0).sum())
    weights = 1.0 / (c_local * counts[y].to(torch.float64))
    length = int(counts.max()) * c_local
    return torch.multinomial(weights, length, replacement=True, generator=gen)


@dataclass(frozen=True)
class ClientPipeline:
    """An epoch's sample order and a per-batch transform (None: batches as stored)."""

    order: Order = shuffled
    transform: Transform | None = None




def augmentation(name: str) -> Transform | None:
    """The data-level transform ``data.augment`` names (None for ``none``)."""
    if name == "none":
        return None
    if name == "crop_flip":
        from protofl.data.seg_augment import crop_flip_transform

        return crop_flip_transform()
    raise ProtoflError(f"config: data.augment = {name!r}; allowed: {', '.join(AUGMENTATIONS)}")


def compose(*transforms: Transform | None) -> Transform | None:
    """The transforms given (None skipped) applied one after another with the same batch
    generator and class counts; None when there is none."""
    chain = [t for t in transforms if t is not None]
    if len(chain) <= 1:
        return chain[0] if chain else None

    def run(x: torch.Tensor, y: torch.Tensor, gen: torch.Generator, counts: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
        for t in chain:
            x, y = t(x, y, gen, counts)
        return x, y

    return run
