"""The native kernel's low-precision forward: bfloat16 / float16 GEMMs (fp32 accumulation, P
rounded to the input dtype before P·V) against the float64 oracle, and the widening path
(``ATTNKIT_NATIVE_LOWP_GEMM=0``: inputs widened to float32, float32 GEMMs) beside it. The GEMM
path's code runs on every CPU: ``ATTNKIT_NATIVE_LOWP_GEMM=emulate`` gives it a plain C++ product
of the same packed operands in place of oneDNN's brgemm (the "emulated" path below), and the
hardware path runs where the CPU has bf16 / fp16 GEMMs (AVX512-BF16, AMX).

Shape legend: q (B, H_q, N_q, D_k), k (B, H_kv, N_k, D_k), v (B, H_kv, N_k, D_v).
Every comparison follows DESIGN: within 2× the naive low-precision formula's error (with the
rounding floor of conftest), and within 2× torch SDPA's own error in the same dtype.
"""

from __future__ import annotations

import math

import pytest
import torch

from attnkit.backends import native
from attnkit.scores import alibi, alibi_slopes
from helpers.native_checks import LOWP_SWITCH, check, hardware_lowp_gemm, poisoned_kv
from helpers.native_checks import qkv64 as qkv
from helpers.oracle import oracle
from helpers.tolerance import assert_low_precision_grad_close, max_err, rounding_floor

NATIVE = native.available()
pytestmark = pytest.mark.skipif(not NATIVE, reason=f"native kernel unavailable: "
                                                   f"{native.why_unavailable()}")
LOWP = (torch.bfloat16, torch.float16)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()




# ---------------------------------------------------------------------------- the path
def test_the_path_is_reported() -> None:
    info = native.low_precision_paths()
    assert set(info) == {"bfloat16", "float16"} and all(isinstance(s, str) for s in info.values())
    if "avx512_bf16" in _cpu_flags() or "amx_bf16" in _cpu_flags():
        assert info["bfloat16"].startswith("bfloat16 GEMMs"), info
    if "avx512_fp16" in _cpu_flags() and "amx_fp16" not in _cpu_flags():
        # oneDNN's float16 brgemm there reads B unpacked: the reason says so
        assert (info["float16"].startswith("float16 GEMMs")
                or "float16 brgemm on this CPU reads B row-major" in info["float16"]), info


def test_the_switch_forces_widening_or_emulation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNKIT_NATIVE_LOWP_GEMM", "0")
    info = native.low_precision_paths()
    assert all("ATTNKIT_NATIVE_LOWP_GEMM=0" in s for s in info.values()), info
    monkeypatch.setenv("ATTNKIT_NATIVE_LOWP_GEMM", "emulate")
    info = native.low_precision_paths()
    assert all(s.endswith(" GEMMs emulated in plain C++ (ATTNKIT_NATIVE_LOWP_GEMM=emulate: "
                          "the path's test mode, slow)") for s in info.values()), info


@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("mode", ["gemm", "emulated"])
def test_gemm_path_rounds_p(dtype: torch.dtype, mode: str,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the GEMM path runs, its output differs from the widening path's (P is rounded to
    the input dtype) while both stay within DESIGN's budget; brgemm and the emulated product
    agree to float32 rounding of their sums."""
    if mode == "gemm" and not hardware_lowp_gemm(dtype):
        pytest.skip("no low-precision GEMMs on this CPU: " + str(native.low_precision_paths()))
    q, k, v = (t.to(dtype) for t in qkv(1, 4, 2, 256, 256, 64))
    outs = {}
    for flag in (LOWP_SWITCH[mode], "0", "emulate"):
        monkeypatch.setenv("ATTNKIT_NATIVE_LOWP_GEMM", flag)
        outs[flag] = native.forward(q, k, v)[0]
    assert not torch.equal(outs[LOWP_SWITCH[mode]], outs["0"])
    assert (outs[LOWP_SWITCH[mode]].float() - outs["emulate"].float()).abs().max() <= 4 * (
        torch.finfo(dtype).eps * outs["emulate"].float().abs().max())


@pytest.mark.parametrize("generic", [False, True])
def test_p_rounds_to_nearest_even(generic: bool) -> None:
    """P's rounding to bfloat16 — the build's (one vcvtneps2bf16 where the kernel is built
    for avx512bf16, as on a CPU with AVX512-BF16) and the plain vector code every build has
    (generic) — matches torch's round-to-nearest-even on ties, carries, overflow to inf, inf,
    NaN and ±0; float32 denormals round as torch does or, by the instruction, flush to ±0."""
    torch.manual_seed(0)
    ties = torch.tensor([0x3F808000, 0x3F818000, 0xBF808000, 0x3F80_7FFF, 0x3F80_8001,
                         0x477F_FFFF, 0x7F7F_FFFF, 0x7F7F_7FFF, 0x7F80_0000, 0xFF80_0000,
                         0x0000_0000, 0x8000_0000, 0x0080_0000, 0x0080_8000],
                        dtype=torch.int64).to(torch.int32).view(torch.float32)
    wide = torch.randn(4099) * torch.exp2(torch.randint(-120, 120, (4099,)).float())
    x = torch.cat([ties, wide, torch.rand(1000)])            # (P itself lies in [0, 1])
    got = native._ops().round_to_bfloat16(x, generic)  # noqa: SLF001
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert torch.equal(got.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))
    nan = native._ops().round_to_bfloat16(torch.tensor([math.nan, -math.nan]), generic)  # noqa: SLF001
    assert nan.isnan().all()
    tiny = torch.tensor([0x0000_0001, 0x0001_8000, 0x007F_FFFF, 0x8001_8000],
                        dtype=torch.int64).to(torch.int32).view(torch.float32)
    got = native._ops().round_to_bfloat16(tiny, generic)  # noqa: SLF001
    want = tiny.to(torch.bfloat16)
    same = got.view(torch.int16) == want.view(torch.int16)
    flushed = (got == 0) & (torch.signbit(got.float()) == torch.signbit(tiny))
    assert (same if generic else same | flushed).all(), (got, want)


# ---------------------------------------------------------------------------- sizes
@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("B,hq,hkv,nq,nk,d,dv", [
    (1, 2, 1, 97, 113, 1, 1),
    (1, 2, 2, 130, 301, 3, 3),
    (2, 4, 2, 129, 257, 64, 64),          # GQA, N not a multiple of the tile
    (1, 2, 2, 200, 77, 80, 80),           # N_q > N_k
    (1, 4, 2, 113, 1025, 128, 64),        # GQA, D_v != D_k
    (1, 1, 1, 70, 140, 256, 256),
])
def test_sizes_match_reference(dtype: torch.dtype, lowp_path: str, B: int, hq: int, hkv: int,
                               nq: int, nk: int, d: int, dv: int) -> None:
    check(*qkv(B, hq, hkv, nq, nk, d, dv), dtype)


@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("head_cache", ["1", "0"])
def test_spans_of_tiles(dtype: torch.dtype, lowp_path: str, head_cache: str,
                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The GEMM loop takes key tiles two at a time (one row pass, one P·V over both): with
    the head cache and without it (each tile of a span packed into its own slot), V over two
    planes of 64 columns, an odd last tile, causal and sliding-window cuts inside a span, and
    a non-finite K / V row (masked) in the second tile of a span, which then goes alone."""
    monkeypatch.setenv("ATTNKIT_NATIVE_HEAD_CACHE", head_cache)
    q, k, v = qkv(1, 4, 2, 300, 777, 64, 128)
    check(q, k, v, dtype)
    i, j = torch.arange(300)[:, None], torch.arange(777)
    check(q, k, v, dtype, allowed=j <= i + 477, band=(-477, math.inf))
    check(q, k, v, dtype, allowed=(i - j >= -477) & (i - j <= -277), band=(-477, -277))
    allowed = (j != 140).expand(300, 777)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 140], v2[:, :, 140] = math.inf, math.nan
    check(q, k, v, dtype, allowed=allowed, kv=(k2, v2), dense_mask=allowed.expand(1, 4, 300, 777))


@pytest.mark.parametrize("dtype", LOWP)
def test_huge_scores_keep_their_softmax(dtype: torch.dtype, lowp_path: str) -> None:
    """Huge scores (q·k up to 1e30 in bf16, 3.6e9 in fp16): a row's largest gets weight 1
    and the others theirs (the exponent's shift is rounded as the scores are, so it is exact
    at the max, not |m| · 2^-23 off: 2^(1e22) at 1e30)."""
    big = 1e15 if dtype == torch.bfloat16 else 6e4          # (within the dtype's range)
    q, k, v = qkv(1, 2, 1, 40, 300, 64)
    q[0, :, 9, 0], k[0, 0, 150, 0] = big, big               # row 9, key 150: big² / 8
    q[0, 1, 20, 0], k[0, 0, 280, 0] = 3e3, 2e3              # row 20 of head 1: 6e6 / 8
    check(q, k, v, dtype)


# ---------------------------------------------------------------------------- masks
@pytest.mark.parametrize("dtype", LOWP)
def test_masks(dtype: torch.dtype, lowp_path: str) -> None:
    q, k, v = qkv(2, 2, 1, 200, 233, 64)
    i, j = torch.arange(200)[:, None], torch.arange(233)
    check(q, k, v, dtype, allowed=j <= i + 33, band=(-33, math.inf))       # causal, bottom-right
    check(q, k, v, dtype, allowed=(i - j >= 0) & (i - j <= 63), band=(0, 63))  # sliding window
    kvl = torch.tensor([233, 150])
    pad = (j < kvl.view(2, 1, 1, 1)).expand(2, 2, 200, 233)
    check(q, k, v, dtype, allowed=pad, kv_lengths=kvl)                     # padding
    # rows 213.. see no key (q - k <= -20 needs k >= q + 20 > 232): output 0, LSE -inf
    check(q, k, v, dtype, allowed=i - j <= -20, band=(-math.inf, -20))
    dense = torch.rand(200, 233) < 0.3
    dense[7] = False                                                       # one empty row
    check(q, k, v, dtype, allowed=dense, dense_mask=dense.expand(2, 2, 200, 233))


@pytest.mark.parametrize("dtype", LOWP)
def test_nan_in_masked_kv_rows_stays_out(dtype: torch.dtype, lowp_path: str) -> None:
    """NaN / inf in masked K/V rows — padded rows, a masked key, and the row just past an
    odd-length last tile that the GEMM's even key count would touch — never reach the out."""
    q, k, v = qkv(2, 2, 1, 97, 301, 32)
    kvl = torch.tensor([201, 37])
    k2, v2, allowed = poisoned_kv(k, v, kvl, 5)
    check(q, k, v, dtype, allowed=allowed, kv=(k2, v2), kv_lengths=kvl,
          dense_mask=allowed.expand(2, 2, 97, 301))
    check(q, k, v, dtype, allowed=allowed, kv=(k2, v2), kv_lengths=kvl,
          dense_mask=allowed.expand(2, 2, 97, 301), block_q=16)


# ---------------------------------------------------------------------------- score terms
@pytest.mark.parametrize("dtype", LOWP)
def test_softcap_and_alibi(dtype: torch.dtype, lowp_path: str) -> None:
    q, k, v = qkv(1, 4, 2, 64, 700, 64)
    causal = torch.arange(700) <= torch.arange(64)[:, None] + 636
    check(q, k, v, dtype, oracle_opts={"softcap": 5.0}, softcap=5.0)
    check(q, k, v, dtype, allowed=causal, oracle_opts={"score_mod": alibi(4)},
          alibi_slopes=alibi_slopes(4), band=(-636, math.inf))


def assert_lse_float32(lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       dtype: torch.dtype, **oracle_opts: object) -> None:
    """The kernel's LSE (float32) within 5e-7 · (1 + |LSE|) of the oracle's on the same
    ``dtype``-rounded inputs in float64: the score terms and the softmax in float32, to a few
    ulp (the soft-cap's forms to 2^-25 of tanh; one coefficient off by 1/15 gives 1e-6)."""
    _, ref, _ = oracle(*(t.to(dtype).double() for t in (q, k, v)), **oracle_opts)
    fin = torch.isfinite(ref)
    err = ((lse.double() - ref).abs() / (1 + ref.abs()))[fin]
    assert err.numel() == 0 or err.max().item() <= 5e-7, err.max().item()


# Soft-cap with no other score term: capped inside the exponent pass on tiles without mask or
# padding (in one of three forms, by a span's largest |score * scale / cap|: the Taylor
# series' first terms below 0.18, the odd polynomial below 0.625, else tanh through e^x), in
# place before the mask on the others. (cap, q's scale): forms 3 (exponents bounded, c < 43),
# 3 and 5 unbounded (c = 60), 5 and 0, 0, and a huge cap (tiny ratio).
@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize(("cap", "q_scale"), [(30.0, 1.0), (60.0, 3.0), (5.0, 1.0), (2.0, 2.0),
                                              (1e8, 1.0)])
def test_softcap_in_the_exponent_pass(dtype: torch.dtype, lowp_path: str, cap: float,
                                      q_scale: float) -> None:
    q, k, v = qkv(2, 4, 2, 97, 301, 59)
    check_term_masks(q * q_scale, k, v, dtype, {"softcap": cap}, {"softcap": cap}, 204, 225, 150)


def check_term_masks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype,
                     opts: dict, oracle_opts: dict, shift: int, cut: int,
                     short: int) -> torch.Tensor:
    """A score term's call (``opts``; the oracle's ``oracle_opts``) against the oracle with
    no mask and a causal band shifted by ``shift`` (both with the LSE to float32 precision),
    rows from N_k − cut on seeing no key (output 0, LSE −inf), and NaN / inf in the K/V rows
    past a second batch's length ``short`` → the causal mask (N_q, N_k)."""
    n_q, n_k = q.shape[2], k.shape[2]
    opts = {"oracle_opts": oracle_opts, **opts}
    _, lse = check(q, k, v, dtype, **opts)                                  # no mask
    assert_lse_float32(lse, q, k, v, dtype, **oracle_opts)
    i, j = torch.arange(n_q)[:, None], torch.arange(n_k)
    causal = j <= i + shift
    _, lse = check(q, k, v, dtype, allowed=causal, band=(-shift, math.inf), **opts)
    assert_lse_float32(lse, q, k, v, dtype, allowed=causal, **oracle_opts)
    # q - k <= -cut needs k >= q + cut: rows from n_k - cut on see no key
    check(q, k, v, dtype, allowed=i - j <= -cut, band=(-math.inf, -cut), **opts)
    kvl = torch.tensor([n_k, short])
    k2, v2, allowed = poisoned_kv(k, v, kvl, 5)                 # NaN / inf in masked K/V rows
    check(q, k, v, dtype, allowed=allowed, kv=(k2, v2), kv_lengths=kvl,
          dense_mask=allowed.expand(q.shape[0], q.shape[1], n_q, n_k), **opts)
    return causal


@pytest.mark.parametrize("dtype", LOWP)
def test_softcap_huge_scores(dtype: torch.dtype, lowp_path: str) -> None:
    """Huge scores under a soft-cap (tanh's e^x form, capped at ±c): the row's largest gets
    weight e^(c tanh(...)) as the oracle's."""
    big = 1e15 if dtype == torch.bfloat16 else 6e4
    q, k, v = qkv(1, 2, 1, 40, 300, 64)
    q[0, :, 9, 0], k[0, 0, 150, 0] = big, big
    q[0, 1, 20, 0], k[0, 0, 280, 0] = -3e3, 2e3
    for cap in (5.0, 50.0):
        check(q, k, v, dtype, oracle_opts={"softcap": cap}, softcap=cap)


def _distance_mod(s, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202 — reads h, q_idx, kv_idx
    return s + (0.01 * (h + 1) * (q_idx - kv_idx)).to(s.dtype)


@pytest.mark.parametrize("dtype", LOWP)
def test_score_mod_on_the_raw_scores(dtype: torch.dtype, lowp_path: str) -> None:
    """A compiled score_mod on the low-precision path: called once per row over a span's
    keys (two tiles), on the raw scores with the scale (score_mod.h), or after the soft-cap
    with scale 1; against the oracle with masks cutting tiles, rows without keys, NaN in
    masked K/V, GQA, N_q != N_k, and its LSE to float32 precision."""
    from attnkit.backends.native import score_mod as sm
    mod = sm.compile_score_mod(_distance_mod)
    q, k, v = qkv(2, 4, 2, 97, 700, 59)
    causal = check_term_masks(q, k, v, dtype, {"score_mod": mod}, {"score_mod": _distance_mod},
                              603, 620, 333)
    capped = {"oracle_opts": {"score_mod": _distance_mod, "softcap": 5.0}, "score_mod": mod,
              "softcap": 5.0}
    _, lse = check(q, k, v, dtype, allowed=causal, band=(-603, math.inf), **capped)
    assert_lse_float32(lse, q, k, v, dtype, allowed=causal, score_mod=_distance_mod, softcap=5.0)


# ---------------------------------------------------------------------------- vs torch SDPA
@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("causal", [False, True])
def test_within_twice_torch_sdpa_error(dtype: torch.dtype, lowp_path: str, causal: bool) -> None:
    q, k, v = qkv(1, 4, 4, 384, 384, 64)
    allowed = torch.ones(384, 384, dtype=torch.bool).tril() if causal else None
    ref, _, _ = oracle(q, k, v, allowed=allowed)
    ql, kl, vl = (t.to(dtype) for t in (q, k, v))
    with torch.no_grad():
        sdpa = torch.nn.functional.scaled_dot_product_attention(ql, kl, vl, is_causal=causal)
        out, _ = native.forward(ql, kl, vl, band=(0, math.inf) if causal else None)
    budget = 2 * max_err(sdpa, ref) + rounding_floor(ref, dtype, 8.0)
    assert max_err(out, ref) <= budget, (max_err(out, ref), max_err(sdpa, ref))


# ---------------------------------------------------------------------------- backward
def test_backward_after_the_lowp_forward(lowp_path: str) -> None:
    """The backward (widening) reuses the forward's saved out and LSE: its gradients stay
    within 3× the naive bfloat16 formula's."""
    q, k, v = qkv(1, 4, 2, 130, 150, 32)
    tril = torch.ones(130, 150, dtype=torch.bool).tril(20)
    dout = torch.randn(1, 4, 130, 32, dtype=torch.float64)

    def grads(dt: torch.dtype, fn) -> list[torch.Tensor]:  # noqa: ANN001
        qq, kk, vv = (t.to(dt).detach().requires_grad_() for t in (q, k, v))
        (fn(qq, kk, vv).double() * dout).sum().backward()
        return [t.grad for t in (qq, kk, vv)]

    g64 = grads(torch.float64, lambda a, b, c: oracle(a, b, c, allowed=tril)[0])
    glow = grads(torch.bfloat16, lambda a, b, c: oracle(a, b, c, allowed=tril,
                                                        dtype=torch.bfloat16)[0])
    gn = grads(torch.bfloat16, lambda a, b, c: native.forward(a, b, c, band=(-20, math.inf))[0])
    for name, got, lo, hi in zip("qkv", gn, glow, g64, strict=True):
        assert_low_precision_grad_close(got, lo, hi, what=f"d{name}")
