"""Running one backend on a call, or skipping the test with that backend's own reasons."""

from __future__ import annotations

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
