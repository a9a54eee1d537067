"""The paged KV cache: one layer's keys and values in fixed-size pages, owned by block tables.

A server keeps many sequences of different lengths; a contiguous cache per sequence wastes
its spare capacity and cannot share a common prompt. :class:`PagedKVCache` pre-allocates one
pool of ``num_blocks`` pages of ``block_size`` tokens (vLLM's and flash-attn's layout) and
gives each sequence a *block table*: the list of pool pages that hold its tokens, in order.
Token ``t`` of a sequence lives in page ``table[t // block_size]``, slot ``t % block_size``.

Storage (flash-attn's paged layout, one pool per stream)::

    k_pages (num_blocks, block_size, H_kv, D)     v_pages (num_blocks, block_size, H_kv, D_v)
    block_table (B, max_pages) int32              cache_seqlens (B,) int32

    B sequences in a call   H_kv key/value heads   D, D_v head widths (D_v defaults to D)

Pages are reference-counted: :meth:`PagedKVCache.fork` gives a new sequence the same pages
(a shared prefix, stored once); the first write into a page that more than one sequence
holds copies that page for the writer first (copy-on-write), so no sequence ever sees
another's tokens. :meth:`PagedKVCache.free` returns a sequence's pages to the pool once no
other sequence holds them.

Use it with :func:`attnkit.attention_with_kvcache` (flash-attn's call) — directly on the
pools and tables, or through :meth:`PagedKVCache.attention`, which reserves pages, appends
the new tokens and attends in one step — or as a layer's cache:
``MultiHeadAttention(x, cache=cache.batch(seqs), is_causal=True)`` (:class:`PagedBatch`).

Caution
-------
- A cache belongs to one layer (as :class:`~attnkit.KVCache`): a model keeps one per layer.
- Made for inference: the pools are written in place, outside autograd.
- Capacity is fixed at construction; a write that needs more pages than are free raises
  (saying how many are free and needed) before anything changes.
- Pages reserved for a write that then fails (a bad query, say) stay with the sequence and
  are used by its next append; nothing already cached is changed.
- :meth:`PagedKVCache.block_table` pads rows with ``-1`` (flash-attn never reads entries past
  a sequence's length; attnkit refuses a ``-1`` it would have to read).
- With the native kernel a step reads the pages in place (through the block table, no
  copy). Without it (``ATTNKIT_NATIVE=0``, another device) a decode step gathers each
  sequence's pages into a workspace the cache keeps (as large as the largest batch's padded
  keys, K and V); :meth:`PagedKVCache.release_workspace` frees it.
"""

from __future__ import annotations

import itertools
import weakref
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from .common import shape_of

__all__ = ["PagedKVCache", "PagedBatch", "CacheCapacityError", "pool_owner"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

# pool tensor → its cache, so attention_with_kvcache can check a raw block table against the
# cache's own state (freed pages, pages shared without a fork); weak: a cache is not kept alive
_POOLS: weakref.WeakValueDictionary[int, PagedKVCache] = weakref.WeakValueDictionary()

_CHECKED_MAX = 8                    # tables a cache remembers as checked (check_block_table)
_CHECKED_ENTRIES = 1 << 16          # larger tables are checked every call


class CacheCapacityError(RuntimeError):
    """A write needs more free pages than the pool has (the message says how many)."""


def pool_owner(k_pages: torch.Tensor) -> PagedKVCache | None:
    """The :class:`PagedKVCache` whose key pool is ``k_pages`` (the same tensor), else None."""
    cache = _POOLS.get(id(k_pages))
    return cache if cache is not None and cache.k_pages is k_pages else None


def _count(x: Any, name: str, *, minimum: int = 1) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {x!r}")
    return x


class PagedKVCache:
    """Keys and values of many sequences for one layer, in a pool of fixed-size pages.

    Shapes: see the module docstring (``k_pages (num_blocks, block_size, H_kv, D)``).

    Args:
        num_blocks: pages in the pool (allocated at once, zero-filled).
        block_size: tokens per page (any size >= 1; flash-attn 2's CUDA kernels need a
            multiple of 256, vLLM's build of them 16, attnkit neither).
        n_kv_heads: key/value heads ``H_kv``.
        head_dim: key width ``D``.
        dtype: ``torch.float32``, ``torch.bfloat16`` or ``torch.float16`` (``torch.float64``
            too, for tests against the reference).
        device: where the pools live (default CPU).
        v_head_dim: value width ``D_v`` (default ``head_dim``).

    Sequences are small integers handed out by :meth:`new_sequence` (or :meth:`fork`)::

        cache = ak.PagedKVCache(256, 16, n_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
        s = cache.new_sequence()
        out = cache.attention([s], q, k, v, causal=True)   # q (1, N, H_q, D), k/v (1, N, H_kv, D)
        t = cache.fork(s)                                  # shares every page of s
        cache.free(s)
    """

    def __init__(self, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 v_head_dim: int | None = None) -> None:
        _count(num_blocks, "num_blocks")
        _count(block_size, "block_size")
        _count(n_kv_heads, "n_kv_heads")
        _count(head_dim, "head_dim")
        d_v = head_dim if v_head_dim is None else _count(v_head_dim, "v_head_dim")
        if dtype not in _DTYPES:
            raise TypeError(f"dtype must be one of torch.float32, torch.bfloat16, "
                            f"torch.float16 (or torch.float64 for tests), got {dtype}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.n_kv_heads, self.head_dim, self.v_head_dim = n_kv_heads, head_dim, d_v
        self.k_pages = torch.zeros(num_blocks, block_size, n_kv_heads, head_dim, dtype=dtype,
                                   device=device)
        self.v_pages = torch.zeros(num_blocks, block_size, n_kv_heads, d_v, dtype=dtype,
                                   device=device)
        self._refs = [0] * num_blocks                 # sequences holding each page
        self._free = list(range(num_blocks - 1, -1, -1))   # a stack: pops 0, 1, 2, ...
        self._tables: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}
        self._next_id = 0
        self._owner: weakref.ref[Any] | None = None      # the layer that wrote first
        self._workspace: dict[str, torch.Tensor] = {}       # gathered keys, reused per step
        # block tables check_block_table passed, since the refcounts last changed -> the
        # rows held to a sequence's length (checked every call)
        self._checked: dict[tuple[Any, ...], list[tuple[int, list[int]]]] = {}
        # bumped after every change of the page refcounts or tables (_changed): a check's
        # key holds the epoch it read, so a check that raced a change is never found again
        self._epoch = 0
        _POOLS[id(self.k_pages)] = self

    # ------------------------------------------------------------------ inspection
    @property
    def dtype(self) -> torch.dtype:
        return self.k_pages.dtype

    @property
    def device(self) -> torch.device:
        return self.k_pages.device

    @property
    def num_free_blocks(self) -> int:
        """Pages no sequence holds."""
        return len(self._free)

    @property
    def sequences(self) -> list[int]:
        """Live sequence ids, oldest first."""
        return list(self._tables)

    def refcount(self, page: int) -> int:
        """How many sequences hold pool page ``page``."""
        return self._refs[page]

    def length(self, seq: int) -> int:
        """Cached tokens of sequence ``seq``."""
        return self._lengths[self._check_seq(seq)]

    def pages(self, seq: int) -> list[int]:
        """The pool pages sequence ``seq`` holds, in token order (a copy)."""
        return list(self._tables[self._check_seq(seq)])

    def seqlens(self, seqs: Iterable[int]) -> torch.Tensor:
        """``cache_seqlens (B,)`` int32 for the sequences ``seqs``."""
        return torch.tensor([self.length(s) for s in seqs], dtype=torch.int32,
                            device=self.device)

    def block_table(self, seqs: Iterable[int], width: int | None = None) -> torch.Tensor:
        """``block_table (B, width)`` int32 for ``seqs``: row b lists sequence b's pages,
        padded with -1 to ``width`` (default: the most pages any of them holds, at least 1)."""
        rows = [self._tables[self._check_seq(s)] for s in seqs]
        w = max([1, *map(len, rows)]) if width is None else width
        if any(len(r) > w for r in rows):
            raise ValueError(f"width {w} is smaller than the {max(map(len, rows))} pages a "
                             "sequence holds")
        out = torch.full((len(rows), w), -1, dtype=torch.int32)
        for b, r in enumerate(rows):
            out[b, : len(r)] = torch.tensor(r, dtype=torch.int32)
        return out.to(self.device)

    def gather(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The contiguous equivalent of sequence ``seq``: ``k (N, H_kv, D)``,
        ``v (N, H_kv, D_v)`` (a copy)."""
        n = self.length(seq)
        idx = torch.tensor(self._tables[seq], dtype=torch.long, device=self.device)
        k = self.k_pages.index_select(0, idx).flatten(0, 1)[:n]
        v = self.v_pages.index_select(0, idx).flatten(0, 1)[:n]
        return k, v

    @property
    def nbytes(self) -> int:
        """Bytes of the two pools (all pages, free or not)."""
        return sum(t.numel() * t.element_size() for t in (self.k_pages, self.v_pages))

    def __len__(self) -> int:
        return len(self._tables)

    def __repr__(self) -> str:
        return (f"PagedKVCache(pages {self.num_blocks} × {self.block_size} tokens, k "
                f"{shape_of(self.k_pages)}, v {shape_of(self.v_pages)} {self.dtype}, "
                f"{len(self._tables)} sequences, {self.num_free_blocks} pages free)")

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()            # a weak reference does not pickle
        state["_owner"] = None
        state["_workspace"] = {}
        state["_checked"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({"_checked": {}, "_epoch": 0, **state})
        _POOLS[id(self.k_pages)] = self

    def workspace(self, name: str, rows: int, pages: int) -> torch.Tensor:
        """A reusable ``(≥ rows, ≥ pages, block_size, H, D)`` buffer for gathering ``name``'s
        pages ("k" or "v"), grown as needed and kept for the next step (no fresh memory per
        decode step). Its contents are stale gathers (finite) or zeros."""
        buf = self._workspace.get(name)
        if buf is None or buf.shape[0] < rows or buf.shape[1] < pages:
            old = (0, 0) if buf is None else buf.shape[:2]
            pool = self.k_pages if name == "k" else self.v_pages
            buf = pool.new_zeros(max(rows, old[0]), max(pages, old[1]), *pool.shape[1:])
            self._workspace[name] = buf
        return buf

    def release_workspace(self) -> None:
        """Free the gather workspace (it is rebuilt on the next batched step)."""
        self._workspace = {}

    # ------------------------------------------------------------------ layers
    def batch(self, seqs: Sequence[int]) -> PagedBatch:
        """These sequences as one layer call's cache: ``layer(x, cache=cache.batch(seqs),
        is_causal=True)`` — row b of ``x (B, N, d)`` continues sequence ``seqs[b]``."""
        seqs = list(seqs)
        for s in seqs:
            self._check_seq(s)
        return PagedBatch(self, seqs)

    def check_owner(self, layer: Any) -> None:
        """Claim this cache for ``layer`` on its first write; another layer's call raises
        (it would attend to the owner's keys). A model keeps one cache per layer."""
        owner = self._owner() if self._owner is not None else None
        if owner is None:
            self._owner = weakref.ref(layer)
        elif owner is not layer:
            raise ValueError(
                f"this PagedKVCache belongs to another layer ({type(owner).__name__} at "
                f"{id(owner):#x}); {type(layer).__name__} at {id(layer):#x} was called with it "
                "— it would attend to the other layer's keys. Use one PagedKVCache per layer")

    # ------------------------------------------------------------------ sequences
    def _check_seq(self, seq: int) -> int:
        if seq not in self._tables:
            live = list(self._tables)
            shown = live if len(live) <= 16 else f"{len(live)} sequences"
            raise KeyError(f"sequence {seq!r} is not in this PagedKVCache (live: {shown}): "
                           "create one with cache.new_sequence() or cache.fork(seq); a freed "
                           "sequence is gone")
        return seq

    def new_sequence(self) -> int:
        """A new empty sequence; returns its id."""
        sid = self._next_id
        self._next_id += 1
        self._tables[sid], self._lengths[sid] = [], 0
        return sid

    def fork(self, seq: int) -> int:
        """A new sequence holding the same tokens as ``seq``, sharing its pages (no copy).

        Either side's next write into a shared page copies that page first (copy-on-write);
        pages both only read — a common prompt — stay stored once.
        """
        pages = self.pages(seq)
        sid = self.new_sequence()
        for p in pages:
            self._refs[p] += 1
        self._tables[sid], self._lengths[sid] = pages, self._lengths[seq]
        self._changed()
        return sid

    def free(self, seq: int) -> None:
        """Forget sequence ``seq``; its pages go back to the pool unless a fork holds them."""
        for p in self._tables.pop(self._check_seq(seq)):
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)
        del self._lengths[seq]
        self._changed()

    def truncate(self, seq: int, length: int) -> None:
        """Keep the first ``length`` tokens of ``seq`` (e.g. drop rejected draft tokens);
        pages past them are released."""
        n = self.length(seq)
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= n:
            raise ValueError(f"truncate needs 0 <= length <= {n} (sequence {seq}'s tokens), "
                             f"got {length!r}")
        keep = -(-length // self.block_size)
        table = self._tables[seq]
        for p in table[keep:]:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)
        dropped = bool(table[keep:])
        del table[keep:]
        self._lengths[seq] = length
        if dropped:
            self._changed()

    # ------------------------------------------------------------------ writing
    def _plan(self, seq: int, n_new: int, refs: list[int]) -> tuple[int, list[int]]:
        """(new pages needed, indices into seq's table of shared pages the write touches),
        counting the copies in ``refs`` (a page's last holder writes it in place)."""
        n, table, bs = self._lengths[seq], self._tables[seq], self.block_size
        if n_new == 0:
            return 0, []
        first, last = n // bs, (n + n_new - 1) // bs
        shared = [i for i in range(first, min(last + 1, len(table))) if refs[table[i]] > 1]
        for i in shared:
            refs[table[i]] -= 1
        return max(0, last + 1 - len(table)), shared

    def reserve(self, seqs: Sequence[int], n_new: int | Sequence[int]) -> None:
        """Make room for ``n_new`` more tokens in each of ``seqs`` (an int: the same for all):
        allocate the pages they need and copy every shared page they will write into
        (copy-on-write). All or nothing: too few free pages raises
        :class:`CacheCapacityError` before any page changes hands."""
        counts = [n_new] * len(seqs) if isinstance(n_new, int) else list(n_new)
        if len(counts) != len(seqs) or any(
                isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
            raise ValueError(f"n_new must be an int >= 0 or one per sequence, got {n_new!r} "
                             f"for {len(seqs)} sequences")
        for s in seqs:
            self._check_seq(s)
        if len(set(seqs)) != len(seqs):
            raise ValueError(f"a sequence appears twice in {list(seqs)}: each write needs its "
                             "own sequence (fork one to branch it)")
        refs = list(self._refs)                    # the copies made by earlier sequences
        plans = [self._plan(s, c, refs) for s, c in zip(seqs, counts, strict=True)]
        need = sum(fresh + len(shared) for fresh, shared in plans)
        if need > len(self._free):
            detail = ", ".join(
                f"sequence {s}: {c} tokens → {fresh} new page(s)"
                + (f" + {len(shared)} copy-on-write" if shared else "")
                for s, c, (fresh, shared) in zip(seqs, counts, plans, strict=True)
                if fresh or shared)
            raise CacheCapacityError(
                f"PagedKVCache is full: the write needs {need} page(s) ({detail}) but only "
                f"{len(self._free)} of {self.num_blocks} are free (block_size "
                f"{self.block_size}): free finished sequences with cache.free(seq), or create "
                "the cache with more num_blocks")
        for s, (fresh, shared) in zip(seqs, plans, strict=True):
            table = self._tables[s]
            for i in shared:                       # copy-on-write: a page of our own first
                old, new = table[i], self._free.pop()
                self.k_pages[new].copy_(self.k_pages[old])
                self.v_pages[new].copy_(self.v_pages[old])
                self._refs[old] -= 1
                self._refs[new] = 1
                table[i] = new
            for _ in range(fresh):
                p = self._free.pop()
                self._refs[p] = 1
                table.append(p)
        if need:
            self._changed()                        # pages changed hands

    def _changed(self) -> None:
        """After a change of the refcounts or tables: the checks remembered are void."""
        self._epoch += 1
        self._checked.clear()

    def commit(self, seqs: Sequence[int], n_new: int | Sequence[int]) -> None:
        """Count ``n_new`` tokens, already written into reserved pages (e.g. by
        :func:`attnkit.attention_with_kvcache` with ``k=``/``v=``), as part of each sequence."""
        counts = [n_new] * len(seqs) if isinstance(n_new, int) else list(n_new)
        for s, c in zip(seqs, counts, strict=True):
            if self._lengths[self._check_seq(s)] + c > len(self._tables[s]) * self.block_size:
                raise ValueError(f"sequence {s} holds {len(self._tables[s])} page(s) "
                                 f"({len(self._tables[s]) * self.block_size} tokens); "
                                 f"committing {c} more past its {self._lengths[s]} needs "
                                 "cache.reserve first")
        for s, c in zip(seqs, counts, strict=True):
            self._lengths[s] += c

    def _check_stream(self, t: torch.Tensor, name: str, width: int, n: int | None) -> None:
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.shape[1:] != (
                self.n_kv_heads, width) or (n is not None and t.shape[0] != n):
            seen = shape_of(t) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be (N_new, H_kv, {'D' if name == 'k' else 'D_v'}) = "
                             f"(N_new, {self.n_kv_heads}, {width}) (or (H_kv, D) for one "
                             f"token), got {seen}")
        if t.dtype != self.dtype or t.device != self.device:
            raise TypeError(f"{name} is {t.dtype} on {t.device}, the cache holds {self.dtype} "
                            f"on {self.device}: convert with {name}.to(cache.dtype)")

    def append(self, seq: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Add tokens to sequence ``seq``: ``k (N_new, H_kv, D)``, ``v (N_new, H_kv, D_v)``
        (a chunk), or ``(H_kv, D)`` / ``(H_kv, D_v)`` (one token). Pages are allocated as
        needed and shared pages copied first (copy-on-write)."""
        k = k.unsqueeze(0) if isinstance(k, torch.Tensor) and k.dim() == 2 else k
        v = v.unsqueeze(0) if isinstance(v, torch.Tensor) and v.dim() == 2 else v
        self._check_seq(seq)
        self._check_stream(k, "k", self.head_dim, None)
        self._check_stream(v, "v", self.v_head_dim, k.shape[0])
        n_new = k.shape[0]
        self.reserve([seq], n_new)
        pos = torch.arange(self._lengths[seq], self._lengths[seq] + n_new, device=self.device)
        table = torch.tensor(self._tables[seq], dtype=torch.long, device=self.device)
        page, slot = table[pos // self.block_size], pos % self.block_size
        with torch.no_grad():
            self.k_pages[page, slot] = k
            self.v_pages[page, slot] = v
        self._lengths[seq] += n_new

    # ------------------------------------------------------------------ attention
    def attention(self, seqs: Sequence[int], q: torch.Tensor, k: torch.Tensor | None = None,
                  v: torch.Tensor | None = None, **options: Any) -> Any:
        """Append ``k``/``v`` to ``seqs`` and attend ``q`` over each sequence's tokens — one
        :func:`attnkit.attention_with_kvcache` call on this cache's pools and tables.

        ``q (B, N_q, H_q, D)``, ``k (B, N_new, H_kv, D)``, ``v (B, N_new, H_kv, D_v)``,
        B = ``len(seqs)``; ``options`` are attention_with_kvcache's (``causal``,
        ``window_size``, ``softcap``, ``alibi_slopes``, ``softmax_scale``,
        ``return_softmax_lse``). Returns what it returns: ``out (B, N_q, H_q, D_v)``.
        """
        from ..serving import attention_with_kvcache  # serving sits above layers

        seqs = list(seqs)
        n_new = 0 if k is None else int(k.shape[1]) if isinstance(k, torch.Tensor) \
            and k.dim() == 4 else -1
        if n_new < 0:
            raise ValueError(f"k must be (B, N_new, H_kv, D), got "
                             f"{shape_of(k) if isinstance(k, torch.Tensor) else type(k)}")
        self.reserve(seqs, n_new)
        table = self.block_table(seqs)
        lens = self.seqlens(seqs)
        out = attention_with_kvcache(q, self.k_pages, self.v_pages, k, v, cache_seqlens=lens,
                                     block_table=table, **options)
        self.commit(seqs, n_new)
        return out

    # ------------------------------------------------------------------ checking
    def check_block_table(self, block_table: torch.Tensor, seqlens: Sequence[int],
                          written: Sequence[tuple[int, int]] = ()) -> None:
        """Raise unless a raw ``block_table`` is consistent with this cache's own state.

        ``seqlens[b]`` tokens of row b are read; ``written`` lists ``(row, first token)``
        pairs of rows that write from that token on. Refused: a page that is free (a freed
        page still referenced), a page more rows (or one row twice) use than the cache's
        refcount allows (a page used by two sequences without a fork), a write into a
        page another sequence holds (it must be copied first: :meth:`reserve`), a row
        whose first and last pages are not where a live sequence holds them (a table kept
        past a :meth:`free`, whose pages were handed to another sequence since), and a row
        over all of a sequence's pages that reads past its tokens or writes from past them
        (slots never written: a missed :meth:`append` or :meth:`commit`).
        """
        if len(seqlens) > block_table.shape[0]:
            raise ValueError(f"{len(seqlens)} sequence lengths for a block_table of "
                             f"{block_table.shape[0]} rows: give one length per row (or fewer: "
                             "the rows past them are not checked)")
        bs = self.block_size
        raw = block_table.detach().cpu().numpy()                            # (B, W)
        key = None if raw.size > _CHECKED_ENTRIES else (
            self._epoch, raw.dtype.str, raw.shape, raw.tobytes(),
            tuple(-(-int(n) // bs) for n in seqlens),
            tuple((b, int(start) // bs) for b, start in written))
        held = self._checked.get(key) if key is not None else None
        if held is None:
            held = self._table_ok(block_table, seqlens, written)
            if held is not None and key is not None:
                if len(self._checked) >= _CHECKED_MAX:
                    self._checked.clear()
                self._checked[key] = held
        if held is None:
            held = self._table_errors(block_table, seqlens, written)
        self._check_lengths(held, seqlens, written)

    def _table_errors(self, block_table: torch.Tensor, seqlens: Sequence[int],
                      written: Sequence[tuple[int, int]]) -> list[tuple[int, list[int]]]:
        """:meth:`check_block_table`'s error path (its fast check failed): raise naming the
        first offending page in the rows' order, else → the rows held to a length."""
        bs = self.block_size
        rows = block_table.tolist()
        read = [rows[b][: -(-int(n) // bs)] for b, n in enumerate(seqlens)]  # pages row b reads
        for b, r in enumerate(read):
            for j, p in enumerate(r):
                if not 0 <= p < len(self._refs):
                    raise ValueError(f"block_table[{b}, {j}] = {p} is not a page of this "
                                     f"PagedKVCache (pages 0..{len(self._refs) - 1})")
        uses = Counter(itertools.chain.from_iterable(read))
        for p, count in uses.items():
            if self._refs[p] == 0 or count > self._refs[p]:
                bs_rows = [b for b, r in enumerate(read) for q in r if q == p]
            if self._refs[p] == 0:
                raise ValueError(
                    f"block_table row {bs_rows[0]} references page {p}, which is free in this "
                    "PagedKVCache (its sequence was freed, or it was never allocated): a freed "
                    "page may be handed to another sequence at any time. Rebuild the table "
                    "with cache.block_table(seqs)")
            if count > self._refs[p]:
                raise ValueError(
                    f"page {p} is used by block_table rows {bs_rows} but held by "
                    f"{self._refs[p]} sequence(s) of this PagedKVCache: a page used by two "
                    "sequences must come from cache.fork(seq) (which counts the sharing and "
                    "copies the page on the first write)")
        for b, start in written:
            n = int(seqlens[b])
            for p in rows[b][start // bs: -(-n // bs)]:
                if self._refs[p] > 1:
                    raise ValueError(
                        f"block_table row {b} writes tokens {start}..{n - 1} into page {p}, "
                        f"which {self._refs[p]} sequences share (a fork): writing would change "
                        "the other sequences' keys. Call cache.reserve(seqs, n_new) first "
                        "(it copies shared pages: copy-on-write), or use cache.attention")
        b, held = self._stray_row([(r[0], r[-1], len(r)) if r else (-1, -1, 0) for r in read])
        if b is not None:
            raise ValueError(
                f"block_table row {b} reads pages {read[b]}, which are not the leading pages of "
                "any sequence of this PagedKVCache: a table kept past a free (the freed pages "
                "now hold another sequence's tokens) or put together by hand. Rebuild the table "
                "with cache.block_table(seqs) after every free")
        return held

    def _check_lengths(self, held: list[tuple[int, list[int]]], seqlens: Sequence[int],
                       written: Sequence[tuple[int, int]]) -> None:
        """Every call (the lengths change without the pages): a row reading all of a
        sequence's pages (``held``: the row and the sequences holding just those pages) reads
        at most the tokens it holds, and writes from at most there — past them, slots never
        written (a missed append or commit)."""
        lengths, starts = self._lengths, dict(written)
        for b, sids in held:
            if any(s not in lengths for s in sids):     # (another thread freed it meanwhile)
                raise ValueError(f"block_table row {b}'s sequence was freed while the call "
                                 "checked it: rebuild the table with cache.block_table(seqs)")
            n = lengths[sids[0]] if len(sids) == 1 else max(lengths[s] for s in sids)
            start = starts.get(b)
            if start is None:
                if seqlens[b] <= n:
                    continue
            elif start <= n:
                continue
            if start is not None:
                raise ValueError(
                    f"block_table row {b} writes from token {start}, but its sequence holds {n} "
                    f"tokens: tokens {n}..{int(start) - 1} would never be written. Pass "
                    "cache_seqlens=cache.seqlens(seqs) and call cache.commit(seqs, n_new) after "
                    "each call that writes (cache.attention does both)")
            raise ValueError(
                f"block_table row {b} reads {int(seqlens[b])} tokens, but its sequence holds "
                f"{n}: the tokens past {n} were never written. Append them first "
                "(cache.append, or cache.reserve + attention_with_kvcache with k=, v= + "
                "cache.commit), or read the sequence's length (cache.seqlens(seqs))")


    def _table_ok(self, block_table: torch.Tensor, seqlens: Sequence[int],
                  written: Sequence[tuple[int, int]]) -> list[tuple[int, list[int]]] | None:
        """:meth:`check_block_table`'s rules at once, NumPy on the table's memory and the
        refcounts of the pages read only (a decode step of 16 forks of a 4096-token prefix:
        0.15 -> 0.05 ms) → the rows held to a length (:meth:`_stray_row`) if all hold; None
        sends the caller through its checks, which name what is wrong."""
        bs, refs = self.block_size, self._refs
        t = block_table.detach().cpu().numpy().astype(np.int64)             # (B, W)
        need = np.zeros(t.shape[0], dtype=np.int64)       # rows past seqlens: not read
        need[:len(seqlens)] = [-(-int(n) // bs) for n in seqlens]
        flat = t[np.arange(t.shape[1]) < need[:, None]]                     # pages read
        if flat.size == 0:
            return []
        if flat.min() < 0 or flat.max() >= len(refs):
            return None
        counts = np.bincount(flat)
        used = np.flatnonzero(counts)                                       # pages read
        holders = np.fromiter((refs[p] for p in used.tolist()), dtype=np.int64,
                              count=used.size)
        if (counts[used] > holders).any():               # a free page (held 0), or a page
            return None                                  # in more rows than hold it
        # a row writes only into pages no other sequence holds
        if not all(refs[p] <= 1 for b, start in written
                   for p in t[b, start // bs: need[b]].tolist()):
            return None
        rows = np.arange(len(seqlens))
        n = need[:len(seqlens)]
        last = t[rows, np.maximum(n - 1, 0)] if t.shape[1] else n
        b, held = self._stray_row(list(zip(t[rows, 0].tolist() if t.shape[1] else n.tolist(),
                                           last.tolist(), n.tolist(), strict=True)))
        return held if b is None else None

    def _stray_row(self, ends: list[tuple[int, int, int]]
                   ) -> tuple[int | None, list[tuple[int, list[int]]]]:
        """From each row's ``(first page, last page read, pages read)``: the first row whose
        pages are not the leading pages of a live sequence (a table kept past a free: its
        pages may hold another sequence's tokens now; refcounts alone pass it once they are
        handed out again), or None; and the rows that read all of a sequence's pages, each
        with the sequences holding just those (:meth:`_check_lengths`). The ends only: a
        stale row whose first and last pages sit at the same places of one live sequence
        passes (as a row equal to one must)."""
        whole: dict[tuple[int, int, int], list[int]] = {}   # (first, last, pages) -> seqs
        by_first: dict[int, list[list[int]]] = {}           # first page -> tables (forks)
        for sid, table in self._tables.items():
            if table:
                key = (table[0], table[-1], len(table))
                if key in whole:
                    whole[key].append(sid)
                else:
                    whole[key] = [sid]
                if table[0] in by_first:
                    by_first[table[0]].append(table)
                else:
                    by_first[table[0]] = [table]
        held = []
        for b, (first, last, n) in enumerate(ends):
            if n == 0:
                continue
            sids = whole.get((first, last, n))              # a row reads all its pages
            if sids is not None:
                held.append((b, sids))
            elif not any(len(t) >= n and t[n - 1] == last for t in by_first.get(first, ())):
                return b, held                               # nor a prefix of a table's
        return None, held


class PagedBatch:
    """Some sequences of a :class:`PagedKVCache`, as the ``cache=`` of one layer call (from
    :meth:`PagedKVCache.batch`): row b of the call's input continues sequence ``seqs[b]``."""

    def __init__(self, cache: PagedKVCache, seqs: list[int]) -> None:
        self.cache, self.seqs = cache, seqs

    def __len__(self) -> int:
        return len(self.seqs)

    def __repr__(self) -> str:
        return f"PagedBatch(sequences {self.seqs} of {self.cache!r})"
