"""Attention layers: multi-head (MHA / GQA / MQA), multi-head latent (MLA), and a KV cache.

The modules own projections only; every attention computation goes through
:func:`attnkit.attention` (``backend="auto"``), so the fastest backend that supports a call
— the decode backend for one query over a long cache, the tiled engine for long prompts —
is picked without the module knowing about it.

Shape legend::

    B     batch                       N, N_q  query tokens     N_k  key/value tokens
    d     d_model (input width)       d_kv   kv_dim (width of the cross-attention context)
    H     query heads (n_heads)       H_kv   key/value heads (n_kv_heads; 1 = MQA)
    d_k   head_dim (query/key width per head)      d_v   v_head_dim (value width per head)
    d_c   kv_latent_dim (MLA's shared latent)

    x        (B, N_q, d)      or (N_q, d) unbatched
    context  (B, N_k, d_kv)   cross-attention source (default: x itself)
    q        (B, H,    N_q, d_k)        per-head queries, split from x W_Qᵀ (B, N_q, H·d_k)
    k, v     (B, H_kv, N_k, d_k | d_v)  per-head keys and values
    weights  (B, H, N_q, N_k)          returned with ``need_weights=True``
    out      (B, N_q, d)               heads concatenated back to (B, N_q, H·d_v), then W_O

Masks follow :func:`attnkit.attention`: an :class:`attnkit.masks.Mask`, a bool tensor
(**True = may attend**) or a float tensor added to the logits, broadcastable to
``(B, H, N_q, N_k)``. PyTorch's ``nn.MultiheadAttention`` uses the opposite bool convention
(True = blocked); :class:`TorchStyleMultiheadAttention` and :func:`torch_masks_to_attnkit`
translate.

Caution
-------
- A :class:`KVCache` belongs to one layer. It is made for inference: appending inside
  autograd (inputs that require grad) switches it to concatenation so gradients flow, which
  costs O(N) copies per step.
- With a cache, ``is_causal=True`` aligns bottom-right (the last query sees the last key),
  which is what decoding needs; without a cache it is top-left, exactly like torch.
- A query with no allowed key gets output 0 (before W_O) where torch gives NaN.
- MLA's key/value up-projections carry no bias (a bias would not absorb into the query).
- ``need_weights=True`` recomputes the weights with the reference (O(N_q·N_k) memory); the
  weights are the softmax before dropout.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from . import masks as _masks
from .api import attention, prepare
from .reference import reference

__all__ = [
    "KVCache",
    "MultiHeadAttention",
    "MultiHeadLatentAttention",
    "RMSNorm",
    "TorchStyleMultiheadAttention",
    "torch_masks_to_attnkit",
]


# ---------------------------------------------------------------------------- helpers
def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def _positive_int(x: Any, name: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < 1:
        raise ValueError(f"{name} must be a positive integer, got {x!r}")
    return x


def _head_dims(d_model: int, n_heads: int, head_dim: Any, v_head_dim: Any) -> tuple[int, int]:
    """``(head_dim, v_head_dim)``: head_dim defaults to d_model / n_heads, v_head_dim to it."""
    if head_dim is None:
        if d_model % n_heads:
            raise ValueError(
                f"d_model={d_model} is not divisible by n_heads={n_heads}: choose n_heads "
                f"that divides d_model, or pass head_dim=... explicitly"
            )
        head_dim = d_model // n_heads
    head_dim = _positive_int(head_dim, "head_dim")
    return head_dim, _positive_int(head_dim if v_head_dim is None else v_head_dim, "v_head_dim")


def _check_options(softcap: float | None, dropout: float) -> None:
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not math.isfinite(softcap) or softcap <= 0):
        raise ValueError(f"softcap must be a finite number > 0 or None, got {softcap!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) \
            or not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be a probability in [0, 1), got {dropout!r}")


def _check_input(x: Any, width: int, name: str, param: torch.Tensor) -> torch.Tensor:
    """Validate x (B, N, width) or (N, width); return it as 3-D."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() not in (2, 3) or x.shape[-1] != width:
        raise ValueError(
            f"{name} must have shape (B, N, {width}) or (N, {width}), got {_shape(x)}: "
            f"its last dim is the feature width, which this layer expects to be {width}"
        )
    if x.dtype != param.dtype:
        raise TypeError(
            f"{name} has dtype {x.dtype} but the layer's parameters are {param.dtype}: "
            f"cast one of them, e.g. layer.to({x.dtype}) or {name}.to({param.dtype})"
        )
    if x.device != param.device:
        raise ValueError(
            f"{name} is on {x.device} but the layer's parameters are on {param.device}: "
            f"move one of them with .to()"
        )
    return x if x.dim() == 3 else x.unsqueeze(0)


def _split_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, N, heads·D) → (B, heads, N, D)."""
    b, n, f = t.shape
    return t.view(b, n, heads, f // heads).transpose(1, 2)


def _merge_heads(t: torch.Tensor) -> torch.Tensor:
    """(B, heads, N, D) → (B, N, heads·D): the heads concatenated back."""
    b, h, n, d = t.shape
    return t.transpose(1, 2).reshape(b, n, h * d)


def _causal_for(cache: KVCache | None, is_causal: bool, mask: Any, n_q: int
                ) -> tuple[Any, bool]:
    """With a cache, causal aligns bottom-right: earlier tokens are already in the cache.

    One new query under bottom-right causal sees every cached key: no mask at all.
    """
    if is_causal and mask is not None:
        raise ValueError(
            "give either mask=... or is_causal=True, not both: combine them as "
            "mask=attnkit.masks.causal() & your_mask"
        )
    if is_causal and cache is not None:
        return (None if n_q == 1 else _masks.causal(align="bottom_right")), False
    return mask, is_causal


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: Any, is_causal: bool,
    scale: float, softcap: float | None, dropout_p: float, need_weights: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ak.attention on (B, H, N, D) tensors; the weights come from the reference.

    A decode step (one query, no mask) with grouped heads folds each group's G query heads
    into G query rows of its K/V head: q (B, H, 1, D) → (B, H_kv, G, D). The problem stays
    the same (every row sees every key), and K/V are read once per group, never repeated.
    """
    b, h, n_q, d = q.shape
    h_kv = k.shape[1]
    fold = n_q == 1 and h > h_kv and mask is None and not is_causal
    if fold:
        q = q.reshape(b, h_kv, h // h_kv, d)                       # (B, H_kv, G, D)
    out = attention(q, k, v, mask=mask, is_causal=is_causal, scale=scale, softcap=softcap,
                    dropout_p=dropout_p)
    weights = None
    if need_weights:
        prep = prepare(q, k, v, mask=mask, is_causal=is_causal, scale=scale, softcap=softcap)
        weights = reference(prep.problem).weights.to(q.dtype)     # (B, H, N_q, N_k)
    if fold:
        out = out.reshape(b, h, 1, out.shape[-1])
        weights = weights.reshape(b, h, 1, -1) if weights is not None else None
    return out, weights


class RMSNorm(nn.Module):
    """``x / √(mean(x²) + eps) · gain`` over the last dim (gain: learnable, ``(width,)``)."""

    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ms = x.pow(2).mean(-1, keepdim=True)                 # (…, 1) mean square
        return x * torch.rsqrt(ms + self.eps) * self.weight

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


# ---------------------------------------------------------------------------- KV cache
class KVCache:
    """Keys and values (or MLA's latent) of the tokens seen so far, for one layer.

    Pass the same cache to successive calls of one layer: ``layer(prompt, cache=c,
    is_causal=True)`` then ``layer(next_token, cache=c, is_causal=True)`` and so on; the
    result equals the full causal forward over all tokens.

    Storage (one buffer per stream, grown by doubling, written in place)::

        MultiHeadAttention        k (B, H_kv, N, d_k), v (B, H_kv, N, d_v)
        MultiHeadLatentAttention  latent (B, 1, N, d_c)

    Args:
        max_len: expected total number of tokens; that much storage is allocated on the
            first append (the cache still grows past it). ``None``: grow as needed.
    """

    def __init__(self, max_len: int | None = None) -> None:
        if max_len is not None:
            _positive_int(max_len, "max_len")
        self.max_len = max_len
        self.kind: str | None = None
        self._buffers: dict[str, torch.Tensor] = {}
        self._length = 0

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
        shapes = ", ".join(f"{n} {_shape(self.get(n))}" for n in self._buffers)
        return f"KVCache(kind={self.kind!r}, length={self._length}, {shapes}, " \
               f"nbytes={self.nbytes})"

    # ------------------------------------------------------------------ editing
    def reset(self) -> None:
        """Forget every token (storage is released)."""
        self.kind = None
        self._buffers = {}
        self._length = 0

    def truncate(self, length: int) -> None:
        """Keep only the first ``length`` tokens (e.g. to drop rejected draft tokens); the
        storage is kept for reuse."""
        if isinstance(length, bool) or not isinstance(length, int) \
                or not 0 <= length <= self._length:
            raise ValueError(f"truncate needs 0 <= length <= {self._length} (the cached "
                             f"tokens), got {length!r}")
        self._length = length

    def reorder(self, index: torch.Tensor) -> None:
        """Select/reorder batch rows (beam search): row ``i`` becomes old row ``index[i]``."""
        self._buffers = {n: b.index_select(0, index.to(b.device))
                         for n, b in self._buffers.items()}

    def append(self, kind: str, **streams: torch.Tensor) -> dict[str, torch.Tensor]:
        """Add new tokens to every stream and return views over all cached tokens.

        ``streams`` maps a name to a ``(B, heads, N_new, D)`` tensor; every call of one cache
        must give the same names, batch, heads, widths, dtype and device. Layers call this;
        ``kind`` names the layer type so one cache cannot be shared by mismatched layers.
        """
        if not streams:
            raise ValueError("append needs at least one stream, e.g. k=..., v=...")
        n_new = next(iter(streams.values())).shape[2]
        if self.kind is None:
            self.kind = kind
        elif self.kind != kind or set(streams) != set(self._buffers):
            raise ValueError(
                f"this KVCache holds {self.kind!r} streams {sorted(self._buffers)}, but a "
                f"{kind!r} layer appended {sorted(streams)}: use one KVCache per layer"
            )
        for name, t in streams.items():
            if t.dim() != 4 or t.shape[2] != n_new:
                raise ValueError(f"stream {name!r} must be (B, heads, N_new={n_new}, D), "
                                 f"got {_shape(t)}")
            old = self._buffers.get(name)
            if old is not None and (old.shape[:2] != t.shape[:2] or old.shape[3] != t.shape[3]
                                    or old.dtype != t.dtype or old.device != t.device):
                raise ValueError(
                    f"cache stream {name!r} holds (B, heads, ·, D) = "
                    f"({old.shape[0]}, {old.shape[1]}, ·, {old.shape[3]}) {old.dtype} on "
                    f"{old.device}, got new tokens {_shape(t)} {t.dtype} on {t.device}: a "
                    "cache must see the same batch, layer and dtype on every call "
                    "(call cache.reset() to start over)"
                )
        end = self._length + n_new
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in streams.values())
        for name, t in streams.items():
            old = self._buffers.get(name)
            if grad:
                # autograd: a functional concat, so no in-place write breaks the graph
                self._buffers[name] = t if old is None else torch.cat(
                    [old[:, :, : self._length], t], dim=2)
                continue
            if old is None or old.shape[2] < end:
                cap = max(end, 2 * (old.shape[2] if old is not None else 0),
                          self.max_len or 0, 16)
                buf = t.new_empty(t.shape[0], t.shape[1], cap, t.shape[3])
                if old is not None:
                    buf[:, :, : self._length] = old[:, :, : self._length]
                self._buffers[name] = old = buf
            old[:, :, self._length: end] = t
        self._length = end
        return {name: self.get(name) for name in streams}


# ---------------------------------------------------------------------------- MHA
class MultiHeadAttention(nn.Module):
    """Multi-head attention with learned projections: MHA, GQA (``n_kv_heads``) and MQA.

    ``out = concat_h( softmax(Q_h K_hᵀ / √d_k + M) V_h ) W_Oᵀ`` where
    ``Q = x W_Qᵀ``, ``K = context W_Kᵀ``, ``V = context W_Vᵀ`` are split into heads.

    Example (the course's picture): T=3 tokens, d=8, h=2 → per-head Q, K, V are 3×4, each
    head's output 3×4, concatenated back to 3×8, then W_O.

    Shapes: see the module's shape legend. Parameters (``nn.Linear``; weights ``(out, in)``)::

        q_proj    W_Q  (H·d_k,    d)      k_proj  W_K (H_kv·d_k, d_kv)
        v_proj    W_V  (H_kv·d_v, d_kv)   out_proj W_O (d, H·d_v)
        qk_proj   W_QK (H·d_k, d) — replaces q_proj and k_proj when ``tie_qk=True``
        q_norm, k_norm  RMSNorm gains (d_k,) — when ``qk_norm=True``

    Args:
        d_model: input (and output) width d.
        n_heads: query heads H.
        n_kv_heads: key/value heads H_kv (default H = MHA; 1 = MQA; must divide H).
        head_dim: d_k per head (default d / H).
        v_head_dim: d_v per head (default d_k).
        kv_dim: width of ``context`` for cross-attention (default d).
        bias: add biases to all four projections.
        qk_norm: RMSNorm with a learnable gain on each head's q and k before the scores.
        softcap: ``c`` maps each scaled logit x to ``c·tanh(x/c)``.
        dropout: dropout on the attention weights (training mode only).
        tie_qk: one shared projection for Q and K (raw self-attention scores are symmetric).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        v_head_dim: int | None = None,
        kv_dim: int | None = None,
        bias: bool = False,
        qk_norm: bool = False,
        softcap: float | None = None,
        dropout: float = 0.0,
        tie_qk: bool = False,
    ) -> None:
        super().__init__()
        d_model = _positive_int(d_model, "d_model")
        n_heads = _positive_int(n_heads, "n_heads")
        head_dim, v_head_dim = _head_dims(d_model, n_heads, head_dim, v_head_dim)
        n_kv_heads = _positive_int(n_heads if n_kv_heads is None else n_kv_heads, "n_kv_heads")
        if n_heads % n_kv_heads:
            raise ValueError(
                f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads} (each K/V "
                f"head serves a group of query heads): use a divisor of {n_heads}"
            )
        kv_dim = _positive_int(d_model if kv_dim is None else kv_dim, "kv_dim")
        _check_options(softcap, dropout)
        if tie_qk and (n_kv_heads != n_heads or kv_dim != d_model):
            raise ValueError(
                f"tie_qk=True shares one projection for Q and K, so it needs n_kv_heads == "
                f"n_heads and kv_dim == d_model, got n_heads={n_heads}, n_kv_heads={n_kv_heads}"
                f", d_model={d_model}, kv_dim={kv_dim}"
            )
        self.d_model, self.n_heads, self.n_kv_heads = d_model, n_heads, n_kv_heads
        self.head_dim, self.v_head_dim, self.kv_dim = head_dim, v_head_dim, kv_dim
        self.softcap = None if softcap is None else float(softcap)
        self.dropout = float(dropout)
        self.tie_qk, self.qk_norm = bool(tie_qk), bool(qk_norm)
        self.scale = 1.0 / math.sqrt(head_dim)

        if tie_qk:
            self.qk_proj = nn.Linear(d_model, n_heads * head_dim, bias=bias)
        else:
            self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=bias)
            self.k_proj = nn.Linear(kv_dim, n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(kv_dim, n_kv_heads * v_head_dim, bias=bias)
        self.out_proj = nn.Linear(n_heads * v_head_dim, d_model, bias=bias)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim)
            self.k_norm = RMSNorm(head_dim)

    def extra_repr(self) -> str:
        opts = [f"d_model={self.d_model}", f"n_heads={self.n_heads}",
                f"n_kv_heads={self.n_kv_heads}", f"head_dim={self.head_dim}"]
        if self.v_head_dim != self.head_dim:
            opts.append(f"v_head_dim={self.v_head_dim}")
        if self.kv_dim != self.d_model:
            opts.append(f"kv_dim={self.kv_dim}")
        for name in ("qk_norm", "tie_qk"):
            if getattr(self, name):
                opts.append(f"{name}=True")
        if self.softcap is not None:
            opts.append(f"softcap={self.softcap}")
        if self.dropout:
            opts.append(f"dropout={self.dropout}")
        return ", ".join(opts)

    # ------------------------------------------------------------------ projections
    def project_q(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, N, d) → q (B, H, N, d_k) (normalised when ``qk_norm``)."""
        w = self.qk_proj if self.tie_qk else self.q_proj
        q = _split_heads(w(x), self.n_heads)
        return self.q_norm(q) if self.qk_norm else q

    def project_k(self, src: torch.Tensor) -> torch.Tensor:
        """src (B, N_k, d_kv) → k (B, H_kv, N_k, d_k) (normalised when ``qk_norm``)."""
        w = self.qk_proj if self.tie_qk else self.k_proj
        k = _split_heads(w(src), self.n_kv_heads)
        return self.k_norm(k) if self.qk_norm else k

    def project_v(self, src: torch.Tensor) -> torch.Tensor:
        """src (B, N_k, d_kv) → v (B, H_kv, N_k, d_v)."""
        return _split_heads(self.v_proj(src), self.n_kv_heads)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        *,
        mask: Any = None,
        is_causal: bool = False,
        cache: KVCache | None = None,
        need_weights: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend from ``x`` (B, N_q, d) to ``context`` (B, N_k, d_kv), default ``x`` itself.

        Args:
            mask: Mask / bool (True = may attend) / additive float, broadcastable to
                ``(B, H, N_q, N_k)``; with a cache, N_k counts the cached tokens too.
            is_causal: causal self-attention (bottom-right aligned when a cache is given).
            cache: a :class:`KVCache` for incremental decoding (self-attention only): the
                new tokens' K/V are appended and the queries attend to every cached token.
            need_weights: also return the attention weights ``(B, H, N_q, N_k)``.

        Returns ``out`` ``(B, N_q, d)`` (``(N_q, d)`` for unbatched input), or
        ``(out, weights)`` with ``need_weights=True``.
        """
        return self._forward(x, context, context, mask=mask, is_causal=is_causal, cache=cache,
                             need_weights=need_weights)

    def _forward(
        self, x: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None, *,
        mask: Any, is_causal: bool, cache: KVCache | None, need_weights: bool,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        w = self.out_proj.weight
        unbatched = isinstance(x, torch.Tensor) and x.dim() == 2
        x3 = _check_input(x, self.d_model, "x", w)
        if key is None:
            if self.kv_dim != self.d_model:
                raise ValueError(
                    f"this layer projects keys/values from width kv_dim={self.kv_dim} but "
                    f"x has width d_model={self.d_model}: pass context (B, N_k, "
                    f"{self.kv_dim}) for cross-attention"
                )
            k_src = v_src = x3
        else:
            if cache is not None:
                raise ValueError(
                    "a KVCache is for self-attention decoding; for cross-attention project "
                    "the context once and call without cache (context=None is required with "
                    "cache=...)"
                )
            k_src = _check_input(key, self.kv_dim, "context", w)
            v_src = k_src if value is key else _check_input(value, self.kv_dim, "value", w)
            if k_src.shape[0] != x3.shape[0] or v_src.shape[:2] != k_src.shape[:2]:
                raise ValueError(
                    f"context {_shape(k_src)} (and value {_shape(v_src)}) must have the same "
                    f"batch as x {_shape(x3)}, and keys and values the same number of tokens"
                )
        q = self.project_q(x3)                              # (B, H,    N_q, d_k)
        k = self.project_k(k_src)                           # (B, H_kv, N_k, d_k)
        v = self.project_v(v_src)                           # (B, H_kv, N_k, d_v)
        if cache is not None:
            kv = cache.append("MultiHeadAttention", k=k, v=v)
            k, v = kv["k"], kv["v"]                         # (B, H_kv, N_cache, ·)
        mask, is_causal = _causal_for(cache, is_causal, mask, q.shape[2])
        o, weights = _attend(q, k, v, mask=mask, is_causal=is_causal, scale=self.scale,
                             softcap=self.softcap,
                             dropout_p=self.dropout if self.training else 0.0,
                             need_weights=need_weights)     # (B, H, N_q, d_v)
        out = self.out_proj(_merge_heads(o))                # (B, N_q, d)
        if unbatched:
            out = out[0]
            weights = weights[0] if weights is not None else None
        return (out, weights) if need_weights else out

    # ------------------------------------------------------------------ torch interop
    @classmethod
    def from_torch(cls, m: nn.MultiheadAttention) -> MultiHeadAttention:
        """An attnkit layer with the same weights as ``torch.nn.MultiheadAttention`` ``m``.

        The result uses attnkit's conventions: batch-first ``(B, N, d)`` inputs and bool
        masks with True = may attend. To call it exactly like ``m`` (``batch_first`` as in
        ``m``, torch's ``attn_mask`` / ``key_padding_mask`` with True = blocked, averaged
        weights), wrap it: ``TorchStyleMultiheadAttention.from_torch(m)``.

        Not supported (raises): ``add_bias_kv``, ``add_zero_attn`` and ``kdim != vdim``.
        """
        if not isinstance(m, nn.MultiheadAttention):
            raise TypeError(f"from_torch needs a torch.nn.MultiheadAttention, got "
                            f"{type(m).__name__}")
        if m.bias_k is not None or m.add_zero_attn:
            raise ValueError("from_torch does not support add_bias_kv=True or "
                             "add_zero_attn=True: build the torch module without them")
        if m.kdim != m.vdim:
            raise ValueError(f"from_torch needs kdim == vdim (one context feeds K and V), "
                             f"got kdim={m.kdim}, vdim={m.vdim}")
        e, h = m.embed_dim, m.num_heads
        has_bias = m.in_proj_bias is not None
        new = cls(e, h, kv_dim=m.kdim, bias=has_bias, dropout=m.dropout)
        ref = m.out_proj.weight
        new.to(device=ref.device, dtype=ref.dtype)
        if m.in_proj_weight is not None:
            wq, wk, wv = m.in_proj_weight.chunk(3, dim=0)
        else:
            wq, wk, wv = m.q_proj_weight, m.k_proj_weight, m.v_proj_weight
        with torch.no_grad():
            for lin, wt in ((new.q_proj, wq), (new.k_proj, wk), (new.v_proj, wv),
                            (new.out_proj, m.out_proj.weight)):
                lin.weight.copy_(wt)
            if has_bias:
                bq, bk, bv = m.in_proj_bias.chunk(3, dim=0)
                for lin, bt in ((new.q_proj, bq), (new.k_proj, bk), (new.v_proj, bv),
                                (new.out_proj, m.out_proj.bias)):
                    lin.bias.copy_(bt)
        new.train(m.training)
        return new


# ---------------------------------------------------------------------------- torch adapter
def torch_masks_to_attnkit(
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    *,
    batch: int,
    heads: int,
) -> torch.Tensor | None:
    """Translate ``nn.MultiheadAttention``'s masks into one attnkit mask ``(B|1, H|1, N_q, N_k)``.

    torch: ``attn_mask`` (N_q, N_k) or (B·H, N_q, N_k), ``key_padding_mask`` (B, N_k); a bool
    entry True = **blocked**, a float entry is added. attnkit: bool True = **may attend**,
    float added. Two bool masks combine with AND (a bool tensor comes back); otherwise bool
    masks become 0 / −inf and the float masks are summed (as torch does).
    """
    parts: list[torch.Tensor] = []
    if attn_mask is not None:
        if attn_mask.dim() == 2:
            am = attn_mask[None, None]                                   # (1, 1, N_q, N_k)
        elif attn_mask.dim() == 3 and attn_mask.shape[0] == batch * heads:
            am = attn_mask.view(batch, heads, *attn_mask.shape[1:])      # (B, H, N_q, N_k)
        else:
            raise ValueError(
                f"attn_mask must be (N_q, N_k) or (B·num_heads={batch * heads}, N_q, N_k), "
                f"got {_shape(attn_mask)}"
            )
        parts.append(am)
    if key_padding_mask is not None:
        if key_padding_mask.dim() != 2 or key_padding_mask.shape[0] != batch:
            raise ValueError(f"key_padding_mask must be (B={batch}, N_k), got "
                             f"{_shape(key_padding_mask)}")
        parts.append(key_padding_mask[:, None, None, :])                 # (B, 1, 1, N_k)
    if not parts:
        return None
    if all(p.dtype == torch.bool for p in parts):
        allowed = ~parts[0]
        for p in parts[1:]:
            allowed = allowed & ~p
        return allowed
    fdtype = next(p.dtype for p in parts if p.dtype != torch.bool)
    total: torch.Tensor | None = None
    for p in parts:
        if p.dtype == torch.bool:
            p = torch.zeros(p.shape, dtype=fdtype, device=p.device).masked_fill(p, -torch.inf)
        total = p if total is None else total + p
    return total


class TorchStyleMultiheadAttention(nn.Module):
    """An attnkit :class:`MultiHeadAttention` behind ``torch.nn.MultiheadAttention``'s call.

    ``forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
    average_attn_weights=True, is_causal=False) -> (out, weights | None)`` with torch's
    layouts: ``(N, B, E)`` (or ``(B, N, E)`` with ``batch_first=True``), unbatched ``(N, E)``,
    and torch's mask convention (bool True = blocked). Weights are ``(B, N_q, N_k)`` averaged
    over heads, or ``(B, H, N_q, N_k)`` with ``average_attn_weights=False``. ``is_causal``
    is, as in torch, a hint that ``attn_mask`` is causal; without ``attn_mask`` it applies a
    causal mask.
    """

    def __init__(self, inner: MultiHeadAttention, batch_first: bool = False) -> None:
        super().__init__()
        self.inner = inner
        self.batch_first = bool(batch_first)

    @classmethod
    def from_torch(cls, m: nn.MultiheadAttention) -> TorchStyleMultiheadAttention:
        """Same weights and same ``batch_first`` as ``m``; same outputs for the same call."""
        return cls(MultiHeadAttention.from_torch(m), batch_first=m.batch_first)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = query[None], key[None], value[None]
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask[None]
        elif not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        mask = torch_masks_to_attnkit(attn_mask, key_padding_mask, batch=query.shape[0],
                                      heads=self.inner.n_heads)
        causal = is_causal and attn_mask is None
        if causal and mask is not None:      # key_padding_mask and the causal hint: merge
            tril = torch.ones(query.shape[1], key.shape[1], dtype=torch.bool,
                              device=mask.device).tril()
            mask = mask & tril if mask.dtype == torch.bool else mask.masked_fill(~tril, -torch.inf)
            causal = False
        res = self.inner._forward(query, key, value, mask=mask, is_causal=causal, cache=None,
                                  need_weights=need_weights)
        out, weights = res if need_weights else (res, None)
        if unbatched:
            out = out[0]
        elif not self.batch_first:
            out = out.transpose(0, 1)
        if weights is not None:
            if average_attn_weights:
                weights = weights.mean(dim=1)
            if unbatched:
                weights = weights[0]
        return out, weights


# ---------------------------------------------------------------------------- MLA
class MultiHeadLatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2's MLA, without RoPE).

    Keys and values come from one small shared latent per token::

        c = x W_DKVᵀ                 (B, N, d_c)         — the only thing a KVCache stores
        k_h = c W_UK,hᵀ, v_h = c W_UV,hᵀ                  (B, N, d_k), (B, N, d_v) per head
        out = concat_h softmax(q_h k_hᵀ / √d_k + M) v_h · W_Oᵀ

    Absorbed path (default with a cache): ``q_h k_hᵀ = (q_h W_UK,h) cᵀ``, so queries are
    mapped into the latent space (``q'_h = q_h W_UK,h``, width d_c) and attend to the cached
    latent directly, as MQA with one shared key=value "head" of width d_c and scale 1/√d_k;
    the head outputs are ``(weights · c) W_UV,hᵀ``. Keys and values are never expanded.

    Parameters (``nn.Linear`` weights are ``(out, in)``)::

        q_proj   (H·d_k, d)        or q_down (d_q, d) + q_up (H·d_k, d_q) with q_latent_dim
        kv_down  W_DKV (d_c, d_kv)  kv_norm (d_c,) RMSNorm gain when latent_norm=True
        k_up     W_UK (H·d_k, d_c)  v_up W_UV (H·d_v, d_c)   (no bias)
        out_proj W_O (d, H·d_v)

    Args: as :class:`MultiHeadAttention`, plus ``kv_latent_dim`` (d_c, required),
    ``q_latent_dim`` (low-rank queries, default off) and ``latent_norm`` (RMSNorm on c).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        kv_latent_dim: int,
        head_dim: int | None = None,
        v_head_dim: int | None = None,
        q_latent_dim: int | None = None,
        kv_dim: int | None = None,
        bias: bool = False,
        latent_norm: bool = False,
        softcap: float | None = None,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        d_model = _positive_int(d_model, "d_model")
        n_heads = _positive_int(n_heads, "n_heads")
        kv_latent_dim = _positive_int(kv_latent_dim, "kv_latent_dim")
        head_dim, v_head_dim = _head_dims(d_model, n_heads, head_dim, v_head_dim)
        kv_dim = _positive_int(d_model if kv_dim is None else kv_dim, "kv_dim")
        if q_latent_dim is not None:
            _positive_int(q_latent_dim, "q_latent_dim")
        _check_options(softcap, dropout)
        self.d_model, self.n_heads, self.kv_latent_dim = d_model, n_heads, kv_latent_dim
        self.head_dim, self.v_head_dim, self.kv_dim = head_dim, v_head_dim, kv_dim
        self.q_latent_dim = q_latent_dim
        self.softcap = None if softcap is None else float(softcap)
        self.dropout = float(dropout)
        self.latent_norm = bool(latent_norm)
        self.scale = 1.0 / math.sqrt(head_dim)

        if q_latent_dim is None:
            self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=bias)
        else:
            self.q_down = nn.Linear(d_model, q_latent_dim, bias=bias)
            self.q_up = nn.Linear(q_latent_dim, n_heads * head_dim, bias=bias)
        self.kv_down = nn.Linear(kv_dim, kv_latent_dim, bias=bias)
        if latent_norm:
            self.kv_norm = RMSNorm(kv_latent_dim)
        self.k_up = nn.Linear(kv_latent_dim, n_heads * head_dim, bias=False)
        self.v_up = nn.Linear(kv_latent_dim, n_heads * v_head_dim, bias=False)
        self.out_proj = nn.Linear(n_heads * v_head_dim, d_model, bias=bias)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, head_dim={self.head_dim}, "
                f"v_head_dim={self.v_head_dim}, kv_latent_dim={self.kv_latent_dim}"
                + (f", q_latent_dim={self.q_latent_dim}" if self.q_latent_dim else "")
                + (", latent_norm=True" if self.latent_norm else ""))

    def project_q(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, N, d) → q (B, H, N, d_k)."""
        q = self.q_proj(x) if self.q_latent_dim is None else self.q_up(self.q_down(x))
        return _split_heads(q, self.n_heads)

    def project_latent(self, src: torch.Tensor) -> torch.Tensor:
        """src (B, N, d_kv) → c (B, 1, N, d_c): the shared latent, as one K/V "head"."""
        c = self.kv_down(src)
        if self.latent_norm:
            c = self.kv_norm(c)
        return c[:, None]

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        *,
        mask: Any = None,
        is_causal: bool = False,
        cache: KVCache | None = None,
        need_weights: bool = False,
        absorb: bool | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend from ``x`` (B, N_q, d) to ``context`` (B, N_k, d_kv), default ``x`` itself.

        Arguments as :meth:`MultiHeadAttention.forward`; ``absorb`` picks the path: ``True``
        the absorbed one (scores against the latent), ``False`` the plain one (per-head K/V
        up-projected), ``None`` (default) absorbed when a cache is given. Both give the same
        result up to rounding.
        """
        w = self.out_proj.weight
        unbatched = isinstance(x, torch.Tensor) and x.dim() == 2
        x3 = _check_input(x, self.d_model, "x", w)
        if context is None:
            if self.kv_dim != self.d_model:
                raise ValueError(
                    f"this layer builds its latent from width kv_dim={self.kv_dim} but x "
                    f"has width d_model={self.d_model}: pass context (B, N_k, {self.kv_dim})"
                )
            src = x3
        else:
            if cache is not None:
                raise ValueError("a KVCache is for self-attention decoding: call with "
                                 "context=None when passing cache=...")
            src = _check_input(context, self.kv_dim, "context", w)
            if src.shape[0] != x3.shape[0]:
                raise ValueError(f"context {_shape(src)} must have the same batch as x "
                                 f"{_shape(x3)}")
        q = self.project_q(x3)                              # (B, H, N_q, d_k)
        c = self.project_latent(src)                        # (B, 1, N_k, d_c)
        if cache is not None:
            c = cache.append("MultiHeadLatentAttention", latent=c)["latent"]  # (B,1,N_cache,d_c)
        mask, is_causal = _causal_for(cache, is_causal, mask, q.shape[2])
        if absorb is None:
            absorb = cache is not None
        opts = dict(mask=mask, is_causal=is_causal, scale=self.scale, softcap=self.softcap,
                    dropout_p=self.dropout if self.training else 0.0, need_weights=need_weights)
        h, d_c = self.n_heads, self.kv_latent_dim
        if absorb:
            w_uk = self.k_up.weight.view(h, self.head_dim, d_c)      # (H, d_k, d_c)
            w_uv = self.v_up.weight.view(h, self.v_head_dim, d_c)    # (H, d_v, d_c)
            q_lat = torch.einsum("bhnk,hkc->bhnc", q, w_uk)          # (B, H, N_q, d_c)
            o_lat, weights = _attend(q_lat, c, c, **opts)            # (B, H, N_q, d_c)
            o = torch.einsum("bhnc,hvc->bhnv", o_lat, w_uv)          # (B, H, N_q, d_v)
        else:
            k = _split_heads(self.k_up(c[:, 0]), h)                  # (B, H, N_k, d_k)
            v = _split_heads(self.v_up(c[:, 0]), h)                  # (B, H, N_k, d_v)
            o, weights = _attend(q, k, v, **opts)                    # (B, H, N_q, d_v)
        out = self.out_proj(_merge_heads(o))                         # (B, N_q, d)
        if unbatched:
            out = out[0]
            weights = weights[0] if weights is not None else None
        return (out, weights) if need_weights else out
