"""The compiled path of the general engine: a user's Python score_mod fused by torch.compile.

A float32 / bfloat16 / float16 score_mod first goes to the native kernel, which compiles it
into its own fused pass (``native/score_mod.py``); this path is the fallback for the calls
the native kernel cannot run (float64, an op it does not know, a captured tensor with grad,
``ATTNKIT_NATIVE=0``, no compiler).

On the current path a score_mod runs as a chain of eager torch ops per tile (each a pass
over a ``(B, H_q, bq, L)`` tensor), and those passes — not the matmuls — took about 5/6 of
the time of an ALiBi-like user function (causal, N=2048, H=8, D=64: 1.2 s, of which
0.19 s in bmm/baddbmm). Here the *elementwise part* of a tile is compiled by
``torch.compile`` (Inductor, C++ on CPU, as FlexAttention does on CPU): soft-cap →
score_mod → + bias → mask → online-softmax update in the forward, and recompute
``P = exp(logits − lse)`` → ``dS = P ∘ (dP − D)`` → the score_mod's (and soft-cap's)
derivative by ``torch.func.vjp`` in the backward, each fused into a few C++ loops. The
matmuls stay torch's (``bmm`` / ``baddbmm_``, BLAS), outside the compiled function.

Compiled functions are cached per score_mod *code* (a new closure of the same code reuses
them: Dynamo guards on what it captured), each key with its own copy of the template code
object, so one key's recompiles never count against another's; at most ``_CACHE_SIZE`` keys
are kept (least recently used dropped). Shapes are dynamic (``dynamic=True``): edge blocks
and chunks do not recompile. A band mask (causal, sliding window) is fused in closed form
from the lowered call (``Problem.lowered``); other masks are evaluated per tile
(``Mask.evaluate``) and passed in.

When: ``ATTNKIT_COMPILE=0`` never; ``ATTNKIT_COMPILE=1`` always; otherwise (auto) for a call
of at least ``AUTO_SCORES`` scores ``B·H_q·N_q·N_k`` (2^23: H=8, N=1024) — compiling costs
seconds once per process, so small calls stay on the current path unless asked.

Shape legend::

    s, x, e, pr, ds, dp  (B, H_q, bq, L)     one tile: bq query rows × L keys
    m, lsum, lse, dcol   (B, H_q, bq, 1)     running max / sum, saved LSE, rowsum(dO∘O)
    b (B,1,1,1)  h (1,H_q,1,1)  q_idx (1,1,bq,1)  kv_idx (1,1,1,L)
    allowed (B|1, H_q|1, bq, L) bool         lo, hi 0-d int64 (band: lo <= q − k <= hi)

Measured (fp32, B=1, H=8, D=64, causal, user-written ALiBi ``score - slopes[h] *
|q_idx - kv_idx|``, ratio to the same call without score_mod, one run, compile apart: 4.3 s
forward + 1.0 s backward once): N=1024 0.64× / 0.48× (forward / forward+backward), N=2048
0.56× / 0.62×, N=4096 0.70× / 0.62× (2 threads, ``OMP_WAIT_POLICY=PASSIVE``); the current
path gave 0.31× / 0.31× at N=4096.

Caution
-------
- On a loaded machine, OpenMP's default spin-waiting between the many short parallel regions
  (Inductor's loops, then BLAS, per tile) can make the path several times slower with 2
  threads than with 1 (N=4096: 0.23× at 2 threads and load 6 vs 0.60× at 1 thread);
  ``OMP_WAIT_POLICY=PASSIVE`` removes it.
- Used only for a score_mod without tensors of its own that need gradients (probed by the
  general engine), without dropout and without a bias that needs a gradient: those stay on
  the current path (``torch.utils.checkpoint``), as do calls made while being traced by
  torch.compile itself and soft-cap-only calls.
- The first call of a score_mod code compiles (measured here: 5–10 s forward, 2–5 s
  backward on a loaded 2-core machine; less from Inductor's on-disk cache in later
  processes); :func:`stats` reports it apart. A score_mod Dynamo cannot trace in one graph
  (``fullgraph=True``: ``.item()``, data-dependent Python control flow, unsupported calls),
  a missing C++ compiler or any other compile error → one warning per score_mod code, and
  the current path from then on (the forward reruns there; a backward finishes with the same
  tile math uncompiled). An error of the score_mod itself is then raised by the current path.
- Per-tile result checks of ``scores.checked_score_mod`` are not repeated here (the probe at
  ``prepare`` checked the function); its result is cast to the score dtype and broadcast to
  the tile, as the checked wrapper does.
- Dynamo keeps at most its ``recompile_limit`` (default 8) graphs per key (dtypes, mask
  kinds, soft-cap values, size-1 specialisations); beyond that Dynamo itself runs the tile
  eagerly (correct, slower) and says so.
"""

from __future__ import annotations

import collections
import math
import os
import threading
import time
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ... import scores as _scores
from ..base import Problem, compute_dtype, finish, refuse_double_backward, softmax_shift
from .counters import count
from .matmul import add_tmm_, addmm_, mm
from .plan import Plan, allowed_tile, backward_rows, bias_tile

__all__ = ["mode", "attention", "stats", "clear", "AUTO_SCORES"]

AUTO_SCORES = 1 << 23           # auto: compile for calls with at least this many scores
_CACHE_SIZE = 16


class _Fallback(Exception):
    """The compiled path cannot run this call: use the current path."""


def mode() -> str:
    """``"off"`` (``ATTNKIT_COMPILE=0``), ``"on"`` (``ATTNKIT_COMPILE=1``) or ``"auto"``."""
    env = os.environ.get("ATTNKIT_COMPILE", "").strip().lower()
    if env in ("0", "off", "false", "no"):
        return "off"
    if env in ("1", "on", "true", "yes"):
        return "on"
    return "auto"


# ---------------------------------------------------------------- the tile functions
# Module-level templates; each cache key runs its own copy (a new code object).
def _mod(fn, s, b, h, qi, ki, bias, cap):  # noqa: ANN001, ANN202
    """soft-cap → score_mod → + bias on a tile ``s (B, H_q, bq, L)``."""
    x = s if cap is None else _scores.soft_cap(s, cap)
    y = fn(x, b, h, qi, ki).to(s.dtype).expand(s.shape)            # (B, H_q, bq, L)
    return y if bias is None else y + bias


def _allowed(qi, ki, lo, hi, allowed):  # noqa: ANN001, ANN202
    if allowed is not None:
        return allowed                                              # (B|1, H_q|1, bq, L)
    d = qi - ki                                                     # (1, 1, bq, L)
    return (d >= lo) & (d <= hi)


def _forward_tile(fn, s, m, lsum, b, h, qi, ki, lo, hi, allowed, bias, cap):  # noqa: ANN001, ANN202
    """One online-softmax step → ``e (B, H_q, bq, L)``, new max, new sum, ``alpha``."""
    x = _mod(fn, s, b, h, qi, ki, bias, cap)
    x = torch.where(_allowed(qi, ki, lo, hi, allowed), x, -math.inf)  # (B, H_q, bq, L)
    m_new = torch.maximum(m, x.amax(-1, keepdim=True))              # (B, H_q, bq, 1)
    shift = torch.where(m_new == -math.inf, 0.0, m_new)             # softmax_shift
    alpha = torch.exp(m - shift)                                    # rescales the past
    e = torch.exp(x - shift)                                        # (B, H_q, bq, L)
    return e, m_new, lsum * alpha + e.sum(-1, keepdim=True), alpha


def _backward_tile(fn, s, dp, lse, dcol, b, h, qi, ki, lo, hi, allowed, bias, cap):  # noqa: ANN001, ANN202
    """``P = exp(logits − lse)`` and ``dS`` w.r.t. the raw scores ``s`` (through the
    score_mod and soft-cap by ``torch.func.vjp``) → ``pr, ds (B, H_q, bq, L)``."""
    y, pull = torch.func.vjp(lambda x: _mod(fn, x, b, h, qi, ki, bias, cap), s)
    pr = torch.where(_allowed(qi, ki, lo, hi, allowed), torch.exp(y - lse), 0.0)
    (ds,) = pull(pr * (dp - dcol))
    return pr, ds


def _copy(fn: Callable[..., Any], tag: str) -> Callable[..., Any]:
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__,
                              fn.__closure__)


class _Tiles:
    """The compiled forward and backward tile functions of one cache key."""

    def __init__(self, name: str, tag: str) -> None:
        self.name = name
        self.failed = False
        self.calls = 0
        self.first: dict[str, float] = {}          # first call's seconds (includes compile)
        self.fwd: Callable[..., Any] = torch.compile(_copy(_forward_tile, tag), dynamic=True,
                                                     fullgraph=True)
        self.bwd: Callable[..., Any] = torch.compile(_copy(_backward_tile, tag), dynamic=True,
                                                     fullgraph=True)

    def run(self, which: str, *args: Any) -> Any:
        fn = self.fwd if which == "fwd" else self.bwd
        if which in self.first:
            return fn(*args)
        t0 = time.perf_counter()
        try:
            out = fn(*args)
        except Exception as e:  # noqa: BLE001 — any compile failure means: the current path
            self.failed = True
            why = (str(e).splitlines() or [""])[0][:300]
            warnings.warn(
                f"attnkit: torch.compile could not compile the tiles of score_mod "
                f"{self.name} ({type(e).__name__}: {why}); "
                "using the uncompiled path for it (correct, slower). Make the score_mod "
                "traceable by torch.compile (no .item(), no Python branches on tensor "
                "values), check that a C++ compiler is installed, or set ATTNKIT_COMPILE=0 "
                "to skip compiling.", RuntimeWarning, stacklevel=2)
            if which == "fwd":
                raise _Fallback from e
            self.bwd = _backward_tile                      # finish this backward eagerly
            return _backward_tile(*args)
        self.first[which] = time.perf_counter() - t0
        return out


_CACHE: collections.OrderedDict[Any, _Tiles] = collections.OrderedDict()
_LOCK = threading.Lock()
_SERIAL = [0]


def stats() -> dict[str, Any]:
    """Cached keys and their first-call seconds (compile time, reported apart from runs)."""
    with _LOCK:
        return {"keys": len(_CACHE),
                "first_call_s": {t.name: dict(t.first) for t in _CACHE.values()},
                "failed": [t.name for t in _CACHE.values() if t.failed]}


def clear() -> None:
    """Forget every compiled tile function (tests; frees their code objects)."""
    with _LOCK:
        _CACHE.clear()


def _evaluate(p: Problem) -> tuple[Callable[..., Any], Any]:
    """The function the tiles call (broadcast call or FlexAttention's per-score call) and
    the cache key of its code."""
    sm = p.score_mod
    user = _scores.unwrap(sm)
    if user is sm:                                    # a raw broadcast score_mod
        fn, per_score = sm, False
    elif isinstance(user, _scores.ScoreTerm):
        fn, per_score = user.fn, False
    else:
        fn = _scores.flex_semantics(user, with_score=True, batch=p.batch, heads=p.heads_q,
                                    n_q=p.n_q, n_k=p.n_k, dtype=compute_dtype(p.dtype),
                                    device=p.device)
        per_score = fn is not user
        fn = user
    code = getattr(fn, "__code__", None)
    key = (code if code is not None else fn, per_score)
    return (_scores.per_element(fn) if per_score else fn), key


def _tiles(p: Problem) -> tuple[Callable[..., Any], _Tiles] | None:
    """The score_mod to call and its compiled tiles, or None: the current path."""
    m = mode()
    if m == "off" or p.score_mod is None or torch.compiler.is_compiling():
        return None
    fn, key = _evaluate(p)
    with _LOCK:
        tiles = _CACHE.get(key)
        if tiles is None:
            if m == "auto" and p.batch * p.heads_q * p.n_q * p.n_k < AUTO_SCORES:
                return None
            _SERIAL[0] += 1
            tiles = _CACHE[key] = _Tiles(_scores.fn_name(_scores.unwrap(p.score_mod)),
                                         f"attnkit{_SERIAL[0]}")
            while len(_CACHE) > _CACHE_SIZE:
                _CACHE.popitem(last=False)
        _CACHE.move_to_end(key)
    return (None if tiles.failed else (fn, tiles))


# ---------------------------------------------------------------- the engine
def _band(p: Problem) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The band's ``(lo, hi)`` as 0-d int64 tensors (infinite bounds clamped), or None."""
    big = p.n_q + p.n_k + 1
    if p.mask is None:
        band: tuple[float, float] | None = (-big, big)
    else:
        band = p.lowered.mask.as_band()
    if band is None:
        return None
    lo, hi = (int(max(-big, min(big, x))) for x in band)
    return torch.tensor(lo), torch.tensor(hi)


class _Env:
    """What every tile of one call shares."""

    def __init__(self, p: Problem, pl: Plan, chunk: int, bias: torch.Tensor | None,
                 fn: Callable[..., Any], tiles: _Tiles) -> None:
        self.p, self.pl, self.chunk, self.bias, self.fn, self.tiles = p, pl, chunk, bias, fn, tiles
        self.band = _band(p)
        big = p.n_q + p.n_k + 1
        self.open = (torch.tensor(-big), torch.tensor(big))          # an unmasked run
        self.b = torch.arange(p.batch).view(-1, 1, 1, 1)
        self.h = torch.arange(p.heads_q).view(1, -1, 1, 1)
        self.cap = p.softcap

    def tile_args(self, masked: bool, q0: int, q1: int, k0: int, k1: int) -> tuple[Any, ...]:
        """``b, h, q_idx, kv_idx, lo, hi, allowed, bias, cap`` of one tile."""
        p = self.p
        lo, hi = self.open
        allowed = None
        if masked and p.mask is not None:
            if self.band is not None:
                lo, hi = self.band
            else:
                allowed = allowed_tile(p, q0, q1, k0, k1)              # (B|1, H_q|1, bq, L)
        bt = None if self.bias is None else bias_tile(self.bias, q0, q1, k0, k1)
        qi = torch.arange(q0, q1).view(1, 1, -1, 1)
        ki = torch.arange(k0, k1).view(1, 1, 1, -1)
        return self.b, self.h, qi, ki, lo, hi, allowed, bt, self.cap


def _forward(env: _Env, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every block, nothing recorded → out (B, H_q, N_q, D_v), lse (B, H_q, N_q)."""
    p = env.p
    B, hq, hkv, g = p.batch, p.heads_q, p.heads_kv, p.group
    out = q.new_zeros(B, hq, p.n_q, p.d_v)
    lse = torch.full((B, hq, p.n_q), -math.inf, dtype=q.dtype)
    for blk in env.pl.blocks:
        if not blk.runs:
            continue
        q0, q1 = blk.q0, blk.q1
        bq = q1 - q0
        qb = q[:, :, :, q0:q1].reshape(B * hkv, g * bq, p.d_k)     # (B·H_kv, G·bq, D_k)
        m = torch.full((B, hq, bq, 1), -math.inf, dtype=q.dtype)    # running max
        lsum = torch.zeros((B, hq, bq, 1), dtype=q.dtype)           # running sum
        acc = q.new_zeros(B * hkv, g * bq, p.d_v)                   # (B·H_kv, G·bq, D_v)
        for run in blk.runs:
            for k0 in range(run.k0, run.k1, env.chunk):
                k1 = min(k0 + env.chunk, run.k1)
                count(runs=1)
                s = mm(qb, k[:, k0:k1].transpose(1, 2)).view(B, hq, bq, k1 - k0)
                e, m, lsum, alpha = env.tiles.run(
                    "fwd", env.fn, s, m, lsum, *env.tile_args(run.masked, q0, q1, k0, k1))
                addmm_(acc.mul_(alpha.view(B * hkv, g * bq, 1)),
                       e.view(B * hkv, g * bq, k1 - k0), v[:, k0:k1])
        o, l_ = finish(acc.view(B, hq, bq, -1), lsum.squeeze(-1), softmax_shift(m).squeeze(-1))
        out[:, :, q0:q1] = o
        lse[:, :, q0:q1] = l_
    return out, lse


class _CompiledAttention(torch.autograd.Function):
    """The compiled tiles with the general engine's FlashAttention-2 backward.

    ``q (B, H_kv, G, N_q, D_k)`` pre-scaled; ``k (B·H_kv | H_kv, N_k, D_k)``,
    ``v (B·H_kv | H_kv, N_k, D_v)`` (H_kv: shared over the batch, see :mod:`.matmul`).
    """

    @staticmethod
    def forward(ctx, q, k, v, env):  # noqa: ANN001, ANN205
        out, lse = _forward(env, q, k, v)
        ctx.env = env
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):  # noqa: ANN001, ANN205
        refuse_double_backward("tiled")
        q, k, v, out, lse = ctx.saved_tensors
        env = ctx.env
        p = env.p
        B, hq, hkv, g = p.batch, p.heads_q, p.heads_kv, p.group
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        dcol, lse_b = backward_rows(dout, out, lse, dlse)        # (B, H_q, N_q, 1) each
        for blk in env.pl.blocks:
            if not blk.runs:
                continue
            q0, q1 = blk.q0, blk.q1
            bq = q1 - q0
            qb = q[:, :, :, q0:q1].reshape(B * hkv, g * bq, p.d_k)  # (B·H_kv, G·bq, D_k)
            dob = dout[:, :, q0:q1].reshape(B * hkv, g * bq, p.d_v)  # (B·H_kv, G·bq, D_v)
            lb, db = lse_b[:, :, q0:q1], dcol[:, :, q0:q1]       # (B, H_q, bq, 1)
            dqb = torch.zeros_like(qb)
            for run in blk.runs:
                for k0 in range(run.k0, run.k1, env.chunk):
                    k1 = min(k0 + env.chunk, run.k1)
                    L = k1 - k0
                    s = mm(qb, k[:, k0:k1].transpose(1, 2)).view(B, hq, bq, L)
                    dp = mm(dob, v[:, k0:k1].transpose(1, 2)).view(B, hq, bq, L)
                    pr, ds = env.tiles.run("bwd", env.fn, s, dp, lb, db,
                                           *env.tile_args(run.masked, q0, q1, k0, k1))
                    p2 = pr.reshape(B * hkv, g * bq, L)           # (B·H_kv, G·bq, L)
                    ds2 = ds.reshape(B * hkv, g * bq, L)
                    add_tmm_(dv[:, k0:k1], p2, dob)               # dV += Pᵀ dO
                    addmm_(dqb, ds2, k[:, k0:k1])                 # dQ += dS K
                    add_tmm_(dk[:, k0:k1], ds2, qb)               # dK += dSᵀ Q
            dq[:, :, :, q0:q1] = dqb.view(B, hkv, g, bq, p.d_k)
        return dq, dk, dv, None


def attention(p: Problem, pl: Plan, chunk: int, q: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor, bias: torch.Tensor | None,
              ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The general engine's call on compiled tiles → ``(out, lse)`` in the compute dtype, or
    None when the current path should run it (off, not worth compiling yet, or compiling
    failed — then after one warning). ``q (B, H_kv, G, N_q, D_k)`` pre-scaled,
    ``k (B·H_kv | H_kv, N_k, D_k)``, ``v (B·H_kv | H_kv, N_k, D_v)`` (H_kv: K/V shared
    over the batch, never copied per batch element), ``bias`` without grad."""
    got = _tiles(p)
    if got is None:
        return None
    fn, tiles = got
    env = _Env(p, pl, chunk, bias, fn, tiles)
    try:
        if torch.is_grad_enabled():
            return _CompiledAttention.apply(q, k, v, env)
        return _forward(env, q, k, v)
    except _Fallback:
        return None
