"""Reliability of ``attention()`` under degenerate sizes, extreme options and user functions
(issue 10): zero-size problems never reach a kernel, out-of-range ``scale``/``softcap`` are
refused, a score_mod's result is cast back and checked once, and FlexAttention's score_mod
functions mean on every backend what they mean in FlexAttention (per-score semantics).

Shape legend: q (B, H_q, N_q, D_k), k (B, H_kv, N_k, D_k), v (B, H_kv, N_k, D_v).
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

import attnkit as ak
from attnkit import masks
from attnkit.scores import alibi, flex_semantics, relative_bias
from helpers.oracle import oracle, randn
from helpers.running import run_backend, skip_unless_supported

TOL = {"rtol": 1e-10, "atol": 1e-10}


def _no_kernel(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Make every backend's forward (and forward_screened) fail loudly: a zero-size call must
    not reach one."""
    for n in ak.backends.names():
        def forward(p, n=n):  # noqa: ANN001, ANN202
            raise AssertionError(f"a zero-size problem reached backend {n!r}: {p.describe()}")
        for method in ("forward", "forward_screened"):
            monkeypatch.setattr(ak.backends.get(n), method, forward)


# ================================================================= 1. zero batch / heads
ZERO_CASES = [
    # q shape,        k/v shape      (B, H_q, N_q, D_k) / (B, H_kv, N_k, D)
    ((1, 0, 3, 4), (1, 2, 3, 4)),    # no query heads, two K/V heads (0 is a multiple of 2)
    ((1, 0, 3, 4), (1, 0, 3, 4)),    # no heads at all
    ((0, 2, 3, 4), (0, 2, 3, 4)),    # no batch
    ((0, 0, 3, 4), (0, 1, 3, 4)),    # neither
    ((0, 4, 3, 4), (0, 2, 5, 4)),    # no batch, GQA, N_q != N_k
    ((2, 0, 0, 4), (2, 0, 0, 4)),    # no heads and no tokens
    ((3, 0, 2, 5, 4), (3, 0, 2, 5, 4)),   # extra leading dim of size 0
]


@pytest.mark.parametrize("q_shape,kv_shape", ZERO_CASES)
@pytest.mark.parametrize("opts", [{}, {"is_causal": True},
                                  {"score_mod": lambda s, b, h, qi, ki: s + (qi - ki)}])
def test_zero_batch_or_heads_give_an_empty_result_without_a_kernel(
        backend, monkeypatch, q_shape, kv_shape, opts):
    _no_kernel(monkeypatch, backend)
    q = randn(*q_shape).requires_grad_()
    k, v = randn(*kv_shape).requires_grad_(), randn(*kv_shape).requires_grad_()
    out, lse = ak.attention(q, k, v, backend=backend, return_lse=True, **opts)
    assert out.shape == (*q_shape[:-1], kv_shape[-1]) and out.dtype == q.dtype
    assert lse.shape == q_shape[:-1]
    assert out.numel() == 0 and lse.numel() == 0
    (out.sum() + lse.sum()).backward()                     # autograd works: zero gradients
    for t in (q, k, v):
        assert t.grad is not None and t.grad.shape == t.shape and (t.grad == 0).all()
    # … and without return_lse, under no_grad, in float16
    with torch.no_grad():
        out = ak.attention(q.half(), k.half(), v.half(), backend=backend, **opts)
    assert out.shape == (*q_shape[:-1], kv_shape[-1]) and out.dtype == torch.float16


def test_zero_kv_heads_for_query_heads_are_refused():
    q, k = randn(1, 2, 3, 4), randn(1, 0, 3, 4)
    with pytest.raises(ValueError, match=r"k and v have no heads \(H_kv=0\) but q has H_q=2"):
        ak.attention(q, k, k)


def test_empty_result_gradients_ignore_nan_inputs():
    """N_k = 0: output 0 and LSE −∞ whatever the query holds (NaN too), gradients 0."""
    q = torch.full((1, 2, 3, 4), torch.nan, dtype=torch.float64, requires_grad=True)
    k, v = randn(1, 2, 0, 4, requires_grad=True), randn(1, 2, 0, 4, requires_grad=True)
    out, lse = ak.attention(q, k, v, return_lse=True)
    assert (out == 0).all() and (lse == -torch.inf).all()
    out.sum().backward()
    assert (q.grad == 0).all()


@pytest.mark.parametrize("d_k,d_v", [(0, 4), (4, 0), (0, 0)])
def test_zero_width_heads(backend, d_k, d_v):
    """D_k = 0: every score is 0 (uniform weights); D_v = 0: an empty output, but the LSE is
    defined — on every backend, with gradients where the backend trains."""
    q, k, v = randn(2, 2, 3, d_k), randn(2, 2, 5, d_k), randn(2, 2, 5, d_v)
    ref_out, ref_lse, _ = oracle(q, k, v, allowed=torch.ones(3, 5, dtype=torch.bool).tril(2),
                                 scale=1.0)
    out, lse = run_backend(backend, q, k, v, mask=masks.causal("bottom_right"), scale=1.0,
                           return_lse=True)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(lse, ref_lse.to(lse.dtype), **TOL)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    skip_unless_supported(backend, q, k, v)
    out, lse = ak.attention(q, k, v, backend=backend, return_lse=True)
    (out.sum() + lse.sum()).backward()
    assert all(t.grad is not None and t.grad.shape == t.shape for t in (q, k, v))


# ==================================================================== 2. scale / softcap
@pytest.mark.parametrize("dtype,compute", [(torch.float32, "float32"), (torch.float16, "float32"),
                                           (torch.bfloat16, "float32")])
@pytest.mark.parametrize("scale", [1e300, -1e300, 1e39, 1e-300])
def test_scale_out_of_the_compute_dtype_range_is_refused(backend, dtype, compute, scale):
    q = torch.randn(1, 2, 4, 8).to(dtype)
    says = f"scale={scale!r} is out of range for {dtype} inputs, which are computed in {compute}"
    with pytest.raises(ValueError, match=re.escape(says)):
        ak.attention(q, q, q, scale=scale, backend=backend)


@pytest.mark.parametrize("softcap", [1e300, 1e39, 1e-300])
def test_softcap_out_of_the_compute_dtype_range_is_refused(backend, softcap):
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"softcap=.* is out of range .* float32"):
        ak.attention(q, q, q, softcap=softcap, backend=backend)


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), 1j, "2", None.__class__])
def test_softcap_and_scale_must_be_finite_reals(bad):
    q = torch.randn(4, 8)
    for name in ("scale", "softcap"):
        with pytest.raises(ValueError, match=f"{name} must be a finite number"):
            ak.attention(q, q, q, **{name: bad})


def test_large_but_representable_scale_and_softcap_still_work(backend):
    """float64 keeps 1e300; scale 0 means uniform weights; softcap 1e8 is within range."""
    q, k, v = randn(1, 2, 4, 8) * 1e-300, randn(1, 2, 5, 8), randn(1, 2, 5, 3)
    out = run_backend(backend, q, k, v, scale=1e300)
    torch.testing.assert_close(out, oracle(q * 1e300, k, v, scale=1.0)[0], rtol=1e-8, atol=1e-8)
    out = run_backend(backend, q.float(), k.float(), v.float(), scale=0.0)
    torch.testing.assert_close(out, v.float().mean(-2, keepdim=True).expand_as(out))
    out = run_backend(backend, k.float(), k.float(), v.float(), softcap=1e8)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_negative_scale_with_softcap_matches_the_reference(backend, dtype):
    """c·tanh(x·scale/c) with scale < 0 (issue 19): the native kernel took tanh's
    small-argument polynomial for every score (off by ~4, dq ~1e22)."""
    q, k, v = randn(1, 2, 64, 64), randn(1, 2, 70, 64), randn(1, 2, 70, 16)
    ref, _, _ = oracle(q, k, v, scale=-1.0, softcap=1.0)
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else TOL
    qd, kd, vd = (t.to(dtype) for t in (q, k, v))
    out = run_backend(backend, qd, kd, vd, scale=-1.0, softcap=1.0)
    torch.testing.assert_close(out.double(), ref, **tol)
    qg = qd.clone().requires_grad_()
    skip_unless_supported(backend, qg, kd, vd, scale=-1.0, softcap=1.0)
    ak.attention(qg, kd, vd, scale=-1.0, softcap=1.0, backend=backend).sum().backward()
    q64 = q.clone().requires_grad_()
    oracle(q64, k, v, scale=-1.0, softcap=1.0)[0].sum().backward()
    torch.testing.assert_close(qg.grad.double(), q64.grad, **tol)


@pytest.mark.parametrize("dtype,scale,softcap", [(torch.float32, 1e20, 1e-20),
                                                 (torch.float64, 1e200, 1e-200)])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_scale_and_softcap_in_range_whose_ratio_is_not(backend, dtype, scale, softcap, sign):
    """Each is allowed alone; scale/softcap overflows the compute dtype. Every logit lies in
    ±softcap, so every row is the mean of V — zero-score rows too (the kernel gave NaN)."""
    q, k, v = (randn(1, 2, 6, 8).to(dtype), randn(1, 2, 9, 8).to(dtype),
               randn(1, 2, 9, 3).to(dtype))
    q[:, :, ::2] = 0.0                                         # rows of zero scores
    out = run_backend(backend, q, k, v, scale=sign * scale, softcap=softcap)
    torch.testing.assert_close(out, v.mean(-2, keepdim=True).expand_as(out))


# ================================================================== 3. score_mod results
def test_score_mod_with_a_float64_capture_in_float32(backend):
    """A float64 slope tensor (torch.from_numpy) in a float32 call: cast back, not a crash."""
    q, k, v = (torch.randn(2, 4, 6, 8) for _ in range(3))
    slopes64 = torch.from_numpy(np.array([0.5, 0.25, 0.125, 0.0625]))

    def mod(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return score + slopes64[h] * (kv_idx - q_idx)

    out = run_backend(backend, q, k, v, score_mod=mod, is_causal=True)
    assert out.dtype == torch.float32
    bias = slopes64.view(1, 4, 1, 1) * (torch.arange(6).view(1, -1) - torch.arange(6).view(-1, 1))
    ref, _, _ = oracle(q, k, v, bias=bias, allowed=torch.ones(6, 6, dtype=torch.bool).tril())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_score_mod_float64_parameter_gets_its_gradient(backend):
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    table = torch.zeros(2, 7, dtype=torch.float64, requires_grad=True)

    def mod(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return score + table[h, (kv_idx - q_idx).clamp(-3, 3) + 3]

    out = run_backend(backend, q, k, v, score_mod=mod)
    (g,) = torch.autograd.grad(out.square().sum(), table)
    assert g.dtype == torch.float64 and g.abs().sum() > 0


def test_score_mod_result_smaller_than_the_scores_is_broadcast(backend):
    q, k, v = randn(2, 2, 5, 4), randn(2, 2, 6, 4), randn(2, 2, 6, 3)
    out = run_backend(backend, q, k, v,
                      score_mod=lambda s, b, h, qi, ki: (qi - ki).to(s.dtype) * 0.3)
    bias = (torch.arange(5).view(-1, 1) - torch.arange(6).view(1, -1)).double() * 0.3
    torch.testing.assert_close(out, oracle(q, k, v, scale=0.0, bias=bias)[0], **TOL)


@pytest.mark.parametrize("bad,exc,says", [
    (lambda s, b, h, qi, ki: None, TypeError, "returned None, not a tensor"),
    (lambda s, b, h, qi, ki: 1.5, TypeError, "returned float, not a tensor"),
    (lambda s, b, h, qi, ki: (s > 0), TypeError, "returned dtype torch.bool"),
    (lambda s, b, h, qi, ki: (qi - ki) + s.long(), TypeError, "returned dtype torch.int64"),
    (lambda s, b, h, qi, ki: s.to(torch.complex64), TypeError, "returned dtype torch.complex64"),
    (lambda s, b, h, qi, ki: torch.cat([s, s], -1), ValueError, "returned shape"),
    (lambda s, b, h, qi, ki: s[..., None].expand(*s.shape, 2), ValueError, "returned shape"),
])
def test_bad_score_mod_results_get_one_clear_error_on_every_backend(backend, bad, exc, says):
    q, k, v = randn(1, 2, 5, 4), randn(1, 2, 6, 4), randn(1, 2, 6, 4)
    with pytest.raises(exc, match="score_mod <lambda>") as info:
        ak.attention(q, k, v, score_mod=bad, backend=backend)
    assert says in str(info.value)
    assert "must return one floating-point score" in str(info.value)


def test_bad_score_mod_message_is_the_same_on_every_backend():
    q, k, v = randn(1, 2, 5, 4), randn(1, 2, 6, 4), randn(1, 2, 6, 4)

    def no_return(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        score + 1                                                    # forgot `return`

    messages = set()
    for name in ak.backends.names():
        with pytest.raises(TypeError) as info:
            ak.attention(q, k, v, score_mod=no_return, backend=name)
        messages.add(str(info.value))
    assert len(messages) == 1 and "no_return" in messages.pop()


# ======================================================= 4. FlexAttention's score_mods
def _loop_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fn, *,  # noqa: ANN001
                    causal: bool = False) -> torch.Tensor:
    """The oracle for a score_mod with FlexAttention's semantics: ``fn`` called on one 0-d
    score and four 0-d indices at a time, in a Python loop (float64)."""
    q, k, v = (t.double() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    x = torch.empty_like(s)
    B, H, M, N = s.shape
    for b in range(B):
        for h in range(H):
            for i in range(M):
                for j in range(N):
                    x[b, h, i, j] = fn(s[b, h, i, j], torch.tensor(b), torch.tensor(h),
                                       torch.tensor(i), torch.tensor(j))
    if causal:
        x = x.masked_fill(~torch.ones(M, N, dtype=torch.bool).tril(), -torch.inf)
    return torch.softmax(x, -1) @ v


B, H, HKV, M, N = 2, 4, 2, 5, 7
_gen = torch.Generator().manual_seed(7)
ALIBI = torch.from_numpy(np.array([2.0 ** -(i + 1) for i in range(H)]))   # float64, (H,)
BIAS = torch.randn(B, H, M, N, generator=_gen, dtype=torch.float64)      # captured (B,H,M,N)
QTABLE = torch.randn(H, M, generator=_gen, dtype=torch.float64)           # (H, N_q)
T5_TABLE = torch.randn(H, 8, generator=_gen, dtype=torch.float64)         # (H, buckets)


def relative_position(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN201
    return score + (q_idx - kv_idx)


def alibi_flex(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN201
    bias = ALIBI[h] * (kv_idx - q_idx)
    return score + bias


def tanh_softcap(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN201
    return 2.0 * torch.tanh(score / 2.0)


def chained_bias(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN201
    return score + BIAS[b][h][q_idx][kv_idx]


def table_per_query(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN201
    return score + QTABLE[h][q_idx]


def _t5_bucket(rel: torch.Tensor, num_buckets: int = 8, max_distance: int = 16) -> torch.Tensor:
    """T5's bidirectional relative-position bucket (``_relative_position_bucket``)."""
    num_buckets //= 2
    ret = (rel > 0).long() * num_buckets
    n = rel.abs()
    max_exact = num_buckets // 2
    is_small = n < max_exact
    large = max_exact + (torch.log(n.double().clamp(min=1) / max_exact)
                         / math.log(max_distance / max_exact) * (num_buckets - max_exact)).long()
    large = torch.clamp(large, max=num_buckets - 1)
    return ret + torch.where(is_small, n, large)


def t5_bias(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN201
    return score + T5_TABLE[h][_t5_bucket(kv_idx - q_idx)]


FLEX_EXAMPLES = [relative_position, alibi_flex, tanh_softcap, chained_bias, table_per_query,
                 t5_bias]


@pytest.mark.parametrize("fn", FLEX_EXAMPLES, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_flex_attention_score_mods_work_unchanged(backend, fn, dtype, causal):
    torch.manual_seed(1)
    q, k, v = (torch.randn(B, H, M, 8, dtype=dtype), torch.randn(B, HKV, N, 8, dtype=dtype),
               torch.randn(B, HKV, N, 3, dtype=dtype))
    mask = masks.causal() if causal else None
    out = run_backend(backend, q, k, v, score_mod=fn, mask=mask)
    ref = _loop_attention(q, k, v, fn, causal=causal)
    tol = TOL if dtype == torch.float64 else {"rtol": 2e-5, "atol": 2e-5}
    torch.testing.assert_close(out.double(), ref, **tol)


@pytest.mark.parametrize("fn", [chained_bias, table_per_query, t5_bias], ids=lambda f: f.__name__)
def test_flex_score_mods_train(backend, fn):
    """Gradients through a per-score (vmapped) score_mod, to q/k/v and to a captured table."""
    torch.manual_seed(2)
    q, k, v = (torch.randn(B, H, M, 8, dtype=torch.float64, requires_grad=True),
               torch.randn(B, HKV, N, 8, dtype=torch.float64, requires_grad=True),
               torch.randn(B, HKV, N, 3, dtype=torch.float64, requires_grad=True))
    skip_unless_supported(backend, q, k, v, score_mod=fn)
    out = ak.attention(q, k, v, score_mod=fn, backend=backend)
    ref = ak.attention(q, k, v, score_mod=fn, backend="reference")
    torch.testing.assert_close(out, _loop_attention(q.detach(), k.detach(), v.detach(), fn),
                               **TOL)
    g = torch.autograd.grad(out.square().sum(), (q, k, v))
    g_ref = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, b_ in zip(g, g_ref, strict=True):
        torch.testing.assert_close(a, b_, **TOL)


def test_flex_semantics_keeps_the_broadcast_call_when_it_means_the_same():
    """The fast path: a function whose broadcast call equals its per-score meaning is called
    as it is; one whose broadcast call means something else is evaluated per score."""
    sizes = {"with_score": True, "batch": B, "heads": H, "n_q": M, "n_k": N,
             "dtype": torch.float64}
    for fn in (relative_position, alibi_flex, tanh_softcap):
        assert flex_semantics(fn, **sizes) is fn
    for fn in (chained_bias, table_per_query, t5_bias):
        assert flex_semantics(fn, **sizes) is not fn


def test_a_mask_mod_gets_the_same_semantics():
    """The helper serves mask_mods too (``with_score=False``): chained indexing into a
    captured per-(b, h) bool table."""
    allowed = torch.rand(B, H, M, N, generator=_gen) > 0.5

    def mask_mod(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return allowed[b][h][q_idx][kv_idx]

    f = flex_semantics(mask_mod, with_score=False, batch=B, heads=H, n_q=M, n_k=N)
    got = f(torch.arange(B).view(-1, 1, 1, 1), torch.arange(H).view(1, -1, 1, 1),
            torch.arange(M).view(1, 1, -1, 1), torch.arange(N).view(1, 1, 1, -1))
    assert got.dtype == torch.bool and torch.equal(got, allowed)


def test_not_elementwise_score_mod_is_one_meaning_on_every_backend(backend):
    """``score - score.amax()`` reduces over its tile: per score (FlexAttention's meaning) it
    is 0 everywhere, i.e. uniform weights — on every backend, whatever its tiles."""
    q, k, v = randn(1, 2, 37, 8), randn(1, 2, 41, 8), randn(1, 2, 41, 3)
    out = run_backend(backend, q, k, v, score_mod=lambda s, b, h, qi, ki: s - s.amax())
    torch.testing.assert_close(out, v.mean(-2, keepdim=True).expand_as(out), **TOL)


def test_score_mod_that_can_be_evaluated_neither_way_is_refused(backend):
    """``.item()`` cannot run per score (vmap), and the broadcast call depends on the tile:
    refused before any backend runs, naming the function."""
    q = randn(1, 2, 5, 4)

    def uses_item(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return score + float(q_idx.max())

    with pytest.raises(ValueError, match="score_mod .*uses_item cannot be evaluated") as info:
        ak.attention(q, q, q, score_mod=uses_item, backend=backend)
    assert "depends on the tile" in str(info.value) and ".item()" in str(info.value)


def test_broadcast_only_score_mod_still_works(backend):
    """A score_mod written for attnkit's broadcast index tensors that vmap cannot run (Python
    control flow on a shape) but that is elementwise keeps working."""
    q, k, v = randn(1, 2, 6, 4), randn(1, 2, 6, 4), randn(1, 2, 6, 4)

    def shaped(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        if (q_idx - kv_idx).abs().max() >= 0:        # data-dependent branch: no vmap
            return score + 0.5 * (q_idx == kv_idx)
        return score

    out = run_backend(backend, q, k, v, score_mod=shaped)
    torch.testing.assert_close(out, oracle(q, k, v, bias=0.5 * torch.eye(6))[0], **TOL)


# ============================================================ 5. the same class elsewhere
@pytest.mark.parametrize("built,h_q", [(4, 8), (8, 4), (2, 3)])
def test_alibi_built_for_other_heads_is_refused(backend, built, h_q):
    q = randn(1, h_q, 5, 4)
    with pytest.raises(ValueError, match=rf"alibi\({built}\) was built for {built} heads but "
                                         rf"the inputs have H_q={h_q}"):
        ak.attention(q, q, q, score_mod=alibi(built), backend=backend)


def test_relative_bias_table_for_other_heads_or_device_is_refused(backend):
    q = randn(1, 3, 5, 4)
    with pytest.raises(ValueError, match="built for 2 heads but the inputs have H_q=3"):
        ak.attention(q, q, q, score_mod=relative_bias(torch.zeros(2, 7), 3), backend=backend)
    with pytest.raises(ValueError, match="holds a tensor on meta but q is on cpu"):
        ak.attention(q, q, q, score_mod=relative_bias(torch.zeros(3, 7, device="meta"), 3),
                     backend=backend)


def test_alibi_for_the_right_heads_under_gqa(backend):
    """ALiBi counts query heads: alibi(H_q) with H_kv < H_q runs."""
    q, k, v = randn(1, 4, 5, 8), randn(1, 2, 5, 8), randn(1, 2, 5, 8)
    out = run_backend(backend, q, k, v, score_mod=alibi(4))
    bias = -ak.scores.alibi_slopes(4).view(4, 1, 1) * \
        (torch.arange(5).view(-1, 1) - torch.arange(5).view(1, -1)).abs()
    torch.testing.assert_close(out, oracle(q, k, v, bias=bias)[0], **TOL)


def test_score_mod_closing_over_a_tensor_on_another_device_is_refused_up_front(backend):
    q = randn(1, 2, 5, 4)
    far = torch.zeros(2, device="meta")

    def mod(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return score + far[h]

    with pytest.raises(ValueError, match="score_mod .*mod cannot be evaluated"):
        ak.attention(q, q, q, score_mod=mod, backend=backend)


def test_score_mod_non_finite_results_behave_like_the_reference(backend):
    """−∞ from a score_mod blocks like a mask (a row of −∞: output 0, LSE −∞, gradient 0);
    NaN at an allowed position shows as NaN in that row only; NaN at a masked one is unseen."""
    q, k, v = randn(1, 2, 4, 8), randn(1, 2, 4, 8), randn(1, 2, 4, 3)

    def minus_inf_row(s, b, h, qi, ki):  # noqa: ANN001, ANN202
        return torch.where(qi == 1, torch.full_like(s, -torch.inf), s)

    def nan_at(s, b, h, qi, ki):  # noqa: ANN001, ANN202
        return torch.where((qi == 2) & (ki == 1), torch.full_like(s, torch.nan), s)

    def nan_above_diagonal(s, b, h, qi, ki):  # noqa: ANN001, ANN202
        return torch.where(ki > qi, torch.full_like(s, torch.nan), s)

    out, lse = run_backend(backend, q, k, v, score_mod=minus_inf_row, return_lse=True)
    assert (out[:, :, 1] == 0).all() and (lse[:, :, 1] == -torch.inf).all()
    assert torch.isfinite(out[:, :, [0, 2, 3]]).all()
    out, lse = run_backend(backend, q, k, v, score_mod=nan_at, return_lse=True)
    assert out[:, :, 2].isnan().all() and lse[:, :, 2].isnan().all()
    assert torch.isfinite(out[:, :, [0, 1, 3]]).all()
    out = run_backend(backend, q, k, v, score_mod=nan_above_diagonal, is_causal=True)
    ref = ak.attention(q, k, v, is_causal=True, backend="reference")
    torch.testing.assert_close(out, ref, **TOL)
    # gradients through the −∞ row are 0, not NaN
    qg = q.clone().requires_grad_()
    skip_unless_supported(backend, qg, k, v, score_mod=minus_inf_row)
    out = ak.attention(qg, k, v, score_mod=minus_inf_row, backend=backend)
    (g,) = torch.autograd.grad(out.sum(), qg)
    assert torch.isfinite(g).all() and (g[:, :, 1] == 0).all()


@pytest.mark.parametrize("grad", [False, True])
def test_nan_value_behind_a_score_mod_minus_inf_reaches_the_output(backend, grad):
    """A score_mod's −∞ is a score, not a mask: a NaN V row it weights 0 still gives NaN
    (0·NaN, as the formula, torch and FlexAttention do), with or without autograd — the
    native kernel skips P == 0, so the API checks K/V up front; a mask removes the row."""
    q, k, v = randn(1, 2, 6, 8), randn(1, 2, 6, 8), randn(1, 2, 6, 3)
    v[0, 0, 4] = torch.nan

    def drop_key_4(s, b, h, qi, ki):  # noqa: ANN001, ANN202
        return torch.where(ki == 4, torch.full_like(s, -torch.inf), s)

    qq = q.clone().requires_grad_(grad)
    skip_unless_supported(backend, qq, k, v, score_mod=drop_key_4)
    out = ak.attention(qq, k, v, score_mod=drop_key_4, backend=backend)
    ref = ak.attention(q, k, v, score_mod=drop_key_4, backend="reference")
    assert out[:, 0].isnan().all() and ref[:, 0].isnan().all()
    assert torch.isfinite(out[:, 1]).all()
    masked = ak.attention(qq, k, v, mask=ak.masks.from_fn(lambda b, h, qi, ki: ki != 4),
                          backend=backend)
    assert torch.isfinite(masked).all()


def test_kv_checked_up_front_only_under_a_python_score_mod(monkeypatch):
    """The up-front K/V read is for Python score_mods (their −∞ can hide a NaN V row from a
    kernel that skips P == 0); ALiBi and relative-bias tables are finite and skip it."""
    from attnkit import eager
    from attnkit.scores import alibi, relative_bias

    calls: set[str] = set()            # the up-front read: the one-pass check, then the rows
    for name in ("_kv_finite", "_bad_kv_rows"):
        real = getattr(eager, name)
        monkeypatch.setattr(eager, name, lambda p, real=real, name=name: calls.add(name)
                            or real(p))
    q = randn(1, 2, 8, 4)
    table = torch.zeros(2, 7)
    minus_inf = table.clone()
    minus_inf[:, 0] = -torch.inf                            # a table may remove keys too
    for mod, expected in ((None, False), (alibi(2), False), (relative_bias(table, 3), False),
                          (relative_bias(minus_inf, 3), True),
                          (lambda s, b, h, qi, ki: s * 2, True)):
        calls.clear()
        ak.attention(q, q, q, score_mod=mod)
        assert bool(calls) == expected, mod


@pytest.mark.parametrize("grad", [False, True])
def test_nan_value_behind_a_minus_inf_table_entry_reaches_the_output(grad):
    """A relative-bias table entry of −∞ is a score too: the NaN V row it weights 0 gives
    NaN with and without autograd, as the reference does."""
    from attnkit.scores import relative_bias

    q, k, v = randn(1, 2, 4, 4), randn(1, 2, 8, 4), randn(1, 2, 8, 3)
    v[0, :, 7] = torch.nan
    table = torch.zeros(2, 3)
    table[:, 2] = -torch.inf                                # kv - q >= 1: key 7 for every q
    qq = q.clone().requires_grad_(grad)
    out = ak.attention(qq, k, v, score_mod=relative_bias(table, 1))
    ref = ak.attention(q, k, v, score_mod=relative_bias(table, 1), backend="reference")
    assert torch.equal(out.isnan(), ref.isnan()) and ref.isnan().all()


def test_mask_larger_than_the_logits_is_refused_clearly():
    """A (2, …) mask for batch 1 used to pass the broadcast check and fail in a raw expand."""
    q = randn(1, 2, 3, 4)
    for m in (torch.ones(2, 2, 3, 3, dtype=torch.bool), torch.zeros(2, 2, 3, 3)):
        with pytest.raises(ValueError, match=r"mask of shape \(2, 2, 3, 3\) does not broadcast "
                                             r"to \(\.\.\., H_q, N_q, N_k\) = \(1, 2, 3, 3\)"):
            ak.attention(q, q, q, mask=m)


@pytest.mark.parametrize("dtype", [torch.int32, torch.uint8, torch.complex64])
def test_mask_of_a_non_bool_non_float_dtype_is_refused(dtype):
    q = randn(5, 4)
    with pytest.raises(TypeError, match=f"bool .* floating point.*{dtype}"):
        ak.attention(q, q, q, mask=torch.ones(5, 5, dtype=dtype))


def test_score_mod_result_on_another_device_is_refused(backend):
    q = randn(1, 2, 5, 4)
    with pytest.raises(ValueError, match="returned a tensor on meta, not on cpu"):
        ak.attention(q, q, q, backend=backend,
                     score_mod=lambda s, b, h, qi, ki: torch.zeros(s.shape, device="meta"))


@pytest.mark.parametrize("bad", ["yes", "False", 1, None, torch.ones(2, dtype=torch.bool)])
def test_is_causal_must_be_a_bool(bad):
    """``is_causal="False"`` used to mean causal (any truthy value did)."""
    q = randn(5, 4)
    with pytest.raises(TypeError, match="is_causal must be True or False"):
        ak.attention(q, q, q, is_causal=bad)


def test_score_term_arguments_are_checked_where_they_are_built():
    with pytest.raises(ValueError, match="n_heads must be >= 1, got 4.0"):
        alibi(4.0)
    with pytest.raises(ValueError, match="max_distance must be an int >= 0, got 3.0"):
        relative_bias(torch.zeros(2, 7), 3.0)
    with pytest.raises(TypeError, match="floating-point tensor .* got dtype torch.int64"):
        relative_bias(torch.zeros(2, 7, dtype=torch.long), 3)


def test_float64_mask_beyond_the_float32_range(backend):
    """A float64 mask on float32 inputs is added in float32: +1e300 would become +inf (NaN
    rows) and is refused; -1e300 means blocked, exactly like -inf."""
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    m = torch.zeros(4, 4, dtype=torch.float64)
    m[1, 2] = 1e300
    with pytest.raises(ValueError, match=r"holds values up to 1e\+300, beyond the range of "
                                         r"float32 \(max 3.4e\+38\)"):
        ak.attention(q, k, v, mask=m, backend=backend)
    m[1, 2], m[0, 1:], m[2, 0] = 0.5, -1e300, -1e300
    out = run_backend(backend, q, k, v, mask=m)
    ref = ak.attention(q, k, v, mask=torch.where(m == -1e300, -torch.inf, m).float(),
                       backend="reference")
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [object, "U3", "datetime64[s]"])
def test_numpy_arrays_torch_cannot_hold_are_refused_clearly(dtype):
    a = np.zeros((3, 4)).astype(dtype)
    with pytest.raises(TypeError, match=r"q is a NumPy array of dtype .*astype\(np.float32\)"):
        ak.attention(a, np.zeros((3, 4)), np.zeros((3, 4)))


def test_per_score_score_mod_has_derivatives_of_every_order_on_the_reference():
    """gradcheck / gradgradcheck through a vmapped (chained-indexing) score_mod."""
    bias = torch.randn(1, 2, 3, 4, dtype=torch.float64, requires_grad=True)
    q, k, v = (randn(1, 2, 3, 5).requires_grad_(), randn(1, 2, 4, 5).requires_grad_(),
               randn(1, 2, 4, 3).requires_grad_())

    def f(q, k, v, bias):  # noqa: ANN001, ANN202
        return ak.attention(q, k, v, backend="reference",
                            score_mod=lambda s, b, h, qi, ki: s + bias[b][h][qi][ki])

    assert torch.autograd.gradcheck(f, (q, k, v, bias))
    assert torch.autograd.gradgradcheck(f, (q, k, v, bias))


def test_per_score_score_mod_from_four_threads():
    """The semantics probe and its cache are shared: four threads get single-thread results."""
    import threading

    bias = torch.randn(2, 4, 37, 41, dtype=torch.float64)
    q, k, v = randn(2, 4, 37, 16), randn(2, 2, 41, 16), randn(2, 2, 41, 8)

    def fresh():  # noqa: ANN202 — a new function object: each thread probes it
        return lambda s, b, h, qi, ki: s + bias[b][h][qi][ki]

    want = {n: ak.attention(q, k, v, score_mod=fresh(), backend=n) for n in ("reference", "tiled")}
    bad: list[str] = []

    def work(name: str) -> None:
        for _ in range(3):
            got = ak.attention(q, k, v, score_mod=fresh(), backend=name)
            # to rounding: concurrent threads share torch's intra-op pool, whose split of a
            # reduction may differ; a wrong semantics choice is off by O(1)
            if not torch.allclose(got, want[name], rtol=1e-12, atol=1e-12):
                bad.append(name)

    threads = [threading.Thread(target=work, args=(n,)) for n in ("reference", "tiled") * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad


@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_a_zero_bias_that_is_learnt_keeps_its_gradient(backend: str) -> None:
    # an all-zero float mask adds nothing, but a learnable bias starts at zero: it must stay
    # in the graph (softmax ignores a constant shift, so a bias of ones gives the same grads)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g, requires_grad=True) for _ in range(3))
    zero = torch.zeros(4, 4, requires_grad=True)
    ones = torch.ones(4, 4, requires_grad=True)
    out0 = ak.attention(q, k, v, mask=zero, backend=backend)
    out1 = ak.attention(q, k, v, mask=ones, backend=backend)
    assert out0.requires_grad
    (g0,) = torch.autograd.grad(out0.square().sum(), zero)
    (g1,) = torch.autograd.grad(out1.square().sum(), ones)
    assert g0.abs().sum() > 0
    torch.testing.assert_close(g0, g1, atol=1e-6, rtol=1e-5)
