"""What the tiled calls did, counted per context (thread, asyncio task) inside
:func:`counting` — block maps built, tiles seen / skipped, kernel calls. Tests and
benchmarks read them; outside a ``counting`` block :func:`count` is a no-op (one context
variable read).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

__all__ = ["COUNTERS", "counting", "count"]

# What the calls did: block maps built, tiles seen / skipped, kernel calls. Tests read them.
# ``native``: calls (tiled or decode) that ran on the native kernel — they plan nothing, so
# the other counters stay 0 for them.
COUNTERS = ("block_maps", "tiles", "empty", "full", "partial", "runs", "causal_runs",
            "masked_runs", "windowed", "native")
_COUNTS: ContextVar[dict[str, int] | None] = ContextVar("attnkit_tiled_counts", default=None)


@contextlib.contextmanager
def counting() -> Iterator[dict[str, int]]:
    """Count what the tiled calls made inside the ``with`` block (this context only)::

        with tiled.counting() as n:
            attention(q, k, v, is_causal=True, backend="tiled")
        n["runs"], n["block_maps"]
    """
    counts = dict.fromkeys(COUNTERS, 0)
    token = _COUNTS.set(counts)
    try:
        yield counts
    finally:
        _COUNTS.reset(token)


def count(**n: int) -> None:
    """Add to the counters of the enclosing :func:`counting` block (no-op outside one)."""
    counts = _COUNTS.get()
    if counts is not None:
        for k_, v in n.items():
            counts[k_] += v
