"""Decoding: a few queries over a long K/V cache, split over the keys (flash-decoding).

With one (or a handful of) queries, the work is one pass over K and V. The keys are split
into ``C`` chunks of ``L`` keys; every chunk computes its own softmax pieces — running max
``m_c``, sum ``l_c`` and unnormalised output ``o_c`` — in one batched matmul over
(batch × K/V heads × chunks), and the chunks are merged by their log-sum-exp::

    M = max_c m_c      out = Σ_c e^{m_c − M} o_c / Σ_c e^{m_c − M} l_c
    lse = M + log Σ_c e^{m_c − M} l_c

Without softcap/score_mod the chunks run as extra "heads" of torch's fused CPU flash kernel
(one pass over K and V, chunks in parallel, LSE returned); with them, as batched matmuls.
K and V are read in place (chunks are views, never copies); the query heads that share a K/V
head are stacked as rows (GQA without repeating K/V).

Shape legend::

    q (B, H_q, N_q, D_k)  N_q ≤ 16        k (B, H_kv, N_k, D_k)     v (B, H_kv, N_k, D_v)
    grouped queries       (B, H_kv, 1, R, D_k)      R = G · N_q rows per K/V head
    chunked keys          (B, H_kv, C, L, D_k)      scores (B, H_kv, C, R, L)
    out (B, H_q, N_q, D_v)                          lse (B, H_q, N_q)

Caution
-------
- Forward only: a call that needs gradients is declined (``not_supported_reasons``) and
  ``backend="auto"`` gives it to the ``tiled`` engine.
- Dropout is declined (decoding is inference).
- float16/bfloat16 K/V are cast to float32 once per call (a copy of the cache): the engine
  is tuned for float32 caches.
- Masks are evaluated densely on ``N_q × N_k`` (tiny for ≤ 16 queries); chunks with no
  allowed key are computed anyway (their weight is exactly 0).
"""

from __future__ import annotations

import math

import torch

from . import register
from .base import Backend, Problem, compute_dtype

__all__ = ["DecodeBackend", "MAX_QUERIES", "chunk_count"]

MAX_QUERIES = 16
# Keys per chunk: big enough for efficient matmuls, small enough for many parallel chunks.
_CHUNK = 1024
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def chunk_count(n_k: int, chunk: int | None = None) -> int:
    """Number of key chunks for ``n_k`` keys (1 for short caches)."""
    return max(1, n_k // (chunk or _CHUNK))


def _decode(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    acc = compute_dtype(p.dtype)
    B, hkv, g, n_q = p.batch, p.heads_kv, p.group, p.n_q
    r = g * n_q
    q = (p.q.to(acc) * p.scale).reshape(B, hkv, 1, r, p.d_k)      # (B, H_kv, 1, R, D_k)
    k, v = p.k.to(acc), p.v.to(acc)
    c = chunk_count(p.n_k)
    L = p.n_k // c
    main = c * L
    dev = p.device
    allowed = None
    if p.mask is not None:
        b = torch.arange(p.batch if p.mask.depends_on_batch else 1, device=dev).view(-1, 1, 1, 1)
        h = torch.arange(p.heads_q if p.mask.depends_on_heads else 1,
                         device=dev).view(1, -1, 1, 1)
        qi = torch.arange(n_q, device=dev).view(1, 1, -1, 1)
        ki = torch.arange(p.n_k, device=dev).view(1, 1, 1, -1)
        a = p.mask(b, h, qi, ki, p.n_q, p.n_k)
        while a.dim() < 4:
            a = a.unsqueeze(0)
        a = a.expand(a.shape[0], a.shape[1], n_q, p.n_k)
        # (B|1, H_q|1, N_q, N_k) → grouped rows (B|1, H_kv|1, R, N_k)
        allowed = (a.repeat(1, 1, g, 1) if a.shape[1] == 1 else a.reshape(a.shape[0], hkv, r,
                                                                          p.n_k))
    bias = None
    if p.bias is not None:
        bb = p.bias.to(acc).expand(B, p.heads_q, n_q, p.n_k)
        bias = bb.reshape(B, hkv, r, p.n_k)

    def pieces(k0: int, k1: int, n_chunks: int) -> tuple[torch.Tensor, ...]:
        """Softmax pieces of keys [k0, k1) cut into ``n_chunks`` equal chunks."""
        length = (k1 - k0) // n_chunks
        kc = k[:, :, k0:k1].reshape(B, hkv, n_chunks, length, p.d_k)  # view when possible
        vc = v[:, :, k0:k1].reshape(B, hkv, n_chunks, length, p.d_v)
        s = torch.matmul(q, kc.transpose(-1, -2))                      # (B, H_kv, C, R, L)
        if p.softcap is not None or p.score_mod is not None:
            # to the (B, H_q, N_q, keys) frame score mods are written for, and back
            x = s.view(B, hkv, n_chunks, g, n_q, length).permute(0, 1, 3, 4, 2, 5)
            x = x.reshape(B, p.heads_q, n_q, n_chunks * length)
            if p.softcap is not None:
                x = p.softcap * torch.tanh(x / p.softcap)
            if p.score_mod is not None:
                x = p.score_mod(x, torch.arange(B, device=dev).view(-1, 1, 1, 1),
                                torch.arange(p.heads_q, device=dev).view(1, -1, 1, 1),
                                torch.arange(n_q, device=dev).view(1, 1, -1, 1),
                                torch.arange(k0, k1, device=dev).view(1, 1, 1, -1))
            x = x.reshape(B, hkv, g, n_q, n_chunks, length).permute(0, 1, 4, 2, 3, 5)
            s = x.reshape(B, hkv, n_chunks, r, length)
        if bias is not None:
            s = s + bias[..., k0:k1].reshape(B, hkv, r, n_chunks, length).transpose(2, 3)
        if allowed is not None:
            al = allowed[..., k0:k1].reshape(*allowed.shape[:2], r, n_chunks, length)
            s = s.masked_fill(~al.transpose(2, 3), -math.inf)
        m = s.amax(-1, keepdim=True)                                   # (B, H_kv, C, R, 1)
        m = torch.where(m == -math.inf, torch.zeros_like(m), m)
        e = torch.exp(s - m)
        return m, e.sum(-1, keepdim=True), torch.matmul(e, vc)         # o: (B, H_kv, C, R, D_v)

    if p.softcap is None and p.score_mod is None and p.d_k == p.d_v:
        out, lse = _fused_chunks(p, q.view(B, hkv, r, p.d_k), k, v, c, allowed, bias)
        return out.reshape(B, p.heads_q, n_q, p.d_v).to(p.dtype), lse.reshape(B, p.heads_q, n_q)
    parts = [pieces(0, main, c)]
    if main < p.n_k:
        parts.append(pieces(main, p.n_k, 1))
    m = torch.cat([x[0] for x in parts], 2)                            # (B, H_kv, C', R, 1)
    lsum = torch.cat([x[1] for x in parts], 2)
    o = torch.cat([x[2] for x in parts], 2)
    big_m = m.amax(2, keepdim=True)
    w = torch.exp(m - big_m)                                           # (B, H_kv, C', R, 1)
    z = (w * lsum).sum(2)                                              # (B, H_kv, R, 1)
    out = (w * o).sum(2)                                               # (B, H_kv, R, D_v)
    nonempty = z > 0
    z_safe = torch.where(nonempty, z, torch.ones_like(z))
    out = out / z_safe
    lse = torch.where(nonempty, big_m.squeeze(2) + torch.log(z_safe),
                      torch.full_like(z, -math.inf))
    out = out.reshape(B, p.heads_q, n_q, p.d_v).to(p.dtype)
    return out, lse.reshape(B, p.heads_q, n_q)


def _fused_chunks(p: Problem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: int,
                  allowed: torch.Tensor | None, bias: torch.Tensor | None,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunks as extra heads of torch's fused CPU flash kernel, merged by LSE.

    ``q (B, H_kv, R, D)`` pre-scaled; keys ``[0, C·L)`` are viewed as ``(B, H_kv·C, L, D)``
    (no copy), the rest is one more call. → out ``(B, H_kv, R, D_v)``, lse ``(B, H_kv, R)``.
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
        kc = k[:, :, k0:k1].reshape(B, hkv * n_chunks, length, d)
        vc = v[:, :, k0:k1].reshape(B, hkv * n_chunks, length, d)
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
                   .reshape(B, hkv * n_chunks, r, length))
        o, lse = _flash(qc, kc, vc, attn_mask=add, scale=1.0)
        lse = lse.to(q.dtype)
        if has_key is not None:
            lse = torch.where(has_key, lse, torch.full_like(lse, -math.inf))
        outs.append(o.view(B, hkv, n_chunks, r, d))
        lses.append(lse.view(B, hkv, n_chunks, r))
    o = torch.cat(outs, 2)                                               # (B, H_kv, C', R, D)
    lse = torch.cat(lses, 2)                                             # (B, H_kv, C', R)
    m = lse.amax(2, keepdim=True)
    m = torch.where(m == -math.inf, torch.zeros_like(m), m)
    w = torch.exp(lse - m)
    z = w.sum(2)                                                         # (B, H_kv, R)
    nonempty = z > 0
    z_safe = torch.where(nonempty, z, torch.ones_like(z))
    out = (o * (w / z_safe.unsqueeze(2)).unsqueeze(-1)).sum(2)
    lse_out = torch.where(nonempty, m.squeeze(2) + torch.log(z_safe),
                          torch.full_like(z, -math.inf))
    return out, lse_out


class DecodeBackend(Backend):
    """Few queries over a long K/V cache: key chunks in parallel, merged by LSE."""

    name = "decode"
    description = (f"CPU flash-decoding for <= {MAX_QUERIES} queries: key chunks in one batched "
                   "matmul, merged by log-sum-exp; forward only")

    def not_supported_reasons(self, p: Problem) -> list[str]:
        reasons = []
        if p.device.type != "cpu":
            reasons.append(f"runs on CPU only (inputs are on {p.device})")
        if p.n_q > MAX_QUERIES:
            reasons.append(f"made for at most {MAX_QUERIES} queries (decoding), got N_q={p.n_q}: "
                           "use 'tiled'")
        if p.requires_grad:
            reasons.append("forward only (inputs require grad): use 'tiled' for training")
        if p.dropout_p > 0.0:
            reasons.append(f"no dropout (decoding is inference), got dropout_p={p.dropout_p}")
        return reasons

    def forward(self, p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
        return _decode(p)


register(DecodeBackend())
