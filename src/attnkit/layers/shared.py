"""What MultiHeadAttention and MultiHeadLatentAttention share on every call: one input
check, one cache step, one attention call and one return path.

A layer's forward reads::

    call = check_call(layer, x, context, value, cache, mask, is_causal)  # nothing changed yet
    q, k, v = projections of call.x, call.k_src, call.v_src
    with cache_step(layer, cache, k=k, v=v) as kv:   # append; undone if the block raises
        o, weights = attend(q, kv["k"], kv["v"], mask=call.mask, ...)
    return finish(layer, o, weights, call, need_weights)

Shape legend: as :mod:`attnkit.layers` (x (B, N_q, d), context (B, N_k, d_kv),
q (B, H, N_q, d_k), k/v (B, H_kv, N_k, ·), weights (B, H, N_q, N_k), out (B, N_q, d)).

Caution
-------
- With a cache, ``is_causal=True`` aligns bottom-right (the last query sees the last key),
  which is what decoding needs; without a cache it is top-left, exactly like torch.
- ``need_weights=True`` recomputes the weights with the reference (O(N_q·N_k) memory); the
  weights are the softmax before dropout. Under torch.compile / torch.export they are one
  ``attnkit::attention_weights`` operator node (:func:`attnkit.ops.attention_weights`), so
  ``fullgraph=True`` compiles with the masks ``attention()`` itself carries as an operator.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import masks as _masks
from .. import ops as _ops
from ..api import attention
from .cache import KVCache, check_cache
from .common import check_input, merge_heads, shape_of

__all__ = ["Call", "check_call", "cache_step", "attend", "attention_weights", "finish"]


@dataclass
class Call:
    """One validated layer call."""

    x: torch.Tensor            # (B, N_q, d)
    k_src: torch.Tensor        # (B, N_k, d_kv)   the keys' source (x itself for self-attention)
    v_src: torch.Tensor        # (B, N_k, d_kv)   the values' source (usually k_src)
    mask: Any                  # for attention(): None, a Mask or a tensor
    is_causal: bool
    unbatched: bool            # x came as (N_q, d)


def check_call(layer: nn.Module, x: Any, context: Any, value: Any, cache: Any, mask: Any,
               is_causal: bool) -> Call:
    """Validate a layer call before anything runs or any cache changes.

    ``layer`` has ``d_model``, ``kv_dim`` and ``out_proj``; ``value`` (MHA only) is a
    separate source for the values, default ``context``.
    """
    w = layer.out_proj.weight
    unbatched = isinstance(x, torch.Tensor) and x.dim() == 2
    x3 = check_input(x, layer.d_model, "x", w)
    if cache is not None:
        check_cache(cache, layer)
    if is_causal and mask is not None:
        raise ValueError(
            "give either mask=... or is_causal=True, not both: combine them as "
            "mask=attnkit.masks.causal() & your_mask"
        )
    if is_causal and cache is not None:
        # earlier tokens are in the cache: causal aligns bottom-right; one new query under
        # bottom-right causal sees every cached key, which is no mask at all
        mask, is_causal = (None if x3.shape[1] == 1 else
                           _masks.causal(align="bottom_right")), False
    if context is None:
        if value is not None:
            raise ValueError("value=... is a separate source for the values of "
                             "cross-attention: pass context=... (the keys' source) with it")
        if layer.kv_dim != layer.d_model:
            raise ValueError(
                f"this layer reads keys/values from width kv_dim={layer.kv_dim} but x has "
                f"width d_model={layer.d_model}: pass context (B, N_k, {layer.kv_dim}) for "
                "cross-attention"
            )
        return Call(x3, x3, x3, mask, is_causal, unbatched)
    if cache is not None:
        raise ValueError(
            "a KVCache is for self-attention decoding; for cross-attention project the "
            "context once and call without cache (context=None is required with cache=...)"
        )
    k_src = check_input(context, layer.kv_dim, "context", w)
    v_src = k_src if value is None or value is context else \
        check_input(value, layer.kv_dim, "value", w)
    if k_src.shape[0] != x3.shape[0] or v_src.shape[:2] != k_src.shape[:2]:
        raise ValueError(
            f"context {shape_of(k_src)} (and value {shape_of(v_src)}) must have the same "
            f"batch as x {shape_of(x3)}, and keys and values the same number of tokens"
        )
    return Call(x3, k_src, v_src, mask, is_causal, unbatched)


@contextlib.contextmanager
def cache_step(layer: nn.Module, cache: KVCache | None, **streams: torch.Tensor
               ) -> Iterator[dict[str, torch.Tensor]]:
    """Append the new tokens' ``streams`` ``(B, heads, N_new, D)`` to ``layer``'s cache and
    give views over every cached token ``(B, heads, N_cache, D)``; without a cache, the
    streams themselves. If the block raises, the cache is left as it was."""
    if cache is None:
        yield streams
        return
    with cache.transaction():
        yield cache.append(layer.cache_kind, owner=layer, **streams)


def attention_weights(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any
                      ) -> torch.Tensor:
    """The attention weights ``(B, H, N_q, N_k)`` of an :func:`attnkit.attention` call
    (same options, dropout excluded), computed by the reference — one operator node under
    torch.compile / export (:func:`attnkit.ops.attention_weights`)."""
    return _ops.attention_weights(q, k, v, **options)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: Any, is_causal: bool,
    scale: float, softcap: float | None, dropout_p: float, need_weights: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`attnkit.attention` on (B, H, N, D) tensors → ``(out (B, H, N_q, D_v), weights
    (B, H, N_q, N_k) or None)``."""
    out = attention(q, k, v, mask=mask, is_causal=is_causal, scale=scale, softcap=softcap,
                    dropout_p=dropout_p)
    weights = attention_weights(q, k, v, mask=mask, is_causal=is_causal, scale=scale,
                                softcap=softcap) if need_weights else None
    return out, weights


def finish(layer: nn.Module, o: torch.Tensor, weights: torch.Tensor | None, call: Call,
           need_weights: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Heads (B, H, N_q, d_v) → out_proj → ``out`` (B, N_q, d), unbatched back to (N_q, d),
    with the weights when asked for."""
    out = layer.out_proj(merge_heads(o))                   # (B, N_q, d)
    if call.unbatched:
        out = out[0]
        weights = weights[0] if weights is not None else None
    return (out, weights) if need_weights else out
