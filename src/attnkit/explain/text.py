"""The text renderer: a Trace as a walkthrough in a terminal, in English or Korean.

    O = softmax(Q Kᵀ · scale + M) V

``render_text(trace, lang)`` prints the five-step table (1 MatMul = score, 2 Scale,
3 Mask, 4 Softmax, 5 MatMul = weighted sum: what each does, its formula and shape), the
inputs, every step's matrix (rows are queries, columns are keys; word labels when the trace
has them), the row sums of the weights, the concatenation of the heads, and the teaching
remarks (:mod:`.remarks`). Words come from :mod:`.strings`, numbers from :mod:`.common`.

Shape legend::

    Q (n_q, d_k)   K (n_k, d_k)   V (n_k, d_v)   S, X, L, W (n_q, n_k)   O (n_q, d_v)
    with heads: every matrix gets a leading head axis h; concat O → (n_q, h·d_v)

Caution
-------
- Large matrices are summarised: a corner of 12 rows and 10 columns with ``…`` / ``⋮``,
  and a note under the matrix that says so (and whether the ``--html`` page shows every
  value or blocks, :func:`~attnkit.explain.common.page_grid`); at most ``max_heads`` heads
  (default 4) are printed. The output stays a few screens at any size explain accepts.
- Numbers are printed with ``decimals`` places (0 to 12), more when that would hide a value
  that is not exactly 0 or 1 (0.9997 stays 0.9997; a tiny weight is printed as
  5e-05-style); a magnitude of a million or more in scientific notation.
"""

from __future__ import annotations

import os
import sys
import unicodedata
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from .common import (
    TEXT_COLS,
    TEXT_ROWS,
    axis_labels,
    cell_formatter,
    fmt,
    n_matrices,
    page_grid,
    shape_str,
    split_heads,
)
from .guard import check_decimals
from .remarks import remarks
from .strings import STRINGS, SYMBOLIC, check_lang, mask_label, step_formula, step_name, step_what

if TYPE_CHECKING:
    from .trace import Trace

__all__ = ["render_text", "render_many", "format_matrix", "step_table", "display_width",
           "wrap", "Style", "use_color"]


def display_width(s: str) -> int:
    """Terminal columns taken by ``s`` (Hangul and other wide characters take two)."""
    return sum(2 if unicodedata.east_asian_width(c) in ("W", "F") else 1 for c in s)


def _rjust(s: str, w: int) -> str:
    return " " * max(0, w - display_width(s)) + s


def _ljust(s: str, w: int) -> str:
    return s + " " * max(0, w - display_width(s))


# ---------------------------------------------------------------------------- colour


class Style:
    """ANSI styling; every method is the identity when colour is off."""

    def __init__(self, on: bool) -> None:
        self.on = on

    def _wrap(self, code: str, s: str) -> str:
        return f"\033[{code}m{s}\033[0m" if self.on and s else s

    def bold(self, s: str) -> str:
        return self._wrap("1", s)

    def head(self, s: str) -> str:
        return self._wrap("1;36", s)

    def dim(self, s: str) -> str:
        return self._wrap("2", s)

    def hi(self, s: str) -> str:
        return self._wrap("1;32", s)

    def warn(self, s: str) -> str:
        return self._wrap("33", s)


def use_color(color: bool | None, stream: object = None) -> bool:
    """``color=None`` → on only when the stream is a terminal and NO_COLOR is unset."""
    if color is not None:
        return color
    stream = sys.stdout if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) and "NO_COLOR" not in os.environ


# ---------------------------------------------------------------------------- matrices


def _keep(n: int, limit: int) -> list[int | None]:
    """Indices to show out of n (None marks the gap)."""
    if n <= limit:
        return list(range(n))
    head = limit - 2
    return [*range(head - 1), None, n - 2, n - 1] if head > 2 else [0, None, n - 1]


def format_matrix(
    a: np.ndarray, decimals: int = 3, rows: str | Sequence[str] | None = "q",
    cols: str | Sequence[str] | None = "k", *, sums: np.ndarray | None = None,
    sum_label: str = "Σ", max_rows: int = TEXT_ROWS, max_cols: int = TEXT_COLS,
    style: Style | None = None, emph: np.ndarray | None = None, indent: str = "  ",
) -> str:
    """A 2-D array as aligned text.

    ``rows``/``cols`` are a label prefix (``"q"`` → q1, q2, …) or one label per row/column.
    ``sums`` adds a column after a ``|``; ``emph`` (bool, same shape) highlights cells.
    Matrices larger than ``max_rows`` × ``max_cols`` show a corner with ``…`` / ``⋮``.
    """
    a = np.atleast_2d(np.asarray(a, dtype=float))
    st = style or Style(False)
    n, m = a.shape
    rl = axis_labels(rows, n, "q")
    cl = axis_labels(cols, m, "k")
    ri, ci = _keep(n, max_rows), _keep(m, max_cols)
    f = cell_formatter(a, decimals)
    cells = [[f(float(a[i, j])) if j is not None else "…" for j in ci]
             if i is not None else ["⋮" if j is not None else "" for j in ci] for i in ri]
    heads = [cl[j] if j is not None else "…" for j in ci]
    w = max([display_width(c) for r in cells for c in r] + [display_width(c) for c in heads]
            + [1])
    lw = max([display_width(rl[i]) for i in ri if i is not None] + [1])
    sum_cells = ([fmt(float(sums[i]), decimals) if i is not None else "⋮" for i in ri]
                 if sums is not None else None)
    sw = max([display_width(c) for c in (sum_cells or [])] + [display_width(sum_label)])
    head = indent + " " * lw + "  " + " ".join(_rjust(c, w) for c in heads)
    if sum_cells is not None:
        head += " | " + _rjust(sum_label, sw)
    lines = [st.dim(head.rstrip())]
    for r, i in enumerate(ri):
        label = _ljust(rl[i] if i is not None else "⋮", lw)
        out = []
        for c, j in enumerate(ci):
            cell = _rjust(cells[r][c], w)
            if i is not None and j is not None:
                v = a[i, j]
                if emph is not None and emph[i, j]:
                    cell = st.hi(cell)
                elif v == 0 or np.isneginf(v):
                    cell = st.dim(cell)
            out.append(cell)
        line = indent + st.bold(label) + "  " + " ".join(out)
        if sum_cells is not None:
            line += " | " + _rjust(sum_cells[r], sw)
        lines.append(line.rstrip())
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the walkthrough


def wrap(text: str, width: int, first: str, rest: str) -> str:
    """Wrap at spaces so no line is wider than ``width`` terminal columns (Hangul = 2)."""
    lines, line = [], first
    for word in (w for w in text.split(" ") if w):     # non-breaking spaces hold
        bare = line in (first, rest)
        if not bare and display_width(line) + 1 + display_width(word) > width:
            lines.append(line)
            line = rest + word
        else:
            line = line + word if bare else f"{line} {word}"
    lines.append(line)
    return "\n".join(lines)


def _table(rows: list[list[str]]) -> str:
    widths = [max(display_width(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for j, r in enumerate(rows):
        out.append(" | ".join(_ljust(c, widths[i]) for i, c in enumerate(r)).rstrip())
        if j == 0:
            out.append("-+-".join("-" * w for w in widths))
    return "\n".join(out)


def step_table(trace: Trace, lang: str = "en") -> str:
    """The five-step table: step, what it does, formula, shape."""
    t = check_lang(lang)
    heads = trace.scores.ndim > 2
    rows = [[t["step"], t["what"], t["formula"], t["shape"]]]
    for i, s in enumerate(trace.steps):
        shape = f"{SYMBOLIC.get(s.key, '')} = {shape_str(s.shape)}".strip(" =")
        if heads:
            shape = f"{t['per_head']} {shape}"
        rows.append([f"{i + 1}. {step_name(s, lang)}", step_what(s, lang),
                     step_formula(s, lang), shape])
    if trace.output.ndim == 3 and trace.output.shape[0] > 1:
        h, n_q, dv = trace.output.shape
        rows.append([f"{len(trace.steps) + 1}. {step_name('Concat', lang)}", t["Concat"],
                     "O = [O₁ | … | O_h]", f"(n_q, h·d_v) = {shape_str((n_q, h * dv))}"])
    return _table(rows)


def _matrices(
    a: np.ndarray, lang: str, decimals: int, rows: Sequence[str] | str | None,
    cols: Sequence[str] | str | None, style: Style, max_heads: int, *, sums: bool = False,
    emph_max: bool = False, word: str = "head", grid: int | None = None,
) -> list[str]:
    t = STRINGS[lang]
    parts: list[str] = []
    total = n_matrices(a)
    for label, m in split_heads(a, lang, word, limit=max_heads):
        if label:
            parts.append(f"  {style.bold(label)}")
        emph = None
        if emph_max and m.size:
            emph = (m == m.max(-1, keepdims=True)) & (m > 0)
        parts.append(format_matrix(m, decimals, rows, cols, style=style, emph=emph,
                                   sums=m.sum(-1) if sums else None, sum_label=t["sum"]))
        if m.shape[0] > TEXT_ROWS or m.shape[1] > TEXT_COLS:
            blocks = grid is not None and max(m.shape) > grid       # the page shows blocks
            note = t["summarised_pooled" if blocks else "summarised"]
            parts.append("  " + style.dim(note.format(r=m.shape[0], c=m.shape[1])))
    if total > max_heads:
        parts.append("  " + style.dim(t["more_heads"].format(n=total - max_heads)))
    return parts


def render_text(trace: Trace, lang: str = "en", decimals: int = 3, color: bool | None = None,
                *, table: bool = True, max_heads: int | None = None) -> str:
    """The whole walkthrough of one trace as text (see the module docstring).

    ``max_heads`` limits how many heads are printed (default: the trace's
    ``options["max_heads"]``, else 4).
    """
    t = check_lang(lang)
    decimals = check_decimals(decimals)
    if max_heads is None:
        max_heads = int(trace.options.get("max_heads", 4))
    st = Style(use_color(color))
    grid = page_grid(trace)
    parts: list[str] = []
    title = trace.title.get(lang) or trace.title.get("en")
    if title:
        parts += [st.bold(title), "=" * display_width(title)]
    intro = trace.intro.get(lang) or trace.intro.get("en")
    if intro:
        parts += [intro.rstrip(), ""]
    if table:
        parts += [st.bold(t["title"]), "", step_table(trace, lang), ""]
    qrows, krows = trace.q_labels or "q", trace.k_labels or "k"
    mask_txt = mask_label(trace.mask_name, lang)
    opts = [f"{t['scale_is']} = {fmt(trace.scale, decimals)}", f"{t['mask_is']}: {mask_txt}"]
    if trace.softcap is not None:
        opts.append(f"{t['softcap_is']} = {fmt(trace.softcap, decimals)}")
    parts.append(st.head(f"{t['inputs']}") + "   " + "   ".join(opts))
    for name, arr, rows in (("Q", trace.q, qrows), ("K", trace.k, krows), ("V", trace.v, krows)):
        parts.append(f"  {name} {shape_str(arr.shape)}")
        shared = name != "Q" and arr.ndim > 2 and arr.shape[-3] != trace.q.shape[-3]
        parts += _matrices(arr, lang, decimals, rows, "d", st, max_heads,
                           word="kv_head" if shared else "head", grid=grid)
    parts.append("")
    for i, s in enumerate(trace.steps):
        parts.append(st.head(f"[{i + 1}] {step_name(s, lang)}: {step_formula(s, lang)}") + "   "
                     + shape_str(s.value.shape))
        cols = "d" if s.key == "output" else krows
        parts += _matrices(s.value, lang, decimals, qrows, cols, st, max_heads,
                           sums=s.key == "weights", emph_max=s.key == "weights", grid=grid)
        parts.append("")
    if trace.output.ndim == 3 and trace.output.shape[0] > 1:
        h, n_q, dv = trace.output.shape
        cat = trace.output.transpose(1, 0, 2).reshape(n_q, h * dv)
        parts.append(st.head(f"[{len(trace.steps) + 1}] {step_name('Concat', lang)}: "
                             "O = [O₁ | … | O_h]") + "   " + shape_str(cat.shape))
        parts += _matrices(cat, lang, decimals, qrows, "d", st, max_heads, grid=grid)
        parts.append("")
    notes = remarks(trace, lang, decimals)
    if notes:
        parts.append(st.head(t["remarks"]))
        for n in notes:
            parts.append(n if n.startswith("  ") else wrap(n, 96, "  • ", "    "))
        parts.append("")
    return "\n".join(parts).rstrip() + "\n"


def render_many(traces: Sequence[Trace], lang: str = "en", decimals: int = 3,
                color: bool | None = None,
                render: Callable[..., str] = render_text) -> str:
    """Several traces (an example and its comparisons): the step table only once."""
    out = [render(tr, lang=lang, decimals=decimals, color=color, table=i == 0)
           for i, tr in enumerate(traces)]
    return "\n".join(out)
