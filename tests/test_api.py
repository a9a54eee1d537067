"""``attnkit.attention``: input forms, options, and every backend against the float64 oracle.

Tests that take the ``backend`` fixture run once per registered backend (see conftest.py) and
skip with the backend's own reasons where it cannot run a call.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import attnkit as ak
from attnkit import masks
from attnkit.api import prepare
from attnkit.scores import alibi, relative_bias
from helpers.oracle import naive_low_precision, oracle, randn
from helpers.recorders import OpOutputs
from helpers.running import run_backend, skip_unless_supported, spy_on_backend
from helpers.tolerance import assert_low_precision_close, assert_low_precision_grad_close, max_err

TOL = {"rtol": 1e-10, "atol": 1e-10}


def qkv(b=1, hq=2, hkv=2, nq=7, nk=9, dk=8, dv=None, dtype=torch.float64, lead=None):
    lead = (b,) if lead is None else lead
    dv = dk if dv is None else dv
    return (randn(*lead, hq, nq, dk, dtype=dtype), randn(*lead, hkv, nk, dk, dtype=dtype),
            randn(*lead, hkv, nk, dv, dtype=dtype))


# ============================================================================ input forms
def test_two_d_inputs_give_two_d_output():
    q, k, v = randn(5, 8), randn(7, 8), randn(7, 3)
    out, lse = ak.attention(q, k, v, return_lse=True)
    assert out.shape == (5, 3) and lse.shape == (5,)
    ref, ref_lse, _ = oracle(q, k, v)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)


def test_three_d_inputs_are_heads_without_batch():
    q, k, v = randn(3, 5, 8), randn(3, 6, 8), randn(3, 6, 4)
    out = ak.attention(q, k, v)
    assert out.shape == (3, 5, 4)
    torch.testing.assert_close(out, oracle(q, k, v)[0], **TOL)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_numpy_in_numpy_out_keeps_dtype(dtype):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 5, 4)).astype(dtype) for _ in range(3))
    out, lse = ak.attention(q, k, v, is_causal=True, return_lse=True)
    assert isinstance(out, np.ndarray) and isinstance(lse, np.ndarray)
    assert out.dtype == dtype and out.shape == (2, 5, 4) and lse.shape == (2, 5)
    ref = oracle(*(torch.from_numpy(a) for a in (q, k, v)),
                 allowed=torch.ones(5, 5, dtype=torch.bool).tril())[0].numpy()
    np.testing.assert_allclose(out, ref, rtol=1e-5 if dtype == np.float32 else 1e-12,
                               atol=1e-6 if dtype == np.float32 else 1e-12)


def test_numpy_non_contiguous_and_numpy_mask():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((8, 6))[:, ::2]                 # non-contiguous view (8, 3)
    k = rng.standard_normal((3, 5)).T                       # transposed (5, 3)
    v = rng.standard_normal((5, 2))
    mask = rng.random((8, 5)) > 0.3
    mask[:, 0] = True
    out = ak.attention(q, k, v, mask=mask)
    ref = oracle(*(torch.from_numpy(np.ascontiguousarray(a)) for a in (q, k, v)),
                 allowed=torch.from_numpy(mask))[0].numpy()
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)


def test_extra_leading_dims_are_batch():
    q, k, v = qkv(lead=(2, 3), hq=4, hkv=2, nq=5, nk=6)
    out, lse = ak.attention(q, k, v, is_causal=True, return_lse=True)
    assert out.shape == (2, 3, 4, 5, 8) and lse.shape == (2, 3, 4, 5)
    flat = ak.attention(*(t.reshape(6, *t.shape[2:]) for t in (q, k, v)), is_causal=True)
    torch.testing.assert_close(out.reshape(6, 4, 5, 8), flat, **TOL)
    one = ak.attention(q[1, 2], k[1, 2], v[1, 2], is_causal=True)
    torch.testing.assert_close(out[1, 2], one, **TOL)


@pytest.mark.parametrize("mask_shape", [(3, 1, 5, 6), (2, 1, 1, 5, 6), (1, 3, 4, 5, 6),
                                        (6,), (5, 1), (2, 3, 4, 5, 6)])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_tensor_masks_broadcast_over_extra_leading_dims(mask_shape, kind):
    q, k, v = qkv(lead=(2, 3), hq=4, hkv=2, nq=5, nk=6)
    allowed = torch.rand(mask_shape) > 0.4
    if kind == "bool":
        m = allowed
    else:
        m = torch.where(allowed, torch.randn(mask_shape, dtype=torch.float64), -torch.inf)
    out = ak.attention(q, k, v, mask=m)
    full = torch.broadcast_to(allowed, (2, 3, 4, 5, 6))
    bias = None if kind == "bool" else torch.where(allowed, m, 0.0)
    ref, _, _ = oracle(q, k, v, allowed=full, bias=bias)
    torch.testing.assert_close(out, ref, **TOL)


def test_mask_object_bool_tensor_and_float_tensor_agree():
    q, k, v = qkv(nq=6, nk=6)
    allowed = torch.ones(6, 6, dtype=torch.bool).tril()
    a = ak.attention(q, k, v, mask=masks.causal())
    b = ak.attention(q, k, v, mask=allowed)
    c = ak.attention(q, k, v, mask=torch.zeros(6, 6).masked_fill(~allowed, -torch.inf))
    d = ak.attention(q, k, v, is_causal=True)
    for x in (b, c, d):
        torch.testing.assert_close(a, x, rtol=0, atol=0)


def test_gqa_equals_repeated_kv_heads():
    q, k, v = qkv(b=2, hq=6, hkv=2, nq=5, nk=7, dk=4, dv=3)
    out = ak.attention(q, k, v)
    rep = ak.attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1))
    torch.testing.assert_close(out, rep, **TOL)
    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(out, ref, **TOL)
    # MQA
    out1 = ak.attention(q, k[:, :1], v[:, :1])
    torch.testing.assert_close(out1, F.scaled_dot_product_attention(
        q, k[:, :1].expand(-1, 6, -1, -1), v[:, :1].expand(-1, 6, -1, -1)), **TOL)


@pytest.mark.parametrize("nq,nk", [(3, 8), (8, 3), (5, 5), (1, 6), (6, 1)])
def test_is_causal_is_top_left_like_torch(nq, nk):
    q, k, v = qkv(hq=2, hkv=2, nq=nq, nk=nk, dk=4, dv=5)
    out = ak.attention(q, k, v, is_causal=True)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ok = torch.ones(nq, nk, dtype=torch.bool).tril().any(-1)        # torch gives NaN elsewhere
    torch.testing.assert_close(out[..., ok, :], ref[..., ok, :], **TOL)
    assert (out[..., ~ok, :] == 0).all()


def test_scale_default_and_explicit():
    q, k, v = qkv(dk=16)
    torch.testing.assert_close(ak.attention(q, k, v), ak.attention(q, k, v, scale=0.25), **TOL)
    out = ak.attention(q, k, v, scale=0.7)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, scale=0.7), **TOL)
    torch.testing.assert_close(ak.attention(q, k, v, scale=np.float32(0.5)),
                               ak.attention(q, k, v, scale=0.5), **TOL)


def test_softcap_applies_to_scaled_logits_before_mask():
    q, k, v = qkv(nq=5, nk=5, dk=4)
    q = q * 6
    c = 2.0
    out, lse = ak.attention(q, k, v, softcap=c, is_causal=True, scale=0.3, return_lse=True)
    x = (q @ k.transpose(-1, -2)) * 0.3
    x = c * torch.tanh(x / c)
    x = x.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), -torch.inf)
    torch.testing.assert_close(lse, torch.logsumexp(x, -1), **TOL)
    torch.testing.assert_close(out, torch.softmax(x, -1) @ v, **TOL)
    # the cap bites: capped logits all lie in (-c, c)
    assert not torch.allclose(out, ak.attention(q, k, v, is_causal=True, scale=0.3))


def test_score_mod_gets_indices_and_is_differentiable(backend):
    """Gradients reach a score mod's own parameters (q, k, v need no grad)."""
    torch.manual_seed(3)
    q, k, v = qkv(b=2, hq=3, hkv=3, nq=4, nk=6, dk=4)
    table = torch.randn(3, 2 * 3 + 1, dtype=torch.float64, requires_grad=True)
    mod = relative_bias(table, 3)
    out = run_backend(backend, q, k, v, score_mod=mod)
    b = torch.arange(2).view(-1, 1, 1, 1)
    h = torch.arange(3).view(1, -1, 1, 1)
    qi, ki = torch.arange(4).view(1, 1, -1, 1), torch.arange(6).view(1, 1, 1, -1)
    rel = (ki - qi).clamp(-3, 3) + 3
    hand = (q @ k.transpose(-1, -2)) / 2 + table[h, rel] + 0 * b
    ref = torch.softmax(hand, -1) @ v
    torch.testing.assert_close(out, ref, **TOL)
    (g,) = torch.autograd.grad(out.square().sum(), table)
    (g_ref,) = torch.autograd.grad(ref.square().sum(), table)
    torch.testing.assert_close(g, g_ref, **TOL)
    assert g.abs().sum() > 0


def test_score_mod_sees_batch_index():
    q, k, v = qkv(b=3, hq=1, hkv=1, nq=4, nk=4)
    out = ak.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + 5.0 * b * (ki == 0))
    for bi in range(3):
        bias = torch.zeros(4, 4, dtype=torch.float64)
        bias[:, 0] = 5.0 * bi
        torch.testing.assert_close(out[bi, 0], oracle(q[bi, 0], k[bi, 0], v[bi, 0],
                                                      bias=bias)[0], **TOL)


def test_return_lse_is_logsumexp_of_masked_logits():
    q, k, v = qkv(b=2, hq=4, hkv=2, nq=6, nk=5)
    allowed = torch.rand(2, 1, 6, 5) > 0.5
    allowed[0, 0, 2] = False                                   # one row with nothing allowed
    bias = torch.randn(2, 4, 6, 5, dtype=torch.float64)
    m = bias.masked_fill(~allowed, -torch.inf)
    out, lse = ak.attention(q, k, v, mask=m, return_lse=True)
    logits = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) / math.sqrt(8) + m
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1), **TOL)
    assert lse.shape == (2, 4, 6) and torch.isneginf(lse[0, :, 2]).all()
    assert (out[0, :, 2] == 0).all()


# ============================================================================ dropout
def test_dropout_reproducible_with_manual_seed(backend):
    q, k, v = qkv(nq=16, nk=16)
    skip_unless_supported(backend, q, k, v, dropout_p=0.3)
    torch.manual_seed(7)
    a = ak.attention(q, k, v, dropout_p=0.3, backend=backend)
    torch.manual_seed(7)
    b = ak.attention(q, k, v, dropout_p=0.3, backend=backend)
    c = ak.attention(q, k, v, dropout_p=0.3, backend=backend)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(a, c)
    assert not torch.allclose(a, ak.attention(q, k, v, backend=backend))


def test_dropout_statistics(backend):
    n, p = 256, 0.3
    q = torch.zeros(1, 1, n, 4, dtype=torch.float64)             # uniform weights 1/n
    k = randn(1, 1, n, 4)
    eye = torch.eye(n, dtype=torch.float64)[None, None]          # out[i, j] = kept w_ij
    out = run_backend(backend, q, k, eye, dropout_p=p)
    dropped = (out == 0).double().mean().item()
    assert abs(dropped - p) < 0.01, dropped                      # 65 536 Bernoulli draws
    kept = out[out != 0]
    torch.testing.assert_close(kept, torch.full_like(kept, 1 / (n * (1 - p))))
    ones = torch.ones(1, 1, n, 1, dtype=torch.float64)
    mean = ak.attention(q, k, ones, dropout_p=p, backend=backend).mean().item()  # E[out] = 1
    assert abs(mean - 1.0) < 0.01, mean


def test_dropout_zero_is_exact():
    q, k, v = qkv()
    torch.testing.assert_close(ak.attention(q, k, v, dropout_p=0.0), oracle(q, k, v)[0],
                               **TOL)


# ============================================================================ every backend
SHAPES = [
    # b, hq, hkv, nq, nk, dk, dv
    (1, 1, 1, 1, 1, 8, 8),
    (2, 4, 2, 97, 113, 59, 33),
    (1, 2, 2, 113, 97, 8, 111),
    (1, 3, 1, 1, 97, 59, 8),
    (2, 2, 1, 64, 64, 16, 16),
]


def _mask_for(kind: str, b: int, nq: int, nk: int):
    """→ (mask argument, dense allowed (B|1, 1, N_q, N_k) or None, bias or None)."""
    tri = torch.ones(nq, nk, dtype=torch.bool).tril()
    if kind == "none":
        return None, None, None
    if kind == "causal":
        return masks.causal(), tri, None
    if kind == "causal_br":
        br = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
        return masks.causal("bottom_right"), br, None
    if kind == "bool":
        allowed = torch.rand(b, 1, nq, nk) > 0.3
        allowed[..., nq // 2, :] = False                           # a fully masked row
        return allowed, allowed, None
    if kind == "float":
        allowed = torch.rand(nq, nk) > 0.3
        bias = torch.randn(nq, nk, dtype=torch.float64)
        return bias.masked_fill(~allowed, -torch.inf), allowed, bias
    if kind == "padding":
        lens = torch.randint(0, nk + 1, (b,))
        lens[0] = nk
        return masks.padding(lens), torch.arange(nk).view(1, 1, 1, -1) < lens.view(-1, 1, 1, 1), \
            None
    if kind == "window":
        i, j = torch.arange(nq).view(-1, 1), torch.arange(nk).view(1, -1)
        return masks.sliding_window(5), (j <= i) & (j > i - 5), None
    if kind == "window_br":
        i, j = torch.arange(nq).view(-1, 1) + (nk - nq), torch.arange(nk).view(1, -1)
        return masks.sliding_window(5, align="bottom_right"), (j <= i) & (j > i - 5), None
    raise AssertionError(kind)


DECODE = (2, 4, 2, 3, 1025, 59, 33)
CASES = [(s, kind) for s in SHAPES for kind in ("none", "causal", "bool")] + [
    (SHAPES[1], "float"), (SHAPES[1], "padding"), (SHAPES[2], "window"),
    (SHAPES[2], "causal_br"), (SHAPES[1], "causal_br"), (SHAPES[4], "padding"),
    # decoding: a few queries over a longer KV cache
    (DECODE, "causal_br"), (DECODE, "padding"), (DECODE, "bool"), (DECODE, "window_br"),
]


@pytest.mark.parametrize("shape,kind", CASES, ids=[f"{s}-{k}" for s, k in CASES])
def test_backend_matches_oracle(backend, shape, kind):
    b, hq, hkv, nq, nk, dk, dv = shape
    q, k, v = qkv(b, hq, hkv, nq, nk, dk, dv)
    m, allowed, bias = _mask_for(kind, b, nq, nk)
    out, lse = run_backend(backend, q, k, v, mask=m, return_lse=True)
    ref, ref_lse, _ = oracle(q, k, v, allowed=allowed, bias=bias)
    assert out.shape == (b, hq, nq, dv) and out.dtype == torch.float64
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)


@pytest.mark.parametrize("nq,nk", [(97, 113), (113, 97), (1, 59), (1025, 1025)])
def test_backend_is_causal_matches_torch_sdpa(backend, nq, nk):
    hq, hkv = (4, 2) if nq < 1025 else (1, 1)
    d = 8 if nq == 1025 else 59
    q, k, v = qkv(1, hq, hkv, nq, nk, d, d)
    out = run_backend(backend, q, k, v, is_causal=True)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("layout", ["transposed", "sliced", "expanded_kv"])
def test_backend_non_contiguous_inputs(backend, layout):
    if layout == "transposed":                  # (B, N, H, D) storage viewed as (B, H, N, D)
        q, k, v = (randn(2, n, 3, 8).transpose(1, 2) for n in (9, 11, 11))
    elif layout == "sliced":                    # every other feature, every other key
        q, k, v = randn(2, 3, 9, 16)[..., ::2], randn(2, 3, 22, 16)[:, :, ::2, ::2], \
            randn(2, 3, 22, 5)[:, :, ::2]
    else:                                       # one K/V head expanded (stride 0)
        q = randn(2, 3, 9, 8)
        k, v = (randn(2, 1, 11, 8).expand(2, 3, 11, 8) for _ in range(2))
    assert not q.is_contiguous() or not k.is_contiguous()
    out = run_backend(backend, q, k, v, is_causal=True)
    ref, _, _ = oracle(q.contiguous(), k.contiguous(), v.contiguous(),
                       allowed=torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril())
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("opt", ["softcap", "alibi", "scale", "float_bias"])
def test_backend_options_match_oracle(backend, opt):
    q, k, v = qkv(2, 4, 2, 33, 47, 16, 8)
    q = q * 3
    kw: dict = {}
    okw: dict = {"allowed": torch.ones(33, 47, dtype=torch.bool).tril()}
    if opt == "softcap":
        kw["softcap"] = okw["softcap"] = 1.5
    elif opt == "alibi":
        kw["score_mod"] = okw["score_mod"] = alibi(4)
    elif opt == "scale":
        kw["scale"] = okw["scale"] = 0.05
    else:
        bias = randn(4, 33, 47)
        kw["mask"] = bias.masked_fill(~okw["allowed"], -torch.inf)
        okw["bias"] = bias
    if "mask" not in kw:
        kw["is_causal"] = True
    out, lse = run_backend(backend, q, k, v, return_lse=True, **kw)
    ref, ref_lse, _ = oracle(q, k, v, **okw)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)


@pytest.mark.parametrize("build", [
    lambda n, b: masks.causal() & masks.padding(torch.tensor([n, n - 3])),
    lambda n, b: masks.sliding_window(4, causal=False) | masks.prefix_lm(3),
    lambda n, b: ~masks.causal(),
    lambda n, b: masks.document(torch.tensor([0] * 5 + [1] * (n - 9) + [2] * 4)) & masks.causal(),
    lambda n, b: masks.from_fn(lambda b_, h, qi, ki: (qi + ki + h) % 3 != 0),
], ids=["causal&padding", "window|prefix", "~causal", "document&causal", "from_fn_heads"])
def test_backend_mask_objects_match_dense(backend, build):
    n = 37
    q, k, v = qkv(2, 4, 2, n, n, 8, 8)
    m = build(n, 2)
    dense = m.to_dense(n, n, batch=2, heads=4)
    out, lse = run_backend(backend, q, k, v, mask=m, return_lse=True)
    ref, ref_lse, _ = oracle(q, k, v, allowed=dense)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)


def test_backend_document_mask_cross_attention(backend):
    q, k, v = qkv(2, 2, 2, 6, 9, 8, 8)
    q_ids = torch.tensor([[0, 0, 1, 1, 2, 2], [0, 1, 1, 1, 1, 3]])
    kv_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 1, 1, 1, 1, 1]])
    out = run_backend(backend, q, k, v, mask=masks.document(q_ids, kv_ids))
    allowed = (q_ids[:, :, None] == kv_ids[:, None, :])[:, None]
    torch.testing.assert_close(out, oracle(q, k, v, allowed=allowed)[0], **TOL)
    assert (out[1, :, [0, 5]] == 0).all()             # documents 0 and 3 have no keys


def test_backend_fully_masked_rows_zero_output_and_grads(backend):
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 2, 5, 6, 8, 8))
    allowed = torch.ones(5, 6, dtype=torch.bool)
    allowed[1] = False
    allowed[3, 2:] = False
    skip_unless_supported(backend, q, k, v, mask=allowed)
    out, lse = ak.attention(q, k, v, mask=allowed, backend=backend, return_lse=True)
    assert (out[:, :, 1] == 0).all() and torch.isneginf(lse[:, :, 1]).all()
    assert torch.isfinite(out).all() and torch.isfinite(lse[:, :, [0, 2, 3, 4]]).all()
    (out.sum() + lse[:, :, [0, 2, 3, 4]].sum()).backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[:, :, 1] == 0).all()
    assert (k.grad[:, :, 2:].abs().sum() > 0)


@pytest.mark.parametrize("bad", [torch.nan, torch.inf, -torch.inf])
def test_backend_non_finite_in_masked_kv_never_reaches_output(backend, bad):
    q, k, v = qkv(2, 2, 1, 7, 10, 8, 8)
    lens = torch.tensor([10, 6])
    k2, v2 = k.clone(), v.clone()
    k2[1, :, 6:] = bad
    v2[1, :, 8:] = bad
    m = masks.padding(lens)
    clean = run_backend(backend, q, k, v, mask=m)
    out = ak.attention(q, k2, v2, mask=m, backend=backend)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, clean, **TOL)
    # with autograd: gradients stay finite and the bad rows get zero gradient
    q3, k3, v3 = (t.clone().requires_grad_() for t in (q, k2, v2))
    skip_unless_supported(backend, q3, k3, v3, mask=m)     # (forward-only backends stop here)
    out3 = ak.attention(q3, k3, v3, mask=m, backend=backend)
    torch.testing.assert_close(out3, clean, **TOL)
    out3.sum().backward()
    for t in (q3, k3, v3):
        assert torch.isfinite(t.grad).all()
    assert (k3.grad[1, :, 6:] == 0).all() and (v3.grad[1, :, 6:] == 0).all()


def test_backend_query_attending_a_nan_key_gets_nan(backend):
    q, k, v = qkv(1, 1, 1, 4, 4, 8, 8)
    v = v.clone()
    v[0, 0, 2] = torch.nan                      # causal: queries 2 and 3 see key 2
    out, lse = run_backend(backend, q, k, v, is_causal=True, return_lse=True)
    assert torch.isfinite(out[0, 0, :2]).all()
    assert torch.isnan(out[0, 0, 2:]).all()
    clean = v.clone()
    clean[0, 0, 2] = 0
    torch.testing.assert_close(out[0, 0, :2], ak.attention(q, k, clean, is_causal=True)[0, 0, :2],
                               **TOL)
    assert torch.isfinite(lse[0, 0, :2]).all()


def test_backend_empty_sequences(backend):
    q, k, v = qkv(1, 2, 2, 0, 5, 8, 4)
    out = run_backend(backend, q, k, v)
    assert out.shape == (1, 2, 0, 4)
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 2, 3, 0, 8, 4))
    out, lse = ak.attention(q, k, v, backend=backend, return_lse=True)
    assert out.shape == (1, 2, 3, 4) and (out == 0).all() and torch.isneginf(lse).all()
    out.sum().backward()
    assert (q.grad == 0).all()


# ============================================================================ gradients
GRAD_CASES = {
    "causal": {"is_causal": True},
    "bool_with_empty_row": {"mask": torch.tensor([[1, 0, 1, 1, 0], [0, 0, 0, 0, 0],
                                                  [1, 1, 1, 0, 0], [0, 0, 0, 0, 1]],
                                                 dtype=torch.bool)},
    "softcap": {"softcap": 0.8, "is_causal": True},
    "alibi": {"score_mod": alibi(2), "mask": masks.sliding_window(2, causal=False)},
    "padding": {"mask": masks.padding(torch.tensor([5, 2]), q_lengths=torch.tensor([4, 3]))},
}


@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_backend_gradcheck_float64(backend, case):
    opts = GRAD_CASES[case]
    q, k, v = (t.requires_grad_() for t in qkv(2, 2, 1, 4, 5, 3, 2))
    q.data *= 2
    skip_unless_supported(backend, q, k, v, **opts)

    def f(q, k, v):
        out, lse = ak.attention(q, k, v, backend=backend, return_lse=True, **opts)
        return out, torch.where(torch.isfinite(lse), lse, 0.0)

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-7, fast_mode=True)


def test_backend_gradcheck_float_mask_bias(backend):
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 2, 3, 4, 3, 2))
    bias = randn(2, 3, 4).requires_grad_()
    skip_unless_supported(backend, q, k, v, mask=bias)
    assert torch.autograd.gradcheck(
        lambda q, k, v, b: ak.attention(q, k, v, mask=b, backend=backend), (q, k, v, bias),
        eps=1e-6, atol=1e-7, fast_mode=True)


@pytest.mark.parametrize("through", ["out", "out_and_lse"])
@pytest.mark.parametrize("kind", ["causal", "bool"])
def test_backend_gradients_match_oracle(backend, kind, through):
    b, hq, hkv, nq, nk, dk, dv = 2, 4, 2, 33, 41, 16, 12
    q, k, v = (t.requires_grad_() for t in qkv(b, hq, hkv, nq, nk, dk, dv))
    m, allowed, _ = _mask_for(kind, b, nq, nk)
    skip_unless_supported(backend, q, k, v, mask=m)
    out, lse = ak.attention(q, k, v, mask=m, backend=backend, return_lse=True)
    ref, ref_lse, _ = oracle(q, k, v, allowed=allowed)
    go = randn(*out.shape)
    loss, loss_ref = (out * go).sum(), (ref * go).sum()
    if through == "out_and_lse":
        if not lse.requires_grad:
            pytest.skip(f"backend {backend!r} returns a non-differentiable LSE")
        fin = torch.isfinite(ref_lse)
        gl = randn(*lse.shape) * fin
        loss = loss + (torch.where(fin, lse, 0) * gl).sum()
        loss_ref = loss_ref + (torch.where(fin, ref_lse, 0) * gl).sum()
    g = torch.autograd.grad(loss, (q, k, v))
    g_ref = torch.autograd.grad(loss_ref, (q, k, v))
    for a, r in zip(g, g_ref, strict=True):
        torch.testing.assert_close(a, r, **TOL)


def test_reference_lse_is_differentiable():
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 2, 4, 5, 3, 2))
    assert torch.autograd.gradcheck(
        lambda q, k, v: ak.attention(q, k, v, backend="reference", return_lse=True)[1],
        (q, k, v), eps=1e-6, atol=1e-7, fast_mode=True)


# ============================================================================ low precision
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["none", "causal", "bool"])
def test_backend_low_precision_within_twice_naive_error(backend, dtype, kind):
    b, hq, hkv, nq, nk, dk, dv = 1, 2, 1, 97, 61, 59, 24
    q64, k64, v64 = qkv(b, hq, hkv, nq, nk, dk, dv)
    q, k, v = (t.to(dtype).requires_grad_() for t in (q64, k64, v64))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    m, allowed, _ = _mask_for(kind, b, nq, nk)
    skip_unless_supported(backend, q, k, v, mask=m)
    out = ak.attention(q, k, v, mask=m, backend=backend)
    assert out.dtype == dtype
    ref64, _, _ = oracle(q64, k64, v64, allowed=allowed)
    q_l, k_l, v_l = (t.detach().requires_grad_() for t in (q, k, v))
    lowp = naive_low_precision(q_l, k_l, v_l, allowed=allowed)
    assert_low_precision_close(out, lowp, ref64, factor=2.0)
    go = randn(*out.shape).to(dtype)
    g = torch.autograd.grad(out, (q, k, v), go)
    g64 = torch.autograd.grad(ref64, (q64, k64, v64), go.double())
    g_lowp = torch.autograd.grad(lowp, (q_l, k_l, v_l), go)
    for name, a, lp, r in zip("qkv", g, g_lowp, g64, strict=True):
        assert_low_precision_grad_close(a, lp, r, what=f"d{name}")


def test_low_precision_rule_catches_a_bad_result():
    """The helper itself must fail for an output rounded much more coarsely."""
    q, k, v = qkv(1, 2, 2, 17, 19, 8, 8)
    ref64 = oracle(q, k, v)[0]
    lowp = naive_low_precision(*(t.half() for t in (q, k, v)))
    bad = (ref64 * 16).round() / 16
    with pytest.raises(AssertionError):
        assert_low_precision_close(bad.half(), lowp, ref64)
    assert max_err(lowp, ref64) > 0


def test_low_precision_floor_is_a_few_float32_roundings_at_the_answers_scale():
    """The floor added to the ratio: 8 (output) / 16 (gradient) float32 roundings at the
    reference's largest magnitude — a float32 answer that is otherwise exact may carry that
    much, one off by more fails, whatever the naive reference's luck."""
    ref64 = torch.full((3, 5), 2.0, dtype=torch.float64)
    exact = ref64.float()                                     # the naive reference: no error
    eps = torch.finfo(torch.float32).eps
    within = (ref64 + 7 * eps * 2.0).float()                  # 7 roundings at magnitude 2
    assert_low_precision_close(within, exact, ref64)
    beyond = (ref64 + 12 * eps * 2.0).float()
    with pytest.raises(AssertionError, match="8 roundings"):
        assert_low_precision_close(beyond, exact, ref64)
    assert_low_precision_grad_close(beyond, exact, ref64, what="dq")
    with pytest.raises(AssertionError, match="dq"):
        assert_low_precision_grad_close((ref64 + 20 * eps * 2.0).float(), exact, ref64,
                                        what="dq")
    # a cancellation (exact answer 0) is judged at the scale of the terms it cancels
    zero = torch.zeros(3, 5, dtype=torch.float64)
    noise = torch.full((3, 5), 12 * eps * 3.0)
    with pytest.raises(AssertionError):
        assert_low_precision_grad_close(noise, zero.float(), zero, what="dq")
    assert_low_precision_grad_close(noise, zero.float(), zero, what="dq", magnitude=3.0)
    # for bfloat16 the floor is float32's plus half a bfloat16 rounding: a coarse result fails
    bad = (ref64 * 16).round() / 16 + 0.05
    with pytest.raises(AssertionError):
        assert_low_precision_close(bad.bfloat16(), ref64.bfloat16(), ref64)


def test_read_only_numpy_arrays_work_without_warnings(recwarn):
    a = np.frombuffer((np.arange(12, dtype=np.float64) / 10).tobytes()).reshape(3, 4)
    assert not a.flags.writeable
    m = np.broadcast_to(np.array([True, True, False]), (3, 3))
    out = ak.attention(a, a, a, mask=m)
    ref = oracle(*(torch.tensor(a) for _ in range(3)), allowed=torch.tensor(m))[0].numpy()
    np.testing.assert_allclose(out, ref, rtol=1e-12)
    assert not [w for w in recwarn if "not writable" in str(w.message)]


# ============================================================================ backend registry
def test_registry_priority_and_auto_selection():
    from attnkit.backends import PRIORITY, REGISTRY, names, register, select

    assert "reference" in names() and PRIORITY[-1] == "reference"
    saved_reg, saved_pri = dict(REGISTRY), list(PRIORITY)

    class Picky(ak.backends.Backend):
        def __init__(self, name: str, max_n: int) -> None:
            self.name, self.max_n = name, max_n

        def not_supported_reasons(self, p):  # noqa: ANN001, ANN201
            return [] if p.n_k <= self.max_n else [f"N_k={p.n_k} > {self.max_n}"]

        def forward(self, p):  # noqa: ANN001, ANN201
            return REGISTRY["reference"].forward(p)

    try:
        register(Picky("test_small", 4))                      # default: just before reference
        register(Picky("test_first", 2), before="test_small")
        assert PRIORITY.index("test_first") < PRIORITY.index("test_small") \
            < PRIORITY.index("reference")
        for n in list(PRIORITY):                              # only ours ahead of reference
            if n not in ("test_first", "test_small", "reference"):
                PRIORITY.remove(n)
        q = randn(3, 4)
        assert select(prepare(q, randn(2, 4), randn(2, 4)).problem).name == "test_first"
        assert select(prepare(q, randn(4, 4), randn(4, 4)).problem).name == "test_small"
        assert select(prepare(q, randn(9, 4), randn(9, 4)).problem).name == "reference"
        with pytest.raises(ValueError, match=r"'test_small' cannot run.*N_k=9 > 4"):
            ak.attention(q, randn(9, 4), randn(9, 4), backend="test_small")
        register(Picky("test_small", 6))                      # re-register replaces
        assert PRIORITY.count("test_small") == 1 and REGISTRY["test_small"].max_n == 6
    finally:
        REGISTRY.clear()
        REGISTRY.update(saved_reg)
        PRIORITY[:] = saved_pri


def test_problem_properties():
    p = prepare(randn(2, 3, 6, 5, 8), randn(2, 3, 2, 7, 8), randn(2, 3, 2, 7, 4),
                is_causal=True).problem
    assert (p.batch, p.heads_q, p.heads_kv, p.group) == (6, 6, 2, 3)
    assert (p.n_q, p.n_k, p.d_k, p.d_v) == (5, 7, 8, 4)
    assert p.dtype == torch.float64 and p.device.type == "cpu" and not p.requires_grad
    d = p.allowed_dense()
    assert d.shape == (1, 1, 5, 7) and torch.equal(d[0, 0], torch.ones(5, 7).tril().bool())
    assert prepare(randn(3, 4), randn(3, 4), randn(3, 4)).problem.allowed_dense() is None


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_backend_output_and_lse_dtypes(backend, dtype):
    q, k, v = (t.to(dtype) for t in qkv(1, 2, 1, 5, 7, 8, 3))
    out, lse = run_backend(backend, q, k, v, is_causal=True, return_lse=True)
    assert out.dtype == dtype and out.shape == (1, 2, 5, 3)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert lse.shape == (1, 2, 5)


# ============================================================== K/V batch broadcast (issue 13)
def _kv_batch_masks(b: int, nq: int, nk: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(7)
    return {
        "none": None,
        "padding": masks.padding([nk, 3, nk - 5][:b], q_lengths=[nq, nq - 1, 2][:b]),
        "causal_br": masks.causal("bottom_right"),
        "document": masks.document(torch.randint(0, 2, (b, nq), generator=g).sort(1).values,
                                   torch.randint(0, 2, (b, nk), generator=g).sort(1).values),
        "bool": torch.rand(b, 1, nq, nk, generator=g) > 0.4,
    }


@pytest.mark.parametrize("kind", ["none", "padding", "causal_br", "document", "bool"])
@pytest.mark.parametrize("nq", [4, 37])
def test_backend_kv_batch_one_broadcasts_like_an_explicit_repeat(backend, kind, nq):
    b, nk = 3, 41
    q = randn(b, 4, nq, 16)
    k1, v1 = randn(1, 2, nk, 16), randn(1, 2, nk, 8)
    m = _kv_batch_masks(b, nq, nk)[kind]
    ref = ak.attention(q, k1.repeat(b, 1, 1, 1), v1.repeat(b, 1, 1, 1), mask=m,
                       backend="reference")
    out = run_backend(backend, q, k1, v1, mask=m)
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("kind", ["padding", "bool"])
def test_backend_kv_batch_one_gradients(backend, kind):
    b, nq, nk = 3, 9, 13
    q = randn(b, 2, nq, 8).requires_grad_()
    k1, v1 = randn(1, 1, nk, 8).requires_grad_(), randn(1, 1, nk, 8).requires_grad_()
    m = _kv_batch_masks(b, nq, nk)[kind]
    out = run_backend(backend, q, k1, v1, mask=m)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k1, v1), g)
    ref = ak.attention(q, k1.expand(b, -1, -1, -1).clone(), v1.expand(b, -1, -1, -1).clone(),
                       mask=m, backend="reference")
    want = torch.autograd.grad(ref, (q, k1, v1), g)
    assert got[1].shape == k1.shape
    for a, w in zip(got, want, strict=True):
        torch.testing.assert_close(a, w, **TOL)


def test_kv_batch_broadcast_over_several_leading_dims():
    q = randn(2, 3, 2, 5, 8)
    k, v = randn(1, 1, 2, 6, 8), randn(1, 3, 2, 6, 8)          # fully / partly broadcast
    ref = ak.attention(q, k.expand(2, 3, -1, -1, -1), v.expand(2, 3, -1, -1, -1))
    torch.testing.assert_close(ak.attention(q, k, v), ref, **TOL)


def test_query_batch_one_against_larger_kv_batch_is_refused():
    with pytest.raises(ValueError, match=r"leading \(batch\) dims.*q \(1, 2, 5, 8\)"):
        ak.attention(randn(1, 2, 5, 8), randn(3, 2, 6, 8), randn(3, 2, 6, 8))


@pytest.mark.parametrize("kind", ["none", "padding", "causal_br"])
def test_backend_kv_batch_one_is_never_materialised_per_batch(backend, kind):
    # K/V reach the backend as a stride-0 view, and the forward allocates nothing of the
    # size of K repeated over the batch (the reference, the readable oracle, may)
    if backend == "reference":
        pytest.skip("the reference materialises by design")
    b, nq, nk, d = 3, 4, 512, 32
    q = randn(b, 4, nq, d, dtype=torch.float32)
    k1, v1 = randn(1, 2, nk, d, dtype=torch.float32), randn(1, 2, nk, d, dtype=torch.float32)
    m = _kv_batch_masks(b, nq, nk)[kind]
    skip_unless_supported(backend, q, k1, v1, mask=m)
    seen = []
    with pytest.MonkeyPatch.context() as mp:
        spy_on_backend(mp, ak.backends.get(backend), lambda p: seen.append(
            (p.k.shape[0], p.k.stride(0), p.k.data_ptr() == k1.data_ptr())))
        with OpOutputs(big=b * k1.numel()) as mode:
            ak.attention(q, k1, v1, mask=m, backend=backend)
    assert seen == [(b, 0, True)]
    assert mode.hits == []


def test_return_types_follow_the_input_kind():
    """The overloads say Tensor for tensor inputs and ndarray for NumPy inputs."""
    import typing

    import numpy as np

    from attnkit import api

    hints = [typing.get_type_hints(f, globalns=vars(api)) for f in
             typing.get_overloads(api.attention)]
    returns = {(h["q"], h["return_lse"]): h["return"] for h in hints}
    assert returns[(torch.Tensor, typing.Literal[False])] is torch.Tensor
    assert returns[(torch.Tensor, typing.Literal[True])] == tuple[torch.Tensor, torch.Tensor]
    assert returns[(np.ndarray, typing.Literal[False])] is np.ndarray
    assert returns[(np.ndarray, typing.Literal[True])] == tuple[np.ndarray, np.ndarray]
