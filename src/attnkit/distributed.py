"""Ring attention: exact attention over a sequence sharded across torch.distributed ranks.

Sequence parallelism for long context: each of the ``W`` ranks of a process group holds one
shard of the sequence (``N_q``, ``N_k`` = the local shard lengths, the same on every rank).
The result on each rank is that rank's shard of ``attention(Q_global, K_global, V_global)``,
exactly — not an approximation. Two strategies (``strategy=``) and two layouts (``layout=``)::

    strategy="ring"     (default) K/V shards travel around a ring; each rank attends its
                        queries to every shard in turn and merges the blocks by log-sum-exp
    strategy="ulysses"  one all-to-all turns sequence shards into head shards (rank j gets
                        heads [j·H/W, (j+1)·H/W) over the WHOLE sequence), one local
                        attention call, one all-to-all back (DeepSpeed-Ulysses)
    layout="contiguous" (default) rank r holds positions [r·n, (r+1)·n) (n = N/W)
    layout="zigzag"     the sequence is cut into 2·W chunks of c = N/(2W); rank r holds
                        chunks r and 2W−1−r, concatenated (head–tail). N = 8, W = 2:
                        rank 0 [0 1 6 7], rank 1 [2 3 4 5]. Balances causal work.

:func:`shard_sequence`, :func:`unshard_sequence` and :func:`sequence_positions` cut a global
tensor into a rank's shard, put every rank's shards back together, and give a shard's global
positions (for RoPE: rotate each shard by its own positions before the call).

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
        compute (o_s, lse_s) = attention(q[rows], K_src[keys], V_src[keys], return_lse=True)
                  not causal: every row, every key, no mask
                  causal, contiguous: src > r → skipped (the future); src == r → local causal
                             mask; src < r → no mask (the past)
                  causal, zigzag (each pair of chunks is full, causal-diagonal or skipped):
                             src == r → local causal mask (= the global one on these chunks);
                             src < r → all rows × the shard's first chunk;
                             src > r → the second query chunk × the whole shard
        merge   (out, lse)[rows] ← merge_partials([(out, lse)[rows], (o_s, lse_s)])  (by LSE)
        wait    for the exchange (at most ``timeout`` s); the received shard is the next block

With contiguous shards, causal rank ``r`` computes ``r + 1`` blocks of ``n²`` (the last rank
``W``: it sets the pace); with zigzag shards every rank computes the same ``2c²`` on every
hop. Each block goes through :func:`attnkit.attention`, so the fastest backend that supports
it runs. The merge is −∞-aware: a block in which a query may see no key contributes nothing.

The backward pass runs the same ring once more, FlashAttention-style. Each K/V shard travels
with its own dK/dV accumulator; after ``W`` hops every accumulator is back on its owner as
the full dK/dV; dQ never leaves its rank. Per block:

- when the blocks run on attnkit's native CPU kernel (``backend`` "auto" or "tiled" and the
  kernel built), the kernel's own FlashAttention-2 backward is called with the SAVED GLOBAL
  LSE and ``delta = rowsum(dO·out) − dLSE``: the weights it rebuilds, ``exp(s − lse)``, are
  already the block's share of the global softmax, so one kernel call gives the block's
  dQ, dK, dV — no forward recompute, no autograd graph, no ``(N_q, N_k)`` buffer;
- otherwise the rank recomputes its block under autograd and asks for the gradients of the
  block's ``(o_s, lse_s)``, weighted by the block's share ``w_s = exp(lse_s − lse)`` of the
  global softmax (``∂L/∂o_s = w_s·dO`` and ``∂L/∂lse_s = w_s·(dO·o_s − dO·out)``).

The Ulysses strategy: ``H_q`` must be a multiple of ``W``. K/V heads that ``W`` does not
divide are repeated first, each ``e = W / gcd(H_kv, W)`` times (the least that makes them
divisible while keeping every query head with its own K/V head; MQA on 2 ranks sends each
K/V head twice). q, k, v go in ONE all-to-all, the local call sees the whole sequence in
global order (a zigzag layout is permuted there and back), so every option of
:func:`attnkit.attention` that does not depend on the head index works: ``mask=`` (a
:class:`~attnkit.masks.Mask` over the global sequence: sliding windows, documents, padding,
…), ``score_mod=`` (ALiBi and relative-bias terms are sliced to the rank's heads — a bias
table's gradient reaches it; any other function is called with the global head index
``h + h0``). The backward is autograd through the local call and the all-to-alls (each
one's backward is the reverse exchange).

Which wins (rule of thumb; measured numbers in ``benchmarks/bench_ring.py``):

- per rank the ring sends ``2·(W−1)`` K/V shards in the forward and ``4·(W−1)`` (K/V and
  dK/dV) in the backward — about ``N·H_kv·D`` elements each way whatever ``W`` — but hides
  them behind the blocks' compute; Ulysses sends about ``(q, k, v, out, and the same in the
  backward)·(W−1)/W`` of its shard — it shrinks with ``W`` — but nothing overlaps it;
- Ulysses: when ``W`` divides ``H_q`` (and ideally ``H_kv``), the network is slow relative to
  compute, or a mask / score_mod the ring does not take is needed; one large local call
  (no per-hop merges, the best kernel tiling) and causal work is balanced by construction;
- ring (zigzag for causal): when ``W > H_q`` or ``W`` does not divide the heads, with few
  K/V heads (GQA/MQA: the ring moves only K/V, Ulysses would repeat them), or when the
  exchange hides behind the compute (long shards: compute grows as ``n²``, traffic as ``n``).

Failures are collective, so that no rank is left waiting:

- before any shard moves, every rank all-gathers a small vector of its shapes, dtype and
  options (``is_causal``, ``scale``, ``softcap``, ``backend``, ``layout``, ``strategy``, the
  names of ``mask`` and ``score_mod``, ``return_lse``, whether it needs a backward) and
  whether its inputs passed local validation; a difference, or a rank's invalid inputs, raise
  on every rank, naming the option and each rank's value. A forced ``backend`` that cannot
  run the forward or the backward blocks of the call is refused then, not half-way through;
- an error while computing a block does not stop the ring: the rank passes the shards on and,
  after the last hop, every rank all-gathers a status word, so all ranks raise together
  (the failing rank its own error, the others :class:`RingAttentionError` naming it and hop);
  Ulysses does the same after its local call, before the second all-to-all;
- every wait for a peer ends after ``timeout`` seconds (default five minutes) with a
  :class:`RingAttentionError` that names this rank, the peer and the hop ("forward hop 1",
  "backward hop 0", "ulysses backward (… all-to-all …)"); a peer that died is reported the
  same way, not as a raw gloo error.

Use::

    import torch.distributed as dist
    import attnkit.distributed as akd

    dist.init_process_group("nccl")                         # or "gloo" on CPU
    out = akd.ring_attention(q, k, v, is_causal=True)       # local shards in

    # balanced causal: shard the global sequence head–tail, rotate by global positions
    qs, ks, vs = (akd.shard_sequence(t, layout="zigzag") for t in (q_all, k_all, v_all))
    pos = akd.sequence_positions(q_all.shape[-2], layout="zigzag")
    out = akd.ring_attention(rope(qs, positions=pos), rope(ks, positions=pos), vs,
                             is_causal=True, layout="zigzag")
    out = akd.ring_attention(qs, ks, vs, is_causal=True, layout="zigzag", strategy="ulysses",
                             score_mod=ak.scores.alibi(H_q))    # heads instead of a ring

Caution
-------
- Tested with the gloo backend on CPU (2 and 3 processes). NCCL on GPU uses the same code
  path (``batch_isend_irecv``, ``all_to_all_single``, ``Work.wait(timeout)``) but is not
  covered by the test suite.
- Each call costs two small all-gathers besides the ring (the option check and the status
  after the forward), the backward one more; each is a synchronisation point (on GPU the
  CPU waits there for the ring's kernels).
- After a timeout or a lost peer the process group is not usable any more (gloo closes the
  connection): re-create it, or end the job. A rank that never calls the backward is only
  noticed by the timeout of its peers. ``timeout=None`` waits as long as the process
  group's own timeout (30 minutes by default).
- Layouts: ``contiguous`` needs equal shards (the global length a multiple of ``W``);
  ``zigzag`` needs even shard lengths ``N_q`` and ``N_k`` (the global length a multiple of
  ``2·W``), checked on every rank with a clear error — pad the sequence and mask the padding.
  Both layouts are exact; only causal work balance (and the Ulysses permutation) differ.
- Causal ring attention needs ``N_q == N_k`` (a self-attention sequence split into equal
  shards). The ring passes only ``scale``, ``softcap`` and ``backend`` to its blocks: masks
  other than the global causal one, ``score_mod`` and dropout need ``strategy="ulysses"``
  (and dropout is supported by neither).
- Ulysses: ``H_q`` a multiple of ``W`` (a clear error otherwise: use the ring); masks that
  depend on the head index and dense mask tensors are refused (the rank holds a slice of
  the heads; a tensor would have to be the global ``(N, N)`` one). Its backward is autograd:
  a rank whose local backward fails raises its own error there, and its peers stop at the
  next all-to-all after ``timeout`` (not at once, as in the ring). Every rank holds its
  heads' full-sequence q, k, v, out (the same number of elements as its shard) and, causal
  or not, the local call's own memory.
- First derivatives only: the backward ring is hand-written, so second derivatives
  (``create_graph=True``) are refused (Ulysses: as its local call's backend does).
- The ring's autograd backward path (a forced backend other than "tiled", or no native
  kernel) needs the gradient of each block's log-sum-exp. A backend whose LSE carries one
  (reference, tiled, triton) does each block in one recompute. For a backend whose LSE does
  not (detected per call), that part is added by hand from one more attention call per block
  (with K as the values): about twice the backward work, still O(N) memory. With ``softcap``
  that shortcut does not apply, and such blocks are recomputed with the reference backend
  (O(N_q·N_k) memory per block).
- Precision: for float16/bfloat16 inputs the forward blocks run in the input dtype and are
  merged in float32; the backward computes each block in float32 (q, k, v of the block
  converted), so that a block's gradients are not rounded to half precision before they are
  summed over the ring (the accumulation contract of attnkit). On GPUs that backward is
  slower than a half-precision one would be.
- Memory: the forward keeps one extra K/V shard in flight; the backward keeps a K/V shard and
  its dK/dV accumulator (float32 for half-precision inputs) in flight, the block's gradients,
  and, on the autograd path only, a float32 copy of the block being recomputed and its graph.
- The exchange overlaps the compute only as far as the process group's backend progresses
  sends in the background (gloo and NCCL do); nothing measures that per call.
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
from . import masks as _masks
from . import scores as _scores
from .api import attention, prepare
from .backends.base import (
    Problem,
    compute_dtype,
    merge_partials,
    refuse_double_backward,
    softmax_shift,
)

__all__ = ["ring_attention", "RingAttentionError", "DEFAULT_TIMEOUT_S", "LAYOUTS",
           "STRATEGIES", "shard_sequence", "unshard_sequence", "sequence_positions"]

DEFAULT_TIMEOUT_S = 300.0   # the longest wait for a peer (seconds) unless the caller says
LAYOUTS = ("contiguous", "zigzag")   # how the global sequence is split over the ranks
STRATEGIES = ("ring", "ulysses")     # K/V shards around a ring, or heads by all-to-all
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

    def all_to_all(self, send: torch.Tensor, step: str) -> torch.Tensor:
        """Chunk j of ``send`` (W, M) to rank j, chunk i of the result from rank i, within
        ``timeout``."""
        if self.size == 1 or send.numel() == 0:
            return send.clone()
        recv = torch.empty_like(send)
        doing = "the all-to-all with every rank of the group"
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        try:
            work = dist.all_to_all_single(recv, send, group=self.group, async_op=True)
        except RuntimeError as e:
            raise self._lost(e, step, doing) from e
        self._wait(work, deadline, step, doing)
        return recv

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

    def settle(self, failure: Exception | None, hop: int, phase: str,
               where: str | None = None) -> None:
        """After a ring: every rank learns whether any rank's computation failed (one small
        all-gather), and then all raise together instead of leaving peers waiting. ``where``
        names the step instead of "<phase> hop <hop>" (the all-to-all strategy's one call)."""
        rows = self.all_gather([hop if failure is not None else -1],
                               f"the status check after the {phase}")

        def at(h: int) -> str:
            return where if where is not None else f"{phase} hop {h}"

        if failure is not None:
            if hasattr(failure, "add_note"):        # Python ≥ 3.11
                failure.add_note(f"ring_attention: raised on rank {self.rank} in {at(hop)}; "
                                 "the other ranks raise RingAttentionError naming it")
            raise failure
        bad = [f"rank {i} in {at(r[0])}" for i, r in enumerate(rows) if r[0] >= 0]
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
                 backend: str, layout: str = "contiguous", n_q: int = 0, n_k: int = 0,
                 ) -> None:
        self.ring = ring
        self.is_causal = is_causal
        self.scale = scale              # resolved: 1/√D_k when the caller gave None
        self.softcap = softcap
        self.backend = backend
        self.grad_backend = backend     # becomes "reference" if the blocks' LSE has no grad
        self.layout = layout
        self.n_q, self.n_k = n_q, n_k   # this rank's shard lengths

    def plan(self, src: int) -> tuple[slice, slice, bool] | None:
        """This rank's block over the K/V shard of rank ``src``: (its query rows, the shard's
        key rows, whether the block is causal-diagonal), or None (skipped: the future).

        contiguous: src < r full, src == r causal, src > r skipped (rank r does r + 1 blocks).
        zigzag (rank r holds chunks r and 2W−1−r, each of half a shard): src == r both rows
        over both chunks, causal (the local causal mask is exactly the global one); src < r
        all rows over the shard's first chunk; src > r the second query chunk over the whole
        shard — two chunk-pairs of work on every hop and every rank."""
        every = slice(None)
        if not self.is_causal:
            return every, every, False
        r = self.ring.rank
        if src == r:
            return every, every, True
        if self.layout == "contiguous":
            return (every, every, False) if src < r else None
        if src < r:
            return every, slice(0, self.n_k // 2), False
        return slice(self.n_q // 2, None), every, False

    def block(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
              backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, lse) of queries ``q`` over one K/V block (``causal``: the diagonal block)."""
        return attention(q, k, v, is_causal=causal, scale=self.scale, softcap=self.softcap,
                         backend=backend or self.backend, return_lse=True)


def _rows(t: torch.Tensor, rows: slice, dim: int = -2) -> torch.Tensor:
    """``t`` restricted to ``rows`` of the sequence dim ``dim`` (a view)."""
    return t if rows == slice(None) else t[(slice(None),) * (t.dim() + dim) + (rows,)]


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
        plan = o.plan(src)
        if failure is None and plan is not None:
            try:        # a failure here must not stop the ring: the shards still move on
                rows, keys, causal = plan
                k_b, v_b = (_rows(t, keys) for t in _unpack(kv, shapes))
                o_b, lse_b = o.block(_rows(q, rows), k_b, v_b, causal)
                _, lse_m = merge_partials([(_rows(out, rows), _rows(lse, rows, -1)),
                                           (o_b, lse_b.to(acc))], inplace=True)  # out: in place
                _rows(lse, rows, -1).copy_(lse_m)
                del o_b, lse_b, lse_m           # (not alive while the next block is computed)
            except Exception as e:
                failure, failed_at = e, s
        if hop is not None:
            kv = ring.wait(hop)
    ring.settle(failure, failed_at, "forward")
    return out.to(q.dtype), lse


def _block_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                 o: _Options, d_out: torch.Tensor, delta: torch.Tensor, lse: torch.Tensor,
                 ) -> tuple[torch.Tensor, ...]:
    """Gradients of the global loss w.r.t. (q, k, v) through one block (the query rows and
    key rows of :meth:`_Options.plan`; d_out, delta, lse restricted to those query rows).

    d_out (B,H_q,N_q,D_v) and delta = rowsum(dO·out) − dLSE (B,H_q,N_q) in the accumulation
    dtype; lse is the saved global LSE. With ``w = exp(lse_b − lse)`` the block's share,
    ``∂L/∂o_b = w·dO`` and ``∂L/∂lse_b = w·c`` where ``c = rowsum(dO·o_b) − delta``.
    """
    acc = d_out.dtype
    # Recomputed in the accumulation dtype: a half-precision block's gradients would be
    # rounded to half before they are summed over the ring (W roundings instead of one).
    leaves = [t.detach().to(acc).requires_grad_() for t in (q, k, v)]
    with torch.enable_grad():
        o_b, lse_b = o.block(*leaves, causal, backend=o.grad_backend)
        if not lse_b.requires_grad and o.softcap is not None:
            o.grad_backend = "reference"     # no LSE gradient and no shortcut: see below
            o_b, lse_b = o.block(*leaves, causal, backend=o.grad_backend)
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
            o_aux, _ = o.block(q_d, k_d, v_aux, causal)                        # Σ_j p_ij k_j
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
    from .backends import native, tiled

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
    ops = native._ops()
    try:        # the operator this module calls by name: its schema, argument by argument
        names = tuple(a.name for a in ops.attend_backward.default._schema.arguments)
    except (AttributeError, RuntimeError):
        return None
    return ops if names == _KERNEL_BACKWARD_ARGS else None      # else: the autograd path


# torch.ops.attnkit_native.attend_backward's arguments, as this module passes them
_KERNEL_BACKWARD_ARGS = (
    "q", "k", "v", "dout", "lse", "delta", "scale", "softcap", "alibi", "alibi_offset",
    "rel_table", "rel_max_distance", "bias", "band_lo", "band_hi", "kv_len", "q_len", "q_doc",
    "k_doc", "mask", "score_mod", "score_mod_caps", "alibi_grad", "bias_grad")


def _kernel_block_grads(ops: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        causal: bool, o: _Options, d_out: torch.Tensor, delta: torch.Tensor,
                        lse: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """:func:`_block_grads` by the native kernel's own (FlashAttention-2) backward, given the
    saved GLOBAL lse and delta: it rebuilds the block's weights as ``exp(s − lse)`` — already
    the block's share of the global softmax — so ``dS = P·(dP − delta)`` is the block's part
    of the global gradient. One kernel call per block: no forward recompute, no autograd
    graph, no O(N_q·N_k) buffer."""
    acc = d_out.dtype
    q, k, v = (t.to(acc).contiguous() for t in (q, k, v))     # a copy only for half inputs
    dq, dk, dv, *_ = ops.attend_backward(
        q, k, v, d_out.contiguous(), lse.contiguous(), delta.contiguous(),
        scale=float(o.scale), softcap=float(o.softcap or 0.0), alibi=None, alibi_offset=0.0,
        rel_table=None, rel_max_distance=0, bias=None,
        band_lo=0.0 if causal else -math.inf, band_hi=math.inf, kv_len=None, q_len=None,
        q_doc=None, k_doc=None, mask=None, score_mod=0, score_mod_caps=0, alibi_grad=False,
        bias_grad=False)
    return dq, dk, dv


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
    kernel = None
    try:        # a failing check here must not stop the ring either: then the autograd path
        if torch.isfinite(lse).all():   # (a row with no key anywhere: the guarded path)
            kernel = _native_backward(q, k, v, o)
    except Exception:
        kernel = None
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
        block_grads = None      # (key rows, dK, dV) of this hop's block, added on arrival
        plan = o.plan(src)
        if failure is None and plan is not None:
            try:        # a failure here must not stop the ring: the accumulators move on
                rows, keys, causal = plan
                k_b, v_b = (_rows(t, keys) for t in _unpack(kv, shapes))
                grads = _kernel_block_grads if kernel is not None else _block_grads
                g_q, g_k, g_v = grads(*((kernel,) if kernel is not None else ()),
                                      _rows(q, rows), k_b, v_b, causal, o, _rows(d_out, rows),
                                      _rows(delta, rows, -1), _rows(lse, rows, -1))
                _rows(dq, rows).add_(g_q)
                block_grads = (keys, g_k, g_v)
                del g_q, g_k, g_v           # (not alive while the next block is computed)
            except Exception as e:
                failure, failed_at = e, s
        if dkv_hop is not None:
            dkv = ring.wait(dkv_hop)    # ours now: the block's gradients go in in place
        if block_grads is not None:
            keys, g_k, g_v = block_grads
            for acc_t, g in zip(_unpack(dkv, shapes), (g_k, g_v), strict=True):
                _rows(acc_t, keys).add_(g)
            del block_grads, g_k, g_v, keys
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


# ------------------------------------------------------------------ the all-to-all strategy
class _AllToAll(torch.autograd.Function):
    """Chunk j of ``x`` (W, M) goes to rank j; chunk i of the result came from rank i. The
    exchange is its own adjoint: the backward is the same all-to-all of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ring: _Ring, step: str, back_step: str,
                ) -> torch.Tensor:
        ctx.ring, ctx.back_step = ring, back_step
        return ring.all_to_all(x.contiguous(), step)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return ctx.ring.all_to_all(g.contiguous(), ctx.back_step), None, None, None


def _heads_out(t: torch.Tensor, w: int) -> torch.Tensor:
    """(B, H, n, D) → (W, B·(H/W)·n·D): chunk j holds head group j (for rank j)."""
    b, h, n, d = t.shape
    return t.reshape(b, w, h // w, n, d).transpose(0, 1).reshape(w, -1)


def _heads_in(buf: torch.Tensor, b: int, hw: int, n: int, d: int) -> torch.Tensor:
    """(W, B·hw·n·D), chunk i = rank i's shard of our heads → (B, hw, W·n, D)."""
    w = buf.shape[0]
    return buf.reshape(w, b, hw, n, d).permute(1, 2, 0, 3, 4).reshape(b, hw, w * n, d)


def _seq_out(t: torch.Tensor, w: int) -> torch.Tensor:
    """(B, hw, W·n, D) → (W, B·hw·n·D): chunk i holds sequence shard i (for rank i)."""
    b, hw, big_n, d = t.shape
    return t.reshape(b, hw, w, big_n // w, d).permute(2, 0, 1, 3, 4).reshape(w, -1)


def _seq_in(buf: torch.Tensor, b: int, hw: int, n: int, d: int) -> torch.Tensor:
    """(W, B·hw·n·D), chunk j = head group j of our shard → (B, W·hw, n, D)."""
    w = buf.shape[0]
    return buf.reshape(w, b, hw, n, d).transpose(0, 1).reshape(b, w * hw, n, d)


def _local_score_mod(score_mod: Any, h0: int, hn: int, h_q: int) -> Any:
    """The score_mod for query heads [h0, h0 + hn) of ``h_q``, called with local head
    indices 0..hn-1: ALiBi and relative-bias terms keep their closed form (their slopes /
    table sliced, gradients flow to the table); any other function sees ``h + h0``."""
    if score_mod is None or (h0 == 0 and hn == h_q):
        return score_mod
    spec = getattr(score_mod, "spec", None)
    if isinstance(score_mod, _scores.ScoreTerm) and isinstance(spec, _scores.Alibi):
        slopes, offset = spec.slopes[h0:h0 + hn], spec.offset

        def alibi(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
            s = slopes.to(device=score.device, dtype=score.dtype)[h]
            return score - s * (q_idx + offset - kv_idx).abs().to(score.dtype)

        return _scores.ScoreTerm(alibi, f"{score_mod.name}[heads {h0}:{h0 + hn}]", hn,
                                 spec=_scores.Alibi(slopes, offset))
    if isinstance(score_mod, _scores.ScoreTerm) and isinstance(spec, _scores.RelativeBias):
        return _scores.relative_bias(spec.table[h0:h0 + hn], spec.max_distance)

    def shifted(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return score_mod(score, b, h + h0, q_idx, kv_idx)

    return shifted


def _ulysses_problem(prep: Any, w: int, rank: int, is_causal: bool, mask: Any,
                     score_mod: Any, requires_grad: bool) -> Any:
    """The local call's Problem (validated by :func:`prepare` on zero-stride stand-ins of
    its shapes: mask sizes, mask with is_causal, score_mod checks — no data)."""
    p = prep.problem
    e = w // math.gcd(p.heads_kv, w)
    h_kv = p.heads_kv * e
    shapes = [(p.batch, p.heads_q // w, w * p.n_q, p.d_k), (p.batch, h_kv // w, w * p.n_k, p.d_k),
              (p.batch, h_kv // w, w * p.n_k, p.d_v)]
    fakes = [prep.restore(torch.empty_strided(s, (0,) * 4, dtype=p.dtype, device=p.device)
                          .requires_grad_(requires_grad)) for s in shapes]
    hw = p.heads_q // w
    with torch.enable_grad() if requires_grad else torch.no_grad():
        return prepare(*fakes, mask=mask, is_causal=is_causal, scale=p.scale, softcap=p.softcap,
                       score_mod=_local_score_mod(score_mod, rank * hw, hw, p.heads_q)).problem


def _check_ulysses(prep: Any, w: int, rank: int, is_causal: bool, mask: Any, score_mod: Any,
                   backend: str, needs_grad: bool) -> None:
    """strategy='ulysses': the head rule, the masks it can take, a forced backend that can
    run the local call — checked on every rank before anything moves."""
    p = prep.problem
    if p.heads_q % w:
        raise ValueError(
            f"ring_attention with strategy='ulysses' splits the query heads over the {w} "
            f"ranks, so H_q must be a multiple of {w}, got H_q={p.heads_q} (q "
            f"{tuple(p.q.shape)}): use strategy='ring' (any head count), or a group size "
            "that divides H_q")
    if mask is not None:
        if not isinstance(mask, _masks.Mask):
            raise TypeError(
                f"ring_attention: mask must be an attnkit.masks.Mask over the global sequence "
                f"(e.g. masks.sliding_window(w), masks.document(ids)), got "
                f"{type(mask).__name__}: a dense mask tensor is not sharded by attnkit")
        if mask.depends_on_heads:
            raise ValueError(
                f"ring_attention with strategy='ulysses': mask {mask.name} depends on the head "
                "index, but each rank holds a slice of the heads: use a mask that is the same "
                "for every head (or express the per-head part as a score_mod)")
    heads = getattr(score_mod, "heads", None)
    if isinstance(score_mod, _scores.ScoreTerm) and heads not in (None, p.heads_q):
        raise ValueError(
            f"ring_attention: score_mod {score_mod.name} was built for {heads} heads, but the "
            f"inputs have H_q={p.heads_q} query heads (q {tuple(p.q.shape)}): build it for "
            "all H_q heads of the call (each rank uses its own slice)")
    local = _ulysses_problem(prep, w, rank, is_causal, mask, score_mod, needs_grad)
    if backend != "auto" and p.n_q and p.n_k:
        why = _backends.get(backend).not_supported_reasons(local)
        if why:
            raise ValueError(
                f"ring_attention: backend {backend!r} cannot run the local attention call of "
                f"strategy='ulysses': {'; '.join(why)}. Choose a backend that can (or 'auto')"
                + (", or call under torch.no_grad() if no gradients are needed"
                   if needs_grad else "") + ".")


def _ulysses(prep: Any, o: _Options, mask: Any, score_mod: Any, return_lse: bool,
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """All-to-all (DeepSpeed-Ulysses): sequence shards → head shards, one local attention
    call over the whole sequence, head shards → sequence shards. Differentiable through
    the all-to-alls (each one's backward is the reverse exchange). → (out, lse or None)
    in the (B, H, N, D) layout."""
    ring, w = o.ring, o.ring.size
    p = prep.problem
    q, k, v = p.q, p.k, p.v
    b, h_q, n_q, d_k = q.shape
    n_k, d_v = k.shape[2], v.shape[-1]
    e = w // math.gcd(k.shape[1], w)       # K/V heads repeated until W divides them
    if e > 1:
        k, v = k.repeat_interleave(e, dim=1), v.repeat_interleave(e, dim=1)
    hq, hkv = h_q // w, k.shape[1] // w    # heads per rank
    send = torch.cat([_heads_out(q, w), _heads_out(k, w), _heads_out(v, w)], dim=1)
    recv = _AllToAll.apply(send, ring, "ulysses forward (sequence → heads all-to-all)",
                           "ulysses backward (heads → sequence all-to-all of dQ/dK/dV)")
    q_r, k_r, v_r = recv.split([b * hq * n_q * d_k, b * hkv * n_k * d_k,
                                b * hkv * n_k * d_v], dim=1)
    q_h, k_h, v_h = (_heads_in(q_r, b, hq, n_q, d_k), _heads_in(k_r, b, hkv, n_k, d_k),
                     _heads_in(v_r, b, hkv, n_k, d_v))
    del send, recv, q_r, k_r, v_r       # the exchange buffers: not alive during the call
    order_q = _to_global_order(n_q, w, o.layout, q.device)
    order_k = _to_global_order(n_k, w, o.layout, q.device)
    if order_q is not None and order_k is not None:        # zigzag → global order
        q_h = q_h.index_select(2, order_q[0])
        k_h, v_h = k_h.index_select(2, order_k[0]), v_h.index_select(2, order_k[0])
    failure: Exception | None = None
    out_h = lse_h = None
    try:
        out_h, lse_h = attention(
            prep.restore(q_h), prep.restore(k_h), prep.restore(v_h), mask=mask,
            is_causal=o.is_causal, scale=o.scale, softcap=o.softcap,
            score_mod=_local_score_mod(score_mod, ring.rank * hq, hq, h_q),
            backend=o.backend, return_lse=True)
    except Exception as err:    # the peers must hear of it before the second all-to-all
        failure = err
    ring.settle(failure, 0, "forward", where="the local attention call of strategy='ulysses'")
    assert out_h is not None and lse_h is not None
    out_h = out_h.reshape(b, hq, w * n_q, d_v)
    lse_h = lse_h.reshape(b, hq, w * n_q, 1)
    if order_q is not None:                                # global → zigzag order
        out_h, lse_h = out_h.index_select(2, order_q[1]), lse_h.index_select(2, order_q[1])
    lse_send = _seq_out(lse_h, w) if return_lse else None
    send_out = _seq_out(out_h, w)
    del out_h, lse_h
    out = _seq_in(_AllToAll.apply(send_out, ring,
                                  "ulysses forward (heads → sequence all-to-all)",
                                  "ulysses backward (sequence → heads all-to-all of dO)"),
                  b, hq, n_q, d_v)
    lse = None
    if return_lse:
        lse = _seq_in(_AllToAll.apply(lse_send, ring,
                                      "ulysses forward (heads → sequence all-to-all of LSE)",
                                      "ulysses backward (all-to-all of dLSE)"),
                      b, hq, n_q, 1)[..., 0]
    return out, lse


# ------------------------------------------------------------------ sequence layouts
def _group_rank_size(rank: int | None, world_size: int | None, group: Any,
                     fn: str) -> tuple[int, int]:
    """(rank, world size): as given, or this process's in ``group`` (the default group)."""
    if rank is None or world_size is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"{fn}: pass rank= and world_size=, or initialise a process group first "
                "(torch.distributed.init_process_group) to use this process's rank")
        rank = dist.get_rank(group) if rank is None else rank
        world_size = dist.get_world_size(group) if world_size is None else world_size
    for name, x in (("rank", rank), ("world_size", world_size)):
        if isinstance(x, bool) or not isinstance(x, numbers.Integral):
            raise TypeError(f"{fn}: {name} must be an int, got {type(x).__name__}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"{fn}: need 0 <= rank < world_size, got rank={rank}, "
                         f"world_size={world_size}")
    return int(rank), int(world_size)


def _check_layout(layout: Any, fn: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"{fn}: layout must be one of {', '.join(map(repr, LAYOUTS))}, got "
                         f"{layout!r}")
    return layout


def _chunk_ranges(n: int, rank: int, world: int, layout: str, fn: str,
                  ) -> list[tuple[int, int]]:
    """The [start, end) ranges of the global sequence (length ``n``) that ``rank`` holds, in
    the order its shard stores them; a clear error when ``n`` does not split evenly."""
    parts = world if layout == "contiguous" else 2 * world
    if n % parts:
        up = -(-n // parts) * parts
        raise ValueError(
            f"{fn}: layout={layout!r} splits the sequence into {parts} equal chunks "
            f"({'W' if layout == 'contiguous' else '2·W'} for W={world} ranks), so its length "
            f"must be a multiple of {parts}, got {n}: pad it to {up} (and mask the padding)")
    c = n // parts
    if layout == "contiguous":
        return [(rank * c, (rank + 1) * c)]
    return [(rank * c, (rank + 1) * c), ((parts - 1 - rank) * c, (parts - rank) * c)]


def shard_sequence(x: torch.Tensor, rank: int | None = None, world_size: int | None = None,
                   *, group: Any = None, layout: str = "contiguous", dim: int = -2,
                   ) -> torch.Tensor:
    """This rank's shard of a global tensor along its sequence dim, in ``layout``.

    ``contiguous``: rank r of W holds positions ``[r·N/W, (r+1)·N/W)``. ``zigzag``: the
    sequence is split into 2·W chunks and rank r holds chunks r and 2W−1−r, concatenated
    (head–tail; balanced causal work). ``N`` must be a multiple of W (contiguous) or 2·W
    (zigzag). ``rank`` / ``world_size`` default to this process's in ``group``. Returns a
    new tensor (a copy), so that shards of q, k, v can be made leaves that require grad.
    Example (positions of 2 ranks, N = 8)::

        contiguous: rank 0 [0 1 2 3]  rank 1 [4 5 6 7]
        zigzag:     rank 0 [0 1 6 7]  rank 1 [2 3 4 5]
    """
    rank, world = _group_rank_size(rank, world_size, group, "shard_sequence")
    layout = _check_layout(layout, "shard_sequence")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"shard_sequence: x must be a torch.Tensor, got {type(x).__name__}")
    n = x.shape[dim]
    return torch.cat([x.narrow(dim, a, b - a)
                      for a, b in _chunk_ranges(n, rank, world, layout, "shard_sequence")],
                     dim=dim)


def unshard_sequence(shards: list[torch.Tensor] | tuple[torch.Tensor, ...], *,
                     layout: str = "contiguous", dim: int = -2) -> torch.Tensor:
    """The global tensor from every rank's shard (``shards[r]`` = rank r's, e.g. from
    ``torch.distributed.all_gather``): the inverse of :func:`shard_sequence`."""
    layout = _check_layout(layout, "unshard_sequence")
    if not isinstance(shards, (list, tuple)) or not shards or not all(
            isinstance(t, torch.Tensor) for t in shards):
        raise TypeError("unshard_sequence: pass a non-empty list of every rank's shard "
                        "(torch tensors, in rank order)")
    world = len(shards)
    n_local = {t.shape[dim] for t in shards}
    if len(n_local) != 1:
        raise ValueError(f"unshard_sequence: the shards have different lengths "
                         f"{[t.shape[dim] for t in shards]} along dim {dim}")
    n = n_local.pop() * world
    pieces: list[tuple[int, torch.Tensor]] = []
    for r, t in enumerate(shards):
        at = 0
        for a, b in _chunk_ranges(n, r, world, layout, "unshard_sequence"):
            pieces.append((a, t.narrow(dim, at, b - a)))
            at += b - a
    return torch.cat([t for _, t in sorted(pieces, key=lambda p: p[0])], dim=dim)


def sequence_positions(seq_len: int, rank: int | None = None, world_size: int | None = None,
                       *, group: Any = None, layout: str = "contiguous",
                       device: Any = None) -> torch.Tensor:
    """The global positions (int64, ``(seq_len / W,)``) of the tokens in this rank's shard of
    a sequence of ``seq_len`` tokens, in the shard's order — e.g. for RoPE:
    ``ak.rope.RoPE()(q_shard, positions=sequence_positions(N, layout="zigzag"))``."""
    rank, world = _group_rank_size(rank, world_size, group, "sequence_positions")
    layout = _check_layout(layout, "sequence_positions")
    if isinstance(seq_len, bool) or not isinstance(seq_len, numbers.Integral) or seq_len < 0:
        raise ValueError(f"sequence_positions: seq_len must be an int >= 0, got {seq_len!r}")
    return torch.cat([torch.arange(a, b, device=device) for a, b in
                      _chunk_ranges(int(seq_len), rank, world, layout, "sequence_positions")])


def _to_global_order(n_local: int, world: int, layout: str, device: Any,
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Indices along the sequence: (rank-order concatenation of every shard → global order,
    global order → that concatenation); None for contiguous (already in order)."""
    if layout == "contiguous":
        return None
    cat = torch.cat([sequence_positions(n_local * world, r, world, layout=layout)
                     for r in range(world)])
    return torch.argsort(cat).to(device), cat.to(device)


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
    ("layout", 1 + _NAME_SLOTS, lambda r: f"layout={_name(r)}"),
    ("strategy", 1 + _NAME_SLOTS, lambda r: f"strategy={_name(r)}"),
    ("mask", 1 + _NAME_SLOTS, lambda r: f"mask {_name(r)}"),
    ("score_mod", 1 + _NAME_SLOTS, lambda r: f"score_mod {_name(r)}"),
    ("return_lse", 1, lambda r: f"return_lse={bool(r[0])}"),
)
# (label, first index, width, formatter); index 0 of a row is the local-error flag
_FIELDS = tuple((label, 1 + sum(w for _, w, _ in _SPEC[:i]), width, fmt)
                for i, (label, width, fmt) in enumerate(_SPEC))


def _option_row(q: Any, k: Any, v: Any, local_error: Exception | None, is_causal: Any,
                scale: float | None, softcap: Any, backend: Any, needs_grad: bool,
                layout: Any = "contiguous", strategy: Any = "ring", mask: Any = None,
                score_mod: Any = None, return_lse: Any = False) -> list[int]:
    dtype = q.dtype if isinstance(q, torch.Tensor) else None
    row = [int(local_error is not None)]
    row += _shape_row(q) + _shape_row(k) + _shape_row(v)
    row += [_DTYPES.index(dtype) if dtype in _DTYPES else -1, int(bool(is_causal))]
    row += [0, 0] if scale is None else [1, _bits(scale)]
    row += [1, _bits(softcap)] if isinstance(softcap, float) else [0, 0]
    device = q.device.type if isinstance(q, torch.Tensor) else None
    row += _name_row(backend) + _name_row(device) + [int(needs_grad)]
    row += _name_row(layout) + _name_row(strategy)
    row += _name_row("none" if mask is None else getattr(mask, "name", type(mask).__name__))
    row += _name_row("none" if score_mod is None else _scores.fn_name(score_mod))
    row += [int(bool(return_lse))]
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
    layout: str = "contiguous",
    strategy: str = "ring",
    mask: Any = None,
    score_mod: Any = None,
) -> Any:
    """Exact attention over a sequence sharded across the ranks of a process group.

    Shapes (per rank; the global sequence is the concatenation of the shards in rank order)::

        q (..., H_q, N_q, D_k)   k (..., H_kv, N_k, D_k)   v (..., H_kv, N_k, D_v)
        → out (..., H_q, N_q, D_v)       [and lse (..., H_q, N_q) with return_lse=True]

    Rank ``r`` passes its shard of the global sequence — with ``layout="contiguous"`` queries
    ``[r·N_q, (r+1)·N_q)`` and keys/values ``[r·N_k, (r+1)·N_k)``, with ``layout="zigzag"``
    chunks ``r`` and ``2W−1−r`` of ``2W`` (see :func:`shard_sequence`) — and gets back its
    rows of the global output, in the same order. Differentiable: the
    gradients of q, k, v are those of single-process :func:`attnkit.attention` on the
    concatenated sequence (restricted to this rank's shard). Every rank of the group must call
    this together with the same shapes and options (and, when the inputs need gradients, the
    backward of the result).

    Args:
        group: the ``torch.distributed`` process group; ``None`` = the default group.
        is_causal: global causal attention (query at global position i sees keys 0..i).
            The ring needs ``N_q == N_k``; blocks of later positions are skipped entirely.
        scale: multiplies the scores; defaults to ``1/√D_k``.
        softcap: ``c`` maps each scaled logit x to ``c·tanh(x/c)``.
        backend: backend for each block (as in :func:`attnkit.attention`); default ``"auto"``.
        return_lse: also return the global log-sum-exp of this rank's query rows.
        timeout: the longest wait, in seconds, for a peer at any step (the option check, each
            hop of the forward and the backward ring, each all-to-all, the status checks);
            default :data:`DEFAULT_TIMEOUT_S` (five minutes). ``None``: the process group's
            timeout.
        layout: ``"contiguous"`` (default) or ``"zigzag"`` (balanced causal work; shard
            lengths must be even). The same on every rank, and the layout the shards were
            cut in (:func:`shard_sequence`).
        strategy: ``"ring"`` (default) or ``"ulysses"`` (all-to-all over heads: ``H_q`` a
            multiple of ``W``; see the module docstring for when each wins).
        mask: ``strategy="ulysses"`` only: an :class:`attnkit.masks.Mask` over the GLOBAL
            sequence (positions as in the unsharded call), not depending on the head index.
        score_mod: ``strategy="ulysses"`` only: as in :func:`attnkit.attention`, with global
            positions and global head indices (ALiBi / relative-bias terms included).

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
        _check_layout(layout, "ring_attention")
        if strategy not in STRATEGIES:
            raise ValueError(f"ring_attention: strategy must be one of "
                             f"{', '.join(map(repr, STRATEGIES))}, got {strategy!r}")
        p = prep.problem
        if layout == "zigzag" and (p.n_q % 2 or p.n_k % 2):
            raise ValueError(
                f"ring_attention with layout='zigzag': each shard holds two equal chunks "
                f"(global chunks r and 2W−1−r), so the shard lengths must be even — the "
                f"global sequence a multiple of 2·W = {2 * ring.size} — got N_q={p.n_q}, "
                f"N_k={p.n_k} (q {tuple(q.shape)}): pad the sequence (and mask the padding), "
                "or use layout='contiguous'")
        if ring.backend == "nccl" and q.device.type != "cuda":
            raise ValueError(f"the NCCL backend needs CUDA tensors, got q on {q.device}: "
                             "move the shards to the GPU or use the gloo backend")
        if strategy == "ulysses":
            _check_ulysses(prep, ring.size, ring.rank, bool(is_causal), mask, score_mod,
                           backend, needs_grad)
        else:
            if mask is not None or score_mod is not None:
                raise ValueError(
                    "ring_attention: mask= and score_mod= need the whole sequence in one call, "
                    "which strategy='ulysses' gives (heads split over the ranks instead of the "
                    "sequence); with strategy='ring' only is_causal, scale and softcap apply")
            if is_causal and p.n_q != p.n_k:
                raise ValueError(
                    f"ring_attention with is_causal=True needs query and key shards of one "
                    f"length (a self-attention sequence split evenly), got N_q={p.n_q} (q "
                    f"{tuple(q.shape)}) and N_k={p.n_k} (k {tuple(k.shape)})"
                )
            _refuse_unrunnable(p, backend, bool(is_causal), ring.size, needs_grad)
    except Exception as e:      # any local failure: the peers must hear of it, not wait
        local_error = e
    resolved = prep.problem if prep is not None else None     # scale as it will be used
    _check_group(ring, _option_row(q, k, v, local_error, is_causal,
                                   getattr(resolved, "scale", None),
                                   getattr(resolved, "softcap", None), backend, needs_grad,
                                   layout, strategy, mask, score_mod, return_lse),
                 local_error)
    assert prep is not None
    p = prep.problem
    o = _Options(ring, bool(is_causal), p.scale, p.softcap, backend, layout, p.n_q, p.n_k)
    if strategy == "ulysses":
        out, lse = _ulysses(prep, o, mask, score_mod, bool(return_lse))
    else:
        out, lse = _RingAttention.apply(p.q, p.k, p.v, o)
    if return_lse:
        return prep.restore(out), prep.restore(lse)
    return prep.restore(out)
