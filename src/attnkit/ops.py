"""``attention()`` as a torch custom operator, for ``torch.compile`` and ``torch.export``.

    torch.ops.attnkit.attention(q, k, v, tensor_mask, bands, kv_lengths, q_lengths,
                                doc_ids, doc_kv_ids, scale, softcap, dropout_p, seed,
                                backend) -> (out, lse)
    torch.ops.attnkit.attention_backward(grad_out, grad_lse, <the same inputs>, needs)
                                -> (dq, dk, dv, dmask)
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
    kv_lengths, q_lengths (B,)    padding term        doc_ids (B|1, N_q), doc_kv_ids (B|1, N_k)

To a tracer (Dynamo, AOTAutograd, export) the call is one opaque node with a fake-tensor
implementation (output shapes only) and an autograd formula whose backward is a second
operator. The real implementations call the eager :func:`attnkit.attention` with the mask
rebuilt from its builders' arguments, so a compiled call computes exactly what the eager
call computes (validation, NaN screens and backend choice included, at run time).

:func:`attnkit.attention` routes here only while ``torch.compiler.is_compiling()`` (compile
and export); an eager call never touches the operator, so it costs eager calls nothing.
The same holds for :func:`attention_weights` (what ``need_weights=True`` and
``output_attentions=True`` return): eager, the reference's softmax; traced, one
``attnkit::attention_weights`` node whose implementation is that same eager call.

Caution
-------
- What an operator argument cannot carry (for the weights too): a Python ``score_mod``
  (also ``scores.alibi`` / ``relative_bias``), ``from_fn`` masks, masks combined with ``|``
  or ``~`` (``prefix_lm`` too), a ``from_tensor`` Mask object (pass the bool tensor itself
  as ``mask=``), band masks other than ``causal`` / ``sliding_window`` / ``full``, more
  than one padding or document term, and NumPy inputs. Such a call runs the plain eager
  path outside the graph (a graph break: ``fullgraph=True`` raises), with one warning per
  call site.
- The backward recomputes the forward with autograd (one more forward per backward) and
  gives first derivatives only.
- Dropout in a compiled call draws a seed in the graph; forward and backward use the same
  pattern, but it differs from the pattern an eager call draws from the same global seed.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from . import masks as _masks
from .backends.base import compute_dtype

__all__ = ["OpArgs", "op_args", "rebuild_mask", "attention_op", "attention_backward_op",
           "eager_fallback", "attention_weights", "attention_weights_op",
           "attention_weights_backward_op"]

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
    for term in mask.conjuncts():
        spec = term.spec
        if isinstance(spec, _masks.Band) and _band_mask(spec.lo, spec.hi,
                                                        spec.bottom_right) is not None:
            a.bands += [float(spec.lo), float(spec.hi), float(spec.bottom_right)]
        elif isinstance(spec, _masks.Lengths) and a.kv_lengths is None:
            a.kv_lengths, a.q_lengths = _masks.lengths_of(term)
        elif isinstance(spec, _masks.Documents) and a.doc_ids is None \
                and _masks.documents_of(term, n_q, n_k) is not None:
            a.doc_ids, a.doc_kv_ids = _masks.documents_of(term, n_q, n_k)
        else:
            return (f"mask term {term.name} has no builder arguments an operator can carry "
                    "(from_fn, |, ~, prefix_lm, a from_tensor Mask, or a second padding / "
                    "document term)")
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


@contextlib.contextmanager
def _seeded(seed: Tensor | None, device: torch.device) -> Iterator[None]:
    """Run with the global generator of ``device`` seeded from ``seed`` (then restored)."""
    if seed is None:
        yield
        return
    s = int(seed.item())
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else [], device_type=device.type):
        if cuda:
            torch.cuda.manual_seed(s)
        else:
            torch.default_generator.manual_seed(s)
        yield


def _autograd_dispatch() -> Any:
    """Autograd back on inside an operator's implementation, which torch runs below the
    autograd dispatch keys: the backward operator differentiates the eager call."""
    ex = torch._C._dispatch_tls_local_exclude_set()
    for name in ("AutogradOther", "AutogradNestedTensor", "AutogradFunctionality",
                 "ADInplaceOrView"):
        key = getattr(torch._C.DispatchKey, name, None)
        if key is not None:
            ex = ex.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), ex)


def _eager(q: Tensor, k: Tensor, v: Tensor, tensor_mask: Tensor | None, bands: list[float],
           kv_lengths: Tensor | None, q_lengths: Tensor | None, doc_ids: Tensor | None,
           doc_kv_ids: Tensor | None, scale: float | None, softcap: float | None,
           dropout_p: float, seed: Tensor | None, backend: str) -> tuple[Tensor, Tensor]:
    from .api import attention  # api imports this module

    mask = tensor_mask if tensor_mask is not None else \
        rebuild_mask(bands, kv_lengths, q_lengths, doc_ids, doc_kv_ids)
    with _seeded(seed, q.device):
        return attention(q, k, v, mask=mask, scale=scale, softcap=softcap,
                         dropout_p=dropout_p, backend=backend, return_lse=True)


@torch.library.custom_op("attnkit::attention", mutates_args=())
def attention_op(q: Tensor, k: Tensor, v: Tensor, tensor_mask: Tensor | None,
                 bands: list[float], kv_lengths: Tensor | None, q_lengths: Tensor | None,
                 doc_ids: Tensor | None, doc_kv_ids: Tensor | None, scale: float | None,
                 softcap: float | None, dropout_p: float, seed: Tensor | None,
                 backend: str) -> tuple[Tensor, Tensor]:
    """:func:`attnkit.attention` (``return_lse=True``) as one operator."""
    out, lse = _eager(q, k, v, tensor_mask, bands, kv_lengths, q_lengths, doc_ids,
                      doc_kv_ids, scale, softcap, dropout_p, seed, backend)
    return out.contiguous(), lse.contiguous()        # the layout the fake promises


@attention_op.register_fake
def _attention_fake(q: Tensor, k: Tensor, v: Tensor, tensor_mask: Tensor | None,
                    bands: list[float], kv_lengths: Tensor | None, q_lengths: Tensor | None,
                    doc_ids: Tensor | None, doc_kv_ids: Tensor | None, scale: float | None,
                    softcap: float | None, dropout_p: float, seed: Tensor | None,
                    backend: str) -> tuple[Tensor, Tensor]:
    from .api import check_inputs

    check_inputs(q, k, v)               # shape / dtype / device errors at trace time
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))                 # (..., H_q, N_q, D_v)
    lse = q.new_empty(q.shape[:-1], dtype=compute_dtype(q.dtype))   # (..., H_q, N_q)
    return out, lse


@torch.library.custom_op("attnkit::attention_backward", mutates_args=())
def attention_backward_op(grad_out: Tensor, grad_lse: Tensor | None, q: Tensor, k: Tensor,
                          v: Tensor, tensor_mask: Tensor | None, bands: list[float],
                          kv_lengths: Tensor | None, q_lengths: Tensor | None,
                          doc_ids: Tensor | None, doc_kv_ids: Tensor | None,
                          scale: float | None, softcap: float | None, dropout_p: float,
                          seed: Tensor | None, backend: str, needs: list[bool],
                          ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of :func:`attention_op` for q, k, v and a float ``tensor_mask``: the eager
    attention recomputed with autograd (the backends' own backward). A gradient that is not
    needed comes back as zeros (an empty tensor for the mask)."""
    with torch.enable_grad(), _autograd_dispatch():
        ins = [t.detach().requires_grad_(n) if t is not None else None
               for t, n in zip((q, k, v, tensor_mask), needs, strict=True)]
        out, lse = _eager(*ins, bands, kv_lengths, q_lengths, doc_ids, doc_kv_ids, scale,
                          softcap, dropout_p, seed, backend)
        outs, grads = [out], [grad_out]
        if grad_lse is not None:
            outs.append(lse)
            grads.append(grad_lse)
        wanted = [t for t in ins if t is not None and t.requires_grad]
        got = iter(torch.autograd.grad(outs, wanted, grads, allow_unused=True)
                   if wanted else [])
    res = []
    for t, like in zip(ins, (q, k, v), strict=False):
        g = next(got) if t.requires_grad else None
        res.append(like.new_zeros(like.shape) if g is None else g.contiguous())
    dm = next(got, None) if ins[3] is not None and ins[3].requires_grad else None
    res.append(q.new_empty(0) if dm is None else dm.contiguous())
    return tuple(res)  # type: ignore[return-value]


@attention_backward_op.register_fake
def _attention_backward_fake(grad_out: Tensor, grad_lse: Tensor | None, q: Tensor, k: Tensor,
                             v: Tensor, tensor_mask: Tensor | None, bands: list[float],
                             kv_lengths: Tensor | None, q_lengths: Tensor | None,
                             doc_ids: Tensor | None, doc_kv_ids: Tensor | None,
                             scale: float | None, softcap: float | None, dropout_p: float,
                             seed: Tensor | None, backend: str, needs: list[bool],
                             ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dm = (tensor_mask.new_empty(tensor_mask.shape) if tensor_mask is not None and needs[3]
          else q.new_empty(0))                                      # contiguous, as the real
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dm


_N_ARGS = 14          # attention_op's inputs


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    (q, k, v, tensor_mask, bands, kv_lengths, q_lengths, doc_ids, doc_kv_ids, scale, softcap,
     dropout_p, seed, backend) = inputs
    ctx.save_for_backward(q, k, v, tensor_mask, kv_lengths, q_lengths, doc_ids, doc_kv_ids,
                          seed)
    ctx.options = (bands, scale, softcap, dropout_p, backend)


def _backward(ctx: Any, grad_out: Tensor, grad_lse: Tensor | None) -> tuple[Any, ...]:
    q, k, v, tensor_mask, kv_lengths, q_lengths, doc_ids, doc_kv_ids, seed = ctx.saved_tensors
    bands, scale, softcap, dropout_p, backend = ctx.options
    needs = [bool(n) for n in ctx.needs_input_grad[:4]]
    if tensor_mask is None or not tensor_mask.dtype.is_floating_point:
        needs[3] = False
    dq, dk, dv, dm = attention_backward_op(
        grad_out, grad_lse, q, k, v, tensor_mask, bands, kv_lengths, q_lengths, doc_ids,
        doc_kv_ids, scale, softcap, dropout_p, seed, backend, needs)
    grads = [dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None,
             dm if needs[3] else None]
    return (*grads, *([None] * (_N_ARGS - 4)))


attention_op.register_autograd(_backward, setup_context=_setup_context)


@torch.compiler.disable
def eager_fallback(q: Any, k: Any, v: Any, **options: Any) -> Any:
    """The plain eager :func:`attnkit.attention`, run outside any graph being traced."""
    from .api import attention

    return attention(q, k, v, **options)


# ------------------------------------------------------------------ the attention weights
def _weights_shape(q: Tensor, k: Tensor) -> tuple[int, ...]:
    """The reference's weights layout ``(B, H_q, N_q, N_k)``: q's leading dims flattened."""
    b = math.prod(q.shape[:-3]) if q.dim() > 3 else 1
    return (b, q.shape[-3] if q.dim() > 2 else 1, q.shape[-2], k.shape[-2])


def _eager_weights(q: Tensor, k: Tensor, v: Tensor, **options: Any) -> Tensor:
    """The weights ``(B, H_q, N_q, N_k)`` of an :func:`attnkit.attention` call by the
    reference (dropout excluded), in q's dtype."""
    from .api import prepare  # api imports this module
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
    from .api import check_inputs

    check_inputs(q, k, k)
    return q.new_empty(_weights_shape(q, k))                       # (B, H_q, N_q, N_k)


@torch.library.custom_op("attnkit::attention_weights_backward", mutates_args=())
def attention_weights_backward_op(grad_weights: Tensor, q: Tensor, k: Tensor,
                                  tensor_mask: Tensor | None, bands: list[float],
                                  kv_lengths: Tensor | None, q_lengths: Tensor | None,
                                  doc_ids: Tensor | None, doc_kv_ids: Tensor | None,
                                  scale: float | None, softcap: float | None,
                                  needs: list[bool]) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`attention_weights_op` for q, k and a float ``tensor_mask``: the
    eager weights recomputed with autograd. One not needed comes back as zeros (an empty
    tensor for the mask)."""
    with torch.enable_grad(), _autograd_dispatch():
        ins = [t.detach().requires_grad_(n) if t is not None else None
               for t, n in zip((q, k, tensor_mask), needs, strict=True)]
        w = _op_weights(*ins, bands, kv_lengths, q_lengths, doc_ids, doc_kv_ids, scale,
                        softcap)
        wanted = [t for t in ins if t is not None and t.requires_grad]
        got = iter(torch.autograd.grad([w], wanted, [grad_weights], allow_unused=True)
                   if wanted else [])
    res = []
    for t, like in zip(ins, (q, k), strict=False):
        g = next(got) if t.requires_grad else None
        res.append(like.new_zeros(like.shape) if g is None else g.contiguous())
    dm = next(got, None) if ins[2] is not None and ins[2].requires_grad else None
    res.append(q.new_empty(0) if dm is None else dm.contiguous())
    return tuple(res)  # type: ignore[return-value]


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


@torch.compiler.disable
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
    per call site."""
    options = dict(mask=mask, is_causal=is_causal, scale=scale, softcap=softcap)
    if not torch.compiler.is_compiling():
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
