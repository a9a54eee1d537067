"""attnkit — scaled dot-product attention, the textbook and the engine.

    Attention(Q, K, V) = softmax(Q Kᵀ / √d_k + M) V

Attention is a soft dictionary: every query scores every allowed key, the scores become
weights that sum to 1 over the keys, and the weights mix the values.

Shape legend (PyTorch SDPA's layout)::

    q (..., H_q, N_q, D_k)   k (..., H_kv, N_k, D_k)   v (..., H_kv, N_k, D_v)
    out (..., H_q, N_q, D_v)

Quick use::

    import attnkit as ak
    out = ak.attention(q, k, v, is_causal=True)
    print(ak.explain(q, k, v, is_causal=True).to_text())
"""

from __future__ import annotations

import sys as _sys

from . import backends, cost, distributed, masks, scores
from .api import attention, scaled_dot_product_attention
from .explain import Trace, explain, explain_model
from .layers import (
    KVCache,
    MultiHeadAttention,
    MultiHeadLatentAttention,
    RMSNorm,
    TorchStyleMultiheadAttention,
    rope,
)
from .layers.paged import PagedKVCache
from .serving import attention_varlen, attention_with_kvcache

_sys.modules[__name__ + ".rope"] = rope      # `import attnkit.rope` (it lives in layers/)

__version__ = "0.2.0"

__all__ = ["MultiHeadAttention", "MultiHeadLatentAttention", "KVCache", "RMSNorm",
           "TorchStyleMultiheadAttention", "cost", "rope",
           "attention", "scaled_dot_product_attention", "explain", "explain_model", "Trace",
           "masks", "scores", "backends", "distributed",
           "PagedKVCache", "attention_with_kvcache", "attention_varlen",
           "__version__"]
