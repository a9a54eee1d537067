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
:func:`prefix_lm`, :func:`from_fn`, :func:`from_tensor`, :func:`full`.

Caution
-------
- Block summaries of ``&`` and ``|`` are conservative: a block may be reported PARTIAL where
  it is in fact EMPTY or FULL. That costs speed, never correctness; exact summaries come from
  :meth:`Mask.block_map` with ``exact=True``.
- ``from_fn`` masks and ``from_tensor`` masks are summarised by evaluating them densely, one
  block row at a time (O(N_k · block_q) memory).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "EMPTY",
    "PARTIAL",
    "FULL",
    "Mask",
    "Band",
    "Lengths",
    "Documents",
    "band_of",
    "lengths_of",
    "documents_of",
    "causal",
    "sliding_window",
    "padding",
    "document",
    "prefix_lm",
    "from_fn",
    "from_tensor",
    "full",
]

EMPTY, PARTIAL, FULL = 0, 1, 2


@dataclass(frozen=True)
class Band:
    """Spec of a band mask: allowed ⇔ ``lo <= (q_idx + offset) - kv_idx <= hi``.

    ``offset`` is ``N_k - N_q`` when ``bottom_right`` else 0. ``causal()`` is
    ``Band(0, inf)``, ``sliding_window(w)`` is ``Band(0, w-1)``, ``full()`` is
    ``Band(-inf, inf)``.
    """

    lo: float
    hi: float
    bottom_right: bool = False

    def offset(self, n_q: int, n_k: int) -> int:
        return (n_k - n_q) if self.bottom_right else 0


@dataclass(frozen=True, eq=False)
class Lengths:
    """Spec of a padding mask: per-batch valid lengths, ``kv_lengths`` (B,), ``q_lengths`` (B,)."""

    kv_lengths: torch.Tensor
    q_lengths: torch.Tensor | None


@dataclass(frozen=True, eq=False)
class Documents:
    """Spec of a document mask: ids ``(B|1, N_q)`` and kv_ids ``(B|1, N_k)``."""

    ids: torch.Tensor
    kv_ids: torch.Tensor


MaskSpec = Band | Lengths | Documents

# ---------------------------------------------------------------------- spec readers
# Engines compute structured masks in closed form; these are the one place that reads specs.
def band_of(m: Mask, n_q: int, n_k: int) -> tuple[float, float] | None:
    """``(lo, hi)`` with allowed ⇔ ``lo <= q_idx - kv_idx <= hi`` on an ``n_q × n_k`` call
    (the alignment offset folded in), or ``None`` when ``m`` is not a band mask."""
    spec = m.spec
    if not isinstance(spec, Band):
        return None
    off = spec.offset(n_q, n_k)
    return (spec.lo - off, spec.hi - off)


def lengths_of(m: Mask) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(kv_lengths (B|1,), q_lengths (B|1,) or None)`` of a padding mask, else ``None``."""
    spec = m.spec
    if not isinstance(spec, Lengths):
        return None
    return spec.kv_lengths, spec.q_lengths


def documents_of(m: Mask, n_q: int, n_k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(ids (B|1, N_q), kv_ids (B|1, N_k))`` of a document mask built for this size, else
    ``None`` (a mismatched size is left to evaluation, which raises the mask's own error)."""
    spec = m.spec
    if not isinstance(spec, Documents):
        return None
    qi, ki = spec.ids, spec.kv_ids
    if qi.dim() != 2 or ki.dim() != 2 or qi.shape[1] != n_q or ki.shape[1] != n_k:
        return None
    return qi, ki


# fn(b, h, q_idx, kv_idx, n_q, n_k) -> bool tensor broadcast from the index tensors.
IndexFn = Callable[..., torch.Tensor]
# blocks(q_start, q_end, k_start, k_end, n_q, n_k) -> (any_allowed, all_allowed), broadcastable
# to (B, H, n_blocks_q, n_blocks_k); q_* have shape (nbq, 1), k_* have shape (1, nbk).
BlockFn = Callable[..., "tuple[torch.Tensor, torch.Tensor]"]


@dataclass(frozen=True)
class _Sizes:
    """Sizes a mask may depend on (batch / heads), ``None`` when it does not."""

    batch: int | None = None
    heads: int | None = None
    # True for masks whose function may read ``b``/``h`` at any size (``from_fn``): they are
    # evaluated on the full (batch, heads) grid instead of on index 0 only.
    any_bh: bool = False

    def merge(self, other: _Sizes) -> _Sizes:
        def pick(a: int | None, b: int | None, what: str) -> int | None:
            if a is not None and b is not None and a != b and 1 not in (a, b):
                raise ValueError(
                    f"cannot combine masks built for {what} {a} and {b}: "
                    f"build both for the same {what}"
                )
            return max(a, b) if (a is not None and b is not None) else (a if b is None else b)

        return _Sizes(pick(self.batch, other.batch, "batch"),
                      pick(self.heads, other.heads, "heads"),
                      self.any_bh or other.any_bh)


class Mask:
    """Where each query may attend: ``True`` = may attend.

    Build masks with the functions of this module (``causal()``, ``padding(...)``, ...) and
    combine them with ``&`` (both allow), ``|`` (either allows) and ``~`` (swap).

    Shapes: ``to_dense(n_q, n_k)`` → bool ``(B, H, N_q, N_k)``;
    ``block_map(n_q, n_k, block_q, block_k)`` → int8 ``(B', H', ⌈N_q/block_q⌉, ⌈N_k/block_k⌉)``
    with B' ∈ {1, B}, H' ∈ {1, H} (1 where the mask does not depend on it).
    """

    __slots__ = ("_fn", "_blocks", "name", "_sizes", "_device", "_natural", "spec", "_terms")

    def __init__(
        self,
        fn: IndexFn,
        *,
        name: str,
        blocks: BlockFn | None = None,
        batch: int | None = None,
        heads: int | None = None,
        device: torch.device | None = None,
        spec: MaskSpec | None = None,
    ) -> None:
        self._fn = fn
        # What a builder made, for engines that compute it in closed form (None = opaque).
        self.spec = spec
        # The &-terms of a conjunction (set by ``&``); see :meth:`conjuncts`.
        self._terms: tuple[Mask, ...] | None = None
        self._blocks = blocks
        self.name = name
        self._sizes = _Sizes(batch, heads)
        self._device = device
        # (N_q, N_k) the mask was built for (tensor and document masks), else None
        self._natural: tuple[int | None, int | None] = (None, None)

    # ------------------------------------------------------------------ evaluation
    def __call__(
        self,
        b: torch.Tensor,
        h: torch.Tensor,
        q_idx: torch.Tensor,
        kv_idx: torch.Tensor,
        n_q: int,
        n_k: int,
    ) -> torch.Tensor:
        """Evaluate on broadcastable index tensors; returns a bool tensor."""
        out = self._fn(b, h, q_idx, kv_idx, n_q, n_k)
        if not isinstance(out, torch.Tensor):
            out = torch.as_tensor(out)
        return out.to(torch.bool)

    def conjuncts(self) -> list[Mask]:
        """``a & (b & c)`` → ``[a, b, c]``; any other mask is its own single term."""
        return list(self._terms) if self._terms is not None else [self]

    @property
    def batch_size(self) -> int | None:
        """The batch size this mask was built for (``padding``/``document``), else ``None``."""
        return self._sizes.batch

    @property
    def heads_size(self) -> int | None:
        """The number of heads this mask was built for (``from_tensor`` with H > 1), else
        ``None``."""
        return self._sizes.heads

    @property
    def depends_on_batch(self) -> bool:
        """True when the mask may differ between batch elements (it is then evaluated for every
        batch index; dense evaluations and block maps have size B or 1 in dim 0)."""
        return self._sizes.any_bh or (self._sizes.batch is not None and self._sizes.batch > 1)

    @property
    def depends_on_heads(self) -> bool:
        """True when the mask may differ between heads (it is then evaluated for every head;
        dense evaluations and block maps have size H or 1 in dim 1)."""
        return self._sizes.any_bh or (self._sizes.heads is not None and self._sizes.heads > 1)

    def evaluate(
        self,
        n_q: int,
        n_k: int,
        *,
        q_range: tuple[int, int] | None = None,
        k_range: tuple[int, int] | None = None,
        batch: int = 1,
        heads: int = 1,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """The mask on queries ``[q0, q1)`` × keys ``[k0, k1)`` of an ``n_q × n_k`` call.

        Returns bool ``(B|1, H|1, q1 - q0, k1 - k0)`` (True = may attend): the batch and head
        dims are 1 where the mask does not depend on them (broadcast it, don't copy it).
        ``q_range`` / ``k_range`` default to every query / key. This is how engines evaluate
        a mask on one tile or one block row; :meth:`to_dense` is the full-size copy.
        """
        dev = torch.device(device) if device is not None else self._device
        q0, q1 = q_range if q_range is not None else (0, n_q)
        k0, k1 = k_range if k_range is not None else (0, n_k)
        b = torch.arange(batch if self.depends_on_batch else 1, device=dev).view(-1, 1, 1, 1)
        h = torch.arange(heads if self.depends_on_heads else 1, device=dev).view(1, -1, 1, 1)
        q = torch.arange(q0, q1, device=dev).view(1, 1, -1, 1)
        k = torch.arange(k0, k1, device=dev).view(1, 1, 1, -1)
        out = self(b, h, q, k, n_q, n_k)
        shape = (b.shape[0], h.shape[1], q1 - q0, k1 - k0)
        while out.dim() < 4:
            out = out.unsqueeze(0)
        try:
            torch.broadcast_shapes(out.shape, shape)
            if out.dim() > 4:
                raise RuntimeError
            # minimal: dims the mask does not depend on stay 1 (a from_fn mask that ignores b/h)
            return out.expand(torch.broadcast_shapes(out.shape, (1, 1) + shape[2:]))
        except RuntimeError:
            raise ValueError(
                f"mask {self.name} evaluated to shape {tuple(out.shape)}, which does not "
                f"broadcast to (B, H, N_q, N_k) = {shape}: a mask function must combine the "
                "index tensors elementwise"
            ) from None

    def to_dense(
        self,
        n_q: int,
        n_k: int,
        *,
        batch: int | None = None,
        heads: int | None = None,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """The mask as a bool tensor of shape ``(B, H, N_q, N_k)`` (True = may attend).

        ``batch`` and ``heads`` default to the sizes the mask was built for (1 if none).
        """
        _check_sizes(n_q, n_k)
        batch = self._default_batch(batch)
        heads = self._default_heads(heads)
        dev = torch.device(device) if device is not None else None
        return self.evaluate(n_q, n_k, batch=batch, heads=heads, device=dev).expand(
            batch, heads, n_q, n_k).clone()

    def _default_batch(self, batch: int | None) -> int:
        if batch is None:
            return self._sizes.batch or 1
        if self._sizes.batch is not None and self._sizes.batch > 1 and batch != self._sizes.batch:
            raise ValueError(
                f"mask {self.name} was built for batch {self._sizes.batch}, got batch {batch}: "
                "pass lengths/ids with one entry per batch element"
            )
        return batch

    def _default_heads(self, heads: int | None) -> int:
        if heads is None:
            return self._sizes.heads or 1
        if self._sizes.heads is not None and self._sizes.heads > 1 and heads != self._sizes.heads:
            raise ValueError(
                f"mask {self.name} was built for {self._sizes.heads} heads, got heads={heads}: "
                "give the mask one entry per head (or 1 to share it)"
            )
        return heads

    # ------------------------------------------------------------------ blocks
    def _block_bounds(
        self, n: int, block: int, device: torch.device | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.arange(0, n, block, device=device)
        ends = torch.clamp(starts + block, max=n)
        return starts, ends

    def _blocks_any_all(
        self, n_q: int, n_k: int, block_q: int, block_k: int, batch: int, heads: int,
        device: torch.device | None, exact: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._blocks is not None and not exact:
            dev = device if device is not None else self._device
            qs, qe = self._block_bounds(n_q, block_q, dev)
            ks, ke = self._block_bounds(n_k, block_k, dev)
            any_, all_ = self._blocks(qs.view(-1, 1), qe.view(-1, 1), ks.view(1, -1),
                                      ke.view(1, -1), n_q, n_k)
            return _as4d(any_), _as4d(all_)
        return self._dense_blocks(n_q, n_k, block_q, block_k, batch, heads, device)

    def _dense_blocks(
        self, n_q: int, n_k: int, block_q: int, block_k: int, batch: int, heads: int,
        device: torch.device | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        nbq, nbk = math.ceil(n_q / block_q), math.ceil(n_k / block_k)
        anys, alls = [], []
        pad_k = nbk * block_k - n_k
        for i in range(nbq):
            q0, q1 = i * block_q, min((i + 1) * block_q, n_q)
            d = self.evaluate(n_q, n_k, q_range=(q0, q1), batch=batch, heads=heads, device=device)
            d = d.expand(d.shape[0], d.shape[1], q1 - q0, n_k)
            if pad_k:
                # padding columns: neutral for "any" (False) and for "all" (True)
                d_any = torch.nn.functional.pad(d, (0, pad_k), value=False)
                d_all = torch.nn.functional.pad(d, (0, pad_k), value=True)
            else:
                d_any = d_all = d
            shp = (d.shape[0], d.shape[1], q1 - q0, nbk, block_k)
            anys.append(d_any.reshape(shp).any(-1).any(2))
            alls.append(d_all.reshape(shp).all(-1).all(2))
        return torch.stack(anys, 2), torch.stack(alls, 2)

    def block_map(
        self,
        n_q: int,
        n_k: int,
        block_q: int = 64,
        block_k: int = 64,
        *,
        batch: int | None = None,
        heads: int | None = None,
        device: torch.device | str | None = None,
        exact: bool = False,
    ) -> torch.Tensor:
        """Summarise the mask into tiles: int8 ``(B', H', ⌈N_q/block_q⌉, ⌈N_k/block_k⌉)``.

        Values are ``EMPTY`` (0), ``PARTIAL`` (1) or ``FULL`` (2). ``B'`` and ``H'`` are 1
        where the mask does not depend on batch or head. ``exact=True`` evaluates the mask
        densely (one block row at a time) instead of using the builders' interval rules.
        """
        _check_sizes(n_q, n_k)
        if block_q < 1 or block_k < 1:
            raise ValueError(f"block sizes must be >= 1, got block_q={block_q}, block_k={block_k}")
        batch = self._default_batch(batch)
        heads = self._default_heads(heads)
        dev = torch.device(device) if device is not None else None
        if n_q == 0 or n_k == 0:
            return torch.zeros(1, 1, math.ceil(n_q / block_q), math.ceil(n_k / block_k),
                               dtype=torch.int8, device=dev)
        any_, all_ = self._blocks_any_all(n_q, n_k, block_q, block_k, batch, heads, dev, exact)
        any_, all_ = torch.broadcast_tensors(any_, all_)
        out = torch.where(all_, FULL, torch.where(any_, PARTIAL, EMPTY)).to(torch.int8)
        nbq, nbk = math.ceil(n_q / block_q), math.ceil(n_k / block_k)
        return out.expand(out.shape[0], out.shape[1], nbq, nbk)

    def sparsity(
        self, n_q: int, n_k: int, *, batch: int | None = None, heads: int | None = None
    ) -> float:
        """Fraction of (query, key) pairs that are blocked (0.0 = dense, 1.0 = nothing allowed)."""
        _check_sizes(n_q, n_k)
        batch = self._default_batch(batch)
        heads = self._default_heads(heads)
        if n_q == 0 or n_k == 0:
            return 0.0
        allowed = 0
        rows = max(1, 2**22 // max(n_k, 1))
        for q0 in range(0, n_q, rows):
            d = self.evaluate(n_q, n_k, q_range=(q0, min(q0 + rows, n_q)), batch=batch, heads=heads)
            full_shape = (batch, heads, d.shape[2], n_k)
            allowed += int(d.sum()) * (math.prod(full_shape) // d.numel())
        return 1.0 - allowed / (batch * heads * n_q * n_k)

    # ------------------------------------------------------------------ drawing
    def to_string(
        self, n_q: int | None = None, n_k: int | None = None, *, b: int = 0, h: int = 0
    ) -> str:
        """Draw the mask for batch ``b``, head ``h``: █ = may attend, ░ = blocked.

        Sizes default to the ones the mask was built for (tensor and document masks), else 8.
        """
        nat_q, nat_k = self._natural
        n_q = n_q if n_q is not None else (nat_q or nat_k or 8)
        n_k = n_k if n_k is not None else (nat_k or n_q)
        batch = self._sizes.batch or 1
        d = self.evaluate(n_q, n_k, batch=max(batch, b + 1), heads=h + 1)
        d = d[min(b, d.shape[0] - 1), min(h, d.shape[1] - 1)].expand(n_q, n_k)
        lines = [f"{self.name}  ({n_q}×{n_k}, █ = may attend, ░ = blocked)"]
        lines += ["".join("█" if x else "░" for x in row.tolist()) for row in d]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_string()

    def __repr__(self) -> str:
        return f"Mask({self.name})"

    # ------------------------------------------------------------------ algebra
    def __and__(self, other: Mask) -> Mask:
        other = _as_mask(other, "&")
        a, b_ = self, other

        def fn(b, h, q, k, n_q, n_k):  # noqa: ANN001, ANN202
            return a(b, h, q, k, n_q, n_k) & b_(b, h, q, k, n_q, n_k)

        blocks = None
        if a._blocks is not None and b_._blocks is not None:
            def blocks(qs, qe, ks, ke, n_q, n_k):  # noqa: ANN001, ANN202
                any1, all1 = a._blocks(qs, qe, ks, ke, n_q, n_k)
                any2, all2 = b_._blocks(qs, qe, ks, ke, n_q, n_k)
                return any1 & any2, all1 & all2  # "any" is conservative, "all" exact

        m = _combined(fn, f"({a.name} & {b_.name})", blocks, a, b_)
        m._terms = (*a.conjuncts(), *b_.conjuncts())
        return m

    def __or__(self, other: Mask) -> Mask:
        other = _as_mask(other, "|")
        a, b_ = self, other

        def fn(b, h, q, k, n_q, n_k):  # noqa: ANN001, ANN202
            return a(b, h, q, k, n_q, n_k) | b_(b, h, q, k, n_q, n_k)

        blocks = None
        if a._blocks is not None and b_._blocks is not None:
            def blocks(qs, qe, ks, ke, n_q, n_k):  # noqa: ANN001, ANN202
                any1, all1 = a._blocks(qs, qe, ks, ke, n_q, n_k)
                any2, all2 = b_._blocks(qs, qe, ks, ke, n_q, n_k)
                return any1 | any2, all1 | all2  # "any" exact, "all" conservative

        return _combined(fn, f"({a.name} | {b_.name})", blocks, a, b_)

    def __rand__(self, other: Mask) -> Mask:     # bool_tensor & mask
        return _as_mask(other, "&") & self

    def __ror__(self, other: Mask) -> Mask:      # bool_tensor | mask
        return _as_mask(other, "|") | self

    def __invert__(self) -> Mask:
        a = self

        def fn(b, h, q, k, n_q, n_k):  # noqa: ANN001, ANN202
            return ~a(b, h, q, k, n_q, n_k)

        blocks = None
        if a._blocks is not None:
            def blocks(qs, qe, ks, ke, n_q, n_k):  # noqa: ANN001, ANN202
                any1, all1 = a._blocks(qs, qe, ks, ke, n_q, n_k)
                return ~all1, ~any1

        m = Mask(fn, name=f"~{a.name}", blocks=blocks)
        m._sizes, m._device, m._natural = a._sizes, a._device, a._natural
        return m


def _combined(fn: IndexFn, name: str, blocks: BlockFn | None, a: Mask, b: Mask) -> Mask:
    m = Mask(fn, name=name, blocks=blocks)
    m._sizes = a._sizes.merge(b._sizes)
    m._device = a._device if a._device is not None else b._device
    m._natural = (a._natural[0] or b._natural[0], a._natural[1] or b._natural[1])
    return m


def _as_mask(x: object, op: str) -> Mask:
    if isinstance(x, Mask):
        return x
    if isinstance(x, torch.Tensor) and x.dtype == torch.bool:
        return from_tensor(x)
    raise TypeError(
        f"mask algebra '{op}' needs two Masks (or a bool tensor), got {type(x).__name__}: "
        "build it with attnkit.masks.from_tensor(...) or from_fn(...)"
    )


def _as4d(t: torch.Tensor) -> torch.Tensor:
    t = torch.as_tensor(t)
    while t.dim() < 4:
        t = t.unsqueeze(0)
    return t


def _check_sizes(n_q: int, n_k: int) -> None:
    if not (isinstance(n_q, int) and isinstance(n_k, int)) or n_q < 0 or n_k < 0:
        raise ValueError(f"n_q and n_k must be non-negative integers, got n_q={n_q!r}, n_k={n_k!r}")


# ---------------------------------------------------------------------- building blocks
def _band(lo: float, hi: float, align: str, name: str) -> Mask:
    """Allowed where ``lo <= (q_idx + offset) - kv_idx <= hi``.

    ``offset`` is 0 for top-left alignment and ``N_k - N_q`` for bottom-right alignment
    (the last query lines up with the last key, as in KV-cache decoding).
    """
    if align not in ("top_left", "bottom_right"):
        raise ValueError(f"align must be 'top_left' or 'bottom_right', got {align!r}")
    br = align == "bottom_right"

    def fn(b, h, q, k, n_q, n_k):  # noqa: ANN001, ANN202
        d = q - k + ((n_k - n_q) if br else 0)
        return (d >= lo) & (d <= hi)

    def blocks(qs, qe, ks, ke, n_q, n_k):  # noqa: ANN001, ANN202
        off = (n_k - n_q) if br else 0
        d_min = qs - (ke - 1) + off
        d_max = (qe - 1) - ks + off
        return (d_max >= lo) & (d_min <= hi), (d_min >= lo) & (d_max <= hi)

    return Mask(fn, name=name, blocks=blocks, spec=Band(lo, hi, br))


def full() -> Mask:
    """Every query may attend to every key (the neutral element of ``&``)."""

    def fn(b, h, q, k, n_q, n_k):  # noqa: ANN001, ANN202
        return torch.ones((), dtype=torch.bool, device=q.device).expand(
            torch.broadcast_shapes(q.shape, k.shape))

    def blocks(qs, qe, ks, ke, n_q, n_k):  # noqa: ANN001, ANN202
        t = torch.ones(torch.broadcast_shapes(qs.shape, ks.shape), dtype=torch.bool,
                       device=qs.device)
        return t, t

    return Mask(fn, name="full", blocks=blocks, spec=Band(-math.inf, math.inf))


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


def _lengths(x: object, what: str) -> torch.Tensor:
    t = torch.as_tensor(x)
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

    def fn(b, h, q, k, n_q, n_k):  # noqa: ANN001, ANN202
        ok = k < _pick(kv_len, b)
        if q_len is not None:
            ok = ok & (q < _pick(q_len, b))
        return ok

    def blocks(qs, qe, ks, ke, n_q, n_k):  # noqa: ANN001, ANN202
        L = kv_len.to(qs.device).view(-1, 1, 1, 1)
        any_, all_ = ks < L, ke <= L
        if q_len is not None:
            Lq = q_len.to(qs.device).view(-1, 1, 1, 1)
            any_, all_ = any_ & (qs < Lq), all_ & (qe <= Lq)
        return any_, all_

    name = f"padding(kv_lengths={kv_len.tolist()}" + (
        f", q_lengths={q_len.tolist()})" if q_len is not None else ")")
    return Mask(fn, name=name, blocks=blocks, batch=nb, spec=Lengths(kv_len, q_len))


def _ids(x: object, what: str) -> torch.Tensor:
    t = torch.as_tensor(x)
    if t.dim() not in (1, 2) or t.dtype.is_floating_point:
        raise ValueError(
            f"{what} must be integer document ids of shape (N,) or (B, N), "
            f"got dtype {t.dtype} and shape {tuple(t.shape)}"
        )
    return t.to(torch.long).reshape(-1, t.shape[-1])


def _block_min_max(ids: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor):  # noqa: ANN202
    """Per-block min and max of ids (B, N) for blocks [starts, ends) → (B, n_blocks)."""
    n = ids.shape[-1]
    nblocks = starts.numel()
    block = int((ends.view(-1)[0] - starts.view(-1)[0]).item()) if nblocks else 1
    pad = nblocks * block - n
    # (F.pad takes its fill value as a double: iinfo(long).max would wrap to min)
    def padded(fill: int) -> torch.Tensor:
        return torch.cat([ids, ids.new_full((ids.shape[0], pad), fill)], dim=1)

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

    m = Mask(fn, name="document", blocks=blocks, batch=nb if nb > 1 else None,
             spec=Documents(q_ids, k_ids))
    m._natural = (q_ids.shape[1], k_ids.shape[1])
    return m


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

    in_prefix = Mask(fn, name="prefix", blocks=blocks, batch=nb)
    m = causal() | in_prefix
    shown = prefix_length if nb is None else p.tolist()
    m.name = f"prefix_lm({shown})"
    return m


def from_fn(fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                         torch.Tensor],
            name: str | None = None) -> Mask:
    """A mask from a function ``fn(b, h, q_idx, kv_idx) -> bool tensor``.

    The index tensors broadcast against each other (shapes ``(B,1,1,1)``, ``(1,H,1,1)``,
    ``(1,1,N_q,1)``, ``(1,1,1,N_k)``); use only elementwise torch operations. ``b`` and ``h``
    run over the whole batch and every query head, so the function may use them (e.g. a
    different pattern per head); one that ignores them costs nothing extra.
    """
    if not callable(fn):
        raise TypeError(f"from_fn needs a callable fn(b, h, q_idx, kv_idx), got {type(fn)}")

    def wrapped(b, h, q, k, n_q, n_k):  # noqa: ANN001, ANN202
        return fn(b, h, q, k)

    m = Mask(wrapped, name=name or getattr(fn, "__name__", "from_fn"))
    m._sizes = _Sizes(any_bh=True)
    return m


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
    t4 = _as4d(t)

    def fn(b, h, q, k, n_q, n_k):  # noqa: ANN001, ANN202
        if (t4.shape[2] not in (1, n_q)) or (t4.shape[3] not in (1, n_k)):
            raise ValueError(
                f"mask of shape {tuple(t.shape)} does not broadcast to "
                f"(..., N_q={n_q}, N_k={n_k}): give a mask whose last two dims are "
                f"(N_q, N_k) or 1"
            )
        tt = t4.to(q.device)
        idx = [b, h, q, k]
        idx = [i if tt.shape[d] > 1 else torch.zeros_like(i) for d, i in enumerate(idx)]
        return tt[idx[0], idx[1], idx[2], idx[3]]

    b = t4.shape[0] if t4.shape[0] > 1 else None
    hh = t4.shape[1] if t4.shape[1] > 1 else None
    m = Mask(fn, name=name or f"tensor{tuple(t.shape)}", batch=b, heads=hh, device=t.device)
    m._natural = (t4.shape[2] if t4.shape[2] > 1 else None,
                  t4.shape[3] if t4.shape[3] > 1 else None)
    return m
