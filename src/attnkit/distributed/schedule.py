"""The ring's schedule: which block of a K/V shard each rank computes, and on which hops.

A global *band* ``(lo, hi)`` says which (query, key) pairs of the whole sequence may attend:
allowed ⇔ ``lo <= q_pos − k_pos <= hi`` (global positions). ``is_causal`` is ``(0, ∞)``, a
sliding window of ``w`` keys ``(0, w − 1)``, no mask ``(−∞, ∞)``. Each shard is a list of
*chunks* (global ``[start, end)`` ranges, :func:`attnkit.distributed.layout._chunk_ranges`);
restricted to one chunk pair the band is again a band in the pair's local indices, so every
block the ring computes is one attention call with a local band (or none: full), and a
block the band does not touch is skipped — no compute and, when no rank needs that hop, no
exchange either. Shape legend: rows / keys index the sequence dim of a rank's q / k shard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Band = tuple[float, float]          # allowed ⇔ lo <= q_idx − k_idx <= hi
FULL: Band = (-math.inf, math.inf)
CAUSAL: Band = (0.0, math.inf)


@dataclass(frozen=True)
class Block:
    """One attention call: this rank's query ``rows`` over the source shard's ``keys``, with
    ``band`` in the block's own indices (row 0 = ``rows.start``, key 0 = ``keys.start``)."""

    rows: slice
    keys: slice
    band: Band


def _classify(band: Band, x_min: float, x_max: float) -> Band | None:
    """A band restricted to a rectangle whose ``q_idx − k_idx`` spans ``[x_min, x_max]``:
    None when it allows nothing there, FULL when it allows everything, else the band."""
    lo, hi = band
    if x_max < lo or x_min > hi or x_max < x_min:
        return None
    if x_min >= lo and x_max <= hi:
        return FULL
    return band


@dataclass(frozen=True)
class _Pair:
    """One query chunk × one key chunk: local offsets/lengths in the shards, and ``d`` = the
    global ``q_pos − k_pos`` of the pair's local index 0 − 0 (row ``oq``, key ``ok``)."""

    oq: int
    nq: int
    ok: int
    nk: int
    d: float

    def allowed(self, band: Band, r0: int, k0: int) -> tuple[float, float] | None:
        """The interval of ``i − j`` (block indices; block starts at row r0, key k0) that
        ``band`` allows inside this pair, or None (nothing)."""
        shift = (self.oq - r0) - (self.ok - k0)            # i − j at the pair's corner
        x_min, x_max = shift - (self.nk - 1), shift + self.nq - 1
        lo, hi = band[0] - self.d - (r0 - k0), band[1] - self.d - (r0 - k0)
        a, b = max(lo, x_min), min(hi, x_max)
        return (a, b) if a <= b and self.nq and self.nk else None

    def span(self, r0: int, k0: int) -> tuple[float, float]:
        shift = (self.oq - r0) - (self.ok - k0)
        return shift - (self.nk - 1), shift + self.nq - 1


def _one_band(pairs: list[_Pair], band: Band, r0: int, k0: int) -> Band | None:
    """The single local band that equals the global ``band`` on every pair of a block
    starting at (r0, k0), or None when no single band does."""
    lo_exact, hi_exact = set(), set()
    for p in pairs:
        got = p.allowed(band, r0, k0)
        if got is None:
            continue
        x_min, x_max = p.span(r0, k0)
        if got[0] > x_min:
            lo_exact.add(got[0])
        if got[1] < x_max:
            hi_exact.add(got[1])
    if len(lo_exact) > 1 or len(hi_exact) > 1:
        return None
    cand = (lo_exact.pop() if lo_exact else -math.inf, hi_exact.pop() if hi_exact else math.inf)
    for p in pairs:     # verify: the same allowed interval on every pair, empty ones included
        x_min, x_max = p.span(r0, k0)
        mine = (max(cand[0], x_min), min(cand[1], x_max))
        mine_ok = mine if mine[0] <= mine[1] and p.nq and p.nk else None
        if mine_ok != p.allowed(band, r0, k0):
            return None
    return cand


def plan_blocks(q_chunks: list[tuple[int, int]], k_chunks: list[tuple[int, int]],
                band: Band) -> list[Block]:
    """The calls for a query shard over a key shard (each a list of global chunk ranges in
    shard order) under the global ``band``: as few as one band per call allows — the whole
    shard pair when possible, else one call per query chunk, else per chunk pair."""
    oq = [0]
    for a, b in q_chunks:
        oq.append(oq[-1] + b - a)
    ok = [0]
    for a, b in k_chunks:
        ok.append(ok[-1] + b - a)
    grid = [[_Pair(oq[i], qb - qa, ok[j], kb - ka, float((qa - oq[i]) - (ka - ok[j])))
             for j, (ka, kb) in enumerate(k_chunks)] for i, (qa, qb) in enumerate(q_chunks)]
    live = [[p.allowed(band, p.oq, p.ok) is not None for p in row] for row in grid]
    rows_live = [i for i, row in enumerate(live) if any(row)]
    keys_live = [j for j in range(len(k_chunks)) if any(row[j] for row in live)]
    if not rows_live:
        return []

    def block(ri: list[int], kj: list[int]) -> Block | None:
        if ri != list(range(ri[0], ri[-1] + 1)) or kj != list(range(kj[0], kj[-1] + 1)):
            return None                                   # not one contiguous slice
        r0, k0 = oq[ri[0]], ok[kj[0]]
        got = _one_band([grid[i][j] for i in ri for j in kj], band, r0, k0)
        if got is None:
            return None
        nq, nk = oq[ri[-1] + 1] - r0, ok[kj[-1] + 1] - k0
        local = _classify(got, -(nk - 1), nq - 1)
        return None if local is None else Block(slice(r0, r0 + nq), slice(k0, k0 + nk), local)

    whole = block(rows_live, keys_live)
    if whole is not None:
        return [whole]
    out: list[Block] = []
    for i in rows_live:
        kj = [j for j in keys_live if live[i][j]]
        b = block([i], kj)
        if b is not None:
            out.append(b)
            continue
        out += [x for j in kj if (x := block([i], [j])) is not None]
    return out


def pieces(blk: Block, max_rows: int, max_keys: int) -> list[Block]:
    """``blk`` cut into sub-blocks of at most ``max_rows`` × ``max_keys`` (each with its
    band shifted to its own corner; sub-blocks the band does not touch are dropped), so that
    a sub-block's gradients are small buffers."""
    r0, r1 = blk.rows.start, blk.rows.stop
    k0, k1 = blk.keys.start, blk.keys.stop
    if r1 - r0 <= max_rows and k1 - k0 <= max_keys:
        return [blk]
    out = []
    for a in range(r0, r1, max_rows):
        na = min(max_rows, r1 - a)
        for b in range(k0, k1, max_keys):
            nb = min(max_keys, k1 - b)
            shift = (a - r0) - (b - k0)            # the piece's corner in block indices
            band = _classify(blk.band, shift - (nb - 1), shift + na - 1)
            if band is None:
                continue
            local = FULL if band == FULL else (band[0] - shift, band[1] - shift)
            out.append(Block(slice(a, a + na), slice(b, b + nb), local))
    return out
