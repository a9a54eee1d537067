"""The native kernel's attention through a block table (native.paged_attention, paged.h)
against the float64 reference on the gathered contiguous equivalent: awkward block sizes,
pages in random pool order, sequences of length 0 and 1, chunks whose queries and keys cross
page boundaries, GQA / MQA, causal / window / softcap / ALiBi, key splits merged by LSE,
the dot (decode) and GEMM (chunk) loops, fp64 / fp32 / bf16 / fp16 (the GEMM loop's bf16 /
fp16 GEMMs on packed tiles: emulated on every CPU, brgemm where it runs); NaN in unused pool
pages and past a sequence's length stays out; bad block tables are refused with nothing
written; serving's paged calls take this path (no gathered copy) and fall back without it."""

from __future__ import annotations

import functools

import pytest
import torch

import attnkit as ak
from attnkit.backends import native
from helpers.native_checks import hardware_lowp_gemm
from helpers.oracle import oracle
from helpers.tolerance import assert_low_precision_close

pytestmark = pytest.mark.skipif(not native.available(),
                                reason=f"native kernel unavailable: {native.why_unavailable()}")

DT = torch.float64


def _reference(q, k, v, pos, *, window=(-1, -1), softcap=0.0, slopes=None, scale=None,
               dtype=DT):
    """One sequence by the formula: q (N_q, H_q, D), k (N_k, H_kv, D); query i at position
    pos + i sees key t when pos + i − left <= t <= pos + i + right; ALiBi −slope·|p − t|.
    → out (N_q, H_q, D_v), lse (N_q, H_q)."""
    n_q, n_k = q.shape[0], k.shape[0]
    p = torch.arange(n_q)[:, None] + pos
    t = torch.arange(n_k)[None, :]
    allowed = torch.ones(n_q, n_k, dtype=torch.bool)
    left, right = window
    if left >= 0:
        allowed &= t >= p - left
    if right >= 0:
        allowed &= t <= p + right
    bias = None
    if slopes is not None:
        bias = -slopes.to(DT)[:, None, None] * (p - t).abs().to(DT)         # (H_q, N_q, N_k)
    out, lse, _ = oracle(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                         allowed=allowed, bias=bias, scale=scale, softcap=softcap or None,
                         dtype=dtype)
    return out.transpose(0, 1), lse.transpose(0, 1)


def _assert_rows(out, lse, dtype, what, reference):
    """out / lse of some rows against ``reference(dtype=)`` → (out, lse) by the formula: equal
    to float64 in float64, close in float32, within the low-precision rule in half."""
    want, want_lse = reference()
    if dtype == DT:
        torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(lse, want_lse, rtol=1e-10, atol=1e-10)
    elif dtype == torch.float32:
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    else:
        assert_low_precision_close(out, reference(dtype=dtype)[0], want, what=what)


def _pool(lengths, block_size, h_kv, d, d_v, dtype, *, poison=True):
    """Pools whose pages are in random order, a block table (-1 past each row's pages), each
    row's gathered keys; unused pages and the slots past a row's length hold NaN."""
    need = [-(-n // block_size) for n in lengths]
    n_blocks = sum(need) + 3
    k_pages = torch.randn(n_blocks, block_size, h_kv, d).to(dtype)
    v_pages = torch.randn(n_blocks, block_size, h_kv, d_v).to(dtype)
    perm = torch.randperm(n_blocks).tolist()
    table = torch.full((len(lengths), max(need, default=0) + 1), -1, dtype=torch.int32)
    rows, at = [], 0
    for b in range(len(lengths)):
        rows.append(perm[at: at + need[b]])
        table[b, : need[b]] = torch.tensor(rows[-1], dtype=torch.int32)
        at += need[b]
    if poison:
        for page in perm[at:]:                                 # pages no row holds
            k_pages[page] = float("nan")
            v_pages[page] = float("nan")
        for b, n in enumerate(lengths):                        # slots past the row's length
            if n % block_size:
                k_pages[rows[b][-1], n % block_size:] = float("nan")
                v_pages[rows[b][-1], n % block_size:] = float("nan")
    ks = [k_pages[torch.tensor(r, dtype=torch.long)].flatten(0, 1)[:n]
          for r, n in zip(rows, lengths, strict=True)]
    vs = [v_pages[torch.tensor(r, dtype=torch.long)].flatten(0, 1)[:n]
          for r, n in zip(rows, lengths, strict=True)]
    return k_pages, v_pages, table, ks, vs


OPTIONS = [
    {},
    {"window": (-1, 0)},                                       # causal (bottom-right)
    {"window": (4, 2)},
    {"window": (7, 0), "softcap": 3.0},
    {"softcap": 5.0, "scale": 0.7},
    {"alibi": True},
    {"alibi": True, "window": (-1, 0), "softcap": 2.0},
]
LENGTHS = [0, 1, 37, 150]        # keys per sequence (150: two splits of 128)
N_Q = [2, 1, 20, 3]              # queries: none see a key (0, and 1 causal), a chunk of 20


def _check(dtype, block_size, opts, *, split_len, block_q, h_q=8, h_kv=2, d=16, d_v=24,
           n_q=N_Q, lengths=LENGTHS, q_positions=None):
    k_pages, v_pages, table, ks, vs = _pool(lengths, block_size, h_kv, d, d_v, dtype)
    cu = torch.tensor([0, *torch.tensor(n_q).cumsum(0).tolist()])
    q = torch.randn(int(cu[-1]), h_q, d).to(dtype)
    o = dict(opts)
    slopes = torch.rand(len(lengths), h_q) if o.pop("alibi", False) else None
    pools = (k_pages.clone(), v_pages.clone())
    out, lse = native.paged_attention(q, k_pages, v_pages, table, cu, lengths,
                                      q_positions=q_positions, alibi_slopes=slopes,
                                      split_len=split_len, block_q=block_q, **o)
    assert out.shape == (q.shape[0], h_q, d_v) and out.dtype == dtype
    assert torch.isfinite(out).all(), "NaN from an unused page or slot leaked"
    assert torch.equal(k_pages.nan_to_num(7.0), pools[0].nan_to_num(7.0))    # nothing written
    for b in range(len(lengths)):
        pos = lengths[b] - n_q[b] if q_positions is None else q_positions[b]
        rows = slice(int(cu[b]), int(cu[b + 1]))
        kw = dict(window=o.get("window", (-1, -1)), softcap=o.get("softcap", 0.0),
                  slopes=None if slopes is None else slopes[b], scale=o.get("scale"))
        _assert_rows(out[rows], lse[rows], dtype, f"paged {dtype} seq {b}",
                     functools.partial(_reference, q[rows], ks[b], vs[b], pos, **kw))


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(o) or "plain")
@pytest.mark.parametrize("block_size", [5, 16])
@pytest.mark.parametrize("split_len", [None, 128])
def test_matches_reference_float64(opts, block_size, split_len):
    # block_q 4: the chunk of 20 queries runs as 5 items of G·4 = 16 rows (the GEMM loop)
    _check(DT, block_size, opts, split_len=split_len, block_q=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("opts", [{"window": (-1, 0)}, {"alibi": True, "softcap": 4.0}],
                         ids=lambda o: ",".join(o))
def test_low_precision(dtype, opts):
    _check(dtype, 16, opts, split_len=128, block_q=4, d=32, d_v=32)


@pytest.mark.parametrize("h_q,h_kv", [(4, 4), (6, 1), (8, 2)])
def test_heads_mha_mqa_gqa_and_wide_rows(h_q, h_kv):
    # one long sequence split across items, a single-key one, a chunk of 17 > 16 queries
    _check(DT, 7, {"window": (-1, 0)}, split_len=None, block_q=None, h_q=h_q, h_kv=h_kv,
           d=8, d_v=8, n_q=[17, 1, 1], lengths=[700, 1, 130])


@pytest.mark.parametrize("dtype", [DT, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 3])
def test_decode_heads_together_with_chosen_splits(dtype, threads):
    # decode rows: each (sequence, split)'s H_kv heads run as one task, and the splits chosen
    # on the dot loop are H_kv times shorter (3000 keys: several, merged by LSE); per-head
    # ALiBi slopes tell the heads apart
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check(dtype, 16, {"window": (-1, 0), "softcap": 3.0, "alibi": True}, split_len=None,
               block_q=None, h_q=8, h_kv=4, d=32, d_v=16, n_q=[1, 2, 1],
               lengths=[3000, 1, 517])
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h_q,h_kv", [(8, 4), (6, 2), (8, 2), (10, 2), (7, 1), (16, 2)])
def test_gqa_group_loops_on_decode_rows(dtype, h_q, h_kv):
    # decode / few-query rows of R = G * n_q in 2 .. 8 take the GQA loops (paged.h:
    # group_tile; one K/V row read for all R rows, key-major over the heads): groups 2 .. 8,
    # D_v with a remainder of one vector (40 = 32 + 8), tiles of 128 keys and ragged ends,
    # a window whose P == 0 keys take the exact path, NaN past each length; R = 16 (8 x 2
    # queries) stays on the generic loops
    for opts in ({"window": (-1, 0)}, {"window": (100, 0), "softcap": 4.0}):
        _check(dtype, 16, opts, split_len=None, block_q=None, h_q=h_q, h_kv=h_kv, d=64,
               d_v=40, n_q=[1, 2, 1, 1], lengths=[300, 129, 1, 1000])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("block_size", [5, 13])
@pytest.mark.parametrize("h_q,h_kv,d,d_v", [(8, 2, 128, 128), (6, 1, 59, 111), (4, 4, 32, 40)])
def test_decode_rows_at_awkward_pages_and_dims(dtype, block_size, h_q, h_kv, d, d_v):
    # decode rows (G * n_q < 16) on the dot loops — bf16 with AVX512-BF16 on forward.h's
    # bf16 dot loops (pairs of dims: FMAs, one row by vdpbf16ps), the others on the GQA /
    # generic loops (bf16 K read as pairs on AVX2 / AVX-512 where D_k fits): pages
    # of 5 and 13 (a tile of 128 keys spans pages mid-way), D_k / D_v off the 32-dim chunks
    # (59, 111, 40), lengths 0 and 1, a window whose P == 0 keys skip their V rows, NaN in
    # unused pages and past each length
    for opts in ({"window": (-1, 0)}, {"window": (150, 0), "softcap": 4.0}):
        _check(dtype, block_size, opts, split_len=None, block_q=None, h_q=h_q, h_kv=h_kv,
               d=d, d_v=d_v, n_q=[1, 1, 1, 2, 1], lengths=[0, 1, 517, 260, 129])


@pytest.mark.parametrize("h_q,h_kv,d,d_v", [(8, 8, 64, 64), (16, 8, 64, 64), (6, 2, 128, 40),
                                           (32, 8, 128, 128), (10, 2, 40, 72), (8, 1, 96, 96)])
def test_bf16_decode_equals_float32_on_the_same_values(h_q, h_kv, d, d_v):
    # the bf16 dot loops (R = G = 1, 2, 3, 4, 5, 8 rows per K/V head; Q.Kᵀ on the bf16 pairs —
    # FMAs or vdpbf16ps — or widened where D_k is off the pairs' chunks) against the float32
    # kernel on the same bf16 values: every product is exact, only the float sums' order
    # differs, so the LSE agrees to float rounding and the output to one bf16 rounding (a
    # wrong lane, dim, row or key is off by O(1)); NaN in unused pages and past each length
    lengths = [517, 260, 1, 129]
    k_pages, v_pages, table, _, _ = _pool(lengths, 16, h_kv, d, d_v, torch.bfloat16)
    q = torch.randn(len(lengths), h_q, d).to(torch.bfloat16)
    cu, kl = list(range(len(lengths) + 1)), lengths
    out, lse = native.paged_attention(q, k_pages, v_pages, table, cu, kl)
    out32, lse32 = native.paged_attention(q.float(), k_pages.float(), v_pages.float(), table,
                                          cu, kl)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert ((lse - lse32).abs() <= 1e-5 * (1 + lse32.abs())).all(), (lse - lse32).abs().max()
    ulp = torch.finfo(torch.bfloat16).eps * out32.abs() + 1e-30
    assert ((out.float() - out32).abs() <= ulp * 1.01).all(), (out.float() - out32).abs().max()


def test_explicit_query_positions():
    # every query placed after all keys (a shared prefix's call) sees every key
    _check(DT, 5, {"window": (-1, 0)}, split_len=128, block_q=4, n_q=[3, 16],
           lengths=[12, 300], q_positions=[11, 299])


def test_splits_merge_equals_one_pass():
    k_pages, v_pages, table, _, _ = _pool([1000, 3], 16, 2, 8, 8, DT, poison=False)
    q = torch.randn(2, 4, 8, dtype=DT)
    one = native.paged_attention(q, k_pages, v_pages, table, [0, 1, 2], [1000, 3],
                                 split_len=1024)
    many = native.paged_attention(q, k_pages, v_pages, table, [0, 1, 2], [1000, 3],
                                  split_len=128)
    torch.testing.assert_close(many[0], one[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(many[1], one[1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("entry,match", [(-1, r"block_table\[1, 2\] = -1 is out of range"),
                                         (99, r"block_table\[1, 2\] = 99 is out of range")])
def test_block_table_entry_out_of_range_is_refused(entry, match):
    k_pages, v_pages, table, _, _ = _pool([20, 40], 16, 2, 8, 8, DT, poison=False)
    table[1, 2] = entry
    before = k_pages.clone(), v_pages.clone()
    q = torch.randn(2, 4, 8, dtype=DT)
    with pytest.raises(ValueError, match=match):
        native.paged_attention(q, k_pages, v_pages, table, [0, 1, 2], [20, 40])
    assert torch.equal(k_pages, before[0]) and torch.equal(v_pages, before[1])


def test_bad_lengths_and_table_shape_are_refused():
    k_pages, v_pages, table, _, _ = _pool([20, 40], 16, 2, 8, 8, DT, poison=False)
    q = torch.randn(2, 4, 8, dtype=DT)
    with pytest.raises(ValueError, match="need 4 pages of 16, but its block_table row holds"):
        native.paged_attention(q, k_pages, v_pages, table[:, :3], [0, 1, 2], [20, 50])
    with pytest.raises(ValueError, match="cu_seqlens_q must run from 0 to total_q = 2"):
        native.paged_attention(q, k_pages, v_pages, table, [0, 1, 3], [20, 40])
    with pytest.raises(ValueError, match="kv_lengths\\[0\\] = -1 < 0"):
        native.paged_attention(q, k_pages, v_pages, table, [0, 1, 2], [-1, 40])
    with pytest.raises(TypeError, match="share one dtype"):
        native.paged_attention(q.float(), k_pages, v_pages, table, [0, 1, 2], [20, 40])


# --------------------------------------------------------------------------- cascade merge
@pytest.mark.parametrize("dtype", [DT, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n_q", [1, 3])
def test_merge_rows_of_prefix_and_own_parts_equals_attention_over_all_keys(dtype, n_q):
    """The cascade by hand: each row's queries over its first 10 keys (the 'prefix') and
    over the rest (its own, none for row 1) in one paged call, then paged_merge_rows in
    place → the reference over all the row's keys (gathered); the src rows stay."""
    h_q, h_kv, d, bs, prefix = 4, 2, 8, 5, 10
    own = [6, 0, 9, 1]
    lengths = [prefix + n for n in own]
    k_pages, v_pages, table, ks, vs = _pool(lengths, bs, h_kv, d, d, dtype)
    B = len(lengths)
    q = torch.randn(B * n_q, h_q, d).to(dtype)                 # row b: rows b·n_q ...
    tab = torch.cat([table, torch.cat([table[:, prefix // bs:],
                                       table[:, :prefix // bs]], 1)])   # own keys' pages
    cu = list(range(0, 2 * B * n_q + 1, n_q))
    kv = [prefix] * B + own
    out, lse = native.paged_attention(torch.cat([q, q]), k_pages, v_pages, tab, cu, kv)
    parts = out[: B * n_q].clone(), lse[: B * n_q].clone()
    native.paged_merge_rows(out, lse, range(B * n_q), range(B * n_q, 2 * B * n_q))
    assert torch.equal(out[: B * n_q], parts[0]) and torch.equal(lse[: B * n_q], parts[1])
    for b in range(B):
        rows = slice(B * n_q + b * n_q, B * n_q + (b + 1) * n_q)
        _assert_rows(out[rows], lse[rows], dtype, f"merged {dtype} row {b}",
                     functools.partial(_reference, q[b * n_q: (b + 1) * n_q], ks[b], vs[b], 0))


def test_merge_rows_follows_merge_partials_rules_for_empty_and_nan_parts():
    """Rows with an empty part (LSE −∞), both parts empty (→ 0, −∞) and NaN in one part's
    LSE (→ NaN) merge as base.merge_partials merges them; pairs in any order."""
    from attnkit.backends.base import merge_partials

    h_q, d_v = 3, 5
    out = torch.randn(8, h_q, d_v, dtype=DT)
    lse = torch.randn(8, h_q, dtype=DT)
    src, dst = [6, 1, 4, 0], [2, 7, 3, 5]
    lse[6, 0] = -torch.inf                                     # prefix part empty
    lse[2, 1] = -torch.inf                                     # own part empty
    lse[1, :] = lse[7, :] = -torch.inf                         # both: no key at all
    out[1] = out[7] = 0.0
    lse[4, 2] = torch.nan
    s, t = torch.tensor(src), torch.tensor(dst)
    want_out, want_lse = merge_partials([(out[s].transpose(0, 1), lse[s].t()),
                                         (out[t].transpose(0, 1), lse[t].t())])
    native.paged_merge_rows(out, lse, src, dst)
    torch.testing.assert_close(out[t], want_out.transpose(0, 1), rtol=1e-12, atol=1e-12,
                               equal_nan=True)
    torch.testing.assert_close(lse[t], want_lse.t(), rtol=1e-12, atol=0, equal_nan=True)
    assert torch.equal(out[7], torch.zeros(h_q, d_v, dtype=DT)) and (lse[7] == -torch.inf).all()
    assert lse[3, 2].isnan() and out[3, 2].isnan().all()


def test_merge_rows_refuses_a_row_used_twice_or_out_of_range():
    out, lse = torch.zeros(4, 2, 3), torch.zeros(4, 2)
    for src, dst, match in (([0, 1], [2, 2], "used twice"), ([0, 2], [2, 3], "used twice"),
                            ([1], [1], "used twice"), ([0], [4], "out of range")):
        with pytest.raises(ValueError, match=match):
            native.paged_merge_rows(out, lse, src, dst)
    with pytest.raises(ValueError, match="lse must be"):
        native.paged_merge_rows(out, lse.double(), [0], [1])


# --------------------------------------------------------------------------- serving wiring
def _no_gather(monkeypatch):
    import attnkit.serving as serving

    def refuse(*a, **k):
        raise AssertionError("a paged call gathered pages into a contiguous copy")

    monkeypatch.setattr(serving, "_read_pages", refuse)
    monkeypatch.setattr(serving, "_gather_padded", refuse)


def test_serving_paged_calls_read_pages_in_the_kernel(monkeypatch):
    _no_gather(monkeypatch)
    cache = ak.PagedKVCache(40, 5, 2, 8, dtype=DT)
    root = cache.new_sequence()
    cache.append(root, torch.randn(23, 2, 8, dtype=DT), torch.randn(23, 2, 8, dtype=DT))
    seqs = [cache.fork(root) for _ in range(3)] + [cache.new_sequence()]
    for s, n in zip(seqs, [0, 4, 9, 6], strict=True):
        if n:
            cache.append(s, torch.randn(n, 2, 8, dtype=DT), torch.randn(n, 2, 8, dtype=DT))
    cache.reserve(seqs, 2)
    q = torch.randn(4, 2, 4, 8, dtype=DT)
    kn, vn = torch.randn(4, 2, 2, 8, dtype=DT), torch.randn(4, 2, 2, 8, dtype=DT)
    for shared in (True, False):                               # cascade, and each row alone
        out, lse = ak.attention_with_kvcache(
            q, cache.k_pages, cache.v_pages, kn, vn, cache_seqlens=cache.seqlens(seqs),
            block_table=cache.block_table(seqs), causal=True, shared_prefix=shared,
            return_softmax_lse=True)
        for b, s in enumerate(seqs):
            n = cache.length(s) + 2
            idx = torch.tensor(cache.pages(s), dtype=torch.long)
            kk = cache.k_pages[idx].flatten(0, 1)[:n]
            vv = cache.v_pages[idx].flatten(0, 1)[:n]
            want, want_lse = _reference(q[b], kk, vv, n - 2, window=(-1, 0))
            torch.testing.assert_close(out[b], want, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(lse[b], want_lse.transpose(0, 1), rtol=1e-10,
                                       atol=1e-10)


def test_serving_falls_back_to_gathering_without_the_kernel(monkeypatch):
    k_pages, v_pages, table, ks, vs = _pool([9, 30], 4, 2, 8, 8, DT)
    q = torch.randn(2, 1, 4, 8, dtype=DT)
    got = ak.attention_with_kvcache(q, k_pages, v_pages, cache_seqlens=[9, 30],
                                    block_table=table, causal=True)
    monkeypatch.setenv("ATTNKIT_NATIVE", "0")
    off = ak.attention_with_kvcache(q, k_pages, v_pages, cache_seqlens=[9, 30],
                                    block_table=table, causal=True)
    torch.testing.assert_close(got, off, rtol=1e-10, atol=1e-10)
    for b in range(2):
        want, _ = _reference(q[b], ks[b], vs[b], ks[b].shape[0] - 1)
        torch.testing.assert_close(got[b], want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("block_q", [4, 32])          # GEMM loop: cached tiles, per-tile
def test_nan_in_a_key_outside_the_window_stays_out_on_the_gemm_loop(block_q):
    lengths = [200]                                    # 20 queries at positions 180 .. 199
    k_pages, v_pages, table, ks, vs = _pool(lengths, 16, 2, 8, 8, DT)
    for key in (150, 178):                             # 178 is seen by the queries at 180..182
        page, slot = table[0, key // 16], key % 16
        k_pages[page, slot, 0] = float("nan")
        v_pages[page, slot, 0] = float("nan")
    ks[0][150, 0] = ks[0][178, 0] = float("nan")
    vs[0][150, 0] = vs[0][178, 0] = float("nan")
    q = torch.randn(20, 8, 8, dtype=DT)
    out, _ = native.paged_attention(q, k_pages, v_pages, table, [0, 20], lengths,
                                    window=(4, 0), block_q=block_q)
    want, _ = _reference(q, ks[0], vs[0], 180, window=(4, 0))
    assert torch.isnan(out[:3, :4]).all(), "a NaN key that is seen propagates"
    torch.testing.assert_close(out[:3, 4:], want[:3, 4:], rtol=1e-10, atol=1e-10)  # head 1
    torch.testing.assert_close(out[3:], want[3:], rtol=1e-10, atol=1e-10)          # finite



def _poison_values(v_pages: torch.Tensor, vs: list[torch.Tensor], table: torch.Tensor,
                   keys: tuple[int, ...], dim: int, bad: str) -> None:
    """``bad`` (nan / inf) at dim ``dim`` of sequence 0's V rows ``keys``, in the pool (pages
    of 7 slots, block table ``table``) and in the gathered copy ``vs[0]``."""
    for key in keys:
        page, slot = table[0, key // 7], key % 7
        v_pages[page, slot, :, dim] = float(bad)
        vs[0][key, :, dim] = float(bad)

@pytest.mark.parametrize("dtype", [DT, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", ["nan", "inf"])
@pytest.mark.parametrize("dim", [3, 19])              # a vector lane, the row's scalar tail
def test_nonfinite_value_outside_the_window_stays_out_on_the_gemm_loop(dtype, bad, dim):
    # the GEMM loop converts a tile's V and checks it finite in one pass (paged.h
    # rows_to_compute_finite): an inf / NaN in any lane or the tail of a row (D_v = 20 is
    # not a multiple of the vector) sends the tile to the P == 0-skipping path
    lengths = [300]                                    # 20 queries at 280 .. 299, 8 heads
    k_pages, v_pages, table, ks, vs = _pool(lengths, 7, 2, 16, 20, dtype)
    _poison_values(v_pages, vs, table, (150, 270), dim, bad)  # read tiles, outside the window
    q = torch.randn(20, 8, 16).to(dtype)
    out, lse = native.paged_attention(q, k_pages, v_pages, table, [0, 20], lengths,
                                      window=(8, 0), split_len=128)
    assert torch.isfinite(out).all(), f"{bad} in a masked value row reached the output"
    _assert_rows(out, lse, dtype, f"paged gemm {dtype}",
                 functools.partial(_reference, q, ks[0], vs[0], 280, window=(8, 0)))


# ---------------------------------------------------------------------------- T GEMMs
# The GEMM loop in bfloat16 / float16 (paged.h gemm_tile_pass_lowp): each tile's Kᵀ and V
# packed in the VNNI layout from the rows the block table lists (lowp.h pack_kt_rows /
# pack_v_rows), Q and P in T. "emulated" (ATTNKIT_NATIVE_LOWP_GEMM=emulate) runs that path
# with a plain C++ product on every CPU; "gemm" with brgemm where this CPU has it.
LOWP = (torch.bfloat16, torch.float16)
_SWITCH = {"gemm": "1", "emulated": "emulate", "widen": "0"}


@pytest.fixture(params=["gemm", "emulated"])
def lowp_path(request, monkeypatch):
    dtype = request.node.callspec.params.get("dtype", torch.bfloat16)
    if request.param == "gemm" and not hardware_lowp_gemm(dtype):
        pytest.skip(f"no {dtype} GEMMs on this CPU: {native.low_precision_paths()}")
    monkeypatch.setenv("ATTNKIT_NATIVE_LOWP_GEMM", _SWITCH[request.param])
    return request.param


# keys 0 and 1 (a chunk over none, over one), 37, a 45-query chunk over 300 keys (three
# tiles, pages of 5 crossed mid-chunk), decode rows beside them on the dot loops
LOWP_LENGTHS, LOWP_N_Q = [0, 1, 37, 300, 150], [20, 20, 20, 45, 3]


@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(o) or "plain")
@pytest.mark.parametrize("block_size", [5, 16])
@pytest.mark.parametrize("block_q", [4, 32])          # cached packed tiles, packed per use
def test_lowp_gemm_loop_matches_reference(dtype, lowp_path, opts, block_size, block_q):
    _check(dtype, block_size, opts, split_len=None if block_q == 4 else 128, block_q=block_q,
           d=24, d_v=40, n_q=LOWP_N_Q, lengths=LOWP_LENGTHS)


@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("h_q,h_kv,d,d_v", [(4, 4, 8, 8), (8, 1, 65, 17), (16, 2, 128, 128),
                                            (6, 2, 3, 70)])
def test_lowp_gemm_loop_heads_and_dims(dtype, lowp_path, h_q, h_kv, d, d_v):
    # MHA, MQA, GQA; odd D_k (the packing's last word half zero), D_v past one VNNI block
    _check(dtype, 16, {"window": (-1, 0), "softcap": 3.0}, split_len=None, block_q=None,
           h_q=h_q, h_kv=h_kv, d=d, d_v=d_v, n_q=[33, 1, 16], lengths=[260, 1, 16])


@pytest.mark.parametrize("dtype", LOWP)
def test_lowp_gemm_loop_rounds_p_and_agrees_with_emulation(dtype, monkeypatch):
    """The T GEMM loop runs (its P is rounded to T: the output differs from the widening
    path's); brgemm, where it runs, and the emulated product agree to float32 rounding."""
    lengths, n_q = [300, 129], [40, 64]
    k_pages, v_pages, table, _, _ = _pool(lengths, 16, 2, 64, 64, dtype, poison=False)
    cu = torch.tensor([0, *torch.tensor(n_q).cumsum(0).tolist()])
    q = torch.randn(int(cu[-1]), 8, 64).to(dtype)
    outs = {}
    modes = ["emulated", "widen"] + (["gemm"] if hardware_lowp_gemm(dtype) else [])
    for mode in modes:
        monkeypatch.setenv("ATTNKIT_NATIVE_LOWP_GEMM", _SWITCH[mode])
        outs[mode] = native.paged_attention(q, k_pages, v_pages, table, cu, lengths,
                                            window=(-1, 0))[0].float()
    assert not torch.equal(outs["emulated"], outs["widen"])
    if "gemm" in outs:
        assert not torch.equal(outs["gemm"], outs["widen"])
        assert (outs["gemm"] - outs["emulated"]).abs().max() <= 4 * (
            torch.finfo(dtype).eps * outs["emulated"].abs().max())


@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("bad", ["nan", "inf"])
@pytest.mark.parametrize("dim", [3, 19, 33])          # a vector lane, the row's scalar tail
def test_lowp_nonfinite_value_outside_the_window_stays_out(dtype, lowp_path, bad, dim):
    # the packing finds a tile's first inf / NaN V row (pack_v_rows: 16 columns at a time,
    # then the tail of D_v = 36); such a tile takes the P == 0-skipping path for P . V
    lengths = [300]                                    # 20 queries at 280 .. 299, 8 heads
    k_pages, v_pages, table, ks, vs = _pool(lengths, 7, 2, 16, 36, dtype)
    _poison_values(v_pages, vs, table, (150, 271), dim, bad)  # read tiles, outside the window
    q = torch.randn(20, 8, 16).to(dtype)
    for block_q in (4, 32):                            # cached packed tiles, packed per use
        out, lse = native.paged_attention(q, k_pages, v_pages, table, [0, 20], lengths,
                                          window=(8, 0), split_len=128, block_q=block_q)
        assert torch.isfinite(out).all(), f"{bad} in a masked value row reached the output"
        _assert_rows(out, lse, dtype, f"paged lowp {dtype}",
                     functools.partial(_reference, q, ks[0], vs[0], 280, window=(8, 0)))


@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_lowp_nonfinite_value_just_past_an_items_keys_stays_out(dtype, lowp_path, bad):
    # 19 causal queries at 270 .. 288 over 300 keys: the last query block (3 queries) reads
    # keys up to 288 of the tile [256, 384), an odd 33 keys, while the cached packed tile
    # holds all 44; V row 289 (seen by no query) is the one the GEMM's pair of rows would
    # multiply by P = 0
    lengths = [300]
    k_pages, v_pages, table, ks, vs = _pool(lengths, 16, 2, 16, 16, dtype)
    page, slot = table[0, 289 // 16], 289 % 16
    v_pages[page, slot, :, 5] = float(bad)
    vs[0][289, :, 5] = float(bad)
    q = torch.randn(19, 16, 16).to(dtype)
    out, lse = native.paged_attention(q, k_pages, v_pages, table, [0, 19], lengths,
                                      q_positions=[270], window=(-1, 0), block_q=4)
    assert torch.isfinite(out).all(), f"{bad} in a value row no query sees reached the output"
    _assert_rows(out, lse, dtype, f"paged lowp {dtype}",
                 functools.partial(_reference, q, ks[0], vs[0], 270, window=(-1, 0)))
