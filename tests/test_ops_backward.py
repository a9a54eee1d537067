"""The custom operator's backward: it reuses the forward's saved output and LSE.

- compiled forward + backward (``fullgraph=True``) equals the eager call and the float64
  reference, on the native kernel's backward and on the closed form (``ATTNKIT_NATIVE=0``),
  over awkward sizes, N_q != N_k both ways, GQA, K/V batch broadcast, every mask kind an
  operator carries (fully masked rows included), a float mask with its gradient, softcap,
  and NaN in masked K/V rows;
- the compiled backward calls no forward (counted at the engines' entries);
- dropout: the operator's forward and backward share one pattern, redrawn from the seed;
- no private dispatch-key guard in the package.

Compiles are few (Dynamo + AOTAutograd through ``backend="aot_eager"``: one graph per
dtype, holding every case); Inductor's code generation is tested in test_ops.py.
"""

from __future__ import annotations

import math
import pathlib
from collections.abc import Callable

import pytest
import torch

import attnkit as ak
from attnkit import api, eager, ops
from attnkit.backends import native

Tensor = torch.Tensor


pytestmark = pytest.mark.usefixtures("fresh_compile")   # conftest: no cached graphs


# ------------------------------------------------------------------ the cases
# (name, q shape, k shape, D_v, mask maker (q, k dtype → mask), is_causal, softcap)
def _bool_mask(dtype: torch.dtype) -> Tensor:
    g = torch.Generator().manual_seed(1)
    m = torch.rand(2, 1, 17, 5, generator=g) > 0.4            # (B, 1, N_q, N_k)
    m[0, 0, 3] = False                                        # a fully masked row
    return m


def _float_mask(dtype: torch.dtype) -> Tensor:
    g = torch.Generator().manual_seed(2)
    m = torch.randn(1, 4, 13, 29, generator=g, dtype=dtype)   # per head, batch broadcast
    m = m.masked_fill(torch.rand(13, 29, generator=g) > 0.7, -math.inf)
    m[..., 5, :] = -math.inf                                  # a fully masked row
    return m.requires_grad_()


def _zero_float_mask(dtype: torch.dtype) -> Tensor:
    """Zeros and −∞ only: eager drops the (all-zero) bias, yet its gradient is wanted."""
    m = torch.zeros(13, 29, dtype=dtype).masked_fill(torch.ones(13, 29).tril(3) == 0, -math.inf)
    return m.requires_grad_()


CASES: list[tuple[str, tuple[int, ...], tuple[int, ...], int, Callable[[torch.dtype], object],
                  bool, float | None]] = [
    ("causal N_q<N_k GQA", (2, 4, 13, 11), (2, 2, 29, 11), 7, lambda dt: None, True, None),
    ("window+padding q_lengths", (2, 3, 29, 8), (2, 3, 13, 8), 8,
     lambda dt: ak.masks.sliding_window(4, causal=False) & ak.masks.padding([13, 6], [29, 9]),
     False, 30.0),
    ("document & causal, K/V batch 1", (3, 4, 23, 16), (1, 1, 23, 16), 16,
     lambda dt: ak.masks.document(torch.tensor([0] * 9 + [1] * 14)) & ak.masks.causal(),
     False, None),
    ("bool tensor, empty row, N_q>N_k", (2, 6, 17, 9), (2, 2, 5, 9), 12, _bool_mask,
     False, 5.0),
    ("float mask with grad, softcap", (2, 4, 13, 8), (2, 1, 29, 8), 8, _float_mask,
     False, 2.0),
    ("zero float mask with grad, 3-D", (2, 13, 8), (1, 29, 8), 8, _zero_float_mask,
     False, None),
    ("bottom-right causal, 2-D", (7, 5), (19, 5), 3,
     lambda dt: ak.masks.causal("bottom_right"), False, None),
]


_MASKS: dict[tuple[int, torch.dtype], object] = {}    # one mask object per case and dtype
                                                      # (a new one would recompile)


def _inputs(dtype: torch.dtype, nan_kv: bool = False) -> list[tuple[Tensor, Tensor, Tensor,
                                                                     object]]:
    """(q, k, v, mask) per case, leaves that require grad. ``nan_kv``: NaN/inf in K/V rows
    that a padding mask hides (case 1), and in a key that some queries see (case 0)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i, (_, qs, ks, dv, make_mask, _, _) in enumerate(CASES):
        q = torch.randn(qs, generator=g, dtype=dtype)
        k = torch.randn(ks, generator=g, dtype=dtype)
        v = torch.randn((*ks[:-1], dv), generator=g, dtype=dtype)
        if nan_kv and i == 0:
            k[0, 0, 10] = math.nan                  # causal: queries 10.. of heads 0-1 see it
        if nan_kv and i == 1:
            k[1, :, 6:], v[1, :, 8:] = math.nan, math.inf     # keys 6.. padded in batch 1
        mask = _MASKS.setdefault((i, dtype), make_mask(dtype))
        out.append((q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), mask))
    return out


def _all_cases(inputs: list[tuple[Tensor, Tensor, Tensor, object]], backend: str = "auto",
               ) -> list[Tensor]:
    """Every case's (out, lse) — one graph when compiled."""
    res = []
    for (q, k, v, mask), (_, _, _, _, _, causal, cap) in zip(inputs, CASES, strict=True):
        out, lse = ak.attention(q, k, v, mask=mask, is_causal=causal, softcap=cap,
                                backend=backend, return_lse=True)
        res += [out, lse]
    return res


def _leaves(inputs: list[tuple[Tensor, Tensor, Tensor, object]]) -> list[Tensor]:
    return [t for case in inputs for t in case
            if isinstance(t, torch.Tensor) and t.requires_grad]


def _fwd_bwd(f: Callable[..., list[Tensor]], inputs: list[tuple[Tensor, Tensor, Tensor, object]],
             ) -> tuple[list[Tensor], tuple[Tensor, ...]]:
    """Outputs and the gradients of a fixed random weighting of them (out and lse alike)."""
    outs = f(inputs)
    g = torch.Generator().manual_seed(3)
    loss = sum((torch.randn(o.shape, generator=g, dtype=o.dtype)
                * torch.where(torch.isfinite(o), o, 0.0)).sum() for o in outs)
    return outs, torch.autograd.grad(loss, _leaves(inputs))


def _reference(inputs: list[tuple[Tensor, Tensor, Tensor, object]],
               ) -> tuple[list[Tensor], tuple[Tensor, ...]]:
    """The float64 reference (eager, torch autograd) of the same cases."""
    return _fwd_bwd(lambda i: _all_cases(i, backend="reference"), inputs)


def _err(a: Tensor, b: Tensor) -> float:
    """Largest difference of the finite entries; the non-finite ones must agree exactly."""
    assert torch.equal(torch.isfinite(a), torch.isfinite(b)), "different non-finite entries"
    assert torch.equal(torch.isnan(a), torch.isnan(b))
    fin = torch.isfinite(a)
    return (a.double() - b.double())[fin].abs().max().item() if fin.any() else 0.0


def test_compiled_fwd_bwd_equal_eager_and_the_float64_reference(monkeypatch):
    """One compile, run on the native kernel's backward and on the closed form (the
    backward decides at run time, as the forward's engine choice does)."""
    compiled = torch.compile(_all_cases, fullgraph=True, backend="aot_eager")
    engines = ["native", "closed form"] if native.available() else ["closed form"]
    for engine, nan_kv in [(e, n) for e in engines for n in (False, True)]:
        if engine == "closed form":
            monkeypatch.setenv("ATTNKIT_NATIVE", "0")   # read at run time, by the backward too
        inputs = _inputs(torch.float64, nan_kv)
        got, got_g = _fwd_bwd(compiled, inputs)
        eager, eager_g = _fwd_bwd(_all_cases, inputs)
        ref, ref_g = _reference(inputs)
        for a, b, c in zip([*got, *got_g], [*eager, *eager_g], [*ref, *ref_g], strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
            assert _err(a, b) < 1e-12 and _err(a, c) < 1e-12, engine
        # NaN K/V rows reach only the queries that see them, and no gradient
        assert all(bool(torch.isfinite(t).all()) for t in got_g)
        assert bool(got[0].isnan().any()) == nan_kv and bool(torch.isfinite(got[2]).all())
        # a fully masked row: output 0, LSE −∞, no gradient to its query
        out_bool, lse_bool, dq_bool = got[6], got[7], got_g[9]
        assert out_bool[0, :, 3].abs().max() == 0
        assert bool((lse_bool[0, :, 3] == -math.inf).all())
        assert dq_bool[0, :, 3].abs().max() == 0


def test_compiled_float32_is_within_the_design_tolerance_of_float64():
    """float32 error vs the float64 reference within 2× the float32 reference's own error
    (gradients 3×), plus a few float32 ulps of the value's size."""
    compiled = torch.compile(_all_cases, fullgraph=True, backend="aot_eager")
    inputs32 = _inputs(torch.float32)
    inputs64 = [tuple(t.detach().double().requires_grad_(t.requires_grad)
                      if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                      for t in case) for case in inputs32]
    got, got_g = _fwd_bwd(compiled, inputs32)
    ref32, ref32_g = _reference(inputs32)
    ref64, ref64_g = _reference(inputs64)
    n_out = len(got)
    for i, (a, b, c) in enumerate(zip([*got, *got_g], [*ref32, *ref32_g], [*ref64, *ref64_g],
                                      strict=True)):
        factor = 2.0 if i < n_out else 3.0
        finite = c[torch.isfinite(c)]
        floor = 8 * torch.finfo(torch.float32).eps * (finite.abs().max().item()
                                                       if finite.numel() else 1.0)
        assert _err(a, c) <= factor * _err(b, c) + floor, (i, _err(a, c), _err(b, c))


# ------------------------------------------------------------------ no forward in backward
def test_the_compiled_backward_calls_no_forward(monkeypatch):
    if not native.available():
        pytest.skip(f"native kernel unavailable: {native.why_unavailable()}")
    mha = ak.MultiHeadAttention(32, 4, n_kv_heads=2, softcap=20.0)
    x = torch.randn(2, 24, 32, requires_grad=True)
    bm = torch.rand(24, 24) > 0.3
    f = torch.compile(lambda x: mha(x, is_causal=True) + mha(x, mask=bm), fullgraph=True,
                      backend="aot_eager")
    calls = {"eager engine": 0, "native forward": 0, "closed-form forward": 0,
             "native backward": 0, "closed-form backward": 0}

    def counted(name: str, fn: Callable[..., object]) -> Callable[..., object]:
        def wrapper(*a: object, **kw: object) -> object:
            calls[name] += 1
            return fn(*a, **kw)
        return wrapper

    for mod, attr, name in [(eager, "_run", "eager engine"), (native, "_forward", "native forward"),
                            (ops, "_closed_form_forward", "closed-form forward"),
                            (native, "backward_problem", "native backward"),
                            (ops, "_closed_form_grads", "closed-form backward")]:
        monkeypatch.setattr(mod, attr, counted(name, getattr(mod, attr)))
    y = f(x)
    assert calls["eager engine"] == calls["native forward"] == 2        # the forward: 2 calls
    calls.update(dict.fromkeys(calls, 0))
    y.square().sum().backward()
    assert calls == {"eager engine": 0, "native forward": 0, "closed-form forward": 0,
                     "native backward": 2, "closed-form backward": 0}
    # the same call on the closed form (no native kernel): still no forward in the backward
    monkeypatch.setenv("ATTNKIT_NATIVE", "0")
    y = f(x)
    calls.update(dict.fromkeys(calls, 0))
    y.square().sum().backward()
    assert calls == {"eager engine": 0, "native forward": 0, "closed-form forward": 0,
                     "native backward": 0, "closed-form backward": 2}


# ------------------------------------------------------------------ dropout
def _dropout_reference(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, p: float,
                       keep: Tensor) -> Tensor:
    """softmax(q·kᵀ/√D + mask) with ``keep`` (B, H_q, N_q, N_k) applied, in float64, by autograd."""
    x = (q @ k.repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2)) \
        * q.shape[-1] ** -0.5 + mask
    w = torch.softmax(x, -1)
    return torch.where(keep, w / (1 - p), 0.0) @ v.repeat_interleave(q.shape[1] // v.shape[1], 1)


@pytest.mark.parametrize("block_elements", [ops._BLOCK_ELEMENTS, 2 * 9 * 4])
def test_dropout_forward_and_backward_share_the_pattern(block_elements, monkeypatch):
    """The operator's dropout is drawn block by block from its seed: the forward and the
    backward see one pattern (several blocks too), whatever the global generator does."""
    monkeypatch.setattr(ops, "_BLOCK_ELEMENTS", block_elements)
    q = torch.randn(2, 4, 7, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 9, 8, dtype=torch.float64, requires_grad=True) for _ in "kv")
    mask = torch.randn(2, 1, 7, 9, dtype=torch.float64, requires_grad=True)
    seed, p_drop = torch.tensor(77), 0.3
    args = (q, k, v, mask, [], None, None, None, None, None, None, p_drop, seed, "auto")
    out, lse = ops.attention_op(*args)
    torch.rand(100)                                         # the global generator moves on
    g = torch.randn_like(out)
    got = torch.autograd.grad((out * g).sum() + lse.sum(), [q, k, v, mask])
    prep = api.prepare(q, k, v, mask=mask, dropout_p=p_drop)
    keep = torch.cat(list(ops._kept(prep.problem, seed)), dim=2)     # (B, H_q, N_q, N_k)
    assert 0.5 < keep.float().mean() < 0.9
    ref = _dropout_reference(q, k, v, mask, p_drop, keep)
    ref_lse = torch.logsumexp((q @ k.repeat_interleave(2, 1).transpose(-1, -2))
                              * 8 ** -0.5 + mask, -1)
    want = torch.autograd.grad((ref * g).sum() + ref_lse.sum(), [q, k, v, mask])
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    again, _ = ops.attention_op(*args)
    assert torch.equal(again, out)                         # the seed decides the pattern


def test_dropout_needs_a_seed():
    q = torch.randn(1, 1, 3, 4)
    with pytest.raises(ValueError, match="needs a seed"):
        ops.attention_op(q, q, q, None, [], None, None, None, None, None, None, 0.5, None,
                         "auto")


# ------------------------------------------------------------------ structure
def test_no_private_dispatch_key_guard_in_the_package():
    src = pathlib.Path(ak.__file__).parent
    for path in src.rglob("*.py"):
        text = path.read_text()
        for name in ("_ForceDispatchKeyGuard", "_dispatch_tls_local", "_AutoDispatchBelow"):
            assert name not in text, f"{path.relative_to(src)} uses torch._C.{name}"
