"""The ``triton`` backend: fused FlashAttention-2 style forward and backward on the GPU.

Each program of the forward kernel owns ``BLOCK_M`` queries of one (batch, head) and streams
over key tiles with an online softmax, so memory is O(N) and the (N_q, N_k) weights are never
written out. The backward recomputes the weights tile by tile from the saved log-sum-exp:
one kernel for dQ (per query tile) and one for dK/dV (per key tile of a K/V head, summed over
the query heads that share it — no atomics), after ``Δ = rowsum(dO ∘ O)`` in PyTorch.

Shape legend::

    q  (B, H_q,  N_q, D_k)      k  (B, H_kv, N_k, D_k)      v  (B, H_kv, N_k, D_v)
    out (B, H_q, N_q, D_v) in q's dtype      lse (B, H_q, N_q) float32 (float64 for float64)
    H_q = G · H_kv: query head h reads K/V head h // G (GQA / MQA)

What runs in-kernel:

- causal masks (both alignments) and sliding windows, and ``&`` of them: recognised as a band
  ``BAND_LO <= q_idx - kv_idx <= BAND_HI``, evaluated from the indices, and used to skip the
  tiles outside the band;
- every other mask (padding, document, prefix-LM, ``from_fn``, bool tensors, ``|``, ``~``):
  evaluated once into a uint8 tensor ``(B|1, H_q|1, N_q|1, N_k|1)`` that the kernels read a
  tile at a time (broadcast dimensions cost no memory); a band found among the ``&``-terms of
  such a mask still bounds the loops;
- ``softcap`` (forward and its derivative in the backward) and a finite additive ``bias``
  (read a tile at a time, like the mask);
- any N_q, N_k (boundary masks) and D_k, D_v ≤ 256 (padded to powers of two, masked);
- float16, bfloat16 (float32 accumulation), float32 (IEEE products, no TF32) and float64.

A query with no allowed key gets output 0 and LSE −∞, and zero gradients; nothing is NaN.

Caution
-------
- Needs CUDA tensors and the ``triton`` package. With ``TRITON_INTERPRET=1`` in the
  environment (read at each call) CPU tensors are accepted and the kernels run in Triton's
  interpreter — slow, for testing only.
- Not supported (``not_supported_reasons`` says so and ``backend="auto"`` moves on):
  ``score_mod`` (an arbitrary Python function), ``dropout_p > 0``, a ``bias`` that requires
  grad, D_k or D_v above 256.
- Masks that are not a band are materialised at (B|1, H_q|1, N_q, N_k) bytes, reduced to 1
  on each dimension the mask does not depend on; the kernels then visit every key tile.
- Band detection reads the parameters of the masks built by :func:`attnkit.masks.causal`,
  :func:`~attnkit.masks.sliding_window` and :func:`~attnkit.masks.full` (and their ``&``);
  a mask it does not recognise is simply treated as a general mask (correct, less fast).
- Launch parameters (block sizes, warps, stages) are fixed heuristics, not autotuned.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from .. import masks as _masks
from . import PRIORITY, register
from .base import Backend, Problem, compute_dtype

__all__ = ["TritonBackend", "interpreter_enabled", "triton_available"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_MAX_HEAD_DIM = 256
_MAX_DENSE_MASK = 2**31 - 1          # elements of the materialised general mask


def triton_available() -> bool:
    """Whether the ``triton`` package can be imported (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreter_enabled() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for Triton's CPU interpreter (read at each call)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


# --------------------------------------------------------------------------- kernel loading
_KERNELS: dict[bool, ModuleType] = {}


def _kernels(interpret: bool) -> ModuleType:
    """The kernel module, decorated for the GPU or for the interpreter.

    Triton picks compiled vs. interpreted when ``@triton.jit`` runs, so the same source file
    is loaded as two modules, each under the matching ``TRITON_INTERPRET`` setting.
    """
    if interpret in _KERNELS:
        return _KERNELS[interpret]
    name = f"{__package__}._triton_kernels" + ("_interpreted" if interpret else "")
    path = os.path.join(os.path.dirname(__file__), "_triton_kernels.py")
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved
    _KERNELS[interpret] = module
    return module


# --------------------------------------------------------------------------- masks
def _closure(fn: Any) -> dict[str, Any]:
    code = fn.__code__
    cells = [c.cell_contents for c in (fn.__closure__ or ())]
    return dict(zip(code.co_freevars, cells, strict=True))


_BAND_CODE = _masks.causal()._fn.__code__
_FULL_CODE = _masks.full()._fn.__code__
_AND_CODE = (_masks.full() & _masks.full())._fn.__code__


def _conjuncts(m: _masks.Mask) -> list[_masks.Mask]:
    """``a & (b & c)`` → ``[a, b, c]`` (any other mask is one term)."""
    if m._fn.__code__ is _AND_CODE:
        env = _closure(m._fn)
        a, b = env.get("a"), env.get("b_")
        if isinstance(a, _masks.Mask) and isinstance(b, _masks.Mask):
            return _conjuncts(a) + _conjuncts(b)
    return [m]


def _as_band(m: _masks.Mask, n_q: int, n_k: int) -> tuple[float, float] | None:
    """``(lo, hi)`` with allowed ⇔ ``lo <= q_idx - kv_idx <= hi``, or None if not a band."""
    code = m._fn.__code__
    if code is _FULL_CODE:
        return (-math.inf, math.inf)
    if code is _BAND_CODE:
        env = _closure(m._fn)
        if not {"lo", "hi", "br"} <= env.keys():        # masks.py changed: treat as general
            return None
        off = (n_k - n_q) if env["br"] else 0
        return (env["lo"] - off, env["hi"] - off)
    return None


@dataclass
class _MaskPlan:
    """How the kernels apply a mask: an index band, a dense uint8 tensor, or both."""

    band: tuple[int, int] | None = None          # (BAND_LO, BAND_HI), inclusive
    dense: torch.Tensor | None = None            # uint8 (B|1, H_q|1, N_q|1, N_k|1)


def _dense_size(m: _masks.Mask, p: Problem) -> int:
    b = p.batch if m.depends_on_batch else 1
    h = p.heads_q if m.depends_on_heads else 1
    return b * h * p.n_q * p.n_k


def _general_terms(p: Problem) -> tuple[tuple[int, int] | None, list[_masks.Mask]]:
    """Split ``p.mask`` into a band (from its band ``&``-terms) and the remaining terms."""
    if p.mask is None:
        return None, []
    lo, hi = -math.inf, math.inf
    rest: list[_masks.Mask] = []
    found = False
    for term in _conjuncts(p.mask):
        band = _as_band(term, p.n_q, p.n_k)
        if band is None:
            rest.append(term)
        elif band != (-math.inf, math.inf):
            found = True
            lo, hi = max(lo, band[0]), min(hi, band[1])
    if not found:
        return None, rest
    # beyond ±(N_q + N_k) a bound is the same as no bound; keep it a small int for the kernels
    lim = p.n_q + p.n_k + 1
    return (int(max(lo, -lim)), int(min(hi, lim))), rest


def _plan_mask(p: Problem) -> _MaskPlan:
    band, rest = _general_terms(p)
    if not rest:
        return _MaskPlan(band=band)
    general = rest[0]
    for term in rest[1:]:
        general = general & term
    d = general._dense(p.n_q, p.n_k, p.batch, p.heads_q, p.device)
    # keep broadcast (stride-0) dims at size 1 so that they cost no memory
    index = tuple(slice(0, 1) if (st == 0 and n > 1) else slice(None)
                  for st, n in zip(d.stride(), d.shape, strict=True))
    return _MaskPlan(band=band, dense=d[index].to(torch.uint8).contiguous())


def _broadcast_strides(t: torch.Tensor) -> tuple[int, int, int, int]:
    """Strides of a 4-D tensor with 0 on its size-1 dims (so the kernels may broadcast)."""
    b, h, n, k = (0 if size == 1 else st for size, st in zip(t.shape, t.stride(), strict=True))
    return b, h, n, k


def _bias4(bias: torch.Tensor) -> torch.Tensor:
    while bias.dim() < 4:
        bias = bias.unsqueeze(0)
    return bias


# --------------------------------------------------------------------------- launching
@dataclass
class _Launch:
    """Everything but the tensors that the three kernels need."""

    scale: float
    softcap: float | None
    plan: _MaskPlan
    fwd: tuple[int, ...]          # (BLOCK_M, BLOCK_N, num_warps, num_stages) of the forward
    bwd: tuple[int, ...]          # the same for both backward kernels
    interpret: bool


def _pow2(n: int) -> int:
    return max(16, 1 << (max(n, 1) - 1).bit_length())


def _tl_acc(dtype: torch.dtype, tl: Any) -> Any:
    return tl.float64 if dtype == torch.float64 else tl.float32


def _constexprs(L: _Launch, dtype: torch.dtype, d_k: int, d_v: int, tl: Any) -> dict[str, Any]:
    return dict(
        HAS_BAND=L.plan.band is not None, HAS_MASK=L.plan.dense is not None,
        HAS_SOFTCAP=L.softcap is not None, ACC=_tl_acc(dtype, tl), PRECISION="ieee",
        BLOCK_DK=_pow2(d_k), BLOCK_DV=_pow2(d_v),
    )


def _extras(
    L: _Launch, bias: torch.Tensor | None, dummy: torch.Tensor
) -> tuple[list[torch.Tensor], list[int]]:
    """Pointers ``[MASK, BIAS]`` and their strides (dummies when absent)."""
    m = L.plan.dense
    ptrs = [m if m is not None else dummy, bias if bias is not None else dummy]
    strides = [*(_broadcast_strides(m) if m is not None else (0, 0, 0, 0)),
               *(_broadcast_strides(bias) if bias is not None else (0, 0, 0, 0))]
    return ptrs, strides


def _scalars(L: _Launch) -> list[Any]:
    lo, hi = L.plan.band if L.plan.band is not None else (0, 0)
    return [L.scale, L.softcap if L.softcap is not None else 1.0, lo, hi]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _with_fallback(launch: Any, config: tuple[int, ...], interpret: bool) -> None:
    """Launch with ``config``; on a GPU whose shared memory is too small for it, retry with
    fewer pipeline stages, then with smaller tiles (down to 16 × 16)."""
    if interpret:
        launch(*config)
        return
    from triton.runtime.errors import OutOfResources

    bm, bn, warps, stages = config
    while True:
        try:
            launch(bm, bn, warps, stages)
            return
        except OutOfResources:
            if stages > 1:
                stages = 1
            elif max(bm, bn) > 16:
                bm, bn = (bm // 2, bn) if bm >= bn and bm > 16 else (bm, max(16, bn // 2))
                warps = max(1, min(warps, bm * bn // 256))
            else:
                raise


def _run_forward(
    L: _Launch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    kern = _kernels(L.interpret)
    B, H_q, N_q, D_k = q.shape
    H_kv, N_k, D_v = k.shape[1], k.shape[2], v.shape[3]
    out = q.new_empty(B, H_q, N_q, D_v)
    lse = torch.empty(B, H_q, N_q, device=q.device, dtype=compute_dtype(q.dtype))
    ptrs, strides = _extras(L, bias, lse)

    def launch(bm: int, bn: int, warps: int, stages: int) -> None:
        kern._fwd_kernel[(_cdiv(N_q, bm) * B * H_q,)](
            q, k, v, out, lse, *ptrs,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(), *lse.stride(), *strides,
            H_q, H_q // H_kv, N_q, N_k, D_k, D_v, *_scalars(L),
            HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps,
            num_stages=stages, **_constexprs(L, q.dtype, D_k, D_v, kern.tl),
        )

    _with_fallback(launch, L.fwd, L.interpret)
    return out, lse


def _run_backward(
    L: _Launch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
    out: torch.Tensor, lse: torch.Tensor, d_out: torch.Tensor, d_lse: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kern = _kernels(L.interpret)
    B, H_q, N_q, D_k = q.shape
    H_kv, N_k, D_v = k.shape[1], k.shape[2], v.shape[3]
    lse = lse.contiguous()
    # Δ_i = Σ_d dO_id O_id − dLSE_i  (dS = P ∘ (dP − Δ); the LSE's own gradient enters here)
    delta = torch.empty_like(lse)
    acc = _tl_acc(q.dtype, kern.tl)
    bm = L.bwd[0]
    kern._bwd_delta_kernel[(_cdiv(N_q, bm) * B * H_q,)](
        out, d_out, d_lse if d_lse is not None else lse, delta,
        *out.stride(), *d_out.stride(), *lse.stride(),
        *(d_lse.stride() if d_lse is not None else (0, 0, 0)), H_q, N_q, D_v,
        HAS_DLSE=d_lse is not None, ACC=acc, BLOCK_M=bm, BLOCK_DV=_pow2(D_v),
    )
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    ptrs, strides = _extras(L, bias, lse)
    const = _constexprs(L, q.dtype, D_k, D_v, kern.tl)

    def launch_dq(bm: int, bn: int, warps: int, stages: int) -> None:
        kern._bwd_dq_kernel[(_cdiv(N_q, bm) * B * H_q,)](
            q, k, v, d_out, dq, lse, delta, *ptrs,
            *q.stride(), *k.stride(), *v.stride(), *d_out.stride(), *dq.stride(),
            *lse.stride(), *strides, H_q, H_q // H_kv, N_q, N_k, D_k, D_v, *_scalars(L),
            HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps,
            num_stages=stages, **const,
        )

    def launch_dkdv(bm: int, bn: int, warps: int, stages: int) -> None:
        kern._bwd_dkdv_kernel[(_cdiv(N_k, bn) * B * H_kv,)](
            q, k, v, d_out, dk, dv, lse, delta, *ptrs,
            *q.stride(), *k.stride(), *v.stride(), *d_out.stride(), *dk.stride(),
            *dv.stride(), *lse.stride(), *strides, H_kv, H_q // H_kv, N_q, N_k, D_k, D_v,
            *_scalars(L), HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn,
            num_warps=warps, num_stages=stages, **const,
        )

    _with_fallback(launch_dq, L.bwd, L.interpret)
    _with_fallback(launch_dkdv, L.bwd, L.interpret)
    return dq, dk, dv


class _TritonAttention(torch.autograd.Function):
    """Autograd glue: (q, k, v) → (out, lse); the backward runs the dQ and dK/dV kernels."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        bias: torch.Tensor | None, L: _Launch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = _run_forward(L, q, k, v, bias)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.bias = bias
        ctx.launch = L
        return out, lse

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, d_out: torch.Tensor | None, d_lse: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        if d_out is None:
            d_out = torch.zeros_like(out)
        dq, dk, dv = _run_backward(ctx.launch, q, k, v, ctx.bias, out, lse, d_out, d_lse)
        return dq, dk, dv, None, None


# --------------------------------------------------------------------------- the backend
def _default_blocks(dtype: torch.dtype, d: int, interpret: bool) -> tuple[tuple[int, ...], ...]:
    """``((BLOCK_M, BLOCK_N, warps, stages) forward, (…) backward)`` for a dtype and width."""
    if interpret:
        return (32, 32, 4, 1), (32, 32, 4, 1)
    if dtype == torch.float64:
        return (32, 32, 4, 1), (16, 32, 4, 1)
    if dtype == torch.float32:
        return ((64, 32, 4, 2), (32, 32, 4, 1)) if d <= 128 else ((32, 32, 4, 1), (16, 32, 4, 1))
    if d <= 64:
        return (128, 64, 4, 3), (64, 64, 4, 2)
    if d <= 128:
        return (128, 64, 8, 3), (32, 64, 4, 2)
    return (64, 32, 4, 2), (32, 32, 4, 1)


class TritonBackend(Backend):
    """Fused FlashAttention-2 style kernels in Triton (forward + backward), for CUDA GPUs.

    ``block_m``/``block_n`` override the tile sizes of all three kernels (powers of two ≥ 16;
    tests use small tiles to cross tile boundaries on small inputs).
    """

    name = "triton"
    description = ("fused Triton kernels (online softmax, recomputing backward); CUDA; "
                   "causal/sliding window in-kernel, other masks read as a tile")

    def __init__(self, block_m: int | None = None, block_n: int | None = None) -> None:
        for what, b in (("block_m", block_m), ("block_n", block_n)):
            if b is not None and (b < 16 or b & (b - 1)):
                raise ValueError(f"{what} must be a power of two >= 16, got {b}")
        self.block_m = block_m
        self.block_n = block_n

    def not_supported_reasons(self, p: Problem) -> list[str]:
        reasons = []
        interpret = interpreter_enabled()
        if p.device.type != "cuda" and not interpret:
            reasons.append(
                f"the inputs are on {p.device.type}, and the triton kernels run on CUDA GPUs "
                "(set TRITON_INTERPRET=1 to run them on CPU tensors in Triton's interpreter, "
                "for testing)")
        elif not triton_available():
            reasons.append("the triton package is not installed (pip install triton)")
        if p.dtype not in _DTYPES:
            reasons.append(f"dtype {p.dtype} is not supported (use float16, bfloat16, float32 "
                           "or float64)")
        if max(p.d_k, p.d_v) > _MAX_HEAD_DIM:
            reasons.append(f"head dims D_k={p.d_k}, D_v={p.d_v} exceed {_MAX_HEAD_DIM}")
        if p.score_mod is not None:
            reasons.append("score_mod is an arbitrary Python function that the kernels cannot "
                           "run (use backend='tiled' or 'reference')")
        if p.dropout_p > 0:
            reasons.append(f"dropout (dropout_p={p.dropout_p}) is not implemented in the kernels")
        if p.bias is not None and p.bias.requires_grad and torch.is_grad_enabled():
            reasons.append("the additive bias requires grad, and the kernels do not compute "
                           "its gradient")
        too_big = [name for name, t in (("q", p.q), ("k", p.k), ("v", p.v))
                   if (t.shape[2] - 1) * abs(t.stride(2)) + (t.shape[3] - 1) * abs(t.stride(3))
                   >= 2**31]
        if too_big:
            reasons.append(f"{', '.join(too_big)} span 2^31 or more elements within one head "
                           "(the kernels index rows with 32-bit offsets)")
        if p.mask is not None:
            _band, rest = _general_terms(p)
            if rest:
                general = rest[0]
                for term in rest[1:]:
                    general = general & term
                if _dense_size(general, p) > _MAX_DENSE_MASK:
                    reasons.append(
                        f"mask {p.mask.name} is not a causal/sliding-window band and its dense "
                        f"form would hold {_dense_size(general, p)} elements (limit "
                        f"{_MAX_DENSE_MASK})")
        return reasons

    def _launch(self, p: Problem) -> _Launch:
        interpret = interpreter_enabled()
        fwd, bwd = _default_blocks(p.dtype, max(p.d_k, p.d_v), interpret)
        if self.block_m is not None:
            fwd, bwd = (self.block_m, *fwd[1:]), (self.block_m, *bwd[1:])
        if self.block_n is not None:
            fwd, bwd = (fwd[0], self.block_n, *fwd[2:]), (bwd[0], self.block_n, *bwd[2:])
        return _Launch(scale=p.scale, softcap=p.softcap, plan=_plan_mask(p), fwd=fwd, bwd=bwd,
                       interpret=interpret)

    def forward(self, p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
        acc = compute_dtype(p.dtype)
        bias = _bias4(p.bias.detach().to(acc)) if p.bias is not None else None
        out, lse = _TritonAttention.apply(p.q, p.k, p.v, bias, self._launch(p))
        return out, lse


# On a GPU this is the fast path: first in line. On CPU it reports why not, and auto moves on.
register(TritonBackend(), before=PRIORITY[0] if PRIORITY else None)
