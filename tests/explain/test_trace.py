"""``ak.explain`` → ``Trace``: the data of every step, per head, and its text rendering."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnkit as ak
from attnkit import masks
from attnkit.scores import alibi
from helpers.oracle import oracle, randn

KEYS = ["scores", "scaled", "logits", "weights", "output"]
NAMES = ["MatMul", "Scale", "Mask", "Softmax", "MatMul"]


def test_steps_in_order_with_formulas_shapes_values():
    q, k, v = randn(4, 8), randn(6, 8), randn(6, 3)
    tr = ak.explain(q, k, v, is_causal=True)
    assert [s.key for s in tr.steps] == KEYS
    assert [s.name for s in tr.steps] == NAMES
    assert "Q Kᵀ" in tr.steps[0].formula and "softmax" in tr.steps[3].formula
    assert "1/√8" in tr.steps[1].formula
    for s in tr.steps:
        assert isinstance(s.value, np.ndarray) and s.value.dtype == np.float64
        assert s.value.ndim == 2 and s.value.shape == tuple(s.shape)
    assert tr.scores.shape == (4, 6) and tr.output.shape == (4, 3) and tr.lse.shape == (4,)
    allowed = torch.ones(4, 6, dtype=torch.bool).tril()
    np.testing.assert_allclose(tr.scores, (q @ k.T).numpy(), rtol=1e-12)
    np.testing.assert_allclose(tr.scaled, (q @ k.T).numpy() / np.sqrt(8), rtol=1e-12)
    assert np.isneginf(tr.logits[~allowed.numpy()]).all()
    np.testing.assert_array_equal(tr.allowed, allowed.numpy())
    out, lse, w = oracle(q, k, v, allowed=allowed)
    np.testing.assert_allclose(tr.weights, w.numpy(), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(tr.output, out.numpy(), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(tr.lse, lse.numpy(), rtol=1e-12)
    assert tr.step("weights") is tr.steps[3]
    with pytest.raises(KeyError, match="no step 'nope'"):
        tr.step("nope")
    assert tr.mask_name == "causal" and tr.n_heads == 1
    assert tr.scale == pytest.approx(8 ** -0.5, rel=1e-15)
    np.testing.assert_array_equal(tr.q, q.numpy())


def test_per_head_arrays_with_gqa_and_leading_dims():
    q, k, v = randn(2, 3, 4, 5, 8), randn(2, 3, 2, 6, 8), randn(2, 3, 2, 6, 3)
    m = torch.rand(3, 1, 5, 6) > 0.3
    tr = ak.explain(q, k, v, mask=m)
    assert tr.scores.shape == (2, 3, 4, 5, 6) and tr.output.shape == (2, 3, 4, 5, 3)
    assert tr.lse.shape == (2, 3, 4, 5) and tr.allowed.shape == (2, 3, 4, 5, 6)
    assert tr.n_heads == 4 and tr.k.shape == (2, 3, 2, 6, 8)
    out, lse = ak.attention(q, k, v, mask=m, return_lse=True)
    np.testing.assert_allclose(tr.output, out.numpy(), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(tr.lse, lse.numpy(), rtol=1e-12)
    # head 3 of batch (1, 2) shares K/V head 1 (GQA)
    np.testing.assert_allclose(tr.scores[1, 2, 3], (q[1, 2, 3] @ k[1, 2, 1].T).numpy(),
                               rtol=1e-12)
    np.testing.assert_array_equal(tr.allowed[1, 2, 3], m[2, 0].numpy())


def test_options_show_in_scaled_step():
    q, k, v = randn(1, 2, 4, 4) * 5, randn(1, 2, 4, 4), randn(1, 2, 4, 2)
    bias = randn(4, 4)
    tr = ak.explain(q, k, v, softcap=2.0, score_mod=alibi(2), mask=bias, scale=0.3)
    f = tr.steps[1].formula
    assert "2·tanh(X/2)" in f and "score_mod" in f and "bias" in f and "0.3" in f
    assert tr.softcap == 2.0 and tr.has_score_mod and tr.has_bias
    out = ak.attention(q, k, v, softcap=2.0, score_mod=alibi(2), mask=bias, scale=0.3)
    np.testing.assert_allclose(tr.output, out.numpy(), rtol=1e-12, atol=1e-15)
    capped = 2.0 * np.tanh((q @ k.transpose(-1, -2)).numpy() * 0.3 / 2.0)
    dist = np.abs(np.arange(4)[:, None] - np.arange(4)[None, :])
    slopes = ak.scores.alibi_slopes(2).numpy()[:, None, None]
    np.testing.assert_allclose(tr.scaled, capped - slopes * dist + bias.numpy(), rtol=1e-12)


def test_fully_masked_row_in_trace():
    q, k, v = randn(3, 4), randn(5, 4), randn(5, 2)
    tr = ak.explain(q, k, v, mask=masks.padding([5], q_lengths=[2]))
    assert np.isneginf(tr.logits[2]).all() and (tr.weights[2] == 0).all()
    assert (tr.output[2] == 0).all() and np.isneginf(tr.lse[2])
    np.testing.assert_allclose(tr.weights.sum(-1), [1, 1, 0], rtol=1e-12)


def test_numpy_and_half_inputs():
    a = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    tr = ak.explain(a, a, a)
    assert tr.weights.dtype == np.float64 and tr.weights.shape == (3, 3)
    tr16 = ak.explain(*(torch.from_numpy(a).half() for _ in range(3)))
    np.testing.assert_allclose(tr16.weights, tr.weights, atol=2e-3)


def test_to_text_has_step_table_and_rounded_matrices():
    q = torch.tensor([[1.0, 0, 1, 0]], dtype=torch.float64)
    k = torch.tensor([[1.0, 0, 1, 0], [0, 1, 0, 1], [1, 0, 0, 0]], dtype=torch.float64)
    v = torch.tensor([[1.0, 0], [0, 1], [0.5, 0.5]], dtype=torch.float64)
    tr = ak.explain(q, k, v)
    en, ko = tr.to_text(lang="en"), tr.to_text(lang="ko")
    for text in (en, ko):
        for name in ("MatMul", "Scale", "Mask", "Softmax"):
            assert name in text
        for s in tr.steps:
            assert s.formula.split()[0] in text
        # weights [0.506, 0.186, 0.307] and output [0.660, 0.340], 3 decimals
        for number in ("0.506", "0.186", "0.307", "0.660", "0.340"):
            assert number in text, number
        assert "0.5065" not in text                       # rounded, not raw
    assert en != ko
    assert any("\uac00" <= ch <= "\ud7a3" for ch in ko)   # Hangul in the Korean text
    assert tr.to_text(decimals=2) != en and "0.51" in tr.to_text(decimals=2)
    with pytest.raises(ValueError, match="lang"):
        tr.to_text(lang="xx")


def test_text_lists_every_head():
    q, k, v = randn(1, 2, 3, 4), randn(1, 2, 3, 4), randn(1, 2, 3, 2)
    tr = ak.explain(q, k, v)
    text = tr.to_text()
    w = tr.weights
    for h in range(2):
        assert f"{w[0, h, 0, 0]:.3f}" in text


@pytest.mark.parametrize("n_q,n_k", [(0, 3), (3, 0)])
def test_empty_sequences(n_q, n_k):
    tr = ak.explain(randn(n_q, 4), randn(n_k, 4), randn(n_k, 2), is_causal=True)
    assert tr.weights.shape == (n_q, n_k) and tr.output.shape == (n_q, 2)
    assert (tr.output == 0).all() and np.isneginf(tr.lse).all()


def test_explain_refuses_dropout_and_unknown_backends():
    x = torch.eye(3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"deterministic.*dropout_p=0.5"):
        ak.explain(x, x, x, dropout_p=0.5)
    with pytest.raises(ValueError, match="unknown backend 'bogus'"):
        ak.explain(x, x, x, backend="bogus")
