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

    hop s = 0 .. W-1:  this rank holds the K/V shard of rank  src = (r - s) mod W
        start   send K/V shard → rank r+1,  receive the next one ← rank r-1   (async)
        compute (o_s, lse_s) = attention(q, K_src, V_src, return_lse=True)
                  is_causal: src > r → skipped (the future); src == r → local causal mask;
                             src < r → no mask (the past)
        merge   (out, lse) ← merge_partials([(out, lse), (o_s, lse_s)])   (by log-sum-exp)
        wait    for the exchange (at most ``timeout`` s); the received shard is the next block

Each block goes through :func:`attnkit.attention`, so the fastest backend that supports it
runs. The merge is −∞-aware: a block in which a query may see no key contributes nothing.

The backward pass runs the same ring once more, FlashAttention-style. Each K/V shard travels
with its own dK/dV accumulator; at every hop a rank recomputes its block under autograd and
asks for the gradients of the block's ``(o_s, lse_s)``, weighted by the block's share
``w_s = exp(lse_s − lse)`` of the global softmax (``∂L/∂o_s = w_s·dO`` and
``∂L/∂lse_s = w_s·(dO·o_s − dO·out)``). After ``W`` hops every accumulator is back on its
owner as the full dK/dV; dQ never leaves its rank.

Failures are collective, so that no rank is left waiting:

- before any shard moves, every rank all-gathers a small vector of its shapes, dtype and
  options (``is_causal``, ``scale``, ``softcap``, ``backend``, whether it needs a backward) and
  whether its inputs passed local validation; a difference, or a rank's invalid inputs, raise
  on every rank, naming the option and each rank's value. A forced ``backend`` that cannot
  run the forward or the backward blocks of the call is refused then, not half-way through;
- an error while computing a block does not stop the ring: the rank passes the shards on and,
  after the last hop, every rank all-gathers a status word, so all ranks raise together
  (the failing rank its own error, the others :class:`RingAttentionError` naming it and hop);
- every wait for a peer ends after ``timeout`` seconds (default five minutes) with a
  :class:`RingAttentionError` that names this rank, the peer and the hop ("forward hop 1",
  "backward hop 0"); a peer that died is reported the same way, not as a raw gloo error.

Use::

    import torch.distributed as dist
    import attnkit.distributed

    dist.init_process_group("nccl")                         # or "gloo" on CPU
    out = attnkit.distributed.ring_attention(q, k, v, is_causal=True)   # local shards in

Caution
-------
- Tested with the gloo backend on CPU (2 and 3 processes). NCCL on GPU uses the same code
  path (``batch_isend_irecv``, ``Work.wait(timeout)``) but is not covered by the test suite.
- Each call costs two small all-gathers besides the ring (the option check and the status
  after the forward), the backward one more; each is a synchronisation point (on GPU the
  CPU waits there for the ring's kernels).
- After a timeout or a lost peer the process group is not usable any more (gloo closes the
  connection): re-create it, or end the job. A rank that never calls the backward is only
  noticed by the timeout of its peers. ``timeout=None`` waits as long as the process
  group's own timeout (30 minutes by default).
- With ``is_causal=True`` and contiguous shards the work is unbalanced: rank ``r`` computes
  ``r + 1`` blocks (the last rank does ``W``), while every rank still forwards every shard.
  Zig-zag / striped layouts that balance it are not implemented.
- Causal ring attention needs ``N_q == N_k`` (a self-attention sequence split into equal
  shards). Only ``scale``, ``softcap`` and ``backend`` are passed through to the blocks: masks
  other than the global causal one, ``score_mod`` and dropout are not supported (they would
  need global positions).
- First derivatives only: the backward ring is hand-written, so second derivatives
  (``create_graph=True``) are refused.
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

import math
import numbers
import re
import struct
import time
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import backends as _backends
from .api import attention, prepare
from .backends.base import (
    Problem,
    compute_dtype,
    merge_partials,
    refuse_double_backward,
    softmax_shift,
)

__all__ = ["ring_attention", "RingAttentionError", "DEFAULT_TIMEOUT_S"]

DEFAULT_TIMEOUT_S = 300.0   # the longest wait for a peer (seconds) unless the caller says
_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
_META_DIMS = 6          # the trailing dims of q/k/v shown per rank (padded with -1)
_LEAD_DIMS = 4          # leading dims beyond those, recorded too (a CRC covers the rest)
_NAME_SLOTS = 4         # the backend name travels as 8 bytes per int64 slot (32 bytes shown)


class RingAttentionError(RuntimeError):
    """A ring hop failed, timed out or lost its peer, or another rank of the group failed:
    the message names this rank, the peer or the failing rank, and the hop."""


@dataclass
class _Hop:
    """One started exchange: the receive buffer (valid after :meth:`_Ring.wait`) and the
    requests, each with what it moves and to/from whom (for the error message)."""

    recv: torch.Tensor
    works: list[tuple[Any, str, int]]    # (request, "sending the K/V shard to", peer rank)
    step: str                            # "forward hop 1", "backward hop 0"


class _Ring:
    """Who this rank is in the ring, how to talk to its neighbours, and how long to wait."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        world = group is None or group is dist.group.WORLD

        def global_rank(r: int) -> int:
            return r if world else dist.get_global_rank(group, r)

        self.next_r, self.prev_r = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        self.next, self.prev = global_rank(self.next_r), global_rank(self.prev_r)
        self.backend = str(dist.get_backend(group))
        self.device = torch.device("cpu")   # where small collectives' tensors live
        self.timeout: float | None = DEFAULT_TIMEOUT_S

    def exchange(self, send: torch.Tensor, what: str, step: str) -> _Hop:
        """Start sending ``send`` (``what``) to the next rank and receiving its like from the
        previous one; ``send`` must not be modified before :meth:`wait`."""
        if self.size == 1:
            return _Hop(send.clone(), [], step)
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.group),
               dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        try:
            reqs = dist.batch_isend_irecv(ops)
        except RuntimeError as e:
            raise self._lost(e, step, f"starting to exchange {what} with ranks "
                                      f"{self.next_r} and {self.prev_r}") from e
        roles = [(f"sending {what} to", self.next_r), (f"receiving {what} from", self.prev_r)]
        if len(reqs) != len(roles):     # a coalesced backend returns one request for both
            roles = [(f"exchanging {what} with", self.next_r)] * len(reqs)
        return _Hop(recv, [(r, a, p) for r, (a, p) in zip(reqs, roles, strict=True)], step)

    def wait(self, hop: _Hop) -> torch.Tensor:
        """The received buffer once the exchange is done; a clear error after ``timeout``."""
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        for work, action, peer in hop.works:
            self._wait(work, deadline, hop.step, f"{action} rank {peer}")
        return hop.recv

    def all_gather(self, row: list[int], step: str) -> list[list[int]]:
        """Every rank's ``row`` (small int64 vectors of one length), within ``timeout``."""
        mine = torch.tensor(row, dtype=torch.int64, device=self.device)
        if self.size == 1:
            return [row]
        rows = [torch.empty_like(mine) for _ in range(self.size)]
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        try:
            work = dist.all_gather(rows, mine, group=self.group, async_op=True)
        except RuntimeError as e:
            raise self._lost(e, step, "the all-gather with every rank of the group") from e
        self._wait(work, deadline, step, "the all-gather with every rank of the group")
        return [r.tolist() for r in rows]

    def _wait(self, work: Any, deadline: float | None, step: str, doing: str) -> None:
        try:
            if deadline is None:
                work.wait()
            else:
                work.wait(timeout=timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
        except RuntimeError as e:      # gloo / NCCL errors (DistBackendError is one too)
            raise self._lost(e, step, doing) from e

    def _lost(self, e: Exception, step: str, doing: str) -> RingAttentionError:
        """The error for a wait that failed: which rank, which hop, what it was doing, why."""
        raw = re.sub(r"^\[[^\]]*\]\s*", "", str(e).strip()).split(". ")[0][:200]
        where = f"ring_attention on rank {self.rank} (of {self.size}), {step}: {doing}"
        if "timed out" in raw.lower() or "timeout" in raw.lower():
            limit = ("the process group's timeout" if self.timeout is None
                     else f"timeout={self.timeout:g} s")
            return RingAttentionError(
                f"{where} did not complete within {limit}. The rank it "
                "waits for failed, crashed, did not make the same call (ring_attention, or "
                "the backward of its result), or is that much slower: see that rank's log, "
                "or pass a larger `timeout` if the ranks are legitimately that far apart. "
                "The process group cannot be used after this.")
        if re.search(r"connection|closed|reset|broken pipe|read error|write error", raw.lower()):
            return RingAttentionError(
                f"{where} failed: the connection was lost ({raw}). The peer most likely "
                "crashed or exited: see its log. The process group cannot be used after this.")
        return RingAttentionError(f"{where} failed: {raw}")

    def settle(self, failure: Exception | None, hop: int, phase: str) -> None:
        """After a ring: every rank learns whether any rank's computation failed (one small
        all-gather), and then all raise together instead of leaving peers waiting."""
        rows = self.all_gather([hop if failure is not None else -1],
                               f"the status check after the {phase}")
        if failure is not None:
            if hasattr(failure, "add_note"):        # Python ≥ 3.11
                failure.add_note(f"ring_attention: raised on rank {self.rank} in {phase} hop "
                                 f"{hop}; the other ranks raise RingAttentionError naming it")
            raise failure
        bad = [f"rank {i} in {phase} hop {r[0]}" for i, r in enumerate(rows) if r[0] >= 0]
        if bad:
            raise RingAttentionError(
                f"ring_attention: {', '.join(bad)} failed (its error is raised there); rank "
                f"{self.rank} stops with it, and no rank returns a result")


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
    failure: Exception | None = None
    failed_at = -1
    for s in range(ring.size):
        src = (ring.rank - s) % ring.size
        hop = ring.exchange(kv, "the K/V shard", f"forward hop {s}") if s < ring.size - 1 \
            else None
        if failure is None and o.computes(src):
            try:        # a failure here must not stop the ring: the shards still move on
                k_b, v_b = _unpack(kv, shapes)
                o_b, lse_b = o.block(q, k_b, v_b, src)
                out, lse = merge_partials([(out, lse), (o_b, lse_b.to(acc))], inplace=True)
            except Exception as e:
                failure, failed_at = e, s
        if hop is not None:
            kv = ring.wait(hop)
    ring.settle(failure, failed_at, "forward")
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
    dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
    dkv_hop: _Hop | None = None     # the accumulator of the shard we hold, on its way to us
    failure: Exception | None = None
    failed_at = -1
    for s in range(ring.size):
        src = (ring.rank - s) % ring.size
        step = f"backward hop {s}"
        kv_hop = ring.exchange(kv, "the K/V shard", step) if s < ring.size - 1 else None
        grad_kv = None
        if failure is None and o.computes(src):
            try:        # a failure here must not stop the ring: the accumulators move on
                k_b, v_b = _unpack(kv, shapes)
                g_q, g_k, g_v = _block_grads(q, k_b, v_b, src, o, d_out, delta, lse)
                dq += g_q.to(acc)
                grad_kv = _pack(g_k.to(acc), g_v.to(acc))
            except Exception as e:
                failure, failed_at = e, s
        if dkv_hop is not None:
            dkv = ring.wait(dkv_hop)
        if grad_kv is not None:
            dkv = dkv + grad_kv
        dkv_hop = ring.exchange(dkv, "the dK/dV accumulator", step)   # W hops: home again
        if kv_hop is not None:
            kv = ring.wait(kv_hop)
    assert dkv_hop is not None
    dkv = ring.wait(dkv_hop)
    ring.settle(failure, failed_at, "backward")
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


# ------------------------------------------------------------- the collective option check
def _bits(x: float) -> int:
    """A float as the int64 with the same bits (compared exactly, shown as the float)."""
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _float(b: int) -> float:
    return struct.unpack("<d", struct.pack("<q", b))[0]


def _shape_row(t: Any) -> list[int]:
    """[ndim, crc of the shape, last _META_DIMS sizes, the _LEAD_DIMS before] (-1 = none)."""
    n = _META_DIMS + _LEAD_DIMS
    if not isinstance(t, torch.Tensor):
        return [-1, -1] + [-1] * n
    shape = list(t.shape)
    tail = shape[-_META_DIMS:]
    lead = shape[:-_META_DIMS][-_LEAD_DIMS:] if t.dim() > _META_DIMS else []
    row = tail + [-1] * (_META_DIMS - len(tail)) + lead + [-1] * (_LEAD_DIMS - len(lead))
    return [t.dim(), zlib.crc32(repr(shape).encode())] + row


def _fmt(row: list[int]) -> str:
    ndim = row[0]
    if ndim < 0:
        return "(not a tensor)"
    tail = ", ".join(map(str, row[2:2 + min(ndim, _META_DIMS)]))
    if ndim <= _META_DIMS:
        return f"({tail})"
    lead = [str(d) for d in row[2 + _META_DIMS:] if d >= 0]
    more = "…, " if ndim > _META_DIMS + _LEAD_DIMS else ""
    return f"(…, {tail}) after leading dims ({more}{', '.join(lead)})"


def _name_row(name: Any) -> list[int]:
    """A short string (backend name, device type) as [crc, 8-byte slots…]: enough to show
    it and to compare it."""
    if not isinstance(name, str):
        return [-1] * (_NAME_SLOTS + 1)
    raw = name.encode()[:8 * _NAME_SLOTS].ljust(8 * _NAME_SLOTS, b"\0")
    return [zlib.crc32(name.encode())] + [int.from_bytes(raw[i:i + 8], "little", signed=True)
                                          for i in range(0, len(raw), 8)]


def _name(row: list[int]) -> str:
    if row[0] < 0:
        return "(not a string)"
    raw = b"".join(x.to_bytes(8, "little", signed=True) for x in row[1:])
    return repr(raw.rstrip(b"\0").decode(errors="replace"))


_W = 2 + _META_DIMS + _LEAD_DIMS      # one tensor's shape record
# (label, width in the row, formatter) of each field that must agree, in _option_row's order
_SPEC: tuple[tuple[str, int, Any], ...] = (
    ("shard shapes", 3 * _W, lambda r: ", ".join(
        f"{n} {_fmt(r[i * _W:(i + 1) * _W])}" for i, n in enumerate("qkv"))),
    ("dtype", 1, lambda r: str(_DTYPES[r[0]]).replace("torch.", "") if r[0] >= 0 else "?"),
    ("is_causal", 1, lambda r: f"is_causal={bool(r[0])}"),
    ("scale", 2, lambda r: f"scale={_float(r[1])!r}" if r[0] else "scale=?"),
    ("softcap", 2, lambda r: f"softcap={_float(r[1])!r}" if r[0] else "softcap=None"),
    ("backend", 1 + _NAME_SLOTS, lambda r: f"backend={_name(r)}"),
    ("device type", 1 + _NAME_SLOTS, lambda r: _name(r)),
    ("needs a backward", 1, lambda r: (
        "inputs require grad" if r[0] else "no input requires grad (or torch.no_grad)")),
)
# (label, first index, width, formatter); index 0 of a row is the local-error flag
_FIELDS = tuple((label, 1 + sum(w for _, w, _ in _SPEC[:i]), width, fmt)
                for i, (label, width, fmt) in enumerate(_SPEC))


def _option_row(q: Any, k: Any, v: Any, local_error: Exception | None, is_causal: Any,
                scale: float | None, softcap: Any, backend: Any, needs_grad: bool) -> list[int]:
    dtype = q.dtype if isinstance(q, torch.Tensor) else None
    row = [int(local_error is not None)]
    row += _shape_row(q) + _shape_row(k) + _shape_row(v)
    row += [_DTYPES.index(dtype) if dtype in _DTYPES else -1, int(bool(is_causal))]
    row += [0, 0] if scale is None else [1, _bits(scale)]
    row += [1, _bits(softcap)] if isinstance(softcap, float) else [0, 0]
    device = q.device.type if isinstance(q, torch.Tensor) else None
    row += _name_row(backend) + _name_row(device) + [int(needs_grad)]
    assert len(row) == _FIELDS[-1][1] + _FIELDS[-1][2], "row and _SPEC out of step"
    return row


def _check_group(ring: _Ring, row: list[int], local_error: Exception | None) -> None:
    """All-gather every rank's row; raise the same clear error on every rank if any rank's
    inputs were invalid or any field differs between ranks."""
    rows = ring.all_gather(row, "the option check (before any shard moves)")
    bad = [i for i, r in enumerate(rows) if r[0]]
    if bad:
        if local_error is not None:
            raise local_error
        raise RuntimeError(
            f"ring_attention: rank(s) {bad} of the group were given invalid inputs (see the "
            f"error raised there); this rank ({ring.rank}) stopped with them"
        )
    differ = []
    for label, at, width, fmt in _FIELDS:
        vals = [r[at:at + width] for r in rows]
        if any(x != vals[0] for x in vals):
            differ.append(f"{label}: " + "; ".join(f"rank {i}: {fmt(x)}"
                                                   for i, x in enumerate(vals)))
    if differ:
        raise ValueError(
            "ring_attention needs the same shard shapes, dtype and options on every rank, "
            "but they differ — " + " | ".join(differ) + ". Pass the same options on every "
            "rank, and pad the sequence so that it splits into equal shards."
        )


def _refuse_unrunnable(p: Problem, backend: str, is_causal: bool, size: int,
                       needs_grad: bool) -> None:
    """A forced backend that cannot run the forward or the backward blocks of this call is
    refused now, before any shard moves (not half-way through a ring, or in the backward)."""
    if backend == "auto" or p.n_q == 0 or p.n_k == 0:     # "auto" always finds one
        return
    masks = ([True] if is_causal else []) + ([False] if size > 1 or not is_causal else [])
    acc = compute_dtype(p.dtype)
    reasons: dict[str, list[str]] = {}
    for phase in ("forward", "backward") if needs_grad else ("forward",):
        for causal in masks:
            if phase == "forward":
                with torch.no_grad():
                    blk = prepare(p.q, p.k, p.v, is_causal=causal, scale=p.scale,
                                  softcap=p.softcap).problem
                    why = _backends.get(backend).not_supported_reasons(blk)
            else:       # recomputed in the accumulation dtype, under autograd
                lv = [torch.empty_strided(t.shape, (0,) * t.dim(), dtype=acc,
                                          device=t.device).requires_grad_()
                      for t in (p.q, p.k, p.v)]
                with torch.enable_grad():
                    blk = prepare(*lv, is_causal=causal, scale=p.scale,
                                  softcap=p.softcap).problem
                    why = _backends.get(backend).not_supported_reasons(blk)
            for w in why:
                reasons.setdefault(w, [])
                if phase not in reasons[w]:
                    reasons[w].append(phase)
    if reasons:
        said = "; ".join(f"{w} [{' and '.join(ph)}]" for w, ph in reasons.items())
        raise ValueError(
            f"ring_attention: backend {backend!r} cannot run the blocks of this call: {said}. "
            "Choose a backend that can (or 'auto')"
            + (", or call under torch.no_grad() if no gradients are needed"
               if needs_grad else "") + "."
        )


def _check_timeout(timeout: Any) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"ring_attention: timeout must be a number of seconds or None, got "
                        f"{type(timeout).__name__}")
    if not (math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"ring_attention: timeout must be a finite number of seconds > 0, "
                         f"got {timeout!r} (None waits as long as the process group does)")
    return float(timeout)


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
    timeout: float | None = DEFAULT_TIMEOUT_S,
) -> Any:
    """Exact attention over a sequence sharded across the ranks of a process group.

    Shapes (per rank; the global sequence is the concatenation of the shards in rank order)::

        q (..., H_q, N_q, D_k)   k (..., H_kv, N_k, D_k)   v (..., H_kv, N_k, D_v)
        → out (..., H_q, N_q, D_v)       [and lse (..., H_q, N_q) with return_lse=True]

    Rank ``r`` passes queries ``[r·N_q, (r+1)·N_q)`` and keys/values ``[r·N_k, (r+1)·N_k)``
    of the global sequence and gets back its rows of the global output. Differentiable: the
    gradients of q, k, v are those of single-process :func:`attnkit.attention` on the
    concatenated sequence (restricted to this rank's shard). Every rank of the group must call
    this together with the same shapes and options (and, when the inputs need gradients, the
    backward of the result).

    Args:
        group: the ``torch.distributed`` process group; ``None`` = the default group.
        is_causal: global causal attention (query at global position i sees keys 0..i).
            Needs ``N_q == N_k``. Blocks from later ranks are skipped entirely.
        scale: multiplies the scores; defaults to ``1/√D_k``.
        softcap: ``c`` maps each scaled logit x to ``c·tanh(x/c)``.
        backend: backend for each block (as in :func:`attnkit.attention`); default ``"auto"``.
        return_lse: also return the global log-sum-exp of this rank's query rows.
        timeout: the longest wait, in seconds, for a peer at any step (the option check, each
            hop of the forward and the backward ring, the status checks); default
            :data:`DEFAULT_TIMEOUT_S` (five minutes). ``None``: the process group's timeout.

    Raises:
        RuntimeError: torch.distributed is unavailable or the process group is not
            initialised, or this process is not a member of ``group``.
        ValueError / TypeError: invalid inputs or options on any rank, options that differ
            between ranks, or a forced ``backend`` that cannot run the blocks (raised on
            every rank, before any shard moves).
        RingAttentionError: a peer timed out, died, or failed in the ring (its own error is
            raised on the failing rank).
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
    if ring.backend == "nccl":      # NCCL only moves CUDA tensors
        ring.device = (q.device if isinstance(q, torch.Tensor) and q.is_cuda
                       else torch.device("cuda", torch.cuda.current_device()))
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v))
    local_error: Exception | None = None
    prep = None
    try:
        ring.timeout = _check_timeout(timeout)
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
        _refuse_unrunnable(p, backend, bool(is_causal), ring.size, needs_grad)
    except Exception as e:      # any local failure: the peers must hear of it, not wait
        local_error = e
    resolved = prep.problem if prep is not None else None     # scale as it will be used
    _check_group(ring, _option_row(q, k, v, local_error, is_causal,
                                   getattr(resolved, "scale", None),
                                   getattr(resolved, "softcap", None), backend, needs_grad),
                 local_error)
    assert prep is not None
    p = prep.problem
    o = _Options(ring, bool(is_causal), p.scale, p.softcap, backend)
    out, lse = _RingAttention.apply(p.q, p.k, p.v, o)
    if return_lse:
        return prep.restore(out), prep.restore(lse)
    return prep.restore(out)
