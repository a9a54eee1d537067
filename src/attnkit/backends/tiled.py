"""The CPU engine: block-sparse online softmax, forward + backward, O(N) memory.

Python orchestrates; tuned kernels compute. The call is cut into *query blocks* of
``block_q`` rows; the mask's block map (``block_q × block_k`` tiles, computed once per call)
says, for each query block, which key tiles are EMPTY (skipped), FULL (no mask work) or
PARTIAL (the mask is evaluated on that tile only). Consecutive tiles of one kind become one
*run* — a contiguous key range computed by one big kernel call batched over
(batch × heads) — and the runs of a query block are merged by their log-sum-exp
(``out = Σ_r e^{lse_r − lse} out_r``, ``lse = log Σ_r e^{lse_r}``). Nothing of size
N_q × N_k is ever allocated.

Three schedules, chosen per call:

- **one call** — no mask (dense), or plain top-left causal with N_q = N_k and no GQA: the
  fused kernel's own schedule (it skips the blocks above the diagonal itself);
- **windowed** — when every query block's non-empty tiles lie in a short window at a fixed
  offset from the block (sliding windows, documents, local masks): all query blocks go into
  ONE kernel call, the windows being strided views of zero-padded K/V, batched as extra
  "heads", with one mask tensor for them (none when every window is exactly a FULL run);
  for a band mask (sliding window) the interior blocks — windows inside ``[0, N_k)`` — share
  one ``(bq, window)`` mask broadcast over the blocks and read K/V unpadded, and the few
  edge blocks run in their own call (2–3 calls in all, no N_q × window mask built);
  the query block size (1, 2, 4 or 8 × ``block_q``) is the one computing the fewest pairs;
- **per block** — otherwise: query blocks (coarsened up to 4 × ``block_q`` while that adds at
  most 25% work), one kernel call per run, merged by LSE.

Two engines compute a run:

- **fused** (no softcap / score_mod / dropout, and no bias that needs a gradient): torch's
  own fused CPU flash kernel, which returns its LSE, given the run's additive mask tile
  (or ``is_causal`` for a diagonal square). Backward is FlashAttention-2 style inside a
  :class:`torch.autograd.Function`: each run is recomputed by torch's fused CPU flash
  backward, fed the *final* output and LSE of its rows — with the global LSE the run's
  probabilities are the global ones, so its ``dq`` part and its ``dk``/``dv`` slice are exact
  and simply add up.
- **general** (softcap, score_mod, dropout, bias with grad): per query block, key chunks
  of at most ``chunk_k`` keys as batched matmuls with an online softmax (running max,
  running sum, rescaled accumulator), scores modified per tile, in place when nothing is
  recorded. Backward: a hand-written FlashAttention-2 pass inside a
  :class:`torch.autograd.Function` (softcap's derivative by formula, score_mod's by
  autograd on the tile) — or, when score_mod closes over tensors that need gradients, when
  a bias needs one, or with dropout, each query block is recomputed by
  ``torch.utils.checkpoint`` so those gradients flow through autograd and dropout's mask is
  regenerated from the saved RNG state.

GQA never repeats K/V: the ``G = H_q / H_kv`` query heads sharing a K/V head are stacked as
rows, ``q (B, H_kv, G·rows, D)``, and multiplied by K once.

Shape legend::

    q (B, H_q, N_q, D_k)   k (B, H_kv, N_k, D_k)   v (B, H_kv, N_k, D_v)   H_q = G · H_kv
    grouped query block    (B, H_kv, G·bq, D)        bq ≤ block_q rows of one query block
    run                    keys [k0, k1) of one query block, one kernel call
    out (B, H_q, N_q, D_v) lse (B, H_q, N_q)

Numerical contract: float16/bfloat16 inputs are computed in float32 (one cast in, one cast
out); a query with no allowed key gets output 0, LSE −∞ and zero gradients.

Caution
-------
- The fused kernel needs D_v == D_k: the narrower of q/k and v is zero-padded to the wider
  width (exact: zero columns add nothing to a dot product and give zero output columns).
- Masks summarised conservatively (``&``/``|`` algebra, ``from_fn``) may mark a tile
  PARTIAL that is in fact EMPTY or FULL: correct, a little slower.
- The windowed schedule evaluates the mask on its whole window tensor (``N_q × window``
  elements, built once per call), FULL tiles included — except a band mask, whose interior
  blocks share one ``(bq, window)`` pattern (forward and backward); it is used only when the
  window is at most a quarter of N_k (and the tensor at most 2^24 elements).
- Exact causal (one call) and the band masks' window patterns are recognised from
  ``Mask.spec`` (:class:`attnkit.masks.Band`); other masks are evaluated.
- Dropout draws its mask from torch's global generator (reproducible with
  ``torch.manual_seed``) but in a different order than the reference does: results agree in
  distribution, not bit for bit.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .. import masks as _masks
from . import register
from .base import Backend, Problem, compute_dtype

__all__ = ["TiledBackend", "tile_sizes", "STATS", "plan"]

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

# Tunables (measured on a 2-core AVX2 machine, see BENCHMARKS.md): query rows per block,
# key granularity of the block map, and the key chunk of the general engine.
_SIZES = {"block_q": 128, "block_k": 128, "chunk_k": 2048, "general_block_q": 256}
# Score elements one general-engine step may hold (a block's recompute holds a few such).
_GENERAL_BUDGET = 1 << 22

# Debug counters of the last call(s): tiles seen / skipped, kernel calls. Tests read them.
STATS: dict[str, int] = {}


def _reset_stats() -> None:
    STATS.update(tiles=0, empty=0, full=0, partial=0, runs=0, causal_runs=0, masked_runs=0,
                 windowed=0)


_reset_stats()


@contextlib.contextmanager
def tile_sizes(**sizes: int) -> Iterator[None]:
    """Temporarily change tile sizes (``block_q``, ``block_k``, ``chunk_k``,
    ``general_block_q``), e.g. tiny tiles to exercise tile edges in tests."""
    unknown = set(sizes) - set(_SIZES)
    if unknown:
        raise ValueError(f"unknown tile size(s) {sorted(unknown)}: choose from {sorted(_SIZES)}")
    for k_, s in sizes.items():
        if not isinstance(s, int) or s < 1:
            raise ValueError(f"tile size {k_} must be a positive integer, got {s!r}")
    old = dict(_SIZES)
    _SIZES.update(sizes)
    try:
        yield
    finally:
        _SIZES.update(old)


# ---------------------------------------------------------------------------- the plan
@dataclass
class Run:
    """Keys ``[k0, k1)`` of one query block, computed by one kernel call."""

    k0: int
    k1: int
    masked: bool          # evaluate the mask (some tile PARTIAL, or a bias is added)


@dataclass
class Plan:
    """The schedule of one call: per query block ``[q0, q1)``, its runs (empty → skipped)."""

    block_q: int
    block_k: int
    blocks: list[tuple[int, int, list[Run]]] = field(default_factory=list)
    tiles: int = 0
    empty: int = 0
    full: int = 0
    partial: int = 0


def _status_map(p: Problem, block_q: int, block_k: int) -> np.ndarray | None:
    """Per tile over all (batch, head): EMPTY if empty everywhere, FULL if full everywhere,
    else PARTIAL → int8 ``(⌈N_q/block_q⌉, ⌈N_k/block_k⌉)``; ``None`` for no mask."""
    if p.mask is None:
        return None
    bm = p.mask.block_map(p.n_q, p.n_k, block_q, block_k, batch=p.batch, heads=p.heads_q,
                          device=torch.device("cpu"))
    empty = (bm == _masks.EMPTY).flatten(0, 1).all(0)
    full = (bm == _masks.FULL).flatten(0, 1).all(0)
    st = torch.where(full, _masks.FULL, torch.where(empty, _masks.EMPTY, _masks.PARTIAL))
    return st.to(torch.int8).numpy()


def _coarsen(st: np.ndarray, f: int) -> np.ndarray:
    """Merge ``f`` consecutive block rows: EMPTY if all are, FULL if all are, else PARTIAL."""
    nbq, nbk = st.shape
    pad = (-nbq) % f
    empty = np.concatenate([st == _masks.EMPTY, np.ones((pad, nbk), bool)])
    full = np.concatenate([st == _masks.FULL, np.ones((pad, nbk), bool)])
    empty = empty.reshape(-1, f, nbk).all(1)
    full = full.reshape(-1, f, nbk).all(1)
    return np.where(full, _masks.FULL, np.where(empty, _masks.EMPTY, _masks.PARTIAL))


def _cost(st: np.ndarray, bq: int, n_q: int, bk: int) -> int:
    """Score pairs computed with query blocks of ``bq`` rows (every non-empty tile)."""
    rows = np.minimum(bq, n_q - bq * np.arange(st.shape[0]))
    return int((rows * (st != _masks.EMPTY).sum(1)).sum()) * bk


def plan(p: Problem, block_q: int | None = None, block_k: int | None = None,
         coarsen: bool = True, factor: int = 1) -> Plan:
    """Cut ``p`` into query blocks and key runs from the mask's block map.

    A run is a maximal range of consecutive non-empty tiles of one kind: FULL tiles (no mask
    work) or PARTIAL tiles (mask evaluated on the run). A bias makes every run masked.
    With ``coarsen``, query blocks grow to 2× or 4× ``block_q`` rows (bigger, faster kernel
    calls) when that computes at most 25% more score pairs than the fine blocks.
    Without a mask or bias the whole call is one block and one run. ``factor`` > 1 merges
    exactly that many fine block rows (instead of ``coarsen``'s choice).
    """
    bq = block_q or _SIZES["block_q"]
    bk = block_k or _SIZES["block_k"]
    nbq, nbk = math.ceil(p.n_q / bq), math.ceil(p.n_k / bk)
    if (coarsen and p.mask is not None and p.group == 1 and p.bias is None
            and _band_is_tril(p, 0, p.n_q, 0, p.n_k)):
        # plain causal: one call of the fused kernel's own causal schedule
        pl = Plan(p.n_q, bk, tiles=nbq * nbk)
        pl.blocks.append((0, p.n_q, [Run(0, p.n_k, True)]))
        return pl
    st = _status_map(p, bq, bk)
    pl = Plan(bq, bk, tiles=nbq * nbk)
    if st is None:
        pl.full = nbq * nbk
        step = p.n_q if (p.bias is None and coarsen) else bq
        for q0 in range(0, p.n_q, step):
            pl.blocks.append((q0, min(q0 + step, p.n_q), [Run(0, p.n_k, p.bias is not None)]))
        return pl
    pl.empty = int((st == _masks.EMPTY).sum())
    pl.full = int((st == _masks.FULL).sum())
    pl.partial = int((st == _masks.PARTIAL).sum())
    if factor > 1:
        st, bq = _coarsen(st, factor), factor * bq
        pl.block_q = bq
    elif coarsen:
        base = _cost(st, bq, p.n_q, bk)
        for f in (4, 2):
            cst = _coarsen(st, f)
            if _cost(cst, f * bq, p.n_q, bk) <= 1.25 * base:
                st, bq = cst, f * bq
                pl.block_q = bq
                break
    for i in range(st.shape[0]):
        row = st[i]
        # run boundaries: where the tile kind changes
        cuts = np.flatnonzero(np.diff(row)) + 1
        starts = np.concatenate(([0], cuts))
        ends = np.concatenate((cuts, [nbk]))
        runs = []
        for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
            kind = int(row[s])
            if kind == _masks.EMPTY:
                continue
            runs.append(Run(s * bk, min(e * bk, p.n_k),
                            kind == _masks.PARTIAL or p.bias is not None))
        pl.blocks.append((i * bq, min((i + 1) * bq, p.n_q), runs))
    return pl


def _count(pl: Plan) -> None:
    STATS["tiles"] += pl.tiles
    STATS["empty"] += pl.empty
    STATS["full"] += pl.full
    STATS["partial"] += pl.partial


# ---------------------------------------------------------------------------- tiles
def _allowed_tile(p: Problem, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
    """The mask on queries ``[q0, q1)`` × keys ``[k0, k1)``: bool ``(B|1, H_q|1, bq, L)``."""
    m = p.mask
    assert m is not None
    dev = p.device
    b = torch.arange(p.batch if m.depends_on_batch else 1, device=dev).view(-1, 1, 1, 1)
    h = torch.arange(p.heads_q if m.depends_on_heads else 1, device=dev).view(1, -1, 1, 1)
    qi = torch.arange(q0, q1, device=dev).view(1, 1, -1, 1)
    ki = torch.arange(k0, k1, device=dev).view(1, 1, 1, -1)
    a = m(b, h, qi, ki, p.n_q, p.n_k)
    while a.dim() < 4:
        a = a.unsqueeze(0)
    return a.expand(a.shape[0], a.shape[1], q1 - q0, k1 - k0)


def _bias_tile(bias: torch.Tensor, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
    """``bias (B|1, H_q|1, N_q|1, N_k|1)`` restricted to the tile (size-1 dims kept)."""
    t = bias if bias.shape[2] == 1 else bias[:, :, q0:q1]
    return t if t.shape[3] == 1 else t[:, :, :, k0:k1]


def _to_grouped(t: torch.Tensor, g: int, heads_kv: int) -> torch.Tensor:
    """``(B|1, H_q|1, bq, …)`` → grouped rows ``(B|1, H_kv|1, G·bq, …)``."""
    if g == 1:
        return t
    b_, h_, bq = t.shape[:3]
    rest = tuple(t.shape[3:])
    if h_ == 1:                       # the same rows for every query head of a group
        return t.repeat(1, 1, g, *([1] * len(rest)))
    return t.reshape(b_, heads_kv, g * bq, *rest)


def _tile_is_tril(allowed: torch.Tensor) -> bool:
    """True when a square tile's mask is exactly the top-left causal pattern (all b, h)."""
    bq, L = allowed.shape[-2:]
    if bq != L:
        return False
    return bool((allowed == _tril(bq)).all())


def _band(mask: _masks.Mask) -> tuple[float, float, bool] | None:
    """``(lo, hi, bottom_right)`` when ``mask`` is a band mask (causal, sliding window):
    allowed ⇔ ``lo <= q - k + off <= hi``, a pattern known in closed form; else ``None``."""
    spec = mask.spec
    if not isinstance(spec, _masks.Band):
        return None
    return float(spec.lo), float(spec.hi), spec.bottom_right


def _band_is_tril(p: Problem, q0: int, q1: int, k0: int, k1: int) -> bool:
    """True when a band mask is exactly top-left causal on this square tile."""
    assert p.mask is not None
    band = _band(p.mask)
    n = q1 - q0
    if band is None or n != k1 - k0:
        return False
    lo, hi, br = band
    c = q0 - k0 + ((p.n_k - p.n_q) if br else 0)    # allowed iff lo <= c + (i - j) <= hi
    return c == lo == 0 and hi >= n - 1


@functools.lru_cache(maxsize=8)
def _tril(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril_()


# ---------------------------------------------------------------------------- fused engine
@dataclass
class _Fused:
    """What one fused call needs, in the grouped layout (see the module legend)."""

    p: Problem
    pl: Plan
    q: torch.Tensor       # (B, H_kv, G, N_q, D)   compute dtype, D padded
    k: torch.Tensor       # (B, H_kv, N_k, D)
    v: torch.Tensor       # (B, H_kv, N_k, D)
    bias: torch.Tensor | None
    win: _Window | None = None


def _run_mask(f: _Fused, q0: int, q1: int, run: Run) -> tuple[torch.Tensor | None, bool,
                                                                torch.Tensor | None]:
    """→ (additive float mask in grouped rows or None, is_causal, rows-with-a-key or None)."""
    p = f.p
    if not run.masked:
        return None, False, None
    g = p.group
    if (p.mask is not None and f.bias is None and g == 1
            and _band_is_tril(p, q0, q1, run.k0, run.k1)):
        return None, True, None                              # known without evaluating
    allowed = _allowed_tile(p, q0, q1, run.k0, run.k1) if p.mask is not None else None
    if allowed is not None and f.bias is None and g == 1 and _tile_is_tril(allowed):
        return None, True, None
    dt = f.q.dtype
    shape = (q1 - q0, run.k1 - run.k0)
    if allowed is not None:
        add = torch.zeros(allowed.shape, dtype=dt).masked_fill_(~allowed, -math.inf)
    else:
        add = torch.zeros(1, 1, *shape, dtype=dt)
    if f.bias is not None:
        add = add + _bias_tile(f.bias, q0, q1, run.k0, run.k1)
        add = add.expand(*add.shape[:2], *shape)
    has_key = _to_grouped(allowed.any(-1), g, p.heads_kv) if allowed is not None else None
    return _to_grouped(add, g, p.heads_kv).contiguous(), False, has_key


def _merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge per-run ``(out (…, rows, D), lse (…, rows))`` by their log-sum-exp.

    Weights are formed on the small ``(…, rows)`` tensors; the outputs are combined in place
    in the first run's buffer (one multiply and one fused multiply-add per further run).
    """
    if len(parts) == 1:
        return parts[0]
    lse = torch.stack([x[1] for x in parts])                 # (R, …, rows)
    m = lse.amax(0)
    m = torch.where(m == -math.inf, torch.zeros_like(m), m)
    w = torch.exp(lse - m)                                   # (R, …, rows)
    s = w.sum(0)
    nonzero = s > 0
    s_safe = torch.where(nonzero, s, torch.ones_like(s))
    w = (w / s_safe).unsqueeze(-1)                           # normalised weights
    out = parts[0][0].mul_(w[0])
    for r in range(1, len(parts)):
        out.addcmul_(parts[r][0], w[r])
    lse_out = torch.where(nonzero, m + torch.log(s_safe), torch.full_like(s, -math.inf))
    return out, lse_out


def _fused_forward(f: _Fused) -> tuple[torch.Tensor, torch.Tensor]:
    """→ out (B, H_kv, G, N_q, D), lse (B, H_kv, G, N_q) in the compute dtype."""
    if f.win is not None:
        return _win_forward(f, f.win)
    p = f.p
    B, hkv, g, n_q, d = f.q.shape
    one = len(f.pl.blocks) == 1 and f.pl.blocks[0][2]        # one block with runs: no copy
    out = None if one else f.q.new_empty(B, hkv, g, n_q, d)
    lse = None if one else f.q.new_empty(B, hkv, g, n_q)
    for q0, q1, runs in f.pl.blocks:
        if not runs:
            assert out is not None and lse is not None
            out[:, :, :, q0:q1] = 0.0
            lse[:, :, :, q0:q1] = -math.inf
            continue
        bq = q1 - q0
        qb = f.q[:, :, :, q0:q1].reshape(B, hkv, g * bq, d)
        parts = []
        for run in runs:
            add, causal, has_key = _run_mask(f, q0, q1, run)
            STATS["runs"] += 1
            STATS["causal_runs"] += int(causal)
            STATS["masked_runs"] += int(add is not None)
            o, lse_r = _flash(qb, f.k[:, :, run.k0:run.k1], f.v[:, :, run.k0:run.k1],
                              is_causal=causal, attn_mask=add, scale=p.scale)
            if has_key is not None:                          # rows with no key: lse −∞
                lse_r = torch.where(has_key, lse_r, torch.full_like(lse_r, -math.inf))
            parts.append((o, lse_r.to(o.dtype)))
        o, l_ = _merge(parts)
        if out is None or lse is None:
            return o.view(B, hkv, g, bq, d), l_.view(B, hkv, g, bq)
        out[:, :, :, q0:q1] = o.view(B, hkv, g, bq, d)
        lse[:, :, :, q0:q1] = l_.view(B, hkv, g, bq)
    assert out is not None and lse is not None
    return out, lse


def _fused_backward(f: _Fused, out: torch.Tensor, lse: torch.Tensor,
                    dout: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """FlashAttention-2 style: recompute each run with the final out/LSE of its rows."""
    if f.win is not None:
        return _win_backward(f, f.win, out, lse, dout)
    p = f.p
    B, hkv, g, n_q, d = f.q.shape
    blocks = f.pl.blocks
    single = (len(blocks) == 1 and len(blocks[0][2]) == 1
              and blocks[0][2][0].k0 == 0 and blocks[0][2][0].k1 == f.k.shape[2])
    # one run over everything: the kernel's gradients are the answer (no accumulators)
    dq = None if single else torch.zeros_like(f.q)
    dk = None if single else torch.zeros(f.k.shape, dtype=f.k.dtype)
    dv = None if single else torch.zeros(f.v.shape, dtype=f.v.dtype)
    # an empty row has lse −∞; +∞ makes every exp(s − lse) exactly 0 there
    lse_b = torch.where(lse == -math.inf, torch.full_like(lse, math.inf), lse)
    for q0, q1, runs in f.pl.blocks:
        if not runs:
            continue
        bq = q1 - q0
        qb = f.q[:, :, :, q0:q1].reshape(B, hkv, g * bq, d)
        ob = out[:, :, :, q0:q1].reshape(B, hkv, g * bq, d)
        dob = dout[:, :, :, q0:q1].reshape(B, hkv, g * bq, d)
        lb = lse_b[:, :, :, q0:q1].reshape(B, hkv, g * bq)
        if lb.dtype != torch.float64:
            lb = lb.float()
        dqb = None
        for run in runs:
            add, causal, _ = _run_mask(f, q0, q1, run)
            gq, gk, gv = _flash_bwd(dob, qb, f.k[:, :, run.k0:run.k1],
                                    f.v[:, :, run.k0:run.k1], ob, lb, 0.0, causal,
                                    attn_mask=add, scale=p.scale)
            if dq is None or dk is None or dv is None:
                return gq.view(B, hkv, g, n_q, d), gk, gv
            dqb = gq if dqb is None else dqb.add_(gq)
            dk[:, :, run.k0:run.k1] += gk
            dv[:, :, run.k0:run.k1] += gv
        if dqb is not None and dq is not None:
            dq[:, :, :, q0:q1] = dqb.view(B, hkv, g, bq, d)
    assert dq is not None and dk is not None and dv is not None
    return dq, dk, dv


# ---------------------------------------------------------------------------- windows
@dataclass
class _Window:
    """All query blocks in ONE fused call: block i sees keys ``[i·bq + off, i·bq + off + lw)``.

    Used when every block's non-empty tiles lie in a short window at a fixed offset from the
    block (sliding windows, documents, local masks): one kernel call instead of one per run,
    blocks batched as extra "heads". K/V are padded by ``front``/``back`` zero rows (masked)
    and the windows are strided views of them (no gather).
    """

    bq: int
    nb: int
    lw: int
    off: int
    front: int
    back: int
    masked: bool                  # False: every window is exactly one FULL run


def _window_plan(p: Problem, pl: Plan) -> _Window | None:
    if len(pl.blocks) < 2:
        return None
    bq, nb = pl.block_q, len(pl.blocks)
    lo, hi, exact = None, None, True
    for i, (_q0, _q1, runs) in enumerate(pl.blocks):
        if not runs:
            exact = False
            continue
        s0, e0 = runs[0].k0 - i * bq, runs[-1].k1 - i * bq
        lo = s0 if lo is None else min(lo, s0)
        hi = e0 if hi is None else max(hi, e0)
        exact &= len(runs) == 1 and not runs[0].masked
    if lo is None or hi is None:
        return None
    lw = hi - lo
    # a window tensor of N_q × lw stays well below N_q × N_k (and below 64 MB)
    if 4 * lw > p.n_k or nb * bq * p.group * lw > (1 << 24):
        return None
    front = max(0, -lo)
    back = max(0, (nb - 1) * bq + lo + lw - p.n_k)
    if exact:        # windows must be exactly the FULL runs, inside [0, N_k)
        exact = front == 0 and back == 0 and all(
            runs[0].k0 == i * bq + lo and runs[0].k1 == i * bq + lo + lw
            for i, (_q0, _q1, runs) in enumerate(pl.blocks))
    return _Window(bq, nb, lw, lo, front, back, not exact)


def _win_rows(t: torch.Tensor, w: _Window, n_q: int) -> torch.Tensor:
    """``(B, H_kv, G, N_q, X)`` → ``(B·H_kv, nb, G·bq, X)`` (rows padded to nb·bq)."""
    B, hkv, g, _, x = t.shape
    if w.nb * w.bq != n_q:
        t = F.pad(t, (0, 0, 0, w.nb * w.bq - n_q))
    return t.view(B, hkv, g, w.nb, w.bq, x).transpose(2, 3).reshape(B * hkv, w.nb, g * w.bq, x)


def _win_unrows(t: torch.Tensor, B: int, hkv: int, g: int, w: _Window, n_q: int) -> torch.Tensor:
    """Inverse of :func:`_win_rows`: ``(B·H_kv, nb, G·bq, X)`` → ``(B, H_kv, G, N_q, X)``."""
    x = t.shape[-1]
    t = t.view(B, hkv, w.nb, g, w.bq, x).transpose(2, 3).reshape(B, hkv, g, w.nb * w.bq, x)
    return t[:, :, :, :n_q]


def _win_kv(f: _Fused, w: _Window) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V windows ``(B·H_kv, nb, lw, D)``: strided views of the zero-padded K/V."""
    B, hkv, n_k, d = f.k.shape
    out = []
    for t in (f.k, f.v):
        tp = F.pad(t, (0, 0, w.front, w.back)) if (w.front or w.back) else t.contiguous()
        n_p = n_k + w.front + w.back
        out.append(tp.as_strided((B * hkv, w.nb, w.lw, d), (n_p * d, w.bq * d, d, 1),
                                 tp.storage_offset() + (w.off + w.front) * d))
    return out[0], out[1]


def _win_mask(f: _Fused, w: _Window) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """→ (additive mask ``(B·H_kv|1, nb, G·bq, lw)``, rows with a key ``(…, nb, G·bq)``)."""
    p = f.p
    if not w.masked:
        return None, None
    m = p.mask
    assert m is not None
    B, hkv, g = p.batch, p.heads_kv, p.group
    c = torch.arange(w.lw)
    k_abs = torch.arange(w.nb).view(-1, 1) * w.bq + w.off + c.view(1, -1)   # (nb, lw)
    inside = (k_abs >= 0) & (k_abs < p.n_k)
    band = _band(m)
    if band is not None:
        # q − k = r − off − c for every block: one (bq, lw) pattern, shifted nowhere
        lo, hi, br = band
        dqk = (torch.arange(w.bq).view(-1, 1) - w.off - c.view(1, -1)
               + ((p.n_k - p.n_q) if br else 0))
        shared = (dqk >= lo) & (dqk <= hi)                                    # (bq, lw)
        allowed = (shared.unsqueeze(0) & inside.unsqueeze(1)).view(1, 1, w.nb * w.bq, w.lw)
    else:
        qi = torch.arange(w.nb * w.bq).clamp(max=p.n_q - 1).view(1, 1, -1, 1)
        ki = k_abs.clamp(0, p.n_k - 1).repeat_interleave(w.bq, 0).view(1, 1, -1, w.lw)
        b = torch.arange(B if m.depends_on_batch else 1).view(-1, 1, 1, 1)
        h = torch.arange(p.heads_q if m.depends_on_heads else 1).view(1, -1, 1, 1)
        allowed = m(b, h, qi, ki, p.n_q, p.n_k) & inside.repeat_interleave(w.bq, 0)
        while allowed.dim() < 4:
            allowed = allowed.unsqueeze(0)
    allowed = allowed.expand(allowed.shape[0], allowed.shape[1], w.nb * w.bq, w.lw)
    bm, hm = allowed.shape[:2]
    if bm == 1 and hm == 1:                                  # one mask for every (b, h)
        a = allowed.reshape(1, w.nb, 1, w.bq, w.lw).expand(1, w.nb, g, w.bq, w.lw)
        a = a.reshape(1, w.nb, g * w.bq, w.lw)
    else:
        a = allowed.expand(B, p.heads_q, w.nb * w.bq, w.lw).reshape(B, hkv, g, w.nb * w.bq,
                                                                    w.lw)
        a = _win_rows(a, w, w.nb * w.bq)                      # (B·H_kv, nb, G·bq, lw)
    add = torch.zeros(a.shape, dtype=f.q.dtype).masked_fill_(~a, -math.inf)
    return add, a.any(-1)


def _win_forward(f: _Fused, w: _Window) -> tuple[torch.Tensor, torch.Tensor]:
    p = f.p
    B, hkv, g, n_q, d = f.q.shape
    split = _win_split(f, w)
    if split is not None:
        # interior blocks (window inside [0, N_k)) share ONE (bq, lw) band pattern: no K/V
        # padding, a small mask broadcast over the blocks; the few edge blocks apart
        parts = [_win_range(f, w, a, b_, inner) for a, b_, inner in split]
        if len(parts) == 1:
            return parts[0]
        return (torch.cat([x[0] for x in parts], 3), torch.cat([x[1] for x in parts], 3))
    kw, vw = _win_kv(f, w)
    add, has_key = _win_mask(f, w)
    STATS["runs"] += 1
    STATS["windowed"] += 1
    STATS["masked_runs"] += int(add is not None)
    o, lse = _flash(_win_rows(f.q, w, n_q), kw, vw, attn_mask=add, scale=p.scale)
    lse = lse.to(o.dtype)
    if has_key is not None:
        lse = torch.where(has_key, lse, torch.full_like(lse, -math.inf))
    out = _win_unrows(o, B, hkv, g, w, n_q)
    lse = _win_unrows(lse.unsqueeze(-1), B, hkv, g, w, n_q).squeeze(-1)
    return out.contiguous(), lse.contiguous()


def _win_split(f: _Fused, w: _Window) -> list[tuple[int, int, bool]] | None:
    """Block ranges ``(i_lo, i_hi, interior)`` for a band mask, or None (one masked call).

    Interior blocks — windows inside ``[0, N_k)`` — share one band pattern; the edge blocks
    before and after them are computed apart.
    """
    p = f.p
    if not (w.masked and p.mask is not None and f.bias is None and _band(p.mask) is not None):
        return None
    i0 = min(w.nb, max(0, -(w.off // w.bq)))
    i1 = max(i0, min(w.nb, (p.n_k - w.off - w.lw) // w.bq + 1))
    if i1 - i0 < max(2, w.nb // 2):
        return None
    return [(a, b_, a == i0 and b_ == i1) for a, b_ in ((0, i0), (i0, i1), (i1, w.nb)) if b_ > a]


def _win_range_inputs(f: _Fused, w: _Window, i_lo: int, i_hi: int, interior: bool):  # noqa: ANN202
    """K/V windows, additive mask and rows-with-a-key for blocks ``[i_lo, i_hi)`` of a band.

    K/V are sliced to the keys those blocks see (zero-padded only where a window leaves
    ``[0, N_k)``). ``interior``: every window lies inside ``[0, N_k)``, so all blocks share
    one ``(G·bq, lw)`` mask, broadcast over the blocks (stride 0).
    → (kw, vw ``(B·H_kv, n, lw, D)``, add, has_key, sub-window, first key (absolute)).
    """
    p = f.p
    B, hkv, g, n_q, d = f.q.shape
    n_k = f.k.shape[2]
    bq, lw, n = w.bq, w.lw, i_hi - i_lo
    s0, s1 = i_lo * bq + w.off, (i_hi - 1) * bq + w.off + lw       # absolute keys seen
    ks, ke = max(0, s0), min(n_k, s1)
    front, back = ks - s0, s1 - ke
    kv = []
    for t in (f.k, f.v):
        t = t[:, :, ks:ke]
        t = F.pad(t, (0, 0, front, back)) if (front or back) else t.contiguous()
        kv.append(t.as_strided((B * hkv, n, lw, d), (t.shape[2] * d, bq * d, d, 1),
                               t.storage_offset()))
    band = _band(p.mask)  # type: ignore[arg-type]
    assert band is not None
    lo, hi, br = band
    c = torch.arange(lw)
    dqk = (torch.arange(bq).view(-1, 1) - w.off - c.view(1, -1)
           + ((p.n_k - p.n_q) if br else 0))
    allowed = (dqk >= lo) & (dqk <= hi)                                   # (bq, lw)
    if interior:
        a = allowed.view(1, 1, 1, bq, lw).expand(1, 1, g, bq, lw).reshape(1, 1, g * bq, lw)
    else:
        k_abs = torch.arange(i_lo, i_hi).view(-1, 1) * bq + w.off + c.view(1, -1)
        inside = (k_abs >= 0) & (k_abs < p.n_k)                           # (n, lw)
        a = (allowed.unsqueeze(0) & inside.unsqueeze(1)).view(1, n, 1, bq, lw)
        a = a.expand(1, n, g, bq, lw).reshape(1, n, g * bq, lw)
    add = torch.zeros(a.shape, dtype=f.q.dtype).masked_fill_(~a, -math.inf)
    has_key = a.any(-1)
    if interior:
        add = add.expand(1, n, g * bq, lw)
    return kv[0], kv[1], add, has_key, _Window(bq, n, lw, 0, 0, 0, True), s0


def _win_range(f: _Fused, w: _Window, i_lo: int, i_hi: int, interior: bool,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward of blocks ``[i_lo, i_hi)`` of a band-masked window schedule, ONE kernel call.

    → out ``(B, H_kv, G, rows, D)``, lse ``(B, H_kv, G, rows)`` for query rows
    ``[i_lo·bq, min(i_hi·bq, N_q))``.
    """
    p = f.p
    B, hkv, g, n_q, d = f.q.shape
    r0, r1 = i_lo * w.bq, min(i_hi * w.bq, n_q)
    kw, vw, add, has_key, wr, _ = _win_range_inputs(f, w, i_lo, i_hi, interior)
    STATS["runs"] += 1
    STATS["windowed"] += 1
    STATS["masked_runs"] += 1
    o, lse = _flash(_win_rows(f.q[:, :, :, r0:r1], wr, r1 - r0), kw, vw, attn_mask=add,
                    scale=p.scale)
    lse = lse.to(o.dtype)
    if not bool(has_key.all()):
        lse = torch.where(has_key, lse, torch.full_like(lse, -math.inf))
    out = _win_unrows(o, B, hkv, g, wr, r1 - r0)
    lse = _win_unrows(lse.unsqueeze(-1), B, hkv, g, wr, r1 - r0).squeeze(-1)
    return out, lse


def _win_backward_split(f: _Fused, w: _Window, split: list[tuple[int, int, bool]],
                        out: torch.Tensor, lse_b: torch.Tensor, dout: torch.Tensor,
                        ) -> tuple[torch.Tensor, ...]:
    """Backward of a band-masked window schedule, one kernel call per block range."""
    p = f.p
    B, hkv, g, n_q, d = f.q.shape
    n_k = f.k.shape[2]
    dk = f.k.new_zeros(B, hkv, n_k + w.front + w.back, d)
    dv = f.v.new_zeros(B, hkv, n_k + w.front + w.back, d)
    dqs = []
    for i_lo, i_hi, interior in split:
        r0, r1 = i_lo * w.bq, min(i_hi * w.bq, n_q)
        kw, vw, add, _, wr, s0 = _win_range_inputs(f, w, i_lo, i_hi, interior)
        rows = r1 - r0

        def sub(t: torch.Tensor, r0: int = r0, r1: int = r1, wr: _Window = wr,
                rows: int = rows) -> torch.Tensor:
            return _win_rows(t[:, :, :, r0:r1], wr, rows)

        lse_w = sub(lse_b.unsqueeze(-1)).squeeze(-1)
        gq, gk, gv = _flash_bwd(sub(dout), sub(f.q), kw, vw, sub(out), lse_w, 0.0, False,
                                attn_mask=add, scale=p.scale)
        dqs.append(_win_unrows(gq, B, hkv, g, wr, rows))
        # window j of this range starts at absolute key s0 + j·bq (padded: + w.front)
        flat = (torch.arange(wr.nb).view(-1, 1) * w.bq + (s0 + w.front)
                + torch.arange(w.lw).view(1, -1)).reshape(-1)
        dk.index_add_(2, flat, gk.reshape(B, hkv, wr.nb * w.lw, d))
        dv.index_add_(2, flat, gv.reshape(B, hkv, wr.nb * w.lw, d))
    dq = torch.cat(dqs, 3) if len(dqs) > 1 else dqs[0].contiguous()
    return dq, dk[:, :, w.front:w.front + n_k], dv[:, :, w.front:w.front + n_k]


def _win_backward(f: _Fused, w: _Window, out: torch.Tensor, lse: torch.Tensor,
                  dout: torch.Tensor) -> tuple[torch.Tensor, ...]:
    p = f.p
    B, hkv, g, n_q, d = f.q.shape
    lse_b = torch.where(lse == -math.inf, torch.full_like(lse, math.inf), lse)
    if lse_b.dtype != torch.float64:
        lse_b = lse_b.float()
    split = _win_split(f, w)
    if split is not None:
        return _win_backward_split(f, w, split, out, lse_b, dout)
    kw, vw = _win_kv(f, w)
    add, _ = _win_mask(f, w)
    lse_w = _win_rows(lse_b.unsqueeze(-1), w, n_q).squeeze(-1)
    gq, gk, gv = _flash_bwd(_win_rows(dout, w, n_q), _win_rows(f.q, w, n_q), kw, vw,
                            _win_rows(out, w, n_q), lse_w, 0.0, False, attn_mask=add,
                            scale=p.scale)
    dq = _win_unrows(gq, B, hkv, g, w, n_q)
    n_k = f.k.shape[2]
    n_p = n_k + w.front + w.back
    # window j of block i is padded row i·bq + off + front + j: overlapping windows add up
    flat = (torch.arange(w.nb).view(-1, 1) * w.bq + (w.off + w.front)
            + torch.arange(w.lw).view(1, -1)).reshape(-1)
    dk = f.k.new_zeros(B, hkv, n_p, d).index_add_(2, flat, gk.reshape(B, hkv, w.nb * w.lw, d))
    dv = f.v.new_zeros(B, hkv, n_p, d).index_add_(2, flat, gv.reshape(B, hkv, w.nb * w.lw, d))
    return dq.contiguous(), dk[:, :, w.front:w.front + n_k], dv[:, :, w.front:w.front + n_k]


class _FusedAttention(torch.autograd.Function):
    """out, lse = attention(q, k, v) on the fused engine; backward recomputes per run."""

    @staticmethod
    def forward(ctx, q, k, v, f):  # noqa: ANN001, ANN205
        f = _Fused(f.p, f.pl, q, k, v, f.bias, f.win)
        out, lse = _fused_forward(f)
        ctx.f = f
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):  # noqa: ANN001, ANN205
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        lse_grad = dlse is not None and bool((dlse != 0).any())
        if lse_grad:
            # ∂lse/∂logits = P, so dS = P∘(dP − D + dlse): the kernel's D = rowsum(dO∘O) gets
            # −dlse from one extra column (dO: −dlse, O: 1) whose V and Q/K columns are zero
            dl = torch.where(torch.isfinite(lse), dlse, torch.zeros_like(dlse)).to(dout.dtype)
            q, k, v = (F.pad(t, (0, 1)) for t in (q, k, v))
            out = torch.cat([out, torch.ones_like(out[..., :1])], -1)
            dout = torch.cat([dout, -dl.unsqueeze(-1)], -1)
        f = _Fused(ctx.f.p, ctx.f.pl, q, k, v, ctx.f.bias, ctx.f.win)
        dq, dk, dv = _fused_backward(f, out, lse, dout)
        if lse_grad:
            dq, dk, dv = dq[..., :-1], dk[..., :-1], dv[..., :-1]
        return dq, dk, dv, None


def _fused_attention(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    acc = compute_dtype(p.dtype)
    B, hkv, g = p.batch, p.heads_kv, p.group
    d = max(p.d_k, p.d_v)
    # the fused kernel reads rows through strides but needs unit stride along D
    q, k, v = (t.to(acc) if t.stride(-1) == 1 else t.to(acc).contiguous()
               for t in (p.q, p.k, p.v))
    if p.d_k < d:           # zero columns change no dot product
        q, k = F.pad(q, (0, d - p.d_k)), F.pad(k, (0, d - p.d_k))
    if p.d_v < d:           # zero value columns give zero output columns, cut off below
        v = F.pad(v, (0, d - p.d_v))
    q = q.view(B, hkv, g, p.n_q, d)
    bias = p.bias.to(acc) if p.bias is not None else None
    win, fine = None, None
    if p.mask is not None and bias is None and _band_is_tril(p, 0, p.n_q, 0, p.n_k) is False:
        # the cheapest windowed schedule over query blocks of 1, 2, 4, 8 × block_q rows
        best = None
        for factor in (1, 2, 4, 8):
            cand = plan(p, coarsen=False, factor=factor)
            w_ = _window_plan(p, cand)
            if w_ is not None and (best is None or w_.nb * w_.bq * w_.lw
                                   < 0.95 * best[1].nb * best[1].bq * best[1].lw):
                best = (cand, w_)
        if best is not None:
            fine, win = best
    pl = fine if fine is not None else plan(p)
    _count(pl)
    f = _Fused(p, pl, q, k, v, bias, win)
    if p.requires_grad:
        out, lse = _FusedAttention.apply(q, k, v, f)
    else:
        out, lse = _fused_forward(f)
    out = out.reshape(B, p.heads_q, p.n_q, d)[..., : p.d_v]
    return out.to(p.dtype), lse.reshape(B, p.heads_q, p.n_q)


# ---------------------------------------------------------------------------- general engine
def _general_block(p: Problem, q0: int, q1: int, runs: list[Run], chunk_k: int,
                   qb: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One query block, online softmax over key chunks.

    ``qb (B·H_kv, G·bq, D_k)`` pre-scaled, ``k (B·H_kv, N_k, D_k)``, ``v (B·H_kv, N_k, D_v)``
    → ``out (B, H_q, bq, D_v)``, ``lse (B, H_q, bq)``.
    """
    B, hq, hkv, g = p.batch, p.heads_q, p.heads_kv, p.group
    bq = q1 - q0
    dev = qb.device
    bi = torch.arange(B, device=dev).view(-1, 1, 1, 1)
    hi = torch.arange(hq, device=dev).view(1, -1, 1, 1)
    qi = torch.arange(q0, q1, device=dev).view(1, 1, -1, 1)
    m = torch.full((B, hq, bq, 1), -math.inf, dtype=qb.dtype, device=dev)
    lsum = torch.zeros((B, hq, bq, 1), dtype=qb.dtype, device=dev)
    acc = torch.zeros((B * hkv, g * bq, v.shape[-1]), dtype=qb.dtype, device=dev)
    ip = not torch.is_grad_enabled()          # nothing recorded: work in place on the tile
    for run in runs:
        for k0 in range(run.k0, run.k1, chunk_k):
            k1 = min(k0 + chunk_k, run.k1)
            STATS["runs"] += 1
            s = torch.bmm(qb, k[:, k0:k1].transpose(1, 2))          # (B·H_kv, G·bq, L)
            x = s.view(B, hq, bq, k1 - k0)                            # (B, H_q, bq, L)
            if p.softcap is not None:
                c = p.softcap
                # c·tanh(x/c) = c·(2σ(2x/c) − 1): torch's sigmoid is ~2× faster than its tanh
                x = x.mul_(2.0 / c).sigmoid_().mul_(2.0 * c).sub_(c) if ip \
                    else c * torch.tanh(x / c)
            if p.score_mod is not None:
                ki = torch.arange(k0, k1, device=dev).view(1, 1, 1, -1)
                x = p.score_mod(x, bi, hi, qi, ki)
            if bias is not None:
                bt = _bias_tile(bias, q0, q1, k0, k1)
                x = x.add_(bt) if ip and x.shape == torch.broadcast_shapes(x.shape, bt.shape) \
                    else x + bt
            if run.masked and p.mask is not None:
                allowed = _allowed_tile(p, q0, q1, k0, k1)
                x = x.masked_fill_(~allowed, -math.inf) if ip else x.masked_fill(~allowed,
                                                                                 -math.inf)
            m_new = torch.maximum(m, x.detach().amax(-1, keepdim=True))
            m_safe = torch.where(m_new == -math.inf, torch.zeros_like(m_new), m_new)
            alpha = torch.exp(m - m_safe)                             # rescales the past
            e = x.sub_(m_safe).exp_() if ip else torch.exp(x - m_safe)  # (B, H_q, bq, L)
            lsum = lsum * alpha + e.sum(-1, keepdim=True)
            if p.dropout_p > 0.0:
                keep = torch.rand(e.shape, device=dev) >= p.dropout_p
                e = torch.where(keep, e * (1.0 / (1.0 - p.dropout_p)), torch.zeros_like(e))
            a = alpha.view(B * hkv, g * bq, 1)
            acc = (acc.mul_(a).baddbmm_(e.reshape(B * hkv, g * bq, k1 - k0), v[:, k0:k1]) if ip
                   else torch.baddbmm(acc * a, e.reshape(B * hkv, g * bq, k1 - k0),
                                      v[:, k0:k1]))
            m = m_new
    nonempty = lsum > 0
    l_safe = torch.where(nonempty, lsum, torch.ones_like(lsum))
    out = acc.view(B, hq, bq, -1) / l_safe
    m_safe = torch.where(m == -math.inf, torch.zeros_like(m), m)
    lse = torch.where(nonempty, m_safe + torch.log(l_safe), torch.full_like(lsum, -math.inf))
    return out, lse.squeeze(-1)


def _general_attention(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    acc = compute_dtype(p.dtype)
    B, hkv, g = p.batch, p.heads_kv, p.group
    q = (p.q.to(acc) * p.scale).view(B, hkv, g, p.n_q, p.d_k)
    k = p.k.to(acc).reshape(B * hkv, p.n_k, p.d_k)
    v = p.v.to(acc).reshape(B * hkv, p.n_k, p.d_v)
    bias = p.bias.to(acc) if p.bias is not None else None
    # rows per block and keys per chunk within a budget of score elements per step; a
    # checkpointed block (score_mod, dropout, bias with grad) holds its whole key range
    manual = _pure_score_mod(p) and p.dropout_p == 0.0 and not (
        p.bias is not None and p.bias.requires_grad)
    span = _SIZES["chunk_k"] if manual else p.n_k
    rows = max(16, min(_SIZES["general_block_q"], _GENERAL_BUDGET // (B * p.heads_q * span)))
    pl = plan(p, block_q=rows, coarsen=False)
    _count(pl)
    chunk = max(16, min(_SIZES["chunk_k"], _GENERAL_BUDGET // (B * p.heads_q * rows)))
    # score_mod may close over tensors that require grad: recompute whenever autograd records
    grad = torch.is_grad_enabled()
    if grad and manual:
        out, lse = _ManualAttention.apply(q, k, v, (p, pl, chunk, bias))
        return out.to(p.dtype), lse
    outs, lses = [], []
    for q0, q1, runs in pl.blocks:
        bq = q1 - q0
        qb = q[:, :, :, q0:q1].reshape(B * hkv, g * bq, p.d_k)
        if not runs:
            o = torch.zeros(B, p.heads_q, bq, p.d_v, dtype=acc) + 0.0 * qb.sum()
            lse_b = torch.full((B, p.heads_q, bq), -math.inf, dtype=acc)
        elif grad:
            o, lse_b = checkpoint(_general_block, p, q0, q1, runs, chunk, qb, k, v, bias,
                                  use_reentrant=False)
        else:
            o, lse_b = _general_block(p, q0, q1, runs, chunk, qb, k, v, bias)
        outs.append(o)
        lses.append(lse_b)
    out = torch.cat(outs, dim=2)
    return out.to(p.dtype), torch.cat(lses, dim=2)


def _general_forward(p: Problem, pl: Plan, chunk: int, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, bias: torch.Tensor | None,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    B, hkv, g = p.batch, p.heads_kv, p.group
    out = q.new_zeros(B, p.heads_q, p.n_q, p.d_v)
    lse = torch.full((B, p.heads_q, p.n_q), -math.inf, dtype=q.dtype)
    for q0, q1, runs in pl.blocks:
        if runs:
            qb = q[:, :, :, q0:q1].reshape(B * hkv, g * (q1 - q0), p.d_k)
            o, l_ = _general_block(p, q0, q1, runs, chunk, qb, k, v, bias)
            out[:, :, q0:q1] = o
            lse[:, :, q0:q1] = l_
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

    ``q (B, H_kv, G, N_q, D_k)`` is pre-scaled; ``k (B·H_kv, N_k, D_k)``, ``v (B·H_kv, N_k, D_v)``.
    """

    @staticmethod
    def forward(ctx, q, k, v, meta):  # noqa: ANN001, ANN205
        p, pl, chunk, bias = meta
        out, lse = _general_forward(p, pl, chunk, q, k, v, bias)
        ctx.meta = meta
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):  # noqa: ANN001, ANN205
        q, k, v, out, lse = ctx.saved_tensors
        p, pl, chunk, bias = ctx.meta
        B, hq, hkv, g = p.batch, p.heads_q, p.heads_kv, p.group
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        dcol = (dout * out).sum(-1, keepdim=True)                # (B, H_q, N_q, 1) = rowsum(dO∘O)
        if dlse is not None:                                     # ∂lse/∂logits = P
            dcol = dcol - torch.where(torch.isfinite(lse), dlse, torch.zeros_like(dlse))[..., None]
        lse_b = torch.where(lse == -math.inf, torch.full_like(lse, math.inf), lse).unsqueeze(-1)
        c = p.softcap
        bi = torch.arange(B).view(-1, 1, 1, 1)
        hi = torch.arange(hq).view(1, -1, 1, 1)
        for q0, q1, runs in pl.blocks:
            if not runs:
                continue
            bq = q1 - q0
            qb = q[:, :, :, q0:q1].reshape(B * hkv, g * bq, p.d_k)
            dob = dout[:, :, q0:q1].reshape(B * hkv, g * bq, p.d_v)
            lb, db = lse_b[:, :, q0:q1], dcol[:, :, q0:q1]       # (B, H_q, bq, 1)
            dqb = torch.zeros_like(qb)
            for run in runs:
                for k0 in range(run.k0, run.k1, chunk):
                    k1 = min(k0 + chunk, run.k1)
                    L = k1 - k0
                    x = torch.bmm(qb, k[:, k0:k1].transpose(1, 2)).view(B, hq, bq, L)
                    t = y = xr = None
                    if c is not None:
                        t = x.mul_(2.0 / c).sigmoid_().mul_(2.0).sub_(1.0)   # tanh(x/c), kept
                        x = t * c
                    if p.score_mod is not None:                   # autograd on the tile
                        with torch.enable_grad():
                            xr = x.detach().requires_grad_(True)
                            y = p.score_mod(xr, bi, hi, torch.arange(q0, q1).view(1, 1, -1, 1),
                                            torch.arange(k0, k1).view(1, 1, 1, -1))
                        x = y.detach().clone()
                    if bias is not None:
                        x = x + _bias_tile(bias, q0, q1, k0, k1)
                    if run.masked and p.mask is not None:
                        x = x.masked_fill_(~_allowed_tile(p, q0, q1, k0, k1), -math.inf)
                    pr = x.sub_(lb).exp_()                        # (B, H_q, bq, L) probabilities
                    p2 = pr.view(B * hkv, g * bq, L)
                    dv[:, k0:k1].baddbmm_(p2.transpose(1, 2), dob)
                    dp = torch.bmm(dob, v[:, k0:k1].transpose(1, 2)).view(B, hq, bq, L)
                    ds = dp.sub_(db).mul_(pr)
                    if y is not None and xr is not None:
                        (ds,) = torch.autograd.grad(y, xr, ds)
                    if t is not None:
                        ds.mul_(t.mul_(t).neg_().add_(1.0))       # × (1 − tanh²)
                    ds2 = ds.view(B * hkv, g * bq, L)
                    dqb.baddbmm_(ds2, k[:, k0:k1])
                    dk[:, k0:k1].baddbmm_(ds2.transpose(1, 2), qb)
            dq[:, :, :, q0:q1] = dqb.view(B, hkv, g, bq, p.d_k)
        return dq, dk, dv, None


# ---------------------------------------------------------------------------- the backend
def _fusable(p: Problem) -> bool:
    return (p.softcap is None and p.score_mod is None and p.dropout_p == 0.0
            and not (p.bias is not None and p.bias.requires_grad and torch.is_grad_enabled()))


class TiledBackend(Backend):
    """CPU: block-sparse online softmax with forward + backward and O(N) memory."""

    name = "tiled"
    description = ("CPU block-sparse online softmax (torch's fused flash kernel per run, "
                   "batched matmuls for softcap/score_mod/dropout); O(N) memory; autograd")

    def not_supported_reasons(self, p: Problem) -> list[str]:
        if p.device.type != "cpu":
            return [f"runs on CPU only (inputs are on {p.device}); use backend='triton' on GPU"]
        return []

    def forward(self, p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
        if _fusable(p):
            return _fused_attention(p)
        return _general_attention(p)


register(TiledBackend())
