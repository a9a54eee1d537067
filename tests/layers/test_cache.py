"""KVCache: decoding equals the full forward, growth, autograd, masks, reorder, sizes;
one cache per layer; a failed call leaves the cache as it was."""

from __future__ import annotations

import copy
import gc
import pickle

import pytest
import torch

import attnkit as ak
from helpers.layers import DT, decode_in_chunks


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
    want = m(x, mask=ak.masks.padding([6, 4]) & ak.masks.causal())

    def pad(lengths):        # valid keys among the N_k a call sees (cached ones included)
        return ak.masks.padding(lengths) & ak.masks.causal(align="bottom_right")

    with torch.no_grad():
        cache = ak.KVCache()
        a = m(x[:, :4], cache=cache, mask=pad([4, 4]))     # N_k = 4
        b = m(x[:, 4:], cache=cache, mask=pad([6, 4]))     # N_k = 6
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


# ---------------------------------------------------------------------------- one cache, one layer
def _layer_pair(kind):
    if kind == "MHA":
        return (ak.MultiHeadAttention(16, 4, n_kv_heads=2).to(DT),
                ak.MultiHeadAttention(16, 4, n_kv_heads=2).to(DT))
    return (ak.MultiHeadLatentAttention(16, 4, kv_latent_dim=6).to(DT),
            ak.MultiHeadLatentAttention(16, 4, kv_latent_dim=6).to(DT))


@pytest.mark.parametrize("kind", ["MHA", "MLA"])
def test_cache_shared_by_two_layers_raises_and_names_them(kind):
    a, b = _layer_pair(kind)                     # same configuration: shapes cannot tell
    x = torch.randn(2, 6, 16, dtype=DT)
    with torch.no_grad():
        cache = ak.KVCache()
        a(x[:, :5], cache=cache, is_causal=True)
        with pytest.raises(ValueError, match="one KVCache per layer") as e:
            b(x[:, 5:], cache=cache, is_causal=True)
        msg = str(e.value)
        assert "belongs to another layer" in msg and "5 tokens" in msg
        assert f"{id(a):#x}" in msg and f"{id(b):#x}" in msg
        assert type(a).__name__ in msg
        assert cache.length == 5 and cache.owner is a          # nothing was appended
        # the owner goes on decoding, and equals its full forward
        step = a(x[:, 5:], cache=cache, is_causal=True)
    torch.testing.assert_close(step, a(x, is_causal=True)[:, 5:])


@pytest.mark.parametrize("kind", ["MHA", "MLA"])
def test_cache_reset_and_reuse_by_the_same_layer(kind):
    a, b = _layer_pair(kind)
    x = torch.randn(1, 7, 16, dtype=DT)
    with torch.no_grad():
        cache = ak.KVCache()
        a(x[:, :4], cache=cache, is_causal=True)
        cache.truncate(2)                        # the owner may roll back and go on
        got = torch.cat([a(x[:, 2:6], cache=cache, is_causal=True),
                         a(x[:, 6:], cache=cache, is_causal=True)], 1)
        torch.testing.assert_close(got, a(x, is_causal=True)[:, 2:])
        cache.reset()                            # a reset cache is free for a new owner
        assert cache.owner is None and cache.length == 0
        b(x, cache=cache, is_causal=True)
        assert cache.owner is b
        with pytest.raises(ValueError, match="one KVCache per layer"):
            a(x[:, :1], cache=cache, is_causal=True)
        cache.reset()                            # and back to the first layer
        a(x, cache=cache, is_causal=True)
        assert cache.owner is a and cache.length == 7


def test_cache_owned_by_a_deleted_layer_raises():
    a, b = _layer_pair("MHA")
    with torch.no_grad():
        cache = ak.KVCache()
        a(torch.randn(1, 3, 16, dtype=DT), cache=cache)
        del a
        gc.collect()
        assert cache.owner is None               # the cache does not keep its layer alive
        with pytest.raises(ValueError, match="no longer exists.*reset"):
            b(torch.randn(1, 1, 16, dtype=DT), cache=cache)


def test_cache_copy_keeps_owner_and_pickle_drops_it():
    m, other = _layer_pair("MHA")
    x = torch.randn(1, 5, 16, dtype=DT)
    with torch.no_grad():
        cache = ak.KVCache()
        m(x[:, :4], cache=cache, is_causal=True)
        twin = copy.deepcopy(cache)              # e.g. a beam's copy: still m's
        assert twin.owner is m
        with pytest.raises(ValueError, match="one KVCache per layer"):
            other(x[:, 4:], cache=twin, is_causal=True)
        loaded = pickle.loads(pickle.dumps(cache))
        assert loaded.owner is None and loaded.length == 4
        torch.testing.assert_close(loaded.k, cache.k)
        step = m(x[:, 4:], cache=loaded, is_causal=True)
    torch.testing.assert_close(step, m(x, is_causal=True)[:, 4:])


@pytest.mark.parametrize("kind", ["MHA", "MLA"])
@pytest.mark.parametrize("first", ["copy", "original"])
def test_shallow_copy_is_a_fork_that_never_overwrites_the_original(kind, first):
    """copy.copy(cache) shared the storage: appending to one wrote over the other's next
    token slot (issue 19). Now each side copies the storage before its first write."""
    m, _ = _layer_pair(kind)
    a, b = torch.randn(1, 6, 16, dtype=DT), torch.randn(1, 6, 16, dtype=DT)
    b[:, :4] = a[:, :4]                             # one prompt, two continuations
    with torch.no_grad():
        cache = ak.KVCache(max_len=32)              # spare capacity: appends write in place
        m(a[:, :4], cache=cache, is_causal=True)
        twin = copy.copy(cache)
        assert twin.owner is m and twin.length == 4
        order = [(twin, b), (cache, a)] if first == "copy" else [(cache, a), (twin, b)]
        got = {id(c): m(x[:, 4:5], cache=c, is_causal=True) for c, x in order}
        got2 = {id(c): m(x[:, 5:6], cache=c, is_causal=True) for c, x in order}
    for c, x in ((cache, a), (twin, b)):
        want = m(x, is_causal=True)
        torch.testing.assert_close(got[id(c)], want[:, 4:5], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got2[id(c)], want[:, 5:6], rtol=1e-10, atol=1e-10)
        assert c.length == 6
    name = "k" if kind == "MHA" else "latent"
    assert cache.get(name).data_ptr() != twin.get(name).data_ptr()


def test_shallow_copy_fork_survives_truncate_chains_and_failed_calls():
    m, _ = _layer_pair("MHA")
    x = torch.randn(1, 6, 16, dtype=DT)
    with torch.no_grad():
        cache = ak.KVCache(max_len=32)
        m(x[:, :5], cache=cache, is_causal=True)
        k5 = cache.k.clone()
        twin = copy.copy(cache)
        twin.truncate(3)                            # a draft rejected on the copy only
        with pytest.raises(ValueError):             # a failed call rolls back, still shared
            m(x[:, 3:4], cache=twin, is_causal=True, mask=torch.ones(2, 2, dtype=torch.bool))
        third = copy.copy(twin)                     # a copy of a copy
        m(torch.randn(1, 2, 16, dtype=DT), cache=twin, is_causal=True)
        m(torch.randn(1, 1, 16, dtype=DT), cache=third, is_causal=True)
        torch.testing.assert_close(cache.k, k5, rtol=0, atol=0)
        assert third.k[:, :, :3].equal(k5[:, :, :3]) and twin.k[:, :, :3].equal(k5[:, :, :3])
        assert not third.k[:, :, 3].equal(twin.k[:, :, 3])
        step = m(x[:, 5:], cache=cache, is_causal=True)   # the original is as it was
    torch.testing.assert_close(step, m(x, is_causal=True)[:, 5:], rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------- failed calls
@pytest.mark.parametrize("kind", ["MHA", "MLA"])
def test_a_failed_call_leaves_the_cache_as_it_was(kind):
    m, other = _layer_pair(kind)
    x = torch.randn(2, 6, 16, dtype=DT)
    want = m(x, is_causal=True)
    with torch.no_grad():
        cache = ak.KVCache()
        m(x[:, :5], cache=cache, is_causal=True)
        bad_mask = torch.ones(2, 1, 1, 1, 3, dtype=torch.bool)       # does not broadcast
        with pytest.raises(ValueError, match="mask"):
            m(x[:, 5:], cache=cache, mask=bad_mask)
        with pytest.raises(ValueError, match="not both"):
            m(x[:, 5:], cache=cache, mask=ak.masks.causal(), is_causal=True)
        assert cache.length == 5
        step = m(x[:, 5:], cache=cache, is_causal=True)  # the corrected call: no stale token
        torch.testing.assert_close(step, want[:, 5:])
        # a first call that fails leaves the cache unclaimed
        fresh = ak.KVCache()
        with pytest.raises(ValueError, match="mask"):
            m(x, cache=fresh, mask=bad_mask)
        assert fresh.length == 0 and fresh.owner is None and fresh.kind is None
        other(x, cache=fresh, is_causal=True)
        assert fresh.owner is other


@pytest.mark.parametrize("kind", ["MHA", "MLA"])
def test_cache_argument_must_be_a_kvcache(kind):
    m, _ = _layer_pair(kind)
    x = torch.randn(1, 3, 16, dtype=DT)
    for bad in ({}, [], "cache"):
        with pytest.raises(TypeError, match=r"cache must be an attnkit\.KVCache, got"):
            m(x, cache=bad)
    with pytest.raises(ValueError, match="self-attention"):
        m(x, torch.randn(1, 2, 16, dtype=DT), cache=ak.KVCache())


def test_reorder_checks_its_index():
    m, _ = _layer_pair("MHA")
    x = torch.randn(2, 3, 16, dtype=DT)
    with torch.no_grad():
        cache = ak.KVCache()
        m(x, cache=cache, is_causal=True)
        k = cache.k.clone()
        cache.reorder([1, 1, 0])                 # a list works; beams may repeat rows
        torch.testing.assert_close(cache.k, k[[1, 1, 0]])
        for bad in ([3], [-1], torch.tensor([0.0, 1.0]), torch.tensor([[0, 1]]),
                    torch.tensor([True, False])):
            with pytest.raises(ValueError, match=r"reorder needs a 1-D integer index .*\[0, 3\)"):
                cache.reorder(bad)
        assert cache.k.shape[0] == 3


def test_append_streams_must_agree():
    cache = ak.KVCache()
    with pytest.raises(ValueError, match="every stream must be"):
        cache.append("x", k=torch.zeros(2, 1, 3, 4), v=torch.zeros(3, 1, 3, 4))
    with pytest.raises(ValueError, match="every stream must be"):
        cache.append("x", k=torch.zeros(2, 1, 3, 4), v=torch.zeros(2, 1, 3, 4, dtype=DT))
    assert cache.kind is None and cache.length == 0
