"""The plan: the mask's block map (computed once per call) → query blocks and key runs.

A *tile* is ``block_q × block_k`` (queries × keys). :func:`tile_map` reduces the mask's
block map over (batch, head) to one status per tile — EMPTY (skipped), FULL (no mask work)
or PARTIAL (mask evaluated on that tile). :func:`plan` cuts each query block's row of tiles
into *runs*: maximal ranges of consecutive non-empty tiles of one kind, each computed by one
kernel call. The plan is data (:class:`Plan` → :class:`Block` → :class:`Run`); the engines
read it, they never recompute it.

Also here, because every engine needs them: the small tile helpers (the mask on a tile, the
bias on a tile, the grouped-rows layout, the causal-diagonal test). The tile sizes live in
:mod:`.sizes`, the counters in :mod:`.counters`, the native kernel's switch with the kernel
(:func:`attnkit.backends.native.use_native`).

Shape legend::

    tile status   int8 (⌈N_q/block_q⌉, ⌈N_k/block_k⌉)   EMPTY 0 / PARTIAL 1 / FULL 2
    allowed tile  bool (B|1, H_q|1, bq, L)               L = k1 - k0 keys of one run
    grouped rows  (B|1, H_kv|1, G·bq, …)                 G = H_q / H_kv query heads per K/V head
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from ... import masks as _masks
from ..base import Problem
from .counters import count
from .sizes import sizes

__all__ = ["Run", "Block", "TileMap", "Plan", "tile_map", "plan", "allowed_tile", "bias_tile",
           "backward_rows", "to_grouped", "band_is_tril", "tile_is_tril"]


# ---------------------------------------------------------------------------- plan types
@dataclass(frozen=True)
class Run:
    """Keys ``[k0, k1)`` of one query block, computed by one kernel call."""

    k0: int
    k1: int
    masked: bool          # evaluate the mask (some tile PARTIAL, or a bias is added)


@dataclass(frozen=True)
class Block:
    """Queries ``[q0, q1)`` and their runs (no runs: every key is masked, output 0)."""

    q0: int
    q1: int
    runs: tuple[Run, ...]

    @property
    def rows(self) -> int:
        return self.q1 - self.q0


@dataclass(frozen=True)
class TileMap:
    """The mask's block map reduced over (batch, head): EMPTY where empty everywhere, FULL
    where full everywhere, else PARTIAL. ``status`` is ``None`` without a mask (all FULL)."""

    block_q: int
    block_k: int
    status: np.ndarray | None         # int8 (⌈N_q/block_q⌉, ⌈N_k/block_k⌉)
    tiles: int
    empty: int
    full: int
    partial: int


@dataclass(frozen=True)
class Plan:
    """The schedule of one call: query blocks of ``block_q`` rows (the last may be shorter)
    and their runs; the tile counts come from the :class:`TileMap`."""

    block_q: int
    block_k: int
    blocks: tuple[Block, ...]
    tiles: int = 0
    empty: int = 0
    full: int = 0
    partial: int = 0


# ---------------------------------------------------------------------------- building
def tile_map(p: Problem, block_q: int, block_k: int) -> TileMap:
    """The mask's tile statuses at ``block_q × block_k`` — the one block map of a call."""
    nbq, nbk = math.ceil(p.n_q / block_q), math.ceil(p.n_k / block_k)
    if p.mask is None:
        return TileMap(block_q, block_k, None, nbq * nbk, 0, nbq * nbk, 0)
    count(block_maps=1)
    bm = p.mask.block_map(p.n_q, p.n_k, block_q, block_k, batch=p.batch, heads=p.heads_q,
                          device=torch.device("cpu"))
    empty = (bm == _masks.EMPTY).flatten(0, 1).all(0)
    full = (bm == _masks.FULL).flatten(0, 1).all(0)
    st = torch.where(full, _masks.FULL, torch.where(empty, _masks.EMPTY, _masks.PARTIAL))
    st = st.to(torch.int8).numpy()
    return TileMap(block_q, block_k, st, nbq * nbk, int((st == _masks.EMPTY).sum()),
                   int((st == _masks.FULL).sum()), int((st == _masks.PARTIAL).sum()))


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
         coarsen: bool = True, factor: int = 1, tiles: TileMap | None = None) -> Plan:
    """Cut ``p`` into query blocks and key runs from the mask's block map.

    A run is a maximal range of consecutive non-empty tiles of one kind: FULL tiles (no mask
    work) or PARTIAL tiles (mask evaluated on the run). A bias makes every run masked.
    With ``coarsen``, query blocks grow to 2× or 4× ``block_q`` rows (bigger, faster kernel
    calls) when that computes at most 25% more score pairs than the fine blocks.
    Without a mask or bias the whole call is one block and one run; plain top-left causal
    (no GQA, no bias) is one block and one diagonal run. ``factor`` > 1 merges exactly that
    many fine block rows (instead of ``coarsen``'s choice). ``tiles``: the call's
    :func:`tile_map` at ``block_q × block_k`` when the caller already has it.
    """
    sz = sizes()
    bq = block_q or (tiles.block_q if tiles is not None else sz.block_q)
    bk = block_k or (tiles.block_k if tiles is not None else sz.block_k)
    nbq, nbk = math.ceil(p.n_q / bq), math.ceil(p.n_k / bk)
    if (coarsen and p.mask is not None and p.group == 1 and p.bias is None
            and band_is_tril(p, 0, p.n_q, 0, p.n_k)):
        # plain causal: one call of the fused kernel's own causal schedule
        return Plan(p.n_q, bk, (Block(0, p.n_q, (Run(0, p.n_k, True),)),), tiles=nbq * nbk)
    if tiles is None:
        tiles = tile_map(p, bq, bk)
    assert (tiles.block_q, tiles.block_k) == (bq, bk), "tile map of another tile size"
    counts = dict(tiles=tiles.tiles, empty=tiles.empty, full=tiles.full, partial=tiles.partial)
    st = tiles.status
    has_bias = p.bias is not None
    if st is None:
        step = p.n_q if (not has_bias and coarsen) else bq
        blocks = tuple(Block(q0, min(q0 + step, p.n_q), (Run(0, p.n_k, has_bias),))
                       for q0 in range(0, p.n_q, step))
        return Plan(bq, bk, blocks, **counts)
    if factor > 1:
        st, bq = _coarsen(st, factor), factor * bq
    elif coarsen:
        base = _cost(st, bq, p.n_q, bk)
        for f in (4, 2):
            cst = _coarsen(st, f)
            if _cost(cst, f * bq, p.n_q, bk) <= 1.25 * base:
                st, bq = cst, f * bq
                break
    blocks = []
    for i in range(st.shape[0]):
        row = st[i]
        # run boundaries: where the tile kind changes
        cuts = np.flatnonzero(np.diff(row)) + 1
        starts = np.concatenate(([0], cuts))
        ends = np.concatenate((cuts, [nbk]))
        runs = tuple(Run(s * bk, min(e * bk, p.n_k), int(row[s]) == _masks.PARTIAL or has_bias)
                     for s, e in zip(starts.tolist(), ends.tolist(), strict=True)
                     if int(row[s]) != _masks.EMPTY)
        blocks.append(Block(i * bq, min((i + 1) * bq, p.n_q), runs))
    return Plan(bq, bk, tuple(blocks), **counts)


# ---------------------------------------------------------------------------- tiles
def backward_rows(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                  dlse: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-row terms of a FlashAttention-2 backward (the general and compiled engines):
    ``dcol = rowsum(dO∘O) − dlse`` (∂lse/∂logits = P; a row without keys takes no dlse) and
    the LSE to subtract, +∞ for such a row (so its P = e^(x − ∞) = 0), both (B, H_q, N_q, 1)."""
    dcol = (dout * out).sum(-1, keepdim=True)
    if dlse is not None:
        dcol = dcol - torch.where(torch.isfinite(lse), dlse, torch.zeros_like(dlse))[..., None]
    lse_b = torch.where(lse == -math.inf, torch.full_like(lse, math.inf), lse).unsqueeze(-1)
    return dcol, lse_b


def allowed_tile(p: Problem, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
    """The mask on queries ``[q0, q1)`` × keys ``[k0, k1)``: bool ``(B|1, H_q|1, bq, L)``."""
    assert p.mask is not None
    a = p.mask.evaluate(p.n_q, p.n_k, q_range=(q0, q1), k_range=(k0, k1), batch=p.batch,
                        heads=p.heads_q, device=p.device)
    return a.expand(a.shape[0], a.shape[1], q1 - q0, k1 - k0)


def bias_tile(bias: torch.Tensor, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
    """``bias (B|1, H_q|1, N_q|1, N_k|1)`` restricted to the tile (size-1 dims kept)."""
    t = bias if bias.shape[2] == 1 else bias[:, :, q0:q1]
    return t if t.shape[3] == 1 else t[:, :, :, k0:k1]


def to_grouped(t: torch.Tensor, g: int, heads_kv: int) -> torch.Tensor:
    """``(B|1, H_q|1, bq, …)`` → grouped rows ``(B|1, H_kv|1, G·bq, …)``."""
    if g == 1:
        return t
    b_, h_, bq = t.shape[:3]
    rest = tuple(t.shape[3:])
    if h_ == 1:                       # the same rows for every query head of a group
        return t.repeat(1, 1, g, *([1] * len(rest)))
    return t.reshape(b_, heads_kv, g * bq, *rest)


def band_is_tril(p: Problem, q0: int, q1: int, k0: int, k1: int) -> bool:
    """True when a band mask (causal, sliding window) is exactly top-left causal on this
    square tile — known from the lowered mask without evaluating it."""
    assert p.mask is not None
    band = p.lowered.mask.as_band()
    n = q1 - q0
    if band is None or n != k1 - k0:
        return False
    lo, hi = band
    c = q0 - k0                      # allowed iff lo <= c + (i - j) <= hi, i - j in ±(n-1)
    return c == lo and hi - c >= n - 1


def tile_is_tril(allowed: torch.Tensor) -> bool:
    """True when a square tile's mask is exactly the top-left causal pattern (all b, h)."""
    bq, L = allowed.shape[-2:]
    if bq != L:
        return False
    return bool((allowed == _tril(bq)).all())


@functools.lru_cache(maxsize=8)
def _tril(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril_()
