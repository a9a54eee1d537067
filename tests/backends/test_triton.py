"""The triton backend: kernels vs the float64 reference, run in Triton's CPU interpreter.

``TRITON_INTERPRET`` is set per test (``monkeypatch``), never for the whole process: the backend
reads it at each call and loads an interpreted copy of its kernels, so other tests in the same
pytest process still see a CPU-only triton backend that ``auto`` skips.

Shapes are small and awkward (N 1, 17, 33; D 8 and 24, padded to 16/32 in-kernel; N_q ≠ N_k;
GQA) and the tiles are 16 × 16, so every case crosses tile boundaries and partial tiles.
"""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from attnkit import backends
from attnkit import masks as M
from attnkit.api import prepare
from attnkit.backends import triton as tb
from attnkit.backends.base import Problem

needs_triton = pytest.mark.skipif(not tb.triton_available(),
                                  reason="the triton package is not installed")


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the kernels in Triton's interpreter (CPU tensors) for this test only."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(params=["interpreter", "cuda"])
def device(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> torch.device:
    """CPU tensors in the interpreter, and CUDA tensors where a GPU is present."""
    if request.param == "cuda":
        if not (torch.cuda.is_available() and tb.triton_available()):
            pytest.skip("needs a CUDA device and the triton package")
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        return torch.device("cuda")
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return torch.device("cpu")


def _precision(device: torch.device) -> tuple[torch.dtype, float]:
    """float64 in the interpreter; float32 on the GPU (whose kernels take float32 scalars)."""
    return (torch.float64, 1e-10) if device.type == "cpu" else (torch.float32, 1e-5)


def _problem(b, hq, hkv, nq, nk, dk, dv, dtype=torch.float64, **kw) -> Problem:  # noqa: ANN001
    q = torch.randn(b, hq, nq, dk, dtype=dtype)
    k = torch.randn(b, hkv, nk, dk, dtype=dtype)
    v = torch.randn(b, hkv, nk, dv, dtype=dtype)
    return prepare(q, k, v, **kw).problem


def _cast(p: Problem, dtype: torch.dtype, grad: bool = False) -> Problem:
    """The same problem in another dtype (q, k, v fresh leaves when ``grad``)."""
    t = [x.detach().to(dtype).requires_grad_(grad) for x in (p.q, p.k, p.v)]
    return Problem(**{**p.__dict__, "q": t[0], "k": t[1], "v": t[2]})


def _run(backend, p: Problem, d_out: torch.Tensor, d_lse: torch.Tensor):  # noqa: ANN001, ANN202
    """out, lse and the gradients of  Σ out·d_out + Σ_finite lse·d_lse  w.r.t. q, k, v."""
    out, lse = backend.forward(p)
    lse_used = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    loss = (out.double() * d_out).sum() + (lse_used.double() * d_lse).sum()
    grads = torch.autograd.grad(loss, (p.q, p.k, p.v))
    return (out.detach(), lse.detach(), *grads)


def _worst(x: torch.Tensor, ref: torch.Tensor) -> float:
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(x), finite), "non-finite entries differ from the reference"
    assert torch.equal(x[~finite].double(), ref[~finite]), "−∞ entries differ from the reference"
    return float((x.double() - ref)[finite].abs().max()) if finite.any() else 0.0


class _Naive:
    """Attention done plainly in the inputs' own dtype (no float32 accumulation by design)."""

    def forward(self, p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
        k = p.k.repeat_interleave(p.group, dim=1)
        v = p.v.repeat_interleave(p.group, dim=1)
        x = (p.q @ k.transpose(-1, -2)) * p.scale
        if p.softcap is not None:
            x = p.softcap * torch.tanh(x / p.softcap)
        if p.bias is not None:
            x = x + p.bias.to(x.dtype)
        allowed = p.allowed_dense()
        if allowed is not None:
            x = torch.where(allowed, x, torch.full_like(x, -math.inf))
        lse = torch.logsumexp(x, -1)
        w = torch.exp(x - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
        return w @ v, lse


def _check_against_reference(p64: Problem, dtype: torch.dtype, block: int = 16) -> None:
    """The kernel's error vs float64 must be within 2× (gradients 3×) of the error that
    attention computed in ``dtype`` makes (the reference, which accumulates in float32, or
    plain torch in ``dtype``, whichever is worse), plus a few units in the last place."""
    dev = p64.q.device
    d_out = torch.randn(p64.batch, p64.heads_q, p64.n_q, p64.d_v, dtype=torch.float64,
                        device=dev)
    d_lse = torch.randn(p64.batch, p64.heads_q, p64.n_q, dtype=torch.float64, device=dev)
    exact = _run(backends.get("reference"), _cast(p64, torch.float64, True), d_out, d_lse)
    low = _run(backends.get("reference"), _cast(p64, dtype, True), d_out, d_lse)
    naive = _run(_Naive(), _cast(p64, dtype, True), d_out, d_lse)
    got = _run(tb.TritonBackend(block, block), _cast(p64, dtype, True), d_out, d_lse)
    assert got[0].dtype == dtype and got[0].shape == exact[0].shape
    assert got[1].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    eps = torch.finfo(dtype).eps
    names, factors = ("out", "lse", "dq", "dk", "dv"), (2, 2, 3, 3, 3)
    for name, g, lo, nv, ex, factor in zip(names, got, low, naive, exact, factors, strict=True):
        finite = ex[torch.isfinite(ex)]
        floor = 8 * eps * max(1.0, float(finite.abs().max()) if finite.numel() else 1.0)
        err = _worst(g, ex)
        base = max(_worst(lo, ex), _worst(nv, ex))
        assert err <= factor * base + floor, f"{name}: error {err:.3g}, baseline's {base:.3g}"


CASES = {
    "single query and key, D 8": dict(shape=(1, 1, 1, 1, 1, 8, 8)),
    "n_q < n_k, D_k 24, GQA": dict(shape=(1, 2, 1, 17, 33, 24, 8)),
    "causal top_left, n_q > n_k, softcap": dict(shape=(1, 2, 1, 33, 17, 8, 24),
                                                is_causal=True, softcap=2.0),
    "causal bottom_right, n_q < n_k, GQA": dict(shape=(1, 3, 1, 17, 33, 8, 8),
                                                mask=M.causal("bottom_right")),
    "causal bottom_right, n_q > n_k (empty rows)": dict(shape=(1, 1, 1, 33, 17, 8, 8),
                                                        mask=M.causal("bottom_right")),
    "two-sided sliding window, softcap": dict(shape=(1, 1, 1, 33, 33, 8, 8), softcap=1.5,
                                              mask=M.sliding_window(5, causal=False)),
    "causal & sliding window, bottom_right": dict(
        shape=(1, 2, 2, 17, 33, 8, 8),
        mask=M.causal("bottom_right") & M.sliding_window(4, align="bottom_right")),
    "padding with empty queries & causal": dict(
        shape=(2, 2, 1, 17, 17, 8, 8), mask=M.padding([17, 9], q_lengths=[17, 5]) & M.causal()),
    "prefix_lm (a general mask)": dict(shape=(1, 1, 1, 33, 33, 8, 8), mask=M.prefix_lm(7)),
    "document & causal (tiles skipped)": dict(
        shape=(2, 1, 1, 33, 33, 8, 8),
        mask=M.document(torch.tensor([[0] * 20 + [1] * 13, [0] * 3 + [1] * 30])) & M.causal()),
}


@needs_triton
@pytest.mark.parametrize("case", list(CASES))
def test_forward_backward_match_reference_float32(interpret: None, case: str) -> None:
    spec = dict(CASES[case])
    p = _problem(*spec.pop("shape"), **spec)
    _check_against_reference(p, torch.float32)


@needs_triton
@pytest.mark.parametrize("cap", [1.0, 30.0, 1e3, 1e8])
def test_softcap_meets_the_low_precision_rule_at_every_cap(interpret: None, cap: float) -> None:
    # c·tanh(x/c) near x/c = 0 must not lose c·eps absolute (the old 1 − 2/(e^{2x}+1) did)
    p = _problem(1, 2, 1, 17, 33, 8, 8, is_causal=True, softcap=cap)
    p = Problem(**{**p.__dict__, "q": p.q * 3.0})          # logits of a few units
    _check_against_reference(p, torch.float32)


@needs_triton
def test_bool_mask_with_fully_masked_rows_gives_zero_output_and_grads(interpret: None) -> None:
    allowed = torch.rand(17, 9) > 0.4
    allowed[[0, 5, 16]] = False                                # rows with no allowed key
    p = _problem(1, 2, 1, 17, 9, 8, 24, mask=allowed)
    _check_against_reference(p, torch.float32)
    q, k, v = (x.float().requires_grad_() for x in (p.q, p.k, p.v))
    out, lse = ak.attention(q, k, v, mask=allowed, backend="triton", return_lse=True)
    assert torch.isneginf(lse[:, :, [0, 5, 16]]).all() and torch.isfinite(lse[:, :, 1]).all()
    assert (out[:, :, [0, 5, 16]] == 0).all()
    dq, dk, dv = torch.autograd.grad(out.sum() + lse[:, :, 1:5].sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert (dq[:, :, [0, 5, 16]] == 0).all()


@needs_triton
def test_garbage_in_fully_masked_query_rows_stays_out_of_every_gradient(interpret: None) -> None:
    allowed = torch.rand(17, 9) > 0.4
    allowed[[0, 5, 16]] = False                                # rows with no allowed key
    q = torch.randn(1, 2, 17, 8, dtype=torch.float64)
    q[:, :, [0, 5, 16]] = math.nan                             # padded rows of garbage
    k, v = torch.randn(1, 1, 9, 8, dtype=torch.float64), torch.randn(1, 1, 9, 8,
                                                                      dtype=torch.float64)
    grads = {}
    for name in ("triton", "reference"):
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        out = ak.attention(qq, kk, vv, mask=allowed, backend=name)
        assert (out[:, :, [0, 5, 16]] == 0).all()
        grads[name] = torch.autograd.grad(out.square().sum(), (qq, kk, vv))
    for got, ref in zip(grads["triton"], grads["reference"], strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, ref, atol=1e-10, rtol=1e-10)


@needs_triton
def test_float_mask_becomes_bias_and_mask(interpret: None) -> None:
    add = torch.randn(2, 17, 33, dtype=torch.float64)          # (H, N_q, N_k)
    add[0, 3, ::2] = -math.inf
    p = _problem(1, 2, 2, 17, 33, 8, 8, mask=add)
    assert p.bias is not None and p.mask is not None
    _check_against_reference(p, torch.float32)


@needs_triton
@pytest.mark.parametrize("shape", [(2, 17, 33), (1, 1, 33)], ids=["(H,N_q,N_k)", "(1,1,N_k)"])
def test_gradient_of_a_float_mask(device: torch.device, shape: tuple[int, ...]) -> None:
    dtype, tol = _precision(device)
    q = torch.randn(1, 2, 17, 8, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(1, 1, 33, 8, dtype=dtype, device=device)
    v = torch.randn(1, 1, 33, 8, dtype=dtype, device=device, requires_grad=True)
    add = torch.randn(shape, dtype=dtype, device=device)
    add[..., 3] = -math.inf                                    # blocked: no gradient there
    add.requires_grad_()
    grads = {}
    for name in ("triton", "reference"):
        out = ak.attention(q, k, v, mask=add, is_causal=False, softcap=4.0, backend=name)
        grads[name] = torch.autograd.grad((out * out).sum(), (q, v, add))
    for got, ref in zip(grads["triton"], grads["reference"], strict=True):
        torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
    assert (grads["triton"][2][..., 3] == 0).all()


@needs_triton
def test_float16_within_twice_the_reference_error(interpret: None) -> None:
    p = _problem(1, 2, 1, 33, 17, 24, 8, is_causal=True, softcap=3.0)
    _check_against_reference(p, torch.float16, block=32)


@needs_triton
def test_bfloat16_refused_in_the_interpreter(interpret: None) -> None:
    p = _problem(1, 1, 1, 4, 4, 8, 8, dtype=torch.bfloat16)
    reasons = backends.get("triton").not_supported_reasons(p)
    assert any("bfloat16" in r and "11584" in r for r in reasons), reasons
    assert backends.select(p).name != "triton"


@needs_triton
@pytest.mark.parametrize("opts,says", [({"scale": 1e200}, "scale=1e+200"),
                                       ({"scale": -1e-300}, "scale=-1e-300"),
                                       ({"softcap": 1e-200}, "softcap=1e-200")])
def test_float64_scalars_beyond_float32_are_declined_by_the_compiled_kernels(
        monkeypatch: pytest.MonkeyPatch, opts: dict, says: str) -> None:
    """The compiled kernels take scale and softcap as float32: a float64 call with either
    outside float32's range would meet inf or 0 there (the interpreter keeps float64)."""
    p = _problem(1, 1, 1, 4, 4, 8, 8, **opts)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reasons = backends.get("triton").extra_reasons(p)
    assert any(says in r and "float32" in r for r in reasons), reasons
    assert not any("float32" in r for r in backends.get("triton").extra_reasons(_problem(
        1, 1, 1, 4, 4, 8, 8, scale=1e30, softcap=1e-30)))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not any("float32" in r for r in backends.get("triton").extra_reasons(p))


@needs_triton
def test_dropout_drops_weights_and_rescales_the_rest(device: torch.device) -> None:
    # V = I: the output rows are the (dropped-out) weights themselves
    dtype, tol = _precision(device)
    q = torch.randn(1, 2, 17, 8, dtype=dtype, device=device)
    k = torch.randn(1, 2, 32, 8, dtype=dtype, device=device)
    v = torch.eye(32, dtype=dtype, device=device).expand(1, 2, 32, 32)
    weights = ak.attention(q, k, v, is_causal=True, backend="reference")
    torch.manual_seed(7)
    out = ak.attention(q, k, v, is_causal=True, dropout_p=0.5, backend="triton")
    torch.manual_seed(7)
    again = ak.attention(q, k, v, is_causal=True, dropout_p=0.5, backend="triton")
    other = ak.attention(q, k, v, is_causal=True, dropout_p=0.5, backend="triton")
    assert torch.equal(out, again) and not torch.equal(out, other)
    dropped = out == 0
    assert torch.allclose(out[~dropped], 2 * weights[~dropped], rtol=tol, atol=0)
    allowed = weights > 0
    assert (dropped | allowed).all()
    rate = float((dropped & allowed).sum() / allowed.sum())      # ~306 allowed pairs
    assert 0.38 < rate < 0.62, rate


@needs_triton
def test_dropout_gradients_match_finite_differences(interpret: None) -> None:
    p = _problem(1, 2, 1, 5, 7, 3, 2, mask=M.causal("bottom_right"), dropout_p=0.3)
    be = tb.TritonBackend()

    def fn(q, k, v):  # noqa: ANN001, ANN202
        torch.manual_seed(11)                      # one dropout pattern for every evaluation
        return be.forward(Problem(**{**p.__dict__, "q": q, "k": k, "v": v}))

    inputs = [x.detach().clone().requires_grad_() for x in (p.q, p.k, p.v)]
    assert torch.autograd.gradcheck(fn, inputs, fast_mode=True)


@needs_triton
def test_gradcheck_float64(interpret: None) -> None:
    p = _problem(1, 2, 1, 5, 7, 3, 2, mask=M.causal("bottom_right"), softcap=1.0)
    be = tb.TritonBackend()

    def fn(q, k, v):  # noqa: ANN001, ANN202
        out, lse = be.forward(Problem(**{**p.__dict__, "q": q, "k": k, "v": v}))
        return out, lse

    inputs = [x.detach().clone().requires_grad_() for x in (p.q, p.k, p.v)]
    assert torch.autograd.gradcheck(fn, inputs, fast_mode=True)


@needs_triton
def test_padded_kv_rows_are_never_read(interpret: None) -> None:
    k = torch.randn(2, 1, 33, 8)
    v = torch.randn(2, 1, 33, 8)
    k[0, :, 20:], v[0, :, 20:] = math.nan, math.inf          # garbage past the length
    p = prepare(torch.randn(2, 2, 17, 8), k, v, mask=M.padding([20, 33])).problem
    out, lse = tb.TritonBackend(16, 16).forward(p)             # the kernel alone, no rerun
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


@needs_triton
def test_public_api_non_contiguous_inputs_and_nan_in_masked_rows(interpret: None) -> None:
    # (B, N, H, D) storage viewed as (B, H, N, D): strides are not contiguous
    q = torch.randn(2, 17, 2, 8).transpose(1, 2)
    k = torch.randn(2, 33, 1, 8).transpose(1, 2)
    v = torch.randn(2, 33, 1, 24).transpose(1, 2)
    k[:, :, 20:] = math.nan                                    # keys no query may see
    v[:, :, 20:] = math.inf
    mask = M.padding([20, 20])
    assert backends.select(prepare(q, k, v, mask=mask).problem).name == "triton"
    out = ak.attention(q, k, v, mask=mask, backend="auto")
    ref = ak.attention(q.double(), k.double(), v.double(), mask=mask, backend="reference")
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-6)


@needs_triton
def test_second_derivatives_are_refused_not_wrong(interpret: None) -> None:
    q = torch.randn(1, 1, 3, 4, dtype=torch.float64, requires_grad=True)
    out = ak.attention(q, q, q, backend="triton")
    # one attnkit error, raised where the second-order graph would be built
    with pytest.raises(NotImplementedError, match="'triton' computes first derivatives only"):
        torch.autograd.grad(out.square().sum(), q, create_graph=True)
    (dq,) = torch.autograd.grad(ak.attention(q, q, q, backend="triton").square().sum(), q)
    assert torch.isfinite(dq).all()                # first derivatives still work


@needs_triton
def test_gradient_of_q_alone(interpret: None) -> None:
    q = torch.randn(1, 2, 17, 8, dtype=torch.float64, requires_grad=True)
    k, v = torch.randn(1, 1, 9, 8, dtype=torch.float64), torch.randn(1, 1, 9, 8,
                                                                      dtype=torch.float64)
    (dq,) = torch.autograd.grad(ak.attention(q, k, v, backend="triton").square().sum(), q)
    (ref,) = torch.autograd.grad(ak.attention(q, k, v, backend="reference").square().sum(), q)
    torch.testing.assert_close(dq, ref, atol=1e-12, rtol=1e-12)


# ----------------------------------------------------------------- no kernels needed below
def test_cpu_tensors_without_interpreter_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    p = _problem(1, 1, 1, 4, 4, 8, 8, dtype=torch.float32)
    reasons = backends.get("triton").not_supported_reasons(p)
    assert any("CUDA" in r and "TRITON_INTERPRET" in r for r in reasons), reasons
    assert backends.select(p).name != "triton"
    with pytest.raises(ValueError, match="backend 'triton' cannot run"):
        ak.attention(p.q, p.k, p.v, backend="triton")


def test_registered_first_in_priority() -> None:
    assert backends.PRIORITY[0] == "triton"


def test_reasons_name_each_unsupported_option(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    be = backends.get("triton")
    assert be.not_supported_reasons(_problem(1, 1, 1, 4, 4, 8, 8, is_causal=True)) == [] or \
        not tb.triton_available()
    cases = {
        "score_mod": _problem(1, 2, 2, 4, 4, 8, 8, score_mod=ak.scores.alibi(2)),
        "exceed 256": _problem(1, 1, 1, 2, 2, 8, 300),
    }
    for needle, p in cases.items():
        reasons = be.not_supported_reasons(p)
        assert any(needle in r for r in reasons), (needle, reasons)


BANDS = [M.causal(), M.causal("bottom_right"), M.sliding_window(3),
         M.sliding_window(4, causal=False, align="bottom_right"),
         M.sliding_window(2, align="bottom_right") & M.causal(), M.full() & M.causal()]


@pytest.mark.parametrize("mask", BANDS, ids=repr)
@pytest.mark.parametrize(("n_q", "n_k"), [(5, 9), (9, 5), (7, 7)])
def test_band_detection_matches_the_mask(mask: M.Mask, n_q: int, n_k: int) -> None:
    p = _problem(1, 1, 1, n_q, n_k, 4, 4, mask=mask)
    plan = tb._plan_mask(p)
    assert plan.dense is None and plan.band is not None
    lo, hi = plan.band
    d = torch.arange(n_q)[:, None] - torch.arange(n_k)[None, :]
    assert torch.equal((d >= lo) & (d <= hi), mask.to_dense(n_q, n_k)[0, 0])


def test_mask_terms_go_to_the_cheapest_mechanism() -> None:
    p = _problem(2, 3, 3, 6, 8, 4, 4, mask=M.padding([3, 5], q_lengths=[6, 2]) & M.causal())
    plan = tb._plan_mask(p)
    assert plan.band == (0, 6 + 8 + 1) and plan.dense is None and plan.summary is None
    assert plan.kv_len.tolist() == [3, 5] and plan.q_len.tolist() == [6, 2]

    ids = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1]])
    p = _problem(2, 1, 1, 6, 6, 4, 4, mask=M.document(ids) & M.sliding_window(3))
    plan = tb._plan_mask(p)
    assert plan.band == (0, 2) and plan.dense is None
    assert torch.equal(plan.q_ids, ids) and torch.equal(plan.k_ids, ids)
    tiles = plan.tiles(6, 6, 2, 2)
    assert tiles.shape == (2, 1, 3, 3) and tiles[0, 0, 0, 2] == M.EMPTY

    mask = M.prefix_lm(2) & M.padding([3, 5]) & M.padding([4, 4])   # paddings intersect
    p = _problem(2, 3, 3, 6, 8, 4, 4, mask=mask)
    plan = tb._plan_mask(p)
    assert plan.kv_len.tolist() == [3, 4] and plan.dense is not None
    assert plan.dense.dtype == torch.uint8 and plan.dense.shape == (1, 1, 6, 8)
    dense = plan.dense.bool() & (torch.arange(8) < plan.kv_len.view(2, 1, 1, 1))
    assert torch.equal(dense, mask.to_dense(6, 8, batch=2))


def test_launch_falls_back_to_smaller_tiles_when_shared_memory_runs_out() -> None:
    pytest.importorskip("triton")
    from triton.runtime.errors import OutOfResources

    seen: list[tuple[int, ...]] = []

    def launch(bm: int, bn: int, warps: int, stages: int) -> None:
        seen.append((bm, bn, warps, stages))
        if bm * bn > 32 * 32:
            raise OutOfResources(bm * bn, 32 * 32, "shared memory")

    tb._with_fallback(launch, (128, 64, 8, 3), interpret=False)
    assert seen[0] == (128, 64, 8, 3) and seen[1] == (128, 64, 8, 1)
    assert seen[-1][0] * seen[-1][1] <= 32 * 32 and len(seen) < 8

    def never(bm: int, bn: int, warps: int, stages: int) -> None:
        raise OutOfResources(1, 0, "shared memory")

    with pytest.raises(OutOfResources):
        tb._with_fallback(never, (32, 32, 4, 2), interpret=False)


def test_tile_sizes_are_checked() -> None:
    with pytest.raises(ValueError, match="power of two"):
        tb.TritonBackend(block_m=24)


# ----------------------------------------------------------------- on a GPU (skipped here)
needs_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and tb.triton_available()),
                                reason="needs a CUDA device and the triton package")

GPU_CASES = {
    "fp16 no mask, D 59/111, GQA": (torch.float16, (2, 4, 2, 1025, 97, 59, 111), {}),
    "bf16 causal, D 128": (torch.bfloat16, (1, 4, 4, 1025, 1025, 128, 128),
                           dict(is_causal=True)),
    "bf16 window & document, softcap": (
        torch.bfloat16, (1, 2, 1, 513, 513, 64, 64),
        dict(mask=M.sliding_window(100) & M.document(torch.arange(513) // 200), softcap=30.0)),
    "fp32 padding & bottom_right causal": (
        torch.float32, (2, 2, 2, 113, 1025, 64, 64),
        dict(mask=M.padding([1025, 600]) & M.causal("bottom_right"))),
}


@needs_cuda
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_cuda_matches_reference(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    dtype, shape, opts = GPU_CASES[case]
    p = _problem(*shape, **opts)             # masks move their own tensors to q's device
    p = Problem(**{**p.__dict__, "q": p.q.cuda(), "k": p.k.cuda(), "v": p.v.cuda()})
    assert backends.select(p).name == "triton"
    _check_against_reference(p, dtype, block=64)
