"""flash-attn style masks (issue 13, item 4): ``window(left, right, align)``, ``band``,
``varlen(cu_seqlens_q, cu_seqlens_k, causal, window)`` and ``cache_lengths(lengths)`` —
each against a dense Python-loop definition on awkward sizes, its block map sound (and
exact where claimed), its specs, its drawing, and ``attention(mask=m)`` on every backend
against the float64 oracle."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

import attnkit as ak
from attnkit import masks
from attnkit.masks import EMPTY, FULL, PARTIAL
from helpers.masks import dense_blocks
from helpers.oracle import oracle, randn
from helpers.running import run_backend


# ============================================================================ loop definitions
def loop_window(left: int, right: int, align: str, n_q: int, n_k: int) -> torch.Tensor:
    off = n_k - n_q if align == "bottom_right" else 0
    d = torch.zeros(n_q, n_k, dtype=torch.bool)
    for i in range(n_q):
        for j in range(n_k):
            d[i, j] = ((left == -1 or j >= i + off - left)
                       and (right == -1 or j <= i + off + right))
    return d


def loop_varlen(lens_q: list[int], lens_k: list[int], causal: bool = False,
                window: tuple[int, int] = (-1, -1), align: str = "bottom_right") -> torch.Tensor:
    """flash-attn's varlen rule, one sequence at a time (local indices i, j)."""
    d = torch.zeros(sum(lens_q), sum(lens_k), dtype=torch.bool)
    sq = list(itertools.accumulate([0, *lens_q]))
    sk = list(itertools.accumulate([0, *lens_k]))
    left, right = window
    for s, (lq, lk) in enumerate(zip(lens_q, lens_k, strict=True)):
        off = lk - lq if align == "bottom_right" else 0
        for i in range(lq):
            for j in range(lk):
                ok = ((left == -1 or j >= i + off - left)
                      and (right == -1 or j <= i + off + right)
                      and (not causal or j <= i + off))
                d[sq[s] + i, sk[s] + j] = ok
    return d


def loop_cache(lengths: list[int], n_q: int, n_k: int) -> torch.Tensor:
    d = torch.zeros(len(lengths), 1, n_q, n_k, dtype=torch.bool)
    for b, L in enumerate(lengths):
        for i in range(n_q):
            for j in range(n_k):
                d[b, 0, i, j] = j < L - n_q + i + 1 and j < L
    return d


def check_blocks(m: masks.Mask, want_dense: torch.Tensor, bq: int, bk: int, *,
                 exact: bool, ctx: str) -> None:
    """Rules' block map sound (FULL ⇒ full, EMPTY ⇒ empty), exact if claimed; exact=True
    refinement equal to the dense truth."""
    B = want_dense.shape[0]
    n_q, n_k = want_dense.shape[-2:]
    want = dense_blocks(want_dense.expand(B, 1, n_q, n_k), bq, bk)
    got = m.block_map(n_q, n_k, bq, bk, batch=B, heads=2)
    assert got.shape[0] in (1, B) and got.shape[2:] == want.shape[2:], ctx
    got = got.expand(B, got.shape[1], *want.shape[2:])
    want = want.expand_as(got)
    assert not ((got == FULL) & (want != FULL)).any(), ctx
    assert not ((got == EMPTY) & (want != EMPTY)).any(), ctx
    if exact:
        assert torch.equal(got, want), ctx
    ref = m.block_map(n_q, n_k, bq, bk, batch=B, heads=2, exact=True)
    assert torch.equal(ref.expand_as(want), want), ctx


SIZES = [(1, 1), (5, 5), (3, 11), (11, 3), (1, 9), (9, 1), (97, 113), (113, 97)]
WINDOWS = [(-1, -1), (0, 0), (2, 1), (0, 3), (5, -1), (-1, 2), (-1, 0), (3, 0)]


# ============================================================================ window
@pytest.mark.parametrize("align", ["bottom_right", "top_left"])
@pytest.mark.parametrize("left,right", WINDOWS)
def test_window_matches_loop_and_is_a_band(left, right, align):
    m = masks.window(left, right, align)
    assert isinstance(m.spec, masks.Band) and m.conjuncts() == [m]
    assert m.spec.bottom_right == (align == "bottom_right")
    rng = random.Random(left * 7 + right)
    for n_q, n_k in SIZES:
        want = loop_window(left, right, align, n_q, n_k)
        assert torch.equal(m.to_dense(n_q, n_k)[0, 0], want), (n_q, n_k)
        lo, hi = masks.band_of(m, n_q, n_k)                 # what tiled/triton compute
        i, j = torch.arange(n_q).view(-1, 1), torch.arange(n_k).view(1, -1)
        assert torch.equal((i - j >= lo) & (i - j <= hi), want)
        bq, bk = rng.choice([1, 3, 16, 64]), rng.choice([1, 4, 7, 32])
        check_blocks(m, want[None, None], bq, bk, exact=True, ctx=f"{n_q}x{n_k} {bq},{bk}")
        assert m.sparsity(n_q, n_k) == pytest.approx(1 - want.double().mean().item())


def test_window_relates_to_the_other_band_builders():
    for n_q, n_k in [(6, 6), (4, 9), (9, 4)]:
        d = lambda m, n_q=n_q, n_k=n_k: m.to_dense(n_q, n_k)  # noqa: E731
        assert torch.equal(d(masks.window(-1, 0)), d(masks.causal("bottom_right")))
        assert torch.equal(d(masks.window(-1, 0, "top_left")), d(masks.causal()))
        assert torch.equal(d(masks.window(3, 0, "top_left")), d(masks.sliding_window(4)))
        assert torch.equal(d(masks.window(3, 3, "top_left")),
                           d(masks.sliding_window(4, causal=False)))
        assert torch.equal(d(masks.window(-1, -1)), d(masks.full()))
        assert torch.equal(d(masks.band(-1, 2)), d(masks.window(2, 1, "top_left")))
    assert masks.window(2, 1).spec == masks.Band(-1, 2, True)
    assert masks.window(-1, -1).spec == masks.Band(-math.inf, math.inf, True)


def test_window_draws_itself():
    lines = masks.window(2, 1).to_string(4, 6).splitlines()
    assert "window(2, 1)" in lines[0] and "4×6" in lines[0]
    assert lines[1:] == ["████░░", "░████░", "░░████", "░░░███"]
    lines = masks.window(2, 1, "top_left").to_string(4, 6).splitlines()
    assert lines[1:] == ["██░░░░", "███░░░", "████░░", "░████░"]
    assert str(masks.window(1, 0)).splitlines()[1] == "█░░░░░░░"
    big = masks.window(100, 0).to_string(1000, 1000, grid=10).splitlines()
    assert len(big) == 11 and big[1] == "▒░░░░░░░░░" and big[10] == "░░░░░░░░▒▒"


# ============================================================================ varlen
VARLEN_CASES = [
    # (lens_q, lens_k): self-attention, cross with per-sequence offsets, empty sequences,
    # a uniform offset (Band), long packs (97 × 113 and 113 × 97)
    ([3, 5, 2], None),
    ([1], [4]),
    ([2, 3], [3, 2]),
    ([2, 3], [3, 4]),
    ([2, 3, 4], [3, 3, 4]),            # offsets −1, −1, −1: uniform → Documents & Band
    ([0, 4, 3, 0], [2, 0, 5, 3]),      # empty on one side: fully masked rows / unused keys
    ([1, 40, 0, 56], [13, 30, 7, 63]),
    ([13, 30, 7, 63], [1, 40, 0, 56]),
]


def _cu(lens: list[int]) -> list[int]:
    return list(itertools.accumulate([0, *lens]))


@pytest.mark.parametrize("lens_q,lens_k", VARLEN_CASES)
def test_varlen_matches_loop_with_sound_blocks(lens_q, lens_k):
    lk = lens_k if lens_k is not None else lens_q
    n_q, n_k = sum(lens_q), sum(lk)
    rng = random.Random(n_q * 31 + n_k)
    no_gaps = min(lens_q) > 0 and min(lk) > 0
    for causal, window, align in [(False, (-1, -1), "bottom_right"),
                                  (True, (-1, -1), "bottom_right"),
                                  (True, (-1, -1), "top_left"),
                                  (False, (2, 1), "bottom_right"),
                                  (True, (3, 5), "bottom_right"),
                                  (False, (0, -1), "top_left")]:
        cu_k = _cu(lens_k) if lens_k is not None else None
        m = masks.varlen(_cu(lens_q), cu_k, causal=causal, window=window, align=align)
        same = masks.varlen(seqlens_q=lens_q, seqlens_k=lens_k, causal=causal, window=window,
                            align=align)
        want = loop_varlen(lens_q, lk, causal, window, align)
        ctx = f"{lens_q}/{lk} causal={causal} window={window} {align}"
        assert torch.equal(m.to_dense(n_q, n_k)[0, 0], want), ctx
        assert torch.equal(same.to_dense(n_q, n_k)[0, 0], want), ctx
        # exact rules: pure Documents, and Documents & local term, when no sequence is empty
        # (Documents & Band is conservative where a tile spans sequences)
        exact = no_gaps and (len(m.conjuncts()) == 1 or m.conjuncts()[1].spec is None)
        for _ in range(3):
            bq, bk = rng.choice([1, 2, 5, 16, 64]), rng.choice([1, 3, 8, 32])
            check_blocks(m, want[None, None], bq, bk, exact=exact,
                         ctx=f"{ctx} block=({bq},{bk})")
        assert m.sparsity(n_q, n_k) == pytest.approx(1 - want.double().mean().item()), ctx


def test_varlen_specs_say_what_engines_can_compute():
    # pure block-diagonal: one Documents term
    m = masks.varlen([0, 3, 5])
    assert m.conjuncts() == [m] and isinstance(m.spec, masks.Documents)
    ids = masks.documents_of(m, 5, 5)
    assert ids[0].tolist() == [[0, 0, 0, 1, 1]] and ids[1].tolist() == [[0, 0, 0, 1, 1]]
    # self-attention causal: Documents & Band(0, inf) — both read in closed form
    terms = masks.varlen([0, 3, 5], causal=True).conjuncts()
    assert [type(t.spec) for t in terms] == [masks.Documents, masks.Band]
    assert masks.band_of(terms[1], 5, 5) == (0, math.inf)
    # a uniform per-sequence offset is still a band (q − k >= −1)
    terms = masks.varlen(seqlens_q=[2, 3], seqlens_k=[3, 4 - 0], causal=True).conjuncts()
    assert [type(t.spec) for t in terms] == [masks.Documents, type(None)]
    terms = masks.varlen(seqlens_q=[2, 3, 4], seqlens_k=[3, 3, 4], causal=True).conjuncts()
    assert [type(t.spec) for t in terms] == [masks.Documents, masks.Band]
    assert masks.band_of(terms[1], 9, 10) == (-1, math.inf)
    # per-sequence offsets that differ: Documents & a term without spec (evaluated)
    terms = masks.varlen(seqlens_q=[2, 3], seqlens_k=[3, 2], causal=True).conjuncts()
    assert isinstance(terms[0].spec, masks.Documents) and terms[1].spec is None
    assert terms[1].summarised_by_rules


def test_varlen_batched_packings():
    cu_q = torch.tensor([[0, 2, 5, 6], [0, 4, 4, 6]])
    cu_k = torch.tensor([[0, 3, 4, 7], [0, 1, 5, 7]])
    m = masks.varlen(cu_q, cu_k, causal=True)
    assert m.batch_size == 2 and m.depends_on_batch
    d = m.to_dense(6, 7)
    for b in range(2):
        lq, lk = cu_q[b].diff().tolist(), cu_k[b].diff().tolist()
        assert torch.equal(d[b, 0], loop_varlen(lq, lk, causal=True)), b
    check_blocks(m, d, 2, 3, exact=False, ctx="batched")
    # one packing for keys, two for queries (rows broadcast)
    m2 = masks.varlen(cu_q, [0, 2, 4, 7])
    assert m2.to_dense(6, 7).shape == (2, 1, 6, 7)
    assert "causal" in m.name and str(m.to_string(b=1)).count("\n") == 6


def test_varlen_draws_each_sequence_aligned_bottom_right():
    lines = str(masks.varlen([0, 2, 5], causal=True)).splitlines()
    assert "varlen([2, 3], causal)" in lines[0] and "5×5" in lines[0]
    assert lines[1:] == ["█░░░░", "██░░░", "░░█░░", "░░██░", "░░███"]
    lines = str(masks.varlen(seqlens_q=[2, 3], seqlens_k=[3, 2], causal=True)).splitlines()
    assert lines[1:] == ["██░░░", "███░░", "░░░░░", "░░░█░", "░░░██"]
    many = masks.varlen(seqlens_q=[3] * 20)
    assert "20 sequences" in many.name


@pytest.mark.parametrize("call,match", [
    (lambda: masks.varlen(), "needs the queries' packing"),
    (lambda: masks.varlen([1, 3]), "start at 0"),
    (lambda: masks.varlen([0, 3, 2]), "never decrease"),
    (lambda: masks.varlen([0.0, 2.0]), "integers"),
    (lambda: masks.varlen([0]), "at least 2 entries"),
    (lambda: masks.varlen([0, 2], seqlens_q=[2]), "not both"),
    (lambda: masks.varlen([0, 2, 4], [0, 4]), r"same sequences.*\(1, 3\).*\(1, 2\)"),
    (lambda: masks.varlen([[0, 2, 4], [0, 1, 3]]), "same total"),
    (lambda: masks.varlen(seqlens_q=[2, -1]), ">= 0"),
    (lambda: masks.varlen([0, 2], window=(1,)), "window must be"),
    (lambda: masks.varlen([0, 2], window=(-2, 0)), "window must be"),
    (lambda: masks.varlen([0, 2], causal=1), "causal must be"),
    (lambda: masks.varlen([0, 2], align="middle"), "top_left"),
    (lambda: masks.varlen([0, 2, 5]).to_dense(6, 5), r"packs 5 queries × 5 keys.*N_q=6"),
    (lambda: masks.varlen([0, 2, 5], causal=True).block_map(5, 4), "N_k=4"),
    (lambda: masks.window(-2, 0), "integer >= 0, or -1"),
    (lambda: masks.window(1.5, 0), "integer >= 0, or -1"),
    (lambda: masks.window(1, 1, "middle"), "top_left"),
    (lambda: masks.band(2, 1), "lo <= hi"),
    (lambda: masks.band(0.5, 1), "integer or"),
    (lambda: masks.cache_lengths([3, -1]), ">= 0"),
    (lambda: masks.cache_lengths([[3]]), "1-D"),
    (lambda: masks.cache_lengths([3, 9]).to_dense(2, 8), "exceed the call's N_k=8"),
])
def test_errors_say_what_is_wrong(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_varlen_block_rules_skip_tiles_tiled_can_skip():
    """On a long pack the rules find every EMPTY 64×64 tile without evaluation (~87% of the
    tiles here), for self-attention (Documents & Band) and per-sequence offsets alike."""
    rng = random.Random(7)
    lens_q = [rng.randint(20, 300) for _ in range(12)]
    lens_k = [n + rng.randint(0, 40) for n in lens_q]
    for m in (masks.varlen(seqlens_q=lens_q, causal=True),
              masks.varlen(seqlens_q=lens_q, seqlens_k=lens_k, causal=True)):
        n_q, n_k = sum(lens_q), sum(lens_k) if "k=" in m.name else sum(lens_q)
        rules = m.block_map(n_q, n_k, 64, 64)
        exact = m.block_map(n_q, n_k, 64, 64, exact=True)
        assert not ((rules == EMPTY) & (exact != EMPTY)).any()
        missed = int(((rules == PARTIAL) & (exact == EMPTY)).sum())
        assert missed == 0, (m.name, missed, rules.numel())
        assert int((rules == EMPTY).sum()) > 0.8 * rules.numel()


# ============================================================================ cache lengths
@pytest.mark.parametrize("n_q,n_k", [(1, 9), (3, 11), (5, 5), (7, 4), (16, 97), (97, 113)])
def test_cache_lengths_matches_loop_with_exact_blocks(n_q, n_k):
    rng = random.Random(n_q + 100 * n_k)
    lengths = [0, n_k, *[rng.randint(0, n_k) for _ in range(3)]]
    m = masks.cache_lengths(lengths)
    want = loop_cache(lengths, n_q, n_k)
    d = m.to_dense(n_q, n_k)
    assert d.shape == (len(lengths), 1, n_q, n_k) and torch.equal(d, want)
    for bq, bk in [(1, 1), (2, 3), (16, 32), (64, 64)]:
        check_blocks(m, want, bq, bk, exact=True, ctx=f"{n_q}x{n_k} {bq},{bk}")
    assert m.sparsity(n_q, n_k) == pytest.approx(1 - want.double().mean().item())
    if n_q == 1:                                      # plain decoding: padding(lengths)
        assert torch.equal(d, masks.padding(lengths).to_dense(1, n_k))


def test_cache_lengths_spec_and_drawing():
    m = masks.cache_lengths([4, 6])
    terms = m.conjuncts()
    assert isinstance(terms[0].spec, masks.Lengths) and terms[1].spec is None
    assert masks.lengths_of(terms[0])[0].tolist() == [4, 6]
    assert m.batch_size == 2
    assert m.to_string(3, 6, b=0).splitlines()[1:] == ["██░░░░", "███░░░", "████░░"]
    lines = m.to_string(3, 6, b=1).splitlines()
    assert "cache_lengths([4, 6])" in lines[0] and "batch element 1 of 2" in lines[0]
    assert lines[1:] == ["████░░", "█████░", "██████"]
    assert str(m).count("\n") == 6                    # drawn at its longest length


# ============================================================================ end to end
def _e2e(backend: str, m: masks.Mask, allowed: torch.Tensor, B: int, n_q: int, n_k: int,
         *, grad: bool = True) -> None:
    grad = grad and backend != "decode"                         # decode is forward only
    q = randn(B, 4, n_q, 8, requires_grad=grad)
    k = randn(B, 2, n_k, 8, requires_grad=grad)                 # GQA 4 → 2
    v = randn(B, 2, n_k, 5, requires_grad=grad)
    v_nan = v.detach().clone()
    unused = ~allowed.expand(B, 1, n_q, n_k).any(2).any(0)[0]   # keys no query sees
    v_nan[..., unused, :] = float("nan")
    want, _, _ = oracle(q, k, v, allowed=allowed)
    got = run_backend(backend, q, k, v, mask=m)
    assert got.shape == want.shape and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-7)
    if grad:
        g = torch.randn_like(want)
        dq, dk, dv = torch.autograd.grad(want, (q, k, v), g)
        gq, gk, gv = torch.autograd.grad(got, (q, k, v), g)
        for a, b_ in ((gq, dq), (gk, dk), (gv, dv)):
            torch.testing.assert_close(a, b_, atol=1e-8, rtol=1e-6)
    # NaN in keys that nothing may see never reaches the output
    got_nan = run_backend(backend, q.detach(), k.detach(), v_nan, mask=m)
    torch.testing.assert_close(got_nan, want.detach(), atol=1e-9, rtol=1e-7)


@pytest.mark.parametrize("left,right,align", [(2, 1, "bottom_right"), (5, -1, "top_left"),
                                              (-1, 3, "bottom_right"), (0, 0, "top_left")])
@pytest.mark.parametrize("n_q,n_k", [(97, 113), (113, 97), (1, 33)])
def test_window_end_to_end(backend, left, right, align, n_q, n_k):
    m = masks.window(left, right, align)
    _e2e(backend, m, loop_window(left, right, align, n_q, n_k), 2, n_q, n_k)


@pytest.mark.parametrize("lens_q,lens_k", [([3, 5, 2], None), ([1, 40, 0, 56], [13, 30, 7, 63]),
                                           ([13, 30, 7, 63], [1, 40, 0, 56])])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)),
                                           (True, (6, -1))])
def test_varlen_end_to_end(backend, lens_q, lens_k, causal, window):
    lk = lens_k if lens_k is not None else lens_q
    m = masks.varlen(seqlens_q=lens_q, seqlens_k=lens_k, causal=causal, window=window)
    want = loop_varlen(lens_q, lk, causal, window)
    _e2e(backend, m, want, 2, sum(lens_q), sum(lk))             # one packing, batch 2


def test_varlen_batched_end_to_end(backend):
    cu_q = torch.tensor([[0, 20, 50, 61], [0, 41, 41, 61]])
    cu_k = torch.tensor([[0, 33, 40, 70], [0, 10, 52, 70]])
    m = masks.varlen(cu_q, cu_k, causal=True)
    allowed = torch.stack([loop_varlen(cu_q[b].diff().tolist(), cu_k[b].diff().tolist(),
                                       causal=True) for b in range(2)])[:, None]
    _e2e(backend, m, allowed, 2, 61, 70)


@pytest.mark.parametrize("n_q,n_k", [(1, 113), (4, 97), (16, 64), (97, 113)])
def test_cache_lengths_end_to_end(backend, n_q, n_k):
    lengths = [n_k, 1, n_k // 2, 3]                   # 3 < n_q for some: empty rows
    m = masks.cache_lengths(lengths)
    _e2e(backend, m, loop_cache(lengths, n_q, n_k), 4, n_q, n_k)


def test_masks_exported():
    for name in ("window", "band", "varlen", "cache_lengths"):
        assert name in masks.__all__ and callable(getattr(ak.masks, name))
        assert getattr(masks, name).__doc__ and "::" in getattr(masks, name).__doc__


# ------------------------------------------------------------- the Triton kernels, interpreted
_TRITON_CASES = {
    "window": (lambda: masks.window(3, 1), lambda: loop_window(3, 1, "bottom_right", 17, 33),
               1, 17, 33),
    "window_tl": (lambda: masks.window(-1, 2, "top_left"),
                  lambda: loop_window(-1, 2, "top_left", 33, 17), 1, 33, 17),
    "varlen_causal_self": (lambda: masks.varlen(seqlens_q=[5, 0, 12, 16], causal=True),
                           lambda: loop_varlen([5, 0, 12, 16], [5, 0, 12, 16], True), 1, 33,
                           33),
    "varlen_causal_cross": (lambda: masks.varlen(seqlens_q=[5, 12], seqlens_k=[20, 13],
                                                 causal=True),
                            lambda: loop_varlen([5, 12], [20, 13], True), 2, 17, 33),
    "cache_lengths": (lambda: masks.cache_lengths([33, 2, 20]),
                      lambda: loop_cache([33, 2, 20], 5, 33), 3, 5, 33),
}


@pytest.mark.parametrize("case", sorted(_TRITON_CASES))
def test_triton_kernels_interpreted(case, monkeypatch):
    """The triton backend in Triton's CPU interpreter (set for this test only): the specs it
    reads (Band, Documents, Lengths) and the terms it evaluates give the reference's numbers."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    build, allowed, B, n_q, n_k = _TRITON_CASES[case]
    _e2e("triton", build(), allowed(), B, n_q, n_k)
