"""The KV cache: keys and values (or MLA's latent) of the tokens one layer has seen.

Storage (one buffer per stream, grown by doubling, written in place)::

    MultiHeadAttention        k (B, H_kv, N, d_k), v (B, H_kv, N, d_v)
    MultiHeadLatentAttention  latent (B, 1, N, d_c)

    B batch   N cached tokens   H_kv key/value heads   d_k, d_v head widths   d_c latent width

Caution
-------
- A cache belongs to one layer: the first layer that writes to it owns it, and any other
  layer's call raises (it would attend to the owner's keys). ``reset()`` frees it for a new
  owner. The owner is held by a weak reference and is not pickled or saved: a cache loaded
  back is claimed by the first layer that writes to it.
- Made for inference: appending inside autograd (inputs that require grad) switches the cache
  to concatenation so gradients flow, which costs O(N) copies per step.
- ``max_len`` only sizes the first allocation; the cache grows past it.
- ``copy.copy(cache)`` is a fork that shares the storage until either side appends: the
  first append of each then writes into storage of its own (copy-on-write), so neither sees
  the other's tokens. ``copy.deepcopy`` copies the tensors at once.
- ``get()`` / ``.k`` / ``.v`` / ``.latent`` are views of the storage: after ``truncate(n)``
  the next append writes over the tokens past ``n`` that an earlier view still shows
  (``.clone()`` a view to keep it).
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .common import layer_label, positive_int, shape_of

__all__ = ["KVCache", "check_cache"]


class KVCache:
    """Keys and values (or MLA's latent) of the tokens seen so far, for one layer.

    Pass the same cache to successive calls of one layer: ``layer(prompt, cache=c,
    is_causal=True)`` then ``layer(next_token, cache=c, is_causal=True)`` and so on; the
    result equals the full causal forward over all tokens. A model keeps one cache per
    layer: ``caches = [KVCache() for _ in range(n_layers)]``.

    Storage: see the module docstring.

    Args:
        max_len: expected total number of tokens; that much storage is allocated on the
            first append (the cache still grows past it). ``None``: grow as needed.
    """

    # True while the storage may be shared with a copy.copy() twin: the next append writes
    # into storage of its own first (class default: caches pickled before this field)
    _shared: bool = False

    def __init__(self, max_len: int | None = None) -> None:
        if max_len is not None:
            positive_int(max_len, "max_len")
        self.max_len = max_len
        self.kind: str | None = None
        self._buffers: dict[str, torch.Tensor] = {}
        self._length = 0
        self._owner: weakref.ref[nn.Module] | None = None   # the layer that wrote first
        self._owner_label: str | None = None

    # ------------------------------------------------------------------ inspection
    def __len__(self) -> int:
        return self._length

    @property
    def length(self) -> int:
        """Number of cached tokens ``N``."""
        return self._length

    @property
    def nbytes(self) -> int:
        """Bytes held by the cached tokens (all streams, ``N`` tokens, spare capacity
        excluded)."""
        return sum(b[:, :, : self._length].numel() * b.element_size()
                   for b in self._buffers.values())

    @property
    def allocated_nbytes(self) -> int:
        """Bytes allocated, spare capacity included."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    @property
    def capacity(self) -> int:
        """Tokens the current storage can hold before it grows."""
        return next(iter(self._buffers.values())).shape[2] if self._buffers else 0

    @property
    def owner(self) -> nn.Module | None:
        """The layer this cache belongs to (the first that wrote to it); ``None`` when no
        layer has written yet, or the owner no longer exists."""
        return self._owner() if self._owner is not None else None

    def get(self, name: str) -> torch.Tensor:
        """A view of one stream's cached tokens, ``(B, heads, N, D)``."""
        if name not in self._buffers:
            raise KeyError(f"this cache holds {sorted(self._buffers)} (kind {self.kind!r}), "
                           f"not {name!r}")
        return self._buffers[name][:, :, : self._length]

    @property
    def k(self) -> torch.Tensor:
        """Cached keys ``(B, H_kv, N, d_k)`` (MultiHeadAttention caches)."""
        return self.get("k")

    @property
    def v(self) -> torch.Tensor:
        """Cached values ``(B, H_kv, N, d_v)`` (MultiHeadAttention caches)."""
        return self.get("v")

    @property
    def latent(self) -> torch.Tensor:
        """Cached latent ``(B, 1, N, d_c)`` (MultiHeadLatentAttention caches)."""
        return self.get("latent")

    def __repr__(self) -> str:
        shapes = ", ".join(f"{n} {shape_of(self.get(n))}" for n in self._buffers)
        return f"KVCache(kind={self.kind!r}, length={self._length}, {shapes}, " \
               f"nbytes={self.nbytes})"

    # ------------------------------------------------------------------ ownership
    def check_owner(self, layer: nn.Module) -> None:
        """Raise unless ``layer`` may write to this cache: it owns it, or nobody does yet."""
        if self._owner is None:
            return
        owner = self._owner()
        if owner is layer:
            return
        held = f"{self._length} tokens of {self._owner_label}"
        if owner is None:
            raise ValueError(
                f"this KVCache holds {held}, a layer that no longer exists, and "
                f"{layer_label(layer)} was called with it: a cache belongs to the layer that "
                "first wrote to it. Use one KVCache per layer, or call cache.reset() before "
                "giving it to another layer"
            )
        raise ValueError(
            f"this KVCache belongs to another layer: it holds {held}, and "
            f"{layer_label(layer)} was called with it — it would attend to the "
            "other layer's keys. Use one KVCache per layer (e.g. caches = [ak.KVCache() for "
            "_ in range(n_layers)]), or call cache.reset() before giving it to another layer"
        )

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()            # a weak reference does not pickle
        state["_owner"] = state["_owner_label"] = None
        return state

    def __copy__(self) -> KVCache:
        new = KVCache.__new__(KVCache)
        new.__dict__.update(self.__dict__)      # the copy belongs to the same layer
        new._buffers = dict(self._buffers)      # shares the tensors until one side appends:
        self._shared = new._shared = True       # each copies its storage before its first write
        return new

    def __deepcopy__(self, memo: dict[int, Any]) -> KVCache:
        new = KVCache.__new__(KVCache)          # e.g. a beam's copy: same owner, own tensors
        memo[id(self)] = new
        for key, val in self.__dict__.items():
            new.__dict__[key] = val if key == "_owner" else copy.deepcopy(val, memo)
        return new

    # ------------------------------------------------------------------ editing
    def reset(self) -> None:
        """Forget every token and the owner (storage is released)."""
        self.kind = None
        self._buffers = {}
        self._length = 0
        self._owner = self._owner_label = None
        self._shared = False

    def truncate(self, length: int) -> None:
        """Keep only the first ``length`` tokens (e.g. to drop rejected draft tokens); the
        storage and the owner are kept for reuse."""
        if isinstance(length, bool) or not isinstance(length, int) \
                or not 0 <= length <= self._length:
            raise ValueError(f"truncate needs 0 <= length <= {self._length} (the cached "
                             f"tokens), got {length!r}")
        self._length = length

    def reorder(self, index: torch.Tensor) -> None:
        """Select/reorder batch rows (beam search): row ``i`` becomes old row ``index[i]``.

        ``index``: a 1-D integer tensor (or a list of ints) of rows in ``[0, B)``; it may
        repeat rows and change the batch size.
        """
        if not isinstance(index, torch.Tensor):
            index = torch.as_tensor(index)
        batch = next(iter(self._buffers.values())).shape[0] if self._buffers else None
        bad = index.dim() != 1 or index.dtype.is_floating_point or index.dtype.is_complex \
            or index.dtype == torch.bool
        if not bad and batch is not None and index.numel():
            bad = bool(index.min() < 0) or bool(index.max() >= batch)
        if bad:
            raise ValueError(
                f"reorder needs a 1-D integer index of batch rows in "
                f"[0, {'B' if batch is None else batch}), got "
                f"{shape_of(index)} {index.dtype} {index.tolist() if index.numel() <= 8 else ''}"
                ": row i of the reordered cache is old row index[i]"
            )
        self._buffers = {n: b.index_select(0, index.to(b.device))
                         for n, b in self._buffers.items()}
        self._shared = False                    # index_select made new tensors

    @contextlib.contextmanager
    def transaction(self) -> Iterator[KVCache]:
        """Undo every append made inside the block if the block raises.

        The layers run each call in one, so a call that fails (a bad mask, say) leaves the
        cache as it was, and the corrected call does not see the failed call's tokens twice.
        """
        saved = (self.kind, dict(self._buffers), self._length, self._owner, self._owner_label,
                 self._shared)
        try:
            yield self
        except BaseException:
            # tokens written in place past the saved length are invisible once it is restored
            (self.kind, self._buffers, self._length, self._owner, self._owner_label,
             self._shared) = saved
            raise

    def append(self, kind: str, *, owner: nn.Module | None = None,
               **streams: torch.Tensor) -> dict[str, torch.Tensor]:
        """Add new tokens to every stream and return views over all cached tokens.

        ``streams`` maps a name to a ``(B, heads, N_new, D)`` tensor; every call of one cache
        must give the same names, batch, heads, widths, dtype and device. Layers call this
        with ``owner=self``: the first owner given becomes the cache's owner, and a different
        one raises. ``kind`` names the layer type so one cache cannot be shared by mismatched
        layers.
        """
        if not streams:
            raise ValueError("append needs at least one stream, e.g. k=..., v=...")
        if owner is not None:
            self.check_owner(owner)
        first = next(iter(streams.values()))
        n_new = first.shape[2] if first.dim() == 4 else -1
        if self.kind is not None and (self.kind != kind or set(streams) != set(self._buffers)):
            raise ValueError(
                f"this KVCache holds {self.kind!r} streams {sorted(self._buffers)}, but a "
                f"{kind!r} layer appended {sorted(streams)}: use one KVCache per layer"
            )
        for name, t in streams.items():
            if t.dim() != 4 or t.shape[2] != n_new or t.shape[0] != first.shape[0] \
                    or t.dtype != first.dtype or t.device != first.device:
                got = ", ".join(f"{n} {shape_of(s)} {s.dtype} on {s.device}"
                                for n, s in streams.items())
                raise ValueError(f"every stream must be (B, heads, N_new, D) with one B, N_new, "
                                 f"dtype and device, got {got}")
            old = self._buffers.get(name)
            if old is not None and (old.shape[:2] != t.shape[:2] or old.shape[3] != t.shape[3]
                                    or old.dtype != t.dtype or old.device != t.device):
                raise ValueError(
                    f"cache stream {name!r} holds (B, heads, ·, D) = "
                    f"({old.shape[0]}, {old.shape[1]}, ·, {old.shape[3]}) {old.dtype} on "
                    f"{old.device}, got new tokens {shape_of(t)} {t.dtype} on {t.device}: a "
                    "cache must see the same batch, layer and dtype on every call "
                    "(call cache.reset() to start over)"
                )
        self.kind = kind
        if owner is not None and self._owner is None:
            self._owner, self._owner_label = weakref.ref(owner), layer_label(owner)
        end = self._length + n_new
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in streams.values())
        for name, t in streams.items():
            old = self._buffers.get(name)
            if grad:
                # autograd: a functional concat, so no in-place write breaks the graph
                self._buffers[name] = t if old is None else torch.cat(
                    [old[:, :, : self._length], t], dim=2)
                continue
            if old is None or old.shape[2] < end or self._shared:
                # new storage: to grow, or a copy.copy() twin may still read this one
                held = old.shape[2] if old is not None else 0
                cap = max(end, held if held >= end else 2 * held, self.max_len or 0, 16)
                buf = t.new_empty(t.shape[0], t.shape[1], cap, t.shape[3])
                if old is not None:
                    buf[:, :, : self._length] = old[:, :, : self._length]
                self._buffers[name] = old = buf
            old[:, :, self._length: end] = t
        self._length = end
        self._shared = False                    # every stream now has storage of its own
        return {name: self.get(name) for name in streams}


def check_cache(cache: Any, layer: nn.Module) -> KVCache:
    """``cache`` if it is a :class:`KVCache` that ``layer`` may write to, else a clear error."""
    if not isinstance(cache, KVCache):
        raise TypeError(
            f"cache must be an attnkit.KVCache, got {type(cache).__name__}: create one per "
            "layer with attnkit.KVCache() (other libraries' caches are not understood)"
        )
    cache.check_owner(layer)
    return cache
