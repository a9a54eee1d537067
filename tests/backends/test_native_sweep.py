"""A seeded sweep over the native kernel's inputs, forward and backward, against float64.

Each case draws a shape (batch, GQA group, N_q, N_k, D_k, D_v), a memory layout (contiguous,
SDPA's (B, N, H, D) transposed view, a slice of a wider last dim), a dtype, a mask (none,
causal either alignment, sliding window, padding with an empty sequence and NaN past the
lengths, documents, prefix-LM, a bool tensor with fully masked rows) and score terms
(scale, negative scale, soft-cap, ALiBi, a relative-bias table, a Python score_mod). The
call runs on ``tiled`` — asserted to be the native kernel — and on ``decode`` for short
query blocks, and is held to DESIGN's rules: float64 within 1e-9 of the reference, lower
precisions within 2× (gradients 3×) of the same reference run in that precision
(``conftest.assert_low_precision_close``), masked K/V never reaching the results.

The sweep is one test per case (ids name the draw), seeded: 160 cases in ~5-30 s on 2 cores
(the first run builds a few score_mods). On the code before issue 19 it fails every case with
a negative scale and a soft-cap.

Shape legend: q (B, H_q, N_q, D_k), k (B, H_kv, N_k, D_k), v (B, H_kv, N_k, D_v).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import attnkit as ak
from attnkit.api import prepare
from attnkit.backends import native
from attnkit.backends.tiled import counting
from helpers.tolerance import assert_low_precision_close, assert_low_precision_grad_close

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernel unavailable: "
                                                               f"{native.why_unavailable()}")
F64 = torch.float64
N_CASES = 160
DTYPES = [torch.float32, torch.float32, torch.bfloat16, torch.float16, F64]


@dataclass
class Case:
    seed: int
    b: int
    h_kv: int
    group: int
    n_q: int
    n_k: int
    d_k: int
    d_v: int
    layout: str
    dtype: torch.dtype
    mask: str
    terms: str

    @property
    def id(self) -> str:
        return (f"{self.seed}-{str(self.dtype)[6:]}-{self.b}x{self.h_kv * self.group}/"
                f"{self.h_kv}x{self.n_q}x{self.n_k}x{self.d_k}/{self.d_v}-{self.layout}-"
                f"{self.mask}-{self.terms}")


def draw(seed: int) -> Case:
    r = random.Random(seed)
    d_k = r.choice([8, 16, 59, 64, 111])
    return Case(seed, r.choice([1, 2]), r.choice([1, 2]), r.choice([1, 2, 3]),
                r.choice([1, 3, 33, 97, 130]), r.choice([1, 7, 64, 113, 200]), d_k,
                r.choice([d_k, d_k, 24]), r.choice(["contiguous", "bnhd", "sliced"]),
                r.choice(DTYPES),
                r.choice(["none", "causal", "causal_br", "window", "padding", "document",
                          "prefix", "bool"]),
                r.choice(["none", "scale", "neg_scale", "softcap", "neg_scale_plain", "alibi",
                          "relbias", "score_mod"]))


CASES = [draw(s) for s in range(N_CASES)]


def layout(t: torch.Tensor, how: str) -> torch.Tensor:
    """The same values in another memory layout (a view, as users pass them)."""
    if how == "bnhd":                                  # SDPA's (B, N, H, D) transposed
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    if how == "sliced":                                # a slice of a wider last dim
        wide = torch.cat([t, torch.full_like(t[..., :3], float("nan"))], dim=-1)
        return wide[..., : t.shape[-1]]
    return t


def inputs(c: Case) -> tuple[list[torch.Tensor], dict[str, Any], torch.Tensor | None]:
    """float64 (q, k, v), the call's options, and the (B, N_k) rows a mask removes (or None)."""
    g = torch.Generator().manual_seed(1000 + c.seed)
    h_q = c.h_kv * c.group
    q = torch.randn(c.b, h_q, c.n_q, c.d_k, generator=g, dtype=F64)
    k = torch.randn(c.b, c.h_kv, c.n_k, c.d_k, generator=g, dtype=F64)
    v = torch.randn(c.b, c.h_kv, c.n_k, c.d_v, generator=g, dtype=F64)
    opts: dict[str, Any] = {}
    removed = None
    m = ak.masks
    if c.mask == "causal":
        opts["is_causal"] = True
    elif c.mask == "causal_br":
        opts["mask"] = m.causal("bottom_right")
    elif c.mask == "window":
        opts["mask"] = m.sliding_window(max(1, c.n_k // 3))
    elif c.mask == "padding":
        lengths = torch.tensor([max(1, c.n_k - 5), 0][: c.b])
        opts["mask"] = m.padding(lengths)
        removed = torch.arange(c.n_k)[None, :] >= lengths[:, None]           # (B, N_k)
    elif c.mask == "document":
        q_ids, kv_ids = (torch.arange(n) * 3 // n for n in (c.n_q, c.n_k))  # 3 documents
        opts["mask"] = m.document(q_ids.expand(c.b, -1), kv_ids=kv_ids.expand(c.b, -1))
    elif c.mask == "prefix":
        opts["mask"] = m.prefix_lm(max(1, c.n_k // 2))
    elif c.mask == "bool":
        allowed = torch.rand(c.b, 1, c.n_q, c.n_k, generator=g) < 0.6
        allowed[:, :, :: 4] = False                                          # empty rows
        opts["mask"] = allowed
    if c.terms == "scale":
        opts["scale"] = 0.37
    elif c.terms == "neg_scale":
        opts["scale"] = -0.21
        opts["softcap"] = 2.5
    elif c.terms == "softcap":
        opts["softcap"] = 3.0
    elif c.terms == "neg_scale_plain":
        opts["scale"] = -0.5
    elif c.terms == "alibi":
        opts["score_mod"] = ak.scores.alibi(h_q)
    elif c.terms == "relbias":
        table = torch.randn(h_q, 2 * 16 + 1, generator=g, dtype=F64)
        opts["score_mod"] = ak.scores.relative_bias(table, 16)
    elif c.terms == "score_mod":
        slopes = torch.linspace(0.1, 0.6, h_q, dtype=F64)

        def distance(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
            # in the score's dtype: a float32 sqrt here would be float32 (docs: score_mod.py)
            return score - slopes[h] * (q_idx - kv_idx).abs().to(score.dtype).sqrt()

        opts["score_mod"] = distance
    if removed is not None:                            # NaN where the mask removes keys
        nan = removed[:, None, :, None].expand_as(k[..., :1])
        k = torch.where(nan, float("nan"), k)
        v = torch.where(removed[:, None, :, None].expand_as(v[..., :1]), float("nan"), v)
    return [q, k, v], opts, removed


def run(ins: list[torch.Tensor], dtype: torch.dtype, backend: str, how: str, opts: dict,
        grad: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = [layout(t.detach().to(dtype), how).requires_grad_(grad) for t in ins]
    out = ak.attention(*leaves, backend=backend, **opts)
    if not grad:
        return out.detach(), []
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=F64)
    return out.detach(), list(torch.autograd.grad(out, leaves, dout.to(dtype)))


def keep_valid(t: torch.Tensor, removed: torch.Tensor | None) -> torch.Tensor:
    """Zero the K/V rows a padding mask removes (their gradient is 0; NaN input there)."""
    return t if removed is None else torch.where(removed[:, None, :, None], 0.0, t)


def summand_scale(ins: list[torch.Tensor], removed: torch.Tensor | None) -> float:
    """The scale of the terms a gradient sums: |dO|·|V|·|K| (dS·K, dSᵀ·Q, Pᵀ·dO). Where a
    gradient is a cancellation — a row with one key has dS = P(dP − D) = 0 exactly — any
    FlashAttention-style backward gives a few roundings of this scale, not of the answer."""
    q, k, v = (keep_valid(t, removed) if i else t for i, t in enumerate(ins))
    return 3.0 * max(q.abs().max().item(), k.abs().max().item()) * v.abs().max().item()


def compare(c: Case, got: torch.Tensor, grads: list[torch.Tensor], ins: list[torch.Tensor],
            opts: dict, removed: torch.Tensor | None, what: str) -> None:
    ref, gref = run(ins, F64, "reference", "contiguous", opts, bool(grads))
    assert torch.isfinite(got).all(), f"{what}: non-finite output"
    if c.dtype == F64:
        torch.testing.assert_close(got, ref, atol=1e-9, rtol=1e-9, msg=what)
    else:
        low, glow = run(ins, c.dtype, "reference", "contiguous", opts, bool(grads))
        assert_low_precision_close(got, low, ref, what=f"{what} output")
    scale = summand_scale(ins, removed)                # |dO| <= ~3 (seeded randn)
    for name, a, r, i in zip("qkv", grads, gref, range(3), strict=False):
        a = keep_valid(a, removed) if name != "q" else a
        r = keep_valid(r, removed) if name != "q" else r
        assert torch.isfinite(a).all(), f"{what} d{name}: non-finite"
        if removed is not None and name != "q":
            masked = grads[i].double()[removed[:, None, :, None].expand_as(grads[i])]
            assert (masked == 0).all(), f"{what} d{name}: a removed key got a gradient"
        if c.dtype == F64:
            torch.testing.assert_close(a, r, atol=1e-9, rtol=1e-9, msg=f"{what} d{name}")
        else:
            lo = keep_valid(glow[i], removed) if name != "q" else glow[i]
            assert_low_precision_grad_close(a, lo, r, what=f"{what} d{name}",
                                            magnitude=max(scale, r.abs().max().item()))


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_sweep(c: Case) -> None:
    ins, opts, removed = inputs(c)
    with counting() as n:
        got, grads = run(ins, c.dtype, "tiled", c.layout, opts, grad=True)
    assert n["native"] >= 1, f"the native kernel did not run this call: {n}"
    compare(c, got, grads, ins, opts, removed, "tiled")
    decode = ak.backends.get("decode")
    short = [t.to(c.dtype) for t in ins]
    if c.n_q <= 3 and not decode.not_supported_reasons(prepare(*short, **opts).problem):
        with torch.no_grad():                          # the decode engine's own kernel path
            got, _ = run(ins, c.dtype, "decode", c.layout, opts, grad=False)
        compare(c, got, [], ins, opts, removed, "decode")
