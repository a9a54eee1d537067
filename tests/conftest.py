"""Shared fixtures and helpers for the test suite.

- ``backend`` (fixture, parametrised at collection time over ``attnkit.backends.names()``):
  every backend that registers itself gets the reference-comparison tests automatically.
  In the reference-comparison modules (``MODE_MODULES``) the engines with a native kernel
  appear twice: ``tiled`` / ``decode`` run on the native kernel only — a call the kernel
  cannot take (float64, a Python score_mod, ...) skips the test with the kernel's reasons,
  so nothing runs twice on the Python engine — and ``tiled[python]`` / ``decode[python]``
  run with ``ATTNKIT_NATIVE=0`` (the Python engines, every call). Elsewhere ``tiled`` and
  ``decode`` are what users get: native where it can run, the Python engine otherwise.
- :func:`run_backend`: ``attention(..., backend=name)`` or ``pytest.skip`` with the
  backend's own reasons when it cannot run the call.
- :func:`oracle`: attention written out in float64 with plain torch, independent of attnkit
  (the dense "math" every backend is compared with).
- :func:`naive_low_precision` and :func:`assert_low_precision_close`: the rule for float16 /
  bfloat16 — a backend's error against the float64 oracle must be within ``factor`` (2 for
  outputs, 3 for gradients) times the error of the same math done naively in that precision,
  plus a floor of a few roundings at the answer's magnitude (see ``OUTPUT_ULPS``).

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
# engine → the id of its Python-engine mode (see the module docstring)
PYTHON_MODES = {"tiled": "tiled[python]", "decode": "decode[python]"}
MODE_MODULES = ("test_api.py", "test_properties.py", "test_course_examples.py",
                "test_api_reliability.py", "masks/test_flash.py")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "native_engine: tiled/decode on the native kernel only")
    config.addinivalue_line("markers", "python_engine: tiled/decode with ATTNKIT_NATIVE=0")


def backend_params(names: list[str]) -> list[Any]:
    """``names`` with each engine of ``PYTHON_MODES`` as two modes: native, then Python."""
    out: list[Any] = []
    for n in names:
        if n in PYTHON_MODES:
            out.append(pytest.param(n, id=n, marks=pytest.mark.native_engine))
            out.append(pytest.param(n, id=PYTHON_MODES[n], marks=pytest.mark.python_engine))
        else:
            out.append(n)
    return out


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test taking ``backend`` runs once per registered backend (unless the test
    parametrises ``backend`` itself)."""
    own = any("backend" in str(m.args[0]).replace(" ", "").split(",")
              for m in metafunc.definition.iter_markers("parametrize") if m.args)
    if "backend" in metafunc.fixturenames and not own:
        path = metafunc.definition.path.as_posix()
        modes = any(path.endswith("tests/" + f) for f in MODE_MODULES)
        metafunc.parametrize("backend", backend_params(BACKENDS) if modes else BACKENDS)


@pytest.fixture(autouse=True)
def _engine_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Put ``tiled``/``decode`` in the mode the test's parameter names (module docstring)."""
    if request.node.get_closest_marker("python_engine"):
        monkeypatch.setenv("ATTNKIT_NATIVE", "0")
    elif request.node.get_closest_marker("native_engine"):
        from attnkit.backends import decode, native, tiled

        if not native.available():
            pytest.skip(f"native kernel unavailable: {native.why_unavailable()}")

        def python_engine(p: Any) -> Any:
            pytest.skip("the native kernel cannot run this call (the [python] mode runs it): "
                        + "; ".join(tiled.native_reasons(p)))

        monkeypatch.setattr(tiled, "python_attention", python_engine)
        monkeypatch.setattr(decode, "_decode", python_engine)


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


# ------------------------------------------------------------------- tolerance margins
def log_margin(what: str, dtype: torch.dtype, err: float, budget: float) -> None:
    """With ``ATTNKIT_TOLERANCE_LOG=path``, append one JSON line per comparison (the test, what
    was compared, error, budget) — ``python tests/tolerance_report.py path`` lists the
    tightest, to audit the tolerances on a new CPU before a failure does."""
    path = os.environ.get("ATTNKIT_TOLERANCE_LOG")
    if path:
        import json

        with open(path, "a") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "?"),
                                "what": what, "dtype": str(dtype), "err": err,
                                "budget": budget}) + "\n")


if os.environ.get("ATTNKIT_TOLERANCE_LOG"):
    _assert_close = torch.testing.assert_close

    def _logged_assert_close(actual: Any, expected: Any, *a: Any, **kw: Any) -> None:
        atol, rtol = kw.get("atol"), kw.get("rtol")
        if (isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor)
                and atol is not None and rtol is not None and actual.is_floating_point()
                and actual.shape == expected.shape and actual.numel()):
            d = (actual.double() - expected.double()).abs()
            allowed = atol + rtol * expected.double().abs()
            ok = torch.isfinite(d)
            if ok.any():
                i = (d[ok] / allowed[ok].clamp_min(1e-300)).argmax()
                log_margin(str(kw.get("msg") or "assert_close"), actual.dtype,
                           d[ok][i].item(), allowed[ok][i].item())
        _assert_close(actual, expected, *a, **kw)

    torch.testing.assert_close = _logged_assert_close


def rounding_floor(ref64: torch.Tensor, dtype: torch.dtype, ulps: float,
                   magnitude: float | None = None) -> float:
    """``ulps`` roundings of the compute type at the reference's largest magnitude, plus the
    result's own final rounding (half an ulp of ``dtype``, as flash-attn's tests allow): the
    noise any correct kernel carries, however lucky the naive reference was. The kernels
    compute in float32 at least (the numerical contract), so the unit is float32's epsilon
    for float32, bfloat16 and float16 results and float64's for float64. ``magnitude``
    (default: the reference's largest) is the scale the rounding is relative to where the
    answer is a cancellation of larger terms."""
    if magnitude is None:
        magnitude = ref64.abs().max().item() if ref64.numel() else 0.0
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    return (ulps * torch.finfo(compute).eps + 0.5 * torch.finfo(dtype).eps) * magnitude


# The floors, in float32 roundings (see rounding_floor). A ratio of two maxima of rounding noise is
# itself noisy where both are a few ulps (float32: the naive reference is sometimes lucky;
# on an AVX-512 Xeon a dv summed over 300 keys measured 6.4x the naive error, 7 ulps), and
# for float64 the naive reference is the oracle itself, so each budget adds a floor — as
# flash-attn's tests add 2 roundings of the reference to 2x the low-precision error, and
# PyTorch's SDPA tests take max(1e-5, fudge x low-precision error) with fudge factors of 4
# (output) to 160 (dq). An output is a weighted mean over the keys: 8 roundings (about the
# 1e-6 these tests allowed before at unit scale). A gradient is a sum over a row or a column
# of the scores (dq over the keys, dk and dv over the queries), whose rounding grows like
# the square root of its length: 16 for the ~300-long sums the suite uses.
OUTPUT_ULPS = 8.0
GRAD_ULPS = 16.0


def assert_low_precision_close(got: torch.Tensor, ref_lowp: torch.Tensor, ref64: torch.Tensor,
                               *, factor: float = 2.0, ulps: float = OUTPUT_ULPS,
                               magnitude: float | None = None, what: str = "output") -> None:
    """A low-precision result must be within ``factor`` × the error that the naive
    low-precision reference makes against the float64 reference, plus ``ulps`` roundings
    of the compute type at the reference's magnitude (:func:`rounding_floor`)."""
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    err = max_err(got, ref64)
    naive = max_err(ref_lowp, ref64)
    if got.dtype == torch.float64:   # the naive reference is the oracle: the floor is all
        ulps *= 2
    floor = rounding_floor(ref64, got.dtype, ulps, magnitude)
    budget = factor * naive + floor
    log_margin(what, got.dtype, err, budget)
    assert err <= budget, (
        f"{what}: error {err:.3g} vs float64 exceeds {factor}× the naive {got.dtype} "
        f"reference's error ({naive:.3g}) + {ulps:g} roundings ({floor:.3g}): budget "
        f"{budget:.3g}")


def assert_low_precision_grad_close(got: torch.Tensor, ref_lowp: torch.Tensor,
                                    ref64: torch.Tensor, *, what: str,
                                    magnitude: float | None = None) -> None:
    """:func:`assert_low_precision_close` for a gradient: 3× the naive error + GRAD_ULPS."""
    assert_low_precision_close(got, ref_lowp, ref64, factor=3.0, ulps=GRAD_ULPS,
                               magnitude=magnitude, what=what)


def randn(*shape: int, dtype: torch.dtype = torch.float64, **kw: Any) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, **kw)
