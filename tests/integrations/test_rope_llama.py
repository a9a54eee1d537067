"""A Llama attention layer built from attnkit parts equals transformers' ``LlamaAttention``.

The attnkit side is :func:`attnkit.integrations.transformers.attention_from_llama`: an
``ak.MultiHeadAttention`` (GQA) with the model's q/k/v/o weights and ``rope=`` from the
config, decoding with an ``ak.KVCache``. The transformers side is ``LlamaAttention`` itself
(its projections, ``apply_rotary_pos_emb``, its ``DynamicCache``, torch SDPA in float64)
fed ``position_embeddings`` by transformers' own recipe (``cat(freqs, freqs)``,
cos/sin) — in float64, because transformers computes its tables in float32; the tables
themselves are compared with transformers' (``LlamaRotaryEmbedding`` and the
``ROPE_INIT_FUNCTIONS`` of the "default", "linear" and "llama3" rope types) at float32
precision.

Shape legend: x (B, N, d), positions (B, N), cos/sin (B, N, d_k), out (B, N, d).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytest.importorskip(
    "transformers",
    reason="Hugging Face transformers is not installed: pip install 'attnkit[transformers]'",
)

from transformers import LlamaConfig  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama.modeling_llama import (  # noqa: E402
    LlamaAttention,
    LlamaRotaryEmbedding,
)

import attnkit as ak  # noqa: E402
import attnkit.integrations.transformers as akt  # noqa: E402

DT = torch.float64
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def _config(rope_parameters: dict[str, Any] | None = None, **kw: Any) -> LlamaConfig:
    base = {"vocab_size": 16, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 64}
    cfg = LlamaConfig(**{**base, **kw}, rope_parameters=rope_parameters)
    cfg._attn_implementation = "sdpa"       # float64 all through (eager's softmax is float32)
    return cfg


def _pair(cfg: LlamaConfig) -> tuple[LlamaAttention, ak.MultiHeadAttention]:
    hf = LlamaAttention(cfg, layer_idx=0).to(DT).eval()
    return hf, akt.attention_from_llama(hf)


def _position_embeddings(cfg: LlamaConfig, positions: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' recipe (LlamaRotaryEmbedding.forward) in float64: (B, N, d_k) each."""
    rope = akt.rope_from_config(cfg)
    inv = ak.rope.inv_frequencies(cfg.head_dim, rope.theta, scaling=rope.scaling)
    freqs = positions[..., None].to(DT) * inv                       # (B, N, d_k/2)
    emb = torch.cat((freqs, freqs), dim=-1)                         # (B, N, d_k)
    return emb.cos(), emb.sin()


CONFIGS = {
    "default theta 1e4": {},
    "theta 5e5, biases": {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
                          "attention_bias": True},
    "linear x4": {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}},
    "llama3": {"rope_parameters": LLAMA3},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_and_token_by_token_decode_equal_llama_attention(name: str) -> None:
    torch.manual_seed(0)
    cfg = _config(**CONFIGS[name])
    hf, mine = _pair(cfg)
    b, n, n0 = 2, 9, 4
    x = torch.randn(b, n, cfg.hidden_size, dtype=DT)
    pos = torch.arange(n).expand(b, n)
    with torch.no_grad():
        ref, _ = hf(x, position_embeddings=_position_embeddings(cfg, pos), attention_mask=None)
        torch.testing.assert_close(mine(x, is_causal=True), ref, rtol=0, atol=1e-10)
        # decode: a prompt of n0 tokens, then one token at a time, each with a cache
        hf_cache, cache = DynamicCache(config=cfg), ak.KVCache()
        ref0, _ = hf(x[:, :n0], position_embeddings=_position_embeddings(cfg, pos[:, :n0]),
                     attention_mask=None, cache=hf_cache)
        got0 = mine(x[:, :n0], cache=cache, is_causal=True)
        torch.testing.assert_close(got0, ref0, rtol=0, atol=1e-10)
        for t in range(n0, n):
            ref_t, _ = hf(x[:, t:t + 1], attention_mask=None, cache=hf_cache,
                          position_embeddings=_position_embeddings(cfg, pos[:, t:t + 1]))
            got_t = mine(x[:, t:t + 1], cache=cache, is_causal=True)   # positions from len(cache)
            torch.testing.assert_close(got_t, ref_t, rtol=0, atol=1e-10)
            torch.testing.assert_close(got_t, ref[:, t:t + 1], rtol=0, atol=1e-10)
        assert len(cache) == n and cache.k.shape == (b, cfg.num_key_value_heads, n, 8)
        # the comparison has teeth: another theta gives another answer
        other = ak.MultiHeadAttention(32, 4, n_kv_heads=2, rope=ak.rope.RoPE(theta=77.0),
                                      bias=mine.q_proj.bias is not None).to(DT)
        other.load_state_dict(mine.state_dict())
        assert (other(x, is_causal=True) - ref).abs().max() > 1e-3


def test_per_sequence_positions_match_llama_attention() -> None:
    """Rows of one batch at different positions (left padding, packed continuation)."""
    torch.manual_seed(1)
    cfg = _config(rope_parameters=LLAMA3)
    hf, mine = _pair(cfg)
    x = torch.randn(2, 5, 32, dtype=DT)
    pos = torch.stack([torch.arange(5), torch.arange(11, 16)])      # (B, N)
    with torch.no_grad():
        ref, _ = hf(x, position_embeddings=_position_embeddings(cfg, pos), attention_mask=None)
        torch.testing.assert_close(mine(x, is_causal=True, positions=pos), ref, rtol=0,
                                   atol=1e-10)


@pytest.mark.parametrize("params", [
    None,
    {"rope_type": "default", "rope_theta": 5e5},
    {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0},
    LLAMA3,
    {**LLAMA3, "original_max_position_embeddings": 8192, "factor": 32.0},
])
def test_tables_equal_transformers_rotary_embedding(params: dict[str, Any] | None) -> None:
    """transformers computes in float32: agreement to float32 precision, at long positions."""
    cfg = _config(rope_parameters=params, head_dim=64, hidden_size=256)
    rope = akt.rope_from_config(cfg)
    theirs_inv, _ = ROPE_INIT_FUNCTIONS[cfg.rope_parameters["rope_type"]](cfg) \
        if cfg.rope_parameters["rope_type"] != "default" \
        else LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    mine_inv = ak.rope.inv_frequencies(64, rope.theta, scaling=rope.scaling)
    torch.testing.assert_close(mine_inv.float(), theirs_inv, rtol=2e-6, atol=0)
    pos = torch.tensor([[0, 1, 2, 100, 1000]])
    cos32, sin32 = LlamaRotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), pos)
    cos, sin = rope.tables(pos, 64, dtype=torch.float32)
    # float32 angles at position 1000 carry ~1e-4 error in transformers' own tables
    torch.testing.assert_close(cos, cos32, rtol=0, atol=2e-4)
    torch.testing.assert_close(sin, sin32, rtol=0, atol=2e-4)
    torch.testing.assert_close(cos[:, :3], cos32[:, :3], rtol=0, atol=1e-6)


def test_rope_from_config_reads_partial_rotary_and_refuses_unknown_types() -> None:
    cfg = _config(partial_rotary_factor=0.5)
    assert akt.rope_from_config(cfg).dims == 4
    cfg = _config(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                   "original_max_position_embeddings": 32})
    with pytest.raises(akt.UnsupportedFeatureError, match="yarn"):
        akt.rope_from_config(cfg)


def test_attention_from_llama_refuses_what_it_does_not_convert() -> None:
    with pytest.raises(TypeError, match="q_proj"):
        akt.attention_from_llama(torch.nn.Linear(2, 2))
    hf, _ = _pair(_config())
    hf.q_norm = torch.nn.Identity()
    with pytest.raises(akt.UnsupportedFeatureError, match="q_norm"):
        akt.attention_from_llama(hf)


def test_interleaved_style_equals_gptj_rotary_functions() -> None:
    """GPT-J: rotate_every_two on the first rotary_dim channels, sin/cos repeat-interleaved."""
    gptj = pytest.importorskip("transformers.models.gptj.modeling_gptj")
    torch.manual_seed(2)
    rotary_dim, n = 8, 12
    x = torch.randn(2, n, 3, 16, dtype=DT)                       # GPT-J's layout (B, N, H, D)
    pos = torch.arange(5, 5 + n)
    sincos = gptj.create_sinusoidal_positions(64, rotary_dim).to(DT)[pos][None]  # (1, N, R)
    sin, cos = torch.split(sincos, rotary_dim // 2, dim=-1)
    want = torch.cat([gptj.apply_rotary_pos_emb(x[..., :rotary_dim], sin, cos),
                      x[..., rotary_dim:]], dim=-1)                 # (B, N, H, D)
    got = ak.rope.RoPE(dims=rotary_dim, style="interleaved")(x.transpose(1, 2), pos)
    # GPT-J's table is float32-computed: float32 agreement
    torch.testing.assert_close(got.transpose(1, 2), want, rtol=0, atol=1e-5)
