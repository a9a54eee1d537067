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

    hop s = 0 .. W-1:  this rank gets the K/V shard of rank  src = (r - s) mod W
        wait    for hop s's K/V (sent straight by its owner; at most ``timeout`` s)
        start   hop s+1: own K/V → rank r+s+1, rank r−s−1's ← (async: overlaps the compute)
        compute (o_b, lse_b) = attention(q[rows], K_src[keys], V_src[keys], band, return_lse=True)
                  for each block of the schedule (below); none: the hop is skipped here
        merge   (out, lse)[rows] ← merge_partials([(out, lse)[rows], (o_b, lse_b)])  (by LSE)

The schedule (:mod:`.schedule`) reads the global mask as a band of diagonals — allowed ⇔
``lo <= q_pos − k_pos <= hi`` in global positions: no mask, ``is_causal`` (``(0, ∞)``), a
sliding window, any :func:`~attnkit.masks.band` — and cuts each (query shard, K/V shard)
pair into as few calls as one local band allows; pairs the band does not touch are skipped,
and a hop on which no rank computes anything is not run (no exchange); a rank sends its K/V
only to the ranks that use it. Causal, contiguous: src > r skipped, src == r the local
causal mask, src < r full (rank ``r`` computes ``r + 1`` blocks of ``n²``; the last rank sets
the pace). Causal, zigzag: src == r local causal (= the global mask on these chunks), src < r
all rows × the shard's first chunk, src > r the second query chunk × the whole shard — every
rank computes the same ``2c²`` on every hop. A causal window no longer than a shard needs
hops 0 and 1 only (contiguous: one exchange, with the left neighbour). Each block goes
through :func:`attnkit.attention`, so the fastest backend that supports it runs. The merge
is −∞-aware: a block in which a query may see no key contributes nothing.

The backward pass runs the same hops once more, FlashAttention-style. Each K/V shard's
dK/dV accumulator follows it (at hop s the accumulator of shard r − s is on rank r, moved
in place a piece at a time); after the last hop it goes home as the full dK/dV; dQ never
leaves its rank. Blocks are computed in sub-blocks of at most ``_PIECE_ELEMENTS`` (256 Ki)
elements per gradient (whole heads first, then rows and keys of one head), so that a
block's gradients are small buffers. Per sub-block:

- when the blocks run on attnkit's native CPU kernel (``backend`` "auto" or "tiled" and the
  kernel built), the kernel's own FlashAttention-2 backward is called with the SAVED GLOBAL
  LSE and ``delta = rowsum(dO·out) − dLSE``: the weights it rebuilds, ``exp(s − lse)``, are
  already the block's share of the global softmax, so one kernel call gives the block's
  dQ, dK, dV — no forward recompute, no autograd graph, no ``(N_q, N_k)`` buffer;
- otherwise the rank recomputes its block under autograd and asks for the gradients of the
  block's ``(o_b, lse_b)``, weighted by the block's share ``w_b = exp(lse_b − lse)`` of the
  global softmax (``∂L/∂o_b = w_b·dO`` and ``∂L/∂lse_b = w_b·(dO·o_b − dO·out)``).

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

- per rank the ring sends up to ``2·(W−1)`` K/V shards in the forward and ``4·(W−1)`` (K/V
  and dK/dV) in the backward — about ``N·H_kv·D`` elements each way whatever ``W``, fewer
  with a sliding window — and hides the K/V part behind the blocks' compute; Ulysses sends
  about ``(q, k, v, out, and the same in the backward)·(W−1)/W`` of its shard — it shrinks
  with ``W`` — but nothing overlaps it;
- Ulysses: when ``W`` divides ``H_q`` (and ideally ``H_kv``), the network is slow relative to
  compute, or a mask / score_mod the ring does not take (not a band) is needed; one large local call
  (no per-hop merges, the best kernel tiling) and causal work is balanced by construction;
- ring (zigzag for causal): when ``W > H_q`` or ``W`` does not divide the heads, with few
  K/V heads (GQA/MQA: the ring moves only K/V, Ulysses would repeat them), or when the
  exchange hides behind the compute (long shards: compute grows as ``n²``, traffic as ``n``),
  and for sliding windows short next to a shard (far shards are neither sent nor computed).

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
    out = akd.ring_attention(qs, ks, vs, layout="zigzag",     # a window: far shards are
                             mask=ak.masks.sliding_window(4096))    # skipped, not sent
    out = akd.ring_attention(qs, ks, vs, is_causal=True, layout="zigzag", strategy="ulysses",
                             score_mod=ak.scores.alibi(H_q))    # heads instead of a ring
    out = akd.ring_attention(q, k, v, group=mesh["cp"].get_group())   # a DeviceMesh dim

Where it lives: :mod:`.api` (the entry point: checks, then a strategy), :mod:`.ring` (the
ring's forward and backward), :mod:`.schedule` (which blocks, which hops), :mod:`.ulysses`
(the all-to-all strategy), :mod:`.layout` (shards, positions), :mod:`.collectives`
(exchanges with deadlines, errors that name rank and hop), :mod:`.checks` (the collective
option check).

Caution
-------
- Tested with the gloo backend on CPU (2 and 3 processes; a ``new_group`` and a
  ``DeviceMesh`` dimension of 2 ranks inside a 3-rank job; ``examples/ring_attention.py``
  under ``torchrun --nproc-per-node 2``). NCCL on GPU uses the same code path
  (``batch_isend_irecv``, ``all_to_all_single``, ``Work.wait(timeout)``) but is not covered
  by the test suite.
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
  shards). The ring takes ``is_causal`` or one band ``mask=`` over the global sequence
  (``masks.sliding_window``, ``masks.band``, ``masks.window``, ``masks.causal``; not both),
  ``scale``, ``softcap`` and ``backend``: other masks and ``score_mod`` need
  ``strategy="ulysses"`` (and dropout is supported by neither).
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
- Memory (per rank, besides the inputs and the results out, lse, dq, dk, dv): in the
  forward, the K/V shard of this hop and the next (one for ``W = 2``: a rank's own shard is
  never copied, unless strided); in the backward, the K/V shards arrive a chunk at a time
  (the K/V heads of one backward sub-block, of one batch element), so only this chunk and
  the next are held, plus one piece (``_SHIFT_ELEMENTS``, 4 MiB in float32) of the
  accumulator while it moves, and a sub-block's gradients (and contiguous copies of its
  inputs where a head slice is strided: batch > 1); on the autograd path also a float32
  copy of the sub-block being recomputed and its graph. For ``W = 2`` at N=16384 that is
  0.47× the extra peak of one process holding the whole sequence
  (``benchmarks/bench_ring.py``; 0.66× while the backward held whole shards); with more
  ranks it shrinks as ``1/W``.
- The K/V exchange overlaps the compute only as far as the process group's backend
  progresses sends in the background (gloo and NCCL do); the accumulator's moves are
  waited for at once (small next to a hop's compute). ``benchmarks/bench_ring.py
  --overlap`` measures the exchange's cost: the same run without exchanges, and without
  compute. On 2 shared CPU cores with 2 ranks it was not hidden (gloo's socket copies need
  the cores the ranks compute on); it was about 5% of the compute there.
"""

from __future__ import annotations

from .api import STRATEGIES, ring_attention
from .collectives import DEFAULT_TIMEOUT_S, RingAttentionError
from .layout import LAYOUTS, sequence_positions, shard_sequence, unshard_sequence

__all__ = ["ring_attention", "RingAttentionError", "DEFAULT_TIMEOUT_S", "LAYOUTS",
           "STRATEGIES", "shard_sequence", "unshard_sequence", "sequence_positions"]
