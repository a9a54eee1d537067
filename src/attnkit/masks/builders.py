"""The mask builders of :mod:`attnkit.masks` (import them from there): causal, sliding
window, flash-attn's two-sided window, band, padding, document, prefix-LM, ``from_fn`` and
``from_tensor`` masks, each a
:class:`~attnkit.masks.Mask` with its function, its block rules and, where it has one, its
spec (``Band`` / ``Lengths`` / ``Documents``) — built with the public constructor only.

Shape legend::

    b (B,1,1,1)   h (1,H,1,1)   q_idx (1,1,N_q,1)   kv_idx (1,1,1,N_k)   (broadcasting)
    block rules: qs, qe (nbq, 1) and ks, ke (1, nbk) — first and one-past-last index of
    each block → (any allowed, all allowed), broadcastable to (B, H, nbq, nbk)
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import torch

from .._shapes import broadcast_shapes
from ..scores import flex_semantics
from .core import Band, Documents, Lengths, Mask

__all__ = ["causal", "sliding_window", "window", "band", "padding", "document", "prefix_lm",
           "from_fn", "from_tensor", "full"]


def _band(lo: float, hi: float, align: str, name: str) -> Mask:
    """Allowed where ``lo <= (q_idx + offset) - kv_idx <= hi``.

    ``offset`` is 0 for top-left alignment and ``N_k - N_q`` for bottom-right alignment
    (the last query lines up with the last key, as in KV-cache decoding).
    """
    if align not in ("top_left", "bottom_right"):
        raise ValueError(f"align must be 'top_left' or 'bottom_right', got {align!r}")
    br = align == "bottom_right"

    def fn(b, h, q, k, n_q, n_k):  # noqa: ANN001, ANN202
        # lo <= q + off - k <= hi, as k <= q + (off - lo) and k >= q + (off - hi): the shifts
        # are per query (small), each bound is one broadcast comparison; ±inf is no bound
        off = (n_k - n_q) if br else 0
        out = k <= q + (off - lo) if lo != -math.inf else None
        if hi != math.inf:
            upper = k >= q + (off - hi)
            out = upper if out is None else out & upper
        if out is None:
            return torch.ones((), dtype=torch.bool, device=q.device).expand(
                broadcast_shapes(q.shape, k.shape))
        return out

    def blocks(qs, qe, ks, ke, n_q, n_k):  # noqa: ANN001, ANN202
        off = (n_k - n_q) if br else 0
        d_min = qs - (ke - 1) + off
        d_max = (qe - 1) - ks + off
        return (d_max >= lo) & (d_min <= hi), (d_min >= lo) & (d_max <= hi)

    return Mask(fn, name=name, blocks=blocks, spec=Band(lo, hi, br), exact_rules=True)


def full() -> Mask:
    """Every query may attend to every key (the neutral element of ``&``)."""

    def fn(b, h, q, k, n_q, n_k):  # noqa: ANN001, ANN202
        return torch.ones((), dtype=torch.bool, device=q.device).expand(
            broadcast_shapes(q.shape, k.shape))

    def blocks(qs, qe, ks, ke, n_q, n_k):  # noqa: ANN001, ANN202
        t = torch.ones(broadcast_shapes(qs.shape, ks.shape), dtype=torch.bool,
                       device=qs.device)
        return t, t

    return Mask(fn, name="full", blocks=blocks, spec=Band(-math.inf, math.inf),
                exact_rules=True)


def causal(align: str = "top_left") -> Mask:
    """Each query sees itself and earlier keys.

    ``align="top_left"`` (torch's ``is_causal``): query i sees keys ``0..i``.
    ``align="bottom_right"``: the last query lines up with the last key, so query i sees keys
    ``0..i + (N_k - N_q)`` — the rule for decoding with a KV cache.
    """
    return _band(0, math.inf, align, f"causal({align})" if align != "top_left" else "causal")


def sliding_window(size: int, causal: bool = True, align: str = "top_left") -> Mask:
    """Local attention over a window of ``size`` keys.

    ``causal=True``: query i sees keys ``i-size+1 .. i`` (itself and ``size-1`` before it).
    ``causal=False``: query i sees keys with ``|i - j| < size`` (``size-1`` on each side).
    ``align`` as in :func:`causal`.
    """
    if not isinstance(size, numbers.Integral) or isinstance(size, bool) or size < 1:
        raise ValueError(f"sliding_window size must be a positive integer, got {size!r}")
    size = int(size)
    lo = -(size - 1) if not causal else 0
    kind = "causal" if causal else "two-sided"
    where = ", bottom_right" if align == "bottom_right" else ""
    return _band(lo, size - 1, align, f"sliding_window({size}, {kind}{where})")


def _bound(x: object, what: str) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or (
            not isinstance(x, numbers.Integral) and not math.isinf(x)):
        raise ValueError(f"band {what} must be an integer or ±math.inf, got {x!r}")
    return x if math.isinf(x) else int(x)


def band(lo: float, hi: float, align: str = "top_left") -> Mask:
    """A band of diagonals: allowed ⇔ ``lo <= (q_idx + offset) - kv_idx <= hi``.

    ``offset`` is 0 for ``align="top_left"`` and ``N_k - N_q`` for ``"bottom_right"``;
    ``lo``/``hi`` are integers or ``∓math.inf`` (unbounded). ``causal()`` is
    ``band(0, inf)``; ``sliding_window(w)`` is ``band(0, w - 1)``. The spec is
    :class:`Band`, so every engine computes it in closed form. ``band(-1, 2).to_string(5, 5)``
    (rows: queries, columns: keys)::

        ██░░░
        ███░░
        ████░
        ░████
        ░░███
    """
    if align not in ("top_left", "bottom_right"):
        raise ValueError(f"align must be 'top_left' or 'bottom_right', got {align!r}")
    lo, hi = _bound(lo, "lo"), _bound(hi, "hi")
    if lo > hi or lo == math.inf or hi == -math.inf:
        raise ValueError(f"band needs lo <= hi (finite, or lo=-inf / hi=inf for unbounded), got "
                         f"lo={lo}, hi={hi}: such a band allows no pair")
    where = ", bottom_right" if align == "bottom_right" else ""
    return _band(lo, hi, align, f"band({lo}, {hi}{where})")


def window(left: int, right: int, align: str = "bottom_right") -> Mask:
    """flash-attn's ``window_size=(left, right)``: a query sees ``left`` keys before its own
    position and ``right`` after it (``-1`` = unbounded on that side).

    Query i sees keys ``j`` with ``i + offset - left <= j <= i + offset + right``, where
    ``offset`` is ``N_k - N_q`` for ``align="bottom_right"`` (flash-attn's alignment, the
    default: the last query lines up with the last key) and 0 for ``"top_left"`` (torch's
    ``is_causal`` alignment). ``window(left, 0)`` is flash-attn's ``causal=True,
    window_size=(left, ...)``; ``window(-1, 0)`` is ``causal("bottom_right")``;
    ``window(-1, -1)`` allows everything. It is a band — spec ``Band(-right, left)`` — so
    every engine computes it in closed form and skips the tiles outside it.

    Shapes: the mask applies to any ``N_q × N_k``; it does not depend on batch or head.
    ``window(2, 1).to_string(4, 6)`` (bottom-right, offset 2) and
    ``window(2, 1, "top_left").to_string(4, 6)`` (rows: queries, columns: keys)::

        ████░░          ██░░░░
        ░████░          ███░░░
        ░░████          ████░░
        ░░░███          ░████░
    """
    for what, x in (("left", left), ("right", right)):
        if not isinstance(x, numbers.Integral) or isinstance(x, bool) or x < -1:
            raise ValueError(
                f"window {what} size must be an integer >= 0, or -1 for unbounded (flash-attn's "
                f"window_size), got {what}={x!r}"
            )
    left, right = int(left), int(right)
    hi = math.inf if left == -1 else left
    lo = -math.inf if right == -1 else -right
    where = ", top_left" if align == "top_left" else ""
    return _band(lo, hi, align, f"window({left}, {right}{where})")


def _lengths(x: object, what: str) -> torch.Tensor:
    t = torch.as_tensor(x)
    if t.numel() == 0 and t.dim() <= 1:
        raise ValueError(
            f"{what} needs one entry per batch element, got an empty {what} (shape (0,)): "
            f"give {what} of shape (B,), e.g. [n] * batch"
        )
    if t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ValueError(
            f"{what} must be a 1-D integer sequence (one length per batch element), "
            f"got dtype {t.dtype} and shape {tuple(t.shape)}"
        )
    if (t < 0).any():
        raise ValueError(f"{what} must be >= 0, got {t.tolist()}")
    return t.to(torch.long)


def _pick(t: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-batch value ``t[b]`` shaped to broadcast with index tensors."""
    t = t.to(b.device)
    return t[b] if t.shape[0] > 1 else t[0]


def padding(kv_lengths: object, q_lengths: object | None = None) -> Mask:
    """Per-batch valid lengths: batch element b sees keys ``0..kv_lengths[b]-1``.

    With ``q_lengths``, queries at or past ``q_lengths[b]`` see nothing (their output is 0).
    Shapes: ``kv_lengths`` (B,), ``q_lengths`` (B,).
    """
    kv_len = _lengths(kv_lengths, "kv_lengths")
    q_len = _lengths(q_lengths, "q_lengths") if q_lengths is not None else None
    if q_len is not None and q_len.shape != kv_len.shape:
        raise ValueError(
            f"q_lengths {tuple(q_len.shape)} and kv_lengths {tuple(kv_len.shape)} must have "
            "one entry per batch element each"
        )
    nb = kv_len.shape[0]
    longest = (int(kv_len.max()), int(q_len.max()) if q_len is not None else None)
    checked: set[tuple[int, int]] = set()

    def check(n_q: int, n_k: int) -> None:
        if (n_q, n_k) in checked:
            return
        if longest[0] > n_k:
            raise ValueError(
                f"padding mask kv_lengths={kv_len.tolist()} exceed the call's N_k={n_k} keys "
                f"(longest {longest[0]}): a length counts valid keys, so it is at most N_k"
            )
        if longest[1] is not None and longest[1] > n_q:
            raise ValueError(
                f"padding mask q_lengths={q_len.tolist()} exceed the call's N_q={n_q} queries "
                f"(longest {longest[1]}): a length counts valid queries, so it is at most N_q"
            )
        checked.add((n_q, n_k))

    def fn(b, h, q, k, n_q, n_k):  # noqa: ANN001, ANN202
        check(n_q, n_k)
        ok = k < _pick(kv_len, b)
        if q_len is not None:
            ok = ok & (q < _pick(q_len, b))
        return ok

    def blocks(qs, qe, ks, ke, n_q, n_k):  # noqa: ANN001, ANN202
        check(n_q, n_k)
        L = kv_len.to(qs.device).view(-1, 1, 1, 1)
        any_, all_ = ks < L, ke <= L
        if q_len is not None:
            Lq = q_len.to(qs.device).view(-1, 1, 1, 1)
            any_, all_ = any_ & (qs < Lq), all_ & (qe <= Lq)
        return any_, all_

    name = f"padding(kv_lengths={kv_len.tolist()}" + (
        f", q_lengths={q_len.tolist()})" if q_len is not None else ")")
    # drawn (str) at the default 8 × 8, or as large as the longest length when that is more
    longest_q = int(q_len.max()) if q_len is not None else 0
    natural = (longest_q if longest_q > 8 else None,
               int(kv_len.max()) if int(kv_len.max()) > 8 else None)
    return Mask(fn, name=name, blocks=blocks, batch=nb, spec=Lengths(kv_len, q_len),
                checks=(check,), exact_rules=True, natural=natural)


def _ids(x: object, what: str) -> torch.Tensor:
    t = torch.as_tensor(x)
    if t.dim() not in (1, 2) or t.dtype.is_floating_point:
        raise ValueError(
            f"{what} must be integer document ids of shape (N,) or (B, N), "
            f"got dtype {t.dtype} and shape {tuple(t.shape)}"
        )
    return t.to(torch.long).reshape(-1, t.shape[-1])


def _block_min_max(ids: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor):  # noqa: ANN202
    """Per-block min and max of ids (B, N) for consecutive equal blocks [starts, ends) (the
    last may be shorter) → (B, n_blocks)."""
    nblocks = starts.numel()
    if nblocks == 0:
        return ids[:, :0], ids[:, :0]
    s0, e1 = int(starts.view(-1)[0]), int(ends.view(-1)[-1])
    block = int(ends.view(-1)[0]) - s0
    seg = ids[:, s0:e1]                                                  # (B, covered)
    pad = nblocks * block - seg.shape[1]

    # (F.pad takes its fill value as a double: iinfo(long).max would wrap to min)
    def padded(fill: int) -> torch.Tensor:
        return torch.cat([seg, seg.new_full((seg.shape[0], pad), fill)], dim=1)

    lo, hi = padded(torch.iinfo(torch.long).max), padded(torch.iinfo(torch.long).min)
    return (lo.view(ids.shape[0], nblocks, block).amin(-1),
            hi.view(ids.shape[0], nblocks, block).amax(-1))


def document(ids: object, kv_ids: object | None = None) -> Mask:
    """Packed sequences: a query sees only keys of its own document.

    ``ids`` gives each query position's document id, shape (N_q,) or (B, N_q); ``kv_ids``
    the keys' ids (defaults to ``ids``, i.e. self-attention). Combine with ``causal()`` for
    packed causal training: ``document(ids) & causal()``.
    """
    q_ids = _ids(ids, "ids")
    k_ids = _ids(kv_ids, "kv_ids") if kv_ids is not None else q_ids
    if q_ids.shape[0] != k_ids.shape[0] and 1 not in (q_ids.shape[0], k_ids.shape[0]):
        raise ValueError(
            f"ids batch {q_ids.shape[0]} and kv_ids batch {k_ids.shape[0]} differ: "
            "give both with the same batch size"
        )
    nb = max(q_ids.shape[0], k_ids.shape[0])

    def _check(n_q: int, n_k: int) -> None:
        if q_ids.shape[1] != n_q or k_ids.shape[1] != n_k:
            raise ValueError(
                f"document mask built for {q_ids.shape[1]} queries × {k_ids.shape[1]} keys, "
                f"used with N_q={n_q}, N_k={n_k}: give ids of length N_q (and kv_ids of "
                "length N_k)"
            )

    def fn(b, h, q, k, n_q, n_k):  # noqa: ANN001, ANN202
        _check(n_q, n_k)
        qi, ki = q_ids.to(q.device), k_ids.to(q.device)
        bq = b if qi.shape[0] > 1 else torch.zeros_like(b)
        bk = b if ki.shape[0] > 1 else torch.zeros_like(b)
        return qi[bq, q] == ki[bk, k]

    def blocks(qs, qe, ks, ke, n_q, n_k):  # noqa: ANN001, ANN202
        _check(n_q, n_k)
        qmin, qmax = _block_min_max(q_ids.to(qs.device), qs, qe)  # (B, nbq)
        kmin, kmax = _block_min_max(k_ids.to(qs.device), ks, ke)  # (B, nbk)
        qmin, qmax = qmin[:, None, :, None], qmax[:, None, :, None]
        kmin, kmax = kmin[:, None, None, :], kmax[:, None, None, :]
        overlap = (qmax >= kmin) & (kmax >= qmin)
        single = (qmin == qmax) & (kmin == kmax) & (qmin == kmin)
        return overlap, single

    return Mask(fn, name="document", blocks=blocks, batch=nb if nb > 1 else None,
                spec=Documents(q_ids, k_ids), natural=(q_ids.shape[1], k_ids.shape[1]),
                checks=(_check,))


def prefix_lm(prefix_length: object) -> Mask:
    """Prefix-LM: every query sees the first ``prefix_length`` keys, and causal after them.

    ``prefix_length`` is an int or a per-batch sequence of shape (B,).
    """
    if isinstance(prefix_length, numbers.Integral) and not isinstance(prefix_length, bool):
        prefix_length = int(prefix_length)
        if prefix_length < 0:
            raise ValueError(f"prefix_length must be >= 0, got {prefix_length}")
        p = torch.tensor([prefix_length])
        nb = None
    else:
        p = _lengths(prefix_length, "prefix_length")
        nb = p.shape[0]

    def fn(b, h, q, k, n_q, n_k):  # noqa: ANN001, ANN202
        return k < _pick(p, b)

    def blocks(qs, qe, ks, ke, n_q, n_k):  # noqa: ANN001, ANN202
        P = p.to(qs.device).view(-1, 1, 1, 1)
        return ks < P, ke <= P

    in_prefix = Mask(fn, name="prefix", blocks=blocks, batch=nb, exact_rules=True)
    m = causal() | in_prefix
    shown = prefix_length if nb is None else p.tolist()
    m.name = f"prefix_lm({shown})"
    return m


def from_fn(fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                         torch.Tensor],
            name: str | None = None) -> Mask:
    """A mask from a function ``fn(b, h, q_idx, kv_idx) -> bool`` — a FlexAttention
    ``mask_mod`` works unchanged.

    ``fn`` has FlexAttention's per-pair semantics: it means what it returns for one
    ``(b, h, q_idx, kv_idx)`` of 0-d integer tensors, so chained indexing such as
    ``doc[b][q_idx] == doc[b][kv_idx]`` or ``table[h][q_idx]`` means what it says. It is
    called on whole tiles with broadcast index tensors when that means the same, and per pair
    through ``torch.vmap`` otherwise (:func:`attnkit.scores.flex_semantics` decides once per
    function and size, as it does for score mods). Use torch operations (``&``, ``|``, ``~``,
    ``torch.where``) — not Python ``if``/``and``/``or`` on tensor values, nor ``.item()``.
    ``b`` and ``h`` run over the whole batch and every query head, so the function may use
    them (e.g. a different pattern per head); one that ignores them costs nothing extra. The
    result must be bool: a number is refused, not rounded into allowed/blocked.
    """
    if not callable(fn):
        raise TypeError(f"from_fn needs a callable fn(b, h, q_idx, kv_idx), got {type(fn)}")
    label = name or getattr(fn, "__name__", "from_fn")

    def scalar(*idx: torch.Tensor) -> torch.Tensor:
        out = fn(*idx)
        return torch.tensor(out, device=idx[2].device) if isinstance(out, bool) else out

    scalar.__name__ = scalar.__qualname__ = label      # errors name the mask

    def wrapped(b, h, q, k, n_q, n_k):  # noqa: ANN001, ANN202
        shape = broadcast_shapes(b.shape, h.shape, q.shape, k.shape)
        if 0 in shape:
            return torch.zeros(shape, dtype=torch.bool, device=q.device)
        call = flex_semantics(scalar, with_score=False, batch=shape[0], heads=shape[1],
                              n_q=n_q, n_k=n_k, device=q.device, what="mask_mod")
        out = torch.as_tensor(call(b, h, q, k))
        # per-pair evaluation broadcasts what does not depend on b / h (stride 0): keep it 1
        return out[tuple(slice(0, 1) if (st == 0 and n > 1) else slice(None)
                         for st, n in zip(out.stride(), out.shape, strict=True))]

    return Mask(wrapped, name=label, any_bh=True)


def from_tensor(t: torch.Tensor, name: str | None = None) -> Mask:
    """A mask from a bool tensor (True = may attend), broadcastable to ``(B, H, N_q, N_k)``.

    Accepts 2-D ``(N_q, N_k)``, 3-D ``(H, N_q, N_k)`` (broadcasting rules: leading dims are
    added on the left) and 4-D ``(B, H, N_q, N_k)``; any dim may be 1.
    """
    if not isinstance(t, torch.Tensor):
        import numpy as np

        t = torch.from_numpy(t) if isinstance(t, np.ndarray) else torch.as_tensor(t)
    if t.dtype != torch.bool:
        raise TypeError(
            f"from_tensor needs a bool tensor (True = may attend), got dtype {t.dtype}; "
            "pass an additive float mask to attention(mask=...) directly instead"
        )
    if t.dim() < 2 or t.dim() > 4:
        raise ValueError(
            f"from_tensor needs a 2-D (N_q, N_k), 3-D (H, N_q, N_k) or 4-D (B, H, N_q, N_k) "
            f"bool tensor, got shape {tuple(t.shape)}"
        )
    t4 = t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))              # (B|1, H|1, N_q, N_k)

    def check(n_q: int, n_k: int) -> None:
        if (t4.shape[2] not in (1, n_q)) or (t4.shape[3] not in (1, n_k)):
            raise ValueError(
                f"mask of shape {tuple(t.shape)} does not broadcast to "
                f"(..., N_q={n_q}, N_k={n_k}): give a mask whose last two dims are "
                f"(N_q, N_k) or 1"
            )

    def fn(b, h, q, k, n_q, n_k):  # noqa: ANN001, ANN202
        check(n_q, n_k)
        tt = t4.to(q.device)
        idx = [b, h, q, k]
        idx = [i if tt.shape[d] > 1 else torch.zeros_like(i) for d, i in enumerate(idx)]
        return tt[idx[0], idx[1], idx[2], idx[3]]

    b = t4.shape[0] if t4.shape[0] > 1 else None
    hh = t4.shape[1] if t4.shape[1] > 1 else None
    return Mask(fn, name=name or f"tensor{tuple(t.shape)}", batch=b, heads=hh, device=t.device,
                natural=(t4.shape[2] if t4.shape[2] > 1 else None,
                         t4.shape[3] if t4.shape[3] > 1 else None), checks=(check,))
