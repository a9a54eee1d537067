"""A user's Python score_mod compiled into the native kernel (native/score_mod.py).

Every comparison follows DESIGN: against ``ak.attention(..., backend="reference")`` in
float64, the kernel's float32 (bfloat16) error is within 2× — gradients 3× — the error of
the same reference run in float32 (bfloat16). ``tiled.counting()["native"]`` proves the
native kernel ran the call; ``score_mod.stats()`` that a library was built or loaded.

Shape legend: q (B, H_q, N_q, D), k, v (B, H_kv, N_k, D).
"""

from __future__ import annotations

import math
import threading
import warnings

import pytest
import torch

import attnkit as ak
from attnkit.api import prepare
from attnkit.backends import native
from attnkit.backends.native import score_mod as sm
from attnkit.backends.tiled import counting, native_reasons
from helpers.tolerance import assert_low_precision_close, assert_low_precision_grad_close

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernel unavailable: "
                                                               f"{native.why_unavailable()}")
F64 = torch.float64
H = 4
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=F64)
QBIAS = torch.randn(H, 300, generator=torch.Generator().manual_seed(3))
BIAS = torch.randn(2, H, 97, 113, generator=torch.Generator().manual_seed(4))
T5 = torch.randn(H, 32, generator=torch.Generator().manual_seed(5))
REL = torch.randn(H, 2 * 300 - 1, generator=torch.Generator().manual_seed(6)).double()


# FlexAttention's examples (attention-gym), written by hand as a user would
def relative_position(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN201
    return score + (q_idx - kv_idx)


def alibi_captured(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN201
    return score - SLOPES[h] * (q_idx - kv_idx).abs()


def tanh_softcap(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN201
    return 2.0 * torch.tanh(score / 2.0)


def head_query_bias(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN201
    return score + QBIAS[h][q_idx]


def full_bias(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN201
    return score + BIAS[b, h, q_idx, kv_idx]


def wrapped_relative_table(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN201
    return score + REL[h, q_idx - kv_idx]                   # negative indices wrap, as torch's


def t5_buckets(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN201
    rel = kv_idx - q_idx
    ret = (rel > 0).long() * 16
    n = rel.abs()
    large = 8 + (torch.log(n.float() / 8) / math.log(128 / 8) * 8).long()
    large = torch.minimum(large, torch.full_like(large, 15))
    return score + T5[h, ret + torch.where(n < 8, n, large)]


def sqrt_distance(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN201
    return score - 0.02 * (q_idx - kv_idx).abs().to(score.dtype).sqrt()


def mixed_ops(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN201
    x = torch.where(q_idx % 3 == 0, score * 1.5, score.clamp(-1.0, 1.0) - 0.25)
    y = torch.maximum(x, torch.sigmoid(score) - 2) + torch.exp(-score.abs()) * 0.5
    return y + (kv_idx // 7).float() * 0.01 + (score ** 2) * 0.05 / (1 + h)


MODS = [relative_position, alibi_captured, tanh_softcap, head_query_bias, full_bias,
        wrapped_relative_table, t5_buckets, sqrt_distance, mixed_ops]


def qkv(B: int, hq: int, hkv: int, nq: int, nk: int, d: int, scale: float = 1.0,
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (scale * torch.randn(B, hq, nq, d, dtype=F64), torch.randn(B, hkv, nk, d, dtype=F64),
            torch.randn(B, hkv, nk, d, dtype=F64))


def attend(q, k, v, dtype, backend, **opts):  # noqa: ANN001, ANN201
    ins = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out = ak.attention(*ins, backend=backend, **opts)
    torch.manual_seed(7)
    dout = torch.randn(out.shape, dtype=F64).to(dtype)
    grads = torch.autograd.grad(out, ins, dout)
    return out.detach(), grads


def check(q, k, v, *, dtype=torch.float32, grads=True, native_calls=1, **opts):  # noqa: ANN001, ANN201
    """The tiled call against the reference; asserts it ran natively (``native_calls``)."""
    with counting() as n:
        out, g = attend(q, k, v, dtype, "tiled", **opts)
    assert n["native"] == native_calls, n
    ref, gref = attend(q, k, v, F64, "reference", **opts)
    low, glow = attend(q, k, v, dtype, "reference", **opts)
    assert_low_precision_close(out, low, ref)
    if grads:
        for name, a, b, c in zip("qkv", g, gref, glow, strict=True):
            assert_low_precision_grad_close(a, c, b, what=f"d{name}")
    return out, g


@pytest.mark.parametrize("mod", MODS, ids=lambda f: f.__name__)
def test_flex_examples_forward_and_gradients(mod) -> None:  # noqa: ANN001
    q, k, v = qkv(2, H, 2, 97, 113, 59)                       # GQA, N_q != N_k, awkward D
    check(q, k, v, score_mod=mod, is_causal=True)


@pytest.mark.parametrize("nq,nk", [(113, 97), (1, 300), (300, 129)])
def test_sizes_masks_and_softcap(nq: int, nk: int) -> None:
    q, k, v = qkv(1, H, 1, nq, nk, 64, scale=3.0)             # MQA; decode for N_q = 1
    check(q, k, v, score_mod=alibi_captured, mask=ak.masks.causal("bottom_right"))
    check(q, k, v, score_mod=mixed_ops, softcap=5.0)          # d/ds = dmod(capped) * dcap
    check(q, k, v, score_mod=t5_buckets, mask=ak.masks.sliding_window(17, causal=False))
    bias = torch.randn(nq, nk, dtype=F64)                     # added after the score_mod
    check(q, k, v, score_mod=tanh_softcap, mask=bias)


def test_masking_by_score_mod_minus_inf() -> None:
    def late_causal(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return torch.where(q_idx >= kv_idx + 5, score, -float("inf"))   # rows 0..4: no key

    q, k, v = qkv(1, H, 2, 97, 113, 32)
    out, g = check(q, k, v, score_mod=late_causal)
    assert (out[:, :, :5] == 0).all() and (g[0][:, :, :5] == 0).all()


def test_fully_masked_rows_and_nan_in_masked_kv() -> None:
    q, k, v = qkv(2, H, 2, 97, 113, 32)
    k[1, :, 50:] = math.nan                                   # padded keys of batch 1
    v[1, :, 50:] = math.inf
    mask = ak.masks.padding([113, 50], q_lengths=[97, 40])   # rows 40.. of batch 1: no key
    out, g = check(q, k, v, score_mod=alibi_captured, mask=mask)
    assert (out[1, :, 40:] == 0).all() and (g[0][1, :, 40:] == 0).all()
    rows_off = torch.rand(97, 113) > 0.4
    rows_off[::5] = False
    check(q[:1], k[:1], v[:1], score_mod=full_bias, mask=rows_off)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_within_twice_the_reference(dtype: torch.dtype) -> None:
    q, k, v = qkv(1, H, 2, 97, 300, 64)
    check(q, k, v, dtype=dtype, score_mod=alibi_captured, is_causal=True)


def test_generated_function_directly() -> None:
    """compile_score_mod + native.forward, and an index out of range raising IndexError."""
    mod = sm.compile_score_mod(head_query_bias)
    q, k, v = (t.float() for t in qkv(1, H, H, 20, 30, 16))
    out, lse = native.forward(q, k, v, score_mod=mod)
    ref, lse_ref = ak.attention(q.double(), k.double(), v.double(), score_mod=head_query_bias,
                                backend="reference", return_lse=True)
    assert (out.double() - ref).abs().max() < 1e-5 and (lse.double() - lse_ref).abs().max() < 1e-4
    small = torch.zeros(H, 10)
    bad = sm.compile_score_mod(lambda s, b, h, q, kv: s + small[h, kv])
    with pytest.raises(IndexError, match="out of range"):
        native.forward(q, k, v, score_mod=bad)


def test_unsupported_op_and_grad_tensor_fall_back() -> None:
    def atan_mod(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return score + torch.atan(score)                      # not in the op table

    q, k, v = qkv(1, H, 2, 40, 50, 16)
    assert isinstance(sm.for_problem(atan_mod), str)
    p = prepare(q.float(), k.float(), v.float(), score_mod=atan_mod).problem
    assert any("atan" in r for r in native_reasons(p))       # tiled's reasons say why
    check(q, k, v, score_mod=atan_mod, is_causal=True, native_calls=0)
    w = torch.tensor(0.3, dtype=torch.float32, requires_grad=True)

    def learned(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return score + w * (q_idx - kv_idx)

    with counting() as n:
        out = ak.attention(*(t.float() for t in (q, k, v)), score_mod=learned, backend="tiled")
        out.sum().backward()
    assert n["native"] == 0 and w.grad is not None
    with torch.no_grad(), counting() as n:                  # no autograd: w is a constant
        ak.attention(*(t.float() for t in (q, k, v)), score_mod=learned, backend="tiled")
    assert n["native"] == 1


def test_failed_build_warns_once_and_is_right(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path) -> None:  # noqa: ANN001
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(tmp_path))   # no cached build to find
    q, k, v = qkv(1, H, 2, 30, 40, 16)
    for cxx, why in (("/nonexistent/c++", "no C\\+\\+ compiler"), ("false", "build failed")):
        sm.clear()
        monkeypatch.setenv("CXX", cxx)
        with pytest.warns(RuntimeWarning, match=why):
            check(q, k, v, score_mod=sqrt_distance, is_causal=True, native_calls=0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")                    # one warning, not one per call
            check(q, k, v, score_mod=sqrt_distance, is_causal=True, native_calls=0)
    sm.clear()


def test_switched_off_and_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = qkv(1, H, 2, 30, 40, 16)
    monkeypatch.setenv("ATTNKIT_NATIVE", "0")
    check(q, k, v, score_mod=relative_position, native_calls=0)
    monkeypatch.delenv("ATTNKIT_NATIVE")
    before = sm.stats()
    check(q, k, v, score_mod=relative_position)
    check(q, k, v, score_mod=lambda s, b, h, qi, ki: s + (qi - ki))   # same source: no build
    after = sm.stats()
    assert after["builds"] - before["builds"] <= 1 and after["traces"] >= before["traces"] + 2


def test_trace_reused_only_while_captured_data_is_the_same() -> None:
    """A second call of the same code on the same captured tensors reuses the trace; an
    in-place update (here of a float16 tensor the kernel reads through a float32 copy), a
    rebound closure or a changed Python constant is traced again — never stale."""
    table = torch.randn(H, 64).half()
    state = {"scale": 1.0}

    def make(t):  # noqa: ANN001, ANN202
        def mod(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
            return score + state["scale"] * t[h, kv_idx % 64].float()
        return mod

    q, k, v = qkv(1, H, 2, 40, 70, 16)
    mod = make(table)
    check(q, k, v, score_mod=mod, is_causal=True)
    before = sm.stats()
    check(q, k, v, score_mod=mod, is_causal=True)
    assert sm.stats()["traces"] == before["traces"] and sm.stats()["reused"] > before["reused"]
    with torch.no_grad():
        table.mul_(-3)                                        # in place: version changes
    check(q, k, v, score_mod=mod, is_causal=True)
    check(q, k, v, score_mod=make(torch.randn(H, 64).half()), is_causal=True)
    state["scale"] = 0.25
    check(q, k, v, score_mod=mod, is_causal=True)
    assert sm.stats()["traces"] >= before["traces"] + 3


def test_trace_keys_nested_arguments_by_their_structure() -> None:
    """An op taking a list (``torch.stack``) is keyed by the list's length too: a closure
    that stacks the score n times has another signature when n changes, so it is never
    answered from the n = 2 trace (flat arguments take a shorter key path than nested
    ones); the call matches the reference."""
    state = {"n": 2}

    def mod(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return torch.stack([score] * state["n"]).sum(0) * 0.5 - 0.01 * (q_idx - kv_idx)

    def key() -> tuple:
        got = sm._signature(mod, torch.float32)
        assert got is not None
        return got[0]

    two = key()
    assert key() == two                                       # the same run: the same key
    state["n"] = 3
    assert key() != two
    q, k, v = qkv(1, H, 1, 33, 47, 16)
    check(q, k, v, score_mod=mod, is_causal=True, native_calls=0)   # (stack: Python path)


def test_trace_keys_the_keyword_names_of_flat_arguments() -> None:
    """The same code calling ``clamp(score, min=c)`` then ``clamp(score, max=c)`` (one flat
    keyword, another name): another signature, so the second call is traced again and both
    match the reference on the native path (a key without the names reused the first
    build: a silent wrong answer)."""
    state = {"kw": "min"}

    def mod(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return torch.clamp(score, **{state["kw"]: 0.0}) - 0.01 * (q_idx - kv_idx)

    first = sm._signature(mod, torch.float32)
    state["kw"] = "max"
    second = sm._signature(mod, torch.float32)
    assert first is not None and second is not None and first[0] != second[0]
    q, k, v = qkv(1, H, 1, 33, 47, 16, scale=3.0)
    for kw in ("min", "max"):
        state["kw"] = kw
        check(q, k, v, score_mod=mod, is_causal=True)              # native, vs the reference


# ---------------------------------------------------------------- float64: the double rows
@pytest.mark.parametrize("mod", MODS, ids=lambda f: f.__name__)
def test_float64_runs_the_double_build_to_float64_rounding(mod) -> None:  # noqa: ANN001
    # float64 inputs: the function is traced with a float64 score and built for double rows
    q, k, v = qkv(2, H, 2, 37, 113, 24)                       # GQA, N_q != N_k
    with counting() as n:
        out, g = attend(q, k, v, F64, "tiled", score_mod=mod, is_causal=True, softcap=8.0)
    assert n["native"] == 1 and n["runs"] == 0                # the kernel, not Python
    ref, gref = attend(q, k, v, F64, "reference", score_mod=mod, is_causal=True, softcap=8.0)
    tol = {"atol": 1e-11, "rtol": 1e-9}
    torch.testing.assert_close(out, ref, **tol)
    for a, b in zip(g, gref, strict=True):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("mod", [alibi_captured, tanh_softcap, mixed_ops, t5_buckets],
                         ids=lambda f: f.__name__)
def test_gradcheck_of_the_generated_derivative(mod) -> None:  # noqa: ANN001
    # the forward-mode derivative codegen writes, checked by finite differences on the kernel
    g = torch.Generator().manual_seed(21)
    q, k, v = (torch.randn(1, H, n, 8, generator=g, dtype=F64, requires_grad=True)
               for n in (7, 11, 11))
    f = lambda q, k, v: ak.attention(q, k, v, score_mod=mod, softcap=4.0,  # noqa: E731
                                     backend="tiled")
    with counting() as n:
        assert torch.autograd.gradcheck(f, (q, k, v))
    assert n["native"] > 0 and n["runs"] == 0


def test_compiled_for_the_wrong_dtype_is_refused() -> None:
    mod = sm.compile_score_mod(head_query_bias)                # float rows
    q, k, v = qkv(1, H, H, 5, 6, 8)
    with pytest.raises(TypeError, match="compiled for torch.float32 rows"):
        native.forward(q, k, v, score_mod=mod)
    out, _ = native.forward(q, k, v, score_mod=sm.compile_score_mod(head_query_bias,
                                                                  dtype=F64))
    ref = ak.attention(q, k, v, score_mod=head_query_bias, backend="reference")
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_float_remainder_and_floor_divide_round_as_torch(dtype: torch.dtype) -> None:
    # a - b·floor(a / b) loses the remainder once a / b rounds; torch works from fmod
    def mod(s, b, h, qi, ki):  # noqa: ANN001, ANN202
        a = (qi - ki) * 0.37 - 10.5
        return (s + torch.remainder(a, 0.7) - 0.1 * torch.floor_divide(a, -0.7)
                + torch.remainder(((ki + 1) * 0.3), 0.1) * 10 + torch.fmod(a, 0.3))

    q, k, v = qkv(1, H, H, 23, 41, 8)
    with counting() as n:
        out = ak.attention(q.to(dtype), k.to(dtype), v.to(dtype), score_mod=mod,
                           backend="tiled")
    assert n["native"] == 1
    ref = ak.attention(q.to(dtype), k.to(dtype), v.to(dtype), score_mod=mod,
                       backend="reference")
    tol = {"atol": 1e-12, "rtol": 1e-10} if dtype == F64 else {"atol": 2e-5, "rtol": 2e-5}
    torch.testing.assert_close(out, ref, **tol)


# ---------------------------------------------------------------- never stale, never shared
def native_vs_reference(q, k, v, mod) -> float:  # noqa: ANN001
    """Max |tiled (native) - reference| of one float32 call of ``mod``."""
    with counting() as n:
        out = ak.attention(q, k, v, score_mod=mod, backend="tiled")
    assert n["native"] == 1, n
    ref = ak.attention(q.double(), k.double(), v.double(), score_mod=mod, backend="reference")
    return (out.double() - ref).abs().max().item()


STALE_TABLE = torch.zeros(H, 64, dtype=torch.int32)


def _stale_array():  # noqa: ANN202
    import numpy as np
    return np.zeros(64)


STALE_ARRAY = _stale_array()


def via_data(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN201
    return score + STALE_TABLE[h, kv_idx % 64] * 0.25           # read per score


def via_folded(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN201
    return score + STALE_TABLE.long()[h, kv_idx % 64] * 0.25    # the trace folds .long()


def via_numpy(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN201
    return (score + torch.tensor(STALE_ARRAY)[kv_idx % 64]
            + torch.as_tensor(STALE_ARRAY)[kv_idx % 64])


@pytest.mark.parametrize("mod", [via_data, via_folded, via_numpy], ids=lambda f: f.__name__)
def test_captured_data_written_behind_torchs_back_is_never_served_stale(mod) -> None:  # noqa: ANN001
    """A write through ``t.data`` (its own version counter), under a constant the trace folds
    (``table.long()``), or by NumPy to an array read with ``torch.tensor`` /
    ``torch.as_tensor`` inside the score_mod: the next call computes with the new data."""
    STALE_TABLE.zero_()
    STALE_ARRAY[:] = 0.0
    q, k, v = (t.float() for t in qkv(1, H, 2, 20, 64, 16))
    assert native_vs_reference(q, k, v, mod) < 1e-5
    STALE_TABLE.data[:, :32] = 5                        # .data: STALE_TABLE._version unchanged
    STALE_ARRAY[:32] = 2.0                              # NumPy: torch sees nothing
    assert native_vs_reference(q, k, v, mod) < 1e-5


def test_threads_share_a_compiled_score_mod_but_not_its_call_state() -> None:
    """One score_mod in two threads: the out-of-range flag and the captured data belong to
    each call — the in-range thread never raises, the out-of-range one always does."""
    small = torch.randn(H, 50)

    def mod(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return score + small[h, kv_idx]                 # kv_idx >= 50: torch raises

    g = torch.Generator().manual_seed(9)
    q = torch.randn(1, H, 96, 32, generator=g)
    k_in, v_in = (torch.randn(1, H, 40, 32, generator=g) for _ in range(2))
    k_out, v_out = (torch.randn(1, H, 60, 32, generator=g) for _ in range(2))
    ak.attention(q, k_in, v_in, score_mod=mod, backend="tiled")      # compiled once
    ref = ak.attention(q, k_in, v_in, score_mod=mod, backend="reference")
    raised = {"in": 0, "out": 0, "wrong": 0}
    start = threading.Barrier(2)

    def run(which: str, k: torch.Tensor, v: torch.Tensor) -> None:
        start.wait()
        for _ in range(40):
            try:
                out = ak.attention(q, k, v, score_mod=mod, backend="tiled")
                if which == "in" and (out - ref).abs().max() > 1e-5:
                    raised["wrong"] += 1
            except IndexError:
                raised[which] += 1

    threads = [threading.Thread(target=run, args=a) for a in (("in", k_in, v_in),
                                                              ("out", k_out, v_out))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert raised == {"in": 0, "out": 40, "wrong": 0}


def test_float64_call_with_float32_and_float16_intermediates() -> None:
    """A float64 call whose score_mod computes in float32 / float16: correctly rounded ops
    (casts, + - * /, comparisons) agree with the float64 reference as torch computes them
    (float16 nodes rounded); torch's float32 functions (exp, tanh, even sqrt here) are not
    correctly rounded and neither are the kernel's, so those agree to float32 precision at
    the node — the rule in score_mod.py's Caution."""
    q, k, v = qkv(1, H, 2, 37, 53, 16)

    def exact(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        d = (q_idx - kv_idx).float()
        return (score + (d * 0.1 + score.float() / 3).double() + (score.half() * 1.5).double()
                + torch.where(d.half() > 2.5, 0.3, -0.1))

    def functions(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        d = (q_idx - kv_idx).abs().float()
        return score + torch.exp(-d * 0.3) + score.float().tanh() - 0.1 * d.sqrt()

    with counting() as n:
        out = ak.attention(q, k, v, score_mod=exact, backend="tiled")
        out_f = ak.attention(q, k, v, score_mod=functions, backend="tiled")
    assert n["native"] == 2
    ref = ak.attention(q, k, v, score_mod=exact, backend="reference")
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    ref_f = ak.attention(q, k, v, score_mod=functions, backend="reference")
    err = (out_f - ref_f).abs().max().item()
    assert err < 8 * 2.0**-24 * 8, err                  # a few float32 ulps of the terms


I32 = torch.tensor([2**30, 2**30 + 5, 3, -2**31, 7, 2**31 - 1] * 20, dtype=torch.int32)
EXPONENT = torch.tensor([-1, -2, 0, 3, -3, 1] * 20)


def integer_and_half_semantics(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN201
    wrap = kv_idx.to(torch.uint8).float() * 0.01 + (kv_idx * 3).to(torch.int8).float() * 0.01
    overflow = (I32[kv_idx] * 3 + I32[kv_idx]).double() * 1e-9     # int32 wraps
    power = torch.pow(kv_idx % 5 - 2, EXPONENT[kv_idx]).float()     # 0, or ±1, for b < 0
    d = (q_idx - kv_idx).float() * 0.37                    # exact inputs: no flaky rounding
    rounded = d.half().float() * 0.1 + (d * 1.7).bfloat16().float() * 0.1
    return score + wrap + overflow + power + rounded


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_integer_wrapping_negative_powers_and_half_rounding_as_torch(dtype) -> None:  # noqa: ANN001
    """The compiled function computes what torch computes: narrow integer casts wrap, int32
    arithmetic wraps at 32 bits, an integer to a negative power is 0 (but for ±1), and
    ``.half()`` / ``.bfloat16()`` round to their formats."""
    q, k, v = (t.to(dtype) for t in qkv(1, H, 2, 30, 120, 16, scale=4.0))
    with counting() as n:
        out = ak.attention(q, k, v, score_mod=integer_and_half_semantics, backend="tiled")
    assert n["native"] == 1
    ref = ak.attention(q, k, v, score_mod=integer_and_half_semantics, backend="reference")
    tol = {"atol": 1e-12, "rtol": 1e-10} if dtype == F64 else {"atol": 2e-5, "rtol": 2e-5}
    torch.testing.assert_close(out, ref, **tol)
