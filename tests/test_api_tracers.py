"""attention() under torch's Python-level tracers — make_fx, FakeTensorMode (and FakeTensor
inputs), torch.func.grad / jacrev / jvp / vmap, functionalize — and the SDPA drop-in likewise:
each sees one operator it knows (``attnkit::attention``) or plain torch operators, never the
native kernel's. Before, a warm decode frame's repeat under make_fx recorded two
``aten.empty`` nodes and replayed garbage, and FakeTensorMode / torch.func failed inside the
kernel.

Shape legend: q (B, H_q, N_q, D_k), k (B, H_kv, N_k, D_k), v (B, H_kv, N_k, D_v).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import attnkit as ak
from helpers.oracle import naive_low_precision, oracle
from helpers.tolerance import assert_low_precision_close


def _qkv(dtype: torch.dtype, n_q: int = 1, n_k: int = 67, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 4, n_q, 16, generator=g).to(dtype),        # q, GQA 4:2
            torch.randn(2, 2, n_k, 16, generator=g).to(dtype),
            torch.randn(2, 2, n_k, 16, generator=g).to(dtype)]


def _causal(n_q: int, n_k: int) -> torch.Tensor:
    """Top-left causal, as is_causal: query i sees keys 0..i."""
    return torch.ones(n_q, n_k, dtype=torch.bool).tril()


def _assert_matches_formula(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                            v: torch.Tensor, **opts) -> None:
    ref64, _, _ = oracle(q, k, v, **opts)
    if q.dtype in (torch.bfloat16, torch.float16):
        assert_low_precision_close(out, naive_low_precision(q, k, v, **opts), ref64)
    else:
        torch.testing.assert_close(out.double(), ref64, rtol=1e-5, atol=1e-5)


def _targets(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["real", "fake", "symbolic"])
@pytest.mark.parametrize("n_q", [1, 5])
def test_make_fx_records_the_operator_and_replays_new_values(dtype, mode, n_q):
    """After warm eager calls of the same signature (the decode frame's inline repeat), a
    make_fx graph holds one attnkit::attention node and no kernel operator, and replayed on
    new q, k, v it gives their attention."""
    q, k, v = _qkv(dtype, n_q)

    def f(q, k, v):
        return ak.attention(q, k, v, is_causal=True)

    for _ in range(3):
        f(q, k, v)
    gm = make_fx(f, tracing_mode=mode)(q, k, v)
    targets = _targets(gm)
    assert "attnkit.attention.default" in targets, targets
    assert not any("attnkit_native" in t or t.startswith("aten.empty") for t in targets), targets
    q2, k2, v2 = _qkv(dtype, n_q, seed=1)
    _assert_matches_formula(gm(q2, k2, v2), q2, k2, v2, allowed=_causal(n_q, 67))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_drop_in_under_make_fx_replays_new_values(dtype):
    q, k, v = _qkv(dtype, 3)

    def f(q, k, v):
        return ak.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    for _ in range(3):
        f(q, k, v)
    gm = make_fx(f)(q, k, v)
    assert not any("attnkit_native" in t for t in _targets(gm))
    q2, k2, v2 = _qkv(dtype, 3, seed=1)
    _assert_matches_formula(gm(q2, k2, v2), q2, k2, v2)


def test_fake_tensor_mode_and_fake_inputs_give_the_output_metadata():
    """Inside FakeTensorMode, and with FakeTensor inputs outside it (a subclass that
    dispatches in Python), the call returns fake (out, lse) of the right shapes and dtypes."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    q, k, v = _qkv(torch.bfloat16, 5)
    ak.attention(q, k, v)                                        # a warm frame first
    fake_mode = FakeTensorMode()
    fq, fk, fv = (fake_mode.from_tensor(t) for t in (q, k, v))
    with fake_mode:
        out, lse = ak.attention(fq, fk, fv, return_lse=True)
    assert isinstance(out, FakeTensor) and out.shape == (2, 4, 5, 16)
    assert out.dtype == torch.bfloat16 and lse.shape == (2, 4, 5) and lse.dtype == torch.float32
    out = ak.attention(fq, fk, fv, is_causal=True)               # no mode on: the inputs' own
    assert isinstance(out, FakeTensor) and out.shape == (2, 4, 5, 16)


def test_func_grad_and_jacrev_equal_autograd():
    """torch.func.grad (and jacrev) of a causal, soft-capped GQA call equal the gradient
    autograd gives the eager call (float64)."""
    q, k, v = _qkv(torch.float64, 5)

    def loss(q, k, v):
        return (ak.attention(q, k, v, is_causal=True, softcap=4.0) ** 2).sum()

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    loss(*leaves).backward()
    grads = torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)
    for got, leaf in zip(grads, leaves, strict=True):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-10, atol=1e-12)
    jac = torch.func.jacrev(lambda q: ak.attention(q, k, v, is_causal=True)[0, 1, 2])(q)
    want = torch.autograd.functional.jacobian(
        lambda q: ak.attention(q, k, v, is_causal=True)[0, 1, 2], q)
    torch.testing.assert_close(jac, want, rtol=1e-10, atol=1e-12)


def test_func_jvp_equals_the_formulas_jvp():
    q, k, v = _qkv(torch.float64, 5)
    tangent = torch.randn_like(q)
    _, got = torch.func.jvp(lambda q: ak.attention(q, k, v, is_causal=True), (q,), (tangent,))
    _, want = torch.func.jvp(lambda q: oracle(q, k, v, allowed=_causal(5, 67))[0], (q,),
                             (tangent,))
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_func_grad_through_a_python_score_mod():
    q, k, v = _qkv(torch.float64, 5)

    def bias(s, b, h, i, j):
        return s - 0.1 * (i - j).abs()

    leaf = q.clone().requires_grad_()
    ak.attention(leaf, k, v, score_mod=bias).sum().backward()
    got = torch.func.grad(lambda q: ak.attention(q, k, v, score_mod=bias).sum())(q)
    torch.testing.assert_close(got, leaf.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vmap_equals_the_batched_call(dtype):
    """vmap over the batch (q, k, v and a per-example bool mask) equals the one batched
    call; vmap of K/V alone (one q for every example) equals the call per example."""
    q, k, v = _qkv(dtype, 5)
    keep = torch.rand(2, 1, 5, 67, generator=torch.Generator().manual_seed(2)) > 0.3
    for _ in range(3):
        ak.attention(q[0], k[0], v[0])
    got = torch.vmap(lambda q, k, v, m: ak.attention(q, k, v, mask=m))(q, k, v, keep)
    _assert_matches_formula(got, q, k, v, allowed=keep)
    got = torch.vmap(lambda k, v: ak.attention(q[0], k, v), in_dims=(0, 0))(k, v)
    _assert_matches_formula(got, q[0].expand(2, -1, -1, -1), k, v)


def test_functionalize_equals_eager():
    q, k, v = _qkv(torch.float32, 5)
    got = torch.func.functionalize(lambda q, k, v: ak.attention(q, k, v, is_causal=True))(q, k, v)
    _assert_matches_formula(got, q, k, v, allowed=_causal(5, 67))


def test_sdpa_drop_in_under_func_grad_equals_torch():
    q, k, v = _qkv(torch.float64, 5)
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    got = torch.func.grad(lambda q: ak.scaled_dot_product_attention(q, k, v).sum())(q)
    want = torch.func.grad(lambda q: F.scaled_dot_product_attention(q, k, v).sum())(q)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
