"""The tiled engine under extremes: soft-cap precision at any cap, NaN / inf queries,
fully masked rows whatever their query holds, huge values, and second derivatives refused
with one attnkit error on every path (fused, windowed, general, checkpointed)."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from attnkit.backends import tiled
from helpers.oracle import oracle
from helpers.tolerance import assert_low_precision_close, assert_low_precision_grad_close

M = ak.masks
F64 = torch.float64
TINY = {"block_q": 16, "block_k": 8, "chunk_k": 24, "general_block_q": 16}

# one option set per engine path (softcap / score_mod force the general engine)
PATHS = {
    "fused": {},
    "fused_causal": {"is_causal": True},
    "windowed": {"mask": M.sliding_window(9)},
    "windowed_document": {"mask": M.document(torch.arange(64) // 16)},
    "general_softcap": {"softcap": 4.0},
    "general_score_mod": {"score_mod": ak.scores.alibi(2), "mask": M.sliding_window(9)},
}


def _qkv(nq=64, nk=64, d=16, dtype=F64, grad=False, seed=0):  # noqa: ANN001, ANN202
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 2, nq, d, dtype=dtype, generator=g)
    k = torch.randn(2, 2, nk, d, dtype=dtype, generator=g)
    v = torch.randn(2, 2, nk, d, dtype=dtype, generator=g)
    return [t.requires_grad_(grad) for t in (q, k, v)]


def _grads(out: torch.Tensor, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    w = torch.cos(torch.arange(out.numel(), dtype=out.dtype)).view(out.shape)
    return list(torch.autograd.grad((out * w).sum(), inputs))


# ---------------------------------------------------------------------------- soft-cap
@pytest.mark.parametrize("cap", [1.0, 30.0, 50.0, 1e3, 1e8])
@pytest.mark.parametrize("mask", [None, M.causal()], ids=["dense", "causal"])
def test_softcap_float32_within_twice_the_reference_error_at_any_cap(cap, mask):
    q64, k64, v64 = _qkv(97, 113, 32, seed=3)
    q64 = q64 * 3.0                                     # logits ~N(0, 9): the cap bites at 1
    allowed = None if mask is None else mask.to_dense(97, 113)
    ins64 = [t.clone().requires_grad_(True) for t in (q64, k64, v64)]
    ins32 = [t.float().requires_grad_(True) for t in (q64, k64, v64)]
    mine = [t.float().requires_grad_(True) for t in (q64, k64, v64)]
    exact, _, _ = oracle(*ins64, allowed=allowed, softcap=cap)
    low, _, _ = oracle(*ins32, allowed=allowed, softcap=cap, dtype=torch.float32)
    got = ak.attention(*mine, mask=mask, softcap=cap, backend="tiled")
    assert_low_precision_close(got.detach(), low.detach(), exact.detach(), factor=2.0)
    for name, a, r, e in zip("qkv", _grads(got, mine), _grads(low, ins32), _grads(exact, ins64),
                             strict=True):
        assert_low_precision_grad_close(a, r, e, what=f"d{name}")
    with torch.no_grad():                               # the in-place forward alone
        again = ak.attention(*mine, mask=mask, softcap=cap, backend="tiled")
    assert_low_precision_close(again, low.detach(), exact.detach(), factor=2.0)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_soft_cap_in_place_is_the_formula_to_a_few_ulp(dtype):
    x = torch.cat([torch.randn(10000, dtype=dtype) * 10.0 ** torch.randint(-8, 9, (10000,)),
                   torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e30, -1e30, math.inf, -math.inf],
                                dtype=dtype)])
    for cap in (1.0, 30.0, 1e3, 1e8, 1e30):
        exact = cap * torch.tanh(x.double() / cap)
        got = ak.scores.soft_cap_(x.clone(), cap)
        assert got.dtype == dtype and torch.isfinite(got).all()
        fi = torch.finfo(dtype)                 # (x / cap underflows like the formula's)
        torch.testing.assert_close(got.double(), exact, rtol=8 * fi.eps, atol=4 * cap * fi.tiny)
        xr = x.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(ak.scores.soft_cap(xr, cap).sum(), xr)
        torch.testing.assert_close(ak.scores.soft_cap_grad(ak.scores.soft_cap(x, cap), cap), g)
    assert ak.scores.soft_cap_(torch.tensor([math.nan], dtype=dtype), 5.0).isnan().all()


# ---------------------------------------------------------------------------- NaN / inf queries
def _nan_rows(q: torch.Tensor, rows: list[tuple[int, int, int]], value: float) -> torch.Tensor:
    """q with ``value`` in the given rows: the whole first row, one element of the others."""
    q = q.detach().clone()
    for j, (b, h, i) in enumerate(rows):
        if j == 0:
            q[b, h, i, :] = value
        else:
            q[b, h, i, 1] = value
    return q


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_query_row_gives_nan_output_and_lse(path, value):
    q, k, v = _qkv()
    rows = [(0, 0, 5), (1, 1, 40)]
    qn = _nan_rows(q, rows, value)
    with tiled.tile_sizes(**TINY):
        out, lse = ak.attention(qn, k, v, backend="tiled", return_lse=True, **PATHS[path])
    ref, ref_lse = ak.attention(q, k, v, backend="reference", return_lse=True, **PATHS[path])
    hit = torch.zeros(lse.shape, dtype=torch.bool)
    for b, h, i in rows:
        hit[b, h, i] = True
    assert out[hit].isnan().all() and lse[hit].isnan().all()
    torch.testing.assert_close(out[~hit], ref[~hit], atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(lse[~hit], ref_lse[~hit], atol=1e-10, rtol=1e-9)


def test_nan_query_is_not_hidden_by_the_fused_kernel():
    # torch's fused CPU kernel drops a NaN row at some shapes (output 0, LSE 0)
    q, k, v = (torch.randn(1, 2, n, 4, generator=torch.Generator().manual_seed(0))
               for n in (6, 8, 8))
    q[0, 0, 2] = math.nan
    out, lse = ak.attention(q, k, v, backend="tiled", return_lse=True)
    assert out[0, 0, 2].isnan().all() and lse[0, 0, 2].isnan()
    ref = ak.attention(q, k, v, backend="reference")
    torch.testing.assert_close(out, ref, equal_nan=True)


# a padded-away query row (q_lengths) holding garbage: no allowed key
EMPTY_ROW_PATHS = {
    "fused": {"mask": M.padding([64, 50], q_lengths=[40, 64])},
    "windowed": {"mask": M.sliding_window(9) & M.padding([64, 64], q_lengths=[40, 64])},
    "general_softcap": {"mask": M.padding([64, 50], q_lengths=[40, 64]), "softcap": 3.0},
    "general_score_mod": {"mask": M.padding([64, 50], q_lengths=[40, 64]),
                          "score_mod": ak.scores.alibi(2)},
    "general_checkpointed": {"mask": M.padding([64, 50], q_lengths=[40, 64]),
                             "score_mod": ak.scores.relative_bias(
                                 torch.randn(2, 9, dtype=F64, requires_grad=True), 4)},
}


@pytest.mark.parametrize("path", list(EMPTY_ROW_PATHS))
@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
def test_fully_masked_row_is_zero_whatever_its_query_holds(path, value):
    kw = EMPTY_ROW_PATHS[path]
    q, k, v = _qkv()
    rows = [(0, 0, 45), (0, 1, 63)]                              # b=0: rows >= 40 padded away
    got = []
    for qi in (_nan_rows(q, rows, value), _nan_rows(q, rows, 0.5)):
        ins = [qi.requires_grad_(True), k.clone().requires_grad_(True),
               v.clone().requires_grad_(True)]
        with tiled.tile_sizes(**TINY):
            out, lse = ak.attention(*ins, backend="tiled", return_lse=True, **kw)
        got.append([out, lse, *_grads(out, ins)])
    (out, lse, dq, _, _), finite_run = got[0], got[1]
    assert (out[0, :, 40:] == 0).all() and (lse[0, :, 40:] == -math.inf).all()
    assert (dq[0, :, 40:] == 0).all()
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got[0], finite_run, strict=True):
        assert not a.isnan().any(), name
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0, msg=name)   # garbage ignored
    with torch.no_grad(), tiled.tile_sizes(**TINY):                  # the in-place forward
        out2, lse2 = ak.attention(_nan_rows(q, rows, value), k, v, backend="tiled",
                                  return_lse=True, **kw)
    torch.testing.assert_close(out2, out.detach(), atol=1e-12, rtol=0)
    assert torch.equal(lse2 == -math.inf, lse == -math.inf)


# ---------------------------------------------------------------------------- huge values
@pytest.mark.parametrize("mask,key", [(M.sliding_window(5), 6),
                                      (M.prefix_lm(3) | M.sliding_window(4), 6),
                                      (M.padding([30]), 31)],
                         ids=["windowed", "per_block", "padding"])
def test_blocked_logits_that_overflow_never_reach_the_output(mask, key):
    # q·k overflows float32 only at a key row 3 may not see (in one of its PARTIAL tiles):
    # the answer stays finite
    q, k, v = (t.float() for t in _qkv(40, 40, 8))
    q[0, 0, 3, 0] = 1e30
    k[0, 0, key, 0] = 1e30
    with tiled.tile_sizes(block_q=8, block_k=8):
        out, lse = ak.attention(q, k, v, mask=mask, backend="tiled", return_lse=True)
    ref, ref_lse = ak.attention(q, k, v, mask=mask, backend="reference", return_lse=True)
    assert torch.isfinite(out[0, 0, 3]).all()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)


@pytest.mark.parametrize("path", ["fused", "fused_causal", "windowed"])
def test_an_allowed_logit_that_overflows_gives_nan_output_and_lse(path):
    q, k, v = (t.float() for t in _qkv(40, 40, 8))
    q[0, 0, 3, :] = 1e30
    k[0, 0, 2, :] = 1e30                                        # row 3 may see key 2: +inf
    out, lse = ak.attention(q, k, v, backend="tiled", return_lse=True, **PATHS[path])
    ref, ref_lse = ak.attention(q, k, v, backend="reference", return_lse=True, **PATHS[path])
    assert ref[0, 0, 3].isnan().all() and ref_lse[0, 0, 3].isnan()
    assert out[0, 0, 3].isnan().all() and lse[0, 0, 3].isnan()   # not LSE +inf
    torch.testing.assert_close(out, ref, equal_nan=True)


@pytest.mark.parametrize("grad_bias", [False, True], ids=["fused", "checkpointed"])
def test_minus_inf_float_mask_row_gives_zero_output_and_grads(grad_bias):
    q, k, v = _qkv(30, 30, 8, grad=True)
    bias = torch.randn(1, 1, 30, 30, dtype=F64)
    bias[..., 7, :] = -math.inf
    bias.requires_grad_(grad_bias)
    with tiled.tile_sizes(**TINY):
        out, lse = ak.attention(q, k, v, mask=bias, backend="tiled", return_lse=True)
    assert (out[:, :, 7] == 0).all() and (lse[:, :, 7] == -math.inf).all()
    dq, dk = torch.autograd.grad(out.square().sum(), (q, k))
    assert (dq[:, :, 7] == 0).all() and torch.isfinite(dk).all()


# ---------------------------------------------------------------------------- second derivatives
SECOND_ORDER_PATHS = {
    **PATHS,
    "general_checkpointed_score_mod": {"score_mod": ak.scores.relative_bias(
        torch.randn(2, 9, dtype=F64, requires_grad=True), 4)},
    "general_checkpointed_bias": {"mask": torch.randn(1, 2, 64, 64, dtype=F64,
                                                      requires_grad=True)},
    "general_checkpointed_dropout": {"dropout_p": 0.2, "is_causal": True},
}


@pytest.mark.parametrize("path", list(SECOND_ORDER_PATHS))
def test_second_derivatives_are_refused_with_one_attnkit_error(path):
    q, k, v = _qkv(grad=True)
    with tiled.tile_sizes(**TINY):
        out, lse = ak.attention(q, k, v, backend="tiled", return_lse=True,
                                **SECOND_ORDER_PATHS[path])
    with pytest.raises(NotImplementedError, match="first derivatives only"):
        (gq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
        gq.sum().backward()
    # first derivatives still work
    assert torch.isfinite(torch.autograd.grad(out.square().sum(), q)[0]).all()


def test_gradgradcheck_with_alibi_is_refused_not_wrong():
    q, k, v = _qkv(6, 7, 3, grad=True)

    def f(q, k, v):  # noqa: ANN001, ANN202
        return ak.attention(q, k, v, score_mod=ak.scores.alibi(2), backend="tiled")

    with pytest.raises(NotImplementedError, match="first derivatives only"):
        torch.autograd.gradgradcheck(f, (q, k, v))
