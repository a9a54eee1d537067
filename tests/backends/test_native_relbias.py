"""The native kernel's relative-position bias table term against the float64 reference.

``native.forward(..., rel_table=T, rel_max_distance=M)`` adds ``T[h, clamp(k − q, −M, M) + M]``
to every score (``scores.relative_bias(T, M)``) and differentiates the table. Every test
compares with ``ak.attention(..., score_mod=relative_bias(T, M), backend="reference")``:
the kernel's float32 error against the float64 reference is within 2× (gradients 3×) the
error of the same reference run in float32 (DESIGN's testing rule).

Shape legend: q (B, H_q, N_q, D), k, v (B, H_kv, N_k, D), T (H_q, 2M + 1).
"""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from attnkit.backends import native
from attnkit.masks import band_of
from attnkit.scores import relative_bias
from helpers.oracle import oracle
from helpers.tolerance import assert_low_precision_close, assert_low_precision_grad_close

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernel unavailable: "
                                                               f"{native.why_unavailable()}")


def qkv(B: int, hq: int, hkv: int, nq: int, nk: int, d: int,
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.randn(B, hq, nq, d, dtype=torch.float64),
            torch.randn(B, hkv, nk, d, dtype=torch.float64),
            torch.randn(B, hkv, nk, d, dtype=torch.float64))


def table(hq: int, M: int) -> torch.Tensor:
    return torch.randn(hq, 2 * M + 1, dtype=torch.float64)


def reference(dtype: torch.dtype, M: int, mask: object = None, softcap: float | None = None):  # noqa: ANN201
    """(q, k, v, T) -> (out, lse) of the reference backend computed in ``dtype``."""
    def fn(q, k, v, t):  # noqa: ANN001, ANN202
        return ak.attention(q.to(dtype), k.to(dtype), v.to(dtype), mask=mask, softcap=softcap,
                            score_mod=relative_bias(t.to(dtype), M), backend="reference",
                            return_lse=True)
    return fn


def kernel(M: int, dtype: torch.dtype = torch.float32, **opts: object):  # noqa: ANN201
    def fn(q, k, v, t):  # noqa: ANN001, ANN202
        return native.forward(q.to(dtype), k.to(dtype), v.to(dtype), rel_table=t,
                              rel_max_distance=M, **opts)
    return fn


def check_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, t: torch.Tensor, M: int,
                  *, mask: object = None, softcap: float | None = None,
                  **opts: object) -> None:
    with torch.no_grad():
        ref, lse_ref = reference(torch.float64, M, mask, softcap)(q, k, v, t)
        low, _ = reference(torch.float32, M, mask, softcap)(q, k, v, t)
        out, lse = kernel(M, softcap=softcap, **opts)(q, k, v, t.float())
    assert out.shape == ref.shape and lse.shape == lse_ref.shape
    assert_low_precision_close(out, low, ref)
    empty = lse_ref == -math.inf
    assert torch.equal(lse == -math.inf, empty), "rows without keys must have LSE -inf"
    assert (out[empty] == 0).all()
    tol = 64 * torch.finfo(torch.float32).eps * (1 + lse_ref[~empty].abs())
    assert ((lse.double()[~empty] - lse_ref[~empty]).abs() <= tol).all()


def grads(fn, q, k, v, t, dout, dlse) -> list[torch.Tensor]:  # noqa: ANN001
    """Gradients of (out · dout) + (finite lse · dlse) to q, k, v and the table."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, t)]
    out, lse = fn(*leaves)
    assert out.grad_fn is not None and lse.grad_fn is not None
    fin = torch.isfinite(lse.detach())
    loss = (out.double() * dout).sum() + (torch.where(fin, lse.double(), 0.0) * dlse).sum()
    loss.backward()
    return [x.grad for x in leaves]


def check_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, t: torch.Tensor, M: int, *,
                mask: object = None, softcap: float | None = None,
                kv_nan: torch.Tensor | None = None, **opts: object) -> None:
    dout = torch.randn(*q.shape[:3], v.shape[-1], dtype=torch.float64)
    dlse = torch.randn(*q.shape[:3], dtype=torch.float64)
    g64 = grads(reference(torch.float64, M, mask, softcap), q, k, v, t, dout, dlse)
    g32 = grads(reference(torch.float32, M, mask, softcap), q.float(), k.float(), v.float(),
                t.float(), dout, dlse)
    kn, vn = k, v
    if kv_nan is not None:                                   # NaN where the mask blocks
        kn = torch.where(kv_nan[..., None], math.nan, k)
        vn = torch.where(kv_nan[..., None], math.nan, v)
    gn = grads(kernel(M, softcap=softcap, **opts), q.float(), kn.float(), vn.float(),
               t.float(), dout, dlse)
    for name, got, lo, hi in zip(("q", "k", "v", "table"), gn, g32, g64, strict=True):
        assert got.dtype == torch.float32 and got.shape == hi.shape
        if kv_nan is not None and name in ("k", "v"):
            got = torch.where(kv_nan[..., None], 0.0, got.double())
        assert_low_precision_grad_close(got, lo, hi, what=f"d{name}")


SIZES = [  # B, hq, hkv, nq, nk, d, M
    (1, 1, 1, 1, 1, 8, 0),
    (2, 2, 1, 97, 113, 59, 5),
    (1, 4, 2, 113, 97, 111, 17),
    (1, 2, 2, 1025, 97, 8, 1),          # many more queries than keys
    (1, 8, 2, 113, 1025, 64, 64),       # GQA, keys > queries
    (1, 6, 1, 300, 129, 32, 400),       # MQA, M beyond every distance
    (1, 2, 1, 260, 260, 16, 0),         # M = 0: one bucket per head
]


@pytest.mark.parametrize("B,hq,hkv,nq,nk,d,M", SIZES)
def test_forward_matches_reference(B: int, hq: int, hkv: int, nq: int, nk: int, d: int,
                                   M: int) -> None:
    check_forward(*qkv(B, hq, hkv, nq, nk, d), table(hq, M), M)


@pytest.mark.parametrize("B,hq,hkv,nq,nk,d,M", [s for s in SIZES if s[3] * s[4] < 120_000])
def test_gradients_match_reference(B: int, hq: int, hkv: int, nq: int, nk: int, d: int,
                                   M: int) -> None:
    check_grads(*qkv(B, hq, hkv, nq, nk, d), table(hq, M), M)


@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
@pytest.mark.parametrize("nq,nk", [(130, 150), (150, 130), (257, 257)])
def test_causal(align: str, nq: int, nk: int) -> None:
    q, k, v = qkv(1, 4, 2, nq, nk, 32)
    t, m = table(4, 24), ak.masks.causal(align)
    band = band_of(m, nq, nk)
    check_forward(q, k, v, t, 24, mask=m, band=band)
    check_grads(q, k, v, t, 24, mask=m, band=band)


def test_softcap_then_table() -> None:
    """The table is added after the soft-cap: its gradient is dX, not dX · d(cap)/dx."""
    q, k, v = qkv(2, 4, 2, 97, 140, 32)
    q = q * 4                                                # logits well into the cap
    t = table(4, 9)
    check_forward(q, k, v, t, 9, softcap=2.0)
    check_grads(q, k, v, t, 9, softcap=2.0)


def test_fully_masked_rows_padding_and_nan_in_masked_kv() -> None:
    q, k, v = qkv(2, 2, 2, 97, 120, 16)
    kvl, ql = torch.tensor([120, 45]), torch.tensor([97, 60])
    dense = torch.rand(97, 120) > 0.2
    dense[:, 7] = False                                      # key 7 blocked everywhere
    dense[::9] = False                                       # fully-masked rows
    allowed = ((torch.arange(120) < kvl.view(2, 1, 1, 1))
               & (torch.arange(97)[:, None] < ql.view(2, 1, 1, 1)) & dense)
    nan_rows = (torch.arange(120) >= kvl.view(2, 1, 1)) | (torch.arange(120) == 7)
    t = table(2, 11)
    opts = {"kv_lengths": kvl, "q_lengths": ql, "dense_mask": dense}
    check_forward(q, k, v, t, 11, mask=allowed, **opts)
    check_grads(q, k, v, t, 11, mask=allowed, kv_nan=nan_rows.expand(2, 2, 120), **opts)


def test_with_alibi_bias_and_documents() -> None:
    """Every fused term at once: soft-cap, ALiBi, the table, an additive bias, documents."""
    q, k, v = qkv(1, 4, 2, 130, 150, 32)
    t = table(4, 6)
    slopes = ak.scores.alibi_slopes(4)
    bias = torch.randn(4, 130, 150, dtype=torch.float64)
    ids, kids = torch.arange(130) // 40, torch.arange(150) // 50
    alibi, rel = ak.scores.alibi(4), relative_bias(t, 6)

    def both(s, b, h, qi, ki):  # noqa: ANN001, ANN202
        return rel(alibi(s, b, h, qi, ki), b, h, qi, ki)

    with torch.no_grad():
        got, _ = native.forward(q.float(), k.float(), v.float(), softcap=4.0,
                                alibi_slopes=slopes, rel_table=t.float(), rel_max_distance=6,
                                bias=bias, doc_ids=ids, kv_doc_ids=kids)
    allowed = ids[:, None] == kids
    r64, _, _ = oracle(q, k, v, softcap=4.0, score_mod=both, bias=bias, allowed=allowed)
    r32, _, _ = oracle(q, k, v, softcap=4.0, score_mod=both, bias=bias, allowed=allowed,
                       dtype=torch.float32)
    assert_low_precision_close(got, r32, r64)


@pytest.mark.parametrize("nq,nk,hq,hkv", [(1, 1025, 4, 2), (3, 5000, 8, 2), (16, 700, 2, 2)])
def test_decode(nq: int, nk: int, hq: int, hkv: int) -> None:
    """The decode path (all G heads per K/V read, keys split and merged by LSE)."""
    q, k, v = qkv(1, hq, hkv, nq, nk, 64)
    t, M = table(hq, 40), 40
    m = ak.masks.causal("bottom_right")
    band = band_of(m, nq, nk)
    with torch.no_grad():
        ref, lse_ref = reference(torch.float64, M, m)(q, k, v, t)
        low, _ = reference(torch.float32, M, m)(q, k, v, t)
        for splits in (None, 1, 7):
            out, lse = native.decode(q.float(), k.float(), v.float(), rel_table=t.float(),
                                     rel_max_distance=M, band=band, splits=splits)
            assert_low_precision_close(out, low, ref, what=f"decode out (splits={splits})")
            assert (lse.double() - lse_ref).abs().max() < 1e-4
    dout = torch.randn(1, hq, nq, 64, dtype=torch.float64)
    dlse = torch.randn(1, hq, nq, dtype=torch.float64)
    g64 = grads(reference(torch.float64, M, m), q, k, v, t, dout, dlse)
    g32 = grads(reference(torch.float32, M, m), q.float(), k.float(), v.float(), t.float(),
                dout, dlse)

    def run(a, b, c, tt):  # noqa: ANN001, ANN202
        return native.decode(a, b, c, rel_table=tt, rel_max_distance=M, band=band)

    gn = grads(run, q.float(), k.float(), v.float(), t.float(), dout, dlse)
    for name, got, lo, hi in zip(("q", "k", "v", "table"), gn, g32, g64, strict=True):
        assert_low_precision_grad_close(got, lo, hi, what=f"decode d{name}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision(dtype: torch.dtype) -> None:
    q, k, v = qkv(1, 4, 2, 97, 113, 64)
    t, M = table(4, 13), 13
    with torch.no_grad():
        ref, _ = reference(torch.float64, M)(q, k, v, t)
        low, _ = reference(dtype, M)(q, k, v, t)
        out, _ = kernel(M, dtype)(q, k, v, t.to(dtype))
    assert out.dtype == dtype
    assert_low_precision_close(out, low, ref)
    leaves = [x.to(dtype).requires_grad_() for x in (q, k, v, t)]
    out, _ = native.forward(*leaves[:3], rel_table=leaves[3], rel_max_distance=M)
    out.float().sum().backward()
    assert leaves[3].grad.dtype == dtype and torch.isfinite(leaves[3].grad).all()


def test_table_gradient_alone_and_deterministic() -> None:
    """Only the table requires grad: out still has a grad_fn; two runs give the same bits."""
    q, k, v = (x.float() for x in qkv(2, 4, 2, 300, 333, 32))
    t = table(4, 30).float().requires_grad_()
    runs = []
    for _ in range(2):
        out, _ = native.forward(q, k, v, rel_table=t, rel_max_distance=30, band=(0, math.inf))
        assert out.grad_fn is not None
        (g,) = torch.autograd.grad((out * out).sum(), t)
        runs.append(g)
    assert torch.equal(runs[0], runs[1])
    assert q.grad is None


def test_max_distance_beyond_the_sequence() -> None:
    """A table far wider than any |k - q|: the columns no pair reaches get gradient 0."""
    q, k, v = qkv(1, 2, 1, 40, 50, 16)
    M = 100_000
    t = table(2, M)
    reach = (torch.arange(50)[None, :] - torch.arange(40)[:, None]).unique() + M
    sub = table(2, 60)                                        # the same scores via M = 60
    sub[:, reach - M + 60] = t[:, reach]
    check_forward(q, k, v, sub, 60)
    tt = t.float().requires_grad_()
    out, _ = native.forward(q.float(), k.float(), v.float(), rel_table=tt, rel_max_distance=M)
    ref, _ = native.forward(q.float(), k.float(), v.float(), rel_table=sub.float(),
                            rel_max_distance=60)
    assert torch.allclose(out, ref, atol=1e-6)
    out.sum().backward()
    unused = torch.ones(2 * M + 1, dtype=torch.bool)
    unused[reach] = False
    assert (tt.grad[:, unused] == 0).all() and (tt.grad[:, reach] != 0).any()


def test_without_grad_no_graph() -> None:
    q, k, v = (x.float() for x in qkv(1, 2, 1, 20, 30, 8))
    t = table(2, 3).float()
    out, lse = native.forward(q, k, v, rel_table=t, rel_max_distance=3)
    assert out.grad_fn is None and lse.grad_fn is None


def test_errors_say_what_is_wrong() -> None:
    q, k, v = (x.float() for x in qkv(1, 2, 1, 20, 30, 8))
    with pytest.raises(ValueError, match="together"):
        native.forward(q, k, v, rel_table=torch.zeros(2, 7))
    with pytest.raises(ValueError, match="together"):
        native.forward(q, k, v, rel_max_distance=3)
    with pytest.raises(ValueError, match=r"\(2, 7\), got \(2, 5\)"):
        native.forward(q, k, v, rel_table=torch.zeros(2, 5), rel_max_distance=3)
    with pytest.raises(ValueError, match=r"\(2, 7\), got \(1, 7\)"):
        native.forward(q, k, v, rel_table=torch.zeros(1, 7), rel_max_distance=3)
    with pytest.raises(ValueError, match="int >= 0"):
        native.forward(q, k, v, rel_table=torch.zeros(2, 7), rel_max_distance=-1)
    with pytest.raises(TypeError, match="floating-point"):
        native.forward(q, k, v, rel_table=torch.zeros(2, 7, dtype=torch.int64),
                       rel_max_distance=3)


# ------------------------------------------------------------- learnable ALiBi slopes
@pytest.mark.parametrize("offset", [0, 5])
def test_alibi_slope_gradient(offset: int) -> None:
    """ALiBi slopes that require grad get their gradient (with the table and a soft-cap)."""
    q, k, v = qkv(2, 4, 2, 130, 150, 32)
    slopes0, t0, M = torch.rand(4, dtype=torch.float64), table(4, 7), 7
    allowed = (torch.arange(130)[:, None] + 20 - torch.arange(150)) >= 0
    dout = torch.randn(2, 4, 130, 32, dtype=torch.float64)
    dlse = torch.randn(2, 4, 130, dtype=torch.float64)

    def loss(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        fin = torch.isfinite(lse.detach())
        return (out.double() * dout).sum() + (torch.where(fin, lse.double(), 0.0) * dlse).sum()

    def ref(dtype: torch.dtype) -> list[torch.Tensor]:
        leaves = [x.detach().to(dtype).clone().requires_grad_() for x in (q, k, v, slopes0, t0)]
        a, b, c, sl, tt = leaves
        rel = relative_bias(tt, M)

        def mod(s, bb, h, qi, ki):  # noqa: ANN001, ANN202
            s = s - sl[h] * (qi + offset - ki).abs().to(s.dtype)
            return rel(s, bb, h, qi, ki)

        out, lse, _ = oracle(a, b, c, softcap=3.0, score_mod=mod, allowed=allowed, dtype=dtype)
        loss(out, lse).backward()
        return [x.grad for x in leaves]

    g64, g32 = ref(torch.float64), ref(torch.float32)
    leaves = [x.detach().float().clone().requires_grad_() for x in (q, k, v, slopes0, t0)]
    out, lse = native.forward(*leaves[:3], softcap=3.0, alibi_slopes=leaves[3],
                              alibi_offset=offset, rel_table=leaves[4], rel_max_distance=M,
                              band=(-20, math.inf))
    loss(out, lse).backward()
    for name, x, lo, hi in zip(("q", "k", "v", "slopes", "table"), leaves, g32, g64,
                               strict=True):
        assert x.grad.shape == x.shape and x.grad.dtype == torch.float32
        assert_low_precision_grad_close(x.grad, lo, hi, what=f"d{name}")


def test_alibi_slope_gradient_alone_and_with_a_bias_gradient() -> None:
    q, k, v = (x.float() for x in qkv(1, 2, 1, 50, 60, 16))
    sl = torch.tensor([0.5, 0.25], dtype=torch.float64, requires_grad=True)
    out, _ = native.forward(q, k, v, alibi_slopes=sl)
    (g,) = torch.autograd.grad(out.sum() * 0 + (out * out).sum(), sl)
    assert g.dtype == torch.float64 and g.shape == (2,) and (g != 0).all()
    bias = torch.zeros(50, 60, requires_grad=True)          # both gradients in one backward
    out, _ = native.forward(q, k, v, alibi_slopes=sl, bias=bias)
    g2, gb = torch.autograd.grad((out * out).sum(), (sl, bias))
    torch.testing.assert_close(g2, g, atol=1e-5, rtol=1e-5)  # a zero bias changes nothing
    assert gb.shape == (50, 60) and gb.dtype == torch.float32 and gb.abs().sum() > 0


def test_relative_bias_score_mod_runs_natively_through_tiled():
    """``scores.relative_bias`` reaches the kernel through its spec (tiled's native counter),
    with the table's gradient, and matches the float64 reference."""
    from attnkit.backends import tiled

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 97, 16, requires_grad=True) for _ in range(3))
    table = torch.randn(4, 17, requires_grad=True)
    with tiled.counting() as n:
        out = ak.attention(q, k, v, score_mod=ak.scores.relative_bias(table, 8), is_causal=True,
                           backend="tiled")
    assert n["native"] == 1
    out.square().sum().backward()
    ins = [t.detach().double().requires_grad_() for t in (q, k, v, table)]
    ref = ak.attention(*ins[:3], score_mod=ak.scores.relative_bias(ins[3], 8), is_causal=True,
                       backend="reference")
    ref.square().sum().backward()
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-4)
    for got, want in zip((q, k, v, table), ins, strict=True):
        torch.testing.assert_close(got.grad.double(), want.grad, atol=1e-4, rtol=1e-3)
