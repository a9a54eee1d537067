"""The course's worked examples, reproduced to the digits the course states.

Inputs are built so that the raw scores q·k are the course's numbers; every number below is
computed by ``ak.explain`` (the reference) and ``ak.attention`` (every backend).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import attnkit as ak
from helpers.running import run_backend


def T(rows) -> torch.Tensor:  # noqa: ANN001
    return torch.tensor(rows, dtype=torch.float64)


def rounded(a: np.ndarray, digits: int) -> list:
    return np.round(np.asarray(a, dtype=np.float64), digits).tolist()


# (a) masking hides the best-matching key ------------------------------------------------
A_Q = T([[1, 0, 1, 0]])
A_K = T([[1, 0, 0.5, 0], [1, 0, 1, 0], [2, 0, 1, 0]])        # q·k = 1.5, 2, 3
A_V = T([[1, 0], [0, 1], [1000, -1000]])
A_M = T([[0, 0, -math.inf]])


def test_a_mask_hides_the_largest_score():
    tr = ak.explain(A_Q, A_K, A_V, mask=A_M)
    assert tr.scores.tolist() == [[1.5, 2.0, 3.0]]
    assert tr.logits.tolist() == [[0.75, 1.0, -math.inf]]
    assert rounded(tr.weights, 2) == [[0.44, 0.56, 0.0]]
    assert tr.weights[0, 2] == 0.0
    # the key with the largest raw score contributes nothing, whatever its value
    w = tr.weights[0]
    np.testing.assert_allclose(tr.output[0], w[0] * A_V[0].numpy() + w[1] * A_V[1].numpy())
    v_nan = A_V.clone()
    v_nan[2] = torch.nan
    out = ak.attention(A_Q, A_K, v_nan, mask=A_M)
    np.testing.assert_allclose(out.numpy(), tr.output, rtol=1e-15)


# (b) the worked example, and the same logits ×10 --------------------------------------
B_Q = T([[1, 0, 1, 0]])
B_K = T([[1, 0, 1, 0], [0, 1, 0, 1], [1, 0, 0, 0]])           # q·k = 2, 0, 1
B_V = T([[1, 0], [0, 1], [0.5, 0.5]])


def test_b_worked_example(backend):
    tr = ak.explain(B_Q, B_K, B_V)
    assert tr.scores.tolist() == [[2.0, 0.0, 1.0]]
    assert tr.scaled.tolist() == [[1.0, 0.0, 0.5]]
    assert rounded(tr.weights, 2) == [[0.51, 0.19, 0.31]]
    assert rounded(tr.output, 2) == [[0.66, 0.34]]
    out = run_backend(backend, B_Q, B_K, B_V)
    assert rounded(out.numpy(), 2) == [[0.66, 0.34]]


def test_b_same_logits_times_ten():
    tr = ak.explain(B_Q, B_K, B_V, scale=10 * 0.5)
    assert tr.logits.tolist() == [[10.0, 0.0, 5.0]]
    w = tr.weights[0]
    assert round(w[0], 3) == 0.993 and round(w[1], 5) == 0.00005 and round(w[2], 3) == 0.007


# (c) why scale by 1/√d_k ------------------------------------------------------------------
def _c_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.zeros(1, 64, dtype=torch.float64)
    q[0, 0] = 4
    k = torch.zeros(3, 64, dtype=torch.float64)
    k[0, 0], k[1, 0], k[2, 1] = 4, 2, 1                        # q·k = 16, 8, 0
    return q, k, torch.eye(3, dtype=torch.float64)


def test_c_unscaled_vs_scaled_logits_in_d_k_64(backend):
    q, k, v = _c_inputs()
    raw = ak.explain(q, k, v, scale=1.0)
    assert raw.logits.tolist() == [[16.0, 8.0, 0.0]]
    w = raw.weights[0]
    assert round(w[0], 4) == 0.9997 and round(w[1], 4) == 0.0003 and w[2] < 1e-6
    tr = ak.explain(q, k, v)                                   # default scale 1/√64 = 1/8
    assert tr.scale == 1 / 8 and tr.logits.tolist() == [[2.0, 1.0, 0.0]]
    assert rounded(tr.weights, 3) == [[0.665, 0.245, 0.090]]
    out = run_backend(backend, q, k, v)                        # V = I: the output is W
    assert rounded(out.numpy(), 3) == [[0.665, 0.245, 0.090]]


# (d) two queries, two keys ---------------------------------------------------------------
def test_d_two_by_two(backend):
    q = T([[1, 0, 1, 0], [0, 1, 0, 1]])
    k = T([[1, 0, 1, 0], [1, 1, 1, 1]])
    v = T([[10, 0], [0, 10]])
    tr = ak.explain(q, k, v)
    assert tr.scores.tolist() == [[2.0, 2.0], [0.0, 2.0]]
    assert rounded(tr.weights, 2) == [[0.5, 0.5], [0.27, 0.73]]
    assert rounded(tr.output, 1) == [[5.0, 5.0], [2.7, 7.3]]
    out = run_backend(backend, q, k, v)
    assert rounded(out.numpy(), 1) == [[5.0, 5.0], [2.7, 7.3]]


# (e) three tokens, causal ------------------------------------------------------------------
E_Q = T([[1, 0, 1, 0], [1, -1, 2, 0], [-1, 1, 1, 2]])
E_K = T([[1, -1, 2, 1], [0, -1, 1, 0], [-2, 0, 0, 2]])
E_V = torch.cat([torch.eye(3, dtype=torch.float64), torch.ones(3, 1, dtype=torch.float64)], 1)


def test_e_three_tokens_causal(backend):
    tr = ak.explain(E_Q, E_K, E_V, is_causal=True)
    assert tr.scores[2].tolist() == [2.0, 0.0, 6.0]
    assert tr.scaled[2].tolist() == [1.0, 0.0, 3.0]
    assert rounded(tr.weights[2], 3) == [0.114, 0.042, 0.844]
    assert tr.scaled[1].tolist() == [3.0, 1.5, -1.0]
    assert tr.logits[1].tolist() == [3.0, 1.5, -math.inf]
    assert rounded(tr.weights[1], 3) == [0.818, 0.182, 0.0]
    assert tr.weights[0].tolist() == [1.0, 0.0, 0.0]
    assert rounded(tr.output[2], 3) == [0.114, 0.042, 0.844, 1.0]
    out = run_backend(backend, E_Q, E_K, E_V, is_causal=True)
    assert rounded(out[2].numpy(), 3) == [0.114, 0.042, 0.844, 1.0]
    np.testing.assert_allclose(out.numpy(), tr.output, rtol=1e-12, atol=1e-12)


def test_e_matches_the_built_in_example():
    """The library's built-in example uses the same inputs and gives the same numbers."""
    from attnkit.explain import examples

    built = examples.causal_three_tokens()
    tr = built[0] if isinstance(built, list) else built
    np.testing.assert_array_equal(tr.q, E_Q.numpy())
    np.testing.assert_array_equal(tr.k, E_K.numpy())
    assert rounded(tr.weights[2], 3) == [0.114, 0.042, 0.844]


@pytest.mark.parametrize("lang", ["en", "ko"])
def test_e_text_shows_the_numbers(lang):
    text = ak.explain(E_Q, E_K, E_V, is_causal=True).to_text(lang=lang)
    for number in ("0.114", "0.042", "0.844", "0.818", "0.182"):
        assert number in text, number
    assert "-inf" in text or "−∞" in text
