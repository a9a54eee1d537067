"""A compiled score_mod's generated loop called on one row of keys, and torch's own
evaluation of the same row: shared by test_native_score_mod_ops.py and
test_native_score_mod_build.py."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

#: The generated loop's C signature: (scores, d/d score, n, b, h, q, k0, captures, scale).
ROW_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * 5,
                          ctypes.c_void_p, ctypes.c_double)


def call_row(address: int, caps_address: int, y: torch.Tensor, dy: torch.Tensor, b: int,
             h: int, q: int, k0: int, scale: float = 1.0) -> None:
    """The loop at ``address`` on row ``y`` (in place, its scores times ``scale`` first) of
    keys k0 .. k0 + len(y) - 1, d / d score into ``dy``."""
    ROW_FN(address)(y.data_ptr(), dy.data_ptr(), len(y), b, h, q, k0, caps_address, scale)


def torch_row(fn: Callable, x: torch.Tensor, b: int, h: int, q: int, k0: int,
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """torch on the whole row (int64 index tensors): the values and d / d score."""
    n = len(x)
    x = x.clone().requires_grad_(True)
    idx = [torch.full((n,), i, dtype=torch.int64) for i in (b, h, q)]
    y = fn(x, *idx, torch.arange(k0, k0 + n, dtype=torch.int64))
    g, = torch.autograd.grad(y.sum(), x)
    return y.detach(), g
