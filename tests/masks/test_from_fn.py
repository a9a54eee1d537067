"""``masks.from_fn``: FlexAttention's mask_mod functions work unchanged (per-pair semantics,
``scores.flex_semantics``), and a function that returns the wrong thing is refused with one
clear error, the same on every backend (issue 10, items 7 and 8)."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit import masks

BACKENDS = ["reference", "decode", "tiled"]


def _loop(fn, B: int, H: int, n_q: int, n_k: int) -> torch.Tensor:  # noqa: ANN001
    """The mask as FlexAttention means it: fn called on each (b, h, q, kv) as 0-d tensors."""
    out = torch.empty(B, H, n_q, n_k, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            for i in range(n_q):
                for j in range(n_k):
                    out[b, h, i, j] = bool(fn(*(torch.tensor(x) for x in (b, h, i, j))))
    return out


# FlexAttention's documented mask_mod examples (attention-gym / the FlexAttention blog)
SLIDING_WINDOW = 3
document_id = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 2, 3]])
prefix_length = torch.tensor([2, 5])
head_table = torch.tensor([[True, False] * 5, [False, True] * 5, [True] * 10])   # (H, N)


def causal(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN201
    return q_idx >= kv_idx


def sliding_window_causal(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN201
    causal_mask = q_idx >= kv_idx
    window_mask = q_idx - kv_idx <= SLIDING_WINDOW
    return causal_mask & window_mask


def prefix_lm_causal(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN201
    return (kv_idx < prefix_length[b]) | (q_idx >= kv_idx)


def document_causal(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN201
    causal_mask = q_idx >= kv_idx
    document_mask = document_id[b][q_idx] == document_id[b][kv_idx]    # chained indexing
    return causal_mask & document_mask


def per_head_keys(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN201
    return head_table[h][kv_idx] | (q_idx == kv_idx)                    # table[h][kv]


EXAMPLES = [causal, sliding_window_causal, prefix_lm_causal, document_causal, per_head_keys]


@pytest.mark.parametrize("fn", EXAMPLES, ids=lambda f: f.__name__)
def test_flex_mask_mods_have_flex_semantics(fn):  # noqa: ANN001
    B, H, n = 2, 3, 9
    want = _loop(fn, B, H, n, n)
    got = masks.from_fn(fn).to_dense(n, n, batch=B, heads=H)
    assert torch.equal(got, want)
    # block maps and sparsity agree with the dense evaluation
    bm = masks.from_fn(fn).block_map(n, n, 4, 4, batch=B, heads=H)
    assert bm.shape[2:] == (3, 3)
    assert masks.from_fn(fn).sparsity(n, n, batch=B, heads=H) == pytest.approx(
        1 - want.double().mean().item())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fn", EXAMPLES, ids=lambda f: f.__name__)
def test_flex_mask_mods_on_every_backend(fn, backend):  # noqa: ANN001
    B, H, n = 2, 3, 9
    q, k, v = (torch.randn(B, H, n, 8, dtype=torch.float64) for _ in range(3))
    got = ak.attention(q, k, v, mask=masks.from_fn(fn), backend=backend)
    want = ak.attention(q, k, v, mask=_loop(fn, B, H, n, n), backend="reference")
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


def test_chained_indexing_was_wrong_under_broadcast_semantics():
    # what attnkit did before: the same function on broadcast index tensors indexes the
    # wrong elements (document_id[b] has shape (B,1,1,1,N); [q_idx] then indexes dim 0)
    b, h = torch.arange(2).view(-1, 1, 1, 1), torch.arange(1).view(1, -1, 1, 1)
    q, kv = torch.arange(9).view(1, 1, -1, 1), torch.arange(9).view(1, 1, 1, -1)
    with pytest.raises(IndexError):
        document_causal(b, h, q, kv)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_bool_results_are_refused_naming_the_mask(backend):
    q = torch.randn(1, 2, 4, 8)
    for fn in (lambda b, h, i, j: (i - j) * 0.5,
               lambda b, h, i, j: torch.where(i >= j, 1.0, torch.nan),
               lambda b, h, i, j: (i >= j).int()):
        with pytest.raises(TypeError, match=r"mask_mod halfway cannot be evaluated.*"
                                            "not torch.bool"):
            ak.attention(q, q, q, mask=masks.from_fn(fn, name="halfway"), backend=backend)


def test_a_hand_built_mask_returning_numbers_is_refused():
    m = masks.Mask(lambda b, h, i, j, n_q, n_k: (i - j) * 0.5, name="raw")
    with pytest.raises(TypeError, match=r"mask raw returned a torch.float32 tensor, not a bool"):
        m.to_dense(3, 3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_wrong_shapes_and_failing_functions_get_one_clear_error(backend):
    q = torch.randn(1, 2, 4, 8)
    wide = masks.from_fn(lambda b, h, i, j: torch.ones(3, dtype=torch.bool), name="wide")
    with pytest.raises(ValueError, match=r"mask_mod wide cannot be evaluated.*returned shape "
                                         r"\(3,\)"):
        ak.attention(q, q, q, mask=wide, backend=backend)

    def branchy(b, h, i, j):  # noqa: ANN001, ANN202
        return i >= j if i > 2 else i == j          # Python control flow on a tensor value

    with pytest.raises(ValueError, match=r"mask_mod branchy cannot be evaluated.*torch.vmap"):
        ak.attention(q, q, q, mask=masks.from_fn(branchy), backend=backend)


def test_constant_and_python_bool_results():
    assert masks.from_fn(lambda b, h, i, j: True).to_dense(2, 3).all()
    m = masks.from_fn(lambda b, h, i, j: torch.tensor(False))
    assert not m.to_dense(2, 3, batch=2).any()
    assert m.evaluate(2, 3, batch=2, heads=4).shape == (1, 1, 2, 3)   # no copy per b, h
    chained = masks.from_fn(document_causal)
    assert chained.evaluate(9, 9, batch=2, heads=4).shape == (2, 1, 9, 9)
    assert chained.evaluate(9, 9, q_range=(3, 3), batch=2).shape[2] == 0
