"""Text walkthrough of a Trace, in English or Korean."""

from __future__ import annotations

import numpy as np

STRINGS: dict[str, dict[str, str]] = {
    "en": {
        "title": "Attention, step by step:  O = softmax(Q Kᵀ · scale + M) V",
        "step": "step", "what": "what it does", "formula": "formula", "shape": "shape",
        "MatMul_scores": "score every key for every query (dot product)",
        "Scale": "scale the scores so their spread does not grow with d_k",
        "Mask": "block the keys a query may not see (−∞)",
        "Softmax": "turn each row into weights that sum to 1",
        "MatMul_output": "mix the values with the weights",
        "head": "head", "row_sums": "row sums of the weights",
        "query": "q", "key": "k", "value": "v",
        "inputs": "inputs", "scale_is": "scale",
    },
    "ko": {
        "title": "어텐션 단계별 풀이:  O = softmax(Q Kᵀ · scale + M) V",
        "step": "단계", "what": "하는 일", "formula": "수식", "shape": "모양",
        "MatMul_scores": "모든 쿼리와 모든 키의 점수 계산 (내적)",
        "Scale": "d_k가 커져도 점수의 퍼짐이 커지지 않도록 스케일링",
        "Mask": "쿼리가 볼 수 없는 키를 가림 (−∞)",
        "Softmax": "각 행을 합이 1인 가중치로 변환",
        "MatMul_output": "가중치로 값(V)을 섞음",
        "head": "헤드", "row_sums": "가중치 행의 합",
        "query": "q", "key": "k", "value": "v",
        "inputs": "입력", "scale_is": "스케일",
    },
}


def _fmt(x: float, decimals: int) -> str:
    if np.isneginf(x):
        return "-inf"
    if np.isposinf(x):
        return "inf"
    if np.isnan(x):
        return "nan"
    s = f"{x:.{decimals}f}"
    return "0." + "0" * decimals if s.startswith("-") and float(s) == 0 else s


def format_matrix(a: np.ndarray, decimals: int = 3, row_label: str = "q",
                  col_label: str = "k") -> str:
    """A 2-D array as aligned text, rows labelled q1.., columns k1.. ."""
    a = np.atleast_2d(a)
    cells = [[_fmt(float(x), decimals) for x in row] for row in a]
    rl = [f"{row_label}{i + 1}" for i in range(a.shape[0])]
    cl = [f"{col_label}{j + 1}" for j in range(a.shape[1])]
    w = max([len(c) for r in cells for c in r] + [len(c) for c in cl] + [1])
    lw = max([len(r) for r in rl] + [1])
    lines = [" " * lw + "  " + " ".join(c.rjust(w) for c in cl)]
    lines += [rl[i].ljust(lw) + "  " + " ".join(c.rjust(w) for c in row)
              for i, row in enumerate(cells)]
    return "\n".join(lines)


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for j, r in enumerate(rows):
        out.append(" | ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip())
        if j == 0:
            out.append("-+-".join("-" * w for w in widths))
    return "\n".join(out)


def _heads(a: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """Split (..., H, N, M) into labelled 2-D matrices."""
    if a.ndim == 2:
        return [("", a)]
    lead = a.shape[:-2]
    flat = a.reshape(-1, *a.shape[-2:])
    return [(str(tuple(int(i) for i in np.unravel_index(n, lead))), flat[n])
            for n in range(flat.shape[0])]


def render_text(trace, lang: str = "en", decimals: int = 3, color: bool | None = None) -> str:  # noqa: ANN001
    if lang not in STRINGS:
        raise ValueError(f"lang must be one of {sorted(STRINGS)}, got {lang!r}")
    t = STRINGS[lang]
    rows = [[t["step"], t["what"], t["formula"], t["shape"]]]
    for i, s in enumerate(trace.steps):
        what = t.get(f"{s.name}_{s.key}", t.get(s.name, s.name))
        rows.append([f"{i + 1}. {s.name}", what, s.formula,
                     "(" + ", ".join(str(x) for x in s.shape) + ")"])
    parts = [t["title"], "", _table(rows), ""]
    for i, s in enumerate(trace.steps):
        parts.append(f"[{i + 1}] {s.name}: {s.formula}   {tuple(s.value.shape)}")
        col = "d" if s.key == "output" else "k"
        for label, m in _heads(s.value):
            if label:
                parts.append(f"  {t['head']} {label}")
            parts.append(format_matrix(m, decimals, "q", col))
            if s.key == "weights":
                sums = " ".join(_fmt(float(x), decimals) for x in m.sum(-1))
                parts.append(f"  {t['row_sums']}: {sums}")
        parts.append("")
    return "\n".join(parts).rstrip() + "\n"
