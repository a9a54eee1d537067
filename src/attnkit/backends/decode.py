"""Decoding: a few queries over a long K/V cache, split over the keys (flash-decoding).

A call goes to the native kernel's decode path (``native.decode``: keys split across
cores, the G query heads of a K/V head read each K/V row once, float16/bfloat16 caches read
as such) when it is available and supports the call (``tiled.native_reasons``); otherwise
to the Python engine described here.

With one (or a handful of) queries, the work is one pass over K and V. The keys are split
into ``C`` chunks of ``L`` keys; every chunk computes its own softmax pieces — running max
``m_c``, sum ``l_c`` and unnormalised output ``o_c`` — in one batched matmul over
(batch × K/V heads × chunks), and the chunks are merged by their log-sum-exp::

    out_c, lse_c = finish(o_c, l_c, m_c)            (base.finish: −∞-safe, NaN-propagating)
    lse = log Σ_c e^{lse_c}      out = Σ_c e^{lse_c − lse} out_c     (base.merge_stacked)

Without softcap/score_mod the chunks run as extra "heads" of torch's fused CPU flash kernel
(one pass over K and V, chunks in parallel, LSE returned); with them, as batched matmuls.
K and V are read in place (chunks are views, never copies); the query heads that share a K/V
head are stacked as rows (GQA without repeating K/V). K/V of batch 1 broadcast over the
queries' batch (stride-0 views from ``attention()``) are read once for all of it, never
copied per batch element: the batched matmuls take the batch's queries as more rows
``B·R`` of each K/V head, and the fused kernel reads the stride-0 view as it is.

Shape legend::

    q (B, H_q, N_q, D_k)  N_q ≤ 16        k (B, H_kv, N_k, D_k)     v (B, H_kv, N_k, D_v)
    grouped queries       (B, H_kv, 1, R, D_k)      R = G · N_q rows per K/V head
    chunked keys          (B, H_kv, C, L, D_k)      scores (B, H_kv, C, R, L)
    shared K/V (batch 1)  k (1, H_kv, N_k, D_k)     rows of a head (H_kv, B·R, ·)
    out (B, H_q, N_q, D_v)                          lse (B, H_q, N_q)

Caution
-------
- Forward only: a call that needs gradients is declined (``not_supported_reasons``) and
  ``backend="auto"`` gives it to the ``tiled`` engine.
- Dropout is declined (decoding is inference).
- The native kernel runs the call under the same conditions as in ``tiled`` (see its
  Caution: CPU, float32/bfloat16/float16, a score_mod only if ALiBi by spec, not
  ``ATTNKIT_NATIVE=0`` nor ``tiled.use_native(False)``); it reads half-precision caches in
  place. On the Python engine, float16/bfloat16 K/V are cast to float32 once per call (a copy
  of the cache, of batch 1 for shared K/V): that engine is tuned for float32 caches.
- Masks are evaluated densely on ``N_q × N_k`` with ``Mask.evaluate`` (tiny for ≤ 16
  queries); chunks with no allowed key are computed anyway (their weight is exactly 0).
- A query row holding NaN/inf is computed on the batched-matmul path (IEEE arithmetic, as in
  the reference: NaN output and LSE where it attends), not in torch's fused kernel.
"""

from __future__ import annotations

import math

import torch

from .. import _compat
from ..scores import soft_cap
from . import native
from .base import (
    Backend,
    Capabilities,
    Problem,
    compute_dtype,
    finish,
    merge_stacked,
    softmax_shift,
)
from .tiled import native_reasons
from .tiled.counters import count

__all__ = ["DecodeBackend", "MAX_QUERIES", "chunk_count"]

MAX_QUERIES = 16
# Keys per chunk: big enough for efficient matmuls, small enough for many parallel chunks.
_CHUNK = 1024
_flash = _compat.flash_cpu


def chunk_count(n_k: int, chunk: int | None = None) -> int:
    """Number of key chunks for ``n_k`` keys (1 for short caches)."""
    return max(1, n_k // (chunk or _CHUNK))


def _grouped_allowed(p: Problem) -> torch.Tensor | None:
    """The mask as grouped rows ``(B|1, H_kv|1, R, N_k)`` bool, or None (all allowed)."""
    if p.mask is None:
        return None
    hkv, g, r = p.heads_kv, p.group, p.group * p.n_q
    a = p.mask.evaluate(p.n_q, p.n_k, batch=p.batch, heads=p.heads_q,
                        device=p.device)                            # (B|1, H_q|1, N_q, N_k)
    if a.shape[1] == 1:
        return a.repeat(1, 1, g, 1)                                 # (B|1, 1, R, N_k)
    return a.reshape(a.shape[0], hkv, r, p.n_k)                     # (B|1, H_kv, R, N_k)


def _decode(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    acc = compute_dtype(p.dtype)
    B, hkv, g, n_q = p.batch, p.heads_kv, p.group, p.n_q
    r = g * n_q
    q = (p.q.to(acc) * p.scale).reshape(B, hkv, 1, r, p.d_k)      # (B, H_kv, 1, R, D_k)
    shared = B > 1 and p.k.stride(0) == 0 and p.v.stride(0) == 0   # K/V of batch 1
    k, v = (p.k[:1].to(acc), p.v[:1].to(acc)) if shared else (p.k.to(acc), p.v.to(acc))
    c = chunk_count(p.n_k)
    main = c * (p.n_k // c)
    allowed = _grouped_allowed(p)
    bias = None
    if p.bias is not None:
        bb = p.bias.to(acc).expand(B, p.heads_q, n_q, p.n_k)
        bias = bb.reshape(B, hkv, r, p.n_k)                           # (B, H_kv, R, N_k)

    fused = p.softcap is None and p.score_mod is None and p.d_k == p.d_v
    if fused and bool(torch.isfinite(q).all()):
        out, lse = _fused_chunks(q.view(B, hkv, r, p.d_k), k, v, c, allowed, bias)
    else:
        parts = [_pieces(p, q, k, v, 0, main, c, allowed, bias)]
        if main < p.n_k:
            parts.append(_pieces(p, q, k, v, main, p.n_k, 1, allowed, bias))
        o = torch.cat([x[0] for x in parts], 2)                       # (B, H_kv, C', R, D_v)
        lse_c = torch.cat([x[1] for x in parts], 2)                   # (B, H_kv, C', R)
        out, lse = merge_stacked(o, lse_c, dim=2)                     # (B, H_kv, R, D_v)
    out = out.reshape(B, p.heads_q, n_q, p.d_v).to(p.dtype)
    return out, lse.reshape(B, p.heads_q, n_q)


def _pieces(p: Problem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k0: int, k1: int,
            n_chunks: int, allowed: torch.Tensor | None, bias: torch.Tensor | None,
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys [k0, k1) cut into ``n_chunks`` equal chunks, each finished on its own:
    → out ``(B, H_kv, C, R, D_v)``, lse ``(B, H_kv, C, R)`` (batched matmuls)."""
    B, hkv, g, n_q, dev = p.batch, p.heads_kv, p.group, p.n_q, p.device
    r = g * n_q
    length = (k1 - k0) // n_chunks
    shared = k.shape[0] == 1 and B > 1                                 # K/V of batch 1
    if shared:                     # the batch's queries as rows of each K/V head
        qf = q.reshape(B, hkv, r, p.d_k).transpose(0, 1).reshape(hkv, B * r, p.d_k)
        s = torch.matmul(qf, k[0, :, k0:k1].transpose(-1, -2))         # (H_kv, B·R, keys)
        s = s.view(hkv, B, r, n_chunks, length).permute(1, 0, 3, 2, 4)  # (B, H_kv, C, R, L)
    else:
        kc = k[:, :, k0:k1].reshape(B, hkv, n_chunks, length, p.d_k)  # view when possible
        s = torch.matmul(q, kc.transpose(-1, -2))                      # (B, H_kv, C, R, L)
    if p.softcap is not None or p.score_mod is not None:
        # to the (B, H_q, N_q, keys) frame score mods are written for, and back
        x = s.view(B, hkv, n_chunks, g, n_q, length).permute(0, 1, 3, 4, 2, 5)
        x = x.reshape(B, p.heads_q, n_q, n_chunks * length)            # (B, H_q, N_q, keys)
        if p.softcap is not None:
            x = soft_cap(x, p.softcap)
        if p.score_mod is not None:
            x = p.score_mod(x, torch.arange(B, device=dev).view(-1, 1, 1, 1),
                            torch.arange(p.heads_q, device=dev).view(1, -1, 1, 1),
                            torch.arange(n_q, device=dev).view(1, 1, -1, 1),
                            torch.arange(k0, k1, device=dev).view(1, 1, 1, -1))
        x = x.reshape(B, hkv, g, n_q, n_chunks, length).permute(0, 1, 4, 2, 3, 5)
        s = x.reshape(B, hkv, n_chunks, r, length)                     # (B, H_kv, C, R, L)
    if bias is not None:
        s = s + bias[..., k0:k1].reshape(B, hkv, r, n_chunks, length).transpose(2, 3)
    if allowed is not None:
        al = allowed[..., k0:k1].reshape(*allowed.shape[:2], r, n_chunks, length)
        s = torch.where(al.transpose(2, 3), s, torch.full_like(s, -math.inf))
    m = softmax_shift(s.amax(-1))                                      # (B, H_kv, C, R)
    e = torch.exp(s - m.unsqueeze(-1))                                 # (B, H_kv, C, R, L)
    if shared:
        vc = v[0, :, k0:k1].reshape(hkv, n_chunks, length, p.d_v)      # (H_kv, C, L, D_v)
        ef = e.permute(1, 2, 0, 3, 4).reshape(hkv, n_chunks, B * r, length)
        o = torch.matmul(ef, vc).view(hkv, n_chunks, B, r, p.d_v)      # (H_kv, C, B, R, D_v)
        o = o.permute(2, 0, 1, 3, 4)                                   # (B, H_kv, C, R, D_v)
    else:
        vc = v[:, :, k0:k1].reshape(B, hkv, n_chunks, length, p.d_v)
        o = torch.matmul(e, vc)                                        # (B, H_kv, C, R, D_v)
    return finish(o, e.sum(-1), m)                                     # out_c, lse_c


def _fused_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: int,
                  allowed: torch.Tensor | None, bias: torch.Tensor | None,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunks as extra heads of torch's fused CPU flash kernel, merged by LSE.

    ``q (B, H_kv, R, D)`` pre-scaled and finite; keys ``[0, C·L)`` are viewed as
    ``(B, H_kv·C, L, D)`` (no copy), the rest is one more call. K/V of batch 1 (shared by
    the batch) are viewed so and expanded to B with stride 0: the kernel reads them as such.
    → out ``(B, H_kv, R, D_v)``, lse ``(B, H_kv, R)``.
    """
    B, hkv, r, d = q.shape
    n_k = k.shape[2]
    L = n_k // c
    main = c * L
    outs, lses = [], []
    for k0, k1, n_chunks in ((0, main, c), (main, n_k, 1)):
        if k1 <= k0:
            continue
        length = (k1 - k0) // n_chunks
        kc = k[:, :, k0:k1].reshape(-1, hkv * n_chunks, length, d).expand(B, -1, -1, -1)
        vc = v[:, :, k0:k1].reshape(-1, hkv * n_chunks, length, d).expand(B, -1, -1, -1)
        qc = q.repeat_interleave(n_chunks, dim=1)                       # (B, H_kv·C, R, D)
        add = has_key = None
        if allowed is not None or bias is not None:
            shape = (B, hkv, r, k1 - k0)
            add = torch.zeros((), dtype=q.dtype).expand(shape)
            if bias is not None:
                add = add + bias[..., k0:k1]
            if allowed is not None:
                al = allowed[..., k0:k1].expand(shape)
                add = add.masked_fill(~al, -math.inf)
                has_key = al.reshape(B, hkv, r, n_chunks, length).any(-1)   # (B, H_kv, R, C)
                has_key = has_key.transpose(2, 3).reshape(B, hkv * n_chunks, r)
            add = (add.reshape(B, hkv, r, n_chunks, length).transpose(2, 3)
                   .reshape(B, hkv * n_chunks, r, length))               # (B, H_kv·C, R, L)
        o, lse = _flash(qc, kc, vc, attn_mask=add, scale=1.0)           # (B, H_kv·C, R, D)
        lse = lse.to(q.dtype)                                           # (B, H_kv·C, R)
        if has_key is not None:
            # a chunk with no allowed key: the kernel gives output 0 (finite queries) but
            # LSE 0; make it −∞ so that the merge gives it no weight
            lse = lse.masked_fill(~has_key, -math.inf)
        outs.append(o.view(B, hkv, n_chunks, r, d))
        lses.append(lse.view(B, hkv, n_chunks, r))
    return merge_stacked(torch.cat(outs, 2), torch.cat(lses, 2), dim=2)


class DecodeBackend(Backend):
    """Few queries over a long K/V cache: key chunks in parallel, merged by LSE."""

    name = "decode"
    description = (f"CPU flash-decoding for <= {MAX_QUERIES} queries: key chunks in one batched "
                   "matmul, merged by log-sum-exp; forward only")
    capabilities = Capabilities(
        devices=("cpu",), max_queries=MAX_QUERIES, grad=False, dropout=False,
        hints=(("max_queries", "decoding is for few queries; use 'tiled'"),
               ("grad", "use 'tiled' for training"),
               ("dropout", "decoding is inference; use 'tiled'")))

    def lean(self, p: Problem) -> native.LeanLaunch | None:
        """The native kernel's lean launch of ``p`` (:func:`native.lean_launch`) when
        :meth:`forward` runs ``p`` on the kernel, else None: the eager hot path runs a
        repeat of ``p``'s signature with it (what :meth:`forward` would run)."""
        return None if native_reasons(p) else native.lean_launch(p)

    def forward(self, p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
        if not native_reasons(p):
            count(native=1)
            return native.forward_problem(p)
        return _decode(p)
