"""The ring's schedule (no processes): the blocks of every rank over every shard, and their
backward pieces, cover exactly the (query, key) pairs the global band allows — each once.

Shape legend: a rank's shard holds N_q query and N_k key positions (global positions from
the layout's chunks); a block is (query rows, key rows, a band in its own indices).
"""

from __future__ import annotations

import math

import pytest
import torch

from attnkit.distributed.layout import _chunk_ranges
from attnkit.distributed.schedule import CAUSAL, FULL, Band, pieces, plan_blocks

BANDS: list[Band] = [FULL, CAUSAL, (0, 2), (-1, 1), (0, 4), (-3, 0), (2, 5), (-math.inf, -1)]


def _positions(chunks: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([torch.arange(a, b) for a, b in chunks])


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_blocks_cover_the_band_exactly_once(layout: str, world: int) -> None:
    for n_q, n_k in ((4, 4), (2, 6), (6, 2)):
        for band in BANDS:
            for r in range(world):
                for src in range(world):
                    qc = _chunk_ranges(world * n_q, r, world, layout, "test")
                    kc = _chunk_ranges(world * n_k, src, world, layout, "test")
                    d = _positions(qc)[:, None] - _positions(kc)[None, :]   # (N_q, N_k)
                    want = (d >= band[0]) & (d <= band[1])
                    for max_rows, max_keys in ((100, 100), (3, 2)):
                        cover = torch.zeros(want.shape, dtype=torch.int64)
                        for blk in plan_blocks(qc, kc, band):
                            for sub in pieces(blk, max_rows, max_keys):
                                i = torch.arange(sub.rows.stop - sub.rows.start)[:, None]
                                j = torch.arange(sub.keys.stop - sub.keys.start)[None, :]
                                ok = ((i - j) >= sub.band[0]) & ((i - j) <= sub.band[1])
                                cover[sub.rows, sub.keys] += ok.long()
                        assert torch.equal(cover, want.long()), (n_q, n_k, band, r, src,
                                                                 max_rows, max_keys)


def test_zigzag_causal_is_one_call_per_shard_pair() -> None:
    """The balanced causal plan: the diagonal is one causal call, every other shard one
    full call of half the shard (the same work on every hop)."""
    c = 3
    for r in range(2):
        for src in range(2):
            qc = _chunk_ranges(4 * c, r, 2, "zigzag", "test")
            kc = _chunk_ranges(4 * c, src, 2, "zigzag", "test")
            blocks = plan_blocks(qc, kc, CAUSAL)
            assert len(blocks) == 1, blocks
            (b,) = blocks
            n = (b.rows.stop - b.rows.start) * (b.keys.stop - b.keys.start)
            assert b.band == (CAUSAL if r == src else FULL) and (
                n == (2 * c) ** 2 if r == src else n == 2 * c * c), b


def test_window_within_a_shard_skips_far_shards() -> None:
    """Contiguous shards of 8, a causal window of 4: a rank needs its own shard and its left
    neighbour's, nothing else."""
    for r in range(4):
        for src in range(4):
            blocks = plan_blocks(_chunk_ranges(32, r, 4, "contiguous", "test"),
                                 _chunk_ranges(32, src, 4, "contiguous", "test"), (0, 3))
            assert bool(blocks) == (src in (r, r - 1)), (r, src, blocks)
