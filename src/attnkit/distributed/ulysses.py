"""The all-to-all strategy (DeepSpeed-Ulysses): one all-to-all turns sequence shards into
head shards over the whole sequence, one local attention call, one all-to-all back.
Shape legend as in :mod:`attnkit.distributed`."""

from __future__ import annotations

import math
from typing import Any

import torch

from .. import backends as _backends
from .. import masks as _masks
from .. import scores as _scores
from ..api import attention, prepare
from .collectives import _Ring
from .layout import _to_global_order
from .ring import _Options


class _AllToAll(torch.autograd.Function):
    """Chunk j of ``x`` (W, M) goes to rank j; chunk i of the result came from rank i. The
    exchange is its own adjoint: the backward is the same all-to-all of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ring: _Ring, step: str, back_step: str,
                ) -> torch.Tensor:
        ctx.ring, ctx.back_step = ring, back_step
        return ring.all_to_all(x.contiguous(), step)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return ctx.ring.all_to_all(g.contiguous(), ctx.back_step), None, None, None


def _heads_out(t: torch.Tensor, w: int) -> torch.Tensor:
    """(B, H, n, D) → (W, B·(H/W)·n·D): chunk j holds head group j (for rank j)."""
    b, h, n, d = t.shape
    return t.reshape(b, w, h // w, n, d).transpose(0, 1).reshape(w, -1)


def _heads_in(buf: torch.Tensor, b: int, hw: int, n: int, d: int) -> torch.Tensor:
    """(W, B·hw·n·D), chunk i = rank i's shard of our heads → (B, hw, W·n, D)."""
    w = buf.shape[0]
    return buf.reshape(w, b, hw, n, d).permute(1, 2, 0, 3, 4).reshape(b, hw, w * n, d)


def _seq_out(t: torch.Tensor, w: int) -> torch.Tensor:
    """(B, hw, W·n, D) → (W, B·hw·n·D): chunk i holds sequence shard i (for rank i)."""
    b, hw, big_n, d = t.shape
    return t.reshape(b, hw, w, big_n // w, d).permute(2, 0, 1, 3, 4).reshape(w, -1)


def _seq_in(buf: torch.Tensor, b: int, hw: int, n: int, d: int) -> torch.Tensor:
    """(W, B·hw·n·D), chunk j = head group j of our shard → (B, W·hw, n, D)."""
    w = buf.shape[0]
    return buf.reshape(w, b, hw, n, d).transpose(0, 1).reshape(b, w * hw, n, d)


def _local_score_mod(score_mod: Any, h0: int, hn: int, h_q: int) -> Any:
    """The score_mod for query heads [h0, h0 + hn) of ``h_q``, called with local head
    indices 0..hn-1: ALiBi and relative-bias terms keep their closed form (their slopes /
    table sliced, gradients flow to the table); any other function sees ``h + h0``."""
    if score_mod is None or (h0 == 0 and hn == h_q):
        return score_mod
    terms = _scores.score_terms(score_mod, h_q)
    if terms.alibi is not None:
        slopes, offset = terms.alibi.slopes[h0:h0 + hn], terms.alibi.offset

        def alibi(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
            s = slopes.to(device=score.device, dtype=score.dtype)[h]
            return score - s * (q_idx + offset - kv_idx).abs().to(score.dtype)

        return _scores.ScoreTerm(alibi, f"{_scores.fn_name(terms.fn)}[heads {h0}:{h0 + hn}]",
                                 hn, spec=_scores.Alibi(slopes, offset))
    if terms.relative is not None:
        return _scores.relative_bias(terms.relative.table[h0:h0 + hn],
                                     terms.relative.max_distance)

    def shifted(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return score_mod(score, b, h + h0, q_idx, kv_idx)

    return shifted


def _ulysses_problem(prep: Any, w: int, rank: int, is_causal: bool, mask: Any,
                     score_mod: Any, requires_grad: bool) -> Any:
    """The local call's Problem (validated by :func:`prepare` on zero-stride stand-ins of
    its shapes: mask sizes, mask with is_causal, score_mod checks — no data)."""
    p = prep.problem
    e = w // math.gcd(p.heads_kv, w)
    h_kv = p.heads_kv * e
    shapes = [(p.batch, p.heads_q // w, w * p.n_q, p.d_k), (p.batch, h_kv // w, w * p.n_k, p.d_k),
              (p.batch, h_kv // w, w * p.n_k, p.d_v)]
    fakes = [prep.restore(torch.empty_strided(s, (0,) * 4, dtype=p.dtype, device=p.device)
                          .requires_grad_(requires_grad)) for s in shapes]
    hw = p.heads_q // w
    with torch.enable_grad() if requires_grad else torch.no_grad():
        return prepare(*fakes, mask=mask, is_causal=is_causal, scale=p.scale, softcap=p.softcap,
                       score_mod=_local_score_mod(score_mod, rank * hw, hw, p.heads_q)).problem


def _check_ulysses(prep: Any, w: int, rank: int, is_causal: bool, mask: Any, score_mod: Any,
                   backend: str, needs_grad: bool) -> None:
    """strategy='ulysses': the head rule, the masks it can take, a forced backend that can
    run the local call — checked on every rank before anything moves."""
    p = prep.problem
    if p.heads_q % w:
        raise ValueError(
            f"ring_attention with strategy='ulysses' splits the query heads over the {w} "
            f"ranks, so H_q must be a multiple of {w}, got H_q={p.heads_q} (q "
            f"{tuple(p.q.shape)}): use strategy='ring' (any head count), or a group size "
            "that divides H_q")
    if mask is not None:
        if not isinstance(mask, _masks.Mask):
            raise TypeError(
                f"ring_attention: mask must be an attnkit.masks.Mask over the global sequence "
                f"(e.g. masks.sliding_window(w), masks.document(ids)), got "
                f"{type(mask).__name__}: a dense mask tensor is not sharded by attnkit")
        if mask.depends_on_heads:
            raise ValueError(
                f"ring_attention with strategy='ulysses': mask {mask.name} depends on the head "
                "index, but each rank holds a slice of the heads: use a mask that is the same "
                "for every head (or express the per-head part as a score_mod)")
    heads = getattr(score_mod, "heads", None)
    if isinstance(score_mod, _scores.ScoreTerm) and heads not in (None, p.heads_q):
        raise ValueError(
            f"ring_attention: score_mod {score_mod.name} was built for {heads} heads, but the "
            f"inputs have H_q={p.heads_q} query heads (q {tuple(p.q.shape)}): build it for "
            "all H_q heads of the call (each rank uses its own slice)")
    local = _ulysses_problem(prep, w, rank, is_causal, mask, score_mod, needs_grad)
    if backend != "auto" and p.n_q and p.n_k:
        why = _backends.get(backend).not_supported_reasons(local)
        if why:
            raise ValueError(
                f"ring_attention: backend {backend!r} cannot run the local attention call of "
                f"strategy='ulysses': {'; '.join(why)}. Choose a backend that can (or 'auto')"
                + (", or call under torch.no_grad() if no gradients are needed"
                   if needs_grad else "") + ".")


def _ulysses(prep: Any, o: _Options, mask: Any, score_mod: Any, return_lse: bool,
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """All-to-all (DeepSpeed-Ulysses): sequence shards → head shards, one local attention
    call over the whole sequence, head shards → sequence shards. Differentiable through
    the all-to-alls (each one's backward is the reverse exchange). → (out, lse or None)
    in the (B, H, N, D) layout."""
    ring, w = o.ring, o.ring.size
    p = prep.problem
    q, k, v = p.q, p.k, p.v
    b, h_q, n_q, d_k = q.shape
    n_k, d_v = k.shape[2], v.shape[-1]
    e = w // math.gcd(k.shape[1], w)       # K/V heads repeated until W divides them
    if e > 1:
        k, v = k.repeat_interleave(e, dim=1), v.repeat_interleave(e, dim=1)
    hq, hkv = h_q // w, k.shape[1] // w    # heads per rank
    send = torch.cat([_heads_out(q, w), _heads_out(k, w), _heads_out(v, w)], dim=1)
    recv = _AllToAll.apply(send, ring, "ulysses forward (sequence → heads all-to-all)",
                           "ulysses backward (heads → sequence all-to-all of dQ/dK/dV)")
    q_r, k_r, v_r = recv.split([b * hq * n_q * d_k, b * hkv * n_k * d_k,
                                b * hkv * n_k * d_v], dim=1)
    q_h, k_h, v_h = (_heads_in(q_r, b, hq, n_q, d_k), _heads_in(k_r, b, hkv, n_k, d_k),
                     _heads_in(v_r, b, hkv, n_k, d_v))
    del send, recv, q_r, k_r, v_r       # the exchange buffers: not alive during the call
    order_q = _to_global_order(n_q, w, o.layout, q.device)
    order_k = _to_global_order(n_k, w, o.layout, q.device)
    if order_q is not None and order_k is not None:        # zigzag → global order
        q_h = q_h.index_select(2, order_q[0])
        k_h, v_h = k_h.index_select(2, order_k[0]), v_h.index_select(2, order_k[0])
    failure: Exception | None = None
    out_h = lse_h = None
    try:
        out_h, lse_h = attention(
            prep.restore(q_h), prep.restore(k_h), prep.restore(v_h), mask=mask,
            is_causal=o.is_causal, scale=o.scale, softcap=o.softcap,
            score_mod=_local_score_mod(score_mod, ring.rank * hq, hq, h_q),
            backend=o.backend, return_lse=True)
    except Exception as err:    # the peers must hear of it before the second all-to-all
        failure = err
    ring.settle(failure, 0, "forward", where="the local attention call of strategy='ulysses'")
    assert out_h is not None and lse_h is not None
    out_h = out_h.reshape(b, hq, w * n_q, d_v)
    lse_h = lse_h.reshape(b, hq, w * n_q, 1)
    if order_q is not None:                                # global → zigzag order
        out_h, lse_h = out_h.index_select(2, order_q[1]), lse_h.index_select(2, order_q[1])
    lse_send = _seq_out(lse_h, w) if return_lse else None
    send_out = _seq_out(out_h, w)
    del out_h, lse_h
    out = _seq_in(_AllToAll.apply(send_out, ring,
                                  "ulysses forward (heads → sequence all-to-all)",
                                  "ulysses backward (sequence → heads all-to-all of dO)"),
                  b, hq, n_q, d_v)
    lse = None
    if return_lse:
        lse = _seq_in(_AllToAll.apply(lse_send, ring,
                                      "ulysses forward (heads → sequence all-to-all of LSE)",
                                      "ulysses backward (all-to-all of dLSE)"),
                      b, hq, n_q, 1)[..., 0]
    return out, lse
