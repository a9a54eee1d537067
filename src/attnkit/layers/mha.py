"""Multi-head attention with learned projections: MHA, GQA (``n_kv_heads``) and MQA.

Shape legend::

    B  batch      N_q query tokens     N_k key/value tokens (cached ones included)
    d  d_model    d_kv kv_dim          H query heads    H_kv key/value heads (1 = MQA)
    d_k head_dim  d_v v_head_dim

    x (B, N_q, d)  context, value (B, N_k, d_kv)
    q (B, H, N_q, d_k)  k (B, H_kv, N_k, d_k)  v (B, H_kv, N_k, d_v)  out (B, N_q, d)
    positions (N_q,) or (B, N_q)   token positions for ``rope`` (default: cache length + 0 …)

Caution
-------
- A query with no allowed key gets output 0 (before W_O) where torch gives NaN.
- The cache and causal alignment rules are :mod:`attnkit.layers.cache`'s and
  :mod:`attnkit.layers.shared`'s.
- ``rope`` rotates q and k after the head split (and after ``qk_norm``) and before the cache
  append, so the cache holds rotated keys (as transformers' caches do). It is for
  self-attention: with ``context=...`` it raises (keys from another sequence have no
  positions in this one).
"""

from __future__ import annotations

import math
from typing import Any, Literal, overload

import torch
from torch import nn

from .cache import KVCache
from .common import check_options, head_dims, positive_int, shape_of, split_heads
from .norms import RMSNorm
from .paged import PagedBatch, PagedKVCache
from .rope import RoPE, apply, positions_for
from .shared import attend, cache_step, check_call, finish

__all__ = ["MultiHeadAttention"]


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

    Rotary embeddings (``rope=``) have no parameters: ``layer.rope`` holds the setting.

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
        rope: rotary position embeddings on q and k: ``True`` (θ = 10 000, Llama's "half"
            style, every channel) or an :class:`attnkit.rope.RoPE` (``theta``, ``dims``,
            ``style``, ``scaling``); ``None``/``False``: none.
    """

    cache_kind = "MultiHeadAttention"       # what a KVCache of this layer holds: k, v

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
        rope: bool | RoPE | None = None,
    ) -> None:
        super().__init__()
        d_model = positive_int(d_model, "d_model")
        n_heads = positive_int(n_heads, "n_heads")
        head_dim, v_head_dim = head_dims(d_model, n_heads, head_dim, v_head_dim)
        n_kv_heads = positive_int(n_heads if n_kv_heads is None else n_kv_heads, "n_kv_heads")
        if n_heads % n_kv_heads:
            raise ValueError(
                f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads} (each K/V "
                f"head serves a group of query heads): use a divisor of {n_heads}"
            )
        kv_dim = positive_int(d_model if kv_dim is None else kv_dim, "kv_dim")
        check_options(softcap, dropout)
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
        if rope is True:
            rope = RoPE()
        elif rope is False:
            rope = None
        if rope is not None and not isinstance(rope, RoPE):
            raise TypeError(f"rope must be True, None or an attnkit.rope.RoPE(...), got "
                            f"{type(rope).__name__}")
        if rope is not None:
            rope.rotated_dims(head_dim)                   # even, <= head_dim: checked now
        self.rope: RoPE | None = rope

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
        if self.rope is not None:
            opts.append(f"rope={self.rope}")
        return ", ".join(opts)

    # ------------------------------------------------------------------ projections
    def project_q(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, N, d) → q (B, H, N, d_k) (normalised when ``qk_norm``)."""
        w = self.qk_proj if self.tie_qk else self.q_proj
        q = split_heads(w(x), self.n_heads)
        return self.q_norm(q) if self.qk_norm else q

    def project_k(self, src: torch.Tensor) -> torch.Tensor:
        """src (B, N_k, d_kv) → k (B, H_kv, N_k, d_k) (normalised when ``qk_norm``)."""
        w = self.qk_proj if self.tie_qk else self.k_proj
        k = split_heads(w(src), self.n_kv_heads)
        return self.k_norm(k) if self.qk_norm else k

    def project_v(self, src: torch.Tensor) -> torch.Tensor:
        """src (B, N_k, d_kv) → v (B, H_kv, N_k, d_v)."""
        return split_heads(self.v_proj(src), self.n_kv_heads)

    def rotate_qk(self, q: torch.Tensor, k: torch.Tensor, positions: Any,
                  cache: KVCache | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary embeddings on q (B, H, N, d_k) and the new keys k (B, H_kv, N, d_k) at
        ``positions`` (N,) / (B, N), default the cache length + 0 … N−1."""
        assert self.rope is not None
        n = q.shape[2]
        if positions is None:
            positions = positions_for(n, len(cache) if cache is not None else 0,
                                      device=q.device)
        elif isinstance(positions, torch.Tensor) and positions.dim() == 2 \
                and positions.shape[0] not in (1, q.shape[0]):
            raise ValueError(f"positions (B, N) = {tuple(positions.shape)} must have the batch "
                             f"of x (B={q.shape[0]})")
        table_dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        cos, sin = self.rope.tables(positions, self.head_dim, dtype=table_dtype,
                                    device=q.device)        # (N, R) or (B, N, R)
        if cos.shape[-2] != n:
            raise ValueError(f"positions give {cos.shape[-2]} tokens but x has N={n}: one "
                             "position per token")
        return apply(q, cos, sin, style=self.rope.style), apply(k, cos, sin,
                                                                style=self.rope.style)

    # ------------------------------------------------------------------ forward
    @overload
    def forward(self, x: torch.Tensor, context: torch.Tensor | None = ..., *,
                value: torch.Tensor | None = ..., mask: Any = ..., is_causal: bool = ...,
                cache: KVCache | PagedKVCache | PagedBatch | None = ...,
                need_weights: Literal[False] = ...,
                positions: Any = ...) -> torch.Tensor: ...
    @overload
    def forward(self, x: torch.Tensor, context: torch.Tensor | None = ..., *,
                value: torch.Tensor | None = ..., mask: Any = ..., is_causal: bool = ...,
                cache: KVCache | PagedKVCache | PagedBatch | None = ...,
                need_weights: Literal[True],
                positions: Any = ...) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        *,
        value: torch.Tensor | None = None,
        mask: Any = None,
        is_causal: bool = False,
        cache: KVCache | PagedKVCache | PagedBatch | None = None,
        need_weights: bool = False,
        positions: Any = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend from ``x`` (B, N_q, d) to ``context`` (B, N_k, d_kv), default ``x`` itself.

        Args:
            value: a separate source for the values ``(B, N_k, d_kv)`` when keys and values
                come from different tensors (as ``torch.nn.MultiheadAttention`` allows);
                default ``context``. Needs ``context``.
            mask: Mask / bool (True = may attend) / additive float, broadcastable to
                ``(B, H, N_q, N_k)``; with a cache, N_k counts the cached tokens too.
            is_causal: causal self-attention (bottom-right aligned when a cache is given).
            cache: a :class:`KVCache` for incremental decoding (self-attention only): the
                new tokens' K/V are appended and the queries attend to every cached token.
                A cache belongs to the first layer that writes to it. Serving: a
                :class:`~attnkit.PagedKVCache` (row b continues its b-th sequence) or
                ``paged.batch(seqs)`` — no mask, context or weights; N new tokens per row.
            need_weights: also return the attention weights ``(B, H, N_q, N_k)``.
            positions: with ``rope``, the new tokens' positions ``(N_q,)`` or ``(B, N_q)``
                (integers; e.g. left-padded batches); default the cache length + 0 … N_q−1.

        Returns ``out`` ``(B, N_q, d)`` (``(N_q, d)`` for unbatched input), or
        ``(out, weights)`` with ``need_weights=True``.
        """
        if isinstance(cache, (PagedKVCache, PagedBatch)):   # serving: a paged cache
            return self._forward_paged(x, cache, context=context, value=value, mask=mask,
                                       is_causal=is_causal, need_weights=need_weights,
                                       positions=positions)
        call = check_call(self, x, context, value, cache, mask, is_causal)
        if positions is not None and self.rope is None:
            raise ValueError("positions=... are for rotary embeddings: build the layer with "
                             "rope=True (or rope=attnkit.rope.RoPE(...))")
        if self.rope is not None and context is not None:
            raise ValueError(
                "rope applies to self-attention: keys from context=... have no positions in "
                "x's sequence. Build the cross-attention layer without rope, or rotate q and "
                "k yourself with attnkit.rope"
            )
        q = self.project_q(call.x)                          # (B, H,    N_q, d_k)
        k = self.project_k(call.k_src)                      # (B, H_kv, N_k, d_k)
        v = self.project_v(call.v_src)                      # (B, H_kv, N_k, d_v)
        if self.rope is not None:                           # before the cache append
            q, k = self.rotate_qk(q, k, positions, cache)   # same shapes, rotated
        with cache_step(self, cache, k=k, v=v) as kv:       # (B, H_kv, N_cache, ·)
            o, weights = attend(q, kv["k"], kv["v"], mask=call.mask, is_causal=call.is_causal,
                                scale=self.scale, softcap=self.softcap,
                                dropout_p=self.dropout if self.training else 0.0,
                                need_weights=need_weights)  # (B, H, N_q, d_v)
        return finish(self, o, weights, call, need_weights)

    def _forward_paged(self, x: torch.Tensor, cache: PagedKVCache | PagedBatch, *,
                       context: Any, value: Any, mask: Any, is_causal: bool,
                       need_weights: bool, positions: Any) -> torch.Tensor:
        """``cache=`` a :class:`~attnkit.PagedKVCache` (row b of x is its b-th live sequence)
        or ``cache.batch(seqs)``: x (B, N, d) appends N tokens to each sequence and attends
        through its pages (:func:`attnkit.attention_with_kvcache`; causal bottom-right)."""
        batch = cache.batch(cache.sequences) if isinstance(cache, PagedKVCache) else cache
        paged, seqs = batch.cache, batch.seqs
        refused = [name for name, given in (("context", context is not None),
                   ("value", value is not None), ("mask", mask is not None),
                   ("need_weights", need_weights),
                   ("dropout in training", self.training and self.dropout > 0)) if given]
        if refused:
            raise NotImplementedError(f"with a PagedKVCache, {', '.join(refused)} is not "
                                      "supported (self-attention decoding, is_causal only)")
        if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3) \
                or x.shape[-1] != self.d_model:
            raise ValueError(f"x must be (B, N, {self.d_model}) or (N, {self.d_model}), got "
                             f"{shape_of(x) if isinstance(x, torch.Tensor) else type(x)}")
        unbatched = x.dim() == 2
        x3 = x[None] if unbatched else x
        if x3.shape[0] != len(seqs):
            raise ValueError(f"x has batch B={x3.shape[0]} but the paged cache call holds "
                             f"{len(seqs)} sequences {seqs}: row b continues sequence b "
                             "(use cache.batch(seqs) to choose them)")
        if (paged.n_kv_heads, paged.head_dim, paged.v_head_dim) != (
                self.n_kv_heads, self.head_dim, self.v_head_dim):
            raise ValueError(
                f"this PagedKVCache holds (H_kv, D, D_v) = ({paged.n_kv_heads}, "
                f"{paged.head_dim}, {paged.v_head_dim}), the layer has ({self.n_kv_heads}, "
                f"{self.head_dim}, {self.v_head_dim})")
        paged.check_owner(self)
        q = self.project_q(x3)                              # (B, H,    N, d_k)
        k = self.project_k(x3)                              # (B, H_kv, N, d_k)
        v = self.project_v(x3)                              # (B, H_kv, N, d_v)
        if self.rope is not None:
            if positions is None:                           # each row from its own length
                n = x3.shape[1]
                positions = paged.seqlens(seqs).to(torch.long)[:, None] + torch.arange(
                    n, device=paged.device)
            q, k = self.rotate_qk(q, k, positions, None)
        o = paged.attention(seqs, *(t.transpose(1, 2) for t in (q, k, v)), causal=is_causal,
                            softmax_scale=self.scale, softcap=self.softcap or 0.0)
        out = self.out_proj(o.flatten(2))                   # (B, N, H·d_v) → (B, N, d)
        return out[0] if unbatched else out

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
        from .torch_compat import from_torch  # torch_compat builds on this module

        return from_torch(m, cls)
