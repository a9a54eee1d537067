"""MultiHeadLatentAttention: parameters, backprop, the latent cache, absorbed = plain."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from helpers.layers import DT, decode_in_chunks, n_params
from helpers.oracle import oracle


def test_parameter_counts_mla_and_options():
    d, H, d_c = 32, 4, 6
    m = ak.MultiHeadLatentAttention(d, H, kv_latent_dim=d_c)
    assert n_params(m) == 2 * d * d + 3 * d * d_c
    assert n_params(m) == ak.cost.report(d, H, 8, kv_latent_dim=d_c).attn_params["MLA"]
    lowq = ak.MultiHeadLatentAttention(d, H, kv_latent_dim=d_c, q_latent_dim=5,
                                       latent_norm=True)
    assert n_params(lowq) == d * 5 + 5 * d + d * d + 3 * d * d_c + d_c
    tied = ak.MultiHeadAttention(d, H, tie_qk=True, qk_norm=True)
    names = {n for n, _ in tied.named_parameters()}
    assert not any(n.startswith(("q_proj", "k_proj")) for n in names)
    assert {"q_norm.weight", "k_norm.weight"} <= names
    assert n_params(tied) == 3 * d * d + 2 * (d // H)


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


@pytest.mark.parametrize("chunks", [[4, 1, 1, 1, 1, 1], [1] * 9, [2, 5, 2]])
def test_mla_cache_holds_latent_only_and_decode_equals_full(chunks):
    m = ak.MultiHeadLatentAttention(16, 4, kv_latent_dim=6, latent_norm=True,
                                    bias=True).to(DT)
    x = torch.randn(2, 9, 16, dtype=DT)
    want = m(x, is_causal=True, absorb=False)
    with torch.no_grad():
        got, cache = decode_in_chunks(m, x, chunks)
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
    mask[0, 2, 4] = False                          # a query that sees no key: its output is 0
    p_out, p_w = m(x, ctx, mask=mask, need_weights=True, absorb=False)
    a_out, a_w = m(x, ctx, mask=mask, need_weights=True, absorb=True)
    torch.testing.assert_close(a_out, p_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(a_w, p_w, rtol=1e-10, atol=1e-10)
    # the plain path really is per-head attention over up-projected K and V
    c = m.kv_down(ctx)
    k = m.k_up(c).view(2, 8, 4, 3).transpose(1, 2)
    v = m.v_up(c).view(2, 8, 4, 7).transpose(1, 2)
    o, _, _ = oracle(m.project_q(x), k, v, scale=1 / math.sqrt(3), softcap=3.0, allowed=mask)
    torch.testing.assert_close(p_out, m.out_proj(o.transpose(1, 2).reshape(2, 6, -1)))
