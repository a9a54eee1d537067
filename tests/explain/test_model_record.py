"""explain_model's capture records a model's attention inputs per context: the run in
progress in this thread / task only (two explanations at once, or nested, keep apart)."""

from __future__ import annotations

import threading
import types

import pytest
import torch

pytest.importorskip("transformers")

from attnkit.explain import model as em  # noqa: E402


def test_the_capture_records_into_this_contexts_run_only() -> None:
    capture = em._attention_function()
    module = types.SimpleNamespace(is_causal=False, training=False)
    q, k, v = (torch.randn(1, 2, 3, 4) for _ in range(3))
    outer: list[dict] = []
    token = em._RECORD.set(outer)
    try:
        capture(module, q, k, v, None, scaling=0.5)
        inner: list[dict] = []
        nested = em._RECORD.set(inner)                 # an explanation inside another
        capture(module, q, k, v, None, scaling=0.5)
        em._RECORD.reset(nested)
        elsewhere: list[object] = []
        t = threading.Thread(target=lambda: elsewhere.append(
            capture(module, q, k, v, None, scaling=0.5)))
        t.start()
        t.join()
    finally:
        em._RECORD.reset(token)
    assert len(outer) == 1 and len(inner) == 1 and len(elsewhere) == 1
    assert outer[0]["scale"] == 0.5 and outer[0]["q"].shape == (1, 2, 3, 4)
    assert em._RECORD.get() is None
