"""Attention layers: multi-head (MHA / GQA / MQA), multi-head latent (MLA), and a KV cache.

The modules own projections only; every attention computation goes through
:func:`attnkit.attention` (``backend="auto"``), so the fastest backend that supports a call
— the decode backend for one query over a long cache, the tiled engine for long prompts —
is picked without the module knowing about it. Speed lives in the backends, not here.

What lives where::

    cache.py         KVCache: the tokens one layer has seen (k, v or MLA's latent), its owner
    paged.py         PagedKVCache: many sequences' k, v in a pool of pages, block tables,
                     fork (copy-on-write), free — for attnkit.attention_with_kvcache (serving)
    mha.py           MultiHeadAttention (MHA / GQA / MQA, qk_norm, tie_qk, softcap, dropout)
    mla.py           MultiHeadLatentAttention (absorbed and plain paths)
    norms.py         RMSNorm (QK-norm, MLA's latent norm)
    rope.py          rotary position embeddings (attnkit.rope): tables, apply, RoPE settings
    torch_compat.py  from_torch, torch_masks_to_attnkit, TorchStyleMultiheadAttention
    shared.py        what MHA and MLA share on every call: the one input check, the cache
                     step (append, undone if the call fails), attention() + weights, the
                     return path
    common.py        one copy of each small helper: shape_of, split_heads / merge_heads,
                     layer_label, argument checks

Shape legend::

    B     batch                       N, N_q  query tokens     N_k  key/value tokens
    d     d_model (input width)       d_kv   kv_dim (width of the cross-attention context)
    H     query heads (n_heads)       H_kv   key/value heads (n_kv_heads; 1 = MQA)
    d_k   head_dim (query/key width per head)      d_v   v_head_dim (value width per head)
    d_c   kv_latent_dim (MLA's shared latent)

    x        (B, N_q, d)      or (N_q, d) unbatched
    context  (B, N_k, d_kv)   cross-attention source (default: x itself)
    q        (B, H,    N_q, d_k)        per-head queries, split from x W_Qᵀ (B, N_q, H·d_k)
    k, v     (B, H_kv, N_k, d_k | d_v)  per-head keys and values
    weights  (B, H, N_q, N_k)          returned with ``need_weights=True``
    out      (B, N_q, d)               heads concatenated back to (B, N_q, H·d_v), then W_O

Masks follow :func:`attnkit.attention`: an :class:`attnkit.masks.Mask`, a bool tensor
(**True = may attend**) or a float tensor added to the logits, broadcastable to
``(B, H, N_q, N_k)``. PyTorch's ``nn.MultiheadAttention`` uses the opposite bool convention
(True = blocked); :class:`TorchStyleMultiheadAttention` and :func:`torch_masks_to_attnkit`
translate.

Caution
-------
- A :class:`KVCache` belongs to one layer: the first layer that writes to it owns it and
  another layer's call raises. It is made for inference: appending inside autograd (inputs
  that require grad) switches it to concatenation so gradients flow, which costs O(N)
  copies per step. A call that raises leaves its cache as it was.
- With a cache, ``is_causal=True`` aligns bottom-right (the last query sees the last key),
  which is what decoding needs; without a cache it is top-left, exactly like torch.
- A query with no allowed key gets output 0 (before W_O) where torch gives NaN.
- MLA's key/value up-projections carry no bias (a bias would not absorb into the query).
- ``rope`` (MultiHeadAttention only) rotates q and k before the cache append (the cache holds
  rotated keys); decoding positions continue from the cache length. Not for cross-attention.
- ``need_weights=True`` recomputes the weights with the reference (O(N_q·N_k) memory); the
  weights are the softmax before dropout.
"""

from __future__ import annotations

from . import rope
from .cache import KVCache
from .mha import MultiHeadAttention
from .mla import MultiHeadLatentAttention
from .norms import RMSNorm
from .paged import PagedKVCache
from .rope import RoPE
from .torch_compat import TorchStyleMultiheadAttention, torch_masks_to_attnkit

__all__ = [
    "KVCache",
    "MultiHeadAttention",
    "MultiHeadLatentAttention",
    "PagedKVCache",
    "RMSNorm",
    "RoPE",
    "TorchStyleMultiheadAttention",
    "rope",
    "torch_masks_to_attnkit",
]
