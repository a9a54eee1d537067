"""attention() as the torch custom operator attnkit::attention: torch.compile(fullgraph=True)
of MultiHeadAttention with every operator-carried mask, torch.export, the one-warning eager
fallback, and the operator's own contract (opcheck, autograd). The backward's own tests
(saved output and LSE, no forward, dropout's pattern): test_ops_backward.py.

Compiles are few and small (one fullgraph compile of a model that exercises every mask)."""

from __future__ import annotations

import warnings

import pytest
import torch

import attnkit as ak
from attnkit import ops
from attnkit.backends.native import loader
from helpers.recorders import OpOutputs

# Inductor compiles C++ on CPU: without a compiler torch.compile itself cannot run
needs_inductor = pytest.mark.skipif(loader.compiler() is None,
                                    reason="torch.compile (Inductor) needs a C++ compiler")


pytestmark = pytest.mark.usefixtures("fresh_compile")   # conftest: no cached graphs


B, N, D = 2, 12, 32


def _masks() -> list[tuple[object, bool]]:
    """(mask, is_causal) for every mask kind an operator argument carries."""
    ids = torch.tensor([0] * 5 + [1] * 7)
    g = torch.Generator().manual_seed(0)
    return [
        (None, True),
        (ak.masks.padding([N, 7]), False),
        (ak.masks.sliding_window(4), False),
        (ak.masks.document(ids) & ak.masks.causal(), False),
        (ak.masks.padding([9, 12]) & ak.masks.sliding_window(3, causal=False), False),
        (torch.rand(B, 1, N, N, generator=g) > 0.3, False),
        (torch.randn(1, 1, N, N, generator=g).masked_fill(torch.eye(N) == 0, -torch.inf)
         * 0.5, False),
    ]


class _Many(torch.nn.Module):
    """One MHA (GQA, softcap) called with every mask, plus the SDPA call: one graph."""

    def __init__(self) -> None:
        super().__init__()
        self.mha = ak.MultiHeadAttention(D, 4, n_kv_heads=2, softcap=30.0)

    def forward(self, x: torch.Tensor, masks: list[tuple[object, bool]]) -> torch.Tensor:
        out = x.new_zeros(())
        for i, (m, causal) in enumerate(masks):
            out = out + (self.mha(x, mask=m, is_causal=causal) * (i + 1)).sum()
        q = x.view(B, N, 4, D // 4).transpose(1, 2)             # (B, 4, N, 8)
        fm = masks[-1][0]
        s = ak.scaled_dot_product_attention(q, q[:, :2], q[:, :2], attn_mask=fm,
                                            enable_gqa=True)
        return out + s.square().sum()


def _compare(model: torch.nn.Module, compiled: torch.nn.Module, *args: object,
             **kw: object) -> None:
    x = args[0]

    def run(f):  # noqa: ANN001, ANN202
        y = f(*args, **kw)
        return y, torch.autograd.grad(y.sum(), [x, *model.parameters()])

    y0, g0 = run(model)
    y1, g1 = run(compiled)
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-5)
    for a, b in zip(g1, g0, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_mha_compiles_fullgraph_with_every_mask_and_gives_eager_numbers():
    # Dynamo with fullgraph=True (a graph break raises) + AOTAutograd (the fake and the
    # autograd formula traced); Inductor's code generation is the next test's
    torch.manual_seed(0)
    model = _Many()
    x = torch.randn(B, N, D, requires_grad=True)
    _compare(model, torch.compile(model, fullgraph=True, backend="aot_eager"), x, _masks())


@needs_inductor
def test_mha_compiles_with_inductor_forward_and_backward():
    torch.manual_seed(5)
    mha = ak.MultiHeadAttention(D, 4, n_kv_heads=2, softcap=30.0)
    x = torch.randn(B, N, D, requires_grad=True)
    _compare(mha, torch.compile(mha, fullgraph=True), x, None, mask=ak.masks.padding([N, 5]))


def test_export_captures_the_operator():
    torch.manual_seed(1)

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mha = ak.MultiHeadAttention(D, 4)
            self.mask = ak.masks.padding([N, 5]) & ak.masks.causal()

        def forward(self, x: torch.Tensor, bool_mask: torch.Tensor) -> torch.Tensor:
            return self.mha(x, mask=self.mask) + self.mha(x, mask=bool_mask)

    layer, x = Layer(), torch.randn(B, N, D)
    bm = torch.rand(N, N) > 0.5
    ep = torch.export.export(layer, (x, bm))
    nodes = [n for n in ep.graph.nodes if n.target is torch.ops.attnkit.attention.default]
    assert len(nodes) == 2
    x2, bm2 = torch.randn(B, N, D), torch.rand(N, N) > 0.5
    torch.testing.assert_close(ep.module()(x2, bm2), layer(x2, bm2), rtol=1e-6, atol=1e-6)


def test_what_an_operator_cannot_carry_runs_eagerly_with_one_warning():
    torch.manual_seed(2)
    mha = ak.MultiHeadAttention(D, 4)
    x = torch.randn(B, N, D)
    fn_mask = ak.masks.from_fn(lambda b, h, q, k: k <= q)
    f = torch.compile(mha, backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        outs = [f(x, mask=fn_mask) for _ in range(5)]
    ours = [w for w in caught if "attnkit.attention under torch.compile" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert "from_fn" in str(ours[0].message) and "eagerly" in str(ours[0].message)
    for o in outs:
        torch.testing.assert_close(o, mha(x, mask=fn_mask))

    def with_score_mod(q: torch.Tensor) -> torch.Tensor:
        return ak.attention(q, q, q, score_mod=lambda s, b, h, i, j: s - (i - j).abs())

    q = torch.randn(1, 2, 6, 8)
    with pytest.warns(UserWarning, match="a Python score_mod cannot be an operator argument"):
        got = torch.compile(with_score_mod, backend="eager")(q)
    torch.testing.assert_close(got, with_score_mod(q))


def test_eager_calls_do_not_go_through_the_operator():
    q = torch.randn(2, 2, 5, 8, requires_grad=True)
    with OpOutputs() as mode:
        ak.attention(q, q, q, is_causal=True).sum().backward()
    assert not any("attnkit" in s for s in mode.seen)


def _op_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: object) -> tuple:
    a = ops.op_args(kw.pop("mask", None), q.shape[-2], k.shape[-2])
    assert not isinstance(a, str)
    return (q, k, v, a.tensor, a.bands, a.kv_lengths, a.q_lengths, a.doc_ids, a.doc_kv_ids,
            kw.get("scale"), kw.get("softcap"), kw.get("dropout_p", 0.0), kw.get("seed"),
            "auto")


@pytest.mark.parametrize("mask", [
    ak.masks.causal("bottom_right") & ak.masks.padding([7, 3], q_lengths=[4, 2]),
    "float",
], ids=["structured", "float"])
def test_opcheck(mask):
    torch.manual_seed(3)
    q, k, v = (torch.randn(2, 2, n, 8, dtype=torch.float64, requires_grad=True)
               for n in (4, 7, 7))
    if mask == "float":
        mask = torch.randn(2, 1, 4, 7, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(ops.attention_op, _op_args(q, k, v, mask=mask, softcap=5.0))


def test_operator_gradients_match_the_eager_call():
    """The operator's own backward (from the saved output and LSE), K/V broadcast over the
    batch, against eager autograd; dropout's pattern: tests/test_ops_backward.py."""
    torch.manual_seed(4)
    q, k, v = (torch.randn(2, 4, n, 8, dtype=torch.float64, requires_grad=True)
               for n in (5, 9, 9))
    kv1 = [t[:1].detach().requires_grad_() for t in (k, v)]         # K/V batch broadcast
    out, lse = ops.attention_op(*_op_args(q, *kv1, mask=ak.masks.sliding_window(3)))
    g = torch.randn_like(out)
    got = torch.autograd.grad((out * g).sum() + lse.sum(), [q, *kv1])
    ref, ref_lse = ak.attention(q, *kv1, mask=ak.masks.sliding_window(3), return_lse=True)
    want = torch.autograd.grad((ref * g).sum() + ref_lse.sum(), [q, *kv1])
    torch.testing.assert_close(out, ref)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("build", [lambda: ak.masks.window(3, 1),
                                   lambda: ak.masks.window(3, 1, align="top_left"),
                                   lambda: ak.masks.window(-1, 2),
                                   lambda: ak.masks.band(-2, 5)])
def test_any_band_is_an_operator_argument(build):
    """Flash-attn windows and ``masks.band`` travel as op arguments (they used to fall back)."""
    m = build()
    a = ops.op_args(m, 8, 6)
    assert not isinstance(a, str)
    r = ops.rebuild_mask(a.bands, None, None, None, None)
    assert torch.equal(r.to_dense(8, 6), m.to_dense(8, 6))
    assert torch.equal(r.to_dense(5, 9), m.to_dense(5, 9))


# ------------------------------------------------ need_weights=True (attnkit::attention_weights)
def _weight_masks() -> list[tuple[object, bool]]:
    g = torch.Generator().manual_seed(6)
    bm = torch.rand(B, 1, N, N, generator=g) > 0.4
    bm[1, :, 3] = False                                    # a fully masked row: weights 0
    return [(None, True), (ak.masks.padding([N, 7]), False), (bm, False)]


class _WithWeights(torch.nn.Module):
    """MHA (GQA, softcap) with need_weights=True under each mask, and torch's call."""

    def __init__(self) -> None:
        super().__init__()
        self.mha = ak.MultiHeadAttention(D, 4, n_kv_heads=2, softcap=30.0)
        self.torch_style = ak.TorchStyleMultiheadAttention(D, 4, batch_first=True)

    def forward(self, x: torch.Tensor, masks: list[tuple[object, bool]],
                ) -> tuple[torch.Tensor, ...]:
        res: list[torch.Tensor] = []
        for m, causal in masks:
            res += self.mha(x, mask=m, is_causal=causal, need_weights=True)
        pad = torch.arange(N) >= torch.tensor([[N], [8]])  # key_padding_mask: True = pad
        res += self.torch_style(x, x, x, key_padding_mask=pad, need_weights=True,
                                average_attn_weights=False)
        return tuple(res)


def test_mha_need_weights_compiles_fullgraph_with_eager_outputs_weights_and_gradients():
    torch.manual_seed(7)
    model = _WithWeights()
    x = torch.randn(B, N, D, requires_grad=True)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    masks = _weight_masks()
    want, got = model(x, masks), compiled(x, masks)
    assert len(got) == len(want) == 8
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert want[-3][1, :, 3].abs().sum() == 0              # the fully masked row
    torch.testing.assert_close(want[1].sum(-1)[0], torch.ones(4, N))   # rows sum to 1
    # gradients through outputs and weights alike
    gs = [torch.randn_like(t) for t in want]
    params = [x, *model.parameters()]
    g0 = torch.autograd.grad(sum((t * g).sum() for t, g in zip(want, gs, strict=True)),
                             params, allow_unused=True)
    g1 = torch.autograd.grad(sum((t * g).sum() for t, g in zip(got, gs, strict=True)),
                             params, allow_unused=True)
    for a, b in zip(g1, g0, strict=True):
        if b is None:
            assert a is None
            continue
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@needs_inductor
def test_mha_need_weights_compiles_with_inductor():
    torch.manual_seed(8)
    mha = ak.MultiHeadAttention(D, 4)
    x = torch.randn(B, N, D)
    f = torch.compile(mha, fullgraph=True)
    with torch.no_grad():
        out, w = f(x, mask=ak.masks.padding([N, 5]) & ak.masks.causal(), need_weights=True)
        ref, ref_w = mha(x, mask=ak.masks.padding([N, 5]) & ak.masks.causal(),
                         need_weights=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=1e-6)


def test_export_captures_the_weights_operator():
    torch.manual_seed(9)

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mha = ak.MultiHeadAttention(D, 4, n_kv_heads=2)

        def forward(self, x: torch.Tensor, bool_mask: torch.Tensor,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
            o1, w1 = self.mha(x, is_causal=True, need_weights=True)
            o2, w2 = self.mha(x, mask=bool_mask, need_weights=True)
            return o1, w1, o2, w2

    layer, x = Layer(), torch.randn(B, N, D)
    bm = torch.rand(N, N) > 0.5
    ep = torch.export.export(layer, (x, bm))
    targets = [n.target for n in ep.graph.nodes]
    assert targets.count(torch.ops.attnkit.attention_weights.default) == 2
    assert targets.count(torch.ops.attnkit.attention.default) == 2
    x2, bm2 = torch.randn(B, N, D), torch.rand(N, N) > 0.5
    for a, b in zip(ep.module()(x2, bm2), layer(x2, bm2), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mask", [
    ak.masks.causal("bottom_right") & ak.masks.padding([7, 3], q_lengths=[4, 2]),
    "float",
], ids=["structured", "float"])
def test_weights_opcheck(mask):
    torch.manual_seed(10)
    q, k = (torch.randn(2, 2, n, 8, dtype=torch.float64, requires_grad=True) for n in (4, 7))
    if mask == "float":
        mask = torch.randn(2, 1, 4, 7, dtype=torch.float64, requires_grad=True)
    a = ops.op_args(mask, 4, 7)
    assert not isinstance(a, str)
    args = (q, k, a.tensor, a.bands, a.kv_lengths, a.q_lengths, a.doc_ids, a.doc_kv_ids,
            None, 5.0)
    torch.library.opcheck(ops.attention_weights_op, args)
    w = ops.attention_weights_op(*args)
    want = ops.attention_weights(q, k, k, mask=mask, softcap=5.0)      # eager: the reference
    torch.testing.assert_close(w, want, rtol=0, atol=0)
    g = torch.randn_like(w)
    leaves = [t for t in (q, k, a.tensor) if t is not None and t.requires_grad]
    for x, y in zip(torch.autograd.grad(w, leaves, g), torch.autograd.grad(want, leaves, g),
                    strict=True):
        torch.testing.assert_close(x, y)


def test_weights_of_a_mask_an_operator_cannot_carry_run_eagerly_with_one_warning():
    torch.manual_seed(11)
    mha = ak.MultiHeadAttention(D, 4)
    x = torch.randn(B, N, D)
    fn_mask = ak.masks.from_fn(lambda b, h, q, k: k <= q)
    f = torch.compile(mha, backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        outs = [f(x, mask=fn_mask, need_weights=True) for _ in range(3)]
    ours = [w for w in caught if "attention weights under torch.compile" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert "from_fn" in str(ours[0].message)
    ref, ref_w = mha(x, mask=fn_mask, need_weights=True)
    for o, w in outs:
        torch.testing.assert_close(o, ref)
        torch.testing.assert_close(w, ref_w)
