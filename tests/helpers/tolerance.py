"""The rule for float16 / bfloat16 (DESIGN's testing rules): a backend's error against the
float64 oracle must be within ``factor`` (2 for outputs, 3 for gradients) times the error of
the same math done naively in that precision (:func:`helpers.oracle.naive_low_precision`),
plus a floor of a few roundings at the answer's magnitude (see ``OUTPUT_ULPS``).

With ``ATTNKIT_TOLERANCE_LOG=path`` every comparison appends its margin to ``path``
(:func:`log_margin`; conftest also routes ``torch.testing.assert_close`` through
:func:`install_assert_close_log`); ``python tests/helpers/tolerance_report.py path`` lists the
tightest.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


# ------------------------------------------------------------------- tolerance margins
def log_margin(what: str, dtype: torch.dtype, err: float, budget: float) -> None:
    """With ``ATTNKIT_TOLERANCE_LOG=path``, append one JSON line per comparison (the test, what
    was compared, error, budget) — ``python tests/helpers/tolerance_report.py path`` lists the
    tightest, to audit the tolerances on a new CPU before a failure does."""
    path = os.environ.get("ATTNKIT_TOLERANCE_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "?"),
                                "what": what, "dtype": str(dtype), "err": err,
                                "budget": budget}) + "\n")


def install_assert_close_log() -> None:
    """Make ``torch.testing.assert_close`` (with explicit atol and rtol) log its margin too."""
    assert_close = torch.testing.assert_close

    def logged_assert_close(actual: Any, expected: Any, *a: Any, **kw: Any) -> None:
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
        assert_close(actual, expected, *a, **kw)

    torch.testing.assert_close = logged_assert_close


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
