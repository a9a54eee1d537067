"""A Llama attention layer assembled from attnkit parts, checked against transformers'.

    python examples/rope_llama.py

Needs the transformers extra (``pip install "attnkit[transformers]"``); nothing is
downloaded: a tiny Llama configuration (4 query heads, 2 key/value heads, Llama 3's
θ = 500 000 with "llama3" frequency scaling) is built locally with random weights.

attnkit's side is ``ak.MultiHeadAttention(..., rope=ak.rope.RoPE(...))`` with the same
q/k/v/o weights (what ``attention_from_llama`` builds), run once over a prompt and then
token by token with an ``ak.KVCache``. transformers' side is ``LlamaAttention`` with its
own ``DynamicCache``. The printed numbers are the largest differences (float64).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import LlamaConfig  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaAttention  # noqa: E402

import attnkit as ak  # noqa: E402
import attnkit.integrations.transformers as akt  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=1, intermediate_size=128, vocab_size=32,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                       "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 32})
    cfg._attn_implementation = "sdpa"
    hf = LlamaAttention(cfg, layer_idx=0).double().eval()

    # attnkit: the same layer, by hand …
    rope = ak.rope.RoPE(theta=500000.0, scaling=ak.rope.Llama3Scaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=32))
    mine = ak.MultiHeadAttention(64, 4, n_kv_heads=2, rope=rope).double()
    for ours, theirs in ((mine.q_proj, hf.q_proj), (mine.k_proj, hf.k_proj),
                         (mine.v_proj, hf.v_proj), (mine.out_proj, hf.o_proj)):
        ours.weight.data.copy_(theirs.weight.data)
    # … or in one call: mine = akt.attention_from_llama(hf)
    assert akt.rope_from_config(cfg) == rope

    def position_embeddings(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope.tables(positions, 16, dtype=torch.float64)   # cos, sin (B, N, d_k)

    x = torch.randn(1, 12, 64, dtype=torch.float64)
    pos = torch.arange(12)[None]
    with torch.no_grad():
        ref, _ = hf(x, position_embeddings=position_embeddings(pos), attention_mask=None)
        got = mine(x, is_causal=True)
        print(f"prefill of 12 tokens:        max |attnkit - Llama| = "
              f"{(got - ref).abs().max():.1e}")

        hf_cache, cache = DynamicCache(config=cfg), ak.KVCache()
        hf(x[:, :4], position_embeddings=position_embeddings(pos[:, :4]), cache=hf_cache)
        mine(x[:, :4], cache=cache, is_causal=True)
        worst = 0.0
        for t in range(4, 12):                   # decoding: positions continue at len(cache)
            r, _ = hf(x[:, t:t + 1], position_embeddings=position_embeddings(pos[:, t:t + 1]),
                      cache=hf_cache)
            g = mine(x[:, t:t + 1], cache=cache, is_causal=True)
            worst = max(worst, (g - r).abs().max().item())
        print(f"decode 8 tokens with caches: max |attnkit - Llama| = {worst:.1e}  "
              f"(cache: {len(cache)} tokens, k {tuple(cache.k.shape)})")


if __name__ == "__main__":
    main()
