"""flash-attn's packed and cached batches as masks: :func:`varlen` (``cu_seqlens``, packed
variable-length sequences) and :func:`cache_lengths` (per-sequence KV-cache lengths for
decoding). Import them from :mod:`attnkit.masks`. Both are built with the public
:class:`~attnkit.masks.Mask` constructor and publish specs the engines read (``Documents``,
``Band``, ``Lengths``), with block rules in closed form for the rest.

Shape legend::

    S                 sequences packed in a row        cu_seqlens (S+1,) or (B, S+1)
    N_q = cu_seqlens_q[-1] packed queries              N_k = cu_seqlens_k[-1] packed keys
    ids_q (B|1, N_q), ids_k (B|1, N_k)                 the sequence of each position
    pos_q (B|1, N_q), pos_k (B|1, N_k)                 position from the sequence's anchor
                                                       (its end: bottom-right; start: top-left)
    lengths (B,)      cache lengths, one per batch element
    block rules: qs, qe (nbq, 1), ks, ke (1, nbk) → (any, all) broadcastable to (B, 1, nbq, nbk)

What each publishes (``m.conjuncts()``, each term's ``spec``)::

    varlen(cu)                            Documents                          (one term, exact)
    varlen(cu, causal=True), cu_q == cu_k Documents & Band(0, inf)           (all in closed form)
      (any window whose per-sequence offset is the same for every sequence: Documents & Band)
    varlen(cu_q, cu_k, causal=True)       Documents & varlen-local term      (term: no spec, exact
      with a per-sequence offset          block rules when no sequence is empty; conservative
                                          where one is; evaluated on PARTIAL tiles)
    cache_lengths(L)                      Lengths(L) & per-batch causal term (term: no spec,
                                                                              exact block rules)

Caution
-------
- A varlen mask is built for its packed sizes: it applies to calls with exactly
  ``N_q = cu_seqlens_q[-1]`` queries and ``N_k = cu_seqlens_k[-1]`` keys (append a sequence
  to cover padding at the end of a packed row).
- With ``causal``/``window`` and per-sequence offsets that differ (query and key lengths
  that differ by different amounts per sequence), the local term has no spec: the Triton
  kernel evaluates it densely (one byte per pair) and the native kernel declines it; the
  tiled engine skips its EMPTY tiles from the block rules.
- ``cache_lengths`` with more than one query per sequence carries a term without a spec
  (the per-batch offset ``lengths[b] - N_q``); with one query it equals ``padding(lengths)``,
  which is all-spec — use that for plain one-token decoding.
"""

from __future__ import annotations

import math
import numbers

import torch

from .builders import band, padding
from .core import Documents, Mask, lengths_of

__all__ = ["varlen", "cache_lengths"]


# --------------------------------------------------------------------------- validation
def _cu(x: object, what: str) -> torch.Tensor:
    """cu_seqlens → long ``(B|1, S+1)``: starts at 0, non-decreasing, same total per row."""
    t = torch.as_tensor(x)
    if t.dim() not in (1, 2) or t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ValueError(
            f"{what} must be 1-D (S+1,) or 2-D (B, S+1) integers (cumulative sequence "
            f"lengths, starting at 0), got dtype {t.dtype} and shape {tuple(t.shape)}"
        )
    t = t.to(torch.long).reshape(-1, t.shape[-1])
    if t.shape[1] < 2:
        raise ValueError(f"{what} needs at least 2 entries [0, n, ...] (one sequence), got "
                         f"shape {tuple(t.shape)}")
    if (t[:, 0] != 0).any() or (t.diff(dim=1) < 0).any():
        raise ValueError(f"{what} must start at 0 and never decrease (cumulative lengths), got "
                         f"{t.tolist()}: build it with [0, *itertools.accumulate(lengths)]")
    if (t[:, -1] != t[0, -1]).any():
        raise ValueError(f"{what} rows must end at the same total (the packed length), got "
                         f"{t[:, -1].tolist()}: add a last sequence that covers the padding")
    return t


def _from_lengths(x: object, what: str) -> torch.Tensor:
    t = torch.as_tensor(x)
    if t.dim() not in (1, 2) or t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ValueError(f"{what} must be 1-D (S,) or 2-D (B, S) integer lengths, got dtype "
                         f"{t.dtype} and shape {tuple(t.shape)}")
    if (t < 0).any():
        raise ValueError(f"{what} must be >= 0, got {t.tolist()}")
    t = t.to(torch.long).reshape(-1, t.shape[-1])
    return torch.cat([t.new_zeros(t.shape[0], 1), t.cumsum(1)], dim=1)


def _pick_cu(cu: object | None, lens: object | None, side: str) -> torch.Tensor | None:
    if cu is not None and lens is not None:
        raise ValueError(f"give cu_seqlens_{side} or seqlens_{side}, not both")
    if cu is not None:
        return _cu(cu, f"cu_seqlens_{side}")
    if lens is not None:
        return _cu(_from_lengths(lens, f"seqlens_{side}"), f"seqlens_{side}")
    return None


def _positions(cu: torch.Tensor, anchor_end: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """→ (ids (B|1, N): the sequence of each position, pos (B|1, N): position − anchor)."""
    n = int(cu[0, -1])
    p = torch.arange(n).expand(cu.shape[0], n).contiguous()                   # (B|1, N)
    ids = torch.searchsorted(cu[:, 1:].contiguous(), p, right=True)           # (B|1, N)
    anchor = (cu[:, 1:] if anchor_end else cu[:, :-1]).gather(1, ids)         # (B|1, N)
    return ids, p - anchor


def _ends(x: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor):  # noqa: ANN202
    """First and last entry of ``x`` (B, N) in each block ``[starts, ends)`` → (B, n)."""
    return x[:, starts.reshape(-1)], x[:, ends.reshape(-1) - 1]


def _q4(t: torch.Tensor) -> torch.Tensor:
    return t[:, None, :, None]                                                # (B, 1, nbq, 1)


def _k4(t: torch.Tensor) -> torch.Tensor:
    return t[:, None, None, :]                                                # (B, 1, 1, nbk)


def _shown(cu: torch.Tensor) -> str:
    lens = cu.diff(dim=1)
    if lens.numel() <= 8:
        return str(lens[0].tolist() if lens.shape[0] == 1 else lens.tolist())
    return f"{lens.shape[1]} sequences" + (f" × {lens.shape[0]} rows" if lens.shape[0] > 1
                                           else "")


# --------------------------------------------------------------------------- varlen
def varlen(
    cu_seqlens_q: object | None = None,
    cu_seqlens_k: object | None = None,
    *,
    causal: bool = False,
    window: tuple[int, int] = (-1, -1),
    align: str = "bottom_right",
    seqlens_q: object | None = None,
    seqlens_k: object | None = None,
) -> Mask:
    """flash-attn's ``flash_attn_varlen_func`` as a mask: sequences packed one after another,
    each query attending only within its own sequence (block-diagonal).

    Give the packing as ``cu_seqlens_q`` (cumulative lengths ``[0, n_0, n_0 + n_1, ...]``,
    shape ``(S+1,)``, or ``(B, S+1)`` for a different packing per batch row) or as
    ``seqlens_q`` (the lengths ``[n_0, n_1, ...]``); the keys' packing ``cu_seqlens_k`` /
    ``seqlens_k`` defaults to the queries' (self-attention). Sequence s holds queries
    ``[cu_q[s], cu_q[s+1])`` and keys ``[cu_k[s], cu_k[s+1])``; a call must have
    ``N_q = cu_q[-1]``, ``N_k = cu_k[-1]`` (in attnkit's layout: q ``(1, H, N_q, D)``).

    ``causal=True``: causal within each sequence, aligned **bottom-right per sequence** as
    flash-attn does — local query i of a sequence with ``lq`` queries and ``lk`` keys sees
    local keys ``j <= i + lk - lq``. ``window=(left, right)`` is flash-attn's
    ``window_size`` per sequence (``-1`` = unbounded; with ``causal`` the right side is 0).
    ``align="top_left"`` anchors each sequence at its start instead (``j <= i``).

    ``varlen([0, 2, 5], causal=True)`` and ``varlen(seqlens_q=[2, 3], seqlens_k=[3, 2],
    causal=True)`` (rows: queries, columns: keys; each sequence aligned at its bottom right)::

        █░░░░          ██░░░
        ██░░░          ███░░
        ░░█░░          ░░░░░
        ░░██░          ░░░█░
        ░░███          ░░░██

    Spec: pure block-diagonal is one ``Documents`` term (every engine computes it). With
    ``causal``/``window`` it is a conjunction ``Documents & Band(...)`` when the per-sequence
    offset is the same for every sequence (e.g. ``cu_seqlens_k`` equal to ``cu_seqlens_q``),
    else ``Documents & local term`` — a term without spec whose block rules are exact inside
    a sequence (see the module's Caution).
    """
    if align not in ("top_left", "bottom_right"):
        raise ValueError(f"align must be 'top_left' or 'bottom_right', got {align!r}")
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False, got {causal!r}")
    if (not isinstance(window, (tuple, list)) or len(window) != 2 or any(
            not isinstance(w, numbers.Integral) or isinstance(w, bool) or w < -1
            for w in window)):
        raise ValueError(f"window must be (left, right), integers >= 0 or -1 for unbounded "
                         f"(flash-attn's window_size), got {window!r}")
    cu_q = _pick_cu(cu_seqlens_q, seqlens_q, "q")
    if cu_q is None:
        raise ValueError("varlen needs the queries' packing: cu_seqlens_q=[0, n_0, n_0+n_1, "
                         "...] or seqlens_q=[n_0, n_1, ...]")
    cu_k = _pick_cu(cu_seqlens_k, seqlens_k, "k")
    cu_k = cu_q if cu_k is None else cu_k
    if cu_q.shape[1] != cu_k.shape[1] or (cu_q.shape[0] != cu_k.shape[0]
                                          and 1 not in (cu_q.shape[0], cu_k.shape[0])):
        raise ValueError(
            f"the queries' and keys' packings must hold the same sequences: cu_seqlens_q has "
            f"shape {tuple(cu_q.shape)}, cu_seqlens_k {tuple(cu_k.shape)} (S+1 entries each, "
            "rows 1 or B)"
        )
    nb = max(cu_q.shape[0], cu_k.shape[0])
    cu_q, cu_k = cu_q.expand(nb, -1), cu_k.expand(nb, -1)
    tot_q, tot_k = int(cu_q[0, -1]), int(cu_k[0, -1])
    end = align == "bottom_right"
    ids_q, pos_q = _positions(cu_q, end)                                     # (B|1, N_q)
    ids_k, pos_k = _positions(cu_k, end)                                     # (B|1, N_k)
    left, right = int(window[0]), int(window[1])
    hi = math.inf if left == -1 else left                                    # allowed ⇔
    lo = -math.inf if right == -1 else -right                                # lo <= d <= hi
    if causal:
        lo = max(lo, 0)
    shown = _shown(cu_q) + ("" if cu_k is cu_q or torch.equal(cu_k, cu_q)
                            else f", k={_shown(cu_k)}")
    opts = (", causal" if causal else "") + (
        f", window=({left}, {right})" if (left, right) != (-1, -1) else "") + (
        ", top_left" if not end and (causal or (left, right) != (-1, -1)) else "")
    name = f"varlen({shown}{opts})"
    batch = nb if nb > 1 else None

    def check(n_q: int, n_k: int) -> None:
        if n_q != tot_q or n_k != tot_k:
            raise ValueError(
                f"varlen mask packs {tot_q} queries × {tot_k} keys (cu_seqlens_q[-1], "
                f"cu_seqlens_k[-1]), used with N_q={n_q}, N_k={n_k}: a packed call has "
                "exactly cu_seqlens[-1] positions (add a last sequence to cover padding)"
            )

    def same(b, q, k):  # noqa: ANN001, ANN202
        bb = b if nb > 1 else torch.zeros_like(b)
        return bb, ids_q.to(q.device)[bb, q] == ids_k.to(q.device)[bb, k]

    def doc_fn(b, h, q, k, n_q, n_k):  # noqa: ANN001, ANN202
        check(n_q, n_k)
        return same(b, q, k)[1]

    def doc_rules(qs, qe, ks, ke, n_q, n_k):  # noqa: ANN001, ANN202
        check(n_q, n_k)
        fq, lq = (_q4(t) for t in _ends(ids_q.to(qs.device), qs, qe))  # ids sorted: first =
        fk, lk = (_k4(t) for t in _ends(ids_k.to(qs.device), ks, ke))  # min, last = max
        return (lq >= fk) & (lk >= fq), (fq == lq) & (fk == lk) & (fq == fk)

    # exact when every sequence holds queries and keys (no id is skipped inside a block)
    no_gaps = bool((cu_q.diff(dim=1) > 0).all() and (cu_k.diff(dim=1) > 0).all())
    pure = (lo, hi) == (-math.inf, math.inf)
    docs = Mask(doc_fn, name=name if pure else "varlen-documents", blocks=doc_rules, batch=batch,
                spec=Documents(ids_q, ids_k), natural=(tot_q, tot_k), checks=(check,),
                exact_rules=no_gaps)
    if pure:
        return docs
    # per-sequence offset of q − k: allowed ⇔ lo <= (q − k) − off_s <= hi
    anchor_q = cu_q[:, 1:] if end else cu_q[:, :-1]                          # (B|1, S)
    anchor_k = cu_k[:, 1:] if end else cu_k[:, :-1]
    live = (cu_q.diff(dim=1) > 0) & (cu_k.diff(dim=1) > 0)                   # (B|1, S)
    offs = (anchor_q - anchor_k)[live].unique()
    if offs.numel() <= 1:
        c = int(offs[0]) if offs.numel() else 0
        m = docs & band(lo + c, hi + c)
        m.name = name
        return m

    # allowed ⇔ same sequence and lo <= pos_q − pos_k <= hi, as one interval test on codes
    # id·M + pos (|pos| <= N < M/2, so codes of different sequences never fall in the interval)
    M = 4 * (max(tot_q, tot_k) + 1)
    code_k = ids_k * M + pos_k                                               # (B|1, N_k)
    code_q = ids_q * M + pos_q                                               # (B|1, N_q)
    first = code_q - hi if hi != math.inf else ids_q * M - M // 2            # (B|1, N_q)
    last = code_q - lo if lo != -math.inf else ids_q * M + M // 2
    first, last = torch.maximum(first, ids_q * M - M // 2), torch.minimum(last, ids_q * M + M // 2)

    def local_fn(b, h, q, k, n_q, n_k):  # noqa: ANN001, ANN202
        check(n_q, n_k)
        bb = b if nb > 1 else torch.zeros_like(b)
        ck = code_k.to(q.device)[bb, k]                                      # (B, 1, 1, N_k)
        return (ck >= first.to(q.device)[bb, q]) & (ck <= last.to(q.device)[bb, q])

    def local_rules(qs, qe, ks, ke, n_q, n_k):  # noqa: ANN001, ANN202
        check(n_q, n_k)
        dev = qs.device
        fq, lq = (_q4(t) for t in _ends(ids_q.to(dev), qs, qe))             # (B, 1, nbq, 1)
        fk, lk = (_k4(t) for t in _ends(ids_k.to(dev), ks, ke))             # (B, 1, 1, nbk)
        a, z = torch.maximum(fq, fk), torch.minimum(lq, lk)   # sequences both tiles touch
        bb = torch.arange(nb, device=dev).view(-1, 1, 1, 1)
        cq, ck, aq, ak = (t.to(dev) for t in (cu_q, cu_k, anchor_q, anchor_k))

        def pairs(x):  # noqa: ANN001, ANN202
            """Tiles' pairs inside sequence x (B, 1, nbq, nbk): (any allowed, all allowed)."""
            x = x.clamp(0, cq.shape[1] - 2)
            q0, q1 = torch.maximum(qs, cq[bb, x]), torch.minimum(qe, cq[bb, x + 1])
            k0, k1 = torch.maximum(ks, ck[bb, x]), torch.minimum(ke, ck[bb, x + 1])
            # positions are contiguous inside a sequence: d = pos_q − pos_k spans an interval
            d_lo = (q0 - aq[bb, x]) - (k1 - 1 - ak[bb, x])
            d_hi = (q1 - 1 - aq[bb, x]) - (k0 - ak[bb, x])
            return ((q0 < q1) & (k0 < k1) & (d_hi >= lo) & (d_lo <= hi),
                    (d_lo >= lo) & (d_hi <= hi))

        any_a, all_a = pairs(a)
        any_z, _ = pairs(z)
        single = (fq == lq) & (fk == lk) & (fq == fk)
        # a sequence strictly between a and z lies whole in both tiles; a non-empty one has
        # an allowed pair (d = 0 is allowed), an empty one makes "any" conservative
        any_ = (a <= z) & (any_a | any_z | (z - a >= 2))
        return any_, single & all_a

    local = Mask(local_fn, name=f"varlen-local({lo}, {hi})", blocks=local_rules, batch=batch,
                 natural=(tot_q, tot_k), checks=(check,), exact_rules=no_gaps)
    m = docs & local
    m.name = name
    return m


# --------------------------------------------------------------------------- cache lengths
def cache_lengths(lengths: object) -> Mask:
    """Per-sequence KV-cache lengths for decoding (flash-attn's ``cache_seqlens``): batch
    element b holds ``lengths[b]`` valid keys and its ``N_q`` new queries are the last
    ``N_q`` positions of its sequence — bottom-right causal per batch element.

    Query i of batch element b sees keys ``j < lengths[b] - N_q + i + 1`` (which is also
    ``< lengths[b]``): nothing at or past ``lengths[b]``; a query with
    ``i < N_q - lengths[b]`` sees no key (output 0). With ``N_q = 1`` this is
    ``padding(lengths)``. Shapes: ``lengths`` (B,), each ``<= N_k``.

    ``cache_lengths([4, 6]).to_string(3, 6, b=0)`` and ``b=1`` (rows: queries, columns: keys)::

        ██░░░░          ████░░
        ███░░░          █████░
        ████░░          ██████

    Spec: ``Lengths(lengths) & per-batch causal term`` — engines read the padding and skip
    keys past each length in closed form; the causal term has exact per-batch block rules
    (``q − k >= N_q − lengths[b]``) but no spec (see the module's Caution).
    """
    pad = padding(lengths)                      # validates: 1-D, integers >= 0
    spec = lengths_of(pad)
    assert spec is not None
    L = spec[0]                                                               # (B,)
    nb = L.shape[0]

    def fn(b, h, q, k, n_q, n_k):  # noqa: ANN001, ANN202
        Lb = L.to(q.device)[b] if nb > 1 else L[0]
        return k <= q + Lb - n_q

    def rules(qs, qe, ks, ke, n_q, n_k):  # noqa: ANN001, ANN202
        Lb = L.to(qs.device).view(-1, 1, 1, 1)                               # (B, 1, 1, 1)
        return (qe - 1) - ks >= n_q - Lb, qs - (ke - 1) >= n_q - Lb

    shown = L.tolist() if nb <= 8 else f"{nb} lengths"
    term = Mask(fn, name="per-batch causal", blocks=rules, batch=nb,
                natural=(None, int(L.max())), exact_rules=True)
    m = pad & term
    m.name = f"cache_lengths({shown})"
    return m
