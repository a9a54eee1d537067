"""Running one backend on a call, or skipping the test with that backend's own reasons."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

import attnkit as ak
from attnkit.api import prepare

_ATTN_OPTS = ("mask", "is_causal", "scale", "softcap", "score_mod", "dropout_p")


def skip_unless_supported(name: str, q: Any, k: Any, v: Any, **opts: Any) -> None:
    """``pytest.skip`` with the backend's reasons when it cannot run this call."""
    prep = prepare(q, k, v, **{o: opts[o] for o in _ATTN_OPTS if o in opts})
    if prep.problem.n_q == 0 or prep.problem.n_k == 0:
        return                                   # answered by attention() itself
    reasons = ak.backends.get(name).not_supported_reasons(prep.problem)
    if reasons:
        pytest.skip(f"backend {name!r} cannot run this call: " + "; ".join(reasons))


def run_backend(name: str, q: Any, k: Any, v: Any, **opts: Any) -> Any:
    """``ak.attention(q, k, v, backend=name, **opts)``, skipping where ``name`` can't run."""
    skip_unless_supported(name, q, k, v, **opts)
    return ak.attention(q, k, v, backend=name, **opts)


def spy_on_backend(monkeypatch: pytest.MonkeyPatch, backend: Any,
                   on_call: Callable[[Any], None]) -> None:
    """``on_call(problem)`` once for every call that reaches ``backend`` (an instance): its
    ``forward`` and ``forward_screened`` are wrapped (instance attributes, undone by
    monkeypatch), and a call that enters one from the other counts once, at the outer."""
    inside = threading.local()

    for method in ("forward", "forward_screened"):
        real = getattr(backend, method)

        def spy(p: Any, real: Callable[[Any], Any] = real) -> Any:
            if getattr(inside, "on", False):
                return real(p)
            on_call(p)
            inside.on = True
            try:
                return real(p)
            finally:
                inside.on = False
        monkeypatch.setattr(backend, method, spy)
