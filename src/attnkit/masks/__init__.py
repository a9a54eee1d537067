"""Masks: where a query may attend.

A :class:`Mask` is a small function of the indices ``(b, h, q_idx, kv_idx)`` that answers
True where the query may attend to the key, composed with ``&``, ``|`` and ``~``.
Every mask also knows how to summarise itself into *blocks* — the unit the fast engines
schedule on:

- ``FULL``   (2): every pair in the block may attend — the engine skips the mask work;
- ``PARTIAL``(1): some may — the engine evaluates the mask on that tile;
- ``EMPTY``  (0): none may — the engine skips the tile entirely.

Shape legend::

    B    batch (all leading dimensions of the inputs, flattened)
    H    heads (query heads, H_q)
    N_q  number of queries        N_k  number of keys
    b, h, q_idx, kv_idx           integer index tensors that broadcast against each other

Builders: :func:`causal`, :func:`sliding_window`, :func:`padding`, :func:`document`,
:func:`prefix_lm`, :func:`from_fn`, :func:`from_tensor`, :func:`full`, :func:`band`; and
flash-attn's: :func:`window` (``window_size=(left, right)``), :func:`varlen` (packed
``cu_seqlens``) and :func:`cache_lengths` (per-sequence KV-cache lengths).

What lives where::

    masks/core.py      Mask (evaluate, to_dense, block_map, algebra & | ~), the specs Band /
                       Lengths / Documents and their readers band_of / lengths_of / documents_of
    masks/builders.py  the builders above (public constructor only)
    masks/parts.py     decompose: the one decomposition of a mask into closed-form parts
                       (band, lengths, documents) and a rest, read by every engine
    masks/varlen.py    varlen and cache_lengths (their specs and closed-form block rules)
    masks/summary.py   sparsity (closed form for band, padding, documents) and drawing (exact
                       when small, a coarse block grid when large)
 ``from_fn`` gets FlexAttention's per-pair semantics from
:func:`attnkit.scores.flex_semantics`, the one helper for mask_mods and score_mods.

Caution
-------
- Block summaries of ``&``, ``|`` and document masks are conservative: a block may be
  reported PARTIAL where it is in fact EMPTY or FULL. That costs speed, never correctness;
  :meth:`Mask.block_map` with ``exact=True`` evaluates those PARTIAL blocks (band, padding
  and prefix rules are exact already).
- ``from_fn`` masks and ``from_tensor`` masks have no rules: they are summarised by
  evaluating them, one block row at a time (O(N_k · block_q) memory). A ``from_fn`` function
  that needs per-pair evaluation (chained indexing) runs through ``torch.vmap``, which costs
  a fraction of a millisecond per evaluation (see :mod:`attnkit.scores`).
- A mask must return bool: a number is refused, never rounded into allowed/blocked.
"""

from __future__ import annotations

from .builders import (
    band,
    causal,
    document,
    from_fn,
    from_tensor,
    full,
    padding,
    prefix_lm,
    sliding_window,
    window,
)
from .core import *  # noqa: F403
from .core import __all__ as _core_all
from .parts import NO_MASK, MaskParts, decompose
from .varlen import cache_lengths, varlen

__all__ = [*_core_all, "causal", "sliding_window", "padding", "document", "prefix_lm",
           "from_fn", "from_tensor", "full", "band", "window", "varlen", "cache_lengths",
           "MaskParts", "decompose", "NO_MASK"]
