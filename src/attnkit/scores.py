"""Score modifications: how much a query likes a key, beyond the dot product.

A *score mod* is a function ``score_mod(score, b, h, q_idx, kv_idx) -> score`` applied to the
scaled (and soft-capped) logits before the mask. It must be elementwise and differentiable;
the index tensors broadcast against ``score``.

Shape legend::

    score   (B, H, N_q, N_k) or any tile of it     b (B,1,1,1)   h (1,H,1,1)
    q_idx   (1,1,N_q,1)                            kv_idx (1,1,1,N_k)

The order inside attention is fixed: ``S·scale → softcap → score_mod → + bias → mask``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["ScoreMod", "soft_cap", "alibi_slopes", "alibi", "relative_bias"]

ScoreMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                    torch.Tensor]


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap · tanh(x / cap)``: squashes logits smoothly into (-cap, cap)."""
    return cap * torch.tanh(x / cap)


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """ALiBi's geometric head slopes ``2^(-8h/H)`` for ``h = 1..H`` (shape ``(H,)``).

    For a head count that is not a power of two, the slopes of the next lower power of two
    are followed by every other slope of the next higher one (as in the ALiBi paper's code).
    """
    if n_heads < 1:
        raise ValueError(f"n_heads must be >= 1, got {n_heads}")

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    p = 1 << (n_heads.bit_length() - 1)
    slopes = power_of_two(p)
    if p != n_heads:
        slopes += power_of_two(2 * p)[0::2][: n_heads - p]
    return torch.tensor(slopes, dtype=torch.float64)


def alibi(n_heads: int) -> ScoreMod:
    """ALiBi as a score mod: ``score - slope_h · |q_idx - kv_idx|``."""
    slopes = alibi_slopes(n_heads)

    def score_mod(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        s = slopes.to(device=score.device, dtype=score.dtype)[h]
        return score - s * (q_idx - kv_idx).abs().to(score.dtype)

    return score_mod


def relative_bias(table: torch.Tensor, max_distance: int) -> ScoreMod:
    """A learned relative-position bias: ``score + table[h, clamp(kv_idx - q_idx) + max_distance]``.

    ``table`` has shape ``(H, 2·max_distance + 1)`` and may require grad.
    """
    if table.dim() != 2 or table.shape[1] != 2 * max_distance + 1:
        raise ValueError(
            f"relative_bias table must have shape (H, 2*max_distance+1) = "
            f"(H, {2 * max_distance + 1}), got {tuple(table.shape)}"
        )

    def score_mod(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        rel = (kv_idx - q_idx).clamp(-max_distance, max_distance) + max_distance
        return score + table.to(score.dtype)[h, rel]

    return score_mod
