"""The general engine's compiled path (tiled/compiled.py): a Python score_mod's tiles fused by
torch.compile, forward and backward, against the float64 oracle; its fallback and switch.

The native kernel runs a float32 / bfloat16 / float16 user score_mod itself when it can
(native/score_mod.py), so these tests keep tiled on its Python engines (``use_native(False)``)
except the one that checks that order.

Compiles are few on purpose (each costs seconds here): one score_mod code for the compiled
tests (float64 band, float64 tile mask, float32 band + softcap), and a stand-in for
``torch.compile`` where only the dispatch is under test.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import attnkit as ak
from attnkit.backends import native
from attnkit.backends.native import loader
from attnkit.backends.tiled import compiled, counting, tile_sizes, use_native
from helpers.eager_tiles import EagerTiles
from helpers.oracle import oracle
from helpers.tolerance import max_err

M = ak.masks
F64 = torch.float64
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=F64)


def user_alibi(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN201
    """A user-written ALiBi (not attnkit's ScoreTerm) with a captured tensor."""
    return score - SLOPES[h] * (q_idx - kv_idx).abs()


def _ref_mod(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN201
    return score - SLOPES.to(score.dtype)[h] * (q_idx - kv_idx).abs().to(score.dtype)


@pytest.fixture(autouse=True)
def python_engines():  # noqa: ANN201
    with use_native(False):
        yield


@pytest.fixture
def compile_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNKIT_COMPILE", "1")


def _grads(out: torch.Tensor, ins: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(1)
    g = torch.randn(out.shape, dtype=F64)                  # the same dO in every dtype
    return torch.autograd.grad(out, ins, g.to(out.dtype))


def _check(q, k, v, *, allowed=None, atol, mask=None, is_causal=False, softcap=None,  # noqa: ANN001
           dtype=F64) -> None:
    ins = tuple(t.to(dtype).requires_grad_() for t in (q, k, v))
    out = ak.attention(*ins, mask=mask, is_causal=is_causal, softcap=softcap,
                       score_mod=user_alibi, backend="tiled")
    got = _grads(out, ins)
    ref_in = tuple(t.to(F64).requires_grad_() for t in (q, k, v))
    ref, _, _ = oracle(*ref_in, allowed=allowed, softcap=softcap, score_mod=_ref_mod)
    want = _grads(ref, ref_in)
    assert torch.isfinite(out).all()
    assert max_err(out, ref) <= atol, f"output error {max_err(out, ref):.3g}"
    for name, a, b in zip("qkv", got, want, strict=True):
        assert max_err(a, b) <= 10 * atol, f"d{name} error {max_err(a, b):.3g}"


@pytest.mark.skipif(loader.compiler() is None, reason="torch.compile (Inductor) needs a C++ "
                    "compiler; without one the tiles run uncompiled (tested below)")
def test_compiled_matches_oracle_causal_gqa_awkward(compile_on: None) -> None:
    # GQA 4 over 2, N_q != N_k, awkward sizes; tiny tiles: several blocks, chunks, runs
    q, k, v = torch.randn(2, 4, 97, 59), torch.randn(2, 2, 113, 59), torch.randn(2, 2, 113, 8)
    allowed = torch.ones(97, 113, dtype=torch.bool).tril()
    before = compiled.stats()["keys"]
    with tile_sizes(block_q=16, block_k=16, chunk_k=48, general_block_q=32):
        _check(q, k, v, is_causal=True, allowed=allowed, atol=1e-10)
        # a new closure of the same code reuses the compiled tiles (no new cache key)
        _check(q, k, v, is_causal=True, allowed=allowed, atol=1e-10)
    st = compiled.stats()
    assert st["keys"] <= before + 1 and "user_alibi" in st["first_call_s"]
    assert set(st["first_call_s"]["user_alibi"]) == {"fwd", "bwd"} and not st["failed"]


def test_compiled_padding_mask_fully_masked_rows(compile_on: None) -> None:
    # batch 1 has no valid key: every one of its rows is fully masked → 0, gradients 0
    q, k, v = torch.randn(2, 4, 33, 16), torch.randn(2, 4, 40, 16), torch.randn(2, 4, 40, 16)
    mask = M.padding(torch.tensor([17, 0]))
    allowed = (torch.arange(40) < torch.tensor([17, 0]).view(2, 1))[:, None, None, :]
    with tile_sizes(block_q=16, block_k=16, chunk_k=32, general_block_q=16):
        _check(q, k, v, mask=mask, allowed=allowed, atol=1e-10)
        ins = tuple(t.clone().requires_grad_() for t in (q, k, v))
        out, lse = ak.attention(*ins, mask=mask, score_mod=user_alibi, backend="tiled",
                                return_lse=True)
        out.sum().backward()
    assert (out[1] == 0).all() and (lse[1] == -torch.inf).all()
    assert (ins[0].grad[1] == 0).all() and (ins[1].grad[1] == 0).all()


def test_compiled_float32_softcap(compile_on: None) -> None:
    q, k, v = (torch.randn(1, 4, 130, 32) * 2 for _ in range(3))
    allowed = torch.ones(130, 130, dtype=torch.bool).tril()
    _check(q, k, v, is_causal=True, allowed=allowed, softcap=3.0, atol=2e-5,
           dtype=torch.float32)


# --------------------------------------------------------------- dispatch, no compiling
@pytest.fixture
def eager_tiles(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    monkeypatch.setattr(compiled, "_Tiles", EagerTiles)
    EagerTiles.made = 0
    compiled.clear()
    yield
    compiled.clear()


def _fresh_mod():  # noqa: ANN202
    def mod(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return score + 0.1 * (q_idx - kv_idx)
    return mod


def test_env_switch_and_auto_threshold(eager_tiles: None, monkeypatch: pytest.MonkeyPatch,
                                       ) -> None:
    q = k = v = torch.randn(1, 2, 20, 8)
    for env, want in (("0", "off"), ("1", "on"), ("", "auto"), ("off", "off")):
        monkeypatch.setenv("ATTNKIT_COMPILE", env)
        assert compiled.mode() == want
    monkeypatch.setenv("ATTNKIT_COMPILE", "0")
    ak.attention(q, k, v, score_mod=_fresh_mod(), backend="tiled")
    assert EagerTiles.made == 0
    monkeypatch.delenv("ATTNKIT_COMPILE")                  # auto: a small call is not worth it
    ak.attention(q, k, v, score_mod=_fresh_mod(), backend="tiled")
    assert EagerTiles.made == 0
    monkeypatch.setenv("ATTNKIT_COMPILE", "1")
    out = ak.attention(q, k, v, score_mod=_fresh_mod(), backend="tiled")
    out2 = ak.attention(q, k, v, score_mod=_fresh_mod(), backend="tiled")   # same code: cached
    assert EagerTiles.made == 1
    ref = ak.attention(q, k, v, score_mod=_fresh_mod(), backend="reference")
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out2, ref, atol=1e-6, rtol=1e-5)


def test_eager_tile_math_matches_oracle(eager_tiles: None, monkeypatch: pytest.MonkeyPatch,
                                        ) -> None:
    """The tile templates themselves (what Inductor compiles), band and tile masks, bias."""
    monkeypatch.setenv("ATTNKIT_COMPILE", "1")
    q, k, v = torch.randn(2, 4, 29, 11), torch.randn(2, 2, 31, 11), torch.randn(2, 2, 31, 7)
    win = torch.ones(29, 31, dtype=torch.bool).tril().triu(-5)
    doc = torch.rand(2, 1, 29, 31) > 0.3
    doc[:, :, 3] = False                                    # a fully masked row
    with tile_sizes(block_q=8, block_k=8, chunk_k=16, general_block_q=16):
        _check(q, k, v, mask=M.sliding_window(6), allowed=win, atol=1e-10)
        _check(q, k, v, mask=doc, allowed=doc, softcap=2.0, atol=1e-10)


def test_closure_with_grad_stays_on_current_path(eager_tiles: None,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNKIT_COMPILE", "1")
    w = torch.tensor(0.3, dtype=F64, requires_grad=True)

    def mod(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return score + w * (q_idx - kv_idx)

    q, k, v = (torch.randn(1, 2, 12, 8, dtype=F64) for _ in range(3))
    ak.attention(q, k, v, is_causal=True, score_mod=mod, backend="tiled").sum().backward()
    assert EagerTiles.made == 0 and w.grad is not None


def test_compile_failure_warns_once_and_falls_back(compile_on: None) -> None:
    @torch.compiler.disable
    def untraceable(x: torch.Tensor) -> torch.Tensor:
        return x * 0.5

    def mod(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return untraceable(score) + 0.01 * (q_idx - kv_idx)

    q, k, v = (torch.randn(1, 2, 24, 8, dtype=F64, requires_grad=True) for _ in range(3))
    ref = ak.attention(q, k, v, is_causal=True, score_mod=mod, backend="reference")
    with pytest.warns(RuntimeWarning, match="could not compile"):
        out = ak.attention(q, k, v, is_causal=True, score_mod=mod, backend="tiled")
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                      # no second warning
        out = ak.attention(q, k, v, is_causal=True, score_mod=mod, backend="tiled")
        out.sum().backward()
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-9)


@pytest.mark.skipif(not native.available(), reason="native kernel unavailable")
def test_native_kernel_runs_a_float32_score_mod_first(eager_tiles: None,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNKIT_COMPILE", "1")
    q, k, v = (torch.randn(1, 4, 40, 16) for _ in range(3))
    with use_native(True), counting() as n:
        out = ak.attention(q, k, v, is_causal=True, score_mod=user_alibi, backend="tiled")
    assert n["native"] == 1 and EagerTiles.made == 0            # compiled.py is the fallback
    ref = ak.attention(q, k, v, is_causal=True, score_mod=user_alibi, backend="reference")
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
