"""Ring attention: exact attention over a sequence sharded across torch.distributed ranks.

Sequence parallelism for long context: each of the ``W`` ranks of a process group holds one
contiguous shard of the sequence. Rank ``r`` holds queries ``[r·N_q, (r+1)·N_q)`` and keys /
values ``[r·N_k, (r+1)·N_k)`` of the global sequence (``N_q``, ``N_k`` = the local shard
lengths, the same on every rank). The result on each rank is that rank's shard of
``attention(Q_global, K_global, V_global)``, exactly — not an approximation.

Shape legend (per rank; SDPA layout, as everywhere in attnkit)::

    q    (..., H_q,  N_q, D_k)     this rank's query shard
    k    (..., H_kv, N_k, D_k)     this rank's key shard      H_q a multiple of H_kv (GQA)
    v    (..., H_kv, N_k, D_v)     this rank's value shard
    out  (..., H_q,  N_q, D_v)     this rank's shard of the global output
    lse  (..., H_q,  N_q)          global log-sum-exp of the logits (``return_lse=True``)
    W = group size, r = this rank in the group; global sequence length W·N_q (queries)

The ring schedule (forward)::

    step s = 0 .. W-1:  this rank holds the K/V shard of rank  src = (r - s) mod W
        start   send K/V shard → rank r+1,  receive the next one ← rank r-1   (async)
        compute (o_s, lse_s) = attention(q, K_src, V_src, return_lse=True)
                  is_causal: src > r → skipped (the future); src == r → local causal mask;
                             src < r → no mask (the past)
        merge   lse = log(e^lse + e^lse_s);  out = (e^lse_old·out + e^lse_s·o_s) / e^lse
        wait    for the exchange; the received shard is next step's block

Each block goes through :func:`attnkit.attention`, so the fastest backend that supports it
runs. The merge is −∞-aware: a block in which a query may see no key contributes nothing.

The backward pass runs the same ring once more, FlashAttention-style. Each K/V shard travels
with its own dK/dV accumulator; at every step a rank recomputes its block under autograd and
asks for the gradients of the block's ``(o_s, lse_s)``, weighted by the block's share
``w_s = exp(lse_s − lse)`` of the global softmax (``∂L/∂o_s = w_s·dO`` and
``∂L/∂lse_s = w_s·(dO·o_s − dO·out)``). After ``W`` hops every accumulator is back on its
owner as the full dK/dV; dQ never leaves its rank.

Use::

    import torch.distributed as dist
    import attnkit.distributed

    dist.init_process_group("nccl")                         # or "gloo" on CPU
    out = attnkit.distributed.ring_attention(q, k, v, is_causal=True)   # local shards in

Caution
-------
- Tested with the gloo backend on CPU (2 and 3 processes). NCCL on GPU uses the same code
  path (``batch_isend_irecv``) but is not covered by the test suite.
- Every call first all-gathers a small vector of shapes (one collective) so that mismatched
  shards or options raise the same clear error on every rank instead of hanging. A rank whose
  inputs fail local validation still joins that collective, so its peers raise too.
- An error raised inside the ring on some ranks only (e.g. a forced ``backend`` that can
  run the diagonal, masked block but not the others) leaves the other ranks waiting until
  the process group's ``timeout``: give ``init_process_group`` a finite one.
- With ``is_causal=True`` and contiguous shards the work is unbalanced: rank ``r`` computes
  ``r + 1`` blocks (the last rank does ``W``), while every rank still forwards every shard.
  Zig-zag / striped layouts that balance it are not implemented.
- Causal ring attention needs ``N_q == N_k`` (a self-attention sequence split into equal
  shards). Only ``scale``, ``softcap`` and ``backend`` are passed through to the blocks: masks
  other than the global causal one, ``score_mod`` and dropout are not supported (they would
  need global positions).
- The backward pass needs the gradient of each block's log-sum-exp. A backend whose LSE
  carries one (reference, tiled, triton) does each block in one recompute. For a backend whose
  LSE does not (detected per call), that part is added by hand from one more attention call
  per block (with K as the values): about twice the backward work, still O(N) memory. With
  ``softcap`` that shortcut does not apply, and such blocks are recomputed with the reference
  backend (O(N_q·N_k) memory per block).
- Precision: for float16/bfloat16 inputs the forward blocks run in the input dtype and are
  merged in float32; the backward recomputes each block in float32, so that a block's
  gradients are not rounded to half precision before they are summed over the ring (the
  accumulation contract of attnkit). On GPUs that backward is slower than a half-precision
  one would be.
- Memory: the forward keeps one extra K/V shard in flight; the backward keeps a K/V shard and
  its dK/dV accumulator (float32 for half-precision inputs) in flight, plus a float32 copy of
  the block being recomputed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from . import backends as _backends
from .api import attention, prepare
from .backends.base import compute_dtype, merge_partials, softmax_shift

__all__ = ["ring_attention"]

_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
_META_DIMS = 6          # q/k/v shapes are recorded with this many dims (padded with -1)


class _Ring:
    """Who this rank is in the ring and how to talk to its neighbours."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        world = group is None or group is dist.group.WORLD

        def global_rank(r: int) -> int:
            return r if world else dist.get_global_rank(group, r)

        self.next = global_rank((self.rank + 1) % self.size)
        self.prev = global_rank((self.rank - 1) % self.size)
        self.backend = str(dist.get_backend(group))

    def exchange(self, send: torch.Tensor) -> tuple[torch.Tensor, list[Any]]:
        """Start sending ``send`` to the next rank and receiving its like from the previous one.

        Returns the receive buffer and the requests; the buffer is valid after :meth:`wait`,
        and ``send`` must not be modified before then.
        """
        if self.size == 1:
            return send.clone(), []
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.group),
               dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        return recv, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(reqs: list[Any]) -> None:
        for req in reqs:
            req.wait()


def _pack(*ts: torch.Tensor) -> torch.Tensor:
    """Tensors of one dtype → one flat contiguous buffer (one message per hop)."""
    return torch.cat([t.reshape(-1) for t in ts])


def _unpack(buf: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    out, at = [], 0
    for s in shapes:
        n = s.numel()
        out.append(buf[at:at + n].view(s))
        at += n
    return out


def _share(lse_b: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``exp(lse_b − lse)``: a block's share of the global softmax mass; 0 where the block has
    no allowed key (``lse_b = −∞``, also when the whole row has none), NaN stays NaN."""
    return torch.exp(lse_b - softmax_shift(lse))


class _Options:
    """One call's settings, shared by the forward and the backward ring."""

    def __init__(self, ring: _Ring, is_causal: bool, scale: float, softcap: float | None,
                 backend: str) -> None:
        self.ring = ring
        self.is_causal = is_causal
        self.scale = scale              # resolved: 1/√D_k when the caller gave None
        self.softcap = softcap
        self.backend = backend
        self.grad_backend = backend     # becomes "reference" if the blocks' LSE has no grad

    def computes(self, src: int) -> bool:
        """Whether this rank attends to the K/V shard of rank ``src`` at all."""
        return not (self.is_causal and src > self.ring.rank)

    def block(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, src: int,
              backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, lse) of this rank's queries over the K/V shard of rank ``src``."""
        return attention(q, k, v, is_causal=self.is_causal and src == self.ring.rank,
                         scale=self.scale, softcap=self.softcap,
                         backend=backend or self.backend, return_lse=True)


def _ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: _Options,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward ring on (B, H, N, D) shards → (out in q.dtype, lse float32/64)."""
    ring = o.ring
    acc = compute_dtype(q.dtype)
    b, h_q, n_q = q.shape[:3]
    out = torch.zeros(b, h_q, n_q, v.shape[-1], dtype=acc, device=q.device)   # (B,H_q,N_q,D_v)
    lse = torch.full((b, h_q, n_q), -torch.inf, dtype=acc, device=q.device)   # (B,H_q,N_q)
    shapes = [k.shape, v.shape]
    kv = _pack(k, v)
    for s in range(ring.size):
        src = (ring.rank - s) % ring.size
        pending = ring.exchange(kv) if s < ring.size - 1 else None
        if o.computes(src):
            k_b, v_b = _unpack(kv, shapes)
            o_b, lse_b = o.block(q, k_b, v_b, src)
            out, lse = merge_partials([(out, lse), (o_b, lse_b.to(acc))], inplace=True)
        if pending is not None:
            kv, reqs = pending
            ring.wait(reqs)
    return out.to(q.dtype), lse


def _block_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, src: int, o: _Options,
                 d_out: torch.Tensor, delta: torch.Tensor, lse: torch.Tensor,
                 ) -> tuple[torch.Tensor, ...]:
    """Gradients of the global loss w.r.t. (q, k_src, v_src) through one block.

    d_out (B,H_q,N_q,D_v) and delta = rowsum(dO·out) − dLSE (B,H_q,N_q) in the accumulation
    dtype; lse is the saved global LSE. With ``w = exp(lse_b − lse)`` the block's share,
    ``∂L/∂o_b = w·dO`` and ``∂L/∂lse_b = w·c`` where ``c = rowsum(dO·o_b) − delta``.
    """
    acc = d_out.dtype
    # Recomputed in the accumulation dtype: a half-precision block's gradients would be
    # rounded to half before they are summed over the ring (W roundings instead of one).
    leaves = [t.detach().to(acc).requires_grad_() for t in (q, k, v)]
    with torch.enable_grad():
        o_b, lse_b = o.block(*leaves, src, backend=o.grad_backend)
        if not lse_b.requires_grad and o.softcap is not None:
            o.grad_backend = "reference"     # no LSE gradient and no shortcut: see below
            o_b, lse_b = o.block(*leaves, src, backend=o.grad_backend)
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
            o_aux, _ = o.block(q_d, k_d, v_aux, src)                          # Σ_j p_ij k_j
            g_aux = (o.scale * wc)[..., None] * q_d                           # (B,H_q,N_q,D_k)
            (dk_lse,) = torch.autograd.grad((o_aux * g_aux).sum(), [v_aux])
            grads[0] = grads[0] + (o.scale * wc)[..., None] * o_aux.detach()
            grads[1] = grads[1] + dk_lse
    return tuple(grads)


def _ring_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, d_out: torch.Tensor, d_lse: torch.Tensor | None,
                   o: _Options) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward ring: K/V shards travel with their dK/dV accumulators → (dq, dk, dv)."""
    ring = o.ring
    acc = compute_dtype(q.dtype)
    d_out = d_out.to(acc)
    delta = (d_out * out.to(acc)).sum(-1)                                     # (B,H_q,N_q)
    if d_lse is not None:
        delta = delta - d_lse.to(acc)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    shapes = [k.shape, v.shape]
    kv = _pack(k, v)
    dkv: torch.Tensor | None = torch.zeros(kv.shape, dtype=acc, device=q.device)
    dkv_pending = None      # the accumulator of the shard we hold, still on its way to us
    for s in range(ring.size):
        src = (ring.rank - s) % ring.size
        kv_pending = ring.exchange(kv) if s < ring.size - 1 else None
        grad_kv = None
        if o.computes(src):
            k_b, v_b = _unpack(kv, shapes)
            g_q, g_k, g_v = _block_grads(q, k_b, v_b, src, o, d_out, delta, lse)
            dq += g_q.to(acc)
            grad_kv = _pack(g_k.to(acc), g_v.to(acc))
        if dkv_pending is not None:
            dkv, reqs = dkv_pending
            ring.wait(reqs)
        assert dkv is not None
        if grad_kv is not None:
            dkv = dkv + grad_kv
        dkv_pending = ring.exchange(dkv)     # after W hops it is back with its owner
        if kv_pending is not None:
            kv, reqs = kv_pending
            ring.wait(reqs)
    assert dkv_pending is not None
    dkv, reqs = dkv_pending
    ring.wait(reqs)
    dk, dv = _unpack(dkv, shapes)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


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
    @once_differentiable      # the backward ring itself is not differentiable: say so loudly
    def backward(ctx: Any, d_out: torch.Tensor | None, d_lse: torch.Tensor | None,
                 ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        if d_out is None:
            d_out = torch.zeros_like(out)
        dq, dk, dv = _ring_backward(q, k, v, out, lse, d_out, d_lse, ctx.options)
        return dq, dk, dv, None


def _shape_row(t: Any) -> list[int]:
    """[ndim, numel, the last _META_DIMS sizes padded with -1] (ndim -1: not a tensor)."""
    if not isinstance(t, torch.Tensor):
        return [-1, -1] + [-1] * _META_DIMS
    shape = list(t.shape)[-_META_DIMS:]
    return [t.dim(), t.numel()] + shape + [-1] * (_META_DIMS - len(shape))


def _fmt(row: list[int]) -> str:
    ndim, shape = row[0], row[2:2 + min(row[0], _META_DIMS)]
    if ndim < 0:
        return "(not a tensor)"
    return "(" + ("…, " if ndim > _META_DIMS else "") + ", ".join(map(str, shape)) + ")"


def _check_group(
    q: Any, k: Any, v: Any, ring: _Ring, is_causal: bool, local_error: Exception | None,
) -> None:
    """All-gather every rank's shapes and options; raise the same clear error everywhere."""
    row = [int(local_error is not None), int(bool(is_causal))]
    row += [_DTYPES.index(q.dtype) if isinstance(q, torch.Tensor) and q.dtype in _DTYPES
            else -1]
    for t in (q, k, v):
        row += _shape_row(t)
    device = torch.device("cpu")
    if ring.backend == "nccl":      # NCCL only moves CUDA tensors
        device = (q.device if isinstance(q, torch.Tensor) and q.is_cuda
                  else torch.device("cuda", torch.cuda.current_device()))
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    rows_t = [torch.empty_like(mine) for _ in range(ring.size)]
    dist.all_gather(rows_t, mine, group=ring.group)
    rows = [r.tolist() for r in rows_t]
    bad = [i for i, r in enumerate(rows) if r[0]]
    if bad:
        if local_error is not None:
            raise local_error
        raise RuntimeError(
            f"ring_attention: rank(s) {bad} of the group were given invalid inputs (see the "
            f"error raised there); this rank ({ring.rank}) stopped with them"
        )
    if any(r[1:] != rows[0][1:] for r in rows):
        n = _META_DIMS + 2
        lines = []
        for i, r in enumerate(rows):
            dt = _DTYPES[r[2]] if r[2] >= 0 else "?"
            qs, ks, vs = r[3:3 + n], r[3 + n:3 + 2 * n], r[3 + 2 * n:3 + 3 * n]
            lines.append(f"rank {i}: q {_fmt(qs)}, k {_fmt(ks)}, v {_fmt(vs)}, {dt}, "
                         f"is_causal={bool(r[1])}")
        raise ValueError(
            "ring_attention needs the same shard shapes, dtype and options on every rank "
            "(pad the sequence so that it splits into equal shards); got " + "; ".join(lines)
        )


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Any = None,
    is_causal: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
    backend: str = "auto",
    return_lse: bool = False,
) -> Any:
    """Exact attention over a sequence sharded across the ranks of a process group.

    Shapes (per rank; the global sequence is the concatenation of the shards in rank order)::

        q (..., H_q, N_q, D_k)   k (..., H_kv, N_k, D_k)   v (..., H_kv, N_k, D_v)
        → out (..., H_q, N_q, D_v)       [and lse (..., H_q, N_q) with return_lse=True]

    Rank ``r`` passes queries ``[r·N_q, (r+1)·N_q)`` and keys/values ``[r·N_k, (r+1)·N_k)``
    of the global sequence and gets back its rows of the global output. Differentiable: the
    gradients of q, k, v are those of single-process :func:`attnkit.attention` on the
    concatenated sequence (restricted to this rank's shard). Every rank of the group must call
    this together with the same shapes and options.

    Args:
        group: the ``torch.distributed`` process group; ``None`` = the default group.
        is_causal: global causal attention (query at global position i sees keys 0..i).
            Needs ``N_q == N_k``. Blocks from later ranks are skipped entirely.
        scale: multiplies the scores; defaults to ``1/√D_k``.
        softcap: ``c`` maps each scaled logit x to ``c·tanh(x/c)``.
        backend: backend for each block (as in :func:`attnkit.attention`); default ``"auto"``.
        return_lse: also return the global log-sum-exp of this rank's query rows.

    Raises:
        RuntimeError: torch.distributed is unavailable or the process group is not
            initialised, or this process is not a member of ``group``.
        ValueError / TypeError: invalid inputs on any rank (raised on every rank).
    """
    if not dist.is_available():
        raise RuntimeError("ring_attention needs torch.distributed, which this torch build lacks")
    if not dist.is_initialized():
        raise RuntimeError(
            "ring_attention needs an initialised process group: call "
            "torch.distributed.init_process_group(...) first (e.g. backend 'gloo' on CPU, "
            "'nccl' on GPU), or use attnkit.attention on a single process"
        )
    if group is not None and dist.get_rank(group) < 0:
        raise RuntimeError(
            f"this process (global rank {dist.get_rank()}) is not a member of the given "
            "process group: call ring_attention only on the group's ranks"
        )
    ring = _Ring(group)
    local_error: Exception | None = None
    prep = None
    try:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"ring_attention: {name} must be a torch.Tensor, got "
                                f"{type(t).__name__}")
        prep = prepare(q, k, v, scale=scale, softcap=softcap)
        _backends.check_name(backend)
        p = prep.problem
        if is_causal and p.n_q != p.n_k:
            raise ValueError(
                f"ring_attention with is_causal=True needs query and key shards of one length "
                f"(a self-attention sequence split evenly), got N_q={p.n_q} (q "
                f"{tuple(q.shape)}) and N_k={p.n_k} (k {tuple(k.shape)})"
            )
        if ring.backend == "nccl" and q.device.type != "cuda":
            raise ValueError(f"the NCCL backend needs CUDA tensors, got q on {q.device}: "
                             "move the shards to the GPU or use the gloo backend")
    except (TypeError, ValueError) as e:
        local_error = e
    _check_group(q, k, v, ring, is_causal, local_error)
    assert prep is not None
    p = prep.problem
    o = _Options(ring, is_causal, p.scale, softcap, backend)
    out, lse = _RingAttention.apply(p.q, p.k, p.v, o)
    if return_lse:
        return prep.restore(out), prep.restore(lse)
    return prep.restore(out)
