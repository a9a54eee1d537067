"""The course's lessons that are measurements and drawings, not one attention call.

``LESSONS[name].text(lang)`` prints a lesson; ``LESSONS[name].plot(path, lang)`` draws it
where it has a figure (``attnkit lesson NAME [--plot OUT.png]`` on the command line):

    sqrt-dk      why ÷√d_k, measured: unit-variance random q, k for d_k in 4 … 1024 — the
                 variance of q·k and of q·k/√d_k, the largest softmax weight, the entropy,
                 the softmax slope p(1−p), with and without scaling (table + PNG), and the
                 course's derivation with its limit
    bounds       √d_k scaling vs QK-Norm vs soft-capping: where each acts, what it bounds
    attn-vs-ffn  attention vs FFN: 4d² vs 8d² weights, 8nd² + 4n²d vs 16nd² FLOPs
    heads        the multi-head split drawn: X (n, d) → Q with each head's columns marked →
                 per head (n, d_h) → concat (n, d) → W_O

Shape legend::

    sqrt-dk   q (trials, d_k)   k (trials, n_keys, d_k)   s = q·k (trials, n_keys)

Caution
-------
- sqrt-dk is a Monte-Carlo measurement with a fixed seed (the numbers repeat exactly):
  ``trials`` queries against ``n_keys`` keys each; the measured variances carry a sampling
  error of about √(2/trials) relative.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .._outfiles import savefig_kwargs
from .common import fmt
from .strings import check_lang

__all__ = ["LESSONS", "Lesson", "measure_sqrt_dk", "D_KS"]

D_KS = (4, 16, 64, 256, 1024)


def _p(en: str, ko: str) -> dict[str, str]:
    return {"en": en, "ko": ko}


@dataclass(frozen=True)
class Lesson:
    name: str
    descriptions: dict[str, str]
    make_text: Callable[[str], str]
    make_plot: Callable[[Path, str], Path] | None = None

    def describe(self, lang: str = "en") -> str:
        return self.descriptions.get(lang, self.descriptions["en"])

    def text(self, lang: str = "en") -> str:
        check_lang(lang)
        return self.make_text(lang)

    def plot(self, path: str | Path, lang: str = "en") -> Path:
        if self.make_plot is None:
            raise ValueError(f"the lesson {self.name!r} has no figure; lessons with one: "
                             + ", ".join(n for n, x in LESSONS.items() if x.make_plot))
        return self.make_plot(Path(path), lang)


# ---------------------------------------------------------------------------- why √d_k


def measure_sqrt_dk(d_ks: tuple[int, ...] = D_KS, trials: int = 2000, n_keys: int = 16,
                    seed: int = 0) -> list[dict[str, float]]:
    """For each d_k: q, k ~ N(0, 1) per component; the variance of q·k and of q·k/√d_k, and,
    unscaled vs scaled, the mean largest weight, the mean entropy (nats; uniform = ln n_keys)
    and the mean slope p(1−p) of the largest weight."""
    rng = np.random.default_rng(seed)
    rows = []
    for d in d_ks:
        q = rng.standard_normal((trials, d))                     # (T, d_k)
        k = rng.standard_normal((trials, n_keys, d))             # (T, n, d_k)
        s = np.einsum("td,tnd->tn", q, k)                        # (T, n)
        row: dict[str, float] = {"d_k": d, "var": float(s.var()),
                                 "var_scaled": float((s / math.sqrt(d)).var())}
        for tag, x in (("raw", s), ("scaled", s / math.sqrt(d))):
            z = x - x.max(-1, keepdims=True)
            w = np.exp(z)
            w /= w.sum(-1, keepdims=True)                        # (T, n) softmax weights
            p = w.max(-1)
            ent = -(w * np.log(np.where(w > 0, w, 1.0))).sum(-1)
            row[f"pmax_{tag}"] = float(p.mean())
            row[f"entropy_{tag}"] = float(ent.mean())
            row[f"slope_{tag}"] = float((p * (1 - p)).mean())
        rows.append(row)
    return rows


_SQRT = {
    "en": (
        "Why ÷√d_k, measured",
        "Draw q and k with independent components of mean 0 and variance 1. Then\n"
        "  q·k = Σ_i q_i k_i,  E[q_i k_i] = 0,  Var(q_i k_i) = E[q_i²] E[k_i²] = 1,\n"
        "so Var(q·k) = d_k (a sum of d_k independent terms), and Var(q·k / √d_k) = 1.\n"
        "Without the division the logits spread like √d_k: softmax becomes nearly one-hot\n"
        "and its slope p(1−p) — what the gradient flows through — vanishes.\n"
        "Measured ({trials} queries × {n} keys each, seed {seed}):",
        "The limit: the derivation assumes independent, unit-variance components — true at\n"
        "initialisation only. Training moves W_Q and W_K, the norms of q and k grow, and\n"
        "÷√d_k no longer keeps the logits near unit variance. That is where QK-Norm comes\n"
        "in: it normalises q and k themselves, so the logits stay bounded during training\n"
        "(see `attnkit lesson bounds`).",
        ("d_k", "Var(q·k)", "Var(q·k/√d_k)", "max w raw", "max w ÷√d_k", "H raw",
         "H ÷√d_k", "p(1−p) raw", "p(1−p) ÷√d_k"),
        "entropy H in nats (uniform over {n} keys: ln {n} = {ln})",
    ),
    "ko": (
        "왜 √d_k로 나누는가: 직접 재어 보기",
        "q와 k의 각 성분을 평균 0, 분산 1로 서로 독립이 되게 뽑습니다. 그러면\n"
        "  q·k = Σ_i q_i k_i,  E[q_i k_i] = 0,  Var(q_i k_i) = E[q_i²] E[k_i²] = 1\n"
        "이므로 Var(q·k) = d_k (독립인 항 d_k개의 합)이고, Var(q·k / √d_k) = 1입니다.\n"
        "나누지 않으면 logit이 √d_k에 비례해 퍼집니다: Softmax가 거의 one-hot이 되고,\n"
        "p(1−p)가 0에 가까워져 역전파의 학습 신호가 약해집니다.\n"
        "측정값 (Query {trials}개 × 각각 Key {n}개, 시드 {seed}):",
        "한계: 이 유도는 성분이 서로 독립이고 분산이 1이라고 가정합니다 — 초기화 때만\n"
        "맞는 가정입니다. 학습하면서 W_Q, W_K가 바뀌고 q, k의 노름이 커지면 ÷√d_k만으로는\n"
        "logit의 분산을 1 근처로 붙잡지 못합니다. 여기서 QK-Norm이 등장합니다: q와 k 자체를\n"
        "정규화하므로 학습 중에도 logit이 유계로 남습니다 (`attnkit lesson bounds` 참고).",
        ("d_k", "Var(q·k)", "Var(q·k/√d_k)", "최대 w 나누기 전", "최대 w ÷√d_k", "H 나누기 전",
         "H ÷√d_k", "p(1−p) 나누기 전", "p(1−p) ÷√d_k"),
        "엔트로피 H의 단위는 nat (Key {n}개에 고르게 퍼지면 ln {n} = {ln})",
    ),
}


def _table(head: tuple[str, ...], rows: list[list[str]]) -> str:
    from .text import display_width

    w = [max(display_width(r[i]) for r in [list(head), *rows]) for i in range(len(head))]
    line = lambda r: "  ".join(" " * (w[i] - display_width(c)) + c   # noqa: E731
                               for i, c in enumerate(r))
    return "\n".join([line(list(head)), "  ".join("-" * x for x in w)]
                     + [line(r) for r in rows])


def _sqrt_text(lang: str, trials: int = 2000, n: int = 16, seed: int = 0) -> str:
    title, intro, limit, head, note = _SQRT[lang]
    rows = measure_sqrt_dk(trials=trials, n_keys=n, seed=seed)
    body = [[str(r["d_k"]), f"{r['var']:.1f}", f"{r['var_scaled']:.3f}",
             f"{r['pmax_raw']:.3f}", f"{r['pmax_scaled']:.3f}", f"{r['entropy_raw']:.3f}",
             f"{r['entropy_scaled']:.3f}", f"{r['slope_raw']:.4f}", f"{r['slope_scaled']:.4f}"]
            for r in rows]
    return "\n".join([title, "=" * 40, intro.format(trials=trials, n=n, seed=seed), "",
                      _table(head, body), note.format(n=n, ln=fmt(math.log(n))), "",
                      limit]) + "\n"


def _sqrt_plot(path: Path, lang: str) -> Path:
    from matplotlib.figure import Figure

    from .plot import korean_font

    font = korean_font("figure's labels") if lang == "ko" else None
    if lang == "ko" and font is None:
        lang = "en"
    import matplotlib as mpl

    title, _, _, head, _ = _SQRT[lang]
    rows = measure_sqrt_dk()
    d = [r["d_k"] for r in rows]
    fig = Figure(figsize=(12, 3.8), dpi=100, layout="constrained")
    with mpl.rc_context({"font.family": ["DejaVu Sans", font] if font else ["DejaVu Sans"]}):
        axes = fig.subplots(1, 3)
        for ax, (a, b, la, lb, ylab) in zip(axes, [
            ("var", "var_scaled", head[1], head[2], "variance" if lang == "en" else "분산"),
            ("pmax_raw", "pmax_scaled", head[3], head[4], "max w" if lang == "en" else "최대 w"),
            ("slope_raw", "slope_scaled", head[7], head[8], "p(1−p)"),
        ], strict=True):
            ax.plot(d, [r[a] for r in rows], "o-", color="#b2182b", label=la)
            ax.plot(d, [r[b] for r in rows], "s-", color="#2166ac", label=lb)
            ax.set_xscale("log", base=2)
            if a == "var":
                ax.set_yscale("log", base=2)
                ax.plot(d, d, ":", color="#888", label="d_k")
            ax.set_xlabel("d_k")
            ax.set_ylabel(ylab)
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3)
        fig.suptitle(title)
    fig.savefig(path, **savefig_kwargs(path))
    return path


# ---------------------------------------------------------------------------- bounds


def _bounds_text(lang: str) -> str:
    rows = [(a, 50 * math.tanh(a / 50)) for a in (1, 10, 25, 50, 100, 1000, -1000)]
    en = lang == "en"
    head = ("method", "acts on", "what it bounds") if en else ("방법", "어디에", "무엇을 제한하나")
    table = _table(head, [
        ["÷√d_k", "S = QKᵀ, after the dot product" if en else "내적 뒤의 S = QKᵀ",
         "nothing: it fixes the variance at initialisation only" if en else
         "제한하지 않음: 초기화 때의 분산만 1로 맞춤"],
        ["QK-Norm", "q and k, before the dot product" if en else "내적 전의 q와 k",
         "|q̂·k̂| ≤ 1, so every logit ≤ g (the learned gain)" if en else
         "|q̂·k̂| ≤ 1이므로 모든 logit ≤ g (g: 학습되는 배율)"],
        ["soft-cap c" if en else "소프트캡 c", "the scaled score, before the mask" if en else
         "Mask 전의 Score (scale을 곱한 뒤)", "c·tanh(a/c) ∈ (−c, c)"],
    ])
    caps = _table(("a", "50·tanh(a/50)"), [[f"{a:g}", f"{x:.3f}"] for a, x in rows])
    intro = ("√d_k scaling, QK-Norm and soft-capping, side by side: where each acts and what "
             "it bounds.\n  QK-Norm: q̂ = q/‖q‖, k̂ = k/‖k‖, logit = g · q̂·k̂ (RMSNorm in "
             "practice).\n  soft-cap (Gemma 2: c = 50): a ↦ c·tanh(a/c) — near a for |a| ≪ c, "
             "never beyond ±c." if en else
             "÷√d_k, QK-Norm, 소프트캡을 나란히: 각각 어디에 작용하고 무엇을 제한하는가.\n"
             "  QK-Norm: q̂ = q/‖q‖, k̂ = k/‖k‖, logit = g · q̂·k̂ (실제로는 RMSNorm).\n"
             "  소프트캡 (Gemma 2: c = 50): a ↦ c·tanh(a/c) — |a| ≪ c이면 거의 a이고, ±c를 "
             "넘지 않음.")
    tail = ("In attnkit: ak.attention(..., scale=...), MultiHeadAttention(qk_norm=True), "
            "ak.attention(..., softcap=50)." if en else
            "attnkit에서는: ak.attention(..., scale=...), MultiHeadAttention(qk_norm=True), "
            "ak.attention(..., softcap=50).")
    title = "Scaling vs QK-Norm vs soft-capping" if en else "÷√d_k vs QK-Norm vs 소프트캡"
    return "\n".join([title, "=" * 40, intro, "", table, "", caps, "", tail]) + "\n"


# ---------------------------------------------------------------------------- attn vs FFN


def _ffn_text(lang: str, d: int = 512) -> str:
    from ..cost import report

    en = lang == "en"
    rows = []
    for n in (128, 512, 1024, 2048, 4096):
        r = report(d, 8, n)
        att, ffn = r.attention_flops["MHA"], r.ffn_flops
        rows.append([str(n), f"{att:,}", f"{ffn:,}", f"{att / ffn:.2f}"])
    r = report(d, 8, 1)
    head = (("n", "attention 8nd² + 4n²d", "FFN 16nd²", "attention / FFN") if en else
            ("n", "Attention 8nd² + 4n²d", "FFN 16nd²", "Attention / FFN"))
    intro = (f"One layer, d = {d}: weights — attention 4d² = {r.attn_params['MHA']:,}, "
             f"FFN 8d² = {r.ffn_params:,} (the FFN holds twice as many).\n"
             "Forward FLOPs per sequence: attention 8nd² + 4n²d, FFN 16nd²; the ratio is "
             "(2 + n/d) / 4, so attention costs more once n > 2d." if en else
             f"레이어 하나, d = {d}: 가중치 — Attention 4d² = {r.attn_params['MHA']:,}, "
             f"FFN 8d² = {r.ffn_params:,} (FFN이 두 배).\n"
             "시퀀스 하나의 순전파 FLOPs: Attention 8nd² + 4n²d, FFN 16nd². 비율은 "
             "(2 + n/d) / 4이므로 n > 2d부터 Attention이 더 비쌉니다.")
    tail = ("`attnkit cost --d-model D --heads H --seq N` prints both subtotals for any size."
            if en else "`attnkit cost --d-model D --heads H --seq N`은 어떤 크기든 두 소계를 "
            "함께 보여 줍니다.")
    title = "Attention vs FFN"
    return "\n".join([title, "=" * 40, intro, "", _table(head, rows), "", tail]) + "\n"


# ---------------------------------------------------------------------------- heads


def _blocks(h: int) -> str:
    """The concatenated heads, each written while they fit: ``O_1 | O_2``; ``O_1 | … | O_8``."""
    names = [f"O_{i + 1}" for i in range(h)]
    return " | ".join(names if h <= 4 else [names[0], "…", names[-1]])


def _heads_text(lang: str, n: int = 3, d: int = 8, h: int = 2) -> str:
    en = lang == "en"
    dh = d // h
    cols = [f"d{j + 1}" for j in range(d)]
    mark = "".join(f"h{j // dh + 1}".center(4) for j in range(d))
    lines = [("The multi-head split, drawn" if en else "Multi-Head 분할 그림"), "=" * 40,
             (f"n = {n} tokens, d = {d}, h = {h} heads of d_h = d/h = {dh}:" if en else
              f"토큰 n = {n}개, d = {d}, head h = {h}개, head마다 d_h = d/h = {dh}:"), "",
             f"  X ({n}, {d})  ·  W_Q ({d}, {d})  →  Q ({n}, {d})", "",
             "      " + "".join(c.center(4) for c in cols),
             "      " + mark + ("   ← " + ("head of each column" if en else "열마다 맡은 head"))]
    for i in range(n):
        lines.append(f"  q{i + 1}  " + "".join(" ·  " for _ in cols))
    lines.append("")
    for g in range(h):
        a, b = g * dh + 1, (g + 1) * dh
        qg = f"Q_{g + 1} ({n}, {dh})"
        lines.append(f"  head {g + 1}: columns d{a}–d{b}  →  {qg}, and K_{g + 1}, V_{g + 1} "
                     "the same columns" if en else
                     f"  head {g + 1}: d{a}–d{b} 열  →  {qg}, K_{g + 1}, V_{g + 1}도 같은 열")
    lines += ["",
              (f"  each head: softmax(Q_i K_iᵀ / √{dh}) V_i  →  O_i ({n}, {dh})" if en else
               f"  head마다: softmax(Q_i K_iᵀ / √{dh}) V_i  →  O_i ({n}, {dh})"),
              f"  {'concat' if en else '이어붙이기'} [{_blocks(h)}]  →  ({n}, {d})  ·  "
              f"W_O ({d}, {d})  →  ({n}, {d})", "",
              (f"Head 2 is d{dh + 1}–d{2 * dh}, not d1–d{dh}: a head is a slice of the columns "
               "(features), every token keeps all its rows." if en else
               f"head 2는 d1–d{dh}가 아니라 d{dh + 1}–d{2 * dh}입니다: head는 열(특징)의 조각이고, "
               "모든 토큰은 자기 행을 그대로 가집니다."),
              ("Try it: attnkit explain --example multihead" if en else
               "직접 해 보기: attnkit explain --example multihead --lang ko")]
    return "\n".join(lines) + "\n"


LESSONS: dict[str, Lesson] = {x.name: x for x in [
    Lesson("sqrt-dk", _p("why ÷√d_k, measured: variance, max weight, entropy, p(1−p)",
                         "왜 ÷√d_k인가, 직접 재어 보기: 분산, 최대 가중치, 엔트로피, p(1−p)"),
           _sqrt_text, _sqrt_plot),
    Lesson("bounds", _p("√d_k scaling vs QK-Norm vs soft-capping: where each acts",
                        "÷√d_k vs QK-Norm vs 소프트캡: 어디에 작용하나"), _bounds_text),
    Lesson("attn-vs-ffn", _p("attention vs FFN: 4d² vs 8d² weights, 8nd² + 4n²d vs 16nd²",
                             "Attention vs FFN: 가중치 4d² vs 8d², FLOPs 8nd² + 4n²d vs 16nd²"),
           _ffn_text),
    Lesson("heads", _p("the multi-head split drawn: which columns each head takes",
                       "Multi-Head 분할 그림: head마다 맡는 열"), _heads_text),
]}


def run(name: str, lang: str = "en", plot: str | None = None) -> tuple[str, Any]:
    """(text, the PNG path or None) of one lesson."""
    lesson = LESSONS[name]
    return lesson.text(lang), (lesson.plot(plot, lang) if plot else None)
