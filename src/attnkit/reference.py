"""The reference: attention exactly as the formula reads, one step a line.

    Attention(Q, K, V) = Softmax_keys( Q Kᵀ · scale + M ) V

This module is the oracle every test compares against, and the engine behind
``attnkit.explain``. It materialises every intermediate (O(N_q · N_k) memory): it is
written to be read and trusted, not to be fast.

Shape legend::

    B batch   H heads (H_q)   N_q queries   N_k keys   D_k key width   D_v value width
    q (B,H,N_q,D_k)   k (B,H_kv,N_k,D_k)   v (B,H_kv,N_k,D_v)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .backends.base import Backend, Capabilities, Problem, compute_dtype, finish, softmax_shift
from .scores import soft_cap

__all__ = ["Intermediates", "reference", "ReferenceBackend", "safe_softmax"]


@dataclass
class Intermediates:
    """Every step of one reference run (tensors in the accumulation dtype)."""

    scores: torch.Tensor      # S = Q Kᵀ                         (B, H, N_q, N_k)
    scaled: torch.Tensor      # S · scale (then softcap, score_mod, + bias)
    allowed: torch.Tensor     # mask, True = may attend          (B|1, H|1, N_q, N_k)
    logits: torch.Tensor      # scaled where allowed, else -inf  (B, H, N_q, N_k)
    weights: torch.Tensor     # softmax over keys                (B, H, N_q, N_k)
    output: torch.Tensor      # weights · V                      (B, H, N_q, D_v)
    lse: torch.Tensor         # log Σ_keys exp(logits)           (B, H, N_q)


def safe_softmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Max-subtracted softmax over the last dim that maps an all −∞ row to zeros.

    Returns ``(weights, lse)``; ``lse`` is −∞ for a row with no allowed key, and neither the
    weights nor their gradients are ever NaN for such a row.
    """
    if logits.shape[-1] == 0:                             # no keys at all: every row empty
        return logits, torch.full(logits.shape[:-1], -torch.inf, dtype=logits.dtype,
                                  device=logits.device)
    m = softmax_shift(logits.amax(-1).detach())           # (…, N_q) row max (empty row: 0)
    e = torch.exp(logits - m.unsqueeze(-1))               # (…, N_q, N_k) in (0, 1]
    z = e.sum(-1)                                         # (…, N_q)      row sum
    return finish(e, z, m)                                # weights sum to 1 (or 0), lse


def _indices(p: Problem, device: torch.device) -> tuple[torch.Tensor, ...]:
    b = torch.arange(p.batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(p.heads_q, device=device).view(1, -1, 1, 1)
    qi = torch.arange(p.n_q, device=device).view(1, 1, -1, 1)
    ki = torch.arange(p.n_k, device=device).view(1, 1, 1, -1)
    return b, h, qi, ki


def _idle_rows_zeroed(q: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """``q`` with the rows that may attend to no key set to 0 — only when such a row holds
    NaN/inf (a padded query row of garbage): its weights are 0, but 0 · NaN in the gradient
    of ``Q Kᵀ`` would still reach dK. Finite rows are left as they are (their scores show)."""
    if allowed is None:
        return q
    idle = ~allowed.any(-1, keepdim=True)                 # (B|1, H|1, N_q, 1)
    if not bool((idle & ~torch.isfinite(q)).any()):
        return q
    return torch.where(idle, torch.zeros_like(q), q)


def reference(p: Problem) -> Intermediates:
    """Run the five textbook steps (score, scale, mask, softmax, weighted sum) on a normalised
    problem, keeping every intermediate."""
    acc = compute_dtype(p.dtype)
    q = p.q.to(acc)                                       # (B, H,    N_q, D_k)
    k = p.k.to(acc).repeat_interleave(p.group, dim=1)     # (B, H,    N_k, D_k)  GQA: share K
    v = p.v.to(acc).repeat_interleave(p.group, dim=1)     # (B, H,    N_k, D_v)
    allowed = p.allowed_dense()                           # (B|1, H|1, N_q, N_k) or None
    q = _idle_rows_zeroed(q, allowed)                     # padded garbage never reaches dK

    # 1. Score: how well each query matches each key
    scores = q @ k.transpose(-1, -2)                      # (B, H, N_q, N_k)
    # 2. Scale (and optional soft-cap, score mod, additive bias)
    x = scores * p.scale                                  # (B, H, N_q, N_k)
    if p.softcap is not None:
        x = soft_cap(x, p.softcap)                        # c·tanh(x/c)
    if p.score_mod is not None:
        x = p.score_mod(x, *_indices(p, x.device))       # per-score function
    if p.bias is not None:
        x = x + p.bias.to(acc)                            # additive float mask / bias
    # 3. Mask: blocked pairs get -inf (torch.where, so NaN there cannot leak)
    if allowed is None:
        allowed = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=x.device)
        logits = x
    else:
        logits = torch.where(allowed, x, torch.full_like(x, -torch.inf))
    # 4. Softmax over keys → weights; 5. weighted sum of values
    weights, lse = safe_softmax(logits)                   # (B, H, N_q, N_k), (B, H, N_q)
    mixed = weights
    if p.dropout_p > 0.0:
        keep = torch.rand_like(weights) >= p.dropout_p    # same torch seed → same dropout
        mixed = torch.where(keep, weights / (1.0 - p.dropout_p), torch.zeros_like(weights))
    output = mixed @ v                                    # (B, H, N_q, D_v)
    return Intermediates(scores, x, allowed, logits, weights, output, lse)


class ReferenceBackend(Backend):
    """The formula, materialised: any device, any dtype, every option."""

    name = "reference"
    description = "materialised softmax(QKᵀ·scale + M)V; O(N_q·N_k) memory; every option"
    capabilities = Capabilities(devices=None, dtypes=None)      # everything: the fallback

    def forward(self, p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
        r = reference(p)
        return r.output.to(p.dtype), r.lse
