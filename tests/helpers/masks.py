"""Helpers shared by the mask tests."""

from __future__ import annotations

import math

import torch

from attnkit.masks import EMPTY, FULL, PARTIAL


def dense_blocks(d: torch.Tensor, bq: int, bk: int) -> torch.Tensor:
    """Exact block map of a dense (B, H, N_q, N_k) bool tensor (pads are neutral)."""
    B, H, n_q, n_k = d.shape
    nbq, nbk = math.ceil(n_q / bq), math.ceil(n_k / bk)
    pad = (0, nbk * bk - n_k, 0, nbq * bq - n_q)

    def tiles(fill: bool) -> torch.Tensor:
        t = torch.nn.functional.pad(d.to(torch.uint8), pad, value=int(fill)).bool()
        return t.reshape(B, H, nbq, bq, nbk, bk).transpose(3, 4).reshape(B, H, nbq, nbk, -1)

    all_, any_ = tiles(True).all(-1), tiles(False).any(-1)
    return torch.where(all_, FULL, torch.where(any_, PARTIAL, EMPTY)).to(torch.int8)
