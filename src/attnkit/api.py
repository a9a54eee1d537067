"""``attention()``: validate, normalise masks and options, dispatch to a backend.

    out = softmax(Q Kᵀ · scale + M) V

Shape legend (PyTorch SDPA's layout)::

    q    (..., H_q,  N_q, D_k)     or 2-D (N_q, D_k): one head, no batch
    k    (..., H_kv, N_k, D_k)     H_q must be a multiple of H_kv (GQA / MQA); a leading
                                   dim of k / v may be 1 against q's (K/V batch broadcast)
    v    (..., H_kv, N_k, D_v)     D_v may differ from D_k; N_q may differ from N_k
    mask broadcastable to (..., H_q, N_q, N_k)
    out  (..., H_q,  N_q, D_v)     lse (..., H_q, N_q)

The order of operations on the logits is fixed:
``S = QKᵀ → S·scale → softcap → score_mod → + float mask → bool mask (−∞) → softmax``.

What never reaches a backend: a problem with no score to compute (B, H_q, N_q or N_k = 0)
gets its defined result here (empty, or zeros with LSE −∞ when N_k = 0; autograd gives zero
gradients); a zero-width head (D_k or D_v = 0) is widened by one zero column. ``scale`` and
``softcap`` are checked against the compute dtype's range, and a ``score_mod`` is wrapped once
(:func:`attnkit.scores.checked_score_mod`: FlexAttention's per-score semantics, result cast
back to the score dtype, one error for a bad result) — every backend calls that wrapper.

The eager path itself (validation, the per-signature frames of a decoder's repeated
calls, the NaN/inf screens, the backend's run) lives in :mod:`attnkit.eager`, which the
custom operator's implementation calls too; this module is the public front.

:func:`scaled_dot_product_attention` is torch's ``F.scaled_dot_product_attention`` call
on top of :func:`attention`. While ``torch.compile`` / ``torch.export`` trace
(``torch.compiler.is_compiling()``), :func:`attention` becomes one ``attnkit::attention``
operator node (:mod:`attnkit.ops`); eager calls never go through the operator.

Caution
-------
- K/V broadcast over the batch: a leading dim of size 1 in K/V against q's is a stride-0
  view — never copied when every leading dim of K/V is 1; K/V broadcast in some leading
  dims only (``(B1, 1)`` against ``(B1, B2)``) are expanded with a copy.
- Under torch.compile, a Python ``score_mod``, ``from_fn`` masks and masks combined with
  ``|`` / ``~`` run eagerly outside the graph (one warning per call site); see
  :mod:`attnkit.ops`.
- NaN/inf in K or V rows: rows no query may attend to never reach the output. A query that
  *does* attend to such a row gets NaN (the honest answer). Finding those queries after the
  fact evaluates the mask densely (O(N_q·N_k) bools) — only on calls whose K/V hold NaN/inf.
  "May attend" is the mask's word: a score_mod's −∞ is a score (weight 0, and 0·NaN is NaN,
  as in the formula, torch and FlexAttention), so remove keys with a mask
  (``masks.from_fn``), not a score_mod; under a Python score_mod K/V are checked up front.
- ``dropout_p`` is applied whenever it is > 0 (as in torch SDPA); modules pass 0 in eval mode.
- A user ``score_mod`` is probed once per call (a few hundred µs on CPU; the choice is cached
  per function object) — see :mod:`attnkit.scores`.
"""

from __future__ import annotations

import math
import numbers
import os as _os
import warnings
from typing import Any, Literal, overload

import numpy as np
import torch

from . import _compat
from . import backends as _backends
from . import eager as _eager
from . import masks as _masks
from . import ops as _ops
from .eager import Prepared, _check_causal_flag, _shape, check_inputs, prepare
from .scores import ScoreMod

__all__ = ["attention", "scaled_dot_product_attention", "prepare", "Prepared", "check_inputs"]

_is_compiling = torch.compiler.is_compiling     # (Dynamo knows the function, not its name)
_any_autocast = _ops.any_autocast
_Tensor = torch.Tensor
# (torch.compiler.is_compiling()'s answer in one function, see _compat.compiling)
_compiling = _compat.compiling
_jit_tracing = _compat.jit_tracing_state
_dispatch_modes, _tracer_mode = _compat.dispatch_modes, _compat.tracer_mode
_func_transforms = _compat.func_transforms
_SLOT_FINITE, _SLOT_NOT_FINITE = _eager.SLOT_FINITE, _eager.SLOT_NOT_FINITE
_PLAIN = _eager._PLAIN
_grad_enabled = torch.is_grad_enabled
_SCOPE, _NATIVE = _eager._SCOPE, _eager._NATIVE
_num_threads = torch.get_num_threads
_loader = _eager._loader
_COUNTS, _count = _eager._COUNTS, _eager._count


@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: Any = ...,
              is_causal: bool = ..., scale: float | None = ..., softcap: float | None = ...,
              score_mod: ScoreMod | None = ..., dropout_p: float = ..., backend: str = ...,
              return_lse: Literal[False] = ...) -> torch.Tensor: ...
@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: Any = ...,
              is_causal: bool = ..., scale: float | None = ..., softcap: float | None = ...,
              score_mod: ScoreMod | None = ..., dropout_p: float = ..., backend: str = ...,
              return_lse: Literal[True]) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, mask: Any = ...,
              is_causal: bool = ..., scale: float | None = ..., softcap: float | None = ...,
              score_mod: ScoreMod | None = ..., dropout_p: float = ..., backend: str = ...,
              return_lse: Literal[False] = ...) -> np.ndarray: ...
@overload
def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, mask: Any = ...,
              is_causal: bool = ..., scale: float | None = ..., softcap: float | None = ...,
              score_mod: ScoreMod | None = ..., dropout_p: float = ..., backend: str = ...,
              return_lse: Literal[True]) -> tuple[np.ndarray, np.ndarray]: ...


def attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    mask: Any = None,
    is_causal: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
    score_mod: ScoreMod | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
    return_lse: bool = False,
) -> Any:
    """Scaled dot-product attention: ``softmax(Q Kᵀ · scale + M) V``.

    Shapes::

        q (..., H_q, N_q, D_k)   k (..., H_kv, N_k, D_k)   v (..., H_kv, N_k, D_v)
        → out (..., H_q, N_q, D_v)        [and lse (..., H_q, N_q) with return_lse=True]

    2-D inputs ``(N, D)`` are one head with no batch. NumPy arrays in → NumPy array out.

    Args:
        mask: an :class:`attnkit.masks.Mask`, a bool tensor (True = may attend) or a float
            tensor added to the logits (−inf = blocked), broadcastable to
            ``(..., H_q, N_q, N_k)``.
        is_causal: query i sees keys 0..i (top-left aligned, exactly like torch). Same as
            ``mask=attnkit.masks.causal()``; giving both is an error.
        scale: multiplies the scores; defaults to ``1/√D_k``.
        softcap: ``c`` maps each scaled logit x to ``c·tanh(x/c)`` (before the mask).
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, differentiable, with
            FlexAttention's semantics (one score and its four indices; FlexAttention's
            functions work unchanged). Its result is cast back to the score dtype.
        dropout_p: dropout on the weights (seeded by torch's generator), in [0, 1).
        backend: ``"auto"`` (the first backend in ``attnkit.backends.PRIORITY``, fastest
            first, that supports the call — or, inside an ``attnkit.backends.use(...)``
            scope, the scope's choice), or a name from ``attnkit.backends.names()``, which
            wins over any scope.
        return_lse: also return the natural-log log-sum-exp of the masked logits
            (−inf for a query with no allowed key).

    A query with no allowed key gets output 0 (never NaN). K/V whose leading (batch) dims
    are 1 broadcast against q's without a copy (as FlexAttention). Under ``torch.compile`` /
    ``torch.export`` the call is the operator ``attnkit::attention`` (:mod:`attnkit.ops`).
    Inside ``torch.autocast`` it runs as torch runs SDPA there: q, k, v and a float mask
    cast to the region's dtype (float64 left as it is), the call with autocast off.
    """
    # (the common call — backend "auto", no autocast region — enters no function of ours
    # before the kernel's operator (a warm frame's repeat, below) or eager.attend: after a
    # decode call has streamed its K/V through the caches, each Python function entered
    # costs microseconds of cache misses)
    if type(backend) is not str or backend != "auto":
        _backends.check_name(backend)
    # torch.compile / torch.export, make_fx, FakeTensorMode, torch.func: one operator
    if _compiling() or (_dispatch_modes() and _tracer_mode()) or _func_transforms():
        return _traced(q, k, v, mask=mask, is_causal=is_causal, scale=scale, softcap=softcap,
                       score_mod=score_mod, dropout_p=dropout_p, backend=backend,
                       return_lse=return_lse)
    cast_to = _ops.autocast_dtype(q) if _any_autocast() else None
    if cast_to is not None:                 # torch.autocast: run as it runs torch's SDPA
        with torch.autocast(q.device.type, enabled=False):
            return attention(*(_ops.autocast_cast(t, cast_to) for t in (q, k, v)),
                             mask=_ops.autocast_cast(mask, cast_to), is_causal=is_causal,
                             scale=scale, softcap=softcap, score_mod=score_mod,
                             dropout_p=dropout_p, backend=backend, return_lse=return_lse)
    # A decoder's per-token call (no mask, no score_mod, CPU tensors without gradients, a
    # frame whose lane holds a lean launch): eager.attend's hot path written out here, so
    # that the call enters no function of ours before the kernel's operator. First the last
    # such call's frame (eager._HOT): the options compared here, the lane's checks written
    # out (eager._lane_holds' checks: keep the two alike), the tensors' signature and the
    # gradients checked by the operator (attend_slot); then the frame's key, as eager.attend
    # finds it. Any miss, or an output that is not finite, takes eager.attend's path.
    if mask is None and score_mod is None and type(q) is _Tensor and type(k) is _Tensor \
            and type(v) is _Tensor and type(scale) in _PLAIN and type(softcap) in _PLAIN \
            and type(dropout_p) in _PLAIN and (is_causal is True or is_causal is False):
        hot = _eager._HOT                   # (not while torch.jit.trace records: the
        if hot is not None and _jit_tracing() is None and hot.frames is _eager._FRAMES \
                and is_causal is hot.is_causal \
                and scale == hot.scale and softcap == hot.softcap \
                and dropout_p == hot.dropout_p:
            lane = hot.frame.lane
            launch = lane.launch if lane is not None else None   # (a plain frame, no mask)
            if launch is not None and launch.slot is not None:
                state = lane.state                  # (eager._lane_state's fields, in order)
                env = _loader._DATA if _os.environ is _loader._ENVIRON else None
                holds = state[0] == backend and state[1] == _SCOPE.get() \
                    and state[3] == _NATIVE.get() and state[5] == _num_threads() \
                    and state[6] is _backends.select and state[2] == _backends.PRIORITY \
                    and state[4] == ((env.get(b"ATTNKIT_NATIVE"), env.get(b"TRITON_INTERPRET"),
                                      _loader._state["ops"]) if env is not None
                                     else _loader.hot_state())
                if holds:
                    reg = _backends.REGISTRY
                    for name, b, attrs, n_attrs in lane.consulted:
                        if reg.get(name) is not b or len(attrs) != n_attrs:
                            holds = False
                            break
                if holds:
                    out, lse, status = launch.slot(  # type: ignore[operator]
                        q, k, v, *hot.sigs, *launch.slot_tail)
                    if status == _SLOT_FINITE:
                        if _COUNTS.get() is not None:
                            _count(native=1)
                        return (out, lse) if return_lse else out
                    if status == _SLOT_NOT_FINITE:  # the full path screens
                        return _eager.run_frame(hot.frame, q, k, v, None, backend, return_lse)
        if q.is_cpu and k.is_cpu and v.is_cpu \
                and not (_grad_enabled() and (q.requires_grad or k.requires_grad
                                              or v.requires_grad)):
            key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, True, is_causal,
                   scale, softcap, dropout_p, None)
            frame = _eager._FRAMES.get(key)
            lane = frame.lane if frame is not None and frame.plain else None
            launch = lane.launch if lane is not None else None
            if launch is not None and not launch.masked and _eager._lane_holds(lane, backend):
                out, lse, finite = launch.op(q, k, v, *launch.tail)  # type: ignore[operator]
                if finite:
                    if launch.slot is not None:     # the next call tries this frame first
                        if frame.hot is None:
                            frame.hot = _eager._Hot(frame, q, k, v, key)
                        _eager._HOT = frame.hot
                    if _COUNTS.get() is not None:
                        _count(native=1)
                    return (out, lse) if return_lse else out
                return _eager.run_frame(frame, q, k, v, None, backend, return_lse)
    elif (type(q) is not _Tensor or type(k) is not _Tensor or type(v) is not _Tensor) \
            and _compat.intercepted(q, k, v):       # FakeTensor, DTensor … : one operator
        return _traced(q, k, v, mask=mask, is_causal=is_causal, scale=scale, softcap=softcap,
                       score_mod=score_mod, dropout_p=dropout_p, backend=backend,
                       return_lse=return_lse)
    return _eager.attend(q, k, v, mask=mask, is_causal=is_causal, scale=scale,
                         softcap=softcap, score_mod=score_mod, dropout_p=dropout_p,
                         backend=backend, return_lse=return_lse)


def _traced(q: Any, k: Any, v: Any, *, mask: Any, is_causal: bool, scale: float | None,
            softcap: float | None, score_mod: ScoreMod | None, dropout_p: float, backend: str,
            return_lse: bool) -> Any:
    """:func:`attention` while torch.compile / torch.export trace: one ``attnkit::attention``
    operator node (see :mod:`attnkit.ops`), or — for what an operator argument cannot carry —
    the eager call outside the graph, with one warning per call site. Under a dispatch mode
    or a torch.func transform (make_fx, FakeTensorMode, grad, vmap …) or with a tensor
    subclass that dispatches in Python, the same operator — or, for what it cannot carry,
    the eager call in plain torch operators (the native kernel off), which they follow."""
    options = dict(mask=mask, is_causal=is_causal, scale=scale, softcap=softcap,
                   score_mod=score_mod, dropout_p=dropout_p, backend=backend,
                   return_lse=return_lse)
    compiling = _compiling()
    if not compiling and _compat.differentiating():     # torch.func.grad, jacrev, jvp …
        return _ops.eager_in_torch(q, k, v, differentiable=True, **options)
    reason: str | None = None
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        reason = "NumPy inputs"
    elif score_mod is not None:
        reason = "a Python score_mod"
    else:
        _check_causal_flag(mask, is_causal)
        args = _ops.op_args(_masks.causal() if is_causal else mask, q.shape[-2], k.shape[-2])
        if isinstance(args, str):
            reason = args
    if reason is not None and not compiling:
        return _ops.eager_in_torch(q, k, v, **options)
    if reason is not None:
        warnings.warn(
            f"attnkit.attention under torch.compile/export: {reason} cannot be an operator "
            "argument, so this call runs eagerly outside the graph (a graph break; "
            "fullgraph=True fails). Use the mask builders causal / sliding_window / padding / "
            "document (and &) or a mask tensor to stay in the graph", UserWarning,
            stacklevel=3)
        return _ops.eager_fallback(q, k, v, **options)
    seed = torch.randint(0, 2**62, (), dtype=torch.int64) if dropout_p > 0 else None
    out, lse = _ops.attention_op(
        q, k, v, args.tensor, args.bands, args.kv_lengths, args.q_lengths, args.doc_ids,
        args.doc_kv_ids, scale, softcap, float(dropout_p), seed, backend)
    return (out, lse) if return_lse else out


def _and_causal(attn_mask: torch.Tensor, n_q: int, n_k: int) -> torch.Tensor:
    """``attn_mask`` with top-left causal applied too (query i keeps keys 0..i): bool masks
    are and-ed, float masks get −∞ where causal blocks — as torch 2.13 combines them."""
    keep = torch.ones(n_q, n_k, dtype=torch.bool, device=attn_mask.device).tril()  # (L, S)
    if attn_mask.dtype == torch.bool:
        return attn_mask & keep
    return attn_mask.masked_fill(~keep, -math.inf)


def scaled_dot_product_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
    *, scale: float | None = None, enable_gqa: bool = False,
) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention``'s call, with torch's semantics:
    replacing ``F.scaled_dot_product_attention`` by this is a one-line change.

    Shapes (torch's)::

        query (..., H_q, L, E)   key (..., H_kv, S, E)   value (..., H_kv, S, E_v)
        attn_mask broadcastable to (..., H_q, L, S)      → out (..., H_q, L, E_v)

    As in torch: leading dims of query, key and value broadcast against each other (2-D and
    3-D inputs too; K/V with batch 1 are not copied per batch element); ``attn_mask`` is
    bool (True = take part in attention) or float (added to the logits) of query's dtype or
    float32, at least 2-D; ``is_causal`` is top-left causal (query i sees keys 0..i), and
    together with ``attn_mask`` the two combine (mask ∧ causal, as torch 2.13's default
    dispatch does; its math kernel alone refuses the pair); ``scale`` and ``enable_gqa`` are
    keyword-only;
    without ``enable_gqa`` the head counts must match or one of them be 1; with it H_q must
    be a multiple of H_kv. A query whose mask row allows no key gets 0 (torch ≥ 2.5; older
    torch gave NaN); a float mask row holding NaN or +inf gives NaN, as in torch.
    ``dropout_p`` in [0, 1] (1 gives zeros) drops weights with attnkit's own draw: same
    statistics as torch's, not the same pattern. Inside ``torch.autocast`` (CPU or CUDA,
    bfloat16 or float16) query, key, value and a float ``attn_mask`` are cast to the
    region's dtype first, float64 ones left as they are, as torch casts its SDPA's inputs.

    Where this is stricter than torch: a non-finite ``scale`` (or one so large that the
    logits overflow) is refused rather than giving NaN; K/V of different lengths S, or
    ``dropout_p`` outside [0, 1], are refused on every input (some torch kernels accept
    them silently). Errors are attnkit's (ValueError / TypeError with the shapes seen), not
    torch's RuntimeError.
    """
    # (the common call — no autocast region, three tensors — asks the fewest questions: on
    # the per-token path each function entered is a cache miss, see eager.attend)
    cast_to = _ops.autocast_dtype(query) if _any_autocast() else None
    if cast_to is not None:             # torch.autocast casts SDPA's inputs, the mask too
        query, key, value, attn_mask = (_ops.autocast_cast(t, cast_to)
                                        for t in (query, key, value, attn_mask))
    if not (type(query) is _Tensor and type(key) is _Tensor and type(value) is _Tensor
            or isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor)
            and isinstance(value, torch.Tensor)) \
            or query.dim() < 2 or key.dim() < 2 or value.dim() < 2:
        _check_sdpa_tensors(query, key, value)
    if not isinstance(enable_gqa, (bool, np.bool_)):
        raise TypeError(f"enable_gqa must be True or False, got {enable_gqa!r}")
    if type(dropout_p) is not float and (isinstance(dropout_p, (bool, np.bool_))
                                         or not isinstance(dropout_p, numbers.Real)) \
            or not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must be a number in [0, 1], got {dropout_p!r}")
    if attn_mask is not None:
        _check_sdpa_mask(attn_mask, query)
    if attn_mask is not None and is_causal:             # torch's default dispatch: mask ∧ causal
        _check_causal_flag(None, is_causal)
        attn_mask, is_causal = _and_causal(attn_mask, query.shape[-2], key.shape[-2]), False
    q, k, v = query, key, value
    if q.dim() > 2 or k.dim() > 2 or v.dim() > 2:
        q, k, v = _sdpa_broadcast(q, k, v, enable_gqa)
    poison = None
    if attn_mask is not None and attn_mask.dtype.is_floating_point:
        attn_mask, poison = _sdpa_poison(attn_mask)
    drop = float(dropout_p) if dropout_p < 1 else 0.0
    if cast_to is None and not _is_compiling() and not _compat.intercepted(q, k, v):
        # attention()'s eager call, its checks done: no autocast region, backend "auto",
        # no tracer (make_fx, FakeTensorMode, torch.func …: attention() makes it one operator)
        out = _eager.attend(q, k, v, mask=attn_mask, is_causal=is_causal, scale=scale,
                            dropout_p=drop)
    else:
        out = attention(q, k, v, mask=attn_mask, is_causal=is_causal, scale=scale,
                        dropout_p=drop)
    if dropout_p == 1:
        out = out * 0.0                                 # every weight dropped
    if poison is not None:                              # (..., L, 1): NaN rows, as in torch
        out = torch.where(poison, torch.full_like(out, torch.nan), out)
    return out


def _check_sdpa_tensors(query: Any, key: Any, value: Any) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"scaled_dot_product_attention(): argument '{name}' must be Tensor, "
                            f"not {type(t).__name__}")
        if t.dim() < 2:
            raise ValueError(
                "scaled_dot_product_attention: query, key and value must be at least 2-D "
                f"(..., L, E), got query {_shape(query)}, key {_shape(key)}, value "
                f"{_shape(value)}")


def _check_sdpa_mask(m: Any, q: torch.Tensor) -> None:
    if not isinstance(m, torch.Tensor):
        raise TypeError("scaled_dot_product_attention(): argument 'attn_mask' must be Tensor, "
                        f"not {type(m).__name__}")
    if m.dtype != torch.bool and m.dtype not in (q.dtype, torch.float32):
        raise TypeError(
            f"attn_mask must be bool (True = attend) or float of query's dtype {q.dtype} (or "
            f"float32), got {m.dtype} (as torch's SDPA): cast it with attn_mask.to(q.dtype)")
    if m.dim() < 2:
        raise ValueError(f"attn_mask must be at least 2-D (L, S), got shape {_shape(m)}")


def _sdpa_broadcast(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch's broadcasting of SDPA's inputs: ranks padded on the left to one rank ≥ 3,
    leading dims broadcast; q is expanded where K/V have the larger size, K/V stay as they
    are (attention() broadcasts K/V of batch 1 without a copy)."""
    qs, ks, vs = q.shape, k.shape, v.shape
    r = len(qs)
    if r == len(ks) == len(vs) and (
            qs[0] == ks[0] == vs[0] if r == 4 else qs[:-3] == ks[:-3] == vs[:-3]) and (
            qs[-3] == ks[-3] or (enable_gqa and ks[-3] and qs[-3] % ks[-3] == 0)):
        return q, k, v                  # the common case: nothing to broadcast
    r = max(q.dim(), k.dim(), v.dim())
    if not q.dim() == k.dim() == v.dim() == r:
        q, k, v = (t if t.dim() == r else t.reshape((1,) * (r - t.dim()) + tuple(t.shape))
                   for t in (q, k, v))
    lead = q.shape[:-3]
    if k.shape[:-3] != lead or v.shape[:-3] != lead:        # broadcast, as tuple arithmetic
        sizes = []
        for dims in zip(lead, k.shape[:-3], v.shape[:-3], strict=True):
            n = 1
            for s in dims:
                if s != 1 and n != 1 and s != n:
                    raise ValueError(
                        f"the leading (batch) dims of query {_shape(q)}, key {_shape(k)} and "
                        f"value {_shape(v)} do not broadcast: give each dim one size or 1")
                n = s if s != 1 else n
            sizes.append(n)
        lead = tuple(sizes)
    h_q, h_kv = q.shape[-3], k.shape[-3]
    h = h_q
    if not enable_gqa and h_q != h_kv:
        if h_q == 1:
            h = h_kv                                    # one query head against many
        elif h_kv != 1:
            raise ValueError(
                f"query has H_q={h_q} heads and key/value H_kv={h_kv} (query {_shape(q)}, key "
                f"{_shape(k)}): torch's SDPA broadcasts them only when they are equal or one "
                "is 1; pass enable_gqa=True for grouped-query attention")
    if tuple(q.shape[:-3]) != tuple(lead) or h != h_q:
        q = q.expand(*lead, h, *q.shape[-2:])
    return q, k, v


def _sdpa_poison(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A float mask with NaN / +inf entries: torch's result is NaN on those query rows.
    → (the mask with them zeroed, (..., L, 1) True on those rows), or (mask, None)."""
    bad = torch.isnan(m) | (m == torch.inf)
    if not torch.compiler.is_compiling() and not bool(bad.any()):
        return m, None
    return torch.where(bad, torch.zeros_like(m), m), bad.any(-1, keepdim=True)
