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

- a mask is split into its ``&``-terms, and each term goes to the cheapest mechanism:
  causal masks (both alignments), sliding windows and ``full()`` become one index band
  ``BAND_LO <= q_idx - kv_idx <= BAND_HI``; one ``padding`` term becomes per-batch lengths;
  one ``document`` term becomes per-position ids. These are evaluated from the indices, and
  the band and the lengths bound the loops, so tiles outside them are never visited;
- every other term (prefix-LM, ``from_fn``, bool tensors, ``|``, ``~``, a second padding or
  document term) is evaluated once into a uint8 tensor ``(B|1, H_q|1, N_q|1, N_k|1)`` that
  the kernels read a tile at a time (broadcast dimensions cost no memory);
- for document and dense terms the kernels also read the mask's block map
  (:meth:`attnkit.masks.Mask.block_map`) and skip tiles in which no pair is allowed;
- ``softcap`` (forward and its derivative in the backward) and a finite additive ``bias``
  (read a tile at a time, like the mask);
- any N_q, N_k (boundary masks) and D_k, D_v ≤ 256 (padded to powers of two, masked);
- float16, bfloat16 (float32 accumulation), float32 (IEEE products, no TF32) and float64.

A query with no allowed key gets output 0 and LSE −∞, and zero gradients; nothing is NaN.

Caution
-------
- Needs CUDA tensors and the ``triton`` package. With ``TRITON_INTERPRET=1`` in the
  environment (read at each call) CPU tensors are accepted and the kernels run in Triton's
  interpreter — slow, for testing only, and without bfloat16 (the interpreter's ``tl.dot``
  gets bfloat16 wrong, triton-lang/triton#11584).
- Not supported (``not_supported_reasons`` says so and ``backend="auto"`` moves on):
  ``score_mod`` (an arbitrary Python function), ``dropout_p > 0``, a ``bias`` that requires
  grad, D_k or D_v above 256.
- Dense terms are materialised at (B|1, H_q|1, N_q, N_k) bytes, reduced to 1 on each
  dimension the term does not depend on (a call is refused above 2^31 elements).
- Recognising terms reads the parameters of the masks built by :func:`attnkit.masks.causal`,
  :func:`~attnkit.masks.sliding_window`, :func:`~attnkit.masks.full`,
  :func:`~attnkit.masks.padding` and :func:`~attnkit.masks.document` (and their ``&``) from
  their closures; a mask it does not recognise is treated as a dense term (correct, slower).
- Launch parameters (block sizes, warps, stages) are fixed heuristics, not autotuned; a GPU
  without the shared memory for them gets fewer stages, then smaller tiles.
- Compiled kernels receive ``scale`` and ``softcap`` as float32 scalars, so float64 runs on
  the GPU carry a relative error of about 1e-8 (the interpreter keeps them in float64).
- NaN/inf in a K/V row that a whole tile of queries may not see still meets a zero weight
  inside the P·V product (0·inf = NaN); ``attention()`` detects that and reruns the call
  with those rows zeroed, as for every backend.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from dataclasses import dataclass, field
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


# The mask functions built by masks.py, recognised by their code objects.
_BAND_CODE = _masks.causal()._fn.__code__
_FULL_CODE = _masks.full()._fn.__code__
_AND_CODE = (_masks.full() & _masks.full())._fn.__code__
_PADDING_CODE = _masks.padding([1])._fn.__code__
_DOCUMENT_CODE = _masks.document([0])._fn.__code__


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


def _as_padding(m: _masks.Mask) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(kv_lengths (B|1,), q_lengths (B|1,) or None)`` of a padding mask, else None."""
    if m._fn.__code__ is not _PADDING_CODE:
        return None
    env = _closure(m._fn)
    kv, q = env.get("kv_len"), env.get("q_len")
    if not isinstance(kv, torch.Tensor) or not (q is None or isinstance(q, torch.Tensor)):
        return None
    return kv, q


def _as_document(m: _masks.Mask, n_q: int, n_k: int) -> tuple[torch.Tensor, ...] | None:
    """``(ids (B|1, N_q), kv_ids (B|1, N_k))`` of a document mask that fits, else None."""
    if m._fn.__code__ is not _DOCUMENT_CODE:
        return None
    env = _closure(m._fn)
    qi, ki = env.get("q_ids"), env.get("k_ids")
    if not (isinstance(qi, torch.Tensor) and isinstance(ki, torch.Tensor)):
        return None
    if qi.dim() != 2 or ki.dim() != 2 or qi.shape[1] != n_q or ki.shape[1] != n_k:
        return None           # evaluated densely instead, which raises the mask's own error
    return qi, ki


@dataclass
class _MaskPlan:
    """How the kernels apply a mask: each ``&``-term of it goes to the cheapest mechanism.

    band      (BAND_LO, BAND_HI), inclusive, from causal / sliding-window terms
    kv_len    int32 (B|1,), q_len int32 (B|1,) or None — one padding term
    q_ids     int64 (B|1, N_q), k_ids int64 (B|1, N_k) — one document term
    dense     uint8 (B|1, H_q|1, N_q|1, N_k|1) — every other term, evaluated once
    summary   the mask of the non-band, non-padding terms, whose block map lets the kernels
              skip tiles without an allowed pair (None: nothing to skip beyond the loops)
    """

    band: tuple[int, int] | None = None
    kv_len: torch.Tensor | None = None
    q_len: torch.Tensor | None = None
    q_ids: torch.Tensor | None = None
    k_ids: torch.Tensor | None = None
    dense: torch.Tensor | None = None
    summary: _masks.Mask | None = None
    batch: int = 1
    heads: int = 1
    device: torch.device | None = None
    _tiles: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    def tiles(self, n_q: int, n_k: int, bm: int, bn: int) -> torch.Tensor | None:
        """int8 block map (B|1, H_q|1, ⌈N_q/bm⌉, ⌈N_k/bn⌉) of ``summary``, cached per tile size."""
        if self.summary is None:
            return None
        if (bm, bn) not in self._tiles:
            self._tiles[bm, bn] = self.summary.block_map(
                n_q, n_k, bm, bn, batch=self.batch, heads=self.heads, device=self.device)
        return self._tiles[bm, bn]


def _and_all(terms: list[_masks.Mask]) -> _masks.Mask:
    out = terms[0]
    for t in terms[1:]:
        out = out & t
    return out


def _split_terms(p: Problem) -> tuple[tuple[int, int] | None, list[_masks.Mask],
                                      list[_masks.Mask]]:
    """→ (band, [padding/document terms handled by index], [terms to evaluate densely])."""
    if p.mask is None:
        return None, [], []
    lo, hi = -math.inf, math.inf
    indexed: list[_masks.Mask] = []
    dense: list[_masks.Mask] = []
    found = False
    kinds: set[str] = set()
    for term in _conjuncts(p.mask):
        band = _as_band(term, p.n_q, p.n_k)
        if band is not None:
            if band != (-math.inf, math.inf):
                found = True
                lo, hi = max(lo, band[0]), min(hi, band[1])
        elif "padding" not in kinds and _as_padding(term) is not None:
            kinds.add("padding")
            indexed.append(term)
        elif "document" not in kinds and _as_document(term, p.n_q, p.n_k) is not None:
            kinds.add("document")
            indexed.append(term)
        else:
            dense.append(term)
    # beyond ±(N_q + N_k) a bound is the same as no bound; keep it a small int for the kernels
    lim = p.n_q + p.n_k + 1
    band_out = (int(max(lo, -lim)), int(min(hi, lim))) if found else None
    return band_out, indexed, dense


def _dense_size(m: _masks.Mask, p: Problem) -> int:
    b = p.batch if m.depends_on_batch else 1
    h = p.heads_q if m.depends_on_heads else 1
    return b * h * p.n_q * p.n_k


def _plan_mask(p: Problem) -> _MaskPlan:
    band, indexed, dense_terms = _split_terms(p)
    plan = _MaskPlan(band=band, batch=p.batch, heads=p.heads_q, device=p.device)
    dev = p.device
    summary_terms = list(dense_terms)
    for term in indexed:
        padding = _as_padding(term)
        if padding is not None:
            lim = max(p.n_q, p.n_k) + 1
            plan.kv_len = padding[0].clamp(max=lim).to(device=dev, dtype=torch.int32)
            if padding[1] is not None:
                plan.q_len = padding[1].clamp(max=lim).to(device=dev, dtype=torch.int32)
            continue
        ids = _as_document(term, p.n_q, p.n_k)
        assert ids is not None
        plan.q_ids, plan.k_ids = (t.to(device=dev, dtype=torch.int64) for t in ids)
        summary_terms.append(term)
    if dense_terms:
        d = _and_all(dense_terms)._dense(p.n_q, p.n_k, p.batch, p.heads_q, dev)
        # keep broadcast (stride-0) dims at size 1 so that they cost no memory
        index = tuple(slice(0, 1) if (st == 0 and n > 1) else slice(None)
                      for st, n in zip(d.stride(), d.shape, strict=True))
        plan.dense = d[index].to(torch.uint8).contiguous()
    if summary_terms:
        plan.summary = _and_all(summary_terms)
    return plan


def _broadcast_strides(t: torch.Tensor) -> tuple[int, ...]:
    """Strides with 0 on size-1 dims (so that the kernels broadcast them)."""
    return tuple(0 if size == 1 else st for size, st in zip(t.shape, t.stride(), strict=True))


def _bias4(bias: torch.Tensor) -> torch.Tensor:
    while bias.dim() < 4:
        bias = bias.unsqueeze(0)
    return bias


# --------------------------------------------------------------------------- launching
@dataclass
class _Launch:
    """Everything but q, k, v that the kernels need."""

    scale: float
    softcap: float | None
    plan: _MaskPlan
    bias: torch.Tensor | None     # (B|1, H_q|1, N_q|1, N_k|1) in the accumulation dtype
    fwd: tuple[int, ...]          # (BLOCK_M, BLOCK_N, num_warps, num_stages) of the forward
    bwd: tuple[int, ...]          # the same for the backward kernels
    interpret: bool


def _pow2(n: int) -> int:
    return max(16, 1 << (max(n, 1) - 1).bit_length())


def _tl_acc(dtype: torch.dtype, tl: Any) -> Any:
    return tl.float64 if dtype == torch.float64 else tl.float32


def _mask_args(L: _Launch, n_q: int, n_k: int, bm: int, bn: int,
               dummy: torch.Tensor) -> tuple[list[Any], dict[str, Any]]:
    """The mask/bias pointer and stride arguments (kernel order) and their HAS_* flags."""
    pl = L.plan
    tiles = pl.tiles(n_q, n_k, bm, bn)

    def ptr(t: torch.Tensor | None, ndim: int) -> list[Any]:
        return [t, *_broadcast_strides(t)] if t is not None else [dummy, *([0] * ndim)]

    lens = [pl.kv_len if pl.kv_len is not None else dummy,
            pl.q_len if pl.q_len is not None else dummy,
            1 if pl.kv_len is not None and pl.kv_len.shape[0] > 1 else 0]
    ids = [pl.q_ids if pl.q_ids is not None else dummy,
           pl.k_ids if pl.k_ids is not None else dummy,
           *(_broadcast_strides(pl.q_ids) if pl.q_ids is not None else (0, 0)),
           *(_broadcast_strides(pl.k_ids) if pl.k_ids is not None else (0, 0))]
    args = [*ptr(pl.dense, 4), *ptr(L.bias, 4), *lens, *ids, *ptr(tiles, 4)]
    flags = dict(HAS_BAND=pl.band is not None, HAS_MASK=pl.dense is not None,
                 HAS_BIAS=L.bias is not None, HAS_KVLEN=pl.kv_len is not None,
                 HAS_QLEN=pl.q_len is not None, HAS_DOC=pl.q_ids is not None,
                 HAS_TILES=tiles is not None, HAS_SOFTCAP=L.softcap is not None)
    return args, flags


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
    L: _Launch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    kern = _kernels(L.interpret)
    B, H_q, N_q, D_k = q.shape
    H_kv, N_k, D_v = k.shape[1], k.shape[2], v.shape[3]
    out = q.new_empty(B, H_q, N_q, D_v)
    lse = torch.empty(B, H_q, N_q, device=q.device, dtype=compute_dtype(q.dtype))
    const = dict(ACC=_tl_acc(q.dtype, kern.tl), PRECISION="ieee", BLOCK_DK=_pow2(D_k),
                 BLOCK_DV=_pow2(D_v))

    def launch(bm: int, bn: int, warps: int, stages: int) -> None:
        margs, flags = _mask_args(L, N_q, N_k, bm, bn, lse)
        kern._fwd_kernel[(_cdiv(N_q, bm) * B * H_q,)](
            q, k, v, out, lse,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(), *lse.stride(), *margs,
            H_q, H_q // H_kv, N_q, N_k, D_k, D_v, *_scalars(L),
            BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, **flags, **const,
        )

    _with_fallback(launch, L.fwd, L.interpret)
    return out, lse


def _run_backward(
    L: _Launch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, d_out: torch.Tensor, d_lse: torch.Tensor | None,
    need_dq: bool = True, need_dkdv: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    kern = _kernels(L.interpret)
    B, H_q, N_q, D_k = q.shape
    H_kv, N_k, D_v = k.shape[1], k.shape[2], v.shape[3]
    lse = lse.contiguous()
    const = dict(ACC=_tl_acc(q.dtype, kern.tl), PRECISION="ieee", BLOCK_DK=_pow2(D_k),
                 BLOCK_DV=_pow2(D_v))
    # Δ_i = Σ_d dO_id O_id − dLSE_i  (dS = P ∘ (dP − Δ); the LSE's own gradient enters here)
    delta = torch.empty_like(lse)
    bm = L.bwd[0]
    kern._bwd_delta_kernel[(_cdiv(N_q, bm) * B * H_q,)](
        out, d_out, d_lse if d_lse is not None else lse, delta,
        *out.stride(), *d_out.stride(), *lse.stride(),
        *(d_lse.stride() if d_lse is not None else (0, 0, 0)), H_q, N_q, D_v,
        HAS_DLSE=d_lse is not None, ACC=const["ACC"], BLOCK_M=bm, BLOCK_DV=const["BLOCK_DV"],
    )
    dq = torch.empty_like(q) if need_dq else None
    dk = torch.empty_like(k) if need_dkdv else None
    dv = torch.empty_like(v) if need_dkdv else None

    def launch_dq(bm: int, bn: int, warps: int, stages: int) -> None:
        margs, flags = _mask_args(L, N_q, N_k, bm, bn, lse)
        kern._bwd_dq_kernel[(_cdiv(N_q, bm) * B * H_q,)](
            q, k, v, d_out, dq, lse, delta,
            *q.stride(), *k.stride(), *v.stride(), *d_out.stride(), *dq.stride(),
            *lse.stride(), *margs, H_q, H_q // H_kv, N_q, N_k, D_k, D_v, *_scalars(L),
            BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, **flags, **const,
        )

    def launch_dkdv(bm: int, bn: int, warps: int, stages: int) -> None:
        margs, flags = _mask_args(L, N_q, N_k, bm, bn, lse)
        kern._bwd_dkdv_kernel[(_cdiv(N_k, bn) * B * H_kv,)](
            q, k, v, d_out, dk, dv, lse, delta,
            *q.stride(), *k.stride(), *v.stride(), *d_out.stride(), *dk.stride(),
            *dv.stride(), *lse.stride(), *margs, H_kv, H_q // H_kv, N_q, N_k, D_k, D_v,
            *_scalars(L), BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages,
            **flags, **const,
        )

    if dq is not None:
        _with_fallback(launch_dq, L.bwd, L.interpret)
    if dk is not None:
        _with_fallback(launch_dkdv, L.bwd, L.interpret)
    return dq, dk, dv


class _TritonAttention(torch.autograd.Function):
    """Autograd glue: (q, k, v) → (out, lse); the backward runs the Δ, dQ and dK/dV kernels."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, L: _Launch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = _run_forward(L, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.launch = L
        return out, lse

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, d_out: torch.Tensor | None, d_lse: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        if d_out is None:
            d_out = torch.zeros_like(out)
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        dq, dk, dv = _run_backward(ctx.launch, q, k, v, out, lse, d_out, d_lse,
                                   need_dq=need_q, need_dkdv=need_k or need_v)
        return dq, dk, dv, None


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
        elif p.dtype == torch.bfloat16 and interpret:
            reasons.append("Triton's interpreter multiplies the raw bits of bfloat16 in tl.dot "
                           "(triton-lang/triton#11584), so bfloat16 runs only on a GPU")
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
            _band, _indexed, rest = _split_terms(p)
            if rest:
                general = _and_all(rest)
                if _dense_size(general, p) > _MAX_DENSE_MASK:
                    reasons.append(
                        f"mask {p.mask.name} is not a causal/sliding-window band and its dense "
                        f"form would hold {_dense_size(general, p)} elements (limit "
                        f"{_MAX_DENSE_MASK})")
        return reasons

    def _launch(self, p: Problem) -> _Launch:
        interpret = interpreter_enabled()
        fwd, bwd = _default_blocks(p.dtype, max(p.d_k, p.d_v), interpret)
        # few queries (decoding): no point in query tiles larger than N_q
        fwd, bwd = ((min(c[0], _pow2(p.n_q)), *c[1:]) for c in (fwd, bwd))
        if self.block_m is not None:
            fwd, bwd = (self.block_m, *fwd[1:]), (self.block_m, *bwd[1:])
        if self.block_n is not None:
            fwd, bwd = (fwd[0], self.block_n, *fwd[2:]), (bwd[0], self.block_n, *bwd[2:])
        acc = compute_dtype(p.dtype)
        bias = _bias4(p.bias.detach().to(acc)) if p.bias is not None else None
        return _Launch(scale=p.scale, softcap=p.softcap, plan=_plan_mask(p), bias=bias,
                       fwd=fwd, bwd=bwd, interpret=interpret)

    def forward(self, p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = _TritonAttention.apply(p.q, p.k, p.v, self._launch(p))
        return out, lse


# On a GPU this is the fast path: first in line. On CPU it reports why not, and auto moves on.
register(TritonBackend(), before=PRIORITY[0] if PRIORITY else None)
