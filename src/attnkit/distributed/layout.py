"""Sequence layouts: which global positions each rank holds (``contiguous`` or ``zigzag``),
and the helpers that cut a global tensor into a rank's shard, put the shards back together,
and give a shard's global positions (for RoPE)."""

from __future__ import annotations

import numbers
from typing import Any

import torch
import torch.distributed as dist

LAYOUTS = ("contiguous", "zigzag")   # how the global sequence is split over the ranks


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
