"""The native kernel's gradient to an additive bias (a float mask that requires grad).

The backward writes dS — the gradient of the score after soft-cap and score_mod — once per
(b, h, q, k) into a (B, H_q, N_q, N_k) buffer, summed to the bias's own (broadcast) shape.
Oracle: the float64 reference's autograd. ``tiled.counting()`` proves the kernel ran
(``native`` counts its calls, ``runs`` the Python engine's).

Shape legend: q (B, H_q, N_q, D), k, v (B, H_kv, N_k, D); bias broadcastable to
(B, H_q, N_q, N_k).
"""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from attnkit.backends import native, tiled

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernel unavailable: "
                                                               f"{native.why_unavailable()}")
F64 = torch.float64
TOL = {"atol": 1e-12, "rtol": 1e-10}
B, HQ = 2, 4


def _grads(out: torch.Tensor, leaves: list[torch.Tensor], g: torch.Tensor,
           ) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad((out * g).sum(), leaves, retain_graph=True)


def _check(hkv: int, nq: int, nk: int, bias_shape: tuple[int, ...], dtype: torch.dtype = F64,
           **opts: object) -> None:
    gen = torch.Generator().manual_seed(nq * 7 + nk)
    q = torch.randn(B, HQ, nq, 24, generator=gen, dtype=dtype, requires_grad=True)
    k = torch.randn(B, hkv, nk, 24, generator=gen, dtype=dtype, requires_grad=True)
    v = torch.randn(B, hkv, nk, 20, generator=gen, dtype=dtype, requires_grad=True)
    bias = torch.randn(*bias_shape, generator=gen, dtype=dtype).requires_grad_(True)
    with tiled.counting() as n:
        out = ak.attention(q, k, v, mask=bias, backend="tiled", **opts)
    assert n["native"] == 1 and n["runs"] == 0                       # the kernel ran
    ref = ak.attention(*(t.double() for t in (q, k, v)), mask=bias.double(),
                       backend="reference", **opts)
    g = torch.randn(out.shape, generator=gen, dtype=F64)
    got = _grads(out, [q, k, v, bias], g.to(dtype))
    want = _grads(ref, [q, k, v, bias], g)
    tol = TOL if dtype == F64 else {"atol": 2e-5, "rtol": 2e-5}
    for a, w in zip(got, want, strict=True):
        assert a.shape == w.shape and a.dtype == dtype
        torch.testing.assert_close(a.double(), w.double(), **tol)


@pytest.mark.parametrize("bias_shape", [(37, 150), (B, 1, 37, 150), (1, HQ, 37, 150),
                                        (B, HQ, 37, 150), (150,)])
def test_bias_gradient_sums_to_its_broadcast_shape(bias_shape: tuple[int, ...]) -> None:
    _check(2, 37, 150, bias_shape, softcap=6.0)                     # GQA, N_q != N_k


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_bias_gradient_under_blocked_positions(dtype: torch.dtype) -> None:
    # a float mask: the bias, −∞ where causal + padding block (whole tiles empty, a fully
    # masked row, padded keys); blocked positions get no gradient
    _check(1, 130, 200, (B, HQ, 130, 200), dtype)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, HQ, 150, 16, generator=gen, dtype=dtype, requires_grad=True)
               for _ in range(3))
    bias = torch.randn(150, 150, generator=gen, dtype=dtype, requires_grad=True)
    allowed = (ak.masks.causal() & ak.masks.padding([150, 41])).to_dense(150, 150, batch=B)
    allowed = allowed.expand(B, HQ, 150, 150).clone()
    allowed[0, 1, 7] = False                                        # a fully masked row
    fm = bias.masked_fill(~allowed, -math.inf)                      # (B, H_q, N_q, N_k)
    with tiled.counting() as n:
        out = ak.attention(q, k, v, mask=fm, backend="tiled", softcap=4.0)
    assert n["native"] == 1 and n["runs"] == 0
    ref = ak.attention(*(t.double() for t in (q, k, v)), mask=fm.double(), backend="reference",
                       softcap=4.0)
    g = torch.randn(out.shape, generator=gen, dtype=F64)
    got = _grads(out, [q, k, v, bias], g.to(dtype))
    want = _grads(ref, [q, k, v, bias], g)
    tol = TOL if dtype == F64 else {"atol": 2e-5, "rtol": 2e-5}
    for a, w in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), w.double(), **tol)
    assert got[3][~allowed.any(0).any(0)].abs().max() == 0          # never allowed: zero


def test_bias_gradcheck_on_the_kernel() -> None:
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(1, 2, 9, 8, generator=gen, dtype=F64, requires_grad=True)
    k = torch.randn(1, 1, 11, 8, generator=gen, dtype=F64, requires_grad=True)
    v = torch.randn(1, 1, 11, 6, generator=gen, dtype=F64, requires_grad=True)
    bias = torch.randn(2, 9, 11, generator=gen, dtype=F64, requires_grad=True)

    def f(q, k, v, bias):  # noqa: ANN001, ANN202
        out, lse = native.forward(q, k, v, bias=bias, softcap=3.0, band=(-2, 5))
        assert out.grad_fn is not None and "Native" in type(out.grad_fn).__name__
        return out, lse.masked_fill(torch.isinf(lse), 0.0)

    assert torch.autograd.gradcheck(f, (q, k, v, bias))


def test_bias_gradient_beside_a_relative_bias_table() -> None:
    # the backward's table path (dX kept per key for the buckets) gives d bias too
    gen = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(1, HQ, 97, 16, generator=gen, dtype=F64, requires_grad=True)
               for _ in range(3))
    table = torch.randn(HQ, 17, generator=gen, dtype=F64, requires_grad=True)
    bias = torch.randn(97, 97, generator=gen, dtype=F64, requires_grad=True)
    opts = dict(score_mod=ak.scores.relative_bias(table, 8), softcap=5.0, mask=bias)
    with tiled.counting() as n:
        out = ak.attention(q, k, v, backend="tiled", **opts)
    assert n["native"] == 1 and n["runs"] == 0
    ref = ak.attention(q, k, v, backend="reference", **opts)
    g = torch.randn(out.shape, generator=gen, dtype=F64)
    for a, w in zip(_grads(out, [q, k, v, table, bias], g), _grads(ref, [q, k, v, table, bias], g),
                    strict=True):
        torch.testing.assert_close(a, w, **TOL)
