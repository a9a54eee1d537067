"""The Trace: every step of one attention call, as data — the five steps of the reference
(1 score S = Q Kᵀ, 2 scale, 3 mask, 4 softmax, 5 weighted sum O = W V).

Shape legend::

    2-D inputs (N, D)            → step values (N_q, N_k) and (N_q, D_v)
    inputs (..., H, N, D)        → step values (..., H, N_q, N_k) and (..., H, N_q, D_v)

Caution
-------
- ``explain`` keeps every step as float64: it refuses a call above the limits of
  :mod:`.guard` (4,194,304 scores, 16,777,216 values per input) before computing, and a
  call whose finite inputs overflow (Q·Kᵀ, S · scale, a score_mod), naming where — both as
  :class:`~attnkit.explain.guard.ExplainError`. Renderers summarise large traces
  (:mod:`.common`'s budgets).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..api import prepare
from ..backends import check_name
from ..reference import reference
from ..scores import ScoreMod
from .guard import check_overflow, check_size
from .strings import check_lang


@dataclass
class Step:
    """One step of the walkthrough."""

    name: str            # e.g. "MatMul", "Scale", "Mask", "Softmax"
    key: str             # stable id: scores, scaled, logits, weights, output
    formula: str         # e.g. "S = Q Kᵀ"
    shape: tuple[int, ...]
    value: np.ndarray


@dataclass(frozen=True)
class PageView:
    """What :meth:`Trace.view` returns: Jupyter displays it as the trace's page in ``lang``."""

    trace: Trace
    lang: str = "en"

    def _repr_html_(self) -> str:
        import html

        page = self.trace.to_html(lang=self.lang)
        title = "attnkit explain"
        return (f'<iframe srcdoc="{html.escape(page, quote=True)}" title="{title}" '
                'style="width:100%;height:720px;border:1px solid #d9dee8;border-radius:8px">'
                "</iframe>")


@dataclass
class Trace:
    """Every intermediate of ``softmax(QKᵀ·scale + M) V`` for one call (NumPy, float64).

    ``steps`` are, in order: MatMul (scores), Scale (scaled), Mask (logits), Softmax
    (weights), MatMul (output). ``q``, ``k``, ``v`` are the inputs as given (2-D stays 2-D).
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    steps: list[Step]
    lse: np.ndarray
    allowed: np.ndarray
    scale: float
    softcap: float | None = None
    mask_name: str | None = None
    has_score_mod: bool = False
    has_bias: bool = False
    options: dict[str, Any] = field(default_factory=dict)
    # Presentation (optional): word labels for the query rows / key columns, and a title and
    # an introduction per language ("en", "ko") shown above the walkthrough.
    q_labels: list[str] | None = None
    k_labels: list[str] | None = None
    title: dict[str, str] = field(default_factory=dict)
    intro: dict[str, str] = field(default_factory=dict)

    def labelled(self, q_labels: list[str] | None = None, k_labels: list[str] | None = None,
                 ) -> Trace:
        """Attach word labels to the query rows and key columns (returns ``self``)."""
        n_q, n_k = self.scores.shape[-2:]
        for name, labels, n in (("q_labels", q_labels, n_q), ("k_labels", k_labels, n_k)):
            if labels is not None and len(labels) != n:
                raise ValueError(f"{name} has {len(labels)} labels but there are {n} "
                                 f"{'queries' if name == 'q_labels' else 'keys'}: give one each")
        self.q_labels = list(q_labels) if q_labels is not None else None
        self.k_labels = list(k_labels) if k_labels is not None else None
        return self

    def step(self, key: str) -> Step:
        for s in self.steps:
            if s.key == key:
                return s
        raise KeyError(f"no step {key!r}; steps are {[s.key for s in self.steps]}")

    @property
    def scores(self) -> np.ndarray:
        """S = Q Kᵀ, ``(…, N_q, N_k)``."""
        return self.step("scores").value

    @property
    def scaled(self) -> np.ndarray:
        """S · scale (then softcap / score_mod / bias), before the mask."""
        return self.step("scaled").value

    @property
    def logits(self) -> np.ndarray:
        """The scaled, soft-capped, masked logits (−inf where blocked)."""
        return self.step("logits").value

    @property
    def weights(self) -> np.ndarray:
        """Softmax over keys: each row sums to 1 (0 for a row with no allowed key)."""
        return self.step("weights").value

    @property
    def output(self) -> np.ndarray:
        """weights · V, ``(…, N_q, D_v)``."""
        return self.step("output").value

    @property
    def n_heads(self) -> int:
        return 1 if self.scores.ndim == 2 else self.scores.shape[-3]

    def to_text(self, lang: str = "en", *, decimals: int = 3, color: bool | None = None) -> str:
        """The walkthrough as text: the step table, then each step's matrix."""
        from .text import render_text

        return render_text(self, lang=lang, decimals=decimals, color=color)

    def to_html(self, path: str | Path | None = None, *, lang: str = "en") -> str:
        """A self-contained HTML page (no network); written to ``path`` if given."""
        from .html import render_html

        page = render_html([self], lang=lang)
        if path is not None:
            Path(path).write_text(page, encoding="utf-8")
        return page

    def _repr_html_(self) -> str:
        """Jupyter shows the trace as its page (in an iframe, so the page's script runs and
        its styles stay inside), in English; ``tr.view("ko")`` shows it in Korean."""
        return self.view()._repr_html_()

    def view(self, lang: str = "en") -> PageView:
        """The page in ``lang`` for Jupyter: a cell ending in ``tr.view("ko")`` shows the
        Korean page, playground included (a bare ``tr`` shows the English one)."""
        check_lang(lang)
        return PageView(self, lang)

    def plot(self, path: str | Path, *, what: str | tuple[str, ...] = ("weights",),
             lang: str = "en") -> Path:
        """Heatmaps (PNG) of the weights per head — and optionally scores/logits."""
        from .plot import render_plot

        return render_plot([self], path, what=what, lang=lang)


def explain(
    q: Any, k: Any, v: Any, *, mask: Any = None, is_causal: bool = False,
    scale: float | None = None, softcap: float | None = None,
    score_mod: ScoreMod | None = None, dropout_p: float = 0.0, backend: str = "reference",
    return_lse: bool = False,
) -> Trace:
    """Run the reference on one call and keep every step (same options as ``attention``).

    ``backend`` and ``return_lse`` are accepted for symmetry with ``attention``: the trace
    always comes from the reference and always holds the LSE. ``dropout_p`` must be 0: a
    walkthrough shows the deterministic computation (dropout would make the printed weights
    and output disagree). Raises :class:`~attnkit.explain.guard.ExplainError` above the size
    limits or where finite inputs overflow (see the module's Caution).
    """
    check_name(backend)
    if dropout_p:
        raise ValueError(
            f"explain shows the deterministic computation, got dropout_p={dropout_p!r}: "
            "call explain without dropout (dropout zeroes random weights and rescales the "
            "rest by 1/(1-p) during training only)"
        )
    prep = prepare(q, k, v, mask=mask, is_causal=is_causal, scale=scale, softcap=softcap,
                   score_mod=score_mod, dropout_p=dropout_p)
    p = prep.problem
    check_size(p, {n: tuple(getattr(x, "shape", ())) for n, x in zip("qkv", (q, k, v),
                                                                      strict=True)})
    r = reference(p)
    lead = prep.lead
    check_overflow(p, r, lead if not prep.two_d else ())

    def arr(t: Any) -> np.ndarray:
        a = t.detach().to("cpu").double().numpy()
        return a[0, 0] if prep.two_d else a.reshape(*lead, *a.shape[1:])

    allowed = np.broadcast_to(
        r.allowed.cpu().numpy(), (p.batch, p.heads_q, p.n_q, p.n_k)).copy()
    allowed = allowed[0, 0] if prep.two_d else allowed.reshape(*lead, *allowed.shape[1:])
    n_q, n_k, d_v = p.n_q, p.n_k, p.d_v
    sq = (n_q, n_k)
    d_k = p.d_k
    scale_txt = f"1/√{d_k}" if math.isclose(p.scale, 1 / math.sqrt(max(d_k, 1))) \
        else f"{p.scale:g}"
    scaled_formula = f"X = S · {scale_txt}"
    if p.softcap is not None:
        scaled_formula += f", X ← {p.softcap:g}·tanh(X/{p.softcap:g})"
    if p.score_mod is not None:
        scaled_formula += ", X ← score_mod(X)"
    if p.bias is not None:
        scaled_formula += " + bias"
    steps = [
        Step("MatMul", "scores", "S = Q Kᵀ", sq, arr(r.scores)),
        Step("Scale", "scaled", scaled_formula, sq, arr(r.scaled)),
        Step("Mask", "logits", "L = X + M   (M = 0 or −∞)", sq, arr(r.logits)),
        Step("Softmax", "weights", "W = softmax_keys(L)", sq, arr(r.weights)),
        Step("MatMul", "output", "O = W V", (n_q, d_v), arr(r.output)),
    ]
    qn, kn, vn = (arr(t) for t in (p.q, p.k, p.v))
    return Trace(
        q=qn, k=kn, v=vn, steps=steps, lse=arr(r.lse), allowed=allowed, scale=p.scale,
        softcap=p.softcap, mask_name=p.mask.name if p.mask is not None else None,
        has_score_mod=p.score_mod is not None, has_bias=p.bias is not None,
        options={"is_causal": is_causal, "dropout_p": dropout_p},
    )
