"""K/V of batch 1 against a larger query batch on the tiled Python *general* engine (softcap,
score_mod, a bias that needs a gradient): the float64 reference as the oracle, and no tensor
of the size of K/V repeated over the batch ever allocated (issue 13, item 5).

Every test runs the Python engine (``ATTNKIT_NATIVE=0``), without the compiled score_mod
tiles (``ATTNKIT_COMPILE=0``) except the last, which runs their matmuls on uncompiled tiles,
and checks that the general engine is the one that ran.
"""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from attnkit.backends import tiled
from attnkit.backends.tiled import compiled
from helpers.eager_tiles import EagerTiles
from helpers.recorders import OpOutputs, floating

M = ak.masks
F64 = torch.float64
B = 3                                    # query batch; K/V have batch 1
TOL = dict(atol=1e-10, rtol=1e-9)


@pytest.fixture(autouse=True)
def _python_general_engine(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    monkeypatch.setenv("ATTNKIT_NATIVE", "0")
    monkeypatch.setenv("ATTNKIT_COMPILE", "0")
    calls: list[int] = []
    real = tiled.general_attention

    def spy(p):  # noqa: ANN001, ANN202
        calls.append(p.k.stride(0))
        return real(p)

    monkeypatch.setattr(tiled, "general_attention", spy)
    return calls


def _alibi_like(s, b, h, qi, ki):  # noqa: ANN001, ANN202
    return s - 0.1 * (h + 1) * (qi - ki).abs()


def _options(kind: str, nq: int, nk: int, dtype: torch.dtype = F64) -> dict[str, object]:
    """Options that route the call to the general engine."""
    g = torch.Generator().manual_seed(11)
    if kind == "score_mod":
        return dict(score_mod=_alibi_like, mask=M.causal("bottom_right"))
    if kind == "from_fn":
        return dict(softcap=2.5, mask=M.from_fn(lambda b, h, qi, ki: (qi + ki + b) % 3 != 0))
    if kind == "bool":
        allowed = torch.rand(B, 1, nq, nk, generator=g) > 0.5
        allowed[1, :, 2] = False                          # a fully masked row
        return dict(softcap=4.0, mask=allowed)
    if kind == "padding":
        return dict(softcap=3.0, mask=M.padding([nk, 5, 0]))   # batch 2 sees nothing
    if kind == "float":                               # an additive mask: a bias, −∞ = blocked
        fm = torch.randn(1, 4, nq, nk, generator=g, dtype=dtype)
        return dict(softcap=3.0, mask=fm.masked_fill(torch.rand(B, 1, nq, nk, generator=g)
                                                     > 0.6, -math.inf))
    raise AssertionError(kind)


def _inputs(hkv: int, nq: int, nk: int, d: int, dtype: torch.dtype = F64,
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return (torch.randn(B, 4, nq, d, generator=g, dtype=dtype),
            torch.randn(1, hkv, nk, d, generator=g, dtype=dtype),
            torch.randn(1, hkv, nk, d + 3, generator=g, dtype=dtype))


def _reference(q, k1, v1, **opts):  # noqa: ANN001, ANN202
    """The float64 reference on K/V repeated explicitly over the batch."""
    k, v = (t.double().repeat(B, 1, 1, 1) for t in (k1, v1))
    return ak.attention(q.double(), k, v, backend="reference", return_lse=True, **opts)


@pytest.mark.parametrize("kind", ["score_mod", "from_fn", "bool", "padding", "float"])
@pytest.mark.parametrize("hkv", [1, 2])
@pytest.mark.parametrize("nq,nk", [(9, 97), (37, 1025)])
def test_general_engine_with_kv_batch_one_matches_the_reference(kind, hkv, nq, nk,
                                                                _python_general_engine):
    q, k1, v1 = _inputs(hkv, nq, nk, 16)
    opts = _options(kind, nq, nk)
    out, lse = ak.attention(q, k1, v1, backend="tiled", return_lse=True, **opts)
    assert _python_general_engine == [0]                  # general engine, stride-0 K/V
    ref, ref_lse = _reference(q, k1, v1, **opts)
    assert torch.equal(lse == -math.inf, ref_lse == -math.inf)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)


@pytest.mark.parametrize("path", ["manual", "checkpoint"])
@pytest.mark.parametrize("kind", ["score_mod", "bool"])
@pytest.mark.parametrize("hkv", [1, 2])
def test_general_engine_kv_batch_one_gradients(path, kind, hkv, _python_general_engine):
    nq, nk = 11, 70
    q, k1, v1 = _inputs(hkv, nq, nk, 8)
    opts = _options(kind, nq, nk)
    if path == "checkpoint":          # a bias that needs a gradient: checkpointed blocks
        bias = torch.randn(1, 4, nq, nk, dtype=F64, requires_grad=True)
        opts = dict(opts, score_mod=lambda s, b, h, qi, ki: s + bias[0, h, qi, ki])
        leaves = [q, k1, v1, bias]
    else:
        leaves = [q, k1, v1]
    for t in (q, k1, v1):
        t.requires_grad_(True)
    out, lse = ak.attention(q, k1, v1, backend="tiled", return_lse=True, **opts)
    assert _python_general_engine == [0]
    ref, ref_lse = _reference(q, k1, v1, **opts)
    torch.testing.assert_close(out, ref, **TOL)
    g = torch.randn_like(out)
    got = torch.autograd.grad((out * g).sum() + lse.clamp_min(-1e9).sum(), leaves)
    want = torch.autograd.grad((ref * g).sum() + ref_lse.clamp_min(-1e9).sum(), leaves)
    assert got[1].shape == k1.shape and got[2].shape == v1.shape
    for a, w in zip(got, want, strict=True):
        torch.testing.assert_close(a, w, **TOL)


@pytest.mark.parametrize("kind", ["score_mod", "from_fn", "bool", "padding"])
@pytest.mark.parametrize("hkv", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "grad"])
def test_general_engine_never_copies_kv_per_batch_element(kind, hkv, dtype, grad,
                                                          _python_general_engine):
    # scores of a call (B·H_q·N_q·N_k) stay below 2·H_kv·N_k·D, so an allocation that large
    # holds K or V for more than one batch element (old code: the reshape / cast of the
    # stride-0 view)
    nq, nk, d = 9, 600, 64
    q, k1, v1 = (t.to(dtype) for t in _inputs(hkv, nq, nk, d))
    opts = _options(kind, nq, nk)
    q.requires_grad_(grad)
    with torch.set_grad_enabled(grad), OpOutputs(big=2 * k1.numel(), keep=floating) as rec:
        out = ak.attention(q, k1, v1, backend="tiled", **opts)
    assert _python_general_engine == [0]
    assert rec.hits == []
    ref, _ = _reference(q.detach(), k1, v1, **opts)
    torch.testing.assert_close(out.double(), ref, atol=5e-3 if dtype == torch.float16 else 2e-5,
                               rtol=5e-3 if dtype == torch.float16 else 2e-5)


def test_kv_batch_one_same_numbers_as_an_explicit_repeat(_python_general_engine):
    # the shared path and the per-batch path compute the same thing (to rounding)
    q, k1, v1 = _inputs(2, 21, 130, 16, dtype=torch.float32)
    opts = _options("score_mod", 21, 130)
    shared = ak.attention(q, k1, v1, backend="tiled", **opts)
    repeated = ak.attention(q, k1.repeat(B, 1, 1, 1), v1.repeat(B, 1, 1, 1), backend="tiled",
                            **opts)
    assert [s == 0 for s in _python_general_engine] == [True, False]
    torch.testing.assert_close(shared, repeated, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("hkv", [1, 2])
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_compiled_tiles_read_shared_kv_without_a_copy(hkv, dtype, monkeypatch,
                                                      _python_general_engine):
    monkeypatch.setenv("ATTNKIT_COMPILE", "1")
    monkeypatch.setattr(compiled, "_Tiles", EagerTiles)
    compiled.clear()
    EagerTiles.made = 0
    nq, nk, d = 9, 600, 64
    q, k1, v1 = (t.to(dtype) for t in _inputs(hkv, nq, nk, d))
    opts = dict(score_mod=_fresh_alibi_like(), mask=M.causal("bottom_right"))
    with OpOutputs(big=2 * k1.numel(), keep=floating) as rec:
        out = ak.attention(q, k1, v1, backend="tiled", **opts)
    assert EagerTiles.made >= 1 and _python_general_engine == [0]   # compiled tiles ran
    assert rec.hits == []
    tol = TOL if dtype == F64 else dict(atol=2e-5, rtol=2e-5)
    ref, _ = _reference(q, k1, v1, **opts)
    torch.testing.assert_close(out.double(), ref, **tol)
    for t in (q, k1, v1):                                  # and the backward's matmuls
        t.requires_grad_(True)
    out = ak.attention(q, k1, v1, backend="tiled", **opts)
    g = torch.randn_like(out)
    got = torch.autograd.grad((out * g).sum(), (q, k1, v1))
    ref, _ = _reference(q, k1, v1, **opts)
    want = torch.autograd.grad((ref * g.double()).sum(), (q, k1, v1))
    for a, w in zip(got, want, strict=True):
        assert a.shape == w.shape
        torch.testing.assert_close(a.double(), w.double(), **tol)
    compiled.clear()


def _fresh_alibi_like():  # noqa: ANN202
    """A new function per test, so no earlier compiled-tile cache entry is reused."""
    def mod(s, b, h, qi, ki):  # noqa: ANN001, ANN202
        return s - 0.1 * (h + 1) * (qi - ki).abs()
    return mod
