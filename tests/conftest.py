"""Shared fixtures and helpers for the test suite.

- ``backend`` (fixture, parametrised at collection time over ``attnkit.backends.names()``):
  every backend that registers itself gets the reference-comparison tests automatically.
- :func:`run_backend`: ``attention(..., backend=name)`` or ``pytest.skip`` with the
  backend's own reasons when it cannot run the call.
- :func:`oracle`: attention written out in float64 with plain torch, independent of attnkit
  (the dense "math" every backend is compared with).
- :func:`naive_low_precision` and :func:`assert_low_precision_close`: the rule for float16 /
  bfloat16 — a backend's error against the float64 oracle must be within ``factor`` (2 for
  outputs, 3 for gradients) times the error of the same math done naively in that precision.

Shape legend: q (B, H_q, N_q, D_k), k (B, H_kv, N_k, D_k), v (B, H_kv, N_k, D_v);
allowed/bias broadcastable to (B, H_q, N_q, N_k).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

import attnkit as ak
from attnkit.api import prepare

# Keep runs deterministic and within the 2-core budget.
torch.set_num_threads(min(2, os.cpu_count() or 1))

BACKENDS: list[str] = list(ak.backends.names())


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test taking ``backend`` runs once per registered backend (unless the test
    parametrises ``backend`` itself)."""
    own = any("backend" in str(m.args[0]).replace(" ", "").split(",")
              for m in metafunc.definition.iter_markers("parametrize") if m.args)
    if "backend" in metafunc.fixturenames and not own:
        metafunc.parametrize("backend", BACKENDS)


# ---------------------------------------------------------------------------- running
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


# ---------------------------------------------------------------------------- oracle
def _gqa(t: torch.Tensor, h_q: int) -> torch.Tensor:
    return t.repeat_interleave(h_q // t.shape[-3], dim=-3)


def oracle(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    allowed: torch.Tensor | None = None, bias: torch.Tensor | None = None,
    scale: float | None = None, softcap: float | None = None,
    score_mod: Callable[..., torch.Tensor] | None = None,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention by the formula in ``dtype`` (default float64) → (out, lse, weights).

    Inputs are (..., H, N, D) or 2-D; ``allowed`` (True = may attend) and ``bias`` broadcast
    to the logits. A row with no allowed key gets weights 0, output 0 and LSE -inf.
    Blocked positions are removed with ``torch.where`` so NaN there cannot leak.
    """
    q, k, v = (t.to(dtype) for t in (q, k, v))
    if q.dim() >= 3:
        k, v = _gqa(k, q.shape[-3]), _gqa(v, q.shape[-3])
    sc = q.shape[-1] ** -0.5 if scale is None else scale
    x = (q @ k.transpose(-1, -2)) * sc
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    if score_mod is not None:
        n_q, n_k = x.shape[-2], x.shape[-1]
        x4 = x.reshape(-1, *x.shape[-3:]) if x.dim() >= 3 else x[None, None]
        b = torch.arange(x4.shape[0]).view(-1, 1, 1, 1)
        h = torch.arange(x4.shape[1]).view(1, -1, 1, 1)
        qi = torch.arange(n_q).view(1, 1, -1, 1)
        ki = torch.arange(n_k).view(1, 1, 1, -1)
        x = score_mod(x4, b, h, qi, ki).reshape(x.shape)
    if bias is not None:
        x = x + bias.to(dtype)
    if allowed is not None:
        x = torch.where(allowed, x, torch.tensor(-torch.inf, dtype=dtype))
    lse = torch.logsumexp(x, dim=-1)
    w = torch.exp(x - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    w = torch.where(torch.isfinite(lse)[..., None], w, torch.zeros_like(w))
    if bool(torch.isfinite(v).all()):
        return w @ v, lse, w
    # non-finite V rows: only the queries that give them weight may see them (0·NaN = NaN)
    used = w[..., :, :, None] != 0                                   # (…, N_q, N_k, 1)
    terms = torch.where(used, w[..., None] * v[..., None, :, :], 0.0)  # (…, N_q, N_k, D_v)
    return terms.sum(-2), lse, w


def naive_low_precision(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        **opts: Any) -> torch.Tensor:
    """The same math done naively in q's own (low) precision: no float32 accumulation."""
    out, _, _ = oracle(q, k, v, dtype=q.dtype, **opts)
    return out


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def assert_low_precision_close(got: torch.Tensor, ref_lowp: torch.Tensor, ref64: torch.Tensor,
                               *, factor: float = 2.0, what: str = "output") -> None:
    """A low-precision result must be within ``factor`` × the error that the naive
    low-precision reference makes against the float64 reference (plus a hair for ties)."""
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    err = max_err(got, ref64)
    budget = factor * max_err(ref_lowp, ref64) + 1e-6
    assert err <= budget, (
        f"{what}: error {err:.3g} vs float64 exceeds {factor}× the naive {got.dtype} "
        f"reference's error ({budget:.3g})")


def randn(*shape: int, dtype: torch.dtype = torch.float64, **kw: Any) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, **kw)
