"""Mask summaries at any size (issue 10 item 11, issue 9 item 7, issue 10 item 10): closed-form
sparsity and block maps equal the dense evaluation, densifying peaks near the result's own
size, drawings stay small, and padding lengths that cannot apply are refused."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import pytest
import torch

import attnkit as ak
from attnkit import masks
from attnkit.masks import EMPTY, FULL, PARTIAL


def _structured(n_q: int, n_k: int) -> dict[str, masks.Mask]:
    g = torch.Generator().manual_seed(n_q * 100 + n_k)
    ids_q = torch.sort(torch.randint(0, 4, (2, n_q), generator=g)).values
    ids_k = torch.sort(torch.randint(0, 4, (2, n_k), generator=g)).values
    return {
        "causal": masks.causal(), "causal_br": masks.causal("bottom_right"),
        "window": masks.sliding_window(3), "window2": masks.sliding_window(4, causal=False),
        "full": masks.full(), "padding": masks.padding([n_k, n_k // 2]),
        "padding_q": masks.padding([n_k // 3, n_k], q_lengths=[n_q, 1]),
        "document": masks.document(ids_q, ids_k),
        "doc_shared": masks.document(ids_q[0], ids_k[0]),
        "doc&causal": masks.document(ids_q, ids_k) & masks.causal(),
        "window|prefix": masks.sliding_window(2) | masks.prefix_lm(3),
        "~pad&causal": ~(masks.padding([min(2, n_k), n_k]) & masks.causal()),
    }


@pytest.mark.parametrize(("n_q", "n_k"), [(1, 1), (7, 13), (13, 7), (64, 64), (97, 33)])
def test_closed_form_sparsity_equals_the_dense_evaluation(n_q, n_k):
    for name, m in _structured(n_q, n_k).items():
        d = m.to_dense(n_q, n_k, batch=2, heads=3)
        want = 1 - d.double().mean().item()
        assert m.sparsity(n_q, n_k, batch=2, heads=3) == pytest.approx(want, abs=1e-12), name


@pytest.mark.parametrize(("n_q", "n_k", "bq", "bk"), [(7, 13, 2, 4), (97, 33, 8, 5),
                                                       (64, 64, 16, 16), (5, 40, 3, 7)])
def test_exact_block_maps_equal_the_dense_blocks(n_q, n_k, bq, bk):
    for name, m in _structured(n_q, n_k).items():
        d = m.to_dense(n_q, n_k, batch=2, heads=2)
        pad = (0, -n_k % bk, 0, -n_q % bq)
        n = torch.nn.functional.pad(d.to(torch.int32), pad).reshape(
            2, 2, -(-n_q // bq), bq, -(-n_k // bk), bk).sum((3, 5))
        size = masks.block_sizes(n_q, n_k, bq, bk)
        want = torch.where(n == size, FULL, torch.where(n > 0, PARTIAL, EMPTY)).to(torch.int8)
        got = m.block_map(n_q, n_k, bq, bk, batch=2, heads=2, exact=True)
        assert torch.equal(got.expand_as(want), want), name


@pytest.fixture
def one_thread():  # noqa: ANN201
    """Small tensor ops are fastest on one thread (and the test machine is shared)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def test_structured_masks_answer_at_65536_in_closed_form(one_thread):  # noqa: ANN001
    n = 65536
    ids = torch.arange(n) // 3000
    for m in (masks.causal(), masks.sliding_window(1000), masks.padding([n, 30000]),
              masks.document(ids), masks.document(ids) & masks.causal()):
        assert 0.0 < m.sparsity(n, n) < 1.0, m.name
        assert m.block_map(n, n, 128, 128).shape[2:] == (512, 512)
    for m in (masks.causal(), masks.sliding_window(1000), masks.padding([n, 30000])):
        exact = m.block_map(n, n, 128, 128, exact=True)        # the rules are exact: no work
        assert torch.equal(exact, m.block_map(n, n, 128, 128)), m.name
    assert masks.causal().sparsity(n, n) == pytest.approx(1 - (n + 1) / (2 * n))
    # a document mask's exact map evaluates only its PARTIAL blocks
    n = 2048
    m = masks.document(torch.arange(n) // 300) & masks.causal()
    d = m.to_dense(n, n).reshape(16, 128, 16, 128)
    want = torch.where(d.all(3).all(1), FULL, torch.where(d.any(3).any(1), PARTIAL, EMPTY))
    assert torch.equal(m.block_map(n, n, 128, 128, exact=True)[0, 0], want.to(torch.int8))


_PEAK = textwrap.dedent("""
    import json, resource, sys, torch
    torch.set_num_threads(1)
    from attnkit import masks
    def peak():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # bytes (Linux)
    masks.causal().to_dense(256, 256); masks.causal().block_map(4096, 4096)   # warm up
    out = {}
    base = peak(); r = masks.causal().to_dense(4096, 4096)
    out["dense"] = (peak() - base, r.numel())
    del r
    base = peak(); r = masks.causal().block_map(131072, 131072)
    out["block_map"] = (peak() - base, r.numel())
    print(json.dumps(out))
""")


def test_densifying_peaks_near_the_size_of_the_result():
    res = subprocess.run([sys.executable, "-c", _PEAK], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    for what, (grew, size) in json.loads(res.stdout).items():
        # the result itself plus pieces of ~2^18 elements (the old code peaked 16× higher)
        assert grew <= 2 * size + 24 * 2**20, (what, grew, size)


def test_large_masks_draw_as_a_coarse_grid_of_blocks():
    t = torch.zeros(4096, 4096, dtype=torch.bool)
    t[:, :100] = True
    t[1000:1100, 2000:2050] = True
    text = str(masks.from_tensor(t, name="big"))
    lines = text.splitlines()
    assert len(text) < 6000 and len(lines) == 65 and all(len(x) == 64 for x in lines[1:])
    assert "4096×4096" in lines[0] and "blocks of 64×64" in lines[0]
    assert "█ = every pair may attend" in lines[0] and "▒ = some" in lines[0]
    assert lines[1][:2] == "█▒" and lines[1][2:] == "░" * 62
    assert lines[16][31] == "▒" and lines[17][31] == "▒" and lines[16][33] == "░"
    causal = masks.causal().to_string(1000, 1000, grid=10).splitlines()
    assert causal[1:] == ["▒" + "░" * 9] + ["█" * i + "▒" + "░" * (9 - i) for i in range(1, 10)]


def test_drawings_say_which_batch_element_and_head_they_show():
    pad = masks.padding([2, 3])
    assert "batch element 1 of 2" in pad.to_string(2, 4, b=1).splitlines()[0]
    assert "batch element" not in masks.causal().to_string(4).splitlines()[0]
    per_head = masks.from_tensor(torch.rand(3, 5, 5) > 0.5)
    assert "head 2 of 3" in per_head.to_string(h=2).splitlines()[0]
    big = masks.padding([5000, 100])
    assert "batch element 1 of 2" in big.to_string(5000, 5000, b=1).splitlines()[0]
    with pytest.raises(ValueError, match="b=2 is outside the batch of 2"):
        pad.to_string(2, 4, b=2)


@pytest.mark.parametrize("backend", ["reference", "decode", "tiled"])
def test_padding_lengths_that_cannot_apply_are_refused(backend):
    with pytest.raises(ValueError, match=r"empty kv_lengths \(shape \(0,\)\)"):
        masks.padding([])
    with pytest.raises(ValueError, match="empty kv_lengths"):
        masks.padding(torch.tensor([], dtype=torch.long), q_lengths=[])
    q, k = torch.randn(2, 1, 3, 4), torch.randn(2, 1, 5, 4)
    with pytest.raises(ValueError, match=r"kv_lengths=\[5, 7\] exceed the call's N_k=5 keys"):
        ak.attention(q, k, k, mask=masks.padding([5, 7]), backend=backend)
    with pytest.raises(ValueError, match=r"q_lengths=\[4, 1\] exceed the call's N_q=3"):
        ak.attention(q, k, k, mask=masks.padding([5, 5], q_lengths=[4, 1]), backend=backend)
    with pytest.raises(ValueError, match="exceed the call's N_k=5"):
        masks.padding([6]).to_dense(3, 5)
    with pytest.raises(ValueError, match="exceed the call's N_k=5"):
        (masks.causal() & masks.padding([6])).block_map(3, 5, 2, 2)
    out = ak.attention(q, k, k, mask=masks.padding([5, 0]), backend=backend)   # at the limit
    assert math.isfinite(float(out.sum()))


def test_ranges_and_block_sizes_outside_the_call_are_refused():
    # (before: evaluated indices past N_q / N_k silently, and a float block size
    # produced a map of the wrong shape)
    m = masks.causal()
    with pytest.raises(ValueError, match=r"q_range=\(2, 9\).*N_q=4"):
        m.evaluate(4, 4, q_range=(2, 9))
    with pytest.raises(ValueError, match=r"k_range=\(3, 1\)"):
        m.evaluate(4, 4, k_range=(3, 1))
    with pytest.raises(ValueError, match="block sizes must be >= 1"):
        m.block_map(8, 8, 2.5, 2)
    assert m.evaluate(4, 4, q_range=(4, 4)).shape == (1, 1, 0, 4)


def test_padding_longer_than_eight_draws_at_its_longest_length():
    """``str(padding([10, 12]))`` drew at the default 8 keys, which the lengths exceed (raised)."""
    text = str(masks.padding([10, 12]))
    lines = text.splitlines()
    assert "12×12" in lines[0] and len(lines) == 13
    assert lines[1] == "█" * 10 + "░" * 2                   # batch element 0: 10 valid keys
    assert "8×8" in str(masks.causal() & masks.padding([3]))   # short lengths: 8 × 8 as before
