"""PyTorch compatibility: ``nn.MultiheadAttention`` weights, masks and call convention.

- :func:`from_torch` — an attnkit :class:`MultiHeadAttention` with the same weights as a
  ``torch.nn.MultiheadAttention`` (what ``MultiHeadAttention.from_torch`` returns);
- :func:`torch_masks_to_attnkit` — torch's ``attn_mask`` / ``key_padding_mask``
  (bool True = **blocked**) as one attnkit mask (bool True = **may attend**);
- :class:`TorchStyleMultiheadAttention` — an attnkit layer behind torch's exact call.

Shape legend::

    B batch   H num_heads   E embed_dim   N_q, N_k query / key tokens
    query (N_q, B, E) or (B, N_q, E) with batch_first, (N_q, E) unbatched; key, value alike
    attn_mask (N_q, N_k) or (B·H, N_q, N_k)   key_padding_mask (B, N_k)
    attnkit mask (B|1, H|1, N_q, N_k)         weights (B, N_q, N_k) averaged, or (B, H, N_q, N_k)

Caution
-------
- ``add_bias_kv``, ``add_zero_attn`` and ``kdim != vdim`` are not supported (raise).
- A query with no allowed key gets output 0 where torch gives NaN.
"""

from __future__ import annotations

import torch
from torch import nn

from .common import shape_of
from .mha import MultiHeadAttention

__all__ = ["from_torch", "torch_masks_to_attnkit", "TorchStyleMultiheadAttention"]


def from_torch(m: nn.MultiheadAttention, cls: type[MultiHeadAttention] = MultiHeadAttention
               ) -> MultiHeadAttention:
    """A ``cls`` layer with the same weights, biases, dropout and training mode as ``m``.

    See :meth:`MultiHeadAttention.from_torch` (which calls this).
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
                f"got {shape_of(attn_mask)}"
            )
        parts.append(am)
    if key_padding_mask is not None:
        if key_padding_mask.dim() != 2 or key_padding_mask.shape[0] != batch:
            raise ValueError(f"key_padding_mask must be (B={batch}, N_k), got "
                             f"{shape_of(key_padding_mask)}")
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

    def __init__(self, embed_dim: int | MultiHeadAttention, num_heads: int | None = None,
                 dropout: float = 0.0, bias: bool = True, add_bias_kv: bool = False,
                 add_zero_attn: bool = False, kdim: int | None = None, vdim: int | None = None,
                 batch_first: bool = False, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        """Either torch's constructor, ``(embed_dim, num_heads, dropout=0.0, bias=True, ...,
        batch_first=False, device=None, dtype=None)`` — a new layer with attnkit's own
        initialisation — or an existing attnkit :class:`MultiHeadAttention` to wrap
        (``TorchStyleMultiheadAttention(layer, batch_first=...)``)."""
        super().__init__()
        if isinstance(embed_dim, MultiHeadAttention):
            if num_heads is not None:
                raise TypeError("TorchStyleMultiheadAttention(layer) wraps an existing layer: "
                                f"num_heads comes from it, got num_heads={num_heads!r}")
            inner = embed_dim
        elif isinstance(embed_dim, int) and not isinstance(embed_dim, bool):
            if num_heads is None:
                raise TypeError("TorchStyleMultiheadAttention(embed_dim, num_heads, ...) needs "
                                "num_heads, as torch.nn.MultiheadAttention does")
            if add_bias_kv or add_zero_attn:
                raise ValueError("add_bias_kv=True and add_zero_attn=True are not supported: "
                                 "build the layer without them")
            kdim = embed_dim if kdim is None else kdim
            vdim = embed_dim if vdim is None else vdim
            if kdim != vdim:
                raise ValueError(f"kdim == vdim is required (one context feeds K and V), got "
                                 f"kdim={kdim}, vdim={vdim}")
            inner = MultiHeadAttention(embed_dim, num_heads, kv_dim=kdim, bias=bias,
                                       dropout=dropout)
            inner.to(device=device, dtype=dtype)
        else:
            raise TypeError("TorchStyleMultiheadAttention takes (embed_dim, num_heads, ...) like "
                            "torch.nn.MultiheadAttention, or an attnkit MultiHeadAttention to "
                            f"wrap; got {type(embed_dim).__name__}")
        self.inner = inner
        self.batch_first = bool(batch_first)

    @classmethod
    def from_torch(cls, m: nn.MultiheadAttention) -> TorchStyleMultiheadAttention:
        """Same weights and same ``batch_first`` as ``m``; same outputs for the same call."""
        return cls(from_torch(m, MultiHeadAttention), batch_first=m.batch_first)

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
        res = self.inner(query, key, value=value, mask=mask, is_causal=causal,
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
