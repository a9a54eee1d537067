"""Score modifications: how much a query likes a key, beyond the dot product.

A *score mod* is a function ``score_mod(score, b, h, q_idx, kv_idx) -> score`` applied to the
scaled (and soft-capped) logits before the mask. It is a per-score function with
FlexAttention's semantics: it means what it returns for one score and its four scalar
indices, so FlexAttention's score_mod / mask_mod functions work unchanged — chained indexing
such as ``bias[b][h][q_idx][kv_idx]`` included. Backends call it on whole tiles with
broadcast index tensors; :func:`flex_semantics` checks once per call that the broadcast call
means the same, and otherwise evaluates it per score through ``torch.vmap``.

Shape legend::

    score   (B, H, N_q, N_k) or any tile of it     b (B,1,1,1)   h (1,H,1,1)
    q_idx   (1,1,N_q,1)                            kv_idx (1,1,1,N_k)

The order inside attention is fixed: ``S·scale → softcap → score_mod → + bias → mask``.

attnkit's own score terms (:func:`alibi`, :func:`relative_bias`) are :class:`ScoreTerm` s that
carry a *spec* the way masks do — ``term.spec`` is :class:`Alibi` ``(slopes (H,), offset)`` or
:class:`RelativeBias` ``(table (H, 2·max_distance+1), max_distance)`` — so a compiled kernel
reads the term's data instead of calling Python per tile (``spec`` is None for a term without
a closed form).

Caution
-------
- The semantics check runs the function on a small probe tile (≤ 5 indices per axis, both
  as a broadcast call and per score): a function with side effects sees those extra calls.
  The choice is remembered per function object and problem size (a lock-guarded weak cache;
  it holds no results, only which way to call).
- Per-score evaluation (``torch.vmap``) is used only when the broadcast call would mean
  something else (chained indexing, a reduction) or fails. It costs about 0.2 ms per tile
  call beyond the broadcast call for index arithmetic (CPU, one thread: 121 µs → 313 µs on a
  (1, 8, 128, 512) tile for ``score + (q_idx - kv_idx)``), and much more for chained indexing
  into a captured tensor, where each ``[·]`` gathers a copy: ``bias[b][h][q_idx][kv_idx]``
  with bias (1, 8, 1024, 1024) took 1143 ms on ``tiled`` (causal, D=64) against 193 ms for
  ``bias[b, h, q_idx, kv_idx]`` — the same scores in one index, which runs as a broadcast
  call. Write one index where you can.
- A function that can be evaluated neither way — it fails under ``torch.vmap`` (``.item()``,
  Python control flow on values, randomness) and its broadcast call fails too or depends on
  the tile it is given — or that returns None, a non-float dtype, the wrong shape or another
  device, is refused before any backend runs, with one message. A function vmap cannot run
  whose broadcast call is tile-independent runs as a broadcast call.
- A call with no score to compute (B, H_q, N_q or N_k = 0) never calls the score_mod.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ._shapes import broadcast_shapes

__all__ = ["ScoreMod", "ScoreTerm", "Alibi", "RelativeBias", "soft_cap", "alibi_slopes", "alibi",
           "relative_bias", "per_element", "flex_semantics", "checked_score_mod", "fn_name",
           "unwrap", "ScoreTerms", "score_terms", "NO_SCORE_TERMS"]

ScoreMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                    torch.Tensor]


@dataclass(frozen=True, eq=False)
class Alibi:
    """ALiBi's spec: ``score − slopes[h] · |q_idx + offset − kv_idx|``; ``slopes (H,)``."""

    slopes: torch.Tensor
    offset: int = 0


@dataclass(frozen=True, eq=False)
class RelativeBias:
    """A relative-position bias table's spec:
    ``score + table[h, clamp(kv_idx − q_idx, ±max_distance) + max_distance]``;
    ``table (H, 2·max_distance + 1)`` (it may require grad)."""

    table: torch.Tensor
    max_distance: int


class ScoreTerm:
    """One of attnkit's own score mods: a callable written for broadcast index tensors (so
    no semantics probe is needed) that knows the head count and tensors it was built with,
    so a mismatch with the inputs is refused up front. ``spec`` (:class:`Alibi`,
    :class:`RelativeBias` or None) is what kernels read instead of calling ``fn``."""

    def __init__(self, fn: ScoreMod, name: str, heads: int,
                 tensors: tuple[torch.Tensor, ...] = (), spec: object | None = None):
        self.fn, self.name, self.heads, self.tensors = fn, name, heads, tensors
        self.spec = spec
        self.__name__ = self.__qualname__ = name

    def __call__(self, score: torch.Tensor, b: torch.Tensor, h: torch.Tensor,
                 q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return self.fn(score, b, h, q_idx, kv_idx)

    def __repr__(self) -> str:
        return f"<score term {self.name}>"


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap · tanh(x / cap)``: squashes logits smoothly into (-cap, cap)."""
    return cap * torch.tanh(x / cap)


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """ALiBi's geometric head slopes ``2^(-8h/H)`` for ``h = 1..H`` (shape ``(H,)``).

    For a head count that is not a power of two, the slopes of the next lower power of two
    are followed by every other slope of the next higher one (as in the ALiBi paper's code).
    """
    if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads < 1:
        raise ValueError(f"n_heads must be >= 1, got {n_heads!r} (an int: one slope per head)")

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    p = 1 << (n_heads.bit_length() - 1)
    slopes = power_of_two(p)
    if p != n_heads:
        slopes += power_of_two(2 * p)[0::2][: n_heads - p]
    return torch.tensor(slopes, dtype=torch.float64)


def alibi(n_heads: int) -> ScoreTerm:
    """ALiBi as a score mod: ``score - slope_h · |q_idx - kv_idx|`` (for ``H_q = n_heads``)."""
    slopes = alibi_slopes(n_heads)

    def score_mod(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        s = slopes.to(device=score.device, dtype=score.dtype)[h]
        return score - s * (q_idx - kv_idx).abs().to(score.dtype)

    return ScoreTerm(score_mod, f"alibi({n_heads})", n_heads, spec=Alibi(slopes))


def relative_bias(table: torch.Tensor, max_distance: int) -> ScoreTerm:
    """A learned relative-position bias: ``score + table[h, clamp(kv_idx - q_idx) + max_distance]``.

    ``table`` has shape ``(H, 2·max_distance + 1)`` (``H = H_q``) and may require grad.
    """
    if isinstance(max_distance, bool) or not isinstance(max_distance, int) or max_distance < 0:
        raise ValueError(f"max_distance must be an int >= 0, got {max_distance!r}")
    if not isinstance(table, torch.Tensor) or not table.dtype.is_floating_point:
        seen = f"dtype {table.dtype}" if isinstance(table, torch.Tensor) else type(table).__name__
        raise TypeError(
            "relative_bias table must be a floating-point tensor of shape "
            f"(H, 2*max_distance+1), got {seen}: convert it with torch.as_tensor(t).float()"
        )
    if table.dim() != 2 or table.shape[1] != 2 * max_distance + 1:
        raise ValueError(
            f"relative_bias table must have shape (H, 2*max_distance+1) = "
            f"(H, {2 * max_distance + 1}), got {tuple(table.shape)}"
        )

    def score_mod(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        rel = (kv_idx - q_idx).clamp(-max_distance, max_distance) + max_distance
        return score + table.to(score.dtype)[h, rel]

    return ScoreTerm(score_mod, f"relative_bias(table {tuple(table.shape)}, {max_distance})",
                     table.shape[0], (table,), spec=RelativeBias(table, max_distance))


# ----------------------------------------------------------- what a score mod is, as data
def unwrap(score_mod: Any) -> Any:
    """The function a call's score mod stands for: the user's function (or
    :class:`ScoreTerm`) under the checker :func:`checked_score_mod` or :func:`per_element`
    wrapped it in; ``score_mod`` itself when it is not wrapped. The one reader of the
    wrappers' ``__wrapped__``."""
    return getattr(score_mod, "__wrapped__", score_mod)


class ScoreTerms(NamedTuple):
    """A call's score mod as kernels read it: exactly one of ``alibi`` (its
    :class:`Alibi` spec), ``relative`` (its :class:`RelativeBias` spec) or ``user`` (a
    Python function no spec describes: the call's score mod, to call or compile) is set, or
    none without a score mod. ``fn`` is the unwrapped function (:func:`unwrap`)."""

    alibi: Alibi | None = None
    relative: RelativeBias | None = None
    user: ScoreMod | None = None
    fn: Any = None


NO_SCORE_TERMS = ScoreTerms()


def score_terms(score_mod: Any, heads: int) -> ScoreTerms:
    """``score_mod`` of a call with ``heads`` query heads as :class:`ScoreTerms`: a spec is
    read when it fits the call (one slope / table row per query head), else the function is
    a ``user`` term (called as written)."""
    if score_mod is None:
        return NO_SCORE_TERMS
    fn = unwrap(score_mod)
    spec = getattr(fn, "spec", None)
    if isinstance(spec, Alibi) and torch.as_tensor(spec.slopes).numel() == heads:
        return ScoreTerms(alibi=spec, fn=fn)
    if (isinstance(spec, RelativeBias) and spec.table.dim() == 2
            and spec.table.shape[0] == heads):
        return ScoreTerms(relative=spec, fn=fn)
    return ScoreTerms(user=score_mod, fn=fn)


# ----------------------------------------------------------- FlexAttention's semantics
def fn_name(fn: Any) -> str:
    """A readable name for a user function in error messages."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return repr(fn) if name is None else name


def _axis_vector(t: Any, axis: int, size: int) -> torch.Tensor | None:
    """A broadcast index tensor that varies along ``axis`` of 4 only → its ``(size,)`` values."""
    t = torch.as_tensor(t)
    if t.dim() > 4:
        return None
    shape = (1,) * (4 - t.dim()) + tuple(t.shape)
    if any(s != 1 for i, s in enumerate(shape) if i != axis) or shape[axis] not in (1, size):
        return None
    return t.reshape(-1).expand(size)


def per_element(fn: Callable[..., Any], *, with_score: bool = True) -> Callable[..., Any]:
    """``fn`` evaluated once per score through ``torch.vmap``, as FlexAttention does
    (``_vmap_for_bhqkv``): ``fn`` sees 0-d tensors ``(score,) b, h, q_idx, kv_idx``.

    The returned function takes what backends pass — ``score (B, H, M, N)`` (with
    ``with_score``) and broadcast index tensors ``b (B,1,1,1), h (1,H,1,1), q_idx (1,1,M,1),
    kv_idx (1,1,1,N)`` — and returns ``(B, H, M, N)`` (any other broadcastable index shapes
    are expanded and mapped over flat). For a mask_mod, ``with_score=False``.
    """
    pre = (0,) if with_score else ()
    nested = fn
    for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None),
                 (0, None, None, None)):
        nested = torch.vmap(nested, in_dims=pre + dims)
    flat = torch.vmap(fn)

    def evaluate(*args: Any) -> Any:
        score, idx = (args[0], args[1:]) if with_score else (None, args)
        if len(idx) != 4:
            raise TypeError(f"expected 4 index tensors (b, h, q_idx, kv_idx), got {len(idx)}")
        idx = [torch.as_tensor(i) for i in idx]
        shape = broadcast_shapes(*(i.shape for i in idx),
                                       *(() if score is None else (score.shape,)))
        if len(shape) == 4:
            vecs = [_axis_vector(t, a, shape[a]) for a, t in enumerate(idx)]
            if all(vec is not None for vec in vecs):
                s = () if score is None else (score.expand(shape),)
                return nested(*s, *vecs)
        full = [t.expand(shape).reshape(-1) for t in ((score,) if score is not None else ())
                + tuple(idx)]
        out = flat(*full)                                   # (numel, *per-element shape)
        return out.reshape(*shape, *out.shape[1:])

    evaluate.__name__ = evaluate.__qualname__ = f"per_element({fn_name(fn)})"
    evaluate.__wrapped__ = fn  # type: ignore[attr-defined]
    return evaluate


# which way to call a user function, per function object and problem size (not results)
_CHOICES: weakref.WeakKeyDictionary[Any, dict[tuple, bool]] = weakref.WeakKeyDictionary()
_CHOICES_LOCK = threading.Lock()
_PROBE = 5                                   # at most this many indices per axis


def _probe_indices(n: int) -> list[int]:
    """≤ 5 indices of ``range(n)``, both ends included."""
    return sorted({i for i in (0, 1, n // 2, n - 2, n - 1) if 0 <= i < n})


def _result_problem(y: Any, shape: tuple[int, ...], want_float: bool,
                    device: torch.device | None = None) -> str | None:
    """What is wrong with a function's result for an input of ``shape`` (None: nothing)."""
    if not isinstance(y, torch.Tensor):
        return f"returned {'None' if y is None else type(y).__name__}, not a tensor"
    if device is not None and y.device != device:
        return f"returned a tensor on {y.device}, not on {device} where the scores are"
    if want_float and (not y.dtype.is_floating_point):
        return f"returned dtype {y.dtype}, not a floating-point dtype"
    if not want_float and y.dtype != torch.bool:
        return f"returned dtype {y.dtype}, not torch.bool"
    try:
        ok = broadcast_shapes(y.shape, shape) == torch.Size(shape)
    except RuntimeError:
        ok = False
    if not ok:
        return f"returned shape {tuple(y.shape)} for an input of shape {tuple(shape)}"
    return None


def _error_type(problem: str) -> type[Exception]:
    """TypeError for a result of the wrong kind (None, a number, a dtype), else ValueError."""
    return TypeError if "not a tensor" in problem or "dtype" in problem else ValueError


def _same(a: torch.Tensor, b: torch.Tensor, shape: tuple[int, ...]) -> bool:
    a, b = a.expand(shape), b.expand(shape)
    if a.dtype.is_floating_point and b.dtype.is_floating_point:
        tol = 1e-10 if torch.float64 in (a.dtype, b.dtype) else 1e-5
        return bool(torch.allclose(a.to(b.dtype), b, rtol=tol, atol=tol, equal_nan=True))
    return a.dtype == b.dtype and bool(torch.equal(a, b))


def _tile_independent(fn: Callable[..., Any], args: tuple[torch.Tensor, ...],
                      full: torch.Tensor, shape: tuple[int, ...]) -> bool:
    """True when ``fn`` called on single scores (1×1×1×1 tiles) at the probe's corners gives
    the values of its call on the whole probe tile (the check when vmap cannot run it)."""
    with_score = len(args) == 5
    full = full.expand(shape)
    for corner in range(16):
        at = [(len_ - 1) * ((corner >> d) & 1) for d, len_ in enumerate(shape)]
        one = [a.expand(shape)[tuple(at)].reshape(1, 1, 1, 1) for a in args]
        try:
            with torch.no_grad():
                y = fn(*one)
        except Exception:  # noqa: BLE001
            return False
        if _result_problem(y, (1, 1, 1, 1), want_float=with_score) is not None \
                or not _same(y, full[tuple(at)].reshape(1, 1, 1, 1), (1, 1, 1, 1)):
            return False
    return True


def flex_semantics(fn: Callable[..., Any], *, with_score: bool, batch: int, heads: int,
                   n_q: int, n_k: int, dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu", what: str = "score_mod",
                   ) -> Callable[..., Any]:
    """``fn`` with FlexAttention's per-score semantics, callable with broadcast index tensors.

    ``fn(score, b, h, q_idx, kv_idx)`` (``with_score``, a score_mod: returns float) or
    ``fn(b, h, q_idx, kv_idx)`` (a mask_mod: returns bool), for a problem of ``batch`` ×
    ``heads`` × ``n_q`` × ``n_k`` scores of ``dtype`` on ``device``. On a probe tile (≤ 5
    indices per axis, both ends included) ``fn`` is called once with broadcast index tensors
    and once per score (:func:`per_element`); when both agree, ``fn`` itself is returned (the
    fast broadcast call), otherwise ``per_element(fn)`` — and when neither way gives one valid
    value per score, a ``TypeError``/``ValueError`` naming ``what`` and ``fn``.
    """
    name = fn_name(fn)
    axes = [_probe_indices(n) for n in (batch, heads, n_q, n_k)]
    key = (with_score, batch, heads, *map(len, axes), dtype, str(device))
    try:
        with _CHOICES_LOCK:
            vmapped = _CHOICES.get(fn, {}).get(key)
    except TypeError:                                      # not weak-referenceable
        vmapped = None
    if vmapped is not None:
        return per_element(fn, with_score=with_score) if vmapped else fn

    shape = tuple(len(a) for a in axes)
    idx = [torch.tensor(a, device=device).view([-1 if i == d else 1 for i in range(4)])
           for d, a in enumerate(axes)]
    n = max(1, int(torch.Size(shape).numel()))
    score = (torch.sin(torch.arange(n, dtype=dtype, device=device) * 1.7) * 3).reshape(shape)
    args = ((score,) if with_score else ()) + tuple(idx)
    results: dict[str, Any] = {}
    for way, call in (("broadcast", fn), ("per score", per_element(fn, with_score=with_score))):
        try:
            with torch.no_grad():
                y = call(*args)
        except Exception as e:  # noqa: BLE001 — any failure of user code is reported below
            results[way] = e
            continue
        problem = _result_problem(y, shape, want_float=with_score, device=idx[0].device)
        results[way] = y if problem is None else problem
    b_ok, v_ok = (isinstance(results[w], torch.Tensor) for w in ("broadcast", "per score"))
    if b_ok and not v_ok and not _tile_independent(fn, args, results["broadcast"], shape):
        results["broadcast"] = ("gives a score that depends on the tile it is called on (it "
                                "is not elementwise: a reduction, .item(), a shape, ...)")
        b_ok = False
    if b_ok or v_ok:
        vmapped = not b_ok or (v_ok and not _same(results["broadcast"], results["per score"],
                                                  shape))
        try:
            with _CHOICES_LOCK:
                _CHOICES.setdefault(fn, {})[key] = vmapped
        except TypeError:
            pass
        return per_element(fn, with_score=with_score) if vmapped else fn
    sig = "(score, b, h, q_idx, kv_idx)" if with_score else "(b, h, q_idx, kv_idx)"
    want = "one floating-point score" if with_score else "one bool (True = may attend)"
    said = {w: f"raised {type(r).__name__}: {r}" if isinstance(r, Exception) else r
            for w, r in results.items()}
    first = results["broadcast"]
    exc = _error_type(first) if isinstance(first, str) else ValueError
    err = exc(
        f"{what} {name} cannot be evaluated on a probe tile of {shape} scores "
        f"({str(dtype).replace('torch.', '')}): called with broadcast index tensors, it "
        f"{said['broadcast']}; called per score (torch.vmap, as FlexAttention does), it "
        f"{said['per score']}. A {what}{sig} must return {want} per input score, of the "
        f"input's shape or broadcastable to it (e.g. score + (q_idx - kv_idx))"
    )
    cause = next((r for r in results.values() if isinstance(r, Exception)), None)
    raise err from cause


def checked_score_mod(fn: ScoreMod, *, batch: int, heads: int, n_q: int, n_k: int,
                      dtype: torch.dtype, device: torch.device) -> ScoreMod:
    """The score_mod every backend calls: ``fn`` with FlexAttention's semantics
    (:func:`flex_semantics`), its result cast back to the score dtype (a captured float64
    tensor is fine) and checked for shape on every tile — the one check, so a bad result
    gets the same error on every backend. ``heads`` is ``H_q``; an attnkit
    :class:`ScoreTerm` is checked against it and against ``device`` instead of probed."""
    name = fn_name(fn)
    if isinstance(fn, ScoreTerm):
        if fn.heads != heads:
            raise ValueError(
                f"score_mod {fn.name} was built for {fn.heads} heads but the inputs have "
                f"H_q={heads} query heads: build it for {heads} heads (one per query head)"
            )
        for t in fn.tensors:
            if t.device != torch.device(device):
                raise ValueError(
                    f"score_mod {fn.name} holds a tensor on {t.device} but q is on {device}: "
                    f"move it with .to({str(device)!r}) before building the score mod"
                )
        evaluate: Callable[..., Any] = fn
    else:
        evaluate = flex_semantics(fn, with_score=True, batch=batch, heads=heads, n_q=n_q,
                                  n_k=n_k, dtype=dtype, device=device)

    def score_mod(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                  kv_idx: torch.Tensor) -> torch.Tensor:
        y = evaluate(score, b, h, q_idx, kv_idx)
        if isinstance(y, torch.Tensor) and y.dtype == score.dtype and y.shape == score.shape \
                and y.device == score.device:
            return y                                         # the common case: one check
        problem = _result_problem(y, tuple(score.shape), want_float=True, device=score.device)
        if problem is not None:
            raise _error_type(problem)(
                f"score_mod {name} {problem} (scores {tuple(score.shape)} {score.dtype}): "
                "a score_mod(score, b, h, q_idx, kv_idx) must return one floating-point "
                "score per input score (e.g. score + (q_idx - kv_idx))"
            )
        return y.to(score.dtype).expand(score.shape).contiguous()   # cast back / materialise

    score_mod.__name__ = score_mod.__qualname__ = name
    score_mod.__wrapped__ = fn  # type: ignore[attr-defined]
    return score_mod


# ---------------------------------------------------------------------- in-place soft-cap
# For kernels that work in place on a score tile no autograd records (tiled's engines).
def soft_cap_(x: torch.Tensor, cap: float) -> torch.Tensor:
    """In place ``x ← cap · tanh(x / cap)`` (returns ``x``), within ~3 ulp of :func:`soft_cap`
    at any cap and faster than torch's CPU tanh (no temporary tensor).

    ``tanh(y) = −E / (E + 2) = −1 / (1 + 2/E)`` with ``E = expm1(−2y)`` (Kahan): expm1 keeps
    its relative accuracy near 0, where the faster ``2σ(2y) − 1`` loses ``~cap · 1e-7``
    absolute (30× the float32 reference's error at cap 1e3). ``−2y`` is clamped at 40
    (tanh(±20) is ±1 in float32 and float64); ±inf map to ±cap, NaN stays NaN.
    """
    e = x.mul_(-2.0 / cap).clamp_(max=40.0).expm1_()      # E = e^{−2y} − 1 ∈ [−1, e^40]
    return e.reciprocal_().mul_(2.0).add_(1.0).reciprocal_().mul_(-cap)   # cap·(−E/(E+2))


def soft_cap_grad(capped: torch.Tensor, cap: float) -> torch.Tensor:
    """``∂ soft_cap(x, cap) / ∂x = 1 − tanh²(x / cap)``, written with the capped value
    ``capped = soft_cap(x, cap)`` (one new tensor, two passes)."""
    t = capped / cap
    return torch.addcmul(torch.ones((), dtype=t.dtype, device=t.device), t, t, value=-1.0,
                         out=t)
