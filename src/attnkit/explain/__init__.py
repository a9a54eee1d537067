"""Explain an attention call step by step: ``ak.explain(q, k, v, **options) -> Trace``.

The trace is data (NumPy arrays for each of the five steps: score, scale, mask, softmax,
weighted sum); renderers turn it into a text walkthrough (English or Korean), a
self-contained HTML page, or heatmaps.

What lives where::

    trace.py     Trace, Step and explain(): runs the reference and keeps every step
    guard.py     what explain refuses (size limits, overflow): ExplainError, in en and ko
    strings.py   every word shown, English and Korean, one table for all renderers;
                 step and mask names (step_name, step_what, step_formula, mask_label)
    common.py    shared by the renderers: number formatting, shapes, labels, heads,
                 and the size budgets with the one downsampling (pool)
    remarks.py   the teaching remarks ("What to notice")
    text.py      the text renderer (terminal, colour, Hangul-aware alignment)
    html.py      the HTML renderer (heatmaps, flow diagram, tabs per head)
    plot.py      the PNG renderer (matplotlib, imported only when used)
    examples.py  the course's built-in worked examples
    inputs.py    a learner's own Q, K, V and mask read from files (the command line's)
    live.py      the page's playground: the page's own script recomputes every step
    model.py     a real model's attention (explain_model): every layer's captured Q, K, V
    modelview.py its renderers: the layer × head grid and one head's five steps
    tiny.py      tiny-ko: a Korean character-level causal model trained here (tiny_ko.txt)

Caution
-------
- Size: ``explain`` refuses more than 4,194,304 scores (B·H·N_q·N_k) or 16,777,216 values
  per input (:mod:`.guard`). Below that every renderer stays bounded: the text prints
  corners (12 × 10) of at most 4 heads, the HTML page draws a large trace in blocks of
  means (at most 8 heads, about 2 MB at most), the plot downsamples panels to 256 × 256
  (at most 8 heads) — and each says so, in English and Korean.
"""

from __future__ import annotations

from .guard import ExplainError
from .trace import Step, Trace, explain


def explain_model(model: str = "minilm", text: str | None = None, **options):  # noqa: ANN201
    """A real model's attention on one text (see :func:`attnkit.explain.model.explain_model`;
    imported on first use, since it needs transformers)."""
    from .model import explain_model as run

    return run(model, text, **options)


__all__ = ["explain", "explain_model", "Trace", "Step", "ExplainError"]
