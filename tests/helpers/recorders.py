"""One recorder of what aten ops produce, for tests that assert on memory or on dispatch.

``with OpOutputs(big=n, keep=pred) as rec: ...`` then

- ``rec.seen``     the names of the aten ops that ran;
- ``rec.largest``  the most elements of any tensor output ``keep`` accepts;
- ``rec.hits``     ``"op -> shape"`` for each such output owning at least ``big`` elements
  of storage (a view of a larger buffer counts as that buffer).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class OpOutputs(TorchDispatchMode):
    def __init__(self, big: int | None = None,
                 keep: Callable[[torch.Tensor], bool] = lambda t: True) -> None:
        super().__init__()
        self.big, self.keep = big, keep
        self.seen: set[str] = set()
        self.largest = 0
        self.hits: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        self.seen.add(str(func))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor) or not self.keep(t):
                continue
            self.largest = max(self.largest, t.numel())
            if self.big is not None and t.untyped_storage().nbytes() >= self.big * t.element_size():
                self.hits.append(f"{func} -> {tuple(t.shape)}")
        return out


def floating(t: torch.Tensor) -> bool:
    """``keep`` for K/V-sized float buffers (bool masks and block maps are not K/V)."""
    return t.is_floating_point()
