"""Shape arithmetic on plain tuples, for the per-call paths.

``torch.broadcast_shapes`` costs ~100 µs a call and, on its first call in a process, imports
``torch.fx.experimental.symbolic_shapes`` and with it sympy (about a second on a 2-core
machine): a user's first masked or score_mod call paid for it.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["broadcast_shapes"]


def broadcast_shapes(*shapes: Sequence[int]) -> tuple[int, ...]:
    """The shape ``shapes`` broadcast to, by torch's rules (sizes aligned from the right; a
    size 1 stretches, a size 0 wins over 1); ``RuntimeError`` when they do not broadcast."""
    n = max((len(s) for s in shapes), default=0)
    out = [1] * n
    for s in shapes:
        for i, d in enumerate(s, n - len(s)):
            if d == 1:
                continue
            if out[i] != 1 and out[i] != d:
                raise RuntimeError(
                    f"shapes {', '.join(str(tuple(x)) for x in shapes)} do not broadcast "
                    f"(dim {i - n}: {out[i]} vs {d})")
            out[i] = d
    return tuple(out)
