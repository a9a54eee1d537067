"""Triton kernels behind :mod:`attnkit.backends.triton` (FlashAttention-2 style).

This module imports ``triton`` and is loaded by ``backends/triton.py`` only when a kernel is
about to run — once compiled for the GPU, and once more under Triton's CPU interpreter when
``TRITON_INTERPRET=1`` (Triton decides between the two when a kernel is *decorated*).

Shape legend (strides are passed for every dimension, so inputs need not be contiguous)::

    Q  (B, H_q,  N_q, D_k)     K  (B, H_kv, N_k, D_k)     V  (B, H_kv, N_k, D_v)
    O  (B, H_q,  N_q, D_v)     LSE, DELTA (B, H_q, N_q)
    MASK  uint8 (B|1, H_q|1, N_q|1, N_k|1)   1 = may attend   (stride 0 on broadcast dims)
    BIAS  float (B|1, H_q|1, N_q|1, N_k|1)   added to the logits (stride 0 on broadcast dims)
    KVLEN, QLEN  int32 (B|1,)                padding: key j / query i valid below the length
    QIDS (B|1, N_q), KIDS (B|1, N_k)  int32  document ids: i sees j only if the ids are equal
    TILES int8 (B|1, H_q|1, ⌈N_q/BLOCK_M⌉|1, ⌈N_k/BLOCK_N⌉|1)  0 = no pair allowed: skip tile

One program owns one tile of ``BLOCK_M`` queries (forward, Δ, dQ) or ``BLOCK_N`` keys (dK/dV)
of one (batch, head) pair. The logits of a tile are, in order::

    x = (Q Kᵀ)·scale  →  softcap c·tanh(x/c)  →  + BIAS  →  −∞ where blocked

With dropout, the weights that mix V are dropped (and the kept ones scaled by 1/(1−p)) by a
counter-based hash of (seed, b·H_q + h, i, j), so the backward regenerates the same mask.

A pair (i, j) is blocked when j ≥ N_k, when ``i - j`` lies outside ``[BAND_LO, BAND_HI]``
(causal and sliding-window masks), when j ≥ KVLEN[b] or i ≥ QLEN[b], when the document ids
differ, or when MASK is 0. The band and the lengths also bound the loops, and TILES (a block
summary of the non-band terms) lets a program skip tiles with no allowed pair. Feature widths
are padded to powers of two (≥ 16) and the padding is masked on load.

Only builtins of ``triton.language`` appear here: the library's own @jit helpers (tl.max,
tl.sum, tl.zeros, tl.cdiv) are decorated once, when triton is imported, and an interpreted
kernel cannot call a compiled helper. Reductions use the builtin ``tl.reduce`` with triton's
own combine functions when present (the interpreter recognises those and reduces with NumPy).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _add_combine(a, b):
    return a + b


_MAX = getattr(tl.standard, "_elementwise_max", _max_combine)
_ADD = getattr(tl.standard, "_sum_combine", _add_combine)


@triton.jit
def _tanh(x):
    # tanh|x| = −m / (m + 2) with m = e^{−2|x|} − 1 ∈ [−1, 0]: no overflow (limits ±1
    # exactly), and no cancellation near 0, where m is Kahan's expm1 (u − 1)·y / log u —
    # a few ulp everywhere (1 − 2/(e^{2x}+1) lost c·eps absolute in c·tanh(x/c) near 0).
    y = -2.0 * tl.abs(x)
    u = tl.exp(y)                                  # (0, 1]
    lg = tl.log(tl.maximum(u, 0.5))                # used only where u >= 0.5
    lg = tl.where(u == 1.0, -1.0, lg)              # (not 0: that branch returns y)
    m = tl.where(u == 1.0, y, (u - 1.0) * y / lg)
    m = tl.where(u < 0.5, u - 1.0, m)
    t = -m / (m + 2.0)
    return tl.where(x < 0, -t, t)


@triton.jit
def _range(first, last, N_OTHER, LO, HI, pid_b, KvLen, QLen, slen, IS_Q_TILE: tl.constexpr,
           HAS_BAND: tl.constexpr, HAS_KVLEN: tl.constexpr, HAS_QLEN: tl.constexpr,
           BLOCK: tl.constexpr):
    """[lo, hi) of the other axis that a tile of rows (``IS_Q_TILE``) or columns
    ``first..last`` may see, lo rounded down to a multiple of BLOCK."""
    lo = first * 0
    hi = first * 0 + N_OTHER
    if HAS_BAND:
        if IS_Q_TILE:      # keys j with LO <= i - j <= HI
            lo = tl.maximum(first - HI, 0)
            hi = tl.minimum(last - LO + 1, N_OTHER)
        else:              # queries i with LO <= i - j <= HI
            lo = tl.maximum(first + LO, 0)
            hi = tl.minimum(last + HI + 1, N_OTHER)
    if HAS_KVLEN:
        kv_len = tl.load(KvLen + pid_b * slen)
        if IS_Q_TILE:  # noqa: SIM108  (a compile-time branch, kept as statements)
            hi = tl.minimum(hi, kv_len)
        else:
            hi = tl.where(first < kv_len, hi, 0)
    if HAS_QLEN:
        q_len = tl.load(QLen + pid_b * slen)
        if IS_Q_TILE:  # noqa: SIM108
            hi = tl.where(first < q_len, hi, 0)
        else:
            hi = tl.minimum(hi, q_len)
    lo = (lo // BLOCK) * BLOCK
    return lo, hi


@triton.jit
def _mix32(x):
    # a 32-bit integer mixer (xorshift-multiply, two rounds), computed in int64 with masking
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    x ^= x >> 16
    return x


@triton.jit
def _keep(seed, pid_bh, offs_m, offs_n, N_K, drop_p):
    """Dropout's keep mask for a tile: a counter-based hash of (seed, b·h, i, j) → uniform
    in [0, 1) compared with drop_p; forward and backward regenerate the same mask."""
    key = (seed.to(tl.int64) * 0x9E3779B1 + pid_bh.to(tl.int64) * 0x85EBCA77) & 0xFFFFFFFF
    idx = offs_m[:, None].to(tl.int64) * N_K + offs_n[None, :]
    x = _mix32(_mix32((idx ^ key) & 0xFFFFFFFF) ^ key)
    u = (x >> 8).to(tl.float32) * (1.0 / 16777216.0)
    return u >= drop_p


@triton.jit
def _logits(
    q, k_t, offs_m, offs_n, pid_b, h, scale, softcap, BAND_LO, BAND_HI, N_Q, N_K,
    Mask, smb, smh, smn, smk, Bias, sbb, sbh, sbn, sbk, KvLen, QLen, slen,
    QIds, KIds, sqib, sqin, skib, skin,
    HAS_BAND: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_KVLEN: tl.constexpr, HAS_QLEN: tl.constexpr, HAS_DOC: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
):
    """One (BLOCK_M, BLOCK_N) tile: logits (−∞ where blocked), tanh(x/c) and the allowed set."""
    s = tl.dot(q, k_t, input_precision=PRECISION, out_dtype=ACC) * scale
    t = s
    if HAS_SOFTCAP:
        t = _tanh(s / softcap)
        s = softcap * t
    rows = offs_m[:, None]
    cols = offs_n[None, :]
    inside = (rows < N_Q) & (cols < N_K)
    allowed = inside
    if HAS_BAND:
        d = rows - cols
        allowed = allowed & (d >= BAND_LO) & (d <= BAND_HI)
    if HAS_KVLEN:
        allowed = allowed & (cols < tl.load(KvLen + pid_b * slen))
    if HAS_QLEN:
        allowed = allowed & (rows < tl.load(QLen + pid_b * slen))
    if HAS_DOC:
        qi = tl.load(QIds + pid_b * sqib + offs_m * sqin, mask=offs_m < N_Q, other=-1)
        ki = tl.load(KIds + pid_b * skib + offs_n * skin, mask=offs_n < N_K, other=-2)
        allowed = allowed & (qi[:, None] == ki[None, :])
    if HAS_MASK:
        m = tl.load(Mask + pid_b * smb + h * smh + rows * smn + cols * smk, mask=inside, other=0)
        allowed = allowed & (m != 0)
    if HAS_BIAS:
        bias = tl.load(Bias + pid_b * sbb + h * sbh + rows * sbn + cols * sbk, mask=inside,
                       other=0.0)
        s = s + bias.to(ACC)
    s = tl.where(allowed, s, float("-inf"))
    return s, t, allowed


@triton.jit
def fwd_kernel(
    Q, K, V, O, Lse,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    sob, soh, son, sod, slb, slh, sln,
    Mask, smb, smh, smn, smk, Bias, sbb, sbh, sbn, sbk, KvLen, QLen, slen,
    QIds, KIds, sqib, sqin, skib, skin, Tiles, stb, sth, stm, stn,
    H_Q, GROUP, N_Q, N_K, D_K, D_V, scale, softcap, BAND_LO, BAND_HI,
    seed, drop_p, inv_keep,
    HAS_BAND: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_KVLEN: tl.constexpr, HAS_QLEN: tl.constexpr, HAS_DOC: tl.constexpr,
    HAS_TILES: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    ACC: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Forward: online softmax over key tiles → O and LSE for one query tile."""
    # one 1-D grid of (B·H_q) × ⌈N_q/BLOCK_M⌉ programs, query tiles fastest
    n_tiles = (N_Q + BLOCK_M - 1) // BLOCK_M
    pid_m = tl.program_id(0) % n_tiles
    pid_bh = tl.program_id(0) // n_tiles
    pid_b = (pid_bh // H_Q).to(tl.int64)
    h = (pid_bh % H_Q).to(tl.int64)
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < N_Q

    q = tl.load(Q + pid_b * sqb + h * sqh + offs_m[:, None] * sqn + offs_dk[None, :] * sqd,
                mask=row_ok[:, None] & (offs_dk[None, :] < D_K), other=0.0)
    K_base = K + pid_b * skb + hk * skh
    V_base = V + pid_b * svb + hk * svh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=ACC)
    l_i = tl.full([BLOCK_M], 0.0, dtype=ACC)
    acc = tl.full([BLOCK_M, BLOCK_DV], 0.0, dtype=ACC)

    q_first = pid_m * BLOCK_M
    lo, hi = _range(q_first, tl.minimum(q_first + BLOCK_M, N_Q) - 1, N_K, BAND_LO, BAND_HI,
                    pid_b, KvLen, QLen, slen, True, HAS_BAND, HAS_KVLEN, HAS_QLEN, BLOCK_N)
    n_keys = N_K + 0 * lo
    if HAS_KVLEN:       # K/V rows past a padding length are never read (garbage there stays out)
        n_keys = tl.minimum(n_keys, tl.load(KvLen + pid_b * slen))
    for start_n in range(lo, hi, BLOCK_N):
        visit = True
        if HAS_TILES:          # skip tiles where the block summary says nothing is allowed
            visit = tl.load(Tiles + pid_b * stb + h * sth + pid_m * stm
                            + (start_n // BLOCK_N) * stn) != 0
        if visit:
            offs_n = start_n + offs_n0
            col_ok = offs_n < n_keys
            k_t = tl.load(K_base + offs_n[None, :] * skn + offs_dk[:, None] * skd,
                          mask=col_ok[None, :] & (offs_dk[:, None] < D_K), other=0.0)
            s, _t, _allowed = _logits(
                q, k_t, offs_m, offs_n, pid_b, h, scale, softcap, BAND_LO, BAND_HI, N_Q, N_K,
                Mask, smb, smh, smn, smk, Bias, sbb, sbh, sbn, sbk, KvLen, QLen, slen,
                QIds, KIds, sqib, sqin, skib, skin, HAS_BAND, HAS_MASK, HAS_BIAS, HAS_KVLEN,
                HAS_QLEN, HAS_DOC, HAS_SOFTCAP, ACC, PRECISION)
            m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # empty so far: shift by 0
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])                          # blocked: exp(−∞) = 0
            l_i = l_i * alpha + tl.reduce(p, 1, _ADD)
            v = tl.load(V_base + offs_n[:, None] * svn + offs_dv[None, :] * svd,
                        mask=col_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0)
            if HAS_DROPOUT:     # the normaliser l_i keeps every weight; the mix drops some
                p = tl.where(_keep(seed, pid_bh, offs_m, offs_n, N_K, drop_p), p * inv_keep, 0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION,
                                                out_dtype=ACC)
            m_i = m_new

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    tl.store(O + pid_b * sob + h * soh + offs_m[:, None] * son + offs_dv[None, :] * sod,
             out.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < D_V))
    tl.store(Lse + pid_b * slb + h * slh + offs_m * sln, lse, mask=row_ok)


@triton.jit
def bwd_delta_kernel(
    O, DO, DLse, Delta,
    sob, soh, son, sod, sdob, sdoh, sdon, sdod, slb, slh, sln, sdlb, sdlh, sdln,
    H_Q, N_Q, D_V,
    HAS_DLSE: tl.constexpr, ACC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Δ_i = Σ_d dO_id · O_id − dLSE_i for one query tile (the row term of dS = P ∘ (dP − Δ))."""
    n_tiles = (N_Q + BLOCK_M - 1) // BLOCK_M
    pid_m = tl.program_id(0) % n_tiles
    pid_bh = tl.program_id(0) // n_tiles
    pid_b = (pid_bh // H_Q).to(tl.int64)
    h = (pid_bh % H_Q).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < N_Q
    inside = row_ok[:, None] & (offs_dv[None, :] < D_V)
    o = tl.load(O + pid_b * sob + h * soh + offs_m[:, None] * son + offs_dv[None, :] * sod,
                mask=inside, other=0.0)
    do = tl.load(DO + pid_b * sdob + h * sdoh + offs_m[:, None] * sdon + offs_dv[None, :] * sdod,
                 mask=inside, other=0.0)
    delta = tl.reduce(o.to(ACC) * do.to(ACC), 1, _ADD)
    if HAS_DLSE:
        delta -= tl.load(DLse + pid_b * sdlb + h * sdlh + offs_m * sdln, mask=row_ok,
                         other=0.0).to(ACC)
    tl.store(Delta + pid_b * slb + h * slh + offs_m * sln, delta, mask=row_ok)


@triton.jit
def bwd_dq_kernel(
    Q, K, V, DO, DQ, Lse, Delta, DBias,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    sdob, sdoh, sdon, sdod, sdqb, sdqh, sdqn, sdqd, slb, slh, sln, sdbb, sdbh, sdbn, sdbk,
    Mask, smb, smh, smn, smk, Bias, sbb, sbh, sbn, sbk, KvLen, QLen, slen,
    QIds, KIds, sqib, sqin, skib, skin, Tiles, stb, sth, stm, stn,
    H_Q, GROUP, N_Q, N_K, D_K, D_V, scale, softcap, BAND_LO, BAND_HI,
    seed, drop_p, inv_keep,
    HAS_BAND: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_KVLEN: tl.constexpr, HAS_QLEN: tl.constexpr, HAS_DOC: tl.constexpr,
    HAS_TILES: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    ACC: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_DBIAS: tl.constexpr,
):
    """dQ for one query tile: dQ = scale · Σ_j dS_ij K_j with dS = P ∘ (dP − Δ) (∘ softcap′).

    With HAS_DBIAS, dS (the gradient of the biased logits) is also added atomically into
    DBIAS, which has the bias's shape (stride 0 on broadcast dims sums over them)."""
    n_tiles = (N_Q + BLOCK_M - 1) // BLOCK_M
    pid_m = tl.program_id(0) % n_tiles
    pid_bh = tl.program_id(0) // n_tiles
    pid_b = (pid_bh // H_Q).to(tl.int64)
    h = (pid_bh % H_Q).to(tl.int64)
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < N_Q

    q = tl.load(Q + pid_b * sqb + h * sqh + offs_m[:, None] * sqn + offs_dk[None, :] * sqd,
                mask=row_ok[:, None] & (offs_dk[None, :] < D_K), other=0.0)
    do = tl.load(DO + pid_b * sdob + h * sdoh + offs_m[:, None] * sdon + offs_dv[None, :] * sdod,
                 mask=row_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0)
    lse = tl.load(Lse + pid_b * slb + h * slh + offs_m * sln, mask=row_ok, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse)          # empty row: P = 0 via the mask
    delta = tl.load(Delta + pid_b * slb + h * slh + offs_m * sln, mask=row_ok, other=0.0)
    K_base = K + pid_b * skb + hk * skh
    V_base = V + pid_b * svb + hk * svh
    dq = tl.full([BLOCK_M, BLOCK_DK], 0.0, dtype=ACC)

    q_first = pid_m * BLOCK_M
    lo, hi = _range(q_first, tl.minimum(q_first + BLOCK_M, N_Q) - 1, N_K, BAND_LO, BAND_HI,
                    pid_b, KvLen, QLen, slen, True, HAS_BAND, HAS_KVLEN, HAS_QLEN, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        visit = True
        if HAS_TILES:          # skip tiles where the block summary says nothing is allowed
            visit = tl.load(Tiles + pid_b * stb + h * sth + pid_m * stm
                            + (start_n // BLOCK_N) * stn) != 0
        if visit:
            offs_n = start_n + offs_n0
            col_ok = offs_n < N_K
            k_t = tl.load(K_base + offs_n[None, :] * skn + offs_dk[:, None] * skd,
                          mask=col_ok[None, :] & (offs_dk[:, None] < D_K), other=0.0)
            v_t = tl.load(V_base + offs_n[None, :] * svn + offs_dv[:, None] * svd,
                          mask=col_ok[None, :] & (offs_dv[:, None] < D_V), other=0.0)
            s, t, allowed = _logits(
                q, k_t, offs_m, offs_n, pid_b, h, scale, softcap, BAND_LO, BAND_HI, N_Q, N_K,
                Mask, smb, smh, smn, smk, Bias, sbb, sbh, sbn, sbk, KvLen, QLen, slen,
                QIds, KIds, sqib, sqin, skib, skin, HAS_BAND, HAS_MASK, HAS_BIAS, HAS_KVLEN,
                HAS_QLEN, HAS_DOC, HAS_SOFTCAP, ACC, PRECISION)
            p = tl.where(allowed, tl.exp(s - lse[:, None]), 0.0)
            dp = tl.dot(do, v_t, input_precision=PRECISION, out_dtype=ACC)
            if HAS_DROPOUT:     # dP = dropout(dO Vᵀ): the same mask and rescaling
                dp = tl.where(_keep(seed, pid_bh, offs_m, offs_n, N_K, drop_p), dp * inv_keep,
                              0.0)
            ds = p * (dp - delta[:, None])
            if HAS_DBIAS:
                tl.atomic_add(DBias + pid_b * sdbb + h * sdbh + offs_m[:, None] * sdbn
                              + offs_n[None, :] * sdbk, ds,
                              mask=(offs_m[:, None] < N_Q) & col_ok[None, :])
            if HAS_SOFTCAP:
                ds = ds * (1.0 - t * t)
            dq += tl.dot(ds.to(k_t.dtype), tl.trans(k_t), input_precision=PRECISION,
                         out_dtype=ACC)
    dq = dq * scale
    tl.store(DQ + pid_b * sdqb + h * sdqh + offs_m[:, None] * sdqn + offs_dk[None, :] * sdqd,
             dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & (offs_dk[None, :] < D_K))


@triton.jit
def bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, Lse, Delta,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    sdob, sdoh, sdon, sdod, sdkb, sdkh, sdkn, sdkd, sdvb, sdvh, sdvn, sdvd, slb, slh, sln,
    Mask, smb, smh, smn, smk, Bias, sbb, sbh, sbn, sbk, KvLen, QLen, slen,
    QIds, KIds, sqib, sqin, skib, skin, Tiles, stb, sth, stm, stn,
    H_KV, GROUP, N_Q, N_K, D_K, D_V, scale, softcap, BAND_LO, BAND_HI,
    seed, drop_p, inv_keep,
    HAS_BAND: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_KVLEN: tl.constexpr, HAS_QLEN: tl.constexpr, HAS_DOC: tl.constexpr,
    HAS_TILES: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    ACC: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """dK, dV for one key tile of one K/V head, summed over the GROUP query heads sharing it.

    dV = Σ_i Pᵀ dO      dK = scale · Σ_i dSᵀ Q      (no atomics: one program owns its keys)
    """
    # one 1-D grid of (B·H_kv) × ⌈N_k/BLOCK_N⌉ programs, key tiles fastest
    n_tiles = (N_K + BLOCK_N - 1) // BLOCK_N
    pid_n = tl.program_id(0) % n_tiles
    pid_bh = tl.program_id(0) // n_tiles
    pid_b = (pid_bh // H_KV).to(tl.int64)
    hk = (pid_bh % H_KV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    col_ok = offs_n < N_K

    k_t = tl.load(K + pid_b * skb + hk * skh + offs_n[None, :] * skn + offs_dk[:, None] * skd,
                  mask=col_ok[None, :] & (offs_dk[:, None] < D_K), other=0.0)
    v_t = tl.load(V + pid_b * svb + hk * svh + offs_n[None, :] * svn + offs_dv[:, None] * svd,
                  mask=col_ok[None, :] & (offs_dv[:, None] < D_V), other=0.0)
    dk = tl.full([BLOCK_N, BLOCK_DK], 0.0, dtype=ACC)
    dv = tl.full([BLOCK_N, BLOCK_DV], 0.0, dtype=ACC)

    k_first = pid_n * BLOCK_N
    lo, hi = _range(k_first, tl.minimum(k_first + BLOCK_N, N_K) - 1, N_Q, BAND_LO, BAND_HI,
                    pid_b, KvLen, QLen, slen, False, HAS_BAND, HAS_KVLEN, HAS_QLEN, BLOCK_M)
    for g in range(0, GROUP):
        h = hk * GROUP + g
        Q_base = Q + pid_b * sqb + h * sqh
        DO_base = DO + pid_b * sdob + h * sdoh
        L_base = pid_b * slb + h * slh
        for start_m in range(lo, hi, BLOCK_M):
            visit = True
            if HAS_TILES:
                visit = tl.load(Tiles + pid_b * stb + h * sth + (start_m // BLOCK_M) * stm
                                + pid_n * stn) != 0
            if visit:
                offs_m = start_m + offs_m0
                row_ok = offs_m < N_Q
                q = tl.load(Q_base + offs_m[:, None] * sqn + offs_dk[None, :] * sqd,
                            mask=row_ok[:, None] & (offs_dk[None, :] < D_K), other=0.0)
                do = tl.load(DO_base + offs_m[:, None] * sdon + offs_dv[None, :] * sdod,
                             mask=row_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0)
                lse = tl.load(Lse + L_base + offs_m * sln, mask=row_ok, other=0.0)
                idle = lse == float("-inf")                     # rows with no allowed key
                lse = tl.where(idle, 0.0, lse)
                # a padded query row may hold garbage: 0 · NaN must not reach dK below
                q = tl.where(idle[:, None], 0.0, q)
                delta = tl.load(Delta + L_base + offs_m * sln, mask=row_ok, other=0.0)
                s, t, allowed = _logits(
                    q, k_t, offs_m, offs_n, pid_b, h, scale, softcap, BAND_LO, BAND_HI, N_Q,
                    N_K, Mask, smb, smh, smn, smk, Bias, sbb, sbh, sbn, sbk, KvLen, QLen, slen,
                    QIds, KIds, sqib, sqin, skib, skin, HAS_BAND, HAS_MASK, HAS_BIAS,
                    HAS_KVLEN, HAS_QLEN, HAS_DOC, HAS_SOFTCAP, ACC, PRECISION)
                p = tl.where(allowed, tl.exp(s - lse[:, None]), 0.0)        # (BLOCK_M, BLOCK_N)
                dp = tl.dot(do, v_t, input_precision=PRECISION, out_dtype=ACC)
                if HAS_DROPOUT:
                    keep = _keep(seed, pid_b * H_KV * GROUP + h, offs_m, offs_n, N_K, drop_p)
                    dv += tl.dot(tl.trans(tl.where(keep, p * inv_keep, 0.0)).to(do.dtype), do,
                                 input_precision=PRECISION, out_dtype=ACC)
                    dp = tl.where(keep, dp * inv_keep, 0.0)
                else:
                    dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PRECISION,
                                 out_dtype=ACC)
                ds = p * (dp - delta[:, None])
                if HAS_SOFTCAP:
                    ds = ds * (1.0 - t * t)
                dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PRECISION,
                             out_dtype=ACC)
    dk = dk * scale
    tl.store(DK + pid_b * sdkb + hk * sdkh + offs_n[:, None] * sdkn + offs_dk[None, :] * sdkd,
             dk.to(DK.dtype.element_ty), mask=col_ok[:, None] & (offs_dk[None, :] < D_K))
    tl.store(DV + pid_b * sdvb + hk * sdvh + offs_n[:, None] * sdvn + offs_dv[None, :] * sdvd,
             dv.to(DV.dtype.element_ty), mask=col_ok[:, None] & (offs_dv[None, :] < D_V))
