"""attention_with_kvcache / attention_varlen (flash-attn's calls) against the float64
reference on the gathered contiguous equivalent: paged and contiguous caches, awkward page
sizes, pages in random pool order, sequences of length 0 and 1, new tokens across page
boundaries, GQA, causal / window / softcap / ALiBi, fp32 / bf16 / fp16; bad block tables
refused with the pool unchanged."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from helpers.oracle import oracle
from helpers.tolerance import assert_low_precision_close

DT = torch.float64


def _reference(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, slopes=None,
               scale=None, dtype=DT):
    """One sequence by the formula: q (N_q, H_q, D), k (N_k, H_kv, D) → out (N_q, H_q, D_v),
    lse (H_q, N_q); bottom-right causal / window, ALiBi −slope·|i + N_k − N_q − j|."""
    n_q, n_k = q.shape[0], k.shape[0]
    i = torch.arange(n_q)[:, None]
    j = torch.arange(n_k)[None, :]
    off = n_k - n_q
    left, right = window[0], 0 if causal else window[1]
    allowed = torch.ones(n_q, n_k, dtype=torch.bool)
    if left >= 0:
        allowed &= j >= i + off - left
    if right >= 0:
        allowed &= j <= i + off + right
    bias = None
    if slopes is not None:
        bias = -slopes.to(DT)[:, None, None] * (i + off - j).abs().to(DT)    # (H_q, N_q, N_k)
    out, lse, _ = oracle(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                         allowed=allowed, bias=bias, scale=scale,
                         softcap=softcap or None, dtype=dtype)
    return out.transpose(0, 1), lse


def _paged(lengths, block_size, h_kv, d, d_v, dtype, extra_pages=3, spare=0):
    """Random pools and a block table whose pages are in random pool order; row b holds
    ``lengths[b] + spare`` tokens' worth of pages. → (k_pages, v_pages, table, contiguous
    k list, v list) — the contiguous lists are the first lengths[b] tokens of each row."""
    need = [-(-(n + spare) // block_size) for n in lengths]
    n_blocks = sum(need) + extra_pages
    k_pages = torch.randn(n_blocks, block_size, h_kv, d, dtype=dtype)
    v_pages = torch.randn(n_blocks, block_size, h_kv, d_v, dtype=dtype)
    perm = torch.randperm(n_blocks).tolist()
    width = max([1, *need])
    table = torch.full((len(lengths), width), -1, dtype=torch.int32)
    at = 0
    ks, vs = [], []
    for b, n in enumerate(lengths):
        pages = perm[at: at + need[b]]
        at += need[b]
        table[b, : need[b]] = torch.tensor(pages, dtype=torch.int32)
        idx = torch.tensor(pages, dtype=torch.long)
        ks.append(k_pages[idx].flatten(0, 1)[:n].clone())
        vs.append(v_pages[idx].flatten(0, 1)[:n].clone())
    return k_pages, v_pages, table, ks, vs


OPTIONS = [
    {},
    {"causal": True},
    {"window_size": (2, 1)},
    {"causal": True, "window_size": (3, -1)},
    {"softcap": 5.0, "softmax_scale": 0.7},
    {"alibi": True},
    {"alibi": True, "causal": True, "softcap": 3.0},
]


def _opts(o, h_q, batch):
    o = dict(o)
    slopes = None
    if o.pop("alibi", False):
        slopes = torch.rand(batch, h_q, dtype=torch.float32) * 0.5
        o["alibi_slopes"] = slopes
    ref = {"causal": o.get("causal", False), "window": o.get("window_size", (-1, -1)),
           "softcap": o.get("softcap", 0.0), "scale": o.get("softmax_scale")}
    return o, ref, slopes


@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(o) or "plain")
@pytest.mark.parametrize("n_q,n_new", [(1, 1), (3, 2), (4, 0)])
def test_paged_matches_reference_on_gathered_keys(block_size, opts, n_q, n_new):
    lengths = [0, 1, 7, 20]                    # cached before the new tokens
    h_q, h_kv, d, d_v = 4, 2, 8, 5
    batch = len(lengths)
    k_pages, v_pages, table, ks, vs = _paged(lengths, block_size, h_kv, d, d_v, DT,
                                             spare=n_new)
    q = torch.randn(batch, n_q, h_q, d, dtype=DT)
    k_new = torch.randn(batch, n_new, h_kv, d, dtype=DT)
    v_new = torch.randn(batch, n_new, h_kv, d_v, dtype=DT)
    kw, ref, slopes = _opts(opts, h_q, batch)
    out, lse = ak.attention_with_kvcache(
        q, k_pages, v_pages, k_new if n_new else None, v_new if n_new else None,
        cache_seqlens=torch.tensor(lengths, dtype=torch.int32), block_table=table,
        return_softmax_lse=True, **kw)
    assert out.shape == (batch, n_q, h_q, d_v) and lse.shape == (batch, h_q, n_q)
    for b in range(batch):
        kk, vv = torch.cat([ks[b], k_new[b]]), torch.cat([vs[b], v_new[b]])
        want, want_lse = _reference(q[b], kk, vv, slopes=None if slopes is None else slopes[b],
                                    **ref)
        torch.testing.assert_close(out[b], want, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(lse[b], want_lse.to(lse.dtype), rtol=1e-10, atol=1e-10)
        # the new tokens were written in place through the block table
        idx = table[b, : -(-(lengths[b] + n_new) // block_size)].long()
        got_k = k_pages[idx].flatten(0, 1)[: lengths[b] + n_new]
        assert torch.equal(got_k, kk)


@pytest.mark.parametrize("dtype", [DT, torch.bfloat16])
def test_new_tokens_written_into_pools_whose_slots_are_not_one_dim(dtype):
    # pools viewed from (block_size, num_blocks, H_kv, D) storage: a page's slots are not
    # one run of memory, so the new K and V rows go in by page and slot (not index_copy_);
    # both pools written, and the output is the reference's on the gathered keys
    lengths, n_new, bs, h_q, h_kv, d, d_v = [0, 4, 9], 3, 5, 4, 2, 8, 6
    k_pages, v_pages, table, ks, vs = _paged(lengths, bs, h_kv, d, d_v, dtype, spare=n_new)
    k_view = k_pages.transpose(0, 1).contiguous().transpose(0, 1)
    v_view = v_pages.transpose(0, 1).contiguous().transpose(0, 1)
    assert k_view.stride(0) != bs * k_view.stride(1)
    q = torch.randn(3, 1, h_q, d, dtype=DT).to(dtype)
    k_new = torch.randn(3, n_new, h_kv, d, dtype=DT).to(dtype)
    v_new = torch.randn(3, n_new, h_kv, d_v, dtype=DT).to(dtype)
    out = ak.attention_with_kvcache(q, k_view, v_view, k_new, v_new, causal=True,
                                    cache_seqlens=torch.tensor(lengths), block_table=table)
    for b, n in enumerate(lengths):
        idx = table[b, : -(-(n + n_new) // bs)].long()
        kk, vv = torch.cat([ks[b], k_new[b]]), torch.cat([vs[b], v_new[b]])
        assert torch.equal(k_view[idx].flatten(0, 1)[: n + n_new], kk)
        assert torch.equal(v_view[idx].flatten(0, 1)[: n + n_new], vv)
        want, _ = _reference(q[b].to(DT), kk.to(DT), vv.to(DT), causal=True)
        if dtype == DT:
            torch.testing.assert_close(out[b], want, rtol=1e-10, atol=1e-10)
        else:
            low, _ = _reference(q[b], kk, vv, causal=True, dtype=dtype)
            assert_low_precision_close(out[b], low, want, what=f"written pools, row {b}")


@pytest.mark.parametrize("opts", OPTIONS[:4] + OPTIONS[5:6], ids=lambda o: ",".join(o) or "plain")
def test_contiguous_cache_matches_reference_and_is_written_in_place(opts):
    lengths = [0, 1, 9]
    h_q, h_kv, d = 6, 3, 8
    batch, n_q, n_new, n_cache = 3, 2, 2, 12
    k_cache = torch.randn(batch, n_cache, h_kv, d, dtype=DT)
    v_cache = torch.randn(batch, n_cache, h_kv, d, dtype=DT)
    q = torch.randn(batch, n_q, h_q, d, dtype=DT)
    k_new = torch.randn(batch, n_new, h_kv, d, dtype=DT)
    v_new = torch.randn(batch, n_new, h_kv, d, dtype=DT)
    before = k_cache.clone()
    kw, ref, slopes = _opts(opts, h_q, batch)
    out = ak.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                    cache_seqlens=torch.tensor(lengths), **kw)
    for b, n in enumerate(lengths):
        assert torch.equal(k_cache[b, n: n + n_new], k_new[b])
        assert torch.equal(k_cache[b, n + n_new:], before[b, n + n_new:])   # rest untouched
        want, _ = _reference(q[b], k_cache[b, : n + n_new], v_cache[b, : n + n_new],
                             slopes=None if slopes is None else slopes[b], **ref)
        torch.testing.assert_close(out[b], want, rtol=1e-10, atol=1e-10)


def test_cache_seqlens_none_and_int():
    k_cache = torch.randn(2, 6, 1, 4, dtype=DT)
    v_cache = torch.randn(2, 6, 1, 4, dtype=DT)
    q = torch.randn(2, 1, 2, 4, dtype=DT)
    full = ak.attention_with_kvcache(q, k_cache, v_cache)                  # all 6 keys
    as_int = ak.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=6)
    torch.testing.assert_close(full, as_int, rtol=0, atol=0)
    for b in range(2):
        want, _ = _reference(q[b], k_cache[b], v_cache[b])
        torch.testing.assert_close(full[b], want, rtol=1e-10, atol=1e-10)


def test_empty_sequence_gives_zero_and_lse_minus_inf():
    k_pages, v_pages, table, _, _ = _paged([0, 3], 2, 1, 4, 4, DT)
    q = torch.randn(2, 2, 2, 4, dtype=DT)
    out, lse = ak.attention_with_kvcache(q, k_pages, v_pages, cache_seqlens=torch.tensor([0, 3]),
                                         block_table=table, causal=True,
                                         return_softmax_lse=True)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert (lse[0] == -math.inf).all() and torch.isfinite(lse[1]).all()


@pytest.mark.parametrize("paged", [True, False])
def test_an_empty_batch_with_new_tokens_is_empty(paged):
    # B = 0 with k, v given (an idle step of a server loop): nothing written, empty results
    pool = torch.randn(4, 2, 1, 4, dtype=DT) if paged else torch.randn(0, 5, 1, 4, dtype=DT)
    before = pool.clone()
    kn = torch.randn(0, 1, 1, 4, dtype=DT)
    out, lse = ak.attention_with_kvcache(
        torch.randn(0, 1, 1, 4, dtype=DT), pool, pool, kn, kn.clone(),
        cache_seqlens=torch.zeros(0, dtype=torch.int32), return_softmax_lse=True,
        block_table=torch.zeros(0, 1, dtype=torch.int32) if paged else None)
    assert out.shape == (0, 1, 1, 4) and lse.shape == (0, 1, 1) and torch.equal(pool, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("opts", [{"causal": True}, {"softcap": 4.0, "window_size": (5, 0)},
                                  {"alibi": True, "causal": True}],
                         ids=lambda o: ",".join(o))
def test_low_precision_within_twice_the_naive_error(dtype, opts):
    lengths = [1, 40, 97]
    h_q, h_kv, d = 8, 2, 16
    batch, n_q, n_new = 3, 3, 3
    k64, v64, table, ks, vs = _paged(lengths, 16, h_kv, d, d, DT, spare=n_new)
    q64 = torch.randn(batch, n_q, h_q, d, dtype=DT)
    kn64 = torch.randn(batch, n_new, h_kv, d, dtype=DT)
    vn64 = torch.randn(batch, n_new, h_kv, d, dtype=DT)
    lo = [t.to(dtype) for t in (k64, v64, q64, kn64, vn64)]
    kw, ref, slopes = _opts(opts, h_q, batch)
    out = ak.attention_with_kvcache(lo[2], lo[0], lo[1], lo[3], lo[4],
                                    cache_seqlens=torch.tensor(lengths), block_table=table, **kw)
    assert out.dtype == dtype
    for b in range(batch):
        # the reference sees the same low-precision values, in float64 and naively in dtype
        kk = torch.cat([ks[b].to(dtype), lo[3][b]])
        vv = torch.cat([vs[b].to(dtype), lo[4][b]])
        sl = None if slopes is None else slopes[b]
        want64, _ = _reference(lo[2][b].double(), kk.double(), vv.double(), slopes=sl, **ref)
        naive, _ = _reference(lo[2][b], kk, vv, slopes=sl, dtype=dtype, **ref)
        assert_low_precision_close(out[b], naive, want64, what=f"paged {dtype} row {b}")


@pytest.mark.parametrize("paged", [True, False])
@pytest.mark.parametrize("opts", [{"causal": True}, {"window_size": (4, 2)},
                                  {"alibi": True, "causal": True, "softcap": 2.0}],
                         ids=lambda o: ",".join(o))
def test_varlen_mixed_prefill_chunks_and_decodes(paged, opts):
    """Ragged batch: a prefill chunk over an existing prefix, two single-token decodes, a new
    prompt, and an empty sequence — one call."""
    len_q = [5, 1, 1, 8, 0]
    len_k = [12, 30, 1, 8, 0]
    h_q, h_kv, d = 4, 1, 8
    batch = len(len_q)
    cu_q = torch.tensor([0, *torch.tensor(len_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(len_k).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), h_q, d, dtype=DT)
    if paged:
        k, v, table, ks, vs = _paged(len_k, 3, h_kv, d, d, DT)
    else:
        ks = [torch.randn(n, h_kv, d, dtype=DT) for n in len_k]
        vs = [torch.randn(n, h_kv, d, dtype=DT) for n in len_k]
        k, v, table = torch.cat(ks), torch.cat(vs), None
    kw, ref, slopes = _opts(opts, h_q, batch)
    out, lse = ak.attention_varlen(q, k, v, cu_q, cu_k, max(len_q), max(len_k),
                                   block_table=table, return_softmax_lse=True, **kw)
    assert out.shape == (q.shape[0], h_q, d) and lse.shape == (h_q, q.shape[0])
    for b in range(batch):
        s, e = int(cu_q[b]), int(cu_q[b + 1])
        want, want_lse = _reference(q[s:e], ks[b], vs[b],
                                    slopes=None if slopes is None else slopes[b], **ref)
        torch.testing.assert_close(out[s:e], want, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(lse[:, s:e], want_lse, rtol=1e-10, atol=1e-10)


def test_cache_attention_varlen_style_batch_equals_each_sequence_alone():
    """PagedKVCache.attention over several sequences at different lengths at once equals
    each sequence's own call (the block table is read per sequence)."""
    cache = ak.PagedKVCache(32, 4, 2, 8, dtype=DT)
    seqs = [cache.new_sequence() for _ in range(3)]
    for s, n in zip(seqs, [3, 9, 14], strict=True):
        cache.append(s, torch.randn(n, 2, 8, dtype=DT), torch.randn(n, 2, 8, dtype=DT))
    q = torch.randn(3, 1, 4, 8, dtype=DT)
    kn, vn = torch.randn(3, 1, 2, 8, dtype=DT), torch.randn(3, 1, 2, 8, dtype=DT)
    out = cache.attention(seqs, q, kn, vn, causal=True)
    for b, s in enumerate(seqs):
        kk, vv = cache.gather(s)
        want, _ = _reference(q[b], kk, vv, causal=True)
        torch.testing.assert_close(out[b], want, rtol=1e-10, atol=1e-10)


# --------------------------------------------------------------------------- bad input
def _bad_call_setup():
    k_pages, v_pages, table, _, _ = _paged([5, 4], 3, 1, 4, 4, DT, extra_pages=2, spare=1)
    q = torch.randn(2, 1, 1, 4, dtype=DT)
    kn, vn = torch.randn(2, 1, 1, 4, dtype=DT), torch.randn(2, 1, 1, 4, dtype=DT)
    return k_pages, v_pages, table, q, kn, vn


def _assert_refused(k_pages, v_pages, match, *args, **kw):
    k0, v0 = k_pages.clone(), v_pages.clone()
    with pytest.raises(ValueError, match=match):
        ak.attention_with_kvcache(*args, **kw)
    assert torch.equal(k_pages, k0) and torch.equal(v_pages, v0)     # nothing overwritten


def test_block_table_entry_out_of_range_is_refused_before_any_write():
    k_pages, v_pages, table, q, kn, vn = _bad_call_setup()
    table[1, 0] = k_pages.shape[0]
    _assert_refused(k_pages, v_pages, r"block_table\[1, 0\] = \d+ is out of range", q,
                    k_pages, v_pages, kn, vn, cache_seqlens=torch.tensor([5, 4]),
                    block_table=table)


def test_sequence_longer_than_its_pages_is_refused():
    k_pages, v_pages, table, q, kn, vn = _bad_call_setup()
    # row 1 has pages for 5 tokens (2 pages of 3) and is asked to hold 6 + 1
    _assert_refused(k_pages, v_pages, "longer than its pages", q, k_pages, v_pages, kn, vn,
                    cache_seqlens=torch.tensor([5, 6]), block_table=table)
    table[1, 1] = -1
    _assert_refused(k_pages, v_pages, "-1 is padding", q, k_pages, v_pages, kn, vn,
                    cache_seqlens=torch.tensor([5, 4]), block_table=table)
    k_cache = torch.randn(2, 4, 1, 4, dtype=DT)
    _assert_refused(k_cache, k_cache, "longer than its cache", q, k_cache, k_cache.clone(),
                    kn, vn, cache_seqlens=torch.tensor([3, 4]))


def test_page_used_by_two_sequences_without_fork_is_refused():
    k_pages, v_pages, table, q, kn, vn = _bad_call_setup()
    table[1, 1] = table[0, 1]              # row 1 writes into row 0's last page
    _assert_refused(k_pages, v_pages, "used by two sequences without a fork", q, k_pages,
                    v_pages, kn, vn, cache_seqlens=torch.tensor([5, 4]), block_table=table)
    table[0, 0] = table[0, 1]              # one row listing a page twice
    _assert_refused(k_pages, v_pages, "lists page .* twice", q, k_pages, v_pages,
                    cache_seqlens=torch.tensor([5, 4]), block_table=table)


def test_page_written_by_one_row_and_only_read_by_another_is_refused():
    k_pages, v_pages, table, q, kn, vn = _bad_call_setup()
    table[1, 0] = table[0, 1]              # row 1 reads (before its new token) what row 0 writes
    _assert_refused(k_pages, v_pages, "used by two sequences without a fork", q, k_pages,
                    v_pages, kn, vn, cache_seqlens=torch.tensor([5, 4]), block_table=table)


def test_entries_past_a_rows_pages_are_not_checked():
    # a page listed again, -1 and out-of-range entries past the pages a row's length needs
    # are padding: the call runs, equal to the one on the narrow table
    k_pages, v_pages, table, q, kn, vn = _bad_call_setup()
    pad = torch.tensor([[table[0, 0], k_pages.shape[0]], [-1, table[1, 1]]], dtype=table.dtype)
    wide = torch.cat([table, pad], dim=1)
    want = ak.attention_with_kvcache(q, k_pages.clone(), v_pages.clone(), kn, vn,
                                     cache_seqlens=torch.tensor([5, 4]), block_table=table)
    got = ak.attention_with_kvcache(q, k_pages, v_pages, kn, vn,
                                    cache_seqlens=torch.tensor([5, 4]), block_table=wide)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_table_changed_in_place_after_passing_is_checked_again():
    # a call that passed is remembered by the table's bytes: the same tensor changed in place
    # (through a numpy view too, which torch's version counter does not see) is refused
    k_pages, v_pages, table, q, kn, vn = _bad_call_setup()
    kw = dict(cache_seqlens=torch.tensor([5, 4]), block_table=table)
    ak.attention_with_kvcache(q, k_pages, v_pages, kn, vn, **kw)
    good = table.clone()
    table.numpy()[1, 1] = int(table[0, 1])         # row 1 writes into row 0's last page
    _assert_refused(k_pages, v_pages, "used by two sequences without a fork", q, k_pages,
                    v_pages, kn, vn, **kw)
    table.copy_(good)
    ak.attention_with_kvcache(q, k_pages, v_pages, kn, vn, **kw)
    table[1, 0] = k_pages.shape[0]
    _assert_refused(k_pages, v_pages, r"block_table\[1, 0\] = \d+ is out of range", q,
                    k_pages, v_pages, kn, vn, **kw)
    table.copy_(good)                               # the same bytes, more pages read
    _assert_refused(k_pages, v_pages, "longer than its pages", q, k_pages, v_pages, kn, vn,
                    cache_seqlens=torch.tensor([5, 6]), block_table=table)
    table[1, 1] = -1                                # reads only (no write): 1 page, then 2
    ak.attention_with_kvcache(q, k_pages, v_pages, cache_seqlens=torch.tensor([5, 3]),
                              block_table=table)
    _assert_refused(k_pages, v_pages, "-1 is padding", q, k_pages, v_pages,
                    cache_seqlens=torch.tensor([5, 4]), block_table=table)


def test_a_repeated_table_is_checked_once(monkeypatch):
    # the block-table check runs once per (table, pages read, first page written): a step
    # over the same pages again skips it; a step that reaches another page checks again
    import attnkit.serving as serving

    k_pages, v_pages, table, q, kn, vn = _bad_call_setup()
    checks = []
    real = serving._pages_ok
    monkeypatch.setattr(serving, "_pages_ok", lambda *a: checks.append(1) or real(*a))
    serving._CHECKED.clear()
    # pages of 3: row 0 with 3 + 1 tokens reads 2 pages, writes into page 1; with 2 + 1
    # it reads 1, writes into page 0; with 5 + 1 it reads and writes as with 3 + 1
    for lens in ([3, 4], [3, 4], [2, 4], [5, 4]):
        ak.attention_with_kvcache(q, k_pages, v_pages, kn, vn,
                                  cache_seqlens=torch.tensor(lens), block_table=table)
    assert len(checks) == 2 and len(serving._CHECKED) == 2
    for n in range(20):                             # other tables: at most 8 kept
        wide = torch.cat([table, torch.full((2, n + 1), -1, dtype=table.dtype)], dim=1)
        ak.attention_with_kvcache(q, k_pages, v_pages, cache_seqlens=torch.tensor([3, 4]),
                                  block_table=wide)
        assert 1 <= len(serving._CHECKED) <= serving._CHECKED_MAX
    monkeypatch.setattr(serving, "_CHECKED_ENTRIES", table.numel() - 1)
    serving._CHECKED.clear()                        # a table over the size kept: checked
    for _ in range(2):                              # every call
        ak.attention_with_kvcache(q, k_pages, v_pages, cache_seqlens=torch.tensor([3, 4]),
                                  block_table=table)
    assert len(checks) == 2 + 20 + 2 and not serving._CHECKED


def test_cascade_steps_over_one_table_with_other_query_counts_equal_the_reference():
    # the native call's layout is kept for the next step over the same pages: a step with
    # another number of queries per row (the same pages) must not reuse it
    cache, seqs = _forked_batch(DT, n_new=0)
    table = cache.block_table(seqs)
    for n_q in (1, 2, 1, 3):
        lens = cache.seqlens(seqs)
        q = torch.randn(len(seqs), n_q, 4, 8, dtype=DT)
        out = ak.attention_with_kvcache(q, cache.k_pages, cache.v_pages, cache_seqlens=lens,
                                        block_table=table, causal=True)
        for b, s in enumerate(seqs):
            kk, vv = cache.gather(s)
            want, _ = _reference(q[b], kk, vv, causal=True)
            torch.testing.assert_close(out[b], want, rtol=1e-10, atol=1e-10)


def test_forks_with_more_queries_than_keys_share_no_prefix():
    # causal varlen rows over forked pages whose first queries see no key at all: no prefix
    # every query sees (was a prefix of -2 pages, refused by the kernel), each row as alone
    cache = ak.PagedKVCache(16, 1, 1, 4, dtype=DT)
    root = cache.new_sequence()
    cache.append(root, torch.randn(2, 1, 4, dtype=DT), torch.randn(2, 1, 4, dtype=DT))
    seqs = [root, cache.fork(root)]
    q = torch.randn(10, 1, 4, dtype=DT)
    out = ak.attention_varlen(q, cache.k_pages, cache.v_pages, [0, 5, 10], [0, 2, 4],
                              block_table=cache.block_table(seqs), causal=True)
    kk, vv = cache.gather(root)
    for b in range(2):
        want, _ = _reference(q[5 * b: 5 * b + 5], kk, vv, causal=True)
        torch.testing.assert_close(out[5 * b: 5 * b + 5], want, rtol=1e-10, atol=1e-10)


def test_paged_cache_state_changes_after_a_passed_table_are_seen():
    # check_block_table remembers a passed table until the refcounts change: a free, a fork
    # or a truncate after it makes the same table's next call checked (and refused) again
    cache = ak.PagedKVCache(8, 2, 1, 4, dtype=DT)
    a, b = cache.new_sequence(), cache.new_sequence()
    for s in (a, b):
        cache.append(s, torch.randn(3, 1, 4, dtype=DT), torch.randn(3, 1, 4, dtype=DT))
    q = torch.randn(1, 1, 1, 4, dtype=DT)
    kn = torch.randn(1, 1, 1, 4, dtype=DT)
    tb = cache.block_table([b])
    ak.attention_with_kvcache(q, cache.k_pages, cache.v_pages, cache_seqlens=torch.tensor([3]),
                              block_table=tb)
    cache.free(b)
    _assert_refused(cache.k_pages, cache.v_pages, "which is free", q, cache.k_pages,
                    cache.v_pages, cache_seqlens=torch.tensor([3]), block_table=tb)
    ta = cache.block_table([a])                     # a writes its 4th token into page 1
    cache.reserve([a], 1)
    ak.attention_with_kvcache(q, cache.k_pages, cache.v_pages, kn, kn.clone(),
                              cache_seqlens=torch.tensor([3]), block_table=ta)
    c = cache.fork(a)                               # page 1 is shared now
    _assert_refused(cache.k_pages, cache.v_pages, "sequences share", q, cache.k_pages,
                    cache.v_pages, kn, kn.clone(), cache_seqlens=torch.tensor([3]),
                    block_table=ta)
    both = cache.block_table([a, c])                # read by both: fine while shared
    ak.attention_with_kvcache(q.expand(2, -1, -1, -1), cache.k_pages, cache.v_pages,
                              cache_seqlens=torch.tensor([3, 3]), block_table=both)
    cache.reserve([c], 1)                           # c copies page 1: a holds it alone
    _assert_refused(cache.k_pages, cache.v_pages, "must come from cache.fork",
                    q.expand(2, -1, -1, -1), cache.k_pages, cache.v_pages,
                    cache_seqlens=torch.tensor([3, 3]), block_table=both)
    cache.free(c)
    ak.attention_with_kvcache(q, cache.k_pages, cache.v_pages, kn, kn.clone(),
                              cache_seqlens=torch.tensor([3]), block_table=ta)
    tf = ta.clone()                                 # the same tensor changed in place
    ak.attention_with_kvcache(q, cache.k_pages, cache.v_pages, cache_seqlens=torch.tensor([3]),
                              block_table=tf)
    tf.numpy()[0, 0] = tb[0, 0]                     # one of b's freed pages
    _assert_refused(cache.k_pages, cache.v_pages, "which is free", q, cache.k_pages,
                    cache.v_pages, cache_seqlens=torch.tensor([3]), block_table=tf)
    cache.truncate(a, 2)                            # page 1 is free again
    _assert_refused(cache.k_pages, cache.v_pages, "which is free", q, cache.k_pages,
                    cache.v_pages, kn, kn.clone(), cache_seqlens=torch.tensor([3]),
                    block_table=ta)


def test_paged_cache_state_errors_freed_page_and_shared_without_fork():
    cache = ak.PagedKVCache(8, 2, 1, 4, dtype=DT)
    a, b = cache.new_sequence(), cache.new_sequence()
    cache.append(a, torch.randn(3, 1, 4, dtype=DT), torch.randn(3, 1, 4, dtype=DT))
    cache.append(b, torch.randn(3, 1, 4, dtype=DT), torch.randn(3, 1, 4, dtype=DT))
    q = torch.randn(1, 1, 1, 4, dtype=DT)
    stale = cache.block_table([b])
    cache.free(b)                                                     # its pages are free now
    _assert_refused(cache.k_pages, cache.v_pages, "which is free", q, cache.k_pages,
                    cache.v_pages, cache_seqlens=torch.tensor([3]), block_table=stale)
    # a's pages listed in two rows (no fork): refused by the cache's refcounts
    two = torch.cat([cache.block_table([a])] * 2)
    _assert_refused(cache.k_pages, cache.v_pages, "must come from cache.fork", q.expand(2, -1,
                    -1, -1), cache.k_pages, cache.v_pages, cache_seqlens=torch.tensor([3, 3]),
                    block_table=two)
    # after a fork, reading both is fine; writing into the shared page raw is refused
    c = cache.fork(a)
    ab = cache.block_table([a, c])
    ak.attention_with_kvcache(q.expand(2, -1, -1, -1), cache.k_pages, cache.v_pages,
                              cache_seqlens=torch.tensor([3, 3]), block_table=ab)
    kn = torch.randn(1, 1, 1, 4, dtype=DT)
    _assert_refused(cache.k_pages, cache.v_pages, "sequences share", q, cache.k_pages,
                    cache.v_pages, kn, kn.clone(), cache_seqlens=torch.tensor([3]),
                    block_table=cache.block_table([c]))


def test_a_check_that_races_a_free_is_not_remembered(monkeypatch):
    """A table check that another thread's free() overtakes (simulated: the free lands
    between the check and its memo) is not remembered: the next call over the freed pages
    is refused, and the racing call itself gets a clear error, not a KeyError."""
    cache = ak.PagedKVCache(8, 2, 1, 4, dtype=torch.float32)
    a, b = cache.new_sequence(), cache.new_sequence()
    for s in (a, b):
        cache.append(s, torch.randn(3, 1, 4), torch.randn(3, 1, 4))
    q = torch.randn(1, 1, 1, 4)
    table = cache.block_table([b])
    real = type(cache)._table_ok
    fired: list[int] = []

    def racing(self, *args):
        held = real(self, *args)
        if not fired:
            fired.append(1)
            self.free(b)                                # "thread B", right now
        return held

    monkeypatch.setattr(type(cache), "_table_ok", racing)
    with pytest.raises(ValueError, match="freed while the call checked it"):
        ak.attention_with_kvcache(q, cache.k_pages, cache.v_pages,
                                  cache_seqlens=torch.tensor([3]), block_table=table)
    monkeypatch.setattr(type(cache), "_table_ok", real)
    before = cache.k_pages.clone()
    with pytest.raises(ValueError, match="which is free"):
        ak.attention_with_kvcache(q, cache.k_pages, cache.v_pages,
                                  cache_seqlens=torch.tensor([3]), block_table=table)
    assert torch.equal(cache.k_pages, before)


def test_paged_cache_refuses_a_table_kept_past_a_free_once_its_pages_are_handed_out():
    # a's table kept past free(a): its pages go to a new sequence n, so every page has a
    # holder again and the refcounts pass it; the row is no live sequence's pages -> refused,
    # before the write that would land in n's tokens
    cache = ak.PagedKVCache(8, 4, 1, 4, dtype=DT)
    a, b = cache.new_sequence(), cache.new_sequence()
    for s, n in ((a, 6), (b, 9)):
        cache.append(s, torch.randn(n, 1, 4, dtype=DT), torch.randn(n, 1, 4, dtype=DT))
    stale, lens = cache.block_table([a, b]), cache.seqlens([a, b])
    q = torch.randn(2, 1, 1, 4, dtype=DT)
    kn = torch.randn(2, 1, 1, 4, dtype=DT)
    ak.attention_with_kvcache(q, cache.k_pages, cache.v_pages, cache_seqlens=lens,
                              block_table=stale)                    # passed (and remembered)
    cache.free(a)
    n = cache.new_sequence()
    cache.append(n, torch.randn(7, 1, 4, dtype=DT), torch.randn(7, 1, 4, dtype=DT))
    assert sorted(cache.pages(n)) == sorted(stale[0, :2].tolist())  # a's pages, n's tokens
    for new in ((), (kn, kn.clone())):
        _assert_refused(cache.k_pages, cache.v_pages, "not the leading pages of any sequence",
                        q, cache.k_pages, cache.v_pages, *new, cache_seqlens=lens,
                        block_table=stale)
    with pytest.raises(ValueError, match="not the leading pages"):
        ak.attention_varlen(q[:, 0], cache.k_pages, cache.v_pages, [0, 1, 2], [0, 6, 15],
                            block_table=stale)
    # a fork's own rows, a prefix of a sequence's pages, and the rebuilt table pass
    f = cache.fork(b)
    ak.attention_varlen(q[:, 0], cache.k_pages, cache.v_pages, [0, 1, 2], [0, 5, 9],
                        block_table=cache.block_table([b, f]))
    ak.attention_with_kvcache(q, cache.k_pages, cache.v_pages, cache_seqlens=torch.tensor(
        [7, 9]), block_table=cache.block_table([n, b]))


def test_paged_cache_refuses_reads_and_writes_past_a_sequences_tokens():
    # flash-attn's habit, lengths kept by hand: a raw write from past the cache's length (a
    # missed commit) would leave slots never written, and a varlen read past it (a missed
    # append) would read them — both refused, every call (a remembered table included)
    cache = ak.PagedKVCache(8, 4, 1, 4, dtype=DT)
    a = cache.new_sequence()
    cache.append(a, torch.randn(5, 1, 4, dtype=DT), torch.randn(5, 1, 4, dtype=DT))
    q, kn = torch.randn(1, 1, 1, 4, dtype=DT), torch.randn(1, 1, 1, 4, dtype=DT)
    cache.reserve([a], 2)
    table = cache.block_table([a])
    ak.attention_with_kvcache(q, cache.k_pages, cache.v_pages, kn, kn.clone(),
                              cache_seqlens=cache.seqlens([a]), block_table=table)  # token 5
    _assert_refused(cache.k_pages, cache.v_pages, "call cache.commit", q, cache.k_pages,
                    cache.v_pages, kn, kn.clone(), cache_seqlens=torch.tensor([6]),
                    block_table=table)                               # no commit of token 5
    with pytest.raises(ValueError, match="reads 6 tokens, but its sequence holds 5"):
        ak.attention_varlen(q[0], cache.k_pages, cache.v_pages, [0, 1], [0, 6],
                            block_table=table)
    cache.commit([a], 1)                                            # now both are fine
    ak.attention_varlen(q[0], cache.k_pages, cache.v_pages, [0, 1], [0, 6], block_table=table)
    ak.attention_with_kvcache(q, cache.k_pages, cache.v_pages, kn, kn.clone(),
                              cache_seqlens=torch.tensor([6]), block_table=table)
    ak.attention_varlen(q[0], cache.k_pages, cache.v_pages, [0, 1], [0, 3], block_table=table)


def test_sdpa_layout_mistakes_name_the_transpose():
    # a port from SDPA code passes (B, H, N, D); where the heads do not fit, the message says
    # flash-attn's layout and the fix; a transposed pool's short rows name its block_size
    k_cache = torch.randn(2, 6, 2, 8, dtype=DT)
    q = torch.randn(2, 1, 4, 8, dtype=DT)
    with pytest.raises(ValueError, match=r"q.transpose\(1, 2\)"):
        ak.attention_with_kvcache(q.transpose(1, 2), k_cache, k_cache)
    kn = torch.randn(2, 2, 1, 8, dtype=DT)                          # (B, H_kv, N_new, D)
    with pytest.raises(ValueError, match=r"k.transpose\(1, 2\)"):
        ak.attention_with_kvcache(q, k_cache, k_cache, kn, kn, cache_seqlens=1)
    pool = torch.randn(6, 4, 2, 8, dtype=DT)                        # (num_blocks, bs, H_kv, D)
    flipped = pool.transpose(1, 2)                                  # vLLM-style (.., H, bs, D)
    table = torch.tensor([[0, 1, -1], [2, 3, -1]], dtype=torch.int32)
    with pytest.raises(ValueError, match="needs block_table="):   # a pool, no table
        ak.attention_with_kvcache(q, pool, pool, cache_seqlens=torch.tensor([6, 6]))
    with pytest.raises(ValueError, match="pages of block_size = 2"):
        ak.attention_with_kvcache(q, flipped, flipped, cache_seqlens=torch.tensor([6, 6]),
                                  block_table=table)


def test_varlen_takes_flash_attns_inference_keywords():
    # flash_attn_varlen_func(..., dropout_p=0.0, deterministic=..., return_attn_probs=False)
    # as inference code writes it runs; what attnkit cannot do is refused, saying so
    q, k, v = torch.randn(5, 2, 8, dtype=DT), torch.randn(7, 1, 8, dtype=DT), torch.randn(
        7, 1, 8, dtype=DT)
    plain = ak.attention_varlen(q, k, v, [0, 2, 5], [0, 3, 7], causal=True)
    out = ak.attention_varlen(q, k, v, [0, 2, 5], [0, 3, 7], 3, 4, dropout_p=0.0,
                              deterministic=True, return_attn_probs=False, causal=True)
    assert torch.equal(out, plain)
    with pytest.raises(NotImplementedError, match="dropout_p.*inference"):
        ak.attention_varlen(q, k, v, [0, 2, 5], [0, 3, 7], dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="return_attn_probs.*attnkit.explain"):
        ak.attention_varlen(q, k, v, [0, 2, 5], [0, 3, 7], return_attn_probs=True)


@pytest.mark.skipif("triton" not in ak.backends.names(), reason="no triton backend")
@pytest.mark.parametrize("paged", [True, False])
def test_a_chosen_engine_that_refuses_after_the_write_leaves_the_cache_as_it_was(
        paged, monkeypatch):
    # triton refuses CPU tensors only inside attention(), after the new tokens are written:
    # the pages (or the contiguous rows) they overwrote are put back before the error
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    k_cache = torch.randn(6, 4, 2, 8, dtype=DT) if paged else torch.randn(2, 9, 2, 8, dtype=DT)
    v_cache = torch.randn_like(k_cache)
    table = {"block_table": torch.tensor([[4, 1], [0, 3]], dtype=torch.int32)} if paged else {}
    q, kn = torch.randn(2, 2, 4, 8, dtype=DT), torch.randn(2, 2, 2, 8, dtype=DT)
    k0, v0 = k_cache.clone(), v_cache.clone()
    for scope in ("call", "use"):
        with pytest.raises(ValueError, match="'triton' cannot run"):
            if scope == "call":
                ak.attention_with_kvcache(q, k_cache, v_cache, kn, kn.clone(),
                                          cache_seqlens=torch.tensor([3, 5]), backend="triton",
                                          **table)
            else:
                with ak.backends.use("triton"):
                    ak.attention_with_kvcache(q, k_cache, v_cache, kn, kn.clone(),
                                              cache_seqlens=torch.tensor([3, 5]), **table)
        assert torch.equal(k_cache, k0) and torch.equal(v_cache, v0)


def test_a_backends_use_scope_chooses_the_engine_of_a_paged_call(monkeypatch):
    # under ak.backends.use("reference") the reference runs, not the native paged kernel
    def refuse(*a, **kw):
        raise AssertionError("the native paged kernel ran inside a use('reference') scope")

    import attnkit.serving as serving
    monkeypatch.setattr(serving._native, "paged_attention", refuse)
    pool = torch.randn(6, 4, 2, 8, dtype=DT)
    table = torch.tensor([[4, 1], [0, 3]], dtype=torch.int32)
    q = torch.randn(2, 1, 4, 8, dtype=DT)
    with ak.backends.use("reference"):
        out = ak.attention_with_kvcache(q, pool, pool, cache_seqlens=torch.tensor([7, 5]),
                                        block_table=table, causal=True)
    for b, n in enumerate((7, 5)):
        kk = pool[table[b].long()].flatten(0, 1)[:n]
        want, _ = _reference(q[b], kk, kk, causal=True)
        torch.testing.assert_close(out[b], want, rtol=1e-10, atol=1e-10)


def test_bad_arguments_are_refused_with_clear_messages():
    k_cache = torch.randn(2, 4, 2, 8)
    q = torch.randn(2, 1, 4, 8)
    with pytest.raises(NotImplementedError, match="rotary_cos"):
        ak.attention_with_kvcache(q, k_cache, k_cache, rotary_cos=torch.ones(4, 4))
    with pytest.raises(ValueError, match="multiple of"):
        ak.attention_with_kvcache(torch.randn(2, 1, 3, 8), k_cache, k_cache)
    with pytest.raises(TypeError, match="share one dtype"):
        ak.attention_with_kvcache(q.double(), k_cache, k_cache)
    with pytest.raises(ValueError, match="window_size"):
        ak.attention_with_kvcache(q, k_cache, k_cache, window_size=(2,))
    with pytest.raises(ValueError, match="alibi_slopes"):
        ak.attention_with_kvcache(q, k_cache, k_cache, alibi_slopes=torch.ones(3))
    with pytest.raises(ValueError, match="give both k and v"):
        ak.attention_with_kvcache(q, k_cache, k_cache, torch.randn(2, 1, 2, 8))
    with pytest.raises(ValueError, match="cache_seqlens"):
        ak.attention_with_kvcache(q, k_cache, k_cache, cache_seqlens=torch.tensor([1.0, 2.0]))
    kn = torch.randn(2, 1, 2, 8)
    before = k_cache.clone()
    for bad, match in (({"backend": "nope"}, "unknown backend"),
                       ({"softmax_scale": math.nan}, "softmax_scale")):
        with pytest.raises(ValueError, match=match):
            ak.attention_with_kvcache(q, k_cache, k_cache, kn, kn, cache_seqlens=1, **bad)
        assert torch.equal(k_cache, before)                  # refused before the write
    with pytest.raises(ValueError, match="new k, v need cache_seqlens"):
        ak.attention_with_kvcache(q, k_cache, k_cache, torch.randn(2, 1, 2, 8),
                                  torch.randn(2, 1, 2, 8))
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0"):
        ak.attention_varlen(torch.randn(3, 4, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8),
                            [1, 3], [0, 3])


# --------------------------------------------------------------------------- shared prefix
def _forked_batch(dtype, block_size=4, prefix=13, own=(0, 1, 6, 9), n_new=1):
    """A PagedKVCache with a prefilled prompt forked into len(own) sequences that each
    append their own tokens, plus one unrelated sequence (last row)."""
    cache = ak.PagedKVCache(64, block_size, 2, 8, dtype=dtype)
    root = cache.new_sequence()
    cache.append(root, torch.randn(prefix, 2, 8).to(dtype), torch.randn(prefix, 2, 8).to(dtype))
    seqs = []
    for n in own:
        s = cache.fork(root)
        if n:
            cache.append(s, torch.randn(n, 2, 8).to(dtype), torch.randn(n, 2, 8).to(dtype))
        seqs.append(s)
    other = cache.new_sequence()
    cache.append(other, torch.randn(7, 2, 8).to(dtype), torch.randn(7, 2, 8).to(dtype))
    seqs.append(other)
    cache.reserve(seqs, n_new)                       # copy-on-write before the raw call
    return cache, seqs


@pytest.mark.parametrize("opts", [{"causal": True}, {}, {"causal": True, "softcap": 2.0},
                                  {"window_size": (-1, 2)}, {"causal": True,
                                                             "window_size": (5, -1)}],
                         ids=lambda o: ",".join(o) or "plain")
@pytest.mark.parametrize("n_q", [1, 3])
def test_shared_prefix_is_attended_once_and_equals_the_reference(opts, n_q, monkeypatch):
    import attnkit.serving as serving

    cache, seqs = _forked_batch(DT, n_new=n_q)
    batch = len(seqs)
    q = torch.randn(batch, n_q, 4, 8, dtype=DT)
    kn, vn = torch.randn(batch, n_q, 2, 8, dtype=DT), torch.randn(batch, n_q, 2, 8, dtype=DT)
    lens, table = cache.seqlens(seqs), cache.block_table(seqs)
    keys_read = []
    real = serving._attend_one

    def counting(q_, k_, v_, **kw):
        keys_read.append(k_.shape[0])
        return real(q_, k_, v_, **kw)

    real_many = serving._attend_single_queries

    def counting_many(qs_, kvs_, ns_, *a, **kw):
        keys_read.extend(ns_)                         # one call for all single-query rows
        return real_many(qs_, kvs_, ns_, *a, **kw)

    real_paged = serving._native.paged_attention

    def counting_paged(q_, kp_, vp_, table_, cu_, kv_lengths, **kw):
        keys_read.extend(kv_lengths)                  # the native call: each sequence's keys
        return real_paged(q_, kp_, vp_, table_, cu_, kv_lengths, **kw)

    monkeypatch.setattr(serving, "_attend_one", counting)
    monkeypatch.setattr(serving, "_attend_single_queries", counting_many)
    monkeypatch.setattr(serving._native, "paged_attention", counting_paged)
    out, lse = ak.attention_with_kvcache(q, cache.k_pages, cache.v_pages, kn, vn,
                                         cache_seqlens=lens, block_table=table,
                                         return_softmax_lse=True, **opts)
    cache.commit(seqs, n_q)
    every_row = sum(cache.length(s) for s in seqs)
    cascade = opts.get("window_size", (-1, -1))[0] == -1
    # the 3 whole prefix pages (12 keys) are read once for the 4 forks, not 4 times
    assert sum(keys_read) == (every_row - 3 * 12 if cascade else every_row)
    _, ref, _ = _opts(opts, 4, batch)
    for b, s in enumerate(seqs):
        kk, vv = cache.gather(s)
        want, want_lse = _reference(q[b], kk, vv, **ref)
        torch.testing.assert_close(out[b], want, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(lse[b], want_lse, rtol=1e-10, atol=1e-10)
    # the prefix pages are still shared (the raw call wrote only into each row's own page)
    assert len({cache.pages(s)[0] for s in seqs[:-1]}) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_shared_prefix_in_low_precision(dtype):
    cache, seqs = _forked_batch(dtype, block_size=16, prefix=70, own=(1, 30, 2))
    batch = len(seqs)
    q = torch.randn(batch, 1, 4, 8).to(dtype)
    kn, vn = torch.randn(batch, 1, 2, 8).to(dtype), torch.randn(batch, 1, 2, 8).to(dtype)
    out = ak.attention_with_kvcache(q, cache.k_pages, cache.v_pages, kn, vn,
                                    cache_seqlens=cache.seqlens(seqs),
                                    block_table=cache.block_table(seqs), causal=True)
    cache.commit(seqs, 1)
    for b, s in enumerate(seqs):
        kk, vv = cache.gather(s)
        want64, _ = _reference(q[b].double(), kk.double(), vv.double(), causal=True)
        naive, _ = _reference(q[b], kk, vv, causal=True, dtype=dtype)
        assert_low_precision_close(out[b], naive, want64, what=f"cascade {dtype} row {b}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["gemm", "emulate"])
def test_shared_prefix_on_the_gemm_loop_in_low_precision(dtype, mode, monkeypatch):
    # 9 forks x 2 query heads per K/V head = 18 prefix rows: the prefix part runs on the
    # paged GEMM loop, in T GEMMs on packed tiles (brgemm where this CPU has it, or emulated)
    from helpers.native_checks import hardware_lowp_gemm

    if mode == "gemm" and not hardware_lowp_gemm(dtype):
        pytest.skip(f"no {dtype} GEMMs on this CPU")
    monkeypatch.setenv("ATTNKIT_NATIVE_LOWP_GEMM", "1" if mode == "gemm" else "emulate")
    cache, seqs = _forked_batch(dtype, block_size=16, prefix=200,
                                own=(1, 30, 2, 0, 5, 17, 3, 9, 40))
    batch = len(seqs)
    q = torch.randn(batch, 1, 4, 8).to(dtype)
    kn, vn = torch.randn(batch, 1, 2, 8).to(dtype), torch.randn(batch, 1, 2, 8).to(dtype)
    out = ak.attention_with_kvcache(q, cache.k_pages, cache.v_pages, kn, vn,
                                    cache_seqlens=cache.seqlens(seqs),
                                    block_table=cache.block_table(seqs), causal=True,
                                    softcap=3.0)
    cache.commit(seqs, 1)
    for b, s in enumerate(seqs):
        kk, vv = cache.gather(s)
        want64, _ = _reference(q[b].double(), kk.double(), vv.double(), causal=True,
                               softcap=3.0)
        naive, _ = _reference(q[b], kk, vv, causal=True, softcap=3.0, dtype=dtype)
        assert_low_precision_close(out[b], naive, want64, what=f"cascade {dtype} row {b}")


def test_shared_prefix_of_many_queries_returns_its_own_tensors():
    """Forks sending 70 queries each (280 prefix rows, more than a decode step's): the
    result equals the reference and holds no storage beyond itself (the prefix parts are
    not kept alive behind a view); decode-sized results are views of the kernel's output."""
    cache, seqs = _forked_batch(DT, block_size=8, prefix=16, n_new=70)
    q = torch.randn(len(seqs), 70, 4, 8, dtype=DT)
    kn, vn = torch.randn(len(seqs), 70, 2, 8, dtype=DT), torch.randn(len(seqs), 70, 2, 8, dtype=DT)
    out, lse = ak.attention_with_kvcache(q, cache.k_pages, cache.v_pages, kn, vn,
                                         cache_seqlens=cache.seqlens(seqs),
                                         block_table=cache.block_table(seqs), causal=True,
                                         return_softmax_lse=True)
    assert out.untyped_storage().nbytes() == out.numel() * out.element_size()
    cache.commit(seqs, 70)
    for b, s in enumerate(seqs):
        kk, vv = cache.gather(s)
        want, want_lse = _reference(q[b], kk, vv, causal=True)
        torch.testing.assert_close(out[b], want, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(lse[b], want_lse, rtol=1e-10, atol=1e-10)


def test_varlen_over_forked_pages_uses_the_shared_prefix():
    cache, seqs = _forked_batch(DT, n_new=0)
    len_q = [2, 1, 1, 3, 1]
    lens = cache.seqlens(seqs)
    cu_q = torch.tensor([0, *torch.tensor(len_q).cumsum(0).tolist()])
    cu_k = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
    q = torch.randn(int(cu_q[-1]), 4, 8, dtype=DT)
    got = ak.attention_varlen(q, cache.k_pages, cache.v_pages, cu_q, cu_k,
                              block_table=cache.block_table(seqs), causal=True)
    off = ak.attention_varlen(q, cache.k_pages, cache.v_pages, cu_q, cu_k,
                              block_table=cache.block_table(seqs), causal=True,
                              shared_prefix=False)
    torch.testing.assert_close(got, off, rtol=1e-10, atol=1e-10)
    for b, s in enumerate(seqs):
        kk, vv = cache.gather(s)
        want, _ = _reference(q[int(cu_q[b]): int(cu_q[b + 1])], kk, vv, causal=True)
        torch.testing.assert_close(got[int(cu_q[b]): int(cu_q[b + 1])], want, rtol=1e-10,
                                   atol=1e-10)


@pytest.mark.parametrize("lengths", [[0, 5, 3, 17], [0, 0], [4, 4]])
@pytest.mark.parametrize("paged", [True, False])
def test_single_query_rows_in_one_call_equal_the_reference(lengths, paged):
    """Decoding rows go to the engine together (a padding mask); NaN in the pool past each
    row's keys never reaches the output."""
    h_q, h_kv, d, batch = 4, 2, 8, len(lengths)
    q = torch.randn(batch, 1, h_q, d, dtype=DT)
    if paged:
        k_cache, v_cache, table, ks, vs = _paged(lengths, 3, h_kv, d, d, DT, spare=0)
        used = {p for b, n in enumerate(lengths) for p in table[b, : -(-n // 3)].tolist()}
        for p in range(k_cache.shape[0]):
            if p not in used:
                k_cache[p] = v_cache[p] = math.nan
    else:
        k_cache = torch.full((batch, 20, h_kv, d), math.nan, dtype=DT)
        v_cache = k_cache.clone()
        ks = [torch.randn(n, h_kv, d, dtype=DT) for n in lengths]
        vs = [torch.randn(n, h_kv, d, dtype=DT) for n in lengths]
        for b, n in enumerate(lengths):
            k_cache[b, :n], v_cache[b, :n] = ks[b], vs[b]
        table = None
    out, lse = ak.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor(lengths),
                                         block_table=table, causal=True, softcap=3.0,
                                         return_softmax_lse=True)
    for b in range(batch):
        want, want_lse = _reference(q[b], ks[b], vs[b], causal=True, softcap=3.0)
        torch.testing.assert_close(out[b], want, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(lse[b], want_lse, rtol=1e-10, atol=1e-10)
