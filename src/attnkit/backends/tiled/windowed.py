"""The windowed schedule: every query block in ONE fused kernel call.

Used when every query block's non-empty tiles lie in a short window at a fixed offset from
the block (sliding windows, documents, local masks): block ``i`` sees keys
``[i·bq + off, i·bq + off + lw)``. The windows are strided views of zero-padded K/V (no
gather), batched as extra "heads", with one mask tensor for them (none when every window is
exactly a FULL run). For a band mask (sliding window) the interior blocks — windows inside
``[0, N_k)`` — share one ``(bq, lw)`` mask broadcast over the blocks and read K/V unpadded,
and the few edge blocks run in their own call (2–3 calls in all). Forward and backward.

Shape legend::

    q (B, H_kv, G, N_q, D)            k, v (B, H_kv, N_k, D)     (as in :mod:`.fused`)
    window rows   (B·H_kv, nb, G·bq, D)   nb blocks of bq rows (rows padded to nb·bq)
    K/V windows   (B·H_kv, nb, lw, D)     additive mask (B·H_kv|1, nb, G·bq, lw)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ... import _compat
from ..base import Problem
from .counters import count
from .plan import Plan

if TYPE_CHECKING:
    from .fused import Fused

__all__ = ["Window", "window_of", "forward", "backward"]

_flash = _compat.flash_cpu
_flash_bwd = _compat.flash_cpu_backward


@dataclass(frozen=True)
class Window:
    """All query blocks in ONE fused call: block i sees keys ``[i·bq + off, i·bq + off + lw)``.

    K/V are padded by ``front``/``back`` zero rows (masked) and the windows are strided views
    of them (no gather).
    """

    bq: int
    nb: int
    lw: int
    off: int
    front: int
    back: int
    masked: bool                  # False: every window is exactly one FULL run


def window_of(p: Problem, pl: Plan) -> Window | None:
    """The window schedule of plan ``pl``, or ``None`` when its runs are not local enough."""
    if len(pl.blocks) < 2:
        return None
    bq, nb = pl.block_q, len(pl.blocks)
    lo, hi, exact = None, None, True
    for i, blk in enumerate(pl.blocks):
        if not blk.runs:
            exact = False
            continue
        s0, e0 = blk.runs[0].k0 - i * bq, blk.runs[-1].k1 - i * bq
        lo = s0 if lo is None else min(lo, s0)
        hi = e0 if hi is None else max(hi, e0)
        exact &= len(blk.runs) == 1 and not blk.runs[0].masked
    if lo is None or hi is None:
        return None
    lw = hi - lo
    # a window tensor of N_q × lw stays well below N_q × N_k (and below 64 MB)
    if 4 * lw > p.n_k or nb * bq * p.group * lw > (1 << 24):
        return None
    front = max(0, -lo)
    back = max(0, (nb - 1) * bq + lo + lw - p.n_k)
    if exact:        # windows must be exactly the FULL runs, inside [0, N_k)
        exact = front == 0 and back == 0 and all(
            blk.runs[0].k0 == i * bq + lo and blk.runs[0].k1 == i * bq + lo + lw
            for i, blk in enumerate(pl.blocks))
    return Window(bq, nb, lw, lo, front, back, not exact)


# ---------------------------------------------------------------------------- layout
def _rows(t: torch.Tensor, w: Window, n_q: int) -> torch.Tensor:
    """``(B, H_kv, G, N_q, X)`` → ``(B·H_kv, nb, G·bq, X)`` (rows padded to nb·bq)."""
    B, hkv, g, _, x = t.shape
    if w.nb * w.bq != n_q:
        t = F.pad(t, (0, 0, 0, w.nb * w.bq - n_q))
    return t.view(B, hkv, g, w.nb, w.bq, x).transpose(2, 3).reshape(B * hkv, w.nb, g * w.bq, x)


def _unrows(t: torch.Tensor, B: int, hkv: int, g: int, w: Window, n_q: int) -> torch.Tensor:
    """Inverse of :func:`_rows`: ``(B·H_kv, nb, G·bq, X)`` → ``(B, H_kv, G, N_q, X)``."""
    x = t.shape[-1]
    t = t.view(B, hkv, w.nb, g, w.bq, x).transpose(2, 3).reshape(B, hkv, g, w.nb * w.bq, x)
    return t[:, :, :, :n_q]


def _kv(f: Fused, w: Window) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V windows ``(B·H_kv, nb, lw, D)``: strided views of the zero-padded K/V."""
    B, hkv, n_k, d = f.k.shape
    out = []
    for t in (f.k, f.v):
        tp = F.pad(t, (0, 0, w.front, w.back)) if (w.front or w.back) else t.contiguous()
        n_p = n_k + w.front + w.back
        out.append(tp.as_strided((B * hkv, w.nb, w.lw, d), (n_p * d, w.bq * d, d, 1),
                                 tp.storage_offset() + (w.off + w.front) * d))
    return out[0], out[1]


def _band_pattern(p: Problem, w: Window) -> torch.Tensor | None:
    """A band mask's pattern shared by every window: bool ``(bq, lw)``, or None."""
    assert p.mask is not None
    band = p.lowered.mask.as_band()
    if band is None:
        return None
    lo, hi = band
    # row r of block i, window column c: q − k = (i·bq + r) − (i·bq + off + c) = r − off − c
    dqk = torch.arange(w.bq).view(-1, 1) - w.off - torch.arange(w.lw).view(1, -1)
    return (dqk >= lo) & (dqk <= hi)                                      # (bq, lw)


def _allowed(p: Problem, w: Window) -> torch.Tensor:
    """The mask on every window: bool ``(B|1, H_q|1, nb·bq, lw)`` (keys outside
    ``[0, N_k)`` and rows past N_q are blocked)."""
    c = torch.arange(w.lw)
    shared = _band_pattern(p, w)
    if shared is not None:
        k_abs = torch.arange(w.nb).view(-1, 1) * w.bq + w.off + c.view(1, -1)   # (nb, lw)
        inside = (k_abs >= 0) & (k_abs < p.n_k)
        return (shared.unsqueeze(0) & inside.unsqueeze(1)).view(1, 1, w.nb * w.bq, w.lw)
    m = p.mask
    assert m is not None
    tiles = []
    for i in range(w.nb):                      # one evaluated tile per block
        q0, q1 = i * w.bq, min((i + 1) * w.bq, p.n_q)
        s0 = i * w.bq + w.off
        k0, k1 = max(0, s0), min(p.n_k, s0 + w.lw)
        tiles.append((q0, q1, k0 - s0, m.evaluate(p.n_q, p.n_k, q_range=(q0, q1),
                                                  k_range=(k0, k1), batch=p.batch,
                                                  heads=p.heads_q)))
    bm = max(t[3].shape[0] for t in tiles)
    hm = max(t[3].shape[1] for t in tiles)
    allowed = torch.zeros(bm, hm, w.nb, w.bq, w.lw, dtype=torch.bool)
    for i, (q0, q1, c0, a) in enumerate(tiles):
        allowed[:, :, i, : q1 - q0, c0:c0 + a.shape[3]] = a
    return allowed.view(bm, hm, w.nb * w.bq, w.lw)


def _mask(f: Fused, w: Window) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """→ (additive mask ``(B·H_kv|1, nb, G·bq, lw)``, rows with a key ``(…, nb, G·bq)``)."""
    p = f.p
    if not w.masked:
        return None, None
    B, hkv, g = p.batch, p.heads_kv, p.group
    allowed = _allowed(p, w)                                  # (B|1, H_q|1, nb·bq, lw)
    bm, hm = allowed.shape[:2]
    if bm == 1 and hm == 1:                                  # one mask for every (b, h)
        a = allowed.reshape(1, w.nb, 1, w.bq, w.lw).expand(1, w.nb, g, w.bq, w.lw)
        a = a.reshape(1, w.nb, g * w.bq, w.lw)
    else:
        a = allowed.expand(B, p.heads_q, w.nb * w.bq, w.lw).reshape(B, hkv, g, w.nb * w.bq,
                                                                    w.lw)
        a = _rows(a, w, w.nb * w.bq)                          # (B·H_kv, nb, G·bq, lw)
    add = torch.zeros(a.shape, dtype=f.q.dtype).masked_fill_(~a, -math.inf)
    return add, a.any(-1)


# ---------------------------------------------------------------------------- band split
def _split(f: Fused, w: Window) -> list[tuple[int, int, bool]] | None:
    """Block ranges ``(i_lo, i_hi, interior)`` for a band mask, or None (one masked call).

    Interior blocks — windows inside ``[0, N_k)`` — share one band pattern; the edge blocks
    before and after them are computed apart.
    """
    p = f.p
    if not (w.masked and p.mask is not None and f.bias is None
            and p.lowered.mask.as_band() is not None):
        return None
    i0 = min(w.nb, max(0, -(w.off // w.bq)))
    i1 = max(i0, min(w.nb, (p.n_k - w.off - w.lw) // w.bq + 1))
    if i1 - i0 < max(2, w.nb // 2):
        return None
    return [(a, b_, a == i0 and b_ == i1) for a, b_ in ((0, i0), (i0, i1), (i1, w.nb)) if b_ > a]


def _range_inputs(f: Fused, w: Window, i_lo: int, i_hi: int, interior: bool):  # noqa: ANN202
    """K/V windows, additive mask and rows-with-a-key for blocks ``[i_lo, i_hi)`` of a band.

    K/V are sliced to the keys those blocks see (zero-padded only where a window leaves
    ``[0, N_k)``). ``interior``: every window lies inside ``[0, N_k)``, so all blocks share
    one ``(G·bq, lw)`` mask, broadcast over the blocks (stride 0).
    → (kw, vw ``(B·H_kv, n, lw, D)``, add, has_key, sub-window, first key (absolute)).
    """
    p = f.p
    B, hkv, g, n_q, d = f.q.shape
    n_k = f.k.shape[2]
    bq, lw, n = w.bq, w.lw, i_hi - i_lo
    s0, s1 = i_lo * bq + w.off, (i_hi - 1) * bq + w.off + lw       # absolute keys seen
    ks, ke = max(0, s0), min(n_k, s1)
    front, back = ks - s0, s1 - ke
    kv = []
    for t in (f.k, f.v):
        t = t[:, :, ks:ke]
        t = F.pad(t, (0, 0, front, back)) if (front or back) else t.contiguous()
        kv.append(t.as_strided((B * hkv, n, lw, d), (t.shape[2] * d, bq * d, d, 1),
                               t.storage_offset()))
    allowed = _band_pattern(p, w)                                         # (bq, lw)
    assert allowed is not None
    if interior:
        a = allowed.view(1, 1, 1, bq, lw).expand(1, 1, g, bq, lw).reshape(1, 1, g * bq, lw)
    else:
        k_abs = torch.arange(i_lo, i_hi).view(-1, 1) * bq + w.off + torch.arange(lw).view(1, -1)
        inside = (k_abs >= 0) & (k_abs < p.n_k)                           # (n, lw)
        a = (allowed.unsqueeze(0) & inside.unsqueeze(1)).view(1, n, 1, bq, lw)
        a = a.expand(1, n, g, bq, lw).reshape(1, n, g * bq, lw)
    add = torch.zeros(a.shape, dtype=f.q.dtype).masked_fill_(~a, -math.inf)
    has_key = a.any(-1)
    if interior:
        add = add.expand(1, n, g * bq, lw)
    return kv[0], kv[1], add, has_key, Window(bq, n, lw, 0, 0, 0, True), s0


def _range_forward(f: Fused, w: Window, i_lo: int, i_hi: int, interior: bool,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward of blocks ``[i_lo, i_hi)`` of a band-masked window schedule, ONE kernel call.

    → out ``(B, H_kv, G, rows, D)``, lse ``(B, H_kv, G, rows)`` for query rows
    ``[i_lo·bq, min(i_hi·bq, N_q))``.
    """
    p = f.p
    B, hkv, g, n_q, d = f.q.shape
    r0, r1 = i_lo * w.bq, min(i_hi * w.bq, n_q)
    kw, vw, add, has_key, wr, _ = _range_inputs(f, w, i_lo, i_hi, interior)
    count(runs=1, windowed=1, masked_runs=1)
    o, lse = _flash(_rows(f.q[:, :, :, r0:r1], wr, r1 - r0), kw, vw, attn_mask=add,
                    scale=p.scale)
    lse = lse.to(o.dtype)
    if not bool(has_key.all()):
        lse = torch.where(has_key, lse, torch.full_like(lse, -math.inf))
    out = _unrows(o, B, hkv, g, wr, r1 - r0)
    lse = _unrows(lse.unsqueeze(-1), B, hkv, g, wr, r1 - r0).squeeze(-1)
    return out, lse


# ---------------------------------------------------------------------------- forward
def forward(f: Fused, w: Window) -> tuple[torch.Tensor, torch.Tensor]:
    """→ out (B, H_kv, G, N_q, D), lse (B, H_kv, G, N_q)."""
    p = f.p
    B, hkv, g, n_q, d = f.q.shape
    split = _split(f, w)
    if split is not None:
        # interior blocks (window inside [0, N_k)) share ONE (bq, lw) band pattern: no K/V
        # padding, a small mask broadcast over the blocks; the few edge blocks apart
        parts = [_range_forward(f, w, a, b_, inner) for a, b_, inner in split]
        if len(parts) == 1:
            return parts[0]
        return (torch.cat([x[0] for x in parts], 3), torch.cat([x[1] for x in parts], 3))
    kw, vw = _kv(f, w)
    add, has_key = _mask(f, w)
    count(runs=1, windowed=1, masked_runs=int(add is not None))
    o, lse = _flash(_rows(f.q, w, n_q), kw, vw, attn_mask=add, scale=p.scale)
    lse = lse.to(o.dtype)
    if has_key is not None:
        lse = torch.where(has_key, lse, torch.full_like(lse, -math.inf))
    out = _unrows(o, B, hkv, g, w, n_q)
    lse = _unrows(lse.unsqueeze(-1), B, hkv, g, w, n_q).squeeze(-1)
    return out.contiguous(), lse.contiguous()


# ---------------------------------------------------------------------------- backward
def _backward_split(f: Fused, w: Window, split: list[tuple[int, int, bool]],
                    out: torch.Tensor, lse_b: torch.Tensor, dout: torch.Tensor,
                    ) -> tuple[torch.Tensor, ...]:
    """Backward of a band-masked window schedule, one kernel call per block range."""
    p = f.p
    B, hkv, g, n_q, d = f.q.shape
    n_k = f.k.shape[2]
    dk = f.k.new_zeros(B, hkv, n_k + w.front + w.back, d)
    dv = f.v.new_zeros(B, hkv, n_k + w.front + w.back, d)
    dqs = []
    for i_lo, i_hi, interior in split:
        r0, r1 = i_lo * w.bq, min(i_hi * w.bq, n_q)
        kw, vw, add, _, wr, s0 = _range_inputs(f, w, i_lo, i_hi, interior)
        rows = r1 - r0

        def sub(t: torch.Tensor, r0: int = r0, r1: int = r1, wr: Window = wr,
                rows: int = rows) -> torch.Tensor:
            return _rows(t[:, :, :, r0:r1], wr, rows)

        lse_w = sub(lse_b.unsqueeze(-1)).squeeze(-1)
        gq, gk, gv = _flash_bwd(sub(dout), sub(f.q), kw, vw, sub(out), lse_w, 0.0, False,
                                attn_mask=add, scale=p.scale)
        dqs.append(_unrows(gq, B, hkv, g, wr, rows))
        # window j of this range starts at absolute key s0 + j·bq (padded: + w.front)
        flat = (torch.arange(wr.nb).view(-1, 1) * w.bq + (s0 + w.front)
                + torch.arange(w.lw).view(1, -1)).reshape(-1)
        dk.index_add_(2, flat, gk.reshape(B, hkv, wr.nb * w.lw, d))
        dv.index_add_(2, flat, gv.reshape(B, hkv, wr.nb * w.lw, d))
    dq = torch.cat(dqs, 3) if len(dqs) > 1 else dqs[0].contiguous()
    return dq, dk[:, :, w.front:w.front + n_k], dv[:, :, w.front:w.front + n_k]


def backward(f: Fused, w: Window, out: torch.Tensor, lse: torch.Tensor,
             dout: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """FlashAttention-2 backward of the window schedule → dq, dk, dv (layouts of q, k, v)."""
    p = f.p
    B, hkv, g, n_q, d = f.q.shape
    # an empty row has lse −∞; +∞ makes every exp(s − lse) exactly 0 there
    lse_b = torch.where(lse == -math.inf, torch.full_like(lse, math.inf), lse)
    if lse_b.dtype != torch.float64:
        lse_b = lse_b.float()
    split = _split(f, w)
    if split is not None:
        return _backward_split(f, w, split, out, lse_b, dout)
    kw, vw = _kv(f, w)
    add, _ = _mask(f, w)
    lse_w = _rows(lse_b.unsqueeze(-1), w, n_q).squeeze(-1)
    gq, gk, gv = _flash_bwd(_rows(dout, w, n_q), _rows(f.q, w, n_q), kw, vw,
                            _rows(out, w, n_q), lse_w, 0.0, False, attn_mask=add,
                            scale=p.scale)
    dq = _unrows(gq, B, hkv, g, w, n_q)
    n_k = f.k.shape[2]
    n_p = n_k + w.front + w.back
    # window j of block i is padded row i·bq + off + front + j: overlapping windows add up
    flat = (torch.arange(w.nb).view(-1, 1) * w.bq + (w.off + w.front)
            + torch.arange(w.lw).view(1, -1)).reshape(-1)
    dk = f.k.new_zeros(B, hkv, n_p, d).index_add_(2, flat, gk.reshape(B, hkv, w.nb * w.lw, d))
    dv = f.v.new_zeros(B, hkv, n_p, d).index_add_(2, flat, gv.reshape(B, hkv, w.nb * w.lw, d))
    return dq.contiguous(), dk[:, :, w.front:w.front + n_k], dv[:, :, w.front:w.front + n_k]
