"""What differs between tasks, decided by the labels' shape: classification labels are one
class per sample ``y (B,)``; segmentation labels are one class per pixel ``y (B, H, W)`` with
``VOID`` (255) ignored. The algorithms are the same for both; they call these functions where
the tasks differ (the per-sample loss and which feature rows stand for which class)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

VOID = 255  # segmentation label of void/boundary pixels (never a class)
DENSE_PIXELS = 1 << 19  # label pixels per forward pass when metrics batch dense predictions


def dense(y: torch.Tensor) -> bool:
    """True for per-pixel labels."""
    return y.dim() > 1


def per_sample_cross_entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy per sample ``(B,)``: of the class scores ``(B, C)``, or the mean over a
    sample's non-void pixels of per-pixel scores ``(B, C, H, W)`` (0 for an all-void image)."""
    if not dense(y):
        return F.cross_entropy(logits, y, reduction="none")
    per_pixel = F.cross_entropy(logits, y.long(), reduction="none", ignore_index=VOID)
    valid = (y != VOID).flatten(1).to(per_pixel.dtype)
    return per_pixel.flatten(1).sum(1) / valid.sum(1).clamp_min(1.0)


def labelled_features(z: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Feature rows ``(n, d)`` and their classes ``(n,)``: ``z (B, d)`` with ``y (B,)`` as they
    are, or every location of a feature map ``z (B, d, h, w)`` with the labels ``y (B, H, W)``
    nearest-downsampled to ``(h, w)``, void locations dropped."""
    if not dense(y):
        return z, y
    b, d, h, w = z.shape
    small = F.interpolate(y[:, None].float(), size=(h, w), mode="nearest")[:, 0].long()
    rows, labels = z.permute(0, 2, 3, 1).reshape(-1, d), small.reshape(-1)
    keep = labels != VOID
    return rows[keep], labels[keep]


def rows_per_pass(y: torch.Tensor, batch: int) -> int:
    """Rows a metric may pass through the model at once: ``batch``, or for per-pixel labels
    at most ``DENSE_PIXELS`` label pixels' worth (a 256 x 256 image's logits and features
    are megabytes each), at least one."""
    if not dense(y):
        return batch
    pixels = max(1, y[0].numel()) if len(y) else 1
    return max(1, min(batch, DENSE_PIXELS // pixels))
