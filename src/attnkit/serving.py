"""Serving: flash-attn's KV-cache calls on attnkit's engines — paged or contiguous caches,
new tokens appended in place, one call over a batch of sequences of different lengths.

:func:`attention_with_kvcache` is ``flash_attn_with_kvcache`` (same argument names, layout
and semantics); :func:`attention_varlen` is ``flash_attn_varlen_func`` for packed ragged
batches, with or without a paged cache. :class:`attnkit.PagedKVCache` holds the pages.

Shape legend (flash-attn's layout: batch, sequence, heads, dim)::

    q            (B, N_q, H_q, D)                 varlen: (total_q, H_q, D)
    k_cache      paged: (num_blocks, block_size, H_kv, D)   contiguous: (B, N_cache, H_kv, D)
    v_cache      the same with D_v
    k, v (new)   (B, N_new, H_kv, D | D_v)        written at cache_seqlens[b] ... + N_new − 1
    cache_seqlens (B,) int                        block_table (B, max_pages) int
    cu_seqlens_q, cu_seqlens_k (B+1,) int         cumulative lengths [0, n_0, n_0 + n_1, ...]
    out          (B, N_q, H_q, D_v)               varlen: (total_q, H_q, D_v)
    lse          (B, H_q, N_q) float32 (float64 in)  varlen: (H_q, total_q)

    N_k(b) = cache_seqlens[b] + N_new             keys sequence b attends to
    causal / window: query i of b sees keys j with
        i + N_k(b) − N_q − left <= j <= i + N_k(b) − N_q + right     (bottom-right aligned)

How it is computed: with the native kernel (CPU, ``backend="auto"``), a paged
call is ONE kernel call that reads the pages through the block table — no gathered copy
(:func:`attnkit.backends.native.paged_attention`): every sequence's queries over its keys,
decodes and prefill chunks together, bottom-right causal / window, soft-cap and ALiBi per
sequence, the work split over the cores (a long sequence's keys in several items, merged by
LSE; the threads take items one at a time). Sequences forked from one prompt (the same
leading pool pages) attend to those pages once — one sequence of the call holding all their
queries — merged with each one's own keys by LSE (cascade; ``shared_prefix``).

Without it (``ATTNKIT_NATIVE=0``, no compiler, another device, a query requiring grad, a
``backend`` other than "auto" or a :func:`attnkit.backends.use` scope: the chosen engine) each
sequence's pages are read in Python (``index_select`` of the pages it holds — a gathered
copy) and attended by :func:`attnkit.attention`: single-query rows with no
position-dependent term (ALiBi, a left window) together in one call, their gathered keys
padded and masked by ``masks.padding``; the others one call each, with the closed-form masks
of :mod:`attnkit.masks` (``window``, bottom-right) and ALiBi as a score term with its spec.
A contiguous cache always takes that route (views, no copy).

Caution
-------
- The block table is validated in Python before anything is written (NumPy on the
  table; the row-by-row checks that name what is wrong only when that fails): tens of µs
  for a large batch. A table that passed is remembered by its bytes with the pages each row
  reads and writes from (up to 8 tables of up to 65536 entries), so a decode step over
  the table of the step before is not checked again; a table changed in place has other
  bytes and is checked anew (a PagedKVCache's own checks also anew after any change of its
  page refcounts).
- Fallback only: batched decode rows are gathered into a workspace kept per pool (a
  PagedKVCache's, or one held while a raw pool tensor lives), as large as the largest
  batch's padded keys; and one engine call per sequence with several queries (on a small
  or oversubscribed CPU the per-call cost can exceed the work of a short sequence).
- Differences from flash-attn: see :func:`attention_with_kvcache` (a row with no key gets
  LSE −∞, not +inf; ``rotary_*``, ``cache_batch_idx``, ``cache_leftpad`` are refused;
  ``num_splits`` is accepted and ignored; block_size may be any size; D_v may differ from D;
  float64 is accepted).
- Inference only: the caches are written in place outside autograd (as flash-attn's).
- The layout is checked by shape only: a ``(B, H, N, D)`` tensor (SDPA's) whose shape also
  reads as ``(B, N, H, D)`` (MQA decoding: ``q (B, H_q, 1, D)`` with H_kv = 1) is taken as
  the latter; transpose SDPA-layout tensors first (``.transpose(1, 2)``).
"""

from __future__ import annotations

import array
import itertools
import math
import numbers
import os
import weakref
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from . import _compat
from . import backends as _backends
from . import masks as _masks
from .api import attention
from .backends import native as _native
from .backends.base import compute_dtype, merge_partials
from .layers.paged import pool_owner
from .scores import Alibi, ScoreTerm

__all__ = ["attention_with_kvcache", "attention_varlen"]


# --------------------------------------------------------------------------- checks
def _shape(t: Any) -> str:
    return str(tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__


def _tensor(x: Any, name: str, rank: int, layout: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() != rank or not x.dtype.is_floating_point:
        seen = (f"{x.dtype} {_shape(x)}" if isinstance(x, torch.Tensor) else type(x).__name__)
        raise ValueError(f"{name} must be a {rank}-D floating-point tensor {layout}, got {seen}")
    return x


def _int_vector(x: Any, name: str, n: int) -> list[int]:
    if isinstance(x, numbers.Integral) and not isinstance(x, bool):
        vals = [int(x)] * n
    else:
        t = torch.as_tensor(x)
        if t.dtype.is_floating_point or t.dtype == torch.bool or t.dim() != 1 or t.numel() != n:
            raise ValueError(f"{name} must be an int or a 1-D integer tensor of {n} entries "
                             f"(one per sequence), got {t.dtype} {tuple(t.shape)}")
        vals = [int(v) for v in t.tolist()]
    if any(v < 0 for v in vals):
        raise ValueError(f"{name} must be >= 0, got {vals}")
    return vals


def _cu(x: Any, name: str) -> list[int]:
    t = torch.as_tensor(x)
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.dim() != 1 or t.numel() < 1:
        raise ValueError(f"{name} must be a 1-D integer tensor (B+1,) of cumulative lengths "
                         f"[0, n_0, n_0 + n_1, ...], got {t.dtype} {tuple(t.shape)}")
    cu = [int(c) for c in t.tolist()]
    if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:], strict=False)):
        raise ValueError(f"{name} must start at 0 and never decrease (cumulative lengths), got "
                         f"{cu}")
    return cu


def _window(window_size: Any, causal: Any) -> tuple[int, int]:
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False, got {causal!r}")
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2 or any(
            not isinstance(w, numbers.Integral) or isinstance(w, bool) or w < -1
            for w in window_size)):
        raise ValueError(f"window_size must be (left, right), integers >= 0 or -1 for "
                         f"unbounded, got {window_size!r}")
    left, right = int(window_size[0]), int(window_size[1])
    return left, (0 if causal else right)          # causal: flash-attn sets right = 0


def _slopes(alibi_slopes: Any, batch: int, heads: int) -> torch.Tensor | None:
    """flash-attn's ``alibi_slopes`` (H_q,) or (B, H_q) → (B, H_q) float64, or None."""
    if alibi_slopes is None:
        return None
    t = torch.as_tensor(alibi_slopes)
    if not t.dtype.is_floating_point or t.shape not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes must be a float tensor of shape (H_q,) = ({heads},) or "
                         f"(B, H_q) = ({batch}, {heads}), got {t.dtype} {tuple(t.shape)}")
    return t.detach().to("cpu", torch.float64).expand(batch, heads)


def _check_scale_backend(scale: Any, backend: Any) -> None:
    """Checked before any write (attention() would refuse them only after it)."""
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)
                              or not math.isfinite(scale)):
        raise ValueError(f"softmax_scale must be a finite number or None (1/√D), got {scale!r}")
    _backends.check_name(backend)


def _unsupported(call: str, **given: Any) -> None:
    for name, (value, default, fix) in given.items():
        if value is not default and (default is None or value != default):
            raise NotImplementedError(f"{name} is not supported by attnkit's "
                                      f"{call} yet: {fix}")


# --------------------------------------------------------------------------- one sequence
def _alibi_term(slopes: torch.Tensor, offset: int) -> ScoreTerm:
    """ALiBi for one sequence: ``score − slope_h · |q_idx + offset − kv_idx|``, as a score
    term carrying its :class:`~attnkit.scores.Alibi` spec (kernels read the spec)."""

    def score_mod(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        s = slopes.to(device=score.device, dtype=score.dtype)[h]
        return score - s * (q_idx + offset - kv_idx).abs().to(score.dtype)

    return ScoreTerm(score_mod, f"alibi(offset {offset})", slopes.numel(),
                     spec=Alibi(slopes, offset))


def _attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None,
                window: tuple[int, int], softcap: float, slopes: torch.Tensor | None,
                backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: ``q (N_q, H_q, D)``, ``k (N_k, H_kv, D)``, ``v (N_k, H_kv, D_v)`` →
    ``out (N_q, H_q, D_v)``, ``lse (H_q, N_q)``; window bottom-right aligned."""
    n_q, n_k = q.shape[0], k.shape[0]
    left, right = window
    full = (left == -1 or left >= n_k - 1) and (right == -1 or right >= n_q - 1)
    mask = None if full else _masks.window(left, right)
    term = None if slopes is None else _alibi_term(slopes, n_k - n_q)
    q4 = q.permute(1, 0, 2).unsqueeze(0)                          # (1, H_q, N_q, D)
    k4 = k.permute(1, 0, 2).unsqueeze(0)                          # (1, H_kv, N_k, D)
    v4 = v.permute(1, 0, 2).unsqueeze(0)                          # (1, H_kv, N_k, D_v)
    out, lse = attention(q4, k4, v4, mask=mask, scale=scale, softcap=softcap or None,
                         score_mod=term, backend=backend, return_lse=True)
    return out[0].transpose(0, 1), lse[0]                         # (N_q, H_q, D_v), (H_q, N_q)


# --------------------------------------------------------------------------- paged reads
def _check_pages(block_table: Any, batch: int, num_blocks: int, block_size: int,
                 lengths: list[int], starts: list[int] | None) -> list[list[int]]:
    """Validate the block table for reading ``lengths[b]`` tokens of row b (and writing from
    ``starts[b]`` on) → each row's pages as a list. Raises before anything is written."""
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 \
            or block_table.dtype.is_floating_point or block_table.dtype == torch.bool \
            or block_table.shape[0] != batch:
        seen = (f"{block_table.dtype} {_shape(block_table)}"
                if isinstance(block_table, torch.Tensor) else type(block_table).__name__)
        raise ValueError(f"block_table must be a 2-D integer tensor (B, max_pages) = "
                         f"({batch}, max_pages), got {seen}")
    width = block_table.shape[1]
    need = [-(-n // block_size) for n in lengths]
    raw = block_table.detach().cpu().numpy()                               # (B, W)
    key = _checked_key(raw, num_blocks, need, None if starts is None else [
        s // block_size if s < n else -1 for s, n in zip(starts, lengths, strict=True)])
    known = _CHECKED.get(key) if key is not None else None
    if known is not None:
        return known
    t = raw.astype(np.int64)                                               # (B, W), read once
    rows = t.tolist()
    if max(need, default=0) <= width and _pages_ok(t, need, num_blocks, block_size, lengths,
                                                   starts):
        pages = [row[:n] for row, n in zip(rows, need, strict=True)]
        if key is not None:
            if len(_CHECKED) >= _CHECKED_MAX:
                _CHECKED.clear()                          # (no iteration: other threads)
            _CHECKED[key] = pages
        return pages
    pages: list[list[int]] = []
    for b, n in enumerate(lengths):
        need = -(-n // block_size)
        if need > width:
            raise ValueError(
                f"sequence {b} has {n} tokens (cache_seqlens + new), which need {need} pages of "
                f"{block_size}, but its block_table row holds only {width}: a sequence longer "
                "than its pages. Allocate pages first (PagedKVCache.reserve)")
        row = rows[b][:need]
        if row and (min(row) < 0 or max(row) >= num_blocks):     # then find the entry
            j, p = next((j, p) for j, p in enumerate(row) if not 0 <= p < num_blocks)
            why = (f" (-1 is padding: the row has fewer pages than the sequence's {n} tokens "
                   f"need in pages of block_size = {block_size}, k_cache being (num_blocks, "
                   "block_size, H_kv, D) — a sequence longer than its pages)" if p == -1 else "")
            raise ValueError(
                f"block_table[{b}, {j}] = {p} is out of range: the pool has {num_blocks} "
                f"pages (0..{num_blocks - 1}){why}")
        if len(set(row)) != len(row):
            dup = next(p for p in row if row.count(p) > 1)
            raise ValueError(f"block_table row {b} lists page {dup} twice: each token position "
                             "needs a page of its own")
        pages.append(row)
    if starts is not None:
        written = {p for b, row in enumerate(pages) if starts[b] < lengths[b]
                   for p in row[starts[b] // block_size:]}
        # written page -> rows using it (set intersections: no count of every page)
        readers = Counter(itertools.chain.from_iterable(written.intersection(r) for r in pages))
        for b, row in enumerate(pages):
            if starts[b] >= lengths[b]:
                continue
            for p in row[starts[b] // block_size:]:
                if readers[p] > 1:
                    others = [c for c, r in enumerate(pages) if c != b and p in r]
                    raise ValueError(
                        f"page {p} is written by sequence {b} (new tokens from position "
                        f"{starts[b]}) and also used by sequence(s) "
                        f"{others} of this call: a page used by two "
                        "sequences without a fork would have its keys overwritten. Give each "
                        "sequence its own page for the tokens it writes (PagedKVCache.fork and "
                        "reserve copy a shared page on the first write)")
    return pages


# block tables that passed _check_pages → their rows' pages (to be read, never changed), keyed
# by all the check reads: the table's bytes, dtype and shape, the pool's page count, each
# row's pages read and first page written. A decode step mostly repeats its table and page
# counts (forks of one prompt: the same for 16 steps): checked once, not every step (16
# forks of a 4096-token prefix: 0.15 ms a step). Content, not tensor identity: a table
# changed in place (numpy views too) is a new key, so nothing wrong ever passes unchecked.
_CHECKED: dict[tuple[Any, ...], list[list[int]]] = {}
_CHECKED_MAX = 8                    # tables kept (a few layers' or steps')
_CHECKED_ENTRIES = 1 << 16          # larger tables are checked every call (not kept)


def _checked_key(raw: np.ndarray, num_blocks: int, need: list[int],
                 first: list[int] | None) -> tuple[Any, ...] | None:
    """:data:`_CHECKED`'s key for the table ``raw`` (B, W) whose row b reads ``need[b]``
    pages and writes from page ``first[b]`` on (-1: no write; None: no row writes), or None
    for a table too large to keep."""
    if raw.size > _CHECKED_ENTRIES:
        return None
    return (raw.dtype.str, raw.shape, raw.tobytes(), num_blocks, tuple(need),
            None if first is None else tuple(first))


def _pages_ok(t: np.ndarray, need: list[int], num_blocks: int, block_size: int,
              lengths: list[int], starts: list[int] | None) -> bool:
    """:func:`_check_pages`' rules on the whole table at once (NumPy on the table's memory:
    16 rows of a 4096-token prefix are 4240 entries, a Python pass over them took 0.27 ms
    a decode step, and torch's small ops cost 10-100 µs each) → whether all hold; False
    sends the caller through its row-by-row checks, which name what is wrong. Row b reads
    its first ``need[b]`` entries; ``t`` is the block table (B, W) as int64."""
    col = np.arange(t.shape[1])
    read = col < np.asarray(need, dtype=np.int64)[:, None]                 # (B, W)
    if ((t < 0) | (t >= num_blocks))[read].any():
        return False                                   # an entry out of range (or -1)
    # a page listed twice in a row: sorted rows, the unread entries made distinct negatives
    ordered = np.sort(np.where(read, t, -1 - col), axis=1)
    if (ordered[:, 1:] == ordered[:, :-1]).any():
        return False
    if starts is None:
        return True
    first = np.asarray([s // block_size if s < n else t.shape[1]
                        for s, n in zip(starts, lengths, strict=True)], dtype=np.int64)
    written = t[read & (col >= first[:, None])]        # pages rows write into
    if written.size == 0:
        return True
    # each written page read by one row only, its writer (no row lists a page twice: checked
    # above); rows reading each page counted over the pages up to the largest read
    readers = np.bincount(t[read])                                        # (max page + 1,)
    return bool((readers[written] == 1).all())


def _read_pages(pool: torch.Tensor, pages: list[int], n: int) -> torch.Tensor:
    """The first ``n`` tokens held by ``pages`` of ``pool`` → ``(n, H_kv, D)`` (a copy)."""
    idx = torch.tensor(pages, dtype=torch.long, device=pool.device)
    return pool.index_select(0, idx).flatten(0, 1)[:n]


def _write(pools: tuple[torch.Tensor, torch.Tensor], pages: list[list[int]] | None,
           starts: list[int], news: tuple[torch.Tensor, torch.Tensor], block_size: int) -> None:
    """Write ``news = (k, v)``, each ``(B, N_new, H_kv, D | D_v)``, at positions ``starts[b]
    ...`` of each row of ``pools = (k_cache, v_cache)`` (the positions' slots found once for
    both)."""
    n_new = news[0].shape[1]
    if n_new == 0 or not starts:                        # no tokens, or no rows (B = 0)
        return
    dev = pools[0].device
    with torch.no_grad():
        if pages is None:                               # contiguous (B, N_cache, H_kv, D)
            pos = torch.tensor(starts, device=dev).unsqueeze(1) + torch.arange(n_new, device=dev)
            rows = torch.arange(news[0].shape[0], device=dev).unsqueeze(1).expand_as(pos)
            for pool, new in zip(pools, news, strict=True):
                pool[rows, pos] = new
            return
        # position p of row b: slot row[p // bs] · bs + p % bs of the pool's token slots,
        # found in Python (a decode step's few positions: one tensor, not five tensor ops)
        slot_of = torch.tensor([row[p // block_size] * block_size + p % block_size
                                for row, s in zip(pages, starts, strict=True)
                                for p in range(s, s + n_new)], device=dev)   # (B · N_new,)
        for pool, new in zip(pools, news, strict=True):
            if pool.stride(0) == block_size * pool.stride(1):   # token slots as one dim: a view
                # rows copied by index_copy_ (index_put's path took ms on a loaded CPU)
                slots = pool.view(-1, *pool.shape[2:])          # (num_blocks · bs, H_kv, D)
                slots.index_copy_(0, slot_of, new.reshape(-1, *new.shape[2:]))
            else:
                page = slot_of.view(-1, n_new) // block_size    # (B, N_new)
                pool[page, slot_of.view(-1, n_new) % block_size] = new


def _overwritten(pools: tuple[torch.Tensor, torch.Tensor], pages: list[list[int]] | None,
                 starts: list[int], n_new: int, block_size: int) -> Any:
    """A copy of what :func:`_write` will overwrite (paged: the pages written; contiguous: the
    positions ``min(starts) ... max(starts) + n_new − 1`` of every row) → a function that
    puts it back."""
    with torch.no_grad():
        if pages is None:
            at = slice(min(starts), max(starts) + n_new)
            kept = [pool[:, at].clone() for pool in pools]
        else:
            at = torch.tensor(sorted({row[p // block_size] for row, s in zip(
                pages, starts, strict=True) for p in range(s, s + n_new)}),
                dtype=torch.long, device=pools[0].device)
            kept = [pool[at] for pool in pools]                     # (pages, bs, H_kv, D)

    def undo() -> None:
        with torch.no_grad():
            for pool, old in zip(pools, kept, strict=True):
                if pages is None:
                    pool[:, at] = old
                else:
                    pool[at] = old

    return undo


# --------------------------------------------------------------------------- rows
# raw pools (not a PagedKVCache's) → their gather workspace, dropped when the pool is
_RAW_WORKSPACES: dict[int, dict[str, torch.Tensor]] = {}


def _workspace(pool: torch.Tensor, name: str, rows: int, pages: int) -> torch.Tensor:
    """A reusable ``(≥ rows, ≥ pages, block_size, H, D)`` gather buffer for ``pool``: the
    owning :class:`~attnkit.PagedKVCache`'s, or one kept while a raw pool lives. Reuse
    means no fresh memory (page faults) per decode step."""
    owner = pool_owner(pool) if name == "k" else None
    if owner is not None:
        return owner.workspace(name, rows, pages)
    key = id(pool)
    if key not in _RAW_WORKSPACES:
        _RAW_WORKSPACES[key] = {}
        weakref.finalize(pool, _RAW_WORKSPACES.pop, key, None)
    work = _RAW_WORKSPACES[key]
    buf = work.get(name)
    if buf is None or buf.shape[0] < rows or buf.shape[1] < pages:
        old = (0, 0) if buf is None else buf.shape[:2]
        buf = pool.new_zeros(max(rows, old[0]), max(pages, old[1]), *pool.shape[1:])
        work[name] = buf
    return buf


def _gather_padded(pool: torch.Tensor, page_lists: list[list[int]], ns: list[int],
                   workspace: torch.Tensor) -> torch.Tensor:
    """Rows' first ``ns[r]`` tokens from their pages → ``(R, n_max, H, D)``: one copy of
    each needed page into ``workspace`` ``(≥ R, ≥ P, bs, H, D)``; past a row's pages it
    holds stale gathers or zeros (the padding mask hides them)."""
    bs = pool.shape[1]
    counts = [-(-n // bs) for n in ns]
    buf = workspace[: len(ns), : max(counts)]                     # (R, P, bs, H, D)
    for r, (row, c) in enumerate(zip(page_lists, counts, strict=True)):
        if c:
            idx = torch.tensor(row[:c], dtype=torch.long, device=pool.device)
            torch.index_select(pool, 0, idx, out=buf[r, :c])      # a contiguous slice
    return buf.flatten(1, 2)[:, : max(ns)]


def _attend_single_queries(qs: list[torch.Tensor], kvs: list[Any], ns: list[int],
                           k_pool: torch.Tensor, v_pool: torch.Tensor, *, opts: dict[str, Any]
                           ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rows with one query each and no position-dependent term, in ONE engine call: the
    query sees every one of its ``ns[r]`` keys (causal and a right window cut nothing for the
    last query), so a padding mask is exact. ``kvs[r]``: a page list, or a contiguous row
    index. → per row ``(out (1, H_q, D_v), lse (H_q, 1))``."""
    n_max = max(ns)
    h_q, d_v = qs[0].shape[1], v_pool.shape[-1]
    if n_max == 0:
        return [(qs[0].new_zeros(1, h_q, d_v),
                 torch.full((h_q, 1), -torch.inf, dtype=compute_dtype(qs[0].dtype),
                            device=qs[0].device)) for _ in qs]
    if isinstance(kvs[0], list):
        n_pages = -(-n_max // k_pool.shape[1])
        owner = pool_owner(k_pool)
        v_work = (owner.workspace("v", len(ns), n_pages) if owner is not None
                  and owner.v_pages is v_pool else _workspace(v_pool, "v", len(ns), n_pages))
        k = _gather_padded(k_pool, kvs, ns, _workspace(k_pool, "k", len(ns), n_pages))
        v = _gather_padded(v_pool, kvs, ns, v_work)               # (R, n_max, H_kv, D)
    elif kvs == list(range(k_pool.shape[0])):                     # every row: views, no copy
        k, v = k_pool[:, :n_max], v_pool[:, :n_max]
    else:
        idx = torch.tensor(kvs, dtype=torch.long, device=k_pool.device)
        k, v = k_pool[idx, :n_max], v_pool[idx, :n_max]
    q4 = torch.cat(qs).unsqueeze(2)                               # (R, H_q, 1, D)
    mask = None if min(ns) == n_max else _masks.padding(ns)
    out, lse = attention(q4, k.transpose(1, 2), v.transpose(1, 2), mask=mask,
                         scale=opts["scale"], softcap=opts["softcap"] or None,
                         backend=opts["backend"], return_lse=True)  # (R, H_q, 1, D_v)
    return [(out[r].transpose(0, 1), lse[r]) for r in range(len(qs))]


def _shared_prefixes(qs: list[torch.Tensor], pages: list[list[int]], lengths: list[int],
                     block_size: int, right: int) -> list[tuple[list[int], int]]:
    """Groups of rows whose leading pages are the same pool pages (forks), each with how many
    of those pages every query of every row in it sees → ``[(rows, n_pages), ...]``."""
    # whole pages every query of row b sees (bottom-right: query 0 sees j <= N_k − N_q +
    # right), None for a row that shares nothing (no query, or less than a page): with the
    # pages, all the groups depend on
    seen = tuple((n if right == -1 else min(n, n - q.shape[0] + 1 + right)) // block_size
                 if n >= block_size and q.shape[0] > 0 else None
                 for n, q in zip(lengths, qs, strict=True))
    last = _LAST_PREFIXES[0]
    if last is not None and last[0] is pages and last[1] == seen:
        return last[2]                                  # type: ignore[no-any-return]
    groups: dict[int, list[int]] = {}
    for b, row in enumerate(pages):
        if row and seen[b] is not None:
            groups.setdefault(row[0], []).append(b)
    found = []
    for rows in groups.values():
        if len(rows) < 2:
            continue
        most = min(seen[b] for b in rows)               # whole pages every query sees
        # the rows' common leading pages (commonprefix compares lists element-wise)
        n_pages = min(most, len(os.path.commonprefix([pages[b][:max(0, most)] for b in rows])))
        if n_pages > 0:
            found.append((rows, n_pages))
    _LAST_PREFIXES[0] = (pages, seen, found)
    return found


# the last call's (pages, whole pages each row sees, groups): a decode step over the pages
# of the step before (the same list: _CHECKED) within the same pages reuses them (finding
# 16 forks' common pages compares 256 entries a row in Python: 0.03 ms)
_LAST_PREFIXES: list[Any] = [None]


def _use_native(qs: list[torch.Tensor], k_pool: torch.Tensor, backend: str) -> bool:
    """Whether a paged call runs in the native kernel through the block table: a CPU pool of
    a dtype it takes, ``backend`` "auto" outside any :func:`attnkit.backends.use` scope (a
    chosen engine runs the per-sequence route), the kernel built and on (not
    ``ATTNKIT_NATIVE=0``), no gradient asked for (the paged kernel has no backward), and no
    tracer (make_fx, FakeTensorMode, torch.func: the per-sequence route is operators they
    know)."""
    if backend != "auto" or _backends.current() is not None or k_pool.device.type != "cpu" \
            or k_pool.dtype not in _native.DTYPES or _compat.intercepted(k_pool, *qs):
        return False
    if torch.is_grad_enabled() and any(q.requires_grad for q in qs):
        return False
    return _native.available()


# a cascade's result is a view of the kernel's output past the prefix parts while those are
# at most this many query rows (a decode step's); more (prefill chunks) are copied out
_KEEP_PREFIX_ROWS = 256


class _Layout:
    """Where a native call's parts go, for rows' pages and shared prefixes (what
    :func:`_attend_rows_native` builds from them: the same for every step over an unchanged
    table, :data:`_LAST_LAYOUT`). The call's sequences are the groups' prefixes first, then
    row b's (own) keys as sequence ``len(groups) + b``."""

    def __init__(self, n_q: tuple[int, ...], pages: list[list[int]],
                 groups: list[tuple[list[int], int]], table: torch.Tensor | None) -> None:
        self.order = [b for rows, _ in groups for b in rows] + list(range(len(n_q)))
        self.own = [0] * len(n_q)                       # row -> its first own page
        self.prefix = [n for _, n in groups]            # pages of each group's prefix
        for rows, n_pages in groups:
            for b in rows:
                self.own[b] = n_pages
        self.cu = [0]                                   # (S + 1,) queries per sequence
        for rows, _ in groups:
            self.cu.append(self.cu[-1] + sum(n_q[b] for b in rows))
        for n in n_q:
            self.cu.append(self.cu[-1] + n)
        if not groups and table is not None:
            self.table = table
        else:
            lists = [pages[rows[0]][:n] for rows, n in groups] + [
                row[o:] for row, o in zip(pages, self.own, strict=True)]
            width = max([1, *map(len, lists)])
            # (S, width), rows padded with page 0: a zeroed flat int64 array, each row's
            # pages written into its slice, read in place (a tenth of the time of extending
            # the array row by row: a 4096-token prefix has 256 pages)
            flat = array.array("q", bytes(8 * len(lists) * width))
            for i, p in enumerate(lists):
                flat[i * width: i * width + len(p)] = array.array("q", p)
            self.table = torch.frombuffer(flat, dtype=torch.int64).view(len(lists), width)
        self.cu_t = torch.tensor(self.cu, dtype=torch.int64)
        g = len(groups)                                 # prefix query i -> its row's query
        self.src = torch.arange(self.cu[0], self.cu[g])
        self.dst = torch.tensor([self.cu[g + b] + i for rows, _ in groups for b in rows
                                 for i in range(n_q[b])], dtype=torch.int64)


# the last native call's (pages, key, _Layout): a decode step over the table of the step
# before (the same pages object: _CHECKED) reuses it (a cascade's 17 × 257 table: 0.1 ms)
_LAST_LAYOUT: list[Any] = [None]


def _layout(qs: list[torch.Tensor], pages: list[list[int]], groups: list[tuple[list[int], int]],
            table: torch.Tensor | None) -> _Layout:
    n_q = tuple(q.shape[0] for q in qs)
    key = (n_q, tuple((tuple(rows), n) for rows, n in groups))
    last = _LAST_LAYOUT[0]
    if last is not None and last[0] is pages and last[1] == key and (
            groups or table is None or last[2].table is table):
        return last[2]                                  # type: ignore[no-any-return]
    lay = _Layout(n_q, pages, groups, table)
    _LAST_LAYOUT[0] = (pages, key, lay)
    return lay


def _attend_rows_native(qs: list[torch.Tensor], k_pool: torch.Tensor, v_pool: torch.Tensor,
                        pages: list[list[int]], lengths: list[int],
                        groups: list[tuple[list[int], int]], table: torch.Tensor | None, *,
                        scale: float | None, window: tuple[int, int], softcap: float,
                        slopes: torch.Tensor | None,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_attend_rows` in ONE native call that reads the pages through the block table
    (no gathered copy): each shared prefix is one sequence of the call holding all its
    rows' queries (placed after the prefix, so each sees all of it), each row (or its own
    suffix) another; then one native merge by LSE of every prefix part into its row's own
    part, in place (:func:`attnkit.backends.native.paged_merge_rows`). ``table``: the
    caller's block table, used as it is when no prefix is shared (row b = sequence b).
    ``pages`` is never changed (the same list may come again: :func:`_layout`)."""
    bs = k_pool.shape[1]
    lay = _layout(qs, pages, groups, table)
    # keys and first query's position per sequence: each prefix's queries after it
    n_keys = [n * bs for n in lay.prefix] + [
        n - o * bs for n, o in zip(lengths, lay.own, strict=True)]
    q_pos = [n - 1 for n in n_keys[:len(groups)]] + [
        n - q.shape[0] for n, q in zip(n_keys[len(groups):], qs, strict=True)]
    pieces = [qs[b] for b in lay.order]
    # (slopes (B, H_q) are per row = per sequence: no prefix is shared with ALiBi)
    out, lse = _native.paged_attention(
        torch.cat(pieces) if len(pieces) > 1 else pieces[0], k_pool, v_pool,   # one copy
        lay.table, lay.cu_t, n_keys, q_positions=q_pos, scale=scale, softcap=softcap or None,
        alibi_slopes=slopes, window=window)
    start = lay.cu[len(groups)]
    if groups:
        _native.paged_merge_rows(out, lse, lay.src, lay.dst)
    rows_out, rows_lse = out[start:], lse[start:]
    if start > _KEEP_PREFIX_ROWS:                  # views would keep the prefix rows alive
        rows_out, rows_lse = rows_out.clone(), rows_lse.clone()
    return rows_out, rows_lse


def _packed(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row ``(out (N_q(b), H_q, D_v), lse (H_q, N_q(b)))`` → rows packed in order:
    ``(out (Σ N_q, H_q, D_v), lse (Σ N_q, H_q))``."""
    return torch.cat([o for o, _ in parts]), torch.cat([lse.t() for _, lse in parts])


def _attend_rows(qs: list[torch.Tensor], k_pool: torch.Tensor, v_pool: torch.Tensor,
                 pages: list[list[int]] | None, lengths: list[int], *, scale: float | None,
                 window: tuple[int, int], softcap: float, slopes: torch.Tensor | None,
                 backend: str, shared_prefix: bool, table: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row b (at least one): ``qs[b] (N_q(b), H_q, D)`` over its first ``lengths[b]``
    keys — the pages ``pages[b]`` of the pools, or row b of a contiguous cache (``pages``
    None) → the rows' queries packed in order: ``out (Σ N_q(b), H_q, D_v)``, ``lse (Σ
    N_q(b), H_q)`` (row b's at ``N_q(0) + … + N_q(b − 1)``).

    Paged, with the native kernel available: one call reading the pages through the block
    table (:func:`_attend_rows_native`). Otherwise (the fallback) each row's pages are
    gathered and attended by :func:`attnkit.attention`, as below.

    Shared prefixes (cascade): rows whose leading pages are the same pool pages (forks) and
    whose queries all see those keys attend to them once, in one call over all their
    queries; each row's own suffix is a second call, merged by LSE (``merge_partials``).
    Only without ALiBi and without a left window (both depend on where a query is).

    Rows (or suffixes) with one query and no such term go to the engine together, in one
    call with a padding mask; the rest one call each."""
    opts: dict[str, Any] = dict(scale=scale, softcap=softcap, backend=backend)
    plain = slopes is None and window[0] == -1         # no term that depends on positions
    groups: list[tuple[list[int], int]] = []
    if pages is not None and shared_prefix and plain:
        groups = _shared_prefixes(qs, pages, lengths, k_pool.shape[1], window[1])
    if pages is not None and qs and _use_native(qs, k_pool, backend):
        return _attend_rows_native(qs, k_pool, v_pool, pages, lengths, groups, table,
                                   scale=scale, window=window, softcap=softcap, slopes=slopes)
    # jobs: (row, queries, keys: page list | contiguous row, key count); prefix per row
    jobs: list[tuple[int, torch.Tensor, Any, int]] = []
    prefix_of: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    grouped: set[int] = set()
    for rows, n_pages in groups:
        assert pages is not None
        n_pre = n_pages * k_pool.shape[1]
        prefix = pages[rows[0]][:n_pages]
        kp, vp = _read_pages(k_pool, prefix, n_pre), _read_pages(v_pool, prefix, n_pre)
        o_pre, lse_pre = _attend_one(torch.cat([qs[b] for b in rows]), kp, vp,
                                     window=(-1, -1), slopes=None, **opts)
        at = 0
        for b in rows:
            n = qs[b].shape[0]
            prefix_of[b] = (o_pre[at: at + n], lse_pre[:, at: at + n])
            jobs.append((b, qs[b], pages[b][n_pages:], lengths[b] - n_pre))
            grouped.add(b)
            at += n
    for b, q in enumerate(qs):
        if b not in grouped:
            jobs.append((b, q, pages[b] if pages is not None else b, lengths[b]))
    results: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    single = [j for j in jobs if plain and j[1].shape[0] == 1]
    if len(single) > 1:
        res = _attend_single_queries([j[1] for j in single], [j[2] for j in single],
                                     [j[3] for j in single], k_pool, v_pool, opts=opts)
        results.update({j[0]: r for j, r in zip(single, res, strict=True)})
    for b, q, kv, n in jobs:
        if b in results:
            continue
        if isinstance(kv, list):
            kb, vb = _read_pages(k_pool, kv, n), _read_pages(v_pool, kv, n)
        else:
            kb, vb = k_pool[kv, :n], v_pool[kv, :n]
        results[b] = _attend_one(q, kb, vb, window=window,
                                 slopes=None if slopes is None else slopes[b], **opts)
    for b, (o_pre, lse_pre) in prefix_of.items():       # merge each row's two parts
        o_own, lse_own = results[b]
        o, lse = merge_partials([(o_pre.transpose(0, 1), lse_pre),
                                 (o_own.transpose(0, 1), lse_own)])
        results[b] = (o.transpose(0, 1).to(qs[b].dtype), lse)
    return _packed([results[b] for b in range(len(qs))])


# --------------------------------------------------------------------------- public calls
def attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    *,
    cache_seqlens: int | torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    return_softmax_lse: bool = False,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    rotary_interleaved: bool = True,
    num_splits: int = 0,
    shared_prefix: bool = True,
    backend: str = "auto",
) -> Any:
    """flash-attn's ``flash_attn_with_kvcache``: attend ``q`` over each sequence's cached keys,
    after appending the new ``k``/``v`` to the cache in place.

    Shapes::

        q        (B, N_q, H_q, D)
        k_cache  paged (num_blocks, block_size, H_kv, D) with block_table (B, max_pages),
                 or contiguous (B, N_cache, H_kv, D);   v_cache: the same with D_v
        k, v     (B, N_new, H_kv, D | D_v) or None      cache_seqlens (B,) int, or an int
        → out (B, N_q, H_q, D_v)     [and lse (B, H_q, N_q) with return_softmax_lse=True]

    Sequence b attends to its first ``N_k(b) = cache_seqlens[b] + N_new`` cached tokens; the
    new ``k[b]``/``v[b]`` are written at positions ``cache_seqlens[b] ... N_k(b) − 1`` first
    (paged: position t is page ``block_table[b, t // block_size]``, slot
    ``t % block_size``). ``cache_seqlens`` is not advanced (as in flash-attn: the caller
    keeps the lengths); None means every row is full (``N_cache``, or ``max_pages ·
    block_size`` when paged) and needs ``k=v=None``.

    Args:
        softmax_scale: multiplies ``QKᵀ``; default ``1/√D``.
        causal: bottom-right aligned per sequence, as flash-attn — query i sees keys
            ``j <= i + N_k(b) − N_q`` (a chunk's queries see the cache before them).
        window_size: ``(left, right)``, ``-1`` = unbounded; query i sees keys in
            ``[i + N_k(b) − N_q − left, i + N_k(b) − N_q + right]``. With ``causal`` the
            right side is 0.
        softcap: ``c > 0`` maps a scaled logit x to ``c·tanh(x/c)``; 0 = off.
        alibi_slopes: ``(H_q,)`` or ``(B, H_q)``: ``− slope · |i + N_k(b) − N_q − j|`` is
            added to the logits (after softcap).
        return_softmax_lse: also return the log-sum-exp of the logits ``(B, H_q, N_q)``.
        num_splits: accepted and ignored (attnkit's engines split the keys themselves).
        shared_prefix: (attnkit only) rows whose leading pages are the same pool pages (a
            ``fork``-ed prompt) attend to those pages once, in one call over all their
            queries, merged with each row's own keys by LSE (cascade attention). Not with
            ALiBi or a left window; ``False`` attends every row to all its keys.
        backend: attnkit's engine choice for :func:`attnkit.attention` (default "auto").

    Differences from flash-attn:

    - A query with no allowed key (a length-0 sequence; causal with ``N_q > N_k``) gets
      output 0 and LSE **−∞** (flash-attn: output 0, LSE +inf) — attnkit's convention, which
      :func:`attnkit.backends.base.merge_partials` merges correctly.
    - With ``causal`` and ``alibi_slopes`` and no left window (flash-attn's causal case,
      which ``window_size=(-1, 0)`` is too), flash-attn adds ``slope · j`` (the same weights
      after the softmax) where attnkit adds ``−slope · |i + N_k − N_q − j|``: outputs are
      equal, attnkit's LSE is lower by ``slope · (i + N_k − N_q)``. With a left window both
      add the latter.
    - ``rotary_cos`` / ``rotary_sin``, ``cache_batch_idx`` and ``cache_leftpad`` are
      refused (``NotImplementedError``; ``rotary_interleaved`` alone is ignored): rotate q
      and k with :mod:`attnkit.rope` before the call; index the cache rows yourself.
    - Any ``block_size`` works (flash-attn 2 needs a multiple of 256, vLLM's build of it
      16); ``D_v`` may differ from ``D``; float64 is accepted; a block table entry past a
      sequence's pages may be -1; ``block_table`` and ``cache_seqlens`` may be of any
      integer dtype (flash-attn: int32), ``cache_seqlens`` also an int or a list.
    - Bad input is refused before anything is written, each with one message: a block
      table entry out of range, a page listed twice, a page written by one sequence and read
      by another in the same call, a sequence longer than its pages or cache; and, when
      ``k_cache`` is a :class:`attnkit.PagedKVCache`'s pool, a freed page still referenced
      (also once handed to another sequence: a row's first and last pages must be where a
      live sequence holds them), a page shared without ``fork``, and a read or write past a
      sequence's tokens (a missed ``append`` or ``commit``).
    - Keyword-only after ``v`` (flash-attn also takes them by position).
    - New ``k``/``v`` with ``cache_seqlens=None`` are refused (flash-attn's behaviour there is
      not defined by its documentation).
    """
    _unsupported(
        "attention_with_kvcache",
        rotary_cos=(rotary_cos, None, "rotate q and k with attnkit.rope before the call"),
        rotary_sin=(rotary_sin, None, "rotate q and k with attnkit.rope before the call"),
        cache_batch_idx=(cache_batch_idx, None, "pass k_cache[cache_batch_idx] (a paged "
                         "cache's block_table rows do the same without a copy)"),
        cache_leftpad=(cache_leftpad, None, "keep each sequence's tokens from position 0 "
                       "(cache_seqlens gives the lengths)"))
    del num_splits, rotary_interleaved          # a hint; nothing to rotate without cos/sin
    q = _tensor(q, "q", 4, "(B, N_q, H_q, D)")
    paged = block_table is not None
    layout = "(num_blocks, block_size, H_kv, D)" if paged else "(B, N_cache, H_kv, D)"
    k_cache = _tensor(k_cache, "k_cache", 4, layout)
    v_cache = _tensor(v_cache, "v_cache", 4, layout.replace("D)", "D_v)"))
    batch, n_q, h_q, d = q.shape
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k_cache {_shape(k_cache)} and v_cache {_shape(v_cache)} must agree "
                         f"in all but the last dim {layout}")
    h_kv = k_cache.shape[2]
    if k_cache.shape[3] != d:
        raise ValueError(f"q {_shape(q)} and k_cache {_shape(k_cache)} must have the same head "
                         f"width D (last dim)")
    if h_kv == 0 or h_q % h_kv:
        raise ValueError(f"H_q = {h_q} query heads (q {_shape(q)}) must be a multiple of "
                         f"H_kv = {h_kv} key/value heads (k_cache {_shape(k_cache)}); q is "
                         f"flash-attn's (B, N_q, H_q, D): a (B, H_q, N_q, D) tensor (SDPA's "
                         f"layout) needs q.transpose(1, 2)")
    if not paged and k_cache.shape[0] != batch:
        raise ValueError(f"a contiguous k_cache must be (B, N_cache, H_kv, D) with q's B = "
                         f"{batch}, got {_shape(k_cache)} (cache_batch_idx is not supported; "
                         "a paged pool (num_blocks, block_size, H_kv, D) needs block_table=)")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype or t.device != q.device:
            raise TypeError(f"{name} is {t.dtype} on {t.device}, q is {q.dtype} on {q.device}: "
                            "q and the caches must share one dtype and device")
    n_new = 0
    if (k is None) != (v is None):
        raise ValueError("give both k and v (the new tokens) or neither")
    if k is not None:
        k = _tensor(k, "k", 4, "(B, N_new, H_kv, D)")
        v = _tensor(v, "v", 4, "(B, N_new, H_kv, D_v)")
        n_new = k.shape[1]
        want_k = (batch, n_new, h_kv, d)
        want_v = (batch, n_new, h_kv, v_cache.shape[3])
        if tuple(k.shape) != want_k or tuple(v.shape) != want_v:
            raise ValueError(f"new k, v must be (B, N_new, H_kv, D) = {want_k} and "
                             f"{want_v}, got k {_shape(k)}, v {_shape(v)}" + (
                                 " (a (B, H_kv, N_new, D) tensor, SDPA's layout, needs "
                                 "k.transpose(1, 2))" if k.shape[2] != h_kv else ""))
        for name, t in (("k", k), ("v", v)):
            if t.dtype != q.dtype or t.device != q.device:
                raise TypeError(f"{name} is {t.dtype} on {t.device}, q is {q.dtype} on "
                                f"{q.device}: convert with {name}.to(q.dtype)")
    block_size = k_cache.shape[1]
    full = block_table.shape[1] * block_size if paged and isinstance(
        block_table, torch.Tensor) and block_table.dim() == 2 else k_cache.shape[1]
    if cache_seqlens is None and k is not None:
        raise ValueError(f"new k, v need cache_seqlens (where each row's new tokens go): "
                         f"cache_seqlens=None means every row is already full ({full} tokens)")
    starts = ([full] * batch if cache_seqlens is None
              else _int_vector(cache_seqlens, "cache_seqlens", batch))
    lengths = [s + n_new for s in starts]
    window = _window(window_size, causal)
    if not isinstance(softcap, numbers.Real) or isinstance(softcap, bool) or softcap < 0:
        raise ValueError(f"softcap must be a number >= 0 (0 = off), got {softcap!r}")
    slopes = _slopes(alibi_slopes, batch, h_q)
    _check_scale_backend(softmax_scale, backend)
    pages: list[list[int]] | None = None
    if paged:
        pages = _check_pages(block_table, batch, k_cache.shape[0], block_size, lengths,
                             starts if n_new else None)
        owner = pool_owner(k_cache)
        if owner is not None:
            owner.check_block_table(block_table, lengths,
                                    [(b, s) for b, s in enumerate(starts)] if n_new else ())
    elif max(lengths, default=0) > k_cache.shape[1]:
        b = max(range(batch), key=lambda i: lengths[i])
        raise ValueError(f"sequence {b} needs {lengths[b]} tokens (cache_seqlens {starts[b]} + "
                         f"{n_new} new), but the contiguous cache holds {k_cache.shape[1]}: "
                         "a sequence longer than its cache")
    undo = None
    if k is not None:
        assert v is not None
        if batch and n_new and (backend != "auto" or _backends.current() is not None):
            # a chosen engine may refuse the call only after the write: keep what it overwrites
            undo = _overwritten((k_cache, v_cache), pages, starts, n_new, block_size)
        _write((k_cache, v_cache), pages, starts, (k, v), block_size)
    if batch == 0:
        out = q.new_zeros(0, n_q, h_q, v_cache.shape[3])
        lse_all = torch.zeros(0, h_q, n_q, dtype=compute_dtype(q.dtype), device=q.device)
    else:
        try:
            out, lse_rows = _attend_rows(list(q.unbind(0)), k_cache, v_cache, pages, lengths,
                                         table=block_table, scale=softmax_scale, window=window,
                                         softcap=float(softcap), slopes=slopes,
                                         backend=backend, shared_prefix=shared_prefix)
        except Exception:
            if undo is not None:
                undo()                                  # the pool as it was before the call
            raise
        out = out.view(batch, n_q, h_q, v_cache.shape[3])           # (B·N_q, H_q, D_v) rows
        lse_all = lse_rows.view(batch, n_q, h_q).transpose(1, 2).contiguous()
    return (out, lse_all) if return_softmax_lse else out


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | Sequence[int],
    cu_seqlens_k: torch.Tensor | Sequence[int],
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    return_softmax_lse: bool = False,
    dropout_p: float = 0.0,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    shared_prefix: bool = True,
    backend: str = "auto",
) -> Any:
    """flash-attn's ``flash_attn_varlen_func``: a ragged batch of sequences packed one after
    another — prefill chunks and single-token decodes mixed in one call.

    Shapes::

        q  (total_q, H_q, D)        sequence b's queries: rows cu_seqlens_q[b] ... [b+1] − 1
        k  (total_k, H_kv, D)       its keys: rows cu_seqlens_k[b] ... [b+1] − 1
           or, with block_table (B, max_pages), a paged pool (num_blocks, block_size, H_kv, D)
           whose row b holds sequence b's N_k(b) = cu_seqlens_k[b+1] − cu_seqlens_k[b] keys
        v  the same with D_v        cu_seqlens_q, cu_seqlens_k (B+1,) int
        → out (total_q, H_q, D_v)   [and lse (H_q, total_q) with return_softmax_lse=True]

    ``causal``, ``window_size``, ``softcap``, ``alibi_slopes`` and ``softmax_scale`` mean what
    they mean in :func:`attention_with_kvcache` (bottom-right aligned per sequence).
    ``max_seqlen_q`` / ``max_seqlen_k`` are accepted for flash-attn's call and checked when
    given. Nothing is written: append new tokens to a :class:`attnkit.PagedKVCache` first.
    ``shared_prefix`` is :func:`attention_with_kvcache`'s (cascade over shared pages).
    Differences from flash-attn: as :func:`attention_with_kvcache`'s (LSE −∞ for a row
    with no key); ``dropout_p`` other than 0 and ``return_attn_probs=True`` are refused
    (``NotImplementedError``: serving is inference; :func:`attnkit.attention` has dropout,
    :func:`attnkit.explain` the weights); ``deterministic`` (flash-attn's backward) is
    accepted and ignored; keyword-only after ``max_seqlen_k``.
    """
    _unsupported(
        "attention_varlen",
        dropout_p=(dropout_p, 0.0, "pass dropout_p=0.0 (inference); attnkit.attention takes "
                   "dropout_p for training"),
        return_attn_probs=(return_attn_probs, False, "attnkit.explain(q, k, v, ...) returns "
                           "the weights of one sequence"))
    del deterministic                           # flash-attn's backward flag; no backward here
    paged = block_table is not None
    q = _tensor(q, "q", 3, "(total_q, H_q, D)")
    k = _tensor(k, "k", 4 if paged else 3,
                "(num_blocks, block_size, H_kv, D)" if paged else "(total_k, H_kv, D)")
    v = _tensor(v, "v", k.dim(), "with k's layout and width D_v")
    h_q, d = q.shape[1], q.shape[2]
    h_kv = k.shape[-2]
    if k.shape[:-1] != v.shape[:-1] or k.shape[-1] != d or h_kv == 0 or h_q % h_kv:
        raise ValueError(f"q {_shape(q)}, k {_shape(k)}, v {_shape(v)}: k and v must agree but "
                         "in the last dim, k's width must be q's D, and H_q a multiple of H_kv")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype or t.device != q.device:
            raise TypeError(f"{name} is {t.dtype} on {t.device}, q is {q.dtype} on {q.device}")
    cu_q = _cu(cu_seqlens_q, "cu_seqlens_q")
    cu_k = _cu(cu_seqlens_k, "cu_seqlens_k")
    if len(cu_k) != len(cu_q):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must hold the same sequences, got "
                         f"{len(cu_q)} and {len(cu_k)} entries")
    if cu_q[-1] != q.shape[0]:
        raise ValueError(f"cu_seqlens_q ends at {cu_q[-1]} but q holds {q.shape[0]} rows")
    if not paged and cu_k[-1] != k.shape[0]:
        raise ValueError(f"cu_seqlens_k ends at {cu_k[-1]} but k holds {k.shape[0]} rows")
    batch = len(cu_q) - 1
    len_q = [b - a for a, b in zip(cu_q, cu_q[1:], strict=False)]
    len_k = [b - a for a, b in zip(cu_k, cu_k[1:], strict=False)]
    for name, mx, lens in (("max_seqlen_q", max_seqlen_q, len_q),
                           ("max_seqlen_k", max_seqlen_k, len_k)):
        if mx is not None and lens and max(lens) > mx:
            raise ValueError(f"{name} = {mx} but a sequence has {max(lens)}")
    window = _window(window_size, causal)
    if not isinstance(softcap, numbers.Real) or isinstance(softcap, bool) or softcap < 0:
        raise ValueError(f"softcap must be a number >= 0 (0 = off), got {softcap!r}")
    slopes = _slopes(alibi_slopes, batch, h_q)
    _check_scale_backend(softmax_scale, backend)
    pages = None
    if paged:
        pages = _check_pages(block_table, batch, k.shape[0], k.shape[1], len_k, None)
        owner = pool_owner(k)
        if owner is not None:
            owner.check_block_table(block_table, len_k)
    qs = [q[cu_q[b]: cu_q[b + 1]] for b in range(batch)]
    if not qs:
        out = q.new_zeros(0, h_q, v.shape[-1])
        lse_all = torch.zeros(h_q, 0, dtype=compute_dtype(q.dtype), device=q.device)
    else:
        if pages is not None:
            out, lse_rows = _attend_rows(qs, k, v, pages, len_k, table=block_table,
                                         scale=softmax_scale, window=window,
                                         softcap=float(softcap), slopes=slopes,
                                         backend=backend, shared_prefix=shared_prefix)
        else:
            out, lse_rows = _packed([
                _attend_one(qs[b], k[cu_k[b]: cu_k[b + 1]], v[cu_k[b]: cu_k[b + 1]],
                            scale=softmax_scale, window=window, softcap=float(softcap),
                            slopes=None if slopes is None else slopes[b], backend=backend)
                for b in range(batch)])
        lse_all = lse_rows.t().contiguous()                          # (H_q, total_q)
    return (out, lse_all) if return_softmax_lse else out
