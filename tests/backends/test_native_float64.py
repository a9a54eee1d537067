"""The native kernel on float64 inputs: computed in float64, forward, backward and decode.

float64 inputs run the kernel's double instantiation (double buffers, exp / tanh from the C
library, loop GEMMs), so the kernel must agree with the float64 oracle to float64 rounding
(``TOL``) — outputs, LSE (float64 too) and gradients, the score terms' included — and
``torch.autograd.gradcheck`` must pass on the kernel itself. The ``tiled`` / ``decode``
tests here read ``tiled.counting()``: ``native`` counts the kernel's calls and ``runs`` the
Python engine's planned runs, so they prove which engine ran.

Shape legend: q (B, H_q, N_q, D_k), k (B, H_kv, N_k, D_k), v (B, H_kv, N_k, D_v);
allowed (B|1, H_q|1, N_q, N_k); rel table T (H_q, 2M + 1).
"""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from attnkit.backends import native, tiled
from attnkit.scores import relative_bias
from helpers.oracle import oracle

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernel unavailable: "
                                                               f"{native.why_unavailable()}")
F64 = torch.float64
TOL = {"atol": 1e-12, "rtol": 1e-10}


def qkv(B: int, hq: int, hkv: int, nq: int, nk: int, d: int, dv: int,
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.randn(B, hq, nq, d, dtype=F64), torch.randn(B, hkv, nk, d, dtype=F64),
            torch.randn(B, hkv, nk, dv, dtype=F64))


def alibi_mod(slopes: torch.Tensor, offset: int):  # noqa: ANN201
    def mod(s, b, h, qi, ki):  # noqa: ANN001, ANN202
        return s - slopes[h] * (qi + offset - ki).abs().to(s.dtype)
    return mod


def case(name: str, B: int, hq: int, nq: int, nk: int,
         ) -> tuple[dict[str, object], torch.Tensor | None, dict[str, object]]:
    """``(native options, allowed (B|1, H_q|1, N_q, N_k) or None, oracle options)``."""
    i, j = torch.arange(nq)[:, None], torch.arange(nk)[None, :]          # (N_q, 1), (1, N_k)
    if name == "plain":
        return {}, None, {}
    if name == "causal_bottom_right":
        return {"band": (-(nk - nq), math.inf)}, (i - j >= -(nk - nq)), {}
    if name == "window_softcap":
        return ({"band": (-3.0, 20.0), "softcap": 0.7}, (i - j >= -3) & (i - j <= 20),
                {"softcap": 0.7})
    if name == "softcap_huge":                          # c·tanh(x/c) ≈ x: no cancellation
        return {"softcap": 1e7}, None, {"softcap": 1e7}
    if name == "alibi":
        slopes = torch.rand(hq, dtype=F64)
        return ({"alibi_slopes": slopes, "alibi_offset": 3}, None,
                {"score_mod": alibi_mod(slopes, 3)})
    if name == "rel_table":
        t = torch.randn(hq, 2 * 9 + 1, dtype=F64)
        return {"rel_table": t, "rel_max_distance": 9}, None, {"score_mod": relative_bias(t, 9)}
    if name == "bias":
        bias = torch.randn(hq, nq, nk, dtype=F64)
        return {"bias": bias}, None, {"bias": bias}
    if name == "padding_empty_rows":                    # batch 1: rows >= 2 see no key
        kv, ql = torch.tensor([nk - 5, 3])[:B], torch.tensor([nq, 2])[:B]
        allowed = (j < kv.view(-1, 1, 1, 1)) & (i < ql.view(-1, 1, 1, 1))
        return {"kv_lengths": kv, "q_lengths": ql}, allowed, {}
    if name == "documents":
        qd = (torch.arange(nq) * 3 // nq).expand(B, nq)
        kd = (torch.arange(nk) * 3 // nk).expand(B, nk)
        return ({"doc_ids": qd, "kv_doc_ids": kd}, (qd[:, None, :, None] == kd[:, None, None, :]),
                {})
    if name == "dense_mask_empty_row":
        allowed = torch.rand(B, 1, nq, nk) > 0.3
        allowed[:, :, 1] = False
        return {"dense_mask": allowed}, allowed, {}
    if name == "key_splits":
        return {"splits": 3}, None, {}
    raise AssertionError(name)


CASES = ["plain", "causal_bottom_right", "window_softcap", "softcap_huge", "alibi", "rel_table",
         "bias", "padding_empty_rows", "documents", "dense_mask_empty_row", "key_splits"]


# ---------------------------------------------------------------------------- forward
@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("nq", [37, 3], ids=["forward", "decode"])
def test_float64_forward_matches_the_oracle_to_rounding(name: str, nq: int) -> None:
    """GQA, N_q != N_k, a key tile edge (N_k = 161 > 128), D_v != D_k; out and LSE float64."""
    B, hq, hkv, nk = 2, 4, 2, 161
    q, k, v = qkv(B, hq, hkv, nq, nk, 24, 16)
    opts, allowed, oo = case(name, B, hq, nq, nk)
    ref, lse_ref, _ = oracle(q, k, v, allowed=allowed, **oo)
    run = native.decode if nq <= native.DECODE_MAX_QUERIES else native.forward
    out, lse = run(q, k, v, **opts)
    assert out.dtype == F64 and lse.dtype == F64
    torch.testing.assert_close(out, ref, **TOL)
    empty = lse_ref == -math.inf
    assert torch.equal(lse == -math.inf, empty) and (out[empty] == 0).all()
    torch.testing.assert_close(lse[~empty], lse_ref[~empty], **TOL)


def test_float64_nan_in_masked_kv_stays_out() -> None:
    q, k, v = qkv(1, 2, 1, 40, 150, 16, 16)
    kn, vn = k.clone(), v.clone()
    kn[:, :, 140:], vn[:, :, 140:] = math.nan, math.inf       # padded away below
    out, lse = native.forward(q, kn, vn, kv_lengths=[140])
    ref, lse_ref, _ = oracle(q, k[:, :, :140], v[:, :, :140])
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(lse, lse_ref, **TOL)


# ---------------------------------------------------------------------------- backward
@pytest.mark.parametrize("name", CASES)
def test_float64_gradients_match_the_oracle_to_rounding(name: str) -> None:
    """dq, dk, dv (and d table, d slopes) through out and LSE, in float64."""
    B, hq, hkv, nq, nk = 2, 4, 2, 37, 161
    q, k, v = qkv(B, hq, hkv, nq, nk, 24, 16)
    opts, allowed, oo = case(name, B, hq, nq, nk)
    dout, dlse = torch.randn(B, hq, nq, 16, dtype=F64), torch.randn(B, hq, nq, dtype=F64)
    extra = [x for x in (opts.get("alibi_slopes"), opts.get("rel_table")) if x is not None]

    def loss(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        return (out * dout).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * dlse).sum()

    def learned(xs: list[torch.Tensor]) -> tuple[dict[str, object], dict[str, object]]:
        """Native options and oracle options with the slopes / table taken from xs[3]."""
        if "alibi_slopes" in opts:
            return {**opts, "alibi_slopes": xs[3]}, {"score_mod": alibi_mod(xs[3], 3)}
        if "rel_table" in opts:
            return {**opts, "rel_table": xs[3]}, {"score_mod": relative_bias(xs[3], 9)}
        return opts, oo

    leaves = [x.clone().requires_grad_() for x in (q, k, v, *extra)]
    got = torch.autograd.grad(loss(*native.forward(*leaves[:3], **learned(leaves)[0])), leaves)
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v, *extra)]
    ref_out, ref_lse, _ = oracle(*ref_leaves[:3], allowed=allowed, **learned(ref_leaves)[1])
    want = torch.autograd.grad(loss(ref_out, ref_lse), ref_leaves)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == F64
        torch.testing.assert_close(g, w, atol=1e-11, rtol=1e-9)


GRAD_CASES = ["causal_bottom_right", "window_softcap", "alibi", "rel_table", "bias",
              "padding_empty_rows", "documents", "dense_mask_empty_row"]


@pytest.mark.parametrize("name", GRAD_CASES)
def test_gradcheck_float64_on_the_kernel(name: str) -> None:
    """gradcheck of native.forward itself (out and LSE), to the slopes / table too; GQA and
    N_k = 131 (two key tiles)."""
    B, hq, hkv, nq, nk = 2, 2, 1, 5, 131
    q, k, v = (x.requires_grad_() for x in qkv(B, hq, hkv, nq, nk, 3, 2))
    opts, _, _ = case(name, B, hq, nq, nk)
    learn = [key for key in ("alibi_slopes", "rel_table") if key in opts]
    extra = [opts.pop(key).requires_grad_() for key in learn]

    def f(q, k, v, *terms):  # noqa: ANN001, ANN202
        out, lse = native.forward(q, k, v, **opts, **dict(zip(learn, terms, strict=True)))
        assert type(out.grad_fn).__name__ == "_NativeAttentionBackward"
        return out, torch.where(torch.isfinite(lse), lse, 0.0)

    assert torch.autograd.gradcheck(f, (q, k, v, *extra), eps=1e-6, atol=1e-7)


# ------------------------------------------------------------------ through tiled / decode
@pytest.mark.parametrize("opts", [
    {"is_causal": True, "softcap": 0.8},
    {"score_mod": ak.scores.alibi(2), "mask": ak.masks.sliding_window(2, causal=False)},
    {"mask": ak.masks.padding(torch.tensor([5, 2]), q_lengths=torch.tensor([4, 3]))},
], ids=["causal_softcap", "alibi_window", "padding"])
def test_tiled_gradcheck_float64_runs_on_the_kernel(opts: dict[str, object]) -> None:
    q, k, v = (x.requires_grad_() for x in qkv(2, 2, 1, 4, 5, 3, 2))

    def f(q, k, v):  # noqa: ANN001, ANN202
        out, lse = ak.attention(q, k, v, backend="tiled", return_lse=True, **opts)
        return out, torch.where(torch.isfinite(lse), lse, 0.0)

    with tiled.counting() as stats:
        assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-7)
    assert stats["native"] > 0 and stats["runs"] == 0


def test_tiled_relative_bias_table_gradcheck_float64_runs_on_the_kernel() -> None:
    q, k, v = (x.requires_grad_() for x in qkv(1, 2, 2, 6, 9, 4, 3))
    t = torch.randn(2, 2 * 3 + 1, dtype=F64, requires_grad=True)

    def f(q, k, v, t):  # noqa: ANN001, ANN202
        return ak.attention(q, k, v, score_mod=relative_bias(t, 3), is_causal=True,
                            backend="tiled")

    with tiled.counting() as stats:
        assert torch.autograd.gradcheck(f, (q, k, v, t), eps=1e-6, atol=1e-7)
    assert stats["native"] > 0 and stats["runs"] == 0


def test_decode_float64_runs_on_the_kernel() -> None:
    q, k, v = qkv(1, 8, 2, 2, 3000, 64, 64)
    with tiled.counting() as stats:
        out, lse = ak.attention(q, k, v, backend="decode", return_lse=True)
    assert stats["native"] == 1 and out.dtype == F64 and lse.dtype == F64
    ref, lse_ref, _ = oracle(q, k, v)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(lse, lse_ref, **TOL)


def test_huge_logits_keep_finite_gradients() -> None:
    # lse = m + log l rounds at m's magnitude, so x - lse can come out above 0: P is capped
    # at 1 in the backward (it was e^(a few ulps of 1e19) = inf, then NaN in dq / dk)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 7, 8, generator=g, dtype=F64, requires_grad=True)
               for _ in range(3))
    with tiled.counting() as n:
        out = ak.attention(q, k, v, scale=1e18, backend="tiled")
    assert n["native"] == 1
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(t).all() for t in grads)
    assert grads[2].abs().max() <= 7                          # at most all 7 queries' weight
