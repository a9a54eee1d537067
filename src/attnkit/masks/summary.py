"""Summaries of a :class:`~attnkit.masks.Mask` that stay small at any size: its sparsity (in
closed form for band, padding and document masks) and its drawing (exact when small, a
coarse grid of blocks when large, like FlexAttention's ``BlockMask.to_string``).

Only the public API of :mod:`attnkit.masks` is used here (specs and their readers,
``block_map``, ``block_counts``, ``evaluate``); :meth:`Mask.sparsity` and
:meth:`Mask.to_string` call in.

Shape legend::

    N_q queries, N_k keys; a block map is int8 (B', H', ⌈N_q/bq⌉, ⌈N_k/bk⌉) of
    EMPTY (0) / PARTIAL (1) / FULL (2), B' ∈ {1, B}, H' ∈ {1, H}
"""

from __future__ import annotations

import math

import torch

from .core import EMPTY, FULL, PARTIAL, Mask, band_of, block_sizes, documents_of, lengths_of

__all__ = ["sparsity", "allowed_pairs", "draw"]

_DRAWN = {FULL: "█", PARTIAL: "▒", EMPTY: "░"}


def allowed_pairs(m: Mask, n_q: int, n_k: int, batch: int, heads: int) -> int:
    """How many (b, h, query, key) quadruples ``m`` allows on an ``n_q × n_k`` call."""
    if n_q == 0 or n_k == 0:
        return 0
    m.check(n_q, n_k)
    closed = _closed_form(m, n_q, n_k, batch)
    if closed is not None:
        return closed * heads
    if m.summarised_by_rules:
        return _from_blocks(m, n_q, n_k, batch, heads)
    total = 0                                  # no rules: evaluate, a few rows at a time
    rows = max(1, 2**22 // n_k)
    for q0 in range(0, n_q, rows):
        d = m.evaluate(n_q, n_k, q_range=(q0, min(q0 + rows, n_q)), batch=batch, heads=heads)
        total += int(d.sum()) * (batch * heads * d.shape[2] * n_k // d.numel())
    return total


def sparsity(m: Mask, n_q: int, n_k: int, batch: int, heads: int) -> float:
    """Fraction of (query, key) pairs that ``m`` blocks, over ``batch`` × ``heads``."""
    if n_q == 0 or n_k == 0:
        return 0.0
    return 1.0 - allowed_pairs(m, n_q, n_k, batch, heads) / (batch * heads * n_q * n_k)


def _closed_form(m: Mask, n_q: int, n_k: int, batch: int) -> int | None:
    """Allowed (b, query, key) triples of a band, padding or document mask, counted from
    its spec in O(N + B), else None."""
    band = band_of(m, n_q, n_k)
    if band is not None:
        lo, hi = band                    # allowed ⇔ lo <= i − j <= hi
        i = torch.arange(n_q, dtype=torch.float64)
        first = (i - hi).clamp(min=0)                      # smallest allowed key
        last = (i - lo).clamp(max=n_k - 1)                 # largest allowed key
        return int((last - first + 1).clamp(min=0).sum()) * batch
    lengths = lengths_of(m)
    if lengths is not None:
        kv, ql = lengths
        rows = ql.clamp(max=n_q) if ql is not None else torch.full_like(kv, n_q)
        per_b = kv.clamp(max=n_k) * rows                   # (B|1,)
        return int(per_b.sum()) * (batch if per_b.numel() == 1 else 1)
    docs = documents_of(m, n_q, n_k)
    if docs is not None:
        qi, ki = docs                                      # (B|1, N_q), (B|1, N_k)
        nb = max(qi.shape[0], ki.shape[0])
        total = 0
        for b in range(nb):
            q_row, k_row = qi[min(b, qi.shape[0] - 1)], ki[min(b, ki.shape[0] - 1)]
            ids, inv = torch.unique(torch.cat([q_row, k_row]), return_inverse=True)
            cq = torch.bincount(inv[:n_q], minlength=ids.numel())
            ck = torch.bincount(inv[n_q:], minlength=ids.numel())
            total += int((cq * ck).sum())
        return total * (batch if nb == 1 else 1)
    return None


def _from_blocks(m: Mask, n_q: int, n_k: int, batch: int, heads: int) -> int:
    """FULL blocks count whole; PARTIAL blocks are evaluated (one block row at a time)."""
    block = max(32, math.ceil(max(n_q, n_k) / 1024))
    bm = m.block_map(n_q, n_k, block, block, batch=batch, heads=heads)  # (B', H', nbq, nbk)
    size = block_sizes(n_q, n_k, block, block)                           # (nbq, nbk)
    reps = (batch // bm.shape[0]) * (heads // bm.shape[1])
    total = int(((bm == FULL) * size).sum()) * reps
    part = bm == PARTIAL
    rows = part.flatten(0, 1).any(0)                                     # (nbq, nbk)
    cols = torch.arange(rows.shape[1])
    first = torch.where(rows, cols, rows.shape[1]).amin(1).tolist()
    last = torch.where(rows, cols, -1).amax(1).tolist()
    for i in rows.any(1).nonzero().flatten().tolist():
        j0, j1 = first[i], last[i] + 1
        c = m.block_counts(n_q, n_k, block, block, block_rows=(i, i + 1), block_cols=(j0, j1),
                           batch=batch, heads=heads)                     # (B'', H'', 1, span)
        p = part[:, :, i:i + 1, j0:j1]
        c, p = torch.broadcast_tensors(c, p)
        total += int((c * p).sum()) * (batch * heads // (c.shape[0] * c.shape[1]))
    return total


def draw(m: Mask, n_q: int | None, n_k: int | None, *, b: int = 0, h: int = 0,
         grid: int = 64) -> str:
    """The text drawing behind :meth:`Mask.to_string`."""
    nat_q, nat_k = m.natural_size
    n_q = n_q if n_q is not None else (nat_q or nat_k or 8)
    n_k = n_k if n_k is not None else (nat_k or n_q)
    if grid < 1:
        raise ValueError(f"grid must be >= 1 (cells per side), got {grid}")
    batch = m.batch_size or 1
    if m.batch_size is not None and m.batch_size > 1 and not 0 <= b < m.batch_size:
        raise ValueError(f"b={b} is outside the batch of {m.batch_size} that mask {m.name} "
                         f"was built for: give 0 <= b < {m.batch_size}")
    if m.heads_size is not None and m.heads_size > 1 and not 0 <= h < m.heads_size:
        raise ValueError(f"h={h} is outside the {m.heads_size} heads that mask {m.name} "
                         f"was built for: give 0 <= h < {m.heads_size}")
    if b < 0 or h < 0:
        raise ValueError(f"b and h must be >= 0, got b={b}, h={h}")
    heads = m.heads_size or 1
    where = []
    if m.depends_on_batch:
        where.append(f"batch element {b}" + (f" of {batch}" if batch > 1 else ""))
    if m.depends_on_heads:
        where.append(f"head {h}" + (f" of {heads}" if heads > 1 else ""))
    at = f", {', '.join(where)}" if where else ""
    big_b, big_h = max(batch, b + 1), max(heads, h + 1)
    if n_q <= grid and n_k <= grid:
        d = m.evaluate(n_q, n_k, batch=big_b, heads=big_h)
        d = d[min(b, d.shape[0] - 1), min(h, d.shape[1] - 1)].expand(n_q, n_k)
        lines = [f"{m.name}  ({n_q}×{n_k}{at}, █ = may attend, ░ = blocked)"]
        lines += ["".join("█" if x else "░" for x in row.tolist()) for row in d]
        return "\n".join(lines)
    bq, bk = math.ceil(n_q / grid), math.ceil(n_k / grid)
    bm = m.block_map(n_q, n_k, bq, bk, batch=big_b, heads=big_h, exact=True)
    cells = bm[min(b, bm.shape[0] - 1), min(h, bm.shape[1] - 1)]
    lines = [f"{m.name}  ({n_q}×{n_k}{at}, drawn as {cells.shape[0]}×{cells.shape[1]} "
             f"blocks of {bq}×{bk}: █ = every pair may attend, ▒ = some may, ░ = none may)"]
    lines += ["".join(_DRAWN[int(x)] for x in row.tolist()) for row in cells]
    return "\n".join(lines)
