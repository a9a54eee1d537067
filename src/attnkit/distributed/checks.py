"""The collective option check: before any shard moves, every rank all-gathers a small
vector of its shapes, dtype and options, so that a difference (or one rank's invalid inputs)
raises the same clear error on every rank; and the local checks that feed it."""

from __future__ import annotations

import math
import numbers
import struct
import zlib
from typing import Any

import torch

from .. import backends as _backends
from .. import scores as _scores
from ..api import prepare
from ..backends.base import Problem, compute_dtype
from .collectives import _Ring

_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
_META_DIMS = 6          # the trailing dims of q/k/v shown per rank (padded with -1)
_LEAD_DIMS = 4          # leading dims beyond those, recorded too (a CRC covers the rest)
_NAME_SLOTS = 4         # the backend name travels as 8 bytes per int64 slot (32 bytes shown)


def _bits(x: float) -> int:
    """A float as the int64 with the same bits (compared exactly, shown as the float)."""
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _float(b: int) -> float:
    return struct.unpack("<d", struct.pack("<q", b))[0]


def _shape_row(t: Any) -> list[int]:
    """[ndim, crc of the shape, last _META_DIMS sizes, the _LEAD_DIMS before] (-1 = none)."""
    n = _META_DIMS + _LEAD_DIMS
    if not isinstance(t, torch.Tensor):
        return [-1, -1] + [-1] * n
    shape = list(t.shape)
    tail = shape[-_META_DIMS:]
    lead = shape[:-_META_DIMS][-_LEAD_DIMS:] if t.dim() > _META_DIMS else []
    row = tail + [-1] * (_META_DIMS - len(tail)) + lead + [-1] * (_LEAD_DIMS - len(lead))
    return [t.dim(), zlib.crc32(repr(shape).encode())] + row


def _fmt(row: list[int]) -> str:
    ndim = row[0]
    if ndim < 0:
        return "(not a tensor)"
    tail = ", ".join(map(str, row[2:2 + min(ndim, _META_DIMS)]))
    if ndim <= _META_DIMS:
        return f"({tail})"
    lead = [str(d) for d in row[2 + _META_DIMS:] if d >= 0]
    more = "…, " if ndim > _META_DIMS + _LEAD_DIMS else ""
    return f"(…, {tail}) after leading dims ({more}{', '.join(lead)})"


def _name_row(name: Any) -> list[int]:
    """A short string (backend name, device type) as [crc, 8-byte slots…]: enough to show
    it and to compare it."""
    if not isinstance(name, str):
        return [-1] * (_NAME_SLOTS + 1)
    raw = name.encode()[:8 * _NAME_SLOTS].ljust(8 * _NAME_SLOTS, b"\0")
    return [zlib.crc32(name.encode())] + [int.from_bytes(raw[i:i + 8], "little", signed=True)
                                          for i in range(0, len(raw), 8)]


def _name(row: list[int]) -> str:
    if row[0] < 0:
        return "(not a string)"
    raw = b"".join(x.to_bytes(8, "little", signed=True) for x in row[1:])
    return repr(raw.rstrip(b"\0").decode(errors="replace"))


_W = 2 + _META_DIMS + _LEAD_DIMS      # one tensor's shape record
# (label, width in the row, formatter) of each field that must agree, in _option_row's order
_SPEC: tuple[tuple[str, int, Any], ...] = (
    ("shard shapes", 3 * _W, lambda r: ", ".join(
        f"{n} {_fmt(r[i * _W:(i + 1) * _W])}" for i, n in enumerate("qkv"))),
    ("dtype", 1, lambda r: str(_DTYPES[r[0]]).replace("torch.", "") if r[0] >= 0 else "?"),
    ("is_causal", 1, lambda r: f"is_causal={bool(r[0])}"),
    ("scale", 2, lambda r: f"scale={_float(r[1])!r}" if r[0] else "scale=?"),
    ("softcap", 2, lambda r: f"softcap={_float(r[1])!r}" if r[0] else "softcap=None"),
    ("backend", 1 + _NAME_SLOTS, lambda r: f"backend={_name(r)}"),
    ("device type", 1 + _NAME_SLOTS, lambda r: _name(r)),
    ("needs a backward", 1, lambda r: (
        "inputs require grad" if r[0] else "no input requires grad (or torch.no_grad)")),
    ("layout", 1 + _NAME_SLOTS, lambda r: f"layout={_name(r)}"),
    ("strategy", 1 + _NAME_SLOTS, lambda r: f"strategy={_name(r)}"),
    ("mask", 1 + _NAME_SLOTS, lambda r: f"mask {_name(r)}"),
    ("score_mod", 1 + _NAME_SLOTS, lambda r: f"score_mod {_name(r)}"),
    ("return_lse", 1, lambda r: f"return_lse={bool(r[0])}"),
)
# (label, first index, width, formatter); index 0 of a row is the local-error flag
_FIELDS = tuple((label, 1 + sum(w for _, w, _ in _SPEC[:i]), width, fmt)
                for i, (label, width, fmt) in enumerate(_SPEC))


def _option_row(q: Any, k: Any, v: Any, local_error: Exception | None, is_causal: Any,
                scale: float | None, softcap: Any, backend: Any, needs_grad: bool,
                layout: Any = "contiguous", strategy: Any = "ring", mask: Any = None,
                score_mod: Any = None, return_lse: Any = False) -> list[int]:
    dtype = q.dtype if isinstance(q, torch.Tensor) else None
    row = [int(local_error is not None)]
    row += _shape_row(q) + _shape_row(k) + _shape_row(v)
    row += [_DTYPES.index(dtype) if dtype in _DTYPES else -1, int(bool(is_causal))]
    row += [0, 0] if scale is None else [1, _bits(scale)]
    row += [1, _bits(softcap)] if isinstance(softcap, float) else [0, 0]
    device = q.device.type if isinstance(q, torch.Tensor) else None
    row += _name_row(backend) + _name_row(device) + [int(needs_grad)]
    row += _name_row(layout) + _name_row(strategy)
    row += _name_row("none" if mask is None else getattr(mask, "name", type(mask).__name__))
    row += _name_row("none" if score_mod is None else _scores.fn_name(score_mod))
    row += [int(bool(return_lse))]
    assert len(row) == _FIELDS[-1][1] + _FIELDS[-1][2], "row and _SPEC out of step"
    return row


def _check_group(ring: _Ring, row: list[int], local_error: Exception | None) -> None:
    """All-gather every rank's row; raise the same clear error on every rank if any rank's
    inputs were invalid or any field differs between ranks."""
    rows = ring.all_gather(row, "the option check (before any shard moves)")
    bad = [i for i, r in enumerate(rows) if r[0]]
    if bad:
        if local_error is not None:
            raise local_error
        raise RuntimeError(
            f"ring_attention: rank(s) {bad} of the group were given invalid inputs (see the "
            f"error raised there); this rank ({ring.rank}) stopped with them"
        )
    differ = []
    for label, at, width, fmt in _FIELDS:
        vals = [r[at:at + width] for r in rows]
        if any(x != vals[0] for x in vals):
            differ.append(f"{label}: " + "; ".join(f"rank {i}: {fmt(x)}"
                                                   for i, x in enumerate(vals)))
    if differ:
        raise ValueError(
            "ring_attention needs the same shard shapes, dtype and options on every rank, "
            "but they differ — " + " | ".join(differ) + ". Pass the same options on every "
            "rank, and pad the sequence so that it splits into equal shards."
        )


def _refuse_unrunnable(p: Problem, backend: str, is_causal: bool, size: int,
                       needs_grad: bool) -> None:
    """A forced backend that cannot run the forward or the backward blocks of this call is
    refused now, before any shard moves (not half-way through a ring, or in the backward)."""
    if backend == "auto" or p.n_q == 0 or p.n_k == 0:     # "auto" always finds one
        return
    masks = ([True] if is_causal else []) + ([False] if size > 1 or not is_causal else [])
    acc = compute_dtype(p.dtype)
    reasons: dict[str, list[str]] = {}
    for phase in ("forward", "backward") if needs_grad else ("forward",):
        for causal in masks:
            if phase == "forward":
                with torch.no_grad():
                    blk = prepare(p.q, p.k, p.v, is_causal=causal, scale=p.scale,
                                  softcap=p.softcap).problem
                    why = _backends.get(backend).not_supported_reasons(blk)
            else:       # recomputed in the accumulation dtype, under autograd
                lv = [torch.empty_strided(t.shape, (0,) * t.dim(), dtype=acc,
                                          device=t.device).requires_grad_()
                      for t in (p.q, p.k, p.v)]
                with torch.enable_grad():
                    blk = prepare(*lv, is_causal=causal, scale=p.scale,
                                  softcap=p.softcap).problem
                    why = _backends.get(backend).not_supported_reasons(blk)
            for w in why:
                reasons.setdefault(w, [])
                if phase not in reasons[w]:
                    reasons[w].append(phase)
    if reasons:
        said = "; ".join(f"{w} [{' and '.join(ph)}]" for w, ph in reasons.items())
        raise ValueError(
            f"ring_attention: backend {backend!r} cannot run the blocks of this call: {said}. "
            "Choose a backend that can (or 'auto')"
            + (", or call under torch.no_grad() if no gradients are needed"
               if needs_grad else "") + "."
        )


def _check_timeout(timeout: Any) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"ring_attention: timeout must be a number of seconds or None, got "
                        f"{type(timeout).__name__}")
    if not (math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"ring_attention: timeout must be a finite number of seconds > 0, "
                         f"got {timeout!r} (None waits as long as the process group does)")
    return float(timeout)
