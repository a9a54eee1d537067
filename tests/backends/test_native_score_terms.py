"""The native kernel's fused score terms (scale → soft-cap) at the edges of their domain
(issue 19, item 3), against the float64 oracle by DESIGN's rule (outputs within 2×, gradients
3×, the naive error in the input dtype).

- A negative ``scale`` with ``softcap``: the kernel picks tanh's small-argument polynomial
  for a row when ``max |x · scale / c| < 0.625``; it once tested ``max|x| · scale / c``,
  negative for every score, so the polynomial ran far outside its range (float32 / bfloat16 /
  float16 off by ~4, q-gradients ~1e22). float64 uses the C library's tanh on both paths.
- ``scale / softcap`` beyond the compute type (1e20 / 1e-20 in float, 1e200 / 1e-200 in
  double — each allowed alone): a zero score became 0 · inf = NaN. The reference computes
  ``(x · scale) / c``, 0 for a zero score and ±inf → tanh ±1 otherwise; so must the kernel.

Prefill runs on ``tiled`` and decode (N_q = 1) on ``decode`` and ``tiled``, with the native
kernel only (``tiled.python_attention`` / ``decode._decode`` fail the test), so a case the
kernel declined could not pass on the Python engine instead. Gradients go through ``tiled``
(``decode`` is forward only).

Shape legend: q (B, H_q, N_q, D_k), k (B, H_kv, N_k, D_k), v (B, H_kv, N_k, D_v).
"""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from attnkit.backends import decode, native, tiled
from helpers.oracle import naive_low_precision, oracle
from helpers.tolerance import assert_low_precision_close, assert_low_precision_grad_close, max_err

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernel unavailable: "
                                f"{native.why_unavailable()}")

LOW = [torch.float32, torch.bfloat16, torch.float16]
# name: (B, H_q, H_kv, N_q, N_k, D); awkward sizes, GQA
SHAPES = {"prefill": (1, 4, 2, 97, 113, 64), "decode": (2, 4, 2, 1, 1025, 64)}
RUNS = [("prefill", "tiled"), ("decode", "tiled"), ("decode", "decode")]


@pytest.fixture(autouse=True)
def _native_only(monkeypatch: pytest.MonkeyPatch) -> None:
    def python_engine(p):  # noqa: ANN001, ANN202
        raise AssertionError("the native kernel declined this call: "
                             + "; ".join(tiled.native_reasons(p)))
    monkeypatch.setattr(tiled, "python_attention", python_engine)
    monkeypatch.setattr(decode, "_decode", python_engine)


def assert_close64(got: torch.Tensor, ref64: torch.Tensor, what: str) -> None:
    """float64 runs the kernel in double: float64 rounding, relative to the answer's size."""
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    err, mag = max_err(got, ref64), ref64.abs().max().item()
    assert err <= 1e-12 * mag + 1e-300, f"{what}: error {err:.3g} at magnitude {mag:.3g}"


def qkv(shape: str, zero_rows: bool = False) -> tuple[torch.Tensor, ...]:
    B, hq, hkv, nq, nk, d = SHAPES[shape]
    q = torch.randn(B, hq, nq, d, dtype=torch.float64)
    if zero_rows:                       # rows of zero scores (and a zero query everywhere)
        q[..., ::3, :] = 0.0
        q[0] = 0.0
    return (q, torch.randn(B, hkv, nk, d, dtype=torch.float64),
            torch.randn(B, hkv, nk, d, dtype=torch.float64))


def check_forward(shape: str, backend: str, dtype: torch.dtype, scale: float, softcap: float,
                  *, zero_rows: bool = False) -> None:
    q, k, v = qkv(shape, zero_rows)
    opts = dict(scale=scale, softcap=softcap)
    ref, _, _ = oracle(q, k, v, **opts)
    lowp = naive_low_precision(q.to(dtype), k.to(dtype), v.to(dtype), **opts)
    assert torch.isfinite(lowp).all()
    with torch.no_grad():
        got = ak.attention(q.to(dtype), k.to(dtype), v.to(dtype), backend=backend, **opts)
    assert got.dtype == dtype
    if dtype == torch.float64:
        assert_close64(got, ref, f"{backend} {shape} output")
    else:
        assert_low_precision_close(got, lowp, ref, what=f"{backend} {shape} output")


def _grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
           fn) -> list[torch.Tensor]:  # noqa: ANN001
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    (fn(qq, kk, vv).double() * dout).sum().backward()
    return [t.grad for t in (qq, kk, vv)]


def check_backward(shape: str, dtype: torch.dtype, scale: float, softcap: float,
                   *, zero_rows: bool = False) -> None:
    q, k, v = qkv(shape, zero_rows)
    opts = dict(scale=scale, softcap=softcap)
    dout = torch.randn(*q.shape[:3], v.shape[-1], dtype=torch.float64)
    g64 = _grads(q, k, v, dout, lambda a, b, c: oracle(a, b, c, **opts)[0])
    low = [t.to(dtype) for t in (q, k, v)]
    glow = _grads(*low, dout, lambda a, b, c: oracle(a, b, c, dtype=dtype, **opts)[0])
    got = _grads(*low, dout, lambda a, b, c: ak.attention(a, b, c, backend="tiled", **opts))
    for name, g, lo, hi in zip("qkv", got, glow, g64, strict=True):
        assert g.dtype == dtype
        if dtype == torch.float64:
            assert_close64(g, hi, f"d{name} ({shape})")
        else:
            assert_low_precision_grad_close(g, lo, hi, what=f"d{name} ({shape})")


# ---------------------------------------------------------------- a negative scale
NEGATIVE = [(-1.0, 1.0), (-0.5, 4.0)]


@pytest.mark.parametrize("scale,softcap", NEGATIVE)
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("shape,backend", RUNS)
def test_negative_scale_with_softcap_forward(shape: str, backend: str, dtype: torch.dtype,
                                             scale: float, softcap: float) -> None:
    check_forward(shape, backend, dtype, scale, softcap)


@pytest.mark.parametrize("scale,softcap", NEGATIVE)
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_negative_scale_with_softcap_backward(shape: str, dtype: torch.dtype, scale: float,
                                              softcap: float) -> None:
    check_backward(shape, dtype, scale, softcap)


# ---------------------------------------------------------------- scale / softcap overflows
# each value is in range for the compute type on its own (eager._check_in_range); the ratio
# is not: float for float32 / bfloat16 / float16 inputs, double for float64
HUGE = {torch.float32: (1e20, 1e-20), torch.bfloat16: (1e20, 1e-20),
        torch.float16: (1e20, 1e-20), torch.float64: (1e200, 1e-200)}


@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["positive", "negative"])
@pytest.mark.parametrize("dtype", [*LOW, torch.float64])
@pytest.mark.parametrize("shape,backend", RUNS)
def test_scale_over_softcap_beyond_the_compute_type_forward(shape: str, backend: str,
                                                            dtype: torch.dtype,
                                                            sign: float) -> None:
    """Every logit lies in ±softcap (~0): each row is the mean of V, rows of zero scores
    included (they were NaN)."""
    scale, softcap = HUGE[dtype]
    check_forward(shape, backend, dtype, sign * scale, softcap, zero_rows=True)


@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["positive", "negative"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_scale_over_softcap_beyond_the_compute_type_backward(shape: str, dtype: torch.dtype,
                                                             sign: float) -> None:
    """d capped / d score = scale · (1 − tanh²): ``scale`` on a zero score, 0 elsewhere
    (float16's naive reference overflows here, so it has no budget to compare with)."""
    scale, softcap = HUGE[dtype]
    check_backward(shape, dtype, sign * scale, softcap, zero_rows=True)


# ---------------------------------------------------------------- tanh over its whole range
def capped_logits(x: torch.Tensor, softcap: float) -> torch.Tensor:
    """The kernel's soft-capped logit of each score x (N,): one key per row (k = 1, scale = 1,
    D = 1), so each row's LSE is its one logit, c · tanh(x / c); every row is its own row pass
    (the polynomial or the e^x form, chosen per row)."""
    q = x.reshape(1, 1, -1, 1)
    k = torch.ones(1, 1, 1, 1, dtype=x.dtype)
    _, lse = native.forward(q, k, k.clone(), scale=1.0, softcap=softcap)
    return lse.reshape(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("softcap", [1e-3, 1.0, 30.0, 1e6])
def test_softcap_tanh_within_a_few_ulp_over_the_whole_range(dtype: torch.dtype,
                                                            softcap: float) -> None:
    """|x / c| from 1e-12 to 1e3 both signs (the polynomial below 0.625, 1 - 2 / (e^2x + 1)
    above it, 1 from ~9 on), and zeros: within 4 float32 ulp of float64's c · tanh(x / c)
    (float64: to rounding)."""
    mag = torch.logspace(-12, 3, 3001, dtype=torch.float64)
    edge = torch.tensor([0.625, 0.6249999, 0.6250001, 9.0, 8.9999, 9.0001], dtype=torch.float64)
    r = torch.cat([mag, -mag, edge, -edge, torch.zeros(2, dtype=torch.float64)])
    x = (r * softcap).to(dtype)
    got = capped_logits(x, softcap).double()
    ref = softcap * torch.tanh(x.double() / softcap)
    ulp = torch.finfo(torch.float32).eps / 2 if dtype == torch.float32 else 1e-15
    err = ((got - ref).abs() / ref.abs().clamp_min(torch.finfo(dtype).tiny)).max().item()
    assert err <= 4 * ulp, f"softcap={softcap}: relative error {err:.3g} ({err / ulp:.1f} ulp)"
    assert (got.abs() <= torch.tensor(softcap, dtype=dtype).item()).all()   # c in dtype


@pytest.mark.parametrize(("dtype", "n_q"), [(torch.float32, 1), (torch.float32, 20),
                                            (torch.bfloat16, 20)])
def test_softcap_form_follows_the_rows_largest_score_at_any_key(dtype: torch.dtype,
                                                                n_q: int) -> None:
    """A row's form (the polynomial alone, or the e^x form) follows its largest |x · scale /
    c| wherever that key lies in the tile (any lane of any vector, the row's padded tail):
    one score of 3 among scores of 0.1 (the polynomial alone is ~2 off at 3). The weights
    (V = the identity) match float64's softmax(c · tanh(x / c)) — bfloat16 (the GEMM loops'
    low-precision path) within DESIGN's budget."""
    n = 133                                                # two tiles: 128 + a 5-key tail
    q = torch.ones(1, 1, n_q, 1, dtype=torch.float64)
    v = torch.eye(n, dtype=torch.float64).reshape(1, 1, n, n)
    for p in range(n):
        k = torch.full((1, 1, n, 1), 0.1, dtype=torch.float64)
        k[0, 0, p, 0] = 3.0
        want = torch.softmax(torch.tanh(k.reshape(1, 1, 1, n)), dim=-1).expand(1, 1, n_q, n)
        got, _ = native.forward(q.to(dtype), k.to(dtype), v.to(dtype), scale=1.0, softcap=1.0)
        if dtype == torch.float32:
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6, msg=f"key {p}")
        else:
            ref_lowp = naive_low_precision(q.to(dtype), k.to(dtype), v.to(dtype), scale=1.0,
                                           softcap=1.0)
            assert_low_precision_close(got, ref_lowp, want, what=f"key {p}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_softcap_of_inf_and_nan_scores(dtype: torch.dtype) -> None:
    """An infinite score caps to ±c (not NaN); NaN stays NaN, in its own row only."""
    x = torch.tensor([math.inf, -math.inf, math.nan, 1.0, 3.0e38], dtype=dtype)
    got = capped_logits(x, 5.0)
    assert got[0].item() == 5.0 and got[1].item() == -5.0
    assert math.isnan(got[2].item())
    assert got[3].item() == pytest.approx(5.0 * math.tanh(0.2), rel=1e-6)
    assert got[4].item() == 5.0
