"""The fused-kernel engine: torch's fused CPU flash kernel per run, and its backward.

Used without softcap / score_mod / dropout and without a bias that needs a gradient. Each
run of the plan is one call of ``_scaled_dot_product_flash_attention_for_cpu`` on its key
range, given the run's additive mask tile (or ``is_causal`` for a causal diagonal square);
the runs of a query block are merged by their log-sum-exp (:func:`~..base.merge_partials`,
in place). When the plan is a windowed schedule (see :mod:`.windowed`), all query blocks go
into one kernel call instead.

Backward is FlashAttention-2 style inside a :class:`torch.autograd.Function`: each run is
recomputed by torch's fused CPU flash backward, fed the *final* output and LSE of its rows
— with the global LSE the run's probabilities are the global ones, so its ``dq`` part and
its ``dk``/``dv`` slice are exact and simply add up.

Shape legend::

    q (B, H_kv, G, N_q, D)   k, v (B, H_kv, N_k, D)   D = max(D_k, D_v) (narrower zero-padded)
    query block              (B, H_kv, G·bq, D)        additive mask (B|1, H_kv|1, G·bq, L)
    out (B, H_kv, G, N_q, D) lse (B, H_kv, G, N_q)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ... import _compat
from ..base import Problem, compute_dtype, merge_partials, refuse_double_backward
from . import windowed
from .counters import count
from .plan import (
    Plan,
    Run,
    allowed_tile,
    band_is_tril,
    bias_tile,
    plan,
    tile_is_tril,
    tile_map,
    to_grouped,
)
from .sizes import sizes

__all__ = ["Fused", "fused_attention"]

_flash = _compat.flash_cpu
_flash_bwd = _compat.flash_cpu_backward


@dataclass
class Fused:
    """What one fused call needs, in the grouped layout (see the module legend)."""

    p: Problem
    pl: Plan
    q: torch.Tensor       # (B, H_kv, G, N_q, D)   compute dtype, D padded
    k: torch.Tensor       # (B, H_kv, N_k, D)
    v: torch.Tensor       # (B, H_kv, N_k, D)
    bias: torch.Tensor | None
    win: windowed.Window | None = None


def _run_mask(f: Fused, q0: int, q1: int, run: Run) -> tuple[torch.Tensor | None, bool,
                                                               torch.Tensor | None]:
    """→ (additive float mask in grouped rows or None, is_causal, rows-with-a-key or None)."""
    p = f.p
    if not run.masked:
        return None, False, None
    g = p.group
    if (p.mask is not None and f.bias is None and g == 1
            and band_is_tril(p, q0, q1, run.k0, run.k1)):
        return None, True, None                              # known without evaluating
    allowed = allowed_tile(p, q0, q1, run.k0, run.k1) if p.mask is not None else None
    if allowed is not None and f.bias is None and g == 1 and tile_is_tril(allowed):
        return None, True, None
    dt = f.q.dtype
    shape = (q1 - q0, run.k1 - run.k0)
    if allowed is not None:
        add = torch.zeros(allowed.shape, dtype=dt).masked_fill_(~allowed, -math.inf)
    else:
        add = torch.zeros(1, 1, *shape, dtype=dt)
    if f.bias is not None:
        add = add + bias_tile(f.bias, q0, q1, run.k0, run.k1)
        add = add.expand(*add.shape[:2], *shape)
    has_key = to_grouped(allowed.any(-1), g, p.heads_kv) if allowed is not None else None
    return to_grouped(add, g, p.heads_kv).contiguous(), False, has_key


def _forward(f: Fused) -> tuple[torch.Tensor, torch.Tensor]:
    """→ out (B, H_kv, G, N_q, D), lse (B, H_kv, G, N_q) in the compute dtype."""
    if f.win is not None:
        return windowed.forward(f, f.win)
    p = f.p
    B, hkv, g, n_q, d = f.q.shape
    blocks = f.pl.blocks
    one = len(blocks) == 1 and blocks[0].runs                # one block with runs: no copy
    out = None if one else f.q.new_empty(B, hkv, g, n_q, d)
    lse = None if one else f.q.new_empty(B, hkv, g, n_q)
    for blk in blocks:
        q0, q1 = blk.q0, blk.q1
        if not blk.runs:
            assert out is not None and lse is not None
            out[:, :, :, q0:q1] = 0.0
            lse[:, :, :, q0:q1] = -math.inf
            continue
        bq = q1 - q0
        qb = f.q[:, :, :, q0:q1].reshape(B, hkv, g * bq, d)     # (B, H_kv, G·bq, D)
        parts = []
        for run in blk.runs:
            add, causal, has_key = _run_mask(f, q0, q1, run)
            count(runs=1, causal_runs=int(causal), masked_runs=int(add is not None))
            o, lse_r = _flash(qb, f.k[:, :, run.k0:run.k1], f.v[:, :, run.k0:run.k1],
                              is_causal=causal, attn_mask=add, scale=p.scale)
            if has_key is not None:                          # rows with no key: lse −∞
                lse_r = torch.where(has_key, lse_r, torch.full_like(lse_r, -math.inf))
            parts.append((o, lse_r.to(o.dtype)))
        o, l_ = merge_partials(parts, inplace=True)          # (B, H_kv, G·bq, D), (…, G·bq)
        if out is None or lse is None:
            return o.view(B, hkv, g, bq, d), l_.view(B, hkv, g, bq)
        out[:, :, :, q0:q1] = o.view(B, hkv, g, bq, d)
        lse[:, :, :, q0:q1] = l_.view(B, hkv, g, bq)
    assert out is not None and lse is not None
    return out, lse


def _backward(f: Fused, out: torch.Tensor, lse: torch.Tensor,
              dout: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """FlashAttention-2 style: recompute each run with the final out/LSE of its rows."""
    if f.win is not None:
        return windowed.backward(f, f.win, out, lse, dout)
    p = f.p
    B, hkv, g, n_q, d = f.q.shape
    blocks = f.pl.blocks
    single = (len(blocks) == 1 and len(blocks[0].runs) == 1
              and blocks[0].runs[0].k0 == 0 and blocks[0].runs[0].k1 == f.k.shape[2])
    # one run over everything: the kernel's gradients are the answer (no accumulators)
    dq = None if single else torch.zeros_like(f.q)
    dk = None if single else torch.zeros(f.k.shape, dtype=f.k.dtype)
    dv = None if single else torch.zeros(f.v.shape, dtype=f.v.dtype)
    # an empty row has lse −∞; +∞ makes every exp(s − lse) exactly 0 there
    lse_b = torch.where(lse == -math.inf, torch.full_like(lse, math.inf), lse)
    for blk in blocks:
        if not blk.runs:
            continue
        q0, q1 = blk.q0, blk.q1
        bq = q1 - q0
        qb = f.q[:, :, :, q0:q1].reshape(B, hkv, g * bq, d)     # (B, H_kv, G·bq, D)
        ob = out[:, :, :, q0:q1].reshape(B, hkv, g * bq, d)
        dob = dout[:, :, :, q0:q1].reshape(B, hkv, g * bq, d)
        lb = lse_b[:, :, :, q0:q1].reshape(B, hkv, g * bq)       # (B, H_kv, G·bq)
        if lb.dtype != torch.float64:
            lb = lb.float()
        dqb = None
        for run in blk.runs:
            add, causal, _ = _run_mask(f, q0, q1, run)
            gq, gk, gv = _flash_bwd(dob, qb, f.k[:, :, run.k0:run.k1],
                                    f.v[:, :, run.k0:run.k1], ob, lb, 0.0, causal,
                                    attn_mask=add, scale=p.scale)
            if dq is None or dk is None or dv is None:
                return gq.view(B, hkv, g, n_q, d), gk, gv
            dqb = gq if dqb is None else dqb.add_(gq)
            dk[:, :, run.k0:run.k1] += gk
            dv[:, :, run.k0:run.k1] += gv
        if dqb is not None and dq is not None:
            dq[:, :, :, q0:q1] = dqb.view(B, hkv, g, bq, d)
    assert dq is not None and dk is not None and dv is not None
    return dq, dk, dv


class _FusedAttention(torch.autograd.Function):
    """out, lse = attention(q, k, v) on the fused engine; backward recomputes per run."""

    @staticmethod
    def forward(ctx, q, k, v, f):  # noqa: ANN001, ANN205
        f = Fused(f.p, f.pl, q, k, v, f.bias, f.win)
        out, lse = _forward(f)
        ctx.f = f
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):  # noqa: ANN001, ANN205
        refuse_double_backward("tiled")
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        lse_grad = dlse is not None and bool((dlse != 0).any())
        if lse_grad:
            # ∂lse/∂logits = P, so dS = P∘(dP − D + dlse): the kernel's D = rowsum(dO∘O) gets
            # −dlse from one extra column (dO: −dlse, O: 1) whose V and Q/K columns are zero
            dl = torch.where(torch.isfinite(lse), dlse, torch.zeros_like(dlse)).to(dout.dtype)
            q, k, v = (F.pad(t, (0, 1)) for t in (q, k, v))
            out = torch.cat([out, torch.ones_like(out[..., :1])], -1)
            dout = torch.cat([dout, -dl.unsqueeze(-1)], -1)
        f = Fused(ctx.f.p, ctx.f.pl, q, k, v, ctx.f.bias, ctx.f.win)
        dq, dk, dv = _backward(f, out, lse, dout)
        if lse_grad:
            dq, dk, dv = dq[..., :-1], dk[..., :-1], dv[..., :-1]
        return dq, dk, dv, None


def fused_attention(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """``p`` on the fused engine → out ``(B, H_q, N_q, D_v)`` in p's dtype,
    lse ``(B, H_q, N_q)``."""
    acc = compute_dtype(p.dtype)
    B, hkv, g = p.batch, p.heads_kv, p.group
    d = max(p.d_k, p.d_v)
    # the fused kernel reads rows through strides but needs unit stride along D
    q, k, v = (t.to(acc) if t.stride(-1) == 1 else t.to(acc).contiguous()
               for t in (p.q, p.k, p.v))
    if p.d_k < d:           # zero columns change no dot product
        q, k = F.pad(q, (0, d - p.d_k)), F.pad(k, (0, d - p.d_k))
    if p.d_v < d:           # zero value columns give zero output columns, cut off below
        v = F.pad(v, (0, d - p.d_v))
    q = q.view(B, hkv, g, p.n_q, d)
    bias = p.bias.to(acc) if p.bias is not None else None
    pl, win, tiles = None, None, None
    if p.mask is not None and bias is None and not band_is_tril(p, 0, p.n_q, 0, p.n_k):
        # the one block map of this call; then the cheapest windowed schedule over query
        # blocks of 1, 2, 4, 8 × block_q rows, if any
        sz = sizes()
        tiles = tile_map(p, sz.block_q, sz.block_k)
        best = None
        for factor in (1, 2, 4, 8):
            cand = plan(p, coarsen=False, factor=factor, tiles=tiles)
            w_ = windowed.window_of(p, cand)
            if w_ is not None and (best is None or w_.nb * w_.bq * w_.lw
                                   < 0.95 * best[1].nb * best[1].bq * best[1].lw):
                best = (cand, w_)
        if best is not None:
            pl, win = best
    if pl is None:
        pl = plan(p, tiles=tiles)
    count(tiles=pl.tiles, empty=pl.empty, full=pl.full, partial=pl.partial)
    f = Fused(p, pl, q, k, v, bias, win)
    if p.requires_grad:
        out, lse = _FusedAttention.apply(q, k, v, f)
    else:
        out, lse = _forward(f)
    out = out.reshape(B, p.heads_q, p.n_q, d)[..., : p.d_v]
    return out.to(p.dtype), lse.reshape(B, p.heads_q, p.n_q)
