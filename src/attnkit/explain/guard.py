"""What ``explain`` refuses, with one error type: sizes beyond the limits, and overflow.

:class:`ExplainError` is a ``ValueError`` whose message exists in English (``str(err)``)
and Korean (``err.message("ko")``); the command line prints it as its one line.

Shape legend::

    q (B, H_q, N_q, D_k)   k, v (B, H_kv, N_k, D_·)
    S, X (B, H_q, N_q, N_k)

Caution
-------
- Limits: a trace keeps every step as float64, so ``explain`` refuses more than
  :data:`MAX_SCORES` scores (B·H_q·N_q·N_k, 4,194,304 = one 2048 × 2048 head) or an input
  of more than :data:`MAX_VALUES` values (16,777,216), before computing anything.
- Overflow is reported where it first happens (Q·Kᵀ, then S · scale, then the soft-cap /
  score_mod / bias) and only where the inputs there were finite: a NaN or ±∞ that the
  caller put in shows as such in the trace. W V cannot overflow: each output is a convex
  mix of finite values.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .common import fmt, head_label, shape_str
from .strings import STRINGS

if TYPE_CHECKING:
    from ..backends.base import Problem
    from ..reference import Intermediates

__all__ = ["ExplainError", "MAX_SCORES", "MAX_VALUES", "check_size", "check_overflow",
           "check_decimals"]

MAX_SCORES = 2 ** 22          # B·H_q·N_q·N_k
MAX_VALUES = 2 ** 24          # per input


class ExplainError(ValueError):
    """A call ``explain`` cannot show: ``ExplainError(key, **params)`` formats
    ``STRINGS[lang]["err_" + key]`` (English for ``str``)."""

    def __init__(self, key: str, **params: Any) -> None:
        self.key, self.params = key, params
        super().__init__(self.message("en"))

    def message(self, lang: str = "en") -> str:
        table = STRINGS.get(lang, STRINGS["en"])
        params = dict(self.params)
        where = params.pop("head", None)
        params["where"] = f", {where[lang]}" if where else ""
        return table[f"err_{self.key}"].format(**params)


def check_decimals(decimals: object) -> int:
    """``decimals`` if it is a whole number from 0 to 12, else an :class:`ExplainError`."""
    if isinstance(decimals, bool) or not isinstance(decimals, (int, np.integer)) \
            or not 0 <= decimals <= 12:
        raise ExplainError("decimals", d=repr(decimals))
    return int(decimals)


def check_size(p: Problem, shapes: dict[str, tuple[int, ...]] | None = None) -> None:
    """Refuse a problem whose trace would not fit the limits (nothing is computed yet);
    ``shapes`` are the caller's input shapes, for the message."""
    for name, t in (("q", p.q), ("k", p.k), ("v", p.v)):
        if t.numel() > MAX_VALUES:
            shape = shape_str((shapes or {}).get(name) or tuple(t.shape))
            raise ExplainError("input_large", name=name, shape=shape, n=f"{t.numel():,}",
                               limit=f"{MAX_VALUES:,}")
    cells = p.batch * p.heads_q * p.n_q * p.n_k
    if cells > MAX_SCORES:
        fit = math.isqrt(MAX_SCORES // max(p.batch * p.heads_q, 1))
        raise ExplainError("too_large", cells=f"{cells:,}",
                           expr=f"{p.batch}·{p.heads_q}·{p.n_q}·{p.n_k}",
                           limit=f"{MAX_SCORES:,}", fit=max(fit, 1))


def _first(bad: torch.Tensor) -> tuple[int, ...] | None:
    """The first index where ``bad`` is True, or None."""
    flat = bad.reshape(-1)
    if not bool(flat.any()):
        return None
    at = int(flat.to(torch.uint8).argmax())               # the first True, no index list
    return tuple(int(i) for i in np.unravel_index(at, tuple(bad.shape)))


def _head(p: Problem, lead: tuple[int, ...], b: int, h: int) -> dict[str, str] | None:
    """The label of head (b, h) in each language (None for one head and no batch)."""
    if p.batch * p.heads_q == 1 and not lead:
        return None
    shape = (*lead, p.heads_q) if lead else (p.heads_q,)
    return {lang: head_label(shape, b * p.heads_q + h, lang) for lang in STRINGS}


def _absmax(t: torch.Tensor) -> str:
    fin = t[torch.isfinite(t)]
    return fmt(float(fin.abs().max()) if fin.numel() else 0.0)


def check_overflow(p: Problem, r: Intermediates, lead: tuple[int, ...] = ()) -> None:
    """Raise where a step turned finite inputs into ±∞ / NaN (see the module's Caution)."""
    acc = r.scores.dtype
    top = fmt(torch.finfo(acc).max)
    fq = torch.isfinite(p.q).all(-1)                                   # (B, H_q, N_q)
    fk = torch.isfinite(p.k).all(-1).repeat_interleave(p.group, 1)     # (B, H_q, N_k)
    s = r.scores                                                       # (B, H_q, N_q, N_k)
    at = _first(~torch.isfinite(s) & fq[..., :, None] & fk[..., None, :])
    if at is not None:
        b, h, i, j = at
        raise ExplainError("overflow_s", dtype=str(acc).removeprefix("torch."), i=i + 1,
                           j=j + 1, max=top, qmax=_absmax(p.q), kmax=_absmax(p.k),
                           head=_head(p, lead, b, h))
    x0 = s * p.scale                                                   # S · scale
    at = _first(~torch.isfinite(x0) & torch.isfinite(s))
    if at is not None:
        b, h, i, j = at
        raise ExplainError("overflow_x", dtype=str(acc).removeprefix("torch."), i=i + 1,
                           j=j + 1, s=fmt(float(s[at])), scale=fmt(p.scale), max=top,
                           head=_head(p, lead, b, h))
    x = r.scaled
    at = _first((torch.isnan(x) | (x == math.inf)) & torch.isfinite(x0))
    if at is not None:
        b, h, i, j = at
        what = [n for n, on in (("soft-cap", p.softcap is not None),
                                ("score_mod", p.score_mod is not None),
                                ("bias", p.bias is not None)) if on]
        raise ExplainError("overflow_mod", i=i + 1, j=j + 1, val=fmt(float(x[at])),
                           s=fmt(float(x0[at])), what=" / ".join(what) or "score",
                           head=_head(p, lead, b, h))
