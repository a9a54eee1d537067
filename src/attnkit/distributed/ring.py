"""The ring strategy: each rank attends its queries to every K/V shard in turn, merging the
blocks by log-sum-exp (forward); the shards travel again with their dK/dV accumulators
(backward). Shape legend as in :mod:`attnkit.distributed`: per rank q (B, H_q, N_q, D_k),
k (B, H_kv, N_k, D_k), v (B, H_kv, N_k, D_v), out (B, H_q, N_q, D_v), lse (B, H_q, N_q).

Hop ``s`` (0 … W−1) gives rank ``r`` the K/V shard of rank ``src = r − s`` (mod W), sent
straight from its owner (rank ``r`` sends its own K/V to ``r + s``): every message is an
owner's original shard, so nothing is forwarded or copied, and a hop that no rank needs
(:mod:`.schedule`: a sliding window far from the shard) is not run at all. The next hop's
exchange starts before the current hop's blocks are computed. The backward receives each
hop's K/V in chunks of heads (:func:`_kv_chunks`), the next chunk's exchange started before
the current chunk's sub-blocks are computed: two chunks in flight instead of two shards.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .. import backends as _backends
from .. import masks as _masks
from ..api import attention, prepare
from ..backends.base import compute_dtype, merge_partials, refuse_double_backward, softmax_shift
from .collectives import _Hop, _Ring
from .layout import _chunk_ranges
from .schedule import CAUSAL, FULL, Band, Block, pieces, plan_blocks

# The backward computes a block in sub-blocks of at most this many elements per gradient
# (whole heads first, then rows / keys of one head): 1 MiB in float32, so that a block's
# gradients are small next to the shards (and as fast as whole blocks on the native kernel).
_PIECE_ELEMENTS = 1 << 18
# The dK/dV accumulator moves between ranks in place, this many elements at a time (4 MiB
# in float32): the one extra buffer while it moves.
_SHIFT_ELEMENTS = 1 << 20


def _share(lse_b: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``exp(lse_b − lse)``: a block's share of the global softmax mass; 0 where the block has
    no allowed key (``lse_b = −∞``, also when the whole row has none), NaN stays NaN."""
    return torch.exp(lse_b - softmax_shift(lse))


class _Options:
    """One call's settings and schedule, shared by the forward and the backward ring (and the
    settings by the all-to-all strategy)."""

    def __init__(self, ring: _Ring, is_causal: bool, scale: float, softcap: float | None,
                 backend: str, layout: str = "contiguous", n_q: int = 0, n_k: int = 0,
                 band: Band | None = None) -> None:
        self.ring = ring
        self.is_causal = is_causal
        self.scale = scale              # resolved: 1/√D_k when the caller gave None
        self.softcap = softcap
        self.backend = backend
        self.grad_backend = backend     # becomes "reference" if the blocks' LSE has no grad
        self.layout = layout
        self.n_q, self.n_k = n_q, n_k   # this rank's shard lengths
        # the global band: a mask's, causal's, or none
        self.band: Band = band if band is not None else CAUSAL if is_causal else FULL
        self._plans: dict[tuple[int, int], list[Block]] = {}

    def blocks(self, src: int, rank: int | None = None) -> list[Block]:
        """The calls of ``rank`` (default: this one) over the K/V shard of rank ``src``
        (every rank can work out every rank's plan: the layout is known)."""
        w = self.ring.size
        rank = self.ring.rank if rank is None else rank
        if (rank, src) not in self._plans:
            qc = _chunk_ranges(w * self.n_q, rank, w, self.layout, "ring_attention")
            kc = _chunk_ranges(w * self.n_k, src, w, self.layout, "ring_attention")
            self._plans[rank, src] = plan_blocks(qc, kc, self.band)
        return self._plans[rank, src]

    def hops(self) -> list[int]:
        """The hops some rank computes a block on (0 always: the accumulators start there)."""
        w = self.ring.size
        return [s for s in range(w) if s == 0 or any(self.blocks((r - s) % w, r)
                                                     for r in range(w))]

    def kv_peers(self, s: int) -> tuple[int | None, int | None]:
        """Hop ``s``: (the rank this one sends its K/V to, the rank it receives K/V from),
        None where that rank has no block there."""
        ring = self.ring
        to, frm = ring.peer(s), ring.peer(-s)
        return (to if self.blocks(ring.rank, to) else None,
                frm if self.blocks(frm) else None)

    def block(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, band: Band,
              backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, lse) of queries ``q`` over one K/V block with ``band`` in its own indices."""
        causal = band == CAUSAL
        mask = None if causal or band == FULL else _masks.band(
            *(x if math.isinf(x) else int(x) for x in band))
        return attention(q, k, v, is_causal=causal, mask=mask, scale=self.scale,
                         softcap=self.softcap, backend=backend or self.backend,
                         return_lse=True)


def _rows(t: torch.Tensor, rows: slice, dim: int = -2) -> torch.Tensor:
    """``t`` restricted to ``rows`` of the sequence dim ``dim`` (a view)."""
    n = t.shape[dim]
    if rows.start in (0, None) and rows.stop in (None, n):
        return t
    return t[(slice(None),) * (t.dim() + dim) + (rows,)]


def _ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: _Options,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward ring on (B, H, N, D) shards → (out in q.dtype, lse float32/64)."""
    ring = o.ring
    acc = compute_dtype(q.dtype)
    b, h_q, n_q = q.shape[:3]
    out = torch.zeros(b, h_q, n_q, v.shape[-1], dtype=acc, device=q.device)   # (B,H_q,N_q,D_v)
    lse = torch.full((b, h_q, n_q), -torch.inf, dtype=acc, device=q.device)   # (B,H_q,N_q)
    own = [k.contiguous(), v.contiguous()]          # what this rank sends (a copy only if
    hops = o.hops()                                 # the caller's shard was strided)
    failure: Exception | None = None
    failed_at = -1
    pending = None
    for i, s in enumerate(hops):
        src = ring.peer(-s)
        kv = own if s == 0 else ring.wait(pending)   # this hop's K/V (None: not needed here)
        nxt = hops[i + 1] if i + 1 < len(hops) else None
        pending = None if nxt is None else _start_kv(o, own, nxt, "forward")
        if failure is None and kv is not None:
            try:        # a failure here must not stop the ring: the shards still move on
                for blk in o.blocks(src):
                    k_b, v_b = (_rows(t, blk.keys) for t in kv)
                    o_b, lse_b = o.block(_rows(q, blk.rows), k_b, v_b, blk.band)
                    _, lse_m = merge_partials([(_rows(out, blk.rows), _rows(lse, blk.rows, -1)),
                                               (o_b, lse_b.to(acc))], inplace=True)
                    _rows(lse, blk.rows, -1).copy_(lse_m)
                    del o_b, lse_b, lse_m       # (not alive while the next block is computed)
            except Exception as e:
                failure, failed_at = e, s
        del kv
    ring.settle(failure, failed_at, "forward")
    return out.to(q.dtype), lse


def _start_kv(o: _Options, own: list[torch.Tensor], s: int, phase: str) -> _Hop:
    """Start hop ``s``'s K/V exchange: own shard to rank r + s, rank r − s's shard in."""
    to, frm = o.kv_peers(s)
    return o.ring.exchange(own, to, own, frm, what="the K/V shard", step=f"{phase} hop {s}")


def _block_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, band: Band,
                 o: _Options, d_out: torch.Tensor, delta: torch.Tensor, lse: torch.Tensor,
                 ) -> tuple[torch.Tensor, ...]:
    """Gradients of the global loss w.r.t. (q, k, v) through one block (the query rows and
    key rows of one :class:`~.schedule.Block`; d_out, delta, lse restricted to those query rows).

    d_out (B,H_q,N_q,D_v) and delta = rowsum(dO·out) − dLSE (B,H_q,N_q) in the accumulation
    dtype; lse is the saved global LSE. With ``w = exp(lse_b − lse)`` the block's share,
    ``∂L/∂o_b = w·dO`` and ``∂L/∂lse_b = w·c`` where ``c = rowsum(dO·o_b) − delta``.
    """
    acc = d_out.dtype
    # Recomputed in the accumulation dtype: a half-precision block's gradients would be
    # rounded to half before they are summed over the ring (W roundings instead of one).
    leaves = [t.detach().to(acc).requires_grad_() for t in (q, k, v)]
    with torch.enable_grad():
        o_b, lse_b = o.block(*leaves, band, backend=o.grad_backend)
        if not lse_b.requires_grad and o.softcap is not None:
            o.grad_backend = "reference"     # no LSE gradient and no shortcut: see below
            o_b, lse_b = o.block(*leaves, band, backend=o.grad_backend)
        w = _share(lse_b.detach().to(acc), lse)                               # (B,H_q,N_q)
        g_out = w[..., None] * d_out                                          # ∂L/∂o_b
        wc = w * ((d_out * o_b.detach().to(acc)).sum(-1) - delta)             # ∂L/∂lse_b
        # Scalar surrogates whose gradients are the block's share of the global ones (a scalar
        # output also keeps torch.autograd.grad off its symbolic-shape checks).
        surrogate = (o_b * g_out).sum()
        if lse_b.requires_grad:
            finite = torch.isfinite(lse_b)
            surrogate = surrogate + (torch.where(finite, lse_b, torch.zeros_like(lse_b))
                                     * wc).sum()
        grads = [torch.zeros_like(x) if g is None else g
                 for g, x in zip(torch.autograd.grad(surrogate, leaves, allow_unused=True),
                                 leaves, strict=True)]
        if not lse_b.requires_grad:
            # The LSE's part by hand (no softcap: logits are scale·q·k). ∂lse_i/∂x_ij = p_ij,
            # so dq_i += scale·wc_i·Σ_j p_ij k_j  and  dk_j += scale·Σ_i p_ij·wc_i·q_i: the
            # output of attention(q, k, V=k), and the V-gradient of that same call.
            q_d, k_d = leaves[0].detach(), leaves[1].detach()
            v_aux = k_d.clone().requires_grad_()                              # K as values
            o_aux, _ = o.block(q_d, k_d, v_aux, band)                          # Σ_j p_ij k_j
            g_aux = (o.scale * wc)[..., None] * q_d                           # (B,H_q,N_q,D_k)
            (dk_lse,) = torch.autograd.grad((o_aux * g_aux).sum(), [v_aux])
            grads[0] = grads[0] + (o.scale * wc)[..., None] * o_aux.detach()
            grads[1] = grads[1] + dk_lse
    return tuple(grads)


def _native_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: _Options,
                     ) -> Any | None:
    """The native kernel's backward operator when this call's backward blocks would run on
    it anyway (``backend`` "auto" or "tiled", and ``tiled`` would pick the native kernel for
    such a block, recomputed in the accumulation dtype with gradients), else None."""
    if o.backend not in ("auto", "tiled") or q.device.type != "cpu":
        return None
    from ..backends import native, tiled

    if not native.available():
        return None
    acc = compute_dtype(q.dtype)
    leaves = [torch.empty_strided(t.shape, (0,) * t.dim(), dtype=acc).requires_grad_()
              for t in (q, k, v)]
    with torch.enable_grad():
        blk = prepare(*leaves, is_causal=o.is_causal and q.shape[-2] == k.shape[-2],
                      scale=o.scale, softcap=o.softcap).problem
        if blk.n_q == 0 or blk.n_k == 0:
            return None
        if o.backend == "auto" and _backends.select(blk).name != "tiled":
            return None
        if tiled.native_reasons(blk):
            return None
    return native._ops()


def _kernel_block_grads(ops: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        band: Band, o: _Options, d_out: torch.Tensor, delta: torch.Tensor,
                        lse: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """:func:`_block_grads` by the native kernel's own (FlashAttention-2) backward, given the
    saved GLOBAL lse and delta: it rebuilds the block's weights as ``exp(s − lse)`` — already
    the block's share of the global softmax — so ``dS = P·(dP − delta)`` is the block's part
    of the global gradient. One kernel call per block: no forward recompute, no autograd
    graph, no O(N_q·N_k) buffer."""
    acc = d_out.dtype
    q, k, v = (t.to(acc).contiguous() for t in (q, k, v))     # a copy only for half inputs
    from ..backends import native

    terms = native.plain_terms(o.scale, o.softcap or 0.0, band)   # the kernel's one record
    dq, dk, dv, *_ = ops.attend_backward(
        q, k, v, d_out.contiguous(), lse.contiguous(), delta.contiguous(), *terms,
        False, False)                                            # alibi_grad, bias_grad
    return dq, dk, dv


def _piece_sizes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int]:
    """(K/V heads, query rows, keys) per backward sub-block, so that each of its gradients
    holds at most ``_PIECE_ELEMENTS`` elements: whole heads first (a head slice of a batch-1
    shard is contiguous: no copy for the kernel), then rows and keys of one K/V head."""
    b, h_kv, n_k = k.shape[:3]
    g = q.shape[1] // max(1, h_kv)
    per_head = max(1, b * max(g * q.shape[2] * q.shape[3], n_k * max(k.shape[3], v.shape[3])))
    heads = max(1, min(h_kv, _PIECE_ELEMENTS // per_head))
    rows = max(1, _PIECE_ELEMENTS // max(1, b * heads * g * q.shape[3]))
    keys = max(1, _PIECE_ELEMENTS // max(1, b * heads * max(k.shape[3], v.shape[3])))
    return heads, rows, keys


def _kv_chunks(k: torch.Tensor, heads: int) -> list[tuple[slice, slice]]:
    """The (batch, K/V heads) ranges in which the backward receives a K/V shard and computes
    on it, in order: the whole shard when a sub-block takes every K/V head, else ``heads``
    heads of one batch element at a time — contiguous slices of a contiguous shard, so that
    two such ranges (this one and the next) are in flight instead of two whole shards."""
    b, h_kv = k.shape[:2]
    if heads >= h_kv:
        return [(slice(0, b), slice(0, h_kv))]
    return [(slice(i, i + 1), slice(h0, min(h0 + heads, h_kv)))
            for i in range(b) for h0 in range(0, h_kv, heads)]


def _ring_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, d_out: torch.Tensor, d_lse: torch.Tensor | None,
                   o: _Options) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward ring → (dq, dk, dv). The K/V shards come as in the forward, a chunk of
    heads at a time (:func:`_kv_chunks`); each shard's dK/dV accumulator follows it from rank
    to rank (hop s: the accumulator of shard r − s is on rank r), so that after the last hop
    it goes home holding the full dK/dV; dQ never leaves its rank. The only extra buffers
    besides the results: this chunk's and the next chunk's K/V (the accumulator moves in
    place, a piece at a time)."""
    ring = o.ring
    acc = compute_dtype(q.dtype)
    d_out = d_out.to(acc)
    delta = (d_out * out.to(acc)).sum(-1)                                     # (B,H_q,N_q)
    if d_lse is not None:
        delta = delta - d_lse.to(acc)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kernel = None
    try:        # a failing check here must not stop the ring either: then the autograd path
        if torch.isfinite(lse).all():   # (a row with no key anywhere: the guarded path)
            kernel = _native_backward(q, k, v, o)
    except Exception:
        kernel = None
    own = [k.contiguous(), v.contiguous()]
    dkv = [torch.zeros(t.shape, dtype=acc, device=q.device) for t in own]   # dK, dV of r − s
    heads, rows_max, keys_max = _piece_sizes(q, k, v)
    g = q.shape[1] // k.shape[1]                          # query heads per K/V head (GQA)
    work = [(s, c) for s in o.hops() for c in _kv_chunks(k, heads)]   # (hop, chunk), in order
    failure: Exception | None = None
    failed_at = -1
    pending = None
    for i, (s, (bs, hk)) in enumerate(work):
        src = ring.peer(-s)
        step = f"backward hop {s}"
        kv = [t[bs, hk] for t in own] if s == 0 else ring.wait(pending)   # (b, heads, N_k, D)
        nxt = work[i + 1] if i + 1 < len(work) else None
        pending = None if nxt is None or nxt[0] == 0 else _start_kv_chunk(o, own, *nxt)
        if failure is None and kv is not None:
            try:        # a failure here must not stop the ring: the accumulators move on
                hq = slice(hk.start * g, hk.stop * g)           # their query heads
                q_c, d_out_c, delta_c, lse_c = (t[bs, hq] for t in (q, d_out, delta, lse))
                dq_c, dk_c, dv_c = dq[bs, hq], dkv[0][bs, hk], dkv[1][bs, hk]
                for blk in o.blocks(src):
                    for sub in pieces(blk, rows_max, keys_max):
                        k_b, v_b = (_rows(t, sub.keys) for t in kv)
                        args = (_rows(q_c, sub.rows), k_b, v_b, sub.band, o,
                                _rows(d_out_c, sub.rows), _rows(delta_c, sub.rows, -1),
                                _rows(lse_c, sub.rows, -1))
                        g_q, g_k, g_v = (_kernel_block_grads(kernel, *args)
                                         if kernel is not None else _block_grads(*args))
                        _rows(dq_c, sub.rows).add_(g_q)
                        _rows(dk_c, sub.keys).add_(g_k)
                        _rows(dv_c, sub.keys).add_(g_v)
                        del g_q, g_k, g_v   # (not alive while the next piece is computed)
            except Exception as e:
                failure, failed_at = e, s
        del kv
        if nxt is not None and nxt[0] == s:
            continue                        # more chunks of this hop
        # the accumulator moves on to the rank that holds shard r − s at the next hop (after
        # the last one: home), in place, a piece at a time
        move = (nxt[0] if nxt is not None else ring.size) - s
        if move % ring.size:
            for t in dkv:
                ring.shift(t, move, _SHIFT_ELEMENTS, what="the dK/dV accumulator", step=step)
    ring.settle(failure, failed_at, "backward")
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


def _start_kv_chunk(o: _Options, own: list[torch.Tensor], s: int,
                    chunk: tuple[slice, slice]) -> _Hop:
    """Start hop ``s``'s exchange of one (batch, heads) chunk of the K/V shards."""
    bs, hk = chunk
    part = [t[bs, hk] for t in own]                 # contiguous: see _kv_chunks
    to, frm = o.kv_peers(s)
    return o.ring.exchange(part, to, part, frm, what="the K/V shard",
                           step=f"backward hop {s}")


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                o: _Options) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = _ring_forward(q, k, v, o)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = o
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor | None, d_lse: torch.Tensor | None,
                 ) -> tuple[torch.Tensor | None, ...]:
        refuse_double_backward(                      # the backward ring is first-order only
            "ring_attention", what="function",
            fix="Gather the shards and call attnkit.attention(..., backend='reference') for "
                "higher derivatives.")
        q, k, v, out, lse = ctx.saved_tensors
        if d_out is None:
            d_out = torch.zeros_like(out)
        with torch.no_grad():
            dq, dk, dv = _ring_backward(q, k, v, out, lse, d_out, d_lse, ctx.options)
        return dq, dk, dv, None
