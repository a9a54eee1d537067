"""The decode engine (few queries over a long K/V) against the float64 reference."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from attnkit import backends
from attnkit.api import prepare
from attnkit.backends import decode, native, tiled
from helpers.oracle import naive_low_precision
from helpers.recorders import OpOutputs, floating
from helpers.tolerance import assert_low_precision_close

M = ak.masks
F64 = torch.float64


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decode, "_CHUNK", 16)          # many chunks + a ragged tail


def _inputs(b, hq, hkv, nq, nk, dk, dv, dtype=F64):  # noqa: ANN001, ANN202
    return (torch.randn(b, hq, nq, dk, dtype=dtype), torch.randn(b, hkv, nk, dk, dtype=dtype),
            torch.randn(b, hkv, nk, dv, dtype=dtype))


def check(q, k, v, **kw):  # noqa: ANN001, ANN201
    out, lse = ak.attention(q, k, v, backend="decode", return_lse=True, **kw)
    ref, ref_lse = ak.attention(q, k, v, backend="reference", return_lse=True, **kw)
    assert torch.isfinite(out).all()
    assert torch.equal(lse == -math.inf, ref_lse == -math.inf)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=1e-10)
    return out, lse


@pytest.mark.parametrize("nq", [1, 3, 16])
@pytest.mark.parametrize("nk", [1, 15, 97, 1025])
def test_lengths_and_chunk_edges(nq, nk):
    check(*_inputs(2, 4, 2, nq, nk, 8, 8), mask=M.causal(align="bottom_right"))


@pytest.mark.parametrize("dk,dv", [(8, 8), (59, 111), (111, 8)])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (8, 1)])
def test_widths_and_gqa(dk, dv, hq, hkv):
    check(*_inputs(1, hq, hkv, 2, 113, dk, dv))


@pytest.mark.parametrize("mask", [
    M.causal(align="bottom_right"),
    M.sliding_window(20, align="bottom_right"),
    M.padding([50, 0]),                       # batch 1 sees nothing: zeros and lse −∞
    M.document(torch.zeros(4, dtype=torch.long), kv_ids=torch.arange(100) // 60),
    M.from_fn(lambda b, h, qi, ki: ki % 3 == 0),
], ids=["causal_br", "sliding_br", "padding", "document", "from_fn"])
def test_masks(mask):
    q, k, v = _inputs(2, 4, 2, 4, 100, 16, 16)
    out, lse = check(q, k, v, mask=mask)
    if "padding" in mask.name:
        assert (out[1] == 0).all() and (lse[1] == -math.inf).all()


def test_float_mask_bool_tensor_softcap_and_score_mod():
    q, k, v = _inputs(2, 4, 2, 5, 77, 16, 16)
    fm = torch.randn(2, 1, 5, 77, dtype=F64)
    fm[torch.rand(2, 1, 5, 77) > 0.7] = -math.inf
    check(q, k, v, mask=fm)
    check(q, k, v, mask=torch.rand(4, 5, 77) > 0.5)
    check(q, k, v, softcap=2.0, score_mod=ak.scores.alibi(4), mask=M.causal(align="bottom_right"))


def test_non_contiguous_and_nan_in_masked_kv():
    q = torch.randn(1, 3, 4, 16, dtype=F64).transpose(1, 2)      # (1, 4, 3, 16)
    k = torch.randn(1, 60, 2, 16, dtype=F64).transpose(1, 2)
    v = torch.randn(1, 2, 16, 60, dtype=F64).transpose(-1, -2)
    k[:, :, 50:] = float("nan")
    check(q, k, v, mask=M.padding([50]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_within_twice_the_reference_error(dtype):
    q, k, v = (t.to(dtype) for t in _inputs(2, 4, 2, 3, 300, 32, 32))
    exact = ak.attention(q.double(), k.double(), v.double(), backend="reference")
    got = ak.attention(q, k, v, backend="decode")
    low = ak.attention(q, k, v, backend="reference")
    assert got.dtype == dtype
    err = (got.double() - exact).abs().max().item()
    err_ref = (low.double() - exact).abs().max().item()
    assert err <= 2 * err_ref + 1e-6


def test_declines_what_it_cannot_do_and_auto_routes():
    q, k, v = _inputs(1, 2, 2, 1, 64, 8, 8)
    dec = backends.get("decode")
    assert dec.not_supported_reasons(prepare(q, k, v).problem) == []
    assert backends.select(prepare(q, k, v).problem).name == "decode"
    many = prepare(*_inputs(1, 2, 2, 17, 64, 8, 8)).problem
    assert any("16 queries" in r for r in dec.not_supported_reasons(many))
    drop = prepare(q, k, v, dropout_p=0.1).problem
    assert any("dropout" in r for r in dec.not_supported_reasons(drop))
    qg = q.clone().requires_grad_(True)
    train = prepare(qg, k, v).problem
    assert any("forward only" in r for r in dec.not_supported_reasons(train))
    assert backends.select(train).name == "tiled"
    with pytest.raises(ValueError, match="forward only"):
        ak.attention(qg, k, v, backend="decode")


def test_chunk_count():
    assert decode.chunk_count(1) == 1
    assert decode.chunk_count(33) == 2                  # 2 chunks of 16 + a tail of 1
    assert decode.chunk_count(32768, 1024) == 32


# ----------------------------------------------------------------- NaN queries (issue 10: 3, 4)
@pytest.mark.parametrize("opts", [{}, dict(softcap=3.0)], ids=["fused", "matmul"])
def test_nan_query_row_gives_nan_output_and_lse(opts):
    q, k, v = _inputs(1, 4, 2, 3, 100, 16, 16)
    q[0, 1, 2, 5] = math.nan                          # one element of one query row
    out, lse = ak.attention(q, k, v, backend="decode", return_lse=True, **opts)
    ref, ref_lse = ak.attention(q, k, v, backend="reference", return_lse=True, **opts)
    assert torch.isnan(out[0, 1, 2]).all() and torch.isnan(lse[0, 1, 2])
    assert torch.isnan(ref_lse[0, 1, 2])             # the reference: NaN, not −∞ (no key)
    keep = torch.ones_like(lse, dtype=torch.bool)
    keep[0, 1, 2] = False
    torch.testing.assert_close(out[keep], ref[keep], atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(lse[keep], ref_lse[keep], atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("opts", [{}, dict(softcap=3.0)], ids=["fused", "matmul"])
def test_fully_masked_row_is_zero_and_minus_inf_whatever_its_query_holds(opts):
    q, k, v = _inputs(2, 4, 2, 4, 100, 16, 16)
    q[:, :, 2:] = math.nan                           # padded query rows hold garbage
    mask = M.padding([100, 37], q_lengths=[2, 2])
    out, lse = ak.attention(q, k, v, backend="decode", mask=mask, return_lse=True, **opts)
    assert (out[:, :, 2:] == 0).all() and torch.isneginf(lse[:, :, 2:]).all()
    ref = ak.attention(q[:, :, :2], k, v, backend="reference", mask=M.padding([100, 37]),
                       **opts)
    torch.testing.assert_close(out[:, :, :2], ref, atol=1e-12, rtol=1e-10)


def test_bad_mask_functions_get_the_mask_error_not_a_torch_error():
    q, k, v = _inputs(1, 2, 2, 3, 40, 8, 8)
    with pytest.raises(ValueError, match=r"mask_mod wrong cannot be evaluated.*returned shape "
                                         r"\(2, 2\)"):
        ak.attention(q, k, v, backend="decode",
                     mask=M.from_fn(lambda b, h, qi, ki: torch.ones(2, 2, dtype=torch.bool),
                                    name="wrong"))
    with pytest.raises(TypeError, match="mask_mod soft cannot be evaluated.*not torch.bool"):
        ak.attention(q, k, v, backend="decode",
                     mask=M.from_fn(lambda b, h, qi, ki: (qi - ki) * 0.5, name="soft"))


# ------------------------------------------------------------------ the native kernel
needs_native = pytest.mark.skipif(not native.available(),
                                  reason=f"native kernel unavailable: {native.why_unavailable()}")


def _float32(t: torch.Tensor) -> bool:
    """``keep`` for float32 outputs (a cast copy of a half cache shows as one)."""
    return t.dtype == torch.float32


@needs_native
@pytest.mark.parametrize("how", ["default", "env_off", "context_off"])
def test_native_decode_runs_when_available_and_the_switches_turn_it_off(how, monkeypatch):
    q, k, v = _inputs(2, 8, 2, 3, 1025, 16, 16, dtype=torch.float32)
    mask = M.causal(align="bottom_right") & M.padding([1025, 700])
    if how == "env_off":
        monkeypatch.setenv("ATTNKIT_NATIVE", "0")
    off = tiled.use_native(False) if how == "context_off" else tiled.use_native(True)
    with tiled.counting() as stats, off:
        out, lse = ak.attention(q, k, v, mask=mask, softcap=15.0, backend="decode",
                                return_lse=True)
    assert stats["native"] == (how == "default")
    ref, ref_lse = ak.attention(q.double(), k.double(), v.double(), mask=mask, softcap=15.0,
                                backend="reference", return_lse=True)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=2e-5)


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_native_decode_reads_a_half_cache_as_such(dtype):
    q, k, v = _inputs(1, 8, 2, 1, 4096, 64, 64, dtype=dtype)
    with tiled.counting() as stats, OpOutputs(keep=_float32) as rec:
        out = ak.attention(q, k, v, score_mod=ak.scores.alibi(8), backend="decode")
    assert stats["native"] == 1 and out.dtype == dtype
    assert rec.largest < k.numel() // 4                         # no float32 copy of K or V
    with tiled.use_native(False), OpOutputs(keep=_float32) as rec_py:
        ak.attention(q, k, v, backend="decode")
    assert rec_py.largest >= k.numel()                          # the Python engine casts
    ref64 = ak.attention(q.double(), k.double(), v.double(), score_mod=ak.scores.alibi(8),
                         backend="reference")
    lowp = naive_low_precision(q, k, v, score_mod=ak.scores.alibi(8))
    assert_low_precision_close(out, lowp, ref64)


# ------------------------------------------- K/V of batch 1, a larger query batch (issue 13)
@pytest.fixture
def python_decode(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The decode[python] mode (``ATTNKIT_NATIVE=0``); records K's batch stride per call."""
    monkeypatch.setenv("ATTNKIT_NATIVE", "0")
    seen: list[int] = []
    real = decode._decode

    def spy(p):  # noqa: ANN001, ANN202
        seen.append(p.k.stride(0))
        return real(p)

    monkeypatch.setattr(decode, "_decode", spy)
    return seen


def _kv1_mask(kind, b, nq, nk):  # noqa: ANN001, ANN202
    g = torch.Generator().manual_seed(5)
    if kind == "bool":
        allowed = torch.rand(b, 1, nq, nk, generator=g) > 0.5
        allowed[1, :, 0] = False                       # a fully masked row
        return allowed
    if kind == "float":                                # an additive mask, −∞ = blocked
        fm = torch.randn(b, 4, nq, nk, generator=g, dtype=F64)
        return fm.masked_fill(torch.rand(b, 1, nq, nk, generator=g) > 0.6, -math.inf)
    return {"none": None, "causal_br": M.causal(align="bottom_right"),
            "padding": M.padding([nk, 5, 0][:b]),      # batch 2 sees nothing
            "from_fn": M.from_fn(lambda b_, h, qi, ki: (ki + b_) % 3 != 0)}[kind]


_KV1_OPTS = {"fused": {}, "softcap": dict(softcap=2.0),
             "score_mod": dict(score_mod=lambda s, b, h, qi, ki: s - 0.05 * (h + 1) * ki)}


@pytest.mark.parametrize("path", list(_KV1_OPTS))
@pytest.mark.parametrize("kind", ["none", "causal_br", "padding", "bool", "float", "from_fn"])
@pytest.mark.parametrize("hkv", [1, 2])
def test_python_decode_kv_batch_one_matches_the_reference(path, kind, hkv, python_decode):
    b, nq, nk = 3, 3, 97                                  # 6 chunks of 16 + a tail of 1
    q = torch.randn(b, 4, nq, 16, dtype=F64)
    k1, v1 = torch.randn(1, hkv, nk, 16, dtype=F64), torch.randn(1, hkv, nk, 16, dtype=F64)
    mask, opts = _kv1_mask(kind, b, nq, nk), _KV1_OPTS[path]
    out, lse = ak.attention(q, k1, v1, backend="decode", mask=mask, return_lse=True, **opts)
    assert python_decode == [0]                           # the Python engine, stride-0 K/V
    ref, ref_lse = ak.attention(q, k1.repeat(b, 1, 1, 1), v1.repeat(b, 1, 1, 1),
                                backend="reference", mask=mask, return_lse=True, **opts)
    assert torch.equal(lse == -math.inf, ref_lse == -math.inf)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("path", list(_KV1_OPTS))
@pytest.mark.parametrize("kind", ["none", "padding", "bool"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_python_decode_never_copies_kv_per_batch_element(path, kind, dtype, python_decode):
    # 37 chunks of 16 + a tail: the chunk view is not one reshape of the cache. Scores and
    # stacked queries stay below 2·H_kv·N_k·D, so an output that large holds K or V for
    # more than one batch element (old code: matmul's broadcast, the chunk reshape of the
    # stride-0 view, the float32 cast of it)
    b, nq, nk, d = 3, 2, 600, 64
    q = torch.randn(b, 4, nq, d).to(dtype)
    k1, v1 = torch.randn(1, 2, nk, d).to(dtype), torch.randn(1, 2, nk, d).to(dtype)
    mask, opts = _kv1_mask(kind, b, nq, nk), _KV1_OPTS[path]
    with OpOutputs(big=2 * k1.numel(), keep=floating) as rec:
        out = ak.attention(q, k1, v1, backend="decode", mask=mask, **opts)
    assert python_decode == [0]
    assert rec.hits == []
    ref = ak.attention(q.double(), k1.double().repeat(b, 1, 1, 1),
                       v1.double().repeat(b, 1, 1, 1), backend="reference", mask=mask, **opts)
    tol = 5e-3 if dtype == torch.float16 else 2e-5
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
