"""``attention()`` as a torch custom operator, for ``torch.compile`` and ``torch.export``.

    torch.ops.attnkit.attention(q, k, v, tensor_mask, bands, kv_lengths, q_lengths,
                                doc_ids, doc_kv_ids, scale, softcap, dropout_p, seed,
                                backend) -> (out, lse)
    torch.ops.attnkit.attention_backward(grad_out, grad_lse, q, k, v, out, lse,
                                         <the other inputs>, needs) -> (dq, dk, dv, dmask)
    torch.ops.attnkit.attention_weights(q, k, tensor_mask, bands, kv_lengths, q_lengths,
                                        doc_ids, doc_kv_ids, scale, softcap) -> weights
    torch.ops.attnkit.attention_weights_backward(grad_weights, <the same inputs>, needs)
                                -> (dq, dk, dmask)

Shape legend: as :func:`attnkit.attention` (user layout, any leading dims)::

    q (..., H_q, N_q, D_k)   k (..., H_kv, N_k, D_k)   v (..., H_kv, N_k, D_v)
    out (..., H_q, N_q, D_v)    lse (..., H_q, N_q)  (float32; float64 for float64 inputs)
    weights (B, H_q, N_q, N_k)  B = the leading dims of q flattened (1 without them)
    tensor_mask   the user's bool or float mask tensor, unchanged
    bands         flat [lo, hi, bottom_right] per band term (causal, windows, any band)
    kv_lengths, q_lengths (B,)    the padding terms (intersected: masks.decompose)
    doc_ids (B|1, N_q), doc_kv_ids (B|1, N_k)    one document term

To a tracer (Dynamo, AOTAutograd, export) the call is one opaque node with a fake-tensor
implementation (output shapes only) and an autograd formula whose backward is a second
operator. The forward's implementation calls the eager :func:`attnkit.attention` with the
mask rebuilt from its builders' arguments, so a compiled call computes exactly what the
eager call computes (validation, NaN screens and backend choice included, at run time) —
on CPU that is the native kernel's forward. The autograd formula saves the forward's
``out`` and ``lse``, and the backward operator reuses them: where the call runs on the
native kernel, it calls the kernel's own backward (``native.backward_problem``); elsewhere
(another device or engine) the closed form from the saved LSE, block by block. No forward
is recomputed, and no autograd runs inside an implementation.

:func:`attnkit.attention` routes here only while ``torch.compiler.is_compiling()`` (compile
and export); an eager call never touches the operator, so it costs eager calls nothing.
The same holds for :func:`attention_weights` (what ``need_weights=True`` and
``output_attentions=True`` return): eager, the reference's softmax; traced, one
``attnkit::attention_weights`` node whose implementation is that same eager call, and whose
backward is the softmax's closed form.

Under ``torch.autocast`` each operator has an autocast rule (the end of this module): as
torch does for SDPA, the forward operators cast q, k, v and a float mask to the region's
dtype (float64 excepted) and run with autocast off; the backward operators run with
autocast off.

Caution
-------
- What an operator argument cannot carry (for the weights too): a Python ``score_mod``
  (also ``scores.alibi`` / ``relative_bias``), ``from_fn`` masks, masks combined with ``|``
  or ``~`` (``prefix_lm`` too), a ``from_tensor`` Mask object (pass the bool tensor itself
  as ``mask=``), band masks other than ``causal`` / ``sliding_window`` / ``full``, more
  than one padding or document term, and NumPy inputs. Such a call runs the plain eager
  path outside the graph (a graph break: ``fullgraph=True`` raises), with one warning per
  call site.
- First derivatives only.
- Dropout (``dropout_p > 0``) in a compiled call runs the operator's own closed form,
  forward and backward, whatever the backend: O(rows · N_k) memory per block of query rows
  (``_BLOCK_ELEMENTS`` logits), the pattern drawn block by block from a seed the graph
  draws, so the backward redraws it exactly. It differs from the pattern an eager call
  draws from the same global seed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from . import masks as _masks
from ._compat import run_outside_graph
from .backends.base import Problem, compute_dtype
from .eager import (
    Prepared,
    _attends_to,
    _empty_result,
    _is_empty,
    _non_finite_kv_rows,
    attend,
    check_inputs,
    prepare,
)
from .reference import safe_softmax
from .scores import soft_cap, soft_cap_grad

__all__ = ["OpArgs", "op_args", "rebuild_mask", "attention_op", "attention_backward_op",
           "eager_fallback", "eager_in_torch", "attention_weights", "attention_weights_op",
           "attention_weights_backward_op", "autocast_dtype", "autocast_cast"]

Tensor = torch.Tensor


class OpArgs:
    """A mask as operator arguments (see the module's shape legend)."""

    __slots__ = ("tensor", "bands", "kv_lengths", "q_lengths", "doc_ids", "doc_kv_ids")

    def __init__(self) -> None:
        self.tensor: Tensor | None = None
        self.bands: list[float] = []
        self.kv_lengths: Tensor | None = None
        self.q_lengths: Tensor | None = None
        self.doc_ids: Tensor | None = None
        self.doc_kv_ids: Tensor | None = None


def _band_mask(lo: float, hi: float, bottom_right: bool) -> _masks.Mask | None:
    """The builder call that makes ``Band(lo, hi, bottom_right)`` (the named builders for
    full / causal / sliding windows, ``masks.band`` for any other band), or None."""
    align = "bottom_right" if bottom_right else "top_left"
    if lo == -math.inf and hi == math.inf:
        return _masks.full()
    if lo == 0 and hi == math.inf:
        return _masks.causal(align)
    if math.isfinite(hi) and hi >= 0 and hi == int(hi) and lo in (0, -hi):
        return _masks.sliding_window(int(hi) + 1, causal=lo == 0, align=align)
    if all(math.isinf(x) or x == int(x) for x in (lo, hi)) and lo <= hi:
        return _masks.band(*(x if math.isinf(x) else int(x) for x in (lo, hi)), align)
    return None


def op_args(mask: Any, n_q: int, n_k: int) -> OpArgs | str:
    """``mask`` (None, a tensor or a Mask) as operator arguments, or the reason it cannot be
    one (a sentence naming the mask)."""
    a = OpArgs()
    if mask is None:
        return a
    if isinstance(mask, torch.Tensor):
        a.tensor = mask
        return a
    if not isinstance(mask, _masks.Mask):
        return f"mask of type {type(mask).__name__} is not a tensor or an attnkit Mask"
    parts = _masks.decompose(mask, n_q, n_k)            # the one decomposition
    if parts.rest is not None:
        return (f"mask term {parts.rest.name} has no builder arguments an operator can carry "
                "(from_fn, |, ~, prefix_lm, a from_tensor Mask, or a second document term)")
    for spec in parts.bands:       # kept apart, alignment unfolded: N_q / N_k may be symbolic
        if _band_mask(spec.lo, spec.hi, spec.bottom_right) is None:
            return (f"mask band ({spec.lo}, {spec.hi}) has no builder arguments an operator "
                    "can carry (its bounds are not whole numbers)")
        a.bands += [float(spec.lo), float(spec.hi), float(spec.bottom_right)]
    a.kv_lengths, a.q_lengths = parts.kv_lengths, parts.q_lengths
    a.doc_ids, a.doc_kv_ids = parts.doc_ids, parts.kv_doc_ids
    return a


def rebuild_mask(bands: list[float], kv_lengths: Tensor | None, q_lengths: Tensor | None,
                 doc_ids: Tensor | None, doc_kv_ids: Tensor | None) -> _masks.Mask | None:
    """The Mask that :func:`op_args` took apart, rebuilt from its builders."""
    terms: list[_masks.Mask] = []
    for i in range(0, len(bands), 3):
        m = _band_mask(bands[i], bands[i + 1], bool(bands[i + 2]))
        if m is None:
            raise ValueError(f"attnkit::attention got a band ({bands[i]}, {bands[i + 1]}) "
                             "that no mask builder makes")
        terms.append(m)
    if kv_lengths is not None:
        terms.append(_masks.padding(kv_lengths, q_lengths))
    if doc_ids is not None:
        terms.append(_masks.document(doc_ids, doc_kv_ids))
    return functools.reduce(lambda x, y: x & y, terms) if terms else None


# ------------------------------------------------------------------ the call, lowered again
def _prepared(q: Tensor, k: Tensor, v: Tensor, tensor_mask: Tensor | None, bands: list[float],
              kv_lengths: Tensor | None, q_lengths: Tensor | None, doc_ids: Tensor | None,
              doc_kv_ids: Tensor | None, scale: float | None, softcap: float | None,
              dropout_p: float = 0.0) -> Prepared:
    """The operator's arguments as the eager call's :class:`~attnkit.api.Prepared` (the mask
    rebuilt from its builders' arguments), on detached inputs: an operator's implementation
    runs below autograd."""

    mask = tensor_mask.detach() if tensor_mask is not None else \
        rebuild_mask(bands, kv_lengths, q_lengths, doc_ids, doc_kv_ids)
    return prepare(q.detach(), k.detach(), v.detach(), mask=mask, scale=scale,
                   softcap=softcap, dropout_p=dropout_p)


def _with_zero_bias(p: Problem) -> Problem:
    """``p`` with a zero additive bias when it has none (a float mask of zeros and −∞ whose
    gradient is wanted: ``prepare`` drops an all-zero bias)."""
    if p.bias is not None:
        return p
    zero = torch.zeros((1, 1, 1, 1), dtype=compute_dtype(p.dtype), device=p.device)
    return dataclasses.replace(p, bias=zero)


def _in_user_layout(g: Tensor, like: Tensor, q: Tensor) -> Tensor:
    """A gradient ``g`` in the Problem layout ``(B, H, N, D)`` (or the logits'
    ``(B, H_q, N_q, N_k)``) back in the layout of the input ``like`` of the call with query
    ``q`` (user layout): q's leading dims unflattened, then summed over what ``like``
    broadcast (K/V batch 1, a mask's size-1 dims), in ``like``'s dtype, contiguous."""
    g = g.reshape(*q.shape[:-3], *g.shape[1:])            # (..., H, N, D) or (..., N_q, N_k)
    if like.dim() > g.dim():
        g = g.reshape((1,) * (like.dim() - g.dim()) + tuple(g.shape))
    return g.sum_to_size(like.shape).to(like.dtype).contiguous()


# ------------------------------------------------------------------ the closed form
# Used where the native kernel's backward cannot run (another device or engine, dropout):
# the weights rebuilt per block of query rows from the scores and the saved LSE (the
# FlashAttention-2 backward, with O(rows · N_k) memory per block instead of O(N_q · N_k)),
#     P = exp(x − lse)      dS = P ∘ (dP − δ)      δ = rowsum(dO ∘ O) − dlse
# then back through the bias, the soft-cap and the scale to dQ, dK (and dP·V to dV).
# Dropout in the operator is drawn here too (forward and backward), block by block from the
# call's seed, so that the backward redraws the forward's pattern exactly.
_BLOCK_ELEMENTS = 4 * 2**20          # logits elements (B · H_q · rows · N_k) per row block


def _row_blocks(p: Problem) -> list[tuple[int, int]]:
    """Query row ranges ``[q0, q1)`` of at most ``_BLOCK_ELEMENTS`` logits each (sizes only:
    the forward and the backward of one call cut the same blocks)."""
    rows = max(1, _BLOCK_ELEMENTS // max(1, p.batch * p.heads_q * p.n_k))
    return [(q0, min(q0 + rows, p.n_q)) for q0 in range(0, p.n_q, rows)]


def _kept(p: Problem, seed: Tensor | None) -> Iterator[Tensor | None]:
    """Dropout's keep pattern, one bool ``(B, H_q, rows, N_k)`` per row block, drawn in block
    order from a generator seeded with ``seed`` (None for every block without dropout)."""
    if p.dropout_p == 0.0:
        for _ in _row_blocks(p):
            yield None
        return
    if seed is None:
        raise ValueError("attnkit::attention with dropout_p > 0 needs a seed tensor "
                         "(attnkit.attention draws one in the graph)")
    gen = torch.Generator(device=p.device)
    gen.manual_seed(int(seed.item()))
    for q0, q1 in _row_blocks(p):
        draw = torch.rand((p.batch, p.heads_q, q1 - q0, p.n_k), generator=gen,
                          device=p.device)
        yield draw >= p.dropout_p


def _logits(p: Problem, q: Tensor, k: Tensor, q0: int, q1: int,
            ) -> tuple[Tensor, Tensor | None]:
    """Rows ``[q0, q1)`` of the logits ``(B, H_q, rows, N_k)`` — ``q·kᵀ·scale``, soft-capped,
    plus the bias, −∞ where the mask blocks — and the soft-capped scores (for the cap's
    derivative; None without a cap). ``q`` holds those rows ``(B, H_q, rows, D_k)``, ``k``
    every key per query head ``(B, H_q, N_k, D_k)``, both in the compute dtype."""
    x = (q @ k.transpose(-1, -2)) * p.scale
    capped = None
    if p.softcap is not None:
        x = capped = soft_cap(x, p.softcap)
    if p.bias is not None:
        b = p.bias if p.bias.shape[-2] == 1 else p.bias[..., q0:q1, :]
        x = x + b.to(x.dtype)
    if p.mask is not None:
        allowed = p.mask.evaluate(p.n_q, p.n_k, q_range=(q0, q1), batch=p.batch,
                                  heads=p.heads_q, device=p.device)  # (B|1, H|1, rows, N_k)
        x = torch.where(allowed, x, torch.full_like(x, -math.inf))
    return x, capped


def _score_grad(p: Problem, ds: Tensor, capped: Tensor | None) -> Tensor:
    """The gradient of the logits ``ds`` taken back through the soft-cap and the scale to
    the gradient of ``q·kᵀ`` (same shape)."""
    if capped is not None:
        ds = ds * soft_cap_grad(capped, p.softcap)  # type: ignore[arg-type]
    return ds * p.scale


def _per_kv_head(g: Tensor, p: Problem) -> Tensor:
    """``(B, H_q, N_k, D)`` summed over each K/V head's group → ``(B, H_kv, N_k, D)``."""
    return g.reshape(p.batch, p.heads_kv, p.group, *g.shape[2:]).sum(2)


def _qkv(p: Problem) -> tuple[Tensor, Tensor, Tensor]:
    """q ``(B, H_q, N_q, D_k)``, and k, v repeated per query head ``(B, H_q, N_k, D)``, in
    the compute dtype."""
    cdt = compute_dtype(p.dtype)
    return (p.q.to(cdt), p.k.to(cdt).repeat_interleave(p.group, dim=1),
            p.v.to(cdt).repeat_interleave(p.group, dim=1))


def _closed_form_forward(p: Problem, seed: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(out (B, H_q, N_q, D_v), lse (B, H_q, N_q))`` of ``p`` block by block, with the
    dropout pattern :func:`_kept` draws (what the operator runs when ``dropout_p > 0``)."""
    q, k, v = _qkv(p)
    out = q.new_empty(p.batch, p.heads_q, p.n_q, p.d_v)
    lse = q.new_empty(p.batch, p.heads_q, p.n_q)
    for (q0, q1), keep in zip(_row_blocks(p), _kept(p, seed), strict=True):
        x, _ = _logits(p, q[:, :, q0:q1], k, q0, q1)              # (B, H_q, rows, N_k)
        w, block_lse = safe_softmax(x)
        lse[:, :, q0:q1] = block_lse
        if keep is not None:
            w = torch.where(keep, w / (1.0 - p.dropout_p), torch.zeros_like(w))
        out[:, :, q0:q1] = w @ v
    return out.to(p.dtype), lse


def _closed_form_grads(p: Problem, out: Tensor, lse: Tensor, dout: Tensor,
                       dlse: Tensor | None, need_bias: bool, seed: Tensor | None,
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """The gradients ``(dq, dk, dv, dbias)`` of ``(out, lse)`` from the saved ``out`` and
    ``lse`` (Problem layout; ``dbias (B, H_q, N_q, N_k)`` in the compute dtype, or None)."""
    cdt = compute_dtype(p.dtype)
    q, k, v = _qkv(p)
    dout = dout.to(cdt)
    delta = (dout * out.to(cdt)).sum(-1)                          # (B, H_q, N_q)
    if dlse is not None:
        delta = delta - dlse.to(cdt)
    lse = lse.to(cdt)
    empty = lse == -math.inf                       # no key: P = 0 (and its q row unused)
    lse = torch.where(empty, torch.full_like(lse, math.inf), lse)
    q = torch.where(empty[..., None], torch.zeros_like(q), q)    # padded NaN rows stay out
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dbias = q.new_zeros(p.batch, p.heads_q, p.n_q, p.n_k) if need_bias else None
    for (q0, q1), keep in zip(_row_blocks(p), _kept(p, seed), strict=True):
        x, capped = _logits(p, q[:, :, q0:q1], k, q0, q1)          # (B, H_q, rows, N_k)
        w = torch.exp(x - lse[:, :, q0:q1, None])                  # P
        do = dout[:, :, q0:q1]                                     # (B, H_q, rows, D_v)
        dp = do @ v.transpose(-1, -2)
        if keep is not None:                                       # out = (P∘Z/(1−p))·V
            w_kept = torch.where(keep, w / (1.0 - p.dropout_p), torch.zeros_like(w))
            dv += w_kept.transpose(-1, -2) @ do
            dp = torch.where(keep, dp / (1.0 - p.dropout_p), torch.zeros_like(dp))
        else:
            dv += w.transpose(-1, -2) @ do
        ds = w * (dp - delta[:, :, q0:q1, None])                   # d loss / d logits
        if dbias is not None:
            dbias[:, :, q0:q1] = ds
        ds = _score_grad(p, ds, capped)
        dq[:, :, q0:q1] = ds @ k
        dk += ds.transpose(-1, -2) @ q[:, :, q0:q1]
    return (dq.to(p.dtype), _per_kv_head(dk, p).to(p.dtype), _per_kv_head(dv, p).to(p.dtype),
            dbias)


# ------------------------------------------------------------------ the operator
def _eager(q: Tensor, k: Tensor, v: Tensor, tensor_mask: Tensor | None, bands: list[float],
           kv_lengths: Tensor | None, q_lengths: Tensor | None, doc_ids: Tensor | None,
           doc_kv_ids: Tensor | None, scale: float | None, softcap: float | None,
           backend: str) -> tuple[Tensor, Tensor]:
    """The eager :func:`attnkit.attention` (``return_lse=True``) of the operator's arguments
    (no dropout): validation, NaN screens and the backend's choice as eager."""

    mask = tensor_mask if tensor_mask is not None else \
        rebuild_mask(bands, kv_lengths, q_lengths, doc_ids, doc_kv_ids)
    return attend(q, k, v, mask=mask, scale=scale, softcap=softcap, backend=backend,
                  return_lse=True)


def _without_rows(p: Problem, bad: Tensor) -> Problem:
    """``p`` with the K/V rows ``bad`` ``(B, H_kv, N_k)`` set to zero."""
    zero = torch.zeros((), dtype=p.dtype, device=p.device)
    return dataclasses.replace(p, k=torch.where(bad[..., None], zero, p.k),
                               v=torch.where(bad[..., None], zero, p.v))


def _dropout_forward(q: Tensor, k: Tensor, v: Tensor, tensor_mask: Tensor | None,
                     bands: list[float], kv_lengths: Tensor | None, q_lengths: Tensor | None,
                     doc_ids: Tensor | None, doc_kv_ids: Tensor | None, scale: float | None,
                     softcap: float | None, dropout_p: float, seed: Tensor | None,
                     ) -> tuple[Tensor, Tensor]:
    """The operator's forward with dropout: the closed form with the pattern the backward
    redraws; NaN/inf K/V rows screened as the eager call screens them."""

    prep = _prepared(q, k, v, tensor_mask, bands, kv_lengths, q_lengths, doc_ids, doc_kv_ids,
                     scale, softcap, dropout_p)
    p = prep.problem
    if _is_empty(p):
        out, lse = _empty_result(p)
    else:
        bad = _non_finite_kv_rows(p)                              # (B, H_kv, N_k) or None
        out, lse = _closed_form_forward(p if bad is None else _without_rows(p, bad), seed)
        if bad is not None:
            hit = _attends_to(p, bad)                             # (B, H_q, N_q)
            out = torch.where(hit[..., None], torch.full_like(out, math.nan), out)
            lse = torch.where(hit, torch.full_like(lse, math.nan), lse)
    return prep.restore(out), prep.restore(lse)


@torch.library.custom_op("attnkit::attention", mutates_args=())
def attention_op(q: Tensor, k: Tensor, v: Tensor, tensor_mask: Tensor | None,
                 bands: list[float], kv_lengths: Tensor | None, q_lengths: Tensor | None,
                 doc_ids: Tensor | None, doc_kv_ids: Tensor | None, scale: float | None,
                 softcap: float | None, dropout_p: float, seed: Tensor | None,
                 backend: str) -> tuple[Tensor, Tensor]:
    """:func:`attnkit.attention` (``return_lse=True``) as one operator."""
    if dropout_p > 0.0:
        out, lse = _dropout_forward(q, k, v, tensor_mask, bands, kv_lengths, q_lengths,
                                    doc_ids, doc_kv_ids, scale, softcap, dropout_p, seed)
    else:
        out, lse = _eager(q, k, v, tensor_mask, bands, kv_lengths, q_lengths, doc_ids,
                          doc_kv_ids, scale, softcap, backend)
    return out.contiguous(), lse.contiguous()        # the layout the fake promises


@attention_op.register_fake
def _attention_fake(q: Tensor, k: Tensor, v: Tensor, tensor_mask: Tensor | None,
                    bands: list[float], kv_lengths: Tensor | None, q_lengths: Tensor | None,
                    doc_ids: Tensor | None, doc_kv_ids: Tensor | None, scale: float | None,
                    softcap: float | None, dropout_p: float, seed: Tensor | None,
                    backend: str) -> tuple[Tensor, Tensor]:

    check_inputs(q, k, v)               # shape / dtype / device errors at trace time
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))                 # (..., H_q, N_q, D_v)
    lse = q.new_empty(q.shape[:-1], dtype=compute_dtype(q.dtype))   # (..., H_q, N_q)
    return out, lse


def _on_native_kernel(p: Problem, backend: str) -> bool:
    """Whether the eager call of ``p`` would run on the native kernel (the engine that
    ``backend`` picks is ``tiled`` or ``decode``, and they would hand ``p`` to it), so its
    backward fits the forward; decided at run time, as the eager call decides."""
    from .backends import select
    from .backends.tiled import native_reasons

    if p.dropout_p > 0.0 or not p.q.is_cpu or p.d_k == 0 or p.d_v == 0:
        return False
    return select(p, backend).name in ("tiled", "decode") and not native_reasons(p)


def _problem_grads(p: Problem, out: Tensor, lse: Tensor, dout: Tensor, dlse: Tensor | None,
                   need_bias: bool, seed: Tensor | None, backend: str,
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """``(dq, dk, dv, dbias)`` of one call in the Problem layout, from its saved output and
    LSE: the native kernel's own backward where the call runs on it, else the closed form.
    NaN/inf K/V rows are screened as the eager call's forward screens them (zeroed; the
    queries that see them had NaN outputs, which pass no gradient)."""
    from .backends import native

    if _is_empty(p):
        zeros = tuple(torch.zeros_like(t) for t in (p.q, p.k, p.v))
        dbias = p.q.new_zeros(p.batch, p.heads_q, p.n_q, p.n_k) if need_bias else None
        return (*zeros, dbias)  # type: ignore[return-value]
    bad = _non_finite_kv_rows(p)                                  # (B, H_kv, N_k) or None
    has_bad = bad is not None
    if has_bad:
        hit = _attends_to(p, bad)                                 # (B, H_q, N_q)
        p = _without_rows(p, bad)
        out = torch.where(hit[..., None], torch.zeros_like(out), out)
        dout = torch.where(hit[..., None], torch.zeros_like(dout), dout)
        lse = torch.where(hit, torch.full_like(lse, math.inf), lse)   # P = 0 in those rows
        if dlse is not None:
            dlse = torch.where(hit, torch.zeros_like(dlse), dlse)
    if _on_native_kernel(p, backend):
        dq, dk, dv, dbias = native.backward_problem(p, out, lse, dout, dlse,
                                                    bias_grad=need_bias)
    else:
        dq, dk, dv, dbias = _closed_form_grads(p, out, lse, dout, dlse, need_bias, seed)
    if has_bad:
        dk = torch.where(bad[..., None], torch.zeros_like(dk), dk)
        dv = torch.where(bad[..., None], torch.zeros_like(dv), dv)
    return dq, dk, dv, dbias


@torch.library.custom_op("attnkit::attention_backward", mutates_args=())
def attention_backward_op(grad_out: Tensor | None, grad_lse: Tensor | None, q: Tensor,
                          k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                          tensor_mask: Tensor | None, bands: list[float],
                          kv_lengths: Tensor | None, q_lengths: Tensor | None,
                          doc_ids: Tensor | None, doc_kv_ids: Tensor | None,
                          scale: float | None, softcap: float | None, dropout_p: float,
                          seed: Tensor | None, backend: str, needs: list[bool],
                          ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of :func:`attention_op` for q, k, v and a float ``tensor_mask``, from the
    forward's saved ``out`` and ``lse`` (no forward is recomputed): the native kernel's
    backward where the call runs on it, else the closed form from the LSE. The mask's
    gradient is an empty tensor unless ``needs[3]``."""
    prep = _prepared(q, k, v, tensor_mask, bands, kv_lengths, q_lengths, doc_ids, doc_kv_ids,
                     scale, softcap, dropout_p)
    p = prep.problem
    need_mask = bool(needs[3]) and tensor_mask is not None \
        and tensor_mask.dtype.is_floating_point
    if need_mask:
        p = _with_zero_bias(p)
    rows = (p.batch, p.heads_q, p.n_q)
    out4, lse4 = out.reshape(*rows, p.d_v), lse.reshape(rows)   # (B, H_q, N_q, D_v), (…)
    dout4 = out4.new_zeros(out4.shape) if grad_out is None else grad_out.reshape(out4.shape)
    dlse4 = None if grad_lse is None else grad_lse.reshape(rows)
    dq, dk, dv, dbias = _problem_grads(p, out4, lse4, dout4, dlse4, need_mask, seed, backend)
    dmask = q.new_empty(0) if dbias is None else _in_user_layout(dbias, tensor_mask, q)
    return (dq.reshape(q.shape).to(q.dtype).contiguous(), _in_user_layout(dk, k, q),
            _in_user_layout(dv, v, q), dmask)


@attention_backward_op.register_fake
def _attention_backward_fake(grad_out: Tensor | None, grad_lse: Tensor | None, q: Tensor,
                             k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                             tensor_mask: Tensor | None, bands: list[float],
                             kv_lengths: Tensor | None, q_lengths: Tensor | None,
                             doc_ids: Tensor | None, doc_kv_ids: Tensor | None,
                             scale: float | None, softcap: float | None, dropout_p: float,
                             seed: Tensor | None, backend: str, needs: list[bool],
                             ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dm = (tensor_mask.new_empty(tensor_mask.shape) if tensor_mask is not None and needs[3]
          and tensor_mask.dtype.is_floating_point else q.new_empty(0))  # contiguous, as real
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dm


_N_ARGS = 14          # attention_op's inputs


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    (q, k, v, tensor_mask, bands, kv_lengths, q_lengths, doc_ids, doc_kv_ids, scale, softcap,
     dropout_p, seed, backend) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, tensor_mask, kv_lengths, q_lengths, doc_ids,
                          doc_kv_ids, seed)
    ctx.options = (bands, scale, softcap, dropout_p, backend)


def _backward(ctx: Any, grad_out: Tensor | None, grad_lse: Tensor | None) -> tuple[Any, ...]:
    (q, k, v, out, lse, tensor_mask, kv_lengths, q_lengths, doc_ids, doc_kv_ids,
     seed) = ctx.saved_tensors
    bands, scale, softcap, dropout_p, backend = ctx.options
    needs = [bool(n) for n in ctx.needs_input_grad[:4]]
    if tensor_mask is None or not tensor_mask.dtype.is_floating_point:
        needs[3] = False
    dq, dk, dv, dm = attention_backward_op(
        grad_out, grad_lse, q, k, v, out, lse, tensor_mask, bands, kv_lengths, q_lengths,
        doc_ids, doc_kv_ids, scale, softcap, dropout_p, seed, backend, needs)
    grads = [dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None,
             dm if needs[3] else None]
    return (*grads, *([None] * (_N_ARGS - 4)))


attention_op.register_autograd(_backward, setup_context=_setup_context)


@run_outside_graph
def eager_fallback(q: Any, k: Any, v: Any, **options: Any) -> Any:
    """The plain eager :func:`attnkit.attention`, run outside any graph being traced."""
    return attend(q, k, v, **options)


def eager_in_torch(q: Any, k: Any, v: Any, *, differentiable: bool = False,
                   **options: Any) -> Any:
    """The eager :func:`attnkit.attention` in plain torch operators (the native kernel off):
    what a dispatch mode or a torch.func transform can follow, for a call the operator cannot
    carry (a Python score_mod …). ``differentiable``: on the reference engine (the formula
    materialised, O(N_q·N_k) memory), whose backward is torch's own — what torch.func.grad /
    jvp differentiate (the other engines' backward is an autograd.Function, which they
    reject)."""
    from .backends.native import use_native

    if differentiable:
        options["backend"] = "reference"
    with use_native(False):
        return attend(q, k, v, **options)


# ------------------------------------------------------------------ the attention weights
def _weights_shape(q: Tensor, k: Tensor) -> tuple[int, ...]:
    """The reference's weights layout ``(B, H_q, N_q, N_k)``: q's leading dims flattened."""
    b = math.prod(q.shape[:-3]) if q.dim() > 3 else 1
    return (b, q.shape[-3] if q.dim() > 2 else 1, q.shape[-2], k.shape[-2])


def _eager_weights(q: Tensor, k: Tensor, v: Tensor, **options: Any) -> Tensor:
    """The weights ``(B, H_q, N_q, N_k)`` of an :func:`attnkit.attention` call by the
    reference (dropout excluded), in q's dtype."""
    from .reference import reference

    return reference(prepare(q, k, v, **options).problem).weights.to(q.dtype)


def _op_weights(q: Tensor, k: Tensor, tensor_mask: Tensor | None, bands: list[float],
                kv_lengths: Tensor | None, q_lengths: Tensor | None, doc_ids: Tensor | None,
                doc_kv_ids: Tensor | None, scale: float | None, softcap: float | None,
                ) -> Tensor:
    mask = tensor_mask if tensor_mask is not None else \
        rebuild_mask(bands, kv_lengths, q_lengths, doc_ids, doc_kv_ids)
    # the weights do not read V: K stands in for it (same keys, so the same checks pass)
    return _eager_weights(q, k, k, mask=mask, scale=scale, softcap=softcap)


def _closed_form_weight_grads(p: Problem, grad_weights: Tensor, need_bias: bool,
                              ) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(dq, dk, dbias)`` of the weights ``(B, H_q, N_q, N_k)`` (Problem layout; ``dbias``
    ``(B, H_q, N_q, N_k)`` in the compute dtype, or None), block by block."""
    q, k, _ = _qkv(p)
    dq, dk = torch.empty_like(q), torch.zeros_like(k)
    dbias = q.new_zeros(p.batch, p.heads_q, p.n_q, p.n_k) if need_bias else None
    for q0, q1 in _row_blocks(p):
        x, capped = _logits(p, q[:, :, q0:q1], k, q0, q1)          # (B, H_q, rows, N_k)
        w, _ = safe_softmax(x)                                     # W (0 in an empty row)
        dw = grad_weights[:, :, q0:q1].to(q.dtype)
        ds = w * (dw - (dw * w).sum(-1, keepdim=True))             # d loss / d logits
        if dbias is not None:
            dbias[:, :, q0:q1] = ds
        ds = _score_grad(p, ds, capped)
        idle = (x == -math.inf).all(-1, keepdim=True)              # no key: row unused
        q_rows = torch.where(idle, torch.zeros_like(q[:, :, q0:q1]), q[:, :, q0:q1])
        dq[:, :, q0:q1] = ds @ k
        dk += ds.transpose(-1, -2) @ q_rows
    return dq.to(p.dtype), _per_kv_head(dk, p).to(p.dtype), dbias


@torch.library.custom_op("attnkit::attention_weights", mutates_args=())
def attention_weights_op(q: Tensor, k: Tensor, tensor_mask: Tensor | None, bands: list[float],
                         kv_lengths: Tensor | None, q_lengths: Tensor | None,
                         doc_ids: Tensor | None, doc_kv_ids: Tensor | None,
                         scale: float | None, softcap: float | None) -> Tensor:
    """:func:`attention_weights` (the eager reference's softmax) as one operator."""
    return _op_weights(q, k, tensor_mask, bands, kv_lengths, q_lengths, doc_ids, doc_kv_ids,
                       scale, softcap).contiguous()


@attention_weights_op.register_fake
def _attention_weights_fake(q: Tensor, k: Tensor, tensor_mask: Tensor | None,
                            bands: list[float], kv_lengths: Tensor | None,
                            q_lengths: Tensor | None, doc_ids: Tensor | None,
                            doc_kv_ids: Tensor | None, scale: float | None,
                            softcap: float | None) -> Tensor:

    check_inputs(q, k, k)
    return q.new_empty(_weights_shape(q, k))                       # (B, H_q, N_q, N_k)


@torch.library.custom_op("attnkit::attention_weights_backward", mutates_args=())
def attention_weights_backward_op(grad_weights: Tensor, q: Tensor, k: Tensor,
                                  tensor_mask: Tensor | None, bands: list[float],
                                  kv_lengths: Tensor | None, q_lengths: Tensor | None,
                                  doc_ids: Tensor | None, doc_kv_ids: Tensor | None,
                                  scale: float | None, softcap: float | None,
                                  needs: list[bool]) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`attention_weights_op` for q, k and a float ``tensor_mask``, in
    closed form (``dS = W ∘ (dW − rowsum(dW ∘ W))``, the weights rebuilt block by block from
    the scores; no autograd). The mask's gradient is an empty tensor unless ``needs[2]``."""
    p = _prepared(q, k, k, tensor_mask, bands, kv_lengths, q_lengths, doc_ids, doc_kv_ids,
                  scale, softcap).problem
    need_mask = bool(needs[2]) and tensor_mask is not None \
        and tensor_mask.dtype.is_floating_point
    if need_mask:
        p = _with_zero_bias(p)
    dq, dk, dbias = _closed_form_weight_grads(p, grad_weights, need_mask)
    dmask = q.new_empty(0) if dbias is None else _in_user_layout(dbias, tensor_mask, q)
    return dq.reshape(q.shape).to(q.dtype).contiguous(), _in_user_layout(dk, k, q), dmask


@attention_weights_backward_op.register_fake
def _attention_weights_backward_fake(grad_weights: Tensor, q: Tensor, k: Tensor,
                                     tensor_mask: Tensor | None, bands: list[float],
                                     kv_lengths: Tensor | None, q_lengths: Tensor | None,
                                     doc_ids: Tensor | None, doc_kv_ids: Tensor | None,
                                     scale: float | None, softcap: float | None,
                                     needs: list[bool]) -> tuple[Tensor, Tensor, Tensor]:
    dm = (tensor_mask.new_empty(tensor_mask.shape) if tensor_mask is not None and needs[2]
          else q.new_empty(0))
    return q.new_empty(q.shape), k.new_empty(k.shape), dm


_N_WEIGHT_ARGS = 10   # attention_weights_op's inputs


def _weights_setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    (q, k, tensor_mask, bands, kv_lengths, q_lengths, doc_ids, doc_kv_ids, scale,
     softcap) = inputs
    ctx.save_for_backward(q, k, tensor_mask, kv_lengths, q_lengths, doc_ids, doc_kv_ids)
    ctx.options = (bands, scale, softcap)


def _weights_backward(ctx: Any, grad_weights: Tensor) -> tuple[Any, ...]:
    q, k, tensor_mask, kv_lengths, q_lengths, doc_ids, doc_kv_ids = ctx.saved_tensors
    bands, scale, softcap = ctx.options
    needs = [bool(n) for n in ctx.needs_input_grad[:3]]
    if tensor_mask is None or not tensor_mask.dtype.is_floating_point:
        needs[2] = False
    dq, dk, dm = attention_weights_backward_op(
        grad_weights, q, k, tensor_mask, bands, kv_lengths, q_lengths, doc_ids, doc_kv_ids,
        scale, softcap, needs)
    grads = [dq if needs[0] else None, dk if needs[1] else None, dm if needs[2] else None]
    return (*grads, *([None] * (_N_WEIGHT_ARGS - 3)))


attention_weights_op.register_autograd(_weights_backward, setup_context=_weights_setup_context)


@run_outside_graph
def _eager_weights_outside(q: Tensor, k: Tensor, v: Tensor, **options: Any) -> Tensor:
    """:func:`_eager_weights` run outside any graph being traced."""
    return _eager_weights(q, k, v, **options)


def attention_weights(q: Tensor, k: Tensor, v: Tensor, *, mask: Any = None,
                      is_causal: bool = False, scale: float | None = None,
                      softcap: float | None = None) -> Tensor:
    """The attention weights ``(B, H_q, N_q, N_k)`` of an :func:`attnkit.attention` call with
    the same options (dropout excluded: the softmax before it), computed by the reference
    (O(N_q·N_k) memory). While torch.compile / torch.export trace, one
    ``attnkit::attention_weights`` node (``fullgraph=True`` holds), or — for a mask an
    operator argument cannot carry — the eager call outside the graph, with one warning
    per call site. Inside ``torch.autocast``, computed as :func:`attnkit.attention` is
    (inputs cast to the region's dtype, autocast off)."""
    options = dict(mask=mask, is_causal=is_causal, scale=scale, softcap=softcap)
    if not torch.compiler.is_compiling():
        cast_to = autocast_dtype(q)
        if cast_to is not None:                    # torch.autocast: as attention() runs
            with torch.autocast(q.device.type, enabled=False):
                return attention_weights(*(autocast_cast(t, cast_to) for t in (q, k, v)),
                                         **{**options, "mask": autocast_cast(mask, cast_to)})
        return _eager_weights(q, k, v, **options)
    reason: str | None = None
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        reason = "NumPy inputs"
    elif is_causal and mask is not None:
        reason = "mask together with is_causal (an error, raised by the eager call)"
    else:
        args = op_args(_masks.causal() if is_causal else mask, q.shape[-2], k.shape[-2])
        if isinstance(args, str):
            reason = args
    if reason is not None:
        warnings.warn(
            f"attnkit attention weights under torch.compile/export: {reason} cannot be an "
            "operator argument, so the weights are computed eagerly outside the graph (a "
            "graph break; fullgraph=True fails). Use the mask builders causal / "
            "sliding_window / padding / document (and &) or a mask tensor to stay in the "
            "graph", UserWarning, stacklevel=2)
        return _eager_weights_outside(q, k, v, **options)
    return attention_weights_op(q, k, args.tensor, args.bands, args.kv_lengths,
                                args.q_lengths, args.doc_ids, args.doc_kv_ids, scale, softcap)


# ------------------------------------------------------------------ torch.autocast
# torch lists SDPA among autocast's lower-precision ops (CPU and CUDA): in an autocast region
# it casts q, k, v and a float mask — float64 excepted — to the region's dtype and runs with
# autocast off. attention() does the same eagerly, and these rules do it for the operators
# in a graph (torch.library.register_autocast casts to one fixed dtype, but a CPU region may
# be bfloat16 or float16). The backward operators cast nothing: they only run with autocast
# off, so that no matmul inside an implementation is autocast.
# Whether autocast is on for any device: one call without arguments, ahead of the per-device
# question (whose device-string argument parsing is the dearer part on the per-token path).
any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def autocast_dtype(q: Any) -> torch.dtype | None:
    """The dtype ``torch.autocast`` runs torch's SDPA in for a call with query ``q``: the
    region's dtype while autocast is on for q's device, else None (off, NumPy inputs, a
    device other than CPU or CUDA)."""
    if not any_autocast() or not isinstance(q, torch.Tensor):
        return None
    device = "cpu" if q.is_cpu else "cuda" if q.is_cuda else None
    if device is None or not torch.is_autocast_enabled(device):
        return None
    return torch.get_autocast_dtype(device)


def autocast_cast(t: Any, dtype: torch.dtype) -> Any:
    """``t`` as autocast casts a lower-precision op's inputs: a floating-point tensor other
    than float64 becomes ``dtype``; anything else (float64, bool or integer tensors, a Mask,
    None) is returned unchanged."""
    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype is not torch.float64:
        return t.to(dtype)
    return t


def _autocast_rule(name: str, device: str, n_cast: int) -> Any:
    """The autocast kernel of ``attnkit::<name>`` on ``device``: its first ``n_cast``
    arguments cast by :func:`autocast_cast`, the operator run with autocast off."""
    op = getattr(torch.ops.attnkit, name).default

    def kernel(*args: Any) -> Any:
        dtype = torch.get_autocast_dtype(device)
        args = tuple(autocast_cast(a, dtype) if i < n_cast else a for i, a in enumerate(args))
        with torch.autocast(device, enabled=False):
            return op(*args)

    return kernel


_AUTOCAST_LIB = torch.library.Library("attnkit", "IMPL")
for _name, _n_cast in (("attention", 4), ("attention_backward", 0),      # q, k, v, mask
                       ("attention_weights", 3), ("attention_weights_backward", 0)):
    for _device, _key in (("cpu", "AutocastCPU"), ("cuda", "AutocastCUDA")):
        _AUTOCAST_LIB.impl(_name, _autocast_rule(_name, _device, _n_cast), _key)
