"""attnkit's native CPU attention kernel (C++), and the Python API the engines call.

One fused forward kernel runs every call (C++: ``forward.h``, shared pieces in ``common.h``,
the backward in ``backward.h``, the operators in ``attention.cpp`` — one translation unit):
per (batch, K/V head, query block, key split) it computes a key tile's scores for the G
query heads of a GQA group at once (brgemm, or one dot product per key for a handful of
rows), then ONE pass over the tile for scale, soft-cap, ALiBi (or a relative-bias table, or
a compiled Python score_mod), an additive bias and the mask, an online softmax, and P·V.
Band, padding and document masks are computed in closed form (tiles they empty are skipped,
tiles they fill skip the mask, and a band's edge tiles run their GEMMs as 32-key sub-blocks
over only the rows that see them, forward and backward); any other mask is a dense bool
tensor. Decoding (a few
queries over a long cache) splits the keys across cores and merges the splits by LSE; K/V
in float16/bfloat16 are read as such and converted in registers. :func:`paged_attention`
(``paged.h``) runs the same loops over a paged KV cache, reading the pages through the block
table (no gathered copy), for a ragged batch of sequences in one call (serving.py).

Shape legend (the Problem layout of ``backends/base.py``)::

    q (B, H_q, N_q, D_k)   k (B, H_kv, N_k, D_k)   v (B, H_kv, N_k, D_v)    H_q = G · H_kv
    out (B, H_q, N_q, D_v)  (q's dtype)            lse (B, H_q, N_q)  −∞ = no key, float32
                                                   (float64 for float64 inputs)
    alibi_slopes (H_q,)     bias, dense_mask       broadcastable to (B, H_q, N_q, N_k)
    rel_table (H_q, 2·rel_max_distance + 1)        any float dtype; gradient flows to it
    kv_lengths, q_lengths   (B,) or (1,)           doc_ids (B|1, N_q)  kv_doc_ids (B|1, N_k)

API (what ``tiled``, ``decode`` and the custom operator ``attnkit::attention`` call)::

    available() -> bool                  why_unavailable() -> str | None
    forward(q, k, v, *, scale=None, softcap=None, alibi_slopes=None, alibi_offset=0,
            rel_table=None, rel_max_distance=None, bias=None, band=None, kv_lengths=None,
            q_lengths=None, doc_ids=None, kv_doc_ids=None, dense_mask=None, block_q=None,
            splits=None) -> (out, lse)
    decode(q, k, v, **the same options) -> (out, lse)        N_q <= 16, keys split
    supports(p: Problem) -> list[str]    forward_problem(p: Problem) -> (out, lse)
    forward_problem_screened(p) -> (out, lse, q finite, out finite) | None   (no autograd)
    backward_problem(p, out, lse, dout, dlse=None, bias_grad=False)
                                         -> (dq, dk, dv, dbias)  from saved out, lse
    all_finite(t) -> bool | None         every element of a 4-D tensor finite (one pass; the
                                         eager path's NaN/inf screens ask it first)
    known_finite(t) -> bool              all_finite, else one torch sum
    lean_launch(p: Problem) -> LeanLaunch | None   the eager hot path's launch of a call
                                         with no score term, a band and at most the call's
                                         bool mask tensor on the lean operator
                                         attend_lean(q, k, v, scale, softcap, band_lo,
                                         band_hi, mask, splits, block_q, check_q)
                                         -> (out, lse, all outputs (and q) finite);
                                         and attend_slot(q, k, v, q_sig, k_sig, v_sig,
                                         scale, softcap, band_lo, band_hi, splits,
                                         block_q, check_q) -> (out, lse, status): the same
                                         run once q, k, v match the signature tensors'
                                         sizes and dtypes on the CPU without gradients
                                         (status 0 finite, 2 not, 1 declined: not run)

Wiring an engine (``supports`` is empty only when the kernel is available)::

    from . import native
    if not native.supports(p):
        out, lse = native.forward_problem(p)   # differentiable in q, k, v (and lse)

Score terms, in attnkit's fixed order: ``x = s·scale → softcap·tanh(x/softcap) →
x − slope_h·|q + alibi_offset − k| → x + rel_table[h, clamp(k − q, −M, M) + M] → x + bias →
mask`` (``M = rel_max_distance``; the table term is ``scores.relative_bias(rel_table, M)``).
All masks given are ANDed:
``band=(lo, hi)`` allows ``lo <= q − k <= hi`` (``masks.decompose(...).band`` gives it with
the alignment folded in); ``kv_lengths``/``q_lengths`` allow ``k < kv_len[b]`` and ``q < q_len[b]``;
``doc_ids``/``kv_doc_ids`` allow equal ids; ``dense_mask`` is True where allowed.

Caution
-------
- Gradients flow to q, k and v (a FlashAttention-2 backward that recomputes P from the
  saved LSE; the LSE output is differentiable too), first derivatives only, and to
  ``rel_table`` (summed per bucket in float64 per thread, then in thread order: the same
  threads give the same bits; only the columns some |k − q| reaches are passed, so the
  per-thread buffer is at most H_q × (2·max(N_q, N_k) − 1) float64) and to
  ``alibi_slopes`` (likewise), and to ``bias``: the kernel writes ``dS`` (the gradient of
  the score after the soft-cap and score_mod) once per element into a (B, H_q, N_q, N_k)
  buffer in the compute dtype, summed over the bias's broadcast dims afterwards — as large
  as a full bias, which a bias that needs a gradient is anyway. The backward keeps one dQ
  buffer per thread in the compute dtype (threads × the size of q).
- With huge logits (|score| near 1e7·(its spread) in float32, 1e15 in float64) the saved
  LSE rounds at the row maximum's magnitude; the backward caps P = e^(x − lse) at 1, so the
  gradients stay finite, but they are only as accurate as that LSE.
- bfloat16 / float16: the forward's QKᵀ and P·V (the paged cache's GEMM loop too), and the
  backward's five products, run in that dtype where torch's brgemm has a kernel for it
  (AMX, AVX512-BF16 / -FP16; fp32 accumulation, P — and in the backward dS — rounded to the
  dtype before the products that use them), else widened to float32;
  :func:`low_precision_paths` says which and why, and ``ATTNKIT_NATIVE_LOWP_GEMM=0`` forces
  the widening. Score terms, softmax, LSE and the backward's P, delta and dS compute in
  float32.
- float32 on CPU computes in float32 (bfloat16 / float16 too where they are widened);
  float64 computes in float64 (the score terms, the softmax, the LSE and the gradients too)
  with the C library's exp / tanh per lane and plain-loop GEMMs: exact to float64 rounding,
  but several times slower than float32 (it is there for gradcheck and float64 reference
  work).
- The first call in a fresh environment compiles the kernel (~15 s of one core on a quiet
  machine, up to ~40 s on a loaded one; see ``loader``); later processes load the cached
  build. ``ATTNKIT_NATIVE=0`` turns the kernel off.
- :func:`forward_problem` reads the call as lowered once (``Problem.lowered``: the mask's
  closed-form parts from ``masks.decompose``, the score mod as ``scores.score_terms``).
  ALiBi reaches it as a score_mod whose spec is ``scores.Alibi`` (``scores.alibi(H_q)``);
  a relative-bias table as ``scores.relative_bias(table, M)`` (its spec is read, the table's
  gradient flows); any other Python score_mod is traced and compiled into a small C++
  function the fused pass calls (:mod:`.score_mod`; forward and backward, gradients to
  q, k, v only); one it cannot compile is refused by :func:`supports` with the reason.
- Masks without a closed form are evaluated densely, ``(B|1, H|1, N_q, N_k)`` bools; above
  ``DENSE_MASK_LIMIT`` bytes (4 MiB) :func:`supports` refuses them (the tiled engine keeps
  its O(N) memory). A bool tensor the call passed itself (``p.mask_tensor``) costs no
  memory and is read in place, at any size.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any, NamedTuple

import torch

from ... import _compat
from ..base import Problem, refuse_double_backward
from . import loader
from .score_mod import CompiledScoreMod, compile_score_mod, for_problem

__all__ = ["available", "why_unavailable", "forward", "decode", "supports", "forward_problem",
           "forward_problem_screened",
           "backward_problem", "compile_score_mod", "CompiledScoreMod", "low_precision_paths",
           "paged_attention", "paged_merge_rows", "KernelTerms", "plain_terms", "use_native",
           "native_enabled", "all_finite", "known_finite", "LeanLaunch", "lean_launch", "DTYPES",
           "DECODE_MAX_QUERIES", "DENSE_MASK_LIMIT"]

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
DECODE_MAX_QUERIES = 16
DENSE_MASK_LIMIT = 4 * 2**20        # bytes of a mask supports() evaluates densely (the one limit)
_ROWS_PER_ITEM = 128                # query rows (G heads × block_q) per work item
_ROWS_PER_ITEM_F32 = 256            # ... for float32 on AVX-512 builds (_rows_per_item)


# ------------------------------------------------------------------ the switch, per context
_NATIVE: ContextVar[bool] = ContextVar("attnkit_native", default=True)


@contextlib.contextmanager
def use_native(enabled: bool) -> Iterator[None]:
    """Let ``tiled`` and ``decode`` use the native kernel (``True``, the default, when it is
    available and supports the call) or keep them on their Python engines (``False``), in
    this context only — e.g. to count the Python engine's plan. ``ATTNKIT_NATIVE=0`` turns
    the kernel off for the whole process."""
    token = _NATIVE.set(bool(enabled))
    try:
        yield
    finally:
        _NATIVE.reset(token)


def native_enabled() -> bool:
    """False inside ``use_native(False)`` (the environment, ``ATTNKIT_NATIVE``, is the
    loader's business)."""
    return _NATIVE.get()


def available() -> bool:
    """True when the native kernel is built (or was built and cached) and loaded."""
    return loader.load() is not None


def why_unavailable() -> str | None:
    """Why :func:`available` is False, with how to fix it (``None`` when it is True)."""
    return None if available() else loader.reason()


def low_precision_paths() -> dict[str, str]:
    """Which GEMMs the forward and the backward run for ``bfloat16`` / ``float16`` inputs
    now, and why: their own dtype through torch's brgemm (oneDNN: AMX tiles, else
    AVX512-BF16 / -FP16 dot products; fp32 accumulation, P — and the backward's dS — rounded
    to the input dtype first), or widened to float32 (no such kernel on this CPU, or
    ``ATTNKIT_NATIVE_LOWP_GEMM=0``, read at every call)."""
    ops = loader.load()
    if ops is None:
        return dict.fromkeys(("bfloat16", "float16"), f"native kernel unavailable: "
                                                      f"{loader.reason()}")
    return {dt: ops.lowp_gemm_path(dt) for dt in ("bfloat16", "float16")}


def _ops() -> object:
    ops = loader.load()
    if ops is None:
        raise RuntimeError(f"attnkit's native CPU kernel is unavailable: {loader.reason()}")
    return ops


# ------------------------------------------------------------------ argument preparation
def _as4d(t: torch.Tensor, shape: tuple[int, int, int, int], what: str,
          dtype: torch.dtype) -> torch.Tensor:
    """``t`` checked to broadcast to ``shape`` and made 4-D ``(B|1, H_q|1, N_q|1, N_k|1)``
    (a view), in ``dtype``, converting only the un-broadcast data. Not expanded: the kernel
    reads a size-1 dim at every index (``broadcast_strides`` in ``attention.cpp``)."""
    ts = t.shape
    if len(ts) != 4:
        if len(ts) > 4:
            raise ValueError(f"{what} must have at most 4 dims, got shape {tuple(ts)}")
        t = t.reshape((1,) * (4 - len(ts)) + tuple(ts))
        ts = t.shape
    # (plain comparisons: torch.broadcast_shapes costs ~100 µs, a generator a few, on every
    # masked small call)
    b, h, n_q, n_k = shape
    if not ((ts[0] == b or ts[0] == 1) and (ts[1] == h or ts[1] == 1)
            and (ts[2] == n_q or ts[2] == 1) and (ts[3] == n_k or ts[3] == 1)):
        raise ValueError(f"{what} of shape {tuple(ts)} does not broadcast to "
                         f"(B, H_q, N_q, N_k) = {shape}")
    if t.dtype is not dtype:
        t = t[tuple(slice(0, 1) if st == 0 else slice(None) for st in t.stride())].to(dtype)
    return t


def _per_batch(x: object, B: int, what: str) -> torch.Tensor:
    t = torch.as_tensor(x).to(torch.int64).reshape(-1)
    if t.numel() not in (1, B):
        raise ValueError(f"{what} must have 1 or B={B} entries, got {t.numel()}")
    return t.expand(B)


def _ids(x: object, B: int, n: int, what: str) -> torch.Tensor:
    t = torch.as_tensor(x).to(torch.int64)
    t = t.reshape(1, -1) if t.dim() == 1 else t
    if t.dim() != 2 or t.shape[0] not in (1, B) or t.shape[1] != n:
        raise ValueError(f"{what} must have shape ({n},) or (B|1, {n}), got {tuple(t.shape)}")
    return t.expand(B, n)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The kernel's compute (and LSE) dtype for inputs of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class KernelTerms(NamedTuple):
    """The kernel's score-term and mask arguments — one record, named and ordered as the
    operators' schema (``attend`` and ``attend_backward`` take them between their tensors
    and their launch / gradient flags; ``tests/test_lowering.py`` checks the names against
    the built schema). Built by :func:`_common` from a call's options, checked."""

    scale: float
    softcap: float                      # 0 = none
    alibi: torch.Tensor | None          # (H_q,) slopes, compute dtype
    alibi_offset: float
    rel_table: torch.Tensor | None      # (H_q, 2M' + 1), M' <= N: the columns a call reaches
    rel_max_distance: int               # M'
    bias: torch.Tensor | None           # (B|1, H_q|1, N_q|1, N_k|1), compute dtype
    band_lo: float                      # allowed ⇔ band_lo <= q − k <= band_hi
    band_hi: float
    kv_len: torch.Tensor | None         # (B,) int64
    q_len: torch.Tensor | None          # (B,) int64
    q_doc: torch.Tensor | None          # (B|1, N_q) int64
    k_doc: torch.Tensor | None          # (B|1, N_k) int64
    mask: torch.Tensor | None           # (B|1, H_q|1, N_q|1, N_k|1) bool
    score_mod: int                      # the compiled score_mod's address (0 = none)
    score_mod_caps: int                 # its captured tensors' table


def plain_terms(scale: float, softcap: float = 0.0,
                band: tuple[float, float] = (-math.inf, math.inf)) -> KernelTerms:
    """The record of a call with no score term and no mask but a band ``(lo, hi)``
    (allowed ⇔ ``lo <= q − k <= hi``; none by default)."""
    return KernelTerms(float(scale), float(softcap), None, 0.0, None, 0, None,
                       float(band[0]), float(band[1]), None, None, None, None, None, 0, 0)


_PLAIN_RECORDS: dict[tuple[float, float], KernelTerms] = {}


def _plain_record(scale: float, softcap: float) -> KernelTerms:
    """``plain_terms(scale, softcap)``, one shared (immutable) record per pair: what every
    call without a score term or mask passes (a decoder's calls repeat a few pairs)."""
    key = (scale, softcap)
    got = _PLAIN_RECORDS.get(key)
    if got is None:
        if len(_PLAIN_RECORDS) >= 64:
            _PLAIN_RECORDS.clear()
        got = _PLAIN_RECORDS[key] = plain_terms(scale, softcap)
    return got


def _rows_per_item(dtype: torch.dtype, band: tuple[float, float] | None) -> int:
    """Query rows (G heads × block_q) per work item of a forward: ``_ROWS_PER_ITEM_F32`` for
    float32 on an AVX-512 build when no window bounds the keys (a band finite on both sides),
    else ``_ROWS_PER_ITEM``. Twice the rows use each K / V tile, read from L2, for twice the
    rows (one thread, (1, 8, 4096, 64): dense 306 → 288 ms, causal 160 → 155 ms); a 512-key
    window ran 101 → 106 ms with them (its edge tiles grow). AVX2 builds (Zen 3: 512 KB of
    L2 per core) keep 128: not measured there."""
    if dtype is torch.float32 and loader.loaded_level() in ("avx512", "avx512bf16") and (
            band is None or not (math.isfinite(band[0]) and math.isfinite(band[1]))):
        return _ROWS_PER_ITEM_F32
    return _ROWS_PER_ITEM


def _auto_splits(items: int, n_k: int) -> int:
    """Key splits so that there are a few work items per thread (decode-sized calls)."""
    threads = max(1, torch.get_num_threads())
    if items >= 2 * threads or items == 0:
        return 1
    return max(1, min(-(-4 * threads // items), n_k // 256))     # (integer ceil)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
            softcap: float | None = None, alibi_slopes: torch.Tensor | None = None,
            alibi_offset: int = 0, rel_table: torch.Tensor | None = None,
            rel_max_distance: int | None = None, bias: torch.Tensor | None = None,
            band: tuple[float, float] | None = None, kv_lengths: object | None = None,
            q_lengths: object | None = None, doc_ids: object | None = None,
            kv_doc_ids: object | None = None, dense_mask: torch.Tensor | None = None,
            block_q: int | None = None, splits: int | None = None,
            score_mod: CompiledScoreMod | None = None,
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention on the Problem layout → ``(out, lse)`` (see the module docstring).

    ``block_q`` (queries per work item and head) and ``splits`` (key splits, merged by LSE)
    are chosen from the sizes and the thread count when not given. ``rel_table`` (H_q,
    2·rel_max_distance + 1) adds ``rel_table[h, clamp(k − q, −M, M) + M]`` to every score
    (give both or neither); when it requires grad, out and lse carry a grad_fn to it.
    ``score_mod`` (a :class:`~.score_mod.CompiledScoreMod`, see :func:`compile_score_mod`,
    built for the compute dtype: float64 for float64 inputs, else float32) runs after the
    soft-cap, in ALiBi's place (not together with ALiBi or a table).
    """
    ops = _ops()
    if not _layout_fits(q, k, v):
        _check_layout(q, k, v)
    return _forward(ops, q, k, v, scale, softcap, alibi_slopes, alibi_offset, rel_table,
                    rel_max_distance, bias, band, kv_lengths, q_lengths, doc_ids, kv_doc_ids,
                    dense_mask, block_q, splits, score_mod)


def unit_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v (4-D) with unit stride along D, as the kernel reads rows: each copied only
    when its last dim is strided. (``stride()`` and one index: ``stride(-1)`` costs 5× as
    much on the per-token path.)"""
    if q.stride()[3] != 1:
        q = q.contiguous()
    if k.stride()[3] != 1:
        k = k.contiguous()
    if v.stride()[3] != 1:
        v = v.contiguous()
    return q, k, v


def _forward(ops: object, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             scale: float | None, softcap: float | None, alibi_slopes: torch.Tensor | None,
             alibi_offset: int, rel_table: torch.Tensor | None, rel_max_distance: int | None,
             bias: torch.Tensor | None, band: tuple[float, float] | None,
             kv_lengths: object | None, q_lengths: object | None, doc_ids: object | None,
             kv_doc_ids: object | None, dense_mask: torch.Tensor | None, block_q: int | None,
             splits: int | None, score_mod: CompiledScoreMod | None, screened: bool = False,
             ) -> Any:
    """:func:`forward` on inputs whose layout is known to fit (checked by :func:`forward`,
    or a :class:`Problem` that :func:`supports` accepted): the per-call work of a small call
    is this function's few lines and the operator call → ``(out, lse)``.

    ``screened``: → ``(out, lse, q finite, out finite)`` from the operator
    ``attend_screened``, which reads the eager path's NaN/inf screens as it goes (see
    :func:`forward_problem_screened`); None, before the score terms' records are built or
    the kernel runs, where the call would need autograd (that path screens as before)."""
    B, Hq, Nq, Dk = q.shape
    _, Hkv, Nk, _ = k.shape
    rel = None if rel_table is None and rel_max_distance is None else \
        _rel_table(rel_table, rel_max_distance, Hq)
    cdt = torch.float64 if q.dtype is torch.float64 else torch.float32   # score terms, LSE
    if score_mod is not None and score_mod.dtype != cdt:
        raise TypeError(f"native.forward: score_mod {score_mod.name} was compiled for "
                        f"{score_mod.dtype} rows, but {q.dtype} inputs compute in {cdt}: "
                        f"compile_score_mod(fn, dtype={cdt})")
    if Nq == 0 or Nk == 0:                                   # no query, or nothing to see
        empty = (q.new_zeros(B, Hq, Nq, v.shape[3]),
                 torch.full((B, Hq, Nq), -math.inf, dtype=cdt))
        return (*empty, True, True) if screened else empty
    q, k, v = unit_rows(q, k, v)
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0, got {softcap}")
    ali = alibi_slopes if isinstance(alibi_slopes, torch.Tensor) else None
    grad = torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad
        or any(t is not None and t.requires_grad for t in (rel, ali, bias)))
    if grad and screened:
        return None
    rows = block_q or max(1, _rows_per_item(q.dtype, band) // (Hq // Hkv))
    n_split = splits or _auto_splits(B * Hkv * -(-Nq // rows), Nk)
    plain = (alibi_slopes is None and rel is None and bias is None and band is None
             and kv_lengths is None and q_lengths is None and doc_ids is None
             and kv_doc_ids is None and dense_mask is None and score_mod is None)
    if plain:                                # no tensor options: the record as is
        common = _plain_record(Dk ** -0.5 if scale is None else scale, softcap or 0.0)
        call = None
    else:
        common, call = _common(q, k, v, B, Hq, Nq, Nk, Dk, cdt, scale, softcap, alibi_slopes,
                               alibi_offset, rel, rel_max_distance, bias, band, kv_lengths,
                               q_lengths, doc_ids, kv_doc_ids, dense_mask, score_mod)
    if grad:
        out = _NativeAttention.apply(q, k, v, rel, ali, bias, common,
                                     (int(n_split), int(rows)), call)
    elif screened:
        out = ops.attend_screened(q, k, v, *common, int(n_split), int(rows))  # type: ignore[attr-defined]
    else:
        out = ops.attend(q, k, v, *common, int(n_split), int(rows))  # type: ignore[attr-defined]
    if call is not None:
        call.check()                                         # an index out of range: raise
    return out


def _common(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, B: int, Hq: int, Nq: int,
            Nk: int, Dk: int, cdt: torch.dtype, scale: float | None, softcap: float | None,
            alibi_slopes: torch.Tensor | None, alibi_offset: int, rel: torch.Tensor | None,
            rel_max_distance: int | None, bias: torch.Tensor | None,
            band: tuple[float, float] | None, kv_lengths: object | None,
            q_lengths: object | None, doc_ids: object | None, kv_doc_ids: object | None,
            dense_mask: torch.Tensor | None, score_mod: CompiledScoreMod | None,
            ) -> tuple[KernelTerms, object | None]:
    """The operator's score-term and mask arguments (everything between v and the launch),
    checked, and the score_mod's bound call (or None)."""
    shape4 = (B, Hq, Nq, Nk)
    slopes = None
    if alibi_slopes is not None:
        slopes = torch.as_tensor(alibi_slopes).detach().to(cdt).reshape(-1)
        slopes = slopes.contiguous()
        if slopes.numel() != Hq:
            raise ValueError(f"alibi_slopes must have H_q={Hq} entries, got {slopes.numel()}")
    lo, hi = (-math.inf, math.inf) if band is None else (float(band[0]), float(band[1]))
    if (doc_ids is None) != (kv_doc_ids is None) and Nq != Nk:
        raise ValueError("give kv_doc_ids with doc_ids when N_q != N_k")
    if doc_ids is not None and kv_doc_ids is None:
        kv_doc_ids = doc_ids
    if kv_doc_ids is not None and doc_ids is None:
        doc_ids = kv_doc_ids
    if dense_mask is not None and dense_mask.dtype != torch.bool:
        raise TypeError(f"dense_mask must be bool (True = may attend), got {dense_mask.dtype}")
    cut = 0                                # table columns on each side that no |k - q| reaches
    if rel is not None:
        cut = max(0, int(rel_max_distance) - (max(Nq, Nk) - 1))  # type: ignore[arg-type]
    call = None if score_mod is None else score_mod.bind(max(B, Hq, Nq, Nk))  # caps, error flag
    common = KernelTerms(
        float(Dk ** -0.5 if scale is None else scale), float(softcap or 0.0),
        slopes, float(alibi_offset),
        None if rel is None else                              # (H_q, 2M' + 1), M' <= N
        rel.detach()[:, cut:rel.shape[1] - cut].to(cdt).contiguous(),
        0 if rel is None else int(rel_max_distance) - cut,  # type: ignore[arg-type]
        None if bias is None else _as4d(bias.detach(), shape4, "bias", cdt),
        lo, hi,
        None if kv_lengths is None else _per_batch(kv_lengths, B, "kv_lengths"),
        None if q_lengths is None else _per_batch(q_lengths, B, "q_lengths"),
        None if doc_ids is None else _ids(doc_ids, B, Nq, "doc_ids"),
        None if kv_doc_ids is None else _ids(kv_doc_ids, B, Nk, "kv_doc_ids"),
        None if dense_mask is None else _as4d(dense_mask, shape4, "dense_mask", torch.bool),
        0 if call is None else call.address,
        0 if call is None else call.caps_address)
    return common, call


def _layout_fits(q: object, k: object, v: object) -> bool:
    """True when :func:`_check_layout` has nothing to say (the common case, in a few
    comparisons); False sends the call to it, which names what is wrong."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
            and isinstance(v, torch.Tensor)):
        return False
    qs, ks, vs = q.shape, k.shape, v.shape
    dt = q.dtype
    return (len(qs) == 4 and len(ks) == 4 and len(vs) == 4 and k.dtype is dt
            and v.dtype is dt and dt in DTYPES and q.is_cpu and k.is_cpu and v.is_cpu
            and ks[0] == qs[0] and ks[3] == qs[3] and vs[0] == ks[0] and vs[1] == ks[1]
            and vs[2] == ks[2] and ks[1] > 0 and qs[1] % ks[1] == 0)


def _check_layout(q: object, k: object, v: object) -> None:
    """The layout checks of :func:`forward`, each with its message."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"native.forward: {name} must be a 4-D tensor (B, H, N, D), got "
                             f"{getattr(t, 'shape', type(t))}")
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) \
        and isinstance(v, torch.Tensor)
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in DTYPES:
        raise TypeError(f"native.forward: q, k, v must share one dtype of float32 / float64 / "
                        f"bfloat16 / float16, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.device.type != "cpu" or k.device.type != "cpu" or v.device.type != "cpu":
        raise ValueError(f"native.forward runs on CPU tensors, got {q.device}, {k.device}, "
                         f"{v.device}")
    B, Hq, Nq, Dk = q.shape
    Hkv = k.shape[1]
    if (k.shape[0], k.shape[3]) != (B, Dk) or v.shape[:3] != k.shape[:3] or Hq % Hkv:
        raise ValueError(f"native.forward: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)} do not fit the layout (B, H_q, N_q, D_k), "
                         "(B, H_kv, N_k, D_k), (B, H_kv, N_k, D_v) with H_q a multiple of H_kv")


def _rel_table(table: torch.Tensor | None, max_distance: int | None, Hq: int,
               ) -> torch.Tensor | None:
    """``table`` checked as a relative-position bias table (H_q, 2·max_distance + 1)."""
    if table is None and max_distance is None:
        return None
    if table is None or max_distance is None:
        raise ValueError("native.forward: give rel_table and rel_max_distance together "
                         f"(got rel_table={'None' if table is None else 'a tensor'}, "
                         f"rel_max_distance={max_distance!r})")
    if isinstance(max_distance, bool) or not isinstance(max_distance, int) or max_distance < 0:
        raise ValueError(f"rel_max_distance must be an int >= 0, got {max_distance!r}")
    if not isinstance(table, torch.Tensor) or not table.dtype.is_floating_point \
            or table.device.type != "cpu":
        raise TypeError(f"rel_table must be a floating-point CPU tensor, got "
                        f"{getattr(table, 'dtype', type(table).__name__)} on "
                        f"{getattr(table, 'device', '?')}")
    if tuple(table.shape) != (Hq, 2 * max_distance + 1):
        raise ValueError(f"rel_table must have shape (H_q, 2*rel_max_distance+1) = "
                         f"({Hq}, {2 * max_distance + 1}), got {tuple(table.shape)}: one row "
                         "per query head, one column per clamped distance k - q")
    return table


def _kernel_backward(ops: object, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                     dlse: torch.Tensor | None, common: KernelTerms, alibi_grad: bool,
                     bias_grad: bool) -> tuple[torch.Tensor, ...]:
    """The kernel's backward call from a forward's ``out`` and ``lse`` (contiguous, in the
    compute dtype) → ``(dq, dk, dv, d rel_table, d alibi, d bias)`` (see ``attention.cpp``):
    ``delta = rowsum(dout ∘ out) − dlse`` (B, H_q, N_q), the one extra input it needs."""
    cdt = lse.dtype                                                # float32, or float64
    delta = (dout.to(cdt) * out.to(cdt)).sum(-1)                   # (B, H_q, N_q)
    if dlse is not None:
        delta = delta - dlse.to(cdt)                               # d lse / d s = P
    dout = dout.to(q.dtype)
    dout = dout if dout.stride()[3] == 1 else dout.contiguous()
    return ops.attend_backward(  # type: ignore[attr-defined]
        q, k, v, dout, lse, delta.contiguous(), *common, alibi_grad, bias_grad)


class _NativeAttention(torch.autograd.Function):
    """The kernel with its FlashAttention-2 backward (LSE saved; gradients of q, k, v, the
    relative bias table ``rel``, the ALiBi slopes ``ali`` and the additive ``bias``, each of
    the last three may be None)."""

    @staticmethod
    def forward(ctx, q, k, v, rel, ali, bias, common, launch, mod):  # noqa: ANN001, ANN205
        out, lse = _ops().attend(q, k, v, *common, *launch)
        ctx.mod = mod                                              # keeps its caps alive
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.common = common
        ctx.rel_dtype = None if rel is None else rel.dtype
        ctx.rel_cut = 0 if rel is None else (rel.shape[1] - common.rel_table.shape[1]) // 2
        ctx.ali_like = None if ali is None else (ali.shape, ali.dtype)
        ctx.bias_like = None if bias is None else (bias.shape, bias.dtype)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):  # noqa: ANN001, ANN205
        refuse_double_backward("native")
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv, drel, dali, dbias = _kernel_backward(
            _ops(), q, k, v, out, lse, dout, dlse, ctx.common, bool(ctx.needs_input_grad[4]),
            bool(ctx.needs_input_grad[5]))
        if ctx.needs_input_grad[3]:                                # (H_q, 2M+1)
            c = ctx.rel_cut
            full = drel.new_zeros(drel.shape[0], drel.shape[1] + 2 * c, dtype=ctx.rel_dtype)
            full[:, c:c + drel.shape[1]] = drel
            drel = full
        else:
            drel = None
        if ctx.needs_input_grad[4]:                                # like alibi_slopes
            dali = dali.reshape(ctx.ali_like[0]).to(ctx.ali_like[1])
        else:
            dali = None
        if ctx.needs_input_grad[5]:                                # like bias: (B, H_q, N_q,
            shape, dtype = ctx.bias_like                           # N_k) summed over its
            dbias = dbias.sum_to_size(shape).to(dtype)             # broadcast dims
        else:
            dbias = None
        if ctx.mod is not None:
            ctx.mod.check()
        return dq, dk, dv, drel, dali, dbias, None, None, None


def decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: object,
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Few queries (N_q <= 16) over a long K/V cache: all queries of a K/V head and all its
    G query heads form one block, and the keys are split across cores (flash-decoding).
    Options as in :func:`forward`; float16/bfloat16 caches are read as such."""
    if q.dim() != 4 or q.shape[2] > DECODE_MAX_QUERIES:
        raise ValueError(f"native.decode takes at most {DECODE_MAX_QUERIES} queries, got q of "
                         f"shape {tuple(q.shape)}: use native.forward")
    options.setdefault("block_q", q.shape[2])
    return forward(q, k, v, **options)  # type: ignore[arg-type]


def _int64(x: object, name: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor) and x.dtype == torch.int64 and x.device.type == "cpu" \
            and x.is_contiguous():
        return x                                # as given (serving's kept layouts: no ops)
    t = torch.as_tensor(x)
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
        raise ValueError(f"native.paged_attention: {name} must be integer, got {t.dtype}")
    return t.to(device="cpu", dtype=torch.int64).contiguous()


def paged_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                    block_table: object, cu_seqlens_q: object, kv_lengths: object, *,
                    q_positions: object | None = None, scale: float | None = None,
                    softcap: float | None = None, alibi_slopes: torch.Tensor | None = None,
                    window: tuple[int, int] = (-1, -1), split_len: int | None = None,
                    block_q: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a ragged batch of sequences over a paged KV cache, the pages read through
    the block table inside the kernel (no gathered copy) → ``(out, lse)``.

    Shapes (flash-attn's layout)::

        q            (total_q, H_q, D)    sequence s: rows cu_seqlens_q[s] .. [s+1] − 1
        k_pages      (num_blocks, block_size, H_kv, D)     v_pages: the same with D_v
        block_table  (S, max_pages) int   key t of s: page block_table[s, t // block_size]
        kv_lengths   (S,) int             keys of sequence s
        q_positions  (S,) int             position of s's first query among its keys;
                                          default kv_lengths − N_q(s) (bottom-right)
        alibi_slopes (S, H_q) or (H_q,)   − slope · |p − t| added after the soft-cap
        → out (total_q, H_q, D_v) in q's dtype,  lse (total_q, H_q) float32 (float64 in),
          −∞ for a query with no key (its output is 0)

    Query i of sequence s sits at ``p = q_positions[s] + i`` and sees key ``t <
    kv_lengths[s]`` when ``p − left <= t <= p + right`` (``window``; −1 = unbounded; causal
    is ``(left, 0)``). ``split_len`` (keys per work item, rounded up to 128) and ``block_q``
    (queries per work item when a sequence has more than 16) are chosen when not given.
    A block-table entry a sequence reads that is not a page of the pool raises ValueError
    before anything runs; nothing is written either way.
    """
    ops = _ops()
    for name, t in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
        if not isinstance(t, torch.Tensor) or t.dim() != (3 if name == "q" else 4):
            raise ValueError(f"native.paged_attention: {name} must be a "
                             f"{3 if name == 'q' else 4}-D tensor, got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
    if not (q.dtype == k_pages.dtype == v_pages.dtype) or q.dtype not in DTYPES:
        raise TypeError(f"native.paged_attention: q and the pages must share one dtype of "
                        f"float32 / float64 / bfloat16 / float16, got {q.dtype}, "
                        f"{k_pages.dtype}, {v_pages.dtype}")
    cu = _int64(cu_seqlens_q, "cu_seqlens_q").reshape(-1)
    kl = _int64(kv_lengths, "kv_lengths").reshape(-1)
    S = cu.numel() - 1
    n_q = cu[1:] - cu[:-1]
    qp = kl - n_q if q_positions is None else _int64(q_positions, "q_positions").reshape(-1)
    table = _int64(block_table, "block_table")
    cdt = _compute_dtype(q.dtype)
    slopes = None
    if alibi_slopes is not None:
        slopes = torch.as_tensor(alibi_slopes).detach().to("cpu", cdt)
        if slopes.dim() == 1:
            slopes = slopes.expand(S, -1)
        slopes = slopes.contiguous()
    left, right = window
    lo = -math.inf if right < 0 else -float(right)              # lo <= p − t <= hi
    hi = math.inf if left < 0 else float(left)
    if softcap is not None and not softcap >= 0:
        raise ValueError(f"softcap must be >= 0 (0 = off), got {softcap}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_pages.stride(-1) != 1 or v_pages.stride(-1) != 1:
        raise ValueError("native.paged_attention: the pages' last dim must be contiguous")
    G = q.shape[1] // max(1, k_pages.shape[2])
    rows = block_q or max(1, _ROWS_PER_ITEM // max(1, G))
    try:
        return ops.paged_attend(  # type: ignore[attr-defined, no-any-return]
            q, k_pages, v_pages, table, cu, kl, qp,
            float(q.shape[-1] ** -0.5 if scale is None else scale), float(softcap or 0.0),
            slopes, lo, hi, int(split_len or 0), int(rows))
    except RuntimeError as e:
        msg = str(e)
        if "attnkit native paged:" in msg:
            raise ValueError(msg.split("attnkit native paged:", 1)[1].split("\n")[0]
                             .strip()) from None
        raise


def paged_merge_rows(out: torch.Tensor, lse: torch.Tensor, src_rows: object,
                     dst_rows: object) -> None:
    """Cascade's merge, in place: row ``src_rows[i]`` of a :func:`paged_attention` call's
    ``(out (total_q, H_q, D_v), lse (total_q, H_q))`` — a query's part over a shared prefix
    — merged by LSE into row ``dst_rows[i]`` — the same query's part over its own keys —
    every head, by :func:`attnkit.backends.base.merge_partials`' rules (an empty part adds
    nothing; NaN in a part's LSE gives NaN). The src rows are left as they were; a row may
    not be both a src and a dst, nor a dst twice (ValueError). One native call, on the
    calling thread for a decode step's few rows."""
    src = _int64(src_rows, "src_rows").reshape(-1)
    dst = _int64(dst_rows, "dst_rows").reshape(-1)
    try:
        _ops().paged_merge_rows(out, lse, src, dst)  # type: ignore[attr-defined]
    except RuntimeError as e:
        msg = str(e)
        if "attnkit native paged_merge_rows:" in msg:
            raise ValueError(msg.split("attnkit native ", 1)[1].split("\n")[0].strip()
                             ) from None
        raise

# ------------------------------------------------------------------ Problem → options
def _extent(p: Problem) -> int:
    """The largest position a score_mod of ``p`` reads (batch, heads, queries, keys): what
    its compiled build must serve (:func:`for_problem`)."""
    return max(p.batch, p.heads_q, p.n_q, p.n_k)


def supports(p: Problem) -> list[str]:
    """Why the native kernel cannot run ``p`` (empty = it can)."""
    if loader.load() is None:
        return [f"native kernel unavailable: {why_unavailable()}"]
    out = []
    q = p.q
    if not q.is_cpu:
        out.append(f"runs on CPU only (inputs are on {p.device})")
    if q.dtype not in DTYPES:
        out.append(f"dtype {p.dtype} is not supported (float32, float64, bfloat16, float16)")
    if p.dropout_p > 0.0:
        out.append(f"no dropout, got dropout_p={p.dropout_p}")
    low = p.lowered
    rest = low.mask.rest
    if rest is not None and not (rest is p.mask and p.mask_tensor is not None):
        size = p.dense_mask_elements()
        if size > DENSE_MASK_LIMIT:
            out.append(f"mask {rest.name!r} has no closed form and its dense form would "
                       f"take {size / 2**20:.0f} MB (limit {DENSE_MASK_LIMIT / 2**20:.0f} MB)")
    if not out and low.terms.user is not None:
        got = for_problem(low.terms.user, _compute_dtype(p.dtype),  # compiled when it would run
                          _extent(p))
        if isinstance(got, str):
            out.append(f"the Python score_mod cannot be compiled natively: {got}")
    return out


class _Terms(NamedTuple):
    """A :class:`Problem`'s score terms and mask as the kernel's options (see :func:`forward`)."""

    alibi_slopes: torch.Tensor | None
    alibi_offset: int
    rel_table: torch.Tensor | None
    rel_max_distance: int | None
    band: tuple[float, float] | None
    kv_lengths: object | None
    q_lengths: object | None
    doc_ids: object | None
    kv_doc_ids: object | None
    dense_mask: torch.Tensor | None
    score_mod: CompiledScoreMod | None


def _terms(p: Problem) -> _Terms:
    """``p`` lowered (:attr:`Problem.lowered`) as the kernel's options, for one kernel call
    (forward or backward). The mask's rest is evaluated densely — or, when it is the bool
    tensor the call gave (``p.mask_tensor``), that tensor is read as it is."""
    low = p.lowered
    parts, terms = low.mask, low.terms
    dense = None
    if parts.rest is not None:
        if parts.rest is p.mask and p.mask_tensor is not None:
            dense = p.mask_tensor                         # (B|1, H_q|1, N_q|1, N_k|1) bool
        else:
            dense = parts.rest.evaluate(p.n_q, p.n_k, batch=p.batch, heads=p.heads_q,
                                        device=p.device)
    ali, rel = terms.alibi, terms.relative
    mod = None
    if terms.user is not None:
        mod = for_problem(terms.user, _compute_dtype(p.dtype), _extent(p))
    return _Terms(None if ali is None else torch.as_tensor(ali.slopes),
                  0 if ali is None else int(ali.offset),
                  None if rel is None else rel.table,
                  None if rel is None else int(rel.max_distance),
                  parts.band, parts.kv_lengths, parts.q_lengths, parts.doc_ids,
                  parts.kv_doc_ids, dense, mod)  # type: ignore[arg-type]


def forward_problem(p: Problem, screened: bool = False) -> Any:
    """Run a :class:`Problem` that :func:`supports` accepts → ``(out, lse)``.

    The Problem's layout was checked where it was made (:func:`attnkit.api.prepare`) and its
    device and dtype by :func:`supports`, so the layout checks of :func:`forward` are not
    repeated (the mask and score terms: :func:`_terms`). ``screened``: see
    :func:`forward_problem_screened`."""
    ops = _ops()
    n_q = p.q.shape[2]
    block = n_q if n_q <= DECODE_MAX_QUERIES else None          # native.decode's block
    if p.mask is None and p.score_mod is None:     # nothing lowered: no term, no mask part
        return _forward(ops, p.q, p.k, p.v, p.scale, p.softcap, None, 0, None, None, p.bias,
                        None, None, None, None, None, None, block, None, None, screened)
    t = _terms(p)
    return _forward(ops, p.q, p.k, p.v, p.scale, p.softcap, t.alibi_slopes, t.alibi_offset,
                    t.rel_table, t.rel_max_distance, p.bias, t.band, t.kv_lengths,
                    t.q_lengths, t.doc_ids, t.kv_doc_ids, t.dense_mask, block, None,
                    t.score_mod, screened)


def forward_problem_screened(p: Problem,
                             ) -> tuple[torch.Tensor, torch.Tensor, bool, bool] | None:
    """:func:`forward_problem` with the eager path's NaN/inf screens read by the kernel as it
    goes → ``(out, lse, q finite, out finite)``: whether every query element it gathered
    holds no inf/NaN (rows past ``q_lengths`` are not gathered: their output is 0 whatever
    they hold), and whether every output element is finite (False too where the kernel did
    not see the final output: a call whose keys are split and merged) — under a compiled
    score_mod also every K and V row of the tiles it read, which it screens only on the
    low-precision GEMM path with the per-thread head cache (False elsewhere). Each replaces one
    more pass over the tensor (together ~5% of a float32 sliding-window forward). None,
    before the kernel runs, where the call needs autograd (the tiled engine asks only
    without gradients on q, k, v and bias, so the mask is not lowered twice)."""
    return forward_problem(p, screened=True)  # type: ignore[no-any-return]


def all_finite(t: torch.Tensor) -> bool | None:
    """Whether every element of the 4-D CPU tensor ``t`` is finite, in one pass of the
    kernel's vector loop over its rows (any strides); None when the kernel is not loaded
    or does not take ``t`` (a GPU tensor never loads it; see :func:`known_finite`), and
    under a dispatch mode or a torch.func transform (``t`` may hold no data)."""
    if t.dim() != 4 or not t.is_cpu or t.dtype not in DTYPES or _compat.intercepted(t):
        return None
    op = getattr(loader.load(), "all_finite", None)
    return None if op is None else bool(op(t))


def known_finite(t: torch.Tensor) -> bool:
    """Whether every element of the 4-D tensor ``t`` is finite, as one pass can tell: the
    kernel's (:func:`all_finite`), else one torch sum in the compute dtype (float32, or
    float64 for float64). False also where a sum of finite values overflows: the callers
    (the eager path's NaN/inf screens) then run their exact row test."""
    ok = all_finite(t)
    if ok is not None:
        return ok
    acc = torch.float64 if t.dtype is torch.float64 else torch.float32
    return math.isfinite(float(t.detach().sum(dtype=acc)))


class LeanLaunch(NamedTuple):
    """How the eager hot path runs a call on the kernel's lean operator
    ``attend_lean(q, k, v, scale, softcap, band_lo, band_hi, mask, splits, block_q,
    check_q) -> (out, lse, finite)``: what :func:`forward_problem` would pass, fixed per
    call signature (see :func:`lean_launch`). ``finite``: every output element — and with
    ``check_q`` every query element — is finite."""

    op: object                          # torch.ops.attnkit_native.attend_lean.default's call
    scale: float
    softcap: float                      # 0 = none
    band_lo: float                      # allowed ⇔ band_lo <= q − k <= band_hi
    band_hi: float
    splits: int
    block_q: int
    masked: bool                        # the call passes its bool mask tensor
    check_q: bool
    # the arguments after (q, k, v) of an unmasked call, in one tuple: the hot path passes
    # them as op(q, k, v, *tail) (one attribute read, not seven, on a cold call); built by
    # lean_launch only — a _replace of another field leaves it stale
    tail: tuple[object, ...]
    # attend_slot's call (None where the library has no such operator) and its arguments
    # after (q, k, v, q_sig, k_sig, v_sig): attnkit.attention's per-token call, whose
    # signature the operator checks itself (see eager._Hot)
    slot: object = None
    slot_tail: tuple[object, ...] = ()


def lean_launch(p: Problem, *, check_q: bool = False) -> LeanLaunch | None:
    """The lean launch of ``p`` when it is one :func:`forward_problem` runs with no score
    term, no bias and no mask but a band and (at most) the bool tensor the call gave
    (``p.mask_tensor``), without gradients; else None. It depends on the call's signature
    (shapes, dtypes, options, the thread count) and not on any tensor's values."""
    if supports(p) or p.requires_grad or p.score_mod is not None or p.bias is not None:
        return None
    B, Hq, n_q, d_k = p.q.shape
    Hkv, n_k = p.k.shape[1], p.k.shape[2]
    if n_q == 0 or n_k == 0 or d_k == 0 or p.v.shape[3] == 0 or B == 0 or Hq == 0 \
            or p.softcap is not None and not p.softcap > 0:
        return None
    parts = p.lowered.mask
    if parts.kv_lengths is not None or parts.q_lengths is not None \
            or parts.doc_ids is not None or parts.kv_doc_ids is not None:
        return None                           # closed-form parts: the full record
    masked = parts.rest is not None
    if masked and (parts.rest is not p.mask or p.mask_tensor is None):
        return None                           # a rest evaluated densely
    op = getattr(_ops(), "attend_lean", None)
    if op is None:
        return None
    lo, hi = (-math.inf, math.inf) if parts.band is None else parts.band
    rows = n_q if n_q <= DECODE_MAX_QUERIES else \
        max(1, _rows_per_item(p.q.dtype, (lo, hi)) // (Hq // Hkv))
    # the overload's own C++ call (what OpOverload.__call__ calls: one Python frame less,
    # measurable on the per-token path, where the frame's code is a cache miss)
    call = getattr(op.default, "_op", op.default)
    scale, softcap = float(p.scale), float(p.softcap or 0.0)
    splits = _auto_splits(B * Hkv * -(-n_q // rows), n_k)
    slot = getattr(_ops(), "attend_slot", None)
    slot = None if slot is None else getattr(slot.default, "_op", slot.default)
    return LeanLaunch(call, scale, softcap, float(lo), float(hi), splits, rows, masked, check_q,
                      (scale, softcap, float(lo), float(hi), None, splits, rows, check_q),
                      slot, (scale, softcap, float(lo), float(hi), splits, rows, check_q))


def backward_problem(p: Problem, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                     dlse: torch.Tensor | None = None, *, bias_grad: bool = False,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The kernel's own (FlashAttention-2) backward of a :class:`Problem` that
    :func:`supports` accepts, from a forward's saved ``out`` and ``lse``: no forward is
    recomputed and no autograd graph is built. ``out``/``lse`` may come from any engine's
    forward of ``p`` (the backward rebuilds the weights as ``exp(s − lse)``).

    Shapes (Problem layout): ``out``, ``dout`` (B, H_q, N_q, D_v); ``lse``, ``dlse``
    (B, H_q, N_q); → ``dq`` like q, ``dk``/``dv`` (B, H_kv, N_k, D) in q's dtype (for K/V
    broadcast over the batch, still per batch element: the caller sums), and ``dbias``
    (B, H_q, N_q, N_k) in the compute dtype when ``bias_grad`` (``p.bias`` given), else
    None. Score terms' own tensors (ALiBi slopes, a relative table) get no gradient here.
    """
    ops = _ops()
    t = _terms(p)
    q, k, v = p.q, p.k, p.v
    q, k, v = unit_rows(q, k, v)
    B, Hq, Nq, Dk = q.shape
    cdt = _compute_dtype(q.dtype)
    rel = _rel_table(t.rel_table, t.rel_max_distance, Hq)
    common, call = _common(q, k, v, B, Hq, Nq, k.shape[2], Dk, cdt, p.scale, p.softcap,
                           t.alibi_slopes, t.alibi_offset, rel, t.rel_max_distance, p.bias,
                           t.band, t.kv_lengths, t.q_lengths, t.doc_ids, t.kv_doc_ids,
                           t.dense_mask, t.score_mod)
    bias_grad = bias_grad and p.bias is not None
    dq, dk, dv, _, _, dbias = _kernel_backward(ops, q, k, v, out, lse.to(cdt).contiguous(),
                                               dout, dlse, common, False, bias_grad)
    if call is not None:
        call.check()                                         # an index out of range: raise
    return dq, dk, dv, dbias if bias_grad else None
