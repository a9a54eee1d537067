"""``torch.autocast`` around attnkit: attnkit runs in the region's dtype exactly as torch runs
``F.scaled_dot_product_attention`` there (torch 2.13 lists SDPA among autocast's
lower-precision ops on CPU): q, k, v and a float mask — float64 excepted — cast to the
region's dtype (bfloat16 or float16), the call itself with autocast off, gradients flowing
back to the inputs' own dtypes. Checked eagerly (``attention``, ``scaled_dot_product_attention``,
the layers), on the operators (``torch.compile(fullgraph=True)``, ``torch.export``), and in a
training step of a tiny model against float64 by the low-precision rule of the suite.

Shape legend: q (B, H_q, N, D), k / v (B, H_kv, N_k, D); x (B, N, d); tokens (B, N).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import attnkit as ak
from attnkit.backends.native import loader
from helpers.oracle import oracle
from helpers.tolerance import assert_low_precision_close, assert_low_precision_grad_close

LOW = [torch.bfloat16, torch.float16]
pytestmark = pytest.mark.usefixtures("fresh_compile")   # conftest: no cached graphs
needs_inductor = pytest.mark.skipif(loader.compiler() is None,
                                    reason="torch.compile (Inductor) needs a C++ compiler")


def _qkv(dtype: torch.dtype = torch.float32, n: int = 97, grad: bool = False,
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (2, 4, n, 59), k / v (2, 2, n + 16, 59): GQA, N_q != N_k, an awkward D."""
    q = torch.randn(2, 4, n, 59, dtype=dtype)
    k = torch.randn(2, 2, n + 16, 59, dtype=dtype)
    v = torch.randn(2, 2, n + 16, 59, dtype=dtype)
    return tuple(t.requires_grad_(grad) for t in (q, k, v))  # type: ignore[return-value]


# ------------------------------------------------------------------ eager: torch's rule
@pytest.mark.parametrize("dtype", LOW)
def test_sdpa_under_autocast_gives_torch_dtypes_and_the_precast_numbers(dtype):
    """fp32 in → the region's dtype out, as torch; the numbers are those of the same call on
    inputs cast to that dtype outside autocast (the call's own kernels are not autocast);
    gradients come back in fp32, as torch's."""
    q, k, v = _qkv(grad=True)
    bias = torch.randn(1, 4, 97, 113, requires_grad=True)         # a learnt float mask
    outs, grads = {}, {}
    for name, fn in (("torch", F.scaled_dot_product_attention),
                     ("attnkit", ak.scaled_dot_product_attention)):
        with torch.autocast("cpu", dtype=dtype):
            outs[name] = fn(q, k, v, attn_mask=bias, enable_gqa=True)
        grads[name] = torch.autograd.grad(outs[name].float().square().sum(), (q, k, v, bias))
    assert outs["attnkit"].dtype == outs["torch"].dtype == dtype
    assert [g.dtype for g in grads["attnkit"]] == [g.dtype for g in grads["torch"]] \
        == [torch.float32] * 4
    # (with gradients too, so that the same engine runs as in the autocast call: the
    # Python engines pick by whether a gradient is needed, when the native kernel is off)
    precast = ak.scaled_dot_product_attention(
        *(t.detach().to(dtype).requires_grad_() for t in (q, k, v)),
        attn_mask=bias.detach().to(dtype).requires_grad_(), enable_gqa=True)
    assert torch.equal(outs["attnkit"], precast)
    # both within the suite's rule of the float64 answer on the cast inputs
    q64, k64, v64, b64 = (t.detach().to(dtype).double() for t in (q, k, v, bias))
    ref64, _, _ = oracle(q64, k64, v64, bias=b64)
    lowp, _, _ = oracle(q64, k64, v64, bias=b64, dtype=dtype)
    for name in outs:
        assert_low_precision_close(outs[name], lowp, ref64, what=name)


@pytest.mark.parametrize("dtype", LOW)
def test_attention_under_autocast_runs_in_the_region_dtype(dtype):
    q, k, v = _qkv()
    with torch.autocast("cpu", dtype=dtype):
        out, lse = ak.attention(q, k, v, is_causal=True, return_lse=True)
        mixed_in = (q.to(torch.bfloat16), k, v.to(torch.float16))
        mixed = ak.attention(*mixed_in, is_causal=True)
    want, want_lse = ak.attention(*(t.to(dtype) for t in (q, k, v)), is_causal=True,
                                  return_lse=True)
    assert out.dtype == mixed.dtype == dtype
    assert lse.dtype == torch.float32                             # LSE stays fp32
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    # bf16 / fp32 / fp16 mixed: each cast to the region's dtype, as torch casts them
    assert torch.equal(mixed, ak.attention(*(t.to(dtype) for t in mixed_in), is_causal=True))


def test_float64_is_left_alone_and_float64_mixed_with_float32_is_refused_as_in_torch():
    q, k, v = _qkv(torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ak.attention(q, k, v, is_causal=True)
        sdpa = ak.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        assert F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              enable_gqa=True).dtype == torch.float64
        with pytest.raises(RuntimeError):                         # torch: bf16 q, f64 k
            F.scaled_dot_product_attention(q.float(), k, v.float(), enable_gqa=True)
        with pytest.raises(TypeError, match="share one dtype"):
            ak.attention(q.float(), k, v.float())
    plain = ak.attention(q, k, v, is_causal=True)
    assert out.dtype == sdpa.dtype == torch.float64
    assert torch.equal(out, plain) and torch.equal(sdpa, plain)


def test_float_masks_cast_as_in_torch_and_bool_masks_and_mask_objects_unchanged():
    q, k, v = _qkv()
    bias = torch.randn(97, 113) * 3
    keep = torch.rand(97, 113) > 0.3
    with torch.autocast("cpu", dtype=torch.bfloat16):
        f32_mask = ak.attention(q, k, v, mask=bias)
        bool_mask = ak.attention(q, k, v, mask=keep)
        window = ak.attention(q, k, v, mask=ak.masks.sliding_window(8))
        f64_sdpa = None
        with pytest.raises(RuntimeError):                        # torch refuses a f64 mask
            F.scaled_dot_product_attention(q, q, q, attn_mask=torch.zeros(97, 97).double())
        with pytest.raises(TypeError, match="attn_mask"):        # and so does attnkit's SDPA
            f64_sdpa = ak.scaled_dot_product_attention(q, q, q,
                                                       attn_mask=torch.zeros(97, 97).double())
        f64_mask = ak.attention(q, k, v, mask=bias.double())     # attention(): added in fp32
    b = (q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert f64_sdpa is None
    assert torch.equal(f32_mask, ak.attention(*b, mask=bias.bfloat16()))   # bias rounded
    assert torch.equal(bool_mask, ak.attention(*b, mask=keep))
    assert torch.equal(window, ak.attention(*b, mask=ak.masks.sliding_window(8)))
    assert torch.equal(f64_mask, ak.attention(*b, mask=bias.double()))


def test_backward_inside_the_region_gives_the_gradients_of_a_backward_outside_it():
    q, k, v = _qkv(grad=True)
    grads = []
    for inside in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ak.attention(q, k, v, is_causal=True)
            if inside:
                grads.append(torch.autograd.grad(out.float().square().sum(), (q, k, v)))
        if not inside:
            grads.append(torch.autograd.grad(out.float().square().sum(), (q, k, v)))
    for a, b in zip(*grads, strict=True):
        assert a.dtype == torch.float32 and torch.equal(a, b)


def test_numpy_inputs_run_unchanged_under_autocast():
    q, k, v = (t.numpy() for t in _qkv(n=9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ak.attention(q, k, v)
    assert out.dtype == q.dtype
    assert (out == ak.attention(q, k, v)).all()


@pytest.mark.parametrize("need_weights", [False, True])
def test_layers_under_autocast_give_torch_multihead_attention_dtypes(need_weights):
    x = torch.randn(2, 9, 16)
    torch_mha = nn.MultiheadAttention(16, 4, batch_first=True)
    ours = ak.TorchStyleMultiheadAttention.from_torch(torch_mha)
    mha = ak.MultiHeadAttention(16, 4, n_kv_heads=2)
    mla = ak.MultiHeadLatentAttention(16, 4, kv_latent_dim=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, want_w = torch_mha(x, x, x, need_weights=need_weights)
        got, got_w = ours(x, x, x, need_weights=need_weights)
        with_mask = mha(x, mask=torch.randn(9, 9), need_weights=need_weights)
        latent = mla(x, is_causal=True, need_weights=need_weights)
    assert got.dtype == want.dtype == torch.bfloat16
    assert (got_w is None) == (want_w is None)
    if need_weights:
        assert got_w.dtype == want_w.dtype
        with_mask, latent = with_mask[0], latent[0]
    assert with_mask.dtype == latent.dtype == torch.bfloat16
    for t in (got, with_mask, latent):
        assert torch.isfinite(t).all()


# ------------------------------------------------------------------ the operators
@pytest.mark.parametrize("dtype", LOW)
def test_operator_casts_by_the_region_dtype_and_leaves_float64_alone(dtype):
    q, k, v = _qkv(n=17)
    mask = torch.randn(17, 33)
    args = ([], None, None, None, None, None, None, 0.0, None, "auto")
    with torch.autocast("cpu", dtype=dtype):
        out, lse = torch.ops.attnkit.attention(q, k, v, mask, *args)
        out64, _ = torch.ops.attnkit.attention(q.double(), k.double(), v.double(),
                                               mask.double(), *args)
        w = torch.ops.attnkit.attention_weights(q, k, mask, [], None, None, None, None,
                                                None, None)
    assert out.dtype == w.dtype == dtype and lse.dtype == torch.float32
    assert out64.dtype == torch.float64
    assert torch.equal(out, ak.attention(q.to(dtype), k.to(dtype), v.to(dtype),
                                         mask=mask.to(dtype)))


class _Attend(nn.Module):
    """Causal SDPA with a float ``bias`` on (B, H, N, D) heads by ``fn`` (the causal part as
    −∞ in the float mask: torch's math kernel refuses a mask with ``is_causal``), recording
    the dtype of each output."""

    def __init__(self, fn: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.fn, self.seen = fn, []

    def forward(self, q, k, v, bias):  # noqa: ANN001, ANN201
        n = q.shape[-2]
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        out = self.fn(q, k, v, attn_mask=bias.masked_fill(~causal, -torch.inf),
                      enable_gqa=True)
        self.seen.append(out.dtype)
        return out


def _naive(dtype: torch.dtype) -> Callable[..., torch.Tensor]:
    """SDPA by the formula done naively in ``dtype`` (the suite's low-precision reference)."""
    def fn(q, k, v, *, attn_mask, enable_gqa):  # noqa: ANN001, ANN202
        with torch.autocast("cpu", enabled=False):
            out, _, _ = oracle(q, k, v, bias=attn_mask, dtype=dtype)
        return out
    return fn


class TinyLM(nn.Module):
    """Embedding → causal GQA attention with a learnt additive bias → logits. q and k are
    scaled by an fp32 position table (as RoPE's tables are kept), which makes them fp32
    again under autocast: the attention call itself must cast them."""

    V, D, H, H_KV, N = 37, 32, 4, 2, 23

    def __init__(self, fn: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.emb = nn.Embedding(self.V, self.D)
        self.q = nn.Linear(self.D, self.D)
        self.kv = nn.Linear(self.D, 2 * self.D // (self.H // self.H_KV))
        self.bias = nn.Parameter(0.1 * torch.randn(self.H, self.N, self.N))
        self.out = nn.Linear(self.D, self.D)
        self.head = nn.Linear(self.D, self.V)
        self.attend = _Attend(fn)
        self.register_buffer("table", 1 + 0.1 * torch.rand(self.N, self.D // self.H))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b, n = tokens.shape
        d_h = self.D // self.H
        x = self.emb(tokens)                                        # (B, N, D)
        q = self.q(x).view(b, n, self.H, d_h).transpose(1, 2)       # (B, H, N, d_h)
        k, v = self.kv(x).view(b, n, 2, self.H_KV, d_h).permute(2, 0, 3, 1, 4)
        q, k = q * self.table, k * self.table                       # fp32 again
        o = self.attend(q, k, v, self.bias)                         # (B, H, N, d_h)
        return self.head(x + self.out(o.transpose(1, 2).reshape(b, n, self.D)))


def _step(model: nn.Module, tokens: torch.Tensor, dtype: torch.dtype | None,
          ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One training step (forward and loss under autocast when ``dtype``, backward, SGD):
    → (logits, the gradients by parameter name)."""
    params = dict(getattr(model, "_orig_mod", model).named_parameters())   # compiled too
    opt = torch.optim.SGD(params.values(), lr=0.1)
    opt.zero_grad()
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        logits = model(tokens)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).double(), tokens[:, 1:].flatten())
    loss.backward()
    grads = {n: p.grad.clone() for n, p in params.items()}
    before = {n: p.detach().clone() for n, p in params.items()}
    opt.step()
    for n, p in params.items():
        assert torch.isfinite(p).all() and not torch.equal(p, before[n]), n
    return logits, grads


def _ak_attention(q, k, v, *, attn_mask, enable_gqa):  # noqa: ANN001, ANN202
    """``attnkit.attention`` with SDPA's keywords: under torch.compile the operator gets the
    fp32 inputs, so its own autocast rule casts them."""
    return ak.attention(q, k, v, mask=attn_mask)


ATTNKIT = {"sdpa": ak.scaled_dot_product_attention, "attention": _ak_attention}


@pytest.mark.parametrize(("dtype", "call", "compile_backend"), [
    (torch.bfloat16, "sdpa", None), (torch.float16, "attention", None),
    (torch.bfloat16, "sdpa", "aot_eager"), (torch.bfloat16, "attention", "aot_eager"),
    pytest.param(torch.bfloat16, "attention", "inductor", marks=needs_inductor),
])
def test_training_step_under_autocast_matches_sdpa_dtypes_and_the_float64_rule(
        dtype, call, compile_backend):
    """A forward + backward + optimizer step of a tiny model under autocast, with attnkit in
    place of torch's SDPA (eager, or compiled with fullgraph=True): the attention and the
    logits in torch's dtypes, every gradient finite and in torch's dtype, and logits and
    gradients within the suite's low-precision rule of the float64 model (the naive
    low-precision formula in its place as the yardstick)."""
    tokens = torch.randint(0, TinyLM.V, (3, TinyLM.N))
    base = TinyLM(F.scaled_dot_product_attention)
    models = {}
    for name, fn in (("torch", F.scaled_dot_product_attention), ("attnkit", ATTNKIT[call]),
                     ("naive", _naive(dtype)), ("float64", _naive(torch.float64))):
        models[name] = copy.deepcopy(base)
        models[name].attend.fn = fn
    models["float64"].double()
    run = {name: models[name] for name in models}
    if compile_backend is not None:
        run["attnkit"] = torch.compile(models["attnkit"], fullgraph=True,
                                       backend=compile_backend)
    results = {name: _step(m, tokens, None if name == "float64" else dtype)
               for name, m in run.items()}
    (logits, grads), (want_logits, want_grads) = results["attnkit"], results["torch"]
    assert models["attnkit"].attend.seen == models["torch"].attend.seen == [dtype]
    assert logits.dtype == want_logits.dtype
    assert {n: g.dtype for n, g in grads.items()} == {n: g.dtype for n, g in want_grads.items()}
    lowp, ref64 = results["naive"], results["float64"]
    assert_low_precision_close(logits, lowp[0], ref64[0], what="logits")
    for n, g in grads.items():
        assert_low_precision_grad_close(g, lowp[1][n], ref64[1][n], what=f"d {n}")
        # and as close to float64 as torch's own SDPA is, within the DESIGN factor
        err, torch_err = ((x.double() - ref64[1][n]).abs().max().item()
                          for x in (g, want_grads[n]))
        assert err <= 2 * torch_err + 1e-6, (n, err, torch_err)


@pytest.mark.parametrize("call", sorted(ATTNKIT))
def test_export_carries_the_autocast_rule(call):
    """torch.export of a module with an autocast region: after decomposition the graph
    casts q, k, v and the mask, then calls attnkit::attention in bfloat16."""
    fn = ATTNKIT[call]

    class M(nn.Module):
        def forward(self, q, k, v, bias):  # noqa: ANN001, ANN202
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn(q, k, v, attn_mask=bias, enable_gqa=True)

    q, k, v = _qkv(n=17)
    bias = torch.randn(17, 33)
    ep = torch.export.export(M(), (q, k, v, bias)).run_decompositions()
    calls = [n for n in ep.graph.nodes if n.target is torch.ops.attnkit.attention.default]
    assert len(calls) == 1
    assert [a.meta["val"].dtype for a in calls[0].args[:4]] == [torch.bfloat16] * 4
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = fn(q, k, v, attn_mask=bias, enable_gqa=True)
    assert torch.equal(ep.module()(q, k, v, bias), eager)
