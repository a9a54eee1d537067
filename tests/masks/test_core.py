"""``attnkit.masks``: builders against hand-built dense masks, the algebra, block maps,
sparsity and drawing."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from attnkit import masks
from attnkit.masks import EMPTY, FULL, PARTIAL
from helpers.masks import dense_blocks


def ij(n_q: int, n_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(n_q).view(-1, 1), torch.arange(n_k).view(1, -1)


def dense2d(m: masks.Mask, n_q: int, n_k: int) -> torch.Tensor:
    d = m.to_dense(n_q, n_k)
    assert d.shape == (1, 1, n_q, n_k) and d.dtype == torch.bool
    return d[0, 0]


# ============================================================================ builders
@pytest.mark.parametrize("n_q,n_k", [(5, 5), (3, 7), (7, 3), (1, 4), (4, 1)])
def test_causal_alignments(n_q, n_k):
    i, j = ij(n_q, n_k)
    assert torch.equal(dense2d(masks.causal(), n_q, n_k), j <= i)
    assert torch.equal(dense2d(masks.causal("top_left"), n_q, n_k),
                       torch.ones(n_q, n_k, dtype=torch.bool).tril())
    br = dense2d(masks.causal("bottom_right"), n_q, n_k)
    assert torch.equal(br, torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q))
    assert torch.equal(br, j <= i + (n_k - n_q))
    if n_k >= n_q:      # the last query sees every key (KV-cache decoding)
        assert br[-1].all()
    else:               # the first n_q - n_k queries see nothing
        assert not br[: n_q - n_k].any() and br[n_q - n_k:].any(-1).all()


@pytest.mark.parametrize("size", [1, 2, 5])
@pytest.mark.parametrize("n_q,n_k", [(9, 9), (4, 11), (11, 4)])
def test_sliding_window(size, n_q, n_k):
    i, j = ij(n_q, n_k)
    assert torch.equal(dense2d(masks.sliding_window(size), n_q, n_k),
                       (j <= i) & (j > i - size))
    assert torch.equal(dense2d(masks.sliding_window(size, causal=False), n_q, n_k),
                       (i - j).abs() < size)
    off = n_k - n_q
    assert torch.equal(dense2d(masks.sliding_window(size, align="bottom_right"), n_q, n_k),
                       (j <= i + off) & (j > i + off - size))
    if size == 1:
        assert torch.equal(dense2d(masks.sliding_window(1), n_q, n_k), i == j)
    assert torch.equal(dense2d(masks.sliding_window(np.int64(size)), n_q, n_k),
                       (j <= i) & (j > i - size))


def test_padding_kv_and_q_lengths():
    kv, ql = torch.tensor([3, 0, 5]), torch.tensor([2, 4, 0])
    d = masks.padding(kv).to_dense(4, 5)
    assert d.shape == (3, 1, 4, 5)
    i, j = ij(4, 5)
    for b in range(3):
        assert torch.equal(d[b, 0], (j < kv[b]).expand(4, 5))
    d = masks.padding([3, 0, 5], q_lengths=ql).to_dense(4, 5, heads=2)
    assert d.shape == (3, 2, 4, 5)
    for b in range(3):
        assert torch.equal(d[b, 1], (j < kv[b]) & (i < ql[b]))
    assert masks.padding(kv).batch_size == 3 and masks.padding(kv).depends_on_batch


def test_document_self_and_cross_batched():
    ids = torch.tensor([0, 0, 1, 1, 1, 2])
    d = dense2d(masks.document(ids), 6, 6)
    assert torch.equal(d, ids[:, None] == ids[None, :])
    q_ids = torch.tensor([[0, 1, 2], [5, 5, 6]])
    kv_ids = torch.tensor([[0, 0, 1, 1, 2], [6, 6, 6, 5, 7]])
    d = masks.document(q_ids, kv_ids).to_dense(3, 5)
    assert d.shape == (2, 1, 3, 5)
    assert torch.equal(d[:, 0], q_ids[:, :, None] == kv_ids[:, None, :])
    # one shared row of query ids against per-batch key ids
    d = masks.document(torch.tensor([1, 2]), kv_ids).to_dense(2, 5)
    assert torch.equal(d[:, 0], torch.tensor([1, 2])[None, :, None] == kv_ids[:, None, :])


def test_document_with_causal_packs_sequences():
    ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    i, j = ij(8, 8)
    got = dense2d(masks.document(ids) & masks.causal(), 8, 8)
    assert torch.equal(got, (ids[:, None] == ids[None, :]) & (j <= i))


def test_document_wrong_lengths_is_an_error():
    m = masks.document(torch.tensor([0, 0, 1]))
    with pytest.raises(ValueError, match=r"3 queries × 3 keys.*N_q=4, N_k=3"):
        m.to_dense(4, 3)
    with pytest.raises(ValueError, match="N_k=5"):
        m.block_map(3, 5, 2, 2)


@pytest.mark.parametrize("n_q,n_k", [(6, 6), (4, 8), (8, 4)])
def test_prefix_lm(n_q, n_k):
    i, j = ij(n_q, n_k)
    assert torch.equal(dense2d(masks.prefix_lm(3), n_q, n_k), (j < 3) | (j <= i))
    assert torch.equal(dense2d(masks.prefix_lm(0), n_q, n_k), j <= i)
    d = masks.prefix_lm([0, 2, 5]).to_dense(n_q, n_k)
    assert d.shape == (3, 1, n_q, n_k)
    for b, p in enumerate((0, 2, 5)):
        assert torch.equal(d[b, 0], (j < p) | (j <= i))
    assert "prefix_lm(3)" in masks.prefix_lm(3).name
    assert torch.equal(dense2d(masks.prefix_lm(np.int64(3)), n_q, n_k), (j < 3) | (j <= i))


def test_from_fn_may_use_batch_and_head():
    m = masks.from_fn(lambda b, h, q, k: ((q + h) % 2 == 0) | (k == b))
    d = m.to_dense(4, 5, batch=2, heads=3)
    assert d.shape == (2, 3, 4, 5)
    for b in range(2):
        for h in range(3):
            i, j = ij(4, 5)
            assert torch.equal(d[b, h], ((i + h) % 2 == 0) | (j == b)), (b, h)
    assert m.depends_on_heads and m.depends_on_batch
    # a per-head pattern is drawn per head
    assert m.to_string(4, 5, h=1) != m.to_string(4, 5, h=0)


def test_from_fn_that_ignores_batch_and_head():
    m = masks.from_fn(lambda b, h, q, k: k <= q, name="mine")
    assert torch.equal(dense2d(m, 5, 5), dense2d(masks.causal(), 5, 5))
    assert m.name == "mine"
    assert m.to_dense(5, 5, batch=3, heads=2).shape == (3, 2, 5, 5)
    # engines see a minimal broadcast block: no copy per batch/head for a mask that ignores them
    assert m.evaluate(5, 5, batch=3, heads=2).shape == (1, 1, 5, 5)
    assert m.block_map(5, 5, 2, 2, batch=3, heads=2).shape == (1, 1, 3, 3)
    per_head = masks.from_fn(lambda b, h, q, k: (q + h) % 2 == 0)
    assert per_head.evaluate(5, 5, batch=3, heads=2).shape == (1, 2, 5, 5)
    assert per_head.block_map(5, 5, 2, 2, batch=3, heads=2).shape == (1, 2, 3, 3)


@pytest.mark.parametrize("shape", [(4, 5), (3, 4, 5), (2, 3, 4, 5), (1, 5), (2, 1, 4, 1)])
def test_from_tensor_shapes(shape):
    t = torch.rand(shape) > 0.5
    m = masks.from_tensor(t)
    full = torch.broadcast_to(t, (*(1,) * (4 - t.dim()), *t.shape)).expand(
        t.shape[0] if t.dim() == 4 else 1, max(t.shape[-3], 1) if t.dim() >= 3 else 1, 4, 5)
    d = m.to_dense(4, 5)
    assert d.shape == full.shape
    assert torch.equal(d, full)


def test_from_tensor_heads_default_and_checked():
    t = torch.rand(3, 4, 4) > 0.5
    m = masks.from_tensor(t)
    assert m.heads_size == 3 and m.depends_on_heads
    assert torch.equal(m.to_dense(4, 4)[0], t)
    assert m.sparsity(4, 4) == pytest.approx(1 - t.double().mean().item())
    with pytest.raises(ValueError, match="3 heads, got heads=2"):
        m.to_dense(4, 4, heads=2)


def test_from_tensor_rejects_float_and_bad_rank():
    with pytest.raises(TypeError, match="bool"):
        masks.from_tensor(torch.zeros(3, 3))
    with pytest.raises(ValueError, match=r"\(3,\)"):
        masks.from_tensor(torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"does not broadcast.*N_q=4, N_k=4"):
        masks.from_tensor(torch.ones(3, 3, dtype=torch.bool)).to_dense(4, 4)


def test_full_mask():
    assert dense2d(masks.full(), 3, 4).all()
    assert masks.full().sparsity(3, 4) == 0.0


# ============================================================================ algebra
def _random_masks(n_q: int, n_k: int) -> list[masks.Mask]:
    return [
        masks.causal(), masks.causal("bottom_right"), masks.sliding_window(3),
        masks.sliding_window(2, causal=False), masks.padding([n_k - 1, 2]),
        masks.prefix_lm(2), masks.from_tensor(torch.rand(n_q, n_k) > 0.5),
        masks.document(torch.tensor([0, 0, 1, 1, 1, 2][:n_q]),
                       torch.tensor([0, 1, 1, 2, 2, 2, 2][:n_k])),
        masks.from_fn(lambda b, h, q, k: (q * k + h) % 3 == 1),
    ]


def test_algebra_against_dense_logic():
    n_q, n_k = 6, 7
    ms = _random_masks(n_q, n_k)

    def dense(m: masks.Mask) -> torch.Tensor:
        return m.to_dense(n_q, n_k, batch=2, heads=2)

    for a in ms:
        da = dense(a)
        assert torch.equal(dense(~a), ~da)
        assert torch.equal(dense(~~a), da)
        for b in ms:
            db = dense(b)
            assert torch.equal(dense(a & b), da & db), (a.name, b.name)
            assert torch.equal(dense(a | b), da | db), (a.name, b.name)
    triple = (ms[0] | ms[4]) & ~ms[6]
    assert torch.equal(dense(triple), (dense(ms[0]) | dense(ms[4])) & ~dense(ms[6]))
    assert "&" in triple.name and "~" in triple.name


def test_algebra_with_bool_tensor_and_errors():
    t = torch.rand(4, 4) > 0.5
    got = dense2d(masks.causal() & t, 4, 4)
    i, j = ij(4, 4)
    assert torch.equal(got, t & (j <= i))
    assert torch.equal(dense2d(t & masks.causal(), 4, 4), t & (j <= i))   # tensor on the left
    assert torch.equal(dense2d(t | masks.causal(), 4, 4), t | (j <= i))
    with pytest.raises(TypeError, match="needs two Masks"):
        masks.causal() & 3                                  # type: ignore[operator]
    with pytest.raises(ValueError, match="batch 2 and 3"):
        masks.padding([1, 2]) & masks.padding([1, 2, 3])


# ============================================================================ block maps


def _builders(rng: random.Random, n_q: int, n_k: int, batch: int) -> dict[str, masks.Mask]:
    lens = [rng.randint(0, n_k) for _ in range(batch)]
    qlens = [rng.randint(0, n_q) for _ in range(batch)]
    n_docs = rng.randint(1, 4)
    cuts_q = sorted(rng.randint(0, n_q) for _ in range(n_docs - 1))
    cuts_k = sorted(rng.randint(0, n_k) for _ in range(n_docs - 1))
    q_ids = torch.bucketize(torch.arange(n_q), torch.tensor(cuts_q, dtype=torch.long), right=True)
    k_ids = torch.bucketize(torch.arange(n_k), torch.tensor(cuts_k, dtype=torch.long), right=True)
    w = rng.randint(1, 9)
    return {
        "causal": masks.causal(),
        "causal_br": masks.causal("bottom_right"),
        "window": masks.sliding_window(w),
        "window2": masks.sliding_window(w, causal=False, align=rng.choice(["top_left",
                                                                           "bottom_right"])),
        "padding": masks.padding(lens),
        "padding_q": masks.padding(lens, q_lengths=qlens),
        "prefix_lm": masks.prefix_lm(rng.randint(0, n_k)),
        "document": masks.document(q_ids, k_ids),
        "doc_shuffled": masks.document(q_ids[torch.randperm(n_q)], k_ids[torch.randperm(n_k)]),
        "full": masks.full(),
        "from_fn": masks.from_fn(lambda b, h, q, k: (q + 2 * k + h) % 5 < 2),
        "tensor": masks.from_tensor(torch.rand(n_q, n_k) > 0.5),
        "and": masks.causal() & masks.padding(lens),
        "or": masks.sliding_window(w) | masks.prefix_lm(rng.randint(0, n_k)),
        "not": ~masks.sliding_window(w, causal=False),
        "not_and": ~(masks.causal() & masks.padding(lens, q_lengths=qlens)),
        "doc_causal": masks.document(q_ids, k_ids) & masks.causal("bottom_right"),
    }


# block maps that must be exact (not just sound) from the interval rules
EXACT = {"causal", "causal_br", "window", "window2", "padding", "padding_q", "full",
         "document", "not", "from_fn", "tensor"}


def test_block_map_sound_and_exact_for_random_sizes():
    rng = random.Random(1234)
    for _ in range(25):
        n_q, n_k = rng.randint(1, 70), rng.randint(1, 70)
        bq, bk = rng.choice([1, 3, 8, 16, 64, 100]), rng.choice([1, 4, 7, 16, 32])
        batch, heads = rng.choice([1, 2]), 2
        for name, m in _builders(rng, n_q, n_k, batch).items():
            d = m.to_dense(n_q, n_k, batch=batch, heads=heads)
            want = dense_blocks(d, bq, bk)
            got = m.block_map(n_q, n_k, bq, bk, batch=batch, heads=heads)
            assert got.dtype == torch.int8 and got.dim() == 4
            assert got.shape[0] in (1, batch) and got.shape[1] in (1, heads)
            assert got.shape[2:] == want.shape[2:]
            got = got.expand_as(want)
            ctx = f"{name} n_q={n_q} n_k={n_k} block=({bq},{bk}) batch={batch}"
            # soundness: FULL only where every pair may attend, EMPTY only where none may
            assert not ((got == FULL) & (want != FULL)).any(), ctx
            assert not ((got == EMPTY) & (want != EMPTY)).any(), ctx
            if name in EXACT:
                assert torch.equal(got, want), ctx
            exact = m.block_map(n_q, n_k, bq, bk, batch=batch, heads=heads, exact=True)
            assert torch.equal(exact.expand_as(want), want), ctx


def test_block_map_shapes_follow_dependencies():
    assert masks.causal().block_map(100, 70, 32, 16).shape == (1, 1, 4, 5)
    assert masks.padding([3, 60]).block_map(100, 70, 32, 16).shape == (2, 1, 4, 5)
    t = torch.rand(2, 3, 10, 10) > 0.5
    assert masks.from_tensor(t).block_map(10, 10, 4, 4).shape == (2, 3, 3, 3)
    bm = masks.causal().block_map(4, 4, 2, 2)
    assert bm[0, 0].tolist() == [[PARTIAL, EMPTY], [FULL, PARTIAL]]
    bm = masks.causal().block_map(4, 4, 3, 3)
    assert bm[0, 0].tolist() == [[PARTIAL, EMPTY], [FULL, FULL]]
    assert masks.causal().block_map(0, 5, 2, 2).shape == (1, 1, 0, 3)
    with pytest.raises(ValueError, match="block sizes must be >= 1"):
        masks.causal().block_map(4, 4, 0, 2)


# ============================================================================ sparsity, drawing
@pytest.mark.parametrize("n_q,n_k", [(16, 16), (5, 13), (13, 5)])
def test_sparsity_matches_dense(n_q, n_k):
    for m in _random_masks(min(n_q, 6), min(n_k, 7))[:6]:
        d = m.to_dense(n_q, n_k, batch=2)
        assert m.sparsity(n_q, n_k, batch=2) == pytest.approx(1 - d.double().mean().item())
    assert masks.causal().sparsity(4, 4) == pytest.approx(6 / 16)
    assert masks.causal().sparsity(0, 4) == 0.0


def test_to_string_draws_the_mask():
    s = masks.causal().to_string(4)
    lines = s.splitlines()
    assert "causal" in lines[0] and "4×4" in lines[0]
    assert lines[1:] == ["█░░░", "██░░", "███░", "████"]
    assert str(masks.causal()) == masks.causal().to_string(8)
    s = masks.padding([2, 3]).to_string(2, 4, b=1)
    assert s.splitlines()[1:] == ["███░", "███░"]
    s = masks.causal("bottom_right").to_string(2, 4)
    assert s.splitlines()[1:] == ["███░", "████"]
    assert repr(masks.causal()) == "Mask(causal)"


def test_str_of_sized_masks_uses_their_own_size():
    t = torch.tensor([[True, False, True], [False, True, True]])
    lines = str(masks.from_tensor(t)).splitlines()
    assert "2×3" in lines[0] and lines[1:] == ["█░█", "░██"]
    assert str(~masks.from_tensor(t)).splitlines()[1:] == ["░█░", "█░░"]
    drawn = str(masks.document([0, 0, 1]) & masks.causal()).splitlines()
    assert drawn[1:] == ["█░░", "██░", "░░█"]


# ============================================================================ errors
@pytest.mark.parametrize("call,match", [
    (lambda: masks.causal("middle"), "top_left"),
    (lambda: masks.sliding_window(0), "positive integer, got 0"),
    (lambda: masks.sliding_window(2.5), "positive integer"),
    (lambda: masks.padding([3, -1]), r">= 0, got \[3, -1\]"),
    (lambda: masks.padding([[3, 1]]), r"1-D integer.*\(1, 2\)"),
    (lambda: masks.padding([1.5]), "integer"),
    (lambda: masks.padding([3, 2], q_lengths=[1]), r"q_lengths \(1,\) and kv_lengths \(2,\)"),
    (lambda: masks.document(torch.tensor([0.5, 1.0])), "integer document ids"),
    (lambda: masks.document(torch.zeros(2, 3, dtype=torch.long),
                            torch.zeros(3, 3, dtype=torch.long)), "batch 2 and kv_ids batch 3"),
    (lambda: masks.prefix_lm(-1), ">= 0"),
    (lambda: masks.from_fn(3), "callable"),
    (lambda: masks.causal().to_dense(-1, 3), "non-negative"),
    (lambda: masks.padding([1, 2]).to_dense(3, 3, batch=3), "built for batch 2, got batch 3"),
])
def test_builder_errors(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_builders_describe_themselves_for_the_engines():
    assert masks.causal().spec == masks.Band(0, math.inf, False)
    assert masks.causal("bottom_right").spec.offset(2, 5) == 3
    assert masks.sliding_window(4, causal=False).spec == masks.Band(-3, 3, False)
    lengths = masks.padding([3, 1], q_lengths=[2, 2]).spec
    assert lengths.kv_lengths.tolist() == [3, 1] and lengths.q_lengths.tolist() == [2, 2]
    assert masks.document([0, 0, 1]).spec.ids.tolist() == [[0, 0, 1]]
    m = masks.causal() & (masks.padding([2]) & masks.sliding_window(3))
    assert [t.name for t in m.conjuncts()] == ["causal", "padding(kv_lengths=[2])",
                                               "sliding_window(3, causal)"]
    assert (masks.causal() | masks.full()).spec is None       # opaque: evaluated
    assert (~masks.causal()).conjuncts()[0].spec is None
