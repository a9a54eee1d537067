"""KVCache: decoding equals the full forward, growth, autograd, masks, reorder, sizes;
one cache per layer; a failed call leaves the cache as it was."""

from __future__ import annotations

import pytest
import torch
from layer_helpers import DT, decode_in_chunks

import attnkit as ak


@pytest.mark.parametrize("n_kv", [4, 2, 1])
@pytest.mark.parametrize("chunks", [[5, 1, 1, 1, 1, 1, 1], [1] * 11, [3, 4, 1, 3]])
def test_kv_cache_decode_equals_full_forward(n_kv, chunks):
    m = ak.MultiHeadAttention(16, 4, n_kv_heads=n_kv, qk_norm=True, bias=True).to(DT)
    x = torch.randn(2, 11, 16, dtype=DT)
    want = m(x, is_causal=True)
    with torch.no_grad():
        got, cache = decode_in_chunks(m, x, chunks)
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
        got, pre = decode_in_chunks(m, x, [8] * 5, max_len=40)
    assert pre.capacity == 40 and pre.allocated_nbytes == pre.nbytes
    torch.testing.assert_close(got, m(x, is_causal=True))


def test_kv_cache_under_autograd_gives_full_forward_gradients():
    m = ak.MultiHeadAttention(8, 2, n_kv_heads=1).to(DT)
    x = torch.randn(1, 6, 8, dtype=DT)
    m(x, is_causal=True).sum().backward()
    want = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    got, _ = decode_in_chunks(m, x, [2, 1, 3])
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


def test_cache_size_ordering_mha_gqa_mla():
    d, H, N = 32, 8, 10
    x = torch.randn(1, N, d)
    sizes = {}
    for name, m in {"MHA": ak.MultiHeadAttention(d, H),
                    "GQA": ak.MultiHeadAttention(d, H, n_kv_heads=2),
                    "MLA": ak.MultiHeadLatentAttention(d, H, kv_latent_dim=8)}.items():
        with torch.no_grad():
            _, cache = decode_in_chunks(m, x, [N])
        sizes[name] = cache.nbytes
    r = ak.cost.report(d, H, N, n_kv_heads=2, kv_latent_dim=8, dtype_bytes=4)
    assert sizes == {k: r.kv_bytes[k] for k in sizes}
    assert sizes["MHA"] > sizes["GQA"] > sizes["MLA"]
