"""The native kernel's low-precision backward: bfloat16 / float16 GEMMs (fp32 accumulation, P
and dS rounded to the input dtype before the GEMMs that use them) against the float64 oracle's
gradients, and the widening path (``ATTNKIT_NATIVE_LOWP_GEMM=0``) beside it. As for the forward
(test_native_lowp.py), ``ATTNKIT_NATIVE_LOWP_GEMM=emulate`` runs the GEMM path's packing and
sub-blocks on every CPU with a plain C++ product; the hardware path runs where the CPU has
the dtype's GEMMs (AVX512-BF16, AMX).

Shape legend: q (B, H_q, N_q, D_k), k (B, H_kv, N_k, D_k), v (B, H_kv, N_k, D_v).
Every gradient follows DESIGN: within 3× the naive low-precision formula's error (plus the
rounding floor of helpers/tolerance.py), and within 2× torch SDPA's own backward error.
"""

from __future__ import annotations

import math

import pytest
import torch

from attnkit.backends import native
from helpers.native_checks import (
    LOWP_SWITCH,
    check_grads,
    check_score_term_grads,
    grads_of,
    hardware_lowp_gemm,
    masked_rows_grad_case,
)
from helpers.native_checks import qkv64 as qkv
from helpers.oracle import oracle
from helpers.tolerance import max_err, rounding_floor

NATIVE = native.available()
pytestmark = pytest.mark.skipif(not NATIVE, reason=f"native kernel unavailable: "
                                                   f"{native.why_unavailable()}")
LOWP = (torch.bfloat16, torch.float16)


def causal(nq: int, nk: int) -> dict:
    """Top-left causal (key j allowed for query i when j <= i): the oracle's mask and band."""
    return {"allowed": torch.arange(nk) <= torch.arange(nq)[:, None], "band": (0, math.inf)}


# ---------------------------------------------------------------------------- sizes
@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("mask", ["dense", "causal"])
@pytest.mark.parametrize("B,hq,hkv,nq,nk,d,dv", [
    (1, 2, 1, 97, 113, 20, 20),           # GQA, D 20
    (2, 4, 2, 129, 257, 64, 64),          # GQA, N not a multiple of the key block (128)
    (1, 2, 2, 200, 77, 72, 72),           # N_q > N_k, D 72
    (1, 4, 2, 113, 300, 128, 64),         # GQA, D_v != D_k
    (1, 2, 1, 65, 141, 3, 5),             # odd D_k, D_v and N_q
    (1, 2, 2, 1, 130, 16, 16),            # one query
    (1, 1, 1, 300, 1, 8, 8),              # one key
])
def test_sizes_match_reference(dtype: torch.dtype, lowp_path: str, mask: str, B: int, hq: int,
                               hkv: int, nq: int, nk: int, d: int, dv: int) -> None:
    opts = causal(nq, nk) if mask == "causal" else {}
    check_grads(*qkv(B, hq, hkv, nq, nk, d, dv), dtype, **opts)


# ---------------------------------------------------------------------------- masks
@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("band", [(0, 49), (-45, 45), (3, 200), (-33, math.inf)])
def test_band_sub_blocks(dtype: torch.dtype, lowp_path: str, band: tuple[float, float]) -> None:
    """A band's edge tiles run as 32-key sub-blocks over the rows that see them, their rows
    rounded out to pairs (odd first and last rows here)."""
    q, k, v = qkv(1, 4, 2, 300, 350, 64)
    d = torch.arange(300)[:, None] - torch.arange(350)[None, :]
    check_grads(q, k, v, dtype, allowed=(d >= band[0]) & (d <= band[1]), band=band)


@pytest.mark.parametrize("dtype", LOWP)
def test_empty_rows_and_nan_in_masked_kv(dtype: torch.dtype, lowp_path: str) -> None:
    """Rows with no key (gradients 0), padded queries and keys, a key masked everywhere: NaN in
    the masked K/V rows never reaches a gradient (dK, dV of those rows are not compared)."""
    q, k, v = qkv(2, 2, 2, 97, 250, 24)
    check_grads(q, k, v, dtype, **masked_rows_grad_case(97, 250, 45, 61))


@pytest.mark.parametrize("dtype", LOWP)
def test_nan_in_masked_kv_with_softcap_and_band(dtype: torch.dtype, lowp_path: str) -> None:
    """NaN in keys a dense mask blocks everywhere (inside the keys the kernel reads, unlike
    padding) and past the padding, under a band with a soft-cap: the cap's per-key factor is
    NaN at those keys, and dS must still be 0 where P is."""
    q, k, v = qkv(1, 4, 2, 300, 350, 32)
    d = torch.arange(300)[:, None] - torch.arange(350)[None, :]
    kvl = torch.tensor([333])
    blocked = (torch.arange(350) % 50 == 7) | (torch.arange(350) >= 333)
    allowed = (d >= -45) & (d <= 45) & ~blocked
    check_grads(q, k, v, dtype, allowed=allowed, kv_nan=blocked.expand(1, 2, 350),
                band=(-45, 45), kv_lengths=kvl, dense_mask=~blocked,
                oracle_opts={"softcap": 4.0}, softcap=4.0)


# ---------------------------------------------------------------------------- score terms
@pytest.mark.parametrize("dtype", LOWP)
def test_softcap_alibi_and_bias(dtype: torch.dtype, lowp_path: str) -> None:
    q, k, v = qkv(2, 4, 2, 130, 150, 32)
    check_score_term_grads(q, k, v, dtype)


# ---------------------------------------------------------------------------- the path runs
@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("mode", ["gemm", "emulated"])
def test_gemm_path_rounds_p_and_ds(dtype: torch.dtype, mode: str,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The GEMM path's gradients differ from the widening path's (P and dS are rounded to the
    input dtype) on the same forward; brgemm and the emulated product agree to float32
    rounding of their sums."""
    if mode == "gemm" and not hardware_lowp_gemm(dtype):
        pytest.skip("no low-precision GEMMs on this CPU: " + str(native.low_precision_paths()))
    q, k, v = (t.to(dtype) for t in qkv(1, 4, 2, 256, 256, 64))
    dout = torch.randn(1, 4, 256, 64, dtype=torch.float64)
    dlse = torch.zeros(1, 4, 256, dtype=torch.float64)
    monkeypatch.setenv("ATTNKIT_NATIVE_LOWP_GEMM", "0")
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = native.forward(qq, kk, vv, band=(0, math.inf))
    got = {}
    for flag in (LOWP_SWITCH[mode], "0", "emulate"):
        monkeypatch.setenv("ATTNKIT_NATIVE_LOWP_GEMM", flag)
        got[flag] = torch.autograd.grad((out.double() * dout).sum() + (lse * dlse).sum(),
                                        (qq, kk, vv), retain_graph=True)
    for name, a, w, e in zip("qkv", got[LOWP_SWITCH[mode]], got["0"], got["emulate"], strict=True):
        assert not torch.equal(a, w), f"d{name}: the GEMM path gave the widening path's result"
        scale = e.float().abs().max()
        assert (a.float() - e.float()).abs().max() <= 4 * torch.finfo(dtype).eps * scale, name


# ---------------------------------------------------------------------------- vs torch SDPA
@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("is_causal", [False, True])
def test_within_twice_torch_sdpa_backward_error(dtype: torch.dtype, lowp_path: str,
                                                is_causal: bool) -> None:
    q, k, v = qkv(1, 4, 4, 384, 384, 64)
    dout = torch.randn(1, 4, 384, 64, dtype=torch.float64)
    dlse = torch.zeros(1, 4, 384, dtype=torch.float64)
    allowed = torch.ones(384, 384, dtype=torch.bool).tril() if is_causal else None
    g64 = grads_of(q, k, v, lambda a, b, c: oracle(a, b, c, allowed=allowed)[:2], dout, dlse)

    def sdpa(a, b, c):  # noqa: ANN001, ANN202
        return (torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=is_causal),
                torch.zeros(1, 4, 384, dtype=torch.float64))

    low = [t.to(dtype) for t in (q, k, v)]
    gs = grads_of(*low, sdpa, dout, dlse)
    gn = grads_of(*low, lambda a, b, c: native.forward(
        a, b, c, band=(0, math.inf) if is_causal else None), dout, dlse)
    for name, got, ref, exact in zip("qkv", gn, gs, g64, strict=True):
        budget = 2 * max_err(ref, exact) + rounding_floor(exact, dtype, 16.0)
        assert max_err(got, exact) <= budget, (name, max_err(got, exact), max_err(ref, exact))
