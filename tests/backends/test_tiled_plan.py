"""The tiled engine's plan and its per-context state: the block map is built once per call,
plan pieces are named types, and tile sizes / counters are never shared between threads."""

from __future__ import annotations

import threading

import pytest
import torch

import attnkit as ak
from attnkit.api import prepare
from attnkit.backends import tiled

M = ak.masks
F64 = torch.float64


def _qkv(b, hq, hkv, nq, nk, d, grad=False):  # noqa: ANN001, ANN202
    g = torch.Generator().manual_seed(nq * 31 + nk)
    t = [torch.randn(b, h, n, d, dtype=F64, generator=g) for h, n in ((hq, nq), (hkv, nk),
                                                                      (hkv, nk))]
    return [x.requires_grad_(grad) for x in t]


@pytest.mark.parametrize("kw", [
    {"is_causal": True},                                       # one call
    {"mask": M.causal(), "hq": 4},                             # per block (GQA)
    {"mask": M.sliding_window(24)},                            # windowed, band split
    {"mask": M.document(torch.arange(300) // 40)},             # windowed, evaluated
    {"mask": M.prefix_lm(30)},                                 # per block
    {"mask": M.sliding_window(24), "softcap": 3.0},            # general, manual backward
    {"mask": M.sliding_window(24), "dropout_p": 0.2},          # general, checkpointed
], ids=["causal", "causal_gqa", "sliding", "document", "prefix", "softcap", "dropout"])
def test_block_map_is_built_once_per_call(kw, monkeypatch):
    kw = dict(kw)
    hq = kw.pop("hq", 2)
    q, k, v = _qkv(1, hq, 2, 300, 300, 8, grad=True)
    calls = []
    original = M.Mask.block_map

    def counted(self, *a, **kw_):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append(a)
        return original(self, *a, **kw_)

    monkeypatch.setattr(M.Mask, "block_map", counted)
    with tiled.counting() as n, tiled.tile_sizes(block_q=16, block_k=8), \
            tiled.use_native(False):                        # the Python engine's plan
        out = ak.attention(q, k, v, backend="tiled", **kw)
        out.sum().backward()
    assert len(calls) <= 1, calls                              # forward and backward
    assert n["block_maps"] == len(calls)
    assert n["runs"] >= 1


def test_plan_pieces_are_named_types():
    q, k, v = _qkv(1, 2, 2, 64, 64, 8)
    p = prepare(q, k, v, mask=M.sliding_window(9)).problem
    pl = tiled.plan(p, block_q=16, block_k=8, coarsen=False)
    assert isinstance(pl, tiled.Plan) and all(isinstance(b, tiled.Block) for b in pl.blocks)
    first = pl.blocks[0]
    assert (first.q0, first.q1, first.rows) == (0, 16, 16)
    assert isinstance(first.runs[0], tiled.Run) and first.runs[0].k0 == 0


def test_tile_sizes_are_per_context():
    base = tiled.sizes()
    seen = {}

    def other() -> None:
        seen["other"] = tiled.sizes()

    with tiled.tile_sizes(block_q=4):
        assert tiled.sizes().block_q == 4
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert seen["other"] == base and tiled.sizes() == base


_CASES = [
    ({"mask": M.sliding_window(17)}, {"block_q": 16, "block_k": 8}),
    ({"is_causal": True}, None),
    ({"mask": M.document(torch.arange(200) // 30), "softcap": 4.0},
     {"block_q": 8, "block_k": 8, "chunk_k": 16, "general_block_q": 8}),
    ({"mask": M.padding([150], q_lengths=[120]), "score_mod": ak.scores.alibi(2)}, None),
]


def _call(i: int) -> tuple[list[torch.Tensor], dict[str, int]]:
    kw, sizes = _CASES[i]
    q, k, v = _qkv(1, 2, 2, 200, 200, 8, grad=True)
    ctx = tiled.tile_sizes(**sizes) if sizes else tiled.tile_sizes()
    with tiled.counting() as n, ctx, tiled.use_native(False):
        out, lse = ak.attention(q, k, v, backend="tiled", return_lse=True, **kw)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    return [out.detach(), lse.detach(), *grads], dict(n)


def test_four_threads_get_the_single_thread_results():
    expected = [_call(i) for i in range(len(_CASES))]
    got: dict[tuple[int, int], tuple[list[torch.Tensor], dict[str, int]]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(_CASES))

    def worker(i: int) -> None:
        try:
            start.wait()
            for r in range(4):
                got[i, r] = _call(i)
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(_CASES))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    for (i, _r), (tensors, counts) in got.items():
        exp_tensors, exp_counts = expected[i]
        assert counts == exp_counts, (i, counts, exp_counts)
        for a, b in zip(tensors, exp_tensors, strict=True):
            # to rounding: threads share torch's intra-op pool (a reduction may split
            # differently); the counts above catch a schedule taken from another thread
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"case {i}")
