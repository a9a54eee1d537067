"""The eager path every call takes outside a graph: validate and normalise a call into one
:class:`~attnkit.backends.base.Problem` (:func:`prepare`), choose a backend and run it with
the NaN/inf screens (``_run``), and give results back in the user's layout.

Both :func:`attnkit.attention` (:mod:`attnkit.api`) and the custom operator's
implementation (:mod:`attnkit.ops`) call :func:`attend`; this module imports neither, so
imports flow one way: ``api → (ops, eager)``, ``ops → eager``.

Shape legend: see :mod:`attnkit.api` (the user's layout) and :mod:`attnkit.backends.base`
(the Problem's ``(B, H, N, D)`` layout).

A call with no mask, ``is_causal`` or a bool mask tensor, and no score_mod (what a decoder
makes once per layer and token) is validated once per *signature* — shapes, dtypes, devices,
the mask's shape and the options: a repeat rebuilds only the Problem around its new
tensors, lowered as before (``_FRAMES``, at most 256 signatures). Nothing about values is
remembered: the NaN/inf screens read each call's own tensors.

A frame also remembers which backend its calls choose (``_Lane``), with everything that
choice depends on besides the signature (the ``backend`` argument, the ``use`` scope, the
priority list and the registry entries asked, ``use_native``, ``ATTNKIT_NATIVE``,
``TRITON_INTERPRET``, the thread count), checked on every repeat. When the choice is the
decode backend on the native kernel, a repeat without gradients runs the kernel's lean
operator directly (``native.lean_launch``): no Problem, no ``select``, and the kernel
reports whether every output is finite in place of the output screen's sum (a non-finite
output runs the full path, which screens K/V as before). :func:`attnkit.attention` runs
such a repeat itself (the same checks written out there), first on the frame of the last
call it ran that way (``_HOT``), whose signature the kernel's ``attend_slot`` operator
checks in C++: a cold per-token call then reads no tensor attribute in Python.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import backends as _backends
from . import masks as _masks
from . import scores as _scores
from .backends import native as _native
from .backends.base import Problem
from .backends.base import compute_dtype as _compute_dtype
from .backends.native import loader as _loader
from .backends.tiled.counters import _COUNTS
from .backends.tiled.counters import count as _count
from .scores import ScoreMod

__all__ = ["Prepared", "prepare", "check_inputs", "attend"]


@dataclass
class Prepared:
    """A validated call: the normalised problem plus how to give results back."""

    problem: Problem
    lead: tuple[int, ...]      # leading (batch) dims of the user's q; () for 2-D and 3-D
    two_d: bool                # the user passed 2-D (N, D) inputs
    numpy: bool                # the user passed NumPy arrays

    def restore(self, t: torch.Tensor) -> Any:
        """(B, H, N, ...) → the user's layout (and NumPy if NumPy came in)."""
        if self.two_d:
            t = t[0, 0]
        elif len(self.lead) != 1:                 # one leading dim: B is it, nothing to do
            t = t.reshape(*self.lead, *t.shape[1:])
        if self.numpy:
            return t.detach().cpu().numpy()
        return t


def _to_tensor(x: Any, name: str) -> tuple[torch.Tensor, bool]:
    if isinstance(x, torch.Tensor):
        return x, False
    if isinstance(x, np.ndarray):
        x = np.ascontiguousarray(x)
        if not x.flags.writeable:                 # torch warns on read-only buffers
            x = x.copy()
        try:
            return torch.from_numpy(x), True
        except TypeError:                         # object, str, datetime, ... arrays
            raise TypeError(
                f"{name} is a NumPy array of dtype {x.dtype}, which torch cannot hold: "
                f"convert it with {name}.astype(np.float32)"
            ) from None
    raise TypeError(
        f"{name} must be a torch.Tensor or a numpy.ndarray, got {type(x).__name__}: "
        f"convert it with torch.as_tensor({name})"
    )


def _shape(t: torch.Tensor) -> str:
    return str(tuple(t.shape))


def _qkv_fit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """True when :func:`_check_qkv` has nothing to say: the common case in a few comparisons
    (plain tuple arithmetic on the shapes). False sends the call to the full check, which
    names what is wrong."""
    qs, ks, vs = q.shape, k.shape, v.shape
    r = len(qs)
    dt = q.dtype
    if r < 2 or len(ks) != r or len(vs) != r or not dt.is_floating_point \
            or k.dtype != dt or v.dtype != dt or qs[-1] != ks[-1] or ks[-2] != vs[-2]:
        return False
    if r >= 3:
        h_kv = ks[-3]
        if vs[-3] != h_kv or h_kv == 0 or qs[-3] % h_kv:
            return False
        lead = qs[:-3]
        for t in (ks, vs):
            if t[:-3] != lead and not all(n in (m, 1) for m, n in zip(lead, t[:-3], strict=True)):
                return False
    return (q.is_cpu and k.is_cpu and v.is_cpu) or q.device == k.device == v.device


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if _qkv_fit(q, k, v):
        return
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() < 2:
            raise ValueError(
                f"{name} must be 2-D (N, D) or at least 3-D (..., H, N, D), got shape "
                f"{_shape(t)}"
            )
        if not t.dtype.is_floating_point:
            raise TypeError(
                f"{name} must be a floating-point tensor, got dtype {t.dtype}: "
                f"convert with {name}.float() (NumPy: {name}.astype(np.float32))"
            )
    if not (q.dim() == k.dim() == v.dim()):
        raise ValueError(
            f"q, k, v must have the same rank, got q {_shape(q)}, k {_shape(k)}, v {_shape(v)}: "
            "use (..., H, N, D) for all three (or 2-D (N, D) for all three)"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}: "
            "cast them to one dtype, e.g. k.to(q.dtype)"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k, v must be on one device, got q on {q.device}, k on {k.device}, "
            f"v on {v.device}: move them with .to(q.device)"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must have the same feature width D_k, got q {_shape(q)} (D_k={q.shape[-1]})"
            f" and k {_shape(k)} (D_k={k.shape[-1]}): project them to one width"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"k and v must have the same number of keys N_k, got k {_shape(k)} "
            f"(N_k={k.shape[-2]}) and v {_shape(v)} (N_k={v.shape[-2]}): every key needs a value"
        )
    if q.dim() >= 3:
        lead = q.shape[:-3]
        if not all(n in (m, 1) for t in (k, v) for m, n in zip(lead, t.shape[:-3], strict=True)):
            raise ValueError(
                f"q, k, v must have the same leading (batch) dims, or k and v a size of 1 in a "
                f"batch dim (broadcast over the queries' batch, as in FlexAttention), got q "
                f"{_shape(q)}, k {_shape(k)}, v {_shape(v)}: expand them to one batch shape"
            )
        if k.shape[-3] != v.shape[-3]:
            raise ValueError(
                f"k and v must have the same number of heads H_kv, got k {_shape(k)} "
                f"(H_kv={k.shape[-3]}) and v {_shape(v)} (H_kv={v.shape[-3]})"
            )
        h_q, h_kv = q.shape[-3], k.shape[-3]
        if h_kv == 0 and h_q > 0:
            raise ValueError(
                f"k and v have no heads (H_kv=0) but q has H_q={h_q} query heads (q "
                f"{_shape(q)}, k {_shape(k)}): every query head needs a key/value head; give "
                f"k and v 1 head (MQA), H_q heads (MHA) or a number that divides H_q"
            )
        if h_kv > 0 and h_q % h_kv != 0:
            raise ValueError(
                f"the number of query heads H_q={h_q} must be a multiple of the number of "
                f"key/value heads H_kv={h_kv} (q {_shape(q)}, k {_shape(k)}): use H_kv that "
                f"divides H_q (H_kv=1 is MQA, H_kv=H_q is MHA)"
            )


def _check_number(x: Any, name: str) -> float:
    if type(x) is float and math.isfinite(x):        # the common case, without ABC checks
        return x
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real) \
            or not math.isfinite(x):
        raise ValueError(f"{name} must be a finite number, got {x!r}")
    return float(x)


def _check_in_range(x: float, name: str, dtype: torch.dtype) -> float:
    """``x`` (already finite) must stay finite and non-zero-by-underflow in the compute dtype
    of ``dtype`` inputs; kernels multiply by small constants (log2 e, 2), hence the margin."""
    cd = _compute_dtype(dtype)
    fi = torch.finfo(cd)
    hi = fi.max / 4
    if abs(x) > hi or (x != 0 and abs(x) < fi.tiny):
        raise ValueError(
            f"{name}={x!r} is out of range for {dtype} inputs, which are computed in "
            f"{str(cd).replace('torch.', '')}: |{name}| must lie in [{fi.tiny:.3g}, {hi:.3g}]"
            f"{' (or be 0)' if name == 'scale' else ''} — outside it the logits overflow to "
            f"±inf/NaN or collapse to 0. Rescale q (or k) instead, or use float64 inputs"
        )
    return x


def _check_causal_flag(mask: Any, is_causal: Any) -> None:
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(
            f"is_causal must be True or False, got {is_causal!r} ({type(is_causal).__name__})"
        )
    if is_causal and mask is not None:
        raise ValueError(
            "give either mask=... or is_causal=True, not both: combine them as "
            "mask=attnkit.masks.causal() & your_mask"
        )


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """The shape / dtype / device checks of a call on q, k, v (tensors, fake ones too)."""
    _check_qkv(q, k, v)


def _normalise_mask(
    mask: Any, is_causal: bool, full_shape: tuple[int, ...], lead: tuple[int, ...],
    device: torch.device, two_d: bool = False, dtype: torch.dtype = torch.float32,
) -> tuple[_masks.Mask | None, torch.Tensor | None, torch.Tensor | None]:
    """→ (structured mask or None, finite additive bias or None, the structured mask's bool
    tensor when it came as one — ``Problem.mask_tensor`` — or None) in the (B, H, N_q, N_k)
    frame."""
    _check_causal_flag(mask, is_causal)
    if is_causal:
        return _masks.causal(), None, None
    if mask is None:
        return None, None, None
    if isinstance(mask, _masks.Mask):
        return mask, None, None
    if isinstance(mask, np.ndarray):
        mask, _ = _to_tensor(mask, "mask")
    if not isinstance(mask, torch.Tensor):
        raise TypeError(
            f"mask must be an attnkit.masks.Mask, a bool tensor (True = may attend) or a float "
            f"tensor added to the logits, got {type(mask).__name__}"
        )
    if mask.device != device:
        raise ValueError(f"mask is on {mask.device} but q is on {device}: move it with .to()")
    # the mask broadcasts *to* the logits: it may not enlarge them (B=1 vs a mask of 2)
    if not _broadcasts_to(tuple(mask.shape), full_shape):
        target = "(N_q, N_k)" if two_d else "(..., H_q, N_q, N_k)"
        shown = tuple(full_shape[1:]) if two_d else tuple(full_shape)
        raise ValueError(
            f"mask of shape {_shape(mask)} does not broadcast to {target} = "
            f"{shown}: give a mask whose dims are those sizes or 1 "
            "(e.g. (N_q, N_k) or (B, 1, N_q, N_k))"
        )
    m = _mask_in_frame(mask, len(full_shape), lead)
    if mask.dtype == torch.bool:
        return _masks.from_tensor(m, name=f"bool mask {_shape(mask)}"), None, m
    if not mask.dtype.is_floating_point:
        raise TypeError(
            f"mask must be bool (True = may attend) or floating point (added to the logits), "
            f"got dtype {mask.dtype}"
        )
    if torch.isnan(m).any() or (m == torch.inf).any():
        raise ValueError("a float mask may hold finite values and -inf only (found NaN or +inf)")
    cd = _compute_dtype(dtype)
    if torch.finfo(m.dtype).max > torch.finfo(cd).max:
        # a wider mask (float64 for float32 inputs) is added in the compute dtype: values
        # beyond its range would become ±inf there (+inf → NaN rows); below it means blocked
        big = torch.finfo(cd).max
        if bool((m > big).any()):
            raise ValueError(
                f"a float mask of {mask.dtype} holds values up to {m.max().item():.3g}, beyond "
                f"the range of {str(cd).replace('torch.', '')} (max {big:.3g}) in which "
                f"{dtype} inputs are computed: they would overflow to +inf. Give values "
                "within it (use -inf for blocked positions)"
            )
        m = torch.where(m < -big, torch.full_like(m, -torch.inf), m)
    blocked = m == -torch.inf
    structured = allowed = None
    if blocked.any():
        allowed = ~blocked
        structured = _masks.from_tensor(allowed, name=f"float mask {_shape(mask)} (-inf)")
        m = torch.where(blocked, torch.zeros_like(m), m)
    # an all-zero bias adds nothing — unless it is being learnt (its gradient is needed)
    bias = m if m.requires_grad or bool((m != 0).any()) else None
    return structured, bias, allowed


def _mask_in_frame(mask: torch.Tensor, rank: int, lead: tuple[int, ...]) -> torch.Tensor:
    """A mask tensor that broadcasts to the logits ``(…lead, H, N_q, N_k)`` (rank ``rank``)
    as ``(B|1, H|1, N_q|1, N_k|1)`` — views, but for leading dims broadcast in part."""
    m = mask if mask.dim() == rank else \
        mask.reshape((1,) * (rank - mask.dim()) + tuple(mask.shape))
    n_lead = len(lead)
    if n_lead == 1:
        return m                                 # (B|1, …) already: the frame's dim 0
    if n_lead == 0:
        return m.unsqueeze(0)
    ms = m.shape
    if all(s == 1 for s in ms[:n_lead]):
        return m.reshape(1, *ms[n_lead:])
    return m.expand(*lead, *ms[n_lead:]).reshape(math.prod(lead), *ms[n_lead:])


def _broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether ``shape`` broadcasts to ``target`` without enlarging it (each dim, aligned on
    the right, is the target's size or 1) — plain tuple arithmetic, no torch call."""
    n = len(shape)
    return n <= len(target) and all(
        s == t or s == 1 for s, t in zip(shape, target[len(target) - n:], strict=True))


def prepare(
    q: Any, k: Any, v: Any, *, mask: Any = None, is_causal: bool = False,
    scale: float | None = None, softcap: float | None = None,
    score_mod: ScoreMod | None = None, dropout_p: float = 0.0,
) -> Prepared:
    """Validate a call and normalise it into one :class:`Problem` (layout (B, H, N, D))."""
    q, q_np = _to_tensor(q, "q")
    k, k_np = _to_tensor(k, "k")
    v, v_np = _to_tensor(v, "v")
    if not q_np == k_np == v_np:
        kinds = ", ".join(f"{n} {'NumPy' if f else 'torch'}" for n, f in
                          (("q", q_np), ("k", k_np), ("v", v_np)))
        raise TypeError(
            f"q, k, v must be all torch tensors or all NumPy arrays, got {kinds}: a NumPy "
            "result would silently drop autograd; convert with torch.from_numpy(...)"
        )
    _check_qkv(q, k, v)
    two_d = q.dim() == 2
    if two_d:
        q4, k4, v4 = (t[None, None] for t in (q, k, v))
        lead: tuple[int, ...] = ()
    else:
        lead = tuple(q.shape[:-3])
        q4, k4, v4 = _flatten_batch(q, lead), _flatten_batch(k, lead), _flatten_batch(v, lead)
    full_shape = (*lead, q4.shape[1], q4.shape[2], k4.shape[2])
    if mask is None and is_causal is False:
        structured = bias = dense = None
    else:
        structured, bias, dense = _normalise_mask(mask, is_causal, full_shape, lead, q.device,
                                                  two_d, q.dtype)
    d_k = q.shape[-1]
    if scale is None:
        scale_f = 1.0 / math.sqrt(d_k) if d_k > 0 else 1.0
    else:
        scale_f = _check_in_range(_check_number(scale, "scale"), "scale", q.dtype)
    if softcap is not None:
        softcap = _check_number(softcap, "softcap")
        if softcap <= 0:
            raise ValueError(
                f"softcap must be > 0 (logits are mapped to c·tanh(x/c)), got {softcap}: "
                "pass softcap=None for no cap (flash-attn's softcap=0.0 means none)"
            )
        softcap = _check_in_range(softcap, "softcap", q.dtype)
    if score_mod is not None and not callable(score_mod):
        raise TypeError(
            "score_mod must be a function score_mod(score, b, h, q_idx, kv_idx) -> score, "
            f"got {type(score_mod).__name__}"
        )
    dropout_p = _check_number(dropout_p, "dropout_p")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    p = Problem(q4, k4, v4, mask=structured, bias=bias, scale=scale_f, softcap=softcap,
                score_mod=score_mod, dropout_p=dropout_p, mask_tensor=dense)
    if score_mod is not None and not _is_empty(p):
        # FlexAttention's per-score semantics, result cast back to the score dtype and
        # checked: every backend calls this wrapper unchanged (see attnkit.scores)
        p.score_mod = _scores.checked_score_mod(
            score_mod, batch=p.batch, heads=p.heads_q, n_q=p.n_q, n_k=p.n_k,
            dtype=_compute_dtype(p.dtype), device=p.device)
    if structured is not None:
        nb, nh = structured.batch_size, structured.heads_size
        if nb is not None and nb > 1 and nb != p.batch:
            raise ValueError(
                f"mask {structured.name} was built for batch {nb} but the inputs have batch "
                f"{p.batch} (q {_shape(q)}): give one length/id row per batch element"
            )
        if nh is not None and nh > 1 and nh != p.heads_q:
            raise ValueError(
                f"mask {structured.name} was built for {nh} heads but the inputs have "
                f"H_q={p.heads_q} query heads (q {_shape(q)}): give one mask per query head "
                "(or a head dim of 1 to share it)"
            )
    return Prepared(p, lead, two_d, q_np)


def _flatten_batch(t: torch.Tensor, lead: tuple[int, ...]) -> torch.Tensor:
    """(…lead', H, N, D) → (B, H, N, D) with B = prod(lead). K/V with batch 1 (lead' all 1)
    become a stride-0 ``expand`` view: one copy of K/V serves every batch element."""
    rest = t.shape[-3:]
    if t.shape[:-3] == lead:
        return t if len(lead) == 1 else t.reshape(math.prod(lead), *rest)
    if all(n == 1 for n in t.shape[:-3]):
        return t.reshape(1, *rest).expand(math.prod(lead), *rest)
    return t.expand(*lead, *rest).reshape(math.prod(lead), *rest)   # partly broadcast: copies


def _is_empty(p: Problem) -> bool:
    """No score to compute: zero batch, query heads, queries or keys (never sent to a
    backend — zero-size kernels launch with a zero grid or divide by zero)."""
    return p.batch == 0 or p.heads_q == 0 or p.n_q == 0 or p.n_k == 0


def _empty_result(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero B, H_q or N_q → empty output; N_k = 0 → zeros (nothing to attend to), LSE −∞."""
    out = p.q.new_zeros(p.batch, p.heads_q, p.n_q, p.d_v)
    lse = torch.full((p.batch, p.heads_q, p.n_q), -torch.inf, device=p.device,
                     dtype=_compute_dtype(p.dtype))
    if p.requires_grad:               # keep the graph: zero gradients (NaN inputs included)
        no = torch.zeros((), dtype=torch.bool, device=p.device)
        zero = sum(torch.where(no, t.sum(), 0.0) for t in (p.q, p.k, p.v, p.bias)
                   if t is not None and t.requires_grad)
        out, lse = out + zero.to(out.dtype), lse + zero.to(lse.dtype)
    return out, lse


def _bad_kv_rows(p: Problem) -> torch.Tensor:
    """(B, H_kv, N_k) True where a K or V row holds NaN or ±inf (K/V broadcast over the
    batch, stride 0, are read once)."""
    def once(t: torch.Tensor) -> torch.Tensor:
        return t[:1] if t.shape[0] > 1 and t.stride(0) == 0 else t

    bad = ~(torch.isfinite(once(p.k)).all(-1) & torch.isfinite(once(p.v)).all(-1))
    return bad.expand(p.batch, *bad.shape[1:])


def _kv_finite(p: Problem) -> bool:
    """Whether every K and V element is finite, known from one pass over each
    (:func:`native.known_finite`: the kernel's, else a torch sum; K/V broadcast over the
    batch read once); False when it cannot say (the caller then finds the rows with torch).
    A bf16 (1, 8, 2048, 64) K and V: ~0.3 ms in the kernel against ~10 ms for
    isfinite(...).all(-1) (four elementwise kernels and a reduction each), one core."""
    k, v = p.k.detach(), p.v.detach()
    if k.shape[0] > 1 and k.stride(0) == 0 and v.stride(0) == 0:
        k, v = k[:1], v[:1]
    return _native.known_finite(k) and _native.known_finite(v)


def _non_finite_kv_rows(p: Problem) -> torch.Tensor | None:
    """``(B, H_kv, N_k)`` True where a K or V row holds NaN or ±inf, or None when none does
    (:func:`_kv_finite` decides that first; the rows' exact test only when it cannot)."""
    if _kv_finite(p):
        return None
    bad = _bad_kv_rows(p)
    return bad if bool(bad.any()) else None


def _may_score_minus_inf(p: Problem) -> bool:
    """Whether the score_mod may score a key −∞: Python code, or an ALiBi / relative-bias
    term whose slopes or table (a few hundred numbers) hold a non-finite value."""
    if p.score_mod is None:
        return False
    terms = p.lowered.terms
    if terms.user is not None:
        return True
    data = terms.alibi.slopes if terms.alibi is not None else terms.relative.table  # type: ignore[union-attr]
    return not bool(torch.isfinite(torch.as_tensor(data).detach()).all())


def _run(p: Problem, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    qs, ks, vs = p.q.shape, p.k.shape, p.v.shape
    if qs[0] == 0 or qs[1] == 0 or qs[2] == 0 or ks[2] == 0:      # _is_empty, inlined
        return _empty_result(p)
    if qs[3] == 0 or vs[3] == 0:
        # a zero-width head: widen it by one zero column (the scores and the mix stay the
        # same), so that no kernel sees a zero-size dim, and cut the output back
        def widen(t: torch.Tensor, d: int) -> torch.Tensor:
            return t if d else torch.cat([t, t.new_zeros(*t.shape[:-1], 1)], dim=-1)

        wide = dataclasses.replace(p, q=widen(p.q, p.d_k), k=widen(p.k, p.d_k),
                                   v=widen(p.v, p.d_v))
        out, lse = _run(wide, backend)
        return out[..., :p.d_v], lse
    chosen = _backends.select(p, backend)
    # Non-finite K/V rows must not leak through zero weights (0·NaN = NaN). Checking up front
    # costs one read of K and V; without autograd we only check when the output shows it —
    # except under a score_mod that may give −∞: that is a score, not a mask (a key it
    # removes still passes NaN on, as in the formula), and a kernel skipping P == 0 hides it.
    # (Up front: the kernel's one pass over K and V first, _non_finite_kv_rows; the rows'
    # exact test cost 6% of a float32 causal forward + backward at N = 2048.) Without
    # autograd, a user score_mod's K/V screen comes after the call instead, and only where
    # the backend's screened forward could not vouch for the K/V rows it read (a backend
    # with screens_kv: its finite says so, see Backend.forward_screened): the same result, as a
    # call with finite K/V gets the same output either way, and one with a non-finite row
    # is run again below on cleaned K/V as it would have been (the native kernel's own K/V
    # screen: ~2% of a bf16 causal call at N = 4096, one thread).
    up_front = p.requires_grad or _may_score_minus_inf(p)
    # (not with dropout: a rerun on cleaned K/V would draw the weights' mask anew)
    late = up_front and not p.requires_grad and p.lowered.terms.user is not None \
        and not p.dropout_p and getattr(chosen, "screens_kv", False) is True
    bad = _non_finite_kv_rows(p) if up_front and not late else None
    if bad is None:
        screened = getattr(chosen, "forward_screened", None)   # (a duck-typed backend:
        if screened is None:                                    # no such method)
            out, lse = chosen.forward(p)
        else:
            out, lse, finite = screened(p)       # finite: the kernel read out's screen
            if finite:
                return out, lse
        if late:                                 # the K/V screen the call did not vouch for
            bad = _non_finite_kv_rows(p)
            if bad is None:
                return out, lse
        else:
            # one-pass screen: NaN/inf anywhere make the sum non-finite (an overflowing sum
            # of finite values only sends us to the exact check below); math.isfinite on the
            # sum's value: torch.isfinite is several tensor ops, a cost on every small call.
            # The sum is taken in the output's dtype (float32 accumulation inside; bfloat16
            # has float32's range) but for float16, whose range a sum of finite outputs can
            # leave; float() of the 0-dim sum costs less than .item()
            # (detached: a score_mod parameter's gradient makes out require grad, and float()
            # of a 0-dim tensor that does warns)
            o = out.detach() if out.requires_grad else out
            if up_front or math.isfinite(float(
                    o.sum(dtype=torch.float32) if o.dtype is torch.float16 else o.sum())):
                return out, lse
            bad = _bad_kv_rows(p)
            if not bad.any():
                return out, lse
    zero = torch.zeros((), dtype=p.dtype, device=p.device)
    clean = dataclasses.replace(p, k=torch.where(bad[..., None], zero, p.k),
                                v=torch.where(bad[..., None], zero, p.v))
    out, lse = chosen.forward(clean)
    hit = _attends_to(p, bad)                                   # (B, H_q, N_q)
    out = torch.where(hit[..., None], torch.full_like(out, torch.nan), out)
    lse = torch.where(hit, torch.full_like(lse, torch.nan), lse)
    return out, lse


def _attends_to(p: Problem, bad: torch.Tensor) -> torch.Tensor:
    """(B, H_q, N_q) True where a query may attend to a bad key row (rows of 256 at a time)."""
    bad_q = bad.repeat_interleave(p.group, dim=1)[:, :, None, :]   # (B, H_q, 1, N_k)
    rows = []
    for q0 in range(0, p.n_q, 256):
        q1 = min(q0 + 256, p.n_q)
        if p.mask is None:
            allowed = torch.ones(1, 1, q1 - q0, p.n_k, dtype=torch.bool, device=p.device)
        else:
            allowed = p.mask.evaluate(p.n_q, p.n_k, q_range=(q0, q1), batch=p.batch,
                                      heads=p.heads_q, device=p.device)
        rows.append((allowed & bad_q).any(-1).expand(p.batch, p.heads_q, q1 - q0))
    return torch.cat(rows, dim=-1)


# ------------------------------------------------------------------ validated once
# A call's validation and normalisation depend on its signature only — shapes, dtypes,
# devices, the options and a bool mask tensor's shape — when it has no float mask, Mask
# object or score_mod (whose values prepare() reads): then what prepare() found is
# remembered per signature, and a repeat (a decoder's per-token call) only rebuilds the
# Problem around its new tensors. Nothing about the tensors' *values* is remembered: the
# NaN/inf screens in _run read every call's own, and a bool mask is read as it is now.
_FRAMES: dict[tuple[Any, ...], _Frame] = {}
_FRAMES_MAX = 256                   # distinct signatures kept (then the dict starts afresh)
_PLAIN = (float, int, type(None))


class _Frame:
    """What prepare() made of one call signature (see above)."""

    __slots__ = ("lead", "two_d", "mask", "scale", "softcap", "dropout_p", "as_is", "rank",
                 "mask_name", "last_mask", "lowered", "lane", "plain", "hot")

    def __init__(self, prep: Prepared, as_is: tuple[bool, bool, bool],
                 mask_name: str | None) -> None:
        p = prep.problem
        self.lead, self.two_d = prep.lead, prep.two_d
        self.mask, self.scale, self.softcap, self.dropout_p = (p.mask, p.scale, p.softcap,
                                                               p.dropout_p)
        self.as_is = as_is          # q, k, v reach the Problem unchanged (no view needed)
        self.rank = len(prep.lead) + 3 if not prep.two_d else 3   # the logits' rank
        self.mask_name = mask_name  # a bool mask tensor's Mask name (None: no mask tensor)
        # (the user's mask tensor, its memory (pointer, strides), its Mask, its view, the
        # Problem lowered with that Mask) of the last call: a model's layers pass one mask
        # tensor to every layer of a step. The Mask reads the tensor's memory (a view, never
        # a copy), so the same tensor object over the same memory is the same mask whatever
        # its values are now.
        self.last_mask: tuple[Any, ...] = (None, None, None, None, None)
        # the lowered form of the frame's own mask (no mask, or is_causal): one per signature
        self.lowered = None if mask_name is not None else p.lowered
        self.lane: _Lane | None = None  # the backend choice, remembered (see _Lane)
        # 4-D q, k, v reach the kernel as they are and its outputs are the user's (attend's
        # inlined lean launch; else _Frame.lean)
        self.plain = as_is == (True, True, True) and not prep.two_d and len(prep.lead) == 1
        self.hot: _Hot | None = None    # (made by attnkit.attention's first lean repeat)

    def prepared(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 mask: torch.Tensor | None) -> Prepared:
        lead, two_d = self.lead, self.two_d
        qi, ki, vi = self.as_is
        if two_d:
            q4, k4, v4 = q[None, None], k[None, None], v[None, None]
        else:
            q4 = q if qi else _flatten_batch(q, lead)
            k4 = k if ki else _flatten_batch(k, lead)
            v4 = v if vi else _flatten_batch(v, lead)
        if self.mask_name is None:
            p = Problem(q4, k4, v4, mask=self.mask, scale=self.scale, softcap=self.softcap,
                        dropout_p=self.dropout_p)
            return Prepared(p.lowered_as(self.lowered), lead, two_d, False)
        last = self.last_mask                    # a bool mask tensor: this call's values
        ptr = (mask.data_ptr(), mask.stride())  # type: ignore[union-attr]
        if last[0] is mask and last[1] == ptr:
            p = Problem(q4, k4, v4, mask=last[2], scale=self.scale, softcap=self.softcap,
                        dropout_p=self.dropout_p, mask_tensor=last[3])
            return Prepared(p.lowered_as(last[4]), lead, two_d, False)
        dense = _mask_in_frame(mask, self.rank, lead)  # type: ignore[arg-type]
        structured = _masks.from_tensor(dense, name=self.mask_name)
        p = Problem(q4, k4, v4, mask=structured, scale=self.scale, softcap=self.softcap,
                    dropout_p=self.dropout_p, mask_tensor=dense)
        self.last_mask = (mask, ptr, structured, dense, p.lowered)
        return Prepared(p, lead, two_d, False)


    def lean(self, launch: _native.LeanLaunch, q: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, mask: torch.Tensor | None, return_lse: bool) -> Any:
        """The call run on the kernel's lean operator (what ``_run`` would run: see
        :class:`_Lane`), in the user's layout; None when an output is not finite (the full
        path then screens K/V as ``_run`` does)."""
        lead, two_d = self.lead, self.two_d
        if two_d:
            q4, k4, v4 = q[None, None], k[None, None], v[None, None]
        else:
            qi, ki, vi = self.as_is
            q4 = q if qi else _flatten_batch(q, lead)
            k4 = k if ki else _flatten_batch(k, lead)
            v4 = v if vi else _flatten_batch(v, lead)
        dense = _mask_in_frame(mask, self.rank, lead) if launch.masked else None  # type: ignore[arg-type]
        out, lse, finite = launch.op(  # type: ignore[operator]  (strided rows: copied there)
            q4, k4, v4, launch.scale, launch.softcap, launch.band_lo, launch.band_hi, dense,
            launch.splits, launch.block_q, launch.check_q)
        if not finite:
            return None
        _count(native=1)
        if two_d:
            out, lse = out[0, 0], lse[0, 0]
        elif len(lead) != 1:
            out = out.reshape(*lead, *out.shape[1:])
            lse = lse.reshape(*lead, *lse.shape[1:])
        return (out, lse) if return_lse else out


# ------------------------------------------------------------------ the last hot frame
# attnkit.attention's per-token call first tries the frame of the last call it ran on the
# lean operator (_HOT): a decoder's layers repeat one signature per step. Python compares the
# options only; the operator attend_slot compares the tensors' sizes, dtypes and device with
# the frame's signature tensors and declines a call that needs gradients, so the call reads
# no tensor attribute in Python. A declined call takes the keyed path (and becomes _HOT).
class _Hot:
    """A plain frame's signature for ``attend_slot``, and the options its key holds."""

    __slots__ = ("frames", "frame", "sigs", "is_causal", "scale", "softcap", "dropout_p")

    def __init__(self, frame: _Frame, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 key: tuple[Any, ...]) -> None:
        self.frames = _FRAMES           # the dict the frame is in (a new dict: not hot)
        self.frame = frame
        # stride-0 views of one element each: the sizes and dtypes of q, k, v
        self.sigs = tuple(torch.empty((), dtype=t.dtype).expand(t.shape) for t in (q, k, v))
        self.is_causal, self.scale, self.softcap, self.dropout_p = key[7:11]


_HOT: _Hot | None = None
# attend_slot's status: ran and every output finite / declined (nothing run) / ran, not finite
SLOT_FINITE, SLOT_DECLINED, SLOT_NOT_FINITE = 0, 1, 2


# ------------------------------------------------------------------ the backend, remembered
# backend="auto" asks every backend in priority order on every call; for a frame's repeats
# the answer is remembered with everything it depends on besides the signature, and a call
# whose state differs is chosen afresh by select(). Only built-in backends are remembered:
# the triton backend refusing CPU tensors (no TRITON_INTERPRET) before the decode backend,
# whose native run depends on the signature, native_enabled() and the loader (ATTNKIT_NATIVE).
class _Lane:
    """The backend a frame's calls choose, and what that choice depends on."""

    __slots__ = ("state", "consulted", "launch")

    def __init__(self, state: tuple[Any, ...],
                 consulted: tuple[tuple[str, Any, dict[str, Any], int], ...],
                 launch: _native.LeanLaunch | None) -> None:
        self.state = state            # (_lane_state(): the choice's inputs besides p)
        # (name, backend, vars(backend), len(vars(backend))) of each backend select asked:
        # a repeat compares the length of the remembered dict (an attribute set on the
        # instance, as monkeypatch does, lands in it) — no vars() lookup per call
        self.consulted = consulted
        self.launch = launch          # the decode backend's lean launch, or None (full path)


_SELECT = _backends.select
_SCOPE = _backends._SCOPE            # what backends.current() reads
_NATIVE = _native._NATIVE            # what native.native_enabled() reads
_num_threads = torch.get_num_threads
_grad_enabled = torch.is_grad_enabled
_Tensor = torch.Tensor


def _lane_state(backend: str) -> tuple[Any, ...]:
    """(backend, scope, priority, native switch, loader state, threads, select): what a
    lane's choice depends on besides the Problem (a plain tuple: built on every call)."""
    # (C calls and one loader call: after a decode call has streamed its K/V through the
    # caches, every Python function and torch binding this touches is a cache miss)
    return (backend, _SCOPE.get(), list(_backends.PRIORITY), _NATIVE.get(),
            _loader.hot_state(), _num_threads(), _backends.select)


_REFUSERS = {("attnkit.backends.triton", "TritonBackend"),   # CPU tensors, no interpreter
             ("attnkit.backends.decode", "DecodeBackend")}   # more than 16 queries
_LEAN = {("attnkit.backends.decode", "DecodeBackend"), ("attnkit.backends.tiled", "TiledBackend")}


def _make_lane(p: Problem, backend: str) -> _Lane:
    """The lane of a frame's CPU call ``p`` (run clean by ``_run`` just now, without
    gradients): the backends ``select`` asks before its choice must be built-in ones whose
    refusal depends on the signature and the state only, and the choice a built-in one with
    a lean launch; else the lane only remembers that the full path runs."""
    state = _lane_state(backend)
    _, scope, priority, _, _, _, select = state       # (the names of _lane_state's fields)
    if backend != "auto":
        order: tuple[str, ...] = (backend,)
    elif scope is not None:
        order = scope
    else:
        order = priority
    consulted: list[tuple[str, Any, dict[str, Any], int]] = []
    launch = None
    if select is _SELECT and not _loader.switch("TRITON_INTERPRET", False) and p.q.is_cpu \
            and not _is_empty(p) \
            and p.d_k > 0 and p.d_v > 0:  # (what _run answers itself selects nothing)
        chosen = _SELECT(p, backend)
        reg = _backends.REGISTRY
        for name in order:
            b = reg.get(name)
            if b is None:
                continue
            consulted.append((name, b, vars(b), len(vars(b))))
            kind = (type(b).__module__, type(b).__qualname__)
            if b is chosen:
                if kind in _LEAN and not vars(b):
                    launch = b.lean(p)
                break
            if kind not in _REFUSERS or "can_run" in vars(b):
                break
    return _Lane(state, tuple(consulted), launch)


def _remember(key: tuple[Any, ...], prep: Prepared, q: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
    p = prep.problem
    tensor_mask = key[-1] is not None
    if p.score_mod is not None or p.bias is not None or (p.mask_tensor is not None) != tensor_mask:
        return                                   # (not the calls attend keys)
    if len(_FRAMES) >= _FRAMES_MAX:
        _FRAMES.clear()
    _FRAMES[key] = _Frame(prep, (p.q is q, p.k is k, p.v is v),
                          p.mask.name if tensor_mask else None)  # type: ignore[union-attr]


def attend(q: Any, k: Any, v: Any, *, mask: Any = None, is_causal: bool = False,
           scale: float | None = None, softcap: float | None = None,
           score_mod: ScoreMod | None = None, dropout_p: float = 0.0, backend: str = "auto",
           return_lse: bool = False) -> Any:
    """:func:`attnkit.attention` run eagerly (its arguments; ``backend`` already checked):
    the signature's frame or :func:`prepare`, then ``_run``, results in the user's
    layout.

    A decoder's per-token call (a frame whose lane holds a lean launch) is written out here
    in one function — its signature, the lane's check (does the remembered choice still
    stand: the state as :func:`_lane_state` reads it, and the registry entries asked unchanged,
    instance attributes included — a patched ``extra_reasons`` shows as one more), the launch
    (:meth:`_Frame.lean`): after the kernel has streamed a long K/V cache through the CPU's
    caches, each Python function such a call enters costs microseconds of cache misses
    (1 query × 4096 keys bf16: 30 → 18 µs around the kernel, one core)."""
    # The signature of a call whose preparation depends on nothing else (_FRAMES), or None.
    # A bool mask tensor (transformers' padding masks) takes part by its shape and device:
    # its values are read by the kernels, never by the preparation.
    key = None
    if score_mod is None and type(q) is _Tensor and type(k) is _Tensor and type(v) is _Tensor \
            and type(scale) in _PLAIN and type(softcap) in _PLAIN \
            and type(dropout_p) in _PLAIN and (is_causal is True or is_causal is False):
        # (True for three CPU tensors: no device objects made, hashed and compared)
        dev = True if q.is_cpu and k.is_cpu and v.is_cpu else (q.device, k.device, v.device)
        if mask is None:
            key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, dev, is_causal, scale,
                   softcap, dropout_p, None)
        elif type(mask) is _Tensor and mask.dtype is torch.bool:
            key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, dev, is_causal, scale,
                   softcap, dropout_p, (mask.shape, mask.device))
    frame = None if key is None else _FRAMES.get(key)
    if frame is None:
        prep = prepare(q, k, v, mask=mask, is_causal=is_causal, scale=scale, softcap=softcap,
                       score_mod=score_mod, dropout_p=dropout_p)
        if key is not None:
            _remember(key, prep, q, k, v)
        out, lse = _run(prep.problem, backend)
        return (prep.restore(out), prep.restore(lse)) if return_lse else prep.restore(out)
    lane = frame.lane
    grad = _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    holds = not grad and lane is not None and _lane_holds(lane, backend)
    launch = lane.launch if holds else None  # type: ignore[union-attr]
    if launch is not None:
        if frame.plain and not launch.masked:                               # frame.lean
            out, lse, finite = launch.op(q, k, v, *launch.tail)  # type: ignore[operator]
            if finite:
                if _COUNTS.get() is not None:
                    _count(native=1)
                return (out, lse) if return_lse else out
        else:
            got = frame.lean(launch, q, k, v, mask, return_lse)
            if got is not None:
                return got
    prep = frame.prepared(q, k, v, mask)
    out, lse = _run(prep.problem, backend)
    if not grad and not holds:
        frame.lane = _make_lane(prep.problem, backend)
    return (prep.restore(out), prep.restore(lse)) if return_lse else prep.restore(out)


def _lane_holds(lane: _Lane, backend: str) -> bool:
    """Whether ``lane``'s remembered choice still stands for a call with ``backend``: the
    state as :func:`_lane_state` reads it, and the registry entries asked unchanged, instance
    attributes included (a patched ``extra_reasons`` shows as one more). (:func:`attnkit.
    attention` writes these checks out for its per-token call: keep the two alike.)"""
    if lane.state != _lane_state(backend):
        return False
    reg = _backends.REGISTRY
    return all(reg.get(name) is b and len(attrs) == n_attrs
               for name, b, attrs, n_attrs in lane.consulted)


def run_frame(frame: _Frame, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: torch.Tensor | None, backend: str, return_lse: bool) -> Any:
    """A frame's call on the full path (``_run``: select, the NaN/inf screens), its lane
    kept — what :func:`attnkit.attention`'s per-token call runs when the lean launch's
    output is not finite (the screens then find out why, as :func:`attend` does)."""
    prep = frame.prepared(q, k, v, mask)
    out, lse = _run(prep.problem, backend)
    return (prep.restore(out), prep.restore(lse)) if return_lse else prep.restore(out)
