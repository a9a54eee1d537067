"""The :class:`Mask` class, its specs and their readers, evaluation and block maps.

See :mod:`attnkit.masks` for the concepts (FULL / PARTIAL / EMPTY blocks) and the builders.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .._shapes import broadcast_shapes

__all__ = [
    "EMPTY",
    "PARTIAL",
    "FULL",
    "Mask",
    "Band",
    "Lengths",
    "Documents",
    "band_of",
    "block_sizes",
    "lengths_of",
    "documents_of",
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

    __slots__ = ("_fn", "_blocks", "name", "_sizes", "_device", "_natural", "spec", "_terms",
                 "_checks", "_exact")

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
        natural: tuple[int | None, int | None] = (None, None),
        checks: tuple[Callable[[int, int], None], ...] = (),
        any_bh: bool = False,
        exact_rules: bool = False,
    ) -> None:
        self._fn = fn
        # What a builder made, for engines that compute it in closed form (None = opaque).
        self.spec = spec
        # The &-terms of a conjunction (set by ``&``); see :meth:`conjuncts`.
        self._terms: tuple[Mask, ...] | None = None
        self._blocks = blocks
        self.name = name
        # any_bh: the function may read b/h at any size (from_fn): evaluated on the full
        # (batch, heads) grid instead of on index 0 only
        self._sizes = _Sizes(batch, heads, any_bh)
        self._device = device
        # (N_q, N_k) the mask was built for (tensor and document masks), else None
        self._natural = natural
        # size checks check(n_q, n_k) of the builders inside (see :meth:`check`)
        self._checks = checks
        # True when the block rules are exact (band, padding, prefix): no refinement needed
        self._exact = exact_rules and blocks is not None

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
        if isinstance(out, bool):
            out = torch.tensor(out, device=q_idx.device)
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
            what = (f"a {out.dtype} tensor" if isinstance(out, torch.Tensor)
                    else f"a {type(out).__name__}")
            raise TypeError(
                f"mask {self.name} returned {what}, not a bool tensor (True = may attend): "
                "return a comparison such as kv_idx <= q_idx (or .bool() it yourself) — "
                "attnkit does not guess how a number becomes allowed/blocked"
            )
        return out

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

    @property
    def natural_size(self) -> tuple[int | None, int | None]:
        """``(N_q, N_k)`` the mask was built for (tensor and document masks), else None."""
        return self._natural

    @property
    def summarised_by_rules(self) -> bool:
        """True when :meth:`block_map` comes from interval rules (O(blocks), no evaluation):
        the builders' masks and their algebra; False for ``from_fn`` and tensor masks."""
        return self._blocks is not None

    def check(self, n_q: int, n_k: int) -> None:
        """Raise a clear error if the mask cannot apply to an ``n_q × n_k`` call (a padding
        length above N_k / N_q, document ids of another length, a tensor of another shape).
        Every evaluation checks this too; ``Problem`` checks it once per call, so that engines
        reading :attr:`spec` directly refuse the same calls."""
        for c in self._checks:
            c(n_q, n_k)

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
        a mask on one tile or one block row; :meth:`to_dense` is the full-size copy. A large
        range is evaluated a few rows at a time (index arithmetic stays small).
        """
        dev = torch.device(device) if device is not None else self._device
        q0, q1 = q_range if q_range is not None else (0, n_q)
        k0, k1 = k_range if k_range is not None else (0, n_k)
        if not (0 <= q0 <= q1 <= n_q and 0 <= k0 <= k1 <= n_k):
            raise ValueError(
                f"mask {self.name}: q_range=({q0}, {q1}) / k_range=({k0}, {k1}) must lie "
                f"within the call's N_q={n_q} queries / N_k={n_k} keys (0 <= start <= end)"
            )
        nb = batch if self.depends_on_batch else 1
        nh = heads if self.depends_on_heads else 1
        per_row = nb * nh * (k1 - k0)
        if (q1 - q0) * per_row <= _BIG:
            return self._tile(n_q, n_k, q0, q1, k0, k1, nb, nh, dev)
        return _by_rows(q1 - q0, k1 - k0, per_row, torch.bool, lambda r0, r1: self._tile(
            n_q, n_k, q0 + r0, q0 + r1, k0, k1, nb, nh, dev))

    def _tile(self, n_q: int, n_k: int, q0: int, q1: int, k0: int, k1: int, nb: int, nh: int,
              dev: torch.device | None) -> torch.Tensor:
        b = torch.arange(nb, device=dev).view(-1, 1, 1, 1)
        h = torch.arange(nh, device=dev).view(1, -1, 1, 1)
        q = torch.arange(q0, q1, device=dev).view(1, 1, -1, 1)
        k = torch.arange(k0, k1, device=dev).view(1, 1, 1, -1)
        out = self(b, h, q, k, n_q, n_k)
        shape = (nb, nh, q1 - q0, k1 - k0)
        while out.dim() < 4:
            out = out.unsqueeze(0)
        try:
            broadcast_shapes(out.shape, shape)
            if out.dim() > 4:
                raise RuntimeError
        except RuntimeError:
            raise ValueError(
                f"mask {self.name} evaluated to shape {tuple(out.shape)}, which does not "
                f"broadcast to (B, H, N_q, N_k) = {shape}: a mask function must return one "
                "bool per (b, h, q_idx, kv_idx)"
            ) from None
        # minimal: dims the mask does not depend on stay 1 (a from_fn mask that ignores b/h)
        return out.expand(broadcast_shapes(out.shape, (1, 1) + shape[2:]))

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
        Filled a few rows at a time: the peak memory is the result plus a small slice.
        """
        _check_sizes(n_q, n_k)
        batch = self._default_batch(batch)
        heads = self._default_heads(heads)
        dev = torch.device(device) if device is not None else self._device
        out = torch.empty(batch, heads, n_q, n_k, dtype=torch.bool, device=dev)
        step = max(1, _PIECE // max(1, batch * heads * n_k))
        for r0 in range(0, n_q, step):
            r1 = min(r0 + step, n_q)
            out[:, :, r0:r1] = self.evaluate(n_q, n_k, q_range=(r0, r1), batch=batch,
                                             heads=heads, device=dev)
        return out

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
    def _rule_codes(self, n_q: int, n_k: int, block_q: int, block_k: int, i0: int, i1: int,
                    dev: torch.device | None) -> torch.Tensor:
        """Block rows ``[i0, i1)`` from the builders' interval rules → int8 codes."""
        qs = torch.arange(i0 * block_q, min(i1 * block_q, n_q), block_q, device=dev)
        ks = torch.arange(0, n_k, block_k, device=dev)
        qe, ke = (qs + block_q).clamp(max=n_q), (ks + block_k).clamp(max=n_k)
        assert self._blocks is not None
        any_, all_ = self._blocks(qs.view(-1, 1), qe.view(-1, 1), ks.view(1, -1),
                                  ke.view(1, -1), n_q, n_k)
        return _codes(_as4d(any_), _as4d(all_))

    def block_counts(
        self, n_q: int, n_k: int, block_q: int = 64, block_k: int = 64, *,
        block_rows: tuple[int, int] | None = None, block_cols: tuple[int, int] | None = None,
        batch: int | None = None, heads: int | None = None,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """Allowed (query, key) pairs in each block, by evaluation: int64
        ``(B', H', i1 - i0, j1 - j0)`` for block rows ``[i0, i1)`` × block columns
        ``[j0, j1)`` (default: all) of the ``block_q × block_k`` grid."""
        batch = self._default_batch(batch)
        heads = self._default_heads(heads)
        dev = torch.device(device) if device is not None else self._device
        i0, i1 = block_rows if block_rows is not None else (0, math.ceil(n_q / block_q))
        j0, j1 = block_cols if block_cols is not None else (0, math.ceil(n_k / block_k))
        q0, q1 = i0 * block_q, min(i1 * block_q, n_q)
        k0, k1 = j0 * block_k, min(j1 * block_k, n_k)
        d = self.evaluate(n_q, n_k, q_range=(q0, q1), k_range=(k0, k1), batch=batch,
                          heads=heads, device=dev)
        d = d.expand(d.shape[0], d.shape[1], q1 - q0, k1 - k0)
        # pad to whole blocks with False: padding pairs are not allowed pairs
        d = torch.nn.functional.pad(d, (0, (j1 - j0) * block_k - (k1 - k0),
                                        0, (i1 - i0) * block_q - (q1 - q0)), value=False)
        d = d.reshape(d.shape[0], d.shape[1], i1 - i0, block_q, j1 - j0, block_k)
        return d.sum(5, dtype=torch.int32).sum(3)

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
        where the mask does not depend on batch or head. Builders' masks (and their algebra)
        are summarised by interval rules, a few block rows at a time; ``exact=True`` then
        evaluates the PARTIAL blocks only (the rules' FULL and EMPTY are always right). Masks
        without rules (``from_fn``, tensors) are evaluated densely, one block row at a time.
        """
        _check_sizes(n_q, n_k)
        if not all(isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= 1
                   for x in (block_q, block_k)):
            raise ValueError(f"block sizes must be >= 1, got block_q={block_q}, block_k={block_k}"
                             " (integers)")
        block_q, block_k = int(block_q), int(block_k)
        batch = self._default_batch(batch)
        heads = self._default_heads(heads)
        dev = torch.device(device) if device is not None else self._device
        nbq, nbk = math.ceil(n_q / block_q), math.ceil(n_k / block_k)
        if n_q == 0 or n_k == 0:
            return torch.zeros(1, 1, nbq, nbk, dtype=torch.int8, device=dev)
        self.check(n_q, n_k)
        nb = batch if self.depends_on_batch else 1
        nh = heads if self.depends_on_heads else 1
        rq = (n_q - torch.arange(0, n_q, block_q)).clamp(max=block_q)    # rows per block row
        rk = (n_k - torch.arange(0, n_k, block_k)).clamp(max=block_k)    # keys per block col

        def counted(i0: int, i1: int, j0: int = 0, j1: int = nbk) -> torch.Tensor:
            c = self.block_counts(n_q, n_k, block_q, block_k, block_rows=(i0, i1),
                                  block_cols=(j0, j1), batch=batch, heads=heads, device=dev)
            full = (rq[i0:i1].view(-1, 1) * rk[j0:j1].view(1, -1)).to(c.device)
            return torch.where(c == full, FULL, torch.where(c > 0, PARTIAL, EMPTY)).to(
                torch.int8)

        if self._blocks is None:
            return _by_rows(nbq, nbk, nb * nh * block_q * n_k, torch.int8, counted)
        out = _by_rows(nbq, nbk, nb * nh * nbk, torch.int8, lambda i0, i1: self._rule_codes(
            n_q, n_k, block_q, block_k, i0, i1, dev))
        out = out.expand(out.shape[0], out.shape[1], nbq, nbk)
        if exact and not self._exact:
            # the rules' FULL and EMPTY are always right: evaluate the PARTIAL blocks only,
            # each block row over the span of its PARTIAL columns
            rows = (out == PARTIAL).flatten(0, 1).any(0)                 # (nbq, nbk)
            cols = torch.arange(nbk, device=rows.device)
            first = torch.where(rows, cols, nbk).amin(1).tolist()
            last = torch.where(rows, cols, -1).amax(1).tolist()
            out = out.clone()
            for i in rows.any(1).nonzero().flatten().tolist():
                j0, j1 = first[i], last[i] + 1
                c = counted(i, i + 1, j0, j1)
                if c.shape[0] > out.shape[0] or c.shape[1] > out.shape[1]:
                    out = out.expand(max(c.shape[0], out.shape[0]),
                                     max(c.shape[1], out.shape[1]), nbq, nbk).clone()
                sl = out[:, :, i:i + 1, j0:j1]
                sl.copy_(torch.where(sl == PARTIAL, c, sl))
        return out

    def sparsity(
        self, n_q: int, n_k: int, *, batch: int | None = None, heads: int | None = None
    ) -> float:
        """Fraction of (query, key) pairs that are blocked (0.0 = dense, 1.0 = nothing allowed).

        Band, padding and document masks answer in closed form; other builders' masks from
        their block map (only PARTIAL blocks are evaluated); ``from_fn`` and tensor masks by
        evaluation, a few rows at a time.
        """
        from .summary import sparsity

        _check_sizes(n_q, n_k)
        return sparsity(self, n_q, n_k, self._default_batch(batch), self._default_heads(heads))

    # ------------------------------------------------------------------ drawing
    def to_string(
        self, n_q: int | None = None, n_k: int | None = None, *, b: int = 0, h: int = 0,
        grid: int = 64,
    ) -> str:
        """Draw the mask for batch element ``b``, head ``h``: █ = may attend, ░ = blocked.

        Sizes default to the ones the mask was built for (tensor and document masks), else 8.
        A mask larger than ``grid`` on a side is drawn as at most ``grid × grid`` blocks
        (like FlexAttention's ``to_string(grid_size=...)``): █ every pair of the block may
        attend, ▒ some may, ░ none may — the text stays small at any size.
        """
        from .summary import draw

        return draw(self, n_q, n_k, b=b, h=h, grid=grid)

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

        m = Mask(fn, name=f"~{a.name}", blocks=blocks, exact_rules=a._exact)
        m._sizes, m._device, m._natural = a._sizes, a._device, a._natural
        m._checks = a._checks
        return m


def _combined(fn: IndexFn, name: str, blocks: BlockFn | None, a: Mask, b: Mask) -> Mask:
    m = Mask(fn, name=name, blocks=blocks)
    m._checks = a._checks + b._checks
    m._sizes = a._sizes.merge(b._sizes)
    m._device = a._device if a._device is not None else b._device
    m._natural = (a._natural[0] or b._natural[0], a._natural[1] or b._natural[1])
    return m


def _as_mask(x: object, op: str) -> Mask:
    if isinstance(x, Mask):
        return x
    if isinstance(x, torch.Tensor) and x.dtype == torch.bool:
        from .builders import from_tensor  # builders import core: resolved at call time

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


# Elements per piece when a large result is built a few rows at a time (index arithmetic in
# int64 is 8 bytes an element: a piece costs ~8 MB), and the size above which evaluate() does.
_PIECE = 2**18
_BIG = 2**22


def block_sizes(n_q: int, n_k: int, block_q: int, block_k: int) -> torch.Tensor:
    """(query, key) pairs in each block of the ``block_q × block_k`` grid: int64
    ``(⌈N_q/block_q⌉, ⌈N_k/block_k⌉)`` (edge blocks are smaller)."""
    rq = (n_q - torch.arange(0, n_q, block_q)).clamp(max=block_q)
    rk = (n_k - torch.arange(0, n_k, block_k)).clamp(max=block_k)
    return rq.view(-1, 1) * rk.view(1, -1)


def _codes(any_: torch.Tensor, all_: torch.Tensor) -> torch.Tensor:
    """(any allowed, all allowed) → EMPTY 0 / PARTIAL 1 / FULL 2, computed in int8."""
    any_, all_ = torch.broadcast_tensors(any_, all_)
    return (any_ | all_).to(torch.int8) + all_.to(torch.int8)


def _by_rows(n_rows: int, n_cols: int, per_row: int, dtype: torch.dtype,
             piece: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """``piece(r0, r1)`` — ``(B'|1, H'|1, r1 - r0 | 1, n_cols | 1)`` — over row ranges of about
    ``_PIECE`` elements, written into one ``(B', H', n_rows, n_cols)`` tensor: the peak memory
    is the result plus one piece's work."""
    step = max(1, _PIECE // max(1, per_row))
    out: torch.Tensor | None = None
    for r0 in range(0, n_rows, step):
        r1 = min(r0 + step, n_rows)
        t = _as4d(piece(r0, r1))
        if out is None:
            out = torch.empty(t.shape[0], t.shape[1], n_rows, n_cols, dtype=dtype,
                              device=t.device)
        elif t.shape[0] > out.shape[0] or t.shape[1] > out.shape[1]:
            out = out.expand(max(t.shape[0], out.shape[0]), max(t.shape[1], out.shape[1]),
                             n_rows, n_cols).clone()
        out[:, :, r0:r1] = t
    assert out is not None
    return out
