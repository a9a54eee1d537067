"""What MHA and MLA share: the input checks, dispatch through attention(), construction errors."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from helpers.layers import DT
from helpers.recorders import OpOutputs


def test_decode_steps_dispatch_through_attention_auto(monkeypatch):
    seen = []
    real = ak.backends.select

    def spy(p, name="auto"):
        chosen = real(p, name)
        seen.append((name, tuple(p.q.shape), tuple(p.k.shape), p.mask, chosen.name))
        return chosen

    m = ak.MultiHeadAttention(16, 8, n_kv_heads=2)
    mla = ak.MultiHeadLatentAttention(16, 8, kv_latent_dim=4)
    with torch.no_grad():
        c1, c2 = ak.KVCache(), ak.KVCache()
        m(torch.randn(1, 3, 16), cache=c1, is_causal=True)
        mla(torch.randn(1, 3, 16), cache=c2, is_causal=True)
        monkeypatch.setattr(ak.backends, "select", spy)
        m(torch.randn(1, 1, 16), cache=c1, is_causal=True)
        mla(torch.randn(1, 1, 16), cache=c2, is_causal=True)
    # one query per head against the whole cache, as is: layers call attention() and nothing
    # else; the decode backend stacks each K/V head's G query heads as rows itself
    assert seen == [("auto", (1, 8, 1, 2), (1, 2, 4, 2), None, "decode"),
                    ("auto", (1, 8, 1, 4), (1, 1, 4, 4), None, "decode")]


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


def test_eager_need_weights_is_the_reference_softmax_and_no_operator():
    # eager: the reference's weights, without the attnkit::attention_weights operator (which
    # only traced calls use); rows sum to 1 where a key is allowed, 0 where none is
    torch.manual_seed(0)
    m = ak.MultiHeadAttention(16, 4, n_kv_heads=2)
    x = torch.randn(2, 5, 16)
    mask = ak.masks.padding([5, 0])
    with OpOutputs() as rec:
        out, w = m(x, mask=mask, need_weights=True)
    assert not any("attnkit" in s for s in rec.seen)
    q, k = m.project_q(x), m.project_k(x)
    ref = ak.reference.reference(ak.api.prepare(q, k, k, mask=mask, scale=m.scale).problem)
    torch.testing.assert_close(w, ref.weights)
    torch.testing.assert_close(w.sum(-1), torch.tensor([1.0, 0.0])[:, None, None].expand(2, 4, 5))
