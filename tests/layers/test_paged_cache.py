"""PagedKVCache: pages and block tables, append (token / chunk, across page boundaries),
free, fork with copy-on-write and refcounts, capacity errors that change nothing, and the
cache's attention equal to attention over the gathered contiguous keys."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.layers.paged import CacheCapacityError

DT = torch.float64


def _kv(n, h=2, d=4, dv=None, dtype=DT):
    return torch.randn(n, h, d, dtype=dtype), torch.randn(n, h, dv or d, dtype=dtype)


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_append_chunks_and_tokens_gather_to_the_concatenation(block_size):
    cache = ak.PagedKVCache(40, block_size, 2, 4, dtype=DT, v_head_dim=5)
    s = cache.new_sequence()
    ks, vs = [], []
    for n in (5, 1, 0, 7, 1, 2):                  # page boundaries fall inside chunks
        k, v = _kv(n, dv=5)
        if n == 1:
            cache.append(s, k[0], v[0])           # one token: (H_kv, D)
        else:
            cache.append(s, k, v)
        ks.append(k)
        vs.append(v)
    k_all, v_all = torch.cat(ks), torch.cat(vs)
    assert cache.length(s) == 16
    assert len(cache.pages(s)) == -(-16 // block_size)
    gk, gv = cache.gather(s)
    assert torch.equal(gk, k_all) and torch.equal(gv, v_all)
    # the pool holds them where the block table says
    table, bs = cache.pages(s), block_size
    for t in range(16):
        assert torch.equal(cache.k_pages[table[t // bs], t % bs], k_all[t])
    assert cache.num_free_blocks == 40 - len(table)


def test_block_table_and_seqlens_pad_with_minus_one():
    cache = ak.PagedKVCache(10, 4, 1, 2)
    a, b = cache.new_sequence(), cache.new_sequence()
    cache.append(a, *_kv(9, 1, 2, dtype=torch.float32))
    cache.append(b, *_kv(2, 1, 2, dtype=torch.float32))
    t = cache.block_table([a, b])
    assert t.dtype == torch.int32 and t.shape == (2, 3)
    assert t[0].tolist() == cache.pages(a) and t[1].tolist() == cache.pages(b) + [-1, -1]
    assert cache.seqlens([a, b]).tolist() == [9, 2]
    assert cache.block_table([a], width=5).shape == (1, 5)
    with pytest.raises(ValueError, match="width 2 is smaller"):
        cache.block_table([a], width=2)


def test_fork_shares_pages_and_copies_on_first_write():
    cache = ak.PagedKVCache(12, 3, 2, 4, dtype=DT)
    parent = cache.new_sequence()
    k0, v0 = _kv(5)
    cache.append(parent, k0, v0)                   # pages: [full, 2 of 3 used]
    p0, p1 = cache.pages(parent)
    child = cache.fork(parent)
    assert cache.pages(child) == [p0, p1] and cache.length(child) == 5
    assert cache.refcount(p0) == cache.refcount(p1) == 2
    free_before = cache.num_free_blocks
    k1, v1 = _kv(2)                                # writes slot 2 of p1, then a new page
    cache.append(child, k1, v1)
    c0, c1, c2 = cache.pages(child)
    assert c0 == p0 and c1 != p1                   # the shared prefix page stays shared
    assert cache.refcount(p0) == 2 and cache.refcount(p1) == 1 and cache.refcount(c1) == 1
    assert cache.num_free_blocks == free_before - 2
    # the parent is untouched; the child sees prefix + its own tokens
    gk, gv = cache.gather(parent)
    assert torch.equal(gk, k0) and torch.equal(gv, v0)
    gk, gv = cache.gather(child)
    assert torch.equal(gk, torch.cat([k0, k1])) and torch.equal(gv, torch.cat([v0, v1]))
    # the parent now owns p1 alone: its write goes in place (no copy)
    k2, v2 = _kv(1)
    cache.append(parent, k2, v2)
    assert cache.pages(parent) == [p0, p1]
    assert torch.equal(cache.gather(parent)[0], torch.cat([k0, k2]))
    assert torch.equal(cache.gather(child)[0], torch.cat([k0, k1]))


def test_batched_write_by_both_holders_copies_once_and_leaks_nothing():
    cache = ak.PagedKVCache(6, 4, 1, 2, dtype=DT)
    a = cache.new_sequence()
    k0, v0 = _kv(6, 1, 2)
    cache.append(a, k0, v0)
    p0, p1 = cache.pages(a)
    b = cache.fork(a)
    cache.reserve([a, b], 1)                       # both write into shared p1
    assert cache.num_free_blocks == 3              # one copy: b, p1's last holder, keeps it
    assert cache.pages(b) == [p0, p1] and cache.pages(a)[0] == p0
    assert cache.refcount(p1) == 1 and cache.refcount(p0) == 2
    assert torch.equal(cache.k_pages[cache.pages(a)[1]], cache.k_pages[p1])
    cache.free(a)
    cache.free(b)
    assert cache.num_free_blocks == 6 and all(cache.refcount(p) == 0 for p in range(6))


def test_free_returns_pages_once_no_fork_holds_them():
    cache = ak.PagedKVCache(6, 2, 1, 2)
    a = cache.new_sequence()
    cache.append(a, *_kv(4, 1, 2, dtype=torch.float32))
    b = cache.fork(a)
    cache.free(a)
    assert cache.num_free_blocks == 4              # b still holds both pages
    assert cache.sequences == [b]
    cache.free(b)
    assert cache.num_free_blocks == 6 and len(cache) == 0
    with pytest.raises(KeyError, match="not in this PagedKVCache"):
        cache.length(b)


def _refused(cache, table, lens, written) -> bool:
    """Whether check_block_table refuses, on its full (row by row) checks."""
    fast = cache._table_ok
    cache._table_ok = lambda *a: None                # the full checks only
    try:
        cache.check_block_table(table, lens, written)
        return False
    except ValueError:
        return True
    finally:
        cache._table_ok = fast


def test_block_table_fast_check_agrees_with_the_full_checks():
    # random tables over a cache with forks, freed pages and shared pages (some with rows
    # writing into them): the one-pass check accepts exactly the tables the full checks do
    gen = torch.Generator().manual_seed(0)
    cache = ak.PagedKVCache(24, 2, 1, 2, dtype=DT)
    root = cache.new_sequence()
    cache.append(root, *_kv(5, 1, 2))
    seqs = [root, cache.fork(root), cache.fork(root)]
    cache.append(seqs[1], *_kv(2, 1, 2))
    gone = cache.new_sequence()
    cache.append(gone, *_kv(4, 1, 2))
    cache.free(gone)                                # its pages are free again
    seen = {True: 0, False: 0}
    for _ in range(300):
        rows = int(torch.randint(1, 4, (), generator=gen))
        pick = [seqs[int(i)] for i in torch.randint(0, 3, (rows,), generator=gen)]
        table = cache.block_table(pick)
        lens = [cache.length(s) for s in pick]
        if torch.rand((), generator=gen) < 0.5:     # one entry replaced by a random page
            b = int(torch.randint(0, rows, (), generator=gen))
            j = int(torch.randint(0, -(-lens[b] // 2), (), generator=gen))
            table[b, j] = int(torch.randint(0, 24, (), generator=gen))
        written = [(b, max(0, lens[b] - 1)) for b in range(rows)
                   if torch.rand((), generator=gen) < 0.3]
        ok = cache._table_ok(table, lens, written) is not None
        assert ok == (not _refused(cache, table, lens, written)), (table, lens, written)
        seen[ok] += 1
    assert min(seen.values()) > 30                  # both outcomes well covered


def test_block_table_check_names_bad_lengths_and_pages():
    # a raw table checked directly: more lengths than rows, or an entry that is no page of
    # the cache, is one clear error; fewer lengths check only their rows
    cache = ak.PagedKVCache(6, 2, 1, 2, dtype=DT)
    a = cache.new_sequence()
    cache.append(a, *_kv(3, 1, 2))
    table = cache.block_table([a])
    with pytest.raises(ValueError, match="2 sequence lengths for a block_table of 1 rows"):
        cache.check_block_table(table, [3, 3])
    for bad in (6, -1):
        t = table.clone()
        t[0, 1] = bad
        with pytest.raises(ValueError, match=rf"block_table\[0, 1\] = {bad} is not a page"):
            cache.check_block_table(t, [3])
    two = torch.cat([table, torch.full_like(table, 5)])      # row 1: a free page, unread
    cache.check_block_table(two, [3])


def test_capacity_error_says_free_and_needed_and_changes_nothing():
    cache = ak.PagedKVCache(4, 2, 1, 2, dtype=DT)
    a, b = cache.new_sequence(), cache.new_sequence()
    cache.append(a, *_kv(5, 1, 2))                 # 3 pages
    pool = cache.k_pages.clone()
    state = (cache.pages(a), cache.pages(b), cache.num_free_blocks)
    with pytest.raises(CacheCapacityError, match=r"needs 2 page\(s\).*only 1 of 4 are free"):
        cache.append(b, *_kv(3, 1, 2))
    c = cache.fork(a)
    with pytest.raises(CacheCapacityError, match="copy-on-write"):
        cache.reserve([c, b], [2, 1])              # c: CoW + 1 new, b: 1 new → 3 > 1 free
    assert (cache.pages(a), cache.pages(b), cache.num_free_blocks) == state
    assert torch.equal(cache.k_pages, pool)
    assert cache.pages(c) == cache.pages(a)


def test_truncate_releases_pages():
    cache = ak.PagedKVCache(8, 3, 1, 2)
    a = cache.new_sequence()
    k, v = _kv(8, 1, 2, dtype=torch.float32)
    cache.append(a, k, v)
    cache.truncate(a, 4)
    assert cache.length(a) == 4 and len(cache.pages(a)) == 2 and cache.num_free_blocks == 6
    assert torch.equal(cache.gather(a)[0], k[:4])
    with pytest.raises(ValueError, match="0 <= length <= 4"):
        cache.truncate(a, 5)


def test_bad_construction_and_streams_are_refused():
    with pytest.raises(TypeError, match="dtype must be"):
        ak.PagedKVCache(4, 2, 1, 2, dtype=torch.int8)
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        ak.PagedKVCache(4, 0, 1, 2)
    cache = ak.PagedKVCache(4, 2, 2, 4)
    s = cache.new_sequence()
    with pytest.raises(ValueError, match=r"\(N_new, 2, 4\)"):
        cache.append(s, torch.randn(3, 1, 4), torch.randn(3, 1, 4))
    with pytest.raises(TypeError, match="cache holds torch.float32"):
        cache.append(s, torch.randn(3, 2, 4, dtype=DT), torch.randn(3, 2, 4, dtype=DT))
    assert cache.length(s) == 0 and cache.num_free_blocks == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pools_hold_each_dtype(dtype):
    cache = ak.PagedKVCache(4, 3, 2, 8, dtype=dtype)
    assert cache.k_pages.shape == (4, 3, 2, 8) and cache.k_pages.dtype == dtype
    s = cache.new_sequence()
    k, v = _kv(4, 2, 8, dtype=dtype)
    cache.append(s, k, v)
    assert torch.equal(cache.gather(s)[1], v)
    assert cache.nbytes == 2 * 4 * 3 * 2 * 8 * k.element_size()


def _full_causal(q, k, v):
    """(1, N, H_q, D) queries over (N, H_kv, D) keys, top-left causal (N_q == N_k)."""
    out = ak.attention(q[0].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                       is_causal=True, backend="reference")
    return out.transpose(0, 1)[None]


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_cache_attention_decoding_equals_full_causal_forward(block_size):
    """Three sequences admitted together, prefilled in chunks of different sizes and
    decoded one token at a time; one forked mid-way. Each equals its own full forward."""
    cache = ak.PagedKVCache(64, block_size, 2, 8, dtype=DT)
    n = 11
    xs = [(torch.randn(1, n, 4, 8, dtype=DT), *_kv(n, 2, 8)) for _ in range(3)]
    seqs = [cache.new_sequence() for _ in range(3)]
    chunks = [[5, 1, 1, 4], [1] * 11, [3, 3, 3, 1, 1]]
    outs: list[list[torch.Tensor]] = [[], [], []]
    for i, (q, k, v) in enumerate(xs):
        at = 0
        for c in chunks[i]:
            o = cache.attention([seqs[i]], q[:, at:at + c], k[None, at:at + c],
                                v[None, at:at + c], causal=True)
            outs[i].append(o)
            at += c
        torch.testing.assert_close(torch.cat(outs[i], 1), _full_causal(q, k, v),
                                   rtol=1e-10, atol=1e-10)
    # fork sequence 0 after 11 tokens, continue both with different tokens, batched
    child = cache.fork(seqs[0])
    q2, (k2, v2) = torch.randn(2, 1, 4, 8, dtype=DT), _kv(2, 2, 8)
    o = cache.attention([seqs[0], child], q2, k2[:, None], v2[:, None], causal=True)
    for b, (k_own, v_own) in enumerate([(k2[0], v2[0]), (k2[1], v2[1])]):
        q0, k0, v0 = xs[0]
        kk, vv = torch.cat([k0, k_own[None]]), torch.cat([v0, v_own[None]])
        want = ak.attention(q2[b].transpose(0, 1)[None], kk.transpose(0, 1)[None],
                            vv.transpose(0, 1)[None], backend="reference")[0].transpose(0, 1)
        torch.testing.assert_close(o[b], want, rtol=1e-10, atol=1e-10)
    assert cache.length(seqs[0]) == cache.length(child) == 12


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_multihead_attention_with_a_paged_cache_equals_kv_cache(block_size):
    """MultiHeadAttention(x, cache=paged.batch(seqs)): two sequences at different lengths
    (GQA, qk_norm, rope, softcap) equal each one decoded with its own KVCache."""
    m = ak.MultiHeadAttention(16, 4, n_kv_heads=2, qk_norm=True, rope=True, softcap=20.0,
                              bias=True).to(DT).eval()
    paged = ak.PagedKVCache(48, block_size, 2, 4, dtype=DT)
    a, b = paged.new_sequence(), paged.new_sequence()
    xa, xb = torch.randn(1, 9, 16, dtype=DT), torch.randn(1, 9, 16, dtype=DT)
    with torch.no_grad():
        ya = [m(xa[:, :5], cache=paged.batch([a]), is_causal=True)]    # a: 5-token prefill
        yb = [m(xb[:, :2], cache=paged.batch([b]), is_causal=True)]    # b: 2-token prefill
        ya.append(m(xa[:, 5:7], cache=paged.batch([a]), is_causal=True))
        for t in range(2):                                            # decode both together
            y = m(torch.cat([xa[:, 7 + t: 8 + t], xb[:, 2 + t: 3 + t]]),
                  cache=paged.batch([a, b]), is_causal=True)
            ya.append(y[:1])
            yb.append(y[1:])
        for x, ys, n in ((xa, ya, 9), (xb, yb, 4)):
            kv = ak.KVCache()
            want = torch.cat([m(x[:, :n - 2], cache=kv, is_causal=True),
                              m(x[:, n - 2: n - 1], cache=kv, is_causal=True),
                              m(x[:, n - 1: n], cache=kv, is_causal=True)], 1)
            torch.testing.assert_close(torch.cat(ys, 1), want, rtol=1e-10, atol=1e-10)
            full = m(x[:, :n], is_causal=True)
            torch.testing.assert_close(torch.cat(ys, 1), full, rtol=1e-10, atol=1e-10)
    assert paged.length(a) == 9 and paged.length(b) == 4
    other = ak.MultiHeadAttention(16, 4, n_kv_heads=2).to(DT)
    with pytest.raises(ValueError, match="belongs to another layer"):
        other(xa[:, :1], cache=paged.batch([a]), is_causal=True)
    with pytest.raises(NotImplementedError, match="need_weights"):
        m(xa[:, :1], cache=paged.batch([a]), is_causal=True, need_weights=True)
    assert paged.length(a) == 9                                       # refused calls: no write


def test_a_failed_cache_attention_call_writes_nothing():
    cache = ak.PagedKVCache(8, 2, 2, 4, dtype=DT)
    s = cache.new_sequence()
    cache.append(s, *_kv(3, 2, 4))
    pool_k, pool_v = cache.k_pages.clone(), cache.v_pages.clone()
    with pytest.raises(ValueError, match="multiple of"):
        cache.attention([s], torch.randn(1, 1, 3, 4, dtype=DT), torch.randn(1, 1, 2, 4, dtype=DT),
                        torch.randn(1, 1, 2, 4, dtype=DT))
    assert cache.length(s) == 3
    assert torch.equal(cache.k_pages, pool_k) and torch.equal(cache.v_pages, pool_v)


def test_pickle_round_trip_keeps_pages_and_tables():
    import pickle

    cache = ak.PagedKVCache(6, 2, 1, 2, dtype=DT)
    a = cache.new_sequence()
    cache.append(a, *_kv(3, 1, 2))
    b = cache.fork(a)
    back = pickle.loads(pickle.dumps(cache))
    assert back.pages(b) == cache.pages(b) and back.refcount(cache.pages(a)[0]) == 2
    assert torch.equal(back.gather(a)[0], cache.gather(a)[0])
    from attnkit.layers.paged import pool_owner
    assert pool_owner(back.k_pages) is back


def test_reused_gather_workspace_never_leaks_stale_keys(monkeypatch: pytest.MonkeyPatch):
    """Decode steps on the gather path (no native kernel: it reads pages in place and needs
    no workspace) reuse the cache's workspace: a short row after a long one sees only its
    own keys (the stale tail is masked), and the workspace can be released."""
    monkeypatch.setenv("ATTNKIT_NATIVE", "0")
    cache = ak.PagedKVCache(32, 3, 2, 4, dtype=DT)
    a, b, c = cache.new_sequence(), cache.new_sequence(), cache.new_sequence()
    cache.append(a, *_kv(20, 2, 4))
    cache.append(b, *_kv(3, 2, 4))
    cache.append(c, *_kv(1, 2, 4))
    for seqs in ([a, b], [c, b], [b, c], [c]):
        q = torch.randn(len(seqs), 1, 4, 4, dtype=DT)
        out = cache.attention(seqs, q)
        for i, s in enumerate(seqs):
            kk, vv = cache.gather(s)
            want = ak.attention(q[i].transpose(0, 1)[None], kk.transpose(0, 1)[None],
                                vv.transpose(0, 1)[None], backend="reference")
            torch.testing.assert_close(out[i], want[0].transpose(0, 1), rtol=1e-10,
                                       atol=1e-10)
    assert cache._workspace
    cache.release_workspace()
    assert not cache._workspace
