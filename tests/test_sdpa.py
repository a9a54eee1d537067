"""attnkit.scaled_dot_product_attention against torch's F.scaled_dot_product_attention (the
oracle), on torch's own kinds of cases: shapes and broadcasting, masks, GQA, dtypes, scale,
causal with N_q != N_k, dropout statistics, and where torch errors."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import attnkit as ak
from attnkit import eager
from helpers.recorders import OpOutputs, floating

SDPA = ak.scaled_dot_product_attention


def rnd(*shape: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype)


def same(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-12) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    torch.testing.assert_close(a, b, atol=tol, rtol=tol, equal_nan=True)


def test_signature_is_torchs():
    mine = inspect.signature(SDPA)
    params = list(mine.parameters.values())
    assert [p.name for p in params] == ["query", "key", "value", "attn_mask", "dropout_p",
                                        "is_causal", "scale", "enable_gqa"]
    assert [p.default for p in params[3:]] == [None, 0.0, False, None, False]
    kinds = [p.kind for p in params]
    assert kinds[:6] == [inspect.Parameter.POSITIONAL_OR_KEYWORD] * 6
    assert kinds[6:] == [inspect.Parameter.KEYWORD_ONLY] * 2     # scale, enable_gqa
    q = rnd(2, 3, 5, 8)
    m = torch.rand(5, 5) > 0.3
    same(SDPA(q, q, q, m, 0.0, False, scale=0.5), F.scaled_dot_product_attention(
        q, q, q, m, 0.0, False, scale=0.5))
    with pytest.raises(TypeError):
        SDPA(q, q, q, m, 0.0, False, 0.5)      # scale is keyword-only, as in torch


SHAPES = [  # q, k, v
    ((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 6)),         # cross, D_v != D_k
    ((5, 8), (7, 8), (7, 8)),                           # 2-D
    ((3, 5, 8), (3, 7, 8), (3, 7, 8)),                  # 3-D
    ((2, 2, 3, 5, 8), (2, 2, 3, 7, 8), (2, 2, 3, 7, 8)),  # 5-D
    ((3, 2, 3, 5, 8), (1, 2, 3, 7, 8), (1, 2, 3, 7, 8)),  # K/V batch broadcast
    ((1, 3, 5, 8), (4, 3, 7, 8), (4, 3, 7, 8)),         # q batch broadcast
    ((2, 3, 5, 8), (3, 7, 8), (3, 7, 8)),               # mixed ranks
    ((2, 3, 5, 8), (2, 1, 7, 8), (2, 1, 7, 8)),         # H_kv = 1 without enable_gqa
    ((2, 1, 5, 8), (2, 3, 7, 8), (2, 3, 7, 8)),         # H_q = 1 without enable_gqa
    ((2, 3, 1, 8), (2, 3, 113, 8), (2, 3, 113, 8)),     # one query
]


@pytest.mark.parametrize("shapes", SHAPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_shapes_and_causal_match_torch(shapes, causal):
    torch.manual_seed(0)
    q, k, v = (rnd(*s) for s in shapes)
    same(SDPA(q, k, v, is_causal=causal), F.scaled_dot_product_attention(q, k, v,
                                                                          is_causal=causal))


@pytest.mark.parametrize("n_q, n_k", [(5, 9), (9, 5), (1, 1), (97, 33)])
def test_causal_is_top_left_with_n_q_ne_n_k(n_q, n_k):
    q, k, v = rnd(2, 2, n_q, 8), rnd(2, 2, n_k, 8), rnd(2, 2, n_k, 8)
    same(SDPA(q, k, v, is_causal=True), F.scaled_dot_product_attention(q, k, v,
                                                                        is_causal=True))


MASK_SHAPES = [(5, 7), (1, 7), (5, 1), (3, 5, 7), (1, 5, 7), (2, 1, 5, 7), (2, 3, 5, 7),
               (1, 1, 1, 7)]


@pytest.mark.parametrize("mask_shape", MASK_SHAPES, ids=str)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_masks_broadcast_like_torch(mask_shape, kind):
    torch.manual_seed(1)
    q, k, v = rnd(2, 3, 5, 8), rnd(2, 3, 7, 8), rnd(2, 3, 7, 8)
    if kind == "bool":
        m = torch.rand(mask_shape) > 0.4
    else:
        m = rnd(*mask_shape)
        m = m.masked_fill(torch.rand(mask_shape) > 0.6, -torch.inf)
    same(SDPA(q, k, v, attn_mask=m), F.scaled_dot_product_attention(q, k, v, attn_mask=m))


def test_rows_with_no_allowed_key_are_zero_as_in_torch():
    # torch 2.13 returns 0 for a fully masked row (older torch gave NaN); so does attnkit
    q, k, v = rnd(2, 3, 5, 8), rnd(2, 3, 7, 8), rnd(2, 3, 7, 8)
    m = torch.rand(2, 1, 5, 7) > 0.4
    m[0, 0, 2] = False
    fm = torch.zeros(5, 7, dtype=torch.float64)
    fm[3] = -torch.inf
    for mask in (m, fm):
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = SDPA(q, k, v, attn_mask=mask)
        same(out, ref)
    assert (SDPA(q, k, v, attn_mask=m)[0, :, 2] == 0).all()


def test_nan_or_inf_in_a_float_mask_gives_nan_rows_as_in_torch():
    q, k, v = rnd(1, 2, 4, 8), rnd(1, 2, 6, 8), rnd(1, 2, 6, 8)
    m = torch.zeros(4, 6, dtype=torch.float64)
    m[1, 2], m[3, 0] = torch.nan, torch.inf
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    out = SDPA(q, k, v, attn_mask=m)
    same(out, ref)
    assert out[:, :, [1, 3]].isnan().all() and not out[:, :, [0, 2]].isnan().any()


@pytest.mark.parametrize("h_q, h_kv", [(4, 2), (6, 1), (4, 4), (8, 2)])
@pytest.mark.parametrize("rank", [3, 4])
def test_gqa_matches_torch(h_q, h_kv, rank):
    lead = (2,) if rank == 4 else ()
    q, k, v = rnd(*lead, h_q, 5, 8), rnd(*lead, h_kv, 7, 8), rnd(*lead, h_kv, 7, 4)
    same(SDPA(q, k, v, enable_gqa=True, is_causal=True),
         F.scaled_dot_product_attention(q, k, v, enable_gqa=True, is_causal=True))


@pytest.mark.parametrize("scale", [0.0, 0.3, -1.0, 2, 10.0])
def test_scale_matches_torch(scale):
    q, k, v = rnd(2, 3, 5, 8), rnd(2, 3, 7, 8), rnd(2, 3, 7, 8)
    same(SDPA(q, k, v, scale=scale), F.scaled_dot_product_attention(q, k, v, scale=scale))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_low_precision_within_twice_torchs_error(dtype, masked):
    # DESIGN's rule: the error against float64 is within 2x the error of torch's own SDPA
    # run in the same low precision (gradients 3x)
    torch.manual_seed(2)
    q, k, v = rnd(2, 4, 97, 59), rnd(2, 2, 113, 59), rnd(2, 2, 113, 59)
    m = (torch.rand(2, 1, 97, 113) > 0.3) if masked else None
    f64 = F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
    lo = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    theirs = F.scaled_dot_product_attention(*lo, attn_mask=m, enable_gqa=True)
    g = torch.randn_like(theirs)
    their_grads = torch.autograd.grad(theirs, lo, g)
    lo2 = [t.detach().requires_grad_() for t in lo]
    mine = SDPA(*lo2, attn_mask=m, enable_gqa=True)
    my_grads = torch.autograd.grad(mine, lo2, g)
    assert mine.dtype == dtype
    floor = 1e-6
    err = (mine.double() - f64).abs().max()
    assert err <= 2 * (theirs.double() - f64).abs().max() + floor
    ex = [t.detach().requires_grad_() for t in (q, k, v)]
    ref_grads = torch.autograd.grad(
        F.scaled_dot_product_attention(*ex, attn_mask=m, enable_gqa=True), ex, g.double())
    for a, b, r in zip(my_grads, their_grads, ref_grads, strict=True):
        assert (a.double() - r).abs().max() <= 3 * (b.double() - r).abs().max() + floor


def test_gradients_match_torch_float64():
    torch.manual_seed(3)
    ins = [rnd(2, 4, 9, 8), rnd(2, 2, 11, 8), rnd(2, 2, 11, 6)]
    bias = rnd(1, 4, 9, 11)
    a = [t.clone().requires_grad_() for t in (*ins, bias)]
    b = [t.clone().requires_grad_() for t in (*ins, bias)]
    out_a = SDPA(*a[:3], attn_mask=a[3], enable_gqa=True, scale=0.7)
    out_b = F.scaled_dot_product_attention(*b[:3], attn_mask=b[3], enable_gqa=True, scale=0.7)
    g = torch.randn_like(out_a)
    for x, y in zip(torch.autograd.grad(out_a, a, g), torch.autograd.grad(out_b, b, g),
                    strict=True):
        same(x, y, 1e-10)


def test_bfloat16_inputs_with_a_float32_mask_as_torch_allows():
    q = rnd(1, 2, 5, 8, dtype=torch.bfloat16)
    m = torch.zeros(5, 5)
    m[:, 0] = -torch.inf
    ref = F.scaled_dot_product_attention(q.double(), q.double(), q.double(), attn_mask=m.double())
    out = SDPA(q, q, q, attn_mask=m)
    assert out.dtype == torch.bfloat16
    assert (out.double() - ref).abs().max() < 3e-2


def test_dropout_statistics_match_torch():
    # uniform weights (q = 0) over N_k keys, v = 1: the output is the kept fraction / (1-p)
    torch.manual_seed(4)
    p, n_k = 0.3, 64
    q, k, v = torch.zeros(4, 8, 64, 16), torch.randn(4, 8, n_k, 16), torch.ones(4, 8, n_k, 16)
    mine = SDPA(q, k, v, dropout_p=p)[..., 0]
    torch_ = F.scaled_dot_product_attention(q, k, v, dropout_p=p)[..., 0]
    # each output is mean of n_k Bernoulli(1-p)/(1-p): mean 1, sd sqrt(p/((1-p) n_k))
    sd = (p / ((1 - p) * n_k)) ** 0.5
    for x in (mine, torch_):
        assert abs(x.mean().item() - 1) < 0.02
        assert abs(x.std().item() - sd) < 0.1 * sd
    assert not torch.equal(SDPA(q, k, v, dropout_p=p), SDPA(q, k, v, dropout_p=p))
    same(SDPA(q, k, v, dropout_p=1.0), F.scaled_dot_product_attention(q, k, v, dropout_p=1.0))


def test_kv_batch_one_is_not_copied(monkeypatch):
    """K/V of batch 1 under a batch-8 query reach the eager path (``eager.attend``, which
    ``attention()`` calls too) as the caller's own tensors, and no buffer the size of K or V
    copied per batch element is made on the way (the logits, (8, 2, 3, 300), are smaller
    than that)."""
    q = rnd(8, 2, 3, 4, dtype=torch.float32)
    k, v = rnd(1, 2, 300, 4, dtype=torch.float32), rnd(1, 2, 300, 4, dtype=torch.float32)
    seen = []
    attend = eager.attend

    def spy(q_, k_, v_, **kw):  # noqa: ANN001, ANN003, ANN202
        seen.append((k_.data_ptr() == k.data_ptr(), v_.data_ptr() == v.data_ptr(),
                     k_.shape[0] == 1 or k_.stride(0) == 0))
        return attend(q_, k_, v_, **kw)

    monkeypatch.setattr(eager, "attend", spy)
    with OpOutputs(big=8 * k.numel(), keep=floating) as rec:
        out = SDPA(q, k, v)
    assert seen == [(True, True, True)]
    assert rec.hits == []
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v),
                               atol=1e-6, rtol=1e-5)
    # the recorder does see a copy, where one is made
    with OpOutputs(big=8 * k.numel(), keep=floating) as rec:
        k.expand(8, -1, -1, -1).contiguous()
    assert [h.split(" -> ")[1] for h in rec.hits] == ["(8, 2, 300, 4)"]


@pytest.mark.parametrize("case", [
    "gqa_without_flag", "gqa_not_divisible", "1d", "mask_1d",
    "mask_enlarges", "mask_int", "mask_f64_for_f32", "dtypes_mixed", "d_k_mismatch",
    "dropout_above_1", "batch_mismatch", "scale_str", "causal_int", "gqa_int",
])
def test_errors_where_torch_errors(case):
    q4, k4 = rnd(2, 4, 5, 8, dtype=torch.float32), rnd(2, 2, 6, 8, dtype=torch.float32)
    q = rnd(2, 4, 5, 8, dtype=torch.float32)
    cases = {
        "gqa_without_flag": lambda f: f(q4, k4, k4),
        "gqa_not_divisible": lambda f: f(q4, q4[:, :3], q4[:, :3], enable_gqa=True),
        "1d": lambda f: f(q[0, 0, 0], q[0, 0, 0], q[0, 0, 0]),
        "mask_1d": lambda f: f(q, q, q, attn_mask=torch.zeros(5)),
        "mask_enlarges": lambda f: f(q, q, q, attn_mask=torch.zeros(3, 4, 5, 5)),
        "mask_int": lambda f: f(q, q, q, attn_mask=torch.ones(5, 5, dtype=torch.long)),
        "mask_f64_for_f32": lambda f: f(q, q, q, attn_mask=torch.zeros(5, 5).double()),
        "dtypes_mixed": lambda f: f(q, q.double(), q),
        "d_k_mismatch": lambda f: f(q, rnd(2, 4, 5, 7, dtype=torch.float32), q),
        "dropout_above_1": lambda f: f(q, q, q, dropout_p=2.0),
        "batch_mismatch": lambda f: f(q, q[:1].expand(3, -1, -1, -1)[:, :4],
                                      q[:1].expand(3, -1, -1, -1)),
        "scale_str": lambda f: f(q, q, q, scale="a"),
        "causal_int": lambda f: f(q, q, q, is_causal=1),
        "gqa_int": lambda f: f(q, q, q, enable_gqa=1),
    }
    # torch's kernels differ here: the default dispatch refuses a 1-D mask (math broadcasts it)
    with pytest.raises((RuntimeError, TypeError, IndexError, ValueError)):
        cases[case](F.scaled_dot_product_attention)
    with pytest.raises((ValueError, TypeError)):
        cases[case](SDPA)


@pytest.mark.parametrize("nq,nk", [(5, 5), (3, 7), (7, 3)])
@pytest.mark.parametrize("kind", ["bool", "float", "bool_4d"])
def test_mask_with_is_causal_combines_as_torch(nq: int, nk: int, kind: str) -> None:
    # torch 2.13's default dispatch takes attn_mask ∧ top-left causal (its math kernel alone
    # refuses the pair); HF models pass both
    torch.manual_seed(1)
    q, k, v = rnd(2, 3, nq, 8, dtype=torch.float32), rnd(2, 3, nk, 8, dtype=torch.float32), \
        rnd(2, 3, nk, 8, dtype=torch.float32)
    if kind == "float":
        mask = torch.randn(nq, nk)
    else:
        mask = torch.rand((2, 1, nq, nk) if kind == "bool_4d" else (nq, nk)) > 0.3
        mask[..., 0] = True                           # every row keeps key 0 (torch: no NaN)
    q.requires_grad_()
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
    got = SDPA(q, k, v, attn_mask=mask, is_causal=True)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    (gw,) = torch.autograd.grad(want.sum(), q)
    (gg,) = torch.autograd.grad(got.sum(), q)
    torch.testing.assert_close(gg, gw, atol=1e-5, rtol=1e-5)
    with sdpa_kernel(SDPBackend.MATH), pytest.raises(RuntimeError):   # why older code refused
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)


def test_empty_sizes_match_torch():
    q, k = rnd(2, 3, 5, 8), rnd(2, 3, 7, 8)
    same(SDPA(q, k[:, :, :0], k[:, :, :0]),
         F.scaled_dot_product_attention(q, k[:, :, :0], k[:, :, :0]))
    same(SDPA(q[:, :, :0], k, k), F.scaled_dot_product_attention(q[:, :, :0], k, k))
