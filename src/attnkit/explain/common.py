"""What every explain renderer shares: numbers, shapes, labels, heads, and size budgets.

- numbers: :func:`fmt` (one number), :func:`cell_formatter` (every cell of one matrix:
  integers when the whole matrix is whole, else :func:`fmt`);
- shapes: :func:`shape_str`; labels: :func:`axis_labels`, :func:`block_labels`;
- heads: :func:`split_heads` (``(..., H, N, M)`` → labelled 2-D matrices), :func:`head_label`,
  :func:`kv_head_index` (GQA), :func:`cut_width` (``(n, h·d)`` → ``(h, n, d)``);
- size: the display budgets (:data:`TEXT_ROWS`, :data:`MAX_HEADS`, :data:`PAGE_CELLS`,
  :data:`PLOT_GRID`), :func:`page_grid` (does the page show a trace cell by cell?) and
  :func:`pool` (block means, the one downsampling of the page and the plot).

Shape legend::

    a (..., H, N, M)  → H·(…) matrices (N, M), labelled "head h" / "batch b, head h"
    pool: m (N, M) → (⌈N/fr⌉, ⌈M/fc⌉) block means

Caution
-------
- Budgets, not limits: above them a renderer summarises (text: a corner of 12 × 10;
  page: blocks of at most 48 × 48 cells per heatmap and the first 8 heads; plot: at most
  256 × 256 blocks and the first 8 heads). The hard limits are in :mod:`.guard`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from .strings import STRINGS

if TYPE_CHECKING:
    from .trace import Trace

TEXT_ROWS, TEXT_COLS = 12, 10      # text: a larger matrix shows a corner
MAX_HEADS = 8                      # page tabs and plot panels per trace
PAGE_CELLS = 40_000                # page: a trace above this many cells is shown in blocks
PAGE_GRID = (8, 48)                # … of at most g × g cells a heatmap, g in this range
PLOT_GRID = 256                    # plot: at most this many blocks per axis

# The one colour scale (page and playground; the plot draws matplotlib's Blues and RdBu_r, whose
# ends these are): weights 0 → 1 white → dark blue; every other matrix diverges at 0,
# positive red and negative blue.
WEIGHTS_RGB = (0.031, 0.188, 0.420)     # Blues' end, #08306b
POS_RGB = (0.404, 0.0, 0.122)           # RdBu_r's red end, #67001f
NEG_RGB = (0.020, 0.188, 0.380)         # RdBu_r's blue end, #053061


# ---------------------------------------------------------------------------- numbers


def fmt(x: float, decimals: int = 3) -> str:
    """A number with ``decimals`` places — more when rounding would hide that it is not 0 or 1.

    0.9997 → ``0.9997`` (not 1.000), 4.5e-05 → ``0.00005``, 1.1e-07 → ``1.1e-07``,
    an exact 0 → ``0``, −∞ → ``-inf``; a magnitude of a million or more → ``1.000e+308``.
    """
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "-inf" if x < 0 else "inf"
    if x == 0:
        return "0"
    if abs(x) >= 1e6:
        return f"{x:.{decimals}e}"
    if abs(x) >= 0.5 and abs(x - round(x)) < 1e-9 * max(1.0, abs(x)):
        x = float(round(x))             # 0.9999999999 is a row sum of 1, not 0.99999…
    for d in range(decimals, decimals + 4):
        s = f"{x:.{d}f}"
        r = abs(float(s))
        if r not in (0.0, 1.0) or abs(x) == 1.0:
            return s
    if abs(float(f"{x:.{decimals + 3}f}")) == 1.0:      # 0.99999999 (a float32 row sum)
        return f"{x:.{decimals}f}"                      # is 1.000, not 1.0e+00
    if abs(x) < 1:
        return f"{x:.1e}"
    return f"{x:.{decimals}f}"


def cell_formatter(a: np.ndarray, decimals: int = 3) -> Callable[[float], str]:
    """How to print each cell of ``a``: integers when every finite value is a whole number
    below a million, else :func:`fmt`."""
    fin = a[np.isfinite(a)]
    whole = fin.size > 0 and bool(np.all(fin == np.round(fin))) and bool(np.all(np.abs(fin) < 1e6))

    def f(x: float) -> str:
        return str(int(x)) if whole and math.isfinite(x) else fmt(x, decimals)

    return f


def shape_str(shape: Sequence[int]) -> str:
    """``(2, 3)``; a 1-D shape keeps Python's comma: ``(3,)``."""
    return "(" + ", ".join(str(int(s)) for s in shape) + (",)" if len(shape) == 1 else ")")


# ---------------------------------------------------------------------------- labels


def axis_labels(given: str | Sequence[str] | None, n: int, prefix: str) -> list[str]:
    """Labels of ``n`` rows or columns: the given words, or a prefix numbered from 1
    (``given`` may itself be the prefix: ``"d"`` → d1, d2, …)."""
    if given is None or isinstance(given, str):
        p = prefix if given is None else given
        return [f"{p}{i + 1}" for i in range(n)]
    return [str(s) for s in given]


def block_labels(labels: Sequence[str], f: int) -> list[str]:
    """Labels of blocks of ``f`` consecutive rows or columns: ``q1–q21``."""
    if f <= 1:
        return list(labels)
    n = len(labels)
    return [labels[i] if min(i + f, n) - i == 1 else f"{labels[i]}–{labels[min(i + f, n) - 1]}"
            for i in range(0, n, f)]


# ---------------------------------------------------------------------------- heads


def head_label(lead: tuple[int, ...], n: int, lang: str = "en", word: str = "head") -> str:
    """The label of flat head ``n`` of leading dims ``lead``: ``head 2``, ``batch 1, head 2``."""
    t = STRINGS[lang]
    idx = np.unravel_index(n, lead)
    if len(lead) == 1:
        return f"{t[word]} {int(idx[0]) + 1}"
    return ", ".join([f"{t['batch']} {int(i) + 1}" for i in idx[:-1]]
                     + [f"{t[word]} {int(idx[-1]) + 1}"])


def n_matrices(a: np.ndarray) -> int:
    """How many 2-D matrices ``a`` holds (1 for a 2-D array)."""
    return int(np.prod(a.shape[:-2], dtype=np.int64)) if a.ndim > 2 else 1


def split_heads(a: np.ndarray, lang: str = "en", word: str = "head",
                limit: int | None = None) -> list[tuple[str, np.ndarray]]:
    """Split ``(..., H, N, M)`` into labelled 2-D matrices (``""`` for a 2-D input).

    ``word`` is ``"head"`` or ``"kv_head"`` (K and V with fewer heads than Q: GQA / MQA);
    ``limit`` keeps the first heads only.
    """
    if a.ndim == 2:
        return [("", a)][:limit]
    lead = a.shape[:-2]
    flat = a.reshape(n_matrices(a), *a.shape[-2:])
    n = flat.shape[0] if limit is None else min(limit, flat.shape[0])
    return [(head_label(lead, i, lang, word), flat[i]) for i in range(n)]


def kv_head_index(trace: Trace, h: int) -> int:
    """The flat K/V head that flat query head ``h`` reads (GQA: H_q / H_kv queries share one)."""
    if trace.k.ndim == 2 or trace.k.shape[-3] == trace.q.shape[-3]:
        return h
    h_q, h_kv = trace.q.shape[-3], trace.k.shape[-3]
    return (h // h_q) * h_kv + (h % h_q) // (h_q // h_kv)


def cut_width(x: np.ndarray, heads: int) -> np.ndarray:
    """``(n, h·d)`` → ``(h, n, d)``: cut the feature width into ``heads`` slices."""
    n, width = x.shape
    return x.reshape(n, heads, width // heads).transpose(1, 0, 2).copy()


def default_scale(trace: Trace) -> float:
    """1/√d_k of the trace's inputs (1 when d_k is 0)."""
    d_k = trace.q.shape[-1]
    return 1.0 / math.sqrt(d_k) if d_k > 0 else 1.0


# ---------------------------------------------------------------------------- size


def page_grid(trace: Trace) -> int | None:
    """``None`` when the page shows every cell of ``trace``; else the largest number of rows
    or columns one heatmap shows (larger matrices are drawn in blocks, :func:`pool`)."""
    n_q, n_k = trace.scores.shape[-2:]
    d_k, d_v = trace.q.shape[-1], trace.v.shape[-1]
    heads = n_matrices(trace.scores)
    shown = min(heads, MAX_HEADS)
    per_head = n_q * d_k + n_k * d_k + n_k * d_v + 4 * n_q * n_k + n_q * d_v
    concat = n_q * heads * d_v if trace.output.ndim == 3 and trace.output.shape[0] > 1 else 0
    if shown * per_head + concat <= PAGE_CELLS:
        return None
    n_maps = shown * 8 + (1 if concat else 0)
    lo, hi = PAGE_GRID
    return max(lo, min(hi, math.isqrt(PAGE_CELLS // n_maps)))


def block_sizes(shape: tuple[int, int], rows: int, cols: int) -> tuple[int, int]:
    """Rows and columns per block so that a matrix of ``shape`` fits ``rows`` × ``cols``."""
    n, k = shape
    return (-(-n // rows) if n > rows else 1), (-(-k // cols) if k > cols else 1)


def pool(m: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, int, int]:
    """Block means of ``m`` so that at most ``rows`` × ``cols`` remain: ``(pooled, fr, fc)``.

    A block's value is the mean of its finite values; a block without one is NaN if it holds
    a NaN, else +∞ or −∞ (all masked stays masked). ``fr``/``fc`` are the block sizes.
    """
    n, k = m.shape
    fr, fc = block_sizes((n, k), rows, cols)
    if fr == fc == 1:
        return m, 1, 1
    r, c = -(-n // fr), -(-k // fc)
    pad = np.full((r * fr, c * fc), np.nan)               # (r·fr, c·fc)
    pad[:n, :k] = m
    valid = np.zeros(pad.shape, dtype=bool)
    valid[:n, :k] = True
    blocks = pad.reshape(r, fr, c, fc).swapaxes(1, 2).reshape(r, c, fr * fc)
    inside = valid.reshape(r, fr, c, fc).swapaxes(1, 2).reshape(r, c, fr * fc)
    fin = np.isfinite(blocks)                             # padding is NaN: not finite
    count = fin.sum(-1)                                   # (r, c)
    mean = np.where(fin, blocks, 0.0).sum(-1) / np.maximum(count, 1)
    nan = (np.isnan(blocks) & inside).any(-1)
    inf = np.where((blocks == np.inf).any(-1), np.inf, -np.inf)
    out = np.where(count > 0, mean, np.where(nan, np.nan, inf))
    return out, fr, fc
