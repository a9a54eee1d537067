"""Text walkthrough of a Trace, in English or Korean.

    O = softmax(Q Kᵀ · scale + M) V

``render_text(trace, lang)`` prints the five-step table (MatMul, Scale, Mask, Softmax,
MatMul: what each does, its formula and shape), the inputs, every step's matrix (rows are
queries, columns are keys; word labels when the trace has them), the row sums of the
weights, the concatenation of the heads, and short remarks where the numbers teach something.

Shape legend::

    Q (n_q, d_k)   K (n_k, d_k)   V (n_k, d_v)   S, X, L, W (n_q, n_k)   O (n_q, d_v)
    with heads: every matrix gets a leading head axis h; concat O → (n_q, h·d_v)

Caution
-------
- Large matrices are summarised (a corner of rows and columns with ``…``); the HTML page
  (``--html``) shows every value.
- Numbers are printed with ``decimals`` places, more when that would hide a value that is
  not exactly 0 or 1 (0.9997 stays 0.9997; a tiny weight is printed as 5e-05-style).
"""

from __future__ import annotations

import math
import os
import sys
import unicodedata
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .trace import Step, Trace

LANGS = ("en", "ko")

STRINGS: dict[str, dict[str, str]] = {
    "en": {
        "title": "Attention, step by step:  O = softmax(Q Kᵀ · scale + M) V",
        "step": "step", "what": "what it does", "formula": "formula", "shape": "shape",
        "name_MatMul": "MatMul", "name_Scale": "Scale", "name_Mask": "Mask",
        "name_Softmax": "Softmax", "name_Concat": "Concat",
        "MatMul_scores": "score every key for every query (dot product)",
        "Scale": "scale the scores so their spread does not grow with d_k",
        "Mask": "block the keys a query may not see (−∞)",
        "Softmax": "turn each row into weights that sum to 1",
        "MatMul_output": "mix the values with the weights",
        "Concat": "put the heads' outputs side by side",
        "head": "head", "kv_head": "kv head", "heads": "heads", "batch": "batch",
        "row_sums": "row sums of the weights",
        "sum": "Σ", "per_head": "per head",
        "inputs": "Inputs", "scale_is": "scale", "queries": "queries", "keys": "keys",
        "softcap_is": "soft-cap", "mask_is": "mask", "no_mask": "none",
        "rows_cols": "rows = queries, columns = keys",
        "summarised": "{r} × {c}: showing a corner (every value is in the --html page)",
        "more_heads": "… {n} more heads with the same shapes (see --html or --plot)",
        "remarks": "What to notice",
        "r_masked_max": "{q}: key {k} had the largest raw score ({s}) but is masked (−∞), "
                        "so its weight is 0 — it contributes nothing to the output.",
        "r_zero_score": "{q}·{k} = 0, yet {k} still gets weight {w}: softmax turns a logit "
                        "of 0 into e⁰\u00a0=\u00a01 before normalising — a zero score is not "
                        "a zero weight.",
        "r_saturated": "{q} is saturated: one key takes {w} of the weight (its logits span "
                       "{spread}). Softmax of large logits is almost one-hot, and its "
                       "gradient almost vanishes.",
        "r_saturated_scale": " Here scale = {scale}; the usual 1/√d_k = {default} would "
                             "divide the logits by {ratio}.",
        "r_symmetric": "S is symmetric (S = Sᵀ): {q1}·{k2} = {q2}·{k1}, as when Q and K "
                       "come from one shared W. The score from i to j equals the score "
                       "from j to i; the weights still differ, because each row is "
                       "normalised on its own.",
        "r_empty_row": "{q} may see no key: its weights are all 0 and its output is 0 "
                       "(never NaN).",
        "r_cross": "n_q = {nq} queries but n_k = {nk} keys: the queries and keys come from "
                   "different sequences, as in cross-attention. The weights are ({nq}, {nk}) "
                   "and the output has one row per query.",
        "r_concat": "The {h} heads ran independently on {dk}-wide slices; their ({nq}, {dv}) "
                    "outputs are concatenated into ({nq}, {hdv}).",
        "and_more": "(and {n} more like this)",
    },
    "ko": {
        "title": "어텐션 단계별 풀이:  O = softmax(Q Kᵀ · scale + M) V",
        "step": "단계", "what": "하는 일", "formula": "수식", "shape": "모양",
        "name_MatMul": "행렬곱 (MatMul)", "name_Scale": "스케일 (Scale)",
        "name_Mask": "마스크 (Mask)", "name_Softmax": "소프트맥스 (Softmax)",
        "name_Concat": "이어붙이기 (Concat)",
        "MatMul_scores": "모든 쿼리와 모든 키의 점수 계산 (내적)",
        "Scale": "d_k가 커져도 점수의 퍼짐이 커지지 않도록 스케일링",
        "Mask": "쿼리가 볼 수 없는 키를 가림 (−∞)",
        "Softmax": "각 행을 합이 1인 가중치로 변환",
        "MatMul_output": "가중치로 값(V)을 섞음",
        "Concat": "헤드들의 출력을 옆으로 이어 붙임",
        "head": "헤드", "kv_head": "KV 헤드", "heads": "헤드", "batch": "배치",
        "row_sums": "가중치 행의 합",
        "sum": "합", "per_head": "헤드마다",
        "inputs": "입력", "scale_is": "스케일", "queries": "쿼리", "keys": "키",
        "softcap_is": "소프트캡", "mask_is": "마스크", "no_mask": "없음",
        "rows_cols": "행 = 쿼리, 열 = 키",
        "summarised": "{r} × {c}: 일부만 표시 (모든 값은 --html 페이지에 있습니다)",
        "more_heads": "… 같은 모양의 헤드 {n}개 더 (--html 또는 --plot 참고)",
        "remarks": "눈여겨볼 점",
        "r_masked_max": "{q}: 키 {k}의 원점수({s})가 가장 컸지만 마스크(−∞)로 가려져 "
                        "가중치가 0입니다 — 출력에 전혀 기여하지 않습니다.",
        "r_zero_score": "{q}·{k} = 0이어도 키 {k}의 가중치는 {w}입니다: 소프트맥스는 정규화 "
                        "전에 로짓 0을 e⁰\u00a0=\u00a01로 바꾸므로 점수 0이 가중치 0은 아닙니다.",
        "r_saturated": "쿼리 {q}: 포화 상태입니다 — 가중치 중 {w}만큼을 키 하나가 가져갑니다 "
                       "(로짓 범위 {spread}). 로짓이 크면 소프트맥스는 거의 원-핫이 되고 "
                       "기울기가 거의 사라집니다.",
        "r_saturated_scale": " 여기서는 scale = {scale}; 보통의 값(1/√d_k = {default})을 쓰면 "
                             "로짓이 {ratio}분의 1로 줄어듭니다.",
        "r_symmetric": "S가 대칭입니다 (S = Sᵀ): {q1}·{k2} = {q2}·{k1}. Q와 K가 같은 W에서 "
                       "나오면 이렇게 됩니다. i에서 j로의 점수와 j에서 i로의 점수가 같고, "
                       "가중치는 행마다 따로 정규화되므로 여전히 다릅니다.",
        "r_empty_row": "쿼리 {q}: 볼 수 있는 키가 없습니다. 가중치는 모두 0, 출력도 0입니다 "
                       "(NaN이 아님).",
        "r_cross": "쿼리 n_q = {nq}개, 키 n_k = {nk}개: 쿼리와 키가 서로 다른 시퀀스에서 "
                   "옵니다 (크로스 어텐션). 가중치는 ({nq}, {nk}), 출력은 쿼리마다 "
                   "한 행입니다.",
        "r_concat": "{h}개의 헤드가 {dk}차원 조각에서 각각 따로 계산했고, ({nq}, {dv}) 출력들을 "
                    "이어 붙여 ({nq}, {hdv})가 됩니다.",
        "and_more": "(같은 경우 {n}개 더)",
    },
}

# Symbolic shape of each step, for the table.
SYMBOLIC = {"scores": "(n_q, n_k)", "scaled": "(n_q, n_k)", "logits": "(n_q, n_k)",
            "weights": "(n_q, n_k)", "output": "(n_q, d_v)"}


def check_lang(lang: str) -> dict[str, str]:
    """The string table for ``lang``; a clear error for an unknown language."""
    if lang not in STRINGS:
        raise ValueError(f"lang must be one of {', '.join(LANGS)}, got {lang!r}")
    return STRINGS[lang]


def step_name(step: Step | str, lang: str) -> str:
    """The step's display name in ``lang`` (Korean keeps the English term in brackets)."""
    name = step if isinstance(step, str) else step.name
    return STRINGS[lang].get(f"name_{name}", name)


def step_what(step: Step, lang: str) -> str:
    """One line on what the step does."""
    t = STRINGS[lang]
    return t.get(f"{step.name}_{step.key}", t.get(step.name, step.name))


_MASK_KO = (("causal", "인과(causal)"), ("bool mask", "참/거짓 마스크"),
            ("float mask", "실수 마스크"), ("sliding_window", "슬라이딩 윈도우"),
            ("padding", "패딩"), ("document", "문서"), ("prefix", "프리픽스"))


def mask_label(name: str | None, lang: str) -> str:
    """The mask's name for display (``none`` when there is no mask)."""
    t = STRINGS[lang]
    if not name:
        return t["no_mask"]
    if lang == "ko":
        for en, ko in _MASK_KO:
            name = name.replace(en, ko)
    return name


def step_formula(step: Step, lang: str) -> str:
    """The step's formula (the one word in it, "or", in ``lang``)."""
    return step.formula.replace(" or ", " 또는 ") if lang == "ko" else step.formula


# ---------------------------------------------------------------------------- numbers


def fmt(x: float, decimals: int = 3) -> str:
    """A number with ``decimals`` places — more when rounding would hide that it is not 0 or 1.

    0.9997 → ``0.9997`` (not 1.000), 4.5e-05 → ``0.00005``, 1.1e-07 → ``1.1e-07``,
    an exact 0 → ``0``, −∞ → ``-inf``.
    """
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "-inf" if x < 0 else "inf"
    if x == 0:
        return "0"
    if abs(x) >= 0.5 and abs(x - round(x)) < 1e-9 * max(1.0, abs(x)):
        x = float(round(x))             # 0.9999999999 is a row sum of 1, not 0.99999…
    for d in range(decimals, decimals + 4):
        s = f"{x:.{d}f}"
        r = abs(float(s))
        if r not in (0.0, 1.0) or abs(x) == 1.0:
            return s
    if abs(x) < 1:
        return f"{x:.1e}"
    return f"{x:.{decimals}f}"


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


def _labels(spec: str | Sequence[str] | None, n: int, prefix: str) -> list[str]:
    if spec is None or isinstance(spec, str):
        p = prefix if spec is None else spec
        return [f"{p}{i + 1}" for i in range(n)]
    return [str(s) for s in spec]


def _keep(n: int, limit: int) -> list[int | None]:
    """Indices to show out of n (None marks the gap)."""
    if n <= limit:
        return list(range(n))
    head = limit - 2
    return [*range(head - 1), None, n - 2, n - 1] if head > 2 else [0, None, n - 1]


def format_matrix(
    a: np.ndarray, decimals: int = 3, rows: str | Sequence[str] | None = "q",
    cols: str | Sequence[str] | None = "k", *, sums: np.ndarray | None = None,
    sum_label: str = "Σ", max_rows: int = 12, max_cols: int = 10,
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
    rl = _labels(rows, n, "q")
    cl = _labels(cols, m, "k")
    ri, ci = _keep(n, max_rows), _keep(m, max_cols)
    fin = a[np.isfinite(a)]
    whole = fin.size > 0 and bool(np.all(fin == np.round(fin))) and bool(np.all(np.abs(fin) < 1e6))

    def f(x: float) -> str:
        return str(int(x)) if whole and math.isfinite(x) else fmt(x, decimals)

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


def split_heads(a: np.ndarray, lang: str = "en", word: str = "head",
                ) -> list[tuple[str, np.ndarray]]:
    """Split ``(..., H, N, M)`` into labelled 2-D matrices (``""`` for a 2-D input).

    ``word`` is ``"head"`` or ``"kv_head"`` (K and V with fewer heads than Q: GQA / MQA).
    """
    t = STRINGS[lang]
    if a.ndim == 2:
        return [("", a)]
    lead = a.shape[:-2]
    flat = a.reshape(int(np.prod(lead, dtype=np.int64)), *a.shape[-2:])
    out = []
    for n in range(flat.shape[0]):
        idx = np.unravel_index(n, lead)
        if len(lead) == 1:
            label = f"{t[word]} {idx[0] + 1}"
        else:
            label = ", ".join([f"{t['batch']} {int(i) + 1}" for i in idx[:-1]]
                              + [f"{t[word]} {int(idx[-1]) + 1}"])
        out.append((label, flat[n]))
    return out


def _shape(s: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(int(x)) for x in s) + ")"


def _default_scale(trace: Trace) -> float:
    d_k = trace.q.shape[-1]
    return 1.0 / math.sqrt(d_k) if d_k > 0 else 1.0


# ---------------------------------------------------------------------------- remarks


def _q_label(trace: Trace, i: int) -> str:
    return trace.q_labels[i] if trace.q_labels else f"q{i + 1}"


def _k_label(trace: Trace, j: int) -> str:
    return trace.k_labels[j] if trace.k_labels else f"k{j + 1}"


def remarks(trace: Trace, lang: str = "en", decimals: int = 3, limit: int = 2) -> list[str]:
    """Short teaching remarks the numbers of this trace support (in ``lang``).

    Each kind of remark appears at most ``limit`` times (then "and N more"); the zero-score
    remark once.
    """
    t = check_lang(lang)
    found: dict[str, list[str]] = {}

    def add(kind: str, text: str) -> None:
        found.setdefault(kind, []).append(text)

    S, W = trace.scores, trace.weights
    allowed = np.broadcast_to(trace.allowed, S.shape)
    n_q, n_k = S.shape[-2:]
    heads = split_heads(S, lang)
    many = len(heads) > 1
    lead = int(np.prod(S.shape[:-2], dtype=np.int64))
    flat_w = W.reshape(lead, n_q, n_k)
    flat_a = allowed.reshape(lead, n_q, n_k)
    flat_l = trace.logits.reshape(lead, n_q, n_k)
    default = _default_scale(trace)
    for h, (hl, s) in enumerate(heads):
        w, al, lg = flat_w[h], flat_a[h], flat_l[h]
        pre = f"[{hl}] " if many else ""
        for i in range(n_q):
            q = pre + _q_label(trace, i)
            if not al[i].any():
                if n_k:
                    add("empty", t["r_empty_row"].format(q=q))
                continue
            j = int(np.argmax(s[i]))
            if not al[i, j] and s[i, j] > s[i][al[i]].max():
                add("masked", t["r_masked_max"].format(q=q, k=_k_label(trace, j),
                                                       s=fmt(float(s[i, j]), decimals)))
            zeros = al[i] & (np.abs(s[i]) < 1e-12) & (w[i] > 0.01)
            for j in np.flatnonzero(zeros if al[i].sum() >= 2 else zeros & False):
                add("zero", t["r_zero_score"].format(q=_q_label(trace, i) if not many else q,
                                                     k=_k_label(trace, int(j)),
                                                     w=fmt(float(w[i, j]), decimals)))
                break
            if al[i].sum() >= 2 and w[i].max() > 0.99:
                fin = lg[i][al[i]]
                text = t["r_saturated"].format(q=q, w=fmt(float(w[i].max()), decimals),
                                               spread=fmt(float(fin.max() - fin.min()), 1))
                if trace.scale > default * 1.5 and trace.softcap is None:
                    text += t["r_saturated_scale"].format(
                        scale=fmt(trace.scale, decimals), default=fmt(default, decimals),
                        ratio=fmt(trace.scale / default, 1))
                add("saturated", text)
        if (n_q == n_k >= 2 and np.allclose(s, s.T, atol=1e-9)
                and not np.allclose(s, s.flat[0])):
            add("symmetric", pre + t["r_symmetric"].format(
                q1=_q_label(trace, 0), k2=_k_label(trace, 1), q2=_q_label(trace, 1),
                k1=_k_label(trace, 0)))
    if n_q != n_k and n_q > 1 and n_k > 1:
        add("cross", t["r_cross"].format(nq=n_q, nk=n_k))
    if trace.output.ndim == 3 and trace.output.shape[0] > 1:
        h, _, dv = trace.output.shape
        add("concat", t["r_concat"].format(h=h, dk=trace.q.shape[-1], nq=n_q, dv=dv,
                                           hdv=h * dv))
    out = []
    for kind, items in found.items():
        keep = 1 if kind == "zero" else limit
        out.extend(items[:keep])
        if len(items) > keep:
            out.append("    " + t["and_more"].format(n=len(items) - keep))
    return out


# ---------------------------------------------------------------------------- the page


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
        shape = f"{SYMBOLIC.get(s.key, '')} = {_shape(s.shape)}".strip(" =")
        if heads:
            shape = f"{t['per_head']} {shape}"
        rows.append([f"{i + 1}. {step_name(s, lang)}", step_what(s, lang),
                     step_formula(s, lang), shape])
    if trace.output.ndim == 3 and trace.output.shape[0] > 1:
        h, n_q, dv = trace.output.shape
        rows.append([f"{len(trace.steps) + 1}. {step_name('Concat', lang)}", t["Concat"],
                     "O = [O₁ | … | O_h]", f"(n_q, h·d_v) = {_shape((n_q, h * dv))}"])
    return _table(rows)


def _matrices(
    a: np.ndarray, lang: str, decimals: int, rows: Sequence[str] | str | None,
    cols: Sequence[str] | str | None, style: Style, max_heads: int, *, sums: bool = False,
    emph_max: bool = False, word: str = "head",
) -> list[str]:
    t = STRINGS[lang]
    parts: list[str] = []
    heads = split_heads(a, lang, word)
    for label, m in heads[:max_heads]:
        if label:
            parts.append(f"  {style.bold(label)}")
        emph = None
        if emph_max and m.size:
            emph = (m == m.max(-1, keepdims=True)) & (m > 0)
        parts.append(format_matrix(m, decimals, rows, cols, style=style, emph=emph,
                                   sums=m.sum(-1) if sums else None, sum_label=t["sum"]))
        if m.shape[0] > 12 or m.shape[1] > 10:
            parts.append("  " + style.dim(t["summarised"].format(r=m.shape[0], c=m.shape[1])))
    if len(heads) > max_heads:
        parts.append("  " + style.dim(t["more_heads"].format(n=len(heads) - max_heads)))
    return parts


def render_text(trace: Trace, lang: str = "en", decimals: int = 3, color: bool | None = None,
                *, table: bool = True, max_heads: int | None = None) -> str:
    """The whole walkthrough of one trace as text (see the module docstring).

    ``max_heads`` limits how many heads are printed (default: the trace's
    ``options["max_heads"]``, else 4).
    """
    t = check_lang(lang)
    if max_heads is None:
        max_heads = int(trace.options.get("max_heads", 4))
    st = Style(use_color(color))
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
        parts.append(f"  {name} {_shape(arr.shape)}")
        shared = name != "Q" and arr.ndim > 2 and arr.shape[-3] != trace.q.shape[-3]
        parts += _matrices(arr, lang, decimals, rows, "d", st, max_heads,
                           word="kv_head" if shared else "head")
    parts.append("")
    for i, s in enumerate(trace.steps):
        parts.append(st.head(f"[{i + 1}] {step_name(s, lang)}: {step_formula(s, lang)}") + "   "
                     + _shape(s.value.shape))
        cols = "d" if s.key == "output" else krows
        parts += _matrices(s.value, lang, decimals, qrows, cols, st, max_heads,
                           sums=s.key == "weights", emph_max=s.key == "weights")
        parts.append("")
    if trace.output.ndim == 3 and trace.output.shape[0] > 1:
        h, n_q, dv = trace.output.shape
        cat = trace.output.transpose(1, 0, 2).reshape(n_q, h * dv)
        parts.append(st.head(f"[{len(trace.steps) + 1}] {step_name('Concat', lang)}: "
                             "O = [O₁ | … | O_h]") + "   " + _shape(cat.shape))
        parts += _matrices(cat, lang, decimals, qrows, "d", st, max_heads)
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
