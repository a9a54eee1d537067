"""torch interop: from_torch, torch_masks_to_attnkit, TorchStyleMultiheadAttention."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import attnkit as ak
from attnkit.layers import TorchStyleMultiheadAttention, torch_masks_to_attnkit
from helpers.layers import DT


def _torch_mha(e=16, h=4, *, bias=True, batch_first=False, kdim=None):
    m = nn.MultiheadAttention(e, h, bias=bias, batch_first=batch_first, kdim=kdim, vdim=kdim)
    m = m.to(DT)
    if bias:
        with torch.no_grad():      # torch zero-initialises the biases: make them matter
            m.in_proj_bias.normal_()
            m.out_proj.bias.normal_()
    return m


def _bool_attn_mask(l_q, l_k, *shape):
    am = torch.rand(*shape, l_q, l_k) > 0.6      # torch convention: True = blocked
    am[..., 0] = False                           # key 0 stays visible: no empty rows
    return am


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("case", ["none", "bool", "float", "bool3d", "kpm", "kpm_float",
                                  "bool+kpm", "float+kpm", "causal_hint"])
def test_from_torch_matches_torch(batch_first, case):
    B, L, E, H = 3, 6, 16, 4
    tm = _torch_mha(E, H, batch_first=batch_first)
    ours = TorchStyleMultiheadAttention.from_torch(tm)
    assert ours.batch_first == batch_first
    x = torch.randn(B, L, E, dtype=DT) if batch_first else torch.randn(L, B, E, dtype=DT)
    kw: dict = {}
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[0, 4:] = True
    kpm[2, 1:3] = True
    if case in ("bool", "bool+kpm"):
        kw["attn_mask"] = _bool_attn_mask(L, L)
    if case in ("float", "float+kpm"):
        kw["attn_mask"] = torch.randn(L, L, dtype=DT).masked_fill(_bool_attn_mask(L, L),
                                                                   -math.inf)
    if case == "bool3d":
        kw["attn_mask"] = _bool_attn_mask(L, L, B * H)
    if case in ("kpm", "bool+kpm", "float+kpm"):
        kw["key_padding_mask"] = kpm
    if case == "kpm_float":
        kw["key_padding_mask"] = torch.randn(B, L, dtype=DT)
    if case == "causal_hint":
        kw["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(L, dtype=DT)
        kw["is_causal"] = True
        kw["key_padding_mask"] = kpm
    for avg in (True, False):
        want_out, want_w = tm(x, x, x, average_attn_weights=avg, **kw)
        got_out, got_w = ours(x, x, x, average_attn_weights=avg, **kw)
        torch.testing.assert_close(got_out, want_out, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got_w, want_w, rtol=1e-10, atol=1e-10)
    want_out, none = tm(x, x, x, need_weights=False, **kw)
    got_out, none2 = ours(x, x, x, need_weights=False, **kw)
    assert none is None and none2 is None
    torch.testing.assert_close(got_out, want_out, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("batch_first", [False, True])
def test_from_torch_cross_attention_and_no_bias(batch_first):
    tm = _torch_mha(16, 2, bias=False, batch_first=batch_first, kdim=10)
    ours = TorchStyleMultiheadAttention.from_torch(tm)
    B, Lq, Lk = 2, 3, 7
    if batch_first:
        q, kv = torch.randn(B, Lq, 16, dtype=DT), torch.randn(B, Lk, 10, dtype=DT)
    else:
        q, kv = torch.randn(Lq, B, 16, dtype=DT), torch.randn(Lk, B, 10, dtype=DT)
    kv2 = torch.randn_like(kv)                  # separate key and value inputs
    for key, value in ((kv, kv), (kv, kv2)):
        want = tm(q, key, value)
        got = ours(q, key, value)
        torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got[1], want[1], rtol=1e-10, atol=1e-10)


def test_from_torch_unbatched_and_attnkit_convention():
    tm = _torch_mha(16, 4)
    x = torch.randn(5, 16, dtype=DT)
    am = _bool_attn_mask(5, 5)
    want_out, want_w = tm(x, x, x, attn_mask=am, average_attn_weights=False)
    got_out, got_w = TorchStyleMultiheadAttention.from_torch(tm)(
        x, x, x, attn_mask=am, average_attn_weights=False)
    torch.testing.assert_close(got_out, want_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got_w, want_w, rtol=1e-10, atol=1e-10)
    # the plain attnkit layer: batch-first, True = may attend
    m = ak.MultiHeadAttention.from_torch(tm)
    out, w = m(x[None], mask=~am, need_weights=True)
    torch.testing.assert_close(out[0], want_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(w[0], want_w, rtol=1e-10, atol=1e-10)


def test_from_torch_rejects_unsupported():
    with pytest.raises(ValueError, match="add_bias_kv"):
        ak.MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2, add_bias_kv=True))
    with pytest.raises(ValueError, match="kdim == vdim"):
        ak.MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2, kdim=4, vdim=6))
    with pytest.raises(TypeError, match="MultiheadAttention"):
        ak.MultiHeadAttention.from_torch(nn.Linear(8, 8))


def test_torch_masks_to_attnkit_conventions():
    am = torch.tensor([[False, True], [False, False]])
    kpm = torch.tensor([[False, False], [True, False]])
    both = torch_masks_to_attnkit(am, kpm, batch=2, heads=3)
    assert both.dtype == torch.bool and both.shape == (2, 1, 2, 2)
    assert both[0, 0].tolist() == [[True, False], [True, True]]
    assert both[1, 0].tolist() == [[False, False], [False, True]]
    fl = torch_masks_to_attnkit(torch.zeros(2, 2), kpm, batch=2, heads=3)
    assert fl.dtype == torch.float32 and fl[1, 0, 0, 0] == -math.inf and fl[1, 0, 0, 1] == 0
    assert torch_masks_to_attnkit(None, None, batch=2, heads=3) is None
    with pytest.raises(ValueError, match="attn_mask"):
        torch_masks_to_attnkit(torch.zeros(5, 2, 2, dtype=torch.bool), None, batch=2, heads=3)


def test_torch_style_takes_torch_constructor():
    """``TorchStyleMultiheadAttention(embed_dim, num_heads, ...)`` builds a layer like torch's
    (was: an int taken for the inner layer → AttributeError on the first call)."""
    torch.manual_seed(0)
    m = ak.TorchStyleMultiheadAttention(16, 4, batch_first=True, dtype=torch.float64)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    out, w = m(x, x, x)
    assert out.shape == (2, 5, 16) and w.shape == (2, 5, 5)
    ref = m.inner(x)                                   # same layer, attnkit's own call
    torch.testing.assert_close(out, ref)
    with pytest.raises(TypeError, match="needs num_heads"):
        ak.TorchStyleMultiheadAttention(16)
    with pytest.raises(ValueError, match="add_bias_kv"):
        ak.TorchStyleMultiheadAttention(16, 4, add_bias_kv=True)
    with pytest.raises(ValueError, match="kdim == vdim"):
        ak.TorchStyleMultiheadAttention(16, 4, kdim=8, vdim=12)
    with pytest.raises(TypeError, match="embed_dim, num_heads"):
        ak.TorchStyleMultiheadAttention("16", 4)
