"""One forward check and one gradient check of the native kernel against the float64 oracle,
shared by test_native.py (every dtype), test_native_lowp.py (the low-precision forward) and
test_native_lowp_backward.py (the low-precision backward)."""

from __future__ import annotations

import math

import torch

from attnkit.backends import native
from helpers.oracle import naive_low_precision, oracle
from helpers.tolerance import assert_low_precision_close, assert_low_precision_grad_close


def check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype = torch.float32,
          *, allowed: torch.Tensor | None = None, oracle_opts: dict | None = None,
          kv: tuple[torch.Tensor, torch.Tensor] | None = None,
          **native_opts: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Run native.forward in ``dtype`` (on K/V ``kv`` when given: the same keys, with NaN
    where ``allowed`` masks them); assert out within DESIGN's budget, rows without keys 0 with
    LSE -inf, and the LSE (float32 for half inputs) close to the oracle's."""
    oo = oracle_opts or {}
    ref, lse_ref, _ = oracle(q, k, v, allowed=allowed, **oo)
    lowp = naive_low_precision(q.to(dtype), k.to(dtype), v.to(dtype), allowed=allowed, **oo)
    kk, vv = kv if kv is not None else (k, v)
    with torch.no_grad():
        out, lse = native.forward(q.to(dtype), kk.to(dtype), vv.to(dtype), **native_opts)
    assert out.dtype == dtype and out.shape == ref.shape and lse.shape == lse_ref.shape
    if dtype in (torch.bfloat16, torch.float16):
        assert lse.dtype == torch.float32, lse.dtype
    assert_low_precision_close(out, lowp, ref)
    empty = lse_ref == -math.inf
    assert torch.equal(lse == -math.inf, empty), "rows without keys must have LSE -inf"
    assert (out[empty] == 0).all(), "rows without keys must give 0"
    tol = 64 * torch.finfo(dtype).eps * (1 + lse_ref[~empty].abs())
    assert ((lse.double()[~empty] - lse_ref[~empty]).abs() <= tol).all()
    return out, lse


def grads_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fn, dout: torch.Tensor,  # noqa: ANN001
             dlse: torch.Tensor) -> list[torch.Tensor]:
    """Gradients of q, k, v of (out * dout).sum() + (lse * dlse).sum() (finite LSE only)
    for (out, lse) = fn(q, k, v)."""
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = fn(qq, kk, vv)
    fin = torch.isfinite(lse.detach())
    loss = (out.double() * dout).sum() + (torch.where(fin, lse.double(), 0.0) * dlse).sum()
    loss.backward()
    return [t.grad for t in (qq, kk, vv)]


def check_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype, *,
                allowed: torch.Tensor | None = None, oracle_opts: dict | None = None,
                kv_nan: torch.Tensor | None = None, **native_opts: object) -> None:
    """Gradients of out and LSE: native in ``dtype`` within 3× the naive ``dtype`` oracle's
    error against the float64 oracle (DESIGN's rule for gradients)."""
    oo = oracle_opts or {}
    dout = torch.randn(*q.shape[:3], v.shape[-1], dtype=torch.float64)
    dlse = torch.randn(*q.shape[:3], dtype=torch.float64)

    def ref(dt: torch.dtype):  # noqa: ANN202
        def fn(a, b, c):  # noqa: ANN001, ANN202
            out, lse, _ = oracle(a, b, c, allowed=allowed, dtype=dt, **oo)
            return out, lse
        return fn

    g64 = grads_of(q, k, v, ref(torch.float64), dout, dlse)
    glow = grads_of(q.to(dtype), k.to(dtype), v.to(dtype), ref(dtype), dout, dlse)
    kn, vn = k, v
    if kv_nan is not None:                                   # NaN where the mask blocks
        kn = torch.where(kv_nan[..., None], math.nan, k)
        vn = torch.where(kv_nan[..., None], math.nan, v)
    gn = grads_of(q.to(dtype), kn.to(dtype), vn.to(dtype),
                lambda a, b, c: native.forward(a, b, c, **native_opts), dout, dlse)
    for name, got, lo, hi in zip("qkv", gn, glow, g64, strict=True):
        if kv_nan is not None and name != "q":
            got = torch.where(kv_nan[..., None], 0.0, got.double())
        assert_low_precision_grad_close(got, lo, hi, what=f"d{name}")


def hardware_lowp_gemm(dtype: torch.dtype) -> bool:
    """Whether this CPU runs ``dtype``'s GEMMs through brgemm (native.low_precision_paths,
    unforced by ``ATTNKIT_NATIVE_LOWP_GEMM``)."""
    name = str(dtype).split(".")[1]
    return native.low_precision_paths()[name].startswith(name + " GEMMs (oneDNN")


#: ATTNKIT_NATIVE_LOWP_GEMM per low-precision path: brgemm (the CPU's), emulated, widening
LOWP_SWITCH = {"gemm": "1", "emulated": "emulate", "widen": "0"}


def use_lowp_path(request, monkeypatch) -> str:  # noqa: ANN001
    """The body of a ``path`` fixture (params gemm / emulated / widen): switch the native
    kernel to that low-precision path for the test, skipping gemm on a CPU without brgemm
    for the test's ``dtype`` parameter (bfloat16 when it has none)."""
    import pytest

    params = getattr(request.node, "callspec", None)
    dtype = params.params.get("dtype", torch.bfloat16) if params else torch.bfloat16
    if request.param == "gemm" and not hardware_lowp_gemm(dtype):
        pytest.skip("no low-precision GEMMs on this CPU: " + str(native.low_precision_paths()))
    monkeypatch.setenv("ATTNKIT_NATIVE_LOWP_GEMM", LOWP_SWITCH[request.param])
    return request.param


def qkv64(B: int, hq: int, hkv: int, nq: int, nk: int, d: int, dv: int | None = None,
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random float64 q (B, hq, nq, d), k (B, hkv, nk, d), v (B, hkv, nk, dv or d)."""
    return (torch.randn(B, hq, nq, d, dtype=torch.float64),
            torch.randn(B, hkv, nk, d, dtype=torch.float64),
            torch.randn(B, hkv, nk, dv or d, dtype=torch.float64))


def masked_rows_grad_case(n_q: int, n_k: int, kv_len: int, q_len: int) -> dict:
    """check_grads options for a batch of 2 (2 heads): batch 1's keys padded past ``kv_len``
    and queries past ``q_len``, a random mask (80% allowed) with key 7 blocked everywhere and
    every ninth query row empty, NaN in every masked K/V row."""
    kvl, ql = torch.tensor([n_k, kv_len]), torch.tensor([n_q, q_len])
    allowed = ((torch.arange(n_k) < kvl.view(2, 1, 1, 1))
               & (torch.arange(n_q)[:, None] < ql.view(2, 1, 1, 1)))
    dense = torch.rand(n_q, n_k) > 0.2
    dense[:, 7] = False                                      # key 7 blocked everywhere
    dense[::9] = False                                       # empty rows
    nan_rows = (torch.arange(n_k) >= kvl.view(2, 1, 1)) | (torch.arange(n_k) == 7)
    return {"allowed": allowed & dense, "kv_nan": nan_rows.expand(2, 2, n_k),
            "kv_lengths": kvl, "q_lengths": ql, "dense_mask": dense}


def poisoned_kv(k: torch.Tensor, v: torch.Tensor, kv_lengths: torch.Tensor, key: int,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K / V (B, H_kv, N_k, D) with NaN / inf in each batch's rows past ``kv_lengths`` and inf
    / NaN at ``key`` everywhere, and the keys allowed around them: (k2, v2, (B, 1, 1, N_k))."""
    n_k = k.shape[2]
    allowed = (torch.arange(n_k) < kv_lengths.view(-1, 1, 1, 1)) & (torch.arange(n_k) != key)
    k2, v2 = k.clone(), v.clone()
    for b, n in enumerate(kv_lengths.tolist()):
        k2[b, :, n:], v2[b, :, n:] = math.nan, math.inf
    k2[:, :, key], v2[:, :, key] = math.inf, math.nan
    return k2, v2, allowed


def check_score_term_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           dtype: torch.dtype) -> None:
    """check_grads under soft-cap 3, ALiBi and an additive bias, the first two with a causal
    band 20 keys wide of the diagonal (q (B, 4, N_q, D), k / v (B, H_kv, N_k, D), N_k >= N_q)."""
    from attnkit.scores import alibi, alibi_slopes

    n_q, n_k = q.shape[2], k.shape[2]
    tril = torch.ones(n_q, n_k, dtype=torch.bool).tril(20)
    check_grads(q, k, v, dtype, allowed=tril, oracle_opts={"softcap": 3.0}, softcap=3.0,
                band=(-20, math.inf))
    check_grads(q, k, v, dtype, allowed=tril, oracle_opts={"score_mod": alibi(4)},
                alibi_slopes=alibi_slopes(4), band=(-20, math.inf))
    bias = torch.randn(4, n_q, n_k, dtype=torch.float64)
    check_grads(q, k, v, dtype, oracle_opts={"bias": bias}, bias=bias)
