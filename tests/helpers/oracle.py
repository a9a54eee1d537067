"""The one float64 oracle of the test suite: attention written out with plain torch,
independent of attnkit (the dense "math" every backend, layer and the library's own
reference are compared with).

Shape legend: q (B, H_q, N_q, D_k), k (B, H_kv, N_k, D_k), v (B, H_kv, N_k, D_v);
allowed/bias broadcastable to (B, H_q, N_q, N_k).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _gqa(t: torch.Tensor, h_q: int) -> torch.Tensor:
    return t.repeat_interleave(h_q // t.shape[-3], dim=-3)


def oracle(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    allowed: torch.Tensor | None = None, bias: torch.Tensor | None = None,
    scale: float | None = None, softcap: float | None = None,
    score_mod: Callable[..., torch.Tensor] | None = None,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention by the formula in ``dtype`` (default float64) → (out, lse, weights).

    Inputs are (..., H, N, D) or 2-D; ``allowed`` (True = may attend) and ``bias`` broadcast
    to the logits. A row with no allowed key gets weights 0, output 0 and LSE -inf.
    Blocked positions are removed with ``torch.where`` so NaN there cannot leak.
    """
    q, k, v = (t.to(dtype) for t in (q, k, v))
    if q.dim() >= 3:
        k, v = _gqa(k, q.shape[-3]), _gqa(v, q.shape[-3])
    sc = q.shape[-1] ** -0.5 if scale is None else scale
    x = (q @ k.transpose(-1, -2)) * sc
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    if score_mod is not None:
        n_q, n_k = x.shape[-2], x.shape[-1]
        x4 = x.reshape(-1, *x.shape[-3:]) if x.dim() >= 3 else x[None, None]
        b = torch.arange(x4.shape[0]).view(-1, 1, 1, 1)
        h = torch.arange(x4.shape[1]).view(1, -1, 1, 1)
        qi = torch.arange(n_q).view(1, 1, -1, 1)
        ki = torch.arange(n_k).view(1, 1, 1, -1)
        x = score_mod(x4, b, h, qi, ki).reshape(x.shape)
    if bias is not None:
        x = x + bias.to(dtype)
    if allowed is not None:
        x = torch.where(allowed, x, torch.tensor(-torch.inf, dtype=dtype))
    lse = torch.logsumexp(x, dim=-1)
    w = torch.exp(x - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    w = torch.where(torch.isfinite(lse)[..., None], w, torch.zeros_like(w))
    if bool(torch.isfinite(v).all()):
        return w @ v, lse, w
    # non-finite V rows: only the queries that give them weight may see them (0·NaN = NaN)
    used = w[..., :, :, None] != 0                                   # (…, N_q, N_k, 1)
    terms = torch.where(used, w[..., None] * v[..., None, :, :], 0.0)  # (…, N_q, N_k, D_v)
    return terms.sum(-2), lse, w


def naive_low_precision(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        **opts: Any) -> torch.Tensor:
    """The same math done naively in q's own (low) precision: no float32 accumulation."""
    out, _, _ = oracle(q, k, v, dtype=q.dtype, **opts)
    return out


def randn(*shape: int, dtype: torch.dtype = torch.float64, **kw: Any) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, **kw)
