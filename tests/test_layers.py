"""Layers: MultiHeadAttention (MHA/GQA/MQA), MultiHeadLatentAttention, KVCache, torch interop."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import attnkit as ak
from attnkit.layers import TorchStyleMultiheadAttention, torch_masks_to_attnkit

DT = torch.float64


def _n_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def _hand_attention(q, k, v, *, scale, softcap=None, allowed=None):
    """softmax(cap(q kᵀ·scale) + mask) v, written out in float64; GQA by repeating heads."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if allowed is not None:
        s = s.masked_fill(~allowed, -math.inf)
    return torch.softmax(s, -1) @ v


# ---------------------------------------------------------------------------- forward
@pytest.mark.parametrize("cfg", [
    dict(d_model=16, n_heads=4),
    dict(d_model=16, n_heads=4, n_kv_heads=2, softcap=2.0),
    dict(d_model=12, n_heads=6, n_kv_heads=1, head_dim=5, v_head_dim=3, bias=True),
    dict(d_model=16, n_heads=2, kv_dim=10, v_head_dim=7),
])
def test_forward_matches_hand_written_formula(cfg):
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
    o = _hand_attention(q, k, v, scale=1 / math.sqrt(m.head_dim), softcap=cfg.get("softcap"),
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


# ---------------------------------------------------------------------------- torch interop
def _torch_mha(e=16, h=4, *, bias=True, batch_first=False, kdim=None):
    m = nn.MultiheadAttention(e, h, bias=bias, batch_first=batch_first, kdim=kdim, vdim=kdim)
    m = m.to(DT)
    if bias:
        with torch.no_grad():      # torch zero-initialises the biases: make them matter
            m.in_proj_bias.normal_()
            m.out_proj.bias.normal_()
    return m


def _bool_attn_mask(l_q, l_k, *shape):
    am = torch.rand(*shape, l_q, l_k) > 0.6      # torch convention: True = blocked
    am[..., 0] = False                           # key 0 stays visible: no empty rows
    return am


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("case", ["none", "bool", "float", "bool3d", "kpm", "kpm_float",
                                  "bool+kpm", "float+kpm", "causal_hint"])
def test_from_torch_matches_torch(batch_first, case):
    B, L, E, H = 3, 6, 16, 4
    tm = _torch_mha(E, H, batch_first=batch_first)
    ours = TorchStyleMultiheadAttention.from_torch(tm)
    assert ours.batch_first == batch_first
    x = torch.randn(B, L, E, dtype=DT) if batch_first else torch.randn(L, B, E, dtype=DT)
    kw: dict = {}
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[0, 4:] = True
    kpm[2, 1:3] = True
    if case in ("bool", "bool+kpm"):
        kw["attn_mask"] = _bool_attn_mask(L, L)
    if case in ("float", "float+kpm"):
        kw["attn_mask"] = torch.randn(L, L, dtype=DT).masked_fill(_bool_attn_mask(L, L),
                                                                   -math.inf)
    if case == "bool3d":
        kw["attn_mask"] = _bool_attn_mask(L, L, B * H)
    if case in ("kpm", "bool+kpm", "float+kpm"):
        kw["key_padding_mask"] = kpm
    if case == "kpm_float":
        kw["key_padding_mask"] = torch.randn(B, L, dtype=DT)
    if case == "causal_hint":
        kw["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(L, dtype=DT)
        kw["is_causal"] = True
        kw["key_padding_mask"] = kpm
    for avg in (True, False):
        want_out, want_w = tm(x, x, x, average_attn_weights=avg, **kw)
        got_out, got_w = ours(x, x, x, average_attn_weights=avg, **kw)
        torch.testing.assert_close(got_out, want_out, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got_w, want_w, rtol=1e-10, atol=1e-10)
    want_out, none = tm(x, x, x, need_weights=False, **kw)
    got_out, none2 = ours(x, x, x, need_weights=False, **kw)
    assert none is None and none2 is None
    torch.testing.assert_close(got_out, want_out, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("batch_first", [False, True])
def test_from_torch_cross_attention_and_no_bias(batch_first):
    tm = _torch_mha(16, 2, bias=False, batch_first=batch_first, kdim=10)
    ours = TorchStyleMultiheadAttention.from_torch(tm)
    B, Lq, Lk = 2, 3, 7
    if batch_first:
        q, kv = torch.randn(B, Lq, 16, dtype=DT), torch.randn(B, Lk, 10, dtype=DT)
    else:
        q, kv = torch.randn(Lq, B, 16, dtype=DT), torch.randn(Lk, B, 10, dtype=DT)
    kv2 = torch.randn_like(kv)                  # separate key and value inputs
    for key, value in ((kv, kv), (kv, kv2)):
        want = tm(q, key, value)
        got = ours(q, key, value)
        torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got[1], want[1], rtol=1e-10, atol=1e-10)


def test_from_torch_unbatched_and_attnkit_convention():
    tm = _torch_mha(16, 4)
    x = torch.randn(5, 16, dtype=DT)
    am = _bool_attn_mask(5, 5)
    want_out, want_w = tm(x, x, x, attn_mask=am, average_attn_weights=False)
    got_out, got_w = TorchStyleMultiheadAttention.from_torch(tm)(
        x, x, x, attn_mask=am, average_attn_weights=False)
    torch.testing.assert_close(got_out, want_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got_w, want_w, rtol=1e-10, atol=1e-10)
    # the plain attnkit layer: batch-first, True = may attend
    m = ak.MultiHeadAttention.from_torch(tm)
    out, w = m(x[None], mask=~am, need_weights=True)
    torch.testing.assert_close(out[0], want_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(w[0], want_w, rtol=1e-10, atol=1e-10)


def test_from_torch_rejects_unsupported():
    with pytest.raises(ValueError, match="add_bias_kv"):
        ak.MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2, add_bias_kv=True))
    with pytest.raises(ValueError, match="kdim == vdim"):
        ak.MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2, kdim=4, vdim=6))
    with pytest.raises(TypeError, match="MultiheadAttention"):
        ak.MultiHeadAttention.from_torch(nn.Linear(8, 8))


def test_torch_masks_to_attnkit_conventions():
    am = torch.tensor([[False, True], [False, False]])
    kpm = torch.tensor([[False, False], [True, False]])
    both = torch_masks_to_attnkit(am, kpm, batch=2, heads=3)
    assert both.dtype == torch.bool and both.shape == (2, 1, 2, 2)
    assert both[0, 0].tolist() == [[True, False], [True, True]]
    assert both[1, 0].tolist() == [[False, False], [False, True]]
    fl = torch_masks_to_attnkit(torch.zeros(2, 2), kpm, batch=2, heads=3)
    assert fl.dtype == torch.float32 and fl[1, 0, 0, 0] == -math.inf and fl[1, 0, 0, 1] == 0
    assert torch_masks_to_attnkit(None, None, batch=2, heads=3) is None
    with pytest.raises(ValueError, match="attn_mask"):
        torch_masks_to_attnkit(torch.zeros(5, 2, 2, dtype=torch.bool), None, batch=2, heads=3)


# ---------------------------------------------------------------------------- parameters
@pytest.mark.parametrize("n_kv", [None, 4, 1])
def test_parameter_counts_mha_gqa_mqa(n_kv):
    d, H = 32, 8
    m = ak.MultiHeadAttention(d, H, n_kv_heads=n_kv)
    kv = H if n_kv is None else n_kv
    h = d // H
    assert _n_params(m) == 2 * d * d + 2 * d * kv * h          # MHA: 4d²
    if n_kv is None:
        assert _n_params(m) == 4 * d * d
    r = ak.cost.report(d, H, 16, n_kv_heads=n_kv)
    assert _n_params(m) == r.attn_params[{None: "MHA", 4: "GQA", 1: "MQA"}[n_kv]]
    with_bias = ak.MultiHeadAttention(d, H, n_kv_heads=n_kv, bias=True)
    assert _n_params(with_bias) == _n_params(m) + d + 2 * kv * h + d


def test_parameter_counts_mla_and_options():
    d, H, d_c = 32, 4, 6
    m = ak.MultiHeadLatentAttention(d, H, kv_latent_dim=d_c)
    assert _n_params(m) == 2 * d * d + 3 * d * d_c
    assert _n_params(m) == ak.cost.report(d, H, 8, kv_latent_dim=d_c).attn_params["MLA"]
    lowq = ak.MultiHeadLatentAttention(d, H, kv_latent_dim=d_c, q_latent_dim=5,
                                       latent_norm=True)
    assert _n_params(lowq) == d * 5 + 5 * d + d * d + 3 * d * d_c + d_c
    tied = ak.MultiHeadAttention(d, H, tie_qk=True, qk_norm=True)
    names = {n for n, _ in tied.named_parameters()}
    assert not any(n.startswith(("q_proj", "k_proj")) for n in names)
    assert {"q_norm.weight", "k_norm.weight"} <= names
    assert _n_params(tied) == 3 * d * d + 2 * (d // H)


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


# ---------------------------------------------------------------------------- options
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


@pytest.mark.parametrize("cfg", [dict(), dict(bias=True, latent_norm=True),
                                 dict(q_latent_dim=5, softcap=2.0), dict(v_head_dim=3)],
                         ids=lambda c: ",".join(c) or "plain")
@pytest.mark.parametrize("absorb", [False, True])
def test_backprop_every_mla_option(cfg, absorb):
    m = ak.MultiHeadLatentAttention(16, 4, kv_latent_dim=6, **cfg).to(DT)
    x = torch.randn(2, 5, 16, dtype=DT, requires_grad=True)
    out = m(x, is_causal=True, absorb=absorb)
    (out * torch.randn_like(out)).sum().backward()
    for name, p in [*m.named_parameters(), ("x", x)]:
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


# ---------------------------------------------------------------------------- KV cache
def _decode(m, x, chunks, **kw):
    """Run x (B, N, d) through m chunk by chunk with one cache; concat the outputs."""
    cache = ak.KVCache(**kw)
    outs, i = [], 0
    for n in chunks:
        outs.append(m(x[:, i:i + n], cache=cache, is_causal=True))
        i += n
    assert i == x.shape[1] and cache.length == i
    return torch.cat(outs, 1), cache


@pytest.mark.parametrize("n_kv", [4, 2, 1])
@pytest.mark.parametrize("chunks", [[5, 1, 1, 1, 1, 1, 1], [1] * 11, [3, 4, 1, 3]])
def test_kv_cache_decode_equals_full_forward(n_kv, chunks):
    m = ak.MultiHeadAttention(16, 4, n_kv_heads=n_kv, qk_norm=True, bias=True).to(DT)
    x = torch.randn(2, 11, 16, dtype=DT)
    want = m(x, is_causal=True)
    with torch.no_grad():
        got, cache = _decode(m, x, chunks)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    # only H_kv heads are stored
    assert cache.k.shape == (2, n_kv, 11, 4) and cache.v.shape == (2, n_kv, 11, 4)
    assert cache.nbytes == 2 * 2 * n_kv * 11 * 4 * 8
    torch.testing.assert_close(cache.k, m.project_k(x))


def test_decode_step_weights_match_full_forward():
    x = torch.randn(2, 6, 16, dtype=DT)
    for m in (ak.MultiHeadAttention(16, 4, n_kv_heads=2).to(DT),
              ak.MultiHeadLatentAttention(16, 4, kv_latent_dim=6).to(DT)):
        full, w_full = m(x, is_causal=True, need_weights=True)
        with torch.no_grad():
            cache = ak.KVCache()
            m(x[:, :5], cache=cache, is_causal=True)
            out, w = m(x[:, 5:], cache=cache, is_causal=True, need_weights=True)
        assert w.shape == (2, 4, 1, 6)
        torch.testing.assert_close(w, w_full[:, :, 5:])
        torch.testing.assert_close(out, full[:, 5:])


def test_decode_steps_dispatch_through_attention_auto(monkeypatch):
    seen = []
    real = ak.backends.select

    def spy(p, name="auto"):
        seen.append((name, tuple(p.q.shape), tuple(p.k.shape), p.mask))
        return real(p, name)

    m = ak.MultiHeadAttention(16, 8, n_kv_heads=2)
    mla = ak.MultiHeadLatentAttention(16, 8, kv_latent_dim=4)
    with torch.no_grad():
        c1, c2 = ak.KVCache(), ak.KVCache()
        m(torch.randn(1, 3, 16), cache=c1, is_causal=True)
        mla(torch.randn(1, 3, 16), cache=c2, is_causal=True)
        monkeypatch.setattr(ak.backends, "select", spy)
        m(torch.randn(1, 1, 16), cache=c1, is_causal=True)
        mla(torch.randn(1, 1, 16), cache=c2, is_causal=True)
    # one query per head, folded onto its K/V head: (B, H_kv, G, D) against the cache
    assert seen == [("auto", (1, 2, 4, 2), (1, 2, 4, 2), None),
                    ("auto", (1, 1, 8, 4), (1, 1, 4, 4), None)]


def test_kv_cache_grows_without_recopying_every_token_and_preallocates():
    m = ak.MultiHeadAttention(8, 2).to(DT)
    x = torch.randn(1, 40, 8, dtype=DT)
    with torch.no_grad():
        cache = ak.KVCache()
        caps = []
        for i in range(40):
            m(x[:, i:i + 1], cache=cache, is_causal=True)
            caps.append(cache.capacity)
    assert len(set(caps)) <= 3                      # 16 → 32 → 64: geometric growth
    assert cache.allocated_nbytes >= cache.nbytes
    with torch.no_grad():
        got, pre = _decode(m, x, [8] * 5, max_len=40)
    assert pre.capacity == 40 and pre.allocated_nbytes == pre.nbytes
    torch.testing.assert_close(got, m(x, is_causal=True))


def test_kv_cache_under_autograd_gives_full_forward_gradients():
    m = ak.MultiHeadAttention(8, 2, n_kv_heads=1).to(DT)
    x = torch.randn(1, 6, 8, dtype=DT)
    m(x, is_causal=True).sum().backward()
    want = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    got, _ = _decode(m, x, [2, 1, 3])
    got.sum().backward()
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad, want[n], msg=n)


def test_kv_cache_with_padding_mask_and_reorder():
    m = ak.MultiHeadAttention(8, 2).to(DT)
    x = torch.randn(2, 6, 8, dtype=DT)
    pad = ak.masks.padding([6, 4]) & ak.masks.causal(align="bottom_right")
    want = m(x, mask=ak.masks.padding([6, 4]) & ak.masks.causal())
    with torch.no_grad():
        cache = ak.KVCache()
        a = m(x[:, :4], cache=cache, mask=pad)
        b = m(x[:, 4:], cache=cache, mask=pad)
    torch.testing.assert_close(torch.cat([a, b], 1), want)
    with torch.no_grad():
        cache = ak.KVCache()
        m(x[:, :5], cache=cache, is_causal=True)
        m(x[:, 5:], cache=cache, is_causal=True)
        cache.truncate(5)
        with pytest.raises(ValueError, match="truncate"):
            cache.truncate(6)
        cache.reorder(torch.tensor([1, 0]))
        step = m(x[[1, 0], 5:], cache=cache, is_causal=True)
    torch.testing.assert_close(step, m(x[[1, 0]], is_causal=True)[:, 5:])


@pytest.mark.parametrize("chunks", [[4, 1, 1, 1, 1, 1], [1] * 9, [2, 5, 2]])
def test_mla_cache_holds_latent_only_and_decode_equals_full(chunks):
    m = ak.MultiHeadLatentAttention(16, 4, kv_latent_dim=6, latent_norm=True,
                                    bias=True).to(DT)
    x = torch.randn(2, 9, 16, dtype=DT)
    want = m(x, is_causal=True, absorb=False)
    with torch.no_grad():
        got, cache = _decode(m, x, chunks)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert cache.kind == "MultiHeadLatentAttention"
    assert cache.latent.shape == (2, 1, 9, 6)
    assert cache.nbytes == 2 * 9 * 6 * 8
    with pytest.raises(KeyError):
        cache.k


def test_mla_absorbed_equals_plain_with_masks_and_weights():
    m = ak.MultiHeadLatentAttention(16, 4, kv_latent_dim=5, head_dim=3, v_head_dim=7,
                                    softcap=3.0).to(DT)
    x = torch.randn(2, 6, 16, dtype=DT)
    ctx = torch.randn(2, 8, 16, dtype=DT)
    mask = torch.rand(2, 4, 6, 8) > 0.5
    mask[..., 0] = True
    p_out, p_w = m(x, ctx, mask=mask, need_weights=True, absorb=False)
    a_out, a_w = m(x, ctx, mask=mask, need_weights=True, absorb=True)
    torch.testing.assert_close(a_out, p_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(a_w, p_w, rtol=1e-10, atol=1e-10)
    # the plain path really is per-head attention over up-projected K and V
    c = m.kv_down(ctx)
    k = m.k_up(c).view(2, 8, 4, 3).transpose(1, 2)
    v = m.v_up(c).view(2, 8, 4, 7).transpose(1, 2)
    o = _hand_attention(m.project_q(x), k, v, scale=1 / math.sqrt(3), softcap=3.0,
                        allowed=mask)
    torch.testing.assert_close(p_out, m.out_proj(o.transpose(1, 2).reshape(2, 6, -1)))


def test_cache_size_ordering_mha_gqa_mla():
    d, H, N = 32, 8, 10
    x = torch.randn(1, N, d)
    sizes = {}
    for name, m in {"MHA": ak.MultiHeadAttention(d, H),
                    "GQA": ak.MultiHeadAttention(d, H, n_kv_heads=2),
                    "MLA": ak.MultiHeadLatentAttention(d, H, kv_latent_dim=8)}.items():
        with torch.no_grad():
            _, cache = _decode(m, x, [N])
        sizes[name] = cache.nbytes
    r = ak.cost.report(d, H, N, n_kv_heads=2, kv_latent_dim=8, dtype_bytes=4)
    assert sizes == {k: r.kv_bytes[k] for k in sizes}
    assert sizes["MHA"] > sizes["GQA"] > sizes["MLA"]


# ---------------------------------------------------------------------------- errors
def test_bad_construction_raises_clear_errors():
    with pytest.raises(ValueError, match="d_model=10 is not divisible by n_heads=3"):
        ak.MultiHeadAttention(10, 3)
    assert ak.MultiHeadAttention(10, 3, head_dim=4).q_proj.weight.shape == (12, 10)
    with pytest.raises(ValueError, match="multiple of n_kv_heads=3"):
        ak.MultiHeadAttention(16, 4, n_kv_heads=3)
    with pytest.raises(ValueError, match="tie_qk"):
        ak.MultiHeadAttention(16, 4, n_kv_heads=2, tie_qk=True)
    with pytest.raises(ValueError, match="softcap"):
        ak.MultiHeadAttention(16, 4, softcap=0.0)
    with pytest.raises(ValueError, match="dropout"):
        ak.MultiHeadAttention(16, 4, dropout=1.0)
    with pytest.raises(ValueError, match="n_heads must be a positive integer"):
        ak.MultiHeadAttention(16, 0)
    with pytest.raises(ValueError, match="not divisible"):
        ak.MultiHeadLatentAttention(10, 3, kv_latent_dim=4)
    with pytest.raises(ValueError, match="kv_latent_dim"):
        ak.MultiHeadLatentAttention(16, 4, kv_latent_dim=0)


def test_bad_calls_raise_clear_errors():
    m = ak.MultiHeadAttention(16, 4, kv_dim=6)
    with pytest.raises(ValueError, match=r"x must have shape \(B, N, 16\).*\(2, 5, 12\)"):
        m(torch.randn(2, 5, 12))
    with pytest.raises(ValueError, match=r"context must have shape \(B, N, 6\)"):
        m(torch.randn(2, 5, 16), torch.randn(2, 3, 16))
    with pytest.raises(ValueError, match="same batch"):
        m(torch.randn(2, 5, 16), torch.randn(3, 3, 6))
    with pytest.raises(TypeError, match="dtype"):
        m(torch.randn(2, 5, 16, dtype=DT))
    with pytest.raises(ValueError, match="pass context"):
        m(torch.randn(2, 5, 16))
    with pytest.raises(ValueError, match="self-attention"):
        m(torch.randn(2, 5, 16), torch.randn(2, 3, 6), cache=ak.KVCache())
    m2 = ak.MultiHeadAttention(16, 4)
    with pytest.raises(ValueError, match="not both"):
        m2(torch.randn(2, 5, 16), mask=ak.masks.causal(), is_causal=True)
    mla = ak.MultiHeadLatentAttention(16, 4, kv_latent_dim=4)
    with torch.no_grad():
        cache = ak.KVCache()
        m2(torch.randn(2, 3, 16), cache=cache)
        with pytest.raises(ValueError, match="one KVCache per layer"):
            mla(torch.randn(2, 1, 16), cache=cache)
        with pytest.raises(ValueError, match="same batch"):
            m2(torch.randn(3, 1, 16), cache=cache)
    with pytest.raises(ValueError, match="max_len"):
        ak.KVCache(max_len=0)
