"""The CPU engine: block-sparse online softmax, forward + backward, O(N) memory.

A call first goes to attnkit's native C++ kernel (:mod:`attnkit.backends.native`: one
fused pass per tile, FlashAttention-2 backward) when it is available and supports the call
(:func:`native_reasons` is empty); otherwise to the Python engine described here.

Python orchestrates; tuned kernels compute. The call is cut into *query blocks*; the mask's
block map (``block_q × block_k`` tiles, computed once per call) says which key tiles of a
block are EMPTY (skipped), FULL (no mask work) or PARTIAL (the mask is evaluated on that
tile only). Consecutive tiles of one kind form a *run* — one kernel call batched over
(batch × heads) — and the runs of a block are merged by their log-sum-exp. Nothing of size
N_q × N_k is ever allocated (on the native kernel: but a bool mask of at most
``native.DENSE_MASK_LIMIT``, 4 MiB, for a mask without closed form that must be evaluated;
a bool tensor the call passed is read in place).

What lives where:

- :mod:`.plan` — the plan: the block map → :class:`~.plan.Plan` of :class:`~.plan.Block` s
  and :class:`~.plan.Run` s (coarsened blocks), tile helpers; :mod:`.sizes` — the tile
  sizes; :mod:`.counters` — what the calls did, for tests (:func:`counting`);
  :func:`use_native` is the native kernel's own per-context switch, re-exported here;
- :mod:`.fused` — the fused-kernel engine (torch's fused CPU flash kernel per run) and its
  FlashAttention-2 backward; used without softcap / score_mod / dropout / a bias with grad;
- :mod:`.windowed` — the windowed schedule of the fused engine: when every block's tiles lie
  in a short window at a fixed offset (sliding windows, documents), all blocks go into one
  kernel call (for a band mask: interior blocks share one mask, edge blocks apart);
- :mod:`.general` — the general engine (batched matmuls, online softmax; softcap, score_mod,
  dropout, bias with grad) with its hand-written backward, or ``torch.utils.checkpoint``;
- :mod:`.compiled` — the general engine's tiles with a Python score_mod fused by
  ``torch.compile`` (the fallback for a score_mod the native kernel cannot compile);
- :mod:`.matmul` — batched matmuls against K/V that may be shared over the batch (batch 1
  broadcast: never copied), used by the general and compiled engines;
- here — :class:`TiledBackend`, which picks the engine (native first, see Caution).

Schedules of the fused engine, chosen per call: *one call* (no mask; plain top-left causal
with N_q = N_k and no GQA), *windowed* (above), or *per block* (query blocks coarsened up
to 4 × ``block_q`` while that adds at most 25% work, one kernel call per run).

GQA never repeats K/V: the ``G = H_q / H_kv`` query heads sharing a K/V head are stacked as
rows, ``q (B, H_kv, G·rows, D)``, and multiplied by K once.

Shape legend::

    q (B, H_q, N_q, D_k)   k (B, H_kv, N_k, D_k)   v (B, H_kv, N_k, D_v)   H_q = G · H_kv
    grouped query block    (B, H_kv, G·bq, D)        bq ≤ block_q rows of one query block
    run                    keys [k0, k1) of one query block, one kernel call
    out (B, H_q, N_q, D_v) lse (B, H_q, N_q)

Numerical contract: float16/bfloat16 inputs are computed in float32 (one cast in, one cast
out); a query with no allowed key gets output 0, LSE −∞ and zero gradients whatever its
query holds; a query row holding NaN/±inf that has an allowed key gets NaN output and LSE;
soft-capping is ``scores.soft_cap``'s formula (in place), exact to rounding at any cap.
First derivatives only: every backward here refuses second derivatives with one attnkit
error (``base.refuse_double_backward``).

Caution
-------
- The native kernel runs a call when it is built and loaded (``native.available()``),
  neither ``ATTNKIT_NATIVE=0`` nor :func:`use_native` ``(False)`` turned it off, a mask part
  without closed form (not band, lengths, documents) is the call's own bool tensor or
  fits ``native.DENSE_MASK_LIMIT`` (4 MiB) once evaluated, and ``native.supports`` accepts
  it: CPU, float32 / bfloat16 / float16 / float64 (float64 computed in float64), no
  dropout (a bias may need a gradient), a score_mod that is none, carries a spec (``scores.alibi``,
  ``scores.relative_bias``) or is a Python function the kernel can compile
  (``native/score_mod.py``: elementwise ops and integer indexing of captured tensors
  without grad). Everything else — dropout, a score_mod it cannot compile (its reason is in
  :func:`native_reasons`; then :mod:`.compiled`) — runs on the Python engine below, with the
  same results within rounding. On the native kernel, :func:`tile_sizes` has no effect,
  :func:`counting` counts only ``native`` (the call plans nothing), and second derivatives
  are refused under the backend name ``'native'``.
- The fused kernel needs D_v == D_k: the narrower of q/k and v is zero-padded to the wider
  width (exact: zero columns add nothing to a dot product and give zero output columns).
- Masks summarised conservatively (``&``/``|`` algebra, ``from_fn``) may mark a tile
  PARTIAL that is in fact EMPTY or FULL: correct, a little slower.
- The windowed schedule evaluates the mask on its whole window tensor (``N_q × window``
  elements, built once per call, one tile per query block), FULL tiles included — except a
  band mask, whose interior blocks share one ``(bq, window)`` pattern (forward and
  backward); it is used only when the window is at most a quarter of N_k (and the tensor at
  most 2^24 elements).
- Exact causal (one call) and the band masks' window patterns are recognised from the
  lowered call (``Problem.lowered.mask``, :func:`attnkit.masks.decompose`); other masks are
  evaluated.
- Dropout draws its mask from torch's global generator (reproducible with
  ``torch.manual_seed``) but in a different order than the reference does: results agree in
  distribution, not bit for bit.
- Tile sizes (:func:`tile_sizes`) and counters (:func:`counting`) are per context (thread,
  asyncio task): concurrent calls never see each other's.
- A non-finite query row is computed as a zero row and then marked NaN where it has a key:
  its gradient is 0 (not NaN), and where ``softcap`` would map its ±inf logits to ±cap the
  reference can return a finite value while tiled returns NaN.
- The fused kernel adds its mask (−∞) to the logits: when finite inputs still give a
  non-finite output (a logit overflowed to +∞), the call is recomputed on the general
  engine, whose masked_fill keeps blocked positions out (slower, only then).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .. import native
from ..base import Backend, Capabilities, Problem, compute_dtype
from ..native import native_enabled, use_native
from .counters import COUNTERS, count, counting
from .fused import fused_attention
from .general import general_attention
from .plan import Block, Plan, Run, plan
from .sizes import TileSizes, sizes, tile_sizes

__all__ = ["TiledBackend", "tile_sizes", "sizes", "TileSizes", "counting", "COUNTERS", "plan",
           "Plan", "Block", "Run", "use_native", "native_reasons", "python_attention",
           ]


def native_reasons(p: Problem) -> list[str]:
    """Why ``tiled`` (and ``decode``) will not run ``p`` on the native kernel (empty = it
    will): switched off by :func:`use_native`, or ``native.supports(p)``'s reasons (which
    include ``ATTNKIT_NATIVE=0``, a kernel that failed to build, and a mask without closed
    form whose dense form would exceed ``native.DENSE_MASK_LIMIT``)."""
    if not native_enabled():
        return ["the native kernel is switched off here (tiled.use_native(False))"]
    return native.supports(p)


def python_attention(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """The Python engine (fused or general), whatever the native kernel could do."""
    if _fusable(p):
        out, lse = fused_attention(p)
        with torch.no_grad():
            if bool(torch.isfinite(out.sum(dtype=compute_dtype(p.dtype)))) or not bool(
                    torch.isfinite(p.k).all() and torch.isfinite(p.v).all()):
                return out, lse                 # (NaN/inf K/V rows: attention() screens them)
        # Finite inputs, non-finite output: the fused kernel adds its mask (−∞) to the
        # logits, so a blocked logit that overflowed to +∞ (huge finite q·k) leaks NaN. The
        # general engine masks with masked_fill: blocked positions never reach the output.
    return general_attention(p)


def _fusable(p: Problem) -> bool:
    return (p.softcap is None and p.score_mod is None and p.dropout_p == 0.0
            and not (p.bias is not None and p.bias.requires_grad and torch.is_grad_enabled()))


def _nonfinite_query_rows(q: torch.Tensor) -> torch.Tensor | None:
    """``(B, H_q, N_q)`` True where a query row holds NaN or ±inf; ``None`` when none does
    (one pass over q: the native kernel's, else a reduction; the exact row test only when
    that finds a non-finite value)."""
    with torch.no_grad():
        if native.known_finite(q):
            return None
        bad = ~torch.isfinite(q).all(-1)
    return bad if bool(bad.any()) else None


def _attention(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    if not native_reasons(p):
        count(native=1)
        return native.forward_problem(p)
    return python_attention(p)


class TiledBackend(Backend):
    """CPU: block-sparse online softmax with forward + backward and O(N) memory."""

    name = "tiled"
    description = ("CPU block-sparse online softmax (torch's fused flash kernel per run, "
                   "batched matmuls for softcap/score_mod/dropout); O(N) memory; autograd")
    capabilities = Capabilities(devices=("cpu",),
                                hints=(("devices", "use backend='triton' on GPU"),))
    screens_kv = True         # (the native kernel's screened forward: forward_screened)

    def lean(self, p: Problem) -> native.LeanLaunch | None:
        """The native kernel's lean launch of ``p`` (:func:`native.lean_launch`, its flag
        covering the query rows too: a non-finite one takes :meth:`forward`'s screen) when
        :meth:`forward` runs ``p`` on the kernel, else None."""
        return None if native_reasons(p) else native.lean_launch(p, check_q=True)

    def forward_screened(self, p: Problem) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """On the native kernel without autograd, the query and output screens are read by
        the kernel as it goes (:func:`native.forward_problem_screened`): no pass over q
        before the call, and none over out after it when it says all are finite. A query
        row holding inf/NaN takes :meth:`forward`'s screen (the call runs again)."""
        if not p.requires_grad and not native_reasons(p):
            res = native.forward_problem_screened(p)
            if res is not None:
                count(native=1)
                out, lse, q_finite, out_finite = res
                if q_finite:
                    return out, lse, out_finite
        return (*self.forward(p), False)

    def forward(self, p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
        bad = _nonfinite_query_rows(p.q)
        if bad is None:
            return _attention(p)
        # A query row holding NaN/inf is computed as a zero row — a row with no allowed key
        # then stays output 0, LSE −∞, gradient 0 whatever it held — and shows as NaN
        # (output and LSE) where it does attend to a key: a non-finite input that is used.
        q = torch.where(bad[..., None], torch.zeros((), dtype=p.q.dtype), p.q)
        out, lse = _attention(dataclasses.replace(p, q=q))
        hit = bad & (lse != -math.inf)                               # (B, H_q, N_q)
        out = torch.where(hit[..., None], torch.full((), math.nan, dtype=out.dtype), out)
        lse = torch.where(hit, torch.full((), math.nan, dtype=lse.dtype), lse)
        return out, lse
