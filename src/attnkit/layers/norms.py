"""Normalisations used inside attention layers (QK-norm, MLA's latent norm).

Shape legend: x (…, width) → (…, width); the statistics are over the last dim.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """``x / √(mean(x²) + eps) · gain`` over the last dim (gain: learnable, ``(width,)``)."""

    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ms = x.pow(2).mean(-1, keepdim=True)                 # (…, 1) mean square
        return x * torch.rsqrt(ms + self.eps) * self.weight

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
