"""Rotary position embeddings (``attnkit.rope``) and ``MultiHeadAttention(rope=...)``.

The oracle is the definition: each channel pair, read as a complex number, is multiplied
by ``e^{i·pos·ω_j}`` (pairs (j, j + R/2) in the "half" style, (2j, 2j + 1) interleaved).
transformers' Llama and GPT-J are compared in tests/integrations/test_rope_llama.py.

Shape legend: x (B, H, N, D), positions (N,) or (B, N), cos/sin (N, R) or (B, N, R).
"""

from __future__ import annotations

import typing

import pytest
import torch

import attnkit as ak
from attnkit.layers.rope import LinearScaling, Llama3Scaling, RoPE
from helpers.layers import DT, decode_in_chunks


def _by_complex(x: torch.Tensor, positions: torch.Tensor, rope: RoPE) -> torch.Tensor:
    """The definition, written with complex numbers: x (…, N, D) → rotated, float64."""
    d = x.shape[-1]
    r = rope.rotated_dims(d)
    inv = 1.0 / rope.theta ** (torch.arange(0, r, 2, dtype=DT) / r)          # (R/2,)
    if rope.scaling is not None:
        inv = rope.scaling.scale(inv)
    turn = torch.polar(torch.ones((), dtype=DT), positions.to(DT)[..., None] * inv)  # (…, N, R/2)
    if positions.dim() == 2:
        turn = turn[:, None]                                                   # (B, 1, N, R/2)
    xr = x[..., :r].to(DT)
    if rope.style == "half":
        z = torch.complex(xr[..., : r // 2], xr[..., r // 2:]) * turn
        out = torch.cat([z.real, z.imag], dim=-1)
    else:
        z = torch.complex(xr[..., 0::2], xr[..., 1::2]) * turn
        out = torch.stack([z.real, z.imag], dim=-1).flatten(-2)
    return torch.cat([out, x[..., r:].to(DT)], dim=-1)


SETTINGS = [
    RoPE(),
    RoPE(theta=500_000.0, style="interleaved"),
    RoPE(dims=6),
    RoPE(dims=4, style="interleaved", scaling=LinearScaling(4.0)),
    RoPE(theta=5e5, scaling=Llama3Scaling(factor=8.0, original_max_position=16)),
]


@pytest.mark.parametrize("rope", SETTINGS, ids=str)
def test_rotation_is_the_complex_definition(rope: RoPE) -> None:
    x = torch.randn(2, 3, 11, 10, dtype=DT)
    pos = torch.tensor([0, 1, 2, 3, 5, 8, 13, 21, 100, 1000, 12345])
    torch.testing.assert_close(rope(x, pos), _by_complex(x, pos, rope), rtol=0, atol=1e-12)
    torch.testing.assert_close(rope(x), _by_complex(x, torch.arange(11), rope), rtol=0,
                               atol=1e-12)
    if rope.dims is not None:                        # the other channels pass through
        assert torch.equal(rope(x)[..., rope.dims:], x[..., rope.dims:])


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_scores_depend_on_the_offset_only(style: str) -> None:
    rope = RoPE(style=style)
    q, k = torch.randn(2, 1, 1, 16, dtype=DT), torch.randn(2, 1, 1, 16, dtype=DT)
    s = [(rope(q, torch.tensor([m])) * rope(k, torch.tensor([n]))).sum()
         for m, n in ((7, 3), (107, 103), (4, 0))]
    torch.testing.assert_close(s[0], s[1], rtol=0, atol=1e-10)
    torch.testing.assert_close(s[0], s[2], rtol=0, atol=1e-10)
    assert (rope(q).norm(dim=-1) - q.norm(dim=-1)).abs().max() < 1e-12   # a rotation


def test_offsets_continue_positions_per_batch_or_shared() -> None:
    rope = RoPE()
    x = torch.randn(2, 2, 9, 8, dtype=DT)
    full = rope(x)
    torch.testing.assert_close(rope(x[:, :, 4:], offset=4), full[:, :, 4:], rtol=0, atol=0)
    per_row = rope(x[:, :, :3], offset=torch.tensor([0, 5]))              # (B,) cache lengths
    torch.testing.assert_close(per_row[0], full[0, :, :3], rtol=0, atol=0)
    torch.testing.assert_close(per_row[1], rope(x[1:, :, :3], offset=5)[0], rtol=0, atol=0)
    pos = torch.tensor([[0, 1, 2], [5, 6, 7]])
    torch.testing.assert_close(rope(x[:, :, :3], pos), per_row, rtol=0, atol=0)


def test_tables_and_apply_compose() -> None:
    x = torch.randn(2, 4, 5, 12, dtype=DT)
    pos = torch.arange(3, 8)
    cos, sin = ak.rope.cos_sin(pos, 8, theta=1e4, style="interleaved", dtype=DT)
    assert cos.shape == sin.shape == (5, 8) and cos.dtype == DT
    got = ak.rope.apply(x, cos, sin, style="interleaved")
    torch.testing.assert_close(got, RoPE(dims=8, style="interleaved")(x, pos), rtol=0, atol=0)
    cos_b, sin_b = ak.rope.cos_sin(torch.stack([pos, pos + 1]), 8, dtype=DT)   # (B, N, R)
    assert cos_b.shape == (2, 5, 8)
    ak.rope.apply(x, cos_b, sin_b)                                   # broadcasts over heads


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_dtype_and_device_are_kept_and_low_precision_is_accurate(dtype: torch.dtype) -> None:
    x = torch.randn(2, 3, 7, 16, dtype=DT)
    want = RoPE()(x, torch.arange(1000, 1007))
    got = RoPE()(x.to(dtype), torch.arange(1000, 1007))
    assert got.dtype == dtype and got.device == x.device and got.shape == x.shape
    naive_err = (x.to(dtype).double() - x).abs().max()               # rounding x itself
    assert (got.double() - want).abs().max() <= 2 * naive_err + 1e-6


def test_scalings_change_the_frequencies_as_defined() -> None:
    plain = ak.rope.inv_frequencies(64, 5e5)
    torch.testing.assert_close(ak.rope.inv_frequencies(64, 5e5, scaling=LinearScaling(4.0)),
                               plain / 4, rtol=0, atol=0)
    l3 = ak.rope.inv_frequencies(64, 5e5, scaling=Llama3Scaling(8.0, 1.0, 4.0, 8192))
    wavelen = 2 * torch.pi / plain
    assert torch.equal(l3[wavelen < 8192 / 4], plain[wavelen < 8192 / 4])       # kept
    torch.testing.assert_close(l3[wavelen > 8192], plain[wavelen > 8192] / 8, rtol=0, atol=0)
    mid = (wavelen >= 2048) & (wavelen <= 8192)
    assert mid.any() and bool(((l3[mid] < plain[mid]) & (l3[mid] > plain[mid] / 8)).all())


def test_gradients_flow_through_the_rotation() -> None:
    x = torch.randn(1, 2, 4, 6, dtype=DT, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: RoPE(dims=4)(t, torch.arange(2, 6)), (x,))


@pytest.mark.parametrize(("call", "err", "match"), [
    (lambda: RoPE(dims=5), ValueError, "even"),
    (lambda: RoPE(style="neox"), ValueError, "half"),
    (lambda: RoPE(theta=0.5), ValueError, "theta"),
    (lambda: RoPE(scaling=4.0), TypeError, "LinearScaling"),
    (lambda: LinearScaling(0), ValueError, "factor"),
    (lambda: Llama3Scaling(low_freq_factor=4.0, high_freq_factor=1.0), ValueError, "high_freq"),
    (lambda: RoPE()(torch.randn(3, 7)), ValueError, "even"),               # odd head width
    (lambda: RoPE(dims=8)(torch.randn(3, 6)), ValueError, "dims <= 6"),
    (lambda: RoPE()(torch.randn(3, 4), torch.tensor([0, -1, 2])), ValueError, ">= 0"),
    (lambda: RoPE()(torch.randn(3, 4), torch.tensor([0.0, 1, 2])), TypeError, "integers"),
    (lambda: RoPE()(torch.randn(3, 4), torch.arange(4)), ValueError, r"\(3,\)"),
    (lambda: RoPE()(torch.randn(3, 4), torch.arange(3), offset=2), ValueError, "not both"),
    (lambda: RoPE()(torch.randn(3, 4), offset=-1), ValueError, "offset"),
    (lambda: RoPE()(torch.randn(3, 4), offset=torch.tensor([1.5])), ValueError, "integer"),
    (lambda: ak.rope.apply(torch.randn(3, 4), *ak.rope.cos_sin(torch.arange(5), 4)),
     ValueError, "5 tokens"),
])
def test_errors_say_what_is_wrong(call, err, match) -> None:  # noqa: ANN001
    with pytest.raises(err, match=match):
        call()


# ------------------------------------------------------------------ MultiHeadAttention(rope=)
def _manual(m: ak.MultiHeadAttention, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    q, k, v = m.project_q(x), m.project_k(x), m.project_v(x)
    q, k = m.rope(q, positions), m.rope(k, positions)
    o = ak.attention(q, k, v, is_causal=True)
    return m.out_proj(o.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))


@pytest.mark.parametrize("cfg", [
    dict(d_model=32, n_heads=4, rope=True),
    dict(d_model=32, n_heads=4, n_kv_heads=2, qk_norm=True,
         rope=RoPE(theta=5e5, dims=4, style="interleaved")),
    dict(d_model=24, n_heads=6, n_kv_heads=1, head_dim=6, bias=True,
         rope=RoPE(scaling=LinearScaling(2.0))),
])
def test_layer_rotates_q_and_k_and_decodes_like_the_full_forward(cfg) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    m = ak.MultiHeadAttention(**cfg).to(DT)
    x = torch.randn(2, 11, cfg["d_model"], dtype=DT)
    full = m(x, is_causal=True)
    torch.testing.assert_close(full, _manual(m, x, torch.arange(11)), rtol=0, atol=1e-12)
    out, cache = decode_in_chunks(m, x, [5, 1, 1, 3, 1])
    torch.testing.assert_close(out, full, rtol=0, atol=1e-12)
    # the cache holds rotated keys, at positions 0 … 10
    torch.testing.assert_close(cache.k, m.rope(m.project_k(x)), rtol=0, atol=1e-12)
    # explicit positions are the default ones; shifted positions change nothing in a causal
    # self-attention over the same tokens (scores depend on offsets only)
    torch.testing.assert_close(m(x, is_causal=True, positions=torch.arange(11)), full,
                               rtol=0, atol=0)
    torch.testing.assert_close(m(x, is_causal=True, positions=torch.arange(11) + 40), full,
                               rtol=0, atol=1e-10)
    unbatched = m(x[0], is_causal=True)
    torch.testing.assert_close(unbatched, full[0], rtol=0, atol=1e-12)
    assert "rope=RoPE(" in repr(m)


def test_layer_without_rope_is_unchanged_and_rope_changes_the_output() -> None:
    torch.manual_seed(0)
    plain = ak.MultiHeadAttention(16, 2).to(DT)
    rotary = ak.MultiHeadAttention(16, 2, rope=True).to(DT)
    rotary.load_state_dict(plain.state_dict())                  # no parameters of its own
    x = torch.randn(1, 6, 16, dtype=DT)
    assert plain.rope is None and ak.MultiHeadAttention(16, 2, rope=False).rope is None
    assert (rotary(x, is_causal=True) - plain(x, is_causal=True)).abs().max() > 1e-3
    assert torch.equal(rotary(x[:, :1]), plain(x[:, :1]))       # position 0: no rotation


def test_layer_rope_errors() -> None:
    with pytest.raises(ValueError, match="even"):
        ak.MultiHeadAttention(10, 2, rope=True)                 # head_dim 5
    with pytest.raises(ValueError, match="dims <= 4"):
        ak.MultiHeadAttention(8, 2, rope=RoPE(dims=6))
    with pytest.raises(TypeError, match="RoPE"):
        ak.MultiHeadAttention(8, 2, rope="llama")
    m = ak.MultiHeadAttention(8, 2, rope=True)
    x = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match="self-attention"):
        m(x, torch.randn(2, 4, 8))
    with pytest.raises(ValueError, match="one position per token|\\(3,\\)"):
        m(x, positions=torch.arange(4))
    with pytest.raises(ValueError, match="batch"):
        m(x, positions=torch.arange(9).view(3, 3))
    with pytest.raises(ValueError, match="rope=True"):
        ak.MultiHeadAttention(8, 2)(x, positions=torch.arange(3))
    cache = ak.KVCache()
    with pytest.raises(TypeError, match="integers"):
        m(x, cache=cache, positions=torch.zeros(3))
    assert len(cache) == 0                                      # a failed call left it as it was


def test_exports_and_return_annotations() -> None:
    import attnkit.rope as rope_module

    assert ak.rope is rope_module and ak.rope.RoPE is RoPE
    assert ak.TorchStyleMultiheadAttention is ak.layers.TorchStyleMultiheadAttention
    for layer in (ak.MultiHeadAttention, ak.MultiHeadLatentAttention):
        returns = [typing.get_type_hints(f)["return"]
                   for f in typing.get_overloads(layer.forward)]
        assert returns == [torch.Tensor, tuple[torch.Tensor, torch.Tensor]], layer


def test_rotation_compiles_without_graph_breaks() -> None:
    rope = RoPE(theta=5e5, scaling=Llama3Scaling(original_max_position=64))
    x = torch.randn(2, 4, 9, 16)
    compiled = torch.compile(lambda t, p: rope(t, p), fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x, torch.arange(3, 12)), rope(x, torch.arange(3, 12)),
                               rtol=0, atol=0)
