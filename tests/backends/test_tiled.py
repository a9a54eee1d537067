"""The tiled CPU engine against the float64 reference: tile edges, the block-map schedule,
every mask kind and option, gradients, low precision, dropout and O(N) memory.

Most tests use tiny tiles (``tile_sizes``) so that small shapes cross many tile edges and
exercise every run kind (skipped, full, partial, diagonal) in both engines.
"""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from attnkit.api import prepare
from attnkit.backends import tiled
from helpers.oracle import oracle
from helpers.recorders import OpOutputs

M = ak.masks
F64 = torch.float64
TINY = {"block_q": 16, "block_k": 8, "chunk_k": 24, "general_block_q": 16}


def _inputs(b, hq, hkv, nq, nk, dk, dv, dtype=F64, grad=False):  # noqa: ANN001, ANN202
    q = torch.randn(b, hq, nq, dk, dtype=dtype)
    k = torch.randn(b, hkv, nk, dk, dtype=dtype)
    v = torch.randn(b, hkv, nk, dv, dtype=dtype)
    for t in (q, k, v):
        t.requires_grad_(grad)
    return q, k, v


def _run(backend, q, k, v, grad, **kw):  # noqa: ANN001, ANN202
    out, lse = ak.attention(q, k, v, backend=backend, return_lse=True, **kw)
    if not grad:
        return [out, lse]
    w = torch.cos(torch.arange(out.numel(), dtype=out.dtype)).view(out.shape)
    gs = torch.autograd.grad((out * w).sum(), (q, k, v), allow_unused=True)
    return [out, lse, *gs]


def check(q, k, v, grad=True, atol=1e-10, **kw):  # noqa: ANN001, ANN201
    """tiled == reference in float64 (out, lse incl. −∞ rows, and gradients)."""
    with tiled.tile_sizes(**TINY):
        got = _run("tiled", q, k, v, grad, **kw)
    ref = _run("reference", q, k, v, grad, **kw)
    assert torch.equal(got[1] == -math.inf, ref[1] == -math.inf), "empty rows differ"
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, ref, strict=False):
        assert not torch.isnan(a).any(), f"{name} has NaN"
        torch.testing.assert_close(a, b, atol=atol, rtol=1e-9, msg=f"{name} differs")
    return got


# ---------------------------------------------------------------------------- shapes
@pytest.mark.parametrize("nq,nk", [(1, 1), (97, 97), (113, 97), (97, 113), (1, 1025),
                                   (1025, 1), (1025, 40)])
@pytest.mark.parametrize("causal", [False, True])
def test_awkward_lengths(nq, nk, causal):
    q, k, v = _inputs(1, 2, 2, nq, nk, 8, 8, grad=True)
    check(q, k, v, is_causal=causal)


@pytest.mark.parametrize("dk,dv", [(8, 8), (59, 59), (111, 111), (8, 59), (111, 8)])
def test_head_widths_including_dv_ne_dk(dk, dv):
    q, k, v = _inputs(2, 2, 1, 37, 53, dk, dv, grad=True)
    check(q, k, v, mask=M.causal(align="bottom_right"))


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 1)])
def test_gqa_and_mqa(hq, hkv):
    q, k, v = _inputs(2, hq, hkv, 45, 61, 16, 16, grad=True)
    check(q, k, v, mask=M.sliding_window(9))
    check(q, k, v, softcap=3.0)


def test_non_contiguous_inputs():
    base = torch.randn(2, 50, 4, 16, dtype=F64)                # (B, N, H, D) → transposed
    q = base.transpose(1, 2).requires_grad_(False)
    k = torch.randn(2, 70, 2, 32, dtype=F64).transpose(1, 2)[..., ::2]
    v = torch.randn(2, 2, 16, 70, dtype=F64).transpose(-1, -2)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    check(q, k, v, grad=False, mask=M.causal(align="bottom_right"))
    check(q, k, v, grad=False, score_mod=ak.scores.alibi(4))


# ---------------------------------------------------------------------------- masks
def _masks(nq: int, nk: int, b: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(1)
    fmask = torch.randn(nq, nk, dtype=F64, generator=g)
    fmask[torch.rand(nq, nk, generator=g) > 0.6] = -math.inf
    return {
        "causal": M.causal(),
        "causal_br": M.causal(align="bottom_right"),
        "sliding": M.sliding_window(11),
        "sliding_2sided": M.sliding_window(6, causal=False),
        "padding_empty_rows": M.padding([nk // 2, 0][:b], q_lengths=[nq - 5, nq][:b]),
        "document": M.document(torch.arange(nq) * 4 // nq,
                               kv_ids=torch.arange(nk) * 4 // nk),
        "prefix_lm": M.prefix_lm(7),
        "from_fn": M.from_fn(lambda b_, h, qi, ki: (qi + ki) % 3 != 0),
        "bool_tensor": torch.rand(b, 1, nq, nk, generator=g) > 0.5,
        "float_additive": fmask,
        "algebra": (M.causal() & ~M.sliding_window(4)) | M.prefix_lm(3),
    }


@pytest.mark.parametrize("name", list(_masks(8, 8, 2)))
@pytest.mark.parametrize("nq,nk", [(29, 53), (53, 29)])
def test_every_mask_kind(name, nq, nk):
    q, k, v = _inputs(2, 4, 2, nq, nk, 16, 12, grad=True)
    check(q, k, v, mask=_masks(nq, nk, 2)[name])


def test_fully_masked_rows_give_zero_output_and_grads():
    q, k, v = _inputs(2, 2, 2, 30, 30, 8, 8, grad=True)
    mask = M.padding([20, 0], q_lengths=[10, 30])           # rows ≥ 10 (b=0), all rows (b=1)
    out, lse, dq, dk, dv = check(q, k, v, mask=mask)
    assert (out[0, :, 10:] == 0).all() and (out[1] == 0).all()
    assert (lse[1] == -math.inf).all()
    assert (dq[1] == 0).all() and (dk[1] == 0).all() and (dv[1] == 0).all()


def test_nan_in_masked_kv_does_not_leak():
    q, k, v = _inputs(1, 2, 2, 20, 40, 8, 8)
    k[:, :, 30:] = float("nan")
    v[:, :, 30:] = float("inf")
    out = ak.attention(q, k, v, mask=M.padding([30]), backend="tiled")
    ref = ak.attention(q, k, v, mask=M.padding([30]), backend="reference")
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)


# ---------------------------------------------------------------------------- options
@pytest.mark.parametrize("mask", [None, M.causal(), M.sliding_window(5)])
def test_softcap_and_score_mods(mask):
    q, k, v = _inputs(1, 4, 2, 33, 47, 16, 16, grad=True)
    check(q, k, v, mask=mask, softcap=2.5)
    check(q, k, v, mask=mask, score_mod=ak.scores.alibi(4))
    check(q, k, v, mask=mask, softcap=2.0, score_mod=ak.scores.alibi(4))


def test_score_mod_parameters_get_gradients():
    q, k, v = _inputs(1, 2, 2, 25, 25, 8, 8)
    grads = []
    table0 = torch.randn(2, 9, dtype=F64)
    for backend in ("tiled", "reference"):
        table = table0.clone().requires_grad_(True)
        mod = ak.scores.relative_bias(table, 4)
        with tiled.tile_sizes(**TINY):
            out = ak.attention(q, k, v, is_causal=True, score_mod=mod, backend=backend)
        (g,) = torch.autograd.grad(out.square().sum(), table)
        grads.append(g)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-10, rtol=1e-9)


def test_bias_with_and_without_grad():
    q, k, v = _inputs(1, 2, 2, 30, 35, 8, 8, grad=True)
    bias = torch.randn(1, 2, 30, 35, dtype=F64)
    check(q, k, v, mask=bias)                                # fused engine (bias as mask)
    bias.requires_grad_(True)
    got = []
    for backend in ("tiled", "reference"):
        with tiled.tile_sizes(**TINY):
            out = ak.attention(q, k, v, mask=bias, backend=backend)
        got.append(torch.autograd.grad(out.square().sum(), (q, bias)))
    for a, b in zip(got[0], got[1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9)


# ---------------------------------------------------------------------------- gradcheck
@pytest.mark.parametrize("kw", [
    {},
    {"is_causal": True},
    {"mask": M.padding([5, 0], q_lengths=[4, 6])},
    {"mask": M.sliding_window(3) | M.prefix_lm(2)},
    {"softcap": 1.5, "is_causal": True},
    {"score_mod": ak.scores.alibi(2), "mask": M.causal(align="bottom_right")},
], ids=["dense", "causal", "padding", "algebra", "softcap", "alibi"])
def test_gradcheck_float64(kw):
    q, k, v = _inputs(2, 2, 1, 6, 7, 3, 4, grad=True)

    def f(q, k, v):  # noqa: ANN001, ANN202
        with tiled.tile_sizes(block_q=2, block_k=2, chunk_k=3, general_block_q=2):
            return ak.attention(q, k, v, backend="tiled", **kw)

    assert torch.autograd.gradcheck(f, (q, k, v), fast_mode=True)


# ---------------------------------------------------------------------------- low precision
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kw", [{"is_causal": True}, {"mask": M.sliding_window(9)},
                                {"softcap": 5.0, "mask": M.causal()}], ids=str)
def test_low_precision_within_twice_the_reference_error(dtype, kw):
    q64, k64, v64 = _inputs(2, 4, 2, 70, 90, 32, 32)
    q, k, v = (t.to(dtype).requires_grad_(True) for t in (q64, k64, v64))
    exact = _run("reference", *(t.detach().double().requires_grad_(True) for t in (q, k, v)),
                 True, **kw)
    with tiled.tile_sizes(**TINY):
        got = _run("tiled", q, k, v, True, **kw)
    low_ref = _run("reference", q, k, v, True, **kw)
    for i, (a, r, e) in enumerate(zip(got, low_ref, exact, strict=True)):
        if i == 1:
            continue                                           # lse is float32 in both
        err = (a.double() - e).abs().max().item()
        err_ref = (r.double() - e).abs().max().item()
        factor = 2.0 if i == 0 else 3.0
        assert err <= factor * err_ref + 1e-6, (i, err, err_ref)


# ---------------------------------------------------------------------------- dropout
def test_dropout_reproducible_and_unbiased():
    q, k, v = _inputs(1, 2, 2, 64, 80, 8, 8)
    v = torch.ones_like(v)
    with tiled.tile_sizes(**TINY):
        torch.manual_seed(5)
        a = ak.attention(q, k, v, dropout_p=0.3, backend="tiled")
        torch.manual_seed(5)
        b = ak.attention(q, k, v, dropout_p=0.3, backend="tiled")
        c = ak.attention(q, k, v, dropout_p=0.3, backend="tiled")
    assert torch.equal(a, b) and not torch.equal(a, c)
    # with V = 1 every output is Σ_j keep_j / (1-p) · w_j: 1 on average, not 1 everywhere
    assert abs(a.mean().item() - 1.0) < 0.05 and (a - 1).abs().max() > 0.01


def test_dropout_gradients():
    q, k, v = _inputs(1, 2, 1, 5, 7, 3, 3, grad=True)

    def f(q, k, v):  # noqa: ANN001, ANN202
        torch.manual_seed(3)                                   # the same dropout mask
        with tiled.tile_sizes(block_q=2, block_k=2, chunk_k=3, general_block_q=2):
            return ak.attention(q, k, v, dropout_p=0.4, is_causal=True, backend="tiled")

    assert not torch.equal(f(q, k, v), ak.attention(q, k, v, is_causal=True))
    assert torch.autograd.gradcheck(f, (q, k, v), fast_mode=True)


# ---------------------------------------------------------------------------- the schedule
def test_block_map_drives_the_schedule():
    n, w = 256, 32
    q, k, v = _inputs(1, 2, 2, n, n, 8, 8)
    mask = M.sliding_window(w)
    p = prepare(q, k, v, mask=mask).problem
    pl = tiled.plan(p, block_q=16, block_k=8, coarsen=False)
    bm = mask.block_map(n, n, 16, 8)[0, 0]
    assert pl.empty == int((bm == M.EMPTY).sum()) > 0.8 * pl.tiles
    for blk in pl.blocks:
        for run in blk.runs:               # every run lies inside the band of its rows
            assert run.k1 > blk.q0 - w and run.k0 < blk.q1
            tiles = bm[blk.q0 // 16, run.k0 // 8: math.ceil(run.k1 / 8)]
            assert ((tiles == M.FULL) if not run.masked else (tiles == M.PARTIAL)).all()
        computed = sum(r.k1 - r.k0 for r in blk.runs)
        assert computed <= 16 + w + 8                          # never the whole row
    with tiled.counting() as stats, tiled.tile_sizes(block_q=16, block_k=8), \
            tiled.use_native(False):                        # the Python engine's plan
        ak.attention(q, k, v, mask=mask, backend="tiled")
    assert stats["empty"] >= pl.empty                          # counted and skipped
    assert stats["full"] > 0
    # the band: one batched call for the interior blocks (one shared mask), one per edge
    assert 1 <= stats["windowed"] <= 3


def test_diagonal_tiles_use_the_causal_kernel_and_full_tiles_no_mask():
    q, k, v = _inputs(1, 1, 1, 64, 64, 8, 8)
    with tiled.counting() as stats, tiled.tile_sizes(block_q=16, block_k=16), \
            tiled.use_native(False):                        # the Python engine's plan
        ak.attention(q, k, v, is_causal=True, backend="tiled")
    # coarsening may merge blocks; every partial run is a diagonal square (no mask tensor)
    assert stats["masked_runs"] == 0 and stats["causal_runs"] >= 1


def test_no_n_by_n_tensor_for_causal_4096():
    n = 4096
    q, k, v = (torch.randn(1, 1, n, 16, requires_grad=True) for _ in range(3))
    with OpOutputs() as rec:
        out = ak.attention(q, k, v, is_causal=True, backend="tiled")
        out.sum().backward()
    assert rec.largest < n * n // 8, rec.largest               # tiles only, O(N) memory
    assert q.grad is not None and torch.isfinite(q.grad).all()


@pytest.mark.parametrize("use_native", [False, True], ids=["python", "native"])
@pytest.mark.parametrize("mask,limit", [(M.prefix_lm(100), 8), (M.sliding_window(256), 4)],
                         ids=["per_block", "windowed"])
def test_no_n_by_n_tensor_for_other_schedules(mask, limit, use_native):
    n = 4096
    q, k, v = (torch.randn(1, 1, n, 16, requires_grad=True) for _ in range(3))
    with tiled.counting() as stats, OpOutputs() as rec, tiled.use_native(use_native):
        out = ak.attention(q, k, v, mask=mask, backend="tiled")
        out.sum().backward()
    if use_native:
        # a band runs natively in closed form; prefix_lm (an | of masks) would need a dense
        # 16 MB mask, over native.DENSE_MASK_LIMIT: the Python engine runs it
        native_ok = not tiled.native_reasons(prepare(q, k, v, mask=M.sliding_window(8)).problem)
        assert stats["native"] == (native_ok and limit == 4)
    else:
        assert (stats["windowed"] > 0) == (limit == 4)
    assert rec.largest < n * n // limit, rec.largest


def test_a_large_bool_tensor_of_the_call_runs_on_the_kernel_in_place():
    """A bool mask the caller passes is read where it lies (no copy, no limit): an 8 MiB
    (2, 1, 2048, 2048) mask, twice native.DENSE_MASK_LIMIT, still runs natively."""
    if tiled.native_reasons(prepare(*_inputs(1, 1, 1, 8, 8, 8, 8)).problem):
        pytest.skip("native kernel unavailable")
    g = torch.Generator().manual_seed(3)
    n = 2048
    q, k, v = (torch.randn(2, 2, n, 8, generator=g, dtype=torch.float64) for _ in range(3))
    m = torch.rand(2, 1, n, n, generator=g) > 0.5
    m[1, 0, 7] = False                                           # one fully masked row
    from attnkit.backends.native import DENSE_MASK_LIMIT

    assert m.numel() > 2 * DENSE_MASK_LIMIT - 1
    with tiled.counting() as stats:
        out = ak.attention(q, k, v, mask=m, backend="tiled")
    assert stats["native"] == 1 and stats["block_maps"] == 0
    ref, _, _ = oracle(q, k, v, allowed=m)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    assert out[1, :, 7].abs().max() == 0


def test_auto_picks_tiled_on_cpu():
    q, k, v = _inputs(1, 2, 2, 40, 40, 8, 8, grad=True)
    p = prepare(q, k, v, is_causal=True).problem
    from attnkit import backends

    assert backends.select(p).name == "tiled"
    assert tiled.TiledBackend().not_supported_reasons(p) == []


def test_tile_sizes_rejects_bad_values():
    with pytest.raises(ValueError, match="unknown tile size"), tiled.tile_sizes(block_x=3):
        pass
    with pytest.raises(ValueError, match="positive integer"), tiled.tile_sizes(block_q=0):
        pass


@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 2)])
@pytest.mark.parametrize("mask", [
    M.sliding_window(24),
    M.sliding_window(10, causal=False) & M.padding([150, 90], q_lengths=[150, 100]),
    M.document(torch.arange(300) // 25),
], ids=["sliding", "two_sided_padding", "document"])
def test_windowed_schedule_one_call_for_local_masks(mask, hq, hkv):
    q, k, v = _inputs(2, hq, hkv, 300, 300, 8, 8, grad=True)
    with tiled.counting() as stats, tiled.use_native(False):
        check(q, k, v, mask=mask)
    assert stats["windowed"] >= 1                     # all query blocks in one call


@pytest.mark.parametrize("hq,hkv,nq,nk,dk,dv", [
    (2, 2, 300, 300, 8, 8), (4, 2, 300, 300, 8, 8), (2, 1, 203, 300, 8, 6),
    (2, 2, 300, 211, 6, 8),
])
@pytest.mark.parametrize("mask,split", [
    (M.sliding_window(40), True),
    (M.sliding_window(17, causal=False), True),
    (M.sliding_window(33) & M.causal(align="bottom_right"), False),   # not a Band: evaluated
], ids=["sliding", "two_sided", "bottom_right"])
def test_band_windows_interior_blocks_share_one_mask(mask, split, hq, hkv, nq, nk, dk, dv):
    # the interior query blocks run in one call with a (bq, window) mask broadcast over the
    # blocks and unpadded K/V; the edge blocks (windows leaving [0, N_k)) run apart
    q, k, v = _inputs(2, hq, hkv, nq, nk, dk, dv, grad=True)
    with tiled.counting() as stats, tiled.tile_sizes(block_q=16, block_k=8), \
            tiled.use_native(False):                        # the Python engine's plan
        check(q, k, v, mask=mask)
        assert stats["windowed"] >= (2 if split and nq <= nk else 0)
        with torch.no_grad():                                   # forward alone, LSE too
            out, lse = ak.attention(q, k, v, mask=mask, backend="tiled", return_lse=True)
    ref, ref_lse = ak.attention(q.detach(), k.detach(), v.detach(), mask=mask,
                                backend="reference", return_lse=True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)


@pytest.mark.parametrize("kw", [
    {"is_causal": True},
    {"mask": M.sliding_window(20)},                              # windowed schedule
    {"mask": M.padding([40, 0], q_lengths=[50, 60])},            # per block, empty rows
    {"softcap": 2.0, "mask": M.causal()},                        # hand-written backward
    {"score_mod": ak.scores.alibi(4)},                           # autograd on the tile
    {"score_mod": ak.scores.relative_bias(torch.randn(4, 9, dtype=F64), 4)},
], ids=["causal", "windowed", "padding", "softcap", "alibi", "relative_bias"])
def test_lse_is_differentiable(kw):
    q, k, v = _inputs(2, 4, 2, 60, 200, 8, 8, grad=True)
    gl = torch.randn(2, 4, 60, dtype=F64)
    grads = []
    for backend in ("tiled", "reference"):
        with tiled.tile_sizes(**TINY):
            out, lse = ak.attention(q, k, v, backend=backend, return_lse=True, **kw)
        assert lse.requires_grad
        lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        grads.append(torch.autograd.grad(out.sum() + (lse * gl).sum(), (q, k, v)))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9)


# ------------------------------------------------------------------ the native kernel
native = pytest.importorskip("attnkit.backends.native")
needs_native = pytest.mark.skipif(not native.available(),
                                  reason=f"native kernel unavailable: {native.why_unavailable()}")


def _f32(*shape: int, grad: bool = False) -> torch.Tensor:
    return torch.randn(*shape).requires_grad_(grad)


@needs_native
@pytest.mark.parametrize("how", ["default", "env_off", "context_off"])
def test_native_runs_when_available_and_the_switches_turn_it_off(how, monkeypatch):
    q, k, v = _f32(2, 4, 97, 16, grad=True), _f32(2, 2, 113, 16, grad=True), \
        _f32(2, 2, 113, 8, grad=True)
    mask = M.causal(align="bottom_right") & M.padding([113, 60])
    if how == "env_off":
        monkeypatch.setenv("ATTNKIT_NATIVE", "0")
    off = tiled.use_native(False) if how == "context_off" else tiled.use_native(True)
    with tiled.counting() as stats, off:
        out, lse = ak.attention(q, k, v, mask=mask, softcap=20.0, return_lse=True,
                                backend="tiled")
        dq, dk, dv = torch.autograd.grad(out.square().sum() + lse.sum(), (q, k, v))
    assert stats["native"] == (how == "default")
    assert (stats["runs"] > 0) == (how != "default")             # the Python engine's plan
    args = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = ak.attention(*args, mask=mask, softcap=20.0, return_lse=True,
                                backend="reference")
    want = torch.autograd.grad(ref.square().sum() + ref_lse.sum(), args)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=2e-5)
    for got, w in zip((dq, dk, dv), want, strict=True):
        torch.testing.assert_close(got.double(), w, atol=2e-4, rtol=2e-4)


@needs_native
def test_native_reasons_name_why_the_python_engine_runs():
    q = _f32(1, 2, 40, 8)
    p = prepare(q, q, q, is_causal=True).problem
    assert tiled.native_reasons(p) == []
    assert any("dropout" in r for r in tiled.native_reasons(
        prepare(q, q, q, dropout_p=0.5).problem))
    assert any("score_mod" in r for r in tiled.native_reasons(
        prepare(q, q, q, score_mod=lambda s, b, h, i, j: torch.atan(s)).problem))
    with tiled.use_native(False):
        assert "use_native(False)" in tiled.native_reasons(p)[0]
    big = _f32(1, 1, 4096, 8)                      # a mask without closed form, 16 MB dense
    reasons = tiled.native_reasons(prepare(big, big, big, mask=M.prefix_lm(10)).problem)
    assert any("no closed form" in r and "16 MB" in r for r in reasons)
    with tiled.counting() as stats:                # dropout and a Python score_mod: Python
        ak.attention(q, q, q, dropout_p=0.5, backend="tiled")
        ak.attention(q, q, q, score_mod=lambda s, b, h, i, j: torch.atan(s), backend="tiled")
    assert stats["native"] == 0 and stats["runs"] > 0


@needs_native
def test_native_alibi_and_fully_masked_rows_and_nan_in_masked_kv():
    q, k, v = _f32(1, 4, 33, 16, grad=True), _f32(1, 2, 50, 16), _f32(1, 2, 50, 16)
    k, v = k.clone(), v.clone()
    k[:, :, 45:] = math.nan                                      # padded away below
    v[:, :, 45:] = math.inf
    k.requires_grad_(), v.requires_grad_()
    mask = M.padding([45], q_lengths=[30])                       # rows 30.. see no key
    with tiled.counting() as stats:
        out, lse = ak.attention(q, k, v, mask=mask, score_mod=ak.scores.alibi(4),
                                return_lse=True, backend="tiled")
        out.sum().backward()
    assert stats["native"] == 1
    assert torch.isfinite(out).all() and (out[:, :, 30:] == 0).all()
    assert (lse[:, :, 30:] == -math.inf).all() and (q.grad[:, :, 30:] == 0).all()
    kk, vv = k.detach()[:, :, :45].double(), v.detach()[:, :, :45].double()
    ref = ak.attention(q.detach().double(), kk, vv, score_mod=ak.scores.alibi(4),
                       backend="reference")
    torch.testing.assert_close(out[:, :, :30].double(), ref[:, :, :30], atol=2e-5, rtol=2e-5)
