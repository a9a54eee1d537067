"""Explain an attention call step by step: ``ak.explain(q, k, v, **options) -> Trace``.

The trace is data (NumPy arrays per step); renderers turn it into a text walkthrough
(English or Korean), a self-contained HTML page, or heatmaps.
"""

from __future__ import annotations

from .trace import Step, Trace, explain

__all__ = ["explain", "Trace", "Step"]
