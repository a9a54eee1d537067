"""The native kernel's bfloat16 dot (decode) loops — fewer than 16 query rows per work item —
against the float64 oracle. On a CPU with AVX512-BF16 (the build's ``avx512bf16`` level) Q·Kᵀ
reads bf16 K rows as pairs of dims (even ``<< 16``, odd ``& 0xffff0000``) with float FMAs,
rows 4 and 2 at a time, and a single row on ``vdpbf16ps`` (bf16 pairs, exact products, float
sums); P·V reads bf16 V rows as pairs likewise; elsewhere the rows are
widened as before (that build is the one test_native.py's narrower-level test runs at
``ATTNKIT_NATIVE_ISA=avx512``).

Every case checks DESIGN's budget (within 2× the naive bfloat16 formula's error) and, sharper,
that the result equals the float32 kernel's on the same bf16 values: q and k are bf16, so every
product is exact and only the float sums' order differs — the LSE agrees to float rounding and
the output to one bf16 rounding (a wrong lane, dim or key order is off by O(1)).

Shape legend: q (B, H_q, N_q, D_k), k (B, H_kv, N_k, D_k), v (B, H_kv, N_k, D_v).
"""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from attnkit.backends import native
from attnkit.backends.native import loader
from helpers.native_checks import check, poisoned_kv

NATIVE = native.available()
pytestmark = pytest.mark.skipif(not NATIVE, reason=f"native kernel unavailable: "
                                                   f"{native.why_unavailable()}")
BF16 = torch.bfloat16


def _dot_bf16_built() -> bool:
    return loader.cpu_flags()[0] == "avx512bf16"


def qkv(B: int, hq: int, hkv: int, nq: int, nk: int, dk: int, dv: int | None = None,
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 inputs already on the bf16 grid (so the float32 kernel sees the same values)."""
    return tuple(torch.randn(*s, dtype=torch.float64).to(BF16).double()  # type: ignore[return-value]
                 for s in ((B, hq, nq, dk), (B, hkv, nk, dk), (B, hkv, nk, dv or dk)))


def same_as_float32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                    **opts: object) -> None:
    """native.forward in bf16 equals the float32 kernel on the same values: LSE to float
    rounding, output within one bf16 rounding of the float32 output."""
    kk, vv = kv if kv is not None else (k, v)
    with torch.no_grad():
        out, lse = native.forward(q.to(BF16), kk.to(BF16), vv.to(BF16), **opts)
        out32, lse32 = native.forward(q.float(), kk.float(), vv.float(), **opts)
    assert torch.equal(lse == -math.inf, lse32 == -math.inf)
    fin = lse32 != -math.inf
    assert ((lse - lse32)[fin].abs() <= 1e-5 * (1 + lse32[fin].abs())).all(), \
        (lse - lse32)[fin].abs().max()
    ulp = torch.finfo(BF16).eps * out32.abs() + 1e-30       # one bf16 rounding, and a hair
    assert ((out.float() - out32).abs() <= ulp * 1.01).all(), (out.float() - out32).abs().max()


def test_the_bf16_dot_loops_are_built_where_the_cpu_has_them() -> None:
    with open("/proc/cpuinfo") as f:
        flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    if "avx512_bf16" not in flags or "ATTNKIT_NATIVE_ISA" in __import__("os").environ:
        pytest.skip("this CPU (or the ISA override) has no AVX512-BF16 build")
    assert _dot_bf16_built(), loader.cpu_flags()


# ---------------------------------------------------------------------------- sizes
@pytest.mark.parametrize("B,hq,hkv,nq,nk,dk,dv", [
    (1, 8, 8, 1, 4096, 64, 64),          # the decode benchmark's shape
    (2, 4, 2, 1, 113, 20, 20),           # GQA, D under one vdpbf16ps (32 dims)
    (1, 8, 1, 1, 97, 72, 72),            # 8 rows per item, D = 2 * 32 + 8
    (1, 2, 2, 3, 1000, 100, 100),        # N_q 3, D = 3 * 32 + 4
    (1, 4, 4, 1, 17, 64, 64),            # one block of 16 keys and a tail of 1
    (1, 15, 1, 1, 50, 8, 40),            # 15 rows, D_v != D_k
    (1, 4, 4, 2, 33, 256, 256),
    (1, 2, 1, 7, 129, 59, 111),          # 14 rows
    (1, 1, 1, 1, 1, 1, 1),
    (1, 4, 4, 1, 40, 48, 48),            # D = 32 + 16: acc's last chunk is half a chunk
    (1, 32, 8, 1, 300, 128, 128),        # the GQA decode benchmark's heads
])
def test_sizes(B: int, hq: int, hkv: int, nq: int, nk: int, dk: int, dv: int) -> None:
    q, k, v = qkv(B, hq, hkv, nq, nk, dk, dv)
    check(q, k, v, BF16)
    same_as_float32(q, k, v)


@pytest.mark.parametrize("rows", range(1, 16))
def test_every_row_count(rows: int) -> None:
    """R = 1 .. 15 query rows per K/V head (GQA): blocks of 4 and 2 rows on the pairs, a last
    single row on vdpbf16ps; D = 32 + 8 (a whole chunk and a part), two blocks of 16 keys and
    a tail of 5."""
    q, k, v = qkv(1, rows, 1, 1, 37, 40)
    check(q, k, v, BF16)
    same_as_float32(q, k, v)


def test_key_splits_and_query_blocks() -> None:
    """Split-K (partials merged by LSE) and several query blocks per head, both on the loops."""
    q, k, v = qkv(1, 4, 2, 5, 777, 64)
    for opts in ({"splits": 3}, {"splits": 7, "block_q": 2}, {"block_q": 1}):
        check(q, k, v, BF16, **opts)
        same_as_float32(q, k, v, **opts)


# ---------------------------------------------------------------------------- masks
def test_masks_and_fully_masked_rows() -> None:
    """Band, padding with a sequence that sees nothing, a dense mask (blocks of 16 keys with
    and without P == 0: the pairs loop and the key-by-key one) and a row with no key."""
    q, k, v = qkv(2, 4, 2, 3, 301, 72)
    i, j = torch.arange(3)[:, None], torch.arange(301)
    check(q, k, v, BF16, allowed=j <= i + 298, band=(-298, math.inf))
    same_as_float32(q, k, v, band=(-298, math.inf))
    kvl = torch.tensor([301, 0])                                   # batch 1: no key at all
    pad = (j < kvl.view(2, 1, 1, 1)).expand(2, 4, 3, 301)
    check(q, k, v, BF16, allowed=pad, kv_lengths=kvl)
    same_as_float32(q, k, v, kv_lengths=kvl)
    dense = torch.rand(2, 4, 3, 301) < 0.5
    dense[..., 32:64] = True                                       # two whole blocks allowed
    dense[0, 1, 2] = False                                         # one empty row
    check(q, k, v, BF16, allowed=dense, dense_mask=dense)
    same_as_float32(q, k, v, dense_mask=dense)


def test_nan_and_inf_in_masked_kv_rows_stay_out() -> None:
    """NaN / inf in K/V rows past kv_lengths and in a masked key inside a block of 16."""
    q, k, v = qkv(2, 8, 2, 1, 203, 100)
    kvl = torch.tensor([201, 37])
    k2, v2, allowed = poisoned_kv(k, v, kvl, 5)
    mask = allowed.expand(2, 8, 1, 203)
    out, _ = check(q, k, v, BF16, allowed=allowed, kv=(k2, v2), kv_lengths=kvl, dense_mask=mask)
    assert torch.isfinite(out).all()
    same_as_float32(q, k, v, kv=(k2, v2), kv_lengths=kvl, dense_mask=mask)


def test_nan_in_an_allowed_value_propagates() -> None:
    """A NaN in an allowed V row reaches the output rows that see it (as the reference)."""
    q, k, v = qkv(1, 2, 1, 1, 64, 64)
    v[0, 0, 20, 3] = math.nan
    with torch.no_grad():
        out, _ = native.forward(q.to(BF16), k.to(BF16), v.to(BF16))
    assert out[0, :, 0, 3].isnan().all() and not out[0, :, 0, :3].isnan().any()


def test_strided_rows() -> None:
    """K/V rows at a stride wider than D (a slice of a larger cache): the loads stop at D."""
    q, k, v = qkv(1, 4, 4, 1, 150, 96)
    kbig, vbig = (torch.full((1, 4, 150, 128), math.nan, dtype=torch.float64) for _ in "kv")
    kbig[..., :72], vbig[..., :72] = k[..., :72], v[..., :72]
    ks, vs = kbig[..., :72], vbig[..., :72]                        # NaN just past each row
    check(q[..., :72], k[..., :72], v[..., :72], BF16, kv=(ks, vs))
    same_as_float32(q[..., :72], k[..., :72], v[..., :72], kv=(ks, vs))


# ---------------------------------------------------------------------------- the eager call
def test_the_eager_per_token_call() -> None:
    """ak.scaled_dot_product_attention's lean call (a decoder's per-token path) in bf16."""
    q, k, v = qkv(1, 8, 2, 1, 517, 64)
    with torch.no_grad():
        out = ak.scaled_dot_product_attention(q.to(BF16), k.to(BF16), v.to(BF16),
                                              enable_gqa=True)
        out32 = ak.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
    assert out.dtype == BF16
    assert ((out.float() - out32).abs() <= torch.finfo(BF16).eps * out32.abs() * 1.01).all()
