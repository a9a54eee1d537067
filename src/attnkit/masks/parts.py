"""The one decomposition of a mask into the parts engines compute in closed form.

A mask built with ``&`` is a conjunction of terms (:meth:`Mask.conjuncts`). Some terms have
a closed form an engine computes from a few numbers instead of reading a dense mask —
bands (causal, sliding windows), paddings (per-batch lengths) and documents (per-token
ids) — and the rest must be evaluated. :func:`decompose` is the only function that sorts
the terms; every engine (the native kernel, Triton, the tiled engines, the custom operator,
the ring) reads its result, so all of them agree on what a mask means::

    allowed(b, h, q, k)  ⇔  band(q, k) ∧ lengths(b, q, k) ∧ documents(b, q, k) ∧ rest(b, h, q, k)

Shape legend: ``B`` batch, ``H`` query heads, ``N_q`` queries, ``N_k`` keys; ``B|1`` a
size that may be 1 (broadcast).

Rules (the same for every engine):

- bands intersect: ``lo = max(lo_i − off_i)``, ``hi = min(hi_i − off_i)``, each term's
  alignment offset (``N_k − N_q`` when bottom-right) folded in;
- paddings intersect: the element-wise minimum of their lengths (a missing ``q_lengths``
  is no limit);
- the first document term whose ids fit the call is closed-form; a second one (two id sets
  do not merge) goes to the rest, as does a document term built for another size (its
  evaluation then raises the mask's own error);
- every other term is the rest, their conjunction, evaluated densely by whoever needs it.
"""

from __future__ import annotations

import math
import operator
from functools import reduce
from typing import NamedTuple

import torch

from .core import Band, Documents, Lengths, Mask, documents_of

__all__ = ["MaskParts", "decompose", "NO_MASK"]


class MaskParts(NamedTuple):
    """A mask on an ``N_q × N_k`` call as closed-form parts and a rest (see the module).

    - ``band``: ``(lo, hi)``, allowed ⇔ ``lo <= q_idx − kv_idx <= hi`` (every band term's
      alignment folded in); ``None`` when the band terms allow every pair (or there are none).
    - ``bands``: the band terms' specs as built (alignment unfolded), for a caller that
      must keep ``N_q`` / ``N_k`` symbolic (the custom operator's arguments).
    - ``kv_lengths`` ``(B|1,)`` and ``q_lengths`` ``(B|1,)`` or None: allowed ⇔
      ``kv_idx < kv_lengths[b]`` (and ``q_idx < q_lengths[b]``); ``None`` without padding.
    - ``doc_ids`` ``(B|1, N_q)`` and ``kv_doc_ids`` ``(B|1, N_k)``: allowed ⇔ equal ids;
      ``documents`` is that term itself (for its block summary).
    - ``rest``: the conjunction of the terms without closed form, or None.

    (A NamedTuple: immutable and cheap to make — a decoder lowers one call per layer and
    token.)
    """

    band: tuple[float, float] | None = None
    bands: tuple[Band, ...] = ()
    kv_lengths: torch.Tensor | None = None
    q_lengths: torch.Tensor | None = None
    doc_ids: torch.Tensor | None = None
    kv_doc_ids: torch.Tensor | None = None
    documents: Mask | None = None
    rest: Mask | None = None

    @property
    def only_bands(self) -> bool:
        """True when the mask is its band terms and nothing else."""
        return (self.kv_lengths is None and self.documents is None and self.rest is None)

    def as_band(self) -> tuple[float, float] | None:
        """``(lo, hi)`` when the whole mask is a band (``(−inf, inf)`` for a full mask), else
        None: what an engine that computes bands only can take."""
        if not self.only_bands or not self.bands:
            return None
        return self.band if self.band is not None else (-math.inf, math.inf)

    def rest_elements(self, batch: int, heads: int, n_q: int, n_k: int) -> int:
        """How many elements the rest's dense form takes (its size-1 dims kept at 1)."""
        if self.rest is None:
            return 0
        b = batch if self.rest.depends_on_batch else 1
        h = heads if self.rest.depends_on_heads else 1
        return b * h * n_q * n_k


NO_MASK = MaskParts()


def _min(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """Element-wise minimum, ``None`` meaning no limit."""
    return b if a is None else a if b is None else torch.minimum(a, b)


def decompose(mask: Mask | None, n_q: int, n_k: int) -> MaskParts:
    """``mask`` on an ``n_q × n_k`` call as :class:`MaskParts` (the module's rules)."""
    if mask is None:
        return NO_MASK
    if mask._terms is None and mask.spec is None:            # one term without closed form
        return MaskParts(rest=mask)                         # (a mask tensor: every step)
    lo, hi = -math.inf, math.inf
    bands: list[Band] = []
    kv_len = q_len = doc = kv_doc = None
    documents: Mask | None = None
    rest: list[Mask] = []
    for term in mask.conjuncts():
        spec = term.spec
        if isinstance(spec, Band):
            off = spec.offset(n_q, n_k)
            lo, hi = max(lo, spec.lo - off), min(hi, spec.hi - off)
            bands.append(spec)
        elif isinstance(spec, Lengths):
            kv_len, q_len = _min(kv_len, spec.kv_lengths), _min(q_len, spec.q_lengths)
        elif (isinstance(spec, Documents) and documents is None
              and (ids := documents_of(term, n_q, n_k)) is not None):
            (doc, kv_doc), documents = ids, term
        else:
            rest.append(term)
    return MaskParts(
        band=None if (lo, hi) == (-math.inf, math.inf) else (lo, hi),
        bands=tuple(bands), kv_lengths=kv_len, q_lengths=q_len, doc_ids=doc,
        kv_doc_ids=kv_doc, documents=documents,
        rest=reduce(operator.and_, rest) if rest else None)
