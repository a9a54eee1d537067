"""The reference (the oracle behind every backend and ``explain``) and the numerical contract:
max-subtracted softmax, float32 accumulation for half precision, empty rows, NaN handling."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from attnkit import masks
from attnkit.api import prepare
from attnkit.backends.base import compute_dtype
from attnkit.reference import reference, safe_softmax
from helpers.oracle import oracle, randn
from helpers.running import run_backend

TOL = {"rtol": 1e-12, "atol": 1e-12}


def test_intermediates_follow_the_formula():
    q, k, v = randn(2, 4, 5, 8), randn(2, 2, 6, 8), randn(2, 2, 6, 3)
    bias = randn(5, 6)
    allowed = torch.rand(5, 6) > 0.3
    allowed[2] = False
    p = prepare(q, k, v, mask=bias.masked_fill(~allowed, -torch.inf), scale=0.3).problem
    r = reference(p)
    k_r, v_r = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    torch.testing.assert_close(r.scores, q @ k_r.transpose(-1, -2), **TOL)
    torch.testing.assert_close(r.scaled, r.scores * 0.3 + bias.masked_fill(~allowed, 0), **TOL)
    assert torch.equal(r.allowed.expand(2, 4, 5, 6), allowed.expand(2, 4, 5, 6))
    torch.testing.assert_close(r.logits, r.scaled.masked_fill(~allowed, -torch.inf), **TOL)
    assert torch.isneginf(r.logits[..., 2, :]).all()
    sums = r.weights.sum(-1)
    torch.testing.assert_close(sums[..., [0, 1, 3, 4]], torch.ones(2, 4, 4, dtype=torch.float64),
                               **TOL)
    assert (r.weights[..., 2, :] == 0).all() and (r.weights[..., ~allowed] == 0).all()
    torch.testing.assert_close(r.output, r.weights @ v_r, **TOL)
    torch.testing.assert_close(r.lse, torch.logsumexp(r.logits, -1), **TOL)
    assert r.output.shape == (2, 4, 5, 3) and r.lse.shape == (2, 4, 5)


def test_order_scale_softcap_score_mod_bias_mask():
    """S·scale → softcap → score_mod → + bias → mask: score_mod sees capped logits."""
    q, k, v = randn(1, 1, 4, 4) * 4, randn(1, 1, 5, 4), randn(1, 1, 5, 2)
    bias = randn(4, 5)
    seen = {}

    def mod(s, b, h, qi, ki):  # noqa: ANN001, ANN202
        seen["x"] = s.detach().clone()
        return 2 * s

    p = prepare(q, k, v, softcap=1.5, score_mod=mod, mask=bias, scale=0.7).problem
    r = reference(p)
    capped = 1.5 * torch.tanh((q @ k.transpose(-1, -2)) * 0.7 / 1.5)
    torch.testing.assert_close(seen["x"], capped, **TOL)
    torch.testing.assert_close(r.scaled, 2 * capped + bias, **TOL)


def test_reference_accumulates_half_precision_in_float32():
    assert compute_dtype(torch.float16) == torch.float32
    assert compute_dtype(torch.bfloat16) == torch.float32
    assert compute_dtype(torch.float64) == torch.float64
    q, k, v = (randn(1, 1, 3, 4).half() for _ in range(3))
    r = reference(prepare(q, k, v).problem)
    assert r.scores.dtype == torch.float32 and r.weights.dtype == torch.float32
    out, lse = ak.attention(q, k, v, backend="reference", return_lse=True)
    assert out.dtype == torch.float16 and lse.dtype == torch.float32


# ============================================================================ safe_softmax
def test_safe_softmax_rows():
    x = torch.tensor([[0.0, 1.0, 2.0], [-torch.inf] * 3, [5.0, -torch.inf, -torch.inf],
                      [1e4, -1e4, 1e4 - 1]], dtype=torch.float64, requires_grad=True)
    w, lse = safe_softmax(x)
    torch.testing.assert_close(w[0], torch.softmax(x[0], -1), **TOL)
    assert (w[1] == 0).all() and torch.isneginf(lse[1])
    assert w[2].tolist() == [1.0, 0.0, 0.0] and lse[2].item() == 5.0
    e = 1 / (1 + math.exp(-1))
    torch.testing.assert_close(w[3], torch.tensor([e, 0.0, 1 - e], dtype=torch.float64),
                               **TOL)
    torch.testing.assert_close(lse[3], torch.tensor(1e4 + math.log1p(math.exp(-1)),
                                                    dtype=torch.float64), **TOL)
    (w * torch.arange(3.0)).sum().backward()
    assert torch.isfinite(x.grad).all() and (x.grad[1] == 0).all()


# ============================================================================ numerical contract
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_huge_logits_stay_finite(backend, dtype):
    """Max-subtracted softmax: logits around ±1e4 (exp would overflow) stay exact."""
    q, k, v = randn(1, 2, 6, 4), randn(1, 2, 7, 4), randn(1, 2, 7, 3)
    q = q * 1e4 / q.abs().amax()
    k = k / k.abs().amax() * 4
    out, lse = run_backend(backend, q.to(dtype), k.to(dtype), v.to(dtype), scale=1.0,
                           return_lse=True)
    ref, ref_lse, _ = oracle(q.to(dtype), k.to(dtype), v.to(dtype), scale=1.0)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    tol = TOL if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-4}
    torch.testing.assert_close(out.double(), ref, **tol)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_accumulates_in_float32(backend, dtype):
    """Scores q·k ≈ 78 400 overflow float16 (max 65 504); float32 accumulation keeps them."""
    d = 16
    q = torch.full((1, 1, 2, d), 70.0)
    k = torch.full((1, 1, 3, d), 70.0)
    k[0, 0, 1] = 69.0
    k[0, 0, 2] = -70.0
    v = torch.tensor([[1.0, 0.0], [0.0, 1.0], [5.0, 5.0]]).view(1, 1, 3, 2)
    scale = 1e-4                                          # logits ≈ [7.84, 7.73, -7.84]
    q, k, v = (t.to(dtype) for t in (q, k, v))
    naive = (q @ k.transpose(-1, -2))                     # done in half precision
    if dtype == torch.float16:
        assert torch.isinf(naive).any()                   # the trap is real
    out, lse = run_backend(backend, q, k, v, scale=scale, return_lse=True)
    ref, ref_lse, _ = oracle(q, k, v, scale=scale)
    assert out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-2 if dtype == torch.bfloat16
                               else 2e-3)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_half_precision_sum_over_many_keys(backend):
    """Uniform weights over 2 049 keys: a float16 running sum would drift; float32 does not."""
    n = 2049
    q = torch.zeros(1, 1, 1, 8, dtype=torch.float16)
    k = torch.randn(1, 1, n, 8).half()
    v = torch.ones(1, 1, n, 1, dtype=torch.float16)
    out, lse = run_backend(backend, q, k, v, return_lse=True)
    assert out.item() == 1.0
    assert lse.item() == pytest.approx(math.log(n), rel=1e-6)


def test_row_with_no_allowed_key(backend):
    q, k, v = (t.requires_grad_() for t in (randn(1, 1, 3, 4), randn(1, 1, 5, 4),
                                             randn(1, 1, 5, 2)))
    m = masks.padding([5], q_lengths=[2])                 # query 2 sees nothing
    out, lse = run_backend(backend, q, k, v, mask=m, return_lse=True)
    assert (out[0, 0, 2] == 0).all() and torch.isneginf(lse[0, 0, 2])
    out.sum().backward()
    assert not any(torch.isnan(t.grad).any() for t in (q, k, v))
    assert (q.grad[0, 0, 2] == 0).all()


def test_float_mask_with_a_minus_inf_row(backend):
    q, k, v = randn(1, 2, 4, 4), randn(1, 2, 5, 4), randn(1, 2, 5, 3)
    m = randn(4, 5)
    m[1] = -torch.inf
    m[3, :4] = -torch.inf
    out, lse = run_backend(backend, q, k, v, mask=m, return_lse=True)
    assert (out[:, :, 1] == 0).all() and torch.isneginf(lse[:, :, 1]).all()
    torch.testing.assert_close(out[:, :, 3], v[:, :, 4], **TOL)   # one key left: weight 1
    ref, ref_lse, _ = oracle(q, k, v, allowed=torch.isfinite(m), bias=m.clamp(min=-1e300))
    torch.testing.assert_close(out, ref, **TOL)


def test_nan_in_padded_rows_with_gqa_and_leading_dims(backend):
    q, k, v = randn(2, 2, 4, 3, 8), randn(2, 2, 2, 6, 8), randn(2, 2, 2, 6, 5)
    lens = torch.tensor([6, 4, 3, 1])
    k2, v2 = k.clone(), v.clone()
    for b, n in enumerate(lens.tolist()):
        k2.view(4, 2, 6, 8)[b, :, n:] = torch.nan
        v2.view(4, 2, 6, 5)[b, :, n:] = torch.inf
    out = run_backend(backend, q, k2, v2, mask=masks.padding(lens))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ak.attention(q, k, v, mask=masks.padding(lens)), **TOL)


def test_nan_query_attending_is_documented():
    doc = ak.api.__doc__ or ""
    assert "NaN" in doc and "attend" in doc


def test_nan_query_rows_show_as_nan_and_padded_garbage_stays_out_of_the_gradients():
    q, k, v = randn(2, 2, 4, 8), randn(2, 2, 6, 8), randn(2, 2, 6, 3)
    q = q.clone()
    q[0, 1, 1, 2] = torch.nan                             # a used row: NaN output and LSE
    out, lse = ak.attention(q, k, v, backend="reference", return_lse=True)
    assert torch.isnan(out[0, 1, 1]).all() and torch.isnan(lse[0, 1, 1])  # NaN, not −∞
    assert torch.isfinite(lse[0, 0]).all()
    # padded query rows (no allowed key) holding NaN: output 0, LSE −∞, and no NaN anywhere
    # in the gradients (before: dK was NaN through 0 · NaN in the backward of Q Kᵀ)
    q = randn(2, 2, 4, 8)
    q[:, :, 3] = torch.nan
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    m = masks.padding([6, 6], q_lengths=[3, 3])
    out, lse = ak.attention(q, k, v, mask=m, backend="reference", return_lse=True)
    assert (out[:, :, 3] == 0).all() and torch.isneginf(lse[:, :, 3]).all()
    dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    assert (dq[:, :, 3] == 0).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
    ref = ak.attention(q[:, :, :3], k, v, mask=masks.padding([6, 6]), backend="reference")
    torch.testing.assert_close(torch.autograd.grad(ref.sum(), k)[0], dk, **TOL)


def test_zero_heads_everywhere_is_an_empty_problem():
    """H_q = H_kv = 0 (allowed, as in torch SDPA): the reference and explain give empty results
    (``Problem.group`` divided by zero)."""
    import attnkit as ak

    q = torch.randn(1, 0, 3, 4, dtype=torch.float64)
    assert ak.attention(q, q, q, backend="reference").shape == (1, 0, 3, 4)
    tr = ak.explain(q, q, q)
    assert tr.output.shape == (1, 0, 3, 4)
    assert "(1, 0, 3, 3)" in tr.to_text()
