"""The tiled engines' tile sizes: one frozen record per context (thread, asyncio task).

Measured on a 2-core AVX2 machine (see BENCHMARKS.md); :func:`tile_sizes` changes them in
one context only (tiny tiles exercise the tile edges in tests).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

__all__ = ["TileSizes", "tile_sizes", "sizes"]


@dataclass(frozen=True)
class TileSizes:
    """Tunables (measured on a 2-core AVX2 machine, see BENCHMARKS.md): query rows per block,
    key granularity of the block map, the general engine's key chunk and query block."""

    block_q: int = 128
    block_k: int = 128
    chunk_k: int = 2048
    general_block_q: int = 256


_DEFAULT_SIZES = TileSizes()          # frozen: the context variable's default is immutable
# Per context (thread, asyncio task): ``tile_sizes`` in one thread never changes another's.
_SIZES: ContextVar[TileSizes] = ContextVar("attnkit_tiled_sizes", default=_DEFAULT_SIZES)
_FIELDS = tuple(f.name for f in dataclasses.fields(TileSizes))


def sizes() -> TileSizes:
    """The tile sizes in effect in this context."""
    return _SIZES.get()


@contextlib.contextmanager
def tile_sizes(**new: int) -> Iterator[None]:
    """Temporarily change tile sizes (``block_q``, ``block_k``, ``chunk_k``,
    ``general_block_q``) in this context only, e.g. tiny tiles to exercise tile edges."""
    unknown = set(new) - set(_FIELDS)
    if unknown:
        raise ValueError(f"unknown tile size(s) {sorted(unknown)}: choose from {sorted(_FIELDS)}")
    for k_, s in new.items():
        if not isinstance(s, int) or s < 1:
            raise ValueError(f"tile size {k_} must be a positive integer, got {s!r}")
    token = _SIZES.set(dataclasses.replace(_SIZES.get(), **new))
    try:
        yield
    finally:
        _SIZES.reset(token)
