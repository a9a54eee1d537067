"""MultiHeadAttention (MHA / GQA / MQA): the formula, heads, parameters, options, backprop."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from helpers.layers import DT, n_params
from helpers.oracle import oracle


@pytest.mark.parametrize("cfg", [
    dict(d_model=16, n_heads=4),
    dict(d_model=16, n_heads=4, n_kv_heads=2, softcap=2.0),
    dict(d_model=12, n_heads=6, n_kv_heads=1, head_dim=5, v_head_dim=3, bias=True),
    dict(d_model=16, n_heads=2, kv_dim=10, v_head_dim=7),
])
def test_forward_matches_the_float64_oracle(cfg):
    m = ak.MultiHeadAttention(**cfg).to(DT)
    x = torch.randn(2, 5, cfg["d_model"], dtype=DT)
    ctx = torch.randn(2, 9, cfg.get("kv_dim", cfg["d_model"]), dtype=DT)
    h, hkv = m.n_heads, m.n_kv_heads
    q = (x @ m.q_proj.weight.T + (m.q_proj.bias if m.q_proj.bias is not None else 0))
    k = (ctx @ m.k_proj.weight.T + (m.k_proj.bias if m.k_proj.bias is not None else 0))
    v = (ctx @ m.v_proj.weight.T + (m.v_proj.bias if m.v_proj.bias is not None else 0))
    q = q.view(2, 5, h, -1).transpose(1, 2)
    k = k.view(2, 9, hkv, -1).transpose(1, 2)
    v = v.view(2, 9, hkv, -1).transpose(1, 2)
    allowed = torch.rand(2, 1, 5, 9) > 0.4
    allowed[..., 0] = True
    allowed[1, 0, 3] = False                       # a query that sees no key: its output is 0
    o, _, _ = oracle(q, k, v, scale=1 / math.sqrt(m.head_dim), softcap=cfg.get("softcap"),
                     allowed=allowed)
    want = m.out_proj(o.transpose(1, 2).reshape(2, 5, -1))
    got = m(x, ctx, mask=allowed)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert got.shape == (2, 5, cfg["d_model"])


def test_course_example_heads_split_and_concat():
    """T=3, d=8, h=2: per-head Q/K/V are 3×4, the heads concatenate back to 3×8."""
    m = ak.MultiHeadAttention(8, 2).to(DT)
    x = torch.randn(3, 8, dtype=DT)                          # unbatched (T, d)
    q = m.project_q(x[None])
    assert q.shape == (1, 2, 3, 4)
    per_head = [torch.softmax(q[0, i] @ m.project_k(x[None])[0, i].T / 2.0, -1)
                @ m.project_v(x[None])[0, i] for i in range(2)]            # 2 × (3, 4)
    concat = torch.cat(per_head, dim=-1)                                   # (3, 8)
    torch.testing.assert_close(m(x), m.out_proj(concat))
    assert m(x).shape == (3, 8)


def test_need_weights_shape_rows_and_masked_zeros():
    m = ak.MultiHeadAttention(16, 4, n_kv_heads=2).to(DT)
    x = torch.randn(2, 6, 16, dtype=DT)
    out, w = m(x, is_causal=True, need_weights=True)
    assert w.shape == (2, 4, 6, 6)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 6, dtype=DT))
    assert (w.triu(1) == 0).all()
    torch.testing.assert_close(out, m(x, is_causal=True))


@pytest.mark.parametrize("n_kv", [None, 4, 1])
def test_parameter_counts_mha_gqa_mqa(n_kv):
    d, H = 32, 8
    m = ak.MultiHeadAttention(d, H, n_kv_heads=n_kv)
    kv = H if n_kv is None else n_kv
    h = d // H
    assert n_params(m) == 2 * d * d + 2 * d * kv * h          # MHA: 4d²
    if n_kv is None:
        assert n_params(m) == 4 * d * d
    r = ak.cost.report(d, H, 16, n_kv_heads=n_kv)
    assert n_params(m) == r.attn_params[{None: "MHA", 4: "GQA", 1: "MQA"}[n_kv]]
    with_bias = ak.MultiHeadAttention(d, H, n_kv_heads=n_kv, bias=True)
    assert n_params(with_bias) == n_params(m) + d + 2 * kv * h + d


def test_gqa_equals_mha_with_repeated_kv_weights():
    d, H, kv = 24, 6, 2
    g = H // kv
    gqa = ak.MultiHeadAttention(d, H, n_kv_heads=kv, bias=True).to(DT)
    mha = ak.MultiHeadAttention(d, H, bias=True).to(DT)
    h = d // H

    def rep(t):          # (kv·h, ...) → (H·h, ...): K/V head j serves query heads j·g .. j·g+g-1
        return t.view(kv, h, *t.shape[1:]).repeat_interleave(g, 0).reshape(H * h, *t.shape[1:])

    with torch.no_grad():
        mha.q_proj.load_state_dict(gqa.q_proj.state_dict())
        mha.out_proj.load_state_dict(gqa.out_proj.state_dict())
        for name in ("k_proj", "v_proj"):
            src, dst = getattr(gqa, name), getattr(mha, name)
            dst.weight.copy_(rep(src.weight))
            dst.bias.copy_(rep(src.bias))
    x = torch.randn(2, 7, d, dtype=DT)
    torch.testing.assert_close(gqa(x, is_causal=True), mha(x, is_causal=True))
    _, w1 = gqa(x, need_weights=True)
    _, w2 = mha(x, need_weights=True)
    torch.testing.assert_close(w1, w2)


def test_tie_qk_raw_scores_are_symmetric():
    m = ak.MultiHeadAttention(16, 4, tie_qk=True, bias=True).to(DT)
    x = torch.randn(2, 6, 16, dtype=DT)
    s = m.project_q(x) @ m.project_k(x).transpose(-1, -2)       # (B, H, N, N)
    torch.testing.assert_close(s, s.transpose(-1, -2))
    untied = ak.MultiHeadAttention(16, 4).to(DT)
    s2 = untied.project_q(x) @ untied.project_k(x).transpose(-1, -2)
    assert not torch.allclose(s2, s2.transpose(-1, -2))


def test_qk_norm_makes_scores_invariant_to_scaling_w_q():
    x = torch.randn(2, 6, 16, dtype=DT)
    for qk_norm in (True, False):
        m = ak.MultiHeadAttention(16, 4, qk_norm=qk_norm).to(DT)
        if qk_norm:            # exact invariance needs RMSNorm's eps out of the way
            m.q_norm.eps = m.k_norm.eps = 1e-300
        out1, w1 = m(x, need_weights=True)
        with torch.no_grad():
            m.q_proj.weight.mul_(7.0)
        out2, w2 = m(x, need_weights=True)
        if qk_norm:
            torch.testing.assert_close(w2, w1, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(out2, out1, rtol=1e-10, atol=1e-12)
        else:
            assert (w2 - w1).abs().max() > 1e-2


def test_qk_norm_gives_unit_rms_per_head_times_gain():
    m = ak.MultiHeadAttention(16, 4, qk_norm=True).to(DT)
    x = torch.randn(2, 6, 16, dtype=DT)
    q = m.project_q(x)                                   # (B, H, N, d_k)
    torch.testing.assert_close(q.pow(2).mean(-1), torch.ones(2, 4, 6, dtype=DT),
                               rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        m.k_norm.weight.copy_(torch.arange(1.0, 5.0))
    k = m.project_k(x)
    raw = m.k_proj(x).view(2, 6, 4, 4).transpose(1, 2)
    want = raw / raw.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * torch.arange(1.0, 5.0)
    torch.testing.assert_close(k, want.to(DT))


def test_softcap_bounds_the_logits():
    m = ak.MultiHeadAttention(8, 2, softcap=0.5).to(DT)
    x = 50 * torch.randn(1, 5, 8, dtype=DT)
    _, w = m(x, need_weights=True)
    # logits lie in (-c, c), so weights within a row differ by at most a factor e^{2c}
    assert (w.amax(-1) / w.amin(-1) <= math.exp(1.0) + 1e-9).all()


def test_dropout_only_in_training():
    m = ak.MultiHeadAttention(16, 4, dropout=0.5).to(DT)
    x = torch.randn(2, 6, 16, dtype=DT)
    m.eval()
    torch.testing.assert_close(m(x), m(x))
    m.train()
    assert not torch.allclose(m(x), m(x))


_MHA_CONFIGS = [
    dict(),
    dict(bias=True),
    dict(n_kv_heads=2),
    dict(n_kv_heads=1),
    dict(qk_norm=True),
    dict(softcap=1.5),
    dict(dropout=0.2),
    dict(tie_qk=True),
    dict(head_dim=3, v_head_dim=5),
    dict(kv_dim=10),
]


@pytest.mark.parametrize("cfg", _MHA_CONFIGS, ids=lambda c: ",".join(c) or "plain")
def test_backprop_every_mha_option(cfg):
    m = ak.MultiHeadAttention(16, 4, **cfg).to(DT).train()
    x = torch.randn(2, 5, 16, dtype=DT, requires_grad=True)
    ctx = torch.randn(2, 7, 10, dtype=DT, requires_grad=True) if "kv_dim" in cfg else None
    out = m(x, ctx, is_causal=ctx is None)
    (out * torch.randn_like(out)).sum().backward()
    for name, p in [*m.named_parameters(), ("x", x), ("context", ctx)]:
        if p is None:
            continue
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_separate_value_source_and_its_checks():
    """forward(x, context, value=...): keys from context, values from value (torch's call)."""
    m = ak.MultiHeadAttention(16, 4, kv_dim=6).to(DT)
    x, ctx, val = (torch.randn(2, 5, 16, dtype=DT), torch.randn(2, 7, 6, dtype=DT),
                   torch.randn(2, 7, 6, dtype=DT))
    q, k, v = m.project_q(x), m.project_k(ctx), m.project_v(val)
    o, _, _ = oracle(q, k, v, scale=1 / math.sqrt(m.head_dim))
    want = m.out_proj(o.transpose(1, 2).reshape(2, 5, -1))
    torch.testing.assert_close(m(x, ctx, value=val), want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(m(x, ctx, value=ctx), m(x, ctx))
    with pytest.raises(ValueError, match="pass context"):
        ak.MultiHeadAttention(16, 4).to(DT)(x, value=x)
    with pytest.raises(ValueError, match=r"value must have shape \(B, N, 6\)"):
        m(x, ctx, value=x)
    with pytest.raises(ValueError, match="same number of tokens"):
        m(x, ctx, value=val[:, :3])
