"""The native CPU kernel against the float64 oracle (DESIGN's testing rules), and its fallback.

Shape legend: q (B, H_q, N_q, D_k), k (B, H_kv, N_k, D_k), v (B, H_kv, N_k, D_v).
Every comparison follows DESIGN: the kernel's error against the float64 oracle is within 2×
the error of the same math done naively in the kernel's input precision (float32 included).
The first run builds the kernel (~10–20 s of one core); later runs load the cached build.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch

import attnkit as ak
from attnkit.api import prepare
from attnkit.backends import native
from attnkit.backends.native import loader
from attnkit.scores import alibi, alibi_slopes
from helpers.native_checks import (
    check,
    check_grads,
    check_score_term_grads,
    masked_rows_grad_case,
)
from helpers.oracle import naive_low_precision, oracle
from helpers.tolerance import assert_low_precision_close

NATIVE = native.available()
needs_native = pytest.mark.skipif(not NATIVE, reason=f"native kernel unavailable: "
                                                     f"{native.why_unavailable()}")


def qkv(B: int, hq: int, hkv: int, nq: int, nk: int, d: int, dv: int | None = None,
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.randn(B, hq, nq, d, dtype=torch.float64),
            torch.randn(B, hkv, nk, d, dtype=torch.float64),
            torch.randn(B, hkv, nk, dv or d, dtype=torch.float64))


# ---------------------------------------------------------------------------- sizes
@needs_native
@pytest.mark.parametrize("B,hq,hkv,nq,nk,d,dv", [
    (1, 1, 1, 1, 1, 8, 8),
    (2, 2, 1, 97, 113, 59, 59),
    (1, 4, 2, 113, 97, 111, 64),
    (1, 2, 2, 1025, 97, 8, 16),
    (1, 2, 2, 97, 1025, 64, 64),
    (1, 8, 2, 113, 1025, 64, 64),        # GQA, queries < keys
    (1, 6, 1, 300, 129, 32, 32),         # MQA
])
def test_sizes_match_reference(B: int, hq: int, hkv: int, nq: int, nk: int, d: int,
                               dv: int) -> None:
    check(*qkv(B, hq, hkv, nq, nk, d, dv))


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("nq,nk", [(97, 113), (1, 1025), (300, 300)])
def test_low_precision_within_twice_naive(dtype: torch.dtype, nq: int, nk: int) -> None:
    q, k, v = qkv(1, 4, 2, nq, nk, 64)
    check(q, k, v, dtype)
    allowed = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
    check(q, k, v, dtype, allowed=allowed, band=(-(nk - nq), math.inf))


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("d", [64, 36])
def test_decode_reads_a_cache_view_in_its_own_dtype(dtype: torch.dtype, d: int) -> None:
    """Decode over the first n rows of a preallocated (B, H, max_len, D) cache: rows of the
    view are read as they are (D = 64: in registers, no padding; D = 36: widened and padded
    into a buffer first), within 2x of the naive formula in that dtype."""
    cache_k = torch.randn(1, 2, 1500, d).to(dtype)          # in the cache's dtype, so the
    cache_v = torch.randn(1, 2, 1500, d).to(dtype)          # view reaches the kernel as is
    cache_k[:, :, 1111:] = math.nan                         # beyond n: never read
    q = torch.randn(1, 8, 2, d, dtype=torch.float64)
    k, v = cache_k[:, :, :1111], cache_v[:, :, :1111]
    assert not k.is_contiguous() and k.to(dtype) is k
    allowed = torch.ones(2, 1111, dtype=torch.bool).tril(1111 - 2)
    out, _ = check(q, k, v, dtype, allowed=allowed, band=(-(1111 - 2), math.inf), block_q=2)
    assert torch.isfinite(out).all()


@needs_native
def test_non_contiguous_inputs() -> None:
    q, k, v = (t.transpose(1, 2) for t in (torch.randn(1, 97, 4, 64, dtype=torch.float64),
                                           torch.randn(1, 113, 2, 64, dtype=torch.float64),
                                           torch.randn(1, 113, 2, 64, dtype=torch.float64)))
    check(q, k, v)
    kk = torch.randn(1, 2, 113, 128, dtype=torch.float64)[..., ::2]   # last dim strided
    check(q, kk, v, scale=64 ** -0.5)


# ---------------------------------------------------------------------------- masks
def _masks(nq: int, nk: int) -> dict[str, ak.masks.Mask]:
    ids = torch.arange(nq) // 37
    gen = torch.Generator().manual_seed(1)
    rows_off = torch.rand(nq, nk, generator=gen) > 0.3
    rows_off[::7] = False                                  # fully masked rows
    return {
        "causal": ak.masks.causal(),
        "causal_bottom_right": ak.masks.causal("bottom_right"),
        "window7": ak.masks.sliding_window(7),
        "window5_two_sided": ak.masks.sliding_window(5, causal=False),
        "window_br": ak.masks.sliding_window(9, align="bottom_right"),
        "padding": ak.masks.padding([max(nk - 30, 0), 5], q_lengths=[nq, max(nq - 11, 0)]),
        "padding_causal": ak.masks.padding([nk // 2, nk]) & ak.masks.causal("bottom_right"),
        "document_causal": (ak.masks.document(ids, torch.arange(nk) // 37) & ak.masks.causal()
                            if nq == nk else ak.masks.document(ids, torch.arange(nk) // 29)),
        "prefix_lm": ak.masks.prefix_lm(13),
        "from_fn": ak.masks.from_fn(lambda b, h, q, k: (q + k + h) % 3 != 0),
        "tensor_empty_rows": ak.masks.from_tensor(rows_off),
    }


@needs_native
@pytest.mark.parametrize("nq,nk", [(113, 113), (97, 300), (300, 97), (1, 257), (16, 1025)])
@pytest.mark.parametrize("name", list(_masks(40, 40)))
def test_every_mask_kind(name: str, nq: int, nk: int) -> None:
    mask = _masks(nq, nk)[name]
    q, k, v = qkv(2, 4, 2, nq, nk, 32)
    p = prepare(q.float(), k.float(), v.float(), mask=mask).problem
    assert native.supports(p) == []
    allowed = mask.to_dense(nq, nk, batch=2, heads=4)
    ref, lse_ref, _ = oracle(q, k, v, allowed=allowed)
    lowp = naive_low_precision(q.float(), k.float(), v.float(), allowed=allowed)
    with torch.no_grad():
        out, lse = native.forward_problem(p)
    assert_low_precision_close(out, lowp, ref)
    assert torch.equal(lse == -math.inf, lse_ref == -math.inf)


@needs_native
def test_closed_form_masks_skip_nothing_they_need() -> None:
    """Band, lengths and documents given directly (not via Problem) match the dense mask."""
    q, k, v = qkv(2, 2, 1, 300, 500, 16)
    d = torch.arange(300)[:, None] - torch.arange(500)[None, :]
    kvl, ql = torch.tensor([400, 130]), torch.tensor([300, 250])
    qd, kd = torch.arange(300) // 50, torch.arange(500) // 80
    allowed = ((d >= -20) & (d <= 100) & (torch.arange(500) < kvl.view(2, 1, 1, 1))
               & (torch.arange(300)[:, None] < ql.view(2, 1, 1, 1)) & (qd[:, None] == kd))
    check(q, k, v, allowed=allowed, band=(-20, 100), kv_lengths=kvl, q_lengths=ql,
          doc_ids=qd, kv_doc_ids=kd)


@needs_native
@pytest.mark.parametrize("band", [(0, 49), (-45, 45), (-(350 - 300), math.inf), (3, 200)])
@pytest.mark.parametrize("terms", ["plain", "softcap", "alibi"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_band_edge_tiles_by_sub_blocks(band: tuple[float, float], terms: str,
                                       dtype: torch.dtype) -> None:
    """A band's edge tiles run as 32-key sub-blocks over only the rows that see them (brgemm
    path: 128 rows per item, two query heads per K/V head); the rows a sub-block skips are
    out of the band and must come out exactly as the float64 oracle says."""
    nq, nk = 300, 350
    q, k, v = qkv(1, 4, 2, nq, nk, 64)
    d = torch.arange(nq)[:, None] - torch.arange(nk)[None, :]
    allowed = (d >= band[0]) & (d <= band[1])
    opts: dict = {"softcap": {"softcap": 5.0}, "alibi": {"alibi_slopes": alibi_slopes(4)},
                  "plain": {}}[terms]
    oo: dict = {"softcap": {"softcap": 5.0}, "alibi": {"score_mod": alibi(4)}, "plain": {}}[terms]
    for rows in (64, 48):                                   # grid-aligned and not
        check(q, k, v, dtype, allowed=allowed, oracle_opts=oo, band=band, block_q=rows, **opts)


@needs_native
@pytest.mark.parametrize("head_cache", ["1", "0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_window_v_finiteness_read_once_per_head(head_cache: str, dtype: torch.dtype,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The GEMM loop in float32 / float64 reads a V tile's finiteness once per head and
    thread when it caches the head (``v_seen``), and the items after the first (a 300-key
    window over 100-row blocks: three or four per tile) reuse it. K/V head 0 is clean, head 1
    holds NaN / inf in keys the mask blocks for every query, inside the tiles those items
    visit: a mark carried over from head 0 would let NaN through P = 0. Batch 1's keys past
    its length (500, inside tile [384, 512)) are NaN too: the tile is marked non-finite, yet
    its first 116 rows, all an item reads, are clean (the exact path need not run).
    ATTNKIT_NATIVE_HEAD_CACHE=0: every item reads the rows itself."""
    monkeypatch.setenv("ATTNKIT_NATIVE_HEAD_CACHE", head_cache)
    nq, nk, d, band = 700, 1025, 59, (0, 299)
    q, k, v = qkv(2, 4, 2, nq, nk, d)
    kvl = torch.tensor([1025, 500])
    poison = torch.zeros(nk, dtype=torch.bool)
    poison[[7, 300, 301, 640]] = True                     # blocked for every query
    dist = torch.arange(nq)[:, None] - torch.arange(nk)[None, :]
    allowed = ((dist >= band[0]) & (dist <= band[1]) & ~poison
               & (torch.arange(nk) < kvl.view(2, 1, 1, 1)))
    k2, v2 = k.clone(), v.clone()
    k2[:, 1, poison], v2[:, 1, poison] = math.inf, math.nan
    k2[1, :, 500:], v2[1, :, 500:] = math.nan, math.inf
    check(q, k, v, dtype, allowed=allowed, kv=(k2, v2), band=band, kv_lengths=kvl,
          dense_mask=~poison.view(1, 1, 1, nk), block_q=100)


@needs_native
@pytest.mark.parametrize("head_cache", ["1", "0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_window_v_screen_reads_strided_rows(head_cache: str, dtype: torch.dtype,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The GEMM loop's V screen on rows that do not follow one another (V a slice of wider
    rows: row stride 64 > D_v = 40): NaN in V rows a dense mask blocks for every query, inside
    the keys the items visit, still sends their tile to the exact path (P = 0 skipped: a
    screen that missed them would let NaN through the GEMM), and the wider rows' columns past
    D_v, NaN, are not V's: they never reach the output (nor make a tile inexact)."""
    monkeypatch.setenv("ATTNKIT_NATIVE_HEAD_CACHE", head_cache)
    nq, nk, d, band = 300, 400, 40, (0, 99)
    q, k, v = qkv(1, 2, 2, nq, nk, d)
    wide = torch.full((1, 2, nk, 64), math.nan, dtype=dtype)
    wide[..., :d] = v.to(dtype)
    poison = torch.zeros(nk, dtype=torch.bool)
    poison[[7, 150, 151, 290]] = True                      # blocked for every query
    wide[:, :, poison, :d] = math.nan
    vs = wide[..., :d]                                     # rows 64 values apart
    assert vs.stride(2) == 64 and vs.stride(3) == 1
    dist = torch.arange(nq)[:, None] - torch.arange(nk)[None, :]
    allowed = (dist >= band[0]) & (dist <= band[1]) & ~poison
    ref, lse_ref, _ = oracle(q, k, v, allowed=allowed)
    lowp = naive_low_precision(q.to(dtype), k.to(dtype), v.to(dtype), allowed=allowed)
    with torch.no_grad():
        out, lse = native.forward(q.to(dtype), k.to(dtype), vs, band=band, block_q=64,
                                  dense_mask=~poison.view(1, 1, 1, nk))
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert_low_precision_close(out, lowp, ref)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [37, 128])
def test_row_pass_groups_keep_each_rows_softmax(dtype: torch.dtype, rows: int) -> None:
    """The GEMM loop's row pass keeps each row's online softmax (row maxima, sums, alphas)
    apart: rows whose scores differ in scale row by row (each query row scaled by its own
    factor), keys whose scores rise tile by tile (the running max grows, alpha < 1), items
    cut short (37 or 128 rows per item, two query heads per K/V head: 74 or 256 rows) and
    rows with no key (the band's first three). A row given another's max or sum fails the
    oracle."""
    nq, nk = 300, 420
    q, k, v = qkv(1, 4, 2, nq, nk, 64)
    q = q * (1 + 3 * (torch.arange(nq) % 7)).view(1, 1, nq, 1) / 4
    k = k * torch.linspace(0.5, 2.0, nk).view(1, 1, nk, 1)
    band = (3, 260)
    d = torch.arange(nq)[:, None] - torch.arange(nk)[None, :]
    allowed = (d >= band[0]) & (d <= band[1])
    check(q, k, v, dtype, allowed=allowed, band=band, block_q=rows)


@needs_native
@pytest.mark.parametrize("band", [(-0.5, 0.5), (0.0, 31.5), (-7.25, 40.75)])
def test_band_bounds_need_not_be_whole(band: tuple[float, float]) -> None:
    """lo <= q - k <= hi with fractional bounds: the kernel rounds them inwards (it used to
    truncate the lower key bound, letting in one key too many)."""
    q, k, v = qkv(1, 2, 2, 200, 230, 32)
    d = torch.arange(200)[:, None] - torch.arange(230)[None, :]
    allowed = (d >= band[0]) & (d <= band[1])
    for rows in (8, 64):                                    # dot-product and brgemm paths
        check(q, k, v, allowed=allowed, band=band, block_q=rows)
    check_grads(q, k, v, torch.float32, allowed=allowed, band=band)


# ---------------------------------------------------------------------------- score terms
@needs_native
@pytest.mark.parametrize("cap", [1.0, 30.0, 1e4, 1e8])
def test_softcap_precise_at_every_cap(cap: float) -> None:
    q, k, v = qkv(1, 2, 2, 97, 300, 64)
    q = q * 4                                               # logits of a few units
    check(q, k, v, oracle_opts={"softcap": cap}, softcap=cap)
    check(q, k, v, torch.bfloat16, oracle_opts={"softcap": cap}, softcap=cap)


@needs_native
@pytest.mark.parametrize("nq,nk", [(113, 113), (97, 300), (4, 1025)])
def test_alibi_matches_score_mod(nq: int, nk: int) -> None:
    q, k, v = qkv(1, 8, 2, nq, nk, 32)
    slopes = alibi_slopes(8)
    allowed = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
    check(q, k, v, allowed=allowed, oracle_opts={"score_mod": alibi(8)},
          alibi_slopes=slopes, band=(-(nk - nq), math.inf))
    check(q, k, v, oracle_opts={"score_mod": alibi(8), "softcap": 5.0},
          alibi_slopes=slopes, softcap=5.0)


@needs_native
@pytest.mark.parametrize("shape", [(1, 8, 97, 113), (97, 113), (8, 1, 113), (1, 1, 97, 1)])
def test_additive_bias_broadcasts(shape: tuple[int, ...]) -> None:
    q, k, v = qkv(1, 8, 4, 97, 113, 16)
    bias = torch.randn(*shape, dtype=torch.float64)
    check(q, k, v, oracle_opts={"bias": bias}, bias=bias)


@needs_native
@pytest.mark.parametrize("with_spec", [False, True])
def test_alibi_through_a_problem(with_spec: bool) -> None:
    sm = alibi(4)
    if with_spec:
        def sm(s, b, h, i, j):  # noqa: ANN001, ANN202 — a user's ALiBi that says what it is
            return alibi(4)(s, b, h, i, j)

        sm.spec = type("Spec", (), {"slopes": alibi_slopes(4), "offset": 0})()
    q, k, v = qkv(1, 4, 4, 97, 97, 32)
    p = prepare(q.float(), k.float(), v.float(), score_mod=sm, is_causal=True).problem
    assert native.supports(p) == []
    ref, _, _ = oracle(q, k, v, score_mod=alibi(4),
                       allowed=torch.ones(97, 97, dtype=torch.bool).tril())
    with torch.no_grad():
        out, _ = native.forward_problem(p)
    assert (out.double() - ref).abs().max() < 1e-5


# ---------------------------------------------------------------------------- dense masks
def _dense_layouts(B: int, hq: int, nq: int, nk: int) -> dict[str, torch.Tensor]:
    """Bool masks (True = may attend) in the layouts a caller passes: contiguous rows read
    as words / lane masks, keys broadcast (stride 0), transposed (stride N_q), per head or
    broadcast over heads and batch; each with a fully masked row and some empty and full
    tiles."""
    g = torch.Generator().manual_seed(11)
    rand = torch.rand(B, 1, nq, nk, generator=g) > 0.4
    rand[:, :, :, 130:260] = True                              # a full tile
    rand[:, :, :, 260:] &= torch.rand(B, 1, nq, 1, generator=g) > 0.5  # rows empty there
    rand[0, 0, 3] = False                                      # a row with no key
    per_head = torch.rand(B, hq, nq, nk, generator=g) > 0.7
    per_head[1, 2, 5] = False
    col = torch.rand(B, 1, nq, 1, generator=g) > 0.3             # each query all or nothing
    tr = (torch.rand(B, 1, nk, nq, generator=g) > 0.5).transpose(-1, -2)
    return {"contiguous": rand, "per_head": per_head, "keys_broadcast": col.expand(B, 1, nq, nk),
            "transposed": tr, "batch_broadcast": rand[:1]}


@needs_native
@pytest.mark.parametrize("layout", ["contiguous", "per_head", "keys_broadcast", "transposed",
                                    "batch_broadcast"])
@pytest.mark.parametrize("rows", [4, 64], ids=["dot", "gemm"])
def test_dense_mask_layouts_forward_and_backward(layout: str, rows: int) -> None:
    q, k, v = qkv(2, 4, 2, 37, 301, 24)
    m = _dense_layouts(2, 4, 37, 301)[layout]
    out, lse = check(q, k, v, torch.float32, allowed=m, dense_mask=m, block_q=rows)
    qd, kd, vd = (t.clone().requires_grad_() for t in (q, k, v))
    out64, _ = native.forward(qd, kd, vd, dense_mask=m, block_q=rows)
    ref, _, _ = oracle(q, k, v, allowed=m)
    assert (out64 - ref).abs().max() < 1e-12
    go = torch.randn_like(ref)
    got = torch.autograd.grad(out64, (qd, kd, vd), go)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(oracle(qr, kr, vr, allowed=m)[0], (qr, kr, vr), go)
    for a, b in zip(got, want, strict=True):
        assert (a - b).abs().max() < 1e-10


def _broadcast_shapes(full: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every shape that has ``full``'s size or 1 in each dim (size-1 dims in every place)."""
    return list(itertools.product(*((n, 1) for n in full)))


@needs_native
@pytest.mark.parametrize("rows", [5, 64], ids=["dot", "gemm"])
def test_mask_and_bias_with_size_one_dims_anywhere(rows: int) -> None:
    """A dense mask and a bias with size-1 (broadcast) dims in any of the four places are
    read in place by the kernel (not expanded, whatever stride the size-1 dim has) and give
    the oracle's forward and gradients (the bias's summed over its broadcast dims)."""
    B, hq, nq, nk = 2, 4, 5, 37
    q, k, v = qkv(B, hq, 2, nq, nk, 16)
    g = torch.Generator().manual_seed(3)
    for shape in _broadcast_shapes((B, hq, nq, nk)):
        m = torch.rand(*shape, generator=g) > 0.3
        m.view(-1)[0] = False                                   # some entry blocked
        bias = torch.randn(*shape, dtype=torch.float64, generator=g)
        qd, kd, vd, bd = (t.clone().requires_grad_() for t in (q, k, v, bias))
        out, lse = native.forward(qd, kd, vd, bias=bd, dense_mask=m, block_q=rows)
        qr, kr, vr, br = (t.clone().requires_grad_() for t in (q, k, v, bias))
        ref, lse_ref, _ = oracle(qr, kr, vr, allowed=m, bias=br)
        assert (out - ref).abs().max() < 1e-12, shape
        assert torch.equal(lse == -math.inf, lse_ref == -math.inf), shape
        go = torch.randn_like(ref)
        got = torch.autograd.grad(out, (qd, kd, vd, bd), go)
        want = torch.autograd.grad(ref, (qr, kr, vr, br), go)
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape and (a - b).abs().max() < 1e-10, shape


@needs_native
def test_a_broadcast_mask_reaches_the_kernel_uncopied() -> None:
    """The record holds the caller's mask itself (4-D, size-1 dims kept: no expand, no
    copy), and the kernel refuses a mask whose dims are neither 1 nor the call's sizes."""
    full = (2, 4, 5, 37)
    for shape in [(1, 1, 1, 37), (2, 1, 1, 37), (1, 4, 5, 1), (5, 37)]:
        m = torch.rand(*shape) > 0.5
        got = native._as4d(m, full, "dense_mask", torch.bool)
        assert got.data_ptr() == m.data_ptr() and got.dim() == 4
        assert tuple(got.shape) == (1,) * (4 - m.dim()) + shape
    q, k, v = (t.float() for t in qkv(2, 4, 2, 5, 37, 16))
    ops = native._ops()
    for bad in [(2, 4, 5, 36), (3, 1, 1, 37), (2, 2, 5, 37), (1, 1, 37)]:
        rec = native.plain_terms(0.25)._replace(mask=torch.ones(*bad, dtype=torch.bool))
        with pytest.raises(RuntimeError, match="does not broadcast"):
            ops.attend(q, k, v, *rec, 1, 5)  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------- non-finite
@needs_native
def test_nan_in_masked_kv_rows_stays_out() -> None:
    q, k, v = qkv(2, 4, 2, 97, 300, 32)
    kvl = torch.tensor([200, 37])
    allowed = torch.arange(300) < kvl.view(2, 1, 1, 1)
    allowed = allowed & (torch.arange(300) != 5)            # key 5 masked for every query
    dense = allowed.expand(2, 4, 97, 300)
    k2, v2 = k.clone(), v.clone()
    for b, n in enumerate(kvl.tolist()):
        k2[b, :, n:], v2[b, :, n:] = math.nan, math.inf
    k2[:, :, 5], v2[:, :, 5] = math.inf, math.nan
    ref, _, _ = oracle(q, k, v, allowed=allowed)
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (4, 64):                                # dot-product and brgemm paths
            with torch.no_grad():
                out, lse = native.forward(q.to(dtype), k2.to(dtype), v2.to(dtype),
                                          kv_lengths=kvl, dense_mask=dense, block_q=rows)
            assert torch.isfinite(out).all() and torch.isfinite(lse).all()
            assert (out.double() - ref).abs().max() < (1e-5 if dtype == torch.float32 else 0.05)


@needs_native
def test_nan_in_q_propagates_and_empty_rows_are_zero() -> None:
    q, k, v = qkv(1, 2, 2, 50, 60, 16)
    q[0, 0, 3] = math.nan
    ql = torch.tensor([40])
    with torch.no_grad():
        out, lse = native.forward(q.float(), k.float(), v.float(), q_lengths=ql)
    assert torch.isnan(out[0, 0, 3]).all() and torch.isnan(lse[0, 0, 3])
    assert torch.isfinite(out[0, 1]).all() and torch.isfinite(out[0, 0, :3]).all()
    assert (out[:, :, 40:] == 0).all() and (lse[:, :, 40:] == -math.inf).all()


# ---------------------------------------------------------------------------- decode
@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("nq,nk,hq,hkv", [(1, 1, 1, 1), (1, 2049, 8, 2), (4, 1025, 2, 2),
                                          (16, 2049, 2, 1), (3, 97, 32, 8)])
def test_decode_split_keys(dtype: torch.dtype, nq: int, nk: int, hq: int, hkv: int) -> None:
    q, k, v = qkv(2, hq, hkv, nq, nk, 64)
    lens = torch.tensor([nk, max(1, nk // 3)])
    allowed = ((torch.arange(nk) < lens.view(2, 1, 1, 1))
               & torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq))
    for splits in (None, 7):
        check(q, k, v, dtype, allowed=allowed, kv_lengths=lens, band=(-(nk - nq), math.inf),
              splits=splits, block_q=nq)
    out_d, _ = native.decode(q.to(dtype), k.to(dtype), v.to(dtype), kv_lengths=lens,
                             band=(-(nk - nq), math.inf))
    out_f, _ = native.forward(q.to(dtype), k.to(dtype), v.to(dtype), kv_lengths=lens,
                              band=(-(nk - nq), math.inf), splits=1)
    assert (out_d.double() - out_f.double()).abs().max() < 0.02


@needs_native
def test_decode_refuses_many_queries() -> None:
    q, k, v = qkv(1, 1, 1, 17, 20, 8)
    with pytest.raises(ValueError, match="at most 16"):
        native.decode(q.float(), k.float(), v.float())


# ---------------------------------------------------------------------------- refusals
@needs_native
def test_supports_says_why() -> None:
    q, k, v = qkv(1, 2, 2, 8, 8, 8)
    assert native.supports(prepare(q, k, v).problem) == []          # float64 runs natively
    qf = q.float().requires_grad_()
    assert native.supports(prepare(qf, k.float(), v.float()).problem) == []
    bias = torch.randn(8, 8, requires_grad=True)                   # its gradient too
    assert native.supports(prepare(qf, k.float(), v.float(), mask=bias).problem) == []
    p = prepare(q.float(), k.float(), v.float(),             # atan: not compiled natively
                score_mod=lambda s, b, h, i, j: torch.atan(s)).problem
    assert "score_mod" in " ".join(native.supports(p))
    p = prepare(q.float(), k.float(), v.float(), dropout_p=0.5).problem
    assert "dropout" in " ".join(native.supports(p))
    with pytest.raises(ValueError, match="does not broadcast"), torch.no_grad():
        native.forward(q.float(), k.float(), v.float(), bias=torch.zeros(3, 8))


# ---------------------------------------------------------------------------- the fallback
def test_disabled_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNKIT_NATIVE", "0")
    assert not native.available()
    assert "ATTNKIT_NATIVE=0" in native.why_unavailable()
    q, k, v = qkv(1, 1, 1, 4, 4, 8)
    assert "ATTNKIT_NATIVE=0" in native.supports(prepare(q.float(), k.float(),
                                                         v.float()).problem)[0]
    with pytest.raises(RuntimeError, match="unavailable"):
        native.forward(q.float(), k.float(), v.float())


@pytest.fixture
def fresh_loader(monkeypatch: pytest.MonkeyPatch, tmp_path):  # noqa: ANN201
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("ATTNKIT_NATIVE", raising=False)
    loader.reset(forget_loaded=True)
    yield tmp_path
    monkeypatch.undo()
    loader.reset(forget_loaded=True)


_FAILED_BUILD = """
import json, sys, warnings
from pathlib import Path
from attnkit.backends import native
from attnkit.backends.native import loader
broken = Path(sys.argv[1]) / "attention.cpp"
broken.write_text("this is not C++;\\n")                  # fails at once
loader.SOURCES = [broken]
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    first, second = native.available(), native.available()
print(json.dumps({"available": first or second, "reason": native.why_unavailable(),
                  "warnings": [str(x.message) for x in w
                               if issubclass(x.category, loader.NativeUnavailableWarning)]}))
"""


def test_failed_build_warns_once_and_says_why(tmp_path) -> None:  # noqa: ANN001
    """A real failed compile, in a fresh process (this one may hold the loaded library)."""
    if loader._compiler() is None:  # noqa: SLF001 — the test needs a compiler to fail a build
        pytest.skip("no C++ compiler here")
    env = {**os.environ, "ATTNKIT_CACHE_DIR": str(tmp_path)}
    env.pop("ATTNKIT_NATIVE", None)
    run = subprocess.run([sys.executable, "-c", _FAILED_BUILD, str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert not got["available"] and "failed to build" in got["reason"]
    assert len(got["warnings"]) == 1 and "ATTNKIT_NATIVE=0" in got["warnings"][0]
    assert "compiling the native CPU kernel" in run.stderr


_OTHER_LEVEL = """
import json, sys, torch
import attnkit as ak
from attnkit.backends import native
assert native.available(), native.why_unavailable()
torch.manual_seed(0)
worst = {}
for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
    for nq, nk, d, band in ((1, 700, 64, None), (2, 300, 40, None), (150, 300, 64, (0, 40))):
        q = torch.randn(1, 4, nq, d)
        k, v = torch.randn(1, 2, nk, d), torch.randn(1, 2, nk, d)
        q, k, v = q.to(dt), k.to(dt), v.to(dt)
        with torch.no_grad():
            out, _ = native.forward(q, k, v, **({"band": band} if band else {}))
        s = (q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2)) * d ** -0.5
        if band:
            dd = torch.arange(nq)[:, None] - torch.arange(nk)[None, :]
            s = s.masked_fill(~((dd >= band[0]) & (dd <= band[1])), -torch.inf)
        ref = torch.softmax(s, -1) @ v.double().repeat_interleave(2, 1)
        worst[str(dt)] = max(worst.get(str(dt), 0.0), (out.double() - ref).abs().max().item())
print(json.dumps(worst))
"""


@pytest.mark.parametrize("level", ["avx512", "avx2", "portable"])
def test_narrower_vector_levels_build_and_agree(level: str, tmp_path) -> None:  # noqa: ANN001
    """The kernel built for AVX-512 without AVX512-BF16 (generic bfloat16 rounding), for AVX2
    (8 float lanes, F16C) and with no vector flags (4 lanes, scalar half conversion) — the
    `#if` branches this CPU's own build never takes — against the float64 formula, every
    dtype, decode and a band (a fresh process and cache each)."""
    if loader._compiler() is None:  # noqa: SLF001
        pytest.skip("no C++ compiler here")
    levels = loader._LEVELS  # noqa: SLF001
    if levels.index(level) >= levels.index(loader.cpu_flags()[0]):
        pytest.skip(f"this CPU's own build is {level} or narrower")
    env = {**os.environ, "ATTNKIT_CACHE_DIR": str(tmp_path), "ATTNKIT_NATIVE_ISA": level}
    env.pop("ATTNKIT_NATIVE", None)
    run = subprocess.run([sys.executable, "-c", _OTHER_LEVEL, level], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    worst = json.loads(run.stdout.strip().splitlines()[-1])
    assert worst["torch.float64"] < 1e-12 and worst["torch.float32"] < 1e-5
    assert worst["torch.bfloat16"] < 0.05 and worst["torch.float16"] < 5e-3, worst


def test_isa_override_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """ATTNKIT_NATIVE_ISA picks a narrower build (the suite can run the AVX2 / portable
    kernel on a wider CPU); an unknown level or one above the CPU's is refused by name."""
    detected = loader._detected_level()  # noqa: SLF001
    monkeypatch.setenv("ATTNKIT_NATIVE_ISA", "portable")
    assert loader.cpu_flags() == ("portable", [])
    monkeypatch.setenv("ATTNKIT_NATIVE_ISA", "AVX1024")
    with pytest.raises(loader._Unavailable, match="not one of portable, avx2, avx512, avx512bf16"):  # noqa: SLF001
        loader.cpu_flags()
    if detected != "avx512bf16":
        monkeypatch.setenv("ATTNKIT_NATIVE_ISA", "avx512bf16")
        with pytest.raises(loader._Unavailable, match="above what this CPU runs"):  # noqa: SLF001
            loader.cpu_flags()
    monkeypatch.delenv("ATTNKIT_NATIVE_ISA")
    assert loader.cpu_flags()[0] == detected


def test_no_compiler(fresh_loader, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert not native.available()
    assert "no C++ compiler" in native.why_unavailable()
    assert len(w) == 1 and "CXX" in str(w[0].message)


def test_build_key_follows_torch_source_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    level, flags = loader.cpu_flags()
    assert level in ("avx512bf16", "avx512", "avx2", "portable")
    key = loader.build_key(flags, "g++")
    assert loader.build_key(flags + ["-DX"], "g++") != key
    monkeypatch.setattr(torch, "__version__", "0.0.0-test")
    assert loader.build_key(flags, "g++") != key
    assert str(loader.cache_dir())


# ---------------------------------------------------------------------------- backward
@needs_native
@pytest.mark.parametrize("B,hq,hkv,nq,nk,d,dv", [
    (1, 2, 2, 97, 113, 59, 59), (2, 4, 2, 113, 97, 64, 32), (1, 3, 1, 1, 300, 16, 16),
    (1, 2, 1, 300, 1, 8, 8)])
def test_gradients_match_reference(B: int, hq: int, hkv: int, nq: int, nk: int, d: int,
                                   dv: int) -> None:
    check_grads(*qkv(B, hq, hkv, nq, nk, d, dv), torch.float32)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_with_score_terms_and_masks(dtype: torch.dtype) -> None:
    q, k, v = qkv(2, 4, 2, 130, 150, 32)
    check_score_term_grads(q, k, v, dtype)
    ids, kids = torch.arange(130) // 40, torch.arange(150) // 50
    check_grads(q, k, v, dtype, allowed=ids[:, None] == kids, doc_ids=ids, kv_doc_ids=kids)


@needs_native
@pytest.mark.parametrize("band", [(0, 49), (-45, 45), (-(350 - 300), math.inf), (3, 200)])
def test_gradients_by_band_sub_blocks(band: tuple[float, float]) -> None:
    """The backward's GEMMs also run a band's edge tiles as 32-key sub-blocks over the rows
    that see them: dQ, dK, dV (and the ALiBi / soft-cap chain rule) against float64."""
    q, k, v = qkv(1, 4, 2, 300, 350, 64)
    d = torch.arange(300)[:, None] - torch.arange(350)[None, :]
    allowed = (d >= band[0]) & (d <= band[1])
    check_grads(q, k, v, torch.float32, allowed=allowed, band=band)
    check_grads(q, k, v, torch.float32, allowed=allowed, oracle_opts={"softcap": 4.0},
                softcap=4.0, band=band)
    check_grads(q, k, v, torch.float32, allowed=allowed, oracle_opts={"score_mod": alibi(4)},
                alibi_slopes=alibi_slopes(4), band=band)
    kvl = torch.tensor([333])                               # NaN past the padding
    nan_rows = (torch.arange(350) >= 333).expand(1, 2, 350)
    check_grads(q, k, v, torch.float32, allowed=allowed & (torch.arange(350) < 333),
                kv_nan=nan_rows, band=band, kv_lengths=kvl)


@needs_native
@pytest.mark.parametrize("band", [(0, 49), (-(350 - 300), math.inf)])
def test_gradients_by_band_sub_blocks_read_unpadded_rows(band: tuple[float, float]) -> None:
    """D_k = 59, D_v = 37: the float32 backward's GEMMs read Q and dO rows where they lie
    (59 and 37 values apart, not copied padded to 64 and 48), also from a sub-block's
    first row on (r0 > 0)."""
    q, k, v = qkv(1, 4, 2, 300, 350, 59, 37)
    d = torch.arange(300)[:, None] - torch.arange(350)[None, :]
    check_grads(q, k, v, torch.float32, allowed=(d >= band[0]) & (d <= band[1]), band=band)


@needs_native
def test_gradients_with_empty_rows_and_nan_in_masked_kv() -> None:
    q, k, v = qkv(2, 2, 2, 97, 120, 16)
    check_grads(q, k, v, torch.float32, **masked_rows_grad_case(97, 120, 45, 60))


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gradients_with_softcap_and_nan_in_masked_keys(dtype: torch.dtype) -> None:
    """NaN in keys a dense mask blocks everywhere, under a soft-cap: the cap's per-key factor
    is NaN there, and dS must still be 0 where P is (dQ was NaN)."""
    q, k, v = qkv(1, 4, 2, 130, 200, 32)
    blocked = torch.arange(200) % 50 == 7
    check_grads(q, k, v, dtype, allowed=~blocked, kv_nan=blocked.expand(1, 2, 200),
                dense_mask=~blocked, oracle_opts={"softcap": 4.0}, softcap=4.0)


@needs_native
def test_gradients_through_a_problem() -> None:
    q, k, v = qkv(1, 4, 2, 97, 97, 32)
    qf, kf, vf = (t.float().requires_grad_() for t in (q, k, v))
    p = prepare(qf, kf, vf, is_causal=True, softcap=5.0).problem
    assert native.supports(p) == []
    out, _ = native.forward_problem(p)
    out.sum().backward()
    ref = torch.autograd.grad(
        oracle(q.requires_grad_(), k, v, softcap=5.0,
               allowed=torch.ones(97, 97, dtype=torch.bool).tril())[0].sum(), q)[0]
    assert (qf.grad.double() - ref).abs().max() < 1e-4
    with pytest.raises(NotImplementedError, match="first derivatives"):
        o, _ = native.forward(qf, kf, vf)
        g = torch.autograd.grad(o.sum(), qf, create_graph=True)[0]
        g.sum().backward()


def test_missing_sources(fresh_loader, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader, "SOURCES", [fresh_loader / "gone.cpp"])
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert not native.available()
    assert "sources are missing" in native.why_unavailable()


@needs_native
def test_zero_length_queries_or_keys() -> None:
    q, k, v = qkv(1, 2, 1, 5, 0, 8)
    out, lse = native.forward(q.float(), k.float(), v.float())
    assert out.shape == (1, 2, 5, 8) and (out == 0).all() and (lse == -math.inf).all()
    q, k, v = qkv(1, 2, 1, 0, 7, 8)
    out, lse = native.forward(q.float(), k.float(), v.float())
    assert out.shape == (1, 2, 0, 8) and lse.shape == (1, 2, 0)


@needs_native
def test_size_one_last_dim_with_any_stride() -> None:
    # a size-1 last dim keeps its stride through .contiguous(): accepted as it is
    q = torch.randn(1, 2, 1, 4).transpose(-1, -2).requires_grad_()    # (1, 2, 4, 1)
    k, v = (torch.randn(1, 2, 1, 6).transpose(-1, -2) for _ in range(2))
    out = ak.attention(q, k, v, backend="tiled")
    ref = ak.attention(q.double(), k.double(), v.double(), backend="reference")
    torch.testing.assert_close(out.double(), ref, atol=1e-6, rtol=1e-6)
    dout = torch.randn(1, 2, 1, 4).transpose(-1, -2)                    # a strided grad too
    (got,) = torch.autograd.grad(out, q, dout)
    (want,) = torch.autograd.grad(ref, q, dout.double())
    torch.testing.assert_close(got.double(), want.double(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n_q", [1, 45])             # the dot (decode) loops, the GEMM loops
def test_screened_operator_reads_the_screens_as_it_goes(dtype, n_q):
    """``attend_screened`` gives what ``attend`` gives, and says whether every query row it
    gathered and every output row it wrote is finite: a non-finite query row that attends,
    or a non-finite V row that is attended, is flagged; one a mask blocks (or past
    ``q_lengths``) is not; a call whose keys are split does not claim a finite output."""
    if not native.available():
        pytest.skip("native kernel unavailable")
    ops = native.loader.load()
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, n_q, 24).to(dtype), torch.randn(2, 2, 70, 24).to(dtype),
               torch.randn(2, 2, 70, 20).to(dtype))
    inf = math.inf

    def call(q_, v_, splits=1, **terms):
        rec = native.plain_terms(0.3, **terms)
        want = ops.attend(q_, k, v_, *rec, splits, 64)
        out, lse, q_ok, out_ok = ops.attend_screened(q_, k, v_, *rec, splits, 64)
        for got, exp in zip((out, lse), want, strict=True):    # the same, NaN where it is
            torch.testing.assert_close(got, exp, rtol=0, atol=0, equal_nan=True)
        return out, q_ok, out_ok

    out, q_ok, out_ok = call(q, v)
    assert q_ok and out_ok
    q_bad = q.clone()
    q_bad[1, 2, n_q - 1, 5] = math.nan
    out, q_ok, out_ok = call(q_bad, v)
    assert not q_ok and not out_ok and out[1, 2, n_q - 1].isnan().all()
    v_bad = v.clone()
    v_bad[0, 1, 33, 4] = inf                             # K/V head 1: query heads 2, 3
    out, q_ok, out_ok = call(q, v_bad)
    assert q_ok and not out_ok and not torch.isfinite(out[0, 2:, :, 4]).any()
    out, q_ok, out_ok = call(q, v_bad, band=(-inf, -40.0))  # k >= q + 40: not key 33
    assert q_ok and out_ok and torch.isfinite(out).all()
    lengths = torch.tensor([n_q, n_q - 1] if n_q > 1 else [1, 0])
    rec = native.plain_terms(0.3)._replace(q_len=lengths)
    out, _, q_ok, out_ok = ops.attend_screened(q_bad, k, v, *rec, 1, 64)
    assert q_ok and out_ok and not out[1, 2, n_q - 1].any()  # past q_len[1]: 0, not read
    k_long, v_long = torch.randn(2, 2, 400, 24).to(dtype), torch.randn(2, 2, 400, 20).to(dtype)
    rec = native.plain_terms(0.3)
    out, _, q_ok, out_ok = ops.attend_screened(q, k_long, v_long, *rec, 3, 64)  # 2 splits
    assert q_ok and not out_ok and torch.isfinite(out).all()
