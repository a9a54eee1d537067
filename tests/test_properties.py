"""Properties of attention that hold for every input (hypothesis):

- rows of the weights sum to 1 (0 for a row with no allowed key);
- masked weights are exactly 0;
- permuting keys and values together leaves the output unchanged;
- adding a constant to every logit of a row changes nothing.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnkit as ak
from helpers.running import skip_unless_supported

SETTINGS = settings(max_examples=20, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@st.composite
def problems(draw):  # noqa: ANN001, ANN201
    """(q, k, v, allowed) with small awkward sizes, GQA, and random masks with empty rows."""
    h_kv = draw(st.sampled_from([1, 2]))
    h_q = h_kv * draw(st.sampled_from([1, 2]))
    n_q, n_k = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    d_k, d_v = draw(st.integers(1, 6)), draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    mag = draw(st.sampled_from([0.1, 1.0, 10.0]))
    q = torch.randn(1, h_q, n_q, d_k, generator=g, dtype=torch.float64) * mag
    k = torch.randn(1, h_kv, n_k, d_k, generator=g, dtype=torch.float64)
    v = torch.randn(1, h_kv, n_k, d_v, generator=g, dtype=torch.float64)
    density = draw(st.sampled_from([0.0, 0.3, 0.7, 1.0]))
    allowed = torch.rand(1, h_q, n_q, n_k, generator=g) < density
    return q, k, v, allowed


@SETTINGS
@given(problems())
def test_weights_rows_sum_to_one_and_masked_weights_are_zero(prob):
    q, k, v, allowed = prob
    tr = ak.explain(q, k, v, mask=allowed)
    w = torch.from_numpy(tr.weights)
    sums = w.sum(-1)
    has_key = allowed.any(-1)
    torch.testing.assert_close(sums, has_key.double(), rtol=1e-12, atol=1e-12)
    assert (w[~allowed] == 0).all()                      # exactly zero, not tiny
    assert (w >= 0).all()


@pytest.mark.parametrize("via", ["mask", "is_causal"])
@SETTINGS
@given(prob=problems(), perm_seed=st.integers(0, 1000))
def test_permuting_keys_and_values_together(backend, via, prob, perm_seed):
    q, k, v, allowed = prob
    n_k = k.shape[-2]
    perm = torch.randperm(n_k, generator=torch.Generator().manual_seed(perm_seed))
    if via == "is_causal":                  # the causal rule moves with the keys as a mask
        allowed = torch.ones(q.shape[-2], n_k, dtype=torch.bool).tril().expand_as(allowed)
    skip_unless_supported(backend, q, k, v, mask=allowed)
    out = ak.attention(q, k, v, mask=allowed, backend=backend)
    out_p = ak.attention(q, k[..., perm, :], v[..., perm, :], mask=allowed[..., perm],
                         backend=backend)
    torch.testing.assert_close(out_p, out, rtol=1e-10, atol=1e-10)


@SETTINGS
@given(prob=problems(), shift=st.floats(-50, 50, allow_nan=False))
def test_adding_a_constant_per_row_changes_nothing(backend, prob, shift):
    q, k, v, allowed = prob
    skip_unless_supported(backend, q, k, v, mask=allowed)
    out, lse = ak.attention(q, k, v, mask=allowed, backend=backend, return_lse=True)
    # a different constant for every (head, query) row, as a float mask …
    per_row = shift * torch.arange(1, q.shape[-2] + 1, dtype=torch.float64).view(-1, 1)
    bias = torch.where(allowed, per_row, -torch.inf)
    skip_unless_supported(backend, q, k, v, mask=bias)
    out_b, lse_b = ak.attention(q, k, v, mask=bias, backend=backend, return_lse=True)
    torch.testing.assert_close(out_b, out, rtol=1e-9, atol=1e-9)
    fin = torch.isfinite(lse)
    torch.testing.assert_close(lse_b[fin], lse[fin] + per_row[:, 0].expand_as(lse)[fin],
                               rtol=1e-9, atol=1e-9)
    # … and as a score mod that adds a constant per query index
    def mod(s, b, h, qi, ki):  # noqa: ANN001, ANN202
        return s + shift * (qi + 1)

    skip_unless_supported(backend, q, k, v, mask=allowed, score_mod=mod)
    mod_out = ak.attention(q, k, v, mask=allowed, backend=backend, score_mod=mod)
    torch.testing.assert_close(mod_out, out, rtol=1e-9, atol=1e-9)


@SETTINGS
@given(problems())
def test_output_is_a_convex_mix_of_values(prob):
    q, k, v, allowed = prob
    out = ak.attention(q, k, v, mask=allowed)
    vr = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    big = torch.finfo(torch.float64).max
    lo = torch.where(allowed[..., None], vr[:, :, None], big).amin(-2)
    hi = torch.where(allowed[..., None], vr[:, :, None], -big).amax(-2)
    has = allowed.any(-1)
    assert (out[has] >= lo[has] - 1e-12).all() and (out[has] <= hi[has] + 1e-12).all()
    assert (out[~has] == 0).all()


@SETTINGS
@given(problems(), st.sampled_from(["chained", "per_query", "flat"]))
def test_score_mod_means_what_it_means_per_score(backend, prob, kind):
    """Any score_mod means on every backend what it returns for one score and its four 0-d
    indices (FlexAttention's semantics): chained indexing into a captured table included."""
    q, k, v, allowed = prob
    h_q, n_q, n_k = q.shape[1], q.shape[2], k.shape[2]
    table = torch.randn(1, h_q, n_q, n_k, dtype=torch.float64)
    mods = {
        "chained": lambda s, b, h, qi, ki: s + table[b][h][qi][ki],
        "per_query": lambda s, b, h, qi, ki: s * 0.5 + table[0][h][qi][0],
        "flat": lambda s, b, h, qi, ki: s + table[b, h, qi, ki],
    }
    fn = mods[kind]
    skip_unless_supported(backend, q, k, v, mask=allowed, score_mod=fn)
    out = ak.attention(q, k, v, mask=allowed, score_mod=fn, backend=backend)
    g = h_q // k.shape[1]
    s = (q @ k.repeat_interleave(g, 1).transpose(-1, -2)) * q.shape[-1] ** -0.5
    x = torch.stack([fn(s[0, h, i, j], torch.tensor(0), torch.tensor(h), torch.tensor(i),
                        torch.tensor(j))
                     for h in range(h_q) for i in range(n_q) for j in range(n_k)])
    x = x.view(1, h_q, n_q, n_k).masked_fill(~allowed, -torch.inf)
    w = torch.softmax(x, -1).nan_to_num(0.0)                     # empty rows: weights 0
    ref = w @ v.repeat_interleave(g, 1)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
