"""The general engine: batched matmuls with an online softmax, and its backward.

Used for softcap, score_mod, dropout and a bias that needs a gradient (the fused kernel has
no hook for them). Per query block, key chunks of at most ``chunk_k`` keys are batched
matmuls with an online softmax (running max, running sum, rescaled accumulator), scores
modified per tile, in place when nothing is recorded.

Backward: a hand-written FlashAttention-2 pass inside a :class:`torch.autograd.Function`
(softcap's derivative by formula, score_mod's by autograd on the tile) — or, when score_mod
closes over tensors that need gradients, when a bias needs one, or with dropout, each query
block is recomputed by ``torch.utils.checkpoint`` so those gradients flow through autograd
and dropout's mask is regenerated from the saved RNG state.

A score_mod first goes to :mod:`.compiled` (its tiles' elementwise part fused by
``torch.compile``, forward and backward); this module's loop is the path when that is off
(``ATTNKIT_COMPILE=0``), not yet worth compiling, failed, or not applicable (a score_mod
closing over tensors that need gradients, dropout, a bias with grad).

K/V of batch 1 broadcast over the queries' batch (``attention()`` passes them as stride-0
views) are read as ``(H_kv, N_k, ·)``, never copied per batch element: every matmul against
them is one batched matmul over the K/V heads per batch element (one over all rows
``B·G·bq`` when H_kv = 1), and their gradients sum over the batch in the same matmuls
(:mod:`.matmul`, shared with :mod:`.compiled`).

Shape legend::

    q (B, H_kv, G, N_q, D_k) pre-scaled     k (B·H_kv, N_k, D_k)     v (B·H_kv, N_k, D_v)
                                            (shared K/V: k (H_kv, N_k, D_k), v (H_kv, N_k, D_v))
    query block  qb (B·H_kv, G·bq, D_k)     scores of a chunk (B, H_q, bq, L), L ≤ chunk_k
    out (B, H_q, N_q, D_v)                  lse (B, H_q, N_q)

Caution
-------
- The gradient of shared K/V reaches them through autograd's slice of the broadcast view,
  which allocates one ``(B, H_kv, N_k, D)`` gradient before summing it (backward only).
"""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

from ..._shapes import broadcast_shapes
from ...scores import soft_cap, soft_cap_, soft_cap_grad
from ..base import Problem, compute_dtype, finish, refuse_double_backward, softmax_shift
from . import compiled
from .counters import count
from .matmul import add_tmm_, addmm_, mm, shared_kv
from .plan import Block, Plan, allowed_tile, backward_rows, bias_tile, plan
from .sizes import sizes

__all__ = ["general_attention"]

# Score elements one general-engine step may hold (a block's recompute holds a few such).
_BUDGET = 1 << 22


def _block(p: Problem, blk: Block, chunk_k: int, qb: torch.Tensor, k: torch.Tensor,
           v: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One query block, online softmax over key chunks.

    ``qb (B·H_kv, G·bq, D_k)`` pre-scaled, ``k (B·H_kv | H_kv, N_k, D_k)``,
    ``v (B·H_kv | H_kv, N_k, D_v)`` → ``out (B, H_q, bq, D_v)``, ``lse (B, H_q, bq)``.
    """
    B, hq, hkv, g = p.batch, p.heads_q, p.heads_kv, p.group
    q0, q1 = blk.q0, blk.q1
    bq = q1 - q0
    dev = qb.device
    bi = torch.arange(B, device=dev).view(-1, 1, 1, 1)
    hi = torch.arange(hq, device=dev).view(1, -1, 1, 1)
    qi = torch.arange(q0, q1, device=dev).view(1, 1, -1, 1)
    m = torch.full((B, hq, bq, 1), -math.inf, dtype=qb.dtype, device=dev)      # running max
    lsum = torch.zeros((B, hq, bq, 1), dtype=qb.dtype, device=dev)           # running sum
    acc = torch.zeros((B * hkv, g * bq, v.shape[-1]), dtype=qb.dtype, device=dev)
    ip = not torch.is_grad_enabled()          # nothing recorded: work in place on the tile
    # in place, every chunk's scores reuse one buffer (a fresh 16 MB tensor per chunk costs
    # its page faults every time)
    longest = max(min(chunk_k, r.k1 - r.k0) for r in blk.runs) if blk.runs else 0
    scratch = qb.new_empty(B * hkv * g * bq * longest) if ip else None
    for run in blk.runs:
        for k0 in range(run.k0, run.k1, chunk_k):
            k1 = min(k0 + chunk_k, run.k1)
            count(runs=1)
            kt = k[:, k0:k1].transpose(1, 2)                    # (B·H_kv | H_kv, D_k, L)
            s = (mm(qb, kt) if scratch is None else mm(               # (B·H_kv, G·bq, L)
                qb, kt, out=scratch[: B * hkv * g * bq * (k1 - k0)].view(B * hkv, g * bq,
                                                                          k1 - k0)))
            x = s.view(B, hq, bq, k1 - k0)                            # (B, H_q, bq, L)
            if p.softcap is not None:                                   # c·tanh(x/c)
                x = soft_cap_(x, p.softcap) if ip else soft_cap(x, p.softcap)
            if p.score_mod is not None:
                ki = torch.arange(k0, k1, device=dev).view(1, 1, 1, -1)
                x = p.score_mod(x, bi, hi, qi, ki)
            if bias is not None:
                bt = bias_tile(bias, q0, q1, k0, k1)
                x = x.add_(bt) if ip and x.shape == broadcast_shapes(x.shape, bt.shape) \
                    else x + bt
            if run.masked and p.mask is not None:
                allowed = allowed_tile(p, q0, q1, k0, k1)              # (B|1, H_q|1, bq, L)
                x = x.masked_fill_(~allowed, -math.inf) if ip else x.masked_fill(~allowed,
                                                                                 -math.inf)
            m_new = torch.maximum(m, x.detach().amax(-1, keepdim=True))  # (B, H_q, bq, 1)
            shift = softmax_shift(m_new)
            alpha = torch.exp(m - shift)                              # rescales the past
            e = x.sub_(shift).exp_() if ip else torch.exp(x - shift)  # (B, H_q, bq, L)
            lsum = lsum * alpha + e.sum(-1, keepdim=True)
            if p.dropout_p > 0.0:
                keep = torch.rand(e.shape, device=dev) >= p.dropout_p
                e = torch.where(keep, e * (1.0 / (1.0 - p.dropout_p)), torch.zeros_like(e))
            a = alpha.view(B * hkv, g * bq, 1)
            e2 = e.reshape(B * hkv, g * bq, k1 - k0)                  # (B·H_kv, G·bq, L)
            if ip:
                acc = addmm_(acc.mul_(a), e2, v[:, k0:k1])
            elif v.shape[0] == e2.shape[0]:
                acc = torch.baddbmm(acc * a, e2, v[:, k0:k1])
            else:                                                     # shared V
                acc = acc * a + mm(e2, v[:, k0:k1])
            m = m_new
    return finish(acc.view(B, hq, bq, -1), lsum.squeeze(-1), softmax_shift(m).squeeze(-1))


def _forward(p: Problem, pl: Plan, chunk: int, q: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every block of ``pl`` without recording → out (B, H_q, N_q, D_v), lse (B, H_q, N_q)."""
    B, hkv, g = p.batch, p.heads_kv, p.group
    out = q.new_zeros(B, p.heads_q, p.n_q, p.d_v)
    lse = torch.full((B, p.heads_q, p.n_q), -math.inf, dtype=q.dtype)
    for blk in pl.blocks:
        if blk.runs:
            qb = q[:, :, :, blk.q0:blk.q1].reshape(B * hkv, g * blk.rows, p.d_k)
            o, l_ = _block(p, blk, chunk, qb, k, v, bias)
            out[:, :, blk.q0:blk.q1] = o
            lse[:, :, blk.q0:blk.q1] = l_
    return out, lse


def _pure_score_mod(p: Problem) -> bool:
    """True without a score_mod, or when it closes over no tensor that requires grad
    (probed on one score): then the hand-written backward may differentiate it per tile."""
    if p.score_mod is None:
        return True
    with torch.enable_grad():
        z = torch.zeros(1, 1, 1, 1, dtype=compute_dtype(p.dtype))
        i = torch.zeros(1, 1, 1, 1, dtype=torch.long)
        y = p.score_mod(z, i, i, i, i)
    return not (isinstance(y, torch.Tensor) and y.requires_grad)


class _ManualAttention(torch.autograd.Function):
    """The general engine with a hand-written FlashAttention-2 backward (softcap, masks, a
    bias without grad, a score_mod without tensors of its own that need grad; no dropout):
    per chunk, recompute the logits, take ``P = exp(logits − lse)`` with the saved LSE, and
    form dV, dP, dS and dQ, dK from them (score_mod differentiated by autograd on the tile).

    ``q (B, H_kv, G, N_q, D_k)`` is pre-scaled; ``k (B·H_kv | H_kv, N_k, D_k)``,
    ``v (B·H_kv | H_kv, N_k, D_v)`` (H_kv: shared over the batch; dK, dV sum over it).
    """

    @staticmethod
    def forward(ctx, q, k, v, meta):  # noqa: ANN001, ANN205
        p, pl, chunk, bias = meta
        out, lse = _forward(p, pl, chunk, q, k, v, bias)
        ctx.meta = meta
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):  # noqa: ANN001, ANN205
        refuse_double_backward("tiled")
        q, k, v, out, lse = ctx.saved_tensors
        p, pl, chunk, bias = ctx.meta
        B, hq, hkv, g = p.batch, p.heads_q, p.heads_kv, p.group
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        dcol, lse_b = backward_rows(dout, out, lse, dlse)        # (B, H_q, N_q, 1) each
        c = p.softcap
        bi = torch.arange(B).view(-1, 1, 1, 1)
        hi = torch.arange(hq).view(1, -1, 1, 1)
        for blk in pl.blocks:
            if not blk.runs:
                continue
            q0, q1 = blk.q0, blk.q1
            bq = q1 - q0
            qb = q[:, :, :, q0:q1].reshape(B * hkv, g * bq, p.d_k)
            dob = dout[:, :, q0:q1].reshape(B * hkv, g * bq, p.d_v)
            lb, db = lse_b[:, :, q0:q1], dcol[:, :, q0:q1]       # (B, H_q, bq, 1)
            dqb = torch.zeros_like(qb)
            for run in blk.runs:
                for k0 in range(run.k0, run.k1, chunk):
                    k1 = min(k0 + chunk, run.k1)
                    L = k1 - k0
                    x = mm(qb, k[:, k0:k1].transpose(1, 2)).view(B, hq, bq, L)
                    dcap = y = xr = None
                    if c is not None:
                        x = soft_cap_(x, c)                       # c·tanh(x/c), in place
                        dcap = soft_cap_grad(x, c)                # 1 − tanh²(x/c), kept
                    if p.score_mod is not None:                   # autograd on the tile
                        with torch.enable_grad():
                            xr = x.detach().requires_grad_(True)
                            y = p.score_mod(xr, bi, hi, torch.arange(q0, q1).view(1, 1, -1, 1),
                                            torch.arange(k0, k1).view(1, 1, 1, -1))
                        x = y.detach().clone()
                    if bias is not None:
                        x = x + bias_tile(bias, q0, q1, k0, k1)
                    if run.masked and p.mask is not None:
                        x = x.masked_fill_(~allowed_tile(p, q0, q1, k0, k1), -math.inf)
                    pr = x.sub_(lb).exp_()                        # (B, H_q, bq, L) probabilities
                    p2 = pr.view(B * hkv, g * bq, L)
                    add_tmm_(dv[:, k0:k1], p2, dob)              # dV += Pᵀ dO
                    dp = mm(dob, v[:, k0:k1].transpose(1, 2)).view(B, hq, bq, L)
                    ds = dp.sub_(db).mul_(pr)
                    if y is not None and xr is not None:
                        (ds,) = torch.autograd.grad(y, xr, ds)
                    if dcap is not None:
                        ds.mul_(dcap)                             # × (1 − tanh²)
                    ds2 = ds.view(B * hkv, g * bq, L)
                    addmm_(dqb, ds2, k[:, k0:k1])                 # dQ += dS K
                    add_tmm_(dk[:, k0:k1], ds2, qb)              # dK += dSᵀ Q
            dq[:, :, :, q0:q1] = dqb.view(B, hkv, g, bq, p.d_k)
        return dq, dk, dv, None


class _FirstOrderOnly(torch.autograd.Function):
    """Identity on ``(out, lse)`` whose backward refuses second derivatives: the checkpointed
    path's recomputation is first-order only, like the hand-written backwards."""

    @staticmethod
    def forward(ctx, out, lse):  # noqa: ANN001, ANN205
        return out.view_as(out), lse.view_as(lse)

    @staticmethod
    def backward(ctx, dout, dlse):  # noqa: ANN001, ANN205
        refuse_double_backward("tiled")
        return dout, dlse


def general_attention(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """``p`` on the general engine → out ``(B, H_q, N_q, D_v)`` in p's dtype,
    lse ``(B, H_q, N_q)``."""
    acc = compute_dtype(p.dtype)
    B, hkv, g = p.batch, p.heads_kv, p.group
    q = (p.q.to(acc) * p.scale).view(B, hkv, g, p.n_q, p.d_k)
    k = shared_kv(p.k, acc)                    # (B·H_kv | H_kv, N_k, D_k), H_kv: shared
    v = shared_kv(p.v, acc)                    # (B·H_kv | H_kv, N_k, D_v)
    bias = p.bias.to(acc) if p.bias is not None else None
    # rows per block and keys per chunk within a budget of score elements per step; a
    # checkpointed block (score_mod, dropout, bias with grad) holds its whole key range
    manual = _pure_score_mod(p) and p.dropout_p == 0.0 and not (
        p.bias is not None and p.bias.requires_grad)
    sz = sizes()
    span = sz.chunk_k if manual else p.n_k
    rows = max(16, min(sz.general_block_q, _BUDGET // (B * p.heads_q * span)))
    pl = plan(p, block_q=rows, coarsen=False)
    count(tiles=pl.tiles, empty=pl.empty, full=pl.full, partial=pl.partial)
    chunk = max(16, min(sz.chunk_k, _BUDGET // (B * p.heads_q * rows)))
    # score_mod may close over tensors that require grad: recompute whenever autograd records
    grad = torch.is_grad_enabled()
    if p.score_mod is not None and p.dropout_p == 0.0 and (manual or not grad) and not (
            bias is not None and bias.requires_grad):
        done = compiled.attention(p, pl, chunk, q, k, v, bias)   # None: the current path
        if done is not None:
            return done[0].to(p.dtype), done[1]
    if grad and manual:
        out, lse = _ManualAttention.apply(q, k, v, (p, pl, chunk, bias))
        return out.to(p.dtype), lse
    outs, lses = [], []
    for blk in pl.blocks:
        bq = blk.rows
        qb = q[:, :, :, blk.q0:blk.q1].reshape(B * hkv, g * bq, p.d_k)
        if not blk.runs:
            o = torch.zeros(B, p.heads_q, bq, p.d_v, dtype=acc) + 0.0 * qb.sum()
            lse_b = torch.full((B, p.heads_q, bq), -math.inf, dtype=acc)
        elif grad:
            o, lse_b = checkpoint(_block, p, blk, chunk, qb, k, v, bias, use_reentrant=False)
        else:
            o, lse_b = _block(p, blk, chunk, qb, k, v, bias)
        outs.append(o)
        lses.append(lse_b)
    out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
    if grad and (out.requires_grad or lse.requires_grad):
        out, lse = _FirstOrderOnly.apply(out, lse)
    return out.to(p.dtype), lse
