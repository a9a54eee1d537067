"""Batched matmuls against K/V that may be shared over the batch (the general and compiled
engines).

``attention()`` passes K/V of batch 1 against a larger query batch as stride-0 views;
:func:`shared_kv` reads them as ``(H_kv, N_k, D)`` (cast and reshaped once, never per batch
element), and :func:`mm` / :func:`addmm_` / :func:`add_tmm_` multiply against either form:
one bmm per batch element over the K/V heads, or one over all ``B·M`` rows when H_kv = 1;
gradients of shared K/V sum over the batch inside the matmuls.

Shape legend::

    a (B·H_kv, M, X)     b (B·H_kv | H_kv, X, Y)     c, out (B·H_kv, M, Y)
"""

from __future__ import annotations

import torch

__all__ = ["shared_kv", "mm", "addmm_", "add_tmm_"]


def shared_kv(t: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """``t (B, H_kv, N_k, D)`` in ``acc`` as ``(B·H_kv, N_k, D)``, or — batch 1 broadcast
    over B > 1 (stride 0) — as ``(H_kv, N_k, D)``: cast and reshaped once, never per batch
    element."""
    if t.shape[0] > 1 and t.stride(0) == 0:
        t = t[:1]                                                   # (1, H_kv, N_k, D)
    return t.to(acc).reshape(-1, t.shape[2], t.shape[3])


def mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``a (B·H_kv, M, X) @ b (B·H_kv | H_kv, X, Y)`` → ``(B·H_kv, M, Y)`` (into ``out``
    when given, nothing recorded). ``b`` with H_kv (K/V shared over the batch) is never
    expanded: one bmm per batch element, or one over all ``B·M`` rows when H_kv = 1."""
    if b.shape[0] == a.shape[0]:
        return torch.bmm(a, b) if out is None else torch.bmm(a, b, out=out)
    h = b.shape[0]
    if h == 1:                                                      # fold B into the rows
        a1 = a.reshape(1, -1, a.shape[2])                           # (1, B·M, X)
        if out is None:
            return torch.bmm(a1, b).view(a.shape[0], a.shape[1], b.shape[2])
        torch.bmm(a1, b, out=out.view(1, -1, b.shape[2]))
        return out
    if out is None:                                                 # autograd may record
        return torch.cat([torch.bmm(a[i:i + h], b) for i in range(0, a.shape[0], h)])
    for i in range(0, a.shape[0], h):
        torch.bmm(a[i:i + h], b, out=out[i:i + h])                  # (H_kv, M, Y) each
    return out


def addmm_(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``c (B·H_kv, M, Y) += a (B·H_kv, M, X) @ b (B·H_kv | H_kv, X, Y)`` in place."""
    if b.shape[0] == a.shape[0]:
        return c.baddbmm_(a, b)
    h = b.shape[0]
    if h == 1:
        c.view(1, -1, c.shape[2]).baddbmm_(a.reshape(1, -1, a.shape[2]), b)
        return c
    for i in range(0, a.shape[0], h):
        c[i:i + h].baddbmm_(a[i:i + h], b)
    return c


def add_tmm_(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``c (B·H_kv | H_kv, L, Y) += aᵀ @ b`` for ``a (B·H_kv, M, L)``, ``b (B·H_kv, M, Y)``
    — a shared K/V's gradient (``c`` with H_kv) sums over the batch."""
    if c.shape[0] == a.shape[0]:
        # bmm + add_: baddbmm_ into a key slice with a transposed operand falls to one
        # addmm per batch (measured 6-10x slower here)
        c.add_(torch.bmm(a.transpose(1, 2), b))
        return
    h = c.shape[0]
    if h == 1:                                                      # Σ over all B·M rows
        c.add_(torch.bmm(a.reshape(1, -1, a.shape[2]).transpose(1, 2),
                         b.reshape(1, -1, b.shape[2])))
        return
    for i in range(0, a.shape[0], h):
        c.add_(torch.bmm(a[i:i + h].transpose(1, 2), b[i:i + h]))
