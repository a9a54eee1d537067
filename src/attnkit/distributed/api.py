"""The entry point, :func:`ring_attention`: local validation, the collective option check,
then the chosen strategy (ring or Ulysses)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .. import backends as _backends
from .. import masks as _masks
from ..api import prepare
from .checks import _check_group, _check_timeout, _option_row, _refuse_unrunnable
from .collectives import DEFAULT_TIMEOUT_S, _Ring
from .layout import _check_layout
from .ring import _Options, _RingAttention
from .schedule import Band
from .ulysses import _check_ulysses, _ulysses

STRATEGIES = ("ring", "ulysses")     # K/V shards around a ring, or heads by all-to-all


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Any = None,
    is_causal: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
    backend: str = "auto",
    return_lse: bool = False,
    timeout: float | None = DEFAULT_TIMEOUT_S,
    layout: str = "contiguous",
    strategy: str = "ring",
    mask: Any = None,
    score_mod: Any = None,
) -> Any:
    """Exact attention over a sequence sharded across the ranks of a process group.

    Shapes (per rank; the global sequence is the concatenation of the shards in rank order)::

        q (..., H_q, N_q, D_k)   k (..., H_kv, N_k, D_k)   v (..., H_kv, N_k, D_v)
        → out (..., H_q, N_q, D_v)       [and lse (..., H_q, N_q) with return_lse=True]

    Rank ``r`` passes its shard of the global sequence — with ``layout="contiguous"`` queries
    ``[r·N_q, (r+1)·N_q)`` and keys/values ``[r·N_k, (r+1)·N_k)``, with ``layout="zigzag"``
    chunks ``r`` and ``2W−1−r`` of ``2W`` (see :func:`shard_sequence`) — and gets back its
    rows of the global output, in the same order. Differentiable: the
    gradients of q, k, v are those of single-process :func:`attnkit.attention` on the
    concatenated sequence (restricted to this rank's shard). Every rank of the group must call
    this together with the same shapes and options (and, when the inputs need gradients, the
    backward of the result).

    Args:
        group: the ``torch.distributed`` process group; ``None`` = the default group.
        is_causal: global causal attention (query at global position i sees keys 0..i).
            The ring needs ``N_q == N_k``; blocks of later positions are skipped entirely.
        scale: multiplies the scores; defaults to ``1/√D_k``.
        softcap: ``c`` maps each scaled logit x to ``c·tanh(x/c)``.
        backend: backend for each block (as in :func:`attnkit.attention`); default ``"auto"``.
        return_lse: also return the global log-sum-exp of this rank's query rows.
        timeout: the longest wait, in seconds, for a peer at any step (the option check, each
            hop of the forward and the backward ring, each all-to-all, the status checks);
            default :data:`DEFAULT_TIMEOUT_S` (five minutes). ``None``: the process group's
            timeout.
        layout: ``"contiguous"`` (default) or ``"zigzag"`` (balanced causal work; shard
            lengths must be even). The same on every rank, and the layout the shards were
            cut in (:func:`shard_sequence`).
        strategy: ``"ring"`` (default) or ``"ulysses"`` (all-to-all over heads: ``H_q`` a
            multiple of ``W``; see the module docstring for when each wins).
        mask: an :class:`attnkit.masks.Mask` over the GLOBAL sequence (positions as in the
            unsharded call). ``strategy="ring"``: a band (``masks.sliding_window``,
            ``masks.band``, ``masks.window``, ``masks.causal``; instead of ``is_causal``) —
            shards it does not reach are neither computed nor sent. ``strategy="ulysses"``:
            any mask that does not depend on the head index.
        score_mod: ``strategy="ulysses"`` only: as in :func:`attnkit.attention`, with global
            positions and global head indices (ALiBi / relative-bias terms included).

    Raises:
        RuntimeError: torch.distributed is unavailable or the process group is not
            initialised, or this process is not a member of ``group``.
        ValueError / TypeError: invalid inputs or options on any rank, options that differ
            between ranks, or a forced ``backend`` that cannot run the blocks (raised on
            every rank, before any shard moves).
        RingAttentionError: a peer timed out, died, or failed in the ring (its own error is
            raised on the failing rank).
    """
    if not dist.is_available():
        raise RuntimeError("ring_attention needs torch.distributed, which this torch build lacks")
    if not dist.is_initialized():
        raise RuntimeError(
            "ring_attention needs an initialised process group: call "
            "torch.distributed.init_process_group(...) first (e.g. backend 'gloo' on CPU, "
            "'nccl' on GPU), or use attnkit.attention on a single process"
        )
    if group is not None and dist.get_rank(group) < 0:
        raise RuntimeError(
            f"this process (global rank {dist.get_rank()}) is not a member of the given "
            "process group: call ring_attention only on the group's ranks"
        )
    ring = _Ring(group)
    if ring.backend == "nccl":      # NCCL only moves CUDA tensors
        ring.device = (q.device if isinstance(q, torch.Tensor) and q.is_cuda
                       else torch.device("cuda", torch.cuda.current_device()))
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v))
    local_error: Exception | None = None
    prep = None
    band: Band | None = None        # the ring's global band mask (None: causal or none)
    try:
        ring.timeout = _check_timeout(timeout)
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"ring_attention: {name} must be a torch.Tensor, got "
                                f"{type(t).__name__}")
        prep = prepare(q, k, v, scale=scale, softcap=softcap)
        _backends.check_name(backend)
        _check_layout(layout, "ring_attention")
        if strategy not in STRATEGIES:
            raise ValueError(f"ring_attention: strategy must be one of "
                             f"{', '.join(map(repr, STRATEGIES))}, got {strategy!r}")
        p = prep.problem
        if layout == "zigzag" and (p.n_q % 2 or p.n_k % 2):
            raise ValueError(
                f"ring_attention with layout='zigzag': each shard holds two equal chunks "
                f"(global chunks r and 2W−1−r), so the shard lengths must be even — the "
                f"global sequence a multiple of 2·W = {2 * ring.size} — got N_q={p.n_q}, "
                f"N_k={p.n_k} (q {tuple(q.shape)}): pad the sequence (and mask the padding), "
                "or use layout='contiguous'")
        if ring.backend == "nccl" and q.device.type != "cuda":
            raise ValueError(f"the NCCL backend needs CUDA tensors, got q on {q.device}: "
                             "move the shards to the GPU or use the gloo backend")
        if strategy == "ulysses":
            _check_ulysses(prep, ring.size, ring.rank, bool(is_causal), mask, score_mod,
                           backend, needs_grad)
        else:
            band = _ring_band(mask, score_mod, bool(is_causal), ring.size * p.n_q,
                              ring.size * p.n_k)
            if is_causal and p.n_q != p.n_k:
                raise ValueError(
                    f"ring_attention with is_causal=True needs query and key shards of one "
                    f"length (a self-attention sequence split evenly), got N_q={p.n_q} (q "
                    f"{tuple(q.shape)}) and N_k={p.n_k} (k {tuple(k.shape)})"
                )
            _refuse_unrunnable(p, backend, bool(is_causal) or band is not None, ring.size,
                               needs_grad)
    except Exception as e:      # any local failure: the peers must hear of it, not wait
        local_error = e
    resolved = prep.problem if prep is not None else None     # scale as it will be used
    _check_group(ring, _option_row(q, k, v, local_error, is_causal,
                                   getattr(resolved, "scale", None),
                                   getattr(resolved, "softcap", None), backend, needs_grad,
                                   layout, strategy, mask, score_mod, return_lse),
                 local_error)
    assert prep is not None
    p = prep.problem
    o = _Options(ring, bool(is_causal), p.scale, p.softcap, backend, layout, p.n_q, p.n_k,
                 band=band)
    if strategy == "ulysses":
        out, lse = _ulysses(prep, o, mask, score_mod, bool(return_lse))
    else:
        out, lse = _RingAttention.apply(p.q, p.k, p.v, o)
    if return_lse:
        return prep.restore(out), prep.restore(lse)
    return prep.restore(out)


def _ring_band(mask: Any, score_mod: Any, is_causal: bool, n_q: int, n_k: int) -> Band | None:
    """The ring's global band for ``mask`` (a band mask: causal, sliding windows, …) over the
    global ``n_q × n_k`` sequence, or None without one; a clear error for what the ring
    cannot take."""
    if score_mod is not None or (mask is not None and (
            not isinstance(mask, _masks.Mask)
            or _masks.decompose(mask, n_q, n_k).as_band() is None)):
        raise ValueError(
            "ring_attention: with strategy='ring' a mask must be a band over the global "
            "sequence (masks.causal, masks.sliding_window, masks.band, masks.window), and "
            "score_mod= needs the whole sequence in one call: strategy='ulysses' takes any "
            "head-independent mask and score_mod (heads split over the ranks instead of the "
            f"sequence); got mask {getattr(mask, 'name', type(mask).__name__)}"
            + ("" if score_mod is None else " and a score_mod"))
    if mask is None:
        return None
    if is_causal:
        raise ValueError(
            f"ring_attention: pass either is_causal=True or mask=, not both (got mask "
            f"{mask.name}): masks.sliding_window(w) is causal already, and is_causal=True is "
            "masks.causal()")
    return _masks.decompose(mask, n_q, n_k).as_band()
