"""One forward check of the native kernel against the float64 oracle, shared by
test_native.py (every dtype) and test_native_lowp.py (the low-precision GEMM path)."""

from __future__ import annotations

import math

import torch

from attnkit.backends import native
from helpers.oracle import naive_low_precision, oracle
from helpers.tolerance import assert_low_precision_close


def check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype = torch.float32,
          *, allowed: torch.Tensor | None = None, oracle_opts: dict | None = None,
          kv: tuple[torch.Tensor, torch.Tensor] | None = None,
          **native_opts: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Run native.forward in ``dtype`` (on K/V ``kv`` when given: the same keys, with NaN
    where ``allowed`` masks them); assert out within DESIGN's budget, rows without keys 0 with
    LSE -inf, and the LSE (float32 for half inputs) close to the oracle's."""
    oo = oracle_opts or {}
    ref, lse_ref, _ = oracle(q, k, v, allowed=allowed, **oo)
    lowp = naive_low_precision(q.to(dtype), k.to(dtype), v.to(dtype), allowed=allowed, **oo)
    kk, vv = kv if kv is not None else (k, v)
    with torch.no_grad():
        out, lse = native.forward(q.to(dtype), kk.to(dtype), vv.to(dtype), **native_opts)
    assert out.dtype == dtype and out.shape == ref.shape and lse.shape == lse_ref.shape
    if dtype in (torch.bfloat16, torch.float16):
        assert lse.dtype == torch.float32, lse.dtype
    assert_low_precision_close(out, lowp, ref)
    empty = lse_ref == -math.inf
    assert torch.equal(lse == -math.inf, empty), "rows without keys must have LSE -inf"
    assert (out[empty] == 0).all(), "rows without keys must give 0"
    tol = 64 * torch.finfo(dtype).eps * (1 + lse_ref[~empty].abs())
    assert ((lse.double()[~empty] - lse_ref[~empty]).abs() <= tol).all()
    return out, lse


def hardware_lowp_gemm(dtype: torch.dtype) -> bool:
    """Whether this CPU runs ``dtype``'s GEMMs through brgemm (native.low_precision_paths,
    unforced by ``ATTNKIT_NATIVE_LOWP_GEMM``)."""
    name = str(dtype).split(".")[1]
    return native.low_precision_paths()[name].startswith(name + " GEMMs (oneDNN")
