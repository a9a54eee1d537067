"""The native kernel's one-pass finiteness check (``native.all_finite``), which the eager path's
NaN/inf screens ask first: K and V up front under a Python score_mod with gradients (without:
the kernel's own screen of the K/V tiles it reads, else this one after the call), the query
rows on the tiled backend. It must agree with ``torch.isfinite(t).all()`` for
every dtype, every position of the bad value (a row's vector part and its tail, the first and
the last row), any strides (a strided last dim, transposed dims, a batch-broadcast view),
and the screens built on it must still find the rows: a NaN V row a score_mod scores −∞ gives
NaN, a NaN query row gives NaN where it attends (float64 reference: the same NaN pattern,
the other rows within budget).

Shape legend: t (B, H, N, D); q (B, H_q, N_q, D_k), k (B, H_kv, N_k, D_k), v (B, H_kv, N_k, D_v).
"""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from attnkit.backends import native
from helpers.tolerance import assert_low_precision_close

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernel unavailable")
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _drop_key_3(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
    return torch.where(kv_idx == 3, -math.inf, score - 0.01 * (q_idx - kv_idx).abs())


def _assert_as_reference(got: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor) -> None:
    """``got`` = the causal call under ``_drop_key_3`` as the float64 reference gives it
    (float32: within 1e-5; bf16 / fp16: the low-precision rule)."""
    ref64 = ak.attention(q.double(), k.double(), v.double(), is_causal=True,
                         score_mod=_drop_key_3, backend="reference")
    if got.dtype == torch.float32:
        torch.testing.assert_close(got.double(), ref64, rtol=1e-5, atol=1e-6)
    else:
        ref_lowp = ak.attention(q, k, v, is_causal=True, score_mod=_drop_key_3,
                                backend="reference")
        assert_low_precision_close(got, ref_lowp, ref64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1, 19, 64, 111])
def test_all_finite_agrees_with_torch_at_every_position(dtype, d):
    torch.manual_seed(0)
    t = torch.randn(2, 3, 5, d).to(dtype)
    assert native.all_finite(t) is True
    for bad in (math.nan, math.inf, -math.inf):
        for idx in ((0, 0, 0, 0), (1, 2, 4, d - 1), (1, 1, 2, d // 2), (0, 2, 1, min(d - 1, 16))):
            u = t.clone()
            u[idx] = bad
            assert native.all_finite(u) is False, (bad, idx)
            assert bool(torch.isfinite(u).all()) is False


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_finite_reads_bits_every_finite_extreme_passes(dtype):
    """The test reads the exponent bits: the largest finite values, the smallest subnormal,
    −0 pass; NaN, +inf and −inf at every position of a head's rows read as one span (past
    the vector part, in the tail, on a row boundary) are found."""
    info = torch.finfo(dtype)
    sub = {torch.float32: 2.0 ** -149, torch.float64: 2.0 ** -1074, torch.bfloat16: 2.0 ** -133,
           torch.float16: 2.0 ** -24}[dtype]                 # the smallest subnormal
    t = torch.tensor([info.max, -info.max, sub, -0.0, info.tiny, 1.0], dtype=dtype)
    assert t[2].item() > 0                                 # (not flushed to zero)
    t = t.repeat(3 * 5 * 13 // 6 + 1)[: 3 * 5 * 13].view(1, 3, 5, 13)
    assert native.all_finite(t) is True
    for flat in range(t.numel()):
        u = t.clone()
        u.view(-1)[flat] = (math.nan, math.inf, -math.inf)[flat % 3]
        assert native.all_finite(u) is False, flat


def test_all_finite_splits_large_tensors_over_threads():
    """From 64k elements the rows are split over the threads: a bad value in the first, a
    middle or the last row is found whichever thread reads it."""
    t = torch.randn(2, 4, 3001, 64).bfloat16()
    assert native.all_finite(t) is True
    for idx in ((0, 0, 0, 0), (1, 1, 1500, 33), (1, 3, 3000, 63)):
        u = t.clone()
        u[idx] = math.nan
        assert native.all_finite(u) is False, idx


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_finite_reads_any_strides(dtype):
    torch.manual_seed(1)
    wide = torch.randn(2, 3, 7, 38).to(dtype)
    views = {
        "strided last dim": wide[..., ::2],
        "transposed": wide.transpose(1, 2),
        "batch broadcast": wide[:1].expand(4, -1, -1, -1),
        "heads sliced": wide[:, 1:],
    }
    for name, view in views.items():
        assert native.all_finite(view) is True, name
    wide[0, 2, 6, 37] = math.nan              # an odd column: outside the ::2 view only
    assert native.all_finite(wide[..., ::2]) is True and native.all_finite(wide) is False
    wide[0, 2, 6, 36] = math.inf              # the last element of every view
    for name, view in views.items():
        assert native.all_finite(view) is False, name
    assert native.all_finite(wide[1:, :, :, ::2]) is True                 # batch 1 only
    assert native.all_finite(torch.randn(1, 2, 3, 0).to(dtype)) is True
    assert native.all_finite(torch.randn(3, 4).to(dtype)) is None        # not 4-D: torch's


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_score_mod_screen_still_finds_a_nan_v_row_it_scores_minus_inf(dtype):
    """K/V are screened under a Python score_mod (its −∞ is a score: a NaN V row it removes
    gives NaN, as the formula); the rows without one match the float64 reference."""
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 4, 37, 19).to(dtype) for _ in range(3))
    with torch.no_grad():
        clean = ak.attention(q, k, v, is_causal=True, score_mod=_drop_key_3)
        _assert_as_reference(clean, q, k, v)
        v_bad = v.clone()
        v_bad[0, 1, 3, 18] = math.nan             # key 3 of head 1, its last dim
        got = ak.attention(q, k, v_bad, is_causal=True, score_mod=_drop_key_3)
        want = ak.attention(q.double(), k.double(), v_bad.double(), is_causal=True,
                            score_mod=_drop_key_3, backend="reference")
        assert torch.equal(got.isnan(), want.isnan())
        assert got[0, 1, 3:].isnan().all() and not got[0, 1, :3].isnan().any()
        assert torch.equal(got[:, [0, 2, 3]], clean[:, [0, 2, 3]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_query_screen_still_finds_a_minus_inf_query_row(dtype):
    """The tiled backend's query check (native.all_finite first): a query row of −∞ whose
    every score is −∞ (keys all positive) attends to keys it may see, so it gives NaN (the
    kernel alone would call the row empty: output 0); the other rows are the clean call's."""
    torch.manual_seed(3)
    q, v = torch.randn(2, 2, 33, 8).to(dtype), torch.randn(2, 2, 33, 8).to(dtype)
    k = (torch.rand(2, 2, 33, 8) + 0.5).to(dtype)
    q_bad = q.clone()
    q_bad[1, 0, 20] = -math.inf
    with torch.no_grad():
        clean = ak.attention(q, k, v, is_causal=True, backend="tiled")
        got = ak.attention(q_bad, k, v, is_causal=True, backend="tiled")
    assert got[1, 0, 20].isnan().all()
    keep = torch.ones(2, 2, 33, dtype=torch.bool)
    keep[1, 0, 20] = False
    assert torch.equal(got[keep], clean[keep])


# ------------------------------------------------ the score_mod's K/V screen, in the kernel
def _kv_screens(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The eager path's K/V screens (``_non_finite_kv_rows``) the calls that follow ask for."""
    import attnkit.eager as eager

    calls: list[object] = []
    real = eager._non_finite_kv_rows

    def spy(p):  # noqa: ANN001, ANN202
        calls.append(p)
        return real(p)
    monkeypatch.setattr(eager, "_non_finite_kv_rows", spy)
    return calls


def _kernel_screens_kv(dtype: torch.dtype) -> bool:
    """Whether the kernel vouches for K/V under a score_mod: its own dtype's GEMMs only."""
    return dtype == torch.bfloat16 and native.low_precision_paths()["bfloat16"].startswith(
        "bfloat16 GEMMs")




@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_score_mod_kv_screen_without_autograd_is_the_kernels(dtype, monkeypatch):
    """Without autograd the kernel screens the K/V tiles it reads under a score_mod (the
    bf16 GEMM path, with its head cache): no eager K/V screen for finite inputs; float32
    (not screened there) and a call with gradients keep the eager one; results match the
    reference either way."""
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 2, 100, 24).to(dtype) for _ in range(3))
    screens = _kv_screens(monkeypatch)
    with torch.no_grad():
        got = ak.attention(q, k, v, is_causal=True, score_mod=_drop_key_3)
    assert len(screens) == (0 if _kernel_screens_kv(dtype) else 1)
    _assert_as_reference(got, q, k, v)
    screens.clear()
    qg = q.clone().requires_grad_(True)
    out = ak.attention(qg, k, v, is_causal=True, score_mod=_drop_key_3)
    assert len(screens) == 1                      # with autograd: up front, as before
    assert torch.equal(out.detach(), got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_score_mod_kv_screen_finds_what_the_output_hides(dtype, monkeypatch):
    """A K row of +inf that the score_mod scores −∞ leaves the kernel's output finite; the
    screen (the kernel's, else the eager one after the call) still finds it: NaN where a
    query may see the key, as the up-front screen gave — and only there. A NaN in keys the
    mask hides from every query (tiles the kernel never reads) costs no screen on the
    kernel's path, and changes nothing."""
    torch.manual_seed(4)
    q, k, v = torch.randn(1, 4, 100, 24).to(dtype), *(torch.randn(1, 4, 300, 24).to(dtype)
                                                      for _ in range(2))
    screens = _kv_screens(monkeypatch)
    with torch.no_grad():
        clean = ak.attention(q, k, v, is_causal=True, score_mod=_drop_key_3)
        k_bad = k.clone()
        k_bad[0, 1, 3, 7] = math.inf                  # key 3 of head 1: scored −∞
        got = ak.attention(q, k_bad, v, is_causal=True, score_mod=_drop_key_3)
        assert got[0, 1, 3:].isnan().all() and not got[0, 1, :3].isnan().any()
        assert torch.equal(got[0, 1, :3], clean[0, 1, :3])
        assert torch.equal(got[:, [0, 2, 3]], clean[:, [0, 2, 3]])
        v_bad = v.clone()
        v_bad[0, 2, 3, 0] = math.nan                  # V of key 3 of head 2, scored −∞
        got = ak.attention(q, k, v_bad, is_causal=True, score_mod=_drop_key_3)
        assert got[0, 2, 3:].isnan().all() and not got[0, 2, :3].isnan().any()
        screens.clear()
        hidden_k, hidden_v = k.clone(), v.clone()
        hidden_k[0, 0, 200, 1] = math.nan             # key 200: past every query (causal)
        hidden_v[0, 3, 299, 2] = math.inf
        got = ak.attention(q, hidden_k, hidden_v, is_causal=True, score_mod=_drop_key_3)
        assert torch.equal(got, clean)
        assert len(screens) == (0 if _kernel_screens_kv(dtype) else 1)
