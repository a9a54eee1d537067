"""Multi-head latent attention (DeepSeek-V2's MLA, without RoPE): the cache holds a small
latent per token instead of per-head keys and values.

Shape legend::

    B  batch      N_q query tokens     N_k key/value tokens (cached ones included)
    d  d_model    d_kv kv_dim          H query heads    d_c kv_latent_dim   d_q q_latent_dim
    d_k head_dim  d_v v_head_dim

    x (B, N_q, d)  context (B, N_k, d_kv)  c (B, 1, N_k, d_c)  — the latent as one K/V "head"
    q (B, H, N_q, d_k)   absorbed q' (B, H, N_q, d_c)   out (B, N_q, d)

Caution
-------
- The key/value up-projections carry no bias (a bias would not absorb into the query).
- A query with no allowed key gets output 0 (before W_O).
"""

from __future__ import annotations

import math
from typing import Any, Literal, overload

import torch
from torch import nn

from .cache import KVCache
from .common import check_options, head_dims, positive_int, split_heads
from .norms import RMSNorm
from .shared import attend, cache_step, check_call, finish

__all__ = ["MultiHeadLatentAttention"]


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

    cache_kind = "MultiHeadLatentAttention"     # what a KVCache of this layer holds: latent

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
        d_model = positive_int(d_model, "d_model")
        n_heads = positive_int(n_heads, "n_heads")
        kv_latent_dim = positive_int(kv_latent_dim, "kv_latent_dim")
        head_dim, v_head_dim = head_dims(d_model, n_heads, head_dim, v_head_dim)
        kv_dim = positive_int(d_model if kv_dim is None else kv_dim, "kv_dim")
        if q_latent_dim is not None:
            positive_int(q_latent_dim, "q_latent_dim")
        check_options(softcap, dropout)
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
        return split_heads(q, self.n_heads)

    def project_latent(self, src: torch.Tensor) -> torch.Tensor:
        """src (B, N, d_kv) → c (B, 1, N, d_c): the shared latent, as one K/V "head"."""
        c = self.kv_down(src)
        if self.latent_norm:
            c = self.kv_norm(c)
        return c[:, None]

    @overload
    def forward(self, x: torch.Tensor, context: torch.Tensor | None = ..., *, mask: Any = ...,
                is_causal: bool = ..., cache: KVCache | None = ...,
                need_weights: Literal[False] = ..., absorb: bool | None = ...
                ) -> torch.Tensor: ...
    @overload
    def forward(self, x: torch.Tensor, context: torch.Tensor | None = ..., *, mask: Any = ...,
                is_causal: bool = ..., cache: KVCache | None = ...,
                need_weights: Literal[True], absorb: bool | None = ...
                ) -> tuple[torch.Tensor, torch.Tensor]: ...

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
        call = check_call(self, x, context, None, cache, mask, is_causal)
        q = self.project_q(call.x)                          # (B, H, N_q, d_k)
        c = self.project_latent(call.k_src)                 # (B, 1, N_k, d_c)
        if absorb is None:
            absorb = cache is not None
        opts = dict(mask=call.mask, is_causal=call.is_causal, scale=self.scale,
                    softcap=self.softcap, dropout_p=self.dropout if self.training else 0.0,
                    need_weights=need_weights)
        h, d_c = self.n_heads, self.kv_latent_dim
        with cache_step(self, cache, latent=c) as streams:
            c = streams["latent"]                                    # (B, 1, N_cache, d_c)
            if absorb:
                w_uk = self.k_up.weight.view(h, self.head_dim, d_c)      # (H, d_k, d_c)
                w_uv = self.v_up.weight.view(h, self.v_head_dim, d_c)    # (H, d_v, d_c)
                q_lat = torch.einsum("bhnk,hkc->bhnc", q, w_uk)          # (B, H, N_q, d_c)
                o_lat, weights = attend(q_lat, c, c, **opts)             # (B, H, N_q, d_c)
                o = torch.einsum("bhnc,hvc->bhnv", o_lat, w_uv)          # (B, H, N_q, d_v)
            else:
                k = split_heads(self.k_up(c[:, 0]), h)                   # (B, H, N_k, d_k)
                v = split_heads(self.v_up(c[:, 0]), h)                   # (B, H, N_k, d_v)
                o, weights = attend(q, k, v, **opts)                     # (B, H, N_q, d_v)
        return finish(self, o, weights, call, need_weights)
