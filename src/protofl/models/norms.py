"""Normalisation layers for pretrained encoders: frozen BatchNorm, and BatchNorm's statistics
carried into GroupNorm.

``model.norm`` picks one of:

- ``group``: GroupNorm everywhere (no running statistics: clients are vectorised with
  ``torch.func.vmap``). A pretrained BatchNorm is carried over by :func:`group_norm_from_bn`.
- ``batch``: BatchNorm in training mode (batch statistics; the running statistics are
  buffers, updated locally and averaged by the server). The sequential trainer only.
- ``frozen``: the pretrained encoder's BatchNorm with its running statistics frozen (always
  eval-mode statistics) and its affine weight and bias trained: :class:`FrozenBatchNorm2d`.
  Layers with no pretrained statistics (DeepLab's ASPP and decoder) use GroupNorm. Nothing
  depends on the batch, so clients are vectorised too. Needs ``model.pretrained``.
"""

from __future__ import annotations

import torch
from torch import nn

NORMS = ("group", "batch", "frozen")
BN_EPS = 1e-5  # torch's BatchNorm default, which torchvision's ResNet and MobileNetV2 use


class FrozenBatchNorm2d(nn.Module):
    """``y = (x - running_mean) / sqrt(running_var + eps) * weight + bias`` per channel.

    The statistics are buffers that never change (no batch statistics in training mode);
    ``weight`` and ``bias`` are parameters. The state_dict keys are BatchNorm's, less
    ``num_batches_tracked``."""

    def __init__(self, channels: int, eps: float = BN_EPS):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.weight * torch.rsqrt(self.running_var + self.eps)
        shift = self.bias - self.running_mean * scale
        return x * scale[:, None, None] + shift[:, None, None]

    def extra_repr(self) -> str:
        return f"{self.weight.numel()}, eps={self.eps}"


def group_norm_from_bn(gn: nn.GroupNorm, weight: torch.Tensor, bias: torch.Tensor,
                       mean: torch.Tensor, var: torch.Tensor, eps: float = BN_EPS) -> None:
    """Set ``gn``'s affine so that it equals the eval-mode BatchNorm ``(weight, bias, mean,
    var)`` on every input whose per-sample group statistics are the population's.

    Group ``G``'s population mean and variance follow from the channels' running statistics
    (the BatchNorm statistics pool the batch and the pixels, so the law of total variance
    applies): ``M_G = mean_c mu_c``, ``V_G = mean_c (var_c + mu_c^2) - M_G^2``. GroupNorm
    computes ``(x_c - m) / sqrt(v + eps_gn)`` with the sample's group statistics ``(m, v)``;
    with ``S_G = sqrt(V_G + eps_gn)`` and ``s_c = sqrt(var_c + eps)``, the affine
    ``w'_c = w_c S_G / s_c`` and ``b'_c = b_c + w_c (M_G - mu_c) / s_c`` gives the BatchNorm
    output exactly when ``(m, v) = (M_G, V_G)``, and approximately elsewhere (how well is
    measured in docs/datasets.md)."""
    c, g = weight.numel(), gn.num_groups
    mu, v = mean.double().reshape(g, c // g), var.double().reshape(g, c // g)
    m_g = mu.mean(1, keepdim=True)
    v_g = (v + mu ** 2).mean(1, keepdim=True) - m_g ** 2
    s_g = torch.sqrt(v_g.clamp_min(0) + gn.eps).expand(g, c // g).reshape(c)
    s_c = torch.sqrt(var.double() + eps)
    w = weight.double()
    with torch.no_grad():
        gn.weight.copy_(w * s_g / s_c)
        gn.bias.copy_(bias.double() + w * (m_g.expand(g, c // g).reshape(c) - mean.double())
                      / s_c)

