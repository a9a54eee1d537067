"""``attnkit.scores``: soft-capping, ALiBi and a learned relative bias as score mods."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from attnkit.scores import alibi, alibi_slopes, relative_bias, soft_cap
from helpers.oracle import oracle, randn


def test_soft_cap_values_and_range():
    x = torch.tensor([-1e6, -3.0, 0.0, 0.5, 3.0, 1e6], dtype=torch.float64)
    y = soft_cap(x, 2.0)
    torch.testing.assert_close(y, 2.0 * torch.tanh(x / 2.0))
    assert (y.abs() <= 2.0).all() and y[2] == 0
    assert y[3].item() == pytest.approx(0.5, rel=0.03)     # ≈ identity near 0


@pytest.mark.parametrize("n,expected", [
    (1, [2 ** -8]),
    (2, [2 ** -4, 2 ** -8]),
    (8, [2 ** -(i + 1) for i in range(8)]),
    # not a power of two: the 4-head slopes, then every other 8-head slope
    (6, [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1, 2 ** -3]),
])
def test_alibi_slopes(n, expected):
    s = alibi_slopes(n)
    assert s.shape == (n,) and s.dtype == torch.float64
    torch.testing.assert_close(s, torch.tensor(expected, dtype=torch.float64))


def test_alibi_slopes_rejects_zero_heads():
    with pytest.raises(ValueError, match="n_heads must be >= 1, got 0"):
        alibi_slopes(0)


def test_alibi_score_mod_in_attention():
    q, k, v = randn(2, 4, 5, 8), randn(2, 4, 7, 8), randn(2, 4, 7, 3)
    out = ak.attention(q, k, v, score_mod=alibi(4), is_causal=True)
    slopes = alibi_slopes(4).view(1, 4, 1, 1)
    dist = (torch.arange(5).view(-1, 1) - torch.arange(7).view(1, -1)).abs()
    bias = -slopes * dist
    ref, _, _ = oracle(q, k, v, bias=bias, allowed=torch.ones(5, 7, dtype=torch.bool).tril())
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_alibi_in_float32_keeps_dtype():
    s = torch.zeros(1, 2, 3, 3)
    b = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    h = torch.arange(2).view(1, -1, 1, 1)
    qi, ki = torch.arange(3).view(1, 1, -1, 1), torch.arange(3).view(1, 1, 1, -1)
    y = alibi(2)(s, b, h, qi, ki)
    assert y.dtype == torch.float32
    assert y[0, 0, 0, 2].item() == pytest.approx(-2 * 2 ** -4)
    assert y[0, 1, 2, 0].item() == pytest.approx(-2 * 2 ** -8)


def test_relative_bias_table_lookup_and_gradient():
    table = torch.arange(2 * 7, dtype=torch.float64).view(2, 7).requires_grad_()
    mod = relative_bias(table, 3)
    s = torch.zeros(1, 2, 3, 9, dtype=torch.float64)
    b = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    h = torch.arange(2).view(1, -1, 1, 1)
    qi, ki = torch.arange(3).view(1, 1, -1, 1), torch.arange(9).view(1, 1, 1, -1)
    y = mod(s, b, h, qi, ki)
    # head 1, query 0, key 8: distance +8 is clamped to +3 → column 6 → value 7 + 6
    assert y[0, 1, 0, 8].item() == 13
    # head 0, query 2, key 0: distance -2 → column 1
    assert y[0, 0, 2, 0].item() == 1
    y.sum().backward()
    assert table.grad.sum().item() == 2 * 3 * 9           # one count per score
    assert table.grad[0, 6].item() == sum(1 for i in range(3) for j in range(9) if j - i >= 3)


def test_relative_bias_shape_error():
    with pytest.raises(ValueError, match=r"\(H, 7\), got \(2, 5\)"):
        relative_bias(torch.zeros(2, 5), 3)


def test_softcap_gradient_vanishes_far_from_zero():
    q = torch.tensor([[100.0, 0.0]], dtype=torch.float64, requires_grad=True)
    k = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    v = torch.tensor([[1.0], [0.0]], dtype=torch.float64)
    out = ak.attention(q, k, v, softcap=1.0, scale=1.0)
    assert out.item() == pytest.approx(math.exp(1) / (math.exp(1) + 1), rel=1e-12)
    out.sum().backward()
    assert abs(q.grad[0, 0].item()) < 1e-12                  # tanh saturated for k1
    assert abs(q.grad[0, 1].item()) > 0.1                    # but not near 0 (k2)


def test_score_terms_carry_specs():
    term = alibi(6)
    assert isinstance(term.spec, ak.scores.Alibi) and term.spec.offset == 0
    torch.testing.assert_close(term.spec.slopes, alibi_slopes(6))
    table = torch.randn(4, 7, requires_grad=True)
    rb = relative_bias(table, 3)
    assert isinstance(rb.spec, ak.scores.RelativeBias)
    assert rb.spec.table is table and rb.spec.max_distance == 3   # the table itself (grad)


def test_native_reads_the_spec_not_the_name():
    """The native kernel recognises ALiBi by ``spec``: a term that is only *named* like
    ALiBi is read as the Python function it is (traced and compiled), one with an Alibi
    spec runs as the kernel's own ALiBi."""
    from attnkit.api import prepare
    from attnkit.backends import native
    from attnkit.scores import Alibi, ScoreTerm

    if not native.available():
        pytest.skip(f"native kernel unavailable: {native.why_unavailable()}")
    q = k = v = torch.randn(1, 4, 33, 16)
    real = alibi(4)
    named_only = ScoreTerm(real.fn, "alibi(4)", 4)
    spec_only = ScoreTerm(real.fn, "my_alibi", 4, spec=Alibi(alibi_slopes(4)))
    p_named = prepare(q, k, v, score_mod=named_only, is_causal=True).problem
    assert native.supports(p_named) == []
    assert not isinstance(native.score_mod.for_problem(p_named.score_mod), str)   # compiled
    for term in (real, spec_only):
        p = prepare(q, k, v, score_mod=term, is_causal=True).problem
        assert native.supports(p) == []
        out, _ = native.forward_problem(p)
        ref, _, _ = oracle(q, k, v, score_mod=real, allowed=torch.ones(33, 33).tril().bool())
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
